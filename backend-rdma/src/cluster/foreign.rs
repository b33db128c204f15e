//! The foreign side of a mixed run (`pdkv cluster --foreign-side prefill|decode`): a driver
//! process plays every engine of one side with another connector's code (vLLM 0.33's MoRIIO, in
//! tests/moriio/mixed.py), while pdkv's connector processes play the other side.
//!
//! The scheduler talks to the driver over its standard input and output, one JSON object per
//! line, each with an `op`; byte strings are lowercase hex. The driver's standard error is the
//! run's. To the driver:
//!
//! - `setup`: the side, its rules, the host, the model, the foreign engines (DP and TP sizes,
//!   port bases, engine id), and on the prefill side every rank's handshake reply (metadata
//!   fields and layer descriptors), which its pdkv data-plane server stands behind. The driver
//!   binds that side's listeners where its own code puts them, and answers `ready` (or `error`,
//!   and exits).
//! - `recv` (decode side): a decode DP group takes a request with the proxy's
//!   `kv_transfer_params`; the driver answers `received` once every TP rank of the group
//!   handshook and released, or with `ok: false` and the error its code raised. Before that,
//!   for every read its code plans, the driver may say `read_plan`: the decode rank, the
//!   prefill rank it reads (`source_dp`, `source_tp`), the block ids, and the session it reads
//!   through (`engine_desc`, the handshake's `agent_metadata`, and `memory_descs`, the remote
//!   memory descriptors of the sessions it built, in hex). The scheduler judges each against the
//!   prefill process holding the transfer (`foreign_reads.rs`).
//! - `register` / `retire` (prefill side): a rank holds a transfer / the engine freed it. The
//!   driver answers `registered` once the rank's worker has the transfer in its table (a step
//!   installed it), and `finished` when that rank's own ack accounting completes the transfer,
//!   exactly when its code reports it; the engine node counts these as the rank's finish. The
//!   proxy hears of the prefill only once every live foreign rank said `registered`: in vLLM the
//!   scheduler maps the request when it allocates it, and the worker receives that table with
//!   the step that computes the prefill, so no decode can read, and release, a transfer its
//!   prefill worker does not know yet. Without this order a release could overtake the
//!   registration on a loaded machine, and a release that vLLM 0.25 drops as unknown would leak
//!   a transfer no real deployment leaks.
//! - `kill` (prefill side, `--kill` of a foreign rank): the rank's data-plane server was
//!   killed; the driver stops the rank's listeners and forgets everything the rank held, as the
//!   death of its process would. `restart`: the rank's data-plane server was started again
//!   (`--restart-after-ms`); the driver starts the rank afresh on the same ports, answering
//!   with the new server's descriptors (`rank`, as in `setup`), and says `restarted` once it
//!   listens. The rank's DP group prefills nothing from the kill until then.
//! - `shutdown`: the driver answers `bye` with its counters and exits.
//!
//! At any time the driver may send `problem` (something to report, not fatal).
//!
//! The driver is not trusted to behave. The scheduler never writes to its input from its own
//! loop: lines go into a bounded queue that a writer thread empties into the pipe, so a driver
//! that stops reading blocks only that thread. A driver that leaves its input unread for
//! [`Cluster::driver_drain_timeout`] (twice the heartbeat timeout: 10 s by default), or lets
//! [`MAX_QUEUED_LINES`] lines or [`MAX_QUEUED_BYTES`] pile up, has failed, and the run ends
//! naming it. The driver runs in a process group of its own, which is killed when the run ends
//! (on every exit path that runs code: a clean end, a failure, a signal), so processes it started
//! go with it; and it gets SIGKILL when `pdkv cluster` dies, even by SIGKILL
//! ([`crate::signals::die_with_parent`]). What that leaves uncovered: a process the driver
//! started survives a SIGKILL of `pdkv cluster` (the parent-death signal reaches the direct
//! child alone), and so does one that left the driver's process group (`setsid`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use pdkv_core::ids::{EngineId, RankId, RequestId, Role, TransferId};
use pdkv_core::params::KvTransferParams;
use pdkv_core::wire::{self, ControlMessage};
use serde::{Deserialize, Serialize};

use super::config::Foreign;
use super::errors::{DriverSetupError, SpawnError, Spawned, StartError};
use super::foreign_reads::{self, Life, Plan};
use super::{Cluster, Ev, ForeignReport};
use pdkv_engine::verdict::ViolationKind;

/// Longest line the driver may send: a `bye` with a few hundred counters fits many times.
const MAX_LINE_BYTES: u64 = 1 << 20;

/// Most lines waiting for the driver to read them: far more than a run has in flight
/// (`MAX_CONCURRENCY` requests, a few lines each), so only a driver that stopped reading fills it.
pub(super) const MAX_QUEUED_LINES: usize = 1 << 16;

/// Most bytes waiting for the driver to read them.
pub(super) const MAX_QUEUED_BYTES: usize = 64 << 20;

/// The model as the driver needs it.
#[derive(Clone, Debug, Serialize)]
pub(super) struct ModelView {
    use_mla: bool,
    kv_heads: u16,
    layers: u16,
    block_size_tokens: u32,
}

