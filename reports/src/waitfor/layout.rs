//! Where each node and bend of a wait-for graph goes: columns by longest path, cycles in one
//! column, and the edge labels to place before any pixel is chosen.

use std::collections::BTreeMap;

use super::graph::{components, Graph};

/// A slot in a column: a node, or the `k`th bend of a long edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Item {
    Node(usize),
    Bend(usize, usize),
}

/// Columns of items, top to bottom, and each edge's path through them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    /// Column of each node.
    pub(super) column_of: Vec<usize>,
    /// Component of each node; nodes sharing a component of more than one node (or with a
    /// self-loop) are in a cycle.
    pub(super) component_of: Vec<usize>,
    /// True for each node in a cycle.
    pub(super) cyclic: Vec<bool>,
    /// The items of each column, top to bottom.
    pub(super) columns: Vec<Vec<Item>>,
    /// For each edge going right: the items from its source to its target. Empty for edges
    /// inside a column (within a cycle).
    pub(super) paths: Vec<Vec<Item>>,
}

impl Layout {
    pub(super) fn new(g: &Graph) -> Layout {
        let n = g.names.len();
        let adj = g.successors();
        let comps = components(&adj);
        let mut component_of = vec![0; n];
        for (c, members) in comps.iter().enumerate() {
            for &v in members {
                component_of[v] = c;
            }
        }
        let mut cyclic: Vec<bool> = (0..n).map(|v| comps[component_of[v]].len() > 1).collect();
        for e in &g.edges {
            if e.from == e.to {
                cyclic[e.from] = true;
            }
        }
        // Longest path over components, sources first (Tarjan lists sinks first).
        let mut layer = vec![0usize; comps.len()];
        for c in (0..comps.len()).rev() {
            for e in &g.edges {
                let (cf, ct) = (component_of[e.from], component_of[e.to]);
                if ct == c && cf != c {
                    layer[c] = layer[c].max(layer[cf] + 1);
                }
            }
        }
        let column_of: Vec<usize> = (0..n).map(|v| layer[component_of[v]]).collect();
        let width = column_of.iter().max().map_or(0, |m| m + 1);
        let mut columns: Vec<Vec<Item>> = vec![Vec::new(); width];
        for v in 0..n {
            columns[column_of[v]].push(Item::Node(v));
        }
        let mut paths = Vec::new();
        for (i, e) in g.edges.iter().enumerate() {
            let (a, b) = (column_of[e.from], column_of[e.to]);
            if b <= a {
                paths.push(Vec::new());
                continue;
            }
            let mut path = vec![Item::Node(e.from)];
            for (k, column) in columns.iter_mut().enumerate().take(b).skip(a + 1) {
                let bend = Item::Bend(i, k);
                column.push(bend);
                path.push(bend);
            }
            path.push(Item::Node(e.to));
            paths.push(path);
        }
        let mut layout = Layout { column_of, component_of, cyclic, columns, paths };
        layout.order(g);
        layout
    }

    /// Orders each column by the mean position of its neighbours (a few sweeps each way), then
    /// keeps the members of one cycle together, in the order of a walk along its edges (so that
    /// most of its edges join neighbours).
    pub(super) fn order(&mut self, g: &Graph) {
        let mut before: BTreeMap<Item, Vec<Item>> = BTreeMap::new();
        let mut after: BTreeMap<Item, Vec<Item>> = BTreeMap::new();
        for path in &self.paths {
            for w in path.windows(2) {
                after.entry(w[0]).or_default().push(w[1]);
                before.entry(w[1]).or_default().push(w[0]);
            }
        }
        let width = self.columns.len();
        for _ in 0..4 {
            for c in 1..width {
                self.reorder(c, &before);
            }
            for c in (0..width.saturating_sub(1)).rev() {
                self.reorder(c, &after);
            }
        }
        for c in 0..width {
            let column = std::mem::take(&mut self.columns[c]);
            let mut grouped: Vec<Item> = Vec::new();
            for item in &column {
                let Item::Node(v) = *item else {
                    grouped.push(*item);
                    continue;
                };
                if grouped.contains(item) {
                    continue;
                }
                if self.cyclic[v] {
                    let members: Vec<usize> = column
                        .iter()
                        .filter_map(|item| match *item {
                            Item::Node(w)
                                if self.cyclic[w] && self.component_of[w] == self.component_of[v] =>
                            {
                                Some(w)
                            }
                            _ => None,
                        })
                        .collect();
                    let mut walk = vec![v];
                    while walk.len() < members.len() {
                        let here = walk[walk.len() - 1];
                        let next = g
                            .edges
                            .iter()
                            .find(|e| e.from == here && members.contains(&e.to) && !walk.contains(&e.to))
                            .map(|e| e.to)
                            .or_else(|| members.iter().copied().find(|w| !walk.contains(w)))
                            .expect("an unvisited member is left");
                        walk.push(next);
                    }
                    grouped.extend(walk.into_iter().map(Item::Node));
                } else {
                    grouped.push(*item);
                }
            }
            self.columns[c] = grouped;
        }
    }

    /// Centred position of every item in its column.
    pub(super) fn positions(&self) -> BTreeMap<Item, f64> {
        let mut at = BTreeMap::new();
        for column in &self.columns {
            let mid = (column.len() as f64 - 1.0) / 2.0;
            for (i, item) in column.iter().enumerate() {
                at.insert(*item, i as f64 - mid);
            }
        }
        at
    }

