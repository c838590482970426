//! What an operator sees: the coordinator's live page, rendered by a real browser
//! (headless Chromium) against the `leasehold coordinator` binary and agents on a real
//! Redis; its bearer token; and `leasehold serve`'s page of the rules its YAML produced,
//! whose addresses are then used as they are shown.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use leasehold_redis_harness::RedisServer;

use super::ops_binaries::{Proc, http};
use crate::support;

const RULES: &str =
    "[rules.api]\ncapacity = 2000\nrate = \"2000/s\"\nleasing = \"lease\"\nlease_max = 200\n";
const TOKEN: &str = "tok-Page-7";

/// Debian's Chromium, or a failure that says how to install it.
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = Path::new(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "chromium is missing: the page is tested in a real browser. Install it with \
         `apt-get install chromium` (scripts/test does when it can)"
    );
}

/// Runs headless Chromium on `url` with `args`, killed after 90 s; its stdout.
fn browse(url: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            // Scripts run for 3 s of virtual time (the page refreshes every second;
            // time waits while a fetch is in flight).
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("chromium output");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The page from the element with `id` up to `end` (a table's `</table>`; for the
/// sections of nested `div`s, the next heading).
fn section<'a>(dom: &'a str, end: &str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page: {dom}"));
    let rest = &dom[start..];
    &rest[..rest.find(end).unwrap_or(rest.len())]
}

/// Every `N.N%` in `text`.
fn percents(text: &str) -> Vec<f64> {
    text.split('%')
        .filter_map(|chunk| {
            let tail: String = chunk
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let n: String = tail.chars().rev().collect();
            (!n.is_empty()).then(|| n.parse().ok()).flatten()
        })
        .collect()
}

#[test]
fn a_browser_shows_the_hot_key_its_gateways_shares_and_the_bound() {
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, RULES).expect("rules");
    let (mut coordinator, admin) = Proc::coordinator(
        rules.to_str().unwrap(),
        &redis.url(),
        &["--admin-token", TOKEN],
    );

    // Three gateways offering 1:2:3 of 6 000 tokens a second on one key whose rate is
    // 2 000: contended, so the bucket shares by demand and refuses the rest.
    let rt = support::runtime();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..3u64 {
        let url = redis.url();
        let stop = stop.clone();
        tasks.push(rt.spawn(async move {
            let limiter = support::limiter(&url, RULES).await;
            let rule = "api".into();
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..(i + 1) * 100 {
                    let _ = limiter.check(&rule, "tenant-7", 1).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            limiter.shutdown().await;
        }));
    }

    // The JSON wants the token; the page itself holds nothing and opens without it.
    let bearer = format!("Authorization: Bearer {TOKEN}");
    let (status, body) = http(admin, "GET", "/api/overview", &[], "");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("Bearer"), "{body}");
    let (status, body) = http(
        admin,
        "GET",
        "/api/overview",
        &["Authorization: Bearer nope"],
        "",
    );
    assert_eq!(status, 401, "{body}");
    // The scheme is case-insensitive.
    let lower = format!("Authorization: bearer {TOKEN}");
    let (status, body) = http(admin, "GET", "/api/overview", &[&lower], "");
    assert_eq!(status, 200, "{body}");
    let (status, page) = http(admin, "GET", "/", &[], "");
    assert_eq!(status, 200);
    assert!(page.contains("Leasehold coordinator") && !page.contains("tenant-7"));

    // Wait for the coordinator to see the three gateways on the key over a settled second.
    let key = "lh:{api|tenant-7}";
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = http(admin, "GET", "/api/overview", &[&bearer], "");
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        let hot = v["keys"].as_array().and_then(|k| k.first()).cloned();
        if let Some(k) = hot
            && k["key"] == key
            && k["agents"] == 3
            && k["window_1s"]["admitted"].as_u64() > Some(0)
            && v["gateways"].as_object().map(serde_json::Map::len) == Some(3)
        {
            assert_eq!(v["store"], "ready");
            assert_eq!(v["rules"][0]["name"], "api");
            break;
        }
        assert!(Instant::now() < deadline, "the key never showed: {v}");
        std::thread::sleep(Duration::from_millis(250));
    }

    let url = format!("http://{admin}/#token={TOKEN}");
    let dom = browse(&url, &["--dump-dom"]);
    // The hot key, first in the table of keys.
    let keys = section(&dom, "</table>", "keys");
    assert!(
        keys.contains("<td class=\"l\">lh:{api|tenant-7}</td>"),
        "{keys}"
    );
    // Each gateway's share, named by its host and process, summing to the whole.
    let shares = section(&dom, "</table>", "shares");
    assert_eq!(
        shares.matches("<tr").count(),
        4,
        "a header and three gateways: {shares}"
    );
    assert_eq!(
        shares
            .matches(&format!("/{} (", std::process::id()))
            .count(),
        3,
        "gateways named HOST/PID: {shares}"
    );
    let p = percents(shares);
    assert_eq!(p.len(), 3, "{shares}");
    assert!((p.iter().sum::<f64>() - 100.0).abs() < 1.0, "shares {p:?}");
    // The bound: the last second's admissions against B + r = 4 000, and 10 s against
    // B + 10 r (or the seconds there are so far), within it.
    let bound = section(&dom, "<h2", "bound");
    assert!(bound.contains("last second (B + r)"), "{bound}");
    let admitted: u64 = bound
        .split("last second (B + r): ")
        .nth(1)
        .and_then(|r| r.split(" / 4,000").next())
        .map(|n| n.replace(',', ""))
        .and_then(|n| n.rsplit('>').next().map(str::to_owned))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no admissions against 4,000 in {bound}"));
    assert!(admitted > 0 && admitted <= 4000, "{bound}");
    assert!(bound.contains("last 10 s (B + 10 r)"), "{bound}");
    assert!(
        bound.contains("overshoot <span class=\"ok\">0.0%"),
        "{bound}"
    );
    let status = section(&dom, "<h2", "status");
    assert!(
        status.contains("ready") && status.contains("leader"),
        "{status}"
    );
    assert!(section(&dom, "</table>", "rules").contains("2,000"));

    // The picture, for a human to look at.
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("coordinator-page.png");
    let _ = std::fs::remove_file(&shot);
    browse(
        &url,
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1500,1300",
        ],
    );
    let size = std::fs::metadata(&shot).map_or(0, |m| m.len());
    assert!(
        size > 20_000,
        "screenshot {} is {size} bytes",
        shot.display()
    );
    println!("screenshot: {}", shot.display());

    stop.store(true, Ordering::Relaxed);
    rt.block_on(async {
        for t in tasks {
            t.await.expect("gateway task");
        }
    });
    assert!(coordinator.running(), "{}", coordinator.stderr());
}

