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
    render(dir, "nic_balance", &Balance { result })
}

/// Writes `nic_utilisation.png` and `nic_utilisation.svg` into `dir`: a heatmap with one row
/// per prefill GPU and one column per virtual second, coloured by the fraction of NIC
/// bandwidth used (log colour scale from 0.1 % to 100 %, idle seconds white). Returns the
/// paths written (PNG first).
pub fn nic_utilisation(result: &RunResult, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    render(dir, "nic_utilisation", &Utilisation { result })
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
// Balance bars.

struct Balance<'a> {
    result: &'a RunResult,
}

/// One bar panel.
struct Bars<'a> {
    caption: String,
    y_desc: &'a str,
    values: Vec<f64>,
    empty: &'a str,
}

impl Picture for Balance<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let r = self.result;
        let gpus = Gpus::new(&gpu_names(r));
        let n = gpus.len();
        title(
            root,
            &format!("NIC balance per prefill GPU: {}", r.title()),
            &format!(
                "Jain index: reads {}, bytes {} (1.000 = perfectly even) · {} prefill GPUs in rank order, {}",
                three(r.nic.jain),
                three(r.nic.jain_bytes),
                n,
                gpus.labelled
            ),
        )?;
        let reads: Vec<f64> =
            (0..n).map(|i| r.nic.reads_per_prefill_gpu.get(i).copied().unwrap_or(0) as f64).collect();
        let gb: Vec<f64> =
            (0..n).map(|i| r.nic.bytes_per_prefill_gpu.get(i).copied().unwrap_or(0) as f64 / 1e9).collect();
        let reads_panel = Bars {
            caption: format!("Reads served per prefill GPU ({})", spread(&reads, |v| format!("{v:.0}"))),
            y_desc: "reads",
            values: reads,
            empty: "no reads served",
        };
        let gb_panel = Bars {
            caption: format!("Gigabytes sent per prefill GPU ({})", spread(&gb, |v| format!("{v:.2} GB"))),
            y_desc: "GB sent",
            values: gb,
            empty: "no bytes sent",
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
        legend
            .push((Swatch::Line { colour: INK, dashed: true, marker: None }, "ideal: the mean".to_string()));
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
    let max = panel.values.iter().copied().fold(0.0, f64::max);
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
    if n > 0 {
        let mean = total(&panel.values) / n as f64;
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
        let gpus = Gpus::new(&gpu_names(r));
        let n = gpus.len();
        let rows = &r.nic.utilisation;
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
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
        title(
            root,
            &format!("NIC utilisation per prefill GPU: {}", r.title()),
            &format!(
                "Share of each NIC's bandwidth used per virtual second · peak {}, mean {}{binned}",
                percent(peak),
                percent(mean)
            ),
        )?;
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
        text(
            root,
            "prefill GPU (rank order)",
            (f.x0 - label_w - 30, (f.y0 + f.y1) / 2),
            &vertical(AXIS, INK),
        )?;
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
