//! Tests of one decode worker on its own, driven by hand (the scripted tests in
//! `crate::scripted` drive it together with the other nodes).

use super::*;
use crate::ids::EngineId;
use crate::legacy::{Legacy, LegacyOptions};
use crate::params::{extension_names, KvTransferParams};
use crate::policy::Policy;
use crate::ports::EngineAddress;
use crate::topology::Deployment;
use crate::wire::{Extensions, HandshakeMetadata};

/// The worker of decode rank (0, 0) of a TP1 deployment, under `legacy`.
fn worker(legacy: &LegacyOptions) -> DecodeWorker {
    let d = Deployment::parse("1P_TP1:1D_TP1").unwrap();
    let rank = RankId::new(EngineId::decode(0), 0, 0);
    let config = DecodeConfig::new(
        rank,
        d.layout(rank.engine),
        d.model.clone(),
        Policy::from(legacy),
        "decode-0:6301".into(),
    );
    DecodeWorker::new(config)
}

/// Request `n`, whose KV a TP1 prefill engine at host `prefill-<n>` holds: each such request
/// reads through a session of its own.
fn request_on_own_host(n: u64) -> RecvRequest {
    let address =
        EngineAddress { host: format!("prefill-{n}"), handshake_port_base: 6301, notify_port_base: 61005 };
    RecvRequest {
        request: RequestId(n),
        prefill_engine: EngineId::prefill(0),
        params: KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(format!("transfer-{n}")),
            remote_block_ids: vec![1].into(),
            remote_engine_id: Some(address.engine_id()),
            remote_dp_size: Some(1),
            remote_tp_size: Some(1),
            ..Default::default()
        },
        prefill_address: address,
        local_block_ids: vec![1],
    }
}

/// The worker keeps at most [`MAX_WORKER_SESSIONS`] sessions. A request whose source would need
/// one more fails with a typed error, in either handshake mode, and the step goes on for the
/// requests the worker holds; before, the step indexed the missing session and panicked.
#[test]
fn a_request_past_the_session_limit_fails_and_the_step_goes_on() {
    let lazy = LegacyOptions::none().with(Legacy::LazyHandshake);
    // Eager dials every session at once; lazy dials the first and blocks on it.
    for (legacy, dials) in [(LegacyOptions::none(), MAX_WORKER_SESSIONS), (lazy, 1)] {
        let mut w = worker(&legacy);
        let requests = (0..=MAX_WORKER_SESSIONS as u64).map(request_on_own_host).collect();
        let mut out = Vec::new();
        w.handle(Instant::ZERO, DecodeEvent::StepBegin { step: 1, requests }, &mut out);
        let failed: Vec<(RequestId, RecvError)> = out
            .iter()
            .filter_map(|a| match a {
                DecodeAction::RequestFailed { request, error } => Some((*request, error.clone())),
                _ => None,
            })
            .collect();
        let last = RequestId(MAX_WORKER_SESSIONS as u64);
        assert_eq!(failed, [(last, RecvError::TooManySessions)], "{legacy:?}");
        assert_eq!(w.pending_requests(), MAX_WORKER_SESSIONS, "{legacy:?}");
        let dialled = out.iter().filter(|a| matches!(a, DecodeAction::DialHandshake { .. })).count();
        assert_eq!(dialled, dials, "{legacy:?}");
    }
}

/// Request `n` on the one TP1 prefill engine at host `prefill-0`, whose answer carried
/// `pdkv_extensions` as `engine` says (`None`: no such key, as from MoRIIO).
fn request_with(n: u64, engine: Option<Extensions>) -> RecvRequest {
    let mut request = request_on_own_host(0);
    request.request = RequestId(n);
    request.params.transfer_id = Some(format!("transfer-{n}"));
    request.params.pdkv_extensions = engine.and_then(extension_names);
    request
}

