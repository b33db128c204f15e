//! Tidy checks that run as tests: the core's purity rules, `//!` headers, no disabled tests.

use std::fs;
use std::path::{Path, PathBuf};

/// What `core/` must never mention in code (comments are exempt, so docs can explain why).
const CORE_FORBIDDEN: [&str; 10] = [
    "std::net",
    "std::fs",
    "std::thread",
    "std::process",
    "std::time",
    "Instant::now",
    "SystemTime",
    "HashMap",
    "HashSet",
    "println!",
];

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

/// Markers of disabled or panic-expecting tests, forbidden everywhere.
const TEST_FORBIDDEN: [&str; 2] = ["#[ignore", "#[should_panic"];

/// Checks every `.rs` file under `root` (skipping `target/` and hidden folders). Returns the
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
        problems.extend(check_file(rel, &text));
    }
    if problems.is_empty() {
        Ok(files.len())
    } else {
        Err(problems)
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        if path.is_dir() {
            collect(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The problems of one file, given its path relative to the workspace root.
pub fn check_file(rel: &Path, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let shown = rel.display();
    if !text.starts_with("//!") {
        problems.push(format!("{shown}:1: file must start with a `//!` line saying what it is for"));
    }
    let in_core = rel.starts_with("core");
    let in_backend = rel.starts_with("backend-rdma/src");
    for (i, line) in text.lines().enumerate() {
        let code = strip_comment(line);
        let n = i + 1;
        if in_core {
            for word in CORE_FORBIDDEN {
                if code.contains(word) {
                    problems.push(format!("{shown}:{n}: core/ must not use `{word}` (no I/O, clock, threads or hash-map iteration)"));
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
        check("core/src/a.rs", "//! Doc.\nuse std::collections::HashMap;\n", 1);
        check("core/src/a.rs", "//! Doc.\nlet t = std::time::Instant::now();\n", 2);
        check("core/src/a.rs", "//! Doc.\n// A HashMap would be iterated in random order.\n", 0);
        check("core/src/a.rs", "//! Doc.\nfn f() { println!(\"x\"); } // HashSet\n", 1);
        check("core/src/a.rs", "//! Doc.\nuse std::net::TcpStream;\nuse std::fs;\n", 2);
        check("core/src/a.rs", "//! Doc.\nstd::thread::spawn(f); std::process::exit(1);\n", 2);
        check("core/src/a.rs", "//! Doc.\nlet s = \"http://x\"; let t = SystemTime::UNIX_EPOCH;\n", 1);
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
    }
}
