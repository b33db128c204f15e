//! A prefill engine: registers each finished prefill's transfer on its workers with their
//! quorums, frees the blocks once every worker finished, and reaps (after fencing) what is still
//! held past the deferred-free timeout or its read leases; it also keeps the block ledger.

use std::collections::{BTreeMap, BTreeSet};

use super::transfer::{transfer_step, TransferEvent, TransferOutput, TransferState, WorkerPart};
#[cfg(doc)]
use super::WorkerAction;
use crate::ids::{EngineId, Incarnation, RankId, RequestId, TransferId};
use crate::policy::{PeerBook, Policy};
use crate::release::{quorum_plan, Quorum};
use crate::routing::RoutingError;
use crate::time::{earliest, Instant, NS_PER_S};
use crate::topology::{Deployment, Layout, ModelSpec};

/// Transfers one engine holds at once; beyond it, new transfers are refused.
pub const MAX_ENGINE_TRANSFERS: usize = 65_536;
/// Slack added after a read lease before the reaper may fire (covers the lease's travel time).
pub const LEASE_GRACE_NS: u64 = NS_PER_S;
/// Finished transfers whose records the ledger keeps for queries (counters, the longest hold
/// included, are kept forever). A simulator hosts every engine of a deployment, so it stays
/// modest.
pub const MAX_LEDGER_RECORDS: usize = 4096;

/// What happened to one transfer's blocks, for the ledger.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TransferRecord {
    /// The transfer.
    pub transfer_id: TransferId,
    /// Its request.
    pub request: RequestId,
    /// The owner DP rank whose workers hold the blocks.
    pub owner_dp: u16,
    /// The blocks, on every TP rank of the owner DP group; empty once the transfer finished
    /// (they went back to the pool with [`EngineAction::FreeBlocks`]).
    pub blocks: Vec<u32>,
    /// When prefill registered it.
    pub registered_at: Instant,
    /// When it was freed or reaped (`None` while held).
    pub ended_at: Option<Instant>,
    /// Whether the reaper freed it.
    pub reaped: bool,
}

impl TransferRecord {
    /// How long the blocks were (or have been, at `now`) held, in nanoseconds.
    pub fn held_ns(&self, now: Instant) -> u64 {
        self.ended_at.unwrap_or(now).since_ns(self.registered_at)
    }
}

/// Counters over every transfer an engine ever registered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LedgerTotals {
    /// Transfers registered.
    pub registered: u64,
    /// Transfers held now.
    pub held: u64,
    /// Freed after every worker finished.
    pub freed: u64,
    /// Freed by the reaper.
    pub reaped: u64,
    /// Blocks (per rank) held now.
    pub held_blocks: u64,
    /// The longest any finished transfer held its blocks, in nanoseconds.
    pub longest_hold_ns: u64,
}

/// Why the engine refused a finished prefill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineError {
    /// The decode layout cannot read this engine.
    Routing(RoutingError),
    /// The owner DP rank is not one of this engine's.
    OwnerOutOfRange {
        /// The rank named.
        owner_dp: u16,
        /// This engine's DP size.
        dp: u16,
    },
    /// The transfer id is held already.
    Duplicate(TransferId),
    /// [`MAX_ENGINE_TRANSFERS`] are held.
    TooManyTransfers,
    /// The holders named are not one per TP rank of the engine.
    HolderCount {
        /// Holders named.
        named: usize,
        /// The engine's TP size.
        tp: u16,
    },
}

