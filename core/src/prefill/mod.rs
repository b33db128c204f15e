//! The prefill side: one worker node per prefill rank and one engine node per prefill engine.
//!
//! # How a driver calls them
//!
//! 1. Create one [`PrefillWorker`] per rank (with the metadata it answers handshakes with) and
//!    one [`PrefillEngine`] per engine.
//! 2. When prefill of a request finishes, give the engine [`EngineEvent::PrefillDone`]. It
//!    answers with [`EngineAction::Register`] for every TP worker of the request's owner DP
//!    rank, each with the quorum of releases that worker waits for.
//! 3. Deliver each `Register` to its worker as [`WorkerEvent::Register`], every decoded release
//!    from the worker's notify listener as [`WorkerEvent::Release`], and every handshake request
//!    from its handshake listener as [`WorkerEvent::HandshakeRequest`].
//! 4. A worker reports [`WorkerAction::Finished`] when its part of a transfer is done; deliver
//!    that to the engine as [`EngineEvent::WorkerFinished`]. When every worker of the group has
//!    finished, the engine reports the request finished sending, retires the transfer on its
//!    workers ([`EngineAction::Retire`], delivered as [`WorkerEvent::Retired`]) and then frees
//!    its blocks ([`EngineAction::FreeBlocks`]), in that order.
//! 5. Tick the engine ([`EngineEvent::Tick`]) when [`PrefillEngine::poll_timeout`] comes: the
//!    deferred-free reaper frees whatever is still held `defer_timeout` after registration, with a
//!    warning. A decode rank leases a transfer before reading it ([`WorkerEvent::Lease`], relayed
//!    to the engine as [`EngineEvent::Leased`]); the reaper waits for the lease to end, since a
//!    read may be in flight until then. If it still fires it first fences the blocks
//!    ([`EngineAction::Fence`]: the driver revokes remote access, so a late read fails instead of
//!    reading reused memory). Under [`Legacy::ReaperIgnoresReads`] it ignores leases and frees
//!    without fencing.
//!
//! # Layout
//!
//! `worker` is [`PrefillWorker`], one per prefill rank; `engine` is [`PrefillEngine`], one per
//! prefill engine; `transfer` is one transfer's lifecycle as the engine sees it, the pure
//! [`transfer_step`] with its listed transition table ([`transition_table`]).

mod engine;
mod transfer;
mod worker;

#[cfg(doc)]
use crate::legacy::Legacy;

pub use engine::{
    EngineAction, EngineError, EngineEvent, LedgerTotals, PrefillDone, PrefillEngine, TransferRecord,
    LEASE_GRACE_NS, MAX_ENGINE_TRANSFERS, MAX_LEDGER_RECORDS,
};
pub use transfer::{
    representative_states, transfer_step, transition_table, TransferEvent, TransferOutput, TransferRow,
    TransferState, WorkerPart, WorkerParts,
};
pub use worker::{PrefillWorker, Refused, WorkerAction, WorkerEvent, DEFAULT_MAX_LEASE_MS};

#[cfg(test)]
mod tests;
