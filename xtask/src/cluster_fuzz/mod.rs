//! `cargo xtask cluster-fuzz`: seeded random `pdkv cluster` runs with random faults, each judged
//! by invariants that must hold whatever the faults did.
//!
//! Every run draws, from the project's seeded stream (`pdkv_core::rng`) of the run's own seed,
//! a deployment, a workload, short timeouts and up to a few faults: the cluster's own (`--kill`,
//! `--drop-releases`, `--lose-messages`, `--duplicate-messages`, `--delay-messages`, which it
//! excuses), a forger outside the deployment (`--forge-messages`), a foreign decode driver that
//! misbehaves (stops reading, outstays its goodbye, leaves a process behind), and outside faults
//! that this task delivers itself at a wall-clock moment (SIGKILL of a connector, SIGSTOP of a
//! connector or of `pdkv cluster` itself for a while, then SIGCONT). Run `i` of a
//! fuzz started with `--seed S` has seed `S + i`, so `--seed S+i --max-runs 1` replays it (the
//! outside faults land at the same offsets from the start, though not at the same point of the
//! protocol, since the cluster runs on wall time).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pdkv_core::legacy::Legacy;

mod judge;
mod plan;
mod procs;

use judge::{judge, Figures};
use plan::Plan;
use procs::{execute, Ran};

const USAGE: &str = "\
usage: cargo xtask cluster-fuzz [--for DURATION] [--seed N] [--max-runs N] [--legacy NAME]...

  --for DURATION   start runs for this long (e.g. 90s, 5m, 300; default 60s)
  --seed N         seed of the first run (default: drawn from the clock and printed); run i
                   has seed N+i, so `--seed N+i --max-runs 1` replays run i
  --max-runs N     stop after N runs even if time is left
  --legacy NAME    pass `--legacy NAME` to every `pdkv cluster` (repeatable), to show that the
                   invariants catch a historical bug";

/// A heartbeat is sent every 500 ms and a rank silent this long is lost (docs/backend.md), so
/// SIGSTOPs are drawn on both sides of it.
pub(super) const HEARTBEAT_LOSS_MS: u64 = 5_000;

/// How long past its own `--timeout-ms` a cluster may take to shut down and write its result
/// before this task calls it hung: the shutdown waits for every rank, and a lost rank is found
/// only after the heartbeat limit.
pub(super) const EXIT_GRACE_MS: u64 = 30_000;

/// How long a connector may outlive its cluster: it exits when its scheduler connection closes.
pub(super) const ORPHAN_GRACE: Duration = Duration::from_secs(5);

/// The options of one fuzz.
struct Options {
    budget: Duration,
    seed: u64,
    max_runs: Option<u64>,
    legacy: Vec<String>,
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let mut options =
        Options { budget: Duration::from_secs(60), seed: clock_seed(), max_runs: None, legacy: vec![] };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--for" => options.budget = parse_duration(value()?)?,
            "--seed" => {
                let v = value()?;
                options.seed = v.parse().map_err(|_| format!("--seed {v}: expected a number below 2^64"))?;
            }
            "--max-runs" => {
                let v = value()?;
                let n: u64 = v.parse().map_err(|_| format!("--max-runs {v}: expected a positive number"))?;
                if n == 0 {
                    return Err("--max-runs 0: expected a positive number".into());
                }
                options.max_runs = Some(n);
            }
            "--legacy" => {
                let v = value()?;
                v.parse::<Legacy>().map_err(|e| format!("--legacy {v}: {e}"))?;
                options.legacy.push(v.clone());
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(options)
}

/// `90s`, `5m`, `1500ms` or a plain number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("--for {text}: expected a duration like 90s, 5m, 1500ms or 300");
    let (number, scale_ms) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1_000)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60_000)
    } else if let Some(n) = text.strip_suffix('h') {
        (n, 3_600_000)
    } else {
        (text, 1_000)
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    // A week is far more than anyone runs this for; the bound keeps the arithmetic in range.
    if n == 0 || n.saturating_mul(scale_ms) > 7 * 24 * 3_600_000 {
        return Err(bad());
    }
    Ok(Duration::from_millis(n * scale_ms))
}

