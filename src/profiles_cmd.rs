//! `pdkv profiles`: the GPU, NIC and model profiles built into the binary, with their values,
//! and one profile's values each with its public source.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use pdkv_sim::profiles::{all, Gpu, Model, Nic, Profile, ProfileError};

const EXAMPLES: &str = "\
Examples:
  pdkv profiles                    every profile's values, one table per file
  pdkv profiles h200-sxm           each value of one profile with its source
  pdkv run 2P_TP8-1D_DP8EP-h200    a built-in scenario that names profiles

A scenario file names profiles with profiles: (gpu: \"h200-sxm\", nic: \"cx7-400g\", model:
\"deepseek-r1\"), each optional; they fill its hardware and model (docs/sim.md, \"Profiles\").
A value marked * has a source that says UNVERIFIED (no primary text was found; the source says
why and where the value comes from).

Exit codes: 0 printed; 2 no profile has that name (the known names are listed).
141: stdout closed before all was printed (e.g. `| head`), quietly; stdout or a result file
that cannot be written (a full disk): 2, naming it.";

/// List the GPU, NIC and model profiles (profiles/*.ron) a scenario can name.
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ProfilesArgs {
    /// Show this profile's values, each with its source (default: every profile's values).
    name: Option<String>,
}

pub fn run(args: &ProfilesArgs) -> ExitCode {
    let text = match &args.name {
        None => tables(),
        Some(name) => one(name),
    };
    match text {
        Ok(text) => {
            out!("{text}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            errln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

/// A value as the tables show it, with `*` when its source says UNVERIFIED.
fn cell<P: Profile>(profile: &P, field: &str) -> String {
    let value = serde_json::to_value(profile).ok().and_then(|v| v.get(field).cloned()).unwrap_or_default();
    let unverified = profile.sources().get(field).is_some_and(|source| source.starts_with("UNVERIFIED"));
    format!("{value}{}", if unverified { "*" } else { "" })
}

/// The profiles of one file as a table: a row per field, a column per profile.
fn table<P: Profile>(out: &mut String) -> Result<(), ProfileError> {
    let profiles = all::<P>()?;
    let kind = P::KIND;
    let noun = kind.noun();
    let title = format!("{}{} profiles ({})", noun[..1].to_uppercase(), &noun[1..], kind.file());
    let _ = writeln!(out, "{title}");
    let mut rows: Vec<Vec<String>> = vec![std::iter::once("field".to_string())
        .chain(profiles.iter().map(|profile| profile.name().to_string()))
        .collect()];
    for field in P::FIELDS {
        rows.push(
            std::iter::once(field.to_string())
                .chain(profiles.iter().map(|profile| cell(profile, field)))
                .collect(),
        );
    }
    let columns = rows[0].len();
    let widths: Vec<usize> =
        (0..columns).map(|c| rows.iter().map(|row| row[c].chars().count()).max().unwrap_or(0)).collect();
    for row in &rows {
        let line: Vec<String> =
            row.iter().zip(&widths).map(|(text, width)| format!("{text:<width$}")).collect();
        let _ = writeln!(out, "  {}", line.join("  ").trim_end());
    }
    out.push('\n');
    Ok(())
}

fn tables() -> Result<String, String> {
    let mut out = String::new();
    table::<Gpu>(&mut out).map_err(|e| e.to_string())?;
    table::<Nic>(&mut out).map_err(|e| e.to_string())?;
    table::<Model>(&mut out).map_err(|e| e.to_string())?;
    out.push_str(
        "* the source says UNVERIFIED. Each value's source: pdkv profiles NAME. A scenario names\n\
         profiles with profiles: (gpu: \"...\", nic: \"...\", model: \"...\").\n",
    );
    Ok(out)
}

/// The profile `name` of `P`'s kind, each value with its source; `None` when the file has no
/// such profile.
fn describe<P: Profile>(name: &str) -> Result<Option<String>, ProfileError> {
    let Some(profile) = all::<P>()?.into_iter().find(|profile| profile.name() == name) else {
        return Ok(None);
    };
    let kind = P::KIND;
    let mut out = format!("{} profile {name} ({})\n", kind.noun(), kind.file());
    let width = P::FIELDS.iter().map(|field| field.len()).max().unwrap_or(0);
    for field in P::FIELDS {
        let source = profile.sources().get(*field).map_or("", String::as_str);
        let _ = writeln!(out, "  {field:<width$}  {}\n  {:<width$}  {source}", cell(&profile, field), "");
    }
    Ok(Some(out))
}

fn one(name: &str) -> Result<String, String> {
    let found = [describe::<Gpu>(name), describe::<Nic>(name), describe::<Model>(name)];
    let mut known = Vec::new();
    for result in found {
        if let Some(text) = result.map_err(|e| e.to_string())? {
            return Ok(text);
        }
    }
    for names in [names::<Gpu>(), names::<Nic>(), names::<Model>()] {
        known.extend(names.map_err(|e| e.to_string())?);
    }
    Err(format!("no profile is named `{}`; known profiles: {}", name.escape_debug(), known.join(", ")))
}

fn names<P: Profile>() -> Result<Vec<String>, ProfileError> {
    Ok(all::<P>()?.iter().map(|profile| profile.name().to_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (what is asked) -> lines the output must have.
    #[test]
    fn tables_and_one_profile_show_values_and_sources() {
        let check = |text: Result<String, String>, lines: &[&str]| {
            let text = text.unwrap_or_else(|e| panic!("{e}"));
            for line in lines {
                assert!(text.lines().any(|l| l.trim_end() == *line), "{line:?} not in\n{text}");
            }
        };
        check(
            tables(),
            &[
                "GPU profiles (profiles/gpus.ron)",
                "  field          mi300x  mi355x  h100-sxm  h200-sxm  b200    h800",
                "  hbm_gb         192.0   288.0   80.0      141.0     180.0   80.0",
                "  fabric_gb_s    448.0   537.6*  450.0     450.0     900.0   200.0",
                "NIC profiles (profiles/nics.ron)",
                "  nic_qp_message_rate_mpps  1.09*     1.09*     1.09*        1.09",
                "Model profiles (profiles/models.ron)",
            ],
        );
        check(
            one("cx8-800g"),
            &[
                "NIC profile cx8-800g (profiles/nics.ron)",
                "  line_rate_gbit            800.0",
                "  nic_gb_s                  89.56*",
            ],
        );
        let err = one("h300").unwrap_err();
        assert!(err.starts_with("no profile is named `h300`; known profiles: mi300x, mi355x,"), "{err}");
        assert!(err.ends_with("llama-3.1-70b, qwen3-235b-a22b"), "{err}");
    }
}
