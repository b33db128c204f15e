//! `pdkv scenarios`: the built-in scenarios with what each shows and its expected outcome.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use pdkv_sim::Outcome;

const EXAMPLES: &str = "\
Examples:
  pdkv scenarios
  pdkv run lazy-handshake-delayed-reply
  pdkv run lazy-handshake-delayed-reply-fixed

Every reproduction of a historical failure has a -fixed twin with the legacy option off.";

/// List the built-in scenarios (the files under scenarios/ when pdkv was built).
#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct ScenariosArgs {}

pub fn run(_args: &ScenariosArgs) -> ExitCode {
    let mut out = String::new();
    let width = crate::builtin::BUILT_IN.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    let _ = writeln!(out, "{:<width$}  {:<18}  {:<22}  description", "name", "expected", "deployment");
    for (name, _) in crate::builtin::BUILT_IN {
        match crate::builtin::find(name) {
            Some(Ok(s)) => {
                let expected = s.expect.unwrap_or(Outcome::Clean).name();
                let jain = match s.expect_jain {
                    Some(b) => match (b.at_least, b.at_most) {
                        (Some(lo), _) => format!(", Jain>={lo}"),
                        (None, Some(hi)) => format!(", Jain<={hi}"),
                        _ => String::new(),
                    },
                    None => String::new(),
                };
                // Profiles go after the description, so the columns before it stay as they were.
                let profiles = if s.profiles.is_empty() {
                    String::new()
                } else {
                    format!(" (profiles: {})", s.profiles)
                };
                let _ = writeln!(
                    out,
                    "{name:<width$}  {:<18}  {:<22}  {}{profiles}",
                    format!("{expected}{jain}"),
                    s.deployment,
                    s.description
                );
            }
            Some(Err(e)) => {
                let _ = writeln!(out, "{name:<width$}  (does not parse: {e})");
            }
            None => {}
        }
    }
    out!("{out}");
    ExitCode::SUCCESS
}
