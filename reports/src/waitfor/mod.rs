//! Wait-for graphs of hangs drawn as boxes and arrows (`wait_for_graph`): a layered layout by
//! longest path from the nodes nobody waits for, with the members of a cycle in one column.

use std::fs;
use std::path::{Path, PathBuf};

use pdkv_sim::result::Hang;

use crate::error::ReportError;
use crate::render::render;

/// For a hang of the run titled `run` ([`pdkv_sim::RunResult::title`]): writes
/// wait_for_<i>.png/.svg (the graph drawn as boxes and arrows) and wait_for_<i>.dot (hang.dot
/// as is). An arrow `a → b` means a waits for b, labelled with the reason; members of
/// `hang.cycle` are red and boxed as "cycle"; nodes that wait for nothing (where the waits end)
/// are orange. Returns the paths written: PNG, SVG, then DOT.
pub fn wait_for_graph(hang: &Hang, index: usize, run: &str, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let stem = format!("wait_for_{index}");
    let mut paths = render(dir, &stem, &WaitFor { hang, run })?;
    let dot = dir.join(format!("{stem}.dot"));
    fs::write(&dot, &hang.dot).map_err(|e| ReportError::io(&dot, e))?;
    paths.push(dot);
    Ok(paths)
}

mod draw;
mod graph;
mod layout;

use draw::WaitFor;

#[cfg(test)]
mod tests {
    use super::graph::*;
    use super::layout::*;

    fn lines(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn lines_parse_with_and_without_reasons() {
        assert_eq!(
            parse_line("D0.dp0.tp3 -> P0.dp0.tp3 handshake listener (blocked on handshake p-0:6301_dp0_tp3)"),
            Some((
                "D0.dp0.tp3".to_string(),
                "P0.dp0.tp3 handshake listener".to_string(),
                "blocked on handshake p-0:6301_dp0_tp3".to_string()
            ))
        );
        assert_eq!(
            parse_line("a -> b (waits (really) long)"),
            Some(("a".to_string(), "b".to_string(), "waits (really) long".to_string()))
        );
        assert_eq!(parse_line("a -> b"), Some(("a".to_string(), "b".to_string(), String::new())));
        assert_eq!(parse_line("a -> (x)"), Some(("a".to_string(), "(x)".to_string(), String::new())));
        assert_eq!(parse_line("no arrow here"), None);
        assert_eq!(parse_line(" -> b (x)"), None);
        let g = Graph::parse(&lines(&["a -> b (x)", "junk", "b -> a (y)"]));
        assert_eq!(g.names, lines(&["a", "b"]));
        assert_eq!(g.skipped, 1);
    }

    #[test]
    fn columns_follow_the_longest_path() {
        let g = Graph::parse(&lines(&[
            "coll -> r0 (not arrived)",
            "coll -> r1 (not arrived)",
            "r1 -> listener (blocked)",
            "r0 -> vote (waiting)",
            "vote -> r1 (has not voted)",
        ]));
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
        let g = Graph::parse(&lines(&[
            "w -> a (x)",
            "a -> b (y)",
            "b -> c (z)",
            "c -> a (back)",
            "c -> end (q)",
        ]));
        let layout = Layout::new(&g);
        let col = |name: &str| layout.column_of[g.names.iter().position(|n| n == name).unwrap()];
        assert_eq!((col("w"), col("a"), col("b"), col("c"), col("end")), (0, 1, 1, 1, 2));
        assert_eq!(layout.cyclic, vec![false, true, true, true, false]);
        assert_eq!(layout.paths[1], Vec::<Item>::new());
        let solo = Layout::new(&Graph::parse(&lines(&["x -> x (self)"])));
        assert_eq!(solo.cyclic, vec![true]);
    }

    #[test]
    fn reasons_are_cut_and_counted() {
        assert_eq!(reason_text("not arrived", 8), "not arrived ×8");
        let long = "x".repeat(80);
        assert_eq!(reason_text(&long, 1).chars().count(), 61);
    }
}
