//! The TCP data plane: a producer rank's [`TcpReadServer`] serves reads of its registered
//! [`Regions`], and a decode rank's [`TcpTransport`] implements [`Transport`] against it. This is
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
//! | 1 | [`MAGIC`] (`0xA1`: the protocol's tag and version 1) |
//! | 4 | range count `n`, at most [`MAX_RANGES`] |
//! | 16 × n | per range: remote address (u64), length (u64) |
//!
//! The lengths must add up to at most [`MAX_TOTAL_BYTES`]. Each range must lie inside one live
//! region of the server's registry.
//!
//! Response: a status byte. [`STATUS_OK`] is followed by exactly the requested bytes, range after
//! range. Any other status is an error code ([`STATUS_UNREGISTERED`], [`STATUS_REVOKED`],
//! [`STATUS_OUT_OF_RANGE`], [`STATUS_MALFORMED`], [`STATUS_LIMIT_EXCEEDED`], [`STATUS_INTERNAL`])
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

use std::collections::BTreeMap;
use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::memory::{MemoryError, Regions};
use crate::transport::{Endpoint, RemoteCode, Transport, TransportError};

/// First byte of every request: the protocol's tag and version.
pub const MAGIC: u8 = 0xA1;
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

/// A producer rank's data-plane server: serves reads of a shared registry on its own threads
/// (one accepting, one per connection) until [`TcpReadServer::shutdown`] or drop.
#[derive(Debug)]
pub struct TcpReadServer {
    accept: AcceptThread,
}

impl TcpReadServer {
    /// Listens on `addr` (port 0 picks a free port) and starts serving `regions`.
    pub fn bind(addr: SocketAddr, regions: Arc<RwLock<Regions>>) -> Result<TcpReadServer, ServerError> {
        let listener = TcpListener::bind(addr).map_err(|e| ServerError::bind(addr, &e))?;
        let accept =
            AcceptThread::spawn(addr, listener, regions, "pdkv-data", MAX_CONNECTIONS, serve_connection)?;
        Ok(TcpReadServer { accept })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.accept.addr
    }

    /// Stops accepting, closes every connection and joins every thread the server started.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.accept.stop_and_join().map_err(|()| ServerError::Panicked)
    }
}

impl Drop for TcpReadServer {
    fn drop(&mut self) {
        let _ = self.accept.stop_and_join();
    }
}

impl ServerError {
    /// The error for binding `addr`.
    pub(crate) fn bind(addr: SocketAddr, e: &io::Error) -> ServerError {
        ServerError::Bind { addr, kind: e.kind(), detail: e.to_string() }
    }
}

