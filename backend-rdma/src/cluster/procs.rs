//! The rank processes: spawning, the admission of their hellos, membership, heartbeats,
//! loss, signals and shutdown.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use pdkv_core::group::GroupEvent;
use pdkv_core::ids::Incarnation;
use pdkv_core::ids::{EngineId, RankId, RequestId, Role};
use pdkv_core::prefill::EngineEvent;

use super::errors::{SpawnError, Spawned, StartError};
use super::foreign::{Driver, ToDriver};
use super::result::Severity;
use super::{Cluster, ClusterConfig, Ev, Processes, EXIT_TIMEOUT, POLL, START_TIMEOUT};
use crate::sched::{
    read_frame, read_frame_within, write_frame, AdmitError, ControlSetup, FromRank, Setup, ToRank,
    MAX_HELLO_BYTES, TOKEN_ENV,
};

/// How long a driver may leave its input unread at shutdown before it counts as not reading.
const SHUTDOWN_READ: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a driver has to say bye when a signal ends the run.
const SIGNALLED_BYE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long the forger gets, once its input closed, to send what it was given and exit.
const FORGER_EXIT: std::time::Duration = std::time::Duration::from_secs(3);

pub(super) struct RankProc {
    pub(super) child: Option<Child>,
    pub(super) writer: Option<TcpStream>,
    pub(super) life: u32,
    pub(super) alive: bool,
    pub(super) ready: bool,
    pub(super) data_addr: Option<String>,
    pub(super) said_bye: bool,
    pub(super) killed_by_fault: bool,
    /// When the scheduler last heard from the process.
    pub(super) last_heard: std::time::Instant,
    /// The protocol incarnation the process drew (a prefill rank's, from its `Ready`).
    pub(super) incarnation: Option<Incarnation>,
}

/// Who may join a run: a process this run started, once, holding the run's token. A stray
/// `pdkv connector` (another run's, a user's, a second one with the id of a live rank) would
/// otherwise take the rank's place: the scheduler would talk to it and the rank it displaced
/// would hang, or serve another life's bytes.
#[derive(Default)]
pub(super) struct Admission {
    /// The run's random token, handed to its processes in [`TOKEN_ENV`].
    pub(super) token: String,
    /// The process this run started for each rank (its latest life).
    pub(super) expected: BTreeMap<RankId, u32>,
    /// Processes admitted so far: each joins once.
    pub(super) admitted: BTreeSet<u32>,
}

impl Admission {
    /// Admits `pid` as `rank` or says why not.
    pub(super) fn admit(&mut self, rank: RankId, pid: u32, token: &str) -> Result<(), AdmitError> {
        if token.is_empty() {
            return Err(AdmitError::NoToken);
        }
        if token != self.token {
            return Err(AdmitError::WrongToken);
        }
        match self.expected.get(&rank) {
            None => Err(AdmitError::NoSuchRank(rank)),
            Some(&running) if running != pid => Err(AdmitError::AlreadyRunning { rank, running, pid }),
            Some(_) if !self.admitted.insert(pid) => Err(AdmitError::JoinedAlready { rank, pid }),
            Some(_) => Ok(()),
        }
    }
}

/// A new random token for a run's membership (16 bytes of the system's randomness, in hex).
pub(super) fn new_token() -> Result<String, StartError> {
    random_hex::<16>("membership token")
}

/// A fresh 256-bit control key for the run's ranks, from the operating system (never from the
/// seed: a key anyone could derive protects nothing).
pub(super) fn new_control_key() -> Result<String, StartError> {
    random_hex::<32>("control key")
}

/// A seed from the operating system; the error names `what` it was for.
pub(super) fn random_u64(what: &'static str) -> Result<u64, StartError> {
    Ok(u64::from_le_bytes(random_bytes::<8>(what)?))
}

/// `N` bytes from /dev/urandom as hexadecimal digits; the error names `what` they were for.
fn random_hex<const N: usize>(what: &'static str) -> Result<String, StartError> {
    Ok(random_bytes::<N>(what)?.iter().map(|b| format!("{b:02x}")).collect())
}

