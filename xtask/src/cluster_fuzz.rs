//! `cargo xtask cluster-fuzz`: seeded random `pdkv cluster` runs with random faults, each judged
//! by invariants that must hold whatever the faults did.
//!
//! Every run draws, from the project's seeded stream (`pdkv_core::rng`) of the run's own seed,
//! a deployment, a workload, short timeouts and up to a few faults: the cluster's own (`--kill`,
//! `--drop-releases`, which it excuses) and outside ones that this task delivers itself at a
//! wall-clock moment (SIGKILL of a connector, SIGSTOP for a while then SIGCONT). Run `i` of a
//! fuzz started with `--seed S` has seed `S + i`, so `--seed S+i --max-runs 1` replays it (the
//! outside faults land at the same offsets from the start, though not at the same point of the
//! protocol, since the cluster runs on wall time).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use pdkv_core::ids::Role;
use pdkv_core::legacy::Legacy;
use pdkv_core::rng::Stream;
use pdkv_core::topology::Deployment;

const USAGE: &str = "\
usage: cargo xtask cluster-fuzz [--for DURATION] [--seed N] [--max-runs N] [--legacy NAME]...

  --for DURATION   start runs for this long (e.g. 90s, 5m, 300; default 60s)
  --seed N         seed of the first run (default: drawn from the clock and printed); run i
                   has seed N+i, so `--seed N+i --max-runs 1` replays run i
  --max-runs N     stop after N runs even if time is left
  --legacy NAME    pass `--legacy NAME` to every `pdkv cluster` (repeatable), to show that the
                   invariants catch a historical bug";

/// Deployments the runs draw from, each checked to be accepted by `pdkv cluster` with and
/// without `--mla` (its GQA model has as many KV heads as the smallest TP, so the head guard
/// accepts every pair).
const DEPLOYMENTS: [&str; 11] = [
    "1P_TP1:1D_TP1",
    "1P_TP2:1D_TP2",
    "1P_TP4:1D_TP8",
    "1P_TP8:1D_TP4",
    "1P_TP4:1D_TP2",
    "1P_TP2:1D_TP4",
    "1P_DP2TP2:1D_TP4",
    "1P_DP2:1D_TP2",
    "1P_DP2:1D_DP2",
    "2P_TP2:1D_DP2",
    "2P_TP2:1D_TP4",
];

/// A heartbeat is sent every 500 ms and a rank silent this long is lost (docs/backend.md), so
/// SIGSTOPs are drawn on both sides of it.
const HEARTBEAT_LOSS_MS: u64 = 5_000;

/// How long past its own `--timeout-ms` a cluster may take to shut down and write its result
/// before this task calls it hung: the shutdown waits for every rank, and a lost rank is found
/// only after the heartbeat limit.
const EXIT_GRACE_MS: u64 = 30_000;

/// How long a connector may outlive its cluster: it exits when its scheduler connection closes.
const ORPHAN_GRACE: Duration = Duration::from_secs(5);

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

/// The fuzzer's draws: the project's seeded stream (`pdkv_core::rng`), so a printed seed
/// replays the same run, plus the shapes the fuzzer needs.
struct Rng(Stream);

impl Rng {
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.range(lo, hi)
    }

    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.0.below(100) < percent
    }

    /// Log-uniform in `1..=max`: small values as often as large ones, so most runs stay short
    /// while some push hundreds of requests.
    fn log_uniform(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let top = 1u64 << self.range(0, bits - 1);
        self.range(top, (2 * top - 1).min(max)).max(1)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        self.0.pick(items)
    }
}

/// A fault this task delivers to a connector process from outside.
#[derive(Clone)]
struct Outside {
    /// Milliseconds after `pdkv cluster` started.
    at_ms: u64,
    /// The rank whose process gets it (the incarnation running at that moment).
    rank: String,
    /// `None` for SIGKILL; `Some(ms)` for SIGSTOP, then SIGCONT this long after.
    stop_ms: Option<u64>,
}

impl Outside {
    fn describe(&self) -> String {
        match self.stop_ms {
            None => format!("at {} ms: SIGKILL {}", self.at_ms, self.rank),
            Some(ms) => format!("at {} ms: SIGSTOP {} for {ms} ms, then SIGCONT", self.at_ms, self.rank),
        }
    }
}

/// Everything one run does, drawn from its seed.
struct Plan {
    seed: u64,
    deployment: &'static str,
    mla: bool,
    requests: u64,
    concurrency: u64,
    layers: u64,
    handshake_ms: u64,
    transfer_ms: u64,
    defer_ms: u64,
    timeout_ms: u64,
    /// `--kill RANK --kill-after N [--restart-after-ms T]`.
    kill: Option<(String, u64, Option<u64>)>,
    /// `--drop-releases RANK=N`.
    drops: Vec<(String, u64)>,
    outside: Vec<Outside>,
    legacy: Vec<String>,
}

