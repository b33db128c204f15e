//! The TCP data plane: a producer rank's [`TcpReadServer`] serves reads of its registered
//! [`Regions`], and a decode rank's [`TcpTransport`] implements [`Transport`](crate::transport::Transport) against it. This is
//! the data plane whenever RDMA is not built or has no device.
//!
//! # Protocol
//!
//! One request and one response at a time on a persistent connection; all integers big-endian.
//!
//! Request:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | [`MAGIC`] (`0xA1`: the protocol's tag and version 1), or [`MAGIC_TAGGED`] (`0xA2`: version 2, a tagged read) |
//! | 1 | version 2 only: flags, bit 0 an incarnation follows, bit 1 a transfer follows; the other bits 0 |
//! | 8 | version 2 only: the incarnation of the server's rank the read means (0 when bit 0 is clear) |
//! | 8 | version 2 only: the key of the transfer the read is of (0 when bit 1 is clear) |
//! | 4 | range count `n`, at most [`MAX_RANGES`] |
//! | 16 × n | per range: remote address (u64), length (u64) |
//!
//! The lengths must add up to at most [`MAX_TOTAL_BYTES`]. Each range must lie inside one live
//! region of the server's registry. A tagged read is served only by the incarnation it names
//! ([`STATUS_OTHER_INCARNATION`] otherwise: the rank restarted since the reader's handshake) and
//! only from bytes granted to the transfer it names ([`STATUS_REVOKED`] otherwise: its blocks were
//! freed and refilled for another transfer, or never filled), so a late read never gets another
//! request's KV (`Regions::grant`). The decode rank tags every read with its session's
//! incarnation and its transfer; the version 1 form stays for readers that name neither.
//!
//! Response: a status byte. [`STATUS_OK`] is followed by exactly the requested bytes, range after
//! range. Any other status is an error code ([`STATUS_UNREGISTERED`], [`STATUS_REVOKED`],
//! [`STATUS_OUT_OF_RANGE`], [`STATUS_MALFORMED`], [`STATUS_LIMIT_EXCEEDED`],
//! [`STATUS_OTHER_INCARNATION`], [`STATUS_INTERNAL`])
//! followed by a message length (u32, at most [`MAX_MESSAGE_BYTES`]) and that many bytes of UTF-8.
//!
//! After an access error (unregistered, revoked, out of range) the connection stays usable: the
//! request was read in full, so both sides are still in step. After a malformed or over-limit
//! request the server answers, stops sending, drains what the client still sends for a moment
//! (so the answer is not lost to a reset) and closes that connection. No input panics the server.
//!
//! # Why it is fast
//!
//! The server checks every range under the registry's read lock, then sends the status byte and
//! each range with `write_all` straight from the region's memory (a 64 KiB `BufWriter` merges
//! small ranges and passes large ones through untouched); the client reads the payload with one
//! `read_exact` into the caller's buffer. There is no per-byte work and no intermediate copy on
//! either side, so throughput is that of a plain socket copy.
//!
//! Holding the read lock while sending is deliberate: [`Regions::deregister`] (a fence) waits
//! for reads in flight, so once it returns no peer can see the region's bytes. A write timeout
//! bounds how long a stalled reader can hold the fence back.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::memory::MemoryError;
#[cfg(doc)]
use crate::memory::Regions;
use crate::transport::{RemoteCode, TransportError};

mod client;
pub(crate) mod server;
#[cfg(test)]
mod tests;

pub use client::TcpTransport;
pub use server::TcpReadServer;

/// First byte of an untagged request: the protocol's tag and version 1.
pub const MAGIC: u8 = 0xA1;
/// First byte of a tagged request (version 2): flags, incarnation and transfer key follow.
pub const MAGIC_TAGGED: u8 = 0xA2;
/// Flag of a tagged request: the incarnation field is set.
pub(crate) const FLAG_INCARNATION: u8 = 1;
/// Flag of a tagged request: the transfer field is set.
pub(crate) const FLAG_TRANSFER: u8 = 2;
/// Most ranges one request may carry (a 1 MiB request header).
pub const MAX_RANGES: u32 = 65_536;
/// Most bytes one request may ask for: 1 GiB.
pub const MAX_TOTAL_BYTES: u64 = 1 << 30;
/// Longest error message a response may carry.
pub const MAX_MESSAGE_BYTES: u32 = 1024;
/// Most connections a server serves at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 256;

