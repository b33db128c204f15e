//! The incarnation fence: a decode worker acts on a transfer only through a session with the
//! prefill incarnation that holds it.
//!
//! # The rule
//!
//! A prefill rank's memory, block ids and registered transfers belong to one incarnation of its
//! process ([`Incarnation`](crate::ids::Incarnation)). A pdkv prefill engine names, in its
//! answer, the incarnation of every rank that holds the transfer (`pdkv_incarnations`), and a
//! rank names its own incarnation in its handshake metadata (`pdkv_incarnation`). Before a decode
//! worker posts a read, sends a lease or a release for a transfer, the session it would use must
//! be the incarnation the transfer names. A prefill rank that crashed and restarted answers a new
//! handshake with a new incarnation, so a transfer prefilled before the restart and dispatched
//! after it is never read from the new incarnation's memory, where its block ids are free or
//! belong to another request (a silent read of wrong KV on hardware).
//!
//! Incarnations are not ordered, so a worker cannot tell from two values which one is older.
//! When the session names another incarnation than the transfer, the session may be the old one
//! (the rank restarted after the session was made, and the transfer is the new incarnation's) or
//! the transfer may be (it was prefilled before the restart). The worker drops the session and
//! dials again ([`FenceOutput::Redial`]): the rank answers with its one live incarnation. If that
//! is still not the transfer's, the incarnation that held the transfer is gone with its memory,
//! and the request fails without a read, a lease or a release ([`FenceOutput::FailUnreleased`]):
//! nothing of the transfer is left to free, and the live incarnation never had it.
//!
//! A transfer that names no incarnation (a MoRIIO engine's answer) is not fenced; nor is any
//! transfer under the legacy `no-incarnation-fence`
//! ([`IncarnationRule::Unfenced`](crate::policy::IncarnationRule)).
//!
//! The machine keeps one [`FenceState`] per request; [`step`] is pure and total, and
//! [`transition_table`] lists it for the checked-in table under `docs/machines/`.

use crate::ids::Incarnation;
use crate::policy::IncarnationRule;

/// Where one request is with the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FenceState {
    /// No complete session compared with the transfer yet.
    Unchecked,
    /// The session named another incarnation: it was dropped and is being dialled again.
    Redialling,
    /// The session is the incarnation holding the transfer (or nothing is fenced).
    Cleared,
    /// The incarnation holding the transfer is gone: the request failed, nothing released.
    Stale,
}

impl FenceState {
    /// The state's name, as in the transition table.
    pub fn kind(&self) -> String {
        format!("{self:?}")
    }
}

/// What a complete session says, compared with the transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceEvent {
    /// The session names the incarnation the transfer names.
    Matches,
    /// The session names another incarnation, or none.
    Differs,
    /// The transfer names no incarnation, or the rule does not fence: nothing to compare.
    Unfenced,
}

impl FenceEvent {
    /// The event for a transfer naming `transfer` and a session naming `session`, under `rule`.
    pub fn of(
        rule: IncarnationRule,
        transfer: Option<Incarnation>,
        session: Option<Incarnation>,
    ) -> FenceEvent {
        match transfer {
            _ if !rule.fences() => FenceEvent::Unfenced,
            None => FenceEvent::Unfenced,
            Some(t) if session == Some(t) => FenceEvent::Matches,
            Some(_) => FenceEvent::Differs,
        }
    }
}

/// What a fence transition asks the worker to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceOutput {
    /// Read (and lease, and release) through the session.
    Proceed,
    /// Drop the session and dial again; the answer decides.
    Redial,
    /// Fail the request without reading, leasing or releasing: its holder is gone.
    FailUnreleased,
    /// Nothing: the request failed already.
    Ignored,
}

/// One fence transition. Pure, total, never panics.
pub fn step(state: FenceState, event: FenceEvent) -> (FenceState, FenceOutput) {
    use FenceEvent as E;
    use FenceOutput as O;
    use FenceState as S;
    match (state, event) {
        (S::Stale, _) => (S::Stale, O::Ignored),
        (_, E::Matches | E::Unfenced) => (S::Cleared, O::Proceed),
        (S::Unchecked, E::Differs) => (S::Redialling, O::Redial),
        // A fresh handshake (or one after the session had matched: the rank moved on) answered
        // with another incarnation: the one holding the transfer is gone.
        (S::Redialling | S::Cleared, E::Differs) => (S::Stale, O::FailUnreleased),
    }
}

/// One row of the fence's transition table.
pub type FenceRow = crate::machine::TableRow;

/// Applies every event to every state and records the result.
pub fn transition_table() -> Vec<FenceRow> {
    let states = [FenceState::Unchecked, FenceState::Redialling, FenceState::Cleared, FenceState::Stale];
    let events: Vec<(String, FenceEvent)> = [
        ("Matches", FenceEvent::Matches),
        ("Differs", FenceEvent::Differs),
        ("Unfenced", FenceEvent::Unfenced),
    ]
    .into_iter()
    .map(|(n, e)| (n.to_string(), e))
    .collect();
    crate::machine::walk(&states, &events, step, FenceState::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inc(n: u64) -> Option<Incarnation> {
        Incarnation::new(n)
    }

    /// (rule, transfer's incarnation, session's) -> the event.
    #[test]
    fn events_compare_the_transfer_with_the_session() {
        let check = |rule, transfer, session, expected| {
            assert_eq!(
                FenceEvent::of(rule, transfer, session),
                expected,
                "{rule:?} {transfer:?} {session:?}"
            );
        };
        use IncarnationRule::{Fenced, Unfenced};
        check(Fenced, inc(1), inc(1), FenceEvent::Matches);
        check(Fenced, inc(1), inc(2), FenceEvent::Differs);
        check(Fenced, inc(1), None, FenceEvent::Differs);
        check(Fenced, None, inc(2), FenceEvent::Unfenced);
        check(Fenced, None, None, FenceEvent::Unfenced);
        check(Unfenced, inc(1), inc(2), FenceEvent::Unfenced);
    }

    /// A transfer of a restarted rank's old incarnation: the session of the new one differs, a
    /// redial answers the new one again, and the request fails unreleased. A session left from
    /// before a restart, with a transfer of the new incarnation: the redial answers the new one
    /// and the request proceeds.
    #[test]
    fn a_differing_session_is_redialled_once_and_the_answer_decides() {
        let (s, out) = step(FenceState::Unchecked, FenceEvent::Differs);
        assert_eq!((s, out), (FenceState::Redialling, FenceOutput::Redial));
        assert_eq!(step(s, FenceEvent::Differs), (FenceState::Stale, FenceOutput::FailUnreleased));
        assert_eq!(step(s, FenceEvent::Matches), (FenceState::Cleared, FenceOutput::Proceed));
        assert_eq!(step(FenceState::Stale, FenceEvent::Matches), (FenceState::Stale, FenceOutput::Ignored));
    }
}
