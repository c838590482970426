//! Three regions on real Redis: a global store and one store per region, each region's
//! broker (a coordinator with `--region`) reaching the global store through a proxy with
//! 40 ms each way (an 80 ms round trip), agents in each region offering 1.5x the rule's
//! rate between them, and region 0 cut off from the global store for 3 s.
//!
//! Checked: in every 1 s window the regions together admit at most `B + r*W` (I1 across
//! regions, scope global, floor 0); the cut-off region serves what it holds until its
//! term ends, then nothing, until the link heals, and then serves again; the other two
//! keep serving through the partition; calls across regions stay a handful per second per
//! key and region, whatever the decisions.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::{Decision, Limiter, LimiterConfig};
use leasehold_coordinator::broker::Broker;
use leasehold_coordinator::{Coordinator, CoordinatorConfig};
use leasehold_core::model::region::BrokerConfig;
use leasehold_redis_harness::{Fault, FaultProxy};
use parking_lot::Mutex;

/// B = 400 and r = 400/s worldwide; a term (the lease TTL at the global bucket) of 1 s.
const RULES: &str = "[rules.api]\ncapacity = 400\nrate = \"400/s\"\nleasing = \"lease\"\n\
                     lease_ttl = \"1s\"\ngrace = \"200ms\"\nscope = \"global\"\n";
const REGIONS: usize = 3;
/// Offered per region: 200/s (600/s in all, 1.5x r).
const PER_10MS: u64 = 2;
const RUN: Duration = Duration::from_secs(12);
const CUT: (u64, u64) = (4_000, 7_000);

#[test]
fn three_regions_share_one_global_bucket_through_a_partition() {
    let global = support::server();
    let stores: Vec<_> = (0..REGIONS).map(|_| support::server()).collect();
    let links: Vec<FaultProxy> = (0..REGIONS)
        .map(|_| {
            let p = FaultProxy::start(global.addr()).expect("proxy");
            p.set_latency(Duration::from_millis(40));
            p
        })
        .collect();
    support::runtime().block_on(async {
        let rules = support::rules(RULES);
        // A plain coordinator on the global store: the brokers' reports give it every
        // region's grants, which it accounts against B + r*W (the global picture).
        let home_coordinator = Arc::new(Coordinator::new(
            support::store(&global.url()).await,
            rules.clone(),
            CoordinatorConfig::default(),
        ))
        .spawn();
        let mut coordinators = Vec::new();
        let mut brokers = Vec::new();
        let mut agents = Vec::new();
        for k in 0..REGIONS {
            let region = format!("r{k}");
            let regional = support::store(&stores[k].url()).await;
            let mut gc = support::config();
            gc.call_timeout = Duration::from_secs(1);
            let to_global = leasehold_agent::RedisStore::connect(&links[k].url(), gc)
                .await
                .expect("global store through the link");
            let c = Coordinator::new(
                regional.clone(),
                rules.clone(),
                CoordinatorConfig::default(),
            );
            let broker = Broker::new(
                &region,
                regional,
                to_global,
                c.rules(),
                BrokerConfig::default(),
            );
            brokers.push(broker.clone());
            coordinators.push(Arc::new(c.with_broker(broker)).spawn());
            let l = Limiter::builder()
                .redis(stores[k].url())
                .rules(rules.clone())
                .config({
                    let mut c = LimiterConfig::default();
                    c.store = support::config();
                    c.region = Some(region);
                    c
                })
                .build()
                .await
                .expect("limiter");
            agents.push(l);
        }
        // Admissions per region, by ms since the start.
        let start = Instant::now();
        let log: Arc<Vec<Mutex<Vec<u64>>>> =
            Arc::new((0..REGIONS).map(|_| Mutex::new(Vec::new())).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for (k, l) in agents.iter().enumerate() {
            let (l, log, stop) = (l.clone(), log.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    for _ in 0..PER_10MS {
                        match l.check(&"api".into(), "tenant", 1).await.unwrap() {
                            Decision::Allowed { .. } => {
                                log[k].lock().push(start.elapsed().as_millis() as u64);
                            }
                            Decision::Denied { .. } => {}
                            d => panic!("region {k}: {d:?}"),
                        }
                    }
                }
            }));
        }
        tokio::time::sleep_until((start + Duration::from_millis(CUT.0)).into()).await;
        links[0].set(Fault::Blackhole);
        tokio::time::sleep_until((start + Duration::from_millis(CUT.1)).into()).await;
        links[0].set(Fault::Pass);
        links[0].cut();
        tokio::time::sleep_until((start + RUN).into()).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        let secs = RUN.as_secs_f64();
        let calls: Vec<u64> = brokers
            .iter()
            .map(|b| b.stats().global_calls.load(Ordering::Relaxed))
            .collect();
        // Each broker reports its grants to the global store as an agent reports to its
        // coordinator: a coordinator there accounts every region's grants.
        let home = support::store(&global.url()).await;
        let members: Vec<String> = home
            .query(redis::cmd("ZRANGE").arg("lh:agents").arg(0).arg(-1))
            .await
            .expect("brokers in lh:agents");
        assert_eq!(members.len(), REGIONS, "{members:?}");
        let mut granted = 0;
        for m in &members {
            let text: String = home
                .query(redis::cmd("GET").arg(format!("lh:agent:{{{m}}}")))
                .await
                .expect("a broker's report");
            let r = leasehold_store::report::Report::parse(&text);
            let key = leasehold_core::BucketKey::new(
                &leasehold_core::RuleName::new("api").unwrap(),
                "tenant",
            )
            .unwrap();
            granted += r.keys.get(key.as_str()).map_or(0, |k| k.admitted);
        }
        let bound = 400 + 400 * RUN.as_secs();
        println!("granted to the regions, by their reports: {granted} (bound {bound})");
        assert!(granted > 0 && granted <= bound, "{granted}");
        for c in coordinators {
            c.stop().await;
        }
        let home = home_coordinator.coordinator().snapshot().read().clone();
        home_coordinator.stop().await;
        let key = leasehold_core::BucketKey::new(
            &leasehold_core::RuleName::new("api").unwrap(),
            "tenant",
        )
        .unwrap();
        let g = home
            .keys
            .get(key.as_str())
            .expect("the global key in the home coordinator's view");
        println!(
            "home coordinator: {} regions report, {} granted, worst overshoot {}",
            g.stats.agents, g.stats.admitted_total, g.stats.worst_overshoot
        );
        assert_eq!(g.stats.agents, REGIONS);
        assert!(g.stats.admitted_total > 0);
        assert_eq!(g.stats.worst_overshoot, 0.0);
        let per_ms: Vec<Vec<u64>> = log
            .iter()
            .map(|l| {
                let mut v = vec![0u64; RUN.as_millis() as usize + 1000];
                for &t in l.lock().iter() {
                    v[t as usize] += 1;
                }
                v
            })
            .collect();
        let sum = |k: usize, from: u64, to: u64| -> u64 {
            per_ms[k][from as usize..to as usize].iter().sum()
        };
        for (k, c) in calls.iter().enumerate() {
            let per_s: Vec<u64> = (0..RUN.as_secs())
                .map(|s| sum(k, s * 1000, s * 1000 + 1000))
                .collect();
            println!(
                "region {k}: admitted per second {per_s:?}, global calls {:.1}/s",
                *c as f64 / secs
            );
        }
        // I1 across regions: every window of 1 s admits at most B + r*W = 800.
        let total: Vec<u64> = (0..per_ms[0].len())
            .map(|i| (0..REGIONS).map(|k| per_ms[k][i]).sum())
            .collect();
        let worst = total
            .windows(1000)
            .map(|w| w.iter().sum::<u64>())
            .max()
            .unwrap_or(0);
        println!("worst 1 s window worldwide: {worst} (bound 800)");
        assert!(worst <= 800, "global overshoot: {worst} admitted in 1 s");
        // The cut-off region: its term (1 s) and a margin past the cut, nothing.
        let quiet = sum(0, CUT.0 + 1_300, CUT.1);
        assert_eq!(
            quiet, 0,
            "region 0 admitted {quiet} past its term while cut off"
        );
        // The others keep serving through it, and region 0 serves again after it heals.
        for k in 1..REGIONS {
            let during = sum(k, CUT.0 + 1_300, CUT.1);
            assert!(
                during > 200,
                "region {k} admitted only {during} during the partition"
            );
        }
        let after = sum(0, CUT.1 + 2_000, RUN.as_millis() as u64);
        assert!(
            after > 100,
            "region 0 admitted only {after} after the link healed"
        );
        // Calls across regions: about ten a second per key and region, not per decision.
        for (k, c) in calls.iter().enumerate() {
            assert!(
                (*c as f64 / secs) < 30.0,
                "region {k}: {c} global calls in {secs} s"
            );
        }
    });
}

