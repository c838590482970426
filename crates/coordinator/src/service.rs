//! The coordinator's loop: once a second (half a second after the agents report) it
//! reads the live agents' reports, updates the accounting, publishes metrics, and — when
//! it holds the leader lock — splits keys too hot for one shard and extends the term of
//! split keys that are still hot.
//!
//! Everything it knows is in Redis: the reports, the split state (in each parent
//! bucket), the lock. A restarted coordinator rebuilds its accounting within a few
//! seconds; agents see nothing of a restart except that a split term is not extended
//! while no coordinator runs. Several may run: only the holder of `lh:coordinator` acts,
//! and its actions are idempotent anyway (a split in force is only extended; a different
//! split of the same key is refused by the bucket).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Op, Request};
use leasehold_core::rule::Rule;
use leasehold_store::report::{REPORT_TTL_MS, Report};
use leasehold_store::{RedisStore, Rules, StoreError};
use parking_lot::RwLock;
use serde::Serialize;

use crate::accounting::{Bound, FORGET_AFTER_MS, KeyStats, Ledger};
use crate::plan::{SplitPolicy, Step, choose_salt, step};
use crate::view::SplitView;

/// The leader lock.
pub use leasehold_store::report::LEAD_KEY as LOCK_KEY;

/// Tuning of the coordinator.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CoordinatorConfig {
    /// How often it runs.
    pub tick: Duration,
    /// When to split and merge.
    pub split: SplitPolicy,
    /// The leader lock expires this long after its last renewal.
    pub lock_ttl: Duration,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            tick: Duration::from_secs(1),
            split: SplitPolicy::default(),
            lock_ttl: Duration::from_secs(5),
        }
    }
}

/// What the coordinator knows of a key.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeyStatus {
    /// Accounting.
    #[serde(flatten)]
    pub stats: KeyStats,
    /// The rule.
    pub rule: String,
    /// The split in force, if the coordinator looked (keys above the merge threshold).
    pub split: Option<SplitView>,
}

/// The coordinator's latest picture, shared with the admin endpoint.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// Whether this instance holds the leader lock.
    pub leader: bool,
    /// Live agents: those whose last report is newer than two of their intervals
    /// between reports (and a second).
    pub agents: usize,
    /// When the last tick ran, wall-clock ms.
    pub at_ms: u64,
    /// Keys reported, by Redis key.
    pub keys: BTreeMap<String, KeyStatus>,
    /// Splits started by this instance.
    pub splits_started: u64,
    /// The live agents, by id.
    pub gateways: BTreeMap<String, GatewayStatus>,
}

/// What a live agent's last report said of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct GatewayStatus {
    /// Its host and process (`HOST/PID`), when it said.
    pub name: Option<String>,
    /// Its health line (`ready`, or `degraded: REASON` with the breakers open), when it
    /// said.
    pub health: Option<String>,
    /// When it wrote the report, wall-clock ms.
    pub report_ms: u64,
    /// Leased keys in the report.
    pub keys: usize,
}

/// The coordinator.
#[derive(Debug)]
pub struct Coordinator {
    store: RedisStore,
    rules: Arc<ArcSwap<Rules>>,
    config: CoordinatorConfig,
    id: AgentId,
    seq: AtomicU64,
    ledger: parking_lot::Mutex<Ledger>,
    /// The agents' last reports read, by agent.
    seen: parking_lot::Mutex<HashMap<AgentId, Seen>>,
    snapshot: Arc<RwLock<Snapshot>>,
    broker: Option<Arc<crate::broker::Broker>>,
}

/// An agent's last report as the coordinator read it.
#[derive(Debug)]
struct Seen {
    /// Its time (the agent's wall clock, its score in `lh:agents`).
    at_ms: u64,
    /// When this coordinator read it (its own wall clock: the agent's may be skewed).
    read_ms: u64,
    /// The agent's seconds between reports.
    every: u64,
    status: GatewayStatus,
}

impl Seen {
    fn new(at_ms: u64, read_ms: u64, every: u64, status: GatewayStatus) -> Self {
        Self {
            at_ms,
            read_ms,
            every,
            status,
        }
    }

