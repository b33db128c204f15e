//! The handshake socket's reply: MoRIIO's agent metadata with pdkv's optional ranks (the first
//! reply message's payload) and the per-layer memory descriptors (the second's), with their wire
//! mirrors and decoders. The request is the raw bytes
//! [`HANDSHAKE_REQUEST`](super::HANDSHAKE_REQUEST); how the parts sit in frames is `framing`'s.

use std::collections::BTreeSet;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use super::error::WireError;
use super::fields::{blob, group, narrow, opt_incarnation, string, Fields, U16_MAX, U32_MAX, U64_MAX};
use super::limits::{MAX_DESCS_PER_LAYER, MAX_EXTENSIONS, MAX_LAYERS, MAX_REGIONS};
use super::msgpack::{check_size, named, parse_whole, Value};
use crate::ids::Incarnation;

/// A message or rule of pdkv's beyond MoRIIO's protocol. A rank uses one with a peer only when
/// the peer advertised it in its handshake metadata, because MoRIIO's listeners raise on a
/// message they do not know, and the exception ends the listener thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Extension {
    /// The rank takes read leases on its notify socket (`{"type": "read_lease", ...}`) and its
    /// reaper waits for them.
    ReadLease,
    /// The rank names its incarnation in its handshake metadata and its engine names the
    /// holding incarnations in its prefill answers (`pdkv_incarnation`, `pdkv_incarnations`); it
    /// ignores releases, leases and reads that name another incarnation of it, so a decode rank
    /// names the incarnation (`pdkv_incarnation`) in what it sends the rank.
    Incarnation,
    /// The rank holds the deployment's control key and checks the MAC (`pdkv_mac`) of the
    /// releases and leases it is sent ([`crate::auth`]), so a decode rank with the key MACs what
    /// it sends the rank.
    Auth,
}

impl Extension {
    /// Every extension this pdkv knows, in wire order.
    pub const ALL: [Extension; 3] = [Extension::ReadLease, Extension::Incarnation, Extension::Auth];

    /// The extension's name in `pdkv_extensions`.
    pub fn wire_name(self) -> &'static str {
        match self {
            Extension::ReadLease => "read_lease",
            Extension::Incarnation => "incarnation",
            Extension::Auth => "auth",
        }
    }

    /// The extension a name in `pdkv_extensions` stands for, if this pdkv knows it.
    pub fn from_wire_name(name: &str) -> Option<Extension> {
        Extension::ALL.into_iter().find(|e| e.wire_name() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// The extensions a rank advertises (`pdkv_extensions` in its handshake metadata): a set.
/// A MoRIIO rank sends no such key, which reads as [`Extensions::NONE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Extensions(u8);

impl Extensions {
    /// No extension: MoRIIO's protocol only.
    pub const NONE: Extensions = Extensions(0);
    /// The extensions every pdkv rank advertises; one that holds the deployment's control key
    /// adds [`Extension::Auth`].
    pub const ALL: Extensions = Extensions(0b11);

    /// Whether `extension` is in the set.
    pub fn has(self, extension: Extension) -> bool {
        self.0 & extension.bit() != 0
    }

    /// The set without `extension`.
    pub fn without(self, extension: Extension) -> Extensions {
        Extensions(self.0 & !extension.bit())
    }

    /// The set with `extension` added.
    pub fn with(self, extension: Extension) -> Extensions {
        Extensions(self.0 | extension.bit())
    }

    /// The extensions in the set, in wire order.
    pub fn iter(self) -> impl Iterator<Item = Extension> {
        Extension::ALL.into_iter().filter(move |e| self.has(*e))
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// Where a rank sits in its engine: pdkv's optional extension of the handshake metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankInfo {
    /// The rank's DP rank in its engine.
    pub dp_rank: u16,
    /// The rank's TP rank in its DP group; always below `tp_size`.
    pub tp_rank: u16,
    /// TP size of the rank's engine, at least 1.
    pub tp_size: u16,
}

/// The first handshake reply payload: MoRIIO's `MoRIIOAgentMetadata`, plus pdkv's ranks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HandshakeMetadata {
    /// `"<host>:<handshake port base>"`.
    pub engine_id: String,
    /// The rank's data-plane descriptor, opaque here (MessagePack bin): a packed MoRI
    /// `EngineDesc` from MoRIIO, a [`DataPlane`](super::DataPlane) from pdkv.
    pub agent_metadata: Vec<u8>,
    /// Device address of each registered memory region.
    pub kv_caches_base_addr: Vec<u64>,
    /// Blocks in the rank's KV pool, at least 1.
    pub num_blocks: u32,
    /// Bytes per block, at least 1.
    pub block_len: u64,
    /// vLLM's attention backend on the rank (e.g. `FLASHMLA`), which decides the KV layout.
    pub attn_backend_name: String,
    /// `dp_rank`, `tp_rank`, `tp_size`: sent by pdkv, absent from MoRIIO.
    pub rank: Option<RankInfo>,
    /// `pdkv_extensions`: what the rank speaks beyond MoRIIO's protocol; sent by pdkv (when not
    /// empty), absent from MoRIIO.
    pub extensions: Extensions,
    /// `pdkv_incarnation`: the answering rank's incarnation, sent by pdkv, absent from MoRIIO.
    pub incarnation: Option<Incarnation>,
}

/// One entry of the second handshake reply payload: a layer and its packed MoRI memory
/// descriptors.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayerMemoryDesc {
    /// vLLM's name of the attention layer, e.g. `model.layers.0.self_attn.attn`.
    pub layer_name: String,
    /// Opaque blobs (MessagePack bin), at least one.
    pub descs: Vec<Vec<u8>>,
}

/// A byte slice that serializes as MessagePack bin rather than as an array of integers.
pub(super) struct Bin<'a>(pub(super) &'a [u8]);

