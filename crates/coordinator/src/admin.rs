//! The admin endpoint: `GET /` (the live page: `page.html`, which reads the two `/api`
//! routes every second), `GET /api/overview` (rules, the hottest keys with their bound,
//! gateways, store and region), `GET /api/key?k=KEY` (one bucket by its Redis key, with
//! each gateway's share), `GET /health`, `GET /ready`, `GET /metrics` (Prometheus),
//! `GET /keys` (the keys agents report, by store calls, with their accounting and split
//! state) and `GET /keys/{rule}/{subject}` (the JSON [`KeyView`](crate::KeyView) of one
//! bucket). It only reads, so any number of coordinators can serve it.
//!
//! With a token ([`Admin::with_token`]), every route but `/`, `/health`, `/ready` and
//! `/metrics` wants `Authorization: Bearer TOKEN`; the page itself holds no data, and
//! takes the token from its address's fragment (`/#token=TOKEN`, which browsers do not
//! send to the server).

use std::future::Future;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use leasehold_core::key::BucketKey;
use leasehold_core::rule::RuleName;
use leasehold_store::{RedisStore, Rules};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::service::Snapshot;
use crate::view::key_view;

type Shared = Arc<parking_lot::RwLock<Snapshot>>;

/// What the admin endpoint serves from.
#[derive(Clone)]
pub struct Admin {
    store: RedisStore,
    rules: Arc<ArcSwap<Rules>>,
    prometheus: Option<PrometheusHandle>,
    snapshot: Option<Shared>,
    region: Option<Arc<crate::broker::Broker>>,
    token: Option<Arc<str>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("rules", &self.rules.load().len())
            .finish()
    }
}

impl Admin {
    /// Serves views of `rules`' buckets in `store`. `/metrics` answers 404 until
    /// [`Admin::with_metrics`] gives it a recorder's handle: the application owns the
    /// recorder (see [`install_prometheus`]).
    pub fn new(store: RedisStore, rules: Rules) -> Self {
        Self {
            store,
            rules: Arc::new(ArcSwap::from_pointee(rules)),
            prometheus: None,
            snapshot: None,
            region: None,
            token: None,
        }
    }

    /// Also shows what this region's broker holds.
    pub fn with_broker(mut self, broker: Option<Arc<crate::broker::Broker>>) -> Self {
        self.region = broker;
        self
    }

    /// Wants `Authorization: Bearer TOKEN` on the routes that show keys and rules.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.filter(|t| !t.is_empty()).map(Arc::from);
        self
    }

    /// Reads the rules from `rules` (a coordinator's, which reloads them) instead.
    pub fn with_rules(mut self, rules: Arc<ArcSwap<Rules>>) -> Self {
        self.rules = rules;
        self
    }

    /// Serves this Prometheus recorder's text on `/metrics`.
    pub fn with_metrics(mut self, handle: PrometheusHandle) -> Self {
        self.prometheus = Some(handle);
        self
    }

    /// Also serves what a running coordinator knows (accounting, splits).
    pub fn with_snapshot(mut self, snapshot: Shared) -> Self {
        self.snapshot = Some(snapshot);
        self
    }

    /// The routes.
    pub fn router(self) -> Router {
        let guarded = Router::new()
            .route("/api/overview", get(overview))
            .route("/api/key", get(one_key))
            .route("/keys", get(keys))
            .route("/keys/{rule}/{subject}", get(key))
            .route_layer(axum::middleware::from_fn_with_state(
                self.token.clone(),
                bearer,
            ));
        Router::new()
            .route("/", get(page))
            .route("/health", get(health))
            .route("/ready", get(ready))
            .route("/metrics", get(metrics_text))
            .merge(guarded)
            .with_state(self)
    }
}

/// Serves `admin` on `listener` until `shutdown` completes (`TCP_NODELAY`, timeouts and
/// a bound on connections: see [`leasehold_net`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    admin: Admin,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = leasehold_net::Limits::default().max_connections(256);
    leasehold_net::serve("admin", listener, admin.router(), limits, shutdown).await
}