fn random_bytes<const N: usize>(what: &'static str) -> Result<[u8; N], StartError> {
    use std::io::Read as _;
    let mut bytes = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|error| StartError::Random { what, error })?;
    Ok(bytes)
}

/// Accepts connector connections, admits each one's `Hello` ([`Admission`]) and hands admitted
/// ones to the main loop. Refusing here, not in the main loop, answers a stray connector even
/// while the main loop is busy.
pub(super) struct Acceptor {
    pub(super) addr: SocketAddr,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) handle: Option<JoinHandle<()>>,
}

impl Acceptor {
    pub(super) fn start(
        listener: TcpListener,
        tx: Sender<Ev>,
        admission: Arc<Mutex<Admission>>,
    ) -> Result<Acceptor, StartError> {
        let addr = listener.local_addr().map_err(StartError::LocalAddr)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = thread::spawn(move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let (tx, admission) = (tx.clone(), admission.clone());
                thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(START_TIMEOUT));
                    let mut reader = BufReader::new(&stream);
                    // Anything but a hello is not a connector; it gets nothing. A hello is small,
                    // so a stranger cannot make this thread allocate a long frame.
                    let hello = read_frame_within::<FromRank>(&mut reader, MAX_HELLO_BYTES);
                    let Ok(FromRank::Hello { rank, pid, token }) = hello else {
                        return;
                    };
                    let verdict =
                        admission.lock().unwrap_or_else(PoisonError::into_inner).admit(rank, pid, &token);
                    match verdict {
                        Ok(()) => {
                            let _ = stream.set_read_timeout(None);
                            let _ = tx.send(Ev::Joined { rank, stream });
                        }
                        Err(reason) => {
                            let _ = write_frame(&mut &stream, &ToRank::Refused { reason: reason.clone() });
                            let _ = tx.send(Ev::Refused { rank, pid, reason });
                        }
                    }
                });
            }
        });
        Ok(Acceptor { addr, stop, handle: Some(handle) })
    }

    pub(super) fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocked accept; it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Finds `count` consecutive ports on `host` that can be bound now.
pub(super) fn free_ports(host: &str, count: u16) -> Result<u16, StartError> {
    // Clusters started at once (tests in one process) must not probe the same ports: mix the
    // process id, a per-process counter and the clock.
    static CLUSTERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CLUSTERS.fetch_add(1, Ordering::SeqCst);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let seed = u64::from(std::process::id()) * 7919 + n * 4999 + u64::from(nanos / 1000);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|text| {
        let mut bounds = text.split_whitespace().map(|n| n.parse::<u16>().ok());
        Some((bounds.next()??, bounds.next()??))
    });
    let (lo, hi) = probe_window(ephemeral, count);
    let width = u64::from(hi - lo - count + 1);
    for attempt in 0..200u64 {
        let start = lo + ((seed + attempt * 1009) % width) as u16;
        let ok = (0..count).all(|i| TcpListener::bind((host, start + i)).is_ok());
        if ok {
            return Ok(start);
        }
    }
    Err(StartError::NoFreePorts { count, host: host.to_owned() })
}

/// Where to look for listener ports, `lo..=hi`: outside the system's ephemeral range (Linux's
/// `ip_local_port_range`, 32768-60999 by default), since every outgoing connection (a data-plane
/// read, a release, another cluster's) takes a port from it, and one could take a rank's port
/// between the probe and the rank's bind. Below it when there is room, else above it.
pub(super) fn probe_window(ephemeral: Option<(u16, u16)>, count: u16) -> (u16, u16) {
    const LOWEST: u16 = 10_000;
    let (first, last) = ephemeral.unwrap_or((32_768, 60_999));
    if first > LOWEST && first - LOWEST > count.saturating_mul(16) {
        (LOWEST, first - 1)
    } else if last < u16::MAX && u16::MAX - last > count.saturating_mul(16) {
        (last + 1, u16::MAX)
    } else {
        // No room outside it (a system that made everything ephemeral): probe it all.
        (LOWEST, u16::MAX)
    }
}

