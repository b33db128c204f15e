//! Why the simulator cannot run a scenario at all ([`SimError`]), and the checks behind it.
//!
//! A scenario read from a file has passed [`crate::load::validate`], whose rules include these
//! (with the file's line and column); `run` checks again only what it needs to build a world,
//! because scenarios are also made in code and not all of them are validated: exploration's
//! storms and shrinking, and tests. A storm on a scenario whose handshake timeout is under
//! 10 ms may ask for a 0 ms listener service time, which the format rejects but the simulator
//! runs fine, so validating in `run` would change what exploration finds.

use std::fmt;

use pdkv_core::ids::EngineId;
use pdkv_core::policy::{PeerRules, UnknownPeerRules};
use pdkv_core::routing::{check_pair, RoutingError};
use pdkv_core::topology::{Deployment, Layout, ModelSpec, NotationError};

/// Why [`crate::run`] refused a scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimError {
    /// The scenario's `deployment` is not valid notation.
    Deployment(NotationError),
    /// A decode engine cannot read from a prefill engine (every decode engine may be routed to
    /// every prefill engine, so every pair must be readable).
    Unroutable {
        /// Index of the decode engine (`D<n>`).
        decode: usize,
        /// Its layout.
        decode_layout: Layout,
        /// Index of the prefill engine (`P<n>`).
        prefill: usize,
        /// Its layout.
        prefill_layout: Layout,
        /// What the core's routing rejects about the pair.
        error: RoutingError,
    },
    /// An entry of `protocol.peers` names no engine of the deployment or no rule set.
    Peers(PeerError),
    /// An engine's GPUs cannot hold the model's weights with room for a KV cache (when the KV
    /// cache is derived from the weights, `hardware.kv_memory_fraction` 0).
    NoKvRoom {
        /// The engine, `P<n>` or `D<n>`.
        engine: String,
        /// Its layout.
        layout: Layout,
        /// The figures: weights, reserve, usable memory.
        detail: String,
    },
}

/// A bad entry of a scenario's `protocol.peers`
/// ([`Scenario::peer_book`](crate::scenario::Scenario::peer_book)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerError {
    /// The key is not an engine label like `P0` or `D1`.
    NotAnEngine {
        /// The key as written.
        name: String,
    },
    /// The deployment has no such engine.
    NoSuchEngine {
        /// The engine named.
        engine: EngineId,
        /// How many engines of its role the deployment has.
        engines: usize,
        /// The deployment, in canonical notation.
        notation: String,
    },
    /// The value is not a rule set name.
    UnknownRules {
        /// The engine it is given for.
        engine: EngineId,
        /// The name and the known ones.
        error: UnknownPeerRules,
    },
    /// Two engines follow different vLLM dialects, whose rules between them pdkv does not
    /// model ([`PeerBook::mixed_dialects`](pdkv_core::policy::PeerBook::mixed_dialects)).
    MixedDialects {
        /// The first engine under a vLLM dialect and its rules.
        first: (EngineId, PeerRules),
        /// The first engine after it under another one.
        second: (EngineId, PeerRules),
    },
}

impl PeerError {
    /// The key of the entry, as written for a good engine label.
    pub fn key(&self) -> String {
        match self {
            PeerError::NotAnEngine { name } => name.clone(),
            PeerError::NoSuchEngine { engine, .. } | PeerError::UnknownRules { engine, .. } => {
                engine.to_string()
            }
            PeerError::MixedDialects { second: (engine, _), .. } => engine.to_string(),
        }
    }
}

impl fmt::Display for PeerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerError::NotAnEngine { name } => {
                write!(f, "`{}` is not an engine; expected one like P0 or D1", name.escape_debug())
            }
            PeerError::NoSuchEngine { engine, engines, notation } => {
                let (letter, role) = (engine.role.letter(), engine.role.name());
                write!(
                    f,
                    "{notation} has no {role} engine {engine} (engines {letter}0..{letter}{})",
                    engines.saturating_sub(1)
                )
            }
            PeerError::UnknownRules { error, .. } => write!(f, "{error}"),
            PeerError::MixedDialects { first: (a, a_rules), second: (_, b_rules) } => write!(
                f,
                "{b_rules}, but {a} follows {a_rules}: one deployment may follow one vLLM dialect \
                 (pdkv does not model two vLLM releases talking to each other)"
            ),
        }
    }
}