/// A finished prefill: what [`EngineEvent::PrefillDone`] carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillDone {
    /// The request.
    pub request: RequestId,
    /// Its transfer id.
    pub transfer_id: TransferId,
    /// The DP rank that prefilled it.
    pub owner_dp: u16,
    /// Its blocks (the same ids on every TP rank of the owner DP group).
    pub blocks: Vec<u32>,
    /// The decode engine's layout (`remote_dp_size`, `remote_tp_size` of the request).
    pub decode: Layout,
    /// The decode engine and DP rank the proxy sent the request to, when the driver knows
    /// it (for [`EngineEvent::ReaderLost`]).
    pub reader: Option<(EngineId, u16)>,
    /// The incarnation of each TP rank of the owner DP group that computed the blocks, when
    /// the driver saw it (a rank may have restarted between computing its part and the
    /// registration); `None` takes each worker's current incarnation. A part computed by an
    /// incarnation that is no longer the worker's is gone with its memory: it counts as lost
    /// from the start, and the answer names the incarnation that computed it, so no decode
    /// rank reads it from the new one.
    pub holders: Option<Vec<Incarnation>>,
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::Routing(e) => write!(f, "{e}"),
            EngineError::OwnerOutOfRange { owner_dp, dp } => {
                write!(f, "owner DP rank {owner_dp} outside DP{dp}")
            }
            EngineError::Duplicate(id) => write!(f, "transfer {id} is held already"),
            EngineError::TooManyTransfers => write!(f, "more than {MAX_ENGINE_TRANSFERS} transfers held"),
            EngineError::HolderCount { named, tp } => {
                write!(f, "{named} holder incarnations named for an engine of TP size {tp}")
            }
        }
    }
}

/// An input to the prefill engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Prefill of a request finished; its blocks are held for the decode side.
    PrefillDone(PrefillDone),
    /// A worker finished its part of a transfer.
    WorkerFinished {
        /// The worker.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
    },
    /// A worker's process died and will not come back (the driver saw its connection close,
    /// or its heartbeat stop, and restarts nothing in its place): every transfer it holds counts
    /// its part as finished, so the group's blocks are freed once the live workers are released
    /// instead of waiting for the reaper, and so do transfers registered on its group later. Its
    /// memory went with it, so no read of it can complete from freed blocks. For a worker that
    /// restarts, report [`EngineEvent::WorkerUp`] with its new incarnation instead: under the
    /// fixed protocol that settles its old incarnation's parts the same way, since no read of
    /// the old transfers can reach the new incarnation's memory.
    WorkerLost {
        /// The worker.
        rank: RankId,
    },
    /// A worker's process started (or restarted) with this incarnation. The engine registers
    /// transfers on it under that incarnation, names it in prefill answers
    /// ([`PrefillEngine::holder_incarnations`]), and retires them under it. A restart (a new
    /// incarnation where another was known) ends the old one: its memory, and with it its part
    /// of every transfer registered on it, is gone, and the fixed protocol fences every decode
    /// read, release and lease of those transfers away from the new incarnation, so its parts
    /// count as finished (as [`EngineEvent::WorkerLost`]'s do) and the group's blocks are freed
    /// once the live workers are released. Under the legacy `no-incarnation-fence` nothing fences
    /// the old transfers, so they wait for the reaper as before.
    WorkerUp {
        /// The worker.
        rank: RankId,
        /// Its incarnation, drawn by the driver at process start.
        incarnation: Incarnation,
    },
    /// A decode rank died for good. Its DP group cannot run its forward pass any more and its
    /// releases will never come, so the transfers that group was to read are reaped as soon as
    /// their read leases (plus [`LEASE_GRACE_NS`]) end, instead of `defer_timeout` after
    /// registration. The reaper fences before it frees, so a read still in flight from a live
    /// peer of the group fails rather than reading reused memory.
    ReaderLost {
        /// The decode rank.
        rank: RankId,
    },
    /// A decode rank leased a transfer until `until` (from [`WorkerAction::Leased`]).
    Leased {
        /// The transfer.
        transfer_id: TransferId,
        /// When the lease ends.
        until: Instant,
    },
    /// The time from [`PrefillEngine::poll_timeout`] has come.
    Tick,
}

