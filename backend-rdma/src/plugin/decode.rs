//! The decode engine's side inside vLLM's scheduler process: the requests vLLM allocated blocks
//! for whose KV is remote, numbered and described as the core's decode workers take them
//! (`RecvRequest`), and gathered into the step every worker of the engine begins together.

use pdkv_core::decode::RecvRequest;
use pdkv_core::ids::{EngineId, RequestId};
use pdkv_core::params::{BlockIds, KvTransferParams};
use pdkv_core::ports::EngineAddress;

use super::config::Engine;
use crate::sched::ToRank;

/// Why a request's remote KV cannot be asked for.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestError(pub String);

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kv_transfer_params: {}", self.0)
    }
}

impl std::error::Error for RequestError {}

/// The decode engine's requests whose KV is remote.
pub struct DecodeNode {
    config: Engine,
    next_request: u64,
    next_step: u64,
    pending: Vec<RecvRequest>,
}

impl DecodeNode {
    /// The side of `config`'s engine (a decode engine).
    pub fn new(config: Engine) -> DecodeNode {
        DecodeNode { config, next_request: 0, next_step: 0, pending: Vec::new() }
    }

    /// vLLM allocated `local_blocks` for a request whose KV the prefill engine named in
    /// `params` holds: the request joins the next step. Returns the number the workers know it by
    /// and the local blocks the read fills (the ones that pair with a remote block holding prompt
    /// KV).
    pub fn handle_request(
        &mut self,
        params: KvTransferParams,
        local_blocks: Vec<u32>,
    ) -> Result<(RequestId, Vec<u32>), RequestError> {
        let missing = |field: &str| RequestError(format!("no `{field}`"));
        let host = params.remote_host.clone().ok_or_else(|| missing("remote_host"))?;
        let port = |field: &str, value: Option<i64>| -> Result<u16, RequestError> {
            let v = value.ok_or_else(|| missing(field))?;
            u16::try_from(v).map_err(|_| RequestError(format!("`{field}` is {v}, not a port")))
        };
        let prefill_address = EngineAddress {
            host,
            handshake_port_base: port("remote_handshake_port", params.remote_handshake_port)?,
            notify_port_base: port("remote_notify_port", params.remote_notify_port)?,
        };
        let remote = params.remote_block_ids.single_group().map_err(|e| RequestError(e.to_string()))?;
        // Block i of one side holds the same tokens as block i of the other. vLLM allocates
        // decode's blocks for the whole prompt, and may have added one for the first new token;
        // a MoRIIO prefill (vLLM 0.34) may name a block past the prompt that was allocated for
        // its next token under async scheduling. Neither tail holds prompt KV.
        let blocks = remote.len().min(local_blocks.len());
        if blocks == 0 && !remote.is_empty() {
            return Err(RequestError(format!("{} remote blocks for no local ones", remote.len())));
        }
        let remote = remote[..blocks].to_vec();
        let mut local_blocks = local_blocks;
        local_blocks.truncate(blocks);
        let params = KvTransferParams { remote_block_ids: BlockIds::Flat(remote), ..params };
        let prefill_engine = self.prefill_engine(&params)?;
        let id = RequestId(self.next_request);
        self.next_request += 1;
        self.pending.push(RecvRequest {
            request: id,
            prefill_engine,
            prefill_address,
            params,
            local_block_ids: local_blocks.clone(),
        });
        Ok((id, local_blocks))
    }

    /// The prefill engine a request's KV is on. The deployment names engines by position; the
    /// request names one by its MoRIIO engine id, which is only known at run time, so with one
    /// prefill engine that is it, and with several the engine id must say which (`P<i>` after
    /// the `#`, as pdkv's own prefill answers do not yet).
    fn prefill_engine(&self, params: &KvTransferParams) -> Result<EngineId, RequestError> {
        match self.config.deployment.prefill.len() {
            1 => Ok(EngineId::prefill(0)),
            n => Err(RequestError(format!(
                "the deployment has {n} prefill engines; telling which one `{}` is needs the engine's index",
                params.remote_engine_id.as_deref().unwrap_or("(no remote_engine_id)")
            ))),
        }
    }

    /// The step every worker of the engine begins with the requests added since the last one,
    /// or `None` when there are none.
    pub fn poll_step(&mut self) -> Option<(u64, ToRank)> {
        if self.pending.is_empty() {
            return None;
        }
        let step = self.next_step;
        self.next_step += 1;
        Some((step, ToRank::StepBegin { step, requests: std::mem::take(&mut self.pending) }))
    }
}
