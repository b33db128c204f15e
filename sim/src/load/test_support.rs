//! Helpers the loader's test tables share: the error variants by name, one-line scenarios, and
//! the check that a text fails with a given variant, field and words.

use super::{parse_scenario, ScenarioError};

/// The error variants, without their data, so tables can name the one they expect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Io,
    Syntax,
    UnknownField,
    MissingField,
    WrongType,
    UnknownVariant,
    Invalid,
    Profile,
}

pub(super) fn kind(err: &ScenarioError) -> Kind {
    match err {
        ScenarioError::Io { .. } => Kind::Io,
        ScenarioError::Syntax { .. } => Kind::Syntax,
        ScenarioError::UnknownField { .. } => Kind::UnknownField,
        ScenarioError::MissingField { .. } => Kind::MissingField,
        ScenarioError::WrongType { .. } => Kind::WrongType,
        ScenarioError::UnknownVariant { .. } => Kind::UnknownVariant,
        ScenarioError::Invalid { .. } => Kind::Invalid,
        ScenarioError::Profile { .. } => Kind::Profile,
    }
}

/// A one-line scenario with the given extra fields.
pub(super) fn with(fields: &str) -> String {
    format!("(name: \"x\", deployment: \"1P_TP8:1D_TP8\", {fields})")
}

/// Parses `text` and checks the error's variant, field and words.
pub(super) fn check_err(text: &str, expected: (Kind, &str, &str)) {
    let (want_kind, field, says) = expected;
    let err = match parse_scenario(text, "<table>") {
        Ok(scenario) => panic!("{text}: parsed {scenario:?}"),
        Err(err) => err,
    };
    let shown = err.to_string();
    assert_eq!((kind(&err), err.field()), (want_kind, Some(field)), "{text}: {shown}");
    assert!(shown.contains(says), "{text}: {shown}");
    assert!(shown.starts_with("<table>:"), "{text}: {shown}");
}

/// A one-line scenario whose fault timeline holds one fault on `target`.
pub(super) fn fault(target: &str, fault: &str) -> String {
    with(&format!("faults: (timeline: [(at_ms: 0, target: \"{target}\", fault: {fault})])"))
}
