//! The project-local Python environment under `target/pyenv/`: a virtual environment made from
//! the system `python3` with pinned, hash-checked versions of exactly the packages the
//! conformance tests' Python peers need (tests/it/zmtp_pyzmq.rs runs tests/fixtures/zmq_peer.py;
//! `cargo xtask moriio-conformance` runs vLLM's own MoRIIO modules, which add msgspec).
//!
//! It lives in the target directory so that `cargo clean` removes it, and it is set up by
//! `cargo xtask test`, so a fresh machine needs Rust and a system Python, nothing installed by
//! hand. [`ensure`] reuses a complete environment (its stamp file holds exactly what
//! [`requirements`] pins, and its interpreter imports every package) and otherwise builds a new one under
//! `target/pyenv.partial/`, renaming it into place only once it is complete: an interrupted run
//! leaves at most a partial directory, which the next run deletes.
//!
//! Adding a package means adding a [`PyPackage`] to [`PACKAGES`] with the sha256 of its wheels
//! (PyPI's simple index lists them: `https://pypi.org/simple/<name>/`); the changed stamp makes
//! the next run rebuild the environment.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

/// One pinned package: its distribution name and version, the module the tests import, and the
/// sha256 of every wheel pip may install for it.
pub struct PyPackage {
    pub name: &'static str,
    pub version: &'static str,
    /// The module `import` finds it under; the reuse check imports it.
    pub import: &'static str,
    /// `(wheel file name, sha256)`: the file names only document which platform a hash is for.
    pub wheels: &'static [(&'static str, &'static str)],
}

