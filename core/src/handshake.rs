//! The handshake machine: one per remote rank a decode worker reads, keyed by session key.
//!
//! A dial sends MoRIIO's metadata request; the reply brings two parts, the engine metadata and
//! the per-layer memory descriptors, which may be delivered separately. A session is complete
//! only when both arrived and the metadata names the engine that was dialled. A dial has a
//! deadline (`handshake_timeout_ns`, 10 s by default) unless the legacy
//! [`Legacy::NoHandshakeTimeout`](crate::legacy::Legacy::NoHandshakeTimeout) removes it, in
//! which case a lost reply leaves the machine waiting forever — the historical hang.
//!
//! The machine is a pure function, [`step`], so that its whole transition table can be listed
//! ([`transition_table`]) and checked in as a snapshot and a Graphviz picture.

use std::fmt;

use crate::time::Instant;
use crate::wire::{Extensions, HandshakeMetadata, LayerMemoryDesc};

/// What a completed handshake taught the decode worker about one remote rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Session {
    /// The first reply frame: engine id, region base addresses, block count and length.
    pub metadata: HandshakeMetadata,
    /// The second reply frame: memory descriptors per layer.
    pub layers: Vec<LayerMemoryDesc>,
    /// When the session became complete.
    pub completed_at: Instant,
}

/// Why a handshake did not complete.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum HandshakeError {
    /// No complete reply before the deadline.
    Timeout {
        /// How long the dial waited, in nanoseconds.
        waited_ns: u64,
    },
    /// The transport reported the dial failed (connection refused, peer gone).
    Transport(String),
    /// The reply came from another engine than the one dialled (a port collision or a stale
    /// listener answered).
    WrongEngine {
        /// The engine id the worker dialled.
        expected: String,
        /// The engine id the reply carried.
        got: String,
    },
    /// The session was complete, but a read through it failed (with this reason): it may be
    /// stale (the remote rank restarted and its memory keys are gone), so it was invalidated and
    /// the next step that needs the rank dials again. No dial failed.
    Invalidated(String),
    /// The session was complete, but a request named another incarnation of the rank than the
    /// session's (see [`crate::fence`]): it was dropped so that a fresh handshake says which
    /// incarnation is live. No dial failed.
    Superseded,
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::Timeout { waited_ns } => {
                write!(f, "no handshake reply within {} ms", waited_ns / 1_000_000)
            }
            HandshakeError::Transport(reason) => write!(f, "handshake dial failed: {reason}"),
            HandshakeError::WrongEngine { expected, got } => {
                write!(f, "dialled engine {expected} but {got} answered")
            }
            HandshakeError::Invalidated(reason) => {
                write!(f, "session invalidated after a failed read: {reason}")
            }
            HandshakeError::Superseded => {
                write!(f, "session dropped: a transfer names another incarnation of the rank")
            }
        }
    }
}

impl std::error::Error for HandshakeError {}

/// The state of one remote rank's handshake.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HandshakeState {
    /// Never dialled.
    Idle,
    /// Dialled; neither reply part has arrived.
    Dialing {
        /// When the dial was sent.
        since: Instant,
        /// When the dial gives up; `None` under the legacy no-timeout option.
        deadline: Option<Instant>,
    },
    /// The metadata arrived; the memory descriptors have not.
    GotMetadata {
        /// When the dial was sent.
        since: Instant,
        /// When the dial gives up; `None` without a timeout.
        deadline: Option<Instant>,
        /// The metadata received.
        metadata: HandshakeMetadata,
    },
    /// The memory descriptors arrived; the metadata has not.
    GotDescriptors {
        /// When the dial was sent.
        since: Instant,
        /// When the dial gives up; `None` without a timeout.
        deadline: Option<Instant>,
        /// The descriptors received.
        layers: Vec<LayerMemoryDesc>,
    },
    /// Both parts arrived: reads may use this session.
    Complete(Session),
    /// The last dial failed, or the session was invalidated after a failed read; a later dial
    /// retries.
    Failed {
        /// Why it failed.
        error: HandshakeError,
        /// When it failed.
        at: Instant,
    },
}

