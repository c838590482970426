//! `leasehold-coordinator`: the coordinator on its own (also `leasehold coordinator`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "leasehold-coordinator", about)]
struct Cli {
    #[command(flatten)]
    args: leasehold_coordinator::cli::Args,
    /// Log lines as text or JSON (to stderr; RUST_LOG filters, default info).
    #[arg(long, value_enum, default_value = "text", env = "LEASEHOLD_LOG_FORMAT")]
    log_format: leasehold_coordinator::cli::LogFormat,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    leasehold_coordinator::cli::init_logging(cli.log_format, "info");
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let done = rt.block_on(leasehold_coordinator::cli::run(cli.args, async {
        let _ = tokio::signal::ctrl_c().await;
    }));
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
