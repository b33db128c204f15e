//! The README's gallery (docs/gallery) is what its commands draw today, and its first command is
//! the README's main command.

use std::path::Path;
use std::process::Command;

use pdkv_reports::gallery;

#[test]
fn gallery_is_what_its_commands_draw() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pictures = gallery::table(root).unwrap_or_else(|e| panic!("{e}"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md exists");
    let main = gallery::readme_main_command(&readme)
        .expect("README.md has a `cargo run --release -- ...` line in the sh block after \"The main job\"");
    assert_eq!(
        pictures[0].args,
        main,
        "the gallery's first command ({}) is not the README's main command ({}); edit {}",
        pictures[0].args.join(" "),
        main.join(" "),
        gallery::TABLE
    );
    // Every other command is shown in the README next to its pictures.
    for picture in &pictures {
        let shown = format!("pdkv {}", picture.args.join(" "));
        assert!(
            picture.args == main || readme.contains(&shown),
            "README.md shows {} but never the command that draws it (`{shown}`)",
            picture.file
        );
        assert!(
            readme.contains(&format!("docs/gallery/{}", picture.file)),
            "README.md does not show {}",
            picture.file
        );
    }

    let fresh = std::env::temp_dir().join(format!("pdkv-it-gallery-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&fresh);
    let files = gallery::render(&pictures, &fresh, |args, folder| {
        let out = Command::new(env!("CARGO_BIN_EXE_pdkv"))
            .args(args)
            .arg("--out")
            .arg(folder)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("exited with {}:\n{}", out.status, String::from_utf8_lossy(&out.stderr)))
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let committed = root.join("docs/gallery").join(&name);
        assert!(
            std::fs::read(&committed).ok() == std::fs::read(file).ok(),
            "docs/gallery/{name} is not what `{}` draws; run `cargo xtask gallery` and commit",
            pictures
                .iter()
                .find(|p| p.file == name)
                .map_or(String::new(), |p| format!("pdkv {}", p.args.join(" ")))
        );
    }
    let mut listed: Vec<String> = std::fs::read_dir(root.join("docs/gallery"))
        .expect("docs/gallery exists")
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|name| name.ends_with(".png"))
        .collect();
    listed.sort();
    let mut expected: Vec<String> = pictures.iter().map(|p| p.file.clone()).collect();
    expected.sort();
    assert_eq!(listed, expected, "docs/gallery holds pictures the gallery table does not list");
    std::fs::remove_dir_all(&fresh).ok();
}
