//! Running one plan: the `pdkv cluster` process, its connector processes found through /proc,
//! and the outside SIGKILLs and SIGSTOPs delivered to them.

use super::plan::{Outside, Plan, SCHEDULER};
use super::{EXIT_GRACE_MS, ORPHAN_GRACE};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A process, named by pid and start time so a reused pid is never taken for it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Proc {
    pub(super) pid: u32,
    pub(super) start: u64,
}

/// One line of `/proc/PID/stat`.
pub(super) struct Stat {
    pub(super) ppid: u32,
    pub(super) start: u64,
    pub(super) state: char,
    /// The wait status (field 52), meaningful once the process is a zombie.
    pub(super) exit_code: Option<i32>,
}

/// Reads `/proc/PID/stat`; the command name, in parentheses, may hold spaces, so the fields
/// are read after its closing parenthesis.
pub(super) fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field n of proc(5) is fields[n - 3]: state (3), ppid (4), starttime (22), exit_code (52).
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
        exit_code: fields.get(49).and_then(|f| f.parse().ok()),
    })
}

/// How a wait status reads: `exit 1`, `signal 11 (core dumped)`.
pub(super) fn describe_status(status: i32) -> String {
    let signal = status & 0x7f;
    if signal == 0 {
        format!("exit {}", (status >> 8) & 0xff)
    } else if status & 0x80 != 0 {
        format!("signal {signal} (core dumped)")
    } else {
        format!("signal {signal}")
    }
}

/// A connector ended this way on its own: killed by a signal other than SIGKILL (which the
/// cluster's faults, its heartbeat check, its shutdown and this task send), or a panic (exit
/// 101). Exit 1 is a connector's reported error, which the cluster accounts for.
pub(super) fn crashed(status: i32) -> bool {
    let signal = status & 0x7f;
    (signal != 0 && signal != 9) || (signal == 0 && (status >> 8) & 0xff == 101)
}

/// Running (not a zombie) and still the same process.
pub(super) fn alive(p: Proc) -> bool {
    stat(p.pid).is_some_and(|s| s.start == p.start && s.state != 'Z')
}

/// The connector children of `parent`, each with the rank its command line names.
pub(super) fn connectors(parent: u32) -> Vec<(Proc, String)> {
    let mut out = vec![];
    let Ok(entries) = std::fs::read_dir("/proc") else { return out };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Some(Stat { ppid, start, state, .. }) = stat(pid) else { continue };
        if ppid != parent || state == 'Z' {
            continue;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<String> =
            cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if !args.iter().any(|a| a == "connector") {
            continue;
        }
        let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
        let (Some(role), Some(engine), Some(dp), Some(tp)) =
            (value("--role"), value("--engine"), value("--dp"), value("--tp"))
        else {
            continue;
        };
        let letter = if role == "prefill" { 'P' } else { 'D' };
        out.push((Proc { pid, start }, format!("{letter}{engine}.dp{dp}.tp{tp}")));
    }
    out
}

