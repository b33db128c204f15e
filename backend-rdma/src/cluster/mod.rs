//! `pdkv cluster`: one real connector process per rank on one host, plus the proxy and each
//! engine's scheduler in this process, pushing requests through the real protocol and checking
//! every byte decode reads.
//!
//! This process plays the parts vLLM keeps outside its workers: the proxy (the core's
//! [`Proxy`]), each prefill engine's scheduler with its block pool and the engine node
//! ([`PrefillEngine`](pdkv_core::prefill::PrefillEngine): registration quorums, frees, the
//! reaper), and each decode DP group's scheduler (the engine layer's
//! [`DecodeScheduler`](pdkv_engine::decode::DecodeScheduler), the simulator's too: admission by
//! pool space, the request barrier, the batch, and the TP group's barrier that takes the MIN
//! vote). The ranks run the worker nodes behind real listeners and a real data plane. Nothing
//! here computes a rank, a port or a quorum either: the proxy routes, the engine registers, the
//! workers decide whom to read.
//!
//! This file holds the run's main loop and [`Cluster`], which keeps only what the driver alone
//! owns (the options, the deployment, the addresses and peer rules, the clock, when the run
//! started, and why it hung or ran out of budget) and one owned subsystem per concept, each in
//! its own file with the methods that touch only it: `clients.rs` ([`clients::Clients`]: the
//! proxy, the request stream, the requests in flight), `procs.rs` ([`procs::Procs`]: processes
//! and membership), `prefill_sched.rs` and `decode_sched.rs` ([`prefill_sched::PrefillSide`],
//! [`decode_sched::DecodeSide`]: the engines' nodes and schedulers), `faults.rs`
//! ([`faults::Faults`]: kills, restarts, held dispatches, what faults excuse), `messages.rs`
//! ([`messages::Messages`]: lost, duplicated and delayed control messages), `foreign.rs`
//! ([`foreign::ForeignSide`]: the side another connector's code plays), `forger.rs` (the
//! forger) and `result.rs` ([`result::Tally`], the run's counters, and the report, in the
//! simulator's vocabulary). `config.rs` holds the options.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdkv_core::group::{GroupEvent, StepReport};
use pdkv_core::ids::{EngineId, RankId, Role};
use pdkv_core::policy::{PeerBook, Policy};
use pdkv_core::ports::EngineAddress;
use pdkv_core::prefill::EngineEvent;
use pdkv_core::proxy::Proxy;
use pdkv_core::time::Instant;
use pdkv_core::topology::Deployment;

use crate::rank_io::Clock;
use crate::sched::FromRank;

mod clients;
mod config;
mod decode_sched;
mod errors;
mod faults;
mod foreign;
mod foreign_reads;
pub mod forger;
mod messages;
mod prefill_sched;
mod procs;
mod result;
#[cfg(test)]
mod tests;

pub use config::{
    ClusterConfig, ClusterError, ConfigError, ControlAuthMode, Fault, Foreign, MAX_CLUSTER_RANKS,
    MAX_CONCURRENCY, MAX_LAYERS, MAX_REQUESTS, MIN_HEARTBEAT_TIMEOUT_MS, MIN_RUN_TIMEOUT_MS,
};
pub use errors::{DriverSetupError, SpawnError, Spawned, StartError};
pub use foreign::DriverExit;
pub use foreign_reads::ForeignReads;
pub use pdkv_engine::verdict::{Summary, Verdict, ViolationKind};
use procs::{free_ports, new_control_key, new_token, Acceptor, Admission};
pub use result::{
    ClusterResult, Control, Failure, ForeignReport, Latencies, Ledger, Nic, Processes, Progress, Requests,
    Throughput, Violation, MAX_FAILURES_LISTED,
};

