//! `pdkv cluster`: starts one connector process per rank on this host and pushes requests
//! through the real protocol, verifying every byte decode reads.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use pdkv_core::ids::{RankId, Role};
use pdkv_core::legacy::{Legacy, LegacyOptions};
use pdkv_core::policy::PeerRules;
use pdkv_rdma::cluster::{self, ClusterConfig, ClusterResult, Fault, Foreign};
use pdkv_rdma::message_faults::{MessageFault, MessageFaultError, Verb};
use pdkv_rdma::sched::TransportKind;

use crate::progress::Bar;

const AFTER_HELP: &str = "\
Examples:
  pdkv cluster 1P_TP4:1D_TP8 --requests 32
  pdkv cluster 2P_TP2:1D_DP2 --mla --requests 64 --json
  pdkv cluster 1P_DP2TP2:1D_TP4 --requests 40 --kill P0.dp0.tp1 --kill-after 6 \\
      --restart-after-ms 1000 --handshake-timeout-ms 2000 --transfer-timeout-ms 5000 --defer-timeout-ms 6000
  pdkv cluster 1P_TP2:1D_TP2 --requests 40 --kill P0.dp0.tp1 --kill-after 1 \\
      --restart-after-ms 300 --hold-dispatches-until-restart --defer-timeout-ms 3000
  pdkv cluster 1P_TP2:1D_TP2 --requests 8 --drop-releases D0.dp0.tp1=2 \\
      --transfer-timeout-ms 2000 --defer-timeout-ms 3000
  pdkv cluster 1P_TP2:1D_TP2 --requests 16 --lose-messages D0.dp0.tp1:release=2 \\
      --duplicate-messages P*.dp*.tp*:handshake-reply,release --transfer-timeout-ms 2000 --defer-timeout-ms 3000
  pdkv cluster 1P_DP2TP2:1D_TP4 --requests 64 --delay-messages P0.dp0.tp*:dispatch:300 \\
      --delay-messages D0.dp0.tp*:release,lease:200@0.5 --seed 7
  pdkv cluster 1P_TP4:1D_TP8 --requests 16 --transport rdma    (build with --features rdma)
  pdkv cluster 1P_DP2TP2:1D_TP2 --foreign-side decode --foreign-driver python3 \\
      --foreign-driver-arg tests/moriio/mixed.py --foreign-driver-arg --vllm-src \\
      --foreign-driver-arg target/vllm-0.33.0/src --foreign-driver-arg --stubs \\
      --foreign-driver-arg tests/moriio/stubs

Every rank is a real `pdkv connector` process on 127.0.0.1 with its handshake and notify
listeners at the ports the core computes; prefill fills each block with a pattern of (request,
layer, block, head) and decode checks every byte it reads. With --json the result object goes
to stdout in the simulator's result schema where it applies (outcome, requests, throughput,
nic, ledger). The timeouts default to a 10 s handshake and MoRIIO's 30 s transfer and 60 s
reaper. A transfer whose releases were dropped is freed by the reaper only once its read
lease (--transfer-timeout-ms, plus 1 s) and --defer-timeout-ms have both passed, so fault runs
set both shorter: with the defaults the --drop-releases example would wait 31 s.

A killed rank's DP group prefills nothing until --restart-after-ms brings it back, but the
requests it prefilled before are dispatched to decode at once, so whether decode reads them
before or after the restart depends on the machine's speed. --hold-dispatches-until-restart
holds the decode dispatch of every request whose KV the group holds (and any a decode group's
scheduler still queues) until the rank is back: its restarted process reported ready, or, for a
foreign rank, the driver said `restarted`. Those requests are then read after the restart,
always; result.requests counts them (held_for_restart) and the dispatches made while the rank
was down (dispatched_while_down, 0 with the hold). Only with --kill and --restart-after-ms, the
restart within --timeout-ms; requests dispatched before the kill and already taken by a decode
rank are not held.

