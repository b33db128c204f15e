//! Deployment model (engines, layouts, model facts) and the `2P_TP8:1D_DP8EP` notation parser.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{EngineId, RankId, Role};

/// At most this many engines of one role: a limit, so every loop over engines is bounded.
pub const MAX_ENGINES_PER_ROLE: u16 = 64;
/// At most this many DP or TP ranks in one engine.
pub const MAX_PARALLEL_SIZE: u16 = 256;
/// At most this many GPUs on one side of a deployment.
pub const MAX_RANKS_PER_ROLE: u32 = 4096;

/// How one engine spreads over its GPUs.
///
/// `ep` says whether the MoE experts are spread over all `dp * tp` ranks (expert parallelism);
/// it changes compute and collectives, not where KV lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel size: independent replicas, each with its own scheduler and KV pool.
    pub dp: u16,
    /// Tensor-parallel size: GPUs in each DP group, which split every layer (and the KV heads
    /// while there are enough of them).
    pub tp: u16,
    /// Expert parallelism over all `dp * tp` ranks.
    pub ep: bool,
}

impl Layout {
    /// A layout of `dp` × `tp` GPUs. Nothing is checked here; the notation parser and the
    /// registry accept sizes in 1..=256 only.
    pub const fn new(dp: u16, tp: u16, ep: bool) -> Layout {
        Layout { dp, tp, ep }
    }

    /// A single-DP engine of `tp` GPUs without EP (`TP<tp>`).
    pub const fn tp(tp: u16) -> Layout {
        Layout::new(1, tp, false)
    }

    /// Number of GPUs the engine occupies.
    pub fn ranks(self) -> u32 {
        u32::from(self.dp) * u32::from(self.tp)
    }

    /// Expert-parallel group size: every rank when EP is on, else 1.
    pub fn ep_size(self) -> u32 {
        if self.ep {
            self.ranks()
        } else {
            1
        }
    }

    /// Offset of rank (dp, tp) in the engine's flat rank order, `dp * tp_size + tp`.
    pub fn flat_index(self, dp: u16, tp: u16) -> u32 {
        debug_assert!(dp < self.dp && tp < self.tp, "rank (dp {dp}, tp {tp}) outside {self}");
        u32::from(dp) * u32::from(self.tp) + u32::from(tp)
    }
}

impl fmt::Display for Layout {
    /// Canonical notation: `TP8`, `DP8EP`, `DP4TP2`, `DP4TP2EP`; a single GPU is `TP1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dp > 1 {
            write!(f, "DP{}", self.dp)?;
        }
        if self.tp > 1 || self.dp == 1 {
            write!(f, "TP{}", self.tp)?;
        }
        if self.ep {
            f.write_str("EP")?;
        }
        Ok(())
    }
}

/// Facts about the served model that decide how many bytes each rank holds and sends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub struct ModelSpec {
    /// Multi-head latent attention: one latent vector per token, identical on every TP rank.
    pub use_mla: bool,
    /// Number of KV heads (1 for MLA, whose latent behaves as one replicated head).
    pub kv_heads: u16,
    /// Transformer layers, each with its own KV cache; reads go one batch per layer.
    pub layers: u16,
    /// KV bytes of one token in one layer for the whole model (all heads).
    pub bytes_per_token_per_layer: u32,
    /// Tokens per KV block.
    pub block_size_tokens: u32,
}

impl ModelSpec {
    /// DeepSeek-R1: MLA with 576 values (latent 512 + rotary 64) per token per layer, stored as
    /// 16-bit values, 61 layers, vLLM's default block of 16 tokens.
    pub fn deepseek_r1() -> ModelSpec {
        ModelSpec {
            use_mla: true,
            kv_heads: 1,
            layers: 61,
            bytes_per_token_per_layer: 576 * 2,
            block_size_tokens: 16,
        }
    }