/// The rank processes and their membership: each rank's process, who may join and with what
/// token, the key every rank gets, how processes ended, and the signal that stopped the run.
pub(super) struct Procs {
    pub(super) ranks: BTreeMap<RankId, RankProc>,
    pub(super) scheduler_addr: SocketAddr,
    /// The run's membership token and who may join ([`Admission`]).
    pub(super) token: String,
    pub(super) admission: Arc<Mutex<Admission>>,
    pub(super) processes: Processes,
    /// The key every rank gets, and whether the prefill ranks require it.
    pub(super) control_setup: ControlSetup,
    /// The signal that stopped the run, if one did.
    pub(super) interrupted: Option<i32>,
}

impl Procs {
    /// No process started yet: joins come to `scheduler_addr` with `token`, admitted by
    /// `admission`, and each rank gets `control_setup`.
    pub(super) fn new(
        scheduler_addr: SocketAddr,
        token: String,
        admission: Arc<Mutex<Admission>>,
        control_setup: ControlSetup,
    ) -> Procs {
        Procs {
            ranks: BTreeMap::new(),
            scheduler_addr,
            token,
            admission,
            processes: Processes::default(),
            control_setup,
            interrupted: None,
        }
    }

    /// Starts `rank`'s process for its life `life`, expected at admission.
    pub(super) fn spawn(
        &mut self,
        config: &ClusterConfig,
        rank: RankId,
        life: u32,
    ) -> Result<(), SpawnError> {
        let role = match rank.engine.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        // Hold the admission while the child starts: its hello may come before this thread
        // runs again, and must find the process expected.
        let admission = self.admission.clone();
        let mut admission = admission.lock().unwrap_or_else(PoisonError::into_inner);
        let mut command = Command::new(&config.exe);
        command
            .args(["connector", "--deployment", &config.deployment, "--role", role])
            .args(["--engine", &rank.engine.index.to_string(), "--dp", &rank.dp.to_string()])
            .args(["--tp", &rank.tp.to_string(), "--scheduler", &self.scheduler_addr.to_string()])
            .env(TOKEN_ENV, &self.token)
            // Its own process group: a Ctrl-C in the terminal reaches only `pdkv cluster`, which
            // then stops its ranks in order and still writes its result.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // A connector exits when its scheduler connection closes, but a stopped one cannot: it
        // dies with `pdkv cluster` all the same.
        crate::signals::die_with_parent(&mut command);
        let child = command.spawn().map_err(|error| SpawnError {
            what: Spawned::Connector,
            program: config.exe.clone(),
            error,
        })?;
        self.processes.started += 1;
        admission.expected.insert(rank, child.id());
        drop(admission);
        let proc = RankProc {
            child: Some(child),
            writer: None,
            life,
            alive: true,
            ready: false,
            data_addr: None,
            said_bye: false,
            killed_by_fault: false,
            last_heard: std::time::Instant::now(),
            incarnation: None,
        };
        self.ranks.insert(rank, proc);
        Ok(())
    }

    /// A rank whose process this run started has exited before it said hello, if any.
    pub(super) fn exited_before_joining(&mut self) -> Option<RankId> {
        self.ranks.iter_mut().find_map(|(rank, proc)| {
            let joined = proc.writer.is_some() || proc.ready;
            let exited = proc.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            (!joined && exited).then_some(*rank)
        })
    }

    /// Whether `rank`'s process is alive and ready.
    pub(super) fn is_up(&self, rank: RankId) -> bool {
        self.ranks.get(&rank).is_some_and(|p| p.alive && p.ready)
    }

    /// Sends `msg` to `rank`'s live process; a connection that fails is dropped.
    pub(super) fn send(&mut self, rank: RankId, msg: &ToRank) {
        let Some(proc) = self.ranks.get_mut(&rank) else { return };
        if !proc.alive {
            return;
        }
        if let Some(writer) = proc.writer.as_mut() {
            if write_frame(writer, msg).is_err() {
                proc.writer = None;
            }
        }
    }
}

