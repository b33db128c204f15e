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

#![deny(missing_docs)]

pub mod memory;
pub mod tcp;
pub mod transport;
pub mod zmtp;
