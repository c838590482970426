//! Leasehold: a hierarchical local-plus-global rate limiter with leased budgets.
//!
//! This facade re-exports the workspace crates:
//! - [`core`] (`lease-core`): the sans-io rules, bucket arithmetic, local lease, lease
//!   policy and the reference model of the global bucket.
//! - [`agent`] (`gateway-agent`): what gateways link: the `Limiter`, Redis and embedded
//!   stores, the rule set, the tower layer.
//! - [`coordinator`]: accounting of admitted tokens, hot-key splitting, the admin endpoint.
#![forbid(unsafe_code)]

pub use coordinator;
pub use gateway_agent as agent;
pub use lease_core as core;
