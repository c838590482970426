//! The command line of the coordinator, shared by `leasehold-coordinator` and
//! `leasehold coordinator`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use leasehold_store::{RedisStore, Rules, StoreArgs, StoreConfig};

use crate::plan::SplitPolicy;
use crate::{Admin, Coordinator, CoordinatorConfig};

/// Runs the coordinator: reads the agents' reports, accounts admitted tokens against
/// each key's bound, splits keys too hot for one shard, and serves the admin endpoint.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The Redis holding the buckets.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The rules file the agents use (`leasehold coordinator` also reads serve's
    /// envoyproxy/ratelimit YAML: a .yaml file or a directory of them).
    #[arg(long, env = "LEASEHOLD_CONFIG")]
    pub config: PathBuf,
    /// Where to serve the admin endpoint (keep it on loopback unless fronted).
    #[arg(long, default_value = "127.0.0.1:9470", env = "LEASEHOLD_LISTEN")]
    pub listen: std::net::SocketAddr,
    /// A bearer token the admin endpoint's page and JSON want (`Authorization: Bearer
    /// TOKEN`; the page at `/#token=TOKEN`). `/health`, `/ready` and `/metrics` stay
    /// open. Set it when the endpoint listens beyond loopback.
    #[arg(long, env = "LEASEHOLD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Split a key whose store calls exceed this many per second (its per-shard budget).
    #[arg(long, default_value_t = 5000.0, env = "LEASEHOLD_SPLIT_ABOVE")]
    pub split_above: f64,
    /// Seconds each extension of a split's term adds.
    #[arg(long, default_value_t = 30, env = "LEASEHOLD_TERM")]
    pub term: u64,
    /// In a deployment in regions: the region whose store `--redis` is. The coordinator
    /// then also brokers the region's budgets of rules with `scope = "global"` from the
    /// global store (`--global-redis`).
    #[arg(long, env = "LEASEHOLD_REGION", requires = "global_redis")]
    pub region: Option<String>,
    /// With `--region`: the home store holding the global buckets (same URL forms as
    /// `--redis`).
    #[arg(
        long,
        env = "LEASEHOLD_GLOBAL_REDIS_URL",
        hide_env_values = true,
        requires = "region"
    )]
    pub global_redis: Option<String>,
    /// With `--region`: how often each global key's budget is renewed, in milliseconds.
    #[arg(long, default_value_t = 100, env = "LEASEHOLD_REGION_REFRESH_MS")]
    pub region_refresh_ms: u64,
    /// With `--region`: the most global keys brokered at once (each costs about
    /// 1000 / region-refresh-ms calls a second to the global store).
    #[arg(long, default_value_t = crate::broker::DEFAULT_MAX_KEYS, env = "LEASEHOLD_REGION_MAX_KEYS")]
    pub region_max_keys: usize,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per event (for log pipelines).
    Json,
}

