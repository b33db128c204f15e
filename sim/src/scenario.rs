//! The scenario: everything a run depends on besides the seed, as data (RON files under
//! `scenarios/`, or built from a bare notation with the default profile).
//!
//! Every field has a default, so a file states only what differs. Unknown fields are rejected.
//! Units are in the field names (`_ms`, `_us`, `_gb_s`, ...). `docs/scenarios.md` documents each.

use std::collections::BTreeMap;

use pdkv_core::ids::EngineId;
use pdkv_core::legacy::Legacy;
use pdkv_core::policy::{PeerBook, PeerRules};
use pdkv_core::topology::Deployment;
use pdkv_engine::timeouts::ProtocolTimeouts;
/// How a run ended: the engine layer's verdict, which the real cluster's results name too.
pub use pdkv_engine::verdict::Outcome;
use serde::{Deserialize, Serialize};

use crate::error::PeerError;

/// Version of the scenario and result formats; bumped when a field changes meaning. 2: a
/// hang's `wait_for` edges and `cycle` members are objects, no longer `a -> b (reason)` text.
pub const FORMAT_VERSION: u32 = 2;

// Limits on every size, count and time a scenario can ask for. Each is far above any real
// deployment, and low enough that the simulator's arithmetic (u64 nanoseconds, u32 blocks) and
// memory stay bounded: a scenario past one is rejected at load with the field and the limit.

/// Largest value of any `_ms` field: 10^10 ms, about 115 days, the engine layer's longest
/// protocol timeout. Times are u64 nanoseconds; at most 10^16 ns each, a thousand of them add
/// up without overflow (u64 holds 1.8 · 10^19).
pub const MAX_TIME_MS: u64 = pdkv_engine::timeouts::MAX_TIMEOUT_MS;
/// Largest `limits.max_virtual_time_s`: one day, twelve times the default. The result keeps one
/// NIC utilisation value per prefill GPU per virtual second, so this also bounds its size.
pub const MAX_VIRTUAL_TIME_S: u64 = 86_400;
/// Largest value of any `_us` field (latencies, service times): the same 115 days.
pub const MAX_TIME_US: f64 = 1e13;
/// Most requests one run sends (each keeps a record until the end of the run).
pub const MAX_REQUESTS: u32 = 1_000_000;
/// Most closed-loop clients (requests in flight at once).
pub const MAX_CONCURRENCY: u32 = 100_000;
/// Longest prompt or output of one request, in tokens (a million-token context).
pub const MAX_TOKENS: u32 = 1 << 20;
/// Most entries of the fault timeline.
pub const MAX_TIMELINE_FAULTS: usize = 1_000;
/// Most `EngineCrash` entries of the timeline: every restart moves a prefill rank's memory to
/// the next of 64 incarnation slots of its address range.
pub const MAX_ENGINE_CRASHES: usize = 63;
/// Largest `limits.max_events` (about an hour of simulation at 2.5 M events/s).
pub const MAX_EVENTS: u64 = 10_000_000_000;
/// Most KV bytes one GPU registers: every incarnation of a prefill rank gets a 256 GiB slice of
/// the simulated address space, so a larger pool would overlap its neighbour.
pub const MAX_KV_BYTES_PER_GPU: u64 = 1 << 38;
/// Most KV blocks of every pool of a deployment together: the simulator keeps a 4-byte owner
/// record per block it hands out, so this bounds that memory to 1 GiB.
pub const MAX_TOTAL_KV_BLOCKS: u64 = 1 << 28;
/// Smallest and largest value of a bandwidth, throughput or rate field, in its own unit (GB/s,
/// TB/s, TFLOP/s, requests/s, billions of parameters, GB): outside these a float-to-integer
/// conversion of a duration or a size would saturate or lose all precision.
pub const RATE_RANGE: (f64, f64) = (1e-6, 1e9);
/// Smallest `SlowNic` factor: a millionth of the bandwidth (a 48 GB/s NIC at 48 KB/s).
pub const MIN_SLOW_NIC_FACTOR: f64 = 1e-6;
/// Largest model dimension fields (`hidden_size`, `kv_bytes_per_token_per_layer`) and
/// `block_size_tokens`.
pub const MAX_MODEL_DIMENSION: u32 = 1 << 20;

