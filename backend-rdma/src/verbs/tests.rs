//! The verbs data plane end to end: a [`VerbsServer`] and [`VerbsTransport`]s on one RDMA device
//! (Soft-RoCE in the `cargo xtask rdma-vm` guest), skipped with a reason where there is none.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::control::{encode_table, TableEntry, QP_INFO_BYTES};
use super::device::{Cq, Device, Qp};
use super::*;
use crate::memory::Regions;
use crate::tcp::STATUS_OK;
use crate::transport::{Endpoint, RemoteCode, Transport, TransportError};

/// Whether the device-backed tests can run here. Without a device they are skipped with a
/// reason on stderr (written past the test harness's capture), unless `PDKV_RDMA_REQUIRED=1`
/// (the rdma-vm guest), where a missing device fails the test.
fn device_present(test: &str) -> bool {
    match Device::open(None) {
        Ok(_) => true,
        Err(e) => {
            let required = std::env::var("PDKV_RDMA_REQUIRED").is_ok_and(|v| v == "1");
            assert!(!required, "{test}: PDKV_RDMA_REQUIRED=1 but {e}");
            let _ = writeln!(io::stderr(), "skipping {test}: {e}");
            false
        }
    }
}

/// The byte a test region holds at `addr` (251 is prime, so runs do not line up with 256).
fn pattern(addr: u64) -> u8 {
    (addr % 251) as u8 ^ (addr >> 16) as u8
}

fn fill(regions: &mut Regions, base: u64, len: u64) {
    let data: Vec<u8> = (base..base + len).map(pattern).collect();
    regions.write(base, &data).expect("fill");
}

const A: (u64, u64) = (0x1_0000, 64 * 1024);
const B: (u64, u64) = (0x100_0000, 3 << 20);
const C: (u64, u64) = (0x2000_0000, 4096);

fn setup() -> (VerbsServer, Arc<RwLock<Regions>>, Endpoint) {
    let mut regions = Regions::new();
    for (base, len) in [A, B, C] {
        regions.register(base, len).expect("register");
        fill(&mut regions, base, len);
    }
    let regions = Arc::new(RwLock::new(regions));
    let server = VerbsServer::bind((Ipv4Addr::LOCALHOST, 0).into(), Arc::clone(&regions)).expect("bind");
    let peer = Endpoint { host: "127.0.0.1".into(), port: server.local_addr().port() };
    (server, regions, peer)
}

fn read(t: &mut VerbsTransport, peer: &Endpoint, ranges: &[(u64, u64)]) -> Result<Vec<u8>, TransportError> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let mut buf = vec![0u8; total as usize];
    t.read(peer, ranges, &mut buf).map(|()| buf)
}

fn expect(ranges: &[(u64, u64)]) -> Vec<u8> {
    ranges.iter().flat_map(|&(a, l)| (a..a + l).map(pattern)).collect()
}

fn read_ok(t: &mut VerbsTransport, peer: &Endpoint, ranges: &[(u64, u64)]) {
    let got = read(t, peer, ranges).expect("read");
    assert!(got == expect(ranges), "bytes differ for {ranges:x?}");
}

/// The drain rule's abort: a cancelled read is refused before it starts, and one cancelled
/// in flight moves the QP to the error state, drains its flushed completions and fails
/// `Aborted`; the next read gets a fresh queue pair and the right bytes.
#[test]
fn verbs_cancelled_read_stops_in_flight_and_the_next_read_reconnects() {
    if !device_present("verbs_cancelled_read_stops_in_flight_and_the_next_read_reconnects") {
        return;
    }
    let (server, _regions, peer) = setup();
    let mut t = VerbsTransport::new();
    let mut buf = vec![0u8; 16];
    let before = t.read_cancellable(&peer, &[(A.0, 16)], &mut buf, &|| true);
    assert_eq!(before, Err(TransportError::Aborted { peer: peer.to_string() }));
    // Many small ranges (one work request each, more than the send queue holds), cancelled
    // at the first check inside the poll loop (after 64 turns of it).
    let many: Vec<(u64, u64)> = (0..4000u64).map(|i| (B.0 + (i * 1499) % (B.1 - 64), 64)).collect();
    let mut aborted = 0;
    for _ in 0..5 {
        let calls = std::cell::Cell::new(0u32);
        let cancelled = || {
            calls.set(calls.get() + 1);
            calls.get() > 1
        };
        let mut buf = vec![0u8; many.len() * 64];
        match t.read_cancellable(&peer, &many, &mut buf, &cancelled) {
            Err(TransportError::Aborted { .. }) => aborted += 1,
            Ok(()) => {}
            Err(other) => panic!("a cancelled read failed otherwise: {other}"),
        }
        read_ok(&mut t, &peer, &[(A.0, 4096), (C.0, 64)]);
    }
    assert!(aborted > 0, "no read was still in flight at its first poll check in 5 tries");
    server.shutdown().expect("clean shutdown");
}

