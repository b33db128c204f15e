//! `pdkv cluster` against what it does not control: a foreign driver that stops reading its
//! input, outstays its goodbye or leaves processes behind, a `pdkv cluster` killed with SIGKILL
//! under its driver, and a `pdkv cluster` that is itself stopped (SIGSTOP) for longer than the
//! heartbeat timeout. Each runs the built binary, as an operator would.
//!
//! The drivers are small `sh` scripts: each `sleep` among them has a number of its own, so that
//! a test can tell from /proc whether a process it started survived the run.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_pdkv")
}

/// The processes whose command line is exactly `args`, that are not zombies.
fn processes_running(args: &[&str]) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Some(words) = crate::cluster::cmdline(pid) else { continue };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
            .unwrap_or(true);
        if !zombie && words == args {
            found.push(pid);
        }
    }
    found
}

/// Waits up to `limit` for `done`; whether it came. A bound on a wait for the system to act
/// (a signal to land), never a measure of how fast pdkv is.
fn wait_until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > limit {
            return false;
        }
        sleep(Duration::from_millis(20));
    }
    true
}

/// Runs `pdkv cluster` with a foreign decode side played by `sh -c script`, and its flags.
fn run_with_driver(deployment: &str, script: &str, flags: &[&str]) -> (Output, serde_json::Value) {
    let out = Command::new(exe())
        .args(["cluster", deployment, "--json", "--foreign-side", "decode", "--foreign-driver", "sh"])
        .args(["--foreign-driver-arg", "-c", "--foreign-driver-arg", script])
        .args(flags)
        .stderr(Stdio::piped())
        .output()
        .expect("pdkv runs");
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out, json)
}

fn problems(json: &serde_json::Value) -> Vec<String> {
    json["problems"].as_array().expect("problems").iter().map(|p| p.as_str().unwrap().to_string()).collect()
}

/// The connectors all exited by themselves: none is blamed for what the driver did.
fn connectors_all_exited_cleanly(json: &serde_json::Value) {
    let p = &json["processes"];
    assert_eq!(
        (p["killed_at_shutdown"].as_u64(), p["failed"].as_u64(), p["exited_cleanly"].as_u64()),
        (Some(0), Some(0), p["started"].as_u64()),
        "{json}"
    );
}

#[test]
fn a_driver_that_stops_reading_its_input_fails_the_run_naming_it_and_dies_with_its_group() {
    // It reads nothing after saying ready, and starts a process of its own. With reads leased
    // for 0.5 s and reaped 0.5 s after, prefill keeps freeing blocks and handing the driver more
    // requests, so its input pipe fills; and the reaper's notes overflow the problem list.
    let script = "echo '{\"op\":\"ready\"}'; sleep 30917 & exec sleep 30918";
    let flags = [
        "--requests",
        "4000",
        "--concurrency",
        "1024",
        "--heartbeat-timeout-ms",
        "1000",
        "--transfer-timeout-ms",
        "500",
        "--defer-timeout-ms",
        "500",
    ];
    let (out, json) = run_with_driver("1P_TP2:1D_TP2", script, &flags);
    assert_eq!(out.status.code(), Some(1), "{json}");
    assert_eq!(json["outcome"], "hang", "{json}");
    let problems = problems(&json);
    let stopped = "the foreign driver stopped reading its input: ";
    assert!(problems[0].starts_with(&format!("hung: {stopped}")), "{json}");
    // The line saying it was killed is kept however many notes came after it.
    let killed = json["foreign"]["killed"].as_str().expect("the driver was killed");
    assert!(killed.starts_with(stopped) && killed.ends_with("; killed it and its process group"), "{json}");
    assert!(problems.iter().any(|p| p == killed), "{json}");
    assert!(problems.len() > 64 && problems.last().unwrap().contains("more problems left out"), "{json}");
    connectors_all_exited_cleanly(&json);
    // The driver and the process it started are gone with the run.
    for sleeper in ["30917", "30918"] {
        assert_eq!(processes_running(&["sleep", sleeper]), Vec::<u32>::new(), "sleep {sleeper} is left");
    }
}

