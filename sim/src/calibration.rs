//! The calibration record, `profiles/calibration.ron`: which calibration the cost model's
//! constants come from, how closely it fits the points it was fitted on and, once measured, how
//! far its predictions fall from held-out points (docs/calibration.md). Reports name it next to
//! their figures, so nobody reads a difference finer than the model can tell.
//!
//! The record also says which profiles the fitting points ran on (`covers`): a run on a GPU,
//! NIC, model or serving stack outside them is an extrapolation, and [`coverage`] names what
//! is outside so `pdkv run` and `pdkv sweep` can warn.
//!
//! The file is embedded in the binary, so the record is the same from any working directory.
//! `cargo xtask calibrate` produces its numbers; the file records them.

use serde::{Deserialize, Serialize};

use crate::scenario::Scenario;

/// The record's file, relative to the repository root.
pub const FILE: &str = "profiles/calibration.ron";

/// The record's text as built into the binary.
const TEXT: &str = include_str!("../../profiles/calibration.ron");

/// One calibration of the cost model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// The calibration's name, e.g. `study-tp8-2026-12`.
    pub name: String,
    /// One line: the points the constants were fitted on.
    pub fitted_on: String,
    /// Worst relative error over the fitting points, a fraction (0.164 is 16.4 %).
    pub fitting_error_max: f64,
    /// The error on held-out points; `None` until they have been simulated.
    pub validation: Option<Validation>,
    /// The profiles the fitting points ran on.
    pub covers: Covers,
}

/// The profiles a calibration's fitting points ran on, by kind. A scenario that names no
/// profile of a kind uses the built-in defaults, which are the fitting points' own
/// (`default_is`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Covers {
    /// GPU profiles.
    pub gpu: Vec<String>,
    /// NIC profiles.
    pub nic: Vec<String>,
    /// Model profiles.
    pub model: Vec<String>,
    /// Serving stacks (the engine software whose kernels and overlap the constants describe).
    pub stack: Vec<String>,
}

/// One profile a run uses that its calibration was not fitted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uncovered {
    /// Which kind of profile: `gpu`, `nic`, `model` or `stack`.
    pub kind: &'static str,
    /// The profile's name.
    pub name: String,
}

/// The profiles one run uses, by kind; `None` where it names none (the built-in defaults).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Combination<'a> {
    /// GPU profile.
    pub gpu: Option<&'a str>,
    /// NIC profile.
    pub nic: Option<&'a str>,
    /// Model profile.
    pub model: Option<&'a str>,
    /// Serving stack.
    pub stack: Option<&'a str>,
}

impl<'a> Combination<'a> {
    /// The profiles `scenario` names, and its serving stack.
    pub fn of(scenario: &'a Scenario) -> Combination<'a> {
        let p = &scenario.profiles;
        Combination {
            gpu: p.gpu.as_deref(),
            nic: p.nic.as_deref(),
            model: p.model.as_deref(),
            stack: Some(scenario.engines.stack.as_str()),
        }
    }
}

/// How far a calibration's predictions fall from held-out points it was not fitted on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Validation {
    /// Held-out points simulated.
    pub points: u32,
    /// Independent sources those points come from.
    pub sources: u32,
    /// Median relative error over those points, a fraction.
    pub median_abs_error: f64,
    /// Largest relative error over those points, a fraction.
    pub max_abs_error: f64,
}

/// The calibration built into this binary.
pub fn current() -> Calibration {
    // The text is part of the binary and a unit test parses it, so a failure here is a build
    // that skipped the tests, not bad input.
    parse(TEXT).unwrap_or_else(|e| panic!("{FILE} does not parse: {e}"))
}

fn parse(text: &str) -> Result<Calibration, ron::error::SpannedError> {
    ron::Options::default().from_str(text)
}

/// What `scenario` uses that the built-in calibration was not fitted on (empty when covered).
pub fn coverage(scenario: &Scenario) -> Vec<Uncovered> {
    current().coverage(Combination::of(scenario))
}

