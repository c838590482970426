//! A virtual-clock simulation of agents sharing one global bucket (quinn-proto style).
//!
//! N agents, each spending from a real [`LocalLease`], talk to the reference model through
//! requests that are sent, processed, delivered, lost, retried with the same sequence
//! number or abandoned, while time advances, jumps, and the server clock steps back.
//! After every step the invariants are checked; at the end, every window of the run is
//! checked against `B + r * W`. Case count: `PROPTEST_CASES` (default 256).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::num::NonZeroU64;

use leasehold_core::model::{AgentId, GlobalBucket, Op, Reply, Request};
use leasehold_core::rule::{BucketParams, Mode, Rule, RuleSpec};
use leasehold_core::{Level, LocalLease, Spend};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Acquire { want: u64, min: u64 },
    Release,
    Exact { cost: u64 },
}

#[derive(Clone, Copy, Debug)]
enum Action {
    /// Real time passes (µs).
    Advance(u64),
    /// A long pause (µs): leases expire, keys may expire.
    Jump(u64),
    /// The server clock steps back (µs).
    ClockBack(u64),
    Send(usize, Kind),
    Process(usize),
    Deliver(usize),
    /// The reply of a processed request is lost; the agent will resend the same seq.
    Lose(usize),
    Spend(usize, u64),
    Crash(usize),
}

struct InFlight {
    req: Request,
    first_send_us: u64,
    /// The reply the server gave the first time, known to the simulation even if lost.
    first_reply: Option<Reply>,
    delivered_reply: Option<Reply>,
}

struct Agent {
    id: AgentId,
    lease: LocalLease,
    seq: u64,
    inflight: Option<InFlight>,
}

struct Sim {
    p: BucketParams,
    bucket: GlobalBucket,
    t: u64,
    skew: u64,
    agents: Vec<Agent>,
    next_id: u64,
    admitted: Vec<(u64, u64)>,
    last_now: u64,
}

const T0: u64 = 1_700_000_000_000_000;

impl Sim {
    fn new(p: BucketParams, agents: usize) -> Self {
        let mut sim = Self {
            p,
            bucket: GlobalBucket::new(),
            t: T0,
            skew: 0,
            agents: Vec::new(),
            next_id: 1,
            admitted: Vec::new(),
            last_now: 0,
        };
        for _ in 0..agents {
            let a = sim.fresh_agent();
            sim.agents.push(a);
        }
        sim
    }

    fn fresh_agent(&mut self) -> Agent {
        self.next_id += 1;
        Agent {
            id: AgentId(self.next_id * 7919),
            lease: LocalLease::new(),
            seq: 0,
            inflight: None,
        }
    }

    /// The raw server clock: real time minus the accumulated backward steps.
    fn server_clock(&self) -> u64 {
        self.t - self.skew
    }

    fn ns(&self) -> u64 {
        self.t * 1000
    }

    fn step(&mut self, action: Action) {
        let n = self.agents.len();
        match action {
            Action::Advance(dt) | Action::Jump(dt) => self.t += dt,
            Action::ClockBack(d) => self.skew = (self.skew + d).min(self.t - T0 + 10_000_000),
            Action::Send(i, kind) => self.send(i % n, kind),
            Action::Process(i) => self.process(i % n),
            Action::Deliver(i) => self.deliver(i % n),
            Action::Lose(i) => {
                if let Some(f) = &mut self.agents[i % n].inflight {
                    f.delivered_reply = None;
                }
            }
            Action::Spend(i, cost) => {
                let now = self.ns();
                if let Spend::Spent { .. } = self.agents[i % n].lease.try_spend(cost, now) {
                    self.admitted.push((self.t, cost));
                }
            }
            Action::Crash(i) => self.agents[i % n] = self.fresh_agent(),
        }
        self.check();
    }

    fn send(&mut self, i: usize, kind: Kind) {
        let now_ns = self.ns();
        let cap = self.p.capacity;
        let a = &mut self.agents[i];
        if a.inflight.is_some() {
            return;
        }
        let op = match kind {
            Kind::Acquire { want, min } => {
                let want = want.clamp(1, cap);
                Op::Acquire {
                    held: a.lease.declare(now_ns),
                    want,
                    min: min.clamp(1, want),
                    demand: want * 1000,
                }
            }
            Kind::Release => Op::Release {
                returned: a.lease.take_all(),
            },
            Kind::Exact { cost } => Op::Exact {
                cost: cost.min(cap),
            },
        };
        a.seq += 1;
        a.inflight = Some(InFlight {
            req: Request {
                agent: a.id,
                seq: a.seq,
                op,
            },
            first_send_us: self.t,
            first_reply: None,
            delivered_reply: None,
        });
    }

