//! `leasehold serve`: flags, start-up and reloads.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use leasehold_agent::{Limiter, LimiterConfig};
use leasehold_store::{Rules, StoreArgs};

use crate::config::Domains;
use crate::decide::{Decider, Options};

/// Serves the Envoy rate limit service and rate limit quota service (gRPC, one port) and
/// the HTTP check API from one limiter.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The limits: envoyproxy/ratelimit YAML (a `.yaml`/`.yml` file, or a directory of
    /// them, one domain each), or a Leasehold rules file (TOML; HTTP API only).
    /// Reloaded when it changes and on SIGHUP.
    #[arg(long, env = "LEASEHOLD_CONFIG")]
    pub config: PathBuf,
    /// YAML files naming the same domain add their descriptors to it (a descriptor
    /// defined twice is still refused), as envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG;
    /// without it a second file for a domain is refused.
    #[arg(long, env = "MERGE_DOMAIN_CONFIG")]
    pub merge_domain_config: bool,
    /// Every descriptor in quota mode: over its limit it is reported OVER_LIMIT, and the
    /// request is refused only when every descriptor is (envoyproxy/ratelimit's
    /// QUOTA_MODE).
    #[arg(long, env = "QUOTA_MODE")]
    pub quota_mode: bool,
    /// Answers carry dynamic metadata: the domain, the descriptors, the hits and the
    /// merged `metadata` of the descriptors that passed (envoyproxy/ratelimit's
    /// RESPONSE_DYNAMIC_METADATA).
    #[arg(long, env = "RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// The tightest limit in envoyproxy/ratelimit's three headers (RateLimit-Limit,
    /// RateLimit-Remaining, RateLimit-Reset; LIMIT_RESPONSE_HEADERS_ENABLED) instead of
    /// the IETF draft's RateLimit-Policy and RateLimit.
    #[arg(long, env = "LIMIT_RESPONSE_HEADERS_ENABLED")]
    pub limit_response_headers: bool,
    /// The name of the limit header, with --limit-response-headers.
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    pub limit_limit_header: String,
    /// The name of the remaining header, with --limit-response-headers.
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub limit_remaining_header: String,
    /// The name of the reset header (seconds), with --limit-response-headers.
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    pub limit_reset_header: String,
    /// The store (default: embedded, in this process).
    #[command(flatten)]
    pub store: StoreArgs,
    /// Serve the Envoy rate limit service v3 and the rate limit quota service (RLQS), both
    /// gRPC, here.
    #[arg(long, env = "LEASEHOLD_GRPC", value_name = "ADDR")]
    pub grpc: Option<SocketAddr>,
    /// Serve the HTTP check API, /metrics, /health and /ready here.
    #[arg(long, env = "LEASEHOLD_HTTP", value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Connections each listener keeps open at once; more are closed as they arrive
    /// (default: three quarters of the open-files limit, at most 16384).
    #[arg(long, env = "LEASEHOLD_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
    /// Seconds a request head may take to arrive (HTTP/1), and an idle keep-alive
    /// connection may wait for the next one.
    #[arg(
        long,
        default_value_t = 10,
        env = "LEASEHOLD_HEADER_TIMEOUT",
        value_name = "SECS"
    )]
    pub header_timeout: u64,
    /// Seconds after which a connection nothing was read from is closed (HTTP/2 with
    /// GOAWAY).
    #[arg(
        long,
        default_value_t = 300,
        env = "LEASEHOLD_IDLE_TIMEOUT",
        value_name = "SECS"
    )]
    pub idle_timeout: u64,
}

impl Args {
    /// How answers are shaped.
    fn options(&self) -> Result<Options, String> {
        let names = [
            ("--limit-limit-header", &self.limit_limit_header),
            ("--limit-remaining-header", &self.limit_remaining_header),
            ("--limit-reset-header", &self.limit_reset_header),
        ];
        for (flag, name) in names {
            if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!("{flag} {name:?}: not a header name"));
            }
        }
        Ok(Options {
            quota_mode: self.quota_mode,
            dynamic_metadata: self.response_dynamic_metadata,
            limit_headers: self
                .limit_response_headers
                .then(|| names.map(|(_, n)| n.to_ascii_lowercase())),
            rlqs_idle: None,
        })
    }

    /// The listeners' limits these flags give.
    fn limits(&self) -> Result<leasehold_net::Limits, String> {
        if !(1..=3600).contains(&self.header_timeout) {
            return Err(format!(
                "--header-timeout {}: between 1 and 3600 seconds",
                self.header_timeout
            ));
        }
        if !(1..=86_400).contains(&self.idle_timeout) {
            return Err(format!(
                "--idle-timeout {}: between 1 and 86400 seconds",
                self.idle_timeout
            ));
        }
        let mut limits = leasehold_net::Limits::default().timeouts(
            std::time::Duration::from_secs(self.header_timeout),
            std::time::Duration::from_secs(self.idle_timeout),
        );
        if let Some(n) = self.max_connections {
            if n == 0 {
                return Err("--max-connections 0: at least 1".into());
            }
            // Past the open-file limit, accept fails with EMFILE before the cap is met,
            // and the store's connections and the files have nothing left.
            if let Some(fds) = leasehold_net::open_files_limit()
                && n > fds.saturating_sub(32)
            {
                return Err(format!(
                    "--max-connections {n}: this process may open only {fds} files \
                     (`ulimit -n`), of which the store and files need some; at most {} \
                     here, or raise the limit",
                    fds.saturating_sub(32).max(1)
                ));
            }
            limits = limits.max_connections(n);
        }
        Ok(limits)
    }
}

