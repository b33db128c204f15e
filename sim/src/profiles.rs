//! Named GPU, NIC and model profiles: `profiles/gpus.ron`, `profiles/nics.ron` and
//! `profiles/models.ron`, embedded in the binary (so it needs no file at run time), parsed into
//! typed profiles, checked, looked up by name, and applied to a scenario that names them
//! (`profiles: (gpu: "h200-sxm", nic: "cx7-400g", model: "deepseek-r1")`).
//!
//! Every value of every profile cites its public source in the profile's `sources` map, keyed by
//! field name: `URL — quote or paraphrase`, `UNVERIFIED: why`, or `modelling choice: why`.
//! Loading fails when a value has no source, when a source names no field, or when a citation has
//! none of these forms, so a number without a source cannot enter a run. `docs/sim.md`
//! ("Profiles") documents the fields.
//!
//! A scenario that names a profile takes every value the profile has from it. A field the
//! profile fills may still be written in the scenario, but only with the profile's own value
//! (the scenario a result prints, which `pdkv replay` reads back, repeats them); any other value
//! is an error naming the field and the profile, so a profile is never mixed silently with
//! hand-set numbers, and replaying a result after a profile changed says which value moved.
//! A field the scenario means to set itself ("MI300X with FP8 off") is listed in
//! `profiles.overrides` by its dotted path (`hardware.fp8_tflops`) and written: it keeps the
//! written value, and the list, carried into the printed scenario and the result, says which
//! values are not the profile's. Listing a field that is not written, that no named profile
//! fills, or twice, is an error.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::scenario::{ModelProfile, Profiles, Scenario, RATE_RANGE};

/// Which file a profile lives in, and which part of a scenario it fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProfileKind {
    /// `profiles/gpus.ron`, filling part of `hardware`.
    Gpu,
    /// `profiles/nics.ron`, filling part of `hardware`.
    Nic,
    /// `profiles/models.ron`, filling all of `model`.
    Model,
}

impl ProfileKind {
    /// Every kind, in the order `pdkv profiles` lists them.
    pub const ALL: [ProfileKind; 3] = [ProfileKind::Gpu, ProfileKind::Nic, ProfileKind::Model];

    /// The file, relative to the repository root.
    pub fn file(self) -> &'static str {
        match self {
            ProfileKind::Gpu => "profiles/gpus.ron",
            ProfileKind::Nic => "profiles/nics.ron",
            ProfileKind::Model => "profiles/models.ron",
        }
    }

    /// The file's text as built into the binary.
    fn text(self) -> &'static str {
        match self {
            ProfileKind::Gpu => include_str!("../../profiles/gpus.ron"),
            ProfileKind::Nic => include_str!("../../profiles/nics.ron"),
            ProfileKind::Model => include_str!("../../profiles/models.ron"),
        }
    }

    /// The word for a profile of this kind in messages: `GPU`, `NIC`, `model`.
    pub fn noun(self) -> &'static str {
        match self {
            ProfileKind::Gpu => "GPU",
            ProfileKind::Nic => "NIC",
            ProfileKind::Model => "model",
        }
    }

    /// The key a scenario names a profile of this kind with: `profiles.gpu`, `.nic`, `.model`.
    pub fn key(self) -> &'static str {
        match self {
            ProfileKind::Gpu => "gpu",
            ProfileKind::Nic => "nic",
            ProfileKind::Model => "model",
        }
    }

    /// The part of a scenario a profile of this kind fills: `hardware` or `model`.
    pub fn section(self) -> &'static str {
        match self {
            ProfileKind::Gpu | ProfileKind::Nic => "hardware",
            ProfileKind::Model => "model",
        }
    }

    /// The fields of [`ProfileKind::section`] a profile of this kind fills ([`Profile::FIELDS`]).
    pub fn fields(self) -> &'static [&'static str] {
        match self {
            ProfileKind::Gpu => Gpu::FIELDS,
            ProfileKind::Nic => Nic::FIELDS,
            ProfileKind::Model => Model::FIELDS,
        }
    }

    /// The kind of profile that fills the scenario field at dotted `path` (`hardware.hbm_gb`
    /// is a GPU's), if any does.
    pub fn filling(path: &str) -> Option<ProfileKind> {
        let (section, field) = path.split_once('.')?;
        ProfileKind::ALL.into_iter().find(|kind| kind.section() == section && kind.fields().contains(&field))
    }

    /// The profile of this kind `profiles` names, if any.
    fn named(self, profiles: &Profiles) -> Option<&String> {
        match self {
            ProfileKind::Gpu => profiles.gpu.as_ref(),
            ProfileKind::Nic => profiles.nic.as_ref(),
            ProfileKind::Model => profiles.model.as_ref(),
        }
    }
}

impl fmt::Display for ProfileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.noun())
    }
}

/// Why a profile file could not be used, or a scenario's profiles could not be applied.
#[derive(Clone, Debug, PartialEq)]
pub enum ProfileError {
    /// The file is not well-formed RON, or not a list of profiles of its kind (an unknown or
    /// missing field, a value of the wrong type).
    Parse {
        /// The file.
        kind: ProfileKind,
        /// Line and column where ron stopped, from 1.
        line: usize,
        /// Column, from 1.
        column: usize,
        /// ron's reason.
        message: String,
    },
    /// A profile's name is not a lowercase id.
    BadName {
        /// The file.
        kind: ProfileKind,
        /// The name as written.
        name: String,
    },
    /// Two profiles of one file share a name.
    DuplicateName {
        /// The file.
        kind: ProfileKind,
        /// The name.
        name: String,
    },
    /// A value breaks a rule of its kind (positive, at most another, consistent with others).
    Invalid {
        /// The file.
        kind: ProfileKind,
        /// The profile.
        profile: String,
        /// The field.
        field: String,
        /// The rule and the value found.
        message: String,
    },
    /// A value has no entry in the profile's `sources`.
    MissingSource {
        /// The file.
        kind: ProfileKind,
        /// The profile.
        profile: String,
        /// The field without a source.
        field: String,
    },
    /// An entry of `sources` names no field of the profile.
    UnknownSourceField {
        /// The file.
        kind: ProfileKind,
        /// The profile.
        profile: String,
        /// The key written.
        field: String,
        /// The profile's fields.
        fields: Vec<String>,
    },
    /// A citation is neither `URL — quote`, `UNVERIFIED: why` nor `modelling choice: why`.
    BadCitation {
        /// The file.
        kind: ProfileKind,
        /// The profile.
        profile: String,
        /// The field cited.
        field: String,
        /// The citation as written.
        citation: String,
    },
    /// A scenario names a profile its file does not have.
    UnknownName {
        /// The file looked in.
        kind: ProfileKind,
        /// The name asked for.
        name: String,
        /// The names the file has, sorted.
        known: Vec<String>,
    },
    /// A scenario names a profile and writes one of the fields it fills with another value,
    /// without listing it in `profiles.overrides`.
    Conflict {
        /// The profile's file.
        kind: ProfileKind,
        /// The profile.
        profile: String,
        /// The scenario's field, e.g. `hardware.hbm_gb`.
        field: String,
        /// The value the scenario writes.
        written: String,
        /// The profile's value.
        value: String,
    },
    /// `profiles.overrides` lists a path no named profile fills: one no profile fills at all
    /// (`kind` is `None`), or one only a kind of profile the scenario does not name fills.
    OverrideUnfilled {
        /// The path as listed.
        path: String,
        /// The kind of profile that would fill it.
        kind: Option<ProfileKind>,
    },
    /// `profiles.overrides` lists a field the scenario does not write, so there is no value of
    /// its own to keep.
    OverrideNotWritten {
        /// The path as listed.
        path: String,
    },
    /// `profiles.overrides` lists a path twice.
    OverrideTwice {
        /// The path as listed.
        path: String,
    },
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProfileError::Parse { kind, line, column, message } => {
                write!(f, "{}:{line}:{column}: {message}", kind.file())
            }
            ProfileError::BadName { kind, name } => write!(
                f,
                "{}: profile name `{}` is not a lowercase id (letters a-z, digits, `-` and `.`, starting \
                 with a letter or digit)",
                kind.file(),
                name.escape_debug()
            ),
            ProfileError::DuplicateName { kind, name } => {
                write!(f, "{}: two profiles are named `{name}`", kind.file())
            }
            ProfileError::Invalid { kind, profile, field, message } => {
                write!(f, "{}, profile `{profile}`, field `{field}`: {message}", kind.file())
            }
            ProfileError::MissingSource { kind, profile, field } => write!(
                f,
                "{}, profile `{profile}`: field `{field}` has no entry in `sources`; every value needs \
                 its public source, `UNVERIFIED: why` or `modelling choice: why`",
                kind.file()
            ),
            ProfileError::UnknownSourceField { kind, profile, field, fields } => write!(
                f,
                "{}, profile `{profile}`: `sources` names `{field}`, which is not a field; the fields are: {}",
                kind.file(),
                fields.join(", ")
            ),
            ProfileError::BadCitation { kind, profile, field, citation } => write!(
                f,
                "{}, profile `{profile}`: the source of `{field}` is neither `URL — quote`, `UNVERIFIED: \
                 why` nor `modelling choice: why`: {citation:?}",
                kind.file()
            ),
            ProfileError::UnknownName { kind, name, known } => write!(
                f,
                "unknown {kind} profile `{}`; {} has: {}",
                name.escape_debug(),
                kind.file(),
                known.join(", ")
            ),
            ProfileError::Conflict { kind, profile, field, written, value } => write!(
                f,
                "is {written} but the {kind} profile `{profile}` ({}) says {value}; a scenario that names \
                 a profile takes the profile's values: remove `{field}` or the profile, or keep this value \
                 by listing the field in `profiles`: `overrides: [\"{field}\"]`",
                kind.file()
            ),
            ProfileError::OverrideUnfilled { path, kind: None } => write!(
                f,
                "`profiles.overrides` lists `{}`, which no profile fills; a GPU or NIC profile fills \
                 fields of `hardware`, a model profile fields of `model` (`pdkv profiles` shows them)",
                path.escape_debug()
            ),
            ProfileError::OverrideUnfilled { path, kind: Some(kind) } => write!(
                f,
                "`profiles.overrides` lists `{path}`, which a {kind} profile fills, but the scenario names \
                 none (`profiles.{}`)",
                kind.key()
            ),
            ProfileError::OverrideNotWritten { path } => write!(
                f,
                "`profiles.overrides` lists `{path}`, which the scenario does not write; write the value \
                 it should have instead of the profile's, or take it off the list"
            ),
            ProfileError::OverrideTwice { path } => {
                write!(f, "`profiles.overrides` lists `{}` twice", path.escape_debug())
            }
        }
    }
}

