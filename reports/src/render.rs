//! Shared drawing machinery: the embedded font, writing one picture as PNG and SVG, colours,
//! text measuring, tick choice, titles and legends.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ab_glyph::{point, Font, FontRef, PxScale, PxScaleFont, ScaleFont};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontDesc, FontFamily, FontStyle};

use crate::error::ReportError;

/// Picture size in pixels (PNG) and user units (SVG).
pub(crate) const SIZE: (u32, u32) = (1280, 720);

/// The family every text style uses; the embedded DejaVu Sans is registered under it, and SVG
/// viewers map the same generic name to a sans-serif font of their own.
pub(crate) const FAMILY: &str = "sans-serif";

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Registers the embedded font once per process.
fn register() -> Result<(), ReportError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(ReportError::Font)
    }
}

/// The whole picture, in pixel coordinates, and how its text is drawn.
pub(crate) struct Canvas<DB: DrawingBackend> {
    area: DrawingArea<DB, Shift>,
    /// Draw text as pixels with the embedded font (PNG) rather than as text elements (SVG).
    raster: bool,
}

impl<DB: DrawingBackend> std::ops::Deref for Canvas<DB> {
    type Target = DrawingArea<DB, Shift>;
    fn deref(&self) -> &Self::Target {
        &self.area
    }
}

/// The picture being drawn.
pub(crate) type Area<DB> = Canvas<DB>;

/// Drawing result; the message is plotters' error text.
pub(crate) type Drawn = Result<(), String>;

/// Something drawn the same way on every backend.
pub(crate) trait Picture {
    /// Draws the picture on `root` (already sized [`SIZE`], not yet filled).
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn;
}

/// Turns plotters' errors into their message.
pub(crate) trait Msg<T> {
    /// The value, or the error's text.
    fn msg(self) -> Result<T, String>;
}

impl<T, E: std::error::Error + Send + Sync> Msg<T> for Result<T, DrawingAreaErrorKind<E>> {
    fn msg(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Writes `<stem>.png` and `<stem>.svg` into `dir` (created if missing); returns both paths.
pub(crate) fn render(dir: &Path, stem: &str, picture: &impl Picture) -> Result<Vec<PathBuf>, ReportError> {
    register()?;
    fs::create_dir_all(dir).map_err(|e| ReportError::io(dir, e))?;
    let png = dir.join(format!("{stem}.png"));
    // Drawn into memory and encoded there, then written whole: plotters writing the file itself
    // reports a full disk as an encoder's debug text, and leaves a cut file behind.
    let mut pixels = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    {
        let root =
            Canvas { area: BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area(), raster: true };
        picture
            .draw(&root)
            .and_then(|()| root.present().msg())
            .map_err(|what| ReportError::Draw { path: png.clone(), what })?;
    }
    let mut encoded = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut encoded),
        &pixels,
        SIZE.0,
        SIZE.1,
        image::ColorType::Rgb8,
    )
    .map_err(|e| ReportError::Draw { path: png.clone(), what: e.to_string() })?;
    pdkv_sim::files::write_atomic(&png, &encoded).map_err(|e| ReportError::io(&png, e))?;
    let svg = dir.join(format!("{stem}.svg"));
    let mut text = String::new();
    {
        let root =
            Canvas { area: SVGBackend::with_string(&mut text, SIZE).into_drawing_area(), raster: false };
        picture
            .draw(&root)
            .and_then(|()| root.present().msg())
            .map_err(|what| ReportError::Draw { path: svg.clone(), what })?;
    }
    pdkv_sim::files::write_atomic(&svg, text.as_bytes()).map_err(|e| ReportError::io(&svg, e))?;
    Ok(vec![png, svg])
}

// ---------------------------------------------------------------------------------------------
// Colours.

/// Text and axes.
pub(crate) const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
/// Secondary text.
pub(crate) const MUTED: RGBColor = RGBColor(0x66, 0x66, 0x66);
/// Grid lines and light borders.
pub(crate) const GRID: RGBColor = RGBColor(0xDD, 0xDD, 0xDD);
/// Alternate background band.
pub(crate) const BAND: RGBColor = RGBColor(0xF0, 0xF0, 0xF0);
/// Problems: cycles, runs that did not end clean, p99.
pub(crate) const ALERT: RGBColor = RGBColor(0xD6, 0x27, 0x28);

