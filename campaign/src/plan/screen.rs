//! The analytical screen of `pdkv plan`: a capacity estimate per layout from the simulator's
//! own cost model (`pdkv_sim::cost`) and the core's real routing, with no simulation. Per side
//! it finds the prefill tokens per second at a step that leaves room in the TTFT target, and the
//! decode tokens per second at the largest batch whose step meets the TPOT target and whose KV
//! fits; per deployment the bytes the busiest prefill NIC sends per request (from the reads the
//! core's proxy and routers assign, `pdkv_core::routes`). The smallest of the three request
//! rates is the layout's capacity and names the bound resource (`docs/sim.md`, "Planning").

use std::fmt;

use pdkv_core::routes::routes;
use pdkv_core::routing::check_pair;
use pdkv_core::topology::{Deployment, Layout};
use pdkv_core::LegacyOptions;
use pdkv_sim::cost::{Cost, GroupLoad, PrefillLoad};
use pdkv_sim::scenario::{Length, Scenario, Slo};
use serde::Serialize;

use super::layouts::{blocks_for, memory_fit, Candidate, MemoryMiss, SideName};

/// Share of a bound side's step spent in the expert all-to-all above which the all-to-all, not
/// the compute or the memory, is named as the bound.
pub const ALLTOALL_BOUND_SHARE: f64 = 0.5;

/// The workload's lengths as the screen uses them: means for rates, maxima for memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lengths {
    pub input_mean: f64,
    pub input_max: u32,
    pub output_mean: f64,
    pub output_max: u32,
}

impl Lengths {
    /// The lengths of a workload's prompt and answer.
    pub fn of(input: Length, output: Length) -> Lengths {
        let (input_mean, input_max) = mean_max(input);
        let (output_mean, output_max) = mean_max(output);
        Lengths { input_mean, input_max, output_mean, output_max }
    }
}

fn mean_max(length: Length) -> (f64, u32) {
    match length {
        Length::Fixed(n) => (f64::from(n), n),
        Length::Uniform { min, max } => ((f64::from(min) + f64::from(max)) / 2.0, max),
    }
}

/// The resource that bounds a layout's goodput.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// Prefill FLOPs: prompts arrive faster than the prefill engines compute them.
    PrefillCompute,
    /// Decode memory or batch room: the KV pool (or the batch limit) caps the requests a decode
    /// DP group runs before its step reaches the TPOT target.
    DecodeMemoryBatch,
    /// Decode step time: a larger batch would break the TPOT target.
    DecodeCompute,
    /// The busiest prefill GPU's NIC, serving the KV reads the routing sends it.
    Nic,
    /// The expert all-to-all takes most of the bound side's step.
    AllToAll,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::PrefillCompute => "prefill compute",
            Bound::DecodeMemoryBatch => "decode memory/batch",
            Bound::DecodeCompute => "decode compute",
            Bound::Nic => "NIC",
            Bound::AllToAll => "all-to-all",
        })
    }
}

/// What stops a decode DP group's batch from growing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeLimit {
    /// Its KV pool holds no more requests.
    Memory,
    /// The engine's batch limit (`engines.decode_max_batch`).
    Batch,
    /// One more request would make the step longer than the TPOT target.
    Tpot,
}

/// One prefill engine's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PrefillEstimate {
    /// Prompt tokens per step of one DP rank at the screened load.
    pub step_tokens: u64,
    /// That step's time, ms.
    pub step_ms: f64,
    /// A lone prompt's prefill on an idle engine, ms.
    pub lone_ms: f64,
    /// Requests per second one engine prefills.
    pub requests_per_s: f64,
    /// Share of the step in the expert all-to-all (0 without EP).
    pub alltoall_share: f64,
}

/// One decode engine's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DecodeEstimate {
    /// Requests one DP group runs at once.
    pub batch: u64,
    /// What stops it growing.
    pub limit: DecodeLimit,
    /// The step's time at that batch, ms.
    pub step_ms: f64,
    /// Requests per second one engine finishes.
    pub requests_per_s: f64,
    /// Share of the step in the expert all-to-all (0 without EP).
    pub alltoall_share: f64,
}

