//! Proportional share on a real Redis: four agents whose demand is 1:2:4:8 on one key
//! that can serve a quarter of it. The bucket tells each agent `r / Σ demand`, the
//! fraction of its demand it may lease, so their admissions converge to the same ratios
//! (Doorman's proportional share), the key stays fully used, and the coordinator's view
//! shows the shares.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::Decision;
use leasehold_coordinator::key_view;
use leasehold_core::{BucketKey, RuleName};

const RULES: &str = "[rules.api]\ncapacity = 200\nrate = \"400/s\"\nleasing = \"lease\"\n";
/// Offered decisions per 10 ms per agent: 100, 200, 400 and 800 per second.
const DEMAND: [u64; 4] = [1, 2, 4, 8];

#[test]
fn skewed_agents_converge_to_proportional_shares() {
    let server = support::server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in DEMAND {
            agents.push(support::limiter(&server.url(), RULES).await);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<Vec<AtomicU64>> =
            Arc::new(DEMAND.iter().map(|_| AtomicU64::new(0)).collect());
        let mut tasks = Vec::new();
        for (i, l) in agents.iter().enumerate() {
            let (l, stop, counts) = (l.clone(), stop.clone(), counts.clone());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    for _ in 0..DEMAND[i] {
                        if let Decision::Allowed { .. } =
                            l.check(&"api".into(), "k", 1).await.unwrap()
                        {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        // Demand is measured over about a second; let it settle, then measure 4 s.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let start: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(4)).await;
        let secs = t0.elapsed().as_secs_f64();
        let got: Vec<f64> = counts
            .iter()
            .zip(&start)
            .map(|(c, s)| (c.load(Ordering::Relaxed) - s) as f64 / secs)
            .collect();
        let store = support::store(&server.url()).await;
        let key = BucketKey::new(&RuleName::new("api").unwrap(), "k").unwrap();
        let (fields, pttl, now) = store.bucket(&key).await.unwrap();
        let rule = support::rules(RULES).get("api").unwrap().clone();
        let view = key_view(&key, &rule, &fields, pttl, now);
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        let total: f64 = got.iter().sum();
        let want_share: Vec<f64> = DEMAND.iter().map(|d| *d as f64 / 15.0).collect();
        let got_share: Vec<f64> = got.iter().map(|g| g / total).collect();
        println!("admitted/s per agent {got:.1?} (total {total:.1} of r = 400/s)");
        println!("share of admissions {got_share:.3?}; proportional share {want_share:.3?}");
        let mut view_share: Vec<(f64, f64)> = view
            .agents
            .iter()
            .filter(|a| a.live)
            .map(|a| (a.demand_per_sec, a.share))
            .collect();
        view_share.sort_by(|a, b| a.0.total_cmp(&b.0));
        println!("coordinator view (demand/s, share): {view_share:.3?}");
        assert!(
            total > 0.95 * 400.0 && total < 1.05 * 400.0,
            "the key is fully used: {total}"
        );
        for (g, w) in got_share.iter().zip(&want_share) {
            assert!(
                (g - w).abs() < 0.04,
                "share {got_share:?} vs proportional {want_share:?}"
            );
        }
        assert_eq!(view_share.len(), 4);
        for ((_, s), w) in view_share.iter().zip(&want_share) {
            assert!(
                (s - w).abs() < 0.08,
                "view shares {view_share:?} vs {want_share:?}"
            );
        }
    });
}
