//! A fleet of agents on a virtual clock: N real [`KeyPolicy`] state machines, each with
//! its [`LocalLease`], lease one key from the reference model of the bucket, with a round
//! trip time, lost replies, agents joining, leaving and crashing. The same arrivals are
//! replayed against one ideal token bucket (same B and r), so the run reports
//! utilisation and below-limit denials (requests the ideal bucket admitted and the fleet
//! denied), and every window is checked against `B + r*W`.
//!
//! Each agent decides with the agent's own local decision, [`Cell::decide`] (lease,
//! cached denial, denial while a refill comes, store), and installs replies with
//! [`KeyPolicy::granted`]; this file is only the event loop around them: a caller the
//! cell sends to the store waits for the key's call in flight, or makes one itself (two
//! rounds at most, looking at the cell again with [`Cell::recheck`] after each); a sweep
//! every 100 ms applies the policy's [`SweepAction`]. Only one store call per agent is
//! in flight at a time (the key's I/O lock). There are no seats and no breakers here:
//! the fleet's store always answers, or loses a reply.
//!
//! A rule with `leasing = "rate"` runs each agent's [`RateKey`] beside its cell, as the
//! agent does: a caller the cell does not cover syncs the share's accrual into it and
//! renews when due ([`RateKey::due`]); waiting for the key's I/O lock, a caller renews if
//! due, else spends the cell or takes what [`RateKey::uncovered`] says (one exact call, or
//! a denial); the sweep renews and gives idle leases up.
#![allow(dead_code)] // each test file uses part of the harness

use std::collections::VecDeque;

use leasehold_core::Rate;
use leasehold_core::model::region::{BrokerCall, BrokerConfig, KeyBroker};
use leasehold_core::model::{AgentId, GlobalBucket, Op, Reply, Request};
use leasehold_core::rate_lease::{RateKey, Uncovered};
use leasehold_core::rule::{BucketParams, Leasing, RegionParams, Rule};
use leasehold_core::{
    Around, Cell, KeyPolicy, Level, PolicyConfig, Reclaim, Refill, SweepAction, Verdict,
};
use std::sync::Arc;

pub(crate) const T0_US: u64 = 1_700_000_000_000_000;
pub(crate) const MS: u64 = 1_000_000;
const SWEEP_EVERY_MS: u64 = 100;

#[path = "rng.rs"]
mod rng;
pub(crate) use rng::Rng;

/// How the total offered load is split over the agents.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Split {
    Even,
    /// Agent i gets a weight 1 / (i+1)^s.
    Zipf(f64),
    /// One agent takes this fraction, the rest share the remainder evenly.
    One(f64),
}

impl Split {
    pub(crate) fn weights(&self, n: usize) -> Vec<f64> {
        let w: Vec<f64> = match self {
            Split::Even => vec![1.0; n],
            Split::Zipf(s) => (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(*s)).collect(),
            Split::One(f) if n > 1 => (0..n)
                .map(|i| {
                    if i == 0 {
                        *f
                    } else {
                        (1.0 - f) / (n - 1) as f64
                    }
                })
                .collect(),
            Split::One(_) => vec![1.0],
        };
        let sum: f64 = w.iter().sum();
        w.iter().map(|x| x / sum).collect()
    }
}

/// A phase of the run: from `at_ms`, per-agent offered rates (tokens/s; 0 = silent).
#[derive(Clone, Debug)]
pub(crate) struct Phase {
    pub(crate) at_ms: u64,
    pub(crate) rates: Vec<f64>,
}

/// Something that happens to an agent at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// The agent's process dies: its lease and its state are gone; the store's record of
    /// it expires on its own. It comes back (a new process, same id) at `back_ms`.
    Crash {
        agent: usize,
        at_ms: u64,
        back_ms: u64,
    },
}

#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub(crate) rule: Rule,
    pub(crate) cfg: PolicyConfig,
    pub(crate) agents: usize,
    pub(crate) phases: Vec<Phase>,
    pub(crate) events: Vec<Event>,
    pub(crate) total_ms: u64,
    /// Round trip of a store call, µs (the store applies it when sent).
    pub(crate) rtt_us: u64,
    /// Probability a reply is lost (the call took effect; the caller times out).
    pub(crate) lose: f64,
    pub(crate) seed: u64,
    /// Set: the fleet is spread over regions (agent `i` in region `i % n`).
    pub(crate) regions: Option<Regions>,
    /// Each agent's requests arrive at random (a Poisson process of its rate: they bunch
    /// as real traffic does), else evenly, each millisecond.
    pub(crate) poisson: bool,
}

