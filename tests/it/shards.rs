//! `--shard i/N` and the merges: the shards of an exploration or a sweep, merged, are byte for
//! byte what the unsharded run writes, and shard files that do not belong together are refused
//! with the file at fault named (exit 2), never merged into something wrong.

use std::path::{Path, PathBuf};

/// A fresh temporary folder of this test process.
fn folder(name: &str) -> PathBuf {
    crate::cli::scratch("shards", name)
}

use crate::cli::pdkv_in as pdkv;

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir`, by path relative to it, with its bytes (none when `dir` is not
/// there).
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut found = Vec::new();
    let mut stack: Vec<PathBuf> = dir.is_dir().then(|| dir.to_path_buf()).into_iter().collect();
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("a readable folder") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                found.push((path.strip_prefix(dir).expect("under dir").to_path_buf(), read(&path)));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn sharded_explorations_merge_into_the_unsharded_result_file() {
    // (scenario, seeds, shards, exit code of the whole and of the merge). The whole run uses two
    // threads and the shards one each, so the result does not depend on --jobs either.
    let table: [(&str, &str, u32, u8); 5] = [
        // Clean: the outcomes, distinct behaviours and events of all shards together.
        ("notify-drift-fixed", "60", 3, 0),
        // A bug only some seeds find: the smallest failing seed (5 today, in shard 2, while
        // shard 1 finds 22 and shard 0 none) wins, with its shrunk scenario.
        ("proxy-aliasing", "60", 3, 1),
        // Every seed fails: each shard stops at its first, the merge takes seed 0's.
        ("notify-drift", "60", 3, 1),
        // Fewer seeds than shards: one shard runs none.
        ("notify-drift-fixed", "2", 3, 0),
        // Seeds without a verdict (1 and 18 are cut by their budget): named, with their
        // scenario files, the same by the merge.
        ("release-during-reads-fixed", "20", 3, 0),
    ];
    for (scenario, seeds, shards, code) in table {
        let dir = folder(&format!("explore-{scenario}-{seeds}"));
        let flags = ["explore", scenario, "--seeds", seeds, "--faults", "swarm"];
        let whole =
            pdkv(&dir, &[&flags[..], &["--jobs", "2", "--result", "whole.json", "--out", "shrunk"]].concat());
        assert_eq!(
            whole.status.code(),
            Some(code.into()),
            "{scenario}: {}",
            String::from_utf8_lossy(&whole.stderr)
        );
        let mut shard_files = Vec::new();
        for i in 0..shards {
            let (shard, file) = (format!("{i}/{shards}"), format!("shard-{i}.json"));
            let out = pdkv(
                &dir,
                &[
                    &flags[..],
                    &["--jobs", "1", "--shard", &shard, "--result", &file, "--out", "shards-shrunk"],
                ]
                .concat(),
            );
            assert!(
                matches!(out.status.code(), Some(0 | 1)),
                "{scenario} {shard}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            shard_files.push(file);
        }
        let mut merge = vec!["explore-merge", "--result", "merged.json", "--out", "merged-shrunk"];
        merge.extend(shard_files.iter().rev().map(String::as_str));
        let merged = pdkv(&dir, &merge);
        assert_eq!(
            merged.status.code(),
            Some(code.into()),
            "{scenario}: {}",
            String::from_utf8_lossy(&merged.stderr)
        );
        assert!(
            read(&dir.join("whole.json")) == read(&dir.join("merged.json")),
            "{scenario}: the merged result differs from the unsharded one (in {})",
            dir.display()
        );
        // A failure's shrunk scenario file, or the named seeds' files, are written by both, the
        // same.
        let (whole, merged) = (files(&dir.join("shrunk")), files(&dir.join("merged-shrunk")));
        if code == 1 {
            assert_eq!(whole.len(), 1, "{scenario}: one shrunk file");
        }
        assert!(whole == merged, "{scenario}: the merge's scenario files differ (in {})", dir.display());
        let text = std::fs::read_to_string(dir.join("whole.json")).expect("written");
        assert_eq!(
            text.contains("release-during-reads-fixed-seed18"),
            scenario == "release-during-reads-fixed",
            "{scenario}: {text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_sharded_sweep_merges_into_the_unsharded_report() {
    let dir = folder("sweep");
    let flags = [
        "sweep",
        "1P_TP8:1D_TP8",
        "2P_TP8:1D_DP8EP",
        "--concurrency",
        "4,8,16",
        "--requests-per-client",
        "2",
    ];
    let whole = pdkv(&dir, &[&flags[..], &["--jobs", "2", "--out", "whole"]].concat());
    assert_eq!(whole.status.code(), Some(0), "{}", String::from_utf8_lossy(&whole.stderr));
    for i in 0..2 {
        let (shard, out) = (format!("{i}/2"), format!("shard-{i}"));
        let run = pdkv(&dir, &[&flags[..], &["--jobs", "1", "--shard", &shard, "--out", &out]].concat());
        assert_eq!(run.status.code(), Some(0), "{shard}: {}", String::from_utf8_lossy(&run.stderr));
    }
    let merged = pdkv(&dir, &["sweep-merge", "shard-1", "shard-0/sweep-shard.json", "--out", "merged"]);
    assert_eq!(merged.status.code(), Some(0), "{}", String::from_utf8_lossy(&merged.stderr));
    let (whole, merged) = (files(&dir.join("whole")), files(&dir.join("merged")));
    let names = |f: &[(PathBuf, Vec<u8>)]| f.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>();
    assert_eq!(names(&whole), names(&merged));
    assert!(names(&whole).contains(&"sweep_throughput.svg".to_string()), "{:?}", names(&whole));
    for ((name, a), (_, b)) in whole.iter().zip(&merged) {
        assert!(a == b, "{} differs between the unsharded and the merged report", name.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_shards_and_shard_files_exit_2_naming_what_is_wrong() {
    let dir = folder("bad");
    let explore = |seeds: &str, shard: &str, file: &str| {
        let out = pdkv(
            &dir,
            &["explore", "notify-drift-fixed", "--seeds", seeds, "--shard", shard, "--result", file],
        );
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    };
    explore("6", "0/3", "a0.json");
    explore("6", "1/3", "a1.json");
    explore("7", "2/3", "other-seeds.json");
    explore("6", "1/2", "other-split.json");
    let whole = pdkv(&dir, &["explore", "notify-drift-fixed", "--seeds", "6", "--result", "whole.json"]);
    assert_eq!(whole.status.code(), Some(0));
    std::fs::write(dir.join("junk.json"), "not json").expect("writes");
    let sweep = pdkv(
        &dir,
        &[
            "sweep",
            "1P_TP8:1D_TP8",
            "--concurrency",
            "4,8",
            "--requests-per-client",
            "1",
            "--shard",
            "0/2",
            "--out",
            "s0",
        ],
    );
    assert_eq!(sweep.status.code(), Some(0), "{}", String::from_utf8_lossy(&sweep.stderr));
    std::fs::create_dir_all(dir.join("empty")).expect("a folder");
    // Shard files edited to claim what no sweep writes, each named in the table below.
    let good = std::fs::read_to_string(dir.join("s0/sweep-shard.json")).expect("the shard file");
    let forge = |name: &str, from: &str, to: &str| {
        assert!(good.contains(from), "{from} is not in {good}");
        std::fs::write(dir.join(name), good.replacen(from, to, 1)).expect("writes");
    };
    forge("banana.json", "\"outcome\": \"clean\"", "\"outcome\": \"banana\"");
    forge("stranger-line.json", "\"run\": \"1P_TP8:1D_TP8\"", "\"run\": \"../../etc\"");
    forge("bad-deployment.json", "\"deployment\": \"1P_TP8:1D_TP8\"", "\"deployment\": \"9Q\"");
    forge("no-clients.json", "\"concurrency\": 4", "\"concurrency\": 0");
    forge("nan.json", "\"total_tok_s\": \"", "\"total_tok_s\": \"NaN\", \"was\": \"");
    // (arguments, what stderr must say)
    let table: &[(&[&str], &[&str])] = &[
        (
            &["explore", "notify-drift-fixed", "--shard", "0/0", "--result", "x.json"],
            &["number of shards must be at least 1"],
        ),
        (
            &["explore", "notify-drift-fixed", "--shard", "3/2", "--result", "x.json"],
            &["shard 3 does not exist", "0 to 1"],
        ),
        (
            &["explore", "notify-drift-fixed", "--shard", "junk", "--result", "x.json"],
            &["`junk` is not a shard like 0/4"],
        ),
        (&["explore", "notify-drift-fixed", "--shard", "0/2"], &["--result <FILE>"]),
        (
            &["explore", "notify-drift-fixed", "--for", "1s", "--shard", "0/2", "--result", "x.json"],
            &["--for is a time budget"],
        ),
        (
            &["explore", "notify-drift-fixed", "--for", "1s", "--result", "x.json"],
            &["--for is a time budget"],
        ),
        (&["sweep", "1P_TP8:1D_TP8", "--shard", "2/2"], &["shard 2 does not exist"]),
        (&["explore-merge", "a0.json", "a1.json"], &["no file holds shard 2/3"]),
        (&["explore-merge", "a0.json", "a1.json", "a1.json"], &["a1.json: is shard 1/3, and so is a1.json"]),
        (
            &["explore-merge", "a0.json", "a1.json", "other-seeds.json"],
            &["other-seeds.json: the number of seeds (--seeds) is 7", "in a0.json it is 6"],
        ),
        (
            &["explore-merge", "a0.json", "other-split.json", "a1.json"],
            &["other-split.json: is shard 1/2", "different splits"],
        ),
        (&["explore-merge", "a0.json", "whole.json"], &["whole.json: a whole result, not a shard"]),
        (&["explore-merge", "a0.json", "junk.json"], &["junk.json: not a shard file: not JSON"]),
        (&["explore-merge", "a0.json", "missing.json"], &["missing.json: cannot read it"]),
        (&["explore-merge", "s0/sweep-shard.json"], &["sweep-shard.json: not a shard file: `format`"]),
        (&["sweep-merge", "s0", "--out", "m"], &["no file holds shard 1/2"]),
        (&["sweep-merge", "s0", "empty", "--out", "m"], &["empty/sweep-shard.json: cannot read it"]),
        (&["sweep-merge", "s0", "a1.json", "--out", "m"], &["a1.json: not a shard file: `format`"]),
        (
            &["sweep-merge", "banana.json", "--out", "m"],
            &["banana.json", "outcome `banana` is not one pdkv knows"],
        ),
        (
            &["sweep-merge", "stranger-line.json", "--out", "m"],
            &["stranger-line.json", "none of the sweep's lines"],
        ),
        (
            &["sweep-merge", "bad-deployment.json", "--out", "m"],
            &["bad-deployment.json", "`deployment` \"9Q\""],
        ),
        (&["sweep-merge", "no-clients.json", "--out", "m"], &["no-clients.json", "`concurrency` is 0"]),
        (&["sweep-merge", "nan.json", "--out", "m"], &["nan.json", "`total_tok_s` is NaN"]),
    ];
    for (args, messages) in table {
        let out = pdkv(&dir, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        for message in *messages {
            assert!(stderr.contains(message), "{args:?}: {stderr:?} lacks {message:?}");
        }
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
