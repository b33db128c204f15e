//! What a hostile tester found in the CLI's file and stream handling, one table each: inputs
//! that are not regular files or are too large are refused before they are read; shard files
//! that lie are refused, naming the file and the lie; a closed or full stdout ends a command
//! without a panic; a full disk leaves no result file cut short.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A fresh temporary folder of this test process.
fn folder(name: &str) -> PathBuf {
    crate::cli::scratch("hostile", name)
}

use crate::cli::pdkv_in as pdkv;

/// Checks that `output` exited with `code`, its stderr holds `words`, and nothing panicked.
fn check(what: &str, output: &Output, code: i32, words: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(code), "{what}: stderr {stderr}");
    assert!(stderr.contains(words), "{what}: stderr {stderr:?} lacks {words:?}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

#[test]
fn inputs_that_are_not_regular_files_or_too_large_are_refused_unread() {
    let dir = folder("inputs");
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero.json")).expect("a symlink");
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero.ron")).expect("a symlink");
    // A sparse 300 MB file: its size alone says it is too large.
    std::fs::File::create(dir.join("big.json")).and_then(|f| f.set_len(300 << 20)).expect("a sparse file");
    let fifo = Command::new("mkfifo").arg(dir.join("fifo.json")).status().expect("mkfifo runs");
    assert!(fifo.success());
    let table: [(&[&str], &str); 8] = [
        (
            &["explore-merge", "/dev/zero"],
            "/dev/zero: cannot read it: a character device, not a regular file",
        ),
        (&["explore-merge", "zero.json"], "zero.json: cannot read it: a character device"),
        (
            &["explore-merge", "big.json"],
            "big.json: cannot read it: the file is 314572800 bytes, larger than 67108864",
        ),
        (
            &["explore-merge", "fifo.json"],
            "fifo.json: cannot read it: a FIFO (named pipe), not a regular file",
        ),
        (&["explore-merge", "."], "cannot read it: a folder, not a regular file"),
        (&["sweep-merge", "zero.json", "--out", "merged"], "zero.json: cannot read it: a character device"),
        (&["replay", "big.json"], "big.json: the file is 314572800 bytes, larger than"),
        (&["run", "zero.ron"], "zero.ron: cannot read the scenario file: a character device"),
    ];
    for (args, words) in table {
        check(&args.join(" "), &pdkv(&dir, args), 2, words);
    }
}

/// Writes the two shards of a small exploration into `dir`, returns their JSON.
fn shards(dir: &Path) -> [serde_json::Value; 2] {
    [0, 1].map(|i| {
        let (shard, file) = (format!("{i}/2"), format!("s{i}.json"));
        let args = ["explore", "notify-drift-fixed", "--seeds", "4", "--shard", &shard, "--result", &file];
        let out = pdkv(dir, &args);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&std::fs::read(dir.join(file)).expect("written")).expect("JSON")
    })
}

#[test]
fn shards_that_lie_are_refused_naming_the_file_and_the_lie() {
    let dir = folder("lies");
    let [first, _] = shards(&dir);
    let failure = |seed: u64, broken: &[&str], text: &str| serde_json::json!({ "failure": { "seed": seed, "broken": broken, "shrunk": { "name": "x", "text": text } } });
    let scenario = r#"(name: "x", deployment: "1P_TP8:1D_TP8")"#;
    type Forge = Box<dyn Fn(&mut serde_json::Value)>;
    let table: Vec<(Forge, &str)> = vec![
        (
            Box::new(|v| {
                v["found"]["clean"]["outcomes"] = serde_json::json!({ "clean": 1, "safety_violation": 1 })
            }),
            "1 seed had outcome `safety_violation`, which breaks a property, yet the file records no failure",
        ),
        (
            Box::new(|v| v["found"]["clean"]["outcomes"] = serde_json::json!({ "clean": 3 })),
            "the outcome counts add up to 3, but `runs` is 2",
        ),
        (
            Box::new(|v| v["found"]["clean"]["outcomes"] = serde_json::json!({ "clean": 1, "fine": 1 })),
            "outcome `fine` is not one pdkv knows",
        ),
        (
            Box::new(move |v| v["found"] = failure(0, &["banana"], scenario)),
            "`broken` names \"banana\", which is not a property",
        ),
        (Box::new(move |v| v["found"] = failure(0, &[], scenario)), "the failure breaks no property"),
        (
            Box::new(move |v| v["found"] = failure(1, &["safety"], scenario)),
            "the failure is seed 1, which is not one of shard 0/2's seeds",
        ),
        (
            Box::new(move |v| v["found"] = failure(0, &["safety"], "rm -rf /")),
            "the shrunk scenario is not a scenario pdkv run accepts",
        ),
        (
            Box::new(move |v| v["found"] = failure(0, &["safety"], &" ".repeat(2 << 20))),
            "the shrunk scenario is 2097152 bytes, larger than 1048576 bytes",
        ),
        (Box::new(|v| v["faults"] = "banana".into()), "`faults` is \"banana\""),
    ];
    for (i, (forge, lie)) in table.iter().enumerate() {
        let mut forged = first.clone();
        forge(&mut forged);
        let name = format!("forged-{i}.json");
        std::fs::write(dir.join(&name), serde_json::to_string(&forged).expect("JSON")).expect("written");
        let out = pdkv(&dir, &["explore-merge", &name, "s1.json", "--out", "shrunk"]);
        check(&name, &out, 2, &format!("{name}: {lie}"));
        assert!(!dir.join("shrunk").exists(), "{name}: a forged shard wrote files");
    }
    // The honest shards still merge.
    check("honest", &pdkv(&dir, &["explore-merge", "s0.json", "s1.json"]), 0, "");
}

