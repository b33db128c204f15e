//! Making, adopting or reusing the vLLM venv `<cache>/vllm-<version>/`: vLLM's pinned wheel
//! installed without its dependencies, then its METADATA's requirement list minus the excluded
//! packages, checked (every requirement met, `import vllm` giving the pinned version), and the
//! `complete` marker written last.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::marker::{self, Origin};
use super::metadata;
use super::pin::{Wheel, EXCLUDED, VLLM};
use super::steps::{self, run_logged};
use super::VllmEnvError;

/// A usable venv: its folder, its interpreter and the cache folder it is in.
pub struct VllmEnv {
    pub dir: PathBuf,
    pub python: PathBuf,
    pub cache: PathBuf,
}

/// Written into the venv before pip runs and removed with the marker written: a venv that has
/// it was being installed by this task when it was interrupted, so it is rebuilt, never adopted.
const INSTALLING: &str = "pdkv-installing";
/// The requirement list pip was given, kept in the venv.
const REQUIREMENTS: &str = "pdkv-requirements.txt";
/// pip's output, appended step by step.
const PIP_LOG: &str = "pdkv-pip.log";

/// The interpreters tried, in order, for the one the venv is made from: the first whose version
/// meets the wheel's Requires-Python.
const BASE_PYTHONS: &[&str] =
    &["python3", "python3.14", "python3.13", "python3.12", "python3.11", "python3.10"];

/// Python printing its version and executable.
const PYTHON_INFO: &str = "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable)";

/// Python printing a wheel's sha256, then, if it is the expected one, its METADATA (argv: the
/// wheel, the expected sha256): a file that is not the pinned wheel is not opened as a zip.
const WHEEL_INFO: &str = "\
import hashlib, sys, zipfile
path, want = sys.argv[1:3]
h = hashlib.sha256()
with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
        h.update(block)
print(h.hexdigest())
if h.hexdigest() != want:
    sys.exit(0)
with zipfile.ZipFile(path) as z:
    names = [n for n in z.namelist() if n.count('/') == 1 and n.endswith('.dist-info/METADATA')]
    if len(names) != 1:
        sys.exit(f'{path}: expected one .dist-info/METADATA, found {names}')
    sys.stdout.write(z.read(names[0]).decode('utf-8'))
";

/// Python printing, for the installed vLLM: the interpreter's version, vLLM's version, the
/// sha256 of the wheel pip installed it from (its `direct_url.json`; empty when it has none),
/// then its METADATA.
const INSTALLED_INFO: &str = "\
import importlib.metadata as md, json, sys
print('%d.%d.%d' % sys.version_info[:3])
d = md.distribution('vllm')
print(d.version)
archive = json.loads(d.read_text('direct_url.json') or '{}').get('archive_info', {})
sha256 = archive.get('hashes', {}).get('sha256') or archive.get('hash', '').partition('sha256=')[2]
print(sha256)
sys.stdout.write(d.read_text('METADATA') or '')
";

/// Python checking a finished venv (argv: the requirement list, vLLM's version, where to write
/// the installed packages): every requirement whose marker applies is installed at a version it
/// allows (with pip's own `packaging`), `import vllm` works and gives the version; then each
/// installed distribution as `name==version`, sorted.
const CHECK: &str = "\
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
reqs, version, out = sys.argv[1:4]
problems = []
for line in open(reqs):
    line = line.strip()
    if not line or line.startswith('#'):
        continue
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({'extra': ''}):
        continue
    try:
        have = md.version(r.name)
    except md.PackageNotFoundError:
        problems.append(f'{line}: not installed')
        continue
    if not r.specifier.contains(have, prereleases=True):
        problems.append(f'{line}: {have} installed')
if problems:
    sys.exit('requirements not met:\\n  ' + '\\n  '.join(problems))
import vllm
if vllm.__version__ != version:
    sys.exit(f'import vllm gives version {vllm.__version__}, expected {version}')
