//! The HTTP check API, `/metrics` and `/health`.
//!
//! With envoyproxy/ratelimit YAML, requests name descriptors, as over gRPC, and decide the
//! same buckets:
//! - `POST /v1/check` with the rate limit service's request as JSON:
//!   `{"domain":"gw","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}]}`
//!   (per descriptor optional `hits_addend`, 0 for a check that takes nothing, and
//!   `limit`: `{"requests_per_unit":10,"unit":"second"}`; the request's `hits_addend`).
//!   200 when OK, 429 when over the limit (with `Retry-After`, unless more hits were asked
//!   than the limit holds: no wait helps), 503 when the store is unreachable and a limit
//!   fails closed; the body has `overall_code` (`OK`, `OVER_LIMIT`, or `UNAVAILABLE`
//!   with the 503) and per descriptor `code` (the same three),
//!   `current_limit`, `limit_remaining`, `duration_until_reset_ms`; the headers are the
//!   gRPC answer's.
//! - `GET /v1/auth?domain=D&descriptor=K1,K2=V2` for nginx `auth_request` (one
//!   `descriptor` parameter per descriptor, its keys separated by commas): a key with
//!   `=VALUE` has that value, a key alone takes its value from the request header
//!   `X-Leasehold-Value-K` (as the client sent it, any bytes a header may hold; nginx:
//!   `proxy_set_header X-Leasehold-Value-api_key $http_x_api_key;`). 204 when OK, 403 when
//!   refused (`Retry-After`, `X-Leasehold-Outcome: limited | unavailable`), 401 when a
//!   value header is missing or empty (nginx passes 401 on; any other status would be a
//!   500), 400 for a malformed query.
//!
//! With a Leasehold rules file (TOML), requests name rules and subjects:
//! - `POST /v1/check` with `{"checks":[{"rule":"api.write","subject":"tenant-42","cost":1}]}`
//!   (cost defaults to 1; at most 256 checks): all or nothing. 200
//!   `{"allowed":true,...}` with `RateLimit-Policy` and `RateLimit` headers; 429 with
//!   `Retry-After` when a limit is exhausted; 503 with `Retry-After` when the store is
//!   unreachable and the rule fails closed; 400 naming what is wrong with the request
//!   (the body is JSON whatever its `Content-Type`), 413 for a body over 2 MB.
//! - `GET /v1/auth?rule=R&subject=S[&cost=N]`: 204, or 403 as above.
//!
//! And: `GET /`: a page of the rules in force and how to address each ([`crate::page`]).
//! `GET /health`: 200 `ready`, or `degraded: REASON` while decisions that need the
//! store follow the failure policies (liveness: the process answers); with the embedded
//! store the line says so. `GET /ready`: the same line, 503 while degraded (readiness).
//! `GET /metrics`: Prometheus text.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use leasehold_agent::{Check, Decision, Limiter, RuleRef, headers};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;

use crate::config::Unit;
use crate::decide::{Decider, Descriptor, Verdict, hits};

#[derive(Clone, Debug)]
struct Api {
    decider: Arc<Decider>,
    metrics: Option<PrometheusHandle>,
}

impl Api {
    fn limiter(&self) -> &Limiter {
        self.decider.limiter()
    }
}

