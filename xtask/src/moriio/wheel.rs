//! The pinned vLLM wheel: which release, its hashes, where it is cached under `target/`, how it
//! is fetched (`pip download`, hash-checked) and which of its files are extracted for the
//! conformance harness.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The vLLM release whose MoRIIO code pdkv is checked against. Moving to the next release is
/// this one change (version and the sha256 of its wheels, from `https://pypi.org/simple/vllm/`).
pub const VLLM: VllmPin = VllmPin {
    version: "0.33.0",
    wheels: &[
        // 336 MB; the MoRIIO sources are pure Python, so either wheel serves on any machine.
        ("manylinux_2_28_x86_64", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"),
        ("manylinux_2_28_aarch64", "e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606"),
    ],
    // The wheels' Requires-Python: pip refuses to fetch them for an older interpreter, and the
    // harness runs their code.
    min_python: (3, 11),
};

/// A vLLM release: its version, `(platform tag, sha256)` of each binary wheel, and the oldest
/// Python it supports.
pub struct VllmPin {
    pub version: &'static str,
    pub wheels: &'static [(&'static str, &'static str)],
    pub min_python: (u32, u32),
}

impl VllmPin {
    /// `vllm-<version>-cp38-abi3-<platform>.whl`, PyPI's name for the wheel of `platform`.
    pub fn file_name(&self, platform: &str) -> String {
        format!("vllm-{}-cp38-abi3-{platform}.whl", self.version)
    }

    /// pip's requirements file: the release with every pinned hash.
    pub fn requirements(&self) -> String {
        let mut text = format!("vllm=={}", self.version);
        for (_, sha256) in self.wheels {
            text.push_str(&format!(" \\\n    --hash=sha256:{sha256}"));
        }
        text.push('\n');
        text
    }
}

/// What is extracted from the wheel: the MoRIIO package and the light vLLM modules whose code
/// runs on the wire or decides a port (ZeroMQ paths and sockets; the environment they read).
/// A member ending in `/` takes the folder's files.
pub const MEMBERS: &[&str] = &[
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/",
    "vllm/utils/network_utils.py",
    "vllm/utils/math_utils.py",
    "vllm/envs.py",
];

/// Why the wheel could not be made available.
#[derive(Debug)]
pub enum WheelError {
    /// pip could not fetch the wheel (no network, PyPI unreachable, no wheel for the platform).
    Download { detail: String },
    /// A wheel (downloaded or cached) does not match any pinned hash.
    HashMismatch { detail: String },
    /// The wheel's files could not be extracted (a member is missing, or it is not a zip).
    Extract { detail: String },
    /// A file-system step failed.
    Io { what: String, error: io::Error },
}

impl fmt::Display for WheelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WheelError::Download { detail } => write!(
                f,
                "could not download vllm {} from PyPI (https://pypi.org, or the index your pip \
                 configuration names). Is PyPI reachable?\n--- pip ---\n{}\n---",
                VLLM.version,
                detail.trim()
            ),
            WheelError::HashMismatch { detail } => write!(
                f,
                "the vllm {} wheel does not match its pinned sha256 (xtask/src/moriio/wheel.rs, VLLM): \
                 a tampered or truncated file, or a platform whose wheel is not pinned.\n{}",
                VLLM.version,
                detail.trim()
            ),
            WheelError::Extract { detail } => {
                write!(
                    f,
                    "cannot extract the MoRIIO files from the vllm {} wheel: {}",
                    VLLM.version,
                    detail.trim()
                )
            }
            WheelError::Io { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

fn io_error(what: String, error: io::Error) -> WheelError {
    WheelError::Io { what, error }
}

/// `<target>/vllm-<version>/`: the cached wheel, the extracted files (`src/`), the answers.
pub fn cache_dir(target: &Path) -> PathBuf {
    target.join(format!("vllm-{}", VLLM.version))
}

/// Makes `<cache>/src/` hold the extracted files of a hash-checked wheel, downloading the wheel
/// only when no cached copy matches its pin. Returns the `src/` folder.
pub fn ensure(python: &Path, root: &Path, cache: &Path) -> Result<PathBuf, WheelError> {
    fs::create_dir_all(cache).map_err(|e| io_error(format!("cannot create {}", cache.display()), e))?;
    let src = cache.join("src");
    if let Some(wheel) = cached_wheel(cache) {
        match extract(python, root, &wheel, &src) {
            Ok(()) => return Ok(src),
            Err(WheelError::HashMismatch { detail }) => {
                eprintln!(
                    "  the cached {} does not match its pin ({}); downloading it again",
                    file_name(&wheel),
                    detail.trim()
                );
                fs::remove_file(&wheel)
                    .map_err(|e| io_error(format!("cannot remove {}", wheel.display()), e))?;
            }
            Err(e) => return Err(e),
        }
    }
    let wheel = download(python, cache)?;
    extract(python, root, &wheel, &src)?;
    Ok(src)
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A cached wheel with one of the pinned file names, if any.
fn cached_wheel(cache: &Path) -> Option<PathBuf> {
    VLLM.wheels.iter().map(|(platform, _)| cache.join(VLLM.file_name(platform))).find(|p| p.is_file())
}

/// `pip download` of the pinned release into a scratch folder, moved into `cache` once pip has
/// checked its hash.
fn download(python: &Path, cache: &Path) -> Result<PathBuf, WheelError> {
    let partial = cache.join("download.partial");
    match fs::remove_dir_all(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(format!("cannot remove {}", partial.display()), e)),
    }
    fs::create_dir_all(&partial).map_err(|e| io_error(format!("cannot create {}", partial.display()), e))?;
    let reqs = partial.join("requirements.txt");
    fs::write(&reqs, VLLM.requirements())
        .map_err(|e| io_error(format!("cannot write {}", reqs.display()), e))?;
    let log = partial.join("pip.log");
    let log_file =
        fs::File::create(&log).map_err(|e| io_error(format!("cannot create {}", log.display()), e))?;
    let log_err = log_file.try_clone().map_err(|e| io_error("cannot duplicate a file handle".into(), e))?;
    eprintln!(
        "  pip download vllm=={} --no-deps --only-binary :all: --require-hashes (about 340 MB, once; cached in {}) ...",
        VLLM.version,
        cache.display()
    );
    let started = Instant::now();
    let mut child = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes"])
        .args(["--no-input", "--disable-pip-version-check", "--progress-bar", "off", "--dest"])
        .arg(&partial)
        .arg("--requirement")
        .arg(&reqs)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(log_err)
        .spawn()
        .map_err(|e| io_error(format!("cannot run {} -m pip", python.display()), e))?;
    // A progress line every 15 s: the download is the one long step of a cold run.
    let mut next_note = Duration::from_secs(15);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => return Err(io_error("cannot wait for pip".into(), e)),
        }
        if started.elapsed() >= next_note {
            eprintln!("  ... still downloading ({} s)", next_note.as_secs());
            next_note += Duration::from_secs(15);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = fs::read_to_string(&log).unwrap_or_default();
    if !status.success() {
        // pip names a hash mismatch "THESE PACKAGES DO NOT MATCH THE HASHES".
        return Err(if output.contains("HASHES") {
            WheelError::HashMismatch { detail: output }
        } else {
            WheelError::Download { detail: format!("{status}\n{output}") }
        });
    }
    let fetched = VLLM
        .wheels
        .iter()
        .map(|(platform, _)| VLLM.file_name(platform))
        .find(|name| partial.join(name).is_file())
        .ok_or_else(|| WheelError::Download {
            detail: format!("pip succeeded but left no pinned wheel in {}:\n{output}", partial.display()),
        })?;
    let wheel = cache.join(&fetched);
    fs::rename(partial.join(&fetched), &wheel)
        .map_err(|e| io_error(format!("cannot move {fetched} into {}", cache.display()), e))?;
    let _ = fs::remove_dir_all(&partial);
    eprintln!("  downloaded {fetched} in {:.1} s", started.elapsed().as_secs_f64());
    Ok(wheel)
}

/// Runs tests/moriio/extract.py: hash check, then the [`MEMBERS`] into `src`.
fn extract(python: &Path, root: &Path, wheel: &Path, src: &Path) -> Result<(), WheelError> {
    let mut cmd = Command::new(python);
    cmd.arg(root.join("tests/moriio/extract.py")).arg(wheel).arg(src);
    for (_, sha256) in VLLM.wheels {
        cmd.args(["--sha256", sha256]);
    }
    for member in MEMBERS {
        cmd.args(["--member", member]);
    }
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| io_error(format!("cannot run {}", python.display()), e))?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // Its progress lines (indented) go on to our stderr; the other lines are the reason.
    let (progress, reason): (Vec<&str>, Vec<&str>) = stderr.lines().partition(|l| l.starts_with("  "));
    for line in progress {
        eprintln!("{line}");
    }
    let reason = reason.join("\n");
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) => Err(WheelError::HashMismatch { detail: reason }),
        _ => Err(WheelError::Extract { detail: format!("{}\n{reason}", out.status) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_names_pypi_files_with_sha256_hashes() {
        assert!(VLLM.version.split('.').all(|n| n.parse::<u32>().is_ok()));
        for (platform, sha256) in VLLM.wheels {
            assert!(platform.starts_with("manylinux_"), "{platform}");
            assert!(sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit()), "{sha256}");
            assert_eq!(*sha256, sha256.to_ascii_lowercase());
        }
        assert_eq!(
            VLLM.file_name("manylinux_2_28_x86_64"),
            "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
        );
        let reqs = VLLM.requirements();
        assert!(reqs.starts_with("vllm==0.33.0 \\\n    --hash=sha256:4b6bdec4"), "{reqs}");
        assert_eq!(reqs.matches("--hash=sha256:").count(), VLLM.wheels.len());
    }

    #[test]
    fn errors_say_what_to_check() {
        let e = WheelError::Download { detail: "NewConnectionError".into() };
        assert!(e.to_string().contains("Is PyPI reachable?"), "{e}");
        let e = WheelError::HashMismatch { detail: "sha256 abc".into() };
        assert!(e.to_string().contains("pinned sha256"), "{e}");
    }
}
