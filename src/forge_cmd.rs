//! `pdkv forge` (hidden): the forger a `pdkv cluster --forge-messages` run starts outside its
//! deployment, sending forged releases and leases for the transfer ids it reads on stdin.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Args;
use pdkv_core::release::ReleaseSender;

/// Send forged releases and leases to prefill notify listeners (started by `pdkv cluster`).
#[derive(Args, Debug)]
pub struct ForgeArgs {
    /// A prefill notify listener to send to (repeatable).
    #[arg(long, required = true)]
    target: Vec<SocketAddr>,
    /// A decode rank's sender key to forge: <engine id>,<dp>,<tp>,<consumer tp size>
    /// (repeatable).
    #[arg(long, value_parser = pdkv_rdma::cluster::forger::parse_sender)]
    sender: Vec<(ReleaseSender, u16)>,
}

pub fn run(args: &ForgeArgs) -> ExitCode {
    let plan =
        pdkv_rdma::cluster::forger::ForgerPlan { targets: args.target.clone(), senders: args.sender.clone() };
    match pdkv_rdma::cluster::forger::run_forger(&plan, std::io::stdin().lock(), std::io::stdout().lock()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("pdkv forge: {e}");
            ExitCode::FAILURE
        }
    }
}
