//! The plugin's nodes on loopback without vLLM: a prefill rank and a decode rank run in this
//! process, wired as the Python connector wires them; every landed byte must be the staged one,
//! and the engine must free each transfer once.

use std::time::{Duration, Instant};

use pdkv_core::ids::RankId;

use super::config::EngineConfig;
use super::decode::DecodeNode;
use super::prefill::PrefillNode;
use super::rank::InProcessRank;
use crate::sched::{FromRank, ToRank};

fn config(engine: &str, port: u16) -> String {
    format!(
        r#"{{"deployment": "1P_TP1:1D_TP1", "engine": "{engine}", "host": "127.0.0.1",
        "handshake_port": {port}, "notify_port": {}, "model": {{"use_mla": false, "kv_heads": 2,
        "layers": 2, "bytes_per_token_per_layer": 64, "block_size_tokens": 4}}}}"#,
        port + 100
    )
}

/// Waits for the first message `pick` accepts, keeping the others in `backlog`.
fn wait(rank: &InProcessRank, backlog: &mut Vec<FromRank>, pick: impl Fn(&FromRank) -> bool) -> FromRank {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(i) = backlog.iter().position(&pick) {
            return backlog.remove(i);
        }
        assert!(Instant::now() < deadline, "{}: nothing wanted came; got {backlog:?}", rank.rank());
        backlog.extend(rank.poll(Duration::from_millis(200)).expect("the rank runs"));
    }
}

/// A prefill rank and a decode rank of `1P_TP1:1D_TP1` on loopback, both ready, with the
/// prefill engine's node (told the prefill rank's incarnation) and the decode side's node.
struct Pair {
    p_rank: InProcessRank,
    d_rank: InProcessRank,
    p_said: Vec<FromRank>,
    d_said: Vec<FromRank>,
    prefill: PrefillNode,
    decode: DecodeNode,
}

impl Pair {
    /// The pair on ports from `base` (plus a per-process offset, so parallel test runs differ).
    fn start(base: u16) -> Pair {
        let port = base + (std::process::id() % 800) as u16 * 2;
        let (p, d) = (config("P0", port), config("D0", port));
        let (p, d) = (EngineConfig::parse(&p).expect("valid"), EngineConfig::parse(&d).expect("valid"));
        let p_rank = InProcessRank::start(&p, RankId::new(p.engine, 0, 0), 16).expect("starts");
        let d_rank = InProcessRank::start(&d, RankId::new(d.engine, 0, 0), 16).expect("starts");
        let (mut p_said, mut d_said) = (Vec::new(), Vec::new());
        let ready = wait(&p_rank, &mut p_said, |m| matches!(m, FromRank::Ready { .. }));
        wait(&d_rank, &mut d_said, |m| matches!(m, FromRank::Ready { .. }));
        let mut prefill = PrefillNode::new(p);
        prefill.handle_worker_message(p_rank.rank(), ready);
        Pair { p_rank, d_rank, p_said, d_said, prefill, decode: DecodeNode::new(d) }
    }

    /// The decode side asks for `answer`'s KV into `local` blocks and runs the step: returns
    /// what the decode rank said of the request (received or failed).
    fn receive(&mut self, answer: pdkv_core::params::KvTransferParams, local: Vec<u32>) -> FromRank {
        self.decode.handle_request(answer, local).expect("routable");
        let Some((step, begin)) = self.decode.poll_step() else { panic!("a step with the request") };
        self.d_rank.deliver(begin).expect("delivered");
        let vote = wait(&self.d_rank, &mut self.d_said, |m| matches!(m, FromRank::Vote { .. }));
        assert_eq!(vote, FromRank::Vote { step, ok: true });
        self.d_rank.deliver(ToRank::VoteResult { step, ok: true }).expect("delivered");
        wait(&self.d_rank, &mut self.d_said, |m| {
            matches!(m, FromRank::Received { .. } | FromRank::RecvFailed { .. })
        })
    }

    fn stop(self) {
        self.p_rank.shutdown(Duration::from_secs(5));
        self.d_rank.shutdown(Duration::from_secs(5));
    }
}

