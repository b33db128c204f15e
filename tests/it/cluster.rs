//! Real clusters on loopback: one `pdkv connector` process per rank, the real protocol, every
//! byte decode reads checked against the pattern prefill wrote; then the real faults (a killed
//! prefill process, dropped releases, a restart, lost, duplicated and delayed control messages).

use std::net::TcpListener;
use std::path::PathBuf;

use pdkv_core::ids::{EngineId, RankId};
use pdkv_rdma::cluster::{self, ClusterConfig, ClusterResult, Fault};
use pdkv_rdma::message_faults::{MessageFault, Verb};
use pdkv_rdma::sched::TOKEN_ENV;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pdkv"))
}

fn run(config: ClusterConfig) -> ClusterResult {
    let what = format!("{} {:?}", config.deployment, config.faults);
    let result = cluster::run(config, &mut |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
    // Every process exits cleanly or was killed by the fault itself.
    let p = &result.processes;
    assert_eq!(
        (p.killed_at_shutdown, p.failed, p.exited_cleanly + p.killed_by_fault),
        (0, 0, p.started),
        "{what}: processes {p:?}\n{}",
        result.to_json()
    );
    assert!(result.violations.is_empty(), "{what}: {:?}", result.violations);
    result
}

/// Fault-free: every request finishes, every byte verified, every transfer freed by its
/// releases (never by the reaper), and reads spread as the routing says.
fn check(deployment: &str, mla: bool, requests: u32, reads_per_gpu: &[u64]) {
    let mut config = ClusterConfig::new(deployment, requests, exe());
    config.mla = mla;
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{deployment}: {json}");
    assert_eq!((r.requests.finished, r.requests.failed), (u64::from(requests), 0), "{deployment}");
    assert_eq!((r.ledger.freed, r.ledger.reaped, r.ledger.held), (u64::from(requests), 0, 0), "{deployment}");
    assert_eq!((r.ledger.fenced, r.ledger.double_frees), (0, 0), "{deployment}");
    assert_eq!(r.nic.reads_per_prefill_gpu, reads_per_gpu, "{deployment}");
    let total: u64 = r.nic.bytes_per_prefill_gpu.iter().sum();
    assert!(total > 0 && r.bytes_verified == total, "{deployment}: {json}");
    let (ttft, e2e) = (r.latency_ms.ttft, r.latency_ms.e2e);
    assert!(ttft.p50 > 0.0 && ttft.p50 <= e2e.p50 && e2e.p50 <= e2e.p99, "{deployment}: {json}");
}

#[test]
fn fault_free_clusters_verify_every_byte_and_free_every_block_once() {
    // P4→D8: each prefill rank is read by the two decode ranks that share its heads.
    check("1P_TP4:1D_TP8", false, 16, &[32, 32, 32, 32]);
    // P8→D4: half the prefill ranks are never read; their zero quorums free them at once.
    check("1P_TP8:1D_TP4", false, 16, &[16, 0, 16, 0, 16, 0, 16, 0]);
    // MLA, flexible reads: one read per request, spread over every prefill rank.
    check("2P_TP2:1D_DP2", true, 16, &[4, 4, 4, 4]);
    // Two prefill DP groups: each request is read from its owner DP group only.
    check("1P_DP2TP2:1D_TP4", false, 16, &[16, 16, 16, 16]);
}

/// Many requests in flight: every request finishes, nothing fails, every transfer is freed by
/// its releases, and decode verified exactly `copies` times the KV of the finished prompts (each
/// KV head is read once by every decode rank that needs it).
fn check_loaded(deployment: &str, mla: bool, requests: u32, concurrency: u32, copies: u64) {
    let mut config = ClusterConfig::new(deployment, requests, exe());
    config.mla = mla;
    config.concurrency = concurrency;
    let what = format!("{deployment} at concurrency {concurrency}");
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{what}: {json}");
    let q = &r.requests;
    let all = u64::from(requests);
    assert_eq!((q.sent, q.finished, q.failed, q.unfinished), (all, all, 0, 0), "{what}: {json}");
    let l = &r.ledger;
    assert_eq!((l.freed, l.held, l.reaped, l.double_frees), (all, 0, 0, 0), "{what}: {json}");
    assert!(r.prompt_kv_bytes > 0, "{what}: {json}");
    assert_eq!(r.bytes_verified, copies * r.prompt_kv_bytes, "{what}: {json}");
    assert_eq!(r.nic.bytes_per_prefill_gpu.iter().sum::<u64>(), r.bytes_verified, "{what}: {json}");
}

#[test]
fn clusters_under_load_finish_every_request_and_verify_every_byte() {
    // TP fan-in: two decode ranks share each prefill rank's head, so each head is read twice.
    check_loaded("1P_TP4:1D_TP8", false, 300, 256, 2);
    // TP fan-out: each decode rank reads its two heads from one prefill rank.
    check_loaded("1P_TP4:1D_TP2", false, 300, 128, 1);
    check_loaded("1P_TP8:1D_TP4", false, 200, 64, 1);
    // DP×TP prefill: each request is read from its owner DP group; two KV heads over four
    // decode ranks, so each head twice.
    check_loaded("1P_DP2TP2:1D_TP4", false, 300, 128, 2);
    // MLA, flexible reads: one decode rank per request reads the latent once.
    check_loaded("2P_TP2:1D_DP2", true, 300, 256, 1);
    // The two reproductions of the bug fixed by retiring a transfer before freeing its blocks.
    check_loaded("1P_TP2:1D_TP2", false, 200, 50, 1);
    check_loaded("1P_TP1:1D_TP1", false, 300, 100, 1);
}

/// A decode group that runs one request at a time (`--decode-max-batch 1`): the rest queue at
/// its scheduler, announced to its ranks, which lease their transfers until a step hands them
/// over; every request still finishes and every transfer is freed once, by its releases.
#[test]
fn requests_queued_behind_a_full_decode_batch_all_finish_and_free_once() {
    let mut config = ClusterConfig::new("1P_TP2:1D_TP2", 200, exe());
    config.concurrency = 32;
    config.decode_max_batch = 1;
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    let (q, l) = (&r.requests, &r.ledger);
    assert_eq!((q.finished, q.failed, q.unfinished), (200, 0, 0), "{json}");
    assert!(q.queued_at_decode > 0, "no request ever queued at decode: {json}");
    assert_eq!((l.freed, l.held, l.reaped, l.double_frees), (200, 0, 0, 0), "{json}");
}

/// A prefill pool of 25 blocks, exactly the longest prompt (400 tokens of 16): at most a few
/// requests fit at once, so most wait in each group's queue behind a head that waits for blocks,
/// and every block is handed out many times over, in vLLM's order (the engine layer's
/// `PrefillScheduler`). Every request still finishes, every byte verifies, every transfer is
/// freed once and nothing stays held.
#[test]
fn a_prefill_pool_as_small_as_one_prompt_serves_every_request_in_order() {
    for deployment in ["1P_TP2:1D_TP2", "1P_DP2TP1:1D_TP2"] {
        let mut config = ClusterConfig::new(deployment, 40, exe());
        config.num_blocks = 25;
        config.concurrency = 16;
        let r = run(config);
        let json = r.to_json();
        assert_eq!(r.outcome, "clean", "{deployment}: {json}");
        let q = &r.requests;
        assert_eq!((q.sent, q.finished, q.failed, q.unfinished), (40, 40, 0, 0), "{deployment}: {json}");
        let l = &r.ledger;
        assert_eq!((l.freed, l.held, l.reaped, l.double_frees), (40, 0, 0, 0), "{deployment}: {json}");
        assert_eq!(r.bytes_verified, r.nic.bytes_per_prefill_gpu.iter().sum::<u64>(), "{deployment}: {json}");
    }
}

#[test]
fn a_cluster_leaves_no_process_or_listener_behind() {
    let r = run(ClusterConfig::new("1P_TP2:1D_TP2", 4, exe()));
    assert_eq!(r.outcome, "clean");
    // `run` checked that every process exited cleanly; every port a rank listened on is free.
    assert_eq!(r.listener_ports.len(), 8, "{:?}", r.listener_ports);
    for port in r.listener_ports {
        assert!(TcpListener::bind(("127.0.0.1", port)).is_ok(), "port {port} is still taken");
    }
}

fn rank(role_prefill: bool, dp: u16, tp: u16) -> RankId {
    let engine = if role_prefill { EngineId::prefill(0) } else { EngineId::decode(0) };
    RankId::new(engine, dp, tp)
}

/// Short timeouts so that the fault tests end within seconds.
fn quick(deployment: &str, requests: u32) -> ClusterConfig {
    let mut config = ClusterConfig::new(deployment, requests, exe());
    config.timeouts.handshake_ms = 2_000;
    config.timeouts.transfer_ms = 5_000;
    config.timeouts.defer_ms = 6_000;
    config.timeout_ms = 60_000;
    config
}

#[test]
fn killing_a_prefill_process_fails_its_requests_and_nothing_hangs() {
    let mut config = quick("1P_DP2TP2:1D_TP4", 24);
    // A reaper far beyond the run: the dead rank's transfers must be freed by its loss and the
    // live ranks' releases, within the handshake and transfer timeouts.
    config.timeouts.defer_ms = 60_000;
    let killed = rank(true, 0, 1);
    config.faults.push(Fault::KillPrefill { rank: killed, after: 6, restart_after_ms: None });
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "the failures and the reaper's frees are the fault's: {json}");
    assert_eq!(r.requests.unfinished, 0, "{json}");
    assert!(r.requests.failed > 0 && r.requests.finished > 0, "{json}");
    assert_eq!(r.requests.failed_excused, r.requests.failed, "{json}");
    // Only requests whose KV the dead DP group held fail. Those prefilled before the kill fail
    // on the decode workers that needed the dead rank (or, once the dial fails, on all of them,
    // with the same error); the group's later ones fail at once, before prefill, since the rank
    // is gone for good.
    for f in &r.failures {
        assert_eq!(f.prefill, "P0.dp0", "{json}");
        let errors: Vec<&str> = f.errors.iter().map(|e| e.split_once(": ").map_or("", |x| x.1)).collect();
        let all_workers = errors.len() == 4 && errors.iter().all(|e| *e == errors[0]);
        let readers_of_dead_rank =
            f.errors.iter().all(|e| e.starts_with("D0.dp0.tp2") || e.starts_with("D0.dp0.tp3"));
        let at_once = f.errors == ["P0.dp0.tp1 is gone"];
        assert!(all_workers || readers_of_dead_rank || at_once, "{json}");
    }
    // Every request of the live DP group finished.
    let failed_dp1 = r.failures.iter().filter(|f| f.prefill == "P0.dp1").count();
    assert_eq!(failed_dp1, 0);
    // The dead rank's part of its transfers counts as done (EngineEvent::WorkerLost): they are
    // freed by the live ranks' releases, none is reaped, nothing stays held, and the run ends
    // within the handshake and transfer timeouts (2 s + 5 s) though the reaper waits 60 s.
    assert_eq!(r.ledger.held, 0, "{json}");
    assert_eq!(r.ledger.reaped, 0, "{json}");
    assert!(r.duration_s < 7.0 + 1.0, "{json}");
    assert_eq!(r.processes.killed_by_fault, 1);
}

