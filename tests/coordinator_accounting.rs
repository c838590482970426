//! Global accounting end to end: agents report, the coordinator sums what they admitted
//! per key per second, checks it against `B + r*W`, and exports it: `/keys` and the
//! Prometheus metrics show the key, its admissions, and an overshoot of 0.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use coordinator::{Admin, Coordinator, CoordinatorConfig};
use gateway_agent::{Decision, Limiter, LimiterConfig, Rules};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = "[rules.api]\ncapacity = 500\nrate = \"2000/s\"\nleasing = \"lease\"\n";

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

#[test]
fn the_coordinator_accounts_admissions_and_exports_the_overshoot() {
    let server = support::server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in 0..3 {
            agents.push(
                Limiter::builder()
                    .redis(server.url())
                    .rules(Rules::from_toml(RULES).unwrap())
                    .config(LimiterConfig {
                        store: support::config(),
                        ..LimiterConfig::default()
                    })
                    .build()
                    .await
                    .unwrap(),
            );
        }
        let store = support::store(&server.url()).await;
        let coordinator = Arc::new(Coordinator::new(
            store.clone(),
            Rules::from_toml(RULES).unwrap(),
            CoordinatorConfig::default(),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin = Admin::new(store, Rules::from_toml(RULES).unwrap())
            .with_snapshot(coordinator.snapshot());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let serving = tokio::spawn(coordinator::serve(listener, admin, {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }));
        let running = {
            let (c, mut rx) = (coordinator.clone(), stop_rx.clone());
            tokio::spawn(async move {
                c.run(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await;
            })
        };
        // Three agents flat out on one key: 2000/s can be admitted in all.
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut load = Vec::new();
        for l in &agents {
            let (l, stop, admitted) = (l.clone(), stop.clone(), admitted.clone());
            load.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match l.check("tenant-1", "api", 1).await.unwrap() {
                        Decision::Allowed { .. } => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => tokio::time::sleep(Duration::from_millis(1)).await,
                    }
                }
            }));
        }
        // Reports every whole second; a second is settled 1.5 s after it ends.
        let key = "lh:{api|tenant-1}";
        let waited = Instant::now();
        let stats = loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let snap = coordinator.snapshot().read().clone();
            if let Some(k) = snap.keys.get(key)
                && k.stats.admitted_last_sec > 0
                && k.stats.agents == 3
            {
                break k.stats.clone();
            }
            assert!(
                waited.elapsed() < Duration::from_secs(10),
                "no accounting: {snap:?}"
            );
        };
        println!("accounting after {:?}: {stats:?}", waited.elapsed());
        let (status, body) = get(addr, "/keys").await;
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["leader"], true, "{v}");
        assert_eq!(v["agents"], 3, "{v}");
        assert_eq!(v["keys"][0]["key"], key, "{v}");
        let (_, view) = get(addr, "/keys/api/tenant-1").await;
        let view: serde_json::Value = serde_json::from_str(&view).unwrap();
        assert!(
            view["accounting"]["admitted_total"].as_u64().unwrap() > 0,
            "{view}"
        );
        let (_, metrics) = get(addr, "/metrics").await;
        let line = |name: &str| {
            metrics
                .lines()
                .find(|l| l.starts_with(name) && l.contains("rule=\"api\""))
                .unwrap_or_else(|| panic!("no {name} in {metrics}"))
                .to_owned()
        };
        println!(
            "{}\n{}",
            line("leasehold_overshoot_ratio"),
            line("leasehold_admitted_tokens")
        );
        assert!(line("leasehold_overshoot_ratio").ends_with(" 0"));
        assert_eq!(stats.overshoot, 0.0);
        // What was admitted in the last settled second is within one second's budget
        // (r plus what B can add).
        assert!(stats.admitted_last_sec <= 2000 + 500, "{stats:?}");
        assert!(
            stats.admitted_last_sec >= 1500,
            "the key is saturated: {stats:?}"
        );
        stop.store(true, Ordering::Relaxed);
        for t in load {
            t.await.unwrap();
        }
        let t = started.elapsed().as_secs_f64();
        let admitted = admitted.load(Ordering::Relaxed);
        assert!(admitted as f64 <= 500.0 + 2000.0 * t, "{admitted} in {t} s");
        let _ = stop_tx.send(true);
        running.await.unwrap();
        serving.await.unwrap().unwrap();
    });
}
