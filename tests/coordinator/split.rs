//! Hot-key splitting on a 6-node Redis Cluster, end to end: six agents hammer one key,
//! the coordinator sees its store calls pass the per-shard budget and splits it into
//! three parts on the three shards, the agents follow, and the admitted total stays
//! within `B + r*t` throughout. The coordinator is then stopped and restarted: the
//! agents see nothing of it, and the new coordinator extends the same split.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::{Decision, Limiter, RedisStore};
use leasehold_coordinator::{Coordinator, CoordinatorConfig, Running};
use leasehold_core::{BucketKey, RuleName};
use leasehold_redis_harness::Cluster;

/// The split's term: each extension sets its end this far ahead.
const TERM_SECS: u64 = 8;

const RULES: &str =
    "[rules.api]\ncapacity = 2000\nrate = \"20000/s\"\nleasing = \"lease\"\nlease_max = 4\n";

/// `FCALL`s served so far by each primary, by port.
fn fcalls(c: &Cluster) -> BTreeMap<u16, u64> {
    let mut out = BTreeMap::new();
    for n in c.topology().unwrap().into_iter().filter(|n| n.primary) {
        let info: String = c
            .node(n.port)
            .unwrap()
            .cmd(&["INFO", "commandstats"])
            .unwrap();
        let calls = info
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_fcall:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        out.insert(n.port, calls);
    }
    out
}

/// Per-primary FCALL rates over `secs` seconds from now.
async fn rates(c: &Cluster, secs: f64) -> BTreeMap<u16, f64> {
    let a = fcalls(c);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let b = fcalls(c);
    b.iter()
        .map(|(p, n)| (*p, (n - a[p]) as f64 / secs))
        .collect()
}

