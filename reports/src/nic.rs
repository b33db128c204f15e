//! NIC pictures: reads and bytes per prefill GPU (`nic_balance`) and NIC use over time
//! (`nic_utilisation`).

use std::path::{Path, PathBuf};

use pdkv_sim::result::RunResult;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use crate::error::ReportError;
use crate::render::{
    dashed_h, fit, legend_row, note, render, series_colour, style, text, text_width, title, total, vertical,
    x_ticks, y_ticks, Area, Drawn, Frame, Msg, Picture, Scale, Swatch, AXIS, BAND, GRID, INK, MUTED,
    SUBTITLE, TICK,
};

/// Writes `nic_balance.png` and `nic_balance.svg` into `dir`: bars of reads and of gigabytes
/// served per prefill GPU in rank order, shaded by DP group and coloured by engine, with the
/// mean as a dashed "ideal" line and both Jain indices in the title. Returns the paths written
/// (PNG first).
pub fn nic_balance(result: &RunResult, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    render(dir, "nic_balance", &Balance { result, scope: Scope::All })
}

/// Writes `nic_utilisation.png` and `nic_utilisation.svg` into `dir`: a heatmap with one row
/// per prefill GPU and one column per virtual second, coloured by the fraction of NIC
/// bandwidth used (log colour scale from 0.1 % to 100 %, idle seconds white). Returns the
/// paths written (PNG first).
pub fn nic_utilisation(result: &RunResult, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    render(dir, "nic_utilisation", &Utilisation { result, scope: Scope::All })
}

// ---------------------------------------------------------------------------------------------
// Prefill GPU names and their grouping.

/// A run of consecutive GPUs sharing a label.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    label: String,
    start: usize,
    end: usize,
}

/// Prefill GPUs in rank order, with the labels used to group them on an axis.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Gpus {
    /// Full names (`P0.dp0.tp3`).
    names: Vec<String>,
    /// The innermost part that varies (`tp3`, or `dp3` when every DP rank has one GPU).
    inner: Vec<String>,
    /// Spans of the DP groups (`P0.dp0`), or of engines when DP ranks have one GPU each.
    groups: Vec<Span>,
    /// Spans of the engines (`P0`).
    engines: Vec<Span>,
    /// For each GPU, the index of its engine in `engines`.
    engine_of: Vec<usize>,
    /// What the labels under the bars say, for the subtitle.
    labelled: &'static str,
}

fn spans(keys: &[String]) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        match out.last_mut() {
            Some(span) if &span.label == key => span.end = i + 1,
            _ => out.push(Span { label: key.clone(), start: i, end: i + 1 }),
        }
    }
    out
}

impl Gpus {
    /// Groups `names` (`P<e>.dp<d>.tp<t>`; other names stand alone).
    fn new(names: &[String]) -> Gpus {
        let parts: Vec<Vec<&str>> = names.iter().map(|n| n.split('.').collect()).collect();
        let engine_key: Vec<String> = parts.iter().map(|p| p[0].to_string()).collect();
        let dp_key: Vec<String> = parts.iter().map(|p| p[..p.len().min(2)].join(".")).collect();
        let tp_varies = parts.iter().all(|p| p.len() == 3) && dp_key.windows(2).any(|w| w[0] == w[1]);
        let dp_varies = parts.iter().all(|p| p.len() >= 2) && engine_key.windows(2).any(|w| w[0] == w[1]);
        let (inner, group_key, labelled): (Vec<String>, &[String], _) = if tp_varies {
            (
                parts.iter().map(|p| p[2].to_string()).collect(),
                &dp_key,
                "bars labelled by TP rank under engine.DP rank",
            )
        } else if dp_varies {
            (
                parts.iter().map(|p| p[1].to_string()).collect(),
                &engine_key,
                "bars labelled by DP rank under engine",
            )
        } else {
            (names.to_vec(), &engine_key, "bars labelled by GPU")
        };
        let engines = spans(&engine_key);
        let mut engine_of = vec![0; names.len()];
        for (e, span) in engines.iter().enumerate() {
            engine_of[span.start..span.end].fill(e);
        }
        Gpus { names: names.to_vec(), inner, groups: spans(group_key), engines, engine_of, labelled }
    }

    fn len(&self) -> usize {
        self.names.len()
    }
}

/// `tp3` → `3`: the label without its letters.
fn digits(label: &str) -> String {
    let d: String = label.chars().filter(|c| c.is_ascii_digit()).collect();
    if d.is_empty() {
        label.to_string()
    } else {
        d
    }
}

/// The GPU names of `result`, padded with `gpu<i>` when a vector is longer than the names.
fn gpu_names(result: &RunResult) -> Vec<String> {
    let nic = &result.nic;
    let n = nic
        .prefill_gpus
        .len()
        .max(nic.reads_per_prefill_gpu.len())
        .max(nic.bytes_per_prefill_gpu.len())
        .max(nic.utilisation.len());
    (0..n).map(|i| nic.prefill_gpus.get(i).cloned().unwrap_or_else(|| format!("gpu{i}"))).collect()
}

// ---------------------------------------------------------------------------------------------
// Aggregation by node, for deployments with more GPUs than bars fit.

/// Above this many prefill GPUs the NIC pictures show one bar (or heatmap row) per node rather
/// than per GPU: past it a bar is narrower than its label and the picture stops being readable.
pub const MAX_BARS: usize = 64;

/// Consecutive prefill GPUs of one engine on one node (or on a run of nodes, when even nodes
/// are more than [`MAX_BARS`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Node {
    /// `P12` for an engine on one node, `P0.n3` for node 3 of engine P0, `P0.n8-15` for its
    /// nodes 8 to 15.
    pub label: String,
    /// The first GPU, in rank order.
    pub start: usize,
    /// One past the last GPU.
    pub end: usize,
}

