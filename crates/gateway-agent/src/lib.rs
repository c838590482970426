//! The Leasehold agent that API gateways link.
//!
//! # Layout
//! - [`redis_store`]: the client of the global bucket protocol on Redis and Redis Cluster
//!   (function library loading, single-flight reload, idempotent calls).
//! - [`rules`]: the rule set, read from a TOML file and validated.
//!
//! The `Limiter` (local leases, refill driver, failure policy, HTTP layer) builds on it.
#![forbid(unsafe_code)]

pub mod redis_store;
pub mod rules;

pub use redis_store::{LIBRARY, RedisStore, StoreConfig, StoreError};
pub use rules::{Rules, RulesError, UnknownRule};