/// A deployment in regions. Each region's agents lease from the region's bucket of the
/// key, in the region's store; the region's broker ([`KeyBroker`]) acquires from the
/// global bucket over a slow link and deposits into the region's. Every store and broker
/// has its own clock: its own offset (hours apart) and rate (a few hundred ppm apart).
#[derive(Clone, Debug)]
pub(crate) struct Regions {
    pub(crate) n: usize,
    /// Round trip between a broker and the global store, µs.
    pub(crate) rtt_us: u64,
    /// What a region admits past its term (`None`: nothing).
    pub(crate) floor: Option<Rate>,
    /// The term a broker asks of the global bucket (its lease TTL there), µs.
    pub(crate) term_us: u64,
    /// `(region, from_ms, to_ms)`: its broker cannot reach the global store.
    pub(crate) partitions: Vec<(usize, u64, u64)>,
    pub(crate) broker: BrokerConfig,
}

/// A clock: `offset + t * (1 + ppm / 1e6)`, in µs, from the run's time in ns.
#[derive(Clone, Copy, Debug)]
struct Clock {
    offset_us: i64,
    ppm: i64,
}

impl Clock {
    fn draw(rng: &mut Rng) -> Self {
        let hour = 3_600_000_000i64;
        Self {
            offset_us: (rng.next_u64() % (2 * hour as u64)) as i64 - hour,
            ppm: (rng.next_u64() % 601) as i64 - 300,
        }
    }
    fn at(&self, t_ns: u64) -> u64 {
        let t_us = (t_ns / 1000) as i64;
        (T0_US as i64 + self.offset_us + t_us + t_us * self.ppm / 1_000_000) as u64
    }
}

/// One region's store, broker and link.
#[derive(Debug)]
struct Region {
    bucket: GlobalBucket,
    clock: Clock,
    broker: KeyBroker,
    broker_clock: Clock,
    global: Option<GlobalCall>,
}

/// A broker's call to the global store.
#[derive(Debug)]
struct GlobalCall {
    req: Request,
    sent_ns: u64,
    /// Applied at the global store then (None once applied, or lost on the way).
    apply_ns: Option<u64>,
    reply_ns: u64,
    /// The reply, unless lost.
    reply: Option<Reply>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquire {
        needed: u64,
    },
    /// For the waiter at the front of the queue.
    Exact {
        cost: u64,
    },
    Rate,
}

#[derive(Debug)]
struct Inflight {
    sent_ns: u64,
    done_ns: u64,
    kind: Kind,
    reply: Option<Reply>,
}

#[derive(Debug)]
struct Waiter {
    id: usize,
    cost: u64,
    /// Store calls it made (a rate key's caller: 1, its renewal; 2, its exact call;
    /// [`BORROWED`], the renewal that borrowed from the level for it).
    rounds: u32,
}

/// A rate key's caller whose renewal borrowed from the level ([`Uncovered::Borrow`]).
const BORROWED: u32 = 3;

#[derive(Debug)]
struct Agent {
    id: AgentId,
    seq: u64,
    /// The key's cell and refill state, as the agent keeps them (shared with the
    /// decision while the fleet starts a refill from inside it).
    key: Arc<(Cell, Refill)>,
    policy: KeyPolicy,
    /// The key's rate lease (a rate rule's).
    rate: RateKey,
    last_io_ns: u64,
    inflight: Option<Inflight>,
    waiting: VecDeque<Waiter>,
    down_until_ms: u64,
    /// Pacing accumulator.
    acc: f64,
    admitted: u64,
    calls: u64,
    /// Offered and admitted over the run's second half.
    last_offered: u64,
    last_admitted: u64,
}

