//! What the protocol machines' transition tables share: the row, and the walk that applies
//! every event to every representative state of a pure transition function.

use std::fmt::Debug;

/// One row of a machine's transition table, as docs/machines lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableRow {
    /// State before.
    pub from: String,
    /// Event.
    pub event: String,
    /// State after.
    pub to: String,
    /// Output.
    pub output: String,
}

/// Applies each named event to each state through `step`, in order (states outer), naming states
/// with `kind` and outputs by their `Debug` form.
pub(crate) fn walk<S: Clone, E: Clone, O: Debug>(
    states: &[S],
    events: &[(String, E)],
    step: impl Fn(S, E) -> (S, O),
    kind: impl Fn(&S) -> String,
) -> Vec<TableRow> {
    let mut rows = Vec::with_capacity(states.len() * events.len());
    for state in states {
        for (name, event) in events {
            let (next, output) = step(state.clone(), event.clone());
            rows.push(TableRow {
                from: kind(state),
                event: name.clone(),
                to: kind(&next),
                output: format!("{output:?}"),
            });
        }
    }
    rows
}

/// Every sequence of `len` events drawn from `events` (with repeats), for the exhaustive tests
/// of a machine.
#[cfg(test)]
pub(crate) fn sequences<E: Copy>(events: &[E], len: usize) -> Vec<Vec<E>> {
    let mut seqs: Vec<Vec<E>> = vec![Vec::new()];
    for _ in 0..len {
        seqs = seqs
            .into_iter()
            .flat_map(|s| {
                events.iter().map(move |&e| {
                    let mut next = s.clone();
                    next.push(e);
                    next
                })
            })
            .collect();
    }
    seqs
}
