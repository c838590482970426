//! Exact decisions in batches (the Lua's `lh_exact_batch`): one agent's cold decisions on
//! many keys in one call, each key decided as `lh_exact` would, one cost after another,
//! from its own state alone.
//!
//! The difference is the record. `lh_exact` leaves a five-field record per agent in the
//! bucket, which joins the drop schedule. A batch leaves nothing in its buckets: its
//! answer is kept once, in the batch's own dedup key ([`BatchLog`]: named by its first
//! bucket key, agent and `seq`, in that key's slot), until the longest grace of its
//! rules. A retry of the batch (same agent, `seq` and keys) finds it there and gets the
//! same answer, whatever happened to the buckets since (I2). The agent retries only
//! within half the shortest grace, so a lost reply never debits twice. (Exact decisions
//! are independent debits: a late first arrival of a batch the agent gave up on only
//! under-admits, so batches need no order.)
//!
//! A key that is split, or is a part, is left untouched and answered
//! [`ExactOutcome::Moved`]: its decisions take the single-key path, which routes them.

use super::state::BucketState;
use super::{GlobalBucket, ProtocolError};
use crate::rate::MAX_EXACT;
use crate::rule::BucketParams;

/// The most decisions one batch may carry, over all its keys.
pub const MAX_BATCH_COSTS: usize = 4096;

/// One key's answer in a batch: the server time, the tokens left after its decisions,
/// and each decision's wait (0 = admitted).
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
}

