//! The tidy rule against import cycles between files: for each crate, the graph of which file
//! uses a name another file defines, and petgraph's strongly connected components of it. A cycle
//! means files that cannot be read, or moved, one without the other; the names they share belong
//! in a file below them.
//!
//! The graph is built from the paths in code (not comments, and not items under `#[cfg(test)]`,
//! where a test module may import its parent, or `#[cfg(doc)]`, which only serve doc links):
//! `use` trees and paths written inline, starting with `crate::`, `super::`, `self::` or a child
//! module's name. Each is resolved through the module tree (`a/b.rs` or `a/b/mod.rs`) to the
//! module it names, and then, following that module's `use` items, to the file that defines the
//! name, so a child that imports a sibling's type through its parent's `pub use` depends on the
//! sibling. A file's uses of its own submodules are not edges: a parent holds and re-exports what
//! it contains (a node split into `impl` blocks, one file each, has its children import the node
//! from the parent while the parent holds their types), so the rule is about imports up and
//! across the tree.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use petgraph::algo::tarjan_scc;
use petgraph::graph::{DiGraph, NodeIndex};

/// Cycles allowed to stay, each the exact set of files of one cycle. Empty: every cycle is a
/// problem. An entry that matches no cycle while one of its files is still there is itself a
/// problem, so the list only shrinks; the mechanism stays for a cycle a branch must leave behind
/// for a while, named with the reason and the issue that removes it.
pub const ALLOWED: [&[&str]; 0] = [];

/// One import cycle: its files (workspace-relative, sorted) and the imports that tie them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cycle {
    pub files: Vec<PathBuf>,
    pub ties: Vec<Tie>,
}

/// The imports from one file of a cycle to another: the first line naming the other file, and
/// the names it takes from it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tie {
    pub from: PathBuf,
    pub line: usize,
    pub to: PathBuf,
    pub names: Vec<String>,
}

impl std::fmt::Display for Cycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ties: Vec<String> = self
            .ties
            .iter()
            .map(|t| {
                format!("{}:{} -> {} ({})", t.from.display(), t.line, t.to.display(), t.names.join(", "))
            })
            .collect();
        write!(f, "{}", ties.join("; "))
    }
}

/// The problems of the workspace under `root` whose crates start at `roots`: every import cycle
/// not in [`ALLOWED`], and every entry of [`ALLOWED`] that matches no cycle.
pub fn problems(root: &Path, roots: &[PathBuf]) -> Vec<String> {
    let found = cycles(roots, |rel| std::fs::read_to_string(root.join(rel)).ok());
    let mut problems = Vec::new();
    for cycle in &found {
        if ALLOWED.iter().any(|allowed| same_files(allowed, &cycle.files)) {
            continue;
        }
        problems.push(format!(
            "{}:1: import cycle between {} files: {cycle}; move the names they share into a file below them",
            cycle.files[0].display(),
            cycle.files.len()
        ));
    }
    for allowed in ALLOWED {
        let present = allowed.iter().any(|file| root.join(file).is_file());
        if present && !found.iter().any(|cycle| same_files(allowed, &cycle.files)) {
            problems.push(format!(
                "xtask/src/tidy/imports.rs:1: the allowed import cycle {} is gone; remove it from `ALLOWED`",
                allowed.join(", ")
            ));
        }
    }
    problems
}

fn same_files(allowed: &[&str], files: &[PathBuf]) -> bool {
    allowed.len() == files.len() && allowed.iter().all(|a| files.iter().any(|f| f == Path::new(a)))
}

/// The import cycles of the crates whose root files are `roots` (workspace-relative), reading
/// files through `read`. The module tree is followed from each root through its `mod name;`
/// items (`#[cfg(test)]` ones skipped: a test module may import its parent), each module being
/// `dir/name.rs` or `dir/name/mod.rs`. Sorted; a cycle two crates share is reported once.
pub fn cycles(roots: &[PathBuf], read: impl Fn(&Path) -> Option<String>) -> Vec<Cycle> {
    let mut found = BTreeSet::new();
    for root in roots {
        found.extend(crate_cycles(root, &read));
    }
    found.into_iter().collect()
}

/// A module's path inside its crate (`[]` for the root).
type ModPath = Vec<String>;

