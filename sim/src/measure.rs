//! What `pdkv run` measures in a run's steady state: the window (warm-up and drain left out),
//! latency percentiles, throughput per GPU and per phase, and goodput under SLOs, computed from
//! the times the world keeps (`docs/sim.md`, "Steady state").
//!
//! Pure functions of the requests' times and the steps' token counts, so the window's rules are
//! tested here on hand-made runs.

use crate::result::{
    round3, Goodput, Gpus, Steady, Summary, Window, WindowKind, WindowLatencies, WindowThroughput,
};
use crate::scenario::{Clients, Measure, Slo};

/// One request's times, as the world kept them; requests are passed in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestTimes {
    /// Its arrival at the proxy.
    pub sent_ns: u64,
    /// The end of its first decode step.
    pub first_token_ns: Option<u64>,
    /// When it ended, finished or failed (`None`: in flight when the run ended).
    pub done_ns: Option<u64>,
    /// It ended with all its tokens.
    pub finished: bool,
    /// Tokens it was to generate.
    pub output: u32,
}

impl RequestTimes {
    /// TTFT, TPOT (`None` for one output token) and E2E in milliseconds, when it finished.
    fn latencies(&self) -> Option<(f64, Option<f64>, f64)> {
        let done = self.done_ns.filter(|_| self.finished)?;
        let first = self.first_token_ns.unwrap_or(done);
        let ttft = (first - self.sent_ns) as f64 / 1e6;
        let tpot = (self.output > 1).then(|| (done - first) as f64 / 1e6 / f64::from(self.output - 1));
        Some((ttft, tpot, (done - self.sent_ns) as f64 / 1e6))
    }
}

/// One decode step of a unit (its DP groups step together): when it ended, the gap since the
/// unit's previous step, and the tokens it generated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeStep {
    /// The end of the step.
    pub end_ns: u64,
    /// Time since the unit's previous step ended (0 for its first step).
    pub gap_ns: u64,
    /// Tokens of requests that already had one: each waited `gap_ns` for it (the ITL samples).
    pub later_tokens: u32,
    /// Tokens generated in all, first tokens included.
    pub tokens: u32,
}

/// One prefill step of a DP group that computed prompt tokens: when it ended and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillStep {
    /// The end of the step.
    pub end_ns: u64,
    /// Prompt tokens it computed.
    pub tokens: u64,
}

/// The requests a window covers, by arrival index (`first..end`), and its time span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Steady, or the whole run and why.
    pub kind: WindowKind,
    /// Arrival index of its first request.
    pub first: usize,
    /// Arrival index after its last request.
    pub end: usize,
    /// Requests left out at the start.
    pub warmup: usize,
    /// Requests left out at the end.
    pub drain: usize,
    /// The start of its time span: tokens and requests completed in `(start_ns, end_ns]` count.
    pub start_ns: u64,
    /// The end of its time span.
    pub end_ns: u64,
}

/// The default warm-up: a closed loop's first `max(C, ceil(N / 10))` arrivals (the first C
/// arrive together at t = 0 and queue behind each other), an open loop's first `ceil(N / 10)`.
pub fn default_warmup(clients: Clients) -> usize {
    match clients {
        Clients::Closed { concurrency, requests } => concurrency.max(requests.div_ceil(10)) as usize,
        Clients::Open { requests, .. } => requests.div_ceil(10) as usize,
    }
}

