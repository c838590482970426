//! Rate leases: an agent is granted a share of a bucket's *rate*, and a burst, for a term,
//! and spends them locally (a GCRA per key); it calls the store once a term whatever its
//! demand, instead of once per batch of tokens. This is the model both sides follow (the
//! function library's twin comes with the agent's use of it).
//!
//! **The bound.** The bucket refills at `r × (1 − S)`, where `S` is the sum of the live
//! leases' shares (parts per million of `r`, so `S ≤ 1` holds exactly), up to `B − Σ b_i`,
//! the live leases' bursts counting as outstanding (as a strict bucket counts leased
//! tokens: I1). A grant's burst is taken from the level; the agent's local bucket holds at
//! most its burst and refills at its share. So the tokens that exist — the level plus every
//! local bucket — never exceed `B`, and flow in at `r` at most (`r(1 − S)` to the level,
//! `q_i` to each local bucket): in any window `W` at most `B + r·W` are admitted, by the
//! rate leases and by everything else the level serves (exact decisions, token leases)
//! together. A share counts in `S` until its record's expiry, which
//! the agent's own deadline precedes (as I4: the deadline is measured from the moment the
//! request was sent, minus a margin); a share given up early is released at once, its
//! burst is not given back (the agent may have spent it). The agent spends its share a
//! little slower than granted ([`RATE_MARGIN_PPM`]) so that its clock running fast by as
//! much cannot make it spend more than `q_i` by the store's clock.
//!
//! A local bucket holds at most its burst, so a share comes with a burst of one token at
//! least: when the level is empty, a bucket of capacity 1 that starts empty and fills
//! from the share (the level's cap falls by it). The live bursts never exceed `B`: at most
//! `B` agents hold a share of one key at once.
//!
//! **Shares.** Every record keeps the agent's demand. A grant is the agent's demand with
//! headroom while the live demands fit in `r`; under contention, the agent's proportional
//! part of `r`; never more than what the other live shares leave. An agent whose demand
//! grows gets its part within one term: every other agent renews within a term, to its
//! own part of the new total.

use std::collections::BTreeMap;

use crate::model::AgentId;
use crate::rule::BucketParams;

/// Parts per million: shares are counted in these, of the bucket's rate.
pub const PPM: u64 = 1_000_000;

/// The rate an agent spends below its share, parts per million: covers its clock running
/// faster than the store's by up to this much.
pub const RATE_MARGIN_PPM: u64 = 1_000;

/// Headroom over an agent's measured demand, when the bucket is not contended (percent).
const HEADROOM_PERCENT: u64 = 25;

/// What the store grants for a term.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateGrant {
    /// The agent's share of the bucket's rate, parts per million.
    pub share_ppm: u64,
    /// Tokens the agent's local bucket may hold: what it may spend at once.
    pub burst: u64,
    /// Tokens of it this grant took from the level, which the agent adds to its local
    /// bucket (the rest fills from its share).
    pub paid: u64,
    /// The term, µs from the store's time of the grant.
    pub ttl_us: u64,
    /// The share is less than the agent's part because other agents' shares still hold
    /// the rest: asking again soon gets more, as they renew to their parts.
    pub limited: bool,
}

#[derive(Clone, Debug)]
struct Record {
    share_ppm: u64,
    burst: u64,
    /// Demand, thousandths of a token per second.
    demand_milli: u64,
    expires_us: u64,
    seq: u64,
    reply: RateGrant,
}

/// The bucket's side of rate leases: its level (exact: in units of
/// `1 / (period_us × PPM)` tokens), the committed shares and each agent's record.
#[derive(Clone, Debug)]
pub struct RateBucket {
    units: i128,
    ts_us: u64,
    committed_ppm: u64,
    /// The live leases' bursts: the level refills to `B` minus these.
    bursts: u64,
    records: BTreeMap<AgentId, Record>,
}

impl RateBucket {
    /// A full bucket at `now_us`.
    pub fn new(p: &BucketParams, now_us: u64) -> Self {
        Self {
            units: i128::from(p.capacity) * denominator(p),
            ts_us: now_us,
            committed_ppm: 0,
            bursts: 0,
            records: BTreeMap::new(),
        }
    }

    /// Whole tokens in the level.
    pub fn level(&self, p: &BucketParams) -> u64 {
        u64::try_from(self.units / denominator(p)).unwrap_or(0)
    }