impl Agent {
    /// Agent `i` at `now_ns`; a rate rule's key leases once it has a grant.
    fn new(i: usize, now_ns: u64, rule: &Rule) -> Self {
        Self {
            id: AgentId(i as u64 + 1),
            seq: 0,
            key: {
                let cell = Cell::new();
                // Every agent of the fleet leases the key.
                cell.reset(u64::MAX, rule.leasing() != Leasing::Rate, false, false);
                Arc::new((cell, Refill::new()))
            },
            policy: KeyPolicy::new(now_ns),
            rate: RateKey::default(),
            last_io_ns: now_ns,
            inflight: None,
            waiting: VecDeque::new(),
            down_until_ms: 0,
            acc: 0.0,
            admitted: 0,
            calls: 0,
            last_offered: 0,
            last_admitted: 0,
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) offered: u64,
    pub(crate) admitted: u64,
    pub(crate) ideal_admitted: u64,
    pub(crate) utilisation: f64,
    /// Utilisation over the run's second half (requests that arrived in it).
    pub(crate) late_utilisation: f64,
    /// Requests the ideal bucket admitted that the fleet denied.
    pub(crate) below_limit_denied: u64,
    /// Of them, those that arrived in the run's second half.
    pub(crate) late_below_limit_denied: u64,
    /// Requests that failed because their reply was lost.
    pub(crate) unavailable: u64,
    /// Largest excess of any window over `B + r*W`, tokens (<= 0 keeps I1).
    pub(crate) worst_window_excess: f64,
    pub(crate) calls: u64,
    /// Calls made over the run's second half.
    pub(crate) late_calls: u64,
    /// Acquires that granted nothing.
    pub(crate) refused: u64,
    /// Decisions that waited for a store call (the others were decided locally, from the
    /// lease or the denial cache).
    pub(crate) waited: u64,
    pub(crate) calls_per_1k: f64,
    /// Per agent: admitted, and what it offered.
    pub(crate) per_agent: Vec<(u64, u64)>,
    /// Admitted and ideal-admitted per 100 ms, for traces.
    pub(crate) trace: Vec<(u64, u64)>,
    /// Tokens the agents' leases hold when the run ends: taken from the bucket, spent
    /// after the run (a short run counts them as lost).
    pub(crate) held_at_end: u64,
    /// Highest `tokens + outstanding` seen on the bucket.
    pub(crate) max_committed: u64,
    /// Calls between brokers and the global store.
    pub(crate) cross_calls: u64,
    /// Per region, tokens admitted per ms.
    pub(crate) region_ms: Vec<Vec<u64>>,
    /// Largest relative distance of an agent's part of the admissions from its part of
    /// the offered load (agents offering at least 1% of it), over the run's second half.
    pub(crate) worst_share_error: f64,
}

pub(crate) struct Fleet {
    s: Setup,
    p: BucketParams,
    bucket: GlobalBucket,
    agents: Vec<Agent>,
    rng: Rng,
    calls: u64,
    late_calls: u64,
    /// Per request id: admitted by the fleet.
    ours: Vec<bool>,
    ideal_ok: Vec<bool>,
    /// Per request id: the ms it arrived in.
    arrival_ms: Vec<u64>,
    unavailable: u64,
    admitted_ms: Vec<u64>,
    max_committed: u64,
    restarts: u64,
    refused: u64,
    waited: u64,
    regions: Vec<Region>,
    /// The global bucket's parameters at the brokers, and its clock.
    global_p: BucketParams,
    global_clock: Clock,
    region_p: BucketParams,
    cross_calls: u64,
    /// Per region, tokens admitted per ms.
    region_ms: Vec<Vec<u64>>,
}

impl Fleet {
    pub(crate) fn run(s: Setup) -> Outcome {
        let p = s.rule.bucket_params();
        let agents = (0..s.agents).map(|i| Agent::new(i, 0, &s.rule)).collect();
        let rng = Rng::new(s.seed);
        // The clocks have their own generator: a run without regions draws as it did.
        let mut clocks = Rng::new(s.seed ^ 0xC10C);
        let mut global_p = p;
        let mut region_p = p;
        let mut regions = Vec::new();
        let global_clock = Clock::draw(&mut clocks);
        if let Some(r) = &s.regions {
            global_p.lease_ttl_us = r.term_us;
            region_p.region = Some(RegionParams::new(r.floor));
            for k in 0..r.n {
                regions.push(Region {
                    bucket: GlobalBucket::new(),
                    clock: Clock::draw(&mut clocks),
                    broker: KeyBroker::new(AgentId(0xB000 + k as u64), 0),
                    broker_clock: Clock::draw(&mut clocks),
                    global: None,
                });
            }
        }
        let mut f = Fleet {
            rng,
            regions,
            global_p,
            global_clock,
            region_p,
            cross_calls: 0,
            region_ms: Vec::new(),
            admitted_ms: vec![0; s.total_ms as usize + 1],
            s,
            p,
            bucket: GlobalBucket::new(),
            agents,
            calls: 0,
            late_calls: 0,
            ours: Vec::new(),
            ideal_ok: Vec::new(),
            arrival_ms: Vec::new(),
            unavailable: 0,
            max_committed: 0,
            restarts: 0,
            refused: 0,
            waited: 0,
        };
        f.go()
    }

