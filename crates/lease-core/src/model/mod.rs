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
//!
//! One file per concern, as the Lua is laid out: `state` (the hash and its refill),
//! `ops` (validation, open/finish, one function per operation), `share` (proportional
//! share), `split` (splitting a hot bucket into parts), `batch` (exact decisions on many
//! keys in one call, answered once from a per-batch dedup key).

mod batch;
mod ops;
pub mod region;
pub mod seats;
mod share;
mod split;
mod state;
#[cfg(test)]
mod tests;

use std::fmt;

pub use batch::{BatchLog, BatchRecord, ExactOutcome, ExactReply, MAX_BATCH_COSTS, validate_exact};
pub(crate) use ops::RATE_HEADROOM;
pub use ops::validate;
pub use split::{MAX_PARTS, PartTerm, RESERVATION, Split};
pub use state::{AgentRecord, BucketState, View, rate_scale};

use crate::bucket::Level;
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
    /// A rate lease (see [`crate::rate_lease`]): declare the burst the agent's local bucket
    /// holds room for (`held`, state-based as for `Acquire`) and the whole tokens in it,
    /// ask for a burst of `want` and a share of the bucket's rate sized by `demand`, for the
    /// rule's lease term. The reply: `burst`, the burst (it grows towards `want` while
    /// the bursts leave room under B, the room it gains starting empty; 0 without a share,
    /// when it is `held`); `granted`, tokens taken from the level into it; `remaining`,
    /// the level left (what a dry local bucket may borrow with another call);
    /// `scale_ppm`, the share in `1/scale`-ths of a token per rate period
    /// ([`rate_scale`]); `retry_us`, 1 when other agents' shares hold more than an eighth
    /// of the agent's part (asking again within the term gets more, as they renew);
    /// `ttl_us`, the term. A release gives the share up.
    Rate {
        /// The burst the agent holds room for: its local bucket's capacity as it sends.
        held: u64,
        /// The burst wanted (at most the capacity).
        want: u64,
        /// Whole tokens in the local bucket (at most `held`).
        tokens: u64,
        /// The agent's demand for this bucket, thousandths of a token per second.
        demand: u64,
    },
    /// Give back unspent tokens; the agent holds nothing afterwards.
    Release {
        /// Tokens returned.
        returned: u64,
    },
    /// Take `cost` tokens for one decision (the per-request path for cold keys). Cost 0
    /// is a read: the reply's `remaining` is the level, nothing is taken (a check-only
    /// request, or the look before taking several buckets all or nothing).
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
    /// On a region's bucket: the broker deposits `tokens` its region was granted by the
    /// global bucket, good until `until_us` (this store's server time). The request's
    /// `seq` is the grant's time on the global bucket; a deposit whose `seq` is not above
    /// the last one applied changes nothing (`seq` 0: a read). See [`region`].
    Deposit {
        /// Tokens granted.
        tokens: u64,
        /// The end of the term they serve, this store's server µs.
        until_us: u64,
        /// The rate the region gets of the global bucket, thousandths of a token per
        /// second (0: unknown): the region's agents share it as they would share r.
        rate_milli: u64,
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

/// The answer to a [`Request`], identical for a replayed retry. Its wire form (an array
/// of integers, and the text stored for replays) is `leasehold_store::wire`'s.
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
    /// The agent's rate-lease burst as its record holds it after the call (0 while the
    /// record holds no share): a replay says the same, read from the record.
    pub burst: u64,
}

/// A request the bucket refuses; nothing is changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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

/// The model of one bucket key; absent state is a full bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GlobalBucket {
    state: Option<BucketState>,
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

    /// Applies `req` at server time `server_now_us`, as one atomic function call would.
    pub fn apply(
        &mut self,
        p: &BucketParams,
        server_now_us: u64,
        req: &Request,
    ) -> Result<Reply, ProtocolError> {
        validate(p, req)?;
        let mut call = match ops::Call::open(&mut self.state, p, server_now_us, req) {
            ops::Opened::Call(call) => call,
            ops::Opened::Replay(answer) => return answer,
        };
        let (record, reply) = match req.op {
            Op::Acquire {
                held,
                want,
                min,
                demand,
            } => ops::acquire(&mut call, p, held, want, min, demand),
            Op::Rate {
                held,
                want,
                tokens,
                demand,
            } => ops::rate(&mut call, p, held, want, tokens, demand),
            Op::Release { returned } => ops::release(&mut call, p, returned),
            Op::Exact { cost } => ops::exact(&mut call, p, cost),
            Op::Split {
                parts,
                salt,
                until_us,
            } => ops::split(&mut call, p, parts, salt, until_us),
            Op::Deposit {
                tokens,
                until_us,
                rate_milli,
            } => {
                let reply = ops::deposit(&mut call, p, req.seq, tokens, until_us, rate_milli);
                let (state, reply) = call.finish(p, req, None, reply);
                self.state = Some(state);
                return Ok(reply);
            }
        };
        let (state, reply) = call.finish(p, req, Some(record), reply);
        self.state = Some(state);
        Ok(reply)
    }

    /// The same bucket with its key expiring no earlier than `expire_at_ms`. Redis judges
    /// a key's expiry by the time its command started, while a function reads `TIME`
    /// later, so a key due to expire within that gap may still be there: an oracle
    /// accepts either reading at that boundary.
    pub fn alive_until(&self, expire_at_ms: u64) -> Self {
        let mut b = self.clone();
        if let Some(s) = &mut b.state {
            s.expire_at_ms = s.expire_at_ms.max(expire_at_ms);
        }
        b
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
                    shared: s.shared,
                }
            }
            _ => View {
                level: Level::full(p.capacity),
                outstanding: 0,
                agents: 0,
                shared: 0,
            },
        }
    }
}