/// What the Python peers and vLLM's MoRIIO modules import. pip runs with `--require-hashes --only-binary :all:`, so it
/// installs one of these exact wheels or nothing. A wheel is specific to a Python version and a
/// platform, so the hashes cover the manylinux wheels for CPython 3.10 to 3.15 on x86_64 and
/// aarch64 (the machines pdkv runs on; pyzmq's `cp312-abi3` wheel serves 3.12 and later). On
/// another platform pip stops with a hash mismatch, and the error says where to add the hash
/// of that platform's wheel: this list. msgpack 1.2 and msgspec 0.22 need Python 3.10 or newer,
/// hence [`MIN_PYTHON`].
pub const PACKAGES: &[PyPackage] = &[
    PyPackage {
        name: "pyzmq",
        version: "27.3.0",
        import: "zmq",
        wheels: &[
            (
                "pyzmq-27.3.0-cp310-cp310-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
                "e84d88c42ac2ea32314aaa9ef879da16c372ebfb8ad6f2ce1953d88538b44831",
            ),
            (
                "pyzmq-27.3.0-cp310-cp310-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl",
                "fe0ed75bccf62838682f2615c33aebbb6bc658ab2697afd6932c7919f3b26cba",
            ),
            (
                "pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
                "477b8ad30d66fc905c5388351e83b9ac25824b00e82c0d052b72ea6392636dfd",
            ),
            (
                "pyzmq-27.3.0-cp311-cp311-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl",
                "f3d14fc8a7b85156c67e3f6ebbe8f2af2f89da2a407997a66e2a578e1bdabf6a",
            ),
            (
                "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
                "858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798",
            ),
            (
                "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl",
                "ad8b828407caee77ff3ab0bdb2984ee8d48922328b226e8fda7c84a71a55dbb4",
            ),
        ],
    },
    PyPackage {
        name: "msgpack",
        version: "1.2.4",
        import: "msgpack",
        wheels: &[
            (
                "msgpack-1.2.4-cp310-cp310-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "85b79ed643cfde70672152b3d1aee438ca647c5d2ffb7dba7226689ee9f6f44b",
            ),
            (
                "msgpack-1.2.4-cp310-cp310-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "25e1f2466c4ea0fb9b694a922f75eb92d7ce6262eda8cb8a5dada34fe990d486",
            ),
            (
                "msgpack-1.2.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "a45ceb5f199d5e388f28b550ba881096a3740d4bda10e661d77f59d9a2e8187a",
            ),
            (
                "msgpack-1.2.4-cp311-cp311-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "0c75cfda0d3ccb1f6abc20e0608ad6b226e11f317b5ac297721504d2509e2bd9",
            ),
            (
                "msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "c4d5bbdbea8f5669b3a734d6c226772804fb120848f99cbe63a0ddee63b049c9",
            ),
            (
                "msgpack-1.2.4-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "9ca1e78106675f2aed07dc37b842ce19be70010ab22c5c5c04688f0840d48539",
            ),
            (
                "msgpack-1.2.4-cp313-cp313-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "7fabd415c41e62006c6641fcdf5b3e866f581c4e11c58328c0d0f69584b9577d",
            ),
            (
                "msgpack-1.2.4-cp313-cp313-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "e9c5ba0f053a7e98f013f083c9d1b2dffb26cad8c897c533d8286e44ed24c669",
            ),
            (
                "msgpack-1.2.4-cp314-cp314-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "5d65b791ce4283e02b6267742ad540899155e1b32887b9cbdda47f38f5a076b5",
            ),
            (
                "msgpack-1.2.4-cp314-cp314-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "2444a4e04f924630d059ae6eae8f91fdfcd28ed9fd17b21bacf4e74550a091f7",
            ),
            (
                "msgpack-1.2.4-cp315-cp315-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "e7ae8cf6012372cecb43016132d1b87ccc2ebb8ae5ab5078687399e82423386a",
            ),
            (
                "msgpack-1.2.4-cp315-cp315-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "c5917972ce1bf5f85f761031e00dab6fe0ad9f880cb3d2d43ed74b330c850400",
            ),
        ],
    },
    PyPackage {
        name: "msgspec",
        version: "0.22.0",
        import: "msgspec",
        wheels: &[
            (
                "msgspec-0.22.0-cp310-cp310-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "12a887c4c06e4a771a2db32c9a80c7bb21866b12458025f636dcdc2253331c28",
            ),
            (
                "msgspec-0.22.0-cp310-cp310-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "57c282f474e17acf6bcf84f393c73afd45d6eba47cccff8b76b79c4fbb8a3b54",
            ),
            (
                "msgspec-0.22.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "a6db3806b3b76ca78064255eac6fa101a8a64fe6f698d80fbaf81fdfa21217d4",
            ),
            (
                "msgspec-0.22.0-cp311-cp311-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "b962000e11dd34fb210a5a2c57a8a62b2d92b381c8cb3b05c075a83e38f8d645",
            ),
            (
                "msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "99c401861c5bb3a57f7d6423ea7ed4352cd57aa3f04f4fbe9f3e3e4564a10f08",
            ),
            (
                "msgspec-0.22.0-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "b5a169b5b03f0f2c7a296c002647db1dab75d2cd501bca34e32b71cab0261b56",
            ),
            (
                "msgspec-0.22.0-cp313-cp313-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "c6c310ef83e7e291b01a63298828f848348bb99e84a1098c4b3923c05674d032",
            ),
            (
                "msgspec-0.22.0-cp313-cp313-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "627bfdfe5a4b3d916b3360b30f4cddeee3a084f56593e33527c6872fa8322ff9",
            ),
            (
                "msgspec-0.22.0-cp314-cp314-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "5e4f7e09cceac7dbf4c0761b8ae7df51c55b5df5e9af7aff2c895aac1ebea015",
            ),
            (
                "msgspec-0.22.0-cp314-cp314-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "f039ef5207b847f075a0a43020ee6140cd47505f890e47e157f2deb485c2dc96",
            ),
            (
                "msgspec-0.22.0-cp315-cp315-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "71cbbdb39631064e2f2f9e9ac2b1b69931d72276eb5f9da4ed025726296bdbb6",
            ),
            (
                "msgspec-0.22.0-cp315-cp315-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl",
                "8d67582478b0eaabb899f2fb255c878ee7de57dff80eb73ab24f1865524ec441",
            ),
        ],
    },
];

