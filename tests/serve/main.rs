//! `leasehold serve`: Envoy's rate limit service over gRPC, the HTTP API, nginx in front.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "../support/mod.rs"]
mod support;

mod rlqs;
mod rls_and_http;
