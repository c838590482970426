//! The coordinator on real Redis: accounting against the bound, its admin endpoint, the
//! leader lock, proportional shares, hot-key splits, regions and their brokers.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

#[path = "../support/mod.rs"]
mod support;

mod accounting;
mod admin;
mod lock;
mod regions;
mod shares;
mod split;
