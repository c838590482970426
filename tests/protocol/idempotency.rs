//! I2 on a real Redis: a request whose reply was lost, re-sent with the same
//! `(agent, seq)`, is applied once and answered with the first reply. The reply is lost
//! for real: a TCP proxy between client and Redis swallows it, then the connection
//! breaks, and the client reconnects and retries.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use leasehold_agent::{RedisStore, StoreError};
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, ExactOutcome, Op, Reply, Request};
use leasehold_core::rule::{BucketParams, RuleName};
use leasehold_redis_harness::{Fault, FaultProxy, RedisServer};
use leasehold_store::ExactItem;
use support::{field, hash, params, runtime, server, store};

fn key(subject: &str) -> BucketKey {
    BucketKey::new(&RuleName::new("idem").expect("name"), subject).expect("key")
}

/// Sends through a proxy that swallows the reply, then retries with the same sequence
/// number once replies flow again. Returns the retry's reply and the hash right after the
/// lost call.
async fn lose_then_retry(
    server: &RedisServer,
    proxy: &FaultProxy,
    st: &RedisStore,
    k: &BucketKey,
    p: &BucketParams,
    req: Request,
) -> (Reply, BTreeMap<String, String>) {
    proxy.set(Fault::DropReplies);
    let lost = st.call(k, p, &req).await;
    assert!(
        matches!(&lost, Err(e) if e.is_retryable()),
        "the reply was swallowed, yet the call returned {lost:?}"
    );
    // Redis applied it even though the client never heard back.
    let after_first = hash(server, k.as_str());
    assert!(!after_first.is_empty(), "the lost call was not applied");
    // TCP does not lose bytes inside a live connection: a lost reply is a connection that
    // broke after Redis acted. Break it, as the network would.
    proxy.cut();
    proxy.set(Fault::Pass);
    for _ in 0..50 {
        match st.call(k, p, &req).await {
            Ok(r) => return (r, after_first),
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("retry failed: {e}"),
        }
    }
    panic!("no answer to the retry");
}

#[test]
fn i2_retried_acquire_after_lost_reply_debits_once() {
    let server = server();
    let proxy = FaultProxy::start(server.addr()).expect("proxy");
    let p = params(100, "1/s", "30s", "5s", None);
    runtime().block_on(async {
        let st = store(&proxy.url()).await;
        let k = key("tenant-a");
        let agent = AgentId(0xBEEF);
        let acquire = Request {
            agent,
            seq: 1,
            op: Op::Acquire {
                held: 0,
                want: 30,
                min: 1,
                demand: 0,
            },
        };
        let (reply, after_first) = lose_then_retry(&server, &proxy, &st, &k, &p, acquire).await;
        assert_eq!(reply.granted, 30, "the retry replays the grant");
        assert_eq!(
            hash(&server, k.as_str()),
            after_first,
            "the retry changed the bucket"
        );
        assert_eq!(field(&server, k.as_str(), "out"), 30, "debited once");
        assert!(field(&server, k.as_str(), "tok") <= 70 + 1);

        // The same holds for exact and release.
        let exact = Request {
            agent,
            seq: 2,
            op: Op::Exact { cost: 5 },
        };
        let (reply, after_first) = lose_then_retry(&server, &proxy, &st, &k, &p, exact).await;
        assert_eq!(reply.granted, 5);
        assert_eq!(hash(&server, k.as_str()), after_first);
        let release = Request {
            agent,
            seq: 3,
            op: Op::Release { returned: 30 },
        };
        let (reply, after_first) = lose_then_retry(&server, &proxy, &st, &k, &p, release).await;
        assert_eq!(reply.granted, 30, "credited once");
        assert_eq!(hash(&server, k.as_str()), after_first);
        assert_eq!(field(&server, k.as_str(), "out"), 0);
        println!(
            "lost replies: acquire 30, exact 5, release 30 each applied exactly once; tok now {}",
            field(&server, k.as_str(), "tok")
        );
    });
}

