//! The mixed deployments of `cargo xtask moriio-conformance`: `pdkv cluster --foreign-side`
//! runs in which vLLM 0.33's own MoRIIO code (tests/moriio/mixed.py) plays one side and real
//! `pdkv connector` processes the other, each judged on every transfer being accounted exactly
//! once on both sides.
//!
//! - vLLM decode against pdkv prefill: vLLM's dialer handshakes with pdkv's listeners and its
//!   release sender releases pdkv's transfers; every transfer must be freed by its releases,
//!   none by the reaper, none twice.
//! - pdkv decode against vLLM prefill: pdkv's decode ranks dial vLLM's handshake listener,
//!   which answers with a pdkv data-plane descriptor as its `agent_metadata` (MoRI's data plane
//!   cannot run here), read the bytes from pdkv's data-plane servers and verify each one, and
//!   release to vLLM's notify receiver, whose own ack accounting must finish every transfer on
//!   every rank holding it exactly once.
//!
//! Three runs restart a prefill rank mid-run (`--kill RANK --kill-after N --restart-after-ms T`)
//! and record what each side does after it, each with an expectation that documents the
//! behaviour observed (and fails when it changes):
//!
//! - vLLM decode, a pdkv prefill rank restarted: the driver reports every read vLLM's
//!   `_read_blocks` would post (its block ids and the session it goes through, from vLLM's own
//!   `_get_built_session`), and `pdkv cluster` judges each against the process holding the KV
//!   (`foreign.reads`): through the holder's live session, stale (an old incarnation's blocks
//!   through the new incarnation's session), or through a dead process's session. Killed after
//!   the first prefill, before vLLM ever dialled the rank, vLLM's first handshake reaches the
//!   restarted process and it reads the old incarnation's transfers through it (stale). Killed
//!   mid-run, vLLM never handshakes again, and every read of the rank goes through the dead
//!   process's session.
//! - pdkv decode, a vLLM prefill rank restarted (the driver stops its listeners and tables, the
//!   cluster its data-plane server, and both start afresh on the same ports): vLLM's answers
//!   name no incarnation, so pdkv's decode reads old block ids through the new session; the new
//!   data-plane server refuses blocks it never filled (`revoked`), so the stale reads fail
//!   instead of reading wrong bytes, and the byte check must find no wrong byte.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use pdkv_core::topology::Deployment;
use serde_json::Value;

use super::matrix::{Case, Direction, Documented, Interaction, Verdict, Wire};

/// Which side vLLM's code plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Prefill,
    Decode,
}

/// What a run must show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Every request finished; every transfer freed once by its releases.
    Clean,
    /// vLLM 0.33's own listeners (base + dp + tp) cannot all bind on one host for a DP x TP
    /// prefill: the run must refuse to start, saying so.
    ListenerCollision,
    /// vLLM decode, a pdkv prefill rank restarted before vLLM first dialled it: vLLM's first
    /// handshake reaches the restarted process, and it reads transfers of the old incarnation
    /// through the new incarnation's session (stale reads), none through a dead session.
    StaleReads,
    /// vLLM decode, a pdkv prefill rank restarted after vLLM handshook with it: vLLM never
    /// handshakes again, and reads of the rank after the kill go through the dead process's
    /// session; none is stale.
    DeadSession,
    /// pdkv decode, a vLLM prefill rank restarted: pdkv's decode reads old block ids through
    /// the restarted rank's new session, and the new data-plane server refuses them (revoked);
    /// no wrong byte is read.
    RefusedStaleReads,
    /// vLLM decode of a release that reads DP rank 0 whatever rank owns the request (0.25,
    /// 0.26), a DP > 1 pdkv prefill: the transfers DP rank 0 holds are read and released; the
    /// others are read at DP rank 0, whose processes do not hold them (vLLM answers each request
    /// as received: on hardware it read another request's memory), and their holders, released
    /// by nobody, are reaped. pdkv's side: nothing held, no double free.
    ReadsDp0,
}

/// What `run` must show against a release following `rules`: a release whose decode reads DP
/// rank 0 alone reads a DP > 1 prefill wrongly ([`Expect::ReadsDp0`]); everything else as the
/// run says.
fn expectation(run: &Run, rules: pdkv_core::policy::PeerRules) -> Expect {
    let prefill_dp =
        Deployment::parse(run.deployment).map_or(1, |d| d.prefill.iter().map(|l| l.dp).max().unwrap_or(1));
    if run.expect == Expect::Clean
        && run.side == Side::Decode
        && prefill_dp > 1
        && rules.read_owner() == pdkv_core::policy::ReadOwner::Dp0
    {
        Expect::ReadsDp0
    } else {
        run.expect
    }
}

/// A prefill rank killed and restarted during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Restart {
    /// The rank (`--kill`).
    rank: &'static str,
    /// Prefilled requests before the kill (`--kill-after`).
    after: u32,
    /// `--restart-after-ms`.
    delay_ms: u32,
    /// Requests of the run.
    requests: u32,
    /// `--hold-dispatches-until-restart`: the requests the killed rank's group holds are
    /// dispatched to decode only once the rank is back, so they are read after the restart
    /// however slow the machine (the expectations that need reads after the restart).
    hold: bool,
}

/// One mixed run.
#[derive(Clone, Copy, Debug)]
struct Run {
    side: Side,
    deployment: &'static str,
    mla: bool,
    /// What the layout exercises, for the matrix.
    about: &'static str,
    expect: Expect,
    restart: Option<Restart>,
}

impl Run {
    fn requests(&self) -> u32 {
        self.restart.map_or(REQUESTS, |r| r.requests)
    }
}

