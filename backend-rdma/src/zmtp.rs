//! ZeroMQ's wire protocol (ZMTP 3.1, NULL security mechanism) over blocking `TcpStream`s, so that
//! pdkv's control plane talks to MoRIIO's pyzmq ROUTER listeners and DEALER dialers without an
//! async runtime.
//!
//! Read from rfc.zeromq.org 37/ZMTP (3.1) and 23/ZMTP (3.0) and checked against libzmq's
//! `zmtp_engine.cpp` and `mechanism.cpp`, then against pyzmq itself (`tests/it/zmtp_pyzmq.rs`).
//! A connection goes through three stages:
//!
//! 1. **Greeting**, 64 bytes each way: `0xFF`, 8 padding bytes, `0x7F` (the signature), version
//!    major and minor, the mechanism name zero-padded to 20 bytes, the as-server byte and 31
//!    zero bytes. pdkv sends `3.1`, `NULL`, as-server 0 all at once (the spec's "demand"
//!    strategy; libzmq sends its signature, then holds back the rest of its greeting until it
//!    has seen the peer's), then reads the peer's greeting in three steps (signature, major version, the
//!    rest) so that an old peer is told apart before pdkv waits for bytes it will never send.
//! 2. **NULL handshake**: each side sends one READY command carrying metadata properties
//!    (`Socket-Type`, and `Identity` from a DEALER that has one). The dialer sends its READY
//!    first; the listener validates the dialer's before answering, and answers an incompatible
//!    peer with an ERROR command before closing, as the spec recommends.
//! 3. **Traffic**: messages of one or more frames (MORE on all but the last), and commands.
//!    A frame is a flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND), a size (1 byte, or 8
//!    bytes big-endian when LONG) and the body.
//!
//! What pdkv accepts and why:
//!
//! - The signature's padding is not checked: libzmq sends its identity length plus one there
//!   (`00 .. 01` from pyzmq 27.3 / libzmq 4.3.5), for ZMTP 1.0 peers, and the spec says the
//!   padding has no significance. Only bytes 0 and 9 are checked.
//! - Version: major 3 with any minor, and any higher major (the spec requires accepting higher
//!   versions). libzmq treats a 3.0 peer differently only in how it sends subscriptions (as
//!   messages, not SUBSCRIBE/CANCEL commands), which a DEALER/ROUTER pair never does, and it
//!   PINGs 3.0 peers too; so 3.0 and 3.1 peers both work, and pdkv always frames as 3.1.
//!   Revision bytes below 3 (0 is ZMTP 1.0, 1 is ZMTP 2.0, spoken by libzmq 2.x and 3.x) are
//!   refused, and an unversioned ZMTP 1.0 peer fails the signature check.
//! - Mechanism: exactly `NULL` followed by 16 zero bytes, as libzmq compares it.
//! - The as-server byte and the filler are not checked (libzmq does not either).
//! - Socket types: both pdkv kinds accept exactly DEALER and ROUTER peers. The spec also pairs
//!   DEALER with REP and ROUTER with REQ, but those peers add an empty delimiter frame that pdkv
//!   does not implement, so they are refused rather than misread. A READY without
//!   `Socket-Type` is refused (the spec says a peer SHOULD send it; pyzmq always does).
//! - Property names are compared without regard to case, as the spec says; libzmq compares them
//!   exactly, so pdkv sends the canonical `Socket-Type` and `Identity`.
//! - An `Identity` is at most 255 bytes and must not start with a zero byte (reserved for
//!   generated identities, which [`RouterListener`] makes the way libzmq does: `0x00` and a
//!   32-bit big-endian counter).
//! - Commands during traffic: PING is answered with PONG echoing its context (at most 16
//!   bytes; a longer one is cut to 16, as libzmq does); PONG, SUBSCRIBE, CANCEL and unknown
//!   commands are ignored; ERROR ends the connection with [`ZmtpError::PeerError`]; a second
//!   READY is a protocol violation. Commands are accepted even between the frames of one
//!   message: the grammar forbids it, but libzmq's engine can slot a PONG in there.
//!
//! On the wire a DEALER sends just its payload frames and a ROUTER replies with just its
//! payload frames on the same connection; the identity frame a pyzmq ROUTER shows its caller
//! never travels. pdkv's ROUTER side is one [`Connection`] per peer, whose
//! [`Connection::peer_identity`] says who it is.
//!
//! Everything read from the network is bounded ([`MAX_FRAME_BYTES`], [`MAX_MESSAGE_BYTES`],
//! [`MAX_FRAMES`], [`MAX_COMMAND_BYTES`]) and checked before it is trusted; malformed input
//! gives a [`ZmtpError`], never a panic, and a frame body is allocated as its bytes arrive,
//! not from the size a peer claims.
//!
//! Timeouts: [`Connection::connect`] and [`Connection::accept`] bound the whole handshake by one
//! deadline. Afterwards the socket's own timeouts apply to each blocking read or write
//! ([`Connection::set_read_timeout`], [`Connection::set_write_timeout`]). A timeout while
//! waiting for the first byte of a message leaves the connection usable; an error in the
//! middle of a message cannot be recovered from (the byte stream is out of step), so the
//! connection then answers every call with [`ZmtpError::Broken`].
//!
//! Nothing here spawns a thread or answers a PING on its own: PINGs are answered while the
//! caller is inside [`Connection::recv`]. A peer that sets a heartbeat timeout shorter than the
//! caller's gaps between `recv` calls will drop the connection; libzmq's default is no
//! heartbeats at all.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Length of a ZMTP 3 greeting, in bytes.
pub const GREETING_LEN: usize = 64;
/// Largest message frame pdkv sends or accepts (64 MiB); MoRIIO's control frames are a few
/// hundred bytes, and the data plane does not travel over ZMTP.
pub const MAX_FRAME_BYTES: u64 = 64 << 20;
/// Largest message, all its frames together (64 MiB).
pub const MAX_MESSAGE_BYTES: u64 = 64 << 20;
/// Most frames in one message; MoRIIO's messages have one or two.
pub const MAX_FRAMES: usize = 1024;
/// Largest command body (READY metadata, PING, ERROR); libzmq's are tens of bytes.
pub const MAX_COMMAND_BYTES: u64 = 64 << 10;
/// Longest `Identity` the spec allows.
pub const MAX_IDENTITY_BYTES: usize = 255;
/// Handshake timeout of a [`RouterListener`] until [`RouterListener::set_handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// The longest body a short frame carries; longer bodies need LONG.
const SHORT_MAX: usize = 255;
/// The mechanism field of a NULL greeting, exactly as libzmq compares it.
const NULL_MECHANISM: [u8; 20] = *b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
/// The longest PING context the spec allows; a PONG echoes at most this much.
const MAX_PING_CONTEXT: usize = 16;
/// Frame bodies up to this size are copied next to their header so that a small message
/// leaves in one write; larger ones are written straight from the caller's slice.
const COALESCE_BYTES: usize = 8 * 1024;
/// Longest peer-supplied text (socket type, mechanism, error reason) kept in an error.
const SHOWN_BYTES: usize = 64;

/// The two ZeroMQ socket types pdkv speaks: MoRIIO's listeners are ROUTERs and its dialers
/// DEALERs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Routes by peer identity; pdkv's listeners (handshake and notify).
    Router,
    /// Sends to whoever it is connected to; pdkv's dialers.
    Dealer,
}

