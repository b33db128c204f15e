//! Drawing a laid-out wait-for graph: pixel geometry of boxes, bends and labels, then the
//! boxes, arrows and legend.

use std::collections::BTreeMap;

use pdkv_sim::result::Hang;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use super::graph::{Edge, Graph};
use super::layout::{inside_edges, label_specs, Anchor, Inside, Item, Layout, Spec, LOOP_STEP};
use crate::render::{
    dashed_h, dashed_v, fit, legend_row, note, style, text, text_width, title, wrap, Area, Drawn, Msg,
    Picture, Swatch, ALERT, GRID, INK, MUTED, SUBTITLE,
};

pub(super) struct WaitFor<'a> {
    pub(super) hang: &'a Hang,
    /// The run's title.
    pub(super) run: &'a str,
}

/// Box fill and border of a waiter.
pub(super) const NODE_FILL: RGBColor = RGBColor(0xDC, 0xE6, 0xF2);
pub(super) const NODE_LINE: RGBColor = RGBColor(0x4E, 0x79, 0xA7);
/// Box fill of a node in a cycle.
pub(super) const CYCLE_FILL: RGBColor = RGBColor(0xFB, 0xE0, 0xE0);
/// Box fill and border of a node that waits for nothing.
pub(super) const END_FILL: RGBColor = RGBColor(0xFD, 0xE9, 0xCF);
pub(super) const END_LINE: RGBColor = RGBColor(0xE0, 0x7B, 0x00);
/// Edge colour.
pub(super) const EDGE: RGBColor = RGBColor(0x70, 0x70, 0x70);

/// Edge label size, line height and widest label.
pub(super) const LABEL: f64 = 14.0;
pub(super) const LABEL_LINE: i32 = 15;
pub(super) const LABEL_MAX: i32 = 210;

/// The drawing area for the graph.
pub(super) const LEFT: i32 = 20;
pub(super) const RIGHT: i32 = 1260;
pub(super) const TOP: i32 = 96;
pub(super) const BOTTOM: i32 = 668;

/// A pixel rectangle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rect {
    pub(super) x0: i32,
    pub(super) y0: i32,
    pub(super) x1: i32,
    pub(super) y1: i32,
}

impl Rect {
    pub(super) fn overlaps(&self, o: &Rect) -> bool {
        self.x0 < o.x1 && o.x0 < self.x1 && self.y0 < o.y1 && o.y0 < self.y1
    }
    pub(super) fn cy(&self) -> i32 {
        (self.y0 + self.y1) / 2
    }
}

/// Pixel geometry of a laid-out graph.
pub(super) struct Geometry {
    /// Box of each node.
    pub(super) boxes: Vec<Rect>,
    /// Label lines of each node.
    pub(super) lines: Vec<Vec<String>>,
    /// Height of each bend.
    pub(super) bends: BTreeMap<Item, i32>,
    /// Left and right edge of the boxes of each column.
    pub(super) column_x: Vec<(i32, i32)>,
    /// Box label size.
    pub(super) font: f64,
    /// Lines of each edge label (as `label_specs` lists them).
    pub(super) label_lines: Vec<Vec<String>>,
    /// Width right of each column taken by its loops.
    pub(super) loop_room: Vec<i32>,
}

/// Room a label needs in its gap besides its text: for the arrows fanning out or in, or for
/// the loops it sits beside (`loop_room` of the gap's column).
pub(super) fn label_pad(spec: &Spec, loop_room: i32) -> i32 {
    match spec.anchor {
        Anchor::Loop(_) => loop_room + 14,
        Anchor::Edge(_) => 36,
        Anchor::FanOut(_) | Anchor::FanIn(_) => 44,
    }
}

/// True for a label beside a straight arrow between two boxes of one column.
pub(super) fn is_vertical(spec: &Spec, inside: &[Option<Inside>]) -> bool {
    matches!(spec.anchor, Anchor::Loop(e) if matches!(inside[e], Some(Inside::Down { .. } | Inside::Up { .. })))
}

