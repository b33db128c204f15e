//! The invariants every fuzz run is judged by, whatever its faults did.

use super::plan::{Driver, Misbehaviour, Plan, SCHEDULER};
use super::procs::Ran;
use super::{EXIT_GRACE_MS, ORPHAN_GRACE};

/// The figures of a run that passed.
pub(super) struct Figures {
    pub(super) outcome: String,
    pub(super) exit: i32,
    pub(super) sent: u64,
    pub(super) failed: u64,
    pub(super) bytes: u64,
}

/// Checks the invariants; the error lists every one that failed.
pub(super) fn judge(plan: &Plan, ran: &Ran) -> Result<Figures, Vec<String>> {
    let mut bad = vec![];
    if ran.hung {
        bad.push(format!(
            "hang: pdkv cluster had not exited {} s after its own --timeout-ms; killed",
            EXIT_GRACE_MS / 1000
        ));
    }
    for o in &ran.orphans {
        bad.push(format!("{o} still running {} s after its cluster exited", ORPHAN_GRACE.as_secs()));
    }
    for c in &ran.crashes {
        bad.push(format!("connector {c}: it crashed"));
    }
    if ran.hung {
        return Err(bad);
    }
    if let Some(driver) = plan.driver {
        return judge_driver(driver, ran, bad);
    }
    let Some(exit) = exit_of(ran, &mut bad) else { return Err(bad) };
    if exit == 2 {
        // An outside kill that lands while the ranks start leaves a cluster that cannot start:
        // it says which rank and exits 2, which is what it should do.
        if let Some(rank) = killed_during_start(&ran.stderr, &ran.delivered) {
            if bad.is_empty() {
                let outcome = format!("not started ({rank} killed during the start)");
                return Ok(Figures { outcome, exit, sent: 0, failed: 0, bytes: 0 });
            }
        }
        bad.push("pdkv cluster exited 2: it refused the arguments or could not start (see stderr)".into());
        return Err(bad);
    }
    let Some(json) = result_of(ran, exit, &mut bad) else { return Err(bad) };
    let num = |path: &[&str]| path.iter().fold(&json, |v, k| &v[*k]).as_u64().unwrap_or(u64::MAX);
    let outcome = json["outcome"].as_str().unwrap_or("(missing)").to_string();
    let (sent, finished, failed) =
        (num(&["requests", "sent"]), num(&["requests", "finished"]), num(&["requests", "failed"]));
    let (excused, unfinished) = (num(&["requests", "failed_excused"]), num(&["requests", "unfinished"]));
    let bytes = num(&["bytes_verified"]);
    if let Some(violations) = json["violations"].as_array() {
        for v in violations {
            bad.push(format!(
                "violation {}: {}",
                v["kind"].as_str().unwrap_or("?"),
                v["detail"].as_str().unwrap_or("?")
            ));
        }
    }
    for (what, value) in [
        ("ledger.held", num(&["ledger", "held"])),
        ("ledger.double_frees", num(&["ledger", "double_frees"])),
        ("requests.unfinished", unfinished),
        ("processes.refused", num(&["processes", "refused"])),
    ] {
        if value != 0 {
            bad.push(format!("{what} is {value}, must be 0"));
        }
    }
    // A forger's messages are all refused, and nothing else is: the cluster makes any other
    // refusal a violation, listed above. No lease is ever capped: a deployment rank leases for
    // the transfer timeout, the longest a prefill rank takes, and a forged one is refused.
    if plan.forge {
        let forged = &json["control"]["forged"];
        let refused =
            num(&["control", "refused_releases"]).saturating_add(num(&["control", "refused_leases"]));
        if forged["refused"].as_u64() != Some(refused) {
            bad.push(format!(
                "control.forged.refused is {}, but {refused} messages were refused",
                forged["refused"]
            ));
        }
    }
    if num(&["control", "leases_capped"]) != 0 {
        bad.push(format!("control.leases_capped is {}, must be 0", num(&["control", "leases_capped"])));
    }
    // A stopped scheduler blames no rank for the silence it did not read.
    let scheduler_stopped = ran.delivered.iter().any(|d| d.contains(&format!("SIGSTOP {SCHEDULER} ")));
    let rank_stopped = ran.delivered.iter().any(|d| d.contains("SIGSTOP") && !d.contains(SCHEDULER));
    if scheduler_stopped && !rank_stopped {
        let problems = json["problems"].as_array().map(Vec::as_slice).unwrap_or_default();
        for p in problems.iter().filter_map(|p| p.as_str()).filter(|p| p.contains("stopped answering")) {
            bad.push(format!("pdkv cluster was stopped, and blamed a rank: {p}"));
        }
    }
    if matches!(outcome.as_str(), "safety_violation" | "hang" | "interrupted") {
        bad.push(format!("outcome {outcome}"));
    }
    if sent != plan.requests || finished.saturating_add(failed).saturating_add(unfinished) != sent {
        bad.push(format!(
            "requests do not add up: {sent} sent of {}, {finished} finished + {failed} failed + {unfinished} unfinished",
            plan.requests
        ));
    }
    // pdkv cluster's own rule (src/cluster_cmd.rs `as_designed`): 0 exactly for a clean run with
    // every process accounted for.
    let processes_ok = num(&["processes", "killed_at_shutdown"]) == 0 && num(&["processes", "failed"]) == 0;
    let expected_exit = if outcome == "clean" && processes_ok { 0 } else { 1 };
    if exit != expected_exit {
        bad.push(format!("exit code {exit} with outcome {outcome}; expected {expected_exit}"));
    }
    // With no outside fault every fault is the cluster's own, which it excuses by design.
    if ran.delivered.is_empty() {
        if outcome != "clean" {
            bad.push(format!("outcome {outcome} with no outside fault; expected clean"));
        }
        if failed != excused {
            bad.push(format!("{failed} requests failed, only {excused} excused, with no outside fault"));
        }
        if !processes_ok {
            bad.push("a process failed or was killed at shutdown with no outside fault".into());
        }
        // A duplicated message must be counted once: duplicates alone change nothing.
        let duplicates_only = plan.messages.iter().all(|(flag, _)| *flag == "--duplicate-messages");
        let faultless = plan.kill.is_none() && plan.drops.is_empty() && duplicates_only;
        if faultless && (failed != 0 || num(&["ledger", "reaped"]) != 0) {
            bad.push("a run with no fault at all failed requests or reaped transfers".into());
        }
        // Each finished request's prompt KV is read at least once in a fault-free run.
        if faultless && bytes < num(&["prompt_kv_bytes"]) {
            bad.push(format!(
                "{bytes} bytes verified, fewer than the {} bytes of the prompts",
                num(&["prompt_kv_bytes"])
            ));
        }
    }
    if bad.is_empty() {
        Ok(Figures { outcome, exit, sent, failed, bytes })
    } else {
        Err(bad)
    }
}