/// How long ranks get to start, join and bind.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long ranks get to say goodbye and exit after shutdown.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the loop looks at [`ClusterConfig::stop`] and at the ranks' heartbeats.
const POLL: Duration = Duration::from_millis(50);
/// The share of the heartbeat timeout ([`ClusterConfig::heartbeat_timeout_ms`]) past which a gap
/// between two turns of the scheduler's own loop counts as the scheduler not running (stopped,
/// or starved of CPU): its loop waits at most [`POLL`] a turn, so such a gap is the scheduler's
/// stall, not its ranks', and every rank gets a fresh heartbeat window instead of the blame.
const STALL_SHARE: u32 = 4;
/// How long after such a stall the engines' reapers wait: the whole process was stopped, its
/// reader threads too, so the releases and finishes the ranks sent meanwhile still sit in the
/// sockets; they are read first, and only what is still unreleased afterwards is reaped.
const STALL_GRACE: Duration = Duration::from_millis(500);

// ------------------------------------------------------------------------------ processes

/// What the run's threads (acceptor, rank readers, the foreign driver's reader) tell the main
/// loop.
enum Ev {
    Joined {
        rank: RankId,
        stream: std::net::TcpStream,
    },
    Refused {
        rank: RankId,
        pid: u32,
        reason: crate::sched::AdmitError,
    },
    Msg {
        rank: RankId,
        life: u32,
        msg: FromRank,
    },
    Gone {
        rank: RankId,
        life: u32,
    },
    /// The foreign side's driver said something ([`foreign`]).
    Driver(foreign::DriverEvent),
    /// The forger said something ([`forger`]).
    Forger(forger::ForgerEvent),
}

// ------------------------------------------------------------------------------ scheduling

/// The whole run: what its driver alone owns, and the subsystems that own the rest.
struct Cluster {
    config: ClusterConfig,
    d: Deployment,
    /// Where each engine's handshake and notify listeners are based.
    addresses: BTreeMap<EngineId, EngineAddress>,
    /// The rules each engine follows (pdkv's, or the foreign side's).
    peers: PeerBook,
    clock: Clock,
    started_at: std::time::Instant,
    /// Why the run hung, if it did.
    hung: Option<String>,
    /// The run's budget (`--timeout-ms`) ended while requests were still finishing.
    budget_ended: Option<String>,
    /// The proxy, the request stream and the requests in flight ([`clients`]).
    clients: clients::Clients,
    /// The prefill engines and their DP groups' schedulers ([`prefill_sched`]).
    prefill: prefill_sched::PrefillSide,
    /// The decode DP groups' schedulers ([`decode_sched`]).
    decode: decode_sched::DecodeSide,
    /// The rank processes and their membership ([`procs`]).
    procs: procs::Procs,
    /// Kills, restarts, held dispatches and what faults excuse ([`faults`]).
    faults: faults::Faults,
    /// The run's message faults and what they did ([`messages`]).
    messages: messages::Messages,
    /// The foreign side, its driver and its report ([`foreign`]).
    foreign: foreign::ForeignSide,
    /// The forger outside the deployment, if the run has one (`--forge-messages`).
    forger: Option<forger::Forger>,
    /// What the run counted for its report ([`result`]).
    tally: result::Tally,
}

