//! A prefill worker, one per prefill rank: answers handshakes with its metadata and counts the
//! releases of the transfers registered on it until each one's quorum is met.

use crate::auth::{self, ControlAuth, Mac, Verdict};
use crate::ids::{Incarnation, RankId, TransferId};
use crate::policy::Policy;
use crate::release::{LedgerError, Quorum, RankLedger, Release, ReleaseOutcome};
use crate::time::{Instant, NS_PER_MS};
use crate::wire::{Extension, HandshakeMetadata, LayerMemoryDesc, ReadLease};

/// An input to a prefill worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// A peer sent the handshake request; `peer` is the driver's handle to answer it.
    HandshakeRequest {
        /// Opaque reply handle (a ZMQ ROUTER identity, a simulator node id).
        peer: u64,
    },
    /// The engine registered a transfer this rank holds blocks of.
    Register {
        /// The transfer.
        transfer_id: TransferId,
        /// Releases this rank waits for.
        quorum: Quorum,
        /// The incarnation of this rank the engine registered it on (`None`: the engine does
        /// not know, which no fence protects).
        incarnation: Option<Incarnation>,
    },
    /// A release arrived on this rank's notify listener.
    Release(Release),
    /// Flexible read: another rank of the group was read and released.
    GroupDone {
        /// The transfer.
        transfer_id: TransferId,
    },
    /// A decode rank leased the transfer for `lease_ms` from now: it is about to read it.
    Lease {
        /// The transfer.
        transfer_id: TransferId,
        /// Lease length in milliseconds.
        lease_ms: u32,
        /// The incarnation the lease names, if the decode rank named one.
        incarnation: Option<Incarnation>,
        /// The lease's MAC, if it carried one.
        mac: Option<Mac>,
    },
    /// The engine freed the transfer's blocks; forget it.
    Retired {
        /// The transfer.
        transfer_id: TransferId,
        /// The incarnation of this rank the transfer was registered on, if the engine knew it.
        incarnation: Option<Incarnation>,
    },
}

/// What a prefill worker asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerAction {
    /// Answer a handshake request with both reply parts (two messages on the wire:
    /// [`crate::wire::handshake_reply`]).
    SendHandshakeReply {
        /// The reply handle from the request.
        peer: u64,
        /// The first part's payload (boxed: large and rare, and every action is moved at this
        /// enum's size).
        metadata: Box<HandshakeMetadata>,
        /// The second part's payload.
        layers: Vec<LayerMemoryDesc>,
    },
    /// This rank's part of the transfer is done (deliver to the engine).
    Finished {
        /// This rank.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
    },
    /// A decode rank will read the transfer until `until` (deliver to the engine).
    Leased {
        /// This rank.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
        /// When the lease ends.
        until: Instant,
    },
    /// A release or event that changed nothing, with why (for traces and counters).
    Ignored {
        /// The transfer it named.
        transfer_id: TransferId,
        /// What the ledger did with it.
        outcome: ReleaseOutcome,
    },
    /// A release or lease from outside the deployment, or forged: refused before it touched the
    /// ledger or the reaper (count it, and name its sender in logs).
    Refused {
        /// The transfer it named.
        transfer_id: TransferId,
        /// What it was.
        message: Refused,
        /// Why it was refused.
        verdict: Verdict,
    },
    /// A lease longer than this rank allows ([`PrefillWorker::with_max_lease_ms`]): it was taken
    /// for the longest allowed instead (count it).
    LeaseCapped {
        /// The transfer it leased.
        transfer_id: TransferId,
        /// The length it asked for.
        asked_ms: u32,
        /// The length it got.
        granted_ms: u32,
    },
    /// The engine sent something inconsistent (a bug in the driver or the engine): `rank`'s
    /// ledger refused it.
    Error {
        /// The rank whose ledger refused.
        rank: RankId,
        /// What the ledger said.
        error: LedgerError,
    },
}

