//! The prefill side's schedulers: submitting requests through the proxy, each prefill DP
//! group's admission (the engine layer's `PrefillScheduler`: its queue and block pool), and the
//! engine node's actions (frees, fences).

use std::collections::{BTreeMap, BTreeSet};

use pdkv_core::ids::{EngineId, RankId, RequestId, TransferId};
use pdkv_core::params::{KvTransferParams, PrefillAnswer};
use pdkv_core::policy::{PeerBook, Policy};
use pdkv_core::prefill::{EngineAction, EngineEvent, PrefillDone, PrefillEngine};
use pdkv_core::proxy::ProxyAction;
use pdkv_core::topology::{Deployment, Layout};
use pdkv_engine::pool::FREE;
use pdkv_engine::prefill::{Prefilled, WHOLE_PROMPTS};
use pdkv_engine::timeouts::NS_PER_MS;
use pdkv_engine::verdict::ViolationKind;

use super::foreign::{Registering, ToDriver};
use super::{Cluster, ClusterConfig};
use crate::sched::ToRank;
use pdkv_core::decode::RecvRequest;

/// What a free names for a transfer the group does not know (never queued there, or freed
/// already): an owner number no transfer has, so every block of the free is a double free.
const UNKNOWN_OWNER: u32 = FREE - 1;

/// A prefill DP group: its queue and block pool are the engine layer's scheduler, the one the
/// simulator's groups run, planned with whole prompts (a rank computes a request at once).
pub(super) struct PGroup {
    engine: usize,
    dp: u16,
    sched: pdkv_engine::prefill::PrefillScheduler,
    /// The pool's owner number of each transfer from its arrival until its blocks are freed.
    owners: BTreeMap<TransferId, u32>,
    next_owner: u32,
}

/// The prefill side: each prefill engine's node (registration quorums, frees, the reaper) and
/// each of its DP groups' schedulers, with the lives transfers were registered on.
pub(super) struct PrefillSide {
    pub(super) engines: Vec<PrefillEngine>,
    pub(super) groups: Vec<PGroup>,
    /// Which life of each rank a transfer was registered on: a worker's later events
    /// (group done, retire) go only to the process that holds its registration.
    pub(super) registered: BTreeMap<(RankId, TransferId), u32>,
    /// Until when the reapers wait after the scheduler's own stall ([`super::STALL_GRACE`]).
    pub(super) reapers_wait_until: Option<std::time::Instant>,
}

impl PrefillSide {
    /// The engines of `d`'s prefill side, under `policy` and with `peers`' rules, and a
    /// scheduler for each of their DP groups.
    pub(super) fn new(
        d: &Deployment,
        config: &ClusterConfig,
        policy: Policy,
        peers: &PeerBook,
    ) -> PrefillSide {
        let engines = PrefillEngine::for_deployment(d, policy)
            .into_iter()
            .map(|engine| engine.with_defer_timeout_ns(config.timeouts.defer_ns()).with_peers(peers.clone()))
            .collect();
        let groups = d
            .prefill
            .iter()
            .enumerate()
            .flat_map(|(e, l)| (0..l.dp).map(move |dp| (e, dp)))
            .map(|(engine, dp)| PGroup {
                engine,
                dp,
                sched: pdkv_engine::prefill::PrefillScheduler::new(
                    config.num_blocks,
                    d.model.block_size_tokens,
                ),
                owners: BTreeMap::new(),
                next_owner: 0,
            })
            .collect();
        PrefillSide { engines, groups, registered: BTreeMap::new(), reapers_wait_until: None }
    }

    /// Transfers the engines hold.
    pub(super) fn held(&self) -> u64 {
        self.engines.iter().map(|e| e.held().count() as u64).sum()
    }

    /// The index of DP group `dp` of prefill engine `engine`.
    pub(super) fn group_index(&self, engine: usize, dp: u16) -> usize {
        self.groups.iter().position(|g| g.engine == engine && g.dp == dp).expect("prefill groups exist")
    }
}

