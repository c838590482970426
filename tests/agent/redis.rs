//! The Limiter against real Redis, with faults: the example gateway under real HTTP, Redis
//! killed and restarted, a TCP proxy adding latency and losing replies, the function
//! library flushed under load, and eight agents on one hot key.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_agent::{Admission, Decision, Limiter, LimiterConfig};
use leasehold_redis_harness::{Fault, FaultProxy, RedisServer};
use support::{field, server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn limiter(url: &str, rules: &str) -> Limiter {
    Limiter::builder()
        .redis(url)
        .rules(support::rules(rules))
        .config({
            let mut c = LimiterConfig::default();
            c.store = support::config();
            c
        })
        .build()
        .await
        .expect("limiter")
}

struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `examples/gateway` (built by `cargo test`) and returns it with its address.
fn gateway(redis: &str, config: &std::path::Path, rule: &str) -> (Gateway, String) {
    let exe = std::env::current_exe().expect("test exe");
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("examples").join("gateway"))
        .expect("target dir");
    assert!(
        bin.exists(),
        "{} missing: run through `cargo test`, which builds examples",
        bin.display()
    );
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--redis", redis, "--rule", rule])
        .arg("--config")
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn gateway");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("gateway banner");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .expect("banner")
        .to_owned();
    (Gateway(child), addr)
}

/// One HTTP/1.1 request; returns the status and the Retry-After header.
async fn get(addr: &str, api_key: &str) -> (u16, Option<u64>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req =
        format!("GET / HTTP/1.1\r\nHost: gw\r\nx-api-key: {api_key}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.expect("read");
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    let retry = resp.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("retry-after:")
            .map(|v| v.trim().parse().expect("secs"))
    });
    (status, retry)
}

#[test]
fn example_gateway_admits_exactly_the_burst_the_bucket_allows() {
    let server = server();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("limits.toml");
    // A generous timeout: this tests the burst, not how fast a loaded machine answers.
    std::fs::write(
        &config,
        "[rules.api]\ncapacity = 10\nrate = \"1/s\"\ntimeout = \"2s\"\n",
    )
    .unwrap();
    let (_gw, addr) = gateway(&server.url(), &config, "api");
    support::runtime().block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let addr = addr.clone();
                tokio::spawn(async move { get(&addr, "tenant-42").await })
            })
            .collect();
        let (mut ok, mut limited) = (0u64, 0u64);
        for t in tasks {
            match t.await.unwrap() {
                (200, _) => ok += 1,
                (429, Some(secs)) => {
                    assert!(secs >= 1, "Retry-After must be at least 1");
                    limited += 1;
                }
                other => panic!("unexpected answer {other:?}"),
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        let bound = 10 + elapsed.floor() as u64;
        println!(
            "burst of 200 against B=10, r=1/s: {ok} admitted, {limited} got 429 in {elapsed:.2}s"
        );
        assert!(
            ok >= 10 && ok <= bound,
            "admitted {ok}, the bucket allows 10..={bound}"
        );
        assert_eq!(ok + limited, 200);
    });
}

const FAULT_RULES: &str = r#"
[rules.closed]
capacity = 1000
rate = "1000/s"
leasing = "exact"
timeout = "50ms"
on_failure = "fail_closed"
[rules.open]
capacity = 1000
rate = "1000/s"
leasing = "exact"
timeout = "50ms"
on_failure = "fail_open"
[rules.emergency]
capacity = 1000
rate = "1000/s"
leasing = "exact"
lease_max = 5
timeout = "50ms"
on_failure = "local_emergency"
emergency_rate = "5/s"
"#;