/// One simulation input.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name, used for the output folder.
    pub name: String,
    /// One line: what the scenario shows.
    #[serde(default)]
    pub description: String,
    /// Deployment notation, e.g. `2P_TP8:1D_DP8EP`.
    pub deployment: String,
    /// The named profiles (`profiles/*.ron`) that filled `hardware` and `model` when the file was
    /// loaded; absent from printed scenarios that name none.
    #[serde(default, skip_serializing_if = "Profiles::is_empty")]
    pub profiles: Profiles,
    /// The served model.
    #[serde(default)]
    pub model: ModelProfile,
    /// GPUs, NICs, fabric and listeners.
    #[serde(default)]
    pub hardware: Hardware,
    /// Calibrated compute-time constants.
    #[serde(default)]
    pub cost: CostModel,
    /// Clients and request lengths.
    #[serde(default)]
    pub workload: Workload,
    /// Protocol knobs and legacy options.
    #[serde(default)]
    pub protocol: Protocol,
    /// Scheduler limits of the engines.
    #[serde(default)]
    pub engines: EngineLimits,
    /// Fault timeline and randomised faults.
    #[serde(default)]
    pub faults: Faults,
    /// Seed of every random stream of the run.
    #[serde(default)]
    pub seed: u64,
    /// Budgets that end a run.
    #[serde(default)]
    pub limits: Limits,
    /// Which requests the run's steady-state figures cover (`docs/sim.md`, "Steady state");
    /// absent from printed scenarios while it keeps its default.
    #[serde(default, skip_serializing_if = "Measure::is_default")]
    pub measure: Measure,
    /// Latency targets a request must meet to count towards goodput; no goodput without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    /// The outcome this scenario is expected to have (`clean` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Outcome>,
    /// Bounds the NIC balance (Jain index of reads per prefill GPU) must meet, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_jain: Option<JainBounds>,
}

/// Inclusive bounds on the Jain index of reads per prefill GPU.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JainBounds {
    /// Lowest acceptable index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_least: Option<f64>,
    /// Highest acceptable index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_most: Option<f64>,
}

impl JainBounds {
    /// True when `jain` is within the bounds.
    pub fn holds(&self, jain: f64) -> bool {
        self.at_least.is_none_or(|lo| jain >= lo) && self.at_most.is_none_or(|hi| jain <= hi)
    }
}

impl std::fmt::Display for JainBounds {
    /// The bounds as a person reads them: `at least 0.99`, `at most 0.5`, `in [0.2, 0.8]`, or
    /// `unbounded`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.at_least, self.at_most) {
            (Some(lo), Some(hi)) => write!(f, "in [{lo}, {hi}]"),
            (Some(lo), None) => write!(f, "at least {lo}"),
            (None, Some(hi)) => write!(f, "at most {hi}"),
            (None, None) => f.write_str("unbounded"),
        }
    }
}

/// The profiles a scenario names, by name: each fills its fields of `hardware` or `model` from
/// `profiles/gpus.ron`, `profiles/nics.ron` or `profiles/models.ron` when the scenario is loaded
/// (`crate::profiles::resolve`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Profiles {
    /// A GPU profile: HBM, compute, fabric, GPUs per node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// A NIC profile: RDMA bandwidth, line rate, latency, message rate, queue pairs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nic: Option<String>,
    /// A model profile: every field of `model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Fields a named profile fills that the scenario sets itself, as dotted paths of the
    /// scenario (`hardware.fp8_tflops`, `model.layers`): each must be written in the scenario,
    /// and its written value is kept instead of the profile's. Left out of printed scenarios and
    /// results while empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<String>,
}

impl Profiles {
    /// True when no profile is named and nothing is overridden (the scenario's own values, or
    /// the defaults, are used).
    pub fn is_empty(&self) -> bool {
        self.gpu.is_none() && self.nic.is_none() && self.model.is_none() && self.overrides.is_empty()
    }
}

impl std::fmt::Display for Profiles {
    /// The named profiles as a person reads them, e.g. `gpu h200-sxm, model deepseek-r1`, then
    /// the fields overridden, e.g. `gpu mi300x; overridden: hardware.fp8_tflops`; or `none`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let named: Vec<String> = [("gpu", &self.gpu), ("nic", &self.nic), ("model", &self.model)]
            .into_iter()
            .filter_map(|(kind, name)| name.as_ref().map(|name| format!("{kind} {name}")))
            .collect();
        if named.is_empty() {
            f.write_str("none")?;
        } else {
            f.write_str(&named.join(", "))?;
        }
        if !self.overrides.is_empty() {
            write!(f, "; overridden: {}", self.overrides.join(", "))?;
        }
        Ok(())
    }
}

/// Predicates that leave a field added after results were first recorded out of a printed
/// scenario while it keeps its default, so the `scenario_ron` of every earlier result, and every
/// result compared byte for byte, stays the same. A value other than the default is printed.
mod at_default {
    use super::{CostModel, EngineLimits, Hardware, ModelProfile};

    macro_rules! at_default {
        ($owner:ident: $($field:ident: $ty:ty),* $(,)?) => {
            $(pub(super) fn $field(value: &$ty) -> bool {
                *value == $owner::default().$field
            })*
        };
    }

