//! `pdkv explore`: run many seeds of a scenario (in parallel, each run single-threaded and
//! deterministic), stop at the first broken property, shrink it and print how to replay it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pdkv_campaign::explore::{self, Campaign, Faults, Found, Record, Search, Workload};
use pdkv_campaign::Shard;
use pdkv_sim::explore::size;
use pdkv_sim::scenario::Scenario;

use crate::progress::Bar;

const EXAMPLES: &str = "\
Examples:
  pdkv explore 2P_DP8EP:1D_TP8 --seeds 2000 --faults swarm
  pdkv explore 2P_TP8:1D_DP8EP --for 60s --faults swarm
  pdkv explore notify-drift --seeds 100          (finds the leak at once)
  pdkv explore prefill-crash-restart --seeds 10000 --faults swarm --legacy no-incarnation-fence
  pdkv explore notify-drift-fixed --seeds 2000 --faults swarm --jobs 2
  pdkv explore 2P_TP8-1D_DP8EP-h200 --seeds 50 --faults swarm --legacy no-flexible-reads
  pdkv explore 2P_TP8:1D_DP8EP --full-workload --seeds 4
  pdkv explore notify-drift-fixed --seeds 60 --faults swarm --result out/explore.json
  pdkv explore notify-drift-fixed --seeds 60 --faults swarm --shard 0/3 --result out/shard-0.json

Each seed draws a small workload of its own: mostly 2 to 24 requests (one seed in eight sends
the four rounds of the proxy the balance check needs), closed loops of 1 to 8 clients or open
loops from a trickle to a burst, prompts of a few to 4,096 tokens and outputs of 1 to 32, and
a budget of 1,000 events per request (at least 20,000). Protocol bugs come from interleavings
and faults, not from request volume, so a search runs many small seeds. --full-workload (or
--requests/--concurrency) runs the scenario's own workload on every seed instead: for a bare
notation, 1,280 requests of 8K in / 1K out, about a second per seed. --for stops handing out
seeds after a time budget. --legacy NAME switches a historical bug on in every seed, to see
the search find it. On a terminal a bar shows seeds per second and the time left.

Each seed runs the scenario with that seed (and, with --faults swarm, message loss,
duplication, delay and send-queue-full drawn from the seed, and a storm of slow NICs, late
messages, slow listeners and degenerate limits). The properties checked: safety (no read of
freed or foreign memory, no double free), every message reaches a listener, no hang, every
request ends, every prefill block freed by its releases, every failed request failed because
of an injected fault, reads spread over the prefill GPUs about as evenly as the fixed routing
spreads them. The first failing seed is shrunk (fewer requests, shorter prompts, fewer faults,
fewer engines, DP or TP ranks and layers) to a local minimum, where no single reduction still
fails, within --shrink-budget runs, and written as a scenario file; the summary says how many
runs and how long shrinking took, and whether it reached the minimum.

A seed cut by its budget while requests were still in flight (outcome incomplete) has no
verdict on liveness: it was judged on safety only. The summary says how many there were, and
for every outcome but clean names its smallest seeds (10) with the command that replays each:
pdkv run of the seed's scenario file, written to --out (default target/pdkv/explore), which
exits 0 while the seed still ends so. Files shrunk or written from a scenario that names
profiles drop the profiles whose values they no longer hold (a search runs shallower twins of
the model) and write the values out, so they load as they are.

--result FILE writes what the exploration found as JSON that is the same on any machine and
for any --jobs: the smallest failing seed, what it broke and its shrunk scenario, or, when no
seed broke a property, the outcomes, the seeds named with their scenario files, the distinct
behaviours and the events. --shard i/N runs only shard i of N (the seeds whose index is i
modulo N, shards numbered from 0) and needs --result; `pdkv explore-merge` merges the N shard
files into the file the unsharded run writes, byte for byte, so a campaign can run as a Slurm
job array or a Kubernetes Indexed Job (docs/cluster-campaigns.md). --for is a time budget, so
what it runs depends on the machine: it takes neither --shard nor --result.

