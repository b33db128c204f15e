//! The TCP data plane's server side: the accept thread shared with the RDMA data plane, and
//! serving one connection's requests from the registry under its read lock.

use std::collections::BTreeMap;
use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::memory::{MemoryError, Regions};

use pdkv_core::ids::Incarnation;

use crate::transport::ReadTag;

use super::{
    memory_status, push_message, ServerError, DRAIN_BYTES, DRAIN_TIME, FLAG_INCARNATION, FLAG_TRANSFER,
    MAGIC, MAGIC_TAGGED, MAX_CONNECTIONS, MAX_RANGES, MAX_TOTAL_BYTES, RANGE_BYTES, SERVER_IO_TIMEOUT,
    STATUS_LIMIT_EXCEEDED, STATUS_MALFORMED, STATUS_OK, STATUS_OTHER_INCARNATION,
};

/// A producer rank's data-plane server: serves reads of a shared registry on its own threads
/// (one accepting, one per connection) until [`TcpReadServer::shutdown`] or drop.
#[derive(Debug)]
pub struct TcpReadServer {
    accept: AcceptThread,
}

impl TcpReadServer {
    /// Listens on `addr` (port 0 picks a free port) and starts serving `regions`.
    pub fn bind(addr: SocketAddr, regions: Arc<RwLock<Regions>>) -> Result<TcpReadServer, ServerError> {
        TcpReadServer::bind_as(addr, regions, None)
    }

    /// [`TcpReadServer::bind`] for a rank in `incarnation`: a tagged read naming another one is
    /// refused ([`super::STATUS_OTHER_INCARNATION`]).
    pub fn bind_as(
        addr: SocketAddr,
        regions: Arc<RwLock<Regions>>,
        incarnation: Option<Incarnation>,
    ) -> Result<TcpReadServer, ServerError> {
        let listener = TcpListener::bind(addr).map_err(|e| ServerError::bind(addr, &e))?;
        let served = Arc::new(Served { regions, incarnation });
        let accept =
            AcceptThread::spawn(addr, listener, served, "pdkv-data", MAX_CONNECTIONS, serve_connection)?;
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

/// What a server serves: the rank's regions, and its incarnation.
struct Served {
    regions: Arc<RwLock<Regions>>,
    incarnation: Option<Incarnation>,
}

/// A request the server refuses without reading further: status and message.
struct Refusal(u8, String);

/// What reading a request gave.
enum Incoming {
    /// The client closed, or the connection failed: nothing to answer.
    Gone,
    /// A request to refuse, then close.
    Refuse(Refusal),
    /// A well-formed request; its ranges are in the caller's buffer, and what it names here
    /// (nothing for the untagged form).
    Ranges(ReadTag),
}

fn serve_connection(stream: &TcpStream, served: &Served) {
    // Requests are small and latency-bound; responses are large writes anyway.
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(SERVER_IO_TIMEOUT));
    let mut out = BufWriter::with_capacity(64 * 1024, stream);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    loop {
        let tag = match read_request(stream, &mut ranges) {
            Incoming::Gone => return,
            Incoming::Refuse(Refusal(status, message)) => {
                if send_error(&mut out, status, &message).is_ok() {
                    drain_and_close(stream);
                }
                return;
            }
            Incoming::Ranges(tag) => tag,
        };
        if let (Some(named), Some(own)) = (tag.incarnation, served.incarnation) {
            if named != own {
                // The request was read in full, so the connection stays in step.
                let message = format!("the read is meant for {named}; this rank is {own} (it restarted)");
                if send_error(&mut out, STATUS_OTHER_INCARNATION, &message).is_err() {
                    return;
                }
                continue;
            }
        }
        let guard = served.regions.read().unwrap_or_else(PoisonError::into_inner);
        let slices: Result<Vec<&[u8]>, MemoryError> = ranges
            .iter()
            .map(|&(addr, len)| match tag.transfer {
                Some(key) => guard.read_granted(addr, len, key),
                None => guard.read(addr, len),
            })
            .collect();
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
    if first[0] != MAGIC && first[0] != MAGIC_TAGGED {
        let msg = format!("bad magic byte {:#04x}, expected {MAGIC:#04x} or {MAGIC_TAGGED:#04x}", first[0]);
        return Incoming::Refuse(Refusal(STATUS_MALFORMED, msg));
    }
    if stream.set_read_timeout(Some(SERVER_IO_TIMEOUT)).is_err() {
        return Incoming::Gone;
    }
    let mut tag = ReadTag::default();
    if first[0] == MAGIC_TAGGED {
        let mut head = [0u8; 17];
        if read_full(stream, &mut head).is_err() {
            return Incoming::Gone;
        }
        let flags = head[0];
        if flags & !(FLAG_INCARNATION | FLAG_TRANSFER) != 0 {
            let msg = format!("unknown flags {flags:#04x} in a tagged read");
            return Incoming::Refuse(Refusal(STATUS_MALFORMED, msg));
        }
        let word = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]));
        if flags & FLAG_INCARNATION != 0 {
            let value = word(1);
            match Incarnation::new(value) {
                Some(incarnation) => tag.incarnation = Some(incarnation),
                None => {
                    let msg = format!("incarnation {value} is outside 1..={}", Incarnation::MAX);
                    return Incoming::Refuse(Refusal(STATUS_MALFORMED, msg));
                }
            }
        }
        if flags & FLAG_TRANSFER != 0 {
            tag.transfer = Some(word(9));
        }
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
    Incoming::Ranges(tag)
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