/// Status: the requested bytes follow.
pub const STATUS_OK: u8 = 0;
/// Status: a range lies in no region ever registered.
pub const STATUS_UNREGISTERED: u8 = 1;
/// Status: a range lies in a deregistered (fenced) region.
pub const STATUS_REVOKED: u8 = 2;
/// Status: a range runs past the end of its region.
pub const STATUS_OUT_OF_RANGE: u8 = 3;
/// Status: the request is malformed; the server closes the connection.
pub const STATUS_MALFORMED: u8 = 4;
/// Status: the request passes [`MAX_RANGES`] or [`MAX_TOTAL_BYTES`]; the server closes the
/// connection.
pub const STATUS_LIMIT_EXCEEDED: u8 = 5;
/// Status: the read names another incarnation of the server's rank (it restarted since the
/// reader's handshake); nothing was read.
pub const STATUS_OTHER_INCARNATION: u8 = 6;
/// Status: the server failed in a way the request did not cause.
pub const STATUS_INTERNAL: u8 = 255;

/// Size of one range in a request.
const RANGE_BYTES: usize = 16;
/// How long a server waits for the rest of a started request, or for a client to take bytes.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server drains a refused client before closing, and at most how much.
const DRAIN_TIME: Duration = Duration::from_millis(100);
const DRAIN_BYTES: usize = 1 << 20;

/// The code a client sees for a status byte.
pub fn remote_code(status: u8) -> RemoteCode {
    match status {
        STATUS_UNREGISTERED => RemoteCode::Unregistered,
        STATUS_REVOKED => RemoteCode::Revoked,
        STATUS_OUT_OF_RANGE => RemoteCode::OutOfRange,
        STATUS_MALFORMED => RemoteCode::Malformed,
        STATUS_LIMIT_EXCEEDED => RemoteCode::LimitExceeded,
        STATUS_OTHER_INCARNATION => RemoteCode::OtherIncarnation,
        other => RemoteCode::Other(other),
    }
}

/// Why a server could not start or stop cleanly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerError {
    /// The listening socket could not be bound.
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The error's kind.
        kind: io::ErrorKind,
        /// The error's text.
        detail: String,
    },
    /// The accept thread could not be started.
    Spawn {
        /// The error's text.
        detail: String,
    },
    /// The accept thread panicked (a bug).
    Panicked,
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerError::Bind { addr, detail, .. } => write!(f, "cannot listen on {addr}: {detail}"),
            ServerError::Spawn { detail } => write!(f, "cannot start the accept thread: {detail}"),
            ServerError::Panicked => f.write_str("the data-plane accept thread panicked"),
        }
    }
}

impl std::error::Error for ServerError {}

impl ServerError {
    /// The error for binding `addr`.
    pub(crate) fn bind(addr: SocketAddr, e: &io::Error) -> ServerError {
        ServerError::Bind { addr, kind: e.kind(), detail: e.to_string() }
    }
}

/// The status byte that reports an access error (shared with the RDMA data plane's control
/// protocol, which refuses with the same codes).
pub(crate) fn memory_status(e: &MemoryError) -> u8 {
    match e {
        MemoryError::Unregistered { .. } => STATUS_UNREGISTERED,
        MemoryError::Revoked { .. } | MemoryError::NotGranted { .. } => STATUS_REVOKED,
        MemoryError::OutOfRange { .. } => STATUS_OUT_OF_RANGE,
        _ => STATUS_INTERNAL,
    }
}

/// Appends an error message as the wire carries it: a u32 length and at most
/// [`MAX_MESSAGE_BYTES`] of UTF-8, cut at a character boundary.
pub(crate) fn push_message(out: &mut Vec<u8>, message: &str) {
    let mut end = message.len().min(MAX_MESSAGE_BYTES as usize);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u32).to_be_bytes());
    out.extend_from_slice(&message.as_bytes()[..end]);
}

/// Validates ranges against `into` and the limits, and encodes the request into `buf`.
/// Refuses a read whose ranges pass [`MAX_TOTAL_BYTES`] or do not fill `into_len` bytes
/// exactly (both data planes check this before sending anything).
pub(crate) fn check_total(ranges: &[(u64, u64)], into_len: usize) -> Result<(), TransportError> {
    let invalid = |detail| Err(TransportError::InvalidRequest { detail });
    let total = ranges.iter().try_fold(0u64, |t, &(_, len)| t.checked_add(len));
    match total {
        Some(t) if t > MAX_TOTAL_BYTES => {
            invalid(format!("{t} bytes requested; the limit is {MAX_TOTAL_BYTES}"))
        }
        Some(t) if t == into_len as u64 => Ok(()),
        Some(t) => invalid(format!("the ranges hold {t} bytes but the buffer {into_len}")),
        None => invalid("the range lengths overflow u64".to_string()),
    }
}
