//! Wait-for graphs of hangs drawn as boxes and arrows (`wait_for_graph`): a layered layout by
//! longest path from the nodes nobody waits for, with the members of a cycle in one column.

use std::path::{Path, PathBuf};

use pdkv_sim::result::Hang;

use crate::error::ReportError;
use crate::render::render;

/// For a hang of the run titled `run` ([`pdkv_sim::RunResult::title`]): writes
/// `wait_for_<i>.png`/`.svg` (the graph drawn as boxes and arrows) and `wait_for_<i>.dot` (hang.dot
/// as is). An arrow `a → b` means a waits for b, labelled with the reason; members of
/// `hang.cycle` are red and boxed as "cycle"; nodes that wait for nothing (where the waits end)
/// are orange. Returns the paths written: PNG, SVG, then DOT.
pub fn wait_for_graph(hang: &Hang, index: usize, run: &str, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let stem = format!("wait_for_{index}");
    let mut paths = render(dir, &stem, &WaitFor { hang, run })?;
    let dot = dir.join(format!("{stem}.dot"));
    pdkv_sim::files::write_atomic(&dot, hang.dot.as_bytes()).map_err(|e| ReportError::io(&dot, e))?;
    paths.push(dot);
    Ok(paths)
}

mod draw;
mod graph;
mod layout;

use draw::WaitFor;

/// Nodes and edges as the simulator builds them (decode engine D0 at step 1), for the tests.
#[cfg(test)]
pub(crate) mod nodes {
    use pdkv_core::ids::{EngineId, RankId};
    use pdkv_core::ports::SessionKey;
    use pdkv_sim::waitfor::{Collective, WaitEdge, WaitNode, WaitReason};

    /// The TP collective of D0's step 1.
    pub(crate) fn collective() -> WaitNode {
        WaitNode::Collective { op: Collective::TpCollective, engine: EngineId::decode(0), step: 1 }
    }

    /// Decode rank D0.dp0.tp`tp`.
    pub(crate) fn rank(tp: u16) -> WaitNode {
        WaitNode::Rank { rank: RankId::new(EngineId::decode(0), 0, tp) }
    }

    /// The handshake listener of prefill rank P0.dp0.tp`tp`.
    pub(crate) fn listener(tp: u16) -> WaitNode {
        WaitNode::HandshakeListener { rank: RankId::new(EngineId::prefill(0), 0, tp) }
    }

    /// The step error of decode rank D0.dp0.tp`tp`.
    pub(crate) fn step_error(tp: u16) -> WaitNode {
        WaitNode::StepError { rank: RankId::new(EngineId::decode(0), 0, tp) }
    }

    /// The MIN vote of D0's group 0 at step 1.
    pub(crate) fn vote() -> WaitNode {
        WaitNode::Vote { engine: EngineId::decode(0), group: 0, step: 1 }
    }

    /// A handshake a rank is blocked on, with the session key of `tp`'s listener.
    pub(crate) fn blocked(tp: u16) -> WaitReason {
        WaitReason::BlockedOnHandshake { session: SessionKey(format!("prefill-0:6301_dp0_tp{tp}")) }
    }

    pub(crate) fn edge(from: WaitNode, to: WaitNode, reason: WaitReason) -> WaitEdge {
        WaitEdge { from, to, reason }
    }
}

#[cfg(test)]
mod tests {
    use pdkv_sim::waitfor::{WaitNode, WaitReason};

    use super::graph::*;
    use super::layout::*;
    use super::nodes::*;

    /// A graph of `pairs`, each waiting for the next for a reason the layout does not look at.
    fn graph(pairs: &[(WaitNode, WaitNode)]) -> Graph {
        let edges: Vec<_> =
            pairs.iter().map(|(a, b)| edge(a.clone(), b.clone(), WaitReason::NotArrived)).collect();
        Graph::new(&edges)
    }

