//! End-to-end tests of the public functions: the files written, PNG and SVG well formed, the
//! pictures saying what they should, and output byte-identical across renders.

use std::fs;
use std::path::{Path, PathBuf};

use pdkv_core::ports::SessionKey;
use pdkv_sim::result::{Hang, RunResult, Summary};
use pdkv_sim::waitfor::WaitReason;
use pdkv_sim::Scenario;

use crate::waitfor::nodes::*;

use crate::{
    latency_cdf, nic_balance, nic_utilisation, sweep_charts, wait_for_graph, ErrorBand, ReportError,
    SweepPoint,
};

/// The title of the run the synthetic hangs belong to.
const RUN: &str = "test-run (1P_TP8:1D_TP8)";

/// A fresh folder for one test under the system temp folder.
fn out_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdkv-reports-{test}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

/// Removes a test's folder once its checks passed (a failing test leaves it to look at).
fn done(dir: &Path) {
    fs::remove_dir_all(dir).expect("test folder removed");
}

/// Checks that the PNG signature starts `path` and the file is over 10 KB.
fn check_png(path: &Path) {
    let bytes = fs::read(path).expect("png readable");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}: no PNG signature", path.display());
    assert!(bytes.len() > 10 * 1024, "{}: only {} bytes", path.display(), bytes.len());
}

/// Checks that `path` is an SVG document with balanced tags; returns its text.
fn check_svg(path: &Path) -> String {
    let text = fs::read_to_string(path).expect("svg is UTF-8");
    let body = match text.trim_start().strip_prefix("<?xml") {
        Some(rest) => rest.split_once("?>").expect("XML declaration closes").1.trim_start(),
        None => text.trim_start(),
    };
    assert!(body.starts_with("<svg"), "{}: does not start with <svg", path.display());
    if let Err(e) = balanced(&text) {
        panic!("{}: {e}", path.display());
    }
    text
}

/// A small tag-balance check: every opened element is closed in order, the root is `svg`, and
/// nothing but whitespace follows it. Skips declarations, comments and self-closing tags.
fn balanced(text: &str) -> Result<(), String> {
    let mut open: Vec<String> = Vec::new();
    let mut rest = text;
    let mut roots = 0;
    while let Some(start) = rest.find('<') {
        if !open.is_empty() || rest[..start].trim().is_empty() {
        } else {
            return Err(format!("text outside the root: {:?}", &rest[..start]));
        }
        rest = &rest[start..];
        if let Some(after) = rest.strip_prefix("<!--") {
            rest = after.split_once("-->").ok_or("unclosed comment")?.1;
            continue;
        }
        if rest.starts_with("<?") || rest.starts_with("<!") {
            rest = rest.split_once('>').ok_or("unclosed declaration")?.1;
            continue;
        }
        // The tag runs to the first '>' outside quotes.
        let mut quote = None;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match (quote, c) {
                (None, '"' | '\'') => quote = Some(c),
                (Some(q), c) if c == q => quote = None,
                (None, '>') => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end.ok_or("unclosed tag")?;
        let tag = &rest[1..end];
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let name = name.trim();
            match open.pop() {
                Some(top) if top == name => {}
                Some(top) => return Err(format!("</{name}> closes <{top}>")),
                None => return Err(format!("</{name}> closes nothing")),
            }
            continue;
        }
        let name: String = tag.chars().take_while(|c| !c.is_whitespace() && *c != '/').collect();
        if name.is_empty() {
            return Err(format!("tag without a name: <{tag}>"));
        }
        if open.is_empty() {
            roots += 1;
            if roots > 1 || name != "svg" {
                return Err(format!("root element <{name}> (number {roots})"));
            }
        }
        if !tag.ends_with('/') {
            open.push(name);
        }
    }
    if !rest.trim().is_empty() {
        return Err(format!("text after the root: {rest:?}"));
    }
    match open.last() {
        Some(top) => Err(format!("<{top}> never closed")),
        None if roots == 1 => Ok(()),
        None => Err("no root element".to_string()),
    }
}

/// The names of `paths`, in order.
fn names(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.file_name().expect("a file").to_string_lossy().into_owned()).collect()
}

/// Percentiles 0..=100 of a distribution with a long tail from `lo` up.
fn percentiles(lo: f64, tail: f64) -> Vec<f64> {
    (0..=100)
        .map(|p| {
            let f = f64::from(p) / 100.0;
            let v = lo * (1.0 + 0.1 * f) + if p >= 90 { tail * (f - 0.9) * 10.0 } else { 0.0 };
            (v * 1000.0).round() / 1000.0
        })
        .collect()
}

