//! Campaigns of simulator runs as a library: explorations (seeds searched on threads, the
//! smallest failing seed, shrinking, result files and their merge) and sweeps (a grid of runs,
//! shard files and their merge), each splittable into shards that merge byte for byte into what
//! one machine writes; and plans (`plan/`: a GPU budget's layouts screened with the cost model
//! and the core's routing, the best run on threads and ranked by goodput per GPU).
//!
//! Invariant: campaign logic only. It may use threads and, for an exploration's time budget, a
//! deadline clock; it prints nothing (progress goes to a callback the caller turns into a bar)
//! and parses no command-line arguments. Every file it reads or writes has a serde type
//! (`deny_unknown_fields`, since the files are pdkv's own), outcomes, properties and behaviours
//! are typed, and reading or merging fails with a typed error naming the file and the field.

#![forbid(unsafe_code)]

pub mod coverage;
pub mod error;
pub mod explore;
pub mod files;
pub mod names;
pub mod plan;
pub mod shard;
pub mod sweep;

pub use error::{Inconsistency, MergeError};
pub use files::{ReadError, WriteError};
pub use shard::{Shard, ShardError};