pub(super) fn label_width(lines: &[String]) -> i32 {
    lines.iter().map(|l| text_width(l, LABEL)).max().unwrap_or(0) + 8
}

impl Geometry {
    pub(super) fn new(g: &Graph, layout: &Layout, specs: &[Spec], inside: &[Option<Inside>]) -> Geometry {
        let width = layout.columns.len().max(1);
        let avail = RIGHT - LEFT;
        let max_box = (avail / width as i32 - 90).clamp(60, 240);
        // The largest text whose tallest column fits.
        let fits = |font: f64, line_h: i32, gap: i32| {
            let lines: Vec<Vec<String>> = g.names.iter().map(|n| wrap(n, font, max_box - 16, 2)).collect();
            let height = |item: &Item| match item {
                Item::Node(v) => lines[*v].len() as i32 * line_h + 10,
                Item::Bend(..) => 10,
            };
            let tallest = layout
                .columns
                .iter()
                .map(|c| c.iter().map(height).sum::<i32>() + gap * (c.len() as i32 - 1).max(0))
                .max()
                .unwrap_or(0);
            (tallest <= BOTTOM - TOP, lines)
        };
        let mut chosen = None;
        for (font, line_h, gap) in
            [(17.0, 18, 24), (17.0, 18, 14), (17.0, 18, 8), (15.0, 16, 6), (13.0, 14, 3)]
        {
            let (ok, lines) = fits(font, line_h, gap);
            if ok || font == 13.0 {
                chosen = Some((font, line_h, gap, lines));
                break;
            }
        }
        let (font, line_h, gap, lines) = chosen.expect("the last choice is always taken");
        let box_w: Vec<i32> = layout
            .columns
            .iter()
            .map(|column| {
                column
                    .iter()
                    .filter_map(|item| match item {
                        Item::Node(v) => lines[*v].iter().map(|l| text_width(l, font)).max(),
                        Item::Bend(..) => None,
                    })
                    .max()
                    .map_or(40, |w| (w + 20).clamp(60, max_box))
            })
            .collect();
        // Gaps sized to their labels; spare room spread evenly, missing room taken evenly.
        let mut loop_room = vec![0; width];
        let mut vertical = vec![false; width];
        for (e, kind) in inside.iter().enumerate() {
            let c = layout.column_of[g.edges[e].from];
            match kind {
                Some(Inside::Loop(k)) => loop_room[c] = loop_room[c].max(12 + LOOP_STEP * k),
                Some(_) => vertical[c] = true,
                None => {}
            }
        }
        let mut need: Vec<i32> =
            (0..width).map(|c| if c + 1 < width { 60 } else { 0 }.max(loop_room[c] + 8)).collect();
        for s in specs {
            let c = s.gap;
            need[c] = need[c].max(if is_vertical(s, inside) {
                label_width(&wrap(&s.text, LABEL, LABEL_MAX, 1)) + 40 - box_w[c] / 2
            } else {
                label_width(&wrap(&s.text, LABEL, LABEL_MAX, 2)) + label_pad(s, loop_room[c])
            });
        }
        let boxes_total: i32 = box_w.iter().sum();
        let need_total: i32 = need.iter().sum();
        let (margin, gaps): (i32, Vec<i32>) = if boxes_total + need_total <= avail {
            let share = (avail - boxes_total - need_total) / (width as i32 + 1);
            (
                share,
                need.iter().enumerate().map(|(c, n)| if c + 1 < width { n + share } else { *n }).collect(),
            )
        } else {
            let room = (avail - boxes_total).max(0);
            (0, need.iter().map(|n| n * room / need_total.max(1)).collect())
        };
        let mut column_x = Vec::new();
        let mut x = LEFT + margin;
        for c in 0..width.min(layout.columns.len()) {
            column_x.push((x, x + box_w[c]));
            x += box_w[c] + gaps[c];
        }
        let label_lines = specs
            .iter()
            .map(|s| {
                if is_vertical(s, inside) {
                    wrap(&s.text, LABEL, (gaps[s.gap] + box_w[s.gap] / 2 - 30).clamp(60, LABEL_MAX), 1)
                } else {
                    wrap(
                        &s.text,
                        LABEL,
                        (gaps[s.gap] - label_pad(s, loop_room[s.gap])).clamp(60, LABEL_MAX),
                        2,
                    )
                }
            })
            .collect();
        let mut boxes = vec![Rect { x0: 0, y0: 0, x1: 0, y1: 0 }; g.names.len()];
        let mut bends = BTreeMap::new();
        for (c, column) in layout.columns.iter().enumerate() {
            let (x0, x1) = column_x[c];
            let height = |item: &Item| match item {
                Item::Node(v) => lines[*v].len() as i32 * line_h + 10,
                Item::Bend(..) => 10,
            };
            let gap = if vertical[c] { gap.max(34) } else { gap };
            let total = column.iter().map(height).sum::<i32>() + gap * (column.len() as i32 - 1).max(0);
            let mut y = TOP + ((BOTTOM - TOP) - total).max(0) / 2;
            for item in column {
                let h = height(item);
                match item {
                    Item::Node(v) => boxes[*v] = Rect { x0, y0: y, x1, y1: y + h },
                    Item::Bend(..) => {
                        bends.insert(*item, y + h / 2);
                    }
                }
                y += h + gap;
            }
        }
        Geometry { boxes, lines, bends, column_x, font, label_lines, loop_room }
    }
}