impl HandshakeState {
    /// The state's name without its data, as in the transition table.
    pub fn kind(&self) -> &'static str {
        match self {
            HandshakeState::Idle => "Idle",
            HandshakeState::Dialing { .. } => "Dialing",
            HandshakeState::GotMetadata { .. } => "GotMetadata",
            HandshakeState::GotDescriptors { .. } => "GotDescriptors",
            HandshakeState::Complete(_) => "Complete",
            HandshakeState::Failed { .. } => "Failed",
        }
    }

    /// The deadline the driver must wake the machine at, if it is waiting with one.
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            HandshakeState::Dialing { deadline, .. }
            | HandshakeState::GotMetadata { deadline, .. }
            | HandshakeState::GotDescriptors { deadline, .. } => *deadline,
            _ => None,
        }
    }

    /// True while a dial is outstanding.
    pub fn is_waiting(&self) -> bool {
        matches!(
            self,
            HandshakeState::Dialing { .. }
                | HandshakeState::GotMetadata { .. }
                | HandshakeState::GotDescriptors { .. }
        )
    }

    /// The session, once complete.
    pub fn session(&self) -> Option<&Session> {
        match self {
            HandshakeState::Complete(session) => Some(session),
            _ => None,
        }
    }
}

/// An input to the handshake machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandshakeEvent {
    /// The worker wants this session (a step references the rank).
    Dial,
    /// The first reply frame arrived.
    Metadata(HandshakeMetadata),
    /// The second reply frame arrived.
    Descriptors(Vec<LayerMemoryDesc>),
    /// The transport reported the dial failed.
    TransportFailed(String),
    /// A read that used the complete session failed (with this reason): the session may be
    /// stale (the remote rank restarted and its memory keys are gone), so it is dropped and the
    /// next step that needs the rank handshakes again.
    ReadFailed(String),
    /// A request named another incarnation of the rank than the complete session's (see
    /// [`crate::fence`]): the session is dropped and the next step that needs the rank
    /// handshakes again, so the rank says which incarnation is live.
    Superseded,
    /// The driver's clock passed a deadline from [`HandshakeState::deadline`].
    Tick,
}

impl HandshakeEvent {
    /// The event's name without its data, as in the transition table.
    pub fn kind(&self) -> &'static str {
        match self {
            HandshakeEvent::Dial => "Dial",
            HandshakeEvent::Metadata(_) => "Metadata",
            HandshakeEvent::Descriptors(_) => "Descriptors",
            HandshakeEvent::TransportFailed(_) => "TransportFailed",
            HandshakeEvent::ReadFailed(_) => "ReadFailed",
            HandshakeEvent::Superseded => "Superseded",
            HandshakeEvent::Tick => "Tick",
        }
    }
}

/// What a transition asks the worker to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandshakeOutput {
    /// Nothing.
    None,
    /// Send the metadata request to the remote rank's handshake listener.
    SendRequest,
    /// The session became complete.
    Completed,
    /// The dial failed, or the complete session was invalidated, with this error.
    Failed(HandshakeError),
    /// The event does not apply in this state (a late or duplicated reply); it was ignored.
    Ignored,
}

/// Fixed facts of one machine: which engine it dials and its timeout.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HandshakeParams {
    /// MoRIIO engine id the reply must carry (`"<host>:<handshake port base>"`).
    pub expected_engine_id: String,
    /// Deadline of a dial, in nanoseconds; `None` waits forever (legacy).
    pub timeout_ns: Option<u64>,
}

