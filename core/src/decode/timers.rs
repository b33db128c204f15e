//! The worker's deadlines in one ordered table, so that [`DecodeWorker::poll_timeout`] is its
//! first entry instead of a scan of every session, request and retry on each call (a driver calls
//! it after every event). The deadlines themselves stay where they belong (a session's handshake
//! machine, a request, a queued request, a refused read's retry); the table is their index, and
//! every change to one of them is followed by a `retime_*` call for the thing changed.

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::RequestId;
use crate::ports::SessionKey;
use crate::time::Instant;

use super::state::RecvPhase;
use super::DecodeWorker;

/// What a deadline is for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Timer {
    /// A queued request's next lease renewal.
    Renew(RequestId),
    /// A session's outstanding dial.
    Handshake(SessionKey),
    /// A held request's deadline (none while it drains: it then waits for answers only).
    Request(RequestId),
    /// The retry of a request's read of one layer (`None`: every layer) refused by a full queue.
    Retry(RequestId, Option<u16>),
}

/// Deadlines by time, and the time of each timer (to move or remove it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(super) struct Timers {
    by_time: BTreeSet<(Instant, Timer)>,
    by_timer: BTreeMap<Timer, Instant>,
}

impl Timers {
    /// The earliest deadline, if any.
    pub(super) fn first(&self) -> Option<Instant> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Arms `timer` at `at`, or disarms it (`None`).
    pub(super) fn set(&mut self, timer: Timer, at: Option<Instant>) {
        if self.by_timer.get(&timer).copied() == at {
            return;
        }
        if let Some(old) = self.by_timer.remove(&timer) {
            self.by_time.remove(&(old, timer.clone()));
        }
        if let Some(at) = at {
            self.by_time.insert((at, timer.clone()));
            self.by_timer.insert(timer, at);
        }
    }

    /// Disarms every retry of `request`.
    fn clear_retries(&mut self, request: RequestId) {
        let range = Timer::Retry(request, None)..=Timer::Retry(request, Some(u16::MAX));
        let armed: Vec<Timer> = self.by_timer.range(range).map(|(timer, _)| timer.clone()).collect();
        for timer in armed {
            self.set(timer, None);
        }
    }
}

impl DecodeWorker {
    /// The table agrees with the handshake deadline of `session` again.
    pub(super) fn retime_session(&mut self, session: &SessionKey) {
        let at = self.sessions.get(session).and_then(|s| s.state.deadline());
        self.timers.set(Timer::Handshake(session.clone()), at);
    }

    /// The table agrees with the deadline and the retries of `request` again (none once it has
    /// ended or while it drains). Called after every change to a held request (`transition`)
    /// and when one is taken, so it does only what such a change can need: a request is taken
    /// waiting for its session (its deadline is armed then and never moves while it is held);
    /// a retry is armed while its `due` is set, and its entry stays in `retries` until its read
    /// is answered, which can only happen once it was posted again (`due` unset), so every retry
    /// the table may hold for a reading request is one of those entries.
    pub(super) fn retime_request(&mut self, request: RequestId) {
        match self.requests.get(&request).map(|r| (&r.phase, r.deadline)) {
            Some((RecvPhase::AwaitingSession, deadline)) => {
                self.timers.set(Timer::Request(request), Some(deadline))
            }
            Some((RecvPhase::Reading { retries, .. }, _)) => {
                for (layer, retry) in retries {
                    self.timers.set(Timer::Retry(request, *layer), retry.due);
                }
            }
            Some((RecvPhase::Draining { .. }, _)) | None => {
                self.timers.set(Timer::Request(request), None);
                self.timers.clear_retries(request);
            }
        }
    }

    /// The table agrees with the lease renewal of queued `request` again (none once admitted).
    pub(super) fn retime_queued(&mut self, request: RequestId) {
        let at = self.waiting.get(&request).map(|w| w.renew_at);
        self.timers.set(Timer::Renew(request), at);
    }

    /// The table built afresh from every queued request, session, request and retry: what the
    /// kept table must equal, for the tests that check it does.
    #[cfg(test)]
    pub(super) fn timers_by_scan(&self) -> Timers {
        let mut table = Timers::default();
        for (id, waiting) in &self.waiting {
            table.set(Timer::Renew(*id), Some(waiting.renew_at));
        }
        for (key, entry) in &self.sessions {
            table.set(Timer::Handshake(key.clone()), entry.state.deadline());
        }
        for (id, recv) in &self.requests {
            if matches!(recv.phase, RecvPhase::Draining { .. }) {
                continue;
            }
            table.set(Timer::Request(*id), Some(recv.deadline));
            if let RecvPhase::Reading { retries, .. } = &recv.phase {
                for (layer, retry) in retries {
                    table.set(Timer::Retry(*id, *layer), retry.due);
                }
            }
        }
        table
    }
}
