//! The decode worker's configuration: its fixed facts and knobs, and the limits it holds to.

use crate::ids::RankId;
use crate::policy::{PeerBook, Policy};
use crate::time::{NS_PER_MS, NS_PER_S};
use crate::topology::{Layout, ModelSpec};

/// Requests one worker holds at once; a step that would exceed it fails those requests.
pub const MAX_WORKER_REQUESTS: usize = 65_536;
/// Remote sessions one worker keeps; a request whose source would need one more fails.
pub const MAX_WORKER_SESSIONS: usize = 4096;

/// Whether a request's KV is read one layer at a time or all at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReadGranularity {
    /// One read per layer (MoRIIO's batching: reads overlap with the layers' compute).
    PerLayer,
    /// One read covering every layer.
    PerRequest,
}

/// Fixed facts and knobs of one decode worker.
#[derive(Clone, Debug, Hash)]
pub struct DecodeConfig {
    /// This worker's rank.
    pub rank: RankId,
    /// Its engine's layout (the TP size is the world size W of the routing rules).
    pub layout: Layout,
    /// The served model.
    pub model: ModelSpec,
    /// The protocol's rules (the fixed protocol, or the legacy options resolved).
    pub policy: Policy,
    /// The rules of this worker's engine and of each prefill engine it reads (pdkv's unless
    /// named): with an engine following vLLM 0.33's, the worker releases as vLLM 0.33 does.
    pub peers: PeerBook,
    /// This worker's MoRIIO engine id, sent as the sender of its releases.
    pub engine_id: String,
    /// Deadline of one handshake dial (10 s by default).
    pub handshake_timeout_ns: u64,
    /// How long a request may wait for its KV, from arrival to the last read (30 s default).
    pub transfer_timeout_ns: u64,
    /// First retry delay after a send-queue-full completion (1 ms); doubles each retry.
    pub backoff_initial_ns: u64,
    /// Largest retry delay (50 ms).
    pub backoff_cap_ns: u64,
    /// Per layer (default) or per request.
    pub granularity: ReadGranularity,
    /// The deployment's control key, if this worker has one: it then MACs the releases and
    /// leases it sends a rank that advertised `auth` ([`crate::auth`]).
    pub control_key: Option<crate::auth::ControlKey>,
}

impl DecodeConfig {
    /// A worker with MoRIIO's defaults.
    pub fn new(rank: RankId, layout: Layout, model: ModelSpec, policy: Policy, engine_id: String) -> Self {
        DecodeConfig {
            rank,
            layout,
            model,
            policy,
            peers: PeerBook::pdkv(),
            engine_id,
            handshake_timeout_ns: 10 * NS_PER_S,
            transfer_timeout_ns: 30 * NS_PER_S,
            backoff_initial_ns: NS_PER_MS,
            backoff_cap_ns: 50 * NS_PER_MS,
            granularity: ReadGranularity::PerLayer,
            control_key: None,
        }
    }
}
