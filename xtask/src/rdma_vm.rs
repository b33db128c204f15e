//! `cargo xtask rdma-vm`: runs the RDMA verbs tests for real, on Soft-RoCE (`rdma_rxe`) inside a
//! qemu guest, since the host kernel may have no RDMA support at all.
//!
//! Steps: check the host tools (each missing one is named with its Debian package); build the
//! `pdkv-rdma` test binary with `--features rdma` (and `pdkv` with `--features rdma` when the
//! root package has that feature); fetch Debian's kernel image and `busybox-static` with
//! `apt-get download` into `target/rdma-vm/` (unpacked once, reused later); build a gzipped
//! cpio (newc) initramfs holding busybox, the RDMA kernel modules, the `rdma` tool, the binaries,
//! every shared library they load (ldd), the rxe verbs provider and its driver file; boot it in
//! `qemu-system-x86_64` under TCG; and stream the guest console here.
//!
//! The guest's `/init` mounts proc, sys and dev, loads the modules in [`MODULES`] order, brings
//! `lo` up, adds `rxe0` on it, then runs each guest command with `PDKV_RDMA_REQUIRED=1` (so a
//! missing device fails the tests instead of skipping them) and prints a [`MARKER`] line with
//! its exit status, then powers off. The task succeeds only if every command's marker reports
//! status 0 before the [`TIMEOUT`].
//!
//! Guest commands: the test binary filtered to `verbs`, then [`CLUSTER_COMMANDS`], each run as
//! `/bin/pdkv ARGS...`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// `pdkv` argument lists run in the guest after the verbs tests, as `/bin/pdkv ARGS...`. They
/// need the root package's `rdma` feature (then `pdkv` is built with it and copied to the guest).
const CLUSTER_COMMANDS: &[&[&str]] = &[
    &["cluster", "1P_TP4:1D_TP8", "--requests", "16", "--transport", "rdma"],
    &["cluster", "1P_DP2:1D_TP2", "--requests", "16", "--transport", "rdma"],
    // A prefill process killed under RDMA: its group's requests fail, the others finish, the
    // reaper frees the dead rank's transfers, nothing hangs.
    &[
        "cluster",
        "1P_DP2TP2:1D_TP4",
        "--requests",
        "16",
        "--transport",
        "rdma",
        "--kill",
        "P0.dp0.tp1",
        "--kill-after",
        "4",
        "--handshake-timeout-ms",
        "2000",
        "--transfer-timeout-ms",
        "8000",
        "--defer-timeout-ms",
        "9000",
    ],
];

/// The test-name filter for the `pdkv-rdma` test binary in the guest.
const TEST_FILTER: &str = "verbs";

/// Kernel modules, in load order (each depends only on earlier ones).
const MODULES: [&str; 12] = [
    "crc32_generic",
    "crc32-pclmul",
    "configfs",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "ib_core",
    "ib_uverbs",
    "iw_cm",
    "ib_cm",
    "rdma_cm",
    "rdma_ucm",
    "rdma_rxe",
];

/// The Debian package whose dependency names the kernel image package.
const KERNEL_META_PACKAGE: &str = "linux-image-amd64";

/// How long the guest may run, boot to power-off; qemu is killed after that.
const TIMEOUT: Duration = Duration::from_secs(600);

/// Prefix of the guest's status lines: `@@pdkv-rdma-vm@@ end INDEX status CODE`.
const MARKER: &str = "@@pdkv-rdma-vm@@";

/// Where the guest finds the rxe verbs provider, and the driver file naming it.
const PROVIDER_DIR: &str = "/usr/lib/x86_64-linux-gnu/libibverbs";
const RXE_DRIVER_FILE: &str = "/etc/libibverbs.d/rxe.driver";

