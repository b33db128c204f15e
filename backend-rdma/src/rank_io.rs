//! What a rank's process shares between its connector (which joins the scheduler and starts the
//! rank) and its driver (`prefill_rank`, `decode_rank`): the scheduler link, the node thread's
//! inputs, the context a driver starts with, and the small helpers both use. It sits below both,
//! so the connector imports the ranks and the ranks import only this.

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread;
use std::time::Duration;

use pdkv_core::auth::KeyError;
use pdkv_core::decode::ReadOutcome;
use pdkv_core::ids::{Incarnation, RankId, RequestId};
use pdkv_core::ports::{Endpoint, ListenerKind, PortError};
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, NotationError};
use pdkv_core::wire::{self, FramingError, ReplyPart, WireError};

use crate::memory::{MemoryError, Regions};
use crate::sched::{
    write_frame, AdmitError, FrameError, FromRank, RankProblem, ReadMismatch, Setup, ToRank,
    HEARTBEAT_INTERVAL,
};
use crate::tcp::ServerError;
use crate::zmtp::ZmtpError;

/// Why a connector stopped with an error.
#[derive(Debug)]
pub enum ConnectorError {
    /// The command line named a rank the deployment does not have.
    NoSuchRank {
        /// The rank asked for.
        rank: RankId,
        /// The deployment.
        deployment: String,
    },
    /// The scheduler could not be reached or spoke nonsense.
    Scheduler {
        /// What was being done.
        op: &'static str,
        /// The error.
        error: LinkError,
    },
    /// A listener or the data plane could not start.
    Setup(SetupError),
    /// The scheduler did not admit this process (see [`crate::sched::ToRank::Refused`]).
    Refused(AdmitError),
}

impl fmt::Display for ConnectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectorError::NoSuchRank { rank, deployment } => {
                write!(f, "deployment {deployment} has no rank {rank}")
            }
            ConnectorError::Scheduler { op, error } => write!(f, "scheduler: {op}: {error}"),
            ConnectorError::Setup(error) => write!(f, "cannot start: {error}"),
            ConnectorError::Refused(reason) => write!(f, "the scheduler refused this connector: {reason}"),
        }
    }
}

impl std::error::Error for ConnectorError {}

/// What went wrong on the scheduler connection.
#[derive(Debug)]
pub enum LinkError {
    /// The socket failed.
    Io(io::Error),
    /// A frame could not be written or read.
    Frame(FrameError),
    /// The scheduler accepted the connection and then said nothing for `timeout`.
    Silent {
        /// The scheduler's address.
        scheduler: SocketAddr,
        /// How long the connector waited.
        timeout: Duration,
    },
    /// The scheduler closed the connection without answering the hello.
    Closed {
        /// The scheduler's address.
        scheduler: SocketAddr,
    },
    /// The scheduler answered the hello with another message than the setup.
    NotSetup {
        /// The message's name ([`ToRank::name`]).
        got: &'static str,
    },
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::Io(e) => write!(f, "{e}"),
            LinkError::Frame(e) => write!(f, "{e}"),
            LinkError::Silent { scheduler, timeout } => write!(
                f,
                "the scheduler at {scheduler} accepted the connection but sent nothing within {} s \
                 (is it a pdkv cluster, and is it running?)",
                timeout.as_secs_f64()
            ),
            LinkError::Closed { scheduler } => {
                write!(f, "the scheduler at {scheduler} closed the connection without answering the hello")
            }
            LinkError::NotSetup { got } => write!(f, "expected setup, got {got}"),
        }
    }
}

impl std::error::Error for LinkError {}

