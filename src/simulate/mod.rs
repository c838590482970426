//! `leasehold simulate`: many agents against one global store under a workload, with
//! Leasehold, the naive per-request Lua token bucket (one script call per decision) and
//! governor (local only) measured one after the other in the same process, and reported
//! side by side.
//!
//! Each agent is one `Limiter` (its own connections, its own leases), as each gateway
//! would have; its threads are tasks on one tokio runtime. Governor gets, per agent, an
//! even share of the rule (`r / agents`, `B / agents`): the usual way to run a local-only
//! limiter behind a load balancer.

mod regions;
mod report;
mod scenario;

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use governor::{Quota, RateLimiter};
use leasehold::agent::{Decision, EmbeddedStore, Limiter, LimiterConfig, Rules, Store};
use leasehold::core::rule::Rule;
use leasehold_redis_harness::{Cluster, FaultProxy, RedisServer, ReplicaPair};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

pub(crate) use report::SystemReport;
use scenario::Pace;
pub(crate) use scenario::{BUILT_IN, Scenario};

/// Where the global buckets live.
#[derive(Clone, Debug)]
pub(crate) enum StoreChoice {
    /// In this process.
    Embedded,
    /// A private redis-server.
    Spawn,
    /// A private primary and replica behind a virtual address that a failover moves.
    SpawnReplica,
    /// A private 6-node cluster.
    ClusterSpawn,
    /// A Redis already running.
    Redis(String),
    /// A Redis Cluster already running, by seed nodes.
    Cluster(Vec<String>),
}

impl std::str::FromStr for StoreChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embedded" => Ok(Self::Embedded),
            "spawn" => Ok(Self::Spawn),
            "spawn-replica" => Ok(Self::SpawnReplica),
            "cluster-spawn" => Ok(Self::ClusterSpawn),
            url if url.starts_with("redis://") => Ok(Self::Redis(url.to_owned())),
            list if list.starts_with("cluster://") => Ok(Self::Cluster(
                list["cluster://".len()..]
                    .split(',')
                    .filter(|n| !n.is_empty())
                    .map(|n| format!("redis://{n}"))
                    .collect(),
            )),
            other => Err(format!(
                "unknown store {other:?}: embedded, spawn (a private redis-server), spawn-replica, \
                 cluster-spawn, redis://HOST:PORT or cluster://HOST:PORT,HOST:PORT"
            )),
        }
    }
}

/// What a system's agents connect to.
#[derive(Clone)]
enum Target {
    Embedded(EmbeddedStore),
    Redis(String),
    Cluster(Vec<String>),
}

impl Target {
    /// The memory Redis uses (`used_memory`, MB), for a single Redis.
    async fn memory_mb(&self) -> Option<f64> {
        let Self::Redis(url) = self else {
            return None;
        };
        let client = redis::Client::open(url.as_str()).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut c)
            .await
            .ok()?;
        let bytes: f64 = info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))?
            .trim()
            .parse()
            .ok()?;
        Some(bytes / 1e6)
    }
}

/// This process's resident memory, MB.
fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1000.0)
}

/// The store of one system's run, started fresh for it so that faults in one run never
/// leak into the next.
enum Env {
    Embedded(EmbeddedStore),
    External(Target),
    Single(RedisServer),
    Pair { pair: ReplicaPair, vip: FaultProxy },
    Cluster(Cluster),
}

impl Env {
    fn start(choice: &StoreChoice) -> Result<Self, String> {
        let e = |e: leasehold_redis_harness::HarnessError| e.to_string();
        Ok(match choice {
            StoreChoice::Embedded => Self::Embedded(EmbeddedStore::new()),
            // `hz 100`, as the README advises for a long tail of cold keys: Redis's
            // active expiry then pauses at most about 2.5 ms a cycle, not 25 ms.
            StoreChoice::Spawn => {
                Self::Single(RedisServer::start_with(&["--hz", "100"]).map_err(e)?)
            }
            StoreChoice::SpawnReplica => {
                let pair = ReplicaPair::start().map_err(e)?;
                let vip = FaultProxy::start(pair.primary.addr()).map_err(e)?;
                Self::Pair { pair, vip }
            }
            StoreChoice::ClusterSpawn => Self::Cluster(Cluster::start().map_err(e)?),
            StoreChoice::Redis(url) => Self::External(Target::Redis(url.clone())),
            StoreChoice::Cluster(nodes) => Self::External(Target::Cluster(nodes.clone())),
        })
    }

