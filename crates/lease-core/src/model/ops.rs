//! The operations, one function each as the Lua has them (`lh_acquire`, `lh_release`,
//! `lh_exact`, `lh_split`), and what every one of them shares: the validation, the
//! opening of the bucket (`open`) and the writing back (`finish`).

use super::share::{Allowance, full_credit, plenty_level, scale_ppm};
use super::split::{MAX_PARTS, Split};
use super::state::{AgentRecord, BucketState};
use super::{DEMAND_TTL_US, MAX_HELD, Op, ProtocolError, Reply, Request};
use crate::bucket::Level;
use crate::rate::MAX_EXACT;
use crate::rule::{BucketParams, Mode};

fn check(what: &'static str, value: u64, max: u64) -> Result<(), ProtocolError> {
    if value > max {
        Err(ProtocolError::InvalidArgument { what, value })
    } else {
        Ok(())
    }
}

/// Tokens a request needs now: at least one, and never more than the bucket can hold.
fn check_amount(what: &'static str, value: u64, capacity: u64) -> Result<(), ProtocolError> {
    if value == 0 {
        return Err(ProtocolError::InvalidArgument { what, value });
    }
    if value > capacity {
        return Err(ProtocolError::CapacityExceeded {
            requested: value,
            capacity,
        });
    }
    Ok(())
}

/// Validates what the Lua validates, in the same order.
pub fn validate(p: &BucketParams, req: &Request) -> Result<(), ProtocolError> {
    check("seq", req.seq, MAX_EXACT)?;
    if let Some(region) = &p.region {
        super::region::validate(p, region)?;
    }
    if let Some(seed) = &p.part {
        if seed.gen_us == 0 {
            // On the wire a zero generation means "not a part".
            return Err(ProtocolError::InvalidArgument {
                what: "part_gen",
                value: 0,
            });
        }
        check("part_gen", seed.gen_us, MAX_EXACT)?;
        check("part_until", seed.until_us, MAX_EXACT)?;
        check("part_tokens", seed.tokens, MAX_EXACT)?;
        check("part_outstanding", seed.outstanding, MAX_HELD)?;
        check("part_drop", seed.drop_us, MAX_EXACT)?;
    }
    match req.op {
        Op::Acquire {
            held,
            want,
            min,
            demand,
        } => {
            check("held", held, MAX_HELD)?;
            check("demand", demand, MAX_HELD)?;
            check_amount("min", min, p.capacity)?;
            if want < min || want > p.capacity {
                return Err(ProtocolError::InvalidArgument {
                    what: "want",
                    value: want,
                });
            }
        }
        Op::Rate {
            held,
            want,
            tokens,
            demand,
        } => {
            validate_rate(p)?;
            check("held", held, p.capacity)?;
            check("tokens", tokens, held)?;
            check("demand", demand, MAX_HELD)?;
            if want > p.capacity {
                return Err(ProtocolError::InvalidArgument {
                    what: "want",
                    value: want,
                });
            }
        }
        Op::Release { returned } => check("returned", returned, MAX_HELD)?,
        // Cost 0 is a read: the level, nothing taken.
        Op::Exact { cost: 0 } => {}
        Op::Exact { cost } => check_amount("cost", cost, p.capacity)?,
        Op::Deposit {
            tokens,
            until_us,
            rate_milli,
        } => {
            if p.region.is_none() {
                return Err(ProtocolError::InvalidArgument {
                    what: "region",
                    value: 0,
                });
            }
            check("tokens", tokens, MAX_HELD)?;
            check("until", until_us, MAX_EXACT)?;
            check("rate_milli", rate_milli, MAX_HELD)?;
        }
        Op::Split {
            parts,
            salt,
            until_us,
        } => {
            if !(2..=MAX_PARTS).contains(&parts)
                || parts > p.capacity
                || p.part.is_some()
                || p.region.is_some()
            {
                return Err(ProtocolError::InvalidArgument {
                    what: "parts",
                    value: parts,
                });
            }
            check("salt", salt, MAX_EXACT)?;
            check("until", until_us, MAX_EXACT)?;
        }
    }
    Ok(())
}