/// Draws an arrowhead at `to`, pointing away from `from`.
pub(super) fn arrowhead<DB: DrawingBackend>(
    root: &Area<DB>,
    from: (i32, i32),
    to: (i32, i32),
    colour: RGBColor,
) -> Drawn {
    let (dx, dy) = (f64::from(to.0 - from.0), f64::from(to.1 - from.1));
    let len = (dx * dx + dy * dy).sqrt();
    if len < 1.0 {
        return Ok(());
    }
    let (ux, uy) = (dx / len, dy / len);
    let back = |along: f64, side: f64| {
        let x = f64::from(to.0) - ux * along - uy * side;
        let y = f64::from(to.1) - uy * along + ux * side;
        (x.round() as i32, y.round() as i32)
    };
    root.draw(&Polygon::new(vec![to, back(11.0, 5.0), back(11.0, -5.0)], colour.filled())).msg()
}

impl Picture for WaitFor<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &Area<DB>) -> Drawn {
        root.fill(&WHITE).msg()?;
        let hang = self.hang;
        let g = Graph::new(&hang.wait_for);
        let layout = Layout::new(&g);
        let n = g.names.len();
        let reported: Vec<bool> =
            g.nodes.iter().map(|node| hang.cycle.as_ref().is_some_and(|c| c.contains(node))).collect();
        let red: Vec<bool> = (0..n).map(|v| layout.cyclic[v] || reported[v]).collect();
        let waits_for_nothing: Vec<bool> = (0..n).map(|v| g.edges.iter().all(|e| e.from != v)).collect();
        let ends: Vec<&str> = (0..n).filter(|&v| waits_for_nothing[v]).map(|v| g.names[v].as_str()).collect();
        let summary = match &hang.cycle {
            Some(members) => {
                let names: Vec<String> = members.iter().map(ToString::to_string).collect();
                format!("cycle (deadlock) among: {}", names.join(", "))
            }
            None if !ends.is_empty() => format!("no cycle; the waits end at: {}", ends.join(", ")),
            None => "no cycle".to_string(),
        };
        // The title names the run; what hung and the graph's summary take a line each, since
        // together they are often too long for one.
        title(
            root,
            &format!("Hang: {}", self.run),
            &format!("{}, detected at t = {:.1} s", hang.what, hang.t_ms / 1000.0),
        )?;
        let (w, _) = root.dim_in_pixel();
        let w = w as i32;
        text(
            root,
            &fit(&format!("{n} waiters, {} waits · {summary}", g.edges.len()), SUBTITLE, w - 40),
            (w / 2, 70),
            &style(SUBTITLE, MUTED, HPos::Center, VPos::Top),
        )?;
        if n == 0 {
            return note(root, "no wait-for edges recorded", (640, 380));
        }
        let inside = inside_edges(&g, &layout);
        let specs = label_specs(&g, &layout, &red);
        let geo = Geometry::new(&g, &layout, &specs, &inside);
        let edge_colour = |e: &Edge| if red[e.from] && red[e.to] { ALERT } else { EDGE };
        let edge_width = |e: &Edge| if red[e.from] && red[e.to] { 2 } else { 1 };

