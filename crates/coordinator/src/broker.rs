//! A region's broker: in a deployment in regions, the region's coordinator leases each
//! global key's budget for its region from the key's global bucket in the home store,
//! and deposits it into the region's bucket of the key, where the region's agents lease
//! and decide as usual (design and argument: `leasehold_core::model::region`,
//! `docs/regions.md`).
//!
//! One task per key the region's agents report, each running the key's
//! [`KeyBroker`] policy: at most one call in flight, a renewal every
//! [`BrokerConfig::refresh_us`]. A key whose region holds nothing and reports no demand
//! for [`IDLE_AFTER`] is dropped (its term lapses on its own). Only the leader brokers:
//! two brokers of one region would each declare the region's whole holding, which only
//! over-counts, but wastes budget.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use leasehold_core::key::BucketKey;
use leasehold_core::model::AgentId;
use leasehold_core::model::region::{BrokerCall, BrokerConfig, KeyBroker};
use leasehold_core::rule::BucketParams;
use leasehold_store::report::{KeyReport, Report};
use leasehold_store::{RedisStore, Rules};
use parking_lot::Mutex;

/// A key idle this long (nothing held, no demand) stops being brokered.
pub const IDLE_AFTER: Duration = Duration::from_secs(10);

/// The most keys a broker feeds at once by default (`--region-max-keys`): each costs
/// about ten calls a second to the global store.
pub const DEFAULT_MAX_KEYS: usize = 10_000;

/// How often the broker reads the keys agents announce.
pub const WATCH_EVERY: Duration = Duration::from_millis(20);

/// Counters of a broker.
#[derive(Debug, Default)]
pub struct BrokerStats {
    /// Calls to the global store.
    pub global_calls: AtomicU64,
    /// Calls to the global store that failed or timed out.
    pub global_failures: AtomicU64,
    /// Tokens granted by the global store and deposited.
    pub granted: AtomicU64,
    /// Calls to the region's store.
    pub region_calls: AtomicU64,
    /// Tokens the region's bucket took from deposits (less than granted when a term was
    /// over on arrival, or the bucket was full).
    pub deposited: AtomicU64,
    /// Keys not brokered because [`Broker::set_max_keys`] were already.
    pub keys_refused: AtomicU64,
}

/// What a region holds of one global key.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Holding {
    /// The global key.
    pub key: String,
    /// Tokens the region holds from its last grant.
    pub held: u64,
    /// Tokens granted to the region since the broker started.
    pub granted: u64,
    /// The region's demand, tokens a second.
    pub demand_per_sec: f64,
}

/// A region's broker.
#[derive(Debug)]
pub struct Broker {
    region: String,
    id: AgentId,
    regional: RedisStore,
    global: RedisStore,
    rules: Arc<ArcSwap<Rules>>,
    config: BrokerConfig,
    started: Instant,
    keys: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    active: AtomicBool,
    watcher: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stats: BrokerStats,
    /// Per global key: what the global bucket granted this region, as an agent's report
    /// says what it admitted (see [`Broker::watch`]).
    totals: Mutex<HashMap<String, KeyReport>>,
    max_keys: std::sync::atomic::AtomicUsize,
}

impl Broker {
    /// The broker of `region`, between the region's store and the global one.
    pub fn new(
        region: &str,
        regional: RedisStore,
        global: RedisStore,
        rules: Arc<ArcSwap<Rules>>,
        config: BrokerConfig,
    ) -> Arc<Self> {
        Arc::new(Self {
            region: region.to_owned(),
            // Random per process, as an agent's: a restarted broker never replays.
            id: AgentId(rand::random::<u64>().max(1)),
            regional,
            global,
            rules,
            config,
            started: Instant::now(),
            keys: Mutex::new(HashMap::new()),
            active: AtomicBool::new(false),
            watcher: Mutex::new(None),
            stats: BrokerStats::default(),
            totals: Mutex::new(HashMap::new()),
            max_keys: std::sync::atomic::AtomicUsize::new(DEFAULT_MAX_KEYS),
        })
    }

    /// Feeds at most `max_keys` keys at once (at least 1; default [`DEFAULT_MAX_KEYS`]);
    /// past it a new key is refused (counted, logged every 10 000 refusals) until one
    /// goes idle, and its region serves it at its floor only.
    pub fn set_max_keys(&self, max_keys: usize) {
        self.max_keys.store(max_keys.max(1), Ordering::Relaxed);
    }

    /// The region it serves.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// Its counters.
    pub fn stats(&self) -> &BrokerStats {
        &self.stats
    }