/// The screen's estimate of one deployment.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// Requests per second the prefill engines take.
    pub prefill_requests_per_s: f64,
    /// Requests per second the decode engines finish at the TPOT target.
    pub decode_requests_per_s: f64,
    /// Requests per second the busiest prefill NIC serves.
    pub nic_requests_per_s: f64,
    /// The smallest of the three.
    pub requests_per_s: f64,
    /// The same per GPU of the deployment.
    pub requests_per_s_per_gpu: f64,
    /// Prompt and generated tokens per second per GPU at that rate.
    pub tok_s_per_gpu: f64,
    /// Busy shares at that rate: prefill compute, decode, busiest NIC.
    pub utilisation: Utilisation,
    /// Bytes per second the busiest prefill NIC sends at that rate.
    pub nic_bytes_per_s: f64,
    /// Jain's index of the reads over the prefill GPUs, from the core's routing.
    pub nic_jain: f64,
    /// The resource with the smallest rate.
    pub bound: Bound,
    /// One prefill engine.
    pub prefill: PrefillEstimate,
    /// One decode engine.
    pub decode: DecodeEstimate,
    /// Whether the NIC figures come from the core's routing (always, for a layout that runs);
    /// without it the NIC is left out and the capacity is an upper bound.
    #[serde(skip)]
    pub routed: bool,
}

/// How reads land on the busiest prefill GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NicShare {
    /// Reads it serves per request routed.
    pub reads_per_request: f64,
    /// Jain's index of the reads over the prefill GPUs.
    pub jain: f64,
}

/// Busy shares of the three resources at the layout's capacity (the bound one is 1).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Utilisation {
    pub prefill: f64,
    pub decode: f64,
    pub nic: f64,
}

/// Why the screen drops a deployment before any run.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ScreenMiss {
    /// An engine does not hold its weights or one request.
    Memory(MemoryMiss),
    /// A lone prompt on an idle prefill engine already takes longer than the TTFT target.
    PrefillSlo { layout: String, lone_ms: f64, target_ms: f64 },
    /// A decode step of one request already takes longer than the TPOT target.
    DecodeSlo { layout: String, step_ms: f64, target_ms: f64 },
    /// The core's routing refuses the pair (a decode engine cannot read a prefill engine).
    Routing { message: String },
}

impl fmt::Display for ScreenMiss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScreenMiss::Memory(miss) => write!(f, "{miss}"),
            ScreenMiss::PrefillSlo { layout, lone_ms, target_ms } => write!(
                f,
                "prefill {layout}: a lone prompt takes {lone_ms:.0} ms on an idle engine, over the TTFT target {target_ms} ms"
            ),
            ScreenMiss::DecodeSlo { layout, step_ms, target_ms } => write!(
                f,
                "decode {layout}: a step of one request takes {step_ms:.1} ms, over the TPOT target {target_ms} ms"
            ),
            ScreenMiss::Routing { message } => write!(f, "routing: {message}"),
        }
    }
}

/// The model, workload and targets one screen uses for every layout.
pub struct Screen<'a> {
    pub scenario: &'a Scenario,
    pub cost: Cost,
    pub lengths: Lengths,
    pub slo: Slo,
}

