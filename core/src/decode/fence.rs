//! The incarnation fence carried out (the rule is [`crate::fence`]): before a step dials and
//! before reads are posted, every request waiting for its session compares the incarnation its
//! transfer names with the complete session's; a differing session is dropped so the step dials
//! it again, and a request whose holder a fresh handshake shows gone fails unreleased.

use crate::fence::{self, FenceEvent, FenceOutput};
use crate::handshake::HandshakeEvent;
use crate::ids::RequestId;
use crate::recv::{RecvEvent, RecvState};
use crate::time::Instant;

use super::state::RecvPhase;
use super::{DecodeAction, DecodeWorker, RecvError};

impl DecodeWorker {
    /// Applies the fence to every request that waits for its session while the session is
    /// complete, in request order.
    pub(super) fn apply_fence(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        let rule = self.config.policy.incarnation;
        let waiting: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.phase, RecvPhase::AwaitingSession))
            .map(|(id, _)| *id)
            .collect();
        for id in waiting {
            let recv = &self.requests[&id];
            // A session dropped by an earlier request of this pass is not complete any more: the
            // request waits for the dial like the one that dropped it.
            let Some(session) = self.sessions.get(&recv.target.session).and_then(|s| s.state.session())
            else {
                continue;
            };
            let live = session.metadata.incarnation;
            let event = FenceEvent::of(rule, recv.incarnation, live);
            let (next, output) = fence::step(recv.fence, event);
            self.requests.get_mut(&id).expect("listed above").fence = next;
            match output {
                FenceOutput::Proceed | FenceOutput::Ignored => {}
                FenceOutput::Redial => {
                    // The key is cloned only here: this pass runs at every step, for every
                    // waiting request.
                    let key = self.requests[&id].target.session.clone();
                    self.on_handshake(now, key, HandshakeEvent::Superseded, out)
                }
                FenceOutput::FailUnreleased => {
                    let holder =
                        self.requests[&id].incarnation.expect("only a transfer naming its holder differs");
                    let error = RecvError::OtherIncarnation { holder, live };
                    self.transition(id, RecvState::AwaitingSession, RecvEvent::Fenced, Some(error), out);
                }
            }
        }
    }
}
