//! Where a key's store calls go while its bucket is split: the part this agent uses, and
//! when to read the split again.

use leasehold_core::key::BucketKey;
use leasehold_core::model::Reply;
use leasehold_core::rule::BucketParams;

use super::keys::{Driver, KeyState};
use super::table::RuleEntry;
use leasehold_core::model::Split;

/// The part of a split bucket this agent uses, as the parent last described the split.
#[derive(Debug)]
pub(super) struct Route {
    pub(super) split: Split,
    pub(super) part: u64,
    pub(super) key: BucketKey,
    pub(super) slot: u16,
    pub(super) params: BucketParams,
    /// When the split was read: local clock (ns) and server time (µs).
    pub(super) seen_ns: u64,
    pub(super) seen_server_us: u64,
}

impl Route {
    /// Part `part` of `split` of the bucket `parent` with `params`; `None` when the
    /// part's parameters cannot be represented exactly.
    pub(super) fn new(
        split: Split,
        part: u64,
        parent: &BucketKey,
        params: &BucketParams,
        seen_ns: u64,
        seen_server_us: u64,
    ) -> Option<Self> {
        let part = part % split.parts.max(1);
        let key = parent.part_of(split.salt, part);
        Some(Self {
            params: split.part_params(params, part)?,
            slot: key.slot(),
            key,
            split,
            part,
            seen_ns,
            seen_server_us,
        })
    }

    /// The next part, for an agent whose part had nothing for it: parts without agents
    /// of their own are drained too.
    pub(super) fn next(&self, parent: &BucketKey, params: &BucketParams) -> Option<Self> {
        Self::new(
            self.split,
            self.part + 1,
            parent,
            params,
            self.seen_ns,
            self.seen_server_us,
        )
    }
}

/// A route whose term ends within this long is read again from the parent (at most once
/// a second), so a term the coordinator extends is followed without a gap.
pub(super) const ROUTE_REFRESH_US: u64 = 10_000_000;

/// True when `reply` comes from a part whose split's term ends too soon for a lease.
pub(super) fn term_ending(driver: &Driver, reply: &Reply) -> bool {
    driver.route.is_some() && !reply.moved && reply.ttl_us == 0 && reply.granted == 0
}

/// Where a store call goes: a bucket key, the parameters to send it, and its slot (for
/// the breaker of the shard that serves it).
#[derive(Clone, Copy)]
pub(super) struct Dest<'a> {
    pub(super) key: &'a BucketKey,
    pub(super) params: &'a BucketParams,
    pub(super) slot: u16,
}

/// The bucket calls for `ks` go to now: its own key, or its part of a split.
pub(super) fn dest<'a>(ks: &'a KeyState, driver: &'a Driver, entry: &'a RuleEntry) -> Dest<'a> {
    match &driver.route {
        Some(r) => Dest {
            key: &r.key,
            params: &r.params,
            slot: r.slot,
        },
        None => Dest {
            key: &ks.bucket,
            params: &entry.params,
            slot: ks.slot,
        },
    }
}