/// The largest `x` in `lo..=hi` with `ok(x)`, for `ok` true up to a point and false after;
/// `None` when `ok(lo)` is false.
fn largest(lo: u64, hi: u64, ok: impl Fn(u64) -> bool) -> Option<u64> {
    if lo > hi || !ok(lo) {
        return None;
    }
    let (mut good, mut bad) = (lo, hi + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

impl Screen<'_> {
    /// A screen of `scenario`'s model and hardware for the workload and targets.
    pub fn new(scenario: &Scenario, lengths: Lengths, slo: Slo) -> Screen<'_> {
        Screen { scenario, cost: Cost::of(scenario), lengths, slo }
    }

    /// The load of a step of `tokens` prompt tokens made of whole prompts of the workload's mean
    /// length (the last one cut), which is what attention's quadratic term needs to know.
    fn step_load(&self, tokens: u64) -> PrefillLoad {
        let prompt = (self.lengths.input_mean.ceil() as u64).max(1);
        let whole = usize::try_from(tokens / prompt).unwrap_or(usize::MAX);
        let mut chunks = vec![(0, prompt); whole];
        if !tokens.is_multiple_of(prompt) {
            chunks.push((0, tokens % prompt));
        }
        PrefillLoad::of_chunks(&chunks)
    }

    /// Nanoseconds of one prefill step of `layout` in which DP rank `i` carries `loads[i]` (a
    /// TP engine has one).
    fn step_ns(&self, layout: Layout, loads: &[PrefillLoad]) -> u64 {
        if layout.ep {
            self.cost.prefill_ep_step_ns(layout, loads)
        } else {
            self.cost.prefill_batch_ns(layout, loads[0])
        }
    }

    /// Nanoseconds of a prefill step in which every DP rank of `layout` carries `tokens`.
    fn prefill_step_ns(&self, layout: Layout, tokens: u64) -> u64 {
        let load = self.step_load(tokens);
        self.step_ns(layout, &vec![load; usize::from(layout.dp).max(1)])
    }

    /// One prefill engine of `layout`: a lone prompt's time must meet the TTFT target; under
    /// load a DP rank's step takes the most prompt tokens (up to the engine's token budget) it
    /// can while lasting at most half the target, the other half left to waiting, the KV read
    /// and the first decode step.
    pub fn prefill(&self, layout: Layout) -> Result<PrefillEstimate, ScreenMiss> {
        let sc = self.scenario;
        memory_fit(sc, &self.cost, SideName::Prefill, layout, self.lengths.input_max)
            .map_err(ScreenMiss::Memory)?;
        let budget = u64::from(sc.engines.prefill_max_batched_tokens.max(1));
        let prompt = (self.lengths.input_mean.ceil() as u64).max(1);
        let chunk = prompt.min(budget);
        let chunks = prompt.div_ceil(chunk);
        // A lone prompt on one DP rank, chunk after chunk, each attending to the ones before.
        let lone_ns: u64 = (0..chunks)
            .map(|i| {
                let context = i * chunk;
                let load = PrefillLoad::of_chunks(&[(context, chunk.min(prompt - context))]);
                let mut loads = vec![PrefillLoad::default(); usize::from(layout.dp).max(1)];
                loads[0] = load;
                self.step_ns(layout, &loads)
            })
            .sum();
        let lone_ms = lone_ns as f64 / 1e6;
        if let Some(target) = self.slo.ttft_ms {
            if lone_ms > target {
                return Err(ScreenMiss::PrefillSlo {
                    layout: layout.to_string(),
                    lone_ms,
                    target_ms: target,
                });
            }
        }
        let half_ns = self.slo.ttft_ms.map_or(u64::MAX, |t| (t * 1e6 / 2.0) as u64);
        let step_tokens =
            largest(chunk, budget, |t| self.prefill_step_ns(layout, t) <= half_ns).unwrap_or(chunk);
        let step_ns = self.prefill_step_ns(layout, step_tokens).max(1);
        let tokens_per_s = f64::from(layout.dp) * step_tokens as f64 * 1e9 / step_ns as f64;
        let alltoall = self.cost.ep_alltoall_ns(layout, step_tokens as f64) as f64 / step_ns as f64;
        Ok(PrefillEstimate {
            step_tokens,
            step_ms: step_ns as f64 / 1e6,
            lone_ms,
            requests_per_s: tokens_per_s / self.lengths.input_mean.max(1.0),
            alltoall_share: alltoall.min(1.0),
        })
    }

    /// Nanoseconds of a decode step of `layout` with `batch` requests in each DP group (every
    /// group of an EP engine steps together; without EP a group steps alone).
    fn decode_step_ns(&self, layout: Layout, batch: u64) -> u64 {
        let context = (self.lengths.input_mean + self.lengths.output_mean / 2.0).round() as u64;
        let load = GroupLoad { batch, context_tokens: batch * context };
        let groups = if layout.ep { usize::from(layout.dp) } else { 1 };
        self.cost.decode_step_ns(layout, &vec![load; groups])
    }

    /// One decode engine of `layout`: the largest batch per DP group its KV pool (which reserves
    /// a whole request's prompt and answer) and batch limit allow whose step meets the TPOT
    /// target, at the workload's mean context.
    pub fn decode(&self, layout: Layout) -> Result<DecodeEstimate, ScreenMiss> {
        let sc = self.scenario;
        let request = self.lengths.input_max.saturating_add(self.lengths.output_max);
        let blocks =
            memory_fit(sc, &self.cost, SideName::Decode, layout, request).map_err(ScreenMiss::Memory)?;
        let by_memory = u64::from(blocks / blocks_for(request, sc.model.block_size_tokens));
        let cap = by_memory.min(u64::from(sc.engines.decode_max_batch.max(1)));
        let target_ns = self.slo.tpot_ms.map_or(u64::MAX, |t| (t * 1e6) as u64);
        let Some(batch) = largest(1, cap, |b| self.decode_step_ns(layout, b) <= target_ns) else {
            return Err(ScreenMiss::DecodeSlo {
                layout: layout.to_string(),
                step_ms: self.decode_step_ns(layout, 1) as f64 / 1e6,
                target_ms: self.slo.tpot_ms.unwrap_or(0.0),
            });
        };
        let limit = if batch < cap {
            DecodeLimit::Tpot
        } else if by_memory <= u64::from(sc.engines.decode_max_batch) {
            DecodeLimit::Memory
        } else {
            DecodeLimit::Batch
        };
        let step_ns = self.decode_step_ns(layout, batch).max(1);
        let tokens_per_s = f64::from(layout.dp) * batch as f64 * 1e9 / step_ns as f64;
        let alltoall = self.cost.ep_alltoall_ns(layout, batch as f64) as f64 / step_ns as f64;
        Ok(DecodeEstimate {
            batch,
            limit,
            step_ms: step_ns as f64 / 1e6,
            requests_per_s: tokens_per_s / self.lengths.output_mean.max(1.0),
            alltoall_share: alltoall.min(1.0),
        })
    }

    /// Bytes of one read: a decode worker's share of the mean prompt's KV.
    fn read_bytes(&self, candidate: &Candidate) -> f64 {
        self.lengths.input_mean
            * f64::from(self.scenario.model.layers)
            * self.cost.kv_bytes_per_token_per_rank(candidate.decode.layout.tp)
    }

    /// The NIC share of `candidate` from the reads the core's proxy and read routers give each
    /// prefill GPU over one round of every prefill slot and decode DP rank (`pdkv_core::routes`,
    /// as `pdkv routes` shows them).
    pub fn nic(&self, candidate: &Candidate) -> Result<NicShare, ScreenMiss> {
        let deployment = Deployment::parse(&candidate.notation())
            .map_err(|e| ScreenMiss::Routing { message: e.to_string() })?
            .with_model(self.scenario.model_spec());
        let table = routes(&deployment, &LegacyOptions::default(), 1)
            .map_err(|e| ScreenMiss::Routing { message: e.to_string() })?;
        let hottest = table.reads_per_prefill_gpu.iter().copied().max().unwrap_or(0) as f64;
        Ok(NicShare { reads_per_request: hottest / table.requests.max(1) as f64, jain: table.jain })
    }

    /// The estimate of `candidate` from its sides' estimates, before its NIC share: the
    /// routing's pair check comes first (`routing::check_pair`, the rule the core's routers
    /// apply), and the capacity is the smaller of the two sides' rates, an upper bound of the
    /// layout's until [`Screen::routed`] adds the NIC's (the core's whole routing table is most
    /// of the screen's time on a large budget, so it is taken only for layouts that can still
    /// reach the shortlist).
    pub fn deployment(
        &self,
        candidate: &Candidate,
        prefill: PrefillEstimate,
        decode: DecodeEstimate,
    ) -> Result<Estimate, ScreenMiss> {
        let model = self.scenario.model_spec();
        let (p, d) = (candidate.prefill.layout, candidate.decode.layout);
        check_pair(d, p, &model).map_err(|e| ScreenMiss::Routing {
            message: format!("decode {d} cannot read prefill {p}: {e}"),
        })?;
        let mut estimate =
            self.assemble(candidate, prefill, decode, NicShare { reads_per_request: 0.0, jain: 0.0 });
        estimate.routed = false;
        Ok(estimate)
    }

    /// `estimate` with its NIC figures from the core's routing (unchanged if it has them).
    pub fn routed(&self, candidate: &Candidate, estimate: &Estimate) -> Result<Estimate, ScreenMiss> {
        if estimate.routed {
            return Ok(estimate.clone());
        }
        Ok(self.assemble(candidate, estimate.prefill, estimate.decode, self.nic(candidate)?))
    }

    /// Requests per second the busiest prefill NIC carries at `share`.
    fn nic_requests_per_s(&self, candidate: &Candidate, share: NicShare) -> f64 {
        let bytes = share.reads_per_request * self.read_bytes(candidate);
        if bytes > 0.0 {
            self.scenario.hardware.nic_gb_s * 1e9 / bytes
        } else {
            f64::INFINITY
        }
    }

    fn assemble(
        &self,
        candidate: &Candidate,
        prefill: PrefillEstimate,
        decode: DecodeEstimate,
        nic: NicShare,
    ) -> Estimate {
        let nic_bytes_per_request = nic.reads_per_request * self.read_bytes(candidate);
        let nic_rps = self.nic_requests_per_s(candidate, nic);
        let prefill_rps = prefill.requests_per_s * f64::from(candidate.prefill.engines);
        let decode_rps = decode.requests_per_s * f64::from(candidate.decode.engines);
        let rps = prefill_rps.min(decode_rps).min(nic_rps);
        let bound = if rps == prefill_rps {
            if prefill.alltoall_share >= ALLTOALL_BOUND_SHARE {
                Bound::AllToAll
            } else {
                Bound::PrefillCompute
            }
        } else if rps == decode_rps {
            decode_bound(&decode)
        } else {
            Bound::Nic
        };
        let gpus = f64::from(candidate.gpus());
        let share = |cap: f64| if cap.is_finite() && cap > 0.0 { rps / cap } else { 0.0 };
        Estimate {
            prefill_requests_per_s: prefill_rps,
            decode_requests_per_s: decode_rps,
            nic_requests_per_s: if nic_rps.is_finite() { nic_rps } else { 0.0 },
            requests_per_s: rps,
            requests_per_s_per_gpu: rps / gpus,
            tok_s_per_gpu: rps * (self.lengths.input_mean + self.lengths.output_mean) / gpus,
            utilisation: Utilisation {
                prefill: share(prefill_rps),
                decode: share(decode_rps),
                nic: share(nic_rps),
            },
            nic_bytes_per_s: rps * nic_bytes_per_request,
            nic_jain: nic.jain,
            bound,
            prefill,
            decode,
            routed: true,
        }
    }
}