/// Series colours (Tableau 10 without its red, which marks problems).
pub(crate) const PALETTE: [RGBColor; 9] = [
    RGBColor(0x4E, 0x79, 0xA7),
    RGBColor(0xF2, 0x8E, 0x2B),
    RGBColor(0x59, 0xA1, 0x4F),
    RGBColor(0xB0, 0x7A, 0xA1),
    RGBColor(0x76, 0xB7, 0xB2),
    RGBColor(0x9C, 0x75, 0x5F),
    RGBColor(0xED, 0xC9, 0x48),
    RGBColor(0xFF, 0x9D, 0xA7),
    RGBColor(0x79, 0x70, 0x6E),
];

/// The `i`th series colour.
pub(crate) fn series_colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

// ---------------------------------------------------------------------------------------------
// Text.

/// Title size.
pub(crate) const TITLE: f64 = 28.0;
/// Subtitle and panel caption size.
pub(crate) const SUBTITLE: f64 = 18.0;
/// Axis description size.
pub(crate) const AXIS: f64 = 18.0;
/// Tick label and legend size.
pub(crate) const TICK: f64 = 16.0;

/// A text style in the embedded font.
pub(crate) fn style(size: f64, colour: RGBColor, h: HPos, v: VPos) -> TextStyle<'static> {
    FontDesc::new(FontFamily::Name(FAMILY), size, FontStyle::Normal).color(&colour).pos(Pos::new(h, v))
}

/// A text style rotated to read bottom to top (for vertical axis descriptions).
pub(crate) fn vertical(size: f64, colour: RGBColor) -> TextStyle<'static> {
    style(size, colour, HPos::Center, VPos::Center).transform(FontTransform::Rotate270)
}

/// The embedded font, parsed once.
fn face() -> Option<&'static FontRef<'static>> {
    static FACE: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    FACE.get_or_init(|| FontRef::try_from_slice(FONT).ok()).as_ref()
}

/// Pixels per em for a plotters font size (plotters' SVG backend writes `font-size` as
/// `size / 1.24`; PNG text uses the same em so both pictures lay out alike).
fn em(size: f64) -> f32 {
    (size / 1.24) as f32
}

/// The font scaled to `size`.
fn scaled(font: &'static FontRef<'static>, size: f64) -> PxScaleFont<&'static FontRef<'static>> {
    let per_em = font.units_per_em().unwrap_or(2048.0);
    font.as_scaled(PxScale::from(em(size) * font.height_unscaled() / per_em))
}

/// Width of `text` in pixels at `size` (advances and kerning of the embedded font).
pub(crate) fn text_width(text: &str, size: f64) -> i32 {
    let Some(font) = face() else {
        return (text.chars().count() as f64 * size * 0.5) as i32;
    };
    let sf = scaled(font, size);
    let mut width = 0.0f32;
    let mut prev = None;
    for c in text.chars() {
        let id = sf.glyph_id(c);
        if let Some(p) = prev {
            width += sf.kern(p, id);
        }
        width += sf.h_advance(id);
        prev = Some(id);
    }
    width.ceil() as i32
}