/// Why a rank could not start: its listeners, its memory or its data plane.
#[derive(Debug)]
pub enum SetupError {
    /// The deployment on the command line does not parse.
    Deployment(NotationError),
    /// The scheduler's control key is not a key.
    ControlKey(KeyError),
    /// The setup asks for RDMA, which this build lacks.
    NoRdma,
    /// A layer's KV region could not be registered or fenced.
    Region {
        /// The layer.
        layer: u64,
        /// Why.
        error: MemoryError,
    },
    /// An address the rank binds does not resolve.
    Resolve(ResolveError),
    /// The TCP data-plane server could not start.
    Tcp(ServerError),
    /// The RDMA data-plane server could not start.
    #[cfg(feature = "rdma")]
    Verbs(crate::verbs::VerbsError),
    /// The core computed no port for a listener.
    Listen(PortError),
    /// A listener could not bind.
    Bind {
        /// Which listener.
        kind: ListenerKind,
        /// Where.
        endpoint: Endpoint,
        /// Why.
        error: ZmtpError,
    },
    /// The scheduler could not be told the rank is ready.
    Ready(Box<ConnectorError>),
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Deployment(e) => write!(f, "{e}"),
            SetupError::ControlKey(e) => write!(f, "control key: {e}"),
            SetupError::NoRdma => f.write_str("this pdkv was built without the `rdma` feature"),
            SetupError::Region { layer, error } => write!(f, "KV region of layer {layer}: {error}"),
            SetupError::Resolve(e) => write!(f, "{e}"),
            SetupError::Tcp(e) => write!(f, "{e}"),
            #[cfg(feature = "rdma")]
            SetupError::Verbs(e) => write!(f, "{e}"),
            SetupError::Listen(e) => write!(f, "{e}"),
            SetupError::Bind { kind, endpoint, error } => write!(f, "{kind} listener at {endpoint}: {error}"),
            SetupError::Ready(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SetupError {}

/// Why an endpoint the core computed gives no socket address.
#[derive(Debug)]
pub enum ResolveError {
    /// The lookup failed.
    Lookup {
        /// The endpoint.
        endpoint: Endpoint,
        /// Why.
        error: io::Error,
    },
    /// The lookup gave no address.
    NoAddress {
        /// The endpoint.
        endpoint: Endpoint,
    },
}

impl fmt::Display for ResolveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResolveError::Lookup { endpoint, error } => write!(f, "cannot resolve {endpoint}: {error}"),
            ResolveError::NoAddress { endpoint } => write!(f, "{endpoint} resolves to no address"),
        }
    }
}

impl std::error::Error for ResolveError {}

/// Why a handshake dial gave no metadata and descriptors.
#[derive(Debug)]
pub enum DialError {
    /// The listener's address does not resolve.
    Resolve(ResolveError),
    /// The connection could not be made.
    Connect {
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: ZmtpError,
    },
    /// The connection could not be configured.
    Configure(ZmtpError),
    /// The request could not be sent.
    Send {
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: ZmtpError,
    },
    /// A reply message did not arrive.
    Recv {
        /// Which message of the reply.
        part: ReplyPart,
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: ZmtpError,
    },
    /// A reply message is not framed as MoRIIO's dialer demands.
    Framing {
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: FramingError,
    },
    /// The first reply is another control message than the metadata.
    NotMetadata {
        /// The listener.
        endpoint: Endpoint,
        /// The message's name ([`message_name`]).
        got: &'static str,
    },
    /// The metadata does not decode.
    Metadata {
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: WireError,
    },
    /// The layers' memory descriptors do not decode.
    Descriptors {
        /// The listener.
        endpoint: Endpoint,
        /// Why.
        error: WireError,
    },
}

impl fmt::Display for DialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DialError::Resolve(e) => write!(f, "{e}"),
            DialError::Connect { endpoint, error } => write!(f, "dial {endpoint}: {error}"),
            DialError::Configure(e) => write!(f, "{e}"),
            DialError::Send { endpoint, error } => write!(f, "send to {endpoint}: {error}"),
            DialError::Recv { part, endpoint, error } => write!(f, "{part} reply from {endpoint}: {error}"),
            DialError::Framing { endpoint, error } => write!(f, "{endpoint}: {error}"),
            DialError::NotMetadata { endpoint, got } => {
                write!(f, "{endpoint} replied {got} instead of metadata")
            }
            DialError::Metadata { endpoint, error } => write!(f, "metadata from {endpoint}: {error}"),
            DialError::Descriptors { endpoint, error } => write!(f, "descriptors from {endpoint}: {error}"),
        }
    }
}

impl std::error::Error for DialError {}