/// The first reply part of rank `prefill-0`, advertising `extensions`.
fn metadata(extensions: Extensions) -> HandshakeMetadata {
    HandshakeMetadata {
        engine_id: "prefill-0:6301".into(),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: vec![1 << 30],
        num_blocks: 16,
        block_len: 4096,
        attn_backend_name: "FLASHMLA".into(),
        rank: None,
        extensions,
        incarnation: None,
    }
}

/// The transfers leased in `out`, in order.
fn leases(out: &[DecodeAction]) -> Vec<String> {
    out.iter()
        .filter_map(|a| match a {
            DecodeAction::SendLease { lease, .. } => Some(lease.transfer_id.to_string()),
            _ => None,
        })
        .collect()
}

/// The session the worker dialled in `out`, if it dialled one.
fn dialled(out: &[DecodeAction]) -> Option<SessionKey> {
    out.iter().find_map(|a| match a {
        DecodeAction::DialHandshake { session, .. } => Some(session.clone()),
        _ => None,
    })
}

/// Runs step `step` with `requests` at `now` to its end, answering its dial (if any) with
/// metadata advertising `rank`; returns the actions at step begin and those at the metadata.
fn step_through(
    w: &mut DecodeWorker,
    now: Instant,
    step: u64,
    requests: Vec<RecvRequest>,
    rank: Extensions,
) -> (Vec<DecodeAction>, Vec<DecodeAction>) {
    let mut begin = Vec::new();
    w.handle(now, DecodeEvent::StepBegin { step, requests }, &mut begin);
    let mut at_metadata = Vec::new();
    if let Some(session) = dialled(&begin) {
        let meta =
            DecodeEvent::HandshakeMetadata { session: session.clone(), metadata: Box::new(metadata(rank)) };
        w.handle(now, meta, &mut at_metadata);
        let layers = vec![crate::wire::LayerMemoryDesc { layer_name: "l0".into(), descs: vec![vec![0]] }];
        let mut rest = Vec::new();
        w.handle(now, DecodeEvent::HandshakeDescriptors { session, layers }, &mut rest);
        // Reads start only after the metadata's leases.
        assert!(leases(&rest).is_empty());
    }
    let mut rest = Vec::new();
    w.handle(now, DecodeEvent::VoteResult { step, ok: true }, &mut rest);
    (begin, at_metadata)
}

/// A lease goes only to a rank that advertised read leases: its handshake metadata once heard
/// (which wins), before that its engine's `pdkv_extensions`; with neither, the lease is held
/// until the metadata says. A MoRIIO rank (no key anywhere) is never sent one.
#[test]
fn leases_go_only_to_ranks_that_advertised_them() {
    let (pdkv, moriio) = (Some(Extensions::ALL), None);
    // (engine's answer, what the rank's metadata says, heard in an earlier step,
    //  leases at step begin, leases when the metadata arrives)
    let cases = [
        (pdkv, Extensions::ALL, false, 1, 0),
        (moriio, Extensions::ALL, false, 0, 1),
        (moriio, Extensions::NONE, false, 0, 0),
        (Some(Extensions::NONE), Extensions::ALL, false, 0, 0),
        // The engine's word is used until the rank's own, which then wins.
        (pdkv, Extensions::NONE, false, 1, 0),
        (moriio, Extensions::ALL, true, 1, 0),
        (pdkv, Extensions::NONE, true, 0, 0),
    ];
    for (engine, rank, heard_before, at_begin, at_metadata) in cases {
        let case = format!("engine {engine:?}, rank {rank:?}, heard before {heard_before}");
        let mut w = worker(&LegacyOptions::none());
        if heard_before {
            step_through(&mut w, Instant::ZERO, 1, vec![request_with(100, None)], rank);
        }
        let (begin, metadata) = step_through(&mut w, Instant::ZERO, 2, vec![request_with(1, engine)], rank);
        assert_eq!(leases(&begin).len(), at_begin, "{case}: at step begin");
        assert_eq!(leases(&metadata).len(), at_metadata, "{case}: at the metadata");
        assert_eq!(dialled(&begin).is_some(), !heard_before, "{case}");
    }
}