/// The oldest system Python the pinned wheels (and [`PIP_WHEEL`]) support.
pub const MIN_PYTHON: (u32, u32) = (3, 10);

/// pip itself, for a system Python whose `venv` cannot install pip (Debian and Ubuntu without
/// the `python3-venv` package have no `ensurepip`). A wheel is a zip that Python can run, so
/// `python pip.whl/pip install pip.whl` installs pip with nothing but the wheel.
pub const PIP_WHEEL: Wheel = Wheel {
    file: "pip-26.3-py3-none-any.whl",
    url: "https://files.pythonhosted.org/packages/07/25/ee8c38ae72d66b844ce8eb9711ba905dba21ca1a8a0c960057c41cd23337/pip-26.3-py3-none-any.whl",
    sha256: "f3b60b20ffaadd4415ed7957212a38ac63fa4c5fa375bd0f4a797777940fad13",
};

/// A file fetched directly from PyPI's file host and checked against its sha256.
pub struct Wheel {
    pub file: &'static str,
    pub url: &'static str,
    pub sha256: &'static str,
}

/// The stamp's first line (a comment to pip); changing it (or [`PACKAGES`]) makes every existing
/// environment stale.
const STAMP_HEADER: &str = "# target/pyenv made by `cargo xtask test` (xtask/src/pyenv.rs) with pip from:";
const STAMP_FILE: &str = "pdkv-requirements.txt";

/// Why the environment could not be set up. Every message names what to install or check.
#[derive(Debug)]
pub enum PyEnvError {
    /// The system Python could not be started at all.
    NoPython { program: String, error: io::Error },
    /// The system Python runs but is older than [`MIN_PYTHON`] (or printed no version).
    OldPython { program: String, version: String },
    /// Neither `python3 -m venv` nor `python3 -m venv --without-pip` worked.
    NoVenv { program: String, with_pip: String, without_pip: String },
    /// The venv had no pip and pip's wheel could not be fetched or did not match its hash.
    PipBootstrap { detail: String },
    /// `pip install` of the pinned packages failed (no network, no wheel for this platform, a
    /// hash mismatch).
    Install { detail: String },
    /// The new environment cannot import a package pip just installed.
    Broken { detail: String },
    /// A file-system step (creating, removing, renaming, writing the stamp) failed.
    Io { what: String, error: io::Error },
}