impl Serialize for Bin<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

/// A list of blobs, each as bin.
struct BinList<'a>(&'a [Vec<u8>]);

impl Serialize for BinList<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for blob in self.0 {
            seq.serialize_element(&Bin(blob))?;
        }
        seq.end()
    }
}

/// The per-layer descriptor map, in the caller's layer order.
struct LayerMap<'a>(&'a [LayerMemoryDesc]);

impl Serialize for LayerMap<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for layer in self.0 {
            map.serialize_entry(&layer.layer_name, &BinList(&layer.descs))?;
        }
        map.end()
    }
}

#[derive(Serialize)]
pub(super) struct MetadataWire<'a> {
    pub(super) engine_id: &'a str,
    pub(super) agent_metadata: Bin<'a>,
    pub(super) kv_caches_base_addr: &'a [u64],
    pub(super) num_blocks: u32,
    pub(super) block_len: u64,
    pub(super) attn_backend_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) dp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tp_size: Option<u16>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) pdkv_extensions: Vec<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pdkv_incarnation: Option<u64>,
}

/// Encodes the second handshake reply payload: `{layer_name: [descriptor, ...]}` in the given
/// order.
pub fn encode_layer_memory_descs(layers: &[LayerMemoryDesc]) -> Vec<u8> {
    named(&LayerMap(layers))
}

pub(super) fn metadata(mut f: Fields) -> Result<HandshakeMetadata, WireError> {
    let engine_id = f.str("engine_id")?;
    let agent_metadata = blob("agent_metadata", f.required("agent_metadata")?)?;
    let kv_caches_base_addr =
        f.int_list("kv_caches_base_addr", MAX_REGIONS, 0, U64_MAX)?.into_iter().map(narrow).collect();
    let num_blocks = narrow(f.int("num_blocks", 1, U32_MAX)?);
    let block_len = narrow(f.int("block_len", 1, U64_MAX)?);
    let attn_backend_name = f.str("attn_backend_name")?;
    let rank = group(
        "rank",
        ["dp_rank", "tp_rank", "tp_size"],
        (
            f.opt_int("dp_rank", 0, U16_MAX)?,
            f.opt_int("tp_rank", 0, U16_MAX)?,
            f.opt_int("tp_size", 1, U16_MAX)?,
        ),
    )?
    .map(|(dp, tp, size)| RankInfo { dp_rank: narrow(dp), tp_rank: narrow(tp), tp_size: narrow(size) });
    if let Some(r) = rank {
        if r.tp_rank >= r.tp_size {
            return Err(WireError::RankOutOfGroup { field: "tp_rank", rank: r.tp_rank, size: r.tp_size });
        }
    }
    // A newer pdkv may advertise extensions this one does not know: they are not used, as they
    // would not be with a peer that never advertised them.
    let extensions = f
        .opt_str_list("pdkv_extensions", MAX_EXTENSIONS)?
        .unwrap_or_default()
        .iter()
        .filter_map(|name| Extension::from_wire_name(name))
        .fold(Extensions::NONE, Extensions::with);
    let incarnation = opt_incarnation(&mut f)?;
    Ok(HandshakeMetadata {
        engine_id,
        agent_metadata,
        kv_caches_base_addr,
        num_blocks,
        block_len,
        attn_backend_name,
        rank,
        extensions,
        incarnation,
    })
}

/// Decodes the second handshake reply payload, `{layer_name: [descriptor, ...]}`, keeping the
/// peer's layer order (MoRIIO opens one session per layer in that order).
pub fn decode_layer_memory_descs(bytes: &[u8]) -> Result<Vec<LayerMemoryDesc>, WireError> {
    const FIELD: &str = "layer memory descriptors";
    check_size(bytes)?;
    let entries = match parse_whole(bytes)? {
        Value::Map(entries) => entries,
        other => return Err(WireError::WrongType { field: FIELD, expected: "map", found: other.kind() }),
    };
    if entries.is_empty() {
        return Err(WireError::EmptyField { field: FIELD });
    }
    if entries.len() > MAX_LAYERS {
        return Err(WireError::TooMany { field: FIELD, len: entries.len(), max: MAX_LAYERS });
    }
    let mut seen = BTreeSet::new();
    let mut layers = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        let layer_name = string("layer name", key)?;
        if !seen.insert(layer_name.clone()) {
            return Err(WireError::DuplicateKey { key: layer_name });
        }
        let items = match value {
            Value::Array(items) => items,
            other => {
                return Err(WireError::WrongType { field: FIELD, expected: "array", found: other.kind() })
            }
        };
        if items.is_empty() {
            return Err(WireError::EmptyField { field: FIELD });
        }
        if items.len() > MAX_DESCS_PER_LAYER {
            return Err(WireError::TooMany { field: FIELD, len: items.len(), max: MAX_DESCS_PER_LAYER });
        }
        let descs = items.into_iter().map(|v| blob(FIELD, v)).collect::<Result<_, _>>()?;
        layers.push(LayerMemoryDesc { layer_name, descs });
    }
    Ok(layers)
}
