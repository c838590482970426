//! The Limiter on a 6-node Redis Cluster: buckets spread over the shards, each shard has
//! its own breaker and bulkhead, and a frozen shard does not stall keys on the others.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use leasehold_agent::{Admission, Decision, Limiter, LimiterConfig};
use leasehold_core::{BucketKey, RuleName};
use leasehold_redis_harness::Cluster;

#[test]
fn a_frozen_shard_costs_its_own_keys_a_timeout_and_nothing_else() {
    let c = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    let rules = "[rules.api]\ncapacity = 1000000\nrate = \"1000000/s\"\nleasing = \"exact\"\ntimeout = \"100ms\"\n";
    // One subject per shard, by the primary that serves its slot.
    let rule = RuleName::new("api").unwrap();
    let mut by_shard: BTreeMap<u16, String> = BTreeMap::new();
    for i in 0..200 {
        let subject = format!("tenant-{i}");
        let owner = c
            .owner(BucketKey::new(&rule, &subject).unwrap().slot())
            .unwrap();
        by_shard.entry(owner.port).or_insert(subject);
    }
    assert_eq!(by_shard.len(), 3);
    let (&frozen_port, frozen_subject) = by_shard.iter().next().unwrap();
    let frozen_subject = frozen_subject.clone();
    let healthy: Vec<String> = by_shard.values().skip(1).cloned().collect();
    support::runtime().block_on(async {
        let l = Limiter::builder()
            .cluster(c.urls())
            .rules(support::rules(rules))
            .config({ let mut c = LimiterConfig::default(); c.store = support::config(); c })
            .build()
            .await
            .unwrap();
        assert_eq!(l.shards().len(), 4, "three primaries and the unassigned slots: {:?}", l.shards());
        for s in by_shard.values() {
            assert!(matches!(l.check(&"api".into(), s, 1).await.unwrap(), Decision::Allowed { via: Admission::Exact, .. }));
        }
        c.node(frozen_port).unwrap().pause().unwrap();
        let frozen = {
            let (l, s) = (l.clone(), frozen_subject.clone());
            tokio::spawn(async move {
                let (mut unavailable, mut worst) = (0, Duration::ZERO);
                let start = Instant::now();
                while start.elapsed() < Duration::from_millis(1200) {
                    let t = Instant::now();
                    if let Decision::Unavailable { .. } = l.check(&"api".into(), &s, 1).await.unwrap() {
                        unavailable += 1;
                    }
                    worst = worst.max(t.elapsed());
                    // The open breaker answers at once: let the other task run.
                    tokio::task::yield_now().await;
                }
                (unavailable, worst)
            })
        };
        let (mut ok, mut worst) = (0u64, Duration::ZERO);
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(1200) {
            for s in &healthy {
                let t = Instant::now();
                let d = l.check(&"api".into(), s, 1).await.unwrap();
                worst = worst.max(t.elapsed());
                assert!(matches!(d, Decision::Allowed { via: Admission::Exact, .. }), "healthy shard: {d:?}");
                ok += 1;
            }
        }
        let (unavailable, frozen_worst) = frozen.await.unwrap();
        c.node(frozen_port).unwrap().resume().unwrap();
        println!(
            "shard :{frozen_port} frozen 1.2s: its key got {unavailable} x 503 (slowest {frozen_worst:?}, timeout 100ms); \
             keys on the 2 other shards: {ok} decisions all admitted, slowest {worst:?}"
        );
        assert!(unavailable > 0);
        assert!(frozen_worst < Duration::from_millis(100 + 250), "{frozen_worst:?}");
        assert!(worst < Duration::from_millis(100), "a healthy shard's key waited {worst:?}");
        let recovered = Instant::now();
        while !matches!(l.check(&"api".into(), &frozen_subject, 1).await.unwrap(), Decision::Allowed { .. }) {
            assert!(recovered.elapsed() < Duration::from_secs(10), "no recovery after the thaw");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// Rules with a local share on a cluster: each rule's seats key lives on its own slot,
/// wherever that is, and every gateway (two here, two seats) spends its seat of every
/// rule without the store once its claims are answered.
#[test]
fn seats_are_claimed_on_whichever_shard_holds_their_rule() {
    let c = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    let names = ["a", "b", "c", "d", "e", "f"];
    let mut rules = String::new();
    for n in names {
        rules.push_str(&format!(
            "[rules.{n}]\ncapacity = 100\nrate = \"100/s\"\nlocal_percent = 50\nlocal_agents = 2\n"
        ));
    }
    let slots: std::collections::BTreeSet<u16> = names
        .iter()
        .map(|n| {
            c.owner(leasehold_core::key::slot_of(
                leasehold_core::local::seats_key(n).as_bytes(),
            ))
            .unwrap()
            .port
        })
        .collect();
    assert!(slots.len() >= 2, "the seats keys spread over shards");
    support::runtime().block_on(async {
        let mut fleet = Vec::new();
        for _ in 0..2 {
            fleet.push(
                Limiter::builder()
                    .cluster(c.urls())
                    .rules(support::rules(&rules))
                    .config({
                        let mut c = LimiterConfig::default();
                        c.store = support::config();
                        c
                    })
                    .build()
                    .await
                    .unwrap(),
            );
        }
        // Claimed at start; a new tenure's seat fills within one refill (1 s here).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for l in &fleet {
            for n in names {
                let d = l.check(&n.into(), "tenant", 1).await.unwrap();
                assert!(
                    matches!(
                        d,
                        Decision::Allowed {
                            via: Admission::Local,
                            ..
                        }
                    ),
                    "rule {n}: {d:?}"
                );
            }
        }
    });
}

/// A planned Redis Cluster failover (`CLUSTER FAILOVER` on the replica of the key's
/// primary) under load mints nothing: the primary pauses its clients until the replica
/// has every write, then the replica takes over and the client follows `MOVED`. The whole
/// run admits at most B + r·T, and the limiter decides on the new primary afterwards.
#[test]
fn a_planned_cluster_failover_under_load_admits_at_most_the_bound() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let c = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    c.wait_replicas_synced(Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e}"));
    let (capacity, rate) = (100u64, 10u64);
    let rule = RuleName::new("hot").unwrap();
    let slot = BucketKey::new(&rule, "tenant").unwrap().slot();
    let primary = c.owner(slot).unwrap();
    // The primary learns of its replica by gossip: synced replicas can still be missing
    // from its list for a moment on a busy machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let replicas: Vec<String> = loop {
        let r: Vec<String> = c
            .node(primary.port)
            .unwrap()
            .cmd(&["CLUSTER", "REPLICAS", &primary.id])
            .unwrap();
        if !r.is_empty() || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let replica_port: u16 = replicas
        .first()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|a| a.split(['@', ':']).nth(1))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no replica in {replicas:?}"));
    support::runtime().block_on(async {
        let limiter = Limiter::builder()
            .cluster(c.urls())
            .rules(support::rules(&format!(
                "[rules.hot]\ncapacity = {capacity}\nrate = \"{rate}/s\"\non_failure = \"fail_closed\"\n"
            )))
            .config({
                let mut c = LimiterConfig::default();
                c.store = support::config();
                c
            })
            .build()
            .await
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (l, stop, admitted) = (limiter.clone(), stop.clone(), admitted.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match l.check(&"hot".into(), "tenant", 1).await.expect("valid check") {
                            Decision::Allowed { .. } => {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => tokio::time::sleep(Duration::from_millis(2)).await,
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let replica = c.node(replica_port).unwrap();
        let ok: String = replica.cmd(&["CLUSTER", "FAILOVER"]).unwrap();
        assert_eq!(ok, "OK");
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.owner(slot).map(|o| o.port).ok() != Some(replica_port) {
            assert!(Instant::now() < deadline, "the replica never took over");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let before = admitted.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        let elapsed = started.elapsed().as_secs_f64();
        let bound = capacity + (rate as f64 * elapsed).ceil() as u64;
        let got = admitted.load(Ordering::Relaxed);
        eprintln!("cluster failover: {got} admitted in {elapsed:.1} s (bound {bound})");
        assert!(got <= bound, "{got} admitted against a bound of {bound}");
        assert!(got > before, "nothing admitted after the failover");
        limiter.shutdown().await;
    });
}
