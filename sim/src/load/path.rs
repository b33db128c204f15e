//! The field-path scanner: which dotted path (`faults.timeline[1].target`) a position of a
//! scenario's text belongs to, and where a path's `key:` is written ([`Location`], a line and
//! column).
//!
//! ron reports only a line and column. The scanner does not parse RON; it only follows brackets,
//! skips strings and comments, and notices `identifier:` (a struct field) and `,` (the next field
//! or list element), and inside a map a `"key":` (the entry, written `peers["P0"]` in a path).
//! That is enough to know which field any position of a well-formed prefix belongs to, which is
//! all ron's errors need (ron has read that prefix successfully before it stopped).
//!
//! It has four users: the path of a ron error ([`super::errors`]), the position of a
//! validation error's field ([`locate`]), the strings inside `protocol.legacy`
//! ([`super::legacy_names`]), and the fields a scenario that names profiles writes itself.
//! `serde_path_to_error` was tried in its place: it works with ron's `Deserializer`
//! (`from_str_with_options`, then `span_error` for the position) and gave the
//! scanner's path for all but 38 of the 4,299 errors the tests provoke (the 38 are corrupted text
//! around list separators, where it names the list or the next element and the scanner the
//! element before). But it covers only the first use: ron gives no span for a value, so
//! validation errors still need the scanner to find their field, and so does the legacy rewrite.
//! It would have added a dependency and a second source of paths without removing this code.

use std::fmt;

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

/// The place of byte `offset` of `text`.
pub(super) fn location_of(text: &str, offset: usize) -> Location {
    let before = &text[..offset];
    let line = 1 + before.matches('\n').count();
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Location { line, column: 1 + before[line_start..].chars().count() }
}

