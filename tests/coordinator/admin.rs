//! The coordinator's admin endpoint against real agents on a real Redis: agents with
//! different demand on one key show up with shares that follow their demand.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use leasehold_agent::Limiter;
use leasehold_coordinator::Admin;
use support::http_get as get;

/// Leases of at most 200 tokens: every agent refills, and so reports its demand, several
/// times a second (demand travels with acquires).
const RULES: &str =
    "[rules.api]\ncapacity = 100000\nrate = \"100000/s\"\nleasing = \"lease\"\nlease_max = 200\n";

#[test]
fn admin_view_shows_agents_and_their_shares_of_demand() {
    let server = support::server();
    support::runtime().block_on(async {
        let mut agents = Vec::new();
        for _ in 0..3 {
            agents.push(
                Limiter::builder()
                    .redis(server.url())
                    .rules(support::rules(RULES))
                    .build()
                    .await
                    .unwrap(),
            );
        }
        // Agent i sends (i + 1) x 200 decisions per 100 ms for 3 s: demand 1:2:3. The
        // reported demand averages over about a second, so it has settled by then.
        for _ in 0..30 {
            for (i, l) in agents.iter().enumerate() {
                for _ in 0..(i + 1) * 200 {
                    l.check(&"api".into(), "tenant-7", 1).await.unwrap();
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let store = leasehold_agent::RedisStore::connect(&server.url(), support::config())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(leasehold_coordinator::serve(
            listener,
            Admin::new(store, support::rules(RULES)).with_metrics(
                leasehold_coordinator::admin::install_prometheus().expect("recorder"),
            ),
            async {
                let _ = stopped.await;
            },
        ));
        assert_eq!(get(addr, "/health").await, (200, "ready\n".to_owned()));
        let (status, body) = get(addr, "/keys/api/tenant-7").await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        println!("{}", serde_json::to_string_pretty(&v).unwrap());
        let agents_view = v["agents"].as_array().unwrap();
        assert_eq!(agents_view.len(), 3, "{v}");
        let mut shares: Vec<f64> = agents_view
            .iter()
            .map(|a| a["share"].as_f64().unwrap())
            .collect();
        let total: f64 = shares.iter().sum();
        assert!((total - 1.0).abs() < 1e-9, "shares sum to 1: {shares:?}");
        shares.sort_by(f64::total_cmp);
        for (share, expected) in shares.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            assert!(
                (share - expected).abs() < 0.1,
                "shares {shares:?} should follow demand 1:2:3"
            );
        }
        let held: u64 = agents_view
            .iter()
            .map(|a| a["held"].as_u64().unwrap())
            .sum();
        assert_eq!(
            v["outstanding"].as_u64().unwrap(),
            held,
            "outstanding is what the agents hold"
        );
        let (status, body) = get(addr, "/keys/nope/x").await;
        assert!(
            status == 404 && body.contains("unknown rule"),
            "{status} {body}"
        );
        let (status, body) = get(addr, "/keys/api/%7Bhostile%7D%00").await;
        assert_eq!(status, 200, "hostile subjects are just subjects: {body}");
        // Subjects are bytes: one that is not UTF-8 is looked up as the agents key it.
        let (status, body) = get(addr, "/keys/api/%FF%FEk").await;
        assert_eq!(status, 200, "a byte subject: {body}");
        assert!(body.contains("lh:{api|%FF%FEk}"), "{body}");
        let (_, metrics) = get(addr, "/metrics").await;
        assert!(
            metrics.contains("leasehold_coordinator_key_views_total"),
            "{metrics}"
        );
        stop.send(()).unwrap();
        serving.await.unwrap().unwrap();
    });
}