/// A foreign engine: its shape and where its listeners are based.
#[derive(Clone, Debug, Serialize)]
pub(super) struct EngineView {
    engine: u16,
    dp: u16,
    tp: u16,
    handshake_port_base: u16,
    notify_port_base: u16,
    engine_id: String,
}

/// The handshake metadata a foreign prefill rank's listener answers with: pdkv's data-plane
/// descriptor as the `agent_metadata`, the rank's KV regions.
#[derive(Clone, Debug, Serialize)]
pub(super) struct MetadataView {
    engine_id: String,
    agent_metadata: String,
    kv_caches_base_addr: Vec<u64>,
    num_blocks: u32,
    block_len: u64,
    attn_backend_name: String,
}

/// One layer's memory descriptors.
#[derive(Clone, Debug, Serialize)]
pub(super) struct LayerView {
    name: String,
    descs: Vec<String>,
}

/// A foreign prefill rank and the handshake reply its listener gives.
#[derive(Clone, Debug, Serialize)]
pub(super) struct RankView {
    engine: u16,
    dp: u16,
    tp: u16,
    metadata: MetadataView,
    layers: Vec<LayerView>,
}

/// Scheduler to driver.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum ToDriver {
    Setup {
        side: &'static str,
        rules: String,
        host: String,
        model: ModelView,
        engines: Vec<EngineView>,
        ranks: Vec<RankView>,
    },
    Recv {
        request: String,
        engine: u16,
        dp: u16,
        params: KvTransferParams,
        local_block_ids: Vec<u32>,
    },
    Register {
        transfer_id: String,
        request: String,
        engine: u16,
        dp: u16,
        tp: u16,
    },
    Retire {
        transfer_id: String,
        engine: u16,
        dp: u16,
        tp: u16,
    },
    /// Prefill side: `--kill` killed the rank's data-plane server; the rank dies with it.
    Kill {
        engine: u16,
        dp: u16,
        tp: u16,
    },
    /// Prefill side: the rank starts again, behind its restarted data-plane server.
    Restart {
        rank: RankView,
    },
    Shutdown,
}

/// Driver to scheduler.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum FromDriver {
    // A struct variant, so that `deny_unknown_fields` sees its fields.
    Ready {},
    Error {
        detail: String,
    },
    Received {
        request: String,
        ok: bool,
        #[serde(default)]
        error: Option<String>,
    },
    Finished {
        transfer_id: String,
        engine: u16,
        dp: u16,
        tp: u16,
    },
    /// Prefill side: the rank's worker has the transfer of a `register` in its table.
    Registered {
        transfer_id: String,
        engine: u16,
        dp: u16,
        tp: u16,
    },
    /// Prefill side: the rank a `restart` named listens again.
    Restarted {
        engine: u16,
        dp: u16,
        tp: u16,
    },
    /// Decode side: a read the driver's code planned, with the session it would read through.
    ReadPlan(ReadPlanLine),
    Problem {
        detail: String,
    },
    Bye {
        #[serde(default)]
        stats: BTreeMap<String, u64>,
    },
}

/// A `read_plan` line: a read the foreign decode code planned, with its session in hex.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReadPlanLine {
    request: String,
    transfer_id: String,
    /// The foreign decode rank that plans it.
    engine: u16,
    dp: u16,
    tp: u16,
    /// The prefill rank it reads, in the request's prefill engine.
    source_dp: u16,
    source_tp: u16,
    block_ids: Vec<u64>,
    /// The peer metadata's `agent_metadata`.
    engine_desc: String,
    /// The remote memory descriptors of the sessions it reads through.
    memory_descs: Vec<String>,
}

/// Why a `read_plan` line is not a plan of this run (a protocol error of the driver's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum PlanRefused {
    /// The reader is no rank of the foreign decode side.
    NotPlayed(RankId),
    /// The request is not one the driver was given and has not answered.
    NotHeld(String),
    /// The transfer is not the request's.
    OtherTransfer { request: String, named: String, held: TransferId },
    /// The source is no prefill rank of the request's engine.
    NoSuchSource(RankId),
    /// A descriptor is not hex.
    NotHex { field: String, detail: String },
}

impl std::fmt::Display for PlanRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanRefused::NotPlayed(rank) => {
                write!(f, "a read planned on {rank}, which the driver does not play")
            }
            PlanRefused::NotHeld(request) => {
                write!(
                    f,
                    "a read for request {request:?}, which the driver was not given or answered already"
                )
            }
            PlanRefused::OtherTransfer { request, named, held } => {
                write!(f, "a read of {named:?} for request {request}, whose transfer is {held}")
            }
            PlanRefused::NoSuchSource(rank) => write!(f, "a read of {rank}, which the deployment lacks"),
            PlanRefused::NotHex { field, detail } => write!(f, "{field} is not hex: {detail}"),
        }
    }
}

/// What the reader thread hands the scheduler.
pub(super) enum DriverEvent {
    /// A line, parsed.
    Msg(FromDriver),
    /// A line that is not a message of the protocol (the text says what and which line).
    Garbled(String),
    /// The driver closed its output (it exited, or is about to).
    Closed,
}

