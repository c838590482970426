//! What operators run, from outside: `leasehold serve`, `leasehold coordinator` and the
//! example gateway as processes, on a real Redis that is down when they start.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_redis_harness::{RedisServer, SentinelSet};

/// A binary run as a process, its output in files; killed on drop.
pub(crate) struct Proc {
    child: Child,
    out: PathBuf,
    err: PathBuf,
    _dir: tempfile::TempDir,
}

impl Proc {
    pub(crate) fn start(exe: &Path, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
        let child = Command::new(exe)
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", exe.display()));
        Self {
            child,
            out,
            err,
            _dir: dir,
        }
    }

    /// `leasehold serve --config CONFIG [--redis URL] --http 127.0.0.1:0`, and its HTTP
    /// address once it listens.
    pub(crate) fn serve_http(config: &str, redis: Option<&str>) -> (Self, SocketAddr) {
        let mut args = vec!["serve", "--config", config, "--http", "127.0.0.1:0"];
        if let Some(url) = redis {
            args.extend(["--redis", url]);
        }
        let mut serve = Self::start(&binaries().0, &args);
        let at = serve.address("http check API on ");
        // It says which store it decides with.
        let out = std::fs::read_to_string(&serve.out).unwrap_or_default();
        let want = match redis {
            None => "store: embedded, in this process".to_owned(),
            Some(url) => format!("store: {}://", url.split("://").next().unwrap_or(url)),
        };
        assert!(out.lines().any(|l| l.starts_with(&want)), "{out}");
        // An embedded store is a warning in the log too: each instance limits alone.
        let err = std::fs::read_to_string(&serve.err).unwrap_or_default();
        let warned = err
            .lines()
            .any(|l| l.contains("WARN") && l.contains("each serve instance enforces"));
        assert_eq!(warned, redis.is_none(), "{err}");
        // And in its health line, which an operator's probe reads.
        if redis.is_none() {
            let (status, body) = http(at, "GET", "/health", &[], "");
            assert_eq!(status, 200, "{body}");
            assert!(
                body.starts_with("ready (embedded store: this instance's own limits"),
                "{body}"
            );
        }
        // And on the page at `/`, beside the health it shows.
        let (status, page) = http(at, "GET", "/", &[], "");
        assert_eq!(status, 200, "{page}");
        assert_eq!(
            page.contains("id=\"embedded\">(embedded store: this instance's own limits"),
            redis.is_none(),
            "{page}"
        );
        (serve, at)
    }

    /// `leasehold coordinator --config RULES --redis URL --listen 127.0.0.1:0 EXTRA...`, and
    /// its admin address once it listens.
    pub(crate) fn coordinator(rules: &str, redis: &str, extra: &[&str]) -> (Self, SocketAddr) {
        let mut args = vec![
            "coordinator",
            "--config",
            rules,
            "--redis",
            redis,
            "--listen",
            "127.0.0.1:0",
        ];
        args.extend(extra);
        let mut coordinator = Self::start(&binaries().0, &args);
        let at = coordinator.address("admin endpoint on http://");
        (coordinator, at)
    }