/// The live page: no data of its own, no external assets.
const PAGE: &str = include_str!("page.html");

async fn page() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

/// Lets a request through when no token is set or it carries `Bearer TOKEN`.
async fn bearer(
    State(token): State<Option<Arc<str>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(token) = &token {
        let given = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme is case-insensitive (RFC 9110, 11.1).
            .and_then(|v| v.split_once(' '))
            .and_then(|(scheme, t)| scheme.eq_ignore_ascii_case("bearer").then_some(t));
        let ok = given.is_some_and(|g| {
            // Compared in time independent of where they differ.
            g.len() == token.len()
                && g.bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "this endpoint wants Authorization: Bearer TOKEN (the coordinator's \
                 --admin-token); the page takes it as /#token=TOKEN"
                    .into(),
            );
            r.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    next.run(request).await
}

/// The keys the overview lists, by demand.
pub const OVERVIEW_KEYS: usize = 100;

/// One key in the overview.
#[derive(serde::Serialize)]
struct KeyLine<'a> {
    #[serde(flatten)]
    status: &'a crate::KeyStatus,
    /// Tokens a second admitted over the last settled second.
    admitted_per_sec: f64,
    /// Offered minus admitted, tokens a second: what was refused (an agent's demand
    /// counts what its callers asked, admitted or not).
    refused_per_sec: f64,
}

async fn overview(State(admin): State<Admin>) -> Response {
    let store = match readiness(&admin).await {
        Ok(()) => "ready".to_owned(),
        Err(why) => format!("degraded: {why}"),
    };
    let rules = admin.rules.load().summaries();
    let region = admin.region.as_ref().map(|b| {
        let st = b.stats();
        let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        serde_json::json!({
            "region": b.region(),
            "keys": b.keys(),
            "held": b.holdings(),
            "global_calls": n(&st.global_calls),
            "global_failures": n(&st.global_failures),
            "granted": n(&st.granted),
            "deposited": n(&st.deposited),
            "keys_refused": n(&st.keys_refused),
        })
    });
    let Some(snap) = &admin.snapshot else {
        return Json(serde_json::json!({ "store": store, "rules": rules })).into_response();
    };
    let snap = snap.read();
    let mut keys: Vec<KeyLine<'_>> = snap
        .keys
        .values()
        .map(|k| {
            let w = &k.stats.window_1s;
            let admitted = w.admitted as f64 / w.secs.max(1) as f64;
            KeyLine {
                status: k,
                admitted_per_sec: admitted,
                refused_per_sec: (k.stats.demand_per_sec - admitted).max(0.0),
            }
        })
        .collect();
    keys.sort_by(|a, b| {
        (b.status.stats.demand_per_sec)
            .total_cmp(&a.status.stats.demand_per_sec)
            .then_with(|| a.status.stats.key.cmp(&b.status.stats.key))
    });
    let total = keys.len();
    keys.truncate(OVERVIEW_KEYS);
    let worst = snap
        .keys
        .values()
        .map(|k| k.stats.worst_overshoot)
        .fold(0.0, f64::max);
    Json(serde_json::json!({
        "at_ms": snap.at_ms,
        "leader": snap.leader,
        "agents": snap.agents,
        "splits_started": snap.splits_started,
        "worst_overshoot": worst,
        "store": store,
        "rules": rules,
        "keys_total": total,
        "keys": keys,
        "gateways": snap.gateways,
        "region": region,
    }))
    .into_response()
}

/// `GET /api/key?k=KEY`: the bucket of a Redis key as the overview lists it.
async fn one_key(State(admin): State<Admin>, uri: Uri) -> Response {
    metrics::counter!("leasehold_coordinator_key_views_total").increment(1);
    let raw = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|p| p.strip_prefix("k="))
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&percent_decoded(&raw.replace('+', " "))).into_owned();
    let Some((key, rule)) = BucketKey::parse(&text) else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "k={:?} is not a bucket's key (lh:{{RULE|SUBJECT}}, as /api/overview lists them)",
                text.chars().take(120).collect::<String>()
            ),
        );
    };
    let found = match admin.rules.load().resolve_key(rule.as_str(), &key) {
        Ok(r) => r.clone(),
        Err(e) => return error(StatusCode::NOT_FOUND, e.to_string()),
    };
    match admin.store.bucket(&key).await {
        Ok((fields, pttl, now)) => {
            let mut view = key_view(&key, &found, &fields, pttl, now);
            let mut names = serde_json::Map::new();
            if let Some(snap) = &admin.snapshot {
                let snap = snap.read();
                view.accounting = snap.keys.get(key.as_str()).map(|s| s.stats.clone());
                for a in &view.agents {
                    if let Some(g) = snap.gateways.get(&a.id) {
                        names.insert(a.id.clone(), serde_json::to_value(g).unwrap_or_default());
                    }
                }
            }
            let mut v = serde_json::to_value(&view).unwrap_or_default();
            v["gateways"] = serde_json::Value::Object(names);
            Json(v).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// `ready` while the store answers a `PING`, else `degraded: REASON`, as serve's and the
/// gateway's probes say it.
async fn readiness(admin: &Admin) -> Result<(), String> {
    if let Some(why) = admin.store.not_reached() {
        return Err(why);
    }
    if admin.store.failing_over() {
        return Err("store failover under way".to_owned());
    }
    match admin.store.ping().await {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("store unreachable: {e}")),
    }
}

/// 200 and the readiness line, whatever it says (a liveness probe: the process answers).
async fn health(State(admin): State<Admin>) -> Response {
    match readiness(&admin).await {
        Ok(()) => "ready\n".into_response(),
        Err(why) => format!("degraded: {why}\n").into_response(),
    }
}

/// 200 `ready`, else 503 `degraded: REASON` (a readiness probe).
async fn ready(State(admin): State<Admin>) -> Response {
    match readiness(&admin).await {
        Ok(()) => "ready\n".into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("degraded: {why}\n"),
        )
            .into_response(),
    }
}