/// Draws `text` as anti-aliased pixels with the embedded font, anchored and rotated as
/// `style` says, with the same anchoring as plotters' SVG text (baseline 0.76 em under a top
/// anchor, half an x-height under a centre anchor, half an x-height above a bottom anchor).
fn raster_text<DB: DrawingBackend>(root: &Area<DB>, text: &str, at: (i32, i32), style: &TextStyle) -> Drawn {
    let Some(font) = face() else {
        return Err("the embedded font cannot be parsed".to_string());
    };
    let size = style.font.get_size();
    let sf = scaled(font, size);
    let em = em(size);
    let width = text_width(text, size) as f32;
    let x0 = match style.pos.h_pos {
        HPos::Left => 0.0,
        HPos::Center => -width / 2.0,
        HPos::Right => -width,
    };
    let half_ex = 0.2735 * em;
    let baseline = match style.pos.v_pos {
        VPos::Top => 0.76 * em,
        VPos::Center => half_ex,
        VPos::Bottom => -half_ex,
    }
    .round();
    let (r, g, b) = style.color.rgb;
    let alpha = style.color.alpha;
    let transform = style.font.get_transform();
    let mut pixels: Vec<(i32, i32, f32)> = Vec::new();
    let mut pen = x0;
    let mut prev = None;
    for c in text.chars() {
        let id = sf.glyph_id(c);
        if let Some(p) = prev {
            pen += sf.kern(p, id);
        }
        let glyph = id.with_scale_and_position(sf.scale(), point(pen, baseline));
        if let Some(outline) = font.outline_glyph(glyph) {
            let bounds = outline.px_bounds();
            let (bx, by) = (bounds.min.x as i32, bounds.min.y as i32);
            outline.draw(|x, y, coverage| {
                if coverage > 0.0 {
                    pixels.push((bx + x as i32, by + y as i32, coverage.min(1.0)));
                }
            });
        }
        pen += sf.h_advance(id);
        prev = Some(id);
    }
    for (x, y, coverage) in pixels {
        let (dx, dy) = match transform {
            FontTransform::None => (x, y),
            FontTransform::Rotate90 => (-y, x),
            FontTransform::Rotate180 => (-x, -y),
            FontTransform::Rotate270 => (y, -x),
        };
        let colour = RGBAColor(r, g, b, alpha * f64::from(coverage));
        root.draw_pixel((at.0 + dx, at.1 + dy), &colour).msg()?;
    }
    Ok(())
}

/// `text`, cut with an ellipsis so it is at most `max` pixels wide at `size`.
pub(crate) fn fit(text: &str, size: f64, max: i32) -> String {
    if text_width(text, size) <= max {
        return text.to_string();
    }
    let chars: Vec<char> = text.chars().collect();
    let mut n = chars.len();
    while n > 0 {
        n -= 1;
        let cut: String = chars[..n].iter().collect::<String>().trim_end().to_string() + "…";
        if text_width(&cut, size) <= max {
            return cut;
        }
    }
    "…".to_string()
}

/// `text` broken at spaces into at most `lines` lines of at most `max` pixels at `size`; the
/// last line is cut with an ellipsis when the text does not fit, and a word longer than a line
/// is cut too.
pub(crate) fn wrap(text: &str, size: f64, max: i32, lines: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        let candidate = if current.is_empty() { word.to_string() } else { format!("{current} {word}") };
        if current.is_empty() || text_width(&candidate, size) <= max {
            current = candidate;
        } else {
            out.push(std::mem::replace(&mut current, word.to_string()));
        }
    }
    if !current.is_empty() || out.is_empty() {
        out.push(current);
    }
    let lines = lines.max(1);
    if out.len() > lines {
        let rest = out[lines - 1..].join(" ");
        out.truncate(lines - 1);
        out.push(rest);
    }
    out.iter().map(|line| fit(line, size, max)).collect()
}

/// Draws `text` at `(x, y)` on the whole picture.
pub(crate) fn text<DB: DrawingBackend>(
    root: &Area<DB>,
    text: &str,
    at: (i32, i32),
    style: &TextStyle,
) -> Drawn {
    if text.is_empty() {
        return Ok(());
    }
    if root.raster {
        raster_text(root, text, at, style)
    } else {
        root.draw_text(text, style, at).msg()
    }
}

/// Smallest size a long title shrinks to before it is cut short.
const TITLE_MIN: f64 = 20.0;

/// The size at which `title` fits in `max` pixels: [`TITLE`], or smaller down to [`TITLE_MIN`]
/// (a title names the run, so shrinking keeps all of it where cutting would lose the end).
fn title_size(title: &str, max: i32) -> f64 {
    let mut size = TITLE;
    while size > TITLE_MIN && text_width(title, size) > max {
        size -= 2.0;
    }
    size
}

/// The title (and a subtitle line under it), centred at the top.
pub(crate) fn title<DB: DrawingBackend>(root: &Area<DB>, title: &str, subtitle: &str) -> Drawn {
    let (w, _) = root.dim_in_pixel();
    let w = w as i32;
    let size = title_size(title, w - 40);
    text(root, &fit(title, size, w - 40), (w / 2, 12), &style(size, INK, HPos::Center, VPos::Top))?;
    text(
        root,
        &fit(subtitle, SUBTITLE, w - 40),
        (w / 2, 46),
        &style(SUBTITLE, MUTED, HPos::Center, VPos::Top),
    )
}

