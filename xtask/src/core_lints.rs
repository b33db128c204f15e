//! The proof that `core/clippy.toml` catches what it is for: a scratch crate carrying a copy of it
//! gets one function per forbidden thing (and a few allowed ones), and clippy must report each
//! forbidden line and no allowed one.
//!
//! The rules bind only the core because clippy reads the `clippy.toml` of the crate being checked
//! (its manifest folder, then the parents); a `clippy.toml` at the workspace root would bind every
//! crate, so the test also checks there is none.

use std::fs;
use std::path::Path;
use std::process::Command;

/// (a line of code, the start of clippy's complaint about it; `""` where clippy must say nothing).
/// The line is the body of its own function in the scratch crate, which starts with
/// `use std::{fs, net, thread};` so that items reached through a short module name are covered.
const CASES: [(&str, &str); 17] = [
    (
        "let m: std::collections::HashMap<u8, u8> = Default::default(); drop(m);",
        "disallowed type `std::collections::HashMap`",
    ),
    (
        "let s = std::collections::HashSet::<u8>::new(); drop(s);",
        "disallowed type `std::collections::HashSet`",
    ),
    ("let r = std::hash::RandomState::new(); drop(r);", "disallowed type `std::hash::RandomState`"),
    ("let t = std::time::Instant::now(); drop(t);", "disallowed method `std::time::Instant::now`"),
    ("let t = std::time::SystemTime::now(); drop(t);", "disallowed method `std::time::SystemTime::now`"),
    ("thread::sleep(std::time::Duration::from_millis(1));", "disallowed method `std::thread::sleep`"),
    ("drop(thread::spawn(|| ()));", "disallowed method `std::thread::spawn`"),
    ("drop(fs::read_to_string(\"x\"));", "disallowed method `std::fs::read_to_string`"),
    ("drop(fs::File::open(\"x\"));", "disallowed type `std::fs::File`"),
    ("drop(net::TcpStream::connect(\"127.0.0.1:1\"));", "disallowed type `std::net::TcpStream`"),
    ("drop(std::process::Command::new(\"true\"));", "disallowed type `std::process::Command`"),
    ("drop(std::env::var(\"HOME\"));", "disallowed method `std::env::var`"),
    ("println!(\"x\");", "disallowed macro `std::println`"),
    // What the core does use stays allowed.
    ("let m: std::collections::BTreeMap<u8, u8> = Default::default(); drop(m);", ""),
    ("let s = std::collections::BTreeSet::<u8>::new(); drop(s);", ""),
    ("let d = std::time::Duration::from_millis(1); drop(d);", ""),
    ("let v = format!(\"{}\", 1); drop(v);", ""),
];

#[test]
fn core_clippy_toml_catches_each_forbidden_use() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace");
    assert!(
        !root.join("clippy.toml").exists() && !root.join(".clippy.toml").exists(),
        "a clippy.toml at the workspace root would bind every crate; the core's rules live in core/clippy.toml"
    );
    let config = fs::read_to_string(root.join("core/clippy.toml")).expect("core/clippy.toml exists");

    // A crate of its own (`[workspace]`), under target/ so that tidy and git ignore it.
    let dir = root.join("target/tmp/core-lints");
    fs::create_dir_all(dir.join("src")).expect("scratch folder");
    fs::write(
        dir.join("Cargo.toml"),
        "[package]\nname = \"core-lints\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n",
    )
    .expect("scratch manifest");
    fs::write(dir.join("clippy.toml"), config).expect("scratch clippy.toml");
    let mut lib =
        String::from("//! Scratch crate.\n#![allow(unused_imports)]\nuse std::{fs, net, thread};\n");
    let mut lines = Vec::new();
    for (i, (code, _)) in CASES.iter().enumerate() {
        lib.push_str(&format!("pub fn case_{i}() {{\n"));
        lines.push(lib.lines().count() + 1);
        lib.push_str(&format!("    {code}\n}}\n"));
    }
    fs::write(dir.join("src/lib.rs"), &lib).expect("scratch lib.rs");

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = Command::new(cargo)
        .args(["clippy", "--quiet", "--message-format=short", "--", "-D", "warnings"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .output()
        .expect("cargo clippy starts");
    let report = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "clippy passed a crate full of forbidden uses:\n{report}");
    for ((code, expected), line) in CASES.iter().zip(&lines) {
        let prefix = format!("src/lib.rs:{line}:");
        // Only the configured lints count: other lints on the scratch code are not the subject.
        let said: Vec<&str> =
            report.lines().filter(|l| l.starts_with(&prefix) && l.contains("disallowed")).collect();
        if expected.is_empty() {
            assert!(said.is_empty(), "`{code}` is allowed in the core, but clippy said: {said:?}");
        } else {
            assert!(
                said.iter().any(|l| l.contains(expected)),
                "`{code}` must be caught with \"{expected}\"; clippy said at that line: {said:?}\n{report}"
            );
        }
    }
}
