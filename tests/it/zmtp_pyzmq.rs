//! Conformance of pdkv's ZMTP (`pdkv_rdma::zmtp`) with a peer nobody here wrote: pyzmq, that is
//! libzmq, driven by tests/fixtures/zmq_peer.py the way MoRIIO drives its control sockets.
//!
//! (a) A pyzmq ROUTER (MoRIIO's notify listener) and a pdkv DEALER: pdkv's MessagePack release
//!     must decode in Python to MoRIIO's dict, and every frame must come back byte for byte.
//! (b) A pdkv ROUTER (a handshake listener) and a pyzmq DEALER with an identity: MoRIIO's
//!     `get_meta_msg` gets pdkv's reply, two messages each framed `[b"", payload]` as MoRIIO's
//!     dialer demands, which Python must decode; the release Python packs must decode in pdkv.
//!
//! (c) The connector's own dial, handshake listener and notify listener against pyzmq peers that
//!     speak as MoRIIO does, including messages that would end MoRIIO's own listener threads
//!     (a wrong frame count, an unknown request or `type`, bytes that are not MessagePack):
//!     each is one report line and the listener serves on.
//!
//! (a) and (b) keep libzmq's heartbeats on, so pdkv must answer PINGs. Python and its packages are
//! required, not optional: the Python is `$PDKV_PYTHON`, which `cargo xtask test` points at
//! target/pyenv (pinned pyzmq and msgpack), else `python3`; a missing package fails the test
//! with its name and says to run `cargo xtask test`. Every wait is bounded; the Python child is
//! killed after [`CHILD_LIMIT`].

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use pdkv_core::ids::TransferId;
use pdkv_core::prefill::WorkerEvent;
use pdkv_core::release::{Release, ReleaseSender};
use pdkv_core::wire::{
    decode, encode, handshake_reply, ControlMessage, Extensions, HandshakeMetadata, LayerMemoryDesc,
    RankInfo, HANDSHAKE_REQUEST,
};
use pdkv_rdma::zmtp::{Connection, RouterListener, SocketType};

/// How long a Python peer may live before it is killed and the test fails.
const CHILD_LIMIT: Duration = Duration::from_secs(20);
/// Connect and handshake timeout of the pdkv end.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Read timeout of the pdkv end: longer than the Python side's own waits.
const READ: Duration = Duration::from_secs(10);
const TRANSFER_ID: &str = "tx-0c5f2a9e-3b7d-4e21-9a64-8f1d2c3b4a5e";
/// zmq_peer.py's exit status when it cannot import a package.
const MISSING_PACKAGE: i32 = 3;
/// What to do when the Python lacks pyzmq or msgpack.
const SETUP_HINT: &str =
    "the pyzmq conformance tests need a Python with pyzmq and msgpack: run the tests with \
                          `cargo xtask test`, which sets one up under target/pyenv (or set PDKV_PYTHON to a \
                          Python that has both)";

/// The Python the peers run with: `$PDKV_PYTHON` (set by `cargo xtask test`), else `python3`.
fn python() -> std::ffi::OsString {
    std::env::var_os("PDKV_PYTHON").filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into())
}

/// A running `zmq_peer.py`: its stdout lines arrive on a channel, its stderr is kept for the
/// failure message, and it is killed when dropped.
struct PyPeer {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Option<JoinHandle<String>>,
    deadline: Instant,
}