    at_default!(ModelProfile: head_dim: u32, total_params_b: f64, routed_experts: u16, experts_per_token: u16,
        shared_experts: u16, expert_params_per_layer_m: f64, weight_bytes_per_param: f64, attention_heads: u16,
        qk_head_dim: u32, v_head_dim: u32);
    at_default!(Hardware: bf16_tflops: f64, gpus_per_node: u16, line_rate_gbit: f64, nic_message_rate_mpps: f64,
        nic_qps: u16, nic_qp_message_rate_mpps: f64);
    at_default!(EngineLimits: gpu_memory_utilization: f64, decode_kv_allocation: super::KvAllocationMode,
        stack: String);
    at_default!(CostModel: activation_reserve_gb: f64);
}

/// The served model's facts that drive KV sizes and compute.
///
/// The fields after `hidden_size` came with the profiles: the decode model reads the parameter
/// and expert counts, prefill's attention the heads and their widths, `head_dim` waits for
/// cost terms still to come. A printed scenario carries each only when it is not the default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelProfile {
    /// Multi-head latent attention (KV replicated on every TP rank).
    pub use_mla: bool,
    /// KV heads (1 for MLA).
    pub kv_heads: u16,
    /// Transformer layers.
    pub layers: u16,
    /// Layers with routed experts (each does an expert all-to-all under EP).
    pub moe_layers: u16,
    /// KV bytes per token per layer, whole model.
    pub kv_bytes_per_token_per_layer: u32,
    /// Tokens per KV block.
    pub block_size_tokens: u32,
    /// Parameters active per token, in billions (FLOPs per token = 2 × this).
    pub active_params_b: f64,
    /// Hidden size (bytes moved per token per expert all-to-all, at one byte per value).
    pub hidden_size: u32,
    /// Values of one cached KV head per token (under MLA the latent plus the RoPE key).
    #[serde(skip_serializing_if = "at_default::head_dim")]
    pub head_dim: u32,
    /// Parameters in all, in billions.
    #[serde(skip_serializing_if = "at_default::total_params_b")]
    pub total_params_b: f64,
    /// Routed experts per MoE layer (0 for a dense model).
    #[serde(skip_serializing_if = "at_default::routed_experts")]
    pub routed_experts: u16,
    /// Routed experts each token goes to (top-k).
    #[serde(skip_serializing_if = "at_default::experts_per_token")]
    pub experts_per_token: u16,
    /// Experts every token goes to.
    #[serde(skip_serializing_if = "at_default::shared_experts")]
    pub shared_experts: u16,
    /// Parameters of one routed expert in one layer, in millions.
    #[serde(skip_serializing_if = "at_default::expert_params_per_layer_m")]
    pub expert_params_per_layer_m: f64,
    /// Bytes per weight of the checkpoint (1 for FP8, 2 for BF16).
    #[serde(skip_serializing_if = "at_default::weight_bytes_per_param")]
    pub weight_bytes_per_param: f64,
    /// Query heads.
    #[serde(skip_serializing_if = "at_default::attention_heads")]
    pub attention_heads: u16,
    /// Values of one query (and key) head that prefill's attention multiplies per token pair;
    /// under MLA the uncompressed head (`qk_nope_head_dim + qk_rope_head_dim`).
    #[serde(skip_serializing_if = "at_default::qk_head_dim")]
    pub qk_head_dim: u32,
    /// Values of one value head that prefill's attention sums per token pair.
    #[serde(skip_serializing_if = "at_default::v_head_dim")]
    pub v_head_dim: u32,
}

impl Default for ModelProfile {
    /// DeepSeek-R1: MLA latent of 576 values per token per layer stored as FP8 (vLLM's
    /// `--kv-cache-dtype fp8`, which the published runs need to hold their batch sizes), 61
    /// layers of which 58 are MoE with 256 routed experts (8 per token) and 1 shared, 671B
    /// parameters of which 37B active, FP8 weights, hidden size 7168, 128 heads: the
    /// `deepseek-r1` profile of `profiles/models.ron`, value for value (a test checks it).
    fn default() -> Self {
        ModelProfile {
            use_mla: true,
            kv_heads: 1,
            layers: 61,
            moe_layers: 58,
            kv_bytes_per_token_per_layer: 576,
            block_size_tokens: 16,
            active_params_b: 37.0,
            hidden_size: 7168,
            head_dim: 576,
            total_params_b: 671.0,
            routed_experts: 256,
            experts_per_token: 8,
            shared_experts: 1,
            expert_params_per_layer_m: 44.040192,
            weight_bytes_per_param: 1.0,
            attention_heads: 128,
            qk_head_dim: 192,
            v_head_dim: 128,
        }
    }
}