Message faults (each flag repeatable): --lose-messages and --duplicate-messages take
PATTERN[:KINDS][=COUNT][@PROBABILITY], --delay-messages PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY].
PATTERN names ranks as the simulator's fault targets do (P0.dp*.tp1; every message has a prefill
end, so P*.dp*.tp* matches them all), and a message is hit when it is sent by or to a matching
rank. KINDS, separated by commas: handshake-request, handshake-reply (handshake for both),
release, lease, and dispatch: the proxy handing a prefilled request to a decode group, which
counts as sent by the prefill group holding its KV and to every rank of the decode group (it is
never duplicated). Without KINDS a fault hits every message between two ranks, not dispatches.
COUNT caps the messages hit per sending rank (the scheduler sends the dispatches); PROBABILITY
(0.000001 to 1) hits each message with that chance, drawn from --seed, so the same order of
messages is hit the same way. DELAY_MS is 1 to 86400000. For each message the lose flags are
tried first, then the duplicate and the delay flags: a lost message is gone, delays add up.
The sender loses, copies or holds back the bytes its node asked to send and decides nothing
else. --drop-releases RANK=N is --lose-messages RANK:release=N. Every message hit is listed in
the result's faults, and what it can cause is excused (docs/backend.md says what).

With --foreign-side, another connector's code plays every engine of that side through a driver
program (the line protocol is in backend-rdma/src/cluster/foreign.rs): the last example has
vLLM 0.33's own MoRIIO code, extracted from its wheel by `cargo xtask moriio-conformance`, play
the decode side against pdkv's prefill ranks. A foreign prefill side keeps pdkv's data-plane
servers (the driver's listeners hand out their descriptor), so decode still verifies every byte;
--kill of one of its ranks kills the server and has the driver kill the rank's own code, and a
restart starts both afresh. A foreign decode side reports every read its code plans, and the
result's foreign.reads judges each against the prefill process holding the KV: through that
process's live session, stale (an old process's blocks through a restarted one's session), or
through a dead process's session.

Exit codes: 0 the run was clean: no violation, no hang, no request failed unless an injected
fault excuses it, nothing held or reaped unless a fault excuses it, every process accounted for
(docs/backend.md says exactly what a fault excuses); 1 it was not; 2 bad arguments or the
cluster could not start; 130 (SIGINT) or 143 (SIGTERM) when a signal stopped it: the ranks are
shut down and the partial result, outcome interrupted, is still written.
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Rdma,
}

