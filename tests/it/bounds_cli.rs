//! Hostile input to the simulator's commands: absurd sizes, overflowing numbers, endless files
//! and doctored results each get exit code 2 and a message naming what is wrong, never a hang,
//! a panic or Rust's debug formatting; a run whose requests fail without a fault exits 1.

use std::path::PathBuf;
use std::process::{Command, Output};

fn pdkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).output().expect("pdkv runs")
}

/// A fresh temporary folder for one test.
fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-it-bounds-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    dir
}

/// Runs `args` and checks the exit code and that the output (stdout and stderr) says `text`,
/// and never shows a Rust `Option` or panic.
fn check(args: &[&str], expected: (i32, &str)) {
    let (code, text) = expected;
    let out = pdkv(args);
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(code), "{}: {all}", args.join(" "));
    assert!(all.contains(text), "{}: expected `{text}` in: {all}", args.join(" "));
    for debug in ["Some(", "None", "panicked", "RUST_BACKTRACE"] {
        assert!(!all.contains(debug), "{}: shows `{debug}`: {all}", args.join(" "));
    }
}

/// A small scenario file in `dir` with `fields` added; returns its path. DeepSeek-R1's weights
/// would not fit its TP1 engines, so its KV pool is a fixed share of HBM.
fn scenario(dir: &std::path::Path, name: &str, fields: &str) -> String {
    let path = dir.join(format!("{name}.ron"));
    let (hardware, fields) = if fields.contains("hardware: (") {
        ("", fields.replacen("hardware: (", "hardware: (kv_memory_fraction: 0.5, ", 1))
    } else {
        (" hardware: (kv_memory_fraction: 0.5),", fields.to_string())
    };
    let text = format!(
        "(\n    name: \"{name}\",\n    deployment: \"1P_TP1:1D_TP1\",{hardware}\n    workload: (clients: \
         Closed(concurrency: 2, requests: 4), input_tokens: Fixed(8192), output_tokens: Fixed(4)),\n    {fields}\n)\n"
    );
    std::fs::write(&path, text).expect("scenario written");
    path.display().to_string()
}

#[test]
fn hostile_arguments_exit_2_with_a_precise_message() {
    let dir = temp("args");
    let out = dir.join("out").display().to_string();
    let overflow = scenario(&dir, "overflow", "protocol: (collective_timeout_ms: 18446744073709),");
    let huge = dir.join("huge.ron");
    std::fs::write(&huge, vec![b' '; 5 << 20]).expect("huge file written");
    let huge = huge.display().to_string();
    let table: Vec<(Vec<&str>, (i32, &str))> = vec![
        (
            vec!["run", &overflow, "--out", &out],
            (2, "overflow.ron:5:16: field `protocol.collective_timeout_ms`: must be at most 10000000000 ms"),
        ),
        (
            vec!["run", "1P_TP8:1D_TP8", "--concurrency", "10000000", "--out", &out],
            (2, "--concurrency 10000000: must be at most 100000, got 10000000"),
        ),
        (
            vec!["run", "1P_TP8:1D_TP8", "--requests", "4000000000", "--out", &out],
            (2, "--requests 4000000000: must be at most 1000000"),
        ),
        (vec!["run", "1P_TP8:1D_TP8", "--concurrency", "0"], (2, "invalid value '0'")),
        (vec!["run", "1P_TP8:1D_TP8", "--seed", "-1"], (2, "unexpected argument")),
        (vec!["run", &huge], (2, "larger than 1048576 bytes")),
        (
            vec!["sweep", "1P_TP8:1D_TP8", "--concurrency", "10000000", "--out", &out],
            (2, "--concurrency 10000000 --requests-per-client 10: must be at most 100000"),
        ),
        (
            vec!["sweep", "1P_TP8:1D_TP8", "--concurrency", "100000", "--requests-per-client", "4000000000"],
            (2, "must be at most 1000000"),
        ),
        (vec!["sweep", "1P_TP8:1D_TP8", "--concurrency", "x"], (2, "invalid value 'x'")),
        (
            vec!["explore", "1P_TP1:1D_TP1", "--from", "18446744073709551610", "--seeds", "10"],
            (2, "the last seed would be past 18446744073709551615"),
        ),
        (vec!["explore", "1P_TP1:1D_TP1", "--seeds", "0"], (2, "invalid value '0'")),
        (vec!["explore", "1P_TP1:1D_TP1", "--jobs", "100000"], (2, "invalid value '100000'")),
        (vec!["explore", &overflow, "--seeds", "1"], (2, "protocol.collective_timeout_ms")),
        (vec!["replay", "/dev/zero"], (2, "cannot read /dev/zero: a character device, not a regular file")),
        (vec!["replay", &huge], (2, "not a pdkv result")),
        (vec!["replay"], (2, "required")),
        (vec!["routes", "1P_TP8"], (2, "error")),
        (vec!["routes", "1P_TP8:1D_TP8", "--kv-heads", "0"], (2, "invalid value '0'")),
        (vec!["routes", "1P_TP8:1D_TP8", "--rounds", "4294967295"], (2, "error")),
        (vec!["run", "1P_TP8:1D_TP8", "--bogus"], (2, "unexpected argument")),
    ];
    for (args, expected) in &table {
        check(args, *expected);
    }
}

