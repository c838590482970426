//! The admin endpoint: `GET /health`, `GET /metrics` (Prometheus), `GET /keys` (the
//! keys agents report, hottest first, with their accounting and split state) and
//! `GET /keys/{rule}/{subject}` (the JSON [`KeyView`](crate::KeyView) of one bucket).
//! It only reads, so any number of coordinators can serve it.

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
        }
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
        Router::new()
            .route("/health", get(health))
            .route("/ready", get(ready))
            .route("/metrics", get(metrics_text))
            .route("/keys", get(keys))
            .route("/keys/{rule}/{subject}", get(key))
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

/// `ready` while the store answers a `PING`, else `degraded: REASON`, as serve's and the
/// gateway's probes say it.
async fn readiness(admin: &Admin) -> Result<(), String> {
    if !admin.store.is_connected() {
        return Err("store not reached yet; connecting".to_owned());
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
            for &(name, kind, help) in METRICS {
                match kind {
                    "counter" => metrics::describe_counter!(name, help),
                    "histogram" => metrics::describe_histogram!(name, metrics::Unit::Seconds, help),
                    _ => metrics::describe_gauge!(name, help),
                }
            }
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