impl std::error::Error for ProfileError {}

/// Why a scenario's profiles could not be applied ([`resolve`]): the scenario field to point
/// at, and the error (boxed: scenario errors are returned by value and should stay small).
#[derive(Clone, Debug, PartialEq)]
pub struct ResolveError {
    /// Dotted path: `profiles.gpu` (or `.nic`, `.model`) for a name the file lacks or a file
    /// that does not load, the written field (e.g. `hardware.hbm_gb`) for a conflict, the entry
    /// (e.g. `profiles.overrides[1]`) for a bad override.
    pub field: String,
    /// What is wrong.
    pub error: Box<ProfileError>,
}

impl ResolveError {
    fn new(field: String, error: ProfileError) -> ResolveError {
        ResolveError { field, error: Box::new(error) }
    }
}

/// What the three kinds of profile have in common.
pub trait Profile: Serialize + DeserializeOwned {
    /// The file of this kind.
    const KIND: ProfileKind;
    /// The value fields (every field but `name` and `sources`), in file order; each is also a
    /// field of the scenario section the profile fills.
    const FIELDS: &'static [&'static str];
    /// The profile's name.
    fn name(&self) -> &str;
    /// Its citations, by field.
    fn sources(&self) -> &BTreeMap<String, String>;
    /// The rules of the values beyond their types; the first one broken, as (field, why).
    fn check(&self) -> Result<(), (&'static str, String)>;
    /// Writes the profile's values into the scenario, except the fields `keep` names (by field
    /// name, e.g. `fp8_tflops`), which keep the scenario's own values.
    fn apply(&self, scenario: &mut Scenario, keep: &dyn Fn(&str) -> bool);
    /// The values `scenario` holds now, as a profile of this kind (named `name`, without
    /// sources): what a written field is compared with. (A scenario section's own serialization
    /// would not do: it leaves out fields at their defaults.)
    fn of_scenario(name: &str, scenario: &Scenario) -> Self;
}

/// A GPU: memory, compute and the intra-node fabric, per GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Lowercase id, e.g. `mi300x`.
    pub name: String,
    /// HBM capacity, GB.
    pub hbm_gb: f64,
    /// Peak HBM bandwidth, TB/s.
    pub hbm_tb_s: f64,
    /// Peak dense FP8 throughput, TFLOP/s.
    pub fp8_tflops: f64,
    /// Peak dense BF16 throughput, TFLOP/s.
    pub bf16_tflops: f64,
    /// Intra-node GPU-to-GPU bandwidth of one GPU per direction, GB/s.
    pub fabric_gb_s: f64,
    /// GPUs per node.
    pub gpus_per_node: u16,
    /// Citation of each value, by field.
    #[serde(deserialize_with = "crate::unique_keys::deserialize")]
    pub sources: BTreeMap<String, String>,
}

/// An RDMA NIC, one per GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nic {
    /// Lowercase id, e.g. `cx7-400g`.
    pub name: String,
    /// Achievable large-message RDMA bandwidth, GB/s.
    pub nic_gb_s: f64,
    /// Line rate, Gbit/s.
    pub line_rate_gbit: f64,
    /// Latency of one small message, µs.
    pub nic_latency_us: f64,
    /// Small-message ceiling, millions of messages per second.
    pub nic_message_rate_mpps: f64,
    /// Queue pairs one transfer uses.
    pub nic_qps: u16,
    /// Messages one queue pair carries, millions per second.
    pub nic_qp_message_rate_mpps: f64,
    /// Citation of each value, by field.
    #[serde(deserialize_with = "crate::unique_keys::deserialize")]
    pub sources: BTreeMap<String, String>,
}

/// A served model: every field of the scenario's `model`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// Lowercase id, e.g. `deepseek-r1`.
    pub name: String,
    /// Multi-head latent attention.
    pub use_mla: bool,
    /// KV heads (1 under MLA).
    pub kv_heads: u16,
    /// Values of one cached KV head per token.
    pub head_dim: u32,
    /// Transformer layers.
    pub layers: u16,
    /// Layers with routed experts.
    pub moe_layers: u16,
    /// Hidden size.
    pub hidden_size: u32,
    /// KV bytes of one token in one layer, whole model.
    pub kv_bytes_per_token_per_layer: u32,
    /// Tokens per KV block.
    pub block_size_tokens: u32,
    /// Parameters, billions.
    pub total_params_b: f64,
    /// Parameters active per token, billions.
    pub active_params_b: f64,
    /// Routed experts per MoE layer.
    pub routed_experts: u16,
    /// Routed experts per token.
    pub experts_per_token: u16,
    /// Experts every token goes to.
    pub shared_experts: u16,
    /// Parameters of one routed expert in one layer, millions.
    pub expert_params_per_layer_m: f64,
    /// Bytes per weight of the checkpoint.
    pub weight_bytes_per_param: f64,
    /// Query heads.
    pub attention_heads: u16,
    /// Values of one query (and key) head in prefill's attention.
    pub qk_head_dim: u32,
    /// Values of one value head in prefill's attention.
    pub v_head_dim: u32,
    /// Citation of each value, by field.
    #[serde(deserialize_with = "crate::unique_keys::deserialize")]
    pub sources: BTreeMap<String, String>,
}

