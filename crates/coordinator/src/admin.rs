//! The admin endpoint: `GET /health`, `GET /metrics` (Prometheus), `GET /keys` (the
//! keys agents report, hottest first, with their accounting and split state) and
//! `GET /keys/{rule}/{subject}` (the JSON [`KeyView`](crate::KeyView) of one bucket).
//! It only reads, so any number of coordinators can serve it.

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
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
    rules: Arc<Rules>,
    prometheus: PrometheusHandle,
    snapshot: Option<Shared>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("rules", &self.rules.len())
            .finish()
    }
}

impl Admin {
    /// Serves views of `rules`' buckets in `store`. Installs a Prometheus recorder for
    /// this process unless one is installed already (then `/metrics` shows only what
    /// this recorder sees).
    pub fn new(store: RedisStore, rules: Rules) -> Self {
        let recorder = PrometheusBuilder::new().build_recorder();
        let prometheus = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::debug!("a metrics recorder is already installed");
        }
        Self {
            store,
            rules: Arc::new(rules),
            prometheus,
            snapshot: None,
        }
    }

    /// Also serves what a running coordinator knows (accounting, splits).
    pub fn with_snapshot(mut self, snapshot: Shared) -> Self {
        self.snapshot = Some(snapshot);
        self
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/health", get(|| async { "ok\n" }))
            .route("/metrics", get(metrics_text))
            .route("/keys", get(keys))
            .route("/keys/{rule}/{subject}", get(key))
            .with_state(self)
    }
}

/// Serves `admin` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    admin: Admin,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, admin.router())
        .with_graceful_shutdown(shutdown)
        .await
}

async fn metrics_text(State(admin): State<Admin>) -> String {
    admin.prometheus.render()
}

fn error(status: StatusCode, message: String) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

async fn key(
    State(admin): State<Admin>,
    Path((rule, subject)): Path<(String, String)>,
) -> Response {
    metrics::counter!("leasehold_coordinator_key_views_total").increment(1);
    let found = match admin.rules.get(&rule) {
        Ok(r) => r.clone(),
        Err(e) => return error(StatusCode::NOT_FOUND, e.to_string()),
    };
    let key = match RuleName::new(&rule)
        .map_err(|e| e.to_string())
        .and_then(|name| BucketKey::new(&name, subject.as_bytes()).map_err(|e| e.to_string()))
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