/// Whether a bucket may be leased by rate: strict mode (its bursts count as outstanding), not
/// a region's bucket or a split's part, and its refill at part of its rate exact
/// (a share scale of 10^3 at least: [`super::rate_scale`]).
pub(super) fn validate_rate(p: &BucketParams) -> Result<(), ProtocolError> {
    let refuse = |what, value| Err(ProtocolError::InvalidArgument { what, value });
    if let Mode::Relaxed { max_outstanding } = p.mode {
        return refuse("max_outstanding", max_outstanding.get());
    }
    if p.region.is_some() {
        return refuse("region", 1);
    }
    if let Some(seed) = &p.part {
        return refuse("part_gen", seed.gen_us);
    }
    if super::rate_scale(p) == 0 {
        return refuse("capacity", p.capacity);
    }
    Ok(())
}

/// One call on a bucket past the replay check, the state advanced to `now` (what the
/// Lua's `open` returns).
pub(super) struct Call {
    /// The bucket's state.
    pub(super) s: BucketState,
    /// The call creates the key: it never existed, expired, or was lost.
    pub(super) created: bool,
    /// Server time, never behind the bucket's last (I5).
    pub(super) now: u64,
    /// The caller's record as the call found it.
    pub(super) prior: Option<AgentRecord>,
}

/// What opening a bucket for a call gives.
#[expect(
    clippy::large_enum_variant,
    reason = "returned once per call and matched at once; boxing would allocate per call"
)]
pub(super) enum Opened {
    /// Go on with the operation.
    Call(Call),
    /// A retry gets its first reply, a late duplicate an error; the state is unchanged
    /// (I2).
    Replay(Result<Reply, ProtocolError>),
}

impl Call {
    /// Loads the bucket (absent or expired: full), checks the caller's sequence number
    /// (I2), starts a part from its seed and refills to `now` (Lua: `begin`, `seed_part`,
    /// `advance`). A replay leaves `state` as it was.
    pub(super) fn open(
        state: &mut Option<BucketState>,
        p: &BucketParams,
        server_now_us: u64,
        req: &Request,
    ) -> Opened {
        if state
            .as_ref()
            .is_some_and(|s| server_now_us / 1000 > s.expire_at_ms)
        {
            *state = None;
        }
        // A deposit has no record: its sequence is checked against the bucket's.
        if let Some(s) = state.as_ref()
            && !matches!(req.op, Op::Deposit { .. })
            && let Some(r) = s.live(req.agent, server_now_us.max(s.updated_us))
            && req.seq <= r.seq
        {
            return Opened::Replay(if req.seq == r.seq {
                Ok(Reply {
                    burst: r.burst(),
                    ..r.reply
                })
            } else {
                Err(ProtocolError::StaleSequence {
                    seq: req.seq,
                    last: r.seq,
                })
            });
        }
        let created = state.is_none();
        let s = state
            .take()
            .unwrap_or_else(|| BucketState::fresh(p, server_now_us));
        let now = server_now_us.max(s.updated_us);
        let (mut s, reseeded) = s.seed_part(p, now);
        s.advance(p, now);
        let prior = s.agents.get(&req.agent).cloned();
        Opened::Call(Self {
            s,
            created: created && !reseeded,
            now,
            prior,
        })
    }

    fn prior_held(&self) -> u64 {
        self.prior.as_ref().map_or(0, |r| r.held)
    }

    fn prior_demand(&self) -> u64 {
        self.prior.as_ref().map_or(0, |r| r.demand)
    }

    /// The credit an operation that grants nothing leaves the agent: what it had, or full.
    fn kept_credit(&self, p: &BucketParams) -> u64 {
        self.prior
            .as_ref()
            .map_or_else(|| full_credit(p), |r| r.credit_milli)
    }

    /// The record after an operation that leaves the agent's holding, demand and credit
    /// as they were (exact, split): it lives at least until the grace after `now`.
    fn kept(&self, p: &BucketParams) -> AgentRecord {
        let grace_end = self.now + p.grace_us;
        AgentRecord {
            held: self.prior_held(),
            drop_us: self.prior.as_ref().map_or(0, |r| r.drop_us).max(grace_end),
            seq: 0,
            reply: Reply::default(),
            demand: self.prior_demand(),
            credit_milli: self.kept_credit(p),
            share: self.prior_share(),
        }
    }

    fn prior_share(&self) -> u64 {
        self.prior.as_ref().map_or(0, |r| r.share)
    }

    fn reply(&self) -> Reply {
        Reply {
            now_us: self.now,
            moved: self.s.moved(self.now),
            ..Reply::default()
        }
    }

