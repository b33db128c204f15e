//! Sweep charts: throughput, TTFT, TPOT, steady throughput per GPU and goodput per GPU against
//! the load (concurrency, or request rate in a rate sweep), one line per run (a scenario or a
//! notation, with its seed when the sweep sets one).

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use pdkv_sim::result::SweepPoint;
use pdkv_sim::Outcome;

use crate::error::ReportError;
use crate::render::{
    fit, legend_column, marker, note, num, polyline, render, series_colour, style, text, title, x_ticks,
    y_ticks, Area, Drawn, Frame, Marker, Msg, Picture, Scale, Swatch, ALERT, MUTED, SUBTITLE, TICK,
};

/// How far the sweep's figures can be trusted, from the calibration that produced them. The
/// caller says where that comes from (`pdkv sweep` reads `profiles/calibration.ron`), so the
/// charts need not know.
#[derive(Clone, Debug, PartialEq)]
pub enum ErrorBand {
    /// The calibration's error on held-out points is measured: each line is drawn over a band
    /// from value × (1 − `half_width`) to value × (1 + `half_width`) in its colour.
    Measured {
        /// Relative half-width of the band, a fraction: the median |error| on held-out points.
        half_width: f64,
        /// Held-out points that error was measured on.
        points: u32,
        /// The calibration's name.
        calibration: String,
    },
    /// Not measured yet: no band is drawn, and the chart says how large a difference to distrust
    /// from the worst error over the fitting points (predictions of other points are unlikely to
    /// do better than the points the constants were fitted to).
    Unmeasured {
        /// Worst relative error over the fitting points, a fraction.
        fitting_error_max: f64,
        /// The calibration's name.
        calibration: String,
    },
}

impl ErrorBand {
    /// The line each chart prints under its subtitle about the model's error.
    pub fn note(&self) -> String {
        match self {
            ErrorBand::Measured { half_width, points, calibration } => format!(
                "shaded: ± {:.1} % (median |error| on {points} held-out {}, calibration {calibration})",
                100.0 * half_width,
                if *points == 1 { "point" } else { "points" }
            ),
            ErrorBand::Unmeasured { fitting_error_max, calibration } => format!(
                "no validation error yet: the fit alone is off by up to {:.1} %, so read differences \
                 under ~{} % as noise (calibration {calibration})",
                100.0 * fitting_error_max,
                noise_percent(*fitting_error_max)
            ),
        }
    }

    /// The band's relative half-width, when there is a band to draw.
    fn half_width(&self) -> Option<f64> {
        match self {
            ErrorBand::Measured { half_width, .. } if half_width.is_finite() && *half_width > 0.0 => {
                Some(*half_width)
            }
            _ => None,
        }
    }
}

/// The fitting error rounded up to a multiple of 5 %, at least 5 %: a reader needs the size of
/// the difference to distrust, not a precision the unvalidated model does not have.
fn noise_percent(fitting_error_max: f64) -> u32 {
    let percent = 100.0 * fitting_error_max;
    if percent.is_finite() && percent > 0.0 {
        ((percent / 5.0 - 1e-9).ceil().max(1.0) * 5.0) as u32
    } else {
        5
    }
}