/// Runs the task; prints why on failure.
pub fn run() -> ExitCode {
    let started = Instant::now();
    match run_inner() {
        Ok(vm_time) => {
            println!(
                "rdma-vm: all guest commands passed (guest {:.1} s, total {:.1} s)",
                vm_time.as_secs_f64(),
                started.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rdma-vm: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One command the guest runs.
struct GuestCommand {
    argv: Vec<String>,
}

fn run_inner() -> Result<Duration, String> {
    let meta = Metadata::read()?;
    let tools = HostTools::check()?;
    let vm_dir = meta.target_dir.join("rdma-vm");
    fs::create_dir_all(&vm_dir).map_err(|e| format!("cannot create {}: {e}", vm_dir.display()))?;

    let tests = build_tests(&meta.workspace_root)?;
    let pdkv = if meta.root_has_rdma_feature {
        Some(build_pdkv(&meta.workspace_root)?)
    } else if !CLUSTER_COMMANDS.is_empty() {
        return Err("CLUSTER_COMMANDS is not empty but the root package `pdkv` has no `rdma` feature".into());
    } else {
        None
    };

    let kernel = fetch_kernel(&vm_dir)?;
    let busybox = fetch_busybox(&vm_dir)?;

    let mut commands = vec![GuestCommand { argv: vec!["/bin/pdkv-rdma-tests".into(), TEST_FILTER.into()] }];
    for args in CLUSTER_COMMANDS {
        let mut argv = vec!["/bin/pdkv".to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        commands.push(GuestCommand { argv });
    }

    let mut cpio = Cpio::default();
    for dir in ["/dev", "/proc", "/sys", "/tmp", "/etc", "/root"] {
        cpio.dir(dir);
    }
    cpio.file("/bin/busybox", &read(&busybox)?, 0o755);
    cpio.file("/init", guest_init(&commands).as_bytes(), 0o755);
    for name in MODULES {
        let module = kernel.module(name)?;
        cpio.file(&format!("/lib/modules/{name}.ko"), &module, 0o644);
    }
    // Dynamically linked programs, and the libraries everything loads.
    let mut libs: BTreeSet<PathBuf> = BTreeSet::new();
    let programs: Vec<(&str, PathBuf)> = [
        Some(("/bin/pdkv-rdma-tests", tests)),
        pdkv.map(|p| ("/bin/pdkv", p)),
        Some(("/bin/rdma", tools.rdma.clone())),
    ]
    .into_iter()
    .flatten()
    .collect();
    for (guest_path, host_path) in &programs {
        cpio.file(guest_path, &tools.stripped(host_path)?, 0o755);
        libs.extend(ldd(host_path)?);
    }
    libs.extend(ldd(&tools.rxe_provider)?);
    let provider_name = tools.rxe_provider.file_name().map(|n| n.to_string_lossy().into_owned());
    let provider_name = provider_name.ok_or("the rxe provider path has no file name")?;
    cpio.file(&format!("{PROVIDER_DIR}/{provider_name}"), &read(&tools.rxe_provider)?, 0o755);
    cpio.file(RXE_DRIVER_FILE, &read(Path::new(RXE_DRIVER_FILE))?, 0o644);
    for lib in &libs {
        cpio.file(&lib.to_string_lossy(), &read(lib)?, 0o755);
    }
    let image = cpio.finish();
    let initrd = vm_dir.join("initramfs.cpio.gz");
    gzip(&image, &initrd)?;
    println!(
        "rdma-vm: initramfs {} ({:.1} MB, {:.1} MB unpacked), kernel {}",
        initrd.display(),
        fs::metadata(&initrd).map(|m| m.len() as f64 / 1e6).unwrap_or(0.0),
        image.len() as f64 / 1e6,
        kernel.version
    );
    boot(&tools.qemu, &kernel.vmlinuz, &initrd, commands.len())
}

/// What `cargo metadata` says about the workspace.
struct Metadata {
    workspace_root: PathBuf,
    target_dir: PathBuf,
    root_has_rdma_feature: bool,
}

impl Metadata {
    fn read() -> Result<Metadata, String> {
        let out = Command::new(env!("CARGO"))
            .args(["metadata", "--no-deps", "--format-version", "1"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
        if !out.status.success() {
            return Err(format!("cargo metadata failed: {}", out.status));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: bad JSON: {e}"))?;
        let path =
            |key: &str| v[key].as_str().map(PathBuf::from).ok_or(format!("cargo metadata has no {key}"));
        let root_has_rdma_feature = v["packages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["name"] == "pdkv")
            .any(|p| p["features"].get("rdma").is_some());
        Ok(Metadata {
            workspace_root: path("workspace_root")?,
            target_dir: path("target_directory")?,
            root_has_rdma_feature,
        })
    }
}

/// Host programs and files the task needs.
struct HostTools {
    qemu: PathBuf,
    rdma: PathBuf,
    rxe_provider: PathBuf,
    strip: Option<PathBuf>,
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| p.is_file())
}

impl HostTools {
    /// Finds everything, or names every missing piece with the Debian package that has it.
    fn check() -> Result<HostTools, String> {
        let mut missing: Vec<String> = Vec::new();
        let mut need = |program: &str, package: &str| {
            let found = find_in_path(program);
            if found.is_none() {
                missing.push(format!("`{program}` (Debian package {package})"));
            }
            found
        };
        let qemu = need("qemu-system-x86_64", "qemu-system-x86");
        let rdma = need("rdma", "iproute2");
        for (program, package) in [
            ("apt-get", "apt"),
            ("apt-cache", "apt"),
            ("dpkg-deb", "dpkg"),
            ("ldd", "libc-bin"),
            ("gzip", "gzip"),
            ("pkg-config", "pkg-config"),
        ] {
            need(program, package);
        }
        // What rdma-sys's build script needs: the verbs headers through pkg-config, and
        // libclang for bindgen.
        let pkg_config = find_in_path("pkg-config");
        for (lib, package) in [("libibverbs", "libibverbs-dev"), ("librdmacm", "librdmacm-dev")] {
            let Some(pkg_config) = &pkg_config else { break };
            let ok = Command::new(pkg_config).args(["--exists", lib]).status().is_ok_and(|s| s.success());
            if !ok {
                missing.push(format!("pkg-config's `{lib}` (Debian package {package})"));
            }
        }
        if !libclang_present() {
            missing.push("libclang, for rdma-sys's bindgen (Debian package libclang-dev)".into());
        }
        let rxe_provider = fs::read_dir(PROVIDER_DIR).ok().and_then(|dir| {
            dir.filter_map(Result::ok).map(|e| e.path()).find(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with("librxe-rdmav") && n.ends_with(".so")
                })
            })
        });
        if rxe_provider.is_none() {
            missing.push(format!(
                "the rxe verbs provider {PROVIDER_DIR}/librxe-rdmav*.so (Debian package ibverbs-providers)"
            ));
        }
        if !Path::new(RXE_DRIVER_FILE).is_file() {
            missing.push(format!("{RXE_DRIVER_FILE} (Debian package ibverbs-providers)"));
        }
        match (qemu, rdma, rxe_provider) {
            (Some(qemu), Some(rdma), Some(rxe_provider)) if missing.is_empty() => {
                Ok(HostTools { qemu, rdma, rxe_provider, strip: find_in_path("strip") })
            }
            _ => Err(format!("missing on this host: {}", missing.join(", "))),
        }
    }

    /// The program's bytes, without debug info when `strip` (binutils) is present: the
    /// guest unpacks the initramfs under emulation, so size is time.
    fn stripped(&self, path: &Path) -> Result<Vec<u8>, String> {
        let Some(strip) = &self.strip else { return read(path) };
        let tmp = std::env::temp_dir().join(format!("pdkv-rdma-vm-strip-{}", std::process::id()));
        let status = Command::new(strip).arg("--strip-debug").arg("-o").arg(&tmp).arg(path).status();
        let bytes = match status {
            Ok(s) if s.success() => read(&tmp),
            _ => read(path),
        };
        let _ = fs::remove_file(&tmp);
        bytes
    }
}

fn libclang_present() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let is_libclang = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libclang"));
    let has = |dir: &Path| {
        fs::read_dir(dir).is_ok_and(|d| d.filter_map(Result::ok).any(|e| is_libclang(&e.path())))
    };
    if has(Path::new("/usr/lib/x86_64-linux-gnu")) {
        return true;
    }
    fs::read_dir("/usr/lib").is_ok_and(|d| {
        d.filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("llvm-"))
            .any(|e| has(&e.path().join("lib")))
    })
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Runs cargo with JSON messages (diagnostics rendered to the terminal) and returns the
/// executables of the artifacts `pick` accepts.
fn cargo_executables(
    root: &Path,
    args: &[&str],
    pick: impl Fn(&serde_json::Value) -> bool,
) -> Result<Vec<PathBuf>, String> {
    eprintln!("$ cargo {}", args.join(" "));
    let out = Command::new(env!("CARGO"))
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo {} failed ({}); building rdma-sys needs libibverbs-dev, librdmacm-dev, libclang-dev \
             and pkg-config",
            args.join(" "),
            out.status
        ));
    }
    let mut found = Vec::new();
    for line in out.stdout.split(|&b| b == b'\n') {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else { continue };
        if v["reason"] == "compiler-artifact" && pick(&v) {
            if let Some(exe) = v["executable"].as_str() {
                found.push(PathBuf::from(exe));
            }
        }
    }
    Ok(found)
}

fn build_tests(root: &Path) -> Result<PathBuf, String> {
    let args = ["test", "-p", "pdkv-rdma", "--features", "rdma", "--lib", "--no-run"];
    let exes = cargo_executables(root, &args, |v| {
        v["target"]["name"] == "pdkv_rdma" && v["profile"]["test"] == true
    })?;
    exes.into_iter().next().ok_or("cargo built no pdkv-rdma test binary".into())
}

fn build_pdkv(root: &Path) -> Result<PathBuf, String> {
    let args = ["build", "-p", "pdkv", "--features", "rdma", "--bin", "pdkv"];
    let exes = cargo_executables(root, &args, |v| {
        v["target"]["name"] == "pdkv"
            && v["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bin"))
    })?;
    exes.into_iter().next().ok_or("cargo built no pdkv binary".into())
}

