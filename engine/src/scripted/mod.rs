//! Scripted protocol tests: a tiny in-test driver that delivers the nodes' messages in an order
//! each test chooses (no simulator), to show the hangs, leaks and fixes at node level.

mod harness;

use harness::{tx, Harness, LAYERS};
use pdkv_core::decode::{DecodeEvent, ReadOp, ReadOutcome, RecvError, RecvRequest, StepError};
use pdkv_core::ids::{EngineId, RankId, RequestId};
use pdkv_core::legacy::{Legacy, LegacyOptions};
use pdkv_core::prefill::{EngineAction, EngineEvent, WorkerEvent};
use pdkv_core::release::Release;
use pdkv_core::time::{NS_PER_MS, NS_PER_S};

/// Eager: one lost handshake reply in a TP8 group fails the step on all eight workers with the
/// same error within the handshake timeout; the next step succeeds once the peer answers, and
/// the transfer then completes and frees once.
#[test]
fn eager_lost_reply_fails_the_whole_group_then_recovers() {
    let mut h = Harness::new("1P_TP8:1D_TP8", LegacyOptions::none());
    let req = h.prefill_done(1, 0, 0, &[3, 4, 5]);
    h.begin_step(0, 1, std::slice::from_ref(&req));
    assert_eq!(h.dials.len(), 8);
    let lost = RankId::new(EngineId::decode(0), 0, 3);
    h.deliver_dials(|d| d.from != lost);
    let open = h.barrier(0).open_vote().expect("the vote is open");
    assert_eq!(open.missing, [lost.tp_rank()], "seven workers voted; the eighth still waits for its reply");
    h.advance(10 * NS_PER_S);
    h.deliver_votes();
    let results = h.step_results(1);
    assert_eq!(results.len(), 8);
    for (rank, result) in &results {
        assert_eq!(result, &Some(StepError::GroupHandshakeFailed { step: 1 }), "{rank}");
    }
    // The seven workers whose sessions are complete read anyway: reads never block a step, and
    // holding them back would starve the group while a peer stays unreachable.
    assert_eq!(h.reads.len(), 7 * LAYERS, "one read per layer per worker with a session");
    assert!(h.reads.iter().all(|r| r.0 != lost) && h.received.is_empty());

    // Next step: the failed session is dialled again and this time the peer answers.
    h.advance(NS_PER_MS);
    h.begin_step(0, 2, &[]);
    assert_eq!(h.dials.len(), 1, "only the failed session is redialled");
    h.deliver_dials(|_| true);
    h.deliver_votes();
    assert!(h.step_results(2).iter().all(|(_, r)| r.is_none()), "{:?}", h.step_results(2));
    assert_eq!(h.reads.len(), 8 * LAYERS, "one read per layer per worker");
    h.complete_reads(|_, _| ReadOutcome::Ok);
    assert_eq!(h.received.len(), 8);
    h.deliver_releases(1);
    assert_eq!(h.frees(), [(tx(1), false)]);
}

/// Lazy (legacy): the same loss leaves the worker blocked while its seven peers report ready —
/// the divergence that hangs the forward collective. Without a handshake timeout it never ends.
#[test]
fn lazy_lost_reply_blocks_one_worker_while_peers_are_ready() {
    let legacy = LegacyOptions::none().with(Legacy::LazyHandshake).with(Legacy::NoHandshakeTimeout);
    let mut h = Harness::new("1P_TP8:1D_TP8", legacy);
    let req = h.prefill_done(1, 0, 0, &[3]);
    h.begin_step(0, 1, &[req]);
    let lost = RankId::new(EngineId::decode(0), 0, 3);
    h.deliver_dials(|d| d.from != lost);
    let results = h.step_results(1);
    assert_eq!(results.len(), 7, "{results:?}");
    assert!(results.iter().all(|(rank, r)| *rank != lost && r.is_none()));
    h.advance(600 * NS_PER_S);
    assert!(h.decoder(lost).is_blocked(), "still blocked after the 600 s collective timeout");
    assert_eq!(h.step_results(1).len(), 7);

    // With a handshake timeout but still lazy, the blocked worker fails alone after 10 s,
    // while its peers are in the collective: the group still diverges.
    let mut h = Harness::new("1P_TP8:1D_TP8", LegacyOptions::none().with(Legacy::LazyHandshake));
    let req = h.prefill_done(1, 0, 0, &[3]);
    h.begin_step(0, 1, &[req]);
    h.deliver_dials(|d| d.from != lost);
    h.advance(10 * NS_PER_S);
    let results = h.step_results(1);
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.is_some()).collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, lost);
    assert_eq!(results.len(), 8);
}