    /// The sum of the live shares, parts per million.
    pub fn committed_ppm(&self) -> u64 {
        self.committed_ppm
    }

    /// Refills to `now_us` at the rate the live shares leave, dropping each record as its
    /// expiry passes (the refill before it at the shares then in force).
    fn advance(&mut self, p: &BucketParams, now_us: u64) {
        let now = now_us.max(self.ts_us);
        loop {
            let next = self
                .records
                .values()
                .filter(|r| r.expires_us <= now)
                .map(|r| r.expires_us)
                .min();
            let until = next.unwrap_or(now).max(self.ts_us);
            self.refill(p, until);
            let Some(at) = next else { break };
            let gone: Vec<AgentId> = (self.records.iter())
                .filter(|(_, r)| r.expires_us <= at)
                .map(|(id, _)| *id)
                .collect();
            for id in gone {
                self.drop_record(id);
            }
        }
    }

    fn drop_record(&mut self, id: AgentId) {
        if let Some(r) = self.records.remove(&id) {
            self.committed_ppm -= r.share_ppm;
            self.bursts -= r.burst;
        }
    }

    fn refill(&mut self, p: &BucketParams, until_us: u64) {
        let dt = i128::from(until_us - self.ts_us);
        let free = i128::from(PPM - self.committed_ppm);
        // Below 0 while the live bursts exceed B (bursts granted on credit).
        let cap = (i128::from(p.capacity) - i128::from(self.bursts)) * denominator(p);
        let refilled = self.units + i128::from(p.rate.tokens()) * free * dt;
        // A level above the cap (bursts granted from it) only falls to it.
        self.units = if self.units >= cap {
            self.units
        } else {
            refilled.min(cap)
        };
        self.ts_us = until_us;
    }

    /// Takes `cost` tokens from the level (an exact decision beside the rate leases).
    pub fn take(&mut self, p: &BucketParams, now_us: u64, cost: u64) -> bool {
        self.advance(p, now_us);
        let need = i128::from(cost) * denominator(p);
        if self.units < need {
            return false;
        }
        self.units -= need;
        true
    }

    /// A rate lease for `agent` (new, or a renewal), request `seq`: its measured demand
    /// (thousandths of a token per second), the burst it wants and the term. A retry of the
    /// last `seq` replays its grant and changes nothing (I2).
    #[allow(clippy::too_many_arguments)] // one call per term, all of it needed
    pub fn lease(
        &mut self,
        p: &BucketParams,
        now_us: u64,
        agent: AgentId,
        seq: u64,
        demand_milli: u64,
        want_burst: u64,
        term_us: u64,
    ) -> RateGrant {
        self.advance(p, now_us);
        let now = now_us.max(self.ts_us);
        if let Some(r) = self.records.get(&agent)
            && r.seq == seq
        {
            // A replay: what is left of the term, so the agent's deadline, measured from
            // this retry, still falls before the record's expiry.
            return RateGrant {
                ttl_us: r.expires_us.saturating_sub(now),
                ..r.reply
            };
        }
        let own = self.records.get(&agent);
        let (own_ppm, own_burst) = own.map_or((0, 0), |r| (r.share_ppm, r.burst));
        let others_demand: u64 = (self.records.iter())
            .filter(|(id, _)| **id != agent)
            .map(|(_, r)| r.demand_milli)
            .sum();
        let rate_milli =
            u128::from(p.rate.tokens()) * 1_000_000_000 / u128::from(p.rate.period_us().max(1));
        let total = u128::from(others_demand) + u128::from(demand_milli);
        let wanted = u128::from(demand_milli) * u128::from(100 + HEADROOM_PERCENT) / 100;
        let ppm_of =
            |milli: u128| (milli * u128::from(PPM) / rate_milli.max(1)).min(u128::from(PPM));
        let share = if total <= rate_milli {
            ppm_of(wanted)
        } else {
            // Contended: the agent's proportional part of the rate.
            u128::from(demand_milli) * u128::from(PPM) / total.max(1)
        } as u64;
        let available = PPM - (self.committed_ppm - own_ppm);
        let share_ppm = share.min(available);
        let limited = share_ppm < share;
        // The burst: what it holds stays; more comes out of the level if it is there. A
        // share needs a local bucket of one token at least to be spent at all: with the
        // level empty, one of capacity 1 that starts empty and fills from the share, while
        // the live bursts leave room under B (the level's cap falls by it).
        let want_burst = want_burst.min(p.capacity);
        let paid = want_burst.saturating_sub(own_burst).min(self.level(p));
        self.units -= i128::from(paid) * denominator(p);
        let mut burst = own_burst + paid;
        if burst == 0 && share_ppm > 0 && want_burst > 0 && self.bursts < p.capacity {
            burst = 1;
            let cap = (i128::from(p.capacity) - i128::from(self.bursts + 1)) * denominator(p);
            self.units = self.units.min(cap);
        }
        let reply = RateGrant {
            share_ppm,
            burst,
            paid,
            ttl_us: term_us,
            limited,
        };
        self.committed_ppm = self.committed_ppm - own_ppm + share_ppm;
        self.bursts = self.bursts - own_burst + burst;
        self.records.insert(
            agent,
            Record {
                share_ppm,
                burst,
                demand_milli,
                expires_us: now + term_us,
                seq,
                reply,
            },
        );
        reply
    }

