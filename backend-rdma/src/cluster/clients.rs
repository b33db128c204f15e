//! The clients' side of a run: the proxy, the request stream, the requests in flight, and the
//! requests each ended request makes room for (`--concurrency`); a request's arrival (through
//! the proxy to a prefill group) and its end are here.

use std::collections::{BTreeMap, BTreeSet};

use pdkv_core::ids::{Incarnation, RankId, RequestId, TransferId};
use pdkv_core::proxy::{Proxy, ProxyAction};
use pdkv_core::rng::Stream;
use pdkv_engine::verdict::ViolationKind;

use super::{Cluster, Failure};

/// The stream number of the request draws (lengths; and ids, from another seed) in the
/// project's generator: the simulator's workload stream's number, and apart from stream 0, which
/// the cluster fuzzer draws its plans from with the same seed, so a plan and its run's requests
/// are not correlated.
pub(super) const REQUEST_STREAM: u64 = 1;

/// A request in flight, from its arrival to its end.
pub(super) struct Req {
    pub(super) transfer_id: TransferId,
    pub(super) input: u32,
    pub(super) output: u32,
    pub(super) prefill: (usize, u16),
    pub(super) decode: (usize, u16),
    pub(super) prefill_blocks: Vec<u32>,
    pub(super) acks_needed: BTreeSet<RankId>,
    /// The incarnation of each TP rank of the owner group whose process computed the KV (the
    /// process that acknowledged the prefill, or that died computing it).
    pub(super) holders: BTreeMap<u16, Incarnation>,
    pub(super) started: std::time::Instant,
    pub(super) first_token: Option<std::time::Instant>,
    /// An injected fault may cause its failure (see [`Cluster::expose_group`]).
    pub(super) exposed: bool,
}

/// The clients: the proxy that routes their requests, the streams the requests are drawn from,
/// the requests in flight, and those owed (sent as soon as the current one is).
pub(super) struct Clients {
    pub(super) proxy: Proxy,
    /// Request lengths, from `--seed`.
    stream: Stream,
    /// Transfer ids, from a seed the operating system drew (unguessable outside the run).
    ids: Stream,
    pub(super) requests: BTreeMap<RequestId, Req>,
    /// Requests to send as soon as the current one is sent ([`Cluster::submit_owed`]).
    pub(super) owed: u64,
    submitting: bool,
}

impl Clients {
    /// Clients with nothing sent: lengths from `seed`, transfer ids from `id_seed`.
    pub(super) fn new(proxy: Proxy, seed: u64, id_seed: u64) -> Clients {
        Clients {
            proxy,
            stream: Stream::new(seed, REQUEST_STREAM),
            ids: Stream::new(id_seed, REQUEST_STREAM),
            requests: BTreeMap::new(),
            owed: 0,
            submitting: false,
        }
    }

    /// The next request's transfer id bits, prompt and answer lengths.
    fn draw(&mut self) -> (u128, u32, u32) {
        // The seed's two draws for the id are still taken, so a seed keeps the workload it had,
        // but the id comes from a stream seeded by the operating system: a transfer id derived
        // from a seed anyone can guess is a handle anyone can forge a release for.
        let _predictable = (self.stream.next_u64(), self.stream.next_u64());
        let bits = (u128::from(self.ids.next_u64()) << 64) | u128::from(self.ids.next_u64());
        // Both ranges fit in a u32, so the casts keep every value.
        let input = self.stream.range(48, 400) as u32;
        let output = self.stream.range(4, 12) as u32;
        (bits, input, output)
    }

    /// The request in flight of a transfer.
    pub(super) fn request_of(&self, transfer_id: &TransferId) -> Option<RequestId> {
        self.requests.iter().find(|(_, r)| &r.transfer_id == transfer_id).map(|(&id, _)| id)
    }
}

impl Cluster {
    /// A client sends its next request, if any is left: drawn, routed by the proxy to a prefill
    /// DP group and queued there, or ended at once when its decode group is gone.
    pub(super) fn submit(&mut self) {
        if self.tally.sent >= u64::from(self.config.requests) {
            return;
        }
        self.tally.sent += 1;
        let (bits, input, output) = self.clients.draw();
        let (id, action) = match self.clients.proxy.handle_request(bits) {
            Ok(x) => x,
            Err(e) => {
                self.tally.violation(ViolationKind::ProtocolError, format!("proxy refused: {e}"));
                return;
            }
        };
        let ProxyAction::SendPrefill { slot, .. } = action else {
            unreachable!("a new request goes to prefill first")
        };
        let record = self.clients.proxy.request(id).expect("just routed").clone();
        let req = Req {
            transfer_id: record.transfer_id,
            input,
            output,
            prefill: (usize::from(slot.engine.index), slot.dp()),
            decode: (usize::from(record.decode.engine.index), record.decode.dp()),
            prefill_blocks: Vec::new(),
            acks_needed: BTreeSet::new(),
            holders: BTreeMap::new(),
            started: std::time::Instant::now(),
            first_token: None,
            // The group lacks a rank a fault killed: the request may fail for it.
            exposed: (0..self.d.layout(slot.engine).tp)
                .any(|tp| self.faults.down_by_fault.contains(&RankId::new(slot.engine, slot.dp(), tp))),
        };
        if req.exposed {
            self.faults.expose(req.transfer_id.clone());
        }
        self.clients.requests.insert(id, req);
        if let Some(gone) = self.gone_rank_of_group(record.decode.engine, record.decode.dp()) {
            self.end(id, Some(vec![format!("{gone} is gone")]));
            return;
        }
        let g = self.prefill.group_index(usize::from(slot.engine.index), slot.dp());
        let transfer_id = self.clients.requests[&id].transfer_id.clone();
        self.prefill.groups[g].handle_arrival(id, transfer_id, input);
        self.pump_prefill(slot.engine, slot.dp());
    }

    /// Sends the requests that ended requests made room for. A request can end while another
    /// is being sent (its group is gone), so sending is not reentrant: the outermost call sends
    /// them all, in a loop rather than a recursion as deep as the run is long.
    pub(super) fn submit_owed(&mut self) {
        if self.clients.submitting {
            return;
        }
        self.clients.submitting = true;
        while self.clients.owed > 0 {
            self.clients.owed -= 1;
            self.submit();
        }
        self.clients.submitting = false;
    }

    /// A request ended: finished (`None`) or failed with each worker's error.
    pub(super) fn end(&mut self, id: RequestId, errors: Option<Vec<String>>) {
        let Some(req) = self.clients.requests.remove(&id) else { return };
        let _ = self.clients.proxy.handle_finished(id);
        match errors {
            None => {
                let m = &self.d.model;
                let block_bytes = u64::from(m.block_size_tokens) * u64::from(m.bytes_per_token_per_layer);
                let prompt_kv_bytes = req.prefill_blocks.len() as u64 * block_bytes * u64::from(m.layers);
                let e2e_ms = req.started.elapsed().as_secs_f64() * 1e3;
                self.tally.record_finished(req.input, req.output, prompt_kv_bytes, e2e_ms);
            }
            Some(errors) => {
                let excused = req.exposed || self.touched_by_message_fault(&req);
                if excused {
                    self.faults.expose(req.transfer_id.clone());
                }
                let failure = Failure {
                    request: id.0,
                    transfer_id: req.transfer_id.to_string(),
                    prefill: format!("P{}.dp{}", req.prefill.0, req.prefill.1),
                    errors,
                };
                self.tally.record_failed(failure, excused);
            }
        }
        self.clients.owed += 1;
        self.submit_owed();
    }
}
