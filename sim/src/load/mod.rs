//! Loading scenario files: RON text to a checked [`Scenario`], with errors that name the file, the
//! line and column, and the dotted field path; and printing a scenario back as RON.
//!
//! Reading happens in four steps:
//!
//! 1. Legacy option names written as strings (`legacy: ["lazy-handshake"]`) are turned into RON
//!    raw identifiers (`r#lazy-handshake`), which is what serde's enum derive needs. `"x"` and
//!    `r#x` have the same length, so every line and column the later steps report is still
//!    right for the text the user wrote (module `legacy_names`).
//! 2. `ron` deserializes the text (with the `implicit_some` extension, so `expect: hang` and
//!    `duration_ms: 500` need no `Some(..)`). ron reports a line and column but not which field
//!    it was reading, so a small scanner (module `path`) walks the text up to that position,
//!    tracking `key:` names and list indexes through the brackets, and rebuilds the dotted path
//!    (e.g. `workload.clients.concurrency`, `faults.timeline[1].target`); module `errors` turns
//!    ron's error into a [`ScenarioError`] in words.
//! 3. When the scenario names profiles (`profiles: (gpu: "h200-sxm")`), `crate::profiles`
//!    fills `hardware` and `model` from them; the scanner says which fields the text writes,
//!    since a written field must agree with the profile unless `profiles.overrides` lists it
//!    (and a listed field must be written).
//! 4. [`validate()`] checks what serde cannot (positive sizes, probabilities, routable engine
//!    pairs, and, in module `target`, fault targets inside the deployment). Its violations name
//!    a dotted path; the same scanner finds where that field's `key:` is written. A field the
//!    file leaves at its default has no key; the error then points at the nearest enclosing
//!    field written in the file, or carries no position at all.

use std::collections::BTreeSet;
use std::path::Path;

use ron::extensions::Extensions;

use crate::scenario::Scenario;

mod errors;
mod legacy_names;
mod path;
mod target;
#[cfg(test)]
mod test_support;
mod validate;

pub use errors::ScenarioError;
pub use path::Location;
pub use validate::{validate, Violation};

use errors::from_ron_error;
use legacy_names::{quoted_legacy_names, raw_legacy_names};
use path::{locate, location_of, scan, MAX_NESTING};

/// The ron options every scenario is read and written with: `implicit_some`, so optional fields
/// take a bare value (`expect: hang`, `duration_ms: 500`); `Some(..)` is still accepted.
fn ron_options() -> ron::Options {
    ron::Options::default().with_default_extension(Extensions::IMPLICIT_SOME)
}

/// Parses and validates a scenario from RON text; `origin` (a path, or a name such as
/// `<notation>`) is only used in error messages.
pub fn parse_scenario(text: &str, origin: &str) -> Result<Scenario, ScenarioError> {
    if let Some(offset) = scan(text, text.len(), &|_| false).too_deep {
        return Err(ScenarioError::Syntax {
            origin: origin.to_string(),
            at: location_of(text, offset),
            field: None,
            message: format!(
                "brackets nested more than {MAX_NESTING} deep; a scenario nests about six (faults, \
                 timeline, a fault, its form)"
            ),
        });
    }
    let text = raw_legacy_names(text);
    let mut scenario: Scenario =
        ron_options().from_str(&text).map_err(|err| from_ron_error(origin, &text, err))?;
    if !scenario.profiles.is_empty() {
        // Which fields the text writes: a named profile may fill only the others, those it
        // agrees with, or those `profiles.overrides` lists (which must be written). serde's
        // defaults cannot tell a field left out from one written as its default, so the text
        // itself is scanned.
        let in_sections = |path: &str| path.starts_with("hardware.") || path.starts_with("model.");
        let written: BTreeSet<String> =
            scan(&text, text.len(), &in_sections).anchors.into_iter().map(|anchor| anchor.path).collect();
        crate::profiles::resolve(&mut scenario, &|path| written.contains(path)).map_err(|failed| {
            ScenarioError::Profile {
                origin: origin.to_string(),
                at: locate(&text, &failed.field),
                field: failed.field,
                error: failed.error,
            }
        })?;
    }
    validate(&scenario).map_err(|violation| ScenarioError::Invalid {
        origin: origin.to_string(),
        at: locate(&text, &violation.field),
        field: violation.field,
        message: violation.message,
    })?;
    Ok(scenario)
}

/// Largest scenario file read, in bytes: the largest useful scenario (a thousand timed faults)
/// is a few hundred kilobytes, and a bound keeps `/dev/zero` or a wrong path from filling memory.
pub const MAX_SCENARIO_BYTES: u64 = 1 << 20;