impl PGroup {
    /// Request `id` of transfer `transfer_id` and `input` prompt tokens queues; its blocks will
    /// be held under an owner number of its own.
    pub(super) fn handle_arrival(&mut self, id: RequestId, transfer_id: TransferId, input: u32) {
        let owner = self.next_owner;
        // Owner numbers only tell live transfers apart; `FREE` and `UNKNOWN_OWNER` are nobody's.
        self.next_owner = (self.next_owner + 1) % UNKNOWN_OWNER;
        self.owners.insert(transfer_id, owner);
        self.sched.handle_arrival(id, input, owner);
    }
}

impl Cluster {
    // -------------------------------------------------------------------------- faults

    /// Starts prefills of a group's queue while its blocks last: the scheduler admits in arrival
    /// order every request whose whole prompt fits (the head is never skipped), with blocks
    /// handed out as vLLM's pool hands them out.
    pub(super) fn pump_prefill(&mut self, engine: EngineId, dp: u16) {
        let g = self.prefill.group_index(usize::from(engine.index), dp);
        if let Some(gone) = self.gone_rank_of_group(engine, dp) {
            let queued = self.prefill.groups[g].sched.take_queued();
            for id in queued {
                if let Some(req) = self.clients.requests.get(&id) {
                    self.prefill.groups[g].owners.remove(&req.transfer_id);
                }
                self.end(id, Some(vec![format!("{gone} is gone")]));
            }
            return;
        }
        // A killed rank that a restart brings back: the group's prefills wait for it, since
        // KV prefilled without it could not be read from it.
        let tp = self.d.layout(engine).tp;
        let incomplete = (0..tp).any(|tp| {
            self.procs.ranks.get(&RankId::new(engine, dp, tp)).is_some_and(|p| !(p.alive && p.ready))
        });
        if incomplete {
            return;
        }
        // The ranks compute a request whole, and each acknowledges it (`prefill_acked`): the
        // scheduler's step ends as soon as it is planned, and the requests it admitted leave it
        // with their blocks at once. A call made while these are sent (a request that ends at
        // once frees its blocks and pumps again) plans a step of its own.
        let now = self.clock.now().0;
        self.prefill.groups[g].sched.plan_step(now, WHOLE_PROMPTS);
        let admitted = self.prefill.groups[g].sched.handle_step_done().finished;
        for Prefilled { request: id, owner, blocks } in admitted {
            let Some(req) = self.clients.requests.get(&id) else {
                // Ended while queued: nobody will free its blocks but the scheduler, and its
                // owner number goes with them (its record, which named the transfer, is gone).
                let group = &mut self.prefill.groups[g];
                let _ = group.sched.handle_free(owner, &blocks);
                group.owners.retain(|_, held| *held != owner);
                continue;
            };
            let transfer_id = req.transfer_id.clone();
            let layout = self.d.layout(engine);
            let live: BTreeSet<RankId> = (0..layout.tp)
                .map(|tp| RankId::new(engine, dp, tp))
                .filter(|&r| self.procs.is_up(r))
                .collect();
            let req = self.clients.requests.get_mut(&id).expect("queued requests exist");
            req.prefill_blocks = blocks.clone();
            req.acks_needed = live.clone();
            for rank in live {
                self.procs.send(
                    rank,
                    &ToRank::Prefill { transfer_id: transfer_id.clone(), blocks: blocks.clone() },
                );
            }
            if self.clients.requests[&id].acks_needed.is_empty() {
                self.prefill_done(id);
            }
        }
    }

