//! The Leasehold agent that API gateways link.
//!
//! # Layout
//! - [`redis_store`]: the client of the global bucket protocol on Redis and Redis Cluster
//!   (function library loading, single-flight reload, idempotent calls).
//! - [`rules`]: the rule set, read from a TOML file and validated.
//! - [`limiter`]: the `Limiter` gateways call, its hot path, refill driver and failure
//!   handling; [`breaker`]: circuit breakers and bulkheads per shard.
//! - [`store`]: Redis or the embedded store; [`counters`]: sharded hot-path counters.
//! - [`http`]: the tower `Layer` that answers 429 and 503.
//! - [`report`]: what agents report to the coordinator every second.
//!
#![forbid(unsafe_code)]

pub mod breaker;
pub mod counters;
pub mod http;
pub mod limiter;
pub mod redis_store;
pub mod report;
pub mod rules;
pub mod store;
#[cfg(feature = "cli")]
pub mod store_args;

pub use limiter::{
    Admission, BuildError, CheckError, Decision, Limiter, LimiterBuilder, LimiterConfig,
};
pub use redis_store::{ErrorKind, LIBRARY, RedisStore, StoreConfig, StoreError, TlsFiles};
pub use rules::{Rules, RulesError, UnknownRule};
pub use store::{EmbeddedStore, Store};
#[cfg(feature = "cli")]
pub use store_args::StoreArgs;
