//! The scheduler channel: how `pdkv cluster` (the engines' schedulers and the proxy) talks to
//! each rank's connector process. It plays the part of vLLM's engine-core-to-worker channel, so
//! it is pdkv's own: MessagePack values in length-prefixed frames over one TCP connection.
//!
//! The channel carries scheduling (prefill this, begin step N, the group voted) and the node
//! events that cross a process boundary in vLLM too (a worker's finished transfer reaching the
//! engine's ledger). It carries no KV and no MoRIIO message: those go over the ranks' own
//! listeners and the data plane.

use std::fmt;
use std::io::{self, Read, Write};

use pdkv_core::decode::{RecvError, RecvRequest, StepError};
use pdkv_core::ids::{Incarnation, RankId, RequestId, Role, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::policy::PeerBook;
use pdkv_core::ports::{Endpoint, EngineAddress};
use pdkv_core::release::{LedgerError, Quorum};
use pdkv_core::topology::ModelSpec;
use pdkv_engine::timeouts::ProtocolTimeouts;
use serde::de::DeserializeOwned;

use crate::message_faults::{MessageHit, SenderFaults};
use serde::{Deserialize, Serialize};

/// The environment variable that carries a run's membership token to its connectors (the
/// environment, unlike the command line, is not shown to other users by `ps`).
pub const TOKEN_ENV: &str = "PDKV_CLUSTER_TOKEN";

/// How often a connector tells its scheduler it is alive ([`FromRank::Heartbeat`]).
pub const HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Largest hello the scheduler reads from a connection it has not admitted yet.
pub const MAX_HELLO_BYTES: u32 = 4096;

/// Largest frame either side accepts (a step of many requests with long block lists fits).
pub const MAX_FRAME_BYTES: u32 = 64 << 20;

/// Which data plane the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransportKind {
    /// [`crate::tcp`]: always built.
    Tcp,
    /// RDMA verbs: only with the `rdma` feature.
    Rdma,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
        })
    }
}

impl From<TransportKind> for pdkv_core::wire::DataTransport {
    fn from(kind: TransportKind) -> Self {
        match kind {
            TransportKind::Tcp => pdkv_core::wire::DataTransport::Tcp,
            TransportKind::Rdma => pdkv_core::wire::DataTransport::Rdma,
        }
    }
}

/// What a rank is told once it says hello: everything but its identity, which is on its command
/// line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setup {
    /// The served model (shapes of the KV cache).
    pub model: ModelSpec,
    /// Legacy behaviours switched on.
    pub legacy: LegacyOptions,
    /// Where this rank's engine listens (host and port bases).
    pub address: EngineAddress,
    /// Blocks in each prefill rank's KV pool.
    pub num_blocks: u32,
    /// Which data plane to use.
    pub transport: TransportKind,
    /// RDMA: the device (NIC) this rank reads or serves through; `None` for the one
    /// `PDKV_RDMA_DEVICE` names, else the first.
    #[serde(default)]
    pub rdma_device: Option<String>,
    /// The protocol's timeouts: a decode rank's handshake and transfer timeouts, and the read
    /// lease a prefill rank grants at most.
    pub timeouts: ProtocolTimeouts,
    /// Decode: read every layer of a request in one read instead of one read per layer.
    pub per_request_reads: bool,
    /// The message faults this rank applies to what it sends (`pdkv cluster --lose-messages`,
    /// `--duplicate-messages`, `--delay-messages`, `--drop-releases`).
    #[serde(default)]
    pub message_faults: SenderFaults,
    /// Which start of this rank this is (0 first); prefill regions of each life get their own
    /// addresses, so a read meant for a dead process cannot land in a new one. (The protocol's
    /// incarnation is another thing: the process draws it at start and reports it in
    /// [`FromRank::Ready`].)
    pub life: u32,
    /// The rules each engine of the deployment follows: a decode rank releases and dials each
    /// prefill engine under the rules it meets it with ([`Policy::between`](pdkv_core::policy::Policy::between)).
    #[serde(default)]
    pub peers: PeerBook,
    /// Prefill: serve only the data plane, and hand the handshake reply to the scheduler in
    /// [`FromRank::Ready`] instead of binding listeners, because another connector's code plays
    /// this rank's control plane (`pdkv cluster --foreign-side prefill`).
    #[serde(default)]
    pub data_plane_only: bool,
    /// The deployment's control key and how a prefill rank judges releases and leases with it
    /// (`pdkv_core::auth`). It travels on this channel, which only the run's own processes can
    /// join (its token).
    #[serde(default)]
    pub control: ControlSetup,
}

