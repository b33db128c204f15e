//! `cargo xtask vllm-env`, `python-wheel` and `vllm-test`: the Python venv in which pdkv's vLLM
//! plugin is tested with vLLM's real code on a CPU (`venv.rs`: made once under the cache folder
//! of `cache.rs`, outside the checkout, from the wheel `pin.rs` pins and the requirement list
//! `metadata.rs` reads from it, reused while its `marker.rs` marker names the pin), the pdkv
//! wheel built and installed into it (`pdkv_wheel.rs`), and the plugin's tests run with it.
//! `steps.rs` runs the long steps with a log and progress lines.

mod cache;
mod marker;
mod metadata;
mod moriio_extras;
mod pdkv_wheel;
mod pin;
mod steps;
mod venv;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use venv::VllmEnv;

pub const HELP_ENV: &str = "\
usage: cargo xtask vllm-env [--print-python]

Makes, or reuses, the venv <cache>/vllm-0.34.0/ in which pdkv's vLLM plugin is tested on a CPU:
vLLM 0.34.0's wheel (pinned with its sha256 in xtask/src/vllm_env/pin.rs) installed without its
dependencies, then the wheel's own requirement list (its METADATA's Requires-Dist, without
extras) minus the packages only GPUs or media inputs need (EXCLUDED in pin.rs, each with why).
`pip install vllm==0.34.0` itself fails: it pins a flashinfer-python that is not on PyPI.

<cache> is $PDKV_CACHE_DIR, else $XDG_CACHE_HOME/pdkv, else ~/.cache/pdkv, never inside the
checkout; the wheel is kept in <cache>/wheels/ and pip's cache in <cache>/pip/. The first run
downloads about 4 GB (a 4.5 GB venv); a venv whose marker (pdkv-vllm-env.txt, written last)
names the current pin is reused in well under a second. A venv made beforehand without a marker
is adopted if its vllm is the pinned version from the pinned wheel and every requirement is
met; an interrupted install, or a venv of another pin, is made anew.

options:
  --print-python   print the venv's Python (after making it if needed) on stdout";

pub const HELP_WHEEL: &str = "\
usage: cargo xtask python-wheel

Makes or reuses the vLLM venv (`cargo xtask vllm-env`), installs the pinned maturin into it if
missing, builds the pdkv wheel from python/ (`maturin build --release -o target/wheels`),
installs it into the venv (`pip install --no-deps --force-reinstall`) and checks that
`import pdkv` works, printing its version.";

/// Where the plugin's tests live, relative to the workspace root, and the module run there.
const TESTS_DIR: &str = "tests/vllm";
const TESTS_PACKAGE: &str = "pdkv_vllm_test";

/// Why the venv or the wheel could not be made. Every message names what failed and what to
/// check.
#[derive(Debug)]
pub enum VllmEnvError {
    Cache(cache::CacheError),
    /// No vLLM wheel is pinned for this machine.
    UnsupportedArch {
        arch: String,
    },
    /// No interpreter tried meets the wheel's Requires-Python.
    NoPython {
        tried: Vec<String>,
    },
    /// `python -m venv` failed, with and without pip.
    Venv {
        program: String,
        detail: String,
    },
    /// The venv had no pip and pip's wheel could not be installed.
    PipBootstrap(crate::pyenv::PyEnvError),
    /// The wheel does not match its pinned sha256.
    HashMismatch {
        file: PathBuf,
        found: String,
        expected: String,
    },
    /// The wheel could not be read (not a zip, no METADATA).
    Wheel {
        file: PathBuf,
        detail: String,
    },
    Metadata(metadata::MetadataError),
    /// A pip step that downloads failed (no network, no such version, a hash mismatch).
    PipStep(steps::StepFailure),
    /// Building or installing the pdkv wheel failed (a compile error, a bad wheel).
    Build(steps::StepFailure),
    /// The finished venv or wheel fails its checks.
    Check {
        dir: PathBuf,
        detail: String,
    },
    Io {
        what: String,
        error: io::Error,
    },
}

