//! The Prometheus exporter (its own test binary: a process has one metrics recorder).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::time::Duration;

use leasehold_agent::{Limiter, Rules};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn prometheus_exporter_serves_decision_counters_on_loopback() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let l = Limiter::builder()
        .embedded()
        .rules(
            Rules::from_toml("[rules.api]\ncapacity = 5\nrate = \"1/s\"\nleasing = \"exact\"\n")
                .unwrap(),
        )
        .prometheus(listener)
        .build()
        .await
        .unwrap();
    for _ in 0..200 {
        l.check(&"api".into(), "t", 1).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1300)).await; // one publish tick
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(
        body.contains("leasehold_decisions_total{rule=\"api\",outcome=\"admitted_exact\"} 5"),
        "{body}"
    );
    assert!(
        body.contains("leasehold_decisions_total{rule=\"api\",outcome=\"denied\"} 195"),
        "{body}"
    );
    // Decision and store call times are histograms with buckets, which sum over
    // gateways (a summary's quantiles do not).
    assert!(
        body.contains("leasehold_decision_seconds_bucket{le="),
        "sampled decision times: {body}"
    );
    assert!(
        body.contains("leasehold_store_call_seconds_bucket{shard=\"all\",op=\"exact\",le="),
        "store call times by shard and op: {body}"
    );
    assert!(
        body.contains("leasehold_breaker_open{shard=\"all\"} 0"),
        "breaker state: {body}"
    );
    assert!(
        body.contains("# HELP leasehold_decisions_total Decisions by rule and outcome"),
        "help text: {body}"
    );
    assert!(
        body.contains("leasehold_store_calls_total{rule=\"api\"}"),
        "{body}"
    );
    // Only /metrics: a probe pointed here by mistake fails.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 404"), "{body}");
}
