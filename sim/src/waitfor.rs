//! The wait-for graph of a hang: who waits for whom, and the cycle if there is one.
//!
//! Nodes and reasons are typed ([`WaitNode`], [`WaitReason`]); their `Display` is the label the
//! text summary, the report pictures and the Graphviz output show. In `result.json` each is an
//! object whose `kind` says what it is, with its fields beside it; ranks and engines are
//! written as their labels (`"D0.dp0.tp3"`, `"D0"`), which is how every other part of the
//! result and the command line names them. An edge reads
//! `{"from": {"kind": "rank", "rank": "D0.dp0.tp3"}, "to": {"kind": "handshake_listener",
//! "rank": "P0.dp0.tp3"}, "reason": {"kind": "blocked_on_handshake", "session": "…"}}`.

use std::collections::BTreeMap;
use std::fmt;

use pdkv_core::ids::{EngineId, RankId};
use pdkv_core::ports::SessionKey;
use petgraph::algo::tarjan_scc;
use petgraph::graph::{DiGraph, NodeIndex};
use serde::{Deserialize, Serialize};

/// Which collective a decode engine's step waits in; `tp_collective` or `ep_all_to_all` in
/// `result.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// The TP collective of a step (a TP engine, or DP groups without EP).
    TpCollective,
    /// The all-to-all that makes every DP group of a DP+EP engine step together.
    EpAllToAll,
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Collective::TpCollective => "TP collective",
            Collective::EpAllToAll => "EP all-to-all",
        })
    }
}

/// Something that waits or is waited for; in `result.json` an object tagged by `kind` (the
/// variant's snake_case name).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WaitNode {
    /// A decode engine's collective for one step, which waits until every rank arrives.
    Collective {
        op: Collective,
        #[serde(with = "label")]
        engine: EngineId,
        step: u64,
    },
    /// One GPU rank (a decode worker in every graph the simulator builds).
    Rank {
        #[serde(with = "label")]
        rank: RankId,
    },
    /// The worker-local failure a rank raised out of its step, which it waits on for good.
    StepError {
        #[serde(with = "label")]
        rank: RankId,
    },
    /// A prefill rank's handshake listener.
    HandshakeListener {
        #[serde(with = "label")]
        rank: RankId,
    },
    /// The MIN vote of a decode group for one step. `group` is the simulator's number of the
    /// group, counted over every decode engine.
    Vote {
        #[serde(with = "label")]
        engine: EngineId,
        group: usize,
        step: u64,
    },
}

impl fmt::Display for WaitNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitNode::Collective { op, engine, step } => write!(f, "{op} {engine} step {step}"),
            WaitNode::Rank { rank } => write!(f, "{rank}"),
            WaitNode::StepError { rank } => write!(f, "{rank} step error"),
            WaitNode::HandshakeListener { rank } => write!(f, "{rank} handshake listener"),
            WaitNode::Vote { engine, group, step } => write!(f, "vote {engine} group {group} step {step}"),
        }
    }
}

/// Why one node waits for another; in `result.json` an object tagged by `kind`, like a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WaitReason {
    /// The collective still waits for this rank.
    NotArrived,
    /// The rank left the step with a worker-local failure.
    RaisedOutOfStep,
    /// The rank cannot arrive at the collective while its handshake of `session` is waiting.
    BlockedOnHandshake { session: SessionKey },
    /// When the run ended, the worker still waited for its handshake of `session`.
    Handshake { session: SessionKey },
    /// The rank voted and waits for the group's MIN vote to close.
    WaitingForMinVote,
    /// The vote waits for this rank, which has not voted.
    HasNotVoted,
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::NotArrived => f.write_str("not arrived"),
            WaitReason::RaisedOutOfStep => f.write_str("raised out of the step (worker-local failure)"),
            WaitReason::BlockedOnHandshake { session } => write!(f, "blocked on handshake {session}"),
            WaitReason::Handshake { session } => write!(f, "handshake {session}"),
            WaitReason::WaitingForMinVote => f.write_str("waiting for the MIN vote"),
            WaitReason::HasNotVoted => f.write_str("has not voted"),
        }
    }
}

/// One wait: `from` waits for `to` because of `reason`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitEdge {
    /// The waiter.
    pub from: WaitNode,
    /// What it waits for.
    pub to: WaitNode,
    /// Why.
    pub reason: WaitReason,
}

impl fmt::Display for WaitEdge {
    /// `from -> to (reason)`, the line the text summary prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {} ({})", self.from, self.to, self.reason)
    }
}

/// Engines and ranks in `result.json` as the labels `Display` writes (`D0`, `D0.dp0.tp3`),
/// read back with `FromStr`.
mod label {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Display, S: Serializer>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(value)
    }

    pub fn deserialize<'de, T, D>(deserializer: D) -> Result<T, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A directed graph of waiters with a reason on each edge.
#[derive(Clone, Debug, Default)]
pub struct WaitFor {
    graph: DiGraph<WaitNode, WaitReason>,
    nodes: BTreeMap<WaitNode, NodeIndex>,
}