/// Requests per run, 32 in flight: enough for transfers to overlap on every rank.
const REQUESTS: u32 = 200;

/// Timeouts of the restart runs: the reaper frees what a killed rank held after 3 s rather than
/// MoRIIO's 60 s, and a dial waits 2 s, well past the restart.
const RESTART_TIMEOUTS: [(&str, &str); 3] =
    [("--handshake-timeout-ms", "2000"), ("--transfer-timeout-ms", "2500"), ("--defer-timeout-ms", "3000")];

/// The substring of pdkv's read error when a data-plane server refuses blocks its process never
/// filled (`transport::ReadError`, `RemoteCode::Revoked`).
const REVOKED: &str = "refused the read (revoked)";

const RUNS: &[Run] = &[
    Run {
        side: Side::Decode,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P TP = D TP",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_DP2TP2:1D_TP2",
        mla: false,
        about: "DP x TP prefill",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP4:1D_TP2",
        mla: false,
        about: "P > D",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP4:1D_TP1",
        mla: true,
        about: "P > D, flexible MLA reads",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P TP = D TP",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_TP4:1D_TP2",
        mla: false,
        about: "P > D",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_DP2:1D_TP2",
        mla: false,
        about: "DP prefill (TP1)",
        expect: Expect::Clean,
        restart: None,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_DP2TP2:1D_TP2",
        mla: false,
        about: "DP x TP prefill",
        expect: Expect::ListenerCollision,
        restart: None,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P0.dp0.tp1 restarted before vLLM dialled it",
        expect: Expect::StaleReads,
        restart: Some(Restart { rank: "P0.dp0.tp1", after: 1, delay_ms: 300, requests: 100, hold: true }),
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P0.dp0.tp1 restarted after vLLM handshook",
        expect: Expect::DeadSession,
        // No hold: vLLM must have handshaken with the rank before the kill, which the closed
        // loop guarantees: 50 prefills at 32 in flight need 18 requests ended first, and vLLM
        // answers one only once every TP rank of its group handshook (an unexcused failure
        // before the kill fails the run instead).
        restart: Some(Restart { rank: "P0.dp0.tp1", after: 50, delay_ms: 300, requests: 150, hold: false }),
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "vLLM's P0.dp0.tp1 restarted",
        expect: Expect::RefusedStaleReads,
        restart: Some(Restart { rank: "P0.dp0.tp1", after: 1, delay_ms: 300, requests: 100, hold: true }),
    },
];

/// Paths a run needs.
pub struct Tools<'a> {
    pub pdkv: &'a Path,
    pub python: &'a Path,
    pub root: &'a Path,
    pub vllm_src: &'a Path,
    /// The release's rule set, which the foreign engines follow (`--foreign-rules`).
    pub rules: pdkv_core::policy::PeerRules,
}

/// The mixed runs' cases for the matrix, and what each restart run showed, in words.
pub struct Mixed {
    pub cases: Vec<Case>,
    /// One line per restart run: the run and what each side did.
    pub restarts: Vec<String>,
}

/// Runs every mixed deployment and returns its cases.
pub fn cases(tools: &Tools, verbose: bool) -> Mixed {
    let mut out = Mixed { cases: Vec::new(), restarts: Vec::new() };
    for run in RUNS {
        let started = Instant::now();
        let run = &Run { expect: expectation(run, tools.rules), ..*run };
        let outcome = execute(tools, run, verbose);
        let judged = judge(run, &outcome);
        let verdict =
            if judged.cases.iter().all(|c| c.verdict != Verdict::Fails) { "as expected" } else { "FAILED" };
        eprintln!(
            "moriio-conformance: mixed {} ({}): {verdict} in {:.1} s",
            label(run),
            run.about,
            started.elapsed().as_secs_f64()
        );
        if let Some(note) = judged.note {
            eprintln!("moriio-conformance:   {note}");
            out.restarts.push(format!("{} ({}), {verdict}: {note}", label(run), run.about));
        }
        out.cases.extend(judged.cases);
    }
    out
}

fn label(run: &Run) -> String {
    let who = match run.side {
        Side::Decode => "vLLM decode, pdkv prefill",
        Side::Prefill => "pdkv decode, vLLM prefill",
    };
    format!("{}{} [{who}]", run.deployment, if run.mla { " MLA" } else { "" })
}

/// What `pdkv cluster` did: its exit code, its JSON result if it wrote one, its stderr.
struct Outcome {
    code: Option<i32>,
    result: Option<Value>,
    stderr: String,
}