impl Cluster {
    pub(super) fn setup_for(&self, rank: RankId, life: u32) -> Setup {
        Setup {
            model: self.d.model.clone(),
            legacy: self.config.legacy.clone(),
            address: self.addresses[&rank.engine].clone(),
            num_blocks: self.config.num_blocks,
            transport: self.config.transport,
            rdma_device: None,
            timeouts: self.config.timeouts,
            per_request_reads: false,
            message_faults: self.sender_faults(rank, life),
            life,
            peers: self.peers.clone(),
            data_plane_only: self.is_foreign(rank.engine),
            control: self.procs.control_setup.clone(),
        }
    }

    pub(super) fn start_all(&mut self, rx: &Receiver<Ev>, tx: &Sender<Ev>) -> Result<(), StartError> {
        // A foreign decode side has no pdkv process at all; a foreign prefill side's ranks are
        // pdkv data-plane servers whose control plane the driver plays.
        let all: Vec<RankId> = [Role::Prefill, Role::Decode]
            .into_iter()
            .filter(|&r| r == Role::Prefill || self.foreign_side() != Some(Role::Decode))
            .flat_map(|r| self.d.ranks(r))
            .collect();
        for &rank in &all {
            self.procs.spawn(&self.config, rank, 0).map_err(StartError::Spawn)?;
        }
        let ranks_ready = |c: &Cluster| c.procs.ranks.values().all(|r| r.ready);
        self.wait_for(rx, tx, ranks_ready, &|c| StartError::NotReady {
            secs: START_TIMEOUT.as_secs(),
            missing: c.procs.ranks.iter().filter(|(_, r)| !r.ready).map(|(&k, _)| k).collect(),
        })?;
        if self.stop_requested() {
            return Ok(());
        }
        if let Some(foreign) = self.config.foreign.clone() {
            let setup = self.driver_setup().map_err(StartError::DriverSetup)?;
            let mut driver = Driver::start(&foreign, tx.clone()).map_err(StartError::Spawn)?;
            driver.send(&setup);
            self.foreign.driver = Some(driver);
            let driver_ready = |c: &Cluster| c.foreign.driver.as_ref().is_some_and(|d| d.ready);
            self.wait_for(rx, tx, driver_ready, &|_| StartError::DriverNotReady {
                program: foreign.program.clone(),
                secs: START_TIMEOUT.as_secs(),
            })?;
        }
        if self.config.forge_messages {
            let plan = self.forger_plan()?;
            let forger = super::forger::Forger::start(&self.config.exe, &plan, tx.clone());
            self.forger = Some(forger.map_err(StartError::Spawn)?);
        }
        Ok(())
    }

    /// What the forger needs to know, as one sniffing the deployment's traffic would: every
    /// prefill notify listener, and every decode rank's sender key.
    fn forger_plan(&self) -> Result<super::forger::ForgerPlan, StartError> {
        use std::net::ToSocketAddrs as _;
        let mut plan = super::forger::ForgerPlan { targets: Vec::new(), senders: Vec::new() };
        for (engine, address) in &self.addresses {
            let layout = self.d.layout(*engine);
            match engine.role {
                Role::Prefill => {
                    for i in 0..layout.ranks() as u16 {
                        let port = address.notify_port_base + i;
                        let target = (address.host.as_str(), port)
                            .to_socket_addrs()
                            .ok()
                            .and_then(|mut a| a.next())
                            .ok_or_else(|| StartError::ForgerTarget { host: address.host.clone(), port })?;
                        plan.targets.push(target);
                    }
                }
                Role::Decode => {
                    for rank in self.d.ranks(Role::Decode).into_iter().filter(|r| r.engine == *engine) {
                        let sender = pdkv_core::release::ReleaseSender {
                            engine_id: address.engine_id(),
                            dp_rank: rank.dp,
                            tp_rank: rank.tp,
                        };
                        plan.senders.push((sender, layout.tp));
                    }
                }
            }
        }
        Ok(plan)
    }