/// What the prefill engine asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineAction {
    /// Register the transfer on a worker with this quorum.
    Register {
        /// The worker.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
        /// Releases it waits for.
        quorum: Quorum,
        /// The worker's incarnation it is registered on, if the driver reported one
        /// ([`EngineEvent::WorkerUp`]): a restarted worker ignores a registration meant for its
        /// previous incarnation.
        incarnation: Option<Incarnation>,
    },
    /// Flexible read done on one rank: tell this other worker its part is done too.
    GroupDone {
        /// The worker.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
    },
    /// Every worker finished: the request is finished sending (report to the scheduler).
    FinishedSending {
        /// The request.
        request: RequestId,
        /// The transfer.
        transfer_id: TransferId,
    },
    /// Revoke remote access to these blocks on these ranks before they are freed, so a read
    /// still in flight fails rather than reading memory another request reuses.
    Fence {
        /// The transfer.
        transfer_id: TransferId,
        /// The owner DP rank.
        owner_dp: u16,
        /// Its blocks.
        blocks: Vec<u32>,
    },
    /// Return the blocks to the KV pool of every TP rank of the owner DP group.
    FreeBlocks {
        /// The transfer.
        transfer_id: TransferId,
        /// The owner DP rank.
        owner_dp: u16,
        /// The blocks.
        blocks: Vec<u32>,
        /// True when the reaper freed them.
        reaped: bool,
    },
    /// Tell a worker the transfer is over.
    Retire {
        /// The worker.
        rank: RankId,
        /// The transfer.
        transfer_id: TransferId,
        /// The worker's incarnation the transfer was registered on: a restarted worker
        /// recognises a retirement meant for its previous incarnation and ignores it.
        incarnation: Option<Incarnation>,
    },
    /// The reaper freed a transfer that was never fully released.
    ReapWarning {
        /// The transfer.
        transfer_id: TransferId,
        /// How long it was held, in nanoseconds.
        held_ns: u64,
        /// TP ranks that never finished.
        unfinished_tp: Vec<u16>,
    },
}

#[derive(Clone, Debug, Hash)]
struct Held {
    state: TransferState,
    record: TransferRecord,
    deadline: Instant,
    /// The decode engine and DP rank reading it, if the driver said.
    reader: Option<(EngineId, u16)>,
    /// The end of the latest read lease.
    leased_until: Option<Instant>,
    /// The incarnation of each TP rank of the owner DP group the transfer was registered on
    /// (`None` where the driver reported none).
    incarnations: Vec<Option<Incarnation>>,
}

/// One prefill engine: registers transfers on its workers, frees blocks once, reaps leftovers.
#[derive(Clone, Debug, Hash)]
pub struct PrefillEngine {
    engine: EngineId,
    layout: Layout,
    model: ModelSpec,
    policy: Policy,
    /// The rules of this engine and of the decode engines that read it: with one following
    /// vLLM 0.33's, a transfer it reads gets vLLM 0.33's quorum.
    peers: PeerBook,
    defer_timeout_ns: u64,
    held: BTreeMap<TransferId, Held>,
    /// Workers lost for good.
    lost: BTreeSet<RankId>,
    /// The current incarnation of each worker the driver reported ([`EngineEvent::WorkerUp`]).
    incarnations: BTreeMap<RankId, Incarnation>,
    /// Reaper deadlines in order, so the next one is found without scanning.
    deadlines: BTreeSet<(Instant, TransferId)>,
    records: std::collections::VecDeque<TransferRecord>,
    totals: LedgerTotals,
}

impl PrefillEngine {
    /// One engine per prefill engine of `d`, in engine order (what every driver builds).
    pub fn for_deployment(d: &Deployment, policy: Policy) -> Vec<PrefillEngine> {
        d.prefill
            .iter()
            .enumerate()
            .map(|(i, &layout)| {
                PrefillEngine::new(EngineId::prefill(i as u16), layout, d.model.clone(), policy)
            })
            .collect()
    }

    /// An engine with MoRIIO's 60 s `defer_timeout`.
    pub fn new(engine: EngineId, layout: Layout, model: ModelSpec, policy: Policy) -> PrefillEngine {
        PrefillEngine {
            engine,
            layout,
            model,
            policy,
            peers: PeerBook::pdkv(),
            defer_timeout_ns: 60 * NS_PER_S,
            held: BTreeMap::new(),
            lost: BTreeSet::new(),
            incarnations: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            records: std::collections::VecDeque::new(),
            totals: LedgerTotals::default(),
        }
    }

