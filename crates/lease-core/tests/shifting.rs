//! Shifting demand on a virtual clock, with no coordinator: eight agents share one key,
//! demand moves from one half of them to the other and back, and every agent runs the
//! lease policy of `gateway-agent` (lease sizing from measured demand times the store's
//! proportional share, prefetch at a low-water mark, slow start, reclaim of idle or
//! oversized leases) against the reference model of the bucket.
//!
//! The run is compared with one ideal token bucket (same B and r) fed the same arrivals:
//! utilisation must stay >= 0.99 over the run, admissions in every window must stay
//! within `B + r*W` (I1), and after each shift the admitted rate must be back above 95% of
//! the ideal's within one refresh interval (the agents' `return_after`, 500 ms).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use lease_core::model::{AgentId, GlobalBucket, Op, Request};
use lease_core::rule::{BucketParams, Rule, RuleSpec};
use lease_core::sizing::{DEFAULT_HORIZON, size_lease};
use lease_core::{Level, LocalLease, Reclaim, Spend, lease_request, reclaim, scaled};

const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000_000;
/// The agents' `return_after`: their refresh interval for unused leases.
const RETURN_AFTER_NS: u64 = 500 * MS;
const SWEEP_EVERY_MS: u64 = 100;
const MARGIN_NS: u64 = 50 * MS;

struct Agent {
    id: AgentId,
    seq: u64,
    lease: LocalLease,
    deny_until: u64,
    prefetch_until: u64,
    grant_ns: u64,
    held_after_grant: u64,
    denied: u64,
    denied_seen: u64,
    demand_milli: u64,
    reported_milli: f64,
    measured_ns: u64,
    last_want: u64,
    scale_ppm: u64,
    seen_held: u64,
    seen_denied: u64,
    seen_at: u64,
}

struct Sim {
    rule: Rule,
    p: BucketParams,
    bucket: GlobalBucket,
    agents: Vec<Agent>,
    calls: u64,
}

impl Sim {
    fn new(rule: Rule, n: usize) -> Self {
        let p = rule.bucket_params();
        let agents = (0..n)
            .map(|i| Agent {
                id: AgentId(i as u64 + 1),
                seq: 0,
                lease: LocalLease::new(),
                deny_until: 0,
                prefetch_until: 0,
                grant_ns: 0,
                held_after_grant: 0,
                denied: 0,
                denied_seen: 0,
                demand_milli: 0,
                reported_milli: 0.0,
                measured_ns: 0,
                last_want: 0,
                scale_ppm: 0,
                seen_held: 0,
                seen_denied: 0,
                seen_at: 0,
            })
            .collect();
        Self {
            rule,
            p,
            bucket: GlobalBucket::new(),
            agents,
            calls: 0,
        }
    }

    fn call(&mut self, i: usize, now: u64, op: Op) -> lease_core::Reply {
        let a = &mut self.agents[i];
        a.seq += 1;
        self.calls += 1;

        let req = Request {
            agent: a.id,
            seq: a.seq,
            op,
        };
        self.bucket.apply(&self.p, T0 + now / 1000, &req).unwrap()
    }

    /// The agent's acquire: declare, measure demand, size, ask, install.
    fn acquire(&mut self, i: usize, now: u64, needed: u64) {
        let a = &mut self.agents[i];
        let held = a.lease.declare(now);
        let denied_since = a.denied - a.denied_seen;
        a.denied_seen = a.denied;
        if a.grant_ns != 0 && now > a.grant_ns {
            let dt = now - a.grant_ns;
            let consumed = a.held_after_grant.saturating_sub(held) + denied_since;
            let rate = (u128::from(consumed) * 1_000_000_000_000 / u128::from(dt)) as u64;
            a.demand_milli = a.demand_milli / 2 + rate / 2;
            (a.reported_milli, a.measured_ns) =
                lease_core::sizing::report_demand(a.reported_milli, rate, dt, a.measured_ns);
        }
        let want = size_lease(
            &self.rule,
            a.demand_milli,
            a.scale_ppm,
            DEFAULT_HORIZON,
            needed,
            a.last_want,
            held,
        );
        a.last_want = want.want;
        let op = Op::Acquire {
            held,
            want: want.want,
            min: want.min,
            demand: a.reported_milli as u64,
        };
        let r = self.call(i, now, op);
        let a = &mut self.agents[i];
        let ttl = r.ttl_us * 1000;
        a.lease.grant(r.granted, now + ttl - MARGIN_NS.min(ttl / 4));
        a.grant_ns = now;
        a.held_after_grant = a.lease.held();
        if r.scale_ppm != 0 {
            a.scale_ppm = r.scale_ppm;
        }
        if r.granted > 0 {
            a.deny_until = 0;
        } else if needed > 0 {
            a.deny_until = now + r.retry_us.max(1) * 1000;
        } else {
            a.prefetch_until = now + r.retry_us.max(1) * 1000;
        }
    }