/// The limits a config file gives: the domains and the rules of envoyproxy/ratelimit's
/// YAML (a `.yaml`/`.yml` file, or a directory of them; `merge`: files naming one domain
/// add to it), else a Leasehold TOML rules file.
pub fn load(path: &Path, merge: bool) -> Result<(Domains, Rules), String> {
    if leasehold_store::rules::names_yaml(path) {
        let domains = Domains::from_path_merging(path, merge).map_err(|e| e.to_string())?;
        for line in domains.unmatched_replaces() {
            tracing::warn!(config = %path.display(), "{line}");
        }
        let rules = domains.rules();
        Ok((domains, rules))
    } else {
        let rules = Rules::from_file(path).map_err(|e| e.to_string())?;
        Ok((Domains::default(), rules))
    }
}

/// Runs until `shutdown` completes. Errors name what is wrong (config, store, address).
pub async fn run(
    args: Args,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    if args.grpc.is_none() && args.http.is_none() {
        return Err("nothing to serve: give --grpc ADDR, --http ADDR or both".into());
    }
    let limits = args.limits()?;
    let options = args.options()?;
    let merge = args.merge_domain_config;
    let (domains, rules) = load(&args.config, merge).map_err(|e| format!("--config {e}"))?;
    if args.grpc.is_some() && domains.domain_names().is_empty() {
        return Err(format!(
            "--grpc needs envoyproxy/ratelimit YAML (a .yaml file or a directory of them); {} is a Leasehold rules file",
            args.config.display()
        ));
    }
    // A store that does not answer yet is dialled again in the background: serve comes up
    // and answers by each rule's failure policy meanwhile (`/ready` says which).
    let mut builder = Limiter::builder().rules(rules).start_degraded(true);
    let address = args.store.address()?;
    let store_line = match address.as_deref() {
        None | Some("embedded") => "store: embedded, in this process (each serve instance \
             enforces every limit on its own; give --redis to share them)"
            .to_owned(),
        Some(a) => format!("store: {}", leasehold_store::secret::redact(a)),
    };
    if matches!(address.as_deref(), None | Some("embedded")) {
        // Said as a warning too, for log pipelines: a forgotten --redis multiplies every
        // limit by the number of instances.
        tracing::warn!(
            "the store is embedded in this process: each serve instance enforces every limit on its own; give --redis to share them"
        );
    }
    builder = match address {
        None => builder.embedded(),
        Some(a) if a == "embedded" => builder.embedded(),
        Some(address) => builder.redis(address).config({
            let mut c = LimiterConfig::default();
            c.store = args.store.config();
            c
        }),
    };
    // The ports first: one taken is said at once, before any store is dialled (which
    // can take a second when the store is down).
    let grpc = match args.grpc {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("--grpc {addr}: {e}"))?,
        ),
        None => None,
    };
    let http = match args.http {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("--http {addr}: {e}"))?,
        ),
        None => None,
    };
    let metrics = leasehold_agent::telemetry::install_prometheus()?;
    leasehold_net::describe(crate::METRICS);
    leasehold_net::describe(leasehold_net::METRICS);
    let limiter = builder
        .build()
        .await
        .map_err(|e| args.store.redact(&e.to_string()))?;
    let decider = Decider::new(limiter.clone(), domains, options);
    println!("{store_line}");
    for (what, l) in [
        ("envoy rate limit service (gRPC)", &grpc),
        ("envoy rate limit quota service (RLQS, gRPC)", &grpc),
        ("http check API", &http),
    ] {
        if let Some(l) = l {
            let addr = l.local_addr().map_err(|e| e.to_string())?;
            println!("{what} on {addr}");
        }
    }
    let reloading = tokio::spawn(reload(decider.clone(), args.config.clone(), merge));
    let served = crate::serve(decider, grpc, http, Some(metrics), limits, shutdown).await;
    reloading.abort();
    limiter.shutdown().await;
    served
}

/// Reads the config again when it changes (checked every second) or on SIGHUP; a
/// config that fails validation is refused, logged, and the limits in force stay.
async fn reload(decider: Arc<Decider>, path: PathBuf, merge: bool) {
    leasehold_store::rules::watch(&path, |why| {
        let _span = tracing::info_span!("limits_reload", why).entered();
        let refused = |e: &dyn std::fmt::Display| {
            metrics::counter!("leasehold_serve_config_reloads_total", "outcome" => "refused")
                .increment(1);
            tracing::error!(error = %e, "config refused; the limits in force stay");
        };
        match load(&path, merge) {
            Ok((d, rules)) => match decider.reload(d, &rules) {
                Ok(()) => {
                    metrics::counter!("leasehold_serve_config_reloads_total", "outcome" => "loaded")
                        .increment(1);
                    tracing::info!(rules = rules.len(), path = %path.display(), "limits reloaded");
                }
                Err(e) => refused(&e),
            },
            Err(e) => refused(&e),
        }
    })
    .await;
}
