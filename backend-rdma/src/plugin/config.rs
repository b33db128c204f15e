//! The configuration the connector's Python side hands the native module, as JSON: read
//! strictly (an unknown or mistyped key is an error naming it), checked, and turned into the
//! core's and the driver's types.

use std::fmt;

use crate::message_faults::{MessageFault, MessageKind, Verb, MAX_MESSAGE_FAULTS};
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
    /// RDMA: the NIC of each of this engine's ranks on a host, by local rank `dp * tp_size +
    /// tp` (cycled), e.g. one per GPU. Empty: every rank opens the one `PDKV_RDMA_DEVICE` names,
    /// else the first, so one NIC carries all of the engine's KV.
    #[serde(default)]
    pub rdma_devices: Vec<String>,
    /// Where rank (0, 0) serves its Prometheus metrics; rank (dp, tp) at `+ dp * tp_size + tp`.
    /// Absent: no endpoint.
    #[serde(default)]
    pub metrics_port: Option<u16>,
    /// Faults on the control messages this engine's ranks send, for hostile tests.
    #[serde(default)]
    pub message_faults: MessageFaultsConfig,
}

/// Faults on the control messages an engine's ranks send (handshake requests and replies,
/// releases, leases), in the syntax of `pdkv cluster`'s `--lose-messages`,
/// `--duplicate-messages` and `--delay-messages`: for hostile tests of a deployment, never for
/// serving. Each rank applies them to what it sends; the connector's decisions are unchanged.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageFaultsConfig {
    /// `PATTERN[:KINDS][=COUNT][@PROBABILITY]`: the messages are never sent.
    #[serde(default)]
    pub lose: Vec<String>,
    /// `PATTERN[:KINDS][=COUNT][@PROBABILITY]`: the messages are sent twice.
    #[serde(default)]
    pub duplicate: Vec<String>,
    /// `PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY]`: the messages are sent that much later.
    #[serde(default)]
    pub delay: Vec<String>,
    /// The seed of the probabilities' draws (a stream per rank).
    #[serde(default)]
    pub seed: u64,
}

impl MessageFaultsConfig {
    fn check(&self, d: &Deployment) -> Result<Vec<MessageFault>, ConfigError> {
        let lists = [
            (Verb::Lose, &self.lose, "message_faults.lose"),
            (Verb::Duplicate, &self.duplicate, "message_faults.duplicate"),
            (Verb::Delay, &self.delay, "message_faults.delay"),
        ];
        let mut faults = Vec::new();
        for (verb, texts, name) in lists {
            for text in texts {
                let fault =
                    MessageFault::parse(verb, text).map_err(|e| field(name, format!("`{text}`: {e}")))?;
                fault.check(d).map_err(|e| field(name, format!("`{text}`: {e}")))?;
                if fault.kinds().contains(&MessageKind::Dispatch) {
                    return Err(field(
                        name,
                        format!("`{text}`: the connector sends no dispatches (the router does)"),
                    ));
                }
                faults.push(fault);
            }
        }
        if faults.len() > MAX_MESSAGE_FAULTS {
            return Err(field(
                "message_faults",
                format!("{} faults, at most {MAX_MESSAGE_FAULTS}", faults.len()),
            ));
        }
        Ok(faults)
    }
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
    /// RDMA: each local rank's NIC, cycled (empty: the process's default device).
    pub rdma_devices: Vec<String>,
    /// Where rank (0, 0) serves its metrics, if anywhere.
    pub metrics_port: Option<u16>,
    /// Faults on the control messages the ranks send (none when serving).
    pub message_faults: Vec<MessageFault>,
    /// The seed of the faults' draws.
    pub fault_seed: u64,
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
        let message_faults = self.message_faults.check(&deployment)?;
        if !self.rdma_devices.is_empty() && transport != TransportKind::Rdma {
            return Err(field("rdma_devices", "given, but the transport is not `rdma`"));
        }
        if let Some(bad) = self.rdma_devices.iter().find(|n| n.is_empty() || n.len() > 64) {
            return Err(field("rdma_devices", format!("{bad:?} is not a device name")));
        }
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
            rdma_devices: self.rdma_devices.clone(),
            metrics_port: self.metrics_port,
            message_faults,
            fault_seed: self.message_faults.seed,
        })
    }
}