    pub(super) fn reorder(&mut self, c: usize, neighbours: &BTreeMap<Item, Vec<Item>>) {
        let at = self.positions();
        let mut keyed: Vec<(f64, Item)> = self.columns[c]
            .iter()
            .map(|item| {
                let own = at[item];
                let key = match neighbours.get(item) {
                    Some(list) if !list.is_empty() => {
                        list.iter().map(|n| at[n]).sum::<f64>() / list.len() as f64
                    }
                    _ => own,
                };
                (key, *item)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.columns[c] = keyed.into_iter().map(|(_, item)| item).collect();
    }
}

/// Where an edge label goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Anchor {
    /// Right of a node's box: one label for several edges leaving it for the same reason.
    FanOut(usize),
    /// Left of a node's box: one label for several edges entering it for the same reason.
    FanIn(usize),
    /// On the first segment of one edge.
    Edge(usize),
    /// Beside an edge inside its column (a cycle): a straight arrow to a neighbour, or a loop.
    Loop(usize),
}

/// An edge label: its text, where it goes, and the column whose right-hand gap holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Spec {
    pub(super) text: String,
    pub(super) anchor: Anchor,
    pub(super) gap: usize,
    pub(super) red: bool,
}

/// How an edge inside one column (between members of a cycle) is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Inside {
    /// Straight down to the next box, moved sideways by `shift` when the two wait for each other.
    Down { shift: i32 },
    /// Straight up to the box above.
    Up { shift: i32 },
    /// Out to the right of the column and back, the `k`th such loop of its column (1, 2, ...).
    Loop(i32),
}

/// Spacing of the loops right of a column.
pub(super) const LOOP_STEP: i32 = 14;

/// How each edge inside a column is drawn (`None` for edges going right).
pub(super) fn inside_edges(g: &Graph, layout: &Layout) -> Vec<Option<Inside>> {
    let mut index: BTreeMap<usize, usize> = BTreeMap::new();
    for column in &layout.columns {
        for (i, item) in column.iter().enumerate() {
            if let Item::Node(v) = item {
                index.insert(*v, i);
            }
        }
    }
    let mut count: BTreeMap<usize, i32> = BTreeMap::new();
    (0..g.edges.len())
        .map(|e| {
            if !layout.paths[e].is_empty() {
                return None;
            }
            let edge = &g.edges[e];
            let (a, b) = (index[&edge.from], index[&edge.to]);
            let mutual =
                edge.from != edge.to && g.edges.iter().any(|o| o.from == edge.to && o.to == edge.from);
            let shift = if mutual { 14 } else { 0 };
            Some(if b == a + 1 {
                Inside::Down { shift: -shift }
            } else if a == b + 1 {
                Inside::Up { shift }
            } else {
                let k = count.entry(layout.column_of[edge.from]).or_insert(0);
                *k += 1;
                Inside::Loop(*k)
            })
        })
        .collect()
}

/// The edge labels: one per (source, reason) fan-out of several edges, else one per (target,
/// reason) fan-in of several edges, else one per edge; edges without a reason get none.
pub(super) fn label_specs(g: &Graph, layout: &Layout, red: &[bool]) -> Vec<Spec> {
    let mut labelled = vec![false; g.edges.len()];
    let mut out = Vec::new();
    for (e, edge) in g.edges.iter().enumerate() {
        if edge.reason.is_empty() || labelled[e] {
            continue;
        }
        let is_red = red[edge.from] && red[edge.to];
        let from_column = layout.column_of[edge.from];
        if layout.paths[e].is_empty() {
            out.push(Spec {
                text: reason_text(&edge.reason, 1),
                anchor: Anchor::Loop(e),
                gap: from_column,
                red: is_red,
            });
            labelled[e] = true;
            continue;
        }
        let open = |o: usize| !labelled[o] && !layout.paths[o].is_empty() && g.edges[o].reason == edge.reason;
        let same_source: Vec<usize> =
            (0..g.edges.len()).filter(|&o| open(o) && g.edges[o].from == edge.from).collect();
        let same_target: Vec<usize> =
            (0..g.edges.len()).filter(|&o| open(o) && g.edges[o].to == edge.to).collect();
        let (anchor, gap, group) = if same_source.len() > 1 {
            (Anchor::FanOut(edge.from), from_column, same_source)
        } else if same_target.len() > 1 {
            (Anchor::FanIn(edge.to), layout.column_of[edge.to] - 1, same_target)
        } else {
            (Anchor::Edge(e), from_column, vec![e])
        };
        out.push(Spec { text: reason_text(&edge.reason, group.len()), anchor, gap, red: is_red });
        group.iter().for_each(|&o| labelled[o] = true);
    }
    out
}

/// The reason as shown: cut to 60 characters, with `×n` when it stands for `n` edges.
pub(super) fn reason_text(reason: &str, count: usize) -> String {
    let mut shown: String = reason.chars().take(60).collect();
    if reason.chars().count() > 60 {
        shown.push('…');
    }
    if count > 1 {
        shown.push_str(&format!(" ×{count}"));
    }
    shown
}