impl SocketType {
    /// The `Socket-Type` property value: `ROUTER` or `DEALER`.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketType::Router => "ROUTER",
            SocketType::Dealer => "DEALER",
        }
    }

    /// The socket type a `Socket-Type` value names, if pdkv speaks it (the value is case
    /// sensitive, as libzmq compares it).
    fn from_wire(value: &[u8]) -> Option<SocketType> {
        match value {
            b"ROUTER" => Some(SocketType::Router),
            b"DEALER" => Some(SocketType::Dealer),
            _ => None,
        }
    }
}

impl fmt::Display for SocketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
fn io_error(op: Op, what: &'static str, e: &io::Error) -> ZmtpError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ZmtpError::Timeout { op, what },
        kind => ZmtpError::Io { op, what, kind, detail: e.to_string() },
    }
}

/// Peer bytes as text for an error message: printable ASCII kept, the rest escaped, cut short.
fn shown(bytes: &[u8]) -> String {
    let mut out: String =
        bytes.iter().take(SHOWN_BYTES).flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    if bytes.len() > SHOWN_BYTES {
        out.push_str("...");
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Reading and writing primitives, generic so that unit tests can feed bytes without sockets.

/// Reads `buf[start..end]`, reporting a short read against the whole of `buf`. `boundary`
/// says that nothing of the item was read before `start == 0`, so a clean end of stream there
/// is [`ZmtpError::Closed`] rather than [`ZmtpError::Truncated`].
fn fill<R: Read>(
    r: &mut R,
    buf: &mut [u8],
    start: usize,
    end: usize,
    what: &'static str,
    boundary: bool,
) -> Result<(), ZmtpError> {
    let mut at = start;
    while at < end {
        match r.read(&mut buf[at..end]) {
            Ok(0) if boundary && at == 0 => return Err(ZmtpError::Closed { during: what }),
            Ok(0) => {
                return Err(ZmtpError::Truncated { what, expected: buf.len() as u64, got: at as u64 });
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(Op::Read, what, &e)),
        }
    }
    Ok(())
}

/// Reads a body of `size` bytes, growing the buffer as bytes arrive so that a peer claiming a
/// large size and sending nothing costs nothing.
fn read_body<R: Read>(r: &mut R, size: u64, what: &'static str) -> Result<Vec<u8>, ZmtpError> {
    let mut body = Vec::with_capacity(usize::try_from(size.min(64 * 1024)).unwrap_or(0));
    r.by_ref().take(size).read_to_end(&mut body).map_err(|e| io_error(Op::Read, what, &e))?;
    if (body.len() as u64) < size {
        return Err(ZmtpError::Truncated { what, expected: size, got: body.len() as u64 });
    }
    Ok(body)
}

fn write_all<W: Write>(w: &mut W, bytes: &[u8], what: &'static str) -> Result<(), ZmtpError> {
    w.write_all(bytes).map_err(|e| io_error(Op::Write, what, &e))
}

/// A frame's flags byte and body size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    flags: u8,
    size: u64,
}

impl Header {
    fn is_command(self) -> bool {
        self.flags & FLAG_COMMAND != 0
    }

    fn more(self) -> bool {
        self.flags & FLAG_MORE != 0
    }
}

/// Checks a frame's flags byte: no reserved bits, and no MORE on a command.
fn check_flags(flags: u8) -> Result<(), ZmtpError> {
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::ProtocolViolation {
            detail: format!("frame flags {flags:#04x} set reserved bits 7-3, which must be zero"),
        });
    }
    if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
        return Err(ZmtpError::ProtocolViolation {
            detail: format!("frame flags {flags:#04x} mark a command with MORE, which commands never carry"),
        });
    }
    Ok(())
}

/// Reads a frame's flags and size; `boundary` when no frame of a message is pending, so a
/// clean close before the flags byte is [`ZmtpError::Closed`].
fn read_header<R: Read>(r: &mut R, boundary: bool) -> Result<Header, ZmtpError> {
    let mut buf = [0u8; 9];
    fill(r, &mut buf[..1], 0, 1, "frame header", boundary)?;
    let flags = buf[0];
    check_flags(flags)?;
    let size = if flags & FLAG_LONG != 0 {
        fill(r, &mut buf, 1, 9, "frame header", false)?;
        let mut size = [0u8; 8];
        size.copy_from_slice(&buf[1..9]);
        u64::from_be_bytes(size)
    } else {
        fill(r, &mut buf[..2], 1, 2, "frame header", false)?;
        u64::from(buf[1])
    };
    Ok(Header { flags, size })
}

/// Appends a frame header: short when the body fits in 255 bytes, else LONG.
fn push_header(out: &mut Vec<u8>, flags: u8, len: usize) {
    if len <= SHORT_MAX {
        out.push(flags);
        out.push(len as u8);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

/// A whole command frame: `name` (1 to 255 letters) then `data`.
fn command_frame(name: &[u8], data: &[u8]) -> Vec<u8> {
    let body_len = 1 + name.len() + data.len();
    let mut out = Vec::with_capacity(9 + body_len);
    push_header(&mut out, FLAG_COMMAND, body_len);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(data);
    out
}

// ---------------------------------------------------------------------------------------------
// Greeting.

/// The greeting pdkv sends: signature with zero padding, version 3.1, NULL, as-server 0.
fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..32].copy_from_slice(&NULL_MECHANISM);
    g
}

/// Reads and checks the peer's greeting; returns its (major, minor) version.
fn read_greeting<R: Read>(r: &mut R) -> Result<(u8, u8), ZmtpError> {
    let mut g = [0u8; GREETING_LEN];
    // The signature first: an unversioned ZMTP 1.0 peer never sends more than this before
    // waiting for us.
    fill(r, &mut g, 0, 10, "greeting", true)?;
    check_signature(&g)?;
    // Then the major version alone: a ZMTP 2.0 peer sends 12 bytes in all and waits.
    fill(r, &mut g, 10, 11, "greeting", false)?;
    let major = g[10];
    check_major(major)?;
    fill(r, &mut g, 11, GREETING_LEN, "greeting", false)?;
    check_mechanism(&g)?;
    Ok((major, g[11]))
}

/// Checks a greeting's signature, its bytes 0 and 9 (the padding between means nothing).
fn check_signature(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ZmtpError::BadSignature { first: g[0], tenth: g[9] });
    }
    Ok(())
}

/// Checks a greeting's major version (byte 10): ZMTP 3.0 or later.
fn check_major(major: u8) -> Result<(), ZmtpError> {
    if major < 3 {
        return Err(ZmtpError::UnsupportedVersion { major });
    }
    Ok(())
}

/// Checks a greeting's mechanism (bytes 12 to 31): exactly NULL.
fn check_mechanism(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    let mechanism = &g[12..32];
    if mechanism != NULL_MECHANISM {
        let end = mechanism.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        return Err(ZmtpError::UnsupportedMechanism { mechanism: shown(&mechanism[..end]) });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Commands.

/// Splits a command body into its name and data.
fn parse_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let malformed = |detail: String| ZmtpError::MalformedCommand { command: "unnamed".to_owned(), detail };
    let Some((&len, rest)) = body.split_first() else {
        return Err(malformed("empty command body, without even a name length".to_owned()));
    };
    let len = usize::from(len);
    if len == 0 {
        return Err(malformed("zero-length command name".to_owned()));
    }
    if len > rest.len() {
        return Err(malformed(format!(
            "command name length {len} overflows the {} bytes left in the command body",
            rest.len()
        )));
    }
    let (name, data) = rest.split_at(len);
    if !name.iter().all(u8::is_ascii_alphabetic) {
        return Err(malformed(format!("command name \"{}\" is not all letters", shown(name))));
    }
    Ok((name, data))
}

/// The metadata of a READY command that pdkv reads; other properties are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Ready {
    socket_type: Option<Vec<u8>>,
    identity: Option<Vec<u8>>,
}

