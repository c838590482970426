//! The protocol on a 6-node Redis Cluster (3 primaries, 3 replicas).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::collections::{BTreeMap, BTreeSet};

use leasehold_agent::RedisStore;
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, GlobalBucket, Op, Request};
use leasehold_core::rule::RuleName;
use leasehold_redis_harness::Cluster;
use support::{config, params, runtime};

fn cluster() -> Cluster {
    Cluster::start().unwrap_or_else(|e| panic!("{e}"))
}

async fn cluster_store(c: &Cluster) -> RedisStore {
    RedisStore::connect_cluster(&c.urls(), config())
        .await
        .unwrap_or_else(|e| panic!("cluster connect: {e}"))
}

/// I7 on a cluster: each bucket lives on the primary that serves its key's slot, the slot
/// is computed from the whole escaped subject (Redis agrees with `BucketKey::slot`),
/// hostile subjects cannot share a key, and ordinary tenants spread over all shards.
#[test]
fn i7_cluster_buckets_land_on_their_slots_whatever_the_subject() {
    let c = cluster();
    let rule = RuleName::new("api.write").expect("name");
    let mut subjects: Vec<Vec<u8>> = vec![
        b"{".to_vec(),
        b"}".to_vec(),
        b"{x}".to_vec(),
        b"}{tenant-1".to_vec(),
        b"tenant-1}".to_vec(),
        b"\0".to_vec(),
        b"a\0b{c}".to_vec(),
        "ünïcødé ✓".as_bytes().to_vec(),
        vec![b'z'; 1 << 20],
        vec![b'{'; 5000],
    ];
    subjects.extend((0..30).map(|i| format!("tenant-{i}").into_bytes()));
    let p = params(10, "1/s", "5s", "1s", None);
    let mut keys = BTreeSet::new();
    let mut per_shard: BTreeMap<u16, usize> = BTreeMap::new();
    runtime().block_on(async {
        let st = cluster_store(&c).await;
        // WAIT is given seconds: on a machine with both cores busy a replica can take
        // hundreds of milliseconds to acknowledge.
        let mut patient = config();
        patient.call_timeout = std::time::Duration::from_secs(10);
        let waiting = RedisStore::connect_cluster(&c.urls(), patient)
            .await
            .unwrap_or_else(|e| panic!("cluster connect: {e}"));
        for (i, s) in subjects.iter().enumerate() {
            let k = BucketKey::new(&rule, s).expect("key");
            assert!(keys.insert(k.clone()), "two subjects share a key: {k}");
            let slot: u16 = c.nodes[0]
                .cmd(&["CLUSTER", "KEYSLOT", k.as_str()])
                .expect("KEYSLOT");
            assert_eq!(
                slot,
                k.slot(),
                "Redis places {k} elsewhere than its tag says"
            );
            let req = Request {
                agent: AgentId(i as u64 + 1),
                seq: 1,
                op: Op::Acquire {
                    held: 0,
                    want: 3,
                    min: 1,
                    demand: 0,
                },
            };
            let r = st.call(&k, &p, &req).await.expect("acquire on the cluster");
            assert_eq!(r.granted, 3, "{k} did not start full: it shares state");
            let owner = c.owner(slot).expect("owner");
            let exists: i64 = c
                .node(owner.port)
                .expect("node")
                .cmd(&["EXISTS", k.as_str()])
                .expect("EXISTS");
            assert_eq!(exists, 1, "{k} is not on the primary of slot {slot}");
            *per_shard.entry(owner.port).or_default() += 1;
            // With `replicas`, WAIT rides in the same pipeline to the key's primary,
            // whose replica acknowledges the grant.
            let again = Request {
                seq: 2,
                op: Op::Exact { cost: 1 },
                ..req
            };
            let wait = Some(leasehold_core::rule::Replication {
                replicas: 1,
                timeout: std::time::Duration::from_secs(5),
            });
            let r = waiting
                .call_replicated(&k, &p, &again, wait)
                .await
                .unwrap_or_else(|e| panic!("FCALL + WAIT on {k}: {e}"));
            assert_eq!(r.granted, 1);
        }
    });
    let primaries: Vec<_> = c
        .topology()
        .expect("topology")
        .into_iter()
        .filter(|n| n.primary)
        .collect();
    let total: i64 = primaries
        .iter()
        .map(|n| {
            c.node(n.port)
                .expect("node")
                .cmd::<i64>(&["DBSIZE"])
                .expect("DBSIZE")
        })
        .sum();
    assert_eq!(
        total as usize,
        subjects.len(),
        "calls created keys other than their own"
    );
    assert_eq!(
        per_shard.len(),
        3,
        "40 buckets should spread over the 3 shards: {per_shard:?}"
    );
    println!(
        "{} buckets over 3 shards: {:?} (port -> buckets)",
        subjects.len(),
        per_shard
    );
}

/// A resharding moves a bucket's slot to another primary: the next call gets MOVED, the
/// client follows it, and the bucket continues exactly where it was (checked against the
/// model).
#[test]
fn cluster_follows_moved_after_resharding() {
    let c = cluster();
    let rule = RuleName::new("api.read").expect("name");
    let k = BucketKey::new(&rule, "tenant-moving").expect("key");
    let p = params(20, "1/s", "30s", "5s", None);
    let mut model = GlobalBucket::new();
    runtime().block_on(async {
        let st = cluster_store(&c).await;
        let mut seq = 0;
        let mut step = |op| {
            seq += 1;
            Request {
                agent: AgentId(0xC1),
                seq,
                op,
            }
        };
        let req = step(Op::Acquire {
            held: 0,
            want: 8,
            min: 1,
            demand: 0,
        });
        let r = st.call(&k, &p, &req).await.expect("before");
        assert_eq!(r, model.apply(&p, r.now_us, &req).expect("model"));
        let before = c.owner(k.slot()).expect("owner");
        let after = c.migrate_slot(k.slot()).expect("migrate");
        assert_ne!(before.id, after.id);
        for op in [
            Op::Exact { cost: 2 },
            Op::Acquire {
                held: 5,
                want: 4,
                min: 1,
                demand: 0,
            },
            Op::Release { returned: 9 },
        ] {
            let req = step(op);
            let r = st.call(&k, &p, &req).await.expect("after MOVED");
            assert_eq!(
                r,
                model.apply(&p, r.now_us, &req).expect("model"),
                "state lost in the move"
            );
        }
        let exists: i64 = c
            .node(after.port)
            .expect("node")
            .cmd(&["EXISTS", k.as_str()])
            .expect("EXISTS");
        assert_eq!(exists, 1);
        println!(
            "slot {} moved from :{} to :{}; 3 calls followed MOVED, replies equal to the model",
            k.slot(),
            before.port,
            after.port
        );
    });
}
