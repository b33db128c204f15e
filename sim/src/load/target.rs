//! Fault targets: rank patterns such as `P0.dp*.tp3` ([`parse_target`]), and the check that a
//! pattern names at least one rank of the deployment.

use pdkv_core::ids::Role;
use pdkv_core::topology::{Deployment, Layout};

use super::validate::{violation, Check};

/// A parsed fault target: role, and engine, DP and TP ranks, each `None` for `*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetPattern {
    /// Prefill or decode.
    pub role: Role,
    /// Engine index, `None` for any.
    pub engine: Option<u16>,
    /// DP rank, `None` for any.
    pub dp: Option<u16>,
    /// TP rank, `None` for any.
    pub tp: Option<u16>,
}

impl TargetPattern {
    /// True when `rank` is one of the ranks the pattern names.
    pub fn matches(&self, rank: pdkv_core::ids::RankId) -> bool {
        rank.engine.role == self.role
            && self.engine.is_none_or(|e| e == rank.engine.index)
            && self.dp.is_none_or(|d| d == rank.dp)
            && self.tp.is_none_or(|t| t == rank.tp)
    }
}

const TARGET_SYNTAX: &str = "P<engine>.dp<rank>.tp<rank> or D<engine>.dp<rank>.tp<rank>, \
                             each number or `*`, e.g. P0.dp*.tp3";

/// Parses a fault target such as `P0.dp*.tp3`; `None` if it is not of that form.
pub fn parse_target(text: &str) -> Option<TargetPattern> {
    fn number(part: &str) -> Option<Option<u16>> {
        if part == "*" {
            return Some(None);
        }
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        part.parse().ok().map(Some)
    }
    let mut parts = text.split('.');
    let (engine, dp, tp) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let role = match engine.as_bytes().first()? {
        b'P' => Role::Prefill,
        b'D' => Role::Decode,
        _ => return None,
    };
    Some(TargetPattern {
        role,
        engine: number(&engine[1..])?,
        dp: number(dp.strip_prefix("dp")?)?,
        tp: number(tp.strip_prefix("tp")?)?,
    })
}

pub(super) fn check_target(field: &str, text: &str, deployment: &Deployment) -> Check {
    let Some(pattern) = parse_target(text) else {
        return Err(violation(
            field,
            format!("`{}` is not a rank pattern; expected {TARGET_SYNTAX}", text.escape_debug()),
        ));
    };
    let letter = pattern.role.letter();
    let side = match pattern.role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let fail = |why: String| {
        Err(violation(field, format!("`{text}` matches no rank of {}: {why}", deployment.notation())))
    };
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