/// P4 -> D8: each prefill rank is read by two decode ranks and completes after exactly two
/// releases; the blocks are freed once, after the last one.
#[test]
fn p4_to_d8_needs_two_releases_per_rank_and_frees_once() {
    let mut h = Harness::new("1P_TP4:1D_TP8", LegacyOptions::none());
    h.step_with_request(1, 0, &[7, 8], 0);
    h.complete_reads(|_, _| ReadOutcome::Ok);
    let mut releases = std::mem::take(&mut h.releases);
    assert_eq!(releases.len(), 8);
    releases.sort_by_key(|(to, r)| (to.tp, r.sender.clone()));
    let targets: Vec<u16> = releases.iter().map(|(to, _)| to.tp).collect();
    assert_eq!(targets, [0, 0, 1, 1, 2, 2, 3, 3]);
    for (i, (to, release)) in releases.into_iter().enumerate() {
        assert!(h.frees().is_empty(), "freed after {i} releases");
        h.worker_event(to, WorkerEvent::Release(release));
    }
    assert_eq!(h.frees(), [(tx(1), false)]);
    let finished: Vec<_> =
        h.engine_log.iter().filter(|a| matches!(a, EngineAction::FinishedSending { .. })).collect();
    assert_eq!(finished.len(), 1);
}

/// P8 -> D4: ranks 1, 3, 5, 7 are never read. The default frees without the reaper; MoRIIO's
/// per-rank counting (legacy no-zero-quorum) leaves them to the reaper.
#[test]
fn p8_to_d4_frees_without_reaper_only_with_zero_quorum() {
    for (legacy, reaped) in
        [(LegacyOptions::none(), false), (LegacyOptions::none().with(Legacy::NoZeroQuorum), true)]
    {
        let mut h = Harness::new("1P_TP8:1D_TP4", legacy.clone());
        h.step_with_request(1, 0, &[1], 0);
        h.complete_reads(|_, _| ReadOutcome::Ok);
        let read: Vec<u16> = h.releases.iter().map(|(to, _)| to.tp).collect();
        assert_eq!(read, [0, 2, 4, 6]);
        h.deliver_releases(1);
        if reaped {
            assert!(h.frees().is_empty(), "{legacy:?}");
            h.advance(60 * NS_PER_S);
        }
        assert_eq!(h.frees(), [(tx(1), reaped)], "{legacy:?}");
        assert_eq!(h.prefill.engine(0).totals().reaped, u64::from(reaped));
    }
}

