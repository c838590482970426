//! The slow path: cold decisions end to end (agent, batch, Redis, answer) against the
//! naive per-request script (one EVALSHA per decision), in the same run, on one private
//! redis-server. Keys are drawn Zipf 0.9 from 1 000 000 tenants with `leasing = "exact"`
//! and a limit no key reaches (B = r = 10^6/s), so every decision goes to the store and is
//! admitted: no local denial hides a call.
//!
//! - lone: one decision at a time (a batch of one: what an idle gateway pays).
//! - concurrent: `COLD_CLIENTS` (default 64) decisions in flight.
//!
//! Reports decisions/s, latency, store calls per decision and the Redis CPU per decision
//! (`INFO commandstats`: the function or script time, and `INFO cpu` for the whole
//! server). `cargo bench --bench cold_path` (env: `COLD_SECS` per workload, default 4).
//! Client and Redis share this machine's cores: compare the lines, not the absolutes.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark fails by panicking

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use leasehold::agent::{Decision, Limiter, Rules};
use leasehold_redis_harness::RedisServer;

/// The naive script, as `leasehold simulate` runs it.
const NAIVE_LUA: &str = include_str!("../src/simulate/naive.lua");

const KEYS: usize = 1_000_000;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Zipf 0.9 over `KEYS` through a cumulative table.
fn zipf_table() -> Arc<Vec<f64>> {
    let w: Vec<f64> = (1..=KEYS).map(|k| 1.0 / (k as f64).powf(0.9)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    Arc::new(
        w.iter()
            .map(|x| {
                acc += x / total;
                acc
            })
            .collect(),
    )
}

fn pick(cdf: &[f64], n: &mut u64) -> usize {
    *n = n
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let u = (*n >> 11) as f64 / (1u64 << 53) as f64;
    cdf.partition_point(|&c| c < u).min(KEYS - 1)
}

#[derive(Clone)]
enum System {
    Leasehold(Limiter),
    Naive(redis::aio::MultiplexedConnection, redis::Script),
}

impl System {
    async fn decide(&mut self, key: usize) -> bool {
        match self {
            Self::Leasehold(l) => matches!(
                l.check(&"cold".into(), format!("tenant-{key}"), 1)
                    .await
                    .unwrap(),
                Decision::Allowed { .. }
            ),
            Self::Naive(c, s) => {
                let ok: i64 = s
                    .key(format!("naive:{{tenant-{key}}}"))
                    .arg(1_000_000)
                    .arg(1_000_000)
                    .arg(1)
                    .invoke_async(c)
                    .await
                    .unwrap();
                ok == 1
            }
        }
    }
}

struct Stats {
    rate: f64,
    h: Histogram<u64>,
}

async fn workload(sys: &System, cdf: &Arc<Vec<f64>>, clients: usize, secs: u64) -> Stats {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let mut sys = sys.clone();
            let (stop, cdf) = (stop.clone(), cdf.clone());
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new(3).unwrap();
                let mut n = i as u64 + 1;
                while !stop.load(Ordering::Relaxed) {
                    let key = pick(&cdf, &mut n);
                    let t = Instant::now();
                    std::hint::black_box(sys.decide(key).await);
                    h.record(t.elapsed().as_micros() as u64).unwrap();
                }
                h
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut h = Histogram::<u64>::new(3).unwrap();
    for t in tasks {
        h.add(t.await.unwrap()).unwrap();
    }
    Stats {
        rate: h.len() as f64 / started.elapsed().as_secs_f64(),
        h,
    }
}

/// Total µs Redis spent in commands named `name` (`fcall`, `evalsha`), and the server's
/// CPU seconds.
fn redis_usage(redis: &RedisServer, name: &str) -> (f64, u64, f64) {
    let mut c = redis.connection().unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c)
        .unwrap();
    let (mut usec, mut calls) = (0.0, 0);
    if let Some(line) = stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
    {
        for kv in line.split(':').nth(1).unwrap_or_default().split(',') {
            match kv.split_once('=') {
                Some(("usec", v)) => usec = v.parse().unwrap_or(0.0),
                Some(("calls", v)) => calls = v.parse().unwrap_or(0),
                _ => {}
            }
        }
    }
    let cpu: String = redis::cmd("INFO").arg("cpu").query(&mut c).unwrap();
    let field = |f: &str| -> f64 {
        cpu.lines()
            .find_map(|l| l.strip_prefix(f))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    (
        usec,
        calls,
        field("used_cpu_user:") + field("used_cpu_sys:"),
    )
}

fn main() {
    let (clients, secs) = (env("COLD_CLIENTS", 64), env("COLD_SECS", 4) as u64);
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cdf = zipf_table();
    rt.block_on(async {
        let rules = Rules::from_toml(
            "[rules.cold]\ncapacity = 1000000\nrate = \"1000000/s\"\nleasing = \"exact\"\n",
        )
        .unwrap();
        let limiter = Limiter::builder()
            .redis(redis.url())
            .rules(rules)
            .build()
            .await
            .unwrap();
        let conn = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let systems = [
            ("leasehold", "fcall", System::Leasehold(limiter.clone())),
            ("naive", "evalsha", System::Naive(conn, redis::Script::new(NAIVE_LUA))),
        ];
        // Loads the naive script and warms both up.
        for (_, _, s) in &systems {
            let _ = workload(s, &cdf, 4, 1).await;
        }
        println!(
            "cold decisions, Zipf 0.9 over {KEYS} keys, private redis-server, {secs} s per line, one run"
        );
        for (workload_name, n) in [("lone", 1), ("concurrent", clients)] {
            for (name, cmd, sys) in &systems {
                let before = limiter.stats("cold").unwrap();
                let (usec0, calls0, cpu0) = redis_usage(&redis, cmd);
                let s = workload(sys, &cdf, n, secs).await;
                let (usec1, calls1, cpu1) = redis_usage(&redis, cmd);
                let after = limiter.stats("cold").unwrap();
                let decisions = s.h.len() as f64;
                let store_calls = if *name == "leasehold" {
                    (after.store_calls - before.store_calls) as f64
                } else {
                    (calls1 - calls0) as f64
                };
                // Decisions answered without the store (the breaker open: fail-open,
                // emergency or 503) are not a figure of the store path: say so.
                let degraded = |st: &leasehold::agent::RuleStats| {
                    st.admitted_fail_open + st.admitted_emergency + st.unavailable
                };
                let without_store = degraded(&after) - degraded(&before);
                let errors = after.store_errors - before.store_errors;
                println!(
                    "{workload_name:<10} ({n:>2} in flight) {name:<9} {:>8.0} decisions/s  p50 {:>5} µs  p99 {:>5} µs  \
                     store calls/decision {:.3}  redis µs/decision: script {:.1}, server {:.1}",
                    s.rate,
                    s.h.value_at_quantile(0.5),
                    s.h.value_at_quantile(0.99),
                    store_calls / decisions,
                    (usec1 - usec0) / decisions,
                    (cpu1 - cpu0) * 1e6 / decisions,
                );
                if without_store > 0 || errors > 0 {
                    println!(
                        "    not a store figure: {without_store} decisions answered without the \
                         store (breaker open), {errors} store errors"
                    );
                }
            }
        }
    });
}
