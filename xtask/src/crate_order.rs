//! The tidy rule on the order of the workspace's crates: each crate may depend only on crates of
//! a lower layer (core, then the engine layer, then the two drivers, then what presents them),
//! so the production connector never links the simulator and the core never links anything of
//! ours.

use std::fs;
use std::path::Path;

/// The layers, lowest first; a crate may depend on crates of lower layers only. A workspace
/// crate missing here is a problem, so a new crate has to be placed before it can be used.
pub const LAYERS: [&[&str]; 5] = [
    &["pdkv-core"],
    &["pdkv-engine"],
    // The two drivers of the engine layer: neither may link the other (the connector stands
    // alone, and the simulator owes nothing to sockets).
    &["pdkv-sim", "pdkv-rdma"],
    &["pdkv-reports", "pdkv-campaign", "pdkv-python"],
    &["pdkv", "xtask"],
];

/// Dependencies the layers would allow but which must never be: `(crate, dependency, why)`.
pub const NEVER: &[(&str, &str, &str)] = &[(
    "pdkv-python",
    "pdkv-sim",
    "the vLLM plugin runs the connector in production and must not link the simulator",
)];

fn layer(name: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&name))
}

/// The package name of a manifest and the `pdkv-*` crates it depends on (normal, dev and build
/// dependencies, target-specific ones included), as `(section, dependency)`.
fn manifest(text: &str) -> (Option<String>, Vec<(String, String)>) {
    let (mut section, mut name, mut deps) = (String::new(), None, Vec::new());
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let key = key.trim();
        if section == "package" && key == "name" {
            name = Some(value.trim().trim_matches('"').to_string());
        }
        let dependencies = section.ends_with("dependencies") && !section.starts_with("workspace");
        let crate_name = key.split('.').next().unwrap_or(key).trim_matches('"');
        if dependencies && (crate_name.starts_with("pdkv") || crate_name == "xtask") {
            deps.push((section.clone(), crate_name.to_string()));
        }
    }
    (name, deps)
}

/// The problems of one manifest (`rel` names it in messages).
pub fn check_manifest(rel: &Path, text: &str) -> Vec<String> {
    let shown = rel.display();
    let (Some(name), deps) = manifest(text) else { return Vec::new() };
    let Some(own) = layer(&name) else {
        return vec![format!(
            "{shown}: crate `{name}` has no place in xtask's crate layers (crate_order::LAYERS)"
        )];
    };
    deps.into_iter()
        .filter_map(|(section, dep)| match layer(&dep) {
            None => Some(format!("{shown}: [{section}] `{dep}` has no place in the crate layers")),
            Some(theirs) if theirs >= own => Some(format!(
                "{shown}: [{section}] `{name}` may not depend on `{dep}`: crates depend only on lower \
                 layers ({})",
                order()
            )),
            Some(_) => NEVER
                .iter()
                .find(|(from, to, _)| *from == name && *to == dep)
                .map(|(_, _, why)| format!("{shown}: [{section}] `{name}` may not depend on `{dep}`: {why}")),
        })
        .collect()
}

/// The problems of every manifest under `root` (skipping `target/` and hidden folders).
pub fn check(root: &Path) -> Vec<String> {
    let mut manifests = Vec::new();
    crate::tree::walk(root, &|name| name == "Cargo.toml", &mut manifests);
    manifests.sort();
    let mut problems = Vec::new();
    for path in manifests {
        let rel = path.strip_prefix(root).unwrap_or(&path);
        match fs::read_to_string(&path) {
            Ok(text) => problems.extend(check_manifest(rel, &text)),
            Err(err) => problems.push(format!("{}: cannot be read: {err}", rel.display())),
        }
    }
    problems
}

/// The layers in words, for messages.
fn order() -> String {
    LAYERS.iter().map(|layer| layer.join(", ")).collect::<Vec<_>>().join(" → ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: &[&str]) {
        let problems = check_manifest(Path::new("x/Cargo.toml"), text);
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
        for (problem, words) in problems.iter().zip(expected) {
            assert!(problem.contains(words), "{problem} lacks {words}");
        }
    }

    #[test]
    fn crates_depend_only_on_lower_layers() {
        let rdma = "[package]\nname = \"pdkv-rdma\"\n\n[dependencies]\npdkv-core.workspace = true\n";
        check(rdma, &[]);
        check(&format!("{rdma}pdkv-engine = {{ path = \"../engine\" }}\n"), &[]);
        // The connector linking the simulator, in any section.
        check(&format!("{rdma}pdkv-sim.workspace = true\n"), &["`pdkv-rdma` may not depend on `pdkv-sim`"]);
        check(&format!("{rdma}[dev-dependencies]\npdkv-sim.workspace = true\n"), &["[dev-dependencies]"]);
        check(
            &format!("{rdma}[target.'cfg(unix)'.dependencies]\npdkv-reports = {{ path = \"r\" }}\n"),
            &["may not depend on `pdkv-reports`"],
        );
        check(
            "[package]\nname = \"pdkv-core\"\n[dependencies]\npdkv-engine.workspace = true\n",
            &["pdkv-core"],
        );
        check("[package]\nname = \"pdkv-new\"\n", &["`pdkv-new` has no place"]);
        // The vLLM plugin may use the connector, never the simulator.
        let python = "[package]\nname = \"pdkv-python\"\n[dependencies]\npdkv-rdma.workspace = true\n";
        check(python, &[]);
        check(&format!("{python}pdkv-sim.workspace = true\n"), &["must not link the simulator"]);
        check(
            "[package]\nname = \"pdkv\"\n[dependencies]\npdkv-mystery.workspace = true\n",
            &["`pdkv-mystery`"],
        );
        // The workspace's own table of path dependencies is not a dependency.
        check("[workspace.dependencies]\npdkv-sim = { path = \"sim\" }\n[package]\nname = \"pdkv\"\n", &[]);
    }
}