/// Splits prefill GPUs (`names`, in rank order) into nodes of `gpus_per_node`. Each engine
/// starts on a node of its own, as the cost model assumes when it asks whether an EP group spans
/// nodes. When that gives more than `max_bars` nodes, runs of `m` nodes are merged, `m` the least
/// that fits (an engine is never merged with another, so with at most `max_bars` engines it fits).
pub(crate) fn nodes(names: &[String], gpus_per_node: u16, max_bars: usize) -> Vec<Node> {
    let engines = Gpus::new(names).engines;
    let per_node = usize::from(gpus_per_node.max(1));
    let count = |size: usize| engines.iter().map(|e| (e.end - e.start).div_ceil(size)).sum::<usize>();
    let mut merged = 1;
    while count(per_node * merged) > max_bars && engines.iter().any(|e| e.end - e.start > per_node * merged) {
        merged += 1;
    }
    let size = per_node * merged;
    let mut out = Vec::new();
    for engine in &engines {
        let chunks = (engine.end - engine.start).div_ceil(size);
        let nodes_in_engine = (engine.end - engine.start).div_ceil(per_node);
        for k in 0..chunks {
            let label = if chunks == 1 {
                engine.label.clone()
            } else if merged == 1 {
                format!("{}.n{k}", engine.label)
            } else {
                let (first, last) = (k * merged, ((k + 1) * merged).min(nodes_in_engine) - 1);
                if first == last {
                    format!("{}.n{first}", engine.label)
                } else {
                    format!("{}.n{first}-{last}", engine.label)
                }
            };
            let start = engine.start + k * size;
            out.push(Node { label, start, end: (start + size).min(engine.end) });
        }
    }
    out
}

