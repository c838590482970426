//! Counters many threads bump on the hot path, without an atomic read-modify-write.
//!
//! Each live thread owns one slot (recycled when the thread exits), and a rule's counters
//! hold one cache line per slot with every counter of that rule. A slot has one writer,
//! so a bump is a plain load and store; readers sum the slots. Threads beyond
//! [`SLOTS`] share an overflow line bumped with `fetch_add`. The background task
//! publishes the sums to the `metrics` crate, so the hot path never touches a registry.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

use crate::redis_store::ErrorKind;

/// Threads with a slot of their own.
pub(crate) const SLOTS: usize = 64;

static NEXT: AtomicUsize = AtomicUsize::new(0);
static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

struct Slot(usize);

impl Slot {
    fn take() -> Self {
        let reused = FREE.lock().ok().and_then(|mut f| f.pop());
        Self(reused.unwrap_or_else(|| NEXT.fetch_add(1, Ordering::Relaxed).min(SLOTS)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.0 < SLOTS
            && let Ok(mut free) = FREE.lock()
        {
            free.push(self.0);
        }
    }
}

thread_local! {
    static SLOT: Slot = Slot::take();
}

/// What is counted per rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum Counter {
    /// Admitted from a local lease, without a network call.
    AdmittedLease,
    /// Admitted by an exact per-request call.
    AdmittedExact,
    /// Admitted because the store was unreachable and the rule fails open.
    AdmittedFailOpen,
    /// Admitted by the local emergency limit while the store was unreachable.
    AdmittedEmergency,
    /// Denied (429): the bucket is empty.
    Denied,
    /// Refused because the store was unreachable and the rule fails closed (503).
    Unavailable,
    /// Store calls that failed or timed out.
    StoreErrors,
    /// Times a key switched to its local emergency limit.
    EmergencyActivations,
    /// Store calls made (acquire, release, exact).
    StoreCalls,
    /// Tokens granted to this agent in leases.
    LeaseTokensGranted,
    /// Tokens this agent returned.
    LeaseTokensReturned,
    /// Acquires that granted something.
    LeaseGrants,
    /// Releases sent.
    LeaseReturns,
    /// Releases of tokens the agent was not spending, or held beyond its share.
    Reclaims,
    /// Would have been denied (429), admitted because the rule is in shadow mode.
    ShadowDenied,
    /// Would have been refused as unavailable (503), admitted in shadow mode.
    ShadowUnavailable,
    /// Admitted from the agent's seat of the rule's local share, without the store.
    AdmittedLocal,
}

const KINDS: usize = 17;

/// The counters of one rule.
#[derive(Debug)]
pub(crate) struct RuleCounters {
    slots: Box<[CachePadded<[AtomicU64; KINDS]>]>,
}

impl Default for RuleCounters {
    fn default() -> Self {
        Self {
            slots: (0..=SLOTS)
                .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }
}

impl RuleCounters {
    /// Adds `n` to `counter`.
    #[inline]
    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let slot = SLOT.try_with(|s| s.0).unwrap_or(SLOTS);
        let c = &self.slots[slot][counter as usize];
        if slot < SLOTS {
            // This thread is the slot's only writer.
            c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        } else {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Adds one to `counter`.
    #[inline]
    pub(crate) fn incr(&self, counter: Counter) {
        self.add(counter, 1);
    }

    /// The total of `counter`.
    pub(crate) fn get(&self, counter: Counter) -> u64 {
        self.slots
            .iter()
            .map(|s| s[counter as usize].load(Ordering::Relaxed))
            .sum()
    }

    /// A snapshot.
    pub(crate) fn stats(&self) -> RuleStats {
        use Counter::*;
        RuleStats {
            admitted_lease: self.get(AdmittedLease),
            admitted_exact: self.get(AdmittedExact),
            admitted_fail_open: self.get(AdmittedFailOpen),
            admitted_emergency: self.get(AdmittedEmergency),
            denied: self.get(Denied),
            unavailable: self.get(Unavailable),
            store_errors: self.get(StoreErrors),
            emergency_activations: self.get(EmergencyActivations),
            store_calls: self.get(StoreCalls),
            lease_tokens_granted: self.get(LeaseTokensGranted),
            lease_tokens_returned: self.get(LeaseTokensReturned),
            lease_grants: self.get(LeaseGrants),
            lease_returns: self.get(LeaseReturns),
            reclaims: self.get(Reclaims),
            shadow_denied: self.get(ShadowDenied),
            shadow_unavailable: self.get(ShadowUnavailable),
            admitted_local: self.get(AdmittedLocal),
        }
    }

    /// Publishes the totals to the installed `metrics` recorder, labelled by rule.
    pub(crate) fn publish(&self, rule: &str) {
        let s = self.stats();
        let rule = rule.to_owned();
        for (outcome, v) in [
            ("admitted_lease", s.admitted_lease),
            ("admitted_local", s.admitted_local),
            ("admitted_exact", s.admitted_exact),
            ("admitted_fail_open", s.admitted_fail_open),
            ("admitted_emergency", s.admitted_emergency),
            ("denied", s.denied),
            ("unavailable", s.unavailable),
            ("shadow_denied", s.shadow_denied),
            ("shadow_unavailable", s.shadow_unavailable),
        ] {
            metrics::counter!("leasehold_decisions_total", "rule" => rule.clone(), "outcome" => outcome)
                .absolute(v);
        }
        for (name, v) in [
            ("leasehold_store_errors_total", s.store_errors),
            (
                "leasehold_emergency_activations_total",
                s.emergency_activations,
            ),
            ("leasehold_store_calls_total", s.store_calls),
            (
                "leasehold_lease_tokens_granted_total",
                s.lease_tokens_granted,
            ),
            (
                "leasehold_lease_tokens_returned_total",
                s.lease_tokens_returned,
            ),
            ("leasehold_lease_grants_total", s.lease_grants),
            ("leasehold_lease_returns_total", s.lease_returns),
            ("leasehold_reclaims_total", s.reclaims),
        ] {
            metrics::counter!(name, "rule" => rule.clone()).absolute(v);
        }
    }
}

/// Store errors by kind, for the whole agent (errors are rare: a plain `fetch_add`).
#[derive(Debug, Default)]
pub(crate) struct ErrorCounts([AtomicU64; ErrorKind::ALL.len()]);

impl ErrorCounts {
    /// Adds one error of `kind`.
    pub(crate) fn incr(&self, kind: ErrorKind) {
        self.0[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Errors of `kind` so far.
    pub(crate) fn get(&self, kind: ErrorKind) -> u64 {
        self.0[kind as usize].load(Ordering::Relaxed)
    }

    /// Publishes `leasehold_store_errors_by_kind_total{kind}`.
    pub(crate) fn publish(&self) {
        for kind in ErrorKind::ALL {
            metrics::counter!("leasehold_store_errors_by_kind_total", "kind" => kind.as_str())
                .absolute(self.get(kind));
        }
    }
}

/// A snapshot of a rule's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    /// Admitted from a local lease, without a network call.
    pub admitted_lease: u64,
    /// Admitted by an exact per-request call.
    pub admitted_exact: u64,
    /// Admitted because the store was unreachable and the rule fails open.
    pub admitted_fail_open: u64,
    /// Admitted by the local emergency limit while the store was unreachable.
    pub admitted_emergency: u64,
    /// Denied (429): the bucket is empty.
    pub denied: u64,
    /// Refused because the store was unreachable and the rule fails closed (503).
    pub unavailable: u64,
    /// Store calls that failed or timed out.
    pub store_errors: u64,
    /// Times a key switched to its local emergency limit.
    pub emergency_activations: u64,
    /// Store calls made (acquire, release, exact).
    pub store_calls: u64,
    /// Tokens granted to this agent in leases.
    pub lease_tokens_granted: u64,
    /// Tokens this agent returned.
    pub lease_tokens_returned: u64,
    /// Acquires that granted something.
    pub lease_grants: u64,
    /// Releases sent.
    pub lease_returns: u64,
    /// Releases of tokens the agent was not spending, or held beyond its share.
    pub reclaims: u64,
    /// Would have been denied (429), admitted because the rule is in shadow mode.
    pub shadow_denied: u64,
    /// Would have been refused as unavailable (503), admitted in shadow mode.
    pub shadow_unavailable: u64,
    /// Admitted from the agent's seat of the rule's local share, without the store.
    pub admitted_local: u64,
}

impl RuleStats {
    /// Every admission, whatever its path (shadow mode's would-be refusals included:
    /// they were let through).
    pub fn admitted(&self) -> u64 {
        self.admitted_lease
            + self.admitted_local
            + self.admitted_exact
            + self.admitted_fail_open
            + self.admitted_emergency
            + self.shadow_denied
            + self.shadow_unavailable
    }

    /// Every decision.
    pub fn decisions(&self) -> u64 {
        self.admitted() + self.denied + self.unavailable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn no_increment_is_lost_across_many_short_lived_threads() {
        let c = Arc::new(RuleCounters::default());
        for _ in 0..4 {
            std::thread::scope(|s| {
                for _ in 0..100 {
                    let c = c.clone();
                    s.spawn(move || {
                        for _ in 0..1000 {
                            c.incr(Counter::Denied);
                        }
                        c.add(Counter::StoreCalls, 2);
                    });
                }
            });
        }
        assert_eq!(c.get(Counter::Denied), 400_000);
        assert_eq!(c.get(Counter::StoreCalls), 800);
    }
}
