//! Rate leases on a virtual clock: agents that spend every token their grant allows, as
//! fast as it allows (the worst case for the bound), renewing every half term through a
//! store that answers a round trip later; replies lost (the retry replays), agents
//! crashing (their records expire), agents' clocks offset and running fast or slow; and a
//! taker of the bucket's level beside them, taking whatever is there every step. Every
//! window of every length must stay within `B + r·W`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use leasehold_core::model::AgentId;
use leasehold_core::rate_lease::{LocalRate, RateBucket, RateGrant, RatePolicy};
use leasehold_core::rule::{BucketParams, Rule};

const T0_US: u64 = 1_700_000_000_000_000;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct Agent {
    id: AgentId,
    local: LocalRate,
    seq: u64,
    /// The agent's clock: `offset + t × (1 + ppm / 1e6)` ns, `t` the store's µs.
    offset_ns: i64,
    ppm: i64,
    next_call_us: u64,
    /// A request in flight: sent at (agent ns), its grant, due at (store µs); `None`
    /// grant: the reply is lost.
    inflight: Option<(u64, Option<RateGrant>, u64)>,
    /// Down until then (store µs): a crashed process; it comes back with a new id.
    down_until_us: u64,
    /// The last request's reply was lost: the next call sends it again.
    retry: bool,
    demand_milli: u64,
    want_burst: u64,
}

impl Agent {
    fn clock_ns(&self, t_us: u64) -> u64 {
        let t = t_us as i128 * 1_000;
        (t + t * self.ppm as i128 / 1_000_000 + self.offset_ns as i128) as u64
    }
}

struct Setup {
    agents: usize,
    capacity: u64,
    rate: &'static str,
    term_us: u64,
    step_us: u64,
    total_us: u64,
    rtt_us: u64,
    lose: f64,
    crash: f64,
    seed: u64,
    /// Nobody spends before then (leases renew): the level and every local bucket fill
    /// up, then everything is spent at once, the moment the bound is tightest.
    quiet_us: u64,
    /// Every agent's clock this fast (ppm) instead of a random rate within ±500 ppm, and
    /// every agent's demand and burst, instead of random ones.
    fixed: Option<(i64, u64, u64)>,
}

