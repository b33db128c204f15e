//! Writing result files whole or not at all: every file a command writes goes to a temporary
//! name in its folder and is renamed into place once written, so a full disk or a killed
//! process never leaves a result file cut short or empty under its real name.

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The temporary name `path` is written under: a hidden file beside it (the same folder, so the
/// rename is atomic on one file system), named after it and this process.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to `path` through [`temp_path`]: the file appears under its name complete,
/// or not at all (a previous file of that name stays as it was). On an error the temporary file
/// is removed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, |out| out.write_all(bytes))
}

/// [`write_atomic`] of what `write` writes, streamed through a buffer: a large file (a million
/// rows of `requests.csv`) never has to be whole in memory.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let temp = temp_path(path);
    let written = std::fs::File::create(&temp).and_then(|file| {
        let mut out = io::BufWriter::new(file);
        write(&mut out)?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        // A file system may report a full disk only when the data is flushed to it.
        file.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&temp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&temp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_is_whole_and_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("pdkv-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("result.json");
        write_atomic(&path, b"{}\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{}\n");
        assert!(!temp_path(&path).exists());
        // A folder in the way: the error is returned and nothing is left behind.
        let blocked = dir.join("blocked");
        std::fs::create_dir_all(&blocked).unwrap();
        assert!(write_atomic(&blocked, b"x").is_err());
        assert!(!temp_path(&blocked).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
