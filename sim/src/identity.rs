//! A run's identity: what tells it apart from other runs, as a label for titles and a slug for
//! its output folder.
//!
//! Two runs of one deployment can differ in their scenario, workload, seed and legacy options.
//! A report that names only the scenario makes them overwrite each other and look alike, so
//! every command that writes or shows a run (`pdkv run`, `replay`, `sweep`, the gallery) names
//! it with [`RunIdentity`]. The identity is a pure function of what ran, so the same run always
//! gets the same label and folder, and two runs that differ get different ones.

use pdkv_core::legacy::Legacy;

use crate::scenario::{Clients, Length, Scenario, Workload};

/// What makes a run different from the plain run of its scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct RunIdentity {
    /// The scenario's name, or the deployment notation as the user typed it.
    pub base: String,
    /// The workload, e.g. `C128 x1280 8K/1K`: shown when the command line changed it, and always
    /// for a bare notation (its default workload is not written anywhere else).
    pub workload: Option<String>,
    /// The seed, when it is not the scenario's own.
    pub seed: Option<u64>,
    /// Legacy options the command line added to the scenario's own, in the order given.
    pub legacy: Vec<Legacy>,
}

/// Longest slug, in bytes: well under the 255 bytes of a file name on common file systems, and
/// short enough to read in a listing.
pub const MAX_SLUG_BYTES: usize = 120;

impl RunIdentity {
    /// The identity of `run`, which is `base` (as loaded) after the command line's overrides;
    /// `notation` is the deployment notation as typed when `base` was built from one
    /// ([`Scenario::from_notation`]), `None` for a scenario file or a built-in scenario.
    pub fn new(base: &Scenario, run: &Scenario, notation: Option<&str>) -> RunIdentity {
        let workload_changed = run.workload != base.workload;
        RunIdentity {
            base: notation.map_or_else(|| base.name.clone(), str::to_string),
            workload: (notation.is_some() || workload_changed).then(|| workload_text(&run.workload)),
            seed: (run.seed != base.seed).then_some(run.seed),
            legacy: run
                .protocol
                .legacy
                .iter()
                .copied()
                .filter(|option| !base.protocol.legacy.contains(option))
                .collect(),
        }
    }

    /// The identity of a scenario run as it is: its name alone.
    pub fn of_scenario(scenario: &Scenario) -> RunIdentity {
        RunIdentity::new(scenario, scenario, None)
    }

    /// The label for titles, parts separated by commas, e.g.
    /// `2P_TP8:1D_DP8EP, C128 x1280 8K/1K, seed 7, legacy no-flexible-reads`.
    pub fn label(&self) -> String {
        let mut parts = vec![self.base.clone()];
        parts.extend(self.workload.clone());
        parts.extend(self.seed.map(|seed| format!("seed {seed}")));
        if !self.legacy.is_empty() {
            let names: Vec<&str> = self.legacy.iter().map(|option| option.name()).collect();
            parts.push(format!("legacy {}", names.join("+")));
        }
        parts.join(", ")
    }

    /// The folder name for this run: [`slug`] of the label.
    pub fn slug(&self) -> String {
        slug(&self.label())
    }
}

/// A workload in a few characters: `C128 x1280 8K/1K` (closed loop: clients, requests, prompt
/// and output lengths) or `open 2.5/s x100 8K/1K` (Poisson arrivals per second); a uniform
/// length shows as `1K-8K`.
pub fn workload_text(workload: &Workload) -> String {
    let lengths = format!("{}/{}", length_text(workload.input_tokens), length_text(workload.output_tokens));
    match workload.clients {
        Clients::Closed { concurrency, requests } => format!("C{concurrency} x{requests} {lengths}"),
        Clients::Open { rate_per_s, requests } => format!("open {rate_per_s}/s x{requests} {lengths}"),
    }
}

fn length_text(length: Length) -> String {
    let tokens =
        |n: u32| if n >= 1024 && n.is_multiple_of(1024) { format!("{}K", n / 1024) } else { n.to_string() };
    match length {
        Length::Fixed(n) => tokens(n),
        Length::Uniform { min, max } => format!("{}-{}", tokens(min), tokens(max)),
    }
}

/// A file-system-safe folder name made from `label`: `, ` becomes `_`; letters, digits, `.`,
/// `_`, `-` and `+` stay; anything else (spaces, `:`, `/`, ...) becomes `-`; runs of `-` shrink
/// to one. It never starts with `.` or `-` (so it is neither hidden, nor `..`, nor read as a
/// flag), is never empty, and is at most [`MAX_SLUG_BYTES`] long: a longer one is cut and ends
/// with a hash of the whole label, so labels that share a long beginning stay apart.
pub fn slug(label: &str) -> String {
    let mut out = String::with_capacity(label.len());
    for part in label.split(", ") {
        if !out.is_empty() {
            out.push('_');
        }
        for c in part.chars() {
            let keep = c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+');
            let c = if keep { c } else { '-' };
            if !(c == '-' && out.ends_with('-')) {
                out.push(c);
            }
        }
    }
    let out = out.trim_start_matches(['.', '-']).trim_end_matches('-');
    let mut out = if out.is_empty() { "run".to_string() } else { out.to_string() };
    if out.len() > MAX_SLUG_BYTES {
        // Only ASCII is kept above, so any byte index is a character boundary.
        out.truncate(MAX_SLUG_BYTES - 9);
        out = format!("{}-{:08x}", out.trim_end_matches('-'), fnv1a(label));
    }
    out
}

