//! The simulated world: clients, proxy, engines, NICs and listeners around the core's nodes,
//! advanced by one event queue in virtual time.
//!
//! Every protocol decision is the core's: the world only delivers events to nodes (after modelled
//! latencies, service times and faults) and carries out their actions. Checkers look at each
//! action as it is carried out (safety) and at the end of the run (liveness).
//!
//! `mod.rs` holds the `World` struct, the event enum, the run loop and the dispatch of events.
//! The world keeps what only the driver owns (the scenario, the clock, the event queue, the
//! random streams, the active faults, the trace) and one value per subsystem, each defined in
//! the file named for it together with that concept's `impl World` block: `clients`
//! (`ClientSide`: arrivals, the proxy, requests and transfers), `prefill` (`PrefillSide`:
//! engines, each DP group's scheduler, workers), `decode` (`DecodeSide`: units, groups with
//! their schedulers, workers), `data_plane` (`Network`: listeners, regions, NICs and flows;
//! `control` carries control messages over it), `finish` (`Stats`, and the `RunResult`) and
//! `checks` (`Checks`: violations, hangs, excuses); `build` is `World::new`, `faults` injects
//! faults. Schedulers and block pools are the engine layer's (`pdkv_engine`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

// `ms_ns` saturates: loaded scenarios keep every time far below overflow (`MAX_TIME_MS`); one
// built in code past that saturates, which means "never".
use pdkv_core::decode::{DecodeEvent, ReadOutcome, RecvRequest};
use pdkv_core::ids::{RankId, RequestId};
use pdkv_core::ports::{AddressBook, SessionKey};
use pdkv_core::prefill::{EngineEvent, WorkerEvent};
use pdkv_core::topology::Deployment;
use pdkv_engine::decode::Tokens;
use pdkv_engine::timeouts::{ms_ns, NS_PER_MS};

use crate::cost::Cost;
use crate::nic::FlowId;
use crate::result::{round3, RunResult};
use crate::rng::Streams;
use crate::scenario::{Clients, Scenario};
use crate::trace::{Link, TraceRecord, TraceSink};

/// Records a trace event only when the run has a trace sink, so the arguments (formatted
/// strings) cost nothing in benchmark runs.
macro_rules! trace {
    ($world:expr, $cat:expr, $name:expr, $track:expr, $dur:expr, $detail:expr $(,)?) => {
        if $world.trace_on {
            let (track, detail) = ($track, $detail);
            $world.record($cat, $name, track, $dur, detail);
        }
    };
}

// The parts of the world, one concept each; declared after `trace!`, which is in scope only
// from its definition on.
mod build;
mod checks;
mod clients;
mod control;
mod data_plane;
mod decode;
mod faults;
mod finish;
mod prefill;
mod transfers;

use checks::Checks;
use clients::ClientSide;
use data_plane::Network;
use decode::DecodeSide;
use faults::ActiveFault;
use finish::Stats;
use prefill::PrefillSide;

/// Delay before a decode engine with requests waiting on reads steps again.
const IDLE_STEP_NS: u64 = 5 * NS_PER_MS;

/// Nanoseconds of a float duration in microseconds; negative or `NaN` gives 0 and huge values
/// saturate (Rust's float-to-integer conversion), which the load-time limits keep out of reach.
fn us_ns(us: f64) -> u64 {
    (us * 1e3) as u64
}

/// Events between two progress reports.
const PROGRESS_EVERY: u64 = 8192;

/// How far a run has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Requests that ended (finished or failed).
    pub ended: u64,
    /// Requests the workload sends in all.
    pub total: u64,
    /// Virtual time, in nanoseconds.
    pub now_ns: u64,
}

/// What a run can be asked to record besides its result.
#[derive(Default)]
pub struct RunOptions {
    /// Where trace records go, in time order, as they are produced; `None` (benchmarks,
    /// sweeps, exploration) formats no record at all.
    pub trace: Option<Box<dyn TraceSink>>,
    /// Keep a row per request for `requests.csv` ([`Run::requests`]); off, the run keeps none.
    pub requests: bool,
}

/// A finished run.
#[derive(Clone, Debug)]
pub struct Run {
    /// The result object.
    pub result: RunResult,
    /// One row per request, in arrival order, when [`RunOptions::requests`] asked for them.
    pub requests: Vec<crate::request_table::RequestRow>,
}

#[derive(Clone, Debug)]
enum Msg {
    Dial {
        from: usize,
        session: SessionKey,
    },
    /// A MessagePack frame for a notify listener (release or read lease), and the transfer it
    /// names (so a lost one can excuse its transfer's reaping without decoding it again).
    Notify {
        bytes: Vec<u8>,
        transfer: Option<u32>,
    },
}

