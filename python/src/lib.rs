//! `pdkv._native`: the native half of the `pdkv` Python package, the KV connector vLLM loads.
//! It exposes the plugin's nodes (`pdkv_rdma::plugin`) to the connector's Python wiring: a
//! worker's rank (its driver on a thread of vLLM's worker process, its KV staged from vLLM's
//! cache), and each engine's node in vLLM's scheduler process. Messages between them cross
//! vLLM's processes as MessagePack bytes the Python side carries without reading; what Python
//! does read (a vote, a received request) it gets as JSON.

#![forbid(unsafe_code)]

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use pdkv_core::ids::RankId;
use pdkv_core::params::KvTransferParams;
use pdkv_rdma::plugin::config::{rank_of, EngineConfig};
use pdkv_rdma::plugin::decode::DecodeNode as DecodeSide;
use pdkv_rdma::plugin::prefill::PrefillNode as PrefillSide;
use pdkv_rdma::plugin::rank::InProcessRank;
use pdkv_rdma::sched::{FromRank, ToRank};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The package version, as Cargo knows it.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn runtime_error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

fn encode<T: serde::Serialize>(msg: &T) -> PyResult<Vec<u8>> {
    rmp_serde::to_vec_named(msg).map_err(runtime_error)
}

fn decode_to_rank(bytes: &[u8]) -> PyResult<ToRank> {
    rmp_serde::from_slice(bytes).map_err(|e| value_error(format!("not a pdkv message for a rank: {e}")))
}

fn decode_from_rank(bytes: &[u8]) -> PyResult<FromRank> {
    rmp_serde::from_slice(bytes).map_err(|e| value_error(format!("not a pdkv message from a rank: {e}")))
}

fn parse_rank(text: &str) -> PyResult<RankId> {
    text.parse().map_err(|e| value_error(format!("rank `{text}`: {e}")))
}

/// One message from a rank: its JSON (what Python reads) and its MessagePack bytes (what
/// Python carries to the scheduler's node).
type Said = (String, Py<PyBytes>);

fn said(py: Python<'_>, msgs: Vec<FromRank>) -> PyResult<Vec<Said>> {
    msgs.into_iter()
        .map(|msg| {
            let json = serde_json::to_string(&msg).map_err(runtime_error)?;
            Ok((json, PyBytes::new(py, &encode(&msg)?).unbind()))
        })
        .collect()
}

/// A worker's rank: the prefill or decode driver on a thread of this process.
#[pyclass(frozen)]
struct Rank {
    inner: InProcessRank,
}

#[pymethods]
impl Rank {
    /// Starts DP rank `dp`, TP rank `tp` of the engine `config` (JSON) describes, with KV
    /// regions of `num_blocks` blocks per layer.
    #[new]
    fn new(config: &str, dp: u16, tp: u16, num_blocks: u32) -> PyResult<Rank> {
        let engine = EngineConfig::parse(config).map_err(value_error)?;
        let rank = rank_of(&engine, dp, tp).map_err(value_error)?;
        let inner = InProcessRank::start(&engine, rank, num_blocks).map_err(value_error)?;
        Ok(Rank { inner })
    }

    /// The rank, e.g. `P0.dp0.tp1`.
    fn name(&self) -> String {
        self.inner.rank().to_string()
    }

    /// Where the rank serves its Prometheus metrics (`host:port`), or `None`.
    fn metrics_address(&self) -> Option<String> {
        self.inner.metrics_addr().map(|a| a.to_string())
    }

    /// The rank's metrics in Prometheus's text format.
    fn metrics(&self) -> String {
        self.inner.metrics_text()
    }

    /// Bytes of one block of one layer in the staged regions.
    fn block_len(&self) -> u64 {
        self.inner.staged().block_len
    }

    /// Hands the driver a message from the engine's node (MessagePack, as the node made it).
    fn deliver(&self, msg: &[u8]) -> PyResult<()> {
        self.inner.deliver(decode_to_rank(msg)?).map_err(runtime_error)
    }

    /// The MIN of the TP group's votes for `step`.
    fn vote_result(&self, step: u64, ok: bool) -> PyResult<()> {
        self.inner.deliver(ToRank::VoteResult { step, ok }).map_err(runtime_error)
    }

    /// Every layer of `blocks` holds `transfer_id`'s KV now: returns once peers may read them
    /// (waiting up to `timeout_s` seconds, without the GIL).
    #[pyo3(signature = (transfer_id, blocks, timeout_s = 10.0))]
    fn staged_transfer(
        &self,
        py: Python<'_>,
        transfer_id: String,
        blocks: Vec<u32>,
        timeout_s: f64,
    ) -> PyResult<()> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).map_err(value_error)?;
        let transfer_id = pdkv_core::ids::TransferId::new(transfer_id);
        py.detach(|| self.inner.staged_transfer(transfer_id, blocks, timeout)).map_err(runtime_error)
    }

    /// Copies `data` (the bytes of `blocks` of `layer`, one block after another) into the
    /// staged regions.
    fn stage(&self, py: Python<'_>, layer: usize, blocks: Vec<u32>, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.inner.staged().stage(layer, &blocks, data)).map_err(value_error)
    }

    /// The bytes of `blocks` of `layer` in the staged regions, one block after another.
    fn unstage<'py>(&self, py: Python<'py>, layer: usize, blocks: Vec<u32>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| self.inner.staged().unstage(layer, &blocks)).map_err(value_error)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// What the driver said: waits up to `timeout_s` seconds for a first message (without
    /// holding the GIL), then takes every one waiting; `[]` on timeout. Raises once the driver
    /// has stopped.
    fn poll(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Vec<Said>> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).map_err(value_error)?;
        let msgs = py.detach(|| self.inner.poll(timeout)).map_err(runtime_error)?;
        said(py, msgs)
    }

    /// Stops the driver, waiting up to `timeout_s` seconds; returns its last messages.
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Vec<Said>> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).map_err(value_error)?;
        let msgs = py.detach(|| self.inner.shutdown(timeout));
        said(py, msgs)
    }
}

