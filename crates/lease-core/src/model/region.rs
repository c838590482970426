//! Regions: one global bucket, carved into the budgets of regions that keep serving
//! through a partition (the third level of the hierarchy; `docs/regions.md` has the whole
//! design and its argument).
//!
//! A rule of global scope has its bucket in the home store, as today. Each region has its
//! own store, where its agents lease and decide as today, but from the **region's
//! bucket** of the key (`BucketKey::region_of`), which never refills at the rule's rate.
//! The region's broker (its coordinator) is an agent of the global bucket: it acquires
//! tokens with the region's demand and declares what the region still holds, exactly as
//! an agent does, so the global bucket's proportional share and I1-I8 divide the budget
//! between regions as they divide it between agents. It then **deposits** the grant into
//! the region's bucket, good until the end of a term:
//!
//! - I1 across regions. Every token admitted anywhere was granted once by the global
//!   bucket (deposits add only grants; refill adds nothing during a term), so the tokens
//!   admitted worldwide in a window W are at most `B + r*W`, as for one bucket, as long
//!   as a region stops spending a grant before the global bucket stops counting it.
//! - The term (I4 one level up). The global record of the region drops at the global
//!   server time `now_g + ttl + grace`, which is after the broker's send time `t0` plus
//!   `ttl` in real time. The broker knows the region's server time `R` from a reply it
//!   received at `a1` on its own clock, so `R` was read no later than `a1`, and the
//!   region's clock passes `R + (t0 + ttl - a1)` no later than real time `t0 + ttl`
//!   (less a margin for the clocks' rates). That is the deposit's `until`. No two clocks
//!   are assumed to agree: only the broker's clock and each store's own, each compared
//!   with itself.
//! - At `until` the region's bucket voids what is left, its agents' leases having ended by
//!   then (a lease from a region's bucket ends with its term). Each renewal extends the
//!   term for everything the region holds, because the acquire declares all of it.
//! - `held` is the region's bucket's `tokens + outstanding` from its last reply: an upper
//!   bound of what the region can still spend (agents only spend; a deposit is confirmed
//!   before the next acquire), so the global bucket never under-counts a region.
//! - Partition: the region spends what it holds until its term ends, then its floor (a
//!   rate from empty, so it admits at most `floor * duration`); nothing else moves, and
//!   the other regions get the partitioned region's share back once its record drops.
//!
//! A deposit is idempotent by the grant's time on the global bucket (`seq`; a retried
//! acquire replays the same reply, and so the same deposit), which only grows per key.

use super::{AgentId, MAX_HELD, Op, ProtocolError, Reply, Request};
use crate::rule::{BucketParams, MAX_BUCKET_UNITS, RegionParams};

/// What a region's bucket tells a denial to wait when only a deposit can help: about a
/// broker's renewal (µs).
pub const REGION_WAIT_US: u64 = 10_000;

pub(super) fn validate(p: &BucketParams, region: &RegionParams) -> Result<(), ProtocolError> {
    if p.part.is_some() {
        return Err(ProtocolError::InvalidArgument {
            what: "part_gen",
            value: p.part.map_or(0, |s| s.gen_us),
        });
    }
    let fits = match region.floor {
        None => region.floor_burst == 0,
        Some(f) => {
            region.floor_burst >= 1
                && u128::from(region.floor_burst) * u128::from(f.period_us())
                    + u128::from(f.tokens())
                    <= u128::from(MAX_BUCKET_UNITS)
        }
    };
    if !fits {
        return Err(ProtocolError::InvalidArgument {
            what: "floor_burst",
            value: region.floor_burst,
        });
    }
    Ok(())
}

/// A region's bucket as a deposit's reply tells it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionState {
    /// Tokens the deposit added (0 for a read, a repeat, or a term already over).
    pub deposited: u64,
    /// What the region may still spend: the bucket's tokens plus what its agents hold.
    pub held: u64,
    /// The bucket's own tokens (what its agents may still lease).
    pub tokens: u64,
    /// The sum of its agents' demand, thousandths of a token per second.
    pub demand_milli: u64,
    /// The term left, µs (0: over).
    pub term_left_us: u64,
    /// The region's server time.
    pub now_us: u64,
}

impl RegionState {
    /// The reply of [`Op::Deposit`], read as what it carries.
    pub fn from_reply(r: &Reply) -> Self {
        Self {
            deposited: r.granted,
            held: r.remaining,
            tokens: r.retry_us,
            demand_milli: r.scale_ppm,
            term_left_us: r.ttl_us,
            now_us: r.now_us,
        }
    }
}

