//! Walking the workspace's files, as the tidy rules read them.

use std::fs;
use std::path::{Path, PathBuf};

/// Every file under `dir` whose name `keep` accepts, skipping `target/` and hidden folders.
pub fn walk(dir: &Path, keep: &dyn Fn(&str) -> bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        if path.is_dir() {
            walk(&path, keep, out);
        } else if keep(&name) {
            out.push(path);
        }
    }
}
