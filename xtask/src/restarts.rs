//! `cargo xtask cluster-restarts`: real clusters (`pdkv cluster`, release build) in which a
//! prefill rank is killed under load and restarted after 0 ms to 3 s, on two deployments, each
//! run judged: no wrong byte, no protocol error, every failure and reaping excused by the kill,
//! nothing held at the end. Prints one line per run and the totals.

use std::path::Path;
use std::process::{Command, ExitCode};

const USAGE: &str = "usage: cargo xtask cluster-restarts [--runs N] [--legacy NAME]

  --runs N       runs per deployment (default 20)
  --legacy NAME  pass `--legacy NAME` to every run (to show what the judgement catches)";

/// The deployments: a DP x TP prefill read by a wider TP decode (fixed mapping), and two TP2
/// prefill engines read by TP1 decode ranks of an MLA model (flexible reads). Each with the rank
/// to kill and its extra flags.
const DEPLOYMENTS: [(&str, &str, &[&str]); 2] =
    [("1P_DP2TP2:1D_TP4", "P0.dp0.tp1", &[]), ("2P_TP2:1D_DP2", "P0.dp0.tp0", &["--mla"])];

/// Restart delays, in turn.
const DELAYS_MS: [u64; 8] = [0, 0, 50, 200, 500, 1000, 2000, 3000];

/// Requests per run and in flight.
const REQUESTS: u32 = 2000;
const CONCURRENCY: u32 = 256;

/// What one run showed, from its JSON result.
#[derive(Default, Clone, Copy)]
struct Figures {
    sent: u64,
    finished: u64,
    failed: u64,
    failed_excused: u64,
    reaped: u64,
    reaped_excused: u64,
    held: u64,
    violations: u64,
    bytes_verified: u64,
}

impl Figures {
    fn add(&mut self, other: Figures) {
        self.sent += other.sent;
        self.finished += other.finished;
        self.failed += other.failed;
        self.failed_excused += other.failed_excused;
        self.reaped += other.reaped;
        self.reaped_excused += other.reaped_excused;
        self.held += other.held;
        self.violations += other.violations;
        self.bytes_verified += other.bytes_verified;
    }
}

/// The number at `path` (object keys) of a JSON value, or 0.
fn number(json: &serde_json::Value, path: &[&str]) -> u64 {
    path.iter().fold(json, |v, key| &v[key]).as_u64().unwrap_or(0)
}

/// The run's figures and what is wrong with it, if anything.
fn judge(json: &serde_json::Value) -> (Figures, Vec<String>) {
    let f = Figures {
        sent: number(json, &["requests", "sent"]),
        finished: number(json, &["requests", "finished"]),
        failed: number(json, &["requests", "failed"]),
        failed_excused: number(json, &["requests", "failed_excused"]),
        reaped: number(json, &["ledger", "reaped"]),
        reaped_excused: number(json, &["ledger", "reaped_excused"]),
        held: number(json, &["ledger", "held"]),
        violations: json["violations"].as_array().map_or(0, |v| v.len() as u64),
        bytes_verified: number(json, &["bytes_verified"]),
    };
    let mut wrong = Vec::new();
    let outcome = json["outcome"].as_str().unwrap_or("no outcome");
    if outcome != "clean" {
        wrong.push(format!("outcome {outcome}"));
    }
    if f.violations > 0 {
        let first = json["violations"][0]["detail"].as_str().unwrap_or("").to_string();
        wrong.push(format!("{} violations, the first: {first}", f.violations));
    }
    if f.failed != f.failed_excused {
        wrong.push(format!(
            "{} of {} failures not excused by the kill",
            f.failed - f.failed_excused,
            f.failed
        ));
    }
    if f.reaped != f.reaped_excused {
        wrong.push(format!(
            "{} of {} reapings not excused by the kill",
            f.reaped - f.reaped_excused,
            f.reaped
        ));
    }
    if f.held > 0 {
        wrong.push(format!("{} transfers still held", f.held));
    }
    if number(json, &["ledger", "double_frees"]) > 0 || number(json, &["requests", "unfinished"]) > 0 {
        wrong.push("double frees or unfinished requests".into());
    }
    if f.bytes_verified == 0 {
        wrong.push("no byte verified".into());
    }
    let restarted = json["faults"]
        .as_array()
        .is_some_and(|log| log.iter().any(|line| line.as_str().is_some_and(|l| l.contains("restarted"))));
    if !restarted {
        wrong.push("the killed rank did not restart".into());
    }
    let problems = json["problems"].as_array().cloned().unwrap_or_default();
    for problem in problems.iter().filter_map(|p| p.as_str()) {
        if problem.contains("is not registered") || problem.contains("protocol") {
            wrong.push(format!("protocol error: {problem}"));
        }
    }
    (f, wrong)
}

fn parse(args: &[String]) -> Result<(u32, Vec<String>), String> {
    let (mut runs, mut legacy) = (20u32, Vec::new());
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--runs" => {
                runs = value
                    .parse()
                    .ok()
                    .filter(|&n| (1..=1000).contains(&n))
                    .ok_or_else(|| format!("--runs {value}: expected a number from 1 to 1000"))?
            }
            "--legacy" => legacy.push(value.clone()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok((runs, legacy))
}