/// The prefill engine's node, in vLLM's scheduler process.
#[pyclass(frozen)]
struct PrefillNode {
    inner: Mutex<PrefillSide>,
}

impl PrefillNode {
    fn with<T>(&self, f: impl FnOnce(&mut PrefillSide) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl PrefillNode {
    /// The node of the prefill engine `config` (JSON) describes.
    #[new]
    fn new(config: &str) -> PyResult<PrefillNode> {
        let engine = EngineConfig::parse(config).map_err(value_error)?;
        if engine.engine.role != pdkv_core::ids::Role::Prefill {
            return Err(value_error(format!("{} is not a prefill engine", engine.engine)));
        }
        Ok(PrefillNode { inner: Mutex::new(PrefillSide::new(engine)) })
    }

    /// vLLM finished prefilling `request` on DP rank `dp`, its KV in `blocks`; `params` (JSON)
    /// are its `kv_transfer_params`. Returns the answer's `kv_transfer_params` (JSON); raises
    /// `ValueError` when the transfer cannot be held (vLLM then frees the blocks at once).
    fn finished(&self, request: &str, params: &str, dp: u16, blocks: Vec<u32>) -> PyResult<String> {
        let params: KvTransferParams = serde_json::from_str(params).map_err(value_error)?;
        let answer =
            self.with(|node| node.handle_finished(request, &params, dp, blocks)).map_err(value_error)?;
        serde_json::to_string(&answer).map_err(runtime_error)
    }

    /// What `rank` said (the MessagePack bytes its `Rank.poll` returned).
    fn worker_message(&self, rank: &str, msg: &[u8]) -> PyResult<()> {
        let (rank, msg) = (parse_rank(rank)?, decode_from_rank(msg)?);
        self.with(|node| node.handle_worker_message(rank, msg));
        Ok(())
    }

    /// Lets the reaper act on time passing.
    fn tick(&self) {
        self.with(PrefillSide::handle_tick)
    }

    /// Messages for the workers: `(rank, MessagePack bytes)`, in order.
    fn to_workers(&self, py: Python<'_>) -> PyResult<Vec<(String, Py<PyBytes>)>> {
        self.with(PrefillSide::poll_to_workers)
            .into_iter()
            .map(|(rank, msg)| Ok((rank.to_string(), PyBytes::new(py, &encode(&msg)?).unbind())))
            .collect()
    }

    /// vLLM's ids of the requests whose blocks the engine freed since the last call.
    fn freed(&self) -> Vec<String> {
        self.with(PrefillSide::poll_freed)
    }

    /// Log lines since the last call.
    fn notes(&self) -> Vec<String> {
        self.with(PrefillSide::poll_notes)
    }

    /// Transfers held.
    fn held(&self) -> usize {
        self.with(|node| node.held())
    }
}

/// The decode engine's requests whose KV is remote, in vLLM's scheduler process.
#[pyclass(frozen)]
struct DecodeNode {
    inner: Mutex<DecodeSide>,
}

impl DecodeNode {
    fn with<T>(&self, f: impl FnOnce(&mut DecodeSide) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl DecodeNode {
    /// The side of the decode engine `config` (JSON) describes.
    #[new]
    fn new(config: &str) -> PyResult<DecodeNode> {
        let engine = EngineConfig::parse(config).map_err(value_error)?;
        if engine.engine.role != pdkv_core::ids::Role::Decode {
            return Err(value_error(format!("{} is not a decode engine", engine.engine)));
        }
        Ok(DecodeNode { inner: Mutex::new(DecodeSide::new(engine)) })
    }

    /// vLLM allocated `local_blocks` for a request whose `kv_transfer_params` (JSON) name the
    /// prefill engine holding its KV. Returns the number the workers know the request by and
    /// the local blocks its read fills.
    fn request(&self, params: &str, local_blocks: Vec<u32>) -> PyResult<(u64, Vec<u32>)> {
        let params: KvTransferParams =
            serde_json::from_str(params).map_err(|e| value_error(format!("kv_transfer_params: {e}")))?;
        self.with(|node| node.handle_request(params, local_blocks))
            .map(|(id, local)| (id.0, local))
            .map_err(value_error)
    }

    /// The next step, `(step, MessagePack bytes)`, when requests are waiting for one.
    fn step(&self, py: Python<'_>) -> PyResult<Option<(u64, Py<PyBytes>)>> {
        match self.with(DecodeSide::poll_step) {
            None => Ok(None),
            Some((step, msg)) => Ok(Some((step, PyBytes::new(py, &encode(&msg)?).unbind()))),
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<Rank>()?;
    m.add_class::<PrefillNode>()?;
    m.add_class::<DecodeNode>()?;
    Ok(())
}
