//! One rank's driver running inside its host program's process (a vLLM worker): the same
//! prefill or decode driver `pdkv cluster` runs as a process, on a thread, with its scheduler
//! link a channel the host drains and its KV in regions the host stages vLLM's blocks into.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use pdkv_core::ids::{RankId, Role, TransferId};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::policy::PeerBook;

use super::config::Engine;
use super::metrics::RankMetrics;
use crate::message_faults::SenderFaults;
use crate::rank_io::{Clock, Context, Input, SchedLink, StageError, StagedKv};
use crate::sched::{ControlSetup, FromRank, Setup, ToRank};

/// Where the staged regions of an in-process rank start; any base serves, since addresses name
/// memory only inside this process's registry.
const STAGED_BASE: u64 = 1 << 44;

/// Why an in-process rank could not start or be reached.
#[derive(Debug)]
pub enum RankError {
    /// The KV geometry the host described does not fit.
    Staging(StageError),
    /// The rank's thread could not be started.
    Spawn(std::io::Error),
    /// The rank's thread has ended (its error, if it said one, came as `SetupFailed`).
    Gone,
    /// The driver did not acknowledge a staged transfer in time.
    Unanswered,
    /// The metrics endpoint could not start.
    Metrics {
        /// Where it was to listen.
        addr: String,
        /// Why not.
        error: std::io::Error,
    },
}

impl std::fmt::Display for RankError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankError::Staging(e) => write!(f, "KV staging regions: {e}"),
            RankError::Spawn(e) => write!(f, "cannot start the rank's thread: {e}"),
            RankError::Gone => f.write_str("the rank's driver has stopped"),
            RankError::Unanswered => f.write_str("the rank's driver did not take the staged blocks in time"),
            RankError::Metrics { addr, error } => write!(f, "metrics endpoint at {addr}: {error}"),
        }
    }
}

impl std::error::Error for RankError {}

/// A rank's driver on a thread of this process.
pub struct InProcessRank {
    rank: RankId,
    tx: Sender<Input>,
    rx: Mutex<Receiver<FromRank>>,
    staged: Arc<StagedKv>,
    thread: Mutex<Option<JoinHandle<()>>>,
    metrics: Arc<Mutex<RankMetrics>>,
    metrics_addr: Option<SocketAddr>,
    /// What the driver said while [`InProcessRank::staged_transfer`] waited, for the next poll.
    backlog: Mutex<Vec<FromRank>>,
}

/// What `rank` applies to the control messages it sends: the engine's faults, each counted per
/// rank, with a stream of the seed of its own (the cluster's numbering of ranks).
fn sender_faults(engine: &Engine, rank: RankId) -> SenderFaults {
    let d = &engine.deployment;
    let slot = match rank.engine.role {
        Role::Prefill => d.rank_index(rank),
        Role::Decode => d.ranks(Role::Prefill).len() + d.rank_index(rank),
    };
    let faults = engine.message_faults.iter().enumerate().map(|(i, f)| (i as u16, f.clone())).collect();
    SenderFaults { seed: engine.fault_seed, stream: 16 + slot as u64, faults }
}

