//! Exact decisions in batches (the Lua's `lh_exact_many`): one agent's cold decisions on
//! many keys in one call, each key decided as `lh_exact` would, one cost after another.
//!
//! The difference is the record. A lease record is five fields per agent and joins the
//! drop schedule (`nexp`, `mx`); an exact batch leaves one field, `ID:e` =
//! `seq,drop,now,remaining,scale,retry...`, which only replays the batch's answer to a
//! retry until `drop` (now + grace). Such records are not in the drop schedule: each
//! agent overwrites its own, the key's expiry covers the newest, and once their number
//! (`en`) reaches the sweep mark (`ec`, at first [`EXACT_SWEEP`]) a new one drops the
//! expired ones and sets the mark to twice what is left. A retry within the grace
//! therefore always finds its record (the key cannot expire before it), so a lost
//! reply never debits twice (I2); a record past its drop is never consulted again.
//!
//! A key that is split, or is a part, is left untouched and answered
//! [`ExactOutcome::Moved`]: its decisions take the single-key path, which routes them.

use super::share::scale_ppm;
use super::state::{BucketState, ExactRecord};
use super::{AgentId, GlobalBucket, ProtocolError};
use crate::rate::MAX_EXACT;
use crate::rule::BucketParams;

/// The most decisions one batch may carry, over all its keys.
pub const MAX_BATCH_COSTS: usize = 4096;

/// Exact records of other agents are first swept once this many are stored.
pub const EXACT_SWEEP: u64 = 16;

/// One key's answer in a batch: the server time, the tokens left after its decisions,
/// the proportional scale when other agents lease the key (as `lh_exact`'s), and each
/// decision's wait (0 = admitted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExactReply {
    /// The server time the key was decided at, µs.
    pub now_us: u64,
    /// Whole tokens left after the key's decisions.
    pub remaining: u64,
    /// At least 1 when other agents report demand on the key (they lease it), else 0.
    pub scale_ppm: u64,
    /// Per decision, in the order sent: 0 if admitted, else µs until its cost could exist.
    pub retry_us: Vec<u64>,
}

/// What a batch did with one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExactOutcome {
    /// Decided (or replayed to a retry).
    Decided(ExactReply),
    /// The key is split or is a part: nothing was done; use the single-key path.
    Moved,
    /// An older batch than the last one seen from this agent on this key: a late
    /// duplicate; nothing was done.
    Stale {
        /// The last sequence number seen.
        last: u64,
    },
}

/// Validates one key of a batch as the Lua does.
pub fn validate_exact(p: &BucketParams, seq: u64, costs: &[u64]) -> Result<(), ProtocolError> {
    if seq > MAX_EXACT {
        return Err(ProtocolError::InvalidArgument {
            what: "seq",
            value: seq,
        });
    }
    if p.part.is_some() {
        return Err(ProtocolError::InvalidArgument {
            what: "part_gen",
            value: p.part.map_or(0, |s| s.gen_us),
        });
    }
    if costs.is_empty() || costs.len() > MAX_BATCH_COSTS {
        return Err(ProtocolError::InvalidArgument {
            what: "count",
            value: costs.len() as u64,
        });
    }
    for &cost in costs {
        if cost == 0 {
            return Err(ProtocolError::InvalidArgument {
                what: "cost",
                value: 0,
            });
        }
        if cost > p.capacity {
            return Err(ProtocolError::CapacityExceeded {
                requested: cost,
                capacity: p.capacity,
            });
        }
    }
    Ok(())
}

impl GlobalBucket {
    /// Decides `costs` (in order) on this key for `agent`'s batch `seq` at server time
    /// `server_now_us`, as one key of an `lh_exact_many` call.
    pub fn exact_many(
        &mut self,
        p: &BucketParams,
        server_now_us: u64,
        agent: AgentId,
        seq: u64,
        costs: &[u64],
    ) -> Result<ExactOutcome, ProtocolError> {
        validate_exact(p, seq, costs)?;
        if self
            .state
            .as_ref()
            .is_some_and(|s| server_now_us / 1000 > s.expire_at_ms)
        {
            self.state = None;
        }
        if let Some(s) = &self.state {
            let now = server_now_us.max(s.updated_us);
            if let Some(r) = s.exact.get(&agent)
                && r.drop_us > now
                && seq <= r.seq
            {
                return Ok(if seq == r.seq {
                    ExactOutcome::Decided(r.reply.clone())
                } else {
                    ExactOutcome::Stale { last: r.seq }
                });
            }
            if s.split.is_some() || s.part.is_some() {
                return Ok(ExactOutcome::Moved);
            }
        }
        let mut s = self
            .state
            .take()
            .unwrap_or_else(|| BucketState::fresh(p, server_now_us));
        let now = server_now_us.max(s.updated_us);
        s.advance(p, now);
        let own = s.agents.get(&agent).map_or(0, |r| r.demand);
        let scale_ppm = if s.demand_sum > own {
            scale_ppm(p, s.demand_sum, 0).max(1)
        } else {
            0
        };
        let retry_us = costs
            .iter()
            .map(|&cost| {
                if s.level.tokens >= cost {
                    s.level = s.level.take(cost);
                    0
                } else {
                    s.level.time_until(cost, p.rate)
                }
            })
            .collect();
        let reply = ExactReply {
            now_us: now,
            remaining: s.level.tokens,
            scale_ppm,
            retry_us,
        };
        let record = ExactRecord {
            seq,
            drop_us: now + p.grace_us,
            reply: reply.clone(),
        };
        if s.exact.insert(agent, record).is_none() {
            let mark = s.exact_sweep_at.unwrap_or(EXACT_SWEEP);
            if s.exact.len() as u64 >= mark {
                s.exact.retain(|id, r| *id == agent || r.drop_us > now);
                s.exact_sweep_at = Some(EXACT_SWEEP.max(2 * s.exact.len() as u64));
            }
        }
        // I6: not before the newest record's drop, every lease record's, and full again.
        let busy = s.last_drop_us.max(now + p.grace_us);
        s.expire_at_ms = (busy + s.level.time_until(p.capacity, p.rate)) / 1000 + 1;
        self.state = Some(s);
        Ok(ExactOutcome::Decided(reply))
    }
}