impl fmt::Display for VllmEnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VllmEnvError::Cache(e) => write!(f, "{e}"),
            VllmEnvError::UnsupportedArch { arch } => write!(
                f,
                "no vLLM {} wheel is pinned for {arch}: add its sha256 (https://pypi.org/simple/vllm/) to VLLM \
                 in xtask/src/vllm_env/pin.rs",
                pin::VLLM.version
            ),
            VllmEnvError::NoPython { tried } => write!(
                f,
                "no Python meets vLLM {}'s Requires-Python {:?}; tried: {}. Install one (Debian/Ubuntu: \
                 `apt-get install python3`)",
                pin::VLLM.version,
                pin::VLLM.requires_python,
                tried.join("; ")
            ),
            VllmEnvError::Venv { program, detail } => write!(
                f,
                "`{program} -m venv` cannot make a venv (Debian/Ubuntu: `apt-get install python3-venv`):\n{}",
                detail.trim()
            ),
            VllmEnvError::PipBootstrap(e) => write!(f, "{e}"),
            VllmEnvError::HashMismatch { file, found, expected } => write!(
                f,
                "{} has sha256 {found}, its pin (xtask/src/vllm_env/pin.rs) {expected}: a truncated or \
                 replaced file; it was removed, so the next run downloads it again",
                file.display()
            ),
            VllmEnvError::Wheel { file, detail } => write!(f, "cannot read {}: {}", file.display(), detail.trim()),
            VllmEnvError::Metadata(e) => write!(f, "{e}"),
            VllmEnvError::PipStep(e) => write!(
                f,
                "{e}\nIs PyPI reachable (https://pypi.org, or the index your pip configuration names), and \
                 does it have the versions vLLM asks for?"
            ),
            VllmEnvError::Build(e) => write!(f, "{e}"),
            VllmEnvError::Check { dir, detail } => write!(f, "{} fails its check: {}", dir.display(), detail.trim()),
            VllmEnvError::Io { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

/// The cache folder, by the rules of `cache.rs`, checked against the checkout as given and as
/// the file system resolves it.
fn cache_root(root: &Path) -> Result<PathBuf, VllmEnvError> {
    let resolved = root.canonicalize().unwrap_or_else(|_| root.to_owned());
    let (dir, _rule) =
        cache::cache_root(&cache::CacheVars::from_env(), &[root, &resolved]).map_err(VllmEnvError::Cache)?;
    Ok(dir)
}

/// Makes or reuses the venv.
pub fn ensure(root: &Path) -> Result<VllmEnv, VllmEnvError> {
    venv::ensure(&cache_root(root)?)
}

/// `cargo xtask vllm-env [--print-python]`.
pub fn run_env(args: &[String], root: &Path) -> ExitCode {
    let mut print_python = false;
    for arg in args {
        match arg.as_str() {
            "-h" | "--help" => {
                println!("{HELP_ENV}");
                return ExitCode::SUCCESS;
            }
            "--print-python" => print_python = true,
            other => {
                eprintln!("vllm-env: unknown argument {other:?}\n\n{HELP_ENV}");
                return ExitCode::from(2);
            }
        }
    }
    match ensure(root) {
        Ok(env) => {
            if print_python {
                println!("{}", env.python.display());
            } else {
                eprintln!(
                    "vllm-env: {} (vLLM {}); its Python: {}",
                    env.dir.display(),
                    pin::VLLM.version,
                    env.python.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vllm-env: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask python-wheel`.
pub fn run_wheel(args: &[String], root: &Path) -> ExitCode {
    match args.first().map(String::as_str) {
        None => {}
        Some("-h" | "--help") => {
            println!("{HELP_WHEEL}");
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("python-wheel: unknown argument {other:?}\n\n{HELP_WHEEL}");
            return ExitCode::from(2);
        }
    }
    match ensure(root).and_then(|env| pdkv_wheel::build_and_install(root, &env).map(|v| (env, v))) {
        Ok((env, version)) => {
            eprintln!("python-wheel: pdkv {version} installed into {}", env.dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("python-wheel: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask vllm-test [ARGS]...`: the venv, the wheel, MoRIIO's extra imports beside the venv
/// (`PDKV_MORIIO_EXTRAS`), then `python -m pdkv_vllm_test.run ARGS...` with
/// `PYTHONPATH=tests/vllm`, its exit code passed on.
pub fn run_test(args: &[String], root: &Path) -> ExitCode {
    let env = match ensure(root) {
        Ok(env) => env,
        Err(e) => {
            eprintln!("vllm-test: {e}");
            return ExitCode::FAILURE;
        }
    };
    match pdkv_wheel::build_and_install(root, &env) {
        Ok(version) => eprintln!("vllm-test: pdkv {version} installed into {}", env.dir.display()),
        Err(e) => {
            eprintln!("vllm-test: {e}");
            return ExitCode::FAILURE;
        }
    }
    let extras = match moriio_extras::ensure(&env) {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("vllm-test: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tests = root.join(TESTS_DIR);
    if !tests.join(TESTS_PACKAGE).is_dir() {
        eprintln!(
            "vllm-test: {TESTS_DIR}/{TESTS_PACKAGE}/ is missing: nothing to run is a failure, not a pass"
        );
        return ExitCode::FAILURE;
    }
    eprintln!("$ PYTHONPATH={TESTS_DIR} {} -m {TESTS_PACKAGE}.run {}", env.python.display(), args.join(" "));
    let status = Command::new(&env.python)
        .args(["-m", &format!("{TESTS_PACKAGE}.run")])
        .args(args)
        .env("PYTHONPATH", &tests)
        .env("PDKV_MORIIO_EXTRAS", &extras)
        .current_dir(root)
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("vllm-test: {TESTS_PACKAGE}.run failed: {s}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("vllm-test: cannot run {}: {e}", env.python.display());
            ExitCode::FAILURE
        }
    }
}
