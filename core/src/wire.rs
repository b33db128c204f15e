//! MoRIIO's control messages on the wire: typed values, their MessagePack encoding, strict decoding.
//!
//! The shapes follow vLLM's MoRIIO connector (READ mode), read from
//! `vllm/distributed/kv_transfer/kv_connector/v1/moriio/{moriio_connector,moriio_engine,moriio_common}.py`.
//! Every structured message is one ZMQ frame holding a MessagePack map with string keys, packed
//! by Python's `msgpack.dumps` (or msgspec for the handshake metadata); the key order below is
//! the order MoRIIO inserts them, and [`encode`] reproduces those bytes exactly.
//!
//! Notify socket (one listener per rank, `notify_port + dp * T + tp`):
//!
//! | message | keys, in wire order |
//! |---|---|
//! | release (decode → prefill) | `type: "release"`, `transfer_id: str`, `consumer_tp_size: int` |
//! | legacy completion | not MessagePack: the raw UTF-8 bytes of the transfer id |
//! | remote_blocks (WRITE mode) | `req_id: str`, `transfer_id: str`, `block_notify_list: [int]`, `decode_rank: int`, `type: "remote_blocks"` |
//! | write_done (WRITE mode) | `type: "write_done"`, `transfer_id: str` |
//!
//! pdkv appends three optional keys to a release, `sender_engine_id: str`, `sender_dp_rank: int`
//! and `sender_tp_rank: int` (names chosen by pdkv; MoRIIO has no such keys), all three or none.
//! MoRIIO reads a release with `data["transfer_id"]` and `consumer_tp_size`, so it ignores them.
//!
//! Handshake socket (`handshake_port + dp * T + tp`): the request is the raw bytes
//! `get_meta_msg` (again not MessagePack), and the reply is two frames. The first is MoRIIO's
//! `MoRIIOAgentMetadata`: `engine_id: str`, `agent_metadata: bin` (a packed MoRI `EngineDesc`),
//! `kv_caches_base_addr: [int]`, `num_blocks: int`, `block_len: int` (bytes per block),
//! `attn_backend_name: str`; pdkv appends `dp_rank`, `tp_rank` and `tp_size` (its own names,
//! all three or none; msgspec's decoder skips unknown keys). The second frame maps each layer
//! name to a list of packed MoRI `MemoryDesc` blobs; it carries no discriminating key, so it
//! has its own pair of functions, [`encode_layer_memory_descs`] and [`decode_layer_memory_descs`].
//!
//! How [`decode`] tells the forms apart, from the first byte, mirroring MoRIIO's own listener
//! (which tries `msgpack.loads` and falls back to decoding the bytes as UTF-8):
//! - exactly `get_meta_msg` is the handshake request;
//! - a MessagePack map marker starts a structured message, chosen by its `type`; a map without
//!   `type` is `remote_blocks` when it has `req_id` (older MoRIIO, and what MoRIIO itself infers)
//!   and handshake metadata when it has `engine_id`;
//! - a first byte below 0x80 starts a legacy plain-string completion, the whole input being the
//!   transfer id; MoRIIO's ids (`tx-…`, `cmpl-…`) always start with ASCII;
//! - a MessagePack str is also accepted as a legacy completion (MoRIIO never sends one; pdkv
//!   tolerates it), but encoding a legacy completion always gives the raw bytes;
//! - anything else is [`WireError::Unrecognized`].
//!
//! Decoding is strict and total: any input gives a message or a typed [`WireError`], never a
//! panic, and allocations are bounded by the input, itself limited to [`MAX_MESSAGE_BYTES`].
//! Unknown map keys are ignored (a newer MoRIIO may add keys), but their values must still be
//! well-formed MessagePack within the same limits. A release map without `consumer_tp_size`
//! (what MoRIIO's `send_notify(..., message_type="release")` builds without extra fields, as
//! earlier versions did) is accepted with `consumer_tp_size: None`, which MoRIIO counts as one
//! release, the same as the legacy string; a `remote_blocks` without `decode_rank` means DP
//! rank 0, as in MoRIIO. Those older forms decode, but re-encode in the current shape.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use crate::ids::TransferId;
use crate::release::{Release, ReleaseSender};

/// Largest input [`decode`] looks at; a MoRIIO control frame is a few hundred bytes, and the
/// largest legitimate one (a `remote_blocks` of a very long prompt) stays well below this.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Deepest nesting of MessagePack containers, counting the message map itself.
pub const MAX_DEPTH: usize = 32;
/// Most MessagePack values (scalars and containers) in one message.
pub const MAX_VALUES: usize = 1 << 18;
/// Longest string field: transfer, request and engine ids, message types, backend and layer names.
pub const MAX_STR_BYTES: usize = 1024;
/// Most block ids in one `remote_blocks` (two million tokens at 16 tokens per block).
pub const MAX_BLOCK_IDS: usize = 1 << 17;
/// Most memory regions (`kv_caches_base_addr` entries) in handshake metadata.
pub const MAX_REGIONS: usize = 4096;
/// Most layers in the per-layer memory descriptors.
pub const MAX_LAYERS: usize = 1024;
/// Most memory descriptors of one layer (MoRIIO registers one tensor per layer).
pub const MAX_DESCS_PER_LAYER: usize = 16;
/// Largest opaque MoRI blob (`agent_metadata`, or one memory descriptor).
pub const MAX_BLOB_BYTES: usize = 64 * 1024;
/// The handshake request, sent as raw bytes (MoRIIO's `GET_META_MSG`).
pub const HANDSHAKE_REQUEST: &[u8] = b"get_meta_msg";

/// A decode rank's notice of which of its blocks a prefill rank should write into (WRITE mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteBlocks {
    /// vLLM's request id on the decode side (`req_id` on the wire).
    pub req_id: String,
    /// The transfer the blocks are for.
    pub transfer_id: TransferId,
    /// Decode-side block ids (`block_notify_list`), never empty.
    pub block_ids: Vec<u32>,
    /// The decode DP rank, global across pods (`decode_rank`).
    pub decode_dp_rank: u16,
}

/// A prefill rank's notice that all its writes of a transfer landed (WRITE mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteDone {
    /// The transfer whose writes landed.
    pub transfer_id: TransferId,
}

/// A decode rank's promise that its reads of a transfer end within `lease_ms` (pdkv's own
/// message, `{"type": "read_lease", "transfer_id", "lease_ms"}`; a MoRIIO peer never sends it and
/// is never sent it). The producer's reaper does not free the transfer's blocks before the lease
/// ends, because a read may still be in flight until then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadLease {
    /// The transfer about to be read.
    pub transfer_id: TransferId,
    /// How long the reads may last, from when the lease is sent, in milliseconds (at least 1).
    pub lease_ms: u32,
}

/// Where a rank sits in its engine: pdkv's optional extension of the handshake metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank's DP rank in its engine.
    pub dp_rank: u16,
    /// The rank's TP rank in its DP group; always below `tp_size`.
    pub tp_rank: u16,
    /// TP size of the rank's engine, at least 1.
    pub tp_size: u16,
}

