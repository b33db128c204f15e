//! Reading a wheel's METADATA (the core metadata of PEP 566): its `Requires-Python`, and the
//! requirement list pip is given, which is its `Requires-Dist` without the optional ones (an
//! `extra ==` marker) and without the excluded packages. Also whether a Python version meets a
//! `Requires-Python` specifier. Pure functions over text.

use std::fmt;

/// Why a METADATA text cannot give the requirement list.
#[derive(Debug, PartialEq, Eq)]
pub enum MetadataError {
    /// A `Requires-Dist` value that does not start with a distribution name.
    BadRequirement { line: String },
    /// An excluded package the METADATA does not require: the exclusion list is stale.
    NotRequired { name: String },
    /// No `Requires-Python` header, or one other than the pin's.
    RequiresPython { found: Option<String>, pinned: String },
}

impl fmt::Display for MetadataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetadataError::BadRequirement { line } => {
                write!(f, "the wheel's METADATA has a Requires-Dist without a package name: {line:?}")
            }
            MetadataError::NotRequired { name } => write!(
                f,
                "{name} is excluded (xtask/src/vllm_env/pin.rs, EXCLUDED) but the wheel does not require \
                 it: remove it from the list"
            ),
            MetadataError::RequiresPython { found, pinned } => write!(
                f,
                "the wheel's METADATA says Requires-Python {}, the pin (xtask/src/vllm_env/pin.rs, VLLM) \
                 says {pinned:?}: copy the wheel's into the pin",
                found.as_deref().map_or("(none)".to_owned(), |s| format!("{s:?}"))
            ),
        }
    }
}

/// The values of every header `name` in the header block (up to the first empty line, where
/// the description starts), folded continuation lines joined.
fn headers(metadata: &str, name: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_match = false;
    for line in metadata.lines() {
        if line.trim().is_empty() {
            break;
        }
        if line.starts_with([' ', '\t']) {
            if in_match {
                if let Some(last) = out.last_mut() {
                    last.push(' ');
                    last.push_str(line.trim());
                }
            }
            continue;
        }
        in_match = false;
        if let Some((key, value)) = line.split_once(':') {
            if key.trim().eq_ignore_ascii_case(name) {
                out.push(value.trim().to_owned());
                in_match = true;
            }
        }
    }
    out
}

/// The METADATA's `Requires-Python`, which must be `pinned`.
pub fn check_requires_python(metadata: &str, pinned: &str) -> Result<(), MetadataError> {
    let found = headers(metadata, "Requires-Python").into_iter().next();
    if found.as_deref() == Some(pinned) {
        Ok(())
    } else {
        Err(MetadataError::RequiresPython { found, pinned: pinned.to_owned() })
    }
}

/// A distribution name as PEP 503 compares them: lower case, each run of `-`, `_`, `.` one `-`.
pub fn normalise(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_run = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !in_run {
                out.push('-');
            }
            in_run = true;
        } else {
            out.push(c.to_ascii_lowercase());
            in_run = false;
        }
    }
    out
}

/// The distribution name a requirement starts with (PEP 508: letters, digits, `-`, `_`, `.`).
fn requirement_name(requirement: &str) -> Option<&str> {
    let requirement = requirement.trim_start();
    let end = requirement
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(requirement.len());
    Some(&requirement[..end]).filter(|name| !name.is_empty())
}

/// Whether a requirement's environment marker names the `extra` variable, so that it applies
/// only when an extra of the package is asked for. Quoted strings are skipped, so a value that
/// happens to read `extra` does not count.
fn needs_extra(requirement: &str) -> bool {
    let Some((_, marker)) = requirement.split_once(';') else { return false };
    let mut unquoted = String::new();
    let mut quote = None;
    for c in marker.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None => unquoted.push(c),
        }
    }
    unquoted.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|word| word == "extra")
}

/// The requirement list pip installs after the wheel: each `Requires-Dist` as written (version
/// ranges, the package's own extras and environment markers kept, for pip to evaluate), minus
/// the optional ones and the `excluded` names, in the METADATA's order. Every excluded name must
/// be among the unconditional requirements.
pub fn requirements(metadata: &str, excluded: &[&str]) -> Result<Vec<String>, MetadataError> {
    let excluded: Vec<String> = excluded.iter().map(|n| normalise(n)).collect();
    let mut seen_excluded = vec![false; excluded.len()];
    let mut out = Vec::new();
    for line in headers(metadata, "Requires-Dist") {
        let name =
            requirement_name(&line).ok_or_else(|| MetadataError::BadRequirement { line: line.clone() })?;
        if needs_extra(&line) {
            continue;
        }
        if let Some(i) = excluded.iter().position(|e| *e == normalise(name)) {
            seen_excluded[i] = true;
            continue;
        }
        out.push(line);
    }
    match seen_excluded.iter().position(|seen| !seen) {
        Some(i) => Err(MetadataError::NotRequired { name: excluded[i].clone() }),
        None => Ok(out),
    }
}

