//! A step of the fixed protocol: the worker takes the step's requests, dials every session they
//! need (eager handshakes), votes once no dial is outstanding, and reports the group's MIN. The
//! legacy lazy handshake branches off at step begin, when a handshake resolves while blocked, and
//! for the step machine's lazy outputs (`lazy.rs`).

use std::collections::BTreeSet;

use crate::handshake::{self, HandshakeEvent, HandshakeOutput, HandshakeState};
use crate::policy::HandshakeMode;
use crate::ports::SessionKey;
use crate::step_machine::{self, StepEvent, StepOutput, StepState};
use crate::time::Instant;

use super::state::RecvPhase;
use super::{DecodeAction, DecodeWorker, RecvRequest, StepError};

impl DecodeWorker {
    /// Begins a step: takes its requests, then dials every session they need that is not
    /// complete and waits for those dials before voting.
    pub(super) fn on_step_begin(
        &mut self,
        now: Instant,
        step: u64,
        requests: Vec<RecvRequest>,
        out: &mut Vec<DecodeAction>,
    ) {
        assert_eq!(
            self.step,
            StepState::Idle,
            "{}: step {step} began before the last step was reported",
            self.rank()
        );
        self.admit(now, requests, out);
        // A session naming another incarnation than a waiting request's transfer is dropped
        // here, so this step dials it again.
        self.apply_fence(now, out);
        // Sessions this step needs that are not complete, in key order.
        let needed: BTreeSet<SessionKey> = self
            .requests
            .values()
            .filter(|r| matches!(r.phase, RecvPhase::AwaitingSession))
            .map(|r| &r.target.session)
            .filter(|key| self.sessions.get(*key).is_none_or(|s| s.state.session().is_none()))
            .cloned()
            .collect();
        if self.config.policy.handshake == HandshakeMode::Lazy {
            return self.lazy_step_begin(now, step, needed, out);
        }
        let mut waiting = BTreeSet::new();
        for key in needed {
            self.dial(now, &key, out);
            if self.sessions[&key].state.is_waiting() {
                waiting.insert(key);
            }
        }
        let event = StepEvent::Begin { step, dials: waiting.len() as u32 };
        self.step_dials = waiting;
        self.run_step(now, event, None, out);
    }

    /// Dials `key` unless a dial is outstanding or the session is complete.
    pub(super) fn dial(&mut self, now: Instant, key: &SessionKey, out: &mut Vec<DecodeAction>) {
        let Some(entry) = self.sessions.get_mut(key) else { return };
        let state = std::mem::replace(&mut entry.state, HandshakeState::Idle);
        let (next, output) = handshake::step(state, HandshakeEvent::Dial, now, &entry.params);
        entry.state = next;
        if output == HandshakeOutput::SendRequest {
            out.push(DecodeAction::DialHandshake {
                session: key.clone(),
                rank: entry.rank,
                endpoint: entry.endpoint.clone(),
            });
        }
        self.retime_session(key);
    }

    /// Applies a handshake event to its session's machine and tells the step what resolved.
    pub(super) fn on_handshake(
        &mut self,
        now: Instant,
        key: SessionKey,
        event: HandshakeEvent,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(entry) = self.sessions.get_mut(&key) else { return };
        // Metadata the machine takes (in a dial waiting for it, and from the engine dialled:
        // another engine's fails the dial) says what the rank advertises, which decides the
        // leases held for it before any read through the session is posted.
        let advertised = match (&event, &entry.state) {
            (
                HandshakeEvent::Metadata(metadata),
                HandshakeState::Dialing { .. } | HandshakeState::GotDescriptors { .. },
            ) => Some(metadata.extensions),
            _ => None,
        };
        let state = std::mem::replace(&mut entry.state, HandshakeState::Idle);
        let (next, output) = handshake::step(state, event, now, &entry.params);
        let took = matches!(next, HandshakeState::GotMetadata { .. } | HandshakeState::Complete(_));
        entry.state = next;
        self.retime_session(&key);
        if let (Some(extensions), true) = (advertised, took) {
            self.advertised(&key, extensions, out);
        }
        self.after_handshake(now, key, output, out);
    }

    /// Tells the step machine about a resolved handshake the step waits for.
    fn after_handshake(
        &mut self,
        now: Instant,
        key: SessionKey,
        output: HandshakeOutput,
        out: &mut Vec<DecodeAction>,
    ) {
        let failed = match output {
            HandshakeOutput::Completed => None,
            HandshakeOutput::Failed(error) => Some(error),
            _ => return,
        };
        if self.is_blocked() {
            return self.lazy_handshake_resolved(now, key, failed, out);
        }
        let event = if failed.is_some() { StepEvent::HandshakeFailed } else { StepEvent::HandshakeDone };
        let waited_for = matches!(self.step, StepState::Handshaking { .. }) && self.step_dials.remove(&key);
        // A failed dial fails nothing by itself (no error rides along): the vote decides.
        if waited_for {
            self.run_step(now, event, None, out);
        }
    }

    /// Eager: whether every session this worker's waiting requests need is complete.
    fn vote_ok(&self) -> bool {
        self.requests
            .values()
            .filter(|r| matches!(r.phase, RecvPhase::AwaitingSession))
            .all(|r| self.sessions.get(&r.target.session).is_some_and(|s| s.state.session().is_some()))
    }

    /// Runs the step machine of [`crate::step_machine`] on the worker's step state for one event
    /// whose effect on the sessions the caller has applied already (a dial it no longer waits
    /// for, a session off the lazy queue), and carries out its output; `failure` is why the step
    /// fails, for an event that raises.
    pub(super) fn run_step(
        &mut self,
        now: Instant,
        mut event: StepEvent,
        mut failure: Option<StepError>,
        out: &mut Vec<DecodeAction>,
    ) {
        loop {
            let (after, output) = step_machine::step(self.step, event);
            self.step = after;
            match output {
                StepOutput::None | StepOutput::Ignored => {}
                StepOutput::OutOfOrder => unreachable!("a step begins only on an idle worker"),
                StepOutput::CastVote { step } => {
                    let ok = self.vote_ok();
                    out.push(DecodeAction::CastVote { step, ok });
                }
                // Reads of requests whose sessions are complete start whatever the step's outcome:
                // reads never block the step, so they cannot make the group diverge, and holding
                // them back while a dead peer's dial fails step after step would starve every
                // request of the group until its deadline (found by killing a prefill process
                // under `pdkv cluster`).
                StepOutput::Ready { step } => {
                    self.post_ready_reads(now, out);
                    out.push(DecodeAction::StepReady { step });
                }
                StepOutput::FailedWithGroup { step } => {
                    self.post_ready_reads(now, out);
                    let error = StepError::GroupHandshakeFailed { step };
                    out.push(DecodeAction::StepFailed { step, error: Box::new(error) });
                }
                // Only the legacy lazy handshake dials one session after another and raises alone.
                StepOutput::DialNext { .. } | StepOutput::Raised { .. } => {
                    if let Some(next) = self.lazy_step_output(now, output, failure.take(), out) {
                        event = next;
                        continue;
                    }
                }
            }
            return;
        }
    }
}
