//! `cargo xtask bench`: runs the benchmarks, collects their figures and prints each against the
//! figures recorded in `bench/figures.txt`, with the ratio, so that a regression shows; `cargo
//! xtask bench --record` writes this run's figures there.
//!
//! The examples (`pdkv-sim`'s `bench`, `pdkv-rdma`'s `tcp_bench` and `release_rtt`) print their
//! human-readable lines and, for each figure, a line `figure <name> <value> <unit>
//! <higher|lower>`. The user's path (a `pdkv run` with its report, an exploration) and the
//! memory curve (a 1,024-GPU deployment at 10k, 100k and 1M requests) are measured here by
//! running the release `pdkv` binary, its peak resident memory read from `/proc` while it runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Where the recorded figures live, relative to the workspace root.
const RECORD: &str = "bench/figures.txt";

/// One measured figure.
#[derive(Clone, Debug, PartialEq)]
struct Figure {
    value: f64,
    unit: String,
    /// Whether a larger value is better (a rate) or worse (a time, a size).
    higher_is_better: bool,
}

/// Reads `figure <name> <value> <unit> <higher|lower>` lines; other lines are not figures.
fn parse_figures(text: &str) -> Result<BTreeMap<String, Figure>, String> {
    let mut figures = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() != Some(&"figure") {
            continue;
        }
        let [_, name, value, unit, better] = words[..] else {
            return Err(format!(
                "line {}: `{line}` is not `figure <name> <value> <unit> <higher|lower>`",
                i + 1
            ));
        };
        let value: f64 = value.parse().map_err(|_| format!("line {}: `{value}` is not a number", i + 1))?;
        let higher_is_better = match better {
            "higher" => true,
            "lower" => false,
            other => return Err(format!("line {}: `{other}` is neither higher nor lower", i + 1)),
        };
        figures.insert(name.to_string(), Figure { value, unit: unit.to_string(), higher_is_better });
    }
    Ok(figures)
}

fn figure_line(name: &str, f: &Figure) -> String {
    let better = if f.higher_is_better { "higher" } else { "lower" };
    format!("figure {name} {} {} {better}", f.value, f.unit)
}

/// A figure's value with the digits worth reading.
fn shown(value: f64) -> String {
    match value.abs() {
        v if v >= 100.0 => format!("{value:.0}"),
        v if v >= 10.0 => format!("{value:.1}"),
        _ => format!("{value:.3}"),
    }
}

/// The table of this run's figures against the recorded ones: the ratio new / old, and a
/// verdict when the change is worse than `slack` (a factor) in the figure's bad direction.
fn compare(now: &BTreeMap<String, Figure>, before: &BTreeMap<String, Figure>, slack: f64) -> String {
    let mut out = String::from("| figure | now | recorded | ratio | |\n|---|---|---|---|---|\n");
    for (name, f) in now {
        let (old, ratio, verdict) = match before.get(name) {
            Some(b) if b.value != 0.0 => {
                let ratio = f.value / b.value;
                let worse = if f.higher_is_better { ratio < 1.0 / slack } else { ratio > slack };
                (
                    format!("{} {}", shown(b.value), b.unit),
                    format!("{ratio:.2}"),
                    if worse { "WORSE" } else { "" },
                )
            }
            Some(b) => (format!("{} {}", shown(b.value), b.unit), "-".into(), ""),
            None => ("-".into(), "-".into(), "new"),
        };
        out.push_str(&format!("| {name} | {} {} | {old} | {ratio} | {verdict} |\n", shown(f.value), f.unit));
    }
    out
}

/// Runs `cargo <args>` in `root`, echoing its output and collecting the figures it prints.
fn run_example(root: &Path, args: &[&str]) -> Result<BTreeMap<String, Figure>, String> {
    eprintln!("$ cargo {}", args.join(" "));
    let out = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines().filter(|l| !l.starts_with("figure ")) {
        println!("{line}");
    }
    if !out.status.success() {
        return Err(format!("cargo {} failed: {}", args.join(" "), out.status));
    }
    parse_figures(&text)
}

