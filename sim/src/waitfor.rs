//! The wait-for graph of a hang: who waits for whom, and the cycle if there is one.

use petgraph::algo::tarjan_scc;
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::BTreeMap;

/// A directed graph of named waiters with a reason on each edge.
#[derive(Clone, Debug, Default)]
pub struct WaitFor {
    graph: DiGraph<String, String>,
    nodes: BTreeMap<String, NodeIndex>,
}

impl WaitFor {
    fn node(&mut self, name: &str) -> NodeIndex {
        if let Some(&i) = self.nodes.get(name) {
            return i;
        }
        let i = self.graph.add_node(name.to_string());
        self.nodes.insert(name.to_string(), i);
        i
    }

    /// Records that `waiter` waits for `waited` because of `reason`.
    pub fn edge(&mut self, waiter: &str, waited: &str, reason: &str) {
        let (a, b) = (self.node(waiter), self.node(waited));
        self.graph.add_edge(a, b, reason.to_string());
    }

    /// One line per edge, `a -> b (reason)`, in insertion order.
    pub fn lines(&self) -> Vec<String> {
        self.graph
            .edge_indices()
            .filter_map(|e| {
                let (a, b) = self.graph.edge_endpoints(e)?;
                Some(format!("{} -> {} ({})", self.graph[a], self.graph[b], self.graph[e]))
            })
            .collect()
    }

    /// The members of a cycle (a strongly connected component of more than one node, or a
    /// node waiting for itself), sorted, if there is one: a deadlock.
    pub fn cycle(&self) -> Option<Vec<String>> {
        for component in tarjan_scc(&self.graph) {
            let looped = component.len() == 1 && self.graph.contains_edge(component[0], component[0]);
            if component.len() > 1 || looped {
                let mut names: Vec<String> = component.iter().map(|&i| self.graph[i].clone()).collect();
                names.sort();
                return Some(names);
            }
        }
        None
    }

    /// The graph in Graphviz form.
    pub fn dot(&self) -> String {
        let mut out = String::from("digraph waitfor {\n  rankdir=LR;\n  node [shape=box];\n");
        for i in self.graph.node_indices() {
            out.push_str(&format!("  n{} [label=\"{}\"];\n", i.index(), self.graph[i].replace('"', "'")));
        }
        for e in self.graph.edge_indices() {
            if let Some((a, b)) = self.graph.edge_endpoints(e) {
                let label = self.graph[e].replace('"', "'");
                out.push_str(&format!("  n{} -> n{} [label=\"{label}\"];\n", a.index(), b.index()));
            }
        }
        out.push_str("}\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_have_no_cycle_and_loops_do() {
        let mut g = WaitFor::default();
        g.edge("collective", "D0.dp0.tp3", "not arrived");
        g.edge("D0.dp0.tp3", "P0.dp0.tp3 handshake listener", "blocked");
        assert_eq!(g.cycle(), None);
        assert_eq!(g.lines()[0], "collective -> D0.dp0.tp3 (not arrived)");
        g.edge("P0.dp0.tp3 handshake listener", "collective", "made up");
        assert_eq!(g.cycle().unwrap().len(), 3);
        assert!(g.dot().contains("n0 -> n1"));
    }
}