/// Chooses the window of a run whose requests, in arrival order, are `requests` and which
/// lasted until `run_end_ns` (`docs/sim.md`, "Steady state"):
/// - warm-up: the first `measure.warmup_requests` arrivals, or [`default_warmup`];
/// - drain: the last K arrivals, K the requests in flight just after the last arrival (in a
///   closed loop, C): a request's life spans about K arrivals (Little's law), so the requests
///   after the last K-th from the end overlap the falling load of the drain;
/// - the span runs from the arrival of the window's first request to that of the first drain
///   request, all of it at full load.
///
/// `measure.whole_run`, or a run too short to leave a window (no request between warm-up and
/// drain, or a span of no time), gives the whole run, saying which.
pub fn select<I>(clients: Clients, measure: Measure, requests: I, run_end_ns: u64) -> Span
where
    I: Iterator<Item = RequestTimes> + Clone,
{
    let sent = requests.clone().count();
    let whole =
        |kind| Span { kind, first: 0, end: sent, warmup: 0, drain: 0, start_ns: 0, end_ns: run_end_ns };
    if measure.whole_run {
        return whole(WindowKind::WholeRunAsked);
    }
    let Some(last_arrival) = requests.clone().last().map(|r| r.sent_ns) else {
        return whole(WindowKind::WholeRunTooShort);
    };
    let warmup = measure.warmup_requests.map_or_else(|| default_warmup(clients), |n| n as usize);
    let drain = requests.clone().filter(|r| r.done_ns.is_none_or(|done| done > last_arrival)).count();
    let end = sent - drain;
    if end <= warmup {
        return whole(WindowKind::WholeRunTooShort);
    }
    let arrival = |i: usize| requests.clone().nth(i).map_or(last_arrival, |r| r.sent_ns);
    let (start_ns, end_ns) = (arrival(warmup), arrival(end));
    if end_ns <= start_ns {
        return whole(WindowKind::WholeRunTooShort);
    }
    Span { kind: WindowKind::Steady, first: warmup, end, warmup, drain, start_ns, end_ns }
}

/// The figures of `span`: latencies of the requests that arrived inside it, ITL of the decode
/// steps that ended inside it, throughput and goodput of what completed inside it, per GPU of
/// `gpus`; goodput only with an `slo`.
pub fn steady<I>(
    span: &Span,
    requests: I,
    decode: &[DecodeStep],
    prefill: &[PrefillStep],
    gpus: Gpus,
    slo: Option<Slo>,
) -> Steady
where
    I: Iterator<Item = RequestTimes> + Clone,
{
    let inside = |t: u64| span.start_ns < t && t <= span.end_ns;
    let arrived = requests.clone().skip(span.first).take(span.end - span.first);

    let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let mut met = 0u64;
    for r in arrived {
        let Some((first, per_token, end_to_end)) = r.latencies() else { continue };
        ttft.push(first);
        tpot.extend(per_token);
        e2e.push(end_to_end);
        met += u64::from(slo.is_some_and(|slo| slo.met(first, per_token)));
    }
    let latency_ms = WindowLatencies {
        ttft: Summary::of(&mut ttft),
        tpot: Summary::of(&mut tpot),
        itl: itl(decode.iter().filter(|s| inside(s.end_ns))),
        e2e: Summary::of(&mut e2e),
    };

    let seconds = (span.end_ns - span.start_ns).max(1) as f64 / 1e9;
    let per_s = |n: u64| n as f64 / seconds;
    let finished_inside = || requests.clone().filter(|r| r.finished && r.done_ns.is_some_and(inside));
    let input: u64 = prefill.iter().filter(|s| inside(s.end_ns)).map(|s| s.tokens).sum();
    let output: u64 = decode.iter().filter(|s| inside(s.end_ns)).map(|s| u64::from(s.tokens)).sum();
    let finished = finished_inside().count() as u64;
    let (all, p, d) =
        (f64::from(gpus.total().max(1)), f64::from(gpus.prefill.max(1)), f64::from(gpus.decode.max(1)));
    let throughput = WindowThroughput {
        requests_per_s: round3(per_s(finished)),
        input_tok_s: round3(per_s(input)),
        output_tok_s: round3(per_s(output)),
        total_tok_s: round3(per_s(input + output)),
        requests_per_s_per_gpu: round3(per_s(finished) / all),
        total_tok_s_per_gpu: round3(per_s(input + output) / all),
        output_tok_s_per_gpu: round3(per_s(output) / all),
        input_tok_s_per_prefill_gpu: round3(per_s(input) / p),
        output_tok_s_per_decode_gpu: round3(per_s(output) / d),
    };

    let goodput = slo.map(|slo| {
        let good = finished_inside()
            .filter(|r| r.latencies().is_some_and(|(ttft, tpot, _)| slo.met(ttft, tpot)))
            .count() as u64;
        let arrived = (span.end - span.first) as u64;
        Goodput {
            slo,
            requests_per_s: round3(per_s(good)),
            requests_per_s_per_gpu: round3(per_s(good) / all),
            met_fraction: if arrived == 0 { 0.0 } else { round3(met as f64 / arrived as f64) },
        }
    });

    Steady {
        window: Window {
            kind: span.kind,
            warmup_requests: span.warmup as u64,
            drain_requests: span.drain as u64,
            requests: (span.end - span.first) as u64,
            start_s: round3(span.start_ns as f64 / 1e9),
            end_s: round3(span.end_ns as f64 / 1e9),
        },
        latency_ms,
        throughput,
        goodput,
    }
}