/// Runs `args` with stdout a pipe whose reader is closed before pdkv starts, so its first write
/// meets a broken pipe whatever the scheduling (closing the reader after the spawn raced a command
/// as quick as `profiles`, whose whole output could land in the pipe's buffer first).
fn with_closed_stdout(dir: &Path, args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .current_dir(dir)
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("pdkv runs")
}

#[test]
fn a_closed_or_full_stdout_ends_the_command_without_a_panic() {
    let dir = folder("stdout");
    shards(&dir);
    let commands: [&[&str]; 6] = [
        &["run", "2P_TP8:1D_DP8EP", "--json", "--out", "run"],
        &["routes", "64P_TP8:8D_DP64EP"],
        &["explore", "notify-drift", "--seeds", "20"],
        &["explore-merge", "s0.json", "s1.json"],
        &["scenarios"],
        &["profiles"],
    ];
    for args in commands {
        let what = args.join(" ");
        check(&format!("{what} | (closed)"), &with_closed_stdout(&dir, args), 141, "");
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        let out = Command::new(env!("CARGO_BIN_EXE_pdkv"))
            .current_dir(&dir)
            .args(args)
            .stdout(full)
            .output()
            .expect("pdkv runs");
        check(
            &format!("{what} > /dev/full"),
            &out,
            2,
            "error: cannot write to standard output: No space left",
        );
    }
}

#[test]
fn a_full_disk_leaves_no_result_file_cut_short() {
    let dir = folder("disk");
    // RLIMIT_FSIZE makes a write past the limit fail with EFBIG (with SIGXFSZ ignored), as a
    // full disk would; no root and no small file system needed. Kilobytes: enough for some
    // files of a run and not others.
    for limit_kb in [1, 40, 200, 2000] {
        let out_dir = dir.join(format!("run-{limit_kb}"));
        let script = format!("trap '' XFSZ; ulimit -f {limit_kb}; exec \"$0\" \"$@\"");
        let out = Command::new("sh")
            .args(["-c", &script, env!("CARGO_BIN_EXE_pdkv"), "run", "2P_TP8:1D_DP8EP", "--out"])
            .arg(&out_dir)
            .output()
            .expect("sh runs");
        let what = format!("run with a {limit_kb} KB file size limit");
        check(&what, &out, 2, "cannot write");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("Error(") && !stderr.contains("Custom {"), "{what}: Debug text: {stderr}");
        for entry in std::fs::read_dir(&out_dir).into_iter().flatten() {
            let path = entry.expect("an entry").path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
            assert!(!name.starts_with('.'), "{what}: a temporary file is left: {name}");
            let bytes = std::fs::read(&path).expect("readable");
            assert!(!bytes.is_empty(), "{what}: {name} is empty");
            if name == "result.json" {
                serde_json::from_slice::<serde_json::Value>(&bytes).expect("a whole result.json");
            }
            if name == "trace.txt" {
                assert!(bytes.ends_with(b"\n"), "{what}: trace.txt is cut mid-line");
            }
        }
    }
}
