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
//! Files: this one holds the decision paths; `builder` the configuration and start-up,
//! `route` where a split key's calls go, `background` the loop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use leasehold_core::bucket::Level;
use leasehold_core::cell::refill_ns;
use leasehold_core::key::{BucketKey, SubjectError};
use leasehold_core::local::{LocalShare, SeatBucket, SeatRefusal, Tenure};
use leasehold_core::model::{AgentId, Op, Reply, Split};
use leasehold_core::rule::{BucketParams, FailurePolicy, Leasing, Rule};
use leasehold_core::{
    Around, Cell, KeyPolicy, PolicyConfig, Rate, Reclaim, Refill, SweepAction, Verdict,
};
use tokio::sync::{Mutex as AsyncMutex, mpsc};
use tokio::time::{Instant, timeout_at};

use crate::breaker::{BreakerConfig, Breakers, Refusal};
use crate::counters::{Counter, ErrorCounts, RuleCounters, RuleStats};
use crate::redis_store::{ErrorKind, RedisStore, StoreConfig, StoreError};
use crate::rules::{Overrides, Rules, RulesError, UnknownRule};
use crate::store::{EmbeddedStore, Store};

mod all;
mod background;
mod batch;
mod builder;
mod health;
mod keymap;
mod route;

use background::background;
pub(crate) use batch::ExactBatch;
pub use builder::{BuildError, LimiterBuilder, LimiterConfig};
pub use health::Health;
use route::{Dest, ROUTE_REFRESH_US, Route, dest, term_ending};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Whether a line that every request could repeat is due: true at most once per
/// `every_ns` for `slot` (the agent's clock, ns).
fn once_per(slot: &AtomicU64, now_ns: u64, every_ns: u64) -> bool {
    let now = now_ns.max(1);
    let last = slot.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= every_ns)
        && slot
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// How often the shard map behind the breakers is read again.
const TOPOLOGY_EVERY: Duration = Duration::from_secs(5);

/// One decision in this many (per thread) is timed for `leasehold_decision_seconds`.
pub const SAMPLE_EVERY: u64 = 64;

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

pub(crate) struct RuleEntry {
    /// The rule as the store keeps it (its global part when it has a local share).
    rule: Rule,
    /// This agent's seat of the rule's local share, and the rule's tenure.
    local: Option<(LocalShare, Arc<Seat>)>,
    pub(crate) params: BucketParams,
    pub(crate) name: Arc<str>,
    /// This rule's `RateLimit-Policy` item, `"NAME";q=B;w=SECONDS` (W: the seconds an
    /// empty bucket takes to fill), made once so a response needs no formatting.
    #[cfg_attr(
        not(feature = "tower"),
        expect(dead_code, reason = "read by the tower layer")
    )]
    pub(crate) policy: bytes::Bytes,
    counters: Arc<RuleCounters>,
    /// Shadow mode: refusals are counted as such and let through.
    shadow: bool,
    /// What a denial (429) counts as: `Denied`, or `ShadowDenied` in shadow mode.
    denied: Counter,
    /// What a refusal for an unreachable store (503) counts as.
    unavailable: Counter,
}

impl RuleEntry {
    /// The entry of `rule` as this agent's region uses it (see [`Rule::in_region`]).
    fn new(
        rule: &Rule,
        counters: &Arc<RuleCounters>,
        shadow_all: bool,
        region: Option<&str>,
        seat: Option<&Arc<Seat>>,
    ) -> Result<Arc<Self>, String> {
        let whole = rule.in_region(region)?;
        let shadow = shadow_all || whole.shadow();
        // The policy a client sees is the whole rule's; the store keeps its global part.
        let (b, r) = (whole.capacity().get(), whole.rate());
        let w = leasehold_core::refill_secs(b, r);
        let policy = format!("\"{}\";q={b};w={w}", whole.name());
        let local = whole.local().zip(seat.cloned());
        let rule = &whole.global_part();
        Ok(Arc::new(Self {
            local,
            policy: policy.into(),
            params: rule.bucket_params(),
            rule: rule.clone(),
            name: rule.name().as_str().into(),
            counters: counters.clone(),
            shadow,
            denied: if shadow {
                Counter::ShadowDenied
            } else {
                Counter::Denied
            },
            unavailable: if shadow {
                Counter::ShadowUnavailable
            } else {
                Counter::Unavailable
            },
        }))
    }

    /// The store key of `subject` under this rule: the region's bucket of a global key
    /// when the rule is region-fed.
    fn key(&self, subject: &[u8]) -> Result<BucketKey, SubjectError> {
        let key = BucketKey::new(self.rule.name(), subject)?;
        Ok(if self.rule.region_fed().is_some() {
            key.region_of()
        } else {
            key
        })
    }

    /// The decision the caller gets: in shadow mode a refusal is let through (it was
    /// counted as a shadow refusal where it was made).
    #[inline]
    fn enforce(&self, d: Decision) -> Decision {
        match d {
            Decision::Denied { .. } | Decision::Unavailable { .. } if self.shadow => {
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::Shadow,
                }
            }
            d => d,
        }
    }
}

/// A rule's overrides, and the entry of each by its name.
type OverrideEntries = (Overrides, FastMap<Box<str>, Arc<RuleEntry>>);

/// A rule and its per-subject overrides (which share its counters).
struct RuleSet {
    base: Arc<RuleEntry>,
    overrides: Option<OverrideEntries>,
}

impl RuleSet {
    /// The entry that applies to `subject`; hashes the subject only when the rule has
    /// `sha256:` overrides. Called on the cold path only: a key keeps its entry.
    fn resolve(&self, subject: &[u8]) -> &Arc<RuleEntry> {
        self.overrides
            .as_ref()
            .and_then(|(o, entries)| entries.get(o.resolve(subject)?.0))
            .unwrap_or(&self.base)
    }
}

struct RuleTable {
    by_name: FastMap<Box<str>, RuleSet>,
    /// The seats of the rules with a local share, claimed by the background loop.
    seats: FastMap<Box<str>, Arc<Seat>>,
}

/// A rule's local share as this agent holds it: the share it claims a seat of, and the
/// tenure the store confirmed (see [`leasehold_core::local`]).
pub(crate) struct Seat {
    share: LocalShare,
    tenure: Tenure,
    /// When a decision of the rule last wanted the seat (agent clock, to about
    /// [`SEAT_WANTED_GRAIN_NS`]): an idle gateway gives its seat back.
    wanted_ns: AtomicU64,
}

/// How stale [`Seat::wanted_ns`] may be: it is written at most once per this long, so
/// the threads deciding on a rule's keys do not all write one word.
const SEAT_WANTED_GRAIN_NS: u64 = 50_000_000;

impl Seat {
    #[inline]
    fn wanted(&self, now: u64) {
        if now.saturating_sub(self.wanted_ns.load(Ordering::Relaxed)) > SEAT_WANTED_GRAIN_NS {
            self.wanted_ns.store(now, Ordering::Relaxed);
        }
    }
}

