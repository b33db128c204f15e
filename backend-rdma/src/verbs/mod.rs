//! The RDMA verbs data plane (feature `rdma`): a producer rank's [`VerbsServer`] exposes its
//! [`Regions`] as memory regions, and a decode rank's [`VerbsTransport`] implements
//! [`Transport`] with one-sided RDMA READs over reliable-connected (RC) queue pairs.
//!
//! Bindings come from `rdma-sys` (libibverbs; bindgen at build time, so building needs
//! `libibverbs-dev`, `librdmacm-dev`, `libclang-dev` and `pkg-config`). Any RDMA device works;
//! the tests run on Soft-RoCE (`rdma_rxe`) inside a qemu guest (`cargo xtask rdma-vm`), since
//! rdma_cm is not used: queue pairs are connected out of band over a TCP control connection.
//!
//! # Device
//!
//! The device a rank's configuration names, else the one `PDKV_RDMA_DEVICE` names, else the
//! first `ibv_get_device_list` reports;
//! port 1, or `PDKV_RDMA_PORT`; the GID is the first IPv4-mapped one in the port's table (the
//! usual RoCE v2 choice), else the first non-zero one, or index `PDKV_RDMA_GID_INDEX`. Without
//! a device, [`VerbsServer::bind`] returns [`VerbsError::NoDevice`] and [`VerbsTransport`]'s
//! reads return [`TransportError::Connect`] with kind `Unsupported` and the same text.
//!
//! # Control protocol
//!
//! One TCP connection per queue pair, all integers big-endian. The client opens it and sends
//! HELLO: [`CONTROL_MAGIC`], version [`CONTROL_VERSION`], kind [`KIND_HELLO`] and its QP info
//! (QP number u32, first PSN u32, LID u16, GID 16 bytes, active MTU u8, most outstanding RDMA
//! READs it serves u8, link layer u8). The server creates an RC QP, moves it INIT→RTR→RTS
//! (remote read allowed), and answers a status byte ([`crate::tcp::STATUS_OK`] or another
//! status of [`crate::tcp`] followed by a u32-length message, then it closes), its own QP info
//! and the region table. The client then moves its QP to RTR→RTS and may post reads: the server
//! is already in RTR when its answer leaves.
//!
//! The region table is a u32 count (at most [`MAX_TABLE_ENTRIES`]) of entries: pdkv base
//! address u64, length u64, virtual address of the registered buffer u64, rkey u32.
//!
//! The client may later send REFRESH ([`KIND_REFRESH`], address u64, length u64) for a range
//! its table does not cover. The server checks the range against its registry, as the TCP data
//! plane would, and answers a status byte, a u32-length message and a fresh table. This is how
//! regions registered after a client connected are found: MRs are registered lazily, whenever
//! a table is built (on HELLO and on REFRESH), and MRs of regions that are no longer live are
//! deregistered then. A client that closes the connection tears its QP down on the server.
//!
//! # Fences
//!
//! An RDMA READ never involves the server's CPU, so refusing a read means invalidating the key:
//! [`VerbsServer::rekey`] deregisters the region's MR and registers a new one (a new rkey).
//! Every read that carries the old rkey, in flight or later, fails on the reader with a remote
//! access error, which [`VerbsTransport`] reports as [`RemoteCode::Revoked`]; it then drops that
//! connection, and the next read reconnects and gets the new keys. [`VerbsServer::deregister`]
//! does the same for a region that goes away for good: its MR is deregistered before the
//! region leaves the registry. Deregistering straight on [`Regions`] leaves the MR, and the
//! pinned pages under it, readable by clients that still hold the table until the next table is
//! built. Range fences inside a live region ([`Regions`]' `fence`) are checked only on the
//! REFRESH path: an MR covers its whole region, so only a rekey revokes RDMA access.
//!
//! # Reads
//!
//! [`VerbsTransport`] keeps one connection per peer. A read translates each range to (virtual
//! address, rkey) with the table (refreshing it once for a range it does not cover; a range the
//! server then refuses is refused without posting anything), splits ranges at the port's
//! largest message (at most 1 GiB), and keeps up to [`SEND_QUEUE_DEPTH`] signalled RDMA READs
//! posted, polling the connection's own completion queue until all complete or the I/O timeout
//! passes. Reads of at least the direct threshold go straight into the caller's buffer, which
//! is registered for the read and deregistered after it; smaller ones go through a bounce
//! buffer registered once and grown as needed (at most the threshold), then copied. After a
//! failed completion, a timeout or a control-connection error the peer's connection is dropped
//! (destroying the QP stops any transfer still running before the buffers are released), so the
//! next read reconnects; a refusal the server gave before anything was posted keeps it.
//!
//! Every verbs object is owned by a wrapper whose `Drop` frees it and which holds `Arc`s to
//! what it was made from (QP → CQ → device context and protection domain), so resources are
//! freed in the order verbs requires whatever order their owners are dropped in.
//!
//! # Layout
//!
//! `device` owns the libibverbs objects (device context, protection domain, CQ, MR, QP) and holds
//! nearly all the `unsafe`; `control` is the control protocol's messages; `server` is
//! [`VerbsServer`] and `client` is [`VerbsTransport`]; `error` is [`VerbsError`].

#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(doc)]
use crate::memory::Regions;
#[cfg(doc)]
use crate::transport::{RemoteCode, Transport, TransportError};

mod client;
mod control;
mod device;
mod error;
mod server;
#[cfg(test)]
mod tests;

pub use client::{VerbsTransport, DEFAULT_DIRECT_THRESHOLD, MAX_TOTAL_BYTES, SEND_QUEUE_DEPTH};
pub use control::{CONTROL_MAGIC, CONTROL_VERSION, KIND_HELLO, KIND_REFRESH, MAX_TABLE_ENTRIES};
pub use device::MAX_READ_BYTES;
pub use error::VerbsError;
pub use server::{VerbsServer, MAX_CONNECTIONS};