/// The wait-for graph of the lost-reply hang: a collective, eight ranks, a vote and a listener.
fn lost_reply_hang() -> Hang {
    let mut wait_for = Vec::new();
    for t in 0..8 {
        wait_for.push(edge(collective(), rank(t), WaitReason::NotArrived));
        if t == 3 {
            wait_for.push(edge(rank(3), listener(3), blocked(3)));
        }
    }
    for t in [0, 1, 2, 4, 5, 6, 7] {
        wait_for.push(edge(rank(t), vote(), WaitReason::WaitingForMinVote));
    }
    wait_for.push(edge(vote(), rank(3), WaitReason::HasNotVoted));
    Hang {
        t_ms: 600_296.725,
        what: "TP collective D0 step 1 waited 600 s (timeout)".into(),
        ranks: (0..8).map(|t| format!("D0.dp0.tp{t}")).collect(),
        wait_for,
        cycle: None,
        dot: "digraph waitfor {\n  rankdir=LR;\n  n0 [label=\"TP collective D0 step 1\"];\n}\n".into(),
    }
}

/// A three-node deadlock (two ranks and a vote) with a self-loop and waiters outside the cycle.
/// The simulator's graphs have no cycle; this one is made up to draw one.
fn deadlock() -> Hang {
    let long = WaitReason::Handshake {
        session: SessionKey(
            "prefill-0:6301_dp0_tp1, a session key long enough to be cut short somewhere".into(),
        ),
    };
    Hang {
        t_ms: 1500.0,
        what: "release quorum never met".into(),
        ranks: vec!["P0.dp0.tp0".into()],
        wait_for: vec![
            edge(collective(), rank(0), WaitReason::NotArrived),
            edge(rank(0), vote(), WaitReason::WaitingForMinVote),
            edge(vote(), rank(1), WaitReason::HasNotVoted),
            edge(rank(1), rank(0), long),
            edge(rank(1), rank(1), WaitReason::RaisedOutOfStep),
            edge(rank(1), listener(1), blocked(1)),
        ],
        cycle: Some(vec![rank(0), rank(1), vote()]),
        dot: "digraph waitfor {\n  n0 -> n1 [label=\"x\"];\n}\n".into(),
    }
}

/// True when `svg` has a text element saying exactly `text` (plotters puts it on its own line).
fn says(svg: &str, text: &str) -> bool {
    svg.contains(&format!("\n{text}\n"))
}

/// A finished run over `notation` (prefill: `engines` engines of `dp` × `tp` GPUs) with uneven
/// reads, ragged utilisation rows and one hang.
fn result(notation: &str) -> RunResult {
    let (engines, dp, tp) = match notation {
        "2P_TP8:1D_DP8EP" => (2, 1, 8),
        "4P_DP2TP8:2D_DP8EP" => (4, 2, 8),
        "8P_DP8EP:4D_TP8" => (8, 8, 1),
        "1P_TP8:1D_TP8" => (1, 1, 8),
        "64P_TP8:8D_DP64EP" => (64, 1, 8),
        other => panic!("no prefill layout listed for {other}"),
    };
    let mut r = RunResult::empty(&Scenario::from_notation(notation), String::new());
    let mut gpus = Vec::new();
    for e in 0..engines {
        for d in 0..dp {
            for t in 0..tp {
                gpus.push(format!("P{e}.dp{d}.tp{t}"));
            }
        }
    }
    let n = gpus.len() as u64;
    r.duration_s = 312.968;
    r.requests.sent = 1280;
    r.requests.finished = 1270;
    r.requests.unfinished = 10;
    r.nic.reads_per_prefill_gpu = (0..n).map(|i| 60 + (i * 7) % 41).collect();
    r.nic.bytes_per_prefill_gpu = r.nic.reads_per_prefill_gpu.iter().map(|r| r * 287_834_112).collect();
    r.nic.prefill_gpus = gpus;
    r.nic.jain = Some(0.962);
    r.nic.jain_bytes = Some(0.962);
    r.nic.utilisation = (0..n as usize)
        .map(|i| {
            (0..280 + i % 9)
                .map(|s| if (s + i) % 3 == 0 { 0.0 } else { ((s * 13 + i) % 97) as f64 / 97.0 })
                .collect()
        })
        .collect();
    r.latency_ms.ttft = Some(Summary { mean: 3240.198, p50: 1938.709, p90: 9133.626, p99: 26718.338 });
    r.latency_ms.tpot = Some(Summary { mean: 26.165, p50: 26.228, p90: 26.229, p99: 26.229 });
    r.latency_ms.ttft_percentiles = percentiles(670.0, 27_000.0);
    r.latency_ms.tpot_percentiles = percentiles(25.2, 1.0);
    r.hangs = vec![lost_reply_hang()];
    r
}

/// A run in which nothing finished.
fn empty_result() -> RunResult {
    let mut r = RunResult::empty(&Scenario::from_notation("1P_TP8:1D_TP8"), String::new());
    r.duration_s = 600.297;
    r.nic.prefill_gpus = (0..8).map(|t| format!("P0.dp0.tp{t}")).collect();
    r.nic.reads_per_prefill_gpu = vec![0; 8];
    r.nic.bytes_per_prefill_gpu = vec![0; 8];
    r.nic.utilisation = vec![Vec::new(); 8];
    r
}

