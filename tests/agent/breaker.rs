//! The per-shard breaker against real Redis: every way out of a probe ends it, so a shard
//! answers again within one cooldown of becoming healthy. Reproduces an outage where a
//! cancelled probe, or a probe ending in a non-retryable error (OOM), left the breaker
//! open for ever and every key on the shard answered 503.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::{Duration, Instant};

use leasehold_agent::{Decision, ErrorKind, Limiter};
use leasehold_redis_harness::{Fault, FaultProxy};
use support::server;

/// The breaker's cooldown (the default) plus room for a loaded machine.
const RECOVERY_LIMIT: Duration = Duration::from_secs(3);

const RULES: &str = "[rules.api]\ncapacity = 1000000\nrate = \"1000/s\"\nleasing = \"exact\"\n\
                     on_failure = \"fail_closed\"\ntimeout = \"400ms\"\n";

/// Checks fresh subjects until one is admitted; returns how long that took.
async fn until_admitted(l: &Limiter, tag: &str) -> Duration {
    let start = Instant::now();
    for i in 0.. {
        let d = l
            .check(&"api".into(), format!("{tag}-{i}"), 1)
            .await
            .unwrap();
        if let Decision::Allowed { .. } = d {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < RECOVERY_LIMIT,
            "{tag}: still {d:?} {:?} after the store became healthy",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!()
}

#[test]
fn out_of_memory_then_recovery_closes_the_breaker() {
    let server = server();
    support::runtime().block_on(async {
        let l = support::limiter(&server.url(), RULES).await;
        assert!(matches!(
            l.check(&"api".into(), "warm", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
        let _: String = server
            .cmd(&["CONFIG", "SET", "maxmemory", "1"])
            .expect("maxmemory");
        let mut unavailable = 0;
        for i in 0..40 {
            match l.check(&"api".into(), format!("oom-{i}"), 1).await.unwrap() {
                Decision::Unavailable { .. } => unavailable += 1,
                d => panic!("an OOM store admitted or denied: {d:?}"),
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(unavailable, 40);
        let ooms = l.store_errors(ErrorKind::OutOfMemory);
        assert!(ooms >= 3, "OOM replies are counted by kind: {ooms}");
        assert!(
            ooms < 40,
            "the breaker opened and spared the store most calls: {ooms}"
        );
        let _: String = server
            .cmd(&["CONFIG", "SET", "maxmemory", "0"])
            .expect("maxmemory");
        let took = until_admitted(&l, "healed").await;
        println!("OOM cleared: admitted again after {took:?} ({ooms} OOM replies seen)");
    });
}

#[test]
fn a_cancelled_probe_does_not_keep_the_breaker_open() {
    let server = server();
    let proxy = FaultProxy::start(server.addr()).expect("proxy");
    support::runtime().block_on(async {
        let l = support::limiter(&proxy.url(), RULES).await;
        assert!(matches!(
            l.check(&"api".into(), "warm", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
        proxy.set(Fault::Blackhole);
        // Timeouts open the breaker.
        let start = Instant::now();
        let mut i = 0;
        loop {
            i += 1;
            let asked = Instant::now();
            let d = l
                .check(&"api".into(), format!("down-{i}"), 1)
                .await
                .unwrap();
            assert!(matches!(d, Decision::Unavailable { .. }), "{d:?}");
            if asked.elapsed() < Duration::from_millis(100) {
                break; // refused at once: the breaker is open
            }
            assert!(start.elapsed() < Duration::from_secs(20), "never opened");
        }
        // After the cooldown, the next call is the probe; the client goes away mid-call.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let api = "api".into();
        let probe = tokio::time::timeout(Duration::from_millis(100), l.check(&api, "probe", 1));
        assert!(probe.await.is_err(), "the probe hangs on the dead store");
        proxy.cut();
        proxy.set(Fault::Pass);
        let took = until_admitted(&l, "healed").await;
        println!("probe cancelled, store healed: admitted again after {took:?}");
    });
}

/// A store killed outright refuses connections at once: every decision, the breaker's
/// probes included, is answered by the failure policy at once rather than after the
/// rule's timeout. (Each probe waited out the connection manager's reconnect backoff,
/// 0.3-0.4 s here and the whole timeout in serve, 50 ms: past Envoy's 20 ms, which then
/// failed the request open despite fail_closed.)
#[test]
fn with_the_store_killed_probes_answer_at_once() {
    let mut server = crate::support::server();
    crate::support::runtime().block_on(async {
        let rules =
            "[rules.ex]\ncapacity = 5\nrate = \"5/s\"\nleasing = \"exact\"\ntimeout = \"1s\"\n";
        let l = crate::support::limiter(&server.url(), rules).await;
        let rule = l.rule("ex").unwrap();
        l.check(&rule, "k", 1).await.unwrap();
        server.kill();
        // 2 s of decisions, 20 a second: four probes or so (the breaker's cooldown).
        let mut slow = Vec::new();
        for i in 0..40 {
            let t = std::time::Instant::now();
            let d = l.check(&rule, format!("k{i}"), 1).await.unwrap();
            assert!(
                matches!(d, leasehold_agent::Decision::Unavailable { .. }),
                "{d:?}"
            );
            if t.elapsed() > std::time::Duration::from_millis(150) {
                slow.push(t.elapsed());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        // One slow answer allowed for a busy machine; every probe was slow before.
        assert!(slow.len() <= 1, "answers slower than 150 ms: {slow:?}");
    });
}

/// Many decisions on one key share one batch call: when that call times out, the shard
/// counts one failure, not one per decision. (Each waiting decision counted its own, so a
/// burst of requests on one key while the store, or this process, was slow for one
/// timeout opened the breaker, logged "store unreachable" and refused every key of the
/// shard for a cooldown after the store answered again.)
#[test]
fn a_burst_waiting_on_one_call_is_one_failure() {
    let server = server();
    support::runtime().block_on(async {
        let l = support::limiter(&server.url(), RULES).await;
        let api = "api".into();
        assert!(matches!(
            l.check(&api, "warm", 1).await.unwrap(),
            Decision::Allowed { .. }
        ));
        server.pause().unwrap();
        let burst: Vec<_> = (0..40)
            .map(|_| {
                let (l, api) = (l.clone(), api.clone());
                tokio::spawn(async move { l.check(&api, "burst", 1).await.unwrap() })
            })
            .collect();
        for b in burst {
            let d = b.await.unwrap();
            assert!(matches!(d, Decision::Unavailable { .. }), "{d:?}");
        }
        server.resume().unwrap();
        let d = l.check(&api, "after", 1).await.unwrap();
        assert!(
            matches!(d, Decision::Allowed { .. }),
            "the store answers again, and one timed-out call did not open the breaker: {d:?}"
        );
        let timeouts = l.store_errors(ErrorKind::Timeout);
        assert!(
            timeouts >= 40,
            "each decision that waited out its timeout is counted: {timeouts}"
        );
    });
}

/// A gateway with no traffic finds out that its store died: each idle second it checks
/// the shard with a `PING`, and failed checks open the breaker as failed calls do, so
/// readiness says `degraded` before a request has to. (It said `ready` for as long as the
/// gateway stayed idle, and its next requests found out one refusal at a time.)
#[test]
fn an_idle_gateway_sees_its_store_die_without_a_request() {
    let mut server = server();
    support::runtime().block_on(async {
        let l = support::limiter(&server.url(), RULES).await;
        assert_eq!(l.health(), leasehold_agent::Health::Ready);
        server.kill();
        let start = Instant::now();
        let why = loop {
            if let leasehold_agent::Health::Degraded(why) = l.health() {
                break why;
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "still ready {:?} after the store died, with no request",
                start.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        println!(
            "idle gateway: degraded {:?} after the store died: {why}",
            start.elapsed()
        );
        assert!(why.contains("unreachable"), "{why}");
    });
}
