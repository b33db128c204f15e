//! Legacy option names in scenario text: written as strings (`"lazy-handshake"`) for people,
//! read as RON raw identifiers (`r#lazy-handshake`) for serde's enum derive, and back.

use pdkv_core::legacy::Legacy;

use super::path::scan;

/// The known legacy option names, for error messages.
pub(super) fn legacy_names() -> String {
    let names: Vec<&str> = Legacy::ALL.iter().map(|option| option.name()).collect();
    names.join(", ")
}

/// True for the path of the legacy list or one of its elements.
pub(super) fn is_legacy_path(path: &str) -> bool {
    path == "protocol.legacy" || path.starts_with("protocol.legacy[")
}

/// Rewrites each string in `protocol.legacy` that is a valid raw identifier (`"lazy-handshake"`)
/// to that identifier (`r#lazy-handshake`): same length, so positions stay exact.
pub(super) fn raw_legacy_names(text: &str) -> String {
    let scanned = scan(text, text.len(), &is_legacy_path);
    let mut out = text.to_string();
    for atom in scanned.atoms.iter().filter(|atom| atom.quoted && is_legacy_path(&atom.path)) {
        let Some(name) = text.get(atom.start + 1..atom.end - 1) else { continue };
        let closed = atom.end - atom.start >= 2 && text[..atom.end].ends_with('"');
        let plain =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.+".contains(&b));
        if closed && plain {
            out.replace_range(atom.start..atom.end, &format!("r#{name}"));
        }
    }
    out
}

/// The reverse for printing: `r#lazy-handshake` in `protocol.legacy` becomes `"lazy-handshake"`.
pub(super) fn quoted_legacy_names(text: &str) -> String {
    let scanned = scan(text, text.len(), &is_legacy_path);
    let mut out = text.to_string();
    for atom in scanned.atoms.iter().filter(|atom| !atom.quoted && is_legacy_path(&atom.path)) {
        let name = &text[atom.start + 2..atom.end];
        out.replace_range(atom.start..atom.end, &format!("\"{name}\""));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_legacy_names_in_strings_keep_their_positions() {
        let text = "(protocol: (legacy: [\"lazy-handshake\", \"not ident\", \"\"]), description: \"x\")";
        let prepared = raw_legacy_names(text);
        assert_eq!(
            prepared,
            "(protocol: (legacy: [r#lazy-handshake, \"not ident\", \"\"]), description: \"x\")"
        );
        assert_eq!(prepared.len(), text.len());
        assert_eq!(quoted_legacy_names(&prepared), text);
    }
}
