//! The real driver of `pdkv-core`: control plane over TCP, data plane over RDMA verbs or TCP,
//! memory from HIP or the host. The only crate allowed `unsafe`, and only in its FFI modules
//! (`verbs`, `hip`, [`signals`]), which the crate root's `#![deny(unsafe_code)]` exempts by name.
//!
//! - [`zmtp`]: ZeroMQ's wire protocol (ZMTP 3.1, NULL mechanism) over blocking TCP, the
//!   framing MoRIIO's control sockets speak: pdkv dials as a DEALER and listens as a ROUTER.
//! - [`memory`]: registered regions of host memory, and revocation by deregistering (a fence).
//! - [`transport`]: the data-plane seam, [`transport::Transport`], through which a decode rank
//!   reads byte ranges of a producer rank's regions, with typed errors.
//! - [`tcp`]: the TCP data plane: a producer's [`tcp::TcpReadServer`] and a decode rank's
//!   [`tcp::TcpTransport`], with the wire protocol in its module doc.
//! - [`connector`], [`prefill_rank`], [`decode_rank`]: one rank's process (`pdkv connector`),
//!   driving a core node over the pieces above; [`rank_io`] is what the connector and the two
//!   drivers share (the scheduler link, the node thread's inputs), below both; [`sched`] is its
//!   channel to the cluster's scheduler, [`pattern`] the KV bytes prefill writes and decode
//!   verifies, and [`message_faults`] the lost, duplicated and delayed control messages a run
//!   can inject.
//! - [`cluster`]: `pdkv cluster`: the proxy and the engines' schedulers, which start one
//!   connector process per rank on one host and push requests through them; [`signals`] lets
//!   its command line stop it in order on SIGINT or SIGTERM.

// `unsafe` only in the FFI modules that name it below (libibverbs, HIP, signal handlers): deny,
// not forbid, at the root, because a forbid could not be lifted for them.
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod cluster;
pub mod connector;
pub mod decode_rank;
#[cfg(feature = "hip")]
// FFI: the HIP runtime's C API.
#[allow(unsafe_code)]
pub mod hip;
pub mod memory;
pub mod message_faults;
pub mod pattern;
pub mod plugin;
pub mod prefill_rank;
pub mod rank_io;
pub mod sched;
// FFI: installs the SIGINT and SIGTERM handlers through libc's `signal`.
#[allow(unsafe_code)]
pub mod signals;
pub mod tcp;
pub mod transport;
#[cfg(feature = "rdma")]
// FFI: libibverbs and librdmacm through rdma-sys.
#[allow(unsafe_code)]
pub mod verbs;
pub mod zmtp;
