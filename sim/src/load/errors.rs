//! Why a scenario could not be loaded ([`ScenarioError`], with its [`Location`]), and the
//! translation of ron's errors into it: the position moved to the start of the offending value,
//! the field path from the scanner ([`super::path`]), and the message in words.

use std::fmt;

use ron::error::{Error as RonError, SpannedError};

use super::legacy_names::{is_legacy_path, legacy_names};
use super::path::{ident_end, is_ident_start, location_of, scan, skip_blank, skip_string, Location};
use crate::profiles::ProfileError;

/// Why a scenario could not be loaded. `origin` is the file path (or a name such as
/// `<notation>`); `field` is a dotted path such as `workload.clients.concurrency`.
#[derive(Clone, Debug, PartialEq)]
pub enum ScenarioError {
    /// The file could not be read.
    Io {
        /// The path as given.
        origin: String,
        /// The operating system's reason.
        message: String,
    },
    /// The text is not well-formed RON (a missing comma or parenthesis, an unterminated string,
    /// text after the end, a field given twice).
    Syntax {
        /// File or name of the text.
        origin: String,
        /// Where ron stopped.
        at: Location,
        /// The field being read there, when there was one.
        field: Option<String>,
        /// What was wrong, in words.
        message: String,
    },
    /// A field the scenario format does not have (unknown fields are rejected, not ignored).
    UnknownField {
        /// File or name of the text.
        origin: String,
        /// Where the unknown name starts.
        at: Location,
        /// Dotted path of the unknown field, e.g. `workload.clients.extra`.
        field: String,
        /// The fields allowed at that place.
        expected: Vec<String>,
    },
    /// A field without a default is absent (`name`, `deployment`, and the fields of enum forms
    /// such as `Closed(concurrency, requests)`).
    MissingField {
        /// File or name of the text.
        origin: String,
        /// The closing parenthesis of the struct that lacks the field.
        at: Location,
        /// Dotted path of the missing field.
        field: String,
    },
    /// A value of the wrong type: a string where a number belongs, a negative or too large
    /// integer, a decimal number where a whole one belongs.
    WrongType {
        /// File or name of the text.
        origin: String,
        /// Where the value starts.
        at: Location,
        /// Dotted path of the field, when one could be found.
        field: Option<String>,
        /// What was expected and what was found.
        message: String,
    },
    /// A name that is not one of an enum's forms (a legacy option, an outcome, `Closed`/`Open`).
    UnknownVariant {
        /// File or name of the text.
        origin: String,
        /// Where the name starts.
        at: Location,
        /// Dotted path of the field, when one could be found.
        field: Option<String>,
        /// The name written.
        found: String,
        /// The names allowed.
        expected: Vec<String>,
    },
    /// Well-formed and well-typed, but a value breaks a rule of [`validate`](super::validate()).
    Invalid {
        /// File or name of the text.
        origin: String,
        /// Where the field's name is written; `None` when the file leaves it at its default.
        at: Option<Location>,
        /// Dotted path of the field.
        field: String,
        /// The rule broken and the value found.
        message: String,
    },
    /// The scenario's `profiles` cannot be applied: a name its file lacks, a field written with
    /// another value than the named profile's, or a profile file that does not load.
    Profile {
        /// File or name of the text.
        origin: String,
        /// Where the field's name is written, when it is.
        at: Option<Location>,
        /// Dotted path of the field: `profiles.gpu` (or `.nic`, `.model`) for the name, the
        /// written field (e.g. `hardware.hbm_gb`) for a conflict, the entry (e.g.
        /// `profiles.overrides[0]`) for a bad override.
        field: String,
        /// What is wrong.
        error: Box<ProfileError>,
    },
}

impl ScenarioError {
    /// The file or name the error is about.
    pub fn origin(&self) -> &str {
        match self {
            ScenarioError::Io { origin, .. }
            | ScenarioError::Syntax { origin, .. }
            | ScenarioError::UnknownField { origin, .. }
            | ScenarioError::MissingField { origin, .. }
            | ScenarioError::WrongType { origin, .. }
            | ScenarioError::UnknownVariant { origin, .. }
            | ScenarioError::Invalid { origin, .. }
            | ScenarioError::Profile { origin, .. } => origin,
        }
    }

    /// Where in the text the error is, when known.
    pub fn location(&self) -> Option<Location> {
        match self {
            ScenarioError::Io { .. } => None,
            ScenarioError::Syntax { at, .. }
            | ScenarioError::UnknownField { at, .. }
            | ScenarioError::MissingField { at, .. }
            | ScenarioError::WrongType { at, .. }
            | ScenarioError::UnknownVariant { at, .. } => Some(*at),
            ScenarioError::Invalid { at, .. } | ScenarioError::Profile { at, .. } => *at,
        }
    }