impl fmt::Display for PyEnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = MIN_PYTHON;
        match self {
            PyEnvError::NoPython { program, error } => write!(
                f,
                "cannot run `{program}` ({error}). The conformance tests need Python {major}.{minor} or \
                 newer to set up target/pyenv: install it (Debian/Ubuntu: `apt-get install python3`), or \
                 set PDKV_PYTHON to a Python that already has {}",
                package_list()
            ),
            PyEnvError::OldPython { program, version } => write!(
                f,
                "`{program}` is Python {version}; the pinned {} need Python {major}.{minor} or newer. Put a \
                 newer python3 first on PATH, or set PDKV_PYTHON to a Python that already has them",
                package_list()
            ),
            PyEnvError::NoVenv { program, with_pip, without_pip } => write!(
                f,
                "`{program} -m venv` cannot create a virtual environment.\n\
                 with pip: {}\nwithout pip: {}\n\
                 Install Python's venv module (Debian/Ubuntu: `apt-get install python3-venv`; Fedora: \
                 `dnf install python3`), or set PDKV_PYTHON to a Python that already has {}",
                with_pip.trim(),
                without_pip.trim(),
                package_list()
            ),
            PyEnvError::PipBootstrap { detail } => write!(
                f,
                "the venv has no pip (the system Python lacks ensurepip), so pip's wheel {} was to be \
                 fetched from PyPI, which failed: {}\nEither allow access to files.pythonhosted.org, or install Python's venv module \
                 with its pip (Debian/Ubuntu: `apt-get install python3-venv`)",
                PIP_WHEEL.file,
                detail.trim()
            ),
            PyEnvError::Install { detail } => {
                write!(
                    f,
                    "pip could not install {} from PyPI (https://pypi.org, or the index your pip \
                     configuration names).\n--- pip ---\n{}\n---\n",
                    package_list(),
                    detail.trim()
                )?;
                // pip says "THESE PACKAGES DO NOT MATCH THE HASHES" when it found only wheels whose
                // hash is not pinned: a platform the pins do not cover (or a tampered file).
                if detail.contains("HASHES") {
                    write!(
                        f,
                        "The pinned hashes cover the manylinux wheels of CPython {major}.{minor} to 3.15 on \
                         x86_64 and aarch64. For another platform, add its wheel's sha256 (listed at \
                         https://pypi.org/simple/<name>/) to PACKAGES in xtask/src/pyenv.rs"
                    )
                } else {
                    write!(
                        f,
                        "Is PyPI reachable? Without network access, set PDKV_PYTHON to a Python that already \
                         has these packages"
                    )
                }
            }
            PyEnvError::Broken { detail } => {
                write!(f, "the new target/pyenv cannot import {}: {}", package_list(), detail.trim())
            }
            PyEnvError::Io { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

/// `pyzmq 27.3.0, msgpack 1.2.4`: for progress lines and errors.
pub fn package_list() -> String {
    PACKAGES.iter().map(|p| format!("{} {}", p.name, p.version)).collect::<Vec<_>>().join(", ")
}

/// pip's requirements file: every package pinned to its version with each allowed hash. It is
/// also the stamp's body, so any change to [`PACKAGES`] invalidates an existing environment.
pub fn requirements() -> String {
    requirements_of(PACKAGES.iter())
}

/// pip's requirements file for `packages`: each pinned to its version with each allowed hash.
pub fn requirements_of<'a>(packages: impl Iterator<Item = &'a PyPackage>) -> String {
    let mut text = String::new();
    for p in packages {
        text.push_str(&format!("{}=={}", p.name, p.version));
        for (_, sha256) in p.wheels {
            text.push_str(&format!(" \\\n    --hash=sha256:{sha256}"));
        }
        text.push('\n');
    }
    text
}

fn stamp() -> String {
    format!("{STAMP_HEADER}\n{}", requirements())
}

/// Where the interpreter of a venv at `dir` is.
fn venv_python(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// Returns the interpreter of `<target>/pyenv`, first building the environment if it is missing,
/// incomplete or stale. Progress goes to stderr. `system_python` is the program the venv is made
/// from (`python3`, found on PATH).
pub fn ensure(target: &Path, system_python: &str) -> Result<PathBuf, PyEnvError> {
    let dir = target.join("pyenv");
    let python = venv_python(&dir);
    // The import also catches a venv whose base Python was since upgraded or removed.
    if fs::read_to_string(dir.join(STAMP_FILE)).is_ok_and(|s| s == stamp()) && imports_all(&python).is_ok() {
        return Ok(python);
    }
    let started = Instant::now();
    let (version, executable) = system_python_info(system_python)?;
    eprintln!("setting up target/pyenv ({}) from {executable} (Python {version}) ...", package_list());
    let partial = target.join("pyenv.partial");
    // A leftover from an interrupted or failed run: nothing in it is trusted.
    remove_dir(&partial)?;
    fs::create_dir_all(target)
        .map_err(|error| io_error(format!("cannot create {}", target.display()), error))?;
    create_venv(system_python, &partial)?;
    let tmp_python = venv_python(&partial);
    // The stamp is pip's requirements file too (its header is a comment). Writing it before pip
    // runs is safe: only the rename below makes an environment count.
    let reqs = partial.join(STAMP_FILE);
    fs::write(&reqs, stamp()).map_err(|error| io_error(format!("cannot write {}", reqs.display()), error))?;
    eprintln!("  pip install --require-hashes --only-binary :all: {} ...", package_list());
    let installed = run(Command::new(&tmp_python)
        .args(["-m", "pip", "install", "--require-hashes", "--only-binary", ":all:", "--no-input"])
        .args(["--disable-pip-version-check", "--progress-bar", "off", "--requirement"])
        .arg(&reqs));
    if let Err(detail) = installed {
        return Err(PyEnvError::Install { detail });
    }
    imports_all(&tmp_python).map_err(|detail| PyEnvError::Broken { detail })?;
    // Only a complete environment takes the final name. The venv's own `bin/python` finds its
    // packages relative to itself, so the rename does not break it; only the activate and pip
    // scripts in bin/ name the temporary path, and nothing here uses them.
    remove_dir(&dir)?;
    fs::rename(&partial, &dir).map_err(|error| {
        io_error(format!("cannot rename {} to {}", partial.display(), dir.display()), error)
    })?;
    eprintln!("target/pyenv ready in {:.1} s", started.elapsed().as_secs_f64());
    Ok(python)
}

/// Runs `python -c` importing every package; Err carries Python's output.
fn imports_all(python: &Path) -> Result<(), String> {
    let modules: Vec<&str> = PACKAGES.iter().map(|p| p.import).collect();
    run(Command::new(python).arg("-c").arg(format!("import {}", modules.join(", "))))
}

/// The system Python's version (checked against [`MIN_PYTHON`]) and its executable's path.
fn system_python_info(program: &str) -> Result<(String, String), PyEnvError> {
    let out = Command::new(program)
        .args(["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable)"])
        .output()
        .map_err(|error| PyEnvError::NoPython { program: program.to_owned(), error })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let version = lines.next().unwrap_or_default().trim().to_owned();
    let executable = lines.next().unwrap_or(program).trim().to_owned();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) if out.status.success() && (major, minor) >= MIN_PYTHON => {
            Ok((version, executable))
        }
        _ => {
            let shown = if version.is_empty() { describe(&out) } else { version };
            Err(PyEnvError::OldPython { program: program.to_owned(), version: shown })
        }
    }
}

