//! The Leasehold agent.
#![forbid(unsafe_code)]