/// A centred grey note in the middle of an empty chart.
pub(crate) fn note<DB: DrawingBackend>(root: &Area<DB>, message: &str, centre: (i32, i32)) -> Drawn {
    text(root, message, centre, &style(24.0, MUTED, HPos::Center, VPos::Center))
}

// ---------------------------------------------------------------------------------------------
// Legends.

/// What a legend entry shows next to its text.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Swatch {
    /// A filled square.
    Box(RGBColor),
    /// A line, dashed or not, with an optional circle marker.
    Line { colour: RGBColor, dashed: bool, marker: Option<Marker> },
    /// A marker alone.
    Mark(Marker, RGBColor),
}

/// Marker shapes for line charts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Marker {
    Circle,
    Square,
    Triangle,
    Diamond,
    Cross,
}

impl Marker {
    /// The `i`th of the filled shapes.
    pub(crate) fn nth(i: usize) -> Marker {
        [Marker::Circle, Marker::Square, Marker::Triangle, Marker::Diamond][i % 4]
    }
}

/// Draws `marker` centred at `at` with radius `r`.
pub(crate) fn marker<DB: DrawingBackend>(
    root: &Area<DB>,
    marker: Marker,
    at: (i32, i32),
    r: i32,
    colour: RGBColor,
) -> Drawn {
    let (x, y) = at;
    let fill = colour.filled();
    match marker {
        Marker::Circle => root.draw(&Circle::new(at, r, fill)).msg(),
        Marker::Square => {
            root.draw(&Rectangle::new([(x - r + 1, y - r + 1), (x + r - 1, y + r - 1)], fill)).msg()
        }
        Marker::Triangle => {
            root.draw(&Polygon::new(vec![(x, y - r - 1), (x + r + 1, y + r), (x - r - 1, y + r)], fill)).msg()
        }
        Marker::Diamond => root
            .draw(&Polygon::new(vec![(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)], fill))
            .msg(),
        Marker::Cross => {
            let s = colour.stroke_width(3);
            root.draw(&PathElement::new(vec![(x - r, y - r), (x + r, y + r)], s)).msg()?;
            root.draw(&PathElement::new(vec![(x - r, y + r), (x + r, y - r)], s)).msg()
        }
    }
}

/// Draws a horizontal dashed line from `x0` to `x1` at `y`.
pub(crate) fn dashed_h<DB: DrawingBackend>(
    root: &Area<DB>,
    x0: i32,
    x1: i32,
    y: i32,
    style: ShapeStyle,
) -> Drawn {
    let mut x = x0;
    while x < x1 {
        root.draw(&PathElement::new(vec![(x, y), ((x + 8).min(x1), y)], style)).msg()?;
        x += 13;
    }
    Ok(())
}

/// Width of a legend entry's swatch plus gap.
const SWATCH_W: i32 = 34;

/// Width of one legend entry.
fn entry_width(label: &str) -> i32 {
    SWATCH_W + text_width(label, TICK)
}

fn swatch<DB: DrawingBackend>(root: &Area<DB>, swatch: Swatch, x: i32, y: i32) -> Drawn {
    match swatch {
        Swatch::Box(c) => root.draw(&Rectangle::new([(x + 4, y - 7), (x + 22, y + 7)], c.filled())).msg(),
        Swatch::Line { colour, dashed, marker: m } => {
            let s = colour.stroke_width(3);
            if dashed {
                dashed_h(root, x, x + 27, y, s)?;
            } else {
                root.draw(&PathElement::new(vec![(x, y), (x + 26, y)], s)).msg()?;
            }
            match m {
                Some(m) => marker(root, m, (x + 13, y), 5, colour),
                None => Ok(()),
            }
        }
        Swatch::Mark(m, c) => marker(root, m, (x + 13, y), 6, c),
    }
}

