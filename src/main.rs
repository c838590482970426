//! The `leasehold` command line.
fn main() {}
