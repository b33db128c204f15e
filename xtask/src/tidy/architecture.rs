//! The tidy rule that keeps ARCHITECTURE.md true and complete: every path it names in backticks
//! exists, and every crate, every folder under a crate's `src/` and every file directly in a
//! crate's `src/` (but its roots, `lib.rs` and `main.rs`) is named. Files inside a module's
//! folder need not be: naming the folder keeps the map short, and the module's own `//!` line
//! says what each file is for.
//!
//! Names are written the way the document reads, relative to where they stand: a heading or a
//! table row that starts with a folder (`` `sim/` ``) is the base of what follows it, and a
//! folder followed by `(` or `:` (`` `world/` (`mod.rs` ...) ``, `` `decode/`: `mod.rs` ... ``)
//! holds the names up to the closing parenthesis, or the end of the row or list item. A name
//! resolves to the first path that exists among each enclosing folder joined with the name, then
//! with `src/` and the name, innermost first, and last the workspace root. Links and the words
//! `check_citations` reads are that rule's; this one reads what is in backticks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The document, at the workspace root.
pub const FILE: &str = "ARCHITECTURE.md";

/// What a backticked name must end with to be read as a path (a folder ends with `/`): source
/// and data files of the repository. Files a run writes (`result.json`) are not in it.
const EXTENSIONS: [&str; 5] = [".rs", ".md", ".toml", ".ron", ".py"];

/// The problems of the document: each name that resolves to nothing, then each path of
/// `required` no name resolves to. `exists` says whether a workspace-relative path is there.
pub fn check(text: &str, exists: impl Fn(&Path) -> bool, required: &[PathBuf]) -> Vec<String> {
    let (named, mut problems) = names(text, exists);
    for path in required {
        if !named.contains(path) {
            problems.push(format!(
                "{FILE}:1: does not name `{}`; every crate, every folder under a crate's src/ and every \
                 file directly in it is named",
                path.display()
            ));
        }
    }
    problems
}

/// The problems of the workspace's ARCHITECTURE.md, against the files under `root`.
pub fn problems(root: &Path) -> Vec<String> {
    match std::fs::read_to_string(root.join(FILE)) {
        Ok(text) => check(&text, |p| root.join(p).exists(), &required(root)),
        Err(err) => vec![format!("{FILE}: cannot be read: {err}")],
    }
}

/// What the document must name: each package's folder (relative to `root`; the root package's
/// is its `src/`), every folder under its `src/`, and every `.rs` file directly in its `src/`
/// but `lib.rs` and `main.rs`. Sorted.
pub fn required(root: &Path) -> Vec<PathBuf> {
    let mut packages = Vec::new();
    super::collect_packages(root, &mut packages);
    let mut out = Vec::new();
    for package in packages {
        let rel = package.strip_prefix(root).unwrap_or(&package).to_path_buf();
        let src = package.join("src");
        if rel.as_os_str().is_empty() {
            out.push(PathBuf::from("src"));
        } else {
            out.push(rel.clone());
        }
        let Ok(entries) = std::fs::read_dir(&src) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                folders(&path, &mut out);
            } else if name.ends_with(".rs") && !["lib.rs", "main.rs", "tests.rs"].contains(&name.as_str()) {
                out.push(path);
            }
        }
    }
    let mut out: Vec<PathBuf> =
        out.into_iter().map(|p| p.strip_prefix(root).map(Path::to_path_buf).unwrap_or(p)).collect();
    out.sort();
    out.dedup();
    out
}

/// `dir` and every folder under it.
fn folders(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.path().is_dir() {
            folders(&entry.path(), out);
        }
    }
}

/// A folder that holds the names after it, until the parenthesis depth falls below `depth`.
struct Frame {
    dir: PathBuf,
    depth: usize,
}

/// The paths the backticked names of `text` resolve to (folders without their `/`), and one
/// problem per name that resolves to nothing.
pub fn names(text: &str, exists: impl Fn(&Path) -> bool) -> (BTreeSet<PathBuf>, Vec<String>) {
    let mut named = BTreeSet::new();
    let mut problems = Vec::new();
    let mut section = PathBuf::new();
    let mut stack: Vec<Frame> = Vec::new();
    let mut depth = 0;
    for (i, line) in text.lines().enumerate() {
        if line.starts_with('#') {
            // A heading that names a folder (`### Inside `core/``) is the base of its section.
            section = first_folder(line).map(PathBuf::from).unwrap_or_default();
            stack.clear();
            continue;
        }
        let row = line.starts_with('|');
        let continued = line.starts_with("  ") && !stack.is_empty();
        if !continued {
            // A table row, a list item or a paragraph starts afresh from its section; a row
            // whose first cell is a folder adds it.
            depth = 0;
            stack.clear();
            stack.push(Frame { dir: section.clone(), depth: 0 });
            let first_cell = line.trim_start_matches('|').split('|').next().unwrap_or("");
            if let Some(folder) = first_folder(first_cell).filter(|_| row) {
                stack.push(Frame { dir: section.join(folder), depth: 0 });
            }
        }
        let mut rest = line;
        let mut opens: Option<PathBuf> = None;
        while let Some(c) = rest.chars().next() {
            match c {
                '`' => {
                    let Some(end) = rest[1..].find('`') else { break };
                    let name = &rest[1..1 + end];
                    rest = &rest[end + 2..];
                    if !is_path(name) {
                        continue;
                    }
                    match resolve(name, &stack, &exists) {
                        Some(path) => {
                            if name.ends_with('/') {
                                if rest.starts_with(" (") {
                                    opens = Some(path.clone());
                                } else if rest.starts_with(':') {
                                    stack.push(Frame { dir: path.clone(), depth });
                                }
                            }
                            named.insert(path);
                        }
                        None => problems.push(format!(
                            "{FILE}:{}: names `{name}`, which is not in the repository",
                            i + 1
                        )),
                    }
                    continue;
                }
                '(' => {
                    depth += 1;
                    if let Some(dir) = opens.take() {
                        stack.push(Frame { dir, depth });
                    }
                }
                ')' => {
                    // The frames opened inside this parenthesis end with it.
                    while stack.len() > 1 && stack.last().is_some_and(|f| f.depth >= depth && f.depth > 0) {
                        stack.pop();
                    }
                    depth = depth.saturating_sub(1);
                }
                ' ' => {}
                _ => opens = None,
            }
            rest = &rest[c.len_utf8()..];
        }
        if row {
            stack.clear();
        }
    }
    (named, problems)
}

