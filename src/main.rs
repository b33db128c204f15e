//! The `pdkv` command line: routing tables, simulation runs, sweeps and replays, and the real
//! connector processes and clusters.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc instead of the system allocator: a simulation allocates and frees small objects
/// (messages, events, per-request state) at a high rate, and glibc's malloc and free took about
/// a quarter of an exploration's time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[macro_use]
mod output;

mod builtin;
mod check_cmd;
mod cluster_cmd;
mod connector_cmd;
mod explore_cmd;
mod explore_merge;
mod forge_cmd;
mod plan_cmd;
mod profiles_cmd;
mod progress;
mod replay_cmd;
mod routes_cmd;
mod run_cmd;
mod scenarios_cmd;
mod sweep_cmd;
mod sweep_merge;
mod trace_files;

const EXAMPLES: &str = "\
Examples:
  pdkv run 2P_TP8:1D_DP8EP                    simulate the mixed deployment, write its report
  pdkv scenarios                              list the built-in scenarios
  pdkv profiles                               GPU, NIC and model profiles a scenario can name
  pdkv run lazy-handshake-delayed-reply       reproduce a historical hang
  pdkv sweep 2P_TP8:1D_TP8 2P_TP8:1D_DP8EP --concurrency 32,128,512
  pdkv replay target/pdkv/2P_TP8-1D_DP8EP_C128-x1280-8K-1K/result.json
  pdkv explore notify-drift-fixed --seeds 2000 --faults swarm    search seeds for bugs
  pdkv check 1P_TP2:1D_TP2 --restarts 1      every interleaving of a tiny deployment
  pdkv routes 2P_TP8:1D_DP8EP --json          who reads whom, ports, quorums
  pdkv plan --gpus 24 --gpu mi300x --model deepseek-r1 --slo-ttft-ms 2000 --slo-tpot-ms 50
  pdkv cluster 1P_TP4:1D_TP8 --requests 32    real processes on 127.0.0.1, every byte verified

Each command's --help has its own examples and exit codes.";

/// Heterogeneous prefill/decode KV-transfer routing: protocol core, simulator and connector.
#[derive(Parser, Debug)]
#[command(name = "pdkv", version, about, long_about = None, after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    Run(run_cmd::RunArgs),
    Sweep(sweep_cmd::SweepArgs),
    SweepMerge(sweep_merge::SweepMergeArgs),
    Scenarios(scenarios_cmd::ScenariosArgs),
    Profiles(profiles_cmd::ProfilesArgs),
    Replay(replay_cmd::ReplayArgs),
    Explore(explore_cmd::ExploreArgs),
    Check(check_cmd::CheckArgs),
    ExploreMerge(explore_merge::ExploreMergeArgs),
    Plan(plan_cmd::PlanArgs),
    Routes(routes_cmd::RoutesArgs),
    Cluster(cluster_cmd::ClusterArgs),
    Connector(connector_cmd::ConnectorArgs),
    #[command(hide = true)]
    Forge(forge_cmd::ForgeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run_cmd::run(&args),
        Command::Sweep(args) => sweep_cmd::run(&args),
        Command::SweepMerge(args) => sweep_merge::run(&args),
        Command::Scenarios(args) => scenarios_cmd::run(&args),
        Command::Profiles(args) => profiles_cmd::run(&args),
        Command::Replay(args) => replay_cmd::run(&args),
        Command::Explore(args) => explore_cmd::run(&args),
        Command::Check(args) => check_cmd::run(&args),
        Command::ExploreMerge(args) => explore_merge::run(&args),
        Command::Plan(args) => plan_cmd::run(&args),
        Command::Routes(args) => routes_cmd::run(&args),
        Command::Cluster(args) => cluster_cmd::run(&args),
        Command::Connector(args) => connector_cmd::run(&args),
        Command::Forge(args) => forge_cmd::run(&args),
    }
}