/// The band of a calibration not yet validated (no shading).
fn unmeasured() -> ErrorBand {
    ErrorBand::Unmeasured { fitting_error_max: 0.164, calibration: "study-tp8-2026-12".into() }
}

/// The band of a calibration validated on eight held-out points.
fn measured() -> ErrorBand {
    ErrorBand::Measured { half_width: 0.23, points: 8, calibration: "study-tp8-2026-12".into() }
}

/// The polygons of `svg` drawn with the error band's opacity (markers are opaque).
fn bands(svg: &str) -> usize {
    svg.matches("<polygon opacity=\"0.18\"").count()
}

fn sweep() -> Vec<SweepPoint> {
    let mut points = Vec::new();
    for (d, deployment) in ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP", "1P_TP4:1D_TP8"].iter().enumerate() {
        for (i, concurrency) in [32u32, 128, 512].iter().enumerate() {
            let k = (d * 3 + i) as f64;
            let hung = d == 2 && i == 2;
            let total_tok_s = if hung { 0.0 } else { 8000.0 * (1.0 + i as f64) + 900.0 * k };
            let mut steady = pdkv_sim::result::Steady::default();
            steady.throughput.total_tok_s_per_gpu = total_tok_s / 16.0;
            points.push(SweepPoint {
                run: deployment.to_string(),
                deployment: deployment.to_string(),
                concurrency: *concurrency,
                rate_per_s: None,
                gpus: pdkv_sim::result::Gpus { prefill: 8, decode: 8 },
                total_tok_s,
                ttft_mean_ms: if hung { None } else { Some(3000.0 * 6f64.powi(i as i32) + 100.0 * k) },
                tpot_mean_ms: if hung { None } else { Some(25.0 + k) },
                outcome: if hung { pdkv_sim::Outcome::Hang } else { pdkv_sim::Outcome::Clean },
                steady,
            });
        }
    }
    points
}

#[test]
fn nic_balance_writes_a_png_and_an_svg() {
    let dir = out_dir("nic-balance");
    for notation in ["2P_TP8:1D_DP8EP", "4P_DP2TP8:2D_DP8EP", "8P_DP8EP:4D_TP8"] {
        let paths = nic_balance(&result(notation), &dir).expect("draws");
        assert_eq!(names(&paths), ["nic_balance.png", "nic_balance.svg"]);
        check_png(&paths[0]);
        let svg = check_svg(&paths[1]);
        assert!(svg.contains("NIC balance per prefill GPU"), "{notation}");
        assert!(svg.contains("Jain index: reads 0.962, bytes 0.962"), "{notation}");
        assert!(svg.contains("ideal: the mean"), "{notation}");
        assert!(svg.contains("font-family=\"sans-serif\""), "{notation}");
    }
    let paths = nic_balance(&empty_result(), &dir).expect("draws");
    assert!(check_svg(&paths[1]).contains("no reads served"));
    // The title names the run in full: a long label shrinks the title rather than losing its end.
    let mut labelled = result("2P_TP8:1D_DP8EP");
    labelled.label =
        "2P_TP8:1D_DP8EP, C128 x1280 8K/1K, seed 12345, legacy no-flexible-reads+proxy-aliasing".into();
    let svg = check_svg(&nic_balance(&labelled, &dir).expect("draws")[1]);
    assert!(says(&svg, &format!("NIC balance per prefill GPU: {}", labelled.label)), "full title");
    labelled.label = "proxy-aliasing".into();
    let svg = check_svg(&nic_balance(&labelled, &dir).expect("draws")[1]);
    assert!(says(&svg, "NIC balance per prefill GPU: proxy-aliasing (2P_TP8:1D_DP8EP)"), "deployment added");
    done(&dir);
}

#[test]
fn nic_utilisation_writes_a_heatmap_with_its_scale() {
    let dir = out_dir("nic-utilisation");
    let paths = nic_utilisation(&result("2P_TP8:1D_DP8EP"), &dir).expect("draws");
    assert_eq!(names(&paths), ["nic_utilisation.png", "nic_utilisation.svg"]);
    check_png(&paths[0]);
    let svg = check_svg(&paths[1]);
    for text in ["virtual time (s)", "100 %", "0.1 %", "0 (idle)", "P1.dp0.tp7"] {
        assert!(svg.contains(text), "{text}");
    }
    // A long run is averaged into bins; an idle one says so.
    let mut long = result("1P_TP8:1D_TP8");
    long.duration_s = 2000.0;
    long.nic.utilisation =
        (0..8).map(|i| (0..2000).map(|s| ((s + i) % 10) as f64 / 10.0).collect()).collect();
    let svg = check_svg(&nic_utilisation(&long, &dir).expect("draws")[1]);
    assert!(svg.contains("3-second bins"));
    let svg = check_svg(&nic_utilisation(&empty_result(), &dir).expect("draws")[1]);
    assert!(svg.contains("no NIC traffic recorded"));
    assert!(svg.contains("mean 0.00 %"), "no negative zero");
    done(&dir);
}