    /// The address printed after `prefix` on stdout, once it is (the process is up).
    pub(crate) fn address(&mut self, prefix: &str) -> SocketAddr {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = std::fs::read_to_string(&self.out).unwrap_or_default();
            if let Some(rest) = out.lines().find_map(|l| l.split_once(prefix).map(|x| x.1)) {
                return rest.trim().parse().expect("an address");
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("exited with {status} before serving: {}", self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "no {prefix:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Waits until stderr shows `needle`.
    fn wait_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.stderr().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "no {needle:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM, as an orchestrator stops a process, and waits (30 s at most) for it
    /// to exit: its exit status.
    pub(crate) fn terminate(&mut self) -> std::process::ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit 30 s after SIGTERM: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `leasehold` binary and the example gateway (cargo test builds the examples beside
/// the binaries).
pub(crate) fn binaries() -> (PathBuf, PathBuf) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_leasehold"));
    let gateway = exe
        .parent()
        .expect("target")
        .join("examples")
        .join("gateway");
    assert!(
        gateway.is_file(),
        "{} missing: cargo test builds the examples",
        gateway.display()
    );
    (exe, gateway)
}

/// One HTTP/1.1 request: the status and the body.
pub(crate) fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("receive");
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no status in {resp:?}"));
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

pub(crate) fn wait_ready(addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http(addr, "GET", "/ready", &[], "");
        if status == 200 {
            assert_eq!(body, "ready\n");
            return;
        }
        assert!(Instant::now() < deadline, "{what} never ready: {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn check(addr: SocketAddr, rule: &str) -> u16 {
    check_as(addr, rule, "t")
}

fn check_as(addr: SocketAddr, rule: &str, subject: &str) -> u16 {
    let body = format!(r#"{{"checks":[{{"rule":"{rule}","subject":"{subject}"}}]}}"#);
    http(addr, "POST", "/v1/check", &[], &body).0
}

/// Every binary comes up while its Redis is down, answers by each rule's failure policy
/// (503 for fail_closed, 200 for fail_open), says `degraded` on `/ready`, logs why without
/// the password, and decides with the store once it appears, without a restart.
#[test]
fn every_binary_starts_while_redis_is_down_and_uses_it_once_it_is_up() {
    let mut redis = RedisServer::start_with(&["--requirepass", "pw-Zq9secret"])
        .unwrap_or_else(|e| panic!("{e}"));
    redis.kill();
    let url = format!("redis://:pw-Zq9secret@127.0.0.1:{}", redis.port());
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[rules.closed]\ncapacity = 5\nrate = \"1/s\"\non_failure = \"fail_closed\"\n\
         [rules.open]\ncapacity = 5\nrate = \"1/s\"\non_failure = \"fail_open\"\n",
    )
    .expect("rules");
    let rules = rules.to_str().expect("utf-8");
    let (_, gateway_exe) = binaries();

    let (mut serve, serve_at) = Proc::serve_http(rules, Some(&url));
    let (mut coordinator, coordinator_at) = Proc::coordinator(rules, &url, &[]);
    let mut gateway = Proc::start(
        &gateway_exe,
        &[
            "--config",
            rules,
            "--redis",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--rule",
            "open",
        ],
    );
    let gateway_at = gateway.address("listening on ");

    for (what, addr) in [
        ("serve", serve_at),
        ("coordinator", coordinator_at),
        ("gateway", gateway_at),
    ] {
        let (status, body) = http(addr, "GET", "/ready", &[], "");
        assert_eq!(status, 503, "{what}: {body}");
        assert!(body.starts_with("degraded: "), "{what}: {body}");
        // Alive, and saying why it is not ready.
        let (status, body) = http(addr, "GET", "/health", &[], "");
        assert_eq!(status, 200, "{what}: {body}");
        assert!(body.starts_with("degraded: "), "{what}: {body}");
    }
    // Enough failed calls to open the breaker of the one shard known before the store's
    // topology is.
    for n in 0..5 {
        assert_eq!(check_as(serve_at, "closed", &format!("early-{n}")), 503);
    }
    // Admitted without the store's count: no figure for what is left.
    let (status, body) = http(
        serve_at,
        "POST",
        "/v1/check",
        &[],
        r#"{"checks":[{"rule":"open","subject":"t"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""remaining":null"#), "{body}");
    let tenant = "x-api-key: tenant-1";
    assert_eq!(http(gateway_at, "GET", "/", &[tenant], "").0, 200);
    // Two identities: which one pays would be a guess.
    assert_eq!(
        http(gateway_at, "GET", "/", &[tenant, "x-api-key: other"], "").0,
        400
    );

    for p in [&serve, &coordinator, &gateway] {
        p.wait_log("store unreachable");
        // The log names the store (without its password).
        p.wait_log(&format!("redis://***@127.0.0.1:{}", redis.port()));
    }
    // The breaker of the shard known before the topology is reported open (checks keep
    // it from cooling down to half-open between the metric's updates).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    while !http(serve_at, "GET", "/metrics", &[], "")
        .1
        .contains("leasehold_breaker_open{shard=\"all\"} 1")
    {
        assert!(Instant::now() < deadline, "the breaker never reported open");
        n += 1;
        check_as(serve_at, "closed", &format!("early-{n}"));
        std::thread::sleep(Duration::from_millis(20));
    }
    redis.restart().unwrap_or_else(|e| panic!("{e}"));
    for (what, addr) in [
        ("serve", serve_at),
        ("coordinator", coordinator_at),
        ("gateway", gateway_at),
    ] {
        wait_ready(addr, what);
    }
    // Decided by the store now: 5 tokens, then 429.
    let statuses: Vec<u16> = (0..6).map(|_| check(serve_at, "closed")).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);

    // Lost and found again: each change of state is a log line.
    let count = |p: &Proc, line: &str| p.stderr().matches(line).count();
    let (opened, closed) = (
        count(&serve, "breaker open"),
        count(&serve, "breaker closed"),
    );
    redis.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    while count(&serve, "breaker open") == opened {
        assert!(Instant::now() < deadline, "{}", serve.stderr());
        n += 1;
        check_as(serve_at, "closed", &format!("tenant-{n}"));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Not ready for as long as the store is down, between the breaker's probes too.
    for _ in 0..6 {
        n += 1;
        check_as(serve_at, "closed", &format!("tenant-{n}"));
        assert_eq!(http(serve_at, "GET", "/ready", &[], "").0, 503);
        std::thread::sleep(Duration::from_millis(250));
    }
    redis.restart().unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&serve, "breaker closed") == closed {
        assert!(Instant::now() < deadline, "{}", serve.stderr());
        n += 1;
        check_as(serve_at, "closed", &format!("tenant-{n}"));
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_ready(serve_at, "serve");
    // No breaker reported open once the store answers (the one of the shard named before
    // the store's topology was known included).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, metrics) = http(serve_at, "GET", "/metrics", &[], "");
        let open: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("leasehold_breaker_open{") && !l.ends_with(" 0"))
            .collect();
        if open.is_empty() && metrics.contains("leasehold_breaker_open{") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "breakers reported open: {open:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for (what, p) in [
        ("serve", &mut serve),
        ("coordinator", &mut coordinator),
        ("gateway", &mut gateway),
    ] {
        assert!(p.running(), "{what} exited: {}", p.stderr());
        let log = p.stderr();
        assert!(log.contains("store connected"), "{what}: {log}");
        assert!(
            !log.contains("Zq9secret"),
            "{what} printed the password: {log}"
        );
        assert!(!log.contains('\u{1b}'), "{what} coloured a log file: {log}");
    }
    // Stopped as an orchestrator stops them: each exits 0, having said so.
    for (what, p) in [
        ("serve", &mut serve),
        ("coordinator", &mut coordinator),
        ("gateway", &mut gateway),
    ] {
        let status = p.terminate();
        assert!(
            status.success(),
            "{what} exited {status} on SIGTERM: {}",
            p.stderr()
        );
        assert!(p.stderr().contains("SIGTERM"), "{what}: {}", p.stderr());
    }
}

/// However the address is mistyped, no binary prints the password: a malformed address
/// is refused at once, naming what is wrong, with the password hidden.
#[test]
fn no_binary_prints_the_password_of_a_malformed_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "[rules.a]\ncapacity = 5\nrate = \"1/s\"\n").expect("rules");
    let rules = rules.to_str().expect("utf-8");
    let (exe, gateway_exe) = binaries();
    let pw = "Pw7Zq9leak";
    for address in [
        format!("redis//:{pw}@127.0.0.1:1"),
        format!("redis:/:{pw}@127.0.0.1:1"),
        pw.to_owned(),
        format!("redis+sentinel://{pw}"),
        format!("redis://{pw}@127.0.0.1:notaport"),
        format!("cluster://:{pw}@"),
    ] {
        let runs: [(&Path, Vec<&str>); 4] = [
            (
                &exe,
                vec!["serve", "--config", rules, "--http", "127.0.0.1:0"],
            ),
            // simulate takes the address as --store / LEASEHOLD_STORE.
            (&exe, vec!["simulate", "--duration", "1"]),
            (
                &exe,
                vec!["coordinator", "--config", rules, "--listen", "127.0.0.1:0"],
            ),
            (
                &gateway_exe,
                vec!["--config", rules, "--listen", "127.0.0.1:0", "--rule", "a"],
            ),
        ];
        for (bin, args) in runs {
            // From the command line and from the environment.
            for by_env in [false, true] {
                let mut cmd = Command::new(bin);
                cmd.args(&args).stdin(Stdio::null());
                let simulate = args[0] == "simulate";
                match (by_env, simulate) {
                    (true, false) => cmd.env("LEASEHOLD_REDIS_URL", &address),
                    (false, false) => cmd.args(["--redis", &address]),
                    (true, true) => cmd.env("LEASEHOLD_STORE", &address),
                    (false, true) => cmd.args(["--store", &address]),
                };
                let mut child = cmd
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn");
                // Refused at once; should one start anyway, it is stopped here.
                let deadline = Instant::now() + Duration::from_secs(10);
                while child.try_wait().expect("wait").is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = child.kill();
                let out = child.wait_with_output().expect("output");
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(
                    !text.contains("Zq9"),
                    "{address:?} via {bin:?} {args:?}: {text}"
                );
                assert!(!out.status.success(), "{address:?} accepted: {text}");
            }
        }
    }
}

/// A reload of the rules file that drops the rule the gateway checks is refused as the
/// same file is at start: one ERROR line, the rules in force kept, every request answered
/// as before (no 500s); a later good file is taken.
#[test]
fn the_gateway_refuses_a_reload_that_drops_its_rule_and_keeps_answering() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[rules.api]\ncapacity = 3\nrate = \"1/h\"\n[rules.other]\ncapacity = 9\nrate = \"1/s\"\n",
    )
    .expect("rules");
    let (_, gateway_exe) = binaries();
    let gateway = Proc::start(
        &gateway_exe,
        &[
            "--config",
            rules.to_str().expect("utf-8"),
            "--redis",
            &redis.url(),
            "--listen",
            "127.0.0.1:0",
            "--rule",
            "api",
        ],
    );
    let mut gateway = gateway;
    let at = gateway.address("listening on ");
    let get = |key: &str| http(at, "GET", "/", &[&format!("x-api-key: {key}")], "").0;
    assert_eq!(get("a"), 200);

