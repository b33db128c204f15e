//! Engine registration at the proxy: what each engine announces, and what the proxy refuses.
//!
//! In MoRIIO each engine announces its role, HTTP address, host, handshake and notify ports, DP
//! and TP sizes and transfer mode; the proxy rejects an engine whose transfer mode differs from
//! its own (a WRITE-mode decode paired with a READ-mode prefill would wait forever for writes).
//! The registry turns accepted registrations into the `Deployment` and `AddressBook` the rest of
//! the core uses.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, Role};
use crate::ports::{AddressBook, EngineAddress};
use crate::topology::{
    Deployment, Layout, ModelSpec, MAX_ENGINES_PER_ROLE, MAX_PARALLEL_SIZE, MAX_RANKS_PER_ROLE,
};

/// How KV moves: decode pulls with RDMA READ (pdkv's mode), or prefill pushes with WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// Decode reads prefill's blocks with RDMA READ, then releases them (pdkv's mode).
    Read,
    /// Decode announces its blocks with `remote_blocks`; prefill writes into them with RDMA WRITE
    /// and reports `write_done`.
    Write,
}

impl fmt::Display for TransferMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferMode::Read => "read",
            TransferMode::Write => "write",
        })
    }
}

/// What one engine announces. Sizes and ports are kept as received so bad values can be named.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Whether the engine serves prefill or decode.
    pub role: Role,
    /// Where the proxy sends the engine requests over HTTP; identifies the engine, so it must be
    /// unique across both roles.
    pub http_address: String,
    /// Host of the engine's handshake and notify listeners.
    pub host: String,
    /// Handshake port base, 1..=65535; rank (dp, tp) listens at `base + dp * tp_size + tp`.
    pub handshake_port: i64,
    /// Notify (release) port base, 1..=65535, offset per rank like the handshake base.
    pub notify_port: i64,
    /// DP ranks of the engine, 1..=256.
    pub dp_size: i64,
    /// TP ranks of each DP group, 1..=256.
    pub tp_size: i64,
    /// Expert parallelism over all ranks (changes compute only).
    #[serde(default)]
    pub ep: bool,
    /// Must equal the proxy's mode.
    pub transfer_mode: TransferMode,
}

/// A registration the proxy refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationError {
    /// The engine's transfer mode differs from the proxy's; the pair would wait forever.
    ModeMismatch {
        /// The engine's HTTP address.
        http_address: String,
        /// The proxy's mode.
        proxy: TransferMode,
        /// The mode the engine announced.
        engine: TransferMode,
    },
    /// A size or port base outside its range.
    OutOfRange {
        /// The engine's HTTP address.
        http_address: String,
        /// The registration field: `dp_size`, `tp_size`, `handshake_port` or `notify_port`.
        field: &'static str,
        /// The value as announced.
        value: i64,
        /// Smallest accepted value.
        min: i64,
        /// Largest accepted value.
        max: i64,
    },
    /// An engine with this HTTP address is registered already, in either role.
    Duplicate {
        /// The HTTP address announced twice.
        http_address: String,
    },
    /// The role has [`MAX_ENGINES_PER_ROLE`] engines already.
    TooManyEngines {
        /// The role that is full.
        role: Role,
    },
    /// The side would have more than [`MAX_RANKS_PER_ROLE`] GPUs.
    TooManyRanks {
        /// The side.
        role: Role,
        /// GPUs it would have.
        ranks: u32,
    },
}

impl fmt::Display for RegistrationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistrationError::ModeMismatch { http_address, proxy, engine } => write!(
                f,
                "engine {http_address} uses transfer mode {engine} but the proxy runs {proxy}; \
                 both sides must use the same mode"
            ),
            RegistrationError::OutOfRange { http_address, field, value, min, max } => {
                write!(f, "engine {http_address}: {field} = {value} is outside {min}..={max}")
            }
            RegistrationError::Duplicate { http_address } => {
                write!(f, "engine {http_address} is registered already")
            }
            RegistrationError::TooManyRanks { role, ranks } => {
                write!(f, "the {} side would have {ranks} GPUs, more than {MAX_RANKS_PER_ROLE}", role.name())
            }
            RegistrationError::TooManyEngines { role } => {
                write!(f, "more than {MAX_ENGINES_PER_ROLE} {} engines", role.name())
            }
        }
    }
}

