//! Measures the control-plane release round trip on loopback, in one run: a decode side sends
//! MoRIIO-shaped release messages (`{"type": "release", "transfer_id", "consumer_tp_size"}`, made
//! by `wire::encode`) one at a time from a ZMTP DEALER to a pdkv notify listener, and waits for
//! each to be acknowledged.
//!
//! The listener runs as production will run it: a `zmtp::RouterListener` on 127.0.0.1, served on
//! its own thread, decoding each frame with `wire::decode` and handing each release to a real
//! `PrefillWorker` as `WorkerEvent::Release`. The worker is prefill TP rank 0 of a P TP4 -> D TP8
//! pair, so each transfer waits for two releases (MoRIIO's `consumer_tp / producer_tp`); both
//! come over the one DEALER connection. Transfers are registered before their releases arrive
//! (`WorkerEvent::Register`, 64 in flight, as the engine would), so every release is counted,
//! never buffered as early; a completed transfer is retired and the next one registered after
//! the acknowledgement is sent, outside the timed path.
//!
//! The acknowledgement exists only so that this bench can time a round trip: MoRIIO's notify
//! listener answers nothing, and a pdkv listener talking to MoRIIO must not either. Its one frame
//! says what the worker did with the release (`counted` or `finished`), and the decode side
//! checks it against what the quorum implies; the run fails with a non-zero exit if any release
//! was not counted, or if any transfer did not finish after exactly its quorum.
//!
//! It also times the codec alone (encode and decode of a release), the worker alone (the same
//! register, release and retire calls without sockets), and a plain TCP ping-pong between two
//! threads carrying the same bytes each way (the ZMTP frame out, the ack frame back), so that a
//! reader sees which part of the round trip is codec, which is ledger, and which is sockets and
//! thread wake-ups (loopback latency varies a lot between machines and over time; compare the
//! round trip with the ping-pong of the same run).
//!
//! Run with `cargo run --release -p pdkv-rdma --example release_rtt`.

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use pdkv_core::prefill::{PrefillWorker, WorkerAction, WorkerEvent};
use pdkv_core::release::{expected_releases, Quorum, Release};
use pdkv_core::time::Instant as CoreInstant;
use pdkv_core::wire::{self, ControlMessage, Extensions, HandshakeMetadata};
use pdkv_core::{EngineId, Policy, RankId, TransferId};
use pdkv_rdma::zmtp::{Connection, RouterListener, SocketType, ZmtpError};

/// Timed round trips (rounded down to whole transfers).
const ROUND_TRIPS: usize = 20_000;
/// Untimed round trips first: connection, caches, branch predictors, CPU frequency.
const WARM_UP: usize = 2_000;
/// Prefill and decode TP sizes: each prefill rank waits for `DECODE_TP / PREFILL_TP` releases.
const PREFILL_TP: u16 = 4;
const DECODE_TP: u16 = 8;
/// Transfers registered on the worker and not yet released, as on a busy prefill rank.
const IN_FLIGHT: usize = 64;
/// Messages encoded and decoded by the codec-only measurement.
const CODEC_MESSAGES: usize = 200_000;
/// Connect timeout and read timeout of the decode side: a listener that stops answering fails
/// the run instead of hanging it.
const TIMEOUT: Duration = Duration::from_secs(5);

/// The acknowledgement when the release was counted and the transfer still waits for more.
const ACK_COUNTED: &[u8] = b"counted";
/// The acknowledgement when the release completed the transfer's quorum.
const ACK_FINISHED: &[u8] = b"finished";
/// The acknowledgement when the worker ignored the release or reported an error.
const ACK_IGNORED: &[u8] = b"ignored";

type Fallible<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// MoRIIO-shaped transfer ids (`tx-` and a UUID), spread out so that they do not share long
/// prefixes, as random UUIDs do not.
fn transfer_ids(n: usize) -> Vec<TransferId> {
    const SPREAD: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835; // odd: a bijection
    (0..n as u128).map(|k| TransferId::from_u128(k.wrapping_mul(SPREAD))).collect()
}

