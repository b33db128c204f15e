//! `cargo xtask test`, the README's test command: sets up the Python environment the conformance
//! tests need (`pyenv.rs`), runs `cargo test --workspace --no-fail-fast` with `PDKV_PYTHON`
//! pointing at it, forwards cargo's output as it comes, and ends with one line totalling every
//! test run, because cargo's own last lines are doc-test runs of a few tests each.

use std::io::{self, IsTerminal, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::pyenv;

/// The variable tests/it/zmtp_pyzmq.rs runs its Python peers with (`python3` when unset).
pub const PYTHON_VAR: &str = "PDKV_PYTHON";

/// Runs the whole suite; `extra` goes to `cargo test` after `--workspace --no-fail-fast` (so
/// `-- NAME` filters, for instance). cargo's stdout and stderr both come out on our stdout, in
/// order, and the total is the last line.
pub fn run(root: &Path, extra: &[String]) -> ExitCode {
    let python = match std::env::var_os(PYTHON_VAR).filter(|p| !p.is_empty()) {
        // An escape hatch for machines without PyPI: a Python that already has the packages.
        Some(p) => {
            eprintln!("test: {PYTHON_VAR}={} given, so target/pyenv is not used", Path::new(&p).display());
            PathBuf::from(p)
        }
        None => match pyenv::ensure(&crate::target_dir(root), "python3") {
            Ok(python) => python,
            Err(e) => {
                eprintln!("test: cannot set up the Python environment of the pyzmq conformance tests: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let mut args: Vec<String> = ["test", "--workspace", "--no-fail-fast"].map(String::from).to_vec();
    args.extend(extra.iter().cloned());
    eprintln!("$ {PYTHON_VAR}={} cargo {}", python.display(), args.join(" "));
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(&args).env(PYTHON_VAR, &python).current_dir(root);
    if io::stdout().is_terminal() && std::env::var_os("CARGO_TERM_COLOR").is_none() {
        cmd.env("CARGO_TERM_COLOR", "always");
    }
    let (reader, child) = match spawn_merged(cmd) {
        Ok(spawned) => spawned,
        Err(e) => {
            eprintln!("test: cannot run cargo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut child, totals) = (child, Arc::new(Mutex::new(Totals::default())));
    let (done_tx, done_rx) = mpsc::channel();
    let counted = Arc::clone(&totals);
    thread::spawn(move || {
        tee(reader, &counted);
        let _ = done_tx.send(());
    });
    let status = child.wait();
    // A process some test started and leaked would hold the output open for ever; cargo's exit
    // is what ends the run, after a moment for the last lines to arrive.
    let drained = done_rx.recv_timeout(DRAIN).is_ok();
    let totals = totals.lock().map(|t| t.clone()).unwrap_or_else(|poisoned| poisoned.into_inner().clone());
    if !drained {
        // Everything cargo wrote was read by now; only the leak is worth a word.
        eprintln!("test: cargo exited but its output is still open: a test leaked a child process");
    }
    println!("{}", totals.line(status.as_ref().map_err(|e| e.to_string())));
    match status {
        Ok(s) if s.success() && totals.failed == 0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// How long the output may stay open after cargo exited.
const DRAIN: Duration = Duration::from_secs(10);

/// Spawns `cmd` with stdout and stderr on one socket, as `2>&1` would: cargo's `Running ...`
/// lines (stderr) and the tests' results (stdout) then arrive in the order they were written,
/// which two pipes read by two threads would not keep. A socket pair because std's `pipe` is
/// newer than the Rust some machines have.
fn spawn_merged(mut cmd: Command) -> io::Result<(UnixStream, Child)> {
    let (reader, writer) = UnixStream::pair()?;
    let writer_too = writer.try_clone()?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(OwnedFd::from(writer)))
        .stderr(Stdio::from(OwnedFd::from(writer_too)));
    let child = cmd.spawn()?;
    // Our copies of the write end must close, or the reader never sees the end.
    drop(cmd);
    Ok((reader, child))
}

/// Copies `from` to our stdout as it arrives (so a slow test shows up live) and counts every
/// complete `test result:` line.
fn tee(mut from: impl Read, totals: &Mutex<Totals>) {
    let mut buf = [0u8; 8192];
    let mut pending: Vec<u8> = Vec::new();
    let stdout = io::stdout();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        // A closed stdout (`| head`) must not stop the count, nor block cargo on a full pipe.
        let mut out = stdout.lock();
        let _ = out.write_all(&buf[..n]).and_then(|()| out.flush());
        pending.extend_from_slice(&buf[..n]);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            add_line(totals, &line);
        }
    }
    add_line(totals, &pending);
}

fn add_line(totals: &Mutex<Totals>, line: &[u8]) {
    if let Ok(mut t) = totals.lock() {
        t.add_line(&String::from_utf8_lossy(line));
    }
}

/// Counts summed over every `test result:` line, one per test binary or doc-test run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    pub runs: u64,
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    pub filtered: u64,
}

impl Totals {
    /// Adds one output line if it is libtest's summary, e.g. `test result: ok. 12 passed; 0
    /// failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s`.
    pub fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim_end().strip_prefix("test result: ") else { return };
        let Some((_, counts)) = rest.split_once(". ") else { return };
        self.runs += 1;
        for part in counts.split(';') {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next().and_then(|n| n.parse::<u64>().ok()), words.next())
            else {
                continue;
            };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                "filtered" => self.filtered += n,
                _ => {}
            }
        }
    }

    /// The last line: the totals and, when anything went wrong, what.
    pub fn line(&self, status: Result<&ExitStatus, String>) -> String {
        let mut line = format!(
            "test total: {} passed, {} failed, {} ignored{} ({} test runs)",
            self.passed,
            self.failed,
            self.ignored,
            if self.filtered > 0 { format!(", {} filtered out", self.filtered) } else { String::new() },
            self.runs
        );
        match status {
            Ok(s) if s.success() && self.failed == 0 => {}
            Ok(s) if s.success() => line.push_str(": FAILED"),
            Ok(s) if self.failed > 0 => line.push_str(&format!(": FAILED (cargo test: {s})")),
            Ok(s) => line.push_str(&format!(
                ": FAILED (cargo test: {s}; a target did not build or a test binary did not finish, see above)"
            )),
            Err(e) => line.push_str(&format!(": FAILED (cannot wait for cargo test: {e})")),
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_result_lines_and_ignores_everything_else() {
        let mut t = Totals::default();
        for line in [
            "running 3 tests",
            "test a ... ok",
            "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 2 filtered out; finished in 0.00s\n",
            "test result: FAILED. 5 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.20s",
            "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
            "    test result: ok. 9 passed; 0 failed", // indented: a test's own output, not libtest's
            "",
        ] {
            t.add_line(line);
        }
        assert_eq!(t, Totals { runs: 3, passed: 8, failed: 2, ignored: 1, filtered: 2 });
    }

    #[test]
    fn the_last_line_says_failed_for_failures_and_for_a_failed_cargo() {
        use std::os::unix::process::ExitStatusExt;
        let ok = ExitStatus::from_raw(0);
        let failed = ExitStatus::from_raw(101 << 8);
        let mut t = Totals { runs: 47, passed: 231, failed: 0, ignored: 0, filtered: 0 };
        assert_eq!(t.line(Ok(&ok)), "test total: 231 passed, 0 failed, 0 ignored (47 test runs)");
        assert_eq!(
            t.line(Ok(&failed)),
            "test total: 231 passed, 0 failed, 0 ignored (47 test runs): FAILED (cargo test: exit status: \
             101; a target did not build or a test binary did not finish, see above)"
        );
        t.failed = 2;
        t.filtered = 4;
        assert_eq!(
            t.line(Ok(&failed)),
            "test total: 231 passed, 2 failed, 0 ignored, 4 filtered out (47 test runs): FAILED (cargo \
             test: exit status: 101)"
        );
    }
}