    /// One decision of cost 1 by agent `i`.
    fn decide(&mut self, i: usize, now: u64) -> bool {
        for attempt in 0..2 {
            let a = &self.agents[i];
            if let Spend::Spent { left } = a.lease.try_spend(1, now) {
                if left < (a.last_want / 4).max(1) && now >= a.prefetch_until {
                    self.acquire(i, now, 0);
                }
                return true;
            }
            if now < a.deny_until || attempt == 1 {
                break;
            }
            self.acquire(i, now, 1);
        }
        self.agents[i].denied += 1;
        false
    }

    /// The agent's sweep: reclaim idle or oversized leases, renew near expiry.
    fn sweep(&mut self, i: usize, now: u64) {
        let a = &mut self.agents[i];
        let held = a.lease.held();
        if held != a.seen_held || a.denied != a.seen_denied {
            a.seen_held = held;
            a.seen_denied = a.denied;
            a.seen_at = now;
        }
        let fair = (a.scale_ppm != 0 && a.scale_ppm < 1_000_000).then(|| {
            let share = scaled(a.reported_milli as u64, a.scale_ppm);
            lease_request(&self.rule, share, DEFAULT_HORIZON, 0).want
        });
        let quiet = now - a.seen_at;
        let decision = reclaim(held, a.reported_milli as u64, quiet, RETURN_AFTER_NS, fair);
        if decision != Reclaim::Keep {
            let expired = now >= a.lease.deadline_ns();
            let returned = a.lease.take_all();
            let returned = if expired { 0 } else { returned };
            if decision == Reclaim::Idle {
                a.reported_milli = 0.0;
                a.measured_ns = 0;
                a.demand_milli = 0;
            }
            self.call(i, now, Op::Release { returned });
        } else if held > 0 {
            let deadline = a.lease.deadline_ns();
            let ttl = self.p.lease_ttl_us * 1000;
            if deadline > now && deadline - now < ttl / 4 {
                self.acquire(i, now, 0);
            }
        }
    }
}

struct Outcome {
    utilisation: f64,
    recovery_ms: Vec<u64>,
    worst_window_excess: f64,
    calls_per_1k: f64,
}

