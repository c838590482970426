//! `leasehold simulate`, briefly, on the embedded store and on a private redis-server:
//! the JSON report has every field and Leasehold's overshoot is 0.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::process::Command;

/// One simulate run at a time: each runs agents flat out on the machine's cores, and a
/// scenario that must reach a rate (hot-split's calls past the coordinator's budget) does
/// not reach it on a debug build beside three others.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `leasehold simulate` with `args` plus a JSON report; returns the report.
fn run(args: &[&str]) -> serde_json::Value {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (json, plot) = (dir.path().join("report.json"), dir.path().join("plot.svg"));
    let html = dir.path().join("report.html");
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .arg("simulate")
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&plot)
        .arg("--report")
        .arg(&html)
        .output()
        .expect("run leasehold simulate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{stdout}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg"));
    // The HTML report: the table, the same plot inline, the scenario, the columns' meaning.
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<table id=\"results\">"), "{page}");
    assert!(page.contains(&svg), "the plot inline");
    assert!(page.contains("<pre id=\"scenario\">name = "), "{page}");
    assert!(page.contains("<dt>below_limit</dt>"), "{page}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // One row per system the run measured (leasehold and its baselines, or a world and
    // its regions).
    let systems = report["systems"].as_object().expect("systems");
    assert!(!systems.is_empty());
    for name in systems.keys() {
        assert!(
            page.contains(&format!("<tr><td>{name}</td>")),
            "{name}: {page}"
        );
    }
    report
}

fn simulate(store: &str, scenario: &str) -> serde_json::Value {
    run(&[
        "--duration",
        "1.5",
        "--agents",
        "4",
        "--store",
        store,
        "--scenario",
        scenario,
    ])
}

fn check(report: &serde_json::Value) {
    for key in ["scenario", "store", "agents", "duration_s", "machine"] {
        assert!(report.get(key).is_some(), "missing {key}");
    }
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);
    for system in ["leasehold", "naive", "governor"] {
        let s = &report["systems"][system];
        for field in [
            "decisions_per_sec",
            "admitted",
            "denied",
            "redis_calls",
            "redis_calls_per_1k_decisions",
            "overshoot_1s",
            "overshoot_10s",
            "utilization",
            "denied_below_limit",
        ] {
            assert!(s[field].is_number(), "{system}.{field} missing in {s}");
        }
        for p in ["p50", "p95", "p99", "p999", "max"] {
            assert!(s["latency_ns"][p].is_u64(), "{system}.latency_ns.{p}");
        }
    }
    let l = &report["systems"]["leasehold"];
    assert_eq!(
        l["overshoot_10s"].as_f64(),
        Some(0.0),
        "leasehold overshoot: {l}"
    );
    assert_eq!(
        l["overshoot_1s"].as_f64(),
        Some(0.0),
        "leasehold overshoot: {l}"
    );
    assert!(l["admitted"].as_u64().unwrap() > 0);
}

#[test]
fn simulate_embedded_hot_key() {
    check(&simulate("embedded", "hot-key"));
}

/// A load far below one decision per agent per run (2 a second over 200 agents: each
/// agent's next decision is 100 s away) still ends when the run does: the agents' waits
/// stop at its end.
#[test]
fn a_sparse_load_ends_with_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sparse.toml");
    std::fs::write(
        &file,
        "name = \"sparse\"\nagents = 200\n[rule]\ncapacity = 100\nrate = \"100/s\"\n\
         [keys]\ncount = 1\n[[phases]]\nat = 0.0\ntotal = 2\n",
    )
    .unwrap();
    let started = std::time::Instant::now();
    let r = run(&[
        "--scenario-file",
        file.to_str().unwrap(),
        "--duration",
        "2",
        "--compare",
        "none",
    ]);
    let took = started.elapsed();
    assert!(r["systems"]["leasehold"].is_object());
    // Two seconds of run, the agents' start and the report: well within a minute (it
    // waited out the agents' 100 s before).
    assert!(took < std::time::Duration::from_secs(60), "took {took:?}");
}