impl Plan {
    fn draw(seed: u64, legacy: &[String]) -> Plan {
        let mut rng = Rng(Stream::new(seed, 0));
        let deployment = *rng.pick(&DEPLOYMENTS);
        let mla = rng.chance(40);
        let parsed = Deployment::parse(deployment).expect("the fuzzer's deployments parse");
        let prefill: Vec<String> = parsed.ranks(Role::Prefill).iter().map(|r| r.to_string()).collect();
        let decode: Vec<String> = parsed.ranks(Role::Decode).iter().map(|r| r.to_string()).collect();
        let requests = rng.log_uniform(256);
        let concurrency = rng.log_uniform(256);
        let layers = rng.range(1, 6);
        // Short timeouts, so a faulted run ends in seconds; handshake < transfer < defer, as
        // docs/verification.md says they must be.
        let (handshake_ms, transfer_ms, defer_ms) =
            *rng.pick(&[(1_000, 3_000, 4_000), (2_000, 5_000, 6_000)]);
        let mut kill = None;
        if rng.chance(35) && requests > 1 {
            let rank = rng.pick(&prefill).clone();
            let after = rng.range(0, requests - 1);
            let restart = rng.chance(60).then(|| rng.range(100, 3_000));
            kill = Some((rank, after, restart));
        }
        let mut drops = vec![];
        if rng.chance(25) {
            drops.push((rng.pick(&decode).clone(), rng.range(1, requests.min(8))));
        }
        let mut outside = vec![];
        // A run here takes about 50 ms per round of a few requests (measured: 256 requests take
        // 13 s one at a time, 2.2 s 256 at a time), so a moment drawn up to this estimate lands
        // before, during or after the traffic.
        let horizon_ms = 50 + 40 * requests.div_ceil(concurrency.min(8));
        for _ in 0..rng.range(0, 2) {
            if !rng.chance(45) {
                continue;
            }
            let all = [prefill.as_slice(), decode.as_slice()].concat();
            let rank = rng.pick(&all).clone();
            let at_ms = rng.range(0, horizon_ms);
            let stop_ms = if rng.chance(50) {
                None
            } else if rng.chance(70) {
                Some(rng.range(50, HEARTBEAT_LOSS_MS - 1_000))
            } else {
                Some(rng.range(HEARTBEAT_LOSS_MS + 500, HEARTBEAT_LOSS_MS + 3_000))
            };
            outside.push(Outside { at_ms, rank, stop_ms });
        }
        Plan {
            seed,
            deployment,
            mla,
            requests,
            concurrency,
            layers,
            handshake_ms,
            transfer_ms,
            defer_ms,
            // Long enough for a lost rank's transfers to be reaped (defer plus lease) after the
            // heartbeat finds it, on a loaded 2-core machine.
            timeout_ms: 60_000,
            kill,
            drops,
            outside,
            legacy: legacy.to_vec(),
        }
    }

    /// The arguments of `pdkv cluster`.
    fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec!["cluster".into(), self.deployment.into()];
        let mut flag = |name: &str, value: String| {
            a.push(name.into());
            a.push(value);
        };
        flag("--requests", self.requests.to_string());
        flag("--concurrency", self.concurrency.to_string());
        flag("--layers", self.layers.to_string());
        flag("--seed", self.seed.to_string());
        flag("--handshake-timeout-ms", self.handshake_ms.to_string());
        flag("--transfer-timeout-ms", self.transfer_ms.to_string());
        flag("--defer-timeout-ms", self.defer_ms.to_string());
        flag("--timeout-ms", self.timeout_ms.to_string());
        if let Some((rank, after, restart)) = &self.kill {
            flag("--kill", rank.clone());
            flag("--kill-after", after.to_string());
            if let Some(ms) = restart {
                flag("--restart-after-ms", ms.to_string());
            }
        }
        for (rank, n) in &self.drops {
            flag("--drop-releases", format!("{rank}={n}"));
        }
        for name in &self.legacy {
            flag("--legacy", name.clone());
        }
        if self.mla {
            a.push("--mla".into());
        }
        a.push("--json".into());
        a
    }

    fn command_line(&self, exe: &Path) -> String {
        format!("{} {}", exe.display(), self.args().join(" "))
    }

    /// Short description for the progress line.
    fn brief(&self) -> String {
        let mut s = format!(
            "{}{} req {} conc {} layers {}",
            self.deployment,
            if self.mla { " mla" } else { "" },
            self.requests,
            self.concurrency,
            self.layers
        );
        if let Some((rank, after, restart)) = &self.kill {
            let _ = write!(s, ", kill {rank} after {after}");
            if let Some(ms) = restart {
                let _ = write!(s, " restart {ms} ms");
            }
        }
        for (rank, n) in &self.drops {
            let _ = write!(s, ", drop {rank}={n}");
        }
        for o in &self.outside {
            match o.stop_ms {
                None => {
                    let _ = write!(s, ", SIGKILL {} at {} ms", o.rank, o.at_ms);
                }
                Some(ms) => {
                    let _ = write!(s, ", SIGSTOP {} at {} ms for {ms} ms", o.rank, o.at_ms);
                }
            }
        }
        s
    }
}