    /// Stores the agent's record with its reply (a deposit leaves none), and sets the key
    /// to expire only once every record is dropped, the split's or the region's term is
    /// over, and the bucket would be back to what an absent key holds (I6).
    pub(super) fn finish(
        self,
        p: &BucketParams,
        req: &Request,
        record: Option<AgentRecord>,
        mut reply: Reply,
    ) -> (BucketState, Reply) {
        let Self { mut s, now, .. } = self;
        s.compact = false;
        reply.split = s.split;
        // A deposit's says what it carries.
        if !matches!(req.op, Op::Deposit { .. }) {
            reply.remaining = s.level.tokens;
        }
        if let Some(record) = record {
            reply.burst = record.burst();
            let record = AgentRecord {
                seq: req.seq,
                reply,
                ..record
            };
            let x = record.drop_us;
            s.next_drop_us = if s.next_drop_us == 0 {
                x
            } else {
                s.next_drop_us.min(x)
            };
            s.last_drop_us = s.last_drop_us.max(x);
            if record.demand > 0 && record.share == 0 {
                let stale = now + DEMAND_TTL_US;
                s.next_stale_us = if s.next_stale_us == 0 {
                    stale
                } else {
                    s.next_stale_us.min(stale)
                };
            }
            s.agents.insert(req.agent, record);
        }
        // A deposit leaves no record; the key stays a grace after it as after any call.
        let busy_until = s
            .last_drop_us
            .max(s.split.map_or(0, |sp| sp.until_us))
            .max(s.term_until_us)
            .max(if matches!(req.op, Op::Deposit { .. }) {
                now + p.grace_us
            } else {
                0
            });
        let life = busy_until.saturating_sub(now) + s.time_to_rest(p);
        s.expire_at_ms = (now + life) / 1000 + 1;
        (s, reply)
    }
}

/// `lh_acquire`: the agent declares what it holds and asks for `want` tokens, `min` at
/// least, within its proportional share while the key is contended.
pub(super) fn acquire(
    c: &mut Call,
    p: &BucketParams,
    held: u64,
    want: u64,
    min: u64,
    demand: u64,
) -> (AgentRecord, Reply) {
    let now = c.now;
    let moved = c.s.moved(now);
    let ttl_us = c.s.lease_ttl(p, now);
    let (prior_held, prior_demand) = (c.prior_held(), c.prior_demand());
    let s = &mut c.s;
    // An agent holding tokens from, or measuring demand on, a bucket that no longer
    // exists: the bucket was lost (evicted, flushed, a replica promoted without it). It
    // restarts empty, not full: what it handed out may all be spent. (A bucket expires
    // only once every lease in it has, I6, and full; an agent declares nothing past its
    // lease's deadline, and reports demand only on a key it has used, which an idle
    // agent withdraws.)
    if c.created && (held > 0 || demand > 0) {
        s.level = Level::default();
    }
    // State-based report: the agent's own count replaces ours. Declaring more than we
    // knew (after a failover lost a grant) lowers the tokens instead.
    s.outstanding = s.outstanding - prior_held + held;
    s.demand_sum = s.demand_sum - prior_demand + demand;
    s.clamp(p);
    let tok = s.level.tokens;
    let rr = s.region_rate_milli;
    let scale = scale_ppm(p, rr, s.demand_sum, demand);
    let mut share = Allowance::new(p, rr, s.demand_sum, demand, scale, min);
    if let Some(a) = &mut share {
        a.earn(c.prior.as_ref(), now);
    }
    let avail = match p.mode {
        _ if moved || ttl_us == 0 => 0,
        Mode::Strict => tok,
        Mode::Relaxed { max_outstanding } => {
            tok.min(max_outstanding.get().saturating_sub(s.outstanding))
        }
    };
    // Work conserving: past the plenty level anyone may take tokens.
    let plenty = tok >= plenty_level(p);
    let avail = match &share {
        Some(a) if !plenty => avail.min(a.tokens()),
        _ => avail,
    };
    let g = if want.min(avail) >= min {
        want.min(avail)
    } else {
        0
    };
    s.level = s.level.take(g);
    s.outstanding += g;
    if let Some(a) = &mut share {
        a.spend(g);
    }
    let mut reply = c.reply();
    let s = &c.s;
    reply.retry_us = if g > 0 {
        0
    } else if moved {
        1
    } else if ttl_us == 0 && p.region.is_some() {
        // The term ends within the grace: the next deposit renews it.
        super::region::REGION_WAIT_US
    } else if ttl_us == 0 {
        let until = s.part.map_or(0, |t| t.until_us);
        until.saturating_sub(now).max(1)
    } else {
        let relaxed = matches!(p.mode, Mode::Relaxed { .. });
        let blocked = if relaxed && tok >= min {
            s.next_drop_us.saturating_sub(now)
        } else {
            0
        };
        // An agent's turn comes when its share has earned `min` (see `wait_us`), or when
        // tokens pile up to plenty, whichever is first.
        let plenty_in = s.wait_for(p, plenty_level(p));
        let turn = share.as_ref().map_or(0, |a| a.wait_us(min).min(plenty_in));
        s.wait_for(p, min).max(blocked).max(turn).max(1)
    };
    reply.granted = g;
    reply.ttl_us = ttl_us;
    reply.scale_ppm = scale;
    let record = AgentRecord {
        held: held + g,
        drop_us: now + ttl_us + p.grace_us,
        seq: 0,
        reply: Reply::default(),
        demand,
        credit_milli: share.map_or_else(|| full_credit(p), |a| a.credit as u64),
        // A rate lease's share counts on until this record drops.
        share: c.prior_share(),
    };
    (record, reply)
}

