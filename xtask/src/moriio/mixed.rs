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
}

/// Requests per run, 32 in flight: enough for transfers to overlap on every rank.
const REQUESTS: u32 = 200;

const RUNS: &[Run] = &[
    Run {
        side: Side::Decode,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P TP = D TP",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_DP2TP2:1D_TP2",
        mla: false,
        about: "DP x TP prefill",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP4:1D_TP2",
        mla: false,
        about: "P > D",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Decode,
        deployment: "1P_TP4:1D_TP1",
        mla: true,
        about: "P > D, flexible MLA reads",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_TP2:1D_TP2",
        mla: false,
        about: "P TP = D TP",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_TP4:1D_TP2",
        mla: false,
        about: "P > D",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_DP2:1D_TP2",
        mla: false,
        about: "DP prefill (TP1)",
        expect: Expect::Clean,
    },
    Run {
        side: Side::Prefill,
        deployment: "1P_DP2TP2:1D_TP2",
        mla: false,
        about: "DP x TP prefill",
        expect: Expect::ListenerCollision,
    },
];

/// Paths a run needs.
pub struct Tools<'a> {
    pub pdkv: &'a Path,
    pub python: &'a Path,
    pub root: &'a Path,
    pub vllm_src: &'a Path,
}

/// Runs every mixed deployment and returns its cases.
pub fn cases(tools: &Tools, verbose: bool) -> Vec<Case> {
    let mut out = Vec::new();
    for run in RUNS {
        let started = Instant::now();
        let outcome = execute(tools, run, verbose);
        let cases = judge(run, &outcome);
        let verdict =
            if cases.iter().all(|c| c.verdict != Verdict::Fails) { "as expected" } else { "FAILED" };
        eprintln!(
            "moriio-conformance: mixed {} ({}): {verdict} in {:.1} s",
            label(run),
            run.about,
            started.elapsed().as_secs_f64()
        );
        out.extend(cases);
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
    cmd.args(["cluster", run.deployment, "--requests", &REQUESTS.to_string(), "--concurrency", "32"])
        .args(["--json", "--timeout-ms", "120000", "--foreign-side", side])
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

/// The cases of one run: the whole deployment, and the handshake and release interactions it
/// carried (in the direction the run has them).
fn judge(run: &Run, outcome: &Outcome) -> Vec<Case> {
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
    let n = u64::from(REQUESTS);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn run(side: Side, expect: Expect) -> Run {
        Run { side, deployment: "1P_TP2:1D_TP2", mla: false, about: "test", expect }
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
}