    fn go(&mut self) -> Outcome {
        self.region_ms = vec![vec![0; self.s.total_ms as usize + 1]; self.regions.len()];
        let mut ideal = Level::full(self.p.capacity);
        let mut offered_per = vec![0u64; self.s.agents];
        let mut trace = Vec::new();
        let mut t_ideal = 0u64;
        for ms in 0..self.s.total_ms {
            let base = ms * MS + 1;
            if ms > 0 {
                ideal = ideal.refill(self.p.capacity, self.p.rate, 1000);
            }
            for e in self.s.events.clone() {
                match e {
                    Event::Crash {
                        agent,
                        at_ms,
                        back_ms,
                    } if at_ms == ms => {
                        let a = &mut self.agents[agent];
                        for w in std::mem::take(&mut a.waiting) {
                            self.ours[w.id] = false;
                        }
                        // A new process: a new agent id, nothing of the old state.
                        let mut fresh = Agent::new(agent, base, &self.s.rule);
                        self.restarts += 1;
                        fresh.id = AgentId(self.restarts << 32 | (agent as u64 + 1));
                        fresh.down_until_ms = back_ms;
                        *a = fresh;
                    }
                    _ => {}
                }
            }
            self.brokers(base);
            let phase = self
                .s
                .phases
                .iter()
                .rev()
                .find(|ph| ph.at_ms <= ms)
                .expect("a phase at 0")
                .rates
                .clone();
            // Agents take turns in a different order every millisecond (no agent is
            // always first to the tokens a refill brings).
            let n_agents = self.s.agents.min(phase.len());
            let first = (self.rng.next_u64() % n_agents.max(1) as u64) as usize;
            for j in 0..n_agents {
                let i = (first + j) % n_agents;
                let rate = phase[i];
                if self.agents[i].down_until_ms > ms {
                    continue;
                }
                let n = if self.s.poisson {
                    poisson(&mut self.rng, rate / 1000.0)
                } else {
                    self.agents[i].acc += rate / 1000.0;
                    let n = self.agents[i].acc.floor() as u64;
                    self.agents[i].acc -= n as f64;
                    n
                };
                for k in 0..n {
                    let t = base + k * (MS / n);
                    self.complete(i, t);
                    let id = self.ours.len();
                    self.ours.push(false);
                    let ok = ideal.tokens >= 1;
                    if ok {
                        ideal = ideal.take(1);
                        t_ideal += 1;
                    }
                    self.ideal_ok.push(ok);
                    self.arrival_ms.push(ms);
                    if ms * 2 >= self.s.total_ms {
                        self.agents[i].last_offered += 1;
                    }
                    offered_per[i] += 1;
                    self.decide(i, id, 1, t);
                }
            }
            let end = base + MS - 1;
            for i in 0..self.s.agents {
                if self.agents[i].down_until_ms <= ms {
                    self.complete(i, end);
                }
            }
            if ms % SWEEP_EVERY_MS == SWEEP_EVERY_MS - 1 {
                for i in 0..self.s.agents {
                    if self.agents[i].down_until_ms <= ms {
                        self.sweep(i, base + MS / 2);
                    }
                }
            }
            self.check_i1();
            if ms % 100 == 99 {
                let got: u64 = self.admitted_ms[(ms - 99) as usize..=ms as usize]
                    .iter()
                    .sum();
                trace.push((got, t_ideal));
                t_ideal = 0;
            }
        }
        // Calls still in flight when the run stops complete (and the second calls they
        // lead to): their callers are decided.
        for pass in 1..=3 {
            let end = self.s.total_ms * MS + pass * self.s.rtt_us * 1000;
            for i in 0..self.s.agents {
                self.complete(i, end);
            }
        }
        let admitted: u64 = self.ours.iter().filter(|x| **x).count() as u64;
        let ideal_admitted: u64 = self.ideal_ok.iter().filter(|x| **x).count() as u64;
        let below = self
            .ours
            .iter()
            .zip(&self.ideal_ok)
            .filter(|(o, i)| **i && !**o)
            .count() as u64;
        let late_below = (self.ours.iter().zip(&self.ideal_ok).zip(&self.arrival_ms))
            .filter(|((o, i), ms)| **i && !**o && **ms * 2 >= self.s.total_ms)
            .count() as u64;
        let offered = self.ours.len() as u64;
        let last_offered: u64 = self.agents.iter().map(|a| a.last_offered).sum();
        let last_admitted: u64 = self.agents.iter().map(|a| a.last_admitted).sum();
        let late_ideal = (self.ideal_ok.iter().zip(&self.arrival_ms))
            .filter(|(ok, ms)| **ok && **ms * 2 >= self.s.total_ms)
            .count() as u64;
        let worst_share_error = self
            .agents
            .iter()
            .filter(|a| a.last_offered * 100 >= last_offered && last_admitted > 0)
            .map(|a| {
                let want = a.last_offered as f64 / last_offered as f64;
                let got = a.last_admitted as f64 / last_admitted as f64;
                (got / want - 1.0).abs()
            })
            .fold(0.0, f64::max);
        Outcome {
            worst_share_error,
            offered,
            admitted,
            ideal_admitted,
            utilisation: admitted as f64 / ideal_admitted.max(1) as f64,
            late_utilisation: last_admitted as f64 / late_ideal.max(1) as f64,
            below_limit_denied: below.saturating_sub(self.unavailable),
            late_below_limit_denied: late_below,
            unavailable: self.unavailable,
            worst_window_excess: self.worst_window(),
            calls: self.calls,
            late_calls: self.late_calls,
            refused: self.refused,
            waited: self.waited,
            calls_per_1k: self.calls as f64 * 1000.0 / offered.max(1) as f64,
            per_agent: self
                .agents
                .iter()
                .zip(&offered_per)
                .map(|(a, o)| (a.admitted, *o))
                .collect(),
            trace,
            max_committed: self.max_committed,
            cross_calls: self.cross_calls,
            region_ms: std::mem::take(&mut self.region_ms),
            held_at_end: self.agents.iter().map(|a| a.key.0.lease.held()).sum(),
        }
    }

