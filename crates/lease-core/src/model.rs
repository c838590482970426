//! The reference model of one global bucket: the oracle that `lua/leasehold.lua` must
//! match reply for reply and field for field.
//!
//! The state is what the Redis hash holds: the level (`tok`, `car`), the refill period the
//! carry is counted in (`p`), the last server time (`ts`), the tokens leased and not yet
//! reported (`out`), the earliest and latest moments an agent record may be dropped
//! (`nexp`, `mx`), the sum of the agents' reported demand (`ds`) and the earliest moment
//! one of them goes stale (`dx`, a second after the agent's last call), a split in force
//! (`sp`: parts, salt, until, tokens, outstanding, drop; `sg`: when the latest began) or
//! the split this bucket is a part of (`pt`: its start and the end of its term), and per
//! agent its held tokens, drop time, last sequence number, last
//! reply, demand and lease credit (`ID:h x s r d c`). Every operation is a pure function
//! of this state, the rule's parameters and the server time:
//!
//! 1. Expired key: the state is gone, the bucket is full (I6 makes that equivalent).
//! 2. `now = max(server time, ts)`: a clock stepping back creates nothing (I5).
//! 3. The agent's live record with the same `seq` replays its reply and changes nothing;
//!    an older `seq` is refused (I2).
//! 4. A part of a split bucket starts from the seed its callers carry, once per split.
//! 5. Refill up to `now` (none while a split is in force: the rate belongs to the parts),
//!    dropping agent records whose drop time passed in time order, so the refill between
//!    two drops uses the cap in force then. In strict mode refill stops at `B - out` (I1).
//! 6. The operation — under contention within the agent's proportional share (see
//!    `Allowance`) — then the key's expiry: not before every record is dropped, the
//!    split's term is over, and the bucket would be full again (I6).

use std::collections::BTreeMap;
use std::fmt;

use crate::bucket::Level;
use crate::rate::MAX_EXACT;
use crate::rule::BucketParams;

/// The largest `held` or `returned` an agent may declare (2^40): a sum over thousands of
/// agents stays exact in Lua.
pub const MAX_HELD: u64 = 1 << 40;

/// A record's demand stops counting in the key's shares this long after the agent's
/// last operation (a crashed or partitioned agent's demand would otherwise hold the
/// others back until its lease and grace run out).
pub const DEMAND_TTL_US: u64 = 1_000_000;

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
    /// Split the bucket into `parts` sub-buckets until `until_us` (server time), or extend
    /// the split in force. The coordinator's operation; see [`Split`].
    Split {
        /// How many parts (2..=[`MAX_PARTS`]).
        parts: u64,
        /// Chooses the parts' keys (and so their slots).
        salt: u64,
        /// The end of the split's term, server µs.
        until_us: u64,
    },
}

/// The most parts a bucket may be split into.
pub const MAX_PARTS: u64 = 64;

/// The agent id that holds, in each part, the reservation of the parent's outstanding
/// tokens (agents draw random non-zero ids).
pub const RESERVATION: AgentId = AgentId(0);

/// A split in force on a bucket too hot for one shard.
///
/// For its term the parent grants nothing and refills nothing: its rate and capacity
/// move to `parts` sub-buckets (part `i` gets `B/k` and `r/k`, the remainders going to the
/// first parts, so they sum to the parent's). The parent's tokens at the split are shared
/// among the parts, and each part reserves its share of the parent's outstanding tokens
/// until the parent's last lease record drops. So at every moment the parent's
/// `tokens + outstanding` plus every part's is at most `B`, and the refill of all of them
/// together is at most `r`: I1 bounds the whole. A part serves only until the term ends
/// (its leases end by then too), and the parent resumes from then: merging needs no step
/// that could overlap. The coordinator keeps extending the term while the key is hot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Number of parts; 0 = no split.
    pub parts: u64,
    /// Chooses the parts' keys (see [`crate::BucketKey::part_of`]).
    pub salt: u64,
    /// When the split began (server µs); identifies it.
    pub gen_us: u64,
    /// When its term ends (server µs).
    pub until_us: u64,
    /// The parent's tokens at the split.
    pub tokens: u64,
    /// The parent's outstanding tokens at the split.
    pub outstanding: u64,
    /// When the parent's last lease record drops.
    pub drop_us: u64,
}