/// Headroom over an agent's demand in its rate lease's share while the demands are at
/// most 0.8 r: a quarter more (as a multiplier, the same operation in the Lua).
pub(crate) const RATE_HEADROOM: f64 = 1.25;

/// The part of the rate the demands' parts may fill with their headroom (the rest is left
/// for the noise in measured demand).
pub(crate) const RATE_ROOM: f64 = 0.95;

/// The shortest term of a rate lease, µs.
pub(crate) const RATE_MIN_TERM_US: u64 = 400_000;

/// The term a rate lease gets per live share, µs; twice that for a steady renewal.
pub(crate) const RATE_TERM_PER_SHARE_US: u64 = 4_000;

/// The term of a rate lease while `shares` shares of the key are live (this one
/// included): the rule's `term` at most, and no longer than the key needs for its agents'
/// renewals (each at three quarters of its term) to stay within about 330 a second — 4 s
/// for 1 000 agents, 0.4 s (the least) for 100 or fewer. A share granted on a demand that
/// has since moved to other agents is renewed, and given back, that much sooner. A
/// steady renewal ([`steady`]) gets twice as long: its share was right and stays right,
/// and a fleet in steady state calls about half as often (143 a second at 1 000 agents,
/// each renewing a second before its 8 s term ends).
pub(crate) fn rate_term_us(p: &BucketParams, shares: u64, steady: bool) -> u64 {
    let per_share = RATE_TERM_PER_SHARE_US << u32::from(steady);
    p.lease_ttl_us
        .min(RATE_MIN_TERM_US.max(shares.saturating_mul(per_share)))
}

/// Whether a renewal is steady (see [`rate_term_us`]): it had a share, reports a demand
/// within a quarter of the last one, and gets a share in the same proportion to it as
/// before, within an eighth (a share cut, or swollen, by other demands in passing — the
/// demands of a fleet whose load moved, counted until their agents renew — is renewed at
/// the plain term). Floating point, the same operations as the Lua, so both round alike.
fn steady(prior_share: u64, share: u64, prior_demand: u64, demand: u64) -> bool {
    if prior_share == 0 || prior_demand == 0 || demand.abs_diff(prior_demand) > prior_demand / 4 {
        return false;
    }
    let was = prior_share as f64 * demand as f64;
    let is = share as f64 * prior_demand as f64;
    (is - was).abs() * 8.0 <= was
}

