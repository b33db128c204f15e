//! Tidy checks that run as tests: the core's purity rules (the textual part), `//!` headers, no
//! disabled tests, `unsafe` forbidden in every crate root but the backend's, no citation of a file
//! the repository lacks, no import cycle between the files of a crate (`imports.rs`), and an
//! ARCHITECTURE.md whose every path exists and that names every crate, module folder and top
//! file (`architecture.rs`).

mod architecture;
mod imports;

use std::fs;
use std::path::{Path, PathBuf};

/// Standard-library modules `core/` must never name in code (comments are exempt, so docs can
/// explain why). This is the coarse, textual half of the core's purity rules: it catches any item
/// of these modules written with its path, including ones no list names. The precise half is
/// `core/clippy.toml` (`disallowed-types`, `-methods`, `-macros`), which clippy applies to the
/// core only: it catches `HashMap`, `HashSet`, clocks, sockets, files, processes, threads,
/// `println!` and unseeded randomness however they are imported (`use std::{fs, net}` then
/// `net::TcpStream`), which text matching cannot.
const CORE_FORBIDDEN: [&str; 6] =
    ["std::net", "std::fs", "std::thread", "std::process", "std::time", "std::env"];

/// What the real backend must never call: the core's routing and release-counting decisions.
/// The backend drives nodes and carries out their actions; which rank to read, which port a
/// rank is at and how many releases free a transfer come from node actions (`DialHandshake`,
/// `PostRead`, `SendRelease`, `Register`), so the code the simulator checks is the code that
/// decides in production. Validation (`check_pair`) and the engine's own listen address are
/// allowed: they decide nothing the nodes do not.
const BACKEND_FORBIDDEN: [&str; 15] = [
    "fixed_tp_source",
    "is_flexible",
    "ReadRouter",
    "expected_releases",
    "quorum_plan",
    "QuorumPlan",
    "RankLedger",
    "Quorum::",
    "port_offset",
    "listener_offset",
    "flat_index",
    "session_key",
    "ReadTarget",
    "flat_slots",
    "proxy::route",
];

/// The attribute every crate root carries, so that the compiler rejects `unsafe` anywhere in the
/// crate (a `forbid` cannot be lifted further down).
const FORBID_UNSAFE: &str = "#![forbid(unsafe_code)]";

/// What the backend's library root carries instead: its FFI modules (`verbs`, `hip`, `signals`)
/// lift it by name with `#[allow(unsafe_code)]`, which a `forbid` would not allow.
const DENY_UNSAFE: &str = "#![deny(unsafe_code)]";

/// The one crate root that denies rather than forbids `unsafe`.
const BACKEND_ROOT: &str = "backend-rdma/src/lib.rs";

/// Markers of disabled or panic-expecting tests, forbidden everywhere.
const TEST_FORBIDDEN: [&str; 2] = ["#[ignore", "#[should_panic"];

/// Checks every `.rs` and `.md` file under `root` (skipping `target/` and hidden folders):
/// the source rules on `.rs` files, and on both that every file they cite exists. Returns the
/// number of files checked, or one line per problem as `path:line: what`.
pub fn check(root: &Path) -> Result<usize, Vec<String>> {
    let mut files = Vec::new();
    collect(root, &mut files);
    files.sort();
    let mut problems = Vec::new();
    for path in &files {
        let Ok(text) = fs::read_to_string(path) else {
            problems.push(format!("{}: cannot be read as UTF-8", path.display()));
            continue;
        };
        let rel = path.strip_prefix(root).unwrap_or(path);
        if rel.extension().is_some_and(|e| e == "rs") {
            problems.extend(check_file(rel, &text));
        }
        problems.extend(check_citations(rel, &text, |cited| root.join(cited).exists()));
    }
    problems.extend(crate::crate_order::check(root));
    for rel in crate_roots(root) {
        match fs::read_to_string(root.join(&rel)) {
            Ok(text) => problems.extend(check_unsafe_attribute(&rel, &text)),
            Err(err) => problems.push(format!("{}: cannot be read: {err}", rel.display())),
        }
    }
    problems.extend(imports::problems(root, &crate_roots(root)));
    problems.extend(architecture::problems(root));
    if problems.is_empty() {
        Ok(files.len())
    } else {
        Err(problems)
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    crate::tree::walk(dir, &|name| name.ends_with(".rs") || name.ends_with(".md"), out);
}

/// Every crate root of every package under `root` (a folder whose `Cargo.toml` has a
/// `[package]`, skipping `target/` and hidden folders), relative to `root`, sorted: the build
/// script, `src/lib.rs`, `src/main.rs`, and each target cargo finds by itself under `src/bin/`,
/// `examples/`, `tests/` and `benches/` (a file there, or a folder's `main.rs`). Found by walking,
/// not from the workspace's member list, so a new crate or example cannot go unchecked.
pub fn crate_roots(root: &Path) -> Vec<PathBuf> {
    let mut packages = Vec::new();
    collect_packages(root, &mut packages);
    let mut roots = Vec::new();
    for package in packages {
        for fixed in ["build.rs", "src/lib.rs", "src/main.rs"] {
            if package.join(fixed).is_file() {
                roots.push(package.join(fixed));
            }
        }
        for folder in ["src/bin", "examples", "tests", "benches"] {
            let Ok(entries) = fs::read_dir(package.join(folder)) else { continue };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() && path.join("main.rs").is_file() {
                    roots.push(path.join("main.rs"));
                } else if path.extension().is_some_and(|e| e == "rs") {
                    roots.push(path);
                }
            }
        }
    }
    let mut roots: Vec<PathBuf> = roots
        .into_iter()
        .map(|path| path.strip_prefix(root).map(Path::to_path_buf).unwrap_or(path))
        .collect();
    roots.sort();
    roots
}

