//! Helpers the CLI tests share: a fresh scratch folder and running the `pdkv` binary in it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh temporary folder of this test process, named after the test `area` and `name`.
pub(crate) fn scratch(area: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-it-{area}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// Runs pdkv in `dir` (so default output folders land there).
pub(crate) fn pdkv_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).current_dir(dir).args(args).output().expect("pdkv runs")
}
