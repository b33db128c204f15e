//! `pdkv run`'s steady-state window: its TTFT percentiles do not depend on how long the run is
//! where the whole run's do, its flags reach the result, the scenario and the replay command,
//! and its figures are as deterministic as the rest of the result.

use std::path::Path;

use pdkv_sim::result::WindowKind;
use pdkv_sim::{RunOptions, RunResult};

use crate::cli::{pdkv_in, scratch};

/// How far apart the steady TTFT percentiles of the short and the long run may be.
const TOLERANCE: f64 = 0.10;

/// A closed loop of 24 clients on one TP8 engine a side, 8K prompts and outputs of 64 to 1,024
/// tokens: its first 24 prompts arrive together and queue for prefill (nine 32K-token steps),
/// and the outputs' spread breaks the first generation's lockstep within a few generations.
/// (A loop of equal outputs stays in lockstep far longer: `2P_TP8:1D_DP8EP` at C = 128 takes
/// about 1,800 arrivals to settle its median TTFT, longer than a 10 x C run; see docs/sim.md.)
fn closed_loop(requests: u32) -> RunResult {
    let text = format!(
        "(name: \"steady\", deployment: \"1P_TP8:1D_TP8\", workload: (clients: Closed(concurrency: 24, \
         requests: {requests}), input_tokens: Fixed(8192), output_tokens: Uniform(min: 64, max: 1024)))"
    );
    let scenario = pdkv_sim::load::parse_scenario(&text, "<steady>").unwrap_or_else(|e| panic!("{e}"));
    pdkv_sim::run(&scenario, RunOptions::default()).unwrap_or_else(|e| panic!("{e}")).result
}

/// |a − b| relative to the smaller.
fn apart(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.min(b)
}

/// The same closed loop at 10 x C and 40 x C requests: the steady window's p50 and p90 TTFT
/// agree within [`TOLERANCE`], the whole run's differ by more than that and by more than twice
/// as much, since the first generation's queue weighs four times as much in the short run.
#[test]
fn the_steady_ttft_does_not_depend_on_the_run_length() {
    let (short, long) = (closed_loop(240), closed_loop(960));
    for r in [&short, &long] {
        assert_eq!(r.outcome, pdkv_sim::Outcome::Clean);
        let w = &r.steady.window;
        assert_eq!((w.kind, w.drain_requests), (WindowKind::Steady, 24), "{w:?}");
    }
    // Warm-up: max(C, N / 10) arrivals.
    assert_eq!((short.steady.window.warmup_requests, long.steady.window.warmup_requests), (24, 96));
    let steady = |r: &RunResult| r.steady.latency_ms.ttft.expect("requests finished in the window");
    let whole = |r: &RunResult| r.latency_ms.ttft.expect("requests finished");
    let mut figures = String::new();
    for (name, at) in [("p50", 0), ("p90", 1)] {
        let pick = |s: pdkv_sim::result::Summary| [s.p50, s.p90][at];
        let (s, l) = (pick(steady(&short)), pick(steady(&long)));
        let (ws, wl) = (pick(whole(&short)), pick(whole(&long)));
        let (steady_apart, whole_apart) = (apart(s, l), apart(ws, wl));
        figures += &format!(
            "{name} TTFT: steady {s} ms at 10 x C, {l} ms at 40 x C ({:.1} % apart); whole run {ws} ms and {wl} ms \
             ({:.1} % apart)\n",
            100.0 * steady_apart,
            100.0 * whole_apart
        );
        assert!(steady_apart <= TOLERANCE, "{figures}");
        assert!(whole_apart > TOLERANCE && whole_apart > 2.0 * steady_apart, "{figures}");
    }
}

/// Runs `pdkv run` in `dir` with `args` and the output folder `out`; returns the exit code,
/// stdout and stderr.
fn run(dir: &Path, out: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--no-trace", "--out", out]);
    let output = pdkv_in(dir, &all);
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).to_string();
    (output.status.code(), text(&output.stdout), text(&output.stderr))
}

