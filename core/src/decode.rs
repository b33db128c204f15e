//! The decode worker node: one per decode rank; receives KV for the requests of each step.
//!
//! # How a driver calls it
//!
//! 1. Create one [`DecodeWorker`] per decode rank with its [`DecodeConfig`].
//! 2. At the start of every scheduler step, before the forward pass, call
//!    [`DecodeWorker::handle`] with [`DecodeEvent::StepBegin`] carrying the requests of the step
//!    whose KV lives on a prefill engine. Every worker of a TP group gets the same step number
//!    and the same requests.
//! 3. Carry out the returned [`DecodeAction`]s: dial handshakes, post reads, send releases,
//!    cast the step's vote into the group's barrier (the [`DecodeGroup`](crate::group::DecodeGroup)
//!    of the worker's DP group, which takes the MIN), and report step and request results to
//!    the scheduler (and the step's to the group).
//! 4. Feed back what happens as events: handshake reply parts or failures (keyed by the
//!    session key of the dial), the group's vote result, read completions, and
//!    [`DecodeEvent::Tick`] whenever the time returned by [`DecodeWorker::poll_timeout`] has
//!    come. Call `poll_timeout` again after every `handle`.
//! 5. A step ends for this worker with exactly one [`DecodeAction::StepReady`] or
//!    [`DecodeAction::StepFailed`]; only then may the driver enter the forward collective, and
//!    only then may it begin the next step.
//! 6. Answer every posted read with exactly one [`DecodeEvent::ReadDone`], also after
//!    [`DecodeAction::AbortReads`] asked to abort it (an aborted or flushed read is answered
//!    [`ReadOutcome::Aborted`] or [`ReadOutcome::Failed`]). The worker releases a transfer only
//!    once none of its reads can still complete: see [`crate::recv`] for the rule.
//!
//! # Handshake modes
//!
//! Eager (default): at step begin the worker dials every session the step needs that is not
//! complete, then votes ok or fail; the group's MIN decides, and on failure every worker reports
//! the same [`StepError::GroupHandshakeFailed`] for the step. Requests stay queued and the next
//! step redials. Lazy ([`Legacy::LazyHandshake`]): the worker blocks on the read path,
//! handshaking every DP rank of the remote engine one at a time; it reports the step only when
//! they are all done, while peers that needed no handshake report ready at once — the
//! divergence that leaves a TP collective waiting for its 600 s timeout. How a step goes is the
//! step machine of [`crate::step_machine`], whose table is checked in under `docs/machines/`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use crate::handshake::{
    self, HandshakeError, HandshakeEvent, HandshakeOutput, HandshakeParams, HandshakeState,
};
use crate::ids::{EngineId, RankId, RequestId, TransferId};
#[cfg(doc)]
use crate::legacy::Legacy;
use crate::params::{KvTransferParams, ParamsError};
use crate::policy::{HandshakeMode, NotifyRule, Policy, QueuedLease};
use crate::ports::{Endpoint, EngineAddress, ListenerKind, PortError, ReadTarget, SessionKey};
use crate::recv::{self, RecvEvent, RecvOutput, RecvState};
use crate::release::{Release, ReleaseSender};
use crate::routing::{self, ReadRouter, RoutingError};
use crate::step_machine::{self, StepEvent, StepOutput, StepState};
use crate::time::{earliest, Instant, NS_PER_MS, NS_PER_S};
use crate::topology::{Layout, ModelSpec};
use crate::wire::{HandshakeMetadata, LayerMemoryDesc, ReadLease};

/// Requests one worker holds at once; a step that would exceed it fails those requests.
pub const MAX_WORKER_REQUESTS: usize = 65_536;
/// Remote sessions one worker keeps.
pub const MAX_WORKER_SESSIONS: usize = 4096;

/// Whether a request's KV is read one layer at a time or all at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReadGranularity {
    /// One read per layer (MoRIIO's batching: reads overlap with the layers' compute).
    PerLayer,
    /// One read covering every layer.
    PerRequest,
}

/// Fixed facts and knobs of one decode worker.
#[derive(Clone, Debug, Hash)]
pub struct DecodeConfig {
    /// This worker's rank.
    pub rank: RankId,
    /// Its engine's layout (the TP size is the world size W of the routing rules).
    pub layout: Layout,
    /// The served model.
    pub model: ModelSpec,
    /// The protocol's rules (the fixed protocol, or the legacy options resolved).
    pub policy: Policy,
    /// This worker's MoRIIO engine id, sent as the sender of its releases.
    pub engine_id: String,
    /// Deadline of one handshake dial (10 s by default).
    pub handshake_timeout_ns: u64,
    /// How long a request may wait for its KV, from arrival to the last read (30 s default).
    pub transfer_timeout_ns: u64,
    /// First retry delay after a send-queue-full completion (1 ms); doubles each retry.
    pub backoff_initial_ns: u64,
    /// Largest retry delay (50 ms).
    pub backoff_cap_ns: u64,
    /// Per layer (default) or per request.
    pub granularity: ReadGranularity,
}

impl DecodeConfig {
    /// A worker with MoRIIO's defaults.
    pub fn new(rank: RankId, layout: Layout, model: ModelSpec, policy: Policy, engine_id: String) -> Self {
        DecodeConfig {
            rank,
            layout,
            model,
            policy,
            engine_id,
            handshake_timeout_ns: 10 * NS_PER_S,
            transfer_timeout_ns: 30 * NS_PER_S,
            backoff_initial_ns: NS_PER_MS,
            backoff_cap_ns: 50 * NS_PER_MS,
            granularity: ReadGranularity::PerLayer,
        }
    }
}

/// A request whose KV this worker must read, as the scheduler hands it over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvRequest {
    /// The proxy's request number.
    pub request: RequestId,
    /// The prefill engine that holds the KV (the driver maps `remote_engine_id` to it).
    pub prefill_engine: EngineId,
    /// Where that engine's ranks listen (from `remote_host` and the port bases).
    pub prefill_address: EngineAddress,
    /// The request's `kv_transfer_params` as the proxy forwarded them.
    pub params: KvTransferParams,
    /// Decode-side blocks the KV lands in, one per remote block.
    pub local_block_ids: Vec<u32>,
}