    /// The brokers at `t`: global calls reach the store and their replies the brokers
    /// (unless a partition cuts them: the broker times out), then each broker sends what
    /// its policy asks (region calls are answered at once).
    fn brokers(&mut self, t: u64) {
        let Some(rs) = self.s.regions.clone() else {
            return;
        };
        let cut = |k: usize, at: u64| {
            rs.partitions
                .iter()
                .any(|&(r, a, b)| r == k && at >= a * MS && at < b * MS)
        };
        let mut due: Vec<(u64, usize)> = self
            .regions
            .iter()
            .enumerate()
            .filter_map(|(k, r)| {
                r.global
                    .as_ref()?
                    .apply_ns
                    .filter(|a| *a <= t)
                    .map(|a| (a, k))
            })
            .collect();
        due.sort();
        for (at, k) in due {
            let c = self.regions[k].global.as_mut().expect("due");
            c.apply_ns = None;
            if cut(k, c.sent_ns) {
                continue;
            }
            let reply = self
                .bucket
                .apply(&self.global_p, self.global_clock.at(at), &c.req)
                .expect("the global bucket accepts every request a broker makes");
            if !cut(k, c.reply_ns) {
                c.reply = Some(reply);
            }
        }
        let timeout = 2 * rs.rtt_us * 1000 + 20 * MS;
        for k in 0..rs.n {
            let r = &mut self.regions[k];
            if let Some(c) = &r.global
                && c.apply_ns.is_none()
            {
                match c.reply {
                    Some(reply) if c.reply_ns <= t => {
                        let now = r.broker_clock.at(c.reply_ns);
                        r.broker
                            .on_global_reply(now, &rs.broker, &self.global_p, &reply);
                        r.global = None;
                    }
                    None if t >= c.sent_ns + timeout => {
                        r.broker.on_failure();
                        r.global = None;
                    }
                    _ => {}
                }
            }
            for _ in 0..4 {
                let now = r.broker_clock.at(t);
                match r.broker.poll(now, &rs.broker, &self.global_p) {
                    None => break,
                    Some(BrokerCall::Region(req)) => {
                        let reply = r
                            .bucket
                            .apply(&self.region_p, r.clock.at(t), &req)
                            .expect("the region's bucket accepts every deposit");
                        let back = r.broker_clock.at(t + 100_000);
                        r.broker.on_region_reply(back, &rs.broker, &reply);
                    }
                    Some(BrokerCall::Global(req)) => {
                        self.cross_calls += 1;
                        r.global = Some(GlobalCall {
                            req,
                            sent_ns: t,
                            apply_ns: Some(t + rs.rtt_us * 500),
                            reply_ns: t + rs.rtt_us * 1000,
                            reply: None,
                        });
                        break;
                    }
                }
            }
        }
    }

    fn check_i1(&mut self) {
        for (k, r) in self.regions.iter().enumerate() {
            if let Some(st) = r.bucket.state() {
                assert!(
                    st.level.tokens + st.outstanding <= self.p.capacity,
                    "region {k}: tokens {} + outstanding {} > B",
                    st.level.tokens,
                    st.outstanding
                );
            }
        }
        if let Some(st) = self.bucket.state()
            && self.p.mode == leasehold_core::Mode::Strict
        {
            let committed = st.level.tokens + st.outstanding;
            assert!(
                committed <= self.p.capacity,
                "I1: tokens {} + outstanding {} > B {}",
                st.level.tokens,
                st.outstanding,
                self.p.capacity
            );
            self.max_committed = self.max_committed.max(committed);
        }
    }