/// The release decode TP rank `i % quorum` sends for transfer `ids[i / quorum]`, as MoRIIO sends
/// it: no sender keys, so each one counts.
fn release(ids: &[TransferId], quorum: usize, i: usize) -> ControlMessage {
    ControlMessage::Release(Release {
        transfer_id: ids[i / quorum].clone(),
        consumer_tp_size: Some(DECODE_TP),
        sender: None,
        incarnation: None,
        mac: None,
    })
}

/// What the worker did with one release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Counted,
    Finished,
    Ignored,
}

impl Outcome {
    fn ack(self) -> &'static [u8] {
        match self {
            Outcome::Counted => ACK_COUNTED,
            Outcome::Finished => ACK_FINISHED,
            Outcome::Ignored => ACK_IGNORED,
        }
    }
}

/// One prefill rank's worker, with the engine's part played just enough to keep `IN_FLIGHT`
/// transfers registered: register ahead, retire on completion.
struct Rank {
    worker: PrefillWorker,
    clock: Instant,
    ids: Vec<TransferId>,
    quorum: u16,
    registered: usize,
    to_retire: Option<TransferId>,
    out: Vec<WorkerAction>,
    releases: usize,
    counted: usize,
    finished: usize,
    problems: Vec<String>,
}

impl Rank {
    fn new(ids: Vec<TransferId>, quorum: u16) -> Rank {
        let metadata = HandshakeMetadata {
            engine_id: "127.0.0.1:7100".into(),
            agent_metadata: Vec::new(),
            kv_caches_base_addr: Vec::new(),
            num_blocks: 1,
            block_len: 1,
            attn_backend_name: "FLASHMLA".into(),
            rank: None,
            extensions: Extensions::ALL,
            incarnation: None,
        };
        let rank_id = RankId::new(EngineId::prefill(0), 0, 0);
        let worker = PrefillWorker::new(rank_id, metadata, Vec::new(), &Policy::fixed());
        let mut rank = Rank {
            worker,
            clock: Instant::now(),
            ids,
            quorum,
            registered: 0,
            to_retire: None,
            out: Vec::new(),
            releases: 0,
            counted: 0,
            finished: 0,
            problems: Vec::new(),
        };
        while rank.registered < IN_FLIGHT.min(rank.ids.len()) {
            rank.register_next();
        }
        rank
    }

    /// The wall clock as the core's `Instant`, as a real driver passes it.
    fn now(&self) -> CoreInstant {
        CoreInstant(self.clock.elapsed().as_nanos() as u64)
    }

    fn problem(&mut self, what: String) {
        // Keep a few; the counters say how many there were.
        if self.problems.len() < 5 {
            self.problems.push(what);
        }
    }

    /// Hands every leftover action to `problem`: register and retire should produce none.
    fn expect_quiet(&mut self, during: &str) {
        for action in std::mem::take(&mut self.out) {
            self.problem(format!("{during}: unexpected {action:?}"));
        }
    }

    fn register_next(&mut self) {
        let transfer_id = self.ids[self.registered].clone();
        self.registered += 1;
        let now = self.now();
        let quorum = Quorum::Exact(self.quorum);
        self.worker.handle(
            now,
            WorkerEvent::Register { transfer_id, quorum, incarnation: None },
            &mut self.out,
        );
        self.expect_quiet("register");
    }

    /// The release path of the notify listener: one decoded release into the worker.
    fn release(&mut self, release: Release) -> Outcome {
        self.releases += 1;
        let now = self.now();
        self.worker.handle(now, WorkerEvent::Release(release), &mut self.out);
        let mut outcome = Outcome::Counted;
        for action in std::mem::take(&mut self.out) {
            match action {
                WorkerAction::Finished { transfer_id, .. } if outcome == Outcome::Counted => {
                    outcome = Outcome::Finished;
                    self.to_retire = Some(transfer_id);
                }
                other => {
                    outcome = Outcome::Ignored;
                    self.problem(format!("release: {other:?}"));
                }
            }
        }
        match outcome {
            Outcome::Counted => self.counted += 1,
            Outcome::Finished => self.finished += 1,
            Outcome::Ignored => {}
        }
        outcome
    }