Exit codes: 0 no seed broke a property (seeds without a verdict are named, not failed); 1 one
did (its seed, the shrunk scenario and the replay command are printed); 2 bad input.
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// Fault injection of an exploration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FaultMode {
    /// Only the scenario's own faults.
    None,
    /// Plus random message loss, duplication, delay and send-queue-full drawn from each seed.
    Swarm,
}

/// Search seeds for runs that break the protocol's safety or liveness properties.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ExploreArgs {
    /// A scenario file, a built-in scenario name, or a deployment notation.
    scenario: String,
    /// Switch on a historical bug (repeatable), on top of the scenario's own: the search then
    /// looks for what it breaks.
    #[arg(long = "legacy", value_name = "NAME", value_parser = crate::routes_cmd::legacy_parser())]
    legacy: Vec<pdkv_core::legacy::Legacy>,
    #[command(flatten)]
    workload: crate::run_cmd::WorkloadArgs,
    /// How many seeds to run (default 1000, or as many as --for allows).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: Option<u64>,
    /// Stop handing out seeds after this long (e.g. 60s, 5m, 1h); the seeds started finish.
    #[arg(long = "for", value_name = "DURATION", value_parser = parse_duration)]
    for_: Option<Duration>,
    /// Run the scenario's own workload (or --requests/--concurrency) on every seed instead of a
    /// small one drawn from the seed.
    #[arg(long)]
    full_workload: bool,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Threads (default: the machine's cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    jobs: Option<u32>,
    /// Faults to add to every seed.
    #[arg(long, value_enum, default_value_t = FaultMode::None)]
    faults: FaultMode,
    /// Runs the shrinker may spend on the first failure (it stops earlier at a local minimum).
    #[arg(long, default_value_t = 300)]
    shrink_budget: usize,
    /// Folder for the scenario files written: the shrunk failure, or the seeds named by outcome
    /// (default target/pdkv/explore).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write what the exploration found to this JSON file (the same on any machine).
    #[arg(long, value_name = "FILE")]
    result: Option<PathBuf>,
    /// Run only shard I of N (seed indexes equal to I modulo N; I from 0 to N-1), for
    /// `pdkv explore-merge`.
    #[arg(long, value_name = "I/N", value_parser = pdkv_campaign::shard::parse, requires = "result")]
    shard: Option<Shard>,
}