/// A queued request the engine takes back is no longer renewed: once every one is taken back
/// no renewal is armed, so a request that never comes back cannot keep its transfer leased.
#[test]
fn a_dequeued_request_is_no_longer_renewed() {
    let mut w = worker(&LegacyOptions::none());
    let mut out = Vec::new();
    let queued = vec![request_with(1, None), request_with(2, None)];
    w.handle(Instant::ZERO, DecodeEvent::Queued { requests: queued }, &mut out);
    assert_eq!(w.queued_requests(), 2);
    let rows: [(&[u64], usize, bool); 3] = [(&[1], 1, true), (&[1, 7], 1, true), (&[2], 0, false)];
    for (taken, queued, armed) in rows {
        let requests = taken.iter().map(|&n| RequestId(n)).collect();
        w.handle(Instant::ZERO, DecodeEvent::Dequeued { requests }, &mut out);
        assert_eq!((w.queued_requests(), w.poll_timeout().is_some()), (queued, armed), "{taken:?}");
    }
}

/// Queued requests of a rank nobody advertised for: no lease and no renewal until the rank's
/// metadata arrives (a step admits one of them and dials); then every held lease of that rank
/// goes at once, and the queued one is renewed from then on. A MoRIIO rank gets none, ever.
#[test]
fn held_leases_of_queued_requests_go_when_the_rank_advertises() {
    for (rank, expected) in [(Extensions::ALL, 2), (Extensions::NONE, 0)] {
        let mut w = worker(&LegacyOptions::none());
        let mut out = Vec::new();
        let queued = vec![request_with(1, None), request_with(2, None)];
        w.handle(Instant::ZERO, DecodeEvent::Queued { requests: queued }, &mut out);
        assert!(leases(&out).is_empty(), "{rank:?}");
        // Renewals come due and send nothing while the leases are held.
        let renew = w.poll_timeout().expect("a renewal is armed");
        w.handle(renew, DecodeEvent::Tick, &mut out);
        assert!(leases(&out).is_empty(), "{rank:?}");
        let (begin, at_metadata) = step_through(&mut w, renew, 1, vec![request_with(1, None)], rank);
        assert!(leases(&begin).is_empty(), "{rank:?}");
        assert_eq!(leases(&at_metadata), ["transfer-1", "transfer-2"][..expected], "{rank:?}");
        assert_eq!(w.queued_requests(), 1);
        let mut renewed = Vec::new();
        let next = w.poll_timeout().expect("a renewal is armed");
        assert!(next > renew);
        w.handle(next, DecodeEvent::Tick, &mut renewed);
        assert_eq!(leases(&renewed).len(), expected / 2, "{rank:?}: the queued request's renewal");
    }
}

/// Runs step `step` with `requests` to its end, answering its dial (if any) with metadata of
/// incarnation `answer`, and returns every action of the step.
fn step_answering(
    w: &mut DecodeWorker,
    step: u64,
    requests: Vec<RecvRequest>,
    answer: Option<crate::ids::Incarnation>,
) -> Vec<DecodeAction> {
    let now = Instant::ZERO;
    let mut out = Vec::new();
    w.handle(now, DecodeEvent::StepBegin { step, requests }, &mut out);
    if let Some(session) = dialled(&out) {
        let metadata = HandshakeMetadata { incarnation: answer, ..metadata(Extensions::ALL) };
        w.handle(
            now,
            DecodeEvent::HandshakeMetadata { session: session.clone(), metadata: Box::new(metadata) },
            &mut out,
        );
        let layers = vec![crate::wire::LayerMemoryDesc { layer_name: "l0".into(), descs: vec![vec![0]] }];
        w.handle(now, DecodeEvent::HandshakeDescriptors { session, layers }, &mut out);
    }
    w.handle(now, DecodeEvent::VoteResult { step, ok: true }, &mut out);
    out
}