/// The mean, least and greatest of one node's GPU values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Stat {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// Per node, the mean, least and greatest of `values` (one per GPU; missing GPUs count 0).
pub(crate) fn node_stats(values: &[f64], nodes: &[Node]) -> Vec<Stat> {
    nodes
        .iter()
        .map(|node| {
            let v: Vec<f64> = (node.start..node.end).map(|i| values.get(i).copied().unwrap_or(0.0)).collect();
            Stat {
                mean: total(&v) / v.len().max(1) as f64,
                min: v.iter().copied().fold(f64::INFINITY, f64::min),
                max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect()
}

/// Per node, the mean NIC utilisation of its GPUs in each second (a missing second counts 0).
fn node_rows(rows: &[Vec<f64>], nodes: &[Node]) -> Vec<Vec<f64>> {
    nodes
        .iter()
        .map(|node| {
            let gpus = &rows[node.start.min(rows.len())..node.end.min(rows.len())];
            let seconds = gpus.iter().map(Vec::len).max().unwrap_or(0);
            let size = (node.end - node.start).max(1) as f64;
            (0..seconds).map(|s| gpus.iter().filter_map(|row| row.get(s)).sum::<f64>() / size).collect()
        })
        .collect()
}

/// The axis of a per-node picture: a bar per node, grouped by engine, or, when every engine
/// sits on one node, labelled by engine under one bracket.
fn node_axis(gpus: &Gpus, nodes: &[Node]) -> Gpus {
    let names: Vec<String> = nodes.iter().map(|n| n.label.clone()).collect();
    let engine_of: Vec<usize> =
        nodes.iter().map(|n| gpus.engine_of.get(n.start).copied().unwrap_or(0)).collect();
    if nodes.len() == gpus.engines.len() {
        let label = match (names.first(), names.last()) {
            (Some(first), Some(last)) => format!("one node per engine, {first} to {last}"),
            _ => String::new(),
        };
        return Gpus {
            inner: names.clone(),
            names,
            groups: vec![Span { label, start: 0, end: nodes.len() }],
            engines: Vec::new(),
            engine_of: vec![0; nodes.len()],
            labelled: "one bar per node",
        };
    }
    let engine_key: Vec<String> = engine_of.iter().map(|&e| gpus.engines[e].label.clone()).collect();
    let inner = names
        .iter()
        .zip(&engine_key)
        // A run of nodes (`n8-15`) is labelled by its first node, as the axis has room for one number.
        .map(|(name, engine)| {
            let node = name.strip_prefix(&format!("{engine}.")).unwrap_or(name);
            node.split('-').next().unwrap_or(node).to_string()
        })
        .collect();
    let engines = spans(&engine_key);
    let mut engine_of = vec![0; names.len()];
    for (e, span) in engines.iter().enumerate() {
        engine_of[span.start..span.end].fill(e);
    }
    Gpus { names, inner, groups: engines.clone(), engines, engine_of, labelled: "one bar per node" }
}

/// The nodes worth a picture of their own, each with why: the busiest node by mean reads per
/// GPU, the node of the most-read GPU, and the least busy node (ties go to the first in rank
/// order; a node picked twice is listed once, with both reasons).
pub(crate) fn drill_downs(reads: &[f64], names: &[String], nodes: &[Node]) -> Vec<(usize, String)> {
    let stats = node_stats(reads, nodes);
    if stats.is_empty() {
        return Vec::new();
    }
    let first_by = |better: &dyn Fn(f64, f64) -> bool, key: &dyn Fn(usize) -> f64, n: usize| {
        (1..n).fold(0, |best, i| if better(key(i), key(best)) { i } else { best })
    };
    let busiest = first_by(&|a, b| a > b, &|i| stats[i].mean, stats.len());
    let idlest = first_by(&|a, b| a < b, &|i| stats[i].mean, stats.len());
    let gpu = first_by(&|a, b| a > b, &|i| reads.get(i).copied().unwrap_or(0.0), names.len().max(1));
    let gpu_node = nodes.iter().position(|n| (n.start..n.end).contains(&gpu)).unwrap_or(busiest);
    let gpu_name = names.get(gpu).map_or("", String::as_str);
    let most =
        format!("holds the most-read GPU, {gpu_name} ({:.0} reads)", reads.get(gpu).copied().unwrap_or(0.0));
    // Nodes equally busy have no busiest or least busy one; the first stands for them all.
    let picks = if stats[busiest].mean == stats[idlest].mean {
        vec![
            (
                busiest,
                format!("every node equally busy, {:.1} reads per GPU on average", stats[busiest].mean),
            ),
            (gpu_node, most),
        ]
    } else {
        vec![
            (busiest, format!("busiest node: {:.1} reads per GPU on average", stats[busiest].mean)),
            (gpu_node, most),
            (idlest, format!("least busy node: {:.1} reads per GPU on average", stats[idlest].mean)),
        ]
    };
    let mut out: Vec<(usize, String)> = Vec::new();
    for (node, why) in picks {
        match out.iter_mut().find(|(n, _)| *n == node) {
            Some((_, reasons)) => *reasons = format!("{reasons}; {why}"),
            None => out.push((node, why)),
        }
    }
    out
}

/// One node's pictures, drawn because the node stands out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DrillDown {
    /// The node's label (`P12`, `P0.n3`).
    pub node: String,
    /// Why it was picked, in words.
    pub why: String,
    /// The files written: balance PNG and SVG, then utilisation PNG and SVG when drawn.
    pub files: Vec<PathBuf>,
}

/// The NIC pictures of a deployment with more than [`MAX_BARS`] prefill GPUs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodePictures {
    /// The overviews (`nic_balance` and `nic_utilisation`, PNG then SVG), a bar or row per node.
    pub files: Vec<PathBuf>,
    /// How the overviews aggregate, in one sentence for the page.
    pub aggregation: String,
    /// The per-GPU pictures of the nodes that stand out.
    pub drill_downs: Vec<DrillDown>,
}

/// Writes the per-node NIC pictures into `dir`: the overviews `nic_balance` (when `balance`) and
/// `nic_utilisation` (when `utilisation`), one bar or heatmap row per node of `gpus_per_node`
/// GPUs, and per-GPU drill-downs `nic_balance_<node>` and `nic_utilisation_<node>` of the nodes
/// [`drill_downs`] picks.
pub fn nic_by_node(
    result: &RunResult,
    gpus_per_node: u16,
    dir: &Path,
    balance: bool,
    utilisation: bool,
) -> Result<NodePictures, ReportError> {
    let names = gpu_names(result);
    let nodes = nodes(&names, gpus_per_node, MAX_BARS);
    let per_node = usize::from(gpus_per_node.max(1));
    let widest = nodes.iter().map(|n| n.end - n.start).max().unwrap_or(0);
    // What one bar or row stands for, for the subtitles: a node, or a run of nodes.
    let each = if widest > per_node {
        format!("run of up to {} nodes of {per_node} GPUs", widest.div_ceil(per_node))
    } else {
        format!("node of up to {widest} GPUs")
    };
    let unit = if widest > per_node { "runs of nodes" } else { "nodes" };
    let mut out = NodePictures {
        aggregation: format!(
            "The {} prefill GPUs are too many for a bar each (more than {MAX_BARS}), so the NIC pictures above show one bar or row per node ({} {unit} of up to {} GPUs, each engine starting a node): a bar is the mean of the node's GPUs and its whisker runs from its least to its most busy GPU; a heatmap row is the mean utilisation of the node's GPUs. The nodes below are drawn GPU by GPU.",
            names.len(),
            nodes.len(),
            widest,
        ),
        ..NodePictures::default()
    };
    if balance {
        out.files.extend(render(
            dir,
            "nic_balance",
            &Balance { result, scope: Scope::Nodes(&nodes, &each) },
        )?);
    }
    if utilisation {
        out.files.extend(render(
            dir,
            "nic_utilisation",
            &Utilisation { result, scope: Scope::Nodes(&nodes, &each) },
        )?);
    }
    let reads: Vec<f64> = (0..names.len())
        .map(|i| result.nic.reads_per_prefill_gpu.get(i).copied().unwrap_or(0) as f64)
        .collect();
    for (index, why) in drill_downs(&reads, &names, &nodes) {
        let node = &nodes[index];
        let stem: String = node
            .label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' })
            .collect();
        let mut files = Vec::new();
        if balance {
            files.extend(render(
                dir,
                &format!("nic_balance_{stem}"),
                &Balance { result, scope: Scope::Node(node, &why) },
            )?);
        }
        if utilisation {
            let scope = Scope::Node(node, &why);
            files.extend(render(dir, &format!("nic_utilisation_{stem}"), &Utilisation { result, scope })?);
        }
        out.drill_downs.push(DrillDown { node: node.label.clone(), why, files });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Balance bars.

struct Balance<'a> {
    result: &'a RunResult,
    scope: Scope<'a>,
}

/// Which prefill GPUs a NIC picture shows.
#[derive(Clone, Copy)]
enum Scope<'a> {
    /// Every GPU, one bar or heatmap row each.
    All,
    /// One bar or row per node (see [`nodes`]), each standing for the node's GPUs; with what a
    /// bar stands for in words (`node of up to 8 GPUs`).
    Nodes(&'a [Node], &'a str),
    /// The GPUs of one node, and why the node was picked.
    Node(&'a Node, &'a str),
}

/// One bar panel.
struct Bars<'a> {
    caption: String,
    y_desc: &'a str,
    values: Vec<f64>,
    /// Per bar, the least and the greatest GPU value it stands for, drawn as a whisker.
    ranges: Option<Vec<(f64, f64)>>,
    /// The dashed "ideal" line; the mean of `values` when `None`.
    ideal: Option<f64>,
    empty: &'a str,
}