fn collect_packages(dir: &Path, out: &mut Vec<PathBuf>) {
    if fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|manifest| manifest.contains("[package]")) {
        out.push(dir.to_path_buf());
    }
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with('.') && name != "target" && entry.path().is_dir() {
            collect_packages(&entry.path(), out);
        }
    }
}

/// The problem of a crate root (path relative to the workspace root) that lacks its `unsafe`
/// attribute: [`FORBID_UNSAFE`] everywhere but [`BACKEND_ROOT`], which has [`DENY_UNSAFE`]. The
/// attribute must stand on a line of its own, so a commented-out one does not count.
pub fn check_unsafe_attribute(rel: &Path, text: &str) -> Option<String> {
    let wanted = if rel == Path::new(BACKEND_ROOT) { DENY_UNSAFE } else { FORBID_UNSAFE };
    if text.lines().any(|line| line.trim() == wanted) {
        return None;
    }
    let why = if wanted == DENY_UNSAFE {
        "the backend's FFI modules allow `unsafe` by name; nothing else may"
    } else {
        "only the backend's FFI modules may use `unsafe`"
    };
    Some(format!("{}:1: a crate root must carry `{wanted}`: {why}", rel.display()))
}

/// The files a document (`.md`) or the doc comments (`//!`, `///`) of a `.rs` file cite that
/// `exists` (given a path relative to the workspace root) says are missing, one problem each.
///
/// A citation is the target of a relative Markdown link (up to any `#`; in a `.rs` file only a
/// target with a `/` or a `.` and no `::`, since rustdoc links name items), a word starting
/// `docs/`, or a word ending `.md`. A link resolves against the citing file's folder; a `docs/`
/// word against the workspace root; a `.md` word against either (a page names its neighbours
/// by file name alone). Web addresses and links to them are skipped, with their text: a page on
/// GitHub may name a file of another repository. The repository must stand alone, so a document
/// pointing at a file that is not in it (a private note, a file since renamed) fails the check.
pub fn check_citations(rel: &Path, text: &str, exists: impl Fn(&Path) -> bool) -> Vec<String> {
    let markdown = rel.extension().is_some_and(|e| e == "md");
    let dir = rel.parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let prose = if markdown {
            line
        } else {
            match line.trim_start().strip_prefix("//!").or_else(|| line.trim_start().strip_prefix("///")) {
                Some(doc) => doc,
                None => continue,
            }
        };
        for (cited, candidates) in citations(prose, dir, markdown) {
            if !candidates.iter().any(|c| exists(c)) {
                problems.push(format!(
                    "{}:{}: cites `{cited}`, which is not in the repository",
                    rel.display(),
                    i + 1
                ));
            }
        }
    }
    problems
}

