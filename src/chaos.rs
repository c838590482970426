//! `leasehold chaos`: the fault matrix under load, against the processes operators run.
//!
//! Four topologies, each driven the same way (one hot tenant at 3x its limit, 200 cold
//! tenants), one fault at a time: each holds for a while, is cleared, and is watched
//! until the end of its phase.
//!
//! 1. The example gateway on a private primary and replica (behind a TCP proxy that a
//!    promotion moves), with the coordinator, under an open-file limit of 256: started
//!    while the primary is down, then kill -9, SIGSTOP, FUNCTION FLUSH, OOM, an evicting
//!    policy, clients hanging up mid-probe, the coordinator killed, idle sockets past the
//!    file limit, a flood of distinct keys, a promotion.
//! 2. The gateway through a Sentinel (`redis+sentinel://`): a planned `SENTINEL FAILOVER`.
//! 3. The gateway on a 6-node Redis Cluster: `CLUSTER FAILOVER` on the replica of the
//!    hot tenant's primary.
//! 4. `leasehold serve` with its embedded store, over gRPC: a flood of distinct
//!    descriptor values, then an idle watch (its memory must stay flat).
//!
//! One table row per fault:
//!
//! - max latency: the slowest answer in the phase (the decision plus HTTP or gRPC on
//!   loopback), against the rule's timeout + 10 ms;
//! - statuses: shares of 200, 429, 503 and transport errors (gRPC: OK, OVER_LIMIT,
//!   UNAVAILABLE);
//! - recovered: from clearing the fault to the last 503 or error the load saw ("never"
//!   when they go on to the end of the phase);
//! - overshoot: tokens the hot tenant was admitted beyond B + r x phase length;
//! - RSS: the serving process's largest resident set in the phase.
//!
//! At the end, an application key planted before the run is checked unchanged, and every
//! key in Redis is checked to be Leasehold's.

use std::cell::{Cell, RefCell};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use leasehold_redis_harness::{Cluster, FaultProxy, ReplicaPair, SentinelSet};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// One of the topologies the matrix runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Topology {
    /// The example gateway on a primary and replica, with the coordinator.
    Gateway,
    /// The gateway through a Sentinel.
    Sentinel,
    /// The gateway on a 6-node Redis Cluster.
    Cluster,
    /// `leasehold serve` with its embedded store, over gRPC.
    Serve,
}

/// What to run.
pub(crate) struct Options {
    /// The example gateway's binary.
    pub(crate) gateway: PathBuf,
    /// Distinct API keys the flood sends to the gateway.
    pub(crate) flood_keys: u64,
    /// Distinct descriptor values the flood sends to `leasehold serve`.
    pub(crate) serve_values: u64,
    /// The topologies to run.
    pub(crate) only: Vec<Topology>,
    /// How long serve is watched, idle of the flood, after it.
    pub(crate) idle: Duration,
    /// How long each fault holds before it is cleared.
    pub(crate) hold: Duration,
    /// How long each phase watches after clearing.
    pub(crate) watch: Duration,
}

const CAPACITY: u64 = 200;
const RATE: u64 = 200;
const HOT_RPS: u64 = 600;
const COLD_RPS: u64 = 100;
const TIMEOUT_MS: u64 = 50;
const RULES: &str = "[rules.chaos]\ncapacity = 200\nrate = \"200/s\"\ntimeout = \"50ms\"\n\
                     on_failure = \"fail_closed\"\n";
const PLANTED: &str = "app:user:1";
/// The gateway's open-file limit: small enough that the fd phase reaches it.
const GATEWAY_FDS: u32 = 256;
/// Idle sockets the fd phase opens, past the gateway's open-file limit.
const IDLE_SOCKETS: usize = 300;
/// serve's configuration: `tenant` as the gateway's rule, `value` for the flood (a
/// metric series per value, up to the cap).
const SERVE_CONFIG: &str = "domain: chaos
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 200}
  - key: value
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 10}
";

/// One answer the load saw.
#[derive(Clone, Copy)]
struct Sample {
    at_us: u64,
    latency_us: u64,
    /// HTTP status, 0 for a transport error.
    status: u16,
    hot: bool,
}

struct Recorder {
    start: Instant,
    samples: Mutex<Vec<Sample>>,
    stop: AtomicBool,
    rss_kb: Mutex<Vec<(u64, u64)>>,
}

