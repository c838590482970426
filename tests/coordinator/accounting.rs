//! Global accounting end to end: agents report, the coordinator sums what they admitted
//! per key per second, checks it against `B + r*W`, and exports it: `/keys` and the
//! Prometheus metrics show the key, its admissions, and an overshoot of 0.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_coordinator::Admin;
use support::http_get as get;

const RULES: &str = "[rules.api]\ncapacity = 500\nrate = \"2000/s\"\nleasing = \"lease\"\n";

#[test]
fn the_coordinator_accounts_admissions_and_exports_the_overshoot() {
    let server = support::server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in 0..3 {
            agents.push(support::limiter(&server.url(), RULES).await);
        }
        let store = support::store(&server.url()).await;
        let coordinator = support::coordinator(store.clone(), RULES);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin = Admin::new(store, support::rules(RULES))
            .with_metrics(leasehold_coordinator::admin::install_prometheus().expect("recorder"))
            .with_snapshot(coordinator.snapshot());
        let (stop_admin, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(leasehold_coordinator::serve(listener, admin, async {
            let _ = stopped.await;
        }));
        let running = coordinator.clone().spawn();
        // Three agents flat out on one key: 2000/s can be admitted in all (a denial
        // yields; the negative cache answers it without a store call).
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let load: Vec<_> = agents
            .iter()
            .map(|l| support::hammer(l, "tenant-1", "api", &stop, &admitted))
            .collect();
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
        running.stop().await;
        stop_admin.send(()).unwrap();
        serving.await.unwrap().unwrap();
    });
}

/// In a fleet of five hundred agents (`lh:agents`), an agent reports every 5 s instead of
/// every second, carrying each second's totals: the coordinator still places every
/// second's admissions in its second, and settles it once the reports covering it are due.
#[test]
fn a_large_fleets_slower_reports_still_account_each_second() {
    let server = support::server();
    support::runtime().block_on(async {
        let store = support::store(&server.url()).await;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        // The rest of the fleet: live entries without reports.
        let mut fleet = redis::cmd("ZADD");
        fleet.arg("lh:agents");
        for i in 0..497u64 {
            fleet
                .arg(now_ms + 60_000)
                .arg(format!("{:016x}", 0xf000_0000 + i));
        }
        store.query::<i64>(&fleet).await.unwrap();
        let mut agents = Vec::new();
        for _ in 0..3 {
            agents.push(support::limiter(&server.url(), RULES).await);
        }
        let coordinator = support::coordinator(store.clone(), RULES);
        let running = coordinator.clone().spawn();
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let load: Vec<_> = agents
            .iter()
            .map(|l| support::hammer(l, "tenant-1", "api", &stop, &admitted))
            .collect();
        let key = "lh:{api|tenant-1}";
        let report_key = format!("lh:agent:{{{}}}", agents[0].agent_id());
        let waited = Instant::now();
        let (text, stats) = loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let text: Option<String> = store
                .query(redis::cmd("GET").arg(&report_key))
                .await
                .unwrap();
            let snap = coordinator.snapshot().read().clone();
            if let (Some(text), Some(k)) = (text, snap.keys.get(key))
                && text.contains("\n=every 5")
                && text.contains("\n=past ")
                && k.stats.window_10s.secs >= 3
            {
                break (text, k.stats.clone());
            }
            assert!(
                waited.elapsed() < Duration::from_secs(30),
                "no slower cadence or no accounting: {snap:?}"
            );
        };
        println!("after {:?}: {text}\n{stats:?}", waited.elapsed());
        // The fleet's set expires a report's life after the last report (it was kept for
        // ever once every agent had stopped).
        let life: i64 = store
            .query(redis::cmd("PTTL").arg("lh:agents"))
            .await
            .unwrap();
        assert!(
            life > 0 && life as u64 <= leasehold_store::report::REPORT_TTL_MS,
            "lh:agents lives {life} ms"
        );
        stop.store(true, Ordering::Relaxed);
        for t in load {
            t.await.unwrap();
        }
        running.stop().await;
        // Saturated every second, and each second's admissions in their second: within
        // one second's budget, and not spread thin by a report every 5 s.
        assert_eq!(stats.overshoot, 0.0, "{stats:?}");
        assert!(
            (1500..=2500).contains(&stats.admitted_last_sec),
            "{stats:?}"
        );
        let w = stats.window_10s;
        assert!(
            w.admitted as f64 >= 1500.0 * w.secs as f64 && w.overshoot == 0.0,
            "{stats:?}"
        );
    });
}

/// A gateway that stops reporting leaves the coordinator's live view after two of its
/// intervals between reports (a second each in a small fleet) and a tick, not when its
/// report expires (20 s: two reports of the slowest cadence); the others stay.
#[test]
fn a_gateway_that_stops_reporting_leaves_the_live_view_within_two_intervals() {
    let server = support::server();
    support::runtime().block_on(async {
        let a = support::limiter(&server.url(), RULES).await;
        let b = support::limiter(&server.url(), RULES).await;
        let (a_id, b_id) = (a.agent_id().to_string(), b.agent_id().to_string());
        let store = support::store(&server.url()).await;
        let coordinator = support::coordinator(store, RULES);
        let running = coordinator.clone().spawn();
        let live = || {
            let snap = coordinator.snapshot().read().clone();
            (
                snap.gateways.contains_key(&a_id),
                snap.gateways.contains_key(&b_id),
                snap.agents,
            )
        };
        let waited = Instant::now();
        while live() != (true, true, 2) {
            assert!(
                waited.elapsed() < Duration::from_secs(15),
                "both gateways never live: {:?}",
                coordinator.snapshot().read().gateways
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        a.shutdown().await;
        let stopped = Instant::now();
        while live().0 {
            assert!(
                stopped.elapsed() < Duration::from_secs(12),
                "a gateway that stopped reporting still live after 12 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("gone after {:?}", stopped.elapsed());
        assert_eq!(live(), (false, true, 1));
        running.stop().await;
    });
}