    // The same file without `api`: refused, once.
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time
    std::fs::write(&rules, "[rules.other]\ncapacity = 9\nrate = \"1/s\"\n").expect("rules");
    gateway.wait_log("rules file refused");
    let statuses: Vec<u16> = (0..5).map(|_| get("a")).collect();
    assert_eq!(
        statuses,
        [200, 200, 429, 429, 429],
        "the rule in force decides"
    );
    std::thread::sleep(Duration::from_millis(2500)); // a few watch ticks
    assert_eq!(get("b"), 200);
    let log = gateway.stderr();
    let errors = log.lines().filter(|l| l.contains("ERROR")).count();
    assert_eq!(errors, 1, "{log}");
    assert!(log.contains("api"), "the refusal names the rule: {log}");

    // A good file is taken: `api` with a larger capacity.
    std::fs::write(
        &rules,
        "[rules.api]\ncapacity = 20\nrate = \"1/h\"\n[rules.other]\ncapacity = 9\nrate = \"1/s\"\n",
    )
    .expect("rules");
    gateway.wait_log("rules reloaded");
    assert_eq!(get("c"), 200);
    assert!(gateway.running(), "{}", gateway.stderr());
}

/// serve refuses a config file that fails validation as it would at start, keeps the
/// limits in force, and counts it (`leasehold_serve_config_reloads_total{outcome}`: a
/// refusal was only an ERROR line, `/health` still `ready`); a later good file is taken.
#[test]
fn serve_counts_a_refused_reload_and_keeps_its_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = dir.path().join("config.yaml");
    let good = |rpu: u32| {
        format!(
            "domain: gw\ndescriptors:\n  - key: api_key\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}}}\n"
        )
    };
    std::fs::write(&yaml, good(2)).expect("yaml");
    let (serve, at) = Proc::serve_http(yaml.to_str().unwrap(), None);
    let check = |value: &str| {
        let body = format!(
            r#"{{"domain":"gw","descriptors":[{{"entries":[{{"key":"api_key","value":"{value}"}}]}}]}}"#
        );
        http(at, "POST", "/v1/check", &[], &body).0
    };
    let count = |outcome: &str| -> u64 {
        let (_, text) = http(at, "GET", "/metrics", &[], "");
        let line = format!("leasehold_serve_config_reloads_total{{outcome=\"{outcome}\"}} ");
        (text.lines())
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |n| n.trim().parse().expect("a count"))
    };
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time
    std::fs::write(
        &yaml,
        "domain: gw\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
    )
    .expect("yaml");
    serve.wait_log("config refused");
    assert_eq!(count("refused"), 1);
    assert_eq!(
        [check("a"), check("a"), check("a")],
        [200, 200, 429],
        "the limit in force decides"
    );
    std::fs::write(&yaml, good(3)).expect("yaml");
    serve.wait_log("limits reloaded");
    assert_eq!(count("loaded"), 1);
    assert_eq!([check("b"), check("b"), check("b")], [200, 200, 200]);
}

