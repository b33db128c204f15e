//! Latency distributions: TTFT and TPOT as cumulative distributions (`latency_cdf`).

use std::path::{Path, PathBuf};

use pdkv_sim::result::{RunResult, Summary};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use crate::error::ReportError;
use crate::render::{
    dashed_v, legend_row, marker, ms, note, num, polyline, render, series_colour, style, text, title,
    x_ticks, y_ticks, Area, Drawn, Frame, Marker, Msg, Picture, Scale, Swatch, ALERT, INK, SUBTITLE,
};

/// Writes `latency_cdf.png` and `latency_cdf.svg` into `dir`: two panels, TTFT and TPOT, each
/// the fraction of finished requests at or under a latency (x in milliseconds, log scale when
/// the values span a factor of 20 or more), with the mean and p99 marked. Without finished
/// requests the panels say so. Returns the paths written (PNG first).
pub fn latency_cdf(result: &RunResult, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    render(dir, "latency_cdf", &Cdf { result })
}

struct Cdf<'a> {
    result: &'a RunResult,
}

/// One panel's data.
struct Panel<'a> {
    caption: &'a str,
    x_desc: &'a str,
    percentiles: &'a [f64],
    /// `None` when nothing was measured.
    summary: Option<Summary>,
}

impl Picture for Cdf<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let r = self.result;
        let l = &r.latency_ms;
        title(
            root,
            &format!("Latency distribution: {}", r.title()),
            &match l.ttft {
                None => format!("{} of {} requests finished", r.requests.finished, r.requests.sent),
                Some(ttft) => format!(
                    "{} of {} requests finished · TTFT median {} · TPOT median {}",
                    r.requests.finished,
                    r.requests.sent,
                    ms(ttft.p50),
                    l.tpot.map_or("n/a".to_string(), |tpot| ms(tpot.p50))
                ),
            },
        )?;
        let ttft = Panel {
            caption: "Time to first token (TTFT)",
            x_desc: "TTFT (ms)",
            percentiles: &l.ttft_percentiles,
            summary: l.ttft,
        };
        let tpot = Panel {
            caption: "Time per output token after the first (TPOT)",
            x_desc: "TPOT (ms)",
            percentiles: &l.tpot_percentiles,
            summary: l.tpot,
        };
        draw_panel(root, &ttft, Frame { x0: 110, y0: 116, x1: 610, y1: 580 })?;
        draw_panel(root, &tpot, Frame { x0: 750, y0: 116, x1: 1250, y1: 580 })
    }
}

/// The fraction of requests at or under `x`, interpolated between percentiles.
fn fraction_at(percentiles: &[f64], x: f64) -> f64 {
    let n = percentiles.len();
    if n < 2 || x < percentiles[0] {
        return 0.0;
    }
    let step = 1.0 / (n - 1) as f64;
    for (i, w) in percentiles.windows(2).enumerate() {
        if x < w[1] {
            let f = if w[1] > w[0] { (x - w[0]) / (w[1] - w[0]) } else { 0.0 };
            return (i as f64 + f) * step;
        }
    }
    1.0
}

fn draw_panel<DB: DrawingBackend>(root: &Area<DB>, p: &Panel, f: Frame) -> Drawn {
    text(root, p.caption, (f.x0, f.y0 - 30), &style(SUBTITLE, INK, HPos::Left, VPos::Top))?;
    let yr = 0.0..1.0;
    let yt: Vec<(i32, String)> =
        (0..=5).map(|k| f64::from(k) / 5.0).map(|v| (f.py(&yr, v), num(v))).collect();
    let values: Vec<f64> = p.percentiles.iter().copied().filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        y_ticks(root, &yt, f.x0, Some(f.x1))?;
        f.axes(root)?;
        f.descs(root, &format!("{} (no data)", p.x_desc), "fraction of requests ≤ x", 60)?;
        return note(root, "no finished requests", f.centre());
    }
    let (mean, p99) = (p.summary.map(|s| s.mean), p.summary.map(|s| s.p99));
    let mut span = values.clone();
    span.extend([mean, p99].iter().flatten().filter(|v| v.is_finite()));
    let scale = Scale::fit(&span, 20.0, false);
    let xr = scale.range();
    let x_of = |v: f64| scale.at(v).map(|c| f.px(&xr, c));
    let xt: Vec<(i32, String)> =
        scale.ticks(6).into_iter().filter_map(|v| x_of(v).map(|x| (x, num(v)))).collect();
    y_ticks(root, &yt, f.x0, Some(f.x1))?;
    x_ticks(root, &xt, f.y1, Some(f.y0))?;
    let step = 1.0 / (p.percentiles.len().max(2) - 1) as f64;
    let points: Vec<(i32, i32)> = p
        .percentiles
        .iter()
        .enumerate()
        .filter_map(|(i, v)| x_of(*v).map(|x| (x, f.py(&yr, i as f64 * step))))
        .collect();
    let mean_colour = series_colour(2);
    let line = series_colour(0);
    let mut legend = vec![(Swatch::Line { colour: line, dashed: false, marker: None }, "CDF".to_string())];
    if let Some((mean, x)) = mean.and_then(|m| Some((m, x_of(m)?))) {
        dashed_v(root, x, f.y0, f.y1, mean_colour.stroke_width(2))?;
        legend.push((
            Swatch::Line { colour: mean_colour, dashed: true, marker: Some(Marker::Circle) },
            format!("mean {}", ms(mean)),
        ));
    }
    if let Some((p99, x)) = p99.and_then(|v| Some((v, x_of(v)?))) {
        dashed_v(root, x, f.y0, f.y1, ALERT.stroke_width(2))?;
        legend.push((
            Swatch::Line { colour: ALERT, dashed: true, marker: Some(Marker::Triangle) },
            format!("p99 {}", ms(p99)),
        ));
    }
    polyline(root, points, line.stroke_width(3))?;
    if let Some((mean, x)) = mean.and_then(|m| Some((m, x_of(m)?))) {
        marker(root, Marker::Circle, (x, f.py(&yr, fraction_at(p.percentiles, mean))), 6, mean_colour)?;
    }
    if let Some(x) = p99.and_then(x_of) {
        marker(root, Marker::Triangle, (x, f.py(&yr, 0.99)), 6, ALERT)?;
    }
    f.axes(root)?;
    let desc = if scale.is_log() { format!("{}, log scale", p.x_desc) } else { p.x_desc.to_string() };
    f.descs(root, &desc, "fraction of requests ≤ x", 60)?;
    legend_row(root, &legend, (f.x0 + f.x1) / 2, f.y1 + 80, f.x1 - f.x0 + 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_interpolates_between_percentiles() {
        let p: Vec<f64> = (0..=100).map(f64::from).collect();
        assert_eq!(fraction_at(&p, -1.0), 0.0);
        assert!((fraction_at(&p, 50.5) - 0.505).abs() < 1e-9);
        assert_eq!(fraction_at(&p, 100.0), 1.0);
        assert_eq!(fraction_at(&[], 3.0), 0.0);
        assert_eq!(fraction_at(&[5.0; 101], 5.0), 1.0);
    }
}
