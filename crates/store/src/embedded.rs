//! The in-process store: the reference model behind the same interface as Redis, for
//! single-process use, demos and tests.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use leasehold_core::key::BucketKey;
use leasehold_core::local::SeatReply;
use leasehold_core::model::seats::Seats;
use leasehold_core::model::{
    AgentId, BatchLog, ExactOutcome, GlobalBucket, Reply, Request, validate,
};
use leasehold_core::rule::BucketParams;
use parking_lot::Mutex;

use crate::redis::StoreError;
use crate::wire::ExactItem;

const SHARDS: usize = 64;

/// One shard's entries (buckets, or exact batches' dedup logs), dropped once Redis would
/// have expired them, as Redis expiry keeps memory to the live keys whatever the
/// traffic's shape: the shard is swept once it has served as many calls as it kept
/// entries at its last sweep (at least [`Expiring::SWEEP_AT_LEAST`]), so sweeping costs
/// O(1) a call and the shard holds at most about twice what is live.
#[derive(Debug)]
struct Expiring<K, V> {
    map: HashMap<K, V>,
    since_sweep: usize,
    /// Calls until the next sweep: what the last one kept.
    sweep_at: usize,
}

impl<K, V> Default for Expiring<K, V> {
    fn default() -> Self {
        Self {
            map: HashMap::new(),
            since_sweep: 0,
            sweep_at: Self::SWEEP_AT_LEAST,
        }
    }
}

impl<K, V> Expiring<K, V> {
    const SWEEP_AT_LEAST: usize = 64;
}

impl<K: std::hash::Hash + Eq, V: Default> Expiring<K, V> {
    /// The entry at `key` (made if missing), after a sweep of what `live` says has
    /// expired when the shard is due.
    fn entry(&mut self, key: K, live: impl Fn(&V) -> bool) -> &mut V {
        self.since_sweep += 1;
        if self.since_sweep >= self.sweep_at {
            self.since_sweep = 0;
            self.map.retain(|_, v| live(v));
            self.sweep_at = self.map.len().max(Self::SWEEP_AT_LEAST);
            // A flood's peak is not kept: the table shrinks with what it holds.
            if self.map.capacity() > 4 * self.map.len().max(Self::SWEEP_AT_LEAST) {
                self.map.shrink_to(2 * self.map.len());
            }
        }
        self.map.entry(key).or_default()
    }
}

/// One shard's buckets.
type Buckets = Expiring<BucketKey, GlobalBucket>;

impl Buckets {
    /// The bucket at `key`, after dropping, when the shard is due, what Redis would have
    /// expired (full, leaseless buckets, safe to forget: I6).
    fn bucket(&mut self, key: &BucketKey, now_us: u64) -> &mut GlobalBucket {
        self.entry(key.clone(), |b: &GlobalBucket| {
            b.state().is_some_and(|s| now_us / 1000 <= s.expire_at_ms)
        })
    }
}

type Shard = Mutex<Buckets>;

/// The reference model of every bucket, in memory, with the wall clock (or a clock tests
/// move, [`EmbeddedStore::with_time`]) as server time.
/// Expired buckets are dropped as the model says Redis would drop them.
#[derive(Clone, Debug)]
pub struct EmbeddedStore {
    shards: Arc<[Shard]>,
    hasher: foldhash::fast::RandomState,
    calls: Arc<AtomicU64>,
    offline: Arc<std::sync::atomic::AtomicBool>,
    /// Exact batches' dedup keys, sharded as the buckets are.
    batches: Arc<[Mutex<Expiring<String, BatchLog>>]>,
    /// The seats of rules' local shares, by rule.
    seats: Arc<Mutex<HashMap<String, Seats>>>,
    /// The clock, when not the system's.
    time: Option<TimeSource>,
}

/// A clock read in µs since the epoch.
#[derive(Clone)]
struct TimeSource(Arc<dyn Fn() -> u64 + Send + Sync>);

impl std::fmt::Debug for TimeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TimeSource({} µs)", (self.0)())
    }
}