/// The first frame of the handshake reply: MoRIIO's `MoRIIOAgentMetadata`, plus pdkv's ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandshakeMetadata {
    /// `"<host>:<handshake port base>"`.
    pub engine_id: String,
    /// Packed MoRI `EngineDesc`, opaque here (MessagePack bin).
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
}

/// One entry of the second handshake reply frame: a layer and its packed MoRI memory descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerMemoryDesc {
    /// vLLM's name of the attention layer, e.g. `model.layers.0.self_attn.attn`.
    pub layer_name: String,
    /// Opaque blobs (MessagePack bin), at least one.
    pub descs: Vec<Vec<u8>>,
}

/// A control message on a MoRIIO notify or handshake socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlMessage {
    /// A structured release map (`consumer_tp_size` is `None` when an older peer left it out).
    Release(Release),
    /// The legacy plain-string completion: one release for this transfer id when a prefill rank
    /// receives it (a decode rank in WRITE mode reads the same bytes as a write completion).
    /// Kept apart from [`ControlMessage::Release`] because its wire form differs;
    /// [`ControlMessage::as_release`] gives the ledger's view of both.
    LegacyCompletion(TransferId),
    /// WRITE mode, decode to prefill: which decode blocks to write the transfer into.
    RemoteBlocks(RemoteBlocks),
    /// WRITE mode, prefill to decode: the writes of a transfer landed.
    WriteDone(WriteDone),
    /// pdkv's read lease (decode → prefill, notify socket): the decode rank is about to read.
    ReadLease(ReadLease),
    /// `get_meta_msg`: asks a rank for its [`HandshakeMetadata`].
    HandshakeRequest,
    /// The first frame of the reply to [`ControlMessage::HandshakeRequest`].
    HandshakeMetadata(HandshakeMetadata),
}

impl ControlMessage {
    /// The release this message stands for: the map form as it is, the legacy string as a
    /// release without TP size or sender; `None` for every other message.
    pub fn as_release(&self) -> Option<Release> {
        match self {
            ControlMessage::Release(release) => Some(release.clone()),
            ControlMessage::LegacyCompletion(id) => {
                Some(Release { transfer_id: id.clone(), consumer_tp_size: None, sender: None })
            }
            _ => None,
        }
    }
}

/// Why bytes are not a valid control message. Field names are the wire keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Zero bytes: MoRIIO rejects an empty frame too.
    Empty,
    /// The input is longer than [`MAX_MESSAGE_BYTES`]; nothing of it is parsed.
    TooLarge {
        /// The input's length in bytes.
        len: usize,
        /// The limit, [`MAX_MESSAGE_BYTES`].
        max: usize,
    },
    /// The input ends inside the MessagePack value that starts at `offset`, or a declared length
    /// or element count runs past the end.
    Truncated {
        /// Byte offset where the unfinished value starts.
        offset: usize,
    },
    /// One whole value ends at `offset` but the input is `len` bytes long.
    TrailingBytes {
        /// Byte offset just past the value.
        offset: usize,
        /// The input's length in bytes.
        len: usize,
    },
    /// The never-used MessagePack marker 0xc1.
    ReservedMarker {
        /// Byte offset of the marker.
        offset: usize,
    },
    /// Containers nest deeper than [`MAX_DEPTH`], counting the message map.
    TooDeep {
        /// The limit, [`MAX_DEPTH`].
        max: usize,
    },
    /// The input holds more than [`MAX_VALUES`] MessagePack values.
    TooManyValues {
        /// The limit, [`MAX_VALUES`].
        max: usize,
    },
    /// The first byte starts neither a map, a str, nor an ASCII plain-string completion.
    Unrecognized {
        /// The input's first byte.
        first_byte: u8,
    },
    /// A str that must be text is not UTF-8.
    InvalidUtf8 {
        /// The wire key; `map key` or `layer name` for a key; `transfer_id` for a plain-string
        /// completion.
        field: &'static str,
    },
    /// A key appears twice in one map (a message, or the per-layer descriptor map).
    DuplicateKey {
        /// The repeated key.
        key: String,
    },
    /// `type` names a message pdkv does not know.
    UnknownType {
        /// The `type` value received.
        type_name: String,
    },
    /// A required key is absent; `type` when a map has none of `type`, `req_id` and `engine_id`.
    MissingField {
        /// The missing key.
        field: &'static str,
    },
    /// A value of the wrong MessagePack kind.
    WrongType {
        /// The wire key, or `message`, `map key`, `layer name` or `layer memory descriptors`.
        field: &'static str,
        /// The kind wanted: `str`, `int`, `bin`, `array` or `map`.
        expected: &'static str,
        /// The kind received, e.g. `nil` or `str (not UTF-8)`.
        found: &'static str,
    },
    /// An integer outside the range its field allows (a size of 0, a negative block id, ...).
    OutOfRange {
        /// The wire key.
        field: &'static str,
        /// The value received.
        value: i128,
        /// Smallest accepted value.
        min: i128,
        /// Largest accepted value.
        max: i128,
    },
    /// A string, list or map that must not be empty is empty.
    EmptyField {
        /// The wire key, or `layer memory descriptors`.
        field: &'static str,
    },
    /// A string over [`MAX_STR_BYTES`] or a blob over [`MAX_BLOB_BYTES`].
    TooLong {
        /// The wire key, or `layer memory descriptors` for a descriptor blob.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit that applies.
        max: usize,
    },
    /// A list or map with more entries than its limit ([`MAX_BLOCK_IDS`], [`MAX_REGIONS`],
    /// [`MAX_LAYERS`] or [`MAX_DESCS_PER_LAYER`]).
    TooMany {
        /// The wire key, or `layer memory descriptors`.
        field: &'static str,
        /// Entries received.
        len: usize,
        /// The limit that applies.
        max: usize,
    },
    /// A group of keys that comes all together or not at all came in part.
    PartialGroup {
        /// The group: `sender` (release) or `rank` (handshake metadata).
        group: &'static str,
        /// The first key of the group, in wire order, that is missing.
        missing: &'static str,
    },
    /// A TP rank not below the TP size it belongs to.
    RankOutOfGroup {
        /// The key holding the rank: `sender_tp_rank` or `tp_rank`.
        field: &'static str,
        /// The TP rank received.
        rank: u16,
        /// The TP size it should lie below: `consumer_tp_size` or `tp_size`.
        size: u16,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Empty => write!(f, "empty control message"),
            WireError::TooLarge { len, max } => {
                write!(f, "control message is {len} bytes, over the {max}-byte limit")
            }
            WireError::Truncated { offset } => {
                write!(f, "message ends inside the MessagePack value starting at byte {offset}")
            }
            WireError::TrailingBytes { offset, len } => write!(
                f,
                "{} trailing bytes after the message, which ends at byte {offset}",
                len.saturating_sub(*offset)
            ),
            WireError::ReservedMarker { offset } => {
                write!(f, "reserved MessagePack marker 0xc1 at byte {offset}")
            }
            WireError::TooDeep { max } => {
                write!(f, "MessagePack containers nested deeper than {max} levels")
            }
            WireError::TooManyValues { max } => {
                write!(f, "message holds more than {max} MessagePack values")
            }
            WireError::Unrecognized { first_byte } => write!(
                f,
                "not a control message: first byte {first_byte:#04x} starts neither a \
                 MessagePack map, a MessagePack str, nor an ASCII plain-string completion"
            ),
            WireError::InvalidUtf8 { field } => write!(f, "field `{field}` is not valid UTF-8"),
            WireError::DuplicateKey { key } => write!(f, "key `{key}` appears twice in the map"),
            WireError::UnknownType { type_name } => {
                write!(f, "field `type` names an unknown message type `{type_name}`")
            }
            WireError::MissingField { field } => write!(f, "required field `{field}` is missing"),
            WireError::WrongType { field, expected, found } => {
                write!(f, "field `{field}` should be {expected}, found {found}")
            }
            WireError::OutOfRange { field, value, min, max } => {
                write!(f, "field `{field}` is {value}, outside {min}..={max}")
            }
            WireError::EmptyField { field } => write!(f, "field `{field}` is empty"),
            WireError::TooLong { field, len, max } => {
                write!(f, "field `{field}` is {len} bytes, over the {max}-byte limit")
            }
            WireError::TooMany { field, len, max } => {
                write!(f, "field `{field}` has {len} entries, over the limit of {max}")
            }
            WireError::PartialGroup { group, missing } => {
                write!(f, "the {group} fields come all together or not at all, but `{missing}` is missing")
            }
            WireError::RankOutOfGroup { field, rank, size } => {
                write!(f, "field `{field}` is {rank}, not below its TP size {size}")
            }
        }
    }
}