    /// Whether the agent is live at `now_ms`: it wrote a newer report within two of its
    /// intervals and a second (one tick's wait), or it is that fresh.
    fn live(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.read_ms) <= (2 * self.every + 1) * 1000
    }
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Coordinator {
    /// A coordinator of `rules`' buckets in `store`.
    pub fn new(store: RedisStore, rules: Rules, config: CoordinatorConfig) -> Self {
        Self {
            store,
            rules: Arc::new(ArcSwap::from_pointee(rules)),
            config,
            id: AgentId(rand::random::<u64>().max(1)),
            seq: AtomicU64::new(0),
            ledger: parking_lot::Mutex::new(Ledger::new()),
            seen: parking_lot::Mutex::default(),
            snapshot: Arc::default(),
            broker: None,
        }
    }

    /// Also brokers its region's budgets of global keys (see [`crate::broker`]), while it
    /// holds the lead.
    pub fn with_broker(mut self, broker: Arc<crate::broker::Broker>) -> Self {
        self.broker = Some(broker);
        self
    }

    /// The broker, if this coordinator is one.
    pub fn broker(&self) -> Option<&Arc<crate::broker::Broker>> {
        self.broker.as_ref()
    }

    /// Replaces the rules (a reloaded file): the next tick accounts with them.
    pub fn set_rules(&self, rules: Rules) {
        self.rules.store(Arc::new(rules));
    }

    /// The rules in force, shared: the admin endpoint reads the same ones.
    pub fn rules(&self) -> Arc<ArcSwap<Rules>> {
        self.rules.clone()
    }

    /// The picture the admin endpoint serves.
    pub fn snapshot(&self) -> Arc<RwLock<Snapshot>> {
        self.snapshot.clone()
    }

    /// Runs a tick every `config.tick`, half a second after the agents' whole-second
    /// reports, until `shutdown` completes; then gives up the lock.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        // One tick at once (the lock, a broker's keys), then on the half second.
        let mut failing = Failing::default();
        failing.note(self.tick().await);
        let first =
            tokio::time::Instant::now() + Duration::from_millis((1500 - wall_ms() % 1000) % 1000);
        let mut ticks = tokio::time::interval_at(first, self.config.tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    let result = self.tick().await;
                    if result.is_err() {
                        metrics::counter!("leasehold_coordinator_errors_total").increment(1);
                    }
                    failing.note(result);
                }
                () = &mut shutdown => break,
            }
        }
        if let Some(b) = &self.broker {
            b.stop();
        }
        if self.snapshot.read().leader {
            let _ = self.unlock().await;
        }
    }

    /// Runs it on the current tokio runtime until [`Running::stop`].
    pub fn spawn(self: Arc<Self>) -> Running {
        let (stop, mut rx) = tokio::sync::watch::channel(false);
        let coordinator = self.clone();
        let task = tokio::spawn(async move {
            self.run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        });
        Running {
            coordinator,
            stop,
            task,
        }
    }

    /// Takes or renews the leader lock; true when this instance holds it.
    async fn lock(&self) -> Result<bool, StoreError> {
        let ttl = self.config.lock_ttl.as_millis() as u64;
        self.store.take_lead(&self.id.to_string(), ttl).await
    }

    async fn unlock(&self) -> Result<(), StoreError> {
        self.store.give_up_lead(&self.id.to_string()).await
    }

    /// One round: reports in, accounting and metrics out, splits when leader.
    #[tracing::instrument(level = "debug", name = "coordinator_tick", skip_all)]
    pub async fn tick(&self) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        let leader = self.lock().await?;
        let now_ms = wall_ms();
        let live = (self.store)
            .live_agents(now_ms.saturating_sub(REPORT_TTL_MS))
            .await?;
        if leader {
            (self.store)
                .forget_agents(now_ms.saturating_sub(FORGET_AFTER_MS))
                .await?;
        }
        // Only the reports written since the last tick are read: in a large fleet an agent
        // writes one every few seconds, and each read is Redis's work.
        let changed: Vec<AgentId> = {
            let seen = self.seen.lock();
            live.iter()
                .filter(|(a, at)| seen.get(a).is_none_or(|s| s.at_ms != *at))
                .map(|&(a, _)| a)
                .collect()
        };
        let reports = self.store.agent_reports(&changed).await?;
        let gateways = {
            let mut seen = self.seen.lock();
            let scores: HashMap<AgentId, u64> = live.iter().copied().collect();
            seen.retain(|a, _| scores.contains_key(a));
            for (agent, text) in changed.iter().zip(reports) {
                let Some(text) = text else {
                    seen.remove(agent);
                    continue;
                };
                let report = Report::parse(&text);
                self.ledger.lock().record(&agent.to_string(), &report);
                let status = GatewayStatus {
                    name: report.name,
                    health: report.health,
                    report_ms: report.at_ms,
                    keys: report.keys.len(),
                };
                let at_ms = scores.get(agent).copied().unwrap_or_default();
                seen.insert(*agent, Seen::new(at_ms, now_ms, report.every, status));
            }
            seen.iter()
                .filter(|(_, s)| s.live(now_ms))
                .map(|(a, s)| (a.to_string(), s.status.clone()))
                .collect::<BTreeMap<_, _>>()
        };
        let every = self
            .seen
            .lock()
            .values()
            .map(|s| s.every)
            .max()
            .unwrap_or(1);
        let mut statuses = BTreeMap::new();
        {
            let mut ledger = self.ledger.lock();
            ledger.cadence(every);
            ledger.forget(now_ms);
            if let Some(b) = &self.broker {
                b.ensure(leader, ledger.keys());
            }
            let keys: Vec<String> = ledger.keys().map(str::to_owned).collect();
            let rules = self.rules.load();
            for key in keys {
                let Some((bucket, rule)) = BucketKey::parse(&key) else {
                    continue;
                };
                // The subject's override when it has one: its B and r bound the key.
                let Ok(r) = rules.resolve_key(rule.as_str(), &bucket) else {
                    continue;
                };
                let bound = Bound {
                    capacity: r.capacity().get(),
                    rate_per_sec: r.rate().per_sec_f64(),
                };
                if let Some(stats) = ledger.stats(&key, bound, now_ms) {
                    statuses.insert(
                        key,
                        KeyStatus {
                            stats,
                            rule: rule.as_str().to_owned(),
                            split: None,
                        },
                    );
                }
            }
        }
        let mut started_splits = 0;
        let policy = &self.config.split;
        let warm: Vec<String> = statuses
            .iter()
            .filter(|(_, s)| s.stats.calls_per_sec >= policy.merge_below)
            .map(|(k, _)| k.clone())
            .collect();
        if !warm.is_empty() {
            let now_us = self.store.server_now_us().await?;
            let ranges = self.store.shards().await?;
            let mut primaries: Vec<&str> = ranges.iter().map(|(_, _, n)| n.as_str()).collect();
            primaries.sort_unstable();
            primaries.dedup();
            // A slot's shard: the index of the primary serving it (0 for a slot no
            // primary serves, so a part there is never counted as on a shard of its own).
            let shard_of = |slot: u16| {
                ranges
                    .iter()
                    .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
                    .and_then(|(_, _, n)| primaries.iter().position(|p| p == n))
                    .unwrap_or(0)
            };
            for key in warm {
                // A region's bucket is fed by its broker, never split.
                let Some((bucket, rule)) = BucketKey::parse(&key).filter(|(b, _)| !b.is_region())
                else {
                    continue;
                };
                let Ok(params) = self
                    .rules
                    .load()
                    .resolve_key(rule.as_str(), &bucket)
                    .map(Rule::bucket_params)
                else {
                    continue;
                };
                let split = self.store.split_of(&bucket, now_us).await?;
                let calls = statuses[&key].stats.calls_per_sec;
                let until_us = now_us + policy.term.as_micros() as u64;
                let op = match (leader, step(policy, calls, split.as_ref(), primaries.len())) {
                    (true, Step::Split(parts)) => choose_salt(&bucket, &params, parts, shard_of)
                        .map(|salt| Op::Split {
                            parts,
                            salt,
                            until_us,
                        }),
                    (true, Step::Extend) => split.map(|s| Op::Split {
                        parts: s.parts,
                        salt: s.salt,
                        until_us,
                    }),
                    _ => None,
                };
                let mut view = split;
                if let Some(op) = op {
                    let req = Request {
                        agent: self.id,
                        seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
                        op,
                    };
                    let reply = self.store.call(&bucket, &params, &req).await?;
                    if let (None, Some(started)) = (split, reply.split) {
                        started_splits += 1;
                        tracing::info!(key = %bucket.for_logs(), parts = started.parts, calls_per_sec = calls, "split");
                    }
                    view = reply.split;
                }
                if let (Some(s), Some(status)) = (view, statuses.get_mut(&key)) {
                    status.split =
                        Some(SplitView::new(&bucket, s.parts, s.salt, s.until_us, now_us));
                }
            }
        }
        publish(leader, gateways.len(), &statuses, started_splits);
        let mut snap = self.snapshot.write();
        if snap.leader != leader {
            if leader {
                tracing::info!(
                    "this coordinator holds the leader lock now: it splits and merges keys"
                );
            } else {
                tracing::warn!(
                    "this coordinator lost the leader lock: another one splits and merges keys"
                );
            }
        }
        snap.leader = leader;
        snap.agents = gateways.len();
        snap.at_ms = now_ms;
        snap.keys = statuses;
        snap.splits_started += started_splits;
        snap.gateways = gateways;
        metrics::histogram!("leasehold_coordinator_tick_seconds")
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// A coordinator running in this process.
#[derive(Debug)]
pub struct Running {
    coordinator: Arc<Coordinator>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The coordinator.
    pub fn coordinator(&self) -> &Arc<Coordinator> {
        &self.coordinator
    }