/// Reads at most `limit` bytes of the file at `path` as UTF-8 text: the one reader of every
/// whole file a command reads from a path it was given (scenarios, results, shards).
///
/// The path must name a regular file once symlinks are followed: a device (`/dev/zero` never
/// ends), a FIFO (opening it waits for a writer) or a folder is refused before it is opened,
/// naming what it is. A file whose size is over `limit` is refused before it is read, and the
/// read itself stops at `limit + 1` bytes, so a file that grows while it is read (or a file
/// system that reports a wrong size) cannot fill memory either. The reason names the size and
/// the limit; the caller names the file.
pub fn read_capped(path: &Path, limit: u64) -> Result<String, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|err| err.to_string())?;
    not_regular(&meta).map_or(Ok(()), |what| Err(format!("{what}, not a regular file")))?;
    if meta.len() > limit {
        return Err(format!(
            "the file is {} bytes, larger than {limit} bytes, the most this command reads",
            meta.len()
        ));
    }
    let file = std::fs::File::open(path).map_err(|err| err.to_string())?;
    // The path may have been replaced between the check and the open; check what was opened.
    let meta = file.metadata().map_err(|err| err.to_string())?;
    not_regular(&meta).map_or(Ok(()), |what| Err(format!("{what}, not a regular file")))?;
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|err| err.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!(
            "the file is larger than {limit} bytes when read (it grew, or its size was reported wrong), the most this command reads"
        ));
    }
    String::from_utf8(bytes).map_err(|err| format!("not UTF-8 text ({err})"))
}

/// What a file that is not a regular file is, in words, or `None` for a regular file.
fn not_regular(meta: &std::fs::Metadata) -> Option<&'static str> {
    let kind = meta.file_type();
    if kind.is_file() {
        return None;
    }
    if kind.is_dir() {
        return Some("a folder");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_char_device() {
            return Some("a character device");
        }
        if kind.is_block_device() {
            return Some("a block device");
        }
        if kind.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if kind.is_socket() {
            return Some("a socket");
        }
    }
    Some("a special file")
}

/// Reads the file at `path` (at most [`MAX_SCENARIO_BYTES`]) and parses it with
/// [`parse_scenario`], naming the path in errors.
pub fn load_scenario(path: &Path) -> Result<Scenario, ScenarioError> {
    let origin = path.display().to_string();
    match read_capped(path, MAX_SCENARIO_BYTES) {
        Ok(text) => parse_scenario(&text, &origin),
        Err(message) => Err(ScenarioError::Io { origin, message }),
    }
}

/// The scenario as pretty RON without struct names, with legacy names as strings, and without
/// the optional fields that are absent (RON would print them as `None`, which reads as Rust
/// rather than as a scenario; each defaults to absent when read); reading the result with
/// [`parse_scenario`] gives the same scenario back.
pub fn scenario_to_ron(scenario: &Scenario) -> String {
    let config = ron::ser::PrettyConfig::default().indentor("    ");
    // ron fails only when the writer fails (a String never does) or nesting exceeds the
    // recursion limit (the scenario is six levels deep), so failure is a programmer error.
    let text = ron_options().to_string_pretty(scenario, config).expect("a scenario always serializes to RON");
    with_overridden_fields(quoted_legacy_names(&text), scenario)
}