impl RuleTable {
    /// The table of `rules` as `region` uses them; an error names a rule that does not fit
    /// the region.
    fn new(
        rules: &Rules,
        old: Option<&RuleTable>,
        shadow_all: bool,
        region: Option<&str>,
    ) -> Result<Self, String> {
        let mut by_name = FastMap::default();
        let mut seats = FastMap::default();
        for rule in rules.iter() {
            let name = rule.name().as_str();
            let counters = old
                .and_then(|t| t.by_name.get(name))
                .map_or_else(Default::default, |e| e.base.counters.clone());
            // A seat of the same share goes on; a changed one is claimed anew (its first
            // answer starts it empty).
            let seat = rule.local().map(|share| {
                old.and_then(|t| t.seats.get(name))
                    .filter(|s| s.share == share)
                    .cloned()
                    .unwrap_or_else(|| {
                        Arc::new(Seat {
                            share,
                            tenure: Tenure::new(),
                            wanted_ns: AtomicU64::new(0),
                        })
                    })
            });
            let overrides = match rules.overrides(name) {
                Some(o) => {
                    let mut entries = FastMap::default();
                    for (n, r) in o.iter() {
                        let e = RuleEntry::new(r, &counters, shadow_all, region, seat.as_ref())?;
                        entries.insert(n.into(), e);
                    }
                    Some((o.clone(), entries))
                }
                None => None,
            };
            let base = RuleEntry::new(rule, &counters, shadow_all, region, seat.as_ref())?;
            by_name.insert(name.into(), RuleSet { base, overrides });
            if let Some(seat) = seat {
                seats.insert(name.into(), seat);
            }
        }
        // Seats no longer in force stop at once (their records expire in the store).
        if let Some(old) = old {
            for (name, seat) in &old.seats {
                if !seats.get(name).is_some_and(|s| Arc::ptr_eq(s, seat)) {
                    seat.tenure.lost();
                }
            }
        }
        Ok(Self { by_name, seats })
    }

    fn get(&self, name: &str) -> Result<&RuleSet, UnknownRule> {
        self.by_name.get(name).ok_or_else(|| UnknownRule {
            name: name.chars().take(80).collect(),
            known: {
                let mut names: Vec<&str> = self.by_name.keys().map(AsRef::as_ref).collect();
                names.sort_unstable();
                names.join(", ")
            },
        })
    }
}

/// A key of the agent's map: rule name and subject, hashed in the same two pieces as the
/// borrowed [`KeyRef`]. The map's slot keeps the bytes inline when short (no pointer to
/// follow on a lookup).
#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyId {
    bytes: smallvec::SmallVec<[u8; 40]>,
    rule_len: usize,
}

impl KeyId {
    fn new(rule: &str, subject: &[u8]) -> Self {
        let mut bytes = smallvec::SmallVec::with_capacity(rule.len() + subject.len());
        bytes.extend_from_slice(rule.as_bytes());
        bytes.extend_from_slice(subject);
        Self {
            bytes,
            rule_len: rule.len(),
        }
    }
}

impl std::hash::Hash for KeyId {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        KeyRef::of(&self.bytes, self.rule_len).hash(h);
    }
}

/// A key borrowed: rule name and subject. Every key of the map hashes as one of these.
struct KeyRef<'a> {
    rule: &'a [u8],
    subject: &'a [u8],
}

impl std::hash::Hash for KeyRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write(self.rule);
        h.write(self.subject);
    }
}

impl<'a> KeyRef<'a> {
    fn new(rule: &'a str, subject: &'a [u8]) -> Self {
        Self {
            rule: rule.as_bytes(),
            subject,
        }
    }

    /// The key stored as `bytes`, the rule's name being the first `rule_len`.
    fn of(bytes: &'a [u8], rule_len: usize) -> Self {
        let (rule, subject) = bytes.split_at(rule_len);
        Self { rule, subject }
    }

    #[inline]
    fn matches(&self, key: &[u8], rule_len: usize) -> bool {
        let (rule, subject) = key.split_at(rule_len);
        bytes_eq(self.rule, rule) && bytes_eq(self.subject, subject)
    }
}

/// `a == b`, comparing slices of 4 to 16 bytes (most rule names and subjects) with two
/// overlapping word loads each instead of a call to `memcmp`.
#[inline]
fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let w8 = |s: &[u8], i: usize| <[u8; 8]>::try_from(&s[i..i + 8]).map_or(0, u64::from_ne_bytes);
    let w4 = |s: &[u8], i: usize| <[u8; 4]>::try_from(&s[i..i + 4]).map_or(0, u32::from_ne_bytes);
    match n {
        8..=16 => w8(a, 0) == w8(b, 0) && w8(a, n - 8) == w8(b, n - 8),
        4..=7 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        _ => a == b,
    }
}

/// What drives a key's store calls, touched only under its lock (one call at a time per
/// key): the policy (lease-core) and where calls go while the bucket is split.
#[derive(Debug, Default)]
struct Driver {
    policy: KeyPolicy,
    /// The split part this key's calls go to (boxed: most keys are never split).
    route: Option<Box<Route>>,
}

#[derive(Debug)]
struct Emergency {
    level: Level,
    rate: Rate,
    cap: u64,
    at_ns: u64,
}

/// One key's state. What the hot path reads is in its [`keymap::Hot`] cell, in an arena
/// shared with other keys; the rest is touched only off the hot path.
struct KeyState {
    cell: keymap::Cell,
    /// The key's bucket of this agent's seat, when its rule has a local share.
    seat: SeatBucket,
    counters: Arc<RuleCounters>,
    prefetching: AtomicBool,
    rule: Box<str>,
    bucket: BucketKey,
    slot: u16,
    /// What the local decision reads once the cell's lease and cached denial did not
    /// decide: the refill denial, a refused prefetch's wait, this agent's share (also
    /// the emergency limit's).
    refill: Refill,
    /// Tokens admitted without the store (emergency, fail-open, a leasing key's seat) not
    /// yet reported.
    without_store: AtomicU64,
    /// Tokens the global bucket had left at the store's last answer, and when (agent
    /// clock): with what the lease holds, the quota a leased admission reports.
    store_left: AtomicU64,
    store_left_at_ns: AtomicU64,
    last_io_ns: AtomicU64,
    driver: Arc<AsyncMutex<Driver>>,
    queue: AsyncMutex<()>,
    waiters: AtomicUsize,
    in_emergency: AtomicBool,
    /// Boxed: a key needs it only while its store is unreachable.
    emergency: parking_lot::Mutex<Option<Box<Emergency>>>,
    /// Made for one decision while the key map was full; never in the map, never leased.
    transient: bool,
    /// The rule, or the subject's override, in force for this key; replaced on reload.
    entry: ArcSwap<RuleEntry>,
    /// Exact decisions take the per-key path until then (the key was found split).
    batch_after_ns: AtomicU64,
    /// In [`Inner::swept`], the keys the sweep visits every tick.
    in_sweep: AtomicBool,
    /// A region's bucket of a global key, announced to the region's broker.
    announced: AtomicBool,
    /// The bucket is a region's (`lh:{RULE|SUBJECT|region}`).
    region: bool,
}

impl KeyState {
    /// The fields the hot path reads.
    #[inline]
    fn hot(&self) -> &keymap::Hot {
        self.cell.get()
    }

    /// How long a caller of `cost` is denied without the store, if the key's cached
    /// denial covers it.
    fn cached_wait(&self, cost: u64, now: u64) -> Option<u64> {
        (self.hot()).cached_wait(cost, now, self.entry.load().params.rate)
    }

    /// The store answered that the global bucket has `left` tokens.
    fn saw_store_left(&self, left: u64, now: u64) {
        self.store_left.store(left, Ordering::Relaxed);
        self.store_left_at_ns.store(now, Ordering::Relaxed);
    }

