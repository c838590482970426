//! The admin endpoint: `GET /health`, `GET /metrics` (Prometheus), and
//! `GET /keys/{rule}/{subject}` (the JSON [`KeyView`](crate::KeyView) of one bucket).
//! It only reads, so any number of coordinators can serve it.

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use gateway_agent::{RedisStore, Rules};
use lease_core::key::BucketKey;
use lease_core::rule::RuleName;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::view::key_view;

/// What the admin endpoint serves from.
#[derive(Clone)]
pub struct Admin {
    store: RedisStore,
    rules: Arc<Rules>,
    prometheus: PrometheusHandle,
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
        }
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/health", get(|| async { "ok\n" }))
            .route("/metrics", get(metrics_text))
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
        Ok((fields, pttl, now)) => Json(key_view(&key, &found, &fields, pttl, now)).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
