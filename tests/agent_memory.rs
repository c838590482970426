//! Agent memory under a flood of distinct subjects (an unauthenticated client sending a
//! new API key with every request), on a real Redis: the key map stays within
//! `max_keys`, every decision stays right (each subject's one token is admitted once and
//! then denied), and the process's memory stays bounded.
//!
//! Long subjects (1 MB descriptor values) cost a key its digest, not their bytes.
//!
//! `LEASEHOLD_FLOOD_KEYS` (default 50 000) and `LEASEHOLD_FLOOD_MAX_KEYS` (default 5 000)
//! set the size; the README's figure is 1 000 000 keys with the default cap of 50 000 in
//! a release build.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

mod support;

use std::sync::Arc;

use leasehold_agent::{Decision, Limiter, LimiterConfig};

const RULES: &str = "[rules.api]\ncapacity = 1\nrate = \"1/1h\"\ntimeout = \"2s\"\n";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn a_flood_of_distinct_keys_keeps_memory_bounded_and_decisions_right() {
    let keys = env("LEASEHOLD_FLOOD_KEYS", 50_000);
    let max_keys = env("LEASEHOLD_FLOOD_MAX_KEYS", 5_000);
    let server = support::server();
    support::runtime().block_on(async {
        let limiter = Limiter::builder()
            .redis(server.url())
            .rules(support::rules(RULES))
            .config({
                let mut c = LimiterConfig::default();
                c.store = support::config();
                c.max_keys = max_keys;
                c
            })
            .build()
            .await
            .unwrap();
        let before = rss();
        let limiter = Arc::new(limiter);
        let tasks = 16;
        let mut handles = Vec::new();
        for t in 0..tasks {
            let l = limiter.clone();
            handles.push(tokio::spawn(async move {
                let (mut wrong, mut most) = (0u64, 0usize);
                for i in (t..keys).step_by(tasks) {
                    let subject = format!("flood-{i:08}");
                    let first = l.check(&"api".into(), &subject, 1).await.unwrap();
                    let second = l.check(&"api".into(), &subject, 1).await.unwrap();
                    if !matches!(first, Decision::Allowed { .. })
                        || !matches!(second, Decision::Denied { .. })
                    {
                        wrong += 1;
                    }
                    most = most.max(l.keys_in_memory());
                }
                (wrong, most)
            }));
        }
        let (mut wrong, mut most) = (0, 0);
        for h in handles {
            let (w, m) = h.await.unwrap();
            wrong += w;
            most = most.max(m);
        }
        let after = rss();
        let (evicted, without_state) = limiter.keys_evicted();
        println!(
            "{keys} distinct keys, max_keys {max_keys}: at most {most} keys in memory, \
             {evicted} evicted, {without_state} decided without keeping state; RSS {:.1} MB \
             before, {:.1} MB after ({:+.1} MB)",
            before as f64 / 1e6,
            after as f64 / 1e6,
            (after as f64 - before as f64) / 1e6
        );
        assert_eq!(
            wrong, 0,
            "subjects whose first check was not admitted or second not denied"
        );
        assert!(
            most <= max_keys + tasks,
            "{most} keys in memory, cap {max_keys}"
        );
        assert!(evicted + without_state > 0, "the cap was never reached");
        // About 1 KB per key at the cap, plus the allocator's slack.
        let bound = 64e6 + max_keys as f64 * 2_000.0;
        assert!(
            ((after as f64) - (before as f64)) < bound,
            "RSS grew by {:.1} MB",
            (after as f64 - before as f64) / 1e6
        );
    });
}

#[test]
fn long_subjects_cost_a_key_their_digest_not_their_bytes() {
    // 100 subjects of 1 MB, each its own key: kept as they came they would be 100 MB of
    // the agent's memory for as long as their keys live.
    let (n, size) = (100usize, 1 << 20);
    let server = support::server();
    support::runtime().block_on(async {
        let limiter = support::limiter(&server.url(), RULES).await;
        // One buffer, its last bytes changed per subject: the test's own allocations do
        // not grow with n.
        let mut subject = vec![b'v'; size];
        let at = |i: usize, s: &mut Vec<u8>| {
            s[size - 8..].copy_from_slice(&(i as u64).to_be_bytes());
        };
        let before = rss();
        for i in 0..n {
            at(i, &mut subject);
            let first = limiter.check(&"api".into(), &subject, 1).await.unwrap();
            let second = limiter.check(&"api".into(), &subject, 1).await.unwrap();
            assert!(
                matches!(first, Decision::Allowed { .. }),
                "subject {i}: its own bucket, admitted once: {first:?}"
            );
            assert!(
                matches!(second, Decision::Denied { .. }),
                "subject {i}: the same bucket again, denied: {second:?}"
            );
        }
        let after = rss();
        assert!(
            limiter.keys_in_memory() >= n,
            "{} keys in memory",
            limiter.keys_in_memory()
        );
        // Each is still its own key (a subject differing only in its last bytes).
        at(0, &mut subject);
        let again = limiter.check(&"api".into(), &subject, 1).await.unwrap();
        assert!(matches!(again, Decision::Denied { .. }), "{again:?}");
        at(n, &mut subject);
        let new = limiter.check(&"api".into(), &subject, 1).await.unwrap();
        assert!(matches!(new, Decision::Allowed { .. }), "{new:?}");
        let grew = (after as f64 - before as f64) / 1e6;
        println!("{n} keys of {size}-byte subjects: RSS {grew:+.1} MB");
        assert!(
            grew < 40.0,
            "RSS grew by {grew:.1} MB for {n} keys of {size}-byte subjects"
        );
    });
}