async fn metrics_text(State(admin): State<Admin>) -> Response {
    match &admin.prometheus {
        Some(h) => h.render().into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "no metrics recorder was given to the admin endpoint".into(),
        ),
    }
}

/// What the coordinator records: (name, kind, help).
pub const METRICS: &[(&str, &str, &str)] = &[
    (
        "leasehold_overshoot_ratio",
        "gauge",
        "Per rule, the worst key's overshoot over the last 1-10 s windows: (admitted - (B + r*W)) / (B + r*W), 0 when within the bound.",
    ),
    (
        "leasehold_overshoot_worst_ratio",
        "gauge",
        "Per rule, the worst overshoot seen since the coordinator started.",
    ),
    (
        "leasehold_admitted_tokens_total",
        "counter",
        "Per rule, tokens the agents report admitted on the keys the coordinator follows.",
    ),
    (
        "leasehold_key_calls_per_second_max",
        "gauge",
        "Per rule, the most store calls per second one key received (the split trigger).",
    ),
    (
        "leasehold_split_keys",
        "gauge",
        "Per rule, keys currently split over several shards.",
    ),
    (
        "leasehold_coordinator_splits_total",
        "counter",
        "Splits started.",
    ),
    (
        "leasehold_coordinator_leader",
        "gauge",
        "1 while this instance holds the leader lock and acts.",
    ),
    (
        "leasehold_coordinator_agents",
        "gauge",
        "Live agents (reports seen within their TTL).",
    ),
    ("leasehold_coordinator_keys", "gauge", "Keys followed."),
    (
        "leasehold_coordinator_tick_seconds",
        "histogram",
        "Time one tick took (read reports, account, split).",
    ),
    (
        "leasehold_coordinator_errors_total",
        "counter",
        "Ticks that failed (store errors).",
    ),
    (
        "leasehold_coordinator_key_views_total",
        "counter",
        "Requests for one key's view on the admin endpoint.",
    ),
    (
        "leasehold_broker_global_calls_total",
        "counter",
        "Per region, a broker's calls to the global store.",
    ),
    (
        "leasehold_broker_global_failures_total",
        "counter",
        "Per region, a broker's calls to the global store that failed or timed out.",
    ),
    (
        "leasehold_broker_granted_tokens_total",
        "counter",
        "Per region, tokens the global store granted the region's broker.",
    ),
    (
        "leasehold_broker_keys_refused_total",
        "counter",
        "Per region, global keys not brokered because --region-max-keys were.",
    ),
];