/// Request `n` on the TP1 engine at `prefill-0`, its answer naming `holder` as the incarnation
/// holding the transfer.
fn request_held_by(n: u64, holder: crate::ids::Incarnation) -> RecvRequest {
    let mut request = request_with(n, Some(Extensions::ALL));
    request.params.pdkv_incarnations = crate::params::incarnation_values(&[holder]);
    request
}

/// What a step did with its requests, in short: `dial`, `read <inc>`, `lease <inc>`,
/// `release <inc>`, `failed <error>`, in action order.
fn summary(out: &[DecodeAction]) -> Vec<String> {
    let inc = |i: Option<crate::ids::Incarnation>| i.map_or("-".to_string(), |i| i.value().to_string());
    out.iter()
        .filter_map(|a| match a {
            DecodeAction::DialHandshake { .. } => Some("dial".to_string()),
            DecodeAction::PostRead(op) => Some(format!("read {}", inc(op.plan.incarnation))),
            DecodeAction::SendLease { lease, .. } => Some(format!("lease {}", inc(lease.incarnation))),
            DecodeAction::SendRelease { release, .. } => {
                Some(format!("release {}", inc(release.incarnation)))
            }
            DecodeAction::RequestFailed { error, .. } => Some(format!("failed {error}")),
            _ => None,
        })
        .collect()
}

/// The incarnation fence on one worker. Incarnation 1 is the rank before its restart, 2 after.
/// A transfer of the new incarnation meeting a session of the old one redials and reads through
/// the new session. A transfer of the old incarnation dispatched after the restart (its holder's
/// memory is gone, and its block ids are free or another request's in the new one) redials once,
/// then fails without a read, a lease or a release. Under `no-incarnation-fence` the new
/// transfer reads through the old session (whose keys died with the old process, so the read
/// fails and the session is dropped), and then the old transfer is read from the new
/// incarnation's memory: the stale read.
#[test]
fn a_transfer_of_a_gone_incarnation_is_never_read_leased_or_released() {
    let (one, two) = (crate::ids::Incarnation::new(1).unwrap(), crate::ids::Incarnation::new(2).unwrap());
    let read_done = |w: &mut DecodeWorker, n: u64, outcome: ReadOutcome| {
        let mut out = Vec::new();
        let event = DecodeEvent::ReadDone { request: RequestId(n), layer: Some(0), outcome };
        w.handle(Instant::ZERO, event, &mut out);
        summary(&out)
    };
    // Fixed protocol.
    let mut w = worker(&LegacyOptions::none());
    let first = step_answering(&mut w, 1, vec![request_held_by(1, one)], Some(one));
    assert_eq!(summary(&first), ["lease 1", "dial", "read 1"]);
    assert_eq!(read_done(&mut w, 1, ReadOutcome::Ok), ["release 1"]);
    // The rank restarted as incarnation 2: a transfer it holds meets the old session (its lease
    // names incarnation 2, which takes it).
    let new = step_answering(&mut w, 2, vec![request_held_by(2, two)], Some(two));
    assert_eq!(summary(&new), ["lease 2", "dial", "read 2"]);
    assert_eq!(read_done(&mut w, 2, ReadOutcome::Ok), ["release 2"]);
    // A transfer incarnation 1 held, dispatched after the restart: leased as incarnation 1's (so
    // incarnation 2 ignores the lease), then found gone; nothing read or released.
    let old = step_answering(&mut w, 3, vec![request_held_by(3, one)], Some(two));
    assert_eq!(
        summary(&old),
        ["lease 1", "dial", "failed the prefill rank restarted: inc-1 held the KV and inc-2 answers"]
    );
    assert_eq!(w.pending_requests(), 0);

    // The legacy option: no fence.
    let mut w = worker(&LegacyOptions::none().with(Legacy::NoIncarnationFence));
    let first = step_answering(&mut w, 1, vec![request_held_by(1, one)], Some(one));
    assert_eq!(summary(&first), ["lease 1", "dial", "read 1"]);
    assert_eq!(read_done(&mut w, 1, ReadOutcome::Ok), ["release 1"]);
    let new = step_answering(&mut w, 2, vec![request_held_by(2, two)], Some(two));
    assert_eq!(summary(&new), ["lease 2", "read 1"]);
    let failed = read_done(&mut w, 2, ReadOutcome::Failed("remote access error".into()));
    assert_eq!(failed, ["release 2", "failed read failed: remote access error"]);
    let old = step_answering(&mut w, 3, vec![request_held_by(3, one)], Some(two));
    assert_eq!(summary(&old), ["lease 1", "dial", "read 2"]);
}