/// `kv_transfer_params` a router sends to prefill for `transfer`.
fn remote_decode(transfer: &pdkv_core::ids::TransferId) -> pdkv_core::params::KvTransferParams {
    pdkv_core::params::KvTransferParams {
        do_remote_decode: true,
        transfer_id: Some(transfer.to_string()),
        ..Default::default()
    }
}

#[test]
fn staged_kv_crosses_from_prefill_to_decode_and_is_freed_once() {
    let mut pair = Pair::start(21_000);
    let block_len = pair.p_rank.staged().block_len as usize;
    let blocks = vec![5, 2, 9];
    let layers: Vec<Vec<u8>> =
        (0..2u8).map(|l| (0..blocks.len() * block_len).map(|i| (i as u8) ^ (l * 37)).collect()).collect();
    for (layer, data) in layers.iter().enumerate() {
        pair.p_rank.staged().stage(layer, &blocks, data).expect("fits");
    }
    let transfer = pdkv_core::ids::TransferId::new("tx-00000000000000000000000000000001");
    pair.p_rank.staged_transfer(transfer.clone(), blocks.clone(), Duration::from_secs(10)).expect("granted");
    let mut params = remote_decode(&transfer);
    params.remote_tp_size = Some(1);
    let answer = pair.prefill.handle_finished("req-0", &params, 0, blocks.clone()).expect("held");
    for (_, msg) in pair.prefill.poll_to_workers() {
        pair.p_rank.deliver(msg).expect("delivered");
    }
    let local = vec![1, 0, 15];
    let got = pair.receive(answer, local.clone());
    assert!(matches!(got, FromRank::Received { .. }), "{got:?}");
    for (layer, data) in layers.iter().enumerate() {
        assert_eq!(&pair.d_rank.staged().unstage(layer, &local).expect("fits"), data, "layer {layer}");
    }
    let finished = wait(&pair.p_rank, &mut pair.p_said, |m| matches!(m, FromRank::Finished { .. }));
    pair.prefill.handle_worker_message(pair.p_rank.rank(), finished);
    assert_eq!(pair.prefill.poll_freed(), vec!["req-0".to_string()]);
    assert_eq!(pair.prefill.held(), 0);
    // Freed once: the retirement goes to the rank, and nothing is freed again.
    assert!(pair.prefill.poll_to_workers().iter().any(|(_, m)| matches!(m, ToRank::Retire { .. })));
    pair.prefill.handle_tick();
    assert!(pair.prefill.poll_freed().is_empty());
    pair.stop();
}

/// A read of blocks the prefill rank never staged (its host lost the race, or never computed
/// them) is refused; the decode rank fails the request, and its release still reaches the
/// prefill rank, so the engine frees the transfer at once instead of holding it until the
/// reaper.
#[test]
fn a_refused_read_fails_the_request_and_still_releases_the_transfer() {
    refused_read(23_000, false);
}

/// The same with the registration reaching the prefill rank after the release (vLLM carries it
/// in the next step's metadata, and the decode side may be faster): the early release is kept
/// and counted when the registration comes.
#[test]
fn a_release_that_overtakes_its_registration_is_counted_when_it_comes() {
    refused_read(24_000, true);
}

fn refused_read(base: u16, register_late: bool) {
    let mut pair = Pair::start(base);
    let transfer = pdkv_core::ids::TransferId::new("tx-00000000000000000000000000000002");
    // Registered, but never staged.
    let answer =
        pair.prefill.handle_finished("req-1", &remote_decode(&transfer), 0, vec![3, 4]).expect("held");
    let registration = pair.prefill.poll_to_workers();
    if !register_late {
        for (_, msg) in registration.clone() {
            pair.p_rank.deliver(msg).expect("delivered");
        }
    }
    let got = pair.receive(answer, vec![7, 8]);
    assert!(matches!(got, FromRank::RecvFailed { .. }), "{got:?}");
    if register_late {
        // Give the release time to arrive first.
        std::thread::sleep(Duration::from_millis(200));
        for (_, msg) in registration {
            pair.p_rank.deliver(msg).expect("delivered");
        }
    }
    let finished = wait(&pair.p_rank, &mut pair.p_said, |m| matches!(m, FromRank::Finished { .. }));
    pair.prefill.handle_worker_message(pair.p_rank.rank(), finished);
    assert_eq!(pair.prefill.poll_freed(), vec!["req-1".to_string()]);
    pair.stop();
}