/// Runs a cluster to the end and reports; `progress` is called as requests end.
pub fn run(config: ClusterConfig, progress: &mut dyn FnMut(Progress)) -> Result<ClusterResult, ClusterError> {
    let d = Deployment::parse(&config.deployment)
        .map_err(|e| ClusterError::Config(ConfigError::Deployment(e)))?;
    let model = config.model(&d);
    let d = d.with_model(model);
    for &decode in &d.decode {
        for &prefill in &d.prefill {
            pdkv_core::routing::check_pair(decode, prefill, &d.model)
                .map_err(|e| ClusterError::Config(ConfigError::Routing(e)))?;
        }
    }
    config.validate(&d).map_err(ClusterError::Config)?;
    // Port bases: each engine gets a handshake and a notify block as wide as its ranks.
    let widths: Vec<(EngineId, u16)> = [Role::Prefill, Role::Decode]
        .into_iter()
        .flat_map(|role| {
            d.engines(role)
                .iter()
                .enumerate()
                .map(move |(i, l)| (EngineId { role, index: i as u16 }, l.ranks() as u16))
        })
        .collect();
    let total: u16 = widths.iter().map(|(_, w)| 2 * w).sum();
    let mut next = free_ports(&config.host, total).map_err(ClusterError::Start)?;
    let mut addresses = BTreeMap::new();
    for (engine, width) in widths {
        addresses.insert(
            engine,
            EngineAddress {
                host: config.host.clone(),
                handshake_port_base: next,
                notify_port_base: next + width,
            },
        );
        next += 2 * width;
    }

    let listener = TcpListener::bind((config.host.as_str(), 0))
        .map_err(|e| ClusterError::Start(StartError::Listener(e)))?;
    let (tx, rx) = mpsc::channel();
    let token = new_token().map_err(ClusterError::Start)?;
    let admission = Arc::new(Mutex::new(Admission { token: token.clone(), ..Admission::default() }));
    let mut acceptor =
        Acceptor::start(listener, tx.clone(), admission.clone()).map_err(ClusterError::Start)?;
    // A foreign side's vLLM ranks send releases without a MAC, so there a missing one is taken
    // and only a wrong one refused.
    let control_setup = match config.control_auth {
        ControlAuthMode::Open => crate::sched::ControlSetup::default(),
        ControlAuthMode::Require => crate::sched::ControlSetup {
            key: Some(new_control_key().map_err(ClusterError::Start)?),
            require: config.foreign.is_none(),
        },
    };
    let id_seed = procs::random_u64("transfer ids").map_err(ClusterError::Start)?;
    let policy = Policy::from(&config.legacy);
    let peers = config.peers(&d);
    let foreign_report = config.foreign.as_ref().map_or_else(ForeignReport::default, |f| ForeignReport {
        side: f.side.name().to_string(),
        rules: f.rules.to_string(),
        ..ForeignReport::default()
    });
    let auth = match (&control_setup.key, control_setup.require) {
        (None, _) => "open",
        (Some(_), true) => "require",
        (Some(_), false) => "verify",
    };
    let clients =
        clients::Clients::new(Proxy::new(&d, policy.proxy).with_peers(&peers), config.seed, id_seed);
    let prefill = prefill_sched::PrefillSide::new(&d, &config, policy, &peers);
    let decode = decode_sched::DecodeSide::new(&d, &config, policy);
    let messages = messages::Messages::new(&config);
    let mut cluster = Cluster {
        clock: Clock::start(),
        started_at: std::time::Instant::now(),
        hung: None,
        budget_ended: None,
        clients,
        prefill,
        decode,
        procs: procs::Procs::new(acceptor.addr, token, admission, control_setup),
        faults: faults::Faults::default(),
        messages,
        foreign: foreign::ForeignSide::new(foreign_report),
        forger: None,
        tally: result::Tally::new(auth),
        config,
        d,
        addresses,
        peers,
    };
    let started = cluster.start_all(&rx, &tx);
    let result = match started {
        Ok(()) => {
            cluster.started_at = std::time::Instant::now();
            cluster.main_loop(&rx, &tx, progress);
            cluster.stop_forger(&rx, &tx);
            cluster.shutdown(&rx);
            cluster.judge_refusals();
            Ok(cluster.result())
        }
        Err(e) => {
            cluster.shutdown(&rx);
            Err(ClusterError::Start(e))
        }
    };
    acceptor.stop();
    result
}

impl Cluster {
    /// Notes that the loop runs now. It waits at most [`POLL`] between two notes, so a much
    /// longer gap since `last` means this process was not running, and its ranks' silence
    /// meanwhile is not theirs ([`Cluster::scheduler_stalled`]).
    fn note_turn(&mut self, last: &mut std::time::Instant) {
        let now = std::time::Instant::now();
        let gap = now.duration_since(*last);
        *last = now;
        if gap > self.heartbeat_timeout() / STALL_SHARE {
            self.scheduler_stalled(gap);
        }
    }

