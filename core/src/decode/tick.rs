//! What the clock triggers: lease renewals, handshake deadlines, request deadlines and read
//! retries after a full send queue.

use crate::handshake::HandshakeEvent;
use crate::ids::RequestId;
use crate::ports::SessionKey;
use crate::recv::RecvEvent;
use crate::time::Instant;

use super::state::RecvPhase;
use super::{DecodeAction, DecodeWorker, ReadOp, RecvError};

impl DecodeWorker {
    /// The time from `poll_timeout` has come: renews leases, times out handshakes and
    /// requests, and posts again the reads whose retry is due.
    pub(super) fn on_tick(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        self.renew_leases(now, out);
        let due_sessions: Vec<SessionKey> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.state.deadline().is_some_and(|d| d <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due_sessions {
            self.on_handshake(now, key, HandshakeEvent::Tick, out);
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            let Some(recv) = self.requests.get_mut(&id) else { continue };
            if matches!(recv.phase, RecvPhase::Draining { .. }) {
                continue;
            }
            if recv.deadline <= now {
                let before = recv.phase.machine();
                let error = RecvError::Timeout { waited_ns: now.since_ns(recv.arrived) };
                self.transition(id, before, RecvEvent::Deadline, Some(error), out);
                continue;
            }
            let RecvPhase::Reading { retries, .. } = &recv.phase else { continue };
            let due: Vec<Option<u16>> =
                retries.iter().filter(|(_, r)| r.due.is_some_and(|d| d <= now)).map(|(l, _)| *l).collect();
            for layer in due {
                let before = self.requests[&id].phase.machine();
                let recv = self.requests.get_mut(&id).expect("listed above");
                let RecvPhase::Reading { retries, plan, .. } = &mut recv.phase else { break };
                retries.get_mut(&layer).expect("listed above").due = None;
                let op = ReadOp::of_layer(plan.clone(), layer);
                self.transition(id, before, RecvEvent::RetryPosted, None, out);
                out.push(DecodeAction::PostRead(op));
            }
        }
    }
}
