//! The `Limiter`: what a gateway calls on every request.
//!
//! **Hot path.** `check` looks the key up in a lock-free map (by borrowed rule and
//! subject bytes: no allocation), reads the clock, and takes the cost from the key's
//! local lease with one compare-and-swap. No lock, no await, no tracing. When the lease
//! falls under its low-water mark, the key is handed to the background driver, which
//! leases more (sized from the key's measured demand) before the lease runs out.
//!
//! **Slow path.** A key with no usable lease takes its per-key driver lock (so a key has at
//! most one store call in flight, and sequence numbers reach the store in order), looks
//! again (a refill may have landed meanwhile), then either leases (hot keys) or makes one
//! exact call (cold keys), within the rule's timeout. An empty bucket is remembered until
//! the time the store named (negative cache): denials in between cost no network call.
//! Store failures follow the rule's failure policy, through per-shard circuit breakers
//! and bulkheads, so a dead shard costs its keys one timeout and then nothing, and never
//! stalls the keys of other shards.
//!
//! **Background.** Prefetches leases, returns the unspent tokens of keys that went idle
//! (and makes them cold again), renews leases about to expire, forgets idle cold keys,
//! publishes counters to `metrics`, and reloads the rules file when it changes.
//!
//! Files, by concern: this one holds the public API and the limiter's shared state;
//! `decide` the local decision (the hot path), `keys` and `keymap` the keys, `table` the
//! rules, `seats` the local share, `store_path` and `call` a decision on the store (with
//! `batch` for exact decisions batched per shard, `route` for split keys), `degraded`
//! the failure policies, `all` several checks all or nothing, `background` the loop,
//! `builder` the configuration and start-up, `health` readiness.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use leasehold_core::PolicyConfig;
use leasehold_core::key::SubjectError;
use leasehold_core::model::AgentId;
use leasehold_core::rule::BucketParams;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout_at};

use crate::counters::{ErrorCounts, RuleStats};
use crate::redis_store::ErrorKind;
use crate::rules::UnknownRule;
use crate::store::Store;
use crate::telemetry::once_per;

mod all;
mod background;
mod batch;
mod builder;
mod call;
mod check;
mod decide;
mod degraded;
mod health;
mod keymap;
mod keys;
mod rate;
mod route;
mod seats;
mod store_path;
mod table;

use batch::ExactBatch;
/// The breakers of the store's shards, each with its queue of exact decisions.
type Breakers = crate::breaker::Breakers<ExactBatch>;
pub use builder::{BuildError, LimiterBuilder, LimiterConfig};
pub use check::{Check, RuleRef};
use decide::Local;
pub use health::Health;
use keys::{KeyRef, KeyState};
#[cfg(feature = "tower")]
pub(crate) use table::RuleEntry;
use table::RuleTable;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// How often the shard map behind the breakers is read again.
const TOPOLOGY_EVERY: Duration = Duration::from_secs(5);

/// One decision in this many (per thread) is timed for `leasehold_decision_seconds`.
pub(crate) const SAMPLE_EVERY: u64 = 64;

thread_local! {
    static SAMPLE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The outcome of a check. Being limited is an outcome, not an error.
///
/// Deliberately exhaustive: a caller's `match` must say what each outcome means for the
/// request (a wildcard arm would have to guess allow or deny).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Go ahead.
    Allowed {
        /// Tokens left where this one came from (the local lease, or the global bucket
        /// on the exact path); 0 when admitted without the store. For a quota header
        /// after a leased admission see [`Limiter::quota_left`] (`check_all_each` and
        /// the HTTP layer report that).
        remaining: u64,
        /// How it was admitted.
        via: Admission,
    },
    /// The bucket is empty: answer 429. `retry_after` is when `cost` tokens can exist,
    /// never zero.
    Denied {
        /// How long to wait.
        retry_after: Duration,
    },
    /// The store is unreachable and the rule fails closed: answer 503.
    Unavailable {
        /// When the limiter will try the store again.
        retry_after: Duration,
    },
}

