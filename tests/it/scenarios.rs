//! Every scenario under scenarios/ runs to its declared outcome; runs are deterministic; the
//! scenario list in scenarios/README.md is complete.

use std::path::{Path, PathBuf};
use std::process::Command;

use pdkv_sim::{RunOptions, RunResult};

fn scenario_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("scenarios/ exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ron"))
        .collect();
    files.sort();
    files
}

fn run(path: &Path, seed: Option<u64>) -> RunResult {
    let mut scenario = pdkv_sim::load::load_scenario(path).unwrap_or_else(|e| panic!("{e}"));
    if let Some(seed) = seed {
        scenario.seed = seed;
    }
    pdkv_sim::run(&scenario, RunOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .result
}

#[test]
fn every_scenario_has_its_declared_outcome() {
    let files = scenario_files();
    assert!(files.len() >= 29, "only {} scenarios", files.len());
    let mut wrong = Vec::new();
    for path in &files {
        let result = run(path, None);
        if !result.as_expected() {
            wrong.push(format!(
                "{}: outcome {} (expected {}), Jain {} (expected {}); replay: pdkv run {} --seed {}",
                path.display(),
                result.outcome.name(),
                result.expected.name(),
                result.nic.jain.map_or("n/a".to_string(), |jain| jain.to_string()),
                result.expected_jain.map_or("anything".to_string(), |bounds| bounds.to_string()),
                path.display(),
                result.seed
            ));
        }
    }
    assert!(wrong.is_empty(), "scenarios with an unexpected result:\n{}", wrong.join("\n"));
}

#[test]
fn same_scenario_and_seed_give_byte_identical_json() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    for name in ["2P_TP8-1D_DP8EP.ron", "no-handshake-timeout-lost-reply.ron"] {
        let path = dir.join(name);
        let (a, b) = (run(&path, Some(11)).to_json(), run(&path, Some(11)).to_json());
        assert!(a == b, "{name}: two runs with seed 11 differ; replay: pdkv run scenarios/{name} --seed 11");
    }
}

#[test]
fn scenarios_readme_lists_every_scenario() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/README.md"))
        .expect("scenarios/README.md exists");
    for path in scenario_files() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let row = readme.lines().find(|l| l.contains(&format!("`{name}`")));
        let scenario = pdkv_sim::load::load_scenario(&path).unwrap();
        let expected = scenario.expect.unwrap_or(pdkv_sim::Outcome::Clean).name();
        match row {
            Some(row) => {
                assert!(row.contains(expected), "scenarios/README.md row of {name} lacks `{expected}`")
            }
            None => panic!("scenarios/README.md does not list {name}"),
        }
    }
}

fn pdkv_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).output().expect("pdkv runs");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: {e}: {text}"))
}

/// The mixed deployment spreads reads evenly; with the flexible reads switched off every read
/// lands on TP rank 0 of each prefill engine.
#[test]
fn run_mixed_deployment_balance_and_its_legacy_hot_spot() {
    let out = std::env::temp_dir().join("pdkv-it-run-balance");
    let out = out.to_string_lossy();
    let even = pdkv_json(&["run", "2P_TP8:1D_DP8EP", "--json", "--out", &out]);
    assert!(even["nic"]["jain"].as_f64().unwrap() >= 0.99, "{}", even["nic"]);
    let reads = |v: &serde_json::Value| -> Vec<u64> {
        v["nic"]["reads_per_prefill_gpu"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
    };
    assert_eq!(reads(&even).len(), 16);
    let hot =
        pdkv_json(&["run", "2P_TP8:1D_DP8EP", "--legacy", "no-flexible-reads", "--json", "--out", &out]);
    let hot_reads = reads(&hot);
    for (i, r) in hot_reads.iter().enumerate() {
        assert_eq!(*r > 0, i % 8 == 0, "GPU {i}: {hot_reads:?}");
    }
}