/// A process, named by pid and start time so a reused pid is never taken for it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Proc {
    pid: u32,
    start: u64,
}

/// One line of `/proc/PID/stat`.
struct Stat {
    ppid: u32,
    start: u64,
    state: char,
    /// The wait status (field 52), meaningful once the process is a zombie.
    exit_code: Option<i32>,
}

/// Reads `/proc/PID/stat`; the command name, in parentheses, may hold spaces, so the fields
/// are read after its closing parenthesis.
fn stat(pid: u32) -> Option<Stat> {
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
fn describe_status(status: i32) -> String {
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
fn crashed(status: i32) -> bool {
    let signal = status & 0x7f;
    (signal != 0 && signal != 9) || (signal == 0 && (status >> 8) & 0xff == 101)
}

/// Running (not a zombie) and still the same process.
fn alive(p: Proc) -> bool {
    stat(p.pid).is_some_and(|s| s.start == p.start && s.state != 'Z')
}

/// The connector children of `parent`, each with the rank its command line names.
fn connectors(parent: u32) -> Vec<(Proc, String)> {
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
fn signal(p: Proc, signal: &str) -> bool {
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
struct Ran {
    /// `None` when the process was killed by a signal, or hung and was killed by this task.
    exit: Option<i32>,
    hung: bool,
    stdout: String,
    stderr: String,
    seconds: f64,
    /// The outside faults that reached a process, described.
    delivered: Vec<String>,
    /// Outside faults whose rank had no process at their moment.
    missed: Vec<String>,
    /// Outside faults whose moment came after the run had ended.
    not_due: Vec<String>,
    /// Connectors still running after the cluster exited and the grace passed.
    orphans: Vec<String>,
    /// How connectors that ended during the run ended, where it could be seen.
    ends: Vec<String>,
    /// Of those, the ones that crashed (see [`crashed`]).
    crashes: Vec<String>,
}

fn execute(plan: &Plan, exe: &Path, dir: &Path) -> Result<Ran, String> {
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
            // The latest incarnation of the rank: a restarted prefill rank replaces the killed one.
            let target = seen.iter().rev().find(|(p, r)| **r == o.rank && alive(**p)).map(|(p, _)| *p);
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
        orphans: orphans.iter().map(|(p, r)| format!("{r} (pid {})", p.pid)).collect(),
    })
}

/// The figures of a run that passed.
struct Figures {
    outcome: String,
    exit: i32,
    sent: u64,
    failed: u64,
    bytes: u64,
}

/// Checks the invariants; the error lists every one that failed.
fn judge(plan: &Plan, ran: &Ran) -> Result<Figures, Vec<String>> {
    let mut bad = vec![];
    if ran.hung {
        bad.push(format!(
            "hang: pdkv cluster had not exited {} s after its own --timeout-ms; killed",
            EXIT_GRACE_MS / 1000
        ));
    }
    for o in &ran.orphans {
        bad.push(format!(
            "connector {o} still running {} s after its cluster exited",
            ORPHAN_GRACE.as_secs()
        ));
    }
    for c in &ran.crashes {
        bad.push(format!("connector {c}: it crashed"));
    }
    if ran.hung {
        return Err(bad);
    }
    let Some(exit) = ran.exit else {
        bad.push("pdkv cluster was ended by a signal nobody sent it".into());
        return Err(bad);
    };
    if exit == 2 {
        bad.push("pdkv cluster exited 2: it refused the arguments or could not start (see stderr)".into());
        return Err(bad);
    }
    let json: serde_json::Value = match serde_json::from_str(&ran.stdout) {
        Ok(v) => v,
        Err(e) => {
            bad.push(format!("exit {exit} and no JSON result on stdout: {e}"));
            return Err(bad);
        }
    };
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
        let faultless = plan.kill.is_none() && plan.drops.is_empty();
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
        for d in &ran.delivered {
            count(if d.contains("SIGKILL") { "outside SIGKILL" } else { "outside SIGSTOP" });
        }
        for _ in &ran.missed {
            count("outside fault missed (no process)");
        }
        if plan.kill.is_none() && plan.drops.is_empty() && ran.delivered.is_empty() {
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
        }
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