#[derive(Debug)]
enum Ev {
    Arrival,
    PrefillQueue {
        req: RequestId,
    },
    PrefillDone {
        group: usize,
        generation: u64,
    },
    ProxyAnswer {
        req: RequestId,
    },
    DecodeArrive {
        recv: Box<RecvRequest>,
    },
    StepBegin {
        unit: usize,
    },
    StepEnd {
        unit: usize,
        step: u64,
    },
    CollectiveTimeout {
        unit: usize,
        step: u64,
    },
    /// The vote results a decode group decided, one per member: `(member, step, ok)`.
    VoteResults {
        group: usize,
        results: decode::Votes,
    },
    AtListener {
        listener: usize,
        msg: Box<Msg>,
    },
    Serve {
        listener: usize,
        msg: Box<Msg>,
    },
    ToDecode {
        worker: usize,
        event: Box<DecodeEvent>,
    },
    ToPrefill {
        rank: RankId,
        event: Box<WorkerEvent>,
    },
    Flow {
        id: FlowId,
        version: u64,
    },
    ReadLater {
        worker: usize,
        request: RequestId,
        layer: Option<u16>,
        outcome: Box<ReadOutcome>,
    },
    DecodeTick {
        worker: usize,
    },
    EngineTick {
        engine: usize,
    },
    Fault {
        index: usize,
        start: bool,
    },
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Every piece of state of one run.
pub struct World {
    sc: Scenario,
    d: Deployment,
    cost: Cost,
    book: AddressBook,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    events: u64,
    streams: Streams,
    faults: Vec<Option<ActiveFault>>,
    /// The clients, the proxy and the requests and transfers in flight (`clients.rs`).
    clients: ClientSide,
    /// Prefill engines, their DP groups' schedulers and their workers (`prefill.rs`).
    prefill: PrefillSide,
    /// Decode engines: units, groups (each with its scheduler) and workers (`decode.rs`).
    decode: DecodeSide,
    /// Listeners, memory regions, NICs and their flows (`control.rs`, `data_plane.rs`).
    net: Network,
    /// What the result counts (`finish.rs`).
    stats: Stats,
    /// Violations, hangs and what excuses a failure (`checks.rs`).
    checks: Checks,
    stopped: bool,
    /// The run's time or event budget ended with events still to run (not a natural end).
    budget_ended: bool,
    /// Whether `trace` is there: the `trace!` macro's cheap test.
    trace_on: bool,
    trace: Option<Box<dyn TraceSink>>,
}

fn ms(ns: u64) -> f64 {
    round3(ns as f64 / NS_PER_MS as f64)
}

/// `[1, 2, 3]` for messages and traces (not Rust's `Debug` form).
fn list<T: std::fmt::Display>(items: &[T]) -> String {
    let items: Vec<String> = items.iter().map(T::to_string).collect();
    format!("[{}]", items.join(", "))
}

impl World {
    fn at(&mut self, delay_ns: u64, ev: Ev) {
        self.seq += 1;
        // A delay that would pass the end of u64 time is "never": the event sorts after the
        // run's time budget, so it is not run, instead of wrapping to the past.
        let at = self.now.saturating_add(delay_ns);
        self.queue.push(Reverse(Scheduled { at, seq: self.seq, ev }));
    }

    fn record(
        &mut self,
        cat: &'static str,
        name: &'static str,
        track: String,
        dur_ns: Option<u64>,
        detail: String,
    ) {
        self.record_linked(self.now, cat, name, track, dur_ns, detail, None);
    }

    /// Records a trace event at `t_ns` with a link to a request's life, a flow or a counter
    /// (`trace::Link`); callers test `trace_on` first, as `trace!` does.
    #[allow(clippy::too_many_arguments)]
    fn record_linked(
        &mut self,
        t_ns: u64,
        cat: &'static str,
        name: &'static str,
        track: String,
        dur_ns: Option<u64>,
        detail: String,
        link: Option<Link>,
    ) {
        if let Some(sink) = &mut self.trace {
            sink.handle_record(TraceRecord { t_ns, dur_ns, cat, name, track, detail, link });
        }
    }

    fn start(&mut self) {
        match (self.sc.workload.clients, self.clients.open_loop) {
            (Clients::Closed { concurrency, .. }, _) => {
                for _ in 0..concurrency.min(self.clients.to_send as u32) {
                    self.at(0, Ev::Arrival);
                }
            }
            (_, Some(rate)) => {
                let gap = self.streams.exponential_ns(rate);
                self.at(gap, Ev::Arrival);
            }
            _ => {}
        }
        let timeline = self.sc.faults.timeline.clone();
        for (index, fault) in timeline.iter().enumerate() {
            self.faults.push(None);
            self.seq += 1;
            let at = ms_ns(fault.at_ms);
            self.queue.push(Reverse(Scheduled { at, seq: self.seq, ev: Ev::Fault { index, start: true } }));
            if let Some(duration) = fault.duration_ms {
                self.seq += 1;
                let ev = Ev::Fault { index, start: false };
                let end = at.saturating_add(ms_ns(duration));
                self.queue.push(Reverse(Scheduled { at: end, seq: self.seq, ev }));
            }
        }
    }