/// Runs `s`; returns the largest excess of any window over `B + r·W` (tokens; ≤ 0 keeps
/// the bound), the utilisation of `r` over the run, and how many tokens the taker got.
fn run(s: &Setup) -> (f64, f64, u64) {
    let rule = Rule::new("rl", s.capacity, s.rate).unwrap();
    let p: BucketParams = rule.bucket_params();
    let mut rng = Rng(s.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut bucket = RateBucket::new(&p, T0_US);
    let rate_per_sec = rule.rate().per_sec_f64();
    let mut restarts = 0u64;
    let mut agents: Vec<Agent> = (0..s.agents)
        .map(|i| Agent {
            id: AgentId(i as u64 + 1),
            local: LocalRate::default(),
            seq: 0,
            offset_ns: (rng.next() % 3_600_000_000_000) as i64,
            ppm: (rng.next() % 1_001) as i64 - 500,
            next_call_us: rng.next() % s.term_us.max(1),
            inflight: None,
            down_until_us: 0,
            retry: false,
            // Reported demand: together about twice the rate (contended: the shares sum to
            // the whole rate), from a tenth to twice an even part each.
            demand_milli: (rate_per_sec * 1000.0 / s.agents as f64 * (0.1 + 3.8 * rng.unit()))
                as u64,
            // Bursts: together about 80% of B.
            want_burst: 1 + rng.next() % (s.capacity * 8 / 5 / s.agents as u64 + 1),
        })
        .collect();
    if let Some((ppm, demand_milli, burst)) = s.fixed {
        for a in &mut agents {
            (a.ppm, a.demand_milli, a.want_burst) = (ppm, demand_milli, burst);
        }
    }
    let steps = (s.total_us / s.step_us) as usize;
    let mut admitted = vec![0u64; steps];
    let mut taken = 0u64;
    let margin_ns = s.term_us * 1_000 / 100 + 1_000_000;
    for (k, slot) in admitted.iter_mut().enumerate() {
        let t = k as u64 * s.step_us;
        let now = T0_US + t;
        for a in agents.iter_mut() {
            if t < a.down_until_us {
                continue;
            }
            if a.down_until_us != 0 && a.down_until_us <= t {
                // Back as a new process: a new id, nothing of the old state.
                restarts += 1;
                a.id = AgentId((restarts << 32) | a.id.0 & 0xffff_ffff);
                a.local = LocalRate::default();
                a.seq = 0;
                a.inflight = None;
                a.down_until_us = 0;
                a.retry = false;
            }
            // A reply due now.
            if let Some((sent_ns, grant, due)) = a.inflight
                && due <= t
            {
                a.inflight = None;
                match grant {
                    Some(g) => a.local.grant(&p, &g, sent_ns, margin_ns),
                    // Lost: the next call retries the same request.
                    None => {
                        a.next_call_us = t;
                        a.retry = true;
                    }
                }
            }
            // A call due now: the store applies it half a round trip after it is sent.
            if a.inflight.is_none() && a.next_call_us <= t {
                if !std::mem::take(&mut a.retry) {
                    a.seq += 1;
                }
                let sent_ns = a.clock_ns(t);
                let g = bucket.lease(
                    &p,
                    now + s.rtt_us / 2,
                    a.id,
                    a.seq,
                    a.demand_milli,
                    a.want_burst,
                    s.term_us,
                );
                let lost = rng.unit() < s.lose;
                a.inflight = Some((sent_ns, (!lost).then_some(g), t + s.rtt_us));
                a.next_call_us = t + s.term_us / 2 + rng.next() % (s.term_us / 4).max(1);
            }
            if rng.unit() < s.crash {
                a.down_until_us = t + s.term_us * 2;
                continue;
            }
            if t < s.quiet_us {
                continue;
            }
            // Greedy: everything the grant allows, now.
            let at = a.clock_ns(t);
            while a.local.try_spend(1, at) {
                *slot += 1;
            }
        }
        // The level's taker: everything there.
        let level = bucket.level(&p);
        if t >= s.quiet_us && level > 0 && bucket.take(&p, now, level) {
            *slot += level;
            taken += level;
        }
    }
    // Every window of 1 to all steps.
    let (b, r_tokens, period) = (
        p.capacity as f64,
        p.rate.tokens() as f64,
        p.rate.period_us() as f64,
    );
    let mut worst = f64::MIN;
    let mut prefix = vec![0u64; steps + 1];
    for k in 0..steps {
        prefix[k + 1] = prefix[k] + admitted[k];
    }
    for w in 1..=steps {
        let bound = b + r_tokens * (w as u64 * s.step_us) as f64 / period;
        for start in 0..=steps - w {
            let sum = (prefix[start + w] - prefix[start]) as f64;
            worst = worst.max(sum - bound);
        }
    }
    let ideal = b + r_tokens * (s.total_us - s.quiet_us) as f64 / period;
    (worst, prefix[steps] as f64 / ideal, taken)
}

#[test]
fn a_small_fleet_keeps_the_bound_through_losses_crashes_and_skewed_clocks() {
    for seed in 1..=4 {
        let s = Setup {
            agents: 64,
            capacity: 2_000,
            rate: "20000/s",
            term_us: 400_000,
            step_us: 1_000,
            total_us: 4_000_000,
            rtt_us: 2_000,
            lose: 0.05,
            crash: 0.000_05,
            seed,
            quiet_us: 1_000_000,
            fixed: None,
        };
        let (worst, utilisation, taken) = run(&s);
        assert!(
            worst <= 0.0,
            "seed {seed}: a window {worst} tokens over B + r·W"
        );
        // Greedy takers of everything: the bound is reached, not merely kept.
        assert!(utilisation > 0.95, "seed {seed}: utilisation {utilisation}");
        assert!(taken > 0, "seed {seed}: the level served its taker too");
    }
}

/// 10 000 agents on one key (a step of 5 ms: windows of 5 ms and more).
#[test]
fn ten_thousand_agents_never_break_the_bound() {
    let s = Setup {
        agents: 10_000,
        capacity: 20_000,
        rate: "20000/s",
        term_us: 1_000_000,
        step_us: 5_000,
        total_us: 2_000_000,
        rtt_us: 5_000,
        lose: 0.02,
        crash: 0.000_1,
        seed: 7,
        quiet_us: 1_000_000,
        fixed: None,
    };
    let (worst, _, _) = run(&s);
    assert!(worst <= 0.0, "a window {worst} tokens over B + r·W");
}

/// One agent holding the whole rate and the whole bucket as its burst, its clock 500 ppm
/// fast, spending flat out for 10 s: what keeps it within `B + r·W` is the rate it spends
/// below its share (a share spent 0.5% fast is 1 100 tokens over).
#[test]
fn a_fast_clock_does_not_spend_more_than_the_share() {
    let s = Setup {
        agents: 1,
        capacity: 1_000,
        rate: "20000/s",
        term_us: 1_000_000,
        step_us: 1_000,
        total_us: 11_000_000,
        rtt_us: 1_000,
        lose: 0.0,
        crash: 0.0,
        seed: 3,
        quiet_us: 1_000_000,
        fixed: Some((500, 20_000_000, 1_000)),
    };
    let (worst, utilisation, _) = run(&s);
    assert!(worst <= 0.0, "a window {worst} tokens over B + r·W");
    assert!(utilisation > 0.99, "utilisation {utilisation}");
}

/// The store's side alone: shares never sum above the rate, a retry replays, and a share
/// given up or expired comes back to the level's refill.
#[test]
fn shares_stay_within_the_rate_and_come_back_when_released() {
    let rule = Rule::new("rl", 100, "1000/s").unwrap();
    let p = rule.bucket_params();
    let mut b = RateBucket::new(&p, T0_US);
    // Uncontended: demand plus headroom (400/s wanted: 500 with 25%).
    let g = b.lease(&p, T0_US, AgentId(1), 1, 400_000, 10, 1_000_000);
    assert_eq!((g.share_ppm, g.burst, g.paid), (500_000, 10, 10));
    assert_eq!(
        b.lease(&p, T0_US + 5, AgentId(1), 1, 999_999, 99, 1_000_000),
        RateGrant {
            ttl_us: 999_995,
            ..g
        },
        "a replay: what is left of the term"
    );
    // Contended: each its proportional part, never more than the others leave.
    let g2 = b.lease(&p, T0_US, AgentId(2), 1, 1_200_000, 10, 1_000_000);
    assert_eq!(g2.share_ppm, 500_000, "what agent 1 leaves");
    let g1 = b.lease(&p, T0_US + 10, AgentId(1), 2, 400_000, 10, 1_000_000);
    assert_eq!(g1.share_ppm, 250_000, "its part of 1 600/s");
    assert!(b.committed_ppm() <= 1_000_000);
    // Level: 100 - 20 of bursts; the refill is only the uncommitted quarter, to B - 20.
    b.release(&p, T0_US + 10, AgentId(2));
    assert_eq!(b.committed_ppm(), 250_000);
    assert!(b.take(&p, T0_US + 10, 80), "the level after the bursts");
    assert!(!b.take(&p, T0_US + 10, 1));
    // 10 ms at 750/s: 7 tokens.
    assert!(b.take(&p, T0_US + 10_010, 7));
    assert!(!b.take(&p, T0_US + 10_010, 1));
    // Agent 1's record expires: the whole rate refills the level, up to B.
    assert!(b.take(&p, T0_US + 2_000_000, 90));
}

/// Demand moving between agents every term: 16 agents, 1.2x the rate offered by four of
/// them at a time, the four changing every term. Each agent offers its requests as they
/// come, refuses what its grant does not cover, and calls the store as its
/// [`RatePolicy`] says. Returns its utilisation (what it admitted of what an ideal bucket
/// admits of the same arrivals) and the calls per agent per second.
fn shifting(term_us: u64, seed: u64) -> (f64, f64) {
    use leasehold_core::Level;
    let rule = Rule::new("rl", 20_000, "20000/s").unwrap();
    let p = rule.bucket_params();
    let mut rng = Rng(seed | 1);
    let mut bucket = RateBucket::new(&p, T0_US);
    let n = 16usize;
    let mut local = vec![LocalRate::default(); n];
    let mut policy = vec![RatePolicy::default(); n];
    let mut seq = vec![0u64; n];
    let mut acc = vec![0f64; n];
    let mut ideal = Level::full(p.capacity);
    let (mut admitted, mut ideal_admitted, mut calls) = (0u64, 0u64, 0u64);
    let total_ms = 12 * term_us / 1_000;
    for ms in 0..total_ms {
        let t = ms * 1_000;
        if ms > 0 {
            ideal = ideal.refill(p.capacity, p.rate, 1_000);
        }
        let phase = (t / term_us) as usize;
        for i in 0..n {
            let busy = (i / 4) == phase % 4;
            let rate = if busy { 1.2 * 20_000.0 / 4.0 } else { 0.0 };
            acc[i] += rate / 1_000.0;
            let k = acc[i].floor() as u64;
            acc[i] -= k as f64;
            let now_ns = t * 1_000 + (i as u64 * 7_919) % 1_000_000;
            policy[i].offered(now_ns, k);
            if policy[i].due(now_ns) {
                let demand = policy[i].calling(now_ns);
                seq[i] += 1;
                calls += 1;
                let g = bucket.lease(
                    &p,
                    T0_US + t,
                    AgentId(i as u64 + 1),
                    seq[i],
                    demand,
                    1_000,
                    term_us,
                );
                local[i].grant(&p, &g, now_ns, term_us * 10);
                policy[i].granted(now_ns, &g);
            }
            for _ in 0..k {
                if ideal.tokens >= 1 {
                    ideal = ideal.take(1);
                    ideal_admitted += 1;
                }
                if local[i].try_spend(1, now_ns + rng.next() % 1_000) {
                    admitted += 1;
                }
            }
        }
    }
    let secs = total_ms as f64 / 1_000.0;
    (
        admitted as f64 / ideal_admitted as f64,
        calls as f64 / n as f64 / secs,
    )
}

/// Demand moving to other agents every term is followed within a tenth of a second:
/// utilisation 0.95 or more with 4 s terms, and each agent calls about once a second.
#[test]
fn demand_moving_every_term_is_followed() {
    let (u, calls) = shifting(4_000_000, 5);
    assert!(u >= 0.95, "utilisation {u:.4}");
    assert!(calls <= 1.0, "{calls:.2} calls per agent per second");
    let (u, calls) = shifting(1_000_000, 5);
    assert!(u >= 0.85, "1 s terms: utilisation {u:.4}");
    assert!(
        calls <= 3.0,
        "1 s terms: {calls:.2} calls per agent per second"
    );
}