    /// A grouped-query-attention model with `kv_heads` heads of dimension 128 (key and value,
    /// 16-bit) and 80 layers, the shape of Llama-3-70B; used when a user names only `kv_heads`.
    pub fn gqa(kv_heads: u16) -> ModelSpec {
        ModelSpec {
            use_mla: false,
            kv_heads,
            layers: 80,
            bytes_per_token_per_layer: 2 * u32::from(kv_heads) * 128 * 2,
            block_size_tokens: 16,
        }
    }

    /// KV heads each rank of a TP group of size `tp` holds. Heads are split while there are
    /// enough of them and replicated (one per rank) once TP exceeds the head count.
    pub fn heads_per_rank(&self, tp: u16) -> u16 {
        if self.use_mla {
            return self.kv_heads;
        }
        // Rounded up: with heads that do not divide evenly the largest rank's share counts.
        self.kv_heads.div_ceil(tp.max(1)).max(1)
    }

    /// KV bytes of one token in one layer on one rank of a TP group of size `tp`.
    pub fn bytes_per_token_per_layer_per_rank(&self, tp: u16) -> u64 {
        let heads = u64::from(self.heads_per_rank(tp));
        u64::from(self.bytes_per_token_per_layer) * heads / u64::from(self.kv_heads.max(1))
    }
}

impl Default for ModelSpec {
    fn default() -> ModelSpec {
        ModelSpec::deepseek_r1()
    }
}

/// Prefill and decode engines with their layouts, plus the model they serve.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// Layout of each prefill engine, indexed by engine index.
    pub prefill: Vec<Layout>,
    /// Layout of each decode engine, indexed by engine index.
    pub decode: Vec<Layout>,
    /// The model every engine serves.
    pub model: ModelSpec,
}

impl Deployment {
    /// Parses notation such as `2P_TP8:1D_DP8EP` with the default model (DeepSeek-R1).
    pub fn parse(notation: &str) -> Result<Deployment, NotationError> {
        parse_notation(notation)
    }

    /// The same engines serving `model` instead.
    pub fn with_model(mut self, model: ModelSpec) -> Deployment {
        self.model = model;
        self
    }

    /// Layouts of the engines of `role`, indexed by engine index.
    pub fn engines(&self, role: Role) -> &[Layout] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// The layout of `engine`. Panics if the deployment has no such engine.
    pub fn layout(&self, engine: EngineId) -> Layout {
        self.engines(engine.role)[usize::from(engine.index)]
    }

    /// Every rank of a role in rank order: engine, then DP rank, then TP rank.
    pub fn ranks(&self, role: Role) -> Vec<RankId> {
        let mut out = Vec::new();
        for (index, layout) in self.engines(role).iter().enumerate() {
            let engine = EngineId { role, index: index as u16 };
            for dp in 0..layout.dp {
                for tp in 0..layout.tp {
                    out.push(RankId::new(engine, dp, tp));
                }
            }
        }
        out
    }

    /// Position of `rank` in [`Deployment::ranks`] order for its role.
    pub fn rank_index(&self, rank: RankId) -> usize {
        let engines = self.engines(rank.engine.role);
        let before: u32 = engines[..usize::from(rank.engine.index)].iter().map(|l| l.ranks()).sum();
        let layout = engines[usize::from(rank.engine.index)];
        (before + layout.flat_index(rank.dp, rank.tp)) as usize
    }

    /// Canonical notation, grouping consecutive engines with the same layout.
    pub fn notation(&self) -> String {
        format!("{}:{}", side_notation(&self.prefill, 'P'), side_notation(&self.decode, 'D'))
    }
}

impl fmt::Display for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.notation())
    }
}

fn side_notation(engines: &[Layout], letter: char) -> String {
    let mut groups: Vec<(usize, Layout)> = Vec::new();
    for &layout in engines {
        match groups.last_mut() {
            Some((count, last)) if *last == layout => *count += 1,
            _ => groups.push((1, layout)),
        }
    }
    let parts: Vec<String> =
        groups.iter().map(|(count, layout)| format!("{count}{letter}_{layout}")).collect();
    parts.join("+")
}