    /// The dotted path of the field the error is about, when known.
    pub fn field(&self) -> Option<&str> {
        match self {
            ScenarioError::Io { .. } => None,
            ScenarioError::UnknownField { field, .. }
            | ScenarioError::MissingField { field, .. }
            | ScenarioError::Invalid { field, .. }
            | ScenarioError::Profile { field, .. } => Some(field),
            ScenarioError::Syntax { field, .. }
            | ScenarioError::WrongType { field, .. }
            | ScenarioError::UnknownVariant { field, .. } => field.as_deref(),
        }
    }
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `origin:line:column: ` like a compiler, so editors can jump to it.
        write!(f, "{}:", self.origin())?;
        if let Some(at) = self.location() {
            write!(f, "{at}:")?;
        }
        match self {
            ScenarioError::Io { message, .. } => write!(f, " cannot read the scenario file: {message}"),
            ScenarioError::Syntax { field, message, .. }
            | ScenarioError::WrongType { field, message, .. } => match field {
                Some(field) => write!(f, " field `{field}`: {message}"),
                None => write!(f, " {message}"),
            },
            ScenarioError::UnknownField { field, expected, .. } => {
                write!(f, " unknown field `{field}`; expected one of: {}", expected.join(", "))
            }
            ScenarioError::MissingField { field, .. } => {
                write!(f, " missing field `{field}`, which has no default")
            }
            ScenarioError::UnknownVariant { field, found, expected, .. } => {
                let legacy = field.as_deref().is_some_and(is_legacy_path);
                if let Some(field) = field {
                    write!(f, " field `{field}`:")?;
                }
                if legacy {
                    write!(f, " unknown legacy option `{found}`; known options: {}", expected.join(", "))
                } else {
                    write!(f, " unknown name `{found}`; expected one of: {}", expected.join(", "))
                }
            }
            ScenarioError::Invalid { field, message, .. } => write!(f, " field `{field}`: {message}"),
            ScenarioError::Profile { field, error, .. } => write!(f, " field `{field}`: {error}"),
        }
    }
}

impl std::error::Error for ScenarioError {}

pub(super) fn from_ron_error(origin: &str, text: &str, err: SpannedError) -> ScenarioError {
    let reported = Location { line: err.span.start.line, column: err.span.start.col };
    let offset = value_start(text, offset_of(text, reported), &err.code);
    let at = location_of(text, offset);
    let scanned = scan(text, offset, &|_| false);
    let origin = origin.to_string();
    let full = non_empty(scanned.path_at_stop.clone());
    match err.code {
        RonError::NoSuchStructField { expected, found, .. } => ScenarioError::UnknownField {
            origin,
            at,
            // A name can be as long as the file; messages show its start.
            field: join(&scanned.container_at_stop, &shorten(&found)),
            expected: expected.iter().map(|name| name.to_string()).collect(),
        },
        RonError::MissingStructField { field, .. } => {
            ScenarioError::MissingField { origin, at, field: join(&scanned.container_at_stop, field) }
        }
        RonError::DuplicateStructField { field, .. } => ScenarioError::Syntax {
            origin,
            at,
            field: Some(join(&scanned.container_at_stop, field)),
            message: "the field is given twice".to_string(),
        },
        RonError::Message(message) if message.ends_with(crate::unique_keys::WRITTEN_TWICE) => {
            ScenarioError::Syntax { origin, at, field: full, message }
        }
        RonError::NoSuchEnumVariant { expected, found, .. } => ScenarioError::UnknownVariant {
            origin,
            at,
            field: full,
            found: shorten(&found),
            expected: expected.iter().map(|name| name.to_string()).collect(),
        },
        code => {
            let found = describe_token(text, offset);
            let legacy_hint = match &full {
                Some(path) if is_legacy_path(path) => format!("; known legacy options: {}", legacy_names()),
                _ => String::new(),
            };
            if only_blank_after(text, 0) {
                let message = "the text is empty; a scenario is at least (name: \"..\", deployment: \"..\")";
                return ScenarioError::Syntax { origin, at, field: None, message: message.to_string() };
            }
            match wrong_type_message(&code, text, offset, &found) {
                Some(message) => {
                    ScenarioError::WrongType { origin, at, field: full, message: message + &legacy_hint }
                }
                None => ScenarioError::Syntax {
                    origin,
                    at,
                    field: full,
                    message: syntax_message(&code, text, offset, &found),
                },
            }
        }
    }
}

