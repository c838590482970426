//! The Grafana dashboard (`docs/grafana/leasehold.json`) against what the binaries
//! export: every query names a metric one of them declares, as the kind it is; every
//! declared metric is on the dashboard; every metric the code records is declared; and
//! the running `leasehold serve` and `leasehold coordinator` export what they declare.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use leasehold_redis_harness::RedisServer;

use super::ops_binaries::{Proc, http};

/// Every metric the binaries declare (and describe to their recorders), with its kind.
fn declared() -> BTreeMap<&'static str, &'static str> {
    use leasehold_agent::telemetry::{Kind, METRICS};
    let mut out = BTreeMap::new();
    for &(name, kind, _) in METRICS {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        assert!(out.insert(name, kind).is_none(), "{name} declared twice");
    }
    for list in [
        leasehold_coordinator::admin::METRICS,
        leasehold_serve::METRICS,
        leasehold_net::METRICS,
    ] {
        for &(name, kind, _) in list {
            assert!(out.insert(name, kind).is_none(), "{name} declared twice");
        }
    }
    out
}

/// Every `leasehold_...` name in `text`.
fn names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("leasehold_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The queries of the dashboard: panels' targets and the variables'.
fn queries(dashboard: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().expect("expr").to_owned());
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(q) = v["query"]["query"].as_str() {
            out.push(q.to_owned());
        }
    }
    out
}

#[test]
fn every_dashboard_query_names_a_metric_the_binaries_export() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/grafana/leasehold.json");
    let text = std::fs::read_to_string(&path).expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(dashboard["uid"], "leasehold");
    let declared = declared();
    let mut used = BTreeSet::new();
    let queries = queries(&dashboard);
    assert!(queries.len() > 30, "{} queries", queries.len());
    for q in &queries {
        assert!(
            q.matches('(').count() == q.matches(')').count(),
            "unbalanced: {q}"
        );
        let found = names(q);
        assert!(!found.is_empty(), "a query names no metric: {q}");
        for name in found {
            // A histogram is queried through its buckets.
            let (base, kind) = match name.strip_suffix("_bucket") {
                Some(base) => (base.to_owned(), Some("histogram")),
                None => (name.clone(), None),
            };
            let Some(&declared_kind) = declared.get(base.as_str()) else {
                panic!("{name} in {q:?} is not a metric the binaries export");
            };
            if let Some(kind) = kind {
                assert_eq!(declared_kind, kind, "{name} in {q:?}");
            }
            match declared_kind {
                "histogram" => assert!(name.ends_with("_bucket"), "{name} in {q:?}: buckets"),
                "counter" => assert!(
                    q.contains(&format!("rate({name}"))
                        || q.contains(&format!("increase({name}"))
                        || q.starts_with("label_values("),
                    "counter {name} in {q:?} is read through rate() or increase()"
                ),
                _ => assert!(
                    !q.contains(&format!("rate({name}")),
                    "gauge {name} in {q:?} under rate()"
                ),
            }
            used.insert(base);
        }
    }
    let missing: Vec<&&str> = declared.keys().filter(|n| !used.contains(**n)).collect();
    assert!(missing.is_empty(), "not on the dashboard: {missing:?}");
}

/// Every `counter!`/`gauge!`/`histogram!` of a literal name in the code is declared, so
/// the lists above are what the binaries record.
#[test]
fn every_metric_the_code_records_is_declared() {
    let declared = declared();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs = vec![root.join("src"), root.join("crates")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let p = e.path();
            if p.is_dir() && p.file_name().is_some_and(|n| n != "target" && n != "tests") {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut recorded = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).expect("source");
        for macro_ in ["counter!(", "gauge!(", "histogram!("] {
            for (i, _) in text.match_indices(macro_) {
                let call: String = text[i + macro_.len()..]
                    .trim_start()
                    .chars()
                    .take(80)
                    .collect();
                let Some(name) = call.strip_prefix('"').and_then(|c| c.split('"').next()) else {
                    continue;
                };
                recorded += 1;
                let kind = &macro_[..macro_.len() - 2];
                assert_eq!(
                    declared.get(name),
                    Some(&kind),
                    "{name} ({kind}, {}) is not declared as such",
                    f.display()
                );
            }
        }
    }
    assert!(recorded > 25, "{recorded} metrics found in the code");
}

/// The `# TYPE` lines of a Prometheus text: name to kind.
fn exported(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (n, k) = l.split_once(' ')?;
            Some((n.to_owned(), k.to_owned()))
        })
        .collect()
}

fn scrape_until(addr: SocketAddr, wanted: &[&str]) -> BTreeMap<String, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, text) = http(addr, "GET", "/metrics", &[], "");
        assert_eq!(status, 200, "{text}");
        let got = exported(&text);
        if wanted.iter().all(|w| got.contains_key(*w)) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "missing some of {wanted:?}: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_running_binaries_export_what_they_declare() {
    let declared = declared();
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = dir.path().join("config.yaml");
    std::fs::write(
        &yaml,
        "domain: gw\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    .expect("yaml");
    let (_serve, at) = Proc::serve_http(yaml.to_str().unwrap(), None);
    let body = r#"{"domain":"gw","descriptors":[{"entries":[{"key":"api_key","value":"k"}]}]}"#;
    for _ in 0..3 {
        http(at, "POST", "/v1/check", &[], body);
    }
    let redis = RedisServer::start().unwrap_or_else(|e| panic!("{e}"));
    let rules = dir.path().join("rules.toml");
    std::fs::write(&rules, "[rules.api]\ncapacity = 10\nrate = \"10/s\"\n").expect("rules");
    let (_coordinator, admin) = Proc::coordinator(rules.to_str().unwrap(), &redis.url(), &[]);
    for (addr, wanted) in [
        (
            at,
            &[
                "leasehold_serve_requests_total",
                "leasehold_decisions_total",
                "leasehold_connections_open",
            ][..],
        ),
        (
            admin,
            &[
                "leasehold_coordinator_leader",
                "leasehold_coordinator_agents",
                "leasehold_coordinator_tick_seconds",
            ][..],
        ),
    ] {
        for (name, kind) in scrape_until(addr, wanted) {
            if name.starts_with("leasehold_") {
                assert_eq!(
                    declared.get(name.as_str()).copied(),
                    Some(kind.as_str()),
                    "{name} exported by {addr} as a {kind}"
                );
            }
        }
    }
}