/// Makes a venv with pip at `dir`: `venv` with its own pip when the system Python has
/// `ensurepip`, else `venv --without-pip` and pip from its pinned wheel.
fn create_venv(system_python: &str, dir: &Path) -> Result<(), PyEnvError> {
    eprintln!("  {system_python} -m venv ...");
    let with_pip = run(Command::new(system_python).args(["-m", "venv"]).arg(dir));
    let with_pip = match with_pip {
        // A venv module patched to skip pip would leave none; pip's wheel fixes that too.
        Ok(()) if run(Command::new(venv_python(dir)).args(["-m", "pip", "--version"])).is_ok() => {
            return Ok(())
        }
        Ok(()) => return bootstrap_pip(dir),
        Err(e) => e,
    };
    // Debian's `venv` without `python3-venv` fails after making the directory, so it goes first.
    remove_dir(dir)?;
    eprintln!(
        "  `{system_python} -m venv` failed; trying `{system_python} -m venv --without-pip` and pip from its wheel ..."
    );
    if let Err(without_pip) = run(Command::new(system_python).args(["-m", "venv", "--without-pip"]).arg(dir))
    {
        return Err(PyEnvError::NoVenv { program: system_python.to_owned(), with_pip, without_pip });
    }
    bootstrap_pip(dir)
}

/// Python that fetches `url` to `path` and checks its sha256 before keeping it (argv: url, path,
/// sha256). It uses Python's own `urllib`, so proxies and certificates are Python's.
const FETCH: &str = "\
import hashlib, os, sys, urllib.request
url, path, want = sys.argv[1:4]
try:
    with urllib.request.urlopen(url, timeout=60) as r:
        data = r.read()
