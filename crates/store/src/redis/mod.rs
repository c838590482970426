//! The Redis store: calls the `leasehold` function library (`lua/leasehold.lua`) on a
//! single Redis or a Redis Cluster.
//!
//! Every call is one `FCALL` on one key. The library is loaded with `FUNCTION LOAD
//! REPLACE` on every primary at connect. When a node answers that the function does not
//! exist (a restart without persistence, `FUNCTION FLUSH`, a failover to a node that never
//! had it), the library is loaded again once — one caller loads, the others that saw the
//! same failure wait for it — and the call is retried. Requests are idempotent by
//! `(agent, seq)`, so that retry, and the cluster client's own retries after `MOVED`,
//! `ASK` or a dropped connection, never debit twice.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

pub use crate::secret::{redact, redact_in};
use crate::sentinel::SentinelConn;

mod admin;
mod bucket;
mod connect;
mod error;
mod library;

pub use bucket::fcall;
pub(crate) use bucket::validate_batch;
pub(crate) use connect::Certs;
pub use connect::{StoreConfig, TlsFiles, node_urls};
use error::classify;
pub use error::{ErrorKind, StoreError};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError, Value};

/// The function library, as shipped.
pub const LIBRARY: &str = include_str!("../../leasehold.lua");

#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<SentinelConn>),
}

impl Conn {
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Self::Single(c) => cmd.query_async(&mut c.clone()).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Self::Sentinel(s) => s.query(cmd).await,
        }
    }

    /// Runs `pipe` on one connection; on a cluster, on the primary serving `slot` (a
    /// keyless command such as WAIT would otherwise go to every primary).
    async fn query_pipe(
        &self,
        pipe: &redis::Pipeline,
        slot: u16,
    ) -> Result<Vec<Value>, RedisError> {
        use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
        match self {
            Self::Single(c) => pipe.query_async(&mut c.clone()).await,
            Self::Cluster(c) => {
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                c.clone()
                    .route_pipeline(pipe.clone(), 0, pipe.len(), route)
                    .await
            }
            Self::Sentinel(s) => s.query_pipe(pipe).await,
        }
    }
}

pub(super) struct Loader {
    pub(super) generation: AtomicU64,
    pub(super) loads: AtomicU64,
    pub(super) lock: tokio::sync::Mutex<()>,
}

/// The connection a store holds, once it has one, and whether it may be used.
pub(super) struct Link {
    /// Set once, when the store is first reached; every connection type reconnects by
    /// itself after that.
    pub(super) conn: std::sync::OnceLock<Conn>,
    /// `true` from the moment `conn` is set.
    pub(super) connected: tokio::sync::watch::Sender<bool>,
    /// Why the store must not be used, while it must not (see [`RedisStore::refuse`]).
    pub(super) refused: arc_swap::ArcSwapOption<String>,
    /// Until the store is first reached: why the last attempt failed (redacted).
    pub(super) not_reached: arc_swap::ArcSwapOption<String>,
    /// The address, without its password, for logs.
    pub(super) shown: String,
}

/// A connection to the store that holds the global buckets.
#[derive(Clone)]
pub struct RedisStore {
    pub(super) link: Arc<Link>,
    pub(super) loader: Arc<Loader>,
    pub(super) config: StoreConfig,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("address", &self.link.shown)
            .field(
                "mode",
                &match self.link.conn.get() {
                    None => "connecting",
                    Some(Conn::Single(_)) => "single",
                    Some(Conn::Cluster(_)) => "cluster",
                    Some(Conn::Sentinel(_)) => "sentinel",
                },
            )
            .field("library_loads", &self.library_loads())
            .finish()
    }
}

impl RedisStore {
    /// Whether the store has been reached (it may have been lost again since: calls
    /// tell). A store from [`RedisStore::open`] always has.
    pub fn is_connected(&self) -> bool {
        self.link.conn.get().is_some()
    }

    /// Waits until [`RedisStore::is_connected`].
    pub async fn connected(&self) {
        let mut rx = self.link.connected.subscribe();
        // Err only when the sender is gone, which it is not while `self` lives.
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Makes every bucket call fail with `why` (a misconfigured store whose buckets must
    /// not be used, as one that may evict them), or with `None`, lets them through again.
    /// Plain commands ([`RedisStore::query`], the policy and topology reads) still go.
    pub fn refuse(&self, why: Option<String>) {
        self.link.refused.store(why.map(Arc::new));
    }

    /// While the store is not connected: `store not reached yet; connecting`, or why the
    /// last attempt failed, for health probes: `store not connected yet: store
    /// unreachable (…)`, or, when the store answered and refused, `…: store refused the
    /// credentials …` ("not reached" read as if it never answered).
    pub fn not_reached(&self) -> Option<String> {
        if self.is_connected() {
            return None;
        }
        Some(match self.link.not_reached.load_full() {
            None => "store not reached yet; connecting".to_owned(),
            Some(why) => format!("store not connected yet: {why}; retrying"),
        })
    }

    /// Why the store is refused, if it is (see [`RedisStore::refuse`]).
    pub fn refused(&self) -> Option<String> {
        self.link.refused.load_full().map(|s| s.as_ref().clone())
    }

    /// Whether the Sentinels are failing the service over now: calls wait for the new
    /// primary.
    pub fn failing_over(&self) -> bool {
        matches!(self.link.conn.get(), Some(Conn::Sentinel(s)) if s.fenced())
    }

    /// `Err` while the store is refused (see [`RedisStore::refuse`]).
    fn not_refused(&self) -> Result<(), StoreError> {
        match self.link.refused.load().as_deref() {
            Some(why) => Err(StoreError::Misconfigured(why.clone())),
            None => Ok(()),
        }
    }

    /// The connection, or why there is none yet.
    fn conn(&self) -> Result<&Conn, StoreError> {
        self.link.conn.get().ok_or_else(|| {
            StoreError::Unavailable(RedisError::from((
                redis::ErrorKind::Io,
                "not connected yet",
                self.link.shown.clone(),
            )))
        })
    }

    /// Runs one plain command (agent reports, the coordinator's reads), bounded by the
    /// call timeout.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        let limit = self.config.call_timeout;
        let v = tokio::time::timeout(limit, self.conn()?.query(cmd))
            .await
            .map_err(|_| StoreError::Timeout(limit))?
            .map_err(classify)?;
        redis::from_redis_value(v.clone())
            .map_err(|_| StoreError::Misconfigured(format!("unexpected reply {v:?}")))
    }
}