#[test]
fn i2_same_seq_twice_replays_and_changes_nothing() {
    let server = server();
    let p = params(10, "10/s", "5s", "1s", None);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let k = key("tenant-b");
        let req = Request {
            agent: AgentId(7),
            seq: 41,
            op: Op::Acquire {
                held: 0,
                want: 4,
                min: 1,
                demand: 0,
            },
        };
        let first = st.call(&k, &p, &req).await.expect("first");
        let before = hash(&server, k.as_str());
        tokio::time::sleep(Duration::from_millis(150)).await;
        let again = st.call(&k, &p, &req).await.expect("again");
        assert_eq!(first, again);
        assert_eq!(hash(&server, k.as_str()), before);
        let stale = Request { seq: 40, ..req };
        match st.call(&k, &p, &stale).await {
            Err(StoreError::Refused { code, message }) => {
                assert_eq!(code, "LH_STALE");
                assert!(
                    message.contains("40") && message.contains("41"),
                    "{message}"
                );
            }
            other => panic!("a stale sequence must be refused, got {other:?}"),
        }
    });
}

/// A batch of exact decisions whose reply was lost: the retry (same agent, same seq, same
/// keys) gets the first answer from the batch's dedup key, and no bucket is debited twice.
#[test]
fn i2_retried_exact_batch_after_lost_reply_debits_once() {
    let server = server();
    let proxy = FaultProxy::start(server.addr()).expect("proxy");
    let p = params(10, "1/s", "30s", "5s", None);
    runtime().block_on(async {
        let st = store(&proxy.url()).await;
        let keys: Vec<BucketKey> = (0..5).map(|i| key(&format!("batch-{i}"))).collect();
        let costs: Vec<Vec<u64>> = (0..5).map(|i| vec![3; i + 1]).collect();
        let items: Vec<ExactItem<'_>> = keys
            .iter()
            .zip(&costs)
            .map(|(k, c)| ExactItem {
                key: k,
                params: &p,
                costs: c,
            })
            .collect();
        let agent = AgentId(0xB47C);
        proxy.set(Fault::DropReplies);
        let lost = st.exact_many(agent, 9, &items, true).await;
        assert!(
            matches!(&lost, Err(e) if e.is_retryable()),
            "the reply was swallowed, yet the call returned {lost:?}"
        );
        let after_first: Vec<_> = keys.iter().map(|k| hash(&server, k.as_str())).collect();
        assert!(
            after_first.iter().all(|h| !h.is_empty()),
            "the lost batch was not applied"
        );
        proxy.cut();
        proxy.set(Fault::Pass);
        let mut answer = None;
        for _ in 0..50 {
            match st.exact_many(agent, 9, &items, false).await {
                Ok(a) => {
                    answer = Some(a);
                    break;
                }
                Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("retry failed: {e}"),
            }
        }
        let answer = answer.expect("no answer to the retry");
        let after_retry: Vec<_> = keys.iter().map(|k| hash(&server, k.as_str())).collect();
        assert_eq!(after_retry, after_first, "the retry changed a bucket");
        // Key i had i + 1 decisions of 3 from a bucket of 10: three admitted at most.
        for (i, o) in answer.iter().enumerate() {
            let ExactOutcome::Decided(r) = o else {
                panic!("key {i}: {o:?}")
            };
            let admitted = r.retry_us.iter().filter(|&&w| w == 0).count();
            assert_eq!(admitted, (i + 1).min(3), "key {i}: {r:?}");
            assert_eq!(
                field(&server, keys[i].as_str(), "tok"),
                10 - 3 * admitted as u64
            );
        }
        // Sent again later (another lost reply): still the same answer, nothing debited.
        let again = st.exact_many(agent, 9, &items, false).await.expect("again");
        assert_eq!(again, answer);
        let after_again: Vec<_> = keys.iter().map(|k| hash(&server, k.as_str())).collect();
        assert_eq!(after_again, after_first, "a replay changed a bucket");
        println!("lost exact batch of 5 keys / 15 decisions: applied once, replayed twice");
    });
}