impl Recorder {
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Records an answer to a request sent at `at_us`.
    fn push(&self, at_us: u64, status: u16, hot: bool) {
        let latency_us = self.now_us() - at_us;
        self.samples.lock().push(Sample {
            at_us,
            latency_us,
            status,
            hot,
        });
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` and waits for a stdout line starting with `prefix`; returns the rest.
fn spawn_until(mut cmd: Command, prefix: &str, what: &str) -> Result<(Proc, String), String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("start {what}: {e}"))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let err = child.stderr.take().ok_or("no stderr")?;
    let mut proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    let prefix = prefix.to_owned();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix(&prefix) {
                let _ = tx.send(rest.trim().to_owned());
            }
        }
    });
    // The last lines of its log, for an error if it never starts (read all along, so
    // a chatty process never blocks on a full pipe).
    let log = Arc::new(Mutex::new(std::collections::VecDeque::new()));
    {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                let mut log = log.lock();
                if log.len() == 5 {
                    log.pop_front();
                }
                log.push_back(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(rest) = rx.recv_timeout(Duration::from_millis(100)) {
            return Ok((proc, rest));
        }
        let exited = proc.0.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() > deadline {
            std::thread::sleep(Duration::from_millis(100));
            let tail: Vec<String> = log.lock().iter().cloned().collect();
            return Err(format!(
                "{what} {}: {}",
                match exited {
                    Some(status) => format!("exited ({status})"),
                    None => "did not start within 20 s".into(),
                },
                tail.join(" | ")
            ));
        }
    }
}

fn coordinator(redis: &str, rules: &Path) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["coordinator", "--redis", redis, "--listen", "127.0.0.1:0"])
        .arg("--config")
        .arg(rules);
    Ok(spawn_until(cmd, "coordinator admin endpoint on ", "the coordinator")?.0)
}

/// One keep-alive HTTP/1.1 exchange; the status, or None when the connection failed.
async fn get(conn: &mut Option<TcpStream>, addr: SocketAddr, key: &str) -> Option<u16> {
    if conn.is_none() {
        *conn = TcpStream::connect(addr).await.ok();
        if let Some(c) = conn.as_ref() {
            let _ = c.set_nodelay(true);
        }
    }
    let c = conn.as_mut()?;
    let req = format!("GET / HTTP/1.1\r\nHost: gw\r\nx-api-key: {key}\r\n\r\n");
    let status = exchange(c, req.as_bytes()).await;
    if status.is_none() {
        *conn = None;
    }
    status
}

async fn exchange(c: &mut TcpStream, req: &[u8]) -> Option<u16> {
    c.write_all(req).await.ok()?;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = c.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut have = buf.len() - head_end;
    while have < length {
        let n = c.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        have += n;
    }
    Some(status)
}

/// Where the load goes.
#[derive(Clone)]
enum Target {
    /// The example gateway: `GET /` with `x-api-key: VALUE`.
    Http(SocketAddr),
    /// `leasehold serve`: `ShouldRateLimit` in domain `chaos` for (KEY, VALUE).
    Grpc(RateLimitServiceClient<Channel>),
}

impl Target {
    /// One decision, as HTTP would say it (200, 429, 503), or None when the call failed.
    async fn ask(&mut self, conn: &mut Option<TcpStream>, key: &str, value: &str) -> Option<u16> {
        match self {
            Self::Http(addr) => get(conn, *addr, value).await,
            Self::Grpc(client) => {
                let req = RateLimitRequest {
                    domain: "chaos".into(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: key.into(),
                            value: value.into(),
                        }],
                        ..RateLimitDescriptor::default()
                    }],
                    hits_addend: 0,
                };
                match client.should_rate_limit(req).await {
                    Ok(r) => Some(match r.into_inner().overall_code {
                        c if c == Code::Ok as i32 => 200,
                        c if c == Code::OverLimit as i32 => 429,
                        _ => 503,
                    }),
                    Err(s) if s.code() == tonic::Code::Unavailable => Some(503),
                    Err(_) => None,
                }
            }
        }
    }
}

/// Sends `rps` requests per second over one connection (HTTP) or channel (gRPC), for
/// descriptor key `tenant` and values from `value`.
fn load(
    rec: Arc<Recorder>,
    mut target: Target,
    rps: u64,
    hot: bool,
    value: impl Fn(u64) -> String + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rps));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut conn = None;
        let mut n = 0;
        while !rec.stop.load(Ordering::Relaxed) {
            tick.tick().await;
            n += 1;
            let at = rec.now_us();
            let status = target
                .ask(&mut conn, "tenant", &value(n))
                .await
                .unwrap_or(0);
            rec.push(at, status, hot);
        }
    })
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The figures of one phase.
struct Row {
    fault: &'static str,
    max_latency_ms: f64,
    shares: [f64; 4],
    recovered: Option<f64>,
    overshoot: f64,
    rss_mb: f64,
    requests: usize,
}

fn row(rec: &Recorder, fault: &'static str, from_us: u64, cleared_us: u64, to_us: u64) -> Row {
    let samples: Vec<Sample> = rec
        .samples
        .lock()
        .iter()
        .filter(|s| s.at_us >= from_us && s.at_us < to_us)
        .copied()
        .collect();
    let n = samples.len().max(1) as f64;
    let share = |f: &dyn Fn(u16) -> bool| samples.iter().filter(|s| f(s.status)).count() as f64 / n;
    let bad = |s: &Sample| s.status == 0 || s.status == 503;
    let last_bad = samples
        .iter()
        .filter(|s| bad(s))
        .map(|s| s.at_us + s.latency_us)
        .max();
    // Not recovered if the last second of the phase still saw failures.
    let recovered = match last_bad {
        None => Some(0.0),
        Some(t) if t + 1_000_000 > to_us => None,
        Some(t) => Some(t.saturating_sub(cleared_us) as f64 / 1000.0),
    };
    let admitted_hot = samples.iter().filter(|s| s.hot && s.status == 200).count() as f64;
    let bound = CAPACITY as f64 + RATE as f64 * (to_us - from_us) as f64 / 1e6;
    let rss = rec
        .rss_kb
        .lock()
        .iter()
        .filter(|(t, _)| *t >= from_us && *t < to_us)
        .map(|(_, kb)| *kb)
        .max()
        .unwrap_or(0);
    Row {
        fault,
        max_latency_ms: samples.iter().map(|s| s.latency_us).max().unwrap_or(0) as f64 / 1000.0,
        shares: [
            share(&|s| s == 200),
            share(&|s| s == 429),
            share(&|s| s == 503),
            share(&|s| s != 200 && s != 429 && s != 503),
        ],
        recovered,
        overshoot: (admitted_hot - bound).max(0.0),
        rss_mb: rss as f64 / 1024.0,
        requests: samples.len(),
    }
}

/// The load on one serving process, and its figures.
struct Stage {
    rec: Arc<Recorder>,
    tasks: Vec<JoinHandle<()>>,
    watch: Duration,
}

impl Stage {
    /// Starts the load (the hot tenant at 3x its limit over six connections, the cold
    /// tenants over two) and samples `pid`'s resident set every 100 ms. On the runtime.
    fn drive(target: &Target, pid: u32, watch: Duration) -> Self {
        let rec = Arc::new(Recorder {
            start: Instant::now(),
            samples: Mutex::new(Vec::with_capacity(1 << 20)),
            stop: AtomicBool::new(false),
            rss_kb: Mutex::new(Vec::new()),
        });
        let mut tasks = Vec::new();
        for _ in 0..6 {
            tasks.push(load(rec.clone(), target.clone(), HOT_RPS / 6, true, |_| {
                "tenant-hot".into()
            }));
        }
        for c in 0..2u64 {
            tasks.push(load(
                rec.clone(),
                target.clone(),
                COLD_RPS / 2,
                false,
                move |n| format!("tenant-{}", (n * 2 + c) % 200),
            ));
        }
        let sampler = rec.clone();
        tasks.push(tokio::spawn(async move {
            while !sampler.stop.load(Ordering::Relaxed) {
                let t = sampler.now_us();
                sampler.rss_kb.lock().push((t, rss_kb(pid)));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
        Self { rec, tasks, watch }
    }

    /// One fault: `apply`, hold, `clear`, watch; its row goes to `rows`.
    fn phase(
        &self,
        rows: &mut Vec<Row>,
        name: &'static str,
        apply: &dyn Fn() -> Result<(), String>,
        clear: &dyn Fn() -> Result<(), String>,
        hold: Duration,
    ) -> Result<(), String> {
        eprintln!("chaos: {name}");
        let from = self.rec.now_us();
        apply()?;
        std::thread::sleep(hold);
        clear()?;
        let cleared = self.rec.now_us();
        std::thread::sleep(self.watch);
        rows.push(row(&self.rec, name, from, cleared, self.rec.now_us()));
        Ok(())
    }

    fn stop(self, rt: &Runtime) {
        self.rec.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = rt.block_on(t);
        }
    }
}

fn nothing() -> Result<(), String> {
    Ok(())
}

fn harness(e: leasehold_redis_harness::HarnessError) -> String {
    e.to_string()
}

/// The example gateway on `redis` with the chaos rule, under an open-file limit of
/// `fds` when given; its address.
fn gateway(
    exe: &Path,
    redis: &str,
    rules: &Path,
    fds: Option<u32>,
) -> Result<(Proc, SocketAddr), String> {
    let mut cmd = match fds {
        Some(n) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                .arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--redis",
        redis,
        "--rule",
        "chaos",
    ])
    .arg("--config")
    .arg(rules);
    let (proc, addr) = spawn_until(cmd, "listening on ", "the gateway")?;
    let addr = addr.parse().map_err(|e| format!("gateway address: {e}"))?;
    Ok((proc, addr))
}

/// Runs the matrix and prints the table.
pub(crate) fn run(opts: Options) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let _guard = rt.enter();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, RULES).map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    let run = |t| opts.only.contains(&t);
    let planted = match run(Topology::Gateway) {
        true => Some(gateway_matrix(&rt, &opts, &rules, &mut rows)?),
        false => None,
    };
    if run(Topology::Sentinel) {
        sentinel_failover(&rt, &opts, &rules, &mut rows)?;
    }
    if run(Topology::Cluster) {
        cluster_failover(&rt, &opts, &rules, &mut rows)?;
    }
    let serve_rss = match run(Topology::Serve) {
        true => Some(serve_flood(&rt, &opts, dir.path(), &mut rows)?),
        false => None,
    };

    let (hold, watch) = (opts.hold, opts.watch);
    println!(
        "\nfault matrix: rule capacity {CAPACITY}, rate {RATE}/s, timeout {TIMEOUT_MS} ms, \
         fail_closed; load {HOT_RPS} req/s on one tenant + {COLD_RPS} req/s over 200 \
         tenants; each fault held {:.1} s, then watched {:.1} s; the gateway's open-file \
         limit {GATEWAY_FDS}",
        hold.as_secs_f64(),
        watch.as_secs_f64()
    );
    println!(
        "| fault | requests | max latency ms | 200 / 429 / 503 / error | recovered after clearing (ms) | overshoot (tokens) | RSS MB |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1}% / {:.1}% / {:.1}% / {:.1}% | {} | {:.0} | {:.1} |",
            r.fault,
            r.requests,
            r.max_latency_ms,
            r.shares[0] * 100.0,
            r.shares[1] * 100.0,
            r.shares[2] * 100.0,
            r.shares[3] * 100.0,
            r.recovered
                .map_or("never".to_owned(), |ms| format!("{ms:.0}")),
            r.overshoot,
            r.rss_mb
        );
    }
    if let Some(rss) = serve_rss {
        println!(
            "\nserve's RSS: {:.1} MB before the flood of {} values, {:.1} MB at a third of \
             it, {:.1} MB at its end, {:.1} MB after {:.0} s without it",
            rss.before,
            opts.serve_values,
            rss.third,
            rss.end,
            rss.idle,
            opts.idle.as_secs_f64(),
        );
    }
    if let Some((planted_ok, foreign)) = planted {
        println!(
            "planted application key {PLANTED}: {}; keys in Redis that are not Leasehold's: {}",
            if planted_ok { "unchanged" } else { "CHANGED" },
            foreign.len()
        );
        if !planted_ok || !foreign.is_empty() {
            return Err(format!("writes reached foreign keys: {foreign:?}"));
        }
    }
    Ok(())
}

/// The example gateway and the coordinator on a primary and replica: every fault but the
/// failovers of the other topologies. Whether the planted key came through unchanged,
/// and the keys that are not Leasehold's.
fn gateway_matrix(
    rt: &Runtime,
    opts: &Options,
    rules: &Path,
    rows: &mut Vec<Row>,
) -> Result<(bool, Vec<String>), String> {
    let h = harness;
    eprintln!("chaos: a primary, its replica, the coordinator and the gateway, the primary down");
    let pair = ReplicaPair::start().map_err(h)?;
    let vip = FaultProxy::start(pair.primary.addr()).map_err(h)?;
    let pair = RefCell::new(pair);
    // Both start while the store is down, as after a power cut.
    pair.borrow_mut().primary.kill();
    let coord = RefCell::new(Some(coordinator(&vip.url(), rules)?));
    let (gateway, addr) = gateway(&opts.gateway, &vip.url(), rules, Some(GATEWAY_FDS))?;
    let stage = Stage::drive(&Target::Http(addr), gateway.0.id(), opts.watch);
    let hold = opts.hold;
    let primary = |args: &[&str]| -> Result<(), String> {
        pair.borrow()
            .primary
            .cmd::<redis::Value>(args)
            .map(|_| ())
            .map_err(h)
    };
    stage.phase(
        rows,
        "start during an outage",
        &nothing,
        &|| pair.borrow_mut().primary.restart().map_err(h),
        hold,
    )?;
    primary(&["HSET", PLANTED, "name", "ada", "plan", "pro"])?;
    stage.phase(rows, "none (baseline)", &nothing, &nothing, hold)?;
    // kill -9, then a restart (empty, as without persistence).
    stage.phase(
        rows,
        "kill -9 + restart (empty)",
        &|| {
            pair.borrow_mut().primary.kill();
            Ok(())
        },
        &|| pair.borrow_mut().primary.restart().map_err(h),
        hold,
    )?;
    // The restart emptied the node: the application key goes back in.
    primary(&["HSET", PLANTED, "name", "ada", "plan", "pro"])?;
    stage.phase(
        rows,
        "SIGSTOP + SIGCONT",
        &|| pair.borrow().primary.pause().map_err(h),
        &|| pair.borrow().primary.resume().map_err(h),
        hold,
    )?;
    stage.phase(
        rows,
        "FUNCTION FLUSH",
        &|| primary(&["FUNCTION", "FLUSH"]),
        &nothing,
        Duration::ZERO,
    )?;
    stage.phase(
        rows,
        "OOM (`maxmemory 1`), then cleared",
        &|| primary(&["CONFIG", "SET", "maxmemory", "1"]),
        &|| primary(&["CONFIG", "SET", "maxmemory", "0"]),
        hold,
    )?;
    stage.phase(
        rows,
        "maxmemory-policy allkeys-lru",
        &|| primary(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]),
        &|| primary(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        hold,
    )?;
    // Clients that hang up while their checks wait: the shard is frozen long enough to
    // open the breaker, and the probes after it are abandoned mid-call.
    let abandon = Arc::new(AtomicBool::new(true));
    let abandoned = Arc::new(AtomicU64::new(0));
    let quitters = {
        let (abandon, abandoned) = (abandon.clone(), abandoned.clone());
        tokio::spawn(async move {
            while abandon.load(Ordering::Relaxed) {
                let k = abandoned.load(Ordering::Relaxed);
                let abandoned = abandoned.clone();
                tokio::spawn(async move {
                    if let Ok(mut c) = TcpStream::connect(addr).await {
                        let req = format!(
                            "GET / HTTP/1.1\r\nHost: gw\r\nx-api-key: quitter-{}\r\n\r\n",
                            k % 50
                        );
                        let _ = c.write_all(req.as_bytes()).await;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        abandoned.fetch_add(1, Ordering::Relaxed);
                    }
                });
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    // The hang-ups go on through the watch, so the probes after SIGCONT are abandoned too.
    stage.phase(
        rows,
        "clients hang up mid-probe",
        &|| pair.borrow().primary.pause().map_err(h),
        &|| pair.borrow().primary.resume().map_err(h),
        Duration::from_secs(1),
    )?;
    abandon.store(false, Ordering::Relaxed);
    let _ = rt.block_on(quitters);
    eprintln!(
        "chaos:   {} requests abandoned",
        abandoned.load(Ordering::Relaxed)
    );
    stage.phase(
        rows,
        "coordinator kill -9 + restart",
        &|| {
            coord.borrow_mut().take();
            Ok(())
        },
        &|| {
            *coord.borrow_mut() = Some(coordinator(&vip.url(), rules)?);
            Ok(())
        },
        hold,
    )?;
    // Idle sockets past the gateway's open-file limit, while a prober opens a new
    // connection for each request (the load's connections are open already).
    let idle = RefCell::new(Vec::new());
    let probing = Arc::new(AtomicBool::new(true));
    let prober = {
        let (rec, probing) = (stage.rec.clone(), probing.clone());
        tokio::spawn(async move {
            let (mut n, mut failed) = (0u64, 0u64);
            while probing.load(Ordering::Relaxed) {
                n += 1;
                let at = rec.now_us();
                let mut conn = None;
                let status = get(&mut conn, addr, &format!("tenant-{}", n % 200))
                    .await
                    .unwrap_or(0);
                failed += u64::from(status == 0);
                rec.push(at, status, false);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (n, failed)
        })
    };
    stage.phase(
        rows,
        "fd exhaustion (300 idle sockets)",
        &|| {
            let mut held = idle.borrow_mut();
            for _ in 0..IDLE_SOCKETS {
                if let Ok(s) = std::net::TcpStream::connect(addr) {
                    held.push(s);
                }
            }
            Ok(())
        },
        &|| {
            idle.borrow_mut().clear();
            Ok(())
        },
        hold,
    )?;
    probing.store(false, Ordering::Relaxed);
    if let Ok((n, failed)) = rt.block_on(prober) {
        eprintln!("chaos:   {failed} of {n} new connections refused (the gateway at its cap)");
    }
    // Distinct API keys as fast as four connections send them, beside the load.
    let total = opts.flood_keys;
    let flood = || {
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let flooding: Vec<_> = (0..4)
            .map(|_| {
                let sent = sent.clone();
                tokio::spawn(async move {
                    let mut conn = None;
                    loop {
                        let n = sent.fetch_add(1, Ordering::Relaxed);
                        if n >= total {
                            break;
                        }
                        let _ = get(&mut conn, addr, &format!("flood-{n}")).await;
                    }
                })
            })
            .collect();
        for f in flooding {
            let _ = rt.block_on(f);
        }
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "chaos:   {total} keys in {secs:.0} s ({:.0}/s); gateway RSS now {:.1} MB",
            total as f64 / secs,
            rss_kb(gateway.0.id()) as f64 / 1024.0
        );
        Ok(())
    };
    let flood_name = if total == 1_000_000 {
        "1M-key flood"
    } else {
        "key flood"
    };
    stage.phase(rows, flood_name, &flood, &nothing, Duration::ZERO)?;
    let planted: std::collections::HashMap<String, String> = pair
        .borrow()
        .primary
        .cmd(&["HGETALL", PLANTED])
        .map_err(h)?;
    stage.phase(
        rows,
        "replica promoted",
        &|| {
            let mut p = pair.borrow_mut();
            p.fail_over().map_err(h)?;
            vip.set_upstream(p.replica.addr());
            vip.cut();
            Ok(())
        },
        &|| pair.borrow_mut().rejoin().map_err(h),
        hold,
    )?;
    stage.stop(rt);
    // The promoted replica holds everything now.
    let keys: Vec<String> = pair.borrow().replica.cmd(&["KEYS", "*"]).map_err(h)?;
    let foreign = keys
        .into_iter()
        .filter(|k| !k.starts_with("lh:") && k.as_str() != PLANTED)
        .collect();
    let planted_ok = planted.get("name").map(String::as_str) == Some("ada")
        && planted.get("plan").map(String::as_str) == Some("pro")
        && planted.len() == 2;
    Ok((planted_ok, foreign))
}

/// The gateway through a Sentinel: a planned failover under load.
fn sentinel_failover(
    rt: &Runtime,
    opts: &Options,
    rules: &Path,
    rows: &mut Vec<Row>,
) -> Result<(), String> {
    eprintln!("chaos: a primary, its replica and a Sentinel; the gateway through the Sentinel");
    let set = SentinelSet::start().map_err(harness)?;
    let (gateway, addr) = gateway(&opts.gateway, &set.url(), rules, None)?;
    let stage = Stage::drive(&Target::Http(addr), gateway.0.id(), opts.watch);
    std::thread::sleep(Duration::from_secs(2));
    stage.phase(
        rows,
        "planned Sentinel failover",
        &|| set.fail_over().map_err(harness),
        &nothing,
        Duration::ZERO,
    )?;
    stage.stop(rt);
    Ok(())
}

/// The gateway on a 6-node Redis Cluster: the hot tenant's primary handed to its replica.
fn cluster_failover(
    rt: &Runtime,
    opts: &Options,
    rules: &Path,
    rows: &mut Vec<Row>,
) -> Result<(), String> {
    eprintln!("chaos: a 6-node Redis Cluster; the gateway on it");
    let cluster = Cluster::start().map_err(harness)?;
    let hosts: Vec<String> = cluster
        .urls()
        .iter()
        .map(|u| u.trim_start_matches("redis://").to_owned())
        .collect();
    let url = format!("cluster://{}", hosts.join(","));
    let (gateway, addr) = gateway(&opts.gateway, &url, rules, None)?;
    let rule = leasehold::core::rule::RuleName::new("chaos").map_err(|e| e.to_string())?;
    let slot = leasehold::core::key::BucketKey::new(&rule, "tenant-hot")
        .map_err(|e| e.to_string())?
        .slot();
    let stage = Stage::drive(&Target::Http(addr), gateway.0.id(), opts.watch);
    std::thread::sleep(Duration::from_secs(2));
    stage.phase(
        rows,
        "Cluster failover (`CLUSTER FAILOVER`)",
        &|| {
            let primary = cluster.owner(slot).map_err(harness)?;
            let replicas: Vec<String> = cluster
                .node(primary.port)
                .ok_or("the primary is not one of the nodes")?
                .cmd(&["CLUSTER", "REPLICAS", &primary.id])
                .map_err(harness)?;
            let replica: u16 = replicas
                .first()
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|a| a.split(['@', ':']).nth(1))
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("no replica in {replicas:?}"))?;
            cluster
                .node(replica)
                .ok_or("the replica is not one of the nodes")?
                .cmd::<String>(&["CLUSTER", "FAILOVER"])
                .map_err(harness)?;
            let deadline = Instant::now() + Duration::from_secs(30);
            while cluster.owner(slot).map(|o| o.port).ok() != Some(replica) {
                if Instant::now() > deadline {
                    return Err("the replica did not take over within 30 s".into());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        },
        &nothing,
        Duration::ZERO,
    )?;
    stage.stop(rt);
    Ok(())
}

/// serve's resident set through its flood, in MB.
struct ServeRss {
    before: f64,
    third: f64,
    end: f64,
    idle: f64,
}

/// `leasehold serve` with its embedded store over gRPC: distinct descriptor values as
/// fast as four callers send them, then a watch without them.
fn serve_flood(
    rt: &Runtime,
    opts: &Options,
    dir: &Path,
    rows: &mut Vec<Row>,
) -> Result<ServeRss, String> {
    eprintln!("chaos: leasehold serve, embedded store, over gRPC");
    let config = dir.join("chaos.yaml");
    std::fs::write(&config, SERVE_CONFIG).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--grpc", "127.0.0.1:0", "--config"])
        .arg(&config);
    let (serve, addr) = spawn_until(cmd, "envoy rate limit service (gRPC) on ", "serve")?;
    let pid = serve.0.id();
    let client = rt
        .block_on(RateLimitServiceClient::connect(format!("http://{addr}")))
        .map_err(|e| format!("connect to serve: {e}"))?;
    let target = Target::Grpc(client);
    let stage = Stage::drive(&target, pid, opts.idle);
    std::thread::sleep(Duration::from_secs(2));
    let mb = || rss_kb(pid) as f64 / 1024.0;
    let before = mb();
    let (third, flooded) = (Arc::new(AtomicU64::new(0)), Cell::new(0.0));
    let total = opts.serve_values;
    let flood = || {
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let flooding: Vec<_> = (0..4)
            .map(|_| {
                let (sent, third, mut target) = (sent.clone(), third.clone(), target.clone());
                tokio::spawn(async move {
                    loop {
                        let n = sent.fetch_add(1, Ordering::Relaxed);
                        if n >= total {
                            break;
                        }
                        if n == total / 3 {
                            third.store(rss_kb(pid), Ordering::Relaxed);
                        }
                        let _ = target.ask(&mut None, "value", &format!("v-{n}")).await;
                    }
                })
            })
            .collect();
        for f in flooding {
            let _ = rt.block_on(f);
        }
        flooded.set(mb());
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "chaos:   {total} values in {secs:.0} s ({:.0}/s); serve RSS now {:.1} MB",
            total as f64 / secs,
            flooded.get()
        );
        Ok(())
    };
    let name = if total == 300_000 {
        "300k-value flood through serve"
    } else {
        "value flood through serve"
    };
    stage.phase(rows, name, &flood, &nothing, Duration::ZERO)?;
    let idle = mb();
    stage.stop(rt);
    Ok(ServeRss {
        before,
        third: third.load(Ordering::Relaxed) as f64 / 1024.0,
        end: flooded.get(),
        idle,
    })
}