/// A deployment notation that could not be parsed: which token, where, and what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotationError {
    /// The whole notation as given.
    pub input: String,
    /// The offending piece of the input (may be empty when something is missing).
    pub token: String,
    /// 1-based character column where the token starts.
    pub column: usize,
    /// What the parser wanted at that point, in words.
    pub expected: String,
}

impl fmt::Display for NotationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid deployment notation {:?}: bad token {:?} at column {}: expected {}",
            self.input, self.token, self.column, self.expected
        )
    }
}

impl std::error::Error for NotationError {}

/// Cursor over the notation that remembers the whole input so errors can point into it.
struct Parser<'a> {
    input: &'a str,
}

impl<'a> Parser<'a> {
    fn error(&self, start: usize, token: &str, expected: impl Into<String>) -> NotationError {
        NotationError {
            input: self.input.to_string(),
            token: token.to_string(),
            column: self.input[..start].chars().count() + 1,
            expected: expected.into(),
        }
    }

    /// Parses the side `text` that begins at byte `start` of the input.
    fn side(&self, text: &str, start: usize, role: Role) -> Result<Vec<Layout>, NotationError> {
        let what = match role {
            Role::Prefill => "prefill engines like 2P_TP8 before ':'",
            Role::Decode => "decode engines like 1D_DP8EP after ':'",
        };
        if text.is_empty() {
            return Err(self.error(start, text, what));
        }
        let mut engines = Vec::new();
        let mut offset = start;
        for group in text.split('+') {
            if group.is_empty() {
                return Err(self.error(offset, group, format!("{what} (empty group around '+')")));
            }
            let (count, layout) = self.group(group, offset, role)?;
            if engines.len() + usize::from(count) > usize::from(MAX_ENGINES_PER_ROLE) {
                return Err(self.error(
                    offset,
                    group,
                    format!("at most {MAX_ENGINES_PER_ROLE} engines per side"),
                ));
            }
            engines.extend(std::iter::repeat_n(layout, usize::from(count)));
            offset += group.len() + 1;
        }
        let ranks: u32 = engines.iter().map(|l: &Layout| l.ranks()).sum();
        if ranks > MAX_RANKS_PER_ROLE {
            return Err(self.error(
                start,
                text,
                format!("at most {MAX_RANKS_PER_ROLE} GPUs per side (this side has {ranks})"),
            ));
        }
        Ok(engines)
    }

    /// Parses one group such as `2P_DP4TP2EP` starting at byte `start`.
    fn group(&self, group: &str, start: usize, role: Role) -> Result<(u16, Layout), NotationError> {
        let digits = group.chars().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 {
            let token: String = group.chars().take(1).collect();
            return Err(self.error(start, &token, "an engine count like the 2 in 2P_TP8"));
        }
        let count_text = &group[..digits];
        let count = match count_text.parse::<u16>() {
            Ok(0) => return Err(self.error(start, count_text, "an engine count of at least 1")),
            Ok(n) if n <= MAX_ENGINES_PER_ROLE => n,
            _ => {
                return Err(self.error(
                    start,
                    count_text,
                    format!("an engine count of at most {MAX_ENGINES_PER_ROLE}"),
                ))
            }
        };
        let rest = &group[digits..];
        let letter = rest.chars().next();
        let found = match letter.map(|c| c.to_ascii_uppercase()) {
            Some('P') => Role::Prefill,
            Some('D') => Role::Decode,
            _ => {
                let token: String = letter.map(String::from).unwrap_or_default();
                return Err(self.error(
                    start + digits,
                    &token,
                    "P (prefill) or D (decode) after the engine count",
                ));
            }
        };
        if found != role {
            let expected = match role {
                Role::Prefill => "prefill engines (P) left of ':'",
                Role::Decode => "decode engines (D) right of ':'",
            };
            return Err(self.error(start, &group[..digits + 1], expected));
        }
        let after_letter = &rest[1..];
        let Some(layout_text) = after_letter.strip_prefix('_') else {
            let token: String = after_letter.chars().take(1).collect();
            return Err(self.error(
                start + digits + 1,
                &token,
                format!("'_' between {}{} and the layout", count, role.letter()),
            ));
        };
        let layout = self.layout(layout_text, start + digits + 2)?;
        Ok((count, layout))
    }