#[test]
fn a_restarted_prefill_process_is_handshaken_again_and_serves() {
    let mut config = quick("1P_DP2TP2:1D_TP4", 40);
    let killed = rank(true, 0, 1);
    config.faults.push(Fault::KillPrefill { rank: killed, after: 6, restart_after_ms: Some(1_000) });
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert_eq!(r.processes.started, 9, "8 ranks and one restart: {json}");
    assert!(r.faults.iter().any(|f| f.contains("restarted")), "{json}");
    // Requests of the restarted rank's group finish again: the rank served more reads than
    // the few that finished before the kill, all verified.
    let served = r.nic.reads_per_prefill_gpu[1];
    assert!(served >= 10, "the restarted rank served {served} reads: {json}");
    assert!(r.requests.finished >= 30, "{json}");
    assert_eq!(r.ledger.held, 0, "{json}");
}

/// A prefill rank killed under load (128 in flight) and restarted at once or half a second
/// later, on a DP x TP prefill and on flexible reads of two TP2 prefill engines: every byte read
/// is verified (a byte of another incarnation would be a violation), no message meant for the
/// old incarnation is an error, every failure and reaping is the kill's, nothing stays held.
/// Transfers prefilled before the kill and dispatched after the restart fail on the incarnation
/// fence, unread. `cargo xtask cluster-restarts` runs 20 of each with delays up to 3 s.
#[test]
fn a_prefill_rank_restarted_under_load_serves_only_its_own_incarnation_s_kv() {
    for (deployment, mla, killed) in
        [("1P_DP2TP2:1D_TP4", false, rank(true, 0, 1)), ("2P_TP2:1D_DP2", true, rank(true, 0, 0))]
    {
        for restart_after_ms in [0, 500] {
            let mut config = quick(deployment, 600);
            config.mla = mla;
            config.concurrency = 128;
            config.faults.push(Fault::KillPrefill {
                rank: killed,
                after: 40,
                restart_after_ms: Some(restart_after_ms),
            });
            let r = run(config);
            let json = r.to_json();
            let what = format!("{deployment} restarted after {restart_after_ms} ms");
            assert_eq!(r.outcome, "clean", "{what}: {json}");
            assert!(r.faults.iter().any(|f| f.contains("restarted")), "{what}: {json}");
            assert_eq!(r.requests.failed_excused, r.requests.failed, "{what}: {json}");
            assert_eq!(r.ledger.reaped_excused, r.ledger.reaped, "{what}: {json}");
            assert_eq!((r.ledger.held, r.requests.unfinished), (0, 0), "{what}: {json}");
            assert!(r.bytes_verified > 0 && r.requests.finished > 500, "{what}: {json}");
            let errors =
                r.problems.iter().filter(|p| p.contains("is not registered") || p.contains("protocol"));
            assert_eq!(errors.count(), 0, "{what}: {json}");
        }
    }
}

