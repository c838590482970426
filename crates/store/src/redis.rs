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

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::key::BucketKey;
use leasehold_core::local::SeatReply;
use leasehold_core::model::{
    AgentId, ExactOutcome, MAX_BATCH_COSTS, Op, ProtocolError, Reply, Request, validate,
    validate_exact,
};

pub use crate::secret::{redact, redact_in};
use crate::sentinel::SentinelConn;
use crate::wire::{self, ExactItem};
use leasehold_core::rule::{BucketParams, Replication};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError, Value};

/// The function library, as shipped.
pub const LIBRARY: &str = include_str!("../leasehold.lua");

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The request was refused before it was sent: it can never succeed as written.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The store refused the request (`LH_*` error from the library).
    #[error("store refused the request: {code} {message}")]
    Refused {
        /// `LH_CAPACITY`, `LH_STALE` or `LH_ARG`.
        code: String,
        /// The store's explanation.
        message: String,
    },
    /// The store could not be reached or did not answer in time. The request may or may
    /// not have been applied; retrying it with the same `(agent, seq)` is safe.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] RedisError),
    /// No answer within the call timeout. As for `Unavailable`, a retry is safe.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The embedded store was switched off (simulated outage).
    #[error("store offline")]
    Offline,
    /// The store answered with an error of its own: out of memory (`OOM`), no permission
    /// (`NOPERM`), a read-only replica (`READONLY`), a key of another type (`WRONGTYPE`).
    #[error("store error {code}: {message}")]
    Server {
        /// The error code Redis gave.
        code: String,
        /// Its explanation, truncated.
        message: String,
    },
    /// A grant that fewer replicas than the rule's `replicas` acknowledged within its
    /// `replica_timeout`: a failover now could lose it, so it is not spent and counts as
    /// an unknown outcome (the failure policy decides; the next acquire declares what
    /// the agent holds, which returns the grant to the bucket).
    #[error("grant of {granted} acknowledged by {acked} of {wanted} replicas in time")]
    NotReplicated {
        /// Tokens the primary granted.
        granted: u64,
        /// Replicas that acknowledged.
        acked: u64,
        /// Replicas the rule asks for.
        wanted: u32,
    },
    /// The store answered in a way that needs an operator: an unexpected reply, a bad
    /// address.
    #[error("store misconfigured: {0}")]
    Misconfigured(String),
}

/// What kind of store error, as counted in `leasehold_store_errors_by_kind_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No answer in time.
    Timeout,
    /// Connection refused, dropped or reset; the node is loading or the cluster down.
    Unavailable,
    /// The embedded store is switched off.
    Offline,
    /// `OOM`: Redis is at `maxmemory` and refuses writes.
    OutOfMemory,
    /// `NOPERM` or `NOAUTH`: the user may not run the library.
    NoPermission,
    /// `READONLY`: the node is a replica.
    ReadOnly,
    /// `LH_*`: the library refused the request itself.
    Refused,
    /// Refused before sending: the request can never succeed as written.
    Protocol,
    /// A grant that too few replicas acknowledged in time (rules with `replicas`).
    NotReplicated,
    /// Any other error reply or unexpected answer.
    Other,
}

impl ErrorKind {
    /// Every kind, in `repr` order.
    pub const ALL: [ErrorKind; 10] = [
        Self::Timeout,
        Self::Unavailable,
        Self::Offline,
        Self::OutOfMemory,
        Self::NoPermission,
        Self::ReadOnly,
        Self::Refused,
        Self::Protocol,
        Self::NotReplicated,
        Self::Other,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Offline => "offline",
            Self::OutOfMemory => "oom",
            Self::NoPermission => "noperm",
            Self::ReadOnly => "readonly",
            Self::Refused => "refused",
            Self::Protocol => "protocol",
            Self::NotReplicated => "not_replicated",
            Self::Other => "other",
        }
    }
}

impl StoreError {
    /// True when the outcome of the request is unknown and a retry with the same
    /// sequence number is the right move.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::Timeout(_) | Self::Offline
        )
    }

    /// What kind of error this is, for metrics.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Protocol(_) => ErrorKind::Protocol,
            Self::Refused { .. } => ErrorKind::Refused,
            Self::Unavailable(_) => ErrorKind::Unavailable,
            Self::Timeout(_) => ErrorKind::Timeout,
            Self::Offline => ErrorKind::Offline,
            Self::Server { code, .. } => match code.as_str() {
                "OOM" => ErrorKind::OutOfMemory,
                "NOPERM" | "NOAUTH" | "WRONGPASS" => ErrorKind::NoPermission,
                "READONLY" => ErrorKind::ReadOnly,
                _ => ErrorKind::Other,
            },
            Self::NotReplicated { .. } => ErrorKind::NotReplicated,
            Self::Misconfigured(_) => ErrorKind::Other,
        }
    }
}

/// At most this many bytes of a store's error text are kept: a request carrying a
/// megabyte must not come back as a megabyte of error message.
const MAX_ERROR_TEXT: usize = 256;

fn truncated(text: &str) -> String {
    if text.len() <= MAX_ERROR_TEXT {
        return text.to_owned();
    }
    let mut end = MAX_ERROR_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len())
}

