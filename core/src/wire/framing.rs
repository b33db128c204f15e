//! How MoRIIO's control messages sit in ZeroMQ messages: which frames each socket sends and
//! accepts, as vLLM's MoRIIO code (the release pdkv is checked against) reads and writes them.
//!
//! A ZeroMQ message is a list of frames. A ROUTER's caller sees the peer's identity as an extra
//! first frame, which never travels: it only picks the connection. What travels, per socket:
//!
//! | socket | sender | message on the wire | MoRIIO's receiver |
//! |---|---|---|---|
//! | handshake | dialer (DEALER) | `[b"get_meta_msg"]` | `identity, msg = recv_multipart()` |
//! | handshake | listener (ROUTER) | `[b"", metadata]`, then a second message `[b"", layer map]` | `recv_multipart()` twice, each exactly `[b"", payload]` |
//! | handshake | dialer | `[b"pop_done_recv"]`, then `[req_id]` | the listener reads the second message and sends nothing |
//! | notify | decode (DEALER) | `[message]`: one frame per release or notification | `identity, msg = recv_multipart()` |
//!
//! MoRIIO's receivers unpack exactly two frames (`identity, msg = ...`) or check for exactly
//! `[b"", payload]`, and raise otherwise; the exception ends the listener thread (a handshake or
//! notify listener then serves nobody again) or fails the dial (`HandshakeError("Unexpected
//! frame!")`). So pdkv sends exactly these shapes and nothing else. pdkv's own receivers check
//! the same shapes with the functions here, but a wrong shape is a typed [`FramingError`] for
//! that one message, never the end of a listener.

use std::fmt;

use super::handshake::{encode_layer_memory_descs, HandshakeMetadata, LayerMemoryDesc};
use super::message::{encode, ControlMessage, HANDSHAKE_REQUEST};
/// MoRIIO's `POP_DONE_RECV`: a dialer's notice that it received a request's KV, followed by a
/// second message holding the request id. Its listener accepts it and answers nothing; no
/// MoRIIO code sends it any more.
pub const POP_DONE_RECV: &[u8] = b"pop_done_recv";
/// The empty delimiter frame in front of each handshake reply part: MoRIIO's listener sends
/// `(identity, b"", payload)` and its dialer insists on `[b"", payload]`.
pub const DELIMITER: &[u8] = b"";

/// Which of the two handshake reply messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReplyPart {
    /// The first: the engine's metadata (`MoRIIOAgentMetadata`).
    Metadata,
    /// The second: the per-layer memory descriptors.
    Layers,
}

impl fmt::Display for ReplyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReplyPart::Metadata => "metadata",
            ReplyPart::Layers => "layer descriptors",
        })
    }
}

/// What a message on a handshake listener asks for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HandshakeRequest {
    /// `get_meta_msg`: answer with the two reply messages.
    Metadata,
    /// `pop_done_recv`: the next message on the connection is a request id; answer nothing.
    DoneRecv,
}

/// Why a ZeroMQ message does not have the frames its socket expects. The message is dropped;
/// the connection and the listener carry on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum FramingError {
    /// Not as many frames as the socket's messages have.
    FrameCount {
        /// What the message was: `handshake request`, `notify message`, or a reply part.
        what: &'static str,
        /// Frames expected.
        expected: usize,
        /// Frames received.
        got: usize,
    },
    /// A handshake reply part whose first frame is not the empty delimiter (an older pdkv sent
    /// its two parts as one message without it).
    NoDelimiter {
        /// Which reply part.
        part: ReplyPart,
        /// Length of the first frame, which should have been empty.
        first_len: usize,
    },
    /// A one-frame message on a handshake listener that is neither `get_meta_msg` nor
    /// `pop_done_recv` (MoRIIO's listener raises "unexpected msg type" and stops serving).
    UnknownRequest {
        /// The frame's length.
        len: usize,
        /// Its first bytes, printable ASCII kept and the rest escaped, for the report.
        start: String,
    },
}

/// How many bytes of an unknown request [`FramingError::UnknownRequest`] shows.
const SHOWN_BYTES: usize = 24;

