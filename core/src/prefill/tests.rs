//! Tests of the prefill nodes on their own: what a worker and an engine do with incarnations.

use super::*;
use crate::auth::{self, ControlAuth, ControlKey};
use crate::ids::{EngineId, Incarnation, RankId, RequestId, TransferId};
use crate::legacy::{Legacy, LegacyOptions};
use crate::policy::Policy;
use crate::release::{Quorum, Release};
use crate::time::Instant;
use crate::topology::{Layout, ModelSpec};
use crate::wire::{Extension, Extensions, HandshakeMetadata, ReadLease};

fn inc(n: u64) -> Option<Incarnation> {
    Incarnation::new(n)
}

fn tx(n: u32) -> TransferId {
    TransferId::new(format!("tx-{n}"))
}

/// Prefill rank P0.dp0.tp0 in incarnation 7.
fn worker(legacy: &LegacyOptions) -> PrefillWorker {
    let metadata = HandshakeMetadata {
        engine_id: "prefill-0:6301".into(),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: vec![1 << 30],
        num_blocks: 16,
        block_len: 4096,
        attn_backend_name: "pdkv".into(),
        rank: None,
        extensions: Extensions::ALL,
        incarnation: inc(7),
    };
    PrefillWorker::new(RankId::new(EngineId::prefill(0), 0, 0), metadata, Vec::new(), &Policy::from(legacy))
}

/// What the worker said, in short.
fn said(out: &[WorkerAction]) -> Vec<String> {
    out.iter()
        .map(|a| match a {
            WorkerAction::Finished { transfer_id, .. } => format!("finished {transfer_id}"),
            WorkerAction::Leased { transfer_id, .. } => format!("leased {transfer_id}"),
            WorkerAction::Ignored { transfer_id, outcome } => format!("ignored {transfer_id}: {outcome:?}"),
            WorkerAction::Refused { transfer_id, message, verdict } => {
                format!("refused {message:?} {transfer_id}: {verdict:?}")
            }
            WorkerAction::LeaseCapped { transfer_id, asked_ms, granted_ms } => {
                format!("capped {transfer_id}: {asked_ms} -> {granted_ms} ms")
            }
            WorkerAction::Error { error, .. } => format!("error {error}"),
            WorkerAction::SendHandshakeReply { metadata, .. } => format!("reply {:?}", metadata.incarnation),
        })
        .collect()
}

fn release(n: u32, incarnation: Option<Incarnation>) -> WorkerEvent {
    WorkerEvent::Release(Release {
        transfer_id: tx(n),
        consumer_tp_size: Some(1),
        sender: None,
        incarnation,
        mac: None,
    })
}

/// (events in order, under the legacy option?) -> what the worker said at the last event. A
/// message naming another incarnation of the rank (its life before a restart) changes nothing
/// and is no error; naming none is taken as it is; under `no-incarnation-fence` nothing is
/// compared, so an old incarnation's release completes a new transfer of the same id.
#[test]
fn a_worker_ignores_what_names_another_incarnation_of_it() {
    let register =
        |n, incarnation| WorkerEvent::Register { transfer_id: tx(n), quorum: Quorum::Exact(1), incarnation };
    let retired = |n, incarnation| WorkerEvent::Retired { transfer_id: tx(n), incarnation };
    let lease =
        |n, incarnation| WorkerEvent::Lease { transfer_id: tx(n), lease_ms: 100, incarnation, mac: None };
    let other = |n: u32| format!("ignored tx-{n}: OtherIncarnation");
    let check = |events: Vec<WorkerEvent>, legacy: bool, expected: Vec<String>| {
        let options = if legacy {
            LegacyOptions::none().with(Legacy::NoIncarnationFence)
        } else {
            LegacyOptions::none()
        };
        let mut w = worker(&options);
        let mut out = Vec::new();
        for event in events.clone() {
            out.clear();
            w.handle(Instant::ZERO, event, &mut out);
        }
        assert_eq!(said(&out), expected, "{events:?} legacy {legacy}");
    };
    check(vec![WorkerEvent::HandshakeRequest { peer: 1 }], false, vec![format!("reply {:?}", inc(7))]);
    check(vec![register(1, inc(7)), release(1, inc(7))], false, vec!["finished tx-1".into()]);
    check(vec![register(1, inc(7)), release(1, None)], false, vec!["finished tx-1".into()]);
    check(vec![register(1, inc(7)), release(1, inc(6))], false, vec![other(1)]);
    check(vec![register(1, inc(7)), release(1, inc(6))], true, vec!["finished tx-1".into()]);
    check(vec![register(1, inc(6))], false, vec![other(1)]);
    // A registration meant for the old incarnation holds nothing: its release is early, never
    // completing anything.
    check(vec![register(1, inc(6)), release(1, inc(7))], false, vec!["ignored tx-1: Buffered".into()]);
    check(vec![lease(1, inc(6))], false, vec![other(1)]);
    check(vec![lease(1, inc(7))], false, vec!["leased tx-1".into()]);
    check(vec![lease(1, None)], false, vec!["leased tx-1".into()]);
    // The retirement of an old incarnation's transfer is recognised as such, not an error.
    check(vec![retired(1, inc(6))], false, vec![other(1)]);
    check(vec![register(1, inc(7)), retired(1, inc(7))], false, vec![]);
    // A retirement ahead of its registration (the reaper fired first): the registration is late.
    check(vec![retired(1, inc(7))], false, vec!["ignored tx-1: RetiredBeforeRegistration".into()]);
    check(vec![retired(1, inc(7)), register(1, inc(7))], false, vec!["ignored tx-1: RegisteredLate".into()]);
    check(
        vec![retired(1, inc(7)), register(1, inc(7)), release(1, inc(7))],
        false,
        vec!["ignored tx-1: Stale".into()],
    );
    assert_eq!(worker(&LegacyOptions::none()).ledger().pending().count(), 0);
}