#[test]
fn latency_cdf_marks_mean_and_p99_or_says_nothing_finished() {
    let dir = out_dir("latency-cdf");
    let paths = latency_cdf(&result("2P_TP8:1D_DP8EP"), &dir).expect("draws");
    assert_eq!(names(&paths), ["latency_cdf.png", "latency_cdf.svg"]);
    check_png(&paths[0]);
    let svg = check_svg(&paths[1]);
    for text in
        ["mean 3240 ms", "p99 26718 ms", "mean 26.16 ms", "p99 26.23 ms", "TTFT (ms), log scale", "TPOT (ms)"]
    {
        assert!(svg.contains(text), "{text}");
    }
    let paths = latency_cdf(&empty_result(), &dir).expect("draws");
    check_png(&paths[0]);
    let svg = check_svg(&paths[1]);
    assert_eq!(svg.matches("no finished requests").count(), 2);
    done(&dir);
}

#[test]
fn wait_for_graph_writes_pictures_and_the_dot_as_is() {
    let dir = out_dir("wait-for");
    let hang = lost_reply_hang();
    let paths = wait_for_graph(&hang, 3, RUN, &dir).expect("draws");
    assert_eq!(names(&paths), ["wait_for_3.png", "wait_for_3.svg", "wait_for_3.dot"]);
    check_png(&paths[0]);
    let svg = check_svg(&paths[1]);
    for text in [
        "Hang: test-run (1P_TP8:1D_TP8)",
        "TP collective D0 step 1 waited 600 s (timeout), detected at t = 600.3 s",
        "not arrived ×8",
        "waiting for the MIN vote ×7",
        "has not voted",
        "the waits end at: P0.dp0.tp3 handshake listener",
    ] {
        assert!(svg.contains(text), "{text}");
    }
    assert!(!says(&svg, "cycle"));
    assert_eq!(fs::read_to_string(&paths[2]).expect("dot"), hang.dot);
    done(&dir);
}

#[test]
fn wait_for_graph_with_a_cycle_renders_it_red() {
    let dir = out_dir("wait-for-cycle");
    let paths = wait_for_graph(&deadlock(), 0, RUN, &dir).expect("draws");
    check_png(&paths[0]);
    let svg = check_svg(&paths[1]);
    assert!(svg.contains(
        "5 waiters, 6 waits · cycle (deadlock) among: D0.dp0.tp0, D0.dp0.tp1, vote D0 group 0 step 1"
    ));
    assert!(says(&svg, "cycle"), "the cycle is labelled");
    assert!(svg.contains("#D62728"), "cycle members are red");
    assert_eq!(fs::read_to_string(&paths[2]).expect("dot"), deadlock().dot);
    // An empty graph and a lone self-loop draw too.
    let mut lone = deadlock();
    lone.wait_for = vec![edge(rank(0), rank(0), WaitReason::RaisedOutOfStep)];
    lone.cycle = Some(vec![rank(0)]);
    let svg = check_svg(&wait_for_graph(&lone, 1, RUN, &dir).expect("draws")[1]);
    assert!(svg.contains("1 waiters, 1 waits · cycle (deadlock) among: D0.dp0.tp0"));
    lone.wait_for.clear();
    let svg = check_svg(&wait_for_graph(&lone, 2, RUN, &dir).expect("draws")[1]);
    assert!(svg.contains("no wait-for edges recorded"));
    done(&dir);
}

