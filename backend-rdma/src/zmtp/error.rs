//! Why a ZMTP connection could not be set up or used: [`ZmtpError`], naming what and where, and
//! [`Op`], what pdkv was doing when an I/O error struck.

use std::fmt;
use std::io;

#[cfg(doc)]
use super::codec::{MAX_COMMAND_BYTES, MAX_FRAMES, MAX_FRAME_BYTES, MAX_MESSAGE_BYTES};
#[cfg(doc)]
use super::socket::Connection;
use super::socket_type::SocketType;

/// What pdkv was doing when an I/O error or timeout struck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Opening the TCP connection.
    Connect,
    /// Binding a listener.
    Bind,
    /// Accepting a TCP connection.
    Accept,
    /// Reading from the peer.
    Read,
    /// Writing to the peer.
    Write,
    /// Setting a socket option or asking the socket for an address.
    Configure,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Connect => "connecting to",
            Op::Bind => "binding",
            Op::Accept => "accepting",
            Op::Read => "reading",
            Op::Write => "writing",
            Op::Configure => "configuring",
        })
    }
}

/// Why a ZMTP connection could not be set up or used. Each variant names what was wrong and
/// where; every error from malformed peer input is one of these, never a panic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZmtpError {
    /// An I/O error other than a timeout or end of stream.
    Io {
        /// What pdkv was doing.
        op: Op,
        /// What it was doing it to: `greeting`, `frame header`, `peer`, ...
        what: &'static str,
        /// The error's kind.
        kind: io::ErrorKind,
        /// The error's text.
        detail: String,
    },
    /// A read, write or connect did not finish in time (or the handshake deadline passed).
    Timeout {
        /// What pdkv was doing.
        op: Op,
        /// What it was doing it to.
        what: &'static str,
    },
    /// The peer closed the connection cleanly where a new item would start.
    Closed {
        /// The item pdkv was waiting for: `greeting` or `frame header`.
        during: &'static str,
    },
    /// The peer closed the connection in the middle of an item.
    Truncated {
        /// The item: `greeting`, `frame header`, `frame body`, `command body`.
        what: &'static str,
        /// Its length in bytes.
        expected: u64,
        /// How many of them arrived.
        got: u64,
    },
    /// The greeting does not start with `0xFF` or its tenth byte is not `0x7F`: not ZMTP 3.
    BadSignature {
        /// The first byte received.
        first: u8,
        /// The tenth byte received.
        tenth: u8,
    },
    /// The peer speaks a protocol revision older than ZMTP 3.0.
    UnsupportedVersion {
        /// The revision (major version) byte it sent: 0 is ZMTP 1.0, 1 is ZMTP 2.0.
        major: u8,
    },
    /// The peer's security mechanism is not NULL.
    UnsupportedMechanism {
        /// The mechanism it named, trailing zeros removed, unprintable bytes escaped.
        mechanism: String,
    },
    /// The peer's socket type cannot talk to this end.
    IncompatibleSocketType {
        /// This end's socket type.
        ours: SocketType,
        /// The peer's `Socket-Type`, unprintable bytes escaped.
        peer: String,
    },
    /// The peer's READY has no `Socket-Type` property.
    MissingSocketType,
    /// A command from the peer does not follow the grammar.
    MalformedCommand {
        /// The command's name (`READY`, `PING`, ...), or `unnamed` when even that is broken.
        command: String,
        /// What is wrong, with offsets into the command's data.
        detail: String,
    },
    /// A well-formed frame in a place the protocol does not allow it.
    ProtocolViolation {
        /// What arrived and where.
        detail: String,
    },
    /// The peer sent an ERROR command and will close the connection.
    PeerError {
        /// The reason it gave, unprintable bytes escaped.
        reason: String,
    },
    /// A frame larger than its limit ([`MAX_FRAME_BYTES`] or [`MAX_COMMAND_BYTES`]).
    FrameTooLarge {
        /// `message frame` or `command`.
        what: &'static str,
        /// Its size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A message whose frames together exceed [`MAX_MESSAGE_BYTES`].
    MessageTooLarge {
        /// The message's size so far, counting the frame that crossed the limit.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A message with more than [`MAX_FRAMES`] frames.
    TooManyFrames {
        /// The limit.
        max: usize,
    },
    /// [`Connection::send`] was given no frames; a message has at least one.
    EmptyMessage,
    /// The identity given to [`Connection::connect`] is not a valid ZMTP identity.
    InvalidIdentity {
        /// Why.
        detail: &'static str,
    },
    /// An earlier error struck in the middle of a message, so the byte stream is out of step;
    /// drop the connection and dial again.
    Broken,
}

impl fmt::Display for ZmtpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZmtpError::Io { op, what, detail, .. } => write!(f, "I/O error {op} the {what}: {detail}"),
            ZmtpError::Timeout { op, what } => write!(f, "timed out {op} the {what}"),
            ZmtpError::Closed { during } => {
                write!(f, "the peer closed the connection while pdkv waited for the {during}")
            }
            ZmtpError::Truncated { what, expected, got } => write!(
                f,
                "truncated {what}: the peer closed the connection after {got} of {expected} bytes"
            ),
            ZmtpError::BadSignature { first, tenth } => write!(
                f,
                "bad greeting signature: bytes 0 and 9 are {first:#04x} and {tenth:#04x}, expected 0xff \
                 and 0x7f (the peer does not speak ZMTP 3)"
            ),
            ZmtpError::UnsupportedVersion { major } => {
                let name = match major {
                    0 => " (ZMTP 1.0)",
                    1 => " (ZMTP 2.0)",
                    _ => "",
                };
                write!(
                    f,
                    "unsupported protocol version: the peer's greeting announces revision {major}{name}; \
                     pdkv needs ZMTP 3.0 or later"
                )
            }
            ZmtpError::UnsupportedMechanism { mechanism } => write!(
                f,
                "unsupported security mechanism in the peer's greeting: \"{mechanism}\"; pdkv speaks only NULL"
            ),
            ZmtpError::IncompatibleSocketType { ours, peer } => write!(
                f,
                "incompatible socket types: peer is {peer}, expected DEALER or ROUTER (this end is a {ours})"
            ),
            ZmtpError::MissingSocketType => {
                write!(f, "the peer's READY command has no Socket-Type property")
            }
            ZmtpError::MalformedCommand { command, detail } => {
                write!(f, "malformed {command} command from the peer: {detail}")
            }
            ZmtpError::ProtocolViolation { detail } => write!(f, "ZMTP protocol violation by the peer: {detail}"),
            ZmtpError::PeerError { reason } => write!(f, "the peer sent ERROR: \"{reason}\""),
            ZmtpError::FrameTooLarge { what, size, max } => {
                write!(f, "{what} of {size} bytes exceeds the limit of {max} bytes")
            }
            ZmtpError::MessageTooLarge { size, max } => {
                write!(f, "message of at least {size} bytes exceeds the limit of {max} bytes")
            }
            ZmtpError::TooManyFrames { max } => write!(f, "message has more than {max} frames"),
            ZmtpError::EmptyMessage => write!(f, "a message needs at least one frame"),
            ZmtpError::InvalidIdentity { detail } => write!(f, "invalid ZMTP identity: {detail}"),
            ZmtpError::Broken => write!(
                f,
                "connection unusable: an earlier error struck in the middle of a message; reconnect"
            ),
        }
    }
}

