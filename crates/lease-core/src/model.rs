//! The reference model of one global bucket: the oracle that `lua/leasehold.lua` must
//! match reply for reply and field for field.
//!
//! The state is what the Redis hash holds: the level (`tok`, `car`), the refill period the
//! carry is counted in (`p`), the last server time (`ts`), the tokens leased and not yet
//! reported (`out`), the earliest and latest moments an agent record may be dropped
//! (`nexp`, `mx`), and per agent its held tokens, drop time, last sequence number, last
//! reply and demand. Every operation is a pure function of this state, the rule's
//! parameters and the server time:
//!
//! 1. Expired key: the state is gone, the bucket is full (I6 makes that equivalent).
//! 2. `now = max(server time, ts)`: a clock stepping back creates nothing (I5).
//! 3. The agent's live record with the same `seq` replays its reply and changes nothing;
//!    an older `seq` is refused (I2).
//! 4. Refill up to `now`, dropping agent records whose drop time passed in time order, so
//!    the refill between two drops uses the cap in force then. In strict mode refill stops
//!    at `B - out` (I1).
//! 5. The operation, then the key's expiry: not before every record is dropped and the
//!    bucket would be full again (I6).

use std::collections::BTreeMap;
use std::fmt;

use crate::bucket::Level;
use crate::rate::MAX_EXACT;
use crate::rule::BucketParams;

/// The largest `held` or `returned` an agent may declare (2^40): a sum over thousands of
/// agents stays exact in Lua.
pub const MAX_HELD: u64 = 1 << 40;

/// An agent instance: random per process start, so a restarted agent never replays the
/// sequence numbers of its previous life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId(pub u64);

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One operation on a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Declare `held` (what the agent holds as it sends this) and ask for `want` tokens,
    /// taking none unless at least `min` are available.
    Acquire {
        /// Tokens the agent holds, by its own count, when it sent the request.
        held: u64,
        /// Tokens wanted.
        want: u64,
        /// The least grant accepted.
        min: u64,
        /// The agent's recent demand for this bucket, thousandths of a token per second.
        demand: u64,
    },
    /// Give back unspent tokens; the agent holds nothing afterwards.
    Release {
        /// Tokens returned.
        returned: u64,
    },
    /// Take `cost` tokens for one decision (the per-request path for cold keys).
    Exact {
        /// Tokens the decision costs.
        cost: u64,
    },
}

/// An operation from one agent, with its idempotency key `(agent, seq)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Who sends it.
    pub agent: AgentId,
    /// Strictly increasing per (agent, bucket); a retry reuses it.
    pub seq: u64,
    /// What is asked.
    pub op: Op,
}

/// The answer to a [`Request`], identical for a replayed retry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Tokens granted (acquire), credited back (release) or taken (exact; 0 = denied).
    pub granted: u64,
    /// Lease lifetime from the moment the agent sent the acquire, µs (0 otherwise).
    pub ttl_us: u64,
    /// Whole tokens left in the bucket.
    pub remaining: u64,
    /// When nothing was granted: µs until the tokens asked for could exist (never 0).
    pub retry_us: u64,
    /// The server time the operation used, µs.
    pub now_us: u64,
}

impl Reply {
    /// The stored form: `granted,ttl,remaining,retry,now`.
    pub fn encode(&self) -> String {
        format!(
            "{},{},{},{},{}",
            self.granted, self.ttl_us, self.remaining, self.retry_us, self.now_us
        )
    }
}

/// A request the bucket refuses; nothing is changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A cost or minimum grant larger than the capacity can never be satisfied.
    #[error("{requested} tokens requested, but the bucket holds at most {capacity}")]
    CapacityExceeded {
        /// Tokens asked for.
        requested: u64,
        /// Capacity B.
        capacity: u64,
    },
    /// A sequence number older than the last one seen from this agent: a late duplicate.
    #[error("sequence {seq} is older than the last one seen ({last})")]
    StaleSequence {
        /// The request's sequence number.
        seq: u64,
        /// The last one seen.
        last: u64,
    },
    /// An argument out of its range.
    #[error("invalid argument {what} = {value}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: u64,
    },
}