#[test]
fn dropped_releases_are_reaped_and_the_ledger_says_so() {
    let mut config = quick("1P_TP2:1D_TP2", 8);
    config.faults.push(Fault::DropReleases { rank: rank(false, 0, 1), count: 2 });
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert_eq!(r.requests.finished, 8, "{json}");
    assert_eq!(
        (r.ledger.freed, r.ledger.reaped, r.ledger.reaped_excused, r.ledger.held),
        (6, 2, 2, 0),
        "{json}"
    );
    assert!(r.problems.iter().filter(|p| p.contains("reaped")).count() == 2, "{json}");
}

/// `quick(deployment, requests)` with the message faults of `flags` (`--lose-messages VALUE`
/// and the like, as the command line takes them).
fn with_messages(deployment: &str, requests: u32, flags: &[&str]) -> ClusterConfig {
    let mut config = quick(deployment, requests);
    for flag in flags {
        let (name, value) = flag.split_once(' ').expect("a flag and its value");
        let verb = [Verb::Lose, Verb::Duplicate, Verb::Delay]
            .into_iter()
            .find(|v| v.flag() == name)
            .expect("a message-fault flag");
        config.messages.push(MessageFault::parse(verb, value).unwrap_or_else(|e| panic!("{flag}: {e}")));
    }
    config
}

/// The fault log's summary line (its last).
fn message_summary(r: &ClusterResult) -> &str {
    r.faults.last().map_or("", |l| l.as_str())
}

#[test]
fn lost_releases_are_reaped_and_excused() {
    let r = run(with_messages("1P_TP2:1D_TP2", 8, &["--lose-messages D0.dp0.tp1:release=2"]));
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert_eq!((r.requests.finished, r.requests.failed), (8, 0), "{json}");
    let l = &r.ledger;
    assert_eq!((l.freed, l.reaped, l.reaped_excused, l.held), (6, 2, 2, 0), "{json}");
    assert_eq!(message_summary(&r), "message faults hit 2 messages: 2 releases lost", "{json}");
    let lost = r.faults.iter().filter(|f| f.contains(": lost release of tx-")).count();
    assert_eq!(lost, 2, "each lost release is listed with its transfer: {json}");
}

#[test]
fn lost_handshake_replies_cost_a_redial_or_fail_their_requests_excused() {
    // The first reply P0.dp0.tp1 sends to D0.dp0.tp1 is lost: that dial times out (2 s), the
    // worker dials again within the request's transfer timeout, and every request finishes.
    let r = run(with_messages("1P_TP2:1D_TP2", 8, &["--lose-messages P0.dp0.tp1:handshake-reply=1"]));
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert_eq!((r.requests.finished, r.requests.failed, r.ledger.freed), (8, 0, 8), "{json}");
    assert_eq!(message_summary(&r), "message faults hit 1 message: 1 handshake reply lost", "{json}");
    assert!(
        r.faults.iter().any(|f| f.contains("lost handshake reply from P0.dp0.tp1 to D0.dp0.tp1")),
        "{json}"
    );

    // Every reply of P0.dp0.tp1 is lost: D0.dp0.tp1 never completes its session, so every
    // request fails at its transfer timeout, and each failure is excused by the lost replies
    // (they touched both ends' DP groups while it was in flight). Nothing is reaped or held:
    // the failed requests are released.
    let r = run(with_messages("1P_TP2:1D_TP2", 8, &["--lose-messages P0.dp0.tp1:handshake-reply"]));
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    let q = &r.requests;
    assert_eq!((q.finished, q.failed, q.failed_excused, q.unfinished), (0, 8, 8, 0), "{json}");
    assert_eq!((r.ledger.freed, r.ledger.reaped, r.ledger.held), (8, 0, 0), "{json}");
    assert!(r.failures.iter().all(|f| f.errors.iter().all(|e| e.starts_with("D0.dp0.tp1: "))), "{json}");
}

#[test]
fn duplicated_releases_handshakes_and_leases_are_counted_once() {
    // Every release, lease and handshake message sent twice: each is counted once (releases
    // by distinct sender), so the run is clean with nothing failed, reaped or excused.
    let flags = ["--duplicate-messages P*.dp*.tp*:handshake,release,lease"];
    let r = run(with_messages("1P_TP4:1D_TP2", 24, &flags));
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    let q = &r.requests;
    assert_eq!((q.finished, q.failed, q.failed_excused), (24, 0, 0), "{json}");
    let l = &r.ledger;
    assert_eq!((l.freed, l.reaped, l.held, l.double_frees), (24, 0, 0, 0), "{json}");
    let summary = message_summary(&r);
    for kind in ["handshake requests duplicated", "handshake replies duplicated", "releases duplicated"] {
        assert!(summary.contains(kind), "{summary}");
    }
}

#[test]
fn delayed_dispatches_and_releases_end_clean() {
    // Below the reaper's delay a late dispatch and a late release change nothing but time.
    let flags = [
        "--delay-messages P0.dp0.tp*:dispatch:300",
        "--delay-messages D0.dp0.tp*:release:200@0.5",
        "--delay-messages P0.dp1.tp0:handshake-reply:100",
    ];
    let r = run(with_messages("1P_DP2TP2:1D_TP4", 40, &flags));
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    let q = &r.requests;
    assert_eq!((q.finished, q.failed), (40, 0), "{json}");
    let l = &r.ledger;
    assert_eq!((l.freed, l.reaped, l.held), (40, 0, 0), "{json}");
    let summary = message_summary(&r);
    for kind in ["20 dispatches delayed", "releases delayed", "handshake replies delayed"] {
        assert!(summary.contains(kind), "{summary}");
    }
    // Each late dispatch is listed with its transfer and the decode group it went to.
    assert!(
        r.faults.iter().any(|f| f.contains("delayed 300 ms dispatch of tx-") && f.contains("to D0.dp0")),
        "{json}"
    );
}