fn result(dir: &Path, out: &str) -> (String, serde_json::Value) {
    let text = std::fs::read_to_string(dir.join(out).join("result.json")).expect("result.json");
    let json = serde_json::from_str(&text).expect("JSON");
    (text, json)
}

#[test]
fn the_measure_flags_reach_the_result_the_scenario_and_the_replay() {
    let dir = scratch("steady", "flags");
    let small = ["1P_TP8:1D_TP8", "--concurrency", "4", "--requests", "40"];
    let flags = ["--warmup", "8", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "40.5"];
    let args: Vec<&str> = small.iter().chain(&flags).copied().collect();

    let (code, stdout, stderr) = run(&dir, "a", &args);
    assert_eq!(code, Some(0), "{stderr}");
    for line in [
        "\n  window       steady: arrivals 9 to 36 of 40 (warm-up 8, drain 4), ",
        "\n  GPUs         8 prefill, 8 decode\n",
        "\n    ms            mean       p50       p90       p99\n",
        "\n  goodput      ",
        " of the window's requests met TTFT <= 3000 ms, TPOT <= 40.5 ms\n",
        "\n  replay       pdkv run 1P_TP8:1D_TP8 --seed 0 --concurrency 4 --requests 40 --warmup 8 --slo-ttft-ms 3000 \
         --slo-tpot-ms 40.5\n",
    ] {
        assert!(stdout.contains(line), "no {line:?} in\n{stdout}");
    }
    let (bytes, json) = result(&dir, "a");
    let steady = &json["steady"];
    assert_eq!(steady["window"]["kind"], "steady");
    assert_eq!(steady["window"]["warmup_requests"], 8);
    assert_eq!(steady["goodput"]["slo"]["tpot_ms"], 40.5);
    assert_eq!(json["gpus"]["prefill"], 8);
    for key in ["ttft", "tpot", "itl", "e2e"] {
        assert!(steady["latency_ms"][key]["p90"].is_f64(), "{key}: {steady}");
        assert!(json["latency_ms"][key]["p90"].is_f64(), "{key}: {}", json["latency_ms"]);
    }
    let ron = json["scenario_ron"].as_str().expect("the scenario");
    assert!(ron.contains("warmup_requests: 8,") && ron.contains("tpot_ms: 40.5,"), "{ron}");

    // The same run again: byte for byte the same summary and result.
    let (_, again, _) = run(&dir, "a", &args);
    assert_eq!(again, stdout);
    assert_eq!(result(&dir, "a").0, bytes);

    // The replay reruns the stored scenario, window and SLO included.
    let replay = pdkv_in(&dir, &["replay", "a/result.json"]);
    let said = String::from_utf8_lossy(&replay.stdout);
    assert_eq!(replay.status.code(), Some(0), "{said}");
    assert!(said.contains("result byte-identical"), "{said}");

    // The whole run: its latencies are the whole-run ones, and no goodput without an SLO.
    let whole: Vec<&str> = small.iter().copied().chain(["--whole-run"]).collect();
    let (code, stdout, stderr) = run(&dir, "b", &whole);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("\n  window       the whole run, as asked (40 arrivals)\n"), "{stdout}");
    assert!(!stdout.contains("goodput"), "{stdout}");
    let (_, json) = result(&dir, "b");
    for key in ["ttft", "tpot", "itl", "e2e"] {
        assert_eq!(json["steady"]["latency_ms"][key], json["latency_ms"][key], "{key}");
    }
    assert!(json["steady"].get("goodput").is_none(), "{}", json["steady"]);

    // Flags that cannot hold.
    for (bad, says) in [
        (vec!["--warmup", "8", "--whole-run"], "cannot be used with"),
        (vec!["--slo-ttft-ms", "0"], "--slo-ttft-ms 0: must be a time above 0"),
        (
            vec!["--requests", "40", "--slo-tpot-ms", "NaN"],
            "--requests 40 --slo-tpot-ms NaN: must be a time above 0",
        ),
    ] {
        let args: Vec<&str> = ["1P_TP8:1D_TP8"].into_iter().chain(bad.iter().copied()).collect();
        let (code, _, stderr) = run(&dir, "c", &args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
