//! `leasehold simulate`: many agents against one global store under a workload, with
//! Leasehold, the naive per-request Lua token bucket (one script call per decision) and
//! governor (local only) measured one after the other in the same process, and reported
//! side by side.
//!
//! Each agent is one `Limiter` (its own connections, its own leases), as each gateway
//! would have; its threads are tasks on one tokio runtime. Governor gets, per agent, an
//! even share of the rule (`r / agents`, `B / agents`): the usual way to run a local-only
//! limiter behind a load balancer.

mod cores;
mod env;
pub(crate) mod html;
mod regions;
mod report;
mod run;
mod scenario;
mod systems;

use std::path::PathBuf;
use std::time::Duration;

pub(crate) use env::StoreChoice;
pub(crate) use report::SystemReport;
pub(crate) use run::run;
pub(crate) use scenario::{BUILT_IN, Scenario};

/// What to run.
pub(crate) struct Options {
    pub(crate) scenario: Scenario,
    pub(crate) store: StoreChoice,
    pub(crate) duration: Duration,
    /// Run before `duration`, on the first phase, and not counted (but for overshoot).
    pub(crate) warm_up: Duration,
    pub(crate) compare: Vec<String>,
    pub(crate) json: Option<PathBuf>,
    pub(crate) plot: Option<PathBuf>,
    /// The HTML report ([`html::report`]).
    pub(crate) report: Option<PathBuf>,
    pub(crate) seed: u64,
    pub(crate) progress: bool,
    /// A spawned Redis shares the cores with the load instead of having one of its own
    /// ([`cores`]).
    pub(crate) shared_cores: bool,
}

/// The whole report of a run.
pub(crate) struct RunReport {
    pub(crate) systems: Vec<(String, SystemReport)>,
    /// What the coordinator saw during Leasehold's run (Redis stores).
    pub(crate) coordinator: Option<CoordinatorSummary>,
    /// A run across regions: what crossed between them.
    pub(crate) regions: Option<regions::RegionsSummary>,
    /// The store's health as Leasehold's agents saw it.
    pub(crate) agent_faults: Option<AgentFaults>,
    /// The rlqs run: servers, filters, and what went between them and the store.
    pub(crate) rlqs: Option<RlqsSummary>,
    /// The plot of the admitted rate against the limit (SVG).
    pub(crate) plot: String,
}

/// The rlqs system's run (over the whole run, warm-up included).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RlqsSummary {
    pub(crate) servers: usize,
    pub(crate) filters: usize,
    /// Assignments the filters received, a second.
    pub(crate) assignments_per_sec: f64,
    /// The servers' store calls, a second.
    pub(crate) calls_per_sec: f64,
}

/// The store's health as Leasehold's agents saw it (summed over the agents alive at the
/// end of the run): a run whose store stalled shows it here, not only as denials.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct AgentFaults {
    pub(crate) store_errors: u64,
    pub(crate) emergency_activations: u64,
    pub(crate) admitted_emergency: u64,
    pub(crate) admitted_fail_open: u64,
    pub(crate) unavailable: u64,
}

/// The coordinator's view of Leasehold's run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct CoordinatorSummary {
    /// Splits started (over every coordinator instance of the run).
    pub(crate) splits: u64,
    /// The largest overshoot against `B + r*W` it measured (1-10 s windows).
    pub(crate) worst_overshoot: f64,
    /// Tokens admitted by the agents, by their reports.
    pub(crate) admitted: u64,
    /// Coordinator instances started (a stop-coordinator fault ends one).
    pub(crate) instances: u64,
}

/// Each system's report by its name, as the JSON report holds them.
pub(super) fn systems_json(
    systems: &[(String, SystemReport)],
) -> serde_json::Map<String, serde_json::Value> {
    systems
        .iter()
        .map(|(n, r)| (n.clone(), serde_json::to_value(r).unwrap_or_default()))
        .collect()
}

