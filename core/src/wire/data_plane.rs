//! pdkv's data-plane descriptor: what a pdkv prefill rank puts in its handshake metadata's
//! `agent_metadata`, where MoRIIO puts a packed MoRI `EngineDesc`, and the reading of a peer's,
//! which tells a foreign data plane apart from a pdkv one and says so.
//!
//! The descriptor is a MessagePack map whose first key, `pdkv`, holds the format's version:
//! `{"pdkv": 1, "transport": "tcp" | "rdma", "addr": "host:port"}`. A MoRI `EngineDesc` is packed
//! by msgpack-c's `MSGPACK_DEFINE(key, gpuId, hostname, backends, tcpHandle)`, that is as a
//! MessagePack array whose first element is the engine key (a str), never a map; so the two
//! cannot be mistaken for each other, and neither can an empty or non-MessagePack blob.

use std::fmt;

use serde::Serialize;

use super::error::WireError;
use super::fields::{Fields, U32_MAX};
use super::msgpack::{check_size, named, parse_whole, Value};
use crate::ids::RankId;
use crate::ports::Endpoint;

/// The descriptor format this pdkv writes and reads (the `pdkv` key).
pub const DATA_PLANE_VERSION: u32 = 1;

/// How a pdkv rank's KV is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataTransport {
    /// pdkv's TCP read server.
    Tcp,
    /// RDMA READ over verbs, queue pairs exchanged at the address.
    Rdma,
}

impl DataTransport {
    /// The name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            DataTransport::Tcp => "tcp",
            DataTransport::Rdma => "rdma",
        }
    }
}

impl fmt::Display for DataTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A pdkv rank's data plane, from its `agent_metadata`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DataPlane {
    /// How to read it.
    pub transport: DataTransport,
    /// Where its data-plane server listens (for RDMA, the queue-pair exchange).
    pub addr: Endpoint,
}

/// What a blob that is not a pdkv descriptor looks like, for the error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ForeignKind {
    /// Nothing at all.
    Empty,
    /// A MessagePack array starting with a str: how msgpack-c packs a MoRI `EngineDesc`.
    MoriEngineDesc,
    /// A MessagePack map without the `pdkv` key (an older pdkv wrote `{transport, addr}`).
    MapWithoutPdkvKey,
    /// Some other whole MessagePack value, of this kind.
    MessagePack(&'static str),
    /// Not one whole MessagePack value.
    NotMessagePack,
}

impl fmt::Display for ForeignKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForeignKind::Empty => f.write_str("empty"),
            ForeignKind::MoriEngineDesc => f.write_str("looks like a MoRI EngineDesc"),
            ForeignKind::MapWithoutPdkvKey => f.write_str("a MessagePack map without a `pdkv` key"),
            ForeignKind::MessagePack(kind) => write!(f, "a MessagePack {kind}"),
            ForeignKind::NotMessagePack => f.write_str("not MessagePack"),
        }
    }
}

/// Why a peer's `agent_metadata` is not a data plane this pdkv can read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataPlaneError {
    /// Not a pdkv descriptor at all: another implementation's data plane (MoRIIO's).
    Foreign {
        /// What it looks like.
        kind: ForeignKind,
        /// Its length in bytes.
        len: usize,
    },
    /// A pdkv descriptor of a format version this pdkv does not read.
    Version {
        /// The version it carries.
        version: i128,
    },
    /// A pdkv descriptor naming a transport this pdkv does not know.
    Transport {
        /// The name it carries.
        name: String,
    },
    /// A pdkv descriptor whose address is not `host:port`.
    Address {
        /// The address it carries.
        addr: String,
    },
    /// A pdkv descriptor with a missing or malformed field.
    Malformed(WireError),
}