/// Run a real cluster on this host and verify every byte.
#[derive(Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct ClusterArgs {
    /// Deployment notation, e.g. 1P_TP4:1D_TP8.
    deployment: String,
    /// Requests to push through.
    #[arg(long, default_value_t = 32)]
    requests: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: u32,
    /// Requests a decode DP group runs, or waits on, at once; the rest queue (their transfers
    /// leased) until a step has room.
    #[arg(long, default_value_t = 64)]
    decode_max_batch: u32,
    /// Data plane.
    #[arg(long, value_enum, default_value_t = TransportArg::Tcp)]
    transport: TransportArg,
    /// Serve an MLA model (DeepSeek-R1's 576-byte latent, the same on every TP rank; TP1
    /// decode ranks read flexibly) instead of GQA with as many KV heads as the smallest TP size
    /// of the deployment, at most 8 (so heterogeneous TP reads whole heads).
    #[arg(long)]
    mla: bool,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    layers: u16,
    /// Seed of prompt lengths and transfer ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Switch on a historical behaviour (repeatable).
    #[arg(long, value_parser = crate::routes_cmd::legacy_parser())]
    legacy: Vec<Legacy>,
    /// Decode handshake timeout.
    #[arg(long, default_value_t = 10_000)]
    handshake_timeout_ms: u64,
    /// Decode transfer timeout (and read lease).
    #[arg(long, default_value_t = 30_000)]
    transfer_timeout_ms: u64,
    /// The prefill reaper's timeout.
    #[arg(long, default_value_t = 60_000)]
    defer_timeout_ms: u64,
    /// Give up (outcome hang) after this long.
    #[arg(long, default_value_t = 120_000)]
    timeout_ms: u64,
    /// A rank silent this long (connectors send a heartbeat every 500 ms) while pdkv cluster
    /// itself runs is lost: killed and reported as stopped answering. The foreign driver may
    /// leave its input unread twice this long.
    #[arg(long, default_value_t = 5_000)]
    heartbeat_timeout_ms: u64,
    /// Fault: kill this prefill rank's process (e.g. P0.dp0.tp1).
    #[arg(long, value_parser = parse_rank)]
    kill: Option<RankId>,
    /// ... once this many requests have been prefilled.
    #[arg(long, default_value_t = 8, requires = "kill")]
    kill_after: u32,
    /// ... and start it again this long after.
    #[arg(long, requires = "kill")]
    restart_after_ms: Option<u64>,
    /// Fault: hold the decode dispatch of every request whose KV the killed rank's DP group
    /// holds until the rank is back (its restarted process is ready, or a foreign driver said it
    /// restarted), so those requests are read after the restart. Only with --kill and
    /// --restart-after-ms (within --timeout-ms).
    #[arg(long)]
    hold_dispatches_until_restart: bool,
    /// How the prefill ranks take releases and leases: require (a key drawn for the run from
    /// the operating system; one without its MAC is refused, or with a foreign side only one
    /// with a wrong MAC) or open (no key: taken from anyone, as MoRIIO's listener does, to
    /// see what a forger can do). The result's `control` counts what was refused.
    #[arg(long, value_enum, default_value_t = ControlAuthArg::Require)]
    control_auth: ControlAuthArg,
    /// Fault: start a forger outside the deployment that sends, for every transfer as soon as
    /// it is registered, forged releases (each decode rank's sender key, no MAC or a wrong one,
    /// and the legacy string) and 49-day read leases to every prefill notify listener. The
    /// result's `control.forged` says what it sent and how much was refused.
    #[arg(long)]
    forge_messages: bool,
    /// Fault: a decode rank drops its first N releases (RANK=N, e.g. D0.dp0.tp1=2; repeatable);
    /// the same as --lose-messages RANK:release=N.
    #[arg(long, value_parser = parse_drop)]
    drop_releases: Vec<(RankId, u32)>,
    /// Fault: lose the control messages sent by or to the ranks PATTERN matches (repeatable).
    #[arg(long, value_name = "PATTERN[:KINDS][=COUNT][@PROBABILITY]", value_parser = parse_lose)]
    lose_messages: Vec<MessageFault>,
    /// Fault: send those messages twice (repeatable).
    #[arg(long, value_name = "PATTERN[:KINDS][=COUNT][@PROBABILITY]", value_parser = parse_duplicate)]
    duplicate_messages: Vec<MessageFault>,
    /// Fault: send those messages DELAY_MS later (repeatable).
    #[arg(long, value_name = "PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY]", value_parser = parse_delay)]
    delay_messages: Vec<MessageFault>,
    /// Let another connector's code play this whole side, through --foreign-driver (its
    /// engines follow --foreign-rules; a prefill side keeps pdkv data-plane servers).
    #[arg(long, value_enum, requires = "foreign_driver")]
    foreign_side: Option<SideArg>,
    /// The program that plays the foreign side (speaks the line protocol of
    /// backend-rdma/src/cluster/foreign.rs on its standard input and output).
    #[arg(long, requires = "foreign_side")]
    foreign_driver: Option<std::path::PathBuf>,
    /// An argument for the foreign driver (repeatable, in order).
    #[arg(long, allow_hyphen_values = true, requires = "foreign_driver")]
    foreign_driver_arg: Vec<String>,
    /// The rules the foreign side's engines follow.
    #[arg(long, default_value = "vllm-0.33", requires = "foreign_side")]
    foreign_rules: PeerRules,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SideArg {
    Prefill,
    Decode,
}

