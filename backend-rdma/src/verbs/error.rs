//! Why the verbs data plane could not start, or a server operation failed: [`VerbsError`].

use std::fmt;

use super::control::MAX_TABLE_ENTRIES;
#[cfg(doc)]
use super::VerbsServer;
use crate::memory::MemoryError;

/// Why the verbs data plane could not start, or a server operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerbsError {
    /// No RDMA device is present (or the kernel has no RDMA support loaded).
    NoDevice {
        /// What `ibv_get_device_list` said.
        detail: String,
    },
    /// The configuration or `PDKV_RDMA_DEVICE` names a device that is not present.
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The devices present.
        available: Vec<String>,
    },
    /// The port is not active (for Soft-RoCE: the netdev is down).
    PortNotActive {
        /// The device.
        device: String,
        /// The port number.
        port: u8,
        /// The port state (`ibv_port_state`).
        state: u32,
    },
    /// The port's GID table has no usable entry.
    NoGid {
        /// The device.
        device: String,
        /// The port number.
        port: u8,
    },
    /// A verbs call failed.
    Call {
        /// The call, e.g. `"ibv_reg_mr"`.
        call: &'static str,
        /// The error's text (errno).
        detail: String,
    },
    /// An environment variable has a value that cannot be used.
    BadSetting {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// The control listener could not start or stop (bind, thread, panic), as for the TCP
    /// data plane.
    Server(crate::tcp::ServerError),
    /// [`VerbsServer::rekey`] was given an address where no live region starts.
    UnknownRegion {
        /// The address.
        base_addr: u64,
    },
    /// The registry refused an operation.
    Memory(MemoryError),
    /// More live regions than a table may hold.
    TooManyRegions {
        /// How many are live.
        live: usize,
    },
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerbsError::NoDevice { detail } => write!(
                f,
                "no RDMA device: {detail}; load rdma_rxe and run `rdma link add rxe0 type rxe netdev \
                 IFACE` (Soft-RoCE), or load the driver of an RDMA NIC"
            ),
            VerbsError::NoSuchDevice { name, available } => {
                let present = if available.is_empty() { "none".to_string() } else { available.join(", ") };
                write!(f, "no RDMA device named {name:?}; present: {present}")
            }
            VerbsError::PortNotActive { device, port, state } => {
                write!(f, "port {port} of RDMA device {device} is not active (state {state})")
            }
            VerbsError::NoGid { device, port } => {
                write!(f, "port {port} of RDMA device {device} has no usable GID")
            }
            VerbsError::Call { call, detail } => write!(f, "{call} failed: {detail}"),
            VerbsError::BadSetting { name, value } => write!(f, "cannot use {name}={value:?}"),
            VerbsError::Server(e) => write!(f, "verbs control listener: {e}"),
            VerbsError::UnknownRegion { base_addr } => write!(f, "no live region starts at {base_addr:#x}"),
            VerbsError::Memory(e) => e.fmt(f),
            VerbsError::TooManyRegions { live } => {
                write!(f, "{live} live regions; a region table holds at most {MAX_TABLE_ENTRIES}")
            }
        }
    }
}

impl std::error::Error for VerbsError {}
