//! The decode rank's driver: a `DecodeWorker` whose handshakes are real ZMTP dials, whose reads
//! go through a [`Transport`] and are verified byte for byte, and whose releases and leases go to
//! the prefill ranks' notify listeners.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use pdkv_core::decode::{
    DecodeAction, DecodeConfig, DecodeEvent, DecodeWorker, ReadGranularity, ReadOp, ReadOutcome,
};
use pdkv_core::ids::{RankId, RequestId, Role};
use pdkv_core::policy::Policy;
use pdkv_core::ports::{Endpoint, SessionKey};
use pdkv_core::wire::{self, ControlMessage, DataPlane, DataTransport, ForeignDataPlane};

use crate::message_faults::{sooner, Injector, Later, MessageHit, MessageKind};
use crate::pattern::{heads_of_rank, transfer_key, BlockKey};
use crate::rank_io::{
    resolve, ConnectorError, Context, DialError, Dialled, Input, LinkError, ReadResult, SetupError,
    StageError, StagedKv,
};
use crate::sched::{FromRank, RankProblem, ReadMismatch, ToRank, TransportKind};
use crate::tcp::TcpTransport;
use crate::transport::{ReadTag, Transport, TransportError};
use crate::zmtp::{Connection, SocketType};

/// How long a release or lease may take to reach a notify listener.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(2);

/// One read for the reader thread: the op, where to read it, and what the bytes must be.
struct ReadJob {
    op: ReadOp,
    data: Endpoint,
    heads: (u16, u16),
}

/// Dials a prefill rank's handshake listener as MoRIIO does (a DEALER sending the one frame
/// `get_meta_msg`), and decodes the two reply messages, each of which must be `[b"", payload]`
/// as MoRIIO's dialer demands.
pub fn dial(endpoint: &Endpoint, identity: &str, timeout: Duration) -> Dialled {
    let mut first = None;
    dial_repeated(endpoint, identity, timeout, 1, &mut |reply| first = Some(reply));
    first.expect("a dial gives one result at least")
}

/// [`dial`], with the request sent `copies` times on the connection (a duplicated handshake
/// request): each copy is answered, and each reply goes to `deliver` as it arrives, so the node
/// sees what a duplicated request makes the listener send. The first result is always
/// delivered; a later copy that fails is left out (its request was answered once already).
pub fn dial_repeated(
    endpoint: &Endpoint,
    identity: &str,
    timeout: Duration,
    copies: usize,
    deliver: &mut dyn FnMut(Dialled),
) {
    let mut conn = match connect(endpoint, identity, timeout, copies.max(1)) {
        Ok(conn) => conn,
        Err(e) => return deliver(Err(e)),
    };
    let first = read_reply(&mut conn, endpoint);
    let failed = first.is_err();
    deliver(first);
    if failed {
        return;
    }
    for _ in 1..copies {
        match read_reply(&mut conn, endpoint) {
            Ok(reply) => deliver(Ok(reply)),
            Err(_) => return,
        }
    }
}

fn connect(
    endpoint: &Endpoint,
    identity: &str,
    timeout: Duration,
    copies: usize,
) -> Result<Connection, DialError> {
    let addr = resolve(endpoint).map_err(DialError::Resolve)?;
    let mut conn = Connection::connect(addr, SocketType::Dealer, Some(identity.as_bytes()), timeout)
        .map_err(|error| DialError::Connect { endpoint: endpoint.clone(), error })?;
    conn.set_read_timeout(Some(timeout)).map_err(DialError::Configure)?;
    for _ in 0..copies {
        conn.send(&[wire::HANDSHAKE_REQUEST])
            .map_err(|error| DialError::Send { endpoint: endpoint.clone(), error })?;
    }
    Ok(conn)
}

