//! A bounded MessagePack reader into a small value tree, the first stage of decoding: limits on
//! size, depth and value count are checked against the bytes before anything is allocated. Also
//! the one writer, [`named`], which encodes the wire mirrors of `notify` and `handshake`.

use serde::Serialize;

use super::error::WireError;
use super::limits::{MAX_DEPTH, MAX_MESSAGE_BYTES, MAX_VALUES};

/// Serializes one of the wire mirrors as a named map. Writing into a `Vec` cannot fail and every
/// container has a known length, so rmp-serde has no error to return here; an error would be a
/// bug in this module.
pub(super) fn named<T: Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(value).expect("rmp-serde cannot fail writing a known-length value to a Vec")
}

// Decoding, first stage: a bounded MessagePack reader into a small value tree. It is written
// here rather than taken from rmp-serde because the checks the wire needs are about the bytes:
// rmp-serde hands a visitor a bin and a str with invalid UTF-8 through the same `visit_bytes`,
// cannot name the field a type error is in, and does not report where a value ended.

/// A parsed MessagePack value. Floats and extensions are only ever ignored or reported as the
/// wrong type, so their payload is not kept.
#[derive(Debug)]
pub(super) enum Value {
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
    pub(super) fn kind(&self) -> &'static str {
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
pub(super) fn parse_whole(bytes: &[u8]) -> Result<Value, WireError> {
    let mut reader = Reader { bytes, pos: 0, values: 0 };
    let value = reader.value(0)?;
    if reader.pos != bytes.len() {
        return Err(WireError::TrailingBytes { offset: reader.pos, len: bytes.len() });
    }
    Ok(value)
}

pub(super) fn check_size(bytes: &[u8]) -> Result<(), WireError> {
    if bytes.is_empty() {
        return Err(WireError::Empty);
    }
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLarge { len: bytes.len(), max: MAX_MESSAGE_BYTES });
    }
    Ok(())
}
