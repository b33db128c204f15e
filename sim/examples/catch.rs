//! `cargo xtask catch`: how many seeds each legacy option's exploration takes to catch it,
//! running the row's own workload on every seed and as a search, with the events and wall time
//! each took; exits 1 if a mode misses its budget.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use pdkv_sim::catch::{catch, rows, Mode};

fn main() -> ExitCode {
    println!("Seeds to the first catch of each legacy option (seeds are counted from 0; `-` = none within 10 x budget).");
    println!();
    println!("| option | deployment | expects | full workload: seed (budget) | events | ms | search: seed (budget) | events | ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut missed = Vec::new();
    for row in rows() {
        let mut cells = Vec::new();
        for mode in [Mode::Full, Mode::Search] {
            let budget = row.budget(mode);
            let started = Instant::now();
            let found = match catch(&row, mode, budget.saturating_mul(10)) {
                Ok(found) => found,
                Err(e) => {
                    eprintln!("{}: {e}", row.option);
                    return ExitCode::FAILURE;
                }
            };
            let ms = started.elapsed().as_secs_f64() * 1e3;
            match found {
                Some(c) => {
                    if c.seed >= budget {
                        missed.push(format!(
                            "{} ({mode:?}): seed {} is past the budget {budget}",
                            row.option, c.seed
                        ));
                    }
                    cells.push(format!("{} ({budget}) | {} | {ms:.0}", c.seed, c.events));
                }
                None => {
                    missed.push(format!("{} ({mode:?}): not caught in {} seeds", row.option, budget * 10));
                    cells.push(format!("- ({budget}) | - | {ms:.0}"));
                }
            }
        }
        println!("| {} | {} | {:?} | {} |", row.option, row.notation, row.expect, cells.join(" | "));
    }
    if missed.is_empty() {
        println!("\nevery option caught within its budgets");
        ExitCode::SUCCESS
    } else {
        for m in &missed {
            eprintln!("missed: {m}");
        }
        ExitCode::FAILURE
    }
}