/// Which message a worker refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Refused {
    /// A release.
    Release,
    /// A read lease.
    Lease,
}

/// The longest read lease a worker takes unless told otherwise: the default transfer timeout,
/// which is what a pdkv decode rank leases for.
pub const DEFAULT_MAX_LEASE_MS: u32 = 30_000;

/// One prefill rank: answers handshakes and counts releases.
///
/// Its incarnation is the one its handshake metadata names. Under the fixed protocol a
/// registration, release, lease or retirement naming another incarnation is meant for the rank's
/// previous life (before a restart) or a later one: it is ignored
/// ([`ReleaseOutcome::OtherIncarnation`]), so an old transfer never touches this incarnation's
/// ledger and a message for it is never an error. A message naming no incarnation (a MoRIIO
/// peer's) is taken as it is.
///
/// A release frees blocks and a lease holds them, so the worker takes them only as its
/// [`ControlAuth`] says (a wrong MAC is always refused; no MAC is refused when the deployment's
/// ranks all hold the key), and a lease for no longer than its transfer limits allow.
#[derive(Clone, Debug, Hash)]
pub struct PrefillWorker {
    rank: RankId,
    metadata: HandshakeMetadata,
    layers: Vec<LayerMemoryDesc>,
    ledger: RankLedger,
    fenced: bool,
    auth: ControlAuth,
    max_lease_ms: u32,
}

impl PrefillWorker {
    /// A worker that answers handshakes with `metadata` and `layers`.
    pub fn new(
        rank: RankId,
        metadata: HandshakeMetadata,
        layers: Vec<LayerMemoryDesc>,
        policy: &Policy,
    ) -> Self {
        PrefillWorker {
            rank,
            metadata,
            layers,
            ledger: RankLedger::new(policy),
            fenced: policy.incarnation.fences(),
            auth: ControlAuth::Open,
            max_lease_ms: DEFAULT_MAX_LEASE_MS,
        }
    }

    /// The worker judges releases and leases by `auth`, and advertises `auth` when it holds a
    /// key.
    pub fn with_control_auth(mut self, auth: ControlAuth) -> Self {
        self.metadata.extensions = if auth.key().is_some() {
            self.metadata.extensions.with(Extension::Auth)
        } else {
            self.metadata.extensions.without(Extension::Auth)
        };
        self.auth = auth;
        self
    }

    /// The longest read lease the worker takes (at least 1 ms); a longer one is taken for this
    /// long and reported ([`WorkerAction::LeaseCapped`]). Set it to the deployment's transfer
    /// timeout: a pdkv decode rank leases for its transfer timeout, and a read that outlives the
    /// lease fails at the fence instead of reading reused blocks.
    pub fn with_max_lease_ms(mut self, max_lease_ms: u32) -> Self {
        self.max_lease_ms = max_lease_ms.max(1);
        self
    }

    /// This worker's rank.
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// The memory regions this rank registered: base address of each layer's KV region.
    pub fn regions(&self) -> &[u64] {
        &self.metadata.kv_caches_base_addr
    }

    /// This rank's incarnation, as its metadata names it.
    pub fn incarnation(&self) -> Option<Incarnation> {
        self.metadata.incarnation
    }

    /// Whether a message naming `named` is for another incarnation of this rank (never under
    /// the legacy `no-incarnation-fence`, nor for a message or a rank naming none).
    fn other_incarnation(&self, named: Option<Incarnation>) -> bool {
        self.fenced && matches!((named, self.metadata.incarnation), (Some(a), Some(b)) if a != b)
    }