    /// About how many tokens the key has left for this agent's callers: what the lease
    /// holds plus what the global bucket had at the store's last answer, refilled since
    /// at the rule's rate, at most its capacity, plus what the agent's seat of the key
    /// holds when the rule has a local share. (Other agents' leases are not seen: on a
    /// key many agents lease, the bucket's own level is low while their leases hold
    /// tokens.)
    fn quota_left(&self, now: u64) -> u64 {
        let BucketParams { capacity, rate, .. } = self.entry.load().params;
        let at = self.store_left_at_ns.load(Ordering::Relaxed);
        let elapsed_us = now.saturating_sub(at) / 1000;
        let refilled = u128::from(elapsed_us) * u128::from(rate.tokens())
            / u128::from(rate.period_us().max(1));
        let left = u128::from(self.store_left.load(Ordering::Relaxed)) + refilled;
        let held = u128::from(self.hot().lease.held());
        (left + held).min(u128::from(capacity)) as u64 + self.seat_level(now)
    }

    /// What the key's bucket of this agent's seat holds now (0 without a seat).
    fn seat_level(&self, now: u64) -> u64 {
        let entry = self.entry.load();
        let Some((share, seat)) = &entry.local else {
            return 0;
        };
        seat.tenure
            .since(now)
            .map_or(0, |since| self.seat.level(share, now, since))
    }

    /// Whether the sweep visits this key every tick and the coordinator's report covers
    /// it: it leases or holds tokens, admitted without the store since the last report,
    /// or is a region's bucket used lately (its broker feeds the keys reported).
    fn active(&self, now: u64) -> bool {
        self.hot().leases()
            || self.hot().lease.held() > 0
            || self.without_store.load(Ordering::SeqCst) > 0
            || (self.region
                && now.saturating_sub(self.last_io_ns.load(Ordering::Relaxed))
                    < crate::report::REPORT_TTL_MS * 1_000_000)
    }

    /// How long the key has been idle, if it may leave the map to make room: inactive
    /// (no lease, no tokens held or unreported) and no caller waiting on it.
    fn idle_if_evictable(&self, now: u64) -> Option<u64> {
        (self.forgettable(now) && self.waiters.load(Ordering::Acquire) == 0)
            .then(|| now.saturating_sub(self.last_io_ns.load(Ordering::Relaxed)))
    }

    /// Whether forgetting the key loses nothing: inactive, and its seat bucket full again
    /// (a key not held is taken as full: forgetting a spent seat would mint tokens).
    fn forgettable(&self, now: u64) -> bool {
        !self.active(now) && self.seat.full_at(now)
    }

    fn new(
        cells: &Arc<keymap::Cells>,
        rule: &str,
        entry: &Arc<RuleEntry>,
        bucket: BucketKey,
        now: u64,
        transient: bool,
    ) -> Self {
        let region = bucket.is_region();
        Self {
            rule: rule.into(),
            cell: cells.take(
                entry.params.capacity,
                !transient && entry.rule.leasing() == Leasing::Lease,
                entry.shadow,
                entry.local.is_some() && !transient,
            ),
            seat: SeatBucket::new(),
            counters: entry.counters.clone(),
            slot: bucket.slot(),
            bucket,
            refill: Refill::new(),
            prefetching: AtomicBool::new(false),
            without_store: AtomicU64::new(0),
            store_left: AtomicU64::new(entry.params.capacity),
            store_left_at_ns: AtomicU64::new(now),
            last_io_ns: AtomicU64::new(now),
            driver: Arc::new(AsyncMutex::new(Driver::default())),
            queue: AsyncMutex::new(()),
            waiters: AtomicUsize::new(0),
            in_emergency: AtomicBool::new(false),
            emergency: parking_lot::Mutex::new(None),
            transient,
            entry: ArcSwap::new(entry.clone()),
            batch_after_ns: AtomicU64::new(0),
            announced: AtomicBool::new(false),
            in_sweep: AtomicBool::new(false),
            region,
        }
    }
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
    prefetch: mpsc::Sender<Arc<KeyState>>,
    /// The keys that lease or hold tokens: what the sweep visits every tick (renewal,
    /// reclaim, demotion). Cold keys only need forgetting, in a pass over the whole map
    /// once a second (see `background.rs`): visiting 50 000 cold keys ten times a second
    /// was most of an agent's CPU under a long tail of keys.
    swept: parking_lot::Mutex<Vec<Arc<KeyState>>>,
    /// The next shard the sweep's pass over the whole map visits.
    sweep_cursor: AtomicUsize,
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

/// What deciding without the store gave: a decision, or the key and rule whose decision
/// needs the store.
enum Local {
    Decided(Decision),
    NeedsStore(Arc<KeyState>, Arc<RuleEntry>),
}

/// The agent around a key's cell, for [`Cell::decide`]: the key's seat, its prefetch
/// queue, and whether it may wait for a refill (it leases, its shard's breaker is closed).
struct AgentAround<'a> {
    limiter: &'a Limiter,
    ks: &'a Arc<KeyState>,
}

impl Around for AgentAround<'_> {
    fn rate(&self) -> Rate {
        self.ks.entry.load().params.rate
    }

    fn seat(&mut self, cost: u64, now_ns: u64) -> Result<u64, u64> {
        Limiter::take_seat(self.ks, cost, now_ns)
    }

    fn refill(&mut self, now_ns: u64) -> bool {
        self.limiter.request_prefetch(self.ks, now_ns);
        self.ks.prefetching.load(Ordering::Acquire)
    }

    fn may_await_refill(&mut self, now_ns: u64) -> bool {
        let entry = self.ks.entry.load();
        // With the shard's breaker open the failure policy decides, as for any caller
        // the lease cannot cover.
        self.limiter.is_hot(self.ks, &entry)
            && !self.limiter.inner.breakers.is_open(self.ks.slot, now_ns)
    }
}

/// The store answered for `ks`: an emergency limit in force ends.
fn store_answered(ks: &KeyState) {
    if ks.in_emergency.swap(false, Ordering::AcqRel) {
        *ks.emergency.lock() = None;
    }
}

/// How long the store keeps a seat's record after a claim; claims renew it every
/// [`SEAT_RENEW_EVERY`], so a seat survives two lost renewals, and an agent that stops
/// renewing frees it within this time.
const SEAT_TTL_US: u64 = 3_000_000;
const SEAT_RENEW_EVERY: Duration = Duration::from_secs(1);
/// Taken off a tenure's end, as off a lease's (clock rate error between agent and store).
const SEAT_MARGIN_NS: u64 = 100_000_000;

