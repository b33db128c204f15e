//! The README's gallery (docs/gallery) is what `cargo xtask gallery` renders today.

use std::path::Path;

#[test]
fn gallery_is_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fresh = std::env::temp_dir().join(format!("pdkv-it-gallery-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&fresh);
    let files = pdkv_reports::gallery::render(&root.join("scenarios"), &fresh).expect("the gallery renders");
    assert!(!files.is_empty());
    for file in &files {
        let name = file.file_name().unwrap();
        let committed = root.join("docs/gallery").join(name);
        let same = std::fs::read(&committed).ok() == std::fs::read(file).ok();
        assert!(
            same,
            "docs/gallery/{} is stale or missing; run `cargo xtask gallery` and commit",
            name.to_string_lossy()
        );
    }
    let mut listed: Vec<String> = std::fs::read_dir(root.join("docs/gallery"))
        .expect("docs/gallery exists")
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    listed.sort();
    let mut expected: Vec<String> =
        files.iter().map(|f| f.file_name().unwrap().to_string_lossy().to_string()).collect();
    expected.sort();
    assert_eq!(listed, expected, "docs/gallery holds pictures the gallery no longer makes");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for name in &expected {
        assert!(readme.contains(&format!("docs/gallery/{name}")), "README.md does not show {name}");
    }
    std::fs::remove_dir_all(&fresh).ok();
}
