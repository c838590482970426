//! Proportional share: how a contended key's rate is divided among the agents leasing
//! it. The arithmetic is in floating point with the same operations as the Lua, so both
//! round alike; it only guides and paces lease sizes.

use super::AgentRecord;
use crate::rule::BucketParams;

/// `r / demand_sum` in millionths, at most one: the proportional share of every agent.
/// An agent alone with demand has the whole bucket. On a region's bucket whose broker
/// said what the region gets (`region_rate_milli`, thousandths of a token per second;
/// 0: not said), that rate stands for r.
pub(super) fn scale_ppm(
    p: &BucketParams,
    region_rate_milli: u64,
    demand_sum: u64,
    demand: u64,
) -> u64 {
    if demand_sum <= demand {
        return 1_000_000;
    }
    let x = if region_rate_milli > 0 {
        region_rate_milli as f64 * 1e6 / demand_sum as f64
    } else {
        let rate_milli_scaled = p.rate.tokens() as f64 * 1e15;
        rate_milli_scaled / (p.rate.period_us() as f64 * demand_sum as f64)
    };
    x.min(1e6).floor() as u64
}

/// A full allowance: the whole capacity, in thousandths (what an agent has while the key
/// is not contended).
pub(super) fn full_credit(p: &BucketParams) -> u64 {
    (p.capacity as f64 * 1000.0) as u64
}

/// Tokens piling up in the bucket past this level (B/8) mean the agents with credit are
/// not taking them: proportional share stops binding until they are taken.
pub(super) fn plenty_level(p: &BucketParams) -> u64 {
    p.capacity.div_ceil(8)
}

/// Proportional share, enforced. While the key is contended (the agents' demand sums
/// to more than r, and not all of it is this agent's), an agent earns the right to
/// lease tokens at `r * share` per second, `share = demand / Σ demand` (1% of the sum
/// for an agent that reports no demand yet, so a newcomer is not starved before its
/// demand is measured; a floor for every agent would hand a fleet of 1 000 small agents
/// ten times the rate, and the large ones would pay for it), and may bank
/// `B * share` of it. Grants spend the credit; an agent out of credit waits its turn
/// while the others lease.
#[derive(Clone, Copy, Debug)]
pub(super) struct Allowance {
    /// Credit, thousandths of a token.
    pub(super) credit: f64,
    /// Credit earned per µs, thousandths of a token.
    per_us: f64,
    cap: f64,
}

impl Allowance {
    /// The allowance of an agent reporting `demand` on a key whose agents report
    /// `demand_sum` in all; `None` while the key is not contended (`scale` is whole).
    pub(super) fn new(
        p: &BucketParams,
        region_rate_milli: u64,
        demand_sum: u64,
        demand: u64,
        scale: u64,
        min: u64,
    ) -> Option<Self> {
        if scale >= 1_000_000 {
            return None;
        }
        let ds = demand_sum as f64;
        let share = if demand > 0 {
            demand as f64
        } else {
            (ds / 100.0).ceil()
        };
        // Thousandths of a token per µs: the rule's rate, or the region's.
        let rate_us = if region_rate_milli > 0 {
            region_rate_milli as f64 / 1e6
        } else {
            p.rate.tokens() as f64 * 1000.0 / p.rate.period_us() as f64
        };
        let per_us = rate_us * share / ds;
        let cap = (min as f64 * 1000.0).max((p.capacity as f64 * 1000.0 * share / ds).floor());
        Some(Self {
            credit: 0.0,
            per_us,
            cap,
        })
    }

    /// Adds what was earned since the agent's last operation to its banked credit.
    pub(super) fn earn(&mut self, prior: Option<&AgentRecord>, now: u64) {
        let (banked, elapsed) = match prior {
            Some(r) => (
                r.credit_milli as f64,
                now.saturating_sub(r.reply.now_us) as f64,
            ),
            None => (self.cap, 0.0),
        };
        self.credit = (banked + (elapsed * self.per_us).floor()).min(self.cap);
    }

    /// Whole tokens the credit covers.
    pub(super) fn tokens(&self) -> u64 {
        (self.credit / 1000.0).floor() as u64
    }

    /// Spends credit for a grant, down to zero (a grant from plenty may exceed it).
    pub(super) fn spend(&mut self, tokens: u64) {
        self.credit = (self.credit - tokens as f64 * 1000.0).max(0.0);
    }

    /// µs until this agent's turn for `min` tokens: until its credit covers them, or,
    /// when it does and the bucket is short of them, the time its share of the refill
    /// takes to bring them (the other agents drain the bucket meanwhile). Telling every
    /// refused agent "when `min` tokens exist" would bring them all back at once, for one
    /// of them to win.
    pub(super) fn wait_us(&self, min: u64) -> u64 {
        let mut need = min as f64 * 1000.0 - self.credit;
        if need <= 0.0 {
            need = min as f64 * 1000.0;
        }
        (need / self.per_us).ceil() as u64
    }
}
