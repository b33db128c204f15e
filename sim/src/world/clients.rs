//! Clients and the proxy: arrivals, request lengths, routing through the core's proxy, and
//! the end of each request.

use pdkv_core::decode::RecvRequest;
use pdkv_core::ids::{EngineId, Incarnation, RequestId, TransferId};
use pdkv_core::params::{KvTransferParams, PrefillAnswer};
use pdkv_core::proxy::{Proxy, ProxyAction, Slot};

use crate::measure::{RequestTimes, Span};
use crate::request_table::{RequestOutcome, RequestRow};
use crate::result::ViolationKind;
use crate::scenario::{Clients, Length};
use crate::trace::{Link, Phase};

use super::{Ev, World};

/// The clients' side: the proxy, what is left to send, and the requests and transfers in
/// flight.
pub(super) struct ClientSide {
    pub(super) proxy: Proxy,
    /// Requests not sent yet.
    pub(super) to_send: u64,
    /// The open loop's arrival rate per second (`None`: closed loop).
    pub(super) open_loop: Option<f64>,
    pub(super) requests: Requests,
    pub(super) transfers: super::transfers::Transfers,
    /// Keep a row per request for `requests.csv` (`RunOptions::requests`).
    pub(super) keep_rows: bool,
}

pub(super) struct Req {
    pub(super) sent_ns: u64,
    pub(super) input: u32,
    pub(super) output: u32,
    pub(super) prefill_group: usize,
    pub(super) decode_group: usize,
    pub(super) transfer: u32,

    pub(super) first_token_ns: Option<u64>,
    pub(super) done_ns: Option<u64>,
    pub(super) failed: bool,
    /// A decode worker gave up on its KV at the transfer timeout.
    pub(super) timed_out: bool,
    pub(super) prefill_blocks: Vec<u32>,
    pub(super) decode_blocks: Vec<u32>,
    /// The incarnations holding the transfer, as the prefill engine named them when it
    /// registered it, until the proxy answer carries them.
    pub(super) holders: Option<Box<[Incarnation]>>,
}

impl Req {
    /// Its times, as the steady-state figures take them.
    pub(super) fn times(&self) -> RequestTimes {
        RequestTimes {
            sent_ns: self.sent_ns,
            first_token_ns: self.first_token_ns,
            done_ns: self.done_ns,
            finished: self.done_ns.is_some() && !self.failed,
            output: self.output,
        }
    }
}

/// Every request of the run, ended or not, by id. The proxy numbers requests 1, 2, 3, ... in
/// arrival order, so a vector indexed by the number holds them: a million requests are a million
/// slots of a hundred-odd bytes, with nothing per request besides (a map kept a tree node too),
/// and an ended request's block lists are dropped when it ends.
#[derive(Default)]
pub(super) struct Requests {
    slots: Vec<Option<Req>>,
    /// Requests sent.
    sent: u64,
    /// Requests that ended (finished or failed).
    ended: u64,
}

impl Requests {
    fn slot(id: RequestId) -> usize {
        usize::try_from(id.0).expect("request numbers fit in memory")
    }

    pub(super) fn insert(&mut self, id: RequestId, req: Req) {
        let i = Self::slot(id);
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(req);
        self.sent += 1;
    }

    /// Requests sent that have not ended.
    pub(super) fn in_flight(&self) -> u64 {
        self.sent - self.ended
    }

    pub(super) fn get(&self, id: &RequestId) -> Option<&Req> {
        self.slots.get(Self::slot(*id)).and_then(Option::as_ref)
    }

    pub(super) fn get_mut(&mut self, id: &RequestId) -> Option<&mut Req> {
        self.slots.get_mut(Self::slot(*id)).and_then(Option::as_mut)
    }

    /// Every request with its id, in id order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (u64, &Req)> {
        self.slots.iter().enumerate().filter_map(|(i, r)| r.as_ref().map(|r| (i as u64, r)))
    }

    /// Every request, in id order.
    pub(super) fn values(&self) -> impl Iterator<Item = &Req> + Clone {
        self.slots.iter().flatten()
    }

    /// Requests that ended so far.
    pub(super) fn ended(&self) -> u64 {
        self.ended
    }
}

