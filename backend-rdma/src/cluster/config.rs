//! The run's options as the command line gives them, their limits and checks.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::AtomicI32;

use pdkv_core::ids::{RankId, Role};
use pdkv_core::legacy::LegacyOptions;
use pdkv_core::policy::{PeerBook, PeerRules};
use pdkv_core::routing::RoutingError;
use pdkv_core::topology::{Deployment, ModelSpec, NotationError};
use pdkv_engine::timeouts::{ProtocolTimeouts, Timeout, TimeoutError, MAX_TIMEOUT_MS, MIN_TIMEOUT_MS};

use super::errors::StartError;
use crate::message_faults::{MessageFault, MessageFaultError, MAX_MESSAGE_FAULTS};
use crate::sched::TransportKind;

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

/// One side of the deployment played by another connector's code, through a driver process
/// that speaks the protocol of `foreign.rs` on its standard input and output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    /// Which side the driver plays: all of that side's engines.
    pub side: Role,
    /// The rules that side's engines follow (never pdkv's own: that side would be pdkv).
    pub rules: PeerRules,
    /// The driver program and its arguments.
    pub program: PathBuf,
    /// Arguments given to the program.
    pub args: Vec<String>,
}

impl Fault {
    /// The rank the fault hits.
    pub fn rank(&self) -> RankId {
        match *self {
            Fault::KillPrefill { rank, .. } | Fault::DropReleases { rank, .. } => rank,
        }
    }

    /// The command-line flag that asks for it.
    pub fn flag(&self) -> String {
        match *self {
            Fault::KillPrefill { rank, .. } => format!("--kill {rank}"),
            Fault::DropReleases { rank, count } => format!("--drop-releases {rank}={count}"),
        }
    }
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
    /// Requests a decode DP group runs, or waits on, at once (vLLM's `--max-num-seqs`); the
    /// rest queue, leased, until a step has room.
    pub decode_max_batch: u32,
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
    /// The protocol's timeouts: `--handshake-timeout-ms` and `--transfer-timeout-ms` (also the
    /// read lease) for the decode ranks, `--defer-timeout-ms` for the prefill engines' reaper.
    /// The cluster runs no collective of its own, so the collective timeout keeps its default.
    pub timeouts: ProtocolTimeouts,
    /// The run's limit: past it, what is unfinished counts as hung.
    pub timeout_ms: u64,
    /// How long a rank may say nothing (connectors send a heartbeat every
    /// [`crate::sched::HEARTBEAT_INTERVAL`]) while the scheduler itself runs before it counts as
    /// lost; twice this is how long the foreign driver may leave its input unread.
    pub heartbeat_timeout_ms: u64,
    /// Faults to inject.
    pub faults: Vec<Fault>,
    /// Control messages to lose, duplicate or delay (`--lose-messages`, `--duplicate-messages`,
    /// `--delay-messages`); `--drop-releases` is a [`Fault`] that adds one
    /// ([`ClusterConfig::message_faults`]).
    pub messages: Vec<MessageFault>,
    /// A side played by another connector's code, if any.
    pub foreign: Option<Foreign>,
    /// `--hold-dispatches-until-restart`: the proxy holds the decode dispatch of every request
    /// whose KV the DP group of a rank `--kill` killed holds until the rank is back (its
    /// restarted process said it is ready, or the foreign driver said `restarted`), so those
    /// requests are read after the restart whatever the machine's speed. Needs a
    /// [`Fault::KillPrefill`] with a restart.
    pub hold_dispatches_until_restart: bool,
    /// Whether the run's ranks authenticate releases and leases with a key drawn for the run
    /// (`--control-auth`).
    pub control_auth: ControlAuthMode,
    /// Fault: a forger outside the deployment (`pdkv forge`) sends forged releases and leases
    /// to every prefill notify listener for each transfer as it is registered
    /// (`--forge-messages`; [`super::forger`]).
    pub forge_messages: bool,
    /// Where to look for a stop request: a signal number (nonzero) stops the run in order,
    /// with a partial result whose outcome is `interrupted` ([`crate::signals::CAUGHT`] for the
    /// command line).
    pub stop: Option<&'static AtomicI32>,
}