#[test]
fn serve_s_page_lists_the_yaml_s_rules_and_the_addresses_it_shows_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = dir.path().join("config.yaml");
    std::fs::write(
        &yaml,
        "domain: gw\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 5}\n    descriptors:\n      - key: path\n        value: \"/v1/<b>\"\n        rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: health\n    rate_limit: {unlimited: true}\n",
    )
    .expect("yaml");
    let (serve, addr) = Proc::serve_http(yaml.to_str().unwrap(), None);
    let (status, page) = http(addr, "GET", "/", &[], "");
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("<code>gw.api_key</code>"), "{page}");
    // The limit and the bucket behind it (B, and how it is leased).
    assert!(page.contains("5 per minute (B 5, auto leasing)"), "{page}");
    assert!(page.contains("unlimited"), "{page}");
    // A value is text, never markup.
    assert!(
        page.contains("/v1/&lt;b&gt;") && !page.contains("/v1/<b>"),
        "{page}"
    );
    // The body shown for gw.api_key, sent as it is, decides against that limit: five
    // OK, then 429.
    let body = page
        .split("<code>gw.api_key</code>")
        .nth(1)
        .and_then(|rest| rest.split("<code>").nth(1))
        .and_then(|rest| rest.split("</code>").next())
        .expect("a body beside the rule")
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&");
    let codes: Vec<u16> = (0..6)
        .map(|_| http(addr, "POST", "/v1/check", &[], &body).0)
        .collect();
    assert_eq!(codes, [200, 200, 200, 200, 200, 429], "body {body}");
    // And the nginx address for it.
    let auth = page
        .split("<code>/v1/auth?")
        .nth(1)
        .and_then(|rest| rest.split("</code>").next())
        .expect("an auth address")
        .replace("&amp;", "&");
    let (status, _) = http(
        addr,
        "GET",
        &format!("/v1/auth?{auth}"),
        &["X-Leasehold-Value-api_key: k9"],
        "",
    );
    assert_eq!(status, 204, "/v1/auth?{auth}");
    drop(serve);
}
