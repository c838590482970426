//! `leasehold serve` on a real Redis: the Envoy rate limit service through a tonic
//! client, configured with envoyproxy/ratelimit's YAML, and the HTTP check API.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use leasehold_serve::Domains;

const CONFIG: &str = r#"
domain: messaging
descriptors:
  # Only 5 marketing messages a day to one number.
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
  - key: ldap
    rate_limit: {unlimited: true}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit: {unit: minute, requests_per_unit: 2}
        shadow_mode: true
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        rate_limit: {name: specific, unit: minute, requests_per_unit: 1}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        rate_limit:
          replaces: [{name: specific}]
          unit: minute
          requests_per_unit: 10
  - key: files
    value: docs/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  # B = 2 and a slow refill, so no token comes back while a loaded machine runs the test.
  - key: tenant
    rate_limit: {unit: day, requests_per_unit: 60}
    leasehold: {capacity: 2, leasing: exact}
"#;

fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        hits_addend: hits.map(|value| envoy_types::pb::google::protobuf::UInt64Value { value }),
        ..RateLimitDescriptor::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "messaging".into(),
        descriptors,
        hits_addend: hits,
    }
}

type Client = RateLimitServiceClient<tonic::transport::Channel>;

async fn over(c: &mut Client, descriptors: Vec<RateLimitDescriptor>) -> bool {
    let r = c
        .should_rate_limit(request(descriptors, 0))
        .await
        .unwrap()
        .into_inner();
    r.overall_code == Code::OverLimit as i32
}

/// A POST of JSON `body` to `path`: status, headers and body.
async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String, String) {
    post_as(addr, path, Some("application/json"), body).await
}

