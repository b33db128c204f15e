//! The scripted tests' driver: a harness holding one deployment's nodes and delivering their
//! messages only when a test says so, plus the toy model and handshake answers it uses.

use std::collections::BTreeMap;

use pdkv_core::decode::{
    DecodeAction, DecodeConfig, DecodeEvent, DecodeWorker, ReadOp, ReadOutcome, RecvError, RecvRequest,
    StepError,
};
use pdkv_core::group::{DecodeGroup, GroupAction, GroupEvent};

use pdkv_core::ids::{EngineId, RankId, RequestId, Role, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::params::{KvTransferParams, PrefillAnswer};
use pdkv_core::policy::{PeerBook, Policy};
use pdkv_core::ports::{AddressBook, SessionKey};
use pdkv_core::prefill::{
    EngineAction, EngineEvent, PrefillDone, PrefillEngine, PrefillWorker, WorkerAction, WorkerEvent,
};
use pdkv_core::release::Release;
use pdkv_core::time::Instant;
use pdkv_core::topology::Deployment;
use pdkv_core::wire::{Extensions, HandshakeMetadata, LayerMemoryDesc};

use crate::decode::{
    DecodeNodes, DecodeScheduler, KvAllocation, NodeOutput, SchedulerLimits, SchedulerOutput,
};
use crate::prefill::{PrefillNodes, PrefillOutput};

/// Blocks in every prefill rank's pool.
const POOL_BLOCKS: u32 = 1024;
/// Layers of the toy model: few, so per-layer reads stay readable in assertions.
pub(super) const LAYERS: usize = 4;

/// The handshake answer of a prefill rank: distinct, non-overlapping regions per rank and layer.
fn metadata_for(
    book: &AddressBook,
    d: &Deployment,
    rank: RankId,
) -> (HandshakeMetadata, Vec<LayerMemoryDesc>) {
    let index = d.rank_index(rank) as u64;
    let block_len = 16 * d.model.bytes_per_token_per_layer_per_rank(d.layout(rank.engine).tp);
    let region = u64::from(POOL_BLOCKS) * block_len;
    let bases = (0..LAYERS as u64).map(|l| (index * LAYERS as u64 + l + 1) * region).collect();
    let metadata = HandshakeMetadata {
        engine_id: book.engine_id(rank.engine),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: bases,
        num_blocks: POOL_BLOCKS,
        block_len,
        attn_backend_name: "scripted".into(),
        rank: None,
        extensions: Extensions::ALL,
        incarnation: None,
    };
    let layers = (0..LAYERS)
        .map(|l| LayerMemoryDesc { layer_name: format!("layer.{l}"), descs: vec![vec![l as u8]] })
        .collect();
    (metadata, layers)
}

#[derive(Debug, Clone)]
pub(super) struct Dial {
    pub(super) from: RankId,
    pub(super) session: SessionKey,
    pub(super) to: RankId,
}

/// Every node of a deployment plus the messages in flight between them.
pub(super) struct Harness {
    pub(super) d: Deployment,
    pub(super) book: AddressBook,
    pub(super) now: Instant,
    /// Every decode worker and its DP group's barrier, routed to each other (the engine layer's,
    /// as every driver's): the harness only picks which message is delivered when.
    pub(super) nodes: DecodeNodes,
    /// Each decode rank's worker number in `nodes`, and back.
    pub(super) worker_of: BTreeMap<RankId, usize>,
    pub(super) rank_of: Vec<RankId>,
    /// Each decode DP group's number in `nodes`.
    pub(super) group_of: BTreeMap<(EngineId, u16), usize>,
    /// Every prefill engine and worker, routed to each other (the engine layer's).
    pub(super) prefill: PrefillNodes,
    pub(super) dials: Vec<Dial>,
    pub(super) reads: Vec<(RankId, ReadOp)>,
    pub(super) releases: Vec<(RankId, Release)>,
    /// Vote results the groups decided, not delivered yet: `(to, step, ok)`.
    pub(super) results: Vec<(RankId, u64, bool)>,
    /// Step results per decode rank, in order: `(step, None)` ready, `(step, Some(e))` failed.
    pub(super) steps: BTreeMap<RankId, Vec<(u64, Option<StepError>)>>,
    pub(super) received: Vec<(RankId, RequestId)>,
    pub(super) failed: Vec<(RankId, RequestId, RecvError)>,
    pub(super) invalidated: Vec<(RankId, RequestId)>,
    /// Requests whose reads a worker asked to abort.
    pub(super) aborts: Vec<(RankId, RequestId)>,
    pub(super) engine_log: Vec<EngineAction>,
    pub(super) worker_log: Vec<WorkerAction>,
    /// Read leases sent (delivered at once: they leave before the reads).
    pub(super) leases: usize,
}

impl Harness {
    pub(super) fn new(notation: &str, legacy: LegacyOptions) -> Harness {
        Harness::with_peers(notation, legacy, PeerBook::pdkv())
    }

    /// A harness whose engines follow the rules `peers` names.
    pub(super) fn with_peers(notation: &str, legacy: LegacyOptions, peers: PeerBook) -> Harness {
        let policy = Policy::from(&legacy);
        let d = Deployment::parse(notation).unwrap();
        let book = AddressBook::one_host_per_engine(&d).with_rules(peers);
        let mut nodes = DecodeNodes::new();
        let (mut worker_of, mut rank_of, mut group_of) = (BTreeMap::new(), Vec::new(), BTreeMap::new());
        for rank in d.ranks(Role::Decode) {
            let width = d.layout(rank.engine).tp;
            // The scheduler admits nothing here (tests hand requests to the workers), so only
            // its barrier is used.
            let limits = SchedulerLimits {
                width,
                max_batch: 1,
                pool_blocks: 0,
                block_size_tokens: 1,
                allocation: KvAllocation::Reserve,
            };
            let group = *group_of
                .entry((rank.engine, rank.dp))
                .or_insert_with(|| nodes.add_group(DecodeScheduler::new(limits, policy.handshake)));
            let mut config = DecodeConfig::new(
                rank,
                d.layout(rank.engine),
                d.model.clone(),
                policy,
                book.engine_id(rank.engine),
            );
            config.peers = book.rules.clone();
            worker_of.insert(rank, nodes.add_worker(group, DecodeWorker::new(config)));
            rank_of.push(rank);
        }
        let mut prefill = PrefillNodes::new();
        for engine in PrefillEngine::for_deployment(&d, policy) {
            prefill.add_engine(engine.with_peers(book.rules.clone()));
        }
        for rank in d.ranks(Role::Prefill) {
            let (metadata, layers) = metadata_for(&book, &d, rank);
            prefill.add_worker(rank, PrefillWorker::new(rank, metadata, layers, &policy));
        }
        Harness {
            d,
            book,
            now: Instant::ZERO,
            nodes,
            worker_of,
            rank_of,
            group_of,
            prefill,
            dials: Vec::new(),
            reads: Vec::new(),
            releases: Vec::new(),
            results: Vec::new(),
            steps: BTreeMap::new(),
            received: Vec::new(),
            failed: Vec::new(),
            invalidated: Vec::new(),
            aborts: Vec::new(),
            engine_log: Vec::new(),
            worker_log: Vec::new(),
            leases: 0,
        }
    }

    /// Prefill of request `n` finished on `engine`'s DP rank `owner_dp` with `blocks`; returns
    /// what the decode workers of decode engine 0 get for it (the proxy's forwarded params).
    pub(super) fn prefill_done(&mut self, n: u64, engine: u16, owner_dp: u16, blocks: &[u32]) -> RecvRequest {
        let transfer_id = TransferId::from_u128(u128::from(n));
        let prefill = EngineId::prefill(engine);
        let decode = self.d.decode[0];
        let event = EngineEvent::PrefillDone(PrefillDone {
            request: RequestId(n),
            transfer_id: transfer_id.clone(),
            owner_dp,
            blocks: blocks.to_vec(),
            decode,
            reader: Some((EngineId::decode(0), 0)),
            holders: None,
        });
        self.engine_event(usize::from(engine), event);
        let layout = self.d.layout(prefill);
        let answer = KvTransferParams::prefill_answer(&PrefillAnswer {
            transfer_id: Some(&transfer_id),
            blocks,
            address: self.book.engine(prefill),
            layout,
            extensions: Extensions::ALL,
            holders: None,
            blocks_per_group: true,
        });
        RecvRequest {
            request: RequestId(n),
            prefill_engine: prefill,
            prefill_address: self.book.engine(prefill).clone(),
            params: answer.forwarded(&transfer_id, (layout.dp > 1).then_some(owner_dp), layout.tp),
            local_block_ids: blocks.iter().map(|b| b + 500).collect(),
        }
    }

    pub(super) fn group(&self, dp: u16) -> Vec<RankId> {
        self.worker_of.keys().copied().filter(|r| r.engine == EngineId::decode(0) && r.dp == dp).collect()
    }

    /// Decode rank `rank`'s worker.
    pub(super) fn decoder(&self, rank: RankId) -> &DecodeWorker {
        self.nodes.worker(self.worker_of[&rank])
    }

    /// The barrier of decode engine 0's DP group `dp`.
    pub(super) fn barrier(&self, dp: u16) -> &DecodeGroup {
        self.nodes.sched(self.group_of[&(EngineId::decode(0), dp)]).barrier()
    }

    /// Every worker of decode DP group `dp` begins `step` with `requests` (its barrier first).
    pub(super) fn begin_step(&mut self, dp: u16, step: u64, requests: &[RecvRequest]) {
        self.group_event((EngineId::decode(0), dp), GroupEvent::StepBegin { step });
        for rank in self.group(dp) {
            let event = DecodeEvent::StepBegin { step, requests: requests.to_vec() };
            self.decode_event(rank, event);
        }
    }

    /// Request `n` (blocks `blocks`, owned by prefill engine 0's DP rank `owner_dp`) through a
    /// step of decode DP group `dp` in which every message arrives: prefill done, step begin,
    /// handshakes answered, votes delivered. Reads are left posted.
    pub(super) fn step_with_request(&mut self, n: u64, owner_dp: u16, blocks: &[u32], dp: u16) {
        let req = self.prefill_done(n, 0, owner_dp, blocks);
        self.begin_step(dp, 1, &[req]);
        self.deliver_dials(|_| true);
        self.deliver_votes();
    }

    pub(super) fn decode_event(&mut self, rank: RankId, event: DecodeEvent) {
        let mut out = Vec::new();
        self.nodes.handle_worker(self.now, self.worker_of[&rank], event, &mut out);
        self.node_outputs(out);
    }

    /// What the decode nodes asked: messages wait until a test delivers them, vote results
    /// wait in `results`; what the workers reported is logged for the tests.
    fn node_outputs(&mut self, out: Vec<NodeOutput>) {
        for output in out {
            let (worker, action) = match output {
                NodeOutput::Action { worker, action } => (worker, action),
                NodeOutput::Handled { .. } => continue,
                NodeOutput::Group { group, output } => {
                    self.group_output(group, output);
                    continue;
                }
            };
            let rank = self.rank_of[worker];
            match action {
                DecodeAction::DialHandshake { session, rank: to, .. } => {
                    self.dials.push(Dial { from: rank, session, to })
                }
                DecodeAction::PostRead(op) => self.reads.push((rank, op)),
                DecodeAction::SendRelease { rank: to, release, .. } => self.releases.push((to, *release)),
                DecodeAction::SendLease { rank: to, lease, .. } => {
                    self.leases += 1;
                    let event = WorkerEvent::Lease {
                        transfer_id: lease.transfer_id,
                        lease_ms: lease.lease_ms,
                        incarnation: lease.incarnation,
                        mac: lease.mac,
                    };
                    self.worker_event(to, event);
                }
                // The group took the vote and the step reports (the nodes routed them); the
                // tests read each worker's step reports.
                DecodeAction::CastVote { .. } => {}
                DecodeAction::StepReady { step } => self.steps.entry(rank).or_default().push((step, None)),
                DecodeAction::StepFailed { step, error } => {
                    self.steps.entry(rank).or_default().push((step, Some(*error)))
                }
                DecodeAction::RequestReceived { request } => self.received.push((rank, request)),
                DecodeAction::RequestFailed { request, error } => self.failed.push((rank, request, error)),
                DecodeAction::InvalidateBlocks { request, .. } => self.invalidated.push((rank, request)),
                DecodeAction::AbortReads { request } => self.aborts.push((rank, request)),
            }
        }
    }

    /// A decode DP group's barrier decided: its vote results wait in `results`.
    fn group_output(&mut self, group: usize, output: SchedulerOutput<RecvError>) {
        match output {
            SchedulerOutput::Group(GroupAction::VoteResult { member, step, ok }) => {
                let worker = self.nodes.members(group)[usize::from(member.0)];
                self.results.push((self.rank_of[worker], step, ok))
            }
            SchedulerOutput::Group(GroupAction::Ignored(why)) => {
                panic!("the scripted driver fed group {group} an input it ignored: {why}")
            }
            // Requests are handed to the workers, not admitted, so the scheduler's request
            // barrier decides nothing.
            SchedulerOutput::Group(GroupAction::Forward { .. })
            | SchedulerOutput::ToMember { .. }
            | SchedulerOutput::Joined(_)
            | SchedulerOutput::Failed { .. }
            | SchedulerOutput::DoubleFree { .. } => {}
            SchedulerOutput::Preempted(_) | SchedulerOutput::Resumed { .. } => {
                unreachable!("a reserved allocation preempts nothing")
            }
        }
    }

    /// Delivers the pending dials that `keep` accepts (the others are lost) and their replies.
    pub(super) fn deliver_dials(&mut self, keep: impl Fn(&Dial) -> bool) {
        let dials = std::mem::take(&mut self.dials);
        for dial in dials.into_iter().filter(|d| keep(d)) {
            let mut out = Vec::new();
            let worker = self.prefill.worker_of(dial.to).expect("a prefill rank");
            self.prefill.worker_mut(worker).handle(
                self.now,
                WorkerEvent::HandshakeRequest { peer: 0 },
                &mut out,
            );
            for action in out {
                let WorkerAction::SendHandshakeReply { metadata, layers, .. } = action else {
                    panic!("{action:?}")
                };
                let session = dial.session.clone();
                self.decode_event(
                    dial.from,
                    DecodeEvent::HandshakeMetadata { session: session.clone(), metadata },
                );
                self.decode_event(dial.from, DecodeEvent::HandshakeDescriptors { session, layers });
            }
        }
    }

    /// Feeds a decode DP group's barrier; the vote results it decides wait in `results`.
    pub(super) fn group_event(&mut self, group: (EngineId, u16), event: GroupEvent) {
        let mut out = Vec::new();
        self.nodes.handle_group_event(self.now, self.group_of[&group], event, &mut out);
        self.node_outputs(out);
    }

    /// The MIN collective's answers: delivers every vote result the groups decided.
    pub(super) fn deliver_votes(&mut self) {
        for (rank, step, ok) in std::mem::take(&mut self.results) {
            self.decode_event(rank, DecodeEvent::VoteResult { step, ok });
        }
    }

    /// Completes every pending read with the outcome `outcome` picks for it.
    pub(super) fn complete_reads(&mut self, outcome: impl Fn(RankId, &ReadOp) -> ReadOutcome) {
        let reads = std::mem::take(&mut self.reads);
        for (rank, op) in reads {
            let result = outcome(rank, &op);
            self.decode_event(
                rank,
                DecodeEvent::ReadDone { request: op.request(), layer: op.layer, outcome: result },
            );
        }
    }

    /// Delivers pending releases one at a time, each `copies` times.
    pub(super) fn deliver_releases(&mut self, copies: usize) {
        let releases = std::mem::take(&mut self.releases);
        for (to, release) in releases {
            for _ in 0..copies {
                self.worker_event(to, WorkerEvent::Release(release.clone()));
            }
        }
    }

    pub(super) fn worker_event(&mut self, rank: RankId, event: WorkerEvent) {
        let Some(worker) = self.prefill.worker_of(rank) else { return };
        let mut out = Vec::new();
        self.prefill.handle_worker(self.now, worker, event, &mut out);
        self.log_prefill(out);
    }

    /// Prefill engine `engine` handles `event` (which it must take).
    pub(super) fn engine_event(&mut self, engine: usize, event: EngineEvent) {
        let mut out = Vec::new();
        self.prefill.handle_engine(self.now, engine, event, &mut out).unwrap();
        self.log_prefill(out);
    }

    /// Every prefill engine reaps after `ns`.
    pub(super) fn set_defer_timeout_ns(&mut self, ns: u64) {
        for e in 0..self.prefill.engines().len() {
            let engine = self.prefill.engine(e).clone().with_defer_timeout_ns(ns);
            self.prefill.replace_engine(e, engine);
        }
    }

    /// Logs what the prefill nodes did, for the tests (the nodes delivered what they route).
    fn log_prefill(&mut self, out: Vec<PrefillOutput>) {
        for output in out {
            match output {
                PrefillOutput::Worker { action, .. } => self.worker_log.push(action),
                PrefillOutput::Engine { action, .. } => self.engine_log.push(action),
                PrefillOutput::Refused { .. } | PrefillOutput::EngineHandled { .. } => {}
            }
        }
    }

    /// Moves time forward by `ns`, ticking every node whose timer came due, until none is due.
    pub(super) fn advance(&mut self, ns: u64) {
        self.now = self.now.add_ns(ns);
        loop {
            let due: Vec<RankId> = self
                .worker_of
                .iter()
                .filter(|(_, &w)| self.nodes.worker(w).poll_timeout().is_some_and(|t| t <= self.now))
                .map(|(r, _)| *r)
                .collect();
            let engines: Vec<usize> = (0..self.prefill.engines().len())
                .filter(|&i| self.prefill.engine(i).poll_timeout().is_some_and(|t| t <= self.now))
                .collect();
            if due.is_empty() && engines.is_empty() {
                break;
            }
            for rank in due {
                self.decode_event(rank, DecodeEvent::Tick);
            }
            for i in engines {
                self.engine_event(i, EngineEvent::Tick);
            }
        }
    }

    pub(super) fn frees(&self) -> Vec<(TransferId, bool)> {
        self.engine_log
            .iter()
            .filter_map(|a| match a {
                EngineAction::FreeBlocks { transfer_id, reaped, .. } => Some((transfer_id.clone(), *reaped)),
                _ => None,
            })
            .collect()
    }

    pub(super) fn step_results(&self, step: u64) -> Vec<(RankId, Option<StepError>)> {
        let mut out = Vec::new();
        for (rank, results) in &self.steps {
            for (s, result) in results {
                if *s == step {
                    out.push((*rank, result.clone()));
                }
            }
        }
        out
    }
}

pub(super) fn tx(n: u64) -> TransferId {
    TransferId::from_u128(u128::from(n))
}