/// The citations in one line of prose, each with the workspace-relative paths it may mean.
fn citations(prose: &str, dir: &Path, markdown: bool) -> Vec<(String, Vec<PathBuf>)> {
    let mut found = Vec::new();
    let mut rest = String::with_capacity(prose.len());
    // Links first: a relative target is a citation; the whole link, text included, is then
    // blanked so that its words are not read again (nor those of a link to the web).
    let mut tail = prose;
    while let Some(mid) = tail.find("](") {
        let Some(open) = tail[..mid].rfind('[') else {
            rest.push_str(&tail[..mid + 2]);
            tail = &tail[mid + 2..];
            continue;
        };
        let Some(close) = tail[mid + 2..].find(')') else { break };
        let target = &tail[mid + 2..mid + 2 + close];
        rest.push_str(&tail[..open]);
        rest.push(' ');
        let path = target.split('#').next().unwrap_or("").trim();
        let file_like = markdown || ((path.contains('/') || path.contains('.')) && !path.contains("::"));
        if file_like && !path.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            found.push((path.to_string(), vec![normalise(&dir.join(path))]));
        }
        tail = &tail[mid + 3 + close..];
    }
    rest.push_str(tail);
    let mut words = String::with_capacity(rest.len());
    let mut web = false;
    for (i, c) in rest.char_indices() {
        if rest[i..].starts_with("http://") || rest[i..].starts_with("https://") {
            web = true;
        }
        if web && (c.is_whitespace() || matches!(c, ')' | '>' | '|' | '`')) {
            web = false;
        }
        words.push(if web { ' ' } else { c });
    }
    let is_word = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-');
    for word in words.split(|c: char| !is_word(c)) {
        let word = word.trim_end_matches(['.', ',', ':', ';']);
        if word.starts_with("docs/") {
            found.push((word.to_string(), vec![normalise(Path::new(word))]));
        } else if word.len() > ".md".len() && word.ends_with(".md") {
            let candidates = vec![normalise(Path::new(word)), normalise(&dir.join(word))];
            found.push((word.to_string(), candidates));
        }
    }
    found
}