/// Downloads `package` into `vm_dir/debs` (unless a .deb of it is there) and unpacks it into
/// `dest` (unless `dest` exists).
fn fetch_deb(vm_dir: &Path, package: &str, dest: &Path) -> Result<(), String> {
    if dest.is_dir() {
        return Ok(());
    }
    let debs = vm_dir.join("debs");
    fs::create_dir_all(&debs).map_err(|e| format!("cannot create {}: {e}", debs.display()))?;
    let find = || {
        fs::read_dir(&debs).ok().and_then(|d| {
            d.filter_map(Result::ok).map(|e| e.path()).find(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with(&format!("{package}_")) && n.ends_with(".deb")
                })
            })
        })
    };
    let deb = match find() {
        Some(deb) => deb,
        None => {
            eprintln!("$ apt-get download {package}");
            let status = Command::new("apt-get")
                .args(["download", package])
                .current_dir(&debs)
                .status()
                .map_err(|e| format!("cannot run apt-get: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "apt-get download {package} failed ({status}); run `apt-get update` first if the \
                     package lists are missing"
                ));
            }
            find().ok_or(format!("apt-get download {package} left no .deb in {}", debs.display()))?
        }
    };
    let partial = dest.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&partial)
        .status()
        .map_err(|e| format!("cannot run dpkg-deb: {e}"))?;
    if !status.success() {
        return Err(format!("dpkg-deb -x {} failed: {status}", deb.display()));
    }
    fs::rename(&partial, dest).map_err(|e| format!("cannot rename {}: {e}", partial.display()))
}