/// How a rank authenticates control messages: the deployment's key, and whether a prefill rank
/// refuses a release or lease without its MAC (every peer is pdkv and holds the key) or only
/// one with a wrong MAC (a peer may be a vLLM rank, which sends none).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlSetup {
    /// The key as 64 hexadecimal digits; `None`: no key, every message is taken (MoRIIO's way).
    pub key: Option<String>,
    /// Refuse messages without a MAC.
    pub require: bool,
}

impl ControlSetup {
    /// The prefill worker's rule, or the reason the key text is bad.
    pub fn auth(&self) -> Result<pdkv_core::auth::ControlAuth, pdkv_core::auth::KeyError> {
        use pdkv_core::auth::{ControlAuth, ControlKey};
        Ok(match &self.key {
            None => ControlAuth::Open,
            Some(hex) if self.require => ControlAuth::Require(ControlKey::from_hex(hex)?),
            Some(hex) => ControlAuth::Verify(ControlKey::from_hex(hex)?),
        })
    }
}

/// Scheduler to rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToRank {
    /// The answer to [`FromRank::Hello`].
    Setup(Box<Setup>),
    /// Prefill: compute (fill) a request's KV into these blocks.
    Prefill {
        /// The transfer.
        transfer_id: TransferId,
        /// Its blocks, in request order.
        blocks: Vec<u32>,
    },
    /// Prefill: the engine registered the transfer on this rank (`EngineAction::Register`).
    Register {
        /// The transfer.
        transfer_id: TransferId,
        /// Releases this rank waits for.
        quorum: Quorum,
        /// The incarnation of the rank it was registered on.
        #[serde(default)]
        incarnation: Option<Incarnation>,
    },
    /// Prefill: another rank of the group was read and released (`EngineAction::GroupDone`).
    GroupDone {
        /// The transfer.
        transfer_id: TransferId,
    },
    /// Prefill: the engine freed the transfer (`EngineAction::Retire`).
    Retire {
        /// The transfer.
        transfer_id: TransferId,
        /// The incarnation of the rank it was registered on.
        #[serde(default)]
        incarnation: Option<Incarnation>,
    },
    /// Prefill: revoke remote access to these blocks (`EngineAction::Fence`).
    Fence {
        /// The transfer.
        transfer_id: TransferId,
        /// Its blocks.
        blocks: Vec<u32>,
    },
    /// Decode: a scheduler step begins.
    StepBegin {
        /// Step number, the same on every rank of the group.
        step: u64,
        /// Requests new at this step.
        requests: Vec<RecvRequest>,
    },
    /// Decode: requests the group's scheduler queued behind a full batch or pool; the ranks
    /// lease their KV until a step hands them over (`DecodeEvent::Queued`).
    Queued {
        /// The requests newly queued.
        requests: Vec<RecvRequest>,
    },
    /// Decode: queued requests the scheduler took back (`DecodeEvent::Dequeued`): the ranks
    /// stop renewing their leases.
    Dequeued {
        /// The requests taken back.
        requests: Vec<RequestId>,
    },
    /// Decode: the MIN of the group's votes for `step`.
    VoteResult {
        /// The step.
        step: u64,
        /// True when every rank voted ok.
        ok: bool,
    },
    /// Exit cleanly: close listeners, join threads, then reply [`FromRank::Bye`].
    Shutdown,
    /// The answer to a [`FromRank::Hello`] the scheduler does not admit (a wrong token, a rank
    /// that is already running); the connection closes after it.
    Refused {
        /// Why.
        reason: AdmitError,
    },
}

impl ToRank {
    /// The message's name, for reports.
    pub fn name(&self) -> &'static str {
        match self {
            ToRank::Setup(_) => "setup",
            ToRank::Prefill { .. } => "prefill",
            ToRank::Register { .. } => "register",
            ToRank::GroupDone { .. } => "group_done",
            ToRank::Retire { .. } => "retire",
            ToRank::Fence { .. } => "fence",
            ToRank::StepBegin { .. } => "step_begin",
            ToRank::Queued { .. } => "queued",
            ToRank::Dequeued { .. } => "dequeued",
            ToRank::VoteResult { .. } => "vote_result",
            ToRank::Shutdown => "shutdown",
            ToRank::Refused { .. } => "refused",
        }
    }
}