/// The peak resident memory of process `pid` so far, in kilobytes (`VmHWM`), if readable.
fn peak_rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Runs the release `pdkv` with `args`; returns its wall time and its peak resident memory
/// (watched every 20 ms; the high-water mark only grows, so the last reading misses at most
/// the final moments).
fn timed(pdkv: &Path, args: &[&str]) -> Result<(Duration, Option<u64>), String> {
    let started = Instant::now();
    let mut child = Command::new(pdkv)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", pdkv.display()))?;
    let mut peak = None;
    loop {
        if let Some(kb) = peak_rss_kb(child.id()) {
            peak = Some(peak.map_or(kb, |p: u64| p.max(kb)));
        }
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok((started.elapsed(), peak)),
            Ok(Some(status)) => return Err(format!("pdkv {} exited with {status}", args.join(" "))),
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("cannot wait for pdkv: {e}")),
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The user's path and the memory curve, measured with the release binary.
fn cli_figures(pdkv: &Path, scratch: &Path) -> Result<BTreeMap<String, Figure>, String> {
    let mut figures = BTreeMap::new();
    let mut add = |name: &str, value: f64, unit: &str, higher_is_better: bool| {
        println!("  {name:<32} {value:.3} {unit}");
        figures.insert(name.to_string(), Figure { value, unit: unit.into(), higher_is_better });
    };
    println!("pdkv run 2P_TP8:1D_DP8EP --concurrency 512 with its full report (5 runs):");
    let out = scratch.join("run-c512");
    let out = out.to_str().ok_or("the scratch path is not UTF-8")?;
    let mut walls = Vec::new();
    for _ in 0..5 {
        walls.push(
            timed(pdkv, &["run", "2P_TP8:1D_DP8EP", "--concurrency", "512", "--out", out])?.0.as_secs_f64(),
        );
    }
    add("run_c512_report_s", median(walls), "s", false);
    println!("pdkv explore 2P_DP8EP:1D_TP8 --seeds 2000 --faults swarm (every core):");
    let (wall, _) = timed(pdkv, &["explore", "2P_DP8EP:1D_TP8", "--seeds", "2000", "--faults", "swarm"])?;
    add("explore_2000_seeds_s", wall.as_secs_f64(), "s", false);
    println!("memory curve: scenarios/64P_TP8-8D_DP64EP-1024-gpus.ron, C = 4096, no trace:");
    let scenario = "scenarios/64P_TP8-8D_DP64EP-1024-gpus.ron";
    for (label, requests) in [("10k", "10000"), ("100k", "100000"), ("1m", "1000000")] {
        let out = scratch.join(format!("mem-{label}"));
        let out = out.to_str().ok_or("the scratch path is not UTF-8")?;
        let args =
            ["run", scenario, "--requests", requests, "--concurrency", "4096", "--no-trace", "--out", out];
        let (wall, peak) = timed(pdkv, &args)?;
        add(&format!("mem_1024gpu_{label}_wall_s"), wall.as_secs_f64(), "s", false);
        if let Some(kb) = peak {
            add(&format!("mem_1024gpu_{label}_peak_mb"), kb as f64 / 1024.0, "MB", false);
        }
    }
    Ok(figures)
}

/// `cargo xtask bench [--record]`.
pub fn run(root: &Path, target: &Path, args: &[String]) -> ExitCode {
    let record = match args {
        [] => false,
        [flag] if flag == "--record" => true,
        _ => {
            eprintln!("usage: cargo xtask bench [--record]");
            return ExitCode::from(2);
        }
    };
    let mut figures = BTreeMap::new();
    let examples: [&[&str]; 3] = [
        &["run", "--release", "--quiet", "--package", "pdkv-sim", "--example", "bench"],
        &["run", "--release", "--quiet", "--package", "pdkv-rdma", "--example", "tcp_bench"],
        &["run", "--release", "--quiet", "--package", "pdkv-rdma", "--example", "release_rtt"],
    ];
    let build = ["build", "--release", "--quiet", "--package", "pdkv", "--bin", "pdkv"];
    let pdkv: PathBuf = target.join("release/pdkv");
    let scratch = target.join("bench");
    let measured = examples
        .iter()
        .try_for_each(|args| run_example(root, args).map(|f| figures.extend(f)))
        .and_then(|()| run_example(root, &build).map(|_| ()))
        .and_then(|()| std::fs::create_dir_all(&scratch).map_err(|e| format!("{}: {e}", scratch.display())))
        .and_then(|()| cli_figures(&pdkv, &scratch).map(|f| figures.extend(f)));
    if let Err(message) = measured {
        eprintln!("bench: {message}");
        return ExitCode::FAILURE;
    }
    if let (Some(report), Some(engine)) =
        (figures.get("run_c512_report_s"), figures.get("simulate_c512_median_s"))
    {
        let ratio = report.value / engine.value;
        println!("  report / engine alone: {ratio:.2} (target <= 1.5)");
        figures.insert(
            "report_over_engine".into(),
            Figure { value: ratio, unit: "x".into(), higher_is_better: false },
        );
    }
    let path = root.join(RECORD);
    let before = match std::fs::read_to_string(&path) {
        Ok(text) => match parse_figures(&text) {
            Ok(before) => before,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        },
        Err(_) => BTreeMap::new(),
    };
    println!("\nAgainst the figures recorded in {RECORD} (ratio now / recorded; WORSE past a factor of 1.25 the wrong way):\n");
    print!("{}", compare(&figures, &before, 1.25));
    if record {
        let mut text = String::from(
            "# Figures of `cargo xtask bench`, recorded with `cargo xtask bench --record` on a 2-core\n\
             # machine; `cargo xtask bench` prints each new figure against these.\n",
        );
        for (name, f) in &figures {
            text.push_str(&figure_line(name, f));
            text.push('\n');
        }
        if let Err(e) =
            std::fs::create_dir_all(path.parent().unwrap_or(root)).and_then(|()| std::fs::write(&path, text))
        {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("\nrecorded in {RECORD}");
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_back_and_compare_by_their_direction() {
        let text = "human line\nfigure a 2 s lower\nfigure b 100 seeds/s higher\n";
        let figures = parse_figures(text).unwrap();
        assert_eq!(figures["a"], Figure { value: 2.0, unit: "s".into(), higher_is_better: false });
        let again = parse_figures(&figures.iter().map(|(n, f)| figure_line(n, f) + "\n").collect::<String>());
        assert_eq!(again.unwrap(), figures);
        let mut now = figures.clone();
        now.get_mut("a").unwrap().value = 3.0; // slower: worse
        now.get_mut("b").unwrap().value = 200.0; // faster: better
        now.insert("c".into(), Figure { value: 1.0, unit: "x".into(), higher_is_better: false });
        let table = compare(&now, &figures, 1.25);
        assert!(table.contains("| a | 3.000 s | 2.000 s | 1.50 | WORSE |"), "{table}");
        assert!(table.contains("| b | 200 seeds/s | 100 seeds/s | 2.00 |  |"), "{table}");
        assert!(table.contains("| c | 1.000 x | - | - | new |"), "{table}");
        let check = |line: &str, error: &str| {
            let e = parse_figures(line).unwrap_err();
            assert!(e.contains(error), "{line}: {e}");
        };
        check("figure a 2 s", "is not `figure");
        check("figure a x s lower", "`x` is not a number");
        check("figure a 2 s up", "`up` is neither higher nor lower");
    }
}
