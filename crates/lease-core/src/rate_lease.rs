//! Rate leases: an agent is granted a share of a bucket's *rate*, and a burst, for a term,
//! and spends them locally (a token bucket per key); it calls the store once a term, or
//! when its demand changes, whatever its volume, instead of once per batch of tokens.
//! The store's side is [`crate::model`]'s `Op::Rate` (the Lua's twin); this module is the
//! agent's: its local bucket ([`LocalRate`]) and when it calls ([`RatePolicy`]).
//!
//! **The bound (I1 for rate leases).** The bucket refills at `r − S`, `S` the sum of the
//! live leases' shares (thousandths of a token per rate period, so `S ≤ r` holds
//! exactly), up to `B` minus what is outstanding, each lease's burst counting as
//! outstanding (as leased tokens do). A burst grows only by tokens taken from the level;
//! the agent's local bucket holds at most its burst and refills at its share. So the tokens
//! that exist — the level plus every local bucket — never exceed `B`, and flow in at `r`
//! at most (`r − S` to the level, `q_i` to each local bucket): in any window `W` at most
//! `B + r·W` are admitted, by the rate leases and by everything else the level serves
//! (exact decisions, token leases) together. A share counts in `S` until its record drops
//! (the term and a grace after the grant), which the agent's own deadline precedes (as
//! I4: measured from the moment the request was sent, less a margin); a share given up
//! early (a release) is dropped at once, what the local bucket held coming back. The agent
//! spends its share a little slower than granted ([`RATE_MARGIN_PPM`]) so that its clock
//! running fast by as much cannot make it spend more than `q_i` by the store's clock.
//!
//! A local bucket holds at most its burst, so a share comes with a burst of one token at
//! least: when the level is empty, a bucket of capacity 1 that starts empty and fills from
//! the share (the level's cap falls by it). The bursts never exceed `B`: at most `B`
//! agents hold a share of one key at once.
//!
//! **Shares.** Every record keeps the agent's demand (a rate lease's counts until its
//! record drops). A grant is the agent's demand with a quarter of headroom while the live
//! demands fit in `r`; under contention, the agent's proportional part of `r`; never more
//! than the other live shares leave (the reply says so, and the agent asks again a window
//! later). An agent whose demand grows gets its part within one term: every other agent
//! renews within a term, to its own part of the new total.

use crate::model::Reply;
use crate::rule::BucketParams;

/// Parts per million.
pub const PPM: u64 = 1_000_000;

/// The rate an agent spends below its share, parts per million: covers its clock running
/// faster than the store's by up to this much.
pub const RATE_MARGIN_PPM: u64 = 1_000;

/// What the store granted for a term: the reply to `Op::Rate`, read as what it carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateGrant {
    /// The agent's share of the bucket's rate, thousandths of a token per rate period.
    pub share: u64,
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

impl RateGrant {
    /// The grant a reply to a rate lease carries, for a request that declared `held`.
    pub fn of(reply: &Reply, held: u64) -> Self {
        let share = if reply.moved { 0 } else { reply.scale_ppm };
        let paid = reply.granted;
        Self {
            share,
            burst: if held + paid == 0 && share > 0 {
                1
            } else {
                held + paid
            },
            paid,
            ttl_us: reply.ttl_us,
            limited: reply.retry_us != 0,
        }
    }
}

/// An agent's side: a local bucket of its burst, refilled at its share (a little below:
/// [`RATE_MARGIN_PPM`]), spent until its deadline (agent clock, ns). Exact: the level is
/// counted in `1 / (period_us × 10^6 × PPM)` tokens.
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
    /// The share refills the bucket: not while a call is in flight (the store may be
    /// lowering it), nor past the deadline.
    accrue: bool,
}

impl LocalRate {
    /// Before a call at `now_ns` that asks for a burst of `want`: the burst to declare
    /// (`held`). A burst larger than `want` shrinks to it (what it held above is dropped).
    /// Until the reply, the share refills nothing: the store may lower it as it receives
    /// the call, and the agent learns the new one only with the reply.
    pub fn renewing(&mut self, now_ns: u64, want: u64) -> u64 {
        self.settle(now_ns);
        self.accrue = false;
        self.burst = self.burst.min(want);
        self.units = self.units.min(u128::from(self.burst) * self.unit);
        self.burst
    }

    /// Installs `g`, the reply (received at `now_ns`, agent clock) to a request sent at
    /// `sent_ns`, for a bucket of rate `p.rate`: the share refills from now, the term runs
    /// from `sent_ns`, less `margin_ns`. What the local bucket holds carries over a
    /// renewal, plus what the store took from the level for it.
    pub fn grant(
        &mut self,
        p: &BucketParams,
        g: &RateGrant,
        sent_ns: u64,
        now_ns: u64,
        margin_ns: u64,
    ) {
        self.settle(now_ns);
        self.accrue = true;
        let unit = u128::from(p.rate.period_us().max(1)) * 1_000_000 * u128::from(PPM);
        // Rescaled when the rule's rate changed: what is held stays in tokens.
        if self.unit != 0 && self.unit != unit {
            self.units = self.units / self.unit * unit;
        }
        self.unit = unit;
        self.per_ns = u128::from(g.share) * u128::from(PPM - RATE_MARGIN_PPM);
        self.units = (self.units + u128::from(g.paid) * unit).min(u128::from(g.burst) * unit);
        self.burst = g.burst;
        self.deadline_ns = sent_ns + (g.ttl_us * 1_000).saturating_sub(margin_ns);
    }

    /// Stops spending (before giving the lease up, or when the store refused it); returns
    /// the whole tokens it held, which a release gives back.
    pub fn stop(&mut self, now_ns: u64) -> u64 {
        self.settle(now_ns);
        self.deadline_ns = 0;
        let whole = self.units.checked_div(self.unit).unwrap_or(0);
        self.units = 0;
        self.burst = 0;
        u64::try_from(whole).unwrap_or(u64::MAX)
    }

    /// Whether the grant still runs at `now_ns`.
    pub fn running(&self, now_ns: u64) -> bool {
        now_ns < self.deadline_ns
    }

    /// The burst: the local bucket's capacity.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    fn settle(&mut self, now_ns: u64) {
        if now_ns <= self.at_ns {
            return;
        }
        let until = now_ns.min(self.deadline_ns);
        if self.accrue && until > self.at_ns {
            let dt = u128::from(until - self.at_ns);
            self.units = (self.units + self.per_ns * dt).min(u128::from(self.burst) * self.unit);
        }
        self.at_ns = now_ns;
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
            share: 1_000_000,
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