    /// Handles events until `ready` holds, a stop is requested (Ok: the main loop ends at once
    /// and the result says interrupted), an event ends the start, or [`START_TIMEOUT`] passes
    /// (the error is `late`'s).
    fn wait_for(
        &mut self,
        rx: &Receiver<Ev>,
        tx: &Sender<Ev>,
        ready: fn(&Cluster) -> bool,
        late: &dyn Fn(&Cluster) -> StartError,
    ) -> Result<(), StartError> {
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        while !ready(self) {
            if self.stop_requested() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left.min(POLL)) {
                Ok(ev) => {
                    if let Some(error) = self.on_event(ev, tx) {
                        return Err(error);
                    }
                }
                Err(RecvTimeoutError::Timeout) if !left.is_zero() => {}
                Err(_) => return Err(late(self)),
            }
            // A process that died before it joined never closes a connection the scheduler
            // would see: its exit says so at once, instead of the start timeout much later.
            if let Some(rank) = self.procs.exited_before_joining() {
                return Err(StartError::ExitedBeforeReady(rank));
            }
        }
        Ok(())
    }

    /// The acceptor refused a connector ([`Admission`]): counted and reported.
    pub(super) fn refused(&mut self, rank: RankId, pid: u32, reason: &AdmitError) {
        self.procs.processes.refused += 1;
        let line = format!("refused a connector that claimed to be {rank} (process {pid}): {reason}");
        self.tally.problem_of(Severity::Lost, line);
    }

    /// Handles one event; returns a start-up error when a rank cannot start.
    pub(super) fn on_event(&mut self, ev: Ev, tx: &Sender<Ev>) -> Option<StartError> {
        match ev {
            Ev::Joined { rank, stream } => {
                let proc = self.procs.ranks.get_mut(&rank)?;
                let life = proc.life;
                let reader = stream.try_clone().ok()?;
                proc.writer = Some(stream);
                let tx = tx.clone();
                thread::spawn(move || {
                    let mut reader = BufReader::new(reader);
                    while let Ok(msg) = read_frame::<FromRank>(&mut reader) {
                        if tx.send(Ev::Msg { rank, life, msg }).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Ev::Gone { rank, life });
                });
                let setup = self.setup_for(rank, life);
                self.procs.send(rank, &ToRank::Setup(Box::new(setup)));
            }
            Ev::Refused { rank, pid, reason } => self.refused(rank, pid, &reason),
            Ev::Driver(event) => return self.on_driver(event),
            Ev::Forger(event) => {
                if let Some(forger) = self.forger.as_mut() {
                    forger.on_event(event);
                }
            }
            Ev::Msg { rank, life, msg } => {
                let proc = self.procs.ranks.get_mut(&rank).filter(|p| p.life == life)?;
                proc.last_heard = std::time::Instant::now();
                return self.on_message(rank, msg);
            }
            Ev::Gone { rank, life } => {
                let proc = self.procs.ranks.get_mut(&rank)?;
                // A rank already counted as lost (killed by a fault, or for its silence) is
                // not lost twice.
                if proc.life != life || !proc.alive {
                    return None;
                }
                let expected = proc.said_bye || proc.killed_by_fault;
                let ready = proc.ready;
                proc.alive = false;
                proc.writer = None;
                if !expected {
                    self.tally.problem_of(Severity::Lost, format!("{rank} disconnected unexpectedly"));
                }
                // Lost even when it never became ready (a restart that failed), so that its
                // group's queue fails instead of waiting for it.
                self.rank_lost(rank);
                if !expected && !ready {
                    return Some(StartError::ExitedBeforeReady(rank));
                }
            }
        }
        None
    }

    /// Whether `rank` is gone and will not come back (a restart brings back only the rank a
    /// fault killed with `restart_after_ms`).
    pub(super) fn gone_for_good(&self, rank: RankId) -> bool {
        let restarting = self.faults.restart_at.is_some_and(|(_, r)| r == rank);
        self.procs.ranks.get(&rank).is_some_and(|p| !p.alive) && !restarting
    }

    /// The first rank of a DP group that is gone for good, if any.
    pub(super) fn gone_rank_of_group(&self, engine: EngineId, dp: u16) -> Option<RankId> {
        let tp = self.d.layout(engine).tp;
        (0..tp).map(|tp| RankId::new(engine, dp, tp)).find(|&r| self.gone_for_good(r))
    }

    /// A rank is gone. A prefill rank that comes back (a restart is due) is waited for by
    /// nobody: prefills waiting for its acknowledgement go on without it. A rank gone for good
    /// takes its DP group with it, as a dead worker takes its engine in vLLM: the group's
    /// requests that have not reached decode fail now instead of at the decode side's
    /// timeouts, and so do the requests of a decode group that lost a rank, since its TP group
    /// can never vote or step again.
    pub(super) fn rank_lost(&mut self, rank: RankId) {
        if rank.engine.role == Role::Prefill && self.gone_for_good(rank) {
            // Its memory died with it and it will not come back: on the transfers it holds (and
            // any registered later) its part counts as done, so its group's blocks are freed
            // once the live ranks are released instead of at the reaper. The engine decides;
            // the driver only reports the loss. A rank that will restart is not reported: its
            // new life could reuse the freed block ids while a reader still reads the old
            // transfer from it, so its old transfers wait for the reaper, fenced meanwhile.
            self.engine(usize::from(rank.engine.index), EngineEvent::WorkerLost { rank });
        }
        let waiting: Vec<RequestId> = self
            .clients
            .requests
            .iter()
            .filter(|(_, r)| r.acks_needed.contains(&rank))
            .map(|(&id, _)| id)
            .collect();
        if !self.gone_for_good(rank) {
            for id in waiting {
                self.prefill_acked(id, rank);
            }
            return;
        }
        let error = format!("{rank} is gone");
        match rank.engine.role {
            Role::Prefill => {
                // Not registered yet: the scheduler still owns their blocks.
                for id in waiting {
                    let req = &self.clients.requests[&id];
                    let ((e, dp), transfer_id, blocks) =
                        (req.prefill, req.transfer_id.clone(), req.prefill_blocks.clone());
                    self.free_prefill_blocks(e, dp, &transfer_id, &blocks);
                    self.end(id, Some(vec![error.clone()]));
                }
                self.pump_prefill(rank.engine, rank.dp);
            }
            Role::Decode => {
                // Its group's transfers are reaped (fenced first) once their read leases end,
                // not at the reaper's full delay: its releases will never come. The engines
                // decide; the driver only reports the loss.
                for e in 0..self.prefill.engines.len() {
                    self.engine(e, EngineEvent::ReaderLost { rank });
                }
                let g = self.decode.group_of(rank);
                // The group decides what a dead member means (it votes no on the step it left
                // open, so the live ranks fail the step's requests at once and release their
                // transfers, and no later step begins); the driver only reports the loss.
                self.group_event(g, GroupEvent::MemberLost { member: rank.tp_rank() });
                self.decode.groups[g].next_step = None;
                let mut out = Vec::new();
                let lost = self.decode.groups[g].sched.drain(&mut out);
                self.sched_outputs(g, out);
                for id in lost {
                    self.end(id, Some(vec![error.clone()]));
                }
            }
        }
    }

    /// Whether [`ClusterConfig::stop`] asks the run to stop; notes the signal once.
    pub(super) fn stop_requested(&mut self) -> bool {
        if self.procs.interrupted.is_some() {
            return true;
        }
        let Some(flag) = self.config.stop else { return false };
        let signal = flag.load(Ordering::SeqCst);
        if signal == 0 {
            return false;
        }
        self.procs.interrupted = Some(signal);
        if std::ptr::eq(flag, &crate::signals::CAUGHT) {
            // A second Ctrl-C during the orderly stop ends the process at once.
            crate::signals::restore();
        }
        true
    }

    /// How long a rank may stay silent while the scheduler runs.
    pub(super) fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.config.heartbeat_timeout_ms)
    }

    /// The scheduler's own loop did not run for `gap` (the process was stopped, or starved of
    /// CPU): the ranks' heartbeats and the driver's reads waited unread meanwhile, so every
    /// window starts afresh instead of blaming them, the engines' reapers wait
    /// [`super::STALL_GRACE`] so that what the ranks sent meanwhile is read before anything is
    /// reaped, and the requests in flight are exposed to the stall. A rank is lost only for
    /// silence while the scheduler itself was awake.
    pub(super) fn scheduler_stalled(&mut self, gap: Duration) {
        let now = std::time::Instant::now();
        for proc in self.procs.ranks.values_mut() {
            proc.last_heard = now;
        }
        if let Some(driver) = self.foreign.driver.as_mut() {
            driver.fresh_window();
        }
        self.prefill.reapers_wait_until = Some(now + super::STALL_GRACE);
        // The ranks' own timers (a decode rank's transfer timeout) ran while their engine's
        // scheduler did not: a request in flight may fail for the scheduler's stall, which is
        // then excused as an injected fault's would be.
        for req in self.clients.requests.values_mut() {
            req.exposed = true;
            self.faults.expose(req.transfer_id.clone());
        }
        self.tally.record_stall(gap, self.clients.requests.len() as u64);
    }

    /// Ranks that said nothing, not even a heartbeat, for the heartbeat timeout while the
    /// scheduler ran: stopped or hung processes, whose connection stays open. Each is killed and
    /// lost like a dead one.
    pub(super) fn check_heartbeats(&mut self) {
        let timeout = self.heartbeat_timeout();
        let silent: Vec<RankId> = self
            .procs
            .ranks
            .iter()
            .filter(|(_, p)| p.alive && p.ready && p.last_heard.elapsed() > timeout)
            .map(|(&r, _)| r)
            .collect();
        for rank in silent {
            let proc = self.procs.ranks.get_mut(&rank).expect("listed above");
            if let Some(child) = proc.child.as_mut() {
                let _ = child.kill();
            }
            proc.alive = false;
            proc.writer = None;
            let secs = timeout.as_secs_f64();
            self.tally.problem_of(
                Severity::Lost,
                format!("{rank} stopped answering (nothing for {secs} s, not even a heartbeat); killed it"),
            );
            self.rank_lost(rank);
        }
    }

    /// How long the foreign driver may leave its input unread: twice the heartbeat timeout.
    pub(super) fn driver_drain_timeout(&self) -> Duration {
        2 * self.heartbeat_timeout()
    }

    /// A driver that stopped reading its input has failed. During the run that ends it
    /// (outcome hang, naming the driver); at shutdown (`running` false) it is no longer waited
    /// for, and [`Driver::finish`] says it was killed.
    pub(super) fn check_driver(&mut self, running: bool) {
        // At shutdown a driver that reads takes its `shutdown` at once; one whose queued input
        // (beyond what the pipe holds) waits unread longer than SHUTDOWN_READ is not reading,
        // and is not waited for.
        let limit = if running {
            self.driver_drain_timeout()
        } else {
            SHUTDOWN_READ.min(self.driver_drain_timeout())
        };
        let Some(driver) = self.foreign.driver.as_mut() else { return };
        if let Some(why) = driver.check_drained(limit) {
            if running {
                self.hung.get_or_insert(why);
            }
        }
    }

    /// Ends the forger before the ranks shut down: its input closes, it sends what it was
    /// given, and what the ranks refused meanwhile is still counted; one still busy after
    /// [`FORGER_EXIT`] is killed with its process group.
    pub(super) fn stop_forger(&mut self, rx: &Receiver<Ev>, tx: &Sender<Ev>) {
        let Some(forger) = self.forger.as_mut() else { return };
        forger.close_input();
        let deadline = std::time::Instant::now() + FORGER_EXIT;
        while self.forger.as_ref().is_some_and(|f| !f.closed) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match rx.recv_timeout(left.min(POLL)) {
                Ok(ev) => {
                    if let Some(error) = self.on_event(ev, tx) {
                        self.tally.problem(error.to_string());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if let Some(forger) = self.forger.as_mut() {
            forger.finish();
        }
    }

    /// Tells every live rank and the driver to shut down, waits for each to exit, and kills
    /// stragglers: every process is given the same deadline, so one that outstays it (the
    /// driver, say) costs the others nothing.
    pub(super) fn shutdown(&mut self, rx: &Receiver<Ev>) {
        let live: Vec<RankId> = self.procs.ranks.iter().filter(|(_, p)| p.alive).map(|(&r, _)| r).collect();
        for &rank in &live {
            self.procs.send(rank, &ToRank::Shutdown);
        }
        let deadline = std::time::Instant::now() + EXIT_TIMEOUT;
        // A driver that failed gets no goodbye to give: it is killed below.
        if self.foreign.driver.as_ref().is_some_and(|d| d.failed.is_none()) {
            self.foreign.tell(&ToDriver::Shutdown);
        }
        // Collect goodbyes (and anything else still in flight) until every live rank left.
        // A signal asks for the run to end now: a driver that has not said bye and exited
        // within SIGNALLED_BYE is killed rather than waited for. (Its input pipe may hold the unread
        // `shutdown` of a driver that stopped reading, which the queue cannot see.)
        let bye_deadline = if self.procs.interrupted.is_some() {
            std::time::Instant::now() + SIGNALLED_BYE
        } else {
            deadline
        };
        let driver_owes_bye = |c: &Cluster| {
            std::time::Instant::now() < bye_deadline
                && c.foreign
                    .driver
                    .as_ref()
                    .is_some_and(|d| d.ready && !d.said_bye && !d.closed && d.failed.is_none())
        };
        while self.procs.ranks.values().any(|p| p.alive && p.writer.is_some() && !p.said_bye)
            || driver_owes_bye(self)
        {
            // A driver that stopped reading will not read its `shutdown` either.
            self.check_driver(false);
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match rx.recv_timeout(left.min(POLL)) {
                Ok(Ev::Msg { rank, life, msg: FromRank::Bye { .. } }) => {
                    if let Some(p) = self.procs.ranks.get_mut(&rank).filter(|p| p.life == life) {
                        p.said_bye = true;
                    }
                }
                Ok(Ev::Gone { rank, life }) => {
                    if let Some(p) = self.procs.ranks.get_mut(&rank).filter(|p| p.life == life) {
                        p.alive = false;
                    }
                }
                Ok(Ev::Refused { rank, pid, reason }) => self.refused(rank, pid, &reason),
                Ok(Ev::Driver(event)) => {
                    if let Some(error) = self.on_driver(event) {
                        self.tally.problem_of(Severity::Fatal, error.to_string());
                    }
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if let Some(driver) = self.foreign.driver.as_mut() {
            // Its input ends: a driver reading it sees the end, as after its `shutdown`.
            driver.close_input();
        }
        // Wait for every process at once, looking at each at least once, until the deadline.
        let mut statuses: BTreeMap<RankId, std::process::ExitStatus> = BTreeMap::new();
        let mut driver_exit = None;
        loop {
            for (&rank, proc) in self.procs.ranks.iter_mut() {
                let Some(child) = proc.child.as_mut().filter(|_| !proc.killed_by_fault) else { continue };
                if statuses.contains_key(&rank) {
                    continue;
                }
                if let Ok(Some(status)) = child.try_wait() {
                    statuses.insert(rank, status);
                }
            }
            if driver_exit.is_none() {
                driver_exit = self.foreign.driver.as_mut().and_then(Driver::exited);
            }
            let ranks_done = self
                .procs
                .ranks
                .iter()
                .all(|(rank, p)| p.child.is_none() || p.killed_by_fault || statuses.contains_key(rank));
            let driver_done = self.foreign.driver.as_ref().is_none_or(|d| d.failed.is_some())
                || driver_exit.is_some()
                || std::time::Instant::now() >= bye_deadline;
            if (ranks_done && driver_done) || std::time::Instant::now() >= deadline {
                break;
            }
            thread::sleep(Duration::from_millis(5));
        }
        if let Some(mut driver) = self.foreign.driver.take() {
            for problem in driver.finish(driver_exit) {
                self.tally.problem_of(Severity::Fatal, problem);
            }
            self.foreign.report.killed = driver.killed.clone();
        }
        for (rank, proc) in self.procs.ranks.iter_mut() {
            let Some(mut child) = proc.child.take() else { continue };
            if proc.killed_by_fault {
                continue;
            }
            match statuses.get(rank) {
                Some(s) if s.success() => self.procs.processes.exited_cleanly += 1,
                Some(_) => self.procs.processes.failed += 1,
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    self.procs.processes.killed_at_shutdown += 1;
                }
            }
        }
    }
}
