//! SIGINT and SIGTERM for `pdkv cluster`: a handler that only notes the signal, so that the
//! cluster's loop can stop its rank processes in order and still write its (partial) result.
//!
//! Only a command line installs it ([`install`]): a library that took over a process's signals
//! would keep, say, `cargo test` from stopping on Ctrl-C.

use std::sync::atomic::{AtomicI32, Ordering};

/// SIGINT's number (the same on Linux and the BSDs).
pub const SIGINT: i32 = 2;
/// SIGTERM's number.
pub const SIGTERM: i32 = 15;

/// The last signal caught, or 0. [`crate::cluster::ClusterConfig::stop`] can point here.
pub static CAUGHT: AtomicI32 = AtomicI32::new(0);

/// `SIG_DFL`: the default action.
const SIG_DFL: usize = 0;

extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
}

extern "C" fn note(signum: i32) {
    // A store to an atomic is all a handler may safely do here.
    CAUGHT.store(signum, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`CAUGHT`].
pub fn install() {
    let handler = note as extern "C" fn(i32) as usize;
    // SAFETY: `signal` is the C library's; the handler is an `extern "C" fn(i32)` that only
    // stores to an atomic, which is async-signal-safe.
    unsafe {
        signal(SIGINT, handler);
        signal(SIGTERM, handler);
    }
}

/// Gives SIGINT and SIGTERM their default action back, so that a second Ctrl-C during an
/// orderly stop ends the process at once (its ranks then exit as their scheduler connection
/// closes).
pub fn restore() {
    // SAFETY: as in `install`; `SIG_DFL` is the default disposition.
    unsafe {
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
    }
}

/// The signal's name, for messages.
pub fn name(signum: i32) -> String {
    match signum {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}