/// Hardware of every GPU node.
///
/// The fields after `listener_service_us` came with the profiles: the NIC model reads the
/// message rates and `nic_qps`, the all-to-all `gpus_per_node`, prefill's attention
/// `bf16_tflops`; `line_rate_gbit` waits for cost terms still to come. A printed scenario carries each only
/// when it is not the default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Hardware {
    /// HBM per GPU.
    pub hbm_gb: f64,
    /// Fraction of HBM given to the KV cache whatever the weights; 0 (the default) derives the
    /// KV cache from the weights each GPU holds (see `engines.gpu_memory_utilization`).
    pub kv_memory_fraction: f64,
    /// HBM bandwidth per GPU.
    pub hbm_tb_s: f64,
    /// Dense FP8 throughput per GPU.
    pub fp8_tflops: f64,
    /// Intra-node fabric bandwidth per GPU (TP all-reduce, EP all-to-all).
    pub fabric_gb_s: f64,
    /// RDMA NIC bandwidth per GPU (MoRI-IO moves about 48 GB/s per 400 Gb/s NIC).
    pub nic_gb_s: f64,
    /// Per-message latency of an RDMA read.
    pub nic_latency_us: f64,
    /// One-way latency of a control message (handshake, release, HTTP hop).
    pub control_latency_us: f64,
    /// Time a handshake or notify listener spends on one message (one at a time).
    pub listener_service_us: f64,
    /// Dense BF16 throughput per GPU.
    #[serde(skip_serializing_if = "at_default::bf16_tflops")]
    pub bf16_tflops: f64,
    /// GPUs per node (one scale-up fabric domain).
    #[serde(skip_serializing_if = "at_default::gpus_per_node")]
    pub gpus_per_node: u16,
    /// Line rate of one NIC.
    #[serde(skip_serializing_if = "at_default::line_rate_gbit")]
    pub line_rate_gbit: f64,
    /// Small-message ceiling of one NIC, millions of messages per second.
    #[serde(skip_serializing_if = "at_default::nic_message_rate_mpps")]
    pub nic_message_rate_mpps: f64,
    /// Queue pairs one transfer uses.
    #[serde(skip_serializing_if = "at_default::nic_qps")]
    pub nic_qps: u16,
    /// Messages one queue pair carries, millions per second: a transfer's operations go no
    /// faster than `nic_qps` times this, whatever the NIC's ceiling.
    #[serde(skip_serializing_if = "at_default::nic_qp_message_rate_mpps")]
    pub nic_qp_message_rate_mpps: f64,
}

impl Default for Hardware {
    /// MI300X-class: 192 GB HBM3 at 5.3 TB/s, 2.6 PFLOP/s dense FP8 and 1.3 dense BF16, eight
    /// GPUs per node, one 400 Gb/s NIC per GPU measured at 48 GB/s and 7.1 M messages/s with
    /// four queue pairs per transfer (MoRI-IO on Thor2). The `mi300x` and `thor2-400g` profiles
    /// differ in a few values, cited there; a test lists the differences.
    fn default() -> Self {
        Hardware {
            hbm_gb: 192.0,
            kv_memory_fraction: 0.0,
            hbm_tb_s: 5.3,
            fp8_tflops: 2600.0,
            fabric_gb_s: 448.0,
            nic_gb_s: 48.0,
            nic_latency_us: 5.0,
            control_latency_us: 100.0,
            listener_service_us: 50.0,
            bf16_tflops: 1300.0,
            gpus_per_node: 8,
            line_rate_gbit: 400.0,
            nic_message_rate_mpps: 7.1,
            nic_qps: 4,
            nic_qp_message_rate_mpps: 1.09,
        }
    }
}

/// Calibrated constants of the compute-time model (see `docs/sim.md`, "Calibration").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Fixed time of one prefill batch (scheduling, launch, the non-scaling part).
    pub prefill_fixed_ms: f64,
    /// Fraction of peak FP8 throughput prefill achieves.
    pub prefill_mfu: f64,
    /// Fixed time of every decode step, whatever its batch (scheduling, launches, sampling set-up).
    pub decode_fixed_ms: f64,
    /// Fraction of HBM bandwidth a decode step achieves streaming weights.
    pub decode_weight_efficiency: f64,
    /// Fraction of peak FP8 throughput decode's matrix multiplications achieve once a step is
    /// compute-bound.
    pub decode_mfu: f64,
    /// Fixed latency of one expert dispatch or combine (per MoE layer), on top of its bytes.
    pub alltoall_latency_us: f64,
    /// Fraction of HBM bandwidth attention achieves when reading KV in decode.
    pub decode_kv_efficiency: f64,
    /// Per-request per-step overhead in decode (sampling, scheduling).
    pub decode_per_request_us: f64,
    /// Fraction of fabric bandwidth collectives achieve.
    pub fabric_efficiency: f64,
    /// HBM per GPU that is neither weights nor KV cache: the activations' profiled peak, the
    /// graph pools and the communication buffers.
    #[serde(skip_serializing_if = "at_default::activation_reserve_gb")]
    pub activation_reserve_gb: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            // The six fitted constants are `cargo xtask calibrate --fit`'s output on the fitting
            // points F1-F3 (docs/calibration.md), to the four decimals it prints.
            prefill_fixed_ms: 212.8117,
            prefill_mfu: 0.1756,
            decode_fixed_ms: 15.8963,
            decode_weight_efficiency: 0.8539,
            decode_mfu: 0.3,
            alltoall_latency_us: 40.0,
            decode_kv_efficiency: 0.908,
            decode_per_request_us: 1.3781,
            fabric_efficiency: 0.7,
            activation_reserve_gb: 10.0,
        }
    }
}