/// A driver that keeps to the calling order and picks, with a seeded stream, among the events
/// that apply: steps of new and queued requests, queued requests, handshake replies and
/// failures, votes, read answers of every kind (refusals arm retries), ticks and waits. After
/// every event the worker's timer table must be the one a scan of its sessions, requests,
/// retries and renewals builds, so `poll_timeout` is the earliest of them. Returns how many
/// events it fed and how many of them were ticks that found something due.
fn drive_and_check_timers(seed: u64, lazy: bool) -> (usize, usize) {
    use crate::handshake::HandshakeState;
    use crate::rng::Stream;
    use crate::step_machine::StepState;
    use std::collections::BTreeSet;

    let legacy = if lazy { LegacyOptions::none().with(Legacy::LazyHandshake) } else { LegacyOptions::none() };
    let mut w = worker(&legacy);
    w.config.granularity = ReadGranularity::PerLayer;
    w.config.handshake_timeout_ns = 40 * crate::time::NS_PER_MS;
    w.config.transfer_timeout_ns = 300 * crate::time::NS_PER_MS;
    w.config.backoff_initial_ns = crate::time::NS_PER_MS;
    w.config.backoff_cap_ns = 8 * crate::time::NS_PER_MS;
    let mut rng = Stream::new(seed, 0);
    let mut now = Instant::ZERO;
    let mut step = 0;
    let mut next_request = 0;
    let mut queued: Vec<RecvRequest> = Vec::new();
    // Reads posted and not answered yet.
    let mut posted: BTreeSet<(RequestId, Option<u16>)> = BTreeSet::new();
    let (mut events, mut due_ticks) = (0, 0);
    let mut new_request = |rng: &mut Stream| {
        next_request += 1;
        let mut request = request_on_own_host(rng.below(3));
        request.request = RequestId(next_request);
        request.params.transfer_id = Some(format!("transfer-{next_request}"));
        request
    };
    for _ in 0..200 {
        let waiting_sessions: Vec<SessionKey> = w.waiting_sessions().into_iter().map(|(k, _)| k).collect();
        let event = match rng.below(10) {
            0 | 1 if w.step == StepState::Idle => {
                step += 1;
                let mut requests: Vec<RecvRequest> = queued.drain(..).filter(|_| rng.chance(0.7)).collect();
                requests.extend((0..rng.below(3)).map(|_| new_request(&mut rng)));
                DecodeEvent::StepBegin { step, requests }
            }
            2 => {
                let request = new_request(&mut rng);
                queued.push(request.clone());
                DecodeEvent::Queued { requests: vec![request] }
            }
            5 if !queued.is_empty() => {
                let taken = queued.remove(rng.below(queued.len() as u64) as usize);
                DecodeEvent::Dequeued { requests: vec![taken.request] }
            }
            3 | 4 if !waiting_sessions.is_empty() => {
                let session = rng.pick(&waiting_sessions).clone();
                let entry = &w.sessions[&session];
                match (&entry.state, rng.below(8)) {
                    (_, 0) => DecodeEvent::HandshakeFailed { session, reason: "refused".into() },
                    (HandshakeState::GotMetadata { .. }, _) => {
                        let layers = vec![crate::wire::LayerMemoryDesc {
                            layer_name: "l0".into(),
                            descs: vec![vec![0]],
                        }];
                        DecodeEvent::HandshakeDescriptors { session, layers }
                    }
                    _ => {
                        let mut metadata = metadata(Extensions::ALL);
                        metadata.engine_id = entry.params.expected_engine_id.clone();
                        metadata.kv_caches_base_addr = vec![1 << 30, 2 << 30];
                        DecodeEvent::HandshakeMetadata { session, metadata: Box::new(metadata) }
                    }
                }
            }
            5 if matches!(w.step, StepState::Voting { .. }) => {
                let StepState::Voting { step } = w.step else { unreachable!() };
                DecodeEvent::VoteResult { step, ok: rng.chance(0.8) }
            }
            6 | 7 if !posted.is_empty() => {
                let reads: Vec<(RequestId, Option<u16>)> = posted.iter().copied().collect();
                let (request, layer) = *rng.pick(&reads);
                posted.remove(&(request, layer));
                let outcome = match rng.below(6) {
                    0 => ReadOutcome::Failed("nic".into()),
                    1 => ReadOutcome::Aborted,
                    2 | 3 => ReadOutcome::SendQueueFull,
                    _ => ReadOutcome::Ok,
                };
                DecodeEvent::ReadDone { request, layer, outcome }
            }
            8 => {
                let due = w.poll_timeout().is_some_and(|at| at <= now);
                due_ticks += usize::from(due);
                DecodeEvent::Tick
            }
            _ => {
                // Time passes, up to the next deadline or a little past it.
                now = match w.poll_timeout() {
                    Some(at) if rng.chance(0.6) => at.max(now),
                    _ => now.add_ns(rng.below(20 * crate::time::NS_PER_MS)),
                };
                continue;
            }
        };
        let mut out = Vec::new();
        w.handle(now, event, &mut out);
        events += 1;
        for action in &out {
            if let DecodeAction::PostRead(op) = action {
                posted.insert((op.request(), op.layer));
            }
        }
        assert_eq!(w.timers, w.timers_by_scan(), "seed {seed}, lazy {lazy}, after event {events}");
    }
    (events, due_ticks)
}

