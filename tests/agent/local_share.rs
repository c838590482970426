//! The local share on a real Redis: `lh_seat` against its model, and agents spending
//! seats and the global part together within one bucket's bound.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use leasehold_core::local::{SeatReply, seats_key};
use leasehold_core::model::AgentId;
use leasehold_core::model::seats::Seats;
use support::{runtime, server, store};

/// Claims, renewals, refusals and leaving in a random order (agents, seats, pauses that
/// end tenures; `LEASEHOLD_SEED` replays one), the same on Redis as in the model run at
/// Redis's own times (read back from the key's `ts`): every reply and every stored
/// record. Then the key's expiry, and hostile input refused by name.
#[test]
fn lh_seat_matches_the_model() {
    use rand::{Rng, SeedableRng};

    let server = server();
    let seed = std::env::var("LEASEHOLD_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let mut model = Seats::new();
        let ttl = 40_000;
        let seats = rng.random_range(1..=3u64);
        for step in 0..150 {
            if rng.random_bool(0.15) {
                let ms = rng.random_range(0..60);
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            let agent = rng.random_range(1..=5u64);
            let leave = rng.random_bool(0.1);
            let got = st
                .claim_seat("seats", AgentId(agent), seats, ttl, leave)
                .await
                .expect("lh_seat");
            let fields: Vec<String> = server
                .cmd(&["HGETALL", &seats_key("seats")])
                .expect("HGETALL");
            let mut stored: Vec<(AgentId, u64)> = Vec::new();
            let mut now = 0;
            for kv in fields.chunks(2) {
                let v: u64 = kv[1].parse().unwrap();
                if kv[0] == "ts" {
                    now = v;
                } else {
                    stored.push((AgentId(u64::from_str_radix(&kv[0], 16).unwrap()), v));
                }
            }
            stored.sort_unstable();
            let want = if leave {
                model.leave(AgentId(agent), now);
                SeatReply::Full { retry_us: 0 }
            } else {
                model.claim(AgentId(agent), seats, ttl, now)
            };
            let ctx = format!("seed {seed} step {step}: agent {agent} leave {leave} at {now}");
            assert_eq!(got, want, "{ctx}");
            assert_eq!((stored, now), model.stored(), "{ctx}");
            assert!(model.held(now) as u64 <= seats, "{ctx}");
        }
        let sent = std::time::Instant::now();
        let _ = st
            .claim_seat("seats", AgentId(9), seats, 300_000, false)
            .await;
        let pttl: i64 = server.cmd(&["PTTL", &seats_key("seats")]).expect("PTTL");
        // A second past the last tenure, less what has passed since the claim (a busy
        // machine takes milliseconds between it and the PTTL).
        let since = sent.elapsed().as_millis() as i64;
        assert!(
            pttl > 1000 - since - 1 && pttl <= 1300,
            "the key outlives its last tenure: {pttl} ms, {since} ms after the claim"
        );
        let mut c = server.connection().unwrap();
        for (args, want) in [
            (vec!["lh:{x|y}", "ab", "2", "10", "0"], "not a seats key"),
            (vec!["lh:{x}:seats", "zz", "2", "10", "0"], "agent"),
            (
                vec!["lh:{x}:seats", "ab", "0", "10", "0"],
                "seats or ttl_us = 0",
            ),
            (
                vec!["lh:{x}:seats", "ab", "5000", "10", "0"],
                "seats = 5000",
            ),
            (vec!["lh:{x}:seats", "ab", "2", "10", "2"], "leave = 2"),
        ] {
            let e = redis::cmd("FCALL")
                .arg("lh_seat")
                .arg(1)
                .arg(&args)
                .query::<redis::Value>(&mut c)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    });
}

/// Eight gateways, four seats, three keys hammered from every gateway for 1.5 s: the
/// seat holders spend locally, the rest through the store, and each key admits at most
/// B + r*T over the run and at least four fifths of r*T (demand is on every gateway, so
/// every seat is used). Then a seat holder stops, and a gateway that had none takes its
/// seat within a renewal or two.
#[test]
fn gateways_beyond_the_seats_use_the_store_and_take_a_freed_seat() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    let server = server();
    let toml = r#"
        [rules.api]
        capacity = 40
        rate = "200/s"
        local_percent = 50
        local_agents = 4
    "#;
    runtime().block_on(async {
        let mut fleet = Vec::new();
        for _ in 0..8 {
            fleet.push(support::limiter(&server.url(), toml).await);
        }
        // Every gateway claims as it starts; the claims settle within a renewal.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let holders = seated(&fleet, "probe").await;
        assert_eq!(holders.len(), 4, "four seats, held by {holders:?}");
        let stop = Arc::new(AtomicBool::new(false));
        let keys = ["k0", "k1", "k2"];
        let admitted: Vec<Arc<AtomicU64>> = keys.iter().map(|_| Arc::default()).collect();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for l in &fleet {
            for (k, key) in keys.iter().enumerate() {
                tasks.push(support::hammer(l, key, "api", &stop, &admitted[k]));
            }
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("hammer");
        }
        let secs = started.elapsed().as_secs_f64();
        let bound = 40.0 + 200.0 * secs;
        for (k, a) in admitted.iter().enumerate() {
            let a = a.load(Ordering::Relaxed) as f64;
            assert!(a <= bound, "key {k}: {a} admitted > B + r*T = {bound:.0}");
            assert!(
                a >= 0.8 * 200.0 * secs,
                "key {k}: {a} admitted of {bound:.0}"
            );
        }
        let stats = fleet[holders[0]].stats("api").expect("stats");
        assert!(stats.admitted_local > 0, "{stats:?}");
        // A holder stops: its seat goes back at once, and one of the others takes it.
        let gone = holders[0];
        fleet[gone].shutdown().await;
        let waiting: Vec<usize> = (0..8).filter(|i| !holders.contains(i)).collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut taken = None;
        while taken.is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for &i in &waiting {
                // A new tenure starts empty: a key its seat has not seen fills in a
                // whole refill (200 ms here).
                if from_seat(&fleet[i], "fresh").await {
                    taken = Some(i);
                }
            }
        }
        assert!(taken.is_some(), "no gateway took the freed seat");
    });
}