/// The lines queued for the driver and not yet written to its input, shared by the scheduler
/// (which adds) and the writer thread (which takes away). Never held during I/O.
#[derive(Debug)]
struct Outbox {
    lines: usize,
    bytes: usize,
    /// When the writer last finished a line, or the queue last became non-empty.
    since: Instant,
}

/// How the driver ended badly.
#[derive(Debug)]
pub enum DriverExit {
    /// It exited with a failing status.
    Status(std::process::ExitStatus),
    /// It could not be waited for.
    Wait(std::io::Error),
}

impl std::fmt::Display for DriverExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DriverExit::Status(status) => write!(f, "the foreign driver exited with {status}"),
            DriverExit::Wait(e) => write!(f, "cannot wait for the foreign driver: {e}"),
        }
    }
}

impl std::error::Error for DriverExit {}

/// The running driver.
pub(super) struct Driver {
    child: Child,
    /// Its process group (its own pid: it leads the group).
    pgid: u32,
    /// Lines to its input, through the writer thread; `None` once closed or failed.
    input: Option<SyncSender<Vec<u8>>>,
    outbox: Arc<Mutex<Outbox>>,
    pub(super) ready: bool,
    pub(super) said_bye: bool,
    pub(super) closed: bool,
    /// Why the driver counts as failed (it stopped reading its input), once it does.
    pub(super) failed: Option<String>,
    /// Whether [`Driver::check_drained`] gave the failure's reason already.
    failure_told: bool,
    /// Whether it was killed at the end of the run, and why.
    pub(super) killed: Option<String>,
}

impl Driver {
    /// Starts the driver; its lines arrive on `tx` as [`Ev::Driver`].
    pub(super) fn start(foreign: &Foreign, tx: Sender<Ev>) -> Result<Driver, SpawnError> {
        let mut command = Command::new(&foreign.program);
        command
            .args(&foreign.args)
            // Its own process group, as the connectors: a Ctrl-C reaches only `pdkv cluster`,
            // and the end of the run kills the group, with whatever the driver started.
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        crate::signals::die_with_parent(&mut command);
        let mut child = command.spawn().map_err(|error| SpawnError {
            what: Spawned::ForeignDriver,
            program: foreign.program.clone(),
            error,
        })?;
        let stdin = child.stdin.take().expect("stdin was piped");
        let stdout = child.stdout.take().expect("stdout was piped");
        thread::spawn(move || read_lines(stdout, &tx));
        let outbox = Arc::new(Mutex::new(Outbox { lines: 0, bytes: 0, since: Instant::now() }));
        let (input, lines) = mpsc::sync_channel(MAX_QUEUED_LINES);
        let shared = outbox.clone();
        thread::spawn(move || write_lines(stdin, &lines, &shared));
        Ok(Driver {
            pgid: child.id(),
            child,
            input: Some(input),
            outbox,
            ready: false,
            said_bye: false,
            closed: false,
            failed: None,
            failure_told: false,
            killed: None,
        })
    }