/// How a broker runs its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BrokerConfig {
    /// How often a key is renewed, µs.
    pub refresh_us: u64,
    /// How much faster than the broker's clock a store's clock may run, in millionths
    /// (taken off each term, with [`BrokerConfig::margin_us`]).
    pub drift_ppm: u64,
    /// Taken off each term besides the drift, µs.
    pub margin_us: u64,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            refresh_us: 100_000,
            drift_ppm: 1_000,
            margin_us: 1_000,
        }
    }
}

/// What a broker sends for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerCall {
    /// To the region's bucket ([`Op::Deposit`]; `seq` 0 reads).
    Region(Request),
    /// To the global bucket ([`Op::Acquire`]).
    Global(Request),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting until `due` (the broker's clock) to read the region's bucket, then acquire.
    Idle { due: u64 },
    /// A read of the region's bucket, sent or to send: each acquire declares what the
    /// region holds as of a read just before it, so the declaration is an upper bound
    /// that is stale by no more than the read's own round trip.
    Reading,
    /// The region's bucket was just read: acquire now.
    Read,
    /// An acquire sent first at `sent`, not answered.
    Acquiring { req: Request, sent: u64 },
    /// A deposit not answered; resent until it is (it is idempotent).
    Depositing { req: Request },
}

/// The broker's policy for one key of a global rule in its region: acquire from the
/// global bucket, deposit into the region's, one call at a time (sans-io: times are the
/// broker's monotonic clock, µs).
#[derive(Clone, Debug)]
pub struct KeyBroker {
    agent: AgentId,
    seq: u64,
    phase: Phase,
    /// The region's server time and when (broker clock) its reply arrived.
    sample: Option<(u64, u64)>,
    /// The region's held and demand, from its last reply, and its bucket's own tokens.
    held: u64,
    tokens: u64,
    demand_milli: u64,
    /// Consumption measured between reads, thousandths of a token per second.
    spent_milli: u64,
    /// When the region's bucket was last read (broker clock; 0: never), and what it held
    /// then plus what deposits added since.
    last_read_at: u64,
    counted: u64,
    /// The last acquire's round trip, µs.
    rtt_us: u64,
    /// When the last acquire was first sent (broker clock).
    last_acquire: u64,
    /// The region spent about everything it had between its last two replies.
    starved: bool,
    /// An acquire was sent.
    acquired: bool,
    in_flight: bool,
    last_busy: u64,
}

impl KeyBroker {
    /// A broker for one key, acting at the global bucket as `agent` (random per process),
    /// its sequence numbers starting after `first_seq`: a key brokered again by the same
    /// process must start above what it sent before (the broker's clock in µs does).
    pub fn new(agent: AgentId, first_seq: u64) -> Self {
        Self {
            agent,
            seq: first_seq,
            phase: Phase::Reading,
            sample: None,
            held: 0,
            tokens: 0,
            demand_milli: 0,
            spent_milli: 0,
            last_read_at: 0,
            counted: 0,
            rtt_us: 0,
            last_acquire: 0,
            starved: false,
            acquired: false,
            in_flight: false,
            last_busy: 0,
        }
    }

    /// What the region holds by its last reply.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// The demand the broker reports for its region, thousandths of a token per second.
    pub fn demand_milli(&self) -> u64 {
        self.demand_milli.max(self.spent_milli)
    }

    /// Whether the key has had no demand and held nothing since `since` (broker clock):
    /// its broker may be dropped.
    /// A key whose call fails (a global store out of reach) is never idle: its region
    /// still needs it once the link is back.
    pub fn idle_since(&self, since: u64) -> bool {
        self.last_busy < since && !self.in_flight && matches!(self.phase, Phase::Idle { .. })
    }

