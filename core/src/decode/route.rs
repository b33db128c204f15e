//! Taking a request: admitting the requests of a step, routing each to its source rank (the
//! rules of [`crate::routing`]), deriving its session, handshake and notify endpoints from that
//! one rank, and registering the session it will read through.

use crate::fence::FenceState;
use crate::handshake::{HandshakeParams, HandshakeState};
use crate::ids::{RankId, RequestId, TransferId};
use crate::policy::NotifyRule;
use crate::ports::{EngineAddress, ListenerKind, ReadTarget};
use crate::release::release_ranks;
use crate::routing;
use crate::time::Instant;

use super::state::{Recv, RecvPhase, SessionEntry};
use super::{DecodeAction, DecodeWorker, RecvError, RecvRequest, MAX_WORKER_REQUESTS, MAX_WORKER_SESSIONS};

impl DecodeWorker {
    /// Takes the requests of a step: each is routed (unless it was when it was queued), gets its
    /// local blocks, its deadline and a lease of its transfer; one that cannot be taken fails at
    /// once.
    pub(super) fn admit(&mut self, now: Instant, requests: Vec<RecvRequest>, out: &mut Vec<DecodeAction>) {
        for request in requests {
            let id = request.request;
            if self.requests.contains_key(&id) {
                continue;
            }
            if self.requests.len() >= MAX_WORKER_REQUESTS {
                self.waiting.remove(&id);
                self.retime_queued(id);
                self.fail_unrouted(id, &request.local_block_ids, RecvError::TooManyRequests, out);
                continue;
            }
            // A queued request was routed when it was queued: the flexible pick is made once.
            let admitted = match self.waiting.remove(&id) {
                Some(waiting) => Ok(waiting.recv),
                None => self.route(now, &request),
            };
            self.retime_queued(id);
            let admitted = admitted.and_then(|mut recv| {
                if recv.remote_block_ids.len() != request.local_block_ids.len() {
                    return Err(RecvError::BlockCountMismatch {
                        remote: recv.remote_block_ids.len(),
                        local: request.local_block_ids.len(),
                    });
                }
                recv.local_block_ids = request.local_block_ids.as_slice().into();
                recv.arrived = now;
                recv.deadline = now.add_ns(self.config.transfer_timeout_ns);
                Ok(recv)
            });
            match admitted {
                Ok(mut recv) => {
                    // Lease the transfer as soon as the worker takes the request: its handshake
                    // may take a while (a lost reply costs a handshake timeout and a step), and
                    // its reads end by its deadline at the latest, when it fails and releases.
                    self.lease(&mut recv, out);
                    self.requests.insert(id, recv);
                    self.retime_request(id);
                }
                Err(error) => self.fail_unrouted(id, &request.local_block_ids, error, out),
            }
        }
    }

    /// Resolves the source of a request and derives every address from it, without looking at
    /// its local blocks (a queued request has none yet).
    pub(super) fn route(&mut self, now: Instant, request: &RecvRequest) -> Result<Recv, RecvError> {
        // The rules between this engine and the prefill engine decide whom the release goes to.
        let policy =
            self.config.policy.between(&self.config.peers, request.prefill_engine, self.config.rank.engine);
        let params = &request.params;
        let transfer_id = TransferId::new(params.transfer_id.clone().ok_or(RecvError::MissingTransferId)?);
        let remote = params.prefill_layout(policy.tp_size).map_err(RecvError::Params)?;
        let owner = params.owner_dp().map_err(RecvError::Params)?;
        let remote_block_ids: Vec<u32> = params
            .remote_block_ids
            .single_group()
            .map_err(RecvError::Params)?
            .iter()
            .map(|&b| u32::try_from(b).map_err(|_| RecvError::BlockIdTooLarge(b)))
            .collect::<Result<_, _>>()?;
        let holders = params.holder_incarnations(remote.tp).map_err(RecvError::Params)?;
        let holder = |tp: u16| holders.as_ref().and_then(|h| h.get(usize::from(tp)).copied());
        let source =
            self.router.resolve(request.prefill_engine, remote, owner).map_err(RecvError::Routing)?;
        let address = &request.prefill_address;
        let target = ReadTarget::for_engine(address, remote, source.rank, policy.session_key)
            .map_err(RecvError::Port)?;
        let notify_rank = match policy.notify {
            NotifyRule::RankRead => target.source,
            NotifyRule::Recomputed => {
                // The historical release path recomputed its target without the owner DP rank
                // and without the flexible pick, so it could notify a rank other than the one read.
                let tp = routing::fixed_tp_source(self.config.layout.tp, self.config.rank.tp, remote.tp)
                    .map_err(RecvError::Routing)?;
                RankId::new(source.rank.engine, 0, tp)
            }
        };
        let (layout, rank) = (self.config.layout, self.config.rank);
        let releases = release_ranks(policy.release_plan, notify_rank, layout.tp, rank.tp, remote.tp)
            .map_err(RecvError::Routing)?
            .into_iter()
            .map(|to| {
                let endpoint = if to == target.source {
                    target.notify.clone()
                } else {
                    address.dial(remote, to, ListenerKind::Notify).map_err(RecvError::Port)?
                };
                Ok((to, endpoint, holder(to.tp)))
            })
            .collect::<Result<_, RecvError>>()?;
        // A held request's session is always known: every step indexes the sessions by it.
        self.ensure_session(&target, address)?;
        Ok(Recv {
            transfer_id,
            target,
            releases,
            remote_block_ids: remote_block_ids.into(),
            local_block_ids: request.local_block_ids.as_slice().into(),
            remote,
            address: address.clone(),
            deadline: now.add_ns(self.config.transfer_timeout_ns),
            arrived: now,
            phase: RecvPhase::AwaitingSession,
            engine_extensions: params.advertised_extensions(),
            lease_held: false,
            incarnation: holder(source.rank.tp),
            fence: FenceState::Unchecked,
        })
    }

    /// A request that failed before it had a source: no release can be addressed; the producer's
    /// reaper frees its blocks.
    fn fail_unrouted(
        &mut self,
        request: RequestId,
        blocks: &[u32],
        error: RecvError,
        out: &mut Vec<DecodeAction>,
    ) {
        out.push(DecodeAction::InvalidateBlocks { request, block_ids: blocks.to_vec() });
        out.push(DecodeAction::RequestFailed { request, error });
    }

    /// Registers the session of `target` if the worker does not know it yet; fails when that
    /// would pass [`MAX_WORKER_SESSIONS`]. Sessions are never dropped (a stale one is only reset),
    /// so once this succeeded the session stays known.
    pub(super) fn ensure_session(
        &mut self,
        target: &ReadTarget,
        address: &EngineAddress,
    ) -> Result<(), RecvError> {
        if self.sessions.contains_key(&target.session) {
            return Ok(());
        }
        if self.sessions.len() >= MAX_WORKER_SESSIONS {
            return Err(RecvError::TooManySessions);
        }
        let entry = SessionEntry {
            rank: target.source,
            endpoint: target.handshake.clone(),
            params: HandshakeParams {
                expected_engine_id: address.engine_id(),
                timeout_ns: self.config.policy.handshake_timeout.of(self.config.handshake_timeout_ns),
            },
            state: HandshakeState::Idle,
            extensions: None,
        };
        self.sessions.insert(target.session.clone(), entry);
        Ok(())
    }
}