/// Parses `P0.dp0.tp1` or `D1.dp2.tp3`.
fn parse_rank(text: &str) -> Result<RankId, String> {
    let bad = || format!("'{text}' is not a rank like P0.dp0.tp1 or D0.dp1.tp3");
    let mut parts = text.split('.');
    let (Some(engine), Some(dp), Some(tp), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let number = |s: Option<&str>| s.and_then(|n| n.parse::<u16>().ok()).ok_or_else(bad);
    let index = number(engine.get(1..))?;
    let engine = match engine.chars().next() {
        Some('P') => pdkv_core::ids::EngineId::prefill(index),
        Some('D') => pdkv_core::ids::EngineId::decode(index),
        _ => return Err(bad()),
    };
    let dp = number(dp.strip_prefix("dp"))?;
    let tp = number(tp.strip_prefix("tp"))?;
    Ok(RankId::new(engine, dp, tp))
}

fn parse_lose(text: &str) -> Result<MessageFault, MessageFaultError> {
    MessageFault::parse(Verb::Lose, text)
}

fn parse_duplicate(text: &str) -> Result<MessageFault, MessageFaultError> {
    MessageFault::parse(Verb::Duplicate, text)
}

fn parse_delay(text: &str) -> Result<MessageFault, MessageFaultError> {
    MessageFault::parse(Verb::Delay, text)
}

fn parse_drop(text: &str) -> Result<(RankId, u32), String> {
    let (rank, count) = text.split_once('=').ok_or_else(|| format!("'{text}': expected RANK=N"))?;
    let count = count.parse().map_err(|e| format!("'{text}': count '{count}': {e}"))?;
    Ok((parse_rank(rank)?, count))
}

pub fn run(args: &ClusterArgs) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            errln!("pdkv cluster: cannot find the pdkv executable: {e}");
            return ExitCode::from(2);
        }
    };
    let mut config = ClusterConfig::new(&args.deployment, args.requests, exe);
    config.concurrency = args.concurrency;
    config.decode_max_batch = args.decode_max_batch;
    config.transport = match args.transport {
        TransportArg::Tcp => TransportKind::Tcp,
        TransportArg::Rdma => TransportKind::Rdma,
    };
    config.mla = args.mla;
    config.layers = args.layers;
    config.seed = args.seed;
    config.legacy = args.legacy.iter().fold(LegacyOptions::none(), |l, &o| l.with(o));
    config.timeouts.handshake_ms = args.handshake_timeout_ms;
    config.timeouts.transfer_ms = args.transfer_timeout_ms;
    config.timeouts.defer_ms = args.defer_timeout_ms;
    config.timeout_ms = args.timeout_ms;
    config.heartbeat_timeout_ms = args.heartbeat_timeout_ms;
    config.hold_dispatches_until_restart = args.hold_dispatches_until_restart;
    config.control_auth = match args.control_auth {
        ControlAuthArg::Require => pdkv_rdma::cluster::ControlAuthMode::Require,
        ControlAuthArg::Open => pdkv_rdma::cluster::ControlAuthMode::Open,
    };
    config.forge_messages = args.forge_messages;
    if let Some(rank) = args.kill {
        config.faults.push(Fault::KillPrefill {
            rank,
            after: args.kill_after,
            restart_after_ms: args.restart_after_ms,
        });
    }
    for &(rank, count) in &args.drop_releases {
        config.faults.push(Fault::DropReleases { rank, count });
    }
    // Tried in this order for each message, as the simulator tries a timeline's faults.
    config.messages = [&args.lose_messages, &args.duplicate_messages, &args.delay_messages]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    if let (Some(side), Some(program)) = (args.foreign_side, &args.foreign_driver) {
        config.foreign = Some(Foreign {
            side: match side {
                SideArg::Prefill => Role::Prefill,
                SideArg::Decode => Role::Decode,
            },
            rules: args.foreign_rules,
            program: program.clone(),
            args: args.foreign_driver_arg.clone(),
        });
    }
    // Ctrl-C or a SIGTERM stops the run in order: the ranks shut down and the partial result is
    // still written.
    pdkv_rdma::signals::install();
    config.stop = Some(&pdkv_rdma::signals::CAUGHT);
    let mut bar = Bar::new(format!("cluster {}", args.deployment), Duration::from_millis(500));
    let result = cluster::run(config, &mut |p| bar.update(p.done, p.total, "requests".into()));
    bar.finish();
    match result {
        Ok(result) => {
            if args.json {
                outln!("{}", result.to_json());
            } else {
                out!("{}", render(&result));
            }
            let signal = pdkv_rdma::signals::CAUGHT.load(std::sync::atomic::Ordering::SeqCst);
            if result.outcome == "interrupted" {
                // The shell's convention for a process a signal ended.
                ExitCode::from(128u8.saturating_add(u8::try_from(signal).unwrap_or(0)))
            } else if as_designed(&result) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            errln!("pdkv cluster: {e}");
            ExitCode::from(2)
        }
    }
}

