//! The simulated world: clients, proxy, engines, NICs and listeners around the core's nodes,
//! advanced by one event queue in virtual time.
//!
//! Every protocol decision is the core's: the world only delivers events to nodes (after modelled
//! latencies, service times and faults) and carries out their actions. Checkers look at each
//! action as it is carried out (safety) and at the end of the run (liveness).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

use pdkv_core::decode::{
    DecodeAction, DecodeConfig, DecodeEvent, DecodeWorker, ReadGranularity, ReadOp, ReadOutcome, RecvRequest,
};
use pdkv_core::group::{DecodeGroup, GroupAction, GroupEvent, StepReport};
use pdkv_core::ids::{EngineId, RankId, RequestId, Role, TpRank, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::params::KvTransferParams;
use pdkv_core::policy::Policy;
use pdkv_core::ports::{AddressBook, ListenerKind, SessionKey};
use pdkv_core::prefill::{
    EngineAction, EngineEvent, PrefillEngine, PrefillWorker, WorkerAction, WorkerEvent,
};
use pdkv_core::proxy::{Proxy, ProxyAction};
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, Layout};
use pdkv_core::wire::{self, ControlMessage, HandshakeMetadata, LayerMemoryDesc};

use crate::cost::{Cost, GroupLoad};
use crate::load::{parse_target, TargetPattern};
use crate::nic::{Finish, FlowId, Nics, BUCKET_NS};
use crate::result::{
    percentiles, round3, Hang, Ledger, NicStats, RunResult, Summary, Violation, ViolationKind,
};
use crate::rng::Streams;
use crate::scenario::{Clients, FaultKind, Length, Outcome, Reads, Scenario};
use crate::trace::TraceRecord;
use crate::waitfor::WaitFor;

/// Records a trace event only when tracing is on, so the arguments (formatted strings) cost
/// nothing in benchmark runs.
macro_rules! trace {
    ($world:expr, $cat:expr, $name:expr, $track:expr, $dur:expr, $detail:expr $(,)?) => {
        if $world.trace_on {
            let (track, detail) = ($track, $detail);
            $world.record($cat, $name, track, $dur, detail);
        }
    };
}

const NS_PER_MS: u64 = 1_000_000;
/// Most trace records kept; a longer run keeps the first ones and says so.
pub const MAX_TRACE_RECORDS: usize = 500_000;
/// Delay before a decode engine with requests waiting on reads steps again.
const IDLE_STEP_NS: u64 = 5 * NS_PER_MS;

/// Nanoseconds of `ms` milliseconds. Loaded scenarios keep every time far below overflow
/// (`MAX_TIME_MS`); a scenario built in code past that saturates, which means "never" here.
fn ms_ns(ms: u64) -> u64 {
    ms.saturating_mul(NS_PER_MS)
}

/// Nanoseconds of a float duration in microseconds; negative or `NaN` gives 0 and huge values
/// saturate (Rust's float-to-integer conversion), which the load-time limits keep out of reach.
fn us_ns(us: f64) -> u64 {
    (us * 1e3) as u64
}

/// Events between two progress reports.
const PROGRESS_EVERY: u64 = 8192;

/// How far a run has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Requests that ended (finished or failed).
    pub ended: u64,
    /// Requests the workload sends in all.
    pub total: u64,
    /// Virtual time, in nanoseconds.
    pub now_ns: u64,
}

/// What a run can be asked to record besides its result.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// Keep trace records (text and Chrome trace); off for benchmarks.
    pub trace: bool,
}

/// A finished run.
#[derive(Clone, Debug)]
pub struct Run {
    /// The result object.
    pub result: RunResult,
    /// Trace records, in time order, if asked for.
    pub trace: Vec<TraceRecord>,
}

#[derive(Clone, Debug)]
enum Msg {
    Dial {
        from: usize,
        session: SessionKey,
    },
    /// A MessagePack frame for a notify listener (release or read lease), and the transfer it
    /// names (so a lost one can excuse its transfer's reaping without decoding it again).
    Notify {
        bytes: Vec<u8>,
        transfer: Option<u32>,
    },
}

#[derive(Debug)]
enum Ev {
    Arrival,
    PrefillQueue {
        req: RequestId,
    },
    PrefillDone {
        group: usize,
        generation: u64,
    },
    ProxyAnswer {
        req: RequestId,
    },
    DecodeArrive {
        recv: Box<RecvRequest>,
    },
    StepBegin {
        unit: usize,
    },
    StepEnd {
        unit: usize,
        step: u64,
    },
    CollectiveTimeout {
        unit: usize,
        step: u64,
    },
    /// The vote results a decode group decided, one per member: `(member, step, ok)`.
    VoteResults {
        group: usize,
        results: Vec<(TpRank, u64, bool)>,
    },
    AtListener {
        listener: usize,
        msg: Box<Msg>,
    },
    Serve {
        listener: usize,
        msg: Box<Msg>,
    },
    ToDecode {
        worker: usize,
        event: Box<DecodeEvent>,
    },
    ToPrefill {
        rank: RankId,
        event: Box<WorkerEvent>,
    },
    Flow {
        id: FlowId,
        version: u64,
    },
    ReadLater {
        worker: usize,
        request: RequestId,
        layer: Option<u16>,
        outcome: Box<ReadOutcome>,
    },
    DecodeTick {
        worker: usize,
    },
    EngineTick {
        engine: usize,
    },
    Fault {
        index: usize,
        start: bool,
    },
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// KV blocks of one engine DP rank (the same ids on every TP rank), with their owners.
#[derive(Clone, Debug)]
struct Pool {
    capacity: u32,
    next: u32,
    free: Vec<u32>,
    /// Owner transfer (index into `World::transfers`) of each block, `u32::MAX` when free.
    owner: Vec<u32>,
}

const FREE: u32 = u32::MAX;

impl Pool {
    /// A pool of `blocks` ids. Ids are handed out fresh in ascending order, and freed ones are
    /// reused first; nothing is allocated for ids never used, so a short run with a large pool
    /// stays cheap.
    fn new(blocks: u32) -> Pool {
        Pool { capacity: blocks, next: 0, free: Vec::new(), owner: Vec::new() }
    }

    fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.next) as usize
    }

    fn alloc(&mut self, n: usize, owner: u32) -> Vec<u32> {
        debug_assert!(n <= self.available(), "caller checks availability");
        let mut blocks = Vec::with_capacity(n);
        while blocks.len() < n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    self.next += 1;
                    self.next - 1
                }
            };
            if self.owner.len() <= b as usize {
                self.owner.resize(b as usize + 1, FREE);
            }
            self.owner[b as usize] = owner;
            blocks.push(b);
        }
        blocks
    }

    /// Frees `blocks` of `owner`; returns the blocks that were not `owner`'s (a double free).
    fn release(&mut self, blocks: &[u32], owner: u32) -> Vec<u32> {
        let mut bad = Vec::new();
        for &b in blocks.iter().rev() {
            match self.owner.get(b as usize) {
                Some(&o) if o == owner => {
                    self.owner[b as usize] = FREE;
                    self.free.push(b);
                }
                _ => bad.push(b),
            }
        }
        bad
    }

    /// The owner of block `b` (`FREE` if free or never used).
    fn owner_of(&self, b: u32) -> u32 {
        self.owner.get(b as usize).copied().unwrap_or(FREE)
    }
}

struct PGroup {
    engine: usize,
    dp: u16,
    layout: Layout,
    queue: VecDeque<RequestId>,
    batch: Vec<(RequestId, Vec<u32>)>,
    busy: bool,
    pool: Pool,
    stalled_since: Option<u64>,
    stall_ns: u64,
}

#[derive(Clone, Copy, Debug)]
struct Running {
    id: RequestId,
    left: u32,
    context: u64,
    first: bool,
}

struct Pending {
    reported: u16,
    received: u16,
    failed: bool,
}

struct DGroup {
    engine: usize,
    workers: Vec<usize>,
    unit: usize,
    pool: Pool,
    waiting: VecDeque<RecvRequest>,
    /// How many requests at the front of `waiting` the workers were told are queued (they
    /// keep those leased); the rest arrived since the last step began.
    told: usize,
    pending: BTreeMap<RequestId, Pending>,
    ready: Vec<RequestId>,
    /// Requests decoding, with what each step needs of them kept inline (no map lookups).
    running: Vec<Running>,
    /// Sum of the running requests' context lengths.
    context_tokens: u64,
    /// The group's barrier: step admission, the MIN vote, forward readiness.
    barrier: DecodeGroup,
}

#[derive(PartialEq, Eq)]
enum UnitState {
    Idle,
    /// A step began at `began`; its groups' barriers say who entered the forward.
    Waiting {
        began: u64,
    },
    Computing,
}

struct Unit {
    engine: usize,
    /// When the last step ended (for inter-token latency).
    last_step_end: Option<u64>,
    /// Whether a collective-timeout event is pending for this unit.
    watchdog: bool,
    groups: Vec<usize>,
    step: u64,
    state: UnitState,
    wake_scheduled: bool,
}

impl Unit {
    /// An idle unit of decode engine `engine` with no groups yet.
    fn new(engine: usize) -> Unit {
        Unit {
            engine,
            last_step_end: None,
            watchdog: false,
            groups: Vec::new(),
            step: 0,
            state: UnitState::Idle,
            wake_scheduled: false,
        }
    }
}

struct Listener {
    rank: RankId,
    kind: ListenerKind,
    busy_until: u64,
}

struct Req {
    sent_ns: u64,
    input: u32,
    output: u32,
    prefill_group: usize,
    decode_group: usize,
    transfer: u32,

    first_token_ns: Option<u64>,
    done_ns: Option<u64>,
    failed: bool,
    prefill_blocks: Vec<u32>,
    decode_blocks: Vec<u32>,
}

struct FlowInfo {
    worker: usize,
    ops: Vec<(RequestId, Option<u16>)>,
    transfer: u32,
    server: usize,
    blocks: std::sync::Arc<[u32]>,
    started: u64,
}

struct ActiveFault {
    pattern: TargetPattern,
    kind: FaultKind,
    remaining: Option<u32>,
}

/// Every piece of state of one run.
pub struct World {
    sc: Scenario,
    d: Deployment,
    cost: Cost,
    book: AddressBook,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    events: u64,
    streams: Streams,
    proxy: Proxy,
    to_send: u64,
    open_loop: Option<f64>,
    requests: BTreeMap<RequestId, Req>,
    transfers: Vec<TransferId>,
    transfer_index: BTreeMap<TransferId, u32>,
    fenced: BTreeSet<u32>,
    p_ranks: Vec<RankId>,
    d_ranks: Vec<RankId>,
    pgroup_base: Vec<usize>,
    pgroups: Vec<PGroup>,
    engines: Vec<PrefillEngine>,
    engine_tick: Vec<Option<u64>>,
    pworkers: Vec<PrefillWorker>,
    dgroup_base: Vec<usize>,
    dgroups: Vec<DGroup>,
    units: Vec<Unit>,
    dworkers: Vec<DecodeWorker>,
    dworker_tick: Vec<Option<u64>>,
    dworker_group: Vec<usize>,
    listeners: Vec<Listener>,
    listener_at: BTreeMap<(String, u16), usize>,
    regions: BTreeMap<u64, (usize, u64)>,
    nics: Nics,
    flows: BTreeMap<FlowId, FlowInfo>,
    faults: Vec<Option<ActiveFault>>,
    reads: Vec<u64>,
    bytes: Vec<u64>,
    /// Decode step gaps and how many tokens waited each one.
    itl: Vec<(u64, u64)>,
    violations: Vec<Violation>,
    hangs: Vec<Hang>,
    /// Prefill and decode engines that are down (crashed, not yet restarted).
    prefill_down: Vec<bool>,
    decode_down: Vec<bool>,
    /// Incarnation of each prefill rank (bumped at every restart; it moves the memory regions).
    epoch: Vec<u64>,
    /// Regions of crashed incarnations: reads into them fail as a NIC would (stale keys).
    retired_regions: BTreeMap<u64, (usize, u64)>,
    /// Transfers whose decode side crashed: their reaping is expected, not a leak.
    excused: BTreeSet<u32>,
    /// Per rank (prefill ranks, then decode ranks, as NICs are numbered), the merged time
    /// intervals in which an injected fault touched it, each widened by `grace_ns`; a failed
    /// request is excused when one overlaps its life on one of its ranks.
    touched: Vec<Vec<(u64, u64)>>,
    /// How long after a fault touched a rank a request can still fail because of it: a lost
    /// dial surfaces at the handshake timeout, a lost read at the transfer timeout.
    grace_ns: u64,
    /// Arrivals the proxy refused (its in-flight cap); counted as unsent.
    refused: u64,
    reaped_excused: u64,
    /// Transfers whose prefill engine crashed while holding them.
    lost_in_crash: u64,
    /// Freed and reaped counts of prefill engine incarnations that crashed.
    crashed_freed: u64,
    crashed_reaped: u64,
    /// Generation of each prefill group, bumped by a crash so its in-flight batch is dropped.
    pgroup_generation: Vec<u64>,
    /// Spare action buffers for `decode` (reused, never shrunk).
    buffers: Vec<Vec<DecodeAction>>,
    stopped: bool,
    /// The run's time or event budget ended with events still to run (not a natural end).
    budget_ended: bool,
    /// When a request last ended (finished or failed): whether the run was still progressing
    /// when its budget ended.
    last_end_ns: u64,
    max_hold_ns: u64,
    trace_on: bool,
    trace: Vec<TraceRecord>,
    trace_dropped: u64,
}