/// serve's two listeners share the process's connection budget (three quarters of its
/// open-file limit): idle sockets on both never run it out of descriptors, the ones past
/// the budget are closed at once, and it answers again once they go.
#[test]
fn serve_listeners_share_one_connection_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("rls.yaml");
    std::fs::write(
        &config,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10}\n",
    )
    .expect("config");
    let (exe, _) = binaries();
    let script = format!(
        "ulimit -n 128 && exec \"$0\" serve --config {} --http 127.0.0.1:0 --grpc 127.0.0.1:0",
        config.display()
    );
    let mut serve = Proc::start(
        Path::new("sh"),
        &["-c", &script, exe.to_str().expect("utf-8")],
    );
    let http_at = serve.address("http check API on ");
    let grpc_at = serve.address("envoy rate limit service (gRPC) on ");
    assert_eq!(http(http_at, "GET", "/health", &[], "").0, 200);
    // 70 idle sockets on each listener: 140 against a budget of 96 (and 128 files).
    let mut idle = Vec::new();
    for addr in [http_at, grpc_at] {
        for _ in 0..70 {
            idle.push(TcpStream::connect(addr).expect("connect"));
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let held = idle
        .iter_mut()
        .filter(|s| {
            let s: &TcpStream = s;
            let mut s = s;
            s.set_nonblocking(true).expect("nonblocking");
            let mut b = [0u8; 1];
            // Closed by the server: read returns 0 (or a reset); held: would block.
            matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count();
    assert!(held <= 96, "{held} connections held, budget 96");
    assert!(held >= 90, "only {held} held: the budget is 96");
    serve.wait_log("connection limit reached");
    drop(idle);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(http(http_at, "GET", "/health", &[], "").0, 200);
    let log = serve.stderr();
    assert!(!log.contains("Too many open files"), "{log}");
    assert!(serve.running(), "{log}");
}

/// serve on `url`, once its log says `logged`; `/ready` then answers 503.
fn serve_degraded(url: &str, logged: &str) -> (Proc, SocketAddr, String) {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/limits.toml");
    let (serve, at) = Proc::serve_http(example, Some(url));
    serve.wait_log(logged);
    let (status, body) = http(at, "GET", "/ready", &[], "");
    assert_eq!(status, 503, "{body}");
    (serve, at, body)
}

/// A wrong password is not an outage: serve stays up, degraded, and says the store
/// refused the credentials (not that it is unreachable), without printing either password.
#[test]
fn a_wrong_password_is_named_as_such() {
    let redis =
        RedisServer::start_with(&["--requirepass", "right-Zq9"]).unwrap_or_else(|e| panic!("{e}"));
    let url = format!("redis://:wrong-Zq9@127.0.0.1:{}", redis.port());
    let (mut serve, at, _) = serve_degraded(
        &url,
        "store refused the credentials: check the user and password",
    );
    // The probes say it too: an operator reading /health looks at the password, not
    // the network.
    for path in ["/ready", "/health"] {
        let (_, body) = http(at, "GET", path, &[], "");
        assert!(
            body.contains("store not connected yet: store refused the credentials"),
            "{path}: {body}"
        );
        assert!(!body.contains("Zq9"), "a password in {path}: {body}");
    }
    let log = serve.stderr();
    assert!(!log.contains("Zq9"), "a password printed: {log}");
    assert!(serve.running(), "{log}");
    drop(serve);
    // No password at all (or one written where the user goes): named as such too.
    let url = format!("redis://right-Zq9@127.0.0.1:{}", redis.port());
    let (mut serve, _, body) =
        serve_degraded(&url, "store wants a password the address does not give");
    assert!(body.contains("names a user and no password"), "{body}");
    let log = serve.stderr();
    assert!(
        !log.contains("Zq9") && !body.contains("Zq9"),
        "a password printed: {log}"
    );
    assert!(serve.running(), "{log}");
}

/// A database number the store lacks is named as such in the log and the probes (it
/// said "store unreachable").
#[test]
fn a_database_the_store_lacks_is_named_as_such() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("redis://127.0.0.1:{}/99", redis.port());
    let (mut serve, _, body) = serve_degraded(
        &url,
        "store has no such database: check the /DB of the address",
    );
    assert!(
        body.contains("store not connected yet: store has no such database"),
        "{body}"
    );
    assert!(serve.running(), "{}", serve.stderr());
}

/// An address of the wrong kind for the Redis it reaches (cluster:// on one Redis, a
/// Sentinel service nobody monitors) is named as such, not as an outage.
#[test]
fn an_address_of_the_wrong_kind_is_named_as_such() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("cluster://127.0.0.1:{}", redis.port());
    let (mut serve, _, body) = serve_degraded(&url, "store is not a Redis Cluster");
    assert!(body.contains("cluster:// needs one"), "{body}");
    assert!(serve.running(), "{}", serve.stderr());
    drop(serve);

    let sentinels = SentinelSet::start().unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "redis+sentinel://127.0.0.1:{}/no-such-service",
        sentinels.port()
    );
    let (mut serve, _, body) = serve_degraded(&url, "store's Sentinels monitor no such service");
    assert!(body.contains("check the /SERVICE of the address"), "{body}");
    assert!(serve.running(), "{}", serve.stderr());
}

