//! End-to-end tests of `pdkv routes`: the built binary, its exit codes and its JSON.

use std::process::{Command, Output};

use serde_json::Value;

fn pdkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).output().expect("pdkv runs")
}

fn json(args: &[&str]) -> (i32, Value) {
    let out = pdkv(args);
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"));
    (out.status.code().expect("exit code"), value)
}

fn reads(value: &Value) -> Vec<u64> {
    value["reads_per_prefill_gpu"]
        .as_array()
        .expect("array")
        .iter()
        .map(|v| v.as_u64().expect("count"))
        .collect()
}

#[test]
fn flexible_mixed_deployment_reads_every_gpu_equally() {
    let (code, value) = json(&["routes", "2P_TP8:1D_DP8EP", "--mla", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(value["flexible"], Value::Bool(true));
    assert_eq!(reads(&value), vec![16; 16]);
    assert_eq!(value["expected_releases_per_prefill_rank"].as_array().unwrap().len(), 16);
    assert!((value["jain"].as_f64().unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn head_splitting_pair_exits_2_with_the_reason() {
    let (code, value) = json(&["routes", "1P_TP4:1D_TP8", "--kv-heads", "8", "--json"]);
    assert_eq!(code, 2);
    let error = value["error"].as_str().expect("error string");
    assert!(error.contains("replicated KV heads are required"), "{error}");
}

/// (arguments) -> (exit code, text that stdout or stderr must contain).
#[test]
fn exit_codes_and_messages_table() {
    let check = |args: &[&str], code: i32, text: &str| {
        let out = pdkv(args);
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(code), "{args:?}: {all}");
        assert!(all.contains(text), "{args:?}: {all}");
    };
    check(
        &["routes", "1P_TP8:1D_TP4"],
        0,
        "releases per request, per prefill TP rank: [1, 0, 1, 0, 1, 0, 1, 0]",
    );
    check(&["routes", "2P_DP8EP:4D_TP8", "--rounds", "1"], 0, "Jain index 1.0000");
    check(&["routes", "2P_XP8:1D_TP8"], 2, "bad token \"XP8\" at column 4");
    check(&["routes", "2P_XP8:1D_TP8", "--json"], 2, "\"error\"");
    check(&["routes", "1P_TP4:1D_TP6"], 2, "multiple");
    check(&["routes", "1P_TP8:1D_TP8", "--legacy", "read-from-dp1"], 2, "possible values: read-from-dp0");
    check(&["routes", "1P_TP8:1D_TP8", "--mla", "--kv-heads", "8"], 2, "cannot be used with");
    check(&["routes", "1P_TP8:1D_TP8", "--rounds", "0"], 2, "rounds must be in 1..=");
    check(
        &["routes", "1P_DP2TP2:1D_TP2", "--legacy", "listener-offset-dp-plus-tp"],
        0,
        "WARNING: P0.dp0.tp1 and P0.dp1.tp0 both listen on notify port 61006",
    );
    check(&["routes", "--help"], 0, "Examples:");
    // WRITE mode: vLLM 0.33 slices heads where READ refuses; releases before 0.33 pair ranks.
    check(
        &["routes", "2P_TP4:1D_TP8", "--kv-heads", "8", "--mode", "write", "--rules", "vllm-0.33"],
        0,
        "0->[0,1] 1->[2,3] 2->[4,5] 3->[6,7]",
    );
    check(
        &["routes", "2P_TP4:1D_TP8", "--kv-heads", "8", "--mode", "write", "--rules", "vllm-0.30"],
        2,
        "before vLLM 0.33 a WRITE goes from prefill TP rank k to decode TP rank k",
    );
    // Under a vLLM release's rules: 0.25 reads DP rank 0 only; 0.33's listeners collide at DP x TP.
    check(&["routes", "1P_DP8EP:1D_TP8", "--rules", "vllm-0.25"], 0, "most-read P0.dp0.tp0 (1024 reads)");
    check(
        &["routes", "1P_DP2TP2:1D_TP2", "--rules", "vllm-0.33"],
        0,
        "WARNING: P0.dp0.tp1 and P0.dp1.tp0 both listen on notify port 61006",
    );
    check(
        &["routes", "1P_TP8:1D_TP4", "--rules", "vllm-0.33"],
        0,
        "releases per request, per prefill TP rank: [1, 1, 1, 1, 1, 1, 1, 1]",
    );
    check(
        &["routes", "1P_TP8:1D_TP8", "--mode", "write", "--legacy", "tp-size-key"],
        2,
        "takes --rules instead",
    );
    check(
        &["routes", "1P_TP8:1D_TP8", "--mode", "write", "--rules", "vllm-9"],
        2,
        "unknown rule set \"vllm-9\"",
    );
    check(&["routes", "1P_TP8:1D_TP8", "--mode", "push"], 2, "possible values: read, write");
}

fn bytes(value: &Value) -> Vec<u64> {
    value["prefill_ranks"]
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["bytes_per_token"].as_u64().unwrap())
        .collect()
}

/// MLA from TP8 prefill into TP1 decode ranks: under vLLM 0.33's rule TP rank 0 of each prefill
/// engine sends every byte; under pdkv's the eight NICs share them, with the same total.
#[test]
fn write_table_puts_vllm_s_mla_writes_on_one_nic_and_pdkv_s_on_all() {
    let (code, vllm) =
        json(&["routes", "2P_TP8:1D_DP8EP", "--mode", "write", "--rules", "vllm-0.33", "--json"]);
    assert_eq!(code, 0);
    let vllm_bytes = bytes(&vllm);
    assert!(vllm_bytes.iter().enumerate().all(|(i, &b)| (i % 8 == 0) == (b > 0)), "{vllm_bytes:?}");
    assert!((vllm["jain"].as_f64().unwrap() - 0.125).abs() < 1e-12);
    assert_eq!(vllm["write_rule"], "first-holder");
    let (code, pdkv) = json(&["routes", "2P_TP8:1D_DP8EP", "--mode", "write", "--json"]);
    assert_eq!(code, 0);
    let pdkv_bytes = bytes(&pdkv);
    assert_eq!(pdkv_bytes.iter().sum::<u64>(), vllm_bytes.iter().sum::<u64>());
    assert!(pdkv_bytes.iter().all(|&b| b > 0), "{pdkv_bytes:?}");
    assert!(pdkv["jain"].as_f64().unwrap() > 0.99);
}

/// (arguments, requests routed, prefill rows with whitespace collapsed) -> the table says which
/// columns are totals over the run and which are per request, and the numbers are what those
/// words promise: a TP8 decode reads each rank of a TP4 prefill twice per request (2 x 16
/// reads in all, 2 releases per request); a TP4 decode reads every other rank of a TP8 prefill
/// (the unread ranks expect no release).
#[test]
fn prefill_table_says_which_columns_are_totals_and_which_per_request() {
    let check = |args: &[&str], requests: u32, rows: &[&str]| {
        let out = pdkv(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
        let lines: Vec<String> =
            text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
        let has = |wanted: &str| lines.iter().any(|l| l == wanted);
        let sentence = format!(
            "reads and requests are totals over all {requests} requests (a read: one decode rank reads one"
        );
        assert!(has(&sentence), "{args:?}: no sentence {sentence:?} in\n{text}");
        let header = "rank handshake notify reads total requests total releases per request";
        assert!(has(header), "{args:?}: no header {header:?} in\n{text}");
        for row in rows {
            assert!(has(row), "{args:?}: no row {row:?} in\n{text}");
        }
    };
    check(
        &["routes", "1P_TP4:1D_TP8"],
        16,
        &["P0.dp0.tp0 6301 61005 32 16 2", "P0.dp0.tp3 6304 61008 32 16 2"],
    );
    check(
        &["routes", "1P_TP8:1D_TP4", "--rounds", "4"],
        4,
        &["P0.dp0.tp0 6301 61005 4 4 1", "P0.dp0.tp1 6302 61006 0 4 0"],
    );
}

#[test]
fn same_input_gives_byte_identical_output() {
    let args = ["routes", "2P_DP4TP2:1D_TP8", "--json", "--rounds", "3"];
    assert_eq!(pdkv(&args).stdout, pdkv(&args).stdout);
}