#[test]
fn bad_message_fault_flags_are_refused_naming_the_flag_and_the_reason() {
    let check = |extra: &[&str], stderr: &str| {
        let args = [&["cluster", "1P_TP2:1D_TP2", "--requests", "2"], extra].concat();
        let out = std::process::Command::new(exe()).args(&args).output().expect("pdkv runs");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(stderr), "{args:?}: {text}");
    };
    let lose = "'--lose-messages <PATTERN[:KINDS][=COUNT][@PROBABILITY]>'";
    let delay = "'--delay-messages <PATTERN[:KINDS]:DELAY_MS[=COUNT][@PROBABILITY]>'";
    let table: &[(&[&str], String)] = &[
        (&["--lose-messages", "D0.tp1"], format!("for {lose}: `D0.tp1` is not a rank pattern")),
        (&["--lose-messages", "D0.dp0.tp1:relese"], format!("for {lose}: `relese` is not a message kind")),
        (&["--lose-messages", "D0.dp0.tp1:release:2"], format!("for {lose}: expected PATTERN[:KINDS][=COUNT]")),
        (&["--lose-messages", "D0.dp0.tp1=0"], format!("for {lose}: count `0` must be a number from 1 to 1000000")),
        (&["--lose-messages", "D0.dp0.tp1=4294967296"], format!("for {lose}: count `4294967296` must be")),
        (&["--lose-messages", "D0.dp0.tp1@0"], format!("for {lose}: probability `0` must be a number above 0")),
        (&["--lose-messages", "D0.dp0.tp1@1.5"], format!("for {lose}: probability `1.5` must be")),
        (&["--lose-messages", "D0.dp0.tp1@NaN"], format!("for {lose}: probability `NaN` must be")),
        (&["--delay-messages", "D0.dp0.tp1"], format!("for {delay}: expected PATTERN[:KINDS]:DELAY_MS")),
        (&["--delay-messages", "D0.dp0.tp1:release:0"], format!("for {delay}: delay `0` must be a number of")),
        // The longest delay is a day: u64::MAX is refused, never wrapped.
        (
            &["--delay-messages", "D0.dp0.tp1:18446744073709551615"],
            format!("for {delay}: delay `18446744073709551615` must be a number of milliseconds from 1 to 86400000"),
        ),
        (&["--delay-messages", "D0.dp0.tp1:86400001"], format!("for {delay}: delay `86400001` must be")),
        (
            &["--duplicate-messages", "P*.dp*.tp*:release,dispatch"],
            "a dispatch cannot be duplicated".to_string(),
        ),
        // Well formed, but for another deployment: refused before any process starts.
        (
            &["--lose-messages", "D0.dp1.tp*"],
            "invalid cluster: --lose-messages D0.dp1.tp*: the pattern matches no rank of 1P_TP2:1D_TP2".into(),
        ),
        (
            &["--delay-messages", "P1.dp*.tp*:dispatch:5"],
            "invalid cluster: --delay-messages P1.dp*.tp*:dispatch:5: the pattern matches no rank".into(),
        ),
        (
            &["--lose-messages", "P*.dp*.tp*", "--foreign-side", "decode", "--foreign-driver", "false"],
            "--lose-messages P*.dp*.tp*: message faults are injected where pdkv sends".into(),
        ),
    ];
    for (extra, stderr) in table {
        check(extra, stderr);
    }
    let many: Vec<&str> = (0..33).flat_map(|_| ["--lose-messages", "P0.dp0.tp0=1"]).collect();
    check(&many, "33 message faults (--lose-messages, --duplicate-messages, --delay-messages and --drop-releases together): at most 32");
}

