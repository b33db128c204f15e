//! The wait-for graph of a hang as the reports read it: nodes, edges with their reasons, and
//! its strongly connected components.

/// One wait: `from` waits for `to` because of `reason`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Edge {
    pub(super) from: usize,
    pub(super) to: usize,
    pub(super) reason: String,
}

/// Named nodes (in order of first mention) and edges (in line order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Graph {
    pub(super) names: Vec<String>,
    pub(super) edges: Vec<Edge>,
    /// Lines that are not `a -> b (reason)`.
    pub(super) skipped: usize,
}

/// Splits `a -> b (reason)` into its three parts; the reason is the last balanced parenthesised
/// group and may be missing.
pub(super) fn parse_line(line: &str) -> Option<(String, String, String)> {
    let (a, rest) = line.split_once(" -> ")?;
    let rest = rest.trim();
    let (b, reason) = match rest.strip_suffix(')') {
        Some(inner) => {
            let mut depth = 0usize;
            let mut open = None;
            for (i, c) in inner.char_indices().rev() {
                match c {
                    ')' => depth += 1,
                    '(' if depth == 0 => {
                        open = Some(i);
                        break;
                    }
                    '(' => depth -= 1,
                    _ => {}
                }
            }
            match open {
                Some(i) if !inner[..i].trim().is_empty() => (inner[..i].trim(), inner[i + 1..].trim()),
                _ => (rest, ""),
            }
        }
        None => (rest, ""),
    };
    let a = a.trim();
    if a.is_empty() || b.is_empty() {
        return None;
    }
    Some((a.to_string(), b.to_string(), reason.to_string()))
}

impl Graph {
    pub(super) fn parse(lines: &[String]) -> Graph {
        let mut g = Graph::default();
        for line in lines {
            let Some((a, b, reason)) = parse_line(line) else {
                g.skipped += 1;
                continue;
            };
            let from = g.node(&a);
            let to = g.node(&b);
            g.edges.push(Edge { from, to, reason });
        }
        g
    }

    pub(super) fn node(&mut self, name: &str) -> usize {
        match self.names.iter().position(|n| n == name) {
            Some(i) => i,
            None => {
                self.names.push(name.to_string());
                self.names.len() - 1
            }
        }
    }

    pub(super) fn successors(&self) -> Vec<Vec<usize>> {
        let mut adj = vec![Vec::new(); self.names.len()];
        for e in &self.edges {
            adj[e.from].push(e.to);
        }
        adj
    }
}

/// Strongly connected components (Tarjan), sinks first.
pub(super) fn components(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct Tarjan<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            let adj = self.adj;
            for &w in &adj[v] {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                component.sort_unstable();
                self.out.push(component);
            }
        }
    }
    let n = adj.len();
    let mut t = Tarjan {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    t.out
}
