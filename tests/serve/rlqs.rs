//! `leasehold serve`'s rate limit quota service (RLQS) on a real Redis, through clients
//! that behave as Envoy's `rate_limit_quota` filter is documented to: a stream per
//! client, the domain in the first report, a report as the first request of a bucket
//! arrives and then every reporting interval (allowed, denied, time elapsed), a token
//! bucket per assignment — new when the strategy differs or the last one expired (full),
//! extended when it is the same — and requests refused with no assignment or an expired
//! one (`no_assignment_behavior` and `expired_assignment_behavior` set to deny), blanket
//! rules applied as they say, and a reconnect to another server when the stream breaks.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

use crate::rls_and_http::Serving;
use crate::support;

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

/// The bucket as the filter holds it.
#[derive(Clone, Debug, Default)]
enum Held {
    /// No assignment yet, or it expired: denied.
    #[default]
    None,
    Blanket(bool),
    Bucket {
        max: f64,
        per_ns: f64,
        level: f64,
        at: Instant,
        strategy: Strategy,
        expires: Option<Instant>,
    },
}

impl Held {
    fn apply(&mut self, strategy: Strategy, ttl: Option<Duration>, now: Instant) {
        let expires = ttl.map(|t| now + t);
        match strategy {
            Strategy::BlanketRule(r) => {
                *self = Held::Blanket(r == BlanketRule::AllowAll as i32);
            }
            Strategy::TokenBucket(tb) => {
                if let Held::Bucket {
                    strategy: s,
                    expires: e,
                    ..
                } = self
                    && *s == strategy
                    && e.is_none_or(|e| now < e)
                {
                    *e = expires;
                    return;
                }
                let tokens = f64::from(tb.tokens_per_fill.map_or(1, |v| v.value));
                let interval = tb
                    .fill_interval
                    .map_or(1e9, |d| d.seconds as f64 * 1e9 + f64::from(d.nanos));
                *self = Held::Bucket {
                    max: f64::from(tb.max_tokens),
                    per_ns: tokens / interval,
                    level: f64::from(tb.max_tokens),
                    at: now,
                    strategy,
                    expires,
                };
            }
            Strategy::RequestsPerTimeUnit(_) => panic!("not assigned by leasehold"),
        }
    }

    fn admit(&mut self, now: Instant) -> bool {
        match self {
            Held::None => false,
            Held::Blanket(allow) => *allow,
            Held::Bucket {
                max,
                per_ns,
                level,
                at,
                expires,
                ..
            } => {
                if expires.is_some_and(|e| now >= e) {
                    *self = Held::None;
                    return false;
                }
                *level = (*level + *per_ns * now.duration_since(*at).as_nanos() as f64).min(*max);
                *at = now;
                if *level >= 1.0 {
                    *level -= 1.0;
                    true
                } else {
                    false
                }
            }
        }
    }
}

/// One Envoy's filter for one bucket.
struct Filter {
    held: Arc<Mutex<Held>>,
    reports: tokio::sync::mpsc::Sender<RateLimitQuotaUsageReports>,
    /// Assignments received (new or extended), blanket rules included.
    received: Arc<Mutex<u64>>,
    /// The stream ended with this status.
    ended: Arc<Mutex<Option<tonic::Status>>>,
}

fn bucket_id(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<HashMap<_, _>>(),
    }
}

fn report(
    domain: &str,
    id: &BucketId,
    allowed: u64,
    denied: u64,
    elapsed: Duration,
) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.to_owned(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(id.clone()),
            time_elapsed: Some(PbDuration {
                seconds: elapsed.as_secs() as i64,
                nanos: elapsed.subsec_nanos() as i32,
            }),
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        }],
    }
}

impl Filter {
    /// Opens a stream to `addr`.
    async fn connect(addr: std::net::SocketAddr) -> Self {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mut inbound = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let held = Arc::new(Mutex::new(Held::None));
        let received = Arc::new(Mutex::new(0));
        let ended = Arc::new(Mutex::new(None));
        let (h, r, e) = (held.clone(), received.clone(), ended.clone());
        tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(resp)) => {
                        for a in resp.bucket_action {
                            let Some(Action::QuotaAssignmentAction(q)) = a.bucket_action else {
                                continue;
                            };
                            let ttl = q
                                .assignment_time_to_live
                                .map(|d| Duration::new(d.seconds as u64, d.nanos as u32));
                            let strategy = q.rate_limit_strategy.unwrap().strategy.unwrap();
                            h.lock().unwrap().apply(strategy, ttl, Instant::now());
                            *r.lock().unwrap() += 1;
                        }
                    }
                    Ok(None) => {
                        *e.lock().unwrap() = Some(tonic::Status::ok("closed"));
                        return;
                    }
                    Err(status) => {
                        *e.lock().unwrap() = Some(status);
                        return;
                    }
                }
            }
        });
        Self {
            held,
            reports: tx,
            received,
            ended,
        }
    }
}