/// The router: `/v1/check`, `/v1/auth`, `/health`, `/ready`, `/metrics`, and `/` (the
/// page of the rules in force: [`crate::page`]).
pub fn router(decider: Arc<Decider>, metrics: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route(
            "/",
            get(|State(api): State<Api>| async move {
                (
                    [
                        (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
                        (axum::http::header::CACHE_CONTROL, "no-store"),
                    ],
                    crate::page::render(&api.decider),
                )
            }),
        )
        .route("/v1/check", post(check))
        .route("/v1/auth", get(auth))
        .route(
            "/health",
            get(|State(api): State<Api>| async move { health(api.limiter()).1 }),
        )
        .route("/ready", get(ready))
        .route("/metrics", get(render))
        .with_state(Api { decider, metrics })
}

/// 200 `ready`, or 503 `degraded: REASON`: for an orchestrator's readiness probe.
async fn ready(State(api): State<Api>) -> Response {
    let (status, body) = health(api.limiter());
    (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body).into_response()
}

/// What the health line adds when the store is this process's own (each instance then
/// enforces every limit by itself): `/health`, `/ready` and the page at `/` say it.
pub(crate) fn embedded_note(limiter: &leasehold_agent::Limiter) -> Option<&'static str> {
    matches!(limiter.store(), leasehold_agent::Store::Embedded(_))
        .then_some("(embedded store: this instance's own limits; give --redis to share them)")
}

/// The limiter's probe answer, with [`embedded_note`].
fn health(limiter: &leasehold_agent::Limiter) -> (u16, String) {
    let (status, line) = limiter.health().probe();
    match embedded_note(limiter) {
        Some(note) => (status, format!("{} {note}\n", line.trim_end())),
        None => (status, line),
    }
}

/// The most checks, or descriptors, one request may carry (each may be a store call).
const MAX_CHECKS: usize = 256;

/// A `POST /v1/check` body naming descriptors: the rate limit service's request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RlsBody {
    domain: String,
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hitsAddend")]
    hits_addend: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    entries: Vec<JsonEntry>,
    #[serde(default, alias = "hitsAddend")]
    hits_addend: Option<u64>,
    #[serde(default)]
    limit: Option<JsonLimit>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    key: String,
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLimit {
    #[serde(alias = "requestsPerUnit")]
    requests_per_unit: u32,
    unit: String,
}

/// A `POST /v1/check` body naming rules and subjects.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesBody {
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

fn set(h: &mut HeaderMap, name: &str, value: String) {
    if let (Ok(n), Ok(v)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(&value),
    ) {
        h.insert(n, v);
    }
}

fn count(outcome: &'static str) {
    metrics::counter!("leasehold_serve_requests_total", "api" => "http", "outcome" => outcome)
        .increment(1);
}

/// The body is read as JSON whatever its `Content-Type` says: `curl -d` (and many a
/// gateway plugin) sends JSON labelled as a form.
async fn check(
    State(api): State<Api>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let bytes = match body {
        Ok(bytes) => bytes,
        Err(e) => return error(e.status(), e.body_text()),
    };
    // Its shape by its fields: `checks` names rules and subjects, anything else is a rate
    // limit request.
    let refuse = |e: serde_json::Error| {
        bad(format!(
            "the body is neither a rate limit request ({{\"domain\":..,\"descriptors\":[..]}}) \
             nor checks ({{\"checks\":[..]}}): {e}"
        ))
    };
    let value: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return refuse(e),
    };
    if value.get("checks").is_some() {
        match RulesBody::deserialize(value) {
            Ok(b) => check_rules(&api, b).await,
            Err(e) => refuse(e),
        }
    } else {
        match RlsBody::deserialize(value) {
            Ok(b) => check_descriptors(&api, b).await,
            Err(e) => refuse(e),
        }
    }
}

