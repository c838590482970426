//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use leasehold_agent::{RedisStore, StoreConfig};
use leasehold_core::rule::{BucketParams, Rule, RuleSpec};
use leasehold_redis_harness::RedisServer;

pub mod rlqs;

/// A rule's bucket parameters from its spec fields.
pub fn params(
    capacity: u64,
    rate: &str,
    ttl: &str,
    grace: &str,
    relaxed: Option<u64>,
) -> BucketParams {
    let mut spec = RuleSpec::new(capacity, rate);
    spec.lease_ttl = Some(ttl.into());
    spec.grace = Some(grace.into());
    spec.lease_max = Some(capacity);
    spec.mode = relaxed.map(|_| "relaxed".into());
    spec.max_outstanding = relaxed;
    Rule::from_spec("test", &spec)
        .expect("test rules are valid")
        .bucket_params()
}

/// A multi-threaded runtime for one test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Starts a node, failing the test with install instructions if Redis is missing.
pub fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("{e}"))
}

/// A store on `url` with test timeouts.
pub async fn store(url: &str) -> RedisStore {
    RedisStore::connect(url, config())
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// Timeouts for tests: short enough to see faults, long enough for a loaded CI machine.
pub fn config() -> StoreConfig {
    {
        let mut c = StoreConfig::default();
        c.connect_timeout = Duration::from_secs(2);
        c.call_timeout = Duration::from_millis(800);
        c
    }
}

/// The hash of a bucket as Redis holds it; for a compact bucket (a string), the hash it
/// stands for.
pub fn hash(server: &RedisServer, key: &str) -> BTreeMap<String, String> {
    let mut c = server.connection().expect("connection");
    let ty: String = redis::cmd("TYPE").arg(key).query(&mut c).expect("TYPE");
    if ty == "string" {
        let v: Vec<u8> = redis::cmd("GET").arg(key).query(&mut c).expect("GET");
        return leasehold_store::wire::compact_fields(&v).expect("a compact bucket");
    }
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
        .arg(key)
        .query(&mut c)
        .expect("HGETALL");
    leasehold_store::wire::bucket_fields(&pairs).expect("a bucket's hash")
}

/// One field of a bucket as a number.
pub fn field(server: &RedisServer, key: &str, name: &str) -> u64 {
    hash(server, key)
        .get(name)
        .map_or(0, |v| v.parse().expect("numeric field"))
}

/// A limiter on the Redis at `url` with the rules in `toml` and test timeouts.
pub async fn limiter(url: &str, toml: &str) -> leasehold_agent::Limiter {
    limiter_with(leasehold_agent::Limiter::builder().redis(url), toml).await
}

/// `n` limiters on the Redis at `url`, each with the rules in `toml` (a fleet of agents).
pub async fn limiters(url: &str, toml: &str, n: usize) -> Vec<leasehold_agent::Limiter> {
    let mut agents = Vec::with_capacity(n);
    for _ in 0..n {
        agents.push(limiter(url, toml).await);
    }
    agents
}

/// `builder` with the rules in `toml` and test timeouts, built.
pub async fn limiter_with(
    builder: leasehold_agent::LimiterBuilder,
    toml: &str,
) -> leasehold_agent::Limiter {
    builder
        .rules(rules(toml))
        .config({
            let mut c = leasehold_agent::LimiterConfig::default();
            c.store = config();
            c
        })
        .build()
        .await
        .expect("limiter")
}

/// Checks `subject` under `rule` as fast as `limiter` answers until `stop`, counting
/// admissions in `admitted`; a denial yields to the other tasks.
pub fn hammer(
    limiter: &leasehold_agent::Limiter,
    subject: &'static str,
    rule: &'static str,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    admitted: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    use std::sync::atomic::Ordering;
    let (l, stop, admitted) = (limiter.clone(), stop.clone(), admitted.clone());
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            match l
                .check(&rule.into(), subject, 1)
                .await
                .expect("valid check")
            {
                leasehold_agent::Decision::Allowed { .. } => {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
                leasehold_agent::Decision::Denied { .. } => tokio::task::yield_now().await,
                leasehold_agent::Decision::Unavailable { .. } => panic!("store unavailable"),
            }
        }
    })
}

/// `tasks_per_agent` callers on each of `agents` check `subject` under `rule` flat out for
/// `run_for` (yielding every 64 decisions): the tokens admitted, the decisions made, and
/// the seconds it took.
pub async fn flat_out(
    agents: &[leasehold_agent::Limiter],
    tasks_per_agent: usize,
    rule: &str,
    subject: &'static str,
    run_for: Duration,
) -> (u64, u64, f64) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let admitted = Arc::new(AtomicU64::new(0));
    let decisions = Arc::new(AtomicU64::new(0));
    let start = std::time::Instant::now();
    let tasks: Vec<_> = (agents.iter())
        .flat_map(|l| std::iter::repeat_n(l, tasks_per_agent))
        .map(|l| {
            let (l, rule) = (l.clone(), l.rule(rule).expect("the rule"));
            let (admitted, decisions) = (admitted.clone(), decisions.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while start.elapsed() < run_for {
                    let d = l.check(&rule, subject, 1).await.expect("valid check");
                    if let leasehold_agent::Decision::Allowed { .. } = d {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    decisions.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                    if i.is_multiple_of(64) {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("caller");
    }
    (
        admitted.load(Ordering::Relaxed),
        decisions.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
    )
}

/// `GET path` on `addr`: the status and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.expect("receive");
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("status");
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

/// A coordinator over `store` for the rules of `toml` (as [`rules`] reads them), with the
/// default configuration; the caller spawns it.
pub fn coordinator(
    store: RedisStore,
    toml: &str,
) -> std::sync::Arc<leasehold_coordinator::Coordinator> {
    std::sync::Arc::new(leasehold_coordinator::Coordinator::new(
        store,
        rules(toml),
        leasehold_coordinator::CoordinatorConfig::default(),
    ))
}

/// Rules from `toml`, each rule without a `timeout` given a generous one (2 s): tests
/// must pass on a loaded machine, where the default 50 ms is not always met; the tests
/// of timeouts set theirs.
pub fn rules(toml: &str) -> leasehold_agent::Rules {
    let mut doc: toml::Table = toml.parse().expect("test rules are TOML");
    if let Some(rules) = doc.get_mut("rules").and_then(toml::Value::as_table_mut) {
        for (_, spec) in rules.iter_mut() {
            if let Some(spec) = spec.as_table_mut() {
                spec.entry("timeout")
                    .or_insert_with(|| toml::Value::String("2s".into()));
            }
        }
    }
    leasehold_agent::Rules::from_toml(&doc.to_string()).expect("test rules are valid")
}
