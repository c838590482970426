//! An API gateway in front of nothing: answers 200 to admitted requests, 429 with
//! `Retry-After` to denied ones, 503 when the limiter is unreachable and the rule fails
//! closed.
//!
//! ```sh
//! cargo run --release --example gateway -- --listen 127.0.0.1:8080 \
//!     --redis redis://127.0.0.1:6379 --config examples/limits.toml --rule api.write
//! curl -H 'x-api-key: tenant-42' http://127.0.0.1:8080/
//! ```
//!
//! The subject is the `x-api-key` header: identity must come from authenticated data (in
//! a real gateway, the key is validated first). A request with more than one is refused
//! with 400 (no second header can pick whose budget it spends). Requests without it are
//! limited by client address under `--ip-rule`, if given, else refused with 401.
//!
//! The gateway comes up while the store is unreachable (each rule's failure policy
//! decides until it answers); `/health` says `ready` or `degraded: REASON`, and `/ready`
//! answers 503 while degraded, for a readiness probe.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use clap::Parser;
use leasehold::agent::Limiter;
use leasehold::agent::http::{Checks, RateLimitLayer};
use leasehold::{Check, RuleRef};

/// An HTTP gateway limited by Leasehold: every request is checked against `--rule` for
/// its `x-api-key`, answered 429 with Retry-After when limited, 503 when the store is out
/// and the rule fails closed.
#[derive(Parser)]
struct Args {
    /// Log lines as text or JSON (to stderr; RUST_LOG filters; default info).
    #[arg(long, value_enum, default_value = "text", env = "LEASEHOLD_LOG_FORMAT")]
    log_format: leasehold::coordinator::cli::LogFormat,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:8080", env = "LEASEHOLD_LISTEN")]
    listen: SocketAddr,
    /// The store (default: `embedded`, an in-process store).
    #[command(flatten)]
    store: leasehold::store::StoreArgs,
    /// Rules file (TOML); reloaded when it changes.
    #[arg(long, env = "LEASEHOLD_CONFIG")]
    config: PathBuf,
    /// The rule applied per API key.
    #[arg(long, default_value = "api.write", env = "LEASEHOLD_RULE")]
    rule: String,
    /// The rule applied per client address to requests without an API key.
    #[arg(long, env = "LEASEHOLD_IP_RULE")]
    ip_rule: Option<String>,
    /// A rule every write (POST, PUT, PATCH, DELETE) also passes, per API key and path:
    /// a second check, all or nothing with the first.
    #[arg(long, env = "LEASEHOLD_WRITE_RULE")]
    write_rule: Option<String>,
    /// Serve Prometheus metrics here.
    #[arg(long, env = "LEASEHOLD_METRICS")]
    metrics: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    leasehold::coordinator::cli::init_logging(args.log_format, "info");
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut builder = Limiter::builder()
        .rules_file(&args.config)
        .watch_rules(Duration::from_secs(1))
        .start_degraded(true);
    builder = match args.store.address()? {
        None => {
            tracing::warn!(
                "no --redis: limits are kept in this process only (the embedded store); \
                 gateways do not share them"
            );
            builder.embedded()
        }
        Some(a) if a == "embedded" => builder.embedded(),
        Some(address) => builder.redis(address).config({
            let mut c = leasehold::agent::LimiterConfig::default();
            c.store = args.store.config();
            c
        }),
    };
    // The ports first: one taken is said at once, before the store is dialled.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    if let Some(addr) = args.metrics {
        let listener =
            std::net::TcpListener::bind(addr).map_err(|e| format!("--metrics {addr}: {e}"))?;
        builder = builder.prometheus(listener);
    }
    let limiter = builder
        .build()
        .await
        .map_err(|e| args.store.redact(&e.to_string()))?;
    // Every rule the gateway will check must exist now, not answer 500 at each request,
    // and a reload of the rules file that drops one is refused.
    let used: Vec<&String> = std::iter::once(&args.rule)
        .chain(args.ip_rule.as_ref())
        .chain(args.write_rule.as_ref())
        .collect();
    limiter
        .require_rules(&used)
        .map_err(|e| format!("--rule: {e}"))?;
    // Rules are named once here; each request clones an Arc, never a String.
    let rule = RuleRef::from(args.rule.clone());
    let ip_rule = args.ip_rule.clone().map(RuleRef::from);
    let write_rule = args.write_rule.clone().map(RuleRef::from);
    let layer = RateLimitLayer::new(limiter.clone(), move |req: &axum::http::request::Parts| {
        // A request with several x-api-key headers never gets here (400, below).
        if let Some(first) = req.headers.get("x-api-key") {
            let mut subject = first.as_bytes().to_vec();
            let mut checks = Checks::none().and(Check::new(&rule, &subject, 1));
            if let Some(w) = &write_rule
                && !req.method.is_safe()
            {
                subject.push(b' ');
                subject.extend_from_slice(req.uri.path().as_bytes());
                checks.push(Check::new(w, &subject, 1));
            }
            return Some(checks);
        }
        let ip_rule = ip_rule.as_ref()?;
        let ConnectInfo(peer) = req.extensions.get::<ConnectInfo<SocketAddr>>()?;
        Some(Check::new(ip_rule, peer.ip().to_string(), 1).into())
    });
    let health = limiter.clone();
    let ready = limiter.clone();
    let app = Router::new()
        .route("/", any(|| async { "ok\n" }))
        .route("/{*path}", any(|| async { "ok\n" }))
        .layer(layer)
        // Outside the limit: probes are not rate limited.
        .route(
            "/health",
            get(move || async move { health.health().line() + "\n" }),
        )
        .route(
            "/ready",
            get(move || async move {
                let (status, body) = ready.health().probe();
                (StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body)
            }),
        )
        .layer(axum::middleware::from_fn(one_identity));
    println!("listening on {}", listener.local_addr()?);
    // TCP_NODELAY, header-read and idle timeouts, and a bound on open connections.
    leasehold_net::serve(
        "gateway",
        listener,
        app,
        leasehold_net::Limits::default(),
        leasehold_net::stop_signal(),
    )
    .await?;
    limiter.shutdown().await;
    Ok(())
}

/// Refuses a request that carries more than one `x-api-key` (400): which of them names the
/// tenant would be a guess, and a guess an attacker could steer.
async fn one_identity(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if req.headers().get_all("x-api-key").iter().nth(1).is_some() {
        return (StatusCode::BAD_REQUEST, "more than one x-api-key header\n").into_response();
    }
    next.run(req).await
}
