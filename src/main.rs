//! The `leasehold` command line.

mod chaos;
mod simulate;

/// mimalloc, not glibc's malloc: `leasehold serve` allocates per request (gRPC frames,
/// decisions in flight), and glibc's malloc, free and consolidation were a sixth of its
/// CPU under load (perf, 100 000 tenants).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use leasehold::core::rule::Leasing;

#[derive(Parser)]
#[command(
    name = "leasehold",
    version,
    about = "Hierarchical local-plus-global rate limiter with leased budgets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text or JSON (to stderr; RUST_LOG filters; default info for the
    /// coordinator and serve, warn otherwise).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "LEASEHOLD_LOG_FORMAT"
    )]
    log_format: leasehold::coordinator::cli::LogFormat,
}

/// A baseline `simulate` runs after Leasehold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Baseline {
    /// The naive per-request Lua token bucket.
    Naive,
    /// governor, in process (a local limit per agent).
    Governor,
    /// Envoy's rate limit quota filter, one per agent, on `leasehold serve` (the
    /// scenario's `rlqs_servers` instances): Envoy deciding locally with assignments.
    Rlqs,
    /// No baseline.
    None,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the coordinator: accounting of admitted tokens against each key's bound,
    /// hot-key splitting, and the admin endpoint (health, metrics, JSON views of keys).
    Coordinator(leasehold::coordinator::cli::Args),
    /// Serves the Envoy rate limit service v3 over gRPC (envoyproxy/ratelimit's YAML
    /// configuration as it is) and an HTTP check API (JSON, and a GET form for nginx
    /// auth_request), with /metrics and /health.
    Serve(leasehold_serve::cli::Args),
    /// Runs agents against a global store under a workload and reports Leasehold, the
    /// naive per-request Lua bucket and governor side by side.
    Simulate {
        /// A built-in scenario: steady, burst, hot-key, zipf, long-tail, zipf-store,
        /// long-tail-store, shifting, agent-crash, redis-down, failover, failover-wait,
        /// cluster, hot-split, fleet, fleet-under, regions, region-partition.
        #[arg(
            long,
            default_value = "hot-key",
            conflicts_with = "scenario_file",
            env = "LEASEHOLD_SCENARIO"
        )]
        scenario: String,
        /// A scenario file (TOML; the format: docs/scenarios.md).
        #[arg(long, env = "LEASEHOLD_SCENARIO_FILE")]
        scenario_file: Option<PathBuf>,
        /// embedded | spawn (a private redis-server) | spawn-replica | cluster-spawn |
        /// redis://HOST:PORT | rediss://HOST:PORT | cluster://HOST:PORT,HOST:PORT.
        /// Default: the scenario's store, else embedded. (Read as text and parsed after:
        /// a value clap refused would be echoed, password and all.)
        #[arg(long, env = "LEASEHOLD_STORE", hide_env_values = true)]
        store: Option<String>,
        /// Let a spawned Redis (spawn, spawn-replica) share the cores with the agents and
        /// the load. By default, on two cores or more, it runs on a core of its own, as a
        /// Redis server has its own machine: sharing, the scheduler's preemptions of Redis
        /// set both systems' tails.
        #[arg(long, env = "LEASEHOLD_SHARED_CORES")]
        shared_cores: bool,
        /// Agents (gateways); default: the scenario's.
        #[arg(long, env = "LEASEHOLD_AGENTS")]
        agents: Option<usize>,
        /// Seconds each system runs.
        #[arg(long, default_value_t = 6.0, env = "LEASEHOLD_DURATION")]
        duration: f64,
        /// Seconds each system runs the scenario's first phase before `--duration` begins,
        /// not counted in the figures (a large fleet's start), though its overshoot is.
        #[arg(long, default_value_t = 0.0, env = "LEASEHOLD_WARM_UP")]
        warm_up: f64,
        /// Baselines to run after Leasehold (comma-separated).
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "naive,governor",
            env = "LEASEHOLD_COMPARE"
        )]
        compare: Vec<Baseline>,
        /// Write the JSON report here.
        #[arg(long, env = "LEASEHOLD_JSON")]
        json: Option<PathBuf>,
        /// Write an SVG plot of admitted rate vs the limit here.
        #[arg(long, env = "LEASEHOLD_PLOT")]
        plot: Option<PathBuf>,
        /// Write an HTML report here: the settings, the table and what its columns mean,
        /// the plot and the scenario, in one file to share.
        #[arg(long, env = "LEASEHOLD_REPORT")]
        report: Option<PathBuf>,
        /// Random seed of the workload.
        #[arg(long, default_value_t = 1, env = "LEASEHOLD_SEED")]
        seed: u64,
        /// Run the whole comparison this many times (1 to 50), each system after the other
        /// every time, then print Leasehold's medians and each baseline's ratios to
        /// Leasehold per run with their medians: on a shared machine one run's ratio moves
        /// by tens of percent.
        #[arg(
            long,
            default_value_t = 1,
            value_parser = clap::value_parser!(u32).range(1..=50),
            env = "LEASEHOLD_REPEAT"
        )]
        repeat: u32,
        /// Run across this many regions (a private redis-server each, plus the global
        /// one; agent i in region i % N); default: the scenario's.
        #[arg(long, env = "LEASEHOLD_REGIONS")]
        regions: Option<usize>,
        /// With regions: the round trip between a region's broker and the global store
        /// (default: the scenario's, else 80ms).
        #[arg(long, env = "LEASEHOLD_REGION_RTT")]
        region_rtt: Option<String>,
    },
    /// Runs the fault matrix under HTTP load against the example gateway (private
    /// Redis primary and replica, coordinator and gateway as processes) and prints one
    /// table row per fault. `scripts/chaos` builds what it needs and runs it.
    Chaos {
        /// The example gateway binary (`cargo build --release --example gateway`).
        #[arg(
            long,
            default_value = "target/release/examples/gateway",
            env = "LEASEHOLD_GATEWAY"
        )]
        gateway: PathBuf,
        /// Distinct API keys in the gateway's flood.
        #[arg(long, default_value_t = 1_000_000, env = "LEASEHOLD_FLOOD_KEYS")]
        flood_keys: u64,
        /// Distinct descriptor values in serve's flood.
        #[arg(long, default_value_t = 300_000, env = "LEASEHOLD_SERVE_VALUES")]
        serve_values: u64,
        /// Run only these topologies (comma-separated: gateway, sentinel, cluster,
        /// serve); all by default.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "gateway,sentinel,cluster,serve"
        )]
        only: Vec<chaos::Topology>,
        /// Seconds serve is watched after its flood (its memory must not grow).
        #[arg(long, default_value_t = 60.0, env = "LEASEHOLD_IDLE")]
        idle: f64,
        /// Seconds each fault holds before it is cleared.
        #[arg(long, default_value_t = 3.0, env = "LEASEHOLD_HOLD")]
        hold: f64,
        /// Seconds each phase is watched after the fault is cleared.
        #[arg(long, default_value_t = 4.0, env = "LEASEHOLD_WATCH")]
        watch: f64,
    },
    /// Reads a rules file, or envoyproxy/ratelimit's YAML as `serve` reads it, validates
    /// every rule and prints what each one means.
    CheckConfig {
        /// The TOML rules file (`[rules.NAME]` tables), or a `.yaml`/`.yml` file (or a
        /// directory of them) in envoyproxy/ratelimit's format.
        #[arg(env = "LEASEHOLD_CONFIG")]
        file: PathBuf,
        /// YAML files naming the same domain add their descriptors to it (as serve's).
        #[arg(long, env = "MERGE_DOMAIN_CONFIG")]
        merge_domain_config: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.command {
        Command::Coordinator(_) | Command::Serve(_) => "info",
        _ => "warn",
    };
    leasehold::coordinator::cli::init_logging(cli.log_format, level);
    match cli.command {
        Command::CheckConfig {
            file,
            merge_domain_config,
        } => check_config(&file, merge_domain_config),
        Command::Chaos {
            gateway,
            flood_keys,
            serve_values,
            only,
            idle,
            hold,
            watch,
        } => {
            if !(hold.is_finite() && watch.is_finite() && hold >= 0.0 && watch >= 1.0) {
                return usage("--hold must be >= 0 and --watch >= 1 (seconds)");
            }
            if !(idle.is_finite() && (1.0..=3600.0).contains(&idle)) {
                return usage("--idle must be between 1 and 3600 (seconds)");
            }
            match chaos::run(chaos::Options {
                gateway,
                flood_keys,
                serve_values,
                only,
                idle: Duration::from_secs_f64(idle),
                hold: Duration::from_secs_f64(hold),
                watch: Duration::from_secs_f64(watch),
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Coordinator(args) => coordinator(args),
        Command::Serve(args) => serve(args),
        Command::Simulate {
            scenario,
            scenario_file,
            store,
            shared_cores,
            agents,
            duration,
            warm_up,
            compare,
            json,
            plot,
            report,
            seed,
            repeat,
            regions,
            region_rtt,
        } => {
            let scenario = match scenario_file {
                Some(path) => simulate::Scenario::from_file(&path),
                None => simulate::Scenario::built_in(&scenario),
            };
            let mut scenario = match scenario {
                Ok(s) => s,
                Err(e) => return usage(&e),
            };
            if let Some(n) = agents {
                if !(1..=1000).contains(&n) {
                    return usage(&format!("--agents {n}: must be 1..=1000"));
                }
                scenario.agents = n;
            }
            if regions.is_some() {
                scenario.regions = regions;
            }
            if region_rtt.is_some() {
                scenario.region_rtt = region_rtt;
            }
            if !(duration > 0.0 && duration <= 3600.0) {
                return usage(&format!(
                    "--duration {duration}: must be in (0, 3600] seconds"
                ));
            }
            if !(0.0..=3600.0).contains(&warm_up) {
                return usage(&format!(
                    "--warm-up {warm_up}: must be in [0, 3600] seconds"
                ));
            }
            if warm_up > 0.0 && scenario.regions.is_some() {
                return usage("--warm-up: not for runs across regions");
            }
            let mut names: Vec<String> = Vec::new();
            for b in compare {
                let name = match b {
                    Baseline::Naive => "naive",
                    Baseline::Governor => "governor",
                    Baseline::Rlqs => "rlqs",
                    Baseline::None => continue,
                };
                if !names.iter().any(|n| n == name) {
                    names.push(name.to_owned());
                }
            }
            let compare = names;
            let store = match store.as_deref().map(str::parse) {
                Some(Ok(store)) => store,
                Some(Err(e)) => return usage(&format!("--store: {e}")),
                None => match scenario.store.as_deref().map(str::parse) {
                    Some(Ok(store)) => store,
                    Some(Err(e)) => {
                        return usage(&format!("scenario {}: store: {e}", scenario.name));
                    }
                    None => simulate::StoreChoice::Embedded,
                },
            };
            // Written after the run: a path that cannot be written is refused before it.
            for (flag, path) in [("--json", &json), ("--plot", &plot), ("--report", &report)] {
                if let Some(p) = path {
                    let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
                    if p.is_dir() || dir.is_some_and(|d| !d.is_dir()) {
                        return usage(&format!(
                            "{flag} {}: not a file in an existing directory",
                            p.display()
                        ));
                    }
                    // Opened once for writing now (a read-only directory, a file without
                    // write permission), and left as it was.
                    let existed = p.exists();
                    let probe = std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(p);
                    if let Err(e) = probe {
                        return usage(&format!("{flag} {}: {e}", p.display()));
                    }
                    if !existed {
                        let _ = std::fs::remove_file(p);
                    }
                }
            }
            let opts = simulate::Options {
                scenario,
                store,
                duration: Duration::from_secs_f64(duration),
                warm_up: Duration::from_secs_f64(warm_up),
                compare,
                json,
                plot,
                report,
                seed,
                progress: true,
                shared_cores,
            };
            // A bad scenario is refused before anything is printed or started.
            if let Err(e) = opts.scenario.validate() {
                return usage(&e);
            }
            println!(
                "simulate: scenario {}, {} agents, {} s per system, built-in scenarios: {}",
                opts.scenario.name,
                opts.scenario.agents,
                duration,
                simulate::BUILT_IN.join(", ")
            );
            // A phase's `at` is a fraction of the run: said in seconds, so a scenario
            // written for a longer run does not move its demand faster unseen.
            if opts.scenario.phases.len() > 1 {
                let at: Vec<String> = (opts.scenario.phases.iter())
                    .map(|p| {
                        let t = format!("{:.3}", p.at * duration);
                        format!("{} s", t.trim_end_matches('0').trim_end_matches('.'))
                    })
                    .collect();
                println!(
                    "phases start at {} of the {duration} s measured (each phase's `at` is a \
                     fraction of --duration; the warm-up runs the first)",
                    at.join(", ")
                );
            }
            let mut runs = Vec::new();
            for i in 1..=repeat {
                if repeat > 1 {
                    println!("run {i} of {repeat}");
                }
                match simulate::run(&opts) {
                    Ok(report) => {
                        print!("{}", simulate::table(&report));
                        runs.push(report);
                    }
                    Err(e) => return fail(&e),
                }
            }
            if repeat > 1 {
                print!("{}", simulate::medians(&runs));
                if opts.json.is_some() || opts.plot.is_some() || opts.report.is_some() {
                    println!(
                        "the JSON report, plot and HTML report are the last run's (run {repeat} of \
                         {repeat}); the medians are the lines above"
                    );
                }
            }
            // The JSON report and the plot are the last run's (written as it ends).
            if let (Some(path), Some(last)) = (&opts.report, runs.last()) {
                let page = simulate::html::report(&opts, last);
                if let Err(e) = std::fs::write(path, page) {
                    return fail(&format!("--report {}: {e}", path.display()));
                }
                println!("report written to {}", path.display());
            }
            ExitCode::SUCCESS
        }
    }
}

fn serve(args: leasehold_serve::cli::Args) -> ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("tokio runtime: {e}")),
    };
    let done = rt.block_on(leasehold_serve::cli::run(
        args,
        leasehold_net::stop_signal(),
    ));
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn coordinator(args: leasehold::coordinator::cli::Args) -> ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("tokio runtime: {e}")),
    };
    // The rules as serve reads them: envoyproxy/ratelimit's YAML (its limits' rules, named
    // as serve names them) or a Leasehold rules file.
    let load: leasehold::coordinator::cli::LoadRules =
        |path| leasehold_serve::cli::load(path, true).map(|(_, rules)| rules);
    let done = rt.block_on(leasehold::coordinator::cli::run_with(
        args,
        leasehold_net::stop_signal(),
        load,
    ));
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

