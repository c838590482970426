//! The sans-io core of Leasehold.
//!
//! Nothing here performs I/O or reads a clock: time is always a parameter, as in
//! quinn-proto. That is what lets every invariant be tested on a virtual clock, and the
//! same [`model`] be run side by side with the Lua functions on a real Redis.
//!
//! # Layout
//! - [`rate`]: refill rates as exact rationals.
//! - [`rule`]: validated rules (capacity, rate, lease bounds, mode, failure policy).
//! - [`bucket`]: fixed-point token bucket arithmetic (no drift, exact retry times).
//! - [`key`]: Redis keys of buckets, safe against hostile subjects (I7).
//! - [`lease`]: the local lease an agent spends from (I3, I4).
//! - [`cell`]: a key's cell and the local decision (lease, cached denial, refill
//!   denial, seat, store), the one sequence the agent and the fleet tests run.
//! - [`rate_lease`]: rate leases: a share of a bucket's rate and a burst, for a term (the
//!   model; the bound B + r·W with committed rates and bursts).
//! - [`local`]: the local share, seats of every key's budget spent without the store.
//! - [`sizing`]: the agent's lease policy: sizing from demand and share, reported demand,
//!   reclaim.
//! - [`policy`]: the agent's per-key policy as a state machine (demand, sizing, denial
//!   cache, sweep, cold/hot, emergency rate), driven by `gateway-agent` and the fleet tests.
//! - [`model`]: the reference model of the global bucket (I1, I2, I5, I6), the oracle the
//!   Lua must match.
#![forbid(unsafe_code)]

pub mod bucket;
pub mod cell;
pub mod key;
pub mod lease;
pub mod local;
pub mod model;
pub mod policy;
pub mod rate;
pub mod rate_lease;
pub mod rule;
pub mod schema;
pub mod sizing;
mod sync;
pub mod tier;

pub use bucket::{Level, refill_secs, retry_after_secs};
pub use cell::{Around, Cell, DenialKind, Refill, Verdict};
pub use key::{BucketKey, SubjectError, SubjectMatch};
pub use lease::{LocalLease, Spend};
pub use model::{AgentId, GlobalBucket, Op, ProtocolError, Reply, Request, Split};
pub use policy::{
    AcquireArgs, Granted, KeyPolicy, PolicyConfig, SweepAction, Totals, emergency_limit,
};
pub use rate::{MAX_EXACT, Rate, RateError};
pub use rule::{
    BucketParams, FailurePolicy, Leasing, Mode, OverrideSpec, PartSeed, RegionParams, Rule,
    RuleError, RuleName, RuleSpec, Scope,
};
pub use sizing::{LeaseRequest, Reclaim, lease_request, reclaim, scaled};