/// The process clock, in the core's terms: nanoseconds since the connector started.
#[derive(Clone, Copy, Debug)]
pub struct Clock(std::time::Instant);

impl Clock {
    /// A clock starting now.
    pub fn start() -> Clock {
        Clock(std::time::Instant::now())
    }

    /// Now, for the core.
    pub fn now(&self) -> Instant {
        Instant(self.0.elapsed().as_nanos() as u64)
    }

    /// How long from now until `at` (zero if it passed).
    pub fn until(&self, at: Instant) -> Duration {
        Duration::from_nanos(at.0.saturating_sub(self.now().0))
    }
}

/// Where a rank's messages to its scheduler go: the write half of the scheduler connection
/// (a `pdkv cluster` process), shared by the node thread and the heartbeat thread (a lock keeps
/// their frames whole); or, for a rank that runs inside another program's process (the vLLM
/// plugin), a channel that program drains.
pub struct SchedLink {
    sink: Sink,
}

enum Sink {
    Tcp(Arc<Mutex<TcpStream>>),
    Channel(Sender<FromRank>),
}

impl SchedLink {
    /// The link over the write half of the scheduler connection.
    pub(crate) fn new(stream: TcpStream) -> SchedLink {
        SchedLink { sink: Sink::Tcp(Arc::new(Mutex::new(stream))) }
    }

    /// A link whose messages go to `tx`, for a rank running in its host program's process.
    pub fn channel(tx: Sender<FromRank>) -> SchedLink {
        SchedLink { sink: Sink::Channel(tx) }
    }

    /// Sends one message; an error means the scheduler is gone, and the caller exits.
    pub fn send(&mut self, msg: &FromRank) -> Result<(), ConnectorError> {
        match &self.sink {
            Sink::Tcp(stream) => {
                let mut stream = stream.lock().unwrap_or_else(PoisonError::into_inner);
                write_frame(&mut *stream, msg)
                    .map_err(|e| ConnectorError::Scheduler { op: "send", error: LinkError::Frame(e) })
            }
            Sink::Channel(tx) => tx.send(msg.clone()).map_err(|_| ConnectorError::Scheduler {
                op: "send",
                error: LinkError::Io(io::Error::new(io::ErrorKind::BrokenPipe, "the host program is gone")),
            }),
        }
    }

    /// Sends a heartbeat every [`HEARTBEAT_INTERVAL`] from a thread of its own until the
    /// scheduler is gone (the process then exits anyway). A channel link needs none: its
    /// host program shares the process, so it cannot outlive it.
    pub(crate) fn start_heartbeat(&self) {
        let Sink::Tcp(stream) = &self.sink else { return };
        let mut link = SchedLink { sink: Sink::Tcp(stream.clone()) };
        thread::spawn(move || loop {
            thread::sleep(HEARTBEAT_INTERVAL);
            if link.send(&FromRank::Heartbeat).is_err() {
                return;
            }
        });
    }
}

/// KV memory a rank shares with its host program, which keeps the KV's home (vLLM's cache
/// tensors) and copies blocks in and out of these regions: one region per layer, `num_blocks`
/// blocks of `block_len` bytes each, at `bases`. A prefill rank serves reads from them and
/// takes a [`ToRank::Prefill`] to mean the blocks were staged (it grants them to the transfer
/// and fills nothing); a decode rank writes what it reads into them at the request's local
/// blocks instead of checking a pattern.
pub struct StagedKv {
    /// The regions, as the data plane serves them.
    pub regions: Arc<RwLock<Regions>>,
    /// Base address of each layer's region.
    pub bases: Vec<u64>,
    /// Bytes of one block of one layer.
    pub block_len: u64,
    /// Blocks per layer.
    pub num_blocks: u32,
}

