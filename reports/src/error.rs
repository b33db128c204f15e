//! The error every report function returns: which file, and what failed.

use std::fmt;
use std::path::{Path, PathBuf};

/// Error type naming the file and what failed (I/O, drawing).
#[derive(Debug)]
pub enum ReportError {
    /// Creating the output folder or writing a file failed.
    Io {
        /// The folder or file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// Drawing or encoding a picture failed.
    Draw {
        /// The picture being drawn.
        path: PathBuf,
        /// What plotters (or the encoder) said.
        what: String,
    },
    /// The embedded font could not be loaded (a build problem, not an input problem).
    Font,
    /// An input (the gallery table, or a gallery command) could not be read or run.
    Input {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
}

impl ReportError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ReportError {
        ReportError::Io { path: path.to_path_buf(), source }
    }

    pub(crate) fn input(path: &Path, what: String) -> ReportError {
        ReportError::Input { path: path.to_path_buf(), what }
    }
}

impl fmt::Display for ReportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReportError::Io { path, source } => write!(f, "{}: cannot write: {source}", path.display()),
            ReportError::Draw { path, what } => write!(f, "{}: cannot draw: {what}", path.display()),
            ReportError::Input { path, what } => write!(f, "{}: {what}", path.display()),
            ReportError::Font => {
                write!(f, "reports/assets/DejaVuSans.ttf: the embedded font is not a valid TrueType font")
            }
        }
    }
}

impl std::error::Error for ReportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReportError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
