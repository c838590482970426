//! `simulate` across regions: a private redis-server per region and one for the global
//! buckets; agent `i` serves region `i % N` from the region's store; each region's
//! coordinator brokers its budget from the global store through a fault proxy that
//! delays each direction by half the round trip, and that `partition-region` /
//! `heal-region` cut and restore.
//!
//! The report has one row for the world (overshoot against the rule's `B + r*W`,
//! utilisation against one ideal bucket fed every region's arrivals) and one per region
//! (its decisions and their latency), then the calls across regions.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use leasehold::agent::{Limiter, LimiterConfig, RedisStore, Rules, StoreConfig};
use leasehold::coordinator::broker::Broker;
use leasehold::coordinator::{Coordinator, CoordinatorConfig};
use leasehold::core::model::region::BrokerConfig;
use leasehold_redis_harness::{Fault, FaultProxy, RedisServer};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::report::{self, SystemReport};
use super::run::{Keys, Run, worker};
use super::systems::{RULE, System};
use super::{Options, RunReport};

/// What crossed between regions and the global store.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct RegionsSummary {
    pub(crate) regions: usize,
    pub(crate) rtt_ms: f64,
    /// Calls from the brokers to the global store.
    pub(crate) cross_calls: u64,
    pub(crate) cross_calls_per_sec: f64,
    pub(crate) cross_calls_per_1k_decisions: f64,
    /// Keys brokered at the end, over all regions.
    pub(crate) keys: usize,
    /// After each change of phase: ms until a 100 ms window worldwide admitted at least
    /// 95% of the rate (`None`: not within the phase).
    pub(crate) recovery_ms: Vec<Option<u64>>,
    /// After each `heal-region`: ms until every region admits within 15% of an even
    /// part of what the world admits (500 ms windows); `None`: not by the run's end.
    pub(crate) even_after_heal_ms: Vec<Option<u64>>,
}

fn region_name(k: usize) -> String {
    format!("r{k}")
}

