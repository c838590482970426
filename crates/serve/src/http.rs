//! The HTTP check API, `/metrics` and `/health`.
//!
//! - `POST /v1/check` with `{"checks":[{"rule":"api.write","subject":"tenant-42","cost":1}]}`
//!   (cost defaults to 1; at most 256 checks): the checks pass all or nothing. 200
//!   `{"allowed":true,...}` with `RateLimit-Policy` and `RateLimit` headers; 429 with
//!   `Retry-After` when a limit is exhausted; 503 with `Retry-After` when the store is
//!   unreachable and the rule fails closed; 400 naming what is wrong with the request
//!   (the body is JSON whatever its `Content-Type`), 413 for a body over 2 MB.
//! - `GET /v1/auth?rule=R&subject=S[&cost=N]`, for nginx `auth_request`, which only knows
//!   2xx (allow) and 401/403 (deny): 204 when admitted, 403 when refused (limited or
//!   unavailable), with `Retry-After` and `X-Leasehold-Outcome: limited|unavailable` for
//!   nginx to pass on; 400 for a bad request (nginx answers 500 then).
//! - `GET /health`: 200 `ready`, or `degraded: REASON` while decisions that need the
//!   store follow the failure policies (liveness: the process answers). `GET /ready`: the
//!   same line, 503 while degraded (readiness). `GET /metrics`: Prometheus text.

use axum::Json;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use leasehold_agent::{CheckError, Decision, Limiter};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;

#[derive(Clone, Debug)]
struct Api {
    limiter: Limiter,
    metrics: Option<PrometheusHandle>,
}

/// The router: `/v1/check`, `/v1/auth`, `/health`, `/ready`, `/metrics`.
pub fn router(limiter: Limiter, metrics: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/auth", get(auth))
        .route(
            "/health",
            get(|State(api): State<Api>| async move { api.limiter.health().line() + "\n" }),
        )
        .route("/ready", get(ready))
        .route("/metrics", get(render))
        .with_state(Api { limiter, metrics })
}

/// 200 `ready`, or 503 `degraded: REASON`: for an orchestrator's readiness probe.
async fn ready(State(api): State<Api>) -> Response {
    let (status, body) = api.limiter.health().probe();
    (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response()
}

/// The most checks one `POST /v1/check` may carry (each may be a store call).
const MAX_CHECKS: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckBody {
    checks: Vec<OneCheck>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OneCheck {
    rule: String,
    subject: String,
    #[serde(default = "one")]
    cost: u64,
}

fn one() -> u64 {
    1
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "error": message.into() });
    (status, Json(body)).into_response()
}

/// Seconds for `Retry-After`: rounded up, at least 1 (as the tower layer's).
fn secs(d: std::time::Duration) -> u64 {
    leasehold_core::retry_after_secs(d.as_micros().min(u128::from(u64::MAX)) as u64).max(1)
}

fn set(h: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        h.insert(name, v);
    }
}

/// `RateLimit-Policy` and `RateLimit` for the check that decided.
fn limit_headers(h: &mut HeaderMap, limiter: &Limiter, rule: &str, subject: &str, d: Decision) {
    let Ok(p) = limiter.bucket_params_for(rule, subject) else {
        return;
    };
    let w = leasehold_core::refill_secs(p.capacity, p.rate);
    set(
        h,
        "ratelimit-policy",
        format!("\"{rule}\";q={};w={w}", p.capacity),
    );
    let (r, t) = match d {
        // Admitted without the store's count: nothing honest to say of what is left.
        Decision::Allowed { via, .. } if !via.is_metered() => return,
        Decision::Allowed { remaining, .. } => {
            let missing = p.capacity.saturating_sub(remaining);
            (remaining, leasehold_core::refill_secs(missing, p.rate))
        }
        Decision::Denied { retry_after } | Decision::Unavailable { retry_after } => {
            (0, secs(retry_after))
        }
    };
    set(h, "ratelimit", format!("\"{rule}\";r={r};t={t}"));
}