impl fmt::Display for DataPlaneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataPlaneError::Foreign { kind, len } => write!(f, "not a pdkv descriptor: {kind}, {len} bytes"),
            DataPlaneError::Version { version } => {
                write!(f, "pdkv descriptor version {version}; this pdkv reads version {DATA_PLANE_VERSION}")
            }
            DataPlaneError::Transport { name } => {
                write!(f, "pdkv descriptor with unknown transport `{name}`")
            }
            DataPlaneError::Address { addr } => {
                write!(f, "pdkv descriptor whose address `{addr}` is not host:port")
            }
            DataPlaneError::Malformed(e) => write!(f, "malformed pdkv descriptor: {e}"),
        }
    }
}

impl std::error::Error for DataPlaneError {}

/// A peer rank whose handshake metadata advertises a data plane this pdkv cannot read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignDataPlane {
    /// The rank dialled.
    pub peer: RankId,
    /// Why its `agent_metadata` is of no use.
    pub error: DataPlaneError,
}

impl fmt::Display for ForeignDataPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} advertises a data plane pdkv cannot use ({}); pdkv reads over tcp/rdma descriptors",
            self.peer, self.error
        )
    }
}

impl std::error::Error for ForeignDataPlane {}

#[derive(Serialize)]
struct DataPlaneWire<'a> {
    pdkv: u32,
    transport: &'static str,
    addr: &'a str,
}

impl DataPlane {
    /// The bytes for `agent_metadata`.
    pub fn encode(&self) -> Vec<u8> {
        let addr = self.addr.to_string();
        named(&DataPlaneWire { pdkv: DATA_PLANE_VERSION, transport: self.transport.name(), addr: &addr })
    }

    /// Reads the `agent_metadata` of rank `peer`; the error names the peer and says why its data
    /// plane is of no use.
    pub fn decode(peer: RankId, bytes: &[u8]) -> Result<DataPlane, ForeignDataPlane> {
        read(bytes).map_err(|error| ForeignDataPlane { peer, error })
    }
}

