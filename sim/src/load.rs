//! Loading scenario files: RON text to a checked [`Scenario`], with errors that name the file, the
//! line and column, and the dotted field path; and printing a scenario back as RON.
//!
//! Reading happens in three steps:
//!
//! 1. Legacy option names written as strings (`legacy: ["lazy-handshake"]`) are turned into RON
//!    raw identifiers (`r#lazy-handshake`), which is what serde's enum derive needs. `"x"` and
//!    `r#x` have the same length, so every line and column the later steps report is still
//!    right for the text the user wrote.
//! 2. `ron` deserializes the text (with the `implicit_some` extension, so `expect: hang` and
//!    `duration_ms: 500` need no `Some(..)`). ron reports a line and column but not which field
//!    it was reading, so a small scanner (`scan`) walks the text up to that position, tracking
//!    `key:` names and list indexes through the brackets, and rebuilds the dotted path (e.g.
//!    `workload.clients.concurrency`, `faults.timeline[1].target`).
//! 3. [`validate`] checks what serde cannot (positive sizes, probabilities, routable engine
//!    pairs, fault targets inside the deployment). Its violations name a dotted path; the same
//!    scanner finds where that field's `key:` is written. A field the file leaves at its default
//!    has no key; the error then points at the nearest enclosing field written in the file, or
//!    carries no position at all.

use std::fmt;
use std::path::Path;

use pdkv_core::ids::Role;
use pdkv_core::legacy::Legacy;
use pdkv_core::routing::check_pair;
use pdkv_core::topology::{Deployment, Layout, ModelSpec};
use ron::error::{Error as RonError, SpannedError};
use ron::extensions::Extensions;

use crate::cost::Cost;
use crate::scenario::{
    Clients, FaultKind, JainBounds, Length, Scenario, MAX_CONCURRENCY, MAX_ENGINE_CRASHES, MAX_EVENTS,
    MAX_KV_BYTES_PER_GPU, MAX_MODEL_DIMENSION, MAX_REQUESTS, MAX_TIMELINE_FAULTS, MAX_TIME_MS, MAX_TIME_US,
    MAX_TOKENS, MAX_TOTAL_KV_BLOCKS, MAX_VIRTUAL_TIME_S, MIN_SLOW_NIC_FACTOR, RATE_RANGE,
};

/// A place in a scenario's text: 1-based line and column, columns counted in characters (as ron
/// counts them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// Line, from 1.
    pub line: usize,
    /// Column, from 1, in characters.
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

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
    /// Well-formed and well-typed, but a value breaks a rule of [`validate`].
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
            | ScenarioError::Invalid { origin, .. } => origin,
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
            ScenarioError::Invalid { at, .. } => *at,
        }
    }

    /// The dotted path of the field the error is about, when known.
    pub fn field(&self) -> Option<&str> {
        match self {
            ScenarioError::Io { .. } => None,
            ScenarioError::UnknownField { field, .. }
            | ScenarioError::MissingField { field, .. }
            | ScenarioError::Invalid { field, .. } => Some(field),
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
        }
    }
}

impl std::error::Error for ScenarioError {}

/// A rule of the scenario format that a parsed scenario breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Dotted path of the offending field, e.g. `faults.timeline[0].target`.
    pub field: String,
    /// The rule and the value found.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field `{}`: {}", self.field, self.message)
    }
}

/// The ron options every scenario is read and written with: `implicit_some`, so optional fields
/// take a bare value (`expect: hang`, `duration_ms: 500`); `Some(..)` is still accepted.
fn ron_options() -> ron::Options {
    ron::Options::default().with_default_extension(Extensions::IMPLICIT_SOME)
}

/// Parses and validates a scenario from RON text; `origin` (a path, or a name such as
/// `<notation>`) is only used in error messages.
pub fn parse_scenario(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
    if let Some(offset) = scan(text, text.len(), &|_| false).too_deep {
        return Err(ScenarioError::Syntax {
            origin: origin.to_string(),
            at: location_of(text, offset),
            field: None,
            message: format!(
                "brackets nested more than {MAX_NESTING} deep; a scenario nests about six (faults, \
                 timeline, a fault, its form)"
            ),
        });
    }
    let text = raw_legacy_names(text);
    let scenario: Scenario =
        ron_options().from_str(&text).map_err(|err| from_ron_error(origin, &text, err))?;
    validate(&scenario).map_err(|violation| ScenarioError::Invalid {
        origin: origin.to_string(),
        at: locate(&text, &violation.field),
        field: violation.field,
        message: violation.message,
    })?;
    Ok(scenario)
}

/// Largest scenario file read, in bytes: the largest useful scenario (a thousand timed faults)
/// is a few hundred kilobytes, and a bound keeps `/dev/zero` or a wrong path from filling memory.
pub const MAX_SCENARIO_BYTES: u64 = 1 << 20;

/// Reads at most `limit` bytes of the file at `path` as UTF-8 text; a longer file (or an endless
/// one such as `/dev/zero`) is an error naming the limit, so no input can fill memory.
pub fn read_capped(path: &Path, limit: u64) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|err| err.to_string())?;
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|err| err.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!("the file is larger than {limit} bytes, the most this command reads"));
    }
    String::from_utf8(bytes).map_err(|err| format!("not UTF-8 text ({err})"))
}

/// Reads the file at `path` (at most [`MAX_SCENARIO_BYTES`]) and parses it with
/// [`parse_scenario`], naming the path in errors.
pub fn load_scenario(path: &Path) -> Result<Scenario, ScenarioError> {
    let origin = path.display().to_string();
    match read_capped(path, MAX_SCENARIO_BYTES) {
        Ok(text) => parse_scenario(&text, &origin),
        Err(message) => Err(ScenarioError::Io { origin, message }),
    }
}

/// The scenario as pretty RON without struct names, with legacy names as strings, and without
/// the optional fields that are absent (RON would print them as `None`, which reads as Rust
/// rather than as a scenario; each defaults to absent when read); reading the result with
/// [`parse_scenario`] gives the same scenario back.
pub fn scenario_to_ron(scenario: &Scenario) -> String {
    let config = ron::ser::PrettyConfig::default().indentor("    ");
    // ron fails only when the writer fails (a String never does) or nesting exceeds the
    // recursion limit (the scenario is six levels deep), so failure is a programmer error.
    let text = ron_options().to_string_pretty(scenario, config).expect("a scenario always serializes to RON");
    quoted_legacy_names(&text)
}

// ---------------------------------------------------------------------------------------------
// From ron's errors to ours.

