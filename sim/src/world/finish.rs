//! The end of a run: the `RunResult` (requests, latencies, NICs, ledger) and the outcome rules.

use pdkv_core::time::Instant;
use pdkv_engine::verdict::{judge, BudgetRule, Tally, Verdict};

use crate::measure::{self, DecodeStep, PrefillStep};
use crate::nic::BUCKET_NS;
use crate::result::{percentiles, round3, Gpus, Hang, Ledger, NicStats, RunResult, Summary};
use crate::waitfor::{WaitFor, WaitNode, WaitReason};

use super::{ms, Run, World};

/// What the result counts as the run goes.
pub(super) struct Stats {
    /// KV reads served per prefill GPU.
    pub(super) reads: Vec<u64>,
    /// KV bytes served per prefill GPU.
    pub(super) bytes: Vec<u64>,
    /// RDMA operations served per prefill GPU.
    pub(super) messages: Vec<u64>,
    /// Duration of every completed KV read flow, in milliseconds.
    pub(super) kv_read_ms: Vec<f64>,
    /// Every decode step that generated tokens: its end, its gap and its tokens (ITL, and the
    /// steady window's output throughput).
    pub(super) decode_steps: Vec<DecodeStep>,
    /// Every prefill step that computed prompt tokens: its end and its tokens (the steady
    /// window's input throughput).
    pub(super) prefill_steps: Vec<PrefillStep>,
    /// Arrivals the proxy refused (its in-flight cap); counted as unsent.
    pub(super) refused: u64,
    pub(super) reaped_excused: u64,
    /// Transfers whose prefill engine crashed while holding them.
    pub(super) lost_in_crash: u64,
    /// Freed and reaped counts of prefill engine incarnations that crashed.
    pub(super) crashed_freed: u64,
    pub(super) crashed_reaped: u64,
    pub(super) max_hold_ns: u64,
    /// When the run last made progress: a request ended (finished or failed), a prefill step
    /// computed prompt tokens, a decode step generated tokens, or a KV read completed. Whether
    /// the run was still progressing when its budget ended.
    pub(super) last_progress_ns: u64,
    /// Running requests the decode ranks preempted for their blocks.
    pub(super) preemptions: u64,
}