    /// The refusal of a release or lease the worker's [`ControlAuth`] does not take.
    fn refusal(&self, event: &WorkerEvent) -> Option<WorkerAction> {
        let (transfer_id, message, verdict) = match event {
            WorkerEvent::Release(release) => (
                &release.transfer_id,
                Refused::Release,
                self.auth.judge(release.mac, |k| auth::release_mac(k, release)),
            ),
            WorkerEvent::Lease { transfer_id, lease_ms, incarnation, mac } => {
                let lease = ReadLease {
                    transfer_id: transfer_id.clone(),
                    lease_ms: *lease_ms,
                    incarnation: *incarnation,
                    mac: None,
                };
                (transfer_id, Refused::Lease, self.auth.judge(*mac, |k| auth::lease_mac(k, &lease)))
            }
            _ => return None,
        };
        (verdict != Verdict::Taken).then(|| WorkerAction::Refused {
            transfer_id: transfer_id.clone(),
            message,
            verdict,
        })
    }

    /// The release ledger (for queries).
    pub fn ledger(&self) -> &RankLedger {
        &self.ledger
    }

    /// Applies one event; actions are appended to `out`.
    pub fn handle(&mut self, now: Instant, event: WorkerEvent, out: &mut Vec<WorkerAction>) {
        let rank = self.rank;
        let report = |transfer_id: TransferId, outcome: ReleaseOutcome, out: &mut Vec<WorkerAction>| {
            if outcome == ReleaseOutcome::Completed {
                out.push(WorkerAction::Finished { rank, transfer_id });
            } else if !matches!(outcome, ReleaseOutcome::Counted { .. }) {
                out.push(WorkerAction::Ignored { transfer_id, outcome });
            }
        };
        // Authenticity first: a forged message is refused whatever it names.
        if let Some(refused) = self.refusal(&event) {
            out.push(refused);
            return;
        }
        match event {
            WorkerEvent::HandshakeRequest { peer } => out.push(WorkerAction::SendHandshakeReply {
                peer,
                metadata: Box::new(self.metadata.clone()),
                layers: self.layers.clone(),
            }),
            WorkerEvent::Register { transfer_id, incarnation, .. }
            | WorkerEvent::Retired { transfer_id, incarnation }
            | WorkerEvent::Lease { transfer_id, incarnation, .. }
                if self.other_incarnation(incarnation) =>
            {
                report(transfer_id, ReleaseOutcome::OtherIncarnation, out)
            }
            WorkerEvent::Release(release) if self.other_incarnation(release.incarnation) => {
                report(release.transfer_id, ReleaseOutcome::OtherIncarnation, out)
            }
            WorkerEvent::Register { transfer_id, quorum, .. } => {
                match self.ledger.handle_transfer(&transfer_id, quorum) {
                    Ok(outcome) => report(transfer_id, outcome, out),
                    Err(error) => out.push(WorkerAction::Error { rank, error }),
                }
            }
            WorkerEvent::Release(release) => {
                let id = release.transfer_id.clone();
                let outcome = self.ledger.handle_release(release);
                report(id, outcome, out);
            }
            WorkerEvent::GroupDone { transfer_id } => match self.ledger.handle_group_done(&transfer_id) {
                Ok(outcome) => report(transfer_id, outcome, out),
                Err(error) => out.push(WorkerAction::Error { rank, error }),
            },
            WorkerEvent::Lease { transfer_id, lease_ms, .. } => {
                let granted_ms = lease_ms.min(self.max_lease_ms);
                if granted_ms < lease_ms {
                    out.push(WorkerAction::LeaseCapped {
                        transfer_id: transfer_id.clone(),
                        asked_ms: lease_ms,
                        granted_ms,
                    });
                }
                let until = now.add_ns(u64::from(granted_ms) * NS_PER_MS);
                out.push(WorkerAction::Leased { rank, transfer_id, until });
            }
            WorkerEvent::Retired { transfer_id, .. } => {
                if !self.ledger.handle_retired(&transfer_id) {
                    // Its registration is still on the way: it will be ignored as late.
                    report(transfer_id, ReleaseOutcome::RetiredBeforeRegistration, out);
                }
            }
        }
    }
}