/// How an admitted request was admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Admission {
    /// From the agent's local lease, without a network call.
    Lease,
    /// From the agent's seat of the rule's local share, without a network call.
    Local,
    /// By one exact call to the store.
    Exact,
    /// Without the store, which is unreachable, because the rule fails open.
    FailOpen,
    /// By the local emergency limit, while the store is unreachable.
    Emergency,
    /// The rule is in shadow mode and would have refused this request (429 or 503): it
    /// is let through and counted as `shadow_denied` or `shadow_unavailable`.
    Shadow,
}

impl Admission {
    /// Whether the store's count decided it (a lease, a seat, an exact call), so the
    /// tokens left are known; not for fail open, the emergency limit or shadow.
    pub fn is_metered(self) -> bool {
        matches!(self, Self::Lease | Self::Local | Self::Exact)
    }
}

/// A check that can never succeed as asked. Being rate limited is not one of these.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// No rule has this name.
    #[error(transparent)]
    UnknownRule(#[from] UnknownRule),
    /// The cost is larger than the rule's capacity: no wait would ever admit it.
    #[error("cost {cost} exceeds the capacity {capacity} of rule {rule}: it can never be admitted")]
    CostExceedsCapacity {
        /// The rule.
        rule: String,
        /// The cost asked.
        cost: u64,
        /// Capacity B.
        capacity: u64,
    },
    /// A cost of zero.
    #[error("cost must be at least 1")]
    ZeroCost,
    /// The subject cannot name a bucket.
    #[error(transparent)]
    Subject(#[from] SubjectError),
}

struct Inner {
    agent: AgentId,
    seq: AtomicU64,
    store: Store,
    rules: ArcSwap<RuleTable>,
    rules_file: Option<PathBuf>,
    rules_mtime: parking_lot::Mutex<Option<SystemTime>>,
    /// Rules a reload may not remove (see [`Limiter::require_rules`]).
    required: parking_lot::Mutex<Vec<String>>,
    keys: keymap::KeyMap,
    cells: Arc<keymap::Cells>,
    clock: quanta::Clock,
    base: u64,
    breakers: Breakers,
    error_kinds: ErrorCounts,
    /// The store's eviction policy may evict bucket keys (read at start, then every 30 s).
    evicting: AtomicBool,
    /// Decisions made without keeping the key's state (the map was full), and keys the
    /// sweep dropped to make room.
    keys_over_cap: AtomicU64,
    /// Set by [`Limiter::shutdown`]: no more leasing, and the background loop ends.
    shut: AtomicBool,
    /// Wakes the background loop to end.
    stop: Arc<tokio::sync::Notify>,
    keys_evicted: AtomicU64,
    /// Decisions on keys new to the full map and not seen recently, made without
    /// keeping their state.
    keys_first_seen: AtomicU64,
    prefetch: mpsc::Sender<Arc<KeyState>>,
    /// The keys that lease or hold tokens: what the sweep visits every tick (renewal,
    /// reclaim, demotion). Cold keys only need forgetting, in a pass over the whole map
    /// once a second (see `background.rs`): visiting 50 000 cold keys ten times a second
    /// was most of an agent's CPU under a long tail of keys.
    swept: parking_lot::Mutex<Vec<Arc<KeyState>>>,
    /// The next shard the sweep's pass over the whole map visits.
    sweep_cursor: AtomicUsize,
    /// The samples of the seconds since the last report written, and the seconds
    /// between reports (see [`crate::report`], cadence).
    report_log: parking_lot::Mutex<crate::report::Log>,
    report_every: AtomicU64,
    config: LimiterConfig,
    /// The part of `config` the lease-core policy reads.
    policy: PolicyConfig,
}

impl Inner {
    fn note_rules_mtime(&self) {
        if let Some(path) = &self.rules_file {
            *self.rules_mtime.lock() = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        }
    }
}

/// A rate limiter shared by every request of a gateway. Cloning it is cheap and every
/// clone shares the same leases and counters.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("agent", &self.inner.agent)
            .field("keys", &self.inner.keys.len())
            .finish()
    }
}

impl Limiter {
    /// Starts building a limiter.
    pub fn builder() -> LimiterBuilder {
        LimiterBuilder::default()
    }