/// Writes a profile's `value` of `field` into the scenario's `slot`, unless `keep` names the
/// field (the scenario overrides it).
fn put<T>(slot: &mut T, field: &str, value: T, keep: &dyn Fn(&str) -> bool) {
    if !keep(field) {
        *slot = value;
    }
}

/// A rate, size or count given as a float: positive, finite and within the scenario format's
/// [`RATE_RANGE`], so whatever a profile fills, the scenario's own checks accept.
fn positive(field: &'static str, value: f64) -> Result<(), (&'static str, String)> {
    let (lo, hi) = RATE_RANGE;
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err((field, format!("must be a finite number between {lo:e} and {hi:e}, got {value}")))
    }
}

fn at_least_one(field: &'static str, value: u64) -> Result<(), (&'static str, String)> {
    if value >= 1 {
        Ok(())
    } else {
        Err((field, "must be at least 1, got 0".to_string()))
    }
}

impl Profile for Gpu {
    const KIND: ProfileKind = ProfileKind::Gpu;
    const FIELDS: &'static [&'static str] =
        &["hbm_gb", "hbm_tb_s", "fp8_tflops", "bf16_tflops", "fabric_gb_s", "gpus_per_node"];

    fn name(&self) -> &str {
        &self.name
    }

    fn sources(&self) -> &BTreeMap<String, String> {
        &self.sources
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        positive("hbm_gb", self.hbm_gb)?;
        positive("hbm_tb_s", self.hbm_tb_s)?;
        positive("fp8_tflops", self.fp8_tflops)?;
        positive("bf16_tflops", self.bf16_tflops)?;
        positive("fabric_gb_s", self.fabric_gb_s)?;
        at_least_one("gpus_per_node", self.gpus_per_node.into())?;
        // Dense FP8 is twice dense BF16 on every GPU here; FP8 below BF16 means one of them is
        // the sparse figure vendors print, or the two are swapped.
        if self.fp8_tflops < self.bf16_tflops {
            return Err((
                "fp8_tflops",
                format!("must be at least bf16_tflops ({}), got {}", self.bf16_tflops, self.fp8_tflops),
            ));
        }
        Ok(())
    }

    fn apply(&self, scenario: &mut Scenario, keep: &dyn Fn(&str) -> bool) {
        let hw = &mut scenario.hardware;
        put(&mut hw.hbm_gb, "hbm_gb", self.hbm_gb, keep);
        put(&mut hw.hbm_tb_s, "hbm_tb_s", self.hbm_tb_s, keep);
        put(&mut hw.fp8_tflops, "fp8_tflops", self.fp8_tflops, keep);
        put(&mut hw.bf16_tflops, "bf16_tflops", self.bf16_tflops, keep);
        put(&mut hw.fabric_gb_s, "fabric_gb_s", self.fabric_gb_s, keep);
        put(&mut hw.gpus_per_node, "gpus_per_node", self.gpus_per_node, keep);
    }

    fn of_scenario(name: &str, scenario: &Scenario) -> Self {
        let hw = &scenario.hardware;
        Gpu {
            name: name.to_string(),
            hbm_gb: hw.hbm_gb,
            hbm_tb_s: hw.hbm_tb_s,
            fp8_tflops: hw.fp8_tflops,
            bf16_tflops: hw.bf16_tflops,
            fabric_gb_s: hw.fabric_gb_s,
            gpus_per_node: hw.gpus_per_node,
            sources: BTreeMap::new(),
        }
    }
}

impl Profile for Nic {
    const KIND: ProfileKind = ProfileKind::Nic;
    const FIELDS: &'static [&'static str] = &[
        "nic_gb_s",
        "line_rate_gbit",
        "nic_latency_us",
        "nic_message_rate_mpps",
        "nic_qps",
        "nic_qp_message_rate_mpps",
    ];

    fn name(&self) -> &str {
        &self.name
    }

    fn sources(&self) -> &BTreeMap<String, String> {
        &self.sources
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        positive("nic_gb_s", self.nic_gb_s)?;
        positive("line_rate_gbit", self.line_rate_gbit)?;
        positive("nic_latency_us", self.nic_latency_us)?;
        positive("nic_message_rate_mpps", self.nic_message_rate_mpps)?;
        at_least_one("nic_qps", self.nic_qps.into())?;
        positive("nic_qp_message_rate_mpps", self.nic_qp_message_rate_mpps)?;
        // What a NIC achieves stays below its line rate; above it, a unit is wrong (Gbit for GB).
        if self.nic_gb_s * 8.0 > self.line_rate_gbit {
            return Err((
                "nic_gb_s",
                format!(
                    "must be at most line_rate_gbit / 8 ({} GB/s), got {}",
                    self.line_rate_gbit / 8.0,
                    self.nic_gb_s
                ),
            ));
        }
        Ok(())
    }

    fn apply(&self, scenario: &mut Scenario, keep: &dyn Fn(&str) -> bool) {
        let hw = &mut scenario.hardware;
        put(&mut hw.nic_gb_s, "nic_gb_s", self.nic_gb_s, keep);
        put(&mut hw.line_rate_gbit, "line_rate_gbit", self.line_rate_gbit, keep);
        put(&mut hw.nic_latency_us, "nic_latency_us", self.nic_latency_us, keep);
        put(&mut hw.nic_message_rate_mpps, "nic_message_rate_mpps", self.nic_message_rate_mpps, keep);
        put(&mut hw.nic_qps, "nic_qps", self.nic_qps, keep);
        put(
            &mut hw.nic_qp_message_rate_mpps,
            "nic_qp_message_rate_mpps",
            self.nic_qp_message_rate_mpps,
            keep,
        );
    }

    fn of_scenario(name: &str, scenario: &Scenario) -> Self {
        let hw = &scenario.hardware;
        Nic {
            name: name.to_string(),
            nic_gb_s: hw.nic_gb_s,
            line_rate_gbit: hw.line_rate_gbit,
            nic_latency_us: hw.nic_latency_us,
            nic_message_rate_mpps: hw.nic_message_rate_mpps,
            nic_qps: hw.nic_qps,
            nic_qp_message_rate_mpps: hw.nic_qp_message_rate_mpps,
            sources: BTreeMap::new(),
        }
    }
}

impl Model {
    /// The model as a scenario's `model` holds it.
    pub fn to_model_profile(&self) -> ModelProfile {
        ModelProfile {
            use_mla: self.use_mla,
            kv_heads: self.kv_heads,
            layers: self.layers,
            moe_layers: self.moe_layers,
            kv_bytes_per_token_per_layer: self.kv_bytes_per_token_per_layer,
            block_size_tokens: self.block_size_tokens,
            active_params_b: self.active_params_b,
            hidden_size: self.hidden_size,
            head_dim: self.head_dim,
            total_params_b: self.total_params_b,
            routed_experts: self.routed_experts,
            experts_per_token: self.experts_per_token,
            shared_experts: self.shared_experts,
            expert_params_per_layer_m: self.expert_params_per_layer_m,
            weight_bytes_per_param: self.weight_bytes_per_param,
            attention_heads: self.attention_heads,
            qk_head_dim: self.qk_head_dim,
            v_head_dim: self.v_head_dim,
        }
    }