/// An input to the decode worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeEvent {
    /// A scheduler step begins, before its forward pass.
    StepBegin {
        /// Step number, increasing, identical across the TP group.
        step: u64,
        /// Requests of this step that need remote KV (new ones; queued ones are kept).
        requests: Vec<RecvRequest>,
    },
    /// Requests the engine queued for a later step (its batch or its KV pool is full). The
    /// worker routes them now and keeps their source rank leased until they arrive in a
    /// [`DecodeEvent::StepBegin`], so the producer's reaper does not free KV a queued request
    /// will read. Their `local_block_ids` may still be empty; a request the worker cannot route
    /// is left alone (it fails when it is admitted).
    Queued {
        /// The queued requests, in queue order.
        requests: Vec<RecvRequest>,
    },
    /// The first handshake reply frame from the rank dialled under `session`.
    HandshakeMetadata {
        /// The session key of the dial.
        session: SessionKey,
        /// The metadata.
        metadata: HandshakeMetadata,
    },
    /// The second handshake reply frame.
    HandshakeDescriptors {
        /// The session key of the dial.
        session: SessionKey,
        /// Memory descriptors per layer.
        layers: Vec<LayerMemoryDesc>,
    },
    /// The transport could not reach the remote handshake listener.
    HandshakeFailed {
        /// The session key of the dial.
        session: SessionKey,
        /// What the transport said.
        reason: String,
    },
    /// The MIN over the TP group's votes for `step` (eager mode).
    VoteResult {
        /// The step voted on.
        step: u64,
        /// True when every worker voted ok.
        ok: bool,
    },
    /// A posted read finished.
    ReadDone {
        /// The request read.
        request: RequestId,
        /// The layer, for per-layer reads.
        layer: Option<u16>,
        /// How it ended.
        outcome: ReadOutcome,
    },
    /// The time from [`DecodeWorker::poll_timeout`] has come.
    Tick,
}

/// How a read ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Every byte arrived.
    Ok,
    /// The read failed (remote access error, peer gone); the KV is lost.
    Failed(String),
    /// The send queue was full; the read was not posted and may be retried.
    SendQueueFull,
    /// The read was aborted at the worker's request ([`DecodeAction::AbortReads`]) or flushed,
    /// and will touch no memory any more.
    Aborted,
}

/// What every read of one request shares: where from and which blocks. Built once per request
/// and shared by its per-layer reads (a per-layer read of a long prompt would otherwise copy the
/// ids, the transfer id and the session key once per layer).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadPlan {
    /// The request read.
    pub request: RequestId,
    /// Its transfer id.
    pub transfer_id: TransferId,
    /// The prefill rank read (the chosen source).
    pub source: RankId,
    /// The session whose memory descriptors the reads use.
    pub session: SessionKey,
    /// Remote base address of every layer of the source rank.
    pub remote_bases: Vec<u64>,
    /// Bytes per block in the remote region.
    pub block_len: u64,
    /// Remote (prefill) block ids.
    pub remote_block_ids: Arc<[u32]>,
    /// Local (decode) block ids, one per remote block.
    pub local_block_ids: Arc<[u32]>,
}

/// One read to post: a request's plan and the layers this read covers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReadOp {
    /// The request's shared read plan.
    pub plan: Arc<ReadPlan>,
    /// The layer for a per-layer read, `None` for a read of every layer.
    pub layer: Option<u16>,
    /// The layers this read covers: indices into `plan.remote_bases`.
    pub layers: Range<usize>,
}

impl ReadOp {
    /// The request read.
    pub fn request(&self) -> RequestId {
        self.plan.request
    }

    /// Total bytes the read moves.
    pub fn bytes(&self) -> u64 {
        self.layers.len() as u64 * self.plan.remote_block_ids.len() as u64 * self.plan.block_len
    }

    /// Remote address of the first byte this read touches.
    pub fn first_address(&self) -> u64 {
        self.plan.remote_bases[self.layers.start]
    }

    /// Remote byte ranges `(address, length)`, contiguous blocks merged, layer by layer.
    pub fn remote_ranges(&self) -> Vec<(u64, u64)> {
        let plan = &self.plan;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &base in &plan.remote_bases[self.layers.clone()] {
            let mut run: Option<(u64, u64)> = None;
            for &block in plan.remote_block_ids.iter() {
                let addr = base + u64::from(block) * plan.block_len;
                run = match run {
                    Some((start, len)) if start + len == addr => Some((start, len + plan.block_len)),
                    Some(done) => {
                        out.push(done);
                        Some((addr, plan.block_len))
                    }
                    None => Some((addr, plan.block_len)),
                };
            }
            out.extend(run);
        }
        out
    }
}

/// Why a whole step failed on this worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepError {
    /// Eager mode: some worker of the group could not complete a handshake; every worker of
    /// the group reports exactly this value for the step.
    GroupHandshakeFailed {
        /// The step.
        step: u64,
    },
    /// Legacy only ([`HandshakeMode::Lazy`], `lazy-handshake`): this worker's own blocking
    /// handshake failed (its peers may be in the forward collective already).
    Handshake {
        /// The session that failed.
        session: SessionKey,
        /// Why.
        error: HandshakeError,
    },
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::GroupHandshakeFailed { step } => {
                write!(f, "step {step}: a KV handshake failed on some worker of the TP group")
            }
            StepError::Handshake { session, error } => write!(f, "handshake with {session}: {error}"),
        }
    }
}