/// Runs Leasehold across the scenario's regions.
pub(crate) fn run(opts: &Options) -> Result<RunReport, String> {
    let sc = &opts.scenario;
    let n = sc.regions.unwrap_or(1);
    let rtt = sc.rtt()?;
    let rule = sc.validate()?;
    let spec = {
        let mut spec = sc.rule.clone();
        spec.scope.get_or_insert_with(|| "global".into());
        spec
    };
    let rules = Rules::from_rules([
        leasehold::core::rule::Rule::from_spec(RULE, &spec).map_err(|e| e.to_string())?
    ]);
    let e = |e: leasehold_redis_harness::HarnessError| e.to_string();
    let global = RedisServer::start().map_err(e)?;
    let stores: Vec<RedisServer> = (0..n)
        .map(|_| RedisServer::start().map_err(e))
        .collect::<Result<_, _>>()?;
    let links: Vec<FaultProxy> = (0..n)
        .map(|_| {
            let p = FaultProxy::start(global.addr()).map_err(e)?;
            p.set_latency(rtt / 2);
            Ok::<_, String>(p)
        })
        .collect::<Result<_, _>>()?;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let capacity = rule.capacity().get() as f64;
    let rate = rule.rate().per_sec_f64();
    let duration_ms = opts.duration.as_millis() as u64;
    rt.block_on(async {
        let mut brokers = Vec::new();
        let mut running = Vec::new();
        let mut limiters = Vec::new();
        for (k, store) in stores.iter().enumerate() {
            let regional = RedisStore::connect(&store.url(), StoreConfig::default())
                .await
                .map_err(|e| format!("region {k}: {e}"))?;
            let mut gc = StoreConfig::default();
            gc.call_timeout = Duration::from_secs(1);
            let to_global = RedisStore::connect(&links[k].url(), gc)
                .await
                .map_err(|e| format!("region {k}: global store: {e}"))?;
            let c = Coordinator::new(
                regional.clone(),
                rules.clone(),
                CoordinatorConfig::default(),
            );
            let broker = Broker::new(
                &region_name(k),
                regional,
                to_global,
                c.rules(),
                BrokerConfig::default(),
            );
            brokers.push(broker.clone());
            running.push(Arc::new(c.with_broker(broker)).spawn());
        }
        for agent in 0..sc.agents {
            let k = agent % n;
            let l = Limiter::builder()
                .redis(stores[k].url())
                .rules(rules.clone())
                .config({
                    let mut c = sc.agent.apply(LimiterConfig::default())?;
                    c.region = Some(region_name(k));
                    c
                })
                .build()
                .await
                .map_err(|e| format!("agent {agent} (region {k}): {e}"))?;
            limiters.push(Mutex::new(Some(l)));
        }
        let sys = Arc::new(System::Leasehold {
            agents: limiters,
            crashed_calls: AtomicU64::new(0),
        });
        let run = Arc::new(Run {
            keys: Keys::new(sc),
            scenario: sc.clone(),
            start: Instant::now(),
            warm_up: Duration::ZERO,
            duration: opts.duration,
            clock: quanta::Clock::new(),
            stop: AtomicBool::new(false),
        });
        let mut tasks = Vec::new();
        for agent in 0..sc.agents {
            for thread in 0..sc.threads_per_agent {
                let t = tokio::spawn(worker(sys.clone(), run.clone(), agent, thread, opts.seed));
                tasks.push((agent % n, t));
            }
        }
        let mut faults: Vec<_> = sc
            .faults
            .iter()
            .filter(|f| f.action.ends_with("-region"))
            .collect();
        faults.sort_by(|a, b| a.at.total_cmp(&b.at));
        let mut faults = faults.into_iter().peekable();
        while run.start.elapsed() < opts.duration {
            let frac = run.frac(run.start.elapsed());
            while let Some(f) = faults.next_if(|f| f.at <= frac) {
                let link = &links[f.region.unwrap_or(0)];
                if f.action == "partition-region" {
                    link.set(Fault::Blackhole);
                } else {
                    link.set(Fault::Pass);
                    link.cut();
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut per_region: Vec<report::Recording> =
            (0..n).map(|_| report::Recording::new()).collect();
        for (k, t) in tasks {
            per_region[k].merge(t.await.map_err(|e| format!("worker: {e}"))?);
        }
        let calls = sys.redis_calls();
        let keys = brokers.iter().map(|b| b.keys()).sum();
        let cross_calls: u64 = brokers
            .iter()
            .map(|b| b.stats().global_calls.load(Ordering::Relaxed))
            .sum();
        sys.finish().await;
        for r in running {
            r.stop().await;
        }
        let mut all = report::Recording::new();
        for r in &per_region {
            all.merge(r.clone());
        }
        let decisions = all.decisions;
        let world = report::analyze(all, capacity, rate, 0, duration_ms, calls);
        let secs = opts.duration.as_secs_f64();
        let recovery_ms = sc
            .phases
            .iter()
            .skip(1)
            .map(|p| recovery(&world.series, p.at, &sc.phases, rate, duration_ms))
            .collect();
        let mut systems: Vec<(String, SystemReport)> = vec![("world".into(), world)];
        let mut region_series = Vec::new();
        for (k, r) in per_region.into_iter().enumerate() {
            let mut rep = report::analyze(r, capacity, rate, 0, duration_ms, 0);
            region_series.push(rep.series.clone());
            // A region alone has no bound or ideal of its own: only the world's count.
            rep.overshoot_1s = f64::NAN;
            rep.overshoot_10s = f64::NAN;
            rep.utilization = f64::NAN;
            rep.denied_below_limit = 0;
            rep.seconds_within_limit = 0;
            systems.push((format!("region {}", region_name(k)), rep));
        }
        let even_after_heal_ms = sc
            .faults
            .iter()
            .filter(|f| f.action == "heal-region")
            .map(|f| even_after(&region_series, f.at, duration_ms))
            .collect();
        Ok(RunReport {
            plot: String::new(),
            systems,
            coordinator: None,
            agent_faults: None,
            regions: Some(RegionsSummary {
                regions: n,
                rtt_ms: rtt.as_secs_f64() * 1e3,
                cross_calls,
                cross_calls_per_sec: cross_calls as f64 / secs,
                cross_calls_per_1k_decisions: cross_calls as f64 * 1000.0 / decisions.max(1) as f64,
                keys,
                recovery_ms,
                even_after_heal_ms,
            }),
            rlqs: None,
        })
    })
}

/// Ms from fraction `at` of the run until, over 500 ms, every region's admissions are
/// within 15% of the regions' mean (`series`: tokens/s per 100 ms, per region).
fn even_after(series: &[Vec<f64>], at: f64, total_ms: u64) -> Option<u64> {
    let from = (at * total_ms as f64 / 100.0).ceil() as usize;
    let len = series.iter().map(Vec::len).min().unwrap_or(0);
    (from..len.saturating_sub(5)).find_map(|i| {
        let sums: Vec<f64> = series.iter().map(|s| s[i..i + 5].iter().sum()).collect();
        let mean = sums.iter().sum::<f64>() / sums.len() as f64;
        (mean > 0.0 && sums.iter().all(|x| (x - mean).abs() <= 0.15 * mean))
            .then(|| ((i - from) as u64) * 100)
    })
}

/// Ms from the phase starting at fraction `at` until a 100 ms window of `series`
/// (admitted tokens/s of key 0, per 100 ms) reaches 95% of `rate`, within the phase.
fn recovery(
    series: &[f64],
    at: f64,
    phases: &[super::scenario::Phase],
    rate: f64,
    total_ms: u64,
) -> Option<u64> {
    let from = (at * total_ms as f64 / 100.0).ceil() as usize;
    let end = phases
        .iter()
        .map(|p| p.at)
        .find(|&a| a > at)
        .map_or(series.len(), |a| {
            ((a * total_ms as f64 / 100.0) as usize).min(series.len())
        });
    (from..end)
        .find(|&i| series[i] >= 0.95 * rate)
        .map(|i| ((i - from) as u64) * 100)
}