impl PyPeer {
    fn spawn(args: &[&str]) -> PyPeer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/zmq_peer.py");
        let python = python();
        let mut child = Command::new(&python)
            .arg("-u")
            .arg(script)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {} ({e}): {SETUP_HINT}", python.to_string_lossy()));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout is piped");
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut err_pipe = child.stderr.take().expect("stderr is piped");
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            let _ = err_pipe.read_to_string(&mut text);
            text
        });
        PyPeer { child, lines, stderr: Some(stderr), deadline: Instant::now() + CHILD_LIMIT }
    }

    /// Kills the child and fails the test with `why` and everything Python wrote to stderr
    /// (which names a missing package, if that is the cause, and then how to get it).
    fn fail(&mut self, why: &str) -> ! {
        let _ = self.child.kill();
        let status = self.child.wait();
        let missing = matches!(&status, Ok(s) if s.code() == Some(MISSING_PACKAGE));
        let status = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
        let stderr = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let hint = if missing { format!("\n{SETUP_HINT}") } else { String::new() };
        panic!("{why}\npython peer exit: {status}\n--- python stderr ---\n{stderr}{hint}");
    }

    /// The next stdout line, within the child's deadline.
    fn line(&mut self) -> String {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(line) => line,
            Err(mpsc::RecvTimeoutError::Timeout) => self.fail("python peer printed nothing in time"),
            Err(mpsc::RecvTimeoutError::Disconnected) => self.fail("python peer ended its output early"),
        }
    }

    /// Waits for a successful exit within the deadline; returns the remaining stdout lines.
    fn finish(mut self) -> Vec<String> {
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => break,
                Ok(Some(_)) => self.fail("python peer failed"),
                Ok(None) if Instant::now() < self.deadline => thread::sleep(Duration::from_millis(20)),
                Ok(None) => self.fail("python peer did not exit in time"),
                Err(e) => self.fail(&format!("cannot wait for the python peer: {e}")),
            }
        }
        // The process is gone, so the reader thread sees end of file and closes the channel.
        self.lines.iter().collect()
    }

    /// Waits for the pdkv side's result on `rx`, failing at once if Python exits with an error
    /// first (a missing package, say) rather than when the deadline passes.
    fn wait_for<T>(&mut self, rx: &mpsc::Receiver<T>, what: &str) -> T {
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(value) => return value,
                Err(mpsc::RecvTimeoutError::Disconnected) => self.fail(&format!("{what}: thread died")),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            match self.child.try_wait() {
                Ok(Some(status)) if !status.success() => {
                    self.fail(&format!("python peer failed during {what}"))
                }
                _ if Instant::now() >= self.deadline => self.fail(&format!("{what}: not done in time")),
                _ => {}
            }
        }
    }

    /// The value of a `Result` from the pdkv side, or a failure that shows Python's view too.
    fn check<T, E: std::fmt::Display>(&mut self, result: Result<T, E>, what: &str) -> T {
        result.unwrap_or_else(|e| self.fail(&format!("pdkv side: {what}: {e}")))
    }
}

