//! The decode side's schedulers: each decode DP group's batch and steps through the core's
//! `DecodeGroup` barrier, the forward, and how requests end.

use pdkv_core::group::{GroupAction, GroupEvent, Ignored};
use pdkv_core::ids::{EngineId, RankId, RequestId};

use pdkv_engine::decode::Joined;

use super::{Cluster, Failure, IDLE_STEP, MAX_BATCH, MAX_FAILURES_LISTED};
use crate::sched::ToRank;

impl Cluster {
    /// Feeds decode group `g`'s barrier and carries out what it decides: vote results go to
    /// the ranks they name, and a group every rank of which entered the forward runs it.
    pub(super) fn group_event(&mut self, g: usize, event: GroupEvent) {
        let mut out = Vec::new();
        self.dgroups[g].barrier.handle(event, &mut out);
        for action in out {
            match action {
                GroupAction::VoteResult { member, step, ok } => {
                    let rank = self.decode_rank(g, member.0);
                    self.send(rank, &ToRank::VoteResult { step, ok });
                }
                GroupAction::Forward { .. } => self.forward(g),
                // A lost rank's last messages may still be on their way when it is lost.
                GroupAction::Ignored(Ignored::LostMember { .. }) => {}
                GroupAction::Ignored(why) => {
                    let (engine, dp) = (self.dgroups[g].engine, self.dgroups[g].dp);
                    self.problem(format!("D{engine}.dp{dp}: the decode group ignored an input: {why}"));
                }
            }
        }
    }

    pub(super) fn dgroup_of(&self, rank: RankId) -> usize {
        self.dgroups
            .iter()
            .position(|g| g.engine == usize::from(rank.engine.index) && g.dp == rank.dp)
            .expect("decode ranks belong to a group")
    }

    pub(super) fn decode_rank(&self, g: usize, tp: u16) -> RankId {
        let group = &self.dgroups[g];
        RankId::new(EngineId::decode(group.engine as u16), group.dp, tp)
    }

    pub(super) fn has_work(&self, g: usize) -> bool {
        let group = &self.dgroups[g];
        !group.waiting.is_empty() || !group.running.is_empty() || !group.pending.is_empty()
    }

    pub(super) fn begin_step(&mut self, g: usize) {
        // The barrier admits a step once the last one ran its forward, and never after a rank
        // of the group was lost (its collectives can never complete).
        if !self.dgroups[g].barrier.may_begin() || !self.has_work(g) {
            return;
        }
        let step = self.dgroups[g].barrier.step().map_or(1, |s| s + 1);
        self.group_event(g, GroupEvent::StepBegin { step });
        let group = &mut self.dgroups[g];
        group.next_step = None;
        let mut new = Vec::new();
        while let Some(recv) = group.waiting.front() {
            let need = recv.params.remote_block_ids.len();
            let busy = group.running.len() + group.pending.len();
            if busy >= MAX_BATCH || group.free.len() < need {
                break;
            }
            let mut recv = group.waiting.pop_front().expect("front exists");
            let local: Vec<u32> = group.free.iter().take(need).copied().collect();
            for b in &local {
                group.free.remove(b);
            }
            recv.local_block_ids = local.clone();
            group.pending.admit(recv.request);
            new.push(recv);
        }
        for recv in &new {
            if let Some(req) = self.requests.get_mut(&recv.request) {
                req.local_blocks = recv.local_block_ids.clone();
            }
        }
        for tp in 0..self.dgroups[g].tp {
            let rank = self.decode_rank(g, tp);
            self.send(rank, &ToRank::StepBegin { step, requests: new.clone() });
        }
    }

    /// Every rank of the group entered the forward pass: one token for every running request.
    pub(super) fn forward(&mut self, g: usize) {
        let group = &mut self.dgroups[g];
        let now = std::time::Instant::now();
        let mut finished = Vec::new();
        for (id, left) in group.running.iter_mut() {
            *left -= 1;
            if *left == 0 {
                finished.push(*id);
            }
        }
        group.running.retain(|(_, left)| *left > 0);
        let running: Vec<RequestId> =
            group.running.iter().map(|(id, _)| *id).chain(finished.iter().copied()).collect();
        for id in running {
            if let Some(req) = self.requests.get_mut(&id) {
                if req.first_token.is_none() {
                    req.first_token = Some(now);
                    self.ttft_ms.push((now - req.started).as_secs_f64() * 1e3);
                }
            }
        }
        for id in finished {
            self.end(id, None);
        }
        if !self.dgroups[g].running.is_empty() || !self.dgroups[g].waiting.is_empty() {
            self.begin_step(g);
        } else if !self.dgroups[g].pending.is_empty() {
            self.dgroups[g].next_step = Some(now + IDLE_STEP);
        }
    }

    pub(super) fn reported(&mut self, rank: RankId, request: RequestId, error: Option<String>) {
        let g = self.dgroup_of(rank);
        let result = match error {
            Some(error) => Err(format!("{rank}: {error}")),
            None => Ok(()),
        };
        match self.dgroups[g].pending.report(request, rank.tp_rank(), result) {
            None => {}
            Some(Joined::Received) => {
                let output = self.requests[&request].output;
                self.dgroups[g].running.push((request, output));
                self.begin_step(g);
            }
            Some(Joined::Failed(errors)) => {
                self.end(request, Some(errors.into_iter().map(|(_, error)| error).collect()));
            }
        }
    }

    /// A request ended: finished (`None`) or failed with each worker's error.
    pub(super) fn end(&mut self, id: RequestId, errors: Option<Vec<String>>) {
        let Some(req) = self.requests.remove(&id) else { return };
        let g = self.dgroups.iter().position(|g| (g.engine, g.dp) == req.decode).expect("decode group");
        for b in &req.local_blocks {
            self.dgroups[g].free.insert(*b);
        }
        let _ = self.proxy.handle_finished(id);
        match errors {
            None => {
                self.finished += 1;
                let m = &self.d.model;
                let block_bytes = u64::from(m.block_size_tokens) * u64::from(m.bytes_per_token_per_layer);
                self.prompt_kv_bytes += req.prefill_blocks.len() as u64 * block_bytes * u64::from(m.layers);
                self.e2e_ms.push(req.started.elapsed().as_secs_f64() * 1e3);
                self.tokens_in += u64::from(req.input);
                self.tokens_out += u64::from(req.output);
            }
            Some(errors) => {
                self.failed += 1;
                if req.exposed || self.touched_by_message_fault(&req) {
                    self.failed_excused += 1;
                    self.exposed.insert(req.transfer_id.clone());
                }
                if self.failures.len() < MAX_FAILURES_LISTED {
                    self.failures.push(Failure {
                        request: id.0,
                        transfer_id: req.transfer_id.0.clone(),
                        prefill: format!("P{}.dp{}", req.prefill.0, req.prefill.1),
                        errors,
                    });
                }
            }
        }
        self.owed += 1;
        self.submit_owed();
    }
}