/// Why one request's KV could not be received.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RecvError {
    /// Its `kv_transfer_params` are unusable.
    Params(ParamsError),
    /// The routing rules reject the pair.
    Routing(RoutingError),
    /// The source rank's port does not fit in 16 bits.
    Port(PortError),
    /// `transfer_id` is missing from the parameters.
    MissingTransferId,
    /// Remote and local block lists differ in length.
    BlockCountMismatch {
        /// Remote block ids.
        remote: usize,
        /// Local block ids.
        local: usize,
    },
    /// A remote block id is beyond the source rank's pool (e.g. reading another DP rank's ids).
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks the source rank has.
        num_blocks: u32,
    },
    /// A remote block id in the parameters does not fit in 32 bits.
    BlockIdTooLarge(u64),
    /// The session metadata has no memory region at all.
    NoRegions,
    /// A read failed.
    ReadFailed(String),
    /// The KV did not arrive within `transfer_timeout`.
    Timeout {
        /// How long the request waited, in nanoseconds.
        waited_ns: u64,
    },
    /// The worker holds [`MAX_WORKER_REQUESTS`] already.
    TooManyRequests,
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvError::Params(e) => write!(f, "{e}"),
            RecvError::Routing(e) => write!(f, "{e}"),
            RecvError::Port(e) => write!(f, "{e}"),
            RecvError::MissingTransferId => write!(f, "kv_transfer_params lacks transfer_id"),
            RecvError::BlockCountMismatch { remote, local } => {
                write!(f, "{remote} remote blocks but {local} local blocks")
            }
            RecvError::BlockOutOfRange { block, num_blocks } => {
                write!(f, "remote block {block} is beyond the source's {num_blocks} blocks")
            }
            RecvError::BlockIdTooLarge(block) => write!(f, "remote block id {block} does not fit in 32 bits"),
            RecvError::NoRegions => write!(f, "the source announced no memory region"),
            RecvError::ReadFailed(reason) => write!(f, "read failed: {reason}"),
            RecvError::Timeout { waited_ns } => {
                write!(f, "KV not received within {} ms", waited_ns / NS_PER_MS)
            }
            RecvError::TooManyRequests => write!(f, "more than {MAX_WORKER_REQUESTS} requests queued"),
        }
    }
}

impl std::error::Error for RecvError {}

/// What the worker asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeAction {
    /// Send the handshake request to `endpoint`; deliver the reply parts tagged `session`.
    DialHandshake {
        /// The session key the reply must be delivered under.
        session: SessionKey,
        /// The remote rank dialled.
        rank: RankId,
        /// Its handshake listener.
        endpoint: Endpoint,
    },
    /// Post one read.
    PostRead(ReadOp),
    /// Abort every read of `request` still posted (over verbs: move the queue pair to the error
    /// state and drain the flushed completions). Each of them must still be answered with one
    /// [`DecodeEvent::ReadDone`]; the release waits for those answers.
    AbortReads {
        /// The request whose reads to abort.
        request: RequestId,
    },
    /// Send a release to a prefill rank's notify listener.
    SendRelease {
        /// The rank the release is meant for.
        rank: RankId,
        /// Its notify listener.
        endpoint: Endpoint,
        /// The message.
        release: Release,
    },
    /// Send a read lease to the rank this worker will read, when it takes the request: the
    /// producer keeps the blocks (and does not reap them) until the lease ends, which covers the
    /// handshake and every read, since the request fails (and releases) at its deadline.
    SendLease {
        /// The rank read.
        rank: RankId,
        /// Its notify listener.
        endpoint: Endpoint,
        /// The lease.
        lease: ReadLease,
    },
    /// Contribute to the TP group's MIN vote for `step`.
    CastVote {
        /// The step.
        step: u64,
        /// Whether this worker's handshakes all completed.
        ok: bool,
    },
    /// This worker may enter the forward pass of `step`.
    StepReady {
        /// The step.
        step: u64,
    },
    /// The step failed on this worker with this error.
    StepFailed {
        /// The step.
        step: u64,
        /// Why.
        error: StepError,
    },
    /// All of a request's KV arrived.
    RequestReceived {
        /// The request.
        request: RequestId,
    },
    /// A request's KV cannot be received; its local blocks are invalid (recompute).
    RequestFailed {
        /// The request.
        request: RequestId,
        /// Why.
        error: RecvError,
    },
    /// The local blocks of a failed request hold no valid KV.
    InvalidateBlocks {
        /// The request.
        request: RequestId,
        /// Its local blocks.
        block_ids: Vec<u32>,
    },
}

/// A session the worker knows: its handshake machine and where it points.
#[derive(Clone, Debug, Hash)]
struct SessionEntry {
    rank: RankId,
    endpoint: Endpoint,
    params: HandshakeParams,
    state: HandshakeState,
}

/// Where one request is.
#[derive(Clone, Debug, Hash)]
enum RecvPhase {
    /// Waiting for its session (and, in eager mode, the step's vote).
    AwaitingSession,
    /// Reads posted; `outstanding` lists the layers (or `None`) not done yet; `ops` are the
    /// reads as posted, kept for retries (the session may be dropped meanwhile by another
    /// request's failed read, but these reads' memory keys were taken when they were posted).
    Reading { outstanding: BTreeSet<Option<u16>>, retries: BTreeMap<Option<u16>, Retry>, ops: Vec<ReadOp> },
    /// Failed with reads posted: they were aborted, and `in_flight` lists the ones whose answer
    /// is still owed; the release (reporting `error`) waits for them.
    Draining { in_flight: BTreeSet<Option<u16>>, error: RecvError },
}

impl RecvPhase {
    /// The phase as the request machine of [`crate::recv`] sees it.
    fn machine(&self) -> RecvState {
        match self {
            RecvPhase::AwaitingSession => RecvState::AwaitingSession,
            RecvPhase::Reading { outstanding, retries, .. } => {
                let retrying = retries.values().filter(|r| r.due.is_some()).count();
                RecvState::Reading {
                    in_flight: (outstanding.len() - retrying) as u32,
                    retrying: retrying as u32,
                }
            }
            RecvPhase::Draining { in_flight, .. } => {
                RecvState::Draining { in_flight: in_flight.len() as u32 }
            }
        }
    }