/// Writes the JSON report and the plot the options ask for; returns the plot.
pub(super) fn write_outputs(
    opts: &Options,
    json: &serde_json::Value,
    title: &str,
    rate: f64,
    systems: &[(String, SystemReport)],
) -> Result<String, String> {
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(json).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let series: Vec<(String, Vec<f64>)> = systems
        .iter()
        .map(|(n, r)| (n.clone(), r.series.clone()))
        .collect();
    let plot = report::svg(title, rate, &series);
    if let Some(path) = &opts.plot {
        std::fs::write(path, &plot).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(plot)
}

/// The summary table's columns, with their widths in the text table.
const COLUMNS: [(&str, usize); 15] = [
    ("system", 10),
    ("decisions/s", 13),
    ("admitted", 11),
    ("denied", 11),
    ("below_limit", 11),
    ("calls/1k", 12),
    ("store us/dec", 12),
    ("overshoot1s", 11),
    ("overshoot10s", 12),
    ("utilization", 11),
    ("p50 ns", 9),
    ("p99 ns", 9),
    ("p99.9 ns", 10),
    ("RSS MB", 8),
    ("redis MB", 8),
];

/// What each column means, for the HTML report (docs/results.md explains them too).
const COLUMN_HELP: [&str; 15] = [
    "the system run: leasehold, or a baseline in the same run",
    "decisions made per second of the measured window",
    "tokens admitted",
    "requests refused (429) or unavailable (503)",
    "tokens one ideal bucket would have admitted that the system refused, counted only in \
     seconds a key was offered at most its rate (-: no such second)",
    "store calls per 1 000 decisions",
    "store CPU (the Redis processes' user + system time) per decision, microseconds",
    "worst (admitted - (B + r*W)) / (B + r*W) over 1 s windows, 0 within the bound",
    "the same over 10 s windows",
    "tokens admitted over what one ideal bucket with the same B and r would admit",
    "decision latency, median",
    "decision latency, 99th percentile",
    "decision latency, 99.9th percentile",
    "the process's resident memory at the end, and its growth during the run",
    "the store's used memory at the end",
];

/// The summary table's rows: one per system, a cell per column.
fn rows(r: &RunReport) -> Vec<Vec<String>> {
    // A figure that does not apply to the row (a region's own overshoot) shows as "-".
    let f4 = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.4}")
        }
    };
    r.systems
        .iter()
        .map(|(name, s)| {
            vec![
                name.clone(),
                format!("{:.0}", s.decisions_per_sec),
                s.admitted.to_string(),
                (s.denied + s.unavailable).to_string(),
                if s.seconds_within_limit == 0 {
                    "-".to_owned()
                } else {
                    s.denied_below_limit.to_string()
                },
                format!("{:.2}", s.redis_calls_per_1k_decisions),
                s.store_cpu_us_per_decision
                    .map_or_else(|| "-".to_owned(), |u| format!("{u:.3}")),
                f4(s.overshoot_1s),
                f4(s.overshoot_10s),
                f4(s.utilization),
                s.latency_ns.p50.to_string(),
                s.latency_ns.p99.to_string(),
                s.latency_ns.p999.to_string(),
                format!("{:.0}{:+.0}", s.rss_mb, s.rss_growth_mb),
                s.store_mb
                    .map_or_else(|| "-".to_owned(), |m| format!("{m:.0}")),
            ]
        })
        .collect()
}