impl fmt::Display for FramingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FramingError::FrameCount { what, expected, got } => {
                write!(f, "{what}: a message of {got} frame(s), expected {expected}")
            }
            FramingError::NoDelimiter { part, first_len } => write!(
                f,
                "handshake reply ({part}): the first frame should be MoRIIO's empty delimiter but \
                 holds {first_len} bytes (a peer that sends both parts as one message?)"
            ),
            FramingError::UnknownRequest { len, start } => write!(
                f,
                "handshake request of {len} bytes is neither `get_meta_msg` nor `pop_done_recv`: \
                 {start}"
            ),
        }
    }
}

impl std::error::Error for FramingError {}

/// The two messages a handshake listener sends in answer to `get_meta_msg`, in order, each
/// `[b"", payload]` as MoRIIO's listener sends them.
pub fn handshake_reply(metadata: &HandshakeMetadata, layers: &[LayerMemoryDesc]) -> [Vec<Vec<u8>>; 2] {
    [
        vec![DELIMITER.to_vec(), encode(&ControlMessage::HandshakeMetadata(metadata.clone()))],
        vec![DELIMITER.to_vec(), encode_layer_memory_descs(layers)],
    ]
}

/// The payload of one handshake reply message, which must be exactly `[b"", payload]` (what
/// MoRIIO's dialer checks before it decodes anything).
pub fn reply_payload(part: ReplyPart, frames: &[Vec<u8>]) -> Result<&[u8], FramingError> {
    let what = match part {
        ReplyPart::Metadata => "handshake reply (metadata)",
        ReplyPart::Layers => "handshake reply (layer descriptors)",
    };
    match frames {
        [delimiter, payload] if delimiter.is_empty() => Ok(payload),
        [first, _] => Err(FramingError::NoDelimiter { part, first_len: first.len() }),
        _ => Err(FramingError::FrameCount { what, expected: 2, got: frames.len() }),
    }
}

/// What a message received by a handshake listener asks for: exactly one frame, `get_meta_msg`
/// or `pop_done_recv`.
pub fn handshake_request(frames: &[Vec<u8>]) -> Result<HandshakeRequest, FramingError> {
    match frames {
        [frame] if frame == HANDSHAKE_REQUEST => Ok(HandshakeRequest::Metadata),
        [frame] if frame == POP_DONE_RECV => Ok(HandshakeRequest::DoneRecv),
        [frame] => Err(FramingError::UnknownRequest { len: frame.len(), start: shown(frame) }),
        _ => Err(FramingError::FrameCount { what: "handshake request", expected: 1, got: frames.len() }),
    }
}

/// The one frame of a message received by a notify listener.
pub fn notify_frame(frames: &[Vec<u8>]) -> Result<&[u8], FramingError> {
    match frames {
        [frame] => Ok(frame),
        _ => Err(FramingError::FrameCount { what: "notify message", expected: 1, got: frames.len() }),
    }
}