impl std::ops::Index<&RequestId> for Requests {
    type Output = Req;

    fn index(&self, id: &RequestId) -> &Req {
        self.get(id).unwrap_or_else(|| panic!("request {id} exists"))
    }
}

impl World {
    /// Records a moment of request `id`'s life on its own track (`req-N`), for the Chrome trace's
    /// async slice of the request; callers test `trace_on` first.
    pub(super) fn trace_life(&mut self, id: RequestId, name: &'static str, phase: Phase, detail: String) {
        let link = Some(Link::Life { request: id.0, phase });
        self.record_linked(self.now, "request", name, id.to_string(), None, detail, link);
    }

    /// ` request=req-N` for the request of transfer `id`, or nothing when no request of the run
    /// has it: what a trace record that names a transfer adds, so a reader can follow the request.
    pub(super) fn request_words(&self, id: &TransferId) -> String {
        self.clients
            .transfers
            .request_of(id)
            .map_or_else(String::new, |n| format!(" request={}", RequestId(n)))
    }

    /// Records the requests in flight (sent, not ended) as a counter; callers test `trace_on`.
    fn trace_in_flight(&mut self) {
        let in_flight = self.clients.requests.in_flight();
        let link = Some(Link::Counter { value: in_flight });
        self.record_linked(
            self.now,
            "request",
            "in_flight",
            "proxy".into(),
            None,
            format!("requests={in_flight}"),
            link,
        );
    }

    /// One row per request, in arrival order, for `requests.csv`: where it went (prefill DP rank
    /// and decode DP group by engine), its times and lengths, how it ended, and whether it
    /// arrived inside the steady window `span` (by arrival index, as the window counts).
    pub(super) fn request_rows(&self, span: &Span) -> Vec<RequestRow> {
        // Always with the DP rank, so written `P1.dp0` even for an engine with one.
        let slot = |engine: EngineId, base: &[usize], group: usize| Slot {
            engine,
            dp_rank: Some((group - base[usize::from(engine.index)]) as u16),
        };
        self.clients
            .requests
            .entries()
            .enumerate()
            .map(|(arrival, (id, r))| RequestRow {
                id,
                arrival_ns: r.sent_ns,
                prefill: slot(
                    EngineId::prefill(self.prefill.groups[r.prefill_group].engine as u16),
                    &self.prefill.group_base,
                    r.prefill_group,
                ),
                decode: slot(
                    EngineId::decode(self.decode.groups[r.decode_group].engine as u16),
                    &self.decode.group_base,
                    r.decode_group,
                ),
                first_token_ns: r.first_token_ns,
                done_ns: r.done_ns,
                prompt_tokens: r.input,
                output_tokens: r.output,
                outcome: match (r.done_ns, r.failed) {
                    (Some(_), false) => RequestOutcome::Finished,
                    (Some(_), true) => RequestOutcome::Failed,
                    (None, _) => RequestOutcome::Unfinished,
                },
                in_steady_window: (span.first..span.end).contains(&arrival),
            })
            .collect()
    }

    fn length(&mut self, length: Length) -> u32 {
        match length {
            Length::Fixed(n) => n,
            Length::Uniform { min, max } => self.streams.uniform(min, max),
        }
    }

