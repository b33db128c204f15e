//! `cargo xtask results record|compare DIR`: the `result.json` of every built-in scenario and
//! of the README's main command, recorded before a refactor and compared byte for byte after it,
//! so "behaviour unchanged" is a command anyone can run rather than a claim.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

const USAGE: &str = "usage: cargo xtask results record DIR | compare DIR";

/// The runs recorded: (file stem, `pdkv run` argument).
fn runs(pdkv: &Path, root: &Path) -> Result<Vec<(String, String)>, String> {
    let listing =
        Command::new(pdkv).arg("scenarios").output().map_err(|e| format!("cannot run pdkv: {e}"))?;
    if !listing.status.success() {
        return Err("pdkv scenarios failed".into());
    }
    let text = String::from_utf8_lossy(&listing.stdout);
    let mut runs: Vec<(String, String)> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .map(|name| (name.to_string(), name.to_string()))
        .collect();
    let readme = std::fs::read_to_string(root.join("README.md")).map_err(|e| format!("README.md: {e}"))?;
    let main = pdkv_reports::gallery::readme_main_command(&readme)
        .ok_or("README.md has no main command (`cargo run --release -- run ...` after \"The main job\")")?;
    match main.as_slice() {
        [run, spec] if run == "run" => runs.push(("readme-main".into(), spec.clone())),
        _ => return Err(format!("the README's main command is not `run <scenario>`: {}", main.join(" "))),
    }
    Ok(runs)
}

/// Runs `spec` into a scratch folder and returns its result.json.
fn result_of(pdkv: &Path, spec: &str, scratch: &Path) -> Result<Vec<u8>, String> {
    let out = scratch.join("run");
    let _ = std::fs::remove_dir_all(&out);
    Command::new(pdkv)
        .args(["run", spec, "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run pdkv: {e}"))?;
    std::fs::read(out.join("result.json")).map_err(|e| format!("{spec}: no result.json: {e}"))
}

pub fn run(args: &[String], root: &Path) -> ExitCode {
    let (mode, dir) = match args {
        [mode, dir] if mode == "record" || mode == "compare" => (mode.as_str(), PathBuf::from(dir)),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if !crate::cargo(&["build", "--release", "--quiet", "--package", "pdkv", "--bin", "pdkv"], &[]) {
        return ExitCode::FAILURE;
    }
    let target = crate::target_dir(root);
    let pdkv = target.join("release/pdkv");
    let scratch = target.join("results-scratch");
    let result = runs(&pdkv, root).and_then(|runs| {
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut differ = Vec::new();
        for (stem, spec) in &runs {
            let now = result_of(&pdkv, spec, &scratch)?;
            let file = dir.join(format!("{stem}.json"));
            if mode == "record" {
                std::fs::write(&file, &now).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
            } else if std::fs::read(&file).ok().as_deref() != Some(now.as_slice()) {
                differ.push(stem.clone());
            }
        }
        Ok((runs.len(), differ))
    });
    let _ = std::fs::remove_dir_all(&scratch);
    match result {
        Ok((n, _)) if mode == "record" => {
            println!("results: recorded {n} results in {}", dir.display());
            ExitCode::SUCCESS
        }
        Ok((n, differ)) if differ.is_empty() => {
            println!("results: all {n} results byte-identical to {}", dir.display());
            ExitCode::SUCCESS
        }
        Ok((n, differ)) => {
            println!("results: {} of {n} differ from {}: {}", differ.len(), dir.display(), differ.join(", "));
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("results: {e}");
            ExitCode::FAILURE
        }
    }
}
