//! Every legacy option is caught: exploring seeds of a small scenario with the option on finds a
//! run that breaks the matching property within a stated budget, both on the scenario's own
//! workload and as a search (a small seed drawn per seed), and the shrunk counterexample is
//! small. These tests keep the checkers honest (a vacuous checker would find nothing). The rows
//! are `pdkv_sim::catch::rows`, which `cargo xtask catch` prints with the seeds each mode took.

use pdkv_core::legacy::Legacy;
use pdkv_sim::catch::{catch, fixed_twin_fails, rows, Expect, Mode};
use pdkv_sim::explore::{shrink, size};

#[test]
fn every_legacy_option_is_caught_within_its_budget() {
    let table = rows();
    assert_eq!(table.len(), Legacy::ALL.len(), "every legacy option has a row");
    let mut missed = Vec::new();
    for row in &table {
        for mode in [Mode::Full, Mode::Search] {
            let budget = row.budget(mode);
            // The same scenario without the option must hold, or the row proves nothing.
            let twin = fixed_twin_fails(row, mode, budget.min(50)).expect("the fixed twin runs");
            assert_eq!(twin, None, "{} ({mode:?}): the fixed twin fails too ({:?})", row.option, row.expect);
            match catch(row, mode, budget).expect("the row runs") {
                Some(found) => {
                    let shrunk = match row.expect {
                        Expect::Property(p) => size(&shrink(&found.scenario, p, 200).scenario),
                        Expect::JainAtMost(_) => size(&found.scenario),
                    };
                    eprintln!(
                        "{} ({mode:?}): caught at seed {}, shrunk to size {shrunk}",
                        row.option, found.seed
                    );
                    if shrunk > row.max_shrunk {
                        missed.push(format!(
                            "{} ({mode:?}): shrunk size {shrunk} > {}",
                            row.option, row.max_shrunk
                        ));
                    }
                }
                None => missed.push(format!(
                    "{} ({mode:?}): no {:?} in {budget} seeds of {}",
                    row.option, row.expect, row.notation
                )),
            }
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}
