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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lease_core::key::BucketKey;
use lease_core::model::{Op, ProtocolError, Reply, Request, validate};
use lease_core::rule::BucketParams;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError, Value};

/// The function library, as shipped.
pub const LIBRARY: &str = include_str!("../../../lua/leasehold.lua");

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
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
    /// The store answered in a way that needs an operator: an unexpected reply, a bad
    /// address.
    #[error("store misconfigured: {0}")]
    Misconfigured(String),
}

/// What kind of store error, as counted in `leasehold_store_errors_by_kind_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
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
    /// Any other error reply or unexpected answer.
    Other,
}

impl ErrorKind {
    /// Every kind, in `repr` order.
    pub const ALL: [ErrorKind; 9] = [
        Self::Timeout,
        Self::Unavailable,
        Self::Offline,
        Self::OutOfMemory,
        Self::NoPermission,
        Self::ReadOnly,
        Self::Refused,
        Self::Protocol,
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

/// Connection settings.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
    /// Bound on one call, reload included.
    pub call_timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            call_timeout: Duration::from_millis(500),
        }
    }
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Self::Single(c) => cmd.query_async(&mut c.clone()).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }
}

struct Loader {
    generation: AtomicU64,
    loads: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

/// A connection to the store that holds the global buckets.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    loader: Arc<Loader>,
    config: StoreConfig,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field(
                "mode",
                &match self.conn {
                    Conn::Single(_) => "single",
                    Conn::Cluster(_) => "cluster",
                },
            )
            .field("library_loads", &self.library_loads())
            .finish()
    }
}

