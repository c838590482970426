//! `leasehold serve`'s rate limit quota service (RLQS) on a real Redis, through clients
//! that behave as Envoy's `rate_limit_quota` filter is documented to: a stream per
//! client, the domain in the first report, a report as the first request of a bucket
//! arrives and then every reporting interval (allowed, denied, time elapsed), a token
//! bucket per assignment — new when the strategy differs or the last one expired (full),
//! extended when it is the same — and requests refused with no assignment or an expired
//! one (`no_assignment_behavior` and `expired_assignment_behavior` set to deny), blanket
//! rules applied as they say, and a reconnect to another server when the stream breaks.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_serve::rlqs::client::QuotaClient;

use crate::rls_and_http::Serving;
use crate::support;
use crate::support::rlqs::{INTERVAL, run_filter, worst_excess};

const CONFIG: &str = r#"
domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 200}
  - key: open
    rate_limit: {unlimited: true}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
"#;

fn fcalls(server: &leasehold_redis_harness::RedisServer) -> u64 {
    let info: String = server.cmd(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_fcall_ro:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Eight filters on one key at 1.2x its rate through one serve: every window within
/// `B + r·W`, most of the rate used, store calls a few a second whatever the requests,
/// and blanket rules for unlimited and zero limits.
#[test]
fn envoy_filters_enforce_assignments_that_keep_the_bound() {
    let server = support::server();
    support::runtime().block_on(async {
        let serving = Serving::start(&server, CONFIG, Default::default(), false).await;
        // Blanket rules: unlimited and unmatched buckets are allowed, a zero limit denied.
        for (entries, allow) in [
            (vec![("open", "x")], true),
            (vec![("nothing", "here")], true),
            (vec![("blocked", "b")], false),
        ] {
            let f = QuotaClient::connect(serving.grpc, "quota", INTERVAL).await.unwrap();
            assert!(!f.admit(&entries), "{entries:?}: denied until assigned");
            let deadline = Instant::now() + Duration::from_secs(5);
            while f.received() == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(f.admit(&entries), allow, "{entries:?}");
        }
        // A first report without a domain ends the stream.
        let f = QuotaClient::connect(serving.grpc, "", INTERVAL).await.unwrap();
        f.admit(&[("tenant", "t")]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while f.ended().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let status = f.ended().expect("the stream ended");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("domain"), "{status:?}");

        // B = r = 200/s; 64 filters at 3.75/s each (1.2x), reporting every 200 ms.
        let calls_before = fcalls(&server);
        let servers = Arc::new(Mutex::new(vec![serving.grpc]));
        let start = Instant::now();
        let end = start + Duration::from_secs(6);
        let tasks: Vec<_> = (0..64)
            .map(|_| tokio::spawn(run_filter(servers.clone(), vec![("tenant", "acme")], 3.75, end)))
            .collect();
        let (mut all, mut pushes) = (Vec::new(), 0);
        for t in tasks {
            let (admitted, received) = t.await.unwrap();
            all.extend(admitted);
            pushes += received;
        }
        let secs = start.elapsed().as_secs_f64();
        let calls = fcalls(&server) - calls_before;
        let excess = worst_excess(all.clone(), 200.0, 200.0);
        let late = all
            .iter()
            .filter(|&&t| t >= start + Duration::from_secs(3))
            .count() as f64;
        let utilisation = late / (200.0 * (end - (start + Duration::from_secs(3))).as_secs_f64());
        println!(
            "RLQS, 64 filters at 1.2x r on one serve: {} admitted, worst window excess {excess:.1}, \
             utilisation over the last 3 s {utilisation:.3}, {:.1} store calls/s, {:.0} \
             assignments/s",
            all.len(),
            calls as f64 / secs,
            pushes as f64 / secs
        );
        assert!(excess <= 0.0, "a window admitted {excess:.1} over B + r·W");
        assert!(utilisation >= 0.8, "utilisation {utilisation:.3}");
        assert!(
            calls as f64 / secs <= 20.0,
            "{calls} store calls in {secs:.1} s"
        );
        // An assignment per filter per renewal (three a term) at most: set by the term,
        // not by the requests.
        assert!(
            pushes as f64 / secs <= 64.0 * 10.0,
            "{pushes} assignments in {secs:.1} s"
        );
        serving.stop().await;
    });
}

/// Two serve instances on one Redis, filters on the first; it stops mid-run: the filters'
/// assignments run out, they reconnect to the second, and the bound holds throughout.
#[test]
fn a_stopped_server_s_filters_move_to_another_and_the_bound_holds() {
    let server = support::server();
    support::runtime().block_on(async {
        let a = Serving::start(&server, CONFIG, Default::default(), false).await;
        let b = Serving::start(&server, CONFIG, Default::default(), false).await;
        let servers = Arc::new(Mutex::new(vec![a.grpc, b.grpc]));
        let start = Instant::now();
        let end = start + Duration::from_secs(6);
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                tokio::spawn(run_filter(
                    servers.clone(),
                    vec![("tenant", "moving")],
                    60.0,
                    end,
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        a.stop().await;
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap().0);
        }
        let excess = worst_excess(all.clone(), 200.0, 200.0);
        let late = all
            .iter()
            .filter(|&&t| t >= start + Duration::from_secs(4))
            .count() as f64;
        let utilisation = late / (200.0 * (end - (start + Duration::from_secs(4))).as_secs_f64());
        println!(
            "RLQS, 4 filters at 1.2x r, their server stopped at 2 s: worst window excess \
             {excess:.1}, utilisation over the last 2 s {utilisation:.3}"
        );
        assert!(excess <= 0.0, "a window admitted {excess:.1} over B + r·W");
        assert!(utilisation >= 0.7, "utilisation {utilisation:.3}");
        b.stop().await;
    });
}

/// A bucket whose reports show no request for the idle time is abandoned: the filter
/// forgets it, and its next request subscribes it again.
#[test]
fn an_idle_bucket_is_abandoned_and_its_next_request_subscribes_it_again() {
    let server = support::server();
    support::runtime().block_on(async {
        let options = leasehold_serve::Options {
            rlqs_idle: Some(Duration::from_secs(1)),
            ..Default::default()
        };
        let serving = Serving::start(&server, CONFIG, options, false).await;
        let f = QuotaClient::connect(serving.grpc, "quota", INTERVAL)
            .await
            .unwrap();
        let bucket = [("tenant", "idle")];
        let wait_for = |what: &'static str, done: Box<dyn Fn() -> bool>| async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !done() {
                assert!(Instant::now() < deadline, "{what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        assert!(!f.admit(&bucket), "no assignment yet");
        let g = f.clone();
        wait_for("an assignment", Box::new(move || g.received() > 0)).await;
        assert!(f.admit(&bucket));
        // No request for a second: the reports show none, and the server abandons it.
        let g = f.clone();
        wait_for("the bucket abandoned", Box::new(move || g.abandoned() > 0)).await;
        let before = f.received();
        assert!(
            !f.admit(&bucket),
            "forgotten: no assignment until one comes again"
        );
        let g = f.clone();
        wait_for("a new assignment", Box::new(move || g.received() > before)).await;
        assert!(f.admit(&bucket));
        serving.stop().await;
    });
}
