//! Byte builders shared by the zmtp unit tests: table rows, frames and a peer's handshake.

use super::codec::{command_frame, greeting, push_property};

/// A table row: its name, the input bytes, what they must give.
pub(super) type Case<T> = (&'static str, Vec<u8>, T);

pub(super) fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

pub(super) fn property(name: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    push_property(&mut out, name, value);
    out
}

/// The peer's half of a handshake: its greeting and READY.
pub(super) fn peer_hello(socket_type: &[u8], identity: Option<&[u8]>) -> Vec<u8> {
    let mut data = property("Socket-Type", socket_type);
    if let Some(id) = identity {
        data.extend_from_slice(&property("Identity", id));
    }
    cat(&[&greeting(), &command_frame(b"READY", &data)])
}