#[test]
fn cluster_cli_prints_the_result_and_refuses_bad_arguments() {
    let out = std::process::Command::new(exe())
        .args(["cluster", "1P_TP2:1D_TP4", "--requests", "4", "--json"])
        .output()
        .expect("pdkv runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(json["outcome"], "clean");
    assert_eq!(json["ledger"]["freed"], 4);
    assert_eq!(json["requests"]["finished"], 4);

    let check = |args: &[&str], code: i32, stderr: &str| {
        let out = std::process::Command::new(exe()).args(args).output().expect("pdkv runs");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {text}");
        assert!(text.contains(stderr), "{args:?}: {text}");
    };
    check(&["cluster", "1P_TP4:1D_TQ8"], 2, "TQ8");
    check(&["cluster", "1P_TP2:1D_TP2", "--kill", "P0.tp0"], 2, "'P0.tp0' is not a rank");
    check(&["cluster", "1P_TP2:1D_TP2", "--drop-releases", "D0.dp0.tp0=x"], 2, "count 'x'");
    // Arguments that parse but would start a cluster that fails everything (or overflows a
    // clock): refused before any process starts, naming the flag, without Debug quoting.
    let tp2 = |extra: &[&'static str]| [&["cluster", "1P_TP2:1D_TP2"], extra].concat();
    for (extra, stderr) in [
        (&["--requests", "0"][..], "--requests 0: must be between 1 and 1000000"),
        (&["--requests", "1000001"], "--requests 1000001: must be between 1 and 1000000"),
        (&["--concurrency", "0"], "--concurrency 0: must be between 1 and 4096"),
        (&["--concurrency", "4097"], "--concurrency 4097: must be between 1 and 4096"),
        (&["--decode-max-batch", "0"], "--decode-max-batch 0: must be between 1 and 4096"),
        (&["--decode-max-batch", "4097"], "--decode-max-batch 4097: must be between 1 and 4096"),
        (&["--layers", "0"], "--layers 0: must be between 1 and 64"),
        (&["--layers", "65535"], "--layers 65535: must be between 1 and 64"),
        (&["--handshake-timeout-ms", "0"], "--handshake-timeout-ms 0: must be between 1 and 10000000000"),
        (&["--transfer-timeout-ms", "18446744073709551615"], "--transfer-timeout-ms 18446744073709551615"),
        (&["--defer-timeout-ms", "0"], "--defer-timeout-ms 0: must be between"),
        (&["--timeout-ms", "99"], "--timeout-ms 99: must be between"),
        (&["--kill", "D0.dp0.tp0"], "--kill D0.dp0.tp0: 1P_TP2:1D_TP2 has no prefill rank D0.dp0.tp0"),
        (&["--kill", "P0.dp0.tp2"], "--kill P0.dp0.tp2: 1P_TP2:1D_TP2 has no prefill rank P0.dp0.tp2"),
        // The default --kill-after is 8: with 4 requests the kill could never happen.
        (&["--requests", "4", "--kill", "P0.dp0.tp0"], "--kill-after 8: the run prefills only 4 requests"),
        (&["--kill", "P0.dp0.tp0", "--restart-after-ms", "99999999999"], "--restart-after-ms 99999999999"),
        (
            &["--drop-releases", "P0.dp0.tp0=1"],
            "--drop-releases P0.dp0.tp0=1: 1P_TP2:1D_TP2 has no decode rank",
        ),
    ] {
        check(&tp2(extra), 2, stderr);
    }
    check(&["cluster", "1P_TP128:1D_TP64"], 2, "192 ranks, but a cluster on one host starts at most 128");
    // A foreign side's driver that cannot play: refused or stopped before a request is sent.
    let foreign = |side: &'static str, program: &'static str| {
        vec![
            "cluster",
            "1P_TP2:1D_TP2",
            "--requests",
            "2",
            "--foreign-side",
            side,
            "--foreign-driver",
            program,
        ]
    };
    check(
        &foreign("decode", "/nonexistent/driver"),
        2,
        "cannot start the foreign driver /nonexistent/driver",
    );
    check(&foreign("decode", "false"), 2, "the foreign driver exited before it was ready");
    check(
        &[foreign("prefill", "false"), vec!["--foreign-rules", "pdkv"]].concat(),
        2,
        "--foreign-rules pdkv",
    );
    // A kill of a foreign prefill rank is the driver's to play too (it kills the rank's code with
    // its data-plane server); nothing else can be injected into the foreign side.
    check(
        &[foreign("decode", "false"), vec!["--drop-releases", "D0.dp0.tp0=1"]].concat(),
        2,
        "--drop-releases D0.dp0.tp0=1: D0.dp0.tp0 is played by the foreign driver, which takes no \
         injected faults but --kill",
    );
    check(
        &[foreign("prefill", "false"), vec!["--kill", "P0.dp0.tp0", "--kill-after", "0"]].concat(),
        2,
        "the foreign driver exited before it was ready",
    );
    check(
        &[
            foreign("decode", "sh"),
            vec!["--foreign-driver-arg", "-c", "--foreign-driver-arg", "echo hello; exec sleep 60"],
        ]
        .concat(),
        2,
        "line 1 of the foreign driver (\"hello\")",
    );
    check(&["cluster", "1P_TP2:1D_TP2", "--foreign-side", "decode"], 2, "--foreign-driver");
    if !cfg!(feature = "rdma") {
        // Said once, before any rank starts (not once per rank process).
        let out = std::process::Command::new(exe())
            .args(["cluster", "1P_TP2:1D_TP2", "--transport", "rdma"])
            .output()
            .expect("pdkv runs");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert_eq!(text.lines().filter(|l| !l.trim().is_empty()).count(), 1, "{text}");
        assert!(text.contains("--transport rdma: this pdkv was built without the rdma feature"), "{text}");
    }
    check(
        &[
            "connector",
            "--deployment",
            "1P_TP2:1D_TP2",
            "--role",
            "prefill",
            "--engine",
            "0",
            "--dp",
            "0",
            "--tp",
            "5",
            "--scheduler",
            "127.0.0.1:9",
        ],
        2,
        "has no rank P0.dp0.tp5",
    );
}

#[test]
fn a_kill_after_zero_prefills_happens_before_the_first_request() {
    // Gone for good before anything was sent: every request of its group fails at once, each
    // excused by the kill, and the other group serves everything.
    let mut config = quick("1P_DP2TP2:1D_TP4", 16);
    config.faults.push(Fault::KillPrefill { rank: rank(true, 0, 1), after: 0, restart_after_ms: None });
    let r = run(config);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert!(r.faults[0].contains("after 0 prefills"), "{json}");
    let q = &r.requests;
    assert_eq!((q.finished, q.failed, q.failed_excused, q.unfinished), (8, 8, 8, 0), "{json}");
    assert!(r.failures.iter().all(|f| f.prefill == "P0.dp0" && f.errors == ["P0.dp0.tp1 is gone"]), "{json}");
    assert_eq!((r.ledger.freed, r.ledger.reaped, r.ledger.held), (8, 0, 0), "{json}");
    assert!(r.duration_s < 2.0, "nothing waited for a timeout: {json}");

    // Every request fails at once; the result lists the first 1000 and counts them all.
    let mut config = quick("1P_TP1:1D_TP1", 1500);
    config.faults.push(Fault::KillPrefill { rank: rank(true, 0, 0), after: 0, restart_after_ms: None });
    let r = run(config);
    assert_eq!((r.outcome.as_str(), r.requests.failed, r.requests.failed_excused), ("clean", 1500, 1500));
    assert_eq!(r.failures.len(), cluster::MAX_FAILURES_LISTED);
}

/// The `pdkv connector` processes this test process started for `deployment`, with their
/// command lines (Linux's /proc).
fn connectors_of(deployment: &str) -> Vec<(u32, Vec<String>)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent is the second field after the command name, which is in parentheses.
        let ppid =
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid != Some(me) {
            continue;
        }
        let Some(args) = cmdline(pid) else { continue };
        if args.iter().any(|a| a == "connector") && args.iter().any(|a| a == deployment) {
            found.push((pid, args));
        }
    }
    found
}

fn arg_after(args: &[String], flag: &str) -> String {
    let at = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} in {args:?}"));
    args[at + 1].clone()
}

