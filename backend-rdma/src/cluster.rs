//! `pdkv cluster`: one real connector process per rank on one host, plus the proxy and each
//! engine's scheduler in this process, pushing requests through the real protocol and checking
//! every byte decode reads.
//!
//! This process plays the parts vLLM keeps outside its workers: the proxy (the core's
//! [`Proxy`]), each prefill engine's scheduler with its block pool and the engine node
//! ([`PrefillEngine`]: registration quorums, frees, the reaper), and each decode DP group's
//! scheduler (steps, the forward pass, and the TP group's barrier: the core's [`DecodeGroup`]
//! takes the MIN vote). The ranks run the worker nodes
//! behind real listeners and a real data plane. Nothing here computes a rank, a port or a quorum
//! either: the proxy routes, the engine registers, the workers decide whom to read.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use pdkv_core::group::{DecodeGroup, GroupAction, GroupEvent, Ignored, StepReport};
use pdkv_core::ids::{EngineId, RankId, RequestId, Role, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::params::KvTransferParams;
use pdkv_core::policy::Policy;
use pdkv_core::ports::EngineAddress;
use pdkv_core::prefill::{EngineAction, EngineEvent, PrefillEngine};
use pdkv_core::proxy::{Proxy, ProxyAction};
use pdkv_core::time::Instant;
use pdkv_core::topology::{Deployment, Layout, ModelSpec};
use serde::Serialize;

use crate::connector::Clock;
use crate::sched::{
    read_frame, read_frame_within, write_frame, FromRank, Recv, Setup, ToRank, TransportKind,
    MAX_HELLO_BYTES, TOKEN_ENV,
};

const NS_PER_MS: u64 = 1_000_000;
/// Decode blocks per decode DP group (the KV lands there; only ids are tracked here).
const DECODE_BLOCKS: u32 = 1 << 16;
/// Requests a decode DP group runs at once.
const MAX_BATCH: usize = 64;
/// How long a decode group with nothing to compute waits before its next step, so queued
/// requests get redialled without spinning.
const IDLE_STEP: Duration = Duration::from_millis(2);
/// How long ranks get to start, join and bind.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long ranks get to say goodbye and exit after shutdown.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the loop looks at [`ClusterConfig::stop`] and at the ranks' heartbeats.
const POLL: Duration = Duration::from_millis(50);
/// How long a rank may say nothing (not even its heartbeat, every
/// [`crate::sched::HEARTBEAT_INTERVAL`]) before it counts as lost: a stopped process keeps its
/// connection open, so only silence shows it.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// Most failed requests listed in the result: a run whose decode group died can fail a
/// million requests, and a listing of each would make a result of hundreds of megabytes.
pub const MAX_FAILURES_LISTED: usize = 1000;
/// Most problem lines kept for the report.
const MAX_PROBLEMS: usize = 64;

/// A fault to inject into a cluster run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Kill (SIGKILL) a prefill rank's process once `after` requests have been prefilled, so
    /// transfers are in flight; restart it `restart_after_ms` later if given.
    KillPrefill {
        /// The rank.
        rank: RankId,
        /// Prefilled requests before the kill.
        after: u32,
        /// When to start it again, if at all.
        restart_after_ms: Option<u64>,
    },
    /// A decode rank drops its first `count` releases instead of sending them.
    DropReleases {
        /// The decode rank.
        rank: RankId,
        /// How many.
        count: u32,
    },
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Deployment notation, e.g. `1P_TP4:1D_TP8`.
    pub deployment: String,
    /// Requests to push through.
    pub requests: u32,
    /// Requests in flight at once (closed loop).
    pub concurrency: u32,
    /// The data plane.
    pub transport: TransportKind,
    /// MLA model (flexible reads) instead of a GQA model.
    pub mla: bool,
    /// Transformer layers of the model.
    pub layers: u16,
    /// Legacy behaviours.
    pub legacy: LegacyOptions,
    /// The `pdkv` executable that runs `connector`.
    pub exe: PathBuf,
    /// Host every engine listens on.
    pub host: String,
    /// Seed of prompt lengths and transfer ids.
    pub seed: u64,
    /// Blocks per prefill rank.
    pub num_blocks: u32,
    /// Decode handshake timeout.
    pub handshake_timeout_ms: u64,
    /// Decode transfer timeout (also the read lease).
    pub transfer_timeout_ms: u64,
    /// The prefill engines' reaper (`defer_timeout`).
    pub defer_timeout_ms: u64,
    /// The run's limit: past it, what is unfinished counts as hung.
    pub timeout_ms: u64,
    /// Faults to inject.
    pub faults: Vec<Fault>,
    /// Where to look for a stop request: a signal number (nonzero) stops the run in order,
    /// with a partial result whose outcome is `interrupted` ([`crate::signals::CAUGHT`] for the
    /// command line).
    pub stop: Option<&'static AtomicI32>,
}

/// Most requests one run sends (each keeps a few hundred bytes of bookkeeping).
pub const MAX_REQUESTS: u32 = 1_000_000;
/// Most requests in flight at once: far more than the prefill pools and decode batches hold,
/// so the rest queue in the schedulers, as they would in vLLM.
pub const MAX_CONCURRENCY: u32 = 4096;
/// Most layers a cluster's model has (DeepSeek-R1 has 61): every prefill rank keeps
/// `num_blocks` blocks of every layer in memory, which is 300 MB per rank for MLA at 64.
pub const MAX_LAYERS: u16 = 64;
/// Most ranks (processes) one cluster starts on this host.
pub const MAX_CLUSTER_RANKS: usize = 128;
/// Shortest timeout accepted: less fails every request on a loaded host before its KV can
/// move, which tests nothing.
pub const MIN_TIMEOUT_MS: u64 = 100;
/// Longest timeout or delay accepted (a day); longer ones overflow the clocks' arithmetic.
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;

impl ClusterConfig {
    /// Checks what the command line can get wrong before any process starts; the error names
    /// the flag. `d` is the parsed deployment.
    pub fn validate(&self, d: &Deployment) -> Result<(), String> {
        let count = |flag: &str, value: u32, max: u32| {
            if (1..=max).contains(&value) {
                Ok(())
            } else {
                Err(format!("{flag} {value}: must be between 1 and {max}"))
            }
        };
        count("--requests", self.requests, MAX_REQUESTS)?;
        count("--concurrency", self.concurrency, MAX_CONCURRENCY)?;
        count("--layers", u32::from(self.layers), u32::from(MAX_LAYERS))?;
        let timeouts = [
            ("--handshake-timeout-ms", self.handshake_timeout_ms),
            ("--transfer-timeout-ms", self.transfer_timeout_ms),
            ("--defer-timeout-ms", self.defer_timeout_ms),
            ("--timeout-ms", self.timeout_ms),
        ];
        for (flag, ms) in timeouts {
            if !(MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&ms) {
                return Err(format!("{flag} {ms}: must be between {MIN_TIMEOUT_MS} and {MAX_TIMEOUT_MS}"));
            }
        }
        let ranks = d.ranks(Role::Prefill).len() + d.ranks(Role::Decode).len();
        if ranks > MAX_CLUSTER_RANKS {
            return Err(format!(
                "{}: {ranks} ranks, but a cluster on one host starts at most {MAX_CLUSTER_RANKS} processes",
                self.deployment
            ));
        }
        if self.transport == TransportKind::Rdma && !cfg!(feature = "rdma") {
            return Err("--transport rdma: this pdkv was built without the rdma feature (cargo build \
                        --features rdma)"
                .into());
        }
        for fault in &self.faults {
            match *fault {
                Fault::KillPrefill { rank, after, restart_after_ms } => {
                    if rank.engine.role != Role::Prefill || !d.ranks(Role::Prefill).contains(&rank) {
                        return Err(format!("--kill {rank}: {} has no prefill rank {rank}", self.deployment));
                    }
                    if after >= self.requests {
                        return Err(format!(
                            "--kill-after {after}: the run prefills only {} requests, so the kill would \
                             come after the last one (use 0 to {})",
                            self.requests,
                            self.requests - 1
                        ));
                    }
                    if let Some(ms) = restart_after_ms.filter(|&ms| ms > MAX_TIMEOUT_MS) {
                        return Err(format!("--restart-after-ms {ms}: must be at most {MAX_TIMEOUT_MS}"));
                    }
                }
                Fault::DropReleases { rank, count } => {
                    if rank.engine.role != Role::Decode || !d.ranks(Role::Decode).contains(&rank) {
                        return Err(format!(
                            "--drop-releases {rank}={count}: {} has no decode rank {rank}",
                            self.deployment
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Defaults for a loopback run: 8 requests in flight, 4 layers, 512 blocks per prefill rank,
    /// a 10 s handshake timeout and MoRIIO's transfer and reaper timeouts.
    pub fn new(deployment: &str, requests: u32, exe: PathBuf) -> ClusterConfig {
        ClusterConfig {
            deployment: deployment.to_owned(),
            requests,
            concurrency: 8,
            transport: TransportKind::Tcp,
            mla: false,
            layers: 4,
            legacy: LegacyOptions::none(),
            exe,
            host: "127.0.0.1".into(),
            seed: 0,
            num_blocks: 512,
            // The core's defaults (docs/reference.md says which are MoRIIO's): a fault-free run
            // never waits for them, and a loaded machine (CI) must not turn a slow read into a
            // failure.
            handshake_timeout_ms: 10_000,
            transfer_timeout_ms: 30_000,
            defer_timeout_ms: 60_000,
            timeout_ms: 120_000,
            faults: Vec::new(),
            stop: None,
        }
    }

    /// The model the ranks serve: DeepSeek-R1's MLA row (576 bytes per token per layer), or a
    /// GQA model with 64-wide heads, as many KV heads as the smallest TP of the deployment (at
    /// most 8) so that heterogeneous TP finds its heads replicated, as the routing rules require;
    /// 1 byte per value, `layers` layers, 16-token blocks.
    pub fn model(&self, deployment: &Deployment) -> ModelSpec {
        if self.mla {
            return ModelSpec {
                use_mla: true,
                kv_heads: 1,
                layers: self.layers,
                bytes_per_token_per_layer: 576,
                block_size_tokens: 16,
            };
        }
        let tps = deployment.prefill.iter().chain(&deployment.decode).map(|l| l.tp);
        let kv_heads = tps.min().unwrap_or(1).clamp(1, 8);
        ModelSpec {
            use_mla: false,
            kv_heads,
            layers: self.layers,
            bytes_per_token_per_layer: 2 * u32::from(kv_heads) * 64,
            block_size_tokens: 16,
        }
    }
}

/// Why a cluster could not run at all (a run that ran reports its problems in the result).
#[derive(Debug)]
pub enum ClusterError {
    /// The configuration is unusable.
    Config(String),
    /// Ranks could not be started or did not join.
    Start(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::Config(e) => write!(f, "invalid cluster: {e}"),
            ClusterError::Start(e) => write!(f, "cluster did not start: {e}"),
        }
    }
}

impl std::error::Error for ClusterError {}

/// Requests by how they ended (the simulator's names).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Requests {
    /// Sent by the client.
    pub sent: u64,
    /// Produced all their tokens.
    pub finished: u64,
    /// Ended with an error.
    pub failed: u64,
    /// Of those, failed after an injected fault they were exposed to (docs/backend.md says
    /// exactly when): the fault's designed effect, not a failure of the run.
    pub failed_excused: u64,
    /// Still in flight at the end.
    pub unfinished: u64,
}

/// Throughput over the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Throughput {
    /// Prompt plus generated tokens of finished requests per second.
    pub total_tok_s: f64,
    /// Generated tokens per second.
    pub output_tok_s: f64,
    /// Finished requests per second.
    pub requests_per_s: f64,
    /// Verified KV bytes per second.
    pub kv_bytes_per_s: f64,
}

/// Mean and percentiles of one latency, in milliseconds (the simulator's `Summary`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Summary {
    fn of(values: &[f64]) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        let at = |q: f64| round(sorted[((sorted.len() - 1) as f64 * q).round() as usize]);
        Summary { mean: round(sorted.iter().sum::<f64>() / sorted.len() as f64), p50: at(0.5), p99: at(0.99) }
    }
}

/// Wall-clock latencies of finished requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Latencies {
    /// From the client's request to the first decode step that included it.
    pub ttft: Summary,
    /// From the client's request to its last token.
    pub e2e: Summary,
}

/// Reads and bytes per prefill GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Nic {
    /// Prefill GPUs in rank order.
    pub prefill_gpus: Vec<String>,
    /// Reads each served (one per decode worker per request).
    pub reads_per_prefill_gpu: Vec<u64>,
    /// Bytes each sent (verified on arrival).
    pub bytes_per_prefill_gpu: Vec<u64>,
    /// Jain's index of the reads.
    pub jain: f64,
    /// Jain's index of the bytes.
    pub jain_bytes: f64,
}