    fn process(&mut self, i: usize) {
        let server_now = self.server_clock();
        let t = self.t;
        let grace = self.p.grace_us;
        let Some(f) = &self.agents[i].inflight else {
            return;
        };
        if f.delivered_reply.is_some() {
            return;
        }
        if t >= f.first_send_us + grace {
            // Too late to retry safely: the agent abandons the request (the store may
            // have dropped the record that would make a retry a replay).
            self.agents[i].inflight = None;
            return;
        }
        let req = f.req;
        let first = f.first_reply;
        self.check_expiry(server_now);
        let before = self.bucket.clone();
        let reply = self
            .bucket
            .apply(&self.p, server_now, &req)
            .expect("the simulation only sends valid requests");
        if let Some(first) = first {
            // I2: a retry with the same (agent, seq) replays and changes nothing.
            assert_eq!(reply, first, "replay differs");
            assert_eq!(self.bucket, before, "replay changed the bucket");
        } else {
            assert!(reply.now_us >= self.last_now, "I5: server time went back");
            self.last_now = reply.now_us;
            if let Op::Exact { cost } = req.op
                && reply.granted == cost
            {
                self.admitted.push((t, cost));
            }
            // A release and a read (exact, cost 0) take nothing and are not denials.
            if reply.granted == 0 && !matches!(req.op, Op::Release { .. } | Op::Exact { cost: 0 }) {
                assert!(reply.retry_us > 0, "a denial must say when to retry");
            }
        }
        let f = self.agents[i].inflight.as_mut().expect("checked above");
        f.first_reply = Some(reply);
        f.delivered_reply = Some(reply);
    }

    fn deliver(&mut self, i: usize) {
        let a = &mut self.agents[i];
        let Some(f) = &a.inflight else {
            return;
        };
        let Some(reply) = f.delivered_reply else {
            return;
        };
        if let Op::Acquire { .. } = f.req.op {
            // I4: the lease lives from the moment the acquire was first sent.
            a.lease
                .grant(reply.granted, (f.first_send_us + reply.ttl_us) * 1000);
        }
        a.inflight = None;
    }

    /// I6: when Redis would expire the key, the bucket is full and holds no lease.
    fn check_expiry(&self, server_now: u64) {
        if let Some(s) = self.bucket.state()
            && server_now / 1000 > s.expire_at_ms
        {
            let v = self.bucket.view_at(&self.p, s.expire_at_ms * 1000);
            assert_eq!(
                v.level,
                Level::full(self.p.capacity),
                "I6: key expires before full"
            );
            assert_eq!(v.agents, 0, "I6: key expires with live agent records");
        }
    }

    fn check(&self) {
        let Some(s) = self.bucket.state() else {
            return;
        };
        let (b, held_sum): (u64, u64) = (self.p.capacity, s.agents.values().map(|r| r.held).sum());
        assert_eq!(s.outstanding, held_sum, "outstanding is the sum of held");
        assert!(s.level.carry < s.period_us);
        if let Mode::Relaxed { max_outstanding } = self.p.mode {
            assert!(s.level.tokens <= b);
            assert!(
                s.outstanding <= max_outstanding.get(),
                "relaxed cap exceeded"
            );
        } else {
            assert!(
                s.level.tokens + s.outstanding <= b,
                "I1: tokens + outstanding > B"
            );
            if s.level.tokens + s.outstanding == b {
                assert_eq!(s.level.carry, 0, "I1: a full bucket carries nothing");
            }
        }
        // I1/I4: every token an agent can spend is counted by a record the store will
        // keep at least until the agent's deadline.
        let server_now = self.server_clock().max(s.updated_us);
        let now_ns = self.ns();
        for a in &self.agents {
            let held = a.lease.held();
            if held == 0 || now_ns >= a.lease.deadline_ns() {
                continue;
            }
            let r = s
                .agents
                .get(&a.id)
                .expect("I1: spendable tokens without a record");
            assert!(
                r.held >= held,
                "I1: record holds {} < agent {}",
                r.held,
                held
            );
            let remaining_us = a.lease.deadline_ns() / 1000 - self.t;
            assert!(
                r.drop_us >= server_now + remaining_us,
                "I4: record dropped before the agent's lease expires"
            );
            assert!(
                server_now / 1000 <= s.expire_at_ms,
                "I6: key expires under a lease"
            );
        }
    }

    /// Every window [t_i, t_j] of the run admitted at most B + slack + r * (t_j - t_i).
    fn check_windows(&self, slack: u64) {
        let (n, p) = (
            self.p.rate.tokens() as i128,
            self.p.rate.period_us() as i128,
        );
        let b = (self.p.capacity + slack) as i128;
        let log = &self.admitted;
        for i in 0..log.len() {
            let mut sum = 0i128;
            for j in i..log.len() {
                sum += log[j].1 as i128;
                let w = (log[j].0 - log[i].0) as i128;
                assert!(
                    (sum - b) * p <= n * w,
                    "window of {w}µs admitted {sum} > B {b} + r*W (log {i}..{j})"
                );
            }
        }
    }
}