/// What the store remembers of one agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentRecord {
    /// Tokens the agent may hold (an upper bound of its real count).
    pub held: u64,
    /// Server time after which the record no longer counts and is dropped.
    pub drop_us: u64,
    /// Last sequence number processed.
    pub seq: u64,
    /// Its reply, replayed to a retry.
    pub reply: Reply,
    /// Last reported demand, thousandths of a token per second.
    pub demand: u64,
}

/// The state of a bucket key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketState {
    /// Tokens in the bucket.
    pub level: Level,
    /// The period the carry is counted in.
    pub period_us: u64,
    /// Last server time used.
    pub updated_us: u64,
    /// Sum of the agents' `held`.
    pub outstanding: u64,
    /// A time at or before the earliest record drop (0: no records).
    pub next_drop_us: u64,
    /// A time at or after the latest record drop (0: no records yet).
    pub last_drop_us: u64,
    /// Agent records.
    pub agents: BTreeMap<AgentId, AgentRecord>,
    /// Redis key expiry, ms (PEXPIREAT).
    pub expire_at_ms: u64,
}

/// What a bucket would hold at some time, without anything being sent to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Tokens.
    pub level: Level,
    /// Outstanding tokens.
    pub outstanding: u64,
    /// Agent records still counting.
    pub agents: usize,
}

/// The model of one bucket key; absent state is a full bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GlobalBucket {
    state: Option<BucketState>,
}

fn cap(p: &BucketParams, outstanding: u64) -> u64 {
    if p.max_outstanding == 0 {
        p.capacity.saturating_sub(outstanding)
    } else {
        p.capacity
    }
}

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
    match req.op {
        Op::Acquire {
            held,
            want,
            min,
            demand,
        } => {
            check("held", held, MAX_HELD)?;
            check("demand", demand, MAX_EXACT)?;
            check_amount("min", min, p.capacity)?;
            if want < min || want > p.capacity {
                return Err(ProtocolError::InvalidArgument {
                    what: "want",
                    value: want,
                });
            }
        }
        Op::Release { returned } => check("returned", returned, MAX_HELD)?,
        Op::Exact { cost } => check_amount("cost", cost, p.capacity)?,
    }
    Ok(())
}

impl BucketState {
    fn fresh(p: &BucketParams, now_us: u64) -> Self {
        Self {
            level: Level::full(p.capacity),
            period_us: p.rate.period_us(),
            updated_us: now_us,
            outstanding: 0,
            next_drop_us: 0,
            last_drop_us: 0,
            agents: BTreeMap::new(),
            expire_at_ms: 0,
        }
    }

    fn refill_to(&mut self, p: &BucketParams, t: u64) {
        let dt = t.saturating_sub(self.updated_us);
        self.level = self.level.refill(cap(p, self.outstanding), p.rate, dt);
        self.updated_us = self.updated_us.max(t);
    }

    fn clamp(&mut self, p: &BucketParams) {
        self.level = self.level.refill(cap(p, self.outstanding), p.rate, 0);
    }

    /// Refill to `now`, dropping expired records at their drop times on the way.
    fn advance(&mut self, p: &BucketParams, now: u64) {
        if self.period_us != p.rate.period_us() {
            self.level.carry = 0;
            self.period_us = p.rate.period_us();
        }
        if self.next_drop_us != 0 && now >= self.next_drop_us {
            let mut expired: Vec<(u64, AgentId)> = self
                .agents
                .iter()
                .filter(|(_, r)| r.drop_us <= now)
                .map(|(id, r)| (r.drop_us, *id))
                .collect();
            expired.sort();
            for (at, id) in expired {
                self.refill_to(p, at);
                if let Some(r) = self.agents.remove(&id) {
                    self.outstanding -= r.held;
                }
            }
            self.next_drop_us = self.agents.values().map(|r| r.drop_us).min().unwrap_or(0);
            self.last_drop_us = self.agents.values().map(|r| r.drop_us).max().unwrap_or(0);
        }
        self.refill_to(p, now);
    }