/// `scheme://node` for each of the comma-separated `nodes` (`cluster://` addresses).
fn node_urls(scheme: &str, nodes: &str) -> Vec<String> {
    nodes
        .split(',')
        .filter(|n| !n.is_empty())
        .map(|n| format!("{scheme}://{n}"))
        .collect()
}

fn manager_settings(config: &StoreConfig) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.call_timeout))
        .set_number_of_retries(1)
}

/// Connection settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
    /// Bound on one call, reload included.
    pub call_timeout: Duration,
    /// Certificates for `rediss://` (TLS through rustls). Without a CA file the system's
    /// trust store is used.
    pub tls: TlsFiles,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            call_timeout: Duration::from_millis(500),
            tls: TlsFiles::default(),
        }
    }
}

/// PEM files for TLS connections (`rediss://`, `rediss+sentinel://`).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The CA that signed the server's certificate, when it is not in the system's trust
    /// store (a private CA, as managed services and self-run clusters use).
    pub ca_file: Option<PathBuf>,
    /// A client certificate, for servers that require one (`tls-auth-clients yes`).
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }

    /// Reads the files; an error names the file and what is wrong with it.
    #[cfg(feature = "tls")]
    fn load(&self) -> Result<redis::TlsCertificates, StoreError> {
        let read = |what: &str, path: &std::path::Path| {
            let bytes = std::fs::read(path).map_err(|e| {
                StoreError::Misconfigured(format!("{what} {}: {e}", path.display()))
            })?;
            if !bytes.starts_with(b"-----BEGIN") {
                return Err(StoreError::Misconfigured(format!(
                    "{what} {}: not a PEM file (it must start with -----BEGIN)",
                    path.display()
                )));
            }
            Ok(bytes)
        };
        let root_cert = match &self.ca_file {
            Some(p) => Some(read("TLS CA file", p)?),
            None => None,
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read("TLS client certificate", cert)?,
                client_key: read("TLS client key", key)?,
            }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(StoreError::Misconfigured(
                    "a TLS client certificate was given without its key".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(StoreError::Misconfigured(
                    "a TLS client key was given without its certificate".into(),
                ));
            }
        };
        Ok(redis::TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

/// Makes rustls use the ring provider (the only one built), once per process.
#[cfg(feature = "tls")]
fn tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err only when a provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The error for an address that asks for TLS when the `tls` feature is off.
#[cfg(not(feature = "tls"))]
fn no_tls(address: &str) -> StoreError {
    StoreError::Misconfigured(format!(
        "{address:?} asks for TLS, but leasehold-store was built without its `tls` feature"
    ))
}

/// A client for one node, with the TLS files when the URL asks for TLS.
fn client(url: &str, tls: &TlsFiles) -> Result<redis::Client, StoreError> {
    let bad = |e: RedisError| {
        // redis-rs says only "did not parse - InvalidClientConfig": say what is wrong.
        let shown = redact(url);
        if shown.starts_with('<') {
            // Not SCHEME://… at all: the description says so.
            return StoreError::Misconfigured(format!("redis url {shown}"));
        }
        let why = if e.kind() == redis::ErrorKind::InvalidClientConfig {
            crate::secret::what_is_wrong(url)
        } else {
            redact_in(&e.to_string(), url)
        };
        StoreError::Misconfigured(format!("redis url {shown}: {why}"))
    };
    if url.starts_with("rediss://") {
        #[cfg(not(feature = "tls"))]
        return Err(no_tls(&redact(url)));
        #[cfg(feature = "tls")]
        {
            tls_provider();
            if !tls.is_empty() {
                return redis::Client::build_with_tls(url, tls.load()?).map_err(bad);
            }
        }
    } else if !tls.is_empty() {
        return Err(StoreError::Misconfigured(format!(
            "TLS files were given but the url {:?} is not rediss://",
            redact(url)
        )));
    }
    redis::Client::open(url).map_err(bad)
}

#[derive(Clone)]
enum Conn {
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

struct Loader {
    generation: AtomicU64,
    loads: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

/// The connection a store holds, once it has one, and whether it may be used.
struct Link {
    /// Set once, when the store is first reached; every connection type reconnects by
    /// itself after that.
    conn: std::sync::OnceLock<Conn>,
    /// `true` from the moment `conn` is set.
    connected: tokio::sync::watch::Sender<bool>,
    /// Why the store must not be used, while it must not (see [`RedisStore::refuse`]).
    refused: arc_swap::ArcSwapOption<String>,
    /// The address, without its password, for logs.
    shown: String,
}

/// A connection to the store that holds the global buckets.
#[derive(Clone)]
pub struct RedisStore {
    link: Arc<Link>,
    loader: Arc<Loader>,
    config: StoreConfig,
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

/// How a store is reached. Made from the address at once, so a malformed address or a
/// bad TLS file is refused before anything is dialled; dialled as often as it takes.
enum Dialer {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
    Sentinel {
        sentinels: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
        /// The Sentinels' own addresses, whose announcements of a failover are followed.
        watch: Vec<redis::ConnectionAddr>,
        /// The TLS files for the Sentinels, when given.
        certs: Option<Certs>,
        service: String,
    },
}

/// The TLS files of a connection (none without the `tls` feature).
#[cfg(feature = "tls")]
pub(crate) type Certs = redis::TlsCertificates;
/// The TLS files of a connection (none without the `tls` feature).
#[cfg(not(feature = "tls"))]
#[derive(Clone)]
pub(crate) enum Certs {}

impl Dialer {
    /// Takes `address` apart (see [`RedisStore::open`]); errors name what is wrong.
    fn new(address: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        if let Some(nodes) = address.strip_prefix("cluster://") {
            Self::cluster(&node_urls("redis", nodes), config)
        } else if let Some(nodes) = address.strip_prefix("clusters://") {
            Self::cluster(&node_urls("rediss", nodes), config)
        } else if let Some(rest) = address.strip_prefix("redis+sentinel://") {
            Self::sentinel(false, rest, config)
        } else if let Some(rest) = address.strip_prefix("rediss+sentinel://") {
            Self::sentinel(true, rest, config)
        } else {
            Ok(Self::Single(client(address, &config.tls)?))
        }
    }

    fn sentinel(tls: bool, rest: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        let scheme = if tls {
            "rediss+sentinel"
        } else {
            "redis+sentinel"
        };
        let shown = redact(&format!("{scheme}://{rest}"));
        let bad = |why: &str| {
            StoreError::Misconfigured(format!(
                "sentinel address {shown}: {why}; expected \
                 redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE"
            ))
        };
        let (authority, service) = rest.split_once('/').ok_or_else(|| bad("no /SERVICE"))?;
        if service.is_empty() || service.contains(['/', '?', '#']) {
            return Err(bad("the service name is missing or malformed"));
        }
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((c, h)) => (Some(c), h),
            None => (None, authority),
        };
        let mut sentinels = Vec::new();
        for host in hosts.split(',').filter(|h| !h.is_empty()) {
            let (name, port) = host
                .rsplit_once(':')
                .ok_or_else(|| bad("a Sentinel lacks :PORT"))?;
            let port: u16 = port
                .parse()
                .map_err(|_| bad("a Sentinel's port is not a number"))?;
            let name = name
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            sentinels.push(if tls {
                redis::ConnectionAddr::TcpTls {
                    host: name,
                    port,
                    insecure: false,
                    tls_params: None,
                }
            } else {
                redis::ConnectionAddr::Tcp(name, port)
            });
        }
        if sentinels.is_empty() {
            return Err(bad("no Sentinel given"));
        }
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut certs: Option<Certs> = None;
        let mut builder = redis::sentinel::SentinelClientBuilder::new(
            sentinels.clone(),
            service,
            redis::sentinel::SentinelServerType::Master,
        )
        .map_err(|e| bad(&e.to_string()))?;
        if let Some(c) = credentials {
            let (user, password) = c.split_once(':').unwrap_or((c, ""));
            if !user.is_empty() {
                builder = builder.set_client_to_redis_username(user);
            }
            if !password.is_empty() {
                builder = builder.set_client_to_redis_password(password);
            }
        }
        if tls {
            #[cfg(not(feature = "tls"))]
            return Err(no_tls(&shown));
            #[cfg(feature = "tls")]
            {
                tls_provider();
                builder = builder
                    .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                    .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
                if !config.tls.is_empty() {
                    let loaded = config.tls.load()?;
                    builder = builder
                        .set_client_to_redis_certificates(loaded.clone())
                        .set_client_to_sentinel_certificates(loaded.clone());
                    certs = Some(loaded);
                }
            }
        } else if !config.tls.is_empty() {
            return Err(bad(
                "TLS files were given for a plain-text address (use rediss+sentinel://)",
            ));
        }
        let sentinel = builder.build().map_err(|e| bad(&e.to_string()))?;
        Ok(Self::Sentinel {
            sentinels: Arc::new(tokio::sync::Mutex::new(sentinel)),
            watch: sentinels,
            certs,
            service: service.to_owned(),
        })
    }

    fn cluster(nodes: &[String], config: &StoreConfig) -> Result<Self, StoreError> {
        let builder = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.call_timeout)
            .retries(3);
        let tls_node = nodes.iter().find(|n| n.starts_with("rediss://"));
        #[cfg(not(feature = "tls"))]
        if let Some(n) = tls_node {
            return Err(no_tls(&redact(n)));
        }
        #[cfg(feature = "tls")]
        let builder = if tls_node.is_some() && !config.tls.is_empty() {
            tls_provider();
            builder.certs(config.tls.load()?)
        } else {
            if tls_node.is_some() {
                tls_provider();
            }
            builder
        };
        if tls_node.is_none() && !config.tls.is_empty() {
            return Err(StoreError::Misconfigured(
                "TLS files were given for plain-text cluster nodes (use clusters:// or rediss:// nodes)"
                    .into(),
            ));
        }
        let client = builder.build().map_err(|e| {
            let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
            // redis-rs says only "did not parse - InvalidClientConfig": name the node.
            if e.kind() == redis::ErrorKind::InvalidClientConfig
                && let Some((i, n)) = nodes
                    .iter()
                    .enumerate()
                    .find(|(_, n)| redis::Client::open(n.as_str()).is_err())
            {
                return StoreError::Misconfigured(format!(
                    "cluster node {} ({}): {}",
                    i + 1,
                    shown[i],
                    crate::secret::what_is_wrong(n)
                ));
            }
            let mut text = e.to_string();
            for n in nodes {
                text = redact_in(&text, n);
            }
            StoreError::Misconfigured(format!("cluster nodes {shown:?}: {text}"))
        })?;
        Ok(Self::Cluster(Box::new(client)))
    }

    fn tls(&self) -> bool {
        match self {
            Self::Single(c) => matches!(
                c.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            ),
            Self::Cluster(_) => false,
            Self::Sentinel { watch, .. } => {
                matches!(watch.first(), Some(redis::ConnectionAddr::TcpTls { .. }))
            }
        }
    }

    /// One attempt to connect, within twice the connect timeout.
    async fn dial(&self, config: &StoreConfig) -> Result<Conn, StoreError> {
        let limit = config.connect_timeout * 2;
        let settings = manager_settings(config);
        let dialled = tokio::time::timeout(limit, async {
            Ok(match self {
                Self::Single(client) => Conn::Single(
                    ConnectionManager::new_with_config(client.clone(), settings).await?,
                ),
                Self::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
                Self::Sentinel {
                    sentinels,
                    watch,
                    certs,
                    service,
                } => {
                    let client = sentinels.lock().await.async_get_client().await?;
                    let conn = ConnectionManager::new_with_config(client, settings.clone()).await?;
                    Conn::Sentinel(SentinelConn::start(
                        Arc::clone(sentinels),
                        watch.clone(),
                        certs.clone(),
                        service.clone(),
                        conn,
                        settings,
                        config.call_timeout,
                    ))
                }
            })
        })
        .await;
        match dialled {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(StoreError::Unavailable(e)),
            Err(_) if self.tls() => Err(StoreError::Misconfigured(format!(
                "no TLS session within {limit:?}: the server may not speak TLS on that port \
                 (rediss:// needs a TLS port; use redis:// for plain text)"
            ))),
            Err(_) => Err(StoreError::Timeout(limit)),
        }
    }
}

impl RedisStore {
    /// Connects to the store `address` names and loads the library:
    /// - `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, or `rediss://…` for TLS: one Redis;
    /// - `cluster://HOST:PORT,HOST:PORT` (or `clusters://…` for TLS): a Redis Cluster, by
    ///   any of its nodes;
    /// - `redis+sentinel://[USER:PASSWORD@]HOST:PORT,HOST:PORT/SERVICE` (or
    ///   `rediss+sentinel://…`): the primary that these Sentinels name for `SERVICE`,
    ///   followed through failovers. The credentials are the data nodes'.
    ///
    /// No error shows the password.
    pub async fn open(address: &str, config: StoreConfig) -> Result<Self, StoreError> {
        let opened = async {
            let dialer = Dialer::new(address, &config)?;
            let store = Self::unconnected(redact(address), config);
            let conn = dialer.dial(&store.config).await?;
            store.connect_with(conn).await?;
            Ok(store)
        };
        opened.await.map_err(|e| redacted(e, address))
    }

    /// Like [`RedisStore::open`], but returns at once, with a store that connects in the
    /// background: until it has connected and loaded the library, every call fails as
    /// `Unavailable` (so each rule's failure policy decides), and it keeps trying,
    /// logging what stops it. A malformed address or a bad TLS file is still an error
    /// here: retrying cannot mend it. Needs a tokio runtime.
    pub fn open_in_background(address: &str, config: StoreConfig) -> Result<Self, StoreError> {
        let dialer = Dialer::new(address, &config).map_err(|e| redacted(e, address))?;
        Ok(Self::in_background(
            dialer,
            redact(address),
            config,
            vec![address.to_owned()],
        ))
    }

    /// [`RedisStore::open_in_background`] for a Redis Cluster reached through `nodes`.
    pub fn cluster_in_background(
        nodes: &[String],
        config: StoreConfig,
    ) -> Result<Self, StoreError> {
        let dialer = Dialer::cluster(nodes, &config)?;
        let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
        Ok(Self::in_background(
            dialer,
            shown.join(","),
            config,
            nodes.to_vec(),
        ))
    }

    /// A store that `dialer` connects in the background; `secrets` are the addresses
    /// whose passwords its log lines must not show.
    fn in_background(
        dialer: Dialer,
        shown: String,
        config: StoreConfig,
        secrets: Vec<String>,
    ) -> Self {
        let store = Self::unconnected(shown, config);
        let weak = Arc::downgrade(&store.link);
        let (loader, config) = (Arc::clone(&store.loader), store.config.clone());
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(100);
            let mut failures = 0u64;
            loop {
                let Some(link) = weak.upgrade() else { return };
                let store = RedisStore {
                    link,
                    loader: Arc::clone(&loader),
                    config: config.clone(),
                };
                let tried = match dialer.dial(&config).await {
                    Ok(conn) => store.connect_with(conn).await,
                    Err(e) => Err(e),
                };
                match tried {
                    Ok(()) if failures == 0 => {
                        tracing::info!(store = %store.link.shown, "store connected");
                        return;
                    }
                    Ok(()) => {
                        tracing::warn!(
                            store = %store.link.shown,
                            after_failures = failures,
                            "store connected; using it from now on"
                        );
                        return;
                    }
                    Err(e) => {
                        failures += 1;
                        // The first failure, then one line every 15 attempts (20-30 s).
                        if failures == 1 || failures.is_multiple_of(15) {
                            let text = secrets.iter().fold(e.to_string(), |t, a| redact_in(&t, a));
                            // Reachable, but not with these credentials: a retry helps
                            // only once the server's or the address's password changes.
                            let what = match &e {
                                StoreError::Unavailable(r)
                                    if r.kind() == redis::ErrorKind::AuthenticationFailed =>
                                {
                                    "store refused the credentials: check the user and \
                                     password of the address"
                                }
                                _ => "store unreachable",
                            };
                            tracing::error!(
                                store = %store.link.shown,
                                error = %text,
                                failures,
                                "{what}; each rule's failure policy decides meanwhile; retrying"
                            );
                        }
                    }
                }
                drop(store);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
        });
        store
    }

    /// Connects to one Redis (`redis://host:port`, `rediss://host:port`) and loads the
    /// library.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self, StoreError> {
        Self::open(url, config).await
    }

    /// Connects to a Redis Cluster through any of its `nodes` and loads the library on
    /// every primary.
    pub async fn connect_cluster(
        nodes: &[String],
        config: StoreConfig,
    ) -> Result<Self, StoreError> {
        let dialer = Dialer::cluster(nodes, &config)?;
        let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
        let store = Self::unconnected(shown.join(","), config);
        let conn = dialer.dial(&store.config).await?;
        store.connect_with(conn).await?;
        Ok(store)
    }

    fn unconnected(shown: String, config: StoreConfig) -> Self {
        Self {
            link: Arc::new(Link {
                conn: std::sync::OnceLock::new(),
                connected: tokio::sync::watch::Sender::new(false),
                refused: arc_swap::ArcSwapOption::empty(),
                shown,
            }),
            loader: Arc::new(Loader {
                generation: AtomicU64::new(0),
                loads: AtomicU64::new(0),
                lock: tokio::sync::Mutex::new(()),
            }),
            config,
        }
    }

    /// Checks `conn` (credentials, then the library) and makes it the store's.
    async fn connect_with(&self, conn: Conn) -> Result<(), StoreError> {
        // A small command first: an unauthenticated client's large FUNCTION LOAD is cut
        // off by Redis as a protocol error, which would hide the missing password.
        if let Err(e) = conn.query(&redis::cmd("PING")).await
            && e.code() == Some("NOAUTH")
        {
            return Err(StoreError::Misconfigured(
                "Redis requires a password (NOAUTH): give it in the URL, \
                 redis://:PASSWORD@HOST:PORT or redis://USER:PASSWORD@HOST:PORT"
                    .into(),
            ));
        }
        self.load_library(&conn).await?;
        if self.link.conn.set(conn).is_err() {
            return Err(StoreError::Misconfigured("store connected twice".into()));
        }
        self.link.connected.send_replace(true);
        Ok(())
    }

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

    /// Why the store is refused, if it is (see [`RedisStore::refuse`]).
    pub fn refused(&self) -> Option<String> {
        self.link.refused.load_full().map(|s| s.as_ref().clone())
    }

    /// Whether the Sentinels are failing the service over now: calls wait for the new
    /// primary (see [`crate::sentinel`]).
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

    /// How many times the library was loaded (once at connect, then once per loss).
    pub fn library_loads(&self) -> u64 {
        self.loader.loads.load(Ordering::Relaxed)
    }

    /// Loads the library unless another caller already did since `seen` generation.
    async fn reload(&self, seen: u64) -> Result<(), StoreError> {
        let _one_at_a_time = self.loader.lock.lock().await;
        if self.loader.generation.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        self.load_library(self.conn()?).await
    }

    #[tracing::instrument(level = "info", name = "library_load", skip_all)]
    async fn load_library(&self, conn: &Conn) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(LIBRARY);
        conn.query(&cmd).await.map_err(classify)?;
        self.loader.loads.fetch_add(1, Ordering::Relaxed);
        self.loader.generation.fetch_add(1, Ordering::Release);
        tracing::info!(
            loads = self.library_loads(),
            "leasehold function library loaded"
        );
        Ok(())
    }

    /// Runs one request on the bucket at `key`, within the call timeout.
    pub async fn call(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
    ) -> Result<Reply, StoreError> {
        self.call_replicated(key, params, req, None).await
    }

    /// [`RedisStore::call`], and for an acquire or exact call with `replication`, a
    /// `WAIT` pipelined behind it (one round trip): a grant that too few replicas
    /// acknowledged in time is [`StoreError::NotReplicated`].
    #[tracing::instrument(
        level = "debug",
        name = "store_call",
        skip_all,
        fields(key = %key.for_logs(), agent = req.agent.0, seq = req.seq)
    )]
    pub async fn call_replicated(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
        replication: Option<Replication>,
    ) -> Result<Reply, StoreError> {
        validate(params, req)?;
        self.not_refused()?;
        let cmd = fcall(key, params, req);
        let wait = replication.filter(|_| matches!(req.op, Op::Acquire { .. } | Op::Exact { .. }));
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, async {
            let seen = self.loader.generation.load(Ordering::Acquire);
            let Some(r) = wait else {
                return parse_value(self.query_loaded(&cmd).await?);
            };
            let mut pipe = redis::pipe();
            pipe.add_command(cmd)
                .cmd("WAIT")
                .arg(r.replicas)
                .arg(r.timeout.as_millis().max(1) as u64);
            let replies = match self.conn()?.query_pipe(&pipe, key.slot()).await {
                Err(e) if is_missing_library(&e) => {
                    self.reload(seen).await?;
                    self.conn()?.query_pipe(&pipe, key.slot()).await
                }
                other => other,
            }
            .map_err(classify)?;
            let mut replies = replies.into_iter();
            let reply =
                parse_value(replies.next().ok_or_else(|| {
                    StoreError::Misconfigured("empty reply to FCALL + WAIT".into())
                })?)?;
            let acked: u64 = replies
                .next()
                .and_then(|v| redis::from_redis_value(v).ok())
                .ok_or_else(|| StoreError::Misconfigured("WAIT gave no count".into()))?;
            if reply.granted > 0 && acked < u64::from(r.replicas) {
                return Err(StoreError::NotReplicated {
                    granted: reply.granted,
                    acked,
                    wanted: r.replicas,
                });
            }
            Ok(reply)
        })
        .await
        .map_err(|_| StoreError::Timeout(limit))?
    }

    /// Runs one exact batch (`lh_exact_batch`) for `agent` with sequence number `seq`,
    /// within the call timeout: one outcome per item. The keys should lie on one node (a
    /// single Redis, or one cluster primary); should the cluster refuse the batch (a slot
    /// moved), it is sent again per slot (each group with its own dedup key). A retry of
    /// the same items with the same `seq` replays (I2).
    pub async fn exact_many(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        validate_batch(seq, items)?;
        self.not_refused()?;
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, async {
            match self.exact_many_once(agent, seq, items).await {
                Err(StoreError::Server { code, .. })
                    if matches!(self.link.conn.get(), Some(Conn::Cluster(_)))
                        && matches!(code.as_str(), "MOVED" | "ASK" | "CROSSSLOT" | "TRYAGAIN") =>
                {
                    self.exact_many_by_slot(agent, seq, items).await
                }
                other => other,
            }
        })
        .await
        .map_err(|_| StoreError::Timeout(limit))?
    }

    async fn exact_many_once(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_exact_batch")
            .arg(items.len() + 1)
            .arg(wire::batch_key(items[0].key, agent, seq));
        for it in items {
            cmd.arg(it.key.as_str());
        }
        cmd.arg(wire::exact_many_args(agent, seq, items));
        let v = self.query_loaded(&cmd).await?;
        let nums = match &v {
            Value::BulkString(b) => wire::unpack_numbers(b),
            _ => None,
        }
        .ok_or_else(|| StoreError::Misconfigured(format!("unexpected reply {v:?}")))?;
        wire::exact_many_reply(&nums, items).ok_or_else(|| {
            StoreError::Misconfigured(format!(
                "unexpected exact batch reply of {} integers for {} keys",
                nums.len(),
                items.len()
            ))
        })
    }

    /// A batch the cluster refused as a whole, sent again as one call per slot.
    async fn exact_many_by_slot(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let slot = it.key.slot();
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, v)) => v.push(i),
                None => slots.push((slot, vec![i])),
            }
        }
        let mut out: Vec<Option<ExactOutcome>> = vec![None; items.len()];
        for (_, idx) in &slots {
            let group: Vec<ExactItem<'_>> = idx.iter().map(|&i| items[i]).collect();
            for (&i, o) in idx
                .iter()
                .zip(self.exact_many_once(agent, seq, &group).await?)
            {
                out[i] = Some(o);
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.unwrap_or(ExactOutcome::Moved))
            .collect())
    }

    /// Runs a call of the function library, loading the library again (once, whoever
    /// notices first) if the store lost it.
    async fn query_loaded(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        let seen = self.loader.generation.load(Ordering::Acquire);
        match self.conn()?.query(cmd).await {
            Err(e) if is_missing_library(&e) => {
                self.reload(seen).await?;
                self.conn()?.query(cmd).await
            }
            other => other,
        }
        .map_err(classify)
    }

    /// Claims or renews one of `seats` seats of `rule`'s local share for `agent`, for
    /// `ttl_us` (`lh_seat`; see [`leasehold_core::local`]), or gives it up (`leave`),
    /// within the call timeout.
    pub async fn claim_seat(
        &self,
        rule: &str,
        agent: AgentId,
        seats: u64,
        ttl_us: u64,
        leave: bool,
    ) -> Result<SeatReply, StoreError> {
        self.not_refused()?;
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("lh_seat")
            .arg(1)
            .arg(leasehold_core::local::seats_key(rule))
            .arg(agent.to_string())
            .arg(seats)
            .arg(ttl_us)
            .arg(u64::from(leave));
        let limit = self.config.call_timeout;
        let v = tokio::time::timeout(limit, self.query_loaded(&cmd))
            .await
            .map_err(|_| StoreError::Timeout(limit))??;
        let r: Vec<u64> = redis::from_redis_value(v.clone())
            .map_err(|_| StoreError::Misconfigured(format!("unexpected lh_seat reply {v:?}")))?;
        match r.as_slice() {
            [1, renewed, ttl_us] => Ok(SeatReply::Held {
                ttl_us: *ttl_us,
                renewed: *renewed == 1,
            }),
            [0, _, retry_us] => Ok(SeatReply::Full {
                retry_us: *retry_us,
            }),
            _ => Err(StoreError::Misconfigured(format!(
                "unexpected lh_seat reply {r:?}"
            ))),
        }
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

    /// Tells the region's broker that agents use `key`, a region's bucket of a global key
    /// (see [`crate::report::WANTED_KEY`]).
    pub async fn announce_region_key(&self, key: &BucketKey) -> Result<(), StoreError> {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut add = redis::cmd("ZADD");
        add.arg(crate::report::WANTED_KEY)
            .arg(at_ms)
            .arg(key.as_str());
        self.query::<i64>(&add).await.map(|_| ())
    }

    /// Replaces `agent`'s report (see [`crate::report`]) and scores it live at `at_ms`.
    pub async fn report(
        &self,
        agent: leasehold_core::model::AgentId,
        at_ms: u64,
        text: &str,
    ) -> Result<(), StoreError> {
        use crate::report::{AGENTS_KEY, REPORT_TTL_MS, report_key};
        let mut set = redis::cmd("SET");
        set.arg(report_key(agent))
            .arg(text)
            .arg("PX")
            .arg(REPORT_TTL_MS);
        self.query::<()>(&set).await?;
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(AGENTS_KEY).arg(at_ms).arg(agent.to_string());
        self.query::<i64>(&zadd).await.map(drop)
    }

    /// The slot ranges of the store's primaries, named `host:port`: one range covering
    /// every slot for a single Redis, `CLUSTER SLOTS` for a cluster.
    pub async fn shards(&self) -> Result<Vec<crate::ShardRange>, StoreError> {
        if let Some(Conn::Single(_) | Conn::Sentinel(_)) = self.link.conn.get() {
            return Ok(vec![(
                0,
                leasehold_core::key::SLOTS - 1,
                "single".to_owned(),
            )]);
        }
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let v = self.conn()?.query(&cmd).await.map_err(classify)?;
        let bad = || StoreError::Misconfigured(format!("unexpected CLUSTER SLOTS reply {v:?}"));
        let Value::Array(entries) = &v else {
            return Err(bad());
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(items) = entry else {
                return Err(bad());
            };
            let (Some(start), Some(end), Some(Value::Array(primary))) =
                (items.first(), items.get(1), items.get(2))
            else {
                return Err(bad());
            };
            let start: u16 = redis::from_redis_value(start.clone()).map_err(|_| bad())?;
            let end: u16 = redis::from_redis_value(end.clone()).map_err(|_| bad())?;
            let (Some(host), Some(port)) = (primary.first(), primary.get(1)) else {
                return Err(bad());
            };
            let host: String = redis::from_redis_value(host.clone()).map_err(|_| bad())?;
            let port: u16 = redis::from_redis_value(port.clone()).map_err(|_| bad())?;
            ranges.push((start, end, format!("{host}:{port}")));
        }
        Ok(ranges)
    }

    /// The hash of one bucket, as stored (empty when the key does not exist), its
    /// remaining time to live in ms (-2 when absent), and the server time in µs: what an
    /// operator's view of the key is built from. One key, no scan.
    pub async fn bucket(
        &self,
        key: &BucketKey,
    ) -> Result<(std::collections::HashMap<String, String>, i64, u64), StoreError> {
        let mut ty = redis::cmd("TYPE");
        ty.arg(key.as_str());
        let ty: String = redis::from_redis_value(self.conn()?.query(&ty).await.map_err(classify)?)
            .map_err(|e| StoreError::Misconfigured(format!("TYPE {key}: {e}")))?;
        let fields = if ty == "string" {
            // A compact bucket: the hash it stands for.
            let mut get = redis::cmd("GET");
            get.arg(key.as_str());
            let v: Option<Vec<u8>> =
                redis::from_redis_value(self.conn()?.query(&get).await.map_err(classify)?)
                    .map_err(|e| StoreError::Misconfigured(format!("bucket {key}: {e}")))?;
            match v {
                // Expired since TYPE.
                None => Default::default(),
                Some(v) => crate::wire::compact_fields(&v)
                    .map(|f| f.into_iter().collect())
                    .ok_or_else(|| {
                        StoreError::Misconfigured(format!(
                            "{key} holds a string that is not a bucket"
                        ))
                    })?,
            }
        } else {
            let mut hgetall = redis::cmd("HGETALL");
            hgetall.arg(key.as_str());
            let fields = self.conn()?.query(&hgetall).await.map_err(classify)?;
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = redis::from_redis_value(fields)
                .map_err(|e| StoreError::Misconfigured(format!("bucket {key}: {e}")))?;
            crate::wire::bucket_fields(&pairs)
                .map(|f| f.into_iter().collect())
                .ok_or_else(|| {
                    StoreError::Misconfigured(format!("{key} holds a hash that is not a bucket"))
                })?
        };
        let mut pttl = redis::cmd("PTTL");
        pttl.arg(key.as_str());
        let ttl: i64 = redis::from_redis_value(self.conn()?.query(&pttl).await.map_err(classify)?)
            .map_err(|e| StoreError::Misconfigured(format!("PTTL {key}: {e}")))?;
        let now = match self
            .conn()?
            .query(&redis::cmd("TIME"))
            .await
            .map_err(classify)?
        {
            Value::Array(v) if v.len() == 2 => {
                let secs: u64 = redis::from_redis_value(v[0].clone()).unwrap_or(0);
                let micros: u64 = redis::from_redis_value(v[1].clone()).unwrap_or(0);
                secs * 1_000_000 + micros
            }
            other => return Err(StoreError::Misconfigured(format!("TIME replied {other:?}"))),
        };
        Ok((fields, ttl, now))
    }

    /// Reads `maxmemory-policy`; bucket keys must not be evicted (a lost bucket resets
    /// its budget), so anything but `noeviction` or a `volatile-*` policy is a warning.
    pub async fn maxmemory_policy(&self) -> Result<String, StoreError> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let v = self.conn()?.query(&cmd).await.map_err(classify)?;
        let found = match v {
            Value::Array(items) => items.get(1).cloned(),
            Value::Map(pairs) => pairs.into_iter().next().map(|(_, v)| v),
            _ => None,
        };
        match found {
            Some(v) => redis::from_redis_value::<String>(v)
                .map_err(|e| StoreError::Misconfigured(format!("maxmemory-policy: {e}"))),
            None => Err(StoreError::Misconfigured(
                "CONFIG GET maxmemory-policy returned nothing".into(),
            )),
        }
    }
}