impl Drop for PyPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tid() -> TransferId {
    TransferId::new(TRANSFER_ID)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn pdkv_dealer_against_pyzmq_router() {
    let mut peer = PyPeer::spawn(&["router-echo", "3"]);
    let port_line = peer.line();
    let port: u16 = match port_line.strip_prefix("port ").and_then(|p| p.parse().ok()) {
        Some(port) => port,
        None => peer.fail(&format!("expected `port N` first, got {port_line:?}")),
    };
    eprintln!("{}", peer.line()); // pyzmq and libzmq versions
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let conn = Connection::connect(addr, SocketType::Dealer, Some(b"pdkv-decode-0"), HANDSHAKE);
    let mut conn = peer.check(conn, "connect");
    peer.check(conn.set_read_timeout(Some(READ)), "read timeout");
    assert_eq!(conn.peer_type(), SocketType::Router);

    let release = encode(&ControlMessage::Release(Release {
        transfer_id: tid(),
        consumer_tp_size: Some(8),
        sender: None,
        incarnation: None,
        mac: None,
    }));
    let legacy = encode(&ControlMessage::LegacyCompletion(tid()));
    let long: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    let with_sender = encode(&ControlMessage::Release(Release {
        transfer_id: tid(),
        consumer_tp_size: Some(8),
        sender: Some(ReleaseSender { engine_id: "decode-0:6301".to_owned(), dp_rank: 3, tp_rank: 5 }),
        incarnation: None,
        mac: None,
    }));
    let messages: [Vec<&[u8]>; 3] = [vec![&release], vec![&legacy, &long, b""], vec![&with_sender]];
    for (i, frames) in messages.iter().enumerate() {
        if i == 1 {
            // Let libzmq's heartbeat PINGs pile up unread; the next recv must answer them.
            thread::sleep(Duration::from_millis(300));
        }
        let sent = conn.send(frames);
        peer.check(sent, "send");
        let echo = conn.recv();
        let echo = peer.check(echo, "recv");
        let mut expected = vec![b"echo".to_vec()];
        expected.extend(frames.iter().map(|f| f.to_vec()));
        assert_eq!(echo, expected, "echo of message {}", i + 1);
    }
    assert!(conn.pings_answered() > 0, "libzmq pinged every 50 ms; pdkv answered none");
    drop(conn);

    let lines = peer.finish();
    let release_dict =
        format!("{{'type': 'release', 'transfer_id': '{TRANSFER_ID}', 'consumer_tp_size': 8}}");
    let expected = vec![
        "message 1 identity b'pdkv-decode-0' frames 1".to_owned(),
        format!("frame msgpack {release_dict}"),
        "message 2 identity b'pdkv-decode-0' frames 3".to_owned(),
        format!("frame raw {} bytes b'{TRANSFER_ID}'", TRANSFER_ID.len()),
        "frame raw 1000 bytes".to_owned(),
        "frame raw 0 bytes b''".to_owned(),
        "message 3 identity b'pdkv-decode-0' frames 1".to_owned(),
        format!(
            "frame msgpack {{'type': 'release', 'transfer_id': '{TRANSFER_ID}', 'consumer_tp_size': 8, \
             'sender_engine_id': 'decode-0:6301', 'sender_dp_rank': 3, 'sender_tp_rank': 5}}"
        ),
    ];
    assert_eq!(lines, expected);
}

/// What the pdkv ROUTER saw of the pyzmq DEALER.
struct Served {
    identity: Vec<u8>,
    peer_type: SocketType,
    request: Vec<Vec<u8>>,
    release: Vec<Vec<u8>>,
    pings: u64,
}

fn metadata() -> HandshakeMetadata {
    let mut agent_metadata: Vec<u8> = (0..40).collect();
    agent_metadata.extend_from_slice(b"mori-engine-desc");
    HandshakeMetadata {
        engine_id: "prefill-0:6301".to_owned(),
        agent_metadata,
        kv_caches_base_addr: vec![0x7F3A_0000_0000, 0x7F3A_4000_0000],
        num_blocks: 21504,
        block_len: 73728,
        attn_backend_name: "FLASHMLA".to_owned(),
        rank: Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 4 }),
        extensions: Extensions::ALL,
        incarnation: pdkv_core::ids::Incarnation::new(0x1F_2E3D_4C5B),
    }
}

fn layers() -> Vec<LayerMemoryDesc> {
    vec![
        LayerMemoryDesc {
            layer_name: "model.layers.0.self_attn.attn".to_owned(),
            descs: vec![vec![1, 2, 3, 0xFF]],
        },
        LayerMemoryDesc {
            layer_name: "model.layers.1.self_attn.attn".to_owned(),
            descs: vec![vec![4, 5], vec![6]],
        },
    ]
}

/// The ROUTER side: one peer, one handshake request answered, one release acknowledged.
fn serve(mut listener: RouterListener) -> Result<Served, pdkv_rdma::zmtp::ZmtpError> {
    let mut conn = listener.accept()?;
    conn.set_read_timeout(Some(READ))?;
    let request = conn.recv()?;
    for message in handshake_reply(&metadata(), &layers()) {
        let frames: Vec<&[u8]> = message.iter().map(Vec::as_slice).collect();
        conn.send(&frames)?;
    }
    let release = conn.recv()?;
    conn.send(&[b"ack"])?;
    Ok(Served {
        identity: conn.peer_identity().to_vec(),
        peer_type: conn.peer_type(),
        request,
        release,
        pings: conn.pings_answered(),
    })
}