fn share(x: u64, k: u64, i: u64) -> u64 {
    x / k + u64::from(i < x % k)
}

impl Split {
    /// The parameters an agent sends to part `i` of a bucket with parameters `parent`;
    /// `None` when the part's rate or size cannot be represented exactly.
    pub fn part_params(&self, parent: &BucketParams, i: u64) -> Option<BucketParams> {
        let k = self.parts;
        if k < 2 || i >= k || parent.capacity < k {
            return None;
        }
        let tokens = std::num::NonZeroU64::new(parent.rate.tokens())?;
        let period = parent.rate.period_us().checked_mul(k)?;
        let rate = crate::Rate::new(tokens, std::time::Duration::from_micros(period)).ok()?;
        let capacity = share(parent.capacity, k, i);
        let units = u128::from(capacity) * u128::from(rate.period_us()) + u128::from(rate.tokens());
        if units > u128::from(crate::rule::MAX_BUCKET_UNITS) {
            return None;
        }
        Some(BucketParams {
            capacity,
            rate,
            max_outstanding: if parent.max_outstanding == 0 {
                0
            } else {
                share(parent.max_outstanding, k, i).max(1)
            },
            part: crate::rule::PartSeed {
                gen_us: self.gen_us,
                until_us: self.until_us,
                tokens: share(self.tokens, k, i),
                outstanding: share(self.outstanding, k, i),
                drop_us: self.drop_us,
            },
            ..*parent
        })
    }
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
    /// Acquire: the fraction of its demand each agent may have, in millionths: `r / Σ
    /// demand` over the agents holding records, at most 1 000 000 (proportional share;
    /// 1 000 000 for an agent alone with demand). Exact: the same scale, at least 1, when
    /// other agents report demand on the key (they lease it), else 0.
    pub scale_ppm: u64,
    /// True when this bucket is not the one to use now (a parent during a split, or a part
    /// whose term is over): nothing was granted, ask the parent.
    pub moved: bool,
    /// The split in force on this (parent) bucket, if any.
    pub split: Option<Split>,
}

impl Reply {
    /// The reply as the Lua functions return it: 14 integers (the split's seven are
    /// zeros when there is none).
    pub fn to_array(&self) -> [u64; 14] {
        let s = self.split.unwrap_or_default();
        [
            self.granted,
            self.ttl_us,
            self.remaining,
            self.retry_us,
            self.now_us,
            self.scale_ppm,
            u64::from(self.moved),
            s.parts,
            s.salt,
            s.gen_us,
            s.until_us,
            s.tokens,
            s.outstanding,
            s.drop_us,
        ]
    }

    /// The inverse of [`Reply::to_array`].
    pub fn from_array(a: [u64; 14]) -> Self {
        Self {
            granted: a[0],
            ttl_us: a[1],
            remaining: a[2],
            retry_us: a[3],
            now_us: a[4],
            scale_ppm: a[5],
            moved: a[6] != 0,
            split: (a[7] != 0).then_some(Split {
                parts: a[7],
                salt: a[8],
                gen_us: a[9],
                until_us: a[10],
                tokens: a[11],
                outstanding: a[12],
                drop_us: a[13],
            }),
        }
    }