/// Moves ron's error offset to the start of the offending value: ron sometimes reports the
/// blank before a value, the digits after a minus sign, or the `.` of `1.5`.
fn value_start(text: &str, offset: usize, code: &RonError) -> usize {
    let bytes = text.as_bytes();
    let mut offset = offset;
    if bytes.get(offset).is_some_and(|b| b.is_ascii_whitespace()) && !only_blank_after(text, offset) {
        offset = skip_blank(bytes, offset);
    }
    if matches!(code, RonError::ExpectedComma) && decimal_point_after_digits(text, offset) {
        while offset > 0 && bytes[offset - 1].is_ascii_digit() {
            offset -= 1;
        }
    }
    // A legacy name that step 1 turned into `r#name`: point at its opening quote.
    if offset >= 2 && &bytes[offset - 2..offset] == b"r#" {
        offset -= 2;
    }
    if offset > 0 && bytes[offset - 1] == b'-' && bytes.get(offset).is_some_and(|b| b.is_ascii_digit()) {
        offset -= 1;
    }
    offset
}

/// The message for ron errors that mean "a value of the wrong type"; `None` for the others.
fn wrong_type_message(code: &RonError, text: &str, offset: usize, found: &str) -> Option<String> {
    let expected = match code {
        RonError::ExpectedBoolean => "`true` or `false`",
        RonError::ExpectedFloat => "a number",
        RonError::ExpectedInteger => "a whole number",
        RonError::ExpectedString => "a string in double quotes",
        RonError::ExpectedIdentifier => "a name",
        RonError::ExpectedArray => "a list `[...]`",
        RonError::ExpectedStructLike | RonError::ExpectedNamedStructLike(_) => "`(`",
        RonError::ExpectedUnit => "`()`",
        RonError::ExpectedOption => "a value, `Some(..)` or `None`",
        RonError::IntegerOutOfBounds => {
            return Some(if text[offset..].starts_with('-') {
                format!("{found} is negative; this field takes a whole number of at least 0")
            } else {
                format!("{found} is too large for this field")
            });
        }
        RonError::InvalidIntegerDigit { .. } => "a whole number",
        RonError::InvalidValueForType { expected, found } => {
            return Some(format!("expected {expected}, found {found}"));
        }
        RonError::ExpectedDifferentLength { expected, found } => {
            return Some(format!("expected {expected}, found {found} elements"));
        }
        RonError::Message(message) => return Some(message.clone()),
        // ron reads `1.5` where an integer belongs as `1` followed by an unexpected `.5`.
        RonError::ExpectedComma if decimal_number_at(text, offset) => {
            return Some("expected a whole number, found a decimal number".to_string());
        }
        _ => return None,
    };
    Some(format!("expected {expected}, found {found}"))
}

fn syntax_message(code: &RonError, text: &str, offset: usize, found: &str) -> String {
    if only_blank_after(text, offset) {
        let missing = match code {
            RonError::ExpectedComma
            | RonError::ExpectedStructLikeEnd
            | RonError::ExpectedArrayEnd
            | RonError::Eof => "a closing `)` or `]` is missing",
            RonError::ExpectedStringEnd => "a string is not closed with `\"`",
            _ => "the text ends too early",
        };
        return format!("unexpected end of file: {missing}");
    }
    match code {
        RonError::ExpectedComma => {
            format!("expected `,` or a closing bracket after the value, found {found}")
        }
        RonError::ExpectedStringEnd => "a string is not closed with `\"`".to_string(),
        RonError::TrailingCharacters => {
            format!("unexpected {found} after the end of the scenario's closing `)`")
        }
        other => {
            let message = other.to_string();
            let mut chars = message.chars();
            // ron's messages start with a capital; ours continue a sentence.
            match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => message,
            }
        }
    }
}

fn decimal_point_after_digits(text: &str, offset: usize) -> bool {
    text[offset..].starts_with('.')
        && text[..offset].chars().next_back().is_some_and(|c| c.is_ascii_digit())
        && text[offset + 1..].chars().next().is_some_and(|c| c.is_ascii_digit())
}

/// True when a number with a fractional part (`1.5`, `-2.25`) starts at `offset`.
fn decimal_number_at(text: &str, offset: usize) -> bool {
    let rest = text[offset..].trim_start_matches('-');
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0
        && rest[digits..].starts_with('.')
        && rest[digits + 1..].starts_with(|c: char| c.is_ascii_digit())
}