    fn worst_window(&self) -> f64 {
        let per_ms = self.p.rate.tokens() as f64 * 1000.0 / self.p.rate.period_us() as f64;
        let a = &self.admitted_ms;
        let mut worst = f64::NEG_INFINITY;
        for w in [1usize, 10, 100, 1000] {
            if w > a.len() {
                continue;
            }
            let mut sum: u64 = a[..w].iter().sum();
            for end in w..=a.len() {
                if end > w {
                    sum = sum + a[end - 1] - a[end - 1 - w];
                }
                // A window of w whole ms spans at most w+1 ms of refill.
                let bound = self.p.capacity as f64 + per_ms * (w + 1) as f64;
                worst = worst.max(sum as f64 - bound);
            }
        }
        worst
    }

    fn admit(&mut self, i: usize, id: usize, t: u64) {
        self.ours[id] = true;
        if self.arrival_ms[id] * 2 >= self.s.total_ms {
            self.agents[i].last_admitted += 1;
        }
        self.agents[i].admitted += 1;
        let last = self.admitted_ms.len() - 1;
        self.admitted_ms[((t / MS) as usize).min(last)] += 1;
        if let Some(r) = &self.s.regions {
            self.region_ms[i % r.n][((t / MS) as usize).min(last)] += 1;
        }
    }

    /// One decision of `cost` by agent `i` at `t`, request `id`: the agent's local
    /// decision, else a wait for the store.
    fn decide(&mut self, i: usize, id: usize, cost: u64, t: u64) {
        let key = self.agents[i].key.clone();
        let verdict = (key.0).decide(&key.1, cost, t, &mut Driving { fleet: self, i });
        match verdict {
            Verdict::Lease { .. } | Verdict::Seat { .. } => self.admit(i, id, t),
            Verdict::Denied { .. } => {}
            Verdict::Store if self.rated() => {
                self.waited += 1;
                self.agents[i].waiting.push_back(Waiter {
                    id,
                    cost,
                    rounds: 0,
                });
                self.rate_serve(i, t);
            }
            Verdict::Store => {
                let a = &mut self.agents[i];
                let start = a.inflight.is_none();
                self.waited += 1;
                a.waiting.push_back(Waiter {
                    id,
                    cost,
                    rounds: u32::from(start),
                });
                if start {
                    self.start_acquire(i, t, cost);
                }
            }
        }
    }

    fn send(&mut self, i: usize, t: u64, op: Op) -> Option<Reply> {
        let a = &mut self.agents[i];
        a.seq += 1;
        a.last_io_ns = t;
        a.calls += 1;
        a.policy.called();
        self.calls += 1;
        if t / MS * 2 >= self.s.total_ms {
            self.late_calls += 1;
        }
        let req = Request {
            agent: a.id,
            seq: a.seq,
            op,
        };
        let reply = match &self.s.regions {
            Some(r) => {
                let region = &mut self.regions[i % r.n];
                region
                    .bucket
                    .apply(&self.region_p, region.clock.at(t), &req)
                    .expect("the region's bucket accepts every request the policy makes")
            }
            None => self
                .bucket
                .apply(&self.p, T0_US + t / 1000, &req)
                .expect("the model accepts every request the policy makes"),
        };
        (self.rng.unit() >= self.s.lose).then_some(reply)
    }

    fn start_acquire(&mut self, i: usize, t: u64, needed: u64) {
        let a = &mut self.agents[i];
        let cell = &a.key.0;
        let args = a.policy.acquire(
            &self.s.rule,
            &self.s.cfg,
            t,
            &cell.lease,
            cell.denied_tokens(),
            needed,
        );
        let op = Op::Acquire {
            held: args.held,
            want: args.want,
            min: args.min,
            demand: args.demand,
        };
        self.start(i, t, op, Kind::Acquire { needed });
    }