/// Sends `signal` (a `kill` name such as KILL) to `p` if it is still that process.
pub(super) fn signal(p: Proc, signal: &str) -> bool {
    if !alive(p) {
        return false;
    }
    Command::new("kill")
        .args([format!("-{signal}"), p.pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// What happened to one run, before judging.
pub(super) struct Ran {
    /// `None` when the process was killed by a signal, or hung and was killed by this task.
    pub(super) exit: Option<i32>,
    pub(super) hung: bool,
    pub(super) stdout: String,
    pub(super) stderr: String,
    pub(super) seconds: f64,
    /// The outside faults that reached a process, described.
    pub(super) delivered: Vec<String>,
    /// Outside faults whose rank had no process at their moment.
    pub(super) missed: Vec<String>,
    /// Outside faults whose moment came after the run had ended.
    pub(super) not_due: Vec<String>,
    /// Connectors still running after the cluster exited and the grace passed.
    pub(super) orphans: Vec<String>,
    /// How connectors that ended during the run ended, where it could be seen.
    pub(super) ends: Vec<String>,
    /// Of those, the ones that crashed (see [`crashed`]).
    pub(super) crashes: Vec<String>,
}

pub(super) fn execute(plan: &Plan, exe: &Path, dir: &Path) -> Result<Ran, String> {
    let out_path = dir.join("last.json");
    let err_path = dir.join("last.stderr");
    let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()));
    let started = Instant::now();
    let mut child: Child = Command::new(exe)
        .args(plan.args())
        .stdin(Stdio::null())
        .stdout(file(&out_path)?)
        .stderr(file(&err_path)?)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let cluster = child.id();
    let limit = Duration::from_millis(plan.timeout_ms + EXIT_GRACE_MS);
    let mut pending: Vec<Outside> = plan.outside.clone();
    // SIGCONTs owed: (when, process, rank).
    let mut resume: Vec<(Duration, Proc, String)> = vec![];
    let mut seen: BTreeMap<Proc, String> = BTreeMap::new();
    // How each connector that ended during the run ended, read from its zombie before the
    // cluster reaps it (a rank the cluster kills and reaps at once may be missed).
    let mut ended: BTreeMap<Proc, i32> = BTreeMap::new();
    let (mut delivered, mut missed) = (vec![], vec![]);
    let mut hung = false;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("waiting for pdkv cluster: {e}"))? {
            break Some(status);
        }
        let now = started.elapsed();
        for (p, rank) in connectors(cluster) {
            seen.insert(p, rank);
        }
        for p in seen.keys() {
            if ended.contains_key(p) {
                continue;
            }
            if let Some(Stat { start, state: 'Z', exit_code: Some(code), .. }) = stat(p.pid) {
                if start == p.start {
                    ended.insert(*p, code);
                }
            }
        }
        let (due, later): (Vec<Outside>, Vec<Outside>) =
            pending.into_iter().partition(|o| Duration::from_millis(o.at_ms) <= now);
        pending = later;
        for o in due {
            // The latest incarnation of the rank: a restarted prefill rank replaces the killed
            // one; or `pdkv cluster` itself.
            let target = if o.rank == SCHEDULER {
                stat(cluster).map(|s| Proc { pid: cluster, start: s.start })
            } else {
                seen.iter().rev().find(|(p, r)| **r == o.rank && alive(**p)).map(|(p, _)| *p)
            };
            let sent = target.is_some_and(|p| signal(p, if o.stop_ms.is_some() { "STOP" } else { "KILL" }));
            let at = now.as_millis();
            match (target, sent) {
                (Some(p), true) => {
                    delivered.push(format!("{} (pid {}, delivered at {at} ms)", o.describe(), p.pid));
                    if let Some(ms) = o.stop_ms {
                        resume.push((now + Duration::from_millis(ms), p, o.rank.clone()));
                    }
                }
                _ => missed.push(format!("{} (no running process at {at} ms)", o.describe())),
            }
        }
        resume.retain(|(when, p, _)| {
            if *when <= now {
                signal(*p, "CONT");
                false
            } else {
                true
            }
        });
        if now > limit {
            hung = true;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let seconds = started.elapsed().as_secs_f64();
    // A stopped process must not stay stopped once the run is over, whatever happened.
    for (_, p, _) in &resume {
        signal(*p, "CONT");
    }
    let deadline = Instant::now() + ORPHAN_GRACE;
    let mut orphans: Vec<(Proc, String)> =
        seen.iter().filter(|(p, _)| alive(**p)).map(|(p, r)| (*p, r.clone())).collect();
    while !orphans.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        orphans.retain(|(p, _)| alive(*p));
    }
    for (p, _) in &orphans {
        signal(*p, "KILL");
    }
    // What a misbehaving driver started must be gone with the run too.
    let mut left = vec![];
    if let Some(driver) = plan.driver {
        let sleepers = driver.sleepers();
        let running = || processes_running_sleep(&sleepers);
        while !running().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        for (p, arg) in running() {
            signal(p, "KILL");
            left.push(format!("the driver's `sleep {arg}` (pid {})", p.pid));
        }
    }
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let name = |p: &Proc| format!("{} (pid {})", seen.get(p).map(String::as_str).unwrap_or("?"), p.pid);
    let ends = ended.iter().map(|(p, &code)| format!("{}: {}", name(p), describe_status(code))).collect();
    let crashes = ended
        .iter()
        .filter(|(_, &code)| crashed(code))
        .map(|(p, &code)| format!("{}: {}", name(p), describe_status(code)))
        .collect();
    let not_due = pending.iter().map(|o| format!("{} (not due: the run had ended)", o.describe())).collect();
    Ok(Ran {
        not_due,
        ends,
        crashes,
        exit: status.and_then(|s| s.code()),
        hung,
        stdout: read(&out_path),
        stderr: read(&err_path),
        seconds,
        delivered,
        missed,
        orphans: orphans.iter().map(|(p, r)| format!("connector {r} (pid {})", p.pid)).chain(left).collect(),
    })
}

/// The running (not zombie) processes whose command line is `sleep ARG` for one of `args`.
fn processes_running_sleep(args: &[String]) -> Vec<(Proc, String)> {
    let mut out = vec![];
    let Ok(entries) = std::fs::read_dir("/proc") else { return out };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let words: Vec<String> = cmdline
            .split(|&b| b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        let [sleep, arg] = words.as_slice() else { continue };
        if sleep != "sleep" || !args.contains(arg) {
            continue;
        }
        if let Some(Stat { start, state, .. }) = stat(pid) {
            if state != 'Z' {
                out.push((Proc { pid, start }, arg.clone()));
            }
        }
    }
    out
}