    fn live(&self, agent: AgentId, now: u64) -> Option<&AgentRecord> {
        self.agents.get(&agent).filter(|r| r.drop_us > now)
    }
}

impl GlobalBucket {
    /// An absent key.
    pub fn new() -> Self {
        Self::default()
    }

    /// The state, if the key exists.
    pub fn state(&self) -> Option<&BucketState> {
        self.state.as_ref()
    }

    /// Applies `req` at server time `server_now_us`, as one atomic script call would.
    pub fn apply(
        &mut self,
        p: &BucketParams,
        server_now_us: u64,
        req: &Request,
    ) -> Result<Reply, ProtocolError> {
        validate(p, req)?;
        if self
            .state
            .as_ref()
            .is_some_and(|s| server_now_us / 1000 > s.expire_at_ms)
        {
            self.state = None;
        }
        let mut s = match &self.state {
            Some(s) => s.clone(),
            None => BucketState::fresh(p, server_now_us),
        };
        let now = server_now_us.max(s.updated_us);
        if let Some(r) = s.live(req.agent, now) {
            if req.seq == r.seq {
                return Ok(r.reply);
            }
            if req.seq < r.seq {
                return Err(ProtocolError::StaleSequence {
                    seq: req.seq,
                    last: r.seq,
                });
            }
        }
        s.advance(p, now);
        let prior = s.agents.get(&req.agent).cloned();
        let prior_held = prior.as_ref().map_or(0, |r| r.held);
        let reply;
        let record;
        match req.op {
            Op::Acquire {
                held,
                want,
                min,
                demand,
            } => {
                // State-based report: the agent's own count replaces ours. Declaring more
                // than we knew (after a failover lost a grant) lowers the tokens instead.
                s.outstanding = s.outstanding - prior_held + held;
                s.clamp(p);
                let tok = s.level.tokens;
                let avail = if p.max_outstanding == 0 {
                    tok
                } else {
                    tok.min(p.max_outstanding.saturating_sub(s.outstanding))
                };
                let g = if want.min(avail) >= min {
                    want.min(avail)
                } else {
                    0
                };
                s.level = s.level.take(g);
                s.outstanding += g;
                let retry_us = if g > 0 {
                    0
                } else {
                    let blocked = if p.max_outstanding != 0 && tok >= min {
                        s.next_drop_us.saturating_sub(now)
                    } else {
                        0
                    };
                    s.level.time_until(min, p.rate).max(blocked).max(1)
                };
                reply = Reply {
                    granted: g,
                    ttl_us: p.lease_ttl_us,
                    remaining: s.level.tokens,
                    retry_us,
                    now_us: now,
                };
                record = AgentRecord {
                    held: held + g,
                    drop_us: now + p.lease_ttl_us + p.grace_us,
                    seq: req.seq,
                    reply,
                    demand,
                };
            }
            Op::Release { returned } => {
                // Credit no more than we know the agent held: returns cannot mint tokens.
                let credit = returned.min(prior_held);
                s.outstanding -= prior_held;
                s.level.tokens += credit;
                s.clamp(p);
                reply = Reply {
                    granted: credit,
                    ttl_us: 0,
                    remaining: s.level.tokens,
                    retry_us: 0,
                    now_us: now,
                };
                record = AgentRecord {
                    held: 0,
                    drop_us: now + p.grace_us,
                    seq: req.seq,
                    reply,
                    demand: 0,
                };
            }
            Op::Exact { cost } => {
                let (granted, retry_us) = if s.level.tokens >= cost {
                    s.level = s.level.take(cost);
                    (cost, 0)
                } else {
                    (0, s.level.time_until(cost, p.rate))
                };
                reply = Reply {
                    granted,
                    ttl_us: 0,
                    remaining: s.level.tokens,
                    retry_us,
                    now_us: now,
                };
                record = AgentRecord {
                    held: prior_held,
                    drop_us: prior
                        .as_ref()
                        .map_or(0, |r| r.drop_us)
                        .max(now + p.grace_us),
                    seq: req.seq,
                    reply,
                    demand: prior.as_ref().map_or(0, |r| r.demand),
                };
            }
        }
        let x = record.drop_us;
        s.next_drop_us = if s.next_drop_us == 0 {
            x
        } else {
            s.next_drop_us.min(x)
        };
        s.last_drop_us = s.last_drop_us.max(x);
        s.agents.insert(req.agent, record);
        let life = s.last_drop_us.saturating_sub(now) + s.level.time_until(p.capacity, p.rate);
        s.expire_at_ms = (now + life) / 1000 + 1;
        self.state = Some(s);
        Ok(reply)
    }

