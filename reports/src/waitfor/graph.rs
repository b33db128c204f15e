//! The wait-for graph of a hang as the reports read it: nodes, edges with their reasons, and
//! its strongly connected components. It is built from the hang's typed edges; nodes are the
//! same node when they are equal, and are drawn with their `Display` labels.

use pdkv_sim::waitfor::{WaitEdge, WaitNode};
use petgraph::algo::tarjan_scc;
use petgraph::graph::{DiGraph, NodeIndex};

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

/// Strongly connected components of the graph whose successors are `adj`, each sorted, sinks
/// first (petgraph's Tarjan lists them in reverse topological order, which the layout's longest
/// path relies on).
pub(super) fn components(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut graph: DiGraph<(), ()> = DiGraph::with_capacity(adj.len(), adj.iter().map(Vec::len).sum());
    for _ in adj {
        graph.add_node(());
    }
    for (from, successors) in adj.iter().enumerate() {
        for &to in successors {
            graph.add_edge(NodeIndex::new(from), NodeIndex::new(to), ());
        }
    }
    tarjan_scc(&graph)
        .into_iter()
        .map(|component| {
            let mut members: Vec<usize> = component.into_iter().map(NodeIndex::index).collect();
            members.sort_unstable();
            members
        })
        .collect()
}
