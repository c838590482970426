//! Reaching a store: addresses (single, Cluster, Sentinel, TLS), dialling, and connecting
//! in the background while the store is down.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::secret::{redact, redact_in};
use crate::sentinel::SentinelConn;

use super::error::{StoreError, redacted};
use super::{Conn, Link, Loader, RedisStore};

/// `scheme://node` for each of the comma-separated `nodes` (`cluster://` addresses). The
/// first node's `USER:PASSWORD@`, if it has one, is every node's that has none: a
/// cluster has one password, written once as a Sentinel address's is
/// (`cluster://:PW@HOST:PORT,HOST:PORT`). An empty node between commas (a typo that
/// would otherwise leave a node out unseen) is refused by its place in the list.
pub fn node_urls(scheme: &str, nodes: &str) -> Result<Vec<String>, StoreError> {
    let list: Vec<&str> = nodes.split(',').collect();
    if list.iter().all(|n| n.is_empty()) {
        return Ok(Vec::new());
    }
    if let Some(i) = list.iter().position(|n| n.is_empty()) {
        return Err(StoreError::Misconfigured(format!(
            "cluster address: node {} of {} is empty (two commas in a row, or one at an end); \
             expected {scheme_name}://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]",
            i + 1,
            list.len(),
            scheme_name = if scheme == "rediss" {
                "clusters"
            } else {
                "cluster"
            },
        )));
    }
    let userinfo = list[0].rsplit_once('@').map(|(u, _)| u.to_owned());
    Ok(list
        .into_iter()
        .map(|n| match &userinfo {
            Some(u) if !n.contains('@') => format!("{scheme}://{u}@{n}"),
            _ => format!("{scheme}://{n}"),
        })
        .collect())
}

#[cfg(test)]
mod node_url_tests {
    use super::node_urls;

    #[test]
    fn the_first_node_s_credentials_are_every_node_s() {
        assert_eq!(
            node_urls("redis", ":pw@h1:1,h2:2,u:other@h3:3").unwrap(),
            [
                "redis://:pw@h1:1",
                "redis://:pw@h2:2",
                "redis://u:other@h3:3"
            ]
        );
        assert_eq!(
            node_urls("rediss", "h1:1,h2:2").unwrap(),
            ["rediss://h1:1", "rediss://h2:2"]
        );
        assert!(node_urls("redis", "").unwrap().is_empty());
        assert!(node_urls("redis", ",").unwrap().is_empty());
    }

    #[test]
    fn an_empty_node_is_refused_by_its_place_and_no_password_is_shown() {
        for (nodes, place) in [
            (":pw@h1:1,,h2:2", "2 of 3"),
            (":pw@h1:1,", "2 of 2"),
            (",h1:1", "1 of 2"),
        ] {
            let e = node_urls("redis", nodes).unwrap_err().to_string();
            assert!(e.contains(&format!("node {place} is empty")), "{e}");
            assert!(e.contains("cluster://"), "{e}");
            assert!(!e.contains("pw"), "{e}");
        }
        let e = node_urls("rediss", "h1:1,,h2:2").unwrap_err().to_string();
        assert!(e.contains("clusters://"), "{e}");
    }
}