impl std::error::Error for WireError {}

// ---------------------------------------------------------------------------------------------
// Encoding: private serde mirrors of each shape, serialized by rmp-serde as named maps. Field
// order is key order on the wire, and absent optional keys are skipped rather than sent as nil,
// so the bytes match what MoRIIO's Python packs.

/// A byte slice that serializes as MessagePack bin rather than as an array of integers.
struct Bin<'a>(&'a [u8]);

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
struct ReleaseWire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    transfer_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    consumer_tp_size: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sender_engine_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sender_dp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sender_tp_rank: Option<u16>,
}

#[derive(Serialize)]
struct RemoteBlocksWire<'a> {
    req_id: &'a str,
    transfer_id: &'a str,
    block_notify_list: &'a [u32],
    decode_rank: u16,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct ReadLeaseWire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    transfer_id: &'a str,
    lease_ms: u32,
}

#[derive(Serialize)]
struct WriteDoneWire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    transfer_id: &'a str,
}

#[derive(Serialize)]
struct MetadataWire<'a> {
    engine_id: &'a str,
    agent_metadata: Bin<'a>,
    kv_caches_base_addr: &'a [u64],
    num_blocks: u32,
    block_len: u64,
    attn_backend_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    dp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tp_rank: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tp_size: Option<u16>,
}

/// Serializes one of the mirrors. Writing into a `Vec` cannot fail and every container has a
/// known length, so rmp-serde has no error to return here; an error would be a bug in this file.
fn named<T: Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(value).expect("rmp-serde cannot fail writing a known-length value to a Vec")
}

/// Encodes a message exactly as MoRIIO would send it (pdkv's optional keys appended when set).
///
/// A message that [`decode`] would reject (an empty transfer id, say) is still encoded; the peer
/// rejects it. A legacy completion whose id starts with a non-ASCII character, or equals
/// `get_meta_msg`, is sent as MoRIIO would send it but does not decode back to itself.
pub fn encode(msg: &ControlMessage) -> Vec<u8> {
    match msg {
        ControlMessage::Release(release) => named(&ReleaseWire {
            kind: "release",
            transfer_id: release.transfer_id.as_str(),
            consumer_tp_size: release.consumer_tp_size,
            sender_engine_id: release.sender.as_ref().map(|s| s.engine_id.as_str()),
            sender_dp_rank: release.sender.as_ref().map(|s| s.dp_rank),
            sender_tp_rank: release.sender.as_ref().map(|s| s.tp_rank),
        }),
        ControlMessage::LegacyCompletion(id) => id.as_str().as_bytes().to_vec(),
        ControlMessage::RemoteBlocks(blocks) => named(&RemoteBlocksWire {
            req_id: &blocks.req_id,
            transfer_id: blocks.transfer_id.as_str(),
            block_notify_list: &blocks.block_ids,
            decode_rank: blocks.decode_dp_rank,
            kind: "remote_blocks",
        }),
        ControlMessage::WriteDone(done) => {
            named(&WriteDoneWire { kind: "write_done", transfer_id: done.transfer_id.as_str() })
        }
        ControlMessage::ReadLease(lease) => named(&ReadLeaseWire {
            kind: "read_lease",
            transfer_id: lease.transfer_id.as_str(),
            lease_ms: lease.lease_ms,
        }),
        ControlMessage::HandshakeRequest => HANDSHAKE_REQUEST.to_vec(),
        ControlMessage::HandshakeMetadata(meta) => named(&MetadataWire {
            engine_id: &meta.engine_id,
            agent_metadata: Bin(&meta.agent_metadata),
            kv_caches_base_addr: &meta.kv_caches_base_addr,
            num_blocks: meta.num_blocks,
            block_len: meta.block_len,
            attn_backend_name: &meta.attn_backend_name,
            dp_rank: meta.rank.map(|r| r.dp_rank),
            tp_rank: meta.rank.map(|r| r.tp_rank),
            tp_size: meta.rank.map(|r| r.tp_size),
        }),
    }
}

/// Encodes the second handshake reply frame: `{layer_name: [descriptor, ...]}` in the given order.
pub fn encode_layer_memory_descs(layers: &[LayerMemoryDesc]) -> Vec<u8> {
    named(&LayerMap(layers))
}

// ---------------------------------------------------------------------------------------------
// Decoding, first stage: a bounded MessagePack reader into a small value tree. It is written
// here rather than taken from rmp-serde because the checks the wire needs are about the bytes:
// rmp-serde hands a visitor a bin and a str with invalid UTF-8 through the same `visit_bytes`,
// cannot name the field a type error is in, and does not report where a value ended.

/// A parsed MessagePack value. Floats and extensions are only ever ignored or reported as the
/// wrong type, so their payload is not kept.
#[derive(Debug)]
enum Value {
    Nil,
    Bool,
    Int(i128),
    Float,
    Str(String),
    /// A str whose bytes are not UTF-8; an error only where a known field holds it.
    BadStr,
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Ext,
}

impl Value {
    /// The kind's name, for [`WireError::WrongType`].
    fn kind(&self) -> &'static str {
        match self {
            Value::Nil => "nil",
            Value::Bool => "bool",
            Value::Int(_) => "int",
            Value::Float => "float",
            Value::Str(_) => "str",
            Value::BadStr => "str (not UTF-8)",
            Value::Bin(_) => "bin",
            Value::Array(_) => "array",
            Value::Map(_) => "map",
            Value::Ext => "ext",
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    values: usize,
}

impl<'a> Reader<'a> {
    /// Takes `n` bytes of the value that starts at `start`.
    fn take(&mut self, n: usize, start: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(WireError::Truncated { offset: start }),
        }
    }

