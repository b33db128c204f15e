//! ZMTP on TCP: a [`Connection`] dials or accepts and runs the handshake within one deadline,
//! then sends and receives whole messages under the socket's timeouts; a [`RouterListener`]
//! accepts DEALER peers and names those that announce no identity.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::codec::{check_identity, check_outgoing};
use super::error::{io_error, Op, ZmtpError};
use super::socket_type::SocketType;
use super::stream::{handshake, read_message, write_message, Counted, Role};

/// Handshake timeout of a [`RouterListener`] until [`RouterListener::set_handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

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

    /// This end's address.
    pub fn local_addr(&self) -> Result<SocketAddr, ZmtpError> {
        self.stream.local_addr().map_err(|e| io_error(Op::Configure, "local address", &e))
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
    use crate::zmtp::codec::{error_frame, greeting};
    use crate::zmtp::test_bytes::{cat, peer_hello};
    use std::thread;

    /// The frames of one received message.
    type Message = Vec<Vec<u8>>;

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
}