/// A broker feeds at most its `max_keys`: a further key is refused (counted) and its
/// region serves it at its floor only (none here: denied), not at the global store's cost.
#[test]
fn a_broker_feeds_at_most_its_max_keys() {
    let global = support::server();
    let store = support::server();
    support::runtime().block_on(async {
        let rules = support::rules(RULES);
        let regional = support::store(&store.url()).await;
        let c = Coordinator::new(
            regional.clone(),
            rules.clone(),
            CoordinatorConfig::default(),
        );
        let broker = Broker::new(
            "r0",
            regional,
            support::store(&global.url()).await,
            c.rules(),
            BrokerConfig::default(),
        );
        broker.set_max_keys(1);
        let running = Arc::new(c.with_broker(broker.clone())).spawn();
        let l = Limiter::builder()
            .redis(store.url())
            .rules(rules)
            .config({
                let mut c = LimiterConfig::default();
                c.store = support::config();
                c.region = Some("r0".into());
                c
            })
            .build()
            .await
            .expect("limiter");
        let deadline = Instant::now() + Duration::from_secs(10);
        let (mut first, mut second) = (0, 0);
        let fed = |a: u64, b: u64| a + b > 0;
        while Instant::now() < deadline
            && (!fed(first, second) || broker.stats().keys_refused.load(Ordering::Relaxed) == 0)
        {
            if let Decision::Allowed { .. } = l.check(&"api".into(), "first", 1).await.unwrap() {
                first += 1;
            }
            if let Decision::Allowed { .. } = l.check(&"api".into(), "second", 1).await.unwrap() {
                second += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!(
            "first {first}, second {second}, keys {}, refused {}",
            broker.keys(),
            broker.stats().keys_refused.load(Ordering::Relaxed)
        );
        assert_eq!(broker.keys(), 1);
        assert!(broker.stats().keys_refused.load(Ordering::Relaxed) > 0);
        // One of the two keys is fed, the other is not (whichever was announced first).
        assert!(
            (first > 0) != (second > 0),
            "first {first}, second {second}"
        );
        running.stop().await;
    });
}