/// Validates one key of a batch as the Lua does.
pub fn validate_exact(p: &BucketParams, seq: u64, costs: &[u64]) -> Result<(), ProtocolError> {
    if seq > MAX_EXACT {
        return Err(ProtocolError::InvalidArgument {
            what: "seq",
            value: seq,
        });
    }
    if let Some(seed) = p.part {
        return Err(ProtocolError::InvalidArgument {
            what: "part_gen",
            value: seed.gen_us,
        });
    }
    // A region's bucket is decided by lh_exact (a batch key is a plain bucket's).
    if p.region.is_some() {
        return Err(ProtocolError::InvalidArgument {
            what: "region",
            value: 0,
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
    /// Decides `costs` (in order) on this key at server time `server_now_us`, as one key
    /// of an `lh_exact_batch` call: [`ExactOutcome::Decided`] or [`ExactOutcome::Moved`].
    pub fn exact_many(
        &mut self,
        p: &BucketParams,
        server_now_us: u64,
        costs: &[u64],
    ) -> Result<ExactOutcome, ProtocolError> {
        validate_exact(p, 0, costs)?;
        if self
            .state
            .as_ref()
            .is_some_and(|s| server_now_us / 1000 > s.expire_at_ms)
        {
            self.state = None;
        }
        if self
            .state
            .as_ref()
            .is_some_and(|s| s.split.is_some() || s.part.is_some())
        {
            return Ok(ExactOutcome::Moved);
        }
        // A new key is stored compact; a compact key stays so; a hash with nothing but a
        // level (no record, demand, share, split or term, never split) is made compact
        // again; any other hash stays a hash.
        let stored = self.state.take();
        let unchanged = stored.clone();
        let mut s = stored.unwrap_or_else(|| BucketState {
            compact: true,
            ..BucketState::fresh(p, server_now_us)
        });
        let was_compact = unchanged.as_ref().is_some_and(|u| u.compact);
        let same_period = s.period_us == super::state::carry_period(p);
        if !s.compact && same_period && s.only_a_level() {
            s.compact = true;
        }
        let now = server_now_us.max(s.updated_us);
        s.advance(p, now);
        // Agents lease this key: say so, with their proportional scale (at least 1).
        let scale_ppm = if s.demand_sum > 0 {
            super::share::scale_ppm(p, 0, s.demand_sum, 0).max(1)
        } else {
            0
        };
        let retry_us: Vec<u64> = costs
            .iter()
            .map(|&cost| {
                if s.level.tokens >= cost {
                    s.level = s.level.take(cost);
                    0
                } else if s.share_records > 0 {
                    // Rate leases hold part of the rate.
                    s.wait_for(p, cost)
                } else {
                    s.level.time_until(cost, p.rate)
                }
            })
            .collect();
        // I6: not before every lease record's drop, and full again; and, as `lh_exact`'s
        // record does, a grace after the call (a key used again soon is not made again).
        let busy = s.last_drop_us.max(now + p.grace_us);
        let needed_ms = (busy + s.level.time_until(p.capacity, p.rate)) / 1000 + 1;
        s.expire_at_ms = if !s.compact {
            needed_ms
        } else if was_compact && s.expire_at_ms >= needed_ms {
            // The expiry a compact key has, which its string keeps, covers this: kept
            // (`SETRANGE` in place: about 5 000 instructions of Redis's less than setting
            // one).
            s.expire_at_ms
        } else {
            // Else ten graces beyond, at most 10 s: a key decided again within them keeps
            // it.
            needed_ms + keep_slack_ms(p)
        };
        let nothing_admitted = retry_us.iter().all(|&r| r > 0);
        let reply = ExactReply {
            now_us: now,
            remaining: s.level.tokens,
            scale_ppm,
            retry_us,
        };
        // A compact key that existed, in the same period, none of whose costs was
        // admitted, is not written: it keeps what it held (its refill from there reads
        // the same later).
        self.state = if was_compact && same_period && nothing_admitted {
            unchanged
        } else {
            Some(s)
        };
        Ok(ExactOutcome::Decided(reply))
    }
}

/// How far beyond what it must cover a compact key's expiry is set, ms: ten of the
/// rule's graces, at most 10 s (the Lua's `keep_slack`). An idle tenant's key stays that
/// long (10 s at the default grace), so a tenant seen again within it finds its key
/// instead of making one, and Redis expires fewer keys; the bound keeps a rule with a
/// long grace from holding idle tenants for hours.
fn keep_slack_ms(p: &BucketParams) -> u64 {
    (p.grace_us / 100).min(KEEP_SLACK_MAX_MS)
}

/// The most a compact key's expiry is set beyond what it must cover, ms.
const KEEP_SLACK_MAX_MS: u64 = 10_000;

/// A batch's dedup key: the batch's sequence number and answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchRecord {
    /// Its sequence number.
    pub seq: u64,
    /// The server time it was decided at, µs.
    pub server_now_us: u64,
    /// Its answer, key by key.
    pub outcomes: Vec<ExactOutcome>,
    /// The number of decisions on each key.
    pub counts: Vec<usize>,
    /// When the key expires, ms.
    pub expire_at_ms: u64,
}

/// The model of one batch's dedup key; absent state is no batch kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchLog {
    state: Option<BatchRecord>,
}

impl BatchLog {
    /// No batch kept.
    pub fn new() -> Self {
        Self::default()
    }

    /// What the key holds.
    pub fn record(&self) -> Option<&BatchRecord> {
        self.state.as_ref()
    }

    /// The key with its expiry as the store set it (the moment of the write, which only
    /// the store knows).
    pub fn set_expiry(&mut self, expire_at_ms: u64) {
        if let Some(r) = &mut self.state {
            r.expire_at_ms = expire_at_ms;
        }
    }

    /// Before the batch's keys are decided: its answer when the batch was applied before
    /// (this is a retry); `None` to go on.
    pub fn open(&mut self, server_now_us: u64, seq: u64) -> Option<Vec<ExactOutcome>> {
        if self
            .state
            .as_ref()
            .is_some_and(|r| server_now_us / 1000 >= r.expire_at_ms)
        {
            self.state = None;
        }
        let r = self.state.as_ref()?;
        (r.seq == seq).then(|| r.outcomes.clone())
    }

    /// After the keys: keeps the batch's answer (with each key's number of decisions) for
    /// `grace_us` (the longest of its rules).
    pub fn close(
        &mut self,
        server_now_us: u64,
        seq: u64,
        grace_us: u64,
        outcomes: &[ExactOutcome],
        counts: &[usize],
    ) {
        self.state = Some(BatchRecord {
            seq,
            server_now_us,
            outcomes: outcomes.to_vec(),
            counts: counts.to_vec(),
            expire_at_ms: server_now_us / 1000 + grace_us.div_ceil(1000).max(1),
        });
    }
}