/// `text`, `scenario` printed, with every field `profiles.overrides` lists written. A field that
/// came with the profiles is left out of a printed scenario while it has its default
/// (`at_default` in `scenario.rs`), but an overridden one must be written to read back: the
/// loader refuses an override of a field not written, and the profile would fill it. The
/// missing ones go at the end of their section (`hardware` or `model`, always printed).
fn with_overridden_fields(mut text: String, scenario: &Scenario) -> String {
    let overrides = &scenario.profiles.overrides;
    if overrides.is_empty() {
        return text;
    }
    let written: BTreeSet<String> = scan(&text, text.len(), &|path| overrides.iter().any(|o| o == path))
        .anchors
        .into_iter()
        .map(|anchor| anchor.path)
        .collect();
    for path in overrides.iter().filter(|path| !written.contains(*path)) {
        let (Some((section, field)), Some(value)) =
            (path.split_once('.'), crate::profiles::filled_value(scenario, path))
        else {
            continue;
        };
        let open = format!("\n    {section}: (\n");
        let Some(start) = text.find(&open).map(|at| at + open.len()) else { continue };
        let Some(end) = text[start..].find("\n    ),").map(|at| start + at + 1) else { continue };
        let value = ron_options().to_string(&value).expect("a number or a bool always serializes to RON");
        text.insert_str(end, &format!("        {field}: {value},\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::test_support::{check_err, kind, with, Kind};
    use super::*;
    use pdkv_core::legacy::Legacy;

    use crate::scenario::{
        Clients, CostModel, EngineLimits, FaultKind, Faults, Hardware, Length, Limits, Measure, ModelProfile,
        Outcome, Profiles, Protocol, Reads, Slo, Swarm, Target, TimedFault, Workload,
    };
    use path::skip_string;

    fn bad_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join("bad")
    }

    /// One file of `testdata/bad`: the variant, line, column and field its error must have, and
    /// words the message must contain.
    struct Bad {
        file: &'static str,
        kind: Kind,
        line: usize,
        column: usize,
        field: &'static str,
        says: &'static str,
    }

    const fn bad(
        file: &'static str,
        kind: Kind,
        line: usize,
        column: usize,
        field: &'static str,
        says: &'static str,
    ) -> Bad {
        Bad { file, kind, line, column, field, says }
    }

    const BAD: [Bad; 30] = [
        bad("unknown_top_level_field.ron", Kind::UnknownField, 5, 5, "seeds", "expected one of: name, "),
        bad("unknown_nested_field.ron", Kind::UnknownField, 7, 9, "hardware.nic_gbps", "nic_gb_s, "),
        bad(
            "unknown_variant_field.ron",
            Kind::UnknownField,
            6,
            55,
            "workload.clients.rate_per_s",
            "expected one of: concurrency, requests",
        ),
        bad(
            "string_for_number.ron",
            Kind::WrongType,
            6,
            19,
            "hardware.nic_gb_s",
            "found the string \"fast\"",
        ),
        bad("decimal_for_integer.ron", Kind::WrongType, 7, 19, "model.kv_heads", "found a decimal number"),
        bad("negative_seed.ron", Kind::WrongType, 5, 11, "seed", "`-1` is negative"),
        bad("zero_tp.ron", Kind::Invalid, 4, 5, "deployment", "TP size of at least 1"),
        bad("tp_not_multiple.ron", Kind::Invalid, 4, 5, "deployment", "one TP size must be a multiple"),
        bad("gqa_head_split.ron", Kind::Invalid, 4, 5, "deployment", "with 8 KV heads"),
        bad("negative_rate.ron", Kind::Invalid, 7, 13, "workload.clients.rate_per_s", "got -2.5"),
        bad(
            "zero_concurrency.ron",
            Kind::Invalid,
            6,
            25,
            "workload.clients.concurrency",
            "at least 1, got 0",
        ),
        bad(
            "unknown_legacy.ron",
            Kind::UnknownVariant,
            6,
            36,
            "protocol.legacy[1]",
            "unknown legacy option `read-from-dp1`; known options: read-from-dp0, ",
        ),
        bad("uniform_min_above_max.ron", Kind::Invalid, 6, 9, "workload.input_tokens", "min 4096 is greater"),
        bad(
            "fault_target_out_of_range.ron",
            Kind::Invalid,
            8,
            26,
            "faults.timeline[1].target",
            "DP rank 1 is out of range",
        ),
        bad(
            "fault_target_malformed.ron",
            Kind::Invalid,
            7,
            24,
            "faults.timeline[0].target",
            "`prefill0.tp3` is not a rank pattern",
        ),
        bad(
            "slow_nic_factor_above_one.ron",
            Kind::Invalid,
            7,
            61,
            "faults.timeline[0].fault.factor",
            "got 1.5",
        ),
        bad(
            "swarm_probability_above_one.ron",
            Kind::Invalid,
            8,
            13,
            "faults.swarm.duplicate",
            "[0, 1], got 1.2",
        ),
        bad(
            "peers_no_such_engine.ron",
            Kind::Invalid,
            6,
            36,
            "protocol.peers[\"P1\"]",
            "1P_DP2TP4:1D_TP4 has no prefill engine P1 (engines P0..P0)",
        ),
        bad(
            "peers_not_an_engine.ron",
            Kind::Invalid,
            7,
            13,
            "protocol.peers[\"P0.dp0.tp0\"]",
            "`P0.dp0.tp0` is not an engine; expected one like P0 or D1",
        ),
        bad(
            "peers_unknown_rules.ron",
            Kind::Invalid,
            5,
            38,
            "protocol.peers[\"P0\"]",
            "unknown rule set \"vllm-0.34\"; known rule sets: pdkv, vllm-0.25, vllm-0.26, vllm-0.27, vllm-0.28, vllm-0.30, vllm-0.33",
        ),
        bad("peers_not_a_string.ron", Kind::WrongType, 5, 30, "protocol.peers[\"P0\"]", "a string"),
        bad("peers_key_twice.ron", Kind::Syntax, 5, 58, "protocol.peers[\"P0\"]", "the key \"P0\" is written twice"),
        bad(
            "profile_unknown_gpu.ron",
            Kind::Profile,
            5,
            16,
            "profiles.gpu",
            "unknown GPU profile `h300`; profiles/gpus.ron has: b200, h100-sxm, h200-sxm, h800, mi300x, mi355x",
        ),
        bad(
            "profile_conflict.ron",
            Kind::Profile,
            8,
            9,
            "hardware.hbm_gb",
            "is 192.0 but the GPU profile `h200-sxm` (profiles/gpus.ron) says 141.0",
        ),
        bad(
            "profile_override_not_written.ron",
            Kind::Profile,
            8,
            40,
            "profiles.overrides[1]",
            "`profiles.overrides` lists `hardware.fp8_tflops`, which the scenario does not write",
        ),
        bad(
            "profile_override_unfilled.ron",
            Kind::Profile,
            5,
            45,
            "profiles.overrides[0]",
            "lists `hardware.nic_gb_s`, which a NIC profile fills, but the scenario names none (`profiles.nic`)",
        ),
        bad("missing_paren.ron", Kind::Syntax, 7, 2, "workload", "unexpected end of file"),
        bad("missing_comma.ron", Kind::Syntax, 4, 5, "name", "expected `,`"),
        bad("missing_deployment.ron", Kind::MissingField, 5, 1, "deployment", "no default"),
        bad(
            "unknown_outcome.ron",
            Kind::UnknownVariant,
            5,
            13,
            "expect",
            "clean, incomplete, leak, failed_requests, hang, safety_violation",
        ),
    ];

    #[test]
    fn load_bad_files_name_the_variant_line_column_and_field() {
        for case in &BAD {
            let path = bad_dir().join(case.file);
            let err = match load_scenario(&path) {
                Ok(scenario) => panic!("{}: loaded {scenario:?}", case.file),
                Err(err) => err,
            };
            let shown = err.to_string();
            assert_eq!(kind(&err), case.kind, "{}: {shown}", case.file);
            let at = Location { line: case.line, column: case.column };
            assert_eq!(err.location(), Some(at), "{}: {shown}", case.file);
            assert_eq!(err.field(), Some(case.field), "{}: {shown}", case.file);
            let origin = path.display().to_string();
            assert_eq!(err.origin(), origin, "{}", case.file);
            assert!(shown.starts_with(&format!("{origin}:{at}: ")), "{}: {shown}", case.file);
            assert!(shown.contains(&format!("`{}`", case.field)), "{}: {shown}", case.file);
            assert!(shown.contains(case.says), "{}: {shown}", case.file);
        }
    }

    #[test]
    fn load_every_bad_file_is_in_the_table() {
        let mut files: Vec<String> = match std::fs::read_dir(bad_dir()) {
            Ok(entries) => {
                entries.flatten().map(|entry| entry.file_name().to_string_lossy().into_owned()).collect()
            }
            Err(err) => panic!("{}: {err}", bad_dir().display()),
        };
        files.sort();
        let mut listed: Vec<String> = BAD.iter().map(|case| case.file.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed);
    }

    #[test]
    fn load_io_errors_name_the_path() {
        let path = bad_dir().join("no-such-file.ron");
        let err = load_scenario(&path).map(|s| s.name).unwrap_err();
        assert_eq!(kind(&err), Kind::Io);
        assert_eq!((err.location(), err.field()), (None, None));
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("{}: cannot read the scenario file: ", path.display())),
            "{shown}"
        );
    }

    #[test]
    fn load_minimal_file_gets_every_default() {
        let scenario = parse_scenario("(name: \"x\", deployment: \"1P_TP8:1D_TP8\")", "<min>");
        let expected = Scenario {
            name: "x".into(),
            description: String::new(),
            deployment: "1P_TP8:1D_TP8".into(),
            profiles: Profiles::default(),
            model: ModelProfile::default(),
            hardware: Hardware::default(),
            cost: CostModel::default(),
            workload: Workload::default(),
            protocol: Protocol::default(),
            engines: EngineLimits::default(),
            faults: Faults::default(),
            seed: 0,
            limits: Limits::default(),
            measure: Measure::default(),
            slo: None,
            expect: None,
            expect_jain: None,
        };
        assert_eq!(scenario, Ok(expected));
    }

    /// A file using most of the format: comments, enum forms, optional values with and without
    /// `Some`, legacy names as strings and as raw identifiers, trailing commas.
    const FULL: &str = r#"// A fuller scenario.
(
    name: "lazy-lost-reply",
    description: "a lost handshake reply under the lazy handshake", /* block comment ( */
    deployment: "2P_TP8:1D_DP8EP",
    model: (kv_bytes_per_token_per_layer: 1152, block_size_tokens: 32),
    hardware: (nic_gb_s: 25, control_latency_us: 80.5),
    cost: (prefill_mfu: 0.2),
    workload: (
        clients: Open(rate_per_s: 2.5, requests: 40),
        input_tokens: Uniform(min: 1024, max: 8192),
        output_tokens: Fixed(256),
    ),
    protocol: (
        legacy: ["lazy-handshake", r#no-handshake-timeout],
        peers: {"P1": "vllm-0.33"},
        reads: PerRequest,
        handshake_timeout_ms: 2000,
    ),
    engines: (decode_max_batch: 64, kv_blocks_per_gpu: 4096),
    faults: (
        timeline: [
            (at_ms: 100, target: "P0.dp0.tp*", fault: LoseMessages, count: 1),
            (at_ms: 200, target: "D0.dp7.tp0", fault: SlowNic(factor: 0.5), duration_ms: Some(1000)),
            (at_ms: 300, target: "P*.dp*.tp*", fault: DelayMessages(delay_ms: 20), duration_ms: 50),
        ],
        swarm: (loss: 0.01, delay: 0.1, max_delay_ms: 5),
        transfer_timeout_ms: 5,
    ),
    seed: 42,
    limits: (max_virtual_time_s: 600),
    measure: (warmup_requests: 4),
    slo: (ttft_ms: 2000, tpot_ms: Some(50.5)),
    expect: hang,
)
"#;

    fn full_expected() -> Scenario {
        Scenario {
            name: "lazy-lost-reply".into(),
            description: "a lost handshake reply under the lazy handshake".into(),
            deployment: "2P_TP8:1D_DP8EP".into(),
            profiles: Profiles::default(),
            model: ModelProfile {
                kv_bytes_per_token_per_layer: 1152,
                block_size_tokens: 32,
                ..ModelProfile::default()
            },
            hardware: Hardware { nic_gb_s: 25.0, control_latency_us: 80.5, ..Hardware::default() },
            cost: CostModel { prefill_mfu: 0.2, ..CostModel::default() },
            workload: Workload {
                clients: Clients::Open { rate_per_s: 2.5, requests: 40 },
                input_tokens: Length::Uniform { min: 1024, max: 8192 },
                output_tokens: Length::Fixed(256),
            },
            protocol: Protocol {
                legacy: vec![Legacy::LazyHandshake, Legacy::NoHandshakeTimeout],
                peers: [("P1".to_string(), "vllm-0.33".to_string())].into(),
                reads: Reads::PerRequest,
                handshake_timeout_ms: 2000,
                ..Protocol::default()
            },
            engines: EngineLimits {
                decode_max_batch: 64,
                kv_blocks_per_gpu: 4096,
                ..EngineLimits::default()
            },
            faults: Faults {
                timeline: vec![
                    TimedFault {
                        at_ms: 100,
                        target: Target("P0.dp0.tp*".into()),
                        fault: FaultKind::LoseMessages,
                        duration_ms: None,
                        count: Some(1),
                    },
                    TimedFault {
                        at_ms: 200,
                        target: Target("D0.dp7.tp0".into()),
                        fault: FaultKind::SlowNic { factor: 0.5 },
                        duration_ms: Some(1000),
                        count: None,
                    },
                    TimedFault {
                        at_ms: 300,
                        target: Target("P*.dp*.tp*".into()),
                        fault: FaultKind::DelayMessages { delay_ms: 20 },
                        duration_ms: Some(50),
                        count: None,
                    },
                ],
                swarm: Swarm { loss: 0.01, delay: 0.1, max_delay_ms: 5, ..Swarm::default() },
                transfer_timeout_ms: Some(5),
            },
            seed: 42,
            limits: Limits { max_virtual_time_s: 600, ..Limits::default() },
            measure: Measure { warmup_requests: Some(4), whole_run: false },
            slo: Some(Slo { ttft_ms: Some(2000.0), tpot_ms: Some(50.5) }),
            expect: Some(Outcome::Hang),
            expect_jain: None,
        }
    }

    #[test]
    fn load_full_file_parses_to_exact_values() {
        assert_eq!(parse_scenario(FULL, "<full>"), Ok(full_expected()));
    }

    /// A scenario's profiles fill `hardware` and `model`; fields they do not fill keep the
    /// scenario's values; a written field must agree with the profile.
    #[test]
    fn load_profiles_fill_hardware_and_model() {
        let ok = |fields: &str| match parse_scenario(&with(fields), "<table>") {
            Ok(scenario) => scenario,
            Err(err) => panic!("{fields}: {err}"),
        };
        let h200 = ok(r#"profiles: (gpu: "h200-sxm")"#);
        let hw = &h200.hardware;
        assert_eq!(
            (hw.hbm_gb, hw.hbm_tb_s, hw.fp8_tflops, hw.bf16_tflops, hw.fabric_gb_s, hw.gpus_per_node),
            (141.0, 4.8, 1979.0, 989.0, 450.0, 8)
        );
        // A GPU profile leaves the NIC and the model alone.
        assert_eq!((hw.nic_gb_s, &h200.model), (Hardware::default().nic_gb_s, &ModelProfile::default()));
        let mixed = ok(
            r#"profiles: (gpu: "h200-sxm", nic: "cx7-400g"), hardware: (hbm_gb: 141, kv_memory_fraction: 0.6, gpus_per_node: 8)"#,
        );
        let hw = &mixed.hardware;
        assert_eq!(
            (hw.hbm_gb, hw.kv_memory_fraction, hw.nic_gb_s, hw.nic_latency_us, hw.line_rate_gbit),
            (141.0, 0.6, 44.78, 6.74, 400.0)
        );
        assert_eq!(ok(r#"profiles: (model: "deepseek-r1")"#).model, ModelProfile::default());
        let llama = ok(r#"profiles: (model: "llama-3.1-70b")"#).model;
        assert_eq!(
            (
                llama.use_mla,
                llama.kv_heads,
                llama.layers,
                llama.moe_layers,
                llama.kv_bytes_per_token_per_layer
            ),
            (false, 8, 80, 0, 2048)
        );
        let table = [
            (
                with(r#"profiles: (gpu: "h300")"#),
                (
                    Kind::Profile,
                    "profiles.gpu",
                    "unknown GPU profile `h300`; profiles/gpus.ron has: b200, h100-sxm, h200-sxm, h800, mi300x, mi355x",
                ),
            ),
            (
                with(r#"profiles: (nic: "cx9")"#),
                (Kind::Profile, "profiles.nic", "profiles/nics.ron has: cx7-400g, cx8-800g, pollara-400, thor2-400g"),
            ),
            (
                with(r#"profiles: (model: "gpt")"#),
                (Kind::Profile, "profiles.model", "unknown model profile `gpt`; profiles/models.ron has: deepseek-r1"),
            ),
            (
                with(r#"profiles: (gpu: "h200-sxm"), hardware: (hbm_gb: 192)"#),
                (
                    Kind::Profile,
                    "hardware.hbm_gb",
                    "field `hardware.hbm_gb`: is 192.0 but the GPU profile `h200-sxm` (profiles/gpus.ron) says 141.0; \
                     a scenario that names a profile takes the profile's values: remove `hardware.hbm_gb` or the profile, \
                     or keep this value by listing the field in `profiles`: `overrides: [\"hardware.hbm_gb\"]`",
                ),
            ),
            (
                with(r#"profiles: (nic: "thor2-400g"), hardware: (nic_qps: 8)"#),
                (Kind::Profile, "hardware.nic_qps", "is 8 but the NIC profile `thor2-400g` (profiles/nics.ron) says 4"),
            ),
            (
                with(r#"profiles: (model: "llama-3.1-70b"), model: (head_dim: 576)"#),
                (Kind::Profile, "model.head_dim", "is 576 but the model profile `llama-3.1-70b` (profiles/models.ron) says 128"),
            ),
            (
                with(r#"profiles: (model: "deepseek-r1"), model: (layers: 60)"#),
                (Kind::Profile, "model.layers", "is 60 but the model profile `deepseek-r1`"),
            ),
            (
                with(r#"profiles: (cpu: "epyc")"#),
                (Kind::UnknownField, "profiles.cpu", "expected one of: gpu, nic, model, overrides"),
            ),
            (
                with(r#"profiles: (gpu: "mi300x", overrides: "hardware.hbm_gb")"#),
                (Kind::WrongType, "profiles.overrides", "expected a list `[...]`, found the string \"hardware.hbm_gb\""),
            ),
            // The profile is applied before the format's rules, which then hold for its values:
            // Llama's 8 KV heads cannot be split between TP4 and TP8.
            (
                r#"(name: "x", deployment: "1P_TP4:1D_TP8", profiles: (model: "llama-3.1-70b"))"#.to_string(),
                (Kind::Invalid, "deployment", "with 8 KV heads"),
            ),
        ];
        for (text, expected) in table {
            check_err(&text, expected);
        }
        // A conflict points at the field as written, an unknown name at the name.
        let at = |fields: &str, word: &str| {
            let text = with(fields);
            let err = parse_scenario(&text, "<at>").map(|_| ()).unwrap_err();
            let column = text.find(word).map(|offset| offset + 1);
            assert_eq!(err.location().map(|at| (at.line, at.column)), column.map(|c| (1, c)), "{err}");
        };
        at(r#"profiles: (gpu: "h200-sxm"), hardware: (hbm_gb: 192)"#, "hbm_gb");
        at(r#"profiles: (gpu: "h300")"#, "gpu:");
        // A bad override points at its entry in the list.
        at(
            r#"profiles: (gpu: "mi300x", overrides: ["hardware.hbm_gb", "model.layers"]), hardware: (hbm_gb: 80)"#,
            "\"model.",
        );
    }

    #[test]
    fn load_printed_scenarios_read_back_unchanged() {
        let mut scenarios = vec![full_expected()];
        let profiled = [
            r#"profiles: (gpu: "h200-sxm", nic: "cx7-400g", model: "llama-3.1-70b")"#,
            // Overridden fields are printed whatever their value, the default included (1300 is
            // the default `bf16_tflops`, which a printed scenario otherwise leaves out).
            r#"profiles: (gpu: "h200-sxm", model: "llama-3.1-70b",
                overrides: ["hardware.bf16_tflops", "hardware.fp8_tflops", "model.layers", "model.attention_heads"]),
               hardware: (bf16_tflops: 1300, fp8_tflops: 1300), model: (layers: 40, attention_heads: 128)"#,
        ];
        for fields in profiled {
            match parse_scenario(&with(fields), "<profiled>") {
                Ok(scenario) => scenarios.push(scenario),
                Err(err) => panic!("{err}"),
            }
        }
        for notation in ["1P_TP8:1D_TP8", "2P_TP8:1D_DP8EP", "1P_TP4+1P_DP2TP4:2D_TP8"] {
            let mut scenario = Scenario::from_notation(notation);
            // Printed non-default values read back too; the small engines need a fixed KV share.
            scenario.hardware.kv_memory_fraction = 0.5;
            scenarios.push(scenario);
        }
        let overridden = scenario_to_ron(&scenarios[2]);
        for scenario in scenarios {
            let text = scenario_to_ron(&scenario);
            assert_eq!(parse_scenario(&text, "<printed>"), Ok(scenario.clone()), "{text}");
            // Printing is stable, and readable: no struct names, legacy names as strings.
            assert_eq!(scenario_to_ron(&scenario), text);
            assert!(text.starts_with("(\n    name: "), "{text}");
            assert!(!text.contains("r#"), "{text}");
            // Absent options are left out rather than printed as Rust's `None`.
            assert!(!text.contains("None"), "{text}");
        }
        for line in [
            "        overrides: [\n            \"hardware.bf16_tflops\",\n",
            "        bf16_tflops: 1300.0,\n",
            "        attention_heads: 128,\n",
        ] {
            assert!(overridden.contains(line), "{line}: {overridden}");
        }
        let text = scenario_to_ron(&full_expected());
        assert!(text.contains("        legacy: [\n            \"lazy-handshake\",\n"), "{text}");
        assert!(text.contains("    expect: hang,\n"), "{text}");
        assert!(
            text.contains("        peers: {\n            \"P1\": \"vllm-0.33\",\n        },\n"),
            "{text}"
        );
        // A scenario without peers prints none, so results of older scenarios keep their text;
        // nor profiles, nor the fields added with them while they keep their defaults.
        let plain = scenario_to_ron(&Scenario::from_notation("1P_TP8:1D_TP8"));
        for field in [
            "peers",
            "profiles",
            "head_dim",
            "total_params_b",
            "routed_experts",
            "experts_per_token",
            "shared_experts",
            "expert_params_per_layer_m",
            "weight_bytes_per_param",
            "attention_heads",
            "bf16_tflops",
            "gpus_per_node",
            "line_rate_gbit",
            "nic_message_rate_mpps",
            "nic_qps",
            "nic_qp_message_rate_mpps",
        ] {
            assert!(!plain.contains(field), "{field}: {plain}");
        }
        assert!(text.contains("duration_ms: 1000,"), "{text}");
    }

    #[test]
    fn load_never_panics_on_truncated_or_corrupted_text() {
        let lines = FULL.lines().count() + 1;
        let mut cuts: Vec<usize> = (0..=FULL.len()).filter(|&i| FULL.is_char_boundary(i)).collect();
        cuts.dedup();
        for &cut in &cuts {
            let texts = [
                FULL[..cut].to_string(),
                format!("{}\"{}", &FULL[..cut], &FULL[cut..]),
                format!("{})]{}", &FULL[..cut], &FULL[cut..]),
                format!("{}é\\r#{}", &FULL[..cut], &FULL[cut..]),
            ];
            for text in texts {
                if let Err(err) = parse_scenario(&text, "<cut>") {
                    if let Some(at) = err.location() {
                        assert!(at.line >= 1 && at.line <= lines + 1 && at.column >= 1, "{cut}: {err}");
                    }
                }
            }
        }
    }

    /// The `ron` code blocks of `docs/scenarios.md`.
    fn doc_examples(doc: &str) -> Vec<String> {
        let mut blocks = Vec::new();
        let mut current: Option<String> = None;
        for line in doc.lines() {
            match (&mut current, line.trim_end()) {
                (None, "```ron") => current = Some(String::new()),
                (Some(block), "```") => {
                    blocks.push(std::mem::take(block));
                    current = None;
                }
                (Some(block), _) => {
                    block.push_str(line);
                    block.push('\n');
                }
                (None, _) => {}
            }
        }
        blocks
    }

    #[test]
    fn load_docs_examples_parse_run_as_declared_and_every_field_is_documented() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scenarios.md");
        let doc = match std::fs::read_to_string(&path) {
            Ok(doc) => doc,
            Err(err) => panic!("{}: {err}", path.display()),
        };
        let examples = doc_examples(&doc);
        assert!(!examples.is_empty(), "docs/scenarios.md has no ```ron example");
        for example in &examples {
            let scenario = match parse_scenario(example, "docs/scenarios.md") {
                Ok(scenario) => scenario,
                Err(err) => panic!("{err}\n{example}"),
            };
            // An example runs to the outcome it declares (clean when it declares none), so one
            // that says "expected to hang" does hang.
            let run = match crate::run(&scenario, crate::RunOptions::default()) {
                Ok(run) => run,
                Err(err) => panic!("docs/scenarios.md: example `{}`: {err}", scenario.name),
            };
            let r = &run.result;
            assert!(
                r.as_expected(),
                "docs/scenarios.md: example `{}` declares `expect: {}` but runs to {} ({} finished, {} failed, \
                 {} hangs); save the block as a file and `pdkv run` it",
                scenario.name,
                r.expected.name(),
                r.outcome.name(),
                r.requests.finished,
                r.requests.failed,
                r.hangs.len()
            );
        }
        // Every field name a printed scenario has (with every enum form) appears in the docs.
        let mut every = full_expected();
        for fault in [
            FaultKind::DuplicateMessages,
            FaultKind::DeadListener,
            FaultKind::SlowListener { service_ms: 5 },
            FaultKind::NicDown,
            FaultKind::SendQueueFull,
        ] {
            every.faults.timeline.push(TimedFault {
                at_ms: 0,
                target: Target("D0.dp0.tp0".into()),
                fault,
                duration_ms: None,
                count: None,
            });
        }
        let printed = scenario_to_ron(&every) + &scenario_to_ron(&Scenario::from_notation("1P_TP8:1D_TP8"));
        let scanned = scan(&printed, printed.len(), &|_| true);
        for anchor in &scanned.anchors {
            let name = anchor.path.rsplit(['.', ']']).next().unwrap_or_default();
            if !name.is_empty() {
                assert!(doc.contains(&format!("`{name}`")), "docs/scenarios.md does not mention `{name}`");
            }
        }
        for word in [
            "Closed",
            "Open",
            "Fixed",
            "Uniform",
            "PerLayer",
            "PerRequest",
            "LoseMessages",
            "DelayMessages",
            "DuplicateMessages",
            "DeadListener",
            "SlowListener",
            "SlowNic",
            "NicDown",
            "SendQueueFull",
            "clean",
            "leak",
            "hang",
            "safety_violation",
        ] {
            assert!(doc.contains(&format!("`{word}")), "docs/scenarios.md does not mention `{word}`");
        }
        check_doc_defaults(&doc);
    }

    /// `(field, default)` of every table row whose default cell is code: `| `f` | .. | .. | `d` |`.
    fn doc_defaults(doc: &str) -> Vec<(String, String)> {
        let mut rows = Vec::new();
        for line in doc.lines().filter(|line| line.starts_with("| `")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let (Some(name), Some(default)) = (cells.get(1), cells.get(4)) else { continue };
            if default.len() >= 2 && default.starts_with('`') && default.ends_with('`') {
                rows.push((name.trim_matches('`').to_string(), default[1..default.len() - 1].to_string()));
            }
        }
        rows
    }

    /// The value text after `key:` at `offset` in printed RON, up to its `,` at depth 0.
    fn value_after(text: &str, offset: usize) -> String {
        let bytes = text.as_bytes();
        let mut i = text[offset..].find(':').map_or(text.len(), |n| offset + n + 1);
        let start = i;
        let mut depth = 0usize;
        while let Some(&b) = bytes.get(i) {
            match b {
                b'"' => {
                    i = skip_string(bytes, i);
                    continue;
                }
                b'(' | b'[' => depth += 1,
                b')' | b']' if depth == 0 => break,
                b')' | b']' => depth -= 1,
                b',' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        text[start..i].trim().to_string()
    }

    /// Compares the defaults the docs' tables give with the ones a minimal scenario prints.
    fn check_doc_defaults(doc: &str) {
        let squeeze = |value: &str| -> String {
            let compact: String = value.chars().filter(|c| !c.is_whitespace()).collect();
            compact.replace(",)", ")").replace(",]", "]")
        };
        let rows = doc_defaults(doc);
        assert!(rows.len() > 40, "{rows:?}");
        let minimal = parse_scenario("(name: \"x\", deployment: \"1P_TP8:1D_TP8\")", "<min>");
        let printed = scenario_to_ron(&minimal.unwrap_or_else(|err| panic!("{err}")));
        let scanned = scan(&printed, printed.len(), &|_| true);
        let mut compared = 0;
        for anchor in &scanned.anchors {
            let name = anchor.path.rsplit(['.', ']']).next().unwrap_or_default();
            let documented: Vec<&String> =
                rows.iter().filter(|(field, _)| field == name).map(|(_, default)| default).collect();
            if documented.is_empty() {
                continue;
            }
            let value = squeeze(&value_after(&printed, anchor.offset));
            assert!(
                documented.iter().any(|default| squeeze(default) == value),
                "docs/scenarios.md gives `{name}` the default {documented:?}, scenario.rs {value}"
            );
            compared += 1;
        }
        assert!(compared > 40, "only {compared} defaults compared");
    }
}