/// The timer table holds exactly the worker's deadlines, whatever the driver does; the drives
/// reach ticks that find work, so the deadlines they check do move.
#[test]
fn the_timer_table_is_every_deadline_of_the_worker() {
    let mut due_ticks = 0;
    for seed in 0..64 {
        for lazy in [false, true] {
            let (events, due) = drive_and_check_timers(seed, lazy);
            assert!(events > 50, "seed {seed}: only {events} events");
            due_ticks += due;
        }
    }
    assert!(due_ticks > 100, "only {due_ticks} ticks found a deadline due");
}

/// A queued request refused at admission because the worker holds as many requests as it may
/// fails with a typed error and leaves no lease renewal armed (the random drives never fill the
/// worker).
#[test]
fn a_queued_request_refused_as_one_too_many_leaves_no_timer() {
    let mut w = worker(&LegacyOptions::none());
    let numbered = |n: u64| {
        let mut request = request_on_own_host(n % 3);
        request.request = RequestId(n);
        request.params.transfer_id = Some(format!("transfer-{n}"));
        request
    };
    let last = RequestId(MAX_WORKER_REQUESTS as u64);
    let mut out = Vec::new();
    w.handle(Instant::ZERO, DecodeEvent::Queued { requests: vec![numbered(last.0)] }, &mut out);
    assert_eq!(w.queued_requests(), 1);
    let mut requests: Vec<RecvRequest> = (0..MAX_WORKER_REQUESTS as u64).map(numbered).collect();
    requests.push(numbered(last.0));
    w.handle(Instant::ZERO, DecodeEvent::StepBegin { step: 1, requests }, &mut out);
    assert!(out.contains(&DecodeAction::RequestFailed { request: last, error: RecvError::TooManyRequests }));
    assert_eq!((w.pending_requests(), w.queued_requests()), (MAX_WORKER_REQUESTS, 0));
    assert_eq!(w.timers, w.timers_by_scan());
}