/// Builds the `FCALL` for `req` (layout in [`crate::wire`]).
pub fn fcall(key: &BucketKey, p: &BucketParams, req: &Request) -> Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(wire::CALL)
        .arg(1)
        .arg(key.as_str())
        .arg(&wire::call_args(p, req)[..]);
    cmd
}

/// Validates an exact batch before it is sent: every key once, every item valid.
pub(crate) fn validate_batch(seq: u64, items: &[ExactItem<'_>]) -> Result<(), StoreError> {
    let mut total = 0;
    let mut keys = std::collections::HashSet::with_capacity(items.len());
    for it in items {
        validate_exact(it.params, seq, it.costs)?;
        total += it.costs.len();
        if !keys.insert(it.key.as_str()) {
            return Err(StoreError::Misconfigured(format!(
                "key {} appears twice in one exact batch",
                it.key.for_logs()
            )));
        }
    }
    if items.is_empty() || total > MAX_BATCH_COSTS {
        return Err(ProtocolError::InvalidArgument {
            what: "count",
            value: total as u64,
        }
        .into());
    }
    Ok(())
}

fn is_missing_library(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// `e` with `address`'s secrets taken out of its text.
fn redacted(e: StoreError, address: &str) -> StoreError {
    match e {
        StoreError::Misconfigured(text) => StoreError::Misconfigured(redact_in(&text, address)),
        other => other,
    }
}

fn classify(e: RedisError) -> StoreError {
    if let Some(code) = e.code()
        && code.starts_with("LH_")
    {
        let detail = e.detail().unwrap_or_default();
        // Redis appends " script: NAME, on @user_function:LINE." to errors from functions.
        let message = truncated(detail.split(" script: ").next().unwrap_or(detail));
        return StoreError::Refused {
            code: code.to_owned(),
            message,
        };
    }
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.code(),
            Some("LOADING" | "CLUSTERDOWN" | "TRYAGAIN" | "MASTERDOWN")
        )
    {
        return StoreError::Unavailable(e);
    }
    if let Some(code) = e.code() {
        return StoreError::Server {
            code: code.to_owned(),
            message: truncated(e.detail().unwrap_or_default()),
        };
    }
    StoreError::Misconfigured(truncated(&e.to_string()))
}

/// An operation's reply: packed (`lh_call`), or an array (the decimal functions).
fn parse_value(v: Value) -> Result<Reply, StoreError> {
    let nums = match &v {
        Value::BulkString(b) => wire::unpack_numbers(b),
        _ => redis::from_redis_value::<Vec<u64>>(v.clone()).ok(),
    }
    .ok_or_else(|| StoreError::Misconfigured(format!("unexpected reply {v:?}")))?;
    match <[u64; wire::REPLY_LEN]>::try_from(nums) {
        Ok(a) => Ok(wire::reply_from_array(a)),
        Err(nums) => Err(StoreError::Misconfigured(format!(
            "unexpected reply {nums:?}; is an older leasehold library loaded?"
        ))),
    }
}

#[cfg(test)]
mod redact_tests {
    use super::*;

    #[test]
    fn connect_errors_carry_no_password() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        for url in [
            "redis://:hunter2-secret@127.0.0.1:notaport",
            "redis://user:hunter2-secret@127.0.0.1:1",
        ] {
            let config = StoreConfig {
                connect_timeout: std::time::Duration::from_millis(200),
                ..StoreConfig::default()
            };
            let text = match rt.block_on(RedisStore::connect(url, config)) {
                Ok(_) => panic!("{} connected", redact(url)),
                Err(e) => e.to_string(),
            };
            assert!(!text.contains("hunter2"), "{text}");
        }
    }
}

#[cfg(all(test, not(feature = "tls")))]
mod no_tls_tests {
    use super::*;

    #[test]
    fn tls_addresses_name_the_missing_feature() {
        let e = client("rediss://:secret@127.0.0.1:1", &TlsFiles::default())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("without its `tls` feature"), "{e}");
        assert!(e.contains("rediss://***@127.0.0.1:1"), "{e}");
        assert!(!e.contains("secret"), "{e}");
    }
}
