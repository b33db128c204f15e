//! `cargo xtask`: project automation (tidy checks and the CI sequence).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

mod tidy;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  tidy   check the source rules (core purity, //! headers, no disabled tests)
  ci     what CI runs: fmt check, clippy -D warnings, the test suite";

fn main() -> ExitCode {
    let task = std::env::args().nth(1);
    match task.as_deref() {
        Some("tidy") => match tidy::check(&workspace_root()) {
            Ok(files) => {
                println!("tidy: {files} files ok");
                ExitCode::SUCCESS
            }
            Err(problems) => {
                for p in &problems {
                    eprintln!("{p}");
                }
                eprintln!("tidy: {} problem(s)", problems.len());
                ExitCode::FAILURE
            }
        },
        Some("ci") => ci(),
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn ci() -> ExitCode {
    let steps: [&[&str]; 3] = [
        &["fmt", "--all", "--check"],
        &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"],
        &["test", "--workspace"],
    ];
    for args in steps {
        eprintln!("$ cargo {}", args.join(" "));
        let status = Command::new(env!("CARGO")).args(args).current_dir(workspace_root()).status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("cargo {} failed: {s}", args.join(" "));
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("cannot run cargo: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
