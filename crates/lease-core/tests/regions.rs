//! Regions on a virtual clock: one global bucket, three regions behind an 80 ms link,
//! each with its own store, broker and agents (the fleet harness of `support/fleet.rs`
//! with `Regions`: real `KeyPolicy` agents leasing from their region's bucket, a real
//! `KeyBroker` per region). Every store and broker has its own clock, hours apart and a
//! few hundred ppm apart in rate. Every window of 1 ms to 1 s of the worldwide
//! admissions is checked against `B + r*W` (I1 across regions), with demand moving
//! between regions and with a region cut off from the global store.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "support/fleet.rs"]
mod fleet;

use fleet::{Fleet, Outcome, Phase, Regions, Setup};
use leasehold_core::PolicyConfig;
use leasehold_core::model::region::BrokerConfig;
use leasehold_core::rule::{Rule, RuleSpec};

const B: u64 = 20_000;
const R: f64 = 20_000.0;
const N: usize = 3;
const PER_REGION: usize = 4;

fn rule() -> Rule {
    let mut spec = RuleSpec::new(B, "20000/s");
    spec.leasing = Some("lease".into());
    Rule::from_spec("global", &spec).unwrap()
}

/// Per-agent rates with `total` tokens/s, `weights[k]` of it in region k.
fn rates(total: f64, weights: [f64; N]) -> Vec<f64> {
    (0..N * PER_REGION)
        .map(|i| total * weights[i % N] / PER_REGION as f64)
        .collect()
}

fn regions(partitions: Vec<(usize, u64, u64)>) -> Regions {
    Regions {
        n: N,
        rtt_us: 80_000,
        floor: None,
        term_us: 2_000_000,
        partitions,
        broker: BrokerConfig::default(),
    }
}

fn setup(phases: Vec<Phase>, total_ms: u64, r: Regions, seed: u64) -> Setup {
    Setup {
        rule: rule(),
        cfg: PolicyConfig::default(),
        agents: N * PER_REGION,
        phases,
        events: vec![],
        total_ms,
        rtt_us: 300,
        lose: 0.0,
        seed,
        regions: Some(r),
        poisson: false,
    }
}

/// Tokens region `k` admitted in `[from_ms, to_ms)`.
fn admitted(o: &Outcome, k: usize, from_ms: u64, to_ms: u64) -> u64 {
    o.region_ms[k][from_ms as usize..to_ms as usize]
        .iter()
        .sum()
}

fn line(name: &str, o: &Outcome, secs: f64) -> String {
    format!(
        "{name}: utilisation {:.4}, worst window excess {:.0}, cross-region calls {:.1}/s, \
         region calls/1k {:.1}",
        o.utilisation,
        o.worst_window_excess,
        o.cross_calls as f64 / secs,
        o.calls_per_1k,
    )
}

#[test]
fn demand_moving_between_regions_stays_within_the_global_bound() {
    for seed in 1..=3 {
        let phases = vec![
            Phase {
                at_ms: 0,
                rates: rates(1.3 * R, [0.7, 0.15, 0.15]),
            },
            Phase {
                at_ms: 3_000,
                rates: rates(1.3 * R, [0.15, 0.7, 0.15]),
            },
            Phase {
                at_ms: 6_000,
                rates: rates(1.3 * R, [0.15, 0.15, 0.7]),
            },
        ];
        let o = Fleet::run(setup(phases, 9_000, regions(vec![]), seed));
        println!("{}", line(&format!("shifting, seed {seed}"), &o, 9.0));
        for k in 0..N {
            let per: Vec<u64> = (0..9)
                .map(|s| admitted(&o, k, s * 1000, s * 1000 + 1000))
                .collect();
            println!("  region {k} per second: {per:?}");
        }
        let tot: Vec<u64> = (0..40)
            .map(|s| {
                (0..N)
                    .map(|k| admitted(&o, k, s * 100, s * 100 + 100))
                    .sum()
            })
            .collect();
        println!("  total per 100 ms: {tot:?}");
        println!(
            "  ideal per 100 ms: {:?}",
            &o.trace[..40].iter().map(|t| t.1).collect::<Vec<_>>()
        );
        assert!(
            o.worst_window_excess <= 0.0,
            "global overshoot: {}",
            o.worst_window_excess
        );
    }
}

#[test]
fn a_partitioned_region_serves_its_term_then_nothing() {
    let phases = vec![Phase {
        at_ms: 0,
        rates: rates(1.3 * R, [1.0 / 3.0; N]),
    }];
    let o = Fleet::run(setup(phases, 10_000, regions(vec![(0, 3_000, 6_000)]), 7));
    println!("{}", line("partition", &o, 10.0));
    let first: Vec<u64> = (0..30)
        .map(|s| admitted(&o, 0, s * 100, s * 100 + 100))
        .collect();
    println!("  region 0 per 100 ms: {first:?}");
    for k in 0..N {
        let per: Vec<u64> = (0..10)
            .map(|s| admitted(&o, k, s * 1000, s * 1000 + 1000))
            .collect();
        println!("  region {k} per second: {per:?}");
    }
    assert!(
        o.worst_window_excess <= 0.0,
        "global overshoot: {}",
        o.worst_window_excess
    );
    // Its term (2 s) is over by 5 s: from then until the link heals it admits nothing.
    assert_eq!(admitted(&o, 0, 5_100, 6_000), 0);
}

#[test]
fn a_partitioned_region_with_a_floor_overshoots_by_the_floor_at_most() {
    let phases = vec![Phase {
        at_ms: 0,
        rates: rates(1.3 * R, [1.0 / 3.0; N]),
    }];
    let floor = leasehold_core::Rate::per_second(std::num::NonZeroU64::new(500).unwrap()).unwrap();
    let r = Regions {
        floor: Some(floor),
        ..regions(vec![(0, 3_000, 6_000)])
    };
    let o = Fleet::run(setup(phases, 10_000, r, 11));
    println!("{}", line("partition, floor 500/s", &o, 10.0));
    // Past its term the region admits its floor: 500/s, plus at most a burst (a second
    // of it) made before the window.
    let late = admitted(&o, 0, 5_100, 6_000);
    println!("  region 0 from 5.1 s to 6 s: {late}");
    assert!(late > 0 && late <= 450 + 500, "floor admissions {late}");
    // From the term's end (by 5.1 s) to the link healing, the floor is all it admits.
    let whole = admitted(&o, 0, 3_000, 6_000);
    assert!(whole <= admitted(&o, 0, 3_000, 5_100) + 950, "{whole}");
    // Worldwide, no window exceeds B + r*W by more than what the floor admitted.
    assert!(
        o.worst_window_excess <= 1_500.0,
        "global overshoot: {}",
        o.worst_window_excess
    );
}