fn env_of(pid: u32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    environ
        .split(|&b| b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .find_map(|v| v.strip_prefix(&prefix).map(str::to_owned))
}

#[test]
fn strangers_and_doubles_are_refused_and_the_run_goes_on() {
    // A deployment no other test uses, so that its connectors are this test's.
    let deployment = "1P_TP1:1D_TP2";
    let mut config = ClusterConfig::new(deployment, 60, exe());
    config.concurrency = 2;
    let mut intruders = Vec::new();
    let mut fired = false;
    // Mid-run (the progress callback runs in the scheduler's loop, which goes on once it
    // returns), start two connectors claiming the live prefill rank: one with a wrong token,
    // one with the run's own token, as a user who read it from /proc could.
    let result = cluster::run(config, &mut |p| {
        if fired || p.done < 3 {
            return;
        }
        fired = true;
        let ranks = connectors_of(deployment);
        let (pid, args) =
            ranks.iter().find(|(_, a)| a.iter().any(|x| x == "prefill")).expect("a prefill rank");
        let scheduler = arg_after(args, "--scheduler");
        let token = env_of(*pid, TOKEN_ENV).expect("the rank has the run's token");
        let join = |token: &str| {
            let ids = ["--role", "prefill", "--engine", "0", "--dp", "0", "--tp", "0"];
            std::process::Command::new(exe())
                .args(["connector", "--deployment", deployment, "--scheduler", &scheduler])
                .args(ids)
                .env(TOKEN_ENV, token)
                .output()
                .expect("pdkv runs")
        };
        intruders.push(("wrong membership token", join("0123")));
        intruders.push(("P0.dp0.tp0 is already running as process", join(&token)));
    })
    .expect("the cluster runs");
    let json = result.to_json();
    assert!(fired, "{json}");
    for (reason, out) in &intruders {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("the scheduler refused this connector") && stderr.contains(reason),
            "{stderr}"
        );
        let reported = "refused a connector that claimed to be P0.dp0.tp0 (process ";
        assert!(result.problems.iter().any(|p| p.starts_with(reported) && p.contains(reason)), "{json}");
    }
    // The live rank was not displaced: every request finished, every byte verified.
    assert_eq!(result.outcome, "clean", "{json}");
    assert_eq!((result.requests.finished, result.processes.refused), (60, 2), "{json}");
    let p = &result.processes;
    assert_eq!((p.started, p.exited_cleanly, p.failed), (3, 3, 0), "{json}");
}