/// Installs the process's log subscriber, writing to stderr: `RUST_LOG` filters
/// (`RUST_LOG=leasehold_agent=debug,info`), else `default` (a level or directives).
/// Keys appear in logs as their rule and a hash of the subject, never the subject.
pub fn init_logging(format: LogFormat, default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colour only for a terminal: a file or a log collector gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // Err only when a subscriber is installed already, which then serves.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// The store `address` names (see [`RedisStore::open`]), connecting in the background:
/// a store that does not answer yet is dialled again until it does. A malformed address
/// is an error at once; no error shows the password.
pub fn connect(address: &str, config: StoreConfig) -> Result<RedisStore, String> {
    RedisStore::open_in_background(address, config).map_err(|e| {
        let text = leasehold_store::redis::redact_in(&e.to_string(), address);
        let shown = leasehold_store::redis::redact(address);
        // Most errors name the address already.
        if text.contains(&shown) {
            text
        } else {
            format!("{shown}: {text}")
        }
    })
}

/// Reads the rules `--config` names, at start and on every reload.
pub type LoadRules = fn(&Path) -> Result<Rules, String>;

/// A Leasehold rules file (TOML). envoyproxy/ratelimit's YAML is refused saying which
/// command reads it (a TOML parser's complaint about YAML names no such thing).
pub fn toml_rules(path: &Path) -> Result<Rules, String> {
    if leasehold_store::rules::names_yaml(path) {
        return Err(format!(
            "{}: this coordinator reads a Leasehold rules file (TOML); `leasehold coordinator` \
             also reads envoyproxy/ratelimit YAML, as `leasehold serve` does",
            path.display()
        ));
    }
    Rules::from_file(path).map_err(|e| e.to_string())
}

/// Runs until `shutdown` completes; errors name what is wrong (rules file, Redis, port).
pub async fn run(
    args: Args,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    run_with(args, shutdown, toml_rules).await
}

/// [`run`], its rules read by `load`.
pub async fn run_with(
    args: Args,
    shutdown: impl Future<Output = ()> + Send + 'static,
    load: LoadRules,
) -> Result<(), String> {
    if !(args.split_above > 0.0 && args.split_above.is_finite()) {
        return Err(format!(
            "--split-above {}: must be a positive number",
            args.split_above
        ));
    }
    // An empty token would leave the page open while the operator believes it closed.
    if args
        .admin_token
        .as_deref()
        .is_some_and(|t| t.trim().is_empty())
    {
        return Err(
            "--admin-token is empty: give a token, or leave the flag out to serve the \
             page without one"
                .into(),
        );
    }
    if !(1..=3600).contains(&args.term) {
        return Err(format!(
            "--term {}: must be between 1 and 3600 seconds",
            args.term
        ));
    }
    let rules = load(&args.config)?;
    let address = args.store.address()?.ok_or(
        "no store given: pass --redis URL, --redis-url-file FILE or set LEASEHOLD_REDIS_URL",
    )?;
    let store = connect(&address, args.store.config())?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("listen {}: {e}", args.listen))?;
    if !args.listen.ip().is_loopback() && args.admin_token.as_deref().unwrap_or("").is_empty() {
        tracing::warn!(
            listen = %args.listen,
            "the admin endpoint listens beyond loopback without --admin-token: anyone who \
             reaches it sees the keys and rules"
        );
    }
    let config = CoordinatorConfig {
        split: SplitPolicy {
            split_above: args.split_above,
            merge_below: args.split_above / 4.0,
            term: Duration::from_secs(args.term),
        },
        ..CoordinatorConfig::default()
    };
    let mut coordinator = Coordinator::new(store.clone(), rules.clone(), config);
    if let (Some(region), Some(global)) = (&args.region, &args.global_redis) {
        if !leasehold_core::rule::valid_region_name(region) {
            return Err(format!(
                "--region {:?}: a region name is 1 to {} of [A-Za-z0-9._-]",
                region.chars().take(80).collect::<String>(),
                leasehold_core::rule::MAX_REGION_NAME
            ));
        }
        if !(10..=10_000).contains(&args.region_refresh_ms) {
            return Err(format!(
                "--region-refresh-ms {}: must be between 10 and 10000",
                args.region_refresh_ms
            ));
        }
        for rule in rules.iter() {
            rule.in_region(Some(region))?;
        }
        // The slow link: calls there wait longer than the region's own.
        let mut global_config = args.store.config();
        global_config.call_timeout = Duration::from_secs(1);
        let global = connect(global.trim(), global_config)?;
        let broker = crate::broker::Broker::new(
            region,
            store.clone(),
            global,
            coordinator.rules(),
            leasehold_core::model::region::BrokerConfig {
                refresh_us: args.region_refresh_ms * 1000,
                ..Default::default()
            },
        );
        broker.set_max_keys(args.region_max_keys);
        coordinator = coordinator.with_broker(broker);
        println!("coordinator brokers region {region}");
    }
    let coordinator = Arc::new(coordinator);
    let admin = Admin::new(store.clone(), rules)
        .with_rules(coordinator.rules())
        .with_snapshot(coordinator.snapshot())
        .with_broker(coordinator.broker().cloned())
        .with_token(args.admin_token.clone())
        .with_metrics(crate::admin::install_prometheus()?);
    println!(
        "coordinator admin endpoint on http://{}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    let reloading = tokio::spawn(reload_rules(coordinator.clone(), args.config.clone(), load));
    let (stop_admin, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(crate::serve(listener, admin, async {
        let _ = stopped.await;
    }));
    // The admin endpoint answers (`/ready`: 503) while the store is out of reach; the
    // coordinator's work starts once it answers.
    let mut shutdown = std::pin::pin!(shutdown);
    let running = tokio::select! {
        () = store.connected() => Some(coordinator.spawn()),
        () = &mut shutdown => None,
    };
    if running.is_some() {
        shutdown.await;
    }
    reloading.abort();
    if let Some(running) = running {
        running.stop().await;
    }
    let _ = stop_admin.send(());
    serving
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Reads the rules file again when it changes (checked every second) or on SIGHUP. A
/// file that fails validation is refused, logged, and the rules in force stay.
async fn reload_rules(coordinator: Arc<Coordinator>, path: std::path::PathBuf, load: LoadRules) {
    leasehold_store::rules::watch(&path, |why| {
        let _span = tracing::info_span!("rules_reload", why).entered();
        match load(&path) {
            Ok(rules) => {
                let n = rules.len();
                coordinator.set_rules(rules);
                tracing::info!(rules = n, path = %path.display(), "rules reloaded");
            }
            Err(e) => tracing::error!(error = %e, "rules file refused; the rules in force stay"),
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coordinator_binary_says_which_command_reads_yaml() {
        let e = toml_rules(Path::new("/etc/ratelimit/config.yaml")).unwrap_err();
        assert!(
            e.contains("`leasehold coordinator` also reads envoyproxy/ratelimit YAML"),
            "{e}"
        );
    }
}