/// Line charts against the load, one line per run: sweep_throughput, sweep_ttft, sweep_tpot,
/// sweep_throughput_per_gpu (steady-state tokens per second per GPU) and, when some point has
/// an SLO's goodput, sweep_goodput_per_gpu (.png/.svg each). The load (concurrency, or the rate
/// of a rate sweep) takes evenly spaced categories in ascending order; runs without a value (no
/// finished request) are left out; a red cross marks a run whose outcome is not `clean`. Each
/// chart says, under its subtitle, what `band` says about the model's error, and shades the band
/// behind every line when it is measured. Returns the paths (PNG before SVG for each chart).
pub fn sweep_charts(
    points: &[SweepPoint],
    band: &ErrorBand,
    dir: &Path,
) -> Result<Vec<PathBuf>, ReportError> {
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
        Metric {
            stem: "sweep_throughput_per_gpu",
            title: "Steady-state token throughput per GPU against concurrency",
            y_desc: "steady tok/s per GPU",
            value: |p| Some(p.steady.throughput.total_tok_s_per_gpu),
            log_ratio: f64::INFINITY,
        },
        Metric {
            stem: "sweep_goodput_per_gpu",
            title: "Steady-state goodput per GPU against concurrency",
            y_desc: "goodput (req/s meeting the SLO) per GPU",
            value: |p| p.steady.goodput.map(|g| g.requests_per_s_per_gpu),
            log_ratio: f64::INFINITY,
        },
    ];
    // Goodput needs an SLO: without one the chart would be empty.
    let with_goodput = points.iter().any(|p| p.steady.goodput.is_some());
    let charts: Vec<Metric> =
        charts.into_iter().filter(|m| with_goodput || m.stem != "sweep_goodput_per_gpu").collect();
    // Each chart on a thread of its own (they share only the points); the files come back in
    // the order above, and their bytes do not depend on the threads' timing.
    let drawn: Vec<_> = std::thread::scope(|scope| {
        let threads: Vec<_> = charts
            .into_iter()
            .map(|metric| scope.spawn(move || render(dir, metric.stem, &Chart { points, metric, band })))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    });
    let mut paths = Vec::new();
    for files in drawn {
        paths.extend(files?);
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
    band: &'a ErrorBand,
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
        let mut levels: Vec<f64> = self.points.iter().map(SweepPoint::load).collect();
        levels.sort_by(f64::total_cmp);
        levels.dedup();
        // A rate sweep's load is arrivals per second; the words follow it.
        let rates = self.points.iter().any(|p| p.rate_per_s.is_some());
        let (load, load_means, x_desc) = match rates {
            true => (
                "request rate",
                "request rate = Poisson arrivals per second",
                "request rate (arrivals per second)",
            ),
            false => ("concurrency", "concurrency = clients in flight", "concurrency (clients in flight)"),
        };
        let mut bad: Vec<&str> = Vec::new();
        for p in self.points {
            if p.outcome != Outcome::Clean && !bad.contains(&p.outcome.name()) {
                bad.push(p.outcome.name());
            }
        }
        title(
            root,
            &self.metric.title.replace("concurrency", load),
            &format!(
                "{} points · {} {} · {load_means}{}",
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
        let (w, _) = root.dim_in_pixel();
        let w = w as i32;
        text(
            root,
            &fit(&self.band.note(), SUBTITLE, w - 40),
            (w / 2, 68),
            &style(SUBTITLE, MUTED, HPos::Center, VPos::Top),
        )?;
        let f = Frame { x0: 110, y0: 108, x1: 950, y1: 620 };
        let values: Vec<f64> = self.points.iter().filter_map(|p| self.value(p)).collect();
        let scale = Scale::fit(&values, self.metric.log_ratio, true);
        let yr = scale.range();
        let yt: Vec<(i32, String)> =
            scale.ticks(6).into_iter().filter_map(|v| scale.at(v).map(|c| (f.py(&yr, c), num(v)))).collect();
        y_ticks(root, &yt, f.x0, Some(f.x1))?;
        let xr = 0.0..levels.len().max(1) as f64;
        let x_of = |c: f64| levels.iter().position(|&l| l == c).map(|i| f.px(&xr, i as f64 + 0.5));
        let xt: Vec<(i32, String)> =
            levels.iter().filter_map(|&c| x_of(c).map(|x| (x, c.to_string()))).collect();
        x_ticks(root, &xt, f.y1, Some(f.y0))?;
        let line = |name: &str| -> Vec<&SweepPoint> {
            let mut mine: Vec<&SweepPoint> = self.points.iter().filter(|p| p.run == name).collect();
            mine.sort_by(|a, b| a.load().total_cmp(&b.load()));
            mine
        };
        // Every band goes down before any line, so no band covers another run's line: where
        // bands overlap, the lines inside them cannot be told apart by the model.
        if let Some(e) = self.band.half_width() {
            for (d, name) in runs.iter().enumerate() {
                // The band's edges are the value times (1 ± e), mapped like the value (on a log
                // axis too); an edge the axis cannot show (zero or less on a log axis) sits
                // just under the frame, so clipping lays it on the frame's bottom.
                let y_of = |v: f64| scale.at(v).map_or(f.y1 + 1, |c| f.py(&yr, c));
                let edges: Vec<(i32, i32, i32)> = line(name)
                    .iter()
                    .filter_map(|p| {
                        let v = self.value(p)?;
                        scale.at(v)?;
                        Some((x_of(p.load())?, y_of(v * (1.0 + e)), y_of(v * (1.0 - e))))
                    })
                    .collect();
                let shape = clip_rows(&band_outline(&edges), f.y0, f.y1);
                if shape.len() >= 3 {
                    root.draw(&Polygon::new(shape, series_colour(d).mix(BAND_OPACITY).filled())).msg()?;
                }
            }
        }
        let mut legend: Vec<(Swatch, String)> = Vec::new();
        for (d, name) in runs.iter().enumerate() {
            let colour = series_colour(d);
            let shape = Marker::nth(d);
            let mine = line(name);
            let at = |p: &SweepPoint| -> Option<(i32, i32)> {
                let c = scale.at(self.value(p)?)?;
                Some((x_of(p.load())?, f.py(&yr, c)))
            };
            polyline(root, mine.iter().filter_map(|p| at(p)).collect(), colour.stroke_width(3))?;
            for p in &mine {
                if let Some(xy) = at(p) {
                    marker(root, shape, xy, 6, colour)?;
                    if p.outcome != Outcome::Clean {
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
        f.descs(root, x_desc, &desc, 72)?;
        text(root, "run", (980, f.y0 - 6), &style(TICK, MUTED, HPos::Left, VPos::Center))?;
        legend_column(root, &legend, 980, f.y0 + 18, 280)
    }
}

/// Opacity of an error band: light enough that a line and the bands of other runs show through.
const BAND_OPACITY: f64 = 0.18;

/// Half the width, in pixels, of the band of a run with a single point (a bar around it).
const LONE_HALF_WIDTH: i32 = 10;

/// The outline of a band through `edges` (pixel x, upper y, lower y; left to right): along the
/// upper edge, then back along the lower one. A lone point gets a bar around it.
fn band_outline(edges: &[(i32, i32, i32)]) -> Vec<(i32, i32)> {
    if let [(x, upper, lower)] = edges {
        return vec![
            (x - LONE_HALF_WIDTH, *upper),
            (x + LONE_HALF_WIDTH, *upper),
            (x + LONE_HALF_WIDTH, *lower),
            (x - LONE_HALF_WIDTH, *lower),
        ];
    }
    edges
        .iter()
        .map(|&(x, upper, _)| (x, upper))
        .chain(edges.iter().rev().map(|&(x, _, lower)| (x, lower)))
        .collect()
}

/// `polygon` clipped to the rows `top..=bottom` (pixel y grows downwards): Sutherland and
/// Hodgman's algorithm against the two horizontal edges of the plot frame. The band is drawn
/// only inside the frame, and its edges keep their slopes where they cross it.
fn clip_rows(polygon: &[(i32, i32)], top: i32, bottom: i32) -> Vec<(i32, i32)> {
    let mut points: Vec<(f64, f64)> = polygon.iter().map(|&(x, y)| (f64::from(x), f64::from(y))).collect();
    // Each edge is a row and the side kept: at or below the top row (y grows downwards), at or
    // above the bottom one.
    for (limit, side) in [(f64::from(top), 1.0), (f64::from(bottom), -1.0)] {
        let inside = |y: f64| side * (y - limit) >= 0.0;
        let mut kept = Vec::with_capacity(points.len() + 2);
        for (i, &q) in points.iter().enumerate() {
            let p = points[(i + points.len() - 1) % points.len()];
            let crossing = || {
                let t = (limit - p.1) / (q.1 - p.1);
                (p.0 + t * (q.0 - p.0), limit)
            };
            match (inside(p.1), inside(q.1)) {
                (true, true) => kept.push(q),
                (true, false) => kept.push(crossing()),
                (false, true) => {
                    kept.push(crossing());
                    kept.push(q);
                }
                (false, false) => {}
            }
        }
        points = kept;
    }
    let mut out: Vec<(i32, i32)> = Vec::with_capacity(points.len());
    for (x, y) in points {
        let xy = (x.round() as i32, y.round() as i32);
        if out.last() != Some(&xy) {
            out.push(xy);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_percent_table() {
        let check = |fitting: f64, expected: u32| assert_eq!(noise_percent(fitting), expected, "{fitting}");
        check(0.164, 20);
        check(0.2, 20);
        check(0.201, 25);
        check(0.01, 5);
        check(0.0, 5);
        check(f64::NAN, 5);
    }

    #[test]
    fn note_table() {
        let check = |band: ErrorBand, expected: &str| assert_eq!(band.note(), expected);
        check(
            ErrorBand::Measured { half_width: 0.23, points: 8, calibration: "c1".into() },
            "shaded: ± 23.0 % (median |error| on 8 held-out points, calibration c1)",
        );
        check(
            ErrorBand::Measured { half_width: 0.05, points: 1, calibration: "c1".into() },
            "shaded: ± 5.0 % (median |error| on 1 held-out point, calibration c1)",
        );
        check(
            ErrorBand::Unmeasured { fitting_error_max: 0.164, calibration: "c1".into() },
            "no validation error yet: the fit alone is off by up to 16.4 %, so read differences under \
             ~20 % as noise (calibration c1)",
        );
    }

    #[test]
    fn band_outline_table() {
        let check = |edges: &[(i32, i32, i32)], expected: &[(i32, i32)]| {
            assert_eq!(band_outline(edges), expected, "{edges:?}");
        };
        check(&[], &[]);
        check(&[(100, 40, 60)], &[(90, 40), (110, 40), (110, 60), (90, 60)]);
        check(&[(100, 40, 60), (200, 30, 50)], &[(100, 40), (200, 30), (200, 50), (100, 60)]);
    }

    #[test]
    fn clip_rows_table() {
        let check = |polygon: &[(i32, i32)], expected: &[(i32, i32)]| {
            assert_eq!(clip_rows(polygon, 100, 200), expected, "{polygon:?}");
        };
        // Inside: unchanged.
        check(&[(0, 120), (10, 120), (10, 180), (0, 180)], &[(0, 120), (10, 120), (10, 180), (0, 180)]);
        // Over the top: cut at the frame's top row, the slanted edge where it crosses.
        check(
            &[(0, 80), (100, 120), (100, 150), (0, 150)],
            &[(0, 100), (50, 100), (100, 120), (100, 150), (0, 150)],
        );
        // Through both rows: a rectangle of the frame's height.
        check(&[(0, 50), (10, 50), (10, 250), (0, 250)], &[(0, 200), (0, 100), (10, 100), (10, 200)]);
        // Wholly outside: nothing.
        check(&[(0, 10), (10, 10), (10, 20)], &[]);
    }
}