/// Drives a filter for `entries` at `rate` requests a second (evenly spaced) until `end`,
/// reporting every `interval`; on a broken stream it reconnects to the next address of
/// `servers`. Returns the instants of its admissions.
async fn run_filter(
    servers: Arc<Mutex<Vec<std::net::SocketAddr>>>,
    entries: Vec<(&'static str, &'static str)>,
    rate: f64,
    interval: Duration,
    end: Instant,
) -> Vec<Instant> {
    let id = bucket_id(&entries);
    let mut which = 0;
    let addr = servers.lock().unwrap()[which];
    let mut f = Filter::connect(addr).await;
    let mut admitted = Vec::new();
    let (mut allowed, mut denied) = (0u64, 0u64);
    let gap = Duration::from_secs_f64(1.0 / rate);
    let mut next = Instant::now();
    let mut last_report: Option<Instant> = None;
    while Instant::now() < end {
        tokio::time::sleep_until(next.into()).await;
        next += gap;
        let now = Instant::now();
        if f.held.lock().unwrap().admit(now) {
            allowed += 1;
            admitted.push(now);
        } else {
            denied += 1;
        }
        // The first request subscribes the bucket; then a report every interval.
        let due = last_report.is_none_or(|t| now >= t + interval);
        if due {
            let elapsed = last_report.map_or(Duration::from_millis(1), |t| now - t);
            let broken = f.ended.lock().unwrap().is_some()
                || f.reports
                    .send(report("quota", &id, allowed, denied, elapsed))
                    .await
                    .is_err();
            if broken {
                // Envoy's filter reconnects; here to the next server.
                which += 1;
                let addr = {
                    let s = servers.lock().unwrap();
                    s[which % s.len()]
                };
                let held = f.held.lock().unwrap().clone();
                f = Filter::connect(addr).await;
                // What it held stays in force until it expires.
                *f.held.lock().unwrap() = held;
                let _ = f
                    .reports
                    .send(report("quota", &id, allowed, denied, elapsed))
                    .await;
            }
            allowed = 0;
            denied = 0;
            last_report = Some(now);
        }
    }
    admitted
}

/// The largest excess of admissions in any window over `B + r·W` (≤ 0: kept).
fn worst_excess(mut times: Vec<Instant>, capacity: f64, rate: f64) -> f64 {
    times.sort_unstable();
    let mut worst = f64::MIN;
    for (i, &start) in times.iter().enumerate() {
        for (j, &t) in times.iter().enumerate().skip(i) {
            let w = (t - start).as_secs_f64();
            let n = (j - i + 1) as f64;
            worst = worst.max(n - (capacity + rate * w));
        }
    }
    worst
}

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
        // Blanket rules: unlimited and unmatched buckets are allowed, a zero limit denied;
        // a first report without a domain ends the stream.
        for (entries, allow) in [
            (vec![("open", "x")], true),
            (vec![("nothing", "here")], true),
            (vec![("blocked", "b")], false),
        ] {
            let f = Filter::connect(serving.grpc).await;
            f.reports
                .send(report(
                    "quota",
                    &bucket_id(&entries),
                    0,
                    1,
                    Duration::from_millis(1),
                ))
                .await
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            while *f.received.lock().unwrap() == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(
                f.held.lock().unwrap().admit(Instant::now()),
                allow,
                "{entries:?}"
            );
        }
        let f = Filter::connect(serving.grpc).await;
        f.reports
            .send(report(
                "",
                &bucket_id(&[("tenant", "t")]),
                0,
                1,
                Duration::from_millis(1),
            ))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while f.ended.lock().unwrap().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let status = f.ended.lock().unwrap().clone().expect("the stream ended");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("domain"), "{status:?}");

        // B = r = 200/s; eight filters at 30/s each (1.2x), reporting every 200 ms.
        let calls_before = fcalls(&server);
        let servers = Arc::new(Mutex::new(vec![serving.grpc]));
        let start = Instant::now();
        let end = start + Duration::from_secs(6);
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn(run_filter(
                    servers.clone(),
                    vec![("tenant", "acme")],
                    30.0,
                    Duration::from_millis(200),
                    end,
                ))
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
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
            "RLQS, 8 filters at 1.2x r on one serve: {} admitted, worst window excess {excess:.1}, \
             utilisation over the last 3 s {utilisation:.3}, {:.1} store calls/s",
            all.len(),
            calls as f64 / secs
        );
        assert!(excess <= 0.0, "a window admitted {excess:.1} over B + r·W");
        assert!(utilisation >= 0.8, "utilisation {utilisation:.3}");
        assert!(
            calls as f64 / secs <= 20.0,
            "{calls} store calls in {secs:.1} s"
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
                    Duration::from_millis(200),
                    end,
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        a.stop().await;
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
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