impl WaitFor {
    fn node(&mut self, node: WaitNode) -> NodeIndex {
        if let Some(&i) = self.nodes.get(&node) {
            return i;
        }
        let i = self.graph.add_node(node.clone());
        self.nodes.insert(node, i);
        i
    }

    /// Records that `waiter` waits for `waited` because of `reason`.
    pub fn edge(&mut self, waiter: WaitNode, waited: WaitNode, reason: WaitReason) {
        let (a, b) = (self.node(waiter), self.node(waited));
        self.graph.add_edge(a, b, reason);
    }

    /// The edges in insertion order.
    pub fn edges(&self) -> Vec<WaitEdge> {
        self.graph
            .edge_indices()
            .filter_map(|e| {
                let (a, b) = self.graph.edge_endpoints(e)?;
                Some(WaitEdge {
                    from: self.graph[a].clone(),
                    to: self.graph[b].clone(),
                    reason: self.graph[e].clone(),
                })
            })
            .collect()
    }

    /// The members of a cycle (a strongly connected component of more than one node, or a
    /// node waiting for itself), if there is one: a deadlock. They are sorted by label, the
    /// order in which the summary lists them.
    pub fn cycle(&self) -> Option<Vec<WaitNode>> {
        for component in tarjan_scc(&self.graph) {
            let looped = component.len() == 1 && self.graph.contains_edge(component[0], component[0]);
            if component.len() > 1 || looped {
                let mut members: Vec<WaitNode> = component.iter().map(|&i| self.graph[i].clone()).collect();
                members.sort_by_cached_key(WaitNode::to_string);
                return Some(members);
            }
        }
        None
    }