fn ready_error(detail: String) -> ZmtpError {
    ZmtpError::MalformedCommand { command: "READY".to_owned(), detail }
}

/// Parses the metadata after READY's name: properties of a 1-byte name length, the name, a
/// 4-byte big-endian value length and the value, until the data ends exactly.
fn parse_ready(data: &[u8]) -> Result<Ready, ZmtpError> {
    let mut ready = Ready::default();
    let mut at = 0usize;
    while at < data.len() {
        let start = at;
        let name_len = usize::from(data[at]);
        at += 1;
        if name_len == 0 {
            return Err(ready_error(format!("property at offset {start} has a zero-length name")));
        }
        let left = data.len() - at;
        if name_len > left {
            return Err(ready_error(format!(
                "property at offset {start}: name length {name_len} overflows the {left} bytes left"
            )));
        }
        let name = &data[at..at + name_len];
        at += name_len;
        if !name.iter().all(|&b| b.is_ascii_alphanumeric() || b"-_.+".contains(&b)) {
            return Err(ready_error(format!("property at offset {start}: invalid name \"{}\"", shown(name))));
        }
        let left = data.len() - at;
        if left < 4 {
            return Err(ready_error(format!(
                "property {} at offset {start}: value length field needs 4 bytes, {left} left",
                shown(name)
            )));
        }
        let value_len = u32::from_be_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
        at += 4;
        let left = data.len() - at;
        // The spec caps values at 2^31-1; the comparison with what is left covers that too,
        // since a command body is far smaller.
        let value_len = usize::try_from(value_len).unwrap_or(usize::MAX);
        if value_len > left {
            return Err(ready_error(format!(
                "property {} at offset {start}: value length {value_len} overflows the {left} bytes left",
                shown(name)
            )));
        }
        let value = data[at..at + value_len].to_vec();
        at += value_len;
        let slot = if name.eq_ignore_ascii_case(b"Socket-Type") {
            &mut ready.socket_type
        } else if name.eq_ignore_ascii_case(b"Identity") {
            &mut ready.identity
        } else {
            // Resource, X-* and implementation properties mean nothing to a DEALER or ROUTER.
            continue;
        };
        if slot.is_some() {
            return Err(ready_error(format!("property {} appears twice", shown(name))));
        }
        *slot = Some(value);
    }
    Ok(ready)
}

/// Appends one metadata property.
fn push_property(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// The READY command frame this end sends.
fn ready_frame(kind: SocketType, identity: Option<&[u8]>) -> Vec<u8> {
    let mut data = Vec::new();
    push_property(&mut data, "Socket-Type", kind.as_str().as_bytes());
    if let Some(id) = identity {
        push_property(&mut data, "Identity", id);
    }
    command_frame(b"READY", &data)
}

/// The reason carried by an ERROR command (a 1-byte length and the text).
fn parse_error_reason(data: &[u8]) -> Result<String, ZmtpError> {
    let Some((&len, rest)) = data.split_first() else {
        return Ok(String::new());
    };
    let len = usize::from(len);
    if len > rest.len() {
        return Err(ZmtpError::MalformedCommand {
            command: "ERROR".to_owned(),
            detail: format!("reason length {len} overflows the {} bytes left", rest.len()),
        });
    }
    Ok(shown(&rest[..len]))
}

/// An ERROR command telling the peer why pdkv closes the connection.
fn error_frame(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(SHORT_MAX)];
    let mut data = Vec::with_capacity(1 + reason.len());
    data.push(reason.len() as u8);
    data.extend_from_slice(reason);
    command_frame(b"ERROR", &data)
}

/// Checks an identity's length and first byte (identities starting with zero are reserved).
fn check_identity(id: &[u8]) -> Result<(), &'static str> {
    if id.len() > MAX_IDENTITY_BYTES {
        Err("longer than 255 bytes")
    } else if id.first() == Some(&0) {
        Err("starts with a zero byte, which ZMTP reserves for generated identities")
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake.

/// Which side of the NULL handshake this end plays: the dialer speaks first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Dialer,
    Listener,
}

/// What the handshake learnt about the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Peer {
    socket_type: SocketType,
    identity: Vec<u8>,
    version: (u8, u8),
}

/// Reads the peer's READY (or ERROR) command.
fn read_ready<R: Read>(r: &mut R) -> Result<Ready, ZmtpError> {
    let header = read_header(r, true)?;
    if !header.is_command() {
        return Err(ZmtpError::ProtocolViolation {
            detail: "a message frame arrived before the peer's READY command".to_owned(),
        });
    }
    if header.size > MAX_COMMAND_BYTES {
        return Err(ZmtpError::FrameTooLarge { what: "command", size: header.size, max: MAX_COMMAND_BYTES });
    }
    let body = read_body(r, header.size, "command body")?;
    handshake_command(&body)
}

/// The peer's READY metadata from the body of the first command it sends, or the error its
/// ERROR (or any other command) means.
fn handshake_command(body: &[u8]) -> Result<Ready, ZmtpError> {
    let (name, data) = parse_command(body)?;
    match name {
        b"READY" => parse_ready(data),
        b"ERROR" => Err(ZmtpError::PeerError { reason: parse_error_reason(data)? }),
        _ => Err(ZmtpError::ProtocolViolation {
            detail: format!("expected the READY command, got {}", shown(name)),
        }),
    }
}

/// Checks the peer's metadata against this end's socket type.
fn validate_peer(kind: SocketType, ready: Ready, version: (u8, u8)) -> Result<Peer, ZmtpError> {
    let raw_type = ready.socket_type.ok_or(ZmtpError::MissingSocketType)?;
    let socket_type = SocketType::from_wire(&raw_type)
        .ok_or_else(|| ZmtpError::IncompatibleSocketType { ours: kind, peer: shown(&raw_type) })?;
    let identity = ready.identity.unwrap_or_default();
    check_identity(&identity).map_err(|why| ZmtpError::MalformedCommand {
        command: "READY".to_owned(),
        detail: format!("Identity \"{}\" {why}", shown(&identity)),
    })?;
    Ok(Peer { socket_type, identity, version })
}

/// Greeting and NULL handshake on any byte stream. On a failed validation the peer is sent an
/// ERROR first (best effort: the connection is being given up anyway).
fn handshake<S: Read + Write>(
    s: &mut S,
    kind: SocketType,
    identity: Option<&[u8]>,
    role: Role,
) -> Result<Peer, ZmtpError> {
    write_all(s, &greeting(), "greeting")?;
    let version = read_greeting(s)?;
    if role == Role::Dialer {
        write_all(s, &ready_frame(kind, identity), "READY command")?;
    }
    let ready = read_ready(s)?;
    let peer = match validate_peer(kind, ready, version) {
        Ok(peer) => peer,
        Err(e) => {
            let _ = s.write_all(&error_frame(&e.to_string()));
            return Err(e);
        }
    };
    if role == Role::Listener {
        write_all(s, &ready_frame(kind, identity), "READY command")?;
    }
    Ok(peer)
}

// ---------------------------------------------------------------------------------------------
// Traffic.

/// A byte stream that counts what went through, so that a failed receive or send can tell
/// whether it left the stream at a message boundary.
struct Counted<S> {
    inner: S,
    read: u64,
    written: u64,
}

impl<S> Counted<S> {
    fn new(inner: S) -> Counted<S> {
        Counted { inner, read: 0, written: 0 }
    }
}

impl<S: Read> Read for Counted<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

