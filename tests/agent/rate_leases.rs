//! Rate leases (`leasing = "rate"`) on real Redis: agents spending flat out keep the
//! bound, call the store a few times a term whatever their volume, and the bucket's hash
//! shows their shares; an idle agent gives its share up.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::Decision;
use support::{field, server};

const RULES: &str =
    "[rules.rl]\ncapacity = 1000\nrate = \"2000/s\"\nleasing = \"rate\"\nterm = \"2s\"\n";

#[test]
fn agents_flat_out_on_rate_leases_keep_the_bound_and_call_a_few_times_a_term() {
    let server = server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in 0..8 {
            agents.push(support::limiter(&server.url(), RULES).await);
        }
        let admitted = Arc::new(AtomicU64::new(0));
        let decisions = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let run_for = Duration::from_secs(4);
        let rule = agents[0].rule("rl").expect("the rule");
        let tasks: Vec<_> = agents
            .iter()
            .map(|l| {
                let (l, rule) = (l.clone(), rule.clone());
                let (admitted, decisions) = (admitted.clone(), decisions.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while start.elapsed() < run_for {
                        let d = l.check(&rule, "tenant", 1).await.unwrap();
                        if let Decision::Allowed { .. } = d {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        decisions.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                        if i.is_multiple_of(64) {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let elapsed = start.elapsed().as_secs_f64();
        let (admitted, decisions) = (
            admitted.load(Ordering::Relaxed),
            decisions.load(Ordering::Relaxed),
        );
        let calls: u64 = agents
            .iter()
            .map(|l| l.stats("rl").unwrap().store_calls)
            .sum();
        let bound = 1000.0 + 2000.0 * elapsed;
        println!(
            "8 agents on rate leases for {elapsed:.2}s: {decisions} decisions, {admitted} admitted \
             (bound {bound:.0}, utilisation {:.3}), {calls} store calls",
            admitted as f64 / bound
        );
        assert!(admitted as f64 <= bound, "admitted {admitted} > {bound}");
        // Each agent: its first call, one once the fleet's demand is known, a renewal at
        // three quarters of each term (0.4 s while so few agents share the key), and the
        // ones its demand makes (flat out, the denied callers it counts swing it by more
        // than half now and then) or a limited grant (backing off). Token leases on this
        // load call thousands of times.
        assert!(calls <= 8 * 60, "{calls} store calls");
        // Loose: flat-out callers on two cores starve the agents' own tasks (see the
        // README's figures for paced load).
        assert!(
            admitted as f64 >= 0.3 * bound,
            "the shares were spent: {admitted} of {bound}"
        );
        // The hash: every agent's share counts, within the rate.
        let key = "lh:{rl|tenant}";
        let holders = field(&server, key, "sn");
        assert!((1..=8).contains(&holders), "{holders} records with a share");
        let unit = field(&server, key, "su");
        let shared = field(&server, key, "sh") as f64 * 1e6 / unit as f64;
        assert!(shared <= 2000.0 + 1e-6, "{shared} tokens/s leased");
        // Idle for longer than the rule's idle time: every agent gives its share up.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(field(&server, key, "sn"), 0, "shares given up when idle");
    });
}
