//! Tests of one decode worker on its own, driven by hand (the scripted tests in
//! `crate::scripted` drive it together with the other nodes).

use super::*;
use crate::ids::EngineId;
use crate::legacy::{Legacy, LegacyOptions};
use crate::params::KvTransferParams;
use crate::policy::Policy;
use crate::ports::EngineAddress;
use crate::topology::Deployment;

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
            remote_block_ids: vec![1],
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