/// Rank to scheduler.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromRank {
    /// The first message: who the rank is (from its command line).
    Hello {
        /// The rank.
        rank: RankId,
        /// Its process id.
        pid: u32,
        /// The run's membership token, handed to the process at launch in
        /// [`TOKEN_ENV`]: proves the process was started by this run.
        token: String,
    },
    /// Listeners are bound and the data plane serves; or why not.
    Ready {
        /// The data-plane address peers read from (prefill), or `None` (decode).
        data_addr: Option<String>,
        /// Which memory holds the KV, in words (host, or a HIP device).
        memory: String,
        /// Prefill: the two payloads of the handshake reply it sends (metadata, then the layers'
        /// memory descriptors), or would have sent when data-plane only
        /// ([`Setup::data_plane_only`]): for the connector that plays its control plane, and to
        /// tell whose descriptors a foreign decode's read goes through.
        #[serde(default)]
        handshake: Option<[Vec<u8>; 2]>,
        /// Prefill: the incarnation the process drew at start and names in its handshake
        /// metadata (`None` for a rank whose engine follows rules without incarnations).
        #[serde(default)]
        incarnation: Option<Incarnation>,
    },
    /// The rank could not start; it exits after sending this.
    SetupFailed {
        /// Why.
        error: String,
    },
    /// Prefill: the request's KV is in its blocks.
    Prefilled {
        /// The transfer.
        transfer_id: TransferId,
    },
    /// Prefill: `WorkerAction::Finished`.
    Finished {
        /// The transfer.
        transfer_id: TransferId,
    },
    /// Prefill: `WorkerAction::Leased`; the lease ends `remaining_ns` after it was sent (clocks
    /// of two processes are not comparable, durations are).
    Leased {
        /// The transfer.
        transfer_id: TransferId,
        /// Time left on the lease.
        remaining_ns: u64,
    },
    /// Prefill: `WorkerAction::Refused`: a release or lease from outside the deployment (or
    /// forged) was refused before it touched anything.
    Refused {
        /// The transfer it named.
        transfer_id: TransferId,
        /// What it was.
        message: pdkv_core::prefill::Refused,
        /// Why it was refused (no MAC, or a wrong one).
        verdict: pdkv_core::auth::Verdict,
        /// The address it came from, if the socket knew it.
        from: Option<String>,
    },
    /// Prefill: `WorkerAction::LeaseCapped`: a lease longer than the deployment's transfer
    /// timeout was taken for that long only.
    LeaseCapped {
        /// The transfer.
        transfer_id: TransferId,
        /// The length asked for.
        asked_ms: u32,
    },
    /// Decode: `DecodeAction::CastVote`.
    Vote {
        /// The step.
        step: u64,
        /// Whether this rank's handshakes completed.
        ok: bool,
    },
    /// Decode: `DecodeAction::StepReady` (no error), or `StepFailed` with the core's error. The
    /// scheduler reports it to the group as the core says (`StepReport::failed`): a step failed
    /// with the whole group still enters the forward pass, one of this rank's own (a
    /// lazy-handshake divergence) raises and never does.
    StepDone {
        /// The step.
        step: u64,
        /// Why the step failed, if it did.
        error: Option<StepError>,
    },
    /// Decode: every read of a request arrived and verified.
    Received {
        /// The request.
        request: RequestId,
    },
    /// Decode: `DecodeAction::RequestFailed`: a request's KV cannot be received.
    RecvFailed {
        /// The request.
        request: RequestId,
        /// Why, the core's value.
        error: RecvError,
    },
    /// Decode: one read finished and its bytes verified.
    ReadVerified {
        /// The request read.
        request: RequestId,
        /// The layer, for a per-layer read.
        layer: Option<u16>,
        /// The prefill rank read.
        source: RankId,
        /// Bytes read.
        bytes: u64,
        /// How long the read took on the data plane, in microseconds.
        #[serde(default)]
        elapsed_us: u64,
    },
    /// Decode: a handshake dial ended (for metrics; the node got its result already).
    Dialled {
        /// The prefill rank dialled.
        peer: RankId,
        /// Whether both reply messages came and decoded.
        ok: bool,
        /// From the dial to the end of the reply, in microseconds.
        elapsed_us: u64,
    },
    /// Decode: a read returned bytes that differ from what prefill wrote.
    Mismatch(ReadMismatch),
    /// Prefill: `WorkerAction::Error`: the core itself reported an inconsistency (a rank's
    /// ledger refused what the engine sent), which makes the run a safety violation.
    ProtocolError {
        /// The rank whose ledger refused.
        rank: RankId,
        /// What the ledger said.
        error: LedgerError,
    },
    /// A driver's note worth a line in the report (a lost message, say); never a violation.
    Problem(RankProblem),
    /// The rank's fault layer lost, duplicated or delayed a control message it was asked to
    /// send; the report logs it and excuses what it can cause.
    MessageFault(MessageHit),
    /// Sent every [`HEARTBEAT_INTERVAL`] from a thread of its own, so that a stopped process
    /// (whose connection stays open) is told apart from a busy one.
    Heartbeat,
    /// Counters at shutdown, then the rank exits.
    Bye {
        /// Releases the node asked to send (decode) or counted (prefill).
        releases: u64,
        /// Control messages the fault layer lost, duplicated or delayed.
        messages_faulted: u64,
        /// Handshakes dialled (decode) or answered (prefill).
        handshakes: u64,
    },
}