impl std::error::Error for RegistrationError {}

/// Engines registered so far, in registration order per role.
#[derive(Clone, Debug)]
pub struct Registry {
    mode: TransferMode,
    prefill: Vec<(Registration, Layout, EngineAddress)>,
    decode: Vec<(Registration, Layout, EngineAddress)>,
}

fn ranged(
    reg: &Registration,
    field: &'static str,
    value: i64,
    min: i64,
    max: i64,
) -> Result<i64, RegistrationError> {
    if value < min || value > max {
        return Err(RegistrationError::OutOfRange {
            http_address: reg.http_address.clone(),
            field,
            value,
            min,
            max,
        });
    }
    Ok(value)
}

impl Registry {
    /// An empty registry for a proxy that runs `mode`.
    pub fn new(mode: TransferMode) -> Registry {
        Registry { mode, prefill: Vec::new(), decode: Vec::new() }
    }

    /// Accepts one engine and returns its id within its role (the next index, in registration
    /// order). Checks mode, then sizes and port bases, then uniqueness, then the engine limit.
    pub fn handle_register(&mut self, reg: Registration) -> Result<EngineId, RegistrationError> {
        if reg.transfer_mode != self.mode {
            return Err(RegistrationError::ModeMismatch {
                http_address: reg.http_address.clone(),
                proxy: self.mode,
                engine: reg.transfer_mode,
            });
        }
        let size = i64::from(MAX_PARALLEL_SIZE);
        let dp = ranged(&reg, "dp_size", reg.dp_size, 1, size)? as u16;
        let tp = ranged(&reg, "tp_size", reg.tp_size, 1, size)? as u16;
        let handshake = ranged(&reg, "handshake_port", reg.handshake_port, 1, 65535)? as u16;
        let notify = ranged(&reg, "notify_port", reg.notify_port, 1, 65535)? as u16;
        let taken =
            self.prefill.iter().chain(&self.decode).any(|(r, _, _)| r.http_address == reg.http_address);
        if taken {
            return Err(RegistrationError::Duplicate { http_address: reg.http_address });
        }
        let side = match reg.role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
        };
        if side.len() >= usize::from(MAX_ENGINES_PER_ROLE) {
            return Err(RegistrationError::TooManyEngines { role: reg.role });
        }
        let layout = Layout::new(dp, tp, reg.ep && dp * tp > 1);
        let ranks: u32 = side.iter().map(|(_, l, _)| l.ranks()).sum::<u32>() + layout.ranks();
        if ranks > MAX_RANKS_PER_ROLE {
            return Err(RegistrationError::TooManyRanks { role: reg.role, ranks });
        }
        // The last rank's listeners must fit in 16 bits, or dials would be unaddressable.
        let last = i64::from(layout.ranks()) - 1;
        ranged(&reg, "handshake_port", reg.handshake_port + last, 1, 65535)?;
        ranged(&reg, "notify_port", reg.notify_port + last, 1, 65535)?;
        let address = EngineAddress {
            host: reg.host.clone(),
            handshake_port_base: handshake,
            notify_port_base: notify,
        };
        let id = EngineId { role: reg.role, index: side.len() as u16 };
        side.push((reg, layout, address));
        Ok(id)
    }

    /// The deployment once at least one engine of each role registered.
    pub fn deployment(&self, model: ModelSpec) -> Option<Deployment> {
        if self.prefill.is_empty() || self.decode.is_empty() {
            return None;
        }
        Some(Deployment {
            prefill: self.prefill.iter().map(|(_, l, _)| *l).collect(),
            decode: self.decode.iter().map(|(_, l, _)| *l).collect(),
            model,
        })
    }

    /// Host and port bases of every registered engine, indexed like the engines of
    /// [`Registry::deployment`].
    pub fn address_book(&self) -> AddressBook {
        AddressBook {
            prefill: self.prefill.iter().map(|(_, _, a)| a.clone()).collect(),
            decode: self.decode.iter().map(|(_, _, a)| a.clone()).collect(),
            rules: crate::policy::PeerBook::pdkv(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(role: Role, http: &str, dp: i64, tp: i64, mode: TransferMode) -> Registration {
        Registration {
            role,
            http_address: http.into(),
            host: http.split(':').next().unwrap_or_default().into(),
            handshake_port: 6301,
            notify_port: 61005,
            dp_size: dp,
            tp_size: tp,
            ep: dp > 1,
            transfer_mode: mode,
        }
    }

    #[test]
    fn registrations_build_the_deployment_and_address_book() {
        let mut registry = Registry::new(TransferMode::Read);
        assert_eq!(
            registry.handle_register(reg(Role::Prefill, "p0:8100", 1, 8, TransferMode::Read)),
            Ok(EngineId::prefill(0))
        );
        assert_eq!(registry.deployment(ModelSpec::default()), None, "no decode engine yet");
        assert_eq!(
            registry.handle_register(reg(Role::Prefill, "p1:8100", 1, 8, TransferMode::Read)),
            Ok(EngineId::prefill(1))
        );
        assert_eq!(
            registry.handle_register(reg(Role::Decode, "d0:8200", 8, 1, TransferMode::Read)),
            Ok(EngineId::decode(0))
        );
        let deployment = registry.deployment(ModelSpec::default()).unwrap();
        assert_eq!(deployment.notation(), "2P_TP8:1D_DP8EP");
        assert_eq!(registry.address_book().engine_id(EngineId::prefill(1)), "p1:6301");
    }

    /// (registration) -> the error it gets.
    #[test]
    fn rejected_registrations_table() {
        let check = |r: Registration, expected: RegistrationError, text: &str| {
            let mut registry = Registry::new(TransferMode::Read);
            registry.handle_register(reg(Role::Decode, "taken:1", 1, 8, TransferMode::Read)).unwrap();
            let err = registry.handle_register(r).unwrap_err();
            assert_eq!(err, expected);
            assert!(err.to_string().contains(text), "{err}");
        };
        check(
            reg(Role::Prefill, "p:1", 1, 8, TransferMode::Write),
            RegistrationError::ModeMismatch {
                http_address: "p:1".into(),
                proxy: TransferMode::Read,
                engine: TransferMode::Write,
            },
            "transfer mode write but the proxy runs read",
        );
        let out = |field, value, min, max| RegistrationError::OutOfRange {
            http_address: "p:1".into(),
            field,
            value,
            min,
            max,
        };
        check(reg(Role::Prefill, "p:1", 0, 8, TransferMode::Read), out("dp_size", 0, 1, 256), "dp_size = 0");
        check(
            reg(Role::Prefill, "p:1", 1, -8, TransferMode::Read),
            out("tp_size", -8, 1, 256),
            "tp_size = -8",
        );
        let mut bad_port = reg(Role::Prefill, "p:1", 1, 8, TransferMode::Read);
        bad_port.notify_port = 70000;
        check(bad_port, out("notify_port", 70000, 1, 65535), "notify_port = 70000");
        let mut high = reg(Role::Prefill, "p:1", 1, 8, TransferMode::Read);
        high.notify_port = 65530;
        check(high, out("notify_port", 65537, 1, 65535), "notify_port = 65537");
        check(
            reg(Role::Prefill, "taken:1", 1, 8, TransferMode::Read),
            RegistrationError::Duplicate { http_address: "taken:1".into() },
            "registered already",
        );
    }

    /// Limit errors name the role in words, not as Rust's variant name.
    #[test]
    fn limit_errors_name_the_role_in_words() {
        let check = |err: RegistrationError, expected: String| assert_eq!(err.to_string(), expected);
        check(
            RegistrationError::TooManyRanks { role: Role::Decode, ranks: MAX_RANKS_PER_ROLE + 1 },
            format!(
                "the decode side would have {} GPUs, more than {MAX_RANKS_PER_ROLE}",
                MAX_RANKS_PER_ROLE + 1
            ),
        );
        check(
            RegistrationError::TooManyEngines { role: Role::Prefill },
            format!("more than {MAX_ENGINES_PER_ROLE} prefill engines"),
        );
    }
}