        // Ports: where each edge going right leaves its source and enters its target, spread
        // along the box side in the order of the other end's height.
        let y_of = |item: &Item| match item {
            Item::Node(v) => geo.boxes[*v].cy(),
            Item::Bend(..) => geo.bends[item],
        };
        let mut out_port: BTreeMap<usize, i32> = BTreeMap::new();
        let mut in_port: BTreeMap<usize, i32> = BTreeMap::new();
        for v in 0..n {
            let b = geo.boxes[v];
            let spread = |mut list: Vec<(i32, usize)>, ports: &mut BTreeMap<usize, i32>| {
                list.sort();
                let m = list.len() as i32;
                let step = if m > 1 { ((b.y1 - b.y0 - 10) / (m - 1)).min(7) } else { 0 };
                for (k, (_, e)) in list.into_iter().enumerate() {
                    ports.insert(e, b.cy() + step * k as i32 - step * (m - 1) / 2);
                }
            };
            let outgoing: Vec<(i32, usize)> = (0..g.edges.len())
                .filter(|&e| g.edges[e].from == v && !layout.paths[e].is_empty())
                .map(|e| (y_of(&layout.paths[e][1]), e))
                .collect();
            spread(outgoing, &mut out_port);
            let incoming: Vec<(i32, usize)> = (0..g.edges.len())
                .filter(|&e| g.edges[e].to == v && !layout.paths[e].is_empty())
                .map(|e| {
                    let p = &layout.paths[e];
                    (y_of(&p[p.len() - 2]), e)
                })
                .collect();
            spread(incoming, &mut in_port);
        }
        // The first segment of each edge going right (where a single label goes).
        let first_segment = |e: usize| {
            let (x0, y0) = (geo.boxes[g.edges[e].from].x1, out_port[&e]);
            let (x1, y1) = match layout.paths[e][1] {
                Item::Node(v) => (geo.boxes[v].x0, in_port[&e]),
                bend @ Item::Bend(_, c) => (geo.column_x[c].0, geo.bends[&bend]),
            };
            ((x0, y0), (x1, y1))
        };

        // Edges going right, through the bends of the columns they cross.
        for (e, edge) in g.edges.iter().enumerate() {
            let path = &layout.paths[e];
            if path.is_empty() {
                continue;
            }
            let mut points = vec![(geo.boxes[edge.from].x1, out_port[&e])];
            for item in &path[1..path.len() - 1] {
                if let Item::Bend(_, c) = item {
                    let (x0, x1) = geo.column_x[*c];
                    points.push((x0, geo.bends[item]));
                    points.push((x1, geo.bends[item]));
                }
            }
            points.push((geo.boxes[edge.to].x0 - 1, in_port[&e]));
            let (last, end) = (points[points.len() - 2], points[points.len() - 1]);
            root.draw(&PathElement::new(points, edge_colour(edge).stroke_width(edge_width(edge)))).msg()?;
            arrowhead(root, last, end, edge_colour(edge))?;
        }