/// Whether the Python `version` (`3.11.7`) meets a `Requires-Python` specifier (`<3.15,>=3.11`):
/// comma-separated clauses of `>=`, `>`, `<=`, `<`, `==`, `!=` (`==` and `!=` with a trailing
/// `.*` too) and a release number, compared as PEP 440 compares releases (missing parts are 0).
/// A clause it cannot read is an Err naming it.
pub fn python_meets(version: &str, specifier: &str) -> Result<bool, String> {
    let have = release(version).ok_or_else(|| format!("not a Python version: {version:?}"))?;
    for clause in specifier.split(',').map(str::trim).filter(|c| !c.is_empty()) {
        let op_len = clause.find(|c: char| c.is_ascii_digit()).unwrap_or(clause.len());
        let (op, number) = (clause[..op_len].trim(), clause[op_len..].trim());
        let bad = || format!("cannot read the Requires-Python clause {clause:?}");
        let (number, wildcard) = match number.strip_suffix(".*") {
            Some(n) => (n, true),
            None => (number, false),
        };
        let want = release(number).ok_or_else(bad)?;
        let prefix_equal = || have.iter().chain(std::iter::repeat(&0)).take(want.len()).eq(want.iter());
        let ok = match (op, wildcard) {
            ("==", true) => prefix_equal(),
            ("!=", true) => !prefix_equal(),
            ("==", false) => compare(&have, &want).is_eq(),
            ("!=", false) => compare(&have, &want).is_ne(),
            (">=", false) => compare(&have, &want).is_ge(),
            (">", false) => compare(&have, &want).is_gt(),
            ("<=", false) => compare(&have, &want).is_le(),
            ("<", false) => compare(&have, &want).is_lt(),
            _ => return Err(bad()),
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

fn release(text: &str) -> Option<Vec<u64>> {
    text.split('.')
        .map(|part| part.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()
        .filter(|r| !r.is_empty())
}

/// Releases compared with missing trailing parts read as 0 (`3.11` == `3.11.0`).
fn compare(a: &[u64], b: &[u64]) -> std::cmp::Ordering {
    let len = a.len().max(b.len());
    let pad = |r: &[u64]| r.iter().copied().chain(std::iter::repeat(0)).take(len).collect::<Vec<u64>>();
    pad(a).cmp(&pad(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header block of vLLM 0.34.0's METADATA, shortened, with its description after it.
    const METADATA: &str = "\
Metadata-Version: 2.4
Name: vllm
Version: 0.34.0
Requires-Python: <3.15,>=3.11
Requires-Dist: regex
Requires-Dist: protobuf!=6.30.*,>=5.29.6; platform_machine != \"s390x\"
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: six>=1.16.0; python_version > \"3.11\"
Requires-Dist: torch==2.14.0
Requires-Dist: torchaudio==2.11.0
Requires-Dist: flashinfer-python==0.7.3
Requires-Dist: fastsafetensors>=0.3.3
Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0
Requires-Dist: tokenspeed-mla==2.0.3; platform_system == \"Linux\"
Requires-Dist: PyNvVideoCodec==2.0.4
Provides-Extra: bench
Requires-Dist: pandas; extra == \"bench\"
Requires-Dist: fastsafetensors>=0.3.3; extra == \"fastsafetensors\"
Requires-Dist: mistral_common[audio]; extra == 'audio'
Requires-Dist: b12x==1.5.1; extra==\"b12x\"

Requires-Dist: in-the-description
";

    #[test]
    fn requirement_list_from_metadata() {
        let check = |metadata: &str, excluded: &[&str], expected: Result<Vec<&str>, MetadataError>| {
            let got = requirements(metadata, excluded);
            assert_eq!(got, expected.map(|v| v.into_iter().map(String::from).collect()), "{excluded:?}");
        };
        let all = [
            "regex",
            "protobuf!=6.30.*,>=5.29.6; platform_machine != \"s390x\"",
            "fastapi[standard]<0.137.0,>=0.133.0",
            "six>=1.16.0; python_version > \"3.11\"",
            "torch==2.14.0",
            "torchaudio==2.11.0",
            "flashinfer-python==0.7.3",
            "fastsafetensors>=0.3.3",
            "nvidia-cutlass-dsl[cu13]==4.8.0",
            "tokenspeed-mla==2.0.3; platform_system == \"Linux\"",
            "PyNvVideoCodec==2.0.4",
        ];
        // Nothing excluded: every unconditional requirement, none behind an extra, none from the
        // description.
        check(METADATA, &[], Ok(all.to_vec()));
        // Excluded names match however they are spelt (PEP 503), extras and markers included.
        check(
            METADATA,
            &["flashinfer_python", "NVIDIA-CUTLASS-DSL", "tokenspeed.mla", "pynvvideocodec", "torchaudio"],
            Ok(vec![
                "regex",
                "protobuf!=6.30.*,>=5.29.6; platform_machine != \"s390x\"",
                "fastapi[standard]<0.137.0,>=0.133.0",
                "six>=1.16.0; python_version > \"3.11\"",
                "torch==2.14.0",
                "fastsafetensors>=0.3.3",
            ]),
        );
        // A name required only behind an extra, or not at all, is a stale exclusion.
        check(METADATA, &["pandas"], Err(MetadataError::NotRequired { name: "pandas".into() }));
        check(METADATA, &["torch", "zentorch"], Err(MetadataError::NotRequired { name: "zentorch".into() }));
        check(
            "Name: x\nRequires-Dist: >=1.0\n",
            &[],
            Err(MetadataError::BadRequirement { line: ">=1.0".into() }),
        );
        // A folded header continues on the next line.
        check("Name: x\nRequires-Dist: a>=1;\n  extra == \"x\"\nRequires-Dist: b\n", &[], Ok(vec!["b"]));
        // A quoted value reading `extra` is not the variable.
        check(
            "Requires-Dist: c; platform_machine == \"extra\"\n",
            &[],
            Ok(vec!["c; platform_machine == \"extra\""]),
        );
    }

    #[test]
    fn the_pinned_exclusions_are_all_required_by_the_pinned_wheel() {
        // vLLM 0.34.0's unconditional requirements the exclusion list names, as its METADATA
        // spells them.
        let metadata = "Requires-Dist: flashinfer-python==0.7.3\nRequires-Dist: tilelang==0.1.12\n\
             Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0\nRequires-Dist: humming-kernels[cu13]==0.1.19\n\
             Requires-Dist: tokenspeed-mla==2.0.3; platform_system == \"Linux\"\n\
             Requires-Dist: quack-kernels==0.6.5\nRequires-Dist: PyNvVideoCodec==2.0.4\n\
             Requires-Dist: torchaudio==2.11.0\nRequires-Dist: torchvision==0.29.0\n\
             Requires-Dist: torchcodec>=0.14\nRequires-Dist: torch==2.14.0\n";
        let names: Vec<&str> = super::super::pin::EXCLUDED.iter().map(|(name, _)| *name).collect();
        assert_eq!(requirements(metadata, &names), Ok(vec!["torch==2.14.0".to_owned()]));
    }

    #[test]
    fn requires_python_header() {
        let check = |metadata: &str, expected: Result<(), MetadataError>| {
            assert_eq!(check_requires_python(metadata, "<3.15,>=3.11"), expected, "{metadata}");
        };
        check(METADATA, Ok(()));
        check(
            "Name: x\nRequires-Python: >=3.10\n",
            Err(MetadataError::RequiresPython {
                found: Some(">=3.10".into()),
                pinned: "<3.15,>=3.11".into(),
            }),
        );
        check("Name: x\n", Err(MetadataError::RequiresPython { found: None, pinned: "<3.15,>=3.11".into() }));
    }

    #[test]
    fn names_normalise_as_pep_503_says() {
        let check = |name: &str, expected: &str| assert_eq!(normalise(name), expected, "{name}");
        check("PyNvVideoCodec", "pynvvideocodec");
        check("flashinfer_python", "flashinfer-python");
        check("a-_.b", "a-b");
        check("zope.interface", "zope-interface");
    }

    #[test]
    fn python_versions_against_specifiers() {
        let check = |version: &str, specifier: &str, expected: Result<bool, &str>| {
            assert_eq!(
                python_meets(version, specifier),
                expected.map_err(String::from),
                "{version} {specifier}"
            );
        };
        check("3.11.7", "<3.15,>=3.11", Ok(true));
        check("3.11.0", "<3.15,>=3.11", Ok(true));
        check("3.10.14", "<3.15,>=3.11", Ok(false));
        check("3.14.2", "<3.15,>=3.11", Ok(true));
        check("3.15.0", "<3.15,>=3.11", Ok(false));
        check("3.12.1", ">=3.10", Ok(true));
        check("3.12.1", "", Ok(true));
        check("3.12.1", "==3.12.*", Ok(true));
        check("3.13.0", "==3.12.*", Ok(false));
        check("3.12.1", "!=3.12.*", Ok(false));
        check("3.12.0", "==3.12", Ok(true));
        check("3.12.1", "!=3.12.0", Ok(true));
        check("3.12.1", ">3.12, <=3.12.1", Ok(true));
        check("3.12.1", "~=3.12", Err("cannot read the Requires-Python clause \"~=3.12\""));
        check("3.12.1", ">=3.x", Err("cannot read the Requires-Python clause \">=3.x\""));
        check("three", ">=3", Err("not a Python version: \"three\""));
    }
}