/// The prefill block ledger over all engines.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Ledger {
    /// Transfers still held at the end.
    pub held: u64,
    /// Freed after their releases.
    pub freed: u64,
    /// Freed by the reaper.
    pub reaped: u64,
    /// Of those, reaped after an injected fault (the designed recovery, not a leak).
    pub reaped_excused: u64,
    /// Transfers fenced before reaping.
    pub fenced: u64,
    /// Frees of a block the transfer did not hold (must be 0).
    pub double_frees: u64,
}

/// A request that failed, with each decode worker's error.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    /// The request.
    pub request: u64,
    /// Its transfer id.
    pub transfer_id: String,
    /// The prefill engine and DP rank that held its KV.
    pub prefill: String,
    /// `rank: error` for every worker that failed it.
    pub errors: Vec<String>,
}

/// A safety violation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Violation {
    /// `read_mismatch`, `double_free`, `protocol_error`.
    pub kind: String,
    /// What exactly.
    pub detail: String,
}

/// Processes and how they ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Processes {
    /// Connector processes started (restarts included).
    pub started: u64,
    /// Exited with status 0 after shutdown.
    pub exited_cleanly: u64,
    /// Killed by an injected fault.
    pub killed_by_fault: u64,
    /// Killed because they did not exit in time after shutdown (must be 0).
    pub killed_at_shutdown: u64,
    /// Exited with an error status.
    pub failed: u64,
    /// Connectors refused at join: not started by this run (no or a wrong token), or claiming
    /// the id of a rank that is running. Not counted in `started`.
    pub refused: u64,
}

/// What a cluster run measured, in the simulator's result schema where it applies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterResult {
    /// The deployment.
    pub deployment: String,
    /// The data plane.
    pub transport: String,
    /// The model's attention and layers.
    pub model: String,
    /// Seed of lengths and ids.
    pub seed: u64,
    /// `clean`, `leak`, `hang` or `safety_violation`, as in the simulator.
    pub outcome: String,
    /// Wall time of the run, in seconds.
    pub duration_s: f64,
    /// Requests by outcome.
    pub requests: Requests,
    /// Throughput.
    pub throughput: Throughput,
    /// Latencies, in milliseconds.
    pub latency_ms: Latencies,
    /// NIC balance over prefill GPUs.
    pub nic: Nic,
    /// Prefill blocks.
    pub ledger: Ledger,
    /// KV bytes decode read and verified against the pattern prefill wrote.
    pub bytes_verified: u64,
    /// KV bytes of the finished requests' prompts: whole blocks, every layer, every KV head
    /// once. Decode reads each head once per decode rank that needs it, so a fault-free run
    /// verifies this times the deployment's replication (1 when no head is read twice).
    pub prompt_kv_bytes: u64,
    /// Where the prefill ranks kept their KV (host memory, or a HIP device), and why.
    pub memory: Vec<String>,
    /// Failed requests, the first [`MAX_FAILURES_LISTED`] (`requests.failed` counts them all).
    pub failures: Vec<Failure>,
    /// Safety violations.
    pub violations: Vec<Violation>,
    /// Faults injected, with when.
    pub faults: Vec<String>,
    /// Connector processes.
    pub processes: Processes,
    /// Every handshake and notify port the ranks listened on (free again once the run ended).
    pub listener_ports: Vec<u16>,
    /// Notes from the ranks (lost notify messages, reap warnings), each once with its count, at
    /// most 64 different ones.
    pub problems: Vec<String>,
}

impl ClusterResult {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("results serialise")
    }
}

/// Progress for a bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Requests ended.
    pub done: u64,
    /// Requests in all.
    pub total: u64,
}

/// How a run ended, by the simulator's rules plus two of the cluster's own: a violation trumps
/// an interruption (a signal stopped the run, so the rest is partial), which trumps a hang; a
/// hang trumps failed requests, failed requests trump a leak. Requests that failed and transfers
/// the reaper freed after an injected fault they were exposed to are the fault's designed
/// effect and recovery, not a failure of the run; any other failed request is.
fn outcome(
    violated: bool,
    interrupted: bool,
    hung: bool,
    incomplete: bool,
    requests: &Requests,
    ledger: &Ledger,
) -> &'static str {
    if violated {
        "safety_violation"
    } else if interrupted {
        "interrupted"
    } else if hung {
        "hang"
    } else if requests.failed > requests.failed_excused {
        "failed_requests"
    } else if incomplete {
        // The budget ended while requests were still finishing: transfers in flight are held,
        // which is not a leak.
        "incomplete"
    } else if ledger.held > 0 || ledger.reaped > ledger.reaped_excused {
        "leak"
    } else {
        "clean"
    }
}

/// Jain's index as the simulator reports it (the core's, to three decimals).
fn jain(values: &[u64]) -> f64 {
    (pdkv_core::routes::jain_index(values) * 1000.0).round() / 1000.0
}

/// A deterministic stream for lengths and ids (SplitMix64).
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next() % u64::from(hi - lo + 1)) as u32
    }
}

// ------------------------------------------------------------------------------ processes

enum Ev {
    Joined { rank: RankId, stream: TcpStream },
    Refused { rank: RankId, pid: u32, reason: String },
    Msg { rank: RankId, incarnation: u32, msg: FromRank },
    Gone { rank: RankId, incarnation: u32 },
}

struct RankProc {
    child: Option<Child>,
    writer: Option<TcpStream>,
    incarnation: u32,
    alive: bool,
    ready: bool,
    data_addr: Option<String>,
    said_bye: bool,
    killed_by_fault: bool,
    /// When the scheduler last heard from the process.
    last_heard: std::time::Instant,
}

/// Who may join a run: a process this run started, once, holding the run's token. A stray
/// `pdkv connector` (another run's, a user's, a second one with the id of a live rank) would
/// otherwise take the rank's place: the scheduler would talk to it and the rank it displaced
/// would hang, or serve another incarnation's bytes.
#[derive(Default)]
struct Admission {
    /// The run's random token, handed to its processes in [`TOKEN_ENV`].
    token: String,
    /// The process this run started for each rank (its latest incarnation).
    expected: BTreeMap<RankId, u32>,
    /// Processes admitted so far: each joins once.
    admitted: BTreeSet<u32>,
}