/// Draws legend entries in one row centred on `centre_x` at height `y`; the row wraps onto
/// further rows 22 pixels apart when wider than `max_w`.
pub(crate) fn legend_row<DB: DrawingBackend>(
    root: &Area<DB>,
    entries: &[(Swatch, String)],
    centre_x: i32,
    y: i32,
    max_w: i32,
) -> Drawn {
    const GAP: i32 = 28;
    let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut width = 0;
    for (i, (_, label)) in entries.iter().enumerate() {
        let w = entry_width(label);
        let row = rows.last_mut().expect("one row");
        if !row.is_empty() && width + GAP + w > max_w {
            rows.push(vec![i]);
            width = w;
        } else {
            width += if row.is_empty() { w } else { GAP + w };
            row.push(i);
        }
    }
    for (r, row) in rows.iter().enumerate() {
        let total: i32 =
            row.iter().map(|&i| entry_width(&entries[i].1)).sum::<i32>() + GAP * (row.len() as i32 - 1);
        let mut x = centre_x - total / 2;
        let yy = y + 22 * r as i32;
        for &i in row {
            let (s, label) = &entries[i];
            swatch(root, *s, x, yy)?;
            text(root, label, (x + SWATCH_W, yy), &style(TICK, INK, HPos::Left, VPos::Center))?;
            x += entry_width(label) + GAP;
        }
    }
    Ok(())
}

/// Draws legend entries one under the other from `(x, y)`, 24 pixels apart, each label cut to
/// `max_w` pixels.
pub(crate) fn legend_column<DB: DrawingBackend>(
    root: &Area<DB>,
    entries: &[(Swatch, String)],
    x: i32,
    y: i32,
    max_w: i32,
) -> Drawn {
    for (i, (s, label)) in entries.iter().enumerate() {
        let yy = y + 24 * i as i32;
        swatch(root, *s, x, yy)?;
        let label = fit(label, TICK, max_w - SWATCH_W);
        text(root, &label, (x + SWATCH_W, yy), &style(TICK, INK, HPos::Left, VPos::Center))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Numbers and ticks.

/// A compact label for a tick value: `12k`, `1.5M`, `0.25`, `26.2`.
pub(crate) fn num(v: f64) -> String {
    let a = v.abs();
    let trimmed = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trimmed(format!("{:.2}", v / 1e6)))
    } else if a >= 1e4 {
        format!("{}k", trimmed(format!("{:.1}", v / 1e3)))
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        trimmed(format!("{v:.2}"))
    } else {
        trimmed(format!("{v:.3}"))
    }
}

/// A latency for legends and subtitles: `3240 ms`, `262.5 ms`, `26.17 ms`, `0.512 ms`.
pub(crate) fn ms(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0} ms")
    } else if a >= 100.0 {
        format!("{v:.1} ms")
    } else if a >= 1.0 {
        format!("{v:.2} ms")
    } else {
        format!("{v:.3} ms")
    }
}

/// The sum of `values` (0 for none; `Iterator::sum` of no floats is -0).
pub(crate) fn total(values: &[f64]) -> f64 {
    values.iter().fold(0.0, |a, b| a + b)
}

/// About `n` round tick values covering `lo..=hi` (steps of 1, 2 or 5 times a power of ten).
pub(crate) fn linear_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !lo.is_finite() || !hi.is_finite() || hi <= lo {
        return vec![lo];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * power).find(|s| *s >= raw).unwrap_or(10.0 * power);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Tick values for a log axis over `lo..=hi` (both > 0): 1, 2, 5 times powers of ten when the
/// range spans few decades, powers of ten otherwise.
pub(crate) fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if lo <= 0.0 || hi <= lo || !hi.is_finite() {
        return vec![lo];
    }
    let decades = hi.log10() - lo.log10();
    let steps: &[f64] = if decades <= 3.5 { &[1.0, 2.0, 5.0] } else { &[1.0] };
    let mut out = Vec::new();
    let mut power = 10f64.powf(lo.log10().floor());
    while power <= hi {
        for m in steps {
            let v = m * power;
            if v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) {
                out.push(v);
            }
        }
        power *= 10.0;
    }
    out
}

/// How a value axis is scaled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Scale {
    /// Linear from `lo` to `hi`.
    Linear { lo: f64, hi: f64 },
    /// Logarithmic from `lo` to `hi` (both > 0); coordinates are `log10(value)`.
    Log { lo: f64, hi: f64 },
}