/// Two `leasehold serve` processes on one Redis; Envoy-like RLQS filters on the first,
/// which is killed (SIGKILL: nothing released, streams cut) mid-run. The filters'
/// assignments run out into their fallback, they reconnect to the second, and every
/// window of what they admitted stays within `B + r·W`.
#[test]
fn a_killed_serve_s_rlqs_filters_move_to_another_and_the_bound_holds() {
    use std::sync::{Arc, Mutex};

    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("quota.yaml");
    std::fs::write(
        &config,
        "domain: quota\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 200}\n",
    )
    .expect("config");
    let (exe, _) = binaries();
    let url = redis.url();
    let start_serve = || {
        let mut p = Proc::start(
            &exe,
            &[
                "serve",
                "--config",
                config.to_str().expect("utf-8"),
                "--grpc",
                "127.0.0.1:0",
                "--redis",
                &url,
            ],
        );
        let at = p.address("envoy rate limit service (gRPC) on ");
        (p, at)
    };
    let (mut a, a_at) = start_serve();
    let (mut b, b_at) = start_serve();
    let rt = crate::support::runtime();
    let (all, killed_at, start) = rt.block_on(async {
        let servers = Arc::new(Mutex::new(vec![a_at, b_at]));
        let start = Instant::now();
        let end = start + Duration::from_secs(7);
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                tokio::spawn(crate::support::rlqs::run_filter(
                    servers.clone(),
                    vec![("tenant", "killed")],
                    60.0,
                    end,
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        a.child.kill().expect("kill serve");
        let killed_at = start.elapsed();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.expect("filter").0);
        }
        (all, killed_at, start)
    });
    let excess = crate::support::rlqs::worst_excess(all.clone(), 200.0, 200.0);
    let late = all
        .iter()
        .filter(|&&t| t >= start + Duration::from_secs(5))
        .count() as f64;
    let utilisation = late / (200.0 * 2.0);
    println!(
        "RLQS through two serve processes, the first killed at {killed_at:?}: worst window \
         excess {excess:.1}, utilisation over the last 2 s {utilisation:.3}"
    );
    assert!(excess <= 0.0, "a window admitted {excess:.1} over B + r·W");
    assert!(utilisation >= 0.7, "utilisation {utilisation:.3}");
    assert!(b.running(), "{}", b.stderr());
}
