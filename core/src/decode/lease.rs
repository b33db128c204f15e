//! Read leases: a request's source rank is leased from the moment the worker takes the request,
//! and a request the engine queued for a later step is routed at once and its lease renewed
//! until a step admits it, so the producer's reaper never frees KV a read may still need.
//!
//! A lease is pdkv's own message, and MoRIIO's notify listener raises on a `type` it does not
//! know, which ends its thread: every later release to that rank would be lost. So a lease goes
//! only to a rank that advertised [`Extension::ReadLease`]: in its handshake metadata once the
//! worker has heard it (the rank's own word, which wins), before that in the request's
//! `pdkv_extensions`, which the rank's engine wrote in its prefill answer. The first lease is due
//! when the worker takes the request, before any dial, and a queued request's session may not be
//! dialled for minutes, so the engine's word is what lets a pdkv rank be leased from the start.
//! With neither, a lease the worker owes is held: the rank's metadata then sends every held lease
//! of that rank, or drops them when it does not take leases.
//!
//! A MoRIIO rank advertises nothing, so it is never sent a lease, and its reaper protects
//! nothing a pdkv decode rank reads: it frees a transfer `defer_timeout` after the request
//! finished, whether a read of it is in flight or the request is still queued (the historical
//! behaviour of `reaper-ignores-reads` and `no-queued-lease`, against that peer only).

use crate::fence::FenceState;
use crate::ids::RequestId;
use crate::policy::QueuedLease;
use crate::ports::SessionKey;
use crate::time::{Instant, NS_PER_MS};
use crate::wire::{Extension, Extensions, ReadLease};

use super::state::{Recv, Waiting};
use super::{DecodeAction, DecodeWorker, RecvRequest, MAX_WORKER_REQUESTS};

impl DecodeWorker {
    /// Leases `recv`'s transfer at its source for the transfer timeout: sent when the source
    /// advertised read leases, held while nothing says whether it does, nothing when it does
    /// not.
    pub(super) fn lease(&self, recv: &mut Recv, out: &mut Vec<DecodeAction>) {
        let advertised = self.advertised_by(recv);
        recv.lease_held = advertised.is_none();
        // A lease names the incarnation holding the transfer, so only that incarnation takes it:
        // one the fence found gone is not leased at all, but one whose rank last answered as
        // another incarnation still is (that answer may be the stale one, and a queued request
        // must stay leased while it waits for a step to find out).
        if advertised.is_some_and(|e| e.has(Extension::ReadLease)) && recv.fence != FenceState::Stale {
            let named = advertised.is_some_and(|e| e.has(Extension::Incarnation));
            out.push(self.lease_action(recv, named));
        }
    }

    /// The key to MAC a message to a rank that advertised `advertised` with: this worker's key,
    /// if it has one and the rank advertised `auth` (a rank without the key could not check it,
    /// and a MoRIIO rank is sent nothing it does not know).
    pub(super) fn control_key_for(&self, advertised: Option<Extensions>) -> Option<&crate::auth::ControlKey> {
        self.config.control_key.as_ref().filter(|_| advertised.is_some_and(|e| e.has(Extension::Auth)))
    }

    /// What the source of `recv` advertised: its own metadata once heard (which wins), else
    /// its engine's word in the request's parameters; `None` while nothing said.
    pub(super) fn advertised_by(&self, recv: &Recv) -> Option<Extensions> {
        let heard = self.sessions.get(&recv.target.session).and_then(|s| s.extensions);
        heard.or(recv.engine_extensions)
    }

    fn lease_action(&self, recv: &Recv, named: bool) -> DecodeAction {
        let lease_ms = self.config.transfer_timeout_ns.div_ceil(NS_PER_MS).clamp(1, u64::from(u32::MAX));
        DecodeAction::SendLease {
            rank: recv.target.source,
            endpoint: recv.target.notify.clone(),
            lease: Box::new({
                let mut lease = ReadLease {
                    transfer_id: recv.transfer_id.clone(),
                    lease_ms: lease_ms as u32,
                    incarnation: recv.incarnation.filter(|_| named),
                    mac: None,
                };
                lease.mac =
                    self.control_key_for(self.advertised_by(recv)).map(|k| crate::auth::lease_mac(k, &lease));
                lease
            }),
        }
    }

    /// The rank of `session` advertised `extensions` (its metadata arrived from the engine
    /// dialled): the leases held for it are sent now, in request order, or dropped.
    pub(super) fn advertised(
        &mut self,
        session: &SessionKey,
        extensions: Extensions,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(entry) = self.sessions.get_mut(session) else { return };
        entry.extensions = Some(extensions);
        let held = |r: &Recv| r.lease_held && r.target.session == *session;
        let taken: Vec<RequestId> =
            self.requests.iter().filter(|(_, r)| held(r)).map(|(id, _)| *id).collect();
        let queued: Vec<RequestId> =
            self.waiting.iter().filter(|(_, w)| held(&w.recv)).map(|(id, _)| *id).collect();
        for id in taken {
            let mut recv = self.requests.remove(&id).expect("listed above");
            self.lease(&mut recv, out);
            self.requests.insert(id, recv);
        }
        for id in queued {
            let mut waiting = self.waiting.remove(&id).expect("listed above");
            self.lease(&mut waiting.recv, out);
            self.waiting.insert(id, waiting);
        }
    }

    /// How often a queued request's lease is renewed: half the lease, so a renewal delayed by up
    /// to half a lease still arrives before the previous one ends.
    fn renew_every_ns(&self) -> u64 {
        (self.config.transfer_timeout_ns / 2).max(NS_PER_MS)
    }

    /// Routes the requests the engine queued and leases their sources until they are admitted.
    pub(super) fn on_queued(
        &mut self,
        now: Instant,
        requests: Vec<RecvRequest>,
        out: &mut Vec<DecodeAction>,
    ) {
        if self.config.policy.queued_lease == QueuedLease::Unleased {
            // The historical worker hears of a request only when a step admits it.
            return;
        }
        for request in requests {
            let id = request.request;
            if self.requests.contains_key(&id)
                || self.waiting.contains_key(&id)
                || self.waiting.len() >= MAX_WORKER_REQUESTS
            {
                continue;
            }
            if let Ok(mut recv) = self.route(now, &request) {
                self.lease(&mut recv, out);
                let renew_at = now.add_ns(self.renew_every_ns());
                self.waiting.insert(id, Waiting { recv, renew_at });
                self.retime_queued(id);
            }
        }
    }

    /// Renews the leases of queued requests that are due.
    pub(super) fn renew_leases(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        let due: Vec<RequestId> =
            self.waiting.iter().filter(|(_, w)| w.renew_at <= now).map(|(id, _)| *id).collect();
        let every = self.renew_every_ns();
        for id in due {
            let mut waiting = self.waiting.remove(&id).expect("listed above");
            self.lease(&mut waiting.recv, out);
            waiting.renew_at = now.add_ns(every);
            self.waiting.insert(id, waiting);
            self.retime_queued(id);
        }
    }

    /// Stops renewing the leases of queued requests the engine took back.
    pub(super) fn on_dequeued(&mut self, requests: &[RequestId]) {
        for &id in requests {
            if self.waiting.remove(&id).is_some() {
                self.retime_queued(id);
            }
        }
    }
}