    /// Runs to the end and returns the result.
    pub fn run(self) -> Run {
        self.run_with_progress(&mut |_| {})
    }

    /// Runs to the end, reporting progress every few thousand events (for progress bars).
    pub fn run_with_progress(mut self, progress: &mut dyn FnMut(Progress)) -> Run {
        let limit_ns = self.sc.limits.max_virtual_time_s.saturating_mul(1_000_000_000);
        while let Some(Reverse(next)) = self.queue.pop() {
            if next.at > limit_ns || self.events >= self.sc.limits.max_events {
                self.now = self.now.max(next.at.min(limit_ns));
                self.budget_ended = true;
                break;
            }
            self.now = next.at;
            self.events += 1;
            self.dispatch(next.ev);
            if self.events.is_multiple_of(PROGRESS_EVERY) {
                progress(self.progress());
            }
            if self.stopped {
                break;
            }
        }
        self.finish()
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Arrival => self.on_arrival(),
            Ev::PrefillQueue { req } => {
                let g = self.clients.requests[&req].prefill_group;
                if self.prefill.down[self.prefill.groups[g].engine] {
                    trace!(
                        self,
                        "proxy",
                        "refused",
                        "proxy".to_string(),
                        None,
                        format!("{req}: prefill engine down")
                    );
                    self.end_request(req, true);
                    return;
                }
                let (input, transfer) =
                    (self.clients.requests[&req].input, self.clients.requests[&req].transfer);
                self.prefill.groups[g].sched.handle_arrival(req, input, transfer);
                self.try_prefill(g);
            }
            Ev::PrefillDone { group, generation } => {
                if generation == self.prefill.generation[group] {
                    self.on_prefill_done(group);
                }
            }
            Ev::ProxyAnswer { req } => self.on_proxy_answer(req),
            Ev::DecodeArrive { recv } => {
                let g = self.clients.requests[&recv.request].decode_group;
                if self.decode.down[self.decode.groups[g].engine] {
                    let transfer = self.clients.requests[&recv.request].transfer;
                    self.checks.excused.insert(transfer);
                    self.end_request(recv.request, true);
                    return;
                }
                let tokens = Tokens {
                    input: self.clients.requests[&recv.request].input,
                    output: self.clients.requests[&recv.request].output,
                };
                self.decode.nodes.sched_mut(g).handle_arrival(*recv, tokens);
                self.wake(self.decode.groups[g].unit);
            }
            Ev::StepBegin { unit } => self.on_step_begin(unit),
            Ev::StepEnd { unit, step } => self.on_step_end(unit, step),
            Ev::CollectiveTimeout { unit, step } => self.on_collective_timeout(unit, step),
            Ev::VoteResults { group, results } => {
                for (member, step, ok) in results.into_results() {
                    let w = self.decode.nodes.members(group)[usize::from(member.0)];
                    self.decode_worker(w, DecodeEvent::VoteResult { step, ok });
                }
            }
            Ev::AtListener { listener, msg } => self.on_at_listener(listener, *msg),
            Ev::Serve { listener, msg } => self.on_serve(listener, *msg),
            Ev::ToDecode { worker, event } => self.decode_worker(worker, *event),
            Ev::ToPrefill { rank, event } => self.prefill_worker(rank, *event),
            Ev::Flow { id, version } => self.on_flow(id, version),
            Ev::ReadLater { worker, request, layer, outcome } => {
                self.decode_worker(worker, DecodeEvent::ReadDone { request, layer, outcome: *outcome })
            }
            Ev::DecodeTick { worker } => {
                if self.decode.worker_tick[worker] == Some(self.now) {
                    self.decode.worker_tick[worker] = None;
                    self.decode_worker(worker, DecodeEvent::Tick);
                }
            }
            Ev::EngineTick { engine } => {
                if self.prefill.engine_tick[engine] == Some(self.now) {
                    self.prefill.engine_tick[engine] = None;
                    self.engine(engine, EngineEvent::Tick);
                }
            }
            Ev::Fault { index, start } => self.on_fault(index, start),
        }
    }

    fn progress(&self) -> Progress {
        let ended = self.clients.requests.ended();
        let total = match self.sc.workload.clients {
            Clients::Closed { requests, .. } | Clients::Open { requests, .. } => u64::from(requests),
        };
        Progress { ended, total, now_ns: self.now }
    }
}
