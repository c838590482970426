//! `leasehold chaos` end to end, small: every fault of the matrix (the example gateway on
//! a primary and replica, through a Sentinel, on a Redis Cluster; `leasehold serve` over
//! gRPC), short floods. Tokens are never minted and no foreign key is written; the full
//! run (`scripts/chaos`) is what the README's table comes from.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_fault_matrix_runs_mints_nothing_and_touches_no_foreign_key() {
    // Cargo builds the examples beside the test binaries.
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_leasehold"));
    let gateway = exe
        .parent()
        .expect("target dir")
        .join("examples")
        .join("gateway");
    assert!(
        gateway.is_file(),
        "{} missing: cargo test builds the examples; run `cargo build --example gateway`",
        gateway.display()
    );
    let out = Command::new(&exe)
        .args([
            "chaos",
            "--flood-keys",
            "3000",
            "--serve-values",
            "3000",
            "--idle",
            "1.5",
            "--hold",
            "0.5",
            "--watch",
            "1.5",
        ])
        .arg("--gateway")
        .arg(&gateway)
        .output()
        .expect("run leasehold chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("app:user:1: unchanged; keys in Redis that are not Leasehold's: 0"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| fault"))
        .collect();
    assert_eq!(rows.len(), 15, "one row per fault: {stdout}");
    assert!(stdout.contains("serve's RSS: "), "{stdout}");
    for r in rows {
        let cells: Vec<&str> = r.split('|').map(str::trim).collect();
        assert_eq!(cells[6], "0", "tokens minted: {r}");
    }
}
