//! `leasehold serve` over gRPC: decisions per second and latency with many concurrent
//! clients, for one hot key and for many keys, against a private redis-server.
//!
//! `cargo bench --bench serve` (env: `SERVE_CLIENTS` default 64 concurrent calls over
//! 8 HTTP/2 connections, then on one connection paced, `SERVE_SECS` default 5 per
//! workload, `SERVE_KEYS` default 100 000). Client, server and Redis share this
//! machine's cores: the figures are a floor for a dedicated server.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark fails by panicking

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use hdrhistogram::Histogram;
use leasehold_redis_harness::RedisServer;
use leasehold_serve::Domains;

const CONFIG: &str = r#"
domain: bench
descriptors:
  # One tenant far over what the clients can send: every call is admitted.
  - key: hot
    rate_limit: {unit: second, requests_per_unit: 1000000}
  # Many tenants, 50 a second each.
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 50}
"#;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn request(key: &str, value: String) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: key.into(),
                value,
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    }
}

async fn workload(
    addr: std::net::SocketAddr,
    clients: usize,
    connections: usize,
    pace: Option<Duration>,
    secs: u64,
    keys: usize,
    hot: bool,
) -> (f64, Histogram<u64>, u64) {
    let mut channels = Vec::new();
    for _ in 0..connections {
        channels.push(
            RateLimitServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap(),
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let mut c = channels[i % channels.len()].clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new(3).unwrap();
                let mut over = 0u64;
                let mut n = i as u64;
                // Spread over the period, not in waves of every client at once.
                let mut tick = pace.map(|p| {
                    let offset = p * i as u32 / clients as u32;
                    tokio::time::interval_at(tokio::time::Instant::now() + offset, p)
                });
                while !stop.load(Ordering::Relaxed) {
                    if let Some(t) = tick.as_mut() {
                        t.tick().await;
                    }
                    n = n
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let req = if hot {
                        request("hot", "tenant-0".into())
                    } else {
                        request("tenant", format!("t{}", (n >> 33) as usize % keys))
                    };
                    let t = Instant::now();
                    let r = c.should_rate_limit(req).await.unwrap().into_inner();
                    h.record(t.elapsed().as_micros() as u64).unwrap();
                    over += u64::from(r.overall_code == Code::OverLimit as i32);
                }
                (h, over)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Histogram::<u64>::new(3).unwrap();
    let mut over = 0;
    for t in tasks {
        let (h, o) = t.await.unwrap();
        all.add(h).unwrap();
        over += o;
    }
    let rate = all.len() as f64 / started.elapsed().as_secs_f64();
    (rate, all, over)
}

/// The allocator the `leasehold` binary runs serve with (src/main.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let (clients, secs, keys) = (
        env("SERVE_CLIENTS", 64),
        env("SERVE_SECS", 5) as u64,
        env("SERVE_KEYS", 100_000),
    );
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let domains = Domains::from_yaml(CONFIG, "bench.yaml").unwrap();
        let limiter = leasehold_agent::Limiter::builder()
            .redis(redis.url())
            .rules(domains.rules())
            .build()
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(leasehold_serve::serve(
            leasehold_serve::Decider::new(limiter.clone(), domains, Default::default()),
            Some(listener),
            None,
            None,
            leasehold_net::Limits::default(),
            async {
                let _ = stopped.await;
            },
        ));
        println!(
            "leasehold serve, gRPC ShouldRateLimit, {clients} concurrent calls, {secs} s each, private redis-server, one run"
        );
        // The last: every call on one HTTP/2 connection, as one Envoy worker sends them,
        // each client calling every 10 ms (about a quarter of what this machine serves),
        // so latency is the answer's, not a queue's: a server without TCP_NODELAY stalls
        // some answers 40 ms behind delayed ACKs.
        for (name, hot, connections, pace) in [
            ("one hot key", true, 8, None),
            ("many keys", false, 8, None),
            ("paced", true, 1, Some(Duration::from_millis(10))),
        ] {
            let calls_before = limiter.stats(&leasehold_serve::config::rule_name(if hot { "bench.hot" } else { "bench.tenant" })).unwrap().store_calls;
            let (rate, h, over) = workload(addr, clients, connections, pace, secs, keys, hot).await;
            let calls = limiter.stats(&leasehold_serve::config::rule_name(if hot { "bench.hot" } else { "bench.tenant" })).unwrap().store_calls - calls_before;
            println!(
                "{name:<12} {connections} conn. {rate:>9.0} decisions/s  p50 {:>6} µs  p99 {:>6} µs  p99.9 {:>6} µs  max {:>6} µs  over limit {over}  store calls/1k {:.1}{}",
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999),
                h.max(),
                calls as f64 * 1000.0 / h.len() as f64,
                if hot { String::new() } else { format!("  ({keys} keys)") }
            );
        }
        stop.send(()).unwrap();
        serving.await.unwrap().unwrap();
    });
}