impl Admission {
    /// Admits `pid` as `rank` or says why not.
    fn admit(&mut self, rank: RankId, pid: u32, token: &str) -> Result<(), String> {
        if token.is_empty() {
            return Err(format!("no membership token (the run hands it out in {TOKEN_ENV})"));
        }
        if token != self.token {
            return Err("wrong membership token: not a process of this run".into());
        }
        match self.expected.get(&rank) {
            None => Err(format!("this run has no rank {rank}")),
            Some(&running) if running != pid => {
                Err(format!("{rank} is already running as process {running}; process {pid} is not it"))
            }
            Some(_) if !self.admitted.insert(pid) => {
                Err(format!("{rank} (process {pid}) has joined already"))
            }
            Some(_) => Ok(()),
        }
    }
}

/// A new random token for a run's membership (16 bytes of the system's randomness, in hex).
fn new_token() -> Result<String, String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| format!("membership token: /dev/urandom: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Accepts connector connections, admits each one's `Hello` ([`Admission`]) and hands admitted
/// ones to the main loop. Refusing here, not in the main loop, answers a stray connector even
/// while the main loop is busy.
struct Acceptor {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Acceptor {
    fn start(
        listener: TcpListener,
        tx: Sender<Ev>,
        admission: Arc<Mutex<Admission>>,
    ) -> Result<Acceptor, String> {
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
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

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocked accept; it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Finds `count` consecutive ports on `host` that can be bound now.
fn free_ports(host: &str, count: u16) -> Result<u16, String> {
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
    Err(format!("no {count} consecutive free ports on {host}"))
}

/// Where to look for listener ports, `lo..=hi`: outside the system's ephemeral range (Linux's
/// `ip_local_port_range`, 32768-60999 by default), since every outgoing connection (a data-plane
/// read, a release, another cluster's) takes a port from it, and one could take a rank's port
/// between the probe and the rank's bind. Below it when there is room, else above it.
fn probe_window(ephemeral: Option<(u16, u16)>, count: u16) -> (u16, u16) {
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

// ------------------------------------------------------------------------------ scheduling

struct Req {
    transfer_id: TransferId,
    input: u32,
    output: u32,
    prefill: (usize, u16),
    decode: (usize, u16),
    prefill_blocks: Vec<u32>,
    local_blocks: Vec<u32>,
    acks_needed: BTreeSet<RankId>,
    started: std::time::Instant,
    first_token: Option<std::time::Instant>,
    /// An injected fault may cause its failure (see [`Cluster::expose_group`]).
    exposed: bool,
}

struct PGroup {
    engine: usize,
    dp: u16,
    free: BTreeSet<u32>,
    owner: BTreeMap<u32, TransferId>,
    queue: VecDeque<RequestId>,
}

struct Pending {
    reported: BTreeSet<u16>,
    errors: Vec<String>,
}

struct DGroup {
    engine: usize,
    dp: u16,
    tp: u16,
    /// The TP group's barrier: which step it is on, the MIN vote, who entered the forward.
    barrier: DecodeGroup,
    waiting: VecDeque<Recv>,
    running: Vec<(RequestId, u32)>,
    pending: BTreeMap<RequestId, Pending>,
    free: BTreeSet<u32>,
    next_step: Option<std::time::Instant>,
}

/// The whole run's state.
struct Cluster {
    config: ClusterConfig,
    d: Deployment,
    addresses: BTreeMap<EngineId, EngineAddress>,
    proxy: Proxy,
    engines: Vec<PrefillEngine>,
    pgroups: Vec<PGroup>,
    dgroups: Vec<DGroup>,
    ranks: BTreeMap<RankId, RankProc>,
    requests: BTreeMap<RequestId, Req>,
    clock: Clock,
    stream: Stream,
    sent: u64,
    finished: u64,
    failed: u64,
    prefilled: u32,
    tokens_in: u64,
    tokens_out: u64,
    ttft_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    failures: Vec<Failure>,
    violations: Vec<Violation>,
    problems: Vec<String>,
    problem_counts: BTreeMap<String, u64>,
    memory: BTreeSet<String>,
    faults_log: Vec<String>,
    ledger: Ledger,
    reads: BTreeMap<RankId, (u64, u64)>,
    /// Which incarnation of each rank a transfer was registered on: a worker's later events
    /// (group done, retire) go only to the process that holds its registration.
    registered: BTreeMap<(RankId, TransferId), u32>,
    bytes_verified: u64,
    /// Transfers an injected fault was exposed to: their failures and reaping are excused.
    exposed: BTreeSet<TransferId>,
    /// Prefill ranks a fault killed and that have not restarted yet.
    down_by_fault: BTreeSet<RankId>,
    failed_excused: u64,
    prompt_kv_bytes: u64,
    /// Requests to send as soon as the current one is sent ([`Cluster::submit_owed`]).
    owed: u64,
    submitting: bool,
    restart_at: Option<(std::time::Instant, RankId)>,
    hung: Option<String>,
    /// The run's budget (`--timeout-ms`) ended while requests were still finishing.
    budget_ended: Option<String>,
    /// The signal that stopped the run, if one did.
    interrupted: Option<i32>,
    scheduler_addr: SocketAddr,
    /// The run's membership token and who may join ([`Admission`]).
    token: String,
    admission: Arc<Mutex<Admission>>,
    processes: Processes,
    started_at: std::time::Instant,
}

/// Runs a cluster to the end and reports; `progress` is called as requests end.
pub fn run(config: ClusterConfig, progress: &mut dyn FnMut(Progress)) -> Result<ClusterResult, ClusterError> {
    let d = Deployment::parse(&config.deployment).map_err(|e| ClusterError::Config(e.to_string()))?;
    let model = config.model(&d);
    let d = d.with_model(model);
    for &decode in &d.decode {
        for &prefill in &d.prefill {
            pdkv_core::routing::check_pair(decode, prefill, &d.model)
                .map_err(|e| ClusterError::Config(e.to_string()))?;
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
        .map_err(|e| ClusterError::Start(format!("scheduler listener: {e}")))?;
    let (tx, rx) = mpsc::channel();
    let token = new_token().map_err(ClusterError::Start)?;
    let admission = Arc::new(Mutex::new(Admission { token: token.clone(), ..Admission::default() }));
    let mut acceptor =
        Acceptor::start(listener, tx.clone(), admission.clone()).map_err(ClusterError::Start)?;
    let policy = Policy::from(&config.legacy);
    let engines = d
        .prefill
        .iter()
        .enumerate()
        .map(|(i, &layout)| {
            PrefillEngine::new(EngineId::prefill(i as u16), layout, d.model.clone(), policy)
                .with_defer_timeout_ns(config.defer_timeout_ms * NS_PER_MS)
        })
        .collect();
    let pgroups = d
        .prefill
        .iter()
        .enumerate()
        .flat_map(|(e, l)| (0..l.dp).map(move |dp| (e, dp)))
        .map(|(engine, dp)| PGroup {
            engine,
            dp,
            free: (0..config.num_blocks).collect(),
            owner: BTreeMap::new(),
            queue: VecDeque::new(),
        })
        .collect();
    let dgroups = d
        .decode
        .iter()
        .enumerate()
        .flat_map(|(e, l)| (0..l.dp).map(move |dp| (e, dp, l.tp)))
        .map(|(engine, dp, tp)| DGroup {
            engine,
            dp,
            tp,
            barrier: DecodeGroup::new(tp, policy.handshake),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: BTreeMap::new(),
            free: (0..DECODE_BLOCKS).collect(),
            next_step: None,
        })
        .collect();
    let mut cluster = Cluster {
        proxy: Proxy::new(&d, policy.proxy),
        engines,
        pgroups,
        dgroups,
        ranks: BTreeMap::new(),
        requests: BTreeMap::new(),
        clock: Clock::start(),
        stream: Stream(config.seed),
        sent: 0,
        finished: 0,
        failed: 0,
        prefilled: 0,
        tokens_in: 0,
        tokens_out: 0,
        ttft_ms: Vec::new(),
        e2e_ms: Vec::new(),
        failures: Vec::new(),
        violations: Vec::new(),
        problems: Vec::new(),
        problem_counts: BTreeMap::new(),
        memory: BTreeSet::new(),
        faults_log: Vec::new(),
        ledger: Ledger::default(),
        reads: BTreeMap::new(),
        registered: BTreeMap::new(),
        bytes_verified: 0,
        exposed: BTreeSet::new(),
        down_by_fault: BTreeSet::new(),
        failed_excused: 0,
        prompt_kv_bytes: 0,
        owed: 0,
        submitting: false,
        restart_at: None,
        hung: None,
        budget_ended: None,
        interrupted: None,
        scheduler_addr: acceptor.addr,
        token,
        admission,
        processes: Processes::default(),
        started_at: std::time::Instant::now(),
        addresses,
        d,
        config,
    };
    let started = cluster.start_all(&rx, &tx);
    let result = match started {
        Ok(()) => {
            cluster.started_at = std::time::Instant::now();
            cluster.main_loop(&rx, &tx, progress);
            cluster.shutdown(&rx);
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
    fn spawn(&mut self, rank: RankId, incarnation: u32) -> Result<(), String> {
        let role = match rank.engine.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        // Hold the admission while the child starts: its hello may come before this thread
        // runs again, and must find the process expected.
        let admission = self.admission.clone();
        let mut admission = admission.lock().unwrap_or_else(PoisonError::into_inner);
        let child = Command::new(&self.config.exe)
            .args(["connector", "--deployment", &self.config.deployment, "--role", role])
            .args(["--engine", &rank.engine.index.to_string(), "--dp", &rank.dp.to_string()])
            .args(["--tp", &rank.tp.to_string(), "--scheduler", &self.scheduler_addr.to_string()])
            .env(TOKEN_ENV, &self.token)
            // Its own process group: a Ctrl-C in the terminal reaches only `pdkv cluster`, which
            // then stops its ranks in order and still writes its result.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {} connector: {e}", self.config.exe.display()))?;
        self.processes.started += 1;
        admission.expected.insert(rank, child.id());
        drop(admission);
        let proc = RankProc {
            child: Some(child),
            writer: None,
            incarnation,
            alive: true,
            ready: false,
            data_addr: None,
            said_bye: false,
            killed_by_fault: false,
            last_heard: std::time::Instant::now(),
        };
        self.ranks.insert(rank, proc);
        Ok(())
    }

    fn setup_for(&self, rank: RankId, incarnation: u32) -> Setup {
        let drop_releases = self
            .config
            .faults
            .iter()
            .map(|f| match f {
                Fault::DropReleases { rank: r, count } if *r == rank => *count,
                _ => 0,
            })
            .sum();
        Setup {
            model: self.d.model.clone(),
            legacy: self.config.legacy.clone(),
            address: self.addresses[&rank.engine].clone(),
            num_blocks: self.config.num_blocks,
            transport: self.config.transport,
            handshake_timeout_ms: self.config.handshake_timeout_ms,
            transfer_timeout_ms: self.config.transfer_timeout_ms,
            per_request_reads: false,
            drop_releases,
            incarnation,
        }
    }

    fn start_all(&mut self, rx: &Receiver<Ev>, tx: &Sender<Ev>) -> Result<(), String> {
        let all: Vec<RankId> =
            [Role::Prefill, Role::Decode].into_iter().flat_map(|r| self.d.ranks(r)).collect();
        for &rank in &all {
            self.spawn(rank, 0)?;
        }
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        while self.ranks.values().any(|r| !r.ready) {
            if self.stop_requested() {
                // The main loop ends at once; the result says interrupted.
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
                Err(_) => {
                    let missing: Vec<String> =
                        self.ranks.iter().filter(|(_, r)| !r.ready).map(|(k, _)| k.to_string()).collect();
                    return Err(format!(
                        "ranks not ready after {} s: {}",
                        START_TIMEOUT.as_secs(),
                        missing.join(", ")
                    ));
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, rank: RankId, msg: &ToRank) {
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

    /// Notes a problem line; repeats of a line are counted, not listed again.
    fn problem(&mut self, line: String) {
        if let Some(count) = self.problem_counts.get_mut(&line) {
            *count += 1;
        } else if self.problem_counts.len() < MAX_PROBLEMS {
            self.problem_counts.insert(line.clone(), 1);
            self.problems.push(line);
        }
    }

    /// The acceptor refused a connector ([`Admission`]): counted and reported.
    fn refused(&mut self, rank: RankId, pid: u32, reason: &str) {
        self.processes.refused += 1;
        self.problem(format!("refused a connector that claimed to be {rank} (process {pid}): {reason}"));
    }

    /// Handles one event; returns a start-up error when a rank cannot start.
    fn on_event(&mut self, ev: Ev, tx: &Sender<Ev>) -> Option<String> {
        match ev {
            Ev::Joined { rank, stream } => {
                let proc = self.ranks.get_mut(&rank)?;
                let incarnation = proc.incarnation;
                let reader = stream.try_clone().ok()?;
                proc.writer = Some(stream);
                let tx = tx.clone();
                thread::spawn(move || {
                    let mut reader = BufReader::new(reader);
                    while let Ok(msg) = read_frame::<FromRank>(&mut reader) {
                        if tx.send(Ev::Msg { rank, incarnation, msg }).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Ev::Gone { rank, incarnation });
                });
                let setup = self.setup_for(rank, incarnation);
                self.send(rank, &ToRank::Setup(setup));
            }
            Ev::Refused { rank, pid, reason } => self.refused(rank, pid, &reason),
            Ev::Msg { rank, incarnation, msg } => {
                let proc = self.ranks.get_mut(&rank).filter(|p| p.incarnation == incarnation)?;
                proc.last_heard = std::time::Instant::now();
                return self.on_message(rank, msg);
            }
            Ev::Gone { rank, incarnation } => {
                let proc = self.ranks.get_mut(&rank)?;
                // A rank already counted as lost (killed by a fault, or for its silence) is
                // not lost twice.
                if proc.incarnation != incarnation || !proc.alive {
                    return None;
                }
                let expected = proc.said_bye || proc.killed_by_fault;
                let ready = proc.ready;
                proc.alive = false;
                proc.writer = None;
                if !expected {
                    self.problem(format!("{rank} disconnected unexpectedly"));
                }
                // Lost even when it never became ready (a restart that failed), so that its
                // group's queue fails instead of waiting for it.
                self.rank_lost(rank);
                if !expected && !ready {
                    return Some(format!("{rank} exited before it was ready"));
                }
            }
        }
        None
    }

    /// Whether `rank` is gone and will not come back (a restart brings back only the rank a
    /// fault killed with `restart_after_ms`).
    fn gone_for_good(&self, rank: RankId) -> bool {
        let restarting = self.restart_at.is_some_and(|(_, r)| r == rank);
        self.ranks.get(&rank).is_some_and(|p| !p.alive) && !restarting
    }

    /// The first rank of a DP group that is gone for good, if any.
    fn gone_rank_of_group(&self, engine: EngineId, dp: u16) -> Option<RankId> {
        let tp = self.d.layout(engine).tp;
        (0..tp).map(|tp| RankId::new(engine, dp, tp)).find(|&r| self.gone_for_good(r))
    }

    /// A rank is gone. A prefill rank that comes back (a restart is due) is waited for by
    /// nobody: prefills waiting for its acknowledgement go on without it. A rank gone for good
    /// takes its DP group with it, as a dead worker takes its engine in vLLM: the group's
    /// requests that have not reached decode fail now instead of at the decode side's
    /// timeouts, and so do the requests of a decode group that lost a rank, since its TP group
    /// can never vote or step again.
    fn rank_lost(&mut self, rank: RankId) {
        if rank.engine.role == Role::Prefill && self.gone_for_good(rank) {
            // Its memory died with it and it will not come back: on the transfers it holds (and
            // any registered later) its part counts as done, so its group's blocks are freed
            // once the live ranks are released instead of at the reaper. The engine decides;
            // the driver only reports the loss. A rank that will restart is not reported: its
            // new incarnation could reuse the freed block ids while a reader still reads the old
            // transfer from it, so its old transfers wait for the reaper, fenced meanwhile.
            self.engine(usize::from(rank.engine.index), EngineEvent::WorkerLost { rank });
        }
        let waiting: Vec<RequestId> =
            self.requests.iter().filter(|(_, r)| r.acks_needed.contains(&rank)).map(|(&id, _)| id).collect();
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
                    let req = &self.requests[&id];
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
                for e in 0..self.engines.len() {
                    self.engine(e, EngineEvent::ReaderLost { rank });
                }
                let g = self.dgroup_of(rank);
                // The group decides what a dead member means (it votes no on the step it left
                // open, so the live ranks fail the step's requests at once and release their
                // transfers, and no later step begins); the driver only reports the loss.
                self.group_event(g, GroupEvent::MemberLost { member: rank.tp_rank() });
                let group = &mut self.dgroups[g];
                group.next_step = None;
                let mut ids: Vec<RequestId> = group.waiting.drain(..).map(|r| r.request).collect();
                ids.extend(group.running.drain(..).map(|(id, _)| id));
                ids.extend(std::mem::take(&mut group.pending).into_keys());
                for id in ids {
                    self.end(id, Some(vec![error.clone()]));
                }
            }
        }
    }

    fn on_message(&mut self, rank: RankId, msg: FromRank) -> Option<String> {
        let now = self.clock.now();
        match msg {
            FromRank::Hello { .. } | FromRank::Heartbeat => {}
            FromRank::Ready { data_addr, memory } => {
                if rank.engine.role == Role::Prefill {
                    self.memory.insert(memory);
                }
                let proc = self.ranks.get_mut(&rank).expect("known rank");
                proc.ready = true;
                proc.data_addr = data_addr;
                let incarnation = proc.incarnation;
                if incarnation > 0 {
                    self.down_by_fault.remove(&rank);
                    self.faults_log.push(format!("{rank} restarted (incarnation {incarnation})"));
                    self.pump_prefill(rank.engine, rank.dp);
                }
            }
            FromRank::SetupFailed { error } => return Some(format!("{rank}: {error}")),
            FromRank::Prefilled { transfer_id } => {
                if let Some(id) = self.request_of(&transfer_id) {
                    self.prefill_acked(id, rank);
                }
            }
            FromRank::Finished { transfer_id } => {
                let e = usize::from(rank.engine.index);
                self.engine(e, EngineEvent::WorkerFinished { rank, transfer_id });
            }
            FromRank::Leased { transfer_id, remaining_ns } => {
                let e = usize::from(rank.engine.index);
                self.engine(e, EngineEvent::Leased { transfer_id, until: Instant(now.0 + remaining_ns) });
            }
            FromRank::Vote { step, ok } => {
                let event = GroupEvent::Vote { member: rank.tp_rank(), step, ok };
                self.group_event(self.dgroup_of(rank), event);
            }
            FromRank::StepDone { step, error } => {
                // Both enter the forward pass: ready, or failed with the whole group.
                let report = if error.is_some() { StepReport::FailedWithGroup } else { StepReport::Ready };
                let event = GroupEvent::StepReport { member: rank.tp_rank(), step, report };
                self.group_event(self.dgroup_of(rank), event);
            }
            FromRank::StepRaised { step, error } => {
                let event =
                    GroupEvent::StepReport { member: rank.tp_rank(), step, report: StepReport::Raised };
                self.group_event(self.dgroup_of(rank), event);
                self.problem(format!("{rank} raised at step {step}: {error}"));
            }
            FromRank::Received { request } => self.reported(rank, request, None),
            FromRank::RecvFailed { request, error } => self.reported(rank, request, Some(error)),
            FromRank::ReadVerified { layer, source, bytes, .. } => {
                let entry = self.reads.entry(source).or_default();
                // A request's reads count once per decode worker, whatever the granularity.
                if layer.is_none_or(|l| l == 0) {
                    entry.0 += 1;
                }
                entry.1 += bytes;
                self.bytes_verified += bytes;
            }
            FromRank::Mismatch { request, detail } => {
                self.violations.push(Violation {
                    kind: "read_mismatch".into(),
                    detail: format!("{rank}, {request}: {detail}"),
                });
            }
            FromRank::Problem { violation, detail } => {
                if violation {
                    self.violations.push(Violation {
                        kind: "protocol_error".into(),
                        detail: format!("{rank}: {detail}"),
                    });
                } else {
                    self.problem(format!("{rank}: {detail}"));
                }
            }
            FromRank::ReleaseDropped { transfer_id } => {
                self.exposed.insert(transfer_id);
            }
            FromRank::Bye { .. } => {
                if let Some(proc) = self.ranks.get_mut(&rank) {
                    proc.said_bye = true;
                }
            }
        }
        None
    }

    /// Feeds decode group `g`'s barrier and carries out what it decides: vote results go to
    /// the ranks they name, and a group every rank of which entered the forward runs it.
    fn group_event(&mut self, g: usize, event: GroupEvent) {
        let mut out = Vec::new();
        self.dgroups[g].barrier.handle(event, &mut out);
        for action in out {
            match action {
                GroupAction::VoteResult { member, step, ok } => {
                    let rank = self.decode_rank(g, member.0);
                    self.send(rank, &ToRank::VoteResult { step, ok });
                }
                GroupAction::Forward { .. } => self.forward(g),
                // A lost rank's last messages may still be on their way when it is lost.
                GroupAction::Ignored(Ignored::LostMember { .. }) => {}
                GroupAction::Ignored(why) => {
                    let (engine, dp) = (self.dgroups[g].engine, self.dgroups[g].dp);
                    self.problem(format!("D{engine}.dp{dp}: the decode group ignored an input: {why}"));
                }
            }
        }
    }

    fn request_of(&self, transfer_id: &TransferId) -> Option<RequestId> {
        self.requests.iter().find(|(_, r)| &r.transfer_id == transfer_id).map(|(&id, _)| id)
    }

    fn dgroup_of(&self, rank: RankId) -> usize {
        self.dgroups
            .iter()
            .position(|g| g.engine == usize::from(rank.engine.index) && g.dp == rank.dp)
            .expect("decode ranks belong to a group")
    }

    fn decode_rank(&self, g: usize, tp: u16) -> RankId {
        let group = &self.dgroups[g];
        RankId::new(EngineId::decode(group.engine as u16), group.dp, tp)
    }

    fn pgroup_index(&self, engine: usize, dp: u16) -> usize {
        self.pgroups.iter().position(|g| g.engine == engine && g.dp == dp).expect("prefill groups exist")
    }

    // -------------------------------------------------------------------------- requests

    fn submit(&mut self) {
        if self.sent >= u64::from(self.config.requests) {
            return;
        }
        self.sent += 1;
        let bits = (u128::from(self.stream.next()) << 64) | u128::from(self.stream.next());
        let input = self.stream.range(48, 400);
        let output = self.stream.range(4, 12);
        let (id, action) = match self.proxy.handle_request(bits) {
            Ok(x) => x,
            Err(e) => {
                self.violations
                    .push(Violation { kind: "protocol_error".into(), detail: format!("proxy refused: {e}") });
                return;
            }
        };
        let ProxyAction::SendPrefill { slot, .. } = action else {
            unreachable!("a new request goes to prefill first")
        };
        let record = self.proxy.request(id).expect("just routed").clone();
        let req = Req {
            transfer_id: record.transfer_id,
            input,
            output,
            prefill: (usize::from(slot.engine.index), slot.dp()),
            decode: (usize::from(record.decode.engine.index), record.decode.dp()),
            prefill_blocks: Vec::new(),
            local_blocks: Vec::new(),
            acks_needed: BTreeSet::new(),
            started: std::time::Instant::now(),
            first_token: None,
            // The group lacks a rank a fault killed: the request may fail for it.
            exposed: (0..self.d.layout(slot.engine).tp)
                .any(|tp| self.down_by_fault.contains(&RankId::new(slot.engine, slot.dp(), tp))),
        };
        if req.exposed {
            self.exposed.insert(req.transfer_id.clone());
        }
        self.requests.insert(id, req);
        if let Some(gone) = self.gone_rank_of_group(record.decode.engine, record.decode.dp()) {
            self.end(id, Some(vec![format!("{gone} is gone")]));
            return;
        }
        let g = self.pgroup_index(usize::from(slot.engine.index), slot.dp());
        self.pgroups[g].queue.push_back(id);
        self.pump_prefill(slot.engine, slot.dp());
    }

    /// Starts prefills of a group's queue while its blocks last.
    fn pump_prefill(&mut self, engine: EngineId, dp: u16) {
        let g = self.pgroup_index(usize::from(engine.index), dp);
        if let Some(gone) = self.gone_rank_of_group(engine, dp) {
            let queued: Vec<RequestId> = self.pgroups[g].queue.drain(..).collect();
            for id in queued {
                self.end(id, Some(vec![format!("{gone} is gone")]));
            }
            return;
        }
        // A killed rank that a restart brings back: the group's prefills wait for it, since
        // KV prefilled without it could not be read from it.
        let tp = self.d.layout(engine).tp;
        let incomplete = (0..tp)
            .any(|tp| self.ranks.get(&RankId::new(engine, dp, tp)).is_some_and(|p| !(p.alive && p.ready)));
        if incomplete {
            return;
        }
        let block = self.d.model.block_size_tokens;
        while let Some(&id) = self.pgroups[g].queue.front() {
            let need = self.requests[&id].input.div_ceil(block) as usize;
            if self.pgroups[g].free.len() < need {
                break;
            }
            self.pgroups[g].queue.pop_front();
            let blocks: Vec<u32> = self.pgroups[g].free.iter().take(need).copied().collect();
            let transfer_id = self.requests[&id].transfer_id.clone();
            for b in &blocks {
                self.pgroups[g].free.remove(b);
                self.pgroups[g].owner.insert(*b, transfer_id.clone());
            }
            let layout = self.d.layout(engine);
            let live: BTreeSet<RankId> = (0..layout.tp)
                .map(|tp| RankId::new(engine, dp, tp))
                .filter(|r| self.ranks.get(r).is_some_and(|p| p.alive && p.ready))
                .collect();
            let req = self.requests.get_mut(&id).expect("queued requests exist");
            req.prefill_blocks = blocks.clone();
            req.acks_needed = live.clone();
            for rank in live {
                self.send(
                    rank,
                    &ToRank::Prefill { transfer_id: transfer_id.clone(), blocks: blocks.clone() },
                );
            }
            if self.requests[&id].acks_needed.is_empty() {
                self.prefill_done(id);
            }
        }
    }

    fn prefill_acked(&mut self, id: RequestId, rank: RankId) {
        let Some(req) = self.requests.get_mut(&id) else { return };
        if req.acks_needed.remove(&rank) && req.acks_needed.is_empty() {
            self.prefill_done(id);
        }
    }

    /// Every live rank of the owner group holds the request's KV: register, answer the proxy.
    fn prefill_done(&mut self, id: RequestId) {
        self.prefilled += 1;
        self.maybe_kill();
        let req = &self.requests[&id];
        let (e, dp) = req.prefill;
        let decode_engine = EngineId::decode(req.decode.0 as u16);
        if let Some(gone) = self.gone_rank_of_group(decode_engine, req.decode.1) {
            // Its decode group died while it was prefilled: nobody will read or release it,
            // so it is not registered, and its blocks go back to the pool now rather than to
            // the reaper later.
            let (transfer_id, blocks) = (req.transfer_id.clone(), req.prefill_blocks.clone());
            self.free_prefill_blocks(e, dp, &transfer_id, &blocks);
            self.end(id, Some(vec![format!("{gone} is gone")]));
            return;
        }
        let req = &self.requests[&id];
        let decode_layout = self.d.decode[req.decode.0];
        let event = EngineEvent::PrefillDone {
            request: id,
            transfer_id: req.transfer_id.clone(),
            owner_dp: dp,
            blocks: req.prefill_blocks.clone(),
            decode: decode_layout,
            reader: Some((EngineId::decode(req.decode.0 as u16), req.decode.1)),
        };
        let mut out = Vec::new();
        let now = self.clock.now();
        if let Err(error) = self.engines[e].handle(now, event, &mut out) {
            self.problem(format!("P{e} refused {id}: {error}"));
            let blocks = self.requests[&id].prefill_blocks.clone();
            let transfer_id = self.requests[&id].transfer_id.clone();
            self.free_prefill_blocks(e, dp, &transfer_id, &blocks);
            self.end(id, Some(vec![format!("prefill refused: {error}")]));
            return;
        }
        self.engine_actions(e, out);
        let engine = EngineId::prefill(e as u16);
        let address = self.addresses[&engine].clone();
        let layout: Layout = self.d.prefill[e];
        let req = &self.requests[&id];
        let answer = KvTransferParams {
            do_remote_prefill: true,
            transfer_id: Some(req.transfer_id.0.clone()),
            remote_block_ids: req.prefill_blocks.iter().map(|&b| u64::from(b)).collect(),
            remote_engine_id: Some(address.engine_id()),
            remote_host: Some(address.host.clone()),
            remote_handshake_port: Some(i64::from(address.handshake_port_base)),
            remote_notify_port: Some(i64::from(address.notify_port_base)),
            remote_dp_size: Some(i64::from(layout.dp)),
            tp_size: Some(i64::from(layout.tp)),
            ..KvTransferParams::default()
        };
        match self.proxy.handle_prefill_response(id, answer) {
            Ok(ProxyAction::SendDecode { slot, params, .. }) => {
                let g = self
                    .dgroups
                    .iter()
                    .position(|g| g.engine == usize::from(slot.engine.index) && g.dp == slot.dp())
                    .expect("the proxy routes to existing groups");
                if let Some(gone) = self.gone_rank_of_group(slot.engine, slot.dp()) {
                    // Registered already: the reaper frees what the dead group never releases.
                    self.end(id, Some(vec![format!("{gone} is gone")]));
                    return;
                }
                let recv = Recv {
                    request: id,
                    prefill_engine: engine,
                    prefill_address: address,
                    params,
                    local_block_ids: Vec::new(),
                };
                self.dgroups[g].waiting.push_back(recv);
                self.begin_step(g);
            }
            other => {
                let detail = match other {
                    Ok(_) => format!("proxy answered the prefill response of {id} with no decode dispatch"),
                    Err(e) => format!("proxy refused the prefill response of {id}: {e}"),
                };
                self.violations.push(Violation { kind: "protocol_error".into(), detail });
            }
        }
    }

    fn engine(&mut self, e: usize, event: EngineEvent) {
        let mut out = Vec::new();
        if let Err(error) = self.engines[e].handle(self.clock.now(), event, &mut out) {
            self.violations
                .push(Violation { kind: "protocol_error".into(), detail: format!("P{e}: {error}") });
        }
        self.engine_actions(e, out);
    }

    fn engine_actions(&mut self, e: usize, actions: Vec<EngineAction>) {
        for action in actions {
            match action {
                EngineAction::Register { rank, transfer_id, quorum } => {
                    if let Some(proc) = self.ranks.get(&rank).filter(|p| p.alive) {
                        self.registered.insert((rank, transfer_id.clone()), proc.incarnation);
                    }
                    self.send(rank, &ToRank::Register { transfer_id, quorum });
                }
                EngineAction::GroupDone { rank, transfer_id } => {
                    if self.holds_registration(rank, &transfer_id) {
                        self.send(rank, &ToRank::GroupDone { transfer_id });
                    }
                }
                EngineAction::Retire { rank, transfer_id } => {
                    if self.holds_registration(rank, &transfer_id) {
                        self.send(rank, &ToRank::Retire { transfer_id: transfer_id.clone() });
                    }
                    self.registered.remove(&(rank, transfer_id));
                }
                EngineAction::FinishedSending { .. } => {}
                EngineAction::Fence { transfer_id, owner_dp, blocks } => {
                    self.ledger.fenced += 1;
                    let engine = EngineId::prefill(e as u16);
                    for tp in 0..self.d.prefill[e].tp {
                        let msg = ToRank::Fence { transfer_id: transfer_id.clone(), blocks: blocks.clone() };
                        self.send(RankId::new(engine, owner_dp, tp), &msg);
                    }
                }
                EngineAction::FreeBlocks { transfer_id, owner_dp, blocks, reaped } => {
                    if reaped {
                        self.ledger.reaped += 1;
                        if self.exposed.contains(&transfer_id) {
                            self.ledger.reaped_excused += 1;
                        }
                    } else {
                        self.ledger.freed += 1;
                    }
                    self.free_prefill_blocks(e, owner_dp, &transfer_id, &blocks);
                    self.pump_prefill(EngineId::prefill(e as u16), owner_dp);
                }
                EngineAction::ReapWarning { transfer_id, held_ns, unfinished_tp } => {
                    let ms = held_ns / NS_PER_MS;
                    let unreleased: Vec<String> = unfinished_tp.iter().map(u16::to_string).collect();
                    self.problem(format!(
                        "P{e} reaped {transfer_id} after {ms} ms; unreleased TP ranks {}",
                        unreleased.join(", ")
                    ));
                }
            }
        }
    }

    /// Whether the live process of `rank` is the one the transfer was registered on (a restarted
    /// rank never heard of transfers registered before it started).
    fn holds_registration(&self, rank: RankId, transfer_id: &TransferId) -> bool {
        let registered = self.registered.get(&(rank, transfer_id.clone()));
        self.ranks.get(&rank).is_some_and(|p| p.alive && registered == Some(&p.incarnation))
    }

    fn free_prefill_blocks(&mut self, e: usize, dp: u16, transfer_id: &TransferId, blocks: &[u32]) {
        let g = self.pgroup_index(e, dp);
        for &b in blocks {
            if self.pgroups[g].owner.get(&b) == Some(transfer_id) {
                self.pgroups[g].owner.remove(&b);
                self.pgroups[g].free.insert(b);
            } else {
                self.ledger.double_frees += 1;
                let detail = format!("P{e}.dp{dp}: block {b} freed for {transfer_id}, which did not hold it");
                self.violations.push(Violation { kind: "double_free".into(), detail });
            }
        }
    }

    // -------------------------------------------------------------------------- decode steps

    fn has_work(&self, g: usize) -> bool {
        let group = &self.dgroups[g];
        !group.waiting.is_empty() || !group.running.is_empty() || !group.pending.is_empty()
    }

    fn begin_step(&mut self, g: usize) {
        // The barrier admits a step once the last one ran its forward, and never after a rank
        // of the group was lost (its collectives can never complete).
        if !self.dgroups[g].barrier.may_begin() || !self.has_work(g) {
            return;
        }
        let step = self.dgroups[g].barrier.step().map_or(1, |s| s + 1);
        self.group_event(g, GroupEvent::StepBegin { step });
        let group = &mut self.dgroups[g];
        group.next_step = None;
        let mut new = Vec::new();
        while let Some(recv) = group.waiting.front() {
            let need = recv.params.remote_block_ids.len();
            let busy = group.running.len() + group.pending.len();
            if busy >= MAX_BATCH || group.free.len() < need {
                break;
            }
            let mut recv = group.waiting.pop_front().expect("front exists");
            let local: Vec<u32> = group.free.iter().take(need).copied().collect();
            for b in &local {
                group.free.remove(b);
            }
            recv.local_block_ids = local.clone();
            group.pending.insert(recv.request, Pending { reported: BTreeSet::new(), errors: Vec::new() });
            new.push(recv);
        }
        for recv in &new {
            if let Some(req) = self.requests.get_mut(&recv.request) {
                req.local_blocks = recv.local_block_ids.clone();
            }
        }
        for tp in 0..self.dgroups[g].tp {
            let rank = self.decode_rank(g, tp);
            self.send(rank, &ToRank::StepBegin { step, requests: new.clone() });
        }
    }

    /// Every rank of the group entered the forward pass: one token for every running request.
    fn forward(&mut self, g: usize) {
        let group = &mut self.dgroups[g];
        let now = std::time::Instant::now();
        let mut finished = Vec::new();
        for (id, left) in group.running.iter_mut() {
            *left -= 1;
            if *left == 0 {
                finished.push(*id);
            }
        }
        group.running.retain(|(_, left)| *left > 0);
        let running: Vec<RequestId> =
            group.running.iter().map(|(id, _)| *id).chain(finished.iter().copied()).collect();
        for id in running {
            if let Some(req) = self.requests.get_mut(&id) {
                if req.first_token.is_none() {
                    req.first_token = Some(now);
                    self.ttft_ms.push((now - req.started).as_secs_f64() * 1e3);
                }
            }
        }
        for id in finished {
            self.end(id, None);
        }
        if !self.dgroups[g].running.is_empty() || !self.dgroups[g].waiting.is_empty() {
            self.begin_step(g);
        } else if !self.dgroups[g].pending.is_empty() {
            self.dgroups[g].next_step = Some(now + IDLE_STEP);
        }
    }

    fn reported(&mut self, rank: RankId, request: RequestId, error: Option<String>) {
        let g = self.dgroup_of(rank);
        let width = usize::from(self.dgroups[g].tp);
        let Some(p) = self.dgroups[g].pending.get_mut(&request) else { return };
        p.reported.insert(rank.tp);
        if let Some(error) = error {
            p.errors.push(format!("{rank}: {error}"));
        }
        if p.reported.len() < width {
            return;
        }
        let p = self.dgroups[g].pending.remove(&request).expect("present");
        if p.errors.is_empty() {
            let output = self.requests[&request].output;
            self.dgroups[g].running.push((request, output));
            self.begin_step(g);
        } else {
            self.end(request, Some(p.errors));
        }
    }

    /// A request ended: finished (`None`) or failed with each worker's error.
    fn end(&mut self, id: RequestId, errors: Option<Vec<String>>) {
        let Some(req) = self.requests.remove(&id) else { return };
        let g = self.dgroups.iter().position(|g| (g.engine, g.dp) == req.decode).expect("decode group");
        for b in &req.local_blocks {
            self.dgroups[g].free.insert(*b);
        }
        let _ = self.proxy.handle_finished(id);
        match errors {
            None => {
                self.finished += 1;
                let m = &self.d.model;
                let block_bytes = u64::from(m.block_size_tokens) * u64::from(m.bytes_per_token_per_layer);
                self.prompt_kv_bytes += req.prefill_blocks.len() as u64 * block_bytes * u64::from(m.layers);
                self.e2e_ms.push(req.started.elapsed().as_secs_f64() * 1e3);
                self.tokens_in += u64::from(req.input);
                self.tokens_out += u64::from(req.output);
            }
            Some(errors) => {
                self.failed += 1;
                if req.exposed {
                    self.failed_excused += 1;
                }
                if self.failures.len() < MAX_FAILURES_LISTED {
                    self.failures.push(Failure {
                        request: id.0,
                        transfer_id: req.transfer_id.0.clone(),
                        prefill: format!("P{}.dp{}", req.prefill.0, req.prefill.1),
                        errors,
                    });
                }
            }
        }
        self.owed += 1;
        self.submit_owed();
    }

    /// Sends the requests that ended requests made room for. A request can end while another
    /// is being sent (its group is gone), so sending is not reentrant: the outermost call sends
    /// them all, in a loop rather than a recursion as deep as the run is long.
    fn submit_owed(&mut self) {
        if self.submitting {
            return;
        }
        self.submitting = true;
        while self.owed > 0 {
            self.owed -= 1;
            self.submit();
        }
        self.submitting = false;
    }

    // -------------------------------------------------------------------------- faults

    fn maybe_kill(&mut self) {
        let faults = self.config.faults.clone();
        for fault in faults {
            let Fault::KillPrefill { rank, after, restart_after_ms } = fault else { continue };
            if self.prefilled != after {
                continue;
            }
            let Some(proc) = self.ranks.get_mut(&rank) else { continue };
            if let Some(child) = proc.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            proc.killed_by_fault = true;
            proc.alive = false;
            proc.writer = None;
            self.processes.killed_by_fault += 1;
            self.down_by_fault.insert(rank);
            self.expose_group(rank);
            let at = self.started_at.elapsed().as_millis();
            self.faults_log.push(format!("killed {rank} at {at} ms, after {after} prefills"));
            if let Some(ms) = restart_after_ms {
                self.restart_at = Some((std::time::Instant::now() + Duration::from_millis(ms), rank));
            }
            self.rank_lost(rank);
        }
    }

    /// A fault hit prefill rank `rank`: every request of its DP group still in flight may fail
    /// because of it (its KV, or part of it, was on the rank), and so may their transfers' reaping.
    /// Requests that the proxy sends to the group while the rank is down are exposed as they are
    /// sent ([`Cluster::submit`]).
    fn expose_group(&mut self, rank: RankId) {
        let group = (usize::from(rank.engine.index), rank.dp);
        for req in self.requests.values_mut().filter(|r| r.prefill == group) {
            req.exposed = true;
            self.exposed.insert(req.transfer_id.clone());
        }
    }

    fn restart(&mut self, rank: RankId) {
        let incarnation = self.ranks.get(&rank).map_or(0, |p| p.incarnation + 1);
        if let Err(e) = self.spawn(rank, incarnation) {
            self.problem(format!("restart of {rank}: {e}"));
        }
    }

    // -------------------------------------------------------------------------- the loop

    /// Whether [`ClusterConfig::stop`] asks the run to stop; notes the signal once.
    fn stop_requested(&mut self) -> bool {
        if self.interrupted.is_some() {
            return true;
        }
        let Some(flag) = self.config.stop else { return false };
        let signal = flag.load(Ordering::SeqCst);
        if signal == 0 {
            return false;
        }
        self.interrupted = Some(signal);
        if std::ptr::eq(flag, &crate::signals::CAUGHT) {
            // A second Ctrl-C during the orderly stop ends the process at once.
            crate::signals::restore();
        }
        true
    }

    /// Ranks that said nothing, not even a heartbeat, for [`HEARTBEAT_TIMEOUT`]: stopped or
    /// hung processes, whose connection stays open. Each is killed and lost like a dead one.
    fn check_heartbeats(&mut self) {
        let silent: Vec<RankId> = self
            .ranks
            .iter()
            .filter(|(_, p)| p.alive && p.ready && p.last_heard.elapsed() > HEARTBEAT_TIMEOUT)
            .map(|(&r, _)| r)
            .collect();
        for rank in silent {
            let proc = self.ranks.get_mut(&rank).expect("listed above");
            if let Some(child) = proc.child.as_mut() {
                let _ = child.kill();
            }
            proc.alive = false;
            proc.writer = None;
            let secs = HEARTBEAT_TIMEOUT.as_secs();
            self.problem(format!(
                "{rank} stopped answering (nothing for {secs} s, not even a heartbeat); killed it"
            ));
            self.rank_lost(rank);
        }
    }

    fn held(&self) -> u64 {
        self.engines.iter().map(|e| e.held().count() as u64).sum()
    }

    fn main_loop(&mut self, rx: &Receiver<Ev>, tx: &Sender<Ev>, progress: &mut dyn FnMut(Progress)) {
        for fault in &self.config.faults {
            if let Fault::DropReleases { rank, count } = fault {
                self.faults_log.push(format!("{rank} drops its first {count} releases"));
            }
        }
        // A kill after 0 prefills happens before the first request.
        self.maybe_kill();
        self.owed += u64::from(self.config.concurrency.min(self.config.requests));
        self.submit_owed();
        let deadline = self.started_at + Duration::from_millis(self.config.timeout_ms);
        let total = u64::from(self.config.requests);
        let mut reported = u64::MAX;
        let mut last_done_at = std::time::Instant::now();
        // A healthy request ends within a handshake and a transfer timeout of its arrival, so a
        // run in which nothing ended for that long is stuck; one that ends its budget sooner
        // after its last finished request was only too short.
        let stall = Duration::from_millis(
            self.config.handshake_timeout_ms.saturating_add(self.config.transfer_timeout_ms),
        );
        loop {
            if self.stop_requested() {
                return;
            }
            self.check_heartbeats();
            let done = self.finished + self.failed;
            if done != reported {
                reported = done;
                last_done_at = std::time::Instant::now();
                progress(Progress { done, total });
            }
            if done >= total && self.held() == 0 {
                return;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                let held = self.held();
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
                         finished in the last {quiet_ms} ms",
                        self.config.timeout_ms,
                        total - done
                    ));
                }
                return;
            }
            // The next timer: an engine's reaper, a group's idle step, a restart, the deadline.
            let mut wake = deadline;
            for e in &self.engines {
                if let Some(at) = e.poll_timeout() {
                    wake = wake.min(now + self.clock.until(at));
                }
            }
            for g in &self.dgroups {
                if let Some(at) = g.next_step {
                    wake = wake.min(at);
                }
            }
            if let Some((at, _)) = self.restart_at {
                wake = wake.min(at);
            }
            match rx.recv_timeout(wake.saturating_duration_since(now).min(POLL)) {
                Ok(ev) => {
                    if let Some(error) = self.on_event(ev, tx) {
                        self.problem(error);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            let now = std::time::Instant::now();
            let core_now = self.clock.now();
            for e in 0..self.engines.len() {
                if self.engines[e].poll_timeout().is_some_and(|at| at <= core_now) {
                    self.engine(e, EngineEvent::Tick);
                }
            }
            for g in 0..self.dgroups.len() {
                if self.dgroups[g].next_step.is_some_and(|at| at <= now) {
                    self.dgroups[g].next_step = None;
                    self.begin_step(g);
                }
            }
            if let Some((at, rank)) = self.restart_at {
                if at <= now {
                    self.restart_at = None;
                    self.restart(rank);
                }
            }
        }
    }

    /// Tells every live rank to shut down, waits for each to exit, and kills stragglers.
    fn shutdown(&mut self, rx: &Receiver<Ev>) {
        let live: Vec<RankId> = self.ranks.iter().filter(|(_, p)| p.alive).map(|(&r, _)| r).collect();
        for &rank in &live {
            self.send(rank, &ToRank::Shutdown);
        }
        let deadline = std::time::Instant::now() + EXIT_TIMEOUT;
        // Collect goodbyes (and anything else still in flight) until every live rank left.
        while self.ranks.values().any(|p| p.alive && p.writer.is_some() && !p.said_bye) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ev::Msg { rank, incarnation, msg: FromRank::Bye { .. } }) => {
                    if let Some(p) = self.ranks.get_mut(&rank).filter(|p| p.incarnation == incarnation) {
                        p.said_bye = true;
                    }
                }
                Ok(Ev::Gone { rank, incarnation }) => {
                    if let Some(p) = self.ranks.get_mut(&rank).filter(|p| p.incarnation == incarnation) {
                        p.alive = false;
                    }
                }
                Ok(Ev::Refused { rank, pid, reason }) => self.refused(rank, pid, &reason),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        for proc in self.ranks.values_mut() {
            let Some(mut child) = proc.child.take() else { continue };
            if proc.killed_by_fault {
                continue;
            }
            let mut status = None;
            while std::time::Instant::now() < deadline {
                if let Ok(Some(s)) = child.try_wait() {
                    status = Some(s);
                    break;
                }
                thread::sleep(Duration::from_millis(5));
            }
            match status {
                Some(s) if s.success() => self.processes.exited_cleanly += 1,
                Some(_) => self.processes.failed += 1,
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    self.processes.killed_at_shutdown += 1;
                }
            }
        }
    }

    fn result(&self) -> ClusterResult {
        let duration_s = self.started_at.elapsed().as_secs_f64();
        let held = self.held();
        let unfinished = u64::from(self.config.requests) - self.finished - self.failed;
        let gpus: Vec<RankId> = self.d.ranks(Role::Prefill);
        let reads: Vec<u64> = gpus.iter().map(|r| self.reads.get(r).map_or(0, |v| v.0)).collect();
        let bytes: Vec<u64> = gpus.iter().map(|r| self.reads.get(r).map_or(0, |v| v.1)).collect();
        let ledger = Ledger { held, ..self.ledger.clone() };
        let requests = Requests {
            sent: self.sent,
            finished: self.finished,
            failed: self.failed,
            failed_excused: self.failed_excused,
            unfinished,
        };
        let incomplete = self.budget_ended.is_some();
        let hung = self.hung.is_some() || (unfinished > 0 && !incomplete);
        let outcome = outcome(
            !self.violations.is_empty(),
            self.interrupted.is_some(),
            hung,
            incomplete,
            &requests,
            &ledger,
        );
        let mut problems: Vec<String> = self
            .problems
            .iter()
            .map(|p| match self.problem_counts.get(p) {
                Some(&n) if n > 1 => format!("{p} ({n} times)"),
                _ => p.clone(),
            })
            .collect();
        if let Some(signal) = self.interrupted {
            problems
                .insert(0, format!("interrupted by {}: the result is partial", crate::signals::name(signal)));
        }
        if let Some(hung) = &self.hung {
            problems.insert(0, format!("hung: {hung}"));
        }
        if let Some(ended) = &self.budget_ended {
            problems.insert(0, format!("incomplete: {ended}"));
        }
        let per_s = |x: f64| if duration_s > 0.0 { (x / duration_s * 10.0).round() / 10.0 } else { 0.0 };
        ClusterResult {
            deployment: self.config.deployment.clone(),
            transport: self.config.transport.to_string(),
            model: if self.d.model.use_mla {
                format!("MLA, {} layers", self.d.model.layers)
            } else {
                let heads = self.d.model.kv_heads;
                let plural = if heads == 1 { "" } else { "s" };
                format!("GQA with {heads} KV head{plural}, {} layers", self.d.model.layers)
            },
            seed: self.config.seed,
            outcome: outcome.into(),
            duration_s: (duration_s * 1000.0).round() / 1000.0,
            requests,
            throughput: Throughput {
                total_tok_s: per_s((self.tokens_in + self.tokens_out) as f64),
                output_tok_s: per_s(self.tokens_out as f64),
                requests_per_s: per_s(self.finished as f64),
                kv_bytes_per_s: per_s(self.bytes_verified as f64),
            },
            latency_ms: Latencies { ttft: Summary::of(&self.ttft_ms), e2e: Summary::of(&self.e2e_ms) },
            nic: Nic {
                prefill_gpus: gpus.iter().map(|r| r.to_string()).collect(),
                jain: jain(&reads),
                jain_bytes: jain(&bytes),
                reads_per_prefill_gpu: reads,
                bytes_per_prefill_gpu: bytes,
            },
            ledger,
            bytes_verified: self.bytes_verified,
            prompt_kv_bytes: self.prompt_kv_bytes,
            memory: self.memory.iter().cloned().collect(),
            failures: self.failures.clone(),
            violations: self.violations.clone(),
            faults: self.faults_log.clone(),
            processes: self.processes.clone(),
            listener_ports: self
                .addresses
                .iter()
                .flat_map(|(engine, a)| {
                    let ranks = self.d.layout(*engine).ranks() as u16;
                    (0..ranks).flat_map(move |i| [a.handshake_port_base + i, a.notify_port_base + i])
                })
                .collect(),
            problems,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_follow_the_simulators_rules_and_failed_requests_are_not_clean() {
        let ledger =
            |held, reaped, excused| Ledger { held, reaped, reaped_excused: excused, ..Ledger::default() };
        // `sent` and `finished` do not matter: only failures without an excuse do.
        let requests = |failed, excused| Requests { failed, failed_excused: excused, ..Requests::default() };
        let check = |violated, hung, r: Requests, l: Ledger, expected: &str| {
            assert_eq!(
                outcome(violated, false, hung, false, &r, &l),
                expected,
                "{violated} {hung} {r:?} {l:?}"
            );
        };
        check(false, false, requests(0, 0), ledger(0, 0, 0), "clean");
        check(false, false, requests(0, 0), ledger(0, 3, 3), "clean");
        check(false, false, requests(0, 0), ledger(0, 3, 2), "leak");
        check(false, false, requests(0, 0), ledger(1, 0, 0), "leak");
        check(false, true, requests(0, 0), ledger(1, 0, 0), "hang");
        check(true, true, requests(0, 0), ledger(1, 0, 0), "safety_violation");
        // The bug of 1P_TP1:1D_TP1 at concurrency 100: 264 requests failed, no fault injected,
        // nothing held at the end; that run said clean.
        check(false, false, requests(264, 0), ledger(0, 0, 0), "failed_requests");
        // A kill excuses the failures of requests it was exposed to, and only those.
        check(false, false, requests(5, 5), ledger(0, 4, 4), "clean");
        check(false, false, requests(6, 5), ledger(0, 4, 4), "failed_requests");
        check(false, false, requests(6, 5), ledger(0, 4, 3), "failed_requests");
        check(false, true, requests(6, 5), ledger(0, 0, 0), "hang");
        // A budget that ends while requests still finish: transfers in flight are held, and
        // that is neither a hang nor a leak; unexcused failures still say more.
        let ended = |r: Requests, l: Ledger| outcome(false, false, false, true, &r, &l);
        assert_eq!(ended(requests(0, 0), ledger(36, 0, 0)), "incomplete");
        assert_eq!(ended(requests(2, 0), ledger(36, 0, 0)), "failed_requests");
        // A stopped run is partial: unfinished requests and held transfers are expected of it;
        // only a violation seen before the stop says more.
        let stopped = |violated, expected: &str| {
            assert_eq!(outcome(violated, true, true, false, &requests(3, 0), &ledger(2, 0, 0)), expected);
        };
        stopped(false, "interrupted");
        stopped(true, "safety_violation");
    }

    #[test]
    fn only_the_process_started_for_a_rank_joins_and_only_once() {
        let p0 = RankId::new(EngineId::prefill(0), 0, 0);
        let d1 = RankId::new(EngineId::decode(0), 0, 1);
        let mut admission = Admission { token: "t0k3n".into(), ..Admission::default() };
        admission.expected.insert(p0, 100);
        admission.expected.insert(d1, 101);
        let mut check = |rank, pid, token: &str, expected: Result<(), &str>| {
            let got = admission.admit(rank, pid, token);
            match expected {
                Ok(()) => assert_eq!(got, Ok(()), "{rank} {pid} {token}"),
                Err(e) => {
                    assert!(got.as_ref().is_err_and(|g| g.contains(e)), "{rank} {pid} {token}: {got:?}")
                }
            }
        };
        check(p0, 100, "", Err("no membership token"));
        check(p0, 100, "guess", Err("wrong membership token"));
        // A second connector with the id of a live rank, even holding the token.
        check(p0, 999, "t0k3n", Err("P0.dp0.tp0 is already running as process 100; process 999 is not it"));
        check(RankId::new(EngineId::prefill(0), 0, 7), 100, "t0k3n", Err("this run has no rank P0.dp0.tp7"));
        check(p0, 100, "t0k3n", Ok(()));
        check(p0, 100, "t0k3n", Err("has joined already"));
        check(d1, 101, "t0k3n", Ok(()));
    }

    #[test]
    fn listener_ports_are_probed_outside_the_ephemeral_range() {
        let check = |ephemeral, count, expected| assert_eq!(probe_window(ephemeral, count), expected);
        check(Some((32_768, 60_999)), 24, (10_000, 32_767));
        check(None, 24, (10_000, 32_767));
        check(Some((1_024, 49_999)), 24, (50_000, 65_535));
        check(Some((1_024, 65_535)), 24, (10_000, 65_535));
    }

    #[test]
    fn the_model_replicates_heads_for_heterogeneous_tp() {
        let check = |notation: &str, mla: bool, expected: (bool, u16, u32)| {
            let mut config = ClusterConfig::new(notation, 1, PathBuf::from("pdkv"));
            config.mla = mla;
            let d = Deployment::parse(notation).unwrap();
            let m = config.model(&d);
            assert_eq!((m.use_mla, m.kv_heads, m.bytes_per_token_per_layer), expected, "{notation}");
            for &decode in &d.decode {
                for &prefill in &d.prefill {
                    let pair = pdkv_core::routing::check_pair(decode, prefill, &m);
                    assert!(pair.is_ok(), "{notation}: {pair:?}");
                }
            }
        };
        check("1P_TP4:1D_TP8", false, (false, 4, 512));
        check("1P_TP8:1D_TP4", false, (false, 4, 512));
        check("1P_DP2TP2:1D_TP4", false, (false, 2, 256));
        check("1P_TP16:1D_TP16", false, (false, 8, 1024));
        check("2P_TP2:1D_DP2", true, (true, 1, 576));
    }

    #[test]
    fn request_lengths_stay_in_their_range_and_repeat_for_a_seed() {
        let draw = |seed| {
            let mut s = Stream(seed);
            (0..1000).map(|_| s.range(48, 400)).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert!(a.iter().all(|&x| (48..=400).contains(&x)));
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
    }
}
