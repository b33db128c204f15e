//! vLLM's wheels: every release with MoRIIO pdkv knows, their hashes and dialects, where each
//! is cached under `target/`, how it is fetched (`pip download`, hash-checked) and which of its files are extracted for the
//! conformance harness.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pdkv_core::policy::PeerRules;

/// Every vLLM release whose MoRIIO connector pdkv knows, oldest first: version, the sha256 of
/// its wheels (from `https://pypi.org/simple/vllm/`), its Requires-Python and its dialect
/// (docs/moriio-releases.md groups releases that agree on the wire and in their rules). A
/// release is checked by `cargo xtask moriio-conformance --release V` once pdkv has a rule set
/// for its dialect; the others are listed, and refused with the reason. Adding a release is one
/// entry here.
pub const RELEASES: &[VllmPin] = &[
    VllmPin {
        version: "0.25.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "c82e96b01af2142ef398ca92f1e9c5f4ffc119f2cc09fe68ea28865323532f0c"),
            ("manylinux_2_28_aarch64", "a36add91a63e4f8543ffd85766fcc604d1f5e48ddae81b9f159bfa8ef25cdc56"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.25",
        rules: Some(PeerRules::Vllm025),
    },
    VllmPin {
        version: "0.25.1",
        wheels: &[
            ("manylinux_2_28_x86_64", "16fc7a28df1576eb6f7ca0455026551b8f9adb674c19c66059359ef3e964bd1e"),
            ("manylinux_2_28_aarch64", "902be760af4c5ebfad8af5b8ea07a53ae14e5a6c839c8ab56da30581abb75ad2"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.25",
        rules: Some(PeerRules::Vllm025),
    },
    VllmPin {
        version: "0.26.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de"),
            ("manylinux_2_28_aarch64", "52a4c3e55c2c80cc8793e52ccc244457ceade25b0ad7caa1c15e5002a95a1b2c"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.26",
        rules: Some(PeerRules::Vllm026),
    },
    VllmPin {
        version: "0.27.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "02d8265e71bab1cf50f93026211c9a75562a7f0a72b3a32ec5e0e8bcdd62ec75"),
            ("manylinux_2_28_aarch64", "d38f7f738a6c340fa86abaa56287ab126d0c841f9d129fb6eb21056c3a83e40b"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.27",
        rules: Some(PeerRules::Vllm027),
    },
    VllmPin {
        version: "0.27.1",
        wheels: &[
            ("manylinux_2_28_x86_64", "98e9fc2a1ed8549a733c9d1b242e2002b82367da9e29e37801761438cb3a2670"),
            ("manylinux_2_28_aarch64", "74c1a04548c9016ace8f6c03592edf62517152a0e833f46282556ffbe0796254"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.27",
        rules: Some(PeerRules::Vllm027),
    },
    VllmPin {
        version: "0.28.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "addb0ffdaafd8155d75e9b3f5ddb3da28fdee9e8a7097ede91f7db2e9e1a3889"),
            ("manylinux_2_28_aarch64", "817b8181f7f61b4a62dc1d5d9ab39f2bfb60a6cb86c29879a78a147b85756787"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.28",
        rules: Some(PeerRules::Vllm028),
    },
    VllmPin {
        version: "0.29.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "09d48617fc2be9c6cdcd5db480651ab0d84817b257204f2cc2e3ecbb70bbb635"),
            ("manylinux_2_28_aarch64", "e6b0dfc2b6fd307315e9b34b73cd2bfe7b6b08958eda721828e61732bba426b0"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.28",
        rules: Some(PeerRules::Vllm028),
    },
    VllmPin {
        version: "0.30.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4"),
            ("manylinux_2_28_aarch64", "eb3e11bab695d085098579a6eda2d602419adec3826ebfbcce9a3ffa543eb62e"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.30",
        rules: Some(PeerRules::Vllm030),
    },
    VllmPin {
        version: "0.31.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "39132b433967f0962d03d8a5f633b9bee6b32708f566c7d5637b79f8d0ef3433"),
            ("manylinux_2_28_aarch64", "56edd19c798510b6da5ae4dd38b3bdf55ea7ae261b339a906df006dc3faf751d"),
        ],
        min_python: (3, 10),
        dialect: "vllm-0.30",
        rules: Some(PeerRules::Vllm030),
    },
    VllmPin {
        version: "0.32.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611"),
            ("manylinux_2_28_aarch64", "d0620dbdf99528bcfebe551a8906347a229921fb1602f887bd1286a920da2d44"),
        ],
        min_python: (3, 11),
        dialect: "vllm-0.30",
        rules: Some(PeerRules::Vllm030),
    },
    VllmPin {
        version: "0.33.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"),
            ("manylinux_2_28_aarch64", "e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606"),
        ],
        min_python: (3, 11),
        dialect: "vllm-0.33",
        rules: Some(PeerRules::Vllm033),
    },
    VllmPin {
        version: "0.34.0",
        wheels: &[
            ("manylinux_2_28_x86_64", "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"),
            ("manylinux_2_28_aarch64", "7d96231fc141ad4b3a441292b77362b285b335ca7d1b0e2ab441d4ebde82f405"),
        ],
        min_python: (3, 11),
        dialect: "vllm-0.33",
        rules: Some(PeerRules::Vllm033),
    },
];

/// A vLLM release: its version, `(platform tag, sha256)` of each binary wheel (about 240 to 340
/// MB; the MoRIIO sources are pure Python, so either wheel serves on any machine), the oldest
/// Python it supports (pip refuses to fetch it for an older interpreter, and the harness runs
/// its code), its dialect's name and pdkv's rule set for that dialect, if pdkv has one.
#[derive(Debug)]
pub struct VllmPin {
    pub version: &'static str,
    pub wheels: &'static [(&'static str, &'static str)],
    pub min_python: (u32, u32),
    pub dialect: &'static str,
    pub rules: Option<PeerRules>,
}

/// The newest release: what `moriio-conformance` checks when no `--release` is given.
pub fn latest() -> &'static VllmPin {
    RELEASES.last().expect("the release list is not empty")
}

/// The releases pdkv has a rule set for, oldest first.
pub fn supported() -> impl Iterator<Item = &'static VllmPin> {
    RELEASES.iter().filter(|r| r.rules.is_some())
}

/// The release `version` names (`latest`: the newest; `oldest`: the oldest pdkv has a rule set
/// for, which CI checks beside the newest), or why it cannot be checked: not a release with
/// MoRIIO pdkv knows, or one whose dialect pdkv has no rule set for.
pub fn release(version: &str) -> Result<&'static VllmPin, String> {
    match version {
        "latest" => return Ok(latest()),
        "oldest" => return Ok(supported().next().expect("pdkv has a rule set for some release")),
        _ => {}
    }
    let known = || RELEASES.iter().map(|r| r.version).collect::<Vec<_>>().join(", ");
    let pin = RELEASES
        .iter()
        .find(|r| r.version == version)
        .ok_or_else(|| format!("--release {version}: not a vLLM release pdkv knows (known: {})", known()))?;
    if pin.rules.is_none() {
        let supported: Vec<&str> = supported().map(|r| r.version).collect();
        return Err(format!(
            "--release {version}: its MoRIIO speaks the {} dialect, which pdkv has no rule set for yet \
             (docs/moriio-releases.md says how it differs); releases checked: {}",
            pin.dialect,
            supported.join(", ")
        ));
    }
    Ok(pin)
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
    Download { version: &'static str, detail: String },
    /// A wheel (downloaded or cached) does not match any pinned hash.
    HashMismatch { version: &'static str, detail: String },
    /// The wheel's files could not be extracted (a member is missing, or it is not a zip).
    Extract { version: &'static str, detail: String },
    /// A file-system step failed.
    Io { what: String, error: io::Error },
}

impl fmt::Display for WheelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WheelError::Download { version, detail } => write!(
                f,
                "could not download vllm {} from PyPI (https://pypi.org, or the index your pip \
                 configuration names). Is PyPI reachable?\n--- pip ---\n{}\n---",
                version,
                detail.trim()
            ),
            WheelError::HashMismatch { version, detail } => write!(
                f,
                "the vllm {} wheel does not match its pinned sha256 (xtask/src/moriio/wheel.rs, RELEASES): \
                 a tampered or truncated file, or a platform whose wheel is not pinned.\n{}",
                version,
                detail.trim()
            ),
            WheelError::Extract { version, detail } => {
                write!(
                    f,
                    "cannot extract the MoRIIO files from the vllm {} wheel: {}",
                    version,
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
pub fn cache_dir(target: &Path, pin: &VllmPin) -> PathBuf {
    target.join(format!("vllm-{}", pin.version))
}

/// Makes `<cache>/src/` hold the extracted files of a hash-checked wheel, downloading the wheel
/// only when no cached copy matches its pin. Returns the `src/` folder.
pub fn ensure(
    python: &Path,
    root: &Path,
    cache: &Path,
    pin: &'static VllmPin,
) -> Result<PathBuf, WheelError> {
    fs::create_dir_all(cache).map_err(|e| io_error(format!("cannot create {}", cache.display()), e))?;
    let src = cache.join("src");
    if let Some(wheel) = cached_wheel(cache, pin) {
        match extract(python, root, &wheel, &src, pin) {
            Ok(()) => return Ok(src),
            Err(WheelError::HashMismatch { detail, .. }) => {
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
    let wheel = download(python, cache, pin)?;
    extract(python, root, &wheel, &src, pin)?;
    Ok(src)
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A cached wheel with one of the pinned file names, if any.
fn cached_wheel(cache: &Path, pin: &VllmPin) -> Option<PathBuf> {
    pin.wheels.iter().map(|(platform, _)| cache.join(pin.file_name(platform))).find(|p| p.is_file())
}

/// `pip download` of the pinned release into a scratch folder, moved into `cache` once pip has
/// checked its hash.
fn download(python: &Path, cache: &Path, pin: &'static VllmPin) -> Result<PathBuf, WheelError> {
    let partial = cache.join("download.partial");
    match fs::remove_dir_all(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(format!("cannot remove {}", partial.display()), e)),
    }
    fs::create_dir_all(&partial).map_err(|e| io_error(format!("cannot create {}", partial.display()), e))?;
    let reqs = partial.join("requirements.txt");
    fs::write(&reqs, pin.requirements())
        .map_err(|e| io_error(format!("cannot write {}", reqs.display()), e))?;
    let log = partial.join("pip.log");
    let log_file =
        fs::File::create(&log).map_err(|e| io_error(format!("cannot create {}", log.display()), e))?;
    let log_err = log_file.try_clone().map_err(|e| io_error("cannot duplicate a file handle".into(), e))?;
    eprintln!(
        "  pip download vllm=={} --no-deps --only-binary :all: --require-hashes (about 340 MB, once; cached in {}) ...",
        pin.version,
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
            WheelError::HashMismatch { version: pin.version, detail: output }
        } else {
            WheelError::Download { version: pin.version, detail: format!("{status}\n{output}") }
        });
    }
    let fetched = pin
        .wheels
        .iter()
        .map(|(platform, _)| pin.file_name(platform))
        .find(|name| partial.join(name).is_file())
        .ok_or_else(|| WheelError::Download {
            version: pin.version,
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
fn extract(
    python: &Path,
    root: &Path,
    wheel: &Path,
    src: &Path,
    pin: &'static VllmPin,
) -> Result<(), WheelError> {
    let mut cmd = Command::new(python);
    cmd.arg(root.join("tests/moriio/extract.py")).arg(wheel).arg(src);
    for (_, sha256) in pin.wheels {
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
        Some(3) => Err(WheelError::HashMismatch { version: pin.version, detail: reason }),
        _ => Err(WheelError::Extract { version: pin.version, detail: format!("{}\n{reason}", out.status) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every release names PyPI's files with both platforms' sha256, versions ascend, and
    /// only releases of a dialect pdkv has a rule set for can be checked.
    #[test]
    fn releases_name_pypi_files_with_sha256_hashes() {
        let number = |v: &str| v.split('.').map(|n| n.parse::<u32>().expect("numeric")).collect::<Vec<_>>();
        for pair in RELEASES.windows(2) {
            assert!(
                number(pair[0].version) < number(pair[1].version),
                "{} then {}",
                pair[0].version,
                pair[1].version
            );
        }
        for pin in RELEASES {
            assert_eq!(pin.wheels.len(), 2, "{}", pin.version);
            for (platform, sha256) in pin.wheels {
                assert!(platform.starts_with("manylinux_"), "{platform}");
                assert!(sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit()), "{sha256}");
                assert_eq!(*sha256, sha256.to_ascii_lowercase());
            }
            assert!(pin.dialect.starts_with("vllm-0."), "{}", pin.dialect);
            if let Some(rules) = pin.rules {
                assert_eq!(rules.name(), pin.dialect, "{}: the rule set is the dialect's", pin.version);
            }
        }
        assert_eq!(latest().version, "0.34.0");
        assert_eq!(
            latest().file_name("manylinux_2_28_x86_64"),
            "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
        );
        let reqs = latest().requirements();
        assert!(reqs.starts_with("vllm==0.34.0 \\\n    --hash=sha256:79ca4b3c"), "{reqs}");
        assert_eq!(reqs.matches("--hash=sha256:").count(), 2);
        let versions: Vec<&str> = supported().map(|r| r.version).collect();
        assert_eq!(
            versions,
            [
                "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                "0.32.0", "0.33.0", "0.34.0"
            ]
        );
    }

    /// (--release value) -> the release, or the refusal's words.
    #[test]
    fn a_release_is_chosen_by_version_or_refused_with_why() {
        let check = |version: &str, expected: Result<&str, &str>| match (release(version), expected) {
            (Ok(pin), Ok(v)) => assert_eq!(pin.version, v),
            (Err(e), Err(words)) => assert!(e.contains(words), "{e}"),
            (got, want) => panic!("{version}: got {:?}, want {want:?}", got.map(|p| p.version)),
        };
        check("0.34.0", Ok("0.34.0"));
        check("0.33.0", Ok("0.33.0"));
        check("0.25.0", Ok("0.25.0"));
        check("0.30.0", Ok("0.30.0"));
        check("0.26.0", Ok("0.26.0"));
        check("0.14.0", Err("not a vLLM release pdkv knows (known: 0.25.0, 0.25.1,"));
        check("latest", Ok("0.34.0"));
        check("oldest", Ok("0.25.0"));
        check("0.33", Err("not a vLLM release pdkv knows"));
    }

    #[test]
    fn errors_say_what_to_check() {
        let e = WheelError::Download { version: "0.34.0", detail: "NewConnectionError".into() };
        assert!(e.to_string().contains("Is PyPI reachable?"), "{e}");
        let e = WheelError::HashMismatch { version: "0.34.0", detail: "sha256 abc".into() };
        assert!(e.to_string().contains("pinned sha256"), "{e}");
    }
}
