//! Building a `Limiter`: its configuration, the store it talks to, and the checks made
//! before the first decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::redis_store::StoreError;
use crate::rules::{Rules, RulesError};
use crate::store::Store;

use super::Breakers;
use super::Inner;
use super::Limiter;
use super::background::background;
use super::table::RuleTable;
use crate::ManualClock;
use crate::breaker::BreakerConfig;
use crate::counters::ErrorCounts;
use crate::redis_store::{RedisStore, StoreConfig};
use crate::store::EmbeddedStore;
use leasehold_core::PolicyConfig;
use leasehold_core::model::AgentId;
use std::path::PathBuf;
use tokio::sync::mpsc;

/// Why a limiter could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No rules were given.
    #[error("no rules: call .rules(..) or .rules_file(..)")]
    NoRules,
    /// No store was named.
    #[error("no store: call .redis(url), .cluster(nodes) or .embedded()")]
    NoStore,
    /// The rules file was refused.
    #[error(transparent)]
    Rules(#[from] RulesError),
    /// The store could not be reached or set up.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The Prometheus exporter could not start.
    #[error("prometheus exporter: {0}")]
    Prometheus(String),
    /// Redis may evict bucket keys (see `LimiterConfig::allow_evicting_store`).
    #[error(
        "Redis maxmemory-policy is {policy}: it may evict bucket keys (each carries an expiry), \
         and an evicted bucket comes back full, admitting what was already spent. Set \
         maxmemory-policy noeviction, or LimiterConfig::allow_evicting_store to run anyway"
    )]
    EvictingStore {
        /// The policy in force.
        policy: String,
    },
    /// `build` was called outside a tokio runtime.
    #[error("Limiter::build must run inside a tokio runtime")]
    NoRuntime,
    /// The region is not a valid name, or a rule does not fit it.
    #[error("region: {0}")]
    Region(String),
}

/// Tuning of the agent. The defaults suit a gateway doing thousands of decisions per
/// second per hot key.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LimiterConfig {
    /// A cold key (auto leasing) becomes leased above this many tokens per second here,
    /// when its exact calls carry it alone; calls that carry many keys make its exact
    /// decisions cheaper for the store, and raise the rate up to 3.7x this
    /// (`leasehold_core::policy::promote_above`).
    pub hot_above_per_sec: u64,
    /// A leased key whose lease saw no spending for this long returns its tokens and
    /// becomes cold again (capped at half the lease lifetime).
    pub idle_after: Duration,
    /// A lease that saw no spending for this long returns its tokens (the key stays
    /// leased), so budget stranded with an agent whose demand moved elsewhere is back in
    /// the bucket within about this long (capped at `idle_after`).
    pub return_after: Duration,
    /// A cold key with no activity for this long is forgotten (memory released).
    pub forget_after: Duration,
    /// The most keys whose state the agent keeps (about 1 KB each). At it, a new key
    /// takes the place of an idle cold key (the longest idle of a few sampled, as Redis
    /// evicts); a key that leases, holds tokens or has a waiter is never dropped, and
    /// when no sampled key may go, the new key is decided by one exact call without
    /// keeping its state.
    pub max_keys: usize,
    /// A lease covers about this much of the key's local demand.
    pub horizon: Duration,
    /// A lease stops being spent this long before the store would let it expire
    /// (capped at a quarter of the lease lifetime), covering clock rate differences.
    pub margin: Duration,
    /// Run on a Redis whose `maxmemory-policy` may evict bucket keys (anything but
    /// `noeviction`). An evicted bucket comes back full, so by default `build` refuses
    /// such a store; set this to run anyway (the agent logs an error, re-reads the policy
    /// every 30 s and sets `leasehold_store_may_evict_buckets` to 1).
    pub allow_evicting_store: bool,
    /// Callers queued per key in `check_wait`.
    pub max_waiters: usize,
    /// How often the background task sweeps keys.
    pub sweep_every: Duration,
    /// Circuit breakers and bulkheads.
    pub breaker: BreakerConfig,
    /// Redis connection settings.
    pub store: StoreConfig,
    /// The region this agent serves, in a deployment in regions (each region with its own
    /// store): rules of scope `global` use the region's bucket of each key, fed by the
    /// region's broker (`leasehold coordinator --region`), and rules of scope `region` the
    /// region's share. `None` (the default): no regions; every rule has one bucket.
    pub region: Option<String>,
    /// A seat of a rule's local share (see `local_percent` in docs/rules.md) that no decision
    /// of the rule wanted for this long goes back to the store, so a gateway with traffic
    /// can take it; the gateway claims one again once its decisions want it.
    pub seat_idle_after: Duration,
    /// Every rule in shadow mode: refusals are counted (`shadow_denied`,
    /// `shadow_unavailable`) and let through. Default: the `LEASEHOLD_SHADOW`
    /// environment variable (`1`, `true` or `yes`); rules and overrides can also set
    /// `shadow = true` each.
    pub shadow: bool,
}