/// Runs `phases` (start ms, active agents) for `total_ms`, each active agent offering
/// `per_ms` decisions every millisecond.
fn run(
    rule: Rule,
    agents: usize,
    per_ms: u64,
    phases: &[(u64, Vec<usize>)],
    total_ms: u64,
) -> Outcome {
    let p = rule.bucket_params();
    let mut sim = Sim::new(rule, agents);
    let mut ideal = Level::full(p.capacity);
    let mut admitted = vec![0u64; total_ms as usize];
    let mut ideal_admitted = vec![0u64; total_ms as usize];
    let mut decisions = 0u64;
    for ms in 0..total_ms {
        let now = ms * MS + 1;
        if ms > 0 {
            ideal = ideal.refill(p.capacity, p.rate, 1000);
        }
        let active = &phases.iter().rev().find(|(at, _)| *at <= ms).unwrap().1;
        for k in 0..per_ms {
            for &i in active {
                let t = now + k * (MS / per_ms);
                decisions += 1;
                if sim.decide(i, t) {
                    admitted[ms as usize] += 1;
                }
                if ideal.tokens >= 1 {
                    ideal = ideal.take(1);
                    ideal_admitted[ms as usize] += 1;
                }
            }
        }
        if ms % SWEEP_EVERY_MS == SWEEP_EVERY_MS - 1 {
            for i in 0..agents {
                sim.sweep(i, now + MS / 2);
            }
        }
    }
    // I1: every window of W ms admits at most B + r*W.
    let per_ms_rate = p.rate.tokens() as f64 * 1000.0 / p.rate.period_us() as f64;
    let mut worst: f64 = f64::NEG_INFINITY;
    for w in [1u64, 10, 100, 1000] {
        let mut sum: u64 = admitted[..w as usize].iter().sum();
        for end in w as usize..=admitted.len() {
            if end > w as usize {
                sum = sum + admitted[end - 1] - admitted[end - 1 - w as usize];
            }
            // A window of w whole ms spans at most w+1 ms of refill.
            let bound = p.capacity as f64 + per_ms_rate * (w + 1) as f64;
            worst = worst.max(sum as f64 - bound);
        }
    }
    if std::env::var("SHIFTING_TRACE").is_ok() {
        for c in (0..admitted.len()).step_by(100) {
            let got: u64 = admitted[c..c + 100].iter().sum();
            let id: u64 = ideal_admitted[c..c + 100].iter().sum();
            println!("{c:>5} ms: {got:>5} {id:>5}");
        }
    }
    let mut recovery_ms = Vec::new();
    for (at, _) in phases.iter().skip(1) {
        let (at, window) = (*at as usize, 100usize);
        let back = (at..total_ms as usize - window).find(|&t| {
            let got: u64 = admitted[t..t + window].iter().sum();
            let ideal: u64 = ideal_admitted[t..t + window].iter().sum();
            got as f64 >= 0.95 * ideal as f64
        });
        recovery_ms.push(back.map_or(u64::MAX, |t| (t + window - at) as u64));
    }
    Outcome {
        utilisation: admitted.iter().sum::<u64>() as f64
            / ideal_admitted.iter().sum::<u64>() as f64,
        recovery_ms,
        worst_window_excess: worst,
        calls_per_1k: sim.calls as f64 * 1000.0 / decisions as f64,
    }
}

fn rule(capacity: u64, rate: &str) -> Rule {
    let spec = RuleSpec {
        capacity,
        rate: rate.into(),
        lease_ttl: Some("5s".into()),
        grace: Some("1s".into()),
        ..RuleSpec::default()
    };
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
    let o = run(rule(2000, "20000/s"), 8, 10, &phases, 9000);
    println!(
        "shifting (saturated, 2x r): utilisation {:.4}, recovery after each shift {:?} ms, \
         worst window excess over B + r*W {:.1} tokens, {:.2} store calls per 1000 decisions",
        o.utilisation, o.recovery_ms, o.worst_window_excess, o.calls_per_1k
    );
    assert!(o.worst_window_excess <= 0.0, "I1");
    assert!(o.utilisation >= 0.99, "utilisation {}", o.utilisation);
    for r in &o.recovery_ms {
        assert!(*r <= RETURN_AFTER_NS / MS, "recovery took {r} ms");
    }
}

#[test]
fn shifting_below_the_rate_admits_everything() {
    // Same key, two agents at 8 000/s each (80% of the rate), the pair changing at each
    // phase: the agents admit what the ideal bucket admits, with few store calls.
    let phases = vec![(0, vec![0, 1]), (2000, vec![6, 7]), (4000, vec![2, 5])];
    let o = run(rule(2000, "20000/s"), 8, 8, &phases, 6000);
    println!(
        "shifting (80% of r): utilisation {:.4}, recovery {:?} ms, {:.2} calls per 1000",
        o.utilisation, o.recovery_ms, o.calls_per_1k
    );
    assert!(o.worst_window_excess <= 0.0, "I1");
    assert!(o.utilisation >= 0.99, "utilisation {}", o.utilisation);
}