impl World {
    pub(super) fn finish(mut self) -> Run {
        let now = self.now;
        let mut result = RunResult::empty(&self.sc, crate::load::scenario_to_ron(&self.sc));
        // Like `vllm bench serve`: the run lasts until its last request ended (a hang or an
        // unfinished request extends it to the end of the simulation).
        let last_end = self.clients.requests.values().filter_map(|r| r.done_ns).max().unwrap_or(0);
        let unfinished = self.clients.requests.values().any(|r| r.done_ns.is_none());
        let end = if unfinished || !self.checks.hangs.is_empty() { now } else { last_end };
        result.duration_s = round3(end as f64 / 1e9);
        result.events = self.events;

        // Requests and latencies.
        let mut ttft = Vec::new();
        let mut tpot = Vec::new();
        let mut e2e = Vec::new();
        let (mut total_tokens, mut output_tokens) = (0u64, 0u64);
        for req in self.clients.requests.values() {
            result.requests.sent += 1;
            match (req.done_ns, req.failed) {
                (Some(done), false) => {
                    result.requests.finished += 1;
                    total_tokens += u64::from(req.input) + u64::from(req.output);
                    output_tokens += u64::from(req.output);
                    let first = req.first_token_ns.unwrap_or(done);
                    ttft.push((first - req.sent_ns) as f64 / 1e6);
                    e2e.push((done - req.sent_ns) as f64 / 1e6);
                    if req.output > 1 {
                        tpot.push((done - first) as f64 / 1e6 / f64::from(req.output - 1));
                    }
                }
                (Some(done), true) => {
                    result.requests.failed += 1;
                    if self.failure_excused(req, done) {
                        result.requests.failed_excused += 1;
                    } else {
                        result.requests.failed_unexcused += 1;
                    }
                }
                (None, _) => result.requests.unfinished += 1,
            }
        }
        result.requests.unsent = self.clients.to_send + self.stats.refused;
        result.requests.preemptions = self.stats.preemptions;
        let seconds = (end as f64 / 1e9).max(1e-9);
        result.throughput.total_tok_s = round3(total_tokens as f64 / seconds);
        result.throughput.output_tok_s = round3(output_tokens as f64 / seconds);
        result.throughput.requests_per_s = round3(result.requests.finished as f64 / seconds);
        result.latency_ms.ttft = Summary::of(&mut ttft);
        result.latency_ms.tpot = Summary::of(&mut tpot);
        // `Summary::of` sorted both.
        result.latency_ms.ttft_percentiles = percentiles(&ttft);
        result.latency_ms.tpot_percentiles = percentiles(&tpot);
        result.latency_ms.e2e = Summary::of(&mut e2e);
        result.latency_ms.kv_read = Summary::of(&mut std::mem::take(&mut self.stats.kv_read_ms));
        result.latency_ms.itl = measure::itl(self.stats.decode_steps.iter());
        drop((ttft, tpot, e2e));

        // The steady-state window and its figures.
        result.gpus =
            Gpus { prefill: self.prefill.ranks.len() as u32, decode: self.decode.ranks.len() as u32 };
        let times = || self.clients.requests.values().map(super::clients::Req::times);
        let span = measure::select(self.sc.workload.clients, self.sc.measure, times(), end);
        result.steady = measure::steady(
            &span,
            times(),
            &self.stats.decode_steps,
            &self.stats.prefill_steps,
            result.gpus,
            self.sc.slo,
        );
        let requests = match self.clients.keep_rows {
            true => self.request_rows(&span),
            false => Vec::new(),
        };

        // NICs.
        let bucket_bytes = self.sc.hardware.nic_gb_s * 1e9 * (BUCKET_NS as f64 / 1e9);
        result.nic = NicStats {
            prefill_gpus: self.prefill.ranks.iter().map(|r| r.to_string()).collect(),
            jain: crate::result::jain(&self.stats.reads),
            jain_bytes: crate::result::jain(&self.stats.bytes),
            reads_per_prefill_gpu: self.stats.reads.clone(),
            bytes_per_prefill_gpu: self.stats.bytes.clone(),
            messages_per_prefill_gpu: self.stats.messages.clone(),
            // One value per second of the run for every GPU (idle seconds are 0), with enough
            // precision for the sub-percent loads a 48 GB/s NIC usually sees.
            utilisation: (0..self.prefill.ranks.len())
                .map(|i| {
                    let sent = self.net.nics.sent_per_bucket(i);
                    let seconds = (end.div_ceil(BUCKET_NS) as usize).max(sent.len());
                    (0..seconds)
                        .map(|b| sent.get(b).map_or(0.0, |x| (x / bucket_bytes * 1e6).round() / 1e6))
                        .collect()
                })
                .collect(),
        };

        // Ledger.
        let mut ledger = Ledger {
            freed: self.stats.crashed_freed,
            reaped: self.stats.crashed_reaped,
            ..Ledger::default()
        };
        for engine in self.prefill.nodes.engines() {
            let totals = engine.totals();
            ledger.held += totals.held;
            ledger.freed += totals.freed;
            ledger.reaped += totals.reaped;
            self.stats.max_hold_ns = self.stats.max_hold_ns.max(totals.longest_hold_ns);
            for record in engine.held() {
                self.stats.max_hold_ns = self.stats.max_hold_ns.max(record.held_ns(Instant(now)));
            }
        }
        ledger.max_hold_ms = ms(self.stats.max_hold_ns);
        ledger.reaped_excused = self.stats.reaped_excused;
        ledger.lost_in_crash = self.stats.lost_in_crash;
        ledger.prefill_stall_s =
            round3(self.prefill.groups.iter().map(|g| g.sched.stall_ns(now)).sum::<u64>() as f64 / 1e9);
        ledger.reaper_pending = self.budget_ended
            && self.prefill.nodes.engines().iter().any(|e| e.totals().held > 0 && e.poll_timeout().is_some());
        result.ledger = ledger;

        // Requests in flight when the budget ended are cut off, not hung, if the run was still
        // progressing within the stall window, the longest any protocol wait may legitimately
        // last (a collective, or a transfer with its defer and handshake timeouts): a request
        // ended, a prefill step computed prompt tokens, a decode step generated tokens or a KV
        // read completed. A prefill step of one token takes a request's prompt hours; it is slow,
        // not hung, and requests ending is too coarse a sign of it.
        let stall_window_ns = self.sc.timeouts().stall_window_ns();
        let progressing =
            self.budget_ended && now.saturating_sub(self.stats.last_progress_ns) <= stall_window_ns;
        if progressing {
            result.requests.cut_off = result.requests.unfinished;
        }
        // Requests that never ended are a hang even when no collective timed out, when the
        // world can say what they wait for.
        if result.requests.unfinished > result.requests.cut_off && self.checks.hangs.is_empty() {
            let mut graph = WaitFor::default();
            let mut ranks = Vec::new();
            for (w, worker) in self.decode.nodes.workers().iter().enumerate() {
                for (session, target) in worker.waiting_sessions() {
                    let rank = self.decode.ranks[w];
                    graph.edge(
                        WaitNode::Rank { rank },
                        WaitNode::HandshakeListener { rank: target },
                        WaitReason::Handshake { session },
                    );
                    ranks.push(rank.to_string());
                }
            }
            if graph.edges().is_empty() {
                // Nothing progressed for the stall window, yet nothing the simulator models
                // waits for anything: a hang it cannot show (a hang always has its wait-for
                // graph) and no progress it can see. No verdict on liveness, said so.
                result.requests.stalled = result.requests.unfinished - result.requests.cut_off;
            } else {
                self.checks.hangs.push(Hang {
                    t_ms: ms(now),
                    what: format!(
                        "{} requests never finished by the end of the run",
                        result.requests.unfinished
                    ),
                    ranks,
                    wait_for: graph.edges(),
                    cycle: graph.cycle(),
                    dot: graph.dot(),
                });
            }
        }
        result.hangs = self.checks.hangs;
        result.violations = self.checks.violations;
        let tally = Tally {
            violated: !result.violations.is_empty(),
            hung: !result.hangs.is_empty(),
            budget_ended: self.budget_ended,
            unfinished: result.requests.unfinished,
            cut_off: result.requests.cut_off,
            stalled: result.requests.stalled,
            unsent: result.requests.unsent,
            failed_unexcused: result.requests.failed_unexcused,
            held: result.ledger.held,
            reaped: result.ledger.reaped,
            reaped_excused: result.ledger.reaped_excused,
            reaper_pending: result.ledger.reaper_pending,
            interrupted: false,
        };
        result.outcome = match judge(&tally, BudgetRule::Virtual) {
            Verdict::Ended(outcome) => outcome,
            Verdict::Interrupted => unreachable!("a simulated run is never interrupted"),
        };
        Run { result, requests }
    }
}

