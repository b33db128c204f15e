//! The scenarios built into the binary (the files under `scenarios/` at build time).

use pdkv_sim::scenario::Scenario;

include!(concat!(env!("OUT_DIR"), "/scenarios.rs"));

/// Parses the built-in scenario `name` (file name without `.ron`), if there is one.
pub fn find(name: &str) -> Option<Result<Scenario, String>> {
    let (stem, text) = BUILT_IN.iter().find(|(stem, _)| *stem == name)?;
    let origin = format!("scenarios/{stem}.ron (built in)");
    Some(pdkv_sim::load::parse_scenario(text, &origin).map_err(|e| e.to_string()))
}
