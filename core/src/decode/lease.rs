//! Read leases: a request's source rank is leased from the moment the worker takes the request,
//! and a request the engine queued for a later step is routed at once and its lease renewed
//! until a step admits it, so the producer's reaper never frees KV a read may still need.

use crate::ids::RequestId;
use crate::policy::QueuedLease;
use crate::time::{Instant, NS_PER_MS};
use crate::wire::ReadLease;

use super::state::{Recv, Waiting};
use super::{DecodeAction, DecodeWorker, RecvRequest, MAX_WORKER_REQUESTS};

impl DecodeWorker {
    /// The lease of `recv`'s transfer at its source, for the transfer timeout.
    pub(super) fn lease(&self, recv: &Recv) -> DecodeAction {
        let lease_ms = self.config.transfer_timeout_ns.div_ceil(NS_PER_MS).clamp(1, u64::from(u32::MAX));
        DecodeAction::SendLease {
            rank: recv.target.source,
            endpoint: recv.target.notify.clone(),
            lease: ReadLease { transfer_id: recv.transfer_id.clone(), lease_ms: lease_ms as u32 },
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
            if let Ok(recv) = self.route(now, &request) {
                out.push(self.lease(&recv));
                let renew_at = now.add_ns(self.renew_every_ns());
                self.waiting.insert(id, Waiting { recv, renew_at });
            }
        }
    }

    /// Renews the leases of queued requests that are due.
    pub(super) fn renew_leases(&mut self, now: Instant, out: &mut Vec<DecodeAction>) {
        let due: Vec<RequestId> =
            self.waiting.iter().filter(|(_, w)| w.renew_at <= now).map(|(id, _)| *id).collect();
        let every = self.renew_every_ns();
        for id in due {
            let lease = self.lease(&self.waiting[&id].recv);
            out.push(lease);
            self.waiting.get_mut(&id).expect("listed above").renew_at = now.add_ns(every);
        }
    }
}
