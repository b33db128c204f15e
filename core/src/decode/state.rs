//! The decode worker's own bookkeeping: the sessions it knows, the requests it holds (and the
//! phase of each) and the requests queued for a later step. A request's phase maps onto the
//! request machine of [`crate::recv`], which the worker checks it agrees with. (The step in
//! progress is the step machine's own state, which the worker holds: see `mod.rs`.)

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::fence::FenceState;
use crate::handshake::{HandshakeParams, HandshakeState};
use crate::ids::{Incarnation, RankId, TransferId};
use crate::ports::{Endpoint, EngineAddress, ReadTarget};
use crate::recv::RecvState;
use crate::time::Instant;
use crate::topology::Layout;
use crate::wire::Extensions;

use super::{ReadOp, RecvError};

/// A session the worker knows: its handshake machine and where it points.
#[derive(Clone, Debug, Hash)]
pub(super) struct SessionEntry {
    pub(super) rank: RankId,
    pub(super) endpoint: Endpoint,
    pub(super) params: HandshakeParams,
    pub(super) state: HandshakeState,
    /// What the rank last advertised in metadata from the engine dialled; `None` until then.
    /// Kept when the session fails or is invalidated: the address still names the same rank.
    pub(super) extensions: Option<Extensions>,
}

/// Where one request is.
#[derive(Clone, Debug, Hash)]
pub(super) enum RecvPhase {
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
    pub(super) fn machine(&self) -> RecvState {
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

    /// Whether the read of `layer` is posted and not answered yet: [`Self::in_flight`]'s
    /// membership without building the set, since it is asked once per read answered.
    pub(super) fn is_in_flight(&self, layer: Option<u16>) -> bool {
        match self {
            RecvPhase::AwaitingSession => false,
            RecvPhase::Reading { outstanding, retries, .. } => {
                outstanding.contains(&layer) && retries.get(&layer).is_none_or(|r| r.due.is_none())
            }
            RecvPhase::Draining { in_flight, .. } => in_flight.contains(&layer),
        }
    }

    /// Posted reads not answered yet (a read waiting for its retry is not posted).
    pub(super) fn in_flight(&self) -> BTreeSet<Option<u16>> {
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

/// A read refused by a full send queue, waiting to be posted again.
#[derive(Clone, Copy, Debug, Hash)]
pub(super) struct Retry {
    /// Refusals so far: each doubles the delay before the next post, up to the cap.
    pub(super) attempts: u32,
    /// When to post it again; `None` once posted.
    pub(super) due: Option<Instant>,
}

/// A request the worker holds: where it reads, whom it releases, and where it is.
#[derive(Clone, Debug, Hash)]
pub(super) struct Recv {
    pub(super) transfer_id: TransferId,
    pub(super) target: ReadTarget,
    /// The prefill ranks released when the request ends, with their notify listeners and the
    /// incarnation of each that holds the transfer (when the answer named them).
    pub(super) releases: Vec<(RankId, Endpoint, Option<Incarnation>)>,
    /// The incarnation of the source rank that holds the transfer (`None`: the answer named
    /// none, and no fence applies), and where the request is with the fence.
    pub(super) incarnation: Option<Incarnation>,
    pub(super) fence: FenceState,
    pub(super) remote_block_ids: Arc<[u32]>,
    pub(super) local_block_ids: Arc<[u32]>,
    /// The prefill layout the parameters announced, and where that engine listens.
    pub(super) remote: Layout,
    pub(super) address: EngineAddress,
    pub(super) deadline: Instant,
    pub(super) arrived: Instant,
    pub(super) phase: RecvPhase,
    /// What the source's engine advertised in the request's `pdkv_extensions`, if anything.
    pub(super) engine_extensions: Option<Extensions>,
    /// A lease is owed to the source, held until its handshake metadata says whether it takes
    /// leases (see `lease.rs`).
    pub(super) lease_held: bool,
}

/// A request queued by the engine: routed, its source leased until admission.
#[derive(Clone, Debug, Hash)]
pub(super) struct Waiting {
    pub(super) recv: Recv,
    /// When to send the next lease.
    pub(super) renew_at: Instant,
}