/// True when only whitespace and comments follow `offset`.
fn only_blank_after(text: &str, offset: usize) -> bool {
    let bytes = text.as_bytes();
    skip_blank(bytes, offset) >= bytes.len()
}

/// A few words for the value starting at `offset`, e.g. ``the string "fast"``.
fn describe_token(text: &str, offset: usize) -> String {
    let rest = &text[offset..];
    let Some(first) = rest.chars().next() else {
        return "the end of the file".to_string();
    };
    let bytes = text.as_bytes();
    if first == '"' {
        let end = skip_string(bytes, offset);
        return format!("the string {}", shorten(&text[offset..end]));
    }
    if first.is_ascii_digit() || first == '-' || first == '+' || first == '.' {
        let end = rest
            .char_indices()
            .find(|&(i, c)| i > 0 && !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_')))
            .map_or(rest.len(), |(i, _)| i);
        return format!("the number `{}`", shorten(&rest[..end]));
    }
    if is_ident_start(first) {
        let end = ident_end(bytes, offset);
        return format!("`{}`", shorten(&text[offset..end]));
    }
    match first {
        '(' => "`(`".to_string(),
        '[' => "a list `[`".to_string(),
        '{' => "a map `{`".to_string(),
        other => format!("`{other}`"),
    }
}

fn shorten(token: &str) -> String {
    const MAX: usize = 40;
    if token.chars().count() <= MAX {
        token.to_string()
    } else {
        token.chars().take(MAX).chain("...".chars()).collect()
    }
}

fn non_empty(path: String) -> Option<String> {
    if path.is_empty() {
        None
    } else {
        Some(path)
    }
}

fn join(container: &str, field: &str) -> String {
    if container.is_empty() {
        field.to_string()
    } else {
        format!("{container}.{field}")
    }
}

/// Byte offset of a (line, column) position; positions past the end give the text's length.
fn offset_of(text: &str, at: Location) -> usize {
    let mut line = 1;
    let mut column = 1;
    for (offset, c) in text.char_indices() {
        if line == at.line && column == at.column {
            return offset;
        }
        if c == '\n' {
            if line == at.line {
                // A column past the end of its line: point at the line break.
                return offset;
            }
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    text.len()
}

#[cfg(test)]
mod tests {
    use super::super::parse_scenario;
    use super::super::test_support::{check_err, fault, with, Kind};

    #[test]
    fn load_reading_errors_name_the_field() {
        use Kind::{MissingField, Syntax, UnknownVariant, WrongType};
        let table: Vec<(String, (Kind, &str, &str))> = vec![
            (
                with("workload: (clients: Half(concurrency: 3))"),
                (UnknownVariant, "workload.clients", "unknown name `Half`; expected one of: Closed, Open"),
            ),
            (with("protocol: (reads: Whole)"), (UnknownVariant, "protocol.reads", "PerLayer, PerRequest")),
            (
                with("protocol: (legacy: [\"lazy handshake\"])"),
                (WrongType, "protocol.legacy[0]", "known legacy options: read-from-dp0,"),
            ),
            (
                with("workload: (clients: Closed(concurrency: 3))"),
                (MissingField, "workload.clients.requests", "missing field `workload.clients.requests`"),
            ),
            (with("model: (use_mla: 1)"), (WrongType, "model.use_mla", "expected `true` or `false`")),
            (with("model: (kv_heads: 70000)"), (WrongType, "model.kv_heads", "`70000` is too large")),
            (
                with("workload: (input_tokens: Fixed(\"a\"))"),
                (WrongType, "workload.input_tokens", "expected a whole number, found the string \"a\""),
            ),
            (
                fault("P0.dp0.tp0", "NicDown").replace("\"P0.dp0.tp0\"", "5"),
                (WrongType, "faults.timeline[0].target", "expected a string in double quotes"),
            ),
            (with("seed: 1, seed: 2"), (Syntax, "seed", "given twice")),
            (with("description: \"open"), (Syntax, "description", "a string is not closed")),
        ];
        for (text, expected) in &table {
            check_err(text, *expected);
        }
        // Errors outside any field.
        for (text, says) in [
            (with(") trailing"), "unexpected `trailing` after the end"),
            (String::new(), "the text is empty"),
            ("// only a comment\n".to_string(), "the text is empty"),
            ("[1]".to_string(), "expected `(`"),
        ] {
            let err = parse_scenario(&text, "<table>").map(|s| s.name).unwrap_err();
            assert_eq!(err.field(), None, "{text}: {err}");
            assert!(err.to_string().contains(says), "{text}: {err}");
        }
    }
}