fn read_reply(conn: &mut Connection, endpoint: &Endpoint) -> Dialled {
    let endpoint = || endpoint.clone();
    let mut part = |part: wire::ReplyPart| -> Result<Vec<u8>, DialError> {
        let frames = conn.recv().map_err(|error| DialError::Recv { part, endpoint: endpoint(), error })?;
        let payload = wire::reply_payload(part, &frames)
            .map_err(|error| DialError::Framing { endpoint: endpoint(), error })?;
        Ok(payload.to_vec())
    };
    let metadata = part(wire::ReplyPart::Metadata)?;
    let metadata = match wire::decode(&metadata) {
        Ok(ControlMessage::HandshakeMetadata(m)) => m,
        Ok(other) => {
            let got = crate::rank_io::message_name(&other);
            return Err(DialError::NotMetadata { endpoint: endpoint(), got });
        }
        Err(error) => return Err(DialError::Metadata { endpoint: endpoint(), error }),
    };
    let layers = part(wire::ReplyPart::Layers)?;
    let layers = wire::decode_layer_memory_descs(&layers)
        .map_err(|error| DialError::Descriptors { endpoint: endpoint(), error })?;
    Ok((metadata, layers))
}

/// Where to read rank `peer`'s KV, from the `agent_metadata` of its handshake: a pdkv data-plane
/// descriptor of this rank's own transport. A foreign one (MoRIIO's packed MoRI `EngineDesc`) or
/// one of the other transport fails the handshake with a line that names the peer and says why.
pub fn data_endpoint(
    peer: RankId,
    own: TransportKind,
    agent_metadata: &[u8],
) -> Result<Endpoint, DataEndpointError> {
    let plane = DataPlane::decode(peer, agent_metadata).map_err(DataEndpointError::Foreign)?;
    if plane.transport != DataTransport::from(own) {
        return Err(DataEndpointError::OtherTransport { peer, serves: plane.transport, own });
    }
    Ok(plane.addr)
}

/// Why a peer's handshake names no data plane this rank can read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataEndpointError {
    /// The descriptor is not pdkv's (MoRIIO's MoRI `EngineDesc`, say).
    Foreign(ForeignDataPlane),
    /// A pdkv descriptor of the other transport.
    OtherTransport {
        /// The peer.
        peer: RankId,
        /// The transport it serves over.
        serves: DataTransport,
        /// This rank's.
        own: TransportKind,
    },
}

impl fmt::Display for DataEndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataEndpointError::Foreign(e) => write!(f, "{e}"),
            DataEndpointError::OtherTransport { peer, serves, own } => {
                write!(f, "{peer} serves its KV over {serves}, and this rank reads over {own}")
            }
        }
    }
}

impl std::error::Error for DataEndpointError {}

/// Requests whose reads the worker aborted ([`DecodeAction::AbortReads`]), shared with the
/// reader thread; an id leaves when the worker reports the request ended, which it does only
/// after every read of it was answered.
type Aborted = Arc<Mutex<BTreeSet<RequestId>>>;