#[test]
fn sweep_charts_write_four_charts_and_goodput_with_an_slo() {
    let dir = out_dir("sweep");
    let paths = sweep_charts(&sweep(), &unmeasured(), &dir).expect("draws");
    assert_eq!(
        names(&paths),
        [
            "sweep_throughput.png",
            "sweep_throughput.svg",
            "sweep_ttft.png",
            "sweep_ttft.svg",
            "sweep_tpot.png",
            "sweep_tpot.svg",
            "sweep_throughput_per_gpu.png",
            "sweep_throughput_per_gpu.svg"
        ]
    );
    for pair in paths.chunks(2) {
        check_png(&pair[0]);
        let svg = check_svg(&pair[1]);
        for text in
            ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP", "concurrency (clients in flight)", "32", "128", "512"]
        {
            assert!(says(&svg, text), "{text}");
        }
    }
    assert!(says(&check_svg(&paths[1]), "not clean: hang"));
    assert!(check_svg(&paths[3]).contains("mean TTFT (ms), log scale"));
    let svg = check_svg(&sweep_charts(&[], &unmeasured(), &dir).expect("draws")[1]);
    assert!(svg.contains("no sweep points"));
    // A bug and its fix on one deployment are two lines, each named by its run.
    let mut twins = sweep();
    twins.retain(|p| p.deployment == "2P_TP8:1D_DP8EP");
    let mut fixed = twins.clone();
    for (p, run) in twins
        .iter_mut()
        .map(|p| (p, "proxy-aliasing"))
        .chain(fixed.iter_mut().map(|p| (p, "proxy-aliasing-fixed")))
    {
        p.run = run.to_string();
    }
    twins.extend(fixed);
    let svg = check_svg(&sweep_charts(&twins, &unmeasured(), &dir).expect("draws")[1]);
    assert!(says(&svg, "proxy-aliasing") && says(&svg, "proxy-aliasing-fixed"));
    assert!(svg.contains("6 points · 2 lines"));
    // With an SLO, goodput per GPU; in a rate sweep the x axis is the rate.
    let mut rated = sweep();
    for (i, p) in rated.iter_mut().enumerate() {
        p.rate_per_s = Some([0.5, 1.0, 2.5][i % 3]);
        p.concurrency = 0;
        p.steady.goodput = Some(pdkv_sim::result::Goodput {
            slo: pdkv_sim::scenario::Slo { ttft_ms: Some(2000.0), tpot_ms: None },
            requests_per_s: 1.0,
            requests_per_s_per_gpu: 0.05 * (i + 1) as f64,
            met_fraction: 0.5,
        });
    }
    let paths = sweep_charts(&rated, &unmeasured(), &dir).expect("draws");
    assert_eq!(names(&paths[8..]), ["sweep_goodput_per_gpu.png", "sweep_goodput_per_gpu.svg"]);
    let svg = check_svg(&paths[9]);
    for text in [
        "Steady-state goodput per GPU against request rate",
        "request rate (arrivals per second)",
        "0.5",
        "2.5",
    ] {
        assert!(says(&svg, text), "{text}");
    }
    done(&dir);
}

/// (band, polygons shaded per chart, text the chart says): a measured error is shaded behind
/// each of the three lines and named; an unmeasured one is not drawn, and the chart says so.
#[test]
fn sweep_charts_shade_the_validation_error_or_say_there_is_none() {
    let dir = out_dir("sweep-band");
    let check = |band: ErrorBand, shaded: usize, says_text: &str| {
        for pair in sweep_charts(&sweep(), &band, &dir).expect("draws").chunks(2) {
            check_png(&pair[0]);
            let svg = check_svg(&pair[1]);
            assert_eq!(bands(&svg), shaded, "{}: {band:?}", pair[1].display());
            assert!(says(&svg, says_text), "{}: {says_text}", pair[1].display());
        }
    };
    check(
        measured(),
        3,
        "shaded: ± 23.0 % (median |error| on 8 held-out points, calibration study-tp8-2026-12)",
    );
    check(
        unmeasured(),
        0,
        "no validation error yet: the fit alone is off by up to 16.4 %, so read differences under ~20 % as \
         noise (calibration study-tp8-2026-12)",
    );
    // A band of zero width is no band.
    check(
        ErrorBand::Measured { half_width: 0.0, points: 8, calibration: "c".into() },
        0,
        "shaded: ± 0.0 % (median |error| on 8 held-out points, calibration c)",
    );
    // Every shaded point lies inside the plot frame, even where value × (1 + e) is off the axis.
    let svg = check_svg(&sweep_charts(&sweep(), &measured(), &dir).expect("draws")[1]);
    for polygon in svg.split("<polygon opacity=\"0.18\"").skip(1) {
        let points = polygon.split("points=\"").nth(1).and_then(|p| p.split('"').next()).expect("points");
        for xy in points.split_whitespace() {
            let (x, y) = xy.split_once(',').expect("x,y");
            let (x, y): (i32, i32) = (x.parse().expect("x"), y.parse().expect("y"));
            assert!((110..=950).contains(&x) && (108..=620).contains(&y), "{xy} outside the frame");
        }
    }
    done(&dir);
}

#[test]
fn rendering_twice_gives_identical_bytes() {
    let (a, b) = (out_dir("twice-a"), out_dir("twice-b"));
    let r = result("2P_TP8:1D_DP8EP");
    for dir in [&a, &b] {
        nic_balance(&r, dir).expect("draws");
        nic_utilisation(&r, dir).expect("draws");
        latency_cdf(&r, dir).expect("draws");
        wait_for_graph(&r.hangs[0], 0, &r.title(), dir).expect("draws");
        wait_for_graph(&deadlock(), 1, RUN, dir).expect("draws");
        sweep_charts(&sweep(), &unmeasured(), dir).expect("draws");
        sweep_charts(&sweep(), &measured(), &dir.join("band")).expect("draws");
    }
    let mut files: Vec<String> = fs::read_dir(&a)
        .expect("listed")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.extend(
        fs::read_dir(a.join("band"))
            .expect("listed")
            .map(|e| format!("band/{}", e.expect("entry").file_name().to_string_lossy())),
    );
    files.retain(|f| f != "band");
    files.sort();
    assert_eq!(files.len(), 28, "with the per-GPU throughput chart of each sweep");
    for file in &files {
        let (x, y) = (fs::read(a.join(file)).expect("read"), fs::read(b.join(file)).expect("read"));
        assert!(x == y, "{file} differs between two renders");
    }
    done(&a);
    done(&b);
}