    /// The call to send now, if any. `global` are the rule's parameters at the global
    /// bucket (the term is its lease TTL); at most one call is in flight.
    pub fn poll(
        &mut self,
        now: u64,
        cfg: &BrokerConfig,
        global: &BucketParams,
    ) -> Option<BrokerCall> {
        if self.in_flight {
            return None;
        }
        let call = match self.phase {
            Phase::Reading => BrokerCall::Region(Request {
                agent: self.agent,
                seq: 0,
                op: Op::Deposit {
                    tokens: 0,
                    until_us: 0,
                    rate_milli: 0,
                },
            }),
            Phase::Idle { due } if now >= due => {
                self.phase = Phase::Reading;
                return self.poll(now, cfg, global);
            }
            Phase::Read => {
                self.seq += 1;
                // Enough for the next renewals and a round trip at the region's rate; a
                // region that ran dry asks for twice what it could spend (its agents'
                // demand is averaged over a second, and lags when demand moves to it).
                let horizon = 2 * cfg.refresh_us + self.rtt_us;
                let mut rate = self.demand_milli();
                if self.starved {
                    rate = rate.max(self.spent_milli.saturating_mul(2));
                }
                // A key new to the region: nothing measured yet, and its agents are
                // refused until this grant arrives. Ask for the rule's rate over the
                // horizon (a round trip of a token at a time would cost a renewal).
                if !self.acquired && rate == 0 {
                    rate = global.rate.milli_per_sec();
                }
                let need = u128::from(rate) * u128::from(horizon) / 1_000_000_000;
                // What the bucket itself holds, not what its agents hold: their leases are
                // being spent, and the region's other agents need tokens in the bucket.
                let want = u64::try_from(need)
                    .unwrap_or(u64::MAX)
                    .saturating_sub(self.tokens)
                    .clamp(1, global.capacity);
                // The first acquire reports no demand, as an agent's does: a bucket that
                // does not exist and is told of demand takes itself for lost and starts
                // empty, and a new key's bucket must start full.
                let demand = if self.acquired {
                    self.demand_milli().min(MAX_HELD)
                } else {
                    0
                };
                self.acquired = true;
                let req = Request {
                    agent: self.agent,
                    seq: self.seq,
                    op: Op::Acquire {
                        held: self.held.min(MAX_HELD),
                        want,
                        min: 1,
                        demand,
                    },
                };
                self.last_acquire = now;
                self.phase = Phase::Acquiring { req, sent: now };
                BrokerCall::Global(req)
            }
            Phase::Idle { .. } => return None,
            Phase::Acquiring { req, sent } => {
                // A resend: the same request, replayed by the bucket if it was applied. Past
                // the term it asked for, a grant could no longer be served: give it up.
                if now >= sent + global.lease_ttl_us {
                    self.phase = Phase::Idle { due: now };
                    return self.poll(now, cfg, global);
                }
                BrokerCall::Global(req)
            }
            Phase::Depositing { req } => BrokerCall::Region(req),
        };
        self.in_flight = true;
        Some(call)
    }

    /// The region's bucket answered the read or the deposit.
    pub fn on_region_reply(&mut self, now: u64, cfg: &BrokerConfig, reply: &Reply) {
        self.in_flight = false;
        let r = RegionState::from_reply(reply);
        self.sample = Some((r.now_us, now));
        self.held = r.held;
        self.tokens = r.tokens;
        self.demand_milli = r.demand_milli;
        if self.held > 0 || self.demand_milli() > 0 {
            self.last_busy = now;
        }
        if self.phase != Phase::Reading {
            // A deposit: the next read counts what it added.
            self.counted += r.deposited;
            self.phase = Phase::Idle {
                due: self.last_acquire + cfg.refresh_us,
            };
            return;
        }
        // Spent since the last read: what it held then, plus what deposits added since,
        // less what it holds now.
        if self.last_read_at > 0 && now > self.last_read_at {
            let spent = self.counted.saturating_sub(r.held);
            let rate = u128::from(spent) * 1_000_000_000 / u128::from(now - self.last_read_at);
            let rate = u64::try_from(rate).unwrap_or(u64::MAX);
            self.spent_milli = (self.spent_milli + rate) / 2;
            // Dry: what is left would not last another such interval.
            self.starved = spent > 0 && r.held <= spent;
        }
        self.counted = r.held;
        self.last_read_at = now.max(1);
        self.phase = Phase::Read;
    }

    /// The global bucket answered the acquire: the deposit to make.
    /// `global` are the rule's parameters at the global bucket.
    pub fn on_global_reply(
        &mut self,
        now: u64,
        cfg: &BrokerConfig,
        global: &BucketParams,
        reply: &Reply,
    ) {
        self.in_flight = false;
        let Phase::Acquiring { sent, req } = self.phase else {
            return;
        };
        // What the region gets: its demand times the share the global bucket granted it
        // (at most the rule's rate), for its agents to divide.
        let demand = match req.op {
            Op::Acquire { demand, .. } => demand,
            _ => 0,
        };
        let share = u128::from(demand) * u128::from(reply.scale_ppm) / 1_000_000;
        let rate_milli = u64::try_from(share.min(u128::from(global.rate.milli_per_sec())))
            .unwrap_or(u64::MAX)
            .min(MAX_HELD);
        self.rtt_us = now.saturating_sub(sent);
        let until = match self.sample {
            Some((region_now, at)) => {
                let ttl = reply.ttl_us;
                let margin = ttl.saturating_mul(cfg.drift_ppm) / 1_000_000 + cfg.margin_us;
                (region_now + sent + ttl).saturating_sub(at + margin)
            }
            None => 0,
        };
        let req = Request {
            agent: self.agent,
            seq: reply.now_us,
            op: Op::Deposit {
                tokens: reply.granted,
                until_us: until,
                rate_milli,
            },
        };
        self.phase = Phase::Depositing { req };
    }

