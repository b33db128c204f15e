//! Legacy only: the lazy handshake ([`HandshakeMode::Lazy`], from `lazy-handshake`). Instead of
//! dialling at step begin and voting, the worker blocks on the read path, handshaking every DP
//! rank of each remote engine it reads, one session at a time; it reports the step ready only
//! when the last one completes, and raises alone when one fails, while peers that needed no
//! handshake are in the forward collective already. That divergence is the historical 600 s
//! hang, kept so the simulator can show it. The fixed path enters this file at three points: at
//! step begin, when a handshake resolves while the worker is blocked, and for the outputs only
//! the blocked step machine gives.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::handshake::HandshakeError;
use crate::ids::{EngineId, RankId};
#[cfg(doc)]
use crate::policy::HandshakeMode;
use crate::ports::{EngineAddress, ReadTarget, SessionKey};
use crate::step_machine::{StepEvent, StepOutput, StepState};
use crate::time::Instant;
use crate::topology::Layout;

use super::{DecodeAction, DecodeWorker, StepError};

impl DecodeWorker {
    /// True while the worker is blocked in a lazy handshake (it cannot join a collective).
    pub fn is_blocked(&self) -> bool {
        matches!(self.step, StepState::Blocked { .. })
    }

    /// Lazy: begins `step` blocked in the handshakes of the sessions it needs (`needed`, those
    /// its requests read through that are not complete), queued one after another.
    pub(super) fn lazy_step_begin(
        &mut self,
        now: Instant,
        step: u64,
        needed: BTreeSet<SessionKey>,
        out: &mut Vec<DecodeAction>,
    ) {
        let queue = self.lazy_sessions(needed);
        let event = StepEvent::BeginLazy { step, sessions: queue.len() as u32 };
        self.lazy_queue = queue;
        self.run_step(now, event, None, out);
    }

    /// Lazy: the sessions a step handshakes one after another, in order.
    fn lazy_sessions(&mut self, needed: BTreeSet<SessionKey>) -> VecDeque<SessionKey> {
        // The historical read path handshook every DP rank of each remote engine it had not met,
        // one after another on one executor, at the TP rank it reads.
        let mut queue: VecDeque<SessionKey> = VecDeque::new();
        let engines: BTreeMap<(EngineId, u16), (Layout, EngineAddress)> = self
            .requests
            .values()
            .filter(|r| needed.contains(&r.target.session))
            .map(|r| ((r.target.source.engine, r.target.source.tp), (r.remote, r.address.clone())))
            .collect();
        for ((engine, tp), (remote, address)) in engines {
            for dp in 0..remote.dp {
                let rank = RankId::new(engine, dp, tp);
                let Ok(target) =
                    ReadTarget::for_engine(&address, remote, rank, self.config.policy.session_key)
                else {
                    continue;
                };
                if self.ensure_session(&target, &address).is_err() {
                    // No room for a session with a rank no request reads (the ranks read were
                    // registered when their requests were routed): it is left out of the queue.
                    continue;
                }
                let key = target.session;
                if !queue.contains(&key) && self.sessions[&key].state.session().is_none() {
                    queue.push_back(key);
                }
            }
        }
        queue
    }

    /// Lazy: carries out an output only the blocked step machine gives, dialling the next session
    /// ([`StepOutput::DialNext`]) or raising alone ([`StepOutput::Raised`], with `failure`).
    /// Returns the event to give the machine next, when the session needed no dial after all.
    pub(super) fn lazy_step_output(
        &mut self,
        now: Instant,
        output: StepOutput,
        failure: Option<StepError>,
        out: &mut Vec<DecodeAction>,
    ) -> Option<StepEvent> {
        match output {
            StepOutput::DialNext { .. } => {
                // The machine dials only while blocked, with a session left: the queue's first.
                let key = self.lazy_queue.front().expect("blocked with sessions left").clone();
                self.dial(now, &key, out);
                if self.sessions.get(&key).is_some_and(|s| s.state.is_waiting()) {
                    return None;
                }
                // The session needed no dial after all (it is complete): on to the next.
                self.lazy_queue.pop_front();
                Some(StepEvent::HandshakeDone)
            }
            StepOutput::Raised { step } => {
                // The step ends here: the sessions left are not dialled for it.
                self.lazy_queue.clear();
                let error = failure.expect("a raising event carries its error");
                out.push(DecodeAction::StepFailed { step, error: Box::new(error) });
                None
            }
            other => unreachable!("{other:?} is not an output of the lazy handshake"),
        }
    }

    /// Lazy: a handshake resolved (`failed` says how) while the worker is blocked. Only the
    /// session being dialled, the first of the queue, moves the step on; its failure is the
    /// step's, and this worker's alone.
    pub(super) fn lazy_handshake_resolved(
        &mut self,
        now: Instant,
        key: SessionKey,
        failed: Option<HandshakeError>,
        out: &mut Vec<DecodeAction>,
    ) {
        if !self.is_blocked() || self.lazy_queue.front() != Some(&key) {
            return;
        }
        self.lazy_queue.pop_front();
        let event = if failed.is_some() { StepEvent::HandshakeFailed } else { StepEvent::HandshakeDone };
        let failure = failed.map(|error| StepError::Handshake { session: key, error });
        self.run_step(now, event, failure, out);
    }
}
