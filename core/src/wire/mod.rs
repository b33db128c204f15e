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
//! | write_done (WRITE mode) | `type: "write_done"`, `transfer_id: str`, `num_writers: int` (1..=65535; vLLM 0.33 on, only when not 1) |
//! | write_failed (WRITE mode, vLLM 0.33 on) | `type: "write_failed"`, `transfer_id: str` |
//! | read_lease (pdkv's own, decode → prefill) | `type: "read_lease"`, `transfer_id: str`, `lease_ms: int`, optional `pdkv_incarnation: int` |
//!
//! pdkv appends three optional keys to a release, `sender_engine_id: str`, `sender_dp_rank: int`
//! and `sender_tp_rank: int` (names chosen by pdkv; MoRIIO has no such keys), all three or none.
//! MoRIIO reads a release with `data["transfer_id"]` and `consumer_tp_size`, so it ignores them.
//! A read lease is pdkv's alone, and MoRIIO's listener raises on its `type` (which ends the
//! listener thread), so a pdkv rank sends one only to a rank that advertised
//! [`Extension::ReadLease`] in its handshake metadata (below). A release or lease to a rank that
//! advertised [`Extension::Incarnation`] also carries `pdkv_incarnation: int`, the incarnation of
//! that rank which holds the transfer ([`Incarnation`](crate::ids::Incarnation), `1..=2^53-1`); the rank ignores one naming
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
//! key changes), and `pdkv_incarnation: int`, the answering rank's [`Incarnation`](crate::ids::Incarnation).
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
//! The code: `message` holds [`ControlMessage`] and dispatches [`encode`] and [`decode`];
//! `notify` and `handshake` hold each family's messages, their wire mirrors and their decoders
//! (`notify` also the release's [`Release`] and the [`Mac`] of releases and leases);
//! `data_plane` pdkv's `agent_metadata`; `framing` how the messages sit in ZeroMQ frames
//! ([`handshake_reply`], [`reply_payload`], [`handshake_request`], [`notify_frame`]); `msgpack`
//! is the bounded MessagePack reader (and the writer of the mirrors), `fields` the typed reading
//! of a map's keys, `limits` the bounds, `error` the [`WireError`]. Each imports from its
//! siblings, never from this file, which only re-exports them.

mod data_plane;
mod error;
mod fields;
mod framing;
mod handshake;
mod limits;
mod message;
mod msgpack;
mod notify;
#[cfg(test)]
mod tests;

pub use data_plane::{
    DataPlane, DataPlaneError, DataTransport, ForeignDataPlane, ForeignKind, DATA_PLANE_VERSION,
};
pub use error::WireError;
pub use framing::{
    handshake_reply, handshake_request, notify_frame, reply_payload, FramingError, HandshakeRequest,
    ReplyPart, DELIMITER, POP_DONE_RECV,
};
pub use handshake::{
    decode_layer_memory_descs, encode_layer_memory_descs, Extension, Extensions, HandshakeMetadata,
    LayerMemoryDesc, RankInfo,
};
pub use limits::{
    MAX_BLOB_BYTES, MAX_BLOCK_IDS, MAX_DEPTH, MAX_DESCS_PER_LAYER, MAX_EXTENSIONS, MAX_LAYERS,
    MAX_MESSAGE_BYTES, MAX_REGIONS, MAX_STR_BYTES, MAX_VALUES,
};
pub use message::{decode, encode, ControlMessage, HANDSHAKE_REQUEST};
pub use notify::{Mac, ReadLease, Release, ReleaseSender, RemoteBlocks, WriteDone, WriteFailed, MAC_BYTES};
