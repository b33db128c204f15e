//! Why a step or a request failed on the decode worker.

use std::fmt;

use crate::handshake::HandshakeError;
use crate::ids::Incarnation;
use crate::params::ParamsError;
#[cfg(doc)]
use crate::policy::HandshakeMode;
use crate::ports::{PortError, SessionKey};
use crate::routing::RoutingError;
use crate::time::NS_PER_MS;

use super::{MAX_WORKER_REQUESTS, MAX_WORKER_SESSIONS};

/// Why a whole step failed on this worker.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepError {
    /// Eager mode: some worker of the group could not complete a handshake; every worker of
    /// the group reports exactly this value for the step.
    GroupHandshakeFailed {
        /// The step.
        step: u64,
    },
    /// Legacy only ([`HandshakeMode::Lazy`], `lazy-handshake`): this worker's own blocking
    /// handshake failed (its peers may be in the forward collective already).
    Handshake {
        /// The session that failed.
        session: SessionKey,
        /// Why.
        error: HandshakeError,
    },
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::GroupHandshakeFailed { step } => {
                write!(f, "step {step}: a KV handshake failed on some worker of the TP group")
            }
            StepError::Handshake { session, error } => write!(f, "handshake with {session}: {error}"),
        }
    }
}

/// Why one request's KV could not be received.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RecvError {
    /// Its `kv_transfer_params` are unusable.
    Params(ParamsError),
    /// The routing rules reject the pair.
    Routing(RoutingError),
    /// The source rank's port does not fit in 16 bits.
    Port(PortError),
    /// `transfer_id` is missing from the parameters.
    MissingTransferId,
    /// Remote and local block lists differ in length.
    BlockCountMismatch {
        /// Remote block ids.
        remote: usize,
        /// Local block ids.
        local: usize,
    },
    /// A remote block id is beyond the source rank's pool (e.g. reading another DP rank's ids).
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks the source rank has.
        num_blocks: u32,
    },
    /// A remote block id in the parameters does not fit in 32 bits.
    BlockIdTooLarge(u64),
    /// The session metadata has no memory region at all.
    NoRegions,
    /// A read failed.
    ReadFailed(String),
    /// The KV did not arrive within `transfer_timeout`.
    Timeout {
        /// How long the request waited, in nanoseconds.
        waited_ns: u64,
    },
    /// The worker holds [`MAX_WORKER_REQUESTS`] already.
    TooManyRequests,
    /// The request's source rank is one the worker has no session with, and it keeps
    /// [`MAX_WORKER_SESSIONS`] already.
    TooManySessions,
    /// The prefill incarnation that held the transfer is gone: the rank restarted, and a fresh
    /// handshake answered with another incarnation (see [`crate::fence`]). Nothing was read,
    /// leased or released.
    OtherIncarnation {
        /// The incarnation the transfer's parameters named.
        holder: Incarnation,
        /// The incarnation that answered, if it named one.
        live: Option<Incarnation>,
    },
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvError::Params(e) => write!(f, "{e}"),
            RecvError::Routing(e) => write!(f, "{e}"),
            RecvError::Port(e) => write!(f, "{e}"),
            RecvError::MissingTransferId => write!(f, "kv_transfer_params lacks transfer_id"),
            RecvError::BlockCountMismatch { remote, local } => {
                write!(f, "{remote} remote blocks but {local} local blocks")
            }
            RecvError::BlockOutOfRange { block, num_blocks } => {
                write!(f, "remote block {block} is beyond the source's {num_blocks} blocks")
            }
            RecvError::BlockIdTooLarge(block) => write!(f, "remote block id {block} does not fit in 32 bits"),
            RecvError::NoRegions => write!(f, "the source announced no memory region"),
            RecvError::ReadFailed(reason) => write!(f, "read failed: {reason}"),
            RecvError::Timeout { waited_ns } => {
                write!(f, "KV not received within {} ms", waited_ns / NS_PER_MS)
            }
            RecvError::TooManyRequests => write!(f, "more than {MAX_WORKER_REQUESTS} requests queued"),
            RecvError::OtherIncarnation { holder, live } => {
                let live = live.map_or_else(|| "a rank naming no incarnation".to_string(), |i| i.to_string());
                write!(f, "the prefill rank restarted: {holder} held the KV and {live} answers")
            }
            RecvError::TooManySessions => {
                write!(
                    f,
                    "no room for a session with the source rank: {MAX_WORKER_SESSIONS} sessions kept already"
                )
            }
        }
    }
}

impl std::error::Error for RecvError {}
