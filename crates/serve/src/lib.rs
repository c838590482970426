//! `leasehold serve`: Leasehold for gateways not written in Rust.
//!
//! One process holding a [`Limiter`] (in a [`Decider`], with the limits in force) serves:
//! - the Envoy rate limit service v3 over gRPC
//!   (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`), configured with
//!   envoyproxy/ratelimit's YAML as it is ([`config`]);
//! - on the same port, Envoy's rate limit quota service
//!   (`envoy.service.rate_limit_quota.v3`, [`rlqs`]): token buckets Envoy enforces itself;
//! - an HTTP check API: `POST /v1/check` with JSON, and `GET /v1/auth` for nginx
//!   `auth_request` ([`http`]);
//! - `/metrics` (Prometheus), `/health` and a page of the rules in force and how to
//!   address them (`/`, [`page`]) on the HTTP listener.
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod decide;
pub mod grpc;
pub mod http;
pub mod page;
pub mod rlqs;

pub use config::{ConfigError, Domains};
pub use decide::{Decider, Options};
pub use leasehold_agent::Limiter;

use std::sync::Arc;

/// What serve records besides the agent's metrics
/// (`leasehold_agent::telemetry::METRICS`) and the listeners' (`leasehold_net::METRICS`):
/// (name, kind, help).
pub const METRICS: &[(&str, &str, &str)] = &[
    (
        "leasehold_serve_requests_total",
        "counter",
        "Requests by api (grpc, http) and outcome (ok, over_limit, unavailable).",
    ),
    (
        "leasehold_serve_hits_total",
        "counter",
        "Per domain and descriptor key (as ratelimit's stats name them; a bounded number of \
         keys), descriptors decided.",
    ),
    (
        "leasehold_serve_shadow_total",
        "counter",
        "Per domain, descriptors over their limit in shadow mode (reported, not enforced).",
    ),
    (
        "leasehold_serve_unknown_domain_total",
        "counter",
        "Requests naming a domain the configuration does not have.",
    ),
    (
        "leasehold_serve_config_reloads_total",
        "counter",
        "Reloads of the config file by outcome (loaded; refused: it failed validation and the \
         limits in force stay).",
    ),
    (
        "leasehold_rlqs_assignments_total",
        "counter",
        "RLQS bucket assignments pushed to filters, by kind (new, extension).",
    ),
];

use metrics_exporter_prometheus::PrometheusHandle;

/// Serves the gRPC rate limit service on `grpc` and the HTTP API on `http` (either may
/// be absent) until `shutdown` completes, then lets calls in flight finish. Both
/// listeners set `TCP_NODELAY`, time out idle and half-sent connections and bound how
/// many are open (see [`leasehold_net`]).
pub async fn serve(
    decider: Arc<Decider>,
    grpc: Option<tokio::net::TcpListener>,
    http: Option<tokio::net::TcpListener>,
    metrics: Option<PrometheusHandle>,
    limits: leasehold_net::Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let (stop, _) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    if let Some(listener) = grpc {
        let service = grpc::Rls::new(decider.clone()).into_server();
        let quota = rlqs::Rlqs::new(decider.clone(), stop.subscribe()).into_server();
        let app = tonic::service::Routes::new(service)
            .add_service(quota)
            .prepare()
            .into_axum_router();
        let mut rx = stop.subscribe();
        tasks.push(tokio::spawn(async move {
            leasehold_net::serve("grpc", listener, app, limits, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
            .map_err(|e| format!("grpc: {e}"))
        }));
    }
    if let Some(listener) = http {
        let app = http::router(decider, metrics);
        let mut rx = stop.subscribe();
        tasks.push(tokio::spawn(async move {
            leasehold_net::serve("http", listener, app, limits, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
            .map_err(|e| format!("http: {e}"))
        }));
    }
    shutdown.await;
    let _ = stop.send(true);
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}