/// Decides descriptors as the gRPC service does.
async fn check_descriptors(api: &Api, body: RlsBody) -> Response {
    if body.descriptors.len() > MAX_CHECKS {
        return bad(format!(
            "at most {MAX_CHECKS} descriptors a request (got {})",
            body.descriptors.len()
        ));
    }
    let mut descriptors = Vec::with_capacity(body.descriptors.len());
    for (i, d) in body.descriptors.iter().enumerate() {
        let limit = match &d.limit {
            None => None,
            Some(l) => match Unit::parse(&l.unit) {
                Some(u) => Some((l.requests_per_unit, u)),
                None => {
                    return bad(format!(
                        "descriptor {i}: limit unit {:?} is not one of second, minute, hour, \
                         day, week, month, year",
                        l.unit
                    ));
                }
            },
        };
        descriptors.push(Descriptor {
            entries: d
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect(),
            hits: hits(d.hits_addend, body.hits_addend),
            limit,
        });
    }
    let (verdict, status, headers) =
        match decided(api, &body.domain, &descriptors, body.hits_addend).await {
            Ok(x) => x,
            Err(r) => return r,
        };
    let statuses: Vec<serde_json::Value> = verdict
        .statuses
        .iter()
        .map(|s| {
            let mut o = serde_json::json!({
                "code": if s.unavailable {
                    "UNAVAILABLE"
                } else if s.over_limit {
                    "OVER_LIMIT"
                } else {
                    "OK"
                },
                "limit_remaining": s.remaining,
            });
            if let Some((rpu, unit, name)) = &s.limit {
                o["current_limit"] = serde_json::json!({
                    "name": name.clone().unwrap_or_default(),
                    "requests_per_unit": rpu,
                    "unit": unit.name().to_ascii_uppercase(),
                });
            }
            if let Some(r) = s.reset {
                o["duration_until_reset_ms"] = serde_json::json!(r.as_millis() as u64);
            }
            o
        })
        .collect();
    let mut json = serde_json::json!({
        // A 503 says why: the store, not the limit (over gRPC it is OVER_LIMIT, the
        // only refusal the protocol has).
        "overall_code": if verdict.unavailable {
            "UNAVAILABLE"
        } else if verdict.over_limit {
            "OVER_LIMIT"
        } else {
            "OK"
        },
        "statuses": statuses,
    });
    if let Some(m) = verdict.metadata {
        json["dynamic_metadata"] = serde_json::Value::Object(m);
    }
    (status, headers, Json(json)).into_response()
}

