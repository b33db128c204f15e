//! The two ZeroMQ socket types pdkv speaks and their `Socket-Type` names: a value the codec
//! writes and reads and an error names, so it sits below both.

use std::fmt;

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
    pub(super) fn from_wire(value: &[u8]) -> Option<SocketType> {
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
