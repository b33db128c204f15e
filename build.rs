//! Embeds the scenario files under `scenarios/` in the `pdkv` binary, so `pdkv scenarios` and
//! `pdkv run <name>` work from any directory.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // Read at run time, not with `env!`: the compiled build script is reused while build.rs is
    // unchanged, so a target folder copied from another worktree would keep embedding that
    // worktree's scenarios (and watching its folder) instead of this one's.
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for build scripts");
    let dir = Path::new(&root).join("scenarios");
    println!("cargo::rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "ron"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let mut out = String::from("/// Built-in scenarios: (file name without `.ron`, file text).\npub const BUILT_IN: &[(&str, &str)] = &[\n");
    for path in files {
        println!("cargo::rerun-if-changed={}", path.display());
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        let _ = writeln!(out, "    ({stem:?}, include_str!({:?})),", path.display().to_string());
    }
    out.push_str("];\n");
    let target = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("scenarios.rs");
    std::fs::write(target, out).expect("OUT_DIR is writable");
}