    /// Completes agent `i`'s call in flight if its reply is due by `t`, then serves the
    /// callers waiting for it.
    fn complete(&mut self, i: usize, t: u64) {
        let Some(f) = self.agents[i].inflight.take_if(|f| f.done_ns <= t) else {
            return;
        };
        let now = f.done_ns;
        match (f.kind, f.reply) {
            (Kind::Acquire { needed }, Some(r)) => {
                self.refused += u64::from(r.granted == 0);
                let a = &mut self.agents[i];
                let (cell, refill) = &*a.key;
                a.policy.granted(
                    &self.s.rule,
                    &self.s.cfg,
                    cell,
                    refill,
                    f.sent_ns,
                    now,
                    needed,
                    &r,
                    false,
                );
            }
            (Kind::Rate, reply) => {
                let a = &mut self.agents[i];
                let (cell, refill) = &*a.key;
                match reply {
                    Some(r) => {
                        let margin = self.s.cfg.margin.as_nanos() as u64;
                        a.rate.granted(cell, refill, &self.p, &r, now, margin);
                        cell.set_leases(true);
                    }
                    None => {
                        // Its caller's decision falls to the failure policy.
                        a.rate.failed();
                        if (a.waiting.front()).is_some_and(|w| matches!(w.rounds, 1 | BORROWED)) {
                            let w = a.waiting.pop_front().expect("a caller");
                            self.unavailable += 1;
                            a.key.0.count_denied(w.cost);
                        }
                    }
                }
                self.rate_serve(i, now);
                return;
            }
            (Kind::Exact { cost }, reply) => {
                let w = self.agents[i]
                    .waiting
                    .pop_front()
                    .expect("the exact call's caller");
                match reply {
                    Some(r) if r.granted >= cost => {
                        self.admit(i, w.id, now);
                        self.agents[i].rate.offered(now, cost);
                    }
                    Some(_) => {}
                    None => self.unavailable += 1,
                }
                self.rate_serve(i, now);
                return;
            }
            (Kind::Acquire { .. }, None) => {
                // The caller timed out: its decision falls to the failure policy (counted
                // apart); the next acquire declares what the lease holds.
                for w in std::mem::take(&mut self.agents[i].waiting) {
                    self.unavailable += 1;
                    self.agents[i].key.0.count_denied(w.cost);
                }
                return;
            }
        }
        // The callers waiting on the key's I/O lock, in order: each looks at the lease
        // and the denial cache again, then makes its own acquire (two at most).
        let mut waiting = std::mem::take(&mut self.agents[i].waiting);
        let key = self.agents[i].key.clone();
        while let Some(mut w) = waiting.pop_front() {
            match (key.0).recheck(&key.1, w.cost, now, &mut Driving { fleet: self, i }) {
                Some(Verdict::Lease { .. }) => {
                    self.admit(i, w.id, now);
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            let a = &mut self.agents[i];
            if a.inflight.is_none() && w.rounds >= 2 {
                a.key.0.count_denied(w.cost);
                continue;
            }
            let start = a.inflight.is_none();
            if start {
                w.rounds += 1;
            }
            let cost = w.cost;
            a.waiting.push_back(w);
            if start {
                a.waiting.extend(waiting.drain(..));
                self.start_acquire(i, now, cost);
                return;
            }
        }
    }

    fn sweep(&mut self, i: usize, t: u64) {
        if self.agents[i].inflight.is_some() {
            return;
        }
        if self.rated() {
            return self.rate_sweep(i, t);
        }
        let a = &mut self.agents[i];
        let cell = &a.key.0;
        let action = a.policy.sweep(
            &self.s.rule,
            &self.s.cfg,
            t,
            &cell.lease,
            cell.denied_tokens(),
            a.last_io_ns,
        );
        match action {
            SweepAction::Keep => {}
            SweepAction::Renew => self.start_acquire(i, t, 0),
            SweepAction::Idle | SweepAction::Reclaim(_) => {
                let withdraw = matches!(
                    action,
                    SweepAction::Idle | SweepAction::Reclaim(Reclaim::Idle)
                );
                let expired = t >= cell.lease.deadline_ns();
                let taken = cell.lease.take_all();
                let tell = a.policy.released(taken, withdraw);
                let returned = if expired { 0 } else { taken };
                if returned > 0 || tell {
                    let _ = self.send(i, t, Op::Release { returned });
                }
            }
        }
    }
}

impl Fleet {
    fn rated(&self) -> bool {
        self.s.rule.leasing() == Leasing::Rate
    }

    /// A caller of agent `i` the cell did not cover, at `t` (the agent's `rate_refill`):
    /// the share's accrual goes into the cell, and a renewal starts if one is due and no
    /// call is in flight. Whether the caller must wait: the cell is still empty.
    fn rate_refill(&mut self, i: usize, t: u64) -> bool {
        let a = &mut self.agents[i];
        a.rate.sync(&a.key.0, t);
        if a.rate.due(t) && a.inflight.is_none() {
            self.start_rate(i, t);
        }
        let a = &self.agents[i];
        a.rate.must_wait(&a.key.0, &a.key.1, self.s.rule.rate())
    }

    fn start_rate(&mut self, i: usize, t: u64) {
        let a = &mut self.agents[i];
        let op = a.rate.call(&a.key.0, &self.p, t);
        self.start(i, t, op, Kind::Rate);
    }

    fn start(&mut self, i: usize, t: u64, op: Op, kind: Kind) {
        let reply = self.send(i, t, op);
        self.agents[i].inflight = Some(Inflight {
            sent_ns: t,
            done_ns: t + self.s.rtt_us * 1000,
            kind,
            reply,
        });
        if self.s.rtt_us == 0 {
            self.complete(i, t);
        }
    }

    /// The callers waiting on agent `i`'s rate key at `t`, in order, while no call is in
    /// flight, each as the agent's store path runs for it once the key's I/O lock is its:
    /// a renewal if one is due (the caller then looks again when it completes), else the
    /// share's accrual; then the cell; then one exact call, or a denial.
    fn rate_serve(&mut self, i: usize, t: u64) {
        while self.agents[i].inflight.is_none() {
            let Some(mut w) = self.agents[i].waiting.pop_front() else {
                return;
            };
            let a = &mut self.agents[i];
            if w.rounds == 0 && a.rate.due(t) {
                w.rounds = 1;
                a.waiting.push_front(w);
                self.start_rate(i, t);
                continue;
            }
            a.rate.sync(&a.key.0, t);
            let key = a.key.clone();
            if let Some(Verdict::Lease { .. }) =
                (key.0).spend(w.cost, t, &key.1, &mut Driving { fleet: self, i })
            {
                self.admit(i, w.id, t);
                continue;
            }
            let a = &mut self.agents[i];
            if a.inflight.is_some() {
                // The cell's prefetch started a renewal: the caller waits for it.
                w.rounds = w.rounds.max(1);
                a.waiting.push_front(w);
                return;
            }
            match (a.rate).uncovered(&a.key.1, w.cost, self.s.rule.rate(), w.rounds == BORROWED) {
                Uncovered::Exact => {
                    let cost = w.cost;
                    w.rounds = 2;
                    a.waiting.push_front(w);
                    self.start(i, t, Op::Exact { cost }, Kind::Exact { cost });
                }
                Uncovered::Borrow => {
                    w.rounds = BORROWED;
                    a.waiting.push_front(w);
                    self.start_rate(i, t);
                }
                Uncovered::Wait(_) => a.key.0.count_denied(w.cost),
            }
        }
    }

    /// The sweep's visit of agent `i`'s rate key (the agent's `rate_sweep`): given up when
    /// nothing was offered for the idle time, renewed when due.
    fn rate_sweep(&mut self, i: usize, t: u64) {
        let ttl_ns = self.s.rule.lease_ttl().as_nanos() as u64;
        let idle_ns = (self.s.cfg.idle_after.as_nanos() as u64).min(ttl_ns / 2);
        let a = &mut self.agents[i];
        if !a.rate.live() {
            return;
        }
        a.rate.sync(&a.key.0, t);
        if a.rate.idle(t, idle_ns) {
            let returned = a.rate.release(&a.key.0, &a.key.1, t);
            a.key.0.set_leases(false);
            let _ = self.send(i, t, Op::Release { returned });
        } else if a.rate.due(t) {
            self.start_rate(i, t);
        }
    }
}

/// The fleet around agent `i`'s cell while it decides: a refill is the agent's acquire,
/// started unless one is in flight (with no round trip it completes at once).
struct Driving<'a> {
    fleet: &'a mut Fleet,
    i: usize,
}

impl Around for Driving<'_> {
    fn rate(&self) -> Rate {
        self.fleet.s.rule.rate()
    }

    fn refill(&mut self, now_ns: u64) -> bool {
        if self.fleet.rated() {
            return self.fleet.rate_refill(self.i, now_ns);
        }
        if self.fleet.agents[self.i].inflight.is_none() {
            self.fleet.start_acquire(self.i, now_ns, 0);
        }
        self.fleet.agents[self.i].inflight.is_some()
    }

    fn may_await_refill(&mut self, _: u64) -> bool {
        true
    }
}

/// Offered rates for `n` agents: `total` tokens/s split by `split`.
pub(crate) fn rates(n: usize, total: f64, split: &Split) -> Vec<f64> {
    split.weights(n).iter().map(|w| w * total).collect()
}

/// A draw of a Poisson variable of mean `mean` (Knuth's: fine for the few arrivals of one
/// agent in a millisecond).
fn poisson(rng: &mut Rng, mean: f64) -> u64 {
    let floor = (-mean).exp();
    let (mut k, mut p) = (0, rng.unit());
    while p > floor {
        k += 1;
        p *= rng.unit();
    }
    k
}