/// `a/../b` as `b` and `./a` as `a`, without touching the file system; a path that climbs out
/// of the workspace keeps its `..` and so never exists inside it.
fn normalise(path: &Path) -> PathBuf {
    let mut parts: Vec<std::path::Component> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir
                if matches!(parts.last(), Some(std::path::Component::Normal(_))) =>
            {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    parts.iter().collect()
}

/// The problems of one file, given its path relative to the workspace root.
pub fn check_file(rel: &Path, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let shown = rel.display();
    if !text.starts_with("//!") {
        problems.push(format!("{shown}:1: file must start with a `//!` line saying what it is for"));
    }
    // The engine layer keeps the core's invariant (engine/clippy.toml holds the same rules).
    let in_core = rel.starts_with("core") || rel.starts_with("engine");
    let in_backend = rel.starts_with("backend-rdma/src");
    for (i, line) in text.lines().enumerate() {
        let code = strip_comment(line);
        let n = i + 1;
        if in_core {
            for word in CORE_FORBIDDEN {
                if code.contains(word) {
                    problems.push(format!(
                        "{shown}:{n}: core/ and engine/ must not use `{word}` (no I/O, clock, threads or global state)"
                    ));
                }
            }
        }
        if in_backend {
            for word in BACKEND_FORBIDDEN {
                if code.contains(word) {
                    problems.push(format!(
                        "{shown}:{n}: the backend must not call `{word}`: routing and release counting come from the core's nodes"
                    ));
                }
            }
        }
        // Only the backend's root lifts its `deny(unsafe_code)`, on the FFI modules' `mod` lines,
        // so the list of code allowed `unsafe` is in one place (tidy's own tests name it).
        let names_allow = code.contains("allow(unsafe_code)") && !rel.ends_with("tidy.rs");
        if names_allow && rel != Path::new(BACKEND_ROOT) {
            problems.push(format!(
                "{shown}:{n}: `allow(unsafe_code)` only on the FFI modules' `mod` lines in {BACKEND_ROOT}"
            ));
        }
        // Legacy options are resolved once, into the typed policy: no other code asks which
        // options are on, so the fixed protocol reads straight through.
        let resolves = rel == Path::new("core/src/policy.rs") || rel == Path::new("core/src/legacy.rs");
        if !resolves
            && !rel.ends_with("tidy.rs")
            && (code.contains(".has(Legacy::") || code.contains("legacy.has("))
        {
            problems.push(format!(
                "{shown}:{n}: legacy options are read only by `Policy::from` (core/src/policy.rs); take the policy's field instead"
            ));
        }
        // A file's imports say what it depends on: a glob of the workspace's own modules hides
        // that (and let split files lean on their parent's imports). Tests (`tests.rs`, and the
        // indented `use super::*;` of a `mod tests`) and external preludes are exempt.
        let is_test_file = rel.file_name().is_some_and(|name| name == "tests.rs");
        let own_glob = code.starts_with("use ")
            && code.trim_end().ends_with("::*;")
            && ["use super::", "use crate::", "use self::"].iter().any(|p| code.starts_with(p));
        if own_glob && !is_test_file {
            problems.push(format!(
                "{shown}:{n}: import the names this file uses instead of a glob of a workspace module"
            ));
        }
        // The tidy module names the markers it looks for; skip its own constant.
        if !rel.ends_with("tidy.rs") {
            for word in TEST_FORBIDDEN {
                if code.contains(word) {
                    problems.push(format!(
                        "{shown}:{n}: `{word}]` is not allowed; assert the error value instead"
                    ));
                }
            }
        }
    }
    problems
}

/// The line without a trailing `//` comment (outside string literals, roughly: a `//` inside a
/// string is rare in this code and errs toward checking more, not less).
fn strip_comment(line: &str) -> &str {
    let mut in_string = false;
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_string => i += 1,
            b'"' => in_string = !in_string,
            b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        match check(root) {
            Ok(files) => assert!(files > 10, "only {files} files found; is the walk broken?"),
            Err(problems) => panic!("tidy problems:\n{}", problems.join("\n")),
        }
    }

    /// (path, text) -> number of problems; keeps the checker itself honest.
    #[test]
    fn checker_table() {
        let check = |path: &str, text: &str, expected: usize| {
            let problems = check_file(Path::new(path), text);
            assert_eq!(problems.len(), expected, "{path}: {text:?}: {problems:?}");
        };
        check("core/src/a.rs", "//! Doc.\nuse std::collections::BTreeMap;\n", 0);
        // HashMap, println! and the like are core/clippy.toml's (see CORE_FORBIDDEN).
        check("core/src/a.rs", "//! Doc.\nuse std::collections::HashMap;\n", 0);
        check("core/src/a.rs", "//! Doc.\nlet t = std::time::Instant::now();\n", 1);
        check("core/src/a.rs", "//! Doc.\n// std::fs would do I/O.\n", 0);
        check("core/src/a.rs", "//! Doc.\nfn f() { g(); } // std::thread::spawn\n", 0);
        check("core/src/a.rs", "//! Doc.\nuse std::net::TcpStream;\nuse std::fs;\n", 2);
        check("core/src/a.rs", "//! Doc.\nstd::thread::spawn(f); std::process::exit(1);\n", 2);
        check("core/src/a.rs", "//! Doc.\nlet s = \"http://x\"; let v = std::env::var(\"X\");\n", 1);
        check("sim/src/a.rs", "//! Doc.\nuse std::collections::HashMap;\n", 0);
        check("sim/src/a.rs", "use std::fs;\n", 1);
        check("tests/it/a.rs", "//! Doc.\n#[ignore]\nfn t() {}\n", 1);
        check("backend-rdma/src/a.rs", "//! Doc.\nlet q = Quorum::Exact(2);\n", 1);
        check(
            "backend-rdma/src/a.rs",
            "//! Doc.\nlet tp = fixed_tp_source(8, 3, 4)?; // expected_releases\n",
            1,
        );
        check("backend-rdma/examples/a.rs", "//! Doc.\nlet n = expected_releases(4, 8)?;\n", 0);
        check("tests/it/a.rs", "//! Doc.\n#[should_panic(expected = \"x\")]\nfn t() {}\n", 1);
        check("backend-rdma/src/lib.rs", "//! Doc.\n#[allow(unsafe_code)]\npub mod verbs;\n", 0);
        check("backend-rdma/src/memory.rs", "//! Doc.\n#[allow(unsafe_code)]\nfn f() {}\n", 1);
        check("backend-rdma/src/verbs/mod.rs", "//! Doc.\n#![allow(unsafe_code)]\n", 1);
        check("sim/src/lib.rs", "//! Doc.\n#![allow(unsafe_code)] // with a reason\n", 1);
        check("core/src/decode.rs", "//! Doc.\nif self.legacy.has(Legacy::LazyHandshake) {}\n", 1);
        check("sim/src/world/build.rs", "//! Doc.\nlet lazy = legacy.has(Legacy::LazyHandshake);\n", 1);
        check("core/src/policy.rs", "//! Doc.\nlazy: legacy.has(Legacy::LazyHandshake),\n", 0);
        check("backend-rdma/src/cluster/procs.rs", "//! Doc.\nuse super::*;\n", 1);
        check("reports/src/waitfor/draw.rs", "//! Doc.\nuse super::graph::*;\nuse crate::x::*;\n", 2);
        check("backend-rdma/src/cluster/tests.rs", "//! Doc.\nuse super::*;\n", 0);
        check("sim/src/world/decode.rs", "//! Doc.\nmod tests {\n    use super::*;\n}\n", 0);
        check("reports/src/nic.rs", "//! Doc.\nuse plotters::prelude::*;\n", 0);
        check("core/src/decode.rs", "//! Doc.\nif policy.handshake == HandshakeMode::Lazy {}\n", 0);
    }

    /// (crate root, text) -> whether the `unsafe` rule complains.
    #[test]
    fn unsafe_attribute_table() {
        let forbid = "//! Doc.\n\n#![forbid(unsafe_code)]\n\nmod a;\n";
        let deny = "//! Doc.\n\n#![deny(unsafe_code)]\n#![deny(missing_docs)]\n";
        let neither = "//! Doc.\n\n#![deny(missing_docs)]\n";
        let commented = "//! Doc.\n\n// #![forbid(unsafe_code)]\n";
        let table = [
            ("sim/src/lib.rs", forbid, false),
            ("sim/src/lib.rs", neither, true),
            ("sim/src/lib.rs", deny, true),
            ("sim/src/lib.rs", commented, true),
            ("src/main.rs", neither, true),
            ("sim/examples/quick.rs", neither, true),
            ("backend-rdma/examples/tcp_bench.rs", forbid, false),
            ("backend-rdma/examples/tcp_bench.rs", deny, true),
            ("backend-rdma/src/lib.rs", deny, false),
            ("backend-rdma/src/lib.rs", forbid, true),
            ("backend-rdma/src/lib.rs", neither, true),
        ];
        for (path, text, complains) in table {
            let problem = check_unsafe_attribute(Path::new(path), text);
            assert_eq!(problem.is_some(), complains, "{path}: {text:?}: {problem:?}");
        }
    }

    /// A new package, with a library, a binary, an example folder and an integration test, is
    /// found by the walk; each of its roots without the attribute is reported by `check`.
    #[test]
    fn a_new_crate_without_the_forbid_fails_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("target/tmp/tidy-new-crate");
        let _ = fs::remove_dir_all(&root);
        let files = [
            ("newcrate/Cargo.toml", "[package]\nname = \"newcrate\"\n"),
            ("newcrate/src/lib.rs", "//! A new library.\n\npub fn f() {}\n"),
            ("newcrate/src/main.rs", "//! A new binary.\n\n#![forbid(unsafe_code)]\n\nfn main() {}\n"),
            ("newcrate/src/helper.rs", "//! Not a root.\n"),
            ("newcrate/examples/demo/main.rs", "//! An example.\n\nfn main() {}\n"),
            ("newcrate/tests/it.rs", "//! A test.\n"),
            ("Cargo.toml", "[workspace]\nmembers = [\"newcrate\"]\n"),
            // The map names the crate and its top file, so only the roots are reported.
            ("ARCHITECTURE.md", "| `newcrate/` | `helper.rs` |\n"),
        ];
        for (path, text) in files {
            let path = root.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        let expected: Vec<PathBuf> = ["examples/demo/main.rs", "src/lib.rs", "src/main.rs", "tests/it.rs"]
            .iter()
            .map(|p| Path::new("newcrate").join(p))
            .collect();
        assert_eq!(crate_roots(&root), expected);
        let problems = check(&root).expect_err("three roots lack the forbid");
        let named: Vec<&str> = problems.iter().filter_map(|p| p.split(':').next()).collect();
        // The manifest is named too: a new crate has no place in the crate layers yet.
        assert_eq!(
            named,
            [
                "newcrate/Cargo.toml",
                "newcrate/examples/demo/main.rs",
                "newcrate/src/lib.rs",
                "newcrate/tests/it.rs"
            ]
        );
    }

    /// The walk finds every member of the real workspace, with its examples and tests.
    #[test]
    fn crate_roots_of_the_workspace() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let roots = crate_roots(root);
        for expected in [
            "build.rs",
            "src/main.rs",
            "tests/it/main.rs",
            "core/src/lib.rs",
            "sim/src/lib.rs",
            "sim/examples/quick.rs",
            "reports/src/lib.rs",
            "campaign/src/lib.rs",
            "backend-rdma/src/lib.rs",
            "backend-rdma/examples/tcp_bench.rs",
            "xtask/src/main.rs",
        ] {
            assert!(roots.contains(&PathBuf::from(expected)), "{expected} not found among {roots:?}");
        }
        assert!(
            !roots.contains(&PathBuf::from("tests/it/scenarios.rs")),
            "a module is not a root: {roots:?}"
        );
    }

    /// (citing file, text) -> the cited files reported missing, against a small fake tree.
    #[test]
    fn citation_table() {
        let tree = ["README.md", "docs/sim.md", "docs/legacy.md", "docs/machines", "scenarios/README.md"];
        let check = |path: &str, text: &str, missing: &[&str]| {
            let problems = check_citations(Path::new(path), text, |p| tree.iter().any(|t| Path::new(t) == p));
            let named: Vec<String> = missing.iter().map(|m| format!("cites `{m}`")).collect();
            assert_eq!(problems.len(), missing.len(), "{path}: {text:?}: {problems:?}");
            for (problem, name) in problems.iter().zip(&named) {
                assert!(problem.contains(name), "{path}: {problem} should name {name}");
            }
        };
        // Present files, cited every way.
        check("docs/sim.md", "See [legacy](legacy.md#names) and docs/machines.", &[]);
        check("docs/sim.md", "Formats are in legacy.md, scenarios in `scenarios/README.md`.", &[]);
        check("README.md", "Read [the simulator](docs/sim.md) and [top](#top).", &[]);
        check("scenarios/README.md", "Back to [the docs](../docs/sim.md).", &[]);
        check("sim/src/a.rs", "//! Calibrated as docs/sim.md says.\nfn f() {}\n", &[]);
        check(
            "core/src/a.rs",
            "//! Off under [`Legacy::X`](crate::legacy::Legacy::X), see [`f`](Self::f).\n",
            &[],
        );
        check(
            "core/src/a.rs",
            "//! The [table](../../docs/legacy.md) and [gone](../../docs/gone.md).\n",
            &["../../docs/gone.md"],
        );
        // Missing files: a private note, a renamed page, a bad relative link.
        check(
            "sim/examples/c.rs",
            "//! Against the figures in REFERENCE.md; see docs/sim.md.\n",
            &["REFERENCE.md"],
        );
        check("sim/src/a.rs", "/// As docs/calibration.md shows.\nfn f() {}\n", &["docs/calibration.md"]);
        check(
            "docs/sim.md",
            "See [the model](model.md) and [old](../REFERENCE.md).",
            &["model.md", "../REFERENCE.md"],
        );
        check("README.md", "The [backend](docs/backend.md).", &["docs/backend.md"]);
        // Plain comments, web addresses and links to the web are not citations of this repository.
        check("sim/src/a.rs", "//! Doc.\n// REFERENCE.md is gone.\nfn f() {}\n", &[]);
        check(
            "docs/sim.md",
            "Source: https://github.com/ROCm/mori/blob/main/docs/MORI-IO-BENCHMARK.md.",
            &[],
        );
        check("docs/sim.md", "| [ROCm/mori docs/MORI-IO-BENCHMARK.md](https://github.com/ROCm/mori) |", &[]);
        check("docs/sim.md", "Not a file: `*.md`, `.md`.", &[]);
    }

    /// The real tree: the check sees the citations of this very repository and finds them all.
    #[test]
    fn citations_of_the_repository_resolve() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let text = fs::read_to_string(root.join("docs/sim.md")).expect("docs/sim.md exists");
        assert!(text.contains("reference.md"), "docs/sim.md no longer cites reference.md; pick another page");
        assert_eq!(
            check_citations(Path::new("docs/sim.md"), &text, |p| root.join(p).exists()),
            Vec::<String>::new()
        );
        let broken = text.replace("reference.md", "REFERENCE.md");
        let problems = check_citations(Path::new("docs/sim.md"), &broken, |p| root.join(p).exists());
        assert!(!problems.is_empty() && problems.iter().all(|p| p.contains("REFERENCE.md")), "{problems:?}");
    }
}
