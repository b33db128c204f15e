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
//! | read_lease (pdkv's own, decode → prefill) | `type: "read_lease"`, `transfer_id: str`, `lease_ms: int`, optional `pdkv_incarnation: int` |
//!
//! pdkv appends three optional keys to a release, `sender_engine_id: str`, `sender_dp_rank: int`
//! and `sender_tp_rank: int` (names chosen by pdkv; MoRIIO has no such keys), all three or none.
//! MoRIIO reads a release with `data["transfer_id"]` and `consumer_tp_size`, so it ignores them.
//! A read lease is pdkv's alone, and MoRIIO's listener raises on its `type` (which ends the
//! listener thread), so a pdkv rank sends one only to a rank that advertised
//! [`Extension::ReadLease`] in its handshake metadata (below). A release or lease to a rank that
//! advertised [`Extension::Incarnation`] also carries `pdkv_incarnation: int`, the incarnation of
//! that rank which holds the transfer ([`Incarnation`], `1..=2^53-1`); the rank ignores one naming
//! another incarnation of it. A MoRIIO rank advertises nothing and is never sent the key.
//!
//! Handshake socket (`handshake_port + dp * T + tp`): the request is one frame, the raw bytes
//! `get_meta_msg` (again not MessagePack), and the reply is two messages, each an empty
//! delimiter frame and then the payload (`[b"", metadata]`, then `[b"", layer map]`: MoRIIO's
//! listener sends them so and its dialer refuses anything else; `framing` has the frames of
//! every socket). The first payload is MoRIIO's `MoRIIOAgentMetadata`: `engine_id: str`,
//! `agent_metadata: bin` (MoRIIO's is a packed MoRI `EngineDesc`, a MessagePack array; pdkv's
//! is its [`DataPlane`] descriptor, `{"pdkv": 1, "transport": "tcp" | "rdma", "addr":
//! "host:port"}`, which [`DataPlane::decode`] tells apart), `kv_caches_base_addr: [int]`,
//! `num_blocks: int`, `block_len: int` (bytes per block), `attn_backend_name: str` (vLLM 0.33
//! adds `kv_head_layouts`, `mamba_state_layouts` and `attention_block_sizes`, which it omits
//! at their empty defaults and pdkv ignores). pdkv appends `dp_rank`, `tp_rank` and `tp_size`
//! (its own names, all three or none) and `pdkv_extensions: [str]`, the names of the
//! [`Extension`]s it speaks (`["read_lease", "incarnation"]`; left out when empty, so no MoRIIO
//! key changes), and `pdkv_incarnation: int`, the answering rank's [`Incarnation`].
//! msgspec decodes `MoRIIOAgentMetadata` (a `Struct` without `forbid_unknown_fields`) skipping
//! unknown keys, so a MoRIIO peer ignores pdkv's. An extension name pdkv does not know is
//! ignored too (a newer pdkv may list more). The second payload maps each layer name to a list
//! of packed MoRI `MemoryDesc` blobs; it carries no discriminating key, so it has its own pair
//! of functions, [`encode_layer_memory_descs`] and [`decode_layer_memory_descs`].
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
//!
//! The code: `notify` and `handshake` hold each family's messages, their wire mirrors and their
//! decoders; `data_plane` pdkv's `agent_metadata`; `framing` how the messages sit in ZeroMQ frames ([`handshake_reply`],
//! [`reply_payload`], [`handshake_request`], [`notify_frame`]); `msgpack` is the bounded
//! MessagePack reader, `fields` the typed reading of a map's keys, `error` the [`WireError`];
//! this file dispatches [`encode`] and [`decode`].

mod data_plane;
mod error;
mod fields;
mod framing;
mod handshake;
mod msgpack;
mod notify;
#[cfg(test)]
mod tests;

use serde::Serialize;

use crate::ids::{Incarnation, TransferId};
use crate::release::Release;
use fields::{string, Fields};
use handshake::{metadata, Bin, MetadataWire};
use msgpack::{check_size, parse_whole, Value};
use notify::{
    read_lease, release, remote_blocks, write_done, ReadLeaseWire, ReleaseWire, RemoteBlocksWire,
    WriteDoneWire,
};

pub use data_plane::{
    DataPlane, DataPlaneError, DataTransport, ForeignDataPlane, ForeignKind, DATA_PLANE_VERSION,
};
pub use error::WireError;
pub use framing::{
    handshake_reply, handshake_request, notify_frame, reply_payload, FramingError, HandshakeRequest,
    ReplyPart, DELIMITER, HANDSHAKE_REQUEST, POP_DONE_RECV,
};
pub use handshake::{
    decode_layer_memory_descs, encode_layer_memory_descs, Extension, Extensions, HandshakeMetadata,
    LayerMemoryDesc, RankInfo,
};
pub use notify::{ReadLease, RemoteBlocks, WriteDone};

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
/// Most names in `pdkv_extensions` (pdkv knows two; a newer pdkv may list more).
pub const MAX_EXTENSIONS: usize = 64;

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
    /// The payload of the first reply message to [`ControlMessage::HandshakeRequest`].
    HandshakeMetadata(HandshakeMetadata),
}

impl ControlMessage {
    /// The release this message stands for: the map form as it is, the legacy string as a
    /// release without TP size or sender; `None` for every other message.
    pub fn as_release(&self) -> Option<Release> {
        match self {
            ControlMessage::Release(release) => Some(release.clone()),
            ControlMessage::LegacyCompletion(id) => Some(Release {
                transfer_id: id.clone(),
                consumer_tp_size: None,
                sender: None,
                incarnation: None,
                mac: None,
            }),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding: private serde mirrors of each shape (in `notify` and `handshake`), serialized by
// rmp-serde as named maps. Field order is key order on the wire, and absent optional keys are
// skipped rather than sent as nil, so the bytes match what MoRIIO's Python packs.

/// Serializes one of the mirrors. Writing into a `Vec` cannot fail and every container has a
/// known length, so rmp-serde has no error to return here; an error would be a bug in this file.
pub(super) fn named<T: Serialize>(value: &T) -> Vec<u8> {
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
            pdkv_incarnation: release.incarnation.map(Incarnation::value),
            pdkv_mac: release.mac.as_ref().map(|m| Bin(&m.0)),
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
            pdkv_incarnation: lease.incarnation.map(Incarnation::value),
            pdkv_mac: lease.mac.as_ref().map(|m| Bin(&m.0)),
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
            pdkv_extensions: meta.extensions.iter().map(Extension::wire_name).collect(),
            pdkv_incarnation: meta.incarnation.map(Incarnation::value),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding: the bytes' first form (see the module doc), then each message's fields.

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

/// Decodes one payload frame of a MoRIIO notify or handshake socket (not the second handshake
/// reply's payload: see [`decode_layer_memory_descs`]).
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
