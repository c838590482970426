//! What operators run, from outside: the `leasehold` command (check-config, simulate,
//! chaos), the binaries on a Redis that is down when they start, and the Prometheus
//! exporter.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "../support/mod.rs"]
mod support;

mod agent_metrics;
mod chaos_smoke;
mod cli;
mod grafana;
mod operator_page;
mod ops_binaries;
mod simulate_smoke;
