//! Leasehold: a hierarchical local-plus-global rate limiter with leased budgets.
//!
//! This facade re-exports the workspace crates:
//! - [`core`] (`lease-core`): the sans-io rules, bucket arithmetic, local lease and the
//!   reference model of the global bucket.
//! - [`agent`] (`gateway-agent`): what gateways link, starting with the Redis store client
//!   and the rule set.
//! - [`coordinator`]: lease sizing and reclaim (to come).
#![forbid(unsafe_code)]

pub use coordinator;
pub use gateway_agent as agent;
pub use lease_core as core;
