//! Per-subject overrides end to end, on a real Redis: an overridden subject gets its own
//! B and r from the same rule, a reloaded file changes a live bucket (capacity shrinking
//! below the tokens it holds, a rate change), and the coordinator bounds the key by the
//! override's B and r.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::{Decision, Limiter};

fn rules_text(hot_capacity: u64, hot_rate: &str) -> String {
    format!(
        "[rules.api]\ncapacity = 10\nrate = \"1/m\"\nleasing = \"exact\"\ntimeout = \"2s\"\n\
         [rules.api.overrides.\"tenant-42\"]\ncapacity = {hot_capacity}\nrate = \"{hot_rate}\"\n"
    )
}

/// A limiter on `server` whose rules are the file at `path` (reloaded on demand).
async fn watching(
    server: &leasehold_redis_harness::RedisServer,
    path: &std::path::Path,
) -> Limiter {
    Limiter::builder()
        .redis(server.url())
        .rules_file(path)
        .config({
            let mut c = leasehold_agent::LimiterConfig::default();
            c.store = support::config();
            c
        })
        .build()
        .await
        .unwrap()
}

async fn admitted(l: &Limiter, subject: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if let Decision::Allowed { .. } = l.check(&"api".into(), subject, 1).await.unwrap() {
            ok += 1;
        }
    }
    ok
}

#[test]
fn a_live_bucket_follows_its_override_through_reloads() {
    let server = support::server();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, rules_text(1000, "1/m")).unwrap();
    support::runtime().block_on(async {
        let l = watching(&server, &path).await;
        // The rule's B for everyone else, the override's for tenant-42.
        assert_eq!(admitted(&l, "tenant-1", 20).await, 10);
        assert_eq!(admitted(&l, "tenant-42", 300).await, 300);
        assert_eq!(
            l.bucket_params_for(&"api".into(), "tenant-42")
                .unwrap()
                .capacity,
            1000
        );
        assert_eq!(
            l.bucket_params_for(&"api".into(), "tenant-1")
                .unwrap()
                .capacity,
            10
        );
        let key = "lh:{api|tenant-42}";
        assert!(support::field(&server, key, "tok") >= 690);

        // Capacity shrinks below the ~700 tokens the bucket holds: the next call clamps
        // the bucket to the new B (refill at 1/m adds nothing meanwhile, even on a busy box).
        std::fs::write(&path, rules_text(50, "1/m")).unwrap();
        l.reload_rules().unwrap();
        let n = admitted(&l, "tenant-42", 100).await;
        assert!(
            (50..=51).contains(&n),
            "{n} admitted after shrinking B to 50"
        );
        // A cost above the new capacity is refused by name, as for any rule.
        let e = l
            .check(&"api".into(), "tenant-42", 60)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("60") && e.contains("50"), "{e}");

        // A rate change applies from the next call: 200/s refills the empty bucket.
        std::fs::write(&path, rules_text(50, "200/s")).unwrap();
        l.reload_rules().unwrap();
        let since = Instant::now();
        let _ = l.check(&"api".into(), "tenant-42", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let n = admitted(&l, "tenant-42", 100).await as f64;
        // At least the 150 ms of refill, at most B plus the refill for as long as it
        // took (a loaded machine makes the checks slow, and the bucket refills meanwhile).
        let most = 50.0 + 200.0 * since.elapsed().as_secs_f64() + 1.0;
        assert!(
            (25.0..=most).contains(&n),
            "{n} admitted after the rate went to 200/s (at most {most})"
        );
        // The override removed: tenant-42 is back under the rule's B = 10.
        std::fs::write(
            &path,
            "[rules.api]\ncapacity = 10\nrate = \"1/m\"\nleasing = \"exact\"\ntimeout = \"2s\"\n",
        )
        .unwrap();
        l.reload_rules().unwrap();
        assert!(admitted(&l, "tenant-42", 20).await <= 11);
        // A refused file keeps the rules in force and says why, naming the override.
        std::fs::write(&path, rules_text(0, "1/m")).unwrap();
        let e = l.reload_rules().unwrap_err().to_string();
        assert!(e.contains("override \"tenant-42\": capacity"), "{e}");
        assert_eq!(
            l.bucket_params_for(&"api".into(), "tenant-1")
                .unwrap()
                .capacity,
            10
        );
    });
}

const FLEET_RULES: &str = "[rules.api]\ncapacity = 10\nrate = \"10/s\"\n\
    [rules.api.overrides.\"tenant-42\"]\ncapacity = 500\nrate = \"2000/s\"\nleasing = \"lease\"\n";

#[test]
fn the_coordinator_bounds_an_overridden_key_by_the_overrides_b_and_r() {
    let server = support::server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in 0..2 {
            agents.push(support::limiter(&server.url(), FLEET_RULES).await);
        }
        let store = support::store(&server.url()).await;
        let coordinator = support::coordinator(store, FLEET_RULES);
        let running = coordinator.clone().spawn();
        let stop = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let load: Vec<_> = agents
            .iter()
            .map(|l| support::hammer(l, "tenant-42", "api", &stop, &count))
            .collect();
        let key = "lh:{api|tenant-42}";
        let waited = Instant::now();
        let stats = loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let snap = coordinator.snapshot().read().clone();
            if let Some(k) = snap.keys.get(key)
                && k.stats.admitted_last_sec > 0
                && k.stats.agents == 2
            {
                break k.stats.clone();
            }
            assert!(
                waited.elapsed() < Duration::from_secs(15),
                "no accounting: {snap:?}"
            );
        };
        println!("{stats:?}");
        stop.store(true, Ordering::Relaxed);
        for t in load {
            t.await.unwrap();
        }
        running.stop().await;
        // Far above the rule's 10 + 10/s, within the override's 500 + 2000/s.
        assert!(stats.admitted_last_sec > 100, "{stats:?}");
        assert_eq!(stats.overshoot, 0.0, "{stats:?}");
    });
}

#[test]
fn a_long_subject_follows_its_override_through_reloads() {
    // A subject past the key map's inline length is kept there by its SHA-256: a reload
    // finds the live key's override by that digest.
    let long = format!("tenant-{}", "x".repeat(300));
    let text = |capacity: Option<u64>| {
        let mut t =
            "[rules.api]\ncapacity = 10\nrate = \"1/m\"\nleasing = \"exact\"\ntimeout = \"2s\"\n"
                .to_owned();
        if let Some(c) = capacity {
            t += &format!("[rules.api.overrides.\"{long}\"]\ncapacity = {c}\nrate = \"1/m\"\n");
        }
        t
    };
    let server = support::server();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.toml");
    std::fs::write(&path, text(Some(1000))).unwrap();
    support::runtime().block_on(async {
        let l = watching(&server, &path).await;
        assert_eq!(admitted(&l, &long, 300).await, 300);
        // B shrinks to 50 below the ~700 the bucket holds: the live key takes it.
        std::fs::write(&path, text(Some(50))).unwrap();
        l.reload_rules().unwrap();
        let n = admitted(&l, &long, 100).await;
        assert!((50..=51).contains(&n), "{n} admitted after B went to 50");
        // The override removed: the rule's B = 10.
        std::fs::write(&path, text(None)).unwrap();
        l.reload_rules().unwrap();
        assert_eq!(
            l.bucket_params_for(&"api".into(), &long).unwrap().capacity,
            10
        );
        assert!(admitted(&l, &long, 20).await <= 11);
    });
}