/// Mean and percentiles (ms) of the step gaps of `steps`, each gap counted once per token that
/// waited it (the requests that already had a token); `None` when no token waited one.
pub fn itl<'a>(steps: impl Iterator<Item = &'a DecodeStep>) -> Option<Summary> {
    let mut samples: Vec<(u64, u64)> =
        steps.filter(|s| s.later_tokens > 0).map(|s| (s.gap_ns, u64::from(s.later_tokens))).collect();
    let total: u64 = samples.iter().map(|(_, n)| n).sum();
    if total == 0 {
        return None;
    }
    samples.sort_unstable();
    let mean = samples.iter().map(|(d, n)| *d as f64 * *n as f64).sum::<f64>() / total as f64 / 1e6;
    let at = |q: f64| {
        let target = ((total - 1) as f64 * q).round() as u64;
        let mut seen = 0;
        for (d, n) in &samples {
            seen += n;
            if seen > target {
                return *d as f64 / 1e6;
            }
        }
        samples.last().map_or(0.0, |(d, _)| *d as f64 / 1e6)
    };
    Some(Summary { mean: round3(mean), p50: round3(at(0.5)), p90: round3(at(0.9)), p99: round3(at(0.99)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A finished request: arrival, first token and end in seconds, 11 output tokens.
    fn req(sent: f64, first: f64, done: f64) -> RequestTimes {
        let ns = |s: f64| (s * S as f64) as u64;
        RequestTimes {
            sent_ns: ns(sent),
            first_token_ns: Some(ns(first)),
            done_ns: Some(ns(done)),
            finished: true,
            output: 11,
        }
    }

    /// A closed loop of `c` clients and `n` requests, each taking `life` seconds with its first
    /// token `ttft` after arrival: every end is the next arrival.
    fn closed(c: usize, n: usize, life: f64, ttft: impl Fn(usize) -> f64) -> Vec<RequestTimes> {
        let mut out: Vec<RequestTimes> = Vec::new();
        for i in 0..n {
            let sent = if i < c { 0.0 } else { out[i - c].done_ns.unwrap() as f64 / S as f64 };
            out.push(req(sent, sent + ttft(i), sent + life));
        }
        out
    }

    fn closed_clients(c: usize, n: usize) -> Clients {
        Clients::Closed { concurrency: c as u32, requests: n as u32 }
    }

    /// (clients, measure, requests) -> (kind, first, end, warmup, drain, start s, end s).
    #[test]
    fn the_window_leaves_out_warm_up_and_drain() {
        type Row = (
            &'static str,
            Clients,
            Measure,
            Vec<RequestTimes>,
            (WindowKind, usize, usize, usize, usize, f64, f64),
        );
        let steady = WindowKind::Steady;
        let warmup = |n| Measure { warmup_requests: Some(n), whole_run: false };
        let open = |n| Clients::Open { rate_per_s: 1.0, requests: n };
        // Open loop: one arrival a second, each request 2.5 s long; at the last arrival (9 s)
        // the requests of 7 s and 8 s are still in flight, and the last one: a drain of 3.
        let open_run: Vec<RequestTimes> =
            (0..10).map(|i| req(f64::from(i), f64::from(i) + 1.0, f64::from(i) + 2.5)).collect();
        let table: Vec<Row> = vec![
            // C = 4, N = 40: warm-up max(4, 4) = 4, drain 4 (one generation of 10 s each).
            (
                "closed 10 x C",
                closed_clients(4, 40),
                Measure::default(),
                closed(4, 40, 10.0, |_| 1.0),
                (steady, 4, 36, 4, 4, 10.0, 90.0),
            ),
            // N = 100: warm-up a tenth, 10 requests, starting mid-generation.
            (
                "closed 25 x C",
                closed_clients(4, 100),
                Measure::default(),
                closed(4, 100, 10.0, |_| 1.0),
                (steady, 10, 96, 10, 4, 20.0, 240.0),
            ),
            (
                "warm-up given",
                closed_clients(4, 40),
                warmup(12),
                closed(4, 40, 10.0, |_| 1.0),
                (steady, 12, 36, 12, 4, 30.0, 90.0),
            ),
            (
                "no warm-up",
                closed_clients(4, 40),
                warmup(0),
                closed(4, 40, 10.0, |_| 1.0),
                (steady, 0, 36, 0, 4, 0.0, 90.0),
            ),
            ("open loop", open(10), Measure::default(), open_run.clone(), (steady, 1, 7, 1, 3, 1.0, 7.0)),
            // Whole run: asked, or nothing left between warm-up and drain.
            (
                "whole run asked",
                closed_clients(4, 40),
                Measure { warmup_requests: None, whole_run: true },
                closed(4, 40, 10.0, |_| 1.0),
                (WindowKind::WholeRunAsked, 0, 40, 0, 0, 0.0, 100.0),
            ),
            (
                "one generation",
                closed_clients(4, 4),
                Measure::default(),
                closed(4, 4, 10.0, |_| 1.0),
                (WindowKind::WholeRunTooShort, 0, 4, 0, 0, 0.0, 100.0),
            ),
            (
                "two generations",
                closed_clients(4, 8),
                Measure::default(),
                closed(4, 8, 10.0, |_| 1.0),
                (WindowKind::WholeRunTooShort, 0, 8, 0, 0, 0.0, 100.0),
            ),
            (
                "warm-up past the drain",
                closed_clients(4, 40),
                warmup(36),
                closed(4, 40, 10.0, |_| 1.0),
                (WindowKind::WholeRunTooShort, 0, 40, 0, 0, 0.0, 100.0),
            ),
            (
                "no request",
                closed_clients(4, 40),
                Measure::default(),
                vec![],
                (WindowKind::WholeRunTooShort, 0, 0, 0, 0, 0.0, 100.0),
            ),
            // The window's first request and the first drain request arrived together (a long
            // request 1 is still in flight at the last arrival, 3 s): a span of no time.
            (
                "a span of no time",
                open(4),
                warmup(1),
                vec![req(0.0, 0.5, 1.0), req(2.0, 2.5, 10.0), req(2.0, 2.2, 2.5), req(3.0, 3.5, 4.0)],
                (WindowKind::WholeRunTooShort, 0, 4, 0, 0, 0.0, 100.0),
            ),
        ];
        for (name, clients, measure, requests, expected) in table {
            let s = select(clients, measure, requests.iter().copied(), 100 * S);
            let got =
                (s.kind, s.first, s.end, s.warmup, s.drain, s.start_ns as f64 / 1e9, s.end_ns as f64 / 1e9);
            assert_eq!(got, expected, "{name}");
        }
    }

    /// Requests that never ended, or failed, at the last arrival are in flight: the drain.
    #[test]
    fn requests_in_flight_at_the_last_arrival_are_the_drain() {
        let run = closed(2, 20, 10.0, |_| 1.0);
        let s = select(closed_clients(2, 20), Measure::default(), run.iter().copied(), 100 * S);
        assert_eq!((s.first, s.end, s.drain), (2, 18, 2));
        // Request 5 never ended and request 6 failed after the last arrival (90 s): both were
        // in flight, so the drain is the last four arrivals, whichever they are.
        let mut run = run;
        run[5].done_ns = None;
        run[6].finished = false;
        run[6].done_ns = Some(95 * S);
        let s = select(closed_clients(2, 20), Measure::default(), run.iter().copied(), 100 * S);
        assert_eq!((s.first, s.end, s.drain), (2, 16, 4));
    }

    /// The point of the window: the same loop at 10 and 40 times C, whose first generation
    /// queues (TTFT 8 s against 1.0, 1.1 or 1.2 s later), has one steady state, and the whole
    /// run's figures (mean 1,790 ms against 1,272.5 ms, p99 8 s) are that of its length.
    #[test]
    fn the_steady_figures_do_not_depend_on_the_run_length() {
        let slow_start = |i: usize| if i < 8 { 8.0 } else { 1.0 + (i % 3) as f64 * 0.1 };
        let figures = |n: usize, measure: Measure| {
            let run = closed(8, n, 10.0, slow_start);
            let span = select(closed_clients(8, n), measure, run.iter().copied(), 10 * n as u64 * S);
            let gpus = Gpus { prefill: 1, decode: 1 };
            let ttft = steady(&span, run.iter().copied(), &[], &[], gpus, None).latency_ms.ttft.unwrap();
            (ttft.p50, ttft.p90, ttft.p99, ttft.mean)
        };
        // 64 requests (arrivals 8 to 71) at 10 x C, 280 (32 to 311) at 40 x C: a third each of
        // 1.0, 1.1 and 1.2 s, give or take one.
        assert_eq!(figures(80, Measure::default()), (1100.0, 1200.0, 1200.0, 1101.563));
        assert_eq!(figures(320, Measure::default()), (1100.0, 1200.0, 1200.0, 1100.357));
        let whole = Measure { warmup_requests: None, whole_run: true };
        assert_eq!(figures(80, whole), (1100.0, 1200.0, 8000.0, 1790.0));
        assert_eq!(figures(320, whole), (1100.0, 1200.0, 8000.0, 1272.5));
    }

    /// Throughput counts what completed in `(start, end]`, per GPU and per phase; latencies the
    /// requests that arrived inside; goodput the finished requests inside that meet the SLO.
    #[test]
    fn throughput_and_goodput_count_what_completed_inside_the_span() {
        // Ten requests, one a second; each 4 s long with its first token 1 s in, or 3 s in for
        // the odd ones; 11 output tokens, so TPOT 0.3 s or 0.1 s.
        let run: Vec<RequestTimes> = (0..10)
            .map(|i| {
                let t = f64::from(i);
                req(t, t + if i % 2 == 1 { 3.0 } else { 1.0 }, t + 4.0)
            })
            .collect();
        let span = Span {
            kind: WindowKind::Steady,
            first: 2,
            end: 6,
            warmup: 2,
            drain: 4,
            start_ns: 2 * S,
            end_ns: 6 * S,
        };
        let decode: Vec<DecodeStep> = (0..=8)
            .map(|i| DecodeStep {
                end_ns: i * S,
                gap_ns: if i % 2 == 0 { 10_000_000 } else { 30_000_000 },
                later_tokens: 2,
                tokens: 3,
            })
            .collect();
        let prefill = [
            PrefillStep { end_ns: 2 * S, tokens: 1000 },
            PrefillStep { end_ns: 3 * S, tokens: 800 },
            PrefillStep { end_ns: 6 * S, tokens: 400 },
        ];
        let slo = Slo { ttft_ms: Some(2000.0), tpot_ms: Some(300.0) };
        let gpus = Gpus { prefill: 2, decode: 2 };
        let s = steady(&span, run.iter().copied(), &decode, &prefill, gpus, Some(slo));
        assert_eq!((s.window.requests, s.window.start_s, s.window.end_s), (4, 2.0, 6.0));
        // Arrivals 2, 3, 4, 5: TTFT 1, 3, 1, 3 s.
        let ttft = s.latency_ms.ttft.unwrap();
        assert_eq!((ttft.mean, ttft.p50, ttft.p90, ttft.p99), (2000.0, 3000.0, 3000.0, 3000.0));
        let tpot = s.latency_ms.tpot.unwrap();
        assert_eq!((tpot.mean, tpot.p50), (200.0, 300.0));
        assert_eq!(s.latency_ms.e2e.map(|e| e.p99), Some(4000.0));
        // Steps ending at 3, 4, 5, 6 s: gaps 30, 10, 30, 10 ms, two tokens each.
        let itl = s.latency_ms.itl.unwrap();
        assert_eq!((itl.mean, itl.p50, itl.p90), (20.0, 30.0, 30.0));
        // Requests ending in (2, 6]: those of 0, 1 and 2 s (ends 4, 5, 6); 12 tokens out, 1,200 in
        // (the step ending at 2 s is outside), over 4 s and 4 GPUs.
        let t = &s.throughput;
        assert_eq!(
            (t.requests_per_s, t.input_tok_s, t.output_tok_s, t.total_tok_s),
            (0.75, 300.0, 3.0, 303.0)
        );
        assert_eq!(
            (t.requests_per_s_per_gpu, t.total_tok_s_per_gpu, t.output_tok_s_per_gpu),
            (0.188, 75.75, 0.75)
        );
        assert_eq!((t.input_tok_s_per_prefill_gpu, t.output_tok_s_per_decode_gpu), (150.0, 1.5));
        // Of the ends inside, 0 and 2 meet TTFT <= 2 s and TPOT <= 300 ms (1's TTFT is 3 s);
        // of the arrivals inside, 2 and 4.
        let g = s.goodput.unwrap();
        assert_eq!((g.requests_per_s, g.requests_per_s_per_gpu, g.met_fraction), (0.5, 0.125, 0.5));
        // No SLO, no goodput.
        assert_eq!(steady(&span, run.iter().copied(), &decode, &prefill, gpus, None).goodput, None);
    }

    /// Failed and unfinished requests have no latency and miss every SLO.
    #[test]
    fn requests_that_did_not_finish_have_no_latency_and_miss_the_slo() {
        let mut run = [req(0.0, 0.5, 1.0); 3];
        run[1].finished = false;
        run[2].done_ns = None;
        let span = select(
            closed_clients(3, 3),
            Measure { warmup_requests: None, whole_run: true },
            run.iter().copied(),
            2 * S,
        );
        let slo = Slo { ttft_ms: Some(1000.0), tpot_ms: None };
        let s = steady(&span, run.iter().copied(), &[], &[], Gpus { prefill: 1, decode: 1 }, Some(slo));
        assert_eq!(s.latency_ms.ttft.map(|t| t.mean), Some(500.0));
        assert_eq!(s.throughput.requests_per_s, 0.5);
        assert_eq!(s.goodput.map(|g| (g.requests_per_s, g.met_fraction)), Some((0.5, 0.333)));
        assert_eq!(s.latency_ms.itl, None);
    }

    /// (gap ms, tokens) samples -> (mean, p50, p90, p99): each gap counted once per token.
    #[test]
    fn itl_weights_each_gap_by_its_tokens() {
        let check = |samples: &[(u64, u32)], expected: Option<[f64; 4]>| {
            let steps: Vec<DecodeStep> = samples
                .iter()
                .map(|&(ms, n)| DecodeStep { end_ns: 0, gap_ns: ms * 1_000_000, later_tokens: n, tokens: n })
                .collect();
            assert_eq!(itl(steps.iter()).map(|s| [s.mean, s.p50, s.p90, s.p99]), expected, "{samples:?}");
        };
        check(&[], None);
        check(&[(5, 0)], None);
        check(&[(10, 1)], Some([10.0, 10.0, 10.0, 10.0]));
        // 9 tokens waited 10 ms, 1 waited 100: index round(9 q) = 5 (10 ms), 8 (10), 9 (100).
        check(&[(100, 1), (10, 9)], Some([19.0, 10.0, 10.0, 100.0]));
    }
}