    /// Queues one message for the driver without ever waiting for it to read; a full queue
    /// fails the driver.
    pub(super) fn send(&mut self, msg: &ToDriver) {
        let Some(input) = self.input.as_ref() else { return };
        let mut line = serde_json::to_vec(msg).expect("driver messages serialise");
        line.push(b'\n');
        let len = line.len();
        let mut outbox = self.outbox.lock().unwrap_or_else(PoisonError::into_inner);
        if outbox.bytes + len > MAX_QUEUED_BYTES {
            let (lines, bytes) = (outbox.lines, outbox.bytes);
            drop(outbox);
            return self.fail(format!(
                "the foreign driver stopped reading its input: {lines} lines ({bytes} bytes) wait \
                 unread, and the queue holds at most {MAX_QUEUED_BYTES} bytes"
            ));
        }
        if outbox.lines == 0 {
            outbox.since = Instant::now();
        }
        outbox.lines += 1;
        outbox.bytes += len;
        match input.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                outbox.lines -= 1;
                outbox.bytes -= len;
                drop(outbox);
                self.fail(format!(
                    "the foreign driver stopped reading its input: {MAX_QUEUED_LINES} lines wait unread"
                ));
            }
            Err(TrySendError::Disconnected(_)) => {
                // The writer ended: the driver closed its input (it exits, and its output's
                // end says so).
                outbox.lines -= 1;
                outbox.bytes -= len;
                drop(outbox);
                self.input = None;
            }
        }
    }

    fn fail(&mut self, why: String) {
        self.input = None;
        self.failed.get_or_insert(why);
    }

    /// Fails the driver when lines have waited unread for longer than `limit`; the reason of its
    /// failure (this one, or a full queue's), the first time it is asked after the failure.
    pub(super) fn check_drained(&mut self, limit: Duration) -> Option<String> {
        if let Some(failed) = self.failed.as_ref().filter(|_| !self.failure_told) {
            self.failure_told = true;
            return Some(failed.clone());
        }
        if self.failed.is_some() || self.closed {
            return None;
        }
        let outbox = self.outbox.lock().unwrap_or_else(PoisonError::into_inner);
        let waited = outbox.since.elapsed();
        if outbox.lines == 0 || waited <= limit {
            return None;
        }
        let why = format!(
            "the foreign driver stopped reading its input: {} lines ({} bytes) waited unread for \
             {:.1} s (the limit is {:.1} s)",
            outbox.lines,
            outbox.bytes,
            waited.as_secs_f64(),
            limit.as_secs_f64()
        );
        drop(outbox);
        self.fail(why.clone());
        self.failure_told = true;
        Some(why)
    }

    /// Gives the driver a fresh window to read its input: the scheduler itself was not running
    /// (stopped, or starved), and neither was the writer thread.
    pub(super) fn fresh_window(&mut self) {
        self.outbox.lock().unwrap_or_else(PoisonError::into_inner).since = Instant::now();
    }

    /// Closes the driver's input: it reads what is queued, then its end.
    pub(super) fn close_input(&mut self) {
        self.input = None;
    }

    /// Whether the driver has exited (reaped), with its status.
    pub(super) fn exited(&mut self) -> Option<Result<(), DriverExit>> {
        match self.child.try_wait() {
            Ok(Some(status)) if status.success() => Some(Ok(())),
            Ok(Some(status)) => Some(Err(DriverExit::Status(status))),
            Ok(None) => None,
            Err(e) => Some(Err(DriverExit::Wait(e))),
        }
    }

    /// Ends the driver: kills what is left of its process group (the driver, if it did not exit
    /// by now, and anything it started), and says what had to be killed.
    pub(super) fn finish(&mut self, exited: Option<Result<(), DriverExit>>) -> Vec<String> {
        self.input = None;
        let mut problems = Vec::new();
        let still_running = exited.is_none();
        // Kill the group before reaping a leader still running, so that its id cannot be reused
        // meanwhile (one that exited already was reaped, but the id stays taken while any
        // member of its group lives, and only then is there anything to kill).
        let killed_any = crate::signals::kill_group(self.pgid, crate::signals::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(Err(e)) = exited {
            problems.push(e.to_string());
        }
        if !self.ready {
            // It never became ready: the start's error says what happened.
            return problems;
        }
        if still_running {
            let why = match (&self.failed, self.said_bye) {
                (Some(failed), _) => format!("{failed}; killed it and its process group"),
                (None, true) => "the foreign driver said bye but did not exit; killed it and its \
                                 process group"
                    .to_string(),
                (None, false) => "the foreign driver did not answer shutdown; killed it and its process \
                                  group"
                    .to_string(),
            };
            self.killed = Some(why.clone());
            problems.push(why);
        } else if killed_any {
            let why =
                "the foreign driver exited, leaving processes of its group running; killed them".to_string();
            self.killed = Some(why.clone());
            problems.push(why);
        }
        problems
    }
}

