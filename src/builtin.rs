//! The scenarios built into the binary (the files under `scenarios/` at build time).

use pdkv_sim::scenario::Scenario;

include!(concat!(env!("OUT_DIR"), "/scenarios.rs"));

/// Parses the built-in scenario `name` (file name without `.ron`), if there is one.
pub fn find(name: &str) -> Option<Result<Scenario, String>> {
    let (stem, text) = BUILT_IN.iter().find(|(stem, _)| *stem == name)?;
    let origin = format!("scenarios/{stem}.ron (built in)");
    Some(pdkv_sim::load::parse_scenario(text, &origin).map_err(|e| e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_core::topology::Deployment;
    use pdkv_sim::RunIdentity;

    /// No built-in scenario records the `scenario` or the label of a notation's run, so `pdkv run
    /// 2P_TP8-1D_DP8EP` (the built-in file) and `pdkv run 2P_TP8:1D_DP8EP` (the notation, another
    /// workload) never read as one run. A notation's scenario is named by the notation, which
    /// parses as one; no built-in's name or file name does, so none equals the name of any
    /// notation's run. And for each built-in's own deployment typed as a notation, the name and
    /// the label differ from the built-in's, and the notation finds no built-in.
    #[test]
    fn no_built_in_shares_a_name_or_label_with_a_notation_run() {
        assert!(BUILT_IN.len() >= 50, "{} built-ins", BUILT_IN.len());
        for (stem, _) in BUILT_IN {
            let builtin = match find(stem) {
                Some(Ok(scenario)) => scenario,
                other => panic!("{stem}: {other:?}"),
            };
            for name in [*stem, builtin.name.as_str()] {
                assert!(Deployment::parse(name).is_err(), "{stem}: its name `{name}` is a notation");
            }
            let notation = Scenario::from_notation(&builtin.deployment);
            assert_eq!(notation.name, builtin.deployment, "{stem}");
            assert!(notation.name != builtin.name && notation.name != *stem, "{stem}");
            let notation_run = RunIdentity::new(&notation, &notation, Some(&builtin.deployment));
            assert_ne!(RunIdentity::of_scenario(&builtin).label(), notation_run.label(), "{stem}");
            assert!(find(&builtin.deployment).is_none(), "{stem}");
        }
    }
}
