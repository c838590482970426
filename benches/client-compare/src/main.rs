//! A batched cold path's call (`FCALL lh_exact_batch`, as agents send it: its numbers
//! packed as little-endian 64-bit integers), through
//! redis-rs's multiplexed connection and through fred's client, in one run, against one
//! redis-server (which must be one you can write to: it loads the function library and
//! makes bucket keys `lh:{cmp|...}`). Tasks call flat out, each call on fresh keys; it reports decisions/s
//! and this process's CPU per call (user + system).
//!
//! `cargo run --release -- REDIS_URL [SECONDS]`; ONLY=TASKS,KEYS runs one shape.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const AGENT: &str = "00000000000000000000000000abcdef";

/// The args of one batch of `n` keys, one cost each, from key number `base`: the agent,
/// then seq, one rule (capacity, rate tokens, rate period µs, grace µs, strict) and per
/// key its rule, count and cost, packed.
fn batch(seq: u64, base: u64, n: u64) -> (Vec<String>, Vec<Vec<u8>>) {
    let mut keys = Vec::new();
    let first = format!("lh:{{cmp|t{base}}}");
    keys.push(format!("{first}:b:{AGENT}:{seq}"));
    for i in 0..n {
        keys.push(format!("lh:{{cmp|t{}}}", base + i));
    }
    let mut numbers = vec![seq, 1, 1_000_000, 1_000_000, 1_000_000, 1_000_000, 0];
    for _ in 0..n {
        numbers.extend([1, 1, 1]);
    }
    let packed: Vec<u8> = numbers.iter().flat_map(|v| v.to_le_bytes()).collect();
    (keys, vec![AGENT.as_bytes().to_vec(), packed])
}

struct Run {
    decisions: u64,
    secs: f64,
    cpu: f64,
}

fn cpu_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

async fn drive<F, Fut>(tasks: usize, n: u64, dur: Duration, call: F) -> Run
where
    F: Fn(Vec<String>, Vec<Vec<u8>>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    static SEQ: AtomicU64 = AtomicU64::new(1);
    let call = Arc::new(call);
    let done = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_secs();
    let start = Instant::now();
    let mut hs = Vec::new();
    for t in 0..tasks {
        let (call, done) = (call.clone(), done.clone());
        hs.push(tokio::spawn(async move {
            let mut i = 0u64;
            while start.elapsed() < dur {
                let seq = SEQ.fetch_add(1, Ordering::Relaxed);
                let base = (t as u64 * 1_000_003 + i * 7919) % 1_000_000;
                let (k, a) = batch(seq, base * 100, n);
                call(k, a).await;
                done.fetch_add(n, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    Run {
        decisions: done.load(Ordering::Relaxed),
        secs: start.elapsed().as_secs_f64(),
        cpu: cpu_secs() - cpu0,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let url = std::env::args().nth(1).expect("redis url");
    let dur = Duration::from_secs(
        std::env::args()
            .nth(2)
            .map(|s| s.parse().unwrap())
            .unwrap_or(4),
    );
    let lua = include_str!("../../../lua/leasehold.lua");
    let rr = redis::Client::open(url.as_str()).unwrap();
    let mut conn = rr.get_multiplexed_async_connection().await.unwrap();
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(lua)
        .query_async(&mut conn)
        .await
        .unwrap();

    use fred::prelude::*;
    let config = Config::from_url(&url).unwrap();
    let fc = Builder::from_config(config).build().unwrap();
    fc.init().await.unwrap();

    let shapes: Vec<(usize, u64)> = match std::env::var("ONLY") {
        Ok(v) => {
            let (a, b) = v.split_once(',').unwrap();
            vec![(a.parse().unwrap(), b.parse().unwrap())]
        }
        Err(_) => vec![(64, 1), (8, 16), (64, 16)],
    };
    for (tasks, n) in shapes {
        // Four rounds, alternating which client goes first: the first run after new keys
        // pays for the keyspace growing.
        for round in 0..4 {
            for client in [round % 2, 1 - round % 2] {
                let r = if client == 0 {
                    let c = conn.clone();
                    drive(tasks, n, dur, move |k, a| {
                        let mut c = c.clone();
                        async move {
                            let _: redis::Value = redis::cmd("FCALL")
                                .arg("lh_exact_batch")
                                .arg(k.len())
                                .arg(&k)
                                .arg(&a)
                                .query_async(&mut c)
                                .await
                                .unwrap();
                        }
                    })
                    .await
                } else {
                    let f = fc.clone();
                    drive(tasks, n, dur, move |k, a| {
                        let f = f.clone();
                        async move {
                            let _: fred::types::Value =
                                f.fcall("lh_exact_batch", k, a).await.unwrap();
                        }
                    })
                    .await
                };
                println!(
                    "round {round} {tasks:>2} tasks x {n:>2} keys  {:<8}: {:>8.0} decisions/s  {:>6.1} µs client CPU per call",
                    ["redis-rs", "fred"][client],
                    r.decisions as f64 / r.secs,
                    r.cpu * 1e6 / (r.decisions / n) as f64
                );
            }
        }
    }
}
