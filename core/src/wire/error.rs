//! Why bytes are not a valid control message: [`WireError`], naming the wire key at fault.

use std::fmt;

#[cfg(doc)]
use super::limits::{
    MAX_BLOB_BYTES, MAX_BLOCK_IDS, MAX_DEPTH, MAX_DESCS_PER_LAYER, MAX_LAYERS, MAX_MESSAGE_BYTES,
    MAX_REGIONS, MAX_STR_BYTES, MAX_VALUES,
};

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
    /// A blob whose length is fixed (a MAC) has another length.
    WrongLength {
        /// The wire key.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The length it must have.
        expected: usize,
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
            WireError::WrongLength { field, len, expected } => {
                write!(f, "field `{field}` is {len} bytes, not {expected}")
            }
            WireError::RankOutOfGroup { field, rank, size } => {
                write!(f, "field `{field}` is {rank}, not below its TP size {size}")
            }
        }
    }
}

impl std::error::Error for WireError {}