impl Picture for Balance<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let r = self.result;
        let names = gpu_names(r);
        let all = names.len();
        let reads: Vec<f64> =
            (0..all).map(|i| r.nic.reads_per_prefill_gpu.get(i).copied().unwrap_or(0) as f64).collect();
        let gb: Vec<f64> =
            (0..all).map(|i| r.nic.bytes_per_prefill_gpu.get(i).copied().unwrap_or(0) as f64 / 1e9).collect();
        let show_reads = |v: f64| format!("{v:.0}");
        let show_gb = |v: f64| format!("{v:.2} GB");
        let (gpus, reads_panel, gb_panel, ideal) = match self.scope {
            Scope::All => {
                let gpus = Gpus::new(&names);
                title(
                    root,
                    &format!("NIC balance per prefill GPU: {}", r.title()),
                    &format!(
                        "Jain index: reads {}, bytes {} (1.000 = perfectly even) · {} prefill GPUs in rank order, {}",
                        three(r.nic.jain),
                        three(r.nic.jain_bytes),
                        all,
                        gpus.labelled
                    ),
                )?;
                let reads_panel = Bars {
                    caption: format!("Reads served per prefill GPU ({})", spread(&reads, show_reads)),
                    y_desc: "reads",
                    values: reads,
                    ranges: None,
                    ideal: None,
                    empty: "no reads served",
                };
                let gb_panel = Bars {
                    caption: format!("Gigabytes sent per prefill GPU ({})", spread(&gb, show_gb)),
                    y_desc: "GB sent",
                    values: gb,
                    ranges: None,
                    ideal: None,
                    empty: "no bytes sent",
                };
                (gpus, reads_panel, gb_panel, "ideal: the mean".to_string())
            }
            Scope::Nodes(nodes, each) => {
                let gpus = node_axis(&Gpus::new(&names), nodes);
                title(
                    root,
                    &format!("NIC balance per prefill node: {}", r.title()),
                    &format!(
                        "Jain index over GPUs: reads {}, bytes {} · {all} prefill GPUs, a bar per {each}: its GPUs' mean, whisker from least to most busy",
                        three(r.nic.jain),
                        three(r.nic.jain_bytes),
                    ),
                )?;
                let panel = |values: &[f64], what: &str, show: &dyn Fn(f64) -> String| {
                    let s = node_stats(values, nodes);
                    (
                        format!("{what} per prefill GPU, by node ({} over GPUs)", spread(values, show)),
                        s.iter().map(|s| s.mean).collect::<Vec<f64>>(),
                        s.iter().map(|s| (s.min, s.max)).collect::<Vec<(f64, f64)>>(),
                    )
                };
                let (caption, values, ranges) = panel(&reads, "Reads served", &show_reads);
                let reads_panel = Bars {
                    caption,
                    y_desc: "reads per GPU",
                    values,
                    ranges: Some(ranges),
                    ideal: None,
                    empty: "no reads served",
                };
                let (caption, values, ranges) = panel(&gb, "Gigabytes sent", &show_gb);
                let gb_panel = Bars {
                    caption,
                    y_desc: "GB sent per GPU",
                    values,
                    ranges: Some(ranges),
                    ideal: None,
                    empty: "no bytes sent",
                };
                (gpus, reads_panel, gb_panel, "ideal: the mean".to_string())
            }
            Scope::Node(node, why) => {
                let gpus = Gpus::new(&names[node.start..node.end]);
                title(
                    root,
                    &format!("NIC balance on prefill node {}: {}", node.label, r.title()),
                    &format!("{why} · {} of {all} prefill GPUs", node.end - node.start),
                )?;
                let mean = |values: &[f64]| total(values) / values.len().max(1) as f64;
                let (node_reads, node_gb) = (&reads[node.start..node.end], &gb[node.start..node.end]);
                let reads_panel = Bars {
                    caption: format!(
                        "Reads served per GPU of node {} ({})",
                        node.label,
                        spread(node_reads, show_reads)
                    ),
                    y_desc: "reads",
                    values: node_reads.to_vec(),
                    ranges: None,
                    ideal: Some(mean(&reads)),
                    empty: "no reads served",
                };
                let gb_panel = Bars {
                    caption: format!(
                        "Gigabytes sent per GPU of node {} ({})",
                        node.label,
                        spread(node_gb, show_gb)
                    ),
                    y_desc: "GB sent",
                    values: node_gb.to_vec(),
                    ranges: None,
                    ideal: Some(mean(&gb)),
                    empty: "no bytes sent",
                };
                (gpus, reads_panel, gb_panel, format!("ideal: the mean over all {all} prefill GPUs"))
            }
        };
        let frame = |y0| Frame { x0: 110, y0, x1: 1250, y1: y0 + 200 };
        draw_bars(root, &gpus, &reads_panel, frame(110))?;
        draw_bars(root, &gpus, &gb_panel, frame(400))?;
        let mut legend: Vec<(Swatch, String)> = Vec::new();
        if gpus.engines.len() <= 8 {
            for (e, span) in gpus.engines.iter().enumerate() {
                legend.push((Swatch::Box(series_colour(e)), format!("engine {}", span.label)));
            }
        }
        legend.push((Swatch::Line { colour: INK, dashed: true, marker: None }, ideal));
        if gpus.groups.len() > 1 && gpus.groups.len() != gpus.engines.len() {
            legend.push((Swatch::Box(BAND), "shading alternates per DP group".to_string()));
        }
        legend_row(root, &legend, 640, 692, 1200)
    }
}

/// `0.962`, or `n/a` for an index without data.
fn three(value: Option<f64>) -> String {
    value.map_or("n/a".to_string(), |v| format!("{v:.3}"))
}

/// `mean 80, min 80, max 80`.
fn spread(values: &[f64], show: impl Fn(f64) -> String) -> String {
    if values.is_empty() {
        return "none".to_string();
    }
    let mean = total(values) / values.len() as f64;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("mean {}, min {}, max {}", show(mean), show(min), show(max))
}