/// Clean (the outcome already excuses what an injected fault was designed to do: failures of
/// the requests it hit and the reaping of their transfers), and every process accounted for.
pub fn as_designed(r: &ClusterResult) -> bool {
    let processes_ok = r.processes.killed_at_shutdown == 0 && r.processes.failed == 0;
    let driver_ok = r.foreign.as_ref().is_none_or(|f| f.killed.is_none());
    processes_ok && driver_ok && r.outcome == "clean"
}

fn render(r: &ClusterResult) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "pdkv cluster {} over {} ({})", r.deployment, r.transport, r.model);
    let _ = writeln!(s, "  outcome        {}", r.outcome);
    let q = &r.requests;
    let _ = writeln!(
        s,
        "  requests       {} sent, {} finished, {} failed ({} excused by faults), {} unfinished in {:.2} s",
        q.sent, q.finished, q.failed, q.failed_excused, q.unfinished, r.duration_s
    );
    let _ = writeln!(
        s,
        "  throughput     {:.0} tok/s ({:.0} output), {:.1} req/s, KV {:.1} MB/s",
        r.throughput.total_tok_s,
        r.throughput.output_tok_s,
        r.throughput.requests_per_s,
        r.throughput.kv_bytes_per_s / 1e6
    );
    let (t, e) = (&r.latency_ms.ttft, &r.latency_ms.e2e);
    // Latencies are over finished requests: without one there is nothing to show but "n/a".
    if q.finished == 0 {
        let _ = writeln!(s, "  latency        n/a (no request finished)");
    } else {
        let _ = writeln!(
            s,
            "  latency        TTFT p50 {:.1} ms, p99 {:.1} ms; end to end p50 {:.1} ms, p99 {:.1} ms",
            t.p50, t.p99, e.p50, e.p99
        );
    }
    let _ = writeln!(s, "  verified       {} KV bytes, byte for byte", r.bytes_verified);
    for memory in &r.memory {
        let _ = writeln!(s, "  prefill KV in  {memory}");
    }
    let gpus = r.nic.prefill_gpus.len();
    let _ = if r.nic.reads_per_prefill_gpu.iter().all(|&reads| reads == 0) {
        writeln!(s, "  reads          Jain n/a: no prefill GPU served a read")
    } else {
        writeln!(s, "  reads          Jain {:.3} over {gpus} prefill GPUs", r.nic.jain)
    };
    for ((gpu, reads), bytes) in
        r.nic.prefill_gpus.iter().zip(&r.nic.reads_per_prefill_gpu).zip(&r.nic.bytes_per_prefill_gpu)
    {
        let _ = writeln!(s, "    {gpu:<12} {reads:>6} reads {:>10.2} MB", *bytes as f64 / 1e6);
    }
    let l = &r.ledger;
    let _ = writeln!(
        s,
        "  ledger         {} freed, {} reaped ({} after faults), {} held, {} fenced, {} double frees",
        l.freed, l.reaped, l.reaped_excused, l.held, l.fenced, l.double_frees
    );
    let p = &r.processes;
    let _ = writeln!(
        s,
        "  processes      {} started, {} exited cleanly, {} killed by faults, {} killed at shutdown, {} failed, \
         {} strangers refused",
        p.started, p.exited_cleanly, p.killed_by_fault, p.killed_at_shutdown, p.failed, p.refused
    );
    if let Some(f) = &r.foreign {
        let stats: Vec<String> =
            f.stats.iter().filter(|(k, _)| !k.contains('.')).map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            s,
            "  foreign        {} side under {} rules: {} requests received, {} transfers finished, \
             {} unexpected finishes; driver: {}",
            f.side,
            f.rules,
            f.received,
            f.finished,
            f.unexpected_finishes,
            if stats.is_empty() { "no counters".to_string() } else { stats.join(", ") }
        );
        let reads = &f.reads;
        if reads.planned > 0 {
            let _ = writeln!(
                s,
                "  foreign reads  {} planned: {} through the holder's live session, {} stale, {} through a \
                 dead process's session, {} unmatched",
                reads.planned, reads.through_holder, reads.stale, reads.through_dead_session, reads.unmatched
            );
            for (pair, lives) in &reads.sessions {
                let lives: Vec<String> = lives.iter().map(u32::to_string).collect();
                let _ =
                    writeln!(s, "  foreign reads  {pair} through the sessions of lives {}", lives.join(", "));
            }
        }
    }
    // Message faults log every message they hit: the first lines and the summary (the last
    // line) say enough here; --json has them all.
    const FAULT_LINES: usize = 20;
    for (i, fault) in r.faults.iter().enumerate() {
        if i < FAULT_LINES || i + 1 == r.faults.len() {
            let _ = writeln!(s, "  fault          {fault}");
        } else if i == FAULT_LINES {
            let more = r.faults.len() - FAULT_LINES - 1;
            let _ = writeln!(s, "  fault          ... {more} more lines (see --json)");
        }
    }
    for f in r.failures.iter().take(10) {
        let _ = writeln!(
            s,
            "  failed         {} ({} on {}): {}",
            f.request,
            f.transfer_id,
            f.prefill,
            f.errors.join("; ")
        );
    }
    let listed = r.failures.len().min(10) as u64;
    if r.requests.failed > listed {
        let _ = writeln!(s, "  failed         ... and {} more (see --json)", r.requests.failed - listed);
    }
    for v in &r.violations {
        let _ = writeln!(s, "  VIOLATION      {}: {}", v.kind, v.detail);
    }
    for p in r.problems.iter().take(10) {
        let _ = writeln!(s, "  note           {p}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_parse_or_say_why() {
        let check = |text: &str, expected: Result<&str, &str>| {
            let got = parse_rank(text).map(|r| r.to_string());
            match expected {
                Ok(e) => assert_eq!(got.as_deref(), Ok(e), "{text}"),
                Err(e) => assert!(got.as_ref().is_err_and(|g| g.contains(e)), "{text}: {got:?}"),
            }
        };
        check("P0.dp0.tp1", Ok("P0.dp0.tp1"));
        check("D1.dp2.tp3", Ok("D1.dp2.tp3"));
        check("X0.dp0.tp1", Err("is not a rank"));
        check("P0.dp0", Err("is not a rank"));
        check("P0.tp0.dp1", Err("is not a rank"));
        assert_eq!(parse_drop("D0.dp0.tp1=2").map(|(r, n)| (r.to_string(), n)), Ok(("D0.dp0.tp1".into(), 2)));
        assert!(parse_drop("D0.dp0.tp1").is_err());
    }
}

/// `--control-auth`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ControlAuthArg {
    /// A key for the run; releases and leases without its MAC are refused.
    Require,
    /// No key; every release and lease is taken.
    Open,
}