impl RedisStore {
    /// Connects to one Redis (`redis://host:port`) and loads the library.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError::Misconfigured(format!(
                "redis url {:?}: {}",
                redact(url),
                redact_in(&e.to_string(), url)
            ))
        })?;
        let cm = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.call_timeout))
            .set_number_of_retries(1);
        let conn = tokio::time::timeout(
            config.connect_timeout * 2,
            ConnectionManager::new_with_config(client, cm),
        )
        .await
        .map_err(|_| StoreError::Timeout(config.connect_timeout * 2))?
        .map_err(StoreError::Unavailable)?;
        Self::start(Conn::Single(conn), config).await
    }

    /// Connects to a Redis Cluster through any of its `nodes` and loads the library on
    /// every primary.
    pub async fn connect_cluster(
        nodes: &[String],
        config: StoreConfig,
    ) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.call_timeout)
            .retries(3)
            .build()
            .map_err(|e| {
                let mut text = e.to_string();
                for n in nodes {
                    text = redact_in(&text, n);
                }
                let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
                StoreError::Misconfigured(format!("cluster nodes {shown:?}: {text}"))
            })?;
        let conn = tokio::time::timeout(config.connect_timeout * 2, client.get_async_connection())
            .await
            .map_err(|_| StoreError::Timeout(config.connect_timeout * 2))?
            .map_err(StoreError::Unavailable)?;
        Self::start(Conn::Cluster(conn), config).await
    }

    async fn start(conn: Conn, config: StoreConfig) -> Result<Self, StoreError> {
        let store = Self {
            conn,
            loader: Arc::new(Loader {
                generation: AtomicU64::new(0),
                loads: AtomicU64::new(0),
                lock: tokio::sync::Mutex::new(()),
            }),
            config,
        };
        // A small command first: an unauthenticated client's large FUNCTION LOAD is cut
        // off by Redis as a protocol error, which would hide the missing password.
        if let Err(e) = store.conn.query(&redis::cmd("PING")).await
            && e.code() == Some("NOAUTH")
        {
            return Err(StoreError::Misconfigured(
                "Redis requires a password (NOAUTH): give it in the URL, \
                 redis://:PASSWORD@HOST:PORT or redis://USER:PASSWORD@HOST:PORT"
                    .into(),
            ));
        }
        store.reload(0).await?;
        Ok(store)
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
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(LIBRARY);
        self.conn.query(&cmd).await.map_err(classify)?;
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
        validate(params, req)?;
        let cmd = fcall(key, params, req);
        let limit = self.config.call_timeout;
        tokio::time::timeout(limit, async {
            let seen = self.loader.generation.load(Ordering::Acquire);
            match self.conn.query(&cmd).await {
                Err(e) if is_missing_library(&e) => {
                    self.reload(seen).await?;
                    parse(self.conn.query(&cmd).await)
                }
                other => parse(other),
            }
        })
        .await
        .map_err(|_| StoreError::Timeout(limit))?
    }

    /// Runs one plain command (agent reports, the coordinator's reads), bounded by the
    /// call timeout.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        let limit = self.config.call_timeout;
        let v = tokio::time::timeout(limit, self.conn.query(cmd))
            .await
            .map_err(|_| StoreError::Timeout(limit))?
            .map_err(classify)?;
        redis::from_redis_value(v.clone())
            .map_err(|_| StoreError::Misconfigured(format!("unexpected reply {v:?}")))
    }

    /// Replaces `agent`'s report (see [`crate::report`]) and scores it live at `at_ms`.
    pub async fn report(
        &self,
        agent: lease_core::model::AgentId,
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
    pub async fn shards(&self) -> Result<Vec<crate::breaker::ShardRange>, StoreError> {
        if let Conn::Single(_) = self.conn {
            return Ok(vec![(0, lease_core::key::SLOTS - 1, "single".to_owned())]);
        }
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let v = self.conn.query(&cmd).await.map_err(classify)?;
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
        let mut hgetall = redis::cmd("HGETALL");
        hgetall.arg(key.as_str());
        let fields = self.conn.query(&hgetall).await.map_err(classify)?;
        let fields = redis::from_redis_value(fields)
            .map_err(|e| StoreError::Misconfigured(format!("bucket {key}: {e}")))?;
        let mut pttl = redis::cmd("PTTL");
        pttl.arg(key.as_str());
        let ttl: i64 = redis::from_redis_value(self.conn.query(&pttl).await.map_err(classify)?)
            .map_err(|e| StoreError::Misconfigured(format!("PTTL {key}: {e}")))?;
        let now = match self
            .conn
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
        let v = self.conn.query(&cmd).await.map_err(classify)?;
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

/// Builds the `FCALL` for `req` (argument order documented in `lua/leasehold.lua`).
pub fn fcall(key: &BucketKey, p: &BucketParams, req: &Request) -> Cmd {
    let function = match req.op {
        Op::Acquire { .. } => "lh_acquire",
        Op::Release { .. } => "lh_release",
        Op::Exact { .. } => "lh_exact",
        Op::Split { .. } => "lh_split",
    };
    let seed = &p.part;
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(function)
        .arg(1)
        .arg(key.as_str())
        .arg(p.capacity)
        .arg(p.rate.tokens())
        .arg(p.rate.period_us())
        .arg(p.lease_ttl_us)
        .arg(p.grace_us)
        .arg(p.max_outstanding)
        .arg(req.agent.to_string())
        .arg(req.seq)
        .arg(seed.gen_us)
        .arg(seed.until_us)
        .arg(seed.tokens)
        .arg(seed.outstanding)
        .arg(seed.drop_us);
    match req.op {
        Op::Acquire {
            held,
            want,
            min,
            demand,
        } => cmd.arg(held).arg(want).arg(min).arg(demand),
        Op::Release { returned } => cmd.arg(returned),
        Op::Exact { cost } => cmd.arg(cost),
        Op::Split {
            parts,
            salt,
            until_us,
        } => cmd.arg(parts).arg(salt).arg(until_us),
    };
    cmd
}

fn is_missing_library(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
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

fn parse(v: Result<Value, RedisError>) -> Result<Reply, StoreError> {
    let v = v.map_err(classify)?;
    let nums: Vec<u64> = redis::from_redis_value(v.clone())
        .map_err(|_| StoreError::Misconfigured(format!("unexpected reply {v:?}")))?;
    match <[u64; 14]>::try_from(nums) {
        Ok(a) => Ok(Reply::from_array(a)),
        Err(nums) => Err(StoreError::Misconfigured(format!(
            "unexpected reply {nums:?}; is an older leasehold library loaded?"
        ))),
    }
}

/// `url` with its password replaced by `***` (`redis://user:***@host:6379`), for errors
/// and logs: credentials are never echoed.
pub fn redact(url: &str) -> String {
    match password(url) {
        Some((start, end)) => format!("{}***{}", &url[..start], &url[end..]),
        None => url.to_owned(),
    }
}

/// `text` with every occurrence of `url`'s password replaced by `***`.
pub fn redact_in(text: &str, url: &str) -> String {
    match password(url) {
        Some((start, end)) if end > start => text.replace(&url[start..end], "***"),
        _ => text.to_owned(),
    }
}

/// Where the password of `scheme://user:password@host/...` lies, if there is one.
fn password(url: &str) -> Option<(usize, usize)> {
    let after_scheme = url.find("://")? + 3;
    let authority_end = url[after_scheme..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after_scheme + i);
    let at = url[after_scheme..authority_end].rfind('@')? + after_scheme;
    let colon = url[after_scheme..at].find(':')? + after_scheme;
    Some((colon + 1, at))
}

#[cfg(test)]
mod redact_tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/0"),
            "redis://:***@10.0.0.1:6379/0"
        );
        assert_eq!(
            redact("rediss://app:p@ss:w@host:6380"),
            "rediss://app:***@host:6380"
        );
        assert_eq!(redact("redis://app@host"), "redis://app@host");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact("not a url"), "not a url");
        assert_eq!(
            redact_in("failed: s3cret rejected", "redis://:s3cret@h"),
            "failed: *** rejected"
        );
    }

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