/// `--repeat` runs the comparison again and ends with each baseline's per-run ratios to
/// Leasehold and their medians.
#[test]
fn repeated_runs_end_with_the_median_ratios() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["simulate", "--scenario", "hot-key", "--agents", "2"])
        .args(["--duration", "0.5", "--compare", "naive", "--repeat", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for i in 1..=3 {
        assert!(stdout.contains(&format!("run {i} of 3\n")), "{stdout}");
    }
    assert!(
        stdout.contains("over 3 runs: leasehold's worst overshoot 0.0000"),
        "{stdout}"
    );
    let line = (stdout.lines())
        .find(|l| l.starts_with("leasehold / naive, median of the runs' ratios"))
        .unwrap_or_else(|| panic!("no median line: {stdout}"));
    // decisions/s M.MMx (a, b, c): the median is the middle of the three.
    let (_, rest) = line.split_once("decisions/s ").unwrap();
    let (m, rest) = rest.split_once("x (").unwrap();
    let each: Vec<f64> = (rest.split_once(')').unwrap().0.split(", "))
        .map(|v| v.parse().unwrap())
        .collect();
    let mut sorted = each.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(each.len(), 3, "{line}");
    assert_eq!(format!("{:.2}", sorted[1]), m, "{line}");
    assert!(
        stdout.contains("leasehold's medians: decisions/s "),
        "{stdout}"
    );
}

#[test]
fn simulate_spawned_redis_zipf() {
    let r = simulate("spawn", "zipf");
    check(&r);
    assert!(r["store"].as_str().unwrap().starts_with("spawn"));
    assert_eq!(
        r["systems"]["naive"]["redis_calls_per_1k_decisions"].as_f64(),
        Some(1000.0)
    );
    // On two cores or more the spawned Redis had one of its own, and the runtime the rest.
    let machine = std::thread::available_parallelism().map_or(1, |n| n.get());
    if machine >= 2 {
        let core = r["machine"]["redis_core"].as_u64();
        assert!(
            core.is_some_and(|c| (c as usize) < machine),
            "{}",
            r["machine"]
        );
        assert_eq!(
            r["machine"]["runtime_cores"].as_u64(),
            Some(machine as u64 - 1),
            "{}",
            r["machine"]
        );
    }
}

#[test]
fn simulate_store_outage_follows_the_failure_policy() {
    let r = run(&[
        "--scenario",
        "redis-down",
        "--store",
        "embedded",
        "--duration",
        "2",
        "--agents",
        "2",
        "--compare",
        "naive",
    ]);
    let l = &r["systems"]["leasehold"];
    assert!(
        l["unavailable"].as_u64().unwrap() > 0,
        "fail_closed answers 503 while the store is down: {l}"
    );
    assert!(l["admitted"].as_u64().unwrap() > 0);
    assert_eq!(l["overshoot_10s"].as_f64(), Some(0.0), "{l}");
}

#[test]
fn simulate_failover_promotes_the_replica_and_keeps_deciding() {
    let r = run(&[
        "--scenario",
        "failover",
        "--duration",
        "2",
        "--agents",
        "2",
        "--compare",
        "none",
    ]);
    assert_eq!(r["store"], "spawn-replica");
    let l = &r["systems"]["leasehold"];
    // Decisions go on after the promotion: the agents re-declare what they hold.
    assert!(l["admitted"].as_u64().unwrap() > 0, "{l}");
}

/// The built-in hot-split scenario with the coordinator's budget at 200 calls a second
/// instead of 500: a debug build beside the other tests makes too few decisions a second
/// for its key to pass 500.
const HOT_SPLIT: &str = r#"
name = "hot-split"
agents = 8
store = "cluster-spawn"
split_above = 200.0
[rule]
capacity = 100000
rate = "200000/s"
lease_max = 20
[keys]
count = 1
[[phases]]
at = 0.0
offered = 0.0
[[faults]]
at = 0.6
action = "stop-coordinator"
[[faults]]
at = 0.8
action = "start-coordinator"
"#;

#[test]
fn simulate_hot_split_splits_the_key_and_survives_a_coordinator_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("hot-split.toml");
    std::fs::write(&file, HOT_SPLIT).unwrap();
    let r = run(&[
        "--scenario-file",
        file.to_str().unwrap(),
        "--duration",
        "8",
        "--compare",
        "none",
    ]);
    let c = &r["coordinator"];
    println!("{c}");
    assert!(c["splits"].as_u64().unwrap() >= 1, "{c}");
    assert_eq!(c["instances"], 2, "stopped at 60%, started at 80%: {c}");
    assert_eq!(c["worst_overshoot"].as_f64().unwrap(), 0.0, "{c}");
    assert_eq!(
        r["systems"]["leasehold"]["overshoot_1s"].as_f64().unwrap(),
        0.0
    );
}

#[test]
fn simulate_region_partition_keeps_the_worldwide_bound() {
    let r = run(&[
        "--scenario",
        "region-partition",
        "--duration",
        "8",
        "--compare",
        "none",
    ]);
    let world = &r["systems"]["world"];
    println!("{}", r["regions"]);
    assert_eq!(world["overshoot_1s"].as_f64(), Some(0.0), "{world}");
    assert_eq!(world["overshoot_10s"].as_f64(), Some(0.0), "{world}");
    let admitted = |k: &str| {
        r["systems"][format!("region {k}")]["admitted"]
            .as_u64()
            .unwrap()
    };
    // Region 0 is cut off for 30% of the run: it admits less than the others, who do not
    // lose their share.
    assert!(admitted("r0") < admitted("r1") && admitted("r0") < admitted("r2"));
    assert!(admitted("r1") > 0 && admitted("r2") > 0);
    // Calls across regions are per key and renewal, not per decision.
    let g = &r["regions"];
    assert!(g["cross_calls"].as_u64().unwrap() > 0, "{g}");
    assert!(
        g["cross_calls_per_1k_decisions"].as_f64().unwrap() < 10.0,
        "{g}"
    );
}