#[test]
fn run_pictures_lead_with_hangs_and_leave_out_charts_without_data() {
    let dir = out_dir("run-pictures");
    // A hung run in which nothing finished and nothing was read.
    let mut hung = empty_result();
    hung.hangs = vec![lost_reply_hang()];
    let pictures = crate::run_pictures(&hung, 8, &dir).expect("draws");
    assert_eq!(names(&pictures.files), ["wait_for_0.png", "wait_for_0.svg", "wait_for_0.dot"]);
    assert_eq!(
        pictures.omitted,
        [
            "No NIC balance chart: no prefill GPU served a read.",
            "No NIC utilisation chart: no NIC carried any traffic.",
            "No latency chart: no request finished, so there is no TTFT or TPOT to plot.",
        ]
    );
    let page = crate::page::write_run_page(
        &dir,
        &hung,
        &pictures,
        "calibration c1: fitting worst 16.4 %",
        "pdkv run x",
        &[("result.json", "the versioned result"), ("trace.txt", "compact trace")],
        &["trace.txt stops at 1024 MiB".to_string()],
    )
    .expect("written");
    let html = fs::read_to_string(page).expect("read");
    // The files listed are the ones given, with their notes; no other trace is linked.
    assert!(
        html.contains(concat!(
            "<ul>\n<li><a href=\"result.json\">result.json</a> (the versioned result)</li>\n",
            "<li><a href=\"trace.txt\">trace.txt</a> (compact trace)</li>\n</ul>\n",
            "<p>trace.txt stops at 1024 MiB</p>\n"
        )),
        "{html}"
    );
    assert!(!html.contains("trace.json"), "{html}");
    let first = html.find("<img").map(|at| &html[at..]).unwrap_or_default();
    assert!(first.starts_with("<img src=\"wait_for_0.png\""), "{html}");
    let heading = html.find("<h2 class=\"bad\">Hang 1").expect("a heading for the hang");
    assert!(heading < html.find("<img").expect("a picture"), "the hang's heading comes first");
    assert!(html.contains("<p>No NIC balance chart: no prefill GPU served a read.</p>"), "{html}");
    for row in [
        "<tr><th>TTFT (whole run)</th><td>n/a (no request finished)</td></tr>",
        "<tr><th>TPOT (whole run)</th><td>n/a (no request finished)</td></tr>",
        "<tr><th>ITL (whole run)</th><td>n/a (no request finished)</td></tr>",
        "<tr><th>NIC balance</th><td>Jain n/a: no prefill GPU served a read</td></tr>",
    ] {
        assert!(html.contains(row), "{row}");
    }
    // The profiles the run used have a row, when it named any; the calibration always has one,
    // right after where the profiles' row goes.
    assert!(!html.contains("<th>profiles</th>"), "{html}");
    assert!(
        html.contains(&format!(
            "<tr><th>seed</th><td>{}</td></tr>\n<tr><th>calibration</th><td>calibration c1: fitting worst 16.4 %</td></tr>",
            hung.seed
        )),
        "{html}"
    );
    hung.profiles.gpu = Some("h200-sxm".into());
    let page = crate::page::write_run_page(&dir, &hung, &pictures, "calibration c1", "pdkv run x", &[], &[])
        .expect("written");
    let html = fs::read_to_string(page).expect("read");
    assert!(
        html.contains("<tr><th>profiles</th><td>gpu h200-sxm (profiles/*.ron)</td></tr>\n<tr><th>calibration</th><td>calibration c1</td></tr>"),
        "{html}"
    );
    // A run with data draws every chart, its wait-for graphs first.
    let pictures = crate::run_pictures(&result("1P_TP8:1D_TP8"), 8, &dir).expect("draws");
    let pngs: Vec<String> = names(&pictures.files).into_iter().filter(|n| n.ends_with(".png")).collect();
    assert_eq!(pngs, ["wait_for_0.png", "nic_balance.png", "nic_utilisation.png", "latency_cdf.png"]);
    assert!(pictures.omitted.is_empty());
    done(&dir);
}

