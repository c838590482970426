//! `leasehold chaos`: the fault matrix under HTTP load against the example gateway.
//!
//! Starts a private primary and replica (behind a TCP proxy that a promotion moves), the
//! coordinator and the example gateway as separate processes, drives the gateway over
//! keep-alive HTTP (one hot tenant at 3x its limit, 200 cold tenants), and injects one
//! fault at a time: each holds for a while, is cleared, and is watched until the end of
//! its phase. One table row per fault:
//!
//! - max latency: the slowest HTTP answer in the phase (the decision plus HTTP on
//!   loopback), against the rule's timeout + 10 ms;
//! - statuses: shares of 200, 429, 503 and transport errors;
//! - recovered: from clearing the fault to the last 503 or error the load saw ("never"
//!   when they go on to the end of the phase);
//! - overshoot: tokens the hot tenant was admitted beyond B + r x phase length;
//! - RSS: the gateway's largest resident set in the phase.
//!
//! At the end, an application key planted before the run is checked unchanged, and every
//! key in Redis is checked to be Leasehold's.

use std::cell::RefCell;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use leasehold_redis_harness::{FaultProxy, ReplicaPair};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What to run.
pub(crate) struct Options {
    /// The example gateway's binary.
    pub(crate) gateway: PathBuf,
    /// Distinct API keys the flood sends.
    pub(crate) flood_keys: u64,
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
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {what}: {e}"))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let proc = Proc(child);
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
    let rest = rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|_| format!("{what} did not start within 20 s"))?;
    Ok((proc, rest))
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

