//! The real driver of `pdkv-core`: control plane over TCP, data plane over RDMA verbs or TCP,
//! memory from HIP or the host (filled in by the backend issue; the only crate allowed `unsafe`).
//!
//! - [`zmtp`]: ZeroMQ's wire protocol (ZMTP 3.1, NULL mechanism) over blocking TCP, the
//!   framing MoRIIO's control sockets speak: pdkv dials as a DEALER and listens as a ROUTER.
//! - [`memory`]: registered regions of host memory, and revocation by deregistering (a fence).
//! - [`transport`]: the data-plane seam, [`transport::Transport`], through which a decode rank
//!   reads byte ranges of a producer rank's regions, with typed errors.
//! - [`tcp`]: the TCP data plane: a producer's [`tcp::TcpReadServer`] and a decode rank's
//!   [`tcp::TcpTransport`], with the wire protocol in its module doc.
//! - [`connector`], [`prefill_rank`], [`decode_rank`]: one rank's process (`pdkv connector`),
//!   driving a core node over the pieces above; [`sched`] is its channel to the cluster's
//!   scheduler and [`pattern`] the KV bytes prefill writes and decode verifies.
//! - [`cluster`]: `pdkv cluster`: the proxy and the engines' schedulers, which start one
//!   connector process per rank on one host and push requests through them; [`signals`] lets
//!   its command line stop it in order on SIGINT or SIGTERM.

#![deny(missing_docs)]

pub mod cluster;
pub mod connector;
pub mod decode_rank;
#[cfg(feature = "hip")]
pub mod hip;
pub mod memory;
pub mod pattern;
pub mod prefill_rank;
pub mod sched;
pub mod signals;
pub mod tcp;
pub mod transport;
#[cfg(feature = "rdma")]
pub mod verbs;
pub mod zmtp;