    fn be(&mut self, n: usize, start: usize) -> Result<u64, WireError> {
        Ok(self.take(n, start)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// A length field of `n` bytes, as usize (u32 always fits on the targets pdkv builds for).
    fn length(&mut self, n: usize, start: usize) -> Result<usize, WireError> {
        let v = self.be(n, start)?;
        usize::try_from(v).map_err(|_| WireError::Truncated { offset: start })
    }

    fn value(&mut self, depth: usize) -> Result<Value, WireError> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(WireError::TooManyValues { max: MAX_VALUES });
        }
        let start = self.pos;
        let marker = self.take(1, start)?[0];
        Ok(match marker {
            0x00..=0x7f => Value::Int(i128::from(marker)),
            0xe0..=0xff => Value::Int(i128::from(marker as i8)),
            0x80..=0x8f => self.map(usize::from(marker & 0x0f), depth, start)?,
            0x90..=0x9f => self.array(usize::from(marker & 0x0f), depth, start)?,
            0xa0..=0xbf => self.str(usize::from(marker & 0x1f), start)?,
            0xc0 => Value::Nil,
            0xc1 => return Err(WireError::ReservedMarker { offset: start }),
            0xc2 | 0xc3 => Value::Bool,
            0xc4..=0xc6 => {
                let n = self.length(1 << (marker - 0xc4), start)?;
                Value::Bin(self.take(n, start)?.to_vec())
            }
            0xc7..=0xc9 => {
                // Extension: length, one type byte, then the data.
                let n = self.length(1 << (marker - 0xc7), start)?;
                self.take(n.saturating_add(1), start)?;
                Value::Ext
            }
            0xca => {
                self.take(4, start)?;
                Value::Float
            }
            0xcb => {
                self.take(8, start)?;
                Value::Float
            }
            0xcc..=0xcf => Value::Int(i128::from(self.be(1 << (marker - 0xcc), start)?)),
            0xd0 => Value::Int(i128::from(self.be(1, start)? as u8 as i8)),
            0xd1 => Value::Int(i128::from(self.be(2, start)? as u16 as i16)),
            0xd2 => Value::Int(i128::from(self.be(4, start)? as u32 as i32)),
            0xd3 => Value::Int(i128::from(self.be(8, start)? as i64)),
            0xd4..=0xd8 => {
                // Fixed extension: one type byte and 1, 2, 4, 8 or 16 data bytes.
                self.take(1 + (1 << (marker - 0xd4)), start)?;
                Value::Ext
            }
            0xd9..=0xdb => {
                let n = self.length(1 << (marker - 0xd9), start)?;
                self.str(n, start)?
            }
            0xdc | 0xdd => {
                let n = self.length(2 << (marker - 0xdc), start)?;
                self.array(n, depth, start)?
            }
            0xde | 0xdf => {
                let n = self.length(2 << (marker - 0xde), start)?;
                self.map(n, depth, start)?
            }
        })
    }

    fn str(&mut self, n: usize, start: usize) -> Result<Value, WireError> {
        let raw = self.take(n, start)?;
        Ok(match std::str::from_utf8(raw) {
            Ok(s) => Value::Str(s.to_owned()),
            Err(_) => Value::BadStr,
        })
    }

    /// Checks a container's declared element count against the bytes left (every element takes
    /// at least one), so a forged length fails before anything is allocated for it.
    fn container(&self, elements: usize, depth: usize, start: usize) -> Result<(), WireError> {
        if depth + 1 > MAX_DEPTH {
            return Err(WireError::TooDeep { max: MAX_DEPTH });
        }
        if elements > self.bytes.len() - self.pos {
            return Err(WireError::Truncated { offset: start });
        }
        Ok(())
    }

    fn array(&mut self, n: usize, depth: usize, start: usize) -> Result<Value, WireError> {
        self.container(n, depth, start)?;
        let mut items = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize, start: usize) -> Result<Value, WireError> {
        self.container(n.saturating_mul(2), depth, start)?;
        let mut entries = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let key = self.value(depth + 1)?;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }
}

/// Parses exactly one MessagePack value that spans the whole input.
fn parse_whole(bytes: &[u8]) -> Result<Value, WireError> {
    let mut reader = Reader { bytes, pos: 0, values: 0 };
    let value = reader.value(0)?;
    if reader.pos != bytes.len() {
        return Err(WireError::TrailingBytes { offset: reader.pos, len: bytes.len() });
    }
    Ok(value)
}

fn check_size(bytes: &[u8]) -> Result<(), WireError> {
    if bytes.is_empty() {
        return Err(WireError::Empty);
    }
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLarge { len: bytes.len(), max: MAX_MESSAGE_BYTES });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Decoding, second stage: typed fields out of a map, each checked against its wire key.

/// The keys of a message map, each once, with their values.
struct Fields(BTreeMap<String, Value>);

impl Fields {
    fn from_entries(entries: Vec<(Value, Value)>) -> Result<Fields, WireError> {
        let mut map = BTreeMap::new();
        for (key, value) in entries {
            let key = match key {
                Value::Str(s) => s,
                Value::BadStr => return Err(WireError::InvalidUtf8 { field: "map key" }),
                other => {
                    return Err(WireError::WrongType {
                        field: "map key",
                        expected: "str",
                        found: other.kind(),
                    })
                }
            };
            if map.contains_key(&key) {
                return Err(WireError::DuplicateKey { key });
            }
            map.insert(key, value);
        }
        Ok(Fields(map))
    }

    fn has(&self, field: &str) -> bool {
        self.0.contains_key(field)
    }

    fn take(&mut self, field: &'static str) -> Option<Value> {
        self.0.remove(field)
    }

    fn required(&mut self, field: &'static str) -> Result<Value, WireError> {
        self.take(field).ok_or(WireError::MissingField { field })
    }

    /// A non-empty string of at most [`MAX_STR_BYTES`].
    fn str(&mut self, field: &'static str) -> Result<String, WireError> {
        let value = self.required(field)?;
        string(field, value)
    }

    fn opt_str(&mut self, field: &'static str) -> Result<Option<String>, WireError> {
        self.take(field).map(|v| string(field, v)).transpose()
    }

    fn int(&mut self, field: &'static str, min: i128, max: i128) -> Result<i128, WireError> {
        let value = self.required(field)?;
        int(field, value, min, max)
    }

    fn opt_int(&mut self, field: &'static str, min: i128, max: i128) -> Result<Option<i128>, WireError> {
        self.take(field).map(|v| int(field, v, min, max)).transpose()
    }

    /// A list of integers in `min..=max`, with at most `max_len` entries.
    fn int_list(
        &mut self,
        field: &'static str,
        max_len: usize,
        min: i128,
        max: i128,
    ) -> Result<Vec<i128>, WireError> {
        let items = match self.required(field)? {
            Value::Array(items) => items,
            other => return Err(WireError::WrongType { field, expected: "array", found: other.kind() }),
        };
        if items.len() > max_len {
            return Err(WireError::TooMany { field, len: items.len(), max: max_len });
        }
        items.into_iter().map(|v| int(field, v, min, max)).collect()
    }
}

