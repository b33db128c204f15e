//! Checks during the run: safety violations, collective hangs with their wait-for graph, and
//! which failed requests a fault excuses.

use std::collections::BTreeSet;

use pdkv_core::group::StepReport;
use pdkv_core::ids::{EngineId, TpRank};

use crate::result::{Hang, Violation, ViolationKind};
use crate::waitfor::{Collective, WaitFor, WaitNode, WaitReason};

use super::clients::Req;
use super::decode::UnitState;
use super::{ms, Ev, World};

/// What the checks found, and what excuses a failure.
pub(super) struct Checks {
    pub(super) violations: Vec<Violation>,
    pub(super) hangs: Vec<Hang>,
    /// Transfers whose decode side crashed: their reaping is expected, not a leak.
    pub(super) excused: BTreeSet<u32>,
    /// Per rank (prefill ranks, then decode ranks, as NICs are numbered), the merged time
    /// intervals in which an injected fault touched it, each widened by `grace_ns`; a failed
    /// request is excused when one overlaps its life on one of its ranks.
    pub(super) touched: Vec<Vec<(u64, u64)>>,
    /// How long after a fault touched a rank a request can still fail because of it: a lost
    /// dial surfaces at the handshake timeout, a lost read at the transfer timeout.
    pub(super) grace_ns: u64,
    /// Transfers whose blocks the reaper fenced (remote access revoked).
    pub(super) fenced: BTreeSet<u32>,
}

impl World {
    pub(super) fn violation(&mut self, kind: ViolationKind, ranks: Vec<String>, detail: String) {
        trace!(self, "check", kind.name(), ranks.first().cloned().unwrap_or_default(), None, detail.clone());
        if self.checks.violations.len() < 1000 {
            self.checks.violations.push(Violation { t_ms: ms(self.now), kind, ranks, detail });
        }
    }

    /// The unit's collective watchdog fired. One watchdog per unit is pending at most: if the
    /// step it was armed for completed, it re-arms for the step now waiting (if any).
    pub(super) fn on_collective_timeout(&mut self, unit: usize, _armed_step: u64) {
        self.decode.units[unit].watchdog = false;
        let timeout = self.sc.timeouts().collective_ns();
        let step = self.decode.units[unit].step;
        let UnitState::Waiting { began } = self.decode.units[unit].state else { return };
        let deadline = began.saturating_add(timeout);
        if self.now < deadline {
            self.decode.units[unit].watchdog = true;
            let delay = deadline - self.now;
            self.at(delay, Ev::CollectiveTimeout { unit, step });
            return;
        }
        let mut graph = WaitFor::default();
        let engine = self.decode.units[unit].engine;
        let layout = self.d.decode[engine];
        let op = if layout.ep && layout.dp > 1 { Collective::EpAllToAll } else { Collective::TpCollective };
        let engine_id = EngineId::decode(engine as u16);
        let collective = WaitNode::Collective { op, engine: engine_id, step };
        let mut ranks = Vec::new();
        for &g in &self.decode.units[unit].groups {
            let barrier = &self.decode.nodes.sched(g).barrier();
            for (&w, member) in self.decode.nodes.members(g).iter().zip((0..).map(TpRank)) {
                let report = barrier.report(member);
                if report.is_some_and(StepReport::enters_forward) {
                    continue;
                }
                let rank = self.decode.ranks[w];
                ranks.push(rank.to_string());
                graph.edge(collective.clone(), WaitNode::Rank { rank }, WaitReason::NotArrived);
                if report == Some(StepReport::Raised) {
                    graph.edge(
                        WaitNode::Rank { rank },
                        WaitNode::StepError { rank },
                        WaitReason::RaisedOutOfStep,
                    );
                }
                for (session, target) in self.decode.nodes.worker(w).waiting_sessions() {
                    graph.edge(
                        WaitNode::Rank { rank },
                        WaitNode::HandshakeListener { rank: target },
                        WaitReason::BlockedOnHandshake { session },
                    );
                }
            }
        }
        // Workers waiting for a group vote wait for the workers that have not voted yet.
        for &g in &self.decode.units[unit].groups {
            let Some(open) = self.decode.nodes.sched(g).barrier().open_vote().filter(|v| v.step == step)
            else {
                continue;
            };
            let vote = WaitNode::Vote { engine: engine_id, group: g, step };
            let worker = |member: TpRank| WaitNode::Rank {
                rank: self.decode.ranks[self.decode.nodes.members(g)[usize::from(member.0)]],
            };
            for &member in &open.voted {
                graph.edge(worker(member), vote.clone(), WaitReason::WaitingForMinVote);
            }
            for &member in &open.missing {
                graph.edge(vote.clone(), worker(member), WaitReason::HasNotVoted);
            }
        }
        let waited = self.now - began;
        self.checks.hangs.push(Hang {
            t_ms: ms(self.now),
            what: format!("{collective} waited {} s (timeout)", ms(waited) / 1e3),
            ranks,
            wait_for: graph.edges(),
            cycle: graph.cycle(),
            dot: graph.dot(),
        });
        trace!(self, "check", "hang", collective.to_string(), None, format!("waited {} ms", ms(waited)));
        self.stopped = true;
    }

    /// A failed request is excused when its transfer was excused for reaping (its decode engine
    /// crashed, or a fault lost one of its releases or leases), or when an injected fault touched
    /// one of its ranks (the TP ranks of its prefill DP group, and of every DP group of its decode
    /// unit) between its arrival and its end (see `touch` for the grace after each touch).
    pub(super) fn failure_excused(&self, req: &Req, done: u64) -> bool {
        if self.checks.excused.contains(&req.transfer) {
            return true;
        }
        // A transfer timeout imposed as a fault: a worker that gave up at it failed because of it.
        if req.timed_out && self.sc.faults.transfer_timeout_ms.is_some() {
            return true;
        }
        let prefill = &self.prefill.groups[req.prefill_group];
        let mut slots: Vec<usize> = (0..self.prefill.ranks.len())
            .filter(|&i| {
                let rank = self.prefill.ranks[i];
                usize::from(rank.engine.index) == prefill.engine && rank.dp == prefill.dp
            })
            .collect();
        // Under EP every DP group of the engine steps together, so a fault that stalls one
        // group's step stalls the whole unit's.
        let unit = &self.decode.units[self.decode.groups[req.decode_group].unit];
        for &g in &unit.groups {
            slots.extend(self.decode.nodes.members(g).iter().map(|&w| self.decode_nic(w)));
        }
        self.touched_during(&slots, req.sent_ns, done)
    }
}