        // Edges inside a column (cycles): straight arrows between neighbours, loops out to the
        // right of the column otherwise.
        let loop_x = |e: usize, k: i32| geo.column_x[layout.column_of[g.edges[e].from]].1 + 6 + LOOP_STEP * k;
        let loop_ys = |edge: &Edge| {
            let (a, b) = (geo.boxes[edge.from], geo.boxes[edge.to]);
            if edge.from == edge.to {
                (a.cy() - 6, a.cy() + 6)
            } else {
                (a.cy() - 5, b.cy() + 5)
            }
        };
        let vertical_x =
            |edge: &Edge, shift: i32| (geo.boxes[edge.from].x0 + geo.boxes[edge.from].x1) / 2 + shift;
        for (e, edge) in g.edges.iter().enumerate() {
            let (a, b) = (geo.boxes[edge.from], geo.boxes[edge.to]);
            let (points, last, end) = match inside[e] {
                None => continue,
                Some(Inside::Down { shift }) => {
                    let x = vertical_x(edge, shift);
                    (vec![(x, a.y1), (x, b.y0 - 1)], (x, a.y1), (x, b.y0 - 1))
                }
                Some(Inside::Up { shift }) => {
                    let x = vertical_x(edge, shift);
                    (vec![(x, a.y0), (x, b.y1 + 1)], (x, a.y0), (x, b.y1 + 1))
                }
                Some(Inside::Loop(k)) => {
                    let x = loop_x(e, k);
                    let (ya, yb) = loop_ys(edge);
                    (vec![(a.x1, ya), (x, ya), (x, yb), (b.x1 + 1, yb)], (x, yb), (b.x1 + 1, yb))
                }
            };
            root.draw(&PathElement::new(points, edge_colour(edge).stroke_width(edge_width(edge)))).msg()?;
            arrowhead(root, last, end, edge_colour(edge))?;
        }

        // Boxes.
        for v in 0..n {
            let b = geo.boxes[v];
            let (fill, line, width) = if red[v] {
                (CYCLE_FILL, ALERT, 2)
            } else if waits_for_nothing[v] {
                (END_FILL, END_LINE, 2)
            } else {
                (NODE_FILL, NODE_LINE, 1)
            };
            root.draw(&Rectangle::new([(b.x0, b.y0), (b.x1, b.y1)], fill.filled())).msg()?;
            root.draw(&Rectangle::new([(b.x0, b.y0), (b.x1, b.y1)], line.stroke_width(width))).msg()?;
            let lines = &geo.lines[v];
            let line_h = (b.y1 - b.y0 - 10) / lines.len().max(1) as i32;
            let s = style(geo.font, INK, HPos::Center, VPos::Center);
            for (i, l) in lines.iter().enumerate() {
                text(root, l, ((b.x0 + b.x1) / 2, b.y0 + 5 + line_h * i as i32 + line_h / 2), &s)?;
            }
        }
        let mut taken: Vec<Rect> = geo.boxes.clone();

        // The cycle: a dashed red frame around its members and their loops, labelled.
        let members: Vec<usize> = (0..n).filter(|&v| red[v]).collect();
        if let Some(&first) = members.first() {
            let c = layout.column_of[first];
            let same_column: Vec<usize> =
                members.iter().copied().filter(|&v| layout.column_of[v] == c).collect();
            let widest_loop = geo.column_x[c].1 + geo.loop_room[c];
            let frame = Rect {
                x0: geo.column_x[c].0 - 8,
                y0: same_column.iter().map(|&v| geo.boxes[v].y0).min().unwrap_or(TOP) - 8,
                x1: widest_loop + 8,
                y1: same_column.iter().map(|&v| geo.boxes[v].y1).max().unwrap_or(TOP) + 8,
            };
            let s = ALERT.stroke_width(1);
            dashed_h(root, frame.x0, frame.x1, frame.y0, s)?;
            dashed_h(root, frame.x0, frame.x1, frame.y1, s)?;
            dashed_v(root, frame.x0, frame.y0, frame.y1, s)?;
            dashed_v(root, frame.x1, frame.y0, frame.y1, s)?;
            let tag = (frame.x0, frame.y0 - 4);
            text(root, "cycle", tag, &style(18.0, ALERT, HPos::Left, VPos::Bottom))?;
            taken.push(Rect { x0: tag.0, y0: tag.1 - 20, x1: tag.0 + text_width("cycle", 18.0), y1: tag.1 });
        }