/// One transition: the next state and what to do. Never panics; events that do not apply are
/// reported as [`HandshakeOutput::Ignored`] and leave the state as it was.
pub fn step(
    state: HandshakeState,
    event: HandshakeEvent,
    now: Instant,
    params: &HandshakeParams,
) -> (HandshakeState, HandshakeOutput) {
    use HandshakeEvent as E;
    use HandshakeState as S;
    let deadline = params.timeout_ns.map(|ns| now.add_ns(ns));
    let check_engine = |metadata: &HandshakeMetadata| -> Result<(), HandshakeError> {
        if metadata.engine_id == params.expected_engine_id {
            Ok(())
        } else {
            Err(HandshakeError::WrongEngine {
                expected: params.expected_engine_id.clone(),
                got: metadata.engine_id.clone(),
            })
        }
    };
    let fail =
        |error: HandshakeError| (S::Failed { error: error.clone(), at: now }, HandshakeOutput::Failed(error));
    match (state, event) {
        // A dial starts from Idle or Failed; a waiting or complete machine does not redial.
        (S::Idle | S::Failed { .. }, E::Dial) => {
            (S::Dialing { since: now, deadline }, HandshakeOutput::SendRequest)
        }
        (S::Dialing { since, deadline }, E::Metadata(metadata)) => match check_engine(&metadata) {
            Ok(()) => (S::GotMetadata { since, deadline, metadata }, HandshakeOutput::None),
            Err(e) => fail(e),
        },
        (S::Dialing { since, deadline }, E::Descriptors(layers)) => {
            (S::GotDescriptors { since, deadline, layers }, HandshakeOutput::None)
        }
        (S::GotMetadata { metadata, .. }, E::Descriptors(layers)) => {
            (S::Complete(Session { metadata, layers, completed_at: now }), HandshakeOutput::Completed)
        }
        (S::GotDescriptors { layers, .. }, E::Metadata(metadata)) => match check_engine(&metadata) {
            Ok(()) => {
                (S::Complete(Session { metadata, layers, completed_at: now }), HandshakeOutput::Completed)
            }
            Err(e) => fail(e),
        },
        (
            S::Dialing { .. } | S::GotMetadata { .. } | S::GotDescriptors { .. },
            E::TransportFailed(reason),
        ) => fail(HandshakeError::Transport(reason)),
        (S::Complete(_), E::ReadFailed(reason)) => fail(HandshakeError::Invalidated(reason)),
        (S::Complete(_), E::Superseded) => fail(HandshakeError::Superseded),
        (state @ (S::Dialing { .. } | S::GotMetadata { .. } | S::GotDescriptors { .. }), E::Tick) => {
            match state.deadline() {
                Some(deadline) if now >= deadline => {
                    let since = match &state {
                        S::Dialing { since, .. }
                        | S::GotMetadata { since, .. }
                        | S::GotDescriptors { since, .. } => *since,
                        _ => now,
                    };
                    fail(HandshakeError::Timeout { waited_ns: now.since_ns(since) })
                }
                _ => (state, HandshakeOutput::None),
            }
        }
        (state, E::Tick) => (state, HandshakeOutput::None),
        (state, _) => (state, HandshakeOutput::Ignored),
    }
}

/// One row of the transition table: state and event kinds, the state kind after, the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransitionRow {
    /// The state before.
    pub from: &'static str,
    /// The event applied.
    pub event: String,
    /// The state after.
    pub to: &'static str,
    /// What the transition asked for.
    pub output: String,
}