/// The reader thread: posts each read through the transport, then checks every byte. A read of
/// an aborted request is cancelled ([`Transport::read_cancellable`]): one that has not started
/// is answered aborted without touching the peer; a started one is stopped where the data plane
/// can (verbs) or runs to its end or its I/O timeout (TCP); the worker's release waits for the
/// answer either way.
fn reader(
    jobs: Receiver<ReadJob>,
    tx: Sender<Input>,
    mut transport: Box<dyn Transport + Send>,
    aborted: Aborted,
    staged: Option<Arc<StagedKv>>,
) {
    let mut buffer = Vec::new();
    for job in jobs {
        let op = &job.op;
        let bytes = op.bytes();
        buffer.resize(bytes as usize, 0);
        let ranges = op.remote_ranges();
        let request = op.request();
        let cancelled = || aborted.lock().is_ok_and(|set| set.contains(&request));
        // The read names the incarnation its session described and its transfer, so the producer
        // serves it only from that incarnation's blocks of that transfer.
        let tag =
            ReadTag { incarnation: op.plan.incarnation, transfer: Some(transfer_key(&op.plan.transfer_id)) };
        let started = std::time::Instant::now();
        let read = transport.read_tagged(&job.data, tag, &ranges, &mut buffer, &cancelled);
        let elapsed_us = started.elapsed().as_micros() as u64;
        let (outcome, mismatch) = match read {
            Ok(()) => match &staged {
                // The host program checks its own KV; the bytes go to the request's blocks.
                Some(staged) => match land(op, staged, &buffer) {
                    Ok(()) => (ReadOutcome::Ok, None),
                    Err(e) => (ReadOutcome::Failed(format!("cannot land the bytes read: {e}")), None),
                },
                None => match verify(op, job.heads, &buffer) {
                    None => (ReadOutcome::Ok, None),
                    Some(mismatch) => (
                        ReadOutcome::Failed(format!("bytes differ from prefill's: {mismatch}")),
                        Some(mismatch),
                    ),
                },
            },
            Err(TransportError::Aborted { .. }) => (ReadOutcome::Aborted, None),
            Err(e) => (ReadOutcome::Failed(e.to_string()), None),
        };
        let result = ReadResult {
            request: op.request(),
            layer: op.layer,
            source: op.plan.source,
            bytes,
            elapsed_us,
            outcome,
            mismatch,
        };
        if tx.send(Input::ReadDone(result)).is_err() {
            return;
        }
    }
}

/// Writes a read's bytes (the op's layers one after another, each with the request's blocks in
/// request order) into the host program's KV at the request's local blocks.
fn land(op: &ReadOp, staged: &StagedKv, buffer: &[u8]) -> Result<(), StageError> {
    let plan = &op.plan;
    if plan.block_len != staged.block_len {
        return Err(StageError::Length { got: plan.block_len, expected: staged.block_len });
    }
    let per_layer = plan.local_block_ids.len() * plan.block_len as usize;
    for (layer, bytes) in op.layers.clone().zip(buffer.chunks(per_layer.max(1))) {
        staged.stage(layer, &plan.local_block_ids, bytes)?;
    }
    Ok(())
}

/// Where a read's bytes differ from the pattern prefill wrote, if anywhere. The buffer holds
/// the op's layers one after another, each with the request's blocks in request order.
fn verify(op: &ReadOp, heads: (u16, u16), buffer: &[u8]) -> Option<ReadMismatch> {
    let plan = &op.plan;
    let transfer = transfer_key(&plan.transfer_id);
    let block_len = plan.block_len as usize;
    let mut chunks = buffer.chunks(block_len);
    for layer in op.layers.clone() {
        for (i, &block) in plan.remote_block_ids.iter().enumerate() {
            let chunk = chunks.next()?;
            let key = BlockKey {
                transfer,
                layer: layer as u16,
                block: i as u32,
                first_head: heads.0,
                heads: heads.1,
            };
            if let Some(at) = key.first_mismatch(chunk) {
                return Some(ReadMismatch {
                    request: plan.request,
                    layer: layer as u16,
                    block: i as u32,
                    block_id: block,
                    source: plan.source,
                    byte: at as u64,
                });
            }
        }
    }
    None
}

/// Sends releases and leases to notify listeners, one DEALER per listener, reconnecting once
/// on failure. A listener that stays unreachable loses the message, as with MoRIIO.
fn notifier(messages: Receiver<(Endpoint, Vec<u8>)>, identity: String, tx: Sender<Input>) {
    let mut conns: BTreeMap<Endpoint, Connection> = BTreeMap::new();
    for (endpoint, bytes) in messages {
        let mut sent = false;
        for _attempt in 0..2 {
            if !conns.contains_key(&endpoint) {
                let Ok(addr) = resolve(&endpoint) else { break };
                match Connection::connect(addr, SocketType::Dealer, Some(identity.as_bytes()), NOTIFY_TIMEOUT)
                {
                    Ok(conn) => {
                        conns.insert(endpoint.clone(), conn);
                    }
                    Err(_) => break,
                }
            }
            let conn = conns.get_mut(&endpoint).expect("connected above");
            if conn.send(&[&bytes]).is_ok() {
                sent = true;
                break;
            }
            conns.remove(&endpoint);
        }
        if !sent && tx.send(Input::Problem(RankProblem::NotifyLost { endpoint })).is_err() {
            return;
        }
    }
}

