//! What the vLLM plugin (the `pdkv` Python package, `python/`) runs: the driver of each worker's
//! rank inside vLLM's worker process, and the engine's nodes inside vLLM's scheduler process,
//! with their configuration. The Python side only carries what these return to where vLLM
//! hands it on; every decision is the core's.

pub mod config;
pub mod decode;
pub mod metrics;
pub mod prefill;
pub mod rank;

#[cfg(test)]
mod tests;