/// Decides `descriptors` of `domain` (counted): the verdict, its status over HTTP (200,
/// 429, 503) and its headers; a request that cannot be decided is a 400 naming why.
async fn decided(
    api: &Api,
    domain: &str,
    descriptors: &[Descriptor<'_>],
    request_hits: u32,
) -> Result<(Verdict, StatusCode, HeaderMap), Response> {
    let verdict = api
        .decider
        .decide(domain, descriptors, request_hits)
        .await
        .map_err(|e| bad(e.to_string()))?;
    let (status, outcome) = if verdict.unavailable {
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    } else if verdict.over_limit {
        (StatusCode::TOO_MANY_REQUESTS, "over_limit")
    } else {
        (StatusCode::OK, "ok")
    };
    count(outcome);
    let mut headers = HeaderMap::new();
    for (k, v) in &verdict.headers {
        set(&mut headers, k, v.clone());
    }
    Ok((verdict, status, headers))
}

/// `RateLimit-Policy` and `RateLimit`, one item per check decided (see
/// [`leasehold_agent::headers`]: the same items as the tower layer's).
fn limit_headers<'a>(
    h: &mut HeaderMap,
    limiter: &Limiter,
    decided: impl IntoIterator<Item = (&'a OneCheck, Decision)>,
) {
    let (mut policies, mut left) = (Vec::new(), Vec::new());
    for (c, d) in decided {
        let Ok(p) = limiter.policy(&RuleRef::from(c.rule.clone()), &c.subject) else {
            continue;
        };
        policies.push(p.item());
        left.extend(p.limit_item(d));
    }
    if !policies.is_empty() {
        set(h, "ratelimit-policy", policies.join(", "));
    }
    if !left.is_empty() {
        set(h, "ratelimit", left.join(", "));
    }
}

/// Decides `checks` all or nothing; a rule of a descriptor's limit (YAML) is refused by
/// name: its buckets are keyed by descriptors, which only the descriptors form names (a
/// subject given here would be another bucket of the same limit).
async fn decide_rules(
    api: &Api,
    checks: &[OneCheck],
) -> Result<(Decision, usize, Vec<Option<Decision>>), String> {
    let domains = api.decider.domains();
    if let Some(c) = checks.iter().find(|c| domains.has_rule(&c.rule)) {
        return Err(format!(
            "rule {:?} is the limit of a YAML descriptor: send its domain and descriptors \
             (the RLS JSON form, or GET /v1/auth?domain=...&descriptor=...)",
            c.rule.chars().take(80).collect::<String>()
        ));
    }
    let list: Vec<Check> = checks
        .iter()
        .map(|c| Check::new(&RuleRef::from(c.rule.clone()), &c.subject, c.cost))
        .collect();
    let mut each = Vec::new();
    let (d, at) = (api.limiter())
        .check_all_each(&list, &mut each)
        .await
        .map_err(|e| e.to_string())?;
    Ok((d, at, each))
}

/// Decides rules and subjects.
async fn check_rules(api: &Api, body: RulesBody) -> Response {
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
    let (decision, at, each) = match decide_rules(api, &body.checks).await {
        Ok(x) => x,
        Err(e) => return bad(e),
    };
    let c = &body.checks[at];
    let mut headers = HeaderMap::new();
    let decided = (body.checks.iter().zip(&each)).filter_map(|(c, d)| Some((c, (*d)?)));
    limit_headers(&mut headers, api.limiter(), decided);
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
                        Some(Decision::Allowed { via, .. }) if !via.is_metered() => None,
                        Some(Decision::Allowed { remaining, .. }) => Some(*remaining),
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
            set(
                &mut headers,
                "retry-after",
                headers::retry_secs(retry_after).to_string(),
            );
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
    count(match status {
        StatusCode::OK => "ok",
        StatusCode::TOO_MANY_REQUESTS => "over_limit",
        _ => "unavailable",
    });
    (status, headers, Json(json)).into_response()
}

/// The first `name=value` pair of a raw query (its position from 1, and its name as far
/// as it decodes) whose name or value is not UTF-8 once percent-decoded; `None` if all are.
fn not_utf8(raw: &str) -> Option<String> {
    raw.split('&').enumerate().find_map(|(i, pair)| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_encoding::percent_decode_str(name);
        let value = percent_encoding::percent_decode_str(value);
        (name.clone().decode_utf8().is_err() || value.decode_utf8().is_err()).then(|| {
            format!(
                "{} ({:?})",
                i + 1,
                name.decode_utf8_lossy()
                    .chars()
                    .take(40)
                    .collect::<String>()
            )
        })
    })
}

/// The header a descriptor key's value comes from in `GET /v1/auth`.
pub const VALUE_HEADER: &str = "x-leasehold-value-";

