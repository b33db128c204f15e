//! Unit tests of the outcome rules, admission, port probing, the model and the request stream.

use std::path::PathBuf;

use pdkv_core::rng::Stream;

use super::clients::REQUEST_STREAM;
use super::procs::probe_window;
use super::result::outcome;
use super::*;

#[test]
fn outcomes_follow_the_simulators_rules_and_failed_requests_are_not_clean() {
    let ledger =
        |held, reaped, excused| Ledger { held, reaped, reaped_excused: excused, ..Ledger::default() };
    // `sent` and `finished` do not matter: only failures without an excuse do.
    let requests = |failed, excused| Requests { failed, failed_excused: excused, ..Requests::default() };
    let check = |violated, hung, r: Requests, l: Ledger, expected: &str| {
        assert_eq!(
            outcome(violated, false, hung, false, &r, &l).name(),
            expected,
            "{violated} {hung} {r:?} {l:?}"
        );
    };
    check(false, false, requests(0, 0), ledger(0, 0, 0), "clean");
    check(false, false, requests(0, 0), ledger(0, 3, 3), "clean");
    check(false, false, requests(0, 0), ledger(0, 3, 2), "leak");
    check(false, false, requests(0, 0), ledger(1, 0, 0), "leak");
    check(false, true, requests(0, 0), ledger(1, 0, 0), "hang");
    check(true, true, requests(0, 0), ledger(1, 0, 0), "safety_violation");
    // The bug of 1P_TP1:1D_TP1 at concurrency 100: 264 requests failed, no fault injected,
    // nothing held at the end; that run said clean.
    check(false, false, requests(264, 0), ledger(0, 0, 0), "failed_requests");
    // A kill excuses the failures of requests it was exposed to, and only those.
    check(false, false, requests(5, 5), ledger(0, 4, 4), "clean");
    check(false, false, requests(6, 5), ledger(0, 4, 4), "failed_requests");
    check(false, false, requests(6, 5), ledger(0, 4, 3), "failed_requests");
    check(false, true, requests(6, 5), ledger(0, 0, 0), "hang");
    // A budget that ends while requests still finish: transfers in flight are held, and
    // that is neither a hang nor a leak; unexcused failures still say more.
    let ended = |r: Requests, l: Ledger| outcome(false, false, false, true, &r, &l).name();
    assert_eq!(ended(requests(0, 0), ledger(36, 0, 0)), "incomplete");
    assert_eq!(ended(requests(2, 0), ledger(36, 0, 0)), "failed_requests");
    // A stopped run is partial: unfinished requests and held transfers are expected of it;
    // only a violation seen before the stop says more.
    let stopped = |violated, expected: &str| {
        assert_eq!(outcome(violated, true, true, false, &requests(3, 0), &ledger(2, 0, 0)).name(), expected);
    };
    stopped(false, "interrupted");
    stopped(true, "safety_violation");
}

#[test]
fn only_the_process_started_for_a_rank_joins_and_only_once() {
    let p0 = RankId::new(EngineId::prefill(0), 0, 0);
    let d1 = RankId::new(EngineId::decode(0), 0, 1);
    let mut admission = Admission { token: "t0k3n".into(), ..Admission::default() };
    admission.expected.insert(p0, 100);
    admission.expected.insert(d1, 101);
    let mut check = |rank, pid, token: &str, expected: Result<(), &str>| {
        let got = admission.admit(rank, pid, token).map_err(|e| e.to_string());
        match expected {
            Ok(()) => assert_eq!(got, Ok(()), "{rank} {pid} {token}"),
            Err(e) => {
                assert!(got.as_ref().is_err_and(|g| g.contains(e)), "{rank} {pid} {token}: {got:?}")
            }
        }
    };
    check(p0, 100, "", Err("no membership token"));
    check(p0, 100, "guess", Err("wrong membership token"));
    // A second connector with the id of a live rank, even holding the token.
    check(p0, 999, "t0k3n", Err("P0.dp0.tp0 is already running as process 100; process 999 is not it"));
    check(RankId::new(EngineId::prefill(0), 0, 7), 100, "t0k3n", Err("this run has no rank P0.dp0.tp7"));
    check(p0, 100, "t0k3n", Ok(()));
    check(p0, 100, "t0k3n", Err("has joined already"));
    check(d1, 101, "t0k3n", Ok(()));
}

#[test]
fn listener_ports_are_probed_outside_the_ephemeral_range() {
    let check = |ephemeral, count, expected| assert_eq!(probe_window(ephemeral, count), expected);
    check(Some((32_768, 60_999)), 24, (10_000, 32_767));
    check(None, 24, (10_000, 32_767));
    check(Some((1_024, 49_999)), 24, (50_000, 65_535));
    check(Some((1_024, 65_535)), 24, (10_000, 65_535));
}

#[test]
fn the_model_replicates_heads_for_heterogeneous_tp() {
    let check = |notation: &str, mla: bool, expected: (bool, u16, u32)| {
        let mut config = ClusterConfig::new(notation, 1, PathBuf::from("pdkv"));
        config.mla = mla;
        let d = Deployment::parse(notation).unwrap();
        let m = config.model(&d);
        assert_eq!((m.use_mla, m.kv_heads, m.bytes_per_token_per_layer), expected, "{notation}");
        for &decode in &d.decode {
            for &prefill in &d.prefill {
                let pair = pdkv_core::routing::check_pair(decode, prefill, &m);
                assert!(pair.is_ok(), "{notation}: {pair:?}");
            }
        }
    };
    check("1P_TP4:1D_TP8", false, (false, 4, 512));
    check("1P_TP8:1D_TP4", false, (false, 4, 512));
    check("1P_DP2TP2:1D_TP4", false, (false, 2, 256));
    check("1P_TP16:1D_TP16", false, (false, 8, 1024));
    check("2P_TP2:1D_DP2", true, (true, 1, 576));
}

#[test]
fn request_lengths_stay_in_their_range_and_repeat_for_a_seed() {
    let draw = |seed| {
        let mut s = Stream::new(seed, REQUEST_STREAM);
        (0..1000).map(|_| s.range(48, 400)).collect::<Vec<_>>()
    };
    let a = draw(7);
    assert!(a.iter().all(|&x| (48..=400).contains(&x)));
    assert_eq!(a, draw(7));
    assert_ne!(a, draw(8));
}
