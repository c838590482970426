//! `leasehold simulate`: many agents against one global store under a workload, with
//! Leasehold, the naive per-request Lua token bucket (one script call per decision) and
//! governor (local only) measured one after the other in the same process, and reported
//! side by side.
//!
//! Each agent is one `Limiter` (its own connections, its own leases), as each gateway
//! would have; its threads are tasks on one tokio runtime. Governor gets, per agent, an
//! even share of the rule (`r / agents`, `B / agents`): the usual way to run a local-only
//! limiter behind a load balancer.

mod env;
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
    pub(crate) seed: u64,
    pub(crate) progress: bool,
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

/// Writes the JSON report and the plot the options ask for.
pub(super) fn write_outputs(
    opts: &Options,
    json: &serde_json::Value,
    title: &str,
    rate: f64,
    systems: &[(String, SystemReport)],
) -> Result<(), String> {
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(json).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &opts.plot {
        let series: Vec<(String, Vec<f64>)> = systems
            .iter()
            .map(|(n, r)| (n.clone(), r.series.clone()))
            .collect();
        std::fs::write(path, report::svg(title, rate, &series))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// The summary table.
pub(crate) fn table(r: &RunReport) -> String {
    let mut out = format!(
        "{:<10} {:>13} {:>11} {:>11} {:>11} {:>12} {:>12} {:>11} {:>12} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}\n",
        "system",
        "decisions/s",
        "admitted",
        "denied",
        "below_limit",
        "calls/1k",
        "store us/dec",
        "overshoot1s",
        "overshoot10s",
        "utilization",
        "p50 ns",
        "p99 ns",
        "p99.9 ns",
        "RSS MB",
        "redis MB"
    );
    // A figure that does not apply to the row (a region's own overshoot) shows as "-".
    let f4 = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.4}")
        }
    };
    for (name, s) in &r.systems {
        out.push_str(&format!(
            "{:<10} {:>13.0} {:>11} {:>11} {:>11} {:>12.2} {:>12} {:>11} {:>12} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}\n",
            name,
            s.decisions_per_sec,
            s.admitted,
            s.denied + s.unavailable,
            if s.seconds_within_limit == 0 {
                "-".to_owned()
            } else {
                s.denied_below_limit.to_string()
            },
            s.redis_calls_per_1k_decisions,
            s.store_cpu_us_per_decision
                .map_or_else(|| "-".to_owned(), |u| format!("{u:.3}")),
            f4(s.overshoot_1s),
            f4(s.overshoot_10s),
            f4(s.utilization),
            s.latency_ns.p50,
            s.latency_ns.p99,
            s.latency_ns.p999,
            format!("{:.0}{:+.0}", s.rss_mb, s.rss_growth_mb),
            s.store_mb.map_or_else(|| "-".to_owned(), |m| format!("{m:.0}"))
        ));
    }
    if let Some(g) = &r.regions {
        let rec: Vec<String> = g
            .recovery_ms
            .iter()
            .map(|m| m.map_or_else(|| "never".to_owned(), |m| format!("{m} ms")))
            .collect();
        out.push_str(&format!(
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
        out.push_str(&format!(
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
        out.push_str(&format!(
            "rlqs: {} filter(s) on {} serve instance(s): {:.0} assignments a second pushed to \
             the filters (gRPC messages, set by the renewals, not the requests), {:.1} store \
             calls a second\n",
            q.filters, q.servers, q.assignments_per_sec, q.calls_per_sec
        ));
    }
    if let Some(c) = &r.coordinator {
        out.push_str(&format!(
            "coordinator (leasehold run, {} instance(s)): {} split(s) started; measured from agent \
             reports, each agent's first one its baseline: {} tokens admitted after it, worst \
             overshoot {:.4}\n",
            c.instances, c.splits, c.admitted, c.worst_overshoot
        ));
    }
    out
}
