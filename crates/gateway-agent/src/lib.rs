//! The Leasehold agent that API gateways link.
//!
//! # Layout
//! - `limiter`: the [`Limiter`] gateways call: its hot path, refill driver and failure
//!   handling; `breaker`: circuit breakers and bulkheads per shard; `counters`: sharded
//!   hot-path counters.
//! - [`headers`]: `RateLimit-Policy`, `RateLimit` and `Retry-After`, for every front end.
//! - [`http`] (feature `tower`, default): the tower `Layer` that answers 429 and 503.
//! - [`telemetry`]: the metrics recorded and their help text; with feature `prometheus`
//!   an exporter the application may install.
//!
//! Every public type is at the top of this crate, and only there; the stores and the
//! rules file come from `leasehold-store`.
//!
#![forbid(unsafe_code)]

mod breaker;
mod clock;
mod counters;
pub mod headers;
#[cfg(feature = "tower")]
pub mod http;
mod limiter;
pub mod telemetry;

use leasehold_store::redis as redis_store;
use leasehold_store::{report, rules};
/// The stores, as the crate's modules name them.
mod store {
    pub(crate) use leasehold_store::{EmbeddedStore, Store};
}

pub use breaker::BreakerConfig;
pub use counters::RuleStats;

pub use clock::ManualClock;
pub use leasehold_store::{
    EmbeddedStore, ErrorKind, LIBRARY, Overrides, RedisStore, Rules, RulesError, Store,
    StoreConfig, StoreError, TlsFiles, UnknownRule,
};
pub use limiter::{
    Admission, BuildError, Check, CheckError, Decision, Health, Limiter, LimiterBuilder,
    LimiterConfig, RuleRef,
};