impl<S: Write> Write for Counted<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Reads one whole message, answering PINGs on the way. `clean` is set to the byte count at
/// which the stream sits at a message boundary (nothing of a message consumed), or `None`
/// once a message has started or a PONG has been (partly) written; the caller compares it
/// with the count after a failure.
fn read_message<S: Read + Write>(
    s: &mut Counted<S>,
    pongs: &mut u64,
    clean: &mut Option<u64>,
) -> Result<Vec<Vec<u8>>, ZmtpError> {
    let mut frames: Vec<Vec<u8>> = Vec::new();
    let mut total: u64 = 0;
    loop {
        *clean = if frames.is_empty() { Some(s.read) } else { None };
        let header = read_header(s, frames.is_empty())?;
        if header.is_command() {
            if header.size > MAX_COMMAND_BYTES {
                return Err(ZmtpError::FrameTooLarge {
                    what: "command",
                    size: header.size,
                    max: MAX_COMMAND_BYTES,
                });
            }
            let body = read_body(s, header.size, "command body")?;
            if let Some(pong) = traffic_command(&body)? {
                *clean = None;
                write_all(s, &pong, "PONG command")?;
                *pongs += 1;
            }
            continue;
        }
        if header.size > MAX_FRAME_BYTES {
            return Err(ZmtpError::FrameTooLarge {
                what: "message frame",
                size: header.size,
                max: MAX_FRAME_BYTES,
            });
        }
        if frames.len() == MAX_FRAMES {
            return Err(ZmtpError::TooManyFrames { max: MAX_FRAMES });
        }
        total += header.size;
        if total > MAX_MESSAGE_BYTES {
            return Err(ZmtpError::MessageTooLarge { size: total, max: MAX_MESSAGE_BYTES });
        }
        frames.push(read_body(s, header.size, "frame body")?);
        if !header.more() {
            return Ok(frames);
        }
    }
}

/// What a command from the peer after the handshake asks for, given its body: the PONG frame
/// to answer a PING with, nothing for a command to skip, or the error an ERROR or a second
/// READY means.
fn traffic_command(body: &[u8]) -> Result<Option<Vec<u8>>, ZmtpError> {
    let (name, data) = parse_command(body)?;
    match name {
        b"PING" => {
            // ping = "PING" ttl(2 bytes) context(0..16 bytes); the TTL is a hint for
            // peers that police heartbeats, which pdkv does not.
            let Some(context) = data.get(2..) else {
                return Err(ZmtpError::MalformedCommand {
                    command: "PING".to_owned(),
                    detail: format!("{} bytes of data, shorter than the 2-byte TTL", data.len()),
                });
            };
            let context = &context[..context.len().min(MAX_PING_CONTEXT)];
            Ok(Some(command_frame(b"PONG", context)))
        }
        b"ERROR" => Err(ZmtpError::PeerError { reason: parse_error_reason(data)? }),
        b"READY" => Err(ZmtpError::ProtocolViolation {
            detail: "a second READY command arrived after the handshake".to_owned(),
        }),
        // PONG (pdkv never pings), SUBSCRIBE/CANCEL/JOIN/LEAVE (meaningless between a
        // DEALER and a ROUTER) and unknown commands are skipped, as libzmq does.
        _ => Ok(None),
    }
}

/// Checks an outgoing message against the limits a pdkv receiver enforces.
fn check_outgoing(frames: &[&[u8]]) -> Result<(), ZmtpError> {
    if frames.is_empty() {
        return Err(ZmtpError::EmptyMessage);
    }
    if frames.len() > MAX_FRAMES {
        return Err(ZmtpError::TooManyFrames { max: MAX_FRAMES });
    }
    let mut total = 0u64;
    for frame in frames {
        let size = frame.len() as u64;
        if size > MAX_FRAME_BYTES {
            return Err(ZmtpError::FrameTooLarge { what: "message frame", size, max: MAX_FRAME_BYTES });
        }
        total += size;
        if total > MAX_MESSAGE_BYTES {
            return Err(ZmtpError::MessageTooLarge { size: total, max: MAX_MESSAGE_BYTES });
        }
    }
    Ok(())
}

/// Writes one message: MORE on every frame but the last. Small frames are gathered with
/// their headers into one buffer so that the message leaves in as few writes as possible.
fn write_message<W: Write>(w: &mut W, frames: &[&[u8]]) -> Result<(), ZmtpError> {
    let mut buf = Vec::with_capacity(frames.iter().map(|f| 9 + f.len().min(COALESCE_BYTES)).sum());
    for (i, frame) in frames.iter().enumerate() {
        let flags = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        push_header(&mut buf, flags, frame.len());
        if frame.len() <= COALESCE_BYTES {
            buf.extend_from_slice(frame);
        } else {
            write_all(w, &buf, "message")?;
            buf.clear();
            write_all(w, frame, "message")?;
        }
    }
    write_all(w, &buf, "message")
}

/// The socket seen through a deadline: every read or write first sets the socket's timeout to
/// the time left, so that the whole handshake, however the peer drips its bytes, ends in time.
struct DeadlineIo<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl DeadlineIo<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "handshake deadline passed"))
        } else {
            Ok(left)
        }
    }
}

impl Read for DeadlineIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

impl Write for DeadlineIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Public API.

/// One ZMTP connection after a successful handshake: a DEALER or ROUTER end talking to one
/// peer. Not thread-safe by design; one owner sends and receives.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    kind: SocketType,
    peer_type: SocketType,
    peer_identity: Vec<u8>,
    peer_version: (u8, u8),
    /// Set when an error struck mid-message; every later call fails with `Broken`.
    broken: bool,
    pings_answered: u64,
}

impl Connection {
    /// Dials `addr` as a `kind` socket (a DEALER, for pdkv), announcing `identity` to the peer
    /// (what a ROUTER peer will know this end by; `None` or empty lets the ROUTER make one up),
    /// and runs the handshake. `timeout` bounds the TCP connect and, separately, the whole
    /// handshake; it also becomes the write timeout. The read timeout is then none (block).
    pub fn connect(
        addr: SocketAddr,
        kind: SocketType,
        identity: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Connection, ZmtpError> {
        let identity = identity.filter(|id| !id.is_empty());
        if let Some(id) = identity {
            check_identity(id).map_err(|detail| ZmtpError::InvalidIdentity { detail })?;
        }
        let stream =
            TcpStream::connect_timeout(&addr, timeout).map_err(|e| io_error(Op::Connect, "peer", &e))?;
        Connection::start(stream, kind, identity, Role::Dialer, timeout)
    }

    /// Runs the listener side of the handshake on an accepted `stream` as a `kind` socket (a
    /// ROUTER, for pdkv), within `timeout`, which also becomes the write timeout. The peer
    /// identity is whatever the peer announced, possibly empty (see [`RouterListener`] for one
    /// that fills in an identity).
    pub fn accept(stream: TcpStream, kind: SocketType, timeout: Duration) -> Result<Connection, ZmtpError> {
        Connection::start(stream, kind, None, Role::Listener, timeout)
    }

    fn start(
        stream: TcpStream,
        kind: SocketType,
        identity: Option<&[u8]>,
        role: Role,
        timeout: Duration,
    ) -> Result<Connection, ZmtpError> {
        let configure = |e: io::Error| io_error(Op::Configure, "socket", &e);
        // Control messages are small and latency-bound: do not let Nagle hold them back.
        stream.set_nodelay(true).map_err(configure)?;
        let deadline = Instant::now() + timeout;
        let peer = handshake(&mut DeadlineIo { stream: &stream, deadline }, kind, identity, role)?;
        stream.set_read_timeout(None).map_err(configure)?;
        stream.set_write_timeout(Some(timeout).filter(|t| !t.is_zero())).map_err(configure)?;
        Ok(Connection {
            stream,
            kind,
            peer_type: peer.socket_type,
            peer_identity: peer.identity,
            peer_version: peer.version,
            broken: false,
            pings_answered: 0,
        })
    }

    /// Sends one message of `frames` (at least one), MORE set on all but the last. A DEALER or
    /// a ROUTER sends just its payload frames: no identity frame travels on the wire.
    pub fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        if self.broken {
            return Err(ZmtpError::Broken);
        }
        check_outgoing(frames)?;
        let mut w = Counted::new(&self.stream);
        let result = write_message(&mut w, frames);
        if result.is_err() && w.written > 0 {
            self.broken = true;
        }
        result
    }

