//! The `complete` marker of a vLLM venv: a file written last, once the venv was checked, naming
//! the pin it was made from (vLLM version, wheel and sha256, the exclusion list), the Python and
//! every package installed. A venv counts only when its marker names the current pin and ends
//! with `complete`; an interrupted install has no marker and is redone, and a venv of another pin
//! is rebuilt.

use std::fmt;

/// The marker's file name inside the venv.
pub const FILE: &str = "pdkv-vllm-env.txt";

/// Bumped when the marker's meaning changes, so that every existing venv is rebuilt.
const FORMAT: &str = "1";

const HEADER: &str =
    "# written by `cargo xtask vllm-env` (xtask/src/vllm_env/) once this venv was complete and checked";

/// What a marker must name to be the current pin's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub vllm_version: String,
    pub wheel_file: String,
    pub sha256: String,
    /// The excluded packages, normalised, in the pin's order.
    pub excluded: Vec<String>,
}

impl Pin {
    /// The lines a marker of this pin has, in order, each `field value`.
    fn fields(&self) -> [(&'static str, String); 4] {
        [
            ("format", FORMAT.to_owned()),
            ("vllm", self.vllm_version.clone()),
            ("wheel", format!("{} sha256:{}", self.wheel_file, self.sha256)),
            ("excluded", self.excluded.join(" ")),
        ]
    }
}

/// How the venv came to be: made by this task, or made by hand beforehand and adopted after
/// its checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Installed,
    Adopted,
}

/// The marker's text: the pin, the Python, how the venv came to be, what is installed (pip's
/// `name==version` lines), and `complete` last.
pub fn render(pin: &Pin, python_version: &str, origin: Origin, installed: &[String]) -> String {
    let mut text = format!("{HEADER}\n");
    for (field, value) in pin.fields() {
        text.push_str(&format!("{field} {value}\n"));
    }
    text.push_str(&format!("python {python_version}\n"));
    let origin = match origin {
        Origin::Installed => "installed by cargo xtask vllm-env",
        Origin::Adopted => {
            "adopted: made beforehand; vllm's version, its wheel's sha256 and every requirement checked"
        }
    };
    text.push_str(&format!("origin {origin}\n"));
    text.push_str("packages\n");
    for line in installed {
        text.push_str(&format!("  {line}\n"));
    }
    text.push_str("complete\n");
    text
}

/// Why a marker does not make its venv usable.
#[derive(Debug, PartialEq, Eq)]
pub enum Stale {
    /// A field of the pin is missing or differs.
    Field { field: &'static str, found: Option<String>, expected: String },
    /// The last line is not `complete`: the marker itself was cut short.
    Incomplete,
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stale::Field { field, found: Some(found), expected } => {
                write!(f, "its marker says {field} {found:?}, the pin {expected:?}")
            }
            Stale::Field { field, found: None, expected } => {
                write!(f, "its marker has no {field} line (the pin's: {expected:?})")
            }
            Stale::Incomplete => write!(f, "its marker does not end with `complete`"),
        }
    }
}

/// Whether a marker's text names `pin` and is complete.
pub fn check(text: &str, pin: &Pin) -> Result<(), Stale> {
    if text.lines().rev().find(|l| !l.trim().is_empty()) != Some("complete") {
        return Err(Stale::Incomplete);
    }
    for (field, expected) in pin.fields() {
        let found = text.lines().find_map(|line| {
            let (name, value) = line.split_once(' ').unwrap_or((line, ""));
            (name == field).then(|| value.to_owned())
        });
        if found.as_deref() != Some(expected.as_str()) {
            return Err(Stale::Field { field, found, expected });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin() -> Pin {
        Pin {
            vllm_version: "0.34.0".into(),
            wheel_file: "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl".into(),
            sha256: "79ca".into(),
            excluded: vec!["flashinfer-python".into(), "torchaudio".into()],
        }
    }

    #[test]
    fn rendered_marker_reads_back() {
        let text =
            render(&pin(), "3.11.7", Origin::Adopted, &["torch==2.14.0".into(), "vllm==0.34.0".into()]);
        assert_eq!(
            text,
            format!(
                "{HEADER}\nformat 1\nvllm 0.34.0\nwheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:79ca\n\
                 excluded flashinfer-python torchaudio\npython 3.11.7\norigin adopted: made beforehand; vllm's \
                 version, its wheel's sha256 and every requirement checked\npackages\n  torch==2.14.0\n  \
                 vllm==0.34.0\ncomplete\n"
            )
        );
        assert_eq!(check(&text, &pin()), Ok(()));
    }

    #[test]
    fn marker_content_checks() {
        let good = render(&pin(), "3.11.7", Origin::Installed, &["vllm==0.34.0".into()]);
        let check = |text: &str, expected: Result<(), Stale>| {
            assert_eq!(super::check(text, &pin()), expected, "{text}")
        };
        let field = |field: &'static str, found: Option<&str>, expected: &str| {
            Err(Stale::Field { field, found: found.map(String::from), expected: expected.into() })
        };
        check(&good, Ok(()));
        // Cut short anywhere before its last line, or empty.
        check(good.trim_end_matches("complete\n"), Err(Stale::Incomplete));
        check(&good[..good.len() / 2], Err(Stale::Incomplete));
        check("", Err(Stale::Incomplete));
        // Another pin: version, wheel, hash, exclusion list, marker format.
        check(&good.replace("vllm 0.34.0", "vllm 0.33.0"), field("vllm", Some("0.33.0"), "0.34.0"));
        check(
            &good.replace("sha256:79ca", "sha256:0000"),
            field(
                "wheel",
                Some("vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:0000"),
                "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl sha256:79ca",
            ),
        );
        check(
            &good.replace("excluded flashinfer-python torchaudio", "excluded flashinfer-python"),
            field("excluded", Some("flashinfer-python"), "flashinfer-python torchaudio"),
        );
        check(&good.replace("format 1", "format 0"), field("format", Some("0"), "1"));
        check(&good.replace("format 1\n", ""), field("format", None, "1"));
        // The Python and the package list are a record, not a condition.
        check(&good.replace("python 3.11.7", "python 3.12.0").replace("vllm==0.34.0", "x==1"), Ok(()));
    }
}