        // Labels last, each moved up or down until it covers no box and no other label.
        for (spec, lines) in specs.iter().zip(&geo.label_lines) {
            let (at, h) = match spec.anchor {
                Anchor::FanOut(v) => ((geo.boxes[v].x1 + 10, geo.boxes[v].cy()), HPos::Left),
                Anchor::FanIn(v) => ((geo.boxes[v].x0 - 26, geo.boxes[v].cy()), HPos::Right),
                Anchor::Edge(e) => {
                    let ((x0, y0), (x1, y1)) = first_segment(e);
                    (((x0 + x1) / 2, (y0 + y1) / 2), HPos::Center)
                }
                Anchor::Loop(e) => {
                    let edge = &g.edges[e];
                    let (a, b) = (geo.boxes[edge.from], geo.boxes[edge.to]);
                    match inside[e] {
                        Some(Inside::Down { shift } | Inside::Up { shift }) => {
                            let mid = (a.y1.min(b.y1) + a.y0.max(b.y0)) / 2;
                            ((vertical_x(edge, shift) + 8, mid), HPos::Left)
                        }
                        _ => {
                            let (ya, yb) = loop_ys(edge);
                            let c = layout.column_of[edge.from];
                            ((geo.column_x[c].1 + geo.loop_room[c] + 10, (ya + yb) / 2), HPos::Left)
                        }
                    }
                }
            };
            place_label(root, lines, at, h, if spec.red { ALERT } else { INK }, &mut taken)?;
        }

        let mut legend = vec![
            (Swatch::Box(NODE_FILL), "waiter".to_string()),
            (
                Swatch::Line { colour: EDGE, dashed: false, marker: None },
                "a → b: a waits for b (label: why)".to_string(),
            ),
        ];
        if waits_for_nothing.iter().any(|&w| w) {
            legend.push((Swatch::Box(END_LINE), "waits for nothing: where the waits end".to_string()));
        }
        if !members.is_empty() {
            legend.push((Swatch::Box(ALERT), "in a cycle".to_string()));
        }
        legend_row(root, &legend, 640, 700, 1200)
    }
}

/// Draws a label's `lines` on a white tag anchored at `at` (horizontally as `h` says,
/// vertically centred), moved up or down to the nearest place where it overlaps nothing in
/// `taken` (or left at the anchor when there is none), and records where it went.
pub(super) fn place_label<DB: DrawingBackend>(
    root: &Area<DB>,
    lines: &[String],
    at: (i32, i32),
    h: HPos,
    colour: RGBColor,
    taken: &mut Vec<Rect>,
) -> Drawn {
    let w = label_width(lines);
    let ht = lines.len() as i32 * LABEL_LINE + 4;
    let rect_at = |dy: i32| {
        let x0 = match h {
            HPos::Left => at.0,
            HPos::Right => at.0 - w,
            HPos::Center => at.0 - w / 2,
        };
        let y0 = at.1 - ht / 2 + dy;
        Rect { x0, y0, x1: x0 + w, y1: y0 + ht }
    };
    let free = |r: &Rect| !taken.iter().any(|t| t.overlaps(r));
    let rect = (0..13)
        .map(|k| if k == 0 { 0 } else { (ht + 3) * ((k + 1) / 2) * if k % 2 == 1 { -1 } else { 1 } })
        .map(rect_at)
        .find(free)
        .unwrap_or_else(|| rect_at(0));
    taken.push(rect);
    root.draw(&Rectangle::new([(rect.x0, rect.y0), (rect.x1, rect.y1)], WHITE.filled())).msg()?;
    root.draw(&Rectangle::new([(rect.x0, rect.y0), (rect.x1, rect.y1)], GRID.stroke_width(1))).msg()?;
    let s = style(LABEL, colour, HPos::Left, VPos::Center);
    for (i, l) in lines.iter().enumerate() {
        text(root, l, (rect.x0 + 4, rect.y0 + 2 + LABEL_LINE * i as i32 + LABEL_LINE / 2), &s)?;
    }
    Ok(())
}
