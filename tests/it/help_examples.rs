//! Every example in every `--help` is a command line that parses and names things that exist.
//!
//! The examples are a newcomer's first commands, so a typo in one (a flag renamed, a scenario
//! gone, a replay of a file no earlier example writes) is a bug. The examples are read from the
//! built binary's own help, as a user sees them. Each one is run with `--help` appended: clap
//! then parses and validates every argument of the line (unknown flags, bad values, legacy
//! names, rank syntax) and prints the subcommand's help instead of running it, so nothing is
//! simulated or started. What `--help` skips (required arguments) is checked against the
//! subcommand's `Usage:` line, and the names an example uses (scenarios, notations, files) are
//! checked to exist.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pdkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .expect("pdkv runs")
}

fn stdout(args: &[&str]) -> String {
    let out = pdkv(args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// The lines after the line `title` up to the next blank line.
fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    text.lines().skip_while(|l| l.trim() != title).skip(1).take_while(|l| !l.trim().is_empty()).collect()
}

/// The example commands of a help text, as words: the lines of its `Examples:` section that
/// start with `pdkv `, joined with the lines a trailing `\` continues, cut at the first two
/// spaces in a row (what follows is a comment for the reader).
fn examples(help: &str) -> Vec<Vec<String>> {
    let mut commands: Vec<String> = Vec::new();
    let mut continued = false;
    for line in section(help, "Examples:") {
        let line = line.trim();
        if continued {
            let last = commands.last_mut().expect("a continuation follows a command");
            last.push(' ');
            last.push_str(line);
        } else if line.starts_with("pdkv ") {
            commands.push(line.to_string());
        }
        continued = line.ends_with('\\');
        if let (true, Some(last)) = (continued, commands.last_mut()) {
            let kept = last.trim_end_matches('\\').trim_end().len();
            last.truncate(kept);
        }
    }
    commands
        .iter()
        .map(|c| c.split("  ").next().unwrap_or("").split_whitespace().map(str::to_string).collect())
        .collect()
}

/// What a subcommand's help says about its arguments.
#[derive(Default)]
struct Syntax {
    /// Long flags, and whether each takes a value.
    flags: BTreeMap<String, bool>,
    /// Required positionals from the `Usage:` line.
    positionals: Vec<String>,
    /// Flags the `Usage:` line lists outside brackets, so required.
    required: Vec<String>,
}

fn syntax(help: &str) -> Syntax {
    let mut s = Syntax::default();
    for line in help.lines().take_while(|l| l.trim() != "Examples:") {
        let mut words = line.split_whitespace().peekable();
        if words.peek().is_some_and(|w| w.len() == 3 && w.starts_with('-') && w.ends_with(',')) {
            words.next();
        }
        if let Some(flag) = words.next().filter(|w| w.starts_with("--")) {
            let takes_value = words.next().is_some_and(|w| w.starts_with('<'));
            s.flags.insert(flag.trim_end_matches(',').to_string(), takes_value);
        }
    }
    let usage = help.lines().find_map(|l| l.strip_prefix("Usage: ")).unwrap_or("");
    let mut depth = 0;
    let mut words = usage.split_whitespace().skip(2).peekable();
    while let Some(word) = words.next() {
        depth += word.matches('[').count();
        let inside = depth > 0;
        depth -= word.matches(']').count().min(depth);
        if inside {
            continue;
        }
        if word.starts_with("--") {
            s.required.push(word.to_string());
            words.next();
        } else if word.starts_with('<') {
            s.positionals.push(word.trim_end_matches("...").to_string());
        }
    }
    s
}

/// The CLI as its help describes it, and a folder to run examples in.
struct Cli {
    helps: BTreeMap<String, String>,
    scenarios: BTreeSet<String>,
    /// Where `pdkv run` examples run when a later example replays what they write: a temporary
    /// folder with `scenarios/` linked in, so default report folders land there.
    workdir: PathBuf,
    /// Whether `pdkv run` examples are run for real (their help also has a replay example).
    execute_runs: bool,
}

impl Cli {
    fn new() -> Cli {
        let top = stdout(&["--help"]);
        let mut helps = BTreeMap::new();
        for line in section(&top, "Commands:") {
            let name = line.split_whitespace().next().expect("a command name");
            if name != "help" {
                helps.insert(name.to_string(), stdout(&[name, "--help"]));
            }
        }
        helps.insert(String::new(), top);
        let listing = stdout(&["scenarios"]);
        let scenarios =
            listing.lines().skip(1).filter_map(|l| l.split_whitespace().next()).map(str::to_string);
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let workdir = std::env::temp_dir().join(format!("pdkv-it-help-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&workdir);
        std::fs::create_dir_all(&workdir).expect("a temporary folder");
        std::os::unix::fs::symlink(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"),
            workdir.join("scenarios"),
        )
        .expect("scenarios/ linked into the temporary folder");
        Cli { helps, scenarios: scenarios.collect(), workdir, execute_runs: false }
    }

    /// Whether `spec` is what `pdkv run` accepts: a built-in scenario, a file, or a notation.
    fn names_a_scenario(&self, spec: &str) -> bool {
        self.scenarios.contains(spec)
            || Path::new(env!("CARGO_MANIFEST_DIR")).join(spec).is_file()
            || notation(spec)
    }

    /// The problems of one example; an empty list when it parses and what it names exists.
    fn problems(&mut self, words: &[String]) -> Vec<String> {
        let shown = words.join(" ");
        let Some(sub) = words.get(1) else { return vec![format!("`{shown}`: no subcommand")] };
        let Some(help) = self.helps.get(sub.as_str()) else {
            return vec![format!("`{shown}`: no subcommand `{sub}` in `pdkv --help`")];
        };
        let mut problems = Vec::new();
        // Parsing: clap validates every argument of the line, then prints the help.
        let mut args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
        args.push("--help");
        let out = pdkv(&args);
        if out.status.code() != Some(0) || String::from_utf8_lossy(&out.stdout) != *help {
            let why = String::from_utf8_lossy(&out.stderr);
            problems.push(format!("`{shown}` does not parse: {}", why.lines().next().unwrap_or("")));
            return problems;
        }
        let syntax = syntax(help);
        let mut positionals = Vec::new();
        let mut values: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let mut rest = words[2..].iter();
        while let Some(word) = rest.next() {
            if word.starts_with("--") {
                let value = if syntax.flags.get(word.as_str()) == Some(&true) { rest.next() } else { None };
                values.entry(word.as_str()).or_default().extend(value.map(String::as_str));
            } else {
                positionals.push(word.as_str());
            }
        }
        // What `--help` does not check: the arguments the usage line requires.
        if positionals.len() < syntax.positionals.len() {
            problems.push(format!("`{shown}` lacks {}", syntax.positionals[positionals.len()..].join(" ")));
        }
        for flag in &syntax.required {
            if !values.contains_key(flag.as_str()) {
                problems.push(format!("`{shown}` lacks the required {flag}"));
            }
        }
        // What the example names must exist.
        let notations: Vec<&str> = match sub.as_str() {
            "routes" | "cluster" => positionals.first().copied().into_iter().collect(),
            "connector" => values.get("--deployment").cloned().unwrap_or_default(),
            _ => Vec::new(),
        };
        for n in notations {
            if !notation(n) {
                problems.push(format!("`{shown}`: `{n}` is not a deployment `pdkv routes` accepts"));
            }
        }
        if matches!(sub.as_str(), "run" | "explore" | "sweep") {
            for spec in &positionals {
                if !self.names_a_scenario(spec) {
                    problems.push(format!(
                        "`{shown}`: `{spec}` is neither a built-in scenario, a file nor a notation"
                    ));
                }
            }
        }
        if sub == "replay" {
            for file in &positionals {
                let exists = Path::new(env!("CARGO_MANIFEST_DIR")).join(file).is_file()
                    || self.workdir.join(file).is_file();
                if !exists {
                    problems
                        .push(format!("`{shown}`: `{file}` exists nowhere and no earlier example writes it"));
                }
            }
        }
        // A run whose result a later example replays is run for real, where its report lands
        // by default, so the replayed path is checked against what pdkv writes.
        if sub == "run" && self.execute_runs {
            let out = Command::new(env!("CARGO_BIN_EXE_pdkv"))
                .current_dir(&self.workdir)
                .args(&words[1..])
                .output()
                .expect("pdkv runs");
            if out.status.code() != Some(0) {
                problems.push(format!("`{shown}` exits with {}", out.status));
            }
        }
        problems
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.workdir);
    }
}

/// The pdkv commands of a README: the lines of its `sh` blocks that start with `pdkv ` or
/// `cargo run --release -- ` (read as `pdkv ...`), without a trailing `# comment`.
fn readme_commands(readme: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut in_sh = false;
    for line in readme.lines() {
        match line.trim() {
            "```sh" => in_sh = true,
            "```" => in_sh = false,
            text if in_sh => {
                let text = text.split(" #").next().unwrap_or_default();
                let command = match text.strip_prefix("cargo run --release -- ") {
                    Some(args) => format!("pdkv {args}"),
                    None if text.starts_with("pdkv ") => text.to_string(),
                    None => continue,
                };
                commands.push(command.split_whitespace().map(str::to_string).collect());
            }
            _ => {}
        }
    }
    commands
}

/// The README's commands are held to the same rules as the help examples.
#[test]
fn every_readme_command_parses_and_names_what_exists() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md exists");
    let commands = readme_commands(&readme);
    assert!(commands.len() >= 8, "only {} pdkv commands found in README.md's sh blocks", commands.len());
    let mut cli = Cli::new();
    let problems: Vec<String> = commands.iter().flat_map(|words| cli.problems(words)).collect();
    assert!(problems.is_empty(), "README.md: {}", problems.join("\nREADME.md: "));
    // The folder the README says the main command writes is the one it writes.
    let main_job = readme.split("The main job").nth(1).expect("README.md has \"The main job\"");
    let folder = main_job
        .split('`')
        .find(|part| part.starts_with("target/pdkv/"))
        .expect("the main job names its report folder `target/pdkv/...`");
    cli.execute_runs = true;
    assert_eq!(cli.problems(&commands[0]), Vec::<String>::new());
    assert!(
        cli.workdir.join(folder).join("index.html").is_file(),
        "README.md says `{}` writes its report to {folder}, but it does not",
        commands[0].join(" ")
    );
    let check = |readme: &str, expected: &[&str]| {
        let got: Vec<String> = readme_commands(readme).iter().map(|w| w.join(" ")).collect();
        assert_eq!(got, expected, "{readme:?}");
    };
    check(
        "x\n```sh\ncargo run --release -- run a\npdkv run b   # a comment\ncargo xtask test\n```\npdkv run c\n",
        &["pdkv run a", "pdkv run b"],
    );
}

/// Whether `pdkv routes` accepts `text` as a deployment.
fn notation(text: &str) -> bool {
    pdkv(&["routes", text]).status.code() == Some(0)
}

#[test]
fn every_help_example_parses_and_names_what_exists() {
    let mut cli = Cli::new();
    assert!(cli.helps.len() >= 9, "expected the top level and 8 subcommands: {:?}", cli.helps.keys());
    let mut problems = Vec::new();
    let mut count = 0;
    let helps: Vec<(String, String)> = cli.helps.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (sub, help) in helps {
        let list = examples(&help);
        if list.is_empty() {
            problems.push(format!("`pdkv {sub} --help` has no examples"));
        }
        cli.execute_runs = list.iter().any(|w| w.get(1).is_some_and(|s| s == "replay"));
        for words in list {
            count += 1;
            problems.extend(cli.problems(&words).into_iter().map(|p| format!("pdkv {sub} --help: {p}")));
        }
    }
    assert!(count >= 25, "only {count} examples found; is the extraction broken?");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// (help text) -> the example command lines found, so the extraction itself is tested.
#[test]
fn examples_are_extracted_as_the_reader_sees_them() {
    let check = |help: &str, expected: &[&str]| {
        let got: Vec<String> = examples(help).iter().map(|w| w.join(" ")).collect();
        assert_eq!(got, expected, "{help:?}");
    };
    check(
        "Usage: x\n\nExamples:\n  pdkv run a\n  pdkv scenarios\n\nText.\n",
        &["pdkv run a", "pdkv scenarios"],
    );
    check("Examples:\n  pdkv run a          (a comment)\n", &["pdkv run a"]);
    check("Examples:\n  pdkv routes a --json      who reads whom\n", &["pdkv routes a --json"]);
    check(
        "Examples:\n  pdkv cluster a --kill P0 \\\n      --restart-after-ms 1 --defer-timeout-ms 2\n  pdkv b\n",
        &["pdkv cluster a --kill P0 --restart-after-ms 1 --defer-timeout-ms 2", "pdkv b"],
    );
    check("Examples:\n  pdkv run a\n\n  pdkv run after-a-blank-line\n", &["pdkv run a"]);
    check("No examples here.\n  pdkv run a\n", &[]);
}

/// (example) -> the problem reported, for examples that are wrong in each way the check looks
/// for; the real help texts must give none of these.
#[test]
fn a_bad_example_is_caught() {
    let mut cli = Cli::new();
    let mut check = |example: &str, problem: &str| {
        let words: Vec<String> = example.split_whitespace().map(str::to_string).collect();
        let problems = cli.problems(&words);
        assert!(
            problems.iter().any(|p| p.contains(problem)),
            "{example}: {problems:?}, expected {problem:?}"
        );
    };
    check("pdkv run 2P_TP8:1D_DP8EP --requestz 3", "does not parse: error: unexpected argument '--requestz'");
    check(
        "pdkv routes 1P_TP8:1D_TP8 --legacy read-from-dp9",
        "does not parse: error: invalid value 'read-from-dp9'",
    );
    check("pdkv explore notify-drift --seeds 0", "does not parse: error: invalid value '0'");
    check("pdkv cluster 1P_TP2:1D_TP2 --kill P0.tp0.dp1", "does not parse");
    check("pdkv simulate 1P_TP8:1D_TP8", "no subcommand `simulate`");
    check("pdkv sweep --concurrency 8,16", "lacks <DEPLOYMENTS>");
    check(
        "pdkv connector --deployment 1P_TP2:1D_TP2 --role prefill --engine 0 --dp 0 --tp 0",
        "lacks the required --scheduler",
    );
    check("pdkv run notify-drfit", "`notify-drfit` is neither a built-in scenario, a file nor a notation");
    check("pdkv run scenarios/no-such-file.ron --seed 7", "is neither a built-in scenario");
    check("pdkv routes 1P_TP4:1D_TP6", "`1P_TP4:1D_TP6` is not a deployment");
    check(
        "pdkv replay /tmp/nobody-writes-this/result.json",
        "exists nowhere and no earlier example writes it",
    );
    check("pdkv replay target/pdkv/notify-drift/result.json", "exists nowhere");
    // A replay of what an earlier `pdkv run` example wrote is fine, with or without --out.
    cli.execute_runs = true;
    let words = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    let out = cli.workdir.join("ex");
    let run = format!("pdkv run notify-drift --out {}", out.display());
    assert_eq!(cli.problems(&words(&run)), Vec::<String>::new());
    let replay = format!("pdkv replay {}/result.json", out.display());
    assert_eq!(cli.problems(&words(&replay)), Vec::<String>::new());
    assert_eq!(cli.problems(&words("pdkv run notify-drift --seed 7")), Vec::<String>::new());
    assert_eq!(
        cli.problems(&words("pdkv replay target/pdkv/notify-drift_seed-7/result.json")),
        Vec::<String>::new()
    );
}