    /// This agent's id, as the store sees it.
    pub fn agent_id(&self) -> AgentId {
        self.inner.agent
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// Store errors of `kind` this agent has seen.
    pub fn store_errors(&self, kind: ErrorKind) -> u64 {
        self.inner.error_kinds.get(kind)
    }

    /// The shards the breakers know, by primary address.
    pub fn shards(&self) -> Vec<String> {
        self.inner.breakers.shard_names()
    }

    #[inline]
    fn now_ns(&self) -> u64 {
        self.inner
            .clock
            .delta_as_nanos(self.inner.base, self.inner.clock.raw())
    }

    /// Decides whether `subject` may spend `cost` tokens of `rule`. Returns without
    /// awaiting anything when the key's local lease covers the cost.
    pub async fn check(
        &self,
        rule: &RuleRef,
        subject: impl AsRef<[u8]>,
        cost: u64,
    ) -> Result<Decision, CheckError> {
        self.check_named(rule.as_str(), subject.as_ref(), cost)
            .await
    }

    /// [`Limiter::check`] of a rule by its name (the decisions of several checks).
    async fn check_named(
        &self,
        rule: &str,
        subject: &[u8],
        cost: u64,
    ) -> Result<Decision, CheckError> {
        let (started, mut now) = (self.sample_start(), None);
        let d = match self.decide_hot(subject, rule, cost, &mut now) {
            Some(d) => d,
            None => match self.look_up(subject, rule, cost, now)? {
                Local::Decided(d) => d,
                Local::NeedsStore(ks, entry) => self.decide_with_store(ks, entry, cost).await,
            },
        };
        self.sample_end(started);
        Ok(d)
    }

    /// One decision in [`SAMPLE_EVERY`] per thread is timed, so the histogram costs the
    /// hot path a thread-local increment.
    #[inline]
    fn sample_start(&self) -> Option<u64> {
        let n = SAMPLE.with(|c| {
            let n = c.get().wrapping_add(1);
            c.set(n);
            n
        });
        n.is_multiple_of(SAMPLE_EVERY)
            .then(|| self.inner.clock.raw())
    }

    fn sample_end(&self, started: Option<u64>) {
        if let Some(t0) = started {
            let ns = self.inner.clock.delta_as_nanos(t0, self.inner.clock.raw());
            metrics::histogram!("leasehold_decision_seconds").record(ns as f64 / 1e9);
        }
    }

    /// Like [`Limiter::check`], but never waits: `None` when only the store could decide.
    pub fn try_check(
        &self,
        rule: &RuleRef,
        subject: impl AsRef<[u8]>,
        cost: u64,
    ) -> Result<Option<Decision>, CheckError> {
        self.try_check_bytes(subject.as_ref(), rule.as_str(), cost)
    }

    /// [`Limiter::try_check`], compiled once here rather than in each caller's crate, so
    /// the hot path's inlining does not depend on the caller.
    #[inline(never)]
    fn try_check_bytes(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
    ) -> Result<Option<Decision>, CheckError> {
        let (started, mut now) = (self.sample_start(), None);
        let d = match self.decide_hot(subject, rule, cost, &mut now) {
            Some(d) => Some(d),
            None => match self.look_up(subject, rule, cost, now)? {
                Local::Decided(d) => Some(d),
                Local::NeedsStore(..) => None,
            },
        };
        self.sample_end(started);
        Ok(d)
    }

    /// Like [`Limiter::check`], but when the bucket is empty waits (FIFO with the other
    /// waiters of the key, at most `max_wait`) for the tokens to arrive instead of
    /// denying. Waits longer than `max_wait`, or a full queue, give the denial at once.
    pub async fn check_wait(
        &self,
        rule: &RuleRef,
        subject: impl AsRef<[u8]>,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, CheckError> {
        let subject = subject.as_ref();
        let deadline = Instant::now() + max_wait;
        let first = self.check(rule, subject, cost).await?;
        let Decision::Denied { retry_after } = first else {
            return Ok(first);
        };
        let Some(ks) = self.key(rule.as_str(), subject) else {
            return Ok(first);
        };
        if retry_after > max_wait
            || ks.waiters.fetch_add(1, Ordering::AcqRel) >= self.inner.config.max_waiters
        {
            if retry_after <= max_wait {
                ks.waiters.fetch_sub(1, Ordering::AcqRel);
            }
            return Ok(first);
        }
        struct Leave<'a>(&'a AtomicUsize);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _leave = Leave(&ks.waiters);
        let Ok(_turn) = timeout_at(deadline, ks.queue.lock()).await else {
            return self.check(rule, subject, cost).await;
        };
        loop {
            match self.check(rule, subject, cost).await? {
                Decision::Denied { retry_after } if Instant::now() + retry_after <= deadline => {
                    tokio::time::sleep(retry_after).await;
                }
                d => return Ok(d),
            }
        }
    }

    fn key(&self, rule: &str, subject: &[u8]) -> Option<Arc<KeyState>> {
        self.inner.keys.get(&KeyRef::new(rule, subject))
    }

    /// About how many tokens `subject` has left under `rule`, for quota headers after a
    /// leased or seat admission (whose [`Decision::Allowed`] names only what the local
    /// lease or seat holds): the lease plus the global bucket's level at the store's last
    /// answer, refilled since at the rule's rate, at most its capacity, plus the agent's
    /// seat of the key (rules with a local share). An estimate: tokens other agents lease
    /// or hold in their seats are not seen. `None` for a key this agent does not hold.
    pub fn quota_left(&self, rule: &RuleRef, subject: impl AsRef<[u8]>) -> Option<u64> {
        let ks = self.key(rule.as_str(), subject.as_ref())?;
        Some(ks.quota_left(self.now_ns()))
    }

    /// The rules in force, as given (before a region's view of them).
    pub fn rules(&self) -> crate::rules::Rules {
        self.inner.rules.load().source.clone()
    }

    /// Counters of one rule.
    pub fn stats(&self, rule: &str) -> Result<RuleStats, UnknownRule> {
        Ok(self.inner.rules.load().get(rule)?.base.counters.stats())
    }

    /// Keys held in memory.
    pub fn keys_in_memory(&self) -> usize {
        self.inner.keys.len()
    }

    /// Keys dropped to keep the map within `max_keys` (idle cold keys, the longest idle
    /// of those sampled),
    /// and decisions made without keeping state because it was full.
    pub fn keys_evicted(&self) -> (u64, u64) {
        (
            self.inner.keys_evicted.load(Ordering::Relaxed),
            self.inner.keys_over_cap.load(Ordering::Relaxed),
        )
    }

    /// Decisions on keys the full map had not seen recently, made by one exact call
    /// without keeping state (seen again soon, a key takes an idle key's place).
    pub fn keys_first_seen(&self) -> u64 {
        self.inner.keys_first_seen.load(Ordering::Relaxed)
    }

    /// Graceful shutdown: stops the background loop (no refills, sweeps or reports
    /// after it), makes every later decision on this limiter an exact call (nothing is
    /// leased again), and returns every unspent leased token to the store.
    pub async fn shutdown(&self) {
        self.inner.shut.store(true, Ordering::Release);
        self.inner.stop.notify_one();
        // Seats stop at once and go back, so another agent may take them.
        for (name, seat) in self.seats() {
            self.give_seat_back(&name, &seat).await;
        }
        // The last totals, while the keys still lease: the coordinator's accounting covers
        // the agent's whole run (reports are otherwise written on the whole second).
        background::report(self.clone()).await;
        let keys: Vec<Arc<KeyState>> = {
            let mut all = Vec::with_capacity(self.inner.keys.len());
            self.inner.keys.for_each(|slot| all.push(slot.ks.clone()));
            all
        };
        for ks in keys {
            let entry = ks.entry.load_full();
            let mut driver = ks.driver.lock().await;
            let _ = self.release(&ks, &mut driver, &entry, true).await;
        }
    }

    /// The rule parameters the store receives for `rule` (for subjects without an
    /// override).
    pub fn bucket_params(&self, rule: &str) -> Result<BucketParams, UnknownRule> {
        Ok(self.inner.rules.load().get(rule)?.base.params)
    }

    /// The rule parameters the store receives for `subject` under `rule`: its override's
    /// when it has one.
    pub fn bucket_params_for(
        &self,
        rule: &RuleRef,
        subject: impl AsRef<[u8]>,
    ) -> Result<BucketParams, UnknownRule> {
        Ok(self
            .inner
            .rules
            .load()
            .get(rule.as_str())?
            .resolve(subject.as_ref())
            .params)
    }
}