/// `GET /v1/auth`: descriptors (`domain`, `descriptor`, `hits`) or a rule and subject
/// (`rule`, `subject`, `cost`).
async fn auth(
    State(api): State<Api>,
    headers: HeaderMap,
    raw: axum::extract::RawQuery,
    q: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Response {
    // The query's decoding replaces bytes that are not UTF-8 with U+FFFD: two tenants
    // `%FF` and `%FE` would share one limit. Refused, as the header form refuses them.
    if let Some(at) = raw.0.as_deref().and_then(not_utf8) {
        return bad(format!(
            "query parameter {at} is not UTF-8 once percent-decoded: descriptor values and \
             subjects are text"
        ));
    }
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad(e.body_text()),
    };
    let get = |name: &str| q.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    for (k, _) in &q {
        if !matches!(
            k.as_str(),
            "domain" | "descriptor" | "hits" | "rule" | "subject" | "cost"
        ) {
            return bad(format!(
                "unknown query parameter {:?}: descriptors take domain, descriptor and hits; \
                 rules take rule, subject and cost",
                k.chars().take(80).collect::<String>()
            ));
        }
    }
    let number = |name: &str| -> Result<Option<u64>, String> {
        get(name)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| format!("{name} {v:?} is not a whole number"))
            })
            .transpose()
    };
    if let Some(domain) = get("domain") {
        let hits = match number("hits") {
            Ok(h) => h.unwrap_or(1),
            Err(why) => return bad(why),
        };
        return auth_descriptors(&api, &headers, domain, &q, hits).await;
    }
    let (Some(rule), Some(subject)) = (get("rule"), get("subject")) else {
        return bad("give domain and descriptor (YAML limits), or rule and subject");
    };
    let cost = match number("cost") {
        Ok(c) => c.unwrap_or(1),
        Err(why) => return bad(why),
    };
    let one = [OneCheck {
        rule: rule.to_owned(),
        subject: subject.to_owned(),
        cost,
    }];
    let (decision, _, _) = match decide_rules(&api, &one).await {
        Ok(x) => x,
        Err(e) => return bad(e),
    };
    let mut headers = HeaderMap::new();
    limit_headers(&mut headers, api.limiter(), [(&one[0], decision)]);
    match decision {
        Decision::Allowed { .. } => (StatusCode::NO_CONTENT, headers).into_response(),
        Decision::Denied { retry_after } | Decision::Unavailable { retry_after } => {
            set(
                &mut headers,
                "retry-after",
                headers::retry_secs(retry_after).to_string(),
            );
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

/// A refusal nginx passes on to its client: 401 with why in `X-Leasehold-Error`.
fn unauthorized(why: String) -> Response {
    let mut h = HeaderMap::new();
    set(&mut h, "x-leasehold-error", why.clone());
    (
        StatusCode::UNAUTHORIZED,
        h,
        Json(serde_json::json!({ "error": why })),
    )
        .into_response()
}

async fn auth_descriptors(
    api: &Api,
    headers: &HeaderMap,
    domain: &str,
    q: &[(String, String)],
    hits: u64,
) -> Response {
    let mut descriptors: Vec<Descriptor<'_>> = Vec::new();
    for (_, spec) in q.iter().filter(|(k, _)| k == "descriptor") {
        if descriptors.len() == MAX_CHECKS {
            return bad(format!("at most {MAX_CHECKS} descriptors a request"));
        }
        let mut entries = Vec::new();
        for item in spec.split(',') {
            let (key, literal) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            if key.is_empty() {
                return bad(format!("descriptor {spec:?} has an empty key"));
            }
            let value = match literal {
                Some(v) => v,
                None => {
                    let name = format!("{VALUE_HEADER}{key}");
                    let Ok(name) = HeaderName::from_bytes(name.as_bytes()) else {
                        return bad(format!(
                            "descriptor key {key:?} cannot name a header: write it as \
                             {key}=VALUE"
                        ));
                    };
                    // The bytes as the client sent them: UTF-8 is text too.
                    match headers
                        .get(&name)
                        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
                    {
                        Some(v) if !v.is_empty() => v,
                        _ => {
                            return unauthorized(format!(
                                "no value for {key}: header {name} is missing, empty or not \
                                 UTF-8"
                            ));
                        }
                    }
                }
            };
            entries.push((key, value));
        }
        descriptors.push(Descriptor {
            entries,
            hits,
            limit: None,
        });
    }
    if descriptors.is_empty() {
        return bad("give at least one descriptor=KEY[=VALUE][,KEY...]");
    }
    let (verdict, status, mut h) = match decided(api, domain, &descriptors, 0).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    if status == StatusCode::OK {
        return (StatusCode::NO_CONTENT, h).into_response();
    }
    let outcome = if verdict.unavailable {
        "unavailable"
    } else {
        "limited"
    };
    set(&mut h, "x-leasehold-outcome", outcome.to_owned());
    (StatusCode::FORBIDDEN, h).into_response()
}

async fn render(State(api): State<Api>) -> Response {
    match &api.metrics {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "no metrics recorder installed\n").into_response(),
    }
}
