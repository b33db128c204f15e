//! `pdkv plan`: which layout to deploy on a GPU budget. Parses the arguments, prints the ranked
//! table and writes `--json`; the search, the screen and the runs are `pdkv_campaign::plan`'s.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use clap::Args;
use pdkv_campaign::plan::layouts::MemoryMiss;
use pdkv_campaign::plan::screen::ScreenMiss;
use pdkv_campaign::plan::{self, Load, PlanReport, PlanSpec};
use pdkv_sim::scenario::{Length, Slo};

use crate::progress::Bar;

const EXAMPLES: &str = "\
Examples:
  pdkv plan --gpus 24 --gpu mi300x --nic pollara-400 --model deepseek-r1 \\
            --input 8192 --output 1024 --slo-ttft-ms 2000 --slo-tpot-ms 50
  pdkv plan --gpus 16 --gpu h200-sxm --nic cx7-400g --model llama-3.1-70b \\
            --input 4096 --output 512 --slo-ttft-ms 1000 --slo-tpot-ms 40 --json /tmp/plan.json
  pdkv plan --gpus 32 --gpu mi300x --model deepseek-r1 --input 2048-8192 --slo-tpot-ms 50 --show-rejected

Every layout of at most --gpus GPUs is enumerated: prefill and decode engine counts, each
side's engines TP-only, DPxEP or DPxTP with EP (a mixture-of-experts model), each engine's
weights and one request's KV fitting its GPUs. A screen estimates each one's capacity from the
cost model and the core's routing (prefill tokens/s within the TTFT target, decode tokens/s at
the TPOT target, the busiest prefill NIC's bytes, the all-to-all); the best --top by estimated
goodput per GPU run in the simulator (steady-state window), and the table ranks them by
measured goodput per GPU (requests/s meeting both targets, per GPU), with the bound resource.
Neighbours whose goodput intervals overlap at the calibration's validation median |error|
(profiles/calibration.ron) are printed as not separated: the model cannot rank them.
Profile names are those of `pdkv profiles`. --input and --output take N or MIN-MAX (uniform).

Exit codes: 0 a ranking was printed; 2 bad input (an unknown profile, a budget no layout fits,
an unwritable --json file).";

/// Rank the layouts of a GPU budget by goodput per GPU under SLOs.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct PlanArgs {
    /// GPUs available; a layout uses at most this many.
    #[arg(long)]
    gpus: u32,
    /// GPU profile (pdkv profiles).
    #[arg(long)]
    gpu: String,
    /// NIC profile (pdkv profiles); the built-in NIC values without it.
    #[arg(long)]
    nic: Option<String>,
    /// Model profile (pdkv profiles).
    #[arg(long)]
    model: String,
    /// Serving stack: vllm (the calibration's, the default), sglang or deepseek; sglang and
    /// deepseek overlap a DP+EP step's all-to-alls with its compute.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(pdkv_sim::stack::names()))]
    stack: Option<String>,
    /// Prompt tokens: N, or MIN-MAX for lengths uniform between them.
    #[arg(long, default_value = "8192", value_parser = parse_length)]
    input: Length,
    /// Generated tokens: N, or MIN-MAX.
    #[arg(long, default_value = "1024", value_parser = parse_length)]
    output: Length,
    /// Run every layout as a closed loop of C clients (default: each layout three times, sized
    /// for 0.5, 0.75 and 1 times its screened capacity, the best goodput shown).
    #[arg(long, value_name = "C", conflicts_with = "rate", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    concurrency: Option<u32>,
    /// Run every layout with Poisson arrivals at this many requests per second.
    #[arg(long, value_name = "REQ_PER_S", value_parser = parse_rate)]
    rate: Option<f64>,
    /// Goodput's TTFT target, in milliseconds.
    #[arg(long, value_name = "MS", value_parser = parse_ms)]
    slo_ttft_ms: Option<f64>,
    /// Goodput's TPOT target, in milliseconds.
    #[arg(long, value_name = "MS", value_parser = parse_ms)]
    slo_tpot_ms: Option<f64>,
    /// Layouts run in the simulator after the screen.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Requests per run (default: ten per client, 400 to 4,000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    requests: Option<u32>,
    /// Seed of every run.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Threads running the simulations (default: the machine's cores); the output is the same for any.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    jobs: Option<u32>,
    /// Also write the plan as JSON to FILE (every layout run, the rejected ones by reason).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// List the rejected layouts by reason (how many, the first of them, why), not only the
    /// counts by kind.
    #[arg(long)]
    show_rejected: bool,
}