#[test]
fn verbs_reads_patterned_bytes_across_regions_and_ranges() {
    if !device_present("verbs_reads_patterned_bytes_across_regions_and_ranges") {
        return;
    }
    let (server, regions, peer) = setup();
    assert_eq!(server.registered(), 3);
    let mut t = VerbsTransport::new();
    // Ranges across all three regions, in one read, through the bounce buffer.
    read_ok(&mut t, &peer, &[(A.0 + 5, 100), (B.0 + 1000, 30_000), (C.0, C.1), (A.0 + 60_000, 5536)]);
    // A direct read (past the threshold) of a whole region and a piece of another.
    read_ok(&mut t, &peer, &[(B.0, B.1), (A.0, 10)]);
    // More ranges than the send queue holds at once.
    let many: Vec<(u64, u64)> = (0..300).map(|i| (B.0 + i * 4099, 17 + i % 5)).collect();
    read_ok(&mut t, &peer, &many);
    // Zero-length ranges inside a region are fine, even in a read of no bytes; at a
    // region's end they are not (as in the registry).
    read_ok(&mut t, &peer, &[(A.0 + 7, 0), (C.0 + 1, 3)]);
    read_ok(&mut t, &peer, &[(A.0 + 7, 0), (C.0, 0)]);
    let refused = read(&mut t, &peer, &[(C.0 + C.1, 0)]);
    assert!(
        matches!(refused, Err(TransportError::Remote { code: RemoteCode::Unregistered, .. })),
        "{refused:?}"
    );
    assert_eq!(t.connections(), 1);
    // A region registered after the connection was made is found through a refresh.
    let d = (0x3000_0000, 8192);
    {
        let mut r = regions.write().expect("lock");
        r.register(d.0, d.1).expect("register");
        fill(&mut r, d.0, d.1);
    }
    read_ok(&mut t, &peer, &[(d.0 + 100, 5000), (A.0, 4)]);
    assert_eq!(t.connections(), 1);
    assert_eq!(server.registered(), 4);
    // Bytes written after registration are what a reader sees (no stale pinned page).
    regions.write().expect("lock").write(A.0, &[9, 8, 7]).expect("write");
    assert_eq!(read(&mut t, &peer, &[(A.0, 3)]).expect("read"), vec![9, 8, 7]);
    // A second transport gets its own queue pair.
    let mut t2 = VerbsTransport::new();
    read_ok(&mut t2, &peer, &[(C.0 + 4000, 96)]);
    server.shutdown().expect("clean shutdown");
    // With the server gone the kept connection is noticed as closed and the reconnect
    // fails cleanly.
    let err = read(&mut t, &peer, &[(A.0, 4)]).expect_err("server is gone");
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
    assert_eq!(t.connections(), 0);
}