/// Where the field at dotted `path` is written: its `key:`, or for a list element its first
/// character. When the path is not in the text (the field keeps its default), the nearest
/// enclosing field that is; `None` when not even the top-level field is written.
pub(super) fn locate(text: &str, path: &str) -> Option<Location> {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bracket {
    /// `(`: a struct, struct variant, tuple or `Some(..)`; tracks its current field.
    Paren,
    /// `[`: a list; tracks its current element.
    Square,
    /// `{`: a map (`protocol.peers`); tracks its current entry's key.
    Curly,
}

#[derive(Debug)]
struct Frame {
    bracket: Bracket,
    /// The field whose value is being read (`Paren`), or the key of the map entry (`Curly`).
    key: Option<String>,
    /// The element being read (`Square` only).
    index: usize,
    /// Whether the current element has begun (`Square` only), to anchor it once.
    started: bool,
}

impl Frame {
    /// The path component this frame adds: `.key` inside a struct, `[i]` inside a list,
    /// `["key"]` inside a map.
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
            Bracket::Curly => {
                if let Some(key) = &self.key {
                    path.push_str(&format!("[\"{key}\"]"));
                }
            }
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
pub(super) struct Anchor {
    pub(super) path: String,
    pub(super) offset: usize,
}

/// A string literal or raw identifier used as a value, with its path and byte range.
#[derive(Debug)]
pub(super) struct Atom {
    pub(super) path: String,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) quoted: bool,
}

#[derive(Debug, Default)]
pub(super) struct Scanned {
    pub(super) anchors: Vec<Anchor>,
    pub(super) atoms: Vec<Atom>,
    /// Path of the value being read at the stop offset, e.g. `workload.clients.concurrency`.
    pub(super) path_at_stop: String,
    /// Path of the struct being read at the stop offset, without its current field, e.g.
    /// `workload.clients` (unknown and missing fields are named relative to it).
    pub(super) container_at_stop: String,
    /// Where a bracket opened past [`MAX_NESTING`] levels, if one did; the scan stops there.
    pub(super) too_deep: Option<usize>,
}

/// Deepest bracket nesting a scenario may have. A scenario nests about six levels; the bound
/// keeps the scanner's paths short, so its work stays linear in the size of the file.
pub(super) const MAX_NESTING: usize = 16;

/// Longest field name kept in a scanned path, in bytes (the format's longest is 30); a longer
/// name is cut, which only shortens the path in an error about that very name.
const MAX_KEY_BYTES: usize = 64;

/// Scans `text`, recording the paths at `stop` (a byte offset), and every anchor and atom whose
/// path `keep` accepts. It stops at a bracket nested deeper than [`MAX_NESTING`].
pub(super) fn scan(text: &str, stop: usize, keep: &dyn Fn(&str) -> bool) -> Scanned {
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
            b'"' if is_map_key(&frames, bytes, i) => {
                // A map entry's key (`"P0":`): the entry's path anchors here, like a field's.
                let end = skip_string(bytes, i);
                let name = cut_key(&text[i + 1..end - 1]);
                if let Some(frame) = frames.last_mut() {
                    frame.key = Some(name.to_string());
                }
                let path = render(&frames);
                if keep(&path) {
                    out.anchors.push(Anchor { path, offset: i });
                }
                i = skip_blank(bytes, end) + 1;
            }
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
                    let name = cut_key(text[i..end].trim_start_matches("r#"));
                    if let Some(frame) = frames.last_mut() {
                        frame.key = Some(name.to_string());
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

/// `name` cut to [`MAX_KEY_BYTES`] at a character boundary.
fn cut_key(name: &str) -> &str {
    let mut cut = name.len().min(MAX_KEY_BYTES);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    &name[..cut]
}

/// Whether the string at `i` is the key of a map entry: a closed string directly inside `{`,
/// where no key was read for the current entry yet, followed by `:`.
fn is_map_key(frames: &[Frame], bytes: &[u8], i: usize) -> bool {
    let in_map = frames.last().is_some_and(|frame| frame.bracket == Bracket::Curly && frame.key.is_none());
    let end = skip_string(bytes, i);
    in_map && end > i + 1 && bytes[end - 1] == b'"' && bytes.get(skip_blank(bytes, end)) == Some(&b':')
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
pub(super) fn skip_blank(bytes: &[u8], mut i: usize) -> usize {
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
pub(super) fn skip_string(bytes: &[u8], i: usize) -> usize {
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

pub(super) fn is_ident_start(c: char) -> bool {
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
pub(super) fn ident_end(bytes: &[u8], i: usize) -> usize {
    let raw = bytes[i..].starts_with(b"r#");
    let start = if raw { i + 2 } else { i };
    let len = bytes[start..]
        .iter()
        .take_while(|&&b| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80 || (raw && b"-.+".contains(&b)))
        .count();
    start + len
}

#[cfg(test)]
mod tests {
    use super::super::{load_scenario, parse_scenario, MAX_SCENARIO_BYTES};
    use super::*;

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
        assert!(shown.ends_with("cannot read the scenario file: the file is 1048577 bytes, larger than 1048576 bytes, the most this command reads"), "{shown}");
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
        check_scan("(p: {\"P0\": ‸\"x\"})", ("p[\"P0\"]", "p"));
        check_scan("(p: {\"P0\": \"x\", ‸\"D1\": \"y\"})", ("p", "p"));
        check_scan("(p: {\"P0\": \"x\", \"D1\" : ‸\"y\"}, k: 1)", ("p[\"D1\"]", "p"));
        check_scan("(p: {\"P0\": \"x\"}, k: ‸1)", ("k", ""));
    }

    #[test]
    fn load_locate_finds_the_key_or_the_nearest_enclosing_one() {
        let text =
            "(\n  a: (\n    b: 1,\n  ),\n  l: [\n    (c: 2),\n    (c: 3),\n  ],\n  m: {\"P0\": 1, \"D1\": 2},\n)";
        let table = [
            ("a", Some((2, 3))),
            ("a.b", Some((3, 5))),
            ("a.z", Some((2, 3))),
            ("l[1]", Some((7, 5))),
            ("l[1].c", Some((7, 6))),
            ("l[5].c", Some((5, 3))),
            ("m[\"D1\"]", Some((9, 16))),
            ("m[\"P3\"]", Some((9, 3))),
            ("z", None),
        ];
        for (path, expected) in table {
            let expected = expected.map(|(line, column)| Location { line, column });
            assert_eq!(locate(text, path), expected, "{path}");
        }
    }
}
