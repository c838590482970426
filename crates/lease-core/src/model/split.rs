//! Splitting a bucket too hot for one shard (`lh_split`, and the seed each part starts
//! from).

use std::num::NonZeroU64;
use std::time::Duration;

use super::AgentId;
use crate::rule::{BucketParams, MAX_BUCKET_UNITS, Mode, PartSeed};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Number of parts, 2..=[`MAX_PARTS`].
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

/// The split a bucket is a part of, as the part remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartTerm {
    /// The split's start (server µs of the parent); identifies it.
    pub gen_us: u64,
    /// The end of the term this part serves.
    pub until_us: u64,
}

/// Part `i`'s share of `x` split `k` ways; the remainder goes to the first parts.
pub(super) fn share(x: u64, k: u64, i: u64) -> u64 {
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
        let tokens = NonZeroU64::new(parent.rate.tokens())?;
        let period = parent.rate.period_us().checked_mul(k)?;
        let rate = crate::Rate::new(tokens, Duration::from_micros(period)).ok()?;
        let capacity = share(parent.capacity, k, i);
        let units = u128::from(capacity) * u128::from(rate.period_us()) + u128::from(rate.tokens());
        if units > u128::from(MAX_BUCKET_UNITS) {
            return None;
        }
        let mode = match parent.mode {
            Mode::Strict => Mode::Strict,
            Mode::Relaxed { max_outstanding } => Mode::Relaxed {
                max_outstanding: NonZeroU64::new(share(max_outstanding.get(), k, i))
                    .unwrap_or(NonZeroU64::MIN),
            },
        };
        Some(BucketParams {
            capacity,
            rate,
            mode,
            part: Some(PartSeed {
                gen_us: self.gen_us,
                until_us: self.until_us,
                tokens: share(self.tokens, k, i),
                outstanding: share(self.outstanding, k, i),
                drop_us: self.drop_us,
            }),
            ..*parent
        })
    }
}