#[test]
fn pyzmq_dealer_against_pdkv_router() {
    let listener = RouterListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind on loopback");
    let port = listener.local_addr().expect("local address").port().to_string();
    let (tx, rx) = mpsc::channel();
    // The pdkv side runs on its own thread so that this one can bound it and kill Python.
    thread::spawn(move || {
        let _ = tx.send(serve(listener));
    });
    let mut peer = PyPeer::spawn(&["dealer", &port, "moriio-decode-0", TRANSFER_ID]);
    let served = peer.wait_for(&rx, "pdkv ROUTER serving the pyzmq DEALER");
    let served = peer.check(served, "serving the handshake");
    eprintln!("{}", peer.line()); // pyzmq and libzmq versions
    let lines = peer.finish();

    assert_eq!(served.identity, b"moriio-decode-0");
    assert_eq!(served.peer_type, SocketType::Dealer);
    // On the wire a DEALER sends just its payload; no identity or delimiter frame.
    assert_eq!(served.request, vec![HANDSHAKE_REQUEST.to_vec()]);
    assert!(served.pings > 0, "libzmq pinged every 50 ms for 1.5 s; pdkv answered none");
    assert_eq!(served.release.len(), 1);
    assert_eq!(
        decode(&served.release[0]),
        Ok(ControlMessage::Release(Release {
            transfer_id: tid(),
            consumer_tp_size: Some(4),
            sender: None,
            incarnation: None,
            mac: None,
        }))
    );

    let meta = metadata();
    let addrs: Vec<String> = meta.kv_caches_base_addr.iter().map(u64::to_string).collect();
    let expected = vec![
        format!(
            "metadata {{\"engine_id\": \"prefill-0:6301\", \"agent_metadata\": \"hex:{}\", \
             \"kv_caches_base_addr\": [{}], \"num_blocks\": 21504, \"block_len\": 73728, \
             \"attn_backend_name\": \"FLASHMLA\", \"dp_rank\": 1, \"tp_rank\": 3, \"tp_size\": 4, \
             \"pdkv_extensions\": [\"read_lease\", \"incarnation\"], \"pdkv_incarnation\": 133919755355}}",
            hex(&meta.agent_metadata),
            addrs.join(", ")
        ),
        "layers {\"model.layers.0.self_attn.attn\": [\"hex:010203ff\"], \
         \"model.layers.1.self_attn.attn\": [\"hex:0405\", \"hex:06\"]}"
            .to_owned(),
        "reply [b'ack']".to_owned(),
    ];
    assert_eq!(lines, expected);
}

/// A MoRI `EngineDesc` as msgpack-c packs it (`MSGPACK_DEFINE(key, gpuId, hostname, backends,
/// tcpHandle)`): an array, the engine key first.
fn mori_engine_desc() -> Vec<u8> {
    let mut bytes = vec![0x95, 0xb2];
    bytes.extend(b"mori-engine-P0-tp1");
    bytes.extend([0x01, 0xa6]);
    bytes.extend(b"node-3");
    bytes.extend([0x91, 0x03, 0x92, 0xa8]);
    bytes.extend(b"10.0.0.3");
    bytes.extend([0xcd, 0xb8, 0x13]);
    bytes
}