    fn target(&self) -> Target {
        match self {
            Self::Embedded(s) => Target::Embedded(s.clone()),
            Self::External(t) => t.clone(),
            Self::Single(server) => Target::Redis(server.url()),
            Self::Pair { vip, .. } => Target::Redis(vip.url()),
            Self::Cluster(c) => Target::Cluster(c.urls()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Embedded(_) => "embedded".into(),
            Self::External(Target::Redis(u)) => u.clone(),
            Self::External(Target::Cluster(n)) => format!("cluster {}", n.join(",")),
            Self::External(Target::Embedded(_)) => "embedded".into(),
            Self::Single(_) => "spawn".into(),
            Self::Pair { .. } => "spawn-replica".into(),
            Self::Cluster(_) => "cluster-spawn (3 primaries, 3 replicas)".into(),
        }
    }

    /// Checks that the scenario's faults can happen to this store.
    fn supports(choice: &StoreChoice, action: &str) -> bool {
        match action {
            "crash-agent" | "leave-agent" | "join-agent" => true,
            "kill-store" | "restore-store" => {
                matches!(choice, StoreChoice::Embedded | StoreChoice::Spawn)
            }
            "promote-replica" | "stall-replication" => {
                matches!(choice, StoreChoice::SpawnReplica)
            }
            "stop-coordinator" | "start-coordinator" => !matches!(choice, StoreChoice::Embedded),
            _ => false,
        }
    }

    /// Makes a store fault happen; `naive_offline` is the embedded naive bucket's switch.
    fn fault(&mut self, action: &str, naive_offline: &AtomicBool) -> Result<(), String> {
        match (action, self) {
            ("kill-store", Self::Embedded(s)) => {
                s.set_offline(true);
                naive_offline.store(true, Ordering::Release);
            }
            ("restore-store", Self::Embedded(s)) => {
                s.set_offline(false);
                naive_offline.store(false, Ordering::Release);
            }
            ("kill-store", Self::Single(server)) => server.kill(),
            ("restore-store", Self::Single(server)) => {
                server.restart().map_err(|e| e.to_string())?
            }
            ("stall-replication", Self::Pair { pair, .. }) => {
                pair.link.set(leasehold_redis_harness::Fault::Blackhole);
            }
            ("promote-replica", Self::Pair { pair, vip }) => {
                pair.fail_over().map_err(|e| e.to_string())?;
                vip.set_upstream(pair.replica.addr());
                vip.cut();
                pair.rejoin().map_err(|e| e.to_string())?;
            }
            (action, _) => return Err(format!("fault {action} does not apply to this store")),
        }
        Ok(())
    }
}

/// What to run.
pub(crate) struct Options {
    pub(crate) scenario: Scenario,
    pub(crate) store: StoreChoice,
    pub(crate) duration: Duration,
    pub(crate) compare: Vec<String>,
    pub(crate) json: Option<PathBuf>,
    pub(crate) plot: Option<PathBuf>,
    pub(crate) seed: u64,
    pub(crate) progress: bool,
}

const RULE: &str = "sim";

/// The naive baseline: a per-request token bucket in one Lua script call (seed 003,
/// with the decision made atomically in the script).
const NAIVE_LUA: &str = include_str!("naive.lua");

/// Per key: tokens (fractional, as the seed's script) and the last refill, µs.
type NaiveShard = Mutex<std::collections::HashMap<u32, (f64, u64)>>;

enum Naive {
    Redis(redis::aio::ConnectionManager, redis::Script),
    Cluster(redis::cluster_async::ClusterConnection, redis::Script),
    Embedded(Arc<Vec<NaiveShard>>, Arc<AtomicBool>),
}

enum System {
    Leasehold {
        agents: Vec<Mutex<Option<Limiter>>>,
        crashed_calls: AtomicU64,
    },
    Naive {
        naive: Naive,
        calls: AtomicU64,
        cap: f64,
        rate: f64,
    },
    Governor(Vec<governor::DefaultKeyedRateLimiter<u32>>),
}

enum Outcome {
    Admitted,
    Denied,
    Unavailable,
}

impl System {
    #[allow(clippy::too_many_arguments)] // one call per system and run
    async fn build(
        name: &str,
        rule: &Rule,
        rules: &Rules,
        agents: usize,
        tuning: &scenario::AgentTuning,
        target: &Target,
        naive_offline: &Arc<AtomicBool>,
    ) -> Result<Self, String> {
        match name {
            "leasehold" => {
                let config = tuning.apply(LimiterConfig::default())?;
                let mut limiters = Vec::with_capacity(agents);
                for _ in 0..agents {
                    let b = Limiter::builder()
                        .rules(rules.clone())
                        .config(config.clone());
                    let b = match target {
                        Target::Embedded(store) => b.store(Store::Embedded(store.clone())),
                        Target::Redis(url) => b.redis(url),
                        Target::Cluster(nodes) => b.cluster(nodes.clone()),
                    };
                    limiters.push(Mutex::new(Some(
                        b.build().await.map_err(|e| e.to_string())?,
                    )));
                }
                Ok(Self::Leasehold {
                    agents: limiters,
                    crashed_calls: AtomicU64::new(0),
                })
            }
            "naive" => {
                let script = redis::Script::new(NAIVE_LUA);
                let naive = match target {
                    Target::Redis(url) => {
                        let client =
                            redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
                        let conn = redis::aio::ConnectionManager::new(client)
                            .await
                            .map_err(|e| e.to_string())?;
                        Naive::Redis(conn, script)
                    }
                    Target::Cluster(nodes) => {
                        let client = redis::cluster::ClusterClient::new(nodes.clone())
                            .map_err(|e| e.to_string())?;
                        let conn = client
                            .get_async_connection()
                            .await
                            .map_err(|e| e.to_string())?;
                        Naive::Cluster(conn, script)
                    }
                    Target::Embedded(_) => Naive::Embedded(
                        Arc::new((0..64).map(|_| Mutex::default()).collect()),
                        naive_offline.clone(),
                    ),
                };
                Ok(Self::Naive {
                    naive,
                    calls: AtomicU64::new(0),
                    cap: rule.capacity().get() as f64,
                    rate: rule.rate().per_sec_f64(),
                })
            }
            "governor" => {
                let n = agents as f64;
                let period = Duration::from_secs_f64(n / rule.rate().per_sec_f64());
                let burst =
                    NonZeroU32::new(((rule.capacity().get() as f64 / n).ceil() as u32).max(1))
                        .unwrap_or(NonZeroU32::MIN);
                let quota = Quota::with_period(period)
                    .ok_or("governor cannot express this rate")?
                    .allow_burst(burst);
                Ok(Self::Governor(
                    (0..agents).map(|_| RateLimiter::keyed(quota)).collect(),
                ))
            }
            other => Err(format!("unknown system {other:?}: naive, governor")),
        }
    }

