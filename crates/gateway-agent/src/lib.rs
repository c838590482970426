//! The Leasehold agent that API gateways link.
//!
//! # Layout
//! - [`limiter`]: the `Limiter` gateways call, its hot path, refill driver and failure
//!   handling; [`breaker`]: circuit breakers and bulkheads per shard.
//! - [`counters`]: sharded hot-path counters.
//! - [`headers`]: `RateLimit-Policy`, `RateLimit` and `Retry-After`, for every front end.
//! - [`http`] (feature `tower`, default): the tower `Layer` that answers 429 and 503.
//! - [`telemetry`]: the metrics recorded and their help text; with feature `prometheus`
//!   an exporter the application may install.
//! - The stores, the rules file and the reports come from `leasehold-store`, re-exported
//!   here as [`redis_store`], [`store`], [`rules`] and [`report`].
//!
#![forbid(unsafe_code)]

pub mod breaker;
mod clock;
pub mod counters;
pub mod headers;
#[cfg(feature = "tower")]
pub mod http;
pub mod limiter;
pub mod telemetry;

pub use leasehold_store::redis as redis_store;
pub use leasehold_store::{report, rules};
/// The stores: [`Store`], [`EmbeddedStore`], [`RedisStore`].
pub mod store {
    pub use leasehold_store::{EmbeddedStore, Store};
}

pub use clock::ManualClock;
pub use limiter::{
    Admission, BuildError, Check, CheckError, Decision, Health, Limiter, LimiterBuilder,
    LimiterConfig, RuleRef,
};
pub use redis_store::{ErrorKind, LIBRARY, RedisStore, StoreConfig, StoreError, TlsFiles};
pub use rules::{Overrides, Rules, RulesError, UnknownRule};
pub use store::{EmbeddedStore, Store};