/// (the worker's authentication, events in order) -> what it said at the last event. A release
/// or lease with a wrong MAC is refused before it touches the ledger or the reaper; one without
/// a MAC is refused only when every peer holds the key (`Require`); `Open` takes anything, as
/// MoRIIO's listener does. Refusing a forged release leaves the transfer waiting for the real one.
#[test]
fn a_worker_takes_releases_and_leases_only_as_its_authentication_says() {
    let key = ControlKey::from_bytes([3; 32]);
    let forger = ControlKey::from_bytes([4; 32]);
    let register =
        |n| WorkerEvent::Register { transfer_id: tx(n), quorum: Quorum::Exact(1), incarnation: inc(7) };
    let release = |n: u32, by: Option<&ControlKey>| {
        let mut r = Release {
            transfer_id: tx(n),
            consumer_tp_size: Some(1),
            sender: None,
            incarnation: inc(7),
            mac: None,
        };
        r.mac = by.map(|k| auth::release_mac(k, &r));
        WorkerEvent::Release(r)
    };
    let lease = |n: u32, lease_ms: u32, by: Option<&ControlKey>| {
        let l = ReadLease { transfer_id: tx(n), lease_ms, incarnation: inc(7), mac: None };
        let mac = by.map(|k| auth::lease_mac(k, &l));
        WorkerEvent::Lease { transfer_id: tx(n), lease_ms, incarnation: inc(7), mac }
    };
    let check = |auth: ControlAuth, events: Vec<WorkerEvent>, expected: &[&str]| {
        let mut w = worker(&LegacyOptions::none()).with_control_auth(auth.clone()).with_max_lease_ms(30_000);
        let mut out = Vec::new();
        for event in events.clone() {
            out.clear();
            w.handle(Instant::ZERO, event, &mut out);
        }
        assert_eq!(said(&out), expected, "{auth:?} {events:?}");
    };
    let open = ControlAuth::Open;
    let verify = ControlAuth::Verify(key.clone());
    let require = ControlAuth::Require(key.clone());
    let finished = ["finished tx-1"];
    check(open.clone(), vec![register(1), release(1, None)], &finished);
    check(open.clone(), vec![register(1), release(1, Some(&forger))], &finished);
    check(verify.clone(), vec![register(1), release(1, None)], &finished);
    check(verify.clone(), vec![register(1), release(1, Some(&key))], &finished);
    check(verify.clone(), vec![register(1), release(1, Some(&forger))], &["refused Release tx-1: BadMac"]);
    check(require.clone(), vec![register(1), release(1, Some(&key))], &finished);
    check(require.clone(), vec![register(1), release(1, None)], &["refused Release tx-1: Unauthenticated"]);
    check(require.clone(), vec![register(1), release(1, Some(&forger))], &["refused Release tx-1: BadMac"]);
    // The forged release changed nothing: the real one still completes the transfer.
    check(require.clone(), vec![register(1), release(1, None), release(1, Some(&key))], &finished);
    check(require.clone(), vec![lease(1, 100, None)], &["refused Lease tx-1: Unauthenticated"]);
    check(require.clone(), vec![lease(1, 100, Some(&forger))], &["refused Lease tx-1: BadMac"]);
    check(require.clone(), vec![lease(1, 100, Some(&key))], &["leased tx-1"]);
    // A lease over the transfer limit (here a forged 49 days) is taken for the limit only.
    check(
        open.clone(),
        vec![lease(1, u32::MAX, None)],
        &["capped tx-1: 4294967295 -> 30000 ms", "leased tx-1"],
    );
    check(require, vec![lease(1, 30_001, Some(&key))], &["capped tx-1: 30001 -> 30000 ms", "leased tx-1"]);
    check(open, vec![lease(1, 30_000, None)], &["leased tx-1"]);
    // A worker with the key says so in its handshake metadata; one without does not.
    let reply = |auth: ControlAuth| {
        let mut out = Vec::new();
        worker(&LegacyOptions::none()).with_control_auth(auth).handle(
            Instant::ZERO,
            WorkerEvent::HandshakeRequest { peer: 1 },
            &mut out,
        );
        match &out[..] {
            [WorkerAction::SendHandshakeReply { metadata, .. }] => metadata.extensions.has(Extension::Auth),
            other => panic!("{other:?}"),
        }
    };
    assert!(reply(verify) && !reply(ControlAuth::Open));
}

