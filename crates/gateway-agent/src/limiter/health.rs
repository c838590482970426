//! Whether a limiter decides with its store (ready) or by its rules' failure policies
//! (degraded), for `/health` and readiness probes.

use crate::store::Store;

use super::Limiter;

/// What [`Limiter::health`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Health {
    /// Decisions use the store.
    Ready,
    /// Decisions that need the store follow each rule's failure policy, for this reason
    /// (leases already held are still spent).
    Degraded(String),
}

impl Health {
    /// `ready`, or `degraded: REASON`: one line for a probe's body or a log.
    pub fn line(&self) -> String {
        match self {
            Self::Ready => "ready".into(),
            Self::Degraded(why) => format!("degraded: {why}"),
        }
    }

    /// A readiness probe's answer: 200 and `ready`, or 503 and `degraded: REASON` (one
    /// line each), so an orchestrator sends traffic elsewhere while the store is out.
    pub fn probe(&self) -> (u16, String) {
        let status = match self {
            Self::Ready => 200,
            Self::Degraded(_) => 503,
        };
        (status, self.line() + "\n")
    }
}

impl Limiter {
    /// Whether decisions use the store now: not while it has not been reached (see
    /// [`LimiterBuilder::start_degraded`](super::LimiterBuilder::start_degraded)), is
    /// refused (an eviction policy that may lose buckets), is failing over (Sentinel), or
    /// while any shard's breaker is open.
    pub fn health(&self) -> Health {
        let Store::Redis(r) = &self.inner.store else {
            return Health::Ready;
        };
        if let Some(why) = r.not_reached() {
            return Health::Degraded(why);
        }
        if let Some(why) = r.refused() {
            return Health::Degraded(why);
        }
        if r.failing_over() {
            return Health::Degraded("store failover under way".into());
        }
        let open = self.inner.breakers.tripped();
        if !open.is_empty() {
            return Health::Degraded(format!(
                "store unreachable (breaker open: {})",
                open.join(", ")
            ));
        }
        Health::Ready
    }
}
