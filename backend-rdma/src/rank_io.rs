//! What a rank's process shares between its connector (which joins the scheduler and starts the
//! rank) and its driver (`prefill_rank`, `decode_rank`): the scheduler link, the node thread's
//! inputs, the context a driver starts with, and the small helpers both use. It sits below both,
//! so the connector imports the ranks and the ranks import only this.

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use pdkv_core::auth::KeyError;
use pdkv_core::decode::ReadOutcome;
use pdkv_core::ids::{Incarnation, RankId, RequestId};
use pdkv_core::ports::{Endpoint, ListenerKind, PortError};
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, NotationError};
use pdkv_core::wire::{self, FramingError, ReplyPart, WireError};

use crate::memory::MemoryError;
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

/// The write half of the scheduler connection, shared by the node thread and the heartbeat
/// thread (a lock keeps their frames whole).
pub struct SchedLink {
    stream: Arc<Mutex<TcpStream>>,
}

impl SchedLink {
    /// The link over the write half of the scheduler connection.
    pub(crate) fn new(stream: TcpStream) -> SchedLink {
        SchedLink { stream: Arc::new(Mutex::new(stream)) }
    }

    /// Sends one message; an error means the scheduler is gone, and the caller exits.
    pub fn send(&mut self, msg: &FromRank) -> Result<(), ConnectorError> {
        let mut stream = self.stream.lock().unwrap_or_else(PoisonError::into_inner);
        write_frame(&mut *stream, msg)
            .map_err(|e| ConnectorError::Scheduler { op: "send", error: LinkError::Frame(e) })
    }

    /// Sends a heartbeat every [`HEARTBEAT_INTERVAL`] from a thread of its own until the
    /// scheduler is gone (the process then exits anyway).
    pub(crate) fn start_heartbeat(&self) {
        let mut link = SchedLink { stream: self.stream.clone() };
        thread::spawn(move || loop {
            thread::sleep(HEARTBEAT_INTERVAL);
            if link.send(&FromRank::Heartbeat).is_err() {
                return;
            }
        });
    }
}

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
    /// What the node is told.
    pub outcome: ReadOutcome,
    /// Where the bytes differ from what prefill wrote, if they do.
    pub mismatch: Option<ReadMismatch>,
}

/// What one handshake dial gives: both reply payloads decoded, or why not.
pub type Dialled = Result<(wire::HandshakeMetadata, Vec<wire::LayerMemoryDesc>), DialError>;