/// Honest outcomes and truthful extremes: every run ends in the outcome its requests earned.
#[cfg(test)]
mod outcome_tests {
    use crate::scenario::Outcome;
    use crate::scenario::{Clients, FaultKind, Scenario, Target, TimedFault};
    use crate::world::RunOptions;

    /// A small, fast scenario: one TP1 engine per side, two clients, four short requests, with
    /// `fields` added (RON, as a scenario file writes them).
    /// DeepSeek-R1's weights would not fit a TP1 engine, so the pool is a fixed share of HBM
    /// (`fields` that set `hardware` say so themselves).
    fn small(fields: &str) -> Scenario {
        let hardware =
            if fields.contains("hardware:") { "" } else { "hardware: (kv_memory_fraction: 0.5), " };
        let text = format!(
            "(name: \"t\", deployment: \"1P_TP1:1D_TP1\", {hardware}workload: (clients: Closed(concurrency: 2, \
             requests: 4), input_tokens: Fixed(8192), output_tokens: Fixed(4)), {fields})"
        );
        crate::load::parse_scenario(&text, "<test>").unwrap_or_else(|e| panic!("{e}"))
    }

    /// A fault on every rank of the deployment for the whole run.
    fn everywhere(fault: FaultKind) -> Vec<TimedFault> {
        ["P0.dp0.tp0", "D0.dp0.tp0"]
            .into_iter()
            .map(|target| TimedFault {
                at_ms: 0,
                target: Target(target.into()),
                fault: fault.clone(),
                duration_ms: None,
                count: None,
            })
            .collect()
    }

    /// What a run is judged by: outcome; sent, finished, failed excused, failed unexcused,
    /// unfinished, unsent, cut off, stalled.
    type Verdict = (Outcome, [u64; 8]);