fn draw_bars<DB: DrawingBackend>(root: &Area<DB>, gpus: &Gpus, panel: &Bars, f: Frame) -> Drawn {
    let n = gpus.len();
    text(root, &panel.caption, (f.x0, f.y0 - 26), &style(SUBTITLE, INK, HPos::Left, VPos::Top))?;
    // Whiskers and a given ideal line must fit under the top too.
    let ranges = panel.ranges.iter().flatten().map(|range| range.1);
    let max = panel.values.iter().copied().chain(ranges).chain(panel.ideal).fold(0.0, f64::max);
    let scale = Scale::Linear { lo: 0.0, hi: if max > 0.0 { max * 1.15 } else { 1.0 } };
    let yr = scale.range();
    let slot = f64::from(f.x1 - f.x0) / n.max(1) as f64;
    let sx = |i: usize| f.x0 + (i as f64 * slot).round() as i32;
    // Bands per group, then grid, then bars.
    for (k, g) in gpus.groups.iter().enumerate() {
        if k % 2 == 1 {
            root.draw(&Rectangle::new([(sx(g.start), f.y0), (sx(g.end), f.y1)], BAND.filled())).msg()?;
        }
    }
    let ticks: Vec<(i32, String)> =
        scale.ticks(5).into_iter().map(|v| (f.py(&yr, v), crate::render::num(v))).collect();
    y_ticks(root, &ticks, f.x0, Some(f.x1))?;
    for e in gpus.engines.iter().skip(1) {
        let x = sx(e.start);
        root.draw(&PathElement::new(vec![(x, f.y0), (x, f.y1)], MUTED.stroke_width(1))).msg()?;
    }
    for (i, v) in panel.values.iter().enumerate() {
        if *v > 0.0 {
            let w = (slot * 0.72).max(1.0);
            let left = f.x0 + (i as f64 * slot + (slot - w) / 2.0).round() as i32;
            let right = (left + w.round() as i32).max(left + 1);
            let colour = series_colour(gpus.engine_of[i]);
            root.draw(&Rectangle::new([(left, f.py(&yr, *v)), (right, f.y1)], colour.filled())).msg()?;
        }
    }
    if let Some(ranges) = &panel.ranges {
        let cap = ((slot * 0.2).round() as i32).max(1);
        for (i, &(lo, hi)) in ranges.iter().enumerate() {
            if hi > 0.0 {
                let x = f.x0 + ((i as f64 + 0.5) * slot).round() as i32;
                let (y_lo, y_hi) = (f.py(&yr, lo), f.py(&yr, hi));
                let ink = INK.stroke_width(1);
                root.draw(&PathElement::new(vec![(x, y_lo), (x, y_hi)], ink)).msg()?;
                for y in [y_lo, y_hi] {
                    root.draw(&PathElement::new(vec![(x - cap, y), (x + cap, y)], ink)).msg()?;
                }
            }
        }
    }
    if n > 0 {
        let mean = panel.ideal.unwrap_or_else(|| total(&panel.values) / n as f64);
        if mean > 0.0 {
            dashed_h(root, f.x0, f.x1, f.py(&yr, mean), INK.stroke_width(2))?;
        } else {
            crate::render::note(root, panel.empty, f.centre())?;
        }
    } else {
        crate::render::note(root, "no prefill GPUs", f.centre())?;
    }
    f.axes(root)?;
    text(root, panel.y_desc, (f.x0 - 70, (f.y0 + f.y1) / 2), &vertical(AXIS, INK))?;
    gpu_axis(root, gpus, f, slot)
}