fn crate_cycles(root: &Path, read: &impl Fn(&Path) -> Option<String>) -> Vec<Cycle> {
    // The module tree: every module, file or inline, with the file that holds it.
    let mut modules: BTreeMap<ModPath, PathBuf> = BTreeMap::new();
    let mut scans: Vec<(PathBuf, ModPath, Scan)> = Vec::new();
    let mut queue = vec![(root.to_path_buf(), ModPath::new(), true)];
    while let Some((file, module, owns_dir)) = queue.pop() {
        if modules.contains_key(&module) {
            continue;
        }
        let Some(text) = read(&file) else { continue };
        let scan = scan(&text);
        modules.insert(module.clone(), file.clone());
        let parent = file.parent().unwrap_or(Path::new(""));
        // A root and a `mod.rs` hold their children beside them; `a.rs` holds them in `a/`.
        let dir =
            if owns_dir { parent.to_path_buf() } else { parent.join(file.file_stem().unwrap_or_default()) };
        for inline in &scan.inline {
            modules.insert([module.clone(), inline.clone()].concat(), file.clone());
        }
        for (within, name) in &scan.mods {
            let sub: PathBuf = within.iter().collect();
            let flat = dir.join(&sub).join(format!("{name}.rs"));
            let nested = dir.join(&sub).join(name).join("mod.rs");
            let child = [module.clone(), within.clone(), vec![name.clone()]].concat();
            if read(&flat).is_some() {
                queue.push((flat, child, false));
            } else {
                queue.push((nested, child, true));
            }
        }
        scans.push((file, module, scan));
    }

    // What each module's `use` items bring in, by the name they bind there.
    let mut imports: Imports = BTreeMap::new();
    for (_, module, scan) in &scans {
        for import in &scan.imports {
            let here = [module.clone(), import.within.clone()].concat();
            imports.entry((here, import.name.clone())).or_insert_with(|| import.segments.clone());
        }
    }

    // The file-level graph, with the names and first line of each edge.
    let files: Vec<PathBuf> = scans.iter().map(|(file, _, _)| file.clone()).collect();
    let index = |file: &Path| files.iter().position(|f| f == file).expect("every module's file was scanned");
    let mut edges: BTreeMap<(usize, usize), (usize, BTreeSet<String>)> = BTreeMap::new();
    for (from, module, scan) in &scans {
        for reference in &scan.refs {
            let here = [module.clone(), reference.within.clone()].concat();
            let Some((named, item)) = resolve(&modules, &here, &reference.segments) else { continue };
            let target = match &item {
                Some(item) => defining(&modules, &imports, named, item, 0),
                None => named,
            };
            let to = &modules[&target];
            // The same file, or one of its own submodules: not an edge (see the module doc).
            if to == from || (target.len() > module.len() && target.starts_with(module)) {
                continue;
            }
            let name = item.unwrap_or_else(|| target.last().cloned().unwrap_or_else(|| "crate".to_string()));
            let edge = edges.entry((index(from), index(to))).or_insert((reference.line, BTreeSet::new()));
            edge.0 = edge.0.min(reference.line);
            edge.1.insert(name);
        }
    }
    let mut graph: DiGraph<usize, ()> = DiGraph::new();
    for i in 0..files.len() {
        graph.add_node(i);
    }
    for &(from, to) in edges.keys() {
        graph.add_edge(NodeIndex::new(from), NodeIndex::new(to), ());
    }

    let mut cycles = Vec::new();
    for component in tarjan_scc(&graph) {
        if component.len() < 2 {
            continue;
        }
        let members: BTreeSet<usize> = component.into_iter().map(NodeIndex::index).collect();
        let mut cycle_files: Vec<PathBuf> = members.iter().map(|&i| files[i].clone()).collect();
        cycle_files.sort();
        let mut ties: Vec<Tie> = edges
            .iter()
            .filter(|((from, to), _)| members.contains(from) && members.contains(to))
            .map(|(&(from, to), (line, names))| Tie {
                from: files[from].clone(),
                line: *line,
                to: files[to].clone(),
                names: names.iter().cloned().collect(),
            })
            .collect();
        ties.sort();
        cycles.push(Cycle { files: cycle_files, ties });
    }
    cycles
}