    /// `agent` gives its lease up (it went idle, and stopped spending it before asking):
    /// its share and its burst count no more from now.
    pub fn release(&mut self, p: &BucketParams, now_us: u64, agent: AgentId) {
        self.advance(p, now_us);
        self.drop_record(agent);
    }
}

/// Units of the level per token: the refill adds `tokens × free_ppm × dt_us` of them.
fn denominator(p: &BucketParams) -> i128 {
    i128::from(p.rate.period_us().max(1)) * i128::from(PPM)
}

/// An agent's side: a local bucket of its burst, refilled at its share (a little below:
/// [`RATE_MARGIN_PPM`]), spent until its deadline (agent clock, ns). Exact: the level is
/// counted in `1 / (period_us × 1000 × PPM)` tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalRate {
    units: u128,
    at_ns: u64,
    /// Units a nanosecond brings.
    per_ns: u128,
    /// Units a token is.
    unit: u128,
    burst: u64,
    deadline_ns: u64,
}

impl LocalRate {
    /// Installs `g`, the reply to a request sent at `sent_ns` (agent clock), for a bucket
    /// of rate `p.rate`; `margin_ns` is taken off the term. What the local bucket holds
    /// carries over a renewal, plus what the store took from the level for it.
    pub fn grant(&mut self, p: &BucketParams, g: &RateGrant, sent_ns: u64, margin_ns: u64) {
        let now = sent_ns.max(self.at_ns);
        self.settle(now);
        let unit = u128::from(p.rate.period_us().max(1)) * 1_000 * u128::from(PPM);
        let effective =
            u128::from(g.share_ppm) * u128::from(PPM - RATE_MARGIN_PPM) / u128::from(PPM);
        self.unit = unit;
        self.per_ns = u128::from(p.rate.tokens()) * effective;
        self.units = (self.units + u128::from(g.paid) * unit).min(u128::from(g.burst) * unit);
        self.burst = g.burst;
        self.deadline_ns = sent_ns + (g.ttl_us * 1_000).saturating_sub(margin_ns);
    }

    /// Stops spending (before giving the lease up, or when the store refused it).
    pub fn stop(&mut self) {
        self.deadline_ns = 0;
    }

    fn settle(&mut self, now_ns: u64) {
        if now_ns > self.at_ns {
            let dt = u128::from(now_ns - self.at_ns);
            self.units = (self.units + self.per_ns * dt).min(u128::from(self.burst) * self.unit);
            self.at_ns = now_ns;
        }
    }

    /// Spends `cost` at `now_ns` if the grant covers it.
    pub fn try_spend(&mut self, cost: u64, now_ns: u64) -> bool {
        if now_ns >= self.deadline_ns {
            return false;
        }
        self.settle(now_ns);
        let need = u128::from(cost) * self.unit;
        if self.units < need {
            return false;
        }
        self.units -= need;
        true
    }
}

/// How long an agent measures its demand over, and the least time between two of its
/// calls for a key (ns).
pub const DEMAND_WINDOW_NS: u64 = 100_000_000;

/// The slots of the demand window.
const SLOTS: usize = 10;