impl StagedKv {
    /// Registers `layers` regions of `num_blocks` blocks of `block_len` bytes, from `first_base`
    /// on, every byte fenced (a prefill rank's peers read only blocks staged for a live
    /// transfer).
    pub fn new(
        first_base: u64,
        layers: u16,
        num_blocks: u32,
        block_len: u64,
    ) -> Result<StagedKv, StageError> {
        let too_large = StageError::TooLarge { layers, num_blocks, block_len };
        let region_len = u64::from(num_blocks).checked_mul(block_len).ok_or(too_large)?;
        let mut regions = Regions::new();
        let mut bases = Vec::new();
        for layer in 0..u64::from(layers) {
            let base = layer
                .checked_mul(region_len)
                .and_then(|offset| first_base.checked_add(offset))
                .ok_or(StageError::TooLarge { layers, num_blocks, block_len })?;
            regions.register(base, region_len).map_err(StageError::Memory)?;
            regions.fence(base, region_len).map_err(StageError::Memory)?;
            bases.push(base);
        }
        Ok(StagedKv { regions: Arc::new(RwLock::new(regions)), bases, block_len, num_blocks })
    }

    /// Address of `block` of `layer`, or why there is none.
    pub fn block_addr(&self, layer: usize, block: u32) -> Result<u64, StageError> {
        let base = *self.bases.get(layer).ok_or(StageError::NoLayer { layer, layers: self.bases.len() })?;
        if block >= self.num_blocks {
            return Err(StageError::NoBlock { block, num_blocks: self.num_blocks });
        }
        Ok(base + u64::from(block) * self.block_len)
    }

    /// Copies `data`, the bytes of `blocks` of `layer` one block after another, into the regions.
    pub fn stage(&self, layer: usize, blocks: &[u32], data: &[u8]) -> Result<(), StageError> {
        let expected = blocks.len() as u64 * self.block_len;
        if data.len() as u64 != expected {
            return Err(StageError::Length { got: data.len() as u64, expected });
        }
        let mut regions = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        for (&block, chunk) in blocks.iter().zip(data.chunks(self.block_len as usize)) {
            let addr = self.block_addr(layer, block)?;
            regions.write_own(addr, chunk).map_err(StageError::Memory)?;
        }
        Ok(())
    }

    /// The bytes of `blocks` of `layer`, one block after another.
    pub fn unstage(&self, layer: usize, blocks: &[u32]) -> Result<Vec<u8>, StageError> {
        let regions = self.regions.read().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::with_capacity(blocks.len() * self.block_len as usize);
        for &block in blocks {
            let addr = self.block_addr(layer, block)?;
            out.extend_from_slice(regions.read_own(addr, self.block_len).map_err(StageError::Memory)?);
        }
        Ok(out)
    }
}

/// Why blocks could not be copied into or out of [`StagedKv`].
#[derive(Debug)]
pub enum StageError {
    /// The layer is not one of the regions'.
    NoLayer {
        /// The layer asked for.
        layer: usize,
        /// Layers there are.
        layers: usize,
    },
    /// The block is past the end of the regions.
    NoBlock {
        /// The block asked for.
        block: u32,
        /// Blocks there are.
        num_blocks: u32,
    },
    /// The bytes given are not whole blocks of the listed blocks.
    Length {
        /// Bytes given.
        got: u64,
        /// Bytes the blocks hold.
        expected: u64,
    },
    /// The regions would not fit in the address space.
    TooLarge {
        /// Layers asked for.
        layers: u16,
        /// Blocks per layer.
        num_blocks: u32,
        /// Bytes per block.
        block_len: u64,
    },
    /// The regions refused.
    Memory(MemoryError),
}

impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StageError::NoLayer { layer, layers } => {
                write!(f, "layer {layer} of a KV cache of {layers} layers")
            }
            StageError::NoBlock { block, num_blocks } => {
                write!(f, "block {block} of a KV cache of {num_blocks} blocks")
            }
            StageError::Length { got, expected } => {
                write!(f, "{got} bytes given for blocks that hold {expected}")
            }
            StageError::TooLarge { layers, num_blocks, block_len } => write!(
                f,
                "{layers} layers of {num_blocks} blocks of {block_len} bytes do not fit in the address space"
            ),
            StageError::Memory(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for StageError {}

/// Resolves an endpoint the core computed (host and port) to a socket address.
pub fn resolve(endpoint: &Endpoint) -> Result<SocketAddr, ResolveError> {
    (endpoint.host.as_str(), endpoint.port)
        .to_socket_addrs()
        .map_err(|error| ResolveError::Lookup { endpoint: endpoint.clone(), error })?
        .next()
        .ok_or_else(|| ResolveError::NoAddress { endpoint: endpoint.clone() })
}

/// What a rank's driver starts with.
pub struct Context {
    /// The deployment, with the model the scheduler set.
    pub deployment: Deployment,
    /// This rank.
    pub rank: RankId,
    /// The scheduler's setup.
    pub setup: Setup,
    /// Messages to the scheduler.
    pub link: SchedLink,
    /// A sender for I/O threads.
    pub tx: Sender<Input>,
    /// The node thread's inputs.
    pub rx: Receiver<Input>,
    /// The process clock.
    pub clock: Clock,
    /// This process's incarnation, drawn at start: a prefill rank names it in its handshake
    /// metadata, and its engine in every answer of a transfer the rank holds.
    pub incarnation: Incarnation,
    /// KV memory shared with the host program, for a rank running inside it; `None`: the rank
    /// owns its KV and fills (prefill) or checks (decode) pdkv's byte pattern.
    pub staged: Option<Arc<StagedKv>>,
}

/// One thing that happened, for the node thread.
pub enum Input {
    /// A message from the scheduler.
    Sched(ToRank),
    /// The scheduler connection ended.
    SchedGone(FrameError),
    /// Prefill: a handshake request arrived on connection `conn`; the reply goes to `reply`.
    HandshakeRequest {
        /// The connection's number (the core's opaque peer handle).
        conn: u64,
        /// The dialler, when the identity it announced names a rank (pdkv's decode ranks
        /// announce theirs); message faults match it.
        peer: Option<RankId>,
        /// Where the reply messages go: each reply sent on the connection in order (two when a
        /// fault duplicated it).
        reply: Sender<Vec<HandshakeReply>>,
    },
    /// Prefill: one frame arrived on the notify listener.
    Notify {
        /// The frame.
        frame: Vec<u8>,
        /// The address of the connection it came on, if the socket knew it (named when the
        /// message is refused).
        from: Option<String>,
    },
    /// Decode: a handshake dial ended.
    Dialled {
        /// The session the dial was for.
        session: pdkv_core::ports::SessionKey,
        /// The rank dialled.
        peer: RankId,
        /// Both reply payloads decoded, or why not.
        result: Dialled,
        /// From the dial to the end of the reply, in microseconds.
        elapsed_us: u64,
    },
    /// Decode: a read finished.
    ReadDone(ReadResult),
    /// Something an I/O thread wants reported.
    Problem(RankProblem),
}

/// A control message's name, for reports (its fields can be long and are not for people).
pub fn message_name(message: &pdkv_core::wire::ControlMessage) -> &'static str {
    use pdkv_core::wire::ControlMessage;
    match message {
        ControlMessage::Release(_) => "release",
        ControlMessage::LegacyCompletion(_) => "legacy completion",
        ControlMessage::RemoteBlocks(_) => "remote blocks",
        ControlMessage::WriteDone(_) => "write done",
        ControlMessage::WriteFailed(_) => "write failed",
        ControlMessage::ReadLease(_) => "read lease",
        ControlMessage::HandshakeRequest => "handshake request",
        ControlMessage::HandshakeMetadata(_) => "handshake metadata",
    }
}

/// The two messages of a handshake reply, each a list of frames
/// ([`pdkv_core::wire::handshake_reply`]).
pub type HandshakeReply = [Vec<Vec<u8>>; 2];

/// A finished read, for the node thread.
pub struct ReadResult {
    /// The request read.
    pub request: RequestId,
    /// The layer, for a per-layer read.
    pub layer: Option<u16>,
    /// The prefill rank read.
    pub source: RankId,
    /// Bytes read.
    pub bytes: u64,
    /// How long the data plane took, in microseconds.
    pub elapsed_us: u64,
    /// What the node is told.
    pub outcome: ReadOutcome,
    /// Where the bytes differ from what prefill wrote, if they do.
    pub mismatch: Option<ReadMismatch>,
}

/// What one handshake dial gives: both reply payloads decoded, or why not.
pub type Dialled = Result<(wire::HandshakeMetadata, Vec<wire::LayerMemoryDesc>), DialError>;