    /// The rules between the attention fields: MLA caches one latent, GQA shares query heads
    /// evenly among KV heads, and the KV bytes are the cached values at one or two bytes each.
    fn check_attention(&self) -> Result<(), (&'static str, String)> {
        at_least_one("kv_heads", self.kv_heads.into())?;
        at_least_one("head_dim", self.head_dim.into())?;
        at_least_one("attention_heads", self.attention_heads.into())?;
        at_least_one("qk_head_dim", self.qk_head_dim.into())?;
        at_least_one("v_head_dim", self.v_head_dim.into())?;
        if self.use_mla && self.kv_heads != 1 {
            return Err((
                "kv_heads",
                format!("must be 1 under MLA (one latent per token), got {}", self.kv_heads),
            ));
        }
        if !self.use_mla && !self.attention_heads.is_multiple_of(self.kv_heads) {
            return Err((
                "attention_heads",
                format!("must be a multiple of kv_heads ({}), got {}", self.kv_heads, self.attention_heads),
            ));
        }
        // MLA caches the latent once; GQA caches a key and a value per KV head.
        let per_value = u64::from(if self.use_mla { 1u8 } else { 2 })
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim);
        let bytes = u64::from(self.kv_bytes_per_token_per_layer);
        if bytes != per_value && bytes != 2 * per_value {
            let shape = if self.use_mla { "kv_heads x head_dim" } else { "2 x kv_heads x head_dim" };
            return Err((
                "kv_bytes_per_token_per_layer",
                format!(
                    "must be {shape} ({per_value}) values at 1 or 2 bytes each (an FP8 or BF16 KV cache): \
                     {per_value} or {}, got {bytes}",
                    2 * per_value
                ),
            ));
        }
        Ok(())
    }

    /// The rules between the expert fields: a model has routed experts exactly when it has MoE
    /// layers, and its experts fit in its parameters.
    fn check_experts(&self) -> Result<(), (&'static str, String)> {
        if (self.moe_layers == 0) != (self.routed_experts == 0) {
            return Err((
                "routed_experts",
                format!(
                    "must be 0 exactly when moe_layers is 0 (a dense model), got {} with moe_layers {}",
                    self.routed_experts, self.moe_layers
                ),
            ));
        }
        if self.routed_experts == 0 {
            let dense = [
                ("experts_per_token", f64::from(self.experts_per_token)),
                ("shared_experts", f64::from(self.shared_experts)),
                ("expert_params_per_layer_m", self.expert_params_per_layer_m),
            ];
            if let Some((field, value)) = dense.into_iter().find(|(_, value)| *value != 0.0) {
                return Err((field, format!("must be 0 for a dense model (routed_experts 0), got {value}")));
            }
            return Ok(());
        }
        at_least_one("experts_per_token", self.experts_per_token.into())?;
        if self.experts_per_token > self.routed_experts {
            return Err((
                "experts_per_token",
                format!(
                    "must be at most routed_experts ({}), got {}",
                    self.routed_experts, self.experts_per_token
                ),
            ));
        }
        positive("expert_params_per_layer_m", self.expert_params_per_layer_m)?;
        // Millions per expert times experts times layers, in billions: the routed experts are part
        // of the whole, and the ones a token visits are part of what is active.
        let layers = f64::from(self.moe_layers) / 1e3;
        let all = self.expert_params_per_layer_m * f64::from(self.routed_experts) * layers;
        if all > self.total_params_b {
            return Err((
                "expert_params_per_layer_m",
                format!(
                    "makes the routed experts {all:.1}B parameters, more than total_params_b ({})",
                    self.total_params_b
                ),
            ));
        }
        let visited = self.expert_params_per_layer_m * f64::from(self.experts_per_token) * layers;
        if visited > self.active_params_b {
            return Err((
                "expert_params_per_layer_m",
                format!(
                    "makes the experts a token visits {visited:.1}B parameters, more than active_params_b ({})",
                    self.active_params_b
                ),
            ));
        }
        Ok(())
    }
}

impl Profile for Model {
    const KIND: ProfileKind = ProfileKind::Model;
    const FIELDS: &'static [&'static str] = &[
        "use_mla",
        "kv_heads",
        "head_dim",
        "layers",
        "moe_layers",
        "hidden_size",
        "kv_bytes_per_token_per_layer",
        "block_size_tokens",
        "total_params_b",
        "active_params_b",
        "routed_experts",
        "experts_per_token",
        "shared_experts",
        "expert_params_per_layer_m",
        "weight_bytes_per_param",
        "attention_heads",
        "qk_head_dim",
        "v_head_dim",
    ];

    fn name(&self) -> &str {
        &self.name
    }

    fn sources(&self) -> &BTreeMap<String, String> {
        &self.sources
    }

    fn check(&self) -> Result<(), (&'static str, String)> {
        at_least_one("layers", self.layers.into())?;
        if self.moe_layers > self.layers {
            return Err((
                "moe_layers",
                format!("must be at most layers ({}), got {}", self.layers, self.moe_layers),
            ));
        }
        at_least_one("hidden_size", self.hidden_size.into())?;
        at_least_one("block_size_tokens", self.block_size_tokens.into())?;
        self.check_attention()?;
        positive("total_params_b", self.total_params_b)?;
        positive("active_params_b", self.active_params_b)?;
        if self.active_params_b > self.total_params_b {
            return Err((
                "active_params_b",
                format!(
                    "must be at most total_params_b ({}), got {}",
                    self.total_params_b, self.active_params_b
                ),
            ));
        }
        positive("weight_bytes_per_param", self.weight_bytes_per_param)?;
        self.check_experts()
    }

    fn apply(&self, scenario: &mut Scenario, keep: &dyn Fn(&str) -> bool) {
        let m = &mut scenario.model;
        put(&mut m.use_mla, "use_mla", self.use_mla, keep);
        put(&mut m.kv_heads, "kv_heads", self.kv_heads, keep);
        put(&mut m.head_dim, "head_dim", self.head_dim, keep);
        put(&mut m.layers, "layers", self.layers, keep);
        put(&mut m.moe_layers, "moe_layers", self.moe_layers, keep);
        put(&mut m.hidden_size, "hidden_size", self.hidden_size, keep);
        put(
            &mut m.kv_bytes_per_token_per_layer,
            "kv_bytes_per_token_per_layer",
            self.kv_bytes_per_token_per_layer,
            keep,
        );
        put(&mut m.block_size_tokens, "block_size_tokens", self.block_size_tokens, keep);
        put(&mut m.total_params_b, "total_params_b", self.total_params_b, keep);
        put(&mut m.active_params_b, "active_params_b", self.active_params_b, keep);
        put(&mut m.routed_experts, "routed_experts", self.routed_experts, keep);
        put(&mut m.experts_per_token, "experts_per_token", self.experts_per_token, keep);
        put(&mut m.shared_experts, "shared_experts", self.shared_experts, keep);
        put(
            &mut m.expert_params_per_layer_m,
            "expert_params_per_layer_m",
            self.expert_params_per_layer_m,
            keep,
        );
        put(&mut m.weight_bytes_per_param, "weight_bytes_per_param", self.weight_bytes_per_param, keep);
        put(&mut m.attention_heads, "attention_heads", self.attention_heads, keep);
        put(&mut m.qk_head_dim, "qk_head_dim", self.qk_head_dim, keep);
        put(&mut m.v_head_dim, "v_head_dim", self.v_head_dim, keep);
    }

    fn of_scenario(name: &str, scenario: &Scenario) -> Self {
        let m = &scenario.model;
        Model {
            name: name.to_string(),
            use_mla: m.use_mla,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            layers: m.layers,
            moe_layers: m.moe_layers,
            hidden_size: m.hidden_size,
            kv_bytes_per_token_per_layer: m.kv_bytes_per_token_per_layer,
            block_size_tokens: m.block_size_tokens,
            total_params_b: m.total_params_b,
            active_params_b: m.active_params_b,
            routed_experts: m.routed_experts,
            experts_per_token: m.experts_per_token,
            shared_experts: m.shared_experts,
            expert_params_per_layer_m: m.expert_params_per_layer_m,
            weight_bytes_per_param: m.weight_bytes_per_param,
            attention_heads: m.attention_heads,
            qk_head_dim: m.qk_head_dim,
            v_head_dim: m.v_head_dim,
            sources: BTreeMap::new(),
        }
    }
}