fn read(bytes: &[u8]) -> Result<DataPlane, DataPlaneError> {
    let len = bytes.len();
    let foreign = |kind| DataPlaneError::Foreign { kind, len };
    if bytes.is_empty() {
        return Err(foreign(ForeignKind::Empty));
    }
    // A blob over the wire's size limit is nobody's descriptor either.
    let value = check_size(bytes).and_then(|()| parse_whole(bytes));
    let entries = match value {
        Ok(Value::Map(entries)) => entries,
        Ok(Value::Array(items)) if matches!(items.first(), Some(Value::Str(_))) => {
            return Err(foreign(ForeignKind::MoriEngineDesc))
        }
        Ok(other) => return Err(foreign(ForeignKind::MessagePack(other.kind()))),
        Err(_) => return Err(foreign(ForeignKind::NotMessagePack)),
    };
    let mut f = Fields::from_entries(entries).map_err(DataPlaneError::Malformed)?;
    if !f.has("pdkv") {
        return Err(foreign(ForeignKind::MapWithoutPdkvKey));
    }
    let version = f.int("pdkv", 0, U32_MAX).map_err(DataPlaneError::Malformed)?;
    if version != i128::from(DATA_PLANE_VERSION) {
        return Err(DataPlaneError::Version { version });
    }
    let transport = match f.str("transport").map_err(DataPlaneError::Malformed)?.as_str() {
        "tcp" => DataTransport::Tcp,
        "rdma" => DataTransport::Rdma,
        other => return Err(DataPlaneError::Transport { name: other.to_owned() }),
    };
    let addr = f.str("addr").map_err(DataPlaneError::Malformed)?;
    let endpoint = addr
        .rsplit_once(':')
        .filter(|(host, _)| !host.is_empty())
        .and_then(|(host, port)| Some(Endpoint { host: host.to_owned(), port: port.parse().ok()? }));
    match endpoint {
        Some(addr) => Ok(DataPlane { transport, addr }),
        None => Err(DataPlaneError::Address { addr }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::EngineId;

    fn peer() -> RankId {
        RankId::new(EngineId::prefill(0), 0, 1)
    }

    fn pack<T: Serialize>(value: &T) -> Vec<u8> {
        rmp_serde::to_vec(value).expect("packs")
    }

    /// What msgpack-c's `MSGPACK_DEFINE(key, gpuId, hostname, backends, tcpHandle)` makes of a
    /// MoRI `EngineDesc`: an array, the engine key first.
    fn mori_engine_desc() -> Vec<u8> {
        pack(&("mori-engine-P0-tp1", 1, "node-3", (3u64,), ("10.0.0.3", 47123)))
    }

    #[test]
    fn a_pdkv_descriptor_round_trips_with_exact_bytes() {
        let plane = DataPlane {
            transport: DataTransport::Rdma,
            addr: Endpoint { host: "10.0.0.3".into(), port: 7000 },
        };
        let bytes = plane.encode();
        let mut expected = b"\x83\xa4pdkv\x01\xa9transport\xa4rdma\xa4addr\xad".to_vec();
        expected.extend(b"10.0.0.3:7000");
        assert_eq!(bytes, expected);
        assert_eq!(DataPlane::decode(peer(), &bytes), Ok(plane));
    }

    #[test]
    fn anything_else_is_a_typed_error_naming_the_peer() {
        use DataPlaneError as E;
        let foreign = |kind, len| E::Foreign { kind, len };
        let mori = mori_engine_desc();
        let old_pdkv = pack(&std::collections::BTreeMap::from([("addr", "h:1"), ("transport", "tcp")]));
        let map = |entries: &[(&str, &str)]| {
            let mut bytes = vec![0x80 | entries.len() as u8];
            for (k, v) in entries {
                bytes.extend(pack(k));
                bytes.extend(pack(v));
            }
            bytes
        };
        let with_version = |v: u32, transport: &str, addr: &str| {
            rmp_serde::to_vec_named(&DataPlaneWire {
                pdkv: v,
                transport: if transport == "tcp" { "tcp" } else { "udp" },
                addr,
            })
            .expect("packs")
        };
        let cases: Vec<(Vec<u8>, DataPlaneError)> = vec![
            (vec![], foreign(ForeignKind::Empty, 0)),
            (mori.clone(), foreign(ForeignKind::MoriEngineDesc, mori.len())),
            (old_pdkv.clone(), foreign(ForeignKind::MapWithoutPdkvKey, old_pdkv.len())),
            // Text is a run of MessagePack fixints, not one whole value.
            (b"mori-engine-desc".to_vec(), foreign(ForeignKind::NotMessagePack, 16)),
            (vec![0x05], foreign(ForeignKind::MessagePack("int"), 1)),
            (vec![0xc1, 0x00], foreign(ForeignKind::NotMessagePack, 2)),
            (vec![0x93, 0x01, 0x02, 0x03], foreign(ForeignKind::MessagePack("array"), 4)),
            (with_version(2, "tcp", "h:1"), E::Version { version: 2 }),
            (with_version(1, "udp", "h:1"), E::Transport { name: "udp".into() }),
            (with_version(1, "tcp", "h"), E::Address { addr: "h".into() }),
            (with_version(1, "tcp", ":80"), E::Address { addr: ":80".into() }),
            (with_version(1, "tcp", "h:99999"), E::Address { addr: "h:99999".into() }),
            (
                map(&[("pdkv", "1")]),
                E::Malformed(WireError::WrongType { field: "pdkv", expected: "int", found: "str" }),
            ),
        ];
        for (bytes, error) in cases {
            assert_eq!(
                DataPlane::decode(peer(), &bytes),
                Err(ForeignDataPlane { peer: peer(), error: error.clone() }),
                "{bytes:02x?}"
            );
        }
    }

    #[test]
    fn the_error_says_whose_data_plane_and_why() {
        let mori = mori_engine_desc();
        let error = DataPlane::decode(peer(), &mori).expect_err("a MoRI EngineDesc");
        assert_eq!(
            error.to_string(),
            format!(
                "P0.dp0.tp1 advertises a data plane pdkv cannot use (not a pdkv descriptor: looks like \
                 a MoRI EngineDesc, {} bytes); pdkv reads over tcp/rdma descriptors",
                mori.len()
            )
        );
    }
}