    /// The graph in Graphviz form.
    pub fn dot(&self) -> String {
        let mut out = String::from("digraph waitfor {\n  rankdir=LR;\n  node [shape=box];\n");
        for i in self.graph.node_indices() {
            let label = self.graph[i].to_string().replace('"', "'");
            out.push_str(&format!("  n{} [label=\"{label}\"];\n", i.index()));
        }
        for e in self.graph.edge_indices() {
            if let Some((a, b)) = self.graph.edge_endpoints(e) {
                let label = self.graph[e].to_string().replace('"', "'");
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

    fn rank(text: &str) -> RankId {
        text.parse().expect("a rank label")
    }

    fn session() -> SessionKey {
        SessionKey("prefill-0:6301_dp0_tp3".into())
    }

    /// The labels are the text the summary, the pictures and the Graphviz output have always
    /// shown.
    #[test]
    fn nodes_and_reasons_read_as_before() {
        fn check(shown: &dyn fmt::Display, expected: &str) {
            assert_eq!(shown.to_string(), expected);
        }
        let d0 = EngineId::decode(0);
        check(
            &WaitNode::Collective { op: Collective::TpCollective, engine: d0, step: 1 },
            "TP collective D0 step 1",
        );
        check(
            &WaitNode::Collective { op: Collective::EpAllToAll, engine: EngineId::decode(2), step: 40 },
            "EP all-to-all D2 step 40",
        );
        check(&WaitNode::Rank { rank: rank("D0.dp1.tp3") }, "D0.dp1.tp3");
        check(&WaitNode::StepError { rank: rank("D0.dp0.tp3") }, "D0.dp0.tp3 step error");
        check(&WaitNode::HandshakeListener { rank: rank("P1.dp0.tp3") }, "P1.dp0.tp3 handshake listener");
        check(&WaitNode::Vote { engine: d0, group: 8, step: 1 }, "vote D0 group 8 step 1");
        check(&WaitReason::NotArrived, "not arrived");
        check(&WaitReason::RaisedOutOfStep, "raised out of the step (worker-local failure)");
        check(
            &WaitReason::BlockedOnHandshake { session: session() },
            "blocked on handshake prefill-0:6301_dp0_tp3",
        );
        check(&WaitReason::Handshake { session: session() }, "handshake prefill-0:6301_dp0_tp3");
        check(&WaitReason::WaitingForMinVote, "waiting for the MIN vote");
        check(&WaitReason::HasNotVoted, "has not voted");
        check(
            &WaitEdge {
                from: WaitNode::Rank { rank: rank("D0.dp0.tp3") },
                to: WaitNode::HandshakeListener { rank: rank("P0.dp0.tp3") },
                reason: WaitReason::BlockedOnHandshake { session: session() },
            },
            "D0.dp0.tp3 -> P0.dp0.tp3 handshake listener (blocked on handshake prefill-0:6301_dp0_tp3)",
        );
    }

    /// In `result.json` every node and reason is an object tagged by `kind`, with engines and
    /// ranks as labels, and reads back to the same value.
    #[test]
    fn nodes_reasons_and_edges_are_tagged_objects_in_json() {
        fn check<T>(value: T, expected: &str)
        where
            T: Serialize + serde::de::DeserializeOwned + PartialEq + fmt::Debug,
        {
            let json = serde_json::to_string(&value).expect("serialises");
            assert_eq!(json, expected);
            assert_eq!(serde_json::from_str::<T>(&json).expect("reads back"), value, "{json}");
        }
        let d0 = EngineId::decode(0);
        check(
            WaitNode::Collective { op: Collective::TpCollective, engine: d0, step: 1 },
            r#"{"kind":"collective","op":"tp_collective","engine":"D0","step":1}"#,
        );
        check(
            WaitNode::Collective { op: Collective::EpAllToAll, engine: EngineId::decode(2), step: 40 },
            r#"{"kind":"collective","op":"ep_all_to_all","engine":"D2","step":40}"#,
        );
        check(WaitNode::Rank { rank: rank("D0.dp1.tp3") }, r#"{"kind":"rank","rank":"D0.dp1.tp3"}"#);
        check(
            WaitNode::StepError { rank: rank("D0.dp0.tp3") },
            r#"{"kind":"step_error","rank":"D0.dp0.tp3"}"#,
        );
        check(
            WaitNode::HandshakeListener { rank: rank("P1.dp0.tp3") },
            r#"{"kind":"handshake_listener","rank":"P1.dp0.tp3"}"#,
        );
        check(
            WaitNode::Vote { engine: d0, group: 8, step: 1 },
            r#"{"kind":"vote","engine":"D0","group":8,"step":1}"#,
        );
        check(WaitReason::NotArrived, r#"{"kind":"not_arrived"}"#);
        check(WaitReason::RaisedOutOfStep, r#"{"kind":"raised_out_of_step"}"#);
        check(
            WaitReason::BlockedOnHandshake { session: session() },
            r#"{"kind":"blocked_on_handshake","session":"prefill-0:6301_dp0_tp3"}"#,
        );
        check(
            WaitReason::Handshake { session: session() },
            r#"{"kind":"handshake","session":"prefill-0:6301_dp0_tp3"}"#,
        );
        check(WaitReason::WaitingForMinVote, r#"{"kind":"waiting_for_min_vote"}"#);
        check(WaitReason::HasNotVoted, r#"{"kind":"has_not_voted"}"#);
        check(
            WaitEdge {
                from: WaitNode::Vote { engine: d0, group: 0, step: 1 },
                to: WaitNode::Rank { rank: rank("D0.dp0.tp3") },
                reason: WaitReason::HasNotVoted,
            },
            r#"{"from":{"kind":"vote","engine":"D0","group":0,"step":1},"to":{"kind":"rank","rank":"D0.dp0.tp3"},"reason":{"kind":"has_not_voted"}}"#,
        );
    }

    /// A node whose label or kind is not one the simulator writes is refused, with the reason.
    #[test]
    fn unreadable_nodes_are_refused() {
        fn check(json: &str, expected: &str) {
            let err = serde_json::from_str::<WaitNode>(json).expect_err(json).to_string();
            assert!(err.contains(expected), "{json}: {err}");
        }
        check(r#"{"kind":"rank","rank":"D0.dp0"}"#, r#""D0.dp0" is not an engine like P0 or a rank like"#);
        check(r#"{"kind":"vote","engine":"X0","group":0,"step":1}"#, r#""X0" is not an engine"#);
        check(r#"{"kind":"rank","rank":{"engine":"D0"}}"#, "invalid type: map, expected a string");
        check(r#"{"kind":"reaper"}"#, "unknown variant `reaper`");
        check(r#""D0.dp0.tp3""#, "invalid type: string");
    }

    #[test]
    fn chains_have_no_cycle_and_loops_do() {
        let collective =
            WaitNode::Collective { op: Collective::TpCollective, engine: EngineId::decode(0), step: 1 };
        let worker = WaitNode::Rank { rank: rank("D0.dp0.tp3") };
        let listener = WaitNode::HandshakeListener { rank: rank("P0.dp0.tp3") };
        let mut g = WaitFor::default();
        g.edge(collective.clone(), worker.clone(), WaitReason::NotArrived);
        g.edge(worker.clone(), listener.clone(), WaitReason::BlockedOnHandshake { session: session() });
        assert_eq!(g.cycle(), None);
        assert_eq!(g.edges()[0].to_string(), "TP collective D0 step 1 -> D0.dp0.tp3 (not arrived)");
        assert_eq!(g.edges().len(), 2);
        // A node met again is the same node.
        g.edge(listener.clone(), collective.clone(), WaitReason::HasNotVoted);
        assert_eq!(g.cycle(), Some(vec![worker, listener, collective]), "sorted by label");
        assert!(g.dot().contains("  n2 -> n0 [label=\"has not voted\"];\n"), "{}", g.dot());
        let mut lone = WaitFor::default();
        let error = WaitNode::StepError { rank: rank("D0.dp0.tp0") };
        lone.edge(error.clone(), error.clone(), WaitReason::RaisedOutOfStep);
        assert_eq!(lone.cycle(), Some(vec![error]));
    }
}
