//! Real Redis for tests: `redis-server` processes on free loopback ports, each in its own
//! temporary directory, killed when dropped; and a TCP proxy that injects faults.
//!
//! # Layout
//! - [`RedisServer`]: one node; [`ReplicaPair`]: a primary and a replica that replicates
//!   through a [`FaultProxy`] (so tests can cut replication and lose writes on purpose);
//!   [`Cluster`]: three primaries and three replicas made with `redis-cli --cluster create`.
//! - [`FaultProxy`]: forwards bytes, delays them, drops replies, or swallows everything.
//!
//! If `redis-server` is not installed, starting one fails with an error that says how to
//! install it: a test that needs Redis never skips silently.
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long a node may take to answer PING after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// Why Redis could not be started or driven.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// `redis-server` (or `redis-cli`) is not on the PATH.
    #[error(
        "{0} not found on PATH: install it with `apt-get install redis-server` (Debian/Ubuntu; \
         `scripts/test` does this when it can), or put Redis 7 binaries on the PATH"
    )]
    Missing(&'static str),
    /// The process started but did not become ready.
    #[error("redis-server on port {port} did not become ready: {why}")]
    NotReady {
        /// The port it was started on.
        port: u16,
        /// What was seen.
        why: String,
    },
    /// A command to a node failed.
    #[error("redis command failed: {0}")]
    Redis(#[from] redis::RedisError),
    /// Test certificates could not be made.
    #[error("certificates: {0}")]
    Certs(String),
    /// An I/O error (temp dir, process, socket).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

type Result<T> = std::result::Result<T, HarnessError>;

fn binary(name: &'static str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or(HarnessError::Missing(name))
}

/// A free loopback port; for cluster nodes also `port + 10000` (the cluster bus) is free.
fn free_port(with_bus: bool) -> Result<u16> {
    for _ in 0..200 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if !with_bus {
            return Ok(port);
        }
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    Err(HarnessError::Io(std::io::Error::other(
        "no free loopback port pair found",
    )))
}

/// One `redis-server` process.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    tls_port: Option<u16>,
    dir: tempfile::TempDir,
    args: Vec<String>,
}

impl RedisServer {
    /// A standalone node with no persistence.
    pub fn start() -> Result<Self> {
        Self::start_with(&[])
    }

    /// A node with extra `redis-server` arguments (`["--maxmemory-policy", "allkeys-lru"]`).
    pub fn start_with(extra: &[&str]) -> Result<Self> {
        Self::launch(extra, false)
    }

    /// A node that also serves TLS on [`RedisServer::tls_port`] with `certs`' server
    /// certificate; with `require_client_cert` it refuses TLS clients without a
    /// certificate signed by `certs`' CA. The plain port stays open for the harness.
    pub fn start_tls(certs: &TestCerts, require_client_cert: bool) -> Result<Self> {
        let mut last = None;
        for _ in 0..5 {
            let tls_port = free_port(false)?.to_string();
            let path = |p: &Path| p.to_string_lossy().into_owned();
            let (cert, key, ca) = (
                path(&certs.server_cert),
                path(&certs.server_key),
                path(&certs.ca_cert),
            );
            let auth = if require_client_cert { "yes" } else { "no" };
            let args = [
                "--tls-port",
                &tls_port,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                auth,
            ];
            match Self::launch(&args, false) {
                Ok(mut server) => {
                    server.tls_port = tls_port.parse().ok();
                    return Ok(server);
                }
                Err(e @ HarnessError::NotReady { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(HarnessError::NotReady {
            port: 0,
            why: "could not start".into(),
        }))
    }

    fn launch(extra: &[&str], cluster: bool) -> Result<Self> {
        binary("redis-server")?;
        let mut last = None;
        // A port found free can be taken by another test before redis binds it: retry on
        // a fresh port.
        for _ in 0..5 {
            let mut server = Self {
                child: None,
                port: free_port(cluster)?,
                tls_port: None,
                dir: tempfile::Builder::new()
                    .prefix("leasehold-redis-")
                    .tempdir()?,
                args: extra.iter().map(|s| s.to_string()).collect(),
            };
            server.spawn()?;
            match server.wait_ready() {
                Ok(()) => return Ok(server),
                Err(e @ HarnessError::NotReady { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(HarnessError::NotReady {
            port: 0,
            why: "could not start".into(),
        }))
    }

    fn spawn(&mut self) -> Result<()> {
        let bin = binary("redis-server")?;
        let log = std::fs::File::create(self.dir.path().join("redis.log"))?;
        let child = Command::new(bin)
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = &mut self.child
                && let Some(status) = child.try_wait()?
            {
                return Err(HarnessError::NotReady {
                    port: self.port,
                    why: format!("exited with {status}; log: {}", self.log_tail()),
                });
            }
            // PONG, or NOAUTH from a server started with --requirepass: it answers.
            if let Ok(mut c) = self.connection()
                && match redis::cmd("PING").query::<String>(&mut c) {
                    Ok(_) => true,
                    Err(e) => e.code() == Some("NOAUTH"),
                }
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    port: self.port,
                    why: format!("no PONG within {READY_TIMEOUT:?}; log: {}", self.log_tail()),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
        log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The TLS port, for a node started with [`RedisServer::start_tls`].
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:TLS_PORT`, for a node started with [`RedisServer::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        self.tls_port.map(|p| format!("rediss://127.0.0.1:{p}"))
    }

    /// The node's working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A blocking connection, for test set-up and inspection.
    pub fn connection(&self) -> Result<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        Ok(client.get_connection_with_timeout(Duration::from_secs(2))?)
    }

    /// Runs one command and returns its reply.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> Result<T> {
        let mut c = self.connection()?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        Ok(cmd.query(&mut c)?)
    }

    /// Kills the process (SIGKILL: no clean shutdown, nothing saved).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the node again on the same port after [`RedisServer::kill`]. Its data and
    /// function library are gone, as after a crash without persistence.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()?;
        self.wait_ready()
    }

    /// Freezes the process (SIGSTOP): connections stay open and nothing answers, like a
    /// node stuck in a long command or a swap storm.
    pub fn pause(&self) -> Result<()> {
        self.signal("-STOP")
    }

    /// Thaws a paused process (SIGCONT).
    pub fn resume(&self) -> Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let pid = self
            .child
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| HarnessError::Io(std::io::Error::other("not running")))?;
        let status = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(HarnessError::Io(std::io::Error::other(format!(
                "kill {sig} {pid}: {status}"
            ))))
        }
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A primary and a replica that replicates through a [`FaultProxy`].
#[derive(Debug)]
pub struct ReplicaPair {
    /// The primary.
    pub primary: RedisServer,
    /// The replica.
    pub replica: RedisServer,
    /// Sits between the replica and the primary: blackhole it to lose writes.
    pub link: FaultProxy,
}

impl ReplicaPair {
    /// Starts both and waits until the replica is in sync.
    pub fn start() -> Result<Self> {
        let primary = RedisServer::start()?;
        let link = FaultProxy::start(primary.addr())?;
        let link_port = link.port().to_string();
        let replica = RedisServer::start_with(&[
            "--replicaof",
            "127.0.0.1",
            &link_port,
            "--repl-timeout",
            "60",
        ])?;
        let pair = Self {
            primary,
            replica,
            link,
        };
        pair.wait_synced(Duration::from_secs(15))?;
        Ok(pair)
    }

    /// Waits until the replica's link is up and it has applied everything the primary
    /// sent.
    pub fn wait_synced(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let info: String = self.replica.cmd(&["INFO", "replication"])?;
            let p_info: String = self.primary.cmd(&["INFO", "replication"])?;
            let field = |s: &str, k: &str| {
                s.lines()
                    .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_owned()))
            };
            let up = field(&info, "master_link_status:").as_deref() == Some("up");
            let r_off = field(&info, "slave_repl_offset:");
            let p_off = field(&p_info, "master_repl_offset:");
            if up && r_off.is_some() && r_off == p_off {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    port: self.replica.port(),
                    why: format!("replica not in sync: {info}"),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fails over by hand: kills the primary and promotes the replica.
    pub fn fail_over(&mut self) -> Result<()> {
        self.primary.kill();
        let _: String = self.replica.cmd(&["REPLICAOF", "NO", "ONE"])?;
        Ok(())
    }

    /// After [`ReplicaPair::fail_over`]: starts the old primary again, empty, as a
    /// replica of the promoted one (directly, not through `link`), as an operator or a
    /// Sentinel would, so writes can be acknowledged by a replica again. Returns once the
    /// full sync has begun; it completes in the background.
    pub fn rejoin(&mut self) -> Result<()> {
        self.primary.restart()?;
        // Sync at once instead of waiting 5 s for more replicas to share the transfer.
        let _: String = self
            .replica
            .cmd(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"])?;
        let port = self.replica.port().to_string();
        let _: String = self.primary.cmd(&["REPLICAOF", "127.0.0.1", &port])?;
        Ok(())
    }
}

/// A private CA and, signed by it, a server certificate for `127.0.0.1`, `::1` and
/// `localhost` and a client certificate: PEM files in a temporary directory, made fresh
/// for each test.
#[derive(Debug)]
pub struct TestCerts {
    /// The CA's certificate.
    pub ca_cert: PathBuf,
    /// The server's certificate.
    pub server_cert: PathBuf,
    /// The server's key.
    pub server_key: PathBuf,
    /// A client certificate signed by the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A CA that signed nothing here: trusting it alone must fail.
    pub other_ca_cert: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestCerts {
    /// Generates the CA and both certificates.
    pub fn generate() -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let err = |e: rcgen::Error| HarnessError::Certs(e.to_string());
        let dir = tempfile::Builder::new()
            .prefix("leasehold-certs-")
            .tempdir()?;
        let ca = |name: &str| -> Result<(CertificateParams, KeyPair, String)> {
            let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().map_err(err)?;
            let pem = params.self_signed(&key).map_err(err)?.pem();
            Ok((params, key, pem))
        };
        let (ca_params, ca_key, ca_pem) = ca("leasehold test CA")?;
        let (_, _, other_pem) = ca("leasehold unrelated CA")?;
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |names: Vec<String>, cn: &str| -> Result<(String, String)> {
            let mut params = CertificateParams::new(names).map_err(err)?;
            params.distinguished_name.push(DnType::CommonName, cn);
            let key = KeyPair::generate().map_err(err)?;
            let cert = params.signed_by(&key, &issuer).map_err(err)?;
            Ok((cert.pem(), key.serialize_pem()))
        };
        let (server_pem, server_key) = leaf(
            vec!["127.0.0.1".into(), "::1".into(), "localhost".into()],
            "leasehold test server",
        )?;
        let (client_pem, client_key) = leaf(vec!["client".into()], "leasehold test client")?;
        let write = |name: &str, text: &str| -> Result<PathBuf> {
            let path = dir.path().join(name);
            std::fs::write(&path, text)?;
            Ok(path)
        };
        Ok(Self {
            ca_cert: write("ca.crt", &ca_pem)?,
            server_cert: write("server.crt", &server_pem)?,
            server_key: write("server.key", &server_key)?,
            client_cert: write("client.crt", &client_pem)?,
            client_key: write("client.key", &client_key)?,
            other_ca_cert: write("other-ca.crt", &other_pem)?,
            _dir: dir,
        })
    }
}

/// A primary and a replica (a [`ReplicaPair`]) watched by a Redis Sentinel that
/// monitors them as service [`SentinelSet::SERVICE`], so failovers are real ones:
/// the Sentinel promotes the replica and clients ask it where the primary is.
#[derive(Debug)]
pub struct SentinelSet {
    /// The data nodes.
    pub pair: ReplicaPair,
    sentinel: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    /// The Sentinel's own password, once [`SentinelSet::require_password`] set one.
    password: std::sync::Mutex<Option<String>>,
}

impl SentinelSet {
    /// The service name the Sentinel monitors.
    pub const SERVICE: &'static str = "leasehold";

    /// Starts the pair and the Sentinel and waits until the Sentinel knows the replica.
    pub fn start() -> Result<Self> {
        // Debian ships `redis-sentinel` (package redis-sentinel) as a separate name for
        // the same binary; `redis-server --sentinel` is the same program.
        let (bin, flag) = match binary("redis-sentinel") {
            Ok(b) => (b, None),
            Err(_) => (binary("redis-server")?, Some("--sentinel")),
        };
        let pair = ReplicaPair::start()?;
        let dir = tempfile::Builder::new()
            .prefix("leasehold-sentinel-")
            .tempdir()?;
        let port = free_port(false)?;
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\nprotected-mode no\n\
                 dir {dir}\n\
                 sentinel monitor {s} 127.0.0.1 {p} 1\n\
                 sentinel down-after-milliseconds {s} 1000\n\
                 sentinel failover-timeout {s} 5000\n\
                 sentinel parallel-syncs {s} 1\n",
                dir = dir.path().display(),
                s = Self::SERVICE,
                p = pair.primary.port(),
            ),
        )?;
        let log = std::fs::File::create(dir.path().join("sentinel.log"))?;
        let mut cmd = Command::new(bin);
        cmd.arg(&conf);
        if let Some(f) = flag {
            cmd.arg(f);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let set = Self {
            pair,
            sentinel: Some(child),
            password: std::sync::Mutex::new(None),
            port,
            dir,
        };
        set.wait_ready()?;
        Ok(set)
    }

    fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT * 2;
        loop {
            // The replica must be one the Sentinel may promote: connected, and its link
            // to the primary up as the Sentinel last saw it (else NOGOODSLAVE).
            let known = self
                .cmd::<Vec<std::collections::HashMap<String, String>>>(&[
                    "SENTINEL",
                    "REPLICAS",
                    Self::SERVICE,
                ])
                .map(|replicas| {
                    replicas.iter().any(|r| {
                        r.get("flags").map(String::as_str) == Some("slave")
                            && r.get("master-link-status").map(String::as_str) == Some("ok")
                    })
                })
                .unwrap_or(false);
            if known {
                return Ok(());
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.path().join("sentinel.log"))
                    .unwrap_or_default();
                return Err(HarnessError::NotReady {
                    port: self.port,
                    why: format!(
                        "the Sentinel does not know the replica; log: {}",
                        log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
                    ),
                });
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+sentinel://127.0.0.1:PORT/leasehold`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{}", self.port, Self::SERVICE)
    }

    /// The Sentinel's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs one command on the Sentinel, on a fresh connection; a connection the
    /// Sentinel drops (it can, while it reconfigures during a failover on a busy
    /// machine) is retried for up to 5 s.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> Result<T> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let password = self.password.lock().map(|p| p.clone()).unwrap_or_default();
        loop {
            let mut info = redis::IntoConnectionInfo::into_connection_info(format!(
                "redis://127.0.0.1:{}",
                self.port
            ))?;
            if let Some(pw) = &password {
                let auth = info.redis_settings().clone().set_password(pw);
                info = info.set_redis_settings(auth);
            }
            let client = redis::Client::open(info)?;
            let mut cmd = redis::cmd(args[0]);
            for a in &args[1..] {
                cmd.arg(*a);
            }
            let answer = client
                .get_connection_with_timeout(Duration::from_secs(2))
                .and_then(|mut c| cmd.query(&mut c));
            match answer {
                Err(e)
                    if (e.is_io_error() || e.is_connection_dropped())
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return Ok(other?),
            }
        }
    }

    /// Gives the Sentinel a password of its own (its default user's, `ACL SETUSER`), as
    /// a Sentinel with `requirepass` has; this set's later commands give it.
    pub fn require_password(&self, password: &str) -> Result<()> {
        let _: String = self.cmd(&[
            "ACL",
            "SETUSER",
            "default",
            "on",
            "resetpass",
            &format!(">{password}"),
        ])?;
        if let Ok(mut p) = self.password.lock() {
            *p = Some(password.to_owned());
        }
        Ok(())
    }

    /// The primary's port as the Sentinel names it.
    pub fn primary_port(&self) -> Result<u16> {
        let (_, port): (String, u16) =
            self.cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", Self::SERVICE])?;
        Ok(port)
    }

    /// Has the Sentinel fail over (`SENTINEL FAILOVER`) and waits until it names the
    /// replica as the primary, the replica says it is one, and the old primary has been
    /// made its replica (until then the old primary still takes writes, which the
    /// failover loses: a window every Sentinel failover has).
    pub fn fail_over(&self) -> Result<()> {
        let _: String = self.cmd(&["SENTINEL", "FAILOVER", Self::SERVICE])?;
        let deadline = Instant::now() + READY_TIMEOUT * 2;
        let want = self.pair.replica.port();
        loop {
            // A node changing role closes its clients' connections: a reset here means
            // "not yet", not a failure.
            let role = |node: &RedisServer| -> Option<Vec<u8>> {
                let r: Vec<redis::Value> = node.cmd(&["ROLE"]).ok()?;
                match r.into_iter().next() {
                    Some(redis::Value::BulkString(b)) => Some(b),
                    _ => None,
                }
            };
            let primary = role(&self.pair.replica).as_deref() == Some(b"master");
            let demoted = role(&self.pair.primary).as_deref() == Some(b"slave");
            if primary && demoted && self.primary_port().ok() == Some(want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    port: want,
                    why: "the Sentinel did not promote the replica".into(),
                });
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        if let Some(mut child) = self.sentinel.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A 6-node Redis Cluster: 3 primaries, 3 replicas.
#[derive(Debug)]
pub struct Cluster {
    /// The nodes, in creation order.
    pub nodes: Vec<RedisServer>,
}

/// A node as `CLUSTER NODES` describes it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// Node id.
    pub id: String,
    /// Port.
    pub port: u16,
    /// True for a primary.
    pub primary: bool,
    /// Slot ranges served (primaries).
    pub slots: Vec<(u16, u16)>,
}

impl Cluster {
    /// Starts six nodes, creates the cluster and waits until every node reports it ok.
    pub fn start() -> Result<Self> {
        let cli = binary("redis-cli")?;
        let mut nodes = Vec::new();
        for _ in 0..6 {
            nodes.push(RedisServer::launch(
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    // Replicas sync at once instead of waiting 5 s for company.
                    "--repl-diskless-sync-delay",
                    "0",
                ],
                true,
            )?);
        }
        let out = Command::new(cli)
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(HarnessError::NotReady {
                port: nodes[0].port(),
                why: format!(
                    "redis-cli --cluster create failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(30))?;
        cluster.wait_replicas_synced(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Waits until every replica's link to its primary is up, so writes can be
    /// acknowledged (`WAIT`) and a failover finds a synced replica.
    pub fn wait_replicas_synced(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        for node in &self.nodes {
            loop {
                let info: String = node.cmd(&["INFO", "replication"])?;
                let replica = info.contains("role:slave");
                if !replica || info.contains("master_link_status:up") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(HarnessError::NotReady {
                        port: node.port(),
                        why: format!("replica not in sync: {info}"),
                    });
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Waits until every node says `cluster_state:ok` and sees three primaries with slots
    /// and three replicas.
    pub fn wait_ok(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let mut ok = true;
            for n in &self.nodes {
                let info: String = n.cmd(&["CLUSTER", "INFO"])?;
                ok &= info.contains("cluster_state:ok");
                // Roles converge after slots do: until every node sees three replicas, a
                // replica may still look like an empty primary to its peers.
                let view = Self::parse_nodes(&n.cmd::<String>(&["CLUSTER", "NODES"])?);
                ok &= view
                    .iter()
                    .filter(|i| i.primary && !i.slots.is_empty())
                    .count()
                    == 3;
                ok &= view.iter().filter(|i| !i.primary).count() == 3;
            }
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    port: self.nodes[0].port(),
                    why: "cluster did not reach state ok".into(),
                });
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node list as the first node sees it.
    pub fn topology(&self) -> Result<Vec<NodeInfo>> {
        Ok(Self::parse_nodes(
            &self.nodes[0].cmd::<String>(&["CLUSTER", "NODES"])?,
        ))
    }

    fn parse_nodes(text: &str) -> Vec<NodeInfo> {
        text.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let slots = f
                    .iter()
                    .skip(8)
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| match s.split_once('-') {
                        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                        None => s.parse().ok().map(|x| (x, x)),
                    })
                    .collect();
                Some(NodeInfo {
                    id: f.first()?.to_string(),
                    port,
                    primary: f.get(2)?.contains("master"),
                    slots,
                })
            })
            .collect()
    }

    /// The primary serving `slot`.
    pub fn owner(&self, slot: u16) -> Result<NodeInfo> {
        self.topology()?
            .into_iter()
            .find(|n| n.primary && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .ok_or_else(|| HarnessError::NotReady {
                port: 0,
                why: format!("no primary serves slot {slot}"),
            })
    }

    /// The node process listening on `port`.
    pub fn node(&self, port: u16) -> Option<&RedisServer> {
        self.nodes.iter().find(|n| n.port() == port)
    }

    /// Moves `slot`, with its keys, to another primary (a one-slot resharding); clients
    /// that cached the old owner get `MOVED` on their next call. Returns the new owner.
    pub fn migrate_slot(&self, slot: u16) -> Result<NodeInfo> {
        let src = self.owner(slot)?;
        let dst = self
            .topology()?
            .into_iter()
            .find(|n| n.primary && n.id != src.id && !n.slots.is_empty())
            .ok_or_else(|| HarnessError::NotReady {
                port: 0,
                why: "no other primary".into(),
            })?;
        let (s, d) = (self.require(src.port)?, self.require(dst.port)?);
        let slot_s = slot.to_string();
        let _: String = d.cmd(&["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &src.id])?;
        let _: String = s.cmd(&["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &dst.id])?;
        loop {
            let keys: Vec<String> = s.cmd(&["CLUSTER", "GETKEYSINSLOT", &slot_s, "100"])?;
            if keys.is_empty() {
                break;
            }
            let port = dst.port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let _: String = s.cmd(&args)?;
        }
        for n in self
            .topology()?
            .iter()
            .filter(|n| n.primary && !n.slots.is_empty())
        {
            let _: String = self
                .require(n.port)?
                .cmd(&["CLUSTER", "SETSLOT", &slot_s, "NODE", &dst.id])?;
        }
        Ok(dst)
    }

    fn require(&self, port: u16) -> Result<&RedisServer> {
        self.node(port).ok_or_else(|| HarnessError::NotReady {
            port,
            why: "not a node of this cluster".into(),
        })
    }
}

/// What a [`FaultProxy`] does with the bytes it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward both ways.
    Pass = 0,
    /// Forward requests, swallow replies: the server acts, the client never hears.
    DropReplies = 1,
    /// Swallow everything both ways, keeping connections open.
    Blackhole = 2,
    /// Forward both ways, each chunk 50 ms late.
    Delay = 3,
}

impl Fault {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::DropReplies,
            2 => Self::Blackhole,
            3 => Self::Delay,
            _ => Self::Pass,
        }
    }
}

/// A TCP proxy on a loopback port, in front of `upstream`, whose behaviour a test sets.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    upstream: Arc<Mutex<SocketAddr>>,
    fault: Arc<AtomicU8>,
    /// One-way latency each way, µs (0: none).
    latency_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let fault = Arc::new(AtomicU8::new(Fault::Pass as u8));
        let latency_us = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let upstream = Arc::new(Mutex::new(upstream));
        let (f, s, c, u) = (fault.clone(), stop.clone(), conns.clone(), upstream.clone());
        let l = latency_us.clone();
        thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        let target = match u.lock() {
                            Ok(addr) => *addr,
                            Err(_) => break,
                        };
                        let Ok(server) =
                            TcpStream::connect_timeout(&target, Duration::from_secs(2))
                        else {
                            let _ = client.shutdown(Shutdown::Both);
                            continue;
                        };
                        if let (Ok(c1), Ok(s1)) = (client.try_clone(), server.try_clone())
                            && let Ok(mut list) = c.lock()
                        {
                            list.push(c1);
                            list.push(s1);
                        }
                        pump(&client, &server, f.clone(), l.clone(), false);
                        pump(&server, &client, f.clone(), l.clone(), true);
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Self {
            port,
            upstream,
            fault,
            latency_us,
            stop,
            conns,
        })
    }

    /// Delays every chunk by `one_way` in each direction (a round trip of twice that),
    /// keeping order and letting requests pipeline, as a long link does.
    pub fn set_latency(&self, one_way: Duration) {
        self.latency_us
            .store(one_way.as_micros() as u64, Ordering::SeqCst);
    }

    /// Points new connections at another upstream (a virtual address moving to a promoted
    /// replica); call [`FaultProxy::cut`] to move the open ones too.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        if let Ok(mut u) = self.upstream.lock() {
            *u = upstream;
        }
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sets what happens to bytes from now on.
    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::SeqCst);
    }

    /// Closes every connection it carries (clients see a reset and reconnect).
    pub fn cut(&self) {
        if let Ok(mut list) = self.conns.lock() {
            for s in list.drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.cut();
    }
}

fn pump(
    from: &TcpStream,
    to: &TcpStream,
    fault: Arc<AtomicU8>,
    latency_us: Arc<AtomicU64>,
    is_reply: bool,
) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    // Chunks go to a writer that sends each at its due time, so a latency delays them
    // all alike without holding the next ones back behind a sleep.
    let (tx, rx) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
    thread::spawn(move || {
        while let Ok((due, bytes)) = rx.recv() {
            let now = std::time::Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
    });
    thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut due = std::time::Instant::now()
                + Duration::from_micros(latency_us.load(Ordering::SeqCst));
            match Fault::from_u8(fault.load(Ordering::SeqCst)) {
                Fault::Blackhole => continue,
                Fault::DropReplies if is_reply => continue,
                Fault::Delay => due += Duration::from_millis(50),
                _ => {}
            }
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    });
}
