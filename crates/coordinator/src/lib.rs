//! The Leasehold coordinator. It is never on the hot path: agents keep every invariant
//! without it, and everything it knows is in Redis or reported by agents, so it can be
//! restarted at any moment and several can run.
//!
//! # Layout
//! - [`view`]: what one bucket holds, for an operator: tokens, outstanding, each agent's
//!   holding, demand and share of the key's demand. Built from the bucket's own hash
//!   (one key, no keyspace scan).
//! - [`admin`]: the admin endpoint (health, Prometheus metrics, the JSON view of a key),
//!   bound to loopback by default.
//!
//! Demand-aware lease sizing, reclaim and hot-key splitting are still to come; until
//! then agents size their leases from their own measured demand.
#![forbid(unsafe_code)]

pub mod accounting;
pub mod admin;
pub mod cli;
pub mod plan;
pub mod service;
pub mod view;

pub use admin::{Admin, serve};
pub use service::{Coordinator, CoordinatorConfig, KeyStatus, Snapshot};
pub use view::{AgentView, KeyView, SplitView, key_view};