/// A rate lease: the agent declares its burst (`held`), asks for `want`, and gets a share of
/// the rate sized by its demand — its demand with headroom, less of it as the live demands near
/// the rate, its proportional part under contention — never more than the other shares
/// leave, and its burst topped up from the level (see [`crate::rate_lease`] for the bound).
pub(super) fn rate(
    c: &mut Call,
    p: &BucketParams,
    held: u64,
    want: u64,
    tokens: u64,
    demand: u64,
) -> (AgentRecord, Reply) {
    let now = c.now;
    let moved = c.s.moved(now);
    let (prior_held, prior_demand, prior_share) =
        (c.prior_held(), c.prior_demand(), c.prior_share());
    // While its record lives, the burst counted is at most the record's: a call whose
    // reply was lost may have shrunk it (below), and the agent, which never saw that,
    // declares the old one. Its bucket has refilled nothing since (no reply), so it holds
    // less than the shrunk burst still.
    let (held, tokens) = if c.prior.is_some() {
        let held = held.min(prior_held);
        (held, tokens.min(held))
    } else {
        (held, tokens)
    };
    let s = &mut c.s;
    // A lost bucket restarts empty, as for an acquire (an agent's first call reports
    // demand, but no burst).
    if c.created && held > 0 {
        s.level = Level::default();
    }
    s.outstanding = s.outstanding - prior_held + held;
    s.demand_sum = s.demand_sum - prior_demand + demand;
    s.remove_share(prior_share);
    s.clamp(p);
    let (n, per, scale) = (p.rate.tokens(), p.rate.period_us(), super::rate_scale(p));
    let whole = n * scale;
    // Its part: the demand with headroom, or its proportional part of the rate if less,
    // so the parts of the demands as they stand never sum over the rate. (A fixed quarter
    // up to r asked for 1.2 r in all at 0.95 r: the agents renewing last got what the
    // others left, less than their demand.)
    // Floating point, the same operations as the Lua, so both round alike.
    let part = if demand == 0 || moved {
        0.0
    } else {
        let d = demand as f64 * per as f64 * scale as f64 / 1e9;
        // The headroom shrinks as the demands near the rate, so their parts leave a
        // twentieth of it for the noise in what each agent measures; never below the
        // demand itself (under contention the proportional part rules).
        let sum = s.demand_sum as f64 * per as f64 * scale as f64 / 1e9;
        let headroom = (RATE_ROOM * whole as f64 / sum).clamp(1.0, RATE_HEADROOM);
        (d * headroom).min(whole as f64 * demand as f64 / s.demand_sum as f64)
    };
    let part = part.floor() as u64;
    let mut share = part.min(whole.saturating_sub(s.shared));
    // The burst's fair part of B: its demand's part of the demands, one token at least
    // (floating point, as the Lua). A burst above it shrinks to it at this call, and grows
    // no further: bursts that filled B before other agents came were kept for ever, and
    // those agents got no burst, so no share (8 agents flat out, 5 of them holding B
    // between them: 5/8 of the rate admitted). It never shrinks below the tokens the
    // agent may still hold — the whole ones it declared, and a fraction — since its
    // bucket refills nothing while the call is out ([`LocalRate::renewing`]): what is
    // outstanding still counts all it can spend.
    //
    // [`LocalRate::renewing`]: crate::rate_lease::LocalRate::renewing
    let fair = if s.demand_sum == 0 {
        p.capacity
    } else {
        ((p.capacity as f64 * demand as f64 / s.demand_sum as f64).floor() as u64).max(1)
    };
    let cap = fair.max(tokens + 1);
    let held = if held > cap {
        s.outstanding -= held - cap;
        cap
    } else {
        held
    };
    // The burst grows towards `want` while the bursts leave room under B; the room it
    // gains starts empty (the level's cap falls by it), so the tokens that exist stay
    // within B. A share needs a burst of one token at least to be spent.
    let grow = if moved || share == 0 {
        0
    } else {
        (want.saturating_sub(held))
            .min(p.capacity.saturating_sub(s.outstanding))
            .min(cap.saturating_sub(held))
    };
    s.outstanding += grow;
    let burst = held + grow;
    if burst == 0 {
        share = 0;
    }
    // Tokens from the level fill the burst's empty room; what the level then holds above
    // B less the bursts is void.
    let paid = if moved {
        0
    } else {
        (burst - tokens).min(s.level.tokens)
    };
    s.level = s.level.take(paid);
    s.clamp(p);
    s.add_share(p, share);
    // Limited: less than seven eighths of its part (a shortfall worth another call).
    let limited = share < part - part / 8;
    let steady = !limited && steady(prior_share, share, prior_demand, demand);
    let term = rate_term_us(p, s.share_records, steady);
    let mut reply = c.reply();
    reply.granted = paid;
    reply.ttl_us = term;
    reply.scale_ppm = share;
    reply.retry_us = u64::from(limited);
    let record = AgentRecord {
        held: burst,
        drop_us: now + term + p.grace_us,
        seq: 0,
        reply: Reply::default(),
        demand,
        credit_milli: c.kept_credit(p),
        share,
    };
    (record, reply)
}