fn clock_seed() -> u64 {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    // Keep the printed seed short enough to type.
    (nanos as u64) % 1_000_000_000
}

/// Running totals for the closing summary.
#[derive(Default)]
struct Totals {
    runs: u64,
    deployments: BTreeMap<String, u64>,
    outcomes: BTreeMap<String, u64>,
    faults: BTreeMap<&'static str, u64>,
    requests: u64,
    failed: u64,
    bytes: u128,
}

impl Totals {
    fn add(&mut self, plan: &Plan, ran: &Ran, figures: &Figures) {
        self.runs += 1;
        let name = format!("{}{}", plan.deployment, if plan.mla { " --mla" } else { "" });
        *self.deployments.entry(name).or_default() += 1;
        *self.outcomes.entry(figures.outcome.clone()).or_default() += 1;
        let mut count = |kind: &'static str| *self.faults.entry(kind).or_default() += 1;
        match &plan.kill {
            Some((_, _, Some(_))) => count("--kill with restart"),
            Some((_, _, None)) => count("--kill for good"),
            None => {}
        }
        for _ in &plan.drops {
            count("--drop-releases");
        }
        for (flag, value) in &plan.messages {
            count(flag);
            if value.contains("dispatch") && plan.kill.as_ref().is_some_and(|k| k.2.is_some()) {
                count("restart while dispatches are delayed or lost");
            }
        }
        for d in &ran.delivered {
            count(if d.contains("SIGKILL") {
                "outside SIGKILL"
            } else if d.contains(plan::SCHEDULER) {
                "outside SIGSTOP of pdkv cluster"
            } else {
                "outside SIGSTOP"
            });
        }
        if plan.forge {
            count("--forge-messages");
        }
        if let Some(driver) = plan.driver {
            count(driver.name());
        }
        for _ in &ran.missed {
            count("outside fault missed (no process)");
        }
        if plan.kill.is_none()
            && plan.drops.is_empty()
            && plan.messages.is_empty()
            && ran.delivered.is_empty()
            && !plan.forge
            && plan.driver.is_none()
        {
            count("none (fault-free run)");
        }
        self.requests += figures.sent;
        self.failed += figures.failed;
        self.bytes += u128::from(figures.bytes);
    }

    fn print(&self, elapsed: Duration) {
        println!("cluster-fuzz: {} runs in {:.0} s, all invariants held", self.runs, elapsed.as_secs_f64());
        println!(
            "  requests       {} sent, {} failed (all excused or after outside faults)",
            self.requests, self.failed
        );
        println!("  verified       {} KV bytes, byte for byte", self.bytes);
        println!("  deployments");
        for (d, n) in &self.deployments {
            println!("    {d:<26} {n}");
        }
        println!("  outcomes");
        for (o, n) in &self.outcomes {
            println!("    {o:<26} {n}");
        }
        println!("  faults");
        for (f, n) in &self.faults {
            println!("    {f:<34} {n}");
        }
    }
}