/// A result.json doctored to hold an absurd scenario is refused like the scenario file would be.
#[test]
fn replay_refuses_a_doctored_result() {
    let dir = temp("doctored");
    let out = dir.join("run");
    let path = scenario(&dir, "small", "");
    let run = pdkv(&["run", &path, "--out", &out.display().to_string()]);
    assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
    let result = std::fs::read_to_string(out.join("result.json")).expect("result written");
    let table = [
        (
            "concurrency: 2,",
            "concurrency: 10000000,",
            "workload.clients.concurrency`: must be at most 100000",
        ),
        (
            "collective_timeout_ms: 600000",
            "collective_timeout_ms: 18446744073709",
            "protocol.collective_timeout_ms`: must be at most",
        ),
        ("nic_gb_s: 48.0", "nic_gb_s: 1e-15", "hardware.nic_gb_s`: must be between 1e-6 and 1e9, got 1e-15"),
    ];
    let version = format!("\"version\": {}", pdkv_sim::scenario::FORMAT_VERSION);
    let older = "result format version 1, but this pdkv reads version";
    let padding = format!("description: \\\"{}\\\",", "x".repeat(1 << 20));
    let table = [
        table[0],
        table[1],
        table[2],
        (
            "description: \\\"\\\",",
            padding.as_str(),
            "(scenario_ron): the scenario is larger than 1048576 bytes",
        ),
        (version.as_str(), "\"version\": 1", older),
    ];
    for (from, to, says) in table {
        assert!(result.contains(from), "result.json lacks `{from}`");
        let doctored = dir.join("doctored.json");
        std::fs::write(&doctored, result.replace(from, to)).expect("doctored result written");
        check(&["replay", &doctored.display().to_string()], (2, says));
    }
}

