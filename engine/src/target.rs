//! Fault targets: rank patterns such as `P0.dp*.tp3`, which both drivers' faults name
//! (scenario files' `target`, the cluster's `--kill` and message-fault flags).

use pdkv_core::ids::{RankId, Role};

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
    pub fn matches(&self, rank: RankId) -> bool {
        rank.engine.role == self.role
            && self.engine.is_none_or(|e| e == rank.engine.index)
            && self.dp.is_none_or(|d| d == rank.dp)
            && self.tp.is_none_or(|t| t == rank.tp)
    }
}

pub const TARGET_SYNTAX: &str = "P<engine>.dp<rank>.tp<rank> or D<engine>.dp<rank>.tp<rank>, \
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

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::ids::EngineId;

    /// A pattern as role, engine, DP and TP (`None` for `*`).
    type Parts = (Role, Option<u16>, Option<u16>, Option<u16>);

    fn check(text: &str, expected: Option<Parts>) {
        let got = parse_target(text).map(|p| (p.role, p.engine, p.dp, p.tp));
        assert_eq!(got, expected, "{text}");
    }

    #[test]
    fn patterns_parse_and_anything_else_is_refused() {
        use Role::{Decode, Prefill};
        check("P0.dp0.tp0", Some((Prefill, Some(0), Some(0), Some(0))));
        check("D1.dp*.tp3", Some((Decode, Some(1), None, Some(3))));
        check("P*.dp*.tp*", Some((Prefill, None, None, None)));
        check("P65535.dp0.tp0", Some((Prefill, Some(65535), Some(0), Some(0))));
        for bad in [
            "",
            "P0",
            "P0.dp0",
            "P0.dp0.tp0.x",
            "X0.dp0.tp0",
            "P.dp0.tp0",
            "P0.d0.tp0",
            "P0.dp0.t0",
            "P65536.dp0.tp0",
            "P-1.dp0.tp0",
            "P+1.dp0.tp0",
            "P0.dp 1.tp0",
            "P0.dp**.tp0",
            "é0.dp0.tp0",
        ] {
            check(bad, None);
        }
    }

    #[test]
    fn a_pattern_matches_the_ranks_it_names() {
        let p = parse_target("D0.dp*.tp1").expect("a pattern");
        assert!(p.matches(RankId::new(EngineId::decode(0), 3, 1)));
        assert!(!p.matches(RankId::new(EngineId::decode(0), 3, 0)));
        assert!(!p.matches(RankId::new(EngineId::decode(1), 3, 1)));
        assert!(!p.matches(RankId::new(EngineId::prefill(0), 3, 1)));
    }
}