fn string(field: &'static str, value: Value) -> Result<String, WireError> {
    match value {
        Value::Str(s) if s.is_empty() => Err(WireError::EmptyField { field }),
        Value::Str(s) if s.len() > MAX_STR_BYTES => {
            Err(WireError::TooLong { field, len: s.len(), max: MAX_STR_BYTES })
        }
        Value::Str(s) => Ok(s),
        Value::BadStr => Err(WireError::InvalidUtf8 { field }),
        other => Err(WireError::WrongType { field, expected: "str", found: other.kind() }),
    }
}

fn int(field: &'static str, value: Value, min: i128, max: i128) -> Result<i128, WireError> {
    match value {
        Value::Int(v) if (min..=max).contains(&v) => Ok(v),
        Value::Int(v) => Err(WireError::OutOfRange { field, value: v, min, max }),
        other => Err(WireError::WrongType { field, expected: "int", found: other.kind() }),
    }
}

fn blob(field: &'static str, value: Value) -> Result<Vec<u8>, WireError> {
    match value {
        Value::Bin(b) if b.len() > MAX_BLOB_BYTES => {
            Err(WireError::TooLong { field, len: b.len(), max: MAX_BLOB_BYTES })
        }
        Value::Bin(b) => Ok(b),
        other => Err(WireError::WrongType { field, expected: "bin", found: other.kind() }),
    }
}

const U16_MAX: i128 = u16::MAX as i128;
const U32_MAX: i128 = u32::MAX as i128;
const U64_MAX: i128 = u64::MAX as i128;

/// Narrows a value already checked to lie within the target type's range; the fallback is
/// unreachable and only keeps the conversion free of panics.
fn narrow<T: TryFrom<i128> + Default>(v: i128) -> T {
    T::try_from(v).unwrap_or_default()
}