/// A run is only clean when every request was sent and every failure was excused by a fault.
#[test]
fn failed_and_unsent_requests_are_not_clean() {
    let dir = temp("honest");
    let out = dir.join("out").display().to_string();
    let handshake = scenario(
        &dir,
        "handshake",
        "protocol: (handshake_timeout_ms: 1), hardware: (control_latency_us: 2000),",
    );
    let excused = scenario(
        &dir,
        "excused",
        "faults: (timeline: [(at_ms: 0, target: \"D0.dp0.tp0\", fault: NicDown)]),",
    );
    let declared = scenario(
        &dir,
        "declared",
        "protocol: (handshake_timeout_ms: 1), hardware: (control_latency_us: 2000), expect: failed_requests,",
    );
    let open = scenario(&dir, "open", "").replace(".ron", "");
    let open_text = std::fs::read_to_string(format!("{open}.ron"))
        .unwrap()
        .replace("Closed(concurrency: 2, requests: 4)", "Open(rate_per_s: 0.002, requests: 40)");
    std::fs::write(format!("{open}.ron"), open_text).unwrap();
    let open = format!("{open}.ron");
    let table: Vec<(&str, (i32, &str))> = vec![
        (handshake.as_str(), (1, "outcome      failed_requests (expected clean: NOT AS EXPECTED)")),
        (handshake.as_str(), (1, "4 failed (0 excused by faults, 4 unexcused)")),
        (excused.as_str(), (0, "4 failed (4 excused by faults, 0 unexcused)")),
        (declared.as_str(), (0, "outcome      failed_requests (expected failed_requests: as expected)")),
        (open.as_str(), (1, "outcome      incomplete (expected clean: NOT AS EXPECTED)")),
        (
            open.as_str(),
            (1, "16 sent, 16 finished, 0 failed (0 excused by faults, 0 unexcused), 0 unfinished, 24 unsent"),
        ),
        (open.as_str(), (1, "UNSENT       24 requests were never sent")),
    ];
    for (path, expected) in &table {
        check(&["run", path, "--out", &out], *expected);
    }
    let json = std::fs::read_to_string(dir.join("out/result.json")).unwrap();
    assert!(json.contains("\"unsent\": 24"), "{json}");
}

/// Summaries and errors show values as the user writes them, not as Rust debug-prints them.
#[test]
fn messages_show_no_debug_formatting() {
    let dir = temp("debug");
    let out = dir.join("out").display().to_string();
    let jain = scenario(&dir, "jain", "expect_jain: (at_most: 0.5),");
    let target =
        scenario(&dir, "target", "faults: (timeline: [(at_ms: 0, target: \"prefill0\", fault: NicDown)]),");
    let name = dir.join("name.ron");
    std::fs::write(&name, "(name: \"a\\tb\", deployment: \"1P_TP1:1D_TP1\")").unwrap();
    let name = name.display().to_string();
    let table: Vec<(&str, (i32, &str))> = vec![
        (jain.as_str(), (1, "expectation  Jain at most 0.5: DOES NOT HOLD")),
        (target.as_str(), (2, "`prefill0` is not a rank pattern")),
        (name.as_str(), (2, "must be a folder name, without `\\t`; got `a\\tb`")),
    ];
    for (path, expected) in &table {
        check(&["run", path, "--out", &out], *expected);
    }
}

/// `pdkv check`: the fixed protocol proves clean with a prefill restart anywhere (exit 0), the
/// legacy option without the incarnation fence shows its stale read with the shortest trace
/// (exit 1), a search stopped by its state bound is no proof (exit 1), and input beyond the
/// model checker's limits is refused naming the flag or the deployment (exit 2).
#[test]
fn check_proves_finds_or_refuses() {
    check(&["check", "1P_TP1:1D_TP1", "--restarts", "1"], (0, "in any interleaving"));
    check(
        &["check", "1P_TP2:1D_TP2", "--restarts", "1", "--losses", "0", "--legacy", "no-incarnation-fence"],
        (1, "VIOLATION    stale read"),
    );
    check(
        &["check", "1P_TP2:1D_TP2", "--legacy", "no-incarnation-fence", "--restarts", "1"],
        (1, "RESTART P0.dp0."),
    );
    check(&["check", "1P_TP2:1D_TP4", "--max-states", "10"], (1, "no proof"));
    check(&["check", "1P_TP2:1D_TP2", "--requests", "5"], (2, "--requests"));
    check(&["check", "1P_TP2:1D_TP2", "--restarts", "3"], (2, "--restarts"));
    check(&["check", "1P_TP2:1D_TP2", "--max-states", "18446744073709551615"], (2, "--max-states"));
    check(
        &["check", "1P_DP4TP4:1D_TP2"],
        (2, "prefill engine P0 has 16 ranks; the model checker takes at most 8"),
    );
    check(&["check", "1P_TP2:1D_XP2"], (2, "XP2"));
}
