//! Sixteen agents hammer one bucket on a real Redis: acquire and spend locally from real
//! leases, release, and take exact tokens, for a few seconds. Meanwhile a monitor samples
//! the hash. Checked: the bucket never goes negative and `tok + out <= B` at every sample
//! (I1); each agent spends no more than it was granted (I3) and only before its deadline
//! (I4); and in total, admitted <= B + r * elapsed. Duration: `LEASEHOLD_HAMMER_SECS`.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use leasehold_agent::RedisStore;
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Op, Reply, Request};
use leasehold_core::rule::{BucketParams, RuleName};
use leasehold_core::{LocalLease, Spend};
use support::{params, runtime, server, store};

#[derive(Debug, Default)]
struct Tally {
    granted: u64,
    credited: u64,
    exact: u64,
    spent: u64,
    calls: u64,
}

const MARGIN_NS: u64 = 20_000_000;

/// Sends `req` until it gets an answer; retries keep the sequence number (I2).
async fn call(store: &RedisStore, key: &BucketKey, p: &BucketParams, req: Request) -> Reply {
    let mut tries = 0;
    loop {
        match store.call(key, p, &req).await {
            Ok(r) => return r,
            Err(e) if e.is_retryable() && tries < 20 => tries += 1,
            Err(e) => panic!("store call failed: {e}"),
        }
    }
}

async fn agent(
    store: RedisStore,
    key: BucketKey,
    p: BucketParams,
    start: Instant,
    run_for: Duration,
    n: u64,
) -> Tally {
    let id = AgentId(0xA000 + n);
    let lease = LocalLease::new();
    let clock = || start.elapsed().as_nanos() as u64;
    let mut seq = 0;
    let mut t = Tally::default();
    let mut i = n;
    while start.elapsed() < run_for {
        i = i
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seq += 1;
        match (i >> 33) % 10 {
            0..7 => {
                let sent = clock();
                let held = lease.declare(sent);
                let want = 1 + (i >> 40) % 12;
                let op = Op::Acquire {
                    held,
                    want,
                    min: 1,
                    demand: want * 1000,
                };
                let r = call(&store, &key, &p, Request { agent: id, seq, op }).await;
                lease.grant(r.granted, sent + r.ttl_us * 1000 - MARGIN_NS);
                t.granted += r.granted;
                // Spend a few, as requests would arrive.
                for _ in 0..(i >> 20) % 8 {
                    let now = clock();
                    if let Spend::Spent { .. } = lease.try_spend(1, now) {
                        assert!(now < lease.deadline_ns(), "I4: spent after the deadline");
                        t.spent += 1;
                    }
                }
            }
            7..9 => {
                let returned = lease.take_all();
                let r = call(
                    &store,
                    &key,
                    &p,
                    Request {
                        agent: id,
                        seq,
                        op: Op::Release { returned },
                    },
                )
                .await;
                assert!(r.granted <= returned);
                t.credited += r.granted;
            }
            _ => {
                let r = call(
                    &store,
                    &key,
                    &p,
                    Request {
                        agent: id,
                        seq,
                        op: Op::Exact { cost: 1 },
                    },
                )
                .await;
                t.exact += r.granted;
            }
        }
        t.calls += 1;
    }
    // I3: every token granted was spent, credited back, or is still held (never more).
    assert!(
        t.spent + t.credited + lease.held() <= t.granted,
        "I3: agent {n} overspent: {t:?}"
    );
    t
}

#[test]
fn i1_i3_i4_sixteen_agents_hammer_one_key() {
    let secs = std::env::var("LEASEHOLD_HAMMER_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let run_for = Duration::from_secs(secs);
    let server = server();
    let p = params(200, "500/s", "300ms", "100ms", None);
    let key = BucketKey::new(&RuleName::new("hammer").expect("name"), "tenant-1").expect("key");
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (stop, url, key) = (stop.clone(), server.url(), key.clone());
        std::thread::spawn(move || {
            let client = redis::Client::open(url).expect("client");
            let mut c = client.get_connection().expect("connection");
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let state: Option<Vec<u8>> = redis::cmd("HGET")
                    .arg(key.as_str())
                    .arg(leasehold_store::wire::STATE)
                    .query(&mut c)
                    .expect("HGET");
                let (tok, out) = state.map_or((200, 0), |v| {
                    let f = leasehold_store::wire::bucket_fields(&[(
                        leasehold_store::wire::STATE.as_bytes().to_vec(),
                        v,
                    )])
                    .expect("a bucket's state");
                    let n = |name: &str| f[name].parse::<i64>().expect("a number");
                    (n("tok"), n("out"))
                });
                assert!(
                    tok >= 0 && out >= 0,
                    "bucket went negative: tok {tok} out {out}"
                );
                assert!(tok + out <= 200, "I1: tok {tok} + out {out} > B");
                samples += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            samples
        })
    };
    let start = Instant::now();
    let tallies: Vec<Tally> = runtime().block_on(async {
        let st = store(&server.url()).await;
        let tasks: Vec<_> = (0..16)
            .map(|n| tokio::spawn(agent(st.clone(), key.clone(), p, start, run_for, n)))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("agent task"));
        }
        out
    });
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let samples = monitor.join().expect("monitor");
    let sum = |f: fn(&Tally) -> u64| tallies.iter().map(f).sum::<u64>();
    let (granted, credited, exact, spent, calls) = (
        sum(|t| t.granted),
        sum(|t| t.credited),
        sum(|t| t.exact),
        sum(|t| t.spent),
        sum(|t| t.calls),
    );
    let bound = 200 + (500.0 * elapsed.as_secs_f64()).ceil() as u64;
    println!(
        "16 agents, {:.2}s: {calls} calls ({:.0}/s), granted {granted}, credited back {credited}, \
         exact {exact}, spent locally {spent}; admitted {} <= bound {bound} (B + r*t); \
         net debit {} ; {samples} monitor samples of tok+out <= B",
        elapsed.as_secs_f64(),
        calls as f64 / elapsed.as_secs_f64(),
        spent + exact,
        granted - credited + exact,
    );
    assert!(
        spent + exact <= bound,
        "admitted {} > {bound}",
        spent + exact
    );
    assert!(
        granted - credited + exact <= bound,
        "net debit {} > {bound}",
        granted - credited + exact
    );
    assert!(
        granted > 0 && exact > 0 && credited > 0,
        "every path was exercised"
    );
}