#[test]
fn verbs_rekey_revokes_reads_until_reconnect() {
    if !device_present("verbs_rekey_revokes_reads_until_reconnect") {
        return;
    }
    let (server, _regions, peer) = setup();
    let mut t = VerbsTransport::new();
    read_ok(&mut t, &peer, &[(A.0, 128), (B.0, 64)]);
    let old: Vec<u32> =
        t.conns.get(&peer).map(|c| c.table.iter().map(|e| e.rkey).collect()).unwrap_or_default();
    let new_key = server.rekey(A.0).expect("rekey");
    assert!(!old.contains(&new_key), "rekey gave an old key {new_key:#x} ({old:x?})");
    // The connection still holds A's old rkey: the device refuses the read.
    match read(&mut t, &peer, &[(B.0, 8), (A.0 + 64, 64)]) {
        Err(TransportError::Remote { code: RemoteCode::Revoked, message, .. }) => {
            assert!(message.contains("remote access error"), "{message}");
        }
        other => panic!("expected a remote access error, got {other:?}"),
    }
    assert_eq!(t.connections(), 0, "the failed connection is dropped");
    // The next read reconnects and gets the new key.
    read_ok(&mut t, &peer, &[(A.0 + 64, 64), (B.0, 8)]);
    assert_eq!(t.connections(), 1);
    assert_eq!(server.rekey(0x1234), Err(VerbsError::UnknownRegion { base_addr: 0x1234 }));
    drop(server);
}

#[test]
fn verbs_refusals_before_posting() {
    if !device_present("verbs_refusals_before_posting") {
        return;
    }
    let (server, regions, peer) = setup();
    let mut t = VerbsTransport::new();
    let code = |r: Result<Vec<u8>, TransportError>| match r {
        Err(TransportError::Remote { code, .. }) => code,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(code(read(&mut t, &peer, &[(0xdead_0000, 8)])), RemoteCode::Unregistered);
    assert_eq!(code(read(&mut t, &peer, &[(A.0, 8), (0xdead_0000, 8)])), RemoteCode::Unregistered);
    assert_eq!(code(read(&mut t, &peer, &[(A.0 + A.1 - 4, 8)])), RemoteCode::OutOfRange);
    // Refusals decided before posting keep the connection.
    assert_eq!(t.connections(), 1);
    read_ok(&mut t, &peer, &[(A.0, 16)]);
    // A region deregistered through the server: its MR goes first, then reads of its range
    // are refused as revoked (the kept connection's stale key fails on the device; a
    // fresh connection is refused by the server).
    let c_id = regions.read().expect("lock").live_regions().find(|r| r.base_addr == C.0).map(|r| r.id);
    let region = server.deregister(c_id.expect("C is live")).expect("deregister");
    assert_eq!(region.bytes.len() as u64, C.1);
    assert_eq!(server.registered(), 2);
    assert_eq!(code(read(&mut t, &peer, &[(C.0, 8)])), RemoteCode::Revoked);
    assert_eq!(code(read(&mut t, &peer, &[(C.0, 8)])), RemoteCode::Revoked);
    read_ok(&mut t, &peer, &[(B.0 + 3, 5)]);
    // Local refusals.
    let mut small = [0u8; 4];
    let err = t.read(&peer, &[(A.0, 8)], &mut small);
    assert!(matches!(err, Err(TransportError::InvalidRequest { .. })), "{err:?}");
}

/// Checks both buffer modes on a large read (48 ranges, 3 MiB) and on small ones (one 4 KiB
/// range), and prints the time per read of each: the numbers behind
/// [`DEFAULT_DIRECT_THRESHOLD`].
#[test]
fn verbs_reads_in_both_buffer_modes() {
    if !device_present("verbs_reads_in_both_buffer_modes") {
        return;
    }
    let (server, _regions, peer) = setup();
    let large: Vec<(u64, u64)> = (0..48).map(|i| (B.0 + i * 65_536, 65_536)).collect();
    let small = vec![(B.0 + 12_345, 4096)];
    for (ranges, rounds) in [(&large, 5u32), (&small, 200)] {
        let want = expect(ranges);
        let mut buf = vec![0u8; want.len()];
        for (name, threshold) in [("bounce", usize::MAX), ("direct", 0)] {
            let mut t = VerbsTransport::new();
            t.set_direct_threshold(threshold);
            t.read(&peer, ranges, &mut buf).expect("warm-up read");
            buf.fill(0);
            let started = Instant::now();
            for _ in 0..rounds {
                t.read(&peer, ranges, &mut buf).expect("read");
            }
            let per = started.elapsed() / rounds;
            assert!(buf == want, "{name}: bytes differ");
            let mbps = want.len() as f64 / per.as_secs_f64() / 1e6;
            let _ = writeln!(
                io::stderr(),
                "verbs {name}: {} bytes in {} ranges: {per:?} per read, {mbps:.0} MB/s",
                want.len(),
                ranges.len()
            );
        }
    }
    drop(server);
}

/// A fake server whose QP stays in INIT, so the device drops every request to it: a read
/// times out (the CQ wait), or, with a longer wait, the transport's retries run out.
#[test]
fn verbs_unanswered_reads_time_out() {
    if !device_present("verbs_unanswered_reads_time_out") {
        return;
    }
    let dev = Device::open(None).expect("device");
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let peer = Endpoint { host: "127.0.0.1".into(), port: listener.local_addr().expect("addr").port() };
    let fake = thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = listener.accept().expect("accept");
            let mut hello = [0u8; 6 + QP_INFO_BYTES];
            s.read_exact(&mut hello).expect("hello");
            let cq = Cq::create(&dev, 4).expect("cq");
            let qp = Qp::create(&cq, 1, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0).expect("qp");
            let mut out = vec![STATUS_OK];
            qp.info().encode(&mut out);
            encode_table(&[TableEntry { base: 0x1000, len: 4096, va: 0x1000, rkey: 0x1234 }], &mut out);
            s.write_all(&out).expect("answer");
            // Hold the QP (never connected) until the client closes.
            let _ = s.read(&mut [0u8; 1]);
            drop(qp);
        }
    });
    let mut t = VerbsTransport::with_timeouts(Duration::from_secs(5), Duration::from_millis(500));
    let err = read(&mut t, &peer, &[(0x1000, 64)]);
    let want = TransportError::Timeout { peer: peer.to_string(), op: "rdma read completion" };
    assert_eq!(err, Err(want));
    assert_eq!(t.connections(), 0);
    let mut t = VerbsTransport::with_timeouts(Duration::from_secs(5), Duration::from_secs(60));
    let started = Instant::now();
    let err = read(&mut t, &peer, &[(0x1000, 64)]);
    let want =
        TransportError::Timeout { peer: peer.to_string(), op: "rdma read (transport retries exceeded)" };
    assert_eq!(err, Err(want));
    assert!(started.elapsed() < Duration::from_secs(30), "retries took {:?}", started.elapsed());
    drop(t);
    fake.join().expect("fake server");
}

