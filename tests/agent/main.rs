//! The agent (`Limiter`, the tower layer) on the embedded store and on real Redis with
//! faults: decisions, batches, breakers, clusters, eviction, replication, local shares,
//! overrides, shadow mode.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "../support/mod.rs"]
mod support;

mod batches;
mod breaker;
mod cluster;
mod embedded;
mod eviction;
mod http_layer;
mod local_share;
mod overrides;
mod rate_leases;
mod redis;
mod replication;
mod shadow;
