//! Tests of the TCP data plane: the wire protocol, limits, hostile clients and shutdown.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::Duration;

use super::*;
use crate::memory::{RegionId, Regions};
use crate::transport::{Endpoint, ReadTag, RemoteCode, Transport, TransportError};

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

/// A tagged read is served only by the incarnation it names and only from bytes granted to the
/// transfer it names; each refusal leaves the connection in step, and a read without a tag sees
/// what is unfenced, as before. A malformed tag is refused and the connection closed.
#[test]
fn tagged_reads_see_only_their_incarnation_and_their_transfer() {
    use pdkv_core::ids::Incarnation;
    let mut regions = Regions::new();
    regions.register(A_BASE, A_LEN).expect("registers");
    regions.write(A_BASE, &[7; 64]).expect("writes");
    regions.grant(A_BASE, 32, 11);
    regions.grant(A_BASE + 32, 32, 12);
    let regions = Arc::new(RwLock::new(regions));
    let own = Incarnation::new(5);
    let server = TcpReadServer::bind_as(loopback(), Arc::clone(&regions), own).expect("bind");
    let peer = endpoint(server.local_addr());
    let mut t = TcpTransport::new();
    let tag = |incarnation: Option<u64>, transfer: Option<u64>| ReadTag {
        incarnation: incarnation.and_then(Incarnation::new),
        transfer,
    };
    let read = |t: &mut TcpTransport, tag: ReadTag, ranges: &[(u64, u64)]| {
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let mut into = vec![0; total as usize];
        t.read_tagged(&peer, tag, ranges, &mut into, &|| false)
    };
    let check = |t: &mut TcpTransport, tag: ReadTag, ranges: &[(u64, u64)], expected: Option<RemoteCode>| {
        let got = read(t, tag, ranges);
        match expected {
            None => assert_eq!(got, Ok(()), "{tag:?} {ranges:x?}"),
            Some(code) => assert_eq!(remote_code_of(got), Some(code), "{tag:?} {ranges:x?}"),
        }
    };
    check(&mut t, tag(Some(5), Some(11)), &[(A_BASE, 32)], None);
    check(&mut t, tag(None, Some(12)), &[(A_BASE + 32, 32)], None);
    check(&mut t, tag(Some(5), None), &[(A_BASE, 64)], None);
    check(&mut t, tag(None, None), &[(A_BASE, 64)], None);
    check(&mut t, tag(Some(6), Some(11)), &[(A_BASE, 32)], Some(RemoteCode::OtherIncarnation));
    check(&mut t, tag(Some(5), Some(12)), &[(A_BASE, 32)], Some(RemoteCode::Revoked));
    check(&mut t, tag(Some(5), Some(11)), &[(A_BASE, 64)], Some(RemoteCode::Revoked));
    // The transfer's block is freed (fenced) and refilled for another transfer: its late read is
    // refused, the new owner's is served.
    {
        let mut guard = regions.write().expect("lock");
        guard.fence(A_BASE, 32).expect("fences");
        guard.unfence(A_BASE, 32);
        guard.grant(A_BASE, 32, 13);
    }
    check(&mut t, tag(Some(5), Some(11)), &[(A_BASE, 32)], Some(RemoteCode::Revoked));
    check(&mut t, tag(Some(5), Some(13)), &[(A_BASE, 32)], None);
    assert_eq!(t.connections(), 1, "every refusal left the connection in step");
    // Unknown flags and an incarnation out of range are malformed.
    for (flags, incarnation) in [(0x04u8, 0u64), (FLAG_INCARNATION, 0), (FLAG_INCARNATION, 1 << 53)] {
        let mut s = TcpStream::connect(server.local_addr()).expect("connects");
        let mut request = vec![MAGIC_TAGGED, flags];
        request.extend_from_slice(&incarnation.to_be_bytes());
        request.extend_from_slice(&0u64.to_be_bytes());
        request.extend_from_slice(&0u32.to_be_bytes());
        s.write_all(&request).expect("sends");
        let mut status = [0u8; 1];
        s.read_exact(&mut status).expect("answers");
        assert_eq!(status[0], STATUS_MALFORMED, "flags {flags:#x}, incarnation {incarnation}");
    }
    drop(server);
}