fn from_ron_error(origin: &str, text: &str, err: SpannedError) -> ScenarioError {
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

fn legacy_names() -> String {
    let names: Vec<&str> = Legacy::ALL.iter().map(|option| option.name()).collect();
    names.join(", ")
}

fn is_legacy_path(path: &str) -> bool {
    path == "protocol.legacy" || path.starts_with("protocol.legacy[")
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

fn location_of(text: &str, offset: usize) -> Location {
    let before = &text[..offset];
    let line = 1 + before.matches('\n').count();
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Location { line, column: 1 + before[line_start..].chars().count() }
}

/// Where the field at dotted `path` is written: its `key:`, or for a list element its first
/// character. When the path is not in the text (the field keeps its default), the nearest
/// enclosing field that is; `None` when not even the top-level field is written.
fn locate(text: &str, path: &str) -> Option<Location> {
    // Only the anchors of `path` and its ancestors are kept: a large file has many others.
    let scanned = scan(text, text.len(), &|anchor| path.starts_with(anchor));
    let mut wanted = path;
    loop {
        if let Some(anchor) = scanned.anchors.iter().find(|anchor| anchor.path == wanted) {
            return Some(location_of(text, anchor.offset));
        }
        wanted = &wanted[..wanted.rfind(['.', '['])?];
    }
}

// ---------------------------------------------------------------------------------------------
// The scanner.
//
// It does not parse RON; it only follows brackets, skips strings and comments, and notices
// `identifier:` (a struct field) and `,` (the next field or list element). That is enough to
// know which field any position of a well-formed prefix belongs to, which is all ron's errors
// need (ron has read that prefix successfully before it stopped).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bracket {
    /// `(`: a struct, struct variant, tuple or `Some(..)`; tracks its current field.
    Paren,
    /// `[`: a list; tracks its current element.
    Square,
    /// `{`: a map; not part of the scenario format, followed only to stay in step.
    Curly,
}

#[derive(Debug)]
struct Frame {
    bracket: Bracket,
    /// The field whose value is being read (`Paren` only).
    key: Option<String>,
    /// The element being read (`Square` only).
    index: usize,
    /// Whether the current element has begun (`Square` only), to anchor it once.
    started: bool,
}

impl Frame {
    /// The path component this frame adds: `.key` inside a struct, `[i]` inside a list.
    fn push_component(&self, path: &mut String) {
        match self.bracket {
            Bracket::Paren => {
                if let Some(key) = &self.key {
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push_str(key);
                }
            }
            Bracket::Square => path.push_str(&format!("[{}]", self.index)),
            Bracket::Curly => {}
        }
    }
}

fn render(frames: &[Frame]) -> String {
    let mut path = String::new();
    for frame in frames {
        frame.push_component(&mut path);
    }
    path
}

/// Where a field's `key:` or a list element starts, with its dotted path.
#[derive(Debug)]
struct Anchor {
    path: String,
    offset: usize,
}

/// A string literal or raw identifier used as a value, with its path and byte range.
#[derive(Debug)]
struct Atom {
    path: String,
    start: usize,
    end: usize,
    quoted: bool,
}

#[derive(Debug, Default)]
struct Scanned {
    anchors: Vec<Anchor>,
    atoms: Vec<Atom>,
    /// Path of the value being read at the stop offset, e.g. `workload.clients.concurrency`.
    path_at_stop: String,
    /// Path of the struct being read at the stop offset, without its current field, e.g.
    /// `workload.clients` (unknown and missing fields are named relative to it).
    container_at_stop: String,
    /// Where a bracket opened past [`MAX_NESTING`] levels, if one did; the scan stops there.
    too_deep: Option<usize>,
}

/// Deepest bracket nesting a scenario may have. A scenario nests about six levels; the bound
/// keeps the scanner's paths short, so its work stays linear in the size of the file.
const MAX_NESTING: usize = 16;

/// Longest field name kept in a scanned path, in bytes (the format's longest is 30); a longer
/// name is cut, which only shortens the path in an error about that very name.
const MAX_KEY_BYTES: usize = 64;

/// Scans `text`, recording the paths at `stop` (a byte offset), and every anchor and atom whose
/// path `keep` accepts. It stops at a bracket nested deeper than [`MAX_NESTING`].
fn scan(text: &str, stop: usize, keep: &dyn Fn(&str) -> bool) -> Scanned {
    let bytes = text.as_bytes();
    let mut frames: Vec<Frame> = Vec::new();
    let mut out = Scanned::default();
    let mut stopped = false;
    let mut i = 0;
    loop {
        if !stopped && i >= stop {
            stopped = true;
            out.path_at_stop = render(&frames);
            out.container_at_stop = frames.split_last().map(|(_, outer)| render(outer)).unwrap_or_default();
        }
        let Some(&c) = bytes.get(i) else { break };
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            b'/' if matches!(bytes.get(i + 1), Some(b'/') | Some(b'*')) => i = skip_comment(bytes, i),
            b'"' => {
                begin_value(&mut frames, &mut out, i, keep);
                let end = skip_string(bytes, i);
                let path = render(&frames);
                if keep(&path) {
                    out.atoms.push(Atom { path, start: i, end, quoted: true });
                }
                i = end;
            }
            b'\'' => {
                begin_value(&mut frames, &mut out, i, keep);
                i = skip_char_literal(bytes, i);
            }
            b'r' if raw_string_hashes(bytes, i).is_some() => {
                begin_value(&mut frames, &mut out, i, keep);
                i = skip_raw_string(bytes, i);
            }
            b'(' | b'[' | b'{' => {
                if frames.len() >= MAX_NESTING {
                    out.too_deep = Some(i);
                    break;
                }
                begin_value(&mut frames, &mut out, i, keep);
                let bracket = match c {
                    b'(' => Bracket::Paren,
                    b'[' => Bracket::Square,
                    _ => Bracket::Curly,
                };
                frames.push(Frame { bracket, key: None, index: 0, started: false });
                i += 1;
            }
            b')' | b']' | b'}' => {
                frames.pop();
                i += 1;
            }
            b',' => {
                if let Some(frame) = frames.last_mut() {
                    frame.key = None;
                    frame.index += 1;
                    frame.started = false;
                }
                i += 1;
            }
            _ if is_ident_start_byte(bytes, i) => {
                let end = ident_end(bytes, i);
                let after = skip_blank(bytes, end);
                let in_struct = frames.last().is_some_and(|frame| frame.bracket == Bracket::Paren);
                if in_struct && bytes.get(after) == Some(&b':') {
                    let name = text[i..end].trim_start_matches("r#");
                    let mut cut = name.len().min(MAX_KEY_BYTES);
                    while !name.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    if let Some(frame) = frames.last_mut() {
                        frame.key = Some(name[..cut].to_string());
                    }
                    let path = render(&frames);
                    if keep(&path) {
                        out.anchors.push(Anchor { path, offset: i });
                    }
                    i = after + 1;
                } else {
                    begin_value(&mut frames, &mut out, i, keep);
                    if bytes[i..].starts_with(b"r#") {
                        let path = render(&frames);
                        if keep(&path) {
                            out.atoms.push(Atom { path, start: i, end, quoted: false });
                        }
                    }
                    i = end;
                }
            }
            _ => {
                begin_value(&mut frames, &mut out, i, keep);
                i += 1;
            }
        }
    }
    out
}

/// Notes the start of a list element (its first character) as that element's anchor.
fn begin_value(frames: &mut [Frame], out: &mut Scanned, offset: usize, keep: &dyn Fn(&str) -> bool) {
    if let Some(frame) = frames.last_mut() {
        if frame.bracket == Bracket::Square && !frame.started {
            frame.started = true;
            let path = render(frames);
            if keep(&path) {
                out.anchors.push(Anchor { path, offset });
            }
        }
    }
}

/// Index just past whitespace and comments from `i`.
fn skip_blank(bytes: &[u8], mut i: usize) -> usize {
    loop {
        match bytes.get(i) {
            Some(b' ' | b'\t' | b'\n' | b'\r') => i += 1,
            Some(b'/') if matches!(bytes.get(i + 1), Some(b'/') | Some(b'*')) => i = skip_comment(bytes, i),
            _ => return i,
        }
    }
}

/// Index just past the `//` or (nested) `/* */` comment starting at `i`.
fn skip_comment(bytes: &[u8], i: usize) -> usize {
    if bytes.get(i + 1) == Some(&b'/') {
        return bytes[i..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |n| i + n);
    }
    let mut depth = 0usize;
    let mut j = i;
    while j < bytes.len() {
        if bytes[j..].starts_with(b"/*") {
            depth += 1;
            j += 2;
        } else if bytes[j..].starts_with(b"*/") {
            depth -= 1;
            j += 2;
            if depth == 0 {
                return j;
            }
        } else {
            j += 1;
        }
    }
    bytes.len()
}

/// Index just past the `"..."` string starting at `i` (or the end, if unterminated).
fn skip_string(bytes: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while let Some(&b) = bytes.get(j) {
        match b {
            b'\\' => j += 2,
            b'"' => return j + 1,
            _ => j += 1,
        }
    }
    bytes.len()
}

fn skip_char_literal(bytes: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while let Some(&b) = bytes.get(j) {
        match b {
            b'\\' => j += 2,
            b'\'' => return j + 1,
            b'\n' => return j,
            _ => j += 1,
        }
    }
    bytes.len()
}

/// For `r"`, `r#"`, `r##"`...: the number of `#`; `None` when `i` starts no raw string.
fn raw_string_hashes(bytes: &[u8], i: usize) -> Option<usize> {
    // A raw string may also follow `b` (`br"..."`), which the identifier rule skips as `b`.
    let hashes = bytes[i + 1..].iter().take_while(|&&b| b == b'#').count();
    (bytes.get(i + 1 + hashes) == Some(&b'"')).then_some(hashes)
}