    /// The engine's part, after the acknowledgement: free a finished transfer (retire it on the
    /// worker) and register the next one.
    fn settle(&mut self) {
        if let Some(transfer_id) = self.to_retire.take() {
            let now = self.now();
            self.worker.handle(now, WorkerEvent::Retired { transfer_id, incarnation: None }, &mut self.out);
            self.expect_quiet("retire");
            if self.registered < self.ids.len() {
                self.register_next();
            }
        }
    }

    /// Everything wrong with the run, given the releases the decode side sent; empty when every
    /// release was counted and every transfer finished after exactly its quorum.
    fn verdict(&self, sent: usize) -> Vec<String> {
        let transfers = self.ids.len();
        let q = usize::from(self.quorum);
        let mut wrong = self.problems.clone();
        let mut expect = |what: &str, got: usize, want: usize| {
            if got != want {
                wrong.push(format!("{what}: {got}, expected {want}"));
            }
        };
        expect("releases delivered to the worker", self.releases, sent);
        expect("releases counted short of a quorum", self.counted, transfers * (q - 1));
        expect("transfers finished", self.finished, transfers);
        expect("transfers registered", self.registered, transfers);
        expect("transfers still pending on the ledger", self.worker.ledger().pending().count(), 0);
        expect("releases buffered as early", self.worker.ledger().early_len(), 0);
        wrong
    }
}

/// What the listener thread reports when the decode side hangs up.
struct ListenerReport {
    wrong: Vec<String>,
    peer_identity: Vec<u8>,
}

/// The notify listener: accepts the decode side's DEALER and serves it until it hangs up.
fn serve(
    mut listener: RouterListener,
    ids: Vec<TransferId>,
    quorum: u16,
    sent: usize,
) -> Fallible<ListenerReport> {
    let mut rank = Rank::new(ids, quorum);
    let mut conn = listener.accept()?;
    loop {
        let frames = match conn.recv() {
            Ok(frames) => frames,
            Err(ZmtpError::Closed { .. }) => break,
            Err(e) => return Err(e.into()),
        };
        let outcome = match frames.as_slice() {
            [frame] => match wire::decode(frame).map(|m| m.as_release()) {
                Ok(Some(release)) => rank.release(release),
                Ok(None) => {
                    rank.problem("a message other than a release arrived".into());
                    Outcome::Ignored
                }
                Err(e) => {
                    rank.problem(format!("undecodable frame: {e}"));
                    Outcome::Ignored
                }
            },
            _ => {
                rank.problem(format!("a message of {} frames arrived", frames.len()));
                Outcome::Ignored
            }
        };
        conn.send(&[outcome.ack()])?;
        rank.settle();
    }
    Ok(ListenerReport { wrong: rank.verdict(sent), peer_identity: conn.peer_identity().to_vec() })
}

/// Round-trip statistics of the timed part, in nanoseconds.
struct Stats {
    median: u64,
    p99: u64,
    max: u64,
    per_second: f64,
}