/// A runtime error (a store unreachable, a refused config file, a port taken): exit 1.
fn fail(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::FAILURE
}

/// A usage error (a flag's value out of range, an unknown scenario): exit 2, as clap
/// exits for the flags it refuses itself.
fn usage(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(2)
}

/// One row of check-config's table; `on_failure` in place of the rule's own policy (a
/// limit that leaves a store outage to Envoy).
fn print_rule(label: &str, r: &leasehold::core::Rule, on_failure: Option<&str>) {
    let s = leasehold::store::rules::RuleSummary::of(label, r);
    println!(
        "{:<36} {:>10} {:>14} {:>9} {:>7} {:>9} {:>10} {:>6}  {}",
        s.name,
        s.capacity,
        s.rate,
        s.lease_max,
        s.leasing,
        s.ttl,
        s.mode,
        if s.shadow { "yes" } else { "no" },
        on_failure.unwrap_or(&s.on_failure)
    );
    if let Some(local) = s.local {
        println!("{:<36} {local}", "");
    }
}

fn check_config(file: &std::path::Path, merge: bool) -> ExitCode {
    // A rules file, or envoyproxy/ratelimit's YAML as serve reads it.
    let (domains, rules) = match leasehold_serve::cli::load(file, merge) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let names = domains.domain_names();
    if !names.is_empty() {
        println!(
            "envoyproxy/ratelimit configuration: domain(s) {}; each limit is a rule named \
             DOMAIN.KEY[_VALUE].KEY[_VALUE]...",
            names.join(", ")
        );
    }
    // By the rule names listed below (a descriptor's value may have been made one): limits
    // with no leasehold.on_failure leave a store outage to Envoy, as envoyproxy/ratelimit
    // does.
    let to_envoy: Vec<&str> = (domains.limits().into_values())
        .filter_map(|l| match &l.action {
            leasehold_serve::config::Action::Rule(r) if l.failure_to_envoy => Some(r.as_str()),
            _ => None,
        })
        .collect();
    let envoy = |name: &str| {
        to_envoy
            .contains(&name)
            .then_some("Envoy's (gRPC), 503 (HTTP)")
    };
    println!(
        "{:<36} {:>10} {:>14} {:>9} {:>7} {:>9} {:>10} {:>6}  on failure",
        "rule / override", "capacity", "rate", "lease max", "leasing", "ttl/term", "mode", "shadow"
    );
    let mut overrides = 0;
    // The smallest capacity leased by rate (none: u64::MAX): what bounds how many gateways
    // can hold a burst.
    let rate_capacity = |r: &leasehold::core::Rule| {
        if r.leasing() == Leasing::Rate {
            r.capacity().get()
        } else {
            u64::MAX
        }
    };
    let mut rated_b = u64::MAX;
    for r in rules.iter() {
        rated_b = rated_b.min(rate_capacity(r));
        let name = r.name().to_string();
        print_rule(&name, r, envoy(&name));
        for (subject, o) in rules
            .overrides(r.name().as_str())
            .into_iter()
            .flat_map(|o| o.iter())
        {
            // Long names (a sha256: digest, a long subject) are cut to fit the column.
            let mut shown: String = subject.chars().take(20).collect();
            if shown.len() < subject.len() {
                shown.push('…');
            }
            print_rule(&format!("  override {shown:?}"), o, envoy(&name));
            rated_b = rated_b.min(rate_capacity(o));
            overrides += 1;
        }
    }
    if rated_b < u64::MAX {
        println!(
            "rate: each gateway holds a share of the rate and a burst for the term, renewed at \
             three quarters of it (a second before its end past 4 s); the term is shorter \
             while few gateways share a key (0.4 s \
             up to 100, then 4 ms a gateway, twice that for a steady renewal, up to the term \
             shown). For keys shared by hundreds of gateways: the store's calls stay near \
             140 a second per key at 1 000 gateways in steady state (the default 8 s term), \
             up to 330 while demand moves, and about 300-450 in a fleet's first seconds; with \
             a few gateways per key, lease (or auto) uses the bucket a little better."
        );
        println!(
            "rate: a gateway's share comes with a burst of one token at least out of the \
             capacity, and it smooths its requests over its burst only: give such a key about \
             5 tokens of capacity per gateway that shares it (the smallest here, {rated_b}, \
             suits about {} gateways). With fewer, gateways refuse below the limit (100 \
             gateways at 1.3x the limit used 0.64 of it with a capacity of 100, 0.15 with 20); \
             leasing = \"exact\" serves a small capacity shared by many gateways, one store \
             call per request.",
            (rated_b / 5).max(1)
        );
    }
    if !to_envoy.is_empty() {
        println!(
            "on failure: {} limit(s) with no leasehold.on_failure ({}{}) answer a store outage \
             over gRPC with an error (UNAVAILABLE) that Envoy's failure_mode_deny decides, as \
             envoyproxy/ratelimit does (Envoy lets the request through by default); over \
             HTTP, 503. Set on_failure to decide here.",
            to_envoy.len(),
            to_envoy
                .iter()
                .take(3)
                .copied()
                .collect::<Vec<_>>()
                .join(", "),
            if to_envoy.len() > 3 { ", …" } else { "" }
        );
    }
    // Descriptors that decide without a bucket: no rule, so not in the table.
    let mut fixed = 0;
    for (key, l) in domains.limits() {
        let what = match l.action {
            leasehold_serve::config::Action::Unlimited => "unlimited: always OK, not counted",
            leasehold_serve::config::Action::DenyAll => "requests_per_unit: 0: always OVER_LIMIT",
            leasehold_serve::config::Action::Rule(_) => continue,
        };
        let shadow = if l.shadow {
            " (shadow_mode: reported, never enforced)"
        } else {
            ""
        };
        println!("{key:<36} {what}{shadow}");
        fixed += 1;
    }
    let fixed = if fixed > 0 {
        format!(", {fixed} descriptor(s) without a bucket")
    } else {
        String::new()
    };
    println!("{} rule(s), {overrides} override(s){fixed} ok", rules.len());
    ExitCode::SUCCESS
}