impl Scale {
    /// A scale for `values` (finite): log when all are positive and they span at least `ratio`,
    /// linear from zero (or from just under the minimum when `from_zero` is false) otherwise.
    pub(crate) fn fit(values: &[f64], ratio: f64, from_zero: bool) -> Scale {
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !lo.is_finite() || !hi.is_finite() {
            return Scale::Linear { lo: 0.0, hi: 1.0 };
        }
        if lo > 0.0 && hi / lo >= ratio {
            return Scale::Log { lo: lo / 1.25, hi: hi * 1.25 };
        }
        if from_zero && lo >= 0.0 {
            let hi = if hi > 0.0 { hi * 1.12 } else { 1.0 };
            return Scale::Linear { lo: 0.0, hi };
        }
        let pad = if hi > lo { (hi - lo) * 0.06 } else { (hi.abs() * 0.05).max(0.5) };
        let lo = if lo >= 0.0 && lo - pad < 0.0 { 0.0 } else { lo - pad };
        Scale::Linear { lo, hi: hi + pad }
    }

    /// The coordinate range (log10 of the bounds for a log scale).
    pub(crate) fn range(self) -> std::ops::Range<f64> {
        match self {
            Scale::Linear { lo, hi } => lo..hi,
            Scale::Log { lo, hi } => lo.log10()..hi.log10(),
        }
    }

    /// The coordinate of `v`, if it can be shown.
    pub(crate) fn at(self, v: f64) -> Option<f64> {
        match self {
            Scale::Linear { .. } if v.is_finite() => Some(v),
            Scale::Log { .. } if v.is_finite() && v > 0.0 => Some(v.log10()),
            _ => None,
        }
    }

    /// Tick values (not coordinates), about `n` of them on a linear scale.
    pub(crate) fn ticks(self, n: usize) -> Vec<f64> {
        match self {
            Scale::Linear { lo, hi } => linear_ticks(lo, hi, n),
            Scale::Log { lo, hi } => log_ticks(lo, hi),
        }
    }

    /// True for a log scale.
    pub(crate) fn is_log(self) -> bool {
        matches!(self, Scale::Log { .. })
    }
}

/// Draws tick marks and labels under a horizontal axis at pixel height `axis_y`, and light
/// vertical grid lines from `top` down to the axis; `ticks` are (pixel x, label).
pub(crate) fn x_ticks<DB: DrawingBackend>(
    root: &Area<DB>,
    ticks: &[(i32, String)],
    axis_y: i32,
    top: Option<i32>,
) -> Drawn {
    let label = style(TICK, INK, HPos::Center, VPos::Top);
    for (x, t) in ticks {
        if let Some(top) = top {
            root.draw(&PathElement::new(vec![(*x, top), (*x, axis_y)], GRID.stroke_width(1))).msg()?;
        }
        root.draw(&PathElement::new(vec![(*x, axis_y), (*x, axis_y + 5)], INK.stroke_width(1))).msg()?;
        text(root, t, (*x, axis_y + 8), &label)?;
    }
    Ok(())
}

/// Draws tick marks and labels left of a vertical axis at pixel `axis_x`, and light horizontal
/// grid lines from the axis to `right`; `ticks` are (pixel y, label).
pub(crate) fn y_ticks<DB: DrawingBackend>(
    root: &Area<DB>,
    ticks: &[(i32, String)],
    axis_x: i32,
    right: Option<i32>,
) -> Drawn {
    let label = style(TICK, INK, HPos::Right, VPos::Center);
    for (y, t) in ticks {
        if let Some(right) = right {
            root.draw(&PathElement::new(vec![(axis_x, *y), (right, *y)], GRID.stroke_width(1))).msg()?;
        }
        root.draw(&PathElement::new(vec![(axis_x - 5, *y), (axis_x, *y)], INK.stroke_width(1))).msg()?;
        text(root, t, (axis_x - 8, *y), &label)?;
    }
    Ok(())
}

/// A plot frame in pixels: where values go on the picture.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Frame {
    /// Left edge.
    pub x0: i32,
    /// Top edge.
    pub y0: i32,
    /// Right edge.
    pub x1: i32,
    /// Bottom edge.
    pub y1: i32,
}

impl Frame {
    /// Pixel x of coordinate `v` in `range`.
    pub(crate) fn px(&self, range: &std::ops::Range<f64>, v: f64) -> i32 {
        let f = if range.end > range.start { (v - range.start) / (range.end - range.start) } else { 0.5 };
        self.x0 + (f * f64::from(self.x1 - self.x0)).round() as i32
    }

    /// Pixel y of coordinate `v` in `range` (up is larger).
    pub(crate) fn py(&self, range: &std::ops::Range<f64>, v: f64) -> i32 {
        let f = if range.end > range.start { (v - range.start) / (range.end - range.start) } else { 0.5 };
        self.y1 - (f * f64::from(self.y1 - self.y0)).round() as i32
    }