fn parse_length(text: &str) -> Result<Length, String> {
    let number = |s: &str| {
        s.trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("{s:?} is not a token count of at least 1 (N, or MIN-MAX)"))
    };
    match text.split_once('-') {
        None => number(text).map(Length::Fixed),
        Some((lo, hi)) => {
            let (min, max) = (number(lo)?, number(hi)?);
            if min > max {
                return Err(format!("{text:?}: MIN is above MAX"));
            }
            Ok(if min == max { Length::Fixed(min) } else { Length::Uniform { min, max } })
        }
    }
}

fn parse_positive(text: &str, what: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{text:?} is not a positive number of {what}")),
    }
}

fn parse_ms(text: &str) -> Result<f64, String> {
    parse_positive(text, "milliseconds")
}

fn parse_rate(text: &str) -> Result<f64, String> {
    parse_positive(text, "requests per second")
}

pub fn run(args: &PlanArgs) -> ExitCode {
    let load = match (args.concurrency, args.rate) {
        (Some(c), _) => Load::Concurrency(c),
        (None, Some(rate)) => Load::Rate(rate),
        (None, None) => Load::Auto,
    };
    let spec = PlanSpec {
        gpus: args.gpus,
        gpu: args.gpu.clone(),
        nic: args.nic.clone(),
        model: args.model.clone(),
        stack: args.stack.clone(),
        input: args.input,
        output: args.output,
        load,
        slo: Slo { ttft_ms: args.slo_ttft_ms, tpot_ms: args.slo_tpot_ms },
        top: args.top,
        requests: args.requests,
        seed: args.seed,
        jobs: args
            .jobs
            .map(|j| j as usize)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    // The profiles the plan runs on, against the ones the calibration was fitted on; a spec
    // that cannot make a scenario is refused by plan() below, with its reason.
    if let Ok(base) = plan::base_scenario(&spec) {
        crate::run_cmd::warn_uncovered(&base);
    }
    let bar = Mutex::new(Bar::new("plan", Duration::ZERO));
    let progress = |p: plan::Progress| {
        if let Ok(mut bar) = bar.lock() {
            bar.update(p.done, p.total, format!("running {}", p.layout));
        }
    };
    let report = plan::plan(&spec, &progress);
    bar.into_inner().expect("threads ended").finish();
    let report = match report {
        Ok(report) => report,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    out!("{}", render(&report, args.show_rejected));
    if let Some(file) = &args.json {
        let text = serde_json::to_string_pretty(&report).expect("the plan has string keys only") + "\n";
        if let Err(e) = pdkv_campaign::files::write(file, &text) {
            errln!("error: {e}");
            return ExitCode::from(2);
        }
        outln!("  wrote        {}", file.display());
    }
    ExitCode::SUCCESS
}

/// A rejection's class, as the summary counts them.
fn class(why: &ScreenMiss) -> &'static str {
    match why {
        ScreenMiss::Memory(MemoryMiss::Weights { .. }) => "weights do not fit",
        ScreenMiss::Memory(MemoryMiss::Kv { .. }) => "KV holds no request",
        ScreenMiss::PrefillSlo { .. } => "a lone prompt misses the TTFT target",
        ScreenMiss::DecodeSlo { .. } => "a one-request step misses the TPOT target",
        ScreenMiss::Routing { .. } => "routing refuses the pair",
    }
}

fn ms(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.0}"))
}