    /// Nodes are numbered in order of first mention, once each however often they are met;
    /// edges keep the hang's order and carry their reason's label.
    #[test]
    fn graphs_number_nodes_by_first_mention() {
        fn check(edges: &[pdkv_sim::waitfor::WaitEdge], names: &[&str], expected: &[(usize, usize, &str)]) {
            let g = Graph::new(edges);
            assert_eq!(g.names, names);
            assert_eq!(g.nodes.len(), g.names.len());
            let got: Vec<(usize, usize, &str)> =
                g.edges.iter().map(|e| (e.from, e.to, e.reason.as_str())).collect();
            assert_eq!(got, expected);
        }
        check(&[], &[], &[]);
        check(
            &[edge(collective(), rank(3), WaitReason::NotArrived), edge(rank(3), listener(3), blocked(3))],
            &["TP collective D0 step 1", "D0.dp0.tp3", "P0.dp0.tp3 handshake listener"],
            &[(0, 1, "not arrived"), (1, 2, "blocked on handshake prefill-0:6301_dp0_tp3")],
        );
        check(
            &[
                edge(rank(0), vote(), WaitReason::WaitingForMinVote),
                edge(vote(), rank(1), WaitReason::HasNotVoted),
                edge(rank(2), vote(), WaitReason::WaitingForMinVote),
                edge(rank(1), rank(1), WaitReason::RaisedOutOfStep),
            ],
            &["D0.dp0.tp0", "vote D0 group 0 step 1", "D0.dp0.tp1", "D0.dp0.tp2"],
            &[
                (0, 1, "waiting for the MIN vote"),
                (1, 2, "has not voted"),
                (3, 1, "waiting for the MIN vote"),
                (2, 2, "raised out of the step (worker-local failure)"),
            ],
        );
    }

    #[test]
    fn columns_follow_the_longest_path() {
        let (coll, r0, r1, listener, vote) = (collective(), rank(0), rank(1), listener(1), vote());
        let g = graph(&[
            (coll.clone(), r0.clone()),
            (coll, r1.clone()),
            (r1.clone(), listener),
            (r0, vote.clone()),
            (vote, r1),
        ]);
        let layout = Layout::new(&g);
        // coll 0; r0 1; vote 2; r1 3 (coll -> r0 -> vote -> r1); listener 4.
        assert_eq!(layout.column_of, vec![0, 1, 3, 4, 2]);
        assert!(layout.cyclic.iter().all(|c| !c));
        // coll -> r1 bends through columns 1 and 2.
        assert_eq!(layout.paths[1], vec![Item::Node(0), Item::Bend(1, 1), Item::Bend(1, 2), Item::Node(2)]);
        assert_eq!(layout.columns[1].len(), 2);
    }

    #[test]
    fn cycle_members_share_a_column() {
        let (w, a, b, c, end) = (collective(), rank(0), rank(1), rank(2), step_error(2));
        let g = graph(&[
            (w.clone(), a.clone()),
            (a.clone(), b.clone()),
            (b.clone(), c.clone()),
            (c.clone(), a.clone()),
            (c.clone(), end.clone()),
        ]);
        let layout = Layout::new(&g);
        let col = |node: &WaitNode| layout.column_of[g.nodes.iter().position(|n| n == node).unwrap()];
        assert_eq!((col(&w), col(&a), col(&b), col(&c), col(&end)), (0, 1, 1, 1, 2));
        assert_eq!(layout.cyclic, vec![false, true, true, true, false]);
        assert_eq!(layout.paths[1], Vec::<Item>::new());
        let solo = Layout::new(&graph(&[(rank(0), rank(0))]));
        assert_eq!(solo.cyclic, vec![true]);
    }

    #[test]
    fn reasons_are_cut_and_counted() {
        assert_eq!(reason_text("not arrived", 8), "not arrived ×8");
        let long = "x".repeat(80);
        assert_eq!(reason_text(&long, 1).chars().count(), 61);
    }
}
