//! Where Leasehold's global buckets live, and what agents and the coordinator share.
//!
//! # Layout
//! - [`redis`]: [`RedisStore`], the client of the `leasehold` function library
//!   (`leasehold.lua`, shipped in this crate) on one Redis, a Sentinel-managed primary or
//!   a Redis Cluster, over TLS when asked; single-flight library reload, idempotent calls,
//!   `WAIT` on grants.
//! - [`embedded`]: [`EmbeddedStore`], the reference model in process.
//! - [`Store`]: either, behind one `call`.
//! - [`rules`]: the rule set, read from a TOML file and validated.
//! - [`secret`]: store addresses in errors and logs, with no password.
//! - [`report`]: what agents report to the coordinator every second.
//! - [`wire`]: the arguments, replies and hash fields of the function library.
//! - [`args`] (feature `cli`): the command-line flags that name a store.
#![forbid(unsafe_code)]

#[cfg(feature = "cli")]
pub mod args;
pub mod embedded;
pub mod redis;
pub mod report;
pub mod rules;
pub mod secret;
mod sentinel;
pub mod wire;

use leasehold_core::key::BucketKey;
use leasehold_core::local::SeatReply;
use leasehold_core::model::{AgentId, ExactOutcome, Reply, Request};
use leasehold_core::rule::BucketParams;

#[cfg(feature = "cli")]
pub use args::StoreArgs;
pub use embedded::EmbeddedStore;
pub use redis::{ErrorKind, LIBRARY, RedisStore, StoreConfig, StoreError, TlsFiles};
pub use rules::{Overrides, Rules, RulesError, UnknownRule};
pub use wire::ExactItem;

/// A slot range `start..=end` and the primary that serves it (`host:port`, or
/// `single` for one Redis).
pub type ShardRange = (u16, u16, String);

/// A global bucket store.
#[derive(Clone, Debug)]
pub enum Store {
    /// Redis or Redis Cluster through the `leasehold` function library.
    Redis(RedisStore),
    /// The reference model in this process.
    Embedded(EmbeddedStore),
}

impl Store {
    /// Runs one request on the bucket at `key`.
    pub async fn call(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
    ) -> Result<Reply, StoreError> {
        self.call_replicated(key, params, req, None).await
    }

    /// [`Store::call`], waiting for `replication` on grants (see
    /// [`RedisStore::call_replicated`]); the embedded store has no replicas and ignores it.
    pub async fn call_replicated(
        &self,
        key: &BucketKey,
        params: &BucketParams,
        req: &Request,
        replication: Option<leasehold_core::rule::Replication>,
    ) -> Result<Reply, StoreError> {
        match self {
            Self::Redis(s) => s.call_replicated(key, params, req, replication).await,
            Self::Embedded(s) => s.call(key, params, req),
        }
    }

    /// Runs one exact batch of `agent` with sequence number `seq` (see
    /// [`RedisStore::exact_many`]): one outcome per item, in order.
    pub async fn exact_many(
        &self,
        agent: AgentId,
        seq: u64,
        items: &[ExactItem<'_>],
        first: bool,
    ) -> Result<Vec<ExactOutcome>, StoreError> {
        match self {
            Self::Redis(s) => s.exact_many(agent, seq, items, first).await,
            Self::Embedded(s) => s.exact_many(agent, seq, items),
        }
    }

    /// Claims, renews or gives up `agent`'s seat of `rule`'s local share (see
    /// [`RedisStore::claim_seat`]).
    pub async fn claim_seat(
        &self,
        rule: &str,
        agent: AgentId,
        seats: u64,
        ttl_us: u64,
        leave: bool,
    ) -> Result<SeatReply, StoreError> {
        match self {
            Self::Redis(s) => s.claim_seat(rule, agent, seats, ttl_us, leave).await,
            Self::Embedded(s) => s.claim_seat(rule, agent, seats, ttl_us, leave),
        }
    }

    /// Times the library was loaded (Redis), 0 for the embedded store.
    pub fn library_loads(&self) -> u64 {
        match self {
            Self::Redis(s) => s.library_loads(),
            Self::Embedded(_) => 0,
        }
    }
}