fn spread(r: &BTreeMap<u16, f64>) -> String {
    r.iter()
        .map(|(p, v)| format!(":{p} {v:.0}/s"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn start_coordinator(store: &RedisStore, split_above: f64) -> Running {
    let config = {
        let mut c = CoordinatorConfig::default();
        c.split.split_above = split_above;
        c.split.merge_below = split_above / 4.0;
        c.split.term = Duration::from_secs(TERM_SECS);
        c
    };
    let rules = support::rules(RULES);
    Arc::new(Coordinator::new(store.clone(), rules, config)).spawn()
}

async fn split_fields(store: &RedisStore, key: &BucketKey) -> (u64, u64, u64) {
    let (f, _, now) = store.bucket(key).await.unwrap();
    let generation = f.get("sg").and_then(|v| v.parse().ok()).unwrap_or(0u64);
    match leasehold_store::wire::decode_split(f.get("sp").map(String::as_str), generation) {
        Some(s) => (s.parts, s.gen_us, s.until_us.saturating_sub(now) / 1000),
        None => (0, 0, 0),
    }
}

#[test]
fn a_split_spreads_a_hot_key_over_three_shards_and_the_bound_holds() {
    let c = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    let key = BucketKey::new(&RuleName::new("api").unwrap(), "hot").unwrap();
    support::runtime().block_on(async {
        let store = RedisStore::connect_cluster(&c.urls(), support::config())
            .await
            .unwrap();
        let mut agents = Vec::new();
        for id in 1..=6u64 {
            // Ids 1..=6: two agents on each of the three parts (part = id % 3).
            let builder = Limiter::builder().cluster(c.urls()).agent_id(id);
            agents.push(support::limiter_with(builder, RULES).await);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let load: Vec<_> = agents
            .iter()
            .map(|l| support::hammer(l, "hot", "api", &stop, &admitted))
            .collect();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let before = rates(&c, 2.0).await;
        let owner = c.owner(key.slot()).unwrap().port;
        let total_before: f64 = before.values().sum();
        println!("before the split: {}", spread(&before));
        assert!(
            before[&owner] > 0.95 * total_before,
            "one shard serves the key: {before:?}"
        );

        // The coordinator splits once the key's calls pass a third of what we measured.
        let budget = total_before / 3.0;
        let running = start_coordinator(&store, budget);
        let waited = Instant::now();
        while split_fields(&store, &key).await.0 == 0 {
            assert!(
                waited.elapsed() < Duration::from_secs(15),
                "no split within 15 s at {total_before:.0} calls/s against a budget of {budget:.0}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (parts, generation, _) = split_fields(&store, &key).await;
        println!(
            "split into {parts} after {:?} (budget {budget:.0} calls/s)",
            waited.elapsed()
        );
        assert_eq!(parts, 3);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let after = rates(&c, 2.0).await;
        println!("after the split: {}", spread(&after));
        let total_after: f64 = after.values().sum();
        for (port, r) in &after {
            assert!(
                *r > total_after / 6.0,
                "shard :{port} takes part of the load: {after:?}"
            );
        }
        let view = running.coordinator().snapshot().read().keys[key.as_str()].clone();
        println!(
            "coordinator: {:.0} calls/s, {} admitted in the last second, overshoot {:.4}",
            view.stats.calls_per_sec, view.stats.admitted_last_sec, view.stats.overshoot
        );
        assert_eq!(view.stats.overshoot, 0.0, "{view:?}");

        // Stop the coordinator: the agents keep the split (its term runs on) and their
        // decisions do not change.
        running.stop().await;
        let without = rates(&c, 2.0).await;
        println!("coordinator stopped: {}", spread(&without));
        for (port, r) in &without {
            assert!(*r > total_after / 6.0, "still spread: {without:?} on :{port}");
        }
        // A new coordinator extends the same split.
        let (_, _, left_before) = split_fields(&store, &key).await;
        let running = start_coordinator(&store, budget);
        tokio::time::sleep(Duration::from_millis(3000)).await;
        let (parts_now, generation_now, left) = split_fields(&store, &key).await;
        println!(
            "restarted: split generation {generation_now} (was {generation}), term left {left} ms (was {left_before} ms)"
        );
        assert_eq!((parts_now, generation_now), (3, generation));
        assert!(left > left_before, "the new coordinator extends the term");

        // The heat passes: one agent goes on at 200 decisions/s. Its calls fall under a
        // quarter of the budget, the coordinator stops extending the term, the term
        // lapses and the parent serves again, with the agent hardly ever refused.
        stop.store(true, Ordering::Relaxed);
        for t in load {
            t.await.unwrap();
        }
        // Saturated until now, through the split, the stop and the restart: the total
        // is within one bucket's bound.
        let hot_t = started.elapsed().as_secs_f64();
        let hot_admitted = admitted.load(Ordering::Relaxed);
        let hot_bound = 2000.0 + 20000.0 * hot_t;
        println!("saturated phase: admitted {hot_admitted} in {hot_t:.2} s; bound B + r*t = {hot_bound:.0}");
        assert!(hot_admitted as f64 <= hot_bound);
        let paced_stop = Arc::new(AtomicBool::new(false));
        let paced_denied = Arc::new(AtomicU64::new(0));
        let paced = {
            let (l, stop, admitted, denied) = (
                agents[0].clone(),
                paced_stop.clone(),
                admitted.clone(),
                paced_denied.clone(),
            );
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(5));
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    match l.check(&"api".into(), "hot", 1).await.unwrap() {
                        Decision::Allowed { .. } => admitted.fetch_add(1, Ordering::Relaxed),
                        _ => denied.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        };
        let cooled = Instant::now();
        while split_fields(&store, &key).await.0 != 0 {
            assert!(
                cooled.elapsed() < Duration::from_secs(TERM_SECS + 10),
                "the split did not end after the heat passed"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!("merged {:?} after the heat passed", cooled.elapsed());
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let merged = rates(&c, 2.0).await;
        println!("after the merge: {}", spread(&merged));
        let total_merged: f64 = merged.values().sum();
        assert!(
            merged[&owner] > 0.9 * total_merged,
            "the parent's shard serves the key again: {merged:?}"
        );
        paced_stop.store(true, Ordering::Relaxed);
        paced.await.unwrap();
        let refused = paced_denied.load(Ordering::Relaxed);
        println!("paced agent refused {refused} times through the merge");
        // The parent resumes empty (what the parts held is unknown to it, so it cannot
        // be handed back without risking B + r*W): a refusal or two as it refills.
        assert!(refused <= 5, "200/s on a 20 000/s key is refused {refused} times");
        let t = started.elapsed().as_secs_f64();
        let admitted = admitted.load(Ordering::Relaxed);
        let bound = 2000.0 + 20000.0 * t;
        println!("admitted {admitted} in {t:.2} s; bound B + r*t = {bound:.0}");
        assert!(admitted as f64 <= bound);
        running.stop().await;
    });
}