/// An unpacked kernel image package.
struct Kernel {
    version: String,
    vmlinuz: PathBuf,
    modules: PathBuf,
}

impl Kernel {
    /// A module's bytes, decompressed if the package ships it compressed.
    fn module(&self, name: &str) -> Result<Vec<u8>, String> {
        let want = name.replace('-', "_");
        let mut stack = vec![self.modules.join("kernel")];
        while let Some(dir) = stack.pop() {
            let entries = fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let file = entry.file_name().to_string_lossy().into_owned();
                for (ext, tool, package) in
                    [(".ko", None, ""), (".ko.xz", Some("xz"), "xz-utils"), (".ko.zst", Some("zstd"), "zstd")]
                {
                    let Some(stem) = file.strip_suffix(ext) else { continue };
                    if stem.replace('-', "_") != want {
                        continue;
                    }
                    let Some(tool) = tool else { return read(&path) };
                    let out = Command::new(tool)
                        .args(["-d", "-c"])
                        .arg(&path)
                        .output()
                        .map_err(|e| format!("cannot run {tool} (Debian package {package}): {e}"))?;
                    if !out.status.success() {
                        return Err(format!("{tool} -d {} failed: {}", path.display(), out.status));
                    }
                    return Ok(out.stdout);
                }
            }
        }
        Err(format!("kernel module {name} not found under {}", self.modules.display()))
    }
}