    fn on_message(&mut self, rank: RankId, msg: FromRank) -> Option<StartError> {
        let now = self.clock.now();
        match msg {
            // A dial's timing is for the plugin's metrics; the run counts handshakes at `Bye`.
            FromRank::Hello { .. } | FromRank::Heartbeat | FromRank::Dialled { .. } => {}
            FromRank::Ready { data_addr, memory, handshake, incarnation } => {
                if rank.engine.role == Role::Prefill {
                    self.tally.memory.insert(memory);
                }
                if let Some(incarnation) = incarnation.filter(|_| rank.engine.role == Role::Prefill) {
                    // The engine registers, answers and retires under the incarnation each of
                    // its workers runs; a new one ends the old incarnation's parts.
                    self.engine(usize::from(rank.engine.index), EngineEvent::WorkerUp { rank, incarnation });
                }
                if let Some(reply) = handshake {
                    self.record_life(rank, incarnation, &reply);
                    if self.is_foreign(rank.engine) {
                        self.foreign.replies.insert(rank, reply);
                    }
                }
                let proc = self.procs.ranks.get_mut(&rank).expect("known rank");
                proc.data_addr = data_addr;
                proc.incarnation = incarnation;
                if proc.life > 0 && self.is_foreign(rank.engine) {
                    // Its control plane is the driver's: ready once the driver restarted it.
                    self.foreign_restart(rank);
                } else {
                    self.rank_up(rank);
                }
            }
            FromRank::SetupFailed { error } => return Some(StartError::RankSetup { rank, error }),
            FromRank::Prefilled { transfer_id } => {
                if let Some(id) = self.clients.request_of(&transfer_id) {
                    self.prefill_acked(id, rank);
                }
            }
            FromRank::Finished { transfer_id } => {
                let e = usize::from(rank.engine.index);
                self.engine(e, EngineEvent::WorkerFinished { rank, transfer_id });
            }
            FromRank::Refused { message, verdict, from, .. } => {
                self.tally.control.refused(rank, message, verdict, from.as_deref());
            }
            FromRank::LeaseCapped { .. } => self.tally.control.leases_capped += 1,
            FromRank::Leased { transfer_id, remaining_ns } => {
                let e = usize::from(rank.engine.index);
                self.engine(e, EngineEvent::Leased { transfer_id, until: Instant(now.0 + remaining_ns) });
            }
            FromRank::Vote { step, ok } => {
                let event = GroupEvent::Vote { member: rank.tp_rank(), step, ok };
                self.group_event(self.decode.group_of(rank), event);
            }
            FromRank::StepDone { step, error } => {
                // The core says what the rank's step means for the group: ready, or failed with
                // the whole group (both enter the forward pass), or raised out of it alone.
                let report = error.as_ref().map_or(StepReport::Ready, StepReport::failed);
                let event = GroupEvent::StepReport { member: rank.tp_rank(), step, report };
                self.group_event(self.decode.group_of(rank), event);
                if let Some(error) = error.filter(|_| report == StepReport::Raised) {
                    self.tally.problem(format!("{rank} raised at step {step}: {error}"));
                }
            }
            FromRank::Received { request } => self.reported(rank, request, None),
            FromRank::RecvFailed { request, error } => self.reported(rank, request, Some(error.to_string())),
            FromRank::ReadVerified { layer, source, bytes, .. } => {
                self.tally.record_read(source, layer, bytes);
            }
            FromRank::Mismatch(mismatch) => {
                self.tally.violation(
                    ViolationKind::ReadMismatch,
                    format!("{rank}, {}: {mismatch}", mismatch.request),
                );
            }
            FromRank::ProtocolError { rank: refused_by, error } => {
                self.tally.violation(ViolationKind::ProtocolError, format!("{rank}: {refused_by}: {error}"));
            }
            FromRank::Problem(problem) => self.tally.problem(format!("{rank}: {problem}")),
            FromRank::MessageFault(hit) => self.on_message_fault(rank, hit),
            FromRank::Bye { .. } => {
                if let Some(proc) = self.procs.ranks.get_mut(&rank) {
                    proc.said_bye = true;
                }
            }
        }
        None
    }

    /// A rank is ready; a restarted one is back, and its group's prefills go on.
    fn rank_up(&mut self, rank: RankId) {
        let Some(proc) = self.procs.ranks.get_mut(&rank) else { return };
        proc.ready = true;
        let life = proc.life;
        if life > 0 {
            self.faults.down_by_fault.remove(&rank);
            self.tally.faults_log.push(format!("{rank} restarted (life {life})"));
            self.release_held(rank);
            self.pump_prefill(rank.engine, rank.dp);
        }
    }

