//! Fault targets: the check that a rank pattern (`pdkv_engine::target`) names at least one rank
//! of the deployment.

use pdkv_core::ids::Role;
use pdkv_core::topology::{Deployment, Layout};

use pdkv_engine::target::{parse_target, TARGET_SYNTAX};

/// Whether `text` is a rank pattern naming at least one rank of `deployment`; the error says
/// why not, and the caller names the field.
pub(super) fn check_target(text: &str, deployment: &Deployment) -> Result<(), String> {
    let Some(pattern) = parse_target(text) else {
        return Err(format!("`{}` is not a rank pattern; expected {TARGET_SYNTAX}", text.escape_debug()));
    };
    let letter = pattern.role.letter();
    let side = match pattern.role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let fail = |why: String| Err(format!("`{text}` matches no rank of {}: {why}", deployment.notation()));
    let engines = deployment.engines(pattern.role);
    let chosen: Vec<Layout> = engines
        .iter()
        .enumerate()
        .filter(|&(e, _)| !matches!(pattern.engine, Some(n) if usize::from(n) != e))
        .map(|(_, layout)| *layout)
        .collect();
    // The notation parser guarantees at least one engine per side and sizes of at least 1.
    let last = engines.len().saturating_sub(1);
    if chosen.is_empty() {
        let n = pattern.engine.unwrap_or_default();
        return fail(format!("there is no {side} engine {letter}{n} (engines {letter}0..{letter}{last})"));
    }
    let chosen: Vec<Layout> = match pattern.dp {
        None => chosen,
        Some(dp) => {
            let largest = chosen.iter().map(|layout| layout.dp).max().unwrap_or(1);
            if dp >= largest {
                return fail(format!(
                    "DP rank {dp} is out of range (largest: dp{})",
                    largest.saturating_sub(1)
                ));
            }
            chosen.into_iter().filter(|layout| dp < layout.dp).collect()
        }
    };
    if let Some(tp) = pattern.tp {
        let largest = chosen.iter().map(|layout| layout.tp).max().unwrap_or(1);
        if tp >= largest {
            return fail(format!("TP rank {tp} is out of range (largest: tp{})", largest.saturating_sub(1)));
        }
    }
    Ok(())
}
