//! Shifting demand on a virtual clock, with no coordinator: eight agents share one key,
//! demand moves from one half of them to the other and back, and every agent runs the
//! per-key policy `gateway-agent` drives (`leasehold_core::KeyPolicy`, through the fleet
//! harness in `support/fleet.rs`) against the reference model of the bucket.
//!
//! The run is compared with one ideal token bucket (same B and r) fed the same arrivals:
//! utilisation must stay >= 0.99 over the run, admissions in every window must stay
//! within `B + r*W` (I1), and after each shift the admitted rate must be back above 95% of
//! the ideal's within one refresh interval (the agents' `return_after`, 500 ms).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "support/fleet.rs"]
mod fleet;

use fleet::{Fleet, MS, Outcome, Phase, Setup};
use leasehold_core::PolicyConfig;
use leasehold_core::rule::{Rule, RuleSpec};

/// The agents' `return_after`: their refresh interval for unused leases.
const RETURN_AFTER_NS: u64 = 500 * MS;

/// Runs `phases` (start ms, active agents) for `total_ms`, each active agent offering
/// `per_ms` decisions every millisecond; returns the outcome and, per shift, how long
/// until a 100 ms window admitted 95% of what the ideal bucket admitted.
fn run(
    rule: Rule,
    agents: usize,
    per_ms: u64,
    phases: &[(u64, Vec<usize>)],
    total_ms: u64,
) -> (Outcome, Vec<u64>) {
    let phases: Vec<Phase> = phases
        .iter()
        .map(|(at, active)| Phase {
            at_ms: *at,
            rates: (0..agents)
                .map(|i| {
                    if active.contains(&i) {
                        per_ms as f64 * 1000.0
                    } else {
                        0.0
                    }
                })
                .collect(),
        })
        .collect();
    let shifts: Vec<u64> = phases.iter().skip(1).map(|p| p.at_ms).collect();
    let mut cfg = PolicyConfig::default();
    cfg.return_after = std::time::Duration::from_nanos(RETURN_AFTER_NS);
    let o = Fleet::run(Setup {
        rule,
        cfg,
        agents,
        phases,
        events: vec![],
        total_ms,
        rtt_us: 0,
        lose: 0.0,
        seed: 1,
        regions: None,
        poisson: false,
    });
    let recovery = shifts
        .iter()
        .map(|&at| {
            let first = (at / 100) as usize;
            o.trace
                .iter()
                .enumerate()
                .skip(first)
                .find(|(_, (got, ideal))| *got as f64 >= 0.95 * *ideal as f64)
                .map_or(u64::MAX, |(i, _)| (i as u64 + 1) * 100 - at)
        })
        .collect();
    (o, recovery)
}

fn rule(capacity: u64, rate: &str) -> Rule {
    let mut spec = RuleSpec::new(capacity, rate);
    spec.lease_ttl = Some("5s".into());
    spec.grace = Some("1s".into());
    spec.leasing = Some("lease".into());
    Rule::from_spec("shifting", &spec).unwrap()
}

#[test]
fn shifting_demand_keeps_utilisation_and_recovers_within_one_refresh_interval() {
    // B = 2000, r = 20 000/s; four active agents offer 10 000/s each (2x the rate).
    let phases = vec![
        (0, vec![0, 1, 2, 3]),
        (3000, vec![4, 5, 6, 7]),
        (6000, vec![0, 1, 2, 3]),
    ];
    let (o, recovery_ms) = run(rule(2000, "20000/s"), 8, 10, &phases, 9000);
    println!(
        "shifting (saturated, 2x r): utilisation {:.4}, recovery after each shift {:?} ms, \
         worst window excess over B + r*W {:.1} tokens, {:.2} store calls per 1000 decisions",
        o.utilisation, recovery_ms, o.worst_window_excess, o.calls_per_1k
    );
    assert!(o.worst_window_excess <= 0.0, "I1");
    assert!(o.utilisation >= 0.99, "utilisation {}", o.utilisation);
    for r in &recovery_ms {
        assert!(*r <= RETURN_AFTER_NS / MS, "recovery took {r} ms");
    }
}

#[test]
fn shifting_below_the_rate_admits_everything() {
    // Same key, two agents at 8 000/s each (80% of the rate), the pair changing at each
    // phase: the agents admit what the ideal bucket admits, with few store calls.
    let phases = vec![(0, vec![0, 1]), (2000, vec![6, 7]), (4000, vec![2, 5])];
    let (o, recovery_ms) = run(rule(2000, "20000/s"), 8, 8, &phases, 6000);
    println!(
        "shifting (80% of r): utilisation {:.4}, recovery {:?} ms, {:.2} calls per 1000",
        o.utilisation, recovery_ms, o.calls_per_1k
    );
    assert!(o.worst_window_excess <= 0.0, "I1");
    assert!(o.utilisation >= 0.99, "utilisation {}", o.utilisation);
}