    pub(super) fn on_arrival(&mut self) {
        if self.clients.to_send == 0 {
            return;
        }
        self.clients.to_send -= 1;
        if let (Some(rate), true) = (self.clients.open_loop, self.clients.to_send > 0) {
            let gap = self.streams.exponential_ns(rate);
            self.at(gap, Ev::Arrival);
        }
        let input = self.length(self.sc.workload.input_tokens).max(1);
        let output = self.length(self.sc.workload.output_tokens).max(1);
        let bits = self.streams.transfer_bits();
        let Ok((id, action)) = self.clients.proxy.handle_request(bits) else {
            // The load-time limits keep requests below the proxy's in-flight cap, so this does
            // not happen for a loaded scenario; if it does, the request is counted, not lost.
            self.stats.refused += 1;
            return;
        };
        let ProxyAction::SendPrefill { slot, params, .. } = action else {
            unreachable!("new requests go to prefill")
        };
        let prefill_group = self.prefill.group_base[usize::from(slot.engine.index)] + usize::from(slot.dp());
        let decode_slot = self.clients.proxy.request(id).expect("just routed").decode;
        let decode_group =
            self.decode.group_base[usize::from(decode_slot.engine.index)] + usize::from(decode_slot.dp());
        let transfer = self
            .clients
            .transfers
            .push(TransferId::new(params.transfer_id.clone().unwrap_or_default()), id.0);
        let req = Req {
            sent_ns: self.now,
            input,
            output,
            prefill_group,
            decode_group,
            transfer,

            first_token_ns: None,
            done_ns: None,
            failed: false,
            timed_out: false,
            prefill_blocks: Vec::new(),
            decode_blocks: Vec::new(),
            holders: None,
        };
        self.clients.requests.insert(id, req);
        trace!(
            self,
            "proxy",
            "request",
            "proxy".into(),
            None,
            format!("{id} prefill={slot} decode={decode_slot}"),
        );
        if self.trace_on {
            let detail = format!("prefill={slot} decode={decode_slot}");
            self.trace_life(id, "arrival", Phase::Begin, detail);
            self.trace_in_flight();
        }
        let latency = self.control_ns();
        self.at(latency, Ev::PrefillQueue { req: id });
    }

    /// A request ended (finished or failed): the closed-loop client sends its next one.
    pub(super) fn end_request(&mut self, id: RequestId, failed: bool) {
        let Some(req) = self.clients.requests.get_mut(&id) else { return };
        if req.done_ns.is_some() {
            return;
        }
        req.done_ns = Some(self.now);
        req.failed = failed;
        // Its decode blocks were freed before it ended (or went with a crashed engine), and its
        // prefill blocks are the engine's to free; dropping the copies keeps memory in line with
        // the requests in flight rather than with every request of the run.
        req.prefill_blocks = Vec::new();
        req.decode_blocks = Vec::new();
        self.clients.requests.ended += 1;
        self.stats.last_progress_ns = self.now;
        if self.trace_on {
            self.trace_life(id, "finish", Phase::End, if failed { "failed" } else { "finished" }.into());
            self.trace_in_flight();
        }
        let _ = self.clients.proxy.handle_finished(id);
        if matches!(self.sc.workload.clients, Clients::Closed { .. }) && self.clients.to_send > 0 {
            self.at(0, Ev::Arrival);
        }
    }

    pub(super) fn on_proxy_answer(&mut self, id: RequestId) {
        let holders = self.clients.requests.get_mut(&id).and_then(|r| r.holders.take());
        let req = &self.clients.requests[&id];
        let group = &self.prefill.groups[req.prefill_group];
        let engine = EngineId::prefill(group.engine as u16);
        let address = self.book.engine(engine).clone();
        let transfer_id = self.clients.transfers.id(req.transfer);
        let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
            transfer_id: transfer_id.as_ref(),
            blocks: &req.prefill_blocks,
            address: &address,
            layout: group.layout,
            extensions: self.book.rules.rules(engine).extensions(),
            holders: holders.as_deref(),
            // The answer's shape is what the decode engine the proxy chose reads.
            blocks_per_group: self
                .clients
                .proxy
                .request(id)
                .is_none_or(|r| self.book.rules.rules(r.decode.engine).block_ids_per_group()),
        });
        match self.clients.proxy.handle_prefill_response(id, answer) {
            Ok(ProxyAction::SendDecode { params, .. }) => {
                let recv = RecvRequest {
                    request: id,
                    prefill_engine: engine,
                    prefill_address: address,
                    params,
                    local_block_ids: Vec::new(),
                };
                let latency = self.control_ns();
                self.at(latency, Ev::DecodeArrive { recv: Box::new(recv) });
            }
            Ok(_) => {
                let detail = format!("the proxy answered the prefill answer of {id} with no decode dispatch");
                self.violation(ViolationKind::ProtocolError, vec![], detail);
            }
            Err(error) => {
                let detail = format!("proxy refused the prefill answer of {id}: {error}");
                self.violation(ViolationKind::ProtocolError, vec![], detail);
            }
        }
    }
}
