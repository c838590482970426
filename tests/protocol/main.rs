//! The protocol: the function library against its model, its invariants (I1-I8) on real
//! Redis (single, primary and replica, Sentinel, a 6-node cluster), hostile callers, and
//! the store's connections (TLS, Sentinel).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod concurrency;
mod differential;
mod failover;
mod hostile;
mod idempotency;
mod keys_and_time;
mod store_tls_sentinel;
