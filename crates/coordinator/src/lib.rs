//! The Leasehold coordinator. It is never on the hot path: agents keep every invariant
//! without it, and everything it knows is in Redis or reported by agents, so it can be
//! restarted at any moment and several can run (one leader acts; its actions are
//! idempotent in the bucket anyway).
//!
//! What needs no view across agents lives where the data is: each bucket computes the
//! proportional share of its agents from the demand they report with their acquires and
//! enforces it while the key is contended (`leasehold_core::model`), and each agent returns
//! leases it is not spending (`leasehold_core::sizing::reclaim`). The coordinator does what
//! needs a view across keys and agents:
//!
//! - [`accounting`]: tokens admitted per key per second from the agents' reports, and
//!   the overshoot against `B + r*W`, exported as metrics;
//! - [`plan`] and [`service`]: splitting a key whose store calls pass a shard's budget
//!   into parts on distinct shards, extending the split while the key stays hot, and
//!   letting it lapse (merge) when it cools;
//! - [`view`] and [`admin`]: the admin endpoint (health, Prometheus metrics, the keys
//!   reported, the JSON view of a bucket), bound to loopback by default;
//! - [`broker`]: in a deployment in regions, the region's broker to the global buckets
//!   (`--region`, `--global-redis`);
//! - [`cli`]: the command line shared by `leasehold-coordinator` and
//!   `leasehold coordinator`.
#![forbid(unsafe_code)]

pub mod accounting;
pub mod admin;
pub mod broker;
pub mod cli;
pub mod plan;
pub mod service;
pub mod view;

pub use admin::{Admin, serve};
pub use service::{Coordinator, CoordinatorConfig, KeyStatus, Running, Snapshot};
pub use view::{AgentView, KeyView, SplitView, key_view};