impl Engine {
    /// The NIC `rank` of this engine moves KV through: its RDMA device, `rdma` for the
    /// process's default device, or `tcp`.
    pub fn nic(&self, rank: RankId) -> String {
        match self.transport {
            TransportKind::Tcp => "tcp".into(),
            TransportKind::Rdma if self.rdma_devices.is_empty() => "rdma".into(),
            TransportKind::Rdma => {
                let layout = self.deployment.layout(self.engine);
                let local = usize::from(rank.dp) * usize::from(layout.tp) + usize::from(rank.tp);
                self.rdma_devices[local % self.rdma_devices.len()].clone()
            }
        }
    }

    /// The device `rank` opens, if the configuration names one.
    pub fn rdma_device(&self, rank: RankId) -> Option<String> {
        (self.transport == TransportKind::Rdma && !self.rdma_devices.is_empty()).then(|| self.nic(rank))
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
        check(
            r#", "message_faults": {"delay": ["D0.dp*.tp*:release"]}"#,
            "`message_faults.delay`: `D0.dp*.tp*:release`",
        );
        check(r#", "message_faults": {"lose": ["D7.dp0.tp0"]}"#, "`message_faults.lose`: `D7.dp0.tp0`");
        check(r#", "message_faults": {"delay": ["P0.dp0.tp*:dispatch:5"]}"#, "sends no dispatches");
        check(r#", "message_faults": {"drop": []}"#, "unknown field `drop`");
        let many = vec![r#""D0.dp0.tp0:release""#; MAX_MESSAGE_FAULTS + 1].join(",");
        check(&format!(r#", "message_faults": {{"lose": [{many}]}}"#), "at most 32");
        let ok = r#", "message_faults": {"delay": ["D0.dp*.tp*:release,lease:1500@0.5"], "lose": ["D0.dp0.tp1:release=2"], "seed": 7}"#;
        check(r#", "rdma_devices": ["mlx5_0"]"#, "`rdma_devices`: given, but the transport is not `rdma`");
        check(r#", "transport": "rdma", "rdma_devices": [""]"#, "`rdma_devices`: \"\" is not a device name");
        let engine = EngineConfig::parse(&config(ok)).expect("a valid fault list");
        assert_eq!(engine.message_faults.len(), 2);
        assert_eq!(engine.fault_seed, 7);
    }

    #[test]
    fn each_rank_gets_its_nic() {
        // Prefill TP2 (ranks 0, 1) over three devices; decode DP2 TP2 over two; TCP and the
        // default device name no device.
        let check = |deployment: &str, engine: &str, transport: &str, devices: &str, expected: &[&str]| {
            let patch = format!(r#", "transport": "{transport}", "rdma_devices": [{devices}]"#);
            let json = config(&patch)
                .replace("1P_TP2:1D_TP2", deployment)
                .replace(r#""engine": "P0""#, &format!(r#""engine": "{engine}""#));
            let e = EngineConfig::parse(&json).expect("valid");
            let layout = e.deployment.layout(e.engine);
            let mut got = Vec::new();
            for dp in 0..layout.dp {
                for tp in 0..layout.tp {
                    let rank = RankId::new(e.engine, dp, tp);
                    got.push(e.nic(rank));
                    assert_eq!(e.rdma_device(rank).is_some(), !devices.is_empty(), "{deployment} {rank}");
                }
            }
            assert_eq!(got, expected, "{deployment} {engine} {transport} [{devices}]");
        };
        check("1P_TP2:1D_TP2", "P0", "rdma", r#""a", "b", "c""#, &["a", "b"]);
        check("1P_TP2:1D_DP2TP2", "D0", "rdma", r#""a", "b""#, &["a", "b", "a", "b"]);
        check("1P_TP2:1D_DP2TP2", "D0", "rdma", "", &["rdma", "rdma", "rdma", "rdma"]);
        check("1P_TP2:1D_TP2", "P0", "tcp", "", &["tcp", "tcp"]);
        assert!(EngineConfig::parse(&config("")).is_ok());
    }
}