    fn main_loop(&mut self, rx: &Receiver<Ev>, tx: &Sender<Ev>, progress: &mut dyn FnMut(Progress)) {
        self.log_message_faults();
        // A kill after 0 prefills happens before the first request.
        self.maybe_kill();
        self.clients.owed += u64::from(self.config.concurrency.min(self.config.requests));
        self.submit_owed();
        let deadline = self.started_at + Duration::from_millis(self.config.timeout_ms);
        let total = u64::from(self.config.requests);
        let mut reported = u64::MAX;
        let mut last_done_at = std::time::Instant::now();
        let mut last_turn = std::time::Instant::now();
        // A healthy request ends within a handshake and a transfer timeout of its arrival, so a
        // run in which nothing ended for that long is stuck; one that ends its budget sooner
        // after its last finished request was only too short.
        let stall = Duration::from_millis(
            self.config.timeouts.handshake_ms.saturating_add(self.config.timeouts.transfer_ms),
        );
        loop {
            if self.stop_requested() {
                return;
            }
            // The foreign side is gone, or stopped reading: nothing it played can finish, so
            // the run ends here (outcome hang, with the reason set when its output closed or
            // its input stalled).
            if self.foreign.driver.as_ref().is_some_and(|d| (d.closed && !d.said_bye) || d.failed.is_some()) {
                return;
            }
            self.note_turn(&mut last_turn);
            self.check_heartbeats();
            self.check_driver(true);
            let done = self.tally.done();
            if done != reported {
                reported = done;
                last_done_at = std::time::Instant::now();
                progress(Progress { done, total });
            }
            if done >= total && self.prefill.held() == 0 {
                return;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                let held = self.prefill.held();
                let quiet_ms = now.duration_since(last_done_at).as_millis();
                if done > 0 && now.duration_since(last_done_at) < stall {
                    self.budget_ended = Some(format!(
                        "the run's budget (--timeout-ms {}) ended with {} of {total} requests \
                         unfinished while they were still finishing (the last {quiet_ms} ms \
                         ago); raise --timeout-ms",
                        self.config.timeout_ms,
                        total - done
                    ));
                } else {
                    self.hung = Some(format!(
                        "after {} ms: {} requests unfinished, {held} transfers still held; none \
                         finished in the last {quiet_ms} ms{}",
                        self.config.timeout_ms,
                        total - done,
                        self.faults.holds_note()
                    ));
                }
                return;
            }
            // The next timer: an engine's reaper, a group's idle step, a restart, the deadline.
            let mut wake = deadline;
            for e in &self.prefill.engines {
                if let Some(at) = e.poll_timeout() {
                    wake = wake.min(now + self.clock.until(at));
                }
            }
            for g in &self.decode.groups {
                if let Some(at) = g.next_step {
                    wake = wake.min(at);
                }
            }
            if let Some((at, _)) = self.faults.restart_at {
                wake = wake.min(at);
            }
            if let Some(wait) = self.messages.wait() {
                wake = wake.min(now + wait);
            }
            match rx.recv_timeout(wake.saturating_duration_since(now).min(POLL)) {
                Ok(ev) => {
                    if let Some(error) = self.on_event(ev, tx) {
                        self.tally.problem(error.to_string());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // A stop that struck during the wait shows here, before any timer fires.
            self.note_turn(&mut last_turn);
            let now = std::time::Instant::now();
            let core_now = self.clock.now();
            let reapers_wait = self.prefill.reapers_wait_until.is_some_and(|until| now < until);
            for e in 0..self.prefill.engines.len() {
                if !reapers_wait && self.prefill.engines[e].poll_timeout().is_some_and(|at| at <= core_now) {
                    self.engine(e, EngineEvent::Tick);
                }
            }
            self.dispatch_due();
            for g in 0..self.decode.groups.len() {
                if self.decode.groups[g].next_step.is_some_and(|at| at <= now) {
                    self.decode.groups[g].next_step = None;
                    self.begin_step(g);
                }
            }
            if let Some((at, rank)) = self.faults.restart_at {
                if at <= now {
                    self.faults.restart_at = None;
                    self.restart(rank);
                }
            }
        }
    }
}