/// `pdkv cluster`'s exit code; `None` (noted in `bad`) when a signal nobody sent ended it.
fn exit_of(ran: &Ran, bad: &mut Vec<String>) -> Option<i32> {
    if ran.exit.is_none() {
        bad.push("pdkv cluster was ended by a signal nobody sent it".into());
    }
    ran.exit
}

/// The JSON result on stdout; `None` (noted in `bad`) when there is none.
fn result_of(ran: &Ran, exit: i32, bad: &mut Vec<String>) -> Option<serde_json::Value> {
    serde_json::from_str(&ran.stdout)
        .map_err(|e| bad.push(format!("exit {exit} and no JSON result on stdout: {e}")))
        .ok()
}

/// A run whose foreign decode driver misbehaves and never answers a request: it ends by its
/// budget (outcome hang, exit 1) with a result that names what the driver did, blames no
/// connector, and leaves no process of the driver's behind (checked with the orphans).
fn judge_driver(driver: Driver, ran: &Ran, mut bad: Vec<String>) -> Result<Figures, Vec<String>> {
    let Some(exit) = exit_of(ran, &mut bad) else { return Err(bad) };
    let Some(json) = result_of(ran, exit, &mut bad) else { return Err(bad) };
    let outcome = json["outcome"].as_str().unwrap_or("(missing)").to_string();
    if (outcome.as_str(), exit) != ("hang", 1) {
        bad.push(format!(
            "outcome {outcome}, exit {exit}; a driver that answers nothing must end hang, exit 1"
        ));
    }
    let p = &json["processes"];
    if p["killed_at_shutdown"].as_u64() != Some(0) || p["failed"].as_u64() != Some(0) {
        bad.push(format!("the {} blamed connectors: processes {p}", driver.name()));
    }
    let killed = json["foreign"]["killed"].as_str().unwrap_or("");
    let expected = match driver.kind {
        Misbehaviour::StopsReading => "; killed it and its process group",
        Misbehaviour::OutstaysBye => "the foreign driver said bye but did not exit",
        Misbehaviour::LeavesChild => "the foreign driver exited, leaving processes of its group running",
    };
    if !killed.contains(expected) {
        bad.push(format!("foreign.killed is {killed:?}; expected it to say {expected:?}"));
    }
    let problems = json["problems"].as_array().map(Vec::as_slice).unwrap_or_default();
    if !killed.is_empty() && !problems.iter().any(|p| p.as_str() == Some(killed)) {
        bad.push("the problem list leaves out the line saying the driver was killed".into());
    }
    if let Some(violations) = json["violations"].as_array().filter(|v| !v.is_empty()) {
        bad.push(format!("violations: {violations:?}"));
    }
    if bad.is_empty() {
        let sent = json["requests"]["sent"].as_u64().unwrap_or(0);
        Ok(Figures { outcome, exit, sent, failed: 0, bytes: 0 })
    } else {
        Err(bad)
    }
}