fn skip_raw_string(bytes: &[u8], i: usize) -> usize {
    let hashes = raw_string_hashes(bytes, i).unwrap_or(0);
    let mut j = i + 2 + hashes;
    while j < bytes.len() {
        if bytes[j] == b'"' && bytes[j + 1..].iter().take(hashes).filter(|&&b| b == b'#').count() == hashes {
            return j + 1 + hashes;
        }
        j += 1;
    }
    bytes.len()
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_start_byte(bytes: &[u8], i: usize) -> bool {
    match bytes.get(i) {
        Some(b'r') if bytes.get(i + 1) == Some(&b'#') => true,
        Some(&b) => b.is_ascii_alphabetic() || b == b'_' || b >= 0x80,
        None => false,
    }
}

/// Index just past the identifier (plain, or raw `r#name` with `-`, `.` and `+` allowed) at `i`.
fn ident_end(bytes: &[u8], i: usize) -> usize {
    let raw = bytes[i..].starts_with(b"r#");
    let start = if raw { i + 2 } else { i };
    let len = bytes[start..]
        .iter()
        .take_while(|&&b| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80 || (raw && b"-.+".contains(&b)))
        .count();
    start + len
}

// ---------------------------------------------------------------------------------------------
// Legacy option names as strings.

/// Rewrites each string in `protocol.legacy` that is a valid raw identifier (`"lazy-handshake"`)
/// to that identifier (`r#lazy-handshake`): same length, so positions stay exact.
fn raw_legacy_names(text: &str) -> String {
    let scanned = scan(text, text.len(), &is_legacy_path);
    let mut out = text.to_string();
    for atom in scanned.atoms.iter().filter(|atom| atom.quoted && is_legacy_path(&atom.path)) {
        let Some(name) = text.get(atom.start + 1..atom.end - 1) else { continue };
        let closed = atom.end - atom.start >= 2 && text[..atom.end].ends_with('"');
        let plain =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.+".contains(&b));
        if closed && plain {
            out.replace_range(atom.start..atom.end, &format!("r#{name}"));
        }
    }
    out
}

/// The reverse for printing: `r#lazy-handshake` in `protocol.legacy` becomes `"lazy-handshake"`.
fn quoted_legacy_names(text: &str) -> String {
    let scanned = scan(text, text.len(), &is_legacy_path);
    let mut out = text.to_string();
    for atom in scanned.atoms.iter().filter(|atom| !atom.quoted && is_legacy_path(&atom.path)) {
        let name = &text[atom.start + 2..atom.end];
        out.replace_range(atom.start..atom.end, &format!("\"{name}\""));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Semantic validation.

fn violation(field: impl Into<String>, message: impl Into<String>) -> Violation {
    Violation { field: field.into(), message: message.into() }
}

/// A check of one field: `Ok` or the violation naming it.
type Check = Result<(), Violation>;

fn at_least_one(field: &str, value: u64) -> Check {
    if value >= 1 {
        Ok(())
    } else {
        Err(violation(field, "must be at least 1, got 0"))
    }
}

/// `value` is at most `max` (a named limit of `scenario.rs`); `unit` follows the numbers.
fn at_most(field: &str, value: u64, max: u64, unit: &str) -> Check {
    if value <= max {
        Ok(())
    } else {
        Err(violation(field, format!("must be at most {max}{unit}, got {value}")))
    }
}

/// A time in milliseconds: at least 1 ms and at most [`MAX_TIME_MS`], so its conversion to
/// nanoseconds, and sums of such times, cannot overflow.
fn time_ms(field: &str, value: u64) -> Check {
    at_least_one(field, value)?;
    at_most(field, value, MAX_TIME_MS, " ms (about 115 days)")
}

/// A bandwidth, throughput or rate: positive, finite and within [`RATE_RANGE`].
fn positive(field: &str, value: f64) -> Check {
    let (lo, hi) = RATE_RANGE;
    if !(value.is_finite() && value > 0.0) {
        return Err(violation(field, format!("must be a positive finite number, got {value}")));
    }
    if !(lo..=hi).contains(&value) {
        return Err(violation(field, format!("must be between {lo:e} and {hi:e}, got {value:e}")));
    }
    Ok(())
}

/// A duration given as a float in the field's unit: finite, at least 0 and at most `max`.
fn non_negative(field: &str, value: f64, max: f64) -> Check {
    if !(value.is_finite() && value >= 0.0) {
        return Err(violation(field, format!("must be a finite number of at least 0, got {value}")));
    }
    if value > max {
        return Err(violation(field, format!("must be at most {max:e} (about 115 days), got {value:e}")));
    }
    Ok(())
}

/// A fraction in (0, 1]; `NaN` fails both comparisons and is rejected too.
fn fraction(field: &str, value: f64) -> Check {
    if value > 0.0 && value <= 1.0 {
        Ok(())
    } else {
        Err(violation(field, format!("must be a fraction in (0, 1] (above 0, at most 1), got {value}")))
    }
}

fn probability(field: &str, value: f64) -> Check {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(violation(field, format!("must be a probability in [0, 1], got {value}")))
    }
}

/// The core's model facts for a scenario's model profile.
fn model_spec(scenario: &Scenario) -> ModelSpec {
    let model = &scenario.model;
    ModelSpec {
        use_mla: model.use_mla,
        kv_heads: model.kv_heads,
        layers: model.layers,
        bytes_per_token_per_layer: model.kv_bytes_per_token_per_layer,
        block_size_tokens: model.block_size_tokens,
    }
}

/// Checks the rules serde cannot express; the first violation found is returned (fields are
/// checked in file order, except that engine pairs are checked after `model`, which they need).
/// `docs/scenarios.md` lists the rules.
pub fn validate(scenario: &Scenario) -> Result<(), Violation> {
    validate_name(&scenario.name)?;
    let deployment =
        Deployment::parse(&scenario.deployment).map_err(|err| violation("deployment", err.to_string()))?;
    validate_model(scenario)?;
    let spec = model_spec(scenario);
    for (d, decode) in deployment.decode.iter().enumerate() {
        for (p, prefill) in deployment.prefill.iter().enumerate() {
            check_pair(*decode, *prefill, &spec).map_err(|err| {
                violation(
                    "deployment",
                    format!(
                        "decode engine D{d} ({decode}) cannot read prefill engine P{p} ({prefill}): {err}"
                    ),
                )
            })?;
        }
    }
    validate_hardware_and_cost(scenario)?;
    validate_workload(scenario)?;
    validate_protocol(scenario)?;
    let engines = &scenario.engines;
    at_least_one("engines.prefill_max_batched_tokens", engines.prefill_max_batched_tokens.into())?;
    at_least_one("engines.decode_max_batch", engines.decode_max_batch.into())?;
    if engines.prefill_register_delay_ms > 0 {
        time_ms("engines.prefill_register_delay_ms", engines.prefill_register_delay_ms)?;
    }
    validate_pools(scenario, &deployment)?;
    validate_faults(scenario, &deployment)?;
    let limits = &scenario.limits;
    at_least_one("limits.max_virtual_time_s", limits.max_virtual_time_s)?;
    at_most("limits.max_virtual_time_s", limits.max_virtual_time_s, MAX_VIRTUAL_TIME_S, " s (one day)")?;
    at_least_one("limits.max_events", limits.max_events)?;
    at_most("limits.max_events", limits.max_events, MAX_EVENTS, "")?;
    if let Some(bounds) = scenario.expect_jain {
        validate_jain(bounds)?;
    }
    Ok(())
}

/// The Jain index lies in (0, 1]; bounds outside [0, 1], `NaN`, or a lower bound above the
/// upper one could never hold, or always would, which is a mistake in the file.
fn validate_jain(bounds: JainBounds) -> Check {
    for (field, value) in [("expect_jain.at_least", bounds.at_least), ("expect_jain.at_most", bounds.at_most)]
    {
        if let Some(value) = value {
            if !(0.0..=1.0).contains(&value) {
                return Err(violation(
                    field,
                    format!("must be a number in [0, 1] (a Jain index), got {value}"),
                ));
            }
        }
    }
    if let (Some(lo), Some(hi)) = (bounds.at_least, bounds.at_most) {
        if lo > hi {
            return Err(violation(
                "expect_jain.at_most",
                format!("must be at least expect_jain.at_least ({lo}), got {hi}"),
            ));
        }
    }
    Ok(())
}

/// The largest value a length can take.
fn longest(length: Length) -> u32 {
    match length {
        Length::Fixed(n) => n,
        Length::Uniform { max, .. } => max,
    }
}

/// Every pool fits the simulated address space, and the longest request fits every pool it can
/// be routed to: a prompt larger than a prefill DP rank's pool would stall that rank forever, and
/// a request larger than a decode pool would wait forever for admission, both of which would be
/// reported as a protocol hang.
fn validate_pools(scenario: &Scenario, deployment: &Deployment) -> Check {
    let cost = Cost::new(&scenario.model, &scenario.hardware, &scenario.cost);
    let explicit = scenario.engines.kv_blocks_per_gpu;
    let (pool_field, pool_source) = if explicit > 0 {
        ("engines.kv_blocks_per_gpu", "engines.kv_blocks_per_gpu")
    } else {
        ("hardware.hbm_gb", "hardware.hbm_gb x hardware.kv_memory_fraction")
    };
    let blocks_for = |tp: u16| if explicit > 0 { explicit } else { cost.kv_blocks_per_gpu(tp) };
    let block = u64::from(scenario.model.block_size_tokens);
    let input_blocks = u64::from(longest(scenario.workload.input_tokens)).div_ceil(block);
    let output_blocks = u64::from(longest(scenario.workload.output_tokens)).div_ceil(block);
    let layers = u64::from(scenario.model.layers);
    let total: u64 = [Role::Prefill, Role::Decode]
        .iter()
        .flat_map(|&role| deployment.engines(role).iter())
        .map(|layout| u64::from(layout.dp) * u64::from(blocks_for(layout.tp)))
        .sum();
    if total > MAX_TOTAL_KV_BLOCKS {
        return Err(violation(
            pool_field,
            format!(
                "the deployment's pools hold {total} KV blocks in all; at most {MAX_TOTAL_KV_BLOCKS} \
                 are simulated (make {pool_field} smaller)"
            ),
        ));
    }
    for role in [Role::Prefill, Role::Decode] {
        for (e, layout) in deployment.engines(role).iter().enumerate() {
            let letter = role.letter();
            let blocks = u64::from(blocks_for(layout.tp));
            let bytes = blocks.saturating_mul(cost.block_bytes_per_layer(layout.tp)).saturating_mul(layers);
            if bytes > MAX_KV_BYTES_PER_GPU {
                return Err(violation(
                    pool_field,
                    format!(
                        "engine {letter}{e} ({layout}) would register {bytes} bytes of KV per GPU \
                         ({blocks} blocks); at most {MAX_KV_BYTES_PER_GPU} (256 GiB) fit the simulated \
                         address space"
                    ),
                ));
            }
            let (needed, field, what) = match role {
                Role::Prefill => (input_blocks, "workload.input_tokens", "the longest prompt"),
                Role::Decode => (
                    input_blocks + output_blocks,
                    "workload.output_tokens",
                    "the longest prompt plus the longest output",
                ),
            };
            if needed > blocks {
                return Err(violation(
                    field,
                    format!(
                        "{what} needs {needed} KV blocks of {block} tokens, but a DP rank of engine \
                         {letter}{e} ({layout}) holds only {blocks} ({pool_source}): such a request \
                         could never be served"
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn validate_name(name: &str) -> Check {
    // The name becomes an output folder name, so it must be one plain path component.
    if name.is_empty() || name == "." || name == ".." {
        return Err(violation("name", format!("must be a folder name, got `{}`", name.escape_debug())));
    }
    if let Some(bad) = name.chars().find(|&c| c == '/' || c == '\\' || c.is_control()) {
        return Err(violation(
            "name",
            format!("must be a folder name, without `{}`; got `{}`", bad.escape_debug(), name.escape_debug()),
        ));
    }
    Ok(())
}

fn validate_model(scenario: &Scenario) -> Check {
    let model = &scenario.model;
    at_least_one("model.kv_heads", model.kv_heads.into())?;
    if model.use_mla && model.kv_heads != 1 {
        return Err(violation(
            "model.kv_heads",
            format!("must be 1 when model.use_mla is true (one latent per token), got {}", model.kv_heads),
        ));
    }
    at_least_one("model.layers", model.layers.into())?;
    if model.moe_layers > model.layers {
        return Err(violation(
            "model.moe_layers",
            format!("must be at most model.layers ({}), got {}", model.layers, model.moe_layers),
        ));
    }
    let dimension = u64::from(MAX_MODEL_DIMENSION);
    at_least_one("model.kv_bytes_per_token_per_layer", model.kv_bytes_per_token_per_layer.into())?;
    at_most("model.kv_bytes_per_token_per_layer", model.kv_bytes_per_token_per_layer.into(), dimension, "")?;
    at_least_one("model.block_size_tokens", model.block_size_tokens.into())?;
    at_most("model.block_size_tokens", model.block_size_tokens.into(), dimension, "")?;
    positive("model.active_params_b", model.active_params_b)?;
    at_least_one("model.hidden_size", model.hidden_size.into())?;
    at_most("model.hidden_size", model.hidden_size.into(), dimension, "")
}

fn validate_hardware_and_cost(scenario: &Scenario) -> Check {
    let hw = &scenario.hardware;
    positive("hardware.hbm_gb", hw.hbm_gb)?;
    fraction("hardware.kv_memory_fraction", hw.kv_memory_fraction)?;
    positive("hardware.hbm_tb_s", hw.hbm_tb_s)?;
    positive("hardware.fp8_tflops", hw.fp8_tflops)?;
    positive("hardware.fabric_gb_s", hw.fabric_gb_s)?;
    positive("hardware.nic_gb_s", hw.nic_gb_s)?;
    non_negative("hardware.nic_latency_us", hw.nic_latency_us, MAX_TIME_US)?;
    non_negative("hardware.control_latency_us", hw.control_latency_us, MAX_TIME_US)?;
    non_negative("hardware.listener_service_us", hw.listener_service_us, MAX_TIME_US)?;
    let cost = &scenario.cost;
    let max_ms = MAX_TIME_MS as f64;
    non_negative("cost.prefill_fixed_ms", cost.prefill_fixed_ms, max_ms)?;
    fraction("cost.prefill_mfu", cost.prefill_mfu)?;
    fraction("cost.prefill_ep_efficiency", cost.prefill_ep_efficiency)?;
    non_negative("cost.decode_fixed_ms", cost.decode_fixed_ms, max_ms)?;
    fraction("cost.decode_kv_efficiency", cost.decode_kv_efficiency)?;
    non_negative("cost.decode_per_request_us", cost.decode_per_request_us, MAX_TIME_US)?;
    fraction("cost.fabric_efficiency", cost.fabric_efficiency)
}

fn validate_length(field: &str, length: Length) -> Check {
    match length {
        Length::Fixed(tokens) => {
            at_least_one(field, tokens.into())?;
            at_most(field, tokens.into(), MAX_TOKENS.into(), " tokens")
        }
        Length::Uniform { min, max } => {
            at_least_one(&format!("{field}.min"), min.into())?;
            at_most(&format!("{field}.max"), max.into(), MAX_TOKENS.into(), " tokens")?;
            if min > max {
                return Err(violation(field, format!("Uniform min {min} is greater than max {max}")));
            }
            Ok(())
        }
    }
}

fn validate_workload(scenario: &Scenario) -> Check {
    let workload = &scenario.workload;
    match workload.clients {
        Clients::Closed { concurrency, requests } => {
            at_least_one("workload.clients.concurrency", concurrency.into())?;
            at_most("workload.clients.concurrency", concurrency.into(), MAX_CONCURRENCY.into(), "")?;
            at_least_one("workload.clients.requests", requests.into())?;
            at_most("workload.clients.requests", requests.into(), MAX_REQUESTS.into(), "")?;
        }
        Clients::Open { rate_per_s, requests } => {
            positive("workload.clients.rate_per_s", rate_per_s)?;
            at_least_one("workload.clients.requests", requests.into())?;
            at_most("workload.clients.requests", requests.into(), MAX_REQUESTS.into(), "")?;
        }
    }
    validate_length("workload.input_tokens", workload.input_tokens)?;
    validate_length("workload.output_tokens", workload.output_tokens)
}

fn validate_protocol(scenario: &Scenario) -> Check {
    let protocol = &scenario.protocol;
    for (i, option) in protocol.legacy.iter().enumerate() {
        if protocol.legacy[..i].contains(option) {
            return Err(violation(format!("protocol.legacy[{i}]"), format!("`{option}` is listed twice")));
        }
    }
    time_ms("protocol.handshake_timeout_ms", protocol.handshake_timeout_ms)?;
    time_ms("protocol.transfer_timeout_ms", protocol.transfer_timeout_ms)?;
    time_ms("protocol.defer_timeout_ms", protocol.defer_timeout_ms)?;
    time_ms("protocol.collective_timeout_ms", protocol.collective_timeout_ms)
}

fn validate_faults(scenario: &Scenario, deployment: &Deployment) -> Check {
    let timeline = &scenario.faults.timeline;
    if timeline.len() > MAX_TIMELINE_FAULTS {
        return Err(violation(
            "faults.timeline",
            format!("holds at most {MAX_TIMELINE_FAULTS} faults, got {}", timeline.len()),
        ));
    }
    let mut crashes = 0;
    for (i, timed) in timeline.iter().enumerate() {
        let field = format!("faults.timeline[{i}]");
        at_most(&format!("{field}.at_ms"), timed.at_ms, MAX_TIME_MS, " ms (about 115 days)")?;
        check_target(&format!("{field}.target"), &timed.target.0, deployment)?;
        match timed.fault {
            FaultKind::DelayMessages { delay_ms } => time_ms(&format!("{field}.fault.delay_ms"), delay_ms)?,
            FaultKind::SlowListener { service_ms } => {
                time_ms(&format!("{field}.fault.service_ms"), service_ms)?
            }
            FaultKind::SlowNic { factor } => {
                let field = format!("{field}.fault.factor");
                fraction(&field, factor)?;
                if factor < MIN_SLOW_NIC_FACTOR {
                    return Err(violation(
                        field,
                        format!("must be at least {MIN_SLOW_NIC_FACTOR:e} (a millionth), got {factor:e}"),
                    ));
                }
            }
            FaultKind::EngineCrash => {
                crashes += 1;
                if crashes > MAX_ENGINE_CRASHES {
                    return Err(violation(
                        format!("{field}.fault"),
                        format!("at most {MAX_ENGINE_CRASHES} EngineCrash faults fit one timeline"),
                    ));
                }
            }
            FaultKind::LoseMessages
            | FaultKind::DuplicateMessages
            | FaultKind::DeadListener
            | FaultKind::NicDown
            | FaultKind::SendQueueFull => {}
        }
        if matches!(timed.fault, FaultKind::SendQueueFull)
            && parse_target(&timed.target.0).is_some_and(|p| p.role == Role::Prefill)
        {
            return Err(violation(
                format!("{field}.target"),
                "SendQueueFull applies to decode ranks (they post the reads), e.g. D0.dp*.tp*",
            ));
        }
        if let Some(duration) = timed.duration_ms {
            time_ms(&format!("{field}.duration_ms"), duration)?;
        }
        if let Some(count) = timed.count {
            let message_fault = matches!(
                timed.fault,
                FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages
            );
            if !message_fault {
                return Err(violation(
                    format!("{field}.count"),
                    "applies only to message faults (LoseMessages, DelayMessages, DuplicateMessages)",
                ));
            }
            at_least_one(&format!("{field}.count"), count.into())?;
        }
    }
    let swarm = &scenario.faults.swarm;
    probability("faults.swarm.loss", swarm.loss)?;
    probability("faults.swarm.duplicate", swarm.duplicate)?;
    probability("faults.swarm.delay", swarm.delay)?;
    probability("faults.swarm.send_queue_full", swarm.send_queue_full)?;
    if swarm.delay > 0.0 && swarm.max_delay_ms == 0 {
        return Err(violation(
            "faults.swarm.max_delay_ms",
            "must be at least 1 when faults.swarm.delay is above 0",
        ));
    }
    at_most("faults.swarm.max_delay_ms", swarm.max_delay_ms, MAX_TIME_MS, " ms (about 115 days)")
}

/// A parsed fault target: role, and engine, DP and TP ranks, each `None` for `*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetPattern {
    /// Prefill or decode.
    pub role: Role,
    /// Engine index, `None` for any.
    pub engine: Option<u16>,
    /// DP rank, `None` for any.
    pub dp: Option<u16>,
    /// TP rank, `None` for any.
    pub tp: Option<u16>,
}

impl TargetPattern {
    /// True when `rank` is one of the ranks the pattern names.
    pub fn matches(&self, rank: pdkv_core::ids::RankId) -> bool {
        rank.engine.role == self.role
            && self.engine.is_none_or(|e| e == rank.engine.index)
            && self.dp.is_none_or(|d| d == rank.dp)
            && self.tp.is_none_or(|t| t == rank.tp)
    }
}

const TARGET_SYNTAX: &str = "P<engine>.dp<rank>.tp<rank> or D<engine>.dp<rank>.tp<rank>, \
                             each number or `*`, e.g. P0.dp*.tp3";

/// Parses a fault target such as `P0.dp*.tp3`; `None` if it is not of that form.
pub fn parse_target(text: &str) -> Option<TargetPattern> {
    fn number(part: &str) -> Option<Option<u16>> {
        if part == "*" {
            return Some(None);
        }
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        part.parse().ok().map(Some)
    }
    let mut parts = text.split('.');
    let (engine, dp, tp) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let role = match engine.as_bytes().first()? {
        b'P' => Role::Prefill,
        b'D' => Role::Decode,
        _ => return None,
    };
    Some(TargetPattern {
        role,
        engine: number(&engine[1..])?,
        dp: number(dp.strip_prefix("dp")?)?,
        tp: number(tp.strip_prefix("tp")?)?,
    })
}

fn check_target(field: &str, text: &str, deployment: &Deployment) -> Check {
    let Some(pattern) = parse_target(text) else {
        return Err(violation(
            field,
            format!("`{}` is not a rank pattern; expected {TARGET_SYNTAX}", text.escape_debug()),
        ));
    };
    let letter = pattern.role.letter();
    let side = match pattern.role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let fail = |why: String| {
        Err(violation(field, format!("`{text}` matches no rank of {}: {why}", deployment.notation())))
    };
    let engines = deployment.engines(pattern.role);
    let chosen: Vec<Layout> = engines
        .iter()
        .enumerate()
        .filter(|&(e, _)| !matches!(pattern.engine, Some(n) if usize::from(n) != e))
        .map(|(_, layout)| *layout)
        .collect();
    // The notation parser guarantees at least one engine per side and sizes of at least 1.
    let last = engines.len().saturating_sub(1);
    if chosen.is_empty() {
        let n = pattern.engine.unwrap_or_default();
        return fail(format!("there is no {side} engine {letter}{n} (engines {letter}0..{letter}{last})"));
    }
    let chosen: Vec<Layout> = match pattern.dp {
        None => chosen,
        Some(dp) => {
            let largest = chosen.iter().map(|layout| layout.dp).max().unwrap_or(1);
            if dp >= largest {
                return fail(format!(
                    "DP rank {dp} is out of range (largest: dp{})",
                    largest.saturating_sub(1)
                ));
            }
            chosen.into_iter().filter(|layout| dp < layout.dp).collect()
        }
    };
    if let Some(tp) = pattern.tp {
        let largest = chosen.iter().map(|layout| layout.tp).max().unwrap_or(1);
        if tp >= largest {
            return fail(format!("TP rank {tp} is out of range (largest: tp{})", largest.saturating_sub(1)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{
        CostModel, EngineLimits, Faults, Hardware, Limits, ModelProfile, Outcome, Protocol, Reads, Swarm,
        Target, TimedFault, Workload,
    };

    /// The error variants, without their data, so tables can name the one they expect.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Kind {
        Io,
        Syntax,
        UnknownField,
        MissingField,
        WrongType,
        UnknownVariant,
        Invalid,
    }

    fn kind(err: &ScenarioError) -> Kind {
        match err {
            ScenarioError::Io { .. } => Kind::Io,
            ScenarioError::Syntax { .. } => Kind::Syntax,
            ScenarioError::UnknownField { .. } => Kind::UnknownField,
            ScenarioError::MissingField { .. } => Kind::MissingField,
            ScenarioError::WrongType { .. } => Kind::WrongType,
            ScenarioError::UnknownVariant { .. } => Kind::UnknownVariant,
            ScenarioError::Invalid { .. } => Kind::Invalid,
        }
    }

    fn bad_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join("bad")
    }

    /// One file of `testdata/bad`: the variant, line, column and field its error must have, and
    /// words the message must contain.
    struct Bad {
        file: &'static str,
        kind: Kind,
        line: usize,
        column: usize,
        field: &'static str,
        says: &'static str,
    }

    const fn bad(
        file: &'static str,
        kind: Kind,
        line: usize,
        column: usize,
        field: &'static str,
        says: &'static str,
    ) -> Bad {
        Bad { file, kind, line, column, field, says }
    }

    const BAD: [Bad; 21] = [
        bad("unknown_top_level_field.ron", Kind::UnknownField, 5, 5, "seeds", "expected one of: name, "),
        bad("unknown_nested_field.ron", Kind::UnknownField, 7, 9, "hardware.nic_gbps", "nic_gb_s, "),
        bad(
            "unknown_variant_field.ron",
            Kind::UnknownField,
            6,
            55,
            "workload.clients.rate_per_s",
            "expected one of: concurrency, requests",
        ),
        bad(
            "string_for_number.ron",
            Kind::WrongType,
            6,
            19,
            "hardware.nic_gb_s",
            "found the string \"fast\"",
        ),
        bad("decimal_for_integer.ron", Kind::WrongType, 7, 19, "model.kv_heads", "found a decimal number"),
        bad("negative_seed.ron", Kind::WrongType, 5, 11, "seed", "`-1` is negative"),
        bad("zero_tp.ron", Kind::Invalid, 4, 5, "deployment", "TP size of at least 1"),
        bad("tp_not_multiple.ron", Kind::Invalid, 4, 5, "deployment", "one TP size must be a multiple"),
        bad("gqa_head_split.ron", Kind::Invalid, 4, 5, "deployment", "with 8 KV heads"),
        bad("negative_rate.ron", Kind::Invalid, 7, 13, "workload.clients.rate_per_s", "got -2.5"),
        bad(
            "zero_concurrency.ron",
            Kind::Invalid,
            6,
            25,
            "workload.clients.concurrency",
            "at least 1, got 0",
        ),
        bad(
            "unknown_legacy.ron",
            Kind::UnknownVariant,
            6,
            36,
            "protocol.legacy[1]",
            "unknown legacy option `read-from-dp1`; known options: read-from-dp0, ",
        ),
        bad("uniform_min_above_max.ron", Kind::Invalid, 6, 9, "workload.input_tokens", "min 4096 is greater"),
        bad(
            "fault_target_out_of_range.ron",
            Kind::Invalid,
            8,
            26,
            "faults.timeline[1].target",
            "DP rank 1 is out of range",
        ),
        bad(
            "fault_target_malformed.ron",
            Kind::Invalid,
            7,
            24,
            "faults.timeline[0].target",
            "`prefill0.tp3` is not a rank pattern",
        ),
        bad(
            "slow_nic_factor_above_one.ron",
            Kind::Invalid,
            7,
            61,
            "faults.timeline[0].fault.factor",
            "got 1.5",
        ),
        bad(
            "swarm_probability_above_one.ron",
            Kind::Invalid,
            8,
            13,
            "faults.swarm.duplicate",
            "[0, 1], got 1.2",
        ),
        bad("missing_paren.ron", Kind::Syntax, 7, 2, "workload", "unexpected end of file"),
        bad("missing_comma.ron", Kind::Syntax, 4, 5, "name", "expected `,`"),
        bad("missing_deployment.ron", Kind::MissingField, 5, 1, "deployment", "no default"),
        bad(
            "unknown_outcome.ron",
            Kind::UnknownVariant,
            5,
            13,
            "expect",
            "clean, incomplete, leak, failed_requests, hang, safety_violation",
        ),
    ];

    #[test]
    fn load_bad_files_name_the_variant_line_column_and_field() {
        for case in &BAD {
            let path = bad_dir().join(case.file);
            let err = match load_scenario(&path) {
                Ok(scenario) => panic!("{}: loaded {scenario:?}", case.file),
                Err(err) => err,
            };
            let shown = err.to_string();
            assert_eq!(kind(&err), case.kind, "{}: {shown}", case.file);
            let at = Location { line: case.line, column: case.column };
            assert_eq!(err.location(), Some(at), "{}: {shown}", case.file);
            assert_eq!(err.field(), Some(case.field), "{}: {shown}", case.file);
            let origin = path.display().to_string();
            assert_eq!(err.origin(), origin, "{}", case.file);
            assert!(shown.starts_with(&format!("{origin}:{at}: ")), "{}: {shown}", case.file);
            assert!(shown.contains(&format!("`{}`", case.field)), "{}: {shown}", case.file);
            assert!(shown.contains(case.says), "{}: {shown}", case.file);
        }
    }

    #[test]
    fn load_every_bad_file_is_in_the_table() {
        let mut files: Vec<String> = match std::fs::read_dir(bad_dir()) {
            Ok(entries) => {
                entries.flatten().map(|entry| entry.file_name().to_string_lossy().into_owned()).collect()
            }
            Err(err) => panic!("{}: {err}", bad_dir().display()),
        };
        files.sort();
        let mut listed: Vec<String> = BAD.iter().map(|case| case.file.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed);
    }

    #[test]
    fn load_io_errors_name_the_path() {
        let path = bad_dir().join("no-such-file.ron");
        let err = load_scenario(&path).map(|s| s.name).unwrap_err();
        assert_eq!(kind(&err), Kind::Io);
        assert_eq!((err.location(), err.field()), (None, None));
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("{}: cannot read the scenario file: ", path.display())),
            "{shown}"
        );
    }

    /// A one-line scenario with the given extra fields.
    fn with(fields: &str) -> String {
        format!("(name: \"x\", deployment: \"1P_TP8:1D_TP8\", {fields})")
    }

    /// Parses `text` and checks the error's variant, field and words.
    fn check_err(text: &str, expected: (Kind, &str, &str)) {
        let (want_kind, field, says) = expected;
        let err = match parse_scenario(text, "<table>") {
            Ok(scenario) => panic!("{text}: parsed {scenario:?}"),
            Err(err) => err,
        };
        let shown = err.to_string();
        assert_eq!((kind(&err), err.field()), (want_kind, Some(field)), "{text}: {shown}");
        assert!(shown.contains(says), "{text}: {shown}");
        assert!(shown.starts_with("<table>:"), "{text}: {shown}");
    }

    /// A one-line scenario whose fault timeline holds one fault on `target`.
    fn fault(target: &str, fault: &str) -> String {
        with(&format!("faults: (timeline: [(at_ms: 0, target: \"{target}\", fault: {fault})])"))
    }

    #[test]
    fn load_validation_rules_name_the_field() {
        use Kind::Invalid;
        let ok = "(name: \"x\", deployment: \"1P_TP8:1D_TP8\")";
        let table: Vec<(String, (Kind, &str, &str))> = vec![
            (ok.replace("\"x\"", "\"a/b\""), (Invalid, "name", "without `/`; got `a/b`")),
            (ok.replace("\"x\"", "\"..\""), (Invalid, "name", "folder name")),
            (ok.replace("8:1", "8-1"), (Invalid, "deployment", "':' between")),
            (
                ok.replace("1D_TP8", "1D_TP8+1D_TP3"),
                (Invalid, "deployment", "decode engine D1 (TP3) cannot read prefill engine P0 (TP8)"),
            ),
            (with("model: (kv_heads: 0)"), (Invalid, "model.kv_heads", "at least 1")),
            (with("model: (kv_heads: 2)"), (Invalid, "model.kv_heads", "must be 1 when model.use_mla")),
            (with("model: (layers: 0)"), (Invalid, "model.layers", "at least 1")),
            (with("model: (layers: 10, moe_layers: 11)"), (Invalid, "model.moe_layers", "at most")),
            (
                with("model: (kv_bytes_per_token_per_layer: 0)"),
                (Invalid, "model.kv_bytes_per_token_per_layer", "at least 1"),
            ),
            (with("model: (block_size_tokens: 0)"), (Invalid, "model.block_size_tokens", "at least 1")),
            (with("model: (active_params_b: 0.0)"), (Invalid, "model.active_params_b", "positive")),
            (with("model: (hidden_size: 0)"), (Invalid, "model.hidden_size", "at least 1")),
            (
                with("faults: (timeline: [(at_ms: 0, target: \"P0.dp0.tp0\", fault: SendQueueFull)])"),
                (Invalid, "faults.timeline[0].target", "applies to decode ranks"),
            ),
            (with("hardware: (hbm_gb: 0)"), (Invalid, "hardware.hbm_gb", "positive")),
            (with("hardware: (kv_memory_fraction: 1.5)"), (Invalid, "hardware.kv_memory_fraction", "(0, 1]")),
            (with("hardware: (nic_gb_s: inf)"), (Invalid, "hardware.nic_gb_s", "finite")),
            (with("hardware: (nic_gb_s: NaN)"), (Invalid, "hardware.nic_gb_s", "got NaN")),
            (with("hardware: (nic_latency_us: -1)"), (Invalid, "hardware.nic_latency_us", "at least 0")),
            (with("cost: (prefill_mfu: 0.0)"), (Invalid, "cost.prefill_mfu", "(0, 1]")),
            (with("cost: (fabric_efficiency: 1.01)"), (Invalid, "cost.fabric_efficiency", "got 1.01")),
            (with("cost: (decode_fixed_ms: -3)"), (Invalid, "cost.decode_fixed_ms", "got -3")),
            (
                with("workload: (clients: Closed(concurrency: 4, requests: 0))"),
                (Invalid, "workload.clients.requests", "at least 1"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 0.0, requests: 5))"),
                (Invalid, "workload.clients.rate_per_s", "positive"),
            ),
            (with("workload: (output_tokens: Fixed(0))"), (Invalid, "workload.output_tokens", "at least 1")),
            (
                with("workload: (input_tokens: Uniform(min: 0, max: 5))"),
                (Invalid, "workload.input_tokens.min", "at least 1"),
            ),
            (
                with("protocol: (handshake_timeout_ms: 0)"),
                (Invalid, "protocol.handshake_timeout_ms", "at least 1"),
            ),
            (
                with("protocol: (collective_timeout_ms: 0)"),
                (Invalid, "protocol.collective_timeout_ms", "at least 1"),
            ),
            (
                with("protocol: (legacy: [\"dedup-releases\", r#dedup-releases])"),
                (Invalid, "protocol.legacy[1]", "`dedup-releases` is listed twice"),
            ),
            (with("engines: (decode_max_batch: 0)"), (Invalid, "engines.decode_max_batch", "at least 1")),
            (with("limits: (max_events: 0)"), (Invalid, "limits.max_events", "at least 1")),
            (with("limits: (max_virtual_time_s: 0)"), (Invalid, "limits.max_virtual_time_s", "at least 1")),
            (
                fault("D0.dp0.tp0", "NicDown, duration_ms: 0"),
                (Invalid, "faults.timeline[0].duration_ms", "at least 1"),
            ),
            (
                fault("D0.dp0.tp0", "NicDown, count: 3"),
                (Invalid, "faults.timeline[0].count", "only to message faults"),
            ),
            (
                fault("D0.dp0.tp0", "LoseMessages, count: 0"),
                (Invalid, "faults.timeline[0].count", "at least 1"),
            ),
            (
                fault("D*.dp*.tp*", "DelayMessages(delay_ms: 0)"),
                (Invalid, "faults.timeline[0].fault.delay_ms", "at least 1"),
            ),
            (
                fault("P0.dp0.tp0", "SlowListener(service_ms: 0)"),
                (Invalid, "faults.timeline[0].fault.service_ms", "at least 1"),
            ),
            (
                fault("P0.dp0.tp0", "SlowNic(factor: 0.0)"),
                (Invalid, "faults.timeline[0].fault.factor", "(0, 1]"),
            ),
            (
                fault("D1.dp0.tp0", "NicDown"),
                (Invalid, "faults.timeline[0].target", "there is no decode engine D1 (engines D0..D0)"),
            ),
            (
                fault("D0.dp*.tp8", "NicDown"),
                (Invalid, "faults.timeline[0].target", "TP rank 8 is out of range (largest: tp7)"),
            ),
            (fault("X0.dp0.tp0", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (fault("P0.dp-1.tp0", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (fault("P0.dp0.tp0.x", "NicDown"), (Invalid, "faults.timeline[0].target", "not a rank pattern")),
            (
                fault("P0.dp99999.tp0", "NicDown"),
                (Invalid, "faults.timeline[0].target", "not a rank pattern"),
            ),
            (
                fault("P1.dp0.tp7", "NicDown").replace("1P_TP8:", "1P_TP8+1P_TP4:"),
                (Invalid, "faults.timeline[0].target", "TP rank 7 is out of range (largest: tp3)"),
            ),
            (with("faults: (swarm: (loss: -0.1))"), (Invalid, "faults.swarm.loss", "[0, 1]")),
            (
                with("faults: (swarm: (send_queue_full: 2))"),
                (Invalid, "faults.swarm.send_queue_full", "[0, 1]"),
            ),
            (
                with("faults: (swarm: (delay: 0.5))"),
                (Invalid, "faults.swarm.max_delay_ms", "when faults.swarm.delay"),
            ),
            // Regressions: each of these once loaded and then misbehaved (a wrapped time, a
            // saturated float, memory without bound). Each is now refused with its limit.
            (
                with("protocol: (collective_timeout_ms: 18446744073709)"),
                (Invalid, "protocol.collective_timeout_ms", "at most 10000000000 ms (about 115 days), got 18446744073709"),
            ),
            (
                with("protocol: (handshake_timeout_ms: 18446744073709551615)"),
                (Invalid, "protocol.handshake_timeout_ms", "at most 10000000000 ms"),
            ),
            (
                with("protocol: (transfer_timeout_ms: 10000000001)"),
                (Invalid, "protocol.transfer_timeout_ms", "got 10000000001"),
            ),
            (with("protocol: (defer_timeout_ms: 99999999999999)"), (Invalid, "protocol.defer_timeout_ms", "at most")),
            (
                fault("D*.dp*.tp*", "DelayMessages(delay_ms: 18446744073709551615)"),
                (Invalid, "faults.timeline[0].fault.delay_ms", "got 18446744073709551615"),
            ),
            (
                fault("P0.dp0.tp0", "SlowListener(service_ms: 18446744073709551615)"),
                (Invalid, "faults.timeline[0].fault.service_ms", "at most 10000000000 ms"),
            ),
            (
                fault("D0.dp0.tp0", "NicDown, duration_ms: 18446744073709551615"),
                (Invalid, "faults.timeline[0].duration_ms", "at most 10000000000 ms"),
            ),
            (
                with("faults: (timeline: [(at_ms: 18446744073709551615, target: \"D0.dp0.tp0\", fault: NicDown)])"),
                (Invalid, "faults.timeline[0].at_ms", "at most 10000000000 ms"),
            ),
            (
                with("faults: (swarm: (delay: 0.5, max_delay_ms: 18446744073709551615))"),
                (Invalid, "faults.swarm.max_delay_ms", "at most 10000000000 ms"),
            ),
            (
                with("engines: (prefill_register_delay_ms: 18446744073709551615)"),
                (Invalid, "engines.prefill_register_delay_ms", "at most 10000000000 ms"),
            ),
            (with("hardware: (nic_gb_s: 1e-15)"), (Invalid, "hardware.nic_gb_s", "between 1e-6 and 1e9, got 1e-15")),
            (with("hardware: (nic_gb_s: 1e300)"), (Invalid, "hardware.nic_gb_s", "between 1e-6 and 1e9")),
            (with("hardware: (fp8_tflops: 1e-300)"), (Invalid, "hardware.fp8_tflops", "between 1e-6 and 1e9")),
            (with("hardware: (hbm_tb_s: 1e-7)"), (Invalid, "hardware.hbm_tb_s", "between 1e-6 and 1e9")),
            (
                with("hardware: (control_latency_us: 1e300)"),
                (Invalid, "hardware.control_latency_us", "at most 1e13 (about 115 days)"),
            ),
            (with("cost: (prefill_fixed_ms: 1e20)"), (Invalid, "cost.prefill_fixed_ms", "at most 1e10")),
            (with("model: (active_params_b: 1e-300)"), (Invalid, "model.active_params_b", "between")),
            (
                with("model: (kv_bytes_per_token_per_layer: 4294967295)"),
                (Invalid, "model.kv_bytes_per_token_per_layer", "at most 1048576"),
            ),
            (with("model: (block_size_tokens: 2000000)"), (Invalid, "model.block_size_tokens", "at most 1048576")),
            (
                fault("P0.dp0.tp0", "SlowNic(factor: 1e-300)"),
                (Invalid, "faults.timeline[0].fault.factor", "at least 1e-6 (a millionth), got 1e-300"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 1e-300, requests: 5))"),
                (Invalid, "workload.clients.rate_per_s", "between 1e-6 and 1e9"),
            ),
            (
                with("workload: (clients: Closed(concurrency: 10000000, requests: 10))"),
                (Invalid, "workload.clients.concurrency", "at most 100000, got 10000000"),
            ),
            (
                with("workload: (clients: Closed(concurrency: 10, requests: 4294967295))"),
                (Invalid, "workload.clients.requests", "at most 1000000, got 4294967295"),
            ),
            (
                with("workload: (clients: Open(rate_per_s: 1.0, requests: 1000001))"),
                (Invalid, "workload.clients.requests", "at most 1000000"),
            ),
            (
                with("workload: (input_tokens: Fixed(4294967295))"),
                (Invalid, "workload.input_tokens", "at most 1048576 tokens"),
            ),
            (
                with("workload: (output_tokens: Uniform(min: 1, max: 2000000))"),
                (Invalid, "workload.output_tokens.max", "at most 1048576 tokens"),
            ),
            (with("limits: (max_virtual_time_s: 18446744073709551615)"), (Invalid, "limits.max_virtual_time_s", "at most 86400 s")),
            (with("limits: (max_events: 18446744073709551615)"), (Invalid, "limits.max_events", "at most 10000000000")),
            (
                with(&format!("faults: (timeline: [{}])", vec!["(at_ms: 0, target: \"D0.dp0.tp0\", fault: NicDown)"; 1001].join(", "))),
                (Invalid, "faults.timeline", "holds at most 1000 faults, got 1001"),
            ),
            (
                with(&format!("faults: (timeline: [{}])", vec!["(at_ms: 0, target: \"D0.dp0.tp0\", fault: EngineCrash)"; 64].join(", "))),
                (Invalid, "faults.timeline[63].fault", "at most 63 EngineCrash faults"),
            ),
            // A prompt that can never fit a pool would stall forever and look like a hang.
            (
                with("engines: (kv_blocks_per_gpu: 100), workload: (input_tokens: Fixed(1601))"),
                (Invalid, "workload.input_tokens", "the longest prompt needs 101 KV blocks of 16 tokens, but a DP rank of engine P0 (TP8) holds only 100 (engines.kv_blocks_per_gpu)"),
            ),
            (
                with("engines: (kv_blocks_per_gpu: 100), workload: (input_tokens: Uniform(min: 1, max: 1600), output_tokens: Fixed(17))"),
                (Invalid, "workload.output_tokens", "the longest prompt plus the longest output needs 102 KV blocks"),
            ),
            (
                with("hardware: (hbm_gb: 0.001), workload: (input_tokens: Fixed(8192))"),
                (Invalid, "workload.input_tokens", "(hardware.hbm_gb x hardware.kv_memory_fraction)"),
            ),
            (
                with("hardware: (hbm_gb: 100000)"),
                (Invalid, "hardware.hbm_gb", "at most 274877906944 (256 GiB) fit the simulated address space"),
            ),
            (
                with("engines: (kv_blocks_per_gpu: 4000000000), model: (layers: 1, moe_layers: 1, kv_bytes_per_token_per_layer: 1, block_size_tokens: 1)"),
                (Invalid, "engines.kv_blocks_per_gpu", "at most 268435456 are simulated"),
            ),
            // Jain bounds that could never hold (or always would).
            (with("expect_jain: (at_least: NaN)"), (Invalid, "expect_jain.at_least", "in [0, 1] (a Jain index), got NaN")),
            (with("expect_jain: (at_most: 1.5)"), (Invalid, "expect_jain.at_most", "got 1.5")),
            (with("expect_jain: (at_least: -0.1)"), (Invalid, "expect_jain.at_least", "got -0.1")),
            (
                with("expect_jain: (at_least: 0.9, at_most: 0.5)"),
                (Invalid, "expect_jain.at_most", "must be at least expect_jain.at_least (0.9), got 0.5"),
            ),
        ];
        for (text, expected) in &table {
            check_err(text, *expected);
        }
    }

    /// Text built to make the scanner quadratic (deep brackets, long field names on a path
    /// above many fields) or too large is refused, or read, in time linear in its size.
    #[test]
    fn load_hostile_text_is_refused_in_linear_time() {
        let head = "(name: \"x\", deployment: \"1P_TP8:1D_TP8\", ";
        let deep = format!("{head}description: {})", "[".repeat(200_000));
        let long_keys = format!(
            "{head}{}{}{})",
            format!("{}: (", "k".repeat(40_000)).repeat(10),
            "a: 1, ".repeat(90_000),
            ")".repeat(10)
        );
        let table: Vec<(&str, &str, &str)> = vec![
            (&deep, "<table>:1:70:", "brackets nested more than 16 deep"),
            (&long_keys, "<table>:1:42: unknown field `kkkk", "expected one of: name, description"),
        ];
        for (text, at, says) in table {
            assert!(text.len() < MAX_SCENARIO_BYTES as usize, "{} bytes", text.len());
            let shown = parse_scenario(text, "<table>").map(|_| ()).unwrap_err().to_string();
            assert!(shown.starts_with(at) && shown.contains(says) && shown.len() < 400, "{shown}");
        }
        let big = std::env::temp_dir().join(format!("pdkv-big-{}.ron", std::process::id()));
        std::fs::write(&big, " ".repeat(MAX_SCENARIO_BYTES as usize + 1)).unwrap();
        let shown = load_scenario(&big).unwrap_err().to_string();
        let _ = std::fs::remove_file(&big);
        assert!(shown.ends_with("cannot read the scenario file: the file is larger than 1048576 bytes, the most this command reads"), "{shown}");
    }

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

    #[test]
    fn load_minimal_file_gets_every_default() {
        let scenario = parse_scenario("(name: \"x\", deployment: \"1P_TP8:1D_TP8\")", "<min>");
        let expected = Scenario {
            name: "x".into(),
            description: String::new(),
            deployment: "1P_TP8:1D_TP8".into(),
            model: ModelProfile::default(),
            hardware: Hardware::default(),
            cost: CostModel::default(),
            workload: Workload::default(),
            protocol: Protocol::default(),
            engines: EngineLimits::default(),
            faults: Faults::default(),
            seed: 0,
            limits: Limits::default(),
            expect: None,
            expect_jain: None,
        };
        assert_eq!(scenario, Ok(expected));
    }

    /// A file using most of the format: comments, enum forms, optional values with and without
    /// `Some`, legacy names as strings and as raw identifiers, trailing commas.
    const FULL: &str = r#"// A fuller scenario.
(
    name: "lazy-lost-reply",
    description: "a lost handshake reply under the lazy handshake", /* block comment ( */
    deployment: "2P_TP8:1D_DP8EP",
    model: (kv_bytes_per_token_per_layer: 1152, block_size_tokens: 32),
    hardware: (nic_gb_s: 25, control_latency_us: 80.5),
    cost: (prefill_mfu: 0.2),
    workload: (
        clients: Open(rate_per_s: 2.5, requests: 40),
        input_tokens: Uniform(min: 1024, max: 8192),
        output_tokens: Fixed(256),
    ),
    protocol: (
        legacy: ["lazy-handshake", r#no-handshake-timeout],
        reads: PerRequest,
        handshake_timeout_ms: 2000,
    ),
    engines: (decode_max_batch: 64, kv_blocks_per_gpu: 4096),
    faults: (
        timeline: [
            (at_ms: 100, target: "P0.dp0.tp*", fault: LoseMessages, count: 1),
            (at_ms: 200, target: "D0.dp7.tp0", fault: SlowNic(factor: 0.5), duration_ms: Some(1000)),
            (at_ms: 300, target: "P*.dp*.tp*", fault: DelayMessages(delay_ms: 20), duration_ms: 50),
        ],
        swarm: (loss: 0.01, delay: 0.1, max_delay_ms: 5),
    ),
    seed: 42,
    limits: (max_virtual_time_s: 600),
    expect: hang,
)
"#;

    fn full_expected() -> Scenario {
        Scenario {
            name: "lazy-lost-reply".into(),
            description: "a lost handshake reply under the lazy handshake".into(),
            deployment: "2P_TP8:1D_DP8EP".into(),
            model: ModelProfile {
                kv_bytes_per_token_per_layer: 1152,
                block_size_tokens: 32,
                ..ModelProfile::default()
            },
            hardware: Hardware { nic_gb_s: 25.0, control_latency_us: 80.5, ..Hardware::default() },
            cost: CostModel { prefill_mfu: 0.2, ..CostModel::default() },
            workload: Workload {
                clients: Clients::Open { rate_per_s: 2.5, requests: 40 },
                input_tokens: Length::Uniform { min: 1024, max: 8192 },
                output_tokens: Length::Fixed(256),
            },
            protocol: Protocol {
                legacy: vec![Legacy::LazyHandshake, Legacy::NoHandshakeTimeout],
                reads: Reads::PerRequest,
                handshake_timeout_ms: 2000,
                ..Protocol::default()
            },
            engines: EngineLimits {
                decode_max_batch: 64,
                kv_blocks_per_gpu: 4096,
                ..EngineLimits::default()
            },
            faults: Faults {
                timeline: vec![
                    TimedFault {
                        at_ms: 100,
                        target: Target("P0.dp0.tp*".into()),
                        fault: FaultKind::LoseMessages,
                        duration_ms: None,
                        count: Some(1),
                    },
                    TimedFault {
                        at_ms: 200,
                        target: Target("D0.dp7.tp0".into()),
                        fault: FaultKind::SlowNic { factor: 0.5 },
                        duration_ms: Some(1000),
                        count: None,
                    },
                    TimedFault {
                        at_ms: 300,
                        target: Target("P*.dp*.tp*".into()),
                        fault: FaultKind::DelayMessages { delay_ms: 20 },
                        duration_ms: Some(50),
                        count: None,
                    },
                ],
                swarm: Swarm { loss: 0.01, delay: 0.1, max_delay_ms: 5, ..Swarm::default() },
            },
            seed: 42,
            limits: Limits { max_virtual_time_s: 600, ..Limits::default() },
            expect: Some(Outcome::Hang),
            expect_jain: None,
        }
    }

    #[test]
    fn load_full_file_parses_to_exact_values() {
        assert_eq!(parse_scenario(FULL, "<full>"), Ok(full_expected()));
    }

    #[test]
    fn load_printed_scenarios_read_back_unchanged() {
        let mut scenarios = vec![full_expected()];
        for notation in ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP", "1P_TP4+1P_DP2TP4:2D_TP8"] {
            scenarios.push(Scenario::from_notation(notation));
        }
        for scenario in scenarios {
            let text = scenario_to_ron(&scenario);
            assert_eq!(parse_scenario(&text, "<printed>"), Ok(scenario.clone()), "{text}");
            // Printing is stable, and readable: no struct names, legacy names as strings.
            assert_eq!(scenario_to_ron(&scenario), text);
            assert!(text.starts_with("(\n    name: "), "{text}");
            assert!(!text.contains("r#"), "{text}");
            // Absent options are left out rather than printed as Rust's `None`.
            assert!(!text.contains("None"), "{text}");
        }
        let text = scenario_to_ron(&full_expected());
        assert!(text.contains("        legacy: [\n            \"lazy-handshake\",\n"), "{text}");
        assert!(text.contains("    expect: hang,\n"), "{text}");
        assert!(text.contains("duration_ms: 1000,"), "{text}");
    }

    #[test]
    fn load_never_panics_on_truncated_or_corrupted_text() {
        let lines = FULL.lines().count() + 1;
        let mut cuts: Vec<usize> = (0..=FULL.len()).filter(|&i| FULL.is_char_boundary(i)).collect();
        cuts.dedup();
        for &cut in &cuts {
            let texts = [
                FULL[..cut].to_string(),
                format!("{}\"{}", &FULL[..cut], &FULL[cut..]),
                format!("{})]{}", &FULL[..cut], &FULL[cut..]),
                format!("{}é\\r#{}", &FULL[..cut], &FULL[cut..]),
            ];
            for text in texts {
                if let Err(err) = parse_scenario(&text, "<cut>") {
                    if let Some(at) = err.location() {
                        assert!(at.line >= 1 && at.line <= lines + 1 && at.column >= 1, "{cut}: {err}");
                    }
                }
            }
        }
    }

    /// `text` with a `‸` marking a position: the paths the scanner reports there.
    fn check_scan(marked: &str, expected: (&str, &str)) {
        let stop = marked.find('‸').unwrap_or(marked.len());
        let text = marked.replacen('‸', "", 1);
        let scanned = scan(&text, stop, &|_| true);
        assert_eq!((scanned.path_at_stop.as_str(), scanned.container_at_stop.as_str()), expected, "{marked}");
    }

    #[test]
    fn load_scanner_tracks_fields_through_brackets() {
        check_scan("(‸a: 1)", ("", ""));
        check_scan("(a: ‸1)", ("a", ""));
        check_scan("(a: (b: Closed(c: ‸1)))", ("a.b.c", "a.b"));
        check_scan("(a: (b: Closed(c: 1, ‸d: 2)))", ("a.b", "a.b"));
        check_scan("(x: [1, ‸2])", ("x[1]", "x"));
        check_scan("(t: [(u: 1), (v: ‸2)])", ("t[1].v", "t[1]"));
        check_scan("(e: Some(‸hang))", ("e", "e"));
        check_scan("(s: \"(]\", /* ) [ */ // )\n k: ‸1)", ("k", ""));
        check_scan("(s: r#\"a\"(\"#, k: ‸1)", ("k", ""));
        check_scan("Scenario(r#k-1: ‸1)", ("k-1", ""));
        check_scan("#![enable(implicit_some)]\n(a: (b: ‸1))", ("a.b", "a"));
    }

    #[test]
    fn load_locate_finds_the_key_or_the_nearest_enclosing_one() {
        let text = "(\n  a: (\n    b: 1,\n  ),\n  l: [\n    (c: 2),\n    (c: 3),\n  ],\n)";
        let table = [
            ("a", Some((2, 3))),
            ("a.b", Some((3, 5))),
            ("a.z", Some((2, 3))),
            ("l[1]", Some((7, 5))),
            ("l[1].c", Some((7, 6))),
            ("l[5].c", Some((5, 3))),
            ("z", None),
        ];
        for (path, expected) in table {
            let expected = expected.map(|(line, column)| Location { line, column });
            assert_eq!(locate(text, path), expected, "{path}");
        }
    }

    #[test]
    fn load_legacy_names_in_strings_keep_their_positions() {
        let text = "(protocol: (legacy: [\"lazy-handshake\", \"not ident\", \"\"]), description: \"x\")";
        let prepared = raw_legacy_names(text);
        assert_eq!(
            prepared,
            "(protocol: (legacy: [r#lazy-handshake, \"not ident\", \"\"]), description: \"x\")"
        );
        assert_eq!(prepared.len(), text.len());
        assert_eq!(quoted_legacy_names(&prepared), text);
    }

    /// The `ron` code blocks of `docs/scenarios.md`.
    fn doc_examples(doc: &str) -> Vec<String> {
        let mut blocks = Vec::new();
        let mut current: Option<String> = None;
        for line in doc.lines() {
            match (&mut current, line.trim_end()) {
                (None, "```ron") => current = Some(String::new()),
                (Some(block), "```") => {
                    blocks.push(std::mem::take(block));
                    current = None;
                }
                (Some(block), _) => {
                    block.push_str(line);
                    block.push('\n');
                }
                (None, _) => {}
            }
        }
        blocks
    }

    #[test]
    fn load_docs_examples_parse_run_as_declared_and_every_field_is_documented() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scenarios.md");
        let doc = match std::fs::read_to_string(&path) {
            Ok(doc) => doc,
            Err(err) => panic!("{}: {err}", path.display()),
        };
        let examples = doc_examples(&doc);
        assert!(!examples.is_empty(), "docs/scenarios.md has no ```ron example");
        for example in &examples {
            let scenario = match parse_scenario(example, "docs/scenarios.md") {
                Ok(scenario) => scenario,
                Err(err) => panic!("{err}\n{example}"),
            };
            // An example runs to the outcome it declares (clean when it declares none), so one
            // that says "expected to hang" does hang.
            let run = match crate::run(&scenario, crate::RunOptions::default()) {
                Ok(run) => run,
                Err(err) => panic!("docs/scenarios.md: example `{}`: {err}", scenario.name),
            };
            let r = &run.result;
            assert!(
                r.as_expected(),
                "docs/scenarios.md: example `{}` declares `expect: {}` but runs to {} ({} finished, {} failed, \
                 {} hangs); save the block as a file and `pdkv run` it",
                scenario.name,
                r.expected.name(),
                r.outcome.name(),
                r.requests.finished,
                r.requests.failed,
                r.hangs.len()
            );
        }
        // Every field name a printed scenario has (with every enum form) appears in the docs.
        let mut every = full_expected();
        for fault in [
            FaultKind::DuplicateMessages,
            FaultKind::DeadListener,
            FaultKind::SlowListener { service_ms: 5 },
            FaultKind::NicDown,
            FaultKind::SendQueueFull,
        ] {
            every.faults.timeline.push(TimedFault {
                at_ms: 0,
                target: Target("D0.dp0.tp0".into()),
                fault,
                duration_ms: None,
                count: None,
            });
        }
        let printed = scenario_to_ron(&every) + &scenario_to_ron(&Scenario::from_notation("1P_TP8:1D_TP8"));
        let scanned = scan(&printed, printed.len(), &|_| true);
        for anchor in &scanned.anchors {
            let name = anchor.path.rsplit(['.', ']']).next().unwrap_or_default();
            if !name.is_empty() {
                assert!(doc.contains(&format!("`{name}`")), "docs/scenarios.md does not mention `{name}`");
            }
        }
        for word in [
            "Closed",
            "Open",
            "Fixed",
            "Uniform",
            "PerLayer",
            "PerRequest",
            "LoseMessages",
            "DelayMessages",
            "DuplicateMessages",
            "DeadListener",
            "SlowListener",
            "SlowNic",
            "NicDown",
            "SendQueueFull",
            "clean",
            "leak",
            "hang",
            "safety_violation",
        ] {
            assert!(doc.contains(&format!("`{word}")), "docs/scenarios.md does not mention `{word}`");
        }
        check_doc_defaults(&doc);
    }

    /// `(field, default)` of every table row whose default cell is code: `| `f` | .. | .. | `d` |`.
    fn doc_defaults(doc: &str) -> Vec<(String, String)> {
        let mut rows = Vec::new();
        for line in doc.lines().filter(|line| line.starts_with("| `")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let (Some(name), Some(default)) = (cells.get(1), cells.get(4)) else { continue };
            if default.len() >= 2 && default.starts_with('`') && default.ends_with('`') {
                rows.push((name.trim_matches('`').to_string(), default[1..default.len() - 1].to_string()));
            }
        }
        rows
    }

    /// The value text after `key:` at `offset` in printed RON, up to its `,` at depth 0.
    fn value_after(text: &str, offset: usize) -> String {
        let bytes = text.as_bytes();
        let mut i = text[offset..].find(':').map_or(text.len(), |n| offset + n + 1);
        let start = i;
        let mut depth = 0usize;
        while let Some(&b) = bytes.get(i) {
            match b {
                b'"' => {
                    i = skip_string(bytes, i);
                    continue;
                }
                b'(' | b'[' => depth += 1,
                b')' | b']' if depth == 0 => break,
                b')' | b']' => depth -= 1,
                b',' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        text[start..i].trim().to_string()
    }

    /// Compares the defaults the docs' tables give with the ones a minimal scenario prints.
    fn check_doc_defaults(doc: &str) {
        let squeeze = |value: &str| -> String {
            let compact: String = value.chars().filter(|c| !c.is_whitespace()).collect();
            compact.replace(",)", ")").replace(",]", "]")
        };
        let rows = doc_defaults(doc);
        assert!(rows.len() > 40, "{rows:?}");
        let minimal = parse_scenario("(name: \"x\", deployment: \"1P_TP8:1D_TP8\")", "<min>");
        let printed = scenario_to_ron(&minimal.unwrap_or_else(|err| panic!("{err}")));
        let scanned = scan(&printed, printed.len(), &|_| true);
        let mut compared = 0;
        for anchor in &scanned.anchors {
            let name = anchor.path.rsplit(['.', ']']).next().unwrap_or_default();
            let documented: Vec<&String> =
                rows.iter().filter(|(field, _)| field == name).map(|(_, default)| default).collect();
            if documented.is_empty() {
                continue;
            }
            let value = squeeze(&value_after(&printed, anchor.offset));
            assert!(
                documented.iter().any(|default| squeeze(default) == value),
                "docs/scenarios.md gives `{name}` the default {documented:?}, scenario.rs {value}"
            );
            compared += 1;
        }
        assert!(compared > 40, "only {compared} defaults compared");
    }
}
