//! pdkv-core: the sans-IO routing and protocol core for heterogeneous prefill/decode KV transfer.
//!
//! Nothing in this crate does I/O, reads a clock, spawns a thread, keeps global state, draws
//! unseeded randomness or iterates a hash map; time comes in as a value and effects leave as
//! values. The simulator and the real backend drive the same code.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod auth;
pub mod decode;
pub mod fence;
pub mod group;
pub mod handshake;
pub mod ids;
pub mod legacy;
pub mod machine;
pub mod params;
pub mod policy;
pub mod ports;
pub mod prefill;
pub mod proxy;
pub mod recv;
pub mod release;
pub mod rng;
pub mod routes;
pub mod routing;
pub mod step_machine;
pub mod time;
pub mod topology;
pub mod wire;
pub mod write;
pub mod write_routes;

pub use ids::{EngineId, Incarnation, RankId, RequestId, Role, TpRank, TransferId};
pub use legacy::{Legacy, LegacyOptions};
pub use policy::Policy;
pub use topology::{Deployment, Layout, ModelSpec};
