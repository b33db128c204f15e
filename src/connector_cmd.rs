//! `pdkv connector`: runs one rank of a deployment as a real process, joined to a cluster's
//! scheduler (started by `pdkv cluster`, which is how it is normally run).

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use pdkv_core::ids::{EngineId, RankId};

const AFTER_HELP: &str = "\
Examples:
  pdkv connector --deployment 1P_TP4:1D_TP8 --role prefill --engine 0 --dp 0 --tp 3 \\
      --scheduler 127.0.0.1:40123

The scheduler (pdkv cluster) tells the rank its model, port bases and timeouts; the rank binds
its handshake and notify listeners at the ports the core computes and serves until told to shut
down. It exits when the scheduler's connection closes.

Exit codes: 0 shut down cleanly; 1 the scheduler went away or a listener could not start;
2 bad arguments (e.g. a rank the deployment does not have).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Prefill,
    Decode,
}

/// Run one rank's connector process.
#[derive(Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct ConnectorArgs {
    /// Deployment notation, e.g. 1P_TP4:1D_TP8.
    #[arg(long)]
    deployment: String,
    /// Which side the rank is on.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// Engine index on that side.
    #[arg(long)]
    engine: u16,
    /// DP rank in the engine.
    #[arg(long)]
    dp: u16,
    /// TP rank in the DP group.
    #[arg(long)]
    tp: u16,
    /// The cluster scheduler's address.
    #[arg(long)]
    scheduler: SocketAddr,
}

pub fn run(args: &ConnectorArgs) -> ExitCode {
    let engine = match args.role {
        RoleArg::Prefill => EngineId::prefill(args.engine),
        RoleArg::Decode => EngineId::decode(args.engine),
    };
    let rank = RankId::new(engine, args.dp, args.tp);
    match pdkv_rdma::connector::run(&args.deployment, rank, args.scheduler) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ pdkv_rdma::connector::ConnectorError::NoSuchRank { .. }) => {
            errln!("pdkv connector: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            errln!("pdkv connector {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}