    /// Posted reads not answered yet (a read waiting for its retry is not posted).
    fn in_flight(&self) -> BTreeSet<Option<u16>> {
        match self {
            RecvPhase::AwaitingSession => BTreeSet::new(),
            RecvPhase::Reading { outstanding, retries, .. } => outstanding
                .iter()
                .filter(|l| retries.get(*l).is_none_or(|r| r.due.is_none()))
                .copied()
                .collect(),
            RecvPhase::Draining { in_flight, .. } => in_flight.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, Hash)]
struct Retry {
    attempts: u32,
    due: Option<Instant>,
}

#[derive(Clone, Debug, Hash)]
struct Recv {
    transfer_id: TransferId,
    target: ReadTarget,
    notify_rank: RankId,
    notify: Endpoint,
    remote_block_ids: Arc<[u32]>,
    local_block_ids: Arc<[u32]>,
    /// The prefill layout the parameters announced, and where that engine listens.
    remote: Layout,
    address: EngineAddress,
    deadline: Instant,
    arrived: Instant,
    phase: RecvPhase,
}

/// A request queued by the engine: routed, its source leased until admission.
#[derive(Clone, Debug, Hash)]
struct Waiting {
    recv: Recv,
    /// When to send the next lease.
    renew_at: Instant,
}

/// What the worker is doing for the current step: the step machine of [`crate::step_machine`]
/// with the sessions it counts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum StepProgress {
    /// No step in progress (the last one was reported).
    Idle,
    /// Eager: waiting for these sessions before voting.
    Handshaking { step: u64, waiting: BTreeSet<SessionKey> },
    /// Eager: vote cast, waiting for the group's result.
    Voting { step: u64 },
    /// Lazy: blocked in handshakes, dialling `queue` one at a time; its first is in flight.
    Blocked { step: u64, queue: VecDeque<SessionKey> },
}

impl StepProgress {
    /// The progress as the step machine sees it.
    fn machine(&self) -> StepState {
        match self {
            StepProgress::Idle => StepState::Idle,
            StepProgress::Handshaking { step, waiting } => {
                StepState::Handshaking { step: *step, waiting: waiting.len() as u32 }
            }
            StepProgress::Voting { step } => StepState::Voting { step: *step },
            StepProgress::Blocked { step, queue } => {
                StepState::Blocked { step: *step, left: queue.len() as u32 }
            }
        }
    }
}

/// The decode worker node. See the module documentation for the calling order.
#[derive(Clone, Debug, Hash)]
pub struct DecodeWorker {
    config: DecodeConfig,
    router: ReadRouter,
    sessions: BTreeMap<SessionKey, SessionEntry>,
    requests: BTreeMap<RequestId, Recv>,
    /// Requests queued by the engine, not admitted to a step yet.
    waiting: BTreeMap<RequestId, Waiting>,
    step: StepProgress,
}

