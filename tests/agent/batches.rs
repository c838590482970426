//! Cold decisions in batches, on real Redis: concurrent decisions on cold keys share
//! calls (one per shard at a time, same-key decisions coalesced into one item), every
//! decision gets its own exact answer, and the bound holds per key. Also at `max_keys`
//! (states made per decision, several naming one bucket) and on a 6-node cluster (a batch
//! per primary, keys of many slots).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::collections::HashMap;

use leasehold_agent::{Admission, Decision, Limiter};
use leasehold_redis_harness::Cluster;
use support::{limiter_with, runtime, server};

const RULES: &str = r#"
[rules.cold]
capacity = 50
rate = "1/s"
leasing = "exact"
timeout = "5s"
"#;

/// Runs `per_key` concurrent decisions on each of `keys` subjects (all at once) and
/// returns the admissions per subject, with every decision's outcome checked.
async fn burst(l: &Limiter, keys: usize, per_key: usize) -> HashMap<String, u64> {
    let tasks: Vec<_> = (0..keys * per_key)
        .map(|i| {
            let l = l.clone();
            let subject = format!("tenant-{}", i % keys);
            tokio::spawn(async move {
                let d = l.check(&"cold".into(), &subject, 1).await.unwrap();
                (subject, d)
            })
        })
        .collect();
    let mut admitted: HashMap<String, u64> = HashMap::new();
    for t in tasks {
        let (subject, d) = t.await.unwrap();
        match d {
            Decision::Allowed {
                via: Admission::Exact,
                ..
            } => *admitted.entry(subject).or_default() += 1,
            Decision::Denied { retry_after } => {
                assert!(!retry_after.is_zero());
                admitted.entry(subject).or_default();
            }
            other => panic!("{subject}: {other:?}"),
        }
    }
    admitted
}

fn check_bound(admitted: &HashMap<String, u64>, keys: usize, per_key: u64) {
    assert_eq!(admitted.len(), keys);
    for (subject, n) in admitted {
        // B = 50 and r = 1/s: the burst takes well under a few seconds.
        assert!(
            *n >= per_key.min(50) && *n <= per_key.min(50) + 5,
            "{subject}: {n} admitted"
        );
    }
}

#[test]
fn concurrent_cold_decisions_share_calls_and_stay_exact() {
    let server = server();
    runtime().block_on(async {
        let l = limiter_with(Limiter::builder().redis(server.url()), RULES).await;
        // 40 keys x 80 decisions, all in flight at once: 30 over B on every key.
        let admitted = burst(&l, 40, 80).await;
        check_bound(&admitted, 40, 80);
        let s = l.stats("cold").unwrap();
        let decisions = 40 * 80;
        println!(
            "{decisions} concurrent cold decisions on 40 keys: {} store calls, {} admitted",
            s.store_calls,
            admitted.values().sum::<u64>()
        );
        // Decisions denied locally by the negative cache make no call; the rest share.
        assert!(
            s.store_calls * 10 < decisions,
            "{} calls for {decisions} decisions: not batched",
            s.store_calls
        );
    });
}

#[test]
fn at_max_keys_states_of_one_bucket_share_a_batch() {
    let server = server();
    runtime().block_on(async {
        let mut config = leasehold_agent::LimiterConfig::default();
        config.max_keys = 4;
        let l = limiter_with(Limiter::builder().redis(server.url()).config(config), RULES).await;
        // Past max_keys each decision makes its own state; many name the same bucket.
        let admitted = burst(&l, 12, 60).await;
        check_bound(&admitted, 12, 60);
    });
}

/// On a 6-node cluster (one, for both halves): at the store, a batch of keys on one
/// primary is one call, and a batch spread over every primary is refused by the cluster
/// and sent again per slot, each key decided once; through the agent, concurrent cold
/// decisions on 300 keys go in batches of one primary's keys of many slots.
#[test]
fn cold_batches_on_a_cluster() {
    use leasehold_core::key::BucketKey;
    use leasehold_core::model::{AgentId, ExactOutcome};
    use leasehold_core::rule::RuleName;
    use leasehold_store::ExactItem;
    let c = Cluster::start().unwrap_or_else(|e| panic!("{e}"));
    let p = support::params(10, "1/s", "5s", "1s", None);
    runtime().block_on(async {
        let st = leasehold_agent::RedisStore::connect_cluster(&c.urls(), support::config())
            .await
            .unwrap();
        let shards = st.shards().await.unwrap();
        let rule = RuleName::new("cold").unwrap();
        let keys: Vec<BucketKey> = (0..60)
            .map(|i| BucketKey::new(&rule, format!("t-{i}")).unwrap())
            .collect();
        let node_of = |k: &BucketKey| {
            shards
                .iter()
                .find(|(a, b, _)| (*a..=*b).contains(&k.slot()))
                .map(|(_, _, n)| n.clone())
                .unwrap()
        };
        let costs = vec![1u64];
        let mut seq = 0;
        let mut decide = async |keys: Vec<&BucketKey>| {
            seq += 1;
            let items: Vec<ExactItem<'_>> = keys
                .iter()
                .map(|k| ExactItem {
                    key: k,
                    params: &p,
                    costs: &costs,
                })
                .collect();
            let out = st
                .exact_many(AgentId(0xC1), seq, &items, true)
                .await
                .unwrap_or_else(|e| panic!("batch of {}: {e}", items.len()));
            assert_eq!(out.len(), items.len());
            for o in out {
                assert!(
                    matches!(&o, ExactOutcome::Decided(r) if r.retry_us == [0]),
                    "{o:?}"
                );
            }
        };
        let first = node_of(&keys[0]);
        let same: Vec<&BucketKey> = keys.iter().filter(|k| node_of(k) == first).collect();
        assert!(same.len() > 5);
        decide(same).await;
        decide(keys.iter().collect()).await;

        let l = limiter_with(Limiter::builder().cluster(c.urls()), RULES).await;
        let admitted = burst(&l, 300, 3).await;
        check_bound(&admitted, 300, 3);
        let s = l.stats("cold").unwrap();
        println!(
            "900 concurrent cold decisions on 300 keys over 3 primaries: {} store calls",
            s.store_calls
        );
        assert!(
            s.store_calls < 900 / 3,
            "{} calls: not batched",
            s.store_calls
        );
        assert_eq!(s.store_errors, 0);
    });
}
