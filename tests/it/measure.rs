//! Decision-grade measurement on the command line: `pdkv sweep` by concurrency and by request
//! rate, with GPU counts, steady-state figures, goodput and the rankings the model's error
//! cannot separate; an open loop refused by a concurrency sweep; shard files of the old format
//! refused by name.

use std::path::Path;

use crate::cli::{pdkv_in, scratch};

/// Runs pdkv in `dir` and returns (exit code, stdout, stderr).
fn run(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = pdkv_in(dir, args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn sweep_json(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("sweep.json")).expect("sweep.json");
    serde_json::from_str::<serde_json::Value>(&text).expect("JSON").as_array().expect("a list").clone()
}

/// A concurrency sweep with an SLO: every point names its GPUs and carries its steady figures
/// and goodput; the table shows them with a rank per load, and the per-GPU charts are drawn.
#[test]
fn a_sweep_reports_gpus_steady_figures_goodput_and_ranks() {
    let dir = scratch("measure", "sweep-slo");
    let (code, text, err) = run(
        &dir,
        &[
            "sweep",
            "1P_TP8:1D_TP8",
            "2P_TP8:1D_DP8EP",
            "--concurrency",
            "4,8",
            "--requests-per-client",
            "3",
            "--slo-ttft-ms",
            "3000",
            "--out",
            "s",
        ],
    );
    assert_eq!(code, Some(0), "{text}{err}");
    let rows: Vec<&str> = text.lines().filter(|l| l.contains(" C=")).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(rows[0].contains(" 16 GPUs (8P+8D) ") && rows[2].contains(" 24 GPUs (16P+8D) "), "{text}");
    assert!(
        rows.iter().all(|r| r.contains(" tok/s/GPU, TTFT p50/p99 ")
            && r.contains(" ms  goodput ")
            && r.contains(" req/s/GPU  rank ")),
        "{text}"
    );
    assert!(
        text.contains("\nranked at each load by goodput per GPU; \"not separated\": within ± "),
        "{text}"
    );
    let points = sweep_json(&dir.join("s"));
    assert_eq!(points.len(), 4);
    for p in &points {
        assert!(p["rate_per_s"].is_null() && p["concurrency"].is_u64(), "{p}");
        let g = &p["gpus"];
        assert_eq!(g["total"].as_u64(), Some(g["prefill"].as_u64().unwrap() + g["decode"].as_u64().unwrap()));
        assert_eq!(p["steady"]["window"]["kind"], "steady", "{p}");
        assert!(p["steady"]["throughput"]["total_tok_s_per_gpu"].as_f64().unwrap() > 0.0, "{p}");
        assert_eq!(p["steady"]["goodput"]["slo"]["ttft_ms"], 3000.0, "{p}");
        // The old keys are all there.
        for key in
            ["concurrency", "deployment", "outcome", "run", "total_tok_s", "tpot_mean_ms", "ttft_mean_ms"]
        {
            assert!(p.get(key).is_some(), "{key}: {p}");
        }
    }
    for chart in ["sweep_throughput_per_gpu.svg", "sweep_goodput_per_gpu.svg"] {
        assert!(dir.join("s").join(chart).is_file(), "{chart}");
    }
    let index = std::fs::read_to_string(dir.join("s/index.html")).expect("the page");
    assert!(index.contains("<td>24 (16 + 8)</td>"), "{index}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rate sweep runs open loops at each rate (a closed-loop line becomes Poisson arrivals with
/// the sweep's request count); a concurrency sweep refuses an open-loop scenario, naming why.
#[test]
fn a_rate_sweep_runs_open_loops_and_a_concurrency_sweep_refuses_one() {
    let dir = scratch("measure", "sweep-rate");
    let (code, text, err) = run(
        &dir,
        &["sweep", "1P_TP8:1D_TP8", "--rate", "0.5,2", "--requests", "30", "--warmup", "3", "--out", "r"],
    );
    assert_eq!(code, Some(0), "{text}{err}");
    let rows: Vec<&str> = text.lines().filter(|l| l.contains(" R=")).collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(rows[0].starts_with("1P_TP8:1D_TP8            R=0.5/s   16 GPUs (8P+8D) "), "{text}");
    let points = sweep_json(&dir.join("r"));
    let rates: Vec<f64> = points.iter().map(|p| p["rate_per_s"].as_f64().expect("a rate")).collect();
    assert_eq!(rates, [0.5, 2.0]);
    assert!(points.iter().all(|p| p["concurrency"].is_null()));
    // --warmup reaches the points (at 2/s the 30 arrivals leave no window: the whole run).
    assert_eq!(points[0]["steady"]["window"]["warmup_requests"], 3, "{points:?}");
    let index = std::fs::read_to_string(dir.join("r/index.html")).expect("the page");
    assert!(
        index.contains("<th>rate (req/s)</th>") && index.contains("--rate 0.5,2 --requests 30 --warmup 3")
    );
    let svg = std::fs::read_to_string(dir.join("r/sweep_throughput.svg")).expect("a chart");
    assert!(svg.contains("request rate (arrivals per second)"), "the x axis is the rate");

    // (arguments, exit code, what stderr says)
    let table: &[(&[&str], i32, &str)] = &[
        (
            &["sweep", "open-loop-past-time-budget", "--concurrency", "4"],
            2,
            "error: open-loop-past-time-budget: its workload is an open loop (Poisson arrivals at 0.002 per \
             second), which a concurrency sweep would silently turn into a closed loop of C clients; sweep it \
             by request rate instead (--rate 0.002,...)",
        ),
        (&["sweep", "1P_TP8:1D_TP8", "--rate", "0"], 2, "error: --rate 0: a rate is a number of arrivals per second above 0"),
        (&["sweep", "1P_TP8:1D_TP8", "--rate", "1", "--concurrency", "4"], 2, "cannot be used with"),
        (&["sweep", "1P_TP8:1D_TP8", "--requests", "4"], 2, "--rate"),
    ];
    for (args, code, words) in table {
        let (got, _, err) = run(&dir, args);
        assert_eq!(got, Some(*code), "{args:?}: {err}");
        assert!(err.contains(words), "{args:?}: {err} lacks {words:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shard file of the first format (without GPUs, rates and steady figures) is refused by the
/// merge, which says to run the shard again.
#[test]
fn a_merge_refuses_a_shard_file_of_the_old_format() {
    let dir = scratch("measure", "old-shard");
    let args = ["sweep", "1P_TP8:1D_TP8", "--concurrency", "2", "--requests-per-client", "1"];
    for (i, out) in [(0, "s0"), (1, "s1")] {
        let shard = format!("{i}/2");
        let (code, _, err) = run(&dir, &[&args[..], &["--shard", &shard, "--out", out]].concat());
        assert_eq!(code, Some(0), "{err}");
    }
    let file = dir.join("s0/sweep-shard.json");
    let text = std::fs::read_to_string(&file).expect("the shard file");
    std::fs::write(&file, text.replace("pdkv-sweep-shard/2", "pdkv-sweep-shard/1")).expect("written");
    let (code, _, err) = run(&dir, &["sweep-merge", "s0", "s1", "--out", "m"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "sweep-shard.json: written by another version of pdkv: `format` is \"pdkv-sweep-shard/1\", and this \
             pdkv reads \"pdkv-sweep-shard/2\" only (its fields differ); run that shard again with this pdkv"
        ),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CSV time (milliseconds with six decimals) in nanoseconds, exactly.
fn csv_ns(ms: &str) -> u64 {
    let (whole, frac) = ms.split_once('.').unwrap_or_else(|| panic!("{ms:?} has six decimals"));
    assert_eq!(frac.len(), 6, "{ms:?}");
    whole.parse::<u64>().expect("ms") * 1_000_000 + frac.parse::<u64>().expect("ns")
}

/// A Chrome timestamp (microseconds) in nanoseconds.
fn chrome_ns(event: &serde_json::Value) -> u64 {
    (event["ts"].as_f64().expect("a timestamp") * 1e3).round() as u64
}

/// `pdkv run` writes requests.csv, byte for byte the same on a second run, one row per request
/// whose steady rows give the steady TTFT; and one request can be followed through trace.json
/// from arrival to finish, its times the CSV's to the nanosecond: an async slice with its
/// arrival, prefill done, first token and finish, a flow from its prefill step to its first
/// read, and every read and free of its KV naming it.
#[test]
fn one_request_is_followed_through_requests_csv_and_the_chrome_trace() {
    let dir = scratch("measure", "follow");
    let args = ["run", "1P_TP8:1D_DP8EP", "--concurrency", "4", "--requests", "40", "--chrome-trace"];
    for out in ["a", "b"] {
        let (code, text, err) = run(&dir, &[&args[..], &["--out", out]].concat());
        assert_eq!(code, Some(0), "{text}{err}");
        assert!(text.contains(&format!("  wrote        {out}/requests.csv\n")), "{text}");
    }
    let csv = std::fs::read(dir.join("a/requests.csv")).expect("requests.csv");
    assert!(
        csv == std::fs::read(dir.join("b/requests.csv")).expect("again"),
        "requests.csv differs between runs"
    );
    let csv = String::from_utf8(csv).expect("UTF-8");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    assert_eq!(
        header,
        [
            "id",
            "arrival_ms",
            "prefill",
            "decode",
            "first_token_ms",
            "finish_ms",
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "prompt_tokens",
            "output_tokens",
            "outcome",
            "in_steady_window"
        ]
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 40);
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("a/result.json")).expect("result"))
            .expect("JSON");
    let steady: Vec<&Vec<&str>> = rows.iter().filter(|r| r[12] == "true").collect();
    assert_eq!(steady.len() as u64, result["steady"]["window"]["requests"].as_u64().unwrap());
    let mean = steady.iter().map(|r| r[6].parse::<f64>().expect("TTFT")).sum::<f64>() / steady.len() as f64;
    let want = result["steady"]["latency_ms"]["ttft"]["mean"].as_f64().unwrap();
    assert!((mean - want).abs() <= 0.001, "steady TTFT mean {mean} against result.json's {want}");

    // Follow request 17 (in the steady window) through the Chrome trace.
    let row = rows.iter().find(|r| r[0] == "17").expect("request 17");
    assert_eq!((row[11], row[12]), ("finished", "true"), "{row:?}");
    let (arrival, first, finish) = (csv_ns(row[1]), csv_ns(row[4]), csv_ns(row[5]));
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("a/trace.json")).expect("trace.json"))
            .expect("JSON");
    let events = trace["traceEvents"].as_array().expect("events");
    let life: Vec<(&str, &str, u64)> = events
        .iter()
        .filter(|e| e["cat"] == "request" && e["id"] == 17)
        .map(|e| (e["ph"].as_str().unwrap(), e["name"].as_str().unwrap(), chrome_ns(e)))
        .collect();
    let prefill_done = life.iter().find(|(_, name, _)| *name == "prefill_done").expect("prefill done").2;
    assert_eq!(
        life,
        [
            ("b", "req-17", arrival),
            ("n", "arrival", arrival),
            ("n", "prefill_done", prefill_done),
            ("n", "first_token", first),
            ("n", "finish", finish),
            ("e", "req-17", finish),
        ]
    );
    assert!(arrival < prefill_done && prefill_done < first, "{life:?}");
    let flow: Vec<(&str, u64)> = events
        .iter()
        .filter(|e| e["cat"] == "kv" && e["id"] == 17)
        .map(|e| (e["ph"].as_str().unwrap(), chrome_ns(e)))
        .collect();
    assert!(
        matches!(flow[..], [("s", s), ("f", f)] if s + 1 == prefill_done && prefill_done <= f && f < first),
        "{flow:?}"
    );
    // Every read and free of its KV names it; the in-flight counter is there.
    let naming = |cat: &str, name: &str| {
        events
            .iter()
            .filter(|e| e["cat"] == cat && e["name"] == name)
            .filter(|e| {
                e["args"]["detail"].as_str().unwrap_or_default().split(' ').any(|w| w == "request=req-17")
            })
            .count()
    };
    assert!(naming("nic", "read") >= 1 && naming("prefill", "free") == 1, "reads and the free name req-17");
    assert!(events.iter().any(|e| e["ph"] == "C" && e["name"] == "in_flight"));
    // The text trace names it too: `grep -w req-17` finds its whole life.
    let text = std::fs::read_to_string(dir.join("a/trace.txt")).expect("trace.txt");
    let mentioned: Vec<&str> = text
        .lines()
        .filter(|l| l.split(|c: char| c.is_whitespace() || c == '=').any(|w| w == "req-17"))
        .map(|l| l.split_whitespace().nth(3).unwrap_or_default())
        .collect();
    for event in ["request", "arrival", "kv_ready", "prefill_done", "read", "free", "first_token", "finish"] {
        assert!(mentioned.contains(&event), "{event} does not name req-17: {mentioned:?}");
    }

    // --no-requests-csv writes none, and removes an earlier run's.
    let (code, text, err) =
        run(&dir, &[&args[..6], &["--out", "a", "--no-requests-csv", "--no-trace"]].concat());
    assert_eq!(code, Some(0), "{text}{err}");
    assert!(!dir.join("a/requests.csv").exists() && !text.contains("requests.csv"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