/// Why the scheduler does not admit a connector's [`FromRank::Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdmitError {
    /// The hello carries no token: the process was not started by a run.
    NoToken,
    /// The hello carries another run's token.
    WrongToken,
    /// The run has no such rank.
    NoSuchRank(RankId),
    /// The rank is running as another process.
    AlreadyRunning {
        /// The rank.
        rank: RankId,
        /// The process the run started for it.
        running: u32,
        /// The process that said hello.
        pid: u32,
    },
    /// The process joined once already.
    JoinedAlready {
        /// The rank.
        rank: RankId,
        /// The process.
        pid: u32,
    },
}

impl fmt::Display for AdmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmitError::NoToken => write!(f, "no membership token (the run hands it out in {TOKEN_ENV})"),
            AdmitError::WrongToken => f.write_str("wrong membership token: not a process of this run"),
            AdmitError::NoSuchRank(rank) => write!(f, "this run has no rank {rank}"),
            AdmitError::AlreadyRunning { rank, running, pid } => {
                write!(f, "{rank} is already running as process {running}; process {pid} is not it")
            }
            AdmitError::JoinedAlready { rank, pid } => write!(f, "{rank} (process {pid}) has joined already"),
        }
    }
}

impl std::error::Error for AdmitError {}

/// Where a read's bytes differ from the pattern prefill wrote (`pattern::BlockKey`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadMismatch {
    /// The request read.
    pub request: RequestId,
    /// The layer.
    pub layer: u16,
    /// The block's place in the request's block list.
    pub block: u32,
    /// The block's id in the prefill rank's pool.
    pub block_id: u32,
    /// The prefill rank read.
    pub source: RankId,
    /// The first byte of the block that differs.
    pub byte: u64,
}

impl fmt::Display for ReadMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ReadMismatch { request, layer, block, block_id, source, byte } = self;
        write!(
            f,
            "{request} layer {layer} block {block} (id {block_id}) from {source} differs at byte {byte}"
        )
    }
}

/// What a rank's driver notes for the report beside its node: what went wrong around the node
/// (a socket, memory, a lost message), never in the protocol.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankProblem {
    /// The scheduler sent a message this rank's role does not take.
    Unexpected {
        /// The rank's role.
        role: Role,
        /// The message's name ([`ToRank::name`]).
        message: String,
    },
    /// Computing, fencing or retiring a transfer's KV blocks failed.
    Kv {
        /// What was being done.
        op: KvOp,
        /// The transfer.
        transfer_id: TransferId,
        /// Why, in the memory's or the data plane's words.
        error: String,
    },
    /// A release or lease was lost: its notify listener stayed unreachable.
    NotifyLost {
        /// The listener.
        endpoint: Endpoint,
    },
    /// A listener could not take a connection or a message; it serves on.
    Listener {
        /// Which listener.
        listener: Listener,
        /// Why, in the socket's or the wire's words.
        error: String,
    },
    /// The data-plane server did not shut down cleanly.
    DataServerShutdown {
        /// Why.
        error: String,
    },
}

impl fmt::Display for RankProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankProblem::Unexpected { role, message } => write!(f, "{} rank got {message}", role.name()),
            RankProblem::Kv { op, transfer_id, error } => write!(f, "{op} of {transfer_id}: {error}"),
            RankProblem::NotifyLost { endpoint } => {
                write!(f, "notify message to {endpoint} lost: listener unreachable")
            }
            RankProblem::Listener { listener, error } => write!(f, "{listener}: {error}"),
            RankProblem::DataServerShutdown { error } => write!(f, "data server shutdown: {error}"),
        }
    }
}