pub fn run(args: &[String], root: &Path) -> ExitCode {
    let options = match parse_options(args) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("cluster-fuzz: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if !crate::cargo(&["build", "--release", "--quiet", "--package", "pdkv"], &[]) {
        return ExitCode::FAILURE;
    }
    let target = crate::target_dir(root);
    let exe = target.join("release/pdkv");
    let dir = target.join("cluster-fuzz");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cluster-fuzz: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let legacy: String = options.legacy.iter().map(|l| format!(" --legacy {l}")).collect();
    println!(
        "cluster-fuzz: seed {}, for {} s{}{}",
        options.seed,
        options.budget.as_secs(),
        options.max_runs.map(|n| format!(", at most {n} runs")).unwrap_or_default(),
        legacy
    );
    let started = Instant::now();
    let mut totals = Totals::default();
    for i in 0.. {
        let elapsed = started.elapsed();
        if elapsed >= options.budget || options.max_runs.is_some_and(|n| i >= n) {
            break;
        }
        let seed = options.seed.wrapping_add(i);
        let plan = Plan::draw(seed, &options.legacy);
        let left = options.budget.saturating_sub(elapsed).as_secs();
        print!("[run {:>4}, {left:>4} s left] seed {seed}: {} ... ", i + 1, plan.brief());
        let _ = std::io::Write::flush(&mut std::io::stdout());
        let ran = match execute(&plan, &exe, &dir) {
            Ok(ran) => ran,
            Err(e) => {
                println!();
                eprintln!("cluster-fuzz: {e}");
                return ExitCode::FAILURE;
            }
        };
        match judge(&plan, &ran) {
            Ok(figures) => {
                let missed = if ran.missed.is_empty() {
                    String::new()
                } else {
                    format!(", {} fault(s) missed", ran.missed.len())
                };
                println!(
                    "{}, exit {} ({}/{} failed, {:.1} s{missed})",
                    figures.outcome, figures.exit, figures.failed, figures.sent, ran.seconds
                );
                totals.add(&plan, &ran, &figures);
            }
            Err(problems) => {
                println!("FAILED");
                report_failure(&options, &plan, &ran, &problems, &exe, &dir, started.elapsed());
                return ExitCode::FAILURE;
            }
        }
    }
    totals.print(started.elapsed());
    ExitCode::SUCCESS
}