/// The 32-bit FNV-1a hash: tiny, stable across platforms and versions (unlike std's hasher).
fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Command-line changes to a scenario, as `pdkv run` applies them.
    #[derive(Default)]
    struct Flags {
        seed: Option<u64>,
        legacy: Vec<Legacy>,
        clients: Option<Clients>,
    }

    fn builtin(name: &str) -> Scenario {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios").join(name);
        crate::load::load_scenario(&path).unwrap()
    }

    #[test]
    fn identity_table() {
        // (base scenario, notation as typed, flags) -> (label, slug)
        let check = |base: Scenario, notation: Option<&str>, flags: Flags, expected: (&str, &str)| {
            let mut run = base.clone();
            if let Some(seed) = flags.seed {
                run.seed = seed;
            }
            for option in flags.legacy {
                if !run.protocol.legacy.contains(&option) {
                    run.protocol.legacy.push(option);
                }
            }
            if let Some(clients) = flags.clients {
                run.workload.clients = clients;
            }
            let id = RunIdentity::new(&base, &run, notation);
            assert_eq!((id.label().as_str(), id.slug().as_str()), expected, "{notation:?} {}", base.name);
        };
        let notation = |n: &str| Scenario::from_notation(n);
        let closed = |concurrency, requests| Some(Clients::Closed { concurrency, requests });
        let n = "2P_TP8:1D_DP8EP";
        check(
            notation(n),
            Some(n),
            Flags::default(),
            ("2P_TP8:1D_DP8EP, C128 x1280 8K/1K", "2P_TP8-1D_DP8EP_C128-x1280-8K-1K"),
        );
        check(
            notation(n),
            Some(n),
            Flags { legacy: vec![Legacy::NoFlexibleReads], ..Flags::default() },
            (
                "2P_TP8:1D_DP8EP, C128 x1280 8K/1K, legacy no-flexible-reads",
                "2P_TP8-1D_DP8EP_C128-x1280-8K-1K_legacy-no-flexible-reads",
            ),
        );
        check(
            notation(n),
            Some(n),
            Flags { clients: closed(32, 320), ..Flags::default() },
            ("2P_TP8:1D_DP8EP, C32 x320 8K/1K", "2P_TP8-1D_DP8EP_C32-x320-8K-1K"),
        );
        check(
            notation(n),
            Some(n),
            Flags {
                seed: Some(7),
                legacy: vec![Legacy::ProxyAliasing, Legacy::DedupReleases],
                ..Flags::default()
            },
            (
                "2P_TP8:1D_DP8EP, C128 x1280 8K/1K, seed 7, legacy proxy-aliasing+dedup-releases",
                "2P_TP8-1D_DP8EP_C128-x1280-8K-1K_seed-7_legacy-proxy-aliasing+dedup-releases",
            ),
        );
        // The built-in scenario of the same deployment is another run, with another folder.
        check(builtin("2P_TP8-1D_DP8EP.ron"), None, Flags::default(), ("2P_TP8-1D_DP8EP", "2P_TP8-1D_DP8EP"));
        check(
            builtin("2P_TP8-1D_DP8EP.ron"),
            None,
            Flags { clients: closed(32, 320), ..Flags::default() },
            ("2P_TP8-1D_DP8EP, C32 x320 2K/32", "2P_TP8-1D_DP8EP_C32-x320-2K-32"),
        );
        // Flags that change nothing leave the identity alone: the same run, the same folder.
        check(
            builtin("notify-drift.ron"),
            None,
            Flags { seed: Some(0), legacy: vec![Legacy::NotifyOtherRank], clients: None },
            ("notify-drift", "notify-drift"),
        );
        check(
            builtin("notify-drift.ron"),
            None,
            Flags { seed: Some(7), ..Flags::default() },
            ("notify-drift, seed 7", "notify-drift_seed-7"),
        );
        let mut open = notation("1P_TP8:1D_TP8");
        open.workload.clients = Clients::Open { rate_per_s: 2.5, requests: 100 };
        open.workload.input_tokens = Length::Uniform { min: 1024, max: 8192 };
        open.workload.output_tokens = Length::Fixed(1000);
        check(
            open,
            Some("1P_TP8:1D_TP8"),
            Flags::default(),
            ("1P_TP8:1D_TP8, open 2.5/s x100 1K-8K/1000", "1P_TP8-1D_TP8_open-2.5-s-x100-1K-8K-1000"),
        );
    }

    #[test]
    fn slug_table() {
        let check = |label: &str, expected: &str| assert_eq!(slug(label), expected, "{label}");
        check("proxy-aliasing", "proxy-aliasing");
        check("1P_TP4+1P_TP8:1D_TP8", "1P_TP4+1P_TP8-1D_TP8");
        check("my run: v2 / test", "my-run-v2-test");
        check("..", "run");
        check(".hidden", "hidden");
        check("--flag", "flag");
        check("", "run");
        check("é ü", "run");
        check("a,b, c", "a-b_c");
        let long = "x".repeat(200);
        let cut = slug(&long);
        assert_eq!(cut.len(), MAX_SLUG_BYTES);
        assert!(cut.starts_with("xxx") && cut != slug(&format!("{long}y")), "{cut}");
        assert_eq!(cut, slug(&long), "deterministic");
    }

    #[test]
    fn a_scenario_run_as_it_is_is_named_by_its_name() {
        let s = builtin("proxy-aliasing.ron");
        assert_eq!(RunIdentity::of_scenario(&s).label(), "proxy-aliasing");
    }
}