impl LimiterConfig {
    /// The part of the configuration the per-key policy reads.
    fn policy(&self) -> PolicyConfig {
        let mut c = PolicyConfig::default();
        c.horizon = self.horizon;
        c.margin = self.margin;
        c.return_after = self.return_after;
        c.idle_after = self.idle_after;
        c.hot_above_per_sec = self.hot_above_per_sec;
        c
    }
}

impl Default for LimiterConfig {
    fn default() -> Self {
        let p = PolicyConfig::default();
        Self {
            hot_above_per_sec: p.hot_above_per_sec,
            idle_after: p.idle_after,
            return_after: p.return_after,
            forget_after: Duration::from_secs(30),
            max_keys: 50_000,
            allow_evicting_store: false,
            horizon: p.horizon,
            margin: p.margin,
            max_waiters: 1024,
            sweep_every: Duration::from_millis(100),
            breaker: BreakerConfig::default(),
            store: StoreConfig::default(),
            region: None,
            seat_idle_after: Duration::from_secs(10),
            shadow: std::env::var("LEASEHOLD_SHADOW")
                .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes")),
        }
    }
}

#[derive(Debug)]
pub(super) enum StoreChoice {
    Redis(String),
    Cluster(Vec<String>),
    Embedded,
    Store(Store),
}

/// Builds a [`Limiter`].
#[derive(Debug, Default)]
pub struct LimiterBuilder {
    target: Option<StoreChoice>,
    rules: Option<Rules>,
    rules_file: Option<PathBuf>,
    watch: Option<Duration>,
    config: LimiterConfig,
    #[cfg(feature = "prometheus")]
    prometheus: Option<std::net::TcpListener>,
    agent: Option<u64>,
    degraded: bool,
    clock: Option<quanta::Clock>,
}