/// Sends `signal` (`-KILL`, `-STOP`, ...) to a process with the system's `kill`.
fn send_signal(pid: u32, signal: &str) {
    let status =
        std::process::Command::new("kill").args([signal, &pid.to_string()]).status().expect("kill runs");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Runs `deployment` and, once a few requests ended, sends `signal` to the connector of
/// `victim` (by its command line's role and ids) from outside, as an operator or a crash would.
fn run_and_hit(deployment: &str, victim: [&str; 4], signal: &str) -> ClusterResult {
    run_and_hit_with(quick(deployment, 400), 4, victim, signal)
}

fn run_and_hit_with(
    mut config: ClusterConfig,
    concurrency: u32,
    victim: [&str; 4],
    signal: &str,
) -> ClusterResult {
    let deployment = config.deployment.clone();
    let deployment = deployment.as_str();
    config.concurrency = concurrency;
    // A reaper far beyond the run: what a lost rank held must be freed through the engine's
    // loss events (WorkerLost, ReaderLost), within the handshake and transfer timeouts.
    config.timeouts.defer_ms = 60_000;
    let mut hit = false;
    let result = cluster::run(config, &mut |p| {
        if hit || p.done < 5 {
            return;
        }
        hit = true;
        let [role, engine, dp, tp] = victim;
        let ranks = connectors_of(deployment);
        let is_victim = |a: &[String]| {
            arg_after(a, "--role") == role
                && arg_after(a, "--engine") == engine
                && arg_after(a, "--dp") == dp
                && arg_after(a, "--tp") == tp
        };
        let (pid, _) = ranks.iter().find(|(_, a)| is_victim(a)).expect("the victim runs");
        send_signal(*pid, signal);
    })
    .expect("the cluster runs");
    assert!(hit, "{}", result.to_json());
    result
}

#[test]
fn a_lost_decode_group_never_leaves_the_prefill_queue_waiting_for_blocks() {
    // The only decode group dies while the prefill queue waits for blocks (64 blocks, up to 25
    // a request, 64 in flight): each request prefilled afterwards gives its blocks back at once,
    // and that must start the next prefill, since nothing else will (found by cluster-fuzz seed
    // 962556817, which hung with 129 requests queued and nothing held).
    let mut config = quick("1P_TP1:1D_DP1TP1", 200);
    config.num_blocks = 64;
    let r = run_and_hit_with(config, 64, ["decode", "0", "0", "0"], "-KILL");
    let json = r.to_json();
    assert_eq!(r.outcome, "failed_requests", "{json}");
    assert_eq!((r.requests.unfinished, r.ledger.held, r.ledger.double_frees), (0, 0, 0), "{json}");
    assert_eq!(r.requests.finished + r.requests.failed, 200, "{json}");
}

#[test]
fn a_decode_group_that_lost_a_rank_stops_leasing_the_requests_it_had_queued() {
    // One request at a time, 64 in flight: when D0.dp0.tp1 dies, its group's scheduler still
    // queues requests its live rank leases. The scheduler takes them back (`Dequeued`), so the
    // live rank stops renewing, their leases run out and the engine reaps them after the
    // transfer timeout; without that, the live rank renewed them for as long as it ran and the
    // run ended with them held.
    let mut config = quick("1P_TP2:1D_DP1TP2", 300);
    config.decode_max_batch = 1;
    let r = run_and_hit_with(config, 64, ["decode", "0", "0", "1"], "-KILL");
    let json = r.to_json();
    assert_eq!(r.outcome, "failed_requests", "{json}");
    assert!(r.requests.queued_at_decode > 0, "{json}");
    assert_eq!((r.requests.unfinished, r.ledger.held, r.ledger.double_frees), (0, 0, 0), "{json}");
    assert_eq!(r.requests.finished + r.requests.failed, 300, "{json}");
}

#[test]
fn a_rank_that_dies_or_stops_without_an_injected_fault_fails_its_group_fast_and_the_run_is_not_clean() {
    // (deployment, victim, signal, the group's failures, what the report says). Each
    // deployment's spelling is this test's alone, so that its connectors are.
    let gone = "disconnected unexpectedly";
    let cases = [
        ("1P_TP2:1D_TP1", ["decode", "0", "0", "0"], "-KILL", "D0.dp0.tp0 is gone", gone),
        ("1P_DP2TP1:1D_TP1", ["prefill", "0", "1", "0"], "-KILL", "P0.dp1.tp0 is gone", gone),
        ("1P_TP1:1D_DP2", ["decode", "0", "1", "0"], "-STOP", "D0.dp1.tp0 is gone", "stopped answering"),
        // A TP group with a live member: the dead rank's vote counts as a no, so a step it
        // left open ends instead of waiting for it.
        ("1P_DP1TP2:1D_DP1TP2", ["decode", "0", "0", "1"], "-KILL", "D0.dp0.tp1 is gone", gone),
    ];
    for (deployment, victim, signal, error, problem) in cases {
        let r = run_and_hit(deployment, victim, signal);
        let json = r.to_json();
        // Nothing excuses the failures: the run is not clean.
        assert_eq!(r.outcome, "failed_requests", "{deployment}: {json}");
        let q = &r.requests;
        assert!(q.failed > 0 && q.failed_excused == 0 && q.unfinished == 0, "{deployment}: {json}");
        assert!(r.failures.iter().any(|f| f.errors == [error]), "{deployment}: {json}");
        assert!(r.problems.iter().any(|p| p.contains(problem)), "{deployment}: {json}");
        // The decode group's barrier never had an input it had to ignore (a vote or step
        // report it could not count), the dead rank's included.
        assert!(!r.problems.iter().any(|p| p.contains("decode group ignored")), "{deployment}: {json}");
        // Ended long before the run's timeout and the 60 s reaper, with nothing held: within
        // the 5 s a stopped rank takes to be found, plus the transfer timeout (5 s) and the
        // lease's grace (1 s) that a lost reader's transfers wait for.
        assert!(r.duration_s < 14.0, "{deployment}: {json}");
        assert_eq!((r.ledger.held, r.ledger.double_frees), (0, 0), "{deployment}: {json}");
        assert_eq!((r.processes.failed, r.processes.killed_at_shutdown), (1, 0), "{deployment}: {json}");
        assert!(r.violations.is_empty(), "{deployment}: {json}");
    }
}

#[test]
fn sigint_and_sigterm_stop_the_ranks_and_write_a_partial_result() {
    for (signal, code, name) in [("-INT", 130, "SIGINT"), ("-TERM", 143, "SIGTERM")] {
        let child = std::process::Command::new(exe())
            .args(["cluster", "1P_TP2:1D_TP2", "--requests", "1000000", "--concurrency", "4", "--json"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("pdkv runs");
        // Wait until its four ranks run, then a little, so that requests are in flight.
        let me = child.id();
        let ranks = || children_of(me);
        let start = std::time::Instant::now();
        while ranks().len() < 4 && start.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let pids = ranks();
        assert_eq!(pids.len(), 4, "{name}: ranks {pids:?}");
        std::thread::sleep(std::time::Duration::from_millis(500));
        send_signal(me, signal);
        let out = child.wait_with_output().expect("pdkv ends");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{name}: {stderr}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a result on stdout");
        assert_eq!(json["outcome"], "interrupted", "{name}: {json}");
        assert!(json["problems"][0].as_str().is_some_and(|p| p.contains(name)), "{name}: {json}");
        assert!(json["requests"]["unfinished"].as_u64() > Some(0), "{name}: {json}");
        // Every rank was told to shut down and exited cleanly; none is left.
        let p = &json["processes"];
        assert_eq!(
            (p["started"].as_u64(), p["exited_cleanly"].as_u64()),
            (Some(4), Some(4)),
            "{name}: {json}"
        );
        for pid in pids {
            assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "{name}: rank {pid} is left");
        }
    }
}

/// `--hold-dispatches-until-restart` on pdkv ranks: a prefill rank killed after the first
/// prefill and restarted 300 ms later. With the hold, every dispatch of a request its group
/// holds waits for the restart (none goes on while the rank is down, and the fault log says
/// when they were released: after the restart); without it, the first is dispatched at once,
/// at the kill, which is the race the hold removes. Either way the run is clean: every failure
/// and reaping is the kill's, nothing stays held.
#[test]
fn held_dispatches_of_a_killed_group_go_on_only_after_its_restart() {
    let check = |hold: bool| {
        let mut config = quick("1P_TP2:1D_TP2", 40);
        config.timeouts.defer_ms = 3_000;
        config.hold_dispatches_until_restart = hold;
        let killed = rank(true, 0, 1);
        config.faults.push(Fault::KillPrefill { rank: killed, after: 1, restart_after_ms: Some(300) });
        let r = run(config);
        let json = r.to_json();
        assert_eq!(r.outcome, "clean", "hold {hold}: {json}");
        let q = &r.requests;
        assert_eq!((q.failed_excused, q.unfinished, r.ledger.held), (q.failed, 0, 0), "hold {hold}: {json}");
        assert_eq!(r.ledger.reaped_excused, r.ledger.reaped, "hold {hold}: {json}");
        let restarted = r.faults.iter().position(|f| f.starts_with("P0.dp0.tp1 restarted"));
        let released = r.faults.iter().position(|f| f.starts_with("released "));
        (
            q.held_for_restart,
            q.dispatched_while_down,
            restarted.is_some(),
            released.map(|i| Some(i) > restarted),
        )
    };
    // With the hold: between 1 (the request whose prefill set off the kill) and the 8 in flight
    // are held, none dispatched while the rank is down, all released after the restart.
    let (held, while_down, restarted, released_after) = check(true);
    assert!((1..=8).contains(&held) && while_down == 0, "held {held}, dispatched while down {while_down}");
    assert_eq!((restarted, released_after), (true, Some(true)));
    // Without it: nothing held, and at least the first request is dispatched at the kill.
    let (held, while_down, restarted, released_after) = check(false);
    assert!(held == 0 && while_down >= 1, "held {held}, dispatched while down {while_down}");
    assert_eq!((restarted, released_after), (true, None));
}

/// `--hold-dispatches-until-restart` without a kill that restarts, or with a restart past the
/// run's budget, is refused before any process starts, naming the flag.
#[test]
fn hold_dispatches_until_restart_is_refused_without_a_restart() {
    let check = |extra: &[&str], stderr: &str| {
        let args =
            [&["cluster", "1P_TP2:1D_TP2", "--requests", "4", "--hold-dispatches-until-restart"], extra]
                .concat();
        let out = std::process::Command::new(exe()).args(&args).output().expect("pdkv runs");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(stderr), "{args:?}: {text}");
    };
    let needs = "--hold-dispatches-until-restart: holds decode dispatches until a killed prefill rank is \
                 back, so it needs --kill and --restart-after-ms";
    check(&[], needs);
    check(&["--kill", "P0.dp0.tp1", "--kill-after", "1"], needs);
    check(
        &["--kill", "P0.dp0.tp1", "--kill-after", "1", "--restart-after-ms", "5000", "--timeout-ms", "5000"],
        "--hold-dispatches-until-restart: --restart-after-ms 5000 is not within --timeout-ms 5000",
    );
}

/// The command line of process `pid`, word by word, if it is still there.
pub(crate) fn cmdline(pid: u32) -> Option<Vec<String>> {
    let bytes = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        bytes
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// The children of `parent` (Linux's /proc).
pub(crate) fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse().ok());
            ppid == Some(parent)
        })
        .collect()
}

