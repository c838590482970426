//! The Leasehold coordinator: watches demand, sizes leases, reclaims unused ones and splits
//! keys too hot for one shard. It is never on the hot path: agents keep every invariant
//! without it.
//!
//! Not built yet; see the coordinator issue. The crate exists so the workspace has the
//! shape of the design and dependencies point one way (`coordinator` -> `gateway-agent` ->
//! `lease-core`).
#![forbid(unsafe_code)]
