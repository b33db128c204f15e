//! `cargo xtask`: project automation (the test command, tidy checks, generated files, benchmarks,
//! the CI sequence).

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

mod bench;
mod cluster_fuzz;
#[cfg(test)]
mod core_lints;
mod crate_order;
mod moriio;
mod pyenv;
mod rdma_vm;
mod restarts;
mod results;
mod suite;
mod tidy;
mod tree;
mod vllm_env;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  test [ARGS]...
           the test suite: sets up target/pyenv (a Python virtual environment with the pinned
           pyzmq, msgpack and msgspec of the conformance tests; PDKV_PYTHON=<python> uses that one
           instead), runs `cargo test --workspace --no-fail-fast [ARGS]...` and prints the total
           over every test run as its last line
  tidy     check the source rules (core purity, //! headers, no disabled tests)
  codegen  regenerate the checked-in state-machine tables and Graphviz files under docs/machines
  bench [--record]
           benchmarks (release build): simulator events/s, explore seeds/s (one request and a
           search of 2P_DP8EP:1D_TP8), model-checker states/s, TCP data-plane throughput against
           a plain socket copy, control-plane release round trip, pdkv run with its report
           against the engine alone, the memory curve of a 1,024-GPU deployment (10k, 100k, 1M
           requests; a few minutes); each figure against bench/figures.txt with the ratio,
           --record writes them there
  calibrate [--fit]
           the cost model: fitting table (docs/reference.md) and held-out validation table
           (docs/calibration.md); --fit first fits the free constants on the fitting points alone
           (sim/src/fit.rs) and prints them with both tables at the fitted values
  catch      seeds to the first catch of each legacy option, full workload and search (docs/verification.md)
             (release build)
  gallery  rerun the commands of docs/gallery/gallery.txt (release build) and copy their
           pictures into docs/gallery, where the README shows them
  results record|compare DIR
           the result.json of every built-in scenario and of the README's main command
           (release build), recorded into DIR or compared byte for byte with it: record
           before a refactor, compare after
  moriio-conformance [--release V | --all-releases] [--max-ranks N]
           pdkv against vLLM's own MoRIIO code from a vLLM release's wheel (the newest unless
           --release names another; downloaded once, hash-checked, into
           target/vllm-<version>/): every pure rule over every layout up to 16 ranks a side,
           and vLLM's wire code against itself; prints the compatibility matrix (`cargo xtask
           moriio-conformance --help` says more)
  vllm-env [--print-python]
           the venv in which pdkv's vLLM plugin is tested on a CPU: vLLM 0.34.0 (pinned wheel)
           and its requirements without the GPU- and media-only ones, made once under
           $PDKV_CACHE_DIR, $XDG_CACHE_HOME/pdkv or ~/.cache/pdkv (about 4 GB the first time)
           and reused; --print-python prints its Python (`cargo xtask vllm-env --help` says more)
  python-wheel
           builds the pdkv wheel from python/ with the pinned maturin into target/wheels and
           installs it into that venv
  vllm-test [ARGS]...
           vllm-env, python-wheel, then `python -m pdkv_vllm_test.run ARGS...` with the venv's
           Python and PYTHONPATH=tests/vllm (until tests/vllm/pdkv_vllm_test/ exists it says
           that no test ran, and succeeds)
  check-model  bounded model checking of the protocol nodes on tiny deployments
  rdma-vm  the RDMA verbs tests (feature `rdma`) in a qemu guest with Soft-RoCE (rdma_rxe)
  cluster-fuzz [--for 60s] [--seed N] [--max-runs N] [--legacy NAME]...
           random real clusters (`pdkv cluster`, release build) with random faults: the
           cluster's own kills, dropped releases and lost, duplicated or delayed control
           messages (dispatches delayed across restarts too), outside SIGKILLs and SIGSTOPs of
           connectors; every run is judged by invariants, the first failure is saved under
           target/cluster-fuzz/ with its replay command
  cluster-restarts [--runs N] [--legacy NAME]
           real clusters (`pdkv cluster`, release build) in which a prefill rank is killed under
           load (256 in flight) and restarted after 0 ms to 3 s, N runs (default 20) on each of
           two deployments; each run must verify every byte, report no protocol error, excuse
           every failure and reaping by the kill and hold nothing at the end
  ci       the Rust part of CI without installing system packages: fmt check, clippy -D warnings
           (also with every feature, which needs the Debian packages .ci/run installs), the test
           suite (`cargo xtask test`); `.ci/run` adds the packages and `cargo xtask rdma-vm`";

fn main() -> ExitCode {
    let task = std::env::args().nth(1);
    match task.as_deref() {
        Some("tidy") => match tidy::check(&workspace_root()) {
            Ok(files) => {
                println!("tidy: {files} files ok");
                ExitCode::SUCCESS
            }
            Err(problems) => {
                for p in &problems {
                    eprintln!("{p}");
                }
                eprintln!("tidy: {} problem(s)", problems.len());
                ExitCode::FAILURE
            }
        },
        Some("test") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            suite::run(&workspace_root(), &args)
        }
        Some("ci") => ci(),
        Some("codegen") => codegen(),
        Some("check-model") => check_model(),
        Some("rdma-vm") => rdma_vm::run(),
        Some("cluster-fuzz") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            cluster_fuzz::run(&args, &workspace_root())
        }
        Some("cluster-restarts") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            restarts::run(&args, &workspace_root())
        }
        Some("gallery") => gallery(),
        Some("moriio-conformance") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            moriio::run(&args, &workspace_root())
        }
        Some("vllm-env") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            vllm_env::run_env(&args, &workspace_root())
        }
        Some("python-wheel") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            vllm_env::run_wheel(&args, &workspace_root())
        }
        Some("vllm-test") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            vllm_env::run_test(&args, &workspace_root())
        }
        Some("results") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            results::run(&args, &workspace_root())
        }
        Some("calibrate") => {
            let mut args =
                vec!["run", "--release", "--quiet", "--package", "pdkv-sim", "--example", "calibrate"];
            let rest: Vec<String> = std::env::args().skip(2).collect();
            match rest.as_slice() {
                [] => {}
                [flag] if flag == "--fit" => args.extend(["--", "--fit"]),
                _ => {
                    eprintln!("usage: cargo xtask calibrate [--fit]");
                    return ExitCode::from(2);
                }
            }
            if cargo(&args, &[]) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Some("catch") => {
            let args = ["run", "--release", "--quiet", "--package", "pdkv-sim", "--example", "catch"];
            if cargo(&args, &[]) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Some("bench") => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            let root = workspace_root();
            bench::run(&root, &target_dir(&root), &args)
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// Runs the gallery's commands with the release binary and copies their pictures into
/// docs/gallery.
fn gallery() -> ExitCode {
    let root = workspace_root();
    if !cargo(&["build", "--release", "--quiet", "--package", "pdkv", "--bin", "pdkv"], &[]) {
        return ExitCode::FAILURE;
    }
    let pdkv = target_dir(&root).join("release/pdkv");
    let drawn = pdkv_reports::gallery::table(&root).and_then(|pictures| {
        pdkv_reports::gallery::render(&pictures, &root.join("docs/gallery"), |args, folder| {
            println!("pdkv {}", args.join(" "));
            let status = Command::new(&pdkv)
                .args(args)
                .arg("--out")
                .arg(folder)
                .stdout(std::process::Stdio::null())
                .status()
                .map_err(|e| format!("cannot run {}: {e}", pdkv.display()))?;
            if status.success() {
                Ok(())
            } else {
                Err(format!("exited with {status}: the run did not end as its scenario expects"))
            }
        })
    });
    match drawn {
        Ok(files) => {
            for file in files {
                println!("wrote {}", file.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gallery: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace's target directory: `CARGO_TARGET_DIR` when set, as cargo does.
pub(crate) fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => std::env::current_dir().map(|cwd| cwd.join(&dir)).unwrap_or_else(|_| PathBuf::from(dir)),
        None => root.join("target"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// The generated files are written by the tests that check them, with `UPDATE_EXPECT` set, so
/// there is one renderer and it cannot disagree with its check.
fn codegen() -> ExitCode {
    if !cargo(&["test", "--package", "pdkv", "--test", "it", "machines"], &[("UPDATE_EXPECT", "1")]) {
        return ExitCode::FAILURE;
    }
    eprintln!("codegen: docs/machines regenerated; review `git diff docs/machines`");
    ExitCode::SUCCESS
}

/// Every interleaving of deliveries, losses (budget 1, then 2) and timers for three tiny
/// deployments and three requests: the fixed protocol must show no violation; the lazy
/// handshake must show its divergence, with the shortest trace.
fn check_model() -> ExitCode {
    use pdkv_core::legacy::{Legacy, LegacyOptions};
    use pdkv_sim::model_check::{check, ModelConfig};
    let mut ok = true;
    // (deployment, legacy options, losses, prefill restarts, a violation expected)
    let runs = [
        ("1P_DP2:1D_TP2", LegacyOptions::none(), 2, 0, false),
        ("1P_TP2:1D_TP4", LegacyOptions::none(), 2, 0, false),
        ("1P_TP4:1D_TP2", LegacyOptions::none(), 2, 0, false),
        ("1P_TP2:1D_TP2", LegacyOptions::none(), 1, 1, false),
        ("1P_TP2:1D_TP2", LegacyOptions::none().with(Legacy::LazyHandshake), 1, 0, true),
        ("1P_TP2:1D_TP2", LegacyOptions::none().with(Legacy::NoHandshakeTimeout), 1, 0, true),
        ("1P_TP2:1D_TP4", LegacyOptions::none().with(Legacy::ReleaseDuringReads), 0, 0, true),
        ("1P_TP2:1D_TP2", LegacyOptions::none().with(Legacy::NoIncarnationFence), 0, 1, true),
    ];
    for (deployment, legacy, loss_budget, restarts, expect_violation) in runs {
        let names: Vec<&str> = legacy.iter().map(|l| l.name()).collect();
        let config = ModelConfig {
            deployment: deployment.into(),
            legacy,
            // Two requests: with timers firing at any point (also while messages and reads are
            // in flight) three requests and two losses did not finish within 15 minutes.
            requests: 2,
            loss_budget,
            max_steps: 4,
            max_states: 2_000_000,
            reduce: true,
            restarts,
        };
        let report = match check(&config) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{deployment}: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!(
            "{deployment} {} losses <= {loss_budget}, restarts <= {restarts}: {} states, {} transitions, depth {}, {:.2} s, {} ({:.0} states/s)",
            if names.is_empty() { "fixed protocol,".to_string() } else { format!("legacy {},", names.join(" + ")) },
            report.states,
            report.transitions,
            report.max_depth,
            report.seconds,
            if report.complete { "complete" } else { "stopped early" },
            report.states as f64 / report.seconds.max(1e-9)
        );
        match (&report.violation, expect_violation) {
            (None, false) => println!("  no deadlock, divergence or leak in any interleaving"),
            (Some((what, trace)), true) => {
                println!("  found: {what}\n  shortest trace ({} steps):", trace.len());
                for line in trace {
                    println!("    {line}");
                }
            }
            (Some((what, _)), false) => {
                println!("  UNEXPECTED VIOLATION: {what}");
                ok = false;
            }
            (None, true) => {
                println!("  EXPECTED A VIOLATION, FOUND NONE");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn ci() -> ExitCode {
    let steps: [&[&str]; 3] = [
        &["fmt", "--all", "--check"],
        &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"],
        &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"],
    ];
    if steps.iter().all(|args| cargo(args, &[("HIP_PATH", "/usr")])) {
        suite::run(&workspace_root(), &[])
    } else {
        ExitCode::FAILURE
    }
}

/// Runs `cargo <args>` at the workspace root with extra environment; true when it succeeded.
fn cargo(args: &[&str], env: &[(&str, &str)]) -> bool {
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(workspace_root())
        .status();
    match status {
        Ok(s) if s.success() => true,
        Ok(s) => {
            eprintln!("cargo {} failed: {s}", args.join(" "));
            false
        }
        Err(e) => {
            eprintln!("cannot run cargo: {e}");
            false
        }
    }
}