/// A control message the node asked to send, as the fault layer holds it.
enum Held {
    /// A handshake dial.
    Dial { session: SessionKey, peer: RankId, endpoint: Endpoint },
    /// A release or lease for a notify listener.
    Notify { endpoint: Endpoint, bytes: Vec<u8> },
}

/// Where the node's control messages leave: through the fault layer (`--lose-messages`,
/// `--duplicate-messages`, `--delay-messages`), which sends each now, later, twice or never,
/// and reports to the scheduler what it did. A delayed message waits in [`Later`], which the
/// node loop's wait covers, so a delay never blocks the loop.
struct Outbox {
    rank: RankId,
    injector: Injector,
    later: Later<(Held, usize)>,
    /// The node thread's inputs (dial results come back on it).
    tx: Sender<Input>,
    notify: Sender<(Endpoint, Vec<u8>)>,
    handshake_timeout: Duration,
    /// Messages the fault layer changed.
    faulted: u64,
}

impl Outbox {
    /// Sends `held` (a message of `kind` to `peer`, about `transfer_id`) as the faults say.
    fn send(
        &mut self,
        link: &mut crate::rank_io::SchedLink,
        kind: MessageKind,
        peer: RankId,
        transfer_id: Option<pdkv_core::ids::TransferId>,
        held: Held,
    ) -> Result<(), ConnectorError> {
        let Some(fate) = self.injector.fate(kind, &[self.rank, peer]) else {
            self.emit(held, 1);
            return Ok(());
        };
        self.faulted += 1;
        let sending = fate.sending();
        link.send(&FromRank::MessageFault(MessageHit {
            kind,
            from: self.rank,
            to: Some(peer),
            transfer_id,
            fate,
        }))?;
        match sending {
            None => {}
            Some((copies, delay)) if delay.is_zero() => self.emit(held, copies),
            Some((copies, delay)) => self.later.push(delay, (held, copies)),
        }
        Ok(())
    }

    /// Sends what a delay held back and is due now.
    fn send_due(&mut self) {
        while let Some((held, copies)) = self.later.pop_due() {
            self.emit(held, copies);
        }
    }

    fn emit(&self, held: Held, copies: usize) {
        match held {
            Held::Dial { session, peer, endpoint } => {
                let (tx, identity, timeout) =
                    (self.tx.clone(), self.rank.to_string(), self.handshake_timeout);
                thread::spawn(move || {
                    let started = std::time::Instant::now();
                    dial_repeated(&endpoint, &identity, timeout, copies, &mut |result| {
                        let elapsed_us = started.elapsed().as_micros() as u64;
                        let _ =
                            tx.send(Input::Dialled { session: session.clone(), peer, result, elapsed_us });
                    });
                });
            }
            Held::Notify { endpoint, bytes } => {
                for _ in 0..copies {
                    let _ = self.notify.send((endpoint.clone(), bytes.clone()));
                }
            }
        }
    }
}

fn transport(
    kind: TransportKind,
    rdma_device: Option<&str>,
    io_timeout: Duration,
) -> Result<Box<dyn Transport + Send>, SetupError> {
    match kind {
        TransportKind::Tcp => {
            Ok(Box::new(TcpTransport::with_timeouts(Duration::from_secs(2), Some(io_timeout))))
        }
        #[cfg(feature = "rdma")]
        TransportKind::Rdma => Ok(Box::new(
            crate::verbs::VerbsTransport::with_timeouts(Duration::from_secs(2), io_timeout)
                .on_device(rdma_device.map(str::to_string)),
        )),
        #[cfg(not(feature = "rdma"))]
        TransportKind::Rdma => {
            let _ = rdma_device;
            Err(SetupError::NoRdma)
        }
    }
}

