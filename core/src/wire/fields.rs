//! Decoding's second stage: typed fields out of a MessagePack map, each checked against its
//! wire key and limits, so that every error names the key at fault.

use std::collections::BTreeMap;

use super::error::WireError;
use super::limits::{MAX_BLOB_BYTES, MAX_STR_BYTES};
use super::msgpack::Value;

/// The keys of a message map, each once, with their values.
pub(super) struct Fields(BTreeMap<String, Value>);

impl Fields {
    pub(super) fn from_entries(entries: Vec<(Value, Value)>) -> Result<Fields, WireError> {
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

    pub(super) fn has(&self, field: &str) -> bool {
        self.0.contains_key(field)
    }

    pub(super) fn take(&mut self, field: &'static str) -> Option<Value> {
        self.0.remove(field)
    }

    pub(super) fn required(&mut self, field: &'static str) -> Result<Value, WireError> {
        self.take(field).ok_or(WireError::MissingField { field })
    }

    /// A non-empty string of at most [`MAX_STR_BYTES`].
    pub(super) fn str(&mut self, field: &'static str) -> Result<String, WireError> {
        let value = self.required(field)?;
        string(field, value)
    }

    pub(super) fn opt_str(&mut self, field: &'static str) -> Result<Option<String>, WireError> {
        self.take(field).map(|v| string(field, v)).transpose()
    }

    pub(super) fn int(&mut self, field: &'static str, min: i128, max: i128) -> Result<i128, WireError> {
        let value = self.required(field)?;
        int(field, value, min, max)
    }

    pub(super) fn opt_int(
        &mut self,
        field: &'static str,
        min: i128,
        max: i128,
    ) -> Result<Option<i128>, WireError> {
        self.take(field).map(|v| int(field, v, min, max)).transpose()
    }

    /// An optional list of strings (each as [`Fields::str`]), with at most `max_len` entries.
    pub(super) fn opt_str_list(
        &mut self,
        field: &'static str,
        max_len: usize,
    ) -> Result<Option<Vec<String>>, WireError> {
        let items = match self.take(field) {
            None => return Ok(None),
            Some(Value::Array(items)) => items,
            Some(other) => {
                return Err(WireError::WrongType { field, expected: "array", found: other.kind() })
            }
        };
        if items.len() > max_len {
            return Err(WireError::TooMany { field, len: items.len(), max: max_len });
        }
        items.into_iter().map(|v| string(field, v)).collect::<Result<_, _>>().map(Some)
    }

    /// A list of integers in `min..=max`, with at most `max_len` entries.
    pub(super) fn int_list(
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

pub(super) fn string(field: &'static str, value: Value) -> Result<String, WireError> {
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

pub(super) fn int(field: &'static str, value: Value, min: i128, max: i128) -> Result<i128, WireError> {
    match value {
        Value::Int(v) if (min..=max).contains(&v) => Ok(v),
        Value::Int(v) => Err(WireError::OutOfRange { field, value: v, min, max }),
        other => Err(WireError::WrongType { field, expected: "int", found: other.kind() }),
    }
}

pub(super) fn blob(field: &'static str, value: Value) -> Result<Vec<u8>, WireError> {
    match value {
        Value::Bin(b) if b.len() > MAX_BLOB_BYTES => {
            Err(WireError::TooLong { field, len: b.len(), max: MAX_BLOB_BYTES })
        }
        Value::Bin(b) => Ok(b),
        other => Err(WireError::WrongType { field, expected: "bin", found: other.kind() }),
    }
}

pub(super) const U16_MAX: i128 = u16::MAX as i128;
pub(super) const U32_MAX: i128 = u32::MAX as i128;
pub(super) const U64_MAX: i128 = u64::MAX as i128;

/// Reads the optional `pdkv_incarnation` key: an incarnation in `1..=Incarnation::MAX`.
pub(super) fn opt_incarnation(f: &mut Fields) -> Result<Option<crate::ids::Incarnation>, WireError> {
    let max = i128::from(crate::ids::Incarnation::MAX);
    Ok(f.opt_int("pdkv_incarnation", 1, max)?.and_then(|v| crate::ids::Incarnation::new(narrow(v))))
}

/// Narrows a value already checked to lie within the target type's range; the fallback is
/// unreachable and only keeps the conversion free of panics.
pub(super) fn narrow<T: TryFrom<i128> + Default>(v: i128) -> T {
    T::try_from(v).unwrap_or_default()
}

/// Three keys that come all together or not at all; the first missing one is reported.
pub(super) fn group<A, B, C>(
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
