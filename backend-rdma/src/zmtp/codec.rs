//! The ZMTP 3.1 codec: greeting, frame headers, commands and READY metadata as pure functions
//! over bytes, with the limits a peer's input is held to. Nothing here reads or writes a stream.

use super::error::ZmtpError;
use super::socket_type::SocketType;

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

pub(super) const FLAG_MORE: u8 = 0x01;
pub(super) const FLAG_LONG: u8 = 0x02;
pub(super) const FLAG_COMMAND: u8 = 0x04;
/// The longest body a short frame carries; longer bodies need LONG.
const SHORT_MAX: usize = 255;
/// The mechanism field of a NULL greeting, exactly as libzmq compares it.
const NULL_MECHANISM: [u8; 20] = *b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
/// The longest PING context the spec allows; a PONG echoes at most this much.
const MAX_PING_CONTEXT: usize = 16;
/// Longest peer-supplied text (socket type, mechanism, error reason) kept in an error.
const SHOWN_BYTES: usize = 64;

/// Peer bytes as text for an error message: printable ASCII kept, the rest escaped, cut short.
fn shown(bytes: &[u8]) -> String {
    let mut out: String =
        bytes.iter().take(SHOWN_BYTES).flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    if bytes.len() > SHOWN_BYTES {
        out.push_str("...");
    }
    out
}

/// A frame's flags byte and body size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) flags: u8,
    pub(super) size: u64,
}

impl Header {
    pub(super) fn is_command(self) -> bool {
        self.flags & FLAG_COMMAND != 0
    }

    pub(super) fn more(self) -> bool {
        self.flags & FLAG_MORE != 0
    }
}

/// Checks a frame's flags byte: no reserved bits, and no MORE on a command.
pub(super) fn check_flags(flags: u8) -> Result<(), ZmtpError> {
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

/// Appends a frame header: short when the body fits in 255 bytes, else LONG.
pub(super) fn push_header(out: &mut Vec<u8>, flags: u8, len: usize) {
    if len <= SHORT_MAX {
        out.push(flags);
        out.push(len as u8);
    } else {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

/// A whole command frame: `name` (1 to 255 letters) then `data`.
pub(super) fn command_frame(name: &[u8], data: &[u8]) -> Vec<u8> {
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
pub(super) fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..32].copy_from_slice(&NULL_MECHANISM);
    g
}

/// Checks a greeting's signature, its bytes 0 and 9 (the padding between means nothing).
pub(super) fn check_signature(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ZmtpError::BadSignature { first: g[0], tenth: g[9] });
    }
    Ok(())
}

/// Checks a greeting's major version (byte 10): ZMTP 3.0 or later.
pub(super) fn check_major(major: u8) -> Result<(), ZmtpError> {
    if major < 3 {
        return Err(ZmtpError::UnsupportedVersion { major });
    }
    Ok(())
}

/// Checks a greeting's mechanism (bytes 12 to 31): exactly NULL.
pub(super) fn check_mechanism(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
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
pub(super) struct Ready {
    pub(super) socket_type: Option<Vec<u8>>,
    pub(super) identity: Option<Vec<u8>>,
}

pub(super) fn ready_error(detail: String) -> ZmtpError {
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
pub(super) fn push_property(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// The READY command frame this end sends.
pub(super) fn ready_frame(kind: SocketType, identity: Option<&[u8]>) -> Vec<u8> {
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
pub(super) fn error_frame(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(SHORT_MAX)];
    let mut data = Vec::with_capacity(1 + reason.len());
    data.push(reason.len() as u8);
    data.extend_from_slice(reason);
    command_frame(b"ERROR", &data)
}

/// Checks an identity's length and first byte (identities starting with zero are reserved).
pub(super) fn check_identity(id: &[u8]) -> Result<(), &'static str> {
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

/// What the handshake learnt about the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Peer {
    pub(super) socket_type: SocketType,
    pub(super) identity: Vec<u8>,
    pub(super) version: (u8, u8),
}

/// The peer's READY metadata from the body of the first command it sends, or the error its
/// ERROR (or any other command) means.
pub(super) fn handshake_command(body: &[u8]) -> Result<Ready, ZmtpError> {
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
pub(super) fn validate_peer(kind: SocketType, ready: Ready, version: (u8, u8)) -> Result<Peer, ZmtpError> {
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

// ---------------------------------------------------------------------------------------------
// Traffic.

/// What a command from the peer after the handshake asks for, given its body: the PONG frame
/// to answer a PING with, nothing for a command to skip, or the error an ERROR or a second
/// READY means.
pub(super) fn traffic_command(body: &[u8]) -> Result<Option<Vec<u8>>, ZmtpError> {
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
pub(super) fn check_outgoing(frames: &[&[u8]]) -> Result<(), ZmtpError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::test_bytes::{cat, property, Case};

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
    fn outgoing_limits() {
        assert_eq!(check_outgoing(&[]), Err(ZmtpError::EmptyMessage));
        let many = vec![&b""[..]; MAX_FRAMES + 1];
        assert_eq!(check_outgoing(&many), Err(ZmtpError::TooManyFrames { max: MAX_FRAMES }));
        assert_eq!(check_outgoing(&vec![&b"x"[..]; MAX_FRAMES]), Ok(()));
    }
}
