//! The decode worker node: one per decode rank; receives KV for the requests of each step.
//!
//! # How a driver calls it
//!
//! 1. Create one [`DecodeWorker`] per decode rank with its [`DecodeConfig`].
//! 2. At the start of every scheduler step, before the forward pass, call
//!    [`DecodeWorker::handle`] with [`DecodeEvent::StepBegin`] carrying the requests of the step
//!    whose KV lives on a prefill engine. Every worker of a TP group gets the same step number
//!    and the same requests.
//! 3. Carry out the returned [`DecodeAction`]s: dial handshakes, post reads, send releases,
//!    cast the step's vote into the group's barrier (the [`DecodeGroup`](crate::group::DecodeGroup)
//!    of the worker's DP group, which takes the MIN), and report step and request results to
//!    the scheduler (and the step's to the group).
//! 4. Feed back what happens as events: handshake reply parts or failures (keyed by the
//!    session key of the dial), the group's vote result, read completions, and
//!    [`DecodeEvent::Tick`] whenever the time returned by [`DecodeWorker::poll_timeout`] has
//!    come. Call `poll_timeout` again after every `handle`.
//! 5. A step ends for this worker with exactly one [`DecodeAction::StepReady`] or
//!    [`DecodeAction::StepFailed`]; only then may the driver enter the forward collective, and
//!    only then may it begin the next step.
//! 6. Answer every posted read with exactly one [`DecodeEvent::ReadDone`], also after
//!    [`DecodeAction::AbortReads`] asked to abort it (an aborted or flushed read is answered
//!    [`ReadOutcome::Aborted`] or [`ReadOutcome::Failed`]). The worker releases a transfer only
//!    once none of its reads can still complete: see [`crate::recv`] for the rule.
//!
//! # Handshake modes
//!
//! Eager (default): at step begin the worker dials every session the step needs that is not
//! complete, then votes ok or fail; the group's MIN decides, and on failure every worker reports
//! the same [`StepError::GroupHandshakeFailed`] for the step. Requests stay queued and the next
//! step redials. Lazy ([`Legacy::LazyHandshake`]): the worker blocks on the read path,
//! handshaking every DP rank of the remote engine one at a time; it reports the step only when
//! they are all done, while peers that needed no handshake report ready at once — the
//! divergence that leaves a TP collective waiting for its 600 s timeout. How a step goes is the
//! step machine of [`crate::step_machine`], whose table is checked in under `docs/machines/`.
//!
//! # Layout
//!
//! One concept per file, each an `impl DecodeWorker` block: this file holds the worker, its
//! dispatch and its timer; `config`, `messages` and `error` the public value types; `state` the
//! worker's own bookkeeping (sessions, requests); `route` how a request
//! finds its source rank and session; `step` a step of the fixed protocol (admission, eager
//! handshakes, the vote); `fence` the incarnation fence of [`crate::fence`] applied to the
//! requests waiting for their sessions; `reads` read planning and read completion; `lease` the
//! leases of taken and queued requests; `tick` what the clock triggers; `finish` the request
//! machine's effects and a request's end; `timers` the table of every deadline. `lazy` holds every piece of the legacy lazy handshake, which the fixed
//! path enters at one point per entry.

mod config;
mod error;
mod fence;
mod finish;
mod lazy;
mod lease;
mod messages;
mod plan;
mod reads;
mod route;
mod state;
mod step;
#[cfg(test)]
mod tests;
mod tick;
mod timers;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::handshake::{HandshakeEvent, HandshakeState};
use crate::ids::{RankId, RequestId};
#[cfg(doc)]
use crate::legacy::Legacy;
use crate::ports::SessionKey;
use crate::routing::ReadRouter;
use crate::step_machine::{StepEvent, StepState};
use crate::time::Instant;

pub use config::{DecodeConfig, ReadGranularity, MAX_WORKER_REQUESTS, MAX_WORKER_SESSIONS};
pub use error::{RecvError, StepError};
pub use messages::{DecodeAction, DecodeEvent, ReadOutcome, RecvRequest};
pub use plan::{ReadOp, ReadPlan};