    /// Sets the rules of this engine and of its readers (pdkv's for all by default).
    pub fn with_peers(mut self, peers: PeerBook) -> PrefillEngine {
        self.peers = peers;
        self
    }

    /// Changes the reaper's delay (nanoseconds from registration).
    pub fn with_defer_timeout_ns(mut self, ns: u64) -> PrefillEngine {
        self.defer_timeout_ns = ns;
        self
    }

    /// Counters of the block ledger.
    pub fn totals(&self) -> LedgerTotals {
        self.totals
    }

    /// Records of transfers held now, in id order.
    pub fn held(&self) -> impl Iterator<Item = &TransferRecord> {
        self.held.values().map(|h| &h.record)
    }

    /// Records of the most recent finished transfers (freed or reaped), oldest first.
    pub fn finished(&self) -> impl Iterator<Item = &TransferRecord> {
        self.records.iter()
    }

    /// The incarnations holding a held transfer, one per TP rank of its owner DP group, for the
    /// prefill answer's `pdkv_incarnations`: `None` when the transfer is not held or the driver
    /// did not report every rank's incarnation (then the answer names none, and no fence
    /// protects the transfer).
    pub fn holder_incarnations(&self, id: &TransferId) -> Option<Vec<Incarnation>> {
        self.held.get(id)?.incarnations.iter().copied().collect()
    }