/// What a prefill rank was doing with a transfer's KV blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvOp {
    /// Computing it into its blocks ([`ToRank::Prefill`]).
    Prefill,
    /// Fencing its blocks again as the engine retired it ([`ToRank::Retire`]).
    Retire,
    /// Revoking remote access to its blocks ([`ToRank::Fence`]).
    Fence,
}

impl fmt::Display for KvOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvOp::Prefill => "prefill",
            KvOp::Retire => "retire",
            KvOp::Fence => "fence",
        })
    }
}

/// A prefill rank's listeners, as its problem lines name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Listener {
    /// Accepting a connection on either listener.
    Accept,
    /// The handshake listener's messages.
    Handshake,
    /// The notify listener's messages.
    Notify,
}

impl fmt::Display for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Listener::Accept => "listener",
            Listener::Handshake => "handshake listener",
            Listener::Notify => "notify listener",
        })
    }
}

/// Why a frame could not be read or written.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    Closed,
    /// An I/O error.
    Io(io::Error),
    /// A frame longer than the reader's limit ([`MAX_FRAME_BYTES`] at most).
    TooLong {
        /// The frame's length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The frame is not a valid message.
    Decode(String),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Closed => f.write_str("connection closed"),
            FrameError::Io(e) => write!(f, "i/o error: {e}"),
            FrameError::TooLong { len, max } => write!(f, "frame of {len} bytes is longer than {max}"),
            FrameError::Decode(e) => write!(f, "undecodable frame: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Writes one frame: a 4-byte big-endian length and the MessagePack value.
pub fn write_frame<T: Serialize>(w: &mut impl Write, value: &T) -> Result<(), FrameError> {
    let body = rmp_serde::to_vec_named(value).map_err(|e| FrameError::Decode(e.to_string()))?;
    let len = u32::try_from(body.len()).ok().filter(|&n| n <= MAX_FRAME_BYTES);
    let len = len.ok_or(FrameError::TooLong { len: u32::MAX, max: MAX_FRAME_BYTES })?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).map_err(FrameError::Io)?;
    w.flush().map_err(FrameError::Io)
}

/// Reads one frame written by [`write_frame`].
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    read_frame_within(r, MAX_FRAME_BYTES)
}

