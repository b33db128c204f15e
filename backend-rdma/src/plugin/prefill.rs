//! The prefill engine's node inside vLLM's scheduler process: the core's `PrefillEngine` for one
//! engine, fed the requests vLLM finished with their blocks and what the workers' ranks said, and
//! telling the workers (through vLLM's connector metadata) and vLLM's scheduler (which requests'
//! blocks to free) what the engine decided.

use std::collections::BTreeMap;

use pdkv_core::ids::{RankId, RequestId, TransferId};
use pdkv_core::params::{KvTransferParams, PrefillAnswer};
use pdkv_core::policy::{PeerBook, Policy};
use pdkv_core::prefill::{EngineAction, EngineEvent, PrefillDone, PrefillEngine};
use pdkv_core::topology::Layout;
use pdkv_core::wire::Extensions;

use super::config::Engine;
use crate::rank_io::Clock;
use crate::sched::{FromRank, ToRank};

/// Why a finished request was not handed to the decode side (vLLM then frees its blocks now).
#[derive(Debug)]
pub enum PrefillError {
    /// Its `kv_transfer_params` do not parse.
    Params(String),
    /// The engine refused it (the core's words).
    Engine(String),
}

impl std::fmt::Display for PrefillError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefillError::Params(e) => write!(f, "kv_transfer_params: {e}"),
            PrefillError::Engine(e) => write!(f, "the prefill engine refused the transfer: {e}"),
        }
    }
}

impl std::error::Error for PrefillError {}

/// The prefill engine node and the names vLLM gives its requests.
pub struct PrefillNode {
    engine: PrefillEngine,
    config: Engine,
    clock: Clock,
    /// vLLM's request id of each transfer held.
    requests: BTreeMap<TransferId, String>,
    next_request: u64,
    /// Messages for the workers, by rank, in order.
    to_workers: Vec<(RankId, ToRank)>,
    /// Requests whose blocks the engine freed, for vLLM's scheduler to free.
    freed: Vec<String>,
    /// Lines for the log: reaped transfers, refusals.
    notes: Vec<String>,
}