impl Default for EmbeddedStore {
    fn default() -> Self {
        Self::new()
    }
}

impl EmbeddedStore {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            calls: Arc::new(AtomicU64::new(0)),
            offline: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            batches: (0..SHARDS).map(|_| Mutex::default()).collect(),
            seats: Arc::new(Mutex::new(HashMap::new())),
            time: None,
        }
    }

    /// An empty store whose clock is `now_us` (µs since the epoch) instead of the
    /// system's: tests move it by hand (see `leasehold_agent::ManualClock`).
    pub fn with_time(now_us: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Self {
            time: Some(TimeSource(Arc::new(now_us))),
            ..Self::new()
        }
    }

    /// The store's clock, µs since the epoch (Redis's `TIME`).
    fn now_us(&self) -> u64 {
        match &self.time {
            Some(now) => (now.0)(),
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
        }
    }

    /// Switches the store off (every call fails as unreachable) or back on, keeping its
    /// buckets: an outage without data loss, for simulations.
    pub fn set_offline(&self, offline: bool) {
        self.offline.store(offline, Ordering::Release);
    }

    /// Runs one request, atomically with respect to every other request on the bucket.
    pub fn call(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
    ) -> Result<Reply, StoreError> {
        validate(params, req)?;
        if self.offline.load(Ordering::Acquire) {
            return Err(StoreError::Offline);
        }
        let now_us = self.now_us();
        let mut shard = self.shards[(self.hasher.hash_one(key) as usize) % SHARDS].lock();
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(shard.bucket(key, now_us).apply(params, now_us, req)?)
    }

    /// Runs one exact batch as `lh_exact_batch` does: each key atomically at one server
    /// time, the answer kept in the batch's dedup log for a retry.
    pub fn exact_many(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        crate::redis::validate_batch(seq, items)?;
        if self.offline.load(Ordering::Acquire) {
            return Err(StoreError::Offline);
        }
        let now_us = self.now_us();
        self.calls.fetch_add(1, Ordering::Relaxed);
        let dedup = crate::wire::batch_key(items[0].key, agent, seq);
        let mut logs = self.batches[(self.hasher.hash_one(&dedup) as usize) % SHARDS].lock();
        // Dedup keys past their grace go as the shard is swept.
        let log = logs.entry(dedup, |l: &BatchLog| {
            l.record().is_some_and(|r| now_us / 1000 < r.expire_at_ms)
        });
        if let Some(answer) = log.open(now_us, seq) {
            return Ok(answer);
        }
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            let mut shard = self.shards[(self.hasher.hash_one(it.key) as usize) % SHARDS].lock();
            let bucket = shard.bucket(it.key, now_us);
            out.push(bucket.exact_many(it.params, now_us, it.costs)?);
        }
        let grace = items.iter().map(|it| it.params.grace_us).max().unwrap_or(0);
        let counts: Vec<usize> = items.iter().map(|it| it.costs.len()).collect();
        log.close(now_us, seq, grace, &out, &counts);
        Ok(out)
    }

    /// Claims, renews or gives up a seat of `rule`'s local share, as `lh_seat` does.
    pub fn claim_seat(
        &self,
        rule: &str,
        agent: AgentId,
        seats: u64,
        ttl_us: u64,
        leave: bool,
    ) -> Result<SeatReply, StoreError> {
        if self.offline.load(Ordering::Acquire) {
            return Err(StoreError::Offline);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let now_us = self.now_us();
        let mut all = self.seats.lock();
        let s = all.entry(rule.to_owned()).or_default();
        if leave {
            s.leave(agent, now_us);
            return Ok(SeatReply::Full { retry_us: 0 });
        }
        Ok(s.claim(agent, seats, ttl_us, now_us))
    }

    /// Calls served so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Buckets held (including expired ones not yet swept).
    pub fn buckets(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Exact batches' dedup logs held (including expired ones not yet swept).
    pub fn batch_logs(&self) -> usize {
        self.batches.iter().map(|s| s.lock().map.len()).sum()
    }
}