fn report_failure(
    options: &Options,
    plan: &Plan,
    ran: &Ran,
    problems: &[String],
    exe: &Path,
    dir: &Path,
    elapsed: Duration,
) {
    let json = dir.join(format!("seed-{}.json", plan.seed));
    let stderr = dir.join(format!("seed-{}.stderr", plan.seed));
    let _ = std::fs::write(&json, &ran.stdout);
    let _ = std::fs::write(&stderr, &ran.stderr);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "cluster-fuzz: run with seed {} broke an invariant after {:.0} s:",
        plan.seed,
        elapsed.as_secs_f64()
    );
    for p in problems {
        let _ = writeln!(s, "  - {p}");
    }
    let _ = writeln!(s, "command:\n  {}", plan.command_line(exe));
    if ran.delivered.is_empty() && ran.missed.is_empty() && ran.not_due.is_empty() {
        let _ = writeln!(s, "outside faults: none");
    } else {
        let _ = writeln!(s, "outside faults (offsets from the start of pdkv cluster):");
        for d in ran.delivered.iter().chain(&ran.missed).chain(&ran.not_due) {
            let _ = writeln!(s, "  {d}");
        }
    }
    if !ran.ends.is_empty() {
        let _ = writeln!(s, "connectors that ended during the run, as their zombies showed:");
        for e in &ran.ends {
            let _ = writeln!(s, "  {e}");
        }
    }
    let legacy: String = options.legacy.iter().map(|l| format!(" --legacy {l}")).collect();
    let _ = writeln!(s, "replay:\n  cargo xtask cluster-fuzz --seed {} --max-runs 1{legacy}", plan.seed);
    let _ = writeln!(s, "saved:\n  {}\n  {}", json.display(), stderr.display());
    let _ = std::fs::write(dir.join(format!("seed-{}.txt", plan.seed)), &s);
    eprint!("{s}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_or_say_why() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("20"), Ok(Duration::from_secs(20)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("99999999h").is_err());
    }

    #[test]
    fn plans_are_a_function_of_the_seed_and_valid() {
        for seed in 0..500 {
            let (a, b) = (Plan::draw(seed, &[]), Plan::draw(seed, &[]));
            assert_eq!(a.args(), b.args());
            assert!((1..=256).contains(&a.requests) && (1..=256).contains(&a.concurrency));
            if let Some((_, after, _)) = &a.kill {
                assert!(*after < a.requests, "seed {seed}: --kill-after must be below --requests");
            }
            assert!(a.handshake_ms < a.transfer_ms && a.transfer_ms < a.defer_ms);
            if a.driver.is_some() {
                // A misbehaving driver is the run's only fault.
                assert!(a.kill.is_none() && a.drops.is_empty() && a.messages.is_empty(), "seed {seed}");
                assert!(a.outside.is_empty() && !a.forge, "seed {seed}");
            }
        }
        // Each new kind of fault is drawn.
        let plans: Vec<Plan> = (0..500).map(|seed| Plan::draw(seed, &[])).collect();
        assert!(plans.iter().any(|p| p.forge));
        assert!(plans.iter().any(|p| p.outside.iter().any(|o| o.rank == plan::SCHEDULER)));
        for kind in [
            plan::Misbehaviour::StopsReading,
            plan::Misbehaviour::OutstaysBye,
            plan::Misbehaviour::LeavesChild,
        ] {
            assert!(plans.iter().any(|p| p.driver.is_some_and(|d| d.kind == kind)));
        }
    }

    /// Every message fault drawn is one `pdkv cluster` takes (its own parser and deployment
    /// check), leases and dispatches are delayed at most a transfer timeout past the reaper,
    /// some of them past it, and the draws include a restart while dispatches are delayed.
    #[test]
    fn message_faults_drawn_are_valid_and_some_come_after_the_reaper() {
        use pdkv_rdma::message_faults::{MessageAction, MessageFault, MessageKind, Verb};
        let mut restarts_with_late_dispatches = 0;
        let (mut drawn, mut after_the_reaper) = (0, 0);
        for seed in 0..2000 {
            let plan = Plan::draw(seed, &[]);
            let d = pdkv_core::topology::Deployment::parse(plan.deployment).expect("parses");
            let most = plan.defer_ms + plan.transfer_ms;
            for (flag, value) in &plan.messages {
                drawn += 1;
                let verb = [Verb::Lose, Verb::Duplicate, Verb::Delay]
                    .into_iter()
                    .find(|v| v.flag() == *flag)
                    .expect("a message-fault flag");
                let fault = MessageFault::parse(verb, value)
                    .unwrap_or_else(|e| panic!("seed {seed}: {flag} {value}: {e}"));
                assert_eq!(fault.check(&d), Ok(()), "seed {seed}: {flag} {value}");
                if let MessageAction::Delay { delay_ms } = fault.action {
                    let late =
                        fault.kinds().iter().any(|k| matches!(k, MessageKind::Lease | MessageKind::Dispatch));
                    assert!(!late || delay_ms <= most, "seed {seed}: {flag} {value} past {most} ms");
                    if late && delay_ms > plan.defer_ms {
                        after_the_reaper += 1;
                    }
                }
                // A fault that can cost time is bounded: by a count, or by what all the
                // dispatches of the run being late add up to.
                let rounds = plan.requests.div_ceil(plan.concurrency);
                match fault.action {
                    MessageAction::Duplicate => {}
                    MessageAction::Delay { delay_ms } if fault.count.is_none() => {
                        assert_eq!(fault.kinds(), [MessageKind::Dispatch], "seed {seed}: {flag} {value}");
                        assert!(rounds * delay_ms <= plan::LATE_DISPATCHES_MS, "seed {seed}: {flag} {value}");
                    }
                    _ => assert!(fault.count.is_some(), "seed {seed}: {flag} {value} needs a count"),
                }
                let restarted = plan.kill.as_ref().is_some_and(|k| k.2.is_some());
                if restarted && fault.kinds().contains(&MessageKind::Dispatch) && verb == Verb::Delay {
                    restarts_with_late_dispatches += 1;
                }
            }
        }
        assert!(drawn > 500, "{drawn} message faults in 2000 plans");
        assert!(restarts_with_late_dispatches > 50, "{restarts_with_late_dispatches}");
        assert!(after_the_reaper > 20, "{after_the_reaper} delays past the reaper");
    }

    #[test]
    fn options_reject_bad_input() {
        let parse = |a: &[&str]| parse_options(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(parse(&["--for"]).is_err());
        assert!(parse(&["--seed", "x"]).is_err());
        assert!(parse(&["--max-runs", "0"]).is_err());
        assert!(parse(&["--legacy", "nope"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        let o = parse(&["--seed", "7", "--for", "2m", "--legacy", "release-during-reads"]).expect("valid");
        assert_eq!((o.seed, o.budget, o.legacy.len()), (7, Duration::from_secs(120), 1));
    }
}
