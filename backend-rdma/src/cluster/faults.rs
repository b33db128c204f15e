//! Injected faults: killing a prefill rank after N requests, restarting it, and holding the
//! decode dispatches of its group's requests until it is back (`--hold-dispatches-until-restart`).

use std::collections::BTreeSet;
use std::time::Duration;

use pdkv_core::ids::{EngineId, RankId, TransferId};

use super::{Cluster, Fault};
use pdkv_core::decode::RecvRequest;

/// The decode dispatches held until a killed prefill rank is back, and what was counted.
#[derive(Default)]
pub(super) struct Holds {
    /// Held dispatches, with their decode group, in the order the proxy made them.
    held: Vec<(usize, RecvRequest)>,
    /// Dispatches held so far (`requests.held_for_restart`).
    pub(super) count: u64,
    /// Dispatches the proxy handed on while a rank of the request's prefill group was down by a
    /// fault (`requests.dispatched_while_down`): with the hold, none.
    pub(super) while_down: u64,
}

/// The injected faults' state: the prefill ranks a kill keeps down and the restart due, the
/// decode dispatches held meanwhile, and the transfers a fault (a kill, a message fault, the
/// scheduler's own stall) was exposed to, whose requests' failures and reaping it excuses.
#[derive(Default)]
pub(super) struct Faults {
    /// Transfers an injected fault was exposed to: their failures and reaping are excused.
    pub(super) exposed: BTreeSet<TransferId>,
    /// Prefill ranks a fault killed and that have not restarted yet.
    pub(super) down_by_fault: BTreeSet<RankId>,
    /// When a killed rank restarts, and which.
    pub(super) restart_at: Option<(std::time::Instant, RankId)>,
    /// Decode dispatches held until a killed prefill rank is back.
    pub(super) holds: Holds,
}

impl Faults {
    /// A fault was exposed to transfer `t`: its request's failure and its reaping are excused.
    pub(super) fn expose(&mut self, t: TransferId) {
        self.exposed.insert(t);
    }

    /// Whether a fault was exposed to transfer `t`.
    pub(super) fn is_exposed(&self, t: &TransferId) -> bool {
        self.exposed.contains(t)
    }

    /// What the hold still holds, for a hang's reason.
    pub(super) fn holds_note(&self) -> String {
        match self.holds.held.len() {
            0 => String::new(),
            n => format!("; {n} decode dispatches held until a killed prefill rank is back"),
        }
    }
}

impl Cluster {
    pub(super) fn maybe_kill(&mut self) {
        let faults = self.config.faults.clone();
        for fault in faults {
            let Fault::KillPrefill { rank, after, restart_after_ms } = fault else { continue };
            if self.tally.prefilled != after {
                continue;
            }
            let Some(proc) = self.procs.ranks.get_mut(&rank) else { continue };
            if let Some(child) = proc.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            proc.killed_by_fault = true;
            proc.alive = false;
            proc.writer = None;
            self.procs.processes.killed_by_fault += 1;
            self.faults.down_by_fault.insert(rank);
            self.expose_group(rank);
            self.hold_queued(rank);
            let at = self.started_at.elapsed().as_millis();
            self.tally.faults_log.push(format!("killed {rank} at {at} ms, after {after} prefills"));
            if self.is_foreign(rank.engine) {
                self.foreign.killed(rank);
                self.foreign_rank_gone(rank);
            }
            if let Some(ms) = restart_after_ms {
                self.faults.restart_at = Some((std::time::Instant::now() + Duration::from_millis(ms), rank));
            }
            self.rank_lost(rank);
        }
    }

    /// A fault hit prefill rank `rank`: every request of its DP group still in flight may fail
    /// because of it (its KV, or part of it, was on the rank), and so may the reaping of every
    /// transfer the group holds.
    /// Requests that the proxy sends to the group while the rank is down are exposed as they are
    /// sent ([`Cluster::submit`]).
    pub(super) fn expose_group(&mut self, rank: RankId) {
        let group = (usize::from(rank.engine.index), rank.dp);
        for req in self.clients.requests.values_mut().filter(|r| r.prefill == group) {
            req.exposed = true;
            self.faults.expose(req.transfer_id.clone());
        }
        // So is every transfer the group still holds whose request already ended: its releases
        // may be on their way to the killed rank and lost with it (a request ends when its KV
        // arrived, before its release is delivered).
        let held: Vec<_> = self.prefill.engines[group.0]
            .held()
            .filter(|t| t.owner_dp == rank.dp)
            .map(|t| t.transfer_id.clone())
            .collect();
        self.faults.exposed.extend(held);
    }