/// Whether `name` is a lowercase id: `a-z`, digits, `-` and `.`, starting with a letter or
/// digit (names are typed in scenarios and on the command line).
fn is_id(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// Whether `citation` has one of the three forms: `URL — quote` (a URL without spaces, an em
/// dash between spaces, then words), `UNVERIFIED: why` or `modelling choice: why`.
fn is_citation(citation: &str) -> bool {
    let after = |prefix: &str| citation.strip_prefix(prefix).is_some_and(|why| !why.trim().is_empty());
    if after("UNVERIFIED: ") || after("modelling choice: ") {
        return true;
    }
    match citation.split_once(" — ") {
        Some((url, quote)) => {
            (url.starts_with("https://") || url.starts_with("http://"))
                && !url.contains(char::is_whitespace)
                && !quote.trim().is_empty()
        }
        None => false,
    }
}

/// The value fields of `profile` as serde writes them (every field but `name` and `sources`),
/// sorted; the source check is against these, so a field added to a profile's type needs a
/// source in every profile before the file loads.
fn value_fields<P: Profile>(profile: &P) -> Vec<String> {
    match serde_json::to_value(profile) {
        Ok(serde_json::Value::Object(map)) => {
            map.keys().filter(|key| *key != "name" && *key != "sources").cloned().collect()
        }
        _ => Vec::new(),
    }
}

/// Every value has a source, every source a value, every citation a form.
fn check_sources<P: Profile>(profile: &P) -> Result<(), ProfileError> {
    let (kind, name) = (P::KIND, profile.name().to_string());
    let fields = value_fields(profile);
    let sources = profile.sources();
    if let Some(field) = fields.iter().find(|field| !sources.contains_key(*field)) {
        return Err(ProfileError::MissingSource { kind, profile: name, field: field.clone() });
    }
    if let Some(field) = sources.keys().find(|key| !fields.contains(key)) {
        return Err(ProfileError::UnknownSourceField { kind, profile: name, field: field.clone(), fields });
    }
    if let Some((field, citation)) = sources.iter().find(|(_, citation)| !is_citation(citation)) {
        return Err(ProfileError::BadCitation {
            kind,
            profile: name,
            field: field.clone(),
            citation: citation.clone(),
        });
    }
    Ok(())
}

/// Parses and checks `text` as the file of `P`'s kind.
fn parse<P: Profile>(text: &str) -> Result<Vec<P>, ProfileError> {
    let kind = P::KIND;
    let profiles: Vec<P> = ron::Options::default().from_str(text).map_err(|err| ProfileError::Parse {
        kind,
        line: err.span.start.line,
        column: err.span.start.col,
        message: err.code.to_string(),
    })?;
    let mut names = BTreeSet::new();
    for profile in &profiles {
        let name = profile.name().to_string();
        if !is_id(&name) {
            return Err(ProfileError::BadName { kind, name });
        }
        if !names.insert(name.clone()) {
            return Err(ProfileError::DuplicateName { kind, name });
        }
        profile.check().map_err(|(field, message)| ProfileError::Invalid {
            kind,
            profile: name,
            field: field.to_string(),
            message,
        })?;
        check_sources(profile)?;
    }
    Ok(profiles)
}

/// Every profile of `P`'s kind, in file order, checked.
pub fn all<P: Profile>() -> Result<Vec<P>, ProfileError> {
    parse(P::KIND.text())
}

/// The profile of `P`'s kind named `name`.
pub fn find<P: Profile>(name: &str) -> Result<P, ProfileError> {
    let profiles = all::<P>()?;
    let mut known: Vec<String> = profiles.iter().map(|profile| profile.name().to_string()).collect();
    known.sort();
    profiles.into_iter().find(|profile| profile.name() == name).ok_or_else(|| ProfileError::UnknownName {
        kind: P::KIND,
        name: name.to_string(),
        known,
    })
}

/// A scenario value as an error shows it.
fn shown(value: Option<&serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::Null) | None => "not a finite number".to_string(),
        Some(value) => value.to_string(),
    }
}

/// Whether `overrides` lists field `field` of the section `kind`'s profiles fill.
fn overridden(overrides: &[String], kind: ProfileKind, field: &str) -> bool {
    overrides.iter().any(|path| path.split_once('.') == Some((kind.section(), field)))
}

/// Applies the profile of `P`'s kind named `name` to `scenario`, after checking the fields the
/// scenario writes against it; the fields `profiles.overrides` lists keep the scenario's values.
fn apply_named<P: Profile>(
    scenario: &mut Scenario,
    name: &str,
    written: &dyn Fn(&str) -> bool,
) -> Result<(), ResolveError> {
    let kind = P::KIND;
    let profile =
        find::<P>(name).map_err(|error| ResolveError::new(format!("profiles.{}", kind.key()), error))?;
    let overrides = scenario.profiles.overrides.clone();
    let keep = |field: &str| overridden(&overrides, kind, field);
    let ours = serde_json::to_value(P::of_scenario(name, scenario)).unwrap_or_default();
    let theirs = serde_json::to_value(&profile).unwrap_or_default();
    for field in P::FIELDS.iter().filter(|field| !keep(field)) {
        let path = format!("{}.{field}", kind.section());
        if written(&path) && ours.get(field) != theirs.get(field) {
            let error = ProfileError::Conflict {
                kind,
                profile: name.to_string(),
                field: path.clone(),
                written: shown(ours.get(field)),
                value: shown(theirs.get(field)),
            };
            return Err(ResolveError::new(path, error));
        }
    }
    profile.apply(scenario, &keep);
    Ok(())
}

/// Checks `profiles.overrides`: each entry a field a named profile fills, written in the
/// scenario (`written`, as for [`resolve`]), listed once. The error names the entry.
fn check_overrides(profiles: &Profiles, written: &dyn Fn(&str) -> bool) -> Result<(), ResolveError> {
    for (index, path) in profiles.overrides.iter().enumerate() {
        let error = if profiles.overrides[..index].contains(path) {
            Some(ProfileError::OverrideTwice { path: path.clone() })
        } else {
            match ProfileKind::filling(path) {
                None => Some(ProfileError::OverrideUnfilled { path: path.clone(), kind: None }),
                Some(kind) if kind.named(profiles).is_none() => {
                    Some(ProfileError::OverrideUnfilled { path: path.clone(), kind: Some(kind) })
                }
                Some(_) if !written(path) => Some(ProfileError::OverrideNotWritten { path: path.clone() }),
                Some(_) => None,
            }
        };
        if let Some(error) = error {
            return Err(ResolveError::new(format!("profiles.overrides[{index}]"), error));
        }
    }
    Ok(())
}

/// Fills `scenario`'s hardware and model from the profiles it names (GPU, then NIC, then
/// model). `written` says whether the scenario's text writes a field, by dotted path such as
/// `hardware.hbm_gb`: such a field must already hold the profile's value, unless
/// `profiles.overrides` lists it, when it keeps its own. The error names the scenario field to
/// point at.
pub fn resolve(scenario: &mut Scenario, written: &dyn Fn(&str) -> bool) -> Result<(), ResolveError> {
    let names = scenario.profiles.clone();
    check_overrides(&names, written)?;
    if let Some(name) = &names.gpu {
        apply_named::<Gpu>(scenario, name, written)?;
    }
    if let Some(name) = &names.nic {
        apply_named::<Nic>(scenario, name, written)?;
    }
    if let Some(name) = &names.model {
        apply_named::<Model>(scenario, name, written)?;
    }
    Ok(())
}

/// Whether `scenario` holds every value of the `P` profile named `name` but the ones its
/// `profiles.overrides` lists (false for an unknown name).
fn holds<P: Profile>(scenario: &Scenario, name: &str) -> bool {
    let Ok(profile) = find::<P>(name) else { return false };
    let ours = serde_json::to_value(P::of_scenario(name, scenario)).unwrap_or_default();
    let theirs = serde_json::to_value(&profile).unwrap_or_default();
    P::FIELDS
        .iter()
        .filter(|field| !overridden(&scenario.profiles.overrides, P::KIND, field))
        .all(|field| ours.get(field) == theirs.get(field))
}

