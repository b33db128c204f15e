//! The `pdkv` command line: routing tables, simulation runs; connector commands later.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod routes_cmd;
mod run_cmd;

/// Heterogeneous prefill/decode KV-transfer routing: protocol core, simulator and connector.
#[derive(Parser, Debug)]
#[command(name = "pdkv", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    Routes(routes_cmd::RoutesArgs),
    Run(run_cmd::RunArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Routes(args) => routes_cmd::run(&args),
        Command::Run(args) => run_cmd::run(&args),
    }
}