    /// What the bucket would hold at server time `server_now_us` if nothing were sent to
    /// it before: the same evaluation as [`GlobalBucket::apply`] without an operation.
    pub fn view_at(&self, p: &BucketParams, server_now_us: u64) -> View {
        match &self.state {
            Some(s) if server_now_us / 1000 <= s.expire_at_ms => {
                let mut s = s.clone();
                let now = server_now_us.max(s.updated_us);
                s.advance(p, now);
                View {
                    level: s.level,
                    outstanding: s.outstanding,
                    agents: s.agents.len(),
                }
            }
            _ => View {
                level: Level::full(p.capacity),
                outstanding: 0,
                agents: 0,
            },
        }
    }

    /// The hash fields Redis holds for this state, sorted by name.
    pub fn fields(&self) -> BTreeMap<String, String> {
        let mut f = BTreeMap::new();
        let Some(s) = &self.state else {
            return f;
        };
        for (k, v) in [
            ("tok", s.level.tokens),
            ("car", s.level.carry),
            ("p", s.period_us),
            ("ts", s.updated_us),
            ("out", s.outstanding),
            ("nexp", s.next_drop_us),
            ("mx", s.last_drop_us),
        ] {
            f.insert(k.to_owned(), v.to_string());
        }
        for (id, r) in &s.agents {
            f.insert(format!("{id}:h"), r.held.to_string());
            f.insert(format!("{id}:x"), r.drop_us.to_string());
            f.insert(format!("{id}:s"), r.seq.to_string());
            f.insert(format!("{id}:r"), r.reply.encode());
            f.insert(format!("{id}:d"), r.demand.to_string());
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::Rule;

    fn params(capacity: u64, rate: &str) -> BucketParams {
        let mut spec = crate::rule::RuleSpec {
            capacity,
            rate: rate.into(),
            ..Default::default()
        };
        spec.lease_ttl = Some("1s".into());
        spec.grace = Some("100ms".into());
        Rule::from_spec("t", &spec).unwrap().bucket_params()
    }

    fn acquire(agent: u64, seq: u64, held: u64, want: u64) -> Request {
        Request {
            agent: AgentId(agent),
            seq,
            op: Op::Acquire {
                held,
                want,
                min: 1,
                demand: 0,
            },
        }
    }

    const T0: u64 = 1_700_000_000_000_000;

    #[test]
    fn grants_from_a_full_bucket_and_counts_outstanding() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        let r = b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
        assert_eq!((r.granted, r.remaining, r.ttl_us), (4, 6, 1_000_000));
        let s = b.state().unwrap();
        assert_eq!((s.level.tokens, s.outstanding), (6, 4));
    }

    #[test]
    fn refill_stops_at_capacity_minus_outstanding() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
        // 0.5 s later the bucket is still at 6 = B - outstanding.
        let r = b.apply(&p, T0 + 500_000, &acquire(2, 1, 0, 1)).unwrap();
        assert_eq!(r.remaining, 5);
        // Agent 1 reports it spent everything: the room opens, refill resumes from here.
        let r = b.apply(&p, T0 + 600_000, &acquire(1, 2, 0, 1)).unwrap();
        assert_eq!((r.granted, r.remaining), (1, 4));
    }