    /// The centre.
    pub(crate) fn centre(&self) -> (i32, i32) {
        ((self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2)
    }

    /// Draws the left and bottom axis lines.
    pub(crate) fn axes<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        let s = INK.stroke_width(1);
        root.draw(&PathElement::new(vec![(self.x0, self.y0), (self.x0, self.y1), (self.x1, self.y1)], s))
            .msg()
    }

    /// Draws the axis descriptions: `x` centred under the tick labels, `y` rotated left of them
    /// at `y_offset` pixels from the axis.
    pub(crate) fn descs<DB: DrawingBackend>(
        &self,
        root: &Area<DB>,
        x: &str,
        y: &str,
        y_offset: i32,
    ) -> Drawn {
        text(root, x, ((self.x0 + self.x1) / 2, self.y1 + 32), &style(AXIS, INK, HPos::Center, VPos::Top))?;
        text(root, y, (self.x0 - y_offset, (self.y0 + self.y1) / 2), &vertical(AXIS, INK))
    }
}

/// Draws a polyline clipped to nothing (the caller keeps it inside its frame).
pub(crate) fn polyline<DB: DrawingBackend>(
    root: &Area<DB>,
    points: Vec<(i32, i32)>,
    style: ShapeStyle,
) -> Drawn {
    if points.len() < 2 {
        return Ok(());
    }
    root.draw(&PathElement::new(points, style)).msg()
}

/// Draws a vertical dashed line from `y0` to `y1` at `x`.
pub(crate) fn dashed_v<DB: DrawingBackend>(
    root: &Area<DB>,
    x: i32,
    y0: i32,
    y1: i32,
    style: ShapeStyle,
) -> Drawn {
    let (top, bottom) = (y0.min(y1), y0.max(y1));
    let mut y = top;
    while y < bottom {
        root.draw(&PathElement::new(vec![(x, y), (x, (y + 8).min(bottom))], style)).msg()?;
        y += 13;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(linear_ticks(0.0, 100.0, 5), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(linear_ticks(0.0, 1.0, 5), vec![0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]);
        assert_eq!(log_ticks(500.0, 30000.0), vec![500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0]);
        assert_eq!(log_ticks(0.5, 50000.0), vec![1.0, 10.0, 100.0, 1000.0, 10000.0]);
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(num(37692.0), "37.7k");
        assert_eq!(num(40000.0), "40k");
        assert_eq!(num(0.25), "0.25");
        assert_eq!(num(26.2), "26.2");
        assert_eq!(num(1500.0), "1500");
        assert_eq!(num(2_500_000.0), "2.5M");
        assert_eq!(ms(3240.198), "3240 ms");
        assert_eq!(ms(26.165), "26.16 ms");
        assert_eq!(ms(262.46), "262.5 ms");
        assert_eq!(total(&[]).to_string(), "0");
    }

    #[test]
    fn scales_pick_log_for_wide_ranges() {
        assert!(Scale::fit(&[670.0, 28447.0], 20.0, true).is_log());
        assert_eq!(Scale::fit(&[0.0, 10.0], 20.0, true), Scale::Linear { lo: 0.0, hi: 11.200000000000001 });
        assert_eq!(Scale::fit(&[], 20.0, true), Scale::Linear { lo: 0.0, hi: 1.0 });
        assert_eq!(Scale::Log { lo: 1.0, hi: 100.0 }.at(0.0), None);
    }

    #[test]
    fn text_is_cut_and_wrapped() {
        register().expect("font");
        let long = "blocked on handshake prefill-0:6301_dp0_tp3";
        assert!(text_width(long, 12.0) > 100);
        let cut = fit(long, 12.0, 100);
        assert!(cut.ends_with('…') && text_width(&cut, 12.0) <= 100, "{cut}");
        let lines = wrap(long, 12.0, 140, 2);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], "blocked on handshake");
        let lines = wrap("a b c d e f g h i j k l m n o p q r s t u v w x y z", 12.0, 40, 2);
        assert_eq!(lines.len(), 2);
        assert!(lines[1].ends_with('…'), "{lines:?}");
        assert_eq!(wrap("short", 12.0, 200, 2), vec!["short".to_string()]);
    }
}