/// What a seat admission reports as left (quota headers, Envoy's `limit_remaining`): the
/// seat's tokens and what the store's part was last seen to hold, not the seat alone.
#[test]
fn a_seat_admission_reports_the_whole_quota_left() {
    use std::time::Duration;

    use leasehold_agent::{Admission, Decision};

    let server = server();
    let toml = r#"
        [rules.api]
        capacity = 100
        rate = "100/s"
        local_percent = 50
        local_agents = 2
    "#;
    runtime().block_on(async {
        let l = support::limiter(&server.url(), toml).await;
        // The seat (25 tokens) fills within a refill (1 s) of the tenure's start.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let mut each = Vec::new();
        let (d, _) = l
            .check_all_each(
                &[leasehold_agent::Check::new(&"api".into(), "tenant", 1)],
                &mut each,
            )
            .await
            .expect("check");
        let Decision::Allowed {
            remaining,
            via: Admission::Local,
        } = d
        else {
            panic!("not from the seat: {d:?}");
        };
        // 24 in the seat, 50 in the store's part (full: never touched).
        assert_eq!(remaining, 74, "{d:?}");
    });
}

/// Seats follow the traffic: gateways holding seats no decision wants give them back
/// after `seat_idle_after`, and a busy gateway that had none takes one.
#[test]
fn an_idle_gateway_gives_its_seat_to_a_busy_one() {
    use std::time::{Duration, Instant};

    use leasehold_agent::{Limiter, LimiterConfig};

    let server = server();
    let toml = r#"
        [rules.api]
        capacity = 100
        rate = "100/s"
        local_percent = 50
        local_agents = 2
    "#;
    runtime().block_on(async {
        let mut fleet = Vec::new();
        for _ in 0..3 {
            let mut c = LimiterConfig::default();
            c.store = support::config();
            c.seat_idle_after = Duration::from_millis(1500);
            let l = Limiter::builder()
                .redis(server.url())
                .rules(support::rules(toml))
                .config(c)
                .build()
                .await
                .expect("limiter");
            fleet.push(l);
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let seated = seated(&fleet, "probe").await;
        assert_eq!(seated.len(), 2, "{seated:?}");
        let busy = (0..3).find(|i| !seated.contains(i)).unwrap();
        // Only the third gateway has traffic from now on.
        let holders = || -> Vec<String> {
            let v: Vec<String> = server
                .cmd(&["HGETALL", &seats_key("api")])
                .expect("HGETALL");
            v.chunks(2)
                .map(|p| p[0].clone())
                .filter(|f| f != "ts")
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(8);
        let me = fleet[busy].agent_id().to_string();
        while !holders().contains(&me) && Instant::now() < deadline {
            fleet[busy]
                .check(&"api".into(), "busy", 1)
                .await
                .expect("check");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            holders(),
            vec![me],
            "the idle gateways gave their seats back"
        );
    });
}

/// Whether one check of `subject` under `api` on `l` was admitted from its seat.
async fn from_seat(l: &leasehold_agent::Limiter, subject: &str) -> bool {
    matches!(
        l.check(&"api".into(), subject, 1).await.expect("check"),
        leasehold_agent::Decision::Allowed {
            via: leasehold_agent::Admission::Local,
            ..
        }
    )
}

/// The gateways of `fleet` whose check of `subject` was admitted from their seat.
async fn seated(fleet: &[leasehold_agent::Limiter], subject: &str) -> Vec<usize> {
    let mut seated = Vec::new();
    for (i, l) in fleet.iter().enumerate() {
        if from_seat(l, subject).await {
            seated.push(i);
        }
    }
    seated
}
