//! What vLLM's own MoRIIO connector imports that vLLM 0.34.0 does not require (`msgpack`),
//! installed beside the venv, never into it: the tests that run MoRIIO against pdkv put this
//! folder on the MoRIIO server's `PYTHONPATH` only, so pdkv's side runs in the venv exactly as
//! vLLM's requirement list makes it. The pins (with every wheel's sha256) are the conformance
//! environment's (`crate::pyenv::PACKAGES`).

use std::fs;
use std::path::PathBuf;

use super::steps::{self, run_logged};
use super::venv::VllmEnv;
use super::VllmEnvError;

/// The packages installed, by name as [`crate::pyenv::PACKAGES`] spells them.
const NAMES: &[&str] = &["msgpack"];

/// The pinned requirements for [`NAMES`], with their hashes; also the folder's stamp.
fn requirements() -> String {
    crate::pyenv::requirements_of(crate::pyenv::PACKAGES.iter().filter(|p| NAMES.contains(&p.name)))
}

const STAMP: &str = "pdkv-extras.txt";

/// Makes or reuses `<cache>/vllm-<version>-moriio-extras/`; returns it.
pub fn ensure(env: &VllmEnv) -> Result<PathBuf, VllmEnvError> {
    let name = env.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = env.cache.join(format!("{name}-moriio-extras"));
    let reqs = requirements();
    let imports = "import sys; sys.path.insert(0, sys.argv[1]); import msgpack; print(msgpack.__file__)";
    let dir_text = dir.to_string_lossy().into_owned();
    if fs::read_to_string(dir.join(STAMP)).is_ok_and(|s| s == reqs)
        && steps::python(&env.python, imports, &[&dir_text]).is_ok_and(|f| f.trim().starts_with(&dir_text))
    {
        return Ok(dir);
    }
    let partial = env.cache.join(format!("{name}-moriio-extras.partial"));
    let io = |what: String| move |error| VllmEnvError::Io { what, error };
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).map_err(io(format!("cannot create {}", partial.display())))?;
    let file = partial.join("requirements.txt");
    fs::write(&file, &reqs).map_err(io(format!("cannot write {}", file.display())))?;
    eprintln!(
        "vllm-env: pip install --target {} {} (MoRIIO's imports, beside the venv) ...",
        dir.display(),
        NAMES.join(" ")
    );
    run_logged(
        "pip install of MoRIIO's extra imports",
        super::venv::pip(env, "install")
            .args(["--require-hashes", "--only-binary", ":all:", "--no-deps", "--target"])
            .arg(&partial)
            .arg("--requirement")
            .arg(&file),
        &partial.join("pip.log"),
    )
    .map_err(VllmEnvError::PipStep)?;
    fs::write(partial.join(STAMP), &reqs).map_err(io(format!("cannot write {}", partial.display())))?;
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&partial, &dir).map_err(io(format!("cannot move {} into place", partial.display())))?;
    let found = steps::python(&env.python, imports, &[&dir_text]).map_err(|detail| VllmEnvError::Check {
        dir: dir.clone(),
        detail: format!("msgpack does not import from it: {detail}"),
    })?;
    eprintln!("  msgpack at {}", found.trim());
    Ok(dir)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_extra_is_pinned_with_hashes() {
        let text = super::requirements();
        for name in super::NAMES {
            assert!(
                text.starts_with(&format!("{name}==")) || text.contains(&format!("\n{name}==")),
                "{text}"
            );
        }
        assert!(text.contains("--hash=sha256:"), "{text}");
    }
}
