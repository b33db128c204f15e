//! End-to-end tests of the report commands: `run`, `sweep`, `scenarios`, `replay` on the built
//! binary; every picture is a real PNG or well-formed SVG and the index page shows each one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pdkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).output().expect("pdkv runs")
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Tags balance and every `<` starts a tag, a comment, a declaration or CDATA: enough to call an
/// SVG well-formed XML for these files (attribute values are quoted by every SVG writer).
fn check_xml(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut stack: Vec<String> = Vec::new();
    let mut rest = text.as_str();
    let mut roots = 0;
    while let Some(start) = rest.find('<') {
        let after = &rest[start + 1..];
        if let Some(body) = after.strip_prefix("!--") {
            let end = body.find("-->").unwrap_or_else(|| panic!("{}: unclosed comment", path.display()));
            rest = &body[end + 3..];
            continue;
        }
        let end = after.find('>').unwrap_or_else(|| panic!("{}: unclosed tag", path.display()));
        let tag = &after[..end];
        rest = &after[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().unwrap_or_else(|| panic!("{}: </{name}> closes nothing", path.display()));
            assert_eq!(open, name.trim(), "{}: <{open}> closed by </{name}>", path.display());
            continue;
        }
        let name = tag.split(|c: char| c.is_whitespace() || c == '/').next().unwrap_or_default().to_string();
        assert!(!name.is_empty(), "{}: empty tag name", path.display());
        assert_eq!(tag.matches('"').count() % 2, 0, "{}: unbalanced quotes in <{name}>", path.display());
        if stack.is_empty() {
            roots += 1;
        }
        if !tag.ends_with('/') {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "{}: unclosed {stack:?}", path.display());
    assert_eq!(roots, 1, "{}: one root element", path.display());
    assert!(text.contains("<svg"), "{}: not an SVG", path.display());
}

fn check_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}: no PNG signature", path.display());
    assert!(bytes.len() > 10_000, "{}: only {} bytes", path.display(), bytes.len());
}

/// Every picture in `dir` is valid and `index.html` shows every PNG and links every SVG.
fn check_report(dir: &Path, expected: &[&str]) {
    let index = std::fs::read_to_string(dir.join("index.html")).expect("index.html written");
    for stem in expected {
        let (png, svg) = (dir.join(format!("{stem}.png")), dir.join(format!("{stem}.svg")));
        check_png(&png);
        check_xml(&svg);
        assert!(index.contains(&format!("src=\"{stem}.png\"")), "index.html lacks {stem}.png");
        assert!(index.contains(&format!("href=\"{stem}.svg\"")), "index.html lacks {stem}.svg");
    }
}

