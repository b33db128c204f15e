//! The typed errors the cluster's files share (a run that could not start, a process that could
//! not be spawned, a foreign driver's setup that could not be made), below the process table,
//! the foreign driver, the forger and the options that name them, so none of those files has to
//! import another for its errors.

use std::fmt;
use std::io;
use std::path::PathBuf;

use pdkv_core::ids::RankId;
use pdkv_core::wire::WireError;

/// Why a run's processes could not start, or did not become ready.
#[derive(Debug)]
pub enum StartError {
    /// No block of free ports for the listeners.
    NoFreePorts {
        /// Ports needed.
        count: u16,
        /// The host.
        host: String,
    },
    /// The scheduler's own listener could not bind.
    Listener(io::Error),
    /// The scheduler's listener has no local address.
    LocalAddr(io::Error),
    /// `/dev/urandom` could not be read.
    Random {
        /// What the bytes were for.
        what: &'static str,
        /// Why.
        error: io::Error,
    },
    /// A process could not be started.
    Spawn(SpawnError),
    /// A rank said it could not start (`FromRank::SetupFailed`), in its own words.
    RankSetup {
        /// The rank.
        rank: RankId,
        /// Why.
        error: String,
    },
    /// A rank's process exited before it was ready.
    ExitedBeforeReady(RankId),
    /// Ranks were not ready within the start timeout.
    NotReady {
        /// The timeout, in seconds.
        secs: u64,
        /// The ranks that were not.
        missing: Vec<RankId>,
    },
    /// The foreign driver was not ready within the start timeout.
    DriverNotReady {
        /// The driver program.
        program: PathBuf,
        /// The timeout, in seconds.
        secs: u64,
    },
    /// The foreign driver's output is not its protocol before it was ready.
    DriverGarbled(String),
    /// The foreign driver exited before it was ready.
    DriverExited,
    /// The foreign driver said `error`, in its own words.
    DriverFailed(String),
    /// The foreign driver's setup could not be made.
    DriverSetup(DriverSetupError),
    /// A prefill notify listener does not resolve for the forger.
    ForgerTarget {
        /// The host.
        host: String,
        /// The port.
        port: u16,
    },
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::NoFreePorts { count, host } => {
                write!(f, "no {count} consecutive free ports on {host}")
            }
            StartError::Listener(e) => write!(f, "scheduler listener: {e}"),
            StartError::LocalAddr(e) => write!(f, "{e}"),
            StartError::Random { what, error } => write!(f, "{what}: /dev/urandom: {error}"),
            StartError::Spawn(e) => write!(f, "{e}"),
            StartError::RankSetup { rank, error } => write!(f, "{rank}: {error}"),
            StartError::ExitedBeforeReady(rank) => write!(f, "{rank} exited before it was ready"),
            StartError::NotReady { secs, missing } => {
                let missing: Vec<String> = missing.iter().map(RankId::to_string).collect();
                write!(f, "ranks not ready after {secs} s: {}", missing.join(", "))
            }
            StartError::DriverNotReady { program, secs } => {
                write!(f, "the foreign driver {} was not ready after {secs} s", program.display())
            }
            StartError::DriverGarbled(detail) => f.write_str(detail),
            StartError::DriverExited => {
                f.write_str("the foreign driver exited before it was ready (its messages are above)")
            }
            StartError::DriverFailed(detail) => write!(f, "the foreign driver: {detail}"),
            StartError::DriverSetup(e) => write!(f, "{e}"),
            StartError::ForgerTarget { host, port } => {
                write!(f, "the forger's target {host}:{port} does not resolve")
            }
        }
    }
}

impl std::error::Error for StartError {}

/// A process the run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spawned {
    /// A rank's `pdkv connector`.
    Connector,
    /// The foreign side's driver (`--foreign-side`).
    ForeignDriver,
    /// The forger (`--forge-messages`).
    Forger,
}

/// Why a process could not be started.
#[derive(Debug)]
pub struct SpawnError {
    /// Which process.
    pub what: Spawned,
    /// Its program.
    pub program: PathBuf,
    /// Why.
    pub error: io::Error,
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (program, e) = (self.program.display(), &self.error);
        match self.what {
            Spawned::Connector => write!(f, "cannot start {program} connector: {e}"),
            Spawned::ForeignDriver => write!(f, "cannot start the foreign driver {program}: {e}"),
            Spawned::Forger => write!(f, "cannot start the forger {program}: {e}"),
        }
    }
}

impl std::error::Error for SpawnError {}

/// Why the driver's setup could not be made: a foreign prefill rank's handshake reply, which its
/// data-plane server hands the scheduler, is missing or does not decode.
#[derive(Debug)]
pub enum DriverSetupError {
    /// The rank gave no reply.
    NoReply(RankId),
    /// The reply's first message is not handshake metadata.
    Metadata {
        /// The rank.
        rank: RankId,
        /// What it decoded to, for people.
        got: String,
    },
    /// The reply's layer descriptors do not decode.
    Layers {
        /// The rank.
        rank: RankId,
        /// Why.
        error: WireError,
    },
}

impl fmt::Display for DriverSetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverSetupError::NoReply(rank) => {
                write!(f, "{rank} gave no handshake reply for the foreign driver")
            }
            DriverSetupError::Metadata { rank, got } => {
                write!(f, "{rank}'s handshake metadata does not decode: {got}")
            }
            DriverSetupError::Layers { rank, error } => {
                write!(f, "{rank}'s layer descriptors do not decode: {error}")
            }
        }
    }
}

impl std::error::Error for DriverSetupError {}