/// The kernel image package the meta package depends on, e.g. `linux-image-6.1.0-57-amd64`.
fn kernel_package() -> Result<String, String> {
    let out = Command::new("apt-cache")
        .args(["depends", KERNEL_META_PACKAGE])
        .output()
        .map_err(|e| format!("cannot run apt-cache: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_string)
        .ok_or(format!(
            "apt-cache depends {KERNEL_META_PACKAGE} names no kernel image; run `apt-get update` first"
        ))
}

fn fetch_kernel(vm_dir: &Path) -> Result<Kernel, String> {
    let dest = vm_dir.join("kernel");
    if !dest.is_dir() {
        fetch_deb(vm_dir, &kernel_package()?, &dest)?;
    }
    let boot = dest.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .map_err(|e| format!("cannot list {}: {e}", boot.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .ok_or(format!("no vmlinuz-* in {}", boot.display()))?;
    let version = vmlinuz
        .file_name()
        .map(|n| n.to_string_lossy().trim_start_matches("vmlinuz-").to_string())
        .unwrap_or_default();
    let modules = dest.join("lib/modules").join(&version);
    if !modules.is_dir() {
        return Err(format!("no modules for {version} in {}", modules.display()));
    }
    Ok(Kernel { version, vmlinuz, modules })
}

fn fetch_busybox(vm_dir: &Path) -> Result<PathBuf, String> {
    let dest = vm_dir.join("busybox");
    fetch_deb(vm_dir, "busybox-static", &dest)?;
    let bin = dest.join("bin/busybox");
    if !bin.is_file() {
        return Err(format!("busybox-static has no {}", bin.display()));
    }
    Ok(bin)
}

/// The shared libraries `path` loads (with the dynamic loader), as ldd reports them.
fn ldd(path: &Path) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("ldd").arg(path).output().map_err(|e| format!("cannot run ldd: {e}"))?;
    if !out.status.success() {
        return Err(format!("ldd {} failed: {}", path.display(), String::from_utf8_lossy(&out.stderr)));
    }
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim();
        let lib = match line.split_once("=> ") {
            Some((name, rest)) => {
                let target = rest.split(" (").next().unwrap_or("").trim();
                if target == "not found" {
                    return Err(format!("{} needs {}, which is not installed", path.display(), name.trim()));
                }
                target
            }
            None => line.split(" (").next().unwrap_or("").trim(),
        };
        if lib.starts_with('/') {
            libs.push(PathBuf::from(lib));
        }
    }
    Ok(libs)
}

/// Quotes a word for the guest's shell.
fn sh_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The guest's `/init`.
fn guest_init(commands: &[GuestCommand]) -> String {
    let mut s = String::new();
    s.push_str("#!/bin/busybox sh\n");
    s.push_str("/bin/busybox --install -s /bin\n");
    s.push_str("export PATH=/bin\n");
    s.push_str("mount -t proc proc /proc\nmount -t sysfs sysfs /sys\nmount -t devtmpfs devtmpfs /dev\n");
    s.push_str("echo \"rdma-vm: guest up, kernel $(uname -r)\"\n");
    for m in MODULES {
        s.push_str(&format!("insmod /lib/modules/{m}.ko || echo \"rdma-vm: insmod {m} failed\"\n"));
    }
    s.push_str("ip link set lo up\n");
    s.push_str("rdma link add rxe0 type rxe netdev lo || echo 'rdma-vm: rdma link add failed'\n");
    s.push_str("rdma link show\n");
    // TERM=dumb: the serial console is a terminal, but a log; progress bars would flood it.
    s.push_str("export PDKV_RDMA_REQUIRED=1 RUST_BACKTRACE=1 HOME=/root TMPDIR=/tmp TERM=dumb\n");
    s.push_str("export LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu\n");
    s.push_str("cd /tmp\n");
    for (i, c) in commands.iter().enumerate() {
        let argv: Vec<String> = c.argv.iter().map(|a| sh_quote(a)).collect();
        let line = argv.join(" ");
        s.push_str(&format!("echo {}\n", sh_quote(&format!("{MARKER} run {i}: {}", c.argv.join(" ")))));
        s.push_str(&format!("{line}\nstatus=$?\n"));
        s.push_str(&format!("echo \"{MARKER} end {i} status $status\"\n"));
    }
    s.push_str(&format!("echo \"{MARKER} done\"\n"));
    s.push_str("poweroff -f\n");
    s
}

/// A cpio archive in the `newc` format, as the kernel unpacks an initramfs.
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    ino: u32,
    dirs: BTreeSet<String>,
    files: BTreeSet<String>,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let name = name.trim_start_matches('/');
        let fields = [self.ino, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, 0, 0, name.len() as u32 + 1, 0];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.out.len() & 3 != 0 {
            self.out.push(0);
        }
    }

    /// Adds a directory and its missing parents.
    fn dir(&mut self, path: &str) {
        let mut at = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            at.push('/');
            at.push_str(part);
            if self.dirs.insert(at.clone()) {
                let name = at.clone();
                self.entry(&name, 0o040_755, &[]);
            }
        }
    }

    /// Adds a regular file (and its missing parent directories); a path added twice keeps the
    /// first.
    fn file(&mut self, path: &str, data: &[u8], perm: u32) {
        if !self.files.insert(path.to_string()) {
            return;
        }
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entry(path, 0o100_000 | perm, data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }
}

