//! Reading and writing a campaign's JSON files: a size-capped read, the `format` line checked
//! before anything else, the file's serde type read strictly, and writes that leave a file whole
//! or not at all.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use serde::de::{DeserializeOwned, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Largest shard or result file read, in bytes. An exploration's shard holds its distinct
/// behaviours (a line each, tens of bytes) and at most a few scenario files per outcome (each at
/// most [`pdkv_sim::load::MAX_SCENARIO_BYTES`]); a sweep's shard a line per point. Sixty-four
/// megabytes is far above both, and keeps `/dev/zero` or a wrong path from filling memory.
pub const MAX_SHARD_BYTES: u64 = 64 << 20;

/// Why a campaign file could not be read, naming the file.
#[derive(Debug)]
pub enum ReadError {
    /// The file cannot be read: not a regular file, too large, or an I/O error (the reason is
    /// [`pdkv_sim::load::read_capped`]'s).
    Unreadable { file: String, reason: String },
    /// The text is not JSON.
    NotJson { file: String, error: serde_json::Error },
    /// The JSON's `format` is missing or not the one this reader takes.
    Format { file: String, found: Option<serde_json::Value>, expected: &'static str },
    /// The format is right, but a field is missing, unknown, of the wrong kind or holds a value
    /// pdkv never writes; serde's message names the field and where it is.
    Field { file: String, error: serde_json::Error },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Unreadable { file, reason } => write!(f, "{file}: cannot read it: {reason}"),
            ReadError::NotJson { file, error } => write!(f, "{file}: not a shard file: not JSON ({error})"),
            // The same kind of file from another version of pdkv: say so, and what to do.
            ReadError::Format { file, found: Some(serde_json::Value::String(found)), expected }
                if found.split('/').next() == expected.split('/').next() =>
            {
                write!(
                    f,
                    "{file}: written by another version of pdkv: `format` is {found:?}, and this pdkv reads \
                     \"{expected}\" only (its fields differ); run that shard again with this pdkv"
                )
            }
            ReadError::Format { file, found, expected } => write!(
                f,
                "{file}: not a shard file: `format` is {}, not \"{expected}\"",
                match found {
                    None => "missing".to_string(),
                    Some(serde_json::Value::String(found)) => format!("{found:?}"),
                    Some(found) => found.to_string(),
                }
            ),
            ReadError::Field { file, error } => write!(f, "{file}: {error}"),
        }
    }
}

impl std::error::Error for ReadError {}

/// The one field read before the rest, leniently, to say what kind of file this is: the
/// `format` of a JSON object, other fields skipped unread.
struct Header(Option<serde_json::Value>);

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Header, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Header;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object with a `format`")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Header, A::Error> {
                let mut format = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "format" {
                        format = Some(map.next_value()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Header(format))
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

/// Reads a file's text as `T`, whose `format` must be `expected`; `file` names it in errors.
pub fn parse<T: DeserializeOwned>(text: &str, expected: &'static str, file: &str) -> Result<T, ReadError> {
    let format = match serde_json::from_str::<Header>(text) {
        Ok(Header(format)) => format,
        // JSON, but not an object: it has no `format`.
        Err(error) if error.is_data() => None,
        Err(error) => return Err(ReadError::NotJson { file: file.to_string(), error }),
    };
    if format.as_ref().and_then(serde_json::Value::as_str) != Some(expected) {
        return Err(ReadError::Format { file: file.to_string(), found: format, expected });
    }
    serde_json::from_str(text).map_err(|error| ReadError::Field { file: file.to_string(), error })
}

/// Reads the file at `path`, a regular file of at most [`MAX_SHARD_BYTES`]. Returns the file's
/// name as messages show it, and its text.
pub fn read_text(path: &Path) -> Result<(String, String), ReadError> {
    let name = path.display().to_string();
    let text = pdkv_sim::load::read_capped(path, MAX_SHARD_BYTES)
        .map_err(|reason| ReadError::Unreadable { file: name.clone(), reason })?;
    Ok((name, text))
}

/// A campaign file's text: pretty JSON and a final newline, so equal values are equal bytes.
pub fn text<T: Serialize>(value: &T) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("campaign files have string keys only");
    text.push('\n');
    text
}

/// Why a file could not be written.
#[derive(Debug)]
pub enum WriteError {
    /// Its folder cannot be created.
    Folder { folder: PathBuf, error: io::Error },
    /// The file cannot be written (a full disk, say); no file of that name is left cut short.
    File { file: PathBuf, error: io::Error },
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::Folder { folder, error } => write!(f, "cannot create {}: {error}", folder.display()),
            WriteError::File { file, error } => write!(f, "cannot write {}: {error}", file.display()),
        }
    }
}

impl std::error::Error for WriteError {}

/// Writes `text` to `file` whole or not at all ([`pdkv_sim::files::write_atomic`]), creating its
/// folder.
pub fn write(file: &Path, text: &str) -> Result<(), WriteError> {
    if let Some(folder) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder)
            .map_err(|error| WriteError::Folder { folder: folder.to_path_buf(), error })?;
    }
    pdkv_sim::files::write_atomic(file, text.as_bytes())
        .map_err(|error| WriteError::File { file: file.to_path_buf(), error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Small {
        format: String,
        n: u64,
    }

    /// (text, what reading it as a `Small` of format `f/1` gives or says).
    #[test]
    fn the_format_is_checked_first_then_every_field() {
        let check = |text: &str, expected: Result<u64, &str>| {
            let got = parse::<Small>(text, "f/1", "x.json");
            match (got, expected) {
                (Ok(small), Ok(n)) => assert_eq!(small, Small { format: "f/1".into(), n }, "{text}"),
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{text}: {e} lacks {want:?}"),
                (got, _) => panic!("{text}: {got:?}, expected {expected:?}"),
            }
        };
        check(r#"{"format": "f/1", "n": 3}"#, Ok(3));
        check("not json", Err("x.json: not a shard file: not JSON (expected"));
        check("[1, 2]", Err("x.json: not a shard file: `format` is missing"));
        check(r#"{"format": "f/1", "n": 3"#, Err("x.json: not a shard file: not JSON (EOF while parsing"));
        check(r#"{"n": 3}"#, Err("x.json: not a shard file: `format` is missing, not \"f/1\""));
        check(
            r#"{"format": "g/1", "n": 3}"#,
            Err("x.json: not a shard file: `format` is \"g/1\", not \"f/1\""),
        );
        check(
            r#"{"format": "f/0", "n": 3}"#,
            Err("x.json: written by another version of pdkv: `format` is \"f/0\", and this pdkv reads \"f/1\" only"),
        );
        check(r#"{"format": 7, "other": 3}"#, Err("x.json: not a shard file: `format` is 7, not \"f/1\""));
        check(r#"{"format": "f/1"}"#, Err("x.json: missing field `n`"));
        check(r#"{"format": "f/1", "n": -1}"#, Err("x.json: invalid value: integer `-1`, expected u64"));
        check(r#"{"format": "f/1", "n": 3, "m": 4}"#, Err("x.json: unknown field `m`"));
    }
}