/// A data-plane server's accept thread ([`accept_loop`]) and how to stop it: the TCP and RDMA
/// servers differ only in what a connection does.
#[derive(Debug)]
pub(crate) struct AcceptThread {
    /// The address the listener is bound to.
    pub(crate) addr: SocketAddr,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl AcceptThread {
    /// Starts accepting on `listener` in a thread named `name-PORT`, serving each connection
    /// with `serve` on a thread of its own.
    pub(crate) fn spawn<S: Send + Sync + 'static>(
        asked: SocketAddr,
        listener: TcpListener,
        shared: Arc<S>,
        name: &'static str,
        max_connections: usize,
        serve: fn(&TcpStream, &S),
    ) -> Result<AcceptThread, ServerError> {
        let addr = listener.local_addr().map_err(|e| ServerError::bind(asked, &e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let conn_name = format!("{name}-conn");
        let handle = thread::Builder::new()
            .name(format!("{name}-{}", addr.port()))
            .spawn(move || accept_loop(listener, shared, flag, &conn_name, max_connections, serve))
            .map_err(|e| ServerError::Spawn { detail: e.to_string() })?;
        Ok(AcceptThread { addr, stop, handle: Some(handle) })
    }

    /// Stops accepting, closes every connection and joins every thread; `Err` if a thread
    /// panicked. Idempotent.
    pub(crate) fn stop_and_join(&mut self) -> Result<(), ()> {
        let Some(handle) = self.handle.take() else { return Ok(()) };
        self.stop.store(true, Ordering::SeqCst);
        // The accept thread is blocked in accept(); a connection of our own wakes it to see the
        // flag. An unspecified bind address is reached through loopback.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(5));
        handle.join().map_err(|_| ())
    }
}

/// Accepts connections until `stop` is set, serving each on its own thread named `name-ID` with
/// `serve`, at most `max_connections` at once (more are closed on accept); on stop, closes the
/// open connections under their threads' feet and joins them. Shared by the TCP and RDMA data
/// planes, whose servers differ only in what a connection does.
fn accept_loop<S: Send + Sync + 'static>(
    listener: TcpListener,
    shared: Arc<S>,
    stop: Arc<AtomicBool>,
    name: &str,
    max_connections: usize,
    serve: fn(&TcpStream, &S),
) {
    // Clones of the open connections, so shutdown can close them under their threads' feet.
    let open: Arc<Mutex<BTreeMap<u64, TcpStream>>> = Arc::default();
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    for incoming in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match incoming {
            Ok(s) => s,
            Err(_) => {
                // Out of descriptors or a connection reset before accept: neither is the
                // server's end, so back off briefly and keep serving.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        threads.retain(|t| !t.is_finished());
        let mut table = open.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= max_connections {
            continue;
        }
        let Ok(clone) = stream.try_clone() else { continue };
        let id = next_id;
        next_id += 1;
        table.insert(id, clone);
        drop(table);
        let (shared, open2) = (Arc::clone(&shared), Arc::clone(&open));
        let spawned = thread::Builder::new().name(format!("{name}-{id}")).spawn(move || {
            serve(&stream, &shared);
            open2.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
        });
        match spawned {
            Ok(t) => threads.push(t),
            Err(_) => {
                open.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
            }
        }
    }
    for stream in open.lock().unwrap_or_else(PoisonError::into_inner).values() {
        let _ = stream.shutdown(Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
}

/// A request the server refuses without reading further: status and message.
struct Refusal(u8, String);

/// What reading a request gave.
enum Incoming {
    /// The client closed, or the connection failed: nothing to answer.
    Gone,
    /// A request to refuse, then close.
    Refuse(Refusal),
    /// A well-formed request; its ranges are in the caller's buffer.
    Ranges,
}

fn serve_connection(stream: &TcpStream, regions: &RwLock<Regions>) {
    // Requests are small and latency-bound; responses are large writes anyway.
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(SERVER_IO_TIMEOUT));
    let mut out = BufWriter::with_capacity(64 * 1024, stream);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    loop {
        match read_request(stream, &mut ranges) {
            Incoming::Gone => return,
            Incoming::Refuse(Refusal(status, message)) => {
                if send_error(&mut out, status, &message).is_ok() {
                    drain_and_close(stream);
                }
                return;
            }
            Incoming::Ranges => {}
        }
        let guard = regions.read().unwrap_or_else(PoisonError::into_inner);
        let slices: Result<Vec<&[u8]>, MemoryError> =
            ranges.iter().map(|&(addr, len)| guard.read(addr, len)).collect();
        let sent = match slices {
            Ok(slices) => send_ok(&mut out, &slices),
            Err(e) => send_error(&mut out, memory_status(&e), &e.to_string()),
        };
        drop(guard);
        if sent.is_err() {
            return;
        }
    }
}

/// The status byte that reports an access error (shared with the RDMA data plane's control
/// protocol, which refuses with the same codes).
pub(crate) fn memory_status(e: &MemoryError) -> u8 {
    match e {
        MemoryError::Unregistered { .. } => STATUS_UNREGISTERED,
        MemoryError::Revoked { .. } => STATUS_REVOKED,
        MemoryError::OutOfRange { .. } => STATUS_OUT_OF_RANGE,
        _ => STATUS_INTERNAL,
    }
}

/// Reads one request into `ranges`, checking magic and limits as the bytes arrive.
fn read_request(stream: &TcpStream, ranges: &mut Vec<(u64, u64)>) -> Incoming {
    ranges.clear();
    // Between requests the connection may idle for as long as the client keeps it; once a
    // request has started, the rest must come promptly.
    if stream.set_read_timeout(None).is_err() {
        return Incoming::Gone;
    }
    let mut first = [0u8; 1];
    if read_full(stream, &mut first).is_err() {
        return Incoming::Gone;
    }
    if first[0] != MAGIC {
        let msg = format!("bad magic byte {:#04x}, expected {MAGIC:#04x}", first[0]);
        return Incoming::Refuse(Refusal(STATUS_MALFORMED, msg));
    }
    if stream.set_read_timeout(Some(SERVER_IO_TIMEOUT)).is_err() {
        return Incoming::Gone;
    }
    let mut count = [0u8; 4];
    if read_full(stream, &mut count).is_err() {
        return Incoming::Gone;
    }
    let count = u32::from_be_bytes(count);
    if count > MAX_RANGES {
        let msg = format!("{count} ranges in one request; the limit is {MAX_RANGES}");
        return Incoming::Refuse(Refusal(STATUS_LIMIT_EXCEEDED, msg));
    }
    // Bounded by MAX_RANGES, so at most 1 MiB.
    let mut body = vec![0u8; count as usize * RANGE_BYTES];
    if read_full(stream, &mut body).is_err() {
        return Incoming::Gone;
    }
    let mut total = 0u64;
    for chunk in body.chunks_exact(RANGE_BYTES) {
        let (a, l) = chunk.split_at(8);
        let addr = u64::from_be_bytes(a.try_into().unwrap_or([0; 8]));
        let len = u64::from_be_bytes(l.try_into().unwrap_or([0; 8]));
        total = total.saturating_add(len);
        ranges.push((addr, len));
    }
    if total > MAX_TOTAL_BYTES {
        let msg = format!("{total} bytes in one request; the limit is {MAX_TOTAL_BYTES}");
        return Incoming::Refuse(Refusal(STATUS_LIMIT_EXCEEDED, msg));
    }
    Incoming::Ranges
}

fn read_full(mut stream: &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    stream.read_exact(buf)
}

fn send_ok(out: &mut BufWriter<&TcpStream>, slices: &[&[u8]]) -> io::Result<()> {
    out.write_all(&[STATUS_OK])?;
    for s in slices {
        // BufWriter passes a slice larger than its spare room straight to the socket.
        out.write_all(s)?;
    }
    out.flush()
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

fn send_error(out: &mut BufWriter<&TcpStream>, status: u8, message: &str) -> io::Result<()> {
    let mut answer = vec![status];
    push_message(&mut answer, message);
    out.write_all(&answer)?;
    out.flush()
}

/// Closes a refused connection without losing the answer: closing a socket with unread input
/// makes the kernel send a reset, which can destroy the answer before the client reads it.
fn drain_and_close(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(DRAIN_TIME));
    let mut sink = [0u8; 8192];
    let mut drained = 0;
    let mut s = stream;
    while drained < DRAIN_BYTES {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

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

fn encode_request(ranges: &[(u64, u64)], into_len: usize, buf: &mut Vec<u8>) -> Result<(), TransportError> {
    let invalid = |detail| Err(TransportError::InvalidRequest { detail });
    let count = match u32::try_from(ranges.len()) {
        Ok(c) if c <= MAX_RANGES => c,
        _ => return invalid(format!("{} ranges; the limit is {MAX_RANGES}", ranges.len())),
    };
    check_total(ranges, into_len)?;
    buf.clear();
    buf.push(MAGIC);
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
        let mut request = std::mem::take(&mut self.request);
        let result = encode_request(ranges, into.len(), &mut request).and_then(|()| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionId;
    use std::net::Ipv4Addr;

    const A_BASE: u64 = 0x1_0000;
    const A_LEN: u64 = 64 * 1024;
    const B_BASE: u64 = 0x100_0000;
    const B_LEN: u64 = 1 << 20;

    /// The byte a test region holds at `addr` (251 is prime, so runs do not line up with 256).
    fn pattern(addr: u64) -> u8 {
        (addr % 251) as u8
    }

    fn loopback() -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
    }

    fn endpoint(addr: SocketAddr) -> Endpoint {
        Endpoint { host: addr.ip().to_string(), port: addr.port() }
    }

    /// A server over two patterned regions: A (id 0) and B (id 1).
    fn start() -> (TcpReadServer, Arc<RwLock<Regions>>, Endpoint) {
        let mut regions = Regions::new();
        for (base, len) in [(A_BASE, A_LEN), (B_BASE, B_LEN)] {
            regions.register(base, len).expect("no overlap");
            let bytes = regions.slice_mut(base, len).expect("registered");
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = pattern(base + i as u64);
            }
        }
        let regions = Arc::new(RwLock::new(regions));
        let server = TcpReadServer::bind(loopback(), Arc::clone(&regions)).expect("bind");
        let peer = endpoint(server.local_addr());
        (server, regions, peer)
    }

    fn read_ok(t: &mut TcpTransport, peer: &Endpoint, ranges: &[(u64, u64)]) {
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let mut into = vec![0xEE; total as usize];
        t.read(peer, ranges, &mut into).unwrap_or_else(|e| panic!("read {ranges:x?}: {e}"));
        let want: Vec<u8> = ranges.iter().flat_map(|&(a, l)| (a..a + l).map(pattern)).collect();
        assert!(into == want, "bytes of {ranges:x?} differ");
    }

    fn remote_code_of(r: Result<(), TransportError>) -> Option<RemoteCode> {
        match r {
            Err(TransportError::Remote { code, .. }) => Some(code),
            _ => None,
        }
    }

    #[test]
    fn round_trip_of_ranges_from_two_regions() {
        let (server, _regions, peer) = start();
        let mut t = TcpTransport::new();
        let cases: &[&[(u64, u64)]] = &[
            &[(A_BASE, 1)],
            &[(A_BASE, A_LEN)],
            &[(A_BASE + 7, 100), (B_BASE + 3, 5000), (A_BASE + A_LEN - 9, 9)],
            &[(B_BASE, B_LEN), (A_BASE, A_LEN)],
            &[(B_BASE + 10, 0), (B_BASE + 10, 1)],
            &[(A_BASE + 300, 20), (A_BASE + 300, 20), (A_BASE + 310, 20)],
        ];
        for ranges in cases {
            read_ok(&mut t, &peer, ranges);
        }
        // Many small ranges merge in the server's buffer and still arrive in order.
        let many: Vec<(u64, u64)> = (0..2000).map(|i| (B_BASE + i * 512 + (i % 7), 3 + i % 11)).collect();
        read_ok(&mut t, &peer, &many);
        assert_eq!(t.connections(), 1, "one persistent connection");
        let mut empty = [0u8; 0];
        assert_eq!(t.read(&peer, &[], &mut empty), Ok(()));
        server.shutdown().expect("clean shutdown");
    }

    #[test]
    fn access_errors_are_typed_and_keep_the_connection() {
        let (server, regions, peer) = start();
        let mut t = TcpTransport::new();
        let mut other = TcpTransport::new();
        read_ok(&mut t, &peer, &[(B_BASE, 16)]);
        read_ok(&mut other, &peer, &[(B_BASE, 16)]);
        regions.write().expect("lock").deregister(RegionId(1)).expect("live");
        let cases: &[(&[(u64, u64)], RemoteCode)] = &[
            (&[(B_BASE, 16)], RemoteCode::Revoked),
            (&[(A_BASE, 4), (B_BASE + 100, 1)], RemoteCode::Revoked),
            (&[(0x10, 4)], RemoteCode::Unregistered),
            (&[(A_BASE + A_LEN, 1)], RemoteCode::Unregistered),
            (&[(A_BASE + A_LEN - 1, 2)], RemoteCode::OutOfRange),
            (&[(A_BASE, 1), (A_BASE + 1, MAX_TOTAL_BYTES - 1)], RemoteCode::OutOfRange),
        ];
        for (ranges, want) in cases {
            let total: u64 = ranges.iter().map(|r| r.1).sum();
            let mut into = vec![0; total as usize];
            let got = t.read(&peer, ranges, &mut into);
            assert!(matches!(&got, Err(TransportError::Remote { message, .. }) if !message.is_empty()));
            assert_eq!(remote_code_of(got), Some(*want), "{ranges:x?}");
            assert_eq!(t.connections(), 1, "an access error keeps the connection");
        }
        // Region A still serves, on the same connection and to the other client.
        read_ok(&mut t, &peer, &[(A_BASE, A_LEN)]);
        read_ok(&mut other, &peer, &[(A_BASE + 5, 50)]);
        server.shutdown().expect("clean shutdown");
    }

    /// Sends `request` on a raw socket and returns the status and message of the answer, and
    /// whether the server then closed the connection.
    fn raw_exchange(addr: SocketAddr, request: &[u8]) -> (u8, String, bool) {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(request).expect("send");
        let mut head = [0u8; 5];
        s.read_exact(&mut head).expect("answer");
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
        let mut msg = vec![0; len as usize];
        s.read_exact(&mut msg).expect("message");
        let closed = matches!(s.read(&mut [0u8; 1]), Ok(0));
        (head[0], String::from_utf8(msg).expect("UTF-8"), closed)
    }

    fn request(ranges: &[(u64, u64)]) -> Vec<u8> {
        let mut r = vec![MAGIC];
        r.extend_from_slice(&(ranges.len() as u32).to_be_bytes());
        for (a, l) in ranges {
            r.extend_from_slice(&a.to_be_bytes());
            r.extend_from_slice(&l.to_be_bytes());
        }
        r
    }

    #[test]
    fn bad_requests_are_refused_and_the_server_survives() {
        let (server, _regions, peer) = start();
        let addr = server.local_addr();
        let mut over_count = vec![MAGIC];
        over_count.extend_from_slice(&(MAX_RANGES + 1).to_be_bytes());
        let half = MAX_TOTAL_BYTES / 2;
        let cases: &[(Vec<u8>, u8, &str)] = &[
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), STATUS_MALFORMED, "bad magic byte 0x47"),
            (vec![0; 100_000], STATUS_MALFORMED, "bad magic byte 0x00"),
            (over_count, STATUS_LIMIT_EXCEEDED, "65537 ranges"),
            (request(&[(A_BASE, half), (A_BASE, half + 1)]), STATUS_LIMIT_EXCEEDED, "1073741825 bytes"),
            (request(&[(A_BASE, u64::MAX), (A_BASE, 2)]), STATUS_LIMIT_EXCEEDED, "the limit is"),
        ];
        for (bytes, status, text) in cases {
            let (got, message, closed) = raw_exchange(addr, bytes);
            assert_eq!(got, *status, "{message}");
            assert!(message.contains(text), "{message:?} lacks {text:?}");
            assert!(closed, "a refused connection is closed");
        }
        // Truncated requests: the client goes away mid-request.
        for cut in [1, 3, 5, 20] {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&request(&[(A_BASE, 1), (A_BASE, 2)])[..cut]).expect("send");
        }
        let mut t = TcpTransport::new();
        read_ok(&mut t, &peer, &[(A_BASE, 10), (B_BASE, 10)]);
        server.shutdown().expect("clean shutdown");
    }

    #[test]
    fn client_refuses_invalid_requests_locally() {
        let mut t = TcpTransport::new();
        // No server is needed: nothing is sent.
        let peer = Endpoint { host: "127.0.0.1".into(), port: 1 };
        let many = vec![(0, 0); MAX_RANGES as usize + 1];
        let cases: &[(&[(u64, u64)], usize)] = &[
            (&[(0, 4)], 3),
            (&[(0, 4), (8, 4)], 9),
            (&[(0, u64::MAX), (0, 1)], 0),
            (&[(0, MAX_TOTAL_BYTES + 1)], 0),
            (&many, 0),
        ];
        for (ranges, len) in cases {
            let mut into = vec![0; *len];
            let got = t.read(&peer, ranges, &mut into);
            assert!(matches!(got, Err(TransportError::InvalidRequest { .. })), "{got:?}");
        }
        assert_eq!(t.connections(), 0);
    }

    #[test]
    fn bad_responses_are_typed() {
        let peer_for = |listener: &TcpListener| endpoint(listener.local_addr().expect("addr"));
        type Check = fn(&TransportError) -> bool;
        let cases: &[(&[u8], Check)] = &[
            (
                &[1, 0, 0, 0, 3, b'a', b'b', b'c'],
                |e| matches!(e, TransportError::Remote { code: RemoteCode::Unregistered, message, .. } if message == "abc"),
            ),
            (&[9, 0, 0, 0, 0], |e| matches!(e, TransportError::Remote { code: RemoteCode::Other(9), .. })),
            (&[1, 0xff, 0xff, 0xff, 0xff], |e| matches!(e, TransportError::Protocol { .. })),
            (&[1, 0, 0, 0, 2, 0xff, 0xfe], |e| matches!(e, TransportError::Protocol { .. })),
            (&[0, 1, 2], |e| {
                matches!(e, TransportError::Io { op: "read data", kind: io::ErrorKind::UnexpectedEof, .. })
            }),
            (&[], |e| matches!(e, TransportError::Io { op: "read status", .. })),
        ];
        for (response, check) in cases {
            let listener = TcpListener::bind(loopback()).expect("bind");
            let peer = peer_for(&listener);
            let sent = response.to_vec();
            let fake = thread::spawn(move || {
                let (mut s, _) = listener.accept().expect("accept");
                let mut req = [0u8; 5 + RANGE_BYTES];
                s.read_exact(&mut req).expect("request");
                s.write_all(&sent).expect("answer");
            });
            let mut t = TcpTransport::new();
            let got = t.read(&peer, &[(0, 8)], &mut [0; 8]);
            fake.join().expect("fake server");
            let e = got.expect_err("a bad response is an error");
            assert!(check(&e), "{response:?} gave {e:?}");
        }
    }

    #[test]
    fn timeouts_and_connect_failures_are_typed() {
        // A listener that accepts but never answers.
        let silent = TcpListener::bind(loopback()).expect("bind");
        let mut t = TcpTransport::with_timeouts(Duration::from_secs(1), Some(Duration::from_millis(100)));
        let got = t.read(&endpoint(silent.local_addr().expect("addr")), &[(0, 1)], &mut [0]);
        assert!(matches!(got, Err(TransportError::Timeout { op: "read status", .. })), "{got:?}");
        assert_eq!(t.connections(), 0, "a timed-out connection is dropped");
        // A port nobody listens on any more.
        let gone = endpoint(TcpListener::bind(loopback()).and_then(|l| l.local_addr()).expect("addr"));
        let got = t.read(&gone, &[(0, 1)], &mut [0]);
        assert!(matches!(got, Err(TransportError::Connect { .. })), "{got:?}");
    }

    #[test]
    fn shutdown_joins_and_closes_connections() {
        let (server, _regions, peer) = start();
        let addr = server.local_addr();
        let mut t = TcpTransport::new();
        read_ok(&mut t, &peer, &[(A_BASE, 8)]);
        // An idle raw connection too, which the server must close rather than wait for.
        let mut idle = TcpStream::connect(addr).expect("connect");
        idle.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        // Returns only once the accept thread and every connection thread have been joined.
        server.shutdown().expect("clean shutdown");
        assert!(matches!(idle.read(&mut [0u8; 1]), Ok(0) | Err(_)));
        // The kept connection is dead and the retry cannot connect.
        let got = t.read(&peer, &[(A_BASE, 8)], &mut [0; 8]);
        assert!(matches!(got, Err(TransportError::Connect { .. })), "{got:?}");
        // Dropping a server shuts it down as well.
        let (dropped, _regions, peer) = start();
        drop(dropped);
        let got = TcpTransport::new().read(&peer, &[(A_BASE, 8)], &mut [0; 8]);
        assert!(matches!(got, Err(TransportError::Connect { .. })), "{got:?}");
    }

    #[test]
    fn reconnects_after_the_server_restarts() {
        let (server, regions, peer) = start();
        let mut t = TcpTransport::new();
        read_ok(&mut t, &peer, &[(A_BASE, 8)]);
        let addr = server.local_addr();
        server.shutdown().expect("clean shutdown");
        // Same port, new server: the kept connection fails once and is transparently replaced.
        let again = TcpReadServer::bind(addr, regions).expect("rebind");
        read_ok(&mut t, &peer, &[(A_BASE, 8)]);
        assert_eq!(t.connections(), 1);
        again.shutdown().expect("clean shutdown");
    }
}