    /// Stops it (it gives up the lock) and waits until it has.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

fn publish(leader: bool, agents: usize, keys: &BTreeMap<String, KeyStatus>, splits: u64) {
    metrics::gauge!("leasehold_coordinator_leader").set(if leader { 1.0 } else { 0.0 });
    metrics::gauge!("leasehold_coordinator_agents").set(agents as f64);
    metrics::gauge!("leasehold_coordinator_keys").set(keys.len() as f64);
    metrics::counter!("leasehold_coordinator_splits_total").increment(splits);
    let mut by_rule: BTreeMap<&str, (f64, f64, u64, f64, usize)> = BTreeMap::new();
    for s in keys.values() {
        let e = by_rule.entry(s.rule.as_str()).or_default();
        e.0 = e.0.max(s.stats.overshoot);
        e.1 = e.1.max(s.stats.worst_overshoot);
        e.2 += s.stats.admitted_total;
        e.3 = e.3.max(s.stats.calls_per_sec);
        e.4 += usize::from(s.split.is_some());
    }
    for (rule, (overshoot, worst, admitted, calls, split)) in by_rule {
        let rule = rule.to_owned();
        metrics::gauge!("leasehold_overshoot_ratio", "rule" => rule.clone()).set(overshoot);
        metrics::gauge!("leasehold_overshoot_worst_ratio", "rule" => rule.clone()).set(worst);
        metrics::counter!("leasehold_admitted_tokens_total", "rule" => rule.clone())
            .absolute(admitted);
        metrics::gauge!("leasehold_key_calls_per_second_max", "rule" => rule.clone()).set(calls);
        metrics::gauge!("leasehold_split_keys", "rule" => rule).set(split as f64);
    }
}

/// Failed ticks, said without flooding the log: the first failure, then one line every
/// 30 s while they go on (with how many), and one when a tick succeeds again.
#[derive(Default)]
struct Failing {
    since: Option<std::time::Instant>,
    said: Option<std::time::Instant>,
    failed: u64,
}

impl Failing {
    const EVERY: Duration = Duration::from_secs(30);

    fn note(&mut self, result: Result<(), StoreError>) {
        let now = std::time::Instant::now();
        match result {
            Ok(()) => {
                if let Some(since) = self.since.take() {
                    tracing::info!(
                        failed = self.failed,
                        after_secs = since.elapsed().as_secs(),
                        "coordinator ticks succeed again"
                    );
                }
                self.failed = 0;
                self.said = None;
            }
            Err(e) => {
                self.failed += 1;
                self.since.get_or_insert(now);
                if self
                    .said
                    .is_none_or(|t| now.duration_since(t) >= Self::EVERY)
                {
                    self.said = Some(now);
                    tracing::warn!(
                        error = %e,
                        failed = self.failed,
                        "coordinator tick failed (said again every 30 s while ticks fail)"
                    );
                }
            }
        }
    }
}