/// A POST of `body` to `path` labelled `content_type` (or not at all).
async fn post_as(
    addr: std::net::SocketAddr,
    path: &str,
    content_type: Option<&str>,
    body: &str,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let label = content_type.map_or(String::new(), |c| format!("Content-Type: {c}\r\n"));
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\n{label}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// `leasehold serve` in this process, on a spawned Redis, with gRPC and HTTP on free
/// loopback ports.
pub(crate) struct Serving {
    pub(crate) decider: std::sync::Arc<leasehold_serve::Decider>,
    pub(crate) grpc: std::net::SocketAddr,
    http: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Serving {
    /// Serves the YAML `config` on `server` with `options`, and `/metrics` with
    /// `metrics` (the process's Prometheus recorder).
    pub(crate) async fn start(
        server: &leasehold_redis_harness::RedisServer,
        config: &str,
        options: leasehold_serve::Options,
        metrics: bool,
    ) -> Self {
        Self::start_with(server, config, options, metrics, None).await
    }

    /// [`Serving::start`], with `more` rules (from TOML) beside the YAML's.
    async fn start_with(
        server: &leasehold_redis_harness::RedisServer,
        config: &str,
        options: leasehold_serve::Options,
        metrics: bool,
        more: Option<&str>,
    ) -> Self {
        let metrics = metrics.then(|| leasehold_agent::telemetry::install_prometheus().unwrap());
        let domains = Domains::from_yaml(config, "messaging.yaml").unwrap();
        let mut rules = domains.rules();
        if let Some(toml) = more {
            let more = leasehold_agent::Rules::from_toml(toml).unwrap();
            rules = rules.and(more.iter().cloned());
        }
        let limiter = leasehold_agent::Limiter::builder()
            .redis(server.url())
            .rules(rules)
            .config({
                let mut c = leasehold_agent::LimiterConfig::default();
                c.store = support::config();
                c
            })
            .build()
            .await
            .unwrap();
        let decider = leasehold_serve::Decider::new(limiter, domains, options);
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(leasehold_serve::serve(
            decider.clone(),
            Some(grpc),
            Some(http),
            metrics,
            leasehold_net::Limits::default(),
            async {
                let _ = stopped.await;
            },
        ));
        Self {
            decider,
            grpc: grpc_addr,
            http: http_addr,
            stop,
            task,
        }
    }

    /// A gRPC client of it.
    async fn client(&self) -> Client {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap()
    }

    /// Stops it and waits for the calls in flight.
    pub(crate) async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

#[test]
fn envoy_rls_and_http_check_on_redis() {
    let server = support::server();
    support::runtime().block_on(async {
        // Beside the YAML's, a rule of the TOML kind for the HTTP API's checks form: B = 2
        // and a slow refill, so no token comes back while a loaded machine runs the test.
        let http = "[rules.http]\ncapacity = 2\nrate = \"60/d\"\nleasing = \"exact\"\n";
        let serving =
            Serving::start_with(&server, CONFIG, Default::default(), true, Some(http)).await;
        let (http_addr, limiter) = (serving.http, serving.decider.limiter().clone());
        let mut c = serving.client().await;

        // Nested descriptors: 5 a day, then OVER_LIMIT with the headers Envoy forwards.
        let marketing = || {
            vec![descriptor(
                &[("message_type", "marketing"), ("to_number", "206")],
                None,
            )]
        };
        for _ in 0..5 {
            assert!(!over(&mut c, marketing()).await);
        }
        let r = c
            .should_rate_limit(request(marketing(), 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        let s = &r.statuses[0];
        assert_eq!(s.code, Code::OverLimit as i32);
        let limit = s.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (5, 4)); // DAY
        let header = |k: &str| {
            r.response_headers_to_add
                .iter()
                .find(|h| h.key == k)
                .map(|h| h.value.clone())
        };
        let retry: u64 = header("retry-after").unwrap().parse().unwrap();
        assert!(retry >= 1, "{retry}");
        assert!(header("ratelimit").unwrap().contains("r=0"));

        // Several descriptors, all or nothing: the marketing one is out, so the plain
        // to_number one is not charged either.
        let both = vec![
            descriptor(&[("to_number", "206")], None),
            descriptor(&[("message_type", "marketing"), ("to_number", "206")], None),
        ];
        assert!(over(&mut c, both).await);
        let r = c
            .should_rate_limit(request(vec![descriptor(&[("to_number", "206")], None)], 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);

        // hits_addend is the cost, per request or per descriptor.
        let r = c
            .should_rate_limit(request(vec![descriptor(&[("tenant", "t9")], None)], 2))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(
            over(&mut c, vec![descriptor(&[("tenant", "t9")], Some(1))]).await,
            "B = 2 spent"
        );

        // unlimited, requests_per_unit 0, no limit at all, unknown domain.
        let r = c
            .should_rate_limit(request(vec![descriptor(&[("ldap", "x")], None)], 0))
            .await
            .unwrap()
            .into_inner();
        // As ratelimit: unlimited reports u32::MAX left, a descriptor no limit matches 0.
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, u32::MAX)
        );
        let r = c
            .should_rate_limit(request(vec![descriptor(&[("nothing", "x")], None)], 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, 0)
        );
        // A descriptor with no entries matches nothing: OK for it, as in ratelimit
        // (the request is not refused).
        let r = c
            .should_rate_limit(request(
                vec![
                    descriptor(&[], None),
                    descriptor(&[("tenant", "t10")], None),
                ],
                0,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(
            r.statuses
                .iter()
                .map(|s| (s.code, s.current_limit.is_some(), s.limit_remaining))
                .collect::<Vec<_>>(),
            [(Code::Ok as i32, false, 0), (Code::Ok as i32, true, 1)]
        );
        assert!(
            over(
                &mut c,
                vec![descriptor(&[("remote_address", "50.0.0.5")], None)]
            )
            .await
        );
        assert!(
            !over(
                &mut c,
                vec![descriptor(&[("remote_address", "50.0.0.6")], None)]
            )
            .await
        );
        let mut other = request(vec![descriptor(&[("a", "b")], None)], 0);
        other.domain = "nobody".into();
        let r = c.should_rate_limit(other).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);

        // shadow_mode: counted, never enforced.
        for _ in 0..5 {
            assert!(
                !over(
                    &mut c,
                    vec![descriptor(&[("service", "s"), ("user", "user-a")], None)]
                )
                .await
            );
        }
        assert_eq!(
            limiter
                .stats(&leasehold_serve::config::rule_name(
                    "messaging.service.user_user-a"
                ))
                .unwrap()
                .shadow_denied,
            3
        );
        // Named twice, more hits than the bucket holds: still only counted.
        let user_a = [("service", "s"), ("user", "user-a")];
        assert!(
            !over(
                &mut c,
                vec![descriptor(&user_a, Some(2)), descriptor(&user_a, Some(2))]
            )
            .await
        );

        // replaces: matched together, the specific limit (1/min) gives way to 10/min.
        let pair = || {
            vec![
                descriptor(&[("key_1", "value_1"), ("user", "u")], None),
                descriptor(&[("key_2", "value_2"), ("user", "u")], None),
            ]
        };
        for _ in 0..3 {
            assert!(!over(&mut c, pair()).await);
        }
        assert!(
            !over(
                &mut c,
                vec![descriptor(&[("key_1", "value_1"), ("user", "u")], None)]
            )
            .await
        );
        assert!(
            over(
                &mut c,
                vec![descriptor(&[("key_1", "value_1"), ("user", "u")], None)]
            )
            .await
        );

        // share_threshold: every value matching docs/* shares 3 an hour.
        for f in ["docs/a", "docs/b", "docs/c"] {
            assert!(!over(&mut c, vec![descriptor(&[("files", f)], None)]).await);
        }
        assert!(over(&mut c, vec![descriptor(&[("files", "docs/d")], None)]).await);

        // More hits than the limit can ever hold are over the limit, as in ratelimit (an
        // error would let Envoy, which fails open by default, pass the request); in
        // shadow mode they are let through.
        let huge = Some(1_000_000);
        assert!(over(&mut c, vec![descriptor(&[("to_number", "n-huge")], huge)]).await);
        assert!(!over(&mut c, vec![descriptor(&[("to_number", "n-huge")], None)]).await);
        let shadowed = descriptor(&[("service", "s"), ("user", "user-a")], huge);
        let r = c
            .should_rate_limit(request(vec![shadowed], 0))
            .await
            .unwrap()
            .into_inner();
        // OK, with nothing left (ratelimit's 0, not u32::MAX).
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, 0)
        );

        // The HTTP check API names rules and subjects; a rule a YAML limit became is
        // refused by name (its buckets are keyed by descriptors: a subject given here
        // would be another bucket of the same limit).
        let rule = leasehold_serve::config::rule_name("messaging.tenant");
        let body = format!(r#"{{"checks":[{{"rule":"{rule}","subject":"http-1","cost":1}}]}}"#);
        let (status, _, json) = post(http_addr, "/v1/check", &body).await;
        assert_eq!(status, 400, "{json}");
        assert!(
            json.contains(&rule) && json.contains("descriptors"),
            "{json}"
        );
        let body = r#"{"checks":[{"rule":"http","subject":"http-1","cost":1}]}"#;
        let (status, head, json) = post(http_addr, "/v1/check", body).await;
        assert_eq!(status, 200, "{json}");
        assert!(head.contains("ratelimit-policy:"), "{head}");
        assert!(json.contains("\"allowed\":true"), "{json}");
        let (status, _, _) = post(http_addr, "/v1/check", body).await;
        assert_eq!(status, 200);
        let (status, head, json) = post(http_addr, "/v1/check", body).await;
        assert_eq!(status, 429, "{json}");
        assert!(head.contains("retry-after:"), "{head}");
        let (status, _, json) = post(
            http_addr,
            "/v1/check",
            r#"{"checks":[{"rule":"nope","subject":"s"}]}"#,
        )
        .await;
        assert_eq!(status, 400);
        assert!(json.contains("nope"), "{json}");
        let (status, _, json) = post(
            http_addr,
            "/v1/check",
            r#"{"checks":[{"rule":"x","subjet":"s"}]}"#,
        )
        .await;
        assert_eq!(status, 400);
        assert!(json.contains("subjet"), "{json}");
        // JSON labelled as a form (`curl -d`) or not labelled is still a check request.
        for label in [Some("application/x-www-form-urlencoded"), None] {
            let body = r#"{"checks":[{"rule":"nope","subject":"s"}]}"#;
            let (status, _, json) = post_as(http_addr, "/v1/check", label, body).await;
            assert_eq!(status, 400, "{label:?}");
            assert!(json.contains("unknown rule"), "{label:?}: {json}");
        }
        let many: Vec<String> = (0..257)
            .map(|i| format!(r#"{{"rule":"{rule}","subject":"m-{i}"}}"#))
            .collect();
        let body = format!(r#"{{"checks":[{}]}}"#, many.join(","));
        let (status, _, json) = post(http_addr, "/v1/check", &body).await;
        assert_eq!(status, 400);
        assert!(json.contains("at most 256 checks"), "{json}");
        let (status, _, json) = post(http_addr, "/v1/check", "checks=1").await;
        assert_eq!(status, 400);
        assert!(json.contains("neither a rate limit request"), "{json}");
        // The nginx auth_request form: 204 or 403.
        let path = "/v1/auth?rule=http&subject=nginx-1";
        assert_eq!(support::http_get(http_addr, path).await.0, 204);
        assert_eq!(support::http_get(http_addr, path).await.0, 204);
        assert_eq!(support::http_get(http_addr, path).await.0, 403);
        let (status, body) = support::http_get(http_addr, "/health").await;
        assert_eq!((status, body.as_str()), (200, "ready\n"));
        let (status, body) = support::http_get(http_addr, "/ready").await;
        assert_eq!((status, body.as_str()), (200, "ready\n"));
        let (status, body) = support::http_get(http_addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("leasehold_serve_requests_total"), "{body}");
        // The shadow limit's refusals above are counted: the three the agent let through
        // (its shadow_denied) and the three decided before the store (named twice).
        let shadow = body
            .lines()
            .find(|l| l.starts_with("leasehold_serve_shadow_total{domain=\"messaging\"}"))
            .unwrap_or_else(|| panic!("no shadow count in {body}"));
        let n: f64 = shadow.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(n >= 6.0, "{shadow}");

        serving.stop().await;
    });
}

/// ratelimit's example config with what a migrating user relies on: quota mode, metadata,
/// limits named by the request. `leasing: exact`: every figure is the store's count.
const DROP_IN: &str = r#"
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
        leasehold: {leasing: exact}
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
    leasehold: {leasing: exact}
  - key: api_key
    rate_limit: {unit: day, requests_per_unit: 3}
    leasehold: {leasing: exact}
  - key: user
    rate_limit: {unit: day, requests_per_unit: 1000}
    leasehold: {leasing: exact}
  - key: quota_a
    quota_mode: true
    rate_limit: {unit: day, requests_per_unit: 1}
    metadata: {backend: cheap}
  - key: quota_b
    quota_mode: true
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: plan
    rate_limit: {unit: day, requests_per_unit: 100}
    metadata: {backend: premium, team: {name: gold}}
"#;

/// A descriptor with its own limit (RateLimitOverride).
fn with_limit(entries: &[(&str, &str)], rpu: u32, unit: i32) -> RateLimitDescriptor {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: rpu,
            unit,
        }),
        ..descriptor(entries, None)
    }
}

/// What is left of `entries`' bucket, by a check that takes nothing (hits_addend 0).
async fn left(c: &mut Client, entries: &[(&str, &str)]) -> u32 {
    let r = c
        .should_rate_limit(request(vec![descriptor(entries, Some(0))], 0))
        .await
        .unwrap()
        .into_inner();
    r.statuses[0].limit_remaining
}

async fn call(
    c: &mut Client,
    descriptors: Vec<RateLimitDescriptor>,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
    c.should_rate_limit(request(descriptors, 0))
        .await
        .unwrap()
        .into_inner()
}

/// What envoyproxy/ratelimit does that a migrating user relies on, through the gRPC API
/// and the HTTP one, on a real Redis: a refused request takes nothing in any order (the
/// same bucket twice included), hits_addend 0 takes nothing, a descriptor's own limit
/// applies (and survives a reload), quota mode, dynamic metadata, ratelimit's header names,
/// and HTTP deciding the same buckets as gRPC.
#[test]
fn ratelimit_drop_in_semantics() {
    let server = support::server();
    support::runtime().block_on(async {
        let options = leasehold_serve::Options {
            dynamic_metadata: true,
            limit_headers: Some([
                "ratelimit-limit".into(),
                "ratelimit-remaining".into(),
                "ratelimit-reset".into(),
            ]),
            ..Default::default()
        };
        let serving = Serving::start(&server, DROP_IN, options, false).await;
        let (http_addr, decider) = (serving.http, serving.decider.clone());
        let mut c = serving.client().await;

        // 1. All or nothing in either order: 8 calls, 5 admitted, and the plain to_number
        // bucket charged for those 5 only.
        let plain = [("to_number", "206")];
        let marketing = [("message_type", "marketing"), ("to_number", "206")];
        let mut admitted = 0;
        for _ in 0..8 {
            let r = call(&mut c, vec![descriptor(&plain, None), descriptor(&marketing, None)]).await;
            admitted += u32::from(r.overall_code == Code::Ok as i32);
        }
        assert_eq!(admitted, 5);
        assert_eq!(left(&mut c, &plain).await, 95, "refused calls took nothing");
        for _ in 0..3 {
            let r = call(&mut c, vec![descriptor(&marketing, None), descriptor(&plain, None)]).await;
            assert_eq!(r.overall_code, Code::OverLimit as i32);
            // The refusing descriptor says so; the other was not charged (0, as ratelimit
            // reports a limit not checked).
            assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
            assert_eq!(r.statuses[1].code, Code::Ok as i32);
        }
        assert_eq!(left(&mut c, &plain).await, 95, "the other order neither");

        // The same bucket twice: the hits add up (2 + 2 > 3 refused, taking nothing).
        let key = [("api_key", "k1")];
        let r = call(&mut c, vec![descriptor(&key, Some(2)), descriptor(&key, Some(2))]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(left(&mut c, &key).await, 3);
        let r = call(&mut c, vec![descriptor(&key, Some(1)), descriptor(&key, Some(1))]).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(left(&mut c, &key).await, 1);

        // 2. hits_addend 0 on a descriptor takes nothing; on an empty bucket it is over.
        for _ in 0..5 {
            assert_eq!(left(&mut c, &key).await, 1);
        }
        assert_eq!(call(&mut c, vec![descriptor(&key, None)]).await.overall_code, Code::Ok as i32);
        let r = c
            .should_rate_limit(request(vec![descriptor(&key, Some(0))], 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::OverLimit as i32, 0)
        );

        // 3. A descriptor's own limit replaces the YAML's (1000 a day): 2 a second.
        let carol = [("user", "carol")];
        let mut codes = Vec::new();
        for _ in 0..3 {
            let r = call(&mut c, vec![with_limit(&carol, 2, 1)]).await;
            codes.push(r.overall_code == Code::Ok as i32);
            let l = r.statuses[0].current_limit.as_ref().unwrap();
            assert_eq!((l.requests_per_unit, l.unit), (2, 1), "SECOND");
        }
        assert_eq!(codes, [true, true, false]);
        // Without it, the YAML's limit.
        for _ in 0..3 {
            assert_eq!(call(&mut c, vec![descriptor(&carol, None)]).await.overall_code, Code::Ok as i32);
        }
        // 10 a day on a descriptor the YAML does not know.
        let unknown = [("key1", "value1"), ("subkey1", "something")];
        let mut ok = 0;
        for _ in 0..12 {
            ok += u32::from(call(&mut c, vec![with_limit(&unknown, 10, 4)]).await.overall_code == Code::Ok as i32);
        }
        assert_eq!(ok, 10);
        // A reload keeps the limits requests named, and their buckets.
        let reloaded = Domains::from_yaml(DROP_IN, "messaging.yaml").unwrap();
        let rules = reloaded.rules();
        decider.reload(reloaded, &rules).expect("the reloaded limits");
        assert_eq!(call(&mut c, vec![with_limit(&unknown, 10, 4)]).await.overall_code, Code::OverLimit as i32);
        // A unit Envoy does not define is refused, naming it.
        let e = c
            .should_rate_limit(request(vec![with_limit(&carol, 2, 99)], 0))
            .await
            .unwrap_err();
        assert!(e.message().contains("limit unit 99"), "{e}");

        // 6. Quota mode: a quota descriptor over its limit leaves the request OK unless
        // every quota descriptor is over.
        let (qa, qb) = ([("quota_a", "z")], [("quota_b", "z")]);
        assert_eq!(call(&mut c, vec![descriptor(&qa, None)]).await.overall_code, Code::Ok as i32);
        let r = call(&mut c, vec![descriptor(&qa, None), descriptor(&qb, None)]).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "quota_b passes");
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
        assert_eq!(r.statuses[1].code, Code::Ok as i32);
        let r = call(&mut c, vec![descriptor(&qa, None), descriptor(&qb, None)]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32, "every quota descriptor over");
        // A normal descriptor beside a quota one over: refused (every quota one is over),
        // and the normal one not charged.
        let plan = [("plan", "p")];
        let r = call(&mut c, vec![descriptor(&plan, None), descriptor(&qa, None)]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(left(&mut c, &plan).await, 100);

        // Dynamic metadata: the descriptors that passed, merged (the first value wins).
        let r = call(&mut c, vec![descriptor(&plan, None), descriptor(&[("quota_a", "fresh")], None)]).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        let m = r.dynamic_metadata.expect("dynamic metadata");
        let field = |s: &envoy_types::pb::google::protobuf::Struct, k: &str| {
            use envoy_types::pb::google::protobuf::value::Kind;
            match s.fields.get(k).and_then(|v| v.kind.clone()) {
                Some(Kind::StringValue(s)) => s,
                Some(Kind::StructValue(s)) => format!("{:?}", s.fields.keys().collect::<Vec<_>>()),
                other => format!("{other:?}"),
            }
        };
        assert_eq!(field(&m, "domain"), "messaging");
        let Some(envoy_types::pb::google::protobuf::value::Kind::StructValue(meta)) =
            m.fields.get("metadata").and_then(|v| v.kind.clone())
        else {
            panic!("no merged metadata: {m:?}");
        };
        assert_eq!(field(&meta, "backend"), "premium");
        assert_eq!(field(&meta, "team"), "[\"name\"]");
        assert!(m.fields.contains_key("descriptors"));

        // ratelimit's header names, for the tightest limit.
        let r = call(&mut c, vec![descriptor(&[("api_key", "k2")], None), descriptor(&plan, None)]).await;
        let header = |k: &str| {
            r.response_headers_to_add
                .iter()
                .find(|h| h.key == k)
                .map(|h| h.value.clone())
        };
        assert_eq!(header("ratelimit-limit").as_deref(), Some("3"));
        assert_eq!(header("ratelimit-remaining").as_deref(), Some("2"));
        assert!(header("ratelimit-reset").is_some());
        assert!(header("ratelimit").is_none(), "one header form at a time");

        // 8. HTTP speaks descriptors and decides the same buckets.
        let body = r#"{"domain":"messaging","descriptors":[{"entries":[{"key":"api_key","value":"k2"}]}]}"#;
        let (status, head, json) = post(http_addr, "/v1/check", body).await;
        assert_eq!(status, 200, "{json}");
        assert!(json.contains(r#""limit_remaining":1"#), "{json}");
        assert!(head.contains("ratelimit-remaining: 1"), "{head}");
        assert_eq!(left(&mut c, &[("api_key", "k2")]).await, 1, "gRPC sees HTTP's take");
        // More hits than the limit holds: 429, and no Retry-After (no wait helps).
        let body = r#"{"domain":"messaging","descriptors":[{"entries":[{"key":"api_key","value":"k3"}],"hits_addend":4}]}"#;
        let (status, head, json) = post(http_addr, "/v1/check", body).await;
        assert_eq!(status, 429, "{json}");
        assert!(!head.contains("retry-after"), "{head}");
        assert!(json.contains("OVER_LIMIT"), "{json}");
        // nginx auth_request: the value comes from a header, as the client sent it.
        let auth = |value: Option<&'static str>| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(http_addr).await.unwrap();
            let h = value.map_or(String::new(), |v| format!("X-Leasehold-Value-api_key: {v}\r\n"));
            let req = format!(
                "GET /v1/auth?domain=messaging&descriptor=api_key HTTP/1.1\r\nHost: x\r\n{h}Connection: close\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await.unwrap();
            let mut resp = String::new();
            s.read_to_string(&mut resp).await.unwrap();
            resp
        };
        for _ in 0..3 {
            assert!(auth(Some("odd key &cost=0")).await.starts_with("HTTP/1.1 204"));
        }
        let refused = auth(Some("odd key &cost=0")).await.to_ascii_lowercase();
        assert!(refused.starts_with("http/1.1 403"), "{refused}");
        assert!(refused.contains("retry-after:"), "{refused}");
        assert!(refused.contains("x-leasehold-outcome: limited"), "{refused}");
        let unicode = auth(Some("ключ-日本")).await;
        assert!(unicode.starts_with("HTTP/1.1 204"), "{unicode}");
        let missing = auth(None).await.to_ascii_lowercase();
        assert!(missing.starts_with("http/1.1 401"), "{missing}");
        assert!(missing.contains("x-leasehold-value-api_key"), "{missing}");
        // A value in the query that is not UTF-8 once decoded is refused, not read as
        // U+FFFD (which would make `%FF` and `%FE` one tenant).
        let raw = |query: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(http_addr).await.unwrap();
            let req = format!("GET /v1/auth?{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let mut resp = String::new();
            s.read_to_string(&mut resp).await.unwrap();
            resp
        };
        for query in [
            "domain=messaging&descriptor=api_key%3D%FF",
            "rule=http&subject=%FE",
        ] {
            let r = raw(query).await;
            assert!(r.starts_with("HTTP/1.1 400"), "{query}: {r}");
            assert!(r.contains("is not UTF-8 once percent-decoded"), "{query}: {r}");
        }
        let text = raw("domain=messaging&descriptor=api_key%3D%C3%A9t%C3%A9").await;
        assert!(text.starts_with("HTTP/1.1 204"), "{text}");

        serving.stop().await;
    });
}

/// An nginx process on a free loopback port, from `conf` (where `{dir}` is its own
/// temporary directory and `{port}` its port), stopped on drop.
struct Nginx {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Nginx {
    fn start(conf: &str) -> Self {
        let bin = ["nginx", "/usr/sbin/nginx"]
            .into_iter()
            .find(|b| {
                std::process::Command::new(b)
                    .arg("-v")
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
            .expect(
                "nginx is not installed: `apt-get install nginx` (scripts/test installs it \
                 when it can)",
            );
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("www")).unwrap();
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        std::fs::write(dir.path().join("www/index.html"), "backend\n").unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.path().display().to_string();
        let text = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{ worker_connections 64; }}\nhttp {{\n\
             access_log off;\nclient_body_temp_path {d}/tmp;\nproxy_temp_path {d}/tmp;\n\
             fastcgi_temp_path {d}/tmp;\nuwsgi_temp_path {d}/tmp;\nscgi_temp_path {d}/tmp;\n\
             server {{\nlisten 127.0.0.1:{port};\nroot {d}/www;\n{conf}\n}}\n}}\n"
        );
        let path = dir.path().join("nginx.conf");
        std::fs::write(&path, text).unwrap();
        let child = std::process::Command::new(bin)
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&path)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let log = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
            assert!(
                std::time::Instant::now() < deadline,
                "nginx did not listen on {port}: {log}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Self {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /index.html` through nginx with `X-Api-Key: key` (or none): the status line and the head.
async fn through(port: u16, key: Option<&str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let h = key.map_or(String::new(), |k| format!("X-Api-Key: {k}\r\n"));
    // The file itself: `/` would redirect internally to it, and pass auth_request twice.
    let req = format!("GET /index.html HTTP/1.1\r\nHost: x\r\n{h}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    resp.to_ascii_lowercase()
}

/// The nginx recipe of `docs/serve.md`, as it is written there, in front of `leasehold serve`:
/// the key's limit holds, the client gets 429 with Retry-After and the RateLimit headers,
/// a key with spaces and `&cost=0` is just a key, and a missing key is 401, never 500.
#[test]
fn nginx_auth_request_recipe_from_the_serve_page() {
    let server = support::server();
    // The recipe, from the page, between its markers; the address is serve's here.
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/serve.md")).unwrap();
    let recipe = readme
        .split("```nginx\n")
        .nth(1)
        .and_then(|r| r.split("```").next())
        .expect("docs/serve.md's nginx recipe")
        .to_owned();
    support::runtime().block_on(async {
        let serving = Serving::start(&server, DROP_IN, Default::default(), false).await;
        let http_port = serving.http.port();
        let conf = recipe
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{http_port}"))
            .replace("domain=gw", "domain=messaging")
            .replace("proxy_pass http://backend;", "");
        let nginx = Nginx::start(&conf);
        // api_key: 3 a day.
        for _ in 0..3 {
            let r = through(nginx.port, Some("odd key &cost=0")).await;
            assert!(r.starts_with("http/1.1 200"), "{r}");
            // The rule the YAML limit became, described as the tower layer describes one.
            assert!(
                r.contains("ratelimit-policy: \"messaging.api_key\";q=3;w=86400"),
                "{r}"
            );
            assert!(r.contains("ratelimit: \"messaging.api_key\";r="), "{r}");
            assert!(r.ends_with("backend\n"), "{r}");
        }
        let r = through(nginx.port, Some("odd key &cost=0")).await;
        assert!(r.starts_with("http/1.1 429"), "{r}");
        assert!(r.contains("retry-after: "), "{r}");
        assert!(r.contains("ratelimit: \"messaging.api_key\";r=0;"), "{r}");
        // Another key has its own bucket.
        let r = through(nginx.port, Some("another")).await;
        assert!(r.starts_with("http/1.1 200"), "{r}");
        // No key: 401 from serve, passed on by nginx.
        let r = through(nginx.port, None).await;
        assert!(r.starts_with("http/1.1 401"), "{r}");
        drop(nginx);
        serving.stop().await;
    });
}

/// One vocabulary at the edge: a rule with a local share is described as a whole (q = its
/// capacity, not its global part's) by the tower layer and by serve's HTTP API alike,
/// item for item.
#[test]
fn rate_limit_headers_agree_between_the_tower_layer_and_serve() {
    use tower::{Layer, ServiceExt};
    let server = support::server();
    support::runtime().block_on(async {
        let shared = "[rules.shared]\ncapacity = 100\nrate = \"10/s\"\n\
                      local_percent = 50\nlocal_agents = 2\nleasing = \"exact\"\n\
                      [rules.other]\ncapacity = 5\nrate = \"1/s\"\nleasing = \"exact\"\n";
        let serving =
            Serving::start_with(&server, CONFIG, Default::default(), false, Some(shared)).await;
        let limiter = serving.decider.limiter().clone();
        let body = r#"{"checks":[{"rule":"shared","subject":"t1"}]}"#;
        let (status, head, _) = post(serving.http, "/v1/check", body).await;
        assert_eq!(status, 200, "{head}");
        let line = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                .unwrap_or_default()
                .to_owned()
        };
        let served = line("ratelimit-policy");
        assert_eq!(
            served, "\"shared\";q=100;w=10",
            "the whole rule, not its global part"
        );

        let rule = limiter.rule("shared").unwrap();
        let inner = tower::service_fn(|_req: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        });
        let svc = leasehold_agent::http::RateLimitLayer::new(
            limiter.clone(),
            move |_: &http::request::Parts| {
                Some(leasehold_agent::Check::new(&rule, "t2", 1).into())
            },
        )
        .layer(inner);
        let r = svc
            .oneshot(http::Request::new(String::new()))
            .await
            .unwrap();
        let layer = r.headers()["ratelimit-policy"].to_str().unwrap().to_owned();
        assert_eq!(layer, served);
        // Both say what is left in the same form, of the same capacity.
        let left = r.headers()["ratelimit"].to_str().unwrap().to_owned();
        assert!(left.starts_with("\"shared\";r="), "{left}");
        assert!(line("ratelimit").starts_with("\"shared\";r="), "{head}");

        // Several checks: one item per check, as the tower layer gives one per rule.
        let body =
            r#"{"checks":[{"rule":"shared","subject":"t3"},{"rule":"other","subject":"t3"}]}"#;
        let (status, head, _) = post(serving.http, "/v1/check", body).await;
        assert_eq!(status, 200, "{head}");
        let policy = |head: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix("ratelimit-policy: "))
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(policy(&head), "\"shared\";q=100;w=10, \"other\";q=5;w=5");

        // The YAML's limits through the RLS JSON form: named by their rule, q = the
        // bucket's capacity (`leasehold.capacity` where it replaces requests_per_unit:
        // 2 tokens at 60 a day fill in 2 880 s), one item per descriptor.
        let body = r#"{"domain":"messaging","descriptors":[
            {"entries":[{"key":"tenant","value":"t9"}]},
            {"entries":[{"key":"to_number","value":"555"}]}]}"#;
        let (status, head, json) = post(serving.http, "/v1/check", body).await;
        assert_eq!(status, 200, "{json}");
        assert_eq!(
            policy(&head),
            "\"messaging.tenant\";q=2;w=2880, \"messaging.to_number\";q=100;w=86400"
        );
        serving.stop().await;
    });
}

/// The HTTP check API with the YAML, its store gone: a descriptor that fails closed is a
/// 503 whose body says `UNAVAILABLE` (the limit is not what refused it), one that fails
/// open is a 200. ratelimit's headers (`LIMIT_RESPONSE_HEADERS_ENABLED`) say a counted
/// limit's remaining, and nothing for one the store did not count: a fail-open admission
/// said `X-RateLimit-Remaining: 0`, which a client reads as exhausted.
#[test]
fn a_fail_closed_descriptor_without_its_store_is_a_503_saying_unavailable() {
    let mut server = support::server();
    support::runtime().block_on(async {
        let yaml = "domain: d\ndescriptors:\n  - key: closed\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: open\n    rate_limit: {unit: second, requests_per_unit: 5}\n    leasehold: {on_failure: fail_open}\n";
        let options = leasehold_serve::Options {
            limit_headers: Some(
                ["X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"]
                    .map(String::from),
            ),
            ..Default::default()
        };
        let serving = Serving::start(&server, yaml, options, false).await;
        let check = |key: &str| {
            format!(r#"{{"domain":"d","descriptors":[{{"entries":[{{"key":"{key}","value":"v"}}]}}]}}"#)
        };
        let (status, head, body) = post(serving.http, "/v1/check", &check("open")).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            head.to_ascii_lowercase().contains("x-ratelimit-remaining: 4"),
            "{head}"
        );
        let (status, _, body) = post(serving.http, "/v1/check", &check("closed")).await;
        assert_eq!(status, 200, "{body}");
        server.kill();
        let (status, _, body) = post(serving.http, "/v1/check", &check("closed")).await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains(r#""overall_code":"UNAVAILABLE""#), "{body}");
        assert!(body.contains(r#""code":"UNAVAILABLE""#), "{body}");
        let (status, head, body) = post(serving.http, "/v1/check", &check("open")).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(r#""overall_code":"OK""#), "{body}");
        assert!(
            !head.to_ascii_lowercase().contains("x-ratelimit-remaining"),
            "no count to say: {head}"
        );
        assert!(
            !body.contains("duration_until_reset_ms"),
            "no count, no time to reset: {body}"
        );
        serving.stop().await;
    });
}

/// Over gRPC, the YAML, its store gone: a limit with no `leasehold.on_failure` is
/// answered as envoyproxy/ratelimit answers a Redis error — a gRPC error (UNAVAILABLE),
/// which Envoy's `failure_mode_deny` decides (by default it lets the request through) —
/// where an explicit `fail_closed` answers OVER_LIMIT, `fail_open` OK, and a request that
/// names both an implicit and an explicit fail-closed limit is over the limit.
#[test]
fn without_its_store_a_yaml_limit_with_no_on_failure_is_a_grpc_error_for_envoy_to_decide() {
    let mut server = support::server();
    support::runtime().block_on(async {
        let yaml = "domain: d\ndescriptors:\n  - key: plain\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: closed\n    rate_limit: {unit: second, requests_per_unit: 5}\n    leasehold: {on_failure: fail_closed}\n  - key: open\n    rate_limit: {unit: second, requests_per_unit: 5}\n    leasehold: {on_failure: fail_open}\n";
        let serving = Serving::start(&server, yaml, Default::default(), false).await;
        let mut c = serving.client().await;
        let ask = |keys: &[&str]| RateLimitRequest {
            domain: "d".into(),
            descriptors: keys
                .iter()
                .map(|k| descriptor(&[(k, "v")], None))
                .collect(),
            hits_addend: 0,
        };
        let r = c.should_rate_limit(ask(&["plain"])).await.unwrap();
        assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
        server.kill();
        let e = c.should_rate_limit(ask(&["plain"])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("unreachable"), "{e:?}");
        for (keys, code) in [
            (&["closed"][..], Code::OverLimit),
            (&["open"][..], Code::Ok),
            (&["plain", "closed"][..], Code::OverLimit),
            (&["plain", "open"][..], Code::OverLimit),
        ] {
            match c.should_rate_limit(ask(keys)).await {
                Ok(r) => assert_eq!(r.into_inner().overall_code, code as i32, "{keys:?}"),
                Err(e) => panic!("{keys:?}: {e:?}"),
            }
        }
        serving.stop().await;
    });
}

/// `RateLimitRequest` with its entries as bytes, as Envoy sends a header's bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// A descriptor value that is not UTF-8 (a header's bytes) is decided as a subject of its
/// own, not refused with INTERNAL: Envoy lets a request through when the service fails,
/// so a refusal would let a client skip its limit with one byte. Values differing only in
/// such bytes are different subjects.
#[test]
fn a_descriptor_value_that_is_not_utf8_is_a_subject_of_its_own() {
    let server = support::server();
    support::runtime().block_on(async {
        let serving = Serving::start_with(&server, CONFIG, Default::default(), false, None).await;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", serving.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        let mut call = async |value: &[u8]| {
            let req = RawRequest {
                domain: "messaging".into(),
                descriptors: vec![RawDescriptor {
                    entries: vec![RawEntry {
                        key: b"tenant".to_vec(),
                        value: value.to_vec(),
                    }],
                }],
            };
            grpc.ready().await.unwrap();
            let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            );
            grpc.unary(tonic::Request::new(req), path, codec)
                .await
                .unwrap_or_else(|s| panic!("{value:?}: {s}"))
                .into_inner()
                .overall_code
        };
        // B = 2: two admitted, then over the limit.
        let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
        assert_eq!(call(b"\xff").await, ok);
        assert_eq!(call(b"\xff").await, ok);
        assert_eq!(call(b"\xff").await, over);
        // Another byte, and the same byte after valid text: other subjects.
        assert_eq!(call(b"\xfe").await, ok);
        assert_eq!(call(b"a\xff").await, ok);
        assert_eq!(call(b"a\xfe").await, ok);
        assert_eq!(call(b"a\xfe").await, ok);
        assert_eq!(call(b"a\xfe").await, over);
        serving.stop().await;
    });
}