impl DecodeWorker {
    /// A worker with no sessions and no requests.
    pub fn new(config: DecodeConfig) -> DecodeWorker {
        let router = ReadRouter::new(config.rank, config.layout, config.model.clone(), config.policy);
        DecodeWorker {
            config,
            router,
            sessions: BTreeMap::new(),
            requests: BTreeMap::new(),
            waiting: BTreeMap::new(),
            step: StepProgress::Idle,
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> RankId {
        self.config.rank
    }

    /// Requests waiting for or receiving KV.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Requests the engine queued that this worker keeps leased.
    pub fn queued_requests(&self) -> usize {
        self.waiting.len()
    }

    /// True while the worker is blocked in a lazy handshake (it cannot join a collective).
    pub fn is_blocked(&self) -> bool {
        matches!(self.step, StepProgress::Blocked { .. })
    }

    /// Sessions with a dial outstanding, and the rank each was dialled at, in key order (who this
    /// worker waits for, for a wait-for graph).
    pub fn waiting_sessions(&self) -> Vec<(SessionKey, RankId)> {
        self.sessions.iter().filter(|(_, s)| s.state.is_waiting()).map(|(k, s)| (k.clone(), s.rank)).collect()
    }

    /// The state of a session, if the worker knows it.
    pub fn session_state(&self, session: &SessionKey) -> Option<&HandshakeState> {
        self.sessions.get(session).map(|s| &s.state)
    }

    /// The earliest time the worker must be ticked, if any timer is armed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut next = None;
        for waiting in self.waiting.values() {
            next = earliest(next, Some(waiting.renew_at));
        }
        for entry in self.sessions.values() {
            next = earliest(next, entry.state.deadline());
        }
        for recv in self.requests.values() {
            if matches!(recv.phase, RecvPhase::Draining { .. }) {
                // Draining waits for the driver's answers only: no timer.
                continue;
            }
            next = earliest(next, Some(recv.deadline));
            if let RecvPhase::Reading { retries, .. } = &recv.phase {
                for retry in retries.values() {
                    next = earliest(next, retry.due);
                }
            }
        }
        next
    }

    /// Applies one event; actions are appended to `out` in the order they must be carried out.
    pub fn handle(&mut self, now: Instant, event: DecodeEvent, out: &mut Vec<DecodeAction>) {
        match event {
            DecodeEvent::StepBegin { step, requests } => self.on_step_begin(now, step, requests, out),
            DecodeEvent::Queued { requests } => self.on_queued(now, requests, out),
            DecodeEvent::HandshakeMetadata { session, metadata } => {
                self.on_handshake(now, session, HandshakeEvent::Metadata(metadata), out)
            }
            DecodeEvent::HandshakeDescriptors { session, layers } => {
                self.on_handshake(now, session, HandshakeEvent::Descriptors(layers), out)
            }
            DecodeEvent::HandshakeFailed { session, reason } => {
                self.on_handshake(now, session, HandshakeEvent::TransportFailed(reason), out)
            }
            DecodeEvent::VoteResult { step, ok } => {
                let before = self.step.machine();
                self.run_step(now, before, StepEvent::VoteResult { step, ok }, None, out);
            }
            DecodeEvent::ReadDone { request, layer, outcome } => {
                self.on_read_done(now, request, layer, outcome, out)
            }
            DecodeEvent::Tick => self.on_tick(now, out),
        }
    }

    fn on_step_begin(
        &mut self,
        now: Instant,
        step: u64,
        requests: Vec<RecvRequest>,
        out: &mut Vec<DecodeAction>,
    ) {
        assert_eq!(
            self.step,
            StepProgress::Idle,
            "{}: step {step} began before the last step was reported",
            self.rank()
        );
        for request in requests {
            let id = request.request;
            if self.requests.contains_key(&id) {
                continue;
            }
            if self.requests.len() >= MAX_WORKER_REQUESTS {
                self.waiting.remove(&id);
                self.fail_unrouted(id, &request.local_block_ids, RecvError::TooManyRequests, out);
                continue;
            }
            // A queued request was routed when it was queued: the flexible pick is made once.
            let admitted = match self.waiting.remove(&id) {
                Some(waiting) => Ok(waiting.recv),
                None => self.route(now, &request),
            };
            let admitted = admitted.and_then(|mut recv| {
                if recv.remote_block_ids.len() != request.local_block_ids.len() {
                    return Err(RecvError::BlockCountMismatch {
                        remote: recv.remote_block_ids.len(),
                        local: request.local_block_ids.len(),
                    });
                }
                recv.local_block_ids = request.local_block_ids.as_slice().into();
                recv.arrived = now;
                recv.deadline = now.add_ns(self.config.transfer_timeout_ns);
                Ok(recv)
            });
            match admitted {
                Ok(recv) => {
                    // Lease the transfer as soon as the worker takes the request: its handshake
                    // may take a while (a lost reply costs a handshake timeout and a step), and
                    // its reads end by its deadline at the latest, when it fails and releases.
                    out.push(self.lease(&recv));
                    self.requests.insert(id, recv);
                }
                Err(error) => self.fail_unrouted(id, &request.local_block_ids, error, out),
            }
        }
        // Sessions this step needs that are not complete, in key order.
        let needed: BTreeSet<SessionKey> = self
            .requests
            .values()
            .filter(|r| matches!(r.phase, RecvPhase::AwaitingSession))
            .map(|r| r.target.session.clone())
            .filter(|key| self.sessions.get(key).is_none_or(|s| s.state.session().is_none()))
            .collect();
        if self.config.policy.handshake == HandshakeMode::Lazy {
            let queue = self.lazy_queue(needed);
            let event = StepEvent::BeginLazy { step, sessions: queue.len() as u32 };
            self.step = StepProgress::Blocked { step, queue };
            self.run_step(now, StepState::Idle, event, None, out);
            return;
        }
        let mut waiting = BTreeSet::new();
        for key in needed {
            self.dial(now, &key, out);
            if self.sessions[&key].state.is_waiting() {
                waiting.insert(key);
            }
        }
        let event = StepEvent::Begin { step, dials: waiting.len() as u32 };
        self.step = StepProgress::Handshaking { step, waiting };
        self.run_step(now, StepState::Idle, event, None, out);
    }

    /// The lease of `recv`'s transfer at its source, for the transfer timeout.
    fn lease(&self, recv: &Recv) -> DecodeAction {
        let lease_ms = self.config.transfer_timeout_ns.div_ceil(NS_PER_MS).clamp(1, u64::from(u32::MAX));
        DecodeAction::SendLease {
            rank: recv.target.source,
            endpoint: recv.target.notify.clone(),
            lease: ReadLease { transfer_id: recv.transfer_id.clone(), lease_ms: lease_ms as u32 },
        }
    }

    /// How often a queued request's lease is renewed: half the lease, so a renewal delayed by up
    /// to half a lease still arrives before the previous one ends.
    fn renew_every_ns(&self) -> u64 {
        (self.config.transfer_timeout_ns / 2).max(NS_PER_MS)
    }

    fn on_queued(&mut self, now: Instant, requests: Vec<RecvRequest>, out: &mut Vec<DecodeAction>) {
        if self.config.policy.queued_lease == QueuedLease::Unleased {
            // The historical worker hears of a request only when a step admits it.
            return;
        }
        for request in requests {
            let id = request.request;
            if self.requests.contains_key(&id)
                || self.waiting.contains_key(&id)
                || self.waiting.len() >= MAX_WORKER_REQUESTS
            {
                continue;
            }
            if let Ok(recv) = self.route(now, &request) {
                out.push(self.lease(&recv));
                let renew_at = now.add_ns(self.renew_every_ns());
                self.waiting.insert(id, Waiting { recv, renew_at });
            }
        }
    }

    /// Renews the leases of queued requests that are due.
    fn renew_leases(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        let due: Vec<RequestId> =
            self.waiting.iter().filter(|(_, w)| w.renew_at <= now).map(|(id, _)| *id).collect();
        let every = self.renew_every_ns();
        for id in due {
            let lease = self.lease(&self.waiting[&id].recv);
            out.push(lease);
            self.waiting.get_mut(&id).expect("listed above").renew_at = now.add_ns(every);
        }
    }

    /// Resolves the source of a request and derives every address from it, without looking at
    /// its local blocks (a queued request has none yet).
    fn route(&mut self, now: Instant, request: &RecvRequest) -> Result<Recv, RecvError> {
        let policy = self.config.policy;
        let params = &request.params;
        let transfer_id = TransferId(params.transfer_id.clone().ok_or(RecvError::MissingTransferId)?);
        let remote = params.prefill_layout(policy.tp_size).map_err(RecvError::Params)?;
        let owner = params.owner_dp().map_err(RecvError::Params)?;
        let remote_block_ids: Vec<u32> = params
            .remote_block_ids
            .iter()
            .map(|&b| u32::try_from(b).map_err(|_| RecvError::BlockIdTooLarge(b)))
            .collect::<Result<_, _>>()?;
        let source =
            self.router.resolve(request.prefill_engine, remote, owner).map_err(RecvError::Routing)?;
        let address = &request.prefill_address;
        let target = ReadTarget::for_engine(address, remote, source.rank, policy.session_key)
            .map_err(RecvError::Port)?;
        let notify_rank = match policy.notify {
            NotifyRule::RankRead => target.source,
            NotifyRule::Recomputed => {
                // The historical release path recomputed its target without the owner DP rank
                // and without the flexible pick, so it could notify a rank other than the one read.
                let tp = routing::fixed_tp_source(self.config.layout.tp, self.config.rank.tp, remote.tp)
                    .map_err(RecvError::Routing)?;
                RankId::new(source.rank.engine, 0, tp)
            }
        };
        let notify = if notify_rank == target.source {
            target.notify.clone()
        } else {
            address.dial(remote, notify_rank, ListenerKind::Notify).map_err(RecvError::Port)?
        };
        self.ensure_session(&target, address);
        Ok(Recv {
            transfer_id,
            target,
            notify_rank,
            notify,
            remote_block_ids: remote_block_ids.into(),
            local_block_ids: request.local_block_ids.as_slice().into(),
            remote,
            address: address.clone(),
            deadline: now.add_ns(self.config.transfer_timeout_ns),
            arrived: now,
            phase: RecvPhase::AwaitingSession,
        })
    }

    /// A request that failed before it had a source: no release can be addressed; the producer's
    /// reaper frees its blocks.
    fn fail_unrouted(
        &mut self,
        request: RequestId,
        blocks: &[u32],
        error: RecvError,
        out: &mut Vec<DecodeAction>,
    ) {
        out.push(DecodeAction::InvalidateBlocks { request, block_ids: blocks.to_vec() });
        out.push(DecodeAction::RequestFailed { request, error });
    }

    /// Dials `key` unless a dial is outstanding or the session is complete.
    fn dial(&mut self, now: Instant, key: &SessionKey, out: &mut Vec<DecodeAction>) {
        let Some(entry) = self.sessions.get_mut(key) else { return };
        let state = std::mem::replace(&mut entry.state, HandshakeState::Idle);
        let (next, output) = handshake::step(state, HandshakeEvent::Dial, now, &entry.params);
        entry.state = next;
        if output == HandshakeOutput::SendRequest {
            out.push(DecodeAction::DialHandshake {
                session: key.clone(),
                rank: entry.rank,
                endpoint: entry.endpoint.clone(),
            });
        }
    }

    /// Lazy: the sessions a step handshakes one after another, in order.
    fn lazy_queue(&mut self, needed: BTreeSet<SessionKey>) -> VecDeque<SessionKey> {
        // The historical read path handshook every DP rank of each remote engine it had not met,
        // one after another on one executor, at the TP rank it reads.
        let mut queue: VecDeque<SessionKey> = VecDeque::new();
        let engines: BTreeMap<(EngineId, u16), (Layout, EngineAddress)> = self
            .requests
            .values()
            .filter(|r| needed.contains(&r.target.session))
            .map(|r| ((r.target.source.engine, r.target.source.tp), (r.remote, r.address.clone())))
            .collect();
        for ((engine, tp), (remote, address)) in engines {
            for dp in 0..remote.dp {
                let rank = RankId::new(engine, dp, tp);
                let Ok(target) =
                    ReadTarget::for_engine(&address, remote, rank, self.config.policy.session_key)
                else {
                    continue;
                };
                self.ensure_session(&target, &address);
                let key = target.session;
                if !queue.contains(&key) && self.sessions[&key].state.session().is_none() {
                    queue.push_back(key);
                }
            }
        }
        queue
    }

    /// Registers the session of `target` if the worker does not know it yet.
    fn ensure_session(&mut self, target: &ReadTarget, address: &EngineAddress) {
        if self.sessions.contains_key(&target.session) || self.sessions.len() >= MAX_WORKER_SESSIONS {
            return;
        }
        let entry = SessionEntry {
            rank: target.source,
            endpoint: target.handshake.clone(),
            params: HandshakeParams {
                expected_engine_id: address.engine_id(),
                timeout_ns: self.config.policy.handshake_timeout.of(self.config.handshake_timeout_ns),
            },
            state: HandshakeState::Idle,
        };
        self.sessions.insert(target.session.clone(), entry);
    }

    fn on_handshake(
        &mut self,
        now: Instant,
        key: SessionKey,
        event: HandshakeEvent,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(entry) = self.sessions.get_mut(&key) else { return };
        let state = std::mem::replace(&mut entry.state, HandshakeState::Idle);
        let (next, output) = handshake::step(state, event, now, &entry.params);
        entry.state = next;
        self.after_handshake(now, key, output, out);
    }

    /// Tells the step machine about a resolved handshake the step waits for.
    fn after_handshake(
        &mut self,
        now: Instant,
        key: SessionKey,
        output: HandshakeOutput,
        out: &mut Vec<DecodeAction>,
    ) {
        let failed = match output {
            HandshakeOutput::Completed => None,
            HandshakeOutput::Failed(error) => Some(error),
            _ => return,
        };
        let before = self.step.machine();
        let event = if failed.is_some() { StepEvent::HandshakeFailed } else { StepEvent::HandshakeDone };
        let waited_for = match &mut self.step {
            StepProgress::Handshaking { waiting, .. } => waiting.remove(&key),
            StepProgress::Blocked { queue, .. } if queue.front() == Some(&key) => {
                queue.pop_front();
                true
            }
            _ => false,
        };
        if waited_for {
            let failure = failed.map(|error| StepError::Handshake { session: key, error });
            self.run_step(now, before, event, failure, out);
        }
    }

    /// Eager: whether every session this worker's waiting requests need is complete.
    fn vote_ok(&self) -> bool {
        self.requests
            .values()
            .filter(|r| matches!(r.phase, RecvPhase::AwaitingSession))
            .all(|r| self.sessions.get(&r.target.session).is_some_and(|s| s.state.session().is_some()))
    }

    /// Runs the step machine of [`crate::step_machine`] for one event whose effect on the
    /// sessions the caller has applied already (`before` is the machine's state before it), and
    /// carries out its output; `failure` is why the step fails, for an event that raises.
    fn run_step(
        &mut self,
        now: Instant,
        mut before: StepState,
        mut event: StepEvent,
        mut failure: Option<StepError>,
        out: &mut Vec<DecodeAction>,
    ) {
        loop {
            let (after, output) = step_machine::step(before, event);
            match output {
                StepOutput::None | StepOutput::Ignored => {}
                StepOutput::OutOfOrder => unreachable!("a step begins only on an idle worker"),
                StepOutput::CastVote { step } => {
                    let ok = self.vote_ok();
                    self.step = StepProgress::Voting { step };
                    out.push(DecodeAction::CastVote { step, ok });
                }
                StepOutput::DialNext { .. } => {
                    let StepProgress::Blocked { queue, .. } = &self.step else {
                        unreachable!("the machine dials only while blocked")
                    };
                    let key = queue.front().expect("blocked with sessions left").clone();
                    self.dial(now, &key, out);
                    if !self.sessions.get(&key).is_some_and(|s| s.state.is_waiting()) {
                        // The session needed no dial after all (it is complete): on to the next.
                        if let StepProgress::Blocked { queue, .. } = &mut self.step {
                            queue.pop_front();
                        }
                        (before, event) = (after, StepEvent::HandshakeDone);
                        continue;
                    }
                }
                // Reads of requests whose sessions are complete start whatever the step's outcome:
                // reads never block the step, so they cannot make the group diverge, and holding
                // them back while a dead peer's dial fails step after step would starve every
                // request of the group until its deadline (found by killing a prefill process
                // under `pdkv cluster`).
                StepOutput::Ready { step } => {
                    self.step = StepProgress::Idle;
                    self.post_ready_reads(out);
                    out.push(DecodeAction::StepReady { step });
                }
                StepOutput::FailedWithGroup { step } => {
                    self.step = StepProgress::Idle;
                    self.post_ready_reads(out);
                    let error = StepError::GroupHandshakeFailed { step };
                    out.push(DecodeAction::StepFailed { step, error });
                }
                StepOutput::Raised { step } => {
                    self.step = StepProgress::Idle;
                    let error = failure.take().expect("a raising event carries its error");
                    out.push(DecodeAction::StepFailed { step, error });
                }
            }
            // The worker's own bookkeeping must agree with the machine (the table is the spec).
            debug_assert_eq!(self.step.machine(), after, "{before:?} + {event:?}");
            return;
        }
    }

    /// Posts the reads of every request whose session is complete.
    fn post_ready_reads(&mut self, out: &mut Vec<DecodeAction>) {
        let ready: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.phase, RecvPhase::AwaitingSession))
            .filter(|(_, r)| {
                self.sessions.get(&r.target.session).is_some_and(|s| s.state.session().is_some())
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ready {
            let before = RecvState::AwaitingSession;
            match self.read_ops(id) {
                Ok(ops) => {
                    let outstanding = ops.iter().map(|op| op.layer).collect();
                    let recv = self.requests.get_mut(&id).expect("listed above");
                    recv.phase =
                        RecvPhase::Reading { outstanding, retries: BTreeMap::new(), ops: ops.clone() };
                    let posted = RecvEvent::ReadsPosted(ops.len() as u32);
                    if self.transition(id, before, posted, None, out) == RecvOutput::PostReads {
                        out.extend(ops.into_iter().map(DecodeAction::PostRead));
                    }
                }
                Err(error) => {
                    self.transition(id, before, RecvEvent::Unreadable, Some(error), out);
                }
            }
        }
    }

    /// The reads of one request, from its session's metadata.
    fn read_ops(&self, id: RequestId) -> Result<Vec<ReadOp>, RecvError> {
        let recv = &self.requests[&id];
        let session = self.sessions[&recv.target.session].state.session().expect("session complete");
        let meta = &session.metadata;
        if meta.kv_caches_base_addr.is_empty() {
            return Err(RecvError::NoRegions);
        }
        if let Some(&block) = recv.remote_block_ids.iter().find(|&&b| b >= meta.num_blocks) {
            return Err(RecvError::BlockOutOfRange { block, num_blocks: meta.num_blocks });
        }
        let plan = Arc::new(ReadPlan {
            request: id,
            transfer_id: recv.transfer_id.clone(),
            source: recv.target.source,
            session: recv.target.session.clone(),
            remote_bases: meta.kv_caches_base_addr.clone(),
            block_len: meta.block_len,
            remote_block_ids: recv.remote_block_ids.clone(),
            local_block_ids: recv.local_block_ids.clone(),
        });
        let layers = plan.remote_bases.len();
        let op =
            |layer: Option<u16>, range: Range<usize>| ReadOp { plan: plan.clone(), layer, layers: range };
        Ok(match self.config.granularity {
            ReadGranularity::PerRequest => vec![op(None, 0..layers)],
            ReadGranularity::PerLayer => (0..layers).map(|l| op(Some(l as u16), l..l + 1)).collect(),
        })
    }

    fn on_read_done(
        &mut self,
        now: Instant,
        id: RequestId,
        layer: Option<u16>,
        outcome: ReadOutcome,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(recv) = self.requests.get_mut(&id) else { return };
        // Only a posted read that has not been answered yet can be answered.
        if !recv.phase.in_flight().contains(&layer) {
            return;
        }
        let before = recv.phase.machine();
        let deadline = recv.deadline;
        let waited_ns = now.since_ns(recv.arrived);
        let session = recv.target.session.clone();
        let mut stale = None;
        let (event, error) = match &mut recv.phase {
            RecvPhase::AwaitingSession => unreachable!("no read is in flight before the session"),
            RecvPhase::Draining { in_flight, .. } => {
                in_flight.remove(&layer);
                (RecvEvent::ReadFailed, None)
            }
            RecvPhase::Reading { outstanding, retries, .. } => match outcome {
                ReadOutcome::Ok => {
                    outstanding.remove(&layer);
                    retries.remove(&layer);
                    (RecvEvent::ReadOk, None)
                }
                ReadOutcome::Failed(reason) => {
                    outstanding.remove(&layer);
                    retries.remove(&layer);
                    stale = Some(reason.clone());
                    (RecvEvent::ReadFailed, Some(RecvError::ReadFailed(reason)))
                }
                ReadOutcome::Aborted => {
                    // Nobody asked for this abort (the request is not draining): the read is
                    // lost all the same.
                    outstanding.remove(&layer);
                    retries.remove(&layer);
                    (RecvEvent::ReadFailed, Some(RecvError::ReadFailed("read aborted".into())))
                }
                ReadOutcome::SendQueueFull => {
                    let retry = retries.entry(layer).or_insert(Retry { attempts: 0, due: None });
                    let shift = retry.attempts.min(20);
                    let delay = (self.config.backoff_initial_ns << shift).min(self.config.backoff_cap_ns);
                    retry.attempts += 1;
                    let due = now.add_ns(delay);
                    retry.due = Some(due);
                    self.transition(id, before, RecvEvent::ReadRefused, None, out);
                    if due > deadline {
                        // The retry would come after the deadline: fail now.
                        let before = self.requests[&id].phase.machine();
                        let error = RecvError::Timeout { waited_ns };
                        self.transition(id, before, RecvEvent::Deadline, Some(error), out);
                    }
                    return;
                }
            },
        };
        if let Some(reason) = stale {
            // The session may be stale (the remote rank restarted and its memory keys are
            // gone): the handshake machine drops it, so the next step that needs the rank
            // handshakes again.
            self.on_handshake(now, session, HandshakeEvent::ReadFailed(reason), out);
        }
        self.transition(id, before, event, error, out);
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        self.renew_leases(now, out);
        let due_sessions: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.state.deadline().is_some_and(|d| d <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due_sessions {
            self.on_handshake(now, key, HandshakeEvent::Tick, out);
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            let Some(recv) = self.requests.get_mut(&id) else { continue };
            if matches!(recv.phase, RecvPhase::Draining { .. }) {
                continue;
            }
            if recv.deadline <= now {
                let before = recv.phase.machine();
                let error = RecvError::Timeout { waited_ns: now.since_ns(recv.arrived) };
                self.transition(id, before, RecvEvent::Deadline, Some(error), out);
                continue;
            }
            let RecvPhase::Reading { retries, .. } = &recv.phase else { continue };
            let due: Vec<Option<u16>> =
                retries.iter().filter(|(_, r)| r.due.is_some_and(|d| d <= now)).map(|(l, _)| *l).collect();
            for layer in due {
                let before = self.requests[&id].phase.machine();
                let recv = self.requests.get_mut(&id).expect("listed above");
                let RecvPhase::Reading { retries, ops, .. } = &mut recv.phase else { break };
                retries.get_mut(&layer).expect("listed above").due = None;
                let op =
                    ops.iter().find(|op| op.layer == layer).expect("retries are of posted reads").clone();
                self.transition(id, before, RecvEvent::RetryPosted, None, out);
                out.push(DecodeAction::PostRead(op));
            }
        }
    }

    /// Runs the request machine of [`crate::recv`] for one event whose effect on the request's
    /// reads the caller has applied already, and carries out its output. `before` is the
    /// machine's state before the event; `error` is why the request fails, for events that fail
    /// it. Returns the machine's output.
    fn transition(
        &mut self,
        id: RequestId,
        before: RecvState,
        event: RecvEvent,
        error: Option<RecvError>,
        out: &mut Vec<DecodeAction>,
    ) -> RecvOutput {
        let (after, output) = recv::step(before, event, self.config.policy.drain);
        let recv = self.requests.get_mut(&id).expect("transitions are of held requests");
        match output {
            RecvOutput::None | RecvOutput::Ignored | RecvOutput::PostReads => {}
            RecvOutput::Abort => {
                let in_flight = recv.phase.in_flight();
                let error = error.expect("a failing event carries its error");
                recv.phase = RecvPhase::Draining { in_flight, error };
                out.push(DecodeAction::AbortReads { request: id });
            }
            RecvOutput::Release { received: true } => self.finish_request(id, None, out),
            RecvOutput::Release { received: false } => {
                let error = match &recv.phase {
                    RecvPhase::Draining { error, .. } => error.clone(),
                    _ => error.expect("a failing event carries its error"),
                };
                self.finish_request(id, Some(error), out);
            }
        }
        // The worker's own bookkeeping must agree with the machine (the table is the spec).
        match self.requests.get(&id) {
            Some(recv) => debug_assert_eq!(recv.phase.machine(), after, "{id}: {before:?} + {event:?}"),
            None => debug_assert_eq!(after, RecvState::Ended, "{id}: {before:?} + {event:?}"),
        }
        output
    }

    /// The request's reads all completed: release the source and report it received.
    fn finish_request(&mut self, id: RequestId, error: Option<RecvError>, out: &mut Vec<DecodeAction>) {
        let recv = self.requests.remove(&id).expect("caller checked");
        out.push(DecodeAction::SendRelease {
            rank: recv.notify_rank,
            endpoint: recv.notify.clone(),
            release: Release {
                transfer_id: recv.transfer_id.clone(),
                consumer_tp_size: Some(self.config.layout.tp),
                sender: Some(ReleaseSender {
                    engine_id: self.config.engine_id.clone(),
                    dp_rank: self.config.rank.dp,
                    tp_rank: self.config.rank.tp,
                }),
            },
        });
        match error {
            None => out.push(DecodeAction::RequestReceived { request: id }),
            Some(error) => {
                out.push(DecodeAction::InvalidateBlocks {
                    request: id,
                    block_ids: recv.local_block_ids.to_vec(),
                });
                out.push(DecodeAction::RequestFailed { request: id, error });
            }
        }
    }
}
