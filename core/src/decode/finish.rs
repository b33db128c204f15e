//! A request's machine carried out: each transition of [`crate::recv`] applied to the worker's
//! bookkeeping (aborting reads, draining), and a request's end: the release to its source and
//! the report to the scheduler.

use crate::ids::RequestId;
use crate::recv::{self, RecvEvent, RecvOutput, RecvState};
use crate::release::{Release, ReleaseSender};
use crate::wire::Extension;

use super::state::RecvPhase;
use super::{DecodeAction, DecodeWorker, RecvError};

impl DecodeWorker {
    /// Runs the request machine of [`crate::recv`] for one event whose effect on the request's
    /// reads the caller has applied already, and carries out its output; the timer table then
    /// agrees with the request (every change to a held request's phase ends here). `before` is the
    /// machine's state before the event; `error` is why the request fails, for events that fail
    /// it. Returns the machine's output.
    pub(super) fn transition(
        &mut self,
        id: RequestId,
        before: RecvState,
        event: RecvEvent,
        error: Option<RecvError>,
        out: &mut Vec<DecodeAction>,
    ) -> RecvOutput {
        let (after, output) = recv::step(before, event, self.config.policy.drain);
        let recv = self.requests.get_mut(&id).expect("transitions are of held requests");
        match output {
            RecvOutput::None | RecvOutput::Ignored | RecvOutput::PostReads => {}
            RecvOutput::Abort => {
                let in_flight = recv.phase.in_flight();
                let error = error.expect("a failing event carries its error");
                recv.phase = RecvPhase::Draining { in_flight, error };
                out.push(DecodeAction::AbortReads { request: id });
            }
            RecvOutput::Release { received: true } => self.finish_request(id, None, true, out),
            RecvOutput::Release { received: false } => {
                let error = match &recv.phase {
                    RecvPhase::Draining { error, .. } => error.clone(),
                    _ => error.expect("a failing event carries its error"),
                };
                self.finish_request(id, Some(error), true, out);
            }
            RecvOutput::FailUnreleased => {
                let error = error.expect("a failing event carries its error");
                self.finish_request(id, Some(error), false, out);
            }
        }
        // The worker's own bookkeeping must agree with the machine (the table is the spec).
        match self.requests.get(&id) {
            Some(recv) => debug_assert_eq!(recv.phase.machine(), after, "{id}: {before:?} + {event:?}"),
            None => debug_assert_eq!(after, RecvState::Ended, "{id}: {before:?} + {event:?}"),
        }
        self.retime_request(id);
        output
    }

    /// The request ended: release every rank its plan names (the source, or under vLLM 0.33's
    /// rules every holder of its share) unless `release` is false (the fence found its holder
    /// gone), and report it received or failed. A release names the incarnation holding the
    /// transfer on each rank that speaks incarnations.
    fn finish_request(
        &mut self,
        id: RequestId,
        error: Option<RecvError>,
        release: bool,
        out: &mut Vec<DecodeAction>,
    ) {
        let recv = self.requests.remove(&id).expect("caller checked");
        let advertised = self.advertised_by(&recv);
        let named = advertised.is_some_and(|e| e.has(Extension::Incarnation));
        let key = self.control_key_for(advertised);
        let message = Release {
            transfer_id: recv.transfer_id.clone(),
            consumer_tp_size: Some(self.config.layout.tp),
            sender: Some(ReleaseSender {
                engine_id: self.config.engine_id.clone(),
                dp_rank: self.config.rank.dp,
                tp_rank: self.config.rank.tp,
            }),
            incarnation: None,
            mac: None,
        };
        let releases = if release { recv.releases.as_slice() } else { &[] };
        for (rank, endpoint, incarnation) in releases {
            out.push(DecodeAction::SendRelease {
                rank: *rank,
                endpoint: endpoint.clone(),
                release: Box::new({
                    let mut release =
                        Release { incarnation: incarnation.filter(|_| named), ..message.clone() };
                    release.mac = key.map(|k| crate::auth::release_mac(k, &release));
                    release
                }),
            });
        }
        match error {
            None => out.push(DecodeAction::RequestReceived { request: id }),
            Some(error) => {
                out.push(DecodeAction::InvalidateBlocks {
                    request: id,
                    block_ids: recv.local_block_ids.to_vec(),
                });
                out.push(DecodeAction::RequestFailed { request: id, error });
            }
        }
    }
}
