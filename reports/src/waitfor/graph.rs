//! The wait-for graph of a hang as the reports read it: nodes, edges with their reasons, and
//! its strongly connected components. It is built from the hang's typed edges; nodes are the
//! same node when they are equal, and are drawn with their `Display` labels.

use pdkv_sim::waitfor::{WaitEdge, WaitNode};

/// One wait: `from` waits for `to` because of `reason` (its label, as drawn).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Edge {
    pub(super) from: usize,
    pub(super) to: usize,
    pub(super) reason: String,
}

/// The nodes (in order of first mention) with their labels, and the edges (in the hang's order)
/// between their positions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Graph {
    pub(super) nodes: Vec<WaitNode>,
    pub(super) names: Vec<String>,
    pub(super) edges: Vec<Edge>,
}

impl Graph {
    pub(super) fn new(wait_for: &[WaitEdge]) -> Graph {
        let mut g = Graph::default();
        for edge in wait_for {
            let from = g.node(&edge.from);
            let to = g.node(&edge.to);
            g.edges.push(Edge { from, to, reason: edge.reason.to_string() });
        }
        g
    }

    fn node(&mut self, node: &WaitNode) -> usize {
        match self.nodes.iter().position(|n| n == node) {
            Some(i) => i,
            None => {
                self.nodes.push(node.clone());
                self.names.push(node.to_string());
                self.nodes.len() - 1
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