/// Request lengths: fixed, or uniform between two bounds (inclusive).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Length {
    /// Always this many tokens.
    Fixed(u32),
    /// Uniform in `min..=max` tokens, drawn from the workload stream.
    Uniform {
        /// Smallest length.
        min: u32,
        /// Largest length.
        max: u32,
    },
}

/// How clients send requests.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Clients {
    /// `concurrency` clients, each sending its next request when the last one ends, until
    /// `requests` were sent (`vllm bench serve --max-concurrency C --num-prompts N`).
    Closed {
        /// Requests in flight at once.
        concurrency: u32,
        /// Requests in total.
        requests: u32,
    },
    /// Poisson arrivals at `rate_per_s` until `requests` were sent.
    Open {
        /// Mean arrivals per second.
        rate_per_s: f64,
        /// Requests in total.
        requests: u32,
    },
}

/// The clients and the lengths of their requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Workload {
    /// Closed or open loop.
    pub clients: Clients,
    /// Prompt length.
    pub input_tokens: Length,
    /// Generated tokens per request.
    pub output_tokens: Length,
}

impl Default for Workload {
    /// C = 128 closed loop, 10×C requests, 8K in / 1K out.
    fn default() -> Self {
        Workload {
            clients: Clients::Closed { concurrency: 128, requests: 1280 },
            input_tokens: Length::Fixed(8192),
            output_tokens: Length::Fixed(1024),
        }
    }
}

/// How the decode side reads KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reads {
    /// One read per layer (MoRIIO).
    PerLayer,
    /// One read per request.
    PerRequest,
}

/// Protocol knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Protocol {
    /// Legacy options switched on (kebab-case names, as `pdkv routes --legacy`).
    pub legacy: Vec<Legacy>,
    /// The rule set of each engine named (`{"P0": "vllm-0.33"}`), where vLLM's current release
    /// and pdkv's protocol differ; an engine not named follows `pdkv`. Read with
    /// [`Scenario::peer_book`].
    #[serde(
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "crate::unique_keys::deserialize"
    )]
    pub peers: BTreeMap<String, String>,
    /// Read granularity.
    pub reads: Reads,
    /// Deadline of a handshake dial.
    pub handshake_timeout_ms: u64,
    /// Deadline of a request's KV, from its arrival at the decode worker.
    pub transfer_timeout_ms: u64,
    /// Delay of the prefill deferred-free reaper.
    pub defer_timeout_ms: u64,
    /// Deadline of a TP or EP collective (NCCL's watchdog: 600 s).
    pub collective_timeout_ms: u64,
}

impl Protocol {
    /// The timeouts this section declares.
    pub fn timeouts(&self) -> ProtocolTimeouts {
        ProtocolTimeouts {
            handshake_ms: self.handshake_timeout_ms,
            transfer_ms: self.transfer_timeout_ms,
            defer_ms: self.defer_timeout_ms,
            collective_ms: self.collective_timeout_ms,
        }
    }
}

impl Default for Protocol {
    fn default() -> Self {
        let timeouts = ProtocolTimeouts::default();
        Protocol {
            legacy: Vec::new(),
            peers: BTreeMap::new(),
            reads: Reads::PerLayer,
            handshake_timeout_ms: timeouts.handshake_ms,
            transfer_timeout_ms: timeouts.transfer_ms,
            defer_timeout_ms: timeouts.defer_ms,
            collective_timeout_ms: timeouts.collective_ms,
        }
    }
}

