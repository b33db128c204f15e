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
//! [`Connection::peer_identity`] says who it is. Which payload frames MoRIIO's messages have
//! (an empty delimiter in front of each handshake reply part, one frame per notification) is
//! the core's `wire` framing, not this module's: here every frame is opaque.
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
//!
//! The code is in three layers, each a module: `codec` holds the protocol as pure functions over
//! bytes (greeting, frame headers, commands, READY metadata, limits), `stream` runs it over any
//! blocking byte stream (reading a greeting, a handshake, a whole message), and `socket` puts that
//! on TCP ([`Connection`], [`RouterListener`]) with deadlines and timeouts; `error` is their
//! common [`ZmtpError`], and `socket_type` the [`SocketType`] all of them name.

mod codec;
mod error;
mod socket;
mod socket_type;
mod stream;
#[cfg(test)]
mod test_bytes;

pub use codec::{
    GREETING_LEN, MAX_COMMAND_BYTES, MAX_FRAMES, MAX_FRAME_BYTES, MAX_IDENTITY_BYTES, MAX_MESSAGE_BYTES,
};
pub use error::{Op, ZmtpError};
pub use socket::{Connection, RouterListener, DEFAULT_HANDSHAKE_TIMEOUT};
pub use socket_type::SocketType;