    /// Keys brokered now.
    pub fn keys(&self) -> usize {
        self.keys.lock().len()
    }

    /// What the region holds of its busiest global keys (at most 20, most held first):
    /// per key, tokens held from the last grant and tokens granted in all.
    pub fn holdings(&self) -> Vec<Holding> {
        let mut v: Vec<Holding> = self
            .totals
            .lock()
            .iter()
            .map(|(k, t)| Holding {
                key: k.clone(),
                held: t.held,
                granted: t.admitted,
                demand_per_sec: t.demand_milli as f64 / 1000.0,
            })
            .collect();
        v.sort_by(|a, b| b.held.cmp(&a.held).then_with(|| a.key.cmp(&b.key)));
        v.truncate(20);
        v
    }

    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Brokers `keys` (regions' bucket keys the region's agents reported) while
    /// `leader`; a key already brokered goes on; without the lead, every key stops. With
    /// the lead it also watches [`leasehold_store::report::WANTED_KEY`], where agents announce a key they start
    /// using, so a new key is fed within a round trip.
    pub fn ensure<'a>(self: &Arc<Self>, leader: bool, keys: impl IntoIterator<Item = &'a str>) {
        self.active.store(leader, Ordering::Relaxed);
        if !leader {
            for (_, task) in self.keys.lock().drain() {
                task.abort();
            }
            return;
        }
        let mut watcher = self.watcher.lock();
        if watcher
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
        {
            let me = self.clone();
            *watcher = Some(tokio::spawn(async move { me.watch().await }));
        }
        drop(watcher);
        self.add(keys);
    }

    fn add<'a>(self: &Arc<Self>, keys: impl IntoIterator<Item = &'a str>) {
        let mut running = self.keys.lock();
        running.retain(|_, task| !task.is_finished());
        for key in keys {
            if running.contains_key(key) {
                continue;
            }
            let Some((bucket, _)) = BucketKey::parse(key).filter(|(b, _)| b.is_region()) else {
                continue;
            };
            let max_keys = self.max_keys.load(Ordering::Relaxed);
            if running.len() >= max_keys {
                if self
                    .stats
                    .keys_refused
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(10_000)
                {
                    tracing::warn!(
                        max_keys,
                        "the broker feeds as many keys as it may; new global keys get only their floor"
                    );
                }
                metrics::counter!("leasehold_broker_keys_refused_total", "region" => self.region.clone())
                    .increment(1);
                continue;
            }
            let me = self.clone();
            running.insert(
                key.to_owned(),
                tokio::spawn(async move { me.run(bucket).await }),
            );
        }
    }

    /// Stops every key.
    pub fn stop(&self) {
        self.active.store(false, Ordering::Relaxed);
        if let Some(w) = self.watcher.lock().take() {
            w.abort();
        }
        for (_, task) in self.keys.lock().drain() {
            task.abort();
        }
    }

    /// Reads the keys agents announce while active: every [`WATCH_EVERY`], the entries
    /// newer than the last seen; entries older than a minute are trimmed. Once a second
    /// it also reports to the global store, as an agent reports to its coordinator, what
    /// the global bucket granted this region per key: a coordinator of the global store
    /// accounts every region's grants against `B + r*W` (grants bound admissions).
    async fn watch(self: Arc<Self>) {
        let mut since = 0u64;
        let mut trimmed = Instant::now();
        let mut reported_s = 0u64;
        while self.active.load(Ordering::Relaxed) {
            let wall_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            if wall_ms / 1000 != reported_s {
                reported_s = wall_ms / 1000;
                let text = {
                    let totals = self.totals.lock();
                    let name = format!("region {} (broker)", self.region);
                    let lines = leasehold_store::report::AgentLines {
                        name: Some(&name),
                        ..Default::default()
                    };
                    Report::encode_with(
                        wall_ms,
                        lines,
                        totals.iter().map(|(k, r)| (k.as_str(), *r)),
                    )
                };
                if let Err(e) = self.global.report(self.id, wall_ms, &text).await {
                    tracing::debug!(error = %e, "report to the global store failed");
                }
            }
            match self.regional.announced_keys(since).await {
                Ok(entries) => {
                    since = entries
                        .iter()
                        .map(|(_, at)| *at)
                        .max()
                        .unwrap_or(since)
                        .max(since);
                    self.add(entries.iter().map(|(k, _)| k.as_str()));
                }
                Err(e) => tracing::debug!(error = %e, "reading the announced keys failed"),
            }
            if trimmed.elapsed() > Duration::from_secs(10) {
                trimmed = Instant::now();
                let cutoff = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64)
                    .saturating_sub(60_000);
                let _ = self.regional.forget_announced(cutoff).await;
            }
            tokio::time::sleep(WATCH_EVERY).await;
        }
    }

    /// The key's parameters at the global bucket and at the region's, by the rules in
    /// force; `None` when its rule is gone or not of global scope.
    fn params_of(
        &self,
        rules: &Rules,
        rule: &str,
        global_key: &BucketKey,
    ) -> Option<(BucketParams, BucketParams)> {
        let rule = rules.resolve_key(rule, global_key).ok()?;
        let regional = rule.in_region(Some(&self.region)).ok()?;
        regional.region_fed()?;
        Some((rule.bucket_params(), regional.bucket_params()))
    }

    /// One key until it is idle, its rule is gone or no longer global, or the lead is lost.
    async fn run(self: Arc<Self>, key: BucketKey) {
        let global_key = key.global_of();
        let Some((_, rule)) = BucketKey::parse(key.as_str()) else {
            return;
        };
        let mut policy = KeyBroker::new(self.id, self.now_us());
        let tick = Duration::from_micros((self.config.refresh_us / 10).clamp(1_000, 20_000));
        let call_timeout = Duration::from_secs(2);
        // Resolved again only when the rules are replaced (a reload).
        let mut rules = self.rules.load_full();
        let Some(mut params) = self.params_of(&rules, rule.as_str(), &global_key) else {
            return;
        };
        while self.active.load(Ordering::Relaxed) {
            let current = self.rules.load_full();
            if !Arc::ptr_eq(&current, &rules) {
                rules = current;
                let Some(p) = self.params_of(&rules, rule.as_str(), &global_key) else {
                    return;
                };
                params = p;
            }
            let (global_p, region_p) = &params;
            let now = self.now_us();
            if policy.idle_since(now.saturating_sub(IDLE_AFTER.as_micros() as u64))
                && now > IDLE_AFTER.as_micros() as u64
            {
                return;
            }
            // A call that fails is sent again by the next poll; one refused at once waits
            // a tick first, one that timed out has waited already.
            let failed = |policy: &mut KeyBroker, e: Option<leasehold_store::StoreError>| {
                policy.on_failure();
                e.inspect(
                    |e| tracing::debug!(error = %e, key = %key.for_logs(), "broker call failed"),
                )
                .is_some()
            };
            let pause = match policy.poll(now, &self.config, global_p) {
                None => true,
                Some(BrokerCall::Region(req)) => {
                    self.stats.region_calls.fetch_add(1, Ordering::Relaxed);
                    match within(call_timeout, self.regional.call(&key, region_p, &req)).await {
                        Ok(reply) => {
                            self.stats
                                .deposited
                                .fetch_add(reply.granted, Ordering::Relaxed);
                            policy.on_region_reply(self.now_us(), &self.config, &reply);
                            false
                        }
                        Err(e) => failed(&mut policy, e),
                    }
                }
                Some(BrokerCall::Global(req)) => {
                    self.stats.global_calls.fetch_add(1, Ordering::Relaxed);
                    let region = self.region.clone();
                    metrics::counter!("leasehold_broker_global_calls_total", "region" => region.clone())
                        .increment(1);
                    match within(call_timeout, self.global.call(&global_key, global_p, &req)).await
                    {
                        Ok(reply) => {
                            self.stats
                                .granted
                                .fetch_add(reply.granted, Ordering::Relaxed);
                            metrics::counter!("leasehold_broker_granted_tokens_total", "region" => region)
                                .increment(reply.granted);
                            policy.on_global_reply(self.now_us(), &self.config, global_p, &reply);
                            let mut totals = self.totals.lock();
                            let t = totals.entry(global_key.as_str().to_owned()).or_default();
                            t.admitted += reply.granted;
                            t.calls += 1;
                            t.demand_milli = policy.demand_milli();
                            t.held = policy.held() + reply.granted;
                            false
                        }
                        Err(e) => {
                            metrics::counter!("leasehold_broker_global_failures_total", "region" => region)
                                .increment(1);
                            self.stats.global_failures.fetch_add(1, Ordering::Relaxed);
                            failed(&mut policy, e)
                        }
                    }
                }
            };
            if pause {
                tokio::time::sleep(tick).await;
            }
        }
    }
}

/// `call` within `limit`: its reply, or its error (`None`: it timed out).
async fn within<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, leasehold_store::StoreError>>,
) -> Result<T, Option<leasehold_store::StoreError>> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r.map_err(Some),
        Err(_) => Err(None),
    }
}