pub fn run(args: &[String], root: &Path) -> ExitCode {
    let (runs, legacy) = match parse(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if !crate::cargo(&["build", "--release", "--quiet", "--package", "pdkv", "--bin", "pdkv"], &[]) {
        return ExitCode::FAILURE;
    }
    let pdkv = crate::target_dir(root).join("release/pdkv");
    let mut bad = 0;
    for (deployment, rank, extra) in DEPLOYMENTS {
        let mut total = Figures::default();
        for i in 0..runs {
            let delay = DELAYS_MS[i as usize % DELAYS_MS.len()];
            // Kill after 20 to 919 prefills, spread over the run.
            let after = 20 + (u64::from(i) * 97) % 900;
            let seed = 100 + u64::from(i);
            let mut cmd = Command::new(&pdkv);
            cmd.args(["cluster", deployment]).args(extra);
            let numbers = [
                ("--requests", REQUESTS.to_string()),
                ("--concurrency", CONCURRENCY.to_string()),
                ("--seed", seed.to_string()),
                ("--kill-after", after.to_string()),
                ("--restart-after-ms", delay.to_string()),
                ("--handshake-timeout-ms", "2000".into()),
                ("--transfer-timeout-ms", "5000".into()),
                ("--defer-timeout-ms", "6000".into()),
                ("--timeout-ms", "90000".into()),
            ];
            cmd.args(["--kill", rank]);
            for (flag, value) in &numbers {
                cmd.args([*flag, value.as_str()]);
            }
            for name in &legacy {
                cmd.args(["--legacy", name]);
            }
            cmd.arg("--json");
            let line: Vec<String> = std::iter::once("pdkv".to_string())
                .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
                .collect();
            let output = match cmd.output() {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("cannot run {}: {e}", pdkv.display());
                    return ExitCode::FAILURE;
                }
            };
            let json: serde_json::Value = match serde_json::from_slice(&output.stdout) {
                Ok(j) => j,
                Err(e) => {
                    println!("{deployment} run {i}: no JSON result ({e}); replay: {}", line.join(" "));
                    bad += 1;
                    continue;
                }
            };
            let (figures, wrong) = judge(&json);
            total.add(figures);
            println!(
                "{deployment} run {i:>2}: kill {rank} after {after:>3} prefills, restart after {delay:>4} ms: {} finished, {} failed ({} excused), {} reaped ({} excused), {} held, {} violations, {} MB verified{}",
                figures.finished,
                figures.failed,
                figures.failed_excused,
                figures.reaped,
                figures.reaped_excused,
                figures.held,
                figures.violations,
                figures.bytes_verified >> 20,
                if wrong.is_empty() { String::new() } else { format!("\n    WRONG: {}\n    replay: {}", wrong.join("; "), line.join(" ")) }
            );
            if !wrong.is_empty() {
                bad += 1;
            }
        }
        println!(
            "{deployment}: {runs} runs, {} requests, {} finished, {} failed ({} excused), {} reaped ({} excused), {} held, {} violations (wrong bytes included), {} MB verified",
            total.sent,
            total.finished,
            total.failed,
            total.failed_excused,
            total.reaped,
            total.reaped_excused,
            total.held,
            total.violations,
            total.bytes_verified >> 20
        );
    }
    if bad == 0 {
        println!("cluster-restarts: every run clean");
        ExitCode::SUCCESS
    } else {
        println!("cluster-restarts: {bad} run(s) wrong");
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clean restart run passes; each thing the judgement is for makes one fail.
    #[test]
    fn the_judgement_catches_what_it_is_for() {
        let clean = serde_json::json!({
            "outcome": "clean",
            "requests": {"sent": 10, "finished": 8, "failed": 2, "failed_excused": 2, "unfinished": 0},
            "ledger": {"held": 0, "reaped": 1, "reaped_excused": 1, "double_frees": 0},
            "violations": [],
            "bytes_verified": 4096,
            "faults": ["killed P0.dp0.tp1 at 10 ms, after 5 prefills", "P0.dp0.tp1 restarted (life 1)"],
            "problems": [],
        });
        assert!(judge(&clean).1.is_empty());
        let check = |change: fn(&mut serde_json::Value), expected: &str| {
            let mut run = clean.clone();
            change(&mut run);
            let wrong = judge(&run).1;
            assert!(wrong.iter().any(|w| w.contains(expected)), "{expected}: {wrong:?}");
        };
        check(|j| j["requests"]["failed_excused"] = 1.into(), "1 of 2 failures not excused");
        check(|j| j["ledger"]["reaped_excused"] = 0.into(), "1 of 1 reapings not excused");
        check(|j| j["ledger"]["held"] = 3.into(), "3 transfers still held");
        check(
            |j| j["violations"] = serde_json::json!([{"detail": "req-1 layer 0 block 0 differs at byte 0"}]),
            "differs at byte 0",
        );
        check(
            |j| j["problems"] = serde_json::json!(["P0.dp0.tp1: transfer tx-1 is not registered"]),
            "protocol error",
        );
        check(|j| j["faults"] = serde_json::json!(["killed P0.dp0.tp1"]), "did not restart");
        check(|j| j["bytes_verified"] = 0.into(), "no byte verified");
        check(|j| j["outcome"] = "leak".into(), "outcome leak");
    }
}
