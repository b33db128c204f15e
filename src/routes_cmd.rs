//! `pdkv routes`: the routing table of a deployment for an operator, as text or JSON.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use pdkv_core::legacy::{Legacy, LegacyOptions};
use pdkv_core::policy::PeerRules;
use pdkv_core::routes::{routes_under, RoutesReport};
use pdkv_core::topology::{Deployment, ModelSpec};
use pdkv_core::write_routes::{write_routes, WriteRoutesReport};

const EXAMPLES: &str = "\
Examples:
  pdkv routes 2P_TP8:1D_DP8EP --mla
  pdkv routes 1P_TP8:1D_TP4 --kv-heads 4 --json
  pdkv routes 2P_DP8EP:1D_TP8 --legacy proxy-aliasing --rounds 4
  pdkv routes 1P_DP8EP:1D_TP8 --rules vllm-0.25
  pdkv routes 2P_TP8:1D_DP8EP --mode write --rules vllm-0.33
  pdkv routes 2P_TP4:1D_TP8 --kv-heads 8 --mode write

Exit codes: 0 table printed; 2 bad notation, bad flags, or a pair the routing rules reject
(with --json, the error is printed as {\"error\": \"...\"}).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Show which decode rank reads which prefill rank, the ports dialled, the release quorum of
/// every prefill rank, and the read count per prefill GPU over rounds of the fixed proxy.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct RoutesArgs {
    /// Deployment notation, e.g. 2P_TP8:1D_DP8EP or 1P_TP4+1P_TP8:1D_TP8.
    notation: String,
    /// MLA model (DeepSeek-R1: one latent replicated on every TP rank). The default.
    #[arg(long, conflicts_with = "kv_heads")]
    mla: bool,
    /// GQA model with this many KV heads (head dimension 128, 80 layers) instead of MLA.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    kv_heads: Option<u16>,
    /// Rounds of the proxy; a round is one request per (prefill slot, decode DP rank) pair.
    #[arg(long, value_name = "R", default_value_t = 16)]
    rounds: u32,
    /// Switch on a historical bug (repeatable); docs/legacy.md says what each one breaks.
    #[arg(long = "legacy", value_name = "NAME", value_parser = legacy_parser())]
    legacy: Vec<Legacy>,
    /// Transfer mode: `read` (decode pulls; the default) or `write` (prefill pushes, vLLM
    /// MoRIIO's default mode): which prefill ranks write which decode ranks and the bytes each
    /// prefill NIC sends.
    #[arg(long, value_enum, default_value_t = Mode::Read)]
    mode: Mode,
    /// The rule set every engine follows: pdkv, or a vLLM release's dialect such as vllm-0.33
    /// (its listeners, release plan and quorum; vllm-0.25 and vllm-0.26 also read DP rank 0 and
    /// never flexibly; in --mode write, who writes a copy several prefill ranks hold).
    #[arg(long, value_name = "RULES", default_value = "pdkv")]
    rules: PeerRules,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// The transfer mode a table is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Decode ranks read the prefill ranks' blocks.
    Read,
    /// Prefill ranks write into the decode ranks' blocks.
    Write,
}

/// A table of either mode.
enum Table {
    Read(RoutesReport),
    Write(WriteRoutesReport),
}

/// Accepts exactly the names of [`Legacy::ALL`], so `--help` and errors list them.
pub fn legacy_parser() -> impl clap::builder::TypedValueParser<Value = Legacy> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(Legacy::ALL.map(Legacy::name))
        .map(|name| name.parse::<Legacy>().expect("possible values are legacy names"))
}