/// Installs a Prometheus recorder as the process's global recorder (time histograms
/// with buckets from 1 µs to 1 s) with the coordinator's help text, once per process,
/// and returns its handle for [`Admin::with_metrics`].
pub fn install_prometheus() -> Result<PrometheusHandle, String> {
    static HANDLE: std::sync::OnceLock<Result<PrometheusHandle, String>> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    &[
                        1e-6, 1e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                        0.1, 0.25, 0.5, 1.0,
                    ],
                )
                .map_err(|e| e.to_string())?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)
                .map_err(|_| "a global metrics recorder is already installed".to_owned())?;
            leasehold_net::describe(METRICS);
            leasehold_net::describe(leasehold_net::METRICS);
            Ok(handle)
        })
        .clone()
}

fn error(status: StatusCode, message: String) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

/// `%XX` escapes decoded to bytes (a subject need not be UTF-8, as agents take bytes);
/// a `%` not followed by two hex digits stays as it is.
fn percent_decoded(raw: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(raw).collect()
}

async fn key(State(admin): State<Admin>, uri: Uri) -> Response {
    metrics::counter!("leasehold_coordinator_key_views_total").increment(1);
    // From the raw path: axum's path extractors insist on UTF-8.
    let path = uri.path().strip_prefix("/keys/").unwrap_or_default();
    let (rule, subject) = path.split_once('/').unwrap_or((path, ""));
    let rule = String::from_utf8_lossy(&percent_decoded(rule)).into_owned();
    let subject = percent_decoded(subject);
    let subject = subject.as_slice();
    let found = match admin.rules.load().resolve(&rule, subject) {
        Ok(r) => r.clone(),
        Err(e) => return error(StatusCode::NOT_FOUND, e.to_string()),
    };
    let key = match RuleName::new(&rule)
        .map_err(|e| e.to_string())
        .and_then(|name| BucketKey::new(&name, subject).map_err(|e| e.to_string()))
    {
        Ok(k) => k,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    match admin.store.bucket(&key).await {
        Ok((fields, pttl, now)) => {
            let mut view = key_view(&key, &found, &fields, pttl, now);
            if let Some(snap) = &admin.snapshot {
                view.accounting = snap.read().keys.get(key.as_str()).map(|s| s.stats.clone());
            }
            Json(view).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// The keys agents report, by store calls per second (at most 1000), with the
/// coordinator's state.
async fn keys(State(admin): State<Admin>) -> Response {
    let Some(snap) = &admin.snapshot else {
        return error(
            StatusCode::NOT_FOUND,
            "this endpoint serves no coordinator".to_owned(),
        );
    };
    let snap = snap.read();
    let mut keys: Vec<_> = snap.keys.values().collect();
    keys.sort_by(|a, b| b.stats.calls_per_sec.total_cmp(&a.stats.calls_per_sec));
    keys.truncate(1000);
    Json(serde_json::json!({
        "leader": snap.leader,
        "agents": snap.agents,
        "at_ms": snap.at_ms,
        "splits_started": snap.splits_started,
        "keys": keys,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::percent_decoded;

    #[test]
    fn escapes_decode_to_bytes_and_stray_percents_stay() {
        assert_eq!(percent_decoded("a%7Bb%7d"), b"a{b}");
        assert_eq!(percent_decoded("%FF%00x"), [0xFF, 0, b'x']);
        assert_eq!(percent_decoded("100%"), b"100%");
        assert_eq!(percent_decoded("%G1%4"), b"%G1%4");
    }
}