/// The built-in calibration's median |error| over its held-out points, a fraction; `None`
/// until measured.
pub fn validation_median() -> Option<f64> {
    current().validation.map(|v| v.median_abs_error)
}

/// A fraction as a percentage with one decimal: `16.4 %`.
pub fn percent(fraction: f64) -> String {
    format!("{:.1} %", 100.0 * fraction)
}

/// `n` and its noun, singular or plural: `1 source`, `3 sources`.
fn count(n: u32, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

impl Calibration {
    /// What `used` names that this calibration's fitting points did not run on, in the order
    /// gpu, nic, model, stack. A kind left at the built-in defaults is covered: the defaults
    /// are the fitting points' profiles.
    pub fn coverage(&self, used: Combination) -> Vec<Uncovered> {
        let kinds = [
            ("gpu", used.gpu, &self.covers.gpu),
            ("nic", used.nic, &self.covers.nic),
            ("model", used.model, &self.covers.model),
            ("stack", used.stack, &self.covers.stack),
        ];
        kinds
            .into_iter()
            .filter_map(|(kind, name, covered)| {
                let name = name?;
                (!covered.iter().any(|c| c == name)).then(|| Uncovered { kind, name: name.to_string() })
            })
            .collect()
    }

    /// The warning for a run that uses `uncovered` (empty: none), one line naming each profile
    /// outside the calibration and the validation error to read its figures with.
    pub fn coverage_warning(&self, uncovered: &[Uncovered]) -> Option<String> {
        if uncovered.is_empty() {
            return None;
        }
        let names: Vec<String> = uncovered.iter().map(|u| format!("{} {}", u.kind, u.name)).collect();
        let error = match &self.validation {
            Some(v) => format!(
                "held-out median |error| {}, worst {}",
                percent(v.median_abs_error),
                percent(v.max_abs_error)
            ),
            None => "validation not yet measured".to_string(),
        };
        Some(format!(
            "WARNING: calibration {} was not fitted on {}: its figures there are an extrapolation ({error}; docs/calibration.md)",
            self.name,
            names.join(", ")
        ))
    }

    /// One line for reports: the name, the fitting error and the validation error, or that the
    /// validation error is not yet measured.
    pub fn summary(&self) -> String {
        let validation = match &self.validation {
            Some(v) => format!(
                "validation median |error| {} over {} from {}",
                percent(v.median_abs_error),
                count(v.points, "held-out point", "held-out points"),
                count(v.sources, "source", "sources")
            ),
            None => "validation not yet measured".to_string(),
        };
        format!(
            "calibration {}: fitting worst {} ({}); {validation} (docs/calibration.md)",
            self.name,
            percent(self.fitting_error_max),
            self.fitted_on
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_record_parses_and_is_sane() {
        let c = parse(TEXT).expect("profiles/calibration.ron parses");
        assert_eq!(c, current());
        assert!(!c.name.is_empty() && !c.fitted_on.is_empty());
        let mut fractions = vec![c.fitting_error_max];
        if let Some(v) = c.validation {
            assert!(v.points >= 1 && v.sources >= 1 && v.sources <= v.points, "{v:?}");
            assert!(v.median_abs_error <= v.max_abs_error, "{v:?}");
            fractions.extend([v.median_abs_error, v.max_abs_error]);
        }
        for f in fractions {
            assert!(f.is_finite() && f >= 0.0, "{c:?}");
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text = TEXT.replacen("fitting_error_max:", "fitting_error_worst:", 1);
        let err = parse(&text).expect_err("an unknown field is refused");
        assert!(err.to_string().contains("fitting_error_worst"), "{err}");
    }

    fn covers() -> Covers {
        Covers {
            gpu: vec!["mi300x".into()],
            nic: vec!["thor2-400g".into()],
            model: vec!["deepseek-r1".into()],
            stack: vec!["vllm".into()],
        }
    }

    #[test]
    fn coverage_table() {
        let c = Calibration {
            name: "c".into(),
            fitted_on: "f".into(),
            fitting_error_max: 0.1,
            validation: Some(Validation { points: 2, sources: 1, median_abs_error: 0.3, max_abs_error: 0.5 }),
            covers: covers(),
        };
        let check = |used: Combination, expected: &[(&str, &str)], warning: Option<&str>| {
            let got = c.coverage(used);
            let got_pairs: Vec<(&str, &str)> = got.iter().map(|u| (u.kind, u.name.as_str())).collect();
            assert_eq!(got_pairs, expected, "{used:?}");
            assert_eq!(c.coverage_warning(&got).as_deref(), warning, "{used:?}");
        };
        check(Combination::default(), &[], None);
        check(
            Combination { gpu: Some("mi300x"), model: Some("deepseek-r1"), ..Combination::default() },
            &[],
            None,
        );
        check(
            Combination { gpu: Some("h100-sxm"), nic: Some("cx7-400g"), ..Combination::default() },
            &[("gpu", "h100-sxm"), ("nic", "cx7-400g")],
            Some(
                "WARNING: calibration c was not fitted on gpu h100-sxm, nic cx7-400g: its figures there are an \
                 extrapolation (held-out median |error| 30.0 %, worst 50.0 %; docs/calibration.md)",
            ),
        );
        check(
            Combination { model: Some("qwen3-235b-a22b"), stack: Some("sglang"), ..Combination::default() },
            &[("model", "qwen3-235b-a22b"), ("stack", "sglang")],
            Some(
                "WARNING: calibration c was not fitted on model qwen3-235b-a22b, stack sglang: its figures there \
                 are an extrapolation (held-out median |error| 30.0 %, worst 50.0 %; docs/calibration.md)",
            ),
        );
    }

    #[test]
    fn the_record_covers_profiles_that_exist() {
        let c = current();
        let lists = [(&c.covers.gpu, "gpu"), (&c.covers.nic, "nic"), (&c.covers.model, "model")];
        for (names, kind) in lists {
            assert!(!names.is_empty(), "{kind}");
            for name in names {
                use crate::profiles::{find, Gpu, Model, Nic};
                let known = match kind {
                    "gpu" => find::<Gpu>(name).is_ok(),
                    "nic" => find::<Nic>(name).is_ok(),
                    _ => find::<Model>(name).is_ok(),
                };
                assert!(known, "covers.{kind} names {name}, which is no profile");
            }
        }
        for name in &c.covers.stack {
            assert!(crate::stack::find(name).is_some(), "covers.stack names {name}, which is no stack");
        }
        assert!(c.covers.stack.iter().any(|s| s == crate::stack::DEFAULT), "the default stack is covered");
        assert_eq!(validation_median(), c.validation.map(|v| v.median_abs_error));
    }

    #[test]
    fn summary_table() {
        let check = |validation: Option<Validation>, expected: &str| {
            let c = Calibration {
                name: "study-tp8-2026-12".into(),
                fitted_on: "2P_TP8:1D_TP8 on MI300X".into(),
                fitting_error_max: 0.164,
                validation,
                covers: covers(),
            };
            assert_eq!(c.summary(), expected);
        };
        check(
            None,
            "calibration study-tp8-2026-12: fitting worst 16.4 % (2P_TP8:1D_TP8 on MI300X); \
             validation not yet measured (docs/calibration.md)",
        );
        check(
            Some(Validation { points: 8, sources: 3, median_abs_error: 0.23, max_abs_error: 0.41 }),
            "calibration study-tp8-2026-12: fitting worst 16.4 % (2P_TP8:1D_TP8 on MI300X); \
             validation median |error| 23.0 % over 8 held-out points from 3 sources (docs/calibration.md)",
        );
        check(
            Some(Validation { points: 1, sources: 1, median_abs_error: 0.0456, max_abs_error: 0.0456 }),
            "calibration study-tp8-2026-12: fitting worst 16.4 % (2P_TP8:1D_TP8 on MI300X); \
             validation median |error| 4.6 % over 1 held-out point from 1 source (docs/calibration.md)",
        );
    }
}