/// Scheduler limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineLimits {
    /// Token budget of one prefill step (per DP rank), vLLM's `--max-num-batched-tokens`:
    /// chunked prefill spreads a longer prompt over several steps and packs short ones.
    pub prefill_max_batched_tokens: u32,
    /// Most requests one decode DP rank runs at once.
    pub decode_max_batch: u32,
    /// KV blocks per GPU; 0 derives them from HBM, the weights the GPU holds and
    /// `gpu_memory_utilization` (or `hardware.kv_memory_fraction` when that is set).
    pub kv_blocks_per_gpu: u32,
    /// Fraction of each GPU's HBM the engine may use (vLLM's `--gpu-memory-utilization`):
    /// weights, the activation reserve and the KV cache share it.
    #[serde(skip_serializing_if = "at_default::gpu_memory_utilization")]
    pub gpu_memory_utilization: f64,
    /// Delay between a prefill finishing and its workers learning the transfer (MoRIIO passes
    /// it with the next step's connector metadata). A release that arrives in this window is
    /// early: buffered by the fixed protocol, dropped under `drop-early-releases`.
    pub prefill_register_delay_ms: u64,
    /// How a decode DP rank's pool holds a request's KV: `Reserve` (prompt and whole answer at
    /// admission) or `OnDemand` (vLLM's: a block at a time, preempting the newest running
    /// request when the pool runs out; the preempted one recomputes its context to rejoin).
    #[serde(skip_serializing_if = "at_default::decode_kv_allocation")]
    pub decode_kv_allocation: KvAllocationMode,
    /// The serving stack the engines run (`sim/src/stack.rs`): what it does that the cost model
    /// depends on, such as overlapping the expert all-to-alls with compute.
    #[serde(skip_serializing_if = "at_default::stack")]
    pub stack: String,
}

/// How a decode DP rank's pool holds a request's KV (`EngineLimits::decode_kv_allocation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvAllocationMode {
    /// Blocks for the prompt and the whole answer at admission: no growth, no preemption.
    #[default]
    Reserve,
    /// vLLM's on-demand allocation with preemption (watermark 0, vLLM's default).
    OnDemand,
}

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            prefill_max_batched_tokens: 32_768,
            decode_max_batch: 512,
            kv_blocks_per_gpu: 0,
            gpu_memory_utilization: 0.92,
            prefill_register_delay_ms: 0,
            decode_kv_allocation: KvAllocationMode::Reserve,
            stack: crate::stack::DEFAULT.to_string(),
        }
    }
}

/// What a fault does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum FaultKind {
    /// Control messages between the target and any peer (either end matching) are lost.
    LoseMessages,
    /// Control messages between the target and any peer are delayed by this much.
    DelayMessages {
        /// Extra delay.
        delay_ms: u64,
    },
    /// Control messages between the target and any peer arrive twice.
    DuplicateMessages,
    /// The target's handshake listener answers nothing.
    DeadListener,
    /// The target's handshake listener takes this long per request.
    SlowListener {
        /// Service time per request.
        service_ms: u64,
    },
    /// The target's NIC runs at this fraction of its bandwidth.
    SlowNic {
        /// Bandwidth factor (0 < factor ≤ 1).
        factor: f64,
    },
    /// The target's NIC fails every read.
    NicDown,
    /// Reads posted by the target (a decode rank) get send-queue-full.
    SendQueueFull,
    /// Every engine with a rank the target matches crashes: its listeners and NICs go down,
    /// its memory (held blocks, queued and running requests) is lost. After `duration_ms` it
    /// restarts empty, with its memory registered anew (old memory keys no longer work).
    EngineCrash,
}

impl std::fmt::Display for FaultKind {
    /// The fault as a scenario file writes it, e.g. `DelayMessages(delay_ms: 20)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultKind::LoseMessages => f.write_str("LoseMessages"),
            FaultKind::DelayMessages { delay_ms } => write!(f, "DelayMessages(delay_ms: {delay_ms})"),
            FaultKind::DuplicateMessages => f.write_str("DuplicateMessages"),
            FaultKind::DeadListener => f.write_str("DeadListener"),
            FaultKind::SlowListener { service_ms } => write!(f, "SlowListener(service_ms: {service_ms})"),
            FaultKind::SlowNic { factor } => write!(f, "SlowNic(factor: {factor})"),
            FaultKind::NicDown => f.write_str("NicDown"),
            FaultKind::SendQueueFull => f.write_str("SendQueueFull"),
            FaultKind::EngineCrash => f.write_str("EngineCrash"),
        }
    }
}

/// A rank a fault applies to, named as `P0.dp0.tp3` or `D0.dp2.tp0`; `*` matches any part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Target(pub String);

/// One entry of the fault timeline: at `at_ms`, on `target`, do `fault` for `duration_ms`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimedFault {
    /// Start, in virtual milliseconds.
    pub at_ms: u64,
    /// The ranks affected.
    pub target: Target,
    /// What happens.
    pub fault: FaultKind,
    /// How long; absent means until the end of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// At most this many messages are affected (message faults only); absent means all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// Randomised faults drawn from the seed (swarm testing).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Swarm {
    /// Probability that a control message is lost.
    pub loss: f64,
    /// Probability that a control message is duplicated.
    pub duplicate: f64,
    /// Probability that a control message is delayed, and by how much at most.
    pub delay: f64,
    /// Largest extra delay.
    pub max_delay_ms: u64,
    /// Probability that a posted read gets send-queue-full.
    pub send_queue_full: f64,
}

