//! The `leasehold` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use leasehold::agent::Rules;
use leasehold::core::rule::{FailurePolicy, Mode};

#[derive(Parser)]
#[command(
    name = "leasehold",
    version,
    about = "Hierarchical local-plus-global rate limiter with leased budgets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reads a rules file, validates every rule and prints what each one means.
    CheckConfig {
        /// The TOML rules file (`[rules.NAME]` tables).
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::CheckConfig { file } => check_config(&file),
    }
}

fn check_config(file: &PathBuf) -> ExitCode {
    let rules = match Rules::from_file(file) {
        Ok(rules) => rules,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{:<24} {:>10} {:>14} {:>9} {:>9} {:>10}  on failure",
        "rule", "capacity", "rate (tok/s)", "lease max", "lease ttl", "mode"
    );
    for r in rules.iter() {
        let mode = match r.mode() {
            Mode::Strict => "strict".to_owned(),
            Mode::Relaxed { max_outstanding } => format!("relaxed/{max_outstanding}"),
        };
        let failure = match r.failure_policy() {
            FailurePolicy::FailOpen => "fail_open".to_owned(),
            FailurePolicy::FailClosed => "fail_closed (503)".to_owned(),
            FailurePolicy::LocalEmergency { rate: Some(rate) } => {
                format!("local_emergency at {rate}")
            }
            FailurePolicy::LocalEmergency { rate: None } => {
                "local_emergency (last share)".to_owned()
            }
        };
        println!(
            "{:<24} {:>10} {:>14.3} {:>9} {:>9} {:>10}  {}",
            r.name(),
            r.capacity(),
            r.rate().per_sec_f64(),
            r.lease_max(),
            format!("{:?}", r.lease_ttl()),
            mode,
            failure
        );
    }
    println!("{} rule(s) ok", rules.len());
    ExitCode::SUCCESS
}
