//! The wire's bounds: the largest message, the deepest nesting and the longest field the decoder
//! takes, each a named constant so that memory stays bounded by the input.

/// Largest input [`decode`](super::decode) looks at; a MoRIIO control frame is a few hundred bytes, and the
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