/// The module a path written in module `here` names (the longest prefix of the path that is a
/// module of the crate), and the item it takes from it (`None` when the path names the module
/// itself). `None` for a path that starts outside the crate (another crate, `std`, a local name).
fn resolve(
    modules: &BTreeMap<ModPath, PathBuf>,
    here: &[String],
    segments: &[String],
) -> Option<(ModPath, Option<String>)> {
    let (mut current, rest): (ModPath, &[String]) = match segments.first()?.as_str() {
        "crate" => (Vec::new(), &segments[1..]),
        "self" => (here.to_vec(), &segments[1..]),
        "super" => {
            let mut current = here.to_vec();
            let mut rest = segments;
            while rest.first().is_some_and(|s| s == "super") {
                current.pop()?;
                rest = &rest[1..];
            }
            (current, rest)
        }
        child if modules.contains_key(&[here.to_vec(), vec![child.to_string()]].concat()) => {
            (here.to_vec(), segments)
        }
        _ => return None,
    };
    for segment in rest {
        if segment == "self" {
            continue;
        }
        let deeper = [current.clone(), vec![segment.clone()]].concat();
        if !modules.contains_key(&deeper) {
            return Some((current, Some(segment.clone())));
        }
        current = deeper;
    }
    Some((current, None))
}

/// Names each module's `use` items bind, keyed by module and name, with the path they import.
type Imports = BTreeMap<(ModPath, String), Vec<String>>;

/// The module whose file defines `item` as seen from `module`: `module` itself, unless one of its
/// `use` items brings the name in from another module of the crate, which is followed (a few
/// steps at most, so that a cycle of re-exports, which the compiler would refuse, cannot loop).
fn defining(
    modules: &BTreeMap<ModPath, PathBuf>,
    imports: &Imports,
    module: ModPath,
    item: &str,
    depth: usize,
) -> ModPath {
    let Some(segments) = imports.get(&(module.clone(), item.to_string())) else { return module };
    match resolve(modules, &module, segments) {
        Some((named, Some(next))) if depth < 8 => defining(modules, imports, named, &next, depth + 1),
        Some((named, _)) => named,
        None => module,
    }
}

/// What one file declares and names.
#[derive(Debug, Default)]
struct Scan {
    /// `mod name;` items: the inline modules they sit in, and the name.
    mods: Vec<(ModPath, String)>,
    /// Inline `mod name { ... }` items, as paths inside the file.
    inline: Vec<ModPath>,
    /// Every path that may name a module of the crate.
    refs: Vec<Reference>,
    /// The names `use` items bind (a glob binds none).
    imports: Vec<Import>,
}

/// A name a `use` item binds in the module `within` (inside the file), and the path it imports.
#[derive(Debug)]
struct Import {
    within: ModPath,
    name: String,
    segments: Vec<String>,
}

