//! The local share on a virtual clock: more agents than seats, each claiming, renewing,
//! losing replies, crashing and spending its seat of a few keys, the rest of every
//! decision going to the reference model's global part. At the end every window of the
//! run, per key, is checked against the whole rule's `B + r * W` (I1 with seats).
//! Case count: `PROPTEST_CASES` (default 256).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::collections::HashMap;

use leasehold_core::local::{SeatBucket, SeatReply, Tenure};
use leasehold_core::model::seats::Seats;
use leasehold_core::model::{AgentId, GlobalBucket, Op, Request};
use leasehold_core::rule::{Rule, RuleSpec};
use proptest::prelude::*;

const KEYS: usize = 3;

#[derive(Clone, Copy, Debug)]
enum Action {
    /// Time passes (µs).
    Advance(u64),
    Claim(usize),
    Process(usize),
    Deliver(usize),
    /// The claim's reply is lost (after the store applied it).
    Lose(usize),
    Spend(usize, usize, u64),
    /// The agent restarts: a new id, nothing held.
    Crash(usize),
}

#[derive(Default)]
struct Agent {
    id: u64,
    tenure: Tenure,
    buckets: HashMap<usize, SeatBucket>,
    /// A claim sent at (µs), and the store's answer once it handled it.
    claim: Option<(u64, Option<SeatReply>)>,
    seq: u64,
}

fn run(rule: &Rule, agents: usize, ttl_us: u64, actions: &[Action]) {
    let local = rule.local().expect("a local share");
    let global = rule.global_part().bucket_params();
    let seats_n = u64::from(local.agents);
    let mut next_id = 1u64;
    let mut fleet: Vec<Agent> = (0..agents)
        .map(|_| {
            next_id += 1;
            Agent {
                id: next_id,
                ..Agent::default()
            }
        })
        .collect();
    let mut seats = Seats::new();
    let mut buckets: Vec<GlobalBucket> = (0..KEYS).map(|_| GlobalBucket::new()).collect();
    let mut log: Vec<Vec<(u64, u64)>> = vec![Vec::new(); KEYS];
    let mut t = 1_000_000u64;
    for &a in actions {
        match a {
            Action::Advance(dt) => t += dt,
            Action::Claim(i) => {
                let ag = &mut fleet[i % agents];
                if ag.claim.is_none() {
                    ag.claim = Some((t, None));
                }
            }
            Action::Process(i) => {
                let ag = &mut fleet[i % agents];
                if let Some((sent, None)) = ag.claim {
                    let reply = seats.claim(AgentId(ag.id), seats_n, ttl_us, t);
                    ag.claim = Some((sent, Some(reply)));
                    assert!(seats.held(t) as u64 <= seats_n, "more records than seats");
                }
            }
            Action::Deliver(i) => {
                let ag = &mut fleet[i % agents];
                if let Some((sent, Some(reply))) = ag.claim.take() {
                    ag.tenure.answered(reply, sent * 1000, t * 1000, 0);
                }
            }
            Action::Lose(i) => {
                let ag = &mut fleet[i % agents];
                if let Some((_, Some(_))) = ag.claim {
                    ag.claim = None;
                }
            }
            Action::Spend(i, key, cost) => {
                let ag = &mut fleet[i % agents];
                let key = key % KEYS;
                let cost = cost.min(global.capacity);
                let now_ns = t * 1000;
                let local_ok = ag.tenure.since(now_ns).is_some_and(|since| {
                    ag.buckets
                        .entry(key)
                        .or_default()
                        .take(&local, cost, now_ns, since)
                        .is_ok()
                });
                if local_ok {
                    log[key].push((t, cost));
                    continue;
                }
                ag.seq += 1;
                let req = Request {
                    agent: AgentId(ag.id),
                    seq: ag.seq,
                    op: Op::Exact { cost },
                };
                let reply = buckets[key].apply(&global, t, &req).expect("valid");
                if reply.granted > 0 {
                    log[key].push((t, reply.granted));
                }
            }
            Action::Crash(i) => {
                next_id += 1;
                fleet[i % agents] = Agent {
                    id: next_id,
                    ..Agent::default()
                };
            }
        }
    }
    let (n, p) = (
        i128::from(rule.rate().tokens()),
        i128::from(rule.rate().period_us()),
    );
    let b = i128::from(rule.capacity().get());
    for (k, log) in log.iter().enumerate() {
        for i in 0..log.len() {
            let mut sum = 0i128;
            for j in i..log.len() {
                sum += i128::from(log[j].1);
                let w = i128::from(log[j].0 - log[i].0);
                assert!(
                    (sum - b) * p <= n * w,
                    "key {k}: a window of {w}µs admitted {sum} > B {b} + r*W"
                );
            }
        }
    }
}