/// The summary table.
pub(crate) fn table(r: &RunReport) -> String {
    let line = |cells: &mut dyn Iterator<Item = String>| {
        let mut out = String::new();
        for (i, (cell, (_, w))) in cells.zip(COLUMNS).enumerate() {
            if i == 0 {
                out.push_str(&format!("{cell:<w$}"));
            } else {
                out.push_str(&format!(" {cell:>w$}"));
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(&mut COLUMNS.iter().map(|(h, _)| (*h).to_owned()));
    for row in rows(r) {
        out.push_str(&line(&mut row.into_iter()));
    }
    out.push_str(&notes(r).join(""));
    if r.systems
        .iter()
        .any(|(_, s)| s.store_cpu_us_per_decision.is_some())
    {
        out.push_str(
            "store us/dec: the store's Redis CPU (user + system, INFO cpu) per decision over \
             the measured window; RSS MB: this process's memory at the end+its growth\n",
        );
    }
    out
}

/// Over repeated runs of one comparison: Leasehold's worst overshoot over them all, its
/// own medians, and per baseline Leasehold's ratio to it in each run (decisions/s, store
/// CPU per decision, p99) with the median of each. Ratios within one run, where the machine's
/// neighbours weigh on both systems alike, and their median, are what a shared machine
/// can compare.
pub(crate) fn medians(runs: &[RunReport]) -> String {
    fn system<'a>(r: &'a RunReport, name: &str) -> Option<&'a SystemReport> {
        r.systems.iter().find(|(n, _)| n == name).map(|(_, s)| s)
    }
    let lh = |r| system(r, "leasehold");
    let mut out = String::new();
    let worst = (runs.iter().filter_map(lh))
        .map(|s| s.overshoot_1s.max(s.overshoot_10s))
        .filter(|v| !v.is_nan())
        .fold(0.0, f64::max);
    out.push_str(&format!(
        "over {} runs: leasehold's worst overshoot {worst:.4}\n",
        runs.len()
    ));
    let Some(first) = runs.first() else {
        return out;
    };
    // Leasehold's own figures too: what two builds' runs compare by.
    let own: Vec<&SystemReport> = runs.iter().filter_map(lh).collect();
    let mut parts = vec![format!(
        "decisions/s {:.0}",
        median(own.iter().map(|s| s.decisions_per_sec).collect())
    )];
    let cpu: Vec<f64> = own
        .iter()
        .filter_map(|s| s.store_cpu_us_per_decision)
        .collect();
    if cpu.len() == own.len() && !cpu.is_empty() {
        parts.push(format!("store us/dec {:.3}", median(cpu)));
    }
    parts.push(format!(
        "p99 {:.0} ns",
        median(own.iter().map(|s| s.latency_ns.p99 as f64).collect())
    ));
    out.push_str(&format!("leasehold's medians: {}\n", parts.join("; ")));
    for (name, _) in first.systems.iter().filter(|(n, _)| n != "leasehold") {
        let mut cols: [(&str, Vec<f64>); 3] = [
            ("decisions/s", vec![]),
            ("store us/dec", vec![]),
            ("p99", vec![]),
        ];
        for r in runs {
            let (Some(l), Some(b)) = (lh(r), system(r, name)) else {
                continue;
            };
            cols[0].1.push(l.decisions_per_sec / b.decisions_per_sec);
            if let (Some(x), Some(y)) = (l.store_cpu_us_per_decision, b.store_cpu_us_per_decision) {
                cols[1].1.push(x / y);
            }
            cols[2]
                .1
                .push(l.latency_ns.p99 as f64 / b.latency_ns.p99.max(1) as f64);
        }
        let parts: Vec<String> = (cols.iter())
            .filter(|(_, v)| !v.is_empty() && v.iter().all(|x| x.is_finite()))
            .map(|(what, v)| {
                let each: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
                format!("{what} {:.2}x ({})", median(v.clone()), each.join(", "))
            })
            .collect();
        out.push_str(&format!(
            "leasehold / {name}, median of the runs' ratios (each run's): {}\n",
            parts.join("; ")
        ));
    }
    if first.systems.len() > 1 {
        out.push_str(
            "ratios: decisions/s above 1x, store us/dec and p99 below 1x are in leasehold's favour\n",
        );
    }
    out
}

/// The median of `v` (the mean of the middle two for an even count; 0 for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The lines under the table: regions, faults, rlqs, coordinator.
fn notes(r: &RunReport) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(g) = &r.regions {
        let rec: Vec<String> = g
            .recovery_ms
            .iter()
            .map(|m| m.map_or_else(|| "never".to_owned(), |m| format!("{m} ms")))
            .collect();
        out.push(format!(
            "across {} regions ({:.0} ms round trip to the global store): {} calls to it, \
             {:.1}/s, {:.3} per 1k decisions, {} key(s) brokered; back above 95% of the rate \
             after each phase change: {}; regions even again after each heal: {}\n",
            g.regions,
            g.rtt_ms,
            g.cross_calls,
            g.cross_calls_per_sec,
            g.cross_calls_per_1k_decisions,
            g.keys,
            if rec.is_empty() {
                "-".to_owned()
            } else {
                rec.join(", ")
            },
            if g.even_after_heal_ms.is_empty() {
                "-".to_owned()
            } else {
                g.even_after_heal_ms
                    .iter()
                    .map(|m| m.map_or_else(|| "never".to_owned(), |m| format!("{m} ms")))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    if let Some(f) = &r.agent_faults {
        out.push(format!(
            "agents (leasehold run): {} store errors, {} emergency activations, {} admitted under \
             the emergency limit, {} failing open, {} refused as unavailable\n",
            f.store_errors,
            f.emergency_activations,
            f.admitted_emergency,
            f.admitted_fail_open,
            f.unavailable
        ));
    }
    if let Some(q) = &r.rlqs {
        out.push(format!(
            "rlqs: {} filter(s) on {} serve instance(s): {:.0} assignments a second pushed to \
             the filters (gRPC messages, set by the renewals, not the requests), {:.1} store \
             calls a second\n",
            q.filters, q.servers, q.assignments_per_sec, q.calls_per_sec
        ));
    }
    if let Some(c) = &r.coordinator {
        out.push(format!(
            "coordinator (leasehold run, {} instance(s)): {} split(s) started; measured from agent \
             reports, each agent's first one its baseline: {} tokens admitted after it (the \
             warm-up included, unlike the table), worst overshoot {:.4}\n",
            c.instances, c.splits, c.admitted, c.worst_overshoot
        ));
    }
    out
}