#[test]
fn simulate_refuses_bad_input_with_a_reason() {
    for (args, want) in [
        (vec!["--scenario", "nope"], "unknown scenario"),
        (vec!["--store", "memcached://x"], "unknown store"),
        (vec!["--duration", "0"], "--duration"),
        (vec!["--compare", "envoy"], "--compare"),
        (
            vec!["--scenario", "failover", "--store", "embedded"],
            "promote-replica",
        ),
        (
            vec!["--scenario", "regions", "--regions", "0"],
            "regions = 0",
        ),
        (
            vec!["--scenario", "regions", "--region-rtt", "forever"],
            "region_rtt",
        ),
        (vec!["--agents", "0"], "--agents 0: must be 1..=1000"),
        (
            vec!["--repeat", "0"],
            "'--repeat <REPEAT>': 0 is not in 1..=50",
        ),
        (
            vec!["--repeat=-1"],
            "'--repeat <REPEAT>': -1 is not in 1..=50",
        ),
        // A file that cannot be created there: refused before the run, not after it.
        (
            vec!["--report", "/proc/leasehold-test.html"],
            "--report /proc/leasehold-test.html",
        ),
        // A malformed address: refused before the run, what is wrong named, none shown.
        (
            vec!["--store", "redis://:hunter2@127.0.0.1:notaport"],
            "--store: store address: the part after `@`",
        ),
        // Nothing listens on port 1: the error names the store, its password hidden.
        (
            vec!["--store", "redis://:hunter2@127.0.0.1:1", "--duration", "1"],
            "on the store redis://***@127.0.0.1:1",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .arg("simulate")
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("hunter2"), "{args:?}: {err}");
        // A bad scenario is refused before the run's header.
        if args[0] == "--agents"
            || args[0] == "--report"
            || args.iter().any(|a| a.contains("notaport"))
        {
            assert!(out.stdout.is_empty(), "{args:?} printed before refusing");
        }
    }
}

/// A scenario file's mistakes are refused naming what the user wrote: the `[rule]` table
/// (not the name the run gives it), a phase's `at` as a fraction of `--duration`, the
/// active agent out of range, `total` beside `offered`.
#[test]
fn a_bad_scenario_file_is_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let head = "name = \"x\"\nagents = 2\n[rule]\ncapacity = 10\nrate = \"10/s\"\n";
    let keys = "[keys]\ncount = 1\n[[phases]]\nat = 0.0\ntotal = 10\n";
    for (i, (text, want)) in [
        (
            format!("{head}leasing = \"rate\"\nterm = \"2h\"\n{keys}"),
            "scenario x: [rule] term = \"2h\": must be between 100ms and 1h: a longer one",
        ),
        (
            format!("{head}{keys}[[phases]]\nat = 3.0\ntotal = 5\n"),
            "phase at 3: at is a fraction of --duration, in [0, 1)",
        ),
        (
            format!("{head}{keys}[[phases]]\nat = 0.5\ntotal = 5\nactive = [7]\n"),
            "active agent 7 is not one of the 2 agents",
        ),
        (
            format!("{head}{keys}[[phases]]\nat = 0.5\ntotal = 5\noffered = 3\n"),
            "give total (decisions/s of all the active agents) or offered (per agent), not both",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.path().join(format!("bad-{i}.toml"));
        std::fs::write(&path, &text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .arg("simulate")
            .arg("--scenario-file")
            .arg(&path)
            .args(["--duration", "1"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{text} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{text}: {err}");
    }
}

/// A scenario's phases start at fractions of `--duration`: the header says when, in
/// seconds, so a scenario written for a longer run (fleet-rate-shifting moves its demand
/// every 4 s of a 24 s run) does not move it faster unseen in a short one.
#[test]
fn the_header_says_when_the_phases_start() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["simulate", "--scenario", "burst", "--store", "embedded"])
        .args([
            "--duration",
            "1",
            "--warm-up",
            "0",
            "--agents",
            "1",
            "--compare",
            "none",
        ])
        .output()
        .expect("run leasehold simulate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("phases start at 0 s, 0.4 s, 0.6 s of the 1 s measured"),
        "{stdout}"
    );
}