/// A driver that answers `ready`, then `bye` on `shutdown` and does `after_bye`, and never
/// answers a request (so the runs below end at --timeout-ms, outcome hang).
fn polite_driver(at_setup: &str, after_bye: &str) -> String {
    format!(
        "while IFS= read -r line; do case \"$line\" in \
           *'\"op\":\"setup\"'*) {at_setup} echo '{{\"op\":\"ready\"}}' ;; \
           *'\"op\":\"shutdown\"'*) echo '{{\"op\":\"bye\"}}'; {after_bye} ;; \
         esac; done"
    )
}

/// Runs a polite driver that does `at_setup` and `after_bye`, and checks that it was killed
/// for `killed`, that no connector was blamed, and that its `sleep SLEEPER` is gone.
fn check_impolite_exit(at_setup: &str, after_bye: &str, killed: &str, sleeper: &str) {
    let flags = ["--requests", "2", "--timeout-ms", "1500"];
    let (_, json) = run_with_driver("1P_TP1:1D_TP1", &polite_driver(at_setup, after_bye), &flags);
    assert_eq!(json["foreign"]["killed"], killed, "{json}");
    assert!(problems(&json).iter().any(|p| p == killed), "{json}");
    connectors_all_exited_cleanly(&json);
    assert_eq!(processes_running(&["sleep", sleeper]), Vec::<u32>::new(), "sleep {sleeper} is left");
}

#[test]
fn a_driver_that_outstays_its_goodbye_is_reported_and_killed_and_no_connector_is_blamed() {
    let killed = "the foreign driver said bye but did not exit; killed it and its process group";
    check_impolite_exit("", "exec sleep 30921", killed, "30921");
}

#[test]
fn processes_a_driver_leaves_behind_are_killed_with_its_group() {
    let killed = "the foreign driver exited, leaving processes of its group running; killed them";
    check_impolite_exit("sleep 30925 &", "exit 0", killed, "30925");
}

#[test]
fn a_driver_dies_with_a_pdkv_cluster_killed_by_sigkill() {
    let mut child = Command::new(exe())
        .args(["cluster", "1P_TP1:1D_TP1", "--requests", "2", "--foreign-side", "decode"])
        .args(["--foreign-driver", "sh", "--foreign-driver-arg", "-c", "--foreign-driver-arg"])
        .arg("echo '{\"op\":\"ready\"}'; exec sleep 30931")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("pdkv runs");
    let pdkv = child.id();
    let driver = || {
        processes_running(&["sleep", "30931"])
            .into_iter()
            .find(|p| crate::cluster::children_of(pdkv).contains(p))
    };
    assert!(wait_until(Duration::from_secs(60), || driver().is_some()), "the driver never started");
    let pid = driver().expect("the driver runs");
    child.kill().expect("SIGKILL");
    child.wait().expect("pdkv ends");
    // Nothing of pdkv's ran after the SIGKILL: only the parent-death signal can end the driver.
    let gone = || processes_running(&["sleep", "30931"]).iter().all(|&p| p != pid);
    assert!(wait_until(Duration::from_secs(10), gone), "the driver {pid} outlived its pdkv cluster");
    assert!(!Path::new(&format!("/proc/{pid}/cmdline")).exists() || gone());
}