/// The connector's own handshake dial (`decode_rank::dial`) against a pyzmq ROUTER answering as
/// a MoRIIO prefill rank: MoRIIO's metadata map, packed by Python, decodes in pdkv, and its
/// `agent_metadata` (a MoRI engine descriptor) is refused as a foreign data plane, naming the
/// rank.
#[test]
fn connector_dial_decodes_a_moriio_handshake_reply() {
    let agent = mori_engine_desc();
    let mut peer = PyPeer::spawn(&["handshake-router", &hex(&agent)]);
    let port: u16 = peer.line().strip_prefix("port ").and_then(|p| p.parse().ok()).expect("a port line");
    eprintln!("{}", peer.line()); // versions
    let endpoint = pdkv_core::ports::Endpoint { host: "127.0.0.1".into(), port };
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(pdkv_rdma::decode_rank::dial(&endpoint, "D0.dp0.tp3", HANDSHAKE));
    });
    let dialled = peer.wait_for(&rx, "pdkv's handshake dial");
    let (metadata, layers) = peer.check(dialled, "the handshake dial");
    let lines = peer.finish();
    assert_eq!(lines, ["request b'D0.dp0.tp3' [b'get_meta_msg']"]);
    assert_eq!(
        metadata,
        HandshakeMetadata {
            engine_id: "moriio-prefill:7100".into(),
            agent_metadata: agent.clone(),
            kv_caches_base_addr: vec![0x7F3A_0000_0000, 0x7F3A_4000_0000],
            num_blocks: 21504,
            block_len: 73728,
            attn_backend_name: "FLASHMLA".into(),
            rank: None,
            extensions: Extensions::NONE,
            incarnation: None,
        }
    );
    let names: Vec<(&str, usize)> = layers.iter().map(|l| (l.layer_name.as_str(), l.descs.len())).collect();
    assert_eq!(names, [("model.layers.0.self_attn.attn", 1), ("model.layers.1.self_attn.attn", 1)]);
    let prefill = pdkv_core::ids::RankId::new(pdkv_core::ids::EngineId::prefill(0), 0, 3);
    let refused = pdkv_rdma::decode_rank::data_endpoint(
        prefill,
        pdkv_rdma::sched::TransportKind::Tcp,
        &metadata.agent_metadata,
    )
    .map_err(|e| e.to_string());
    assert_eq!(
        refused,
        Err(format!(
            "P0.dp0.tp3 advertises a data plane pdkv cannot use (not a pdkv descriptor: looks like a \
             MoRI EngineDesc, {} bytes); pdkv reads over tcp/rdma descriptors",
            agent.len()
        ))
    );
}

/// The connector's notify serving code on a loopback ROUTER listener, for one connection: its
/// port, and the channel it hands the node's inputs to.
fn notify_listener() -> (String, mpsc::Receiver<pdkv_rdma::rank_io::Input>) {
    let mut listener = RouterListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind on loopback");
    let port = listener.local_addr().expect("local address").port().to_string();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        if let Ok(conn) = listener.accept() {
            pdkv_rdma::prefill_rank::serve_notify(conn, 1, tx);
        }
    });
    (port, rx)
}

/// A pyzmq DEALER sends what a MoRIIO decode rank sends a notify listener; the connector's own
/// notify serving code hands both frames to its node, and both decode to releases.
#[test]
fn connector_notify_listener_takes_moriio_releases() {
    let (port, rx) = notify_listener();
    let mut peer = PyPeer::spawn(&["notify-dealer", &port, TRANSFER_ID]);
    let mut frames = Vec::new();
    // `wait_for` fails at once when Python exits with an error (a missing package, say), and
    // otherwise at the child's deadline.
    while frames.len() < 2 {
        if let pdkv_rdma::rank_io::Input::Notify { frame, .. } =
            peer.wait_for(&rx, "a notify frame from the connector's listener")
        {
            frames.push(frame);
        }
    }
    assert_eq!(peer.finish(), ["sent 2"]);
    let release =
        Release { transfer_id: tid(), consumer_tp_size: Some(8), sender: None, incarnation: None, mac: None };
    assert_eq!(decode(&frames[0]), Ok(ControlMessage::Release(release)));
    assert_eq!(decode(&frames[1]), Ok(ControlMessage::LegacyCompletion(tid())));
}