/// Blocks vLLM frees and hands to the next request: the retirement of the transfer that held
/// them (which fences them) reaches the rank before the new transfer's staging (which opens
/// them), in that order, however the two race; a read of the new transfer then succeeds.
#[test]
fn blocks_reused_after_a_retirement_are_readable_by_the_next_transfer() {
    let mut pair = Pair::start(25_000);
    let block_len = pair.p_rank.staged().block_len as usize;
    let blocks = vec![6, 1];
    let old = pdkv_core::ids::TransferId::new("tx-000000000000000000000000000000aa");
    let new = pdkv_core::ids::TransferId::new("tx-000000000000000000000000000000bb");
    pair.p_rank.staged_transfer(old.clone(), blocks.clone(), Duration::from_secs(10)).expect("granted");
    // The old transfer is retired (its blocks fenced) just before the new one is staged.
    pair.p_rank.deliver(ToRank::Retire { transfer_id: old, incarnation: None }).expect("delivered");
    let data: Vec<u8> = (0..blocks.len() * block_len).map(|i| (i % 251) as u8).collect();
    for layer in 0..2 {
        pair.p_rank.staged().stage(layer, &blocks, &data).expect("fits");
    }
    pair.p_rank.staged_transfer(new.clone(), blocks.clone(), Duration::from_secs(10)).expect("granted");
    let answer = pair.prefill.handle_finished("req-2", &remote_decode(&new), 0, blocks).expect("held");
    for (_, msg) in pair.prefill.poll_to_workers() {
        pair.p_rank.deliver(msg).expect("delivered");
    }
    let got = pair.receive(answer, vec![2, 3]);
    assert!(matches!(got, FromRank::Received { .. }), "{got:?}");
    assert_eq!(pair.d_rank.staged().unstage(1, &[2, 3]).expect("fits"), data);
    pair.stop();
}

/// What a decode request reads: block i of the prompt on each side, in either shape of
/// `remote_block_ids`, with the tail that holds no prompt KV (decode's block for its first new
/// token, or a MoRIIO prefill's block for its next one) left out; anything unreadable refused.
#[test]
fn a_request_pairs_each_prompt_block_with_its_remote_block() {
    let engine = EngineConfig::parse(&config("D0", 9)).expect("valid");
    let mut node = DecodeNode::new(engine);
    let mut check = |remote: &str, local: &[u32], expected: Result<(&[u64], &[u32]), &str>| {
        let params = format!(
            r#"{{"do_remote_prefill": true, "transfer_id": "tx-1", "remote_block_ids": {remote},
            "remote_engine_id": "127.0.0.1:9000", "remote_host": "127.0.0.1",
            "remote_handshake_port": 9000, "remote_notify_port": 9100, "remote_tp_size": 1}}"#
        );
        let params = serde_json::from_str(&params).expect("parses");
        let got = node.handle_request(params, local.to_vec()).map_err(|e| e.to_string());
        match expected {
            Ok((remote, local)) => {
                assert_eq!(got.as_ref().map(|(_, l)| l.as_slice()), Ok(local), "{remote:?}");
                let Some((_, ToRank::StepBegin { requests, .. })) = node.poll_step() else {
                    panic!("a step with the request")
                };
                let read = &requests[0];
                assert_eq!(read.params.remote_block_ids.single_group(), Ok(remote), "{remote:?}");
                assert_eq!(read.local_block_ids, local, "{remote:?}");
            }
            Err(text) => assert!(got.as_ref().is_err_and(|e| e.contains(text)), "{remote}: {got:?}"),
        }
    };
    check("[4, 5, 6]", &[1, 2, 3], Ok((&[4, 5, 6], &[1, 2, 3])));
    check("[[4, 5, 6]]", &[1, 2, 3], Ok((&[4, 5, 6], &[1, 2, 3])));
    check("[[4, 5]]", &[1, 2, 3], Ok((&[4, 5], &[1, 2])));
    check("[[4, 5, 6, 7]]", &[1, 2, 3], Ok((&[4, 5, 6], &[1, 2, 3])));
    check("[]", &[1], Ok((&[], &[])));
    check("[[4], [5]]", &[1], Err("names 2 KV cache groups"));
    check("[4]", &[], Err("1 remote blocks for no local ones"));
}