except OSError as e:
    sys.exit(f'cannot download {url}: {e}')
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f'{url}: sha256 {got}, expected {want}')
with open(path + '.tmp', 'wb') as f:
    f.write(data)
os.replace(path + '.tmp', path)
";

/// Installs pip into the venv at `dir` from [`PIP_WHEEL`], downloaded and hash-checked.
pub(crate) fn bootstrap_pip(dir: &Path) -> Result<(), PyEnvError> {
    let python = venv_python(dir);
    let wheel = dir.join(PIP_WHEEL.file);
    eprintln!("  fetching {} from PyPI (sha256-checked) ...", PIP_WHEEL.file);
    run(Command::new(&python).arg("-c").arg(FETCH).arg(PIP_WHEEL.url).arg(&wheel).arg(PIP_WHEEL.sha256))
        .map_err(|detail| PyEnvError::PipBootstrap { detail })?;
    let pip_in_wheel = wheel.join("pip");
    run(Command::new(&python)
        .arg(&pip_in_wheel)
        .args(["install", "--no-index", "--no-deps", "--disable-pip-version-check", "--quiet"])
        .arg(&wheel))
    .map_err(|detail| PyEnvError::PipBootstrap {
        detail: format!("installing pip from its wheel: {detail}"),
    })?;
    fs::remove_file(&wheel).map_err(|error| io_error(format!("cannot remove {}", wheel.display()), error))
}

/// Runs a command to completion; Err has its exit status and output (or why it did not start).
fn run(cmd: &mut Command) -> Result<(), String> {
    match cmd.output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(describe(&out)),
        Err(e) => Err(format!("cannot run {:?}: {e}", cmd.get_program())),
    }
}

fn describe(out: &Output) -> String {
    let mut text = format!("{}", out.status);
    for stream in [&out.stdout, &out.stderr] {
        let s = String::from_utf8_lossy(stream);
        if !s.trim().is_empty() {
            text.push('\n');
            text.push_str(s.trim_end());
        }
    }
    text
}

fn remove_dir(dir: &Path) -> Result<(), PyEnvError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_error(format!("cannot remove {}", dir.display()), error)),
    }
}

fn io_error(what: String, error: io::Error) -> PyEnvError {
    PyEnvError::Io { what, error }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pin_is_a_version_and_sha256_hashes_of_its_own_wheels() {
        for p in PACKAGES {
            assert!(!p.version.is_empty() && p.version.split('.').all(|n| n.parse::<u32>().is_ok()));
            assert!(!p.wheels.is_empty(), "{} has no hashes", p.name);
            for (file, sha256) in p.wheels {
                assert!(file.starts_with(&format!("{}-{}-", p.name, p.version)), "{file} is not {}", p.name);
                assert!(file.ends_with(".whl"), "{file}");
                assert!(sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit()), "{sha256}");
                assert_eq!(*sha256, sha256.to_ascii_lowercase());
            }
        }
        assert_eq!(PIP_WHEEL.sha256.len(), 64);
        assert!(PIP_WHEEL.url.ends_with(&format!("/{}", PIP_WHEEL.file)));
    }

    #[test]
    fn requirements_pin_every_package_with_every_hash() {
        let text = requirements();
        let lines: Vec<&str> = text.lines().collect();
        let hashes: usize = PACKAGES.iter().map(|p| p.wheels.len()).sum();
        assert_eq!(lines.len(), PACKAGES.len() + hashes);
        assert_eq!(lines[0], "pyzmq==27.3.0 \\");
        assert_eq!(
            lines[1],
            "    --hash=sha256:e84d88c42ac2ea32314aaa9ef879da16c372ebfb8ad6f2ce1953d88538b44831 \\"
        );
        assert!(stamp().starts_with(STAMP_HEADER) && stamp().ends_with(&text));
    }
}
