//! Signals for `pdkv cluster`: a SIGINT and SIGTERM handler that only notes the signal, so that
//! the cluster's loop can stop its rank processes in order and still write its (partial) result;
//! and the two calls that keep a child from outliving the run (a parent-death signal set in the
//! child, and a kill of a whole process group).
//!
//! Only a command line installs the handler ([`install`]): a library that took over a
//! process's signals would keep, say, `cargo test` from stopping on Ctrl-C.

use std::sync::atomic::{AtomicI32, Ordering};

/// SIGINT's number (the same on Linux and the BSDs).
pub const SIGINT: i32 = 2;
/// SIGTERM's number.
pub const SIGTERM: i32 = 15;

/// SIGKILL's number.
pub const SIGKILL: i32 = 9;

/// The last signal caught, or 0. [`crate::cluster::ClusterConfig::stop`] can point here.
pub static CAUGHT: AtomicI32 = AtomicI32::new(0);

/// `SIG_DFL`: the default action.
const SIG_DFL: usize = 0;

/// `prctl`'s option that sets the signal a process gets when its parent dies (Linux).
#[cfg(target_os = "linux")]
const PR_SET_PDEATHSIG: i32 = 1;

extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
    fn kill(pid: i32, signum: i32) -> i32;
    fn getppid() -> i32;
    #[cfg(target_os = "linux")]
    fn prctl(option: i32, ...) -> i32;
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

/// Has the child `command` starts get SIGKILL when its parent dies, so that it cannot outlive a
/// `pdkv cluster` that was itself killed (SIGKILL runs no code of ours). Linux's
/// `PR_SET_PDEATHSIG`, set between fork and exec. It covers the direct child alone (the setting
/// is cleared in the child's own children), and Linux sends it when the *thread* that forked the
/// child exits, so `command` must be spawned by a thread that lives as long as the child should.
/// A child whose parent died before the setting took effect exits at once. Elsewhere a no-op.
pub fn die_with_parent(command: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as i32;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: `prctl` and `getppid` are system calls, and the
        // error values are built without allocating (`from_raw_os_error`).
        unsafe {
            command.pre_exec(move || {
                if prctl(PR_SET_PDEATHSIG, std::ffi::c_ulong::try_from(SIGKILL).unwrap_or(9)) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if getppid() != parent {
                    // The parent died before the setting took effect: nothing will send it.
                    return Err(std::io::Error::from_raw_os_error(3 /* ESRCH */));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// Sends `signum` to every process of the process group `pgid`; false when there was none
/// (the group is empty) or the call failed.
pub fn kill_group(pgid: u32, signum: i32) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else { return false };
    if pgid <= 1 {
        // 0 is the caller's own group and 1 would be init's: never a child's group.
        return false;
    }
    // SAFETY: `kill` is the C library's system call wrapper; a negative pid names a group.
    unsafe { kill(-pgid, signum) == 0 }
}

/// The signal's name, for messages.
pub fn name(signum: i32) -> String {
    match signum {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}