/// Runs a decode rank until shutdown.
pub fn run(mut ctx: Context) -> Result<(), ConnectorError> {
    let setup = ctx.setup.clone();
    let rank = ctx.rank;
    let d = &ctx.deployment;
    let mut config = DecodeConfig::new(
        rank,
        d.layout(rank.engine),
        d.model.clone(),
        Policy::from(&setup.legacy),
        setup.address.engine_id(),
    );
    config.peers = setup.peers.clone();
    setup.timeouts.apply_to(&mut config);
    config.control_key =
        setup.control.auth().map_err(|e| ConnectorError::Setup(SetupError::ControlKey(e)))?.key().cloned();
    config.granularity =
        if setup.per_request_reads { ReadGranularity::PerRequest } else { ReadGranularity::PerLayer };
    let mut worker = DecodeWorker::new(config);
    let transfer_timeout = Duration::from_millis(setup.timeouts.transfer_ms);
    let handshake_timeout = Duration::from_millis(setup.timeouts.handshake_ms);
    let transport = match transport(setup.transport, setup.rdma_device.as_deref(), transfer_timeout) {
        Ok(t) => t,
        Err(error) => {
            let _ = ctx.link.send(&FromRank::SetupFailed { error: error.to_string() });
            return Err(ConnectorError::Setup(error));
        }
    };
    let (jobs_tx, jobs_rx) = mpsc::channel();
    let tx = ctx.tx.clone();
    let aborted: Aborted = Arc::default();
    let reader_aborted = aborted.clone();
    let staged = ctx.staged.clone();
    thread::spawn(move || reader(jobs_rx, tx, transport, reader_aborted, staged));
    let (notify_tx, notify_rx) = mpsc::channel();
    let (tx, identity) = (ctx.tx.clone(), rank.to_string());
    thread::spawn(move || notifier(notify_rx, identity, tx));
    let mut outbox = Outbox {
        rank,
        injector: Injector::new(&setup.message_faults),
        later: Later::default(),
        tx: ctx.tx.clone(),
        notify: notify_tx,
        handshake_timeout,
        faulted: 0,
    };
    ctx.link.send(&FromRank::Ready {
        data_addr: None,
        memory: "host".into(),
        handshake: None,
        incarnation: None,
    })?;

    // Data-plane address of each session, from the handshake's `agent_metadata`.
    let mut data: BTreeMap<SessionKey, Endpoint> = BTreeMap::new();
    let (mut releases, mut handshakes) = (0u64, 0u64);
    let mut out = Vec::new();
    loop {
        let node_wait = worker.poll_timeout().map(|at| ctx.clock.until(at));
        let input = match sooner(node_wait, outbox.later.wait()) {
            Some(wait) => match ctx.rx.recv_timeout(wait) {
                Ok(input) => Some(input),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            },
            None => match ctx.rx.recv() {
                Ok(input) => Some(input),
                Err(_) => break,
            },
        };
        outbox.send_due();
        let now = ctx.clock.now();
        match input {
            // The node's timer, or only a held message's (then the node has nothing due).
            None => {
                if worker.poll_timeout().is_some_and(|at| at <= now) {
                    worker.handle(now, DecodeEvent::Tick, &mut out);
                }
            }
            Some(Input::Sched(ToRank::StepBegin { step, requests })) => {
                worker.handle(now, DecodeEvent::StepBegin { step, requests }, &mut out);
            }
            Some(Input::Sched(ToRank::Queued { requests })) => {
                worker.handle(now, DecodeEvent::Queued { requests }, &mut out);
            }
            Some(Input::Sched(ToRank::Dequeued { requests })) => {
                worker.handle(now, DecodeEvent::Dequeued { requests }, &mut out);
            }
            Some(Input::Sched(ToRank::VoteResult { step, ok })) => {
                worker.handle(now, DecodeEvent::VoteResult { step, ok }, &mut out);
            }
            Some(Input::Sched(ToRank::Shutdown)) => break,
            Some(Input::Sched(other)) => {
                let message = other.name().to_string();
                ctx.link.send(&FromRank::Problem(RankProblem::Unexpected { role: Role::Decode, message }))?;
            }
            Some(Input::SchedGone(e)) => {
                return Err(ConnectorError::Scheduler { op: "receive", error: LinkError::Frame(e) });
            }
            Some(Input::Dialled { session, peer, result, elapsed_us }) => {
                ctx.link.send(&FromRank::Dialled { peer, ok: result.is_ok(), elapsed_us })?;
                match result {
                    Ok((metadata, layers)) => {
                        match data_endpoint(peer, setup.transport, &metadata.agent_metadata) {
                            Ok(endpoint) => {
                                data.insert(session.clone(), endpoint);
                                let meta = DecodeEvent::HandshakeMetadata {
                                    session: session.clone(),
                                    metadata: Box::new(metadata),
                                };
                                worker.handle(now, meta, &mut out);
                                worker.handle(
                                    now,
                                    DecodeEvent::HandshakeDescriptors { session, layers },
                                    &mut out,
                                );
                            }
                            Err(e) => {
                                let reason = e.to_string();
                                worker.handle(now, DecodeEvent::HandshakeFailed { session, reason }, &mut out)
                            }
                        }
                    }
                    Err(e) => {
                        let reason = e.to_string();
                        worker.handle(now, DecodeEvent::HandshakeFailed { session, reason }, &mut out)
                    }
                }
            }
            Some(Input::ReadDone(result)) => {
                if let Some(mismatch) = result.mismatch {
                    ctx.link.send(&FromRank::Mismatch(mismatch))?;
                }
                if result.outcome == ReadOutcome::Ok {
                    let (request, layer, source, bytes) =
                        (result.request, result.layer, result.source, result.bytes);
                    let elapsed_us = result.elapsed_us;
                    ctx.link.send(&FromRank::ReadVerified { request, layer, source, bytes, elapsed_us })?;
                }
                let event = DecodeEvent::ReadDone {
                    request: result.request,
                    layer: result.layer,
                    outcome: result.outcome,
                };
                worker.handle(now, event, &mut out);
            }
            Some(Input::Problem(problem)) => ctx.link.send(&FromRank::Problem(problem))?,
            Some(Input::HandshakeRequest { .. } | Input::Notify { .. }) => {}
        }
        for action in out.drain(..) {
            match action {
                DecodeAction::DialHandshake { session, rank: peer, endpoint } => {
                    handshakes += 1;
                    let held = Held::Dial { session, peer, endpoint };
                    outbox.send(&mut ctx.link, MessageKind::HandshakeRequest, peer, None, held)?;
                }
                DecodeAction::PostRead(op) => {
                    let source = op.plan.source;
                    let Some(endpoint) = data.get(&op.plan.session).cloned() else {
                        // The core posts reads only on complete sessions, whose metadata named
                        // a data address; fail the read through the node, in order.
                        let reason = format!("no data-plane address for {}", op.plan.session);
                        let result = ReadResult {
                            request: op.request(),
                            layer: op.layer,
                            source,
                            bytes: 0,
                            elapsed_us: 0,
                            outcome: ReadOutcome::Failed(reason),
                            mismatch: None,
                        };
                        let _ = ctx.tx.send(Input::ReadDone(result));
                        continue;
                    };
                    let layout = ctx.deployment.layout(source.engine);
                    let heads = heads_of_rank(&ctx.deployment.model, layout.tp, source.tp);
                    let _ = jobs_tx.send(ReadJob { op, data: endpoint, heads });
                }
                DecodeAction::SendRelease { rank: peer, endpoint, release } => {
                    releases += 1;
                    let transfer_id = Some(release.transfer_id.clone());
                    let held =
                        Held::Notify { endpoint, bytes: wire::encode(&ControlMessage::Release(*release)) };
                    outbox.send(&mut ctx.link, MessageKind::Release, peer, transfer_id, held)?;
                }
                DecodeAction::SendLease { rank: peer, endpoint, lease } => {
                    let transfer_id = Some(lease.transfer_id.clone());
                    let held =
                        Held::Notify { endpoint, bytes: wire::encode(&ControlMessage::ReadLease(*lease)) };
                    outbox.send(&mut ctx.link, MessageKind::Lease, peer, transfer_id, held)?;
                }
                DecodeAction::CastVote { step, ok } => ctx.link.send(&FromRank::Vote { step, ok })?,
                DecodeAction::StepReady { step } => {
                    ctx.link.send(&FromRank::StepDone { step, error: None })?
                }
                // The scheduler asks the core whether a failed step still enters the forward pass
                // with the group or raised out of it alone.
                DecodeAction::StepFailed { step, error } => {
                    ctx.link.send(&FromRank::StepDone { step, error: Some(*error) })?
                }
                DecodeAction::RequestReceived { request } => {
                    ctx.link.send(&FromRank::Received { request })?
                }
                DecodeAction::RequestFailed { request, error } => {
                    if let Ok(mut set) = aborted.lock() {
                        set.remove(&request);
                    }
                    ctx.link.send(&FromRank::RecvFailed { request, error })?;
                }
                DecodeAction::InvalidateBlocks { .. } => {}
                DecodeAction::AbortReads { request } => {
                    if let Ok(mut set) = aborted.lock() {
                        set.insert(request);
                    }
                }
            }
        }
    }
    ctx.link.send(&FromRank::Bye { releases, messages_faulted: outbox.faulted, handshakes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    /// A MoRI `EngineDesc` as msgpack-c packs it: `[key, gpuId, hostname, [backend bits],
    /// [tcp host, tcp port]]`.
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

    #[test]
    fn a_peer_data_plane_is_read_only_from_a_pdkv_descriptor_of_our_transport() {
        let peer = RankId::new(EngineId::prefill(0), 0, 1);
        let at = Endpoint { host: "10.0.0.3".into(), port: 7000 };
        let pdkv = |transport| DataPlane { transport, addr: at.clone() }.encode();
        let mori = mori_engine_desc();
        let cases: Vec<(TransportKind, Vec<u8>, Result<Endpoint, String>)> = vec![
            (TransportKind::Tcp, pdkv(DataTransport::Tcp), Ok(at.clone())),
            (TransportKind::Rdma, pdkv(DataTransport::Rdma), Ok(at.clone())),
            (
                TransportKind::Tcp,
                pdkv(DataTransport::Rdma),
                Err("P0.dp0.tp1 serves its KV over rdma, and this rank reads over tcp".into()),
            ),
            (
                TransportKind::Tcp,
                mori.clone(),
                Err(format!(
                    "P0.dp0.tp1 advertises a data plane pdkv cannot use (not a pdkv descriptor: looks \
                     like a MoRI EngineDesc, {} bytes); pdkv reads over tcp/rdma descriptors",
                    mori.len()
                )),
            ),
            (
                TransportKind::Tcp,
                Vec::new(),
                Err("P0.dp0.tp1 advertises a data plane pdkv cannot use (not a pdkv descriptor: empty, \
                     0 bytes); pdkv reads over tcp/rdma descriptors"
                    .into()),
            ),
        ];
        for (own, bytes, expected) in cases {
            let got = data_endpoint(peer, own, &bytes).map_err(|e| e.to_string());
            assert_eq!(got, expected, "{own} {bytes:02x?}");
        }
    }
}