pub fn run(args: &RoutesArgs) -> ExitCode {
    match report(args) {
        Ok(table) => {
            match (&table, args.json) {
                (Table::Read(r), true) => {
                    outln!("{}", serde_json::to_string_pretty(r).expect("report serialises"))
                }
                (Table::Write(r), true) => {
                    outln!("{}", serde_json::to_string_pretty(r).expect("report serialises"))
                }
                (Table::Read(r), false) => out!("{}", render(r)),
                (Table::Write(r), false) => out!("{}", render_writes(r)),
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            if args.json {
                outln!("{}", serde_json::json!({ "error": message }));
            } else {
                errln!("error: {message}");
            }
            ExitCode::from(2)
        }
    }
}

fn report(args: &RoutesArgs) -> Result<Table, String> {
    let model = match args.kv_heads {
        Some(heads) => ModelSpec::gqa(heads),
        None => ModelSpec::deepseek_r1(),
    };
    let deployment = Deployment::parse(&args.notation).map_err(|e| e.to_string())?.with_model(model);
    let legacy: LegacyOptions = args.legacy.iter().copied().collect();
    match args.mode {
        Mode::Read => routes_under(&deployment, &legacy, args.rules, args.rounds)
            .map(Table::Read)
            .map_err(|e| e.to_string()),
        Mode::Write if !legacy.is_empty() => {
            Err("--legacy options are read-mode bugs; --mode write takes --rules instead".to_string())
        }
        Mode::Write => {
            write_routes(&deployment, args.rules, args.rounds).map(Table::Write).map_err(|e| e.to_string())
        }
    }
}

/// The human-readable WRITE table.
pub fn render_writes(r: &WriteRoutesReport) -> String {
    let mut out = String::new();
    let model = if r.use_mla {
        "MLA (KV replicated on every TP rank)".to_string()
    } else {
        format!("GQA, {} KV heads", r.kv_heads)
    };
    let _ = writeln!(out, "pdkv routes {} --mode write", r.deployment);
    let _ = writeln!(out, "  model: {model}");
    let _ = writeln!(out, "  rules: {} (write rule: {})", r.rules, r.write_rule);
    let _ = writeln!(out, "  {} rounds, {} requests through the fixed proxy", r.rounds, r.requests);
    let _ = writeln!(out, "\nWrites (prefill engine -> decode engine, within the request's DP ranks)");
    for p in &r.pairs {
        let map: Vec<String> = p
            .targets_per_prefill_tp_rank
            .iter()
            .enumerate()
            .map(|(tp, targets)| {
                let list: Vec<String> = targets.iter().map(u16::to_string).collect();
                format!("{tp}->[{}]", list.join(","))
            })
            .collect();
        let how = if p.slices_heads { "heads sliced or gathered" } else { "whole blocks" };
        let _ = writeln!(
            out,
            "  {} ({}) -> {} ({}), {how}: prefill TP rank -> decode TP ranks: {}",
            p.prefill_engine,
            p.prefill_layout,
            p.decode_engine,
            p.decode_layout,
            map.join(" ")
        );
        let writers: Vec<String> = p.writers_per_decode_tp_rank.iter().map(u16::to_string).collect();
        let _ = writeln!(out, "      write_done per request, per decode TP rank: [{}]", writers.join(", "));
    }
    // A decode rank fed by more prefill ranks than write it receives a copy they hold alike.
    let copies = r.pairs.iter().any(|p| {
        let (prefill_tp, decode_tp) =
            (p.targets_per_prefill_tp_rank.len(), p.writers_per_decode_tp_rank.len());
        prefill_tp > decode_tp
            && p.writers_per_decode_tp_rank.iter().any(|&w| usize::from(w) < prefill_tp / decode_tp)
    });
    if copies && r.write_rule == "spread-holders" {
        let _ = writeln!(
            out,
            "  a copy several prefill ranks hold is written by the holder its transfer id picks; the\n  \
             map shows the first holder's pick"
        );
    }
    let _ = writeln!(out, "\nPrefill GPUs (totals over all {} requests)", r.requests);
    let _ = writeln!(out, "  {:<14} {:>12} {:>16}", "rank", "writes", "share of bytes");
    let total: u64 = r.prefill_ranks.iter().map(|row| row.bytes_per_token).sum();
    for row in &r.prefill_ranks {
        let share = if total == 0 { 0.0 } else { 100.0 * row.bytes_per_token as f64 / total as f64 };
        let _ = writeln!(out, "  {:<14} {:>12} {:>15.1}%", row.rank, row.writes, share);
    }
    let bytes: Vec<u64> = r.prefill_ranks.iter().map(|row| row.bytes_per_token).collect();
    let (max, min) = extremes(&bytes);
    if let (Some(hi), Some(lo)) = (r.prefill_ranks.get(max), r.prefill_ranks.get(min)) {
        let _ = writeln!(
            out,
            "\nNIC balance: most bytes {} ({} writes), least {} ({} writes), Jain index {:.4}",
            hi.rank, hi.writes, lo.rank, lo.writes, r.jain
        );
    }
    out
}

/// The human-readable table.
pub fn render(r: &RoutesReport) -> String {
    let mut out = String::new();
    let model = if r.use_mla {
        "MLA (KV replicated on every TP rank)".to_string()
    } else {
        format!("GQA, {} KV heads", r.kv_heads)
    };
    let legacy = if r.legacy.is_empty() { "none (fixed protocol)".to_string() } else { r.legacy.join(", ") };
    let _ = writeln!(out, "pdkv routes {}", r.deployment);
    let _ = writeln!(out, "  model: {model}");
    let _ = writeln!(out, "  legacy: {legacy}");
    if r.rules != "pdkv" {
        let _ = writeln!(out, "  rules: {} on every engine", r.rules);
    }
    let _ = writeln!(out, "  {} rounds, {} requests through the fixed proxy", r.rounds, r.requests);
    let _ = writeln!(out, "\nReads (decode engine <- prefill engine, within the request's owner DP rank)");
    for p in &r.pairs {
        let how = if p.flexible {
            let tp = p.quorum_per_tp_rank.len();
            format!("flexible round-robin: k-th read of decode DP rank d -> TP rank (d + k) mod {tp}")
        } else {
            let map: Vec<String> = p.tp_map.iter().enumerate().map(|(d, s)| format!("{d}->{s}")).collect();
            format!("decode TP rank -> prefill TP rank: {}", map.join(" "))
        };
        let _ = writeln!(
            out,
            "  {} ({}) <- {} ({}): {how}",
            p.decode_engine, p.decode_layout, p.prefill_engine, p.prefill_layout
        );
        let quorum: Vec<String> = p.quorum_per_tp_rank.iter().map(u16::to_string).collect();
        let note = if p.flexible { " (on the rank picked; the others complete with it)" } else { "" };
        let _ = writeln!(
            out,
            "      releases per request, per prefill TP rank: [{}]{note}; MoRIIO expects {} on every rank",
            quorum.join(", "),
            p.moriio_expected_releases
        );
    }
    let _ = writeln!(out, "\nPrefill GPUs (listen port; a different dial port means no listener there)");
    // Two kinds of number share the table: what each GPU saw over the whole run, and what it
    // waits for on every request. The header and a sentence say which is which.
    let _ = writeln!(
        out,
        "  reads and requests are totals over all {} requests (a read: one decode rank reads one\n  \
         request's KV); releases are what the GPU waits for on each request it holds",
        r.requests
    );
    let _ = writeln!(
        out,
        "  {:<14} {:>11} {:>13} {:>12} {:>15} {:>21}",
        "rank", "handshake", "notify", "reads total", "requests total", "releases per request"
    );
    for (row, expected) in r.prefill_ranks.iter().zip(&r.expected_releases_per_prefill_rank) {
        let port = |listen: u16, dial: u16| {
            if listen == dial {
                listen.to_string()
            } else {
                format!("{listen}!={dial}")
            }
        };
        let _ = writeln!(
            out,
            "  {:<14} {:>11} {:>13} {:>12} {:>15} {:>21}",
            row.rank,
            port(row.handshake_listen_port, row.handshake_dial_port),
            port(row.notify_listen_port, row.notify_dial_port),
            row.reads,
            row.requests_held,
            expected
        );
    }
    let (max, min) = extremes(&r.reads_per_prefill_gpu);
    if let (Some(hi), Some(lo)) = (r.prefill_ranks.get(max), r.prefill_ranks.get(min)) {
        let _ = writeln!(
            out,
            "\nNIC balance: most-read {} ({} reads), least-read {} ({} reads), Jain index {:.4}",
            hi.rank, hi.reads, lo.rank, lo.reads, r.jain
        );
    }
    for line in &r.port_problems {
        let _ = writeln!(out, "WARNING: {line}");
    }
    out
}

/// The indices of the first largest and the first smallest of `values` (0 and 0 when empty).
fn extremes(values: &[u64]) -> (usize, usize) {
    let (mut max, mut min) = (0, 0);
    for (i, &v) in values.iter().enumerate() {
        if v > values[max] {
            max = i;
        }
        if v < values[min] {
            min = i;
        }
    }
    (max, min)
}