/// The first [`SHOWN_BYTES`] bytes as text a report can carry: printable ASCII as it is,
/// anything else escaped.
fn shown(bytes: &[u8]) -> String {
    let mut text: String =
        bytes.iter().take(SHOWN_BYTES).flat_map(|&b| std::ascii::escape_default(b)).map(char::from).collect();
    if bytes.len() > SHOWN_BYTES {
        text.push_str("...");
    }
    format!("\"{text}\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Extensions;

    /// The frames of one message.
    type Message = Vec<Vec<u8>>;

    fn frames(parts: &[&[u8]]) -> Message {
        parts.iter().map(|p| p.to_vec()).collect()
    }

    #[test]
    fn handshake_requests_are_one_known_frame() {
        let long = [b'x'; 40];
        let cases: Vec<(Message, Result<HandshakeRequest, FramingError>)> = vec![
            (frames(&[b"get_meta_msg"]), Ok(HandshakeRequest::Metadata)),
            (frames(&[b"pop_done_recv"]), Ok(HandshakeRequest::DoneRecv)),
            (
                frames(&[b"get_meta"]),
                Err(FramingError::UnknownRequest { len: 8, start: "\"get_meta\"".into() }),
            ),
            (
                frames(&[b"\x81\xa4type\xa7release"]),
                Err(FramingError::UnknownRequest { len: 14, start: "\"\\x81\\xa4type\\xa7release\"".into() }),
            ),
            (
                frames(&[&long]),
                Err(FramingError::UnknownRequest { len: 40, start: format!("\"{}...\"", "x".repeat(24)) }),
            ),
            // A REQ-style delimiter in front: MoRIIO's `identity, msg = ...` would raise.
            (
                frames(&[b"", b"get_meta_msg"]),
                Err(FramingError::FrameCount { what: "handshake request", expected: 1, got: 2 }),
            ),
            (frames(&[]), Err(FramingError::FrameCount { what: "handshake request", expected: 1, got: 0 })),
        ];
        for (input, expected) in cases {
            assert_eq!(handshake_request(&input), expected, "{input:?}");
        }
    }

    #[test]
    fn reply_parts_are_delimiter_then_payload() {
        type Case<'a> = (ReplyPart, Message, Result<&'a [u8], FramingError>);
        let cases: Vec<Case> = vec![
            (ReplyPart::Metadata, frames(&[b"", b"\x80"]), Ok(b"\x80")),
            (ReplyPart::Layers, frames(&[b"", b""]), Ok(b"")),
            // An older pdkv: both parts in one message, no delimiter.
            (
                ReplyPart::Metadata,
                frames(&[b"\x86meta", b"\x81layers"]),
                Err(FramingError::NoDelimiter { part: ReplyPart::Metadata, first_len: 5 }),
            ),
            (
                ReplyPart::Metadata,
                frames(&[b"\x86meta"]),
                Err(FramingError::FrameCount { what: "handshake reply (metadata)", expected: 2, got: 1 }),
            ),
            (
                ReplyPart::Layers,
                frames(&[b"", b"a", b"b"]),
                Err(FramingError::FrameCount {
                    what: "handshake reply (layer descriptors)",
                    expected: 2,
                    got: 3,
                }),
            ),
        ];
        for (part, input, expected) in cases {
            assert_eq!(reply_payload(part, &input), expected, "{part} {input:?}");
        }
    }

    #[test]
    fn the_reply_is_two_messages_each_behind_a_delimiter() {
        let metadata = HandshakeMetadata {
            engine_id: "p:6301".into(),
            agent_metadata: vec![1],
            kv_caches_base_addr: vec![4096],
            num_blocks: 2,
            block_len: 3,
            attn_backend_name: "FLASHMLA".into(),
            rank: None,
            extensions: Extensions::NONE,
            incarnation: None,
        };
        let layers = vec![LayerMemoryDesc { layer_name: "l0".into(), descs: vec![vec![7]] }];
        let [first, second] = handshake_reply(&metadata, &layers);
        assert_eq!(first, [Vec::new(), encode(&ControlMessage::HandshakeMetadata(metadata))]);
        assert_eq!(second, [Vec::new(), encode_layer_memory_descs(&layers)]);
        assert_eq!(reply_payload(ReplyPart::Metadata, &first), Ok(&first[1][..]));
        assert_eq!(reply_payload(ReplyPart::Layers, &second), Ok(&second[1][..]));
    }

    #[test]
    fn notify_messages_are_one_frame() {
        assert_eq!(notify_frame(&frames(&[b"tx-1"])), Ok(&b"tx-1"[..]));
        for n in [0, 2, 3] {
            let input = vec![b"tx-1".to_vec(); n];
            assert_eq!(
                notify_frame(&input),
                Err(FramingError::FrameCount { what: "notify message", expected: 1, got: n })
            );
        }
    }

    #[test]
    fn errors_say_what_and_how() {
        assert_eq!(
            FramingError::FrameCount { what: "notify message", expected: 1, got: 3 }.to_string(),
            "notify message: a message of 3 frame(s), expected 1"
        );
        assert_eq!(
            FramingError::NoDelimiter { part: ReplyPart::Metadata, first_len: 212 }.to_string(),
            "handshake reply (metadata): the first frame should be MoRIIO's empty delimiter but holds \
             212 bytes (a peer that sends both parts as one message?)"
        );
    }
}
