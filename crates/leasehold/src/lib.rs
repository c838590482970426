//! Leasehold: a hierarchical local-plus-global rate limiter with leased budgets.
//!
//! This facade re-exports the workspace crates:
//! - [`core`] (`leasehold-core`): the sans-io rules, bucket arithmetic, local lease,
//!   lease policy and the reference model of the global bucket.
//! - [`store`] (`leasehold-store`): where the global buckets live (Redis, Sentinel,
//!   Cluster, TLS; or in process), the rules file and the agents' reports.
//! - [`agent`] (`leasehold-agent`): what gateways link: the `Limiter` and the tower layer.
//! - [`coordinator`] (`leasehold-coordinator`, feature `coordinator`): accounting of
//!   admitted tokens, hot-key splitting, the admin endpoint.
//! - `serve` (`leasehold-serve`, feature `serve`): the Envoy rate limit service over
//!   gRPC and an HTTP check API, for gateways not written in Rust.
#![forbid(unsafe_code)]

pub use leasehold_agent as agent;
#[cfg(feature = "coordinator")]
pub use leasehold_coordinator as coordinator;
pub use leasehold_core as core;
#[cfg(feature = "serve")]
pub use leasehold_serve as serve;
pub use leasehold_store as store;

// The types a gateway uses, at the top: build a limiter, name its rules, decide.
pub use leasehold_agent::{
    Admission, Check, CheckError, Decision, Limiter, LimiterBuilder, RuleRef, Rules, RulesError,
    Store, StoreConfig, UnknownRule,
};
