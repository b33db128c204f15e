//! `pdkv run` and `pdkv sweep` warn on stderr when a scenario names a GPU, NIC or model profile
//! the cost model's calibration was not fitted on (profiles/calibration.ron's `covers`), and
//! stay quiet on the profiles it was fitted on.

use crate::cli::{pdkv_in, scratch};

/// A small scenario file naming `profiles` (a RON body such as `gpu: "h200-sxm"`), and a
/// serving stack after `;` (`gpu: "h200-sxm"; sglang`).
fn scenario(dir: &std::path::Path, name: &str, profiles: &str) -> String {
    let path = dir.join(format!("{name}.ron"));
    let (profiles, engines) = match profiles.split_once(';') {
        Some((profiles, stack)) => (profiles, format!(", engines: (stack: \"{}\")", stack.trim())),
        None => (profiles, String::new()),
    };
    let text = format!("(name: \"{name}\", deployment: \"1P_TP8:1D_TP8\", profiles: ({profiles}){engines})");
    std::fs::write(&path, text).expect("scenario written");
    path.to_string_lossy().into_owned()
}

/// The WARNING lines of `stderr`.
fn warnings(stderr: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stderr).lines().filter(|l| l.starts_with("WARNING")).map(str::to_string).collect()
}

#[test]
fn run_warns_on_profiles_outside_the_calibration() {
    let dir = scratch("coverage", "run");
    let check = |name: &str, profiles: &str, expected: Option<&str>| {
        let file = scenario(&dir, name, profiles);
        let out = dir.join(name);
        let args = ["run", &file, "--concurrency", "1", "--requests", "2", "--no-trace", "--json"];
        let output = pdkv_in(&dir, &[&args[..], &["--out", &out.to_string_lossy()]].concat());
        assert!(output.status.success(), "{name}: {}", String::from_utf8_lossy(&output.stderr));
        let got = warnings(&output.stderr);
        match expected {
            None => assert!(got.is_empty(), "{name}: {got:?}"),
            Some(names) => {
                assert_eq!(got.len(), 1, "{name}: {got:?}");
                assert!(
                    got[0].contains(&format!("was not fitted on {names}:"))
                        && got[0].contains("docs/calibration.md"),
                    "{name}: {got:?}"
                );
            }
        }
    };
    check("defaults", "", None);
    check("fitted", "gpu: \"mi300x\", nic: \"thor2-400g\", model: \"deepseek-r1\"", None);
    check("h200", "gpu: \"h200-sxm\", nic: \"cx7-400g\"", Some("gpu h200-sxm, nic cx7-400g"));
    check("llama", "model: \"llama-3.1-70b\"", Some("model llama-3.1-70b"));
    check("vllm", "; vllm", None);
    check("sglang", "gpu: \"h200-sxm\"; sglang", Some("gpu h200-sxm, stack sglang"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sweep_warns_once_per_uncovered_line() {
    let dir = scratch("coverage", "sweep");
    let h200 = scenario(&dir, "h200", "gpu: \"h200-sxm\"");
    let out = dir.join("sweep");
    let args =
        ["sweep", "1P_TP8:1D_TP8", &h200, "--concurrency", "1", "--requests-per-client", "2", "--jobs", "1"];
    let output = pdkv_in(&dir, &[&args[..], &["--out", &out.to_string_lossy()]].concat());
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let got = warnings(&output.stderr);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].contains("was not fitted on gpu h200-sxm:"), "{got:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