/// An engine of one TP2 group whose ranks started as incarnations 1 and 2. It registers, names
/// the holders in the answer and retires under those incarnations. When rank 1 restarts (3), its
/// old part is gone with its memory: under the fixed protocol the transfer is freed as soon as
/// rank 0 is released (retired on rank 1 under incarnation 2, which rank 3 ignores); under
/// `no-incarnation-fence` nothing fences the old transfer, so it waits for the reaper.
#[test]
fn an_engine_ends_a_restarted_worker_s_old_parts_only_when_fenced() {
    for (legacy, freed) in
        [(LegacyOptions::none(), true), (LegacyOptions::none().with(Legacy::NoIncarnationFence), false)]
    {
        let model = ModelSpec::deepseek_r1();
        let mut engine =
            PrefillEngine::new(EngineId::prefill(0), Layout::tp(2), model, Policy::from(&legacy));
        let rank = |tp| RankId::new(EngineId::prefill(0), 0, tp);
        let mut out = Vec::new();
        let up = |engine: &mut PrefillEngine, tp, n| {
            let event = EngineEvent::WorkerUp { rank: rank(tp), incarnation: Incarnation::new(n).unwrap() };
            engine.handle(Instant::ZERO, event, &mut Vec::new()).unwrap();
        };
        up(&mut engine, 0, 1);
        up(&mut engine, 1, 2);
        let done = EngineEvent::PrefillDone(PrefillDone {
            request: RequestId(1),
            transfer_id: tx(1),
            owner_dp: 0,
            blocks: vec![4, 5],
            decode: Layout::tp(2),
            reader: None,
            holders: None,
        });
        engine.handle(Instant::ZERO, done, &mut out).unwrap();
        let registered: Vec<Option<Incarnation>> = out
            .iter()
            .filter_map(|a| match a {
                EngineAction::Register { incarnation, .. } => Some(*incarnation),
                _ => None,
            })
            .collect();
        assert_eq!(registered, [inc(1), inc(2)]);
        assert_eq!(engine.holder_incarnations(&tx(1)), Some(vec![inc(1).unwrap(), inc(2).unwrap()]));
        up(&mut engine, 1, 3);
        out.clear();
        let finished = EngineEvent::WorkerFinished { rank: rank(0), transfer_id: tx(1) };
        engine.handle(Instant::ZERO, finished, &mut out).unwrap();
        let retired: Vec<Option<Incarnation>> = out
            .iter()
            .filter_map(|a| match a {
                EngineAction::Retire { incarnation, .. } => Some(*incarnation),
                _ => None,
            })
            .collect();
        let expected: &[Option<Incarnation>] = if freed { &[inc(1), inc(2)] } else { &[] };
        assert_eq!(retired, expected, "{legacy:?}");
        assert_eq!(engine.totals().freed, u64::from(freed), "{legacy:?}");
    }
}
