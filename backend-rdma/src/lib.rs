//! The real driver of `pdkv-core`: control plane over TCP, data plane over RDMA verbs or TCP,
//! memory from HIP or the host (filled in by the backend issue; the only crate allowed `unsafe`).
//!
//! - [`zmtp`]: ZeroMQ's wire protocol (ZMTP 3.1, NULL mechanism) over blocking TCP, the
//!   framing MoRIIO's control sockets speak: pdkv dials as a DEALER and listens as a ROUTER.

#![deny(missing_docs)]

pub mod zmtp;