pub(super) fn manager_settings(config: &StoreConfig) -> ConnectionManagerConfig {
    // A call made while the connection is down waits for the manager's reconnect: one
    // quick retry, not its default backoff of 100 ms and more. (A store killed outright
    // refuses connections at once, yet each call the breaker let through as a probe
    // waited out its whole timeout, 0.3 s in a gateway and 50 ms in serve: past Envoy's
    // 20 ms, which then failed the request open despite fail_closed. The breaker paces
    // the attempts.)
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.call_timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(1))
        .set_max_delay(Duration::from_millis(5))
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
    pub(super) fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }

    /// Reads the files; an error names the file and what is wrong with it.
    #[cfg(feature = "tls")]
    pub(super) fn load(&self) -> Result<redis::TlsCertificates, StoreError> {
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
pub(super) fn tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err only when a provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The error for an address that asks for TLS when the `tls` feature is off.
#[cfg(not(feature = "tls"))]
pub(super) fn no_tls(address: &str) -> StoreError {
    StoreError::Misconfigured(format!(
        "{address:?} asks for TLS, but leasehold-store was built without its `tls` feature"
    ))
}

/// A client for one node, with the TLS files when the URL asks for TLS.
pub(super) fn client(url: &str, tls: &TlsFiles) -> Result<redis::Client, StoreError> {
    let refused = |why: String| {
        let shown = redact(url);
        StoreError::Misconfigured(if shown.starts_with('<') {
            // Not SCHEME://… at all: the description says so.
            format!("redis url {shown}")
        } else {
            format!("redis url {shown}: {why}")
        })
    };
    // redis-rs says only "did not parse - InvalidClientConfig": say what is wrong.
    let bad = |e: RedisError| {
        refused(if e.kind() == redis::ErrorKind::InvalidClientConfig {
            crate::secret::what_is_wrong(url)
        } else {
            redact_in(&e.to_string(), url)
        })
    };
    // redis-rs takes port 0, an empty port or a host with `$` in it and fails later, as
    // if the store were down: refused here, saying what is wrong.
    if let Some(why) = crate::secret::shape_problem(url) {
        return Err(refused(why));
    }
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

/// How a store is reached. Made from the address at once, so a malformed address or a
/// bad TLS file is refused before anything is dialled; dialled as often as it takes.
pub(super) enum Dialer {
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>),
    Sentinel {
        sentinels: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
        /// The Sentinels' own addresses (and credentials), whose announcements of a
        /// failover are followed.
        watch: Vec<redis::ConnectionInfo>,
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
    pub(super) fn new(address: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        if let Some(nodes) = address.strip_prefix("cluster://") {
            Self::cluster(&node_urls("redis", nodes)?, config)
        } else if let Some(nodes) = address.strip_prefix("clusters://") {
            Self::cluster(&node_urls("rediss", nodes)?, config)
        } else if let Some(rest) = address.strip_prefix("redis+sentinel://") {
            Self::sentinel(false, rest, config)
        } else if let Some(rest) = address.strip_prefix("rediss+sentinel://") {
            Self::sentinel(true, rest, config)
        } else {
            Ok(Self::Single(client(address, &config.tls)?))
        }
    }

    pub(super) fn sentinel(
        tls: bool,
        rest: &str,
        config: &StoreConfig,
    ) -> Result<Self, StoreError> {
        let scheme = if tls {
            "rediss+sentinel"
        } else {
            "redis+sentinel"
        };
        let shown = redact(&format!("{scheme}://{rest}"));
        let bad = |why: &str| {
            StoreError::Misconfigured(format!(
                "sentinel address {shown}: {why}; expected \
                 redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE, the \
                 Sentinels' own credentials in ?sentinel_username and sentinel_password"
            ))
        };
        let (authority, service) = rest.split_once('/').ok_or_else(|| bad("no /SERVICE"))?;
        let (service, query) = match service.split_once('?') {
            Some((s, q)) => (s, Some(q)),
            None => (service, None),
        };
        if service.is_empty() || service.contains(['/', '#']) {
            return Err(bad("the service name is missing or malformed"));
        }
        // The Sentinels' own credentials, when they have a `requirepass` (or ACL users) of
        // their own: the ones before `@` are the data nodes'.
        let mut sentinel_auth = redis::RedisConnectionInfo::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            // A name is echoed only when it looks like a misspelt one: anything else may
            // be a password typed in the wrong place, or the rest of one cut at a raw `&`.
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let known = ["sentinel_username", "sentinel_password"].contains(&name);
            if !known {
                let shown = if name.starts_with("sentinel_") && name.len() <= 24 {
                    format!("`{name}`")
                } else {
                    "(not shown)".to_owned()
                };
                return Err(bad(&format!(
                    "an unknown parameter {shown}: a Sentinel address takes \
                     sentinel_username and sentinel_password, the Sentinels' own \
                     credentials (the primary's go before the @), and a `&` within a value \
                     is written %26"
                )));
            }
            if value.is_empty() {
                return Err(bad(&format!("`{name}` needs a value")));
            }
            if value.contains('#') {
                return Err(bad(&format!(
                    "a `#` in `{name}` must be percent-encoded (%23): it ends the address"
                )));
            }
            if crate::secret::bad_escape(value) {
                return Err(bad(&format!(
                    "a `%` in `{name}` starts an escape of two hex digits (a `%` is %25)"
                )));
            }
            let value = crate::secret::percent_decode(value);
            sentinel_auth = if name == "sentinel_username" {
                sentinel_auth.set_username(&value)
            } else {
                sentinel_auth.set_password(&value)
            };
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
        if let Some(user) = sentinel_auth.username() {
            builder = builder.set_client_to_sentinel_username(user);
        }
        if let Some(password) = sentinel_auth.password() {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(c) = credentials {
            // As in redis:// addresses: percent-encoded, so `?` and `#` written plain are
            // refused (there they end the address).
            if c.contains(['?', '#']) {
                return Err(bad(
                    "a `?` or `#` in the user or password must be percent-encoded (`?` is \
                     %3F, `#` is %23)",
                ));
            }
            let (user, password) = c.split_once(':').unwrap_or((c, ""));
            if !user.is_empty() {
                builder = builder.set_client_to_redis_username(crate::secret::percent_decode(user));
            }
            if !password.is_empty() {
                builder =
                    builder.set_client_to_redis_password(crate::secret::percent_decode(password));
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
        let watch = (sentinels.into_iter())
            .map(|a| {
                redis::IntoConnectionInfo::into_connection_info(a)
                    .map(|i| i.set_redis_settings(sentinel_auth.clone()))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&e.to_string()))?;
        Ok(Self::Sentinel {
            sentinels: Arc::new(tokio::sync::Mutex::new(sentinel)),
            watch,
            certs,
            service: service.to_owned(),
        })
    }

    pub(super) fn cluster(nodes: &[String], config: &StoreConfig) -> Result<Self, StoreError> {
        if nodes.is_empty() {
            return Err(StoreError::Misconfigured(
                "cluster address with no nodes; expected \
                 cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...] (clusters:// for TLS)"
                    .into(),
            ));
        }
        // As for one Redis (`client`): a node redis-rs would take and fail on later.
        if let Some((i, why)) = (nodes.iter().enumerate())
            .find_map(|(i, n)| crate::secret::shape_problem(n).map(|why| (i, why)))
        {
            return Err(StoreError::Misconfigured(format!(
                "cluster node {} ({}): {why}",
                i + 1,
                redact(&nodes[i])
            )));
        }
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

    pub(super) fn tls(&self) -> bool {
        match self {
            Self::Single(c) => matches!(
                c.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            ),
            Self::Cluster(_) => false,
            Self::Sentinel { watch, .. } => {
                matches!(
                    watch.first().map(redis::ConnectionInfo::addr),
                    Some(redis::ConnectionAddr::TcpTls { .. })
                )
            }
        }
    }

    /// One attempt to connect, within twice the connect timeout.
    pub(super) async fn dial(&self, config: &StoreConfig) -> Result<Conn, StoreError> {
        let limit = config.connect_timeout * 2;
        let settings = manager_settings(config);
        let dialled = tokio::time::timeout(limit, async {
            Ok::<_, redis::RedisError>(match self {
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
        // Through Sentinels, a refusal may be theirs or the primary's: a PING to the
        // Sentinels tells which, and the message says where that password goes.
        if let (Ok(Err(e)), Self::Sentinel { watch, .. }) = (&dialled, self)
            && crate::sentinel::auth_refused(e)
        {
            let code = e.code().unwrap_or("WRONGPASS");
            return Err(StoreError::Misconfigured(
                match sentinels_refuse(watch).await {
                    Some(true) => format!(
                        "the Sentinels refused the credentials ({code}): theirs go in \
                     ?sentinel_password=PASSWORD (and sentinel_username=USER), \
                     percent-encoded; the ones before the @ are the primary's"
                    ),
                    Some(false) => format!(
                        "the primary the Sentinels name refused the credentials ({code}): they \
                     go before the @ (redis+sentinel://USER:PASSWORD@HOST:PORT/SERVICE), \
                     percent-encoded; the Sentinels accepted theirs"
                    ),
                    None => format!(
                        "the Sentinels or the primary they name refused the credentials ({code}): \
                     a Sentinel's own password goes in ?sentinel_password=PASSWORD, the \
                     primary's before the @ (both percent-encoded)"
                    ),
                },
            ));
        }
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

/// Whether the Sentinels refuse the credentials the address gives them: `Some(true)` when
/// one answers a PING with an authentication error, `Some(false)` when one answers it, `None`
/// when none answers within a second (or they speak TLS: not probed).
async fn sentinels_refuse(watch: &[redis::ConnectionInfo]) -> Option<bool> {
    for info in watch {
        if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
            return None;
        }
        let probe = async {
            let client = redis::Client::open(info.clone())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        };
        match tokio::time::timeout(Duration::from_secs(1), probe).await {
            Ok(Ok(_)) => return Some(false),
            Ok(Err(e)) if crate::sentinel::auth_refused(&e) => return Some(true),
            _ => {}
        }
    }
    None
}

impl RedisStore {
    /// Connects to the store `address` names and loads the library:
    /// - `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, or `rediss://…` for TLS: one Redis;
    /// - `cluster://HOST:PORT,HOST:PORT` (or `clusters://…` for TLS): a Redis Cluster, by
    ///   any of its nodes;
    /// - `redis+sentinel://[USER:PASSWORD@]HOST:PORT,HOST:PORT/SERVICE` (or
    ///   `rediss+sentinel://…`): the primary that these Sentinels name for `SERVICE`,
    ///   followed through failovers. The credentials are the data nodes'; Sentinels with
    ///   a password of their own take `?sentinel_password=…` (and `sentinel_username=…`).
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
    pub(super) fn in_background(
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
                            // Reachable too: the address names a database it lacks.
                            _ if text.contains("DB index is out of range") => {
                                "store has no such database: check the /DB of the address \
                                 (0 to its `databases` setting less one, 0-15 by default)"
                            }
                            // Reachable, and it wants a password the address lacks.
                            StoreError::Misconfigured(m) if m.contains("(NOAUTH)") => {
                                "store wants a password the address does not give"
                            }
                            // Through Sentinels: they, or the primary, refused it.
                            StoreError::Misconfigured(m) if m.contains("(WRONGPASS)") => {
                                "store refused the credentials: check the user and \
                                 password of the address"
                            }
                            // Reachable, but not the kind of Redis the address says.
                            _ if text.contains("cluster support disabled") => {
                                "store is not a Redis Cluster: cluster:// needs one (one Redis \
                                 is redis://HOST:PORT)"
                            }
                            StoreError::Unavailable(r)
                                if r.kind() == redis::ErrorKind::MasterNameNotFoundBySentinel =>
                            {
                                "store's Sentinels monitor no such service: check the \
                                 /SERVICE of the address (the NAME of `sentinel monitor NAME`)"
                            }
                            _ => "store unreachable",
                        };
                        store
                            .link
                            .not_reached
                            .store(Some(Arc::new(format!("{what} ({text})"))));
                        // The first failure, then one line every 15 attempts (20-30 s).
                        if failures == 1 || failures.is_multiple_of(15) {
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

    pub(super) fn unconnected(shown: String, config: StoreConfig) -> Self {
        Self {
            link: Arc::new(Link {
                conn: std::sync::OnceLock::new(),
                connected: tokio::sync::watch::Sender::new(false),
                refused: arc_swap::ArcSwapOption::empty(),
                not_reached: arc_swap::ArcSwapOption::empty(),
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
    pub(super) async fn connect_with(&self, conn: Conn) -> Result<(), StoreError> {
        // A small command first: an unauthenticated client's large FUNCTION LOAD is cut
        // off by Redis as a protocol error, which would hide the missing password.
        if let Err(e) = conn.query(&redis::cmd("PING")).await
            && e.code() == Some("NOAUTH")
        {
            return Err(StoreError::Misconfigured(
                "Redis requires a password (NOAUTH): give it in the URL, \
                 redis://:PASSWORD@HOST:PORT or redis://USER:PASSWORD@HOST:PORT \
                 (redis://WORD@HOST:PORT, without the colon, names a user and no password)"
                    .into(),
            ));
        }
        self.ensure_library(&conn).await?;
        if self.link.conn.set(conn).is_err() {
            return Err(StoreError::Misconfigured("store connected twice".into()));
        }
        self.link.connected.send_replace(true);
        Ok(())
    }
}
