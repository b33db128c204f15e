//! End-to-end tests of `pdkv plan`: the built binary on a budget small enough that memory
//! decides most of the search, its exit codes and named errors, its JSON, and its determinism.

use std::process::{Command, Output};

use serde_json::Value;

fn pdkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).output().expect("pdkv runs")
}

/// A plan of DeepSeek-R1 on 16 MI300X GPUs: a TP4 engine needs 168 GB of weights per GPU of
/// 192 GB, so every layout has 8 GPUs a side; short runs keep the test quick.
const SMALL: &[&str] = &[
    "plan",
    "--gpus",
    "16",
    "--gpu",
    "mi300x",
    "--model",
    "deepseek-r1",
    "--slo-ttft-ms",
    "2000",
    "--slo-tpot-ms",
    "50",
    "--top",
    "2",
    "--requests",
    "120",
    "--jobs",
    "2",
];

fn with(extra: &[&str]) -> Vec<String> {
    SMALL.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// (arguments) -> (exit code, texts that stdout or stderr must contain, texts they must not).
#[test]
fn plans_and_refusals_table() {
    let check = |args: Vec<String>, code: i32, present: &[&str], absent: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = pdkv(&args);
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(code), "{args:?}: {all}");
        for text in present {
            assert!(all.contains(text), "{args:?} lacks {text:?}: {all}");
        }
        for text in absent {
            assert!(!all.contains(text), "{args:?} has {text:?}: {all}");
        }
    };
    // Memory decides: only 8-GPU engines fit, so the two runs are one 8-GPU prefill engine with
    // an 8-GPU decode engine, and the TP4 layouts are rejected by their weights.
    check(
        with(&["--show-rejected"]),
        0,
        &[
            "#1  1P_",
            "#2  1P_",
            "16 (8+8)",
            "weights do not fit",
            "like 1P_TP4:1D_TP1 (5 GPUs): prefill TP4: weights 167.8 GB per GPU",
            "calibration study-tp8-fit-2026-12",
            "not separated at ±37 %",
            "built-in NIC values (48 GB/s), stack vllm;",
        ],
        &["#3 ", "WARNING"],
    );
    // A named stack is the runs' and the screen's, and one the calibration was not fitted on
    // is warned about.
    check(
        with(&["--stack", "sglang"]),
        0,
        &[
            "built-in NIC values (48 GB/s), stack sglang;",
            "WARNING: calibration study-tp8-fit-2026-12 was not fitted on stack sglang",
        ],
        &[],
    );
    check(
        with(&["--stack", "trt-llm"]),
        2,
        &["invalid value 'trt-llm' for '--stack", "[possible values: vllm, sglang, deepseek]"],
        &[],
    );
    check(with(&["--concurrency", "4"]), 0, &["C4 x120"], &[]);
    check(with(&["--rate", "0.5"]), 0, &["0.5/s x120"], &[]);
    // Bad input: exit 2 and a named error.
    let bad = |flag: &str, value: &str| {
        let mut args = with(&[]);
        let at = args.iter().position(|a| a == flag).expect("flag present");
        args[at + 1] = value.to_string();
        args
    };
    check(
        bad("--gpu", "h900"),
        2,
        &["unknown GPU profile `h900`; profiles/gpus.ron has: b200, h100-sxm, h200-sxm, h800, mi300x, mi355x"],
        &[],
    );
    check(bad("--model", "gpt-9"), 2, &["unknown model profile `gpt-9`", "deepseek-r1, llama-3.1-70b"], &[]);
    check(
        bad("--gpus", "12"),
        2,
        &["no layout of 12 GPUs fits", "the smallest that fits is 1P_TP8:1D_TP8, 16 GPUs"],
        &[],
    );
    check(bad("--gpus", "1"), 2, &["--gpus 1: the budget must be 2 to 1024 GPUs"], &[]);
    check(bad("--top", "0"), 2, &["--top 0: run 1 to 64 layouts"], &[]);
    check(bad("--slo-ttft-ms", "0"), 2, &["\"0\" is not a positive number of milliseconds"], &[]);
    check(
        vec![
            "plan".into(),
            "--gpus".into(),
            "16".into(),
            "--gpu".into(),
            "mi300x".into(),
            "--model".into(),
            "deepseek-r1".into(),
        ],
        2,
        &["give --slo-ttft-ms or --slo-tpot-ms"],
        &[],
    );
    check(with(&["--input", "8k"]), 2, &["\"8k\" is not a token count"], &[]);
    check(with(&["--input", "4096-1024"]), 2, &["MIN is above MAX"], &[]);
    check(with(&["--concurrency", "4", "--rate", "1"]), 2, &["cannot be used with"], &[]);
    check(with(&["--nic", "cx9"]), 2, &["unknown NIC profile `cx9`"], &[]);
}

/// Two plans print the same bytes and write the same JSON, on one thread or three; the JSON
/// carries the ranking, the estimates, the rejected layouts with reasons and the error band.
#[test]
fn a_plan_is_deterministic_and_its_json_is_complete() {
    let dir = std::env::temp_dir().join(format!("pdkv-it-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |name: &str, jobs: &str| {
        let file = dir.join(name);
        let mut args = with(&["--json"]);
        args.push(file.display().to_string());
        let at = args.iter().position(|a| a == "--jobs").expect("--jobs") + 1;
        args[at] = jobs.to_string();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = pdkv(&args);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        let json = std::fs::read_to_string(&file).expect("the JSON file");
        (stdout.replace(&file.display().to_string(), "FILE"), json)
    };
    let (first_out, first_json) = run("a.json", "1");
    let (second_out, second_json) = run("b.json", "3");
    assert_eq!(first_out, second_out);
    assert_eq!(first_json, second_json);
    let v: Value = serde_json::from_str(&first_json).expect("JSON");
    let ranked = v["ranked"].as_array().expect("ranked");
    assert_eq!(ranked.len(), 2);
    for (i, r) in ranked.iter().enumerate() {
        assert_eq!(r["rank"], i + 1);
        assert_eq!(r["prefill_gpus"].as_u64().unwrap() + r["decode_gpus"].as_u64().unwrap(), 16);
        assert!(r["estimate"]["bound"].is_string() && r["bound"].is_string(), "{r}");
    }
    assert!(ranked[0]["goodput_per_gpu"].as_f64() >= ranked[1]["goodput_per_gpu"].as_f64());
    let rejected = v["rejected"].as_array().expect("rejected");
    assert!(
        rejected.iter().any(|r| r["why"]["kind"] == "memory" && r["why"]["what"] == "weights"),
        "{rejected:?}"
    );
    assert!(rejected.iter().all(|r| r["reason"].as_str().is_some_and(|s| !s.is_empty())));
    let counted: u64 = rejected.iter().map(|r| r["layouts"].as_u64().expect("a count")).sum();
    assert_eq!(counted + v["screened"].as_u64().unwrap(), v["enumerated"].as_u64().unwrap());
    assert!((v["error"].as_f64().expect("the calibration's error") - 0.37).abs() < 1e-9);
    let _ = std::fs::remove_dir_all(&dir);
}