    /// `rank`'s process computed its part of the request (or died computing it, when a restart
    /// will bring the rank back): the part is that process's incarnation's.
    pub(super) fn prefill_acked(&mut self, id: RequestId, rank: RankId) {
        let incarnation = self.procs.ranks.get(&rank).and_then(|p| p.incarnation);
        let Some(req) = self.clients.requests.get_mut(&id) else { return };
        if let Some(incarnation) = incarnation {
            req.holders.insert(rank.tp, incarnation);
        }
        if req.acks_needed.remove(&rank) && req.acks_needed.is_empty() {
            self.prefill_done(id);
        }
    }

    /// Every live rank of the owner group holds the request's KV: register, answer the proxy.
    pub(super) fn prefill_done(&mut self, id: RequestId) {
        self.tally.prefilled += 1;
        self.maybe_kill();
        let req = &self.clients.requests[&id];
        let (e, dp) = req.prefill;
        let decode_engine = EngineId::decode(req.decode.0 as u16);
        if let Some(gone) = self.gone_rank_of_group(decode_engine, req.decode.1) {
            // Its decode group died while it was prefilled: nobody will read or release it,
            // so it is not registered, and its blocks go back to the pool now rather than to
            // the reaper later.
            let (transfer_id, blocks) = (req.transfer_id.clone(), req.prefill_blocks.clone());
            self.free_prefill_blocks(e, dp, &transfer_id, &blocks);
            self.end(id, Some(vec![format!("{gone} is gone")]));
            // The freed blocks may be what the group's queue waits for, and no other event
            // may come to pump it (the only decode group is gone, nothing else is held).
            self.pump_prefill(EngineId::prefill(e as u16), dp);
            return;
        }
        let req = &self.clients.requests[&id];
        let decode_layout = self.d.decode[req.decode.0];
        let event = EngineEvent::PrefillDone(PrefillDone {
            request: id,
            transfer_id: req.transfer_id.clone(),
            owner_dp: dp,
            blocks: req.prefill_blocks.clone(),
            decode: decode_layout,
            reader: Some((EngineId::decode(req.decode.0 as u16), req.decode.1)),
            // Which process computed each part: a rank may have restarted since.
            holders: (req.holders.len() == usize::from(self.d.prefill[e].tp))
                .then(|| req.holders.values().copied().collect()),
        });
        let mut out = Vec::new();
        let now = self.clock.now();
        if let Err(error) = self.prefill.engines[e].handle(now, event, &mut out) {
            self.tally.problem(format!("P{e} refused {id}: {error}"));
            let blocks = self.clients.requests[&id].prefill_blocks.clone();
            let transfer_id = self.clients.requests[&id].transfer_id.clone();
            self.free_prefill_blocks(e, dp, &transfer_id, &blocks);
            self.end(id, Some(vec![format!("prefill refused: {error}")]));
            self.pump_prefill(EngineId::prefill(e as u16), dp);
            return;
        }
        self.engine_actions(e, out);
        if self.foreign.registering.contains_key(&self.clients.requests[&id].transfer_id) {
            // Answered once the foreign ranks' workers know the transfer (foreign.rs).
            return;
        }
        self.answer_prefilled(id);
    }

    /// A foreign rank's worker knows `transfer_id` (or the rank is gone): the request's answer
    /// goes to the proxy once no live foreign rank is still to say so.
    pub(super) fn foreign_registered(&mut self, rank: RankId, transfer_id: &TransferId) {
        let Some(waiting) = self.foreign.registering.get_mut(transfer_id) else { return };
        waiting.ranks.remove(&rank);
        if waiting.ranks.is_empty() {
            let request = waiting.request;
            self.foreign.registering.remove(transfer_id);
            self.answer_prefilled(request);
        }
    }

    /// A foreign rank died: none of the transfers it was told waits for its `registered` now.
    pub(super) fn foreign_rank_gone(&mut self, rank: RankId) {
        let waiting: Vec<TransferId> = self
            .foreign
            .registering
            .iter()
            .filter(|(_, w)| w.ranks.contains(&rank))
            .map(|(t, _)| t.clone())
            .collect();
        for transfer_id in waiting {
            self.foreign_registered(rank, &transfer_id);
        }
    }