fn params(relaxed: bool) -> impl Strategy<Value = BucketParams> {
    (
        1u64..=40,
        1u64..=20,
        prop_oneof![Just("100ms"), Just("1s"), Just("3s")],
        20u64..=2000,
        1u64..=500,
        1u64..=20,
    )
        .prop_map(move |(cap, n, per, ttl_ms, grace_ms, max_out)| {
            let mut spec = RuleSpec::new(cap, format!("{n}/{per}"));
            spec.lease_ttl = Some(format!("{ttl_ms}ms"));
            spec.grace = Some(format!("{grace_ms}ms"));
            spec.mode = relaxed.then(|| "relaxed".to_owned());
            spec.max_outstanding = relaxed.then_some(max_out);
            spec.lease_max = Some(cap);
            let rule = Rule::from_spec("sim", &spec).expect("valid by construction");
            if relaxed {
                assert!(matches!(rule.mode(), Mode::Relaxed { max_outstanding } if max_outstanding == NonZeroU64::new(max_out).unwrap()));
            }
            rule.bucket_params()
        })
}

/// Weights: (advance, jump, clock back, send, process, deliver, lose, spend, crash).
fn actions(w: [u32; 9], len: usize) -> impl Strategy<Value = Vec<Action>> {
    let kind = prop_oneof![
        3 => (1u64..12, 1u64..4).prop_map(|(want, min)| Kind::Acquire { want, min }),
        1 => Just(Kind::Release),
        1 => (0u64..4).prop_map(|cost| Kind::Exact { cost }),
    ];
    let action = prop_oneof![
        w[0] => (0u64..50_000).prop_map(Action::Advance),
        w[1] => (500_000u64..20_000_000).prop_map(Action::Jump),
        w[2] => (1u64..10_000_000).prop_map(Action::ClockBack),
        w[3] => (0usize..16, kind).prop_map(|(i, k)| Action::Send(i, k)),
        w[4] => (0usize..16).prop_map(Action::Process),
        w[5] => (0usize..16).prop_map(Action::Deliver),
        w[6] => (0usize..16).prop_map(Action::Lose),
        w[7] => (0usize..16, 1u64..4).prop_map(|(i, c)| Action::Spend(i, c)),
        w[8] => (0usize..16).prop_map(Action::Crash),
    ];
    proptest::collection::vec(action, 1..len)
}

fn run(p: BucketParams, agents: usize, script: &[Action]) {
    let mut sim = Sim::new(p, agents);
    for a in script {
        sim.step(*a);
    }
    sim.check_windows(match p.mode {
        Mode::Strict => 0,
        Mode::Relaxed { max_outstanding } => max_outstanding.get(),
    });
}

proptest! {
    /// I1: strict mode never lets tokens + outstanding exceed B, and no window of the run
    /// admits more than B + r * W, across up to 16 agents.
    #[test]
    fn i1_strict_window_bound(p in params(false), agents in 1usize..=16,
                              script in actions([6, 1, 1, 6, 6, 6, 1, 12, 1], 300)) {
        run(p, agents, &script);
    }

    /// Relaxed mode: the bound is B + max_outstanding + r * W.
    #[test]
    fn i1_relaxed_window_bound(p in params(true), agents in 1usize..=16,
                               script in actions([6, 1, 1, 6, 6, 6, 1, 12, 1], 300)) {
        run(p, agents, &script);
    }

    /// I2: lost replies and retries with the same sequence number replay the first reply
    /// and change nothing.
    #[test]
    fn i2_lost_replies_replay(p in params(false), agents in 1usize..=4,
                              script in actions([4, 0, 0, 6, 8, 4, 6, 8, 0], 300)) {
        run(p, agents, &script);
    }

    /// I4, I6: long pauses, crashed agents and expiring keys never leave a spendable token
    /// uncounted, and a key expires only when full with no lease in it.
    #[test]
    fn i4_i6_jumps_crashes_and_expiry(p in params(false), agents in 1usize..=8,
                                      script in actions([4, 3, 0, 6, 6, 6, 1, 10, 3], 300)) {
        run(p, agents, &script);
    }

    /// I5: the server clock stepping back never creates tokens or moves time back.
    #[test]
    fn i5_clock_steps_back(p in params(false), agents in 1usize..=8,
                           script in actions([6, 1, 4, 6, 6, 6, 1, 10, 0], 300)) {
        run(p, agents, &script);
    }
}

/// I5, deterministic: a step back of an hour after draining creates nothing until the
/// server clock has caught up with the last time the bucket saw.
#[test]
fn i5_step_back_an_hour() {
    let p = Rule::new("x", 10, "10/s").unwrap().bucket_params();
    let mut sim = Sim::new(p, 1);
    sim.step(Action::Send(0, Kind::Exact { cost: 10 }));
    sim.step(Action::Process(0));
    sim.step(Action::Deliver(0));
    sim.step(Action::ClockBack(3_600_000_000));
    sim.step(Action::Advance(500_000));
    sim.step(Action::Send(0, Kind::Exact { cost: 1 }));
    sim.step(Action::Process(0));
    let r = sim.agents[0]
        .inflight
        .as_ref()
        .unwrap()
        .delivered_reply
        .unwrap();
    assert_eq!((r.granted, r.now_us), (0, T0));
}
