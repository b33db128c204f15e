//! `cargo xtask python-wheel`: the pdkv wheel built from python/ by the pinned maturin (installed
//! into the vLLM venv when missing), installed into that venv in place of any earlier build, and
//! checked by importing it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::pin::MATURIN;
use super::steps::{self, run_logged};
use super::venv::VllmEnv;
use super::VllmEnvError;

/// The build's log, in the wheels' folder.
const BUILD_LOG: &str = "pdkv-build.log";

/// Builds and installs the pdkv wheel into `env`; Ok has the version `import pdkv` reports.
pub fn build_and_install(root: &Path, env: &VllmEnv) -> Result<String, VllmEnvError> {
    ensure_maturin(env)?;
    let out_dir = crate::target_dir(root).join("wheels");
    fs::create_dir_all(&out_dir)
        .map_err(|error| VllmEnvError::Io { what: format!("cannot create {}", out_dir.display()), error })?;
    let log = out_dir.join(BUILD_LOG);
    let _ = fs::remove_file(&log);
    eprintln!("python-wheel: maturin build --release -o {} (python/) ...", out_dir.display());
    let started = Instant::now();
    run_logged(
        "maturin build of the pdkv wheel",
        Command::new(&env.python)
            .args(["-m", "maturin", "build", "--release", "--out"])
            .arg(&out_dir)
            .arg("--interpreter")
            .arg(&env.python)
            .current_dir(root.join("python")),
        &log,
    )
    .map_err(VllmEnvError::Build)?;
    let text = fs::read_to_string(&log).unwrap_or_default();
    let wheel = built_wheel(&text).ok_or_else(|| VllmEnvError::Check {
        dir: out_dir.clone(),
        detail: format!("maturin succeeded but its log {} names no built wheel", log.display()),
    })?;
    eprintln!("  built {} in {:.1} s; installing it ...", wheel.display(), started.elapsed().as_secs_f64());
    run_logged(
        "pip install of the pdkv wheel",
        super::venv::pip(env, "install").args(["--no-deps", "--force-reinstall", "--no-index"]).arg(&wheel),
        &log,
    )
    .map_err(VllmEnvError::Build)?;
    // Run from the workspace root, where no `pdkv` folder could shadow the installed package.
    let out = Command::new(&env.python)
        .args(["-c", "import pdkv; print(pdkv.__version__)"])
        .current_dir(root)
        .output()
        .map_err(|error| VllmEnvError::Io { what: format!("cannot run {}", env.python.display()), error })?;
    if !out.status.success() {
        return Err(VllmEnvError::Check {
            dir: env.dir.clone(),
            detail: format!("`import pdkv` fails: {}", String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Installs [`MATURIN`] (hash-checked) unless the venv has that version already.
fn ensure_maturin(env: &VllmEnv) -> Result<(), VllmEnvError> {
    let code = "import importlib.metadata as m; print(m.version('maturin'))";
    if steps::python(&env.python, code, &[]).is_ok_and(|v| v.trim() == MATURIN.version) {
        return Ok(());
    }
    let reqs = env.dir.join("pdkv-maturin.txt");
    fs::write(&reqs, MATURIN.requirements())
        .map_err(|error| VllmEnvError::Io { what: format!("cannot write {}", reqs.display()), error })?;
    eprintln!("python-wheel: pip install maturin=={} --require-hashes ...", MATURIN.version);
    run_logged(
        "pip install of maturin",
        super::venv::pip(env, "install")
            .args(["--require-hashes", "--only-binary", ":all:", "--requirement"])
            .arg(&reqs),
        &env.dir.join("pdkv-pip.log"),
    )
    .map_err(VllmEnvError::PipStep)?;
    Ok(())
}

/// The wheel maturin's output says it built: the last `Built wheel ... to <path>` line's path.
fn built_wheel(log: &str) -> Option<PathBuf> {
    let line = log.lines().rev().find(|l| l.contains("Built wheel"))?;
    let (_, path) = line.rsplit_once(" to ")?;
    let path = path.trim();
    path.ends_with(".whl").then(|| PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_wheel_from_maturins_output() {
        let check = |log: &str, expected: Option<&str>| {
            assert_eq!(built_wheel(log), expected.map(PathBuf::from), "{log}");
        };
        check(
            "🔗 Found pyo3 bindings with abi3 support\n   Compiling pdkv-core v0.1.0\n\
             📦 Built wheel for abi3 Python ≥ 3.10 to /w/target/wheels/pdkv-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl\n",
            Some("/w/target/wheels/pdkv-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl"),
        );
        check(
            "📦 Built wheel to /a/x.whl\n📦 Built wheel for abi3 Python ≥ 3.10 to /b/y.whl\n",
            Some("/b/y.whl"),
        );
        check("   Compiling pdkv-core v0.1.0\n", None);
        check("📦 Built wheel to /a/x.tar.gz\n", None);
    }
}