    pub(super) fn restart(&mut self, rank: RankId) {
        let life = self.procs.ranks.get(&rank).map_or(0, |p| p.life + 1);
        if let Err(e) = self.procs.spawn(&self.config, rank, life) {
            self.tally.problem(format!("restart of {rank}: {e}"));
        }
    }

    /// The DP group of a prefill request lacks a rank a fault killed and a restart has not yet
    /// brought back.
    fn group_down(&self, (engine, dp): (usize, u16)) -> Option<RankId> {
        let engine = EngineId::prefill(engine as u16);
        (0..self.d.layout(engine).tp)
            .map(|tp| RankId::new(engine, dp, tp))
            .find(|r| self.faults.down_by_fault.contains(r))
    }

    /// Holds `recv`, the decode dispatch of a request for decode group `g`, when its prefill
    /// group is down and `--hold-dispatches-until-restart` asks for it (`None`); otherwise gives
    /// it back, counting it when it goes on while the group is down. A held request is exposed
    /// to the kill (it already is: it was in flight at the kill, or sent while the rank was
    /// down), so its failure and its reaping stay excused however long it waits.
    pub(super) fn hold(&mut self, g: usize, recv: RecvRequest) -> Option<RecvRequest> {
        let Some(req) = self.clients.requests.get(&recv.request) else { return Some(recv) };
        if self.group_down(req.prefill).is_none() {
            return Some(recv);
        }
        if !self.config.hold_dispatches_until_restart {
            self.faults.holds.while_down += 1;
            return Some(recv);
        }
        let req = self.clients.requests.get_mut(&recv.request).expect("looked up above");
        req.exposed = true;
        self.faults.expose(req.transfer_id.clone());
        self.faults.holds.count += 1;
        self.faults.holds.held.push((g, recv));
        None
    }

    /// The proxy dispatches a prefilled request to decode group `g`: held until the killed rank
    /// of its prefill group is back ([`Cluster::hold`]), then to the foreign driver playing
    /// the group or to the group's scheduler.
    pub(super) fn send_to_decode(&mut self, g: usize, recv: RecvRequest) {
        let (engine, dp) = (EngineId::decode(self.decode.groups[g].engine as u16), self.decode.groups[g].dp);
        if let Some(gone) = self.gone_rank_of_group(engine, dp) {
            // Registered already: the reaper frees what the dead group never releases.
            return self.end(recv.request, Some(vec![format!("{gone} is gone")]));
        }
        let Some(recv) = self.hold(g, recv) else { return };
        if self.is_foreign(engine) {
            self.foreign.recv(recv.request, engine, dp, recv.params);
        } else {
            self.dispatch(g, recv);
        }
    }

    /// `rank` was killed: with the hold, the dispatches of its group's requests that a decode
    /// group's scheduler still queues (no decode rank has seen them) are held too.
    fn hold_queued(&mut self, rank: RankId) {
        if !self.config.hold_dispatches_until_restart {
            return;
        }
        let group = (usize::from(rank.engine.index), rank.dp);
        for g in 0..self.decode.groups.len() {
            let requests = &self.clients.requests;
            let mut out = Vec::new();
            let queued = self.decode.groups[g].sched.take_waiting(
                |recv| requests.get(&recv.request).is_some_and(|r| r.prefill == group),
                &mut out,
            );
            self.sched_outputs(g, out);
            for recv in queued {
                let held = self.hold(g, recv);
                debug_assert!(held.is_none(), "the group is down and the hold is on");
            }
        }
    }

    /// `rank` is back: the dispatches held for it go on, in the order they were made (those of
    /// a group another killed rank still keeps down stay held).
    pub(super) fn release_held(&mut self, rank: RankId) {
        let mut released = 0;
        for (g, recv) in std::mem::take(&mut self.faults.holds.held) {
            if self.clients.requests.get(&recv.request).and_then(|r| self.group_down(r.prefill)).is_some() {
                self.faults.holds.held.push((g, recv));
            } else {
                released += 1;
                self.send_to_decode(g, recv);
            }
        }
        if released > 0 {
            let at = self.started_at.elapsed().as_millis();
            self.tally.faults_log.push(format!(
                "released {released} decode dispatches held for {rank} at {at} ms, after its restart"
            ));
        }
    }
}