/// All faults of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Faults at given times.
    pub timeline: Vec<TimedFault>,
    /// Faults drawn at random.
    pub swarm: Swarm,
    /// A transfer timeout imposed as a fault, in force instead of
    /// `protocol.transfer_timeout_ms` (the search's storm draws 1, 5 or 50 ms): a request whose
    /// KV it fails to receive in time failed because of it, so the failure is excused. The same
    /// timeout written in `protocol` is the deployment's own, and such failures are not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_timeout_ms: Option<u64>,
}

/// Budgets that end a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Virtual time after which the run stops and whatever is unfinished is reported.
    pub max_virtual_time_s: u64,
    /// Events after which the run stops (a guard against runaway models).
    pub max_events: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_virtual_time_s: 7200, max_events: 200_000_000 }
    }
}

/// How the run's steady-state figures are taken: by default without the warm-up at the start
/// and the drain at the end (`docs/sim.md`, "Steady state"; `crate::measure` computes it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Measure {
    /// Requests, in arrival order, left out at the start as warm-up, instead of the default
    /// (closed loop: the larger of C and a tenth of the requests; open loop: a tenth).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_requests: Option<u32>,
    /// Take the figures over the whole run: no warm-up, no drain.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub whole_run: bool,
}

impl Measure {
    /// True when nothing overrides the default window.
    pub fn is_default(&self) -> bool {
        *self == Measure::default()
    }
}

/// Service-level objectives: the latencies a finished request must meet to count towards
/// goodput (`vllm bench serve --goodput ttft:MS tpot:MS`). Either may be left out; at least one
/// is given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slo {
    /// Longest time to first token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Longest time per output token after the first (a request of one output token has none,
    /// and meets it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// True when a request with this TTFT and TPOT (`None`: one output token) meets every target.
    pub fn met(&self, ttft_ms: f64, tpot_ms: Option<f64>) -> bool {
        self.ttft_ms.is_none_or(|target| ttft_ms <= target)
            && self.tpot_ms.is_none_or(|target| tpot_ms.is_none_or(|tpot| tpot <= target))
    }
}

impl std::fmt::Display for Slo {
    /// The targets as a person reads them: `TTFT <= 2000 ms, TPOT <= 50 ms`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)]
            .into_iter()
            .filter_map(|(what, target)| target.map(|ms| format!("{what} <= {ms} ms")))
            .collect();
        f.write_str(&parts.join(", "))
    }
}

impl Scenario {
    /// The transfer timeout in force: the one the faults impose
    /// ([`Faults::transfer_timeout_ms`]), else the protocol's.
    pub fn transfer_timeout_ms(&self) -> u64 {
        self.faults.transfer_timeout_ms.unwrap_or(self.protocol.transfer_timeout_ms)
    }

    /// The protocol's timeouts in force: `protocol`'s, with the transfer timeout a fault injects.
    pub fn timeouts(&self) -> ProtocolTimeouts {
        ProtocolTimeouts { transfer_ms: self.transfer_timeout_ms(), ..self.protocol.timeouts() }
    }

    /// The core's view of the model: what routing, the head guard and block sizes need.
    pub fn model_spec(&self) -> pdkv_core::ModelSpec {
        pdkv_core::ModelSpec {
            use_mla: self.model.use_mla,
            kv_heads: self.model.kv_heads,
            layers: self.model.layers,
            bytes_per_token_per_layer: self.model.kv_bytes_per_token_per_layer,
            block_size_tokens: self.model.block_size_tokens,
        }
    }

    /// The rules of every engine of `deployment` (the scenario's, parsed), from
    /// `protocol.peers`: each key an engine of the deployment (`P0`, `D1`), each value a rule
    /// set name (`pdkv`, `vllm-0.33`). The first bad entry, in key order, is the error.
    pub fn peer_book(&self, deployment: &Deployment) -> Result<PeerBook, PeerError> {
        let mut book = PeerBook::pdkv();
        for (name, rules) in &self.protocol.peers {
            let engine: EngineId = name.parse().map_err(|_| PeerError::NotAnEngine { name: name.clone() })?;
            let engines = deployment.engines(engine.role).len();
            if usize::from(engine.index) >= engines {
                return Err(PeerError::NoSuchEngine { engine, engines, notation: deployment.notation() });
            }
            let rules: PeerRules =
                rules.parse().map_err(|error| PeerError::UnknownRules { engine, error })?;
            book.set(engine, rules);
        }
        if let Some((first, second)) = book.mixed_dialects() {
            return Err(PeerError::MixedDialects { first, second });
        }
        Ok(book)
    }