#[test]
fn verbs_without_device_gives_typed_errors() {
    let Err(e) = Device::open(None) else {
        let _ =
            writeln!(io::stderr(), "skipping verbs_without_device_gives_typed_errors: a device is present");
        return;
    };
    let VerbsError::NoDevice { detail } = &e else { panic!("expected NoDevice, got {e:?}") };
    assert!(detail.starts_with("ibv_get_device_list returned 0 devices"), "{detail}");
    let text = e.to_string();
    assert!(text.starts_with("no RDMA device: ibv_get_device_list returned 0 devices"), "{text}");
    assert!(text.contains("load rdma_rxe and run `rdma link add"), "{text}");
    let bind = VerbsServer::bind((Ipv4Addr::LOCALHOST, 0).into(), Arc::default());
    assert_eq!(bind.map(|_| ()), Err(e.clone()));
    let mut t = VerbsTransport::new();
    let peer = Endpoint { host: "127.0.0.1".into(), port: 9 };
    let mut buf = [0u8; 4];
    let want = TransportError::Connect {
        peer: "127.0.0.1:9".into(),
        kind: io::ErrorKind::Unsupported,
        detail: text,
    };
    assert_eq!(t.read(&peer, &[(0x1000, 4)], &mut buf), Err(want));
    assert_eq!(t.connections(), 0);
    // An empty read needs no device.
    assert_eq!(t.read(&peer, &[], &mut []), Ok(()));
}

#[test]
fn verbs_transport_and_server_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<VerbsTransport>();
    assert_send::<VerbsServer>();
}