    /// The next reaper deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        earliest(None, self.deadlines.first().map(|(t, _)| *t))
    }

    /// Applies one event. A finished prefill the engine cannot accept is returned as an error
    /// (and nothing is registered); everything else appends actions to `out`.
    pub fn handle(
        &mut self,
        now: Instant,
        event: EngineEvent,
        out: &mut Vec<EngineAction>,
    ) -> Result<(), EngineError> {
        match event {
            EngineEvent::PrefillDone(done) => self.on_prefill_done(now, done, out),
            EngineEvent::ReaderLost { rank } => {
                let lost: Vec<TransferId> = self
                    .held
                    .iter()
                    .filter(|(_, h)| h.reader == Some((rank.engine, rank.dp)))
                    .map(|(id, _)| id.clone())
                    .collect();
                let ignore_leases = !self.policy.reaper.fences();
                for id in lost {
                    let held = self.held.get_mut(&id).expect("listed above");
                    let lease_end =
                        held.leased_until.filter(|_| !ignore_leases).map(|t| t.add_ns(LEASE_GRACE_NS));
                    let wanted = lease_end.map_or(now, |t| t.max(now));
                    if wanted < held.deadline {
                        self.deadlines.remove(&(held.deadline, id.clone()));
                        held.deadline = wanted;
                        self.deadlines.insert((wanted, id));
                    }
                }
                Ok(())
            }
            EngineEvent::WorkerFinished { rank, transfer_id } => {
                debug_assert_eq!(rank.engine, self.engine, "finished reported to the wrong engine");
                self.apply(now, &transfer_id, TransferEvent::WorkerFinished(rank.tp), out);
                Ok(())
            }
            EngineEvent::Leased { transfer_id, until } => {
                self.extend_lease(&transfer_id, until);
                Ok(())
            }
            EngineEvent::WorkerLost { rank } => {
                debug_assert_eq!(rank.engine, self.engine, "lost worker reported to the wrong engine");
                self.lost.insert(rank);
                let held: Vec<TransferId> = self
                    .held
                    .iter()
                    .filter(|(_, h)| h.record.owner_dp == rank.dp)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in held {
                    self.apply(now, &id, TransferEvent::WorkerLost(rank.tp), out);
                }
                Ok(())
            }
            EngineEvent::WorkerUp { rank, incarnation } => {
                debug_assert_eq!(rank.engine, self.engine, "worker reported to the wrong engine");
                self.lost.remove(&rank);
                let previous = self.incarnations.insert(rank, incarnation);
                if previous.is_some_and(|p| p != incarnation) && self.policy.incarnation.fences() {
                    // The old incarnation's parts died with its memory, and the fence keeps every
                    // decode read, release and lease of them away from the new one.
                    let tp = usize::from(rank.tp);
                    let old: Vec<TransferId> = self
                        .held
                        .iter()
                        .filter(|(_, h)| h.record.owner_dp == rank.dp && h.incarnations[tp] == previous)
                        .map(|(id, _)| id.clone())
                        .collect();
                    for id in old {
                        self.apply(now, &id, TransferEvent::WorkerLost(rank.tp), out);
                    }
                }
                Ok(())
            }
            EngineEvent::Tick => {
                while let Some((deadline, id)) = self.deadlines.first().cloned() {
                    if deadline > now {
                        break;
                    }
                    self.apply(now, &id, TransferEvent::ReaperDeadline, out);
                }
                Ok(())
            }
        }
    }

    /// Moves the reaper's deadline of a held transfer to at least `until` plus [`LEASE_GRACE_NS`]
    /// (network delay between the lease and the read). The legacy reaper ignores leases.
    fn extend_lease(&mut self, id: &TransferId, until: Instant) {
        if !self.policy.reaper.fences() {
            return;
        }
        let Some(held) = self.held.get_mut(id) else { return };
        held.leased_until = held.leased_until.max(Some(until));
        let wanted = until.add_ns(LEASE_GRACE_NS);
        if wanted > held.deadline {
            self.deadlines.remove(&(held.deadline, id.clone()));
            held.deadline = wanted;
            self.deadlines.insert((wanted, id.clone()));
        }
    }

    fn on_prefill_done(
        &mut self,
        now: Instant,
        done: PrefillDone,
        out: &mut Vec<EngineAction>,
    ) -> Result<(), EngineError> {
        let PrefillDone { request, transfer_id, owner_dp, blocks, decode, reader, holders } = done;
        if owner_dp >= self.layout.dp {
            return Err(EngineError::OwnerOutOfRange { owner_dp, dp: self.layout.dp });
        }
        if holders.as_ref().is_some_and(|h| h.len() != usize::from(self.layout.tp)) {
            let named = holders.as_ref().map_or(0, Vec::len);
            return Err(EngineError::HolderCount { named, tp: self.layout.tp });
        }
        if self.held.contains_key(&transfer_id) {
            return Err(EngineError::Duplicate(transfer_id));
        }
        if self.held.len() >= MAX_ENGINE_TRANSFERS {
            return Err(EngineError::TooManyTransfers);
        }
        // The rules between this engine and the reader decide the quorum (this engine's own when
        // the reader is not known).
        let policy = match reader {
            Some((reader, _)) => self.policy.between(&self.peers, self.engine, reader),
            None => self.policy.under(self.peers.rules(self.engine)),
        };
        let plan = quorum_plan(self.layout, decode, &self.model, &policy).map_err(EngineError::Routing)?;
        let deadline = now.add_ns(self.defer_timeout_ns);
        self.totals.registered += 1;
        self.totals.held += 1;
        self.totals.held_blocks += blocks.len() as u64;
        let record = TransferRecord {
            transfer_id: transfer_id.clone(),
            request,
            owner_dp,
            blocks,
            registered_at: now,
            ended_at: None,
            reaped: false,
        };
        let current = |tp: u16| self.incarnations.get(&RankId::new(self.engine, owner_dp, tp)).copied();
        let incarnations: Vec<Option<Incarnation>> = match &holders {
            Some(holders) => holders.iter().map(|&h| Some(h)).collect(),
            None => (0..self.layout.tp).map(current).collect(),
        };
        // Workers lost before the registration hold nothing of it: their part counts as done.
        // So does the part of a worker whose incarnation that computed it is gone (under the
        // fence, which keeps every read of it away from the new incarnation).
        let fenced = self.policy.incarnation.fences();
        let lost = (0..self.layout.tp).filter(|&tp| {
            let gone = fenced && current(tp).is_some() && incarnations[usize::from(tp)] != current(tp);
            gone || self.lost.contains(&RankId::new(self.engine, owner_dp, tp))
        });
        let state = TransferState::registered(self.layout.tp, lost, plan.flexible);
        let all_lost = state == TransferState::Freed;
        let held =
            Held { state, record, deadline, reader, leased_until: None, incarnations: incarnations.clone() };
        self.held.insert(transfer_id.clone(), held);
        self.deadlines.insert((deadline, transfer_id.clone()));
        for (tp, quorum) in plan.per_tp_rank.into_iter().enumerate() {
            let rank = RankId::new(self.engine, owner_dp, tp as u16);
            let incarnation = incarnations[tp];
            out.push(EngineAction::Register { rank, transfer_id: transfer_id.clone(), quorum, incarnation });
        }
        if all_lost {
            // Nobody holds the KV: nothing to wait for.
            self.end(now, &transfer_id, false, out);
        }
        Ok(())
    }

    fn apply(&mut self, now: Instant, id: &TransferId, event: TransferEvent, out: &mut Vec<EngineAction>) {
        let Some(held) = self.held.get_mut(id) else { return };
        let (next, output) = transfer_step(held.state.clone(), event);
        let unfinished: Vec<u16> =
            held.state.parts().map(|parts| parts.ranks(WorkerPart::Pending).collect()).unwrap_or_default();
        held.state = next;
        let owner_dp = held.record.owner_dp;
        match output {
            TransferOutput::None | TransferOutput::Ignored => {}
            TransferOutput::GroupDone => {
                let Some(parts) = held.state.parts() else { return };
                for tp in parts.ranks(WorkerPart::Pending) {
                    let rank = RankId::new(self.engine, owner_dp, tp);
                    out.push(EngineAction::GroupDone { rank, transfer_id: id.clone() });
                }
            }
            TransferOutput::Free => {
                out.push(EngineAction::FinishedSending {
                    request: held.record.request,
                    transfer_id: id.clone(),
                });
                self.end(now, id, false, out);
            }
            TransferOutput::Reap => {
                out.push(EngineAction::ReapWarning {
                    transfer_id: id.clone(),
                    held_ns: now.since_ns(held.record.registered_at),
                    unfinished_tp: unfinished,
                });
                if self.policy.reaper.fences() {
                    out.push(EngineAction::Fence {
                        transfer_id: id.clone(),
                        owner_dp,
                        blocks: held.record.blocks.clone(),
                    });
                }
                self.end(now, id, true, out);
            }
        }
    }

    /// Frees the blocks of a transfer exactly once and retires it on every worker of the group.
    fn end(&mut self, now: Instant, id: &TransferId, reaped: bool, out: &mut Vec<EngineAction>) {
        let held = self.held.remove(id).expect("ended transfers are held");
        self.deadlines.remove(&(held.deadline, id.clone()));
        let mut record = held.record;
        record.ended_at = Some(now);
        record.reaped = reaped;
        self.totals.longest_hold_ns = self.totals.longest_hold_ns.max(record.held_ns(now));
        self.totals.held -= 1;
        self.totals.held_blocks -= record.blocks.len() as u64;
        if reaped {
            self.totals.reaped += 1;
        } else {
            self.totals.freed += 1;
        }
        // Every worker forgets the transfer (and a real rank fences its blocks) before the
        // blocks return to the pool: a driver that hands freed blocks to the next prefill at
        // once would otherwise let the old transfer's retirement fence the new one's blocks.
        for tp in 0..self.layout.tp {
            out.push(EngineAction::Retire {
                rank: RankId::new(self.engine, record.owner_dp, tp),
                transfer_id: id.clone(),
                incarnation: held.incarnations[usize::from(tp)],
            });
        }
        out.push(EngineAction::FreeBlocks {
            transfer_id: id.clone(),
            owner_dp: record.owner_dp,
            // The blocks go back with the action; the finished record keeps none, so the
            // records kept for queries do not hold a block list each.
            blocks: std::mem::take(&mut record.blocks),
            reaped,
        });
        if self.records.len() == MAX_LEDGER_RECORDS {
            self.records.pop_front();
        }
        self.records.push_back(record);
    }
}
