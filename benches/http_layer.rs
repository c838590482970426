//! What the tower layer adds to a request's latency under concurrent HTTP load: the same
//! axum service on loopback with and without `RateLimitLayer`, keep-alive HTTP/1.1
//! clients in the same process, rounds alternating between the two so a noisy machine
//! affects both alike. The key is leased (the layer decides without the store), which is
//! the path a hot tenant takes.
//!
//! `cargo bench --bench http_layer` (env: `LAYER_CLIENTS` default 16, `LAYER_REQUESTS`
//! per client per round default 2000, `LAYER_ROUNDS` default 5).
#![allow(clippy::expect_used, clippy::unwrap_used)] // a benchmark fails by panicking

use std::net::SocketAddr;
use std::time::Instant;

use axum::Router;
use axum::routing::any;
use hdrhistogram::Histogram;
use leasehold::agent::http::RateLimitLayer;
use leasehold::agent::{Limiter, Rules};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const RULES: &str = "[rules.api]\ncapacity = 1000000\nrate = \"1000000/s\"\n\
                     leasing = \"lease\"\nlease_max = 100000\n";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One keep-alive exchange; the status.
async fn exchange(c: &mut TcpStream, req: &[u8], buf: &mut Vec<u8>) -> u16 {
    c.write_all(req).await.unwrap();
    buf.clear();
    let mut chunk = [0u8; 2048];
    loop {
        let n = c.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..i]).unwrap().to_owned();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < i + 4 + len {
                let n = c.read(&mut chunk).await.unwrap();
                buf.extend_from_slice(&chunk[..n]);
            }
            return head.split_whitespace().nth(1).unwrap().parse().unwrap();
        }
    }
}

/// `clients` connections, `requests` each, all at once; latencies in µs.
async fn round(addr: SocketAddr, clients: usize, requests: usize, hist: &mut Histogram<u64>) {
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            tokio::spawn(async move {
                let mut c = TcpStream::connect(addr).await.unwrap();
                c.set_nodelay(true).unwrap();
                let req = b"GET / HTTP/1.1\r\nHost: b\r\nx-api-key: hot-tenant\r\n\r\n";
                let mut buf = Vec::with_capacity(1024);
                let mut h = Histogram::<u64>::new(3).unwrap();
                for _ in 0..requests {
                    let t = Instant::now();
                    let status = exchange(&mut c, req, &mut buf).await;
                    assert_eq!(status, 200);
                    h.record(t.elapsed().as_micros() as u64).unwrap();
                }
                h
            })
        })
        .collect();
    for t in tasks {
        hist.add(t.await.unwrap()).unwrap();
    }
}

/// The layer's own cost per request, in process (no sockets): a `oneshot` through a
/// service that answers at once, with and without the layer, best of five.
async fn in_process(layer: &RateLimitLayer<leasehold::agent::http::ByHeader>) {
    use tower::{Layer, Service, ServiceExt};
    let inner = tower::service_fn(|_r: http::Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    let req = || {
        http::Request::builder()
            .uri("/")
            .header("x-api-key", "hot-tenant")
            .body(String::new())
            .unwrap()
    };
    const N: u32 = 200_000;
    let mut best = [f64::MAX; 2];
    for _ in 0..5 {
        let mut plain = inner;
        let t = Instant::now();
        for _ in 0..N {
            let r = plain.ready().await.unwrap().call(req()).await.unwrap();
            std::hint::black_box(r);
        }
        best[0] = best[0].min(t.elapsed().as_nanos() as f64 / f64::from(N));
        let mut limited = layer.layer(inner);
        let t = Instant::now();
        for _ in 0..N {
            let r = limited.ready().await.unwrap().call(req()).await.unwrap();
            assert_eq!(r.status(), 200);
            std::hint::black_box(r);
        }
        best[1] = best[1].min(t.elapsed().as_nanos() as f64 / f64::from(N));
    }
    println!(
        "in process, per request (request built, called, dropped): {:.0} ns without, {:.0} ns with the layer (+{:.0} ns)",
        best[0],
        best[1],
        best[1] - best[0]
    );
}

fn main() {
    let (clients, requests, rounds) = (
        env("LAYER_CLIENTS", 16),
        env("LAYER_REQUESTS", 2000),
        env("LAYER_ROUNDS", 5),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let limiter = Limiter::builder()
            .embedded()
            .rules(Rules::from_toml(RULES).unwrap())
            .build()
            .await
            .unwrap();
        let app = || Router::new().route("/", any(|| async { "ok\n" }));
        let plain = serve(app()).await;
        let layer = RateLimitLayer::by_header(
            limiter.clone(),
            http::HeaderName::from_static("x-api-key"),
            "api",
        );
        let limited = serve(app().layer(layer.clone())).await;
        in_process(&layer).await;
        // Warm up: connections, the key's lease.
        let mut warm = Histogram::<u64>::new(3).unwrap();
        round(plain, clients, 200, &mut warm).await;
        round(limited, clients, 200, &mut warm).await;
        let mut without = Histogram::<u64>::new(3).unwrap();
        let mut with = Histogram::<u64>::new(3).unwrap();
        for _ in 0..rounds {
            round(plain, clients, requests, &mut without).await;
            round(limited, clients, requests, &mut with).await;
        }
        let stats = limiter.stats("api").unwrap();
        println!(
            "{clients} keep-alive clients, {} requests each way, this machine, one run",
            without.len()
        );
        for (name, h) in [("without the layer", &without), ("with the layer", &with)] {
            println!(
                "{name:<18} p50 {:>5} µs  p99 {:>5} µs  p99.9 {:>5} µs",
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999)
            );
        }
        println!(
            "added             p50 {:>+5} µs  p99 {:>+5} µs",
            with.value_at_quantile(0.5) as i64 - without.value_at_quantile(0.5) as i64,
            with.value_at_quantile(0.99) as i64 - without.value_at_quantile(0.99) as i64
        );
        println!(
            "decisions: {} from the lease, {} exact, {} store calls",
            stats.admitted_lease, stats.admitted_exact, stats.store_calls
        );
    });
}