impl LimiterBuilder {
    /// Buckets at `address`: one Redis (`redis://host:port`, `rediss://…` for TLS), a
    /// cluster (`cluster://host:port,host:port`) or the primary Sentinels name
    /// (`redis+sentinel://host:port/service`); see [`RedisStore::open`]. TLS files go in
    /// `LimiterConfig::store`.
    pub fn redis(mut self, url: impl Into<String>) -> Self {
        self.target = Some(StoreChoice::Redis(url.into()));
        self
    }
    /// Buckets in a Redis Cluster, reached through any of `nodes`.
    pub fn cluster<S: Into<String>>(mut self, nodes: impl IntoIterator<Item = S>) -> Self {
        self.target = Some(StoreChoice::Cluster(
            nodes.into_iter().map(Into::into).collect(),
        ));
        self
    }
    /// Buckets in this process (single-process gateways, demos, tests).
    pub fn embedded(mut self) -> Self {
        self.target = Some(StoreChoice::Embedded);
        self
    }
    /// An already connected store (several limiters sharing one store).
    pub fn store(mut self, store: Store) -> Self {
        self.target = Some(StoreChoice::Store(store));
        self
    }
    /// Rules built in code.
    pub fn rules(mut self, rules: Rules) -> Self {
        self.rules = Some(rules);
        self
    }
    /// Rules from a TOML file, which [`Limiter::reload_rules`] reads again.
    pub fn rules_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.rules_file = Some(path.into());
        self
    }
    /// Reload the rules file by itself when it changes, checking every `interval`.
    pub fn watch_rules(mut self, interval: Duration) -> Self {
        self.watch = Some(interval);
        self
    }
    /// Tuning.
    pub fn config(mut self, config: LimiterConfig) -> Self {
        self.config = config;
        self
    }
    /// Installs a Prometheus recorder as the process's global recorder and serves it on
    /// `listener` (keep it on loopback unless fronted); see
    /// [`crate::telemetry::serve_prometheus`]. Without this the agent records into
    /// whatever recorder the application installed, and installs none.
    #[cfg(feature = "prometheus")]
    pub fn prometheus(mut self, listener: std::net::TcpListener) -> Self {
        self.prometheus = Some(listener);
        self
    }
    /// Come up even when the store cannot be reached: `build` waits for it at most the
    /// store's connect timeout (a malformed address or a bad TLS file is still an
    /// error), then returns; while it is out of reach decisions follow each
    /// rule's failure policy, and the store is dialled again until it answers; then the
    /// library is loaded, the eviction policy read (a store that may evict buckets is
    /// refused, with an error logged, until its policy is `noeviction`, unless
    /// `allow_evicting_store`) and decisions use it. [`Limiter::health`] tells which.
    /// Without this (the default) `build` fails when the store does not answer. The
    /// binaries start this way, so a gateway restarted during an outage comes back.
    pub fn start_degraded(mut self, yes: bool) -> Self {
        self.degraded = yes;
        self
    }
    /// A fixed agent id instead of a random one (ids must be unique per live process).
    pub fn agent_id(mut self, id: u64) -> Self {
        self.agent = Some(id);
        self
    }

    /// Decides on `clock` instead of the machine's, on an embedded store that reads the
    /// same clock (tests: see [`ManualClock`]).
    pub fn clock(mut self, clock: &ManualClock) -> Self {
        self.clock = Some(clock.quanta());
        self.store(Store::Embedded(clock.store()))
    }

    /// Connects, loads the rules and starts the background task.
    pub async fn build(self) -> Result<Limiter, BuildError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?;
        let rules = match (&self.rules_file, self.rules) {
            (Some(path), _) => Rules::from_file(path)?,
            (None, Some(rules)) => rules,
            (None, None) => return Err(BuildError::NoRules),
        };
        if let Some(r) = &self.config.region
            && !leasehold_core::rule::valid_region_name(r)
        {
            return Err(BuildError::Region(format!(
                "{:?}: a region name is 1 to {} of [A-Za-z0-9._-]",
                r.chars().take(80).collect::<String>(),
                leasehold_core::rule::MAX_REGION_NAME
            )));
        }
        // Checked before connecting: a rule that does not fit the region is a config error.
        RuleTable::new(&rules, None, false, self.config.region.as_deref())
            .map_err(BuildError::Region)?;
        let config = self.config.store.clone();
        let store = match (self.target.ok_or(BuildError::NoStore)?, self.degraded) {
            (StoreChoice::Redis(url), false) => Store::Redis(RedisStore::open(&url, config).await?),
            (StoreChoice::Redis(url), true) => {
                Store::Redis(RedisStore::open_in_background(&url, config)?)
            }
            (StoreChoice::Cluster(nodes), false) => {
                Store::Redis(RedisStore::connect_cluster(&nodes, config).await?)
            }
            (StoreChoice::Cluster(nodes), true) => {
                Store::Redis(RedisStore::cluster_in_background(&nodes, config)?)
            }
            (StoreChoice::Embedded, _) => Store::Embedded(EmbeddedStore::new()),
            (StoreChoice::Store(store), _) => store,
        };
        let breakers = Breakers::new(self.config.breaker);
        let evicting = AtomicBool::new(false);
        // A store that answers at once is set up now, as without `start_degraded`.
        if let Store::Redis(r) = &store
            && self.degraded
        {
            let limit = self.config.store.connect_timeout;
            if tokio::time::timeout(limit, r.connected()).await.is_err() {
                tracing::warn!(
                    waited = ?limit,
                    "store not connected yet: starting degraded (each rule's failure policy \
                     decides until it is)"
                );
            }
        }
        if let Store::Redis(r) = &store
            && r.is_connected()
        {
            if let Some(policy) = evicting_policy(r).await {
                if !self.config.allow_evicting_store {
                    return Err(BuildError::EvictingStore { policy });
                }
                tracing::error!(
                    %policy,
                    "Redis maxmemory-policy may evict bucket keys, and an evicted bucket comes \
                     back full (allow_evicting_store is set)"
                );
                evicting.store(true, Ordering::Relaxed);
            }
            breakers.set_topology(&r.shards().await?);
        }
        #[cfg(feature = "prometheus")]
        if let Some(listener) = self.prometheus {
            crate::telemetry::serve_prometheus(listener).map_err(BuildError::Prometheus)?;
        }
        crate::telemetry::describe();
        let (tx, rx) = mpsc::channel(4096);
        let clock = self.clock.unwrap_or_default();
        let inner = Arc::new(Inner {
            // Id 0 is the store's reservation in the parts of a split bucket.
            agent: AgentId(self.agent.unwrap_or_else(rand::random).max(1)),
            seq: AtomicU64::new(0),
            store,
            rules: ArcSwap::from_pointee(
                RuleTable::new(
                    &rules,
                    None,
                    self.config.shadow,
                    self.config.region.as_deref(),
                )
                .map_err(BuildError::Region)?,
            ),
            rules_file: self.rules_file,
            rules_mtime: parking_lot::Mutex::new(None),
            required: parking_lot::Mutex::new(Vec::new()),
            keys: super::keymap::KeyMap::new(),
            cells: Arc::default(),
            base: clock.raw(),
            clock,
            breakers,
            error_kinds: ErrorCounts::default(),
            evicting,
            keys_over_cap: AtomicU64::new(0),
            shut: AtomicBool::new(false),
            stop: Arc::new(tokio::sync::Notify::new()),
            keys_evicted: AtomicU64::new(0),
            keys_first_seen: AtomicU64::new(0),
            prefetch: tx,
            swept: parking_lot::Mutex::new(Vec::new()),
            report_log: parking_lot::Mutex::default(),
            report_every: AtomicU64::new(1),
            sweep_cursor: AtomicUsize::new(0),
            policy: self.config.policy(),
            config: self.config,
        });
        inner.note_rules_mtime();
        if let Store::Redis(r) = &inner.store
            && !r.is_connected()
        {
            handle.spawn(super::background::when_connected(
                r.clone(),
                Arc::downgrade(&inner),
            ));
        }
        handle.spawn(background(Arc::downgrade(&inner), rx, self.watch));
        Ok(Limiter { inner })
    }
}

/// Whether Redis may evict bucket keys under `policy`. Every bucket key carries an expiry
/// (I6), so the `volatile-*` policies may evict them as well as the `allkeys-*` ones, and
/// an evicted bucket comes back full: only `noeviction` is safe.
pub(super) fn may_evict(policy: &str) -> bool {
    policy != "noeviction"
}

/// Reads the store's eviction policy; `Some(policy)` when it may evict bucket keys.
/// Unreadable (an ACL without CONFIG) is logged and taken as safe.
pub(super) async fn evicting_policy(store: &RedisStore) -> Option<String> {
    match store.maxmemory_policy().await {
        Ok(policy) => may_evict(&policy).then_some(policy),
        Err(e) => {
            tracing::warn!(error = %e, "could not read Redis maxmemory-policy");
            None
        }
    }
}