/// P8 -> D4 under vLLM 0.33's rules, with either engine following them: each decode rank still
/// reads one prefill rank (0, 2, 4, 6) but releases both holders of its share, every prefill rank
/// waits for one release (vLLM 0.33's uniform quorum), and the blocks are freed once, without
/// the reaper. A pdkv decode adapts to a vLLM prefill, a pdkv prefill to a vLLM decode.
#[test]
fn p8_to_d4_under_vllm_rules_releases_every_holder_and_frees_once() {
    use pdkv_core::policy::{PeerBook, PeerRules::Vllm033};
    use pdkv_core::release::Quorum;
    let (p0, d0) = (EngineId::prefill(0), EngineId::decode(0));
    // (peers, releases sent to which prefill TP ranks, quorum registered on each rank)
    let table = [
        (PeerBook::pdkv(), vec![0, 2, 4, 6], [1, 0, 1, 0, 1, 0, 1, 0]),
        (PeerBook::pdkv().with(p0, Vllm033), (0..8).collect(), [1; 8]),
        (PeerBook::pdkv().with(d0, Vllm033), (0..8).collect(), [1; 8]),
        (PeerBook::pdkv().with(p0, Vllm033).with(d0, Vllm033), (0..8).collect(), [1; 8]),
    ];
    for (peers, released, quorums) in table {
        let mut h = Harness::with_peers("1P_TP8:1D_TP4", LegacyOptions::none(), peers.clone());
        h.step_with_request(1, 0, &[1], 0);
        let registered: Vec<u16> = h
            .engine_log
            .iter()
            .filter_map(|a| match a {
                EngineAction::Register { quorum: Quorum::Exact(n), .. } => Some(*n),
                _ => None,
            })
            .collect();
        assert_eq!(registered, quorums, "{peers:?}");
        let read: Vec<u16> = h.reads.iter().map(|(_, op)| op.plan.source.tp).collect();
        assert!(read.iter().all(|tp| tp % 2 == 0), "{peers:?}: reads {read:?}");
        h.complete_reads(|_, _| ReadOutcome::Ok);
        let mut to: Vec<u16> = h.releases.iter().map(|(to, _)| to.tp).collect();
        to.sort();
        assert_eq!(to, released, "{peers:?}");
        h.deliver_releases(1);
        assert_eq!(h.frees(), [(tx(1), false)], "{peers:?}");
    }
}

/// A flexible read (TP1 decode of a TP8 MLA prefill) under vLLM 0.33's rules releases all eight
/// prefill ranks, every one of which holds the latent it read; pdkv releases the rank read.
#[test]
fn flexible_read_under_vllm_rules_releases_every_prefill_rank() {
    use pdkv_core::policy::{PeerBook, PeerRules::Vllm033};
    for (peers, released) in
        [(PeerBook::pdkv(), 1), (PeerBook::pdkv().with(EngineId::prefill(0), Vllm033), 8)]
    {
        let mut h = Harness::with_peers("1P_TP8:1D_DP8EP", LegacyOptions::none(), peers.clone());
        h.step_with_request(1, 0, &[1], 3);
        h.complete_reads(|_, _| ReadOutcome::Ok);
        assert_eq!(h.releases.len(), released, "{peers:?}");
        h.deliver_releases(1);
        assert_eq!(h.frees(), [(tx(1), false)], "{peers:?}");
    }
}

/// A network-duplicated release never completes a transfer early by default.
#[test]
fn duplicated_release_never_completes_early() {
    let mut h = Harness::new("1P_TP4:1D_TP8", LegacyOptions::none());
    h.step_with_request(1, 0, &[2], 0);
    h.complete_reads(|_, _| ReadOutcome::Ok);
    let releases = std::mem::take(&mut h.releases);
    // Every release is delivered three times, the first decode rank of each pair first.
    let (first, second): (Vec<_>, Vec<_>) =
        releases.into_iter().partition(|(_, r)| r.sender.as_ref().unwrap().tp_rank % 2 == 0);
    for (to, release) in first {
        for _ in 0..3 {
            h.worker_event(to, WorkerEvent::Release(release.clone()));
        }
    }
    assert!(h.frees().is_empty(), "duplicates of one sender completed a fan-in of two");
    for (to, release) in second {
        h.worker_event(to, WorkerEvent::Release(release));
    }
    assert_eq!(h.frees(), [(tx(1), false)]);
}