impl InProcessRank {
    /// Starts `rank` of `engine` with KV regions of `num_blocks` blocks per layer, each of the
    /// size the model gives a block on this rank.
    pub fn start(engine: &Engine, rank: RankId, num_blocks: u32) -> Result<InProcessRank, RankError> {
        let d = &engine.deployment;
        let layout = d.layout(rank.engine);
        let block_len =
            u64::from(d.model.block_size_tokens) * d.model.bytes_per_token_per_layer_per_rank(layout.tp);
        let staged = Arc::new(
            StagedKv::new(STAGED_BASE, d.model.layers, num_blocks, block_len).map_err(RankError::Staging)?,
        );
        let setup = Setup {
            model: d.model.clone(),
            legacy: LegacyOptions::default(),
            address: engine.address.clone(),
            num_blocks,
            transport: engine.transport,
            rdma_device: engine.rdma_device(rank),
            timeouts: engine.timeouts,
            per_request_reads: false,
            message_faults: sender_faults(engine, rank),
            life: 0,
            peers: PeerBook::default(),
            data_plane_only: false,
            control: ControlSetup::default(),
        };
        let metrics = Arc::new(Mutex::new(RankMetrics::new(rank, engine.nic(rank))));
        let metrics_addr = match engine.metrics_port {
            None => None,
            Some(base) => {
                // The rank's offset from the base is the core's, as for its listeners.
                let at =
                    pdkv_core::ports::EngineAddress { handshake_port_base: base, ..engine.address.clone() };
                let addr = format!("{}:{base} + the offset of {rank}", engine.address.host);
                let bad = |error| RankError::Metrics { addr: addr.clone(), error };
                let endpoint = at
                    .dial(layout, rank, pdkv_core::ports::ListenerKind::Handshake)
                    .map_err(|e| bad(std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())))?;
                let resolved = (endpoint.host.as_str(), endpoint.port)
                    .to_socket_addrs()
                    .map_err(bad)?
                    .next()
                    .ok_or_else(|| bad(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
                Some(super::metrics::serve(resolved, metrics.clone()).map_err(bad)?)
            }
        };
        let (tx, rx) = mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel();
        let ctx = Context {
            deployment: d.clone(),
            rank,
            setup,
            link: SchedLink::channel(out_tx),
            tx: tx.clone(),
            rx,
            clock: Clock::start(),
            incarnation: crate::connector::draw_incarnation(),
            staged: Some(staged.clone()),
        };
        let thread = thread::Builder::new()
            .name(format!("pdkv {rank}"))
            .spawn(move || {
                // The error, if any, was sent as `SetupFailed` or ends the channel; the host
                // sees either.
                let _ = match rank.engine.role {
                    Role::Prefill => crate::prefill_rank::run(ctx),
                    Role::Decode => crate::decode_rank::run(ctx),
                };
            })
            .map_err(RankError::Spawn)?;
        Ok(InProcessRank {
            rank,
            tx,
            rx: Mutex::new(out_rx),
            staged,
            thread: Mutex::new(Some(thread)),
            metrics,
            metrics_addr,
            backlog: Mutex::new(Vec::new()),
        })
    }

    /// The rank.
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// The KV regions the host stages blocks into and out of.
    pub fn staged(&self) -> &StagedKv {
        &self.staged
    }

    /// Hands the driver a message, as its scheduler would.
    pub fn deliver(&self, msg: ToRank) -> Result<(), RankError> {
        self.metrics.lock().unwrap_or_else(PoisonError::into_inner).observe_to(&msg);
        self.tx.send(Input::Sched(msg)).map_err(|_| RankError::Gone)
    }

    /// Where the rank serves its metrics, if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The rank's metrics in Prometheus's text format.
    pub fn metrics_text(&self) -> String {
        self.metrics.lock().unwrap_or_else(PoisonError::into_inner).render()
    }

    /// The blocks of `transfer_id` hold its KV now (the host staged every layer): the driver
    /// grants them to the transfer, in order with what it was told before (a retirement that
    /// fences the same blocks for the transfer that held them last comes first), and this
    /// returns once it has, so a decode rank the host's answer reaches can read them however
    /// fast it comes. Waits up to `timeout`.
    pub fn staged_transfer(
        &self,
        transfer_id: TransferId,
        blocks: Vec<u32>,
        timeout: Duration,
    ) -> Result<(), RankError> {
        self.deliver(ToRank::Prefill { transfer_id: transfer_id.clone(), blocks })?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now()).ok_or(RankError::Unanswered)?;
            let msgs = self.receive(left)?;
            let mut backlog = self.backlog.lock().unwrap_or_else(PoisonError::into_inner);
            let mut acked = false;
            for msg in msgs {
                match &msg {
                    FromRank::Prefilled { transfer_id: id } if *id == transfer_id => acked = true,
                    _ => backlog.push(msg),
                }
            }
            if acked {
                return Ok(());
            }
        }
    }

    /// What the driver said: waits up to `timeout` for the first message, then takes every one
    /// waiting. Empty on timeout; `Gone` once the driver has stopped and said everything.
    pub fn poll(&self, timeout: Duration) -> Result<Vec<FromRank>, RankError> {
        let kept = std::mem::take(&mut *self.backlog.lock().unwrap_or_else(PoisonError::into_inner));
        if !kept.is_empty() {
            return Ok(kept);
        }
        self.receive(timeout)
    }

    /// What the driver said, from the channel: as [`InProcessRank::poll`] without the backlog.
    fn receive(&self, timeout: Duration) -> Result<Vec<FromRank>, RankError> {
        let rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::new();
        match rx.recv_timeout(timeout) {
            Ok(msg) => out.push(msg),
            Err(RecvTimeoutError::Timeout) => return Ok(out),
            Err(RecvTimeoutError::Disconnected) => return Err(RankError::Gone),
        }
        out.extend(rx.try_iter());
        let mut metrics = self.metrics.lock().unwrap_or_else(PoisonError::into_inner);
        for msg in &out {
            metrics.observe_from(msg);
        }
        Ok(out)
    }

    /// Asks the driver to stop and waits up to `timeout` for it: its last messages (the `Bye`
    /// with its counters among them).
    pub fn shutdown(&self, timeout: Duration) -> Vec<FromRank> {
        let _ = self.deliver(ToRank::Shutdown);
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.poll(left) {
                Ok(msgs) => {
                    let bye = msgs.iter().any(|m| matches!(m, FromRank::Bye { .. }));
                    out.extend(msgs);
                    if bye {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        if let Some(thread) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take() {
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
        out
    }
}