impl Drop for Driver {
    /// A run that ends without [`Driver::finish`] (a panic) still takes the driver's group down.
    fn drop(&mut self) {
        if self.child.try_wait().is_ok_and(|s| s.is_none()) {
            crate::signals::kill_group(self.pgid, crate::signals::SIGKILL);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Writes the queued lines to the driver's input until the queue closes or the driver's input
/// does; blocking here blocks no one else.
fn write_lines(mut stdin: ChildStdin, lines: &Receiver<Vec<u8>>, outbox: &Mutex<Outbox>) {
    for line in lines {
        if stdin.write_all(&line).and_then(|()| stdin.flush()).is_err() {
            return;
        }
        let mut outbox = outbox.lock().unwrap_or_else(PoisonError::into_inner);
        outbox.lines -= 1;
        outbox.bytes -= line.len();
        outbox.since = Instant::now();
    }
}

/// Reads the driver's lines until it closes its output, each line bounded.
fn read_lines(stdout: impl Read, tx: &Sender<Ev>) {
    let mut reader = BufReader::new(stdout);
    let mut number = 0u64;
    loop {
        let mut line = Vec::new();
        match (&mut reader).take(MAX_LINE_BYTES + 1).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        number += 1;
        let event = if line.last() != Some(&b'\n') && line.len() as u64 > MAX_LINE_BYTES {
            let _ = tx.send(Ev::Driver(DriverEvent::Garbled(format!(
                "line {number} of the foreign driver is longer than {MAX_LINE_BYTES} bytes; \
                 no longer reading it"
            ))));
            break;
        } else {
            parse_line(number, &line)
        };
        if tx.send(Ev::Driver(event)).is_err() {
            return;
        }
    }
    let _ = tx.send(Ev::Driver(DriverEvent::Closed));
}

/// One line of the driver, parsed, or what is wrong with it.
fn parse_line(number: u64, line: &[u8]) -> DriverEvent {
    match serde_json::from_slice::<FromDriver>(line.trim_ascii()) {
        Ok(msg) => DriverEvent::Msg(msg),
        Err(e) => {
            let shown = String::from_utf8_lossy(&line[..line.len().min(120)]).trim_end().to_string();
            DriverEvent::Garbled(format!("line {number} of the foreign driver ({shown:?}): {e}"))
        }
    }
}

/// The foreign side of a mixed run: its driver, what the run learnt from and about the side it
/// plays, and its report. Empty, with no driver, in a run without a foreign side.
pub(super) struct ForeignSide {
    /// The driver playing the foreign side, if any.
    pub(super) driver: Option<Driver>,
    /// Foreign prefill: each data-plane-only rank's handshake reply, for the driver's setup.
    pub(super) replies: BTreeMap<RankId, [Vec<u8>; 2]>,
    /// The descriptors each prefill process (rank, life) handed out, to tell whose session a
    /// foreign decode's planned read goes through ([`foreign_reads`]).
    pub(super) lives: BTreeMap<(RankId, u32), Life>,
    /// Foreign decode: requests handed to the driver and not yet answered.
    pub(super) pending: BTreeSet<RequestId>,
    /// Foreign prefill: transfers each foreign rank reported finished (a second report is a
    /// violation).
    pub(super) finished: BTreeSet<(RankId, TransferId)>,
    pub(super) report: ForeignReport,
    /// Foreign prefill ranks whose data-plane server restarted and whose driver has not yet
    /// said `restarted`: not ready.
    pub(super) restarting: BTreeSet<RankId>,
    /// Foreign prefill: transfers told to live ranks whose `registered` has not come yet, with
    /// the request whose proxy answer waits for them.
    pub(super) registering: BTreeMap<TransferId, Registering>,
}

/// A prefilled request whose answer to the proxy waits for foreign ranks to say `registered`.
pub(super) struct Registering {
    pub(super) request: RequestId,
    /// The ranks still to say it.
    pub(super) ranks: BTreeSet<RankId>,
}

impl ForeignSide {
    /// A foreign side without a driver yet, reporting into `report`.
    pub(super) fn new(report: ForeignReport) -> ForeignSide {
        ForeignSide {
            driver: None,
            replies: BTreeMap::new(),
            lives: BTreeMap::new(),
            pending: BTreeSet::new(),
            finished: BTreeSet::new(),
            report,
            restarting: BTreeSet::new(),
            registering: BTreeMap::new(),
        }
    }

    /// Queues `msg` for the driver, if there is one.
    pub(super) fn tell(&mut self, msg: &ToDriver) {
        if let Some(driver) = self.driver.as_mut() {
            driver.send(msg);
        }
    }

    /// A foreign decode group takes request `id`.
    pub(super) fn recv(&mut self, id: RequestId, engine: EngineId, dp: u16, params: KvTransferParams) {
        self.pending.insert(id);
        let msg = ToDriver::Recv {
            request: id.0.to_string(),
            engine: engine.index,
            dp,
            params,
            local_block_ids: Vec::new(),
        };
        self.tell(&msg);
    }

    /// `--kill` stopped a foreign prefill rank's data-plane server: the driver stops the rank's
    /// listeners and forgets what it held, as the process's death would.
    pub(super) fn killed(&mut self, rank: RankId) {
        self.tell(&ToDriver::Kill { engine: rank.engine.index, dp: rank.dp, tp: rank.tp });
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Cluster {
    pub(super) fn foreign_side(&self) -> Option<Role> {
        self.config.foreign.as_ref().map(|f| f.side)
    }

    pub(super) fn is_foreign(&self, engine: EngineId) -> bool {
        self.foreign_side() == Some(engine.role)
    }

    /// The setup message: the foreign engines, and on the prefill side each rank's reply.
    pub(super) fn driver_setup(&self) -> Result<ToDriver, DriverSetupError> {
        let foreign = self.config.foreign.as_ref().expect("a foreign side");
        let side = foreign.side;
        let engines = self
            .d
            .engines(side)
            .iter()
            .enumerate()
            .map(|(i, layout)| {
                let address = &self.addresses[&EngineId { role: side, index: i as u16 }];
                EngineView {
                    engine: i as u16,
                    dp: layout.dp,
                    tp: layout.tp,
                    handshake_port_base: address.handshake_port_base,
                    notify_port_base: address.notify_port_base,
                    engine_id: address.engine_id(),
                }
            })
            .collect();
        let mut ranks = Vec::new();
        if side == Role::Prefill {
            for rank in self.d.ranks(Role::Prefill) {
                ranks.push(self.rank_view(rank)?);
            }
        }
        let m = &self.d.model;
        Ok(ToDriver::Setup {
            side: side.name(),
            rules: foreign.rules.to_string(),
            host: self.config.host.clone(),
            model: ModelView {
                use_mla: m.use_mla,
                kv_heads: m.kv_heads,
                layers: m.layers,
                block_size_tokens: m.block_size_tokens,
            },
            engines,
            ranks,
        })
    }

    /// A foreign prefill rank as the driver binds it: the handshake reply its data-plane server
    /// (its latest life) stands behind.
    fn rank_view(&self, rank: RankId) -> Result<RankView, DriverSetupError> {
        let [metadata, layers] = self.foreign.replies.get(&rank).ok_or(DriverSetupError::NoReply(rank))?;
        let metadata = match wire::decode(metadata) {
            Ok(ControlMessage::HandshakeMetadata(m)) => m,
            other => return Err(DriverSetupError::Metadata { rank, got: format!("{other:?}") }),
        };
        let layers = wire::decode_layer_memory_descs(layers)
            .map_err(|error| DriverSetupError::Layers { rank, error })?;
        Ok(RankView {
            engine: rank.engine.index,
            dp: rank.dp,
            tp: rank.tp,
            metadata: MetadataView {
                engine_id: metadata.engine_id,
                agent_metadata: hex(&metadata.agent_metadata),
                kv_caches_base_addr: metadata.kv_caches_base_addr,
                num_blocks: metadata.num_blocks,
                block_len: metadata.block_len,
                attn_backend_name: metadata.attn_backend_name,
            },
            layers: layers
                .into_iter()
                .map(|l| LayerView { name: l.layer_name, descs: l.descs.iter().map(|d| hex(d)).collect() })
                .collect(),
        })
    }

    /// The restarted data-plane server of a foreign prefill rank is ready: the driver starts the
    /// rank again, a fresh process of its code answering with the new server's descriptors,
    /// and the rank counts as ready once the driver says `restarted`.
    pub(super) fn foreign_restart(&mut self, rank: RankId) {
        match self.rank_view(rank) {
            Ok(view) => {
                self.foreign.restarting.insert(rank);
                self.foreign.tell(&ToDriver::Restart { rank: view });
            }
            Err(e) => self.tally.problem(format!("restart of the foreign {rank}: {e}")),
        }
    }

    /// Records the descriptors a prefill process handed out in its handshake reply (metadata,
    /// layer map), to name the process a foreign read plan's session is of.
    pub(super) fn record_life(
        &mut self,
        rank: RankId,
        incarnation: Option<pdkv_core::ids::Incarnation>,
        reply: &[Vec<u8>; 2],
    ) {
        let Some(proc) = self.procs.ranks.get(&rank) else { return };
        let engine_desc = match wire::decode(&reply[0]) {
            Ok(ControlMessage::HandshakeMetadata(m)) => m.agent_metadata,
            _ => return self.tally.problem(format!("{rank}'s handshake metadata does not decode")),
        };
        let Ok(layers) = wire::decode_layer_memory_descs(&reply[1]) else {
            return self.tally.problem(format!("{rank}'s layer descriptors do not decode"));
        };
        let memory_descs = layers.into_iter().flat_map(|l| l.descs).collect();
        self.foreign.lives.insert((rank, proc.life), Life { incarnation, engine_desc, memory_descs });
    }

    /// A foreign decode rank planned a read: judged and counted, or refused when the line
    /// cannot be a plan of this run.
    fn read_planned(&mut self, line: ReadPlanLine) -> Result<(), PlanRefused> {
        let ReadPlanLine { request, transfer_id, engine, dp, tp, source_dp, source_tp, block_ids, .. } = line;
        let reader = RankId::new(EngineId::decode(engine), dp, tp);
        let source = (source_dp, source_tp);
        if self.foreign_side() != Some(Role::Decode) || !self.d.ranks(Role::Decode).contains(&reader) {
            return Err(PlanRefused::NotPlayed(reader));
        }
        let req = request
            .parse()
            .ok()
            .map(RequestId)
            .filter(|id| self.foreign.pending.contains(id))
            .and_then(|id| self.clients.requests.get(&id))
            .ok_or_else(|| PlanRefused::NotHeld(request.clone()))?;
        if *req.transfer_id.as_str() != *transfer_id {
            return Err(PlanRefused::OtherTransfer {
                request,
                named: transfer_id,
                held: req.transfer_id.clone(),
            });
        }
        let source_rank = RankId::new(EngineId::prefill(req.prefill.0 as u16), source.0, source.1);
        if !self.d.ranks(Role::Prefill).contains(&source_rank) {
            return Err(PlanRefused::NoSuchSource(source_rank));
        }
        let bad_hex = |field: String| move |detail| PlanRefused::NotHex { field, detail };
        let engine_desc = foreign_reads::unhex(&line.engine_desc).map_err(bad_hex("engine_desc".into()))?;
        let memory_descs = line
            .memory_descs
            .iter()
            .enumerate()
            .map(|(i, d)| foreign_reads::unhex(d).map_err(bad_hex(format!("memory_descs[{i}]"))))
            .collect::<Result<Vec<_>, _>>()?;
        // The holder is the owner DP group's process of that TP rank; a read of another DP
        // rank reads a rank that does not hold the transfer.
        let holder = (source.0 == req.prefill.1).then(|| req.holders.get(&source.1).copied()).flatten();
        let held = req.prefill_blocks.clone();
        let plan = Plan { source: source_rank, block_ids, engine_desc, memory_descs };
        let live = self.procs.ranks.get(&source_rank).filter(|p| p.alive).map(|p| p.life);
        let verdict = foreign_reads::judge(&plan, &held, holder, &self.foreign.lives, live);
        self.foreign.report.reads.count(reader, source_rank, &transfer_id, &verdict);
        Ok(())
    }

    /// A line of the driver during the run; `Some` is a problem that ends the start.
    pub(super) fn on_driver(&mut self, event: DriverEvent) -> Option<StartError> {
        let msg = match event {
            DriverEvent::Msg(msg) => msg,
            DriverEvent::Garbled(detail) => {
                // Before it is ready the driver is not talking the protocol at all: stop there.
                if !self.foreign.driver.as_ref().is_some_and(|d| d.ready) {
                    return Some(StartError::DriverGarbled(detail));
                }
                self.tally.violation(ViolationKind::ProtocolError, detail);
                return None;
            }
            DriverEvent::Closed => {
                let driver = self.foreign.driver.as_mut()?;
                driver.closed = true;
                if !driver.said_bye {
                    if !driver.ready {
                        return Some(StartError::DriverExited);
                    }
                    let detail = "the foreign driver closed its output (exited?) during the run".to_string();
                    self.hung.get_or_insert(detail);
                }
                return None;
            }
        };
        match msg {
            FromDriver::Ready {} => {
                if let Some(driver) = self.foreign.driver.as_mut() {
                    driver.ready = true;
                }
            }
            FromDriver::Error { detail } => return Some(StartError::DriverFailed(detail)),
            FromDriver::Problem { detail } => self.tally.problem(format!("foreign driver: {detail}")),
            FromDriver::Bye { stats } => {
                self.foreign.report.stats = stats;
                if let Some(driver) = self.foreign.driver.as_mut() {
                    driver.said_bye = true;
                }
            }
            FromDriver::Received { request, ok, error } => {
                let Some(id) =
                    request.parse().ok().map(RequestId).filter(|id| self.foreign.pending.remove(id))
                else {
                    self.tally.violation(
                        ViolationKind::ProtocolError,
                        format!("the foreign driver reported request {request:?}, which it was not given"),
                    );
                    return None;
                };
                if ok {
                    self.foreign.report.received += 1;
                    if let Some(req) = self.clients.requests.get_mut(&id) {
                        let now = std::time::Instant::now();
                        req.first_token = Some(now);
                        self.tally.record_first_token((now - req.started).as_secs_f64() * 1e3);
                    }
                    self.end(id, None);
                } else {
                    let error = error.unwrap_or_else(|| "no reason given".into());
                    self.end(id, Some(vec![format!("foreign decode: {error}")]));
                }
            }
            FromDriver::Restarted { engine, dp, tp } => {
                let rank = RankId::new(EngineId::prefill(engine), dp, tp);
                if !self.foreign.restarting.remove(&rank) {
                    self.tally.violation(
                        ViolationKind::ProtocolError,
                        format!("the foreign driver restarted {rank}, which it was not asked to restart"),
                    );
                    return None;
                }
                self.rank_up(rank);
            }
            FromDriver::Registered { transfer_id, engine, dp, tp } => {
                let rank = RankId::new(EngineId::prefill(engine), dp, tp);
                let transfer_id = TransferId::new(transfer_id);
                // A rank killed since may say it late, of a transfer the reaper already retired.
                let told = self.d.ranks(Role::Prefill).contains(&rank)
                    && (self.prefill.registered.contains_key(&(rank, transfer_id.clone()))
                        || self.procs.ranks.get(&rank).is_some_and(|p| p.killed_by_fault || p.life > 0));
                if !told {
                    self.tally.violation(
                        ViolationKind::ProtocolError,
                        format!("the foreign {rank} registered {transfer_id}, which it was never given"),
                    );
                    return None;
                }
                self.foreign_registered(rank, &transfer_id);
            }
            FromDriver::ReadPlan(line) => {
                if let Err(refused) = self.read_planned(line) {
                    let detail = format!("the foreign driver's read_plan: {refused}");
                    self.tally.violation(ViolationKind::ProtocolError, detail);
                }
            }
            FromDriver::Finished { transfer_id, engine, dp, tp } => {
                let rank = RankId::new(EngineId::prefill(engine), dp, tp);
                let transfer_id = TransferId::new(transfer_id);
                let held = self.d.ranks(Role::Prefill).contains(&rank)
                    && self.prefill.registered.contains_key(&(rank, transfer_id.clone()))
                    && self.foreign.finished.insert((rank, transfer_id.clone()));
                if !held {
                    self.foreign.report.unexpected_finishes += 1;
                    self.tally.violation(
                        ViolationKind::ProtocolError,
                        format!(
                            "the foreign {rank} reported {transfer_id} finished, which it does not hold \
                             or reported before"
                        ),
                    );
                    return None;
                }
                self.foreign.report.finished += 1;
                self.engine(
                    usize::from(engine),
                    pdkv_core::prefill::EngineEvent::WorkerFinished { rank, transfer_id },
                );
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_lines_parse_or_say_what_is_wrong() {
        let check =
            |line: &str, expected: Result<FromDriver, &str>| match (parse_line(7, line.as_bytes()), expected)
            {
                (DriverEvent::Msg(got), Ok(want)) => assert_eq!(got, want, "{line}"),
                (DriverEvent::Garbled(got), Err(want)) => {
                    assert!(got.starts_with("line 7 of the foreign driver") && got.contains(want), "{got}")
                }
                (_, want) => panic!("{line}: expected {want:?}"),
            };
        check("{\"op\":\"ready\"}\n", Ok(FromDriver::Ready {}));
        check(
            "{\"op\":\"received\",\"request\":\"3\",\"ok\":true}",
            Ok(FromDriver::Received { request: "3".into(), ok: true, error: None }),
        );
        check(
            "{\"op\":\"finished\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":1,\"tp\":2}",
            Ok(FromDriver::Finished { transfer_id: "t".into(), engine: 0, dp: 1, tp: 2 }),
        );
        check(
            "{\"op\":\"registered\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":1,\"tp\":2}",
            Ok(FromDriver::Registered { transfer_id: "t".into(), engine: 0, dp: 1, tp: 2 }),
        );
        check("{\"op\":\"bye\"}", Ok(FromDriver::Bye { stats: BTreeMap::new() }));
        check(
            "{\"op\":\"restarted\",\"engine\":0,\"dp\":0,\"tp\":1}",
            Ok(FromDriver::Restarted { engine: 0, dp: 0, tp: 1 }),
        );
        check(
            "{\"op\":\"read_plan\",\"request\":\"3\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":0,\"tp\":1,\
             \"source_dp\":0,\"source_tp\":1,\"block_ids\":[4,5],\"engine_desc\":\"0a\",\"memory_descs\":[\"0b\"]}",
            Ok(FromDriver::ReadPlan(ReadPlanLine {
                request: "3".into(),
                transfer_id: "t".into(),
                engine: 0,
                dp: 0,
                tp: 1,
                source_dp: 0,
                source_tp: 1,
                block_ids: vec![4, 5],
                engine_desc: "0a".into(),
                memory_descs: vec!["0b".into()],
            })),
        );
        // A plan missing its session, or with a negative block id, is not a plan.
        check(
            "{\"op\":\"read_plan\",\"request\":\"3\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":0,\"tp\":1,\
             \"source_dp\":0,\"source_tp\":1,\"block_ids\":[4]}",
            Err("missing field `engine_desc`"),
        );
        check(
            "{\"op\":\"read_plan\",\"request\":\"3\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":0,\"tp\":1,\
             \"source_dp\":0,\"source_tp\":1,\"block_ids\":[-4],\"engine_desc\":\"\",\"memory_descs\":[]}",
            Err("-4"),
        );
        check("{\"op\":\"restarted\",\"engine\":0,\"dp\":0}", Err("missing field `tp`"));
        check(
            "{\"op\":\"read_plan\",\"request\":\"3\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":0,\"tp\":1,\
             \"source_dp\":0,\"source_tp\":1,\"block_ids\":[],\"engine_desc\":\"\",\"memory_descs\":[],\"x\":1}",
            Err("unknown field `x`"),
        );
        check("{\"op\":\"launch\"}", Err("unknown variant `launch`"));
        check("{\"op\":\"finished\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":1,\"tp\":70000}", Err("70000"));
        check("{\"op\":\"ready\",\"extra\":1}", Err("unknown field `extra`"));
        check("not json", Err("expected"));
    }

    #[test]
    fn messages_to_the_driver_are_tagged_lines() {
        let msg = ToDriver::Retire { transfer_id: "t".into(), engine: 0, dp: 1, tp: 0 };
        assert_eq!(
            serde_json::to_string(&msg).unwrap(),
            "{\"op\":\"retire\",\"transfer_id\":\"t\",\"engine\":0,\"dp\":1,\"tp\":0}"
        );
        assert_eq!(serde_json::to_string(&ToDriver::Shutdown).unwrap(), "{\"op\":\"shutdown\"}");
        assert_eq!(
            serde_json::to_string(&ToDriver::Kill { engine: 0, dp: 1, tp: 0 }).unwrap(),
            "{\"op\":\"kill\",\"engine\":0,\"dp\":1,\"tp\":0}"
        );
        let rank = RankView {
            engine: 0,
            dp: 0,
            tp: 1,
            metadata: MetadataView {
                engine_id: "e".into(),
                agent_metadata: "0a".into(),
                kv_caches_base_addr: vec![4096],
                num_blocks: 2,
                block_len: 64,
                attn_backend_name: "FLASH_ATTN".into(),
            },
            layers: vec![LayerView { name: "l0".into(), descs: vec!["0b".into()] }],
        };
        assert_eq!(
            serde_json::to_string(&ToDriver::Restart { rank }).unwrap(),
            "{\"op\":\"restart\",\"rank\":{\"engine\":0,\"dp\":0,\"tp\":1,\"metadata\":{\"engine_id\":\"e\",\
             \"agent_metadata\":\"0a\",\"kv_caches_base_addr\":[4096],\"num_blocks\":2,\"block_len\":64,\
             \"attn_backend_name\":\"FLASH_ATTN\"},\"layers\":[{\"name\":\"l0\",\"descs\":[\"0b\"]}]}}"
        );
        assert_eq!(
            PlanRefused::NotHex { field: "memory_descs[2]".into(), detail: "not hex at character 0".into() }
                .to_string(),
            "memory_descs[2] is not hex: not hex at character 0"
        );
    }
}