    /// The stored form: the array, comma separated; the 7 split numbers only when a
    /// split is in force.
    pub fn encode(&self) -> String {
        let a = self.to_array();
        let n = if self.split.is_none() { 7 } else { 14 };
        let text: Vec<String> = a[..n].iter().map(u64::to_string).collect();
        text.join(",")
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
    /// What it may still lease while the key is contended, thousandths of a token.
    pub credit_milli: u64,
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
    /// Sum of the records' demand.
    pub demand_sum: u64,
    /// The earliest moment a record's demand goes stale (0: no demand recorded).
    pub next_stale_us: u64,
    /// The split in force (parent).
    pub split: Split,
    /// The start of the latest split, kept after it ends so the next one differs.
    pub last_split_us: u64,
    /// The split this bucket is a part of (0: none), and the end of its term.
    pub part_gen_us: u64,
    /// The end of the term this part serves.
    pub part_until_us: u64,
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

/// `r / demand_sum` in millionths, at most one: the proportional share of every agent.
/// An agent alone with demand has the whole bucket.
/// Computed in floating point with the same operations as the Lua, so both round alike;
/// it only guides lease sizes.
fn scale_ppm(p: &BucketParams, demand_sum: u64, demand: u64) -> u64 {
    if demand_sum <= demand {
        return 1_000_000;
    }
    let rate_milli_scaled = p.rate.tokens() as f64 * 1e15;
    let x = rate_milli_scaled / (p.rate.period_us() as f64 * demand_sum as f64);
    x.min(1e6).floor() as u64
}

/// A full allowance: the whole capacity, in thousandths (what an agent has while the key
/// is not contended).
fn full_credit(p: &BucketParams) -> u64 {
    (p.capacity as f64 * 1000.0) as u64
}

/// Tokens piling up in the bucket past this level (B/8) mean the agents with credit are
/// not taking them: proportional share stops binding until they are taken.
fn plenty_level(p: &BucketParams) -> u64 {
    p.capacity.div_ceil(8)
}

/// Proportional share, enforced. While the key is contended (the agents' demand sums
/// to more than r, and not all of it is this agent's), an agent earns the right to
/// lease tokens at `r * share` per second, `share = demand / Σ demand` (1% of the sum
/// for an agent that reports no demand yet, so a newcomer is not starved before its
/// demand is measured; a floor for every agent would hand a fleet of 1 000 small agents
/// ten times the rate, and the large ones would pay for it), and may bank
/// `B * share` of it. Grants spend the credit; an agent out of credit waits its turn
/// while the others lease. The arithmetic is in floating point with the same operations
/// as the Lua, so both round alike.
#[derive(Clone, Copy, Debug)]
struct Allowance {
    /// Credit, thousandths of a token.
    credit: f64,
    /// Credit earned per µs, thousandths of a token.
    per_us: f64,
    cap: f64,
}

impl Allowance {
    fn new(p: &BucketParams, demand_sum: u64, demand: u64, scale: u64, min: u64) -> Option<Self> {
        if scale >= 1_000_000 {
            return None;
        }
        let ds = demand_sum as f64;
        let share = if demand > 0 {
            demand as f64
        } else {
            (ds / 100.0).ceil()
        };
        let per_us = p.rate.tokens() as f64 * 1000.0 / p.rate.period_us() as f64 * share / ds;
        let cap = (min as f64 * 1000.0).max((p.capacity as f64 * 1000.0 * share / ds).floor());
        Some(Self {
            credit: 0.0,
            per_us,
            cap,
        })
    }

    /// Adds what was earned since the agent's last operation to its banked credit.
    fn earn(&mut self, prior: Option<&AgentRecord>, now: u64) {
        let (banked, elapsed) = match prior {
            Some(r) => (
                r.credit_milli as f64,
                now.saturating_sub(r.reply.now_us) as f64,
            ),
            None => (self.cap, 0.0),
        };
        self.credit = (banked + (elapsed * self.per_us).floor()).min(self.cap);
    }

    fn tokens(&self) -> u64 {
        (self.credit / 1000.0).floor() as u64
    }

    /// Spends credit for a grant, down to zero (a grant from plenty may exceed it).
    fn spend(&mut self, tokens: u64) {
        self.credit = (self.credit - tokens as f64 * 1000.0).max(0.0);
    }

    /// µs until this agent's turn for `min` tokens: until its credit covers them, or,
    /// when it does and the bucket is short of them, the time its share of the refill
    /// takes to bring them (the other agents drain the bucket meanwhile). Telling every
    /// refused agent "when `min` tokens exist" would bring them all back at once, for one
    /// of them to win.
    fn wait_us(&self, min: u64) -> u64 {
        let mut need = min as f64 * 1000.0 - self.credit;
        if need <= 0.0 {
            need = min as f64 * 1000.0;
        }
        (need / self.per_us).ceil() as u64
    }
}

/// The record after an operation that leaves the agent's holding, demand and credit as
/// they were (exact, split): it lives at least until `grace_end`. Its reply is set when
/// the operation completes.
fn kept(prior: Option<&AgentRecord>, credit_milli: u64, grace_end: u64, seq: u64) -> AgentRecord {
    AgentRecord {
        held: prior.map_or(0, |r| r.held),
        drop_us: prior.map_or(0, |r| r.drop_us).max(grace_end),
        seq,
        reply: Reply::default(),
        demand: prior.map_or(0, |r| r.demand),
        credit_milli,
    }
}

/// Validates what the Lua validates, in the same order.
pub fn validate(p: &BucketParams, req: &Request) -> Result<(), ProtocolError> {
    check("seq", req.seq, MAX_EXACT)?;
    let seed = &p.part;
    check("part_gen", seed.gen_us, MAX_EXACT)?;
    check("part_until", seed.until_us, MAX_EXACT)?;
    check("part_tokens", seed.tokens, MAX_EXACT)?;
    check("part_outstanding", seed.outstanding, MAX_HELD)?;
    check("part_drop", seed.drop_us, MAX_EXACT)?;
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
        Op::Release { returned } => check("returned", returned, MAX_HELD)?,
        Op::Exact { cost } => check_amount("cost", cost, p.capacity)?,
        Op::Split {
            parts,
            salt,
            until_us,
        } => {
            if !(2..=MAX_PARTS).contains(&parts) || parts > p.capacity || seed.gen_us != 0 {
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
            demand_sum: 0,
            next_stale_us: 0,
            split: Split::default(),
            last_split_us: 0,
            part_gen_us: 0,
            part_until_us: 0,
            expire_at_ms: 0,
        }
    }

    /// A part starting a new split: its share of the parent's tokens, and a reservation
    /// of its share of the parent's outstanding tokens until they drop.
    fn seeded(p: &BucketParams, now_us: u64) -> Self {
        let seed = &p.part;
        let mut s = Self::fresh(p, now_us);
        s.part_gen_us = seed.gen_us;
        s.part_until_us = seed.until_us;
        if seed.outstanding > 0 && seed.drop_us > now_us {
            s.outstanding = seed.outstanding;
            s.next_drop_us = seed.drop_us;
            s.last_drop_us = seed.drop_us;
            s.agents.insert(
                RESERVATION,
                AgentRecord {
                    held: seed.outstanding,
                    drop_us: seed.drop_us,
                    seq: 0,
                    reply: Reply::default(),
                    demand: 0,
                    credit_milli: 0,
                },
            );
        }
        s.level = Level {
            tokens: seed.tokens,
            carry: 0,
        };
        s.clamp(p);
        s
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
        // A split parent refills nothing during the term: its rate belongs to the parts.
        if self.split.parts != 0 {
            if now < self.split.until_us {
                self.updated_us = now;
            } else {
                self.updated_us = self.updated_us.max(self.split.until_us);
                self.split = Split::default();
            }
        }
        if self.next_stale_us != 0 && now >= self.next_stale_us {
            for r in self.agents.values_mut() {
                if r.demand > 0 && r.reply.now_us + DEMAND_TTL_US <= now {
                    self.demand_sum -= r.demand;
                    r.demand = 0;
                }
            }
            self.next_stale_us = self
                .agents
                .values()
                .filter(|r| r.demand > 0)
                .map(|r| r.reply.now_us + DEMAND_TTL_US)
                .min()
                .unwrap_or(0);
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
                    self.demand_sum -= r.demand;
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
        // A call that creates the key (it never existed, expired, or was lost).
        let mut created = self.state.is_none();
        // Worked on in place: nothing below fails once the replay check has passed.
        let mut s = match self.state.take() {
            Some(s) => s,
            None => BucketState::fresh(p, server_now_us),
        };
        let now = server_now_us.max(s.updated_us);
        if let Some(r) = s.live(req.agent, now) {
            // Only an existing key has records: put it back unchanged.
            let answer = if req.seq == r.seq {
                Ok(r.reply)
            } else if req.seq < r.seq {
                Err(ProtocolError::StaleSequence {
                    seq: req.seq,
                    last: r.seq,
                })
            } else {
                Ok(Reply::default())
            };
            if req.seq <= r.seq {
                self.state = Some(s);
                return answer;
            }
        }
        let seed = &p.part;
        if seed.gen_us != 0 {
            // A part: the first call of a newer split starts it from its seed (whatever
            // an older split left is void: that split's term is over); later calls may
            // carry a longer term.
            if s.part_gen_us < seed.gen_us {
                s = BucketState::seeded(p, now);
                created = false;
            } else if s.part_gen_us == seed.gen_us {
                s.part_until_us = s.part_until_us.max(seed.until_us);
            }
        }
        s.advance(p, now);
        let prior = s.agents.get(&req.agent).cloned();
        let prior_held = prior.as_ref().map_or(0, |r| r.held);
        let prior_demand = prior.as_ref().map_or(0, |r| r.demand);
        let prior_credit = prior
            .as_ref()
            .map_or_else(|| full_credit(p), |r| r.credit_milli);
        // Where this bucket stands: a split parent and a part past its term serve nothing
        // (`moved`); a part's leases end with its term.
        let moved = s.split.parts != 0 || (s.part_gen_us != 0 && now >= s.part_until_us);
        let ttl_us = if s.part_gen_us != 0 {
            p.lease_ttl_us
                .min(s.part_until_us.saturating_sub(now + p.grace_us))
        } else {
            p.lease_ttl_us
        };
        let mut reply = Reply {
            now_us: now,
            moved,
            ..Reply::default()
        };
        let record;
        match req.op {
            Op::Acquire {
                held,
                want,
                min,
                demand,
            } => {
                // An agent holding tokens from, or measuring demand on, a bucket that no
                // longer exists: the bucket was lost (evicted, flushed, a replica promoted
                // without it). It restarts empty, not full: what it handed out may all be
                // spent. (A bucket expires only once every lease in it has, I6, and full;
                // an agent declares nothing past its lease's deadline, and reports demand
                // only on a key it has used, which an idle agent withdraws.)
                if created && (held > 0 || demand > 0) {
                    s.level = Level::default();
                }
                // State-based report: the agent's own count replaces ours. Declaring more
                // than we knew (after a failover lost a grant) lowers the tokens instead.
                s.outstanding = s.outstanding - prior_held + held;
                s.demand_sum = s.demand_sum - prior_demand + demand;
                s.clamp(p);
                let tok = s.level.tokens;
                let scale = scale_ppm(p, s.demand_sum, demand);
                let mut share = Allowance::new(p, s.demand_sum, demand, scale, min);
                if let Some(a) = &mut share {
                    a.earn(prior.as_ref(), now);
                }
                let avail = if moved || ttl_us == 0 {
                    0
                } else if p.max_outstanding == 0 {
                    tok
                } else {
                    tok.min(p.max_outstanding.saturating_sub(s.outstanding))
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
                reply.retry_us = if g > 0 {
                    0
                } else if moved {
                    1
                } else if ttl_us == 0 {
                    s.part_until_us.saturating_sub(now).max(1)
                } else {
                    let blocked = if p.max_outstanding != 0 && tok >= min {
                        s.next_drop_us.saturating_sub(now)
                    } else {
                        0
                    };
                    // An agent's turn comes when its share has earned `min` (see
                    // `wait_us`), or when tokens pile up to plenty, whichever is first.
                    let plenty_in = s.level.time_until(plenty_level(p), p.rate);
                    let turn = share.as_ref().map_or(0, |a| a.wait_us(min).min(plenty_in));
                    s.level
                        .time_until(min, p.rate)
                        .max(blocked)
                        .max(turn)
                        .max(1)
                };
                reply.granted = g;
                reply.ttl_us = ttl_us;
                reply.scale_ppm = scale;
                record = AgentRecord {
                    held: held + g,
                    drop_us: now + ttl_us + p.grace_us,
                    seq: req.seq,
                    reply,
                    demand,
                    credit_milli: share.map_or_else(|| full_credit(p), |a| a.credit as u64),
                };
            }
            Op::Release { returned } => {
                // Credit no more than we know the agent held: returns cannot mint tokens.
                let credit = returned.min(prior_held);
                s.outstanding -= prior_held;
                s.demand_sum -= prior_demand;
                s.level.tokens += credit;
                s.clamp(p);
                reply.granted = credit;
                record = AgentRecord {
                    held: 0,
                    drop_us: now + p.grace_us,
                    seq: req.seq,
                    reply,
                    demand: 0,
                    credit_milli: prior_credit,
                };
            }
            Op::Exact { cost } => {
                if moved {
                    reply.retry_us = 1;
                } else if s.level.tokens >= cost {
                    s.level = s.level.take(cost);
                    reply.granted = cost;
                } else {
                    reply.retry_us = s.level.time_until(cost, p.rate);
                }
                // Other agents lease this key: say so (their proportional scale, at
                // least 1), so an agent that sees it cold starts leasing at once.
                let own = prior.as_ref().map_or(0, |r| r.demand);
                if s.demand_sum > own {
                    reply.scale_ppm = scale_ppm(p, s.demand_sum, 0).max(1);
                }
                record = kept(prior.as_ref(), prior_credit, now + p.grace_us, req.seq);
            }
            Op::Split {
                parts,
                salt,
                until_us,
            } => {
                if s.split.parts == 0 && until_us > now {
                    // Start: the parent's tokens go to the parts, its refill stops.
                    let gen_us = now.max(s.last_split_us + 1);
                    s.split = Split {
                        parts,
                        salt,
                        gen_us,
                        until_us,
                        tokens: s.level.tokens,
                        outstanding: s.outstanding,
                        drop_us: s.last_drop_us,
                    };
                    s.last_split_us = gen_us;
                    s.level = Level::default();
                } else if s.split.parts == parts && s.split.salt == salt {
                    s.split.until_us = s.split.until_us.max(until_us);
                }
                record = kept(prior.as_ref(), prior_credit, now + p.grace_us, req.seq);
            }
        }
        reply.split = (s.split.parts != 0).then_some(s.split);
        reply.remaining = s.level.tokens;
        let record = AgentRecord { reply, ..record };
        let x = record.drop_us;
        s.next_drop_us = if s.next_drop_us == 0 {
            x
        } else {
            s.next_drop_us.min(x)
        };
        s.last_drop_us = s.last_drop_us.max(x);
        if record.demand > 0 {
            let stale = now + DEMAND_TTL_US;
            s.next_stale_us = if s.next_stale_us == 0 {
                stale
            } else {
                s.next_stale_us.min(stale)
            };
        }
        s.agents.insert(req.agent, record);
        // The key lives until every record is dropped, the split's term is over, and the
        // bucket would be full again (I6).
        let busy_until = s.last_drop_us.max(s.split.until_us);
        let life = busy_until.saturating_sub(now) + s.level.time_until(p.capacity, p.rate);
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
        use crate::schema as h;
        for (k, v) in [
            (h::TOKENS, s.level.tokens),
            (h::CARRY, s.level.carry),
            (h::PERIOD, s.period_us),
            (h::UPDATED, s.updated_us),
            (h::OUTSTANDING, s.outstanding),
            (h::NEXT_DROP, s.next_drop_us),
            (h::LAST_DROP, s.last_drop_us),
            (h::DEMAND_SUM, s.demand_sum),
            (h::NEXT_STALE, s.next_stale_us),
        ] {
            f.insert(k.to_owned(), v.to_string());
        }
        let sp = &s.split;
        if s.last_split_us != 0 {
            f.insert(h::SPLIT_GEN.to_owned(), s.last_split_us.to_string());
        }
        if sp.parts != 0 {
            let v = [
                sp.parts,
                sp.salt,
                sp.until_us,
                sp.tokens,
                sp.outstanding,
                sp.drop_us,
            ];
            let v: Vec<String> = v.iter().map(u64::to_string).collect();
            f.insert(h::SPLIT.to_owned(), v.join(","));
        }
        if s.part_gen_us != 0 {
            f.insert(
                h::PART.to_owned(),
                format!("{},{}", s.part_gen_us, s.part_until_us),
            );
        }
        for (id, r) in &s.agents {
            f.insert(format!("{id}{}", h::AGENT_HELD), r.held.to_string());
            f.insert(format!("{id}{}", h::AGENT_DROP), r.drop_us.to_string());
            f.insert(format!("{id}{}", h::AGENT_SEQ), r.seq.to_string());
            f.insert(format!("{id}{}", h::AGENT_REPLY), r.reply.encode());
            f.insert(format!("{id}{}", h::AGENT_DEMAND), r.demand.to_string());
            f.insert(
                format!("{id}{}", h::AGENT_CREDIT),
                r.credit_milli.to_string(),
            );
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

    /// I1 across a split: the parent's `tokens + outstanding` plus every part's never
    /// exceeds B, from the split through the parts' term to the parent's resumption.
    #[test]
    fn a_split_never_holds_more_than_the_parent_could() {
        let p = params(100, "50/s");
        let mut parent = GlobalBucket::new();
        // Agent 1 holds 30, 70 left in the bucket.
        parent.apply(&p, T0, &acquire(1, 1, 0, 30)).unwrap();
        let req = |seq, until_us| Request {
            agent: AgentId(9),
            seq,
            op: Op::Split {
                parts: 3,
                salt: 0,
                until_us,
            },
        };
        let r = parent.apply(&p, T0 + 10, &req(1, T0 + 5_000_000)).unwrap();
        let split = r.split.unwrap();
        assert_eq!((split.parts, split.tokens, split.outstanding), (3, 70, 30));
        // The parent now grants nothing and says where to go.
        let r = parent.apply(&p, T0 + 20, &acquire(2, 1, 0, 5)).unwrap();
        assert_eq!((r.granted, r.moved), (0, true));
        let part_params: Vec<BucketParams> =
            (0..3).map(|i| split.part_params(&p, i).unwrap()).collect();
        assert_eq!(part_params.iter().map(|q| q.capacity).sum::<u64>(), 100);
        let mut parts: Vec<GlobalBucket> = (0..3).map(|_| GlobalBucket::new()).collect();
        let total = |parent: &GlobalBucket, parts: &[GlobalBucket], t: u64| {
            let v = parent.view_at(&p, t);
            let mut sum = v.level.tokens + v.outstanding;
            for (b, q) in parts.iter().zip(&part_params) {
                if b.state().is_some() {
                    let v = b.view_at(q, t);
                    // The reservation stands for the parent's outstanding tokens, already
                    // counted in the parent.
                    let reserved = b.state().unwrap().agents.get(&RESERVATION);
                    let reserved = reserved.filter(|r| r.drop_us > t).map_or(0, |r| r.held);
                    // A part's tokens are dead once its term is over.
                    let usable = if t < split.until_us {
                        v.level.tokens
                    } else {
                        0
                    };
                    sum += usable + v.outstanding - reserved;
                }
            }
            sum
        };
        for step in 0..60u64 {
            let t = T0 + 100 + step * 100_000;
            for (i, (b, q)) in parts.iter_mut().zip(&part_params).enumerate() {
                let r = b
                    .apply(q, t, &acquire(10 + i as u64, step + 1, 0, 2))
                    .unwrap();
                if t + p.grace_us < T0 + 5_000_000 {
                    assert!(!r.moved);
                }
            }
            assert!(total(&parent, &parts, t) <= 100, "over B at step {step}");
        }
        // Past the term: parts refuse, the parent serves again and refills from then.
        let r = parts[0]
            .apply(&part_params[0], T0 + 6_100_000, &acquire(10, 100, 0, 1))
            .unwrap();
        assert_eq!((r.granted, r.moved), (0, true));
        let r = parent
            .apply(&p, T0 + 6_000_000, &acquire(2, 2, 0, 5))
            .unwrap();
        assert_eq!((r.moved, r.split), (false, None));
        assert!(r.granted > 0);
    }

    #[test]
    fn scale_is_the_rate_over_the_sum_of_demands() {
        let p = params(1000, "100/s");
        let mut b = GlobalBucket::new();
        let ask = |agent, demand| Request {
            agent: AgentId(agent),
            seq: 1,
            op: Op::Acquire {
                held: 0,
                want: 1,
                min: 1,
                demand,
            },
        };
        // 50 tokens/s of demand: under the rate, everyone gets all it asks for.
        let r = b.apply(&p, T0, &ask(1, 50_000)).unwrap();
        assert_eq!(r.scale_ppm, 1_000_000);
        // 400/s in all: each agent may have a quarter of its demand.
        let r = b.apply(&p, T0, &ask(2, 350_000)).unwrap();
        assert_eq!(r.scale_ppm, 250_000);
        assert_eq!(b.state().unwrap().demand_sum, 400_000);
    }

    /// Under contention an agent leases at most its share of the rate: with demand 1:9
    /// on a key whose rate is a tenth of the total, the small agent banks a tenth of B,
    /// then earns a tenth of the refill, and waits its turn for more.
    #[test]
    fn contended_agents_lease_their_share_and_wait_their_turn() {
        let p = params(80, "100/s");
        let mut b = GlobalBucket::new();
        let ask = |agent, seq, demand| Request {
            agent: AgentId(agent),
            seq,
            op: Op::Acquire {
                held: 0,
                want: 40,
                min: 1,
                demand,
            },
        };
        // Agent 2 (900/s) alone drains the bucket; agent 1 (100/s) joins.
        b.apply(&p, T0, &ask(2, 1, 900_000)).unwrap();
        b.apply(&p, T0, &ask(2, 2, 900_000)).unwrap();
        let r = b.apply(&p, T0, &ask(1, 1, 100_000)).unwrap();
        assert_eq!((r.granted, r.scale_ppm), (0, 100_000));
        // 90 ms: 9 tokens refilled (under B/8, so not plenty). Agent 1 takes its banked
        // credit, B/10 = 8 tokens, not the 9 there are.
        let r = b.apply(&p, T0 + 90_000, &ask(1, 2, 100_000)).unwrap();
        assert_eq!(r.granted, 8);
        // Out of credit: one token takes 100 ms to earn at 10 tokens/s, but in 90 ms the
        // bucket could hold B/8 = 10 tokens (plenty, when credit no longer binds).
        let r = b.apply(&p, T0 + 90_000, &ask(1, 3, 100_000)).unwrap();
        assert_eq!((r.granted, r.retry_us), (0, 90_000));
        // Agent 2 takes what is left.
        let r = b.apply(&p, T0 + 90_000, &ask(2, 3, 900_000)).unwrap();
        assert_eq!(r.granted, 1);
    }

    /// A silent agent's demand stops counting a second after its last call, so the
    /// others' shares grow back without waiting for its lease to run out.
    #[test]
    fn demand_of_a_silent_agent_goes_stale() {
        let p = params(100, "10/s");
        let mut b = GlobalBucket::new();
        let ask = |agent, seq, demand| Request {
            agent: AgentId(agent),
            seq,
            op: Op::Acquire {
                held: 0,
                want: 1,
                min: 1,
                demand,
            },
        };
        b.apply(&p, T0, &ask(1, 1, 30_000)).unwrap();
        let r = b.apply(&p, T0 + 500_000, &ask(2, 1, 10_000)).unwrap();
        assert_eq!(r.scale_ppm, 250_000);
        // Agent 1 says nothing more; a second after its call its demand is gone.
        let r = b.apply(&p, T0 + 1_000_000, &ask(2, 2, 10_000)).unwrap();
        assert_eq!(
            (r.scale_ppm, b.state().unwrap().demand_sum),
            (1_000_000, 10_000)
        );
        assert_eq!(b.state().unwrap().agents[&AgentId(1)].demand, 0);
    }
}