/// Applies every event to every state (with representative data, the dial sent at t = 1 s with
/// a 10 s timeout, the event at the given time) and records the result.
pub fn transition_table() -> Vec<TransitionRow> {
    let params =
        HandshakeParams { expected_engine_id: "prefill-0:6301".into(), timeout_ns: Some(10_000_000_000) };
    let metadata = |engine: &str| HandshakeMetadata {
        engine_id: engine.into(),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: vec![0x1000],
        num_blocks: 1,
        block_len: 1,
        attn_backend_name: "pdkv".into(),
        rank: None,
        extensions: Extensions::NONE,
        incarnation: None,
    };
    let layers = vec![LayerMemoryDesc { layer_name: "layer.0".into(), descs: vec![vec![1]] }];
    let since = Instant(1_000_000_000);
    let deadline = Some(since.add_ns(10_000_000_000));
    let states = vec![
        HandshakeState::Idle,
        HandshakeState::Dialing { since, deadline },
        HandshakeState::GotMetadata { since, deadline, metadata: metadata("prefill-0:6301") },
        HandshakeState::GotDescriptors { since, deadline, layers: layers.clone() },
        HandshakeState::Complete(Session {
            metadata: metadata("prefill-0:6301"),
            layers: layers.clone(),
            completed_at: since,
        }),
        HandshakeState::Failed { error: HandshakeError::Timeout { waited_ns: 0 }, at: since },
    ];
    let before = Instant(2_000_000_000);
    let after = Instant(11_000_000_000);
    let events: Vec<(String, HandshakeEvent, Instant)> = vec![
        ("Dial".into(), HandshakeEvent::Dial, before),
        ("Metadata".into(), HandshakeEvent::Metadata(metadata("prefill-0:6301")), before),
        ("Metadata(wrong engine)".into(), HandshakeEvent::Metadata(metadata("prefill-1:6301")), before),
        ("Descriptors".into(), HandshakeEvent::Descriptors(layers), before),
        ("TransportFailed".into(), HandshakeEvent::TransportFailed("refused".into()), before),
        ("ReadFailed".into(), HandshakeEvent::ReadFailed("remote access error".into()), before),
        ("Superseded".into(), HandshakeEvent::Superseded, before),
        ("Tick(before deadline)".into(), HandshakeEvent::Tick, before),
        ("Tick(at deadline)".into(), HandshakeEvent::Tick, after),
    ];
    let mut rows = Vec::new();
    for state in &states {
        for (name, event, now) in &events {
            let (next, output) = step(state.clone(), event.clone(), *now, &params);
            let output = match output {
                HandshakeOutput::Failed(e) => format!("Failed: {e}"),
                other => format!("{other:?}"),
            };
            rows.push(TransitionRow { from: state.kind(), event: name.clone(), to: next.kind(), output });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(timeout_ns: Option<u64>) -> HandshakeParams {
        HandshakeParams { expected_engine_id: "prefill-0:6301".into(), timeout_ns }
    }

    fn metadata() -> HandshakeMetadata {
        HandshakeMetadata {
            engine_id: "prefill-0:6301".into(),
            agent_metadata: vec![],
            kv_caches_base_addr: vec![0],
            num_blocks: 4,
            block_len: 64,
            attn_backend_name: "x".into(),
            rank: None,
            extensions: Extensions::NONE,
            incarnation: None,
        }
    }

    #[test]
    fn complete_needs_both_parts_in_either_order() {
        let p = params(Some(100));
        for metadata_first in [true, false] {
            let (s, out) = step(HandshakeState::Idle, HandshakeEvent::Dial, Instant(0), &p);
            assert_eq!(out, HandshakeOutput::SendRequest);
            let parts = [HandshakeEvent::Metadata(metadata()), HandshakeEvent::Descriptors(vec![])];
            let (first, second) =
                if metadata_first { (&parts[0], &parts[1]) } else { (&parts[1], &parts[0]) };
            let (s, out) = step(s, first.clone(), Instant(1), &p);
            assert_eq!((s.session().is_some(), out), (false, HandshakeOutput::None));
            let (s, out) = step(s, second.clone(), Instant(2), &p);
            assert_eq!(out, HandshakeOutput::Completed);
            assert_eq!(s.session().unwrap().completed_at, Instant(2));
        }
    }

    #[test]
    fn deadline_fails_the_dial_unless_there_is_none() {
        let (s, _) = step(HandshakeState::Idle, HandshakeEvent::Dial, Instant(5), &params(Some(100)));
        assert_eq!(s.deadline(), Some(Instant(105)));
        let (s, out) = step(s, HandshakeEvent::Tick, Instant(104), &params(Some(100)));
        assert_eq!((s.kind(), out), ("Dialing", HandshakeOutput::None));
        let (s, out) = step(s, HandshakeEvent::Tick, Instant(105), &params(Some(100)));
        assert_eq!(out, HandshakeOutput::Failed(HandshakeError::Timeout { waited_ns: 100 }));
        assert_eq!(s.kind(), "Failed");
        // Legacy: no deadline, the dial waits forever.
        let (s, _) = step(HandshakeState::Idle, HandshakeEvent::Dial, Instant(5), &params(None));
        assert_eq!(s.deadline(), None);
        let (s, _) = step(s, HandshakeEvent::Tick, Instant(u64::MAX), &params(None));
        assert!(s.is_waiting());
    }

    /// A failed read drops a complete session (it may be stale) so the next dial redials; a
    /// session not complete has nothing to drop.
    #[test]
    fn a_failed_read_drops_only_a_complete_session() {
        let p = params(Some(100));
        let (dialing, _) = step(HandshakeState::Idle, HandshakeEvent::Dial, Instant(0), &p);
        let (got, _) = step(dialing.clone(), HandshakeEvent::Metadata(metadata()), Instant(1), &p);
        let (complete, _) = step(got, HandshakeEvent::Descriptors(vec![]), Instant(2), &p);
        let read_failed = HandshakeEvent::ReadFailed("remote access error".into());
        let (s, out) = step(complete, read_failed.clone(), Instant(3), &p);
        let error = HandshakeError::Invalidated("remote access error".into());
        assert_eq!(out, HandshakeOutput::Failed(error.clone()));
        assert_eq!(s, HandshakeState::Failed { error, at: Instant(3) });
        let (s, out) = step(dialing.clone(), read_failed, Instant(3), &p);
        assert_eq!((s, out), (dialing, HandshakeOutput::Ignored));
    }

    /// A session dropped after a failed read says what happened: a read through it failed and
    /// it was invalidated. No dial was involved, so the text must not blame one.
    #[test]
    fn a_session_dropped_after_a_failed_read_says_so() {
        let session = Session { metadata: metadata(), layers: vec![], completed_at: Instant(2) };
        let read_failed = HandshakeEvent::ReadFailed("remote access error".into());
        let (s, out) = step(HandshakeState::Complete(session), read_failed, Instant(3), &params(Some(100)));
        let HandshakeOutput::Failed(error) = out else { panic!("a failed read fails the session: {out:?}") };
        assert_eq!(error.to_string(), "session invalidated after a failed read: remote access error");
        assert_eq!(s, HandshakeState::Failed { error, at: Instant(3) });
    }
}
