//! Reading a request's KV: the reads built from a complete session (their values are in
//! `plan.rs`), posting them once the session is there, and what each read's answer does (done,
//! failed, retried).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use crate::fence::FenceState;
use crate::handshake::HandshakeEvent;
use crate::ids::RequestId;
use crate::recv::{RecvEvent, RecvOutput, RecvState};
use crate::time::Instant;

use super::config::ReadGranularity;
use super::error::RecvError;
use super::messages::{DecodeAction, ReadOutcome};
use super::plan::{contiguous_runs, ReadOp, ReadPlan};
use super::state::{RecvPhase, Retry};
use super::DecodeWorker;

impl DecodeWorker {
    /// Posts the reads of every request whose session is complete and is the incarnation
    /// holding its transfer (the fence, applied first, drops a session that is not).
    pub(super) fn post_ready_reads(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        self.apply_fence(now, out);
        let ready: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.phase, RecvPhase::AwaitingSession) && r.fence == FenceState::Cleared)
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
                    let plan = ops[0].plan.clone();
                    recv.phase = RecvPhase::Reading { outstanding, retries: BTreeMap::new(), plan };
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
            messages_per_layer: contiguous_runs(&recv.local_block_ids, &recv.remote_block_ids),
            incarnation: meta.incarnation,
        });
        let layers = plan.remote_bases.len();
        let op =
            |layer: Option<u16>, range: Range<usize>| ReadOp { plan: plan.clone(), layer, layers: range };
        Ok(match self.config.granularity {
            ReadGranularity::PerRequest => vec![op(None, 0..layers)],
            ReadGranularity::PerLayer => (0..layers).map(|l| op(Some(l as u16), l..l + 1)).collect(),
        })
    }

    /// A posted read was answered: count it, retry it after a full send queue, or fail the
    /// request (and drop the session a failed read may have found stale).
    pub(super) fn on_read_done(
        &mut self,
        now: Instant,
        id: RequestId,
        layer: Option<u16>,
        outcome: ReadOutcome,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(recv) = self.requests.get_mut(&id) else { return };
        // Only a posted read that has not been answered yet can be answered.
        if !recv.phase.is_in_flight(layer) {
            return;
        }
        let before = recv.phase.machine();
        let deadline = recv.deadline;
        let waited_ns = now.since_ns(recv.arrived);
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
                    // The session is named only here: cloning its key for every read answered
                    // was an allocation per layer of every request.
                    stale = Some((recv.target.session.clone(), reason.clone()));
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
        if let Some((session, reason)) = stale {
            // The session may be stale (the remote rank restarted and its memory keys are
            // gone): the handshake machine drops it, so the next step that needs the rank
            // handshakes again.
            self.on_handshake(now, session, HandshakeEvent::ReadFailed(reason), out);
        }
        self.transition(id, before, event, error, out);
    }
}