async fn decide(
    limiter: &Limiter,
    checks: &[OneCheck],
) -> Result<(Decision, usize, Vec<Decision>), CheckError> {
    let list: Vec<(&[u8], &str, u64)> = checks
        .iter()
        .map(|c| (c.subject.as_bytes(), c.rule.as_str(), c.cost))
        .collect();
    let mut each = Vec::new();
    let (d, at) = limiter.check_all_each(&list, &mut each).await?;
    Ok((d, at, each))
}

/// The body is read as JSON whatever its `Content-Type` says: `curl -d` (and many a
/// gateway plugin) sends JSON labelled as a form.
async fn check(
    State(api): State<Api>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body: CheckBody = match body {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(b) => b,
            Err(e) => return bad(format!("the body is not a check request's JSON: {e}")),
        },
        Err(e) => return error(e.status(), e.body_text()),
    };
    if body.checks.is_empty() {
        return bad("checks must not be empty");
    }
    if body.checks.len() > MAX_CHECKS {
        return bad(format!(
            "at most {MAX_CHECKS} checks a request (got {}): one request must not become \
             thousands of store calls",
            body.checks.len()
        ));
    }
    let (decision, at, each) = match decide(&api.limiter, &body.checks).await {
        Ok(x) => x,
        Err(e) => return bad(e.to_string()),
    };
    let c = &body.checks[at];
    let mut headers = HeaderMap::new();
    limit_headers(&mut headers, &api.limiter, &c.rule, &c.subject, decision);
    let (status, json) = match decision {
        Decision::Allowed { .. } => {
            let results: Vec<serde_json::Value> = body
                .checks
                .iter()
                .zip(&each)
                .map(|(c, d)| {
                    // null: admitted without the store's count (fail open, the
                    // emergency limit, shadow).
                    let remaining = match d {
                        Decision::Allowed { via, .. } if !via.is_metered() => None,
                        Decision::Allowed { remaining, .. } => Some(*remaining),
                        _ => Some(0),
                    };
                    serde_json::json!({ "rule": c.rule, "remaining": remaining })
                })
                .collect();
            (
                StatusCode::OK,
                serde_json::json!({ "allowed": true, "checks": results }),
            )
        }
        Decision::Denied { retry_after } | Decision::Unavailable { retry_after } => {
            set(&mut headers, "retry-after", secs(retry_after).to_string());
            let (status, outcome) = if matches!(decision, Decision::Denied { .. }) {
                (StatusCode::TOO_MANY_REQUESTS, "limited")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            };
            (
                status,
                serde_json::json!({
                    "allowed": false,
                    "outcome": outcome,
                    "rule": c.rule,
                    "retry_after_ms": retry_after.as_millis() as u64,
                }),
            )
        }
    };
    let outcome = match status {
        StatusCode::OK => "ok",
        StatusCode::TOO_MANY_REQUESTS => "over_limit",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        _ => "error",
    };
    metrics::counter!("leasehold_serve_requests_total", "api" => "http", "outcome" => outcome)
        .increment(1);
    (status, headers, Json(json)).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthQuery {
    rule: String,
    subject: String,
    #[serde(default = "one")]
    cost: u64,
}

async fn auth(
    State(api): State<Api>,
    q: Result<Query<AuthQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad(e.body_text()),
    };
    let one = [OneCheck {
        rule: q.rule,
        subject: q.subject,
        cost: q.cost,
    }];
    let (decision, _, _) = match decide(&api.limiter, &one).await {
        Ok(x) => x,
        Err(e) => return bad(e.to_string()),
    };
    let mut headers = HeaderMap::new();
    limit_headers(
        &mut headers,
        &api.limiter,
        &one[0].rule,
        &one[0].subject,
        decision,
    );
    match decision {
        Decision::Allowed { .. } => (StatusCode::NO_CONTENT, headers).into_response(),
        Decision::Denied { retry_after } | Decision::Unavailable { retry_after } => {
            set(&mut headers, "retry-after", secs(retry_after).to_string());
            let outcome = if matches!(decision, Decision::Denied { .. }) {
                "limited"
            } else {
                "unavailable"
            };
            set(&mut headers, "x-leasehold-outcome", outcome.to_owned());
            (StatusCode::FORBIDDEN, headers).into_response()
        }
    }
}

async fn render(State(api): State<Api>) -> Response {
    match &api.metrics {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "no metrics recorder installed\n").into_response(),
    }
}
