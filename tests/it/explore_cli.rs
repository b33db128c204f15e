//! `pdkv explore` as a user checks a change with it: the scenario files it writes (a shrunk
//! failure, the seeds it names by outcome) replay with `pdkv run` as their headers say, whatever
//! the original file names (profiles included), and every seed without a verdict is named with
//! its replay command.

use std::path::PathBuf;
use std::process::Output;

/// A fresh temporary folder of this test process.
fn folder(name: &str) -> PathBuf {
    crate::cli::scratch("explore", name)
}

use crate::cli::pdkv_in as pdkv;

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A protocol scenario on named profiles: small engines, so a fixed share of HBM holds the KV.
const PROFILED_DP2: &str = r#"(
    name: "profiled-dp2",
    deployment: "1P_DP2:1D_TP2",
    profiles: (gpu: "h200-sxm", nic: "cx7-400g", model: "deepseek-r1"),
    hardware: (kv_memory_fraction: 0.5),
    workload: (clients: Closed(concurrency: 4, requests: 16), input_tokens: Fixed(128), output_tokens: Fixed(4)),
)"#;

/// A failure found in a file that names profiles is shrunk to a file that loads and replays:
/// `pdkv run` of it exits 1 (NOT AS EXPECTED) while it breaks the property its header names.
/// Before, the shrunk file kept `profiles:` and the search's shallower model, and the loader
/// refused it (`field model.layers: is 4 but the model profile deepseek-r1 ... says 61`, exit 2).
#[test]
fn a_shrunk_failure_of_a_profiled_scenario_replays() {
    let dir = folder("profiled");
    std::fs::write(dir.join("profiled-dp2.ron"), PROFILED_DP2).expect("writes");
    // (scenario, legacy options, the shrunk file, the property its header names). Reading DP0
    // is a silent read of foreign memory only without the incarnation fence; with it, the read
    // fails (DP0 is not the incarnation the answer names).
    let table: [(&str, &[&str], &str, &str); 2] = [
        ("2P_TP8-1D_DP8EP-h200", &["no-flexible-reads"], "2P_TP8-1D_DP8EP-h200-seed5-shrunk", "balanced"),
        (
            "profiled-dp2.ron",
            &["read-from-dp0", "no-incarnation-fence"],
            "profiled-dp2-seed0-shrunk",
            "safety",
        ),
    ];
    for (scenario, legacy, shrunk, property) in table {
        let mut args = vec!["explore", scenario, "--seeds", "20", "--faults", "swarm"];
        for option in legacy {
            args.extend(["--legacy", option]);
        }
        let out = pdkv(&dir, &[&args[..], &["--jobs", "1", "--out", "found"]].concat());
        assert_eq!(out.status.code(), Some(1), "{scenario}: {}", text(&out));
        assert!(text(&out).contains(" runs, "), "{scenario}: says how long shrinking took: {}", text(&out));
        assert!(text(&out).contains("(a local minimum: "), "{scenario}: {}", text(&out));
        let file = format!("found/{shrunk}.ron");
        let ron = std::fs::read_to_string(dir.join(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(ron.contains(&format!("It breaks the property {property}:")), "{ron}");
        assert!(ron.contains("It no longer names the model profile `deepseek-r1`"), "{ron}");
        // The GPU and NIC profiles still hold, so the file keeps naming them.
        assert!(ron.contains("gpu: \"h200-sxm\"") && ron.contains("nic: \"cx7-400g\""), "{ron}");
        let run = pdkv(&dir, &["run", &file, "--no-trace"]);
        assert_eq!(run.status.code(), Some(1), "{file}: {}", text(&run));
        assert!(text(&run).contains("NOT AS EXPECTED"), "{file}: {}", text(&run));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A seed without a verdict on liveness (cut by its budget while requests were in flight) is
/// named with the command that replays it, and the file replays it: `pdkv run` exits 0 while it
/// still ends `incomplete`. Also for a scenario that names profiles.
#[test]
fn seeds_without_a_verdict_are_named_and_replay() {
    let dir = folder("unjudged");
    for (scenario, name) in
        [("2P_DP8EP:1D_TP8", "2P_DP8EP:1D_TP8"), ("2P_TP8-1D_DP8EP-h200", "2P_TP8-1D_DP8EP-h200")]
    {
        let args = ["explore", scenario, "--from", "57", "--seeds", "2", "--faults", "swarm", "--jobs", "1"];
        let out = pdkv(&dir, &[&args[..], &["--out", "found"]].concat());
        let printed = text(&out);
        assert_eq!(out.status.code(), Some(0), "{scenario}: {printed}");
        assert!(printed.contains("but 1 seed without a verdict on liveness"), "{scenario}: {printed}");
        let file = format!("found/{name}-seed58.ron");
        assert!(printed.contains(&format!("incomplete: 1 seed:\n  seed 58: pdkv run {file}\n")), "{printed}");
        let run = pdkv(&dir, &["run", &file, "--no-trace"]);
        assert_eq!(run.status.code(), Some(0), "{file}: {}", text(&run));
        assert!(
            text(&run).contains("outcome      incomplete (expected incomplete: as expected)"),
            "{}",
            text(&run)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