/// The run page's steady section: the window in words, GPUs, rates, goodput (or why there is
/// none) and the percentile table; a run in which nothing finished shows no rates at all.
#[test]
fn the_run_page_shows_the_steady_window_as_the_summary_does() {
    use pdkv_sim::result::{Goodput, Gpus, Summary, Window, WindowKind};
    use pdkv_sim::scenario::Slo;
    let dir = out_dir("run-steady");
    fs::create_dir_all(&dir).expect("test folder");
    let page_of = |r: &RunResult| {
        let pictures = crate::RunPictures::default();
        let page =
            crate::page::write_run_page(&dir, r, &pictures, "c1", "pdkv run x", &[], &[]).expect("written");
        let html = fs::read_to_string(page).expect("read");
        let start = html.find("<h2>Steady state</h2>").expect("a steady section");
        let end = html[start..].find("<h2>Pictures</h2>").expect("pictures after it") + start;
        html[start..end].to_string()
    };
    let mut r = empty_result();
    r.requests.sent = 1280;
    r.gpus = Gpus { prefill: 16, decode: 8 };
    r.steady.window.kind = WindowKind::WholeRunAsked;
    assert_eq!(
        page_of(&r),
        "<h2>Steady state</h2>\n<table>\n\
         <tr><th>window</th><td>the whole run, as asked (1280 arrivals)</td></tr>\n\
         <tr><th>GPUs</th><td>16 prefill, 8 decode</td></tr>\n\
         <tr><th>figures</th><td>n/a (no request finished)</td></tr>\n</table>\n"
    );
    r.requests.finished = 1280;
    r.steady.window = Window {
        kind: WindowKind::Steady,
        warmup_requests: 128,
        drain_requests: 128,
        requests: 1024,
        start_s: 60.24,
        end_s: 480.5,
    };
    r.steady.latency_ms.ttft = Some(Summary { mean: 1612.34, p50: 1502.1, p90: 2890.0, p99: 5012.24 });
    r.steady.throughput.requests_per_s = 2.4;
    r.steady.throughput.requests_per_s_per_gpu = 0.1;
    let html = page_of(&r);
    for line in [
        "<tr><th>window</th><td>steady: arrivals 129 to 1152 of 1280 (warm-up 128, drain 128), 60.2 s to 480.5 s virtual</td></tr>",
        "<tr><th>rate</th><td>2.400 req/s, 0 tok/s (0 in, 0 out)</td></tr>",
        "<tr><th>goodput</th><td>n/a (no SLO: --slo-ttft-ms, --slo-tpot-ms or the scenario's slo)</td></tr>",
        "<tr><th>ms</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th></tr>",
        "<tr><td>TTFT</td><td>1612.3</td><td>1502.1</td><td>2890.0</td><td>5012.2</td></tr>",
        "<tr><td>TPOT</td><td colspan=\"4\">n/a</td></tr>",
    ] {
        assert!(html.contains(line), "{line}\n{html}");
    }
    r.steady.goodput = Some(Goodput {
        slo: Slo { ttft_ms: Some(3000.0), tpot_ms: None },
        requests_per_s: 2.1,
        requests_per_s_per_gpu: 0.0874,
        met_fraction: 0.876,
    });
    let html = page_of(&r);
    let goodput = "<tr><th>goodput</th><td>2.100 req/s (0.087 per GPU); 87.6% of the window&#39;s requests met TTFT &lt;= 3000 ms</td></tr>";
    assert!(html.contains(goodput), "{html}");
    done(&dir);
}

/// The bars of a balance picture's SVG: rectangles filled with a series colour above the legend
/// (whose swatches start below y = 660).
fn bars(svg: &str) -> usize {
    let above_legend = |line: &str| {
        let y = line.split(" y=\"").nth(1).and_then(|rest| rest.split('"').next());
        y.and_then(|y| y.parse::<i32>().ok()).is_some_and(|y| y < 660)
    };
    let fills: Vec<String> = crate::render::PALETTE
        .iter()
        .map(|c| format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2))
        .collect();
    svg.lines()
        .filter(|l| {
            l.trim_start().starts_with("<rect") && fills.iter().any(|f| l.contains(f)) && above_legend(l)
        })
        .count()
}

