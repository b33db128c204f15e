//! A control message as a typed value ([`ControlMessage`]) and its dispatch: [`encode`] to the
//! bytes MoRIIO sends, [`decode`] from the first byte to the message's own decoder (the rules are
//! in the module documentation of `wire`).

use crate::ids::{Incarnation, TransferId};

use super::error::WireError;
use super::fields::{string, Fields};
use super::handshake::{metadata, Bin, Extension, HandshakeMetadata, MetadataWire};
use super::msgpack::{check_size, named, parse_whole, Value};
use super::notify::{
    read_lease, release, remote_blocks, write_done, write_failed, ReadLease, ReadLeaseWire, Release,
    ReleaseWire, RemoteBlocks, RemoteBlocksWire, WriteDone, WriteDoneWire, WriteFailed, WriteFailedWire,
};

/// The handshake request (MoRIIO's `GET_META_MSG`), sent as raw bytes in a frame of its own.
pub const HANDSHAKE_REQUEST: &[u8] = b"get_meta_msg";

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
    /// WRITE mode, prefill to decode: the decode blocks never came, the transfer is given up.
    WriteFailed(WriteFailed),
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
// rmp-serde as named maps (`msgpack::named`). Field order is key order on the wire, and absent
// optional keys are skipped rather than sent as nil, so the bytes match what MoRIIO's Python packs.

/// Encodes a message exactly as MoRIIO would send it (pdkv's optional keys appended when set).
///
/// A message that [`decode`] would reject (an empty transfer id, say) is still encoded; the peer
/// rejects it. A legacy completion whose id starts with a non-ASCII character, or equals
/// `get_meta_msg`, is sent as MoRIIO would send it but does not decode back to itself.
pub fn encode(msg: &ControlMessage) -> Vec<u8> {
    match msg {
        ControlMessage::Release(release) => named(&ReleaseWire {
            kind: "release",
            transfer_id: &release.transfer_id.as_str(),
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
            transfer_id: &blocks.transfer_id.as_str(),
            block_notify_list: &blocks.block_ids,
            decode_rank: blocks.decode_dp_rank,
            kind: "remote_blocks",
        }),
        ControlMessage::WriteDone(done) => named(&WriteDoneWire {
            kind: "write_done",
            transfer_id: &done.transfer_id.as_str(),
            num_writers: (done.writers != 1).then_some(done.writers),
        }),
        ControlMessage::WriteFailed(failed) => {
            named(&WriteFailedWire { kind: "write_failed", transfer_id: &failed.transfer_id.as_str() })
        }
        ControlMessage::ReadLease(lease) => named(&ReadLeaseWire {
            kind: "read_lease",
            transfer_id: &lease.transfer_id.as_str(),
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
            "release" => release(f).map(ControlMessage::Release),
            "remote_blocks" => remote_blocks(f).map(ControlMessage::RemoteBlocks),
            "write_done" => write_done(f).map(ControlMessage::WriteDone),
            "write_failed" => write_failed(f).map(ControlMessage::WriteFailed),
            "read_lease" => read_lease(f).map(ControlMessage::ReadLease),
            other => Err(WireError::UnknownType { type_name: other.to_owned() }),
        },
        None if f.has("req_id") => remote_blocks(f).map(ControlMessage::RemoteBlocks),
        None if f.has("engine_id") => metadata(f).map(ControlMessage::HandshakeMetadata),
        None => Err(WireError::MissingField { field: "type" }),
    }
}

fn legacy(id: String) -> Result<ControlMessage, WireError> {
    let id = string("transfer_id", Value::Str(id))?;
    Ok(ControlMessage::LegacyCompletion(TransferId::new(id)))
}

/// Decodes one payload frame of a MoRIIO notify or handshake socket (not the second handshake
/// reply's payload: see [`decode_layer_memory_descs`](super::decode_layer_memory_descs)).
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
