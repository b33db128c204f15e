//! The ZMTP protocol over any blocking byte stream (`Read + Write`): reading a greeting, the
//! NULL handshake, reading and writing whole messages, and knowing whether a failure left the
//! stream at a message boundary. Generic, so that unit tests feed bytes without sockets.

use std::io::{self, Read, Write};

use super::codec::{
    check_flags, check_major, check_mechanism, check_signature, error_frame, greeting, handshake_command,
    push_header, ready_frame, traffic_command, validate_peer, Header, Peer, Ready, FLAG_LONG, FLAG_MORE,
    GREETING_LEN, MAX_COMMAND_BYTES, MAX_FRAMES, MAX_FRAME_BYTES, MAX_MESSAGE_BYTES,
};
use super::error::{io_error, Op, ZmtpError};
use super::socket_type::SocketType;

/// Frame bodies up to this size are copied next to their header so that a small message
/// leaves in one write; larger ones are written straight from the caller's slice.
const COALESCE_BYTES: usize = 8 * 1024;

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

// ---------------------------------------------------------------------------------------------
// Handshake.

/// Which side of the NULL handshake this end plays: the dialer speaks first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Dialer,
    Listener,
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

/// Greeting and NULL handshake on any byte stream. On a failed validation the peer is sent an
/// ERROR first (best effort: the connection is being given up anyway).
pub(super) fn handshake<S: Read + Write>(
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
pub(super) struct Counted<S> {
    pub(super) inner: S,
    pub(super) read: u64,
    pub(super) written: u64,
}

impl<S> Counted<S> {
    pub(super) fn new(inner: S) -> Counted<S> {
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
pub(super) fn read_message<S: Read + Write>(
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

/// Writes one message: MORE on every frame but the last. Small frames are gathered with
/// their headers into one buffer so that the message leaves in as few writes as possible.
pub(super) fn write_message<W: Write>(w: &mut W, frames: &[&[u8]]) -> Result<(), ZmtpError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::codec::{command_frame, ready_error, FLAG_COMMAND};
    use crate::zmtp::test_bytes::{cat, peer_hello, property, Case};
    use std::io::Cursor;

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
    /// A frame's expected flags byte and the length of its size field.
    type FlagsAndSizeLen = (u8, usize);

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
}