impl Stats {
    fn of(mut times: Vec<u64>, wall: Duration) -> Stats {
        times.sort_unstable();
        // Nearest rank: the smallest value with at least p% of the samples at or below it.
        let rank = |p: usize| times[(times.len() * p).div_ceil(100).max(1) - 1];
        Stats {
            median: rank(50),
            p99: rank(99),
            max: *times.last().expect("at least one round trip"),
            per_second: times.len() as f64 / wall.as_secs_f64(),
        }
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// Nanoseconds per message of encoding and of decoding a release, each timed alone.
fn time_codec(ids: &[TransferId], quorum: usize) -> Fallible<(f64, f64)> {
    let messages: Vec<ControlMessage> = (0..ids.len() * quorum).map(|i| release(ids, quorum, i)).collect();
    let encoded: Vec<Vec<u8>> = messages.iter().map(wire::encode).collect();
    for (message, bytes) in messages.iter().zip(&encoded) {
        if &wire::decode(bytes)? != message {
            return Err("a release does not decode back to itself".into());
        }
    }
    let start = Instant::now();
    let mut total = 0usize;
    for i in 0..CODEC_MESSAGES {
        total += black_box(wire::encode(black_box(&messages[i % messages.len()]))).len();
    }
    let encode_ns = start.elapsed().as_nanos() as f64 / CODEC_MESSAGES as f64;
    black_box(total);
    let start = Instant::now();
    for i in 0..CODEC_MESSAGES {
        black_box(wire::decode(black_box(&encoded[i % encoded.len()]))?);
    }
    let decode_ns = start.elapsed().as_nanos() as f64 / CODEC_MESSAGES as f64;
    Ok((encode_ns, decode_ns))
}

/// Nanoseconds per release of the worker alone, without sockets: the listener's release path
/// (each call timed on its own, so this includes one clock read), and that path together with
/// the engine's register and retire (the same calls as in the round trip; the one loop timed).
fn time_worker(ids: &[TransferId], quorum: u16) -> Fallible<(f64, f64)> {
    let q = usize::from(quorum);
    let releases: Vec<Release> = (0..ids.len() * q)
        .map(|i| match release(ids, q, i) {
            ControlMessage::Release(r) => r,
            _ => unreachable!("release() builds releases"),
        })
        .collect();
    let sent = releases.len();
    let mut rank = Rank::new(ids.to_vec(), quorum);
    let mut in_release = Duration::ZERO;
    let start = Instant::now();
    for r in releases {
        let call = Instant::now();
        black_box(rank.release(r));
        in_release += call.elapsed();
        rank.settle();
    }
    let all = start.elapsed();
    let wrong = rank.verdict(sent);
    if !wrong.is_empty() {
        return Err(format!("the worker alone miscounted: {}", wrong.join("; ")).into());
    }
    let per = |d: Duration| d.as_nanos() as f64 / sent as f64;
    Ok((per(in_release), per(all)))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("release_rtt failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A plain TCP ping-pong between two threads, `out` bytes each way out and `back` bytes back,
/// one at a time: the floor under any request-reply protocol on this machine's loopback.
fn ping_pong(out: usize, back: usize, warm: usize, timed: usize) -> Fallible<Stats> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    let addr = listener.local_addr()?;
    let echo = thread::spawn(move || -> io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let (mut request, reply) = (vec![0u8; out], vec![1u8; back]);
        loop {
            match s.read_exact(&mut request) {
                Ok(()) => s.write_all(&reply)?,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    let (request, mut reply) = (vec![2u8; out], vec![0u8; back]);
    let mut times = Vec::with_capacity(timed);
    let mut wall = Instant::now();
    for i in 0..warm + timed {
        if i == warm {
            wall = Instant::now();
        }
        let start = Instant::now();
        s.write_all(&request)?;
        s.read_exact(&mut reply)?;
        if i >= warm {
            times.push(start.elapsed().as_nanos() as u64);
        }
    }
    let wall = wall.elapsed();
    drop(s);
    echo.join().map_err(|_| "the echo thread panicked")??;
    Ok(Stats::of(times, wall))
}

fn run() -> Fallible<()> {
    let quorum = expected_releases(PREFILL_TP, DECODE_TP)?;
    let q = usize::from(quorum);
    let (warm_transfers, timed_transfers) = (WARM_UP / q, ROUND_TRIPS / q);
    let ids = transfer_ids(warm_transfers + timed_transfers);
    let (warm_rts, total_rts) = (warm_transfers * q, ids.len() * q);
    let timed_rts = total_rts - warm_rts;

    let sample = wire::encode(&release(&ids, q, 0));
    let (encode_ns, decode_ns) = time_codec(&ids[..1024.min(ids.len())], q)?;
    let (worker_ns, bookkeeping_ns) = time_worker(&ids, quorum)?;

    let listener = RouterListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    let addr = listener.local_addr()?;
    let server = {
        let ids = ids.clone();
        thread::Builder::new()
            .name("notify-listener".into())
            .spawn(move || serve(listener, ids, quorum, total_rts))?
    };

    let mut dealer = Connection::connect(addr, SocketType::Dealer, Some(b"decode-tp0"), TIMEOUT)?;
    dealer.set_read_timeout(Some(TIMEOUT))?;
    let messages: Vec<ControlMessage> = (0..total_rts).map(|i| release(&ids, q, i)).collect();
    // One release, then its acknowledgement, checked against what the quorum implies.
    let mut round_trip = |i: usize| -> Fallible<u64> {
        let start = Instant::now();
        let bytes = wire::encode(&messages[i]);
        dealer.send(&[&bytes])?;
        let ack = dealer.recv()?;
        let elapsed = start.elapsed().as_nanos() as u64;
        let want = if i % q == q - 1 { ACK_FINISHED } else { ACK_COUNTED };
        if ack.len() != 1 || ack[0] != want {
            let got: Vec<String> = ack.iter().map(|f| String::from_utf8_lossy(f).into_owned()).collect();
            return Err(format!(
                "release {i} (transfer {}): acknowledged {got:?}, expected {:?}",
                ids[i / q],
                String::from_utf8_lossy(want)
            )
            .into());
        }
        Ok(elapsed)
    };
    for i in 0..warm_rts {
        round_trip(i)?;
    }
    let mut times = Vec::with_capacity(timed_rts);
    let wall = Instant::now();
    for i in warm_rts..total_rts {
        times.push(round_trip(i)?);
    }
    let wall = wall.elapsed();
    drop(dealer);
    let report = server.join().map_err(|_| "the listener thread panicked")??;
    if !report.wrong.is_empty() {
        return Err(format!("the worker did not count every release: {}", report.wrong.join("; ")).into());
    }
    if report.peer_identity != b"decode-tp0" {
        return Err("the listener saw the wrong DEALER identity".into());
    }

    let stats = Stats::of(times, wall);
    // The same bytes on the wire each way: the release frame out, the ack frame back.
    let raw = ping_pong(sample.len() + 2, ACK_FINISHED.len() + 2, warm_rts, timed_rts)?;
    let codec_ns = encode_ns + decode_ns;
    println!(
        "release round trip, ZMTP DEALER -> pdkv notify listener (ROUTER) -> ack, loopback: \
         {timed_rts} round trips after {warm_rts} warm-up, P TP{PREFILL_TP} -> D TP{DECODE_TP} \
         (quorum {quorum})"
    );
    println!(
        "release message       {:>5} B MessagePack ({} B as one ZMTP frame), ack {} B",
        sample.len(),
        sample.len() + 2,
        ACK_FINISHED.len()
    );
    println!(
        "round trip            median {:>7.1} µs   p99 {:>7.1} µs   max {:>8.1} µs   {:>8.0} round trips/s",
        us(stats.median),
        us(stats.p99),
        us(stats.max),
        stats.per_second
    );
    println!(
        "plain TCP ping-pong   median {:>7.1} µs   p99 {:>7.1} µs   max {:>8.1} µs   {:>8.0} round trips/s",
        us(raw.median),
        us(raw.p99),
        us(raw.max),
        raw.per_second
    );
    println!(
        "codec alone           encode {encode_ns:>5.0} ns + decode {decode_ns:>5.0} ns \
         = {codec_ns:.0} ns per release"
    );
    println!(
        "worker alone          {worker_ns:>5.0} ns per release counted; {bookkeeping_ns:.0} ns with the \
         engine's register and retire (done after the ack)"
    );
    println!(
        "checked               {} transfers finished after exactly {quorum} releases each; none ignored",
        ids.len()
    );
    let over_raw = stats.median as f64 - raw.median as f64;
    println!(
        "A release round trip over loopback takes a median {:.1} µs (p99 {:.1} µs, {:.0}/s) against {:.1} µs \
         for a plain TCP ping-pong of the same bytes ({:+.1} µs), of which the codec is {:.2} µs and the \
         release ledger {:.2} µs: the sockets and thread wake-ups dominate.",
        us(stats.median),
        us(stats.p99),
        stats.per_second,
        us(raw.median),
        over_raw / 1e3,
        codec_ns / 1e3,
        worker_ns / 1e3,
    );
    Ok(())
}