/// Three keys that come all together or not at all; the first missing one is reported.
fn group<A, B, C>(
    group: &'static str,
    names: [&'static str; 3],
    values: (Option<A>, Option<B>, Option<C>),
) -> Result<Option<(A, B, C)>, WireError> {
    match values {
        (Some(a), Some(b), Some(c)) => Ok(Some((a, b, c))),
        (None, None, None) => Ok(None),
        (a, b, _) => {
            let missing = if a.is_none() {
                names[0]
            } else if b.is_none() {
                names[1]
            } else {
                names[2]
            };
            Err(WireError::PartialGroup { group, missing })
        }
    }
}

fn transfer_id(fields: &mut Fields) -> Result<TransferId, WireError> {
    fields.str("transfer_id").map(TransferId)
}

fn release(mut f: Fields) -> Result<ControlMessage, WireError> {
    let transfer_id = transfer_id(&mut f)?;
    let consumer_tp_size = f.opt_int("consumer_tp_size", 1, U16_MAX)?.map(narrow::<u16>);
    let sender = group(
        "sender",
        ["sender_engine_id", "sender_dp_rank", "sender_tp_rank"],
        (
            f.opt_str("sender_engine_id")?,
            f.opt_int("sender_dp_rank", 0, U16_MAX)?,
            f.opt_int("sender_tp_rank", 0, U16_MAX)?,
        ),
    )?
    .map(|(engine_id, dp, tp)| ReleaseSender { engine_id, dp_rank: narrow(dp), tp_rank: narrow(tp) });
    // The sender is one of the `consumer_tp_size` decode ranks, so its TP rank must lie below.
    if let (Some(size), Some(s)) = (consumer_tp_size, &sender) {
        if s.tp_rank >= size {
            return Err(WireError::RankOutOfGroup { field: "sender_tp_rank", rank: s.tp_rank, size });
        }
    }
    Ok(ControlMessage::Release(Release { transfer_id, consumer_tp_size, sender }))
}

fn remote_blocks(mut f: Fields) -> Result<ControlMessage, WireError> {
    let req_id = f.str("req_id")?;
    let transfer_id = transfer_id(&mut f)?;
    let block_ids: Vec<u32> =
        f.int_list("block_notify_list", MAX_BLOCK_IDS, 0, U32_MAX)?.into_iter().map(narrow).collect();
    // MoRIIO raises on an empty list: there is nothing to write into.
    if block_ids.is_empty() {
        return Err(WireError::EmptyField { field: "block_notify_list" });
    }
    let decode_dp_rank = f.opt_int("decode_rank", 0, U16_MAX)?.map_or(0, narrow);
    Ok(ControlMessage::RemoteBlocks(RemoteBlocks { req_id, transfer_id, block_ids, decode_dp_rank }))
}

fn read_lease(mut f: Fields) -> Result<ControlMessage, WireError> {
    let transfer_id = transfer_id(&mut f)?;
    let lease_ms = narrow::<u32>(f.int("lease_ms", 1, i128::from(u32::MAX))?);
    Ok(ControlMessage::ReadLease(ReadLease { transfer_id, lease_ms }))
}

fn write_done(mut f: Fields) -> Result<ControlMessage, WireError> {
    Ok(ControlMessage::WriteDone(WriteDone { transfer_id: transfer_id(&mut f)? }))
}

fn metadata(mut f: Fields) -> Result<ControlMessage, WireError> {
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
    Ok(ControlMessage::HandshakeMetadata(HandshakeMetadata {
        engine_id,
        agent_metadata,
        kv_caches_base_addr,
        num_blocks,
        block_len,
        attn_backend_name,
        rank,
    }))
}

/// Picks the message kind of a map and reads it; see the module docs for the rules.
fn structured(entries: Vec<(Value, Value)>) -> Result<ControlMessage, WireError> {
    let mut f = Fields::from_entries(entries)?;
    match f.take("type") {
        Some(value) => match string("type", value)?.as_str() {
            "release" => release(f),
            "remote_blocks" => remote_blocks(f),
            "write_done" => write_done(f),
            "read_lease" => read_lease(f),
            other => Err(WireError::UnknownType { type_name: other.to_owned() }),
        },
        None if f.has("req_id") => remote_blocks(f),
        None if f.has("engine_id") => metadata(f),
        None => Err(WireError::MissingField { field: "type" }),
    }
}

fn legacy(id: String) -> Result<ControlMessage, WireError> {
    let id = string("transfer_id", Value::Str(id))?;
    Ok(ControlMessage::LegacyCompletion(TransferId(id)))
}

/// Decodes one frame of a MoRIIO notify or handshake socket (not the second handshake reply
/// frame: see [`decode_layer_memory_descs`]).
pub fn decode(bytes: &[u8]) -> Result<ControlMessage, WireError> {
    check_size(bytes)?;
    if bytes == HANDSHAKE_REQUEST {
        return Ok(ControlMessage::HandshakeRequest);
    }
    match bytes[0] {
        0x80..=0x8f | 0xde | 0xdf => match parse_whole(bytes)? {
            Value::Map(entries) => structured(entries),
            other => Err(WireError::WrongType { field: "message", expected: "map", found: other.kind() }),
        },
        0xa0..=0xbf | 0xd9..=0xdb => match parse_whole(bytes)? {
            Value::Str(s) => legacy(s),
            _ => Err(WireError::InvalidUtf8 { field: "transfer_id" }),
        },
        0x00..=0x7f => match std::str::from_utf8(bytes) {
            Ok(s) => legacy(s.to_owned()),
            Err(_) => Err(WireError::InvalidUtf8 { field: "transfer_id" }),
        },
        first_byte => Err(WireError::Unrecognized { first_byte }),
    }
}

/// Decodes the second handshake reply frame, `{layer_name: [descriptor, ...]}`, keeping the
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A test-only MessagePack value, serialized by rmp-serde, to build malformed maps.
    #[derive(Clone, Debug)]
    enum V {
        U(u64),
        I(i64),
        S(String),
        B(Vec<u8>),
        A(Vec<V>),
        M(Vec<(&'static str, V)>),
        Nil,
        F(f64),
    }

    impl Serialize for V {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                V::U(v) => s.serialize_u64(*v),
                V::I(v) => s.serialize_i64(*v),
                V::S(v) => s.serialize_str(v),
                V::B(v) => s.serialize_bytes(v),
                V::A(items) => {
                    let mut seq = s.serialize_seq(Some(items.len()))?;
                    for item in items {
                        seq.serialize_element(item)?;
                    }
                    seq.end()
                }
                V::M(entries) => {
                    let mut map = s.serialize_map(Some(entries.len()))?;
                    for (k, v) in entries {
                        map.serialize_entry(k, v)?;
                    }
                    map.end()
                }
                V::Nil => s.serialize_unit(),
                V::F(v) => s.serialize_f64(*v),
            }
        }
    }

    fn s(v: &str) -> V {
        V::S(v.to_owned())
    }

    fn pack(entries: Vec<(&'static str, V)>) -> Vec<u8> {
        rmp_serde::to_vec_named(&V::M(entries)).unwrap()
    }

    const TID: &str = "tx-0c5f2a9e-3b7d-4e21-9a64-8f1d2c3b4a5e";

    fn tid() -> TransferId {
        TransferId(TID.to_owned())
    }

    fn release_map(extra: Vec<(&'static str, V)>) -> Vec<u8> {
        let mut entries = vec![("type", s("release")), ("transfer_id", s(TID))];
        entries.extend(extra);
        pack(entries)
    }

    fn release(consumer_tp_size: Option<u16>, sender: Option<(&str, u16, u16)>) -> ControlMessage {
        ControlMessage::Release(Release {
            transfer_id: tid(),
            consumer_tp_size,
            sender: sender.map(|(engine_id, dp_rank, tp_rank)| ReleaseSender {
                engine_id: engine_id.to_owned(),
                dp_rank,
                tp_rank,
            }),
        })
    }

    fn metadata(rank: Option<RankInfo>) -> ControlMessage {
        ControlMessage::HandshakeMetadata(HandshakeMetadata {
            engine_id: "prefill-0:6301".to_owned(),
            agent_metadata: vec![0, 1, 2, 0xff],
            kv_caches_base_addr: vec![0x7f3a_0000_0000, 5],
            num_blocks: 21504,
            block_len: 73728,
            attn_backend_name: "FLASHMLA".to_owned(),
            rank,
        })
    }

    fn check(input: &[u8], expected: Result<ControlMessage, WireError>) {
        assert_eq!(decode(input), expected, "input {input:02x?}");
    }

    /// Every message kind survives encode then decode, and the bytes start as MoRIIO's do.
    #[test]
    fn every_message_round_trips() {
        let messages = [
            release(Some(8), None),
            release(None, None),
            release(Some(8), Some(("decode-0:6301", 3, 5))),
            release(None, Some(("d", 0, 9))),
            ControlMessage::LegacyCompletion(tid()),
            ControlMessage::RemoteBlocks(RemoteBlocks {
                req_id: "cmpl-1".to_owned(),
                transfer_id: tid(),
                block_ids: vec![0, 127, 128, 65536, u32::MAX],
                decode_dp_rank: 7,
            }),
            ControlMessage::WriteDone(WriteDone { transfer_id: tid() }),
            ControlMessage::ReadLease(ReadLease { transfer_id: tid(), lease_ms: 30_000 }),
            ControlMessage::HandshakeRequest,
            metadata(None),
            metadata(Some(RankInfo { dp_rank: 1, tp_rank: 3, tp_size: 8 })),
        ];
        for msg in messages {
            let bytes = encode(&msg);
            check(&bytes, Ok(msg));
        }
    }

    /// Exact bytes of the release Python's `msgpack.packb` builds (key order type, transfer_id,
    /// consumer_tp_size), and the raw bytes of the legacy completion.
    #[test]
    fn encodes_the_bytes_moriio_sends() {
        let check_bytes = |msg: ControlMessage, expected: &[u8]| assert_eq!(encode(&msg), expected);
        let mut release_bytes = vec![0x83, 0xa4];
        release_bytes.extend(b"type\xa7release\xabtransfer_id\xd9\x27");
        release_bytes.extend(TID.as_bytes());
        release_bytes.extend(b"\xb0consumer_tp_size\x08");
        check_bytes(release(Some(8), None), &release_bytes);
        check_bytes(ControlMessage::LegacyCompletion(tid()), TID.as_bytes());
        check_bytes(ControlMessage::HandshakeRequest, b"get_meta_msg");
        check_bytes(
            ControlMessage::WriteDone(WriteDone { transfer_id: TransferId("t".to_owned()) }),
            b"\x82\xa4type\xaawrite_done\xabtransfer_id\xa1t",
        );
    }

    /// Forms a MoRIIO peer produces that pdkv accepts without producing them itself.
    #[test]
    fn accepts_older_and_tolerated_forms() {
        // A msgpack str as a legacy completion; raw ASCII text including a single digit.
        check(b"\xa4tx-1", Ok(ControlMessage::LegacyCompletion(TransferId("tx-1".to_owned()))));
        check(b"7", Ok(ControlMessage::LegacyCompletion(TransferId("7".to_owned()))));
        // remote_blocks without `type` (MoRIIO infers it from `req_id`) or `decode_rank`.
        check(
            &pack(vec![
                ("req_id", s("r")),
                ("transfer_id", s(TID)),
                ("block_notify_list", V::A(vec![V::U(4)])),
            ]),
            Ok(ControlMessage::RemoteBlocks(RemoteBlocks {
                req_id: "r".to_owned(),
                transfer_id: tid(),
                block_ids: vec![4],
                decode_dp_rank: 0,
            })),
        );
        // Unknown keys anywhere, holding any well-formed value, are ignored.
        check(
            &release_map(vec![
                ("consumer_tp_size", V::U(2)),
                ("future", V::M(vec![("x", V::A(vec![V::F(1.5), V::Nil, V::B(vec![0xff])]))])),
            ]),
            Ok(release(Some(2), None)),
        );
        // Python packs small ints as fixints, but a signed or wider int is the same number.
        check(&release_map(vec![("consumer_tp_size", V::I(4))]), Ok(release(Some(4), None)));
    }

    /// Malformed inputs, each with the exact error.
    #[test]
    fn rejects_malformed_input_with_typed_errors() {
        use WireError::*;
        let mut too_deep = V::Nil;
        for _ in 0..MAX_DEPTH {
            too_deep = V::A(vec![too_deep]);
        }
        let valid = release_map(vec![("consumer_tp_size", V::U(8))]);
        let mut trailing = valid.clone();
        trailing.push(0x00);
        let cases: Vec<(Vec<u8>, WireError)> = vec![
            (vec![], Empty),
            (
                vec![b'a'; MAX_MESSAGE_BYTES + 1],
                TooLarge { len: MAX_MESSAGE_BYTES + 1, max: MAX_MESSAGE_BYTES },
            ),
            (valid[..valid.len() - 1].to_vec(), Truncated { offset: valid.len() - 1 }),
            (trailing, TrailingBytes { offset: valid.len(), len: valid.len() + 1 }),
            (vec![0xdf, 0xff, 0xff, 0xff, 0xff], Truncated { offset: 0 }),
            (vec![0x81, 0xa1, b'x', 0xc1], ReservedMarker { offset: 3 }),
            (pack(vec![("deep", too_deep)]), TooDeep { max: MAX_DEPTH }),
            (vec![0xc0], Unrecognized { first_byte: 0xc0 }),
            (b"tx-\xff".to_vec(), InvalidUtf8 { field: "transfer_id" }),
            (vec![0xa2, 0xff, 0xfe], InvalidUtf8 { field: "transfer_id" }),
            (vec![0xa0], EmptyField { field: "transfer_id" }),
            (
                b"\x82\xa4type\xa7release\xabtransfer_id\xa2\xff\xfe".to_vec(),
                InvalidUtf8 { field: "transfer_id" },
            ),
            (vec![0x81, 0x01, 0x02], WrongType { field: "map key", expected: "str", found: "int" }),
            (release_map(vec![("transfer_id", s("again"))]), DuplicateKey { key: "transfer_id".to_owned() }),
            (
                pack(vec![("type", s("ack")), ("transfer_id", s(TID))]),
                UnknownType { type_name: "ack".to_owned() },
            ),
            (pack(vec![("type", V::U(1))]), WrongType { field: "type", expected: "str", found: "int" }),
            (pack(vec![("transfer_id", s(TID))]), MissingField { field: "type" }),
            (pack(vec![("type", s("release"))]), MissingField { field: "transfer_id" }),
            (
                pack(vec![("type", s("read_lease")), ("transfer_id", s(TID)), ("lease_ms", V::U(0))]),
                OutOfRange { field: "lease_ms", value: 0, min: 1, max: i128::from(u32::MAX) },
            ),
            (
                pack(vec![("type", s("read_lease")), ("transfer_id", s(TID))]),
                MissingField { field: "lease_ms" },
            ),
            (pack(vec![("type", s("release")), ("transfer_id", s(""))]), EmptyField { field: "transfer_id" }),
            (
                pack(vec![("type", s("release")), ("transfer_id", V::S("x".repeat(MAX_STR_BYTES + 1)))]),
                TooLong { field: "transfer_id", len: MAX_STR_BYTES + 1, max: MAX_STR_BYTES },
            ),
            (
                pack(vec![("type", s("release")), ("transfer_id", V::B(TID.as_bytes().to_vec()))]),
                WrongType { field: "transfer_id", expected: "str", found: "bin" },
            ),
            (
                release_map(vec![("consumer_tp_size", V::U(0))]),
                OutOfRange { field: "consumer_tp_size", value: 0, min: 1, max: 65535 },
            ),
            (
                release_map(vec![("consumer_tp_size", V::I(-1))]),
                OutOfRange { field: "consumer_tp_size", value: -1, min: 1, max: 65535 },
            ),
            (
                release_map(vec![("consumer_tp_size", V::U(65536))]),
                OutOfRange { field: "consumer_tp_size", value: 65536, min: 1, max: 65535 },
            ),
            (
                release_map(vec![("consumer_tp_size", s("8"))]),
                WrongType { field: "consumer_tp_size", expected: "int", found: "str" },
            ),
            (
                release_map(vec![("consumer_tp_size", V::Nil)]),
                WrongType { field: "consumer_tp_size", expected: "int", found: "nil" },
            ),
            (
                release_map(vec![("sender_engine_id", s("d:1"))]),
                PartialGroup { group: "sender", missing: "sender_dp_rank" },
            ),
            (
                release_map(vec![("sender_engine_id", s("d:1")), ("sender_dp_rank", V::U(0))]),
                PartialGroup { group: "sender", missing: "sender_tp_rank" },
            ),
            (
                release_map(vec![
                    ("consumer_tp_size", V::U(4)),
                    ("sender_engine_id", s("d:1")),
                    ("sender_dp_rank", V::U(0)),
                    ("sender_tp_rank", V::U(4)),
                ]),
                RankOutOfGroup { field: "sender_tp_rank", rank: 4, size: 4 },
            ),
            (
                pack(vec![
                    ("type", s("remote_blocks")),
                    ("req_id", s("r")),
                    ("transfer_id", s(TID)),
                    ("block_notify_list", V::A(vec![])),
                ]),
                EmptyField { field: "block_notify_list" },
            ),
            (
                pack(vec![
                    ("req_id", s("r")),
                    ("transfer_id", s(TID)),
                    ("block_notify_list", V::A(vec![V::U(0); MAX_BLOCK_IDS + 1])),
                ]),
                TooMany { field: "block_notify_list", len: MAX_BLOCK_IDS + 1, max: MAX_BLOCK_IDS },
            ),
            (
                pack(vec![
                    ("req_id", s("r")),
                    ("transfer_id", s(TID)),
                    ("block_notify_list", V::A(vec![V::I(-3)])),
                ]),
                OutOfRange { field: "block_notify_list", value: -3, min: 0, max: U32_MAX },
            ),
            (
                pack(vec![("engine_id", s("e")), ("agent_metadata", s("not bin"))]),
                WrongType { field: "agent_metadata", expected: "bin", found: "str" },
            ),
            (
                {
                    let mut bytes = encode(&metadata(Some(RankInfo { dp_rank: 0, tp_rank: 0, tp_size: 1 })));
                    // The last value is `tp_size: 1`; make it 0.
                    let last = bytes.len() - 1;
                    bytes[last] = 0;
                    bytes
                },
                OutOfRange { field: "tp_size", value: 0, min: 1, max: 65535 },
            ),
            (
                encode(&metadata(Some(RankInfo { dp_rank: 0, tp_rank: 8, tp_size: 8 }))),
                RankOutOfGroup { field: "tp_rank", rank: 8, size: 8 },
            ),
        ];
        assert!(cases.len() >= 12);
        for (input, expected) in cases {
            check(&input, Err(expected));
        }
    }

    #[test]
    fn errors_name_the_field() {
        let text = |e: WireError| e.to_string();
        assert_eq!(
            text(WireError::OutOfRange { field: "consumer_tp_size", value: 0, min: 1, max: 65535 }),
            "field `consumer_tp_size` is 0, outside 1..=65535"
        );
        assert_eq!(
            text(WireError::PartialGroup { group: "sender", missing: "sender_dp_rank" }),
            "the sender fields come all together or not at all, but `sender_dp_rank` is missing"
        );
        assert_eq!(
            text(WireError::TrailingBytes { offset: 3, len: 5 }),
            "2 trailing bytes after the message, which ends at byte 3"
        );
    }

    #[test]
    fn legacy_completion_counts_as_one_plain_release() {
        let plain = Release { transfer_id: tid(), consumer_tp_size: None, sender: None };
        assert_eq!(decode(TID.as_bytes()).map(|m| m.as_release()), Ok(Some(plain)));
        assert_eq!(ControlMessage::HandshakeRequest.as_release(), None);
    }

    fn layers() -> Vec<LayerMemoryDesc> {
        (0..3)
            .map(|i| LayerMemoryDesc {
                layer_name: format!("model.layers.{i}.self_attn.attn"),
                descs: vec![vec![i as u8; i + 1]],
            })
            .collect()
    }

    #[test]
    fn layer_memory_descs_round_trip_and_reject_malformed() {
        let bytes = encode_layer_memory_descs(&layers());
        assert_eq!(decode_layer_memory_descs(&bytes), Ok(layers()));
        const FIELD: &str = "layer memory descriptors";
        let check_layers = |input: Vec<u8>, expected: WireError| {
            assert_eq!(decode_layer_memory_descs(&input), Err(expected), "input {input:02x?}");
        };
        check_layers(vec![0x80], WireError::EmptyField { field: FIELD });
        check_layers(vec![0x90], WireError::WrongType { field: FIELD, expected: "map", found: "array" });
        check_layers(pack(vec![("l", V::A(vec![]))]), WireError::EmptyField { field: FIELD });
        check_layers(
            pack(vec![("l", V::A(vec![s("x")]))]),
            WireError::WrongType { field: FIELD, expected: "bin", found: "str" },
        );
        check_layers(
            pack(vec![("l", V::A(vec![V::B(vec![1])])), ("l", V::A(vec![V::B(vec![2])]))]),
            WireError::DuplicateKey { key: "l".to_owned() },
        );
        check_layers(
            pack(vec![("l", V::A(vec![V::B(vec![0; MAX_BLOB_BYTES + 1])]))]),
            WireError::TooLong { field: FIELD, len: MAX_BLOB_BYTES + 1, max: MAX_BLOB_BYTES },
        );
    }

    fn arb_id() -> impl Strategy<Value = String> {
        "[a-z][a-z0-9:.-]{0,40}"
    }

    fn arb_message() -> impl Strategy<Value = ControlMessage> {
        let sender = (arb_id(), any::<u16>(), any::<u16>());
        let release = (arb_id(), prop::option::of(1..=u16::MAX), prop::option::of(sender)).prop_map(
            |(id, size, sender)| {
                ControlMessage::Release(Release {
                    transfer_id: TransferId(id),
                    consumer_tp_size: size,
                    sender: sender.map(|(engine_id, dp_rank, tp_rank)| ReleaseSender {
                        engine_id,
                        dp_rank,
                        // The sender's TP rank lies below the TP size it reports.
                        tp_rank: size.map_or(tp_rank, |n| tp_rank % n),
                    }),
                })
            },
        );
        let legacy = "[!-~][ -~é中]{0,40}"
            .prop_filter("the handshake request is not a transfer id", |id| {
                id.as_bytes() != HANDSHAKE_REQUEST
            })
            .prop_map(|id| ControlMessage::LegacyCompletion(TransferId(id)));
        let blocks = (arb_id(), arb_id(), prop::collection::vec(any::<u32>(), 1..64), any::<u16>()).prop_map(
            |(req_id, id, block_ids, decode_dp_rank)| {
                ControlMessage::RemoteBlocks(RemoteBlocks {
                    req_id,
                    transfer_id: TransferId(id),
                    block_ids,
                    decode_dp_rank,
                })
            },
        );
        let done =
            arb_id().prop_map(|id| ControlMessage::WriteDone(WriteDone { transfer_id: TransferId(id) }));
        let rank = (any::<u16>(), any::<u16>(), 1..=u16::MAX).prop_map(|(dp_rank, tp_rank, tp_size)| {
            RankInfo { dp_rank, tp_rank: tp_rank % tp_size, tp_size }
        });
        let meta = (
            arb_id(),
            prop::collection::vec(any::<u8>(), 0..64),
            prop::collection::vec(any::<u64>(), 0..8),
            1..=u32::MAX,
            1..=u64::MAX,
            "[A-Z_]{1,16}",
            prop::option::of(rank),
        )
            .prop_map(
                |(engine_id, agent_metadata, kv_caches_base_addr, num_blocks, block_len, attn, rank)| {
                    ControlMessage::HandshakeMetadata(HandshakeMetadata {
                        engine_id,
                        agent_metadata,
                        kv_caches_base_addr,
                        num_blocks,
                        block_len,
                        attn_backend_name: attn,
                        rank,
                    })
                },
            );
        let lease = (arb_id(), 1..=u32::MAX).prop_map(|(id, lease_ms)| {
            ControlMessage::ReadLease(ReadLease { transfer_id: TransferId(id), lease_ms })
        });
        prop_oneof![release, legacy, blocks, done, lease, Just(ControlMessage::HandshakeRequest), meta]
    }

    /// How a valid encoding is damaged: overwrite, insert or delete a byte, or cut the end.
    #[derive(Clone, Debug)]
    enum Mutation {
        Set(usize, u8),
        Insert(usize, u8),
        Delete(usize),
        Truncate(usize),
    }

    fn arb_mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Delete),
            any::<usize>().prop_map(Mutation::Truncate),
        ]
    }

    fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
        let n = bytes.len();
        match *mutation {
            Mutation::Set(i, b) if n > 0 => bytes[i % n] = b,
            Mutation::Insert(i, b) => bytes.insert(i % (n + 1), b),
            Mutation::Delete(i) if n > 0 => {
                bytes.remove(i % n);
            }
            Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
            _ => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn decode_is_total_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            // Returning at all, error or not, is the property.
            let _ = decode(&bytes);
            let _ = decode_layer_memory_descs(&bytes);
        }

        #[test]
        fn decode_is_total_on_damaged_messages(
            msg in arb_message(),
            mutations in prop::collection::vec(arb_mutation(), 1..4),
        ) {
            let mut bytes = encode(&msg);
            for mutation in &mutations {
                mutate(&mut bytes, mutation);
            }
            let _ = decode(&bytes);
            let mut layer_bytes = encode_layer_memory_descs(&layers());
            for mutation in &mutations {
                mutate(&mut layer_bytes, mutation);
            }
            let _ = decode_layer_memory_descs(&layer_bytes);
        }

        #[test]
        fn valid_messages_round_trip(msg in arb_message()) {
            prop_assert_eq!(decode(&encode(&msg)), Ok(msg));
        }
    }
}