fn action(agents: usize) -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (1u64..20_000).prop_map(Action::Advance),
        2 => (0..agents).prop_map(Action::Claim),
        2 => (0..agents).prop_map(Action::Process),
        2 => (0..agents).prop_map(Action::Deliver),
        1 => (0..agents).prop_map(Action::Lose),
        12 => (0..agents, 0..KEYS, 1u64..12).prop_map(|(i, k, c)| Action::Spend(i, k, c)),
        1 => (0..agents).prop_map(Action::Crash),
    ]
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn seats_and_the_global_part_never_admit_more_than_one_bucket(
        cap in 4u64..=40,
        tokens in 1u64..=50,
        period in prop_oneof![Just("100ms"), Just("1s")],
        percent in 10u64..=90,
        seats in 1u64..=5,
        agents in 1usize..=8,
        ttl_ms in 5u64..=100,
        actions in proptest::collection::vec(action(8), 1..400),
    ) {
        let mut spec = RuleSpec::new(cap, format!("{tokens}/{period}"));
        spec.local_percent = Some(percent);
        spec.local_agents = Some(seats);
        let rule = Rule::from_spec("local", &spec);
        prop_assume!(rule.is_ok());
        run(&rule.unwrap(), agents, ttl_ms * 1000, &actions);
    }
}

#[test]
fn the_parts_add_up_to_the_rule() {
    let mut spec = RuleSpec::new(100, "1000/s");
    spec.local_percent = Some(25);
    spec.local_agents = Some(8);
    let rule = Rule::from_spec("r", &spec).unwrap();
    let l = rule.local().unwrap();
    assert_eq!(l.capacity.get(), 3);
    assert_eq!(l.rate.per_sec_f64(), 30.0);
    let g = rule.global_part();
    assert_eq!(g.capacity().get(), 76);
    assert_eq!(g.rate().per_sec_f64(), 760.0);
    assert_eq!(g.local(), None);
    assert_eq!(g.bucket_params().capacity, 76);
    // What the store works with is the global part, whoever asks.
    assert_eq!(rule.bucket_params(), g.bucket_params());
    // Without a local share the rule is its own global part.
    let plain = Rule::new("p", 100, "1000/s").unwrap();
    assert_eq!(plain.global_part(), plain);
}

#[test]
fn a_local_share_that_cannot_be_represented_is_refused_by_name() {
    let err = |percent, agents, cap: u64| {
        let mut spec = RuleSpec::new(cap, "10/s");
        spec.local_percent = percent;
        spec.local_agents = agents;
        Rule::from_spec("r", &spec).unwrap_err().to_string()
    };
    let e = err(Some(10), Some(64), 100);
    assert!(e.contains("less than one token"), "{e}");
    assert!(err(Some(95), Some(2), 100).contains("local_percent = 95: must be 1 to 90"));
    assert!(err(Some(0), Some(2), 100).contains("local_percent = 0"));
    assert!(err(Some(20), None, 100).contains("needs local_agents"));
    assert!(err(None, Some(4), 100).contains("needs local_percent"));
    assert!(err(Some(20), Some(5000), 100000).contains("local_agents = 5000"));
    let mut spec = RuleSpec::new(100, "10/s");
    spec.local_percent = Some(20);
    spec.local_agents = Some(2);
    spec.scope = Some("global".into());
    let e = Rule::from_spec("r", &spec).unwrap_err().to_string();
    assert!(e.contains("does not combine with scope"), "{e}");
}
