//! What goes in and out of the decode worker: the requests a scheduler hands over, the events a
//! driver feeds, how a read ended, and the actions the worker asks its driver to carry out.

use crate::ids::{EngineId, RankId, RequestId};
use crate::params::KvTransferParams;
use crate::ports::{Endpoint, EngineAddress, SessionKey};
use crate::release::Release;
use crate::wire::{HandshakeMetadata, LayerMemoryDesc, ReadLease};
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::DecodeWorker;
use super::{ReadOp, RecvError, StepError};

/// A request whose KV this worker must read, as the scheduler hands it over (serialisable, so a
/// scheduler in another process hands over the same value).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    /// Requests the engine had queued and took back without admitting them (their group lost a
    /// member, or the driver holds them elsewhere): the worker stops renewing their leases, so
    /// a request that never comes back does not keep its transfer leased forever; the lease
    /// already granted runs out. A request that comes back is queued anew.
    Dequeued {
        /// The requests taken back.
        requests: Vec<RequestId>,
    },
    /// The first handshake reply frame from the rank dialled under `session`.
    HandshakeMetadata {
        /// The session key of the dial.
        session: SessionKey,
        /// The metadata (boxed: it is large and rare, and every event is moved through the
        /// drivers' queues at this enum's size).
        metadata: Box<HandshakeMetadata>,
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
        /// The message (boxed, as the lease: every action is moved at this enum's size).
        release: Box<Release>,
    },
    /// Send a read lease to the rank this worker will read, when it takes the request: the
    /// producer keeps the blocks (and does not reap them) until the lease ends, which covers the
    /// handshake and every read, since the request fails (and releases) at its deadline. Only
    /// for a rank that advertised read leases; one nothing said so of yet gets it when its
    /// handshake metadata does (see `lease.rs`).
    SendLease {
        /// The rank read.
        rank: RankId,
        /// Its notify listener.
        endpoint: Endpoint,
        /// The lease.
        lease: Box<ReadLease>,
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
        /// Why (boxed: large and rare).
        error: Box<StepError>,
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
