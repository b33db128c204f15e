//! The data-plane seam: how a decode rank reads byte ranges of a producer rank's registered
//! regions, whatever moves the bytes (TCP in [`crate::tcp`], RDMA verbs later behind `rdma`).
//!
//! The seam is one blocking call so that the driver loop, not the transport, decides what runs
//! when; its errors are typed so the driver can map each to a core event (a refused read means
//! the producer fenced or never registered the blocks; a connect failure or timeout means the
//! producer is unreachable).

use std::fmt;
use std::io;

pub use pdkv_core::ports::Endpoint;

use pdkv_core::ids::Incarnation;

/// What a read names besides its ranges, for the producer to check: the incarnation of the
/// producer's rank its handshake described, and the key of the transfer whose blocks it reads
/// (`pattern::transfer_key`). A data plane that carries them (TCP) refuses a read meant for
/// another incarnation, and one of blocks no longer granted to the transfer (freed and
/// refilled for another), so a late read never returns another request's KV.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadTag {
    /// The producer rank's incarnation, when its handshake named one.
    pub incarnation: Option<Incarnation>,
    /// The transfer's key.
    pub transfer: Option<u64>,
}

/// The reader side of the data plane.
pub trait Transport {
    /// Reads `ranges` (remote address, length) from `peer`'s registered regions back to back
    /// into `into`, whose length must equal the sum of the lengths. Each range must lie inside
    /// one remote region. On error the contents of `into` are unspecified.
    fn read(&mut self, peer: &Endpoint, ranges: &[(u64, u64)], into: &mut [u8])
        -> Result<(), TransportError>;

    /// [`Transport::read`], abandoned when `cancelled` turns true: the read then fails with
    /// [`TransportError::Aborted`], and by the time it returns it touches no memory any more
    /// (local or remote), so the caller may release what it read. The default checks before
    /// the read starts and lets a started read run to its end or its I/O timeout; the verbs
    /// plane also stops a read in flight (queue pair to the error state, flushed completions
    /// drained).
    fn read_cancellable(
        &mut self,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
        into: &mut [u8],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        if cancelled() {
            return Err(TransportError::Aborted { peer: peer.to_string() });
        }
        self.read(peer, ranges, into)
    }

    /// [`Transport::read_cancellable`] of a read that names `tag`. The default ignores the tag:
    /// the verbs plane's reads are one-sided, so its producer cannot check one. The memory keys
    /// of a dead process die with it (so a read meant for another incarnation fails), and a
    /// fence rekeys the region (so reads in flight fail), but a read that starts after the fence
    /// gets the new keys and reads the blocks whatever they hold by then; per-transfer memory
    /// windows would close that and are not done. The TCP plane checks both.
    fn read_tagged(
        &mut self,
        peer: &Endpoint,
        tag: ReadTag,
        ranges: &[(u64, u64)],
        into: &mut [u8],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let _ = tag;
        self.read_cancellable(peer, ranges, into, cancelled)
    }
}

/// Why the remote side refused a read, as it reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteCode {
    /// A range lies in no region the remote ever registered.
    Unregistered,
    /// A range lies in a region the remote has deregistered (fenced).
    Revoked,
    /// A range starts inside a region but runs past its end.
    OutOfRange,
    /// The request was malformed (bad magic or version, truncated); the remote closed the
    /// connection.
    Malformed,
    /// The request passed a limit (range count or total bytes); the remote closed the
    /// connection.
    LimitExceeded,
    /// The read named another incarnation of the producer's rank: it restarted since the
    /// reader's handshake, and its memory is not the memory the reader's handshake described.
    OtherIncarnation,
    /// A code this build does not know, kept as sent.
    Other(u8),
}

impl fmt::Display for RemoteCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteCode::Unregistered => f.write_str("unregistered"),
            RemoteCode::Revoked => f.write_str("revoked"),
            RemoteCode::OutOfRange => f.write_str("out of range"),
            RemoteCode::Malformed => f.write_str("malformed request"),
            RemoteCode::LimitExceeded => f.write_str("limit exceeded"),
            RemoteCode::OtherIncarnation => f.write_str("another incarnation"),
            RemoteCode::Other(code) => write!(f, "error code {code}"),
        }
    }
}

/// Why a read failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportError {
    /// The request was refused locally before anything was sent: `into` does not match the
    /// ranges, or a limit was passed.
    InvalidRequest {
        /// What is wrong with it.
        detail: String,
    },
    /// No connection could be opened to the peer.
    Connect {
        /// The peer, as `host:port`.
        peer: String,
        /// The last error's kind.
        kind: io::ErrorKind,
        /// The last error's text.
        detail: String,
    },
    /// The peer refused the read (remote access error).
    Remote {
        /// The peer, as `host:port`.
        peer: String,
        /// The refusal's kind.
        code: RemoteCode,
        /// The peer's message.
        message: String,
    },
    /// The peer answered something that is not a valid response.
    Protocol {
        /// The peer, as `host:port`.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// An I/O error on an open connection.
    Io {
        /// The peer, as `host:port`.
        peer: String,
        /// What was being done: `send request`, `read status`, `read data`, ...
        op: &'static str,
        /// The error's kind.
        kind: io::ErrorKind,
        /// The error's text.
        detail: String,
    },
    /// A connect, send or receive did not finish in time.
    Timeout {
        /// The peer, as `host:port`.
        peer: String,
        /// What was being done.
        op: &'static str,
    },
    /// The caller cancelled the read; nothing of it runs any more.
    Aborted {
        /// The peer, as `host:port`.
        peer: String,
    },
}

impl TransportError {
    /// The error for an I/O failure during `op`, telling timeouts apart.
    pub fn io(peer: &Endpoint, op: &'static str, e: &io::Error) -> TransportError {
        let peer = peer.to_string();
        match e.kind() {
            // A socket timeout shows up as WouldBlock on Unix and TimedOut on Windows.
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransportError::Timeout { peer, op },
            kind => TransportError::Io { peer, op, kind, detail: e.to_string() },
        }
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportError::InvalidRequest { detail } => write!(f, "invalid read request: {detail}"),
            TransportError::Connect { peer, detail, .. } => write!(f, "cannot connect to {peer}: {detail}"),
            TransportError::Remote { peer, code, message } => {
                write!(f, "{peer} refused the read ({code}): {message}")
            }
            TransportError::Protocol { peer, detail } => write!(f, "bad response from {peer}: {detail}"),
            TransportError::Io { peer, op, detail, .. } => write!(f, "{op} with {peer} failed: {detail}"),
            TransportError::Timeout { peer, op } => write!(f, "{op} with {peer} timed out"),
            TransportError::Aborted { peer } => write!(f, "read from {peer} aborted"),
        }
    }
}

impl std::error::Error for TransportError {}