    /// A scenario for a bare notation with the default profile and workload, named by the
    /// notation itself (`2P_TP8:1D_DP8EP`). A built-in scenario file's name is its file name,
    /// which writes the `:` as `-` (`2P_TP8-1D_DP8EP`) and is not a notation, so a notation's run
    /// and a built-in's never record the same `scenario` (a test checks every built-in). Folder
    /// names come from [`crate::RunIdentity::slug`], which writes the `:` as `-`.
    pub fn from_notation(notation: &str) -> Scenario {
        Scenario {
            name: notation.to_string(),
            description: format!("{notation} with the default profile and workload"),
            deployment: notation.to_string(),
            profiles: Profiles::default(),
            model: ModelProfile::default(),
            hardware: Hardware::default(),
            cost: CostModel::default(),
            workload: Workload::default(),
            protocol: Protocol::default(),
            engines: EngineLimits::default(),
            faults: Faults::default(),
            seed: 0,
            limits: Limits::default(),
            measure: Measure::default(),
            slo: None,
            expect: None,
            expect_jain: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (notation) -> the name of its scenario: the notation as typed, which parses as one, so no
    /// file name (which has no `:`) can equal it.
    #[test]
    fn a_notation_names_its_scenario() {
        let check = |notation: &str, expected: &str| {
            let scenario = Scenario::from_notation(notation);
            assert_eq!(scenario.name, expected);
            assert!(Deployment::parse(&scenario.name).is_ok(), "{notation}");
            assert_eq!(crate::load::validate(&scenario), Ok(()), "{notation}");
        };
        check("2P_TP8:1D_DP8EP", "2P_TP8:1D_DP8EP");
        check("1P_TP8:1D_TP8", "1P_TP8:1D_TP8");
        check("1P_TP8+1P_DP8EP:1D_TP8", "1P_TP8+1P_DP8EP:1D_TP8");
        check("64P_TP8:8D_DP64EP", "64P_TP8:8D_DP64EP");
    }

    /// (profiles) -> how a summary, a report page and `pdkv scenarios` show them.
    #[test]
    fn profiles_read_as_words() {
        let check = |gpu: Option<&str>, model: Option<&str>, overrides: &[&str], expected: &str| {
            let profiles = Profiles {
                gpu: gpu.map(str::to_string),
                nic: None,
                model: model.map(str::to_string),
                overrides: overrides.iter().map(|path| path.to_string()).collect(),
            };
            assert_eq!(profiles.to_string(), expected);
        };
        check(None, None, &[], "none");
        check(Some("h200-sxm"), Some("deepseek-r1"), &[], "gpu h200-sxm, model deepseek-r1");
        check(Some("mi300x"), None, &["hardware.fp8_tflops"], "gpu mi300x; overridden: hardware.fp8_tflops");
        check(
            Some("mi300x"),
            Some("deepseek-r1"),
            &["hardware.fp8_tflops", "model.layers"],
            "gpu mi300x, model deepseek-r1; overridden: hardware.fp8_tflops, model.layers",
        );
    }

    #[test]
    fn jain_bounds_read_as_words() {
        let check = |at_least: Option<f64>, at_most: Option<f64>, expected: &str| {
            assert_eq!(JainBounds { at_least, at_most }.to_string(), expected);
        };
        check(Some(0.99), None, "at least 0.99");
        check(None, Some(0.5), "at most 0.5");
        check(Some(0.2), Some(0.8), "in [0.2, 0.8]");
        check(None, None, "unbounded");
    }

    /// (targets, TTFT, TPOT) -> met, and how the targets read.
    #[test]
    fn slos_are_met_at_or_below_their_targets() {
        let both = Slo { ttft_ms: Some(2000.0), tpot_ms: Some(50.0) };
        let ttft = Slo { ttft_ms: Some(2000.0), tpot_ms: None };
        let tpot = Slo { ttft_ms: None, tpot_ms: Some(50.0) };
        let table: &[(Slo, f64, Option<f64>, bool)] = &[
            (both, 2000.0, Some(50.0), true),
            (both, 2000.001, Some(50.0), false),
            (both, 10.0, Some(50.001), false),
            // One output token: no TPOT, so nothing to miss.
            (both, 10.0, None, true),
            (ttft, 10.0, Some(1e9), true),
            (tpot, 1e9, Some(49.0), true),
            (Slo::default(), 1e9, Some(1e9), true),
        ];
        for &(slo, ttft_ms, tpot_ms, met) in table {
            assert_eq!(slo.met(ttft_ms, tpot_ms), met, "{slo:?} {ttft_ms} {tpot_ms:?}");
        }
        assert_eq!(both.to_string(), "TTFT <= 2000 ms, TPOT <= 50 ms");
        assert_eq!(tpot.to_string(), "TPOT <= 50 ms");
    }
}
