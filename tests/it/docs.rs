//! Keeps the documentation in step with the code: every legacy option is documented.

use pdkv_core::legacy::Legacy;

#[test]
fn every_legacy_option_has_a_row_in_docs_legacy_md() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/legacy.md");
    let text = std::fs::read_to_string(path).expect("docs/legacy.md exists");
    for option in Legacy::ALL {
        let row = format!("| `{}` |", option.name());
        assert!(text.contains(&row), "docs/legacy.md lacks a row starting {row}");
    }
    let rows = text.lines().filter(|l| l.starts_with("| `")).count();
    assert_eq!(rows, Legacy::ALL.len(), "docs/legacy.md has rows for options that do not exist");
}