/// Sends `rps` requests per second over one connection, keys from `key`.
fn load(
    rec: Arc<Recorder>,
    addr: SocketAddr,
    rps: u64,
    hot: bool,
    key: impl Fn(u64) -> String + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rps));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut conn = None;
        let mut n = 0;
        while !rec.stop.load(Ordering::Relaxed) {
            tick.tick().await;
            n += 1;
            let at = rec.now_us();
            let status = get(&mut conn, addr, &key(n)).await.unwrap_or(0);
            let latency_us = rec.now_us() - at;
            rec.samples.lock().push(Sample {
                at_us: at,
                latency_us,
                status,
                hot,
            });
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

/// Runs the matrix and prints the table.
pub(crate) fn run(opts: Options) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let h = |e: leasehold_redis_harness::HarnessError| e.to_string();
    eprintln!("chaos: starting a primary, its replica, the coordinator and the gateway");
    let pair = ReplicaPair::start().map_err(h)?;
    let vip = FaultProxy::start(pair.primary.addr()).map_err(h)?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, RULES).map_err(|e| e.to_string())?;
    let coord = Some(coordinator(&vip.url(), &rules)?);
    let mut cmd = Command::new(&opts.gateway);
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--redis",
        &vip.url(),
        "--rule",
        "chaos",
    ])
    .arg("--config")
    .arg(&rules);
    let (gateway, addr) = spawn_until(cmd, "listening on ", "the gateway")?;
    let addr: SocketAddr = addr.parse().map_err(|e| format!("gateway address: {e}"))?;
    let gw_pid = gateway.0.id();

    let rec = Arc::new(Recorder {
        start: Instant::now(),
        samples: Mutex::new(Vec::with_capacity(1 << 20)),
        stop: AtomicBool::new(false),
        rss_kb: Mutex::new(Vec::new()),
    });
    let _guard = rt.enter();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        tasks.push(load(rec.clone(), addr, HOT_RPS / 6, true, |_| {
            "tenant-hot".into()
        }));
    }
    for c in 0..2u64 {
        tasks.push(load(rec.clone(), addr, COLD_RPS / 2, false, move |n| {
            format!("tenant-{}", (n * 2 + c) % 200)
        }));
    }
    {
        let rec = rec.clone();
        tasks.push(tokio::spawn(async move {
            while !rec.stop.load(Ordering::Relaxed) {
                let t = rec.now_us();
                rec.rss_kb.lock().push((t, rss_kb(gw_pid)));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }

    let (hold, watch) = (opts.hold, opts.watch);
    let mut rows = Vec::new();
    let pair = RefCell::new(pair);
    let coord = RefCell::new(coord);
    let primary = |args: &[&str]| -> Result<(), String> {
        pair.borrow()
            .primary
            .cmd::<redis::Value>(args)
            .map(|_| ())
            .map_err(h)
    };
    let mut phase = |name: &'static str,
                     apply: &dyn Fn() -> Result<(), String>,
                     clear: &dyn Fn() -> Result<(), String>,
                     hold: Duration|
     -> Result<(), String> {
        eprintln!("chaos: {name}");
        let from = rec.now_us();
        apply()?;
        std::thread::sleep(hold);
        clear()?;
        let cleared = rec.now_us();
        std::thread::sleep(watch);
        rows.push(row(&rec, name, from, cleared, rec.now_us()));
        Ok(())
    };
    let nothing = || Ok(());
    std::thread::sleep(Duration::from_secs(2));
    phase("none (baseline)", &nothing, &nothing, hold)?;
    // kill -9, then a restart (empty, as without persistence).
    phase(
        "kill -9 + restart",
        &|| {
            pair.borrow_mut().primary.kill();
            Ok(())
        },
        &|| pair.borrow_mut().primary.restart().map_err(h),
        hold,
    )?;
    // The restart emptied the node: the application key goes back in.
    primary(&["HSET", PLANTED, "name", "ada", "plan", "pro"])?;
    phase(
        "SIGSTOP + SIGCONT",
        &|| pair.borrow().primary.pause().map_err(h),
        &|| pair.borrow().primary.resume().map_err(h),
        hold,
    )?;
    phase(
        "FUNCTION FLUSH",
        &|| primary(&["FUNCTION", "FLUSH"]),
        &nothing,
        Duration::ZERO,
    )?;
    phase(
        "OOM, then cleared",
        &|| primary(&["CONFIG", "SET", "maxmemory", "1"]),
        &|| primary(&["CONFIG", "SET", "maxmemory", "0"]),
        hold,
    )?;
    phase(
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
    phase(
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
    phase(
        "coordinator kill -9 + restart",
        &|| {
            coord.borrow_mut().take();
            Ok(())
        },
        &|| {
            *coord.borrow_mut() = Some(coordinator(&vip.url(), &rules)?);
            Ok(())
        },
        hold,
    )?;
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
            rss_kb(gw_pid) as f64 / 1024.0
        );
        Ok(())
    };
    let flood_name = if total == 1_000_000 {
        "1M-key flood"
    } else {
        "key flood"
    };
    phase(flood_name, &flood, &nothing, Duration::ZERO)?;
    let planted: std::collections::HashMap<String, String> = pair
        .borrow()
        .primary
        .cmd(&["HGETALL", PLANTED])
        .map_err(h)?;
    phase(
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
    rec.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = rt.block_on(t);
    }

    // The promoted replica holds everything now.
    let keys: Vec<String> = pair.borrow().replica.cmd(&["KEYS", "*"]).map_err(h)?;
    let foreign: Vec<&String> = keys
        .iter()
        .filter(|k| !k.starts_with("lh:") && k.as_str() != PLANTED)
        .collect();
    drop(gateway);

    println!(
        "\nfault matrix: rule capacity {CAPACITY}, rate {RATE}/s, timeout {TIMEOUT_MS} ms, \
         fail_closed; load {HOT_RPS} req/s on one tenant + {COLD_RPS} req/s over 200 \
         tenants; each fault held {:.1} s, then watched {:.1} s",
        hold.as_secs_f64(),
        watch.as_secs_f64()
    );
    println!(
        "| fault | requests | max latency ms | 200 / 429 / 503 / error | recovered after clearing (ms) | overshoot (tokens) | gateway RSS MB |"
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
    let planted_ok = planted.get("name").map(String::as_str) == Some("ada")
        && planted.get("plan").map(String::as_str) == Some("pro")
        && planted.len() == 2;
    println!(
        "\nplanted application key {PLANTED}: {}; keys in Redis that are not Leasehold's: {}",
        if planted_ok { "unchanged" } else { "CHANGED" },
        foreign.len()
    );
    if !planted_ok || !foreign.is_empty() {
        return Err(format!("writes reached foreign keys: {foreign:?}"));
    }
    Ok(())
}