fn ms(ns: u64) -> f64 {
    round3(ns as f64 / NS_PER_MS as f64)
}

/// A prefill worker of rank `rank` (index `i`) in incarnation `epoch`, with its memory regions
/// (base addresses and their common length). Every incarnation of every rank gets a disjoint
/// slice of one global address space, so a read's address says whose memory it touches, and
/// addresses of a crashed incarnation are recognisably stale.
#[allow(clippy::too_many_arguments)]
fn build_prefill_worker(
    sc: &Scenario,
    d: &Deployment,
    book: &AddressBook,
    cost: &Cost,
    policy: &Policy,
    rank: RankId,
    i: usize,
    epoch: u64,
    num_blocks: u32,
) -> (PrefillWorker, Vec<u64>, u64) {
    let block_len = cost.block_bytes_per_layer(d.layout(rank.engine).tp);
    let region_len = u64::from(num_blocks) * block_len;
    let rank_base = ((i as u64 + 1) << 44) + (epoch << 38);
    let bases: Vec<u64> = (0..u64::from(sc.model.layers)).map(|l| rank_base + l * region_len).collect();
    let metadata = HandshakeMetadata {
        engine_id: book.engine_id(rank.engine),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: bases.clone(),
        num_blocks,
        block_len,
        attn_backend_name: "pdkv-sim".into(),
        rank: None,
    };
    let layers = (0..sc.model.layers)
        .map(|l| LayerMemoryDesc { layer_name: format!("model.layers.{l}"), descs: vec![vec![0]] })
        .collect();
    (PrefillWorker::new(rank, metadata, layers, policy), bases, region_len)
}

/// A decode worker for `rank` with the scenario's protocol settings.
fn build_decode_worker(
    sc: &Scenario,
    d: &Deployment,
    book: &AddressBook,
    policy: &Policy,
    rank: RankId,
) -> DecodeWorker {
    let mut config =
        DecodeConfig::new(rank, d.layout(rank.engine), d.model.clone(), *policy, book.engine_id(rank.engine));
    config.handshake_timeout_ns = ms_ns(sc.protocol.handshake_timeout_ms);
    config.transfer_timeout_ns = ms_ns(sc.protocol.transfer_timeout_ms);
    config.granularity = match sc.protocol.reads {
        Reads::PerLayer => ReadGranularity::PerLayer,
        Reads::PerRequest => ReadGranularity::PerRequest,
    };
    DecodeWorker::new(config)
}

impl World {
    /// Builds the world of `sc`; fails if the scenario cannot run.
    pub fn new(sc: &Scenario, options: RunOptions) -> Result<World, crate::SimError> {
        let d = crate::error::routable_deployment(sc)?;
        let policy = Policy::from(&sc.protocol.legacy.iter().copied().collect::<LegacyOptions>());
        let cost = Cost::new(&sc.model, &sc.hardware, &sc.cost);
        let book = AddressBook::one_host_per_engine(&d);
        let p_ranks = d.ranks(Role::Prefill);
        let d_ranks = d.ranks(Role::Decode);
        let blocks_for = |tp: u16| {
            if sc.engines.kv_blocks_per_gpu > 0 {
                sc.engines.kv_blocks_per_gpu
            } else {
                cost.kv_blocks_per_gpu(tp)
            }
        };

        // Prefill: groups (engine, dp), engines, workers with their memory regions.
        let mut pgroup_base = Vec::new();
        let mut pgroups = Vec::new();
        let mut engines = Vec::new();
        for (e, &layout) in d.prefill.iter().enumerate() {
            pgroup_base.push(pgroups.len());
            for dp in 0..layout.dp {
                pgroups.push(PGroup {
                    engine: e,
                    dp,
                    layout,
                    queue: VecDeque::new(),
                    batch: Vec::new(),
                    busy: false,
                    pool: Pool::new(blocks_for(layout.tp)),
                    stalled_since: None,
                    stall_ns: 0,
                });
            }
            let engine = PrefillEngine::new(EngineId::prefill(e as u16), layout, d.model.clone(), policy)
                .with_defer_timeout_ns(ms_ns(sc.protocol.defer_timeout_ms));
            engines.push(engine);
        }
        let mut regions = BTreeMap::new();
        let mut pworkers = Vec::new();
        for (i, &rank) in p_ranks.iter().enumerate() {
            let blocks = blocks_for(d.layout(rank.engine).tp);
            let (worker, bases, len) =
                build_prefill_worker(sc, &d, &book, &cost, &policy, rank, i, 0, blocks);
            for base in bases {
                regions.insert(base, (i, len));
            }
            pworkers.push(worker);
        }

        // Listeners, bound in rank order; a port taken already fails to bind (EADDRINUSE).
        let mut listeners = Vec::new();
        let mut listener_at = BTreeMap::new();
        for &rank in &p_ranks {
            for kind in [ListenerKind::Handshake, ListenerKind::Notify] {
                let Ok(endpoint) = book.listen_endpoint(&d, rank, kind, &policy) else { continue };
                let key = (endpoint.host, endpoint.port);
                if let std::collections::btree_map::Entry::Vacant(slot) = listener_at.entry(key) {
                    slot.insert(listeners.len());
                    listeners.push(Listener { rank, kind, busy_until: 0 });
                }
            }
        }

        // Decode: groups, units (an EP engine steps all its DP ranks together), workers.
        let mut dgroup_base = Vec::new();
        let mut dgroups = Vec::new();
        let mut units = Vec::new();
        let mut dworkers = Vec::new();
        let mut dworker_group = Vec::new();
        for (e, &layout) in d.decode.iter().enumerate() {
            dgroup_base.push(dgroups.len());
            let engine_unit = units.len();
            if layout.ep {
                units.push(Unit::new(e));
            }
            for dp in 0..layout.dp {
                let unit = if layout.ep {
                    engine_unit
                } else {
                    units.push(Unit::new(e));
                    units.len() - 1
                };
                let g = dgroups.len();
                units[unit].groups.push(g);
                let mut workers = Vec::new();
                for tp in 0..layout.tp {
                    let rank = RankId::new(EngineId::decode(e as u16), dp, tp);
                    workers.push(dworkers.len());
                    dworkers.push(build_decode_worker(sc, &d, &book, &policy, rank));
                    dworker_group.push(g);
                }
                dgroups.push(DGroup {
                    engine: e,
                    workers,
                    unit,
                    pool: Pool::new(blocks_for(layout.tp)),
                    waiting: VecDeque::new(),
                    told: 0,
                    pending: BTreeMap::new(),
                    ready: Vec::new(),
                    running: Vec::new(),
                    context_tokens: 0,
                    barrier: DecodeGroup::new(layout.tp, policy.handshake),
                });
            }
        }

        let (to_send, open_loop) = match sc.workload.clients {
            Clients::Closed { requests, .. } => (u64::from(requests), None),
            Clients::Open { rate_per_s, requests } => (u64::from(requests), Some(rate_per_s)),
        };
        let nic_count = p_ranks.len() + d_ranks.len();
        let (d_prefill_engines, d_decode_engines) = (d.prefill.len(), d.decode.len());
        let (prefill_rank_count, prefill_group_count) = (p_ranks.len(), pgroups.len());
        let mut world = World {
            proxy: Proxy::new(&d, policy.proxy),
            streams: Streams::new(sc.seed),
            nics: Nics::new(nic_count, sc.hardware.nic_gb_s),
            reads: vec![0; p_ranks.len()],
            bytes: vec![0; p_ranks.len()],
            engine_tick: vec![None; engines.len()],
            dworker_tick: vec![None; dworkers.len()],
            faults: Vec::new(),
            sc: sc.clone(),
            d,
            cost,
            book,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: 0,
            to_send,
            open_loop,
            requests: BTreeMap::new(),
            transfers: Vec::new(),
            transfer_index: BTreeMap::new(),
            fenced: BTreeSet::new(),
            p_ranks,
            d_ranks,
            pgroup_base,
            pgroups,
            engines,
            pworkers,
            dgroup_base,
            dgroups,
            units,
            dworkers,
            dworker_group,
            listeners,
            listener_at,
            regions,
            flows: BTreeMap::new(),
            itl: Vec::new(),
            violations: Vec::new(),
            hangs: Vec::new(),
            buffers: Vec::new(),
            prefill_down: vec![false; d_prefill_engines],
            decode_down: vec![false; d_decode_engines],
            epoch: vec![0; prefill_rank_count],
            retired_regions: BTreeMap::new(),
            excused: BTreeSet::new(),
            touched: vec![Vec::new(); nic_count],
            grace_ns: ms_ns(sc.protocol.handshake_timeout_ms)
                .saturating_add(ms_ns(sc.protocol.transfer_timeout_ms)),
            refused: 0,
            reaped_excused: 0,
            lost_in_crash: 0,
            crashed_freed: 0,
            crashed_reaped: 0,
            pgroup_generation: vec![0; prefill_group_count],
            stopped: false,
            budget_ended: false,
            last_end_ns: 0,
            max_hold_ns: 0,
            trace_on: options.trace,
            trace: Vec::new(),
            trace_dropped: 0,
        };
        world.start();
        Ok(world)
    }

    fn at(&mut self, delay_ns: u64, ev: Ev) {
        self.seq += 1;
        // A delay that would pass the end of u64 time is "never": the event sorts after the
        // run's time budget, so it is not run, instead of wrapping to the past.
        let at = self.now.saturating_add(delay_ns);
        self.queue.push(Reverse(Scheduled { at, seq: self.seq, ev }));
    }

    fn record(&mut self, cat: &'static str, name: &str, track: String, dur_ns: Option<u64>, detail: String) {
        if !self.trace_on {
            return;
        }
        if self.trace.len() >= MAX_TRACE_RECORDS {
            self.trace_dropped += 1;
            return;
        }
        let t_ns = self.now;
        self.trace.push(TraceRecord { t_ns, dur_ns, cat, name: name.to_string(), track, detail });
    }

    fn start(&mut self) {
        match (self.sc.workload.clients, self.open_loop) {
            (Clients::Closed { concurrency, .. }, _) => {
                for _ in 0..concurrency.min(self.to_send as u32) {
                    self.at(0, Ev::Arrival);
                }
            }
            (_, Some(rate)) => {
                let gap = self.streams.exponential_ns(rate);
                self.at(gap, Ev::Arrival);
            }
            _ => {}
        }
        let timeline = self.sc.faults.timeline.clone();
        for (index, fault) in timeline.iter().enumerate() {
            self.faults.push(None);
            self.seq += 1;
            let at = ms_ns(fault.at_ms);
            self.queue.push(Reverse(Scheduled { at, seq: self.seq, ev: Ev::Fault { index, start: true } }));
            if let Some(duration) = fault.duration_ms {
                self.seq += 1;
                let ev = Ev::Fault { index, start: false };
                let end = at.saturating_add(ms_ns(duration));
                self.queue.push(Reverse(Scheduled { at: end, seq: self.seq, ev }));
            }
        }
    }

    /// Runs to the end and returns the result.
    pub fn run(self) -> Run {
        self.run_with_progress(&mut |_| {})
    }