#[test]
fn forged_releases_and_leases_from_outside_the_deployment_are_refused_and_counted() {
    // The forger (`--forge-messages`) sends, for every transfer as it is registered, releases
    // under each decode rank's sender key with no MAC and a wrong one, the legacy string, and
    // 49-day leases, to every prefill notify listener, at 256 in flight.
    let forged_run = |auth| {
        let mut config = ClusterConfig::new("1P_TP2:1D_TP2", 1000, exe());
        config.concurrency = 256;
        config.forge_messages = true;
        config.control_auth = auth;
        cluster::run(config, &mut |_| {}).expect("the cluster runs")
    };
    let r = forged_run(cluster::ControlAuthMode::Require);
    let json = r.to_json();
    assert_eq!(r.outcome, "clean", "{json}");
    assert!(r.violations.is_empty(), "{json}");
    assert_eq!((r.requests.finished, r.ledger.freed, r.ledger.reaped), (1000, 1000, 0), "{json}");
    let c = &r.control;
    let forged = c.forged.as_ref().expect("the result says what the forger did");
    assert_eq!(forged.ids_fed + forged.ids_dropped, 1000, "{json}");
    assert!(forged.releases_sent > 0 && forged.leases_sent > 0, "{json}");
    // Everything refused came from the forger, and all it sent that arrived was refused:
    // none was taken, and no lease was long enough to be capped.
    assert_eq!(forged.refused, c.refused_releases + c.refused_leases, "{json}");
    assert!(c.refused_releases > 0 && c.refused_leases > 0, "{json}");
    assert!(forged.refused <= forged.releases_sent + forged.leases_sent, "{json}");
    assert_eq!(c.unauthenticated + c.bad_mac, forged.refused, "{json}");
    assert_eq!(c.leases_capped, 0, "{json}");
    assert!(
        c.refused_from.iter().all(|line| forged.from.iter().any(|a| line.starts_with(a.as_str()))),
        "{json}"
    );

    // The same forger against ranks that take anyone's releases, as MoRIIO's do: blocks are
    // freed under live reads, and the run's checks catch it (the data plane refuses the reads
    // of freed blocks, so the requests fail rather than read another request's bytes).
    let r = forged_run(cluster::ControlAuthMode::Open);
    let json = r.to_json();
    assert_ne!(r.outcome, "clean", "{json}");
    assert!(r.requests.failed > 0, "{json}");
    let c = &r.control;
    assert_eq!((c.refused_releases, c.refused_leases), (0, 0), "{json}");
    // Its leases were taken, but for the transfer timeout, not 49 days.
    assert!(c.leases_capped > 0, "{json}");
}

/// The addresses process `pid` listens on, as (IPv4 address in /proc's hex, port) (Linux's
/// /proc: its socket inodes, found in the system's table of TCP sockets in the LISTEN state).
fn listening(pid: u32) -> Vec<(String, u16)> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let mut found: Vec<(String, u16)> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let listening = fields.get(3) == Some(&"0A");
            let (ip, port) = fields.get(1)?.rsplit_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let ours = inodes.iter().any(|i| Some(&i.as_str()) == fields.get(9));
            (listening && ours).then(|| (ip.to_string(), port))
        })
        .collect();
    found.sort_unstable_by_key(|&(_, port)| port);
    found
}

#[test]
fn a_release_from_a_stranger_is_refused_named_and_the_run_is_not_clean() {
    // A deployment no other test uses, so that its connectors are this test's.
    let deployment = "1P_DP1TP1:1D_TP1";
    let mut config = ClusterConfig::new(deployment, 40, exe());
    config.concurrency = 2;
    let mut stranger = None;
    // Mid-run, a process that is no part of the run (`pdkv forge`, started here, not by the
    // scheduler) sends a release and two leases to the prefill rank's notify listener. With one
    // prefill rank, its notify port is its handshake port plus one (both engine port blocks are
    // one rank wide).
    let result = cluster::run(config, &mut |p| {
        if stranger.is_some() || p.done < 3 {
            return;
        }
        let ranks = connectors_of(deployment);
        let (pid, _) = ranks.iter().find(|(_, a)| a.iter().any(|x| x == "prefill")).expect("a prefill rank");
        let listening = listening(*pid);
        // Handshake, notify and data plane, each on the configured host only (127.0.0.1, which
        // /proc writes as 0100007F), never on every interface.
        assert_eq!(listening.len(), 3, "{listening:?}");
        assert!(listening.iter().all(|(ip, _)| ip == "0100007F"), "{listening:?}");
        let ports: Vec<u16> = listening.iter().map(|&(_, port)| port).collect();
        let notify = ports.iter().find(|&&p| ports.contains(&(p.wrapping_sub(1)))).copied();
        let notify = notify.unwrap_or_else(|| panic!("no notify port among {ports:?}"));
        let mut child = std::process::Command::new(exe())
            .args(["forge", "--target", &format!("127.0.0.1:{notify}")])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("pdkv runs");
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(b"tx-from-a-stranger\n").unwrap();
        let out = child.wait_with_output().expect("the forger ends");
        stranger = Some(String::from_utf8_lossy(&out.stdout).into_owned());
    })
    .expect("the cluster runs");
    let json = result.to_json();
    let said = stranger.expect("the stranger was sent");
    let from = said.lines().find_map(|l| l.strip_prefix("from ")).unwrap_or_else(|| panic!("{said}"));
    assert!(said.ends_with("sent 1 2\n"), "{said}");
    // The rank refused all three, the result names where they came from, and a run in which
    // anyone but the deployment sent control messages is not clean.
    let c = &result.control;
    // The legacy string and a lease carry no MAC, the other lease a wrong one.
    assert_eq!((c.refused_releases, c.refused_leases), (1, 2), "{json}");
    assert_eq!((c.unauthenticated, c.bad_mac), (2, 1), "{json}");
    assert_eq!(c.refused_from, [format!("{from} -> P0.dp0.tp0")], "{json}");
    assert_eq!(result.outcome, "safety_violation", "{json}");
    let detail = &result.violations[0].detail;
    assert!(detail.contains(&format!("while no forger was injected: 3 from {from}")), "{detail}");
    // The stranger changed nothing else: every request finished from its own releases.
    assert_eq!((result.requests.finished, result.ledger.freed, result.ledger.reaped), (40, 40, 0), "{json}");
}
