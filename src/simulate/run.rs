//! One run: the workers that offer the scenario's load to each system in turn, the
//! coordinator beside Leasehold, and what they measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leasehold::agent::Rules;
use leasehold::core::rule::Rule;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::cores::RedisCore;
use super::env::{self, Env, StoreChoice, Target, rss_mb};
use super::report::{self};
use super::scenario::{Pace, Scenario};
use super::systems::{Outcome, RULE, System};
use super::{CoordinatorSummary, Options, RunReport, regions, systems_json, write_outputs};

/// Picks keys: uniform, or Zipf through a cumulative table and a guide table into it
/// (`guide[j]`: the first key whose cumulative weight reaches `j / GUIDE`), so a pick
/// searches a few neighbouring entries instead of the whole table: the same key for the
/// same draw, without twenty cache misses over a million keys.
pub(super) struct Keys {
    pub(super) names: Vec<String>,
    pub(super) cdf: Option<(Vec<f64>, Vec<u32>)>,
}

/// Cells of the guide table.
pub(super) const GUIDE: usize = 1 << 16;

impl Keys {
    pub(super) fn new(s: &Scenario) -> Self {
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

    pub(super) fn pick(&self, rng: &mut SmallRng) -> u32 {
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

pub(super) fn pick_cost(costs: &[(u64, f64)], total: f64, rng: &mut SmallRng) -> u64 {
    let mut u = rng.random::<f64>() * total;
    for &(c, w) in costs {
        if u < w {
            return c;
        }
        u -= w;
    }
    costs[costs.len() - 1].0
}

pub(super) struct Run {
    pub(super) scenario: Scenario,
    pub(super) keys: Keys,
    pub(super) start: Instant,
    /// Before `duration`: the first phase, recorded only for the ideal bucket's level.
    pub(super) warm_up: Duration,
    pub(super) duration: Duration,
    pub(super) clock: quanta::Clock,
    pub(super) stop: AtomicBool,
}

impl Run {
    /// How far into the scenario (its phases, its faults) the run is `elapsed` after its
    /// start: 0 during the warm-up, 1 at its end.
    pub(super) fn frac(&self, elapsed: Duration) -> f64 {
        elapsed.saturating_sub(self.warm_up).as_secs_f64() / self.duration.as_secs_f64()
    }
}

pub(super) async fn worker(
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
        if elapsed >= run.warm_up + run.duration || run.stop.load(Ordering::Relaxed) {
            break;
        }
        let frac = run.frac(elapsed);
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
                // Never past the run's end: an agent offered a decision every few minutes
                // (a `total` far below the fleet's size) would hold the run open for them.
                let end = run.start + run.warm_up + run.duration;
                tokio::time::sleep_until(next.min(end)).await;
                if next > end {
                    elapsed = run.start.elapsed();
                    continue;
                }
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
        // Whether the decision waited (for the store): then the other tasks ran meanwhile.
        let mut waited = false;
        let mut decision = std::pin::pin!(sys.decide(
            limiter.as_ref(),
            agent,
            key,
            &run.keys.names[key as usize],
            cost,
        ));
        let outcome = std::future::poll_fn(|cx| {
            let p = decision.as_mut().poll(cx);
            waited |= p.is_pending();
            p
        })
        .await;
        let counted = elapsed >= run.warm_up;
        if let Some(t0) = t0
            && counted
        {
            let _ = rec
                .latency
                .record(run.clock.delta_as_nanos(t0, run.clock.raw()).max(1));
        }
        elapsed = run.start.elapsed();
        let ms = elapsed.as_millis() as u64;
        rec.decisions += u64::from(counted);
        match outcome {
            Outcome::Admitted => {
                rec.admitted += u64::from(counted);
                rec.add(key, ms, cost, true);
            }
            Outcome::Denied => {
                rec.denied += u64::from(counted);
                rec.add(key, ms, cost, false);
            }
            Outcome::Unavailable => {
                rec.unavailable += u64::from(counted);
                rec.add(key, ms, cost, false);
            }
        }
        i += 1;
        // A gateway serves each request as a task of its own, so the runtime polls I/O
        // between requests; a worker deciding flat out lets the other tasks run every
        // YIELD_EVERY (by time: 64 decisions would hold a thread for 200 µs where each
        // goes to the store, and a store reply would wait for every worker's turn).
        // A decision that waited has let them run: its caller decides again at once (and
        // joins the batch its agent's sender takes next).
        if waited {
            last_yield = elapsed;
        } else if elapsed.saturating_sub(last_yield) >= YIELD_EVERY {
            last_yield = elapsed;
            tokio::task::yield_now().await;
        }
    }
    rec
}

/// How long a simulated gateway's worker decides before letting other tasks run.
pub(super) const YIELD_EVERY: Duration = Duration::from_micros(20);

/// An in-process coordinator of Leasehold's run, which faults stop and start.
pub(super) struct CoordinatorRun {
    pub(super) store: leasehold::agent::RedisStore,
    pub(super) rules: Rules,
    pub(super) split_above: f64,
    pub(super) running: Option<leasehold::coordinator::Running>,
    pub(super) summary: CoordinatorSummary,
}

impl CoordinatorRun {
    pub(super) async fn connect(
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

    pub(super) fn start(&mut self) {
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

    pub(super) async fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            let c = running.coordinator().clone();
            // The agents' last reports (written as they shut down) are read before the
            // figures are taken: a short run's would otherwise be missing.
            let _ = c.tick().await;
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
        let plot = write_outputs(opts, &json, &title, rate, &report.systems)?;
        return Ok(RunReport { plot, ..report });
    }
    let rule = opts.scenario.validate()?;
    let rules =
        Rules::from_rules([Rule::from_spec(RULE, &opts.scenario.rule).map_err(|e| e.to_string())?]);
    let machine_cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Before the runtime's threads start: they inherit the cores left to this process.
    let redis_core = match opts.store {
        StoreChoice::Spawn | StoreChoice::SpawnReplica if !opts.shared_cores => {
            RedisCore::reserve()?
        }
        _ => None,
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    if let Some(core) = &redis_core {
        println!(
            "redis-server on core {} of its own, the agents and the load on the other {cores} \
             (--shared-cores: all share them)",
            core.core()
        );
    }
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
    let progress = indicatif::ProgressBar::new(
        (opts.warm_up + opts.duration).as_millis() as u64 * names.len() as u64,
    );
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
    let mut rlqs = None;
    for (n, name) in names.iter().enumerate() {
        progress.set_prefix(name.clone());
        let mut env = Env::start(&opts.store)?;
        env.pin(redis_core.as_ref())?;
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
                    opts.scenario.rlqs_servers,
                )
                .await
                .map_err(|e| format!("{name} on the store {}: {e}", env.describe()))?,
            );
            let run = Arc::new(Run {
                keys: Keys::new(&opts.scenario),
                scenario: opts.scenario.clone(),
                start: Instant::now(),
                warm_up: opts.warm_up,
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
            let whole = opts.warm_up + opts.duration;
            let base = n as u64 * whole.as_millis() as u64;
            // Store calls and the store's usage from the end of the warm-up on (from the
            // start without one, so that every call is counted).
            let target = env.target();
            let mut before = if opts.warm_up.is_zero() {
                Some((0, target.usage_us().await))
            } else {
                None
            };
            let mut faults: Vec<_> = opts
                .scenario
                .faults
                .iter()
                .filter(|f| !f.action.ends_with("-agent"))
                .collect();
            faults.sort_by(|a, b| a.at.total_cmp(&b.at));
            let mut faults = faults.into_iter().peekable();
            while run.start.elapsed() < whole {
                progress.set_position(base + run.start.elapsed().as_millis() as u64);
                if before.is_none() && run.start.elapsed() >= opts.warm_up {
                    before = Some((sys.redis_calls(), target.usage_us().await));
                }
                let frac = run.frac(run.start.elapsed());
                while let Some(f) = faults.next_if(|f| f.at <= frac) {
                    match (f.action.as_str(), coordinator.as_mut()) {
                        ("stop-coordinator", Some(c)) => c.stop().await,
                        ("start-coordinator", Some(c)) => c.start(),
                        ("stop-coordinator" | "start-coordinator", None) => {}
                        // Restarting a node blocks this thread; the workers run on the
                        // runtime's.
                        _ => {
                            env.fault(&f.action, &naive_offline)?;
                            env.pin(redis_core.as_ref())?;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let mut all = report::Recording::new();
            for t in tasks {
                all.merge(t.await.map_err(|e| format!("worker: {e}"))?);
            }
            let (calls_before, usage_before) = before.unwrap_or((0, None));
            let calls = sys.redis_calls() - calls_before;
            let usage_after = target.usage_us().await;
            if let Some(f) = sys.agent_faults() {
                agent_faults = Some(f);
            }
            let rss = rss_mb();
            let store_mb = env.target().memory_mb().await;
            if let Some(q) = sys.rlqs_summary(run.start.elapsed().as_secs_f64()) {
                rlqs = Some(q);
            }
            let ids = sys.finish().await;
            if let Some(c) = coordinator.as_mut() {
                c.stop().await;
                summary = Some(c.summary.clone());
            }
            // On an operator's store, the run's agents leave no entry behind (their bucket
            // records expire by themselves).
            if let Env::External(t) = &env {
                env::forget_agents(t, &ids).await;
            }
            let mut report = report::analyze(
                all,
                capacity,
                rate,
                opts.warm_up.as_millis() as u64,
                opts.duration.as_millis() as u64,
                calls,
            );
            report.rss_mb = rss;
            report.rss_growth_mb = rss - rss_before;
            report.store_mb = store_mb;
            if let (Some(before), Some(after)) = (usage_before, usage_after) {
                let us = after.0.saturating_sub(before.0) as f64;
                report.store_cpu_s = Some(us / 1e6);
                // A system that makes no store calls (governor) costs the store nothing:
                // what Redis spent meanwhile is its own idling.
                report.store_cpu_us_per_decision =
                    (calls > 0).then(|| us / report.decisions.max(1) as f64);
                report.store_scripts_s = Some(after.1.saturating_sub(before.1) as f64 / 1e6);
            }
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
        "warm_up_s": opts.warm_up.as_secs_f64(),
        "seed": opts.seed,
        "rule": { "capacity": rule.capacity().get(), "rate_per_sec": rate, "mode": format!("{:?}", rule.mode()) },
        // The cores this process could use; the runtime's (less Redis's own, if it has one).
        "machine": {
            "cores": machine_cores,
            "runtime_cores": cores,
            "redis_core": redis_core.as_ref().map(RedisCore::core),
        },
        "systems": systems_json(&systems),
        "coordinator": summary,
        "agent_faults": agent_faults,
    });
    let title = format!(
        "{}: admitted tokens/s for tenant-0, {} agents, {} store",
        opts.scenario.name, opts.scenario.agents, store
    );
    let plot = write_outputs(opts, &json, &title, rate, &systems)?;
    Ok(RunReport {
        systems,
        coordinator: summary,
        regions: None,
        agent_faults,
        rlqs,
        plot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

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