    /// Parses a layout such as `DP4TP2EP` starting at byte `start`.
    fn layout(&self, text: &str, start: usize) -> Result<Layout, NotationError> {
        const WHAT: &str = "a layout like TP8, DP8EP or DP4TP2 (components DP<n>, TP<n>, EP)";
        if text.is_empty() {
            return Err(self.error(start, text, WHAT));
        }
        let mut dp: Option<u16> = None;
        let mut tp: Option<u16> = None;
        let mut ep = false;
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let at = start + i;
            let name = text.get(i..i + 2).map(str::to_ascii_uppercase);
            let is_known = matches!(name.as_deref(), Some("DP" | "TP" | "EP"));
            if !is_known {
                // Name the whole unrecognised run (letters then digits), e.g. "XP8".
                let run = token_run(&text[i..]);
                return Err(self.error(at, run, WHAT));
            }
            let name = name.unwrap_or_default();
            let digits = text[i + 2..].chars().take_while(|c| c.is_ascii_digit()).count();
            let token = &text[i..i + 2 + digits];
            if name == "EP" {
                if digits > 0 {
                    return Err(self.error(at, token, "EP without a size (the EP group is DP×TP)"));
                }
                if ep {
                    return Err(self.error(at, token, "each of DP, TP and EP at most once"));
                }
                ep = true;
                i += 2;
                continue;
            }
            if digits == 0 {
                return Err(self.error(at, token, format!("a size after {name}, like {name}8")));
            }
            let size = match text[i + 2..i + 2 + digits].parse::<u16>() {
                Ok(0) => return Err(self.error(at, token, format!("{name} size of at least 1"))),
                Ok(n) if n <= MAX_PARALLEL_SIZE => n,
                _ => {
                    return Err(self.error(at, token, format!("{name} size of at most {MAX_PARALLEL_SIZE}")))
                }
            };
            let slot = if name == "DP" { &mut dp } else { &mut tp };
            if slot.is_some() {
                return Err(self.error(at, token, "each of DP, TP and EP at most once"));
            }
            *slot = Some(size);
            i += 2 + digits;
        }
        let layout = Layout::new(dp.unwrap_or(1), tp.unwrap_or(1), ep);
        if dp.is_none() && tp.is_none() {
            return Err(self.error(start, text, "DP<n> or TP<n> before EP, like DP8EP"));
        }
        if layout.ep && layout.ranks() == 1 {
            return Err(self.error(start, text, "EP over more than one rank (DP×TP > 1)"));
        }
        Ok(layout)
    }
}

/// The run of letters followed by digits at the start of `text` (at least one character).
fn token_run(text: &str) -> &str {
    let letters = text.chars().take_while(|c| c.is_ascii_alphabetic()).count();
    let digits = text[letters..].chars().take_while(|c| c.is_ascii_digit()).count();
    let len = (letters + digits).max(text.chars().next().map_or(0, char::len_utf8));
    &text[..len]
}