    /// Receives one whole message (all its frames), answering any PING with a PONG and
    /// skipping other commands meanwhile. Blocks up to the read timeout for each read; a
    /// timeout before the first byte of a message leaves the connection usable.
    pub fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmtpError> {
        if self.broken {
            return Err(ZmtpError::Broken);
        }
        let mut s = Counted::new(&self.stream);
        let mut clean = None;
        let result = read_message(&mut s, &mut self.pings_answered, &mut clean);
        if result.is_err() && clean != Some(s.read) {
            self.broken = true;
        }
        result
    }

    /// The identity the peer announced (empty when it announced none), or the one a
    /// [`RouterListener`] generated for it.
    pub fn peer_identity(&self) -> &[u8] {
        &self.peer_identity
    }

    /// The peer's socket type.
    pub fn peer_type(&self) -> SocketType {
        self.peer_type
    }

    /// The ZMTP version the peer's greeting announced, as (major, minor).
    pub fn peer_version(&self) -> (u8, u8) {
        self.peer_version
    }

    /// This end's socket type.
    pub fn socket_type(&self) -> SocketType {
        self.kind
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Result<SocketAddr, ZmtpError> {
        self.stream.peer_addr().map_err(|e| io_error(Op::Configure, "peer address", &e))
    }

    /// How many PINGs this connection has answered with a PONG.
    pub fn pings_answered(&self) -> u64 {
        self.pings_answered
    }

    /// Bounds each blocking read of [`Connection::recv`]; `None` blocks indefinitely.
    /// `Some(Duration::ZERO)` is refused, as by `TcpStream`.
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ZmtpError> {
        self.stream.set_read_timeout(timeout).map_err(|e| io_error(Op::Configure, "read timeout", &e))
    }

    /// Bounds each blocking write of [`Connection::send`] (and of PONGs); `None` blocks
    /// indefinitely. `Some(Duration::ZERO)` is refused, as by `TcpStream`.
    pub fn set_write_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ZmtpError> {
        self.stream.set_write_timeout(timeout).map_err(|e| io_error(Op::Configure, "write timeout", &e))
    }
}

/// A ROUTER listener: accepts one TCP connection at a time and hands back a [`Connection`]
/// per peer, whose identity is the DEALER's (or a generated one). It keeps no table of
/// peers and spawns no thread; the caller decides how to serve the connections, and replies on
/// the connection a request came in on. Two peers announcing the same identity both get
/// their connection (libzmq would refuse the second); telling them apart is the caller's job.
#[derive(Debug)]
pub struct RouterListener {
    listener: TcpListener,
    handshake_timeout: Duration,
    next_generated: u32,
}

impl RouterListener {
    /// Binds a TCP listener on `addr` (port 0 lets the OS choose; see
    /// [`RouterListener::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<RouterListener, ZmtpError> {
        let listener = TcpListener::bind(addr).map_err(|e| io_error(Op::Bind, "listener", &e))?;
        Ok(RouterListener { listener, handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT, next_generated: 1 })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr, ZmtpError> {
        self.listener.local_addr().map_err(|e| io_error(Op::Configure, "listener address", &e))
    }

