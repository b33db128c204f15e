//! The `index.html` summary pages of a run and of a sweep: tables, pictures, the scenario and the
//! command that reproduces it, self-contained (no scripts, no external files but its own).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use pdkv_sim::result::RunResult;

use crate::{RunPictures, SweepPoint};

/// Escapes text for HTML element content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:'DejaVu Sans',sans-serif;margin:2em;max-width:1400px;color:#222}\
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em}table{border-collapse:collapse}\
td,th{border:1px solid #ccc;padding:4px 10px;text-align:left;vertical-align:top}\
th{background:#f3f3f3}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}\
pre{background:#f7f7f7;padding:1em;overflow-x:auto}.bad{color:#b00;font-weight:bold}\
.good{color:#070;font-weight:bold}code{background:#f3f3f3;padding:0 3px}";

fn head(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n\
         <style>{STYLE}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
        escape(title),
        escape(title)
    )
}

/// The file name of `path` (pictures sit next to the page, so links are relative).
fn name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default()
}

/// Pictures as `<img>` of each PNG, linked to its SVG twin when there is one.
fn pictures(images: &[PathBuf]) -> String {
    let mut out = String::new();
    for png in images.iter().filter(|p| p.extension().is_some_and(|x| x == "png")) {
        let png_name = name(png);
        let svg_name = png_name.replace(".png", ".svg");
        let has_svg = images.iter().any(|p| name(p) == svg_name);
        let _ = write!(out, "<figure>\n<img src=\"{}\" alt=\"{}\">\n", escape(&png_name), escape(&png_name));
        if has_svg {
            let _ = writeln!(
                out,
                "<figcaption><a href=\"{}\">{} (SVG)</a></figcaption>",
                escape(&svg_name),
                escape(&svg_name)
            );
        }
        out.push_str("</figure>\n");
    }
    out
}

/// The section of a run page under NIC pictures that aggregate by node: how they aggregate, a
/// list of the nodes drawn GPU by GPU with why and links to each file, then their pictures.
fn drill_downs(aggregation: &str, nodes: &[crate::DrillDown]) -> String {
    let mut out =
        format!("<h2>NIC pictures by node: drill-down</h2>\n<p>{}</p>\n<ul>\n", escape(aggregation));
    for node in nodes {
        let links: Vec<String> = node
            .files
            .iter()
            .map(|file| format!("<a href=\"{}\">{}</a>", escape(&name(file)), escape(&name(file))))
            .collect();
        let _ = writeln!(
            out,
            "<li><b>{}</b>: {}. {}</li>",
            escape(&node.node),
            escape(&node.why),
            links.join(", ")
        );
    }
    out.push_str("</ul>\n");
    for node in nodes {
        let _ = writeln!(out, "<h3>Node {}</h3>", escape(&node.node));
        out.push_str(&pictures(&node.files));
    }
    out
}

fn row(out: &mut String, key: &str, value: &str) {
    let _ = writeln!(out, "<tr><th>{}</th><td>{}</td></tr>", escape(key), value);
}

/// Writes `dir/index.html` for one run: summary table (with the profiles and `calibration`, the
/// one-line summary of the calibration that produced the figures); each hang with its wait-for graph (first,
/// since a hung run has little else to show) and its edges; violations; the other pictures, and
/// a sentence for each left out for want of data; the run's `files` (name, what it is) and
/// `notes` about them (a trace cut at its size limit); the scenario text and the command that
/// reproduces the run.
pub fn write_run_page(
    dir: &Path,
    result: &RunResult,
    pictures_of_run: &RunPictures,
    calibration: &str,
    command: &str,
    files: &[(&str, &str)],
    notes: &[String],
) -> std::io::Result<PathBuf> {
    let images = &pictures_of_run.files;
    let is_hang = |p: &PathBuf| name(p).starts_with("wait_for_");
    let r = result;
    let mut html = head(&format!("pdkv run {}", r.title()));
    let verdict = if r.as_expected() {
        "<span class=\"good\">as expected</span>"
    } else {
        "<span class=\"bad\">NOT as expected</span>"
    };
    html.push_str("<table>\n");
    row(&mut html, "outcome", &format!("{} (expected {}) {verdict}", r.outcome.name(), r.expected.name()));
    row(&mut html, "seed", &r.seed.to_string());
    if !r.profiles.is_empty() {
        row(&mut html, "profiles", &escape(&format!("{} (profiles/*.ron)", r.profiles)));
    }
    row(&mut html, "calibration", &escape(calibration));
    let q = &r.requests;
    row(
        &mut html,
        "requests",
        &format!(
            "{} sent, {} finished, {} failed ({} excused by faults, {} unexcused), {} unfinished, {} unsent",
            q.sent, q.finished, q.failed, q.failed_excused, q.failed_unexcused, q.unfinished, q.unsent
        ),
    );
    row(&mut html, "duration", &format!("{:.1} s virtual, {} events", r.duration_s, r.events));
    let t = &r.throughput;
    row(
        &mut html,
        "throughput (whole run)",
        &format!("{:.0} tok/s total, {:.0} tok/s output", t.total_tok_s, t.output_tok_s),
    );
    let l = &r.latency_ms;
    let missing = |what: &str| match r.requests.finished {
        0 => "n/a (no request finished)".to_string(),
        _ => format!("n/a (no finished request {what})"),
    };
    let ttft = l.ttft.map_or_else(
        || missing("measured one"),
        |t| format!("mean {:.0} ms, p50 {:.0} ms, p99 {:.0} ms", t.mean, t.p50, t.p99),
    );
    row(&mut html, "TTFT (whole run)", &ttft);
    let tpot = l.tpot.map_or_else(
        || missing("produced a second token"),
        |t| format!("mean {:.1} ms, p50 {:.1} ms, p99 {:.1} ms", t.mean, t.p50, t.p99),
    );
    row(&mut html, "TPOT (whole run)", &tpot);
    let itl = l.itl.map_or_else(
        || missing("produced a second token"),
        |t| format!("mean {:.1} ms, p99 {:.1} ms", t.mean, t.p99),
    );
    row(&mut html, "ITL (whole run)", &itl);
    let n = &r.nic;
    if let Some(spread) = n.spread().map(|text| escape(&text)) {
        let gpus = n.reads_per_prefill_gpu.len();
        let text = match (n.jain, n.jain_bytes) {
            (Some(jain), bytes) => format!(
                "Jain {jain:.3} (bytes {}) over {gpus} prefill GPUs; {spread}",
                bytes.map_or("n/a".to_string(), |b| format!("{b:.3}"))
            ),
            (None, _) => "Jain n/a: no prefill GPU served a read".to_string(),
        };
        row(&mut html, "NIC balance", &text);
    }
    let g = &r.ledger;
    row(
        &mut html,
        "block ledger",
        &format!(
            "{} freed, {} reaped ({} excused: decode crashed or a release was lost), {} still held, {} lost in crashes; longest hold {:.0} ms; \
             prefill stalled {:.1} s",
            g.freed, g.reaped, g.reaped_excused, g.held, g.lost_in_crash, g.max_hold_ms, g.prefill_stall_s
        ),
    );
    html.push_str("</table>\n");
    html.push_str(&steady_section(r));
    for (i, hang) in r.hangs.iter().enumerate() {
        let _ = writeln!(html, "<h2 class=\"bad\">Hang {}: {}</h2>", i + 1, escape(&hang.what));
        let stem = format!("wait_for_{i}.");
        let graph: Vec<PathBuf> = images.iter().filter(|p| name(p).starts_with(&stem)).cloned().collect();
        html.push_str(&pictures(&graph));
        html.push_str("<pre>");
        for edge in &hang.wait_for {
            let _ = writeln!(html, "{}", escape(&edge.to_string()));
        }
        if let Some(cycle) = &hang.cycle {
            let members: Vec<String> = cycle.iter().map(ToString::to_string).collect();
            let _ = writeln!(html, "cycle (deadlock): {}", escape(&members.join(" -> ")));
        }
        html.push_str("</pre>\n");
    }
    if !r.violations.is_empty() {
        let _ = writeln!(html, "<h2 class=\"bad\">Safety violations ({})</h2>\n<table>", r.violations.len());
        html.push_str("<tr><th>time (ms)</th><th>check</th><th>detail</th></tr>\n");
        for v in r.violations.iter().take(50) {
            let _ = writeln!(
                html,
                "<tr><td>{:.3}</td><td>{}</td><td>{}</td></tr>",
                v.t_ms,
                escape(v.kind.name()),
                escape(&v.detail)
            );
        }
        html.push_str("</table>\n");
    }
    html.push_str("<h2>Pictures</h2>\n");
    let others: Vec<PathBuf> = images.iter().filter(|p| !is_hang(p)).cloned().collect();
    html.push_str(&pictures(&others));
    for sentence in &pictures_of_run.omitted {
        let _ = writeln!(html, "<p>{}</p>", escape(sentence));
    }
    if let Some(aggregation) = &pictures_of_run.aggregation {
        html.push_str(&drill_downs(aggregation, &pictures_of_run.drill_downs));
    }
    html.push_str("<h2>Files</h2>\n<ul>\n");
    for (file, what) in files {
        let (file, what) = (escape(file), escape(what));
        let _ = writeln!(html, "<li><a href=\"{file}\">{file}</a> ({what})</li>");
    }
    html.push_str("</ul>\n");
    for note in notes {
        let _ = writeln!(html, "<p>{}</p>", escape(note));
    }
    let _ = writeln!(html, "<h2>Reproduce</h2>\n<pre>{}</pre>", escape(command));
    let _ = writeln!(html, "<h2>Scenario</h2>\n<pre>{}</pre>", escape(&r.scenario_ron));
    html.push_str("</body>\n</html>\n");
    let path = dir.join("index.html");
    pdkv_sim::files::write_atomic(&path, html.as_bytes())?;
    Ok(path)
}

/// The run page's "Steady state" section: the window in words, GPUs by side, a table of mean,
/// p50, p90 and p99 of TTFT, TPOT, ITL and E2E, the rates overall, per GPU and per phase, and
/// goodput when the scenario sets an SLO: the figures of `pdkv run`'s summary, which users hold
/// against `vllm bench serve`.
fn steady_section(r: &RunResult) -> String {
    let pdkv_sim::result::Steady { window, latency_ms: l, throughput: t, goodput } = &r.steady;
    let mut html = String::from("<h2>Steady state</h2>\n<table>\n");
    row(&mut html, "window", &escape(&window.describe(r.requests.sent)));
    row(&mut html, "GPUs", &format!("{} prefill, {} decode", r.gpus.prefill, r.gpus.decode));
    if r.requests.finished == 0 {
        // Rates of nothing would read as measured zeros.
        row(&mut html, "figures", "n/a (no request finished)");
        html.push_str("</table>\n");
        return html;
    }
    row(&mut html, "rate", &escape(&t.rate_text()));
    row(&mut html, "per GPU", &escape(&t.per_gpu_text()));
    let goodput = goodput.as_ref().map_or_else(
        || "n/a (no SLO: --slo-ttft-ms, --slo-tpot-ms or the scenario's slo)".to_string(),
        |g| escape(&g.text()),
    );
    row(&mut html, "goodput", &goodput);
    html.push_str(
        "</table>\n<table>\n<tr><th>ms</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th></tr>\n",
    );
    for (name, summary) in [("TTFT", l.ttft), ("TPOT", l.tpot), ("ITL", l.itl), ("E2E", l.e2e)] {
        let _ = match summary {
            Some(x) => writeln!(
                html,
                "<tr><td>{name}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
                x.mean, x.p50, x.p90, x.p99
            ),
            None => writeln!(html, "<tr><td>{name}</td><td colspan=\"4\">n/a</td></tr>"),
        };
    }
    html.push_str("</table>\n");
    html
}

/// What produced a sweep's figures, as its page names it: the hardware and model of each line
/// and the calibration of the cost model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Provenance {
    /// (line, where its hardware and model come from), in the sweep's order, e.g.
    /// `("2P_TP8-1D_DP8EP-h200", "gpu h200-sxm, nic cx7-400g, model deepseek-r1 (profiles/*.ron)")`.
    pub lines: Vec<(String, String)>,
    /// The calibration's one-line summary.
    pub calibration: String,
}

/// Writes `dir/index.html` for a sweep: one table row per run, the model that produced the
/// figures (profiles per line, the calibration), the charts and the command.
pub fn write_sweep_page(
    dir: &Path,
    points: &[SweepPoint],
    images: &[PathBuf],
    provenance: &Provenance,
    command: &str,
) -> std::io::Result<PathBuf> {
    let mut html = head("pdkv sweep");
    let rates = points.iter().any(|p| p.rate_per_s.is_some());
    let _ = write!(
        html,
        "<table>\n<tr><th>run</th><th>deployment</th><th>{}</th><th>total tok/s</th><th>mean TTFT (ms)</th>",
        if rates { "rate (req/s)" } else { "concurrency" }
    );
    html.push_str("<th>mean TPOT (ms)</th><th>GPUs (prefill + decode)</th><th>steady tok/s per GPU</th>");
    html.push_str("<th>steady TTFT p50 / p99 (ms)</th>");
    html.push_str("<th>goodput req/s per GPU</th><th>outcome</th></tr>\n");
    for p in points {
        let load = p.rate_per_s.map_or_else(|| p.concurrency.to_string(), |r| r.to_string());
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{load}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{} ({} + {})</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&p.run),
            escape(&p.deployment),
            p.total_tok_s,
            p.ttft_mean_ms.map_or("n/a".to_string(), |v| format!("{v:.0}")),
            p.tpot_mean_ms.map_or("n/a".to_string(), |v| format!("{v:.1}")),
            p.gpus.total(),
            p.gpus.prefill,
            p.gpus.decode,
            p.steady.throughput.total_tok_s_per_gpu,
            p.steady.latency_ms.ttft.map_or("n/a".to_string(), |t| format!("{:.0} / {:.0}", t.p50, t.p99)),
            p.steady.goodput.map_or("n/a (no SLO)".to_string(), |g| format!("{:.4}", g.requests_per_s_per_gpu)),
            escape(p.outcome.name())
        );
    }
    html.push_str("</table>\n<h2>Model</h2>\n<table>\n<tr><th>line</th><th>hardware and model</th></tr>\n");
    for (line, hardware) in &provenance.lines {
        let _ = writeln!(html, "<tr><td>{}</td><td>{}</td></tr>", escape(line), escape(hardware));
    }
    let _ = writeln!(html, "</table>\n<p>{}</p>", escape(&provenance.calibration));
    html.push_str("<h2>Charts</h2>\n");
    html.push_str(&pictures(images));
    html.push_str("<h2>Files</h2>\n<ul><li><a href=\"sweep.json\">sweep.json</a></li></ul>\n");
    let _ = writeln!(html, "<h2>Reproduce</h2>\n<pre>{}</pre>", escape(command));
    html.push_str("</body>\n</html>\n");
    let path = dir.join("index.html");
    pdkv_sim::files::write_atomic(&path, html.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_table() {
        let check = |input: &str, expected: &str| assert_eq!(escape(input), expected);
        check("a<b>&\"c\"'", "a&lt;b&gt;&amp;&quot;c&quot;&#39;");
        check("2P_TP8:1D_DP8EP", "2P_TP8:1D_DP8EP");
        check("", "");
    }

    #[test]
    fn the_sweep_page_names_profiles_per_line_and_the_calibration() {
        let dir = std::env::temp_dir().join(format!("pdkv-reports-sweep-page-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("made");
        let points = [SweepPoint {
            run: "a<b".into(),
            deployment: "1P_TP8:1D_TP8".into(),
            concurrency: 4,
            rate_per_s: None,
            gpus: pdkv_sim::result::Gpus { prefill: 16, decode: 8 },
            total_tok_s: 1000.0,
            ttft_mean_ms: None,
            tpot_mean_ms: Some(25.0),
            outcome: pdkv_sim::Outcome::Clean,
            steady: pdkv_sim::result::Steady::default(),
        }];
        let provenance = Provenance {
            lines: vec![
                ("a<b".into(), "built-in MI300X-class defaults, DeepSeek-R1 (no profile named)".into()),
                ("h200".into(), "gpu h200-sxm (profiles/*.ron)".into()),
            ],
            calibration: "calibration study-tp8-2026-12: fitting worst 16.4 %; validation not yet measured"
                .into(),
        };
        let page = write_sweep_page(&dir, &points, &[], &provenance, "pdkv sweep a").expect("written");
        let html = std::fs::read_to_string(page).expect("read");
        for text in [
            "<h2>Model</h2>",
            "<tr><td>a&lt;b</td><td>built-in MI300X-class defaults, DeepSeek-R1 (no profile named)</td></tr>",
            "<tr><td>h200</td><td>gpu h200-sxm (profiles/*.ron)</td></tr>",
            "<p>calibration study-tp8-2026-12: fitting worst 16.4 %; validation not yet measured</p>",
            "<td>24 (16 + 8)</td><td>0</td><td>n/a</td><td>n/a (no SLO)</td>",
        ] {
            assert!(html.contains(text), "{text}: {html}");
        }
        assert!(
            html.find("<h2>Model</h2>") < html.find("<h2>Charts</h2>"),
            "the model comes before the charts"
        );
        std::fs::remove_dir_all(&dir).expect("removed");
    }

    #[test]
    fn pictures_link_svg_twins() {
        let images = [
            PathBuf::from("/x/nic_balance.png"),
            PathBuf::from("/x/nic_balance.svg"),
            PathBuf::from("/x/a.png"),
        ];
        let html = pictures(&images);
        assert!(html.contains("<img src=\"nic_balance.png\""));
        assert!(html.contains("<a href=\"nic_balance.svg\">"));
        assert_eq!(html.matches("<img").count(), 2);
        assert_eq!(html.matches("(SVG)").count(), 1);
    }
}
