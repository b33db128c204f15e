//! The calibration record, `profiles/calibration.ron`: which calibration the cost model's
//! constants come from, how closely it fits the points it was fitted on and, once measured, how
//! far its predictions fall from held-out points (docs/calibration.md). Reports name it next to
//! their figures, so nobody reads a difference finer than the model can tell.
//!
//! The file is embedded in the binary, so the record is the same from any working directory.
//! `cargo xtask calibrate` produces its numbers; the file records them.

use serde::{Deserialize, Serialize};

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

/// A fraction as a percentage with one decimal: `16.4 %`.
pub fn percent(fraction: f64) -> String {
    format!("{:.1} %", 100.0 * fraction)
}

/// `n` and its noun, singular or plural: `1 source`, `3 sources`.
fn count(n: u32, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

impl Calibration {
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

    #[test]
    fn summary_table() {
        let check = |validation: Option<Validation>, expected: &str| {
            let c = Calibration {
                name: "study-tp8-2026-12".into(),
                fitted_on: "2P_TP8:1D_TP8 on MI300X".into(),
                fitting_error_max: 0.164,
                validation,
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
