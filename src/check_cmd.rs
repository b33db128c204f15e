//! `pdkv check`: bounded model checking of the protocol nodes on a layout and protocol the user
//! names, with the shortest trace to the first violation.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use pdkv_core::legacy::{Legacy, LegacyOptions};
use pdkv_sim::model_check::{
    check_with_progress, ModelConfig, ModelReport, MAX_LOSSES, MAX_REQUESTS, MAX_RESTARTS, MAX_STATES,
    MAX_STEPS,
};

use crate::progress::Bar;

const EXAMPLES: &str = "\
Examples:
  pdkv check 1P_TP2:1D_TP4                          the fixed protocol, one lost message
  pdkv check 1P_TP2:1D_TP2 --restarts 1             a prefill rank crashes and restarts anywhere
  pdkv check 1P_TP2:1D_TP2 --restarts 1 --losses 0 --legacy no-incarnation-fence
  pdkv check 1P_TP2:1D_TP2 --legacy lazy-handshake  finds the TP-group divergence

Explores every interleaving of message deliveries, losses (up to --losses per execution), read
completions and failures, prefill restarts (up to --restarts) and timer firings, breadth first
with state hashing, for the first prefill engine of the deployment and the first DP group of
its first decode engine, with --requests requests (an MLA model, one layer). Each state with
nothing left to do must have: the TP group's step at its forward (no worker raised alone or
stayed blocked), every request received or failed on every worker, every transfer freed exactly
once (by the reaper only after a loss or a late message); and no read may complete from freed
blocks or from a prefill incarnation that never held its transfer. The first violation comes
with the shortest trace to it.

Limits: at most 8 ranks in the prefill engine and in the decode DP group, 4 requests, 3
losses, 2 restarts, 8 steps and 5,000,000 states (each a few kilobytes while queued). The state
space grows about tenfold with each request or loss: 1P_TP2:1D_TP4 with 2 requests and 2
losses is about 10^5 states and a few seconds.

Exit codes: 0 every interleaving explored and none broke a property; 1 a violation was found
(its trace is printed), or the state bound stopped the search before it was complete (no proof);
2 bad input.
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Check every interleaving of the protocol nodes on a tiny deployment.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct CheckArgs {
    /// Deployment notation, e.g. 1P_TP2:1D_TP4 (its first prefill engine and the first DP group of
    /// its first decode engine are modelled).
    notation: String,
    /// Switch on a historical bug (repeatable); docs/legacy.md says what each one breaks.
    #[arg(long = "legacy", value_name = "NAME", value_parser = crate::routes_cmd::legacy_parser())]
    legacy: Vec<Legacy>,
    /// Requests, owned by the prefill DP ranks in turn.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=MAX_REQUESTS))]
    requests: u64,
    /// Messages the network may lose in one execution.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_LOSSES)))]
    losses: u32,
    /// Prefill rank crashes and restarts in one execution.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_RESTARTS)))]
    restarts: u32,
    /// Decode steps at most.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    max_steps: u64,
    /// States to explore at most.
    #[arg(long, default_value_t = 2_000_000, value_parser = clap::value_parser!(u64).range(1..=MAX_STATES as u64))]
    max_states: u64,
    /// Explore every order of deliveries instead of one canonical order (far more states).
    #[arg(long)]
    no_reduction: bool,
}

pub fn run(args: &CheckArgs) -> ExitCode {
    let legacy: LegacyOptions = args.legacy.iter().copied().collect();
    let config = ModelConfig {
        deployment: args.notation.clone(),
        legacy,
        requests: args.requests,
        loss_budget: args.losses,
        max_steps: args.max_steps,
        max_states: args.max_states as usize,
        reduce: !args.no_reduction,
        restarts: args.restarts,
    };
    let mut bar = Bar::new(format!("checking {}", args.notation), Duration::from_millis(500));
    let total = args.max_states;
    let report = check_with_progress(&config, &mut |p| {
        let message = format!("states, {} queued, depth {}", p.queued, p.depth);
        bar.update(p.states as u64, total, message);
    });
    bar.finish();
    let report = match report {
        Ok(report) => report,
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    out!("{}", render(args, &report));
    if report.violation.is_none() && report.complete {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The report as text: what was checked, the size of the search, and the verdict with the trace.
fn render(args: &CheckArgs, report: &ModelReport) -> String {
    let legacy: Vec<&str> = args.legacy.iter().map(|l| l.name()).collect();
    let protocol = if legacy.is_empty() {
        "the fixed protocol".to_string()
    } else {
        format!("legacy {}", legacy.join(" + "))
    };
    let mut out = format!(
        "pdkv check {} ({protocol}; {} requests, losses <= {}, restarts <= {}, steps <= {})\n",
        args.notation, args.requests, args.losses, args.restarts, args.max_steps
    );
    out.push_str(&format!(
        "  searched     {} states, {} transitions, depth {}, {:.2} s{}\n",
        report.states,
        report.transitions,
        report.max_depth,
        report.seconds,
        if report.complete { ", complete" } else { "" }
    ));
    match &report.violation {
        None if report.complete => {
            out.push_str("  verdict      no deadlock, divergence, leak, read after free or stale read in any interleaving\n");
        }
        None => out.push_str(&format!(
            "  verdict      none found in the states explored, but the search stopped at --max-states {}: no proof\n",
            args.max_states
        )),
        Some((what, trace)) => {
            out.push_str(&format!("  VIOLATION    {what}\n  shortest trace ({} steps):\n", trace.len()));
            for (i, line) in trace.iter().enumerate() {
                out.push_str(&format!("    {:>3}. {line}\n", i + 1));
            }
        }
    }
    out
}