/// The value of the scenario field at dotted `path` that a profile fills (`hardware.bf16_tflops`),
/// as serde writes it; `None` for a path no profile fills. A printed scenario leaves some of
/// these out at their defaults, which an overridden field must not be.
pub fn filled_value(scenario: &Scenario, path: &str) -> Option<serde_json::Value> {
    let (_, field) = path.split_once('.')?;
    let values = match ProfileKind::filling(path)? {
        ProfileKind::Gpu => serde_json::to_value(Gpu::of_scenario("", scenario)),
        ProfileKind::Nic => serde_json::to_value(Nic::of_scenario("", scenario)),
        ProfileKind::Model => serde_json::to_value(Model::of_scenario("", scenario)),
    };
    values.ok()?.get(field).cloned()
}

/// Drops from `scenario.profiles` every profile whose values the scenario no longer holds (a
/// search's shallower twin of a model, say), with the overrides of its fields: the scenario
/// keeps the values, so it runs the same, and written out with all its fields it loads again,
/// since a file that names a profile must agree with it. Returns what was dropped, as "model
/// profile `deepseek-r1`".
pub fn drop_contradicted(scenario: &mut Scenario) -> Vec<String> {
    let mut dropped = Vec::new();
    let names = scenario.profiles.clone();
    let mut check = |name: &Option<String>, kind: ProfileKind, held: &dyn Fn(&str) -> bool| match name {
        Some(name) if !held(name) => {
            dropped.push(format!("{kind} profile `{name}`"));
            None
        }
        other => other.clone(),
    };
    let gpu = check(&names.gpu, Gpu::KIND, &|n| holds::<Gpu>(scenario, n));
    let nic = check(&names.nic, Nic::KIND, &|n| holds::<Nic>(scenario, n));
    let model = check(&names.model, Model::KIND, &|n| holds::<Model>(scenario, n));
    let mut kept = Profiles { gpu, nic, model, overrides: Vec::new() };
    kept.overrides = names
        .overrides
        .iter()
        .filter(|path| ProfileKind::filling(path).is_some_and(|kind| kind.named(&kept).is_some()))
        .cloned()
        .collect();
    scenario.profiles = kept;
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names<P: Profile>() -> Vec<String> {
        match all::<P>() {
            Ok(profiles) => profiles.iter().map(|profile| profile.name().to_string()).collect(),
            Err(err) => panic!("{err}"),
        }
    }

    /// The shipped files load: every value cited, every rule kept, the names the docs list.
    #[test]
    fn every_profile_loads_with_a_source_for_every_value() {
        assert_eq!(names::<Gpu>(), ["mi300x", "mi355x", "h100-sxm", "h200-sxm", "b200", "h800"]);
        assert_eq!(names::<Nic>(), ["cx7-400g", "cx8-800g", "pollara-400", "thor2-400g"]);
        assert_eq!(names::<Model>(), ["deepseek-r1", "llama-3.1-70b", "qwen3-235b-a22b"]);
    }

    /// `FIELDS` lists what serde writes, so the order `pdkv profiles` shows and the fields a
    /// conflict is checked on cannot drift from the types; and a profile read from a scenario
    /// and applied back changes nothing (the two conversions name the same fields).
    #[test]
    fn fields_are_the_serde_fields_and_round_trip_through_a_scenario() {
        fn check<P: Profile + PartialEq + fmt::Debug>(name: &str) {
            let profile = find::<P>(name).unwrap();
            let mut listed: Vec<String> = P::FIELDS.iter().map(|f| f.to_string()).collect();
            listed.sort();
            assert_eq!(listed, value_fields(&profile), "{}", P::KIND.file());
            let mut scenario = Scenario::from_notation("1P_TP8:1D_TP8");
            profile.apply(&mut scenario, &|_| false);
            let read = P::of_scenario(name, &scenario);
            assert!(read.sources().is_empty());
            let mut back = scenario.clone();
            read.apply(&mut back, &|_| false);
            assert_eq!(back, scenario, "{name}");
            assert_eq!(value_fields(&read), value_fields(&profile));
        }
        check::<Gpu>("h200-sxm");
        check::<Nic>("cx8-800g");
        check::<Model>("qwen3-235b-a22b");
    }

    /// A scenario that no longer holds a profile's values stops naming it, and keeps naming the
    /// ones it still holds; written out, it loads again.
    #[test]
    fn contradicted_profiles_are_dropped_and_the_rest_kept() {
        let text =
            r#"(name: "p", deployment: "1P_TP8:1D_TP8", profiles: (gpu: "h200-sxm", model: "deepseek-r1"))"#;
        let mut scenario = crate::load::parse_scenario(text, "<test>").unwrap();
        let mut same = scenario.clone();
        assert_eq!(drop_contradicted(&mut same), Vec::<String>::new());
        assert_eq!(same, scenario);
        scenario.model.layers = 4;
        scenario.model.moe_layers = 4;
        let written = crate::load::scenario_to_ron(&scenario);
        assert!(crate::load::parse_scenario(&written, "<written>").is_err(), "the loader's rule stays");
        assert_eq!(drop_contradicted(&mut scenario), ["model profile `deepseek-r1`"]);
        assert_eq!(scenario.profiles.gpu.as_deref(), Some("h200-sxm"));
        assert_eq!(scenario.profiles.model, None);
        let back =
            crate::load::parse_scenario(&crate::load::scenario_to_ron(&scenario), "<written>").unwrap();
        assert_eq!(back, scenario);
    }

    /// A profile applied with one field kept writes every other field and leaves that one
    /// alone, for every field of every kind: the names `apply` keeps by are `FIELDS`.
    #[test]
    fn apply_keeps_exactly_the_field_it_is_told_to() {
        fn check<P: Profile>(name: &str) {
            let profile = find::<P>(name).unwrap();
            // A profile of the same kind with every value moved: numbers up by one, bools flipped.
            let mut moved = serde_json::to_value(&profile).unwrap();
            for field in P::FIELDS {
                let value = &mut moved[*field];
                *value = match &*value {
                    serde_json::Value::Bool(b) => serde_json::Value::Bool(!b),
                    serde_json::Value::Number(n) if n.is_u64() => (n.as_u64().unwrap() + 1).into(),
                    serde_json::Value::Number(n) => (n.as_f64().unwrap() + 1.0).into(),
                    other => panic!("{field}: {other}"),
                };
            }
            let moved: P = serde_json::from_value(moved).unwrap();
            for kept in P::FIELDS {
                let mut scenario = Scenario::from_notation("1P_TP8:1D_TP8");
                moved.apply(&mut scenario, &|_| false);
                profile.apply(&mut scenario, &|field| field == *kept);
                let now = serde_json::to_value(P::of_scenario(name, &scenario)).unwrap();
                let (theirs, before) =
                    (serde_json::to_value(&profile).unwrap(), serde_json::to_value(&moved).unwrap());
                for field in P::FIELDS {
                    let wanted = if field == kept { &before[*field] } else { &theirs[*field] };
                    assert_eq!(&now[*field], wanted, "{name}, keeping {kept}: {field}");
                }
            }
        }
        check::<Gpu>("mi300x");
        check::<Nic>("thor2-400g");
        check::<Model>("llama-3.1-70b");
    }

    /// (path) -> the kind of profile that fills it.
    #[test]
    fn paths_a_profile_fills() {
        let check = |path: &str, expected: Option<ProfileKind>| {
            assert_eq!(ProfileKind::filling(path), expected, "{path}");
        };
        check("hardware.hbm_gb", Some(ProfileKind::Gpu));
        check("hardware.gpus_per_node", Some(ProfileKind::Gpu));
        check("hardware.nic_qps", Some(ProfileKind::Nic));
        check("model.layers", Some(ProfileKind::Model));
        check("model.attention_heads", Some(ProfileKind::Model));
        check("hardware.control_latency_us", None);
        check("hardware.kv_memory_fraction", None);
        check("hardware.layers", None);
        check("model.hbm_gb", None);
        check("gpu.hbm_gb", None);
        check("hbm_gb", None);
        check("hardware.hbm_gb.x", None);
        check("", None);
    }

    /// (scenario fields) -> what loading gives: the values of some fields a profile fills, or
    /// the error's field and words. A written field listed in `profiles.overrides` keeps its
    /// value; every entry must be written, filled by a named profile, and listed once.
    #[test]
    fn overrides_keep_the_written_value_and_each_entry_is_checked() {
        let check = |fields: &str, expected: Result<&[(&str, &str)], (&str, &str)>| {
            let text = format!("(name: \"o\", deployment: \"1P_TP8:1D_TP8\", {fields})");
            match (crate::load::parse_scenario(&text, "<o>"), expected) {
                (Ok(scenario), Ok(values)) => {
                    for (path, value) in values {
                        let got = filled_value(&scenario, path).map(|v| v.to_string());
                        assert_eq!(got.as_deref(), Some(*value), "{fields}: {path}");
                    }
                }
                (Err(err), Err((field, words))) => {
                    assert_eq!(err.field(), Some(field), "{fields}: {err}");
                    assert!(err.to_string().contains(words), "{fields}: {err}");
                }
                (got, _) => panic!("{fields}: {got:?}, expected {expected:?}"),
            }
        };
        // MI300X with FP8 off: its FP8 peak is its BF16 one, the rest is the profile's.
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.fp8_tflops"]), hardware: (fp8_tflops: 1307.4)"#,
            Ok(&[
                ("hardware.fp8_tflops", "1307.4"),
                ("hardware.bf16_tflops", "1307.4"),
                ("hardware.hbm_gb", "192.0"),
            ]),
        );
        check(
            r#"profiles: (gpu: "h200-sxm", nic: "cx7-400g", overrides: ["hardware.hbm_gb", "hardware.nic_qps"]),
               hardware: (hbm_gb: 192, nic_qps: 8)"#,
            Ok(&[
                ("hardware.hbm_gb", "192.0"),
                ("hardware.nic_qps", "8"),
                ("hardware.hbm_tb_s", "4.8"),
                ("hardware.nic_gb_s", "44.78"),
            ]),
        );
        check(
            r#"profiles: (model: "llama-3.1-70b", overrides: ["model.layers"]), model: (layers: 40)"#,
            Ok(&[("model.layers", "40"), ("model.kv_heads", "8"), ("model.use_mla", "false")]),
        );
        // Listed with the profile's own value: nothing to keep, nothing wrong.
        check(
            r#"profiles: (gpu: "h200-sxm", overrides: ["hardware.hbm_gb"]), hardware: (hbm_gb: 141)"#,
            Ok(&[("hardware.hbm_gb", "141.0")]),
        );
        // Without the list, the written value is a conflict whose message says how to list it.
        check(
            r#"profiles: (gpu: "mi300x"), hardware: (fp8_tflops: 1307.4)"#,
            Err((
                "hardware.fp8_tflops",
                "is 1307.4 but the GPU profile `mi300x` (profiles/gpus.ron) says 2614.9; a scenario that \
                 names a profile takes the profile's values: remove `hardware.fp8_tflops` or the profile, or \
                 keep this value by listing the field in `profiles`: `overrides: [\"hardware.fp8_tflops\"]`",
            )),
        );
        // One field listed does not let another through.
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.hbm_gb"]), hardware: (hbm_gb: 80, fp8_tflops: 1000)"#,
            Err(("hardware.fp8_tflops", "is 1000.0 but the GPU profile `mi300x`")),
        );
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.fp8_tflops"])"#,
            Err((
                "profiles.overrides[0]",
                "`profiles.overrides` lists `hardware.fp8_tflops`, which the scenario does not write; write \
                 the value it should have instead of the profile's, or take it off the list",
            )),
        );
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.control_latency_us"]), hardware: (control_latency_us: 5)"#,
            Err(("profiles.overrides[0]", "lists `hardware.control_latency_us`, which no profile fills")),
        );
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.hbm_gb", "gpu.fp8_tflops"]), hardware: (hbm_gb: 80)"#,
            Err(("profiles.overrides[1]", "lists `gpu.fp8_tflops`, which no profile fills")),
        );
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.nic_gb_s"]), hardware: (nic_gb_s: 20)"#,
            Err((
                "profiles.overrides[0]",
                "lists `hardware.nic_gb_s`, which a NIC profile fills, but the scenario names none (`profiles.nic`)",
            )),
        );
        check(
            r#"profiles: (overrides: ["model.layers"]), model: (layers: 4, moe_layers: 4)"#,
            Err((
                "profiles.overrides[0]",
                "which a model profile fills, but the scenario names none (`profiles.model`)",
            )),
        );
        check(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.hbm_gb", "hardware.hbm_gb"]), hardware: (hbm_gb: 80)"#,
            Err(("profiles.overrides[1]", "`profiles.overrides` lists `hardware.hbm_gb` twice")),
        );
        // An overridden value still meets the format's rules, checked after the profiles.
        check(
            r#"profiles: (model: "deepseek-r1", overrides: ["model.kv_heads"]), model: (kv_heads: 2)"#,
            Err(("model.kv_heads", "must be 1 when model.use_mla is true")),
        );
    }

    /// An overridden field does not contradict its profile; a profile dropped takes the
    /// overrides of its fields with it, and the scenario written out loads again.
    #[test]
    fn overridden_fields_never_contradict_and_leave_with_their_profile() {
        let text = r#"(name: "p", deployment: "1P_TP8:1D_TP8",
            profiles: (gpu: "h200-sxm", model: "deepseek-r1", overrides: ["hardware.hbm_gb", "model.layers"]),
            hardware: (hbm_gb: 192), model: (layers: 60))"#;
        let mut scenario = crate::load::parse_scenario(text, "<test>").unwrap();
        let mut same = scenario.clone();
        assert_eq!(drop_contradicted(&mut same), Vec::<String>::new());
        assert_eq!(same, scenario);
        scenario.model.moe_layers = 4;
        assert_eq!(drop_contradicted(&mut scenario), ["model profile `deepseek-r1`"]);
        assert_eq!(scenario.profiles.gpu.as_deref(), Some("h200-sxm"));
        assert_eq!(scenario.profiles.overrides, ["hardware.hbm_gb"]);
        assert_eq!((scenario.hardware.hbm_gb, scenario.model.layers), (192.0, 60));
        let back =
            crate::load::parse_scenario(&crate::load::scenario_to_ron(&scenario), "<written>").unwrap();
        assert_eq!(back, scenario);
    }

    /// The default model is the `deepseek-r1` profile, value for value, so a scenario naming it
    /// runs exactly as one naming nothing.
    #[test]
    fn default_model_is_the_deepseek_r1_profile() {
        assert_eq!(find::<Model>("deepseek-r1").unwrap().to_model_profile(), ModelProfile::default());
    }

    /// The default hardware predates the profiles and was calibrated as it is; where it differs
    /// from the `mi300x` GPU and the `thor2-400g` NIC whose class it models, this table says so:
    /// (field, default, profile).
    #[test]
    fn default_hardware_against_the_mi300x_and_thor2_profiles() {
        let mut profiled = Scenario::from_notation("1P_TP8:1D_TP8");
        profiled.profiles.gpu = Some("mi300x".into());
        profiled.profiles.nic = Some("thor2-400g".into());
        resolve(&mut profiled, &|_| false).unwrap();
        let default = Scenario::from_notation("1P_TP8:1D_TP8");
        let values = |scenario: &Scenario| {
            let gpu = serde_json::to_value(Gpu::of_scenario("", scenario)).unwrap_or_default();
            let nic = serde_json::to_value(Nic::of_scenario("", scenario)).unwrap_or_default();
            (gpu, nic)
        };
        let (default_gpu, default_nic) = values(&default);
        let (gpu, nic) = values(&profiled);
        let mut differ = Vec::new();
        for (fields, default, profile) in
            [(Gpu::FIELDS, &default_gpu, &gpu), (Nic::FIELDS, &default_nic, &nic)]
        {
            for field in fields {
                if default.get(field) != profile.get(field) {
                    differ.push(format!(
                        "{field}: {} vs {}",
                        shown(default.get(field)),
                        shown(profile.get(field))
                    ));
                }
            }
        }
        assert_eq!(
            differ,
            [
                "fp8_tflops: 2600.0 vs 2614.9",
                "bf16_tflops: 1300.0 vs 1307.4",
                "nic_gb_s: 48.0 vs 47.75",
                "nic_latency_us: 5.0 vs 11.1",
            ]
        );
    }

    /// One profile of each kind in a file of its own, with one line replaced.
    fn gpu_file(replace: (&str, &str)) -> String {
        let text = r#"[(
            name: "g",
            hbm_gb: 80.0, hbm_tb_s: 3.0, fp8_tflops: 2000.0, bf16_tflops: 1000.0, fabric_gb_s: 450.0,
            gpus_per_node: 8,
            sources: {
                "hbm_gb": "https://example.com/a — 'HBM 80 GB'",
                "hbm_tb_s": "UNVERIFIED: not found",
                "fp8_tflops": "modelling choice: twice bf16",
                "bf16_tflops": "https://example.com/b — '1000'",
                "fabric_gb_s": "https://example.com/c — '450 each way'",
                "gpus_per_node": "https://example.com/d — '8 GPUs'",
            },
        )]"#;
        assert!(text.contains(replace.0), "{}", replace.0);
        text.replacen(replace.0, replace.1, 1)
    }

    /// (one change to a good GPU file) -> the error, in words; the good file loads.
    #[test]
    fn bad_profile_files_are_typed_errors_naming_file_profile_and_field() {
        assert!(parse::<Gpu>(&gpu_file(("", ""))).is_ok());
        let check = |replace: (&str, &str), expected: &str| {
            let shown = match parse::<Gpu>(&gpu_file(replace)) {
                Ok(_) => panic!("{replace:?} loaded"),
                Err(err) => err.to_string(),
            };
            assert!(shown.contains(expected), "{replace:?}: {shown}");
        };
        check(
            ("\"hbm_gb\": \"https://example.com/a — 'HBM 80 GB'\",", ""),
            "profiles/gpus.ron, profile `g`: field `hbm_gb` has no entry in `sources`",
        );
        check(
            ("\"hbm_tb_s\":", "\"hbm_tbs\": \"UNVERIFIED: typo\", \"hbm_tb_s\":"),
            "`sources` names `hbm_tbs`, which is not a field; the fields are: bf16_tflops, fabric_gb_s",
        );
        check(("https://example.com/a — ", "example.com/a "), "the source of `hbm_gb` is neither");
        check(("UNVERIFIED: not found", "UNVERIFIED: "), "the source of `hbm_tb_s` is neither");
        check(("https://example.com/b — '1000'", "https://example.com/b"), "the source of `bf16_tflops`");
        check(("hbm_gb: 80.0", "hbm_gb: 0.0"), "profile `g`, field `hbm_gb`: must be a finite number");
        check(
            ("fp8_tflops: 2000.0", "fp8_tflops: 500.0"),
            "field `fp8_tflops`: must be at least bf16_tflops",
        );
        check(("gpus_per_node: 8", "gpus_per_node: 0"), "field `gpus_per_node`: must be at least 1");
        check(("name: \"g\"", "name: \"G-1\""), "profile name `G-1` is not a lowercase id");
        check(
            ("gpus_per_node: 8,", "gpus_per_node: 8, tdp_w: 750.0,"),
            "profiles/gpus.ron:4:31: Unexpected field named `tdp_w` in `Gpu`",
        );
        check(("hbm_gb: 80.0, ", ""), "Unexpected missing field named `hbm_gb`");
        check(("hbm_gb: 80.0", "hbm_gb: \"80\""), "profiles/gpus.ron:3");
        let good = gpu_file(("", ""));
        let one = good.trim().trim_start_matches('[').trim_end_matches(']');
        let twice = format!("[{one}, {one}]");
        let shown = parse::<Gpu>(&twice).map(|_| ()).unwrap_err().to_string();
        assert!(shown.contains("profiles/gpus.ron: two profiles are named `g`"), "{shown}");
    }

    /// (one change to the deepseek-r1 or llama profile) -> the rule that fails, so each rule
    /// between model fields is shown to fire.
    #[test]
    fn model_rules_name_the_field() {
        let text = ProfileKind::Model.text();
        let check = |profile: &str, replace: (&str, &str), expected: &str| {
            let start = text.find(&format!("name: \"{profile}\"")).unwrap();
            let end = text[start..].find("sources:").unwrap() + start;
            let changed = text[start..end].replacen(replace.0, replace.1, 1);
            assert_ne!(changed, text[start..end], "{replace:?}");
            let file = format!("{}{changed}{}", &text[..start], &text[end..]);
            let shown = parse::<Model>(&file).map(|_| ()).unwrap_err().to_string();
            assert!(shown.contains(&format!("profile `{profile}`, {expected}")), "{replace:?}: {shown}");
        };
        check("deepseek-r1", ("kv_heads: 1", "kv_heads: 2"), "field `kv_heads`: must be 1 under MLA");
        check(
            "deepseek-r1",
            ("moe_layers: 58", "moe_layers: 62"),
            "field `moe_layers`: must be at most layers (61)",
        );
        check(
            "deepseek-r1",
            ("experts_per_token: 8", "experts_per_token: 300"),
            "field `experts_per_token`: must be at most routed_experts (256)",
        );
        check(
            "deepseek-r1",
            ("routed_experts: 256", "routed_experts: 0"),
            "field `routed_experts`: must be 0 exactly when",
        );
        check(
            "deepseek-r1",
            ("kv_bytes_per_token_per_layer: 576", "kv_bytes_per_token_per_layer: 1024"),
            "field `kv_bytes_per_token_per_layer`: must be kv_heads x head_dim (576) values at 1 or 2 bytes each (an FP8 or BF16 KV cache): 576 or 1152, got 1024",
        );
        check(
            "deepseek-r1",
            ("expert_params_per_layer_m: 44.040192", "expert_params_per_layer_m: 44040192.0"),
            "field `expert_params_per_layer_m`: makes the routed experts 653908770.8B",
        );
        check(
            "deepseek-r1",
            ("expert_params_per_layer_m: 44.040192", "expert_params_per_layer_m: 50.0"),
            "field `expert_params_per_layer_m`: makes the routed experts 742.4B parameters, more than total_params_b (671)",
        );
        check(
            "deepseek-r1",
            ("active_params_b: 37.0", "active_params_b: 700.0"),
            "field `active_params_b`: must be at most total_params_b",
        );
        check(
            "llama-3.1-70b",
            ("experts_per_token: 0", "experts_per_token: 2"),
            "field `experts_per_token`: must be 0 for a dense model",
        );
        check(
            "llama-3.1-70b",
            ("attention_heads: 64", "attention_heads: 60"),
            "field `attention_heads`: must be a multiple of kv_heads (8)",
        );
        check(
            "llama-3.1-70b",
            ("kv_bytes_per_token_per_layer: 2048", "kv_bytes_per_token_per_layer: 1024"),
            "field `kv_bytes_per_token_per_layer`: must be 2 x kv_heads x head_dim (2048) values",
        );
    }

    /// (citation) -> accepted.
    #[test]
    fn citation_forms() {
        let check = |citation: &str, ok: bool| assert_eq!(is_citation(citation), ok, "{citation:?}");
        check("https://a.b/c — 'quote'", true);
        check("http://a.b/c — paraphrase", true);
        check("UNVERIFIED: no data sheet", true);
        check("modelling choice: four queue pairs", true);
        check("https://a.b/c", false);
        check("https://a.b/c —", false);
        check("https://a.b c — quote", false);
        check("a.b/c — quote", false);
        check("UNVERIFIED:", false);
        check("unverified: lower case", false);
        check("", false);
    }

    /// (name) -> a lowercase id.
    #[test]
    fn profile_names_are_lowercase_ids() {
        let check = |name: &str, ok: bool| assert_eq!(is_id(name), ok, "{name:?}");
        check("mi300x", true);
        check("llama-3.1-70b", true);
        check("3fs", true);
        check("", false);
        check("-x", false);
        check("H100", false);
        check("h100 sxm", false);
    }
}