use state::{Recv, SessionEntry, Waiting};
use timers::Timers;

/// The decode worker node. See the module documentation for the calling order.
#[derive(Clone, Debug, Hash)]
pub struct DecodeWorker {
    config: DecodeConfig,
    router: ReadRouter,
    sessions: BTreeMap<SessionKey, SessionEntry>,
    requests: BTreeMap<RequestId, Recv>,
    /// Requests queued by the engine, not admitted to a step yet.
    waiting: BTreeMap<RequestId, Waiting>,
    /// Where the current step is: the step machine's own state, changed only by its transitions
    /// (`run_step`, `step.rs`). The machine counts dials and sessions; the two fields below say
    /// which they are.
    step: StepState,
    /// Eager, while the step is `Handshaking`: the sessions whose dials it waits for, one for
    /// each dial the machine counts (empty otherwise).
    step_dials: BTreeSet<SessionKey>,
    /// Legacy lazy, while the step is `Blocked`: the sessions still to handshake, the first of
    /// them in flight, one for each the machine counts (empty otherwise; `lazy.rs`).
    lazy_queue: VecDeque<SessionKey>,
    /// Every deadline above (handshakes, requests, retries, renewals), ordered by time.
    timers: Timers,
}

impl DecodeWorker {
    /// A worker with no sessions and no requests.
    pub fn new(config: DecodeConfig) -> DecodeWorker {
        let router = ReadRouter::new(config.rank, config.layout, config.model.clone(), config.policy);
        DecodeWorker {
            config,
            router,
            sessions: BTreeMap::new(),
            requests: BTreeMap::new(),
            waiting: BTreeMap::new(),
            step: StepState::Idle,
            step_dials: BTreeSet::new(),
            lazy_queue: VecDeque::new(),
            timers: Timers::default(),
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> RankId {
        self.config.rank
    }

    /// Requests waiting for or receiving KV.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Requests the engine queued that this worker keeps leased.
    pub fn queued_requests(&self) -> usize {
        self.waiting.len()
    }

    /// Sessions with a dial outstanding, and the rank each was dialled at, in key order (who this
    /// worker waits for, for a wait-for graph).
    pub fn waiting_sessions(&self) -> Vec<(SessionKey, RankId)> {
        self.sessions.iter().filter(|(_, s)| s.state.is_waiting()).map(|(k, s)| (k.clone(), s.rank)).collect()
    }

    /// The state of a session, if the worker knows it.
    pub fn session_state(&self, session: &SessionKey) -> Option<&HandshakeState> {
        self.sessions.get(session).map(|s| &s.state)
    }

    /// The earliest time the worker must be ticked, if any timer is armed: the first entry of
    /// its timer table (`timers.rs`).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.first()
    }

    /// Applies one event; actions are appended to `out` in the order they must be carried out.
    pub fn handle(&mut self, now: Instant, event: DecodeEvent, out: &mut Vec<DecodeAction>) {
        match event {
            DecodeEvent::StepBegin { step, requests } => self.on_step_begin(now, step, requests, out),
            DecodeEvent::Queued { requests } => self.on_queued(now, requests, out),
            DecodeEvent::Dequeued { requests } => self.on_dequeued(&requests),
            DecodeEvent::HandshakeMetadata { session, metadata } => {
                self.on_handshake(now, session, HandshakeEvent::Metadata(*metadata), out)
            }
            DecodeEvent::HandshakeDescriptors { session, layers } => {
                self.on_handshake(now, session, HandshakeEvent::Descriptors(layers), out)
            }
            DecodeEvent::HandshakeFailed { session, reason } => {
                self.on_handshake(now, session, HandshakeEvent::TransportFailed(reason), out)
            }
            DecodeEvent::VoteResult { step, ok } => {
                self.run_step(now, StepEvent::VoteResult { step, ok }, None, out)
            }
            DecodeEvent::ReadDone { request, layer, outcome } => {
                self.on_read_done(now, request, layer, outcome, out)
            }
            DecodeEvent::Tick => self.on_tick(now, out),
        }
    }
}