    /// Sets the deadline of each accepted connection's handshake (default
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`]); it is also the connection's write timeout.
    pub fn set_handshake_timeout(&mut self, timeout: Duration) {
        self.handshake_timeout = timeout;
    }

    /// Blocks until a peer connects, then runs the handshake as a ROUTER. A peer that
    /// announced no identity gets a generated one: a zero byte and a 32-bit big-endian
    /// counter starting at 1, as libzmq makes them (its counter starts at a random value).
    /// A handshake error concerns that one peer only; the listener stays usable.
    pub fn accept(&mut self) -> Result<Connection, ZmtpError> {
        let (stream, _) = self.listener.accept().map_err(|e| io_error(Op::Accept, "connection", &e))?;
        let mut conn = Connection::accept(stream, SocketType::Router, self.handshake_timeout)?;
        if conn.peer_identity.is_empty() {
            let mut id = vec![0u8];
            id.extend_from_slice(&self.next_generated.to_be_bytes());
            self.next_generated = self.next_generated.wrapping_add(1);
            conn.peer_identity = id;
        }
        Ok(conn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use std::thread;

    /// A byte stream whose reads come from `input` and whose writes land in `output`.
    struct Duplex {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Duplex {
        fn new(input: Vec<u8>) -> Duplex {
            Duplex { input: Cursor::new(input), output: Vec::new() }
        }
    }

    impl Read for Duplex {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Duplex {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A table row: its name, the input bytes, what they must give.
    type Case<T> = (&'static str, Vec<u8>, T);
    /// A frame's expected flags byte and the length of its size field.
    type FlagsAndSizeLen = (u8, usize);
    /// The frames of one received message.
    type Message = Vec<Vec<u8>>;

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    /// A greeting with the given version and mechanism, and libzmq-style non-zero padding
    /// when `padding` is set.
    fn greeting_with(major: u8, minor: u8, mechanism: &[u8], padding: bool) -> Vec<u8> {
        let mut g = greeting().to_vec();
        if padding {
            // libzmq 4.3.5 sends its identity length plus one; with no identity, 1.
            g[1..9].copy_from_slice(&1u64.to_be_bytes());
        }
        g[10] = major;
        g[11] = minor;
        g[12..32].fill(0);
        g[12..12 + mechanism.len()].copy_from_slice(mechanism);
        g
    }

    fn message_frame(more: bool, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        push_header(&mut out, if more { FLAG_MORE } else { 0 }, body.len());
        out.extend_from_slice(body);
        out
    }

    fn property(name: &str, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        push_property(&mut out, name, value);
        out
    }

    #[test]
    fn greeting_encoding_is_exact() {
        let mut expected = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 1];
        expected.extend_from_slice(b"NULL");
        expected.extend_from_slice(&[0; 16]);
        expected.push(0); // as-server
        expected.extend_from_slice(&[0; 31]);
        assert_eq!(greeting().to_vec(), expected);
        assert_eq!(expected.len(), GREETING_LEN);
    }

    #[test]
    fn greeting_decoding_table() {
        let ours = greeting().to_vec();
        let mut tenth_wrong = ours.clone();
        tenth_wrong[9] = 0x00;
        let cases: Vec<Case<Result<(u8, u8), ZmtpError>>> = vec![
            ("pdkv's own greeting", ours.clone(), Ok((3, 1))),
            ("ZMTP 3.0 peer", greeting_with(3, 0, b"NULL", false), Ok((3, 0))),
            ("libzmq's non-zero padding is ignored", greeting_with(3, 1, b"NULL", true), Ok((3, 1))),
            ("a higher version is accepted", greeting_with(4, 0, b"NULL", false), Ok((4, 0))),
            (
                "bad first byte",
                cat(&[&[0x01], &ours[1..]]),
                Err(ZmtpError::BadSignature { first: 0x01, tenth: 0x7F }),
            ),
            ("bad tenth byte", tenth_wrong, Err(ZmtpError::BadSignature { first: 0xFF, tenth: 0x00 })),
            (
                "ZMTP 2.0 (revision 1) stops after 11 bytes",
                ours[..10].iter().copied().chain([1u8]).collect(),
                Err(ZmtpError::UnsupportedVersion { major: 1 }),
            ),
            (
                "version 2",
                greeting_with(2, 0, b"NULL", false),
                Err(ZmtpError::UnsupportedVersion { major: 2 }),
            ),
            (
                "PLAIN mechanism",
                greeting_with(3, 1, b"PLAIN", false),
                Err(ZmtpError::UnsupportedMechanism { mechanism: "PLAIN".to_owned() }),
            ),
            (
                "NULL with trailing bytes is not NULL",
                greeting_with(3, 1, b"NULL\0X", false),
                Err(ZmtpError::UnsupportedMechanism { mechanism: "NULL\\x00X".to_owned() }),
            ),
            ("nothing at all", Vec::new(), Err(ZmtpError::Closed { during: "greeting" })),
            (
                "truncated signature",
                ours[..5].to_vec(),
                Err(ZmtpError::Truncated { what: "greeting", expected: 64, got: 5 }),
            ),
            (
                "truncated greeting",
                ours[..30].to_vec(),
                Err(ZmtpError::Truncated { what: "greeting", expected: 64, got: 30 }),
            ),
        ];
        for (name, bytes, expected) in cases {
            assert_eq!(read_greeting(&mut Cursor::new(bytes)), expected, "{name}");
        }
    }

    #[test]
    fn ready_encoding_is_exact() {
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        body.extend_from_slice(&[11]);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&[0, 0, 0, 6]);
        body.extend_from_slice(b"DEALER");
        body.extend_from_slice(&[8]);
        body.extend_from_slice(b"Identity");
        body.extend_from_slice(&[0, 0, 0, 3]);
        body.extend_from_slice(b"abc");
        let mut expected = vec![FLAG_COMMAND, body.len() as u8];
        expected.extend_from_slice(&body);
        assert_eq!(ready_frame(SocketType::Dealer, Some(b"abc")), expected);
        // Without an identity there is no Identity property at all.
        let router = ready_frame(SocketType::Router, None);
        assert_eq!(&router[..2], &[FLAG_COMMAND, (1 + 5 + 1 + 11 + 4 + 6) as u8]);
        assert!(router.ends_with(b"Socket-Type\0\0\0\x06ROUTER"));
    }

    #[test]
    fn ready_decoding_table() {
        let st = |v: &[u8]| property("Socket-Type", v);
        let cases: Vec<Case<Result<Ready, ZmtpError>>> = vec![
            (
                "socket type and identity",
                cat(&[&st(b"DEALER"), &property("Identity", b"dec-0")]),
                Ok(Ready { socket_type: Some(b"DEALER".to_vec()), identity: Some(b"dec-0".to_vec()) }),
            ),
            (
                "names are case-insensitive",
                cat(&[&property("socket-type", b"ROUTER"), &property("IDENTITY", b"")]),
                Ok(Ready { socket_type: Some(b"ROUTER".to_vec()), identity: Some(Vec::new()) }),
            ),
            (
                "unknown properties are skipped",
                cat(&[&property("X-Extra", b"1"), &st(b"ROUTER"), &property("Resource", b"a/b")]),
                Ok(Ready { socket_type: Some(b"ROUTER".to_vec()), identity: None }),
            ),
            ("no properties", Vec::new(), Ok(Ready::default())),
            (
                "property name length overflow",
                vec![200, b'S', b'o'],
                Err(ready_error(
                    "property at offset 0: name length 200 overflows the 2 bytes left".to_owned(),
                )),
            ),
            (
                "property value length overflow",
                cat(&[&[11], b"Socket-Type", &[0, 0, 1, 0], b"DEALER"]),
                Err(ready_error(
                    "property Socket-Type at offset 0: value length 256 overflows the 6 bytes left"
                        .to_owned(),
                )),
            ),
            (
                "value length field cut short",
                cat(&[&[11], b"Socket-Type", &[0, 0]]),
                Err(ready_error(
                    "property Socket-Type at offset 0: value length field needs 4 bytes, 2 left".to_owned(),
                )),
            ),
            (
                "zero-length name",
                vec![0, 0, 0, 0, 0],
                Err(ready_error("property at offset 0 has a zero-length name".to_owned())),
            ),
            (
                "duplicate socket type",
                cat(&[&st(b"DEALER"), &st(b"ROUTER")]),
                Err(ready_error("property Socket-Type appears twice".to_owned())),
            ),
            (
                "invalid name characters",
                cat(&[&[2], b"a b", &[0, 0, 0, 0]]),
                Err(ready_error("property at offset 0: invalid name \"a \"".to_owned())),
            ),
        ];
        for (name, data, expected) in cases {
            assert_eq!(parse_ready(&data), expected, "{name}");
        }
    }

    #[test]
    fn frame_encoding_short_long_and_more() {
        let long = vec![7u8; 256];
        let max_short = vec![9u8; 255];
        // (frames, expected (flags, size-field length) per frame)
        let cases: Vec<(Vec<&[u8]>, Vec<FlagsAndSizeLen>)> = vec![
            (vec![b""], vec![(0x00, 1)]),
            (vec![b"one"], vec![(0x00, 1)]),
            (vec![&max_short], vec![(0x00, 1)]),
            (vec![&long], vec![(0x02, 8)]),
            (vec![b"a", b"", &long], vec![(0x01, 1), (0x01, 1), (0x02, 8)]),
            (vec![&long, b"tail"], vec![(0x03, 8), (0x00, 1)]),
        ];
        for (frames, expected) in cases {
            let mut out = Vec::new();
            write_message(&mut out, &frames).expect("writing to a Vec cannot fail");
            let mut at = 0;
            for (frame, (flags, size_len)) in frames.iter().zip(&expected) {
                assert_eq!(out[at], *flags, "flags of a {}-byte frame", frame.len());
                let size = if *size_len == 1 {
                    u64::from(out[at + 1])
                } else {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&out[at + 1..at + 9]);
                    u64::from_be_bytes(b)
                };
                assert_eq!(size, frame.len() as u64);
                at += 1 + size_len;
                assert_eq!(&out[at..at + frame.len()], *frame);
                at += frame.len();
            }
            assert_eq!(at, out.len(), "nothing after the last frame");
            // And the reader gives the same frames back.
            let mut pongs = 0;
            let got = read_message(&mut Counted::new(Duplex::new(out)), &mut pongs, &mut None)
                .expect("a well-formed message");
            assert_eq!(got, frames.iter().map(|f| f.to_vec()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn outgoing_limits() {
        assert_eq!(check_outgoing(&[]), Err(ZmtpError::EmptyMessage));
        let many = vec![&b""[..]; MAX_FRAMES + 1];
        assert_eq!(check_outgoing(&many), Err(ZmtpError::TooManyFrames { max: MAX_FRAMES }));
        assert_eq!(check_outgoing(&vec![&b"x"[..]; MAX_FRAMES]), Ok(()));
    }

    /// The peer's half of a handshake: its greeting and READY.
    fn peer_hello(socket_type: &[u8], identity: Option<&[u8]>) -> Vec<u8> {
        let mut data = property("Socket-Type", socket_type);
        if let Some(id) = identity {
            data.extend_from_slice(&property("Identity", id));
        }
        cat(&[&greeting(), &command_frame(b"READY", &data)])
    }

    #[test]
    fn handshake_as_listener_and_dialer() {
        let mut s = Duplex::new(peer_hello(b"DEALER", Some(b"decode-3")));
        let peer = handshake(&mut s, SocketType::Router, None, Role::Listener).expect("handshake");
        assert_eq!(
            peer,
            Peer { socket_type: SocketType::Dealer, identity: b"decode-3".to_vec(), version: (3, 1) }
        );
        assert_eq!(s.output, cat(&[&greeting(), &ready_frame(SocketType::Router, None)]));

        let mut s = Duplex::new(peer_hello(b"ROUTER", Some(b"")));
        let peer = handshake(&mut s, SocketType::Dealer, Some(b"me"), Role::Dialer).expect("handshake");
        assert_eq!(peer.socket_type, SocketType::Router);
        assert_eq!(peer.identity, b"");
        assert_eq!(s.output, cat(&[&greeting(), &ready_frame(SocketType::Dealer, Some(b"me"))]));

        // A ZMTP 3.0 peer with libzmq's padding, as libzmq's ROUTER sends it (empty Identity).
        let mut input = greeting_with(3, 0, b"NULL", true);
        input.extend_from_slice(&peer_hello(b"ROUTER", Some(b""))[GREETING_LEN..]);
        let peer =
            handshake(&mut Duplex::new(input), SocketType::Dealer, None, Role::Dialer).expect("3.0 peer");
        assert_eq!(peer, Peer { socket_type: SocketType::Router, identity: Vec::new(), version: (3, 0) });
    }

    /// Malformed peer input, each with the exact error it must give.
    #[test]
    fn malformed_handshakes_table() {
        let g = greeting();
        let ready = |data: &[u8]| command_frame(b"READY", data);
        let cases: Vec<Case<ZmtpError>> = vec![
            (
                "bad signature",
                cat(&[b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", &[0; 40]]),
                ZmtpError::BadSignature { first: b'G', tenth: b'P' },
            ),
            (
                "version 2",
                cat(&[&greeting_with(2, 0, b"NULL", false), &ready(&property("Socket-Type", b"DEALER"))]),
                ZmtpError::UnsupportedVersion { major: 2 },
            ),
            (
                "mechanism PLAIN",
                greeting_with(3, 1, b"PLAIN", false),
                ZmtpError::UnsupportedMechanism { mechanism: "PLAIN".to_owned() },
            ),
            (
                "socket type PUB",
                peer_hello(b"PUB", None),
                ZmtpError::IncompatibleSocketType { ours: SocketType::Router, peer: "PUB".to_owned() },
            ),
            (
                "socket type REQ (valid for libzmq, not for pdkv)",
                peer_hello(b"REQ", None),
                ZmtpError::IncompatibleSocketType { ours: SocketType::Router, peer: "REQ".to_owned() },
            ),
            (
                "truncated greeting",
                g[..40].to_vec(),
                ZmtpError::Truncated { what: "greeting", expected: 64, got: 40 },
            ),
            (
                "command name length overflow",
                cat(&[&g, &[FLAG_COMMAND, 3, 9, b'R', b'E']]),
                ZmtpError::MalformedCommand {
                    command: "unnamed".to_owned(),
                    detail: "command name length 9 overflows the 2 bytes left in the command body".to_owned(),
                },
            ),
            (
                "metadata property length overflow",
                cat(&[&g, &ready(&cat(&[&[11], b"Socket-Type", &[0x7F, 0xFF, 0xFF, 0xFF], b"DEALER"]))]),
                ready_error(
                    "property Socket-Type at offset 0: value length 2147483647 overflows the 6 bytes left"
                        .to_owned(),
                ),
            ),
            ("missing socket type", cat(&[&g, &ready(&[])]), ZmtpError::MissingSocketType),
            (
                "identity starting with a zero byte",
                peer_hello(b"DEALER", Some(b"\0abc")),
                ready_error(
                    "Identity \"\\x00abc\" starts with a zero byte, which ZMTP reserves for generated identities"
                        .to_owned(),
                ),
            ),
            (
                "message before READY",
                cat(&[&g, &message_frame(false, b"hello")]),
                ZmtpError::ProtocolViolation {
                    detail: "a message frame arrived before the peer's READY command".to_owned(),
                },
            ),
            (
                "peer ERROR instead of READY",
                cat(&[&g, &error_frame("go away")]),
                ZmtpError::PeerError { reason: "go away".to_owned() },
            ),
            (
                "oversized READY",
                cat(&[&g, &[FLAG_COMMAND | FLAG_LONG], &(1u64 << 40).to_be_bytes()]),
                ZmtpError::FrameTooLarge { what: "command", size: 1 << 40, max: MAX_COMMAND_BYTES },
            ),
            (
                "EOF after the greeting",
                g.to_vec(),
                ZmtpError::Closed { during: "frame header" },
            ),
        ];
        for (name, input, expected) in cases {
            let mut s = Duplex::new(input);
            let got = handshake(&mut s, SocketType::Router, None, Role::Listener);
            assert_eq!(got, Err(expected.clone()), "{name}");
            // A peer that got as far as a READY is told why before the close.
            if matches!(expected, ZmtpError::IncompatibleSocketType { .. } | ZmtpError::MissingSocketType) {
                assert_eq!(s.output, cat(&[&g, &error_frame(&expected.to_string())]), "{name}");
            }
        }
    }

    /// Malformed traffic after the handshake, each with its exact error.
    #[test]
    fn malformed_traffic_table() {
        let too_many: Vec<u8> = (0..=MAX_FRAMES).flat_map(|_| message_frame(true, b"x")).collect();
        let cases: Vec<Case<ZmtpError>> = vec![
            (
                "LONG frame over the limit",
                cat(&[&[FLAG_LONG], &(MAX_FRAME_BYTES + 1).to_be_bytes()]),
                ZmtpError::FrameTooLarge {
                    what: "message frame",
                    size: MAX_FRAME_BYTES + 1,
                    max: MAX_FRAME_BYTES,
                },
            ),
            (
                "size with the top bit set",
                cat(&[&[FLAG_LONG], &u64::MAX.to_be_bytes()]),
                ZmtpError::FrameTooLarge { what: "message frame", size: u64::MAX, max: MAX_FRAME_BYTES },
            ),
            (
                "EOF mid-frame",
                cat(&[&[0x00, 10], b"abc"]),
                ZmtpError::Truncated { what: "frame body", expected: 10, got: 3 },
            ),
            (
                "EOF mid-header",
                cat(&[&[FLAG_LONG], &[0, 0, 0]]),
                ZmtpError::Truncated { what: "frame header", expected: 9, got: 4 },
            ),
            (
                "EOF between frames of one message",
                message_frame(true, b"first"),
                ZmtpError::Truncated { what: "frame header", expected: 1, got: 0 },
            ),
            ("clean EOF", Vec::new(), ZmtpError::Closed { during: "frame header" }),
            ("too many frames", too_many, ZmtpError::TooManyFrames { max: MAX_FRAMES }),
            (
                "reserved flag bits",
                vec![0x08, 0],
                ZmtpError::ProtocolViolation {
                    detail: "frame flags 0x08 set reserved bits 7-3, which must be zero".to_owned(),
                },
            ),
            (
                "command with MORE",
                vec![FLAG_COMMAND | FLAG_MORE, 0],
                ZmtpError::ProtocolViolation {
                    detail: "frame flags 0x05 mark a command with MORE, which commands never carry"
                        .to_owned(),
                },
            ),
            (
                "PING without its TTL",
                command_frame(b"PING", &[1]),
                ZmtpError::MalformedCommand {
                    command: "PING".to_owned(),
                    detail: "1 bytes of data, shorter than the 2-byte TTL".to_owned(),
                },
            ),
            (
                "empty command",
                vec![FLAG_COMMAND, 0],
                ZmtpError::MalformedCommand {
                    command: "unnamed".to_owned(),
                    detail: "empty command body, without even a name length".to_owned(),
                },
            ),
            (
                "second READY",
                command_frame(b"READY", &property("Socket-Type", b"DEALER")),
                ZmtpError::ProtocolViolation {
                    detail: "a second READY command arrived after the handshake".to_owned(),
                },
            ),
            (
                "ERROR with an overflowing reason",
                command_frame(b"ERROR", &[50, b'x']),
                ZmtpError::MalformedCommand {
                    command: "ERROR".to_owned(),
                    detail: "reason length 50 overflows the 1 bytes left".to_owned(),
                },
            ),
        ];
        for (name, input, expected) in cases {
            let mut pongs = 0;
            let got = read_message(&mut Counted::new(Duplex::new(input)), &mut pongs, &mut None);
            assert_eq!(got, Err(expected), "{name}");
        }
    }

    #[test]
    fn message_over_the_total_limit() {
        // Two frames of 40 MiB: each within the frame limit, together over the message limit.
        // Only the headers are needed: the limit is checked before the second body is read.
        let big = 40u64 << 20;
        let mut input = cat(&[&[FLAG_LONG | FLAG_MORE], &big.to_be_bytes()]);
        input.resize(input.len() + (big as usize), 0);
        input.extend_from_slice(&[FLAG_LONG]);
        input.extend_from_slice(&big.to_be_bytes());
        let got = read_message(&mut Counted::new(Duplex::new(input)), &mut 0, &mut None);
        assert_eq!(got, Err(ZmtpError::MessageTooLarge { size: 2 * big, max: MAX_MESSAGE_BYTES }));
    }

    #[test]
    fn ping_is_answered_and_other_commands_skipped() {
        let context = b"0123456789abcdefXYZ"; // 19 bytes: the PONG echoes only 16
        let input = cat(&[
            &command_frame(b"PING", &cat(&[&[0, 30], b"ctx"])),
            &message_frame(true, b"head"),
            // A PING between the frames of one message: tolerated.
            &command_frame(b"PING", &cat(&[&[0, 0], context])),
            &command_frame(b"PONG", b""),
            &command_frame(b"SUBSCRIBE", b"topic"),
            &message_frame(false, b"tail"),
        ]);
        let mut s = Counted::new(Duplex::new(input));
        let mut pongs = 0;
        let got = read_message(&mut s, &mut pongs, &mut None).expect("message");
        assert_eq!(got, vec![b"head".to_vec(), b"tail".to_vec()]);
        assert_eq!(pongs, 2);
        assert_eq!(
            s.inner.output,
            cat(&[&command_frame(b"PONG", b"ctx"), &command_frame(b"PONG", &context[..16])])
        );
    }

    #[test]
    fn connect_rejects_invalid_identities() {
        let addr: SocketAddr = ([127, 0, 0, 1], 9).into();
        let long = vec![b'a'; 256];
        for (id, detail) in [
            (&long[..], "longer than 255 bytes"),
            (&b"\0x"[..], "starts with a zero byte, which ZMTP reserves for generated identities"),
        ] {
            let got = Connection::connect(addr, SocketType::Dealer, Some(id), Duration::from_secs(1));
            assert_eq!(got.err(), Some(ZmtpError::InvalidIdentity { detail }));
        }
    }

    fn loopback() -> SocketAddr {
        ([127, 0, 0, 1], 0).into()
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn round_trip_over_loopback() {
        let mut listener = RouterListener::bind(loopback()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = thread::spawn(move || -> Result<Vec<(Vec<u8>, Message)>, ZmtpError> {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut conn = listener.accept()?;
                conn.set_read_timeout(Some(T))?;
                assert_eq!(conn.peer_type(), SocketType::Dealer);
                assert_eq!(conn.peer_version(), (3, 1));
                let request = conn.recv()?;
                let mut reply: Vec<&[u8]> = vec![b"re"];
                reply.extend(request.iter().map(Vec::as_slice));
                conn.send(&reply)?;
                seen.push((conn.peer_identity().to_vec(), request));
            }
            Ok(seen)
        });
        let long = vec![0xA5u8; 70_000];
        let request: Vec<&[u8]> = vec![b"get_meta_msg", b"", &long];
        for identity in [Some(&b"decode-0"[..]), None] {
            let mut conn = Connection::connect(addr, SocketType::Dealer, identity, T).expect("connect");
            conn.set_read_timeout(Some(T)).expect("timeout");
            assert_eq!(conn.peer_type(), SocketType::Router);
            conn.send(&request).expect("send");
            let reply = conn.recv().expect("recv");
            assert_eq!(reply.len(), 4);
            assert_eq!(reply[0], b"re");
            assert_eq!(reply[1..], request.iter().map(|f| f.to_vec()).collect::<Vec<_>>()[..]);
        }
        let seen = server.join().expect("server thread").expect("server side");
        assert_eq!(seen[0].0, b"decode-0");
        // No identity announced: the listener made one up the way libzmq does.
        assert_eq!(seen[1].0, vec![0, 0, 0, 0, 1]);
        assert_eq!(seen[1].1.len(), 3);
    }

    #[test]
    fn timeouts_before_a_message_are_recoverable() {
        let mut listener = RouterListener::bind(loopback()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let client = thread::spawn(move || -> Result<(), ZmtpError> {
            let mut conn = Connection::connect(addr, SocketType::Dealer, Some(b"d"), T)?;
            // Wait until the server has timed out once, then send.
            let _ = go_rx.recv_timeout(T);
            conn.send(&[b"late"])
        });
        let mut conn = listener.accept().expect("accept");
        conn.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
        assert_eq!(conn.recv(), Err(ZmtpError::Timeout { op: Op::Read, what: "frame header" }));
        go_tx.send(()).expect("client waiting");
        conn.set_read_timeout(Some(T)).expect("timeout");
        assert_eq!(conn.recv(), Ok(vec![b"late".to_vec()]));
        client.join().expect("client thread").expect("client side");
    }

    #[test]
    fn silent_peer_times_out_the_handshake() {
        let listener = TcpListener::bind(loopback()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        // Accept and say nothing; keep the socket open until the dialer gave up.
        let holder = thread::spawn(move || listener.accept().map(|(s, _)| s));
        let started = Instant::now();
        let got = Connection::connect(addr, SocketType::Dealer, None, Duration::from_millis(200));
        assert_eq!(got.err(), Some(ZmtpError::Timeout { op: Op::Read, what: "greeting" }));
        assert!(started.elapsed() < Duration::from_secs(3));
        drop(holder.join());
    }

    #[test]
    fn incompatible_dialer_is_refused_with_error_command() {
        let mut listener = RouterListener::bind(loopback()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = thread::spawn(move || listener.accept().map(|c| c.peer_identity().to_vec()));
        // A raw peer announcing PUB: refused, and told why with an ERROR command.
        let mut raw = TcpStream::connect(addr).expect("connect");
        raw.set_read_timeout(Some(T)).expect("timeout");
        raw.write_all(&peer_hello(b"PUB", None)).expect("write");
        let mut reply = Vec::new();
        let _ = raw.read_to_end(&mut reply);
        let expected = ZmtpError::IncompatibleSocketType { ours: SocketType::Router, peer: "PUB".to_owned() };
        assert_eq!(reply, cat(&[&greeting(), &error_frame(&expected.to_string())]));
        assert_eq!(server.join().expect("server thread"), Err(expected));
    }

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
