//! The tower layer as a gateway uses it: classification from the request head (method,
//! path, headers), several checks all or nothing, RateLimit headers on every answer, a
//! custom rejection, requests that are not limited.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::convert::Infallible;

use http::{Method, Request, Response, StatusCode};
use leasehold_agent::Check;
use leasehold_agent::http::{Checks, RateLimitLayer, Rejection};
use leasehold_agent::{Limiter, Rules};
use tower::{Layer, ServiceExt};

const RULES: &str = r#"
[rules.tenant]
capacity = 3
rate = "1/m"
leasing = "exact"

[rules.writes]
capacity = 1000
rate = "1000/s"
leasing = "lease"
lease_max = 100
"#;

async fn limiter(rules: &str) -> Limiter {
    Limiter::builder()
        .embedded()
        .rules(Rules::from_toml(rules).unwrap())
        .build()
        .await
        .unwrap()
}

/// `/health` is not limited; every request names its tenant; writes also pass `writes`.
fn classify(req: &http::request::Parts) -> Option<Checks> {
    if req.uri.path() == "/health" {
        return Some(Checks::none());
    }
    let tenant = req.headers.get("x-tenant")?.as_bytes();
    let mut checks = Checks::from(Check::new(&"tenant".into(), tenant, 1));
    if req.method == Method::POST {
        checks.push(Check::new(&"writes".into(), b"all", 1));
    }
    Some(checks)
}

fn request(method: Method, path: &str, tenant: Option<&str>) -> Request<String> {
    let mut r = Request::builder().method(method).uri(path);
    if let Some(t) = tenant {
        r = r.header("x-tenant", t);
    }
    r.body(String::new()).unwrap()
}

fn header(r: &Response<String>, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_from_the_request_head_all_or_nothing_with_headers() {
    let l = limiter(RULES).await;
    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new("ok".to_owned()))
    });
    let svc = RateLimitLayer::new(l.clone(), classify).layer(inner);

    // Not limited, and no identity.
    let r = svc
        .clone()
        .oneshot(request(Method::GET, "/health", None))
        .await
        .unwrap();
    assert_eq!(
        (r.status(), header(&r, "ratelimit")),
        (StatusCode::OK, String::new())
    );
    let r = svc
        .clone()
        .oneshot(request(Method::GET, "/x", None))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    // A write passes both rules: one policy item per rule, what each has left.
    let r = svc
        .clone()
        .oneshot(request(Method::POST, "/x", Some("t1")))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        header(&r, "ratelimit-policy"),
        "\"tenant\";q=3;w=180, \"writes\";q=1000;w=1"
    );
    let rl = header(&r, "ratelimit");
    assert!(rl.starts_with("\"tenant\";r=2;t=60, \"writes\";r="), "{rl}");

    // A read passes the tenant rule only.
    let r = svc
        .clone()
        .oneshot(request(Method::GET, "/x", Some("t1")))
        .await
        .unwrap();
    assert_eq!(header(&r, "ratelimit"), "\"tenant\";r=1;t=120");
    let r = svc
        .clone()
        .oneshot(request(Method::GET, "/x", Some("t1")))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    // The tenant is out: 429 with Retry-After, and the write's other check gives its
    // token back (all or nothing).
    let writes_before = l.stats("writes").unwrap();
    let r = svc
        .clone()
        .oneshot(request(Method::POST, "/x", Some("t1")))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = header(&r, "retry-after").parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert!(
        header(&r, "ratelimit").starts_with("\"tenant\";r=0;t="),
        "{r:?}"
    );
    let writes_after = l.stats("writes").unwrap();
    assert!(writes_after.admitted() <= writes_before.admitted() + 1);

    // Another tenant is not affected.
    let r = svc
        .clone()
        .oneshot(request(Method::POST, "/x", Some("t2")))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rejection_can_be_customised_and_keeps_the_headers() {
    let l = limiter(RULES).await;
    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new("ok".to_owned()))
    });
    let svc = RateLimitLayer::new(l, classify)
        .on_reject(|r: &Rejection| {
            let mut resp = Response::new(match r {
                Rejection::Limited { rule, .. } => format!("{{\"limited_by\":\"{rule}\"}}"),
                other => format!("{{\"error\":\"{other:?}\"}}"),
            });
            *resp.status_mut() = r.status();
            resp
        })
        .layer(inner);
    for _ in 0..3 {
        let r = svc
            .clone()
            .oneshot(request(Method::GET, "/", Some("t")))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let r = svc
        .clone()
        .oneshot(request(Method::GET, "/", Some("t")))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(!header(&r, "retry-after").is_empty());
    assert_eq!(r.body(), "{\"limited_by\":\"tenant\"}");
    let r = svc.oneshot(request(Method::GET, "/", None)).await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(r.body().contains("NoIdentity"), "{}", r.body());
}

/// A leased key's `RateLimit` names what the bucket has left for this gateway (its lease
/// plus the global bucket's level), not only the lease: a client reading `r=` must not
/// back off from a bucket that is nearly full. One agent and a slow refill, so the
/// figure is exact: 1000 less the requests made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_keys_ratelimit_header_names_the_buckets_quota() {
    let rules =
        "[rules.writes]\ncapacity = 1000\nrate = \"1/h\"\nleasing = \"lease\"\nlease_max = 50\n";
    let l = limiter(rules).await;
    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new("ok".to_owned()))
    });
    let classify =
        |_: &http::request::Parts| Some(Checks::from(Check::new(&"writes".into(), b"all", 1)));
    let svc = RateLimitLayer::new(l.clone(), classify).layer(inner);
    for n in 1..=120 {
        let r = svc
            .clone()
            .oneshot(request(Method::POST, "/x", Some("t")))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let left = 1000 - n;
        assert_eq!(
            header(&r, "ratelimit"),
            format!("\"writes\";r={left};t={}", n * 3600),
            "request {n}"
        );
    }
    assert!(l.stats("writes").unwrap().lease_grants > 1, "leased");
}
