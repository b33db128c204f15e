//! Sweep charts: throughput, TTFT and TPOT against concurrency, one line per run (a scenario or
//! a notation, with its seed when the sweep sets one).

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use crate::error::ReportError;
use crate::render::{
    legend_column, marker, note, num, polyline, render, series_colour, style, text, title, x_ticks, y_ticks,
    Area, Drawn, Frame, Marker, Msg, Picture, Scale, Swatch, ALERT, MUTED, TICK,
};

/// One point of a sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepPoint {
    /// The run's label without its workload ([`pdkv_sim::RunIdentity`]): one line per distinct
    /// value, so two scenarios of one deployment (a bug and its fix) are two lines.
    pub run: String,
    /// The deployment notation.
    pub deployment: String,
    /// Clients in flight.
    pub concurrency: u32,
    /// Prompt plus generated tokens per second.
    pub total_tok_s: f64,
    /// Mean time to first token, in milliseconds (`None` when no request finished).
    pub ttft_mean_ms: Option<f64>,
    /// Mean time per output token, in milliseconds (`None` when no finished request produced a
    /// second token).
    pub tpot_mean_ms: Option<f64>,
    /// How the run ended (`clean` or the outcome's name).
    pub outcome: String,
}

/// Three line charts against concurrency, one line per run: sweep_throughput,
/// sweep_ttft, sweep_tpot (.png/.svg each). Concurrency values are evenly spaced categories in
/// ascending order; runs without a value (no finished request) are left out; a red cross marks a
/// run whose outcome is not `clean`. Returns the six paths (PNG before SVG for each chart).
pub fn sweep_charts(points: &[SweepPoint], dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let charts = [
        Metric {
            stem: "sweep_throughput",
            title: "Total token throughput against concurrency",
            y_desc: "total throughput (tok/s)",
            value: |p| Some(p.total_tok_s),
            log_ratio: f64::INFINITY,
        },
        Metric {
            stem: "sweep_ttft",
            title: "Mean time to first token against concurrency",
            y_desc: "mean TTFT (ms)",
            value: |p| p.ttft_mean_ms,
            log_ratio: 20.0,
        },
        Metric {
            stem: "sweep_tpot",
            title: "Mean time per output token against concurrency",
            y_desc: "mean TPOT (ms)",
            value: |p| p.tpot_mean_ms,
            log_ratio: f64::INFINITY,
        },
    ];
    let mut paths = Vec::new();
    for metric in charts {
        paths.extend(render(dir, metric.stem, &Chart { points, metric })?);
    }
    Ok(paths)
}

/// What one chart plots.
#[derive(Clone, Copy)]
struct Metric {
    stem: &'static str,
    title: &'static str,
    y_desc: &'static str,
    /// The value, `None` when the run measured none (latencies without finished requests).
    value: fn(&SweepPoint) -> Option<f64>,
    /// Use a log axis when the largest value is at least this many times the smallest.
    log_ratio: f64,
}

struct Chart<'a> {
    points: &'a [SweepPoint],
    metric: Metric,
}

impl Chart<'_> {
    fn value(&self, p: &SweepPoint) -> Option<f64> {
        (self.metric.value)(p).filter(|v| v.is_finite())
    }
}

impl Picture for Chart<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let mut runs: Vec<&str> = Vec::new();
        for p in self.points {
            if !runs.contains(&p.run.as_str()) {
                runs.push(&p.run);
            }
        }
        let mut levels: Vec<u32> = self.points.iter().map(|p| p.concurrency).collect();
        levels.sort_unstable();
        levels.dedup();
        let mut bad: Vec<&str> = Vec::new();
        for p in self.points {
            if p.outcome != "clean" && !bad.contains(&p.outcome.as_str()) {
                bad.push(&p.outcome);
            }
        }
        title(
            root,
            self.metric.title,
            &format!(
                "{} points · {} {} · concurrency = clients in flight{}",
                self.points.len(),
                runs.len(),
                if runs.len() == 1 { "line" } else { "lines" },
                if self.metric.log_ratio.is_finite() {
                    " · log scale when the values span 20× or more"
                } else {
                    ""
                }
            ),
        )?;
        let f = Frame { x0: 110, y0: 96, x1: 950, y1: 620 };
        let values: Vec<f64> = self.points.iter().filter_map(|p| self.value(p)).collect();
        let scale = Scale::fit(&values, self.metric.log_ratio, true);
        let yr = scale.range();
        let yt: Vec<(i32, String)> =
            scale.ticks(6).into_iter().filter_map(|v| scale.at(v).map(|c| (f.py(&yr, c), num(v)))).collect();
        y_ticks(root, &yt, f.x0, Some(f.x1))?;
        let xr = 0.0..levels.len().max(1) as f64;
        let x_of = |c: u32| levels.iter().position(|&l| l == c).map(|i| f.px(&xr, i as f64 + 0.5));
        let xt: Vec<(i32, String)> =
            levels.iter().filter_map(|&c| x_of(c).map(|x| (x, c.to_string()))).collect();
        x_ticks(root, &xt, f.y1, Some(f.y0))?;
        let mut legend: Vec<(Swatch, String)> = Vec::new();
        for (d, name) in runs.iter().enumerate() {
            let colour = series_colour(d);
            let shape = Marker::nth(d);
            let mut mine: Vec<&SweepPoint> = self.points.iter().filter(|p| p.run == *name).collect();
            mine.sort_by_key(|p| p.concurrency);
            let at = |p: &SweepPoint| -> Option<(i32, i32)> {
                let c = scale.at(self.value(p)?)?;
                Some((x_of(p.concurrency)?, f.py(&yr, c)))
            };
            polyline(root, mine.iter().filter_map(|p| at(p)).collect(), colour.stroke_width(3))?;
            for p in &mine {
                if let Some(xy) = at(p) {
                    marker(root, shape, xy, 6, colour)?;
                    if p.outcome != "clean" {
                        marker(root, Marker::Cross, xy, 9, ALERT)?;
                    }
                }
            }
            legend.push((Swatch::Line { colour, dashed: false, marker: Some(shape) }, name.to_string()));
        }
        if !bad.is_empty() {
            legend.push((Swatch::Mark(Marker::Cross, ALERT), format!("not clean: {}", bad.join(", "))));
        }
        if values.is_empty() {
            note(
                root,
                if self.points.is_empty() { "no sweep points" } else { "no values to plot" },
                f.centre(),
            )?;
        }
        f.axes(root)?;
        let desc = if scale.is_log() {
            format!("{}, log scale", self.metric.y_desc)
        } else {
            self.metric.y_desc.into()
        };
        f.descs(root, "concurrency (clients in flight)", &desc, 72)?;
        text(root, "run", (980, f.y0 - 6), &style(TICK, MUTED, HPos::Left, VPos::Center))?;
        legend_column(root, &legend, 980, f.y0 + 18, 280)
    }
}