/// `lh_release`: the agent gives back unspent tokens and holds nothing afterwards.
pub(super) fn release(c: &mut Call, p: &BucketParams, returned: u64) -> (AgentRecord, Reply) {
    // Credit no more than we know the agent held: returns cannot mint tokens.
    let prior_held = c.prior_held();
    let credit = returned.min(prior_held);
    let s = &mut c.s;
    s.outstanding -= prior_held;
    s.demand_sum -= c.prior.as_ref().map_or(0, |r| r.demand);
    // A rate lease's share is given up with it.
    s.remove_share(c.prior.as_ref().map_or(0, |r| r.share));
    s.level.tokens += credit;
    s.clamp(p);
    let mut reply = c.reply();
    reply.granted = credit;
    let record = AgentRecord {
        held: 0,
        drop_us: c.now + p.grace_us,
        seq: 0,
        reply: Reply::default(),
        demand: 0,
        credit_milli: c.kept_credit(p),
        share: 0,
    };
    (record, reply)
}

/// `lh_exact`: one decision of `cost` tokens, taken from the bucket or refused.
pub(super) fn exact(c: &mut Call, p: &BucketParams, cost: u64) -> (AgentRecord, Reply) {
    let mut reply = c.reply();
    let own = c.prior_demand();
    let s = &mut c.s;
    if reply.moved {
        reply.retry_us = 1;
    } else if s.level.tokens >= cost {
        s.level = s.level.take(cost);
        reply.granted = cost;
    } else {
        reply.retry_us = s.wait_for(p, cost);
    }
    // Other agents lease this key: say so (their proportional scale, at least 1), so an
    // agent that sees it cold starts leasing at once.
    if s.demand_sum > own {
        reply.scale_ppm = scale_ppm(p, s.region_rate_milli, s.demand_sum, 0).max(1);
    }
    (c.kept(p), reply)
}

/// `lh_split`: starts a split of the bucket into `parts` until `until_us`, or extends the
/// one in force (the coordinator's operation).
pub(super) fn split(
    c: &mut Call,
    p: &BucketParams,
    parts: u64,
    salt: u64,
    until_us: u64,
) -> (AgentRecord, Reply) {
    let reply = c.reply();
    let now = c.now;
    let s = &mut c.s;
    match &mut s.split {
        // A bucket leased by rate is not split: its agents call once a term.
        None if until_us > now && s.share_records == 0 => {
            // Start: the parent's tokens go to the parts, its refill stops.
            let gen_us = now.max(s.last_split_us + 1);
            s.split = Some(Split {
                parts,
                salt,
                gen_us,
                until_us,
                tokens: s.level.tokens,
                outstanding: s.outstanding,
                drop_us: s.last_drop_us,
            });
            s.last_split_us = gen_us;
            s.level = Level::default();
        }
        Some(sp) if sp.parts == parts && sp.salt == salt => {
            sp.until_us = sp.until_us.max(until_us);
        }
        _ => {}
    }
    (c.kept(p), reply)
}

/// `lh_deposit`: the broker puts `tokens` its region was granted by the global bucket into
/// the region's bucket, good until `until_us` (this store's server time), once per `seq`.
/// See [`super::region`] for the reply.
pub(super) fn deposit(
    c: &mut Call,
    p: &BucketParams,
    seq: u64,
    tokens: u64,
    until_us: u64,
    rate_milli: u64,
) -> Reply {
    let now = c.now;
    let mut reply = c.reply();
    let s = &mut c.s;
    if seq > s.deposit_seq {
        s.deposit_seq = seq;
        s.region_rate_milli = rate_milli;
        if until_us > now {
            if !s.in_term() {
                // Tokens the floor made are not the global bucket's; the held the broker
                // reported counted them, which only over-counts.
                s.level = Level::default();
            }
            s.term_until_us = s.term_until_us.max(until_us);
            let before = s.level.tokens;
            s.level.tokens += tokens;
            s.clamp(p);
            reply.granted = s.level.tokens.saturating_sub(before);
        }
    }
    reply.remaining = s.level.tokens + s.outstanding;
    // A deposit refuses nothing: the retry field carries the bucket's own tokens.
    reply.retry_us = s.level.tokens;
    reply.ttl_us = s.term_until_us.saturating_sub(now);
    reply.scale_ppm = s.demand_sum;
    reply
}