    /// Runs to the end, reporting progress every few thousand events (for progress bars).
    pub fn run_with_progress(mut self, progress: &mut dyn FnMut(Progress)) -> Run {
        let limit_ns = self.sc.limits.max_virtual_time_s.saturating_mul(1_000_000_000);
        while let Some(Reverse(next)) = self.queue.pop() {
            if next.at > limit_ns || self.events >= self.sc.limits.max_events {
                self.now = self.now.max(next.at.min(limit_ns));
                self.budget_ended = true;
                break;
            }
            self.now = next.at;
            self.events += 1;
            self.dispatch(next.ev);
            if self.events.is_multiple_of(PROGRESS_EVERY) {
                progress(self.progress());
            }
            if self.stopped {
                break;
            }
        }
        self.finish()
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Arrival => self.on_arrival(),
            Ev::PrefillQueue { req } => {
                let g = self.requests[&req].prefill_group;
                if self.prefill_down[self.pgroups[g].engine] {
                    trace!(
                        self,
                        "proxy",
                        "refused",
                        "proxy".to_string(),
                        None,
                        format!("{req}: prefill engine down")
                    );
                    self.end_request(req, true);
                    return;
                }
                self.pgroups[g].queue.push_back(req);
                self.try_prefill(g);
            }
            Ev::PrefillDone { group, generation } => {
                if generation == self.pgroup_generation[group] {
                    self.on_prefill_done(group);
                }
            }
            Ev::ProxyAnswer { req } => self.on_proxy_answer(req),
            Ev::DecodeArrive { recv } => {
                let g = self.requests[&recv.request].decode_group;
                if self.decode_down[self.dgroups[g].engine] {
                    let transfer = self.requests[&recv.request].transfer;
                    self.excused.insert(transfer);
                    self.end_request(recv.request, true);
                    return;
                }
                self.dgroups[g].waiting.push_back(*recv);
                self.wake(self.dgroups[g].unit);
            }
            Ev::StepBegin { unit } => self.on_step_begin(unit),
            Ev::StepEnd { unit, step } => self.on_step_end(unit, step),
            Ev::CollectiveTimeout { unit, step } => self.on_collective_timeout(unit, step),
            Ev::VoteResults { group, results } => {
                for (member, step, ok) in results {
                    let w = self.dgroups[group].workers[usize::from(member.0)];
                    self.decode(w, DecodeEvent::VoteResult { step, ok });
                }
            }
            Ev::AtListener { listener, msg } => self.on_at_listener(listener, *msg),
            Ev::Serve { listener, msg } => self.on_serve(listener, *msg),
            Ev::ToDecode { worker, event } => self.decode(worker, *event),
            Ev::ToPrefill { rank, event } => self.prefill_worker(rank, *event),
            Ev::Flow { id, version } => self.on_flow(id, version),
            Ev::ReadLater { worker, request, layer, outcome } => {
                self.decode(worker, DecodeEvent::ReadDone { request, layer, outcome: *outcome })
            }
            Ev::DecodeTick { worker } => {
                if self.dworker_tick[worker] == Some(self.now) {
                    self.dworker_tick[worker] = None;
                    self.decode(worker, DecodeEvent::Tick);
                }
            }
            Ev::EngineTick { engine } => {
                if self.engine_tick[engine] == Some(self.now) {
                    self.engine_tick[engine] = None;
                    self.engine(engine, EngineEvent::Tick);
                }
            }
            Ev::Fault { index, start } => self.on_fault(index, start),
        }
    }

    // ---------------------------------------------------------------- clients and proxy

    fn length(&mut self, length: Length) -> u32 {
        match length {
            Length::Fixed(n) => n,
            Length::Uniform { min, max } => self.streams.uniform(min, max),
        }
    }

    fn on_arrival(&mut self) {
        if self.to_send == 0 {
            return;
        }
        self.to_send -= 1;
        if let (Some(rate), true) = (self.open_loop, self.to_send > 0) {
            let gap = self.streams.exponential_ns(rate);
            self.at(gap, Ev::Arrival);
        }
        let input = self.length(self.sc.workload.input_tokens).max(1);
        let output = self.length(self.sc.workload.output_tokens).max(1);
        let bits = self.streams.transfer_bits();
        let Ok((id, action)) = self.proxy.handle_request(bits) else {
            // The load-time limits keep requests below the proxy's in-flight cap, so this does
            // not happen for a loaded scenario; if it does, the request is counted, not lost.
            self.refused += 1;
            return;
        };
        let ProxyAction::SendPrefill { slot, params, .. } = action else {
            unreachable!("new requests go to prefill")
        };
        let prefill_group = self.pgroup_base[usize::from(slot.engine.index)] + usize::from(slot.dp());
        let decode_slot = self.proxy.request(id).expect("just routed").decode;
        let decode_group =
            self.dgroup_base[usize::from(decode_slot.engine.index)] + usize::from(decode_slot.dp());
        let transfer_id = TransferId(params.transfer_id.clone().unwrap_or_default());
        let transfer = self.transfers.len() as u32;
        self.transfers.push(transfer_id.clone());
        self.transfer_index.insert(transfer_id, transfer);
        let req = Req {
            sent_ns: self.now,
            input,
            output,
            prefill_group,
            decode_group,
            transfer,

            first_token_ns: None,
            done_ns: None,
            failed: false,
            prefill_blocks: Vec::new(),
            decode_blocks: Vec::new(),
        };
        self.requests.insert(id, req);
        trace!(
            self,
            "proxy",
            "request",
            "proxy".into(),
            None,
            format!("{id} prefill={slot} decode={decode_slot}"),
        );
        let latency = self.control_ns();
        self.at(latency, Ev::PrefillQueue { req: id });
    }

    fn control_ns(&self) -> u64 {
        us_ns(self.sc.hardware.control_latency_us)
    }

    /// A request ended (finished or failed): the closed-loop client sends its next one.
    /// The longest a progressing run may go without a request ending: the collective timeout,
    /// or a transfer's handshake, transfer and defer timeouts in a row, whichever is longer.
    fn stall_window_ns(&self) -> u64 {
        let p = &self.sc.protocol;
        let transfer = ms_ns(p.handshake_timeout_ms)
            .saturating_add(ms_ns(p.transfer_timeout_ms))
            .saturating_add(ms_ns(p.defer_timeout_ms));
        ms_ns(p.collective_timeout_ms).max(transfer)
    }

    fn end_request(&mut self, id: RequestId, failed: bool) {
        let Some(req) = self.requests.get_mut(&id) else { return };
        if req.done_ns.is_some() {
            return;
        }
        req.done_ns = Some(self.now);
        req.failed = failed;
        self.last_end_ns = self.now;
        // Its decode blocks were freed before it ended (or went with a crashed engine), and its
        // prefill blocks are the engine's to free; dropping the copies keeps memory in line with
        // the requests in flight rather than with every request of the run.
        req.prefill_blocks = Vec::new();
        req.decode_blocks = Vec::new();
        let _ = self.proxy.handle_finished(id);
        if matches!(self.sc.workload.clients, Clients::Closed { .. }) && self.to_send > 0 {
            self.at(0, Ev::Arrival);
        }
    }

    fn on_proxy_answer(&mut self, id: RequestId) {
        let req = &self.requests[&id];
        let group = &self.pgroups[req.prefill_group];
        let engine = EngineId::prefill(group.engine as u16);
        let address = self.book.engine(engine).clone();
        let answer = KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(self.transfers[req.transfer as usize].0.clone()),
            remote_block_ids: req.prefill_blocks.iter().map(|&b| u64::from(b)).collect(),
            remote_engine_id: Some(address.engine_id()),
            remote_host: Some(address.host.clone()),
            remote_handshake_port: Some(i64::from(address.handshake_port_base)),
            remote_notify_port: Some(i64::from(address.notify_port_base)),
            remote_dp_size: Some(i64::from(group.layout.dp)),
            tp_size: Some(i64::from(group.layout.tp)),
            ..KvTransferParams::default()
        };
        match self.proxy.handle_prefill_response(id, answer) {
            Ok(ProxyAction::SendDecode { params, .. }) => {
                let recv = RecvRequest {
                    request: id,
                    prefill_engine: engine,
                    prefill_address: address,
                    params,
                    local_block_ids: Vec::new(),
                };
                let latency = self.control_ns();
                self.at(latency, Ev::DecodeArrive { recv: Box::new(recv) });
            }
            Ok(_) => {
                let detail = format!("the proxy answered the prefill answer of {id} with no decode dispatch");
                self.violation(ViolationKind::ProtocolError, vec![], detail);
            }
            Err(error) => {
                let detail = format!("proxy refused the prefill answer of {id}: {error}");
                self.violation(ViolationKind::ProtocolError, vec![], detail);
            }
        }
    }

    // ---------------------------------------------------------------- prefill

    fn try_prefill(&mut self, g: usize) {
        let block = u64::from(self.sc.model.block_size_tokens);
        let max_tokens = u64::from(self.sc.engines.prefill_max_batched_tokens);
        let group = &mut self.pgroups[g];
        if group.busy || group.queue.is_empty() {
            return;
        }
        let mut tokens = 0u64;
        let mut batch = Vec::new();
        while let Some(&id) = group.queue.front() {
            let req = &self.requests[&id];
            let need = u64::from(req.input).div_ceil(block) as usize;
            let fits_tokens = batch.is_empty() || tokens + u64::from(req.input) <= max_tokens;
            if !fits_tokens || group.pool.available() < need {
                break;
            }
            group.queue.pop_front();
            tokens += u64::from(req.input);
            let blocks = group.pool.alloc(need, req.transfer);
            batch.push((id, blocks));
        }
        if batch.is_empty() {
            // The head does not fit in the free blocks: prefill stalls until blocks are freed.
            group.stalled_since.get_or_insert(self.now);
            return;
        }
        if let Some(since) = group.stalled_since.take() {
            group.stall_ns += self.now - since;
        }
        group.busy = true;
        let duration = self.cost.prefill_batch_ns(group.layout, tokens);
        let (engine, dp, count) = (group.engine, group.dp, batch.len());
        group.batch = batch;
        trace!(
            self,
            "prefill",
            "batch",
            format!("P{engine}.dp{dp}"),
            Some(duration),
            format!("requests={count} tokens={tokens}"),
        );
        let generation = self.pgroup_generation[g];
        self.at(duration, Ev::PrefillDone { group: g, generation });
    }

    fn on_prefill_done(&mut self, g: usize) {
        let batch = std::mem::take(&mut self.pgroups[g].batch);
        self.pgroups[g].busy = false;
        let (e, dp) = (self.pgroups[g].engine, self.pgroups[g].dp);
        for (id, blocks) in batch {
            let req = self.requests.get_mut(&id).expect("batched requests exist");
            req.prefill_blocks = blocks.clone();
            let decode = self.d.decode[self.dgroups[req.decode_group].engine];
            let event = EngineEvent::PrefillDone {
                request: id,
                transfer_id: self.transfers[req.transfer as usize].clone(),
                owner_dp: dp,
                blocks: blocks.clone(),
                decode,
                // A decode engine crashes whole in the simulator; no lone reader is lost.
                reader: None,
            };
            let transfer = req.transfer;
            let mut out = Vec::new();
            match self.engines[e].handle(Instant(self.now), event, &mut out) {
                Ok(()) => {
                    self.engine_actions(e, out);
                    let latency = self.control_ns();
                    self.at(latency, Ev::ProxyAnswer { req: id });
                }
                Err(error) => {
                    self.pgroups[g].pool.release(&blocks, transfer);
                    trace!(
                        self,
                        "prefill",
                        "refused",
                        format!("P{e}.dp{dp}"),
                        None,
                        format!("{id}: {error}")
                    );
                    self.end_request(id, true);
                }
            }
        }
        self.engine_timer(e);
        self.try_prefill(g);
    }

    fn engine(&mut self, e: usize, event: EngineEvent) {
        let mut out = Vec::new();
        if let Err(error) = self.engines[e].handle(Instant(self.now), event, &mut out) {
            self.violation(ViolationKind::ProtocolError, vec![format!("P{e}")], error.to_string());
        }
        self.engine_actions(e, out);
        self.engine_timer(e);
    }

    fn engine_timer(&mut self, e: usize) {
        if let Some(Instant(t)) = self.engines[e].poll_timeout() {
            if self.engine_tick[e].is_none_or(|s| t < s) {
                self.engine_tick[e] = Some(t);
                let delay = t.saturating_sub(self.now);
                self.at(delay, Ev::EngineTick { engine: e });
            }
        }
    }

    fn pworker_index(&self, rank: RankId) -> usize {
        self.d.rank_index(rank)
    }

    fn engine_actions(&mut self, e: usize, actions: Vec<EngineAction>) {
        for action in actions {
            match action {
                EngineAction::Register { rank, transfer_id, quorum } => {
                    let delay = ms_ns(self.sc.engines.prefill_register_delay_ms);
                    let event = WorkerEvent::Register { transfer_id, quorum };
                    if delay == 0 {
                        self.prefill_worker(rank, event);
                    } else {
                        self.at(delay, Ev::ToPrefill { rank, event: Box::new(event) });
                    }
                }
                EngineAction::GroupDone { rank, transfer_id } => {
                    self.prefill_worker(rank, WorkerEvent::GroupDone { transfer_id })
                }
                EngineAction::Retire { rank, transfer_id } => {
                    self.prefill_worker(rank, WorkerEvent::Retired { transfer_id })
                }
                EngineAction::FinishedSending { request, .. } => {
                    trace!(self, "prefill", "finished_sending", format!("P{e}"), None, format!("{request}"));
                }
                EngineAction::Fence { transfer_id, .. } => {
                    if let Some(&t) = self.transfer_index.get(&transfer_id) {
                        self.fenced.insert(t);
                    }
                }
                EngineAction::FreeBlocks { transfer_id, owner_dp, blocks, reaped } => {
                    let g = self.pgroup_base[e] + usize::from(owner_dp);
                    let t = self.transfer_index.get(&transfer_id).copied().unwrap_or(FREE - 1);
                    let bad = self.pgroups[g].pool.release(&blocks, t);
                    if !bad.is_empty() {
                        let detail = format!("{transfer_id}: blocks {} were not held by it", list(&bad));
                        self.violation(ViolationKind::DoubleFree, vec![format!("P{e}.dp{owner_dp}")], detail);
                    }
                    let name = if reaped { "reap" } else { "free" };
                    trace!(
                        self,
                        "prefill",
                        name,
                        format!("P{e}.dp{owner_dp}"),
                        None,
                        format!("{transfer_id} blocks={}", blocks.len()),
                    );
                    self.try_prefill(g);
                }
                EngineAction::ReapWarning { transfer_id, held_ns, unfinished_tp } => {
                    self.max_hold_ns = self.max_hold_ns.max(held_ns);
                    if self.transfer_index.get(&transfer_id).is_some_and(|t| self.excused.contains(t)) {
                        self.reaped_excused += 1;
                    }
                    let detail = format!(
                        "{transfer_id} held {} ms; unreleased TP ranks {}",
                        ms(held_ns),
                        list(&unfinished_tp)
                    );
                    trace!(self, "prefill", "reap_warning", format!("P{e}"), None, detail);
                }
            }
        }
    }

    fn prefill_worker(&mut self, rank: RankId, event: WorkerEvent) {
        let i = self.pworker_index(rank);
        let mut out = Vec::new();
        self.pworkers[i].handle(Instant(self.now), event, &mut out);
        self.worker_actions(i, out);
    }

    fn worker_actions(&mut self, i: usize, actions: Vec<WorkerAction>) {
        for action in actions {
            match action {
                WorkerAction::Finished { rank, transfer_id } => {
                    let e = usize::from(rank.engine.index);
                    self.engine(e, EngineEvent::WorkerFinished { rank, transfer_id });
                }
                WorkerAction::Leased { rank, transfer_id, until } => {
                    let e = usize::from(rank.engine.index);
                    self.engine(e, EngineEvent::Leased { transfer_id, until });
                }
                WorkerAction::Ignored { transfer_id, outcome } => {
                    let rank = self.p_ranks[i].to_string();
                    let why = release_outcome_words(&outcome);
                    trace!(self, "release", "ignored", rank, None, format!("{transfer_id}: {why}"));
                }
                WorkerAction::Error { rank, error } => {
                    self.violation(
                        ViolationKind::ProtocolError,
                        vec![self.p_ranks[i].to_string()],
                        format!("{rank}: {error}"),
                    );
                }
                WorkerAction::SendHandshakeReply { .. } => {
                    // Replies are sent by the listener that carried the request (on_serve).
                }
            }
        }
    }

    // ---------------------------------------------------------------- decode

    fn wake(&mut self, unit: usize) {
        if self.decode_down[self.units[unit].engine] {
            return;
        }
        let u = &mut self.units[unit];
        if u.state == UnitState::Idle && !u.wake_scheduled {
            u.wake_scheduled = true;
            self.at(0, Ev::StepBegin { unit });
        }
    }

    fn on_step_begin(&mut self, unit: usize) {
        self.units[unit].wake_scheduled = false;
        if self.units[unit].state != UnitState::Idle || self.decode_down[self.units[unit].engine] {
            return;
        }
        self.units[unit].step += 1;
        let step = self.units[unit].step;
        let max_batch = self.sc.engines.decode_max_batch as usize;
        let block = self.sc.model.block_size_tokens;
        self.units[unit].state = UnitState::Waiting { began: self.now };
        for gi in 0..self.units[unit].groups.len() {
            let g = self.units[unit].groups[gi];
            // Requests whose KV arrived join the batch at this step boundary.
            let group = &mut self.dgroups[g];
            let room = max_batch.saturating_sub(group.running.len());
            for id in group.ready.drain(..group.ready.len().min(room)) {
                let r = &self.requests[&id];
                group.context_tokens += u64::from(r.input);
                group.running.push(Running { id, left: r.output, context: u64::from(r.input), first: true });
            }
            // Admit waiting requests while blocks and batch room last.
            let mut new = Vec::new();
            while let Some(recv) = group.waiting.front() {
                let req = &self.requests[&recv.request];
                let remote = recv.params.remote_block_ids.len();
                let extra = req.output.div_ceil(block) as usize;
                let busy = group.running.len() + group.ready.len() + group.pending.len();
                if busy >= max_batch || group.pool.available() < remote + extra {
                    break;
                }
                let mut recv = group.waiting.pop_front().expect("front exists");
                group.told = group.told.saturating_sub(1);
                let transfer = req.transfer;
                let local = group.pool.alloc(remote, transfer);
                let growth = group.pool.alloc(extra, transfer);
                recv.local_block_ids = local.clone();
                let r = self.requests.get_mut(&recv.request).expect("exists");
                r.decode_blocks = local.into_iter().chain(growth).collect();
                group.pending.insert(recv.request, Pending { reported: 0, received: 0, failed: false });
                new.push(recv);
            }
            // The group's barrier admits the step before any worker hears of it (a worker with
            // nothing to dial votes at once).
            self.group_event(g, GroupEvent::StepBegin { step });
            for i in 0..self.dgroups[g].workers.len() {
                let w = self.dgroups[g].workers[i];
                self.decode(w, DecodeEvent::StepBegin { step, requests: new.clone() });
            }
            // Requests that stay queued behind a full batch or pool: the workers lease them
            // until they are admitted, so their prefill blocks are not reaped meanwhile.
            let group = &mut self.dgroups[g];
            if group.told < group.waiting.len() {
                let queued: Vec<RecvRequest> = group.waiting.iter().skip(group.told).cloned().collect();
                group.told = group.waiting.len();
                for i in 0..self.dgroups[g].workers.len() {
                    let w = self.dgroups[g].workers[i];
                    self.decode(w, DecodeEvent::Queued { requests: queued.clone() });
                }
            }
        }
        if !self.units[unit].watchdog {
            self.units[unit].watchdog = true;
            let timeout = ms_ns(self.sc.protocol.collective_timeout_ms);
            self.at(timeout, Ev::CollectiveTimeout { unit, step });
        }
        self.maybe_compute(unit);
    }

    /// Feeds decode group `g`'s barrier and carries out what it decides: vote results reach
    /// the members one control latency later, and a group whose members all entered the
    /// forward may let its unit compute.
    fn group_event(&mut self, g: usize, event: GroupEvent) {
        let mut out = Vec::new();
        self.dgroups[g].barrier.handle(event, &mut out);
        let mut results = Vec::new();
        for action in out {
            match action {
                GroupAction::VoteResult { member, step, ok } => results.push((member, step, ok)),
                GroupAction::Forward { .. } => self.maybe_compute(self.dgroups[g].unit),
                GroupAction::Ignored(why) => {
                    let engine = self.dgroups[g].engine;
                    self.violation(
                        ViolationKind::ProtocolError,
                        vec![format!("D{engine}")],
                        format!("group {g}: {why}"),
                    );
                }
            }
        }
        if !results.is_empty() {
            let latency = self.control_ns();
            self.at(latency, Ev::VoteResults { group: g, results });
        }
    }

    /// Computes the unit's step once every member of each of its groups entered the forward.
    fn maybe_compute(&mut self, unit: usize) {
        let UnitState::Waiting { began } = self.units[unit].state else { return };
        let step = self.units[unit].step;
        if !self.units[unit].groups.iter().all(|&g| self.dgroups[g].barrier.forward_ready(step)) {
            return;
        }
        let layout = self.d.decode[self.units[unit].engine];
        let loads: Vec<GroupLoad> = self.units[unit]
            .groups
            .iter()
            .map(|&g| GroupLoad {
                batch: self.dgroups[g].running.len() as u64,
                context_tokens: self.dgroups[g].context_tokens,
            })
            .collect();
        let duration = self.cost.decode_step_ns(layout, &loads);
        self.units[unit].state = UnitState::Computing;
        if self.trace_on {
            let batch: u64 = loads.iter().map(|l| l.batch).sum();
            let waited = self.now - began;
            let name = format!("D{}.u{unit}", self.units[unit].engine);
            trace!(
                self,
                "decode",
                "step",
                name,
                Some(duration),
                format!("step={step} batch={batch} waited_ms={}", ms(waited)),
            );
        }
        self.at(duration, Ev::StepEnd { unit, step });
    }

    fn on_step_end(&mut self, unit: usize, step: u64) {
        if self.units[unit].step != step || self.units[unit].state != UnitState::Computing {
            return;
        }
        let now = self.now;
        let mut finished = Vec::new();
        let mut firsts = Vec::new();
        let mut continuing = 0u64;
        for gi in 0..self.units[unit].groups.len() {
            let g = self.units[unit].groups[gi];
            let group = &mut self.dgroups[g];
            let mut context_done = 0u64;
            // Every request of the batch grows by one token; finished ones leave with theirs.
            group.context_tokens += group.running.len() as u64;
            group.running.retain_mut(|r| {
                r.left -= 1;
                r.context += 1;
                if r.first {
                    r.first = false;
                    firsts.push(r.id);
                } else {
                    continuing += 1;
                }
                if r.left == 0 {
                    finished.push((g, r.id));
                    context_done += r.context;
                    return false;
                }
                true
            });
            group.context_tokens -= context_done;
        }
        for id in firsts {
            if let Some(r) = self.requests.get_mut(&id) {
                r.first_token_ns = Some(now);
            }
        }
        // Inter-token latency: every request that already had a token waited one step gap.
        if let Some(last) = self.units[unit].last_step_end.replace(now) {
            if continuing > 0 {
                self.itl.push((now - last, continuing));
            }
        }
        for (g, id) in finished {
            let req = &self.requests[&id];
            let (blocks, transfer) = (req.decode_blocks.clone(), req.transfer);
            self.free_decode_blocks(g, &blocks, transfer);
            self.end_request(id, false);
        }
        self.units[unit].state = UnitState::Idle;
        if self.unit_has_work(unit) {
            self.wake(unit);
        } else if self.unit_has_pending(unit) {
            self.units[unit].wake_scheduled = true;
            self.at(IDLE_STEP_NS, Ev::StepBegin { unit });
        }
    }

    /// Returns a request's decode blocks to its group's pool; freeing blocks it does not hold
    /// is a double free.
    fn free_decode_blocks(&mut self, g: usize, blocks: &[u32], transfer: u32) {
        let bad = self.dgroups[g].pool.release(blocks, transfer);
        if !bad.is_empty() {
            let engine = self.dgroups[g].engine;
            self.violation(
                ViolationKind::DoubleFree,
                vec![format!("D{engine}")],
                format!("decode blocks {} freed twice", list(&bad)),
            );
        }
    }

    fn unit_has_work(&self, unit: usize) -> bool {
        self.units[unit].groups.iter().any(|&g| {
            let group = &self.dgroups[g];
            !group.running.is_empty() || !group.ready.is_empty() || !group.waiting.is_empty()
        })
    }

    fn unit_has_pending(&self, unit: usize) -> bool {
        self.units[unit]
            .groups
            .iter()
            .any(|&g| self.dgroups[g].workers.iter().any(|&w| self.dworkers[w].pending_requests() > 0))
    }

    fn decode(&mut self, w: usize, event: DecodeEvent) {
        // Action buffers are reused: a decode step hands every worker an event, and a fresh
        // vector per call was a measurable share of the simulator's time.
        let mut out = self.buffers.pop().unwrap_or_default();
        self.dworkers[w].handle(Instant(self.now), event, &mut out);
        self.decode_actions(w, &mut out);
        self.buffers.push(out);
        if let Some(Instant(t)) = self.dworkers[w].poll_timeout() {
            if self.dworker_tick[w].is_none_or(|s| t < s || s < self.now) {
                self.dworker_tick[w] = Some(t);
                let delay = t.saturating_sub(self.now);
                self.at(delay, Ev::DecodeTick { worker: w });
            }
        }
    }

    fn decode_actions(&mut self, w: usize, buffer: &mut Vec<DecodeAction>) {
        let actions = buffer.drain(..);
        let mut reads: Vec<ReadOp> = Vec::new();
        for action in actions {
            if !matches!(action, DecodeAction::PostRead(_)) && !reads.is_empty() {
                self.post_reads(w, std::mem::take(&mut reads));
            }
            match action {
                DecodeAction::PostRead(op) => {
                    if reads.last().is_some_and(|last| last.request() != op.request()) {
                        self.post_reads(w, std::mem::take(&mut reads));
                    }
                    reads.push(op);
                }
                DecodeAction::DialHandshake { session, rank, endpoint } => {
                    trace!(
                        self,
                        "handshake",
                        "dial",
                        self.d_ranks[w].to_string(),
                        None,
                        format!("{rank} at {endpoint}"),
                    );
                    self.send(w, rank, (endpoint.host, endpoint.port), Msg::Dial { from: w, session });
                }
                DecodeAction::SendLease { rank, endpoint, lease } => {
                    let transfer = self.transfer_index.get(&lease.transfer_id).copied();
                    let bytes = wire::encode(&ControlMessage::ReadLease(lease));
                    self.send(w, rank, (endpoint.host, endpoint.port), Msg::Notify { bytes, transfer });
                }
                DecodeAction::SendRelease { rank, endpoint, release } => {
                    let transfer = self.transfer_index.get(&release.transfer_id).copied();
                    let bytes = wire::encode(&ControlMessage::Release(release));
                    self.send(w, rank, (endpoint.host, endpoint.port), Msg::Notify { bytes, transfer });
                }
                DecodeAction::CastVote { step, ok } => {
                    let member = self.d_ranks[w].tp_rank();
                    self.group_event(self.dworker_group[w], GroupEvent::Vote { member, step, ok });
                }
                DecodeAction::StepReady { step } => {
                    let (member, report) = (self.d_ranks[w].tp_rank(), StepReport::Ready);
                    self.group_event(self.dworker_group[w], GroupEvent::StepReport { member, step, report });
                }
                DecodeAction::StepFailed { step, error } => {
                    trace!(
                        self,
                        "decode",
                        "step_failed",
                        self.d_ranks[w].to_string(),
                        None,
                        error.to_string(),
                    );
                    // The group's barrier knows what the failure means: a failure the whole group
                    // shares (eager vote) skips the forward together; a worker-local one (lazy
                    // handshake) raises on that worker alone, which never reaches the collective.
                    let (member, report) = (self.d_ranks[w].tp_rank(), StepReport::failed(&error));
                    self.group_event(self.dworker_group[w], GroupEvent::StepReport { member, step, report });
                }
                DecodeAction::RequestReceived { request } => self.report(w, request, false),
                DecodeAction::RequestFailed { request, error } => {
                    trace!(
                        self,
                        "decode",
                        "request_failed",
                        self.d_ranks[w].to_string(),
                        None,
                        format!("{request}: {error}"),
                    );
                    self.report(w, request, true);
                }
                DecodeAction::InvalidateBlocks { .. } => {}
                DecodeAction::AbortReads { request } => self.abort_reads(w, request),
            }
        }
        if !reads.is_empty() {
            self.post_reads(w, reads);
        }
    }

    /// The worker aborts a request's posted reads, as a verbs driver does by moving the queue
    /// pair to the error state: the NIC stops the flows at once and, one NIC latency later,
    /// answers each read aborted (its flushed completion). Reads not on the NIC yet (refused
    /// with a full send queue, or failing at posting) are answered by their own pending events.
    fn abort_reads(&mut self, w: usize, request: RequestId) {
        let ids: Vec<FlowId> = self
            .flows
            .iter()
            .filter(|(_, info)| info.worker == w && info.ops.iter().any(|(r, _)| *r == request))
            .map(|(id, _)| *id)
            .collect();
        let latency = (self.sc.hardware.nic_latency_us * 1e3) as u64;
        for id in ids {
            if let Some((_, finishes)) = self.nics.abort(self.now, id) {
                self.schedule_flows(finishes);
            }
            let Some(info) = self.flows.remove(&id) else { continue };
            trace!(
                self,
                "nic",
                "read_aborted",
                self.p_ranks[info.server].to_string(),
                Some(self.now - info.started),
                format!("to {} layers={}", self.d_ranks[w], info.ops.len()),
            );
            for (request, layer) in info.ops {
                let outcome = Box::new(ReadOutcome::Aborted);
                self.at(latency, Ev::ReadLater { worker: w, request, layer, outcome });
            }
        }
    }

    /// One worker finished (or failed) receiving `request`; once every worker of the group has,
    /// the request joins the batch or ends failed.
    fn report(&mut self, w: usize, request: RequestId, failed: bool) {
        let g = self.dworker_group[w];
        let width = self.dgroups[g].workers.len() as u16;
        let Some(p) = self.dgroups[g].pending.get_mut(&request) else { return };
        p.reported += 1;
        p.failed |= failed;
        p.received += u16::from(!failed);
        if p.reported < width {
            return;
        }
        let failed = p.failed;
        self.dgroups[g].pending.remove(&request);
        if failed {
            let req = &self.requests[&request];
            let (blocks, transfer) = (req.decode_blocks.clone(), req.transfer);
            self.free_decode_blocks(g, &blocks, transfer);
            self.end_request(request, true);
        } else {
            self.dgroups[g].ready.push(request);
            self.wake(self.dgroups[g].unit);
        }
    }

    // ---------------------------------------------------------------- control messages

    /// Sends a control message from decode worker `w` about prefill rank `peer` to `to`.
    fn send(&mut self, w: usize, peer: RankId, to: (String, u16), msg: Msg) {
        let Some(&listener) = self.listener_at.get(&to) else {
            let detail = format!(
                "{} sent {} to {}:{}, where no listener is bound",
                self.d_ranks[w],
                msg_name(&msg),
                to.0,
                to.1
            );
            self.violation(
                ViolationKind::PortWithoutListener,
                vec![self.d_ranks[w].to_string(), peer.to_string()],
                detail,
            );
            if let Msg::Dial { session, .. } = msg {
                let event = DecodeEvent::HandshakeFailed { session, reason: "connection refused".into() };
                let latency = self.control_ns();
                self.at(latency, Ev::ToDecode { worker: w, event: Box::new(event) });
            }
            return;
        };
        let owner = self.listeners[listener].rank;
        if self.prefill_down[usize::from(owner.engine.index)] {
            // The port is known but its engine is down: the connection is refused, which is a
            // failure the protocol must handle, not an arithmetic bug.
            trace!(self, "fault", "refused", self.d_ranks[w].to_string(), None, format!("{owner} is down"));
            self.touch(self.d_ranks[w], self.now, self.now);
            if let Msg::Dial { session, .. } = msg {
                let event = DecodeEvent::HandshakeFailed {
                    session,
                    reason: "connection refused (engine down)".into(),
                };
                let latency = self.control_ns();
                self.at(latency, Ev::ToDecode { worker: w, event: Box::new(event) });
            }
            return;
        }
        let ranks = [self.d_ranks[w], owner];
        let Some(delays) = self.fate(&ranks) else {
            trace!(self, "fault", "lost", self.d_ranks[w].to_string(), None, msg_name(&msg).to_string());
            // A lost release or lease leaves its transfer to the reaper, the designed recovery.
            if let Msg::Notify { transfer: Some(t), .. } = msg {
                self.excused.insert(t);
            }
            return;
        };
        // A release or lease that a fault delays past the reaper's delay arrives after the
        // reaper could have fired: for the ledger that is a lost message, and reaping the
        // design's recovery.
        if let (Msg::Notify { transfer: Some(t), .. }, Some(&first)) = (&msg, delays.first()) {
            if first >= ms_ns(self.sc.protocol.defer_timeout_ms) {
                self.excused.insert(*t);
            }
        }
        let latency = self.control_ns();
        let mut copies = delays.into_iter();
        let first = copies.next().unwrap_or(0);
        for extra in copies {
            self.at(latency.saturating_add(extra), Ev::AtListener { listener, msg: Box::new(msg.clone()) });
        }
        self.at(latency.saturating_add(first), Ev::AtListener { listener, msg: Box::new(msg) });
    }

    /// What faults do to one message between `ranks`: `None` if it is lost, else the extra
    /// delay of each copy that arrives (two copies when duplicated).
    fn fate(&mut self, ranks: &[RankId]) -> Option<Vec<u64>> {
        let fate = self.draw_fate(ranks);
        if fate.as_ref().is_none_or(|copies| copies.len() > 1 || copies[0] > 0) {
            for &rank in ranks {
                self.touch(rank, self.now, self.now);
            }
        }
        fate
    }

    /// [`World::fate`] without the record of which ranks a fault touched.
    fn draw_fate(&mut self, ranks: &[RankId]) -> Option<Vec<u64>> {
        let mut delay = 0u64;
        let mut copies = 1;
        for slot in self.faults.iter_mut() {
            let Some(fault) = slot else { continue };
            if !ranks.iter().any(|r| fault.pattern.matches(*r)) {
                continue;
            }
            let applies = matches!(
                fault.kind,
                FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages
            );
            if !applies || fault.remaining == Some(0) {
                continue;
            }
            if let Some(n) = &mut fault.remaining {
                *n -= 1;
            }
            match fault.kind {
                FaultKind::LoseMessages => return None,
                FaultKind::DelayMessages { delay_ms } => delay = delay.saturating_add(ms_ns(delay_ms)),
                FaultKind::DuplicateMessages => copies = 2,
                _ => {}
            }
        }
        let swarm = &self.sc.faults.swarm;
        if swarm.loss > 0.0 && self.streams.chance(swarm.loss) {
            return None;
        }
        if swarm.delay > 0.0 && self.streams.chance(swarm.delay) {
            delay = delay.saturating_add(self.streams.below(ms_ns(swarm.max_delay_ms.max(1))));
        }
        if swarm.duplicate > 0.0 && self.streams.chance(swarm.duplicate) {
            copies = 2;
        }
        Some(vec![delay; copies])
    }

    fn listener_service_ns(&self, listener: usize) -> Option<u64> {
        let l = &self.listeners[listener];
        let mut service = us_ns(self.sc.hardware.listener_service_us);
        for fault in self.faults.iter().flatten() {
            if l.kind != ListenerKind::Handshake || !fault.pattern.matches(l.rank) {
                continue;
            }
            match fault.kind {
                FaultKind::DeadListener => return None,
                FaultKind::SlowListener { service_ms } => service = service.max(ms_ns(service_ms)),
                _ => {}
            }
        }
        Some(service)
    }

    fn on_at_listener(&mut self, listener: usize, msg: Msg) {
        let service = self.listener_service_ns(listener);
        // A dead or slow listener holds up the dialling decode rank's whole step (its group vote
        // waits for every dial), so the fault touches the dialler too.
        if service.is_none_or(|ns| ns > us_ns(self.sc.hardware.listener_service_us)) {
            if let Msg::Dial { from, .. } = msg {
                self.touch(self.d_ranks[from], self.now, self.now);
            }
        }
        let Some(service) = service else {
            let rank = self.listeners[listener].rank.to_string();
            trace!(self, "fault", "dead_listener", rank, None, msg_name(&msg).to_string());
            return;
        };
        let l = &mut self.listeners[listener];
        let start = l.busy_until.max(self.now);
        l.busy_until = start.saturating_add(service);
        let delay = l.busy_until - self.now;
        self.at(delay, Ev::Serve { listener, msg: Box::new(msg) });
    }

    fn on_serve(&mut self, listener: usize, msg: Msg) {
        let rank = self.listeners[listener].rank;
        if self.prefill_down[usize::from(rank.engine.index)] {
            // Dropped by a crashed engine: the crash touches the dialler's step as well.
            if let Msg::Dial { from, .. } = msg {
                self.touch(self.d_ranks[from], self.now, self.now);
            }
            return;
        }
        let i = self.pworker_index(rank);
        match msg {
            Msg::Dial { from, session } => {
                let mut out = Vec::new();
                self.pworkers[i].handle(
                    Instant(self.now),
                    WorkerEvent::HandshakeRequest { peer: from as u64 },
                    &mut out,
                );
                for action in out {
                    if let WorkerAction::SendHandshakeReply { metadata, layers, .. } = action {
                        let Some(delays) = self.fate(&[self.d_ranks[from], rank]) else { continue };
                        let latency = self.control_ns().saturating_add(delays[0]);
                        let meta = DecodeEvent::HandshakeMetadata { session: session.clone(), metadata };
                        self.at(latency, Ev::ToDecode { worker: from, event: Box::new(meta) });
                        let desc = DecodeEvent::HandshakeDescriptors { session: session.clone(), layers };
                        self.at(latency, Ev::ToDecode { worker: from, event: Box::new(desc) });
                    }
                }
            }
            Msg::Notify { bytes, .. } => match wire::decode(&bytes) {
                Ok(ControlMessage::ReadLease(lease)) => {
                    let event =
                        WorkerEvent::Lease { transfer_id: lease.transfer_id, lease_ms: lease.lease_ms };
                    self.prefill_worker(rank, event);
                }
                Ok(message) => match message.as_release() {
                    Some(release) => self.prefill_worker(rank, WorkerEvent::Release(release)),
                    None => self.violation(
                        ViolationKind::ProtocolError,
                        vec![rank.to_string()],
                        "unexpected notify message".into(),
                    ),
                },
                Err(error) => {
                    self.violation(
                        ViolationKind::ProtocolError,
                        vec![rank.to_string()],
                        format!("undecodable notify frame: {error}"),
                    );
                }
            },
        }
    }

    // ---------------------------------------------------------------- reads and NICs

    fn nic_down(&self, rank: RankId) -> bool {
        let crashed = match rank.engine.role {
            Role::Prefill => self.prefill_down[usize::from(rank.engine.index)],
            Role::Decode => self.decode_down[usize::from(rank.engine.index)],
        };
        crashed
            || self
                .faults
                .iter()
                .flatten()
                .any(|f| matches!(f.kind, FaultKind::NicDown) && f.pattern.matches(rank))
    }

    fn send_queue_full(&mut self, rank: RankId) -> bool {
        let timeline = self
            .faults
            .iter()
            .flatten()
            .any(|f| matches!(f.kind, FaultKind::SendQueueFull) && f.pattern.matches(rank));
        let p = self.sc.faults.swarm.send_queue_full;
        let full = timeline || (p > 0.0 && self.streams.chance(p));
        if full {
            self.touch(rank, self.now, self.now);
        }
        full
    }

    /// Index of `rank` in NIC order (prefill ranks, then decode ranks).
    fn rank_slot(&self, rank: RankId) -> usize {
        match rank.engine.role {
            Role::Prefill => self.d.rank_index(rank),
            Role::Decode => self.p_ranks.len() + self.d.rank_index(rank),
        }
    }

    /// A fault touched `rank` from `from` to `to`: requests on it that fail up to `grace_ns`
    /// later are excused. Touches come in time order, so an overlapping one extends the last
    /// interval and the list stays short.
    fn touch(&mut self, rank: RankId, from: u64, to: u64) {
        let to = to.saturating_add(self.grace_ns);
        let slot = self.rank_slot(rank);
        let intervals = &mut self.touched[slot];
        match intervals.last_mut() {
            Some(last) if last.1 >= from => last.1 = last.1.max(to),
            _ => intervals.push((from, to)),
        }
    }

    /// True when a fault touched one of `ranks` (NIC-order slots) during `[from, to]`.
    fn touched_during(&self, slots: &[usize], from: u64, to: u64) -> bool {
        slots.iter().any(|&slot| self.touched[slot].iter().any(|&(a, b)| a <= to && b >= from))
    }

    /// Posts the reads of one request from worker `w` as one flow (per-layer reads posted
    /// together move together), after the safety checks on their addresses and blocks.
    fn post_reads(&mut self, w: usize, ops: Vec<ReadOp>) {
        let first = &ops[0];
        let request = first.request();
        let me = self.d_ranks[w];
        if self.send_queue_full(me) {
            for op in &ops {
                let ev = Ev::ReadLater {
                    worker: w,
                    request,
                    layer: op.layer,
                    outcome: Box::new(ReadOutcome::SendQueueFull),
                };
                self.at(1_000, ev);
            }
            return;
        }
        // Which rank's memory do the addresses point into?
        let address = first.first_address();
        let owner = |regions: &BTreeMap<u64, (usize, u64)>| {
            regions
                .range(..=address)
                .next_back()
                .and_then(|(&base, &(rank, len))| (address < base + len).then_some(rank))
        };
        let server = owner(&self.regions);
        if server.is_none() && owner(&self.retired_regions).is_some() {
            // Memory of a crashed incarnation: its keys died with it, so the NIC refuses the read.
            self.fail_reads(w, &ops, "remote access error (memory of a restarted rank)");
            return;
        }
        let Some(server) = server else {
            self.violation(
                ViolationKind::ReadForeignRegion,
                vec![me.to_string()],
                format!("{request}: address outside every registered region"),
            );
            self.fail_reads(w, &ops, "remote access error");
            return;
        };
        let server_rank = self.p_ranks[server];
        // A down NIC (or crashed engine) fails the read before it touches any memory.
        if self.nic_down(server_rank) || self.nic_down(me) {
            self.fail_reads(w, &ops, "NIC down");
            return;
        }
        if server_rank != first.plan.source {
            let detail =
                format!("{request}: read meant for {} reads the memory of {server_rank}", first.plan.source);
            self.violation(
                ViolationKind::ReadForeignRegion,
                vec![me.to_string(), server_rank.to_string()],
                detail,
            );
        }
        let transfer = self.transfer_index.get(&first.plan.transfer_id).copied().unwrap_or(FREE - 1);
        if self.fenced.contains(&transfer) {
            // The reaper revoked remote access: the read fails at the NIC, touching nothing.
            self.fail_reads(w, &ops, "remote access revoked (fenced)");
            return;
        }
        self.check_blocks(me, server, transfer, &first.plan.remote_block_ids, "posted");
        let nic_src = server;
        let nic_dst = self.p_ranks.len() + w;
        let bytes: u64 = ops.iter().map(ReadOp::bytes).sum();
        self.reads[server] += 1;
        self.bytes[server] += bytes;
        let latency = (self.sc.hardware.nic_latency_us * 1e3) as u64;
        let (id, finishes) = self.nics.start(self.now + latency, nic_src, nic_dst, bytes);
        self.schedule_flows(finishes);
        let info = FlowInfo {
            worker: w,
            ops: ops.iter().map(|op| (op.request(), op.layer)).collect(),
            transfer,
            server,
            blocks: first.plan.remote_block_ids.clone(),
            started: self.now,
        };
        self.flows.insert(id, info);
    }

    /// A read touches blocks that are not its transfer's: freed, or another request's.
    fn check_blocks(&mut self, me: RankId, server: usize, transfer: u32, blocks: &[u32], when: &str) {
        let rank = self.p_ranks[server];
        let g = self.pgroup_base[usize::from(rank.engine.index)] + usize::from(rank.dp);
        let pool = &self.pgroups[g].pool;
        let wrong: Vec<u32> = blocks.iter().copied().filter(|&b| pool.owner_of(b) != transfer).collect();
        if wrong.is_empty() {
            return;
        }
        let freed = wrong.iter().all(|&b| pool.owner_of(b) == FREE && b < pool.capacity);
        let what = if freed { "freed" } else { "another request's (or unallocated)" };
        let name = self.transfers.get(transfer as usize).map_or("?".to_string(), |t| t.0.clone());
        let shown: Vec<u32> = wrong.iter().copied().take(4).collect();
        let more = if wrong.len() > shown.len() {
            format!(" and {} more", wrong.len() - shown.len())
        } else {
            String::new()
        };
        let detail = format!("read of {name} {when}: blocks {}{more} on {rank} are {what}", list(&shown));
        self.violation(ViolationKind::ReadFreedBlock, vec![me.to_string(), rank.to_string()], detail);
    }

    fn fail_reads(&mut self, w: usize, ops: &[ReadOp], reason: &str) {
        let latency = (self.sc.hardware.nic_latency_us * 1e3) as u64;
        for op in ops {
            let outcome = ReadOutcome::Failed(reason.to_string());
            self.at(
                latency,
                Ev::ReadLater {
                    worker: w,
                    request: op.request(),
                    layer: op.layer,
                    outcome: Box::new(outcome),
                },
            );
        }
    }

    fn schedule_flows(&mut self, finishes: Vec<Finish>) {
        for f in finishes {
            let delay = f.at_ns.saturating_sub(self.now);
            self.at(delay, Ev::Flow { id: f.id, version: f.version });
        }
    }

    fn on_flow(&mut self, id: FlowId, version: u64) {
        let Some((_, finishes)) = self.nics.finish(self.now, id, version) else { return };
        self.schedule_flows(finishes);
        let Some(info) = self.flows.remove(&id) else { return };
        let me = self.d_ranks[info.worker];
        let server_rank = self.p_ranks[info.server];
        trace!(
            self,
            "nic",
            "read",
            format!("{server_rank}"),
            Some(self.now - info.started),
            format!("to {me} layers={}", info.ops.len()),
        );
        let outcome = if self.fenced.contains(&info.transfer) {
            ReadOutcome::Failed("remote access revoked (fenced)".into())
        } else {
            self.check_blocks(me, info.server, info.transfer, &info.blocks, "completed");
            ReadOutcome::Ok
        };
        for (request, layer) in info.ops {
            self.decode(info.worker, DecodeEvent::ReadDone { request, layer, outcome: outcome.clone() });
        }
    }

    // ---------------------------------------------------------------- faults

    fn on_fault(&mut self, index: usize, start: bool) {
        let spec = self.sc.faults.timeline[index].clone();
        let Some(pattern) = parse_target(&spec.target.0) else { return };
        trace!(
            self,
            "fault",
            if start { "start" } else { "end" },
            spec.target.0.clone(),
            None,
            spec.fault.to_string(),
        );
        if start {
            self.touch_window(index, pattern);
        }
        // The fault is in force (or over) before its effects are applied, so recomputed state
        // (a NIC's combined slow-down) sees it.
        self.faults[index] =
            start.then_some(ActiveFault { pattern, kind: spec.fault.clone(), remaining: spec.count });
        let nics: Vec<usize> = self
            .p_ranks
            .iter()
            .chain(self.d_ranks.iter())
            .enumerate()
            .filter(|(_, r)| pattern.matches(**r))
            .map(|(i, _)| i)
            .collect();
        match (&spec.fault, start) {
            (FaultKind::SlowNic { .. }, _) => {
                // Overlapping slow-NIC faults multiply; the end of one leaves the others.
                let ranks: Vec<RankId> = self.p_ranks.iter().chain(self.d_ranks.iter()).copied().collect();
                for nic in nics {
                    let factor: f64 = self
                        .faults
                        .iter()
                        .flatten()
                        .filter_map(|f| match f.kind {
                            FaultKind::SlowNic { factor } if f.pattern.matches(ranks[nic]) => Some(factor),
                            _ => None,
                        })
                        .product();
                    let finishes = self.nics.set_factor(self.now, nic, factor);
                    self.schedule_flows(finishes);
                }
            }
            (FaultKind::NicDown, true) => {
                for nic in nics {
                    self.abort_flows_on(nic, "NIC down");
                }
            }
            (FaultKind::EngineCrash, _) => {
                let mut engines: BTreeSet<EngineId> = BTreeSet::new();
                for rank in self.p_ranks.iter().chain(self.d_ranks.iter()) {
                    if pattern.matches(*rank) {
                        engines.insert(rank.engine);
                    }
                }
                for engine in engines {
                    if start {
                        self.crash(engine);
                    } else {
                        self.restart(engine);
                    }
                }
            }
            _ => {}
        }
    }

    /// Records the ranks a starting timeline fault touches, for its whole window. Message faults
    /// are recorded per message they change instead (in `fate`), since `count` may exhaust them
    /// early. An engine crash touches every rank of each engine it takes down, to the end of the
    /// run: sessions opened to the old incarnation fail at their first use, whenever that is.
    fn touch_window(&mut self, index: usize, pattern: TargetPattern) {
        let spec = &self.sc.faults.timeline[index];
        let end = spec.duration_ms.map_or(u64::MAX, |d| self.now.saturating_add(ms_ns(d)));
        let ranks: Vec<RankId> = self.p_ranks.iter().chain(self.d_ranks.iter()).copied().collect();
        match spec.fault {
            FaultKind::LoseMessages | FaultKind::DelayMessages { .. } | FaultKind::DuplicateMessages => {}
            FaultKind::EngineCrash => {
                let engines: BTreeSet<EngineId> =
                    ranks.iter().filter(|r| pattern.matches(**r)).map(|r| r.engine).collect();
                for rank in ranks.into_iter().filter(|r| engines.contains(&r.engine)) {
                    self.touch(rank, self.now, u64::MAX);
                }
            }
            FaultKind::DeadListener
            | FaultKind::SlowListener { .. }
            | FaultKind::SlowNic { .. }
            | FaultKind::NicDown
            | FaultKind::SendQueueFull => {
                for rank in ranks.into_iter().filter(|r| pattern.matches(*r)) {
                    self.touch(rank, self.now, end);
                }
            }
        }
    }

    /// Ends every flow touching `nic`; the reading workers get a failed read.
    fn abort_flows_on(&mut self, nic: usize, reason: &str) {
        for id in self.nics.flows_on(nic) {
            if let Some((_, finishes)) = self.nics.abort(self.now, id) {
                self.schedule_flows(finishes);
            }
            if let Some(info) = self.flows.remove(&id) {
                for (request, layer) in info.ops {
                    let outcome = ReadOutcome::Failed(reason.to_string());
                    self.decode(info.worker, DecodeEvent::ReadDone { request, layer, outcome });
                }
            }
        }
    }

    /// An engine crashes: its NICs and listeners go down, and everything in its memory is lost.
    fn crash(&mut self, engine: EngineId) {
        let e = usize::from(engine.index);
        trace!(self, "fault", "crash", engine.to_string(), None, String::new());
        match engine.role {
            Role::Prefill => {
                if self.prefill_down[e] {
                    return;
                }
                self.prefill_down[e] = true;
                let ranks: Vec<usize> =
                    (0..self.p_ranks.len()).filter(|&i| self.p_ranks[i].engine == engine).collect();
                for &i in &ranks {
                    self.abort_flows_on(i, "peer down");
                }
                // Its queued and prefilling requests die with it; its held blocks are gone.
                let first = self.pgroup_base[e];
                let layout = self.d.prefill[e];
                for g in first..first + usize::from(layout.dp) {
                    self.pgroup_generation[g] += 1;
                    let mut lost: Vec<RequestId> = self.pgroups[g].queue.drain(..).collect();
                    lost.extend(std::mem::take(&mut self.pgroups[g].batch).into_iter().map(|(id, _)| id));
                    self.pgroups[g].busy = false;
                    self.pgroups[g].stalled_since = None;
                    let blocks = self.pgroups[g].pool.capacity;
                    self.pgroups[g].pool = Pool::new(blocks);
                    for id in lost {
                        self.end_request(id, true);
                    }
                }
                let totals = self.engines[e].totals();
                self.lost_in_crash += totals.held;
                self.crashed_freed += totals.freed;
                self.crashed_reaped += totals.reaped;
                let defer = ms_ns(self.sc.protocol.defer_timeout_ms);
                self.engines[e] = PrefillEngine::new(engine, layout, self.d.model.clone(), self.policy())
                    .with_defer_timeout_ns(defer);
                self.engine_tick[e] = None;
            }
            Role::Decode => {
                if self.decode_down[e] {
                    return;
                }
                self.decode_down[e] = true;
                let first = self.dgroup_base[e];
                for g in first..first + usize::from(self.d.decode[e].dp) {
                    let mut lost: Vec<RequestId> =
                        self.dgroups[g].waiting.drain(..).map(|r| r.request).collect();
                    self.dgroups[g].told = 0;
                    lost.extend(std::mem::take(&mut self.dgroups[g].pending).into_keys());
                    lost.append(&mut self.dgroups[g].ready);
                    lost.extend(self.dgroups[g].running.drain(..).map(|r| r.id));
                    self.dgroups[g].context_tokens = 0;
                    // The group restarts with its workers: a fresh barrier, on no step.
                    let width = self.d.decode[e].tp;
                    self.dgroups[g].barrier = DecodeGroup::new(width, self.policy().handshake);
                    let blocks = self.dgroups[g].pool.capacity;
                    self.dgroups[g].pool = Pool::new(blocks);
                    for w in self.dgroups[g].workers.clone() {
                        self.abort_flows_on(self.p_ranks.len() + w, "peer down");
                        self.dworkers[w] = build_decode_worker(
                            &self.sc,
                            &self.d,
                            &self.book,
                            &self.policy(),
                            self.d_ranks[w],
                        );
                        self.dworker_tick[w] = None;
                    }
                    for id in lost {
                        // Its prefill side will reap these transfers: expected, since the reader died.
                        self.excused.insert(self.requests[&id].transfer);
                        self.end_request(id, true);
                    }
                }
                for unit in 0..self.units.len() {
                    if self.units[unit].engine == e {
                        // Bumping the step makes in-flight step events stale.
                        self.units[unit].step += 1;
                        self.units[unit].state = UnitState::Idle;
                        self.units[unit].last_step_end = None;
                    }
                }
            }
        }
    }

    /// A crashed engine comes back empty; a prefill engine registers its memory anew.
    fn restart(&mut self, engine: EngineId) {
        let e = usize::from(engine.index);
        trace!(self, "fault", "restart", engine.to_string(), None, String::new());
        match engine.role {
            Role::Prefill => {
                if !self.prefill_down[e] {
                    return;
                }
                self.prefill_down[e] = false;
                let policy = self.policy();
                for i in 0..self.p_ranks.len() {
                    let rank = self.p_ranks[i];
                    if rank.engine != engine {
                        continue;
                    }
                    let old: Vec<u64> =
                        self.regions.iter().filter(|(_, (r, _))| *r == i).map(|(b, _)| *b).collect();
                    for base in old {
                        if let Some(region) = self.regions.remove(&base) {
                            self.retired_regions.insert(base, region);
                        }
                    }
                    self.epoch[i] += 1;
                    let g = self.pgroup_base[e] + usize::from(rank.dp);
                    let blocks = self.pgroups[g].pool.capacity;
                    let (worker, bases, len) = build_prefill_worker(
                        &self.sc,
                        &self.d,
                        &self.book,
                        &self.cost,
                        &policy,
                        rank,
                        i,
                        self.epoch[i],
                        blocks,
                    );
                    for base in bases {
                        self.regions.insert(base, (i, len));
                    }
                    self.pworkers[i] = worker;
                }
                let first = self.pgroup_base[e];
                for g in first..first + usize::from(self.d.prefill[e].dp) {
                    self.try_prefill(g);
                }
            }
            Role::Decode => {
                self.decode_down[e] = false;
            }
        }
    }

    fn policy(&self) -> Policy {
        Policy::from(&self.sc.protocol.legacy.iter().copied().collect::<LegacyOptions>())
    }

    // ---------------------------------------------------------------- checks and results

    fn violation(&mut self, kind: ViolationKind, ranks: Vec<String>, detail: String) {
        trace!(self, "check", kind.name(), ranks.first().cloned().unwrap_or_default(), None, detail.clone());
        if self.violations.len() < 1000 {
            self.violations.push(Violation { t_ms: ms(self.now), kind, ranks, detail });
        }
    }

    /// The unit's collective watchdog fired. One watchdog per unit is pending at most: if the
    /// step it was armed for completed, it re-arms for the step now waiting (if any).
    fn on_collective_timeout(&mut self, unit: usize, _armed_step: u64) {
        self.units[unit].watchdog = false;
        let timeout = ms_ns(self.sc.protocol.collective_timeout_ms);
        let step = self.units[unit].step;
        let UnitState::Waiting { began } = self.units[unit].state else { return };
        let deadline = began.saturating_add(timeout);
        if self.now < deadline {
            self.units[unit].watchdog = true;
            let delay = deadline - self.now;
            self.at(delay, Ev::CollectiveTimeout { unit, step });
            return;
        }
        let mut graph = WaitFor::default();
        let engine = self.units[unit].engine;
        let layout = self.d.decode[engine];
        let what = if layout.ep && layout.dp > 1 { "EP all-to-all" } else { "TP collective" };
        let collective = format!("{what} D{engine} step {step}");
        let mut ranks = Vec::new();
        for &g in &self.units[unit].groups {
            let barrier = &self.dgroups[g].barrier;
            for (&w, member) in self.dgroups[g].workers.iter().zip((0..).map(TpRank)) {
                let report = barrier.report(member);
                if report.is_some_and(StepReport::enters_forward) {
                    continue;
                }
                let rank = self.d_ranks[w].to_string();
                ranks.push(rank.clone());
                graph.edge(&collective, &rank, "not arrived");
                if report == Some(StepReport::Raised) {
                    graph.edge(
                        &rank,
                        &format!("{rank} step error"),
                        "raised out of the step (worker-local failure)",
                    );
                }
                for (session, target) in self.dworkers[w].waiting_sessions() {
                    let listener = format!("{target} handshake listener");
                    graph.edge(&rank, &listener, &format!("blocked on handshake {session}"));
                }
            }
        }
        // Workers waiting for a group vote wait for the workers that have not voted yet.
        for &g in &self.units[unit].groups {
            let Some(open) = self.dgroups[g].barrier.open_vote().filter(|v| v.step == step) else { continue };
            let vote = format!("vote D{engine} group {g} step {step}");
            let worker =
                |member: TpRank| self.d_ranks[self.dgroups[g].workers[usize::from(member.0)]].to_string();
            for &member in &open.voted {
                graph.edge(&worker(member), &vote, "waiting for the MIN vote");
            }
            for &member in &open.missing {
                graph.edge(&vote, &worker(member), "has not voted");
            }
        }
        let waited = self.now - began;
        self.hangs.push(Hang {
            t_ms: ms(self.now),
            what: format!("{collective} waited {} s (timeout)", ms(waited) / 1e3),
            ranks,
            wait_for: graph.lines(),
            cycle: graph.cycle(),
            dot: graph.dot(),
        });
        trace!(self, "check", "hang", collective, None, format!("waited {} ms", ms(waited)));
        self.stopped = true;
    }

    /// A failed request is excused when its transfer was excused for reaping (its decode engine
    /// crashed, or a fault lost one of its releases or leases), or when an injected fault touched
    /// one of its ranks (the TP ranks of its prefill DP group, and of every DP group of its decode
    /// unit) between its arrival and its end (see `touch` for the grace after each touch).
    fn failure_excused(&self, req: &Req, done: u64) -> bool {
        if self.excused.contains(&req.transfer) {
            return true;
        }
        let prefill = &self.pgroups[req.prefill_group];
        let mut slots: Vec<usize> = (0..self.p_ranks.len())
            .filter(|&i| {
                let rank = self.p_ranks[i];
                usize::from(rank.engine.index) == prefill.engine && rank.dp == prefill.dp
            })
            .collect();
        // Under EP every DP group of the engine steps together, so a fault that stalls one
        // group's step stalls the whole unit's.
        let unit = &self.units[self.dgroups[req.decode_group].unit];
        for &g in &unit.groups {
            slots.extend(self.dgroups[g].workers.iter().map(|&w| self.p_ranks.len() + w));
        }
        self.touched_during(&slots, req.sent_ns, done)
    }

    fn progress(&self) -> Progress {
        let ended = self.requests.values().filter(|r| r.done_ns.is_some()).count() as u64;
        let total = match self.sc.workload.clients {
            Clients::Closed { requests, .. } | Clients::Open { requests, .. } => u64::from(requests),
        };
        Progress { ended, total, now_ns: self.now }
    }

    fn finish(mut self) -> Run {
        let now = self.now;
        for g in 0..self.pgroups.len() {
            if let Some(since) = self.pgroups[g].stalled_since.take() {
                self.pgroups[g].stall_ns += now - since;
            }
        }
        let mut result = RunResult::empty(&self.sc, crate::load::scenario_to_ron(&self.sc));
        // Like `vllm bench serve`: the run lasts until its last request ended (a hang or an
        // unfinished request extends it to the end of the simulation).
        let last_end = self.requests.values().filter_map(|r| r.done_ns).max().unwrap_or(0);
        let unfinished = self.requests.values().any(|r| r.done_ns.is_none());
        let end = if unfinished || !self.hangs.is_empty() { now } else { last_end };
        result.duration_s = round3(end as f64 / 1e9);
        result.events = self.events;

        // Requests and latencies.
        let mut ttft = Vec::new();
        let mut tpot = Vec::new();
        let mut e2e = Vec::new();
        let (mut total_tokens, mut output_tokens) = (0u64, 0u64);
        for req in self.requests.values() {
            result.requests.sent += 1;
            match (req.done_ns, req.failed) {
                (Some(done), false) => {
                    result.requests.finished += 1;
                    total_tokens += u64::from(req.input) + u64::from(req.output);
                    output_tokens += u64::from(req.output);
                    let first = req.first_token_ns.unwrap_or(done);
                    ttft.push((first - req.sent_ns) as f64 / 1e6);
                    e2e.push((done - req.sent_ns) as f64 / 1e6);
                    if req.output > 1 {
                        tpot.push((done - first) as f64 / 1e6 / f64::from(req.output - 1));
                    }
                }
                (Some(done), true) => {
                    result.requests.failed += 1;
                    if self.failure_excused(req, done) {
                        result.requests.failed_excused += 1;
                    } else {
                        result.requests.failed_unexcused += 1;
                    }
                }
                (None, _) => result.requests.unfinished += 1,
            }
        }
        result.requests.unsent = self.to_send + self.refused;
        let seconds = (end as f64 / 1e9).max(1e-9);
        result.throughput.total_tok_s = round3(total_tokens as f64 / seconds);
        result.throughput.output_tok_s = round3(output_tokens as f64 / seconds);
        result.throughput.requests_per_s = round3(result.requests.finished as f64 / seconds);
        result.latency_ms.ttft = Summary::of(&mut ttft);
        result.latency_ms.tpot = Summary::of(&mut tpot);
        // `Summary::of` sorted both.
        result.latency_ms.ttft_percentiles = percentiles(&ttft);
        result.latency_ms.tpot_percentiles = percentiles(&tpot);
        result.latency_ms.e2e = Summary::of(&mut e2e);
        result.latency_ms.itl = weighted_summary(&mut self.itl);

        // NICs.
        let bucket_bytes = self.sc.hardware.nic_gb_s * 1e9 * (BUCKET_NS as f64 / 1e9);
        result.nic = NicStats {
            prefill_gpus: self.p_ranks.iter().map(|r| r.to_string()).collect(),
            jain: crate::result::jain(&self.reads),
            jain_bytes: crate::result::jain(&self.bytes),
            reads_per_prefill_gpu: self.reads.clone(),
            bytes_per_prefill_gpu: self.bytes.clone(),
            // One value per second of the run for every GPU (idle seconds are 0), with enough
            // precision for the sub-percent loads a 48 GB/s NIC usually sees.
            utilisation: (0..self.p_ranks.len())
                .map(|i| {
                    let sent = self.nics.sent_per_bucket(i);
                    let seconds = (end.div_ceil(BUCKET_NS) as usize).max(sent.len());
                    (0..seconds)
                        .map(|b| sent.get(b).map_or(0.0, |x| (x / bucket_bytes * 1e6).round() / 1e6))
                        .collect()
                })
                .collect(),
        };

        // Ledger.
        let mut ledger =
            Ledger { freed: self.crashed_freed, reaped: self.crashed_reaped, ..Ledger::default() };
        for engine in &self.engines {
            let totals = engine.totals();
            ledger.held += totals.held;
            ledger.freed += totals.freed;
            ledger.reaped += totals.reaped;
            for record in engine.held().chain(engine.finished()) {
                self.max_hold_ns = self.max_hold_ns.max(record.held_ns(Instant(now)));
            }
        }
        ledger.max_hold_ms = ms(self.max_hold_ns);
        ledger.reaped_excused = self.reaped_excused;
        ledger.lost_in_crash = self.lost_in_crash;
        ledger.prefill_stall_s = round3(self.pgroups.iter().map(|g| g.stall_ns).sum::<u64>() as f64 / 1e9);
        result.ledger = ledger;

        // Requests in flight when the budget ended are cut off, not hung, if the run was still
        // progressing: a request ended within the stall window, the longest any protocol wait
        // may legitimately last (a collective, or a transfer with its defer and handshake
        // timeouts). A run whose requests stopped ending for longer than that is hung.
        let stall_window_ns = self.stall_window_ns();
        let progressing = self.budget_ended && now.saturating_sub(self.last_end_ns) <= stall_window_ns;
        if progressing {
            result.requests.cut_off = result.requests.unfinished;
        }
        // Requests that never ended are a hang even when no collective timed out.
        if result.requests.unfinished > result.requests.cut_off && self.hangs.is_empty() {
            let mut graph = WaitFor::default();
            let mut ranks = Vec::new();
            for (w, worker) in self.dworkers.iter().enumerate() {
                for (session, target) in worker.waiting_sessions() {
                    let rank = self.d_ranks[w].to_string();
                    graph.edge(
                        &rank,
                        &format!("{target} handshake listener"),
                        &format!("handshake {session}"),
                    );
                    ranks.push(rank);
                }
            }
            self.hangs.push(Hang {
                t_ms: ms(now),
                what: format!("{} requests never finished by the end of the run", result.requests.unfinished),
                ranks,
                wait_for: graph.lines(),
                cycle: graph.cycle(),
                dot: graph.dot(),
            });
        }
        result.hangs = self.hangs;
        result.violations = self.violations;
        result.outcome = if !result.violations.is_empty() {
            Outcome::SafetyViolation
        } else if !result.hangs.is_empty() {
            Outcome::Hang
        } else if result.requests.failed_unexcused > 0 {
            Outcome::FailedRequests
        } else if result.ledger.reaped > result.ledger.reaped_excused
            || (result.ledger.held > 0 && result.requests.cut_off == 0)
        {
            // Blocks still held by requests the budget cut off are theirs, not leaked.
            Outcome::Leak
        } else if result.requests.unsent > 0 || result.requests.cut_off > 0 {
            Outcome::Incomplete
        } else {
            Outcome::Clean
        };
        if self.trace_dropped > 0 {
            let t_ns = now;
            let detail =
                format!("{} more records were not kept (limit {MAX_TRACE_RECORDS})", self.trace_dropped);
            self.trace.push(TraceRecord {
                t_ns,
                dur_ns: None,
                cat: "check",
                name: "trace_truncated".into(),
                track: "sim".into(),
                detail,
            });
        }
        Run { result, trace: self.trace }
    }
}

