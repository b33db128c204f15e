//! Standard output and standard error without panics: `println!` panics when stdout is a pipe
//! whose reader has quit (`pdkv routes ... | head -1`) or a full device, so every command
//! writes through `outln!`/`out!` and `errln!` instead.
//!
//! A closed stdout (EPIPE) ends the command quietly with exit code 141 ([`EXIT_CLOSED`]), the
//! status a shell reports for a program killed by SIGPIPE: `set -o pipefail` scripts and CI see
//! the output was cut, as they do for `yes | head`, while an exit of 0 would claim a verdict the
//! command never finished printing. Any other stdout error (`> /dev/full`) is an error message
//! on stderr and exit code 2, the code for an output that cannot be written. Stderr errors are
//! ignored: there is nowhere left to say so, and the command's exit code still says how it
//! went.

use std::fmt;
use std::io::{self, Write};

/// The exit code when standard output is closed before the command has written everything.
pub const EXIT_CLOSED: u8 = 141;

/// The exit code when standard output (or a result file) cannot be written.
pub const EXIT_UNWRITABLE: u8 = 2;

/// Writes `args` to stdout and flushes it, so a failed write is seen here; ends the process on
/// a failure (see the module's doc).
pub fn stdout(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        drop(out);
        if e.kind() == io::ErrorKind::BrokenPipe {
            std::process::exit(i32::from(EXIT_CLOSED));
        }
        stderr(format_args!("error: cannot write to standard output: {e}\n"));
        std::process::exit(i32::from(EXIT_UNWRITABLE));
    }
}

/// Writes `args` to stderr, ignoring a failure (nowhere is left to report it).
pub fn stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// `println!` to stdout through [`stdout`].
macro_rules! outln {
    () => {
        $crate::output::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` to stdout through [`stdout`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!($($arg)*))
    };
}

/// `eprintln!` through [`stderr`].
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}