/// The rank an outside SIGKILL hit if pdkv cluster's start failed because that rank exited
/// before it was ready; `None` for any other refusal or failure to start.
fn killed_during_start(stderr: &str, delivered: &[String]) -> Option<String> {
    let line = stderr
        .lines()
        .find(|l| l.contains("cluster did not start: ") && l.ends_with(" exited before it was ready"))?;
    let rank = line.split("cluster did not start: ").nth(1)?.strip_suffix(" exited before it was ready")?;
    delivered.iter().any(|d| d.contains(&format!(": SIGKILL {rank} "))).then(|| rank.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_is_excused_only_when_an_outside_kill_hit_the_rank_that_did_not_start() {
        let stderr = "pdkv cluster: cluster did not start: D0.dp0.tp2 exited before it was ready\n";
        let kill = |rank: &str| vec![format!("at 27 ms: SIGKILL {rank} (pid 7145, delivered at 48 ms)")];
        let check = |stderr: &str, delivered: Vec<String>, expected: Option<&str>| {
            assert_eq!(
                killed_during_start(stderr, &delivered).as_deref(),
                expected,
                "{stderr} / {delivered:?}"
            );
        };
        check(stderr, kill("D0.dp0.tp2"), Some("D0.dp0.tp2"));
        // Another rank was killed, or it was stopped, not killed, or nothing was sent.
        check(stderr, kill("D0.dp0.tp1"), None);
        check(stderr, vec!["at 27 ms: SIGSTOP D0.dp0.tp2 for 80 ms, then SIGCONT (pid 1)".into()], None);
        check(stderr, vec![], None);
        // Any other failure to start stays a failure.
        check(
            "pdkv cluster: invalid cluster: --requests 0: must be between 1 and 1000000\n",
            kill("D0.dp0.tp2"),
            None,
        );
    }
}