#[test]
fn redis_killed_mid_run_follows_each_policy_within_its_timeout_and_recovers() {
    let mut server = server();
    support::runtime().block_on(async {
        let l = limiter(&server.url(), FAULT_RULES).await;
        for rule in ["closed", "open", "emergency"] {
            assert!(matches!(l.check(&rule.into(), "t", 1).await.unwrap(), Decision::Allowed { via: Admission::Exact, .. }));
        }
        server.kill();
        let mut worst = Duration::ZERO;
        let (mut unavailable, mut open, mut emergency, mut emergency_denied) = (0, 0, 0, 0);
        for _ in 0..30 {
            for rule in ["closed", "open", "emergency"] {
                let t = Instant::now();
                let d = l.check(&rule.into(), "t", 1).await.unwrap();
                worst = worst.max(t.elapsed());
                match (rule, d) {
                    ("closed", Decision::Unavailable { retry_after }) => {
                        assert!(retry_after > Duration::ZERO);
                        unavailable += 1;
                    }
                    ("open", Decision::Allowed { via: Admission::FailOpen, .. }) => open += 1,
                    ("emergency", Decision::Allowed { via: Admission::Emergency, .. }) => emergency += 1,
                    ("emergency", Decision::Denied { .. }) => emergency_denied += 1,
                    other => panic!("{other:?} does not follow the policy"),
                }
            }
        }
        println!(
            "Redis down: 90 decisions, slowest {worst:?} (timeout 50ms); closed->503 x{unavailable}, \
             open->admitted x{open}, emergency admitted {emergency} denied {emergency_denied}"
        );
        assert!(worst < Duration::from_millis(50 + 250), "a decision waited {worst:?}");
        assert!((5..=7).contains(&emergency), "emergency limit of 5 (+refill at 5/s) admitted {emergency}");
        let s = l.stats("emergency").unwrap();
        assert_eq!(s.emergency_activations, 1);
        assert!(matches!(l.health(), leasehold_agent::Health::Degraded(_)), "{:?}", l.health());
        server.restart().expect("restart");
        let restarted = Instant::now();
        // With no decision to probe them, the breakers close by themselves: readiness
        // comes back on a gateway without traffic.
        while l.health() != leasehold_agent::Health::Ready {
            assert!(
                restarted.elapsed() < Duration::from_secs(10),
                "still {:?} 10 s after the restart, with no traffic",
                l.health()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("ready again {:?} after the restart, no decision made", restarted.elapsed());
        for rule in ["closed", "open", "emergency"] {
            // Each rule's keys sit behind their own slot group's breaker: each recovers
            // on its first successful probe after the cooldown.
            loop {
                if let Decision::Allowed { via: Admission::Exact, .. } = l.check(&rule.into(), "t", 1).await.unwrap() {
                    break;
                }
                assert!(restarted.elapsed() < Duration::from_secs(10), "{rule}: no recovery 10s after the restart");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        println!("all rules recovered {:?} after the restart; library loads {}", restarted.elapsed(), l.store().library_loads());
        assert_eq!(l.store().library_loads(), 2, "one reload after the restart");
    });
}

#[test]
fn latency_and_lost_replies_never_debit_twice() {
    let server = server();
    let proxy = FaultProxy::start(server.addr()).expect("proxy");
    let rules = "[rules.api]\ncapacity = 100000\nrate = \"1/100s\"\nleasing = \"exact\"\ntimeout = \"300ms\"\n";
    support::runtime().block_on(async {
        let l = limiter(&proxy.url(), rules).await;
        let (mut admitted, mut unknown) = (0u64, 0u64);
        let mut run = async |n: usize, l: &Limiter| {
            for _ in 0..n {
                match l.check(&"api".into(), "t", 1).await.unwrap() {
                    Decision::Allowed { .. } => admitted += 1,
                    Decision::Unavailable { .. } => unknown += 1,
                    d => panic!("{d:?}"),
                }
            }
        };
        run(50, &l).await;
        proxy.set(Fault::Delay);
        run(20, &l).await;
        proxy.set(Fault::DropReplies);
        run(10, &l).await;
        proxy.cut();
        proxy.set(Fault::Pass);
        tokio::time::sleep(Duration::from_millis(600)).await; // breaker cooldown
        for _ in 0..100 {
            run(1, &l).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let rule = leasehold_core::RuleName::new("api").unwrap();
        let key = leasehold_core::BucketKey::new(&rule, "t").unwrap();
        let debited = 100_000 - field(&server, key.as_str(), "tok");
        println!(
            "through the fault proxy: {admitted} admitted, {unknown} with unknown outcome, store debited {debited}"
        );
        assert!(debited >= admitted, "an admission was not debited");
        assert!(debited <= admitted + unknown, "a request was debited twice");
        assert!(unknown > 0, "the faults were felt");
    });
}

#[test]
fn function_flush_under_load_reloads_the_library_once() {
    let server = server();
    let rules = "[rules.api]\ncapacity = 1000000\nrate = \"100000/s\"\nleasing = \"exact\"\ntimeout = \"1s\"\n";
    support::runtime().block_on(async {
        let l = limiter(&server.url(), rules).await;
        l.check(&"api".into(), "warm", 1).await.unwrap();
        let _: String = server.cmd(&["FUNCTION", "FLUSH"]).expect("flush");
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move {
                    for j in 0..25 {
                        let d = l
                            .check(&"api".into(), format!("t{i}-{j}"), 1)
                            .await
                            .unwrap();
                        assert!(matches!(d, Decision::Allowed { .. }), "{d:?}");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(l.store().library_loads(), 2, "one reload, not a storm");
    });
}

#[test]
fn eight_agents_on_one_hot_key_never_admit_more_than_the_bucket() {
    let secs: u64 = std::env::var("LEASEHOLD_AGENT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let server: RedisServer = server();
    let rules = "[rules.hot]\ncapacity = 1000\nrate = \"2000/s\"\n";
    support::runtime().block_on(async {
        let agents = support::limiters(&server.url(), rules, 8).await;
        let (admitted, decisions, elapsed) =
            support::flat_out(&agents, 2, "hot", "tenant-hot", Duration::from_secs(secs)).await;
        let calls: u64 = agents.iter().map(|l| l.stats("hot").unwrap().store_calls).sum();
        let bound = 1000.0 + 2000.0 * elapsed;
        println!(
            "8 agents x 2 tasks on one key for {elapsed:.2}s: {decisions} decisions ({:.0}/s), {admitted} admitted \
             (bound B + r*t = {bound:.0}, utilisation {:.3}), {calls} store calls = {:.2} per 1k decisions",
            decisions as f64 / elapsed,
            admitted as f64 / bound,
            calls as f64 * 1000.0 / decisions as f64
        );
        assert!(admitted as f64 <= bound, "admitted {admitted} > {bound}");
    });
}

/// A Redis that wants a password says so, and the password never shows in the error.
#[test]
fn a_missing_or_wrong_password_is_named_and_never_echoed() {
    let server = leasehold_redis_harness::RedisServer::start_with(&["--requirepass", "s3cret-pw"])
        .unwrap_or_else(|e| panic!("{e}"));
    support::runtime().block_on(async {
        let port = server.url().rsplit(':').next().unwrap().to_owned();
        let missing = format!("redis://127.0.0.1:{port}");
        let e = leasehold_agent::RedisStore::connect(&missing, support::config())
            .await
            .expect_err("no password")
            .to_string();
        assert!(e.contains("NOAUTH") && e.contains("PASSWORD@"), "{e}");
        // The password written where the user goes (no colon): named as the likely slip,
        // and not shown.
        let user_only = format!("redis://s3cret-pw@127.0.0.1:{port}");
        let e = leasehold_agent::RedisStore::connect(&user_only, support::config())
            .await
            .expect_err("a user name, no password")
            .to_string();
        assert!(e.contains("names a user and no password"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
        let wrong = format!("redis://:wrong-pw@127.0.0.1:{port}");
        let e = leasehold_agent::RedisStore::connect(&wrong, support::config())
            .await
            .expect_err("wrong password")
            .to_string();
        assert!(!e.contains("wrong-pw"), "{e}");
        let right = format!("redis://:s3cret-pw@127.0.0.1:{port}");
        leasehold_agent::RedisStore::connect(&right, support::config())
            .await
            .expect("the right password connects");
    });
}