/// A path in code: where it is and its segments (`crate`, `super`, `self` or a first name that
/// may be a child module).
#[derive(Debug)]
struct Reference {
    line: usize,
    within: ModPath,
    segments: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// Reads one file's module items and paths, skipping comments, literals, attributes and every
/// item marked `#[cfg(test)]`.
fn scan(text: &str) -> Scan {
    let toks = lex(text);
    let mut out = Scan::default();
    let is = |i: usize, t: &Tok| toks.get(i).is_some_and(|(tok, _)| tok == t);
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    // Open inline modules: name and the brace depth inside them.
    let mut stack: Vec<(String, usize)> = Vec::new();
    let within = |stack: &[(String, usize)]| stack.iter().map(|(name, _)| name.clone()).collect::<ModPath>();
    let mut depth = 0;
    let mut skipped_item = false;
    let mut i = 0;
    while i < toks.len() {
        let line = toks[i].1;
        if is(i, &Tok::Punct('#')) {
            let inner = is(i + 1, &Tok::Punct('!'));
            let open = if inner { i + 2 } else { i + 1 };
            if is(open, &Tok::Punct('[')) {
                let close = matching(&toks, open);
                let attr: Vec<&Tok> = toks[open + 1..close].iter().map(|(t, _)| t).collect();
                let cfg = |what: &str| {
                    let wanted =
                        [Tok::Ident("cfg".into()), Tok::Punct('('), Tok::Ident(what.into()), Tok::Punct(')')];
                    attr.len() == 4 && attr.iter().zip(&wanted).all(|(a, b)| *a == b)
                };
                if !inner && (cfg("test") || cfg("doc")) {
                    skipped_item = true;
                }
                i = close + 1;
                continue;
            }
        }
        if skipped_item {
            // Skip the item (a test or doc-only one): up to its `;`, or over its body.
            skipped_item = false;
            let mut nest = 0usize;
            while i < toks.len() {
                match toks[i].0 {
                    Tok::Punct('(' | '[') => nest += 1,
                    Tok::Punct(')' | ']') => nest = nest.saturating_sub(1),
                    Tok::Punct(';') if nest == 0 => break,
                    Tok::Punct('{') if nest == 0 => {
                        i = matching(&toks, i);
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        match &toks[i].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if stack.last().is_some_and(|(_, d)| *d == depth) {
                    stack.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(word) if word == "mod" => {
                if let Some(name) = ident(i + 1) {
                    if is(i + 2, &Tok::Punct(';')) {
                        out.mods.push((within(&stack), name.to_string()));
                        i += 3;
                        continue;
                    }
                    if is(i + 2, &Tok::Punct('{')) {
                        stack.push((name.to_string(), depth + 1));
                        out.inline.push(within(&stack));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
            }
            Tok::Ident(word) if word == "use" => {
                let mut k = i + 1;
                let mut paths = Vec::new();
                use_tree(&toks, &mut k, Vec::new(), &mut paths);
                for (segments, name) in paths {
                    if let Some(name) = name {
                        out.imports.push(Import { within: within(&stack), name, segments: segments.clone() });
                    }
                    out.refs.push(Reference { line, within: within(&stack), segments });
                }
                while k < toks.len() && !is(k, &Tok::Punct(';')) {
                    k += 1;
                }
                i = k + 1;
                continue;
            }
            Tok::Ident(first) if is(i + 1, &Tok::Sep) && !(i > 0 && is(i - 1, &Tok::Sep)) => {
                // A path in code: its identifiers up to the first that is not followed by `::`.
                let mut segments = vec![first.clone()];
                let mut k = i + 1;
                while is(k, &Tok::Sep) {
                    let Some(next) = ident(k + 1) else { break };
                    segments.push(next.to_string());
                    k += 2;
                }
                out.refs.push(Reference { line, within: within(&stack), segments });
                i = k;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The index of the bracket closing the one at `open` (or the last token when unclosed).
fn matching(toks: &[(Tok, usize)], open: usize) -> usize {
    let mut nest = 0usize;
    for (k, (tok, _)) in toks.iter().enumerate().skip(open) {
        match tok {
            Tok::Punct('(' | '[' | '{') => nest += 1,
            Tok::Punct(')' | ']' | '}') => {
                nest -= 1;
                if nest == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    toks.len().saturating_sub(1)
}

/// The paths of a `use` tree starting at `*k`, each with `prefix` in front and the name it binds;
/// `a::{b, c::d as e}` gives `a::b` (binding `b`) and `a::c::d` (binding `e`), `a::{self}` gives
/// `a::self` (binding `a`), a glob gives the module and binds nothing.
fn use_tree(
    toks: &[(Tok, usize)],
    k: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path = prefix;
    while let Some((tok, _)) = toks.get(*k) {
        match tok {
            Tok::Ident(name) => {
                path.push(name.clone());
                *k += 1;
                if matches!(toks.get(*k), Some((Tok::Sep, _))) {
                    *k += 1;
                    continue;
                }
                let mut binds =
                    if name == "self" { path.iter().rev().nth(1).cloned() } else { Some(name.clone()) };
                if matches!(toks.get(*k), Some((Tok::Ident(word), _)) if word == "as") {
                    binds = match toks.get(*k + 1) {
                        Some((Tok::Ident(alias), _)) if alias != "_" => Some(alias.clone()),
                        _ => None,
                    };
                    *k += 2;
                }
                out.push((path, binds));
                return;
            }
            Tok::Punct('*') => {
                *k += 1;
                out.push((path, None));
                return;
            }
            Tok::Punct('{') => {
                *k += 1;
                while let Some((tok, _)) = toks.get(*k) {
                    match tok {
                        Tok::Punct('}') => {
                            *k += 1;
                            return;
                        }
                        Tok::Punct(',') => *k += 1,
                        _ => {
                            let before = *k;
                            use_tree(toks, k, path.clone(), out);
                            if *k == before {
                                *k += 1;
                            }
                        }
                    }
                }
                return;
            }
            // `$crate::` in a macro, a leading `::`.
            Tok::Punct('$') | Tok::Sep => *k += 1,
            _ => return,
        }
    }
}

/// Identifiers (with their line), `::` and single punctuation characters; comments, string,
/// character and number literals and lifetimes' quotes dropped.
fn lex(text: &str) -> Vec<(Tok, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut toks = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut nest = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    nest += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    nest -= 1;
                    i += 2;
                    if nest == 0 {
                        break;
                    }
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(&chars, i + 1, false, 0, &mut line);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character literal: up to the closing quote.
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime: its name lexes as an identifier.
                i += 1;
            }
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            // String prefixes: `b"`, `r"`, `r#"`, `br#"`; a byte `b'x'`; a raw identifier `r#x`.
            let raw = matches!(word.as_str(), "r" | "br" | "cr");
            if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_string(&chars, i + 1, false, 0, &mut line);
            } else if word == "b" && at(i) == '\'' {
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            } else if raw && (at(i) == '"' || (at(i) == '#' && matches!(at(i + 1), '"' | '#'))) {
                let mut hashes = 0;
                while at(i) == '#' {
                    hashes += 1;
                    i += 1;
                }
                i = skip_string(&chars, i + 1, true, hashes, &mut line);
            } else if word == "r" && at(i) == '#' {
                i += 1;
            } else {
                toks.push((Tok::Ident(word), line));
            }
        } else if c == ':' && at(i + 1) == ':' {
            toks.push((Tok::Sep, line));
            i += 2;
        } else {
            toks.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    toks
}

/// The index after a string literal whose body starts at `i`: a plain string's escapes count
/// (`raw` false); a raw one has none and closes with a quote and `hashes` `#`s.
fn skip_string(chars: &[char], mut i: usize, raw: bool, hashes: usize, line: &mut usize) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' if !raw => {
                *line += usize::from(chars.get(i + 1) == Some(&'\n'));
                i += 2;
            }
            '"' if (1..=hashes).all(|h| chars.get(i + h) == Some(&'#')) => return i + 1 + hashes,
            c => {
                *line += usize::from(c == '\n');
                i += 1;
            }
        }
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny crate (its root first) -> its cycles, each as its ties `from:line -> to (names)`.
    fn check(files: &[(&str, &str)], expected: &[&str]) {
        let read =
            |path: &Path| files.iter().find(|(p, _)| Path::new(p) == path).map(|(_, text)| text.to_string());
        let found: Vec<String> =
            cycles(&[PathBuf::from(files[0].0)], read).iter().map(ToString::to_string).collect();
        assert_eq!(found, expected, "{files:#?}");
    }

    #[test]
    fn cycles_table() {
        // One way only: no cycle.
        check(
            &[
                ("src/lib.rs", "mod a;\nmod b;\n"),
                ("src/a.rs", "use crate::b::B;\n"),
                ("src/b.rs", "pub struct B;\n"),
            ],
            &[],
        );
        // Both ways, through `crate::` and `super::`.
        check(
            &[
                ("src/lib.rs", "mod a;\nmod b;\n"),
                ("src/a.rs", "pub struct A;\nuse crate::b::B;\n"),
                ("src/b.rs", "use super::a::A;\npub struct B;\n"),
            ],
            &["src/a.rs:2 -> src/b.rs (B); src/b.rs:1 -> src/a.rs (A)"],
        );
        // Paths in code count, a use tree's branches each count, and the first line is named.
        check(
            &[
                ("src/main.rs", "mod a;\nmod b;\nmod c;\n"),
                ("src/a.rs", "fn f() {\n    crate::b::g();\n}\nfn h() { crate::b::G; }\n"),
                ("src/b.rs", "use crate::{c::{self, C}, b};\n"),
                ("src/c.rs", "fn k() -> super::a::A { todo!() }\n"),
            ],
            &["src/a.rs:2 -> src/b.rs (G, g); src/b.rs:1 -> src/c.rs (C, c); src/c.rs:1 -> src/a.rs (A)"],
        );
        // Comments, strings and characters are not code.
        check(
            &[
                ("src/lib.rs", "mod a;\nmod b;\n"),
                ("src/a.rs", "use crate::b::B;\n"),
                ("src/b.rs", "// use crate::a::A;\n/* crate::a::A */ let s = \"crate::a::A\"; let r = r#\"super::a\"#;\nlet c = '\"'; let q = b\"super::a::A\";\n"),
            ],
            &[],
        );
        // A parent's re-export is followed to the file that defines the name: two children that
        // import each other through their parent are a cycle of the two, and the parent, which
        // only holds them, is in none.
        let parent = "mod c;\nmod d;\npub use c::C;\npub use self::d::D as Dee;\n";
        check(
            &[
                ("src/lib.rs", "pub mod w;\n"),
                ("src/w/mod.rs", parent),
                ("src/w/c.rs", "use super::Dee;\npub struct C;\n"),
                ("src/w/d.rs", "pub struct D;\nfn f(_: crate::w::C) {}\n"),
            ],
            &["src/w/c.rs:1 -> src/w/d.rs (Dee); src/w/d.rs:2 -> src/w/c.rs (C)"],
        );
        // A node split into `impl` blocks: the parent holds its children's types, the children
        // import the node from the parent. Not a cycle; but a child that leans on the parent
        // while the parent leans, through another file, on the child is one.
        let node = "mod state;\nmod step;\nuse state::S;\npub struct W(S);\npub const MAX: u8 = 1;\n";
        check(
            &[
                ("src/lib.rs", "mod r;\npub mod w;\n"),
                ("src/w/mod.rs", node),
                ("src/w/state.rs", "pub struct S;\n"),
                ("src/w/step.rs", "use super::{W, MAX};\nimpl W {}\n"),
                ("src/r.rs", "use crate::w::W;\n"),
            ],
            &[],
        );
        check(
            &[
                ("src/lib.rs", "mod r;\npub mod w;\n"),
                ("src/w/mod.rs", &format!("{node}use crate::r::R;\n")),
                ("src/w/state.rs", "pub struct S;\n"),
                ("src/w/step.rs", "use super::{W, MAX};\nimpl W {}\n"),
                ("src/r.rs", "pub struct R;\nuse crate::w::step;\n"),
            ],
            &["src/r.rs:2 -> src/w/step.rs (step); src/w/mod.rs:6 -> src/r.rs (R); src/w/step.rs:1 -> src/w/mod.rs (MAX, W)"],
        );
        // Test modules may import their parent: inline, as a file, or any `#[cfg(test)]` item.
        check(
            &[
                ("src/lib.rs", "pub mod w;\n"),
                ("src/w/mod.rs", "mod c;\npub use c::C;\npub struct W;\n#[cfg(test)]\nmod tests;\n"),
                ("src/w/tests.rs", "use super::c::C;\n"),
                (
                    "src/w/c.rs",
                    "pub struct C;\n#[cfg(test)]\n#[allow(unused)]\nfn f() -> crate::w::W { crate::w::W }\n\
                     #[cfg(test)]\nmod tests {\n    use super::super::W;\n    mod deeper { use crate::w::W; }\n}\n",
                ),
            ],
            &[],
        );
        // Files in folders: `a.rs` holds its children in `a/`, a `mod.rs` beside it; `super` counts
        // from where it is written, inline modules included; doc-only imports are not edges.
        check(
            &[
                ("src/lib.rs", "mod a;\nmod b;\n"),
                ("src/a.rs", "mod x;\n#[cfg(doc)]\nuse crate::b::y::Y;\n"),
                ("src/a/x.rs", "pub struct X;\nmod inner {\n    use super::super::super::b::y::Y;\n}\n"),
                ("src/b/mod.rs", "pub mod y;\n"),
                ("src/b/y.rs", "pub struct Y;\nfn f() { super::super::a::x::g(); }\n"),
            ],
            &["src/a/x.rs:3 -> src/b/y.rs (Y); src/b/y.rs:2 -> src/a/x.rs (g)"],
        );
        // Two cycles, reported apart, and a file that only leans on one is in neither.
        check(
            &[
                ("src/lib.rs", "mod a;\nmod b;\nmod c;\nmod d;\nmod e;\n"),
                ("src/a.rs", "use crate::b::B;\n"),
                ("src/b.rs", "use crate::a::A;\n"),
                ("src/c.rs", "use crate::d::D;\nuse crate::a::A;\n"),
                ("src/d.rs", "use crate::c::C;\n"),
                ("src/e.rs", "use crate::a::A;\n"),
            ],
            &[
                "src/a.rs:1 -> src/b.rs (B); src/b.rs:1 -> src/a.rs (A)",
                "src/c.rs:1 -> src/d.rs (D); src/d.rs:1 -> src/c.rs (C)",
            ],
        );
    }
}