fn execute(tools: &Tools, run: &Run, verbose: bool) -> Outcome {
    let side = match run.side {
        Side::Decode => "decode",
        Side::Prefill => "prefill",
    };
    let mut cmd = Command::new(tools.pdkv);
    cmd.args(["cluster", run.deployment, "--requests", &run.requests().to_string(), "--concurrency", "32"])
        .args(["--json", "--timeout-ms", "120000", "--foreign-side", side])
        .args(["--foreign-rules", tools.rules.name()])
        .arg("--foreign-driver")
        .arg(tools.python)
        .arg("--foreign-driver-arg")
        .arg(tools.root.join("tests/moriio/mixed.py"))
        .args(["--foreign-driver-arg", "--vllm-src", "--foreign-driver-arg"])
        .arg(tools.vllm_src)
        .args(["--foreign-driver-arg", "--stubs", "--foreign-driver-arg"])
        .arg(tools.root.join("tests/moriio/stubs"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null());
    if run.mla {
        cmd.arg("--mla");
    }
    if run.expect == Expect::ReadsDp0 {
        // The reaper frees the holders nobody released after 3 s, not MoRIIO's 60.
        for (flag, value) in RESTART_TIMEOUTS {
            cmd.args([flag, value]);
        }
    }
    if let Some(restart) = &run.restart {
        cmd.args(["--kill", restart.rank, "--kill-after", &restart.after.to_string()])
            .args(["--restart-after-ms", &restart.delay_ms.to_string()]);
        if restart.hold {
            cmd.arg("--hold-dispatches-until-restart");
        }
        for (flag, value) in RESTART_TIMEOUTS {
            cmd.args([flag, value]);
        }
    }
    if verbose {
        cmd.args(["--foreign-driver-arg", "--verbose"]);
    }
    match cmd.output() {
        Ok(out) => Outcome {
            code: out.status.code(),
            result: serde_json::from_slice(&out.stdout).ok(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        },
        Err(e) => {
            Outcome { code: None, result: None, stderr: format!("cannot run {}: {e}", tools.pdkv.display()) }
        }
    }
}

fn u(v: &Value, path: &[&str]) -> u64 {
    path.iter().try_fold(v, |v, k| v.get(k)).and_then(Value::as_u64).unwrap_or(u64::MAX)
}

/// A run's cases and, for a restart run, what it showed.
struct Judged {
    cases: Vec<Case>,
    note: Option<String>,
}

/// The cases of one run: the whole deployment, and the handshake and release interactions it
/// carried (in the direction the run has them); a restart run is one case, with what it showed.
fn judge(run: &Run, outcome: &Outcome) -> Judged {
    if let Some(restart) = &run.restart {
        return judge_restart(run, restart, outcome);
    }
    if run.expect == Expect::ReadsDp0 {
        return judge_reads_dp0(run, outcome);
    }
    Judged { cases: judge_steady(run, outcome), note: None }
}

/// A run judged as one case of the whole deployment, with what it showed.
fn one_case(
    run: &Run,
    direction: Direction,
    verdict: Verdict,
    detail: Option<String>,
    note: Option<String>,
) -> Judged {
    let class = format!("{} ({})", label(run), run.about);
    Judged {
        cases: vec![Case { interaction: Interaction::Wire(Wire::Mixed), direction, class, verdict, detail }],
        note,
    }
}

/// Why a run has no result: its exit code and the last lines it wrote.
fn no_result(outcome: &Outcome) -> String {
    let tail: Vec<&str> = outcome.stderr.lines().rev().take(6).collect();
    format!("no result (exit {:?}): {}", outcome.code, tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
}

/// A run in which vLLM's decode reads DP rank 0 for every request ([`Expect::ReadsDp0`]).
fn judge_reads_dp0(run: &Run, outcome: &Outcome) -> Judged {
    let one = |verdict, detail, note| one_case(run, Direction::VllmToPdkv, verdict, detail, note);
    let Some(r) = &outcome.result else {
        return one(Verdict::Fails, Some(no_result(outcome)), None);
    };
    let (n, ranks) = (u64::from(run.requests()), decode_ranks(run.deployment));
    let (freed, reaped) = (u(r, &["ledger", "freed"]), u(r, &["ledger", "reaped"]));
    let reads = &r["foreign"]["reads"];
    let (planned, holder, unmatched) =
        (u(reads, &["planned"]), u(reads, &["through_holder"]), u(reads, &["unmatched"]));
    let violations = r.get("violations").and_then(Value::as_array).map_or(0, Vec::len);
    let checks = [
        (
            u(r, &["requests", "finished"]) == n,
            format!("{} of {n} finished", u(r, &["requests", "finished"])),
        ),
        (u(&r["foreign"], &["received"]) == n, "vLLM decode did not answer every request".to_string()),
        (
            freed.checked_add(reaped) == Some(n) && reaped > 0 && freed > 0,
            format!("{freed} freed and {reaped} reaped of {n}"),
        ),
        (
            u(r, &["ledger", "held"]) == 0 && u(r, &["ledger", "double_frees"]) == 0,
            format!("ledger {}", r["ledger"]),
        ),
        (planned == n * ranks, format!("vLLM planned {planned} reads of {}", n * ranks)),
        (
            holder == freed * ranks && unmatched == reaped * ranks,
            format!("{holder} reads through the holder, {unmatched} unmatched"),
        ),
        (violations == 0, format!("{violations} violations: {}", r["violations"])),
        (u(&r["foreign"]["stats"], &["problems"]) == 0, "the vLLM side reported problems".to_string()),
    ];
    let wrong: Vec<String> = checks.into_iter().filter(|(ok, _)| !ok).map(|(_, what)| what).collect();
    if !wrong.is_empty() {
        return one(Verdict::Fails, Some(wrong.join("; ")), None);
    }
    let note = format!(
        "vLLM read DP rank 0 for every request: the {freed} transfers DP rank 0 held were read and \
         released; the {reaped} of DP rank 1 were read at DP rank 0, whose processes do not hold them \
         ({unmatched} reads; on hardware another request's memory), and their holders were reaped; pdkv: \
         nothing held, no double free, no violation"
    );
    one(Verdict::Documented(Documented::ReadsDp0), None, Some(note))
}

/// The cases of a run without a restart.
fn judge_steady(run: &Run, outcome: &Outcome) -> Vec<Case> {
    let direction = match run.side {
        Side::Decode => Direction::VllmToPdkv,
        Side::Prefill => Direction::PdkvToVllm,
    };
    let class = format!("{} ({})", label(run), run.about);
    let case = |wire, verdict, detail| Case {
        interaction: Interaction::Wire(wire),
        direction,
        class: class.clone(),
        verdict,
        detail,
    };
    let tail = |s: &str| {
        s.lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ")
    };
    if run.expect == Expect::ListenerCollision {
        // The driver names the rank, the port and why, and the cluster refuses to start (2).
        let said = outcome.stderr.contains("already in use") || outcome.stderr.contains("collide");
        let verdict = if outcome.code == Some(2) && said {
            (Verdict::Documented(Documented::ListenerOffset), None)
        } else {
            (
                Verdict::Fails,
                Some(format!(
                    "expected vLLM's listeners to collide (exit 2), got {:?}: {}",
                    outcome.code,
                    tail(&outcome.stderr)
                )),
            )
        };
        return vec![case(Wire::Mixed, verdict.0, verdict.1)];
    }
    let Some(r) = &outcome.result else {
        let detail = format!("no result (exit {:?}): {}", outcome.code, tail(&outcome.stderr));
        return vec![case(Wire::Mixed, Verdict::Fails, Some(detail))];
    };
    let n = u64::from(run.requests());
    let mut wrong = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            wrong.push(what);
        }
    };
    let outcome_name = r.get("outcome").and_then(Value::as_str).unwrap_or("?");
    check(outcome_name == "clean", format!("outcome {outcome_name}"));
    check(
        u(r, &["requests", "finished"]) == n,
        format!("{} of {n} finished", u(r, &["requests", "finished"])),
    );
    check(
        u(r, &["ledger", "freed"]) == n,
        format!("{} of {n} transfers freed by releases", u(r, &["ledger", "freed"])),
    );
    for key in ["reaped", "held", "double_frees"] {
        check(u(r, &["ledger", key]) == 0, format!("ledger {key} {}", u(r, &["ledger", key])));
    }
    let violations = r.get("violations").and_then(Value::as_array).map_or(0, Vec::len);
    check(violations == 0, format!("{violations} violations: {}", r["violations"]));
    check(u(r, &["processes", "failed"]) == 0, "a pdkv process failed".into());
    check(u(r, &["processes", "killed_at_shutdown"]) == 0, "a pdkv process had to be killed".into());
    let foreign = &r["foreign"];
    check(
        u(foreign, &["unexpected_finishes"]) == 0,
        "the vLLM side finished a transfer it did not hold".into(),
    );
    let stats = &foreign["stats"];
    // The driver's own view: nothing it reported wrong, no vLLM listener thread ended.
    for key in ["problems", "listener_threads_dead"] {
        check(u(stats, &[key]) == 0, format!("vLLM side {key} {}", u(stats, &[key])));
    }
    match run.side {
        Side::Decode => {
            check(
                u(foreign, &["received"]) == n,
                format!("vLLM decode handled {} of {n}", u(foreign, &["received"])),
            );
            check(u(stats, &["recv_unanswered"]) == 0, "vLLM decode left requests unanswered".into());
        }
        Side::Prefill => {
            // Every rank of the owner group holds the transfer under vLLM's rules, and vLLM's
            // get_finished must report it on each exactly once.
            let tp = prefill_tp(run.deployment);
            let want = n * u64::from(tp);
            check(
                u(foreign, &["finished"]) == want,
                format!("vLLM finished {} of {want} rank transfers", u(foreign, &["finished"])),
            );
            // vLLM's tables end empty: every transfer registered was retired, no ack is waiting
            // for a transfer it never heard of.
            for key in ["transfers_held_at_shutdown", "pending_unmapped_acks"] {
                check(u(stats, &[key]) == 0, format!("vLLM prefill {key} {}", u(stats, &[key])));
            }
            let verified = u(r, &["bytes_verified"]);
            let prompt = u(r, &["prompt_kv_bytes"]);
            check(
                verified != u64::MAX && verified >= prompt && prompt > 0,
                format!("verified {verified} of {prompt} KV bytes"),
            );
        }
    }
    let problems = r.get("problems").and_then(Value::as_array).map_or(0, Vec::len);
    let summary = format!(
        "{n} requests; freed {} by releases, reaped {}; foreign {}; {problems} notes",
        u(r, &["ledger", "freed"]),
        u(r, &["ledger", "reaped"]),
        stats
    );
    let failed = if wrong.is_empty() { None } else { Some(format!("{}: {}", wrong.join("; "), summary)) };
    let verdict = |f: &Option<String>| if f.is_none() { Verdict::Works } else { Verdict::Fails };
    // The handshake worked if every request got through it; the releases if every transfer was
    // freed by them.
    let finished = u(r, &["requests", "finished"]) == n;
    let freed = u(r, &["ledger", "freed"]) == n && u(r, &["ledger", "reaped"]) == 0;
    let hs = (!finished)
        .then(|| format!("{} of {n} requests got through: {summary}", u(r, &["requests", "finished"])));
    let rel = (!freed).then(|| format!("freed {} of {n}: {summary}", u(r, &["ledger", "freed"])));
    vec![
        case(Wire::Mixed, verdict(&failed), failed.clone()),
        case(Wire::Handshake, verdict(&hs), hs.clone()),
        case(Wire::ReleaseNotify, verdict(&rel), rel.clone()),
    ]
}

/// The prefill TP size of a deployment of one prefill engine.
fn prefill_tp(deployment: &str) -> u16 {
    Deployment::parse(deployment).map_or(1, |d| d.prefill.first().map_or(1, |l| l.tp))
}

/// The decode ranks of a deployment (every one plans a read of every request it takes).
fn decode_ranks(deployment: &str) -> u64 {
    Deployment::parse(deployment).map_or(1, |d| d.decode.iter().map(|l| u64::from(l.ranks())).sum())
}

/// A restart run: pdkv's side must stay clean (every failure and reaping excused by the kill,
/// nothing held, no violation: no protocol error, no wrong byte) whatever the foreign side did,
/// and what the foreign side did must be what `run.expect` documents. The note says what
/// happened, in figures.
fn judge_restart(run: &Run, restart: &Restart, outcome: &Outcome) -> Judged {
    let direction = match run.side {
        Side::Decode => Direction::VllmToPdkv,
        Side::Prefill => Direction::PdkvToVllm,
    };
    let one = |verdict, detail, note| one_case(run, direction, verdict, detail, note);
    let Some(r) = &outcome.result else {
        return one(Verdict::Fails, Some(no_result(outcome)), None);
    };
    let n = u64::from(restart.requests);
    let mut wrong = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            wrong.push(what);
        }
    };
    // pdkv's side.
    let outcome_name = r.get("outcome").and_then(Value::as_str).unwrap_or("?");
    check(outcome_name == "clean", format!("outcome {outcome_name}"));
    let (finished, failed) = (u(r, &["requests", "finished"]), u(r, &["requests", "failed"]));
    check(finished.saturating_add(failed) == n, format!("{finished} finished and {failed} failed of {n}"));
    check(
        u(r, &["requests", "failed_excused"]) == failed,
        format!("{failed} failed, {} excused", u(r, &["requests", "failed_excused"])),
    );
    let reaped = u(r, &["ledger", "reaped"]);
    check(
        u(r, &["ledger", "reaped_excused"]) == reaped,
        format!("{reaped} reaped, {} excused", u(r, &["ledger", "reaped_excused"])),
    );
    for key in ["held", "double_frees"] {
        check(u(r, &["ledger", key]) == 0, format!("ledger {key} {}", u(r, &["ledger", key])));
    }
    let violations = r.get("violations").and_then(Value::as_array).map_or(0, Vec::len);
    check(violations == 0, format!("{violations} violations: {}", r["violations"]));
    check(u(r, &["processes", "failed"]) == 0, "a pdkv process failed".into());
    check(u(r, &["processes", "killed_at_shutdown"]) == 0, "a pdkv process had to be killed".into());
    // With the hold, the requests the killed group held waited for its restart: some held,
    // none dispatched while it was down.
    let (held, while_down) =
        (u(r, &["requests", "held_for_restart"]), u(r, &["requests", "dispatched_while_down"]));
    if restart.hold {
        check(
            held > 0 && held != u64::MAX && while_down == 0,
            format!(
                "{held} dispatches held for the restart, {while_down} dispatched while the rank was down"
            ),
        );
    }
    let faults: Vec<&str> = r
        .get("faults")
        .and_then(Value::as_array)
        .map_or(Vec::new(), |f| f.iter().filter_map(Value::as_str).collect());
    let restarted = format!("{} restarted", restart.rank);
    check(
        faults.iter().any(|f| f.starts_with(&format!("killed {} ", restart.rank)))
            && faults.iter().any(|f| f.starts_with(&restarted)),
        format!("{} was not killed and restarted: faults {faults:?}", restart.rank),
    );
    // The foreign side's own view: nothing it reported wrong, no listener thread died.
    let foreign = &r["foreign"];
    let stats = &foreign["stats"];
    check(
        u(foreign, &["unexpected_finishes"]) == 0,
        "the vLLM side finished a transfer it did not hold".into(),
    );
    for key in ["problems", "listener_threads_dead"] {
        check(u(stats, &[key]) == 0, format!("vLLM side {key} {}", u(stats, &[key])));
    }
    let pdkv = if failed == 0 && reaped == 0 {
        format!("pdkv: {finished} finished, none failed or reaped, nothing held, no violation")
    } else {
        format!(
            "pdkv: {finished} finished, {failed} failed and {reaped} reaped (all excused by the kill), nothing \
             held, no violation"
        )
    };
    let pdkv = if restart.hold {
        format!("{pdkv}; {held} decode dispatches held until the restart, none dispatched while the rank was down")
    } else {
        pdkv
    };
    let (documented, note) = match run.side {
        Side::Decode => {
            check(
                u(foreign, &["received"]) == n,
                format!("vLLM decode handled {} of {n}", u(foreign, &["received"])),
            );
            check(u(stats, &["recv_unanswered"]) == 0, "vLLM decode left requests unanswered".into());
            let reads = &foreign["reads"];
            let planned = u(reads, &["planned"]);
            let want = n * decode_ranks(run.deployment);
            check(planned == want, format!("vLLM planned {planned} reads of {want}"));
            check(u(reads, &["unmatched"]) == 0, format!("unmatched reads: {}", reads["notes"]));
            let (stale, dead, holder) =
                (u(reads, &["stale"]), u(reads, &["through_dead_session"]), u(reads, &["through_holder"]));
            // The lives whose sessions the decode ranks that read the killed rank went through.
            let target = format!("-> {}", restart.rank);
            let lives: Vec<&Value> = reads["sessions"].as_object().map_or(Vec::new(), |m| {
                m.iter().filter(|(k, _)| k.ends_with(&target)).map(|(_, v)| v).collect()
            });
            let only =
                |life: u64| !lives.is_empty() && lives.iter().all(|v| *v == &serde_json::json!([life]));
            let handshakes = u(stats, &["handshakes_dialled"]);
            if run.expect == Expect::StaleReads {
                check(
                    stale > 0 && dead == 0,
                    format!("{stale} stale reads and {dead} through a dead session"),
                );
                check(
                    only(1),
                    format!("sessions with {}: {lives:?}, not the restarted process's alone", restart.rank),
                );
                let note = format!(
                    "vLLM first handshook with {} after its restart and read {stale} transfers of the old \
                     incarnation (life 0) through the new incarnation's session (life 1): stale reads; {holder} of \
                     {planned} reads through the holder's live session, {dead} through a dead one; {pdkv}",
                    restart.rank
                );
                (Documented::RestartStaleRead, note)
            } else {
                check(
                    stale == 0 && dead > 0,
                    format!("{stale} stale reads and {dead} through a dead session"),
                );
                check(
                    only(0),
                    format!("sessions with {}: {lives:?}, not the dead process's alone", restart.rank),
                );
                let key = format!("{}: held by life 1, read through life 0", restart.rank);
                let new = u(reads, &["by_lives", &key]);
                let new = if new == u64::MAX { 0 } else { new };
                let note = format!(
                    "vLLM never handshook with {} again ({handshakes} handshakes dialled in all, before the \
                     kill): {dead} reads went through the dead process's session (life 0), {new} of them of \
                     transfers the restarted process holds; {stale} stale; {holder} of {planned} reads through \
                     the holder's live session; {pdkv}",
                    restart.rank
                );
                (Documented::RestartDeadSession, note)
            }
        }
        Side::Prefill => {
            for (key, want) in [("ranks_killed", 1), ("ranks_restarted", 1), ("listener_threads_killed", 2)] {
                check(
                    u(stats, &[key]) == want,
                    format!("vLLM prefill {key} {}, not {want}", u(stats, &[key])),
                );
            }
            check(
                u(stats, &["transfers_held_at_shutdown"]) == 0,
                format!("vLLM prefill ended holding {} transfers", u(stats, &["transfers_held_at_shutdown"])),
            );
            let verified = u(r, &["bytes_verified"]);
            let prompt = u(r, &["prompt_kv_bytes"]);
            check(
                verified != u64::MAX && verified >= prompt && prompt > 0,
                format!("verified {verified} of {prompt} KV bytes"),
            );
            let failures = r.get("failures").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
            let revoked = failures
                .iter()
                .filter(|f| {
                    f["errors"]
                        .as_array()
                        .is_some_and(|e| e.iter().any(|e| e.as_str().is_some_and(|e| e.contains(REVOKED))))
                })
                .count() as u64;
            check(revoked > 0, format!("no read was refused as revoked (failures: {failed})"));
            let pending = u(stats, &["pending_unmapped_acks"]);
            let note = format!(
                "pdkv's decode read the old block ids of {revoked} transfers through the restarted vLLM rank's \
                 new session (vLLM names no incarnation, so nothing fenced them); the restarted data-plane \
                 server refused each (revoked: blocks its process never filled), so no wrong byte was read \
                 ({verified} bytes verified, 0 mismatches); requests failed otherwise (at the dead server): {}; \
                 vLLM's restarted rank ended with {pending} releases of transfers it never knew in \
                 _pending_unmapped_acks; {pdkv}",
                failed.saturating_sub(revoked)
            );
            (Documented::RestartUnfenced, note)
        }
    };
    if wrong.is_empty() {
        one(Verdict::Documented(documented), None, Some(note))
    } else {
        one(Verdict::Fails, Some(format!("{}: {note}", wrong.join("; "))), Some(note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(side: Side, expect: Expect) -> Run {
        Run { side, deployment: "1P_TP2:1D_TP2", mla: false, about: "test", expect, restart: None }
    }

    /// `at`'s value at `path` becomes `value` (objects on the way are made).
    fn patch_json(r: &mut Value, patch: &[(&[&str], Value)]) {
        for (path, value) in patch {
            let (last, parents) = path.split_last().unwrap();
            let mut at = &mut *r;
            for p in parents {
                at = &mut at[*p];
            }
            at[*last] = value.clone();
        }
    }

    fn result(patch: &[(&[&str], Value)]) -> Outcome {
        let mut r = serde_json::json!({
            "outcome": "clean",
            "requests": {"finished": REQUESTS},
            "ledger": {"freed": REQUESTS, "reaped": 0, "held": 0, "double_frees": 0},
            "violations": [],
            "processes": {"failed": 0, "killed_at_shutdown": 0},
            "bytes_verified": 4096, "prompt_kv_bytes": 4096,
            "problems": [],
            "foreign": {"received": REQUESTS, "finished": 2 * REQUESTS, "unexpected_finishes": 0, "stats": {
                "problems": 0, "listener_threads_dead": 0, "recv_unanswered": 0,
                "transfers_held_at_shutdown": 0, "pending_unmapped_acks": 0
            }}
        });
        for (path, value) in patch {
            let (last, parents) = path.split_last().unwrap();
            let mut at = &mut r;
            for p in parents {
                at = at.get_mut(*p).unwrap();
            }
            at[*last] = value.clone();
        }
        Outcome { code: Some(0), result: Some(r), stderr: String::new() }
    }

    fn verdicts(run: &Run, outcome: &Outcome) -> Vec<(Wire, Verdict)> {
        judge(run, outcome)
            .cases
            .into_iter()
            .map(|c| {
                (
                    match c.interaction {
                        Interaction::Wire(w) => w,
                        _ => unreachable!(),
                    },
                    c.verdict,
                )
            })
            .collect()
    }

    #[test]
    fn a_run_works_only_when_every_transfer_is_accounted_once() {
        use Verdict::{Fails, Works};
        let works = vec![(Wire::Mixed, Works), (Wire::Handshake, Works), (Wire::ReleaseNotify, Works)];
        for side in [Side::Decode, Side::Prefill] {
            assert_eq!(verdicts(&run(side, Expect::Clean), &result(&[])), works);
        }
        let check = |side, patch: &[(&[&str], Value)], expected: [Verdict; 3]| {
            let got: Vec<Verdict> =
                verdicts(&run(side, Expect::Clean), &result(patch)).into_iter().map(|(_, v)| v).collect();
            assert_eq!(got, expected, "{patch:?}");
        };
        // One transfer reaped instead of released: the releases failed, the handshakes did not.
        check(
            Side::Decode,
            &[
                (&["ledger", "freed"], (REQUESTS - 1).into()),
                (&["ledger", "reaped"], 1.into()),
                (&["outcome"], "leak".into()),
            ],
            [Fails, Works, Fails],
        );
        // A request that failed (a handshake vLLM's dialer refused).
        check(
            Side::Decode,
            &[
                (&["requests", "finished"], (REQUESTS - 1).into()),
                (&["foreign", "received"], (REQUESTS - 1).into()),
                (&["outcome"], "failed_requests".into()),
            ],
            [Fails, Fails, Works],
        );
        // vLLM finished a transfer twice on one rank, or one rank never finished one.
        check(Side::Prefill, &[(&["foreign", "unexpected_finishes"], 1.into())], [Fails, Works, Works]);
        check(Side::Prefill, &[(&["foreign", "finished"], (2 * REQUESTS - 1).into())], [Fails, Works, Works]);
        // Bytes not all verified.
        check(Side::Prefill, &[(&["bytes_verified"], 0.into())], [Fails, Works, Works]);
        check(
            Side::Decode,
            &[(&["violations"], serde_json::json!([{"kind": "double_free"}]))],
            [Fails, Works, Works],
        );
        // vLLM's side ended with a transfer still mapped, or a listener thread dead, or said
        // nothing of it.
        check(
            Side::Prefill,
            &[(&["foreign", "stats", "transfers_held_at_shutdown"], 1.into())],
            [Fails, Works, Works],
        );
        check(
            Side::Decode,
            &[(&["foreign", "stats", "listener_threads_dead"], 1.into())],
            [Fails, Works, Works],
        );
        check(Side::Decode, &[(&["foreign", "stats"], serde_json::json!({}))], [Fails, Works, Works]);
    }

    #[test]
    fn vllms_listener_collision_is_documented_only_when_it_happens() {
        let collide = run(Side::Prefill, Expect::ListenerCollision);
        let refused =
            Outcome { code: Some(2), result: None, stderr: "P0.dp1.tp0: port 7 already in use".into() };
        assert_eq!(
            verdicts(&collide, &refused),
            vec![(Wire::Mixed, Verdict::Documented(Documented::ListenerOffset))]
        );
        assert_eq!(verdicts(&collide, &result(&[])), vec![(Wire::Mixed, Verdict::Fails)]);
    }

    #[test]
    fn prefill_tp_of_the_runs() {
        let check = |d: &str, tp: u16| assert_eq!(prefill_tp(d), tp, "{d}");
        check("1P_TP2:1D_TP2", 2);
        check("1P_DP2TP2:1D_TP2", 2);
        check("1P_DP2:1D_TP2", 1);
        check("1P_TP4:1D_TP1", 4);
    }

    /// The restart run of `expect` as the observed run ended, patched.
    fn restart_result(expect: Expect, patch: &[(&[&str], Value)]) -> (Run, Outcome) {
        let run = *RUNS.iter().find(|r| r.expect == expect).expect("a run of each restart expectation");
        let n = u64::from(run.requests());
        let mut r = serde_json::json!({
            "outcome": "clean",
            "requests": {"finished": n, "failed": 0, "failed_excused": 0, "held_for_restart": 32, "dispatched_while_down": 0},
            "ledger": {"reaped": 0, "reaped_excused": 0, "held": 0, "double_frees": 0},
            "violations": [],
            "processes": {"failed": 0, "killed_at_shutdown": 0},
            "faults": ["killed P0.dp0.tp1 at 5 ms, after 1 prefills", "P0.dp0.tp1 restarted (life 1)"],
            "bytes_verified": 4096, "prompt_kv_bytes": 4096,
            "failures": [],
            "foreign": {"received": n, "unexpected_finishes": 0, "stats": {
                "problems": 0, "listener_threads_dead": 0, "recv_unanswered": 0, "handshakes_dialled": 2
            }}
        });
        let reads = |holder: u64, stale: u64, dead: u64, life: u64| {
            serde_json::json!({
                "planned": 2 * n, "through_holder": holder, "stale": stale, "through_dead_session": dead,
                "unmatched": 0, "notes": [],
                "sessions": {"D0.dp0.tp0 -> P0.dp0.tp0": [0], "D0.dp0.tp1 -> P0.dp0.tp1": [life]},
                "by_lives": {"P0.dp0.tp1: held by life 1, read through life 0": dead / 2}
            })
        };
        match expect {
            Expect::StaleReads => r["foreign"]["reads"] = reads(2 * n - 32, 32, 0, 1),
            Expect::DeadSession => r["foreign"]["reads"] = reads(2 * n - 100, 0, 100, 0),
            Expect::RefusedStaleReads => {
                let revoked = "D0.dp0.tp1: read failed: 127.0.0.1:9 refused the read (revoked): 4096 bytes";
                patch_json(
                    &mut r,
                    &[
                        (&["requests", "finished"], (n - 2).into()),
                        (&["requests", "failed"], 2.into()),
                        (&["requests", "failed_excused"], 2.into()),
                        (&["ledger", "reaped"], 2.into()),
                        (&["ledger", "reaped_excused"], 2.into()),
                        (
                            &["failures"],
                            serde_json::json!([{"errors": [revoked]}, {"errors": ["D0.dp0.tp1: read failed: cannot connect"]}]),
                        ),
                        (
                            &["foreign", "stats"],
                            serde_json::json!({
                                "problems": 0, "listener_threads_dead": 0, "ranks_killed": 1, "ranks_restarted": 1,
                                "listener_threads_killed": 2, "transfers_held_at_shutdown": 0, "pending_unmapped_acks": 2
                            }),
                        ),
                    ],
                );
            }
            _ => unreachable!("not a restart expectation"),
        }
        patch_json(&mut r, patch);
        (run, Outcome { code: Some(0), result: Some(r), stderr: String::new() })
    }

    #[test]
    fn a_restart_run_documents_what_vllm_did_and_fails_when_it_changes() {
        let check = |expect, patch: &[(&[&str], Value)], want: Option<Documented>, says: &str| {
            let (run, outcome) = restart_result(expect, patch);
            let judged = judge(&run, &outcome);
            let verdicts: Vec<Verdict> = judged.cases.iter().map(|c| c.verdict.clone()).collect();
            assert_eq!(verdicts, [want.map_or(Verdict::Fails, Verdict::Documented)], "{expect:?} {patch:?}");
            let text = match &judged.cases[0].detail {
                Some(detail) => detail.clone(),
                None => judged.note.clone().unwrap_or_default(),
            };
            assert!(text.contains(says), "{expect:?} {patch:?}: {text}");
        };
        use Expect::{DeadSession, RefusedStaleReads, StaleReads};
        // As observed.
        check(
            StaleReads,
            &[],
            Some(Documented::RestartStaleRead),
            "read 32 transfers of the old incarnation",
        );
        check(
            DeadSession,
            &[],
            Some(Documented::RestartDeadSession),
            "100 reads went through the dead process's session (life 0), 50 of them",
        );
        check(RefusedStaleReads, &[], Some(Documented::RestartUnfenced), "old block ids of 1 transfers");
        // vLLM changed: it reads nothing stale (it fences, or handshakes before), or it
        // handshakes again after the restart.
        check(StaleReads, &[(&["foreign", "reads", "stale"], 0.into())], None, "0 stale reads");
        check(
            StaleReads,
            &[(&["foreign", "reads", "through_dead_session"], 3.into())],
            None,
            "3 through a dead session",
        );
        check(
            DeadSession,
            &[(&["foreign", "reads", "sessions", "D0.dp0.tp1 -> P0.dp0.tp1"], serde_json::json!([0, 1]))],
            None,
            "not the dead process's alone",
        );
        check(DeadSession, &[(&["foreign", "reads", "stale"], 4.into())], None, "4 stale reads");
        check(StaleReads, &[(&["foreign", "reads", "unmatched"], 1.into())], None, "unmatched reads");
        check(
            StaleReads,
            &[(&["foreign", "reads", "planned"], 10.into())],
            None,
            "vLLM planned 10 reads of 200",
        );
        // pdkv's side erred: a protocol error, a wrong byte, an unexcused failure or reaping,
        // something held, no restart at all.
        let protocol = serde_json::json!([{"kind": "protocol_error", "detail": "P0.dp0.tp1: transfer is not registered"}]);
        check(
            StaleReads,
            &[(&["violations"], protocol), (&["outcome"], "safety_violation".into())],
            None,
            "protocol_error",
        );
        let mismatch = serde_json::json!([{"kind": "read_mismatch", "detail": "D0.dp0.tp1: wrong bytes"}]);
        check(RefusedStaleReads, &[(&["violations"], mismatch)], None, "read_mismatch");
        check(RefusedStaleReads, &[(&["requests", "failed_excused"], 1.into())], None, "2 failed, 1 excused");
        check(DeadSession, &[(&["ledger", "reaped"], 1.into())], None, "1 reaped, 0 excused");
        check(DeadSession, &[(&["ledger", "held"], 1.into())], None, "ledger held 1");
        check(StaleReads, &[(&["faults"], serde_json::json!([]))], None, "was not killed and restarted");
        // A dispatch that went on while the rank was down: the hold did not hold it.
        check(
            StaleReads,
            &[(&["requests", "dispatched_while_down"], 1.into())],
            None,
            "1 dispatched while the rank was down",
        );
        check(RefusedStaleReads, &[(&["requests", "held_for_restart"], 0.into())], None, "0 dispatches held");
        // vLLM's prefill changed: no read refused as revoked (the stale read went elsewhere, or
        // failed otherwise), its tables kept a transfer, a listener died.
        check(
            RefusedStaleReads,
            &[(&["failures"], serde_json::json!([{"errors": ["D0.dp0.tp1: read failed: cannot connect"]}]))],
            None,
            "no read was refused as revoked",
        );
        check(
            RefusedStaleReads,
            &[(&["foreign", "stats", "transfers_held_at_shutdown"], 1.into())],
            None,
            "ended holding 1",
        );
        check(
            RefusedStaleReads,
            &[(&["foreign", "stats", "listener_threads_dead"], 1.into())],
            None,
            "listener_threads_dead 1",
        );
        check(
            RefusedStaleReads,
            &[(&["foreign", "stats", "ranks_restarted"], 0.into())],
            None,
            "ranks_restarted 0",
        );
        check(RefusedStaleReads, &[(&["bytes_verified"], 0.into())], None, "verified 0 of 4096");
    }
}
