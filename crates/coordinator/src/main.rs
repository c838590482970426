//! `leasehold-coordinator`: the coordinator on its own (also `leasehold coordinator`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "leasehold-coordinator", about)]
struct Cli {
    #[command(flatten)]
    args: leasehold_coordinator::cli::Args,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let done = rt.block_on(leasehold_coordinator::cli::run(cli.args, async {
        let _ = tokio::signal::ctrl_c().await;
    }));
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