    /// The prefill engine answers the proxy for a prefilled request, which goes on to decode.
    fn answer_prefilled(&mut self, id: RequestId) {
        let Some(req) = self.clients.requests.get(&id) else { return };
        let e = req.prefill.0;
        // The id now leaves for the proxy and decode, where a sniffer sees it.
        if let Some(forger) = self.forger.as_mut() {
            forger.feed(&req.transfer_id);
        }
        let engine = EngineId::prefill(e as u16);
        let address = self.addresses[&engine].clone();
        let layout: Layout = self.d.prefill[e];
        let req = &self.clients.requests[&id];
        let holders = self.prefill.engines[e].holder_incarnations(&req.transfer_id);
        let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
            transfer_id: Some(&req.transfer_id),
            blocks: &req.prefill_blocks,
            address: &address,
            layout,
            extensions: PrefillAnswer::advertised(
                self.peers.rules(engine).extensions(),
                self.procs.control_setup.key.is_some(),
            ),
            holders: holders.as_deref(),
            // The shape the decode engine this request goes to reads.
            blocks_per_group: self.peers.rules(EngineId::decode(req.decode.0 as u16)).block_ids_per_group(),
        });
        match self.clients.proxy.handle_prefill_response(id, answer) {
            Ok(ProxyAction::SendDecode { slot, params, .. }) => {
                let g = self
                    .decode
                    .groups
                    .iter()
                    .position(|g| g.engine == usize::from(slot.engine.index) && g.dp == slot.dp())
                    .expect("the proxy routes to existing groups");
                let recv = RecvRequest {
                    request: id,
                    prefill_engine: engine,
                    prefill_address: address,
                    params,
                    local_block_ids: Vec::new(),
                };
                self.send_to_decode(g, recv);
            }
            other => {
                let detail = match other {
                    Ok(_) => format!("proxy answered the prefill response of {id} with no decode dispatch"),
                    Err(e) => format!("proxy refused the prefill response of {id}: {e}"),
                };
                self.tally.violation(ViolationKind::ProtocolError, detail);
            }
        }
    }

    pub(super) fn engine(&mut self, e: usize, event: EngineEvent) {
        let mut out = Vec::new();
        if let Err(error) = self.prefill.engines[e].handle(self.clock.now(), event, &mut out) {
            self.tally.violation(ViolationKind::ProtocolError, format!("P{e}: {error}"));
        }
        self.engine_actions(e, out);
    }

    pub(super) fn engine_actions(&mut self, e: usize, actions: Vec<EngineAction>) {
        for action in actions {
            match action {
                EngineAction::Register { rank, transfer_id, quorum, incarnation } => {
                    if let Some(proc) = self.procs.ranks.get(&rank).filter(|p| p.alive) {
                        self.prefill.registered.insert((rank, transfer_id.clone()), proc.life);
                    }
                    if self.is_foreign(rank.engine) {
                        // The foreign rank counts its releases by its own rules; the quorum is
                        // pdkv's model of them and stays with the engine node. A rank that is
                        // down (killed, or restarting) never hears of the transfer: its part
                        // is the reaper's.
                        if !self.procs.is_up(rank) {
                            continue;
                        }
                        let request = self
                            .clients
                            .request_of(&transfer_id)
                            .map_or_else(String::new, |id| id.0.to_string());
                        let msg = ToDriver::Register {
                            transfer_id: transfer_id.to_string(),
                            request,
                            engine: rank.engine.index,
                            dp: rank.dp,
                            tp: rank.tp,
                        };
                        self.foreign.tell(&msg);
                        if let Some(request) = self.clients.request_of(&transfer_id) {
                            let waiting = self
                                .foreign
                                .registering
                                .entry(transfer_id)
                                .or_insert_with(|| Registering { request, ranks: BTreeSet::new() });
                            waiting.ranks.insert(rank);
                        }
                    } else {
                        self.procs.send(rank, &ToRank::Register { transfer_id, quorum, incarnation });
                    }
                }
                EngineAction::GroupDone { rank, transfer_id } => {
                    // A foreign rank has no such notice: its own accounting finished it.
                    if self.holds_registration(rank, &transfer_id) && !self.is_foreign(rank.engine) {
                        self.procs.send(rank, &ToRank::GroupDone { transfer_id });
                    }
                }
                EngineAction::Retire { rank, transfer_id, incarnation } => {
                    if self.holds_registration(rank, &transfer_id) {
                        // A foreign rank's data-plane server fences the blocks; its driver
                        // forgets the transfer.
                        self.procs
                            .send(rank, &ToRank::Retire { transfer_id: transfer_id.clone(), incarnation });
                        if self.is_foreign(rank.engine) {
                            let msg = ToDriver::Retire {
                                transfer_id: transfer_id.to_string(),
                                engine: rank.engine.index,
                                dp: rank.dp,
                                tp: rank.tp,
                            };
                            self.foreign.tell(&msg);
                        }
                    }
                    self.prefill.registered.remove(&(rank, transfer_id));
                }
                EngineAction::FinishedSending { .. } => {}
                EngineAction::Fence { transfer_id, owner_dp, blocks } => {
                    self.tally.ledger.fenced += 1;
                    let engine = EngineId::prefill(e as u16);
                    for tp in 0..self.d.prefill[e].tp {
                        let msg = ToRank::Fence { transfer_id: transfer_id.clone(), blocks: blocks.clone() };
                        self.procs.send(RankId::new(engine, owner_dp, tp), &msg);
                    }
                }
                EngineAction::FreeBlocks { transfer_id, owner_dp, blocks, reaped } => {
                    if reaped {
                        self.tally.ledger.reaped += 1;
                        if self.faults.is_exposed(&transfer_id) {
                            self.tally.ledger.reaped_excused += 1;
                        }
                    } else {
                        self.tally.ledger.freed += 1;
                    }
                    self.free_prefill_blocks(e, owner_dp, &transfer_id, &blocks);
                    self.pump_prefill(EngineId::prefill(e as u16), owner_dp);
                }
                EngineAction::ReapWarning { transfer_id, held_ns, unfinished_tp } => {
                    let ms = held_ns / NS_PER_MS;
                    let unreleased: Vec<String> = unfinished_tp.iter().map(u16::to_string).collect();
                    self.tally.problem(format!(
                        "P{e} reaped {transfer_id} after {ms} ms; unreleased TP ranks {}",
                        unreleased.join(", ")
                    ));
                }
            }
        }
    }

    /// Whether the live process of `rank` is the one the transfer was registered on (a restarted
    /// rank never heard of transfers registered before it started).
    pub(super) fn holds_registration(&self, rank: RankId, transfer_id: &TransferId) -> bool {
        let registered = self.prefill.registered.get(&(rank, transfer_id.clone()));
        self.procs.ranks.get(&rank).is_some_and(|p| p.alive && registered == Some(&p.life))
    }

    pub(super) fn free_prefill_blocks(
        &mut self,
        e: usize,
        dp: u16,
        transfer_id: &TransferId,
        blocks: &[u32],
    ) {
        let g = self.prefill.group_index(e, dp);
        let group = &mut self.prefill.groups[g];
        let owner = group.owners.remove(transfer_id).unwrap_or(UNKNOWN_OWNER);
        let Err(bad) = group.sched.handle_free(owner, blocks) else { return };
        // The pool names them last first, as it frees; the violations keep the request's order.
        for &b in bad.blocks.iter().rev() {
            self.tally.ledger.double_frees += 1;
            let detail = format!("P{e}.dp{dp}: block {b} freed for {transfer_id}, which did not hold it");
            self.tally.violation(ViolationKind::DoubleFree, detail);
        }
    }

    // -------------------------------------------------------------------------- decode steps
}