    fn check(name: &str, scenario: &Scenario, expected: Verdict) {
        let r = crate::run(scenario, RunOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}")).result;
        let q = &r.requests;
        let got = (
            r.outcome,
            [
                q.sent,
                q.finished,
                q.failed_excused,
                q.failed_unexcused,
                q.unfinished,
                q.unsent,
                q.cut_off,
                q.stalled,
            ],
        );
        let hangs: Vec<&str> = r.hangs.iter().map(|h| h.what.as_str()).collect();
        assert_eq!(got, expected, "{name}: hangs {hangs:?}");
        assert_eq!(q.failed, q.failed_excused + q.failed_unexcused, "{name}");
        // A hang always shows what waits for what.
        for hang in &r.hangs {
            assert!(!hang.wait_for.is_empty(), "{name}: {} has no wait-for graph", hang.what);
        }
    }

    #[test]
    fn outcomes_are_honest() {
        use Outcome::*;
        let with = |mut sc: Scenario, f: &dyn Fn(&mut Scenario)| {
            f(&mut sc);
            sc
        };
        let table: Vec<(&str, Scenario, Verdict)> = vec![
            ("baseline", small(""), (Clean, [4, 4, 0, 0, 0, 0, 0, 0])),
            // Requests that fail with no fault to excuse them: the run is not clean. Their
            // reads were still posted at the 1 ms deadline: they are aborted and drained before
            // the release, so no read completes from freed blocks (it did before the drain rule).
            (
                "transfer timeout 1 ms",
                small("protocol: (transfer_timeout_ms: 1)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0, 0]),
            ),
            // The same timeout imposed as a fault (as the search's storm imposes it): the requests
            // fail because of it, excused.
            (
                "transfer timeout 1 ms imposed as a fault",
                small("faults: (transfer_timeout_ms: 1)"),
                (Clean, [4, 0, 4, 0, 0, 0, 0, 0]),
            ),
            (
                "handshake timeout 1 ms over a 2 ms network",
                small("protocol: (handshake_timeout_ms: 1), hardware: (kv_memory_fraction: 0.5, control_latency_us: 2000)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0, 0]),
            ),
            // The same failures while a fault takes the NICs down are the fault's doing.
            (
                "NIC down everywhere",
                with(small(""), &|sc| sc.faults.timeline = everywhere(FaultKind::NicDown)),
                (Clean, [4, 0, 4, 0, 0, 0, 0, 0]),
            ),
            // A dead listener on one of two prefill engines: the requests routed to it fail,
            // excused; those of the other engine finish.
            (
                "dead listener on P1",
                crate::load::parse_scenario(
                    "(name: \"t\", deployment: \"2P_TP4:1D_TP4\", hardware: (kv_memory_fraction: 0.5), workload: (clients: Closed(concurrency: 8, \
                     requests: 48), input_tokens: Fixed(1024), output_tokens: Fixed(16)), protocol: \
                     (handshake_timeout_ms: 1000, transfer_timeout_ms: 3000), faults: (timeline: [(at_ms: 0, \
                     target: \"P1.dp0.tp*\", fault: DeadListener)]))",
                    "<test>",
                )
                .unwrap_or_else(|e| panic!("{e}")),
                (Clean, [48, 24, 24, 0, 0, 0, 0, 0]),
            ),
            // Open-loop arrivals after the time budget are unsent, and the run says so.
            (
                "open loop past the time budget",
                with(small(""), &|sc| {
                    sc.workload.clients = Clients::Open { rate_per_s: 0.002, requests: 40 }
                }),
                (Incomplete, [16, 16, 0, 0, 0, 24, 0, 0]),
            ),
            // A closed loop through a decode batch of one, past its time budget: requests still
            // end every few seconds when it is cut, so the ones in flight are cut off, and the
            // blocks they hold are no leak.
            (
                "decode batch of one past the time budget",
                with(small("engines: (decode_max_batch: 1), limits: (max_virtual_time_s: 60)"), &|sc| {
                    sc.workload.clients = Clients::Closed { concurrency: 4, requests: 40 };
                    sc.workload.output_tokens = crate::scenario::Length::Fixed(50);
                }),
                (Incomplete, [30, 26, 0, 0, 4, 10, 4, 0]),
            ),
            // A prefill step of one token: each 8K prompt takes about 1,750 s, so when the 2 h
            // budget ends no request has ended for longer than the stall window, yet prompts are
            // still being prefilled every step. Slow, not hung: the requests in flight are cut
            // off. (It was called a hang, "4 requests never finished", with an empty wait-for
            // graph; with a 24 h budget all 16 finish, clean.)
            (
                "prefill batch of one token past the time budget",
                with(small("engines: (prefill_max_batched_tokens: 1)"), &|sc| {
                    sc.workload.clients = Clients::Closed { concurrency: 4, requests: 16 };
                }),
                (Incomplete, [8, 4, 0, 0, 4, 8, 4, 0]),
            ),
            (
                "prefill batch of one token within a day",
                with(small("engines: (prefill_max_batched_tokens: 1), limits: (max_virtual_time_s: 86400)"), &|sc| {
                    sc.workload.clients = Clients::Closed { concurrency: 4, requests: 16 };
                }),
                (Clean, [16, 16, 0, 0, 0, 0, 0, 0]),
            ),
            // A request that can never be admitted by its decode engine (its blocks outnumber the
            // pool; the loader refuses such a file, a scenario built in code is not checked)
            // waits in the queue, leased, with nothing progressing and no handshake or
            // collective to wait on: no wait-for graph to show, so no hang. It is stalled, and
            // the run has no verdict (the search calls it `every-request-ends` broken).
            (
                "a request its decode pool can never hold",
                with(small("limits: (max_virtual_time_s: 3600)"), &|sc| {
                    sc.engines.kv_blocks_per_gpu = 200;
                    sc.workload.clients = Clients::Closed { concurrency: 1, requests: 1 };
                    sc.workload.input_tokens = crate::scenario::Length::Fixed(1024);
                    sc.workload.output_tokens = crate::scenario::Length::Fixed(4096);
                }),
                (Incomplete, [1, 0, 0, 0, 1, 0, 0, 1]),
            ),
            // A cut when requests stopped ending longer ago than the stall window cuts off
            // nothing: one lost dial without a handshake timeout blocks the only decode worker
            // for good, its collective times out, and the run is a hang.
            (
                "stuck for longer than the stall window before the budget ended",
                small(
                    "protocol: (legacy: [\"no-handshake-timeout\"], collective_timeout_ms: 1000), faults: (timeline: \
                     [(at_ms: 0, target: \"P0.dp0.tp0\", fault: LoseMessages, count: 2)]), limits: (max_virtual_time_s: 3600)",
                ),
                (Hang, [2, 0, 0, 0, 2, 2, 0, 0]),
            ),
            // Scenarios built in code skip the load-time limits: their times saturate (never),
            // they do not wrap. A collective timeout of 2^64 ns is no false hang at 621 ms.
            (
                "collective timeout past u64 nanoseconds",
                with(small(""), &|sc| sc.protocol.collective_timeout_ms = 18_446_744_073_709),
                (Clean, [4, 4, 0, 0, 0, 0, 0, 0]),
            ),
            // A message delayed past the end of time never arrives: the dials time out.
            (
                "messages delayed by u64::MAX ms",
                with(small(""), &|sc| {
                    sc.faults.timeline = everywhere(FaultKind::DelayMessages { delay_ms: u64::MAX })
                }),
                (Clean, [4, 0, 4, 0, 0, 0, 0, 0]),
            ),
            // A NIC too slow to finish a read within the run: the reads time out, excused by the
            // fault; without a fault the same slowness fails requests unexcused.
            (
                "SlowNic factor 1e-300",
                with(small(""), &|sc| sc.faults.timeline = everywhere(FaultKind::SlowNic { factor: 1e-300 })),
                (Clean, [4, 0, 4, 0, 0, 0, 0, 0]),
            ),
            // The slowest loadable NIC and slow-down behave the same way, through the loader.
            (
                "nic_gb_s at its lower limit",
                small("hardware: (kv_memory_fraction: 0.5, nic_gb_s: 0.000001)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0, 0]),
            ),
            (
                "SlowNic at its lower limit",
                small("faults: (timeline: [(at_ms: 0, target: \"P0.dp0.tp0\", fault: SlowNic(factor: 0.000001))])"),
                (Clean, [4, 0, 4, 0, 0, 0, 0, 0]),
            ),
            (
                "nic_gb_s 1e-15",
                with(small(""), &|sc| sc.hardware.nic_gb_s = 1e-15),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0, 0]),
            ),
        ];
        for (name, scenario, expected) in &table {
            check(name, scenario, *expected);
        }
    }
}