/// The connector's own handshake listener (`prefill_rank::serve_handshake`) against a pyzmq
/// DEALER that first sends what would end MoRIIO's listener thread: each bad message is
/// reported once and skipped, `pop_done_recv` and its request id are taken silently as MoRIIO
/// takes them, and the `get_meta_msg` after all of that is answered, framed as MoRIIO's dialer
/// demands.
#[test]
fn connector_handshake_listener_survives_what_ends_moriio_listener() {
    let mut listener = RouterListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind on loopback");
    let port = listener.local_addr().expect("local address").port().to_string();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        if let Ok(conn) = listener.accept() {
            pdkv_rdma::prefill_rank::serve_handshake(conn, 1, tx);
        }
    });
    let mut peer = PyPeer::spawn(&["handshake-garbage", &port]);
    let mut problems = Vec::new();
    // This thread plays the node: it answers the one metadata request with the core's reply.
    loop {
        match peer.wait_for(&rx, "the connector's handshake listener") {
            pdkv_rdma::rank_io::Input::Problem(problem) => problems.push(problem.to_string()),
            pdkv_rdma::rank_io::Input::HandshakeRequest { conn, reply, .. } => {
                assert_eq!(conn, 1);
                reply
                    .send(vec![handshake_reply(&metadata(), &layers())])
                    .expect("listener waits for the reply");
                break;
            }
            _ => peer.fail("unexpected input from the handshake listener"),
        }
    }
    let lines = peer.finish();
    assert_eq!(
        problems,
        [
            "handshake listener: handshake request: a message of 2 frame(s), expected 1",
            "handshake listener: handshake request of 8 bytes is neither `get_meta_msg` nor \
             `pop_done_recv`: \"get_meta\"",
            "handshake listener: handshake request of 49 bytes is neither `get_meta_msg` nor \
             `pop_done_recv`: \"\\x83\\xa4type\\xa7release\\xabtransfer_...\"",
        ]
    );
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with("metadata {\"engine_id\": \"prefill-0:6301\""), "{lines:?}");
    assert!(lines[1].starts_with("layers {\"model.layers.0.self_attn.attn\""), "{lines:?}");
}

/// The connector's own notify listener and node-side decoding (`serve_notify`, `notify_event`)
/// against a pyzmq DEALER that sends what would end MoRIIO's notify listener before a release:
/// each bad message is one report line, and the release and the legacy completion after them
/// still count.
#[test]
fn connector_notify_listener_survives_what_ends_moriio_listener() {
    let (port, rx) = notify_listener();
    let mut peer = PyPeer::spawn(&["notify-garbage", &port, TRANSFER_ID]);
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let outcome = match peer.wait_for(&rx, "a message from the connector's notify listener") {
            pdkv_rdma::rank_io::Input::Notify { frame, .. } => pdkv_rdma::prefill_rank::notify_event(&frame)
                .map_err(|e| pdkv_rdma::sched::RankProblem::from(e).to_string()),
            pdkv_rdma::rank_io::Input::Problem(problem) => Err(problem.to_string()),
            _ => peer.fail("unexpected input from the notify listener"),
        };
        seen.push(outcome);
    }
    assert_eq!(peer.finish(), ["sent 5"]);
    let release = |consumer_tp_size| {
        Ok(WorkerEvent::Release(Release {
            transfer_id: tid(),
            consumer_tp_size,
            sender: None,
            incarnation: None,
            mac: None,
        }))
    };
    assert_eq!(
        seen,
        [
            Err("notify listener: field `type` names an unknown message type `read_lease_v2`".to_owned()),
            Err("notify listener: notify message: a message of 2 frame(s), expected 1".to_owned()),
            Err("notify listener: reserved MessagePack marker 0xc1 at byte 3".to_owned()),
            release(Some(8)),
            release(None),
        ]
    );
}