    fn limiter(&self, agent: usize) -> Option<Limiter> {
        match self {
            Self::Leasehold { agents, .. } => agents[agent].lock().clone(),
            _ => None,
        }
    }

    /// The agent leaves the fleet in good order: its leases go back, it stops.
    async fn leave(&self, agent: usize) {
        if let Self::Leasehold {
            agents,
            crashed_calls,
        } = self
        {
            let taken = agents[agent].lock().take();
            if let Some(l) = taken {
                l.shutdown().await;
                crashed_calls.fetch_add(
                    l.stats(RULE).map_or(0, |s| s.store_calls),
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// The agent dies: its leases are abandoned, nothing is returned.
    fn crash(&self, agent: usize) {
        if let Self::Leasehold {
            agents,
            crashed_calls,
        } = self
            && let Some(l) = agents[agent].lock().take()
        {
            crashed_calls.fetch_add(
                l.stats(RULE).map_or(0, |s| s.store_calls),
                Ordering::Relaxed,
            );
        }
    }

    async fn decide(
        &self,
        limiter: Option<&Limiter>,
        agent: usize,
        key: u32,
        subject: &str,
        cost: u64,
    ) -> Outcome {
        match self {
            Self::Leasehold { .. } => match limiter {
                Some(l) => match l.check(&RULE.into(), subject, cost).await {
                    Ok(Decision::Allowed { .. }) => Outcome::Admitted,
                    Ok(Decision::Denied { .. }) | Err(_) => Outcome::Denied,
                    Ok(Decision::Unavailable { .. }) => Outcome::Unavailable,
                },
                None => Outcome::Unavailable,
            },
            Self::Naive {
                naive,
                calls,
                cap,
                rate,
            } => {
                calls.fetch_add(1, Ordering::Relaxed);
                let invoke = |script| naive_call(script, subject, *cap, *rate, cost);
                let answer = |r: Result<i64, redis::RedisError>| match r {
                    Ok(1) => Outcome::Admitted,
                    Ok(_) => Outcome::Denied,
                    Err(_) => Outcome::Unavailable,
                };
                match naive {
                    Naive::Redis(conn, script) => {
                        answer(invoke(script).invoke_async(&mut conn.clone()).await)
                    }
                    Naive::Cluster(conn, script) => {
                        answer(invoke(script).invoke_async(&mut conn.clone()).await)
                    }
                    Naive::Embedded(_, offline) if offline.load(Ordering::Acquire) => {
                        Outcome::Unavailable
                    }
                    Naive::Embedded(shards, _) => {
                        let mut shard = shards[key as usize % shards.len()].lock();
                        // The clock is read under the lock, as TIME is inside the script:
                        // a time read before waiting could move `ts` back and count
                        // the same interval twice.
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_micros() as u64);
                        let (tokens, ts) = shard.entry(key).or_insert((*cap, now));
                        *tokens = (*tokens + now.saturating_sub(*ts) as f64 * rate / 1e6).min(*cap);
                        *ts = (*ts).max(now);
                        if *tokens >= cost as f64 {
                            *tokens -= cost as f64;
                            Outcome::Admitted
                        } else {
                            Outcome::Denied
                        }
                    }
                }
            }
            Self::Governor(limiters) => {
                let n = NonZeroU32::new(cost as u32).unwrap_or(NonZeroU32::MIN);
                match limiters[agent].check_key_n(&key, n) {
                    Ok(Ok(())) => Outcome::Admitted,
                    _ => Outcome::Denied,
                }
            }
        }
    }

    /// What the live agents' counters say about the store's health during the run.
    fn agent_faults(&self) -> Option<AgentFaults> {
        let Self::Leasehold { agents, .. } = self else {
            return None;
        };
        let mut f = AgentFaults::default();
        for a in agents {
            if let Some(s) = a.lock().as_ref().and_then(|l| l.stats(RULE).ok()) {
                f.store_errors += s.store_errors;
                f.emergency_activations += s.emergency_activations;
                f.admitted_emergency += s.admitted_emergency;
                f.admitted_fail_open += s.admitted_fail_open;
                f.unavailable += s.unavailable;
            }
        }
        Some(f)
    }

    fn redis_calls(&self) -> u64 {
        match self {
            Self::Leasehold {
                agents,
                crashed_calls,
            } => {
                crashed_calls.load(Ordering::Relaxed)
                    + agents
                        .iter()
                        .filter_map(|a| {
                            a.lock()
                                .as_ref()
                                .map(|l| l.stats(RULE).map_or(0, |s| s.store_calls))
                        })
                        .sum::<u64>()
            }
            Self::Naive { calls, .. } => calls.load(Ordering::Relaxed),
            Self::Governor(_) => 0,
        }
    }

    async fn finish(&self) {
        if let Self::Leasehold { agents, .. } = self {
            let limiters: Vec<Limiter> = agents.iter().filter_map(|a| a.lock().clone()).collect();
            for l in limiters {
                l.shutdown().await;
            }
        }
    }
}

/// One call of the naive script for `subject`.
fn naive_call<'a>(
    script: &'a redis::Script,
    subject: &str,
    cap: f64,
    rate: f64,
    cost: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = script.key(format!("naive:{{{subject}}}"));
    inv.arg(cap).arg(rate).arg(cost);
    inv
}

/// Picks keys: uniform, or Zipf through a cumulative table and a guide table into it
/// (`guide[j]`: the first key whose cumulative weight reaches `j / GUIDE`), so a pick
/// searches a few neighbouring entries instead of the whole table: the same key for the
/// same draw, without twenty cache misses over a million keys.
struct Keys {
    names: Vec<String>,
    cdf: Option<(Vec<f64>, Vec<u32>)>,
}

/// Cells of the guide table.
const GUIDE: usize = 1 << 16;

impl Keys {
    fn new(s: &Scenario) -> Self {
        let n = s.keys.count as usize;
        let names = (0..n).map(|i| format!("tenant-{i}")).collect();
        let cdf = (s.keys.distribution == "zipf").then(|| {
            let mut acc = 0.0;
            let mut cdf: Vec<f64> = (1..=n)
                .map(|k| {
                    acc += 1.0 / (k as f64).powf(s.keys.zipf_s);
                    acc
                })
                .collect();
            for c in &mut cdf {
                *c /= acc;
            }
            let guide = (0..=GUIDE)
                .map(|j| cdf.partition_point(|&c| c < j as f64 / GUIDE as f64) as u32)
                .collect();
            (cdf, guide)
        });
        Self { names, cdf }
    }

    fn pick(&self, rng: &mut SmallRng) -> u32 {
        match &self.cdf {
            None => rng.random_range(0..self.names.len()) as u32,
            Some((cdf, guide)) => {
                let u: f64 = rng.random();
                // cdf[guide[j]] >= j/GUIDE, and u < (j + 1)/GUIDE <= cdf[guide[j + 1]]
                // (or past the end): the first entry >= u lies between the two.
                let j = ((u * GUIDE as f64) as usize).min(GUIDE - 1);
                let (lo, hi) = (
                    guide[j] as usize,
                    (guide[j + 1] as usize + 1).min(cdf.len()),
                );
                (lo + cdf[lo..hi].partition_point(|&c| c < u)).min(cdf.len() - 1) as u32
            }
        }
    }
}

fn pick_cost(costs: &[(u64, f64)], total: f64, rng: &mut SmallRng) -> u64 {
    let mut u = rng.random::<f64>() * total;
    for &(c, w) in costs {
        if u < w {
            return c;
        }
        u -= w;
    }
    costs[costs.len() - 1].0
}

struct Run {
    scenario: Scenario,
    keys: Keys,
    start: Instant,
    duration: Duration,
    clock: quanta::Clock,
    stop: AtomicBool,
}

async fn worker(
    sys: Arc<System>,
    run: Arc<Run>,
    agent: usize,
    thread: usize,
    seed: u64,
) -> report::Recording {
    let mut rng = SmallRng::seed_from_u64(seed ^ ((agent as u64) << 16) ^ thread as u64);
    let mut rec = report::Recording::new();
    let limiter = sys.limiter(agent);
    let sc = &run.scenario;
    let total_weight: f64 = sc.costs.iter().map(|c| c.1).sum();
    let fault_at = |action: &str| {
        sc.faults
            .iter()
            .find(|f| f.agent == Some(agent) && f.action == action)
            .map(|f| f.at)
    };
    let (crash_at, leave_at, join_at) = (
        fault_at("crash-agent"),
        fault_at("leave-agent"),
        fault_at("join-agent"),
    );
    let threads = sc.threads_per_agent as f64;
    let mut next = Instant::now();
    let mut i = 0u64;
    let phase16 = rng.random_range(0..16u64);
    let mut paced = (&sc.phases[0], sc.phases[0].pace(agent, sc.agents));
    // Read once per decision, after it: a clock read costs a local decision's time.
    let mut elapsed = run.start.elapsed();
    let mut last_yield = elapsed;
    loop {
        if elapsed >= run.duration || run.stop.load(Ordering::Relaxed) {
            break;
        }
        let frac = elapsed.as_secs_f64() / run.duration.as_secs_f64();
        if crash_at.is_some_and(|c| frac >= c) {
            sys.crash(agent);
            break;
        }
        if leave_at.is_some_and(|c| frac >= c) {
            if thread == 0 {
                sys.leave(agent).await;
            }
            break;
        }
        // The pace is worked out once per phase, not per decision.
        let phase = sc.phase_at(frac);
        if !std::ptr::eq(phase, paced.0) {
            paced = (phase, phase.pace(agent, sc.agents));
        }
        let pace = paced.1;
        if pace == Pace::Idle || join_at.is_some_and(|j| frac < j) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            next = Instant::now();
            elapsed = run.start.elapsed();
            continue;
        }
        if let Pace::Rate(rate) = pace {
            next += Duration::from_secs_f64(threads / rate);
            let now = Instant::now();
            if next > now + Duration::from_millis(1) {
                tokio::time::sleep_until(next).await;
            } else if next + Duration::from_millis(100) < now {
                next = now;
            }
        }
        let key = run.keys.pick(&mut rng);
        let cost = pick_cost(&sc.costs, total_weight, &mut rng);
        // One decision in 16 is timed, from a random phase: every worker's first decision
        // (a new key: always a store call) must not weigh 16 times the others.
        let sample = (i + phase16).is_multiple_of(16);
        let t0 = sample.then(|| run.clock.raw());
        let outcome = sys
            .decide(
                limiter.as_ref(),
                agent,
                key,
                &run.keys.names[key as usize],
                cost,
            )
            .await;
        if let Some(t0) = t0 {
            let _ = rec
                .latency
                .record(run.clock.delta_as_nanos(t0, run.clock.raw()).max(1));
        }
        elapsed = run.start.elapsed();
        let ms = elapsed.as_millis() as u64;
        rec.decisions += 1;
        match outcome {
            Outcome::Admitted => {
                rec.admitted += 1;
                rec.add(key, ms, cost, true);
            }
            Outcome::Denied => {
                rec.denied += 1;
                rec.add(key, ms, cost, false);
            }
            Outcome::Unavailable => {
                rec.unavailable += 1;
                rec.add(key, ms, cost, false);
            }
        }
        i += 1;
        // A gateway serves each request as a task of its own, so the runtime polls I/O
        // between requests; a worker deciding flat out lets the other tasks run every
        // YIELD_EVERY (by time: 64 decisions would hold a thread for 200 µs where each
        // goes to the store, and a store reply would wait for every worker's turn).
        if elapsed.saturating_sub(last_yield) >= YIELD_EVERY {
            last_yield = elapsed;
            tokio::task::yield_now().await;
        }
    }
    rec
}

/// How long a simulated gateway's worker decides before letting other tasks run.
const YIELD_EVERY: Duration = Duration::from_micros(20);

/// The whole report of a run.
pub(crate) struct RunReport {
    pub(crate) systems: Vec<(String, SystemReport)>,
    /// What the coordinator saw during Leasehold's run (Redis stores).
    pub(crate) coordinator: Option<CoordinatorSummary>,
    /// A run across regions: what crossed between them.
    pub(crate) regions: Option<regions::RegionsSummary>,
    /// The store's health as Leasehold's agents saw it.
    pub(crate) agent_faults: Option<AgentFaults>,
}

/// The store's health as Leasehold's agents saw it (summed over the agents alive at the
/// end of the run): a run whose store stalled shows it here, not only as denials.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct AgentFaults {
    pub(crate) store_errors: u64,
    pub(crate) emergency_activations: u64,
    pub(crate) admitted_emergency: u64,
    pub(crate) admitted_fail_open: u64,
    pub(crate) unavailable: u64,
}

/// The coordinator's view of Leasehold's run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct CoordinatorSummary {
    /// Splits started (over every coordinator instance of the run).
    pub(crate) splits: u64,
    /// The largest overshoot against `B + r*W` it measured (1-10 s windows).
    pub(crate) worst_overshoot: f64,
    /// Tokens admitted by the agents, by their reports.
    pub(crate) admitted: u64,
    /// Coordinator instances started (a stop-coordinator fault ends one).
    pub(crate) instances: u64,
}