fn gzip(data: &[u8], dest: &Path) -> Result<(), String> {
    let file = fs::File::create(dest).map_err(|e| format!("cannot create {}: {e}", dest.display()))?;
    let mut child = Command::new("gzip")
        .arg("-6")
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .map_err(|e| format!("cannot run gzip: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("gzip has no stdin")?;
    let written = stdin.write_all(data);
    drop(stdin);
    let status = child.wait().map_err(|e| format!("gzip: {e}"))?;
    written.map_err(|e| format!("gzip: {e}"))?;
    if !status.success() {
        return Err(format!("gzip failed: {status}"));
    }
    Ok(())
}

/// What the console said about the guest commands.
#[derive(Default)]
struct Outcome {
    statuses: BTreeMap<usize, String>,
    done: bool,
}

/// Boots the guest, streams its console, and checks every command's marker.
fn boot(qemu: &Path, vmlinuz: &Path, initrd: &Path, commands: usize) -> Result<Duration, String> {
    let mut cmd = Command::new(qemu);
    cmd.args(["-m", "2G", "-smp", "2", "-nographic", "-no-reboot", "-accel", "tcg", "-cpu", "max"])
        .args(["-nic", "none"])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!("$ {cmd:?}");
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", qemu.display()))?;
    let stdout = child.stdout.take().ok_or("qemu has no stdout")?;
    let (tx, rx) = mpsc::channel();
    let reader = thread::spawn(move || {
        let mut outcome = Outcome::default();
        let mut lines = BufReader::new(stdout);
        let mut line = Vec::new();
        let mut out = std::io::stdout();
        loop {
            line.clear();
            match lines.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let _ = out.write_all(&line);
            let _ = out.flush();
            let text = String::from_utf8_lossy(&line);
            if let Some(at) = text.find(MARKER) {
                let rest = text[at + MARKER.len()..].trim();
                let words: Vec<&str> = rest.split_whitespace().collect();
                match words.as_slice() {
                    ["end", i, "status", code] => {
                        if let Ok(i) = i.parse() {
                            outcome.statuses.insert(i, code.to_string());
                        }
                    }
                    ["done"] => outcome.done = true,
                    _ => {}
                }
            }
        }
        let _ = tx.send(());
        outcome
    });
    let deadline = started + TIMEOUT;
    let mut timed_out = false;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for qemu: {e}")),
        }
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        let _ = rx.recv_timeout(Duration::from_millis(200));
    }
    let elapsed = started.elapsed();
    let outcome = reader.join().map_err(|_| "the console reader panicked")?;
    println!("rdma-vm: guest ran {:.1} s", elapsed.as_secs_f64());
    if timed_out {
        return Err(format!("the guest did not finish within {} s; qemu was killed", TIMEOUT.as_secs()));
    }
    let mut failures = Vec::new();
    for i in 0..commands {
        match outcome.statuses.get(&i).map(String::as_str) {
            Some("0") => {}
            Some(code) => failures.push(format!("guest command {i} exited with status {code}")),
            None => failures.push(format!("guest command {i} reported no status")),
        }
    }
    if !outcome.done && failures.is_empty() {
        failures.push("the guest did not reach the end of its script".into());
    }
    if failures.is_empty() {
        Ok(elapsed)
    } else {
        Err(failures.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_newc_layout() {
        let mut c = Cpio::default();
        c.file("/bin/x", b"abc", 0o755);
        let out = c.finish();
        // Entries: /bin, /bin/x, the trailer; each header is 110 bytes and 4-aligned.
        assert!(out.starts_with(b"070701"));
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        assert_eq!(text.matches("070701").count(), 3);
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("TRAILER!!!\0"));
    }

    #[test]
    fn init_script_quotes_and_marks() {
        let cmds = [GuestCommand { argv: vec!["/bin/pdkv".into(), "it's".into()] }];
        let s = guest_init(&cmds);
        assert!(s.contains("'/bin/pdkv' 'it'\\''s'\nstatus=$?\n"), "{s}");
        assert!(s.contains(&format!("echo \"{MARKER} end 0 status $status\"")), "{s}");
        assert!(s.trim_end().ends_with("poweroff -f"));
    }
}