/// A failed read still sends the release, so the producer frees; the decode side marks the
/// blocks invalid and reports the request failed.
#[test]
fn read_failure_still_frees_the_producer() {
    let mut h = Harness::new("1P_TP8:1D_TP8", LegacyOptions::none());
    h.step_with_request(1, 0, &[9], 0);
    let broken = RankId::new(EngineId::decode(0), 0, 5);
    h.complete_reads(|rank, op| {
        if rank == broken && op.layer == Some(1) {
            ReadOutcome::Failed("remote access error".into())
        } else {
            ReadOutcome::Ok
        }
    });
    assert_eq!(h.failed.len(), 1);
    assert_eq!(h.failed[0].2, RecvError::ReadFailed("remote access error".into()));
    assert_eq!(h.invalidated, [(broken, RequestId(1))]);
    assert_eq!(h.received.len(), 7);
    assert_eq!(h.releases.len(), 8, "the failed worker released too");
    h.deliver_releases(1);
    assert_eq!(h.frees(), [(tx(1), false)]);
    // The failed read dropped its session: the next request on that worker handshakes again
    // (a restarted peer has new memory keys); the others reuse theirs.
    let req = h.prefill_done(2, 0, 0, &[10]);
    h.begin_step(0, 2, &[req]);
    let redialled: Vec<RankId> = h.dials.iter().map(|d| d.from).collect();
    assert_eq!(redialled, [broken]);
}

/// Send-queue-full is retried with doubling backoff (1, 2, 4 ... 50 ms) until the transfer
/// timeout, then the request fails and still releases.
#[test]
fn send_queue_full_backs_off_until_transfer_timeout() {
    let mut h = Harness::new("1P_TP1:1D_TP1", LegacyOptions::none());
    h.step_with_request(1, 0, &[0], 0);
    h.reads.retain(|(_, op)| op.layer != Some(1));
    h.complete_reads(|_, _| ReadOutcome::Ok);
    let rank = RankId::new(EngineId::decode(0), 0, 0);
    let mut delays = Vec::new();
    for _ in 0..8 {
        let before = h.now;
        h.decode_event(
            rank,
            DecodeEvent::ReadDone {
                request: RequestId(1),
                layer: Some(1),
                outcome: ReadOutcome::SendQueueFull,
            },
        );
        let due = h.decoder(rank).poll_timeout().unwrap();
        delays.push(due.since_ns(before) / NS_PER_MS);
        h.advance(due.since_ns(before));
        assert_eq!(h.reads.len(), 1, "the read is posted again when its retry is due");
        assert_eq!(h.reads[0].1.layer, Some(1));
        h.reads.clear();
    }
    assert_eq!(delays, [1, 2, 4, 8, 16, 32, 50, 50]);
    assert!(h.failed.is_empty());
    h.advance(30 * NS_PER_S);
    // The last retry is posted and unanswered at the deadline: it is aborted and drained first.
    assert_eq!(h.aborts, [(rank, RequestId(1))]);
    assert!(h.failed.is_empty() && h.releases.is_empty(), "nothing ends while the read is posted");
    let aborted =
        DecodeEvent::ReadDone { request: RequestId(1), layer: Some(1), outcome: ReadOutcome::Aborted };
    h.decode_event(rank, aborted);
    assert!(matches!(h.failed.as_slice(), [(_, RequestId(1), RecvError::Timeout { .. })]), "{:?}", h.failed);
    assert_eq!(h.releases.len(), 1, "a timed-out request still releases");
}

/// Legacy notify-other-rank: the owner is DP 1 but the release goes to DP 0, so the read
/// rank waits for the reaper; by default the read rank is the one released.
#[test]
fn legacy_notify_other_rank_leaves_the_read_rank_to_the_reaper() {
    for (legacy, reaped) in
        [(LegacyOptions::none(), false), (LegacyOptions::none().with(Legacy::NotifyOtherRank), true)]
    {
        let mut h = Harness::new("1P_DP2:1D_TP2", legacy.clone());
        h.step_with_request(1, 1, &[4], 0);
        let read: Vec<u16> = h.reads.iter().map(|(_, op)| op.plan.source.dp).collect();
        assert!(read.iter().all(|&dp| dp == 1), "reads go to the owner DP rank");
        h.complete_reads(|_, _| ReadOutcome::Ok);
        let notified: Vec<u16> = h.releases.iter().map(|(to, _)| to.dp).collect();
        assert_eq!(notified, if reaped { [0, 0] } else { [1, 1] }, "{legacy:?}");
        h.deliver_releases(1);
        h.advance(60 * NS_PER_S);
        assert_eq!(h.frees(), [(tx(1), reaped)], "{legacy:?}");
    }
}