fn parse_notation(input: &str) -> Result<Deployment, NotationError> {
    let parser = Parser { input };
    if input.trim().is_empty() {
        return Err(parser.error(0, input, "a deployment like 2P_TP8:1D_DP8EP"));
    }
    if let Some((pos, c)) = input.char_indices().find(|(_, c)| c.is_whitespace()) {
        return Err(parser.error(pos, &input[pos..pos + c.len_utf8()], "no spaces inside the notation"));
    }
    let Some(colon) = input.find(':') else {
        let hint = if input.contains('-') {
            "':' between the prefill and decode sides (scenario file names use '-', notation uses ':')"
        } else {
            "':' between the prefill and decode sides, like 2P_TP8:1D_DP8EP"
        };
        return Err(parser.error(0, input, hint));
    };
    if let Some(second) = input[colon + 1..].find(':') {
        return Err(parser.error(colon + 1 + second, ":", "exactly one ':' in the notation"));
    }
    let prefill = parser.side(&input[..colon], 0, Role::Prefill)?;
    let decode = parser.side(&input[colon + 1..], colon + 1, Role::Decode)?;
    Ok(Deployment { prefill, decode, model: ModelSpec::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_ok(input: &str, prefill: &[Layout], decode: &[Layout], canonical: &str) {
        let d = Deployment::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(d.prefill, prefill, "{input}");
        assert_eq!(d.decode, decode, "{input}");
        assert_eq!(d.notation(), canonical, "{input}");
    }

    #[test]
    fn parses_the_reference_notations() {
        let tp8 = Layout::tp(8);
        let dp8ep = Layout::new(8, 1, true);
        check_ok("2P_TP8:1D_DP8EP", &[tp8, tp8], &[dp8ep], "2P_TP8:1D_DP8EP");
        check_ok("1P_TP4:1D_TP8", &[Layout::tp(4)], &[tp8], "1P_TP4:1D_TP8");
        check_ok("2P_DP4TP2:1D_TP8", &[Layout::new(4, 2, false); 2], &[tp8], "2P_DP4TP2:1D_TP8");
        check_ok("1P_DP8:1D_TP8", &[Layout::new(8, 1, false)], &[tp8], "1P_DP8:1D_TP8");
        check_ok("1P_TP4+1P_TP8:1D_TP8", &[Layout::tp(4), tp8], &[tp8], "1P_TP4+1P_TP8:1D_TP8");
        check_ok("1P_DP4TP2EP:1D_TP1", &[Layout::new(4, 2, true)], &[Layout::tp(1)], "1P_DP4TP2EP:1D_TP1");
        check_ok("2P_TP8:3D_DP8EP", &[tp8, tp8], &[dp8ep; 3], "2P_TP8:3D_DP8EP");
        // Lower case and component order are accepted; output is canonical.
        check_ok("1p_tp2dp4:1d_tp8", &[Layout::new(4, 2, false)], &[tp8], "1P_DP4TP2:1D_TP8");
        check_ok("1P_TP8+1P_TP8:1D_TP8", &[tp8, tp8], &[tp8], "2P_TP8:1D_TP8");
    }

    fn check_err(input: &str, token: &str, column: usize, expected_part: &str) {
        let e = Deployment::parse(input).expect_err(input);
        assert_eq!(e.token, token, "{input}: {e}");
        assert_eq!(e.column, column, "{input}: {e}");
        assert!(e.expected.contains(expected_part), "{input}: {e}");
        let shown = e.to_string();
        assert!(shown.contains(&format!("{token:?}")), "{shown}");
    }

    #[test]
    fn malformed_notation_names_the_bad_token() {
        check_err("", "", 1, "a deployment like");
        check_err("2P_TP8", "2P_TP8", 1, "':' between the prefill and decode sides");
        check_err("2P_TP8-1D_DP8EP", "2P_TP8-1D_DP8EP", 1, "file names use '-'");
        check_err("2P_TP8:1D_TP8:1D_TP8", ":", 14, "exactly one ':'");
        check_err(":1D_TP8", "", 1, "prefill engines like 2P_TP8");
        check_err("2P_TP8:", "", 8, "decode engines like 1D_DP8EP");
        check_err("P_TP8:1D_TP8", "P", 1, "engine count");
        check_err("0P_TP8:1D_TP8", "0", 1, "at least 1");
        check_err("65P_TP8:1D_TP8", "65", 1, "at most 64");
        check_err("2X_TP8:1D_TP8", "X", 2, "P (prefill) or D (decode)");
        check_err("2D_TP8:1D_TP8", "2D", 1, "prefill engines (P) left of ':'");
        check_err("2P_TP8:1P_TP8", "1P", 8, "decode engines (D) right of ':'");
        check_err("2PTP8:1D_TP8", "T", 3, "'_' between 2P and the layout");
        check_err("2P_:1D_TP8", "", 4, "a layout like TP8");
        check_err("2P_XP8:1D_TP8", "XP8", 4, "a layout like TP8");
        check_err("2P_TP:1D_TP8", "TP", 4, "a size after TP");
        check_err("2P_TP0:1D_TP8", "TP0", 4, "at least 1");
        check_err("2P_TP512:1D_TP8", "TP512", 4, "at most 256");
        check_err("2P_TP99999999999:1D_TP8", "TP99999999999", 4, "at most 256");
        check_err("2P_TP8TP4:1D_TP8", "TP4", 7, "at most once");
        check_err("2P_TP8:1D_DP8EPEP", "EP", 16, "at most once");
        check_err("2P_TP8:1D_DP8EP4", "EP4", 14, "EP without a size");
        check_err("2P_TP1EP:1D_TP8", "TP1EP", 4, "more than one rank");
        check_err("2P_EP:1D_TP8", "EP", 4, "DP<n> or TP<n> before EP");
        check_err("2P_TP8+:1D_TP8", "", 8, "empty group");
        check_err("2P_TP8:1D_TP8+1P_TP8", "1P", 15, "decode engines (D)");
        check_err("2P_TP8: 1D_TP8", " ", 8, "no spaces");
        check_err("2P_TP8:1D_TP8x", "x", 14, "a layout like");
        check_err("64P_DP8TP8+1P_TP8:1D_TP8", "1P_TP8", 12, "at most 64 engines");
        check_err("32P_DP16TP16:1D_TP8", "32P_DP16TP16", 1, "at most 4096 GPUs");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Any string either parses or gets an error pointing inside (or just past) the input.
        #[test]
        fn any_string_parses_or_names_a_token(input in "\\PC{0,24}|[0-9PDTEpdte_:+ \u{3000}]{0,24}") {
            if let Err(e) = Deployment::parse(&input) {
                proptest::prop_assert!(e.column <= input.chars().count() + 1, "{}", e);
                proptest::prop_assert!(input.contains(&e.token), "{}", e);
            }
        }

        /// Canonical notation parses back to the same deployment.
        #[test]
        fn notation_round_trips(
            prefill in proptest::collection::vec((1u16..=8, 1u16..=8, proptest::bool::ANY), 1..4),
            decode in proptest::collection::vec((1u16..=8, 1u16..=8, proptest::bool::ANY), 1..4),
        ) {
            let layout = |(dp, tp, ep): (u16, u16, bool)| Layout::new(dp, tp, ep && dp * tp > 1);
            let d = Deployment {
                prefill: prefill.into_iter().map(layout).collect(),
                decode: decode.into_iter().map(layout).collect(),
                model: ModelSpec::default(),
            };
            proptest::prop_assert_eq!(Deployment::parse(&d.notation()), Ok(d));
        }
    }

    #[test]
    fn ranks_are_in_engine_dp_tp_order() {
        let d = Deployment::parse("1P_DP2TP2+1P_TP2:1D_TP1").unwrap();
        let ranks = d.ranks(Role::Prefill);
        let shown: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            shown,
            ["P0.dp0.tp0", "P0.dp0.tp1", "P0.dp1.tp0", "P0.dp1.tp1", "P1.dp0.tp0", "P1.dp0.tp1"]
        );
        for (i, rank) in ranks.iter().enumerate() {
            assert_eq!(d.rank_index(*rank), i);
        }
    }

    #[test]
    fn bytes_per_rank_split_heads_then_replicate() {
        let mla = ModelSpec::deepseek_r1();
        assert_eq!(mla.bytes_per_token_per_layer_per_rank(8), 1152);
        let gqa = ModelSpec::gqa(8);
        assert_eq!(gqa.bytes_per_token_per_layer_per_rank(1), 4096);
        assert_eq!(gqa.bytes_per_token_per_layer_per_rank(4), 1024);
        assert_eq!(gqa.bytes_per_token_per_layer_per_rank(8), 512);
        assert_eq!(gqa.bytes_per_token_per_layer_per_rank(16), 512);
    }
}