#[inline]
fn denied(wait_ns: u64) -> Decision {
    Decision::Denied {
        retry_after: Duration::from_nanos(wait_ns.max(1)),
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
        subject: impl AsRef<[u8]>,
        rule: &str,
        cost: u64,
    ) -> Result<Decision, CheckError> {
        let (subject, started, mut now) = (subject.as_ref(), self.sample_start(), None);
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
        subject: impl AsRef<[u8]>,
        rule: &str,
        cost: u64,
    ) -> Result<Option<Decision>, CheckError> {
        self.try_check_bytes(subject.as_ref(), rule, cost)
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
        subject: impl AsRef<[u8]>,
        rule: &str,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, CheckError> {
        let subject = subject.as_ref();
        let deadline = Instant::now() + max_wait;
        let first = self.check(subject, rule, cost).await?;
        let Decision::Denied { retry_after } = first else {
            return Ok(first);
        };
        let Some(ks) = self.key(rule, subject) else {
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
            return self.check(subject, rule, cost).await;
        };
        loop {
            match self.check(subject, rule, cost).await? {
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
    pub fn quota_left(&self, rule: &str, subject: impl AsRef<[u8]>) -> Option<u64> {
        let ks = self.key(rule, subject.as_ref())?;
        Some(ks.quota_left(self.now_ns()))
    }

    /// `d` as the quota headers report it: an admission from the lease or the seat names
    /// its key's [`Limiter::quota_left`]; anything else stays as it is.
    fn with_quota(&self, ks: &KeyState, d: Decision) -> Decision {
        match d {
            Decision::Allowed {
                via: Admission::Lease,
                ..
            } => Decision::Allowed {
                remaining: ks.quota_left(self.now_ns()),
                via: Admission::Lease,
            },
            Decision::Allowed {
                via: Admission::Local,
                ..
            } => Decision::Allowed {
                remaining: ks.quota_left(self.now_ns()),
                via: Admission::Local,
            },
            d => d,
        }
    }

    /// The hot path, under the shard's read lock and touching no reference count: the
    /// local decision of a known key ([`Cell::decide`]). Sets `now` when it read the
    /// clock. `None`: the key is unknown, the cost invalid, or only the store decides.
    #[inline(always)]
    fn decide_hot(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
        now: &mut Option<u64>,
    ) -> Option<Decision> {
        self.inner
            .keys
            .with(&KeyRef::new(rule, subject), |slot| {
                let cell = slot.valid_for(cost)?;
                let t = self.now_ns();
                *now = Some(t);
                self.decide_local(cell, &slot.counters, &slot.ks, cost, t)
            })
            .flatten()
    }

    /// The key's local decision, counted: [`Cell::decide`] around this agent (its seat,
    /// its prefetch queue, its breakers). `None` when only the store can decide.
    #[inline(always)]
    fn decide_local(
        &self,
        cell: &Cell,
        counters: &RuleCounters,
        ks: &Arc<KeyState>,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        match cell.decide(&ks.refill, cost, now, &mut around) {
            Verdict::Lease { left } => {
                counters.incr(Counter::AdmittedLease);
                Some(Decision::Allowed {
                    remaining: left,
                    via: Admission::Lease,
                })
            }
            Verdict::Seat { left } => Some(self.seat_admitted(ks, cost, left)),
            Verdict::Denied { wait_ns, .. } => Some(if cell.shadow() {
                counters.incr(Counter::ShadowDenied);
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::Shadow,
                }
            } else {
                counters.incr(Counter::Denied);
                denied(wait_ns)
            }),
            Verdict::Store => None,
        }
    }

    /// For the HTTP layer: decides every check without waiting, all or nothing, or
    /// `None` when one of them needs the store (tokens taken by the others go back to
    /// their leases first, or are dropped if the lock that guards that is busy: that
    /// only under-admits). Each decided check comes with the entry that decided it.
    #[cfg(feature = "tower")]
    pub(crate) fn try_check_all_now(
        &self,
        checks: &[crate::http::Check],
        decided: &mut smallvec::SmallVec<[(Decision, Arc<RuleEntry>); 2]>,
    ) -> Result<bool, CheckError> {
        decided.clear();
        // (key, cost, the lease's epoch or None for the seat), as in `check_all_each`.
        type Taken = smallvec::SmallVec<[(Arc<KeyState>, u64, Option<u64>); 2]>;
        let mut taken: Taken = smallvec::SmallVec::new();
        let give_back = |taken: &mut Taken| {
            for (ks, cost, epoch) in taken.drain(..) {
                match epoch {
                    None => Self::refund_seat(&ks, cost),
                    Some(epoch) => {
                        if let Ok(_driver) = ks.driver.try_lock() {
                            ks.hot().lease.refund(cost, epoch);
                        }
                    }
                }
            }
        };
        for c in checks {
            let (subject, rule, cost) = (c.subject(), c.rule(), c.cost());
            // The hot path, as in `check`: a live key whose lease covers the cost.
            let spent = self.inner.keys.with(&KeyRef::new(rule, subject), |slot| {
                let hot = slot.leased_for(cost)?;
                let epoch = hot.lease.epoch();
                self.spend_leased(hot, &slot.counters, &slot.ks, cost, self.now_ns())
                    .map(|d| (d, slot.ks.clone(), epoch))
            });
            if let Some(Some((d, ks, epoch))) = spent {
                decided.push((self.with_quota(&ks, d), ks.entry.load_full()));
                taken.push((ks, cost, Some(epoch)));
                continue;
            }
            let looked = self.look_up(subject, rule, cost, None);
            match looked {
                Ok(Local::Decided(d)) => {
                    let entry = self.key(rule, subject).map(|ks| ks.entry.load_full());
                    let entry = match entry {
                        Some(e) => e,
                        None => self.inner.rules.load().get(rule)?.resolve(subject).clone(),
                    };
                    let refused = !matches!(d, Decision::Allowed { .. });
                    let mut d = d;
                    if let Decision::Allowed {
                        via: Admission::Local,
                        ..
                    } = d
                        && let Some(ks) = self.key(rule, subject)
                    {
                        d = self.with_quota(&ks, d);
                        taken.push((ks, cost, None));
                    }
                    decided.push((d, entry));
                    if refused {
                        give_back(&mut taken);
                        return Ok(true);
                    }
                }
                Ok(Local::NeedsStore(..)) => {
                    give_back(&mut taken);
                    decided.clear();
                    return Ok(false);
                }
                Err(e) => {
                    give_back(&mut taken);
                    return Err(e);
                }
            }
        }
        Ok(true)
    }

    /// The entry in force for `subject` under `rule` (its key's, or the rule table's).
    #[cfg(feature = "tower")]
    pub(crate) fn entry_for(&self, rule: &str, subject: &[u8]) -> Option<Arc<RuleEntry>> {
        if let Some(ks) = self.key(rule, subject) {
            return Some(ks.entry.load_full());
        }
        Some(
            self.inner
                .rules
                .load()
                .get(rule)
                .ok()?
                .resolve(subject)
                .clone(),
        )
    }

    /// The lease step of the local decision alone ([`Cell::spend`]), counted.
    #[inline]
    fn spend_leased(
        &self,
        cell: &Cell,
        counters: &RuleCounters,
        ks: &Arc<KeyState>,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        let Verdict::Lease { left } = cell.spend(cost, now, &ks.refill, &mut around)? else {
            return None;
        };
        counters.incr(Counter::AdmittedLease);
        Some(Decision::Allowed {
            remaining: left,
            via: Admission::Lease,
        })
    }

    /// What a caller finds on the store path once it holds the key's lock, or before
    /// it joins a batch: the lease, or the cached denial ([`Cell::recheck`]).
    fn recheck(
        &self,
        ks: &Arc<KeyState>,
        entry: &RuleEntry,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        match ks.hot().recheck(&ks.refill, cost, now, &mut around)? {
            Verdict::Lease { left } => {
                entry.counters.incr(Counter::AdmittedLease);
                Some(Decision::Allowed {
                    remaining: left,
                    via: Admission::Lease,
                })
            }
            Verdict::Denied { wait_ns, .. } => {
                entry.counters.incr(entry.denied);
                Some(denied(wait_ns))
            }
            Verdict::Seat { .. } | Verdict::Store => None,
        }
    }

    /// Everything the hot path does not cover: validation, new keys, the negative cache.
    /// `now`: the agent's clock if the caller read it already.
    fn look_up(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
        now: Option<u64>,
    ) -> Result<Local, CheckError> {
        let (existing, entry) = self.resolve(subject, rule, cost)?;
        let now = now.unwrap_or_else(|| self.now_ns());
        let keys = &self.inner.keys;
        if let Some(ks) = existing {
            // The hot path decided already, unless the key came or the rule changed
            // meanwhile.
            return Ok(
                match self.decide_local(ks.hot(), &ks.counters, &ks, cost, now) {
                    Some(d) => Local::Decided(d),
                    None => Local::NeedsStore(ks, entry),
                },
            );
        }
        let bucket = entry.key(subject)?;
        let (ks, placed) = keys.get_or_insert_with(
            KeyId::new(rule, subject),
            self.inner.config.max_keys,
            now,
            |transient| {
                Arc::new(KeyState::new(
                    &self.inner.cells,
                    rule,
                    &entry,
                    bucket,
                    now,
                    transient,
                ))
            },
        );
        match placed {
            keymap::Placed::Found | keymap::Placed::Inserted => {}
            keymap::Placed::Evicted => {
                self.inner.keys_evicted.fetch_add(1, Ordering::Relaxed);
            }
            // Full of keys that lease or wait (a flood of distinct subjects while every
            // sampled key is busy): this key is decided by one exact call without keeping
            // its state. Memory stays bounded whatever the callers send.
            keymap::Placed::Transient => {
                self.inner.keys_over_cap.fetch_add(1, Ordering::Relaxed);
                return Ok(Local::NeedsStore(ks, entry));
            }
        }
        if let Some(d) = self.decide_local(ks.hot(), &ks.counters, &ks, cost, now) {
            return Ok(Local::Decided(d));
        }
        // Another caller may have inserted it first, with the same entry.
        let entry = ks.entry.load_full();
        Ok(Local::NeedsStore(ks, entry))
    }

    /// What every decision checks first: the key if this agent holds it, and the rule
    /// entry in force for `subject` (the key's, else the rule table's); an unknown rule,
    /// a cost of 0 or above the capacity, or an empty subject is an error.
    fn resolve(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
    ) -> Result<(Option<Arc<KeyState>>, Arc<RuleEntry>), CheckError> {
        let rules = self.inner.rules.load();
        let set = rules.get(rule)?;
        let existing = self.inner.keys.get(&KeyRef::new(rule, subject));
        let entry = match &existing {
            Some(ks) => ks.entry.load_full(),
            None => set.resolve(subject).clone(),
        };
        let capacity = entry.params.capacity;
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        if cost > capacity {
            return Err(CheckError::CostExceedsCapacity {
                rule: rule.to_owned(),
                cost,
                capacity,
            });
        }
        if subject.is_empty() {
            return Err(SubjectError::Empty.into());
        }
        Ok((existing, entry))
    }

    /// Takes `cost` from the key's bucket of this agent's seat, if its rule has a local
    /// share, the agent holds a seat now, and the bucket covers it. Otherwise how long
    /// until it would (`u64::MAX`: never, no seat).
    fn spend_seat(&self, ks: &KeyState, cost: u64, now: u64) -> Result<Decision, u64> {
        Self::take_seat(ks, cost, now).map(|left| self.seat_admitted(ks, cost, left))
    }

    /// [`Limiter::spend_seat`] uncounted: the tokens the seat's bucket holds after.
    fn take_seat(ks: &KeyState, cost: u64, now: u64) -> Result<u64, u64> {
        if ks.transient {
            // Its bucket would be forgotten with it: a new one starts full.
            return Err(u64::MAX);
        }
        let entry = ks.entry.load();
        let Some((share, seat)) = &entry.local else {
            return Err(u64::MAX);
        };
        seat.wanted(now);
        let since = seat.tenure.since(now).ok_or(u64::MAX)?;
        match ks.seat.take(share, cost, now, since) {
            Ok(left) => Ok(left),
            Err(SeatRefusal::Short { wait_ns }) => Err(wait_ns),
            Err(SeatRefusal::NoSeat) => Err(u64::MAX),
        }
    }

    /// Counts an admission of `cost` by the key's seat, which holds `left` after.
    fn seat_admitted(&self, ks: &KeyState, cost: u64, left: u64) -> Decision {
        ks.counters.incr(Counter::AdmittedLocal);
        // A leasing key's report to the coordinator counts every admission; a cold
        // key's is not reported (its decisions are exact by construction).
        if ks.hot().leases() {
            ks.without_store.fetch_add(cost, Ordering::Relaxed);
        }
        Decision::Allowed {
            remaining: left,
            via: Admission::Local,
        }
    }

    /// Gives `cost` back to the key's seat bucket (another rule refused the request).
    fn refund_seat(ks: &KeyState, cost: u64) {
        if let Some((share, _)) = &ks.entry.load().local {
            ks.seat.refund(share, cost);
        }
    }

    fn request_prefetch(&self, ks: &Arc<KeyState>, now: u64) {
        if !ks.refill.may_prefetch(now) {
            return;
        }
        if !ks.prefetching.swap(true, Ordering::AcqRel)
            && self.inner.prefetch.try_send(ks.clone()).is_err()
        {
            ks.prefetching.store(false, Ordering::Release);
        }
    }

    fn is_hot(&self, ks: &KeyState, entry: &RuleEntry) -> bool {
        if ks.transient || self.inner.shut.load(Ordering::Relaxed) {
            return false;
        }
        match entry.rule.leasing() {
            Leasing::Lease => true,
            Leasing::Exact => false,
            Leasing::Auto => ks.hot().leases(),
        }
    }

    async fn decide_with_store(
        &self,
        ks: Arc<KeyState>,
        entry: Arc<RuleEntry>,
        cost: u64,
    ) -> Decision {
        // A key that leases reaches the store before its first lease, and a region's
        // bucket before its first report: from here on the sweep visits it every tick.
        if ks.hot().leases() || ks.region {
            self.track(&ks);
        }
        // A region's bucket the region's broker may not feed yet: tell it now rather than
        // with the next report.
        if entry.params.region.is_some()
            && !ks.announced.load(Ordering::Relaxed)
            && !ks.announced.swap(true, Ordering::Relaxed)
            && let Store::Redis(store) = &self.inner.store
        {
            let (store, key) = (store.clone(), ks.bucket.clone());
            tokio::spawn(async move {
                if let Err(e) = store.announce_region_key(&key).await {
                    tracing::debug!(error = %e, "announcing a region key to the broker failed");
                }
            });
        }
        let d = match self.consult_store(ks.clone(), entry.clone(), cost).await {
            // The seat may have refilled meanwhile; if not, the caller may come back when
            // it has, if that is sooner than the store's time.
            Decision::Denied { retry_after } if entry.local.is_some() => {
                match self.spend_seat(&ks, cost, self.now_ns()) {
                    Ok(d) => d,
                    Err(wait) => Decision::Denied {
                        retry_after: retry_after.min(Duration::from_nanos(wait.max(1))),
                    },
                }
            }
            d => d,
        };
        entry.enforce(d)
    }

    async fn consult_store(&self, ks: Arc<KeyState>, entry: Arc<RuleEntry>, cost: u64) -> Decision {
        let deadline = Instant::now() + entry.rule.timeout();
        if self.inner.breakers.is_open(ks.slot, self.now_ns()) {
            return self.degraded(&ks, &entry, cost);
        }
        // A cold key: its shard's next exact batch decides, with no lock held meanwhile.
        // Rules that wait for replicas, keys found split, and the embedded store (no
        // round trip to share: a call returns at once) take the per-key path.
        let now = self.now_ns();
        if !self.is_hot(&ks, &entry)
            && matches!(self.inner.store, Store::Redis(_))
            && entry.rule.replication().is_none()
            && entry.params.region.is_none()
            && now >= ks.batch_after_ns.load(Ordering::Relaxed)
        {
            if let Some(d) = self.recheck(&ks, &entry, cost, now) {
                return d;
            }
            if let Some(d) = self.exact_batched(&ks, &entry, cost, deadline).await {
                return d;
            }
            ks.batch_after_ns
                .store(self.now_ns() + 1_000_000_000, Ordering::Relaxed);
        }
        let Ok(mut driver) = timeout_at(deadline, ks.driver.lock()).await else {
            entry.counters.incr(Counter::StoreErrors);
            return self.degraded(&ks, &entry, cost);
        };
        let hot = self.is_hot(&ks, &entry);
        // Look again: a refill or a denial may have landed while we waited for the lock.
        let now = self.now_ns();
        if let Some(d) = self.recheck(&ks, &entry, cost, now) {
            return d;
        }
        ks.last_io_ns.store(now, Ordering::Relaxed);
        let outcome = if hot {
            timeout_at(
                deadline,
                self.lease_and_spend(&ks, &mut driver, &entry, cost),
            )
            .await
        } else {
            timeout_at(deadline, self.exact(&ks, &mut driver, &entry, cost)).await
        };
        drop(driver);
        match outcome {
            Ok(Ok(d)) => {
                store_answered(&ks);
                d
            }
            Ok(Err(CallError::Refused(why))) => {
                if why == Refusal::Saturated {
                    entry.counters.incr(Counter::StoreErrors);
                }
                self.degraded(&ks, &entry, cost)
            }
            Ok(Err(CallError::Store(e))) => {
                tracing::debug!(error = %e, key = %ks.bucket.for_logs(), "store failed; the failure policy decides");
                self.degraded(&ks, &entry, cost)
            }
            // The call in flight was dropped (ending a probe, if it was one).
            Err(_) => self.timed_out(&ks, &entry, cost),
        }
    }

    /// A decision the store did not answer within the rule's timeout: the timeout counts
    /// against the shard only if nothing on it succeeded since this decision began, and
    /// the failure policy decides.
    fn timed_out(&self, ks: &Arc<KeyState>, entry: &RuleEntry, cost: u64) -> Decision {
        let began = self
            .now_ns()
            .saturating_sub(entry.rule.timeout().as_nanos() as u64);
        self.inner
            .breakers
            .for_slot(ks.slot)
            .failure(self.now_ns(), began, false);
        entry.counters.incr(Counter::StoreErrors);
        self.inner.error_kinds.incr(ErrorKind::Timeout);
        self.degraded(ks, entry, cost)
    }

    async fn lease_and_spend(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        cost: u64,
    ) -> Result<Decision, CallError> {
        // Two rounds at most: other callers may spend the grant before we do.
        for _ in 0..2 {
            let reply = self.acquire(ks, driver, entry, cost).await?;
            if let Some(d) = self.spend_leased(ks.hot(), &entry.counters, ks, cost, self.now_ns()) {
                return Ok(d);
            }
            if term_ending(driver, &reply) {
                // No lease can outlive the term; each decision is one exact call until
                // it ends (at most the rule's grace).
                return self.exact(ks, driver, entry, cost).await;
            }
            if reply.granted == 0 {
                break;
            }
        }
        entry.counters.incr(entry.denied);
        ks.hot().count_denied(cost);
        let now = self.now_ns();
        Ok(denied(match ks.cached_wait(cost, now) {
            Some(wait) => wait,
            None => refill_ns(cost, entry.params.rate),
        }))
    }

    async fn exact(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        cost: u64,
    ) -> Result<Decision, CallError> {
        let reply = self.call(ks, driver, entry, Op::Exact { cost }).await?;
        let now = self.now_ns();
        let admitted = reply.granted == cost;
        self.count_exact(
            ks,
            driver,
            entry,
            now,
            &[(cost, admitted)],
            reply.scale_ppm != 0,
        );
        Ok(self.exact_decided(ks, entry, cost, admitted, reply.retry_us, reply.remaining))
    }

    /// Counts exact decisions `(cost, admitted)` taken at `now` in the key's policy
    /// (`leased_elsewhere`: the store said other agents lease the key). Promotion: a cold
    /// key used faster than the threshold, or leased elsewhere, starts leasing, and the
    /// sweep lists it.
    fn count_exact(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        now: u64,
        decisions: &[(u64, bool)],
        leased_elsewhere: bool,
    ) {
        let mut hot = false;
        for &(cost, admitted) in decisions {
            hot |= driver.policy.exact_done(
                &entry.rule,
                &self.inner.policy,
                now,
                cost,
                admitted,
                leased_elsewhere,
            );
        }
        if hot {
            ks.refill.set_share_milli(driver.policy.share_milli());
            ks.hot().set_leases(true);
            // Visited by the sweep from now on, not only once the pass over the map
            // comes by.
            if !ks.transient {
                self.track(ks);
            }
        }
    }

    /// The decision the store made on an exact call of `cost`: counted, and a denial
    /// remembered until `cost` tokens could exist (`retry_us`).
    fn exact_decided(
        &self,
        ks: &KeyState,
        entry: &RuleEntry,
        cost: u64,
        admitted: bool,
        retry_us: u64,
        remaining: u64,
    ) -> Decision {
        ks.saw_store_left(remaining, self.now_ns());
        if admitted {
            entry.counters.incr(Counter::AdmittedExact);
            Decision::Allowed {
                remaining,
                via: Admission::Exact,
            }
        } else {
            let wait = retry_us.max(1) * 1000;
            ks.hot().deny(self.now_ns() + wait, cost);
            entry.counters.incr(entry.denied);
            ks.hot().count_denied(cost);
            denied(wait)
        }
    }

    /// Leases for `ks`: declares what is held, asks for about `horizon` of demand (at
    /// least `needed`), and installs the grant with a deadline measured from the moment
    /// the request was sent.
    #[tracing::instrument(level = "debug", name = "refill", skip_all, fields(key = %ks.bucket.for_logs(), needed))]
    async fn acquire(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        needed: u64,
    ) -> Result<Reply, CallError> {
        let sent = self.now_ns();
        // A key that leases has traffic: the rule's seat stays wanted (its decisions
        // covered by the lease never reach the seat).
        if let Some((_, seat)) = &entry.local {
            seat.wanted(sent);
        }
        let args = driver.policy.acquire(
            &entry.rule,
            &self.inner.policy,
            sent,
            &ks.hot().lease,
            ks.hot().denied_tokens(),
            needed,
        );
        let op = Op::Acquire {
            held: args.held,
            want: args.want,
            min: args.min,
            demand: args.demand,
        };
        let reply = self.call(ks, driver, entry, op).await?;
        // A part in the last moments of its split's term leases nothing (ttl 0).
        let ending = term_ending(driver, &reply);
        driver.policy.granted(
            &entry.rule,
            &self.inner.policy,
            ks.hot(),
            &ks.refill,
            sent,
            self.now_ns(),
            needed,
            &reply,
            ending,
        );
        if !reply.moved {
            ks.saw_store_left(reply.remaining, self.now_ns());
        }
        if reply.granted > 0 {
            entry.counters.incr(Counter::LeaseGrants);
            entry
                .counters
                .add(Counter::LeaseTokensGranted, reply.granted);
        }
        Ok(reply)
    }

    /// Returns what the lease holds. `withdraw` (the agent went idle on the key) also
    /// clears the demand it reported, even with nothing to return, so it stops counting
    /// in the key's proportional shares.
    async fn release(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        withdraw: bool,
    ) -> Result<(), CallError> {
        let now = self.now_ns();
        let expired = now >= ks.hot().lease.deadline_ns();
        let taken = ks.hot().lease.take_all();
        let withdraw = driver.policy.released(taken, withdraw);
        // An expired lease is forfeited: it can no longer be spent, so saying so early
        // only frees room.
        let returned = if expired { 0 } else { taken };
        if returned == 0 && !withdraw {
            return Ok(());
        }
        let reply = self
            .send(dest(ks, driver, entry), entry, &Op::Release { returned })
            .await?;
        entry.counters.incr(Counter::LeaseReturns);
        entry
            .counters
            .add(Counter::LeaseTokensReturned, reply.granted);
        Ok(())
    }

    /// An acquire or exact call to wherever the key's bucket is now: its own key, or the
    /// part of a split this agent uses. A reply saying the bucket moved (the parent is
    /// split, or the part's term is over) switches the route, after returning what the
    /// lease holds to the bucket that leased it, and the call is sent again.
    async fn call(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        mut op: Op,
    ) -> Result<Reply, CallError> {
        let now = self.now_ns();
        if driver.route.as_ref().is_some_and(|r| {
            let server_now = r.seen_server_us + now.saturating_sub(r.seen_ns) / 1000;
            r.split.until_us.saturating_sub(server_now) < ROUTE_REFRESH_US
                && now.saturating_sub(r.seen_ns) > 1_000_000_000
        }) {
            self.switch(ks, driver, entry, None, &mut op).await?;
        }
        let mut hops = 0;
        loop {
            driver.policy.called();
            let reply = self.send(dest(ks, driver, entry), entry, &op).await?;
            if !reply.moved {
                // Refused by its part while holding nothing from it: the next attempt
                // goes to the next part, so parts no agent starts on are drained too.
                let ending = matches!(op, Op::Acquire { .. }) && reply.ttl_us == 0;
                let read = matches!(op, Op::Exact { cost: 0 });
                let refused = reply.granted == 0 && !ending && !read;
                let empty = ks.hot().lease.held() == 0
                    && matches!(op, Op::Exact { .. } | Op::Acquire { held: 0, .. });
                if let Some(r) = &driver.route
                    && refused
                    && empty
                    && let Some(next) = r.next(&ks.bucket, &entry.params)
                {
                    driver.route = Some(Box::new(next));
                }
                return Ok(reply);
            }
            if hops == 2 {
                return Ok(reply);
            }
            hops += 1;
            let next = if driver.route.is_some() {
                None
            } else {
                // A parent answers `moved` only while a split is in force.
                let Some(split) = reply.split else {
                    return Ok(reply);
                };
                let first = self.inner.agent.0;
                let route = Route::new(
                    split,
                    first,
                    &ks.bucket,
                    &entry.params,
                    self.now_ns(),
                    reply.now_us,
                );
                if route.is_none() {
                    tracing::warn!(key = %ks.bucket.for_logs(), parts = split.parts, "split cannot be represented exactly; waiting for its end");
                    return Ok(reply);
                }
                route
            };
            self.switch(ks, driver, entry, next, &mut op).await?;
        }
    }

    /// Moves the key to another bucket (a part, or back to its own key): what the lease
    /// holds goes back to the bucket that leased it, and `op` declares an empty lease.
    async fn switch(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        next: Option<Route>,
        op: &mut Op,
    ) -> Result<(), CallError> {
        self.release(ks, driver, entry, false).await?;
        driver.route = next.map(Box::new);
        driver.policy.moved();
        if let Op::Acquire { held, .. } = op {
            *held = 0;
        }
        Ok(())
    }

    /// One store call through the key's breaker. Retries of a call whose outcome is
    /// unknown reuse its sequence number, so the store applies it at most once (I2).
    /// Every way out resolves the breaker's permit; a cancelled call drops it, which ends
    /// a probe without a verdict.
    async fn send(&self, to: Dest<'_>, entry: &RuleEntry, op: &Op) -> Result<Reply, CallError> {
        let op = *op;
        let breaker = self.inner.breakers.for_slot(to.slot);
        let permit = breaker.enter(self.now_ns()).map_err(CallError::Refused)?;
        let req = leasehold_core::Request {
            agent: self.inner.agent,
            seq: self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1,
            op,
        };
        let first = Instant::now();
        let _timed = CallTimer {
            shard: self.inner.breakers.shard_name(to.slot),
            op: match op {
                Op::Acquire { .. } => "acquire",
                Op::Release { .. } => "release",
                Op::Exact { .. } => "exact",
                Op::Split { .. } => "split",
                Op::Deposit { .. } => "deposit",
            },
            started: first,
        };
        let replay_window = Duration::from_micros(entry.params.grace_us) / 2;
        let mut attempt = 0;
        loop {
            entry.counters.incr(Counter::StoreCalls);
            let replication = entry.rule.replication();
            match self
                .inner
                .store
                .call_replicated(to.key, to.params, &req, replication)
                .await
            {
                Ok(reply) => {
                    permit.succeeded(self.now_ns());
                    return Ok(reply);
                }
                Err(e) if e.is_retryable() && attempt < 2 && first.elapsed() < replay_window => {
                    attempt += 1;
                }
                Err(e) => {
                    entry.counters.incr(Counter::StoreErrors);
                    self.inner.error_kinds.incr(e.kind());
                    match e.kind() {
                        // The shard answered; the request itself was refused.
                        ErrorKind::Refused => permit.succeeded(self.now_ns()),
                        // Never sent: no verdict on the shard.
                        ErrorKind::Protocol => drop(permit),
                        _ => permit.failed(self.now_ns()),
                    }
                    if let StoreError::NotReplicated {
                        acked: 0, wanted, ..
                    } = &e
                    {
                        // No replica acknowledged at all: likely none is attached, and
                        // every grant of the rule is refused. Said once a minute.
                        static SAID: AtomicU64 = AtomicU64::new(0);
                        if once_per(&SAID, self.now_ns(), 60_000_000_000) {
                            tracing::warn!(
                                rule = %entry.name,
                                replicas = wanted,
                                "no replica acknowledged a grant: is one attached to the primary? \
                                 Until one is, the rule's failure policy decides"
                            );
                        }
                    } else if e.kind() == ErrorKind::NotReplicated {
                        tracing::debug!(error = %e, key = %to.key.for_logs(), "grant not replicated in time");
                    } else if !e.is_retryable() {
                        // Every request on the key would say it again (a key holding
                        // foreign data, Redis out of memory): once every 10 s.
                        static SAID: AtomicU64 = AtomicU64::new(0);
                        if once_per(&SAID, self.now_ns(), 10_000_000_000) {
                            tracing::error!(
                                error = %e,
                                key = %to.key.for_logs(),
                                "store refused a request (said at most every 10 s)"
                            );
                        }
                    }
                    return Err(CallError::Store(e));
                }
            }
        }
    }

    /// Counts an admission made without the store, for the next report.
    fn admitted_without_store(&self, ks: &Arc<KeyState>, cost: u64) {
        ks.without_store.fetch_add(cost, Ordering::SeqCst);
        if !ks.transient {
            self.track(ks);
        }
    }

    /// The decision while the store cannot be used, by the rule's failure policy.
    fn degraded(&self, ks: &Arc<KeyState>, entry: &RuleEntry, cost: u64) -> Decision {
        let c = &entry.counters;
        let now = self.now_ns();
        match entry.rule.failure_policy() {
            FailurePolicy::FailOpen => {
                c.incr(Counter::AdmittedFailOpen);
                self.admitted_without_store(ks, cost);
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::FailOpen,
                }
            }
            FailurePolicy::FailClosed => {
                c.incr(entry.unavailable);
                Decision::Unavailable {
                    retry_after: self.inner.breakers.for_slot(ks.slot).retry_in(now),
                }
            }
            FailurePolicy::LocalEmergency { rate } => {
                let mut slot = ks.emergency.lock();
                let e = slot.get_or_insert_with(|| {
                    c.incr(Counter::EmergencyActivations);
                    ks.in_emergency.store(true, Ordering::Release);
                    let (share, cap) = leasehold_core::emergency_limit(
                        &entry.rule,
                        &self.inner.policy,
                        ks.refill.share_milli(),
                    );
                    // An explicit emergency rate overrides the share: a bucket of the
                    // rule's lease_max that starts full (each agent's own limit).
                    let (rate, cap, level) = match rate {
                        Some(r) => {
                            let cap = entry.rule.lease_max().get();
                            (r, cap, Level::full(cap))
                        }
                        None => (share, cap, Level::default()),
                    };
                    Box::new(Emergency {
                        level,
                        rate,
                        cap,
                        at_ns: now,
                    })
                });
                let dt_us = now.saturating_sub(e.at_ns) / 1000;
                e.level = e.level.refill(e.cap, e.rate, dt_us);
                e.at_ns = now;
                if e.level.tokens >= cost {
                    e.level = e.level.take(cost);
                    self.admitted_without_store(ks, cost);
                    c.incr(Counter::AdmittedEmergency);
                    Decision::Allowed {
                        remaining: e.level.tokens,
                        via: Admission::Emergency,
                    }
                } else {
                    c.incr(entry.denied);
                    denied(e.level.time_until(cost.min(e.cap), e.rate) * 1000)
                }
            }
        }
    }

    /// Reads the rules file again. A file that fails validation is refused and the rules
    /// in force stay; keys of removed rules answer `UnknownRule` from then on.
    #[tracing::instrument(level = "info", name = "rules_reload", skip_all)]
    pub fn reload_rules(&self) -> Result<usize, RulesError> {
        let Some(path) = &self.inner.rules_file else {
            return Ok(self.inner.rules.load().by_name.len());
        };
        self.inner.note_rules_mtime();
        let rules = Rules::from_file(path)?;
        if let Some(rule) = self
            .inner
            .required
            .lock()
            .iter()
            .find(|r| rules.get(r).is_err())
        {
            return Err(RulesError::Required {
                path: path.display().to_string(),
                rule: rule.clone(),
            });
        }
        let n = rules.len();
        self.set_rules(&rules);
        tracing::info!(rules = n, path = %path.display(), "rules reloaded");
        Ok(n)
    }

    /// Names rules this process checks requests against (a gateway's configured rules):
    /// each must exist now, and a reload of the rules file that lacks one is refused, with
    /// the rules in force kept, as a file lacking it is refused at start.
    pub fn require_rules<S: AsRef<str>>(
        &self,
        names: impl IntoIterator<Item = S>,
    ) -> Result<(), UnknownRule> {
        let names: Vec<String> = names.into_iter().map(|n| n.as_ref().to_owned()).collect();
        let table = self.inner.rules.load();
        for n in &names {
            table.get(n)?;
        }
        self.inner.required.lock().extend(names);
        Ok(())
    }

    /// Replaces the rules with ones built in code. Rules that do not fit this agent's
    /// region (a region-scoped rule without a weight for it, say) are refused, with the
    /// error logged, and the rules in force stay.
    pub fn set_rules(&self, rules: &Rules) {
        let table = match RuleTable::new(
            rules,
            Some(&self.inner.rules.load()),
            self.inner.config.shadow,
            self.inner.config.region.as_deref(),
        ) {
            Ok(t) => Arc::new(t),
            Err(e) => {
                tracing::error!(error = %e, "rules refused; the rules in force stay");
                return;
            }
        };
        self.inner.rules.store(table.clone());
        self.inner.keys.for_each(|slot| {
            let ks = &slot.ks;
            let capacity = match table.get(&ks.rule) {
                Ok(set) => {
                    let entry = set.resolve(slot.subject());
                    if entry.params != ks.entry.load().params {
                        // A cached denial was timed at the old rate.
                        ks.hot().clear_denial();
                    }
                    ks.hot()
                        .set_rule_flags(entry.shadow, entry.local.is_some() && !ks.transient);
                    ks.entry.store(entry.clone());
                    entry.params.capacity
                }
                Err(_) => 0,
            };
            ks.hot().set_capacity(capacity);
        });
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

    /// The seats of the rules in force with a local share (a snapshot, so no lock is held
    /// across store calls).
    fn seats(&self) -> Vec<(Box<str>, Arc<Seat>)> {
        (self.inner.rules.load().seats.iter())
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect()
    }

    /// Stops spending `seat` of the rule `name` and gives it back to the store, so
    /// another agent may take it (its tenure starts empty).
    async fn give_seat_back(&self, name: &str, seat: &Seat) {
        seat.tenure.lost();
        let agents = u64::from(seat.share.agents);
        let left = (self.inner.store)
            .claim_seat(name, self.inner.agent, agents, SEAT_TTL_US, true)
            .await;
        if let Err(e) = left {
            tracing::debug!(rule = %name, error = %e, "giving a seat back failed");
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
        rule: &str,
        subject: impl AsRef<[u8]>,
    ) -> Result<BucketParams, UnknownRule> {
        Ok(self
            .inner
            .rules
            .load()
            .get(rule)?
            .resolve(subject.as_ref())
            .params)
    }
}

/// Why a store call did not happen or failed.
#[derive(Debug)]
enum CallError {
    Refused(Refusal),
    Store(StoreError),
}

/// Records a store call's time (retries included) in `leasehold_store_call_seconds` when
/// dropped, so a call cancelled by its deadline is counted too.
struct CallTimer {
    shard: String,
    op: &'static str,
    started: Instant,
}

impl Drop for CallTimer {
    fn drop(&mut self) {
        metrics::histogram!(
            "leasehold_store_call_seconds",
            "shard" => std::mem::take(&mut self.shard),
            "op" => self.op
        )
        .record(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::{bytes_eq, once_per};
    use std::sync::atomic::AtomicU64;

    /// A line every request could repeat is said once, then again only a period later.
    #[test]
    fn once_per_says_a_repeated_line_once_a_period() {
        let slot = AtomicU64::new(0);
        assert!(once_per(&slot, 0, 10), "the first time");
        assert!(!once_per(&slot, 6, 10));
        assert!(!once_per(&slot, 10, 10));
        assert!(once_per(&slot, 11, 10));
        assert!(!once_per(&slot, 20, 10));
    }

    #[test]
    fn bytes_eq_agrees_with_slice_equality_at_every_length_and_position() {
        for n in 0..40usize {
            let a: Vec<u8> = (0..n as u8).collect();
            assert!(bytes_eq(&a, &a.clone()), "length {n}");
            assert!(
                !bytes_eq(&a, &[a.as_slice(), &[0]].concat()),
                "length {n} vs {}",
                n + 1
            );
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x80;
                assert!(!bytes_eq(&a, &b), "length {n}, byte {i} differs");
            }
        }
    }
}