impl std::error::Error for PeerError {}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Deployment(error) => write!(f, "{error}"),
            SimError::Peers(error) => write!(f, "protocol.peers[\"{}\"]: {error}", error.key()),
            // The same words as the loader's `hardware.hbm_gb` violation.
            SimError::NoKvRoom { engine, layout, detail } => write!(f, "engine {engine} ({layout}) {detail}"),
            // The same words as the loader's `deployment` violation.
            SimError::Unroutable { decode, decode_layout, prefill, prefill_layout, error } => write!(
                f,
                "decode engine D{decode} ({decode_layout}) cannot read prefill engine P{prefill} \
                 ({prefill_layout}): {error}"
            ),
        }
    }
}

impl std::error::Error for SimError {}

/// A scenario's deployment (its `deployment` notation, with its model), once every decode engine
/// can read every prefill engine.
pub(crate) fn routable_deployment(notation: &str, model: ModelSpec) -> Result<Deployment, SimError> {
    let d = Deployment::parse(notation).map_err(SimError::Deployment)?.with_model(model);
    for (decode, &decode_layout) in d.decode.iter().enumerate() {
        for (prefill, &prefill_layout) in d.prefill.iter().enumerate() {
            check_pair(decode_layout, prefill_layout, &d.model).map_err(|error| SimError::Unroutable {
                decode,
                decode_layout,
                prefill,
                prefill_layout,
                error,
            })?;
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use crate::scenario::Scenario;
    use crate::RunOptions;

    /// (deployment, KV heads of a model without MLA) -> what `run` says, as the user reads it;
    /// `None` where it runs.
    #[test]
    fn run_names_what_cannot_run() {
        let table = [
            ("1P_TP8:1D_TP8", 8, None),
            (
                "1P_TP8:1D_XP8",
                8,
                Some(
                    "invalid deployment notation \"1P_TP8:1D_XP8\": bad token \"XP8\" at column 11: expected \
                     a layout like TP8, DP8EP or DP4TP2 (components DP<n>, TP<n>, EP)",
                ),
            ),
            (
                "1P_TP8:1D_TP3",
                8,
                Some(
                    "decode engine D0 (TP3) cannot read prefill engine P0 (TP8): decode TP3 and prefill TP8: \
                     one TP size must be a multiple of the other",
                ),
            ),
            (
                "1P_TP8:1D_TP8+1D_TP4",
                8,
                Some(
                    "decode engine D1 (TP4) cannot read prefill engine P0 (TP8): decode TP4 and prefill TP8 \
                     with 8 KV heads: heterogeneous TP requires replicated KV heads (replicated KV heads are \
                     required on every rank: min(TP) >= kv_heads, or MLA); reads would split heads",
                ),
            ),
            ("1P_TP8:1D_TP8+1D_TP4", 4, None),
        ];
        for (deployment, kv_heads, expected) in table {
            let mut sc = Scenario::from_notation(deployment);
            sc.model.use_mla = false;
            sc.model.kv_heads = kv_heads;
            // A TP4 engine cannot hold DeepSeek-R1's weights; routing is what this table checks.
            sc.hardware.kv_memory_fraction = 0.5;
            let got = crate::run(&sc, RunOptions::default()).err().map(|e| e.to_string());
            assert_eq!(got.as_deref(), expected, "{deployment}");
        }
        // With the KV cache derived from the weights, the same deployment cannot run, and the
        // error names the engine and the figures.
        let sc = Scenario::from_notation("1P_TP8:1D_TP8+1D_TP4");
        let got = crate::run(&sc, RunOptions::default()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            got.starts_with("engine D1 (TP4) leaves -1.1 GB of KV cache per GPU (under 1 GB): the model's weights take 167.8 GB"),
            "{got}"
        );
    }
}