/// Labels under the bars: the inner part per GPU, then the DP group (or engine) per span.
fn gpu_axis<DB: DrawingBackend>(root: &Area<DB>, gpus: &Gpus, f: Frame, slot: f64) -> Drawn {
    let n = gpus.len();
    if n == 0 {
        return Ok(());
    }
    let centre = |i: usize| f.x0 + ((i as f64 + 0.5) * slot).round() as i32;
    let fits = |labels: &[String]| labels.iter().all(|l| f64::from(text_width(l, TICK)) + 4.0 <= slot);
    let short: Vec<String> = gpus.inner.iter().map(|l| digits(l)).collect();
    let (labels, every) = if fits(&gpus.inner) {
        (gpus.inner.clone(), 1)
    } else if fits(&short) {
        (short, 1)
    } else {
        let widest = short.iter().map(|l| text_width(l, TICK)).max().unwrap_or(8);
        (short, ((f64::from(widest) + 6.0) / slot).ceil() as usize)
    };
    let label = style(TICK, INK, HPos::Center, VPos::Top);
    for i in (0..n).step_by(every.max(1)) {
        root.draw(&PathElement::new(vec![(centre(i), f.y1), (centre(i), f.y1 + 4)], INK.stroke_width(1)))
            .msg()?;
        text(root, &labels[i], (centre(i), f.y1 + 6), &label)?;
    }
    let span_px = |s: &Span| ((s.end - s.start) as f64 * slot) as i32;
    let group_fits = gpus.groups.iter().all(|g| text_width(&g.label, TICK) + 8 <= span_px(g));
    let outer = if group_fits { &gpus.groups } else { &gpus.engines };
    let y = f.y1 + 28;
    for s in outer {
        let (x0, x1) = (f.x0 + (s.start as f64 * slot) as i32, f.x0 + (s.end as f64 * slot) as i32);
        // A bracket under the span, then its label.
        let bracket = GRID.stroke_width(2);
        root.draw(&PathElement::new(vec![(x0 + 3, y - 2), (x1 - 3, y - 2)], bracket)).msg()?;
        let l = fit(&s.label, TICK, (x1 - x0 - 4).max(8));
        text(root, &l, ((x0 + x1) / 2, y + 2), &style(TICK, INK, HPos::Center, VPos::Top))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Utilisation heatmap.

struct Utilisation<'a> {
    result: &'a RunResult,
    scope: Scope<'a>,
}

/// At most this many columns are drawn; longer runs are averaged into bins of whole seconds.
const MAX_COLUMNS: usize = 900;

/// Lowest utilisation with a colour of its own (0.1 %, the data's rounding step).
const FLOOR: f64 = 0.001;

/// YlOrRd without its palest stop, so that the least busy second still differs from idle white.
const HEAT: [(u8, u8, u8); 8] = [
    (255, 237, 160),
    (254, 217, 118),
    (254, 178, 76),
    (253, 141, 60),
    (252, 78, 42),
    (227, 26, 28),
    (189, 0, 38),
    (128, 0, 38),
];

/// Position of `v` on the colour scale (0 at 0.1 %, 1 at 100 %).
fn heat_position(v: f64) -> f64 {
    ((v.max(FLOOR).log10() - FLOOR.log10()) / -FLOOR.log10()).clamp(0.0, 1.0)
}

/// The colour of a position on the scale, quantised to 64 steps so equal-looking neighbours
/// merge into one rectangle.
fn heat(t: f64) -> RGBColor {
    let steps = 64.0;
    let t = (t.clamp(0.0, 1.0) * steps).round() / steps;
    let x = t * (HEAT.len() - 1) as f64;
    let i = (x.floor() as usize).min(HEAT.len() - 2);
    let f = x - i as f64;
    let mix = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * f).round() as u8;
    let (a, b) = (HEAT[i], HEAT[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// `12 %`, `1.5 %`, `0.17 %`.
fn percent(v: f64) -> String {
    let p = v * 100.0;
    if p >= 10.0 {
        format!("{p:.0} %")
    } else if p >= 1.0 {
        format!("{p:.1} %")
    } else {
        format!("{p:.2} %")
    }
}

impl Picture for Utilisation<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let r = self.result;
        let names = gpu_names(r);
        let gpu_rows = &r.nic.utilisation;
        let gpu_peak = gpu_rows.iter().flatten().copied().fold(0.0, f64::max);
        let (gpus, rows, heading, y_desc) = match self.scope {
            Scope::All => (
                Gpus::new(&names),
                gpu_rows.clone(),
                format!("NIC utilisation per prefill GPU: {}", r.title()),
                "prefill GPU (rank order)",
            ),
            Scope::Nodes(nodes, _) => (
                node_axis(&Gpus::new(&names), nodes),
                node_rows(gpu_rows, nodes),
                format!("NIC utilisation per prefill node: {}", r.title()),
                "prefill node (rank order)",
            ),
            Scope::Node(node, _) => (
                Gpus::new(&names[node.start..node.end]),
                gpu_rows[node.start.min(gpu_rows.len())..node.end.min(gpu_rows.len())].to_vec(),
                format!("NIC utilisation on prefill node {}: {}", node.label, r.title()),
                "prefill GPU (rank order)",
            ),
        };
        let n = gpus.len();
        let rows = &rows;
        let longest = gpu_rows.iter().map(Vec::len).max().unwrap_or(0);
        let seconds = longest.max(r.duration_s.ceil().max(0.0) as usize).max(1);
        let bin = seconds.div_ceil(MAX_COLUMNS);
        let columns = seconds.div_ceil(bin);
        let cell = |i: usize, c: usize| -> f64 {
            let row = rows.get(i).map(Vec::as_slice).unwrap_or(&[]);
            let lo = (c * bin).min(row.len());
            let hi = ((c + 1) * bin).min(row.len());
            total(&row[lo..hi]) / bin as f64
        };
        let all: Vec<f64> = rows.iter().flatten().copied().collect();
        let peak = all.iter().copied().fold(0.0, f64::max);
        let mean = if n > 0 { total(&all) / (n * seconds) as f64 } else { 0.0 };
        let binned = if bin > 1 { format!(" · {bin}-second bins") } else { String::new() };
        let subtitle = match self.scope {
            Scope::All | Scope::Node(..) => format!(
                "Share of each NIC's bandwidth used per virtual second · peak {}, mean {}{binned}",
                percent(peak),
                percent(mean)
            ),
            Scope::Nodes(_, each) => format!(
                "Share of NIC bandwidth used per virtual second, a row per {each}: the mean of its GPUs · peak row {}, peak GPU {}, mean {}{binned}",
                percent(peak),
                percent(gpu_peak),
                percent(mean)
            ),
        };
        title(root, &heading, &subtitle)?;
        let label_w = gpus.names.iter().map(|l| text_width(l, TICK)).max().unwrap_or(40);
        let f = Frame { x0: 56 + label_w, y0: 84, x1: 1110, y1: 640 };
        let row_h = f64::from(f.y1 - f.y0) / n.max(1) as f64;
        let ry = |i: usize| f.y0 + (i as f64 * row_h).round() as i32;
        let col_w = f64::from(f.x1 - f.x0) / columns as f64;
        let cx = |c: usize| f.x0 + (c as f64 * col_w).round() as i32;
        let mut any = false;
        for i in 0..n {
            let mut c = 0;
            while c < columns {
                let v = cell(i, c);
                if v <= 0.0 {
                    c += 1;
                    continue;
                }
                any = true;
                let colour = heat(heat_position(v));
                let mut end = c + 1;
                while end < columns && cell(i, end) > 0.0 && heat(heat_position(cell(i, end))) == colour {
                    end += 1;
                }
                root.draw(&Rectangle::new([(cx(c), ry(i)), (cx(end), ry(i + 1))], colour.filled())).msg()?;
                c = end;
            }
        }
        // Group and engine separators across the map.
        for g in gpus.groups.iter().skip(1) {
            let y = ry(g.start);
            root.draw(&PathElement::new(vec![(f.x0, y), (f.x1, y)], MUTED.stroke_width(1))).msg()?;
        }
        for e in gpus.engines.iter().skip(1) {
            let y = ry(e.start);
            root.draw(&PathElement::new(vec![(f.x0, y), (f.x1, y)], INK.stroke_width(2))).msg()?;
        }
        root.draw(&Rectangle::new([(f.x0, f.y0), (f.x1, f.y1)], GRID.stroke_width(1))).msg()?;
        if !any {
            note(root, "no NIC traffic recorded", f.centre())?;
        }
        // Row labels: every row when there is room, else every k-th.
        let every = (15.0 / row_h).ceil().max(1.0) as usize;
        let label = style(TICK, INK, HPos::Right, VPos::Center);
        for i in (0..n).step_by(every) {
            let y = (ry(i) + ry(i + 1)) / 2;
            root.draw(&PathElement::new(vec![(f.x0 - 4, y), (f.x0, y)], INK.stroke_width(1))).msg()?;
            text(root, &gpus.names[i], (f.x0 - 7, y), &label)?;
        }
        let xr = 0.0..seconds as f64;
        let ticks: Vec<(i32, String)> = crate::render::linear_ticks(0.0, seconds as f64, 10)
            .into_iter()
            .map(|v| (f.px(&xr, v), crate::render::num(v)))
            .collect();
        x_ticks(root, &ticks, f.y1, None)?;
        text(
            root,
            "virtual time (s)",
            ((f.x0 + f.x1) / 2, f.y1 + 32),
            &style(AXIS, INK, HPos::Center, VPos::Top),
        )?;
        text(root, y_desc, (f.x0 - label_w - 30, (f.y0 + f.y1) / 2), &vertical(AXIS, INK))?;
        colour_bar(root, f)
    }
}

/// The colour scale legend right of the map: 0.1 % to 100 % (log), and white for idle.
fn colour_bar<DB: DrawingBackend>(root: &Area<DB>, f: Frame) -> Drawn {
    let (x0, x1) = (1150, 1174);
    let (top, bottom) = (f.y0 + 56, f.y1 - 90);
    text(root, "NIC busy", (x0 - 10, f.y0 + 4), &style(SUBTITLE, INK, HPos::Left, VPos::Top))?;
    text(root, "(log scale)", (x0 - 10, f.y0 + 26), &style(TICK, MUTED, HPos::Left, VPos::Top))?;
    for y in top..bottom {
        let t = f64::from(bottom - 1 - y) / f64::from(bottom - top - 1);
        root.draw(&Rectangle::new([(x0, y), (x1, y + 1)], heat(t).filled())).msg()?;
    }
    root.draw(&Rectangle::new([(x0, top), (x1, bottom)], MUTED.stroke_width(1))).msg()?;
    let label = style(TICK, INK, HPos::Left, VPos::Center);
    for (v, l) in [(0.001, "0.1 %"), (0.01, "1 %"), (0.1, "10 %"), (1.0, "100 %")] {
        let y = bottom - 1 - (heat_position(v) * f64::from(bottom - top - 1)).round() as i32;
        root.draw(&PathElement::new(vec![(x1, y), (x1 + 5, y)], INK.stroke_width(1))).msg()?;
        text(root, l, (x1 + 8, y), &label)?;
    }
    let y = bottom + 30;
    root.draw(&Rectangle::new([(x0, y), (x1, y + 18)], WHITE.filled())).msg()?;
    root.draw(&Rectangle::new([(x0, y), (x1, y + 18)], MUTED.stroke_width(1))).msg()?;
    text(root, "0 (idle)", (x1 + 8, y + 9), &label)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn gpus_group_by_dp_when_tp_varies() {
        let g = Gpus::new(&names(&[
            "P0.dp0.tp0",
            "P0.dp0.tp1",
            "P0.dp1.tp0",
            "P0.dp1.tp1",
            "P1.dp0.tp0",
            "P1.dp0.tp1",
        ]));
        assert_eq!(g.inner, names(&["tp0", "tp1", "tp0", "tp1", "tp0", "tp1"]));
        let labels: Vec<&str> = g.groups.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["P0.dp0", "P0.dp1", "P1.dp0"]);
        assert_eq!(g.engines.len(), 2);
        assert_eq!(g.engine_of, vec![0, 0, 0, 0, 1, 1]);
    }

    #[test]
    fn gpus_group_by_engine_when_dp_ranks_have_one_gpu() {
        let g = Gpus::new(&names(&["P0.dp0.tp0", "P0.dp1.tp0", "P1.dp0.tp0", "P1.dp1.tp0"]));
        assert_eq!(g.inner, names(&["dp0", "dp1", "dp0", "dp1"]));
        assert_eq!(digits(&g.inner[1]), "1");
        let labels: Vec<&str> = g.groups.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["P0", "P1"]);
        let odd = Gpus::new(&names(&["x", "y"]));
        assert_eq!(odd.inner, names(&["x", "y"]));
        assert_eq!(odd.groups.len(), 2);
    }

    /// Prefill GPU names of `engines` engines of `dp` × `tp` GPUs, in rank order.
    fn layout(engines: usize, dp: usize, tp: usize) -> Vec<String> {
        let mut out = Vec::new();
        for e in 0..engines {
            for d in 0..dp {
                for t in 0..tp {
                    out.push(format!("P{e}.dp{d}.tp{t}"));
                }
            }
        }
        out
    }

    /// A node as the tables write it: label, first GPU, one past the last.
    type Shown<'a> = (&'a str, usize, usize);

    #[test]
    fn nodes_split_engines_by_gpus_per_node() {
        // ((engines, dp, tp), gpus_per_node, max_bars) -> (node count, first three nodes, last node)
        let check = |(engines, dp, tp): (usize, usize, usize),
                     per_node: u16,
                     max_bars: usize,
                     expected: (usize, &[Shown], Shown)| {
            let got = nodes(&layout(engines, dp, tp), per_node, max_bars);
            let show = |n: &Node| (n.label.clone(), n.start, n.end);
            let first: Vec<_> = got.iter().take(3).map(show).collect();
            let want: Vec<_> = expected.1.iter().map(|&(l, a, b)| (l.to_string(), a, b)).collect();
            let (l, a, b) = expected.2;
            assert_eq!(
                (got.len(), first, got.last().map(show)),
                (expected.0, want, Some((l.to_string(), a, b))),
                "{engines} x DP{dp}TP{tp}, {per_node} per node, at most {max_bars}"
            );
        };
        // A TP8 engine is one node of eight: the node is named by its engine.
        check((64, 1, 8), 8, 64, (64, &[("P0", 0, 8), ("P1", 8, 16), ("P2", 16, 24)], ("P63", 504, 512)));
        // DeepSeek's prefill unit: DP32 EP over four nodes.
        check(
            (1, 32, 1),
            8,
            64,
            (4, &[("P0.n0", 0, 8), ("P0.n1", 8, 16), ("P0.n2", 16, 24)], ("P0.n3", 24, 32)),
        );
        // An engine that does not fill its last node; the next engine starts a node of its own.
        check(
            (2, 12, 1),
            8,
            64,
            (4, &[("P0.n0", 0, 8), ("P0.n1", 8, 12), ("P1.n0", 12, 20)], ("P1.n1", 20, 24)),
        );
        // Too many nodes for the bars: runs of nodes, the least run that fits.
        check((1, 32, 1), 8, 2, (2, &[("P0.n0-1", 0, 16), ("P0.n2-3", 16, 32)], ("P0.n2-3", 16, 32)));
        check(
            (1, 512, 1),
            1,
            64,
            (64, &[("P0.n0-7", 0, 8), ("P0.n8-15", 8, 16), ("P0.n16-23", 16, 24)], ("P0.n504-511", 504, 512)),
        );
        check((1, 20, 1), 8, 2, (2, &[("P0.n0-1", 0, 16), ("P0.n2", 16, 20)], ("P0.n2", 16, 20)));
        // Engines are never merged with each other.
        check((3, 1, 8), 8, 1, (3, &[("P0", 0, 8), ("P1", 8, 16), ("P2", 16, 24)], ("P2", 16, 24)));
    }

    #[test]
    fn node_axis_labels_nodes_under_their_engine() {
        // (layout, gpus_per_node, max_bars) -> (labels under the bars, brackets under them)
        let check = |(engines, dp, tp): (usize, usize, usize),
                     per_node: u16,
                     max_bars: usize,
                     expected: (&[&str], &[&str])| {
            let gpus = layout(engines, dp, tp);
            let axis = node_axis(&Gpus::new(&gpus), &nodes(&gpus, per_node, max_bars));
            let groups: Vec<&str> = axis.groups.iter().map(|g| g.label.as_str()).collect();
            assert_eq!(
                (axis.inner.as_slice(), groups.as_slice()),
                (names(expected.0).as_slice(), expected.1)
            );
        };
        // Engines on one node each: labelled by engine under one bracket, one colour.
        check((3, 1, 8), 8, 64, (&["P0", "P1", "P2"], &["one node per engine, P0 to P2"]));
        check((2, 16, 1), 8, 64, (&["n0", "n1", "n0", "n1"], &["P0", "P1"]));
        // A run of nodes is labelled by its first.
        check((1, 32, 1), 8, 2, (&["n0", "n2"], &["P0"]));
    }

    #[test]
    fn node_stats_are_mean_min_and_max_of_the_gpus() {
        let node = |start, end| Node { label: String::new(), start, end };
        let check = |values: &[f64], nodes: &[Node], expected: &[(f64, f64, f64)]| {
            let got: Vec<_> = node_stats(values, nodes).iter().map(|s| (s.mean, s.min, s.max)).collect();
            assert_eq!(got, expected, "{values:?}");
        };
        check(
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            &[node(0, 2), node(2, 6)],
            &[(1.5, 1.0, 2.0), (4.5, 3.0, 6.0)],
        );
        check(&[7.0, 7.0, 7.0], &[node(0, 3)], &[(7.0, 7.0, 7.0)]);
        // A GPU without a value counts 0.
        check(&[4.0], &[node(0, 2)], &[(2.0, 0.0, 4.0)]);
        check(&[], &[], &[]);
        // Utilisation rows: the per-second mean of the node's GPUs, a missing second 0.
        let rows = vec![vec![1.0, 0.5], vec![0.0], vec![0.2, 0.2, 0.2]];
        assert_eq!(node_rows(&rows, &[node(0, 2), node(2, 3)]), vec![vec![0.5, 0.25], vec![0.2, 0.2, 0.2]]);
    }

    #[test]
    fn drill_downs_pick_the_busiest_and_least_busy_nodes_and_the_busiest_gpu() {
        let pairs = |n: usize| {
            (0..n).map(|k| Node { label: format!("n{k}"), start: 2 * k, end: 2 * k + 2 }).collect::<Vec<_>>()
        };
        let check = |reads: &[f64], expected: &[(usize, &str)]| {
            let names: Vec<String> = (0..reads.len()).map(|i| format!("g{i}")).collect();
            let got = drill_downs(reads, &names, &pairs(reads.len() / 2));
            let want: Vec<(usize, String)> = expected.iter().map(|&(n, w)| (n, w.to_string())).collect();
            assert_eq!(got, want, "{reads:?}");
        };
        check(
            &[9.0, 9.0, 10.0, 0.0, 1.0, 1.0],
            &[
                (0, "busiest node: 9.0 reads per GPU on average"),
                (1, "holds the most-read GPU, g2 (10 reads)"),
                (2, "least busy node: 1.0 reads per GPU on average"),
            ],
        );
        // The busiest node holds the busiest GPU: one entry with both reasons.
        check(
            &[10.0, 10.0, 30.0, 0.0, 5.0, 5.0],
            &[
                (1, "busiest node: 15.0 reads per GPU on average; holds the most-read GPU, g2 (30 reads)"),
                (2, "least busy node: 5.0 reads per GPU on average"),
            ],
        );
        // Ties go to the first node in rank order.
        check(
            &[4.0, 4.0, 4.0, 4.0],
            &[(0, "every node equally busy, 4.0 reads per GPU on average; holds the most-read GPU, g0 (4 reads)")],
        );
        check(&[], &[]);
    }

    #[test]
    fn heat_scale_is_log_from_a_tenth_of_a_percent() {
        assert_eq!(heat_position(0.001), 0.0);
        assert!((heat_position(0.01) - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(heat_position(1.0), 1.0);
        assert_eq!(heat_position(5.0), 1.0);
        assert_eq!(heat(0.0), RGBColor(255, 237, 160));
        assert_eq!(heat(1.0), RGBColor(128, 0, 38));
        assert_eq!(percent(0.006), "0.60 %");
        assert_eq!(percent(0.5), "50 %");
    }
}