#[test]
fn a_thousand_gpu_run_aggregates_nic_pictures_by_node_with_drill_downs() {
    let dir = out_dir("by-node");
    // A 1,024-GPU deployment (512 prefill GPUs) whose reads are uneven within nodes and between
    // them: node P5 the busiest, node P9 the least busy, the most-read GPU on node P40.
    let mut r = result("64P_TP8:8D_DP64EP");
    r.nic.reads_per_prefill_gpu = (0..512u64)
        .map(|i| match (i / 8, i % 8) {
            (40, 3) => 200,
            (5, t) => 90 + t,
            (9, _) => 10,
            (_, t) => 40 + t,
        })
        .collect();
    r.nic.bytes_per_prefill_gpu = r.nic.reads_per_prefill_gpu.iter().map(|r| r * 1_000_000).collect();
    let pictures = crate::run_pictures(&r, 8, &dir).expect("draws");
    let pngs: Vec<String> = names(&pictures.files).into_iter().filter(|n| n.ends_with(".png")).collect();
    assert_eq!(pngs, ["wait_for_0.png", "nic_balance.png", "nic_utilisation.png", "latency_cdf.png"]);
    // The overview: one bar per node in each of its two panels, not one per GPU.
    let svg = check_svg(&dir.join("nic_balance.svg"));
    assert!(svg.contains("NIC balance per prefill node: "), "an overview by node");
    assert_eq!(bars(&svg), 2 * 64, "two panels of a bar per node");
    assert!(bars(&svg) <= 2 * crate::MAX_BARS);
    let svg = check_svg(&dir.join("nic_utilisation.svg"));
    assert!(svg.contains("NIC utilisation per prefill node: "), "a heatmap row per node");
    // The drill-downs: the busiest node, the node of the busiest GPU, the least busy node.
    let picked: Vec<(&str, &str)> =
        pictures.drill_downs.iter().map(|d| (d.node.as_str(), d.why.as_str())).collect();
    assert_eq!(
        picked,
        [
            ("P5", "busiest node: 93.5 reads per GPU on average"),
            ("P40", "holds the most-read GPU, P40.dp0.tp3 (200 reads)"),
            ("P9", "least busy node: 10.0 reads per GPU on average"),
        ]
    );
    for drill in &pictures.drill_downs {
        let svg = check_svg(&drill.files[1]);
        assert!(svg.contains(&format!("NIC balance on prefill node {}: ", drill.node)), "{}", drill.node);
        assert_eq!(bars(&svg), 2 * 8, "{}: a bar per GPU of the node", drill.node);
    }
    // The page says how the pictures aggregate and links every drill-down file, which exists.
    let page = crate::page::write_run_page(&dir, &r, &pictures, "calibration c1", "pdkv run x", &[], &[])
        .expect("written");
    let html = fs::read_to_string(page).expect("read");
    assert!(html.contains("<h2>NIC pictures by node: drill-down</h2>"), "{html}");
    assert!(html.contains("show one bar or row per node (64 nodes of up to 8 GPUs"), "{html}");
    let files: Vec<&PathBuf> = pictures.drill_downs.iter().flat_map(|d| &d.files).collect();
    assert_eq!(files.len(), 3 * 4, "balance and utilisation, PNG and SVG, per node");
    for file in files {
        let name = file.file_name().expect("a name").to_string_lossy().to_string();
        assert!(html.contains(&format!("<a href=\"{name}\">")), "{name} linked");
        assert!(file.exists(), "{name} written");
    }
    // The same data on 64 GPUs or fewer draws a bar per GPU, as before.
    let small = crate::run_pictures(&result("8P_DP8EP:4D_TP8"), 8, &dir).expect("draws");
    assert_eq!((small.aggregation, small.drill_downs.len()), (None, 0));
    assert_eq!(bars(&check_svg(&dir.join("nic_balance.svg"))), 2 * 64);
    done(&dir);
}

#[test]
fn errors_name_the_file() {
    let dir = out_dir("errors");
    fs::create_dir_all(&dir).expect("made");
    let blocker = dir.join("not-a-folder");
    fs::write(&blocker, "x").expect("written");
    let target = blocker.join("pictures");
    let err =
        nic_balance(&result("1P_TP8:1D_TP8"), &target).expect_err("cannot create a folder under a file");
    assert!(matches!(&err, ReportError::Io { path, .. } if path == &target), "{err:?}");
    assert!(err.to_string().starts_with(&target.display().to_string()), "{err}");
    assert!(std::error::Error::source(&err).is_some());
    // A folder where a picture goes.
    fs::create_dir_all(dir.join("p").join("latency_cdf.png")).expect("made");
    let err = latency_cdf(&empty_result(), &dir.join("p")).expect_err("png path is a folder");
    assert!(matches!(&err, ReportError::Io { path, .. } if path.ends_with("latency_cdf.png")), "{err:?}");
    // The DOT file is written after the pictures; a folder in its place fails on it alone.
    fs::create_dir_all(dir.join("g").join("wait_for_0.dot")).expect("made");
    let err = wait_for_graph(&deadlock(), 0, RUN, &dir.join("g")).expect_err("dot path is a folder");
    assert!(matches!(&err, ReportError::Io { path, .. } if path.ends_with("wait_for_0.dot")), "{err:?}");
    done(&dir);
}

#[test]
fn the_svg_checker_finds_unbalanced_tags() {
    assert_eq!(
        balanced("<?xml version=\"1.0\"?>\n<svg a=\"x>y\"><g><rect/></g><text>a</text></svg>\n"),
        Ok(())
    );
    assert!(balanced("<svg><g></svg>").is_err());
    assert!(balanced("<svg><g></g>").is_err());
    assert!(balanced("<svg></svg><svg></svg>").is_err());
    assert!(balanced("<g></g>").is_err());
    assert!(balanced("<svg></svg> trailing").is_err());
    assert!(balanced("<svg><!-- <g> --></svg>").is_ok());
}