    /// The call in flight failed or timed out: it is sent again by the next poll.
    pub fn on_failure(&mut self) {
        self.in_flight = false;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests fail by panicking

    use super::*;
    use crate::rule::{Rule, RuleSpec};

    fn global() -> BucketParams {
        let mut spec = RuleSpec::new(20_000, "20000/s");
        spec.leasing = Some("lease".into());
        Rule::from_spec("global", &spec).unwrap().bucket_params()
    }

    /// A region's reply: it holds `held`, `tokens` of them in the bucket itself.
    fn region(held: u64, tokens: u64, demand_milli: u64, deposited: u64) -> Reply {
        Reply {
            granted: deposited,
            remaining: held,
            retry_us: tokens,
            scale_ppm: demand_milli,
            now_us: 5_000_000_000,
            ttl_us: 1_000_000,
            ..Reply::default()
        }
    }

    fn acquire(call: Option<BrokerCall>) -> (u64, u64, u64) {
        match call {
            Some(BrokerCall::Global(Request {
                op: Op::Acquire {
                    held, want, demand, ..
                },
                ..
            })) => (held, want, demand),
            other => panic!("expected an acquire, got {other:?}"),
        }
    }

    fn is_read(call: Option<BrokerCall>) -> bool {
        matches!(call, Some(BrokerCall::Region(Request { seq: 0, .. })))
    }

    #[test]
    fn a_new_key_asks_for_the_rules_rate_over_the_horizon_at_once() {
        let (cfg, g) = (BrokerConfig::default(), global());
        let mut b = KeyBroker::new(AgentId(7), 0);
        assert!(is_read(b.poll(1_000, &cfg, &g)));
        b.on_region_reply(1_500, &cfg, &region(0, 0, 0, 0));
        let (held, want, demand) = acquire(b.poll(1_500, &cfg, &g));
        // Nothing measured yet: 20 000/s over two renewals (no round trip measured yet),
        // and no demand declared (a bucket told of demand at birth starts empty).
        assert_eq!((held, want, demand), (0, 4_000, 0));
    }

    #[test]
    fn each_acquire_declares_what_a_read_just_before_it_saw() {
        let (cfg, g) = (BrokerConfig::default(), global());
        let mut b = KeyBroker::new(AgentId(7), 0);
        assert!(is_read(b.poll(1_000, &cfg, &g)));
        b.on_region_reply(1_000, &cfg, &region(0, 0, 0, 0));
        acquire(b.poll(1_000, &cfg, &g));
        let grant = Reply {
            granted: 4_000,
            ttl_us: 2_000_000,
            now_us: 9,
            scale_ppm: 1_000_000,
            ..Reply::default()
        };
        b.on_global_reply(81_000, &cfg, &g, &grant);
        assert!(matches!(
            b.poll(81_000, &cfg, &g),
            Some(BrokerCall::Region(Request { seq: 9, .. }))
        ));
        // The deposit's reply: the region holds 4 000.
        b.on_region_reply(82_000, &cfg, &region(4_000, 4_000, 5_000_000, 4_000));
        assert_eq!(b.poll(90_000, &cfg, &g), None, "not due before the refresh");
        // Due: the region is read again first, and the acquire declares that read's
        // holding (1 000 left after 3 000 spent), not the deposit's 4 000.
        assert!(is_read(b.poll(101_000, &cfg, &g)));
        b.on_region_reply(101_500, &cfg, &region(1_000, 1_000, 5_000_000, 0));
        let (held, _, demand) = acquire(b.poll(101_500, &cfg, &g));
        assert_eq!(held, 1_000);
        // Spent between the two reads: 3 000 in 100.5 ms, 29 851/s, averaged with the
        // nothing measured before: 14 925/s, more than the agents' 5 000/s, so reported.
        assert_eq!(demand, 14_925_373);
    }
}