/// An in-process coordinator of Leasehold's run, which faults stop and start.
struct CoordinatorRun {
    store: leasehold::agent::RedisStore,
    rules: Rules,
    split_above: f64,
    running: Option<leasehold::coordinator::Running>,
    summary: CoordinatorSummary,
}

impl CoordinatorRun {
    async fn connect(
        target: &Target,
        rules: &Rules,
        split_above: f64,
    ) -> Result<Option<Self>, String> {
        use leasehold::agent::{RedisStore, StoreConfig};
        let store = match target {
            Target::Embedded(_) => return Ok(None),
            Target::Redis(url) => RedisStore::connect(url, StoreConfig::default()).await,
            Target::Cluster(nodes) => {
                RedisStore::connect_cluster(nodes, StoreConfig::default()).await
            }
        }
        .map_err(|e| format!("coordinator: {e}"))?;
        let mut c = Self {
            store,
            rules: rules.clone(),
            split_above,
            running: None,
            summary: CoordinatorSummary::default(),
        };
        c.start();
        Ok(Some(c))
    }

    fn start(&mut self) {
        if self.running.is_some() {
            return;
        }
        let config = {
            let mut c = leasehold::coordinator::CoordinatorConfig::default();
            c.split.split_above = self.split_above;
            c.split.merge_below = self.split_above / 4.0;
            c.split.term = Duration::from_secs(30);
            c
        };
        let c = Arc::new(leasehold::coordinator::Coordinator::new(
            self.store.clone(),
            self.rules.clone(),
            config,
        ));
        self.summary.instances += 1;
        self.running = Some(c.spawn());
    }