impl Screen<'_> {
    /// Requests in flight when `candidate` serves `estimate`'s rate (Little's law): those in
    /// prefill (the rate times a prefill step) and those decoding, whose batch is the fixed
    /// point of `batch = rate x answer x step(batch)` over the decode DP groups: below the
    /// decode capacity the batch, and so the step, is smaller than at the TPOT target.
    pub fn in_flight(&self, candidate: &Candidate, estimate: &Estimate, rate_per_s: f64) -> f64 {
        let layout = candidate.decode.layout;
        let groups = f64::from(candidate.decode.engines) * f64::from(layout.dp);
        let mut batch = estimate.decode.batch as f64;
        for _ in 0..32 {
            let step_s = self.decode_step_ns(layout, batch.ceil().max(1.0) as u64) as f64 / 1e9;
            let next =
                (rate_per_s * self.lengths.output_mean * step_s / groups).min(estimate.decode.batch as f64);
            if (next - batch).abs() < 0.01 {
                batch = next;
                break;
            }
            batch = next;
        }
        rate_per_s * estimate.prefill.step_ms / 1e3 + batch * groups
    }
}

/// What bounds a decode side: the all-to-all when it takes most of the step, else what stops
/// the batch growing.
pub fn decode_bound(decode: &DecodeEstimate) -> Bound {
    if decode.alltoall_share >= ALLTOALL_BOUND_SHARE {
        Bound::AllToAll
    } else {
        match decode.limit {
            DecodeLimit::Memory | DecodeLimit::Batch => Bound::DecodeMemoryBatch,
            DecodeLimit::Tpot => Bound::DecodeCompute,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layouts::Side;

    fn screen(sc: &Scenario, ttft: f64, tpot: f64) -> Screen<'_> {
        let lengths = Lengths::of(Length::Fixed(8192), Length::Fixed(1024));
        Screen::new(sc, lengths, Slo { ttft_ms: Some(ttft), tpot_ms: Some(tpot) })
    }

    #[test]
    fn largest_finds_the_edge() {
        let check = |lo: u64, hi: u64, edge: u64, expected: Option<u64>| {
            assert_eq!(largest(lo, hi, |x| x <= edge), expected, "{lo}..={hi} edge {edge}");
        };
        check(1, 100, 37, Some(37));
        check(1, 100, 500, Some(100));
        check(5, 100, 4, None);
        check(1, 1, 1, Some(1));
    }

    /// (decode layout, TPOT target) -> what stops the batch and the bound it names.
    #[test]
    fn the_decode_batch_stops_at_memory_or_the_target() {
        let sc = Scenario::from_notation("1P_TP8:1D_TP8");
        let check = |layout: Layout, tpot: f64, limit: DecodeLimit, bound: Bound| {
            let s = screen(&sc, 2000.0, tpot);
            let d = s.decode(layout).expect("fits");
            assert_eq!((d.limit, decode_bound(&d)), (limit, bound), "{layout} at {tpot} ms: {d:?}");
            assert!(d.step_ms <= tpot, "{d:?}");
        };
        // TP8 holds 255 requests of 8K/1K (cost.rs): a loose target lets memory stop it.
        check(Layout::tp(8), 1000.0, DecodeLimit::Memory, Bound::DecodeMemoryBatch);
        check(Layout::tp(8), 30.0, DecodeLimit::Tpot, Bound::DecodeCompute);
        // A target below a one-request step is refused with the step's time.
        let tight = screen(&sc, 2000.0, 1.0).decode(Layout::tp(8)).expect_err("too tight");
        assert!(tight.to_string().starts_with("decode TP8: a step of one request takes"), "{tight}");
    }

    /// A tighter TTFT target means smaller prefill steps and fewer tokens per second; one below
    /// a lone prompt's time is refused.
    #[test]
    fn the_prefill_step_leaves_room_in_the_ttft_target() {
        let sc = Scenario::from_notation("1P_TP8:1D_TP8");
        let loose = screen(&sc, 60_000.0, 50.0).prefill(Layout::tp(8)).expect("fits");
        let tight = screen(&sc, 2_000.0, 50.0).prefill(Layout::tp(8)).expect("fits");
        assert!(tight.step_tokens < loose.step_tokens, "{tight:?} {loose:?}");
        assert!(tight.step_ms <= 1000.0 && tight.requests_per_s <= loose.requests_per_s, "{tight:?}");
        let refused = screen(&sc, 1.0, 50.0).prefill(Layout::tp(8)).expect_err("too tight");
        assert!(refused.to_string().contains("over the TTFT target 1 ms"), "{refused}");
    }

    /// The NIC share comes from the core's routing: a DP8EP decode engine reading two TP8
    /// prefill engines spreads its reads evenly (Jain 1), and the capacity is the smallest rate.
    #[test]
    fn a_deployment_takes_its_smallest_rate() {
        let sc = Scenario::from_notation("2P_TP8:1D_DP8EP");
        let s = screen(&sc, 2000.0, 50.0);
        let (p, d) = (Layout::tp(8), Layout::new(8, 1, true));
        let c = Candidate { prefill: Side { engines: 2, layout: p }, decode: Side { engines: 1, layout: d } };
        let unrouted =
            s.deployment(&c, s.prefill(p).expect("fits"), s.decode(d).expect("fits")).expect("routes");
        // Before the routing the capacity is the sides' alone; the NIC does not bind here (48
        // GB/s against a few requests per second), so the routed capacity is the same.
        assert!(!unrouted.routed, "{unrouted:?}");
        let e = s.routed(&c, &unrouted).expect("routes");
        assert!(e.routed && e.requests_per_s == unrouted.requests_per_s, "{e:?}");
        assert_eq!(e.nic_jain, 1.0);
        let smallest = e.prefill_requests_per_s.min(e.decode_requests_per_s).min(e.nic_requests_per_s);
        assert_eq!(e.requests_per_s, smallest);
        assert!((e.requests_per_s_per_gpu * 24.0 - e.requests_per_s).abs() < 1e-9);
        let top = e.utilisation.prefill.max(e.utilisation.decode).max(e.utilisation.nic);
        assert!((top - 1.0).abs() < 1e-9, "{e:?}");
    }
}
