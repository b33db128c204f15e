//! The engine layer of pdkv, sans-IO, between the core's nodes and the drivers that move their
//! messages (the simulator, the real cluster, the scripted tests, the model checker).
//!
//! The core specifies one node at a time: a decode worker, a decode group's barrier, a prefill
//! worker, a prefill engine's ledger. What sits *between* nodes (how a worker's action becomes
//! the group's input, when every TP rank has reported a request, what a prefill answer says,
//! how a run is judged) is written here once, so every driver runs the same glue. Like the
//! core, this crate does no I/O, reads no clock, spawns no threads and iterates no hash map:
//! time comes in as values and effects leave as values.

#![forbid(unsafe_code)]

pub mod decode;
pub mod pool;
pub mod prefill;
#[cfg(test)]
mod scripted;
pub mod target;
pub mod timeouts;
pub mod verdict;