/// Reads one frame of at most `max` bytes (a hello from a connector not yet admitted is held
/// to [`MAX_HELLO_BYTES`]).
pub fn read_frame_within<T: DeserializeOwned>(r: &mut impl Read, max: u32) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(FrameError::Io(e)),
    }
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(FrameError::TooLong { len, max });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    rmp_serde::from_slice(&body).map_err(|e| FrameError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn frames_round_trip_and_bad_frames_are_typed_errors() {
        let msg = FromRank::Leased { transfer_id: TransferId::from_u128(5), remaining_ns: 42 };
        let mut buf = Vec::new();
        write_frame(&mut buf, &msg).unwrap();
        write_frame(&mut buf, &ToRank::Shutdown).unwrap();
        let mut r = Cursor::new(buf);
        assert_eq!(read_frame::<FromRank>(&mut r).unwrap(), msg);
        assert_eq!(read_frame::<ToRank>(&mut r).unwrap(), ToRank::Shutdown);
        assert!(matches!(read_frame::<ToRank>(&mut r), Err(FrameError::Closed)));

        let check = |bytes: &[u8], expected: &str| {
            let err = read_frame::<ToRank>(&mut Cursor::new(bytes.to_vec())).unwrap_err();
            assert!(err.to_string().starts_with(expected), "{err}");
        };
        check(&[0xff, 0xff, 0xff, 0xff], "frame of 4294967295 bytes is longer than 67108864");
        check(&[0, 0, 0, 2, 0x81, 0xc0], "undecodable frame");
        check(&[0, 0, 0, 9, 1], "i/o error");
        // A hello is held to its own limit.
        let long = read_frame_within::<FromRank>(&mut Cursor::new(vec![0, 0, 16, 1]), MAX_HELLO_BYTES);
        assert_eq!(long.unwrap_err().to_string(), "frame of 4097 bytes is longer than 4096");
    }

    /// The ranks send the core's own values: each reads back equal, and words as the core words
    /// it (the cluster's result quotes these texts).
    #[test]
    fn typed_reports_round_trip_with_the_core_wording() {
        use pdkv_core::handshake::HandshakeError;
        use pdkv_core::ids::EngineId;
        use pdkv_core::params::ParamsError;
        use pdkv_core::ports::SessionKey;
        use pdkv_core::routing::RoutingError;
        let rank = RankId::new(EngineId::prefill(0), 0, 1);
        let check = |msg: FromRank, text: &str| {
            let mut buf = Vec::new();
            write_frame(&mut buf, &msg).unwrap();
            let back = read_frame::<FromRank>(&mut Cursor::new(buf)).unwrap();
            assert_eq!(back, msg);
            let words = match back {
                FromRank::StepDone { error: Some(e), .. } => e.to_string(),
                FromRank::RecvFailed { error, .. } => error.to_string(),
                FromRank::Mismatch(m) => m.to_string(),
                FromRank::ProtocolError { rank, error } => format!("{rank}: {error}"),
                FromRank::Problem(p) => p.to_string(),
                other => format!("no words for {other:?}"),
            };
            assert_eq!(words, text);
        };
        let session = SessionKey("prefill-0:6301#1".into());
        let handshake = StepError::Handshake {
            session: session.clone(),
            error: HandshakeError::WrongEngine { expected: "a".into(), got: "b".into() },
        };
        check(
            FromRank::StepDone { step: 7, error: Some(handshake) },
            "handshake with prefill-0:6301#1: dialled engine a but b answered",
        );
        check(
            FromRank::StepDone { step: 7, error: Some(StepError::GroupHandshakeFailed { step: 7 }) },
            "step 7: a KV handshake failed on some worker of the TP group",
        );
        let params = ParamsError::OutOfRange { field: "remote_tp_size", value: 0, min: 1, max: 256 };
        check(
            FromRank::RecvFailed { request: RequestId(3), error: RecvError::Params(params) },
            "kv_transfer_params remote_tp_size = 0 is outside 1..=256",
        );
        let routing = RoutingError::ZeroSize { what: "prefill TP size".into() };
        check(
            FromRank::RecvFailed { request: RequestId(3), error: RecvError::Routing(routing.clone()) },
            &routing.to_string(),
        );
        let waited = RecvError::Timeout { waited_ns: 30_000_000_000 };
        check(
            FromRank::RecvFailed { request: RequestId(3), error: waited },
            "KV not received within 30000 ms",
        );
        check(
            FromRank::Mismatch(ReadMismatch {
                request: RequestId(3),
                layer: 2,
                block: 1,
                block_id: 40,
                source: rank,
                byte: 17,
            }),
            "req-3 layer 2 block 1 (id 40) from P0.dp0.tp1 differs at byte 17",
        );
        check(
            FromRank::ProtocolError { rank, error: LedgerError::Unknown(TransferId::new("tx-1")) },
            "P0.dp0.tp1: transfer tx-1 is not registered",
        );
        let cases = [
            (
                RankProblem::Unexpected { role: Role::Decode, message: "prefill".into() },
                "decode rank got prefill",
            ),
            (
                RankProblem::Kv {
                    op: KvOp::Fence,
                    transfer_id: TransferId::new("tx-1"),
                    error: "gone".into(),
                },
                "fence of tx-1: gone",
            ),
            (
                RankProblem::NotifyLost { endpoint: Endpoint { host: "127.0.0.1".into(), port: 9 } },
                "notify message to 127.0.0.1:9 lost: listener unreachable",
            ),
            (
                RankProblem::Listener { listener: Listener::Handshake, error: "bad".into() },
                "handshake listener: bad",
            ),
            (RankProblem::DataServerShutdown { error: "stuck".into() }, "data server shutdown: stuck"),
        ];
        for (problem, text) in cases {
            check(FromRank::Problem(problem), text);
        }
    }

    /// Frames pack structs as arrays, and `kv_transfer_params` leaves its last key out when it is
    /// absent: the shorter array must read back with the key absent, and the longer with it.
    #[test]
    fn transfer_params_round_trip_with_and_without_extensions() {
        use pdkv_core::params::{extension_names, KvTransferParams};
        for extensions in [None, extension_names(pdkv_core::wire::Extensions::ALL)] {
            let params = KvTransferParams {
                transfer_id: Some("tx-1".into()),
                remote_tp_size: Some(4),
                pdkv_extensions: extensions,
                ..KvTransferParams::default()
            };
            let mut buf = Vec::new();
            write_frame(&mut buf, &params).unwrap();
            assert_eq!(read_frame::<KvTransferParams>(&mut Cursor::new(buf)).unwrap(), params);
        }
    }
}
