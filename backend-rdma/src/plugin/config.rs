//! The configuration the connector's Python side hands the native module, as JSON: read
//! strictly (an unknown or mistyped key is an error naming it), checked, and turned into the
//! core's and the driver's types.

use std::fmt;

use crate::sched::TransportKind;
use pdkv_core::ids::{EngineId, RankId, Role};
use pdkv_core::ports::EngineAddress;
use pdkv_core::topology::{Deployment, ModelSpec};
use pdkv_engine::timeouts::ProtocolTimeouts;
use serde::Deserialize;

/// Why a configuration was refused; the Python side raises it as `ValueError`.
#[derive(Debug)]
pub enum ConfigError {
    /// The JSON does not parse or does not match the fields (serde's words name the key).
    Json(serde_json::Error),
    /// A field parses but its value is not allowed.
    Field {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Json(e) => write!(f, "pdkv connector configuration: {e}"),
            ConfigError::Field { field, reason } => {
                write!(f, "pdkv connector configuration: `{field}`: {reason}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

fn field(field: &'static str, reason: impl fmt::Display) -> ConfigError {
    ConfigError::Field { field, reason: reason.to_string() }
}

/// The served model's KV geometry, from vLLM's model and cache configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Multi-head latent attention (one latent per token, replicated on every TP rank).
    pub use_mla: bool,
    /// KV heads of the whole model (1 for MLA).
    pub kv_heads: u16,
    /// Attention layers with a KV cache.
    pub layers: u16,
    /// KV bytes of one token in one layer for the whole model (keys and values of every head).
    pub bytes_per_token_per_layer: u32,
    /// Tokens per KV block.
    pub block_size_tokens: u32,
}

impl ModelConfig {
    fn spec(&self) -> Result<ModelSpec, ConfigError> {
        if self.layers == 0 {
            return Err(field("model.layers", "must be at least 1"));
        }
        if self.kv_heads == 0 {
            return Err(field("model.kv_heads", "must be at least 1"));
        }
        if self.block_size_tokens == 0 {
            return Err(field("model.block_size_tokens", "must be at least 1"));
        }
        if self.bytes_per_token_per_layer == 0 {
            return Err(field("model.bytes_per_token_per_layer", "must be at least 1"));
        }
        Ok(ModelSpec {
            use_mla: self.use_mla,
            kv_heads: self.kv_heads,
            layers: self.layers,
            bytes_per_token_per_layer: self.bytes_per_token_per_layer,
            block_size_tokens: self.block_size_tokens,
        })
    }
}

/// What every part of the connector shares: the deployment and this engine.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// The deployment in pdkv's notation, e.g. `1P_TP2:1D_TP2`.
    pub deployment: String,
    /// This engine, e.g. `P0` or `D0`.
    pub engine: String,
    /// The model.
    pub model: ModelConfig,
    /// The host this engine's ranks listen on (a real address peers can reach).
    pub host: String,
    /// Handshake port of rank (0, 0); MoRIIO's `handshake_port`.
    pub handshake_port: u16,
    /// Notify port of rank (0, 0); MoRIIO's `notify_port`.
    pub notify_port: u16,
    /// The protocol's timeouts.
    #[serde(default)]
    pub timeouts: Option<ProtocolTimeouts>,
    /// The data plane: `tcp` or `rdma`.
    #[serde(default = "tcp")]
    pub transport: String,
    /// Where rank (0, 0) serves its Prometheus metrics; rank (dp, tp) at `+ dp * tp_size + tp`.
    /// Absent: no endpoint.
    #[serde(default)]
    pub metrics_port: Option<u16>,
}

fn tcp() -> String {
    "tcp".into()
}

/// [`EngineConfig`], checked.
pub struct Engine {
    /// The deployment, with the model.
    pub deployment: Deployment,
    /// This engine.
    pub engine: EngineId,
    /// Where its ranks listen.
    pub address: EngineAddress,
    /// The timeouts.
    pub timeouts: ProtocolTimeouts,
    /// The data plane.
    pub transport: TransportKind,
    /// Where rank (0, 0) serves its metrics, if anywhere.
    pub metrics_port: Option<u16>,
}

impl EngineConfig {
    /// Parses `json` strictly.
    pub fn parse(json: &str) -> Result<Engine, ConfigError> {
        let config: EngineConfig = serde_json::from_str(json).map_err(ConfigError::Json)?;
        config.check()
    }

    fn check(&self) -> Result<Engine, ConfigError> {
        let mut deployment = Deployment::parse(&self.deployment).map_err(|e| field("deployment", e))?;
        deployment.model = self.model.spec()?;
        let engine: EngineId = self.engine.parse().map_err(|e| field("engine", e))?;
        let engines = match engine.role {
            Role::Prefill => &deployment.prefill,
            Role::Decode => &deployment.decode,
        };
        if usize::from(engine.index) >= engines.len() {
            return Err(field("engine", format!("deployment {} has no engine {engine}", self.deployment)));
        }
        if self.host.is_empty() {
            return Err(field("host", "must name the host the engine's ranks listen on"));
        }
        let timeouts = self.timeouts.unwrap_or_default();
        timeouts.check().map_err(|e| field("timeouts", e))?;
        let transport = match self.transport.as_str() {
            "tcp" => TransportKind::Tcp,
            "rdma" => TransportKind::Rdma,
            other => return Err(field("transport", format!("`{other}` is neither `tcp` nor `rdma`"))),
        };
        Ok(Engine {
            deployment,
            engine,
            address: EngineAddress {
                host: self.host.clone(),
                handshake_port_base: self.handshake_port,
                notify_port_base: self.notify_port,
            },
            timeouts,
            transport,
            metrics_port: self.metrics_port,
        })
    }
}

/// A worker's rank within the engine: its DP and TP rank, from vLLM's parallel state.
pub fn rank_of(engine: &Engine, dp: u16, tp: u16) -> Result<RankId, ConfigError> {
    let layout = engine.deployment.layout(engine.engine);
    if dp >= layout.dp || tp >= layout.tp {
        return Err(field(
            "deployment",
            format!(
                "{} is DP{} TP{}, but this worker is DP rank {dp}, TP rank {tp}: the deployment does not \
                 describe how vLLM was started",
                engine.engine, layout.dp, layout.tp
            ),
        ));
    }
    Ok(RankId::new(engine.engine, dp, tp))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(patch: &str) -> String {
        let base = r#"{"deployment": "1P_TP2:1D_TP2", "engine": "P0", "host": "127.0.0.1",
            "handshake_port": 7000, "notify_port": 7100,
            "model": {"use_mla": false, "kv_heads": 2, "layers": 2, "bytes_per_token_per_layer": 512,
                      "block_size_tokens": 16}"#;
        format!("{base}{patch}}}")
    }

    #[test]
    fn bad_configurations_name_the_field() {
        let check = |patch: &str, expected: &str| {
            let got = EngineConfig::parse(&config(patch)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(got.contains(expected), "{patch}: {got}");
        };
        check(r#", "transport": "carrier-pigeon""#, "`transport`: `carrier-pigeon` is neither");
        check(r#", "colour": 1"#, "unknown field `colour`");
        check(r#", "model2": 1"#, "unknown field `model2`");
        assert!(EngineConfig::parse(&config("")).is_ok());
    }
}