/// Runs 3,000 requests of 1P_DP2TP1:1D_TP2 at 64 in flight with `flags`, stops `pdkv cluster`
/// itself (SIGSTOP) 2 s in for `stop`, continues it, and checks that nobody was blamed: no rank
/// lost, nothing failed or reaped but what the stop itself exposed, a clean run.
fn check_stopped_scheduler(flags: &[&str], stop: Duration) {
    let child = Command::new(exe())
        .args(["cluster", "1P_DP2TP1:1D_TP2", "--requests", "6000", "--concurrency", "64", "--json"])
        .args(["--heartbeat-timeout-ms", "2000"])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("pdkv runs");
    let pdkv = child.id();
    assert!(
        wait_until(Duration::from_secs(60), || crate::cluster::children_of(pdkv).len() == 4),
        "the ranks never started"
    );
    // Into the run, with requests in flight when it stops: 6,000 requests take 6 s on an idle
    // 2-core machine and 30 s on a loaded one, so a second in is mid-run on both (3,000 and a
    // stop 2 s in ended before the stop on an idle machine, and the test saw no stall).
    sleep(Duration::from_secs(1));
    let signal = |name: &str| {
        let status = Command::new("kill").args([name, &pdkv.to_string()]).status().expect("kill runs");
        assert!(status.success(), "kill {name} {pdkv}");
    };
    signal("-STOP");
    sleep(stop);
    signal("-CONT");
    let out = child.wait_with_output().expect("pdkv ends");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let problems = problems(&json);
    // The stop happened during the run, and was seen as the scheduler's own.
    assert!(problems.iter().any(|p| p.starts_with("pdkv cluster itself did not run")), "{flags:?} {json}");
    assert!(!problems.iter().any(|p| p.contains("stopped answering")), "{flags:?} {json}");
    assert_eq!(json["outcome"], "clean", "{flags:?} {json}");
    let (r, l) = (&json["requests"], &json["ledger"]);
    assert_eq!(r["finished"].as_u64().unwrap() + r["failed"].as_u64().unwrap(), 6000, "{json}");
    assert_eq!((&r["failed"], &l["reaped"]), (&r["failed_excused"], &l["reaped_excused"]), "{json}");
    connectors_all_exited_cleanly(&json);
    assert_eq!(out.status.code(), Some(0), "{flags:?} {json}");
}

#[test]
fn a_pdkv_cluster_stopped_for_longer_than_the_heartbeat_timeout_blames_no_rank() {
    // Twice the heartbeat timeout: its ranks went on sending heartbeats that nobody read, so
    // their silence is the scheduler's.
    check_stopped_scheduler(&[], Duration::from_secs(4));
    // Longer than the reaper's delay: the releases sent meanwhile wait in the sockets, and are
    // read before the reaper runs (before, about 30 transfers were reaped as unreleased, a
    // leak), and the requests whose decode timers ran out while their engine was stopped are
    // the stop's (before, failed requests).
    let short =
        ["--handshake-timeout-ms", "1000", "--transfer-timeout-ms", "3000", "--defer-timeout-ms", "4000"];
    check_stopped_scheduler(&short, Duration::from_secs(7));
}

#[test]
fn sigterm_ends_a_run_whose_driver_stopped_reading_at_once_with_a_partial_result() {
    // The driver says ready and reads nothing more, so it never reads its `shutdown` (which
    // waits in its pipe, where the scheduler's queue cannot see it).
    let script = "echo '{\"op\":\"ready\"}'; sleep 30941 & exec sleep 30942";
    let child = Command::new(exe())
        .args(["cluster", "1P_TP2:1D_TP2", "--requests", "4000", "--concurrency", "1024", "--json"])
        .args(["--foreign-side", "decode", "--foreign-driver", "sh"])
        .args(["--foreign-driver-arg", "-c", "--foreign-driver-arg", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("pdkv runs");
    let pdkv = child.id();
    let driver_up = || !processes_running(&["sleep", "30942"]).is_empty();
    assert!(wait_until(Duration::from_secs(60), driver_up), "the driver never started");
    sleep(Duration::from_millis(500));
    let status = Command::new("kill").args(["-TERM", &pdkv.to_string()]).status().expect("kill runs");
    assert!(status.success());
    let signalled = Instant::now();
    let out = child.wait_with_output().expect("pdkv ends");
    let took = signalled.elapsed();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(143), "{json}");
    assert_eq!(json["outcome"], "interrupted", "{json}");
    // It gave the driver a second to say bye, not the 10 s exit timeout a shutdown without a
    // signal allows (a bound on waiting, generous for a loaded machine).
    assert!(took < Duration::from_secs(6), "SIGTERM took {took:?} to end the run");
    let killed = "the foreign driver did not answer shutdown; killed it and its process group";
    assert_eq!(json["foreign"]["killed"], killed, "{json}");
    connectors_all_exited_cleanly(&json);
    for sleeper in ["30941", "30942"] {
        assert_eq!(processes_running(&["sleep", sleeper]), Vec::<u32>::new(), "sleep {sleeper} is left");
    }
}