/// The plan as the terminal shows it.
pub fn render(r: &PlanReport, show_rejected: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "pdkv plan: {} GPUs, {}; {}; {}", r.gpus, r.profiles, r.workload, r.slo);
    let load = match r.load {
        Load::Auto => "each at 0.5, 0.75 and 1 times its screened capacity, the best shown".to_string(),
        Load::Concurrency(c) => format!("each at C = {c}"),
        Load::Rate(rate) => format!("each at {rate} req/s"),
    };
    let _ = writeln!(
        s,
        "  searched     {} layouts: {} rejected, {} screened; the best {} by estimate run in the simulator ({load})",
        r.enumerated,
        r.rejected.iter().map(|x| x.layouts).sum::<usize>(),
        r.screened,
        r.shortlisted,
    );
    let _ = writeln!(
        s,
        "  {:>4}  {:<26} {:>11} {:>12} {:>10} {:>9} {:>9}  {:<20} run",
        "rank", "layout", "GPUs (P+D)", "goodput/GPU", "tok/s/GPU", "TTFT p90", "TPOT p90", "bound"
    );
    for x in &r.ranked {
        let gpus = format!("{} ({}+{})", x.prefill_gpus + x.decode_gpus, x.prefill_gpus, x.decode_gpus);
        let outcome = if x.outcome == "clean" { String::new() } else { format!(", {}", x.outcome) };
        let _ = writeln!(
            s,
            "  {:>4}  {:<26} {:>11} {:>12.3} {:>10.0} {:>9} {:>9}  {:<20} {}{outcome}",
            format!("#{}", x.rank),
            x.layout,
            gpus,
            x.goodput_per_gpu,
            x.tok_s_per_gpu,
            ms(x.ttft_p90_ms),
            ms(x.tpot_p90_ms),
            x.bound.to_string(),
            plan::clients_text(x.clients),
        );
    }
    let _ = writeln!(s, "  units        goodput/GPU: requests/s meeting the targets per GPU; TTFT and TPOT p90 in ms (steady window)");
    match r.error {
        Some(e) => {
            let band = format!("±{:.0} %", 100.0 * e);
            if r.inseparable.is_empty() {
                let _ = writeln!(s, "  separation   every neighbour separated at {band}");
            }
            for g in &r.inseparable {
                let _ = writeln!(s, "  separation   #{}-#{} not separated at {band}", g.first, g.last);
            }
        }
        None => {
            let _ = writeln!(
                s,
                "  separation   not stated: the calibration's validation error is not yet measured"
            );
        }
    }
    let _ = writeln!(s, "  calibration  {}", r.calibration);
    for (layout, why) in &r.failed {
        let _ = writeln!(s, "  not run      {layout}: {why}");
    }
    let mut classes: BTreeMap<&str, usize> = BTreeMap::new();
    for x in &r.rejected {
        *classes.entry(class(&x.why)).or_default() += x.layouts;
    }
    if !classes.is_empty() {
        let counts: Vec<String> = classes.iter().map(|(c, n)| format!("{n} {c}")).collect();
        let hint = if show_rejected { "" } else { " (--show-rejected lists them by reason)" };
        let _ = writeln!(s, "  rejected     {}{hint}", counts.join(", "));
    }
    if show_rejected {
        for x in &r.rejected {
            let _ = writeln!(s, "    {:>6} like {} ({} GPUs): {}", x.layouts, x.example, x.gpus, x.reason);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (text) -> the length, or the error's words.
    #[test]
    fn lengths_parse_or_say_why() {
        let check = |text: &str, expected: Result<Length, &str>| match (parse_length(text), expected) {
            (Ok(got), Ok(want)) => assert_eq!(got, want, "{text}"),
            (Err(e), Err(want)) => assert!(e.contains(want), "{text}: {e} lacks {want:?}"),
            (got, _) => panic!("{text}: {got:?}, expected {expected:?}"),
        };
        check("8192", Ok(Length::Fixed(8192)));
        check("1024-4096", Ok(Length::Uniform { min: 1024, max: 4096 }));
        check("512-512", Ok(Length::Fixed(512)));
        check("0", Err("\"0\" is not a token count of at least 1"));
        check("4096-1024", Err("MIN is above MAX"));
        check("8k", Err("\"8k\" is not a token count"));
    }
}