impl PrefillNode {
    /// The node of `config`'s engine (which must be a prefill engine).
    pub fn new(config: Engine) -> PrefillNode {
        let layout = config.deployment.layout(config.engine);
        let engine = PrefillEngine::new(
            config.engine,
            layout,
            config.deployment.model.clone(),
            Policy::from(&pdkv_core::legacy::LegacyOptions::default()),
        )
        .with_defer_timeout_ns(config.timeouts.defer_ns())
        .with_peers(PeerBook::default());
        PrefillNode {
            engine,
            config,
            clock: Clock::start(),
            requests: BTreeMap::new(),
            next_request: 0,
            to_workers: Vec::new(),
            freed: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A worker's rank started with this incarnation (from its handshake metadata, which vLLM
    /// hands the scheduler at start).
    pub fn handle_worker_up(&mut self, rank: RankId, incarnation: pdkv_core::ids::Incarnation) {
        self.apply(EngineEvent::WorkerUp { rank, incarnation });
    }

    /// vLLM finished prefilling `request` (DP rank `dp`), whose KV is in `blocks` on every TP
    /// rank: the engine registers the transfer on its workers and the answer is the
    /// `kv_transfer_params` the decode side reads with. `params` are the request's, as the
    /// router sent them (the decode engine's sizes, the transfer id).
    pub fn handle_finished(
        &mut self,
        request: &str,
        params: &KvTransferParams,
        dp: u16,
        blocks: Vec<u32>,
    ) -> Result<KvTransferParams, PrefillError> {
        let transfer_id = TransferId::new(
            params.transfer_id.clone().ok_or(PrefillError::Params("no `transfer_id`".into()))?,
        );
        let decode = decode_layout(params, &self.config.deployment.decode).map_err(PrefillError::Params)?;
        let id = RequestId(self.next_request);
        let done = PrefillDone {
            request: id,
            transfer_id: transfer_id.clone(),
            owner_dp: dp,
            blocks: blocks.clone(),
            decode,
            reader: None,
            holders: None,
        };
        let mut out = Vec::new();
        let now = self.clock.now();
        self.engine
            .handle(now, EngineEvent::PrefillDone(done), &mut out)
            .map_err(|e| PrefillError::Engine(e.to_string()))?;
        self.next_request += 1;
        self.requests.insert(transfer_id.clone(), request.to_string());
        self.actions(out);
        let holders = self.engine.holder_incarnations(&transfer_id);
        let layout = self.config.deployment.layout(self.config.engine);
        let mut answer = KvTransferParams::prefill_answer(&PrefillAnswer {
            transfer_id: Some(&transfer_id),
            blocks: &blocks,
            address: &self.config.address,
            layout,
            extensions: PrefillAnswer::advertised(Extensions::ALL, false),
            holders: holders.as_deref(),
            // Inside vLLM 0.34 the answer has that release's shape: one list per KV cache group.
            blocks_per_group: true,
        });
        // The DP rank that holds the blocks, as a router forwards it.
        if layout.dp > 1 {
            answer.remote_dp_rank = Some(i64::from(dp));
        }
        Ok(answer)
    }

    /// What a worker's rank said (forwarded through vLLM's worker-to-scheduler metadata).
    pub fn handle_worker_message(&mut self, rank: RankId, msg: FromRank) {
        let now = self.clock.now();
        match msg {
            FromRank::Finished { transfer_id } => {
                self.apply(EngineEvent::WorkerFinished { rank, transfer_id })
            }
            FromRank::Leased { transfer_id, remaining_ns } => {
                self.apply(EngineEvent::Leased { transfer_id, until: now.add_ns(remaining_ns) })
            }
            FromRank::Ready { incarnation: Some(incarnation), .. } => {
                self.apply(EngineEvent::WorkerUp { rank, incarnation })
            }
            FromRank::ProtocolError { rank, error } => {
                self.notes.push(format!("{rank}: the core's ledger refused: {error:?}"))
            }
            FromRank::Refused { transfer_id, verdict, from, .. } => self.notes.push(format!(
                "{rank} refused a control message for {transfer_id} from {}: {verdict:?}",
                from.unwrap_or_else(|| "an unknown address".into())
            )),
            FromRank::Problem(problem) => self.notes.push(format!("{rank}: {problem}")),
            _ => {}
        }
    }

    /// Lets the engine's reaper act on time passing.
    pub fn handle_tick(&mut self) {
        if self.engine.poll_timeout().is_some_and(|at| at <= self.clock.now()) {
            self.apply(EngineEvent::Tick);
        }
    }

    /// Messages for the workers, in order.
    pub fn poll_to_workers(&mut self) -> Vec<(RankId, ToRank)> {
        std::mem::take(&mut self.to_workers)
    }

    /// Requests whose blocks the engine freed since the last call.
    pub fn poll_freed(&mut self) -> Vec<String> {
        std::mem::take(&mut self.freed)
    }

    /// Log lines since the last call.
    pub fn poll_notes(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notes)
    }

    /// Transfers the engine holds.
    pub fn held(&self) -> usize {
        self.engine.held().count()
    }

    fn apply(&mut self, event: EngineEvent) {
        let mut out = Vec::new();
        let now = self.clock.now();
        if let Err(e) = self.engine.handle(now, event, &mut out) {
            self.notes.push(format!("prefill engine: {e}"));
        }
        self.actions(out);
    }

    fn actions(&mut self, out: Vec<EngineAction>) {
        let layout = self.config.deployment.layout(self.config.engine);
        for action in out {
            match action {
                EngineAction::Register { rank, transfer_id, quorum, incarnation } => {
                    self.to_workers.push((rank, ToRank::Register { transfer_id, quorum, incarnation }))
                }
                EngineAction::GroupDone { rank, transfer_id } => {
                    self.to_workers.push((rank, ToRank::GroupDone { transfer_id }))
                }
                EngineAction::Retire { rank, transfer_id, incarnation } => {
                    self.to_workers.push((rank, ToRank::Retire { transfer_id, incarnation }))
                }
                EngineAction::Fence { transfer_id, owner_dp, blocks } => {
                    for tp in 0..layout.tp {
                        let rank = RankId::new(self.config.engine, owner_dp, tp);
                        let msg = ToRank::Fence { transfer_id: transfer_id.clone(), blocks: blocks.clone() };
                        self.to_workers.push((rank, msg));
                    }
                }
                EngineAction::FreeBlocks { transfer_id, reaped, .. } => {
                    if let Some(request) = self.requests.remove(&transfer_id) {
                        if reaped {
                            self.notes.push(format!(
                                "reaped {transfer_id} (request {request}): its releases did not come in time"
                            ));
                        }
                        self.freed.push(request);
                    }
                }
                EngineAction::ReapWarning { transfer_id, held_ns, unfinished_tp } => {
                    self.notes.push(format!(
                        "{transfer_id} held {} ms; TP ranks {unfinished_tp:?} never finished",
                        held_ns / 1_000_000
                    ))
                }
                EngineAction::FinishedSending { .. } => {}
            }
        }
    }
}

/// The decode engine's layout: `remote_tp_size` and `remote_dp_size` (1 where absent) as a
/// router sends them to prefill, or, when the router sends neither, the deployment's decode
/// engine if it has only one.
fn decode_layout(params: &KvTransferParams, decode: &[Layout]) -> Result<Layout, String> {
    if params.remote_tp_size.is_none() && params.remote_dp_size.is_none() {
        return match decode {
            [only] => Ok(*only),
            _ => Err(format!(
                "no `remote_tp_size`, and the deployment has {} decode engines: the router must say \
                 which one reads",
                decode.len()
            )),
        };
    }
    let size = |field: &str, value: Option<i64>| -> Result<u16, String> {
        let v = value.unwrap_or(1);
        u16::try_from(v)
            .ok()
            .filter(|v| (1..=256).contains(v))
            .ok_or_else(|| format!("`{field}` is {v}, not 1 to 256"))
    };
    let tp = size("remote_tp_size", params.remote_tp_size)?;
    let dp = size("remote_dp_size", params.remote_dp_size)?;
    Ok(Layout::new(dp, tp, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_layout_comes_from_the_request_or_the_only_decode_engine() {
        let check = |tp: Option<i64>, dp: Option<i64>, engines: &[Layout], expected: Result<Layout, &str>| {
            let params = KvTransferParams { remote_tp_size: tp, remote_dp_size: dp, ..Default::default() };
            let got = decode_layout(&params, engines);
            match expected {
                Ok(layout) => assert_eq!(got, Ok(layout)),
                Err(words) => assert!(got.as_ref().is_err_and(|e| e.contains(words)), "{got:?}"),
            }
        };
        let (tp2, tp4) = (Layout::new(1, 2, false), Layout::new(1, 4, false));
        check(None, None, &[tp2], Ok(tp2));
        check(Some(4), None, &[tp2], Ok(tp4));
        check(None, Some(2), &[tp2], Ok(Layout::new(2, 1, false)));
        check(None, None, &[tp2, tp4], Err("2 decode engines"));
        check(Some(0), None, &[tp2], Err("`remote_tp_size` is 0"));
        check(Some(1 << 40), None, &[tp2], Err("not 1 to 256"));
    }
}
