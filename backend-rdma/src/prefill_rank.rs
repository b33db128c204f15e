//! The prefill rank's driver: a `PrefillWorker` behind real handshake and notify listeners (ZMTP
//! ROUTERs at the ports the core computes) and a data-plane server over its KV regions.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread;
use std::time::Duration;

use pdkv_core::ids::{Incarnation, RankId, Role, TransferId};
use pdkv_core::policy::Policy;
use pdkv_core::ports::{Endpoint, ListenerKind};
use pdkv_core::prefill::{PrefillWorker, WorkerAction, WorkerEvent};
use pdkv_core::wire::{
    self, ControlMessage, DataPlane, Extensions, HandshakeMetadata, LayerMemoryDesc, RankInfo,
};

use crate::memory::{MemoryError, Regions};
use crate::message_faults::{Injector, Later, MessageHit, MessageKind};
use crate::pattern::{heads_of_rank, transfer_key, BlockKey};
use crate::rank_io::{resolve, ConnectorError, Context, HandshakeReply, Input, LinkError, SetupError};
use crate::sched::{FromRank, KvOp, Listener, RankProblem, ToRank, TransportKind};
use crate::tcp::{ServerError, TcpReadServer};
use crate::zmtp::RouterListener;

/// How long a handshake connection waits for the node thread's reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a prefill rank could not fill, fence or serve its KV blocks.
#[derive(Debug)]
pub enum KvError {
    /// The host regions refused.
    Memory(MemoryError),
    /// The TCP data-plane server failed.
    Tcp(ServerError),
    /// The HIP device refused a copy.
    #[cfg(feature = "hip")]
    Hip(crate::hip::HipError),
    /// The RDMA data-plane server failed.
    #[cfg(feature = "rdma")]
    Verbs(crate::verbs::VerbsError),
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::Memory(e) => write!(f, "{e}"),
            KvError::Tcp(e) => write!(f, "{e}"),
            #[cfg(feature = "hip")]
            KvError::Hip(e) => write!(f, "{e}"),
            #[cfg(feature = "rdma")]
            KvError::Verbs(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for KvError {}

/// The KV memory of one prefill rank: one region per layer, `num_blocks` blocks each.
struct Kv {
    regions: Arc<RwLock<Regions>>,
    bases: Vec<u64>,
    block_len: u64,
    heads: (u16, u16),
    /// The host program staged the KV ([`Context::staged`]): a prefill grants the blocks and
    /// writes nothing.
    staged: bool,
    /// With a HIP device, the KV's home: one device buffer per layer. Prefill writes each block
    /// there and the host region (what the TCP data plane serves) is filled from the device.
    #[cfg(feature = "hip")]
    device: Option<std::sync::Mutex<Vec<crate::hip::DeviceBuffer>>>,
}

impl Kv {
    fn block_addr(&self, layer: usize, block: u32) -> u64 {
        self.bases[layer] + u64::from(block) * self.block_len
    }

    /// Computes (fills) a request's KV: the pattern of (transfer, layer, block, head).
    fn fill(&self, transfer_id: &TransferId, blocks: &[u32]) -> Result<(), KvError> {
        let transfer = transfer_key(transfer_id);
        let mut regions = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        for layer in 0..self.bases.len() {
            for (i, &block) in blocks.iter().enumerate() {
                let addr = self.block_addr(layer, block);
                regions.unfence(addr, self.block_len);
                // The block holds this transfer's KV now: a read of another transfer (one whose
                // block this was before it was freed) is refused from here on.
                regions.grant(addr, self.block_len, transfer);
                if self.staged {
                    continue;
                }
                let bytes = regions.slice_mut(addr, self.block_len).map_err(KvError::Memory)?;
                let key = BlockKey {
                    transfer,
                    layer: layer as u16,
                    block: i as u32,
                    first_head: self.heads.0,
                    heads: self.heads.1,
                };
                key.fill(bytes);
                #[cfg(feature = "hip")]
                if let Some(device) = &self.device {
                    // The block goes to device memory and the served copy comes back from it.
                    let mut buffers = device.lock().unwrap_or_else(PoisonError::into_inner);
                    let offset = (u64::from(block) * self.block_len) as usize;
                    let buffer = &mut buffers[layer];
                    buffer.copy_from_host(offset, bytes).map_err(KvError::Hip)?;
                    buffer.copy_to_host(offset, bytes).map_err(KvError::Hip)?;
                }
            }
        }
        Ok(())
    }

    fn fence(&self, blocks: &[u32]) -> Result<(), KvError> {
        let mut regions = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        for layer in 0..self.bases.len() {
            for &block in blocks {
                regions.fence(self.block_addr(layer, block), self.block_len).map_err(KvError::Memory)?;
            }
        }
        Ok(())
    }
}

/// Accepts on `listener` forever, serving each connection on its own thread with `serve`.
fn spawn_listener(
    mut listener: RouterListener,
    tx: Sender<Input>,
    serve: fn(crate::zmtp::Connection, u64, Sender<Input>),
) {
    thread::spawn(move || {
        let mut next = 0u64;
        loop {
            match listener.accept() {
                Ok(conn) => {
                    next += 1;
                    let (tx, id) = (tx.clone(), next);
                    thread::spawn(move || serve(conn, id, tx));
                }
                // A failed handshake concerns one peer; the listener carries on.
                Err(e) => {
                    let problem = RankProblem::Listener { listener: Listener::Accept, error: e.to_string() };
                    if tx.send(Input::Problem(problem)).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

/// Serves one handshake connection as MoRIIO's listener does: `get_meta_msg` is answered with
/// the node's two reply messages (each `[b"", payload]`), `pop_done_recv` takes the next message
/// as a request id and answers nothing. Anything else is reported and skipped: unlike MoRIIO's
/// listener, which raises and stops serving everyone, this one keeps serving the connection.
pub fn serve_handshake(mut conn: crate::zmtp::Connection, id: u64, tx: Sender<Input>) {
    let (reply_tx, reply_rx) = mpsc::channel();
    // pdkv's decode ranks announce their rank as their identity; another dialler's is not one.
    let peer = std::str::from_utf8(conn.peer_identity()).ok().and_then(|s| s.parse().ok());
    while let Ok(frames) = conn.recv() {
        match wire::handshake_request(&frames) {
            Ok(wire::HandshakeRequest::Metadata) => {
                if tx.send(Input::HandshakeRequest { conn: id, peer, reply: reply_tx.clone() }).is_err() {
                    return;
                }
                let Ok(replies) = reply_rx.recv_timeout(REPLY_TIMEOUT) else { return };
                for message in replies.iter().flatten() {
                    let refs: Vec<&[u8]> = message.iter().map(Vec::as_slice).collect();
                    if conn.send(&refs).is_err() {
                        return;
                    }
                }
            }
            // The request id that follows is only logged by MoRIIO; pdkv has no use for it.
            Ok(wire::HandshakeRequest::DoneRecv) => {
                if conn.recv().is_err() {
                    return;
                }
            }
            Err(e) => {
                let problem = RankProblem::Listener { listener: Listener::Handshake, error: e.to_string() };
                if tx.send(Input::Problem(problem)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Serves one notify connection: each one-frame message (a release, a lease, the legacy string)
/// goes to the node thread as it arrived, and the node decodes it; a message of another shape
/// is reported and skipped (MoRIIO's listener would raise on it and stop serving).
pub fn serve_notify(mut conn: crate::zmtp::Connection, _id: u64, tx: Sender<Input>) {
    let from = conn.peer_addr().ok().map(|a| a.to_string());
    while let Ok(frames) = conn.recv() {
        let input = match wire::notify_frame(&frames) {
            Ok(frame) => Input::Notify { frame: frame.to_vec(), from: from.clone() },
            Err(e) => {
                Input::Problem(RankProblem::Listener { listener: Listener::Notify, error: e.to_string() })
            }
        };
        if tx.send(input).is_err() {
            return;
        }
    }
}

/// Why a notify frame is no event for the worker: it decoded to another message, or not at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotifyError {
    /// A control message that is neither a release nor a lease.
    Unexpected {
        /// Its name ([`message_name`](crate::rank_io::message_name)).
        message: &'static str,
    },
    /// Bytes that are no control message.
    Wire(wire::WireError),
}

impl fmt::Display for NotifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotifyError::Unexpected { message } => write!(f, "unexpected {message}"),
            NotifyError::Wire(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for NotifyError {}

impl From<NotifyError> for RankProblem {
    fn from(e: NotifyError) -> RankProblem {
        RankProblem::Listener { listener: Listener::Notify, error: e.to_string() }
    }
}

/// What a notify frame means for the worker: a release (the map or the legacy string) or a
/// read lease; anything else (an unknown `type`, a message meant for another socket, bytes that
/// do not decode) is the notify listener's line the report gets. The frame is then dropped and
/// the listener serves on, where MoRIIO's would raise and serve nobody again.
pub fn notify_event(frame: &[u8]) -> Result<WorkerEvent, NotifyError> {
    match wire::decode(frame) {
        Ok(ControlMessage::ReadLease(lease)) => Ok(WorkerEvent::Lease {
            transfer_id: lease.transfer_id,
            lease_ms: lease.lease_ms,
            incarnation: lease.incarnation,
            mac: lease.mac,
        }),
        Ok(message) => match message.as_release() {
            Some(release) => Ok(WorkerEvent::Release(release)),
            None => Err(NotifyError::Unexpected { message: crate::rank_io::message_name(&message) }),
        },
        Err(e) => Err(NotifyError::Wire(e)),
    }
}

/// The data-plane server of this rank.
enum DataServer {
    Tcp(TcpReadServer),
    #[cfg(feature = "rdma")]
    Rdma(crate::verbs::VerbsServer),
}

impl DataServer {
    fn start(
        kind: TransportKind,
        rdma_device: Option<&str>,
        addr: SocketAddr,
        regions: Arc<RwLock<Regions>>,
        incarnation: Incarnation,
    ) -> Result<(DataServer, SocketAddr), SetupError> {
        match kind {
            TransportKind::Tcp => {
                let server =
                    TcpReadServer::bind_as(addr, regions, Some(incarnation)).map_err(SetupError::Tcp)?;
                let local = server.local_addr();
                Ok((DataServer::Tcp(server), local))
            }
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => {
                let server = crate::verbs::VerbsServer::bind_on(addr, regions, rdma_device)
                    .map_err(SetupError::Verbs)?;
                let local = server.local_addr();
                Ok((DataServer::Rdma(server), local))
            }
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma => {
                let _ = rdma_device;
                Err(SetupError::NoRdma)
            }
        }
    }

    /// Makes a fence take effect on the wire: TCP checks the registry's fences on every read;
    /// RDMA cannot fence part of a memory region, so the layer regions get new keys.
    fn fenced(&self, _bases: &[u64]) -> Result<(), KvError> {
        match self {
            DataServer::Tcp(_) => Ok(()),
            #[cfg(feature = "rdma")]
            DataServer::Rdma(server) => {
                for &base in _bases {
                    server.rekey(base).map_err(KvError::Verbs)?;
                }
                Ok(())
            }
        }
    }

    fn shutdown(self) -> Result<(), KvError> {
        match self {
            DataServer::Tcp(server) => server.shutdown().map_err(KvError::Tcp),
            #[cfg(feature = "rdma")]
            DataServer::Rdma(server) => server.shutdown().map_err(KvError::Verbs),
        }
    }
}

/// Runs a prefill rank until shutdown.
pub fn run(mut ctx: Context) -> Result<(), ConnectorError> {
    match start(&mut ctx) {
        Ok(started) => serve(ctx, started),
        Err(error) => {
            let _ = ctx.link.send(&FromRank::SetupFailed { error: error.to_string() });
            Err(ConnectorError::Setup(error))
        }
    }
}

struct Started {
    worker: PrefillWorker,
    kv: Kv,
    server: DataServer,
}

fn start(ctx: &mut Context) -> Result<Started, SetupError> {
    let (setup, rank, d) = (&ctx.setup, ctx.rank, &ctx.deployment);
    let layout = d.layout(rank.engine);
    let model = &d.model;
    let (regions, bases, block_len) = match &ctx.staged {
        // The host program's KV, staged into regions it registered.
        Some(staged) => (staged.regions.clone(), staged.bases.clone(), staged.block_len),
        None => own_regions(ctx)?,
    };
    let num_blocks = ctx.staged.as_ref().map_or(setup.num_blocks, |staged| staged.num_blocks);
    let region_len = u64::from(num_blocks) * block_len;
    let heads = heads_of_rank(model, layout.tp, rank.tp);
    let (backing, note) = crate::memory::select_backing(ctx.staged.is_none());
    let memory = match &note {
        Some(note) => format!("{backing} ({note})"),
        None => backing.to_string(),
    };
    #[cfg(feature = "hip")]
    let (device, memory) = match backing {
        crate::memory::Backing::Hip { device } => {
            let buffers: Result<Vec<_>, _> =
                bases.iter().map(|_| crate::hip::DeviceBuffer::new(device, region_len as usize)).collect();
            match buffers {
                Ok(buffers) => (
                    Some(std::sync::Mutex::new(buffers)),
                    format!("{backing}, staged to host memory for the data plane"),
                ),
                Err(e) => (None, format!("host memory (HIP device {device} refused the KV: {e})")),
            }
        }
        crate::memory::Backing::Host => (None, memory),
    };
    let kv = Kv {
        regions: regions.clone(),
        bases: bases.clone(),
        block_len,
        heads,
        staged: ctx.staged.is_some(),
        #[cfg(feature = "hip")]
        device,
    };

    let address = &setup.address;
    let host_addr = resolve(&pdkv_core::ports::Endpoint { host: address.host.clone(), port: 0 })
        .map_err(SetupError::Resolve)?;
    let (server, data_addr) = DataServer::start(
        setup.transport,
        setup.rdma_device.as_deref(),
        host_addr,
        regions,
        ctx.incarnation,
    )?;
    // MoRIIO's slot for its engine descriptor carries pdkv's data plane instead.
    let data_plane = DataPlane {
        transport: setup.transport.into(),
        addr: Endpoint { host: data_addr.ip().to_string(), port: data_addr.port() },
    };
    let metadata = HandshakeMetadata {
        engine_id: address.engine_id(),
        agent_metadata: data_plane.encode(),
        kv_caches_base_addr: bases.clone(),
        num_blocks,
        block_len,
        attn_backend_name: if model.use_mla { "FLASHMLA" } else { "FLASH_ATTN" }.into(),
        rank: Some(RankInfo { dp_rank: rank.dp, tp_rank: rank.tp, tp_size: layout.tp }),
        extensions: Extensions::ALL,
        incarnation: Some(ctx.incarnation),
    };
    let layers: Vec<LayerMemoryDesc> = bases
        .iter()
        .enumerate()
        .map(|(l, &base)| LayerMemoryDesc {
            layer_name: format!("model.layers.{l}.self_attn.attn"),
            descs: vec![[base.to_be_bytes(), region_len.to_be_bytes()].concat()],
        })
        .collect();
    let policy = Policy::from(&setup.legacy);

    // The handshake reply this rank sends, or would send: the scheduler names the process a
    // foreign decode's read goes through by its descriptors, and when another connector's code
    // plays this rank's control plane (data-plane only), it answers with this reply and the
    // rank binds no listener of its own.
    let handshake = Some([
        wire::encode(&ControlMessage::HandshakeMetadata(metadata.clone())),
        wire::encode_layer_memory_descs(&layers),
    ]);
    // A pdkv decode rank leases for the deployment's transfer timeout; no lease is taken longer.
    let max_lease_ms = setup.timeouts.lease_ms();
    let auth = setup.control.auth().map_err(SetupError::ControlKey)?;
    let worker = PrefillWorker::new(rank, metadata, layers, &policy)
        .with_max_lease_ms(max_lease_ms)
        .with_control_auth(auth);
    // The listeners bind exactly where the core says this rank listens.
    let listeners = if setup.data_plane_only {
        Vec::new()
    } else {
        vec![
            (ListenerKind::Handshake, serve_handshake as fn(_, _, _)),
            (ListenerKind::Notify, serve_notify as fn(_, _, _)),
        ]
    };
    for (kind, serve) in listeners {
        let endpoint = address.listen(layout, rank, kind, &policy).map_err(SetupError::Listen)?;
        let addr = resolve(&endpoint).map_err(SetupError::Resolve)?;
        let listener =
            RouterListener::bind(addr).map_err(|error| SetupError::Bind { kind, endpoint, error })?;
        spawn_listener(listener, ctx.tx.clone(), serve);
    }
    ctx.link
        .send(&FromRank::Ready {
            data_addr: Some(data_addr.to_string()),
            memory,
            handshake,
            incarnation: Some(ctx.incarnation).filter(|_| !ctx.setup.data_plane_only),
        })
        .map_err(|e| SetupError::Ready(Box::new(e)))?;
    Ok(Started { worker, kv, server })
}

/// KV regions, the base address of each layer's, and the bytes of one block.
type KvRegions = (Arc<RwLock<Regions>>, Vec<u64>, u64);

/// The rank's own KV regions: one per layer, `num_blocks` blocks each, every byte fenced.
fn own_regions(ctx: &Context) -> Result<KvRegions, SetupError> {
    let (setup, rank, d) = (&ctx.setup, ctx.rank, &ctx.deployment);
    let layout = d.layout(rank.engine);
    let model = &d.model;
    let block_len = u64::from(model.block_size_tokens) * model.bytes_per_token_per_layer_per_rank(layout.tp);
    let region_len = u64::from(setup.num_blocks) * block_len;
    // Each rank and life gets its own slice of the address space, so an address says whose
    // memory it is, and a read meant for a dead process finds nothing registered.
    let index = d.rank_index(rank) as u64;
    let rank_base = ((index + 1) << 44) + (u64::from(setup.life % 64) << 38);
    let mut regions = Regions::new();
    let mut bases = Vec::new();
    for layer in 0..u64::from(model.layers) {
        let base = rank_base + layer * region_len;
        regions.register(base, region_len).map_err(|error| SetupError::Region { layer, error })?;
        // Peers may read only blocks that hold a live transfer: everything starts fenced, a
        // prefill lifts the fence from its blocks and retiring the transfer puts it back. A
        // read of blocks this incarnation never filled (a transfer prefilled by a process that
        // died) is then refused instead of returning someone else's bytes.
        regions.fence(base, region_len).map_err(|error| SetupError::Region { layer, error })?;
        bases.push(base);
    }
    Ok((Arc::new(RwLock::new(regions)), bases, block_len))
}

/// Where a handshake reply goes: the connection's thread, which sends what it is given.
type ReplyTo = Sender<Vec<HandshakeReply>>;

/// A handshake reply the fault layer holds: delayed (sent when due) or lost (its connection is
/// kept waiting, so the dialler sees silence, as with a lost message, not a closed connection).
enum HeldReply {
    Send(ReplyTo, Vec<HandshakeReply>),
    Lost(ReplyTo),
}

fn serve(mut ctx: Context, started: Started) -> Result<(), ConnectorError> {
    let Started { mut worker, kv, server } = started;
    let mut replies: BTreeMap<u64, (ReplyTo, Option<RankId>)> = BTreeMap::new();
    // Blocks of each transfer this incarnation filled, to fence again when it is retired.
    let mut filled: BTreeMap<TransferId, Vec<u32>> = BTreeMap::new();
    let (mut releases, mut handshakes, mut faulted) = (0u64, 0u64, 0u64);
    // The fault layer of the replies this rank sends; a delay waits here, not in the loop.
    let mut injector = Injector::new(&ctx.setup.message_faults);
    let mut later: Later<HeldReply> = Later::default();
    let mut out = Vec::new();
    // Where the notify frame being handled came from, to name a refused sender.
    let mut sender: Option<String> = None;
    loop {
        let input = match later.wait() {
            None => match ctx.rx.recv() {
                Ok(input) => Some(input),
                Err(_) => break,
            },
            Some(wait) => match ctx.rx.recv_timeout(wait) {
                Ok(input) => Some(input),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            },
        };
        while let Some(held) = later.pop_due() {
            match held {
                // A reply delayed past the connection's wait finds it closed: lost after all.
                HeldReply::Send(reply, messages) => {
                    let _ = reply.send(messages);
                }
                HeldReply::Lost(reply) => drop(reply),
            }
        }
        let Some(input) = input else { continue };
        let now = ctx.clock.now();
        match input {
            Input::Sched(ToRank::Prefill { transfer_id, blocks }) => {
                if let Err(e) = kv.fill(&transfer_id, &blocks) {
                    let (transfer_id, error) = (transfer_id.clone(), e.to_string());
                    ctx.link.send(&FromRank::Problem(RankProblem::Kv {
                        op: KvOp::Prefill,
                        transfer_id,
                        error,
                    }))?;
                }
                filled.insert(transfer_id.clone(), blocks);
                ctx.link.send(&FromRank::Prefilled { transfer_id })?;
            }
            Input::Sched(ToRank::Register { transfer_id, quorum, incarnation }) => {
                worker.handle(now, WorkerEvent::Register { transfer_id, quorum, incarnation }, &mut out);
            }
            Input::Sched(ToRank::GroupDone { transfer_id }) => {
                worker.handle(now, WorkerEvent::GroupDone { transfer_id }, &mut out);
            }
            Input::Sched(ToRank::Retire { transfer_id, incarnation }) => {
                if let Some(blocks) = filled.remove(&transfer_id) {
                    if let Err(e) = kv.fence(&blocks) {
                        let (transfer_id, error) = (transfer_id.clone(), e.to_string());
                        let problem = RankProblem::Kv { op: KvOp::Retire, transfer_id, error };
                        ctx.link.send(&FromRank::Problem(problem))?;
                    }
                }
                // A data-plane-only rank's worker never heard of the transfer: the control
                // plane that registered it is another connector's.
                if !ctx.setup.data_plane_only {
                    worker.handle(now, WorkerEvent::Retired { transfer_id, incarnation }, &mut out);
                }
            }
            Input::Sched(ToRank::Fence { transfer_id, blocks }) => {
                if let Err(e) = kv.fence(&blocks).and_then(|()| server.fenced(&kv.bases)) {
                    let problem = RankProblem::Kv { op: KvOp::Fence, transfer_id, error: e.to_string() };
                    ctx.link.send(&FromRank::Problem(problem))?;
                }
            }
            Input::Sched(ToRank::Shutdown) => break,
            Input::Sched(other) => {
                let message = other.name().to_string();
                ctx.link
                    .send(&FromRank::Problem(RankProblem::Unexpected { role: Role::Prefill, message }))?;
            }
            Input::SchedGone(e) => {
                return Err(ConnectorError::Scheduler { op: "receive", error: LinkError::Frame(e) });
            }
            Input::HandshakeRequest { conn, peer, reply } => {
                handshakes += 1;
                replies.insert(conn, (reply, peer));
                worker.handle(now, WorkerEvent::HandshakeRequest { peer: conn }, &mut out);
            }
            Input::Notify { frame, from } => match notify_event(&frame) {
                Ok(event) => {
                    sender = from;
                    if matches!(event, WorkerEvent::Release(_)) {
                        releases += 1;
                    }
                    worker.handle(now, event, &mut out);
                }
                // Reported (the run's problems count it) and skipped: the listener serves on.
                Err(e) => ctx.link.send(&FromRank::Problem(e.into()))?,
            },
            Input::Problem(problem) => ctx.link.send(&FromRank::Problem(problem))?,
            Input::Dialled { .. } | Input::ReadDone(_) => {}
        }
        for action in out.drain(..) {
            match action {
                WorkerAction::SendHandshakeReply { peer, metadata, layers } => {
                    let Some((reply, dialler)) = replies.remove(&peer) else { continue };
                    let message = wire::handshake_reply(&metadata, &layers);
                    let ranks: Vec<RankId> = [Some(ctx.rank), dialler].into_iter().flatten().collect();
                    let Some(fate) = injector.fate(MessageKind::HandshakeReply, &ranks) else {
                        let _ = reply.send(vec![message]);
                        continue;
                    };
                    faulted += 1;
                    let sending = fate.sending();
                    let hit = MessageHit {
                        kind: MessageKind::HandshakeReply,
                        from: ctx.rank,
                        to: dialler,
                        transfer_id: None,
                        fate,
                    };
                    ctx.link.send(&FromRank::MessageFault(hit))?;
                    match sending {
                        // Its connection waits as long as it would for any reply, then closes.
                        None => later.push(REPLY_TIMEOUT, HeldReply::Lost(reply)),
                        Some((copies, delay)) if delay.is_zero() => {
                            let _ = reply.send(vec![message; copies]);
                        }
                        Some((copies, delay)) => {
                            later.push(delay, HeldReply::Send(reply, vec![message; copies]))
                        }
                    }
                }
                WorkerAction::Finished { transfer_id, .. } => {
                    ctx.link.send(&FromRank::Finished { transfer_id })?;
                }
                WorkerAction::Leased { transfer_id, until, .. } => {
                    let remaining_ns = until.0.saturating_sub(now.0);
                    ctx.link.send(&FromRank::Leased { transfer_id, remaining_ns })?;
                }
                WorkerAction::Ignored { .. } => {}
                WorkerAction::Refused { transfer_id, message, verdict } => ctx
                    .link
                    .send(&FromRank::Refused { transfer_id, message, verdict, from: sender.take() })?,
                WorkerAction::LeaseCapped { transfer_id, asked_ms, .. } => {
                    ctx.link.send(&FromRank::LeaseCapped { transfer_id, asked_ms })?
                }
                WorkerAction::Error { rank, error } => {
                    ctx.link.send(&FromRank::ProtocolError { rank, error })?
                }
            }
        }
    }
    let shutdown = server.shutdown();
    if let Err(e) = shutdown {
        ctx.link.send(&FromRank::Problem(RankProblem::DataServerShutdown { error: e.to_string() }))?;
    }
    ctx.link.send(&FromRank::Bye { releases, messages_faulted: faulted, handshakes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::release::Release;
    use pdkv_core::wire::{ReadLease, WriteDone};

    /// Every frame a notify listener may get: the releases and leases become events, anything
    /// else a report line, and none of them stops the listener (the function returns).
    #[test]
    fn notify_frames_become_events_or_report_lines() {
        let tid = || TransferId::new("tx-1");
        let release = |consumer_tp_size| Release {
            transfer_id: tid(),
            consumer_tp_size,
            sender: None,
            incarnation: None,
            mac: None,
        };
        let encode = |message| wire::encode(&message);
        let cases: Vec<(Vec<u8>, Result<WorkerEvent, &str>)> = vec![
            (encode(ControlMessage::Release(release(Some(4)))), Ok(WorkerEvent::Release(release(Some(4))))),
            (b"tx-1".to_vec(), Ok(WorkerEvent::Release(release(None)))),
            (
                encode(ControlMessage::ReadLease(ReadLease {
                    transfer_id: tid(),
                    lease_ms: 500,
                    incarnation: None,
                    mac: None,
                })),
                Ok(WorkerEvent::Lease { transfer_id: tid(), lease_ms: 500, incarnation: None, mac: None }),
            ),
            // vLLM 0.33's WRITE-mode failure notice: decoded, and not for a prefill rank.
            (
                b"\x82\xa4type\xacwrite_failed\xabtransfer_id\xa4tx-1".to_vec(),
                Err("notify listener: unexpected write failed"),
            ),
            (
                encode(ControlMessage::WriteDone(WriteDone::single(tid()))),
                Err("notify listener: unexpected write done"),
            ),
            (b"get_meta_msg".to_vec(), Err("notify listener: unexpected handshake request")),
            (vec![], Err("notify listener: empty control message")),
            (
                vec![0x81, 0xa1, b'x', 0xc1],
                Err("notify listener: reserved MessagePack marker 0xc1 at byte 3"),
            ),
            (
                vec![0xc0],
                Err("notify listener: not a control message: first byte 0xc0 starts neither a MessagePack \
                     map, a MessagePack str, nor an ASCII plain-string completion"),
            ),
            (
                b"\x81\xa4type\xa7release".to_vec(),
                Err("notify listener: required field `transfer_id` is missing"),
            ),
        ];
        for (frame, expected) in cases {
            let got = notify_event(&frame).map_err(|e| RankProblem::from(e).to_string());
            assert_eq!(got, expected.map_err(str::to_owned), "{frame:02x?}");
        }
    }
}