/// The reaper fences (revokes remote access) before it frees, unless the legacy option says
/// to free regardless of reads in flight.
#[test]
fn reaper_fences_before_freeing_by_default() {
    for (legacy, fenced) in
        [(LegacyOptions::none(), true), (LegacyOptions::none().with(Legacy::ReaperIgnoresReads), false)]
    {
        let mut h = Harness::new("1P_TP2:1D_TP2", legacy.clone());
        h.prefill_done(1, 0, 0, &[4]);
        h.advance(60 * NS_PER_S);
        let kinds: Vec<&str> = h
            .engine_log
            .iter()
            .filter_map(|a| match a {
                EngineAction::Fence { .. } => Some("fence"),
                EngineAction::FreeBlocks { .. } => Some("free"),
                EngineAction::ReapWarning { .. } => Some("warn"),
                _ => None,
            })
            .collect();
        let expected: &[&str] = if fenced { &["warn", "fence", "free"] } else { &["warn", "free"] };
        assert_eq!(kinds, expected, "{legacy:?}");
    }
}

/// Flexible reads (TP1 decode, TP8 MLA prefill): one rank is read; the group completes on its
/// release and every rank's blocks are freed once, without the reaper.
#[test]
fn flexible_read_completes_the_whole_group() {
    let mut h = Harness::new("1P_TP8:1D_DP8EP", LegacyOptions::none());
    h.step_with_request(1, 0, &[6], 3);
    assert!(h.reads.iter().all(|(_, op)| op.plan.source.tp == 3), "DP rank 3's first pick is TP 3");
    h.complete_reads(|_, _| ReadOutcome::Ok);
    h.deliver_releases(1);
    assert_eq!(h.frees(), [(tx(1), false)]);
    let done = h.engine_log.iter().filter(|a| matches!(a, EngineAction::GroupDone { .. })).count();
    assert_eq!(done, 7);
}

/// A release that arrives before prefill registered the transfer is buffered and counted.
#[test]
fn early_release_is_applied_at_registration() {
    let mut h = Harness::new("1P_TP1:1D_TP1", LegacyOptions::none());
    let prefill = RankId::new(EngineId::prefill(0), 0, 0);
    let early =
        Release { transfer_id: tx(1), consumer_tp_size: Some(1), sender: None, incarnation: None, mac: None };
    h.worker_event(prefill, WorkerEvent::Release(early));
    assert!(h.frees().is_empty());
    h.prefill_done(1, 0, 0, &[0]);
    assert_eq!(h.frees(), [(tx(1), false)]);
}

/// A read lease keeps the reaper away while a slow read may be in flight; the legacy reaper
/// ignores it and frees under the read.
#[test]
fn read_lease_defers_the_reaper_until_the_read_can_no_longer_run() {
    for (legacy, reaped) in
        [(LegacyOptions::none(), false), (LegacyOptions::none().with(Legacy::ReaperIgnoresReads), true)]
    {
        let mut h = Harness::new("1P_TP1:1D_TP1", legacy.clone());
        h.set_defer_timeout_ns(NS_PER_S);
        h.step_with_request(1, 0, &[5], 0);
        assert_eq!(h.leases, 1, "one lease per request, sent when the worker takes it");
        h.advance(5 * NS_PER_S);
        assert_eq!(h.frees().is_empty(), !reaped, "{legacy:?}: a 1 s reaper against a read leased for 30 s");
        h.complete_reads(|_, _| ReadOutcome::Ok);
        h.deliver_releases(1);
        assert_eq!(h.frees(), [(tx(1), reaped)], "{legacy:?}");
    }
}

