//! I8: failover loses the grants made during the replication lag. Agents re-declare
//! what they hold on their next acquire, so `outstanding` on the promoted replica
//! recovers exactly; the overshoot the lost writes leave is measured, and must be at most
//! the grants made in the lag window.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Op, Request};
use leasehold_core::rule::RuleName;
use leasehold_core::{LocalLease, Spend};
use leasehold_redis_harness::{Fault, ReplicaPair};
use support::{field, params, runtime, store};

struct Agent {
    id: AgentId,
    seq: u64,
    lease: LocalLease,
    admitted: u64,
}

impl Agent {
    fn spend(&mut self, n: u64, now_ns: u64) {
        for _ in 0..n {
            if let Spend::Spent { .. } = self.lease.try_spend(1, now_ns) {
                self.admitted += 1;
            }
        }
    }
}

#[test]
fn i8_failover_redeclare_recovers_outstanding_and_overshoot_is_bounded() {
    let mut pair = ReplicaPair::start().unwrap_or_else(|e| panic!("{e}"));
    // B = 100, r = 10/s; leases outlive the test so only lost writes can explain a gap.
    let p = params(100, "10/s", "30s", "5s", None);
    let k = BucketKey::new(&RuleName::new("failover").expect("name"), "tenant").expect("key");
    let start = std::time::Instant::now();
    let now_ns = || start.elapsed().as_nanos() as u64;
    let mut agents: Vec<Agent> = (0..4)
        .map(|i| Agent {
            id: AgentId(0xF0 + i),
            seq: 0,
            lease: LocalLease::new(),
            admitted: 0,
        })
        .collect();
    runtime().block_on(async {
        let primary = store(&pair.primary.url()).await;
        let mut first_now = 0;
        let acquire = async |st: &leasehold_agent::RedisStore, a: &mut Agent, want: u64| {
            a.seq += 1;
            let sent = now_ns();
            let held = a.lease.declare(sent);
            let req = Request { agent: a.id, seq: a.seq, op: Op::Acquire { held, want, min: 1, demand: 0 } };
            let r = st.call(&k, &p, &req).await.expect("acquire");
            a.lease.grant(r.granted, sent + r.ttl_us * 1000);
            (held, r)
        };
        // Phase 1: grants that reach the replica.
        for a in agents.iter_mut() {
            let (_, r) = acquire(&primary, a, 10).await;
            first_now = if first_now == 0 { r.now_us } else { first_now };
        }
        pair.wait_synced(Duration::from_secs(10)).expect("replica in sync");
        // Phase 2: replication is cut; these grants exist only on the primary.
        pair.link.set(Fault::Blackhole);
        let mut lag_grants = 0;
        for a in agents.iter_mut() {
            lag_grants += acquire(&primary, a, 10).await.1.granted;
        }
        // Agents spend some of what they hold: two everything, two half.
        for (i, a) in agents.iter_mut().enumerate() {
            a.spend(if i < 2 { 20 } else { 10 }, now_ns());
        }
        pair.fail_over().expect("promote the replica");
        let lost_view = (field(&pair.replica, k.as_str(), "tok"), field(&pair.replica, k.as_str(), "out"));
        // Phase 3: agents reconnect to the new primary; the next acquire re-declares.
        let promoted = store(&pair.replica.url()).await;
        let mut declared = 0;
        let mut new_grants = 0;
        for a in agents.iter_mut() {
            let (held, r) = acquire(&promoted, a, 10).await;
            declared += held;
            new_grants += r.granted;
        }
        let out = field(&pair.replica, k.as_str(), "out");
        assert_eq!(out, declared + new_grants, "outstanding did not recover from the re-declarations");
        // Phase 4: everyone drains the bucket for a while.
        let drain_until = start.elapsed() + Duration::from_millis(1500);
        let mut last_now = 0;
        while start.elapsed() < drain_until {
            for a in agents.iter_mut() {
                let (_, r) = acquire(&promoted, a, 10).await;
                last_now = r.now_us;
                a.spend(50, now_ns());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let admitted: u64 = agents.iter().map(|a| a.admitted).sum();
        let elapsed_s = (last_now - first_now) as f64 / 1e6;
        let bound = 100.0 + 10.0 * elapsed_s;
        let overshoot = (admitted as f64 - bound).max(0.0);
        println!(
            "failover: {lag_grants} tokens granted in the lag window; promoted replica saw tok {} out {}; \
             re-declared {declared} held; outstanding recovered to {out}; admitted {admitted} over {elapsed_s:.2}s \
             vs bound B + r*t = {bound:.1}; measured overshoot {overshoot:.1} tokens ({:.1}% of the bound)",
            lost_view.0, lost_view.1, 100.0 * overshoot / bound
        );
        assert!(
            overshoot <= lag_grants as f64,
            "overshoot {overshoot} exceeds the grants lost in the lag window ({lag_grants})"
        );
    });
}