names = sorted((f\"{d.metadata['Name']}=={d.version}\" for d in md.distributions()), key=str.lower)
with open(out, 'w') as f:
    f.write('\\n'.join(names) + '\\n')
";

/// The venv's interpreter.
pub fn venv_python(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// The pin a marker must name on this machine.
fn marker_pin(wheel: &Wheel) -> marker::Pin {
    marker::Pin {
        vllm_version: VLLM.version.to_owned(),
        wheel_file: VLLM.file_name(wheel),
        sha256: wheel.sha256.to_owned(),
        excluded: EXCLUDED.iter().map(|(name, _)| metadata::normalise(name)).collect(),
    }
}

fn excluded_names() -> Vec<&'static str> {
    EXCLUDED.iter().map(|(name, _)| *name).collect()
}

/// Returns the venv of the current pin under `cache`: reused when its marker names the pin and
/// its Python starts, adopted when it was made beforehand and passes the checks, else made anew.
pub fn ensure(cache: &Path) -> Result<VllmEnv, VllmEnvError> {
    let arch = std::env::consts::ARCH;
    let wheel = VLLM.wheel(arch).ok_or_else(|| VllmEnvError::UnsupportedArch { arch: arch.to_owned() })?;
    let dir = cache.join(format!("vllm-{}", VLLM.version));
    let python = venv_python(&dir);
    let env = VllmEnv { dir: dir.clone(), python: python.clone(), cache: cache.to_owned() };
    let pin = marker_pin(wheel);
    let why_not = match fs::read_to_string(dir.join(marker::FILE)) {
        Ok(text) => match marker::check(&text, &pin) {
            // The Python starting also catches a venv whose base interpreter is gone.
            Ok(()) => match steps::python(&python, "", &[]) {
                Ok(_) => return Ok(env),
                Err(e) => format!("its Python does not start: {}", e.trim()),
            },
            Err(stale) => stale.to_string(),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if dir.join(INSTALLING).exists() {
                "an install into it was interrupted".to_owned()
            } else if python.exists() {
                // A venv made beforehand (by hand, as the one this task was first pointed at):
                // adopted only if it is exactly what this task would make.
                eprintln!("vllm-env: {} has no marker; checking it, to adopt it ...", dir.display());
                let started = Instant::now();
                match adopt(&env, wheel, &pin) {
                    Ok(()) => {
                        eprintln!(
                            "vllm-env: adopted {} in {:.1} s",
                            dir.display(),
                            started.elapsed().as_secs_f64()
                        );
                        return Ok(env);
                    }
                    Err(why) => format!("it cannot be adopted: {why}"),
                }
            } else if dir.exists() {
                "it is not a venv".to_owned()
            } else {
                String::new()
            }
        }
        Err(e) => return Err(io_error(format!("cannot read {}", dir.join(marker::FILE).display()), e)),
    };
    if !why_not.is_empty() {
        eprintln!("vllm-env: rebuilding {}: {why_not}", dir.display());
    }
    build(&env, wheel, &pin)?;
    Ok(env)
}

/// Checks a venv without a marker: its vLLM is the pinned version installed from the pinned
/// wheel (the sha256 pip recorded in `direct_url.json`), its Python meets the wheel's
/// Requires-Python, and [`verify`] passes for the requirement list of the installed METADATA
/// (the wheel's own). Then writes the requirement list and the marker. Err says which check
/// failed; nothing is written then.
fn adopt(env: &VllmEnv, wheel: &Wheel, pin: &marker::Pin) -> Result<(), String> {
    let out =
        steps::python(&env.python, INSTALLED_INFO, &[]).map_err(|e| format!("reading its vllm: {e}"))?;
    let mut lines = out.splitn(4, '\n');
    let mut next = || lines.next().unwrap_or_default().trim().to_owned();
    let (python_version, version, sha256) = (next(), next(), next());
    let metadata_text = lines.next().unwrap_or_default().to_owned();
    if version != VLLM.version {
        return Err(format!("its vllm is {version}, the pin {}", VLLM.version));
    }
    if sha256 != wheel.sha256 {
        return Err(format!(
            "its vllm was not installed from the pinned wheel (pip recorded sha256 {:?}, the pin is {})",
            sha256, wheel.sha256
        ));
    }
    metadata::check_requires_python(&metadata_text, VLLM.requires_python).map_err(|e| e.to_string())?;
    if !metadata::python_meets(&python_version, VLLM.requires_python)? {
        return Err(format!(
            "its Python {python_version} does not meet Requires-Python {}",
            VLLM.requires_python
        ));
    }
    let reqs = metadata::requirements(&metadata_text, &excluded_names()).map_err(|e| e.to_string())?;
    let reqs_file = env.dir.join(REQUIREMENTS);
    fs::write(&reqs_file, requirements_file(&reqs))
        .map_err(|e| format!("cannot write {}: {e}", reqs_file.display()))?;
    eprintln!(
        "  vllm {version} from the pinned wheel; checking its {} requirements and `import vllm` ...",
        reqs.len()
    );
    let packages = verify(env)?;
    write_marker(env, pin, &python_version, Origin::Adopted, &packages)
}

/// The requirement list's file: a comment saying where it came from, then one per line.
fn requirements_file(reqs: &[String]) -> String {
    let mut text = format!(
        "# vLLM {}'s Requires-Dist without extras and without the packages xtask/src/vllm_env/pin.rs \
         excludes (EXCLUDED)\n",
        VLLM.version
    );
    for r in reqs {
        text.push_str(r);
        text.push('\n');
    }
    text
}

/// Runs [`CHECK`] in the venv; Ok has the installed packages (`name==version`).
fn verify(env: &VllmEnv) -> Result<Vec<String>, String> {
    let listed = env.dir.join("pdkv-packages.txt");
    let reqs = env.dir.join(REQUIREMENTS);
    let (reqs, listed_arg) = (reqs.to_string_lossy().into_owned(), listed.to_string_lossy().into_owned());
    steps::python(&env.python, CHECK, &[&reqs, VLLM.version, &listed_arg])?;
    let text = fs::read_to_string(&listed).map_err(|e| format!("cannot read {}: {e}", listed.display()))?;
    let _ = fs::remove_file(&listed);
    Ok(text.lines().filter(|l| !l.is_empty()).map(String::from).collect())
}

fn write_marker(
    env: &VllmEnv,
    pin: &marker::Pin,
    python_version: &str,
    origin: Origin,
    packages: &[String],
) -> Result<(), String> {
    let path = env.dir.join(marker::FILE);
    let partial = env.dir.join(format!("{}.partial", marker::FILE));
    // Written whole, then renamed: a marker cut short by a crash would fail its check anyway
    // (it must end with `complete`), and this way it never exists half-written.
    fs::write(&partial, marker::render(pin, python_version, origin, packages))
        .and_then(|()| fs::rename(&partial, &path))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Makes the venv from nothing: the base Python, the venv (with pip), the wheel, its
/// requirements, the checks, the marker.
fn build(env: &VllmEnv, wheel: &Wheel, pin: &marker::Pin) -> Result<(), VllmEnvError> {
    let started = Instant::now();
    let (base, base_version) = base_python()?;
    eprintln!(
        "vllm-env: making {} from {base} (Python {base_version}); vLLM {} and its requirements, about 4 GB \
         to download the first time (pip's cache: {})",
        env.dir.display(),
        VLLM.version,
        env.cache.join("pip").display()
    );
    remove_dir(&env.dir)?;
    fs::create_dir_all(&env.cache)
        .map_err(|e| io_error(format!("cannot create {}", env.cache.display()), e))?;
    create_venv(&base, &env.dir)?;
    let installing = env.dir.join(INSTALLING);
    fs::write(
        &installing,
        "an install by `cargo xtask vllm-env` began; it is complete once pdkv-vllm-env.txt exists\n",
    )
    .map_err(|e| io_error(format!("cannot write {}", installing.display()), e))?;
    let log = env.dir.join(PIP_LOG);
    let mut wheel_path = wheel_file(env, wheel, &log)?;
    let (mut sha256, mut metadata_text) = wheel_info(&env.python, &wheel_path, wheel.sha256)?;
    if sha256 != wheel.sha256 {
        // pip checked the file's hash when it downloaded it; a cached file that changed since
        // (truncated, replaced) is downloaded again, once.
        eprintln!(
            "  the cached {} has sha256 {sha256}, not its pin's; downloading it again",
            file_name(&wheel_path)
        );
        fs::remove_file(&wheel_path)
            .map_err(|e| io_error(format!("cannot remove {}", wheel_path.display()), e))?;
        wheel_path = wheel_file(env, wheel, &log)?;
        (sha256, metadata_text) = wheel_info(&env.python, &wheel_path, wheel.sha256)?;
    }
    if sha256 != wheel.sha256 {
        return Err(VllmEnvError::HashMismatch {
            file: wheel_path,
            found: sha256,
            expected: wheel.sha256.to_owned(),
        });
    }
    metadata::check_requires_python(&metadata_text, VLLM.requires_python).map_err(VllmEnvError::Metadata)?;
    let reqs = metadata::requirements(&metadata_text, &excluded_names()).map_err(VllmEnvError::Metadata)?;
    let reqs_file = env.dir.join(REQUIREMENTS);
    fs::write(&reqs_file, requirements_file(&reqs))
        .map_err(|e| io_error(format!("cannot write {}", reqs_file.display()), e))?;
    eprintln!("  pip install --no-deps {} ...", file_name(&wheel_path));
    let took = run_logged(
        "pip install of the vLLM wheel",
        pip(env, "install").args(["--no-deps", "--only-binary", ":all:"]).arg(&wheel_path),
        &log,
    )
    .map_err(VllmEnvError::PipStep)?;
    eprintln!("  done in {:.1} s", took.as_secs_f64());
    eprintln!(
        "  pip install of vLLM's {} requirements ({} excluded: {}) ...",
        reqs.len(),
        EXCLUDED.len(),
        excluded_names().join(", ")
    );
    let took = run_logged(
        "pip install of vLLM's requirements",
        pip(env, "install").args(["--only-binary", ":all:", "--requirement"]).arg(&reqs_file),
        &log,
    )
    .map_err(VllmEnvError::PipStep)?;
    eprintln!("  done in {:.1} s; checking every requirement and `import vllm` ...", took.as_secs_f64());
    let packages = verify(env).map_err(|detail| VllmEnvError::Check { dir: env.dir.clone(), detail })?;
    write_marker(env, pin, &base_version, Origin::Installed, &packages)
        .map_err(|detail| VllmEnvError::Check { dir: env.dir.clone(), detail })?;
    fs::remove_file(&installing)
        .map_err(|e| io_error(format!("cannot remove {}", installing.display()), e))?;
    eprintln!(
        "vllm-env: {} ready ({} packages) in {:.1} s",
        env.dir.display(),
        packages.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `python -m pip <command>` of the venv (`install`, `download`), quiet about itself, with its
/// cache under `<cache>/pip`.
pub fn pip(env: &VllmEnv, command: &str) -> Command {
    let mut cmd = Command::new(&env.python);
    cmd.args(["-m", "pip", command, "--disable-pip-version-check", "--no-input", "--progress-bar", "off"])
        .arg("--cache-dir")
        .arg(env.cache.join("pip"));
    cmd
}

/// The first of [`BASE_PYTHONS`] that starts and meets the wheel's Requires-Python, with its
/// version.
fn base_python() -> Result<(String, String), VllmEnvError> {
    let mut tried = Vec::new();
    for program in BASE_PYTHONS {
        let out = steps::python(Path::new(program), PYTHON_INFO, &[]);
        let version = match &out {
            Ok(text) => text.lines().next().unwrap_or_default().trim().to_owned(),
            Err(_) => {
                tried.push(format!("{program}: does not start"));
                continue;
            }
        };
        match metadata::python_meets(&version, VLLM.requires_python) {
            Ok(true) => return Ok((program.to_string(), version)),
            Ok(false) => tried.push(format!("{program}: Python {version}")),
            Err(e) => tried.push(format!("{program}: {e}")),
        }
    }
    Err(VllmEnvError::NoPython { tried })
}

/// `python -m venv` with pip, else `--without-pip` and pip from its pinned wheel (Debian's
/// python3 without python3-venv), as target/pyenv is made.
fn create_venv(base: &str, dir: &Path) -> Result<(), VllmEnvError> {
    let venv = |extra: &[&str]| {
        let out = Command::new(base).args(["-m", "venv"]).args(extra).arg(dir).output();
        match out {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!("{}\n{}", out.status, String::from_utf8_lossy(&out.stderr).trim())),
            Err(e) => Err(format!("cannot run {base}: {e}")),
        }
    };
    let with_pip = match venv(&[]) {
        Ok(()) if steps::python(&venv_python(dir), "import pip", &[]).is_ok() => return Ok(()),
        Ok(()) => return crate::pyenv::bootstrap_pip(dir).map_err(VllmEnvError::PipBootstrap),
        Err(e) => e,
    };
    remove_dir(dir)?;
    eprintln!("  `{base} -m venv` failed; trying `--without-pip` and pip from its wheel ...");
    venv(&["--without-pip"]).map_err(|without_pip| VllmEnvError::Venv {
        program: base.to_owned(),
        detail: format!("with pip: {with_pip}\nwithout pip: {without_pip}"),
    })?;
    crate::pyenv::bootstrap_pip(dir).map_err(VllmEnvError::PipBootstrap)
}

/// The pinned wheel in `<cache>/wheels/`, downloaded with `pip download --require-hashes` when
/// it is not there yet (into a scratch folder, moved in once pip checked its hash).
fn wheel_file(env: &VllmEnv, wheel: &Wheel, log: &Path) -> Result<PathBuf, VllmEnvError> {
    let wheels = env.cache.join("wheels");
    let path = wheels.join(VLLM.file_name(wheel));
    if path.is_file() {
        eprintln!("  the vLLM wheel is cached: {}", path.display());
        return Ok(path);
    }
    let partial = wheels.join("download.partial");
    remove_dir(&partial)?;
    fs::create_dir_all(&partial).map_err(|e| io_error(format!("cannot create {}", partial.display()), e))?;
    let reqs = partial.join("requirements.txt");
    fs::write(&reqs, VLLM.requirements())
        .map_err(|e| io_error(format!("cannot write {}", reqs.display()), e))?;
    eprintln!("  pip download vllm=={} --no-deps --require-hashes (about 240 MB) ...", VLLM.version);
    let took = run_logged(
        "pip download of the vLLM wheel",
        pip(env, "download")
            .args(["--no-deps", "--only-binary", ":all:", "--require-hashes", "--dest"])
            .arg(&partial)
            .arg("--requirement")
            .arg(&reqs),
        log,
    )
    .map_err(VllmEnvError::PipStep)?;
    let fetched = partial.join(VLLM.file_name(wheel));
    fs::rename(&fetched, &path)
        .map_err(|e| io_error(format!("cannot move {} to {}", fetched.display(), path.display()), e))?;
    let _ = fs::remove_dir_all(&partial);
    eprintln!("  downloaded in {:.1} s", took.as_secs_f64());
    Ok(path)
}

/// A wheel's sha256 and, if it is `expected`, its METADATA, read by [`WHEEL_INFO`].
fn wheel_info(python: &Path, wheel: &Path, expected: &str) -> Result<(String, String), VllmEnvError> {
    let out = steps::python(python, WHEEL_INFO, &[&wheel.to_string_lossy(), expected])
        .map_err(|detail| VllmEnvError::Wheel { file: wheel.to_owned(), detail })?;
    let (sha256, metadata_text) = out.split_once('\n').unwrap_or((&out, ""));
    Ok((sha256.trim().to_owned(), metadata_text.to_owned()))
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn remove_dir(dir: &Path) -> Result<(), VllmEnvError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(format!("cannot remove {}", dir.display()), e)),
    }
}

fn io_error(what: String, error: io::Error) -> VllmEnvError {
    VllmEnvError::Io { what, error }
}