/// An agent's renewal policy for one key: it measures the demand it is offered (over the
/// last [`DEMAND_WINDOW_NS`]) and calls the store when the term is three quarters over, or
/// sooner — a window after its last call at the earliest — when its demand doubled or
/// halved since the demand it last reported, or its last grant was limited by other
/// agents' shares (which they give up as they renew). Its calls follow changes of demand,
/// not its volume.
#[derive(Clone, Debug, Default)]
pub struct RatePolicy {
    /// Tokens offered per slot of the window, and the slot of each (agent ns / slot).
    slots: [(u64, u64); SLOTS],
    reported_milli: u64,
    limited: bool,
    last_call_ns: u64,
    renew_at_ns: u64,
}

impl RatePolicy {
    /// `tokens` offered at `now_ns` (admitted or not).
    pub fn offered(&mut self, now_ns: u64, tokens: u64) {
        let slot = now_ns / (DEMAND_WINDOW_NS / SLOTS as u64);
        let cell = &mut self.slots[(slot % SLOTS as u64) as usize];
        if cell.1 != slot {
            *cell = (0, slot);
        }
        cell.0 += tokens;
    }

    /// The demand offered over the last window, thousandths of a token per second.
    pub fn demand_milli(&self, now_ns: u64) -> u64 {
        let slot = now_ns / (DEMAND_WINDOW_NS / SLOTS as u64);
        let tokens: u64 = (self.slots.iter())
            .filter(|(_, s)| slot.saturating_sub(*s) < SLOTS as u64)
            .map(|(n, _)| n)
            .sum();
        tokens.saturating_mul(1_000_000_000_000) / DEMAND_WINDOW_NS
    }

    /// Whether to call the store at `now_ns`.
    pub fn due(&self, now_ns: u64) -> bool {
        if now_ns >= self.renew_at_ns {
            return true;
        }
        if now_ns.saturating_sub(self.last_call_ns) < DEMAND_WINDOW_NS {
            return false;
        }
        let d = self.demand_milli(now_ns);
        self.limited || d > 2 * self.reported_milli.max(1) || d * 2 < self.reported_milli
    }

    /// A call sent at `now_ns` reports this demand.
    pub fn calling(&mut self, now_ns: u64) -> u64 {
        self.last_call_ns = now_ns;
        self.reported_milli = self.demand_milli(now_ns);
        self.reported_milli
    }

    /// The reply to the call sent at `sent_ns` came.
    pub fn granted(&mut self, sent_ns: u64, g: &RateGrant) {
        self.limited = g.limited;
        self.renew_at_ns = sent_ns + g.ttl_us * 750;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_policy_calls_at_three_quarters_of_the_term_or_when_demand_changes() {
        let mut p = RatePolicy::default();
        // 10 tokens a slot of 10 ms: 1 000 tokens/s.
        for slot in 0..10 {
            p.offered(1_000 * MS + slot * 10 * MS, 10);
        }
        assert_eq!(p.demand_milli(1_095 * MS), 1_000_000);
        assert!(p.due(1_095 * MS), "never called");
        assert_eq!(p.calling(1_095 * MS), 1_000_000);
        let g = RateGrant {
            share_ppm: 50_000,
            burst: 10,
            paid: 10,
            ttl_us: 4_000_000,
            limited: false,
        };
        p.granted(1_095 * MS, &g);
        // Steady: not before three quarters of the term.
        for at in (1_100..4_095).step_by(10) {
            p.offered(at * MS, 10);
            assert!(!p.due(at * MS), "at {at} ms");
        }
        assert!(p.due(4_095 * MS));
        // Demand doubling: due, but not within a window of the last call.
        p.calling(4_095 * MS);
        p.granted(4_095 * MS, &g);
        for at in (4_100..4_200).step_by(10) {
            p.offered(at * MS, 25);
        }
        assert!(!p.due(4_190 * MS), "a window since the last call");
        assert!(p.due(4_200 * MS), "2 500/s against 1 000 reported");
        // A limited grant: asked again after a window.
        p.calling(4_200 * MS);
        p.granted(4_200 * MS, &RateGrant { limited: true, ..g });
        for at in (4_210..4_300).step_by(10) {
            p.offered(at * MS, 25);
        }
        assert!(!p.due(4_290 * MS));
        assert!(p.due(4_300 * MS));
    }
}
