//! Running the long steps of the vLLM venv (pip, maturin) with their output appended to a log
//! file and a progress line every 15 s naming the step's latest log line, and the short ones
//! (a Python one-liner) with their output captured.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How often a long step says it is still running.
const PROGRESS_EVERY: Duration = Duration::from_secs(15);

/// How many of the log's last lines a failure shows.
const TAIL_LINES: usize = 40;

/// A step that failed: what it was, how it ended, the log and its last lines.
#[derive(Debug)]
pub struct StepFailure {
    pub what: String,
    pub status: String,
    pub log: PathBuf,
    pub tail: String,
}

impl std::fmt::Display for StepFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed ({}); the last lines of its log, {}:\n{}",
            self.what,
            self.status,
            self.log.display(),
            self.tail.trim_end()
        )
    }
}

/// Runs `cmd` (described as `what`) with stdout and stderr appended to `log`, printing a line
/// to stderr every 15 s with the time so far and the log's latest line. Ends when the command
/// does; Err names how it ended and the log's last lines.
pub fn run_logged(what: &str, cmd: &mut Command, log: &Path) -> Result<Duration, StepFailure> {
    let failure = |status: String| StepFailure {
        what: what.to_owned(),
        status,
        log: log.to_owned(),
        tail: tail(log, TAIL_LINES),
    };
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| failure(format!("cannot open the log: {e}")))?;
    let file_err = file.try_clone().map_err(|e| failure(format!("cannot open the log: {e}")))?;
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(file_err)
        .spawn()
        .map_err(|e| failure(format!("cannot start {:?}: {e}", cmd.get_program())))?;
    let mut next_note = PROGRESS_EVERY;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => return Err(failure(format!("cannot wait for it: {e}"))),
        }
        if started.elapsed() >= next_note {
            let latest = tail(log, 1);
            let latest: String = latest.trim().chars().take(100).collect();
            eprintln!("  ... {what}: {} s; {latest}", next_note.as_secs());
            next_note += PROGRESS_EVERY;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.success() {
        Ok(started.elapsed())
    } else {
        Err(failure(status.to_string()))
    }
}

/// The last `lines` non-empty lines of a file (at most its last 64 KiB), or why it cannot be
/// read.
pub fn tail(path: &Path, lines: usize) -> String {
    let read = || -> io::Result<String> {
        let mut file = fs::File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let kept: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            kept[kept.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Runs `python -c code args...`; Ok has its stdout, Err its exit status and output (or why it
/// did not start).
pub fn python(python: &Path, code: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(python)
        .arg("-c")
        .arg(code)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