    async fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            let c = running.coordinator().clone();
            running.stop().await;
            let snap = c.snapshot().read().clone();
            self.summary.splits += snap.splits_started;
            self.summary.admitted += snap
                .keys
                .values()
                .map(|k| k.stats.admitted_total)
                .sum::<u64>();
            self.summary.worst_overshoot = snap
                .keys
                .values()
                .map(|k| k.stats.worst_overshoot)
                .fold(self.summary.worst_overshoot, f64::max);
        }
    }
}

/// Each system's report by its name, as the JSON report holds them.
fn systems_json(systems: &[(String, SystemReport)]) -> serde_json::Map<String, serde_json::Value> {
    systems
        .iter()
        .map(|(n, r)| (n.clone(), serde_json::to_value(r).unwrap_or_default()))
        .collect()
}

/// Writes the JSON report and the plot the options ask for.
fn write_outputs(
    opts: &Options,
    json: &serde_json::Value,
    title: &str,
    rate: f64,
    systems: &[(String, SystemReport)],
) -> Result<(), String> {
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(json).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &opts.plot {
        let series: Vec<(String, Vec<f64>)> = systems
            .iter()
            .map(|(n, r)| (n.clone(), r.series.clone()))
            .collect();
        std::fs::write(path, report::svg(title, rate, &series))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Runs every system on the scenario and reports.
pub(crate) fn run(opts: &Options) -> Result<RunReport, String> {
    if opts.scenario.regions.is_some() {
        let report = regions::run(opts)?;
        let json = serde_json::json!({
            "scenario": opts.scenario.name,
            "agents": opts.scenario.agents,
            "duration_s": opts.duration.as_secs_f64(),
            "seed": opts.seed,
            "systems": systems_json(&report.systems),
            "regions": report.regions,
        });
        let title = format!(
            "{}: admitted tokens/s for tenant-0, worldwide and per region",
            opts.scenario.name
        );
        let rate = opts.scenario.validate()?.rate().per_sec_f64();
        write_outputs(opts, &json, &title, rate, &report.systems)?;
        return Ok(report);
    }
    let rule = opts.scenario.validate()?;
    let rules =
        Rules::from_rules([Rule::from_spec(RULE, &opts.scenario.rule).map_err(|e| e.to_string())?]);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    for f in &opts.scenario.faults {
        if !Env::supports(&opts.store, &f.action) {
            return Err(format!(
                "scenario {}: fault {} needs another store (kill-store/restore-store: embedded or \
                 spawn; promote-replica: spawn-replica)",
                opts.scenario.name, f.action
            ));
        }
    }
    let mut store_name = String::new();
    let mut names = vec!["leasehold".to_owned()];
    names.extend(opts.compare.iter().cloned());
    let progress =
        indicatif::ProgressBar::new(opts.duration.as_millis() as u64 * names.len() as u64);
    if opts.progress {
        progress.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix:>10} [{bar:40}] {elapsed} / about {duration}",
            )
            .map_err(|e| e.to_string())?,
        );
    } else {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let capacity = rule.capacity().get() as f64;
    let rate = rule.rate().per_sec_f64();
    let mut systems = Vec::new();
    let mut summary = None;
    let mut agent_faults = None;
    for (n, name) in names.iter().enumerate() {
        progress.set_prefix(name.clone());
        let mut env = Env::start(&opts.store)?;
        store_name = env.describe();
        let naive_offline = Arc::new(AtomicBool::new(false));
        let rss_before = rss_mb();
        let report = rt.block_on(async {
            let sys = Arc::new(
                System::build(
                    name,
                    &rule,
                    &rules,
                    opts.scenario.agents,
                    &opts.scenario.agent,
                    &env.target(),
                    &naive_offline,
                )
                .await?,
            );
            let run = Arc::new(Run {
                keys: Keys::new(&opts.scenario),
                scenario: opts.scenario.clone(),
                start: Instant::now(),
                duration: opts.duration,
                clock: quanta::Clock::new(),
                stop: AtomicBool::new(false),
            });
            let mut coordinator = if name == "leasehold" {
                let split_above = opts.scenario.split_above.unwrap_or(5000.0);
                CoordinatorRun::connect(&env.target(), &rules, split_above).await?
            } else {
                None
            };
            let mut tasks = Vec::new();
            for agent in 0..opts.scenario.agents {
                for thread in 0..opts.scenario.threads_per_agent {
                    tasks.push(tokio::spawn(worker(
                        sys.clone(),
                        run.clone(),
                        agent,
                        thread,
                        opts.seed,
                    )));
                }
            }
            let base = n as u64 * opts.duration.as_millis() as u64;
            let mut faults: Vec<_> = opts
                .scenario
                .faults
                .iter()
                .filter(|f| !f.action.ends_with("-agent"))
                .collect();
            faults.sort_by(|a, b| a.at.total_cmp(&b.at));
            let mut faults = faults.into_iter().peekable();
            while run.start.elapsed() < opts.duration {
                progress.set_position(base + run.start.elapsed().as_millis() as u64);
                let frac = run.start.elapsed().as_secs_f64() / opts.duration.as_secs_f64();
                while let Some(f) = faults.next_if(|f| f.at <= frac) {
                    match (f.action.as_str(), coordinator.as_mut()) {
                        ("stop-coordinator", Some(c)) => c.stop().await,
                        ("start-coordinator", Some(c)) => c.start(),
                        ("stop-coordinator" | "start-coordinator", None) => {}
                        // Restarting a node blocks this thread; the workers run on the
                        // runtime's.
                        _ => env.fault(&f.action, &naive_offline)?,
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let mut all = report::Recording::new();
            for t in tasks {
                all.merge(t.await.map_err(|e| format!("worker: {e}"))?);
            }
            let calls = sys.redis_calls();
            if let Some(f) = sys.agent_faults() {
                agent_faults = Some(f);
            }
            let rss = rss_mb();
            let store_mb = env.target().memory_mb().await;
            sys.finish().await;
            if let Some(c) = coordinator.as_mut() {
                c.stop().await;
                summary = Some(c.summary.clone());
            }
            let mut report =
                report::analyze(all, capacity, rate, opts.duration.as_millis() as u64, calls);
            report.rss_mb = rss;
            report.rss_growth_mb = rss - rss_before;
            report.store_mb = store_mb;
            Ok::<_, String>(report)
        })?;
        systems.push((name.clone(), report));
    }
    progress.finish_and_clear();
    let store = store_name;
    let json = serde_json::json!({
        "scenario": opts.scenario.name,
        "store": store,
        "agents": opts.scenario.agents,
        "threads_per_agent": opts.scenario.threads_per_agent,
        "duration_s": opts.duration.as_secs_f64(),
        "seed": opts.seed,
        "rule": { "capacity": rule.capacity().get(), "rate_per_sec": rate, "mode": format!("{:?}", rule.mode()) },
        "machine": { "cores": cores },
        "systems": systems_json(&systems),
        "coordinator": summary,
        "agent_faults": agent_faults,
    });
    let title = format!(
        "{}: admitted tokens/s for tenant-0, {} agents, {} store",
        opts.scenario.name, opts.scenario.agents, store
    );
    write_outputs(opts, &json, &title, rate, &systems)?;
    Ok(RunReport {
        systems,
        coordinator: summary,
        regions: None,
        agent_faults,
    })
}

/// The summary table.
pub(crate) fn table(r: &RunReport) -> String {
    let mut out = format!(
        "{:<10} {:>13} {:>11} {:>11} {:>11} {:>12} {:>11} {:>12} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}\n",
        "system",
        "decisions/s",
        "admitted",
        "denied",
        "below_limit",
        "calls/1k",
        "overshoot1s",
        "overshoot10s",
        "utilization",
        "p50 ns",
        "p99 ns",
        "p99.9 ns",
        "RSS MB",
        "redis MB"
    );
    // A figure that does not apply to the row (a region's own overshoot) shows as "-".
    let f4 = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.4}")
        }
    };
    for (name, s) in &r.systems {
        out.push_str(&format!(
            "{:<10} {:>13.0} {:>11} {:>11} {:>11} {:>12.2} {:>11} {:>12} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}\n",
            name,
            s.decisions_per_sec,
            s.admitted,
            s.denied + s.unavailable,
            s.denied_below_limit,
            s.redis_calls_per_1k_decisions,
            f4(s.overshoot_1s),
            f4(s.overshoot_10s),
            f4(s.utilization),
            s.latency_ns.p50,
            s.latency_ns.p99,
            s.latency_ns.p999,
            format!("{:.0}{:+.0}", s.rss_mb, s.rss_growth_mb),
            s.store_mb.map_or_else(|| "-".to_owned(), |m| format!("{m:.0}"))
        ));
    }
    if let Some(g) = &r.regions {
        let rec: Vec<String> = g
            .recovery_ms
            .iter()
            .map(|m| m.map_or_else(|| "never".to_owned(), |m| format!("{m} ms")))
            .collect();
        out.push_str(&format!(
            "across {} regions ({:.0} ms round trip to the global store): {} calls to it, \
             {:.1}/s, {:.3} per 1k decisions, {} key(s) brokered; back above 95% of the rate \
             after each phase change: {}; regions even again after each heal: {}\n",
            g.regions,
            g.rtt_ms,
            g.cross_calls,
            g.cross_calls_per_sec,
            g.cross_calls_per_1k_decisions,
            g.keys,
            if rec.is_empty() {
                "-".to_owned()
            } else {
                rec.join(", ")
            },
            if g.even_after_heal_ms.is_empty() {
                "-".to_owned()
            } else {
                g.even_after_heal_ms
                    .iter()
                    .map(|m| m.map_or_else(|| "never".to_owned(), |m| format!("{m} ms")))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    if let Some(f) = &r.agent_faults {
        out.push_str(&format!(
            "agents (leasehold run): {} store errors, {} emergency activations, {} admitted under \
             the emergency limit, {} failing open, {} refused as unavailable\n",
            f.store_errors,
            f.emergency_activations,
            f.admitted_emergency,
            f.admitted_fail_open,
            f.unavailable
        ));
    }
    if let Some(c) = &r.coordinator {
        out.push_str(&format!(
            "coordinator (leasehold run, {} instance(s)): {} split(s) started; measured from agent \
             reports: {} tokens admitted, worst overshoot {:.4}\n",
            c.instances, c.splits, c.admitted, c.worst_overshoot
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The guide table only narrows the search: every draw picks the key a search of the
    /// whole cumulative table picks.
    #[test]
    fn guided_zipf_picks_what_the_whole_table_picks() {
        for (count, s) in [(1_000_000, 0.9), (1_000, 1.1), (3, 2.0)] {
            let mut sc = Scenario::built_in("zipf").expect("zipf");
            sc.keys.count = count;
            sc.keys.zipf_s = s;
            let keys = Keys::new(&sc);
            let (cdf, _) = keys.cdf.as_ref().expect("zipf");
            let (mut a, mut b) = (SmallRng::seed_from_u64(7), SmallRng::seed_from_u64(7));
            for _ in 0..200_000 {
                let u: f64 = b.random();
                let want = cdf.partition_point(|&c| c < u).min(cdf.len() - 1) as u32;
                assert_eq!(keys.pick(&mut a), want, "{count} keys, u = {u}");
            }
        }
    }
}
