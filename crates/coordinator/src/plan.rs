//! When to split a key, into how many parts, and where the parts go. Pure functions of
//! what the coordinator measured; the service applies them.

use std::time::Duration;

use leasehold_core::key::BucketKey;
use leasehold_core::model::{MAX_PARTS, Split};
use leasehold_core::rule::BucketParams;

/// The splitting policy.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SplitPolicy {
    /// A key whose store calls (acquires and exact calls, all agents) exceed this many
    /// per second is split: the per-shard budget of one key.
    pub split_above: f64,
    /// A split key whose calls fall below this many per second is merged: its term is
    /// not extended and lapses.
    pub merge_below: f64,
    /// Each extension sets the end of the term this far ahead. A longer term survives a
    /// longer coordinator outage; a shorter one merges a cooled key sooner.
    pub term: Duration,
}

impl Default for SplitPolicy {
    fn default() -> Self {
        Self {
            split_above: 5_000.0,
            merge_below: 1_250.0,
            term: Duration::from_secs(30),
        }
    }
}

/// What to do with a key this tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing.
    Keep,
    /// Split into this many parts.
    Split(u64),
    /// Push the end of the term in force.
    Extend,
}

/// The step for a key with `calls_per_sec`, split (`Some`) or not, on a store of
/// `shards` primaries. Splitting needs at least two shards: parts on one shard spread
/// nothing.
pub fn step(
    policy: &SplitPolicy,
    calls_per_sec: f64,
    split: Option<&Split>,
    shards: usize,
) -> Step {
    match split {
        Some(_) if calls_per_sec >= policy.merge_below => Step::Extend,
        Some(_) => Step::Keep,
        None if calls_per_sec > policy.split_above && shards >= 2 => {
            Step::Split((shards as u64).min(MAX_PARTS))
        }
        None => Step::Keep,
    }
}

/// A salt that puts the `parts` parts of `key` on distinct shards (`shard_of` maps a slot
/// to its shard), with parameters every part can represent exactly; `None` when no salt
/// in the first thousand does.
pub fn choose_salt(
    key: &BucketKey,
    params: &BucketParams,
    parts: u64,
    shard_of: impl Fn(u16) -> usize,
) -> Option<u64> {
    // Only the number of parts matters to whether the parameters are representable.
    let probe = Split {
        parts,
        salt: 0,
        gen_us: 1,
        until_us: 1,
        tokens: 0,
        outstanding: 0,
        drop_us: 0,
    };
    if (0..parts).any(|i| probe.part_params(params, i).is_none()) {
        return None;
    }
    (0..1000).find(|&salt| {
        let mut shards: Vec<usize> = (0..parts)
            .map(|i| shard_of(key.part_of(salt, i).slot()))
            .collect();
        shards.sort_unstable();
        shards.dedup();
        shards.len() as u64 == parts
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::rule::{Rule, RuleName};

    #[test]
    fn splits_hot_keys_extends_warm_ones_and_lets_cool_ones_lapse() {
        let p = SplitPolicy::default();
        let s = Split {
            parts: 3,
            salt: 0,
            gen_us: 1,
            until_us: 2,
            tokens: 0,
            outstanding: 0,
            drop_us: 0,
        };
        assert_eq!(step(&p, 6000.0, None, 3), Step::Split(3));
        assert_eq!(step(&p, 6000.0, None, 1), Step::Keep);
        assert_eq!(step(&p, 2000.0, None, 3), Step::Keep);
        assert_eq!(step(&p, 2000.0, Some(&s), 3), Step::Extend);
        assert_eq!(step(&p, 100.0, Some(&s), 3), Step::Keep);
    }

    #[test]
    fn parts_land_on_distinct_shards() {
        let rule = Rule::new("api", 1000, "1000/s").unwrap();
        let key = BucketKey::new(&RuleName::new("api").unwrap(), "tenant-1").unwrap();
        let shard_of = |slot: u16| usize::from(slot / 5462);
        let salt = choose_salt(&key, &rule.bucket_params(), 3, shard_of).unwrap();
        let mut shards: Vec<usize> = (0..3)
            .map(|i| shard_of(key.part_of(salt, i).slot()))
            .collect();
        shards.sort_unstable();
        assert_eq!(shards, vec![0, 1, 2]);
        // A capacity smaller than the parts cannot be split.
        let tiny = Rule::new("api", 2, "1/s").unwrap();
        assert_eq!(choose_salt(&key, &tiny.bucket_params(), 3, shard_of), None);
    }
}