/// The first backticked folder of `text` that starts it (after `|`, `#`s, `-` and spaces), or
/// that a heading names.
fn first_folder(text: &str) -> Option<&str> {
    let start = text.find('`')?;
    let end = text[start + 1..].find('`')?;
    let name = &text[start + 1..start + 1 + end];
    let before = &text[..start];
    let leads = before.chars().all(|c| matches!(c, '|' | '#' | '-' | ' ')) || before.starts_with('#');
    (leads && name.ends_with('/') && is_path(name)).then(|| name.trim_end_matches('/'))
}

/// Whether a backticked name is a path: path characters only, and a folder or a source file.
fn is_path(name: &str) -> bool {
    name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'))
        && !name.contains("..")
        && !name.starts_with('/')
        && (name.ends_with('/') || EXTENSIONS.iter().any(|e| name.len() > e.len() && name.ends_with(e)))
}

/// The first path `name` may mean that exists: each enclosing folder's, innermost first, then
/// the root's; in each, the folder joined with the name, then with `src/` and the name.
fn resolve(name: &str, stack: &[Frame], exists: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    let name = Path::new(name.trim_end_matches('/'));
    let dirs = stack.iter().rev().map(|f| f.dir.as_path()).chain([Path::new("")]);
    for dir in dirs {
        for candidate in [dir.join(name), dir.join("src").join(name)] {
            if exists(&candidate) {
                return Some(candidate);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (document, expected problems) against a small tree: crate `a` with `x.rs`, the module
    /// folder `d/` (`mod.rs`, `x.rs`, `y.rs`) and `z.rs`.
    #[test]
    fn architecture_table() {
        let tree = [
            "a",
            "a/src",
            "a/src/lib.rs",
            "a/src/x.rs",
            "a/src/z.rs",
            "a/src/d",
            "a/src/d/mod.rs",
            "a/src/d/x.rs",
            "a/src/d/y.rs",
            "docs/a.md",
        ];
        let required: Vec<PathBuf> = ["a", "a/src/d", "a/src/x.rs", "a/src/z.rs"].map(PathBuf::from).to_vec();
        let check = |text: &str, expected: &[&str]| {
            let problems = check(text, |p| tree.iter().any(|t| Path::new(t) == p), &required);
            assert_eq!(problems, expected, "{text}");
        };
        let unnamed = |path: &str| {
            format!(
                "ARCHITECTURE.md:1: does not name `{path}`; every crate, every folder under a crate's src/ \
                 and every file directly in it is named"
            )
        };
        // Every name resolves, against its row's crate and the folders around it.
        check("| `a/` | `d/` (`mod.rs`, `y.rs`), `x.rs`, `z.rs` |\n", &[]);
        // A folder's parenthesis ends: `x.rs` after it is the crate's, so the crate's is named.
        check("| `a/` | `d/` (`x.rs`), `z.rs` |\n", &[&unnamed("a/src/x.rs")]);
        // A heading's folder and a list item's `folder:` hold the names after them; full paths
        // and documents resolve from the root.
        check(
            "## Code map\n\n| `a/` | `d/` |\n\n### Inside `a/`\n\n- `d/`: `mod.rs`,\n  `y.rs`.\n- `x.rs`, `a/src/z.rs`, `docs/a.md`.\n",
            &[],
        );
        // A name that resolves to nothing (a file gone or renamed) is a problem, and so is a
        // file the document does not name.
        check(
            "| `a/` | `d/` (`w.rs`), `x.rs` |\n",
            &["ARCHITECTURE.md:1: names `w.rs`, which is not in the repository", &unnamed("a/src/z.rs")],
        );
        // A folder not named is a problem; names that are not paths are not read.
        check(
            "| `a/` | `x.rs`, `z.rs`, `result.json`, `P0.dp*.tp3`, `Policy::from`, `target/vllm-<v>/` |\n",
            &[&unnamed("a/src/d")],
        );
    }

    /// The rule's required set on the real workspace: crates, module folders and top files,
    /// never a file inside a module folder or a crate root.
    #[test]
    fn required_of_the_workspace() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let required = required(root);
        for path in ["core", "src", "sim/src/world", "sim/src/cost.rs", "xtask/src/tidy.rs", "xtask/src/tidy"]
        {
            assert!(required.contains(&PathBuf::from(path)), "{path} not required: {required:?}");
        }
        for path in ["sim/src/lib.rs", "src/main.rs", "sim/src/world/mod.rs", "xtask/src/tidy/imports.rs"] {
            assert!(!required.contains(&PathBuf::from(path)), "{path} required");
        }
    }
}