#[test]
fn a_hang_report_leads_with_its_wait_for_graph_and_says_n_a_and_replay_confirms_it() {
    let dir = out_dir("run");
    let out = pdkv(&["run", "no-handshake-timeout-lost-reply", "--out", dir.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("outcome      hang (expected hang: as expected)"), "{text}");
    // Nothing finished and nothing was read: the figures say so instead of showing zeros.
    assert!(text.contains("\n  latency      n/a (no request finished)\n"), "{text}");
    assert!(text.contains("\n  NIC balance  Jain n/a: no prefill GPU served a read\n"), "{text}");
    check_report(&dir, &["wait_for_0"]);
    assert!(dir.join("wait_for_0.dot").exists());
    let index = std::fs::read_to_string(dir.join("index.html")).unwrap();
    // The wait-for graph is the page's first figure; charts without data are left out, with a
    // sentence each, rather than drawn as empty axes.
    let first = index.find("<img").map(|at| &index[at..]).unwrap_or_default();
    assert!(first.starts_with("<img src=\"wait_for_0.png\""), "{index}");
    assert_eq!(index.matches("<img").count(), 1, "{index}");
    for absent in ["nic_balance", "nic_utilisation", "latency_cdf"] {
        assert!(!dir.join(format!("{absent}.png")).exists(), "{absent} drawn without data");
    }
    assert!(index.contains("<p>No latency chart: no request finished"), "{index}");
    assert!(
        index.contains("<tr><th>TTFT (whole run)</th><td>n/a (no request finished)</td></tr>"),
        "{index}"
    );
    for debug in ["Some(", "None", "0.000"] {
        assert!(!text.contains(debug) && !index.contains(debug), "shows {debug}");
    }
    assert!(index.contains("pdkv run no-handshake-timeout-lost-reply --seed 0"), "command shown");
    assert!(index.contains("no-handshake-timeout"), "scenario text shown");

    let replay = pdkv(&["replay", dir.join("result.json").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&replay.stdout);
    assert_eq!(replay.status.code(), Some(0), "{text}");
    assert!(text.contains("outcome hang (recorded hang); result byte-identical"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// (flags) -> which trace files the run leaves in its folder, one after the other in the same
/// folder (so a trace the run does not write is removed, not left stale), and whether the page
/// links them. The text trace is the same with and without the Chrome trace; the Chrome trace
/// is valid JSON.
#[test]
fn trace_flags_decide_the_trace_files() {
    let dir = out_dir("trace-flags");
    let run = |flags: &[&str]| {
        let mut args = vec!["run", "notify-drift-fixed", "--out", dir.to_str().unwrap()];
        args.extend_from_slice(flags);
        let out = pdkv(&args);
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.code(), text)
    };
    let mut texts = Vec::new();
    for (flags, txt, json) in [
        (&[][..], true, false),
        (&["--chrome-trace"][..], true, true),
        (&["--no-trace"][..], false, false),
        (&["--chrome-trace"][..], true, true),
        (&[][..], true, false),
    ] {
        let (code, text) = run(flags);
        assert_eq!(code, Some(0), "{flags:?}: {text}");
        let index = std::fs::read_to_string(dir.join("index.html")).unwrap();
        for (file, wanted) in [("trace.txt", txt), ("trace.json", json)] {
            assert_eq!(dir.join(file).exists(), wanted, "{flags:?}: {file}");
            assert_eq!(index.contains(&format!("href=\"{file}\"")), wanted, "{flags:?}: {file} on the page");
            assert_eq!(
                text.contains(&format!("wrote        {}", dir.join(file).display())),
                wanted,
                "{text}"
            );
        }
        if txt {
            texts.push(std::fs::read(dir.join("trace.txt")).unwrap());
        }
        if json {
            let chrome: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("trace.json")).unwrap()).unwrap();
            assert!(chrome["traceEvents"].as_array().is_some_and(|e| e.len() > 10), "{flags:?}");
        }
    }
    assert!(texts[0].starts_with(b"# virtual time ") && texts.len() == 4);
    assert!(texts.iter().all(|t| *t == texts[0]), "the same run writes the same trace.txt");
    let (code, text) = run(&["--no-trace", "--chrome-trace"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--no-trace") && text.contains("cannot be used with"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `pdkv` run in the folder `cwd`, so its default output lands under `cwd/target/pdkv/`.
fn pdkv_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv")).args(args).current_dir(cwd).output().expect("pdkv runs")
}

/// Two different sweeps keep their own reports.
#[test]
fn sweeps_that_differ_leave_reports_side_by_side() {
    let cwd = out_dir("sweep-folders");
    std::fs::create_dir_all(&cwd).unwrap();
    let small = ["--concurrency", "2,4", "--requests-per-client", "1"];
    let sweeps = [
        (
            vec!["sweep", "proxy-aliasing", "proxy-aliasing-fixed"],
            "sweep_proxy-aliasing_proxy-aliasing-fixed_C2-4_x1-per-client",
        ),
        (vec!["sweep", "1P_TP8:1D_TP8"], "sweep_1P_TP8-1D_TP8_C2-4_x1-per-client"),
    ];
    for (args, folder) in &sweeps {
        let args = [&args[..], &small].concat();
        let out = pdkv_in(&cwd, &args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(cwd.join("target/pdkv").join(folder).join("sweep.json").is_file(), "{args:?} wrote {folder}");
    }
    assert_eq!(std::fs::read_dir(cwd.join("target/pdkv")).unwrap().count(), 2, "one folder per sweep");
    std::fs::remove_dir_all(&cwd).ok();
}

#[test]
fn runs_that_differ_leave_reports_side_by_side_each_titled_with_what_it_ran() {
    let cwd = out_dir("identity");
    std::fs::create_dir_all(&cwd).unwrap();
    let small = ["--concurrency", "4", "--requests", "8"];
    let plain = [&["run", "2P_TP8:1D_DP8EP"][..], &small].concat();
    let legacy = [&plain[..], &["--legacy", "no-flexible-reads"]].concat();
    let seeded: Vec<&str> = vec!["run", "notify-drift-fixed", "--seed", "3"];
    let built_in: Vec<&str> = vec!["run", "2P_TP8-1D_DP8EP"];
    // (arguments) -> (folder under target/pdkv, label, the scenario result.json names, its
    // deployment): the built-in `2P_TP8-1D_DP8EP` and the notation `2P_TP8:1D_DP8EP` run other
    // workloads, and say so in every name.
    let runs = [
        (
            &plain,
            "2P_TP8-1D_DP8EP_C4-x8-8K-1K",
            "2P_TP8:1D_DP8EP, C4 x8 8K/1K",
            "2P_TP8:1D_DP8EP",
            "2P_TP8:1D_DP8EP",
        ),
        (
            &legacy,
            "2P_TP8-1D_DP8EP_C4-x8-8K-1K_legacy-no-flexible-reads",
            "2P_TP8:1D_DP8EP, C4 x8 8K/1K, legacy no-flexible-reads",
            "2P_TP8:1D_DP8EP",
            "2P_TP8:1D_DP8EP",
        ),
        (
            &seeded,
            "notify-drift-fixed_seed-3",
            "notify-drift-fixed, seed 3",
            "notify-drift-fixed",
            "1P_DP2:1D_TP2",
        ),
        (&built_in, "2P_TP8-1D_DP8EP", "2P_TP8-1D_DP8EP", "2P_TP8-1D_DP8EP", "2P_TP8:1D_DP8EP"),
    ];
    for (args, folder, label, scenario, deployment) in runs {
        let out = pdkv_in(&cwd, args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
        let dir = cwd.join("target/pdkv").join(folder);
        let title =
            if label.starts_with(deployment) { label.to_string() } else { format!("{label} ({deployment})") };
        assert_eq!(text.lines().next(), Some(format!("pdkv run {title}").as_str()), "{args:?}");
        assert!(text.contains(&format!("target/pdkv/{folder}/index.html")), "{args:?}: {text}");
        let index = std::fs::read_to_string(dir.join("index.html")).expect("index.html");
        assert!(index.contains(&format!("<title>pdkv run {}</title>", title)), "{args:?}");
        assert!(index.contains(&format!("<h1>pdkv run {}</h1>", title)), "{args:?}");
        let svg = std::fs::read_to_string(dir.join("nic_balance.svg")).expect("nic_balance.svg");
        assert!(svg.contains(&format!("NIC balance per prefill GPU: {title}")), "{args:?}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
        assert_eq!((&json["label"], &json["scenario"]), (&(*label).into(), &scenario.into()), "{args:?}");
    }
    let mut folders: Vec<String> = std::fs::read_dir(cwd.join("target/pdkv"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    folders.sort();
    let mut expected: Vec<&str> = runs.iter().map(|r| r.1).collect();
    expected.sort();
    assert_eq!(folders, expected, "one folder per run");
    // The same run again writes the same folder, byte for byte, streamed traces included.
    let folder = cwd.join("target/pdkv").join(runs[0].1);
    let files = ["result.json", "trace.txt", "index.html", "nic_balance.svg"];
    let first: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(folder.join(f)).unwrap()).collect();
    assert_eq!(pdkv_in(&cwd, &plain).status.code(), Some(0));
    for (file, first) in files.iter().zip(&first) {
        let again = std::fs::read(folder.join(file)).unwrap();
        assert!(*first == again, "the same run gives the same {file}");
    }
    assert_eq!(std::fs::read_dir(cwd.join("target/pdkv")).unwrap().count(), 4, "and no new folder");
    std::fs::remove_dir_all(&cwd).ok();
}

#[test]
fn a_shrunk_scenario_is_a_run_of_its_own_and_not_as_expected() {
    let cwd = out_dir("shrunk");
    std::fs::create_dir_all(&cwd).unwrap();
    let out = pdkv_in(&cwd, &["explore", "notify-drift", "--seeds", "1", "--jobs", "1", "--out", "found"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let file = cwd.join("found/notify-drift-seed0-shrunk.ron");
    let ron = std::fs::read_to_string(&file).expect("the shrunk scenario is written under its own name");
    assert!(ron.contains("name: \"notify-drift-seed0-shrunk\""), "{ron}");
    assert!(ron.contains("It breaks the property freed-by-releases"), "{ron}");
    assert!(ron.contains("its outcome is leak"), "{ron}");
    assert!(!ron.contains("expect:") && !ron.contains("expect_jain:"), "no stale expectation: {ron}");
    // The original keeps its report; the shrunk run gets its own and says it is not clean.
    assert_eq!(pdkv_in(&cwd, &["run", "notify-drift"]).status.code(), Some(0));
    let out = pdkv_in(&cwd, &["run", "found/notify-drift-seed0-shrunk.ron"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    // Shrinking also took a decode rank away: one reader of each prefill rank shows the drift.
    assert!(text.starts_with("pdkv run notify-drift-seed0-shrunk (1P_DP2:1D_TP1)\n"), "{text}");
    assert!(text.contains("outcome      leak (expected clean: NOT AS EXPECTED)"), "{text}");
    for folder in ["notify-drift", "notify-drift-seed0-shrunk"] {
        assert!(cwd.join("target/pdkv").join(folder).join("index.html").exists(), "{folder}");
    }
    std::fs::remove_dir_all(&cwd).ok();
}

/// Sweeps `specs` at C = 4 and 8 with two requests per client into a fresh folder; returns the
/// folder, the printed table and sweep.json.
fn sweep_small(name: &str, specs: &[&str]) -> (PathBuf, String, serde_json::Value) {
    let dir = out_dir(name);
    let mut args = vec!["sweep"];
    args.extend_from_slice(specs);
    args.extend(["--concurrency", "4,8", "--requests-per-client", "2", "--out", dir.to_str().unwrap()]);
    let out = pdkv(&args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("sweep.json")).unwrap()).unwrap();
    (dir, text, json)
}

/// A sweep's points run on --jobs threads; the report (every file, and what is printed) is the
/// same byte for byte on one thread or three.
#[test]
fn a_sweep_is_the_same_on_any_number_of_threads() {
    let sweep = |jobs: &str| {
        let dir = out_dir(&format!("sweep-jobs-{jobs}"));
        let args = [
            "sweep",
            "1P_TP8:1D_TP8",
            "notify-drift",
            "notify-drift-fixed",
            "--concurrency",
            "2,4,8",
            "--requests-per-client",
            "2",
            "--jobs",
            jobs,
            "--out",
            dir.to_str().unwrap(),
        ];
        let out = pdkv(&args);
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()))
            .collect();
        files.sort();
        std::fs::remove_dir_all(&dir).ok();
        // The report line names the folder, which differs; everything else is compared.
        let text: String =
            String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.starts_with("report:")).collect();
        (out.status.code(), text, files)
    };
    let one = sweep("1");
    assert_eq!(one.0, Some(0), "{}", one.1);
    assert!(one.2.len() >= 7, "sweep.json, index.html and three charts as PNG and SVG: {:?}", one.2.len());
    for jobs in ["2", "3"] {
        let other = sweep(jobs);
        assert_eq!((other.0, &other.1), (one.0, &one.1), "--jobs {jobs}");
        let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&other.2), names(&one.2), "--jobs {jobs}");
        for ((name, a), (_, b)) in one.2.iter().zip(&other.2) {
            assert!(a == b, "--jobs {jobs}: {name} differs");
        }
    }
}

#[test]
fn sweep_compares_deployments_across_concurrency() {
    let (dir, text, json) = sweep_small("sweep", &["1P_TP8-1D_TP8", "2P_TP8-1D_DP8EP-h200"]);
    assert_eq!(text.lines().filter(|l| l.contains(" C=")).count(), 4, "{text}");
    check_report(&dir, &["sweep_throughput", "sweep_ttft", "sweep_tpot"]);
    assert_eq!(json.as_array().unwrap().len(), 4);
    // The output names what produced the figures: each line's hardware and model, and the
    // calibration, in the terminal and on the page.
    let record = pdkv_sim::calibration::current();
    let calibration = record.summary();
    let index = std::fs::read_to_string(dir.join("index.html")).unwrap();
    for (line, words) in [
        ("1P_TP8-1D_TP8", "built-in MI300X-class defaults, DeepSeek-R1 (no profile named)"),
        ("2P_TP8-1D_DP8EP-h200", "gpu h200-sxm, nic cx7-400g, model deepseek-r1 (profiles/*.ron)"),
    ] {
        assert!(text.contains(&format!("\n  {line:<24} {words}\n")), "{text}");
        assert!(index.contains(&format!("<tr><td>{line}</td><td>{words}</td></tr>")), "{index}");
    }
    assert!(text.contains(&format!("\n{calibration}\nreport: ")), "{text}");
    assert!(
        calibration.starts_with(&format!("calibration {}: fitting worst ", record.name)),
        "{calibration}"
    );
    assert!(index.contains(&format!("<p>{}</p>", pdkv_reports::page::escape(&calibration))), "{index}");
    let svg = std::fs::read_to_string(dir.join("sweep_tpot.svg")).unwrap();
    assert!(svg.contains(&format!("calibration {})", record.name)), "the charts name the calibration");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sweep_of_a_bug_and_its_fix_draws_one_line_each() {
    let (dir, text, json) = sweep_small("sweep-twins", &["proxy-aliasing", "proxy-aliasing-fixed"]);
    let rows: Vec<&str> = text.lines().filter(|l| l.contains(" C=")).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(rows[..2].iter().all(|r| r.starts_with("proxy-aliasing ")), "{text}");
    assert!(rows[2..].iter().all(|r| r.starts_with("proxy-aliasing-fixed ")), "{text}");
    let runs: Vec<&str> = json.as_array().unwrap().iter().map(|p| p["run"].as_str().unwrap()).collect();
    assert_eq!(runs, ["proxy-aliasing", "proxy-aliasing", "proxy-aliasing-fixed", "proxy-aliasing-fixed"]);
    assert!(json.as_array().unwrap().iter().all(|p| p["deployment"] == "2P_DP8EP:1D_TP8"));
    let svg = std::fs::read_to_string(dir.join("sweep_throughput.svg")).unwrap();
    assert!(svg.contains("4 points · 2 lines"), "one line per scenario");
    let index = std::fs::read_to_string(dir.join("index.html")).unwrap();
    assert!(index.contains("<tr><td>proxy-aliasing-fixed</td><td>2P_DP8EP:1D_TP8</td><td>8</td>"), "{index}");
    // The same scenario twice would draw one line over the other.
    let twice = pdkv(&["sweep", "proxy-aliasing", "proxy-aliasing", "--out", dir.to_str().unwrap()]);
    assert_eq!(twice.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&twice.stderr).contains("proxy-aliasing is in the sweep twice"));
    std::fs::remove_dir_all(&dir).ok();
}

/// A scenario that overrides fields of its profiles ("H200 with FP8 off") runs on its own
/// values, names the overrides in its summary and `result.json`, and replays byte for byte: the
/// printed scenario keeps the list and the values, `bf16_tflops` at its default included.
#[test]
fn overridden_profile_fields_run_are_recorded_and_replay() {
    let dir = out_dir("overrides");
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = |name: &str, overrides: &str| {
        let file = dir.join(format!("{name}.ron"));
        let text = format!(
            "(name: \"{name}\", deployment: \"1P_TP8:1D_TP8\", profiles: (gpu: \"h200-sxm\", nic: \"cx7-400g\"{overrides}),\n\
             workload: (clients: Closed(concurrency: 2, requests: 4), input_tokens: Fixed(8192), output_tokens: Fixed(8)))"
        );
        std::fs::write(&file, text).unwrap();
        file.to_string_lossy().into_owned()
    };
    let run = |file: &str, out: &str| {
        let out = dir.join(out);
        let run = pdkv(&["run", file, "--no-trace", "--out", out.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&run.stdout).into_owned();
        assert_eq!(run.status.code(), Some(0), "{file}: {text}{}", String::from_utf8_lossy(&run.stderr));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("result.json")).unwrap()).unwrap();
        (text, json, out)
    };
    let profile = scenario("h200", "");
    let fp8_off = scenario(
        "h200-fp8-off",
        ", overrides: [\"hardware.fp8_tflops\", \"hardware.bf16_tflops\"]), hardware: (fp8_tflops: 1300, bf16_tflops: 1300",
    );
    let (_, plain, _) = run(&profile, "plain");
    let (text, json, out) = run(&fp8_off, "fp8-off");
    assert!(
        text.contains(
            "\n  profiles     gpu h200-sxm, nic cx7-400g; overridden: hardware.fp8_tflops, hardware.bf16_tflops \
             (profiles/*.ron)\n"
        ),
        "{text}"
    );
    assert_eq!(
        json["profiles"]["overrides"],
        serde_json::json!(["hardware.fp8_tflops", "hardware.bf16_tflops"])
    );
    assert!(plain["profiles"].get("overrides").is_none(), "{}", plain["profiles"]);
    let printed = json["scenario_ron"].as_str().unwrap();
    assert!(printed.contains("fp8_tflops: 1300.0,") && printed.contains("bf16_tflops: 1300.0,"), "{printed}");
    // FP8 at 1,300 TFLOP/s instead of the H200's 1,979 slows prefill's linear layers by half;
    // BF16 at 1,300 instead of 989 speeds its attention, which runs in BF16. Prefill is still
    // slower (TTFT 1.14 times the profile's).
    let ttft = |json: &serde_json::Value| json["latency_ms"]["ttft"]["mean"].as_f64().unwrap();
    assert!(ttft(&json) > 1.1 * ttft(&plain), "{} vs {}", ttft(&json), ttft(&plain));
    let replay = pdkv(&["replay", out.join("result.json").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&replay.stdout);
    assert_eq!(replay.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&replay.stderr));
    assert!(text.contains("result byte-identical"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// (arguments) -> (exit code, text the output must contain).
#[test]
fn scenarios_and_bad_input_table() {
    let check = |args: &[&str], code: i32, text: &str| {
        let out = pdkv(args);
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(code), "{args:?}: {all}");
        assert!(all.contains(text), "{args:?}: {all}");
    };
    check(&["scenarios"], 0, "lazy-handshake-delayed-reply-fixed");
    check(&["scenarios"], 0, "proxy-aliasing");
    check(&["--help"], 0, "Examples:");
    check(&["run", "--help"], 0, "Examples:");
    check(&["sweep", "--help"], 0, "Examples:");
    check(&["replay", "--help"], 0, "Examples:");
    check(&["scenarios", "--help"], 0, "Examples:");
    check(&["run", "9P_TP8"], 2, "':' between the prefill and decode sides");
    check(&["run", "missing.ron"], 2, "cannot read the scenario file");
    check(&["replay", "missing.json"], 2, "cannot read missing.json");
    check(&["sweep", "1P_TP8:1D_TP8", "--concurrency", "0"], 2, "at least 1");
    check(&["scenarios"], 0, "(profiles: gpu h200-sxm, nic cx7-400g, model deepseek-r1)");
    check(&["profiles"], 0, "GPU profiles (profiles/gpus.ron)");
    check(&["profiles", "cx7-400g"], 0, "https://github.com/ROCm/mori/blob/");
    check(&["profiles", "h300"], 2, "no profile is named `h300`; known profiles: mi300x,");
    check(&["profiles", "--help"], 0, "Examples:");
    check(
        &["run", "sim/testdata/bad/profile_unknown_gpu.ron"],
        2,
        "sim/testdata/bad/profile_unknown_gpu.ron:5:16: field `profiles.gpu`: unknown GPU profile `h300`",
    );
    check(
        &["run", "sim/testdata/bad/profile_conflict.ron"],
        2,
        "field `hardware.hbm_gb`: is 192.0 but the GPU profile `h200-sxm`",
    );
}