/// A duration such as `90s`, `5m`, `1h` or `30` (seconds), at least a millisecond and at most
/// a year.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let value: f64 = number.parse().map_err(|_| format!("`{text}` is not a duration like 90s, 5m or 1h"))?;
    let seconds = match unit {
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("`{text}`: the unit must be ms, s, m or h")),
    };
    if !(1e-3..=365.0 * 86_400.0).contains(&seconds) {
        return Err(format!("`{text}` must be between 1ms and a year"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

pub fn run(args: &ExploreArgs) -> ExitCode {
    if args.for_.is_some() && (args.shard.is_some() || args.result.is_some()) {
        errln!(
            "error: --for is a time budget, so how many seeds it runs depends on the machine and its load; \
             a result file or a shard must be the same wherever it runs: give --seeds instead"
        );
        return ExitCode::from(2);
    }
    // Seeds are `from..from + seeds`; past u64::MAX there are no seeds to run, and exploring none
    // must not look like a success. A time budget without a count runs every seed left.
    let seeds = match (args.seeds, args.for_) {
        (Some(n), _) => n,
        (None, Some(_)) => (u64::MAX - args.from).max(1),
        (None, None) => 1000,
    };
    if args.from.checked_add(seeds).is_none() {
        errln!(
            "error: --from {} --seeds {}: the last seed would be past {} (the largest seed); \
             use --from {} at most",
            args.from,
            seeds,
            u64::MAX,
            u64::MAX - seeds
        );
        return ExitCode::from(2);
    }
    let base = match crate::run_cmd::load(&args.scenario) {
        Ok(mut s) => {
            args.workload.apply(&mut s);
            for &option in &args.legacy {
                if !s.protocol.legacy.contains(&option) {
                    s.protocol.legacy.push(option);
                }
            }
            s
        }
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    if let Err(message) = crate::run_cmd::check_overrides(&base, &args.workload.flags()) {
        errln!("error: {message}");
        return ExitCode::from(2);
    }
    // Explicit workload flags are a workload of the user's own: every seed runs it.
    let small =
        !args.full_workload && args.workload.concurrency.is_none() && args.workload.requests.is_none();
    let swarm = args.faults == FaultMode::Swarm;
    let search = Search::new(&base, swarm, small);
    if let Err(message) = search.check(&base, args.from) {
        errln!("error: {}: {message}", args.scenario);
        return ExitCode::from(2);
    }
    let jobs = args
        .jobs
        .map(|j| j as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let bar = Mutex::new(Bar::new(format!("exploring {}", base.name), Duration::from_millis(500)));
    let started = Instant::now();
    let search = Search { deadline: args.for_.map(|budget| started + budget), ..search };
    let shard = args.shard.unwrap_or(Shard::WHOLE);
    let progress = |p: explore::Progress| {
        // A thread that finds the bar busy skips its update rather than wait.
        let Ok(mut bar) = bar.try_lock() else { return };
        let elapsed = p.started.elapsed();
        let rate = p.done as f64 / elapsed.as_secs_f64().max(1e-9);
        match search.deadline {
            // A time budget: the bar fills with time, and says how many seeds so far.
            Some(deadline) => {
                let budget = deadline.saturating_duration_since(p.started) + Duration::from_millis(1);
                let ms = |d: Duration| d.as_millis().min(u128::from(u64::MAX)) as u64;
                bar.update(
                    ms(elapsed).min(ms(budget)),
                    ms(budget),
                    format!("ms, {} seeds, {rate:.1}/s", p.done),
                );
            }
            None => bar.update(p.done, p.share, format!("seeds, {rate:.1}/s")),
        }
    };
    let found = explore::explore(&base, args.from, seeds, shard, jobs, &search, &progress);
    bar.into_inner().expect("threads ended").finish();
    let seconds = started.elapsed().as_secs_f64();
    let histogram: Vec<String> = pdkv_campaign::names::in_name_order(&found.outcomes)
        .iter()
        .map(|(o, n)| format!("{} {n}", o.name()))
        .collect();
    let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("target/pdkv/explore"));
    let Some((seed, broken)) = found.failure.clone() else {
        // Every seed named is written as a scenario file, so `pdkv run` of it replays the seed.
        let clean = match found.clean(&base, &search) {
            Ok(clean) => clean.expect("no seed broke a property"),
            Err(message) => {
                errln!("error: {message}");
                return ExitCode::from(2);
            }
        };
        // The result file first: it is what a campaign keeps, even if stdout is gone.
        if let Err(message) = write_result(args, &base, seeds, small, Found::Clean(clean.clone())) {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
        let lines = match crate::explore_merge::listed_lines(&clean, &dir) {
            Ok(lines) => lines,
            Err(message) => {
                errln!("error: {message}");
                return ExitCode::from(2);
            }
        };
        outln!(
            "explored {} seeds of {} ({} faults, {}{}) on {jobs} thread{} in {seconds:.1} s ({:.1} seeds/s, \
             {} events, {:.2} M/s): {}; outcomes: {}; {} distinct behaviours",
            found.runs,
            base.name,
            if swarm { "swarm" } else { "scenario" },
            if small { "a small workload per seed" } else { "the full workload" },
            args.shard.map(|s| format!(", shard {s}")).unwrap_or_default(),
            if jobs == 1 { "" } else { "s" },
            found.runs as f64 / seconds.max(1e-9),
            found.events,
            found.events as f64 / seconds.max(1e-9) / 1e6,
            crate::explore_merge::verdict(&found.outcomes),
            histogram.join(", "),
            found.behaviours.len()
        );
        for line in lines {
            outln!("{line}");
        }
        return ExitCode::SUCCESS;
    };
    let names: Vec<&str> = broken.iter().map(|p| p.name()).collect();
    outln!("seed {seed} of {} breaks: {}", base.name, names.join(", "));
    let shrinking = Instant::now();
    let shrunk = match explore::shrink_failure(&base, &search, seed, &broken, args.shrink_budget) {
        Ok(shrunk) => shrunk,
        Err(message) => {
            errln!("error: seed {seed} of {}, shrunk: {message}", base.name);
            return ExitCode::from(2);
        }
    };
    let shrink_seconds = shrinking.elapsed().as_secs_f64();
    let failure = match shrunk.failure(seed, &broken) {
        Ok(failure) => failure,
        Err(message) => {
            errln!("error: seed {seed} of {}, shrunk: {message}", base.name);
            return ExitCode::from(2);
        }
    };
    let file = match failure.shrunk.write_in(&dir) {
        Ok(file) => file,
        Err(message) => {
            errln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    if let Err(message) = write_result(args, &base, seeds, small, Found::Failure(failure)) {
        errln!("error: {message}");
        return ExitCode::from(2);
    }
    let shape = |s: &Scenario| {
        format!("{}, {} layer{}", s.deployment, s.model.layers, if s.model.layers == 1 { "" } else { "s" })
    };
    let minimum = if shrunk.reduced.local_minimum {
        "a local minimum: no single request, fault, engine, DP or TP half or layer less still fails"
    } else {
        "the budget ran out before a local minimum: raise --shrink-budget"
    };
    let small = &shrunk.reduced.scenario;
    outln!(
        "shrunk from size {} ({}) to {} ({}) in {} runs, {shrink_seconds:.1} s ({minimum}); {} seed{} explored \
         before, {seconds:.1} s:",
        size(&shrunk.failing),
        shape(&shrunk.failing),
        size(small),
        shape(small),
        shrunk.reduced.runs,
        found.runs,
        if found.runs == 1 { "" } else { "s" }
    );
    outln!("{}", shrunk.file.text);
    // The file carries the seed, so running it is the whole replay.
    outln!("replay: pdkv run {}", file.display());
    ExitCode::from(1)
}

/// Writes `--result` (if given): the campaign, this run's shard and what it found.
fn write_result(
    args: &ExploreArgs,
    base: &Scenario,
    seeds: u64,
    small: bool,
    found: Found,
) -> Result<(), pdkv_campaign::WriteError> {
    let Some(file) = &args.result else { return Ok(()) };
    let faults = match args.faults {
        FaultMode::None => Faults::None,
        FaultMode::Swarm => Faults::Swarm,
    };
    let workload = if small { Workload::Small } else { Workload::Full };
    let campaign = Campaign::new(base, args.from, seeds, faults, workload, args.shrink_budget as u64);
    Record { campaign, shard: args.shard, found }.write(Path::new(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_or_say_what_is_wrong() {
        let check = |text: &str, expected: Result<f64, &str>| {
            let got = parse_duration(text).map(|d| d.as_secs_f64());
            match (&got, expected) {
                (Ok(s), Ok(want)) => assert!((s - want).abs() < 1e-9, "{text}: {s} != {want}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{text}: {e:?} lacks {want:?}"),
                _ => panic!("{text}: {got:?}, expected {expected:?}"),
            }
        };
        check("60s", Ok(60.0));
        check("60", Ok(60.0));
        check("1.5m", Ok(90.0));
        check("2h", Ok(7200.0));
        check("250ms", Ok(0.25));
        check("0s", Err("between 1ms and a year"));
        check("400d", Err("the unit must be ms, s, m or h"));
        check("9999999h", Err("between 1ms and a year"));
        check("s", Err("is not a duration"));
        check("1..2s", Err("is not a duration"));
        check("", Err("is not a duration"));
    }
}