/// How a run's prefill ranks take releases and leases (`--control-auth`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ControlAuthMode {
    /// The scheduler draws a key for the run from the operating system and hands it to every
    /// rank: a release or lease without its MAC is refused. With a foreign side, whose vLLM
    /// ranks send no MAC, one without is taken and only a wrong MAC refused.
    #[default]
    Require,
    /// No key: every release and lease is taken from anyone, as MoRIIO's listener takes it
    /// (to show what a forger can do).
    Open,
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
/// Shortest budget a run accepts (`--timeout-ms`): less ends every run on a loaded host before
/// a KV cache can move, which tests nothing. The protocol's timeouts have the limits of every
/// driver instead ([`ProtocolTimeouts::check`]).
pub const MIN_RUN_TIMEOUT_MS: u64 = 100;
/// Shortest heartbeat timeout accepted: two heartbeat intervals, so that one late heartbeat
/// does not lose a rank.
pub const MIN_HEARTBEAT_TIMEOUT_MS: u64 = 1_000;

impl ClusterConfig {
    /// Checks what the command line can get wrong before any process starts; the error names
    /// the flag. `d` is the parsed deployment.
    pub fn validate(&self, d: &Deployment) -> Result<(), ConfigError> {
        let count = |flag: &'static str, value: u32, max: u32| {
            if (1..=max).contains(&value) {
                Ok(())
            } else {
                Err(ConfigError::Count { flag, value, max })
            }
        };
        count("--requests", self.requests, MAX_REQUESTS)?;
        count("--concurrency", self.concurrency, MAX_CONCURRENCY)?;
        count("--decode-max-batch", self.decode_max_batch, MAX_CONCURRENCY)?;
        count("--layers", u32::from(self.layers), u32::from(MAX_LAYERS))?;
        self.timeouts.check().map_err(ConfigError::ProtocolTimeout)?;
        if !(MIN_RUN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(ConfigError::RunTimeout { ms: self.timeout_ms });
        }
        if !(MIN_HEARTBEAT_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&self.heartbeat_timeout_ms) {
            return Err(ConfigError::HeartbeatTimeout { ms: self.heartbeat_timeout_ms });
        }
        let ranks = d.ranks(Role::Prefill).len() + d.ranks(Role::Decode).len();
        if ranks > MAX_CLUSTER_RANKS {
            return Err(ConfigError::TooManyRanks { deployment: self.deployment.clone(), ranks });
        }
        if self.transport == TransportKind::Rdma && !cfg!(feature = "rdma") {
            return Err(ConfigError::NoRdma);
        }
        if let Some(foreign) = &self.foreign {
            if foreign.rules == PeerRules::Pdkv {
                return Err(ConfigError::ForeignRulesPdkv);
            }
            if let Some(fault) = self.messages.first() {
                return Err(ConfigError::MessageFaultWithForeign { fault: fault.clone() });
            }
            // A kill of a foreign prefill rank kills its data-plane server and has the driver
            // kill the rank's own code with it; nothing else can be injected into the driver.
            let injectable = |f: &Fault| matches!(f, Fault::KillPrefill { .. });
            if let Some(fault) =
                self.faults.iter().find(|f| f.rank().engine.role == foreign.side && !injectable(f))
            {
                return Err(ConfigError::FaultOnForeign { fault: fault.clone() });
            }
        }
        let messages = self.message_faults();
        if messages.len() > MAX_MESSAGE_FAULTS {
            return Err(ConfigError::TooManyMessageFaults { count: messages.len() });
        }
        for fault in &self.messages {
            fault.check(d).map_err(|error| ConfigError::MessageFault { fault: fault.clone(), error })?;
        }
        for fault in &self.faults {
            match *fault {
                Fault::KillPrefill { rank, after, restart_after_ms } => {
                    if rank.engine.role != Role::Prefill || !d.ranks(Role::Prefill).contains(&rank) {
                        return Err(ConfigError::NoPrefillRank { deployment: self.deployment.clone(), rank });
                    }
                    if after >= self.requests {
                        return Err(ConfigError::KillAfterLast { after, requests: self.requests });
                    }
                    if let Some(ms) = restart_after_ms.filter(|&ms| ms > MAX_TIMEOUT_MS) {
                        return Err(ConfigError::RestartTooLate { ms });
                    }
                }
                Fault::DropReleases { rank, count } => {
                    if rank.engine.role != Role::Decode || !d.ranks(Role::Decode).contains(&rank) {
                        let deployment = self.deployment.clone();
                        return Err(ConfigError::NoDecodeRank { deployment, rank, count });
                    }
                }
            }
        }
        self.check_hold()
    }

    /// `--hold-dispatches-until-restart` holds dispatches until a killed rank restarts: without
    /// a kill that restarts, it would hold nothing, and a restart past the run's budget would
    /// hold the dispatches until the run gives up.
    fn check_hold(&self) -> Result<(), ConfigError> {
        if !self.hold_dispatches_until_restart {
            return Ok(());
        }
        let restarts: Vec<u64> = self
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::KillPrefill { restart_after_ms, .. } => Some(restart_after_ms),
                Fault::DropReleases { .. } => None,
            })
            .collect::<Option<Vec<u64>>>()
            .unwrap_or_default();
        match restarts.iter().max() {
            None => Err(ConfigError::HoldWithoutRestart),
            Some(&ms) if ms >= self.timeout_ms => {
                Err(ConfigError::HoldPastBudget { restart_ms: ms, timeout_ms: self.timeout_ms })
            }
            Some(_) => Ok(()),
        }
    }

    /// Defaults for a loopback run: 8 requests in flight, 4 layers, 512 blocks per prefill rank,
    /// a 10 s handshake timeout and MoRIIO's transfer and reaper timeouts.
    pub fn new(deployment: &str, requests: u32, exe: PathBuf) -> ClusterConfig {
        ClusterConfig {
            deployment: deployment.to_owned(),
            requests,
            concurrency: 8,
            decode_max_batch: 64,
            transport: TransportKind::Tcp,
            mla: false,
            layers: 4,
            legacy: LegacyOptions::none(),
            exe,
            host: "127.0.0.1".into(),
            seed: 0,
            num_blocks: 512,
            // The protocol's defaults (docs/reference.md says which are MoRIIO's): a fault-free
            // run never waits for them, and a loaded machine (CI) must not turn a slow read into
            // a failure.
            timeouts: ProtocolTimeouts::default(),
            timeout_ms: 120_000,
            heartbeat_timeout_ms: 5_000,
            faults: Vec::new(),
            messages: Vec::new(),
            foreign: None,
            hold_dispatches_until_restart: false,
            control_auth: ControlAuthMode::Require,
            forge_messages: false,
            stop: None,
        }
    }

    /// The rules each engine follows: pdkv's, but the foreign side's engines follow theirs.
    pub fn peers(&self, d: &Deployment) -> PeerBook {
        let mut book = PeerBook::pdkv();
        if let Some(foreign) = &self.foreign {
            for index in 0..d.engines(foreign.side).len() {
                let engine = pdkv_core::ids::EngineId { role: foreign.side, index: index as u16 };
                book.set(engine, foreign.rules);
            }
        }
        book
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
    Config(ConfigError),
    /// Ranks could not be started or did not join.
    Start(StartError),
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

/// What is wrong with a run's options, naming the flag.
#[derive(Debug)]
pub enum ConfigError {
    /// The deployment does not parse.
    Deployment(NotationError),
    /// A decode engine cannot read from a prefill engine.
    Routing(RoutingError),
    /// A count outside `1..=max`.
    Count {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: u32,
        /// The largest accepted.
        max: u32,
    },
    /// A protocol timeout outside the limits every driver shares.
    ProtocolTimeout(TimeoutError),
    /// `--timeout-ms` outside [`MIN_RUN_TIMEOUT_MS`]`..=`[`MAX_TIMEOUT_MS`].
    RunTimeout {
        /// Its value.
        ms: u64,
    },
    /// `--heartbeat-timeout-ms` outside [`MIN_HEARTBEAT_TIMEOUT_MS`]`..=`[`MAX_TIMEOUT_MS`].
    HeartbeatTimeout {
        /// Its value.
        ms: u64,
    },
    /// More ranks than [`MAX_CLUSTER_RANKS`].
    TooManyRanks {
        /// The deployment.
        deployment: String,
        /// Its ranks.
        ranks: usize,
    },
    /// `--transport rdma` in a build without it.
    NoRdma,
    /// `--foreign-rules pdkv`.
    ForeignRulesPdkv,
    /// A message fault under `--foreign-side`.
    MessageFaultWithForeign {
        /// The first one.
        fault: MessageFault,
    },
    /// A fault other than `--kill` on the foreign side.
    FaultOnForeign {
        /// The fault.
        fault: Fault,
    },
    /// More message faults than [`MAX_MESSAGE_FAULTS`].
    TooManyMessageFaults {
        /// How many.
        count: usize,
    },
    /// A message fault the deployment cannot have.
    MessageFault {
        /// The fault.
        fault: MessageFault,
        /// Why.
        error: MessageFaultError,
    },
    /// `--kill` of a rank that is not a prefill rank of the deployment.
    NoPrefillRank {
        /// The deployment.
        deployment: String,
        /// The rank.
        rank: RankId,
    },
    /// `--kill-after` at or past the last request.
    KillAfterLast {
        /// Its value.
        after: u32,
        /// The run's requests.
        requests: u32,
    },
    /// `--restart-after-ms` above [`MAX_TIMEOUT_MS`].
    RestartTooLate {
        /// Its value.
        ms: u64,
    },
    /// `--drop-releases` of a rank that is not a decode rank of the deployment.
    NoDecodeRank {
        /// The deployment.
        deployment: String,
        /// The rank.
        rank: RankId,
        /// The count asked for.
        count: u32,
    },
    /// `--hold-dispatches-until-restart` without a kill that restarts.
    HoldWithoutRestart,
    /// `--hold-dispatches-until-restart` with a restart past the run's budget.
    HoldPastBudget {
        /// The latest restart.
        restart_ms: u64,
        /// The run's budget.
        timeout_ms: u64,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HOLD: &str = "--hold-dispatches-until-restart";
        match self {
            ConfigError::Deployment(e) => write!(f, "{e}"),
            ConfigError::Routing(e) => write!(f, "{e}"),
            ConfigError::Count { flag, value, max } => write!(f, "{flag} {value}: must be between 1 and {max}"),
            ConfigError::ProtocolTimeout(TimeoutError { timeout, value_ms }) => {
                write!(f, "{} {value_ms}: must be between {MIN_TIMEOUT_MS} and {MAX_TIMEOUT_MS}", timeout_flag(*timeout))
            }
            ConfigError::RunTimeout { ms } => {
                write!(f, "--timeout-ms {ms}: must be between {MIN_RUN_TIMEOUT_MS} and {MAX_TIMEOUT_MS}")
            }
            ConfigError::HeartbeatTimeout { ms } => write!(
                f,
                "--heartbeat-timeout-ms {ms}: must be between {MIN_HEARTBEAT_TIMEOUT_MS} and {MAX_TIMEOUT_MS}"
            ),
            ConfigError::TooManyRanks { deployment, ranks } => write!(
                f,
                "{deployment}: {ranks} ranks, but a cluster on one host starts at most {MAX_CLUSTER_RANKS} processes"
            ),
            ConfigError::NoRdma => f.write_str(
                "--transport rdma: this pdkv was built without the rdma feature (cargo build --features rdma)",
            ),
            ConfigError::ForeignRulesPdkv => f.write_str(
                "--foreign-rules pdkv: the foreign side follows another connector's rules (pdkv's own side \
                 needs no driver)",
            ),
            ConfigError::MessageFaultWithForeign { fault } => write!(
                f,
                "{fault}: message faults are injected where pdkv sends, and under --foreign-side half of the \
                 messages are the foreign driver's"
            ),
            ConfigError::FaultOnForeign { fault } => write!(
                f,
                "{}: {} is played by the foreign driver, which takes no injected faults but --kill",
                fault.flag(),
                fault.rank()
            ),
            ConfigError::TooManyMessageFaults { count } => write!(
                f,
                "{count} message faults (--lose-messages, --duplicate-messages, --delay-messages and \
                 --drop-releases together): at most {MAX_MESSAGE_FAULTS}"
            ),
            ConfigError::MessageFault { fault, error } => write!(f, "{fault}: {error}"),
            ConfigError::NoPrefillRank { deployment, rank } => {
                write!(f, "--kill {rank}: {deployment} has no prefill rank {rank}")
            }
            ConfigError::KillAfterLast { after, requests } => write!(
                f,
                "--kill-after {after}: the run prefills only {requests} requests, so the kill would come \
                 after the last one (use 0 to {})",
                requests - 1
            ),
            ConfigError::RestartTooLate { ms } => write!(f, "--restart-after-ms {ms}: must be at most {MAX_TIMEOUT_MS}"),
            ConfigError::NoDecodeRank { deployment, rank, count } => {
                write!(f, "--drop-releases {rank}={count}: {deployment} has no decode rank {rank}")
            }
            ConfigError::HoldWithoutRestart => write!(
                f,
                "{HOLD}: holds decode dispatches until a killed prefill rank is back, so it needs --kill and \
                 --restart-after-ms"
            ),
            ConfigError::HoldPastBudget { restart_ms, timeout_ms } => write!(
                f,
                "{HOLD}: --restart-after-ms {restart_ms} is not within --timeout-ms {timeout_ms}, so the \
                 dispatches would be held until the run gives up"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The flag that sets a protocol timeout. The collective timeout has none (the cluster runs no
/// collective of its own and keeps the default), so it is named in words.
pub fn timeout_flag(timeout: Timeout) -> &'static str {
    match timeout {
        Timeout::Handshake => "--handshake-timeout-ms",
        Timeout::Transfer => "--transfer-timeout-ms",
        Timeout::Defer => "--defer-timeout-ms",
        Timeout::Collective => "the collective timeout",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The protocol's timeout flags take the limits every driver shares, and an error names the
    /// flag; the run's budget keeps its own floor.
    #[test]
    fn timeout_flags_have_the_protocols_limits() {
        let d = Deployment::parse("1P_TP1:1D_TP1").expect("parses");
        let check = |set: fn(&mut ClusterConfig, u64), value: u64, expected: Result<(), String>| {
            let mut config = ClusterConfig::new("1P_TP1:1D_TP1", 4, PathBuf::from("pdkv"));
            set(&mut config, value);
            assert_eq!(config.validate(&d).map_err(|e| e.to_string()), expected, "{value}");
        };
        let out = |flag: &str, value: u64| Err(format!("{flag} {value}: must be between 1 and 10000000000"));
        type Set = fn(&mut ClusterConfig, u64);
        let flags: [(&str, Set); 3] = [
            ("--handshake-timeout-ms", |c, ms| c.timeouts.handshake_ms = ms),
            ("--transfer-timeout-ms", |c, ms| c.timeouts.transfer_ms = ms),
            ("--defer-timeout-ms", |c, ms| c.timeouts.defer_ms = ms),
        ];
        for (flag, set) in flags {
            check(set, 0, out(flag, 0));
            check(set, 1, Ok(()));
            check(set, MAX_TIMEOUT_MS, Ok(()));
            check(set, MAX_TIMEOUT_MS + 1, out(flag, MAX_TIMEOUT_MS + 1));
            check(set, u64::MAX, out(flag, u64::MAX));
        }
        let budget = |c: &mut ClusterConfig, ms| c.timeout_ms = ms;
        let over = |ms: u64| Err(format!("--timeout-ms {ms}: must be between 100 and 10000000000"));
        check(budget, 99, over(99));
        check(budget, 100, Ok(()));
        check(budget, MAX_TIMEOUT_MS, Ok(()));
        check(budget, MAX_TIMEOUT_MS + 1, over(MAX_TIMEOUT_MS + 1));
        check(budget, u64::MAX, over(u64::MAX));
    }
}
