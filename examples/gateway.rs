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
//! a real gateway, the key is validated first). Requests without it are limited by client
//! address under `--ip-rule`, if given, else refused with 401.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::any;
use clap::Parser;
use leasehold::agent::Limiter;
use leasehold::agent::http::{Check, Checks, RateLimitLayer};

#[derive(Parser)]
struct Args {
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
    // Text to stderr; LEASEHOLD_LOG_FORMAT=json for JSON lines, RUST_LOG to filter.
    let format = match std::env::var("LEASEHOLD_LOG_FORMAT").as_deref() {
        Ok("json") => leasehold::coordinator::cli::LogFormat::Json,
        _ => leasehold::coordinator::cli::LogFormat::Text,
    };
    leasehold::coordinator::cli::init_logging(format, "info");
    match run(Args::parse()).await {
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
        .watch_rules(Duration::from_secs(1));
    builder = match args.store.address()? {
        None => builder.embedded(),
        Some(a) if a == "embedded" => builder.embedded(),
        Some(address) => builder.redis(address).config({
            let mut c = leasehold::agent::LimiterConfig::default();
            c.store = args.store.config();
            c
        }),
    };
    if let Some(addr) = args.metrics {
        let listener =
            std::net::TcpListener::bind(addr).map_err(|e| format!("--metrics {addr}: {e}"))?;
        builder = builder.prometheus(listener);
    }
    let limiter = builder.build().await?;
    // Every rule the gateway will check must exist now, not answer 500 at each request.
    for rule in std::iter::once(&args.rule)
        .chain(args.ip_rule.as_ref())
        .chain(args.write_rule.as_ref())
    {
        limiter
            .bucket_params(rule)
            .map_err(|e| format!("--rule {rule}: {e}"))?;
    }
    // Rule names are read once here; each request clones an Arc, never a String.
    let rule: std::sync::Arc<str> = args.rule.as_str().into();
    let ip_rule: Option<std::sync::Arc<str>> = args.ip_rule.as_deref().map(Into::into);
    let write_rule: Option<std::sync::Arc<str>> = args.write_rule.as_deref().map(Into::into);
    let layer = RateLimitLayer::new(limiter.clone(), move |req: &axum::http::request::Parts| {
        // Every x-api-key header counts: with several, the subject is all of them, so a
        // second header cannot pick whose budget a request spends.
        let mut keys = req.headers.get_all("x-api-key").iter();
        if let Some(first) = keys.next() {
            let mut subject = first.as_bytes().to_vec();
            for k in keys {
                subject.push(b',');
                subject.extend_from_slice(k.as_bytes());
            }
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
    let app = Router::new()
        .route("/", any(|| async { "ok\n" }))
        .route("/{*path}", any(|| async { "ok\n" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    limiter.shutdown().await;
    Ok(())
}