    #[test]
    fn denial_says_when_min_tokens_exist() {
        let p = params(2, "1/s");
        let mut b = GlobalBucket::new();
        b.apply(&p, T0, &acquire(1, 1, 0, 2)).unwrap();
        let mut req = acquire(2, 1, 0, 2);
        req.op = Op::Acquire {
            held: 0,
            want: 2,
            min: 2,
            demand: 0,
        };
        let r = b.apply(&p, T0 + 250_000, &req).unwrap();
        assert_eq!(r.granted, 0);
        // Agent 1's 2 tokens are outstanding; 2 tokens at 1/s need 2 s from empty.
        assert_eq!(r.retry_us, 2_000_000);
    }

    #[test]
    fn replay_returns_the_first_reply_and_changes_nothing() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        let first = b.apply(&p, T0, &acquire(1, 7, 0, 3)).unwrap();
        let before = b.clone();
        let again = b.apply(&p, T0 + 10_000, &acquire(1, 7, 0, 3)).unwrap();
        assert_eq!(first, again);
        assert_eq!(b, before);
        assert_eq!(
            b.apply(&p, T0 + 20_000, &acquire(1, 6, 0, 3)),
            Err(ProtocolError::StaleSequence { seq: 6, last: 7 })
        );
    }

    #[test]
    fn errors_change_nothing_and_name_the_problem() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        let req = Request {
            agent: AgentId(1),
            seq: 1,
            op: Op::Exact { cost: 11 },
        };
        assert_eq!(
            b.apply(&p, T0, &req),
            Err(ProtocolError::CapacityExceeded {
                requested: 11,
                capacity: 10
            })
        );
        assert!(b.state().is_none());
    }

    #[test]
    fn release_credits_no_more_than_was_held() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        b.apply(&p, T0, &acquire(1, 1, 0, 4)).unwrap();
        let rel = |seq, returned| Request {
            agent: AgentId(1),
            seq,
            op: Op::Release { returned },
        };
        let r = b.apply(&p, T0, &rel(2, 100)).unwrap();
        assert_eq!((r.granted, r.remaining), (4, 10));
        assert_eq!(b.state().unwrap().outstanding, 0);
    }

    #[test]
    fn clock_stepping_back_creates_nothing() {
        let p = params(10, "10/s");
        let mut b = GlobalBucket::new();
        b.apply(&p, T0, &acquire(1, 1, 0, 10)).unwrap();
        let r = b
            .apply(&p, T0 - 3_600_000_000, &acquire(2, 1, 0, 1))
            .unwrap();
        assert_eq!((r.granted, r.now_us), (0, T0));
    }

    #[test]
    fn dead_agents_stop_counting_at_their_drop_time() {
        let p = params(10, "1/s");
        let mut b = GlobalBucket::new();
        b.apply(&p, T0, &acquire(1, 1, 0, 10)).unwrap();
        // Lease 1 s + grace 0.1 s: dropped at T0 + 1.1 s, refill runs from there.
        let v = b.view_at(&p, T0 + 1_100_000);
        assert_eq!((v.level.tokens, v.outstanding, v.agents), (0, 0, 0));
        let v = b.view_at(&p, T0 + 3_100_000);
        assert_eq!(v.level.tokens, 2);
        // The key expires only once full again: 1.1 s + 10 s.
        let s = b.state().unwrap();
        assert_eq!(s.expire_at_ms, (T0 + 11_100_000) / 1000 + 1);
    }
}