impl std::error::Error for ZmtpError {}

/// Maps an I/O error to a [`ZmtpError`]: socket timeouts (`WouldBlock` on Unix, `TimedOut`
/// elsewhere and from the handshake deadline) become [`ZmtpError::Timeout`].
pub(super) fn io_error(op: Op, what: &'static str, e: &io::Error) -> ZmtpError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ZmtpError::Timeout { op, what },
        kind => ZmtpError::Io { op, what, kind, detail: e.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::MAX_FRAME_BYTES;

    #[test]
    fn display_names_what_and_where() {
        let cases = [
            (
                ZmtpError::IncompatibleSocketType { ours: SocketType::Dealer, peer: "PUB".to_owned() },
                "incompatible socket types: peer is PUB, expected DEALER or ROUTER (this end is a DEALER)",
            ),
            (
                ZmtpError::UnsupportedVersion { major: 1 },
                "unsupported protocol version: the peer's greeting announces revision 1 (ZMTP 2.0); pdkv \
                 needs ZMTP 3.0 or later",
            ),
            (
                ZmtpError::Truncated { what: "frame body", expected: 10, got: 3 },
                "truncated frame body: the peer closed the connection after 3 of 10 bytes",
            ),
            (ZmtpError::Timeout { op: Op::Read, what: "greeting" }, "timed out reading the greeting"),
            (
                ZmtpError::FrameTooLarge { what: "message frame", size: 1 << 30, max: MAX_FRAME_BYTES },
                "message frame of 1073741824 bytes exceeds the limit of 67108864 bytes",
            ),
        ];
        for (error, text) in cases {
            assert_eq!(error.to_string(), text);
        }
    }
}
