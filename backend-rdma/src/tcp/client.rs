//! The TCP data plane's client side: a decode rank's [`TcpTransport`], one persistent
//! connection per peer.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::transport::{Endpoint, ReadTag, RemoteCode, Transport, TransportError};

use super::{
    check_total, remote_code, FLAG_INCARNATION, FLAG_TRANSFER, MAGIC, MAGIC_TAGGED, MAX_MESSAGE_BYTES,
    MAX_RANGES, STATUS_OK,
};

/// A decode rank's TCP data plane: one persistent connection per peer, reopened after an error.
#[derive(Debug)]
pub struct TcpTransport {
    conns: BTreeMap<Endpoint, TcpStream>,
    connect_timeout: Duration,
    io_timeout: Option<Duration>,
    request: Vec<u8>,
}

impl Default for TcpTransport {
    fn default() -> Self {
        TcpTransport::new()
    }
}

impl TcpTransport {
    /// A transport with a 5 s connect timeout and a 30 s send/receive timeout.
    pub fn new() -> TcpTransport {
        TcpTransport::with_timeouts(Duration::from_secs(5), Some(Duration::from_secs(30)))
    }

    /// A transport with the given timeouts (`None`: a send or receive may block forever).
    pub fn with_timeouts(connect_timeout: Duration, io_timeout: Option<Duration>) -> TcpTransport {
        TcpTransport { conns: BTreeMap::new(), connect_timeout, io_timeout, request: Vec::new() }
    }

    /// Number of open connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Closes the connection to `peer`, if open.
    pub fn disconnect(&mut self, peer: &Endpoint) {
        self.conns.remove(peer);
    }

    fn connect(&self, peer: &Endpoint) -> Result<TcpStream, TransportError> {
        let fail = |kind, detail| TransportError::Connect { peer: peer.to_string(), kind, detail };
        let addrs = (peer.host.as_str(), peer.port)
            .to_socket_addrs()
            .map_err(|e| fail(e.kind(), format!("cannot resolve: {e}")))?;
        let mut last = fail(io::ErrorKind::NotFound, "no address".to_string());
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.connect_timeout) {
                Ok(s) => {
                    let set = s
                        .set_nodelay(true)
                        .and_then(|()| s.set_read_timeout(self.io_timeout))
                        .and_then(|()| s.set_write_timeout(self.io_timeout));
                    return match set {
                        Ok(()) => Ok(s),
                        Err(e) => Err(fail(e.kind(), e.to_string())),
                    };
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    last = TransportError::Timeout { peer: peer.to_string(), op: "connect" };
                }
                Err(e) => last = fail(e.kind(), e.to_string()),
            }
        }
        Err(last)
    }
}

/// Encodes a request: the version 1 form for a read without a tag, the tagged form otherwise.
fn encode_request(
    tag: ReadTag,
    ranges: &[(u64, u64)],
    into_len: usize,
    buf: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let invalid = |detail| Err(TransportError::InvalidRequest { detail });
    let count = match u32::try_from(ranges.len()) {
        Ok(c) if c <= MAX_RANGES => c,
        _ => return invalid(format!("{} ranges; the limit is {MAX_RANGES}", ranges.len())),
    };
    check_total(ranges, into_len)?;
    buf.clear();
    if tag == ReadTag::default() {
        buf.push(MAGIC);
    } else {
        buf.push(MAGIC_TAGGED);
        let flags = if tag.incarnation.is_some() { FLAG_INCARNATION } else { 0 }
            | if tag.transfer.is_some() { FLAG_TRANSFER } else { 0 };
        buf.push(flags);
        buf.extend_from_slice(&tag.incarnation.map_or(0, |i| i.value()).to_be_bytes());
        buf.extend_from_slice(&tag.transfer.unwrap_or(0).to_be_bytes());
    }
    buf.extend_from_slice(&count.to_be_bytes());
    for &(addr, len) in ranges {
        buf.extend_from_slice(&addr.to_be_bytes());
        buf.extend_from_slice(&len.to_be_bytes());
    }
    Ok(())
}

/// Sends one request and reads its response into `into`.
fn exchange(
    mut stream: &TcpStream,
    peer: &Endpoint,
    request: &[u8],
    into: &mut [u8],
) -> Result<(), TransportError> {
    let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
    stream.write_all(request).map_err(io("send request"))?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(io("read status"))?;
    if status[0] == STATUS_OK {
        return stream.read_exact(into).map_err(io("read data"));
    }
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(io("read error message"))?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE_BYTES {
        let detail = format!("error message of {len} bytes; the limit is {MAX_MESSAGE_BYTES}");
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    let mut message = vec![0u8; len as usize];
    stream.read_exact(&mut message).map_err(io("read error message"))?;
    let message = String::from_utf8(message).map_err(|e| TransportError::Protocol {
        peer: peer.to_string(),
        detail: format!("error message is not UTF-8: {e}"),
    })?;
    Err(TransportError::Remote { peer: peer.to_string(), code: remote_code(status[0]), message })
}

impl Transport for TcpTransport {
    fn read(
        &mut self,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
        into: &mut [u8],
    ) -> Result<(), TransportError> {
        self.read_with(peer, ReadTag::default(), ranges, into)
    }

    fn read_tagged(
        &mut self,
        peer: &Endpoint,
        tag: ReadTag,
        ranges: &[(u64, u64)],
        into: &mut [u8],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        if cancelled() {
            return Err(TransportError::Aborted { peer: peer.to_string() });
        }
        self.read_with(peer, tag, ranges, into)
    }
}

impl TcpTransport {
    /// One read, tagged or not, on the peer's kept connection.
    fn read_with(
        &mut self,
        peer: &Endpoint,
        tag: ReadTag,
        ranges: &[(u64, u64)],
        into: &mut [u8],
    ) -> Result<(), TransportError> {
        let mut request = std::mem::take(&mut self.request);
        let result = encode_request(tag, ranges, into.len(), &mut request).and_then(|()| {
            if ranges.is_empty() {
                return Ok(());
            }
            let reused = self.conns.contains_key(peer);
            if !reused {
                let s = self.connect(peer)?;
                self.conns.insert(peer.clone(), s);
            }
            let mut result = match self.conns.get(peer) {
                Some(s) => exchange(s, peer, &request, into),
                None => {
                    Err(TransportError::Protocol { peer: peer.to_string(), detail: "no connection".into() })
                }
            };
            // A kept connection may have been closed by the server (restart, idle cleanup) since
            // its last use; reads are idempotent, so one retry on a fresh connection is safe.
            if reused && matches!(result, Err(TransportError::Io { .. })) {
                self.conns.remove(peer);
                let s = self.connect(peer)?;
                result = exchange(&s, peer, &request, into);
                self.conns.insert(peer.clone(), s);
            }
            // Only an access refusal leaves both sides in step; after anything else the
            // connection's state is unknown, so it is dropped and reopened next time.
            let in_step = match &result {
                Ok(()) => true,
                Err(TransportError::Remote { code, .. }) => {
                    !matches!(code, RemoteCode::Malformed | RemoteCode::LimitExceeded)
                }
                Err(_) => false,
            };
            if !in_step {
                self.conns.remove(peer);
            }
            result
        });
        self.request = request;
        result
    }
}
