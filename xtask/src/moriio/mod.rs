//! `cargo xtask moriio-conformance`: pdkv against vLLM's own MoRIIO code, taken from the pinned
//! PyPI wheel (not a peer pdkv wrote). Fetches and checks the wheel (`wheel.rs`), runs
//! tests/moriio/harness.py with target/pyenv's Python (vLLM's real modules, stubs only for torch,
//! numpy, MoRI and the vLLM modules that need them), reads its answers (`answers.rs`), computes
//! pdkv-core's answers to the same questions and judges every case (`compare.rs`), and prints
//! the compatibility matrix (`matrix.rs`). Before the harness runs, `messages.rs` drives pdkv's
//! decode node to get every message pdkv sends, under every capability set, which the harness
//! delivers to vLLM's own listeners. Exit 0 when no case fails, 1 otherwise, 2 for bad
//! arguments.

mod answers;
mod compare;
mod matrix;
mod messages;
mod mixed;
mod wheel;

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use crate::pyenv::{self, PyEnvError};
use crate::suite::PYTHON_VAR;

pub const HELP: &str = "\
usage: cargo xtask moriio-conformance [--release V | --all-releases] [--max-ranks N] [--verbose]

Checks pdkv against vLLM's own MoRIIO connector code, taken from a vLLM release's wheel on PyPI
(the newest, 0.34.0, unless --release names another; every release pdkv knows, with its
wheels' sha256 and its dialect, is listed in xtask/src/moriio/wheel.rs, RELEASES, and described
in docs/moriio-releases.md). For the release:

  1. sets up target/pyenv (pinned pyzmq, msgpack, msgspec; PDKV_PYTHON=<python> uses that
     Python instead, which must have them and be 3.11 or newer);
  2. downloads the vLLM wheel once with `pip download --require-hashes` into target/vllm-<V>/
     (240 to 340 MB; later runs check the cached file's sha256 and reuse it), and extracts the
     MoRIIO package and vLLM's network_utils.py and envs.py;
  3. runs tests/moriio/harness.py: vLLM's real moriio_common.py, moriio_connector.py and
     moriio_engine.py, with tests/moriio/stubs/ standing in for torch, numpy, MoRI and the vLLM
     modules that need them, answer every pure rule pdkv re-implements (source rank and the
     flexible round-robin, release targets, acks per prefill rank, expected ack count, listener
     and dial ports, KV head guard) for every prefill and decode layout of up to N ranks a side
     (pure TP, DP, DP x TP; MLA and GQA), and vLLM talks to vLLM over loopback (handshake,
     release notify);
  4. delivers every message pdkv sends to a prefill rank (got by driving pdkv-core's decode
     node through a request under each capability set a rank can advertise: {} and
     {read_lease}), and a sample of every wire message variant, to a fresh vLLM notify or
     handshake listener each over loopback ZeroMQ, and checks the listener thread still
     serves vLLM's own release or dial afterwards (rows 'every pdkv message (wire)'). A
     message the decode node sends to a rank advertising what vLLM advertises (its
     metadata, decoded by pdkv: row 'handshake (wire)', vLLM -> pdkv) must not end a listener;
     one it never sends there and that does is a documented difference;
  5. computes pdkv-core's answers to the same questions, and prints the compatibility matrix:
     per interaction, direction and layout class, how many cases work, differ as documented
     (a deliberate pdkv rule, explained under the table), or fail. Each failure is listed with
     its layout, vLLM's answer and pdkv's;
  6. runs the mixed deployments: `pdkv cluster --foreign-side` with tests/moriio/mixed.py
     playing one side with vLLM's code, among them three that kill and restart a prefill rank
     (a pdkv one under vLLM's decode, twice, and a vLLM one under pdkv's decode), and prints
     what each side did after the restart (docs/interop.md, Restarts in a mixed deployment).

options:
  --release V     the vLLM release to check: a version, `latest` (the default) or `oldest` (the
                  oldest pdkv has a rule set for). A release whose dialect pdkv has no rule set
                  for yet is refused, naming the dialect and the releases that can be checked
  --all-releases  every release pdkv has a rule set for, one after the other, then a line per
                  release pdkv knows: its dialect and its verdict, or why it was not checked
  --max-ranks N   largest DP x TP a side (1 to 16; default 16)
  --verbose       show vLLM's own log lines

exit codes: 0 no case fails; 1 a case fails, or the wheel, Python or harness could not be set
up (the message says which: no network, wrong hash, missing Python); 2 bad arguments.

examples:
  cargo xtask moriio-conformance
  cargo xtask moriio-conformance --release 0.33.0 --max-ranks 4
  cargo xtask moriio-conformance --all-releases";

/// Why the conformance could not run (as opposed to a case failing).
#[derive(Debug)]
pub enum ConformanceError {
    Pyenv(PyEnvError),
    /// The Python (target/pyenv's or PDKV_PYTHON) cannot run, is too old, or lacks a package.
    Python {
        program: PathBuf,
        detail: String,
    },
    Wheel(wheel::WheelError),
    /// The harness exited with an error.
    Harness {
        detail: String,
    },
    /// The harness's answers are not the document expected.
    Answers {
        detail: String,
    },
    /// pdkv's decode node did not do what the message runs need.
    Messages(messages::MessagesError),
    Io {
        what: String,
        error: io::Error,
    },
}

impl fmt::Display for ConformanceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConformanceError::Pyenv(e) => write!(f, "cannot set up target/pyenv: {e}"),
            ConformanceError::Python { program, detail } => write!(
                f,
                "the Python at {} cannot run vLLM's MoRIIO code: {}",
                program.display(),
                detail.trim()
            ),
            ConformanceError::Wheel(e) => write!(f, "{e}"),
            ConformanceError::Harness { detail } => {
                write!(
                    f,
                    "tests/moriio/harness.py failed (a vLLM change the harness does not follow?):\n{}",
                    detail.trim()
                )
            }
            ConformanceError::Answers { detail } => write!(f, "cannot read the harness's answers: {detail}"),
            ConformanceError::Messages(e) => write!(f, "{e}"),
            ConformanceError::Io { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

#[derive(Debug)]
struct Options {
    /// The releases to check, in order: one, or every supported one.
    releases: Vec<&'static wheel::VllmPin>,
    max_ranks: u16,
    verbose: bool,
    /// Hidden (not in HELP): drive the decode node as a pdkv that sent read leases to every
    /// peer, to show the 'every pdkv message' rows catch it (docs/interop.md).
    ungated_leases: bool,
}

fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut options =
        Options { releases: vec![wheel::latest()], max_ranks: 16, verbose: false, ungated_leases: false };
    let (mut release, mut all) = (None, false);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--verbose" => options.verbose = true,
            "--pretend-ungated-leases" => options.ungated_leases = true,
            "--all-releases" => all = true,
            "--release" => {
                let value = it.next().ok_or("--release needs a value (a version such as 0.34.0)")?;
                release = Some(wheel::release(value)?);
            }
            "--max-ranks" => {
                let value = it.next().ok_or("--max-ranks needs a value")?;
                options.max_ranks = match value.parse::<u16>() {
                    Ok(n) if (1..=16).contains(&n) => n,
                    _ => return Err(format!("--max-ranks {value}: expected 1 to 16")),
                };
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    match (release, all) {
        (Some(_), true) => return Err("--release and --all-releases exclude each other".into()),
        (Some(pin), false) => options.releases = vec![pin],
        (None, true) => options.releases = wheel::supported().collect(),
        (None, false) => {}
    }
    Ok(Some(options))
}

pub fn run(args: &[String], root: &Path) -> ExitCode {
    let options = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("moriio-conformance: {e}\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    let mut verdicts: Vec<(&str, String)> = Vec::new();
    let mut failed = false;
    for &pin in &options.releases {
        let started = Instant::now();
        let verdict = match conformance(root, &options, pin) {
            Ok(totals) => {
                failed |= totals.fails > 0;
                format!("{} ({:.1} s)", totals, started.elapsed().as_secs_f64())
            }
            Err(e) => {
                eprintln!("moriio-conformance: vLLM {}: {e}", pin.version);
                failed = true;
                format!("could not run: {}", e.to_string().lines().next().unwrap_or_default())
            }
        };
        println!("moriio-conformance: vLLM {}: {verdict}", pin.version);
        verdicts.push((pin.version, verdict));
    }
    if options.releases.len() > 1 {
        println!();
        println!("every vLLM release with MoRIIO pdkv knows (docs/moriio-releases.md):");
        for pin in wheel::RELEASES {
            let verdict = verdicts.iter().find(|(v, _)| *v == pin.version).map_or_else(
                || format!("not checked: pdkv has no rule set for the {} dialect yet", pin.dialect),
                |(_, verdict)| verdict.clone(),
            );
            println!("  {:<8} {:<10} {verdict}", pin.version, pin.dialect);
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// A release's totals: cases that work, differ as documented, and fail.
struct Totals {
    works: usize,
    documented: usize,
    fails: usize,
}

impl fmt::Display for Totals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (w, d, x) = (self.works, self.documented, self.fails);
        write!(f, "{} cases: {w} work, {d} differ as documented, {x} fail", w + d + x)
    }
}

/// The whole run for one release, with its totals.
fn conformance(
    root: &Path,
    options: &Options,
    pin: &'static wheel::VllmPin,
) -> Result<Totals, ConformanceError> {
    let target = crate::target_dir(root);
    let python = match std::env::var_os(PYTHON_VAR).filter(|p| !p.is_empty()) {
        Some(p) => {
            eprintln!(
                "moriio-conformance: {PYTHON_VAR}={} given, so target/pyenv is not used",
                Path::new(&p).display()
            );
            PathBuf::from(p)
        }
        None => pyenv::ensure(&target, "python3").map_err(ConformanceError::Pyenv)?,
    };
    check_python(&python, pin)?;
    let cache = wheel::cache_dir(&target, pin);
    eprintln!(
        "moriio-conformance: vLLM {} ({} dialect; cached in {})",
        pin.version,
        pin.dialect,
        cache.display()
    );
    let src = wheel::ensure(&python, root, &cache, pin).map_err(ConformanceError::Wheel)?;
    let out = cache.join("answers.json");
    if options.ungated_leases {
        eprintln!(
            "moriio-conformance: --pretend-ungated-leases: pdkv's decode node is told every rank \
             advertised read leases, as a pdkv without the gate would send them"
        );
    }
    let sent = messages::build(options.ungated_leases).map_err(ConformanceError::Messages)?;
    let messages_file = cache.join("messages.json");
    fs::write(&messages_file, sent.to_json().to_string()).map_err(|error| ConformanceError::Io {
        what: format!("cannot write {}", messages_file.display()),
        error,
    })?;
    let step = Instant::now();
    eprintln!(
        "moriio-conformance: asking vLLM's MoRIIO code about every layout up to {} ranks a side ...",
        options.max_ranks
    );
    let mut cmd = Command::new(&python);
    cmd.arg(root.join("tests/moriio/harness.py"))
        .arg("--vllm-src")
        .arg(&src)
        .args(["--vllm-version", pin.version])
        .arg("--stubs")
        .arg(root.join("tests/moriio/stubs"))
        .args(["--max-ranks", &options.max_ranks.to_string()])
        .arg("--messages")
        .arg(&messages_file)
        .arg("--out")
        .arg(&out)
        // The harness's own modules must not be cached as .pyc files next to the sources.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null());
    if options.verbose {
        cmd.arg("--verbose");
    }
    let status = cmd
        .status()
        .map_err(|error| ConformanceError::Io { what: format!("cannot run {}", python.display()), error })?;
    if !status.success() {
        return Err(ConformanceError::Harness { detail: format!("{status} (its messages are above)") });
    }
    let text = fs::read_to_string(&out)
        .map_err(|error| ConformanceError::Io { what: format!("cannot read {}", out.display()), error })?;
    let answers: answers::Answers = serde_json::from_str(&text)
        .map_err(|e| ConformanceError::Answers { detail: format!("{}: {e}", out.display()) })?;
    answers.check().map_err(|e| ConformanceError::Answers { detail: e.to_string() })?;
    if answers.vllm_version != pin.version {
        return Err(ConformanceError::Answers {
            detail: format!("answers are for vLLM {}, not {}", answers.vllm_version, pin.version),
        });
    }
    eprintln!(
        "moriio-conformance: vLLM answered in {:.1} s; comparing with pdkv-core",
        step.elapsed().as_secs_f64()
    );

    let mut matrix = matrix::Matrix::default();
    let rules = pin.rules.expect("a release is checked only under its rule set");
    for case in compare::cases(&answers, rules).into_iter().chain(compare::message_cases(&sent, &answers)) {
        matrix.add(case);
    }
    eprintln!("moriio-conformance: mixed deployments: vLLM's MoRIIO code on one side, pdkv's processes on the other");
    if !crate::cargo(&["build", "--release", "--quiet", "--package", "pdkv", "--bin", "pdkv"], &[]) {
        return Err(ConformanceError::Harness {
            detail: "cannot build pdkv for the mixed deployments".into(),
        });
    }
    let pdkv = target.join("release/pdkv");
    let tools = mixed::Tools { pdkv: &pdkv, python: &python, root, vllm_src: &src, rules };
    let mixed = mixed::cases(&tools, options.verbose);
    for case in mixed.cases {
        matrix.add(case);
    }
    print_report(&answers, &sent, &matrix, &mixed.restarts);
    let (works, documented, fails) = matrix.totals();
    Ok(Totals { works, documented, fails })
}

fn print_report(
    answers: &answers::Answers,
    sent: &messages::Messages,
    matrix: &matrix::Matrix,
    restarts: &[String],
) {
    const SHOWN: usize = 40;
    let failures = matrix.failures();
    if !failures.is_empty() {
        println!("FAILURES (the layout, vLLM's answer, pdkv's answer):");
        for f in failures.iter().take(SHOWN) {
            println!("  {f}");
        }
        if failures.len() > SHOWN {
            println!("  ... and {} more", failures.len() - SHOWN);
        }
        println!();
    }
    println!(
        "pdkv against vLLM {} (Python {}; real {}):",
        answers.vllm_version,
        answers.python,
        answers.modules.values().map(String::as_str).collect::<Vec<_>>().join(", ")
    );
    println!();
    print!("{}", matrix.render());
    println!();
    print!("{}", deliveries(answers, sent));
    println!();
    if !restarts.is_empty() {
        println!("a prefill rank restarted in a mixed deployment (what each side did):");
        for line in restarts {
            println!("  {line}");
        }
        println!();
    }
}

/// What vLLM's listener did with each of pdkv's messages, one line each, grouped by capability
/// set: the evidence behind the 'every pdkv message' rows.
fn deliveries(answers: &answers::Answers, sent: &messages::Messages) -> String {
    let mut out = String::from("every pdkv message at a fresh vLLM listener (capability set, origin, message -> listener: what vLLM did):\n");
    for m in &sent.messages {
        let did = answers
            .messages
            .iter()
            .find(|d| d.id == m.id)
            .map(|d| format!("{}: {}", if d.alive { "lives on" } else { "ENDED" }, d.did))
            .unwrap_or_else(|| "no answer from the harness".into());
        let origin = match (m.origin, m.emitted) {
            (messages::Origin::DecodeNode, _) => "decode node",
            (messages::Origin::EveryVariant, true) => "every variant, sent",
            (messages::Origin::EveryVariant, false) => "every variant, never sent",
        };
        out.push_str(&format!(
            "  {:<14} {:<26} {:>18} -> {:<9}  {did}\n",
            messages::set_name(m.capabilities),
            origin,
            m.name(),
            m.socket.name()
        ));
    }
    out
}

/// The Python must be the one vLLM's wheel supports and have the harness's packages.
fn check_python(python: &Path, pin: &wheel::VllmPin) -> Result<(), ConformanceError> {
    let (major, minor) = pin.min_python;
    let script = format!(
        "import sys\nif sys.version_info[:2] < ({major}, {minor}):\n    \
         sys.exit('Python %d.%d; vLLM {} needs {major}.{minor} or newer (its Requires-Python)' % sys.version_info[:2])\n\
         import zmq, msgpack, msgspec",
        pin.version
    );
    let out = Command::new(python).arg("-c").arg(&script).output().map_err(|e| ConformanceError::Python {
        program: python.to_path_buf(),
        detail: format!("cannot start it ({e}); install python3 (Debian/Ubuntu: apt-get install python3)"),
    })?;
    if out.status.success() {
        return Ok(());
    }
    let mut detail = String::from_utf8_lossy(&out.stderr).into_owned();
    if detail.contains("No module named") {
        detail.push_str(&format!(
            "\nIt needs {}: unset {PYTHON_VAR} to use target/pyenv",
            pyenv::package_list()
        ));
    }
    Err(ConformanceError::Python { program: python.to_path_buf(), detail })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(parse(&args(&["--help"])).unwrap().is_none());
        let o = parse(&args(&["--max-ranks", "4", "--verbose"])).unwrap().unwrap();
        assert_eq!((o.max_ranks, o.verbose, o.ungated_leases), (4, true, false));
        assert!(parse(&args(&["--pretend-ungated-leases"])).unwrap().unwrap().ungated_leases);
        assert!(parse(&args(&["--max-ranks", "17"])).unwrap_err().contains("1 to 16"));
        assert!(parse(&args(&["--max-ranks"])).unwrap_err().contains("needs a value"));
        assert!(parse(&args(&["--frobnicate"])).unwrap_err().contains("unknown argument"));
        let versions = |a: &[&str]| -> Vec<&str> {
            parse(&args(a)).unwrap().unwrap().releases.iter().map(|r| r.version).collect()
        };
        assert_eq!(versions(&[]), ["0.34.0"]);
        assert_eq!(versions(&["--release", "0.33.0"]), ["0.33.0"]);
        assert_eq!(versions(&["--release", "oldest"]), ["0.25.0"]);
        assert_eq!(
            versions(&["--all-releases"]),
            [
                "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                "0.32.0", "0.33.0", "0.34.0"
            ]
        );
        assert!(parse(&args(&["--release", "0.24.0"]))
            .unwrap_err()
            .contains("not a vLLM release pdkv knows"));
        assert!(parse(&args(&["--release"])).unwrap_err().contains("needs a value"));
        let both = parse(&args(&["--release", "0.34.0", "--all-releases"])).unwrap_err();
        assert!(both.contains("exclude each other"), "{both}");
    }

    #[test]
    fn a_missing_python_is_named() {
        let err = check_python(Path::new("/nonexistent/python3"), wheel::latest()).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/python3") && err.contains("install python3"), "{err}");
    }
}
