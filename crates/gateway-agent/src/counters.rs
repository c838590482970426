//! Counters many threads bump on the hot path: one cache line per shard, a thread always
//! bumps the same shard, and readers sum the shards. They are flushed to the `metrics`
//! crate by the agent's background task, so the hot path never touches a registry.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

const SHARDS: usize = 16;

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed) % SHARDS;
}

/// A counter sharded by thread.
#[derive(Debug, Default)]
pub struct Sharded {
    shards: [CachePadded<AtomicU64>; SHARDS],
}

impl Sharded {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        let i = SHARD.with(|s| *s);
        self.shards[i].fetch_add(n, Ordering::Relaxed);
    }

    /// Adds one.
    #[inline]
    pub fn incr(&self) {
        self.add(1);
    }

    /// The total.
    pub fn get(&self) -> u64 {
        self.shards.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

/// What happened to decisions of one rule, and the store traffic they caused.
#[derive(Debug, Default)]
pub struct RuleCounters {
    /// Admitted from a local lease, without a network call.
    pub admitted_lease: Sharded,
    /// Admitted by an exact per-request call.
    pub admitted_exact: Sharded,
    /// Admitted because the store was unreachable and the rule fails open.
    pub admitted_fail_open: Sharded,
    /// Admitted by the local emergency limit while the store was unreachable.
    pub admitted_emergency: Sharded,
    /// Denied (429): the bucket is empty.
    pub denied: Sharded,
    /// Refused because the store was unreachable and the rule fails closed (503).
    pub unavailable: Sharded,
    /// Store calls that failed or timed out.
    pub store_errors: Sharded,
    /// Times a key switched to its local emergency limit.
    pub emergency_activations: Sharded,
    /// Store calls made (acquire, release, exact).
    pub store_calls: Sharded,
    /// Tokens granted to this agent in leases.
    pub lease_tokens_granted: Sharded,
    /// Tokens this agent returned.
    pub lease_tokens_returned: Sharded,
    /// Acquires that granted something.
    pub lease_grants: Sharded,
    /// Releases sent.
    pub lease_returns: Sharded,
}

/// A snapshot of [`RuleCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    /// See [`RuleCounters::admitted_lease`].
    pub admitted_lease: u64,
    /// See [`RuleCounters::admitted_exact`].
    pub admitted_exact: u64,
    /// See [`RuleCounters::admitted_fail_open`].
    pub admitted_fail_open: u64,
    /// See [`RuleCounters::admitted_emergency`].
    pub admitted_emergency: u64,
    /// See [`RuleCounters::denied`].
    pub denied: u64,
    /// See [`RuleCounters::unavailable`].
    pub unavailable: u64,
    /// See [`RuleCounters::store_errors`].
    pub store_errors: u64,
    /// See [`RuleCounters::emergency_activations`].
    pub emergency_activations: u64,
    /// See [`RuleCounters::store_calls`].
    pub store_calls: u64,
    /// See [`RuleCounters::lease_tokens_granted`].
    pub lease_tokens_granted: u64,
    /// See [`RuleCounters::lease_tokens_returned`].
    pub lease_tokens_returned: u64,
    /// See [`RuleCounters::lease_grants`].
    pub lease_grants: u64,
    /// See [`RuleCounters::lease_returns`].
    pub lease_returns: u64,
}

impl RuleStats {
    /// Every admission, whatever its path.
    pub fn admitted(&self) -> u64 {
        self.admitted_lease
            + self.admitted_exact
            + self.admitted_fail_open
            + self.admitted_emergency
    }

    /// Every decision.
    pub fn decisions(&self) -> u64 {
        self.admitted() + self.denied + self.unavailable
    }
}

impl RuleCounters {
    /// A snapshot.
    pub fn stats(&self) -> RuleStats {
        RuleStats {
            admitted_lease: self.admitted_lease.get(),
            admitted_exact: self.admitted_exact.get(),
            admitted_fail_open: self.admitted_fail_open.get(),
            admitted_emergency: self.admitted_emergency.get(),
            denied: self.denied.get(),
            unavailable: self.unavailable.get(),
            store_errors: self.store_errors.get(),
            emergency_activations: self.emergency_activations.get(),
            store_calls: self.store_calls.get(),
            lease_tokens_granted: self.lease_tokens_granted.get(),
            lease_tokens_returned: self.lease_tokens_returned.get(),
            lease_grants: self.lease_grants.get(),
            lease_returns: self.lease_returns.get(),
        }
    }

    /// Publishes the totals to the installed `metrics` recorder, labelled by rule.
    pub fn publish(&self, rule: &str) {
        let s = self.stats();
        let rule = rule.to_owned();
        for (outcome, v) in [
            ("admitted_lease", s.admitted_lease),
            ("admitted_exact", s.admitted_exact),
            ("admitted_fail_open", s.admitted_fail_open),
            ("admitted_emergency", s.admitted_emergency),
            ("denied", s.denied),
            ("unavailable", s.unavailable),
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
        ] {
            metrics::counter!(name, "rule" => rule.clone()).absolute(v);
        }
    }
}