/// Mean and percentiles (ms) of step gaps `(ns, tokens)`, each gap counted once per token.
fn weighted_summary(samples: &mut [(u64, u64)]) -> Option<Summary> {
    let total: u64 = samples.iter().map(|(_, n)| n).sum();
    if total == 0 {
        return None;
    }
    samples.sort_unstable();
    let mean = samples.iter().map(|(d, n)| *d as f64 * *n as f64).sum::<f64>() / total as f64 / 1e6;
    let at = |q: f64| {
        let target = ((total - 1) as f64 * q).round() as u64;
        let mut seen = 0;
        for (d, n) in samples.iter() {
            seen += n;
            if seen > target {
                return *d as f64 / 1e6;
            }
        }
        samples.last().map_or(0.0, |(d, _)| *d as f64 / 1e6)
    };
    Some(Summary { mean: round3(mean), p50: round3(at(0.5)), p99: round3(at(0.99)) })
}

/// `[1, 2, 3]` for messages and traces (not Rust's `Debug` form).
fn list<T: std::fmt::Display>(items: &[T]) -> String {
    let items: Vec<String> = items.iter().map(T::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// What the release ledger did, in words, for the trace.
fn release_outcome_words(outcome: &pdkv_core::release::ReleaseOutcome) -> String {
    use pdkv_core::release::ReleaseOutcome as O;
    match outcome {
        O::Counted { have, need } => format!("counted ({have} of {need})"),
        O::Completed => "completed".into(),
        O::DuplicateSender => "duplicate sender".into(),
        O::Deduplicated => "deduplicated (legacy)".into(),
        O::AfterCompletion => "after completion".into(),
        O::Stale => "stale (transfer retired)".into(),
        O::Buffered => "buffered (early)".into(),
        O::Dropped => "dropped (legacy)".into(),
    }
}

fn msg_name(msg: &Msg) -> &'static str {
    match msg {
        Msg::Dial { .. } => "handshake request",
        Msg::Notify { .. } => "notify message",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{Target, TimedFault};

    /// Two slow-NIC faults on one rank multiply while both last; ending one leaves the other.
    #[test]
    fn overlapping_slow_nic_faults_combine() {
        let mut sc = Scenario::from_notation("1P_TP1:1D_TP1");
        for (factor, duration_ms) in [(0.5, 10_000), (0.25, 2_000)] {
            sc.faults.timeline.push(TimedFault {
                at_ms: 0,
                target: Target("P0.dp0.tp0".into()),
                fault: FaultKind::SlowNic { factor },
                duration_ms: Some(duration_ms),
                count: None,
            });
        }
        let mut world = World::new(&sc, RunOptions::default()).unwrap();
        let check = |world: &mut World, index: usize, start: bool, expected: f64| {
            world.on_fault(index, start);
            assert!(
                (world.nics.factor(0) - expected).abs() < 1e-12,
                "{} != {expected}",
                world.nics.factor(0)
            );
        };
        check(&mut world, 0, true, 0.5);
        check(&mut world, 1, true, 0.125);
        check(&mut world, 1, false, 0.5);
        check(&mut world, 0, false, 1.0);
    }

    /// A worker's vote counts once however often it arrives: a repeated ballot from one worker
    /// of a TP2 group must not stand in for its peer's (it did when ballots were counted by
    /// length, deciding the MIN before the peer had finished its handshakes).
    #[test]
    fn a_repeated_vote_counts_once() {
        let sc = Scenario::from_notation("1P_TP1:1D_TP2");
        let mut world = World::new(&sc, RunOptions::default()).unwrap();
        let results =
            |world: &World| world.queue.iter().filter(|s| matches!(s.0.ev, Ev::VoteResults { .. })).count();
        let vote = || vec![DecodeAction::CastVote { step: 1, ok: true }];
        world.group_event(0, GroupEvent::StepBegin { step: 1 });
        world.decode_actions(0, &mut vote());
        world.decode_actions(0, &mut vote());
        assert_eq!(results(&world), 0, "one worker of two voted, twice");
        world.decode_actions(1, &mut vote());
        assert_eq!(results(&world), 1, "both voted");
        // The group reports the repeated vote instead of counting it.
        let kinds: Vec<&str> = world.violations.iter().map(|v| v.kind.name()).collect();
        assert_eq!(kinds, ["protocol_error"]);
        assert!(world.violations[0].detail.contains("voted on step 1 already"), "{:?}", world.violations);
    }
}

/// Honest outcomes and truthful extremes: every run ends in the outcome its requests earned.
#[cfg(test)]
mod outcome_tests {
    use super::*;
    use crate::scenario::{Target, TimedFault};

    /// A small, fast scenario: one TP1 engine per side, two clients, four short requests, with
    /// `fields` added (RON, as a scenario file writes them).
    fn small(fields: &str) -> Scenario {
        let text = format!(
            "(name: \"t\", deployment: \"1P_TP1:1D_TP1\", workload: (clients: Closed(concurrency: 2, \
             requests: 4), input_tokens: Fixed(8192), output_tokens: Fixed(4)), {fields})"
        );
        crate::load::parse_scenario(&text, "<test>").unwrap_or_else(|e| panic!("{e}"))
    }

    /// A fault on every rank of the deployment for the whole run.
    fn everywhere(fault: FaultKind) -> Vec<TimedFault> {
        ["P0.dp0.tp0", "D0.dp0.tp0"]
            .into_iter()
            .map(|target| TimedFault {
                at_ms: 0,
                target: Target(target.into()),
                fault: fault.clone(),
                duration_ms: None,
                count: None,
            })
            .collect()
    }

    /// What a run is judged by: outcome; sent, finished, failed excused, failed unexcused,
    /// unfinished, unsent, cut off.
    type Verdict = (Outcome, [u64; 7]);

    fn check(name: &str, scenario: &Scenario, expected: Verdict) {
        let r = crate::run(scenario, RunOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}")).result;
        let q = &r.requests;
        let got = (
            r.outcome,
            [q.sent, q.finished, q.failed_excused, q.failed_unexcused, q.unfinished, q.unsent, q.cut_off],
        );
        let hangs: Vec<&str> = r.hangs.iter().map(|h| h.what.as_str()).collect();
        assert_eq!(got, expected, "{name}: hangs {hangs:?}");
        assert_eq!(q.failed, q.failed_excused + q.failed_unexcused, "{name}");
    }

    #[test]
    fn outcomes_are_honest() {
        use Outcome::*;
        let with = |mut sc: Scenario, f: &dyn Fn(&mut Scenario)| {
            f(&mut sc);
            sc
        };
        let table: Vec<(&str, Scenario, Verdict)> = vec![
            ("baseline", small(""), (Clean, [4, 4, 0, 0, 0, 0, 0])),
            // Requests that fail with no fault to excuse them: the run is not clean. Their
            // reads were still posted at the 1 ms deadline: they are aborted and drained before
            // the release, so no read completes from freed blocks (it did before the drain rule).
            (
                "transfer timeout 1 ms",
                small("protocol: (transfer_timeout_ms: 1)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0]),
            ),
            (
                "handshake timeout 1 ms over a 2 ms network",
                small("protocol: (handshake_timeout_ms: 1), hardware: (control_latency_us: 2000)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0]),
            ),
            // The same failures while a fault takes the NICs down are the fault's doing.
            (
                "NIC down everywhere",
                with(small(""), &|sc| sc.faults.timeline = everywhere(FaultKind::NicDown)),
                (Clean, [4, 0, 4, 0, 0, 0, 0]),
            ),
            // A dead listener on one of two prefill engines: the requests routed to it fail,
            // excused; those of the other engine finish.
            (
                "dead listener on P1",
                crate::load::parse_scenario(
                    "(name: \"t\", deployment: \"2P_TP4:1D_TP4\", workload: (clients: Closed(concurrency: 8, \
                     requests: 48), input_tokens: Fixed(1024), output_tokens: Fixed(16)), protocol: \
                     (handshake_timeout_ms: 1000, transfer_timeout_ms: 3000), faults: (timeline: [(at_ms: 0, \
                     target: \"P1.dp0.tp*\", fault: DeadListener)]))",
                    "<test>",
                )
                .unwrap_or_else(|e| panic!("{e}")),
                (Clean, [48, 24, 24, 0, 0, 0, 0]),
            ),
            // Open-loop arrivals after the time budget are unsent, and the run says so.
            (
                "open loop past the time budget",
                with(small(""), &|sc| {
                    sc.workload.clients = Clients::Open { rate_per_s: 0.002, requests: 40 }
                }),
                (Incomplete, [16, 16, 0, 0, 0, 24, 0]),
            ),
            // A closed loop through a decode batch of one, past its time budget: requests still
            // end every few seconds when it is cut, so the ones in flight are cut off, and the
            // blocks they hold are no leak.
            (
                "decode batch of one past the time budget",
                with(small("engines: (decode_max_batch: 1), limits: (max_virtual_time_s: 60)"), &|sc| {
                    sc.workload.clients = Clients::Closed { concurrency: 4, requests: 40 };
                    sc.workload.output_tokens = crate::scenario::Length::Fixed(50);
                }),
                (Incomplete, [9, 5, 0, 0, 4, 31, 4]),
            ),
            // A cut when requests stopped ending longer ago than the stall window cuts off
            // nothing: one lost dial without a handshake timeout blocks the only decode worker
            // for good, its collective times out, and the run is a hang.
            (
                "stuck for longer than the stall window before the budget ended",
                small(
                    "protocol: (legacy: [\"no-handshake-timeout\"], collective_timeout_ms: 1000), faults: (timeline: \
                     [(at_ms: 0, target: \"P0.dp0.tp0\", fault: LoseMessages, count: 2)]), limits: (max_virtual_time_s: 3600)",
                ),
                (Hang, [2, 0, 0, 0, 2, 2, 0]),
            ),
            // Scenarios built in code skip the load-time limits: their times saturate (never),
            // they do not wrap. A collective timeout of 2^64 ns is no false hang at 621 ms.
            (
                "collective timeout past u64 nanoseconds",
                with(small(""), &|sc| sc.protocol.collective_timeout_ms = 18_446_744_073_709),
                (Clean, [4, 4, 0, 0, 0, 0, 0]),
            ),
            // A message delayed past the end of time never arrives: the dials time out.
            (
                "messages delayed by u64::MAX ms",
                with(small(""), &|sc| {
                    sc.faults.timeline = everywhere(FaultKind::DelayMessages { delay_ms: u64::MAX })
                }),
                (Clean, [4, 0, 4, 0, 0, 0, 0]),
            ),
            // A NIC too slow to finish a read within the run: the reads time out, excused by the
            // fault; without a fault the same slowness fails requests unexcused.
            (
                "SlowNic factor 1e-300",
                with(small(""), &|sc| sc.faults.timeline = everywhere(FaultKind::SlowNic { factor: 1e-300 })),
                (Clean, [4, 0, 4, 0, 0, 0, 0]),
            ),
            // The slowest loadable NIC and slow-down behave the same way, through the loader.
            (
                "nic_gb_s at its lower limit",
                small("hardware: (nic_gb_s: 0.000001)"),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0]),
            ),
            (
                "SlowNic at its lower limit",
                small("faults: (timeline: [(at_ms: 0, target: \"P0.dp0.tp0\", fault: SlowNic(factor: 0.000001))])"),
                (Clean, [4, 0, 4, 0, 0, 0, 0]),
            ),
            (
                "nic_gb_s 1e-15",
                with(small(""), &|sc| sc.hardware.nic_gb_s = 1e-15),
                (FailedRequests, [4, 0, 0, 4, 0, 0, 0]),
            ),
        ];
        for (name, scenario, expected) in &table {
            check(name, scenario, *expected);
        }
    }
}