/// Every worker retires a transfer before its blocks return to the pool, whether released or
/// reaped: a driver that gives freed blocks to the next prefill at once (as `pdkv cluster` does)
/// must not let the old transfer's retirement (which fences the blocks on a real rank) land
/// after the new transfer's fill. Found at 34 requests in flight, when the pool first ran out.
#[test]
fn workers_retire_a_transfer_before_its_blocks_are_freed() {
    for reap in [false, true] {
        let mut h = Harness::new("1P_TP2:1D_TP2", LegacyOptions::none());
        h.step_with_request(1, 0, &[3, 4], 0);
        if reap {
            h.advance(120 * NS_PER_S);
        } else {
            h.complete_reads(|_, _| ReadOutcome::Ok);
            h.deliver_releases(1);
        }
        let kinds: Vec<&str> = h
            .engine_log
            .iter()
            .filter_map(|a| match a {
                EngineAction::Retire { .. } => Some("retire"),
                EngineAction::FreeBlocks { .. } => Some("free"),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, ["retire", "retire", "free"], "reaped: {reap}");
    }
}

/// The drain rule: a request whose transfer timeout passes (or one of whose reads fails) while
/// reads are posted aborts them and releases only once every one was answered, so the producer
/// never frees blocks a posted read may still complete from. The legacy option releases at once.
#[test]
fn a_failing_request_releases_only_after_its_posted_reads_are_answered() {
    // (legacy on, how the request fails)
    for (legacy_on, timeout) in [(false, true), (false, false), (true, true), (true, false)] {
        let legacy = if legacy_on {
            LegacyOptions::none().with(Legacy::ReleaseDuringReads)
        } else {
            LegacyOptions::none()
        };
        let mut h = Harness::new("1P_TP1:1D_TP1", legacy);
        h.step_with_request(1, 0, &[2], 0);
        let reads = std::mem::take(&mut h.reads);
        assert!(reads.len() >= 2, "per-layer reads: {}", reads.len());
        let rank = reads[0].0;
        if timeout {
            h.advance(31 * NS_PER_S);
        } else {
            let op = &reads[0].1;
            let failed = ReadOutcome::Failed("remote access error".into());
            h.decode_event(
                rank,
                DecodeEvent::ReadDone { request: op.request(), layer: op.layer, outcome: failed },
            );
        }
        let case = format!("legacy {legacy_on}, timeout {timeout}");
        if legacy_on {
            assert_eq!(h.releases.len(), 1, "{case}: released under the posted reads");
            assert!(h.aborts.is_empty(), "{case}");
            continue;
        }
        assert!(h.releases.is_empty() && h.failed.is_empty(), "{case}: nothing ends before the drain");
        assert_eq!(h.aborts, [(rank, RequestId(1))], "{case}");
        // Answer the remaining reads (the first one already answered when it failed).
        let left: Vec<&(RankId, ReadOp)> = reads.iter().skip(usize::from(!timeout)).collect();
        for (i, (rank, op)) in left.iter().enumerate() {
            assert!(h.releases.is_empty(), "{case}: released with {} reads unanswered", left.len() - i);
            let outcome = if i == 0 { ReadOutcome::Ok } else { ReadOutcome::Aborted };
            h.decode_event(*rank, DecodeEvent::ReadDone { request: op.request(), layer: op.layer, outcome });
        }
        assert_eq!(h.releases.len(), 1, "{case}: one release after the drain");
        assert_eq!(h.failed.len(), 1, "{case}: the request fails once");
        let expected_timeout = matches!(h.failed[0].2, RecvError::Timeout { .. });
        assert_eq!(expected_timeout, timeout, "{case}: {}", h.failed[0].2);
    }
}

/// A request queued behind a full decode batch keeps its source leased until a step admits it:
/// the 60 s reaper would otherwise free KV the request has yet to read (found with
/// `decode_max_batch: 1`, where requests wait minutes for their turn).
#[test]
fn a_queued_request_keeps_its_source_leased_until_admission() {
    for told in [true, false] {
        let mut h = Harness::new("1P_TP1:1D_TP1", LegacyOptions::none());
        let request = h.prefill_done(1, 0, 0, &[7]);
        let rank = RankId::new(EngineId::decode(0), 0, 0);
        if told {
            let queued = RecvRequest { local_block_ids: Vec::new(), ..request.clone() };
            h.decode_event(rank, DecodeEvent::Queued { requests: vec![queued] });
        }
        // Five minutes in the queue, a second at a time.
        for _ in 0..300 {
            h.advance(NS_PER_S);
        }
        assert_eq!(h.frees().is_empty(), told, "told the worker it is queued: {told}");
        if !told {
            continue;
        }
        assert!(h.leases >= 10, "renewed every 15 s: {} leases", h.leases);
        h.begin_step(0, 1, &[request]);
        h.deliver_dials(|_| true);
        h.deliver_votes();
        h.complete_reads(|_, _| ReadOutcome::Ok);
        h.deliver_releases(1);
        assert_eq!(h.frees(), [(tx(1), false)], "freed by its release, not reaped");
        assert_eq!(h.decoder(rank).queued_requests(), 0);
    }
}

/// A prefill worker that dies for good: its part of every transfer it holds counts as done, so
/// the group's blocks are freed once the live workers are released, long before the reaper.
/// A flexible transfer is not completed by a loss (another rank may be the one being read).
#[test]
fn a_lost_prefill_worker_does_not_hold_its_group_until_the_reaper() {
    let mut h = Harness::new("1P_TP2:1D_TP2", LegacyOptions::none());
    h.step_with_request(1, 0, &[3], 0);
    let dead = RankId::new(EngineId::prefill(0), 0, 1);
    // The decode rank reading the dead rank fails its reads; its release goes nowhere.
    h.complete_reads(|_, op| {
        if op.plan.source == dead {
            ReadOutcome::Failed("connection refused".into())
        } else {
            ReadOutcome::Ok
        }
    });
    h.releases.retain(|(to, _)| *to != dead);
    h.deliver_releases(1);
    assert!(h.frees().is_empty(), "the dead rank's part is still owed");
    h.engine_event(0, EngineEvent::WorkerLost { rank: dead });
    assert_eq!(h.frees(), [(tx(1), false)], "freed by the live release and the loss, not reaped");

    // Flexible: TP1 decode reads one of eight replicated ranks; losing another rank completes
    // nothing, the read rank's release does.
    let mut h = Harness::new("1P_TP8:1D_DP8EP", LegacyOptions::none());
    h.step_with_request(1, 0, &[6], 3);
    let read = h.reads[0].1.plan.source;
    let other = RankId::new(EngineId::prefill(0), 0, (read.tp + 1) % 8);
    h.engine_event(0, EngineEvent::WorkerLost { rank: other });
    assert!(h.frees().is_empty(), "a loss is never the read of a flexible transfer");
    h.complete_reads(|_, _| ReadOutcome::Ok);
    h.deliver_releases(1);
    assert_eq!(h.frees(), [(tx(1), false)]);
}

/// A decode rank that dies for good never releases: the transfers its group was to read are
/// reaped (fenced first) as soon as their read leases end, not `defer_timeout` after
/// registration.
#[test]
fn a_lost_reader_has_its_transfers_reaped_when_their_leases_end() {
    let mut h = Harness::new("1P_TP2:1D_TP2", LegacyOptions::none());
    h.set_defer_timeout_ns(600 * NS_PER_S);
    h.step_with_request(1, 0, &[3], 0);
    let dead = RankId::new(EngineId::decode(0), 0, 1);
    // The live rank reads and releases; the dead one never does.
    h.complete_reads(|rank, _| if rank == dead { ReadOutcome::Aborted } else { ReadOutcome::Ok });
    let live_releases: Vec<_> = h.releases.iter().filter(|(to, _)| to.tp == 0).cloned().collect();
    h.releases = live_releases;
    h.deliver_releases(1);
    h.engine_event(0, EngineEvent::ReaderLost { rank: dead });
    assert!(h.frees().is_empty(), "the lease (30 s) still covers the reads");
    h.advance(32 * NS_PER_S);
    assert_eq!(h.frees(), [(tx(1), true)], "reaped after the lease and its grace, not after 600 s");
    assert!(
        h.engine_log.iter().any(|a| matches!(a, EngineAction::Fence { .. })),
        "fenced before it was freed"
    );
}
