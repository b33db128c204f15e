//! The README's gallery: which `pdkv` command draws each picture under `docs/gallery`, read
//! from `docs/gallery/gallery.txt`, and the copying of those pictures out of the commands'
//! report folders. Running the commands is the caller's job (`cargo xtask gallery` runs the
//! release binary, the gallery test the one cargo built for it), so a picture in the README is
//! always what its command makes.

use std::path::{Path, PathBuf};

use crate::ReportError;

/// Where the table lives, relative to the workspace root.
pub const TABLE: &str = "docs/gallery/gallery.txt";

/// One picture of the gallery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Picture {
    /// Its file name under `docs/gallery`.
    pub file: String,
    /// The `pdkv` arguments whose report draws it (without `--out`).
    pub args: Vec<String>,
    /// The file of that report it is.
    pub report_file: String,
}

/// Reads the table: one picture per line, `file | pdkv arguments | report file`; `#` starts a
/// comment. Errors name the line.
pub fn parse_table(text: &str) -> Result<Vec<Picture>, String> {
    let mut pictures = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('|').map(str::trim).collect();
        let [file, args, report_file] = fields[..] else {
            return Err(format!(
                "line {}: expected `file | pdkv arguments | report file`, found {} field(s)",
                i + 1,
                fields.len()
            ));
        };
        let args: Vec<String> = args.split_whitespace().map(String::from).collect();
        if file.is_empty() || report_file.is_empty() || args.is_empty() {
            return Err(format!("line {}: a field is empty", i + 1));
        }
        if args.iter().any(|a| a == "--out") {
            return Err(format!("line {}: the gallery chooses the report folder; drop --out", i + 1));
        }
        if pictures.iter().any(|p: &Picture| p.file == file) {
            return Err(format!("line {}: {file} is listed twice", i + 1));
        }
        pictures.push(Picture { file: file.into(), args, report_file: report_file.into() });
    }
    if pictures.is_empty() {
        return Err("the table lists no picture".into());
    }
    Ok(pictures)
}

/// Reads `docs/gallery/gallery.txt` under `root`.
pub fn table(root: &Path) -> Result<Vec<Picture>, ReportError> {
    let path = root.join(TABLE);
    let text = std::fs::read_to_string(&path).map_err(|e| ReportError::input(&path, e.to_string()))?;
    parse_table(&text).map_err(|what| ReportError::input(&path, what))
}

/// The arguments of the README's main command: the first `cargo run --release -- ...` line of
/// the first `sh` block after the line that starts with "The main job".
pub fn readme_main_command(readme: &str) -> Option<Vec<String>> {
    let mut lines = readme.lines().skip_while(|l| !l.starts_with("The main job"));
    lines.find(|l| l.trim() == "```sh")?;
    let command = lines.take_while(|l| l.trim() != "```").find(|l| l.trim().starts_with("cargo run"))?;
    let (_, args) = command.split_once(" -- ")?;
    Some(args.split_whitespace().map(String::from).collect())
}

/// Draws the gallery into `out`: `run(args, folder)` runs `pdkv args --out folder` once per
/// distinct command (in the table's order); the listed files are copied out of its report
/// folder. Returns the pictures written, in the table's order.
pub fn render(
    pictures: &[Picture],
    out: &Path,
    mut run: impl FnMut(&[String], &Path) -> Result<(), String>,
) -> Result<Vec<PathBuf>, ReportError> {
    std::fs::create_dir_all(out).map_err(|e| ReportError::io(out, e))?;
    let work = out.join(".work");
    let mut commands: Vec<&[String]> = Vec::new();
    for picture in pictures {
        if !commands.contains(&picture.args.as_slice()) {
            commands.push(&picture.args);
        }
    }
    let mut written = Vec::new();
    for (i, args) in commands.iter().enumerate() {
        let folder = work.join(i.to_string());
        run(args, &folder).map_err(|what| ReportError::input(Path::new(&args.join(" ")), what))?;
        for picture in pictures.iter().filter(|p| p.args.as_slice() == *args) {
            let from = folder.join(&picture.report_file);
            let to = out.join(&picture.file);
            std::fs::copy(&from, &to).map_err(|e| ReportError::io(&from, e))?;
            written.push(to);
        }
    }
    std::fs::remove_dir_all(&work).map_err(|e| ReportError::io(&work, e))?;
    let order = |path: &PathBuf| pictures.iter().position(|p| path.ends_with(&p.file));
    written.sort_by_key(order);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_table(text: &str, expected: Result<usize, &str>) {
        let got = parse_table(text).map(|p| p.len());
        assert_eq!(got, expected.map_err(String::from), "{text}");
    }

    #[test]
    fn table_lines() {
        check_table("a.png | run x | nic_balance.png\n", Ok(1));
        check_table("# comment\n\na.png | run x --seed 3 | b.png # why\nc.png | run y | d.png", Ok(2));
        check_table(
            "a.png | run x\n",
            Err("line 1: expected `file | pdkv arguments | report file`, found 2 field(s)"),
        );
        check_table("a.png |  | b.png\n", Err("line 1: a field is empty"));
        check_table(
            "a.png | run x --out /tmp | b.png\n",
            Err("line 1: the gallery chooses the report folder; drop --out"),
        );
        check_table("a.png | run x | b.png\na.png | run y | b.png\n", Err("line 2: a.png is listed twice"));
        check_table("# nothing\n", Err("the table lists no picture"));
    }

    fn check_main(readme: &str, expected: Option<&str>) {
        let expected = expected.map(|e| e.split_whitespace().map(String::from).collect::<Vec<_>>());
        assert_eq!(readme_main_command(readme), expected, "{readme}");
    }

    #[test]
    fn main_command_of_a_readme() {
        let readme = "intro\n```sh\ncargo run -- other\n```\nThe main job: simulate\n\n```sh\ncargo run --release -- run 2P_TP8:1D_DP8EP\n```\n";
        check_main(readme, Some("run 2P_TP8:1D_DP8EP"));
        check_main("The main job\n```sh\ncargo test\n```\n```sh\ncargo run -- run x\n```\n", None);
        check_main("no such section\n```sh\ncargo run --release -- run x\n```\n", None);
    }
}
