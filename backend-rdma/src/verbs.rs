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
//! The first device `ibv_get_device_list` reports, or the one named by `PDKV_RDMA_DEVICE`;
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

#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use crate::memory::{HostRegion, MemoryError, RegionId, Regions};
use crate::tcp::{
    check_total, memory_status, push_message, remote_code, MAX_MESSAGE_BYTES, STATUS_INTERNAL,
    STATUS_MALFORMED, STATUS_OK,
};
use crate::transport::{Endpoint, RemoteCode, Transport, TransportError};

/// First bytes of a HELLO: the control protocol's tag.
pub const CONTROL_MAGIC: [u8; 4] = *b"PKVR";
/// The control protocol's version.
pub const CONTROL_VERSION: u8 = 1;
/// Request kind: connect a queue pair and get the region table.
pub const KIND_HELLO: u8 = 1;
/// Request kind: check one range and get a fresh region table.
pub const KIND_REFRESH: u8 = 2;
/// Most entries a region table may hold.
pub const MAX_TABLE_ENTRIES: u32 = 65_536;
/// Most connections (queue pairs) a server serves at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 256;
/// Most RDMA READs a reader keeps posted on one queue pair.
pub const SEND_QUEUE_DEPTH: u32 = 128;
/// Largest RDMA READ a reader posts; longer ranges are split.
pub const MAX_READ_BYTES: u64 = 1 << 30;
/// Most bytes one read may ask for (as the TCP data plane): 1 GiB.
pub const MAX_TOTAL_BYTES: u64 = crate::tcp::MAX_TOTAL_BYTES;
/// Reads of at least this many bytes go straight into the caller's buffer; smaller ones through
/// the bounce buffer (see the module doc and [`VerbsTransport::set_direct_threshold`]). Measured
/// on Soft-RoCE in the `rdma-vm` guest: a 4 KiB read took about 110 µs through the bounce buffer
/// and 170–200 µs registering the caller's buffer (registration dominates), a 3 MiB read in 48
/// ranges about 5% less time direct (the copy is saved).
pub const DEFAULT_DIRECT_THRESHOLD: usize = 1 << 20;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Bytes of one encoded [`QpInfo`].
const QP_INFO_BYTES: usize = 29;
/// Bytes of one encoded table entry.
const ENTRY_BYTES: usize = 28;
/// How long a server waits for a started request, or for a client to take an answer.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Local ACK timeout exponent: 4.096 µs × 2^17 ≈ 0.5 s per try, generous for software RoCE
/// in an emulated guest; with [`RETRY_COUNT`] retries a dead peer is noticed in about 4 s.
const ACK_TIMEOUT: u8 = 17;
/// Transport and RNR retries. Not 7: rxe (like the spec for RNR) takes 7 as "retry forever",
/// and a read of a dead peer would then never complete.
const RETRY_COUNT: u8 = 6;
/// Most RDMA READs one side serves or issues at once, whatever the device allows.
const MAX_RD_ATOMIC: u8 = 16;
/// Work completions taken from the CQ per poll.
const POLL_BATCH: usize = 32;
/// How long an abort waits for the flushed completions of the reads it stopped (a flush takes
/// microseconds; past this the QP is destroyed, which stops the device as well).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the verbs data plane could not start, or a server operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerbsError {
    /// No RDMA device is present (or the kernel has no RDMA support loaded).
    NoDevice {
        /// What `ibv_get_device_list` said.
        detail: String,
    },
    /// `PDKV_RDMA_DEVICE` names a device that is not present.
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
                write!(f, "no RDMA device named {name:?} (PDKV_RDMA_DEVICE); present: {present}")
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

/// The last OS error's text, for a call that reported failure through `errno`.
fn errno_call(call: &'static str) -> VerbsError {
    VerbsError::Call { call, detail: io::Error::last_os_error().to_string() }
}

/// The error for a call that returned an errno value.
fn ret_call(call: &'static str, ret: c_int) -> VerbsError {
    VerbsError::Call { call, detail: io::Error::from_raw_os_error(ret.abs()).to_string() }
}

fn env_setting(name: &'static str) -> Result<Option<String>, VerbsError> {
    match std::env::var(name) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(VerbsError::BadSetting { name, value: v.to_string_lossy().into_owned() })
        }
    }
}

fn env_number<T: std::str::FromStr>(name: &'static str) -> Result<Option<T>, VerbsError> {
    match env_setting(name)? {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| VerbsError::BadSetting { name, value: v }),
    }
}

/// An open device context with its protection domain and the port this process uses.
struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    name: String,
    port: u8,
    lid: u16,
    link_layer: u8,
    active_mtu: u32,
    max_msg_sz: u64,
    gid: [u8; 16],
    gid_index: u8,
    max_qp_wr: u32,
    max_rd_atom: u8,
}

// SAFETY: libibverbs is thread safe: its verbs may be called on one context, PD, CQ, QP or MR
// from any thread (rdma-core documents every verb as thread safe). The pointers are owned by
// this value and freed once, in Drop.
unsafe impl Send for Device {}
// SAFETY: as for Send; `&Device` only reads the plain fields or passes the pointers to verbs.
unsafe impl Sync for Device {}

/// The device list, freed on drop.
struct DeviceList(*mut *mut ffi::ibv_device, usize);

impl DeviceList {
    fn get() -> Result<DeviceList, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer; the list is freed by Drop.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            return Err(VerbsError::NoDevice {
                detail: format!(
                    "ibv_get_device_list returned 0 devices ({e}: no RDMA support in the kernel)"
                ),
            });
        }
        let list = DeviceList(list, usize::try_from(n).unwrap_or(0));
        if list.1 == 0 {
            return Err(VerbsError::NoDevice { detail: "ibv_get_device_list returned 0 devices".into() });
        }
        Ok(list)
    }

    fn device(&self, i: usize) -> *mut ffi::ibv_device {
        debug_assert!(i < self.1);
        // SAFETY: the list holds `self.1` device pointers (followed by a null), and i < self.1.
        unsafe { *self.0.add(i) }
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: a device of a live list; ibv_get_device_name returns a NUL-terminated name
        // owned by the device (or null).
        let p = unsafe { ffi::ibv_get_device_name(self.device(i)) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-null and NUL-terminated, valid while the list lives.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once; opened contexts stay
        // valid after the list is freed.
        unsafe { ffi::ibv_free_device_list(self.0) };
    }
}

impl Device {
    fn open() -> Result<Arc<Device>, VerbsError> {
        let list = DeviceList::get()?;
        let names: Vec<String> = (0..list.1).map(|i| list.name(i)).collect();
        let index = match env_setting("PDKV_RDMA_DEVICE")? {
            None => 0,
            Some(want) => names
                .iter()
                .position(|n| *n == want)
                .ok_or(VerbsError::NoSuchDevice { name: want, available: names.clone() })?,
        };
        let name = names[index].clone();
        // SAFETY: a device of the live list.
        let ctx = unsafe { ffi::ibv_open_device(list.device(index)) };
        if ctx.is_null() {
            return Err(errno_call("ibv_open_device"));
        }
        drop(list);
        // From here `Context` closes the context on an early return.
        let ctx = Context(ctx);
        let port: u8 = env_number("PDKV_RDMA_PORT")?.unwrap_or(1);

        // SAFETY: ibv_device_attr is plain old data (integers and arrays); all-zero is valid.
        let mut dev_attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: an open context and a valid out pointer.
        let ret = unsafe { ffi::ibv_query_device(ctx.0, &mut dev_attr) };
        if ret != 0 {
            return Err(ret_call("ibv_query_device", ret));
        }
        // SAFETY: ibv_port_attr is plain old data; all-zero is valid.
        let mut port_attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: an open context and a valid out pointer of the full (new) size, which this
        // wrapper passes to the provider.
        let ret = unsafe { ffi::___ibv_query_port(ctx.0, port, &mut port_attr) };
        if ret != 0 {
            return Err(ret_call("ibv_query_port", ret));
        }
        if port_attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(VerbsError::PortNotActive { device: name, port, state: port_attr.state });
        }
        let (gid_index, gid) = match env_number::<u8>("PDKV_RDMA_GID_INDEX")? {
            Some(i) => {
                (i, query_gid(ctx.0, port, i).ok_or(VerbsError::NoGid { device: name.clone(), port })?)
            }
            None => pick_gid(ctx.0, port, port_attr.gid_tbl_len)
                .ok_or(VerbsError::NoGid { device: name.clone(), port })?,
        };
        // SAFETY: an open context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.0) };
        if pd.is_null() {
            return Err(errno_call("ibv_alloc_pd"));
        }
        let clamp = |v: c_int| u8::try_from(v.clamp(1, i32::from(MAX_RD_ATOMIC))).unwrap_or(1);
        let max_rd_atom = clamp(dev_attr.max_qp_rd_atom).min(clamp(dev_attr.max_qp_init_rd_atom));
        let max_msg_sz = match port_attr.max_msg_sz {
            0 => MAX_READ_BYTES,
            n => u64::from(n).min(MAX_READ_BYTES),
        };
        let device = Device {
            ctx: ctx.release(),
            pd,
            name,
            port,
            lid: port_attr.lid,
            link_layer: port_attr.link_layer,
            active_mtu: port_attr.active_mtu,
            max_msg_sz,
            gid,
            gid_index,
            max_qp_wr: u32::try_from(dev_attr.max_qp_wr).unwrap_or(1).max(1),
            max_rd_atom,
        };
        Ok(Arc::new(device))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every CQ, QP and MR made from this PD and context holds an Arc of this
        // device, so all are gone; the PD and context are freed once, PD first.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// An open context that is closed unless released (for early returns in [`Device::open`]).
struct Context(*mut ffi::ibv_context);

impl Context {
    fn release(self) -> *mut ffi::ibv_context {
        let ctx = self.0;
        std::mem::forget(self);
        ctx
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: an open context with nothing allocated from it yet, closed once.
        unsafe { ffi::ibv_close_device(self.0) };
    }
}

fn query_gid(ctx: *mut ffi::ibv_context, port: u8, index: u8) -> Option<[u8; 16]> {
    let mut gid = ffi::ibv_gid { raw: [0; 16] };
    // SAFETY: an open context and a valid out pointer.
    let ret = unsafe { ffi::ibv_query_gid(ctx, port, c_int::from(index), &mut gid) };
    // SAFETY: every bit pattern of the union is a valid byte array.
    let raw = unsafe { gid.raw };
    (ret == 0 && raw != [0; 16]).then_some(raw)
}

/// The first IPv4-mapped GID (`::ffff:a.b.c.d`, RoCE v2 over IPv4), else the first non-zero.
fn pick_gid(ctx: *mut ffi::ibv_context, port: u8, table_len: c_int) -> Option<(u8, [u8; 16])> {
    let len = u8::try_from(table_len.clamp(0, 255)).unwrap_or(0);
    let gids: Vec<(u8, [u8; 16])> =
        (0..len).filter_map(|i| query_gid(ctx, port, i).map(|g| (i, g))).collect();
    let v4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
    gids.iter().find(|(_, g)| v4_mapped(g)).or(gids.first()).copied()
}

/// A completion queue.
struct Cq {
    raw: *mut ffi::ibv_cq,
    dev: Arc<Device>,
}

// SAFETY: see Device: verbs on a CQ may be called from any thread.
unsafe impl Send for Cq {}
// SAFETY: see Device.
unsafe impl Sync for Cq {}

impl Cq {
    fn create(dev: &Arc<Device>, depth: u32) -> Result<Arc<Cq>, VerbsError> {
        let cqe = c_int::try_from(depth).unwrap_or(c_int::MAX);
        // SAFETY: an open context; no completion channel, no context pointer.
        let raw = unsafe { ffi::ibv_create_cq(dev.ctx, cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if raw.is_null() {
            return Err(errno_call("ibv_create_cq"));
        }
        Ok(Arc::new(Cq { raw, dev: Arc::clone(dev) }))
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of it, so none is left; destroyed once.
        unsafe { ffi::ibv_destroy_cq(self.raw) };
    }
}

/// A memory region.
struct Mr {
    raw: *mut ffi::ibv_mr,
    _dev: Arc<Device>,
}

// SAFETY: see Device: verbs on an MR may be called from any thread.
unsafe impl Send for Mr {}
// SAFETY: see Device; `&Mr` only reads the keys.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until the MR is dropped or, if it may be freed earlier,
    /// the caller accepts that the device keeps reading the pinned pages (never writes, unless
    /// `access` allows a write the caller then posts). With `IBV_ACCESS_LOCAL_WRITE` and a
    /// work request using the lkey, the memory must not be read or written by Rust while that
    /// request may run.
    unsafe fn register(dev: &Arc<Device>, addr: *mut u8, len: usize, access: u32) -> Result<Mr, VerbsError> {
        // SAFETY: the caller's contract; the PD is alive (held by `dev`).
        let raw = unsafe { ffi::ibv_reg_mr(dev.pd, addr.cast::<c_void>(), len, access as c_int) };
        if raw.is_null() {
            return Err(errno_call("ibv_reg_mr"));
        }
        Ok(Mr { raw, _dev: Arc::clone(dev) })
    }

    fn lkey(&self) -> u32 {
        // SAFETY: a registered MR, alive while self is.
        unsafe { (*self.raw).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: a registered MR, alive while self is.
        unsafe { (*self.raw).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by Mr::register, deregistered once; the device outlives it.
        unsafe { ffi::ibv_dereg_mr(self.raw) };
    }
}

/// What one side tells the other to connect its RC queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QpInfo {
    qpn: u32,
    psn: u32,
    lid: u16,
    gid: [u8; 16],
    mtu: u8,
    rd_atom: u8,
    link_layer: u8,
}

impl QpInfo {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_be_bytes());
        out.extend_from_slice(&self.psn.to_be_bytes());
        out.extend_from_slice(&self.lid.to_be_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&[self.mtu, self.rd_atom, self.link_layer]);
    }

    fn decode(b: &[u8; QP_INFO_BYTES]) -> QpInfo {
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        QpInfo {
            qpn: u32_at(0),
            psn: u32_at(4) & 0xff_ffff,
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid,
            mtu: b[26],
            rd_atom: b[27],
            link_layer: b[28],
        }
    }
}

/// A fresh 24-bit packet sequence number (any value works; distinct ones ease debugging).
fn next_psn() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    (nanos ^ COUNTER.fetch_add(0x9e37, Ordering::Relaxed).wrapping_mul(2_654_435_761)) & 0xff_ffff
}

/// A reliable-connected queue pair.
struct Qp {
    raw: *mut ffi::ibv_qp,
    psn: u32,
    cq: Arc<Cq>,
}

// SAFETY: see Device: verbs on a QP may be called from any thread; each Qp is used by one
// thread at a time (its owner).
unsafe impl Send for Qp {}

impl Qp {
    /// Creates an RC QP on `cq` and moves it to INIT with `access` for remote peers.
    fn create(cq: &Arc<Cq>, send_depth: u32, access: u32) -> Result<Qp, VerbsError> {
        let dev = &cq.dev;
        // SAFETY: ibv_qp_init_attr is plain old data (integers and pointers); zero is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw;
        init.recv_cq = cq.raw;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = send_depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: a live PD and a filled attribute block.
        let raw = unsafe { ffi::ibv_create_qp(dev.pd, &mut init) };
        if raw.is_null() {
            return Err(errno_call("ibv_create_qp"));
        }
        let qp = Qp { raw, psn: next_psn(), cq: Arc::clone(cq) };
        let mut attr = zeroed_qp_attr();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = dev.port;
        attr.qp_access_flags = access;
        use ffi::ibv_qp_attr_mask as M;
        qp.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )?;
        Ok(qp)
    }

    fn dev(&self) -> &Device {
        &self.cq.dev
    }

    fn info(&self) -> QpInfo {
        let dev = self.dev();
        QpInfo {
            // SAFETY: a live QP.
            qpn: unsafe { (*self.raw).qp_num },
            psn: self.psn,
            lid: dev.lid,
            gid: dev.gid,
            mtu: u8::try_from(dev.active_mtu).unwrap_or(1),
            rd_atom: dev.max_rd_atom,
            link_layer: dev.link_layer,
        }
    }

    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<(), VerbsError> {
        // SAFETY: a live QP and a filled attribute block for the fields in `mask`.
        let ret = unsafe { ffi::ibv_modify_qp(self.raw, attr, mask.0 as c_int) };
        if ret != 0 {
            return Err(ret_call("ibv_modify_qp", ret));
        }
        Ok(())
    }

    /// Moves an INIT QP to RTR and then RTS, connected to `remote`.
    fn connect(&self, remote: &QpInfo) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        let dev = self.dev();
        let mut attr = zeroed_qp_attr();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = dev.active_mtu.min(u32::from(remote.mtu)).max(ffi::ibv_mtu::IBV_MTU_256);
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = dev.max_rd_atom;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = dev.port;
        if dev.link_layer == LINK_LAYER_ETHERNET || remote.lid == 0 {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = dev.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = 0;
            attr.ah_attr.grh.flow_label = 0;
        }
        let rtr = M::IBV_QP_STATE
            | M::IBV_QP_AV
            | M::IBV_QP_PATH_MTU
            | M::IBV_QP_DEST_QPN
            | M::IBV_QP_RQ_PSN
            | M::IBV_QP_MAX_DEST_RD_ATOMIC
            | M::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, rtr)?;
        let mut attr = zeroed_qp_attr();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = ACK_TIMEOUT;
        attr.retry_cnt = RETRY_COUNT;
        attr.rnr_retry = RETRY_COUNT;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = dev.max_rd_atom.min(remote.rd_atom.max(1));
        let rts = M::IBV_QP_STATE
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_SQ_PSN
            | M::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, rts)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: a live QP destroyed once; after this returns the device no longer touches
        // any buffer through it. Its CQ is held by `self.cq` and freed after.
        unsafe { ffi::ibv_destroy_qp(self.raw) };
    }
}

fn zeroed_qp_attr() -> ffi::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain old data (integers, byte arrays, a union of byte arrays);
    // all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// One entry of a region table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TableEntry {
    /// pdkv base address.
    base: u64,
    len: u64,
    /// Virtual address of the registered buffer.
    va: u64,
    rkey: u32,
}

fn encode_table(table: &[TableEntry], out: &mut Vec<u8>) {
    out.extend_from_slice(&(table.len() as u32).to_be_bytes());
    for e in table {
        out.extend_from_slice(&e.base.to_be_bytes());
        out.extend_from_slice(&e.len.to_be_bytes());
        out.extend_from_slice(&e.va.to_be_bytes());
        out.extend_from_slice(&e.rkey.to_be_bytes());
    }
}

/// A region's MR, with what it was registered for.
struct RegisteredRegion {
    id: RegionId,
    ptr: usize,
    len: usize,
    mr: Mr,
}

/// What a server's threads share.
struct ServerShared {
    regions: Arc<RwLock<Regions>>,
    /// MRs by region base address. Lock order: `regions` first, then `mrs`.
    mrs: Mutex<BTreeMap<u64, RegisteredRegion>>,
    cq: Arc<Cq>,
    dev: Arc<Device>,
}

/// Access a region's MR is registered with. Remote read is what peers use. Local write is
/// never used by a work request (the server posts none); it is asked for because a writable
/// registration makes the kernel pin the region's own (copy-on-write broken) pages, where a
/// read-only one may pin the shared zero page under a freshly zeroed buffer that the producer
/// fills later, and peers would read zeros.
const REGION_ACCESS: u32 =
    ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 | ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;

impl ServerShared {
    fn register(&self, region: &HostRegion) -> Result<RegisteredRegion, VerbsError> {
        let (ptr, len) = (region.bytes.as_ptr(), region.bytes.len());
        // SAFETY: the region is live under the caller's registry lock and its buffer never
        // moves while it is (its length is fixed). The MR is dropped when the region is no
        // longer live (reconcile, rekey, deregister); if the region is deregistered straight on
        // the registry, the kernel keeps the pages pinned until then, so nothing in this
        // process is touched. No work request uses the lkey, so the device never writes.
        let mr = unsafe { Mr::register(&self.dev, ptr.cast_mut(), len, REGION_ACCESS)? };
        Ok(RegisteredRegion { id: region.id, ptr: ptr as usize, len, mr })
    }

    /// Brings the MRs in line with the live regions and returns the table.
    fn reconcile(&self, regions: &Regions) -> Result<Vec<TableEntry>, VerbsError> {
        if regions.len() > MAX_TABLE_ENTRIES as usize {
            return Err(VerbsError::TooManyRegions { live: regions.len() });
        }
        let mut mrs = self.mrs.lock().unwrap_or_else(PoisonError::into_inner);
        let live: BTreeMap<u64, &HostRegion> = regions.live_regions().map(|r| (r.base_addr, r)).collect();
        mrs.retain(|base, reg| {
            live.get(base).is_some_and(|r| {
                r.id == reg.id && r.bytes.as_ptr() as usize == reg.ptr && r.bytes.len() == reg.len
            })
        });
        let mut table = Vec::with_capacity(live.len());
        for (&base, region) in &live {
            let reg = match mrs.entry(base) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => e.insert(self.register(region)?),
            };
            table.push(TableEntry { base, len: reg.len as u64, va: reg.ptr as u64, rkey: reg.mr.rkey() });
        }
        Ok(table)
    }
}

/// A producer rank's RDMA data-plane server: registers its regions as MRs and connects one RC
/// queue pair per client over a TCP control connection (see the module doc), on its own threads
/// (one accepting, one per connection), until [`VerbsServer::shutdown`] or drop.
pub struct VerbsServer {
    accept: crate::tcp::AcceptThread,
    shared: Arc<ServerShared>,
}

impl fmt::Debug for VerbsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsServer")
            .field("addr", &self.accept.addr)
            .field("device", &self.shared.dev.name)
            .field("port", &self.shared.dev.port)
            .finish_non_exhaustive()
    }
}

impl VerbsServer {
    /// Opens the RDMA device, listens on `addr` (port 0 picks a free port) for control
    /// connections, and starts serving `regions`. Fails with [`VerbsError::NoDevice`] when
    /// there is no RDMA device.
    pub fn bind(addr: SocketAddr, regions: Arc<RwLock<Regions>>) -> Result<VerbsServer, VerbsError> {
        let dev = Device::open()?;
        let cq = Cq::create(&dev, 16)?;
        let listener = TcpListener::bind(addr)
            .map_err(|e| VerbsError::Server(crate::tcp::ServerError::bind(addr, &e)))?;
        let shared = Arc::new(ServerShared { regions, mrs: Mutex::new(BTreeMap::new()), cq, dev });
        // Register what is live now, so the first client does not pay for it.
        {
            let regions = shared.regions.read().unwrap_or_else(PoisonError::into_inner);
            shared.reconcile(&regions)?;
        }
        let accept = crate::tcp::AcceptThread::spawn(
            addr,
            listener,
            Arc::clone(&shared),
            "pdkv-verbs",
            MAX_CONNECTIONS,
            serve_connection,
        )
        .map_err(VerbsError::Server)?;
        Ok(VerbsServer { accept, shared })
    }

    /// The address the control listener is bound to (what readers dial as the peer).
    pub fn local_addr(&self) -> SocketAddr {
        self.accept.addr
    }

    /// The RDMA device's name.
    pub fn device_name(&self) -> &str {
        &self.shared.dev.name
    }

    /// Number of regions with a registered MR.
    pub fn registered(&self) -> usize {
        self.shared.mrs.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// The fence: deregisters the MR of the live region starting at `base_addr` and registers
    /// a new one, returning its rkey. Once this returns, every RDMA READ carrying the old rkey,
    /// whether already in flight or posted later, fails on the reader with a remote access
    /// error ([`RemoteCode::Revoked`] from [`VerbsTransport`]); readers reconnect and get the
    /// new key. Blocks table building for the duration.
    pub fn rekey(&self, base_addr: u64) -> Result<u32, VerbsError> {
        let regions = self.shared.regions.read().unwrap_or_else(PoisonError::into_inner);
        let region = regions
            .live_regions()
            .find(|r| r.base_addr == base_addr)
            .ok_or(VerbsError::UnknownRegion { base_addr })?;
        let mut mrs = self.shared.mrs.lock().unwrap_or_else(PoisonError::into_inner);
        // Deregister first: the old key must be dead before the new one exists.
        drop(mrs.remove(&base_addr));
        let reg = self.shared.register(region)?;
        let rkey = reg.mr.rkey();
        mrs.insert(base_addr, reg);
        Ok(rkey)
    }

    /// Deregisters a region for good: its MR first (reads with its rkey fail as after
    /// [`VerbsServer::rekey`]), then the registry entry, whose bytes are returned. Later reads
    /// of its range are refused with [`RemoteCode::Revoked`] before anything is posted.
    pub fn deregister(&self, id: RegionId) -> Result<HostRegion, VerbsError> {
        let mut regions = self.shared.regions.write().unwrap_or_else(PoisonError::into_inner);
        let base = regions
            .region(id)
            .map(|r| r.base_addr)
            .ok_or(VerbsError::Memory(MemoryError::UnknownRegion { region: id }))?;
        drop(self.shared.mrs.lock().unwrap_or_else(PoisonError::into_inner).remove(&base));
        regions.deregister(id).map_err(VerbsError::Memory)
    }

    /// Stops accepting, closes every control connection, destroys every QP and joins every
    /// thread; the MRs, CQ, protection domain and device context are freed when the last
    /// reference goes (right away, unless the caller still holds nothing else).
    pub fn shutdown(mut self) -> Result<(), VerbsError> {
        self.accept.stop_and_join().map_err(|()| VerbsError::Server(crate::tcp::ServerError::Panicked))
    }
}

impl Drop for VerbsServer {
    fn drop(&mut self) {
        // Threads (and so QPs) first; `shared` (MRs, CQ, PD, context) is dropped after.
        let _ = self.accept.stop_and_join();
    }
}

fn send_refusal(mut stream: &TcpStream, status: u8, message: &str) {
    let mut out = vec![status];
    push_message(&mut out, message);
    let _ = stream.write_all(&out);
    let _ = stream.shutdown(Shutdown::Write);
}

/// Serves one control connection: the HELLO that connects its QP, then REFRESHes until the
/// client closes. The QP lives exactly as long as this call.
fn serve_connection(stream: &TcpStream, shared: &ServerShared) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(SERVER_IO_TIMEOUT));
    if stream.set_read_timeout(Some(SERVER_IO_TIMEOUT)).is_err() {
        return;
    }
    let mut s = stream;
    let mut head = [0u8; 6];
    if s.read_exact(&mut head).is_err() {
        return;
    }
    if head[..4] != CONTROL_MAGIC || head[4] != CONTROL_VERSION || head[5] != KIND_HELLO {
        let msg =
            format!("bad HELLO {head:02x?}: expected magic {CONTROL_MAGIC:02x?}, version {CONTROL_VERSION}");
        return send_refusal(stream, STATUS_MALFORMED, &msg);
    }
    let mut info = [0u8; QP_INFO_BYTES];
    if s.read_exact(&mut info).is_err() {
        return;
    }
    let remote = QpInfo::decode(&info);
    let access = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    let setup = Qp::create(&shared.cq, 1, access).and_then(|qp| qp.connect(&remote).map(|()| qp));
    let qp = match setup {
        Ok(qp) => qp,
        Err(e) => return send_refusal(stream, STATUS_INTERNAL, &e.to_string()),
    };
    let table = {
        let regions = shared.regions.read().unwrap_or_else(PoisonError::into_inner);
        shared.reconcile(&regions)
    };
    let table = match table {
        Ok(t) => t,
        Err(e) => return send_refusal(stream, STATUS_INTERNAL, &e.to_string()),
    };
    let mut out = vec![STATUS_OK];
    qp.info().encode(&mut out);
    encode_table(&table, &mut out);
    if s.write_all(&out).is_err() {
        return;
    }
    loop {
        // Between requests the connection idles as long as the client keeps it.
        if stream.set_read_timeout(None).is_err() {
            return;
        }
        let mut kind = [0u8; 1];
        if s.read_exact(&mut kind).is_err() {
            break;
        }
        if kind[0] != KIND_REFRESH {
            return send_refusal(stream, STATUS_MALFORMED, &format!("unknown request kind {}", kind[0]));
        }
        if stream.set_read_timeout(Some(SERVER_IO_TIMEOUT)).is_err() {
            return;
        }
        let mut body = [0u8; 16];
        if s.read_exact(&mut body).is_err() {
            break;
        }
        let (a, l) = body.split_at(8);
        let addr = u64::from_be_bytes(a.try_into().unwrap_or([0; 8]));
        let len = u64::from_be_bytes(l.try_into().unwrap_or([0; 8]));
        let (status, message, table) = {
            let regions = shared.regions.read().unwrap_or_else(PoisonError::into_inner);
            let (status, message) = match regions.read(addr, len) {
                Ok(_) => (STATUS_OK, String::new()),
                Err(e) => (memory_status(&e), e.to_string()),
            };
            match shared.reconcile(&regions) {
                Ok(t) => (status, message, t),
                Err(e) => return send_refusal(stream, STATUS_INTERNAL, &e.to_string()),
            }
        };
        let mut out = vec![status];
        push_message(&mut out, &message);
        encode_table(&table, &mut out);
        if s.write_all(&out).is_err() {
            break;
        }
    }
    drop(qp);
}

/// A connection to one peer: its QP (and CQ) and the peer's region table.
struct Conn {
    qp: Qp,
    stream: TcpStream,
    table: Vec<TableEntry>,
}

impl Conn {
    /// The entry holding all of `len` bytes at `addr`, if the table has one.
    fn lookup(&self, addr: u64, len: u64) -> Option<TableEntry> {
        let i = self.table.partition_point(|e| e.base <= addr);
        let e = *self.table.get(i.checked_sub(1)?)?;
        let (end, region_end) = (addr.checked_add(len)?, e.base + e.len);
        // As the registry: the first byte must lie inside the region, even for no bytes.
        (addr < region_end && end <= region_end).then_some(e)
    }

    /// Whether the server has closed the control connection (it restarted or shut down).
    fn closed(&self) -> bool {
        let mut probe = [0u8; 1];
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let closed = match self.stream.peek(&mut probe) {
            Ok(_) => true, // EOF, or bytes nobody asked for: either way out of step.
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        };
        closed || self.stream.set_nonblocking(false).is_err()
    }
}

/// The registered bounce buffer for small reads. Field order matters: the MR is dropped
/// (deregistered) before the buffer is freed.
struct Bounce {
    mr: Mr,
    buf: Vec<u8>,
}

/// One RDMA READ to post: local address, length, remote address, rkey.
#[derive(Clone, Copy)]
struct Segment {
    local: u64,
    len: u32,
    remote: u64,
    rkey: u32,
}

/// A decode rank's RDMA data plane: one RC queue pair per peer, reopened after an error.
pub struct VerbsTransport {
    // Field order is drop order: connections (QPs) before the bounce buffer's MR.
    conns: BTreeMap<Endpoint, Conn>,
    bounce: Option<Bounce>,
    dev: Option<Arc<Device>>,
    connect_timeout: Duration,
    io_timeout: Duration,
    direct_threshold: usize,
}

impl fmt::Debug for VerbsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsTransport")
            .field("connections", &self.conns.len())
            .field("device", &self.dev.as_ref().map(|d| d.name.as_str()))
            .field("direct_threshold", &self.direct_threshold)
            .finish_non_exhaustive()
    }
}

impl Default for VerbsTransport {
    fn default() -> Self {
        VerbsTransport::new()
    }
}

impl VerbsTransport {
    /// A transport with a 5 s connect timeout and a 30 s timeout for control I/O and for a
    /// read's completions. The device is opened at the first read.
    pub fn new() -> VerbsTransport {
        VerbsTransport::with_timeouts(Duration::from_secs(5), Duration::from_secs(30))
    }

    /// A transport with the given timeouts.
    pub fn with_timeouts(connect_timeout: Duration, io_timeout: Duration) -> VerbsTransport {
        VerbsTransport {
            conns: BTreeMap::new(),
            bounce: None,
            dev: None,
            connect_timeout,
            io_timeout,
            direct_threshold: DEFAULT_DIRECT_THRESHOLD,
        }
    }

    /// Sets the size from which reads go straight into the caller's buffer (registered for the
    /// read) instead of through the bounce buffer (0: always direct; `usize::MAX`: always
    /// bounce, with a bounce buffer as large as the largest read).
    pub fn set_direct_threshold(&mut self, bytes: usize) {
        self.direct_threshold = bytes;
        self.bounce = None;
    }

    /// Number of open connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Closes the connection to `peer`, if open.
    pub fn disconnect(&mut self, peer: &Endpoint) {
        self.conns.remove(peer);
    }

    fn device(&mut self, peer: &Endpoint) -> Result<Arc<Device>, TransportError> {
        if let Some(d) = &self.dev {
            return Ok(Arc::clone(d));
        }
        let dev = Device::open().map_err(|e| setup_error(peer, &e))?;
        self.dev = Some(Arc::clone(&dev));
        Ok(dev)
    }

    fn connect(&self, dev: &Arc<Device>, peer: &Endpoint) -> Result<Conn, TransportError> {
        let fail = |kind, detail| TransportError::Connect { peer: peer.to_string(), kind, detail };
        let addrs = (peer.host.as_str(), peer.port)
            .to_socket_addrs()
            .map_err(|e| fail(e.kind(), format!("cannot resolve: {e}")))?;
        let mut last = fail(io::ErrorKind::NotFound, "no address".to_string());
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    last = TransportError::Timeout { peer: peer.to_string(), op: "connect" };
                }
                Err(e) => last = fail(e.kind(), e.to_string()),
            }
        }
        let stream = stream.ok_or(last)?;
        let set = stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(self.io_timeout)))
            .and_then(|()| stream.set_write_timeout(Some(self.io_timeout)));
        set.map_err(|e| fail(e.kind(), e.to_string()))?;

        let depth = SEND_QUEUE_DEPTH.min(dev.max_qp_wr);
        let cq = Cq::create(dev, depth).map_err(|e| setup_error(peer, &e))?;
        // The reader grants no remote access to itself.
        let qp = Qp::create(&cq, depth, 0).map_err(|e| setup_error(peer, &e))?;
        let mut hello = Vec::with_capacity(6 + QP_INFO_BYTES);
        hello.extend_from_slice(&CONTROL_MAGIC);
        hello.extend_from_slice(&[CONTROL_VERSION, KIND_HELLO]);
        qp.info().encode(&mut hello);
        let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
        (&stream).write_all(&hello).map_err(io("send hello"))?;
        let mut status = [0u8; 1];
        (&stream).read_exact(&mut status).map_err(io("read hello status"))?;
        if status[0] != STATUS_OK {
            return Err(read_refusal(&stream, peer, status[0]));
        }
        let mut info = [0u8; QP_INFO_BYTES];
        (&stream).read_exact(&mut info).map_err(io("read hello"))?;
        let remote = QpInfo::decode(&info);
        let table = read_table(&stream, peer)?;
        qp.connect(&remote).map_err(|e| setup_error(peer, &e))?;
        Ok(Conn { qp, stream, table })
    }

    /// Asks the server about a range the table does not hold; takes the fresh table.
    fn refresh(conn: &mut Conn, peer: &Endpoint, addr: u64, len: u64) -> Result<(), TransportError> {
        let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
        let mut req = vec![KIND_REFRESH];
        req.extend_from_slice(&addr.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        (&conn.stream).write_all(&req).map_err(io("send refresh"))?;
        let mut status = [0u8; 1];
        (&conn.stream).read_exact(&mut status).map_err(io("read refresh status"))?;
        let message = read_message(&conn.stream, peer)?;
        conn.table = read_table(&conn.stream, peer)?;
        if status[0] != STATUS_OK {
            let code = remote_code(status[0]);
            return Err(TransportError::Remote { peer: peer.to_string(), code, message });
        }
        Ok(())
    }

    /// Translates the ranges to segments of at most the device's message size, local
    /// addresses starting at `local`.
    fn plan(
        conn: &mut Conn,
        peer: &Endpoint,
        dev: &Device,
        ranges: &[(u64, u64)],
        local: u64,
    ) -> Result<Vec<Segment>, TransportError> {
        let mut segs = Vec::with_capacity(ranges.len());
        let mut offset = 0u64;
        for &(addr, len) in ranges {
            let entry = match conn.lookup(addr, len) {
                Some(e) => e,
                None => {
                    // The server's verdict on the range, and a fresh table.
                    Self::refresh(conn, peer, addr, len)?;
                    // Readable, yet not in the fresh table: the registry changed in between.
                    conn.lookup(addr, len).ok_or_else(|| TransportError::Remote {
                        peer: peer.to_string(),
                        code: RemoteCode::Unregistered,
                        message: format!("no registered region holds {len} bytes at {addr:#x}"),
                    })?
                }
            };
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(dev.max_msg_sz);
                segs.push(Segment {
                    local: local + offset + done,
                    len: n as u32,
                    remote: entry.va + (addr - entry.base) + done,
                    rkey: entry.rkey,
                });
                done += n;
            }
            offset += len;
        }
        Ok(segs)
    }

    /// Posts the segments and waits for every completion. When `cancelled` turns true, moves
    /// the QP to the error state and drains the flushed completions of everything posted, so
    /// the device touches none of the buffers afterwards.
    fn post_and_poll(
        conn: &Conn,
        peer: &Endpoint,
        segs: &[Segment],
        lkey: u32,
        timeout: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let depth = SEND_QUEUE_DEPTH.min(conn.qp.dev().max_qp_wr) as usize;
        let deadline = Instant::now() + timeout;
        let (mut posted, mut completed) = (0usize, 0usize);
        // SAFETY: ibv_wc is plain old data (integers and a union of integers); zero is valid.
        let mut wcs: Vec<ffi::ibv_wc> = (0..POLL_BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut idle = 0u32;
        let mut turns = 0u32;
        let started = Instant::now();
        while completed < segs.len() {
            // Checked every few turns whether completions arrive or not: a steady stream of
            // them must not hide a cancellation until the read ends.
            turns = turns.wrapping_add(1);
            if turns & 63 == 0 && cancelled() {
                Self::flush(conn, peer, posted - completed, &mut wcs)?;
                return Err(TransportError::Aborted { peer: peer.to_string() });
            }
            let room = depth - (posted - completed);
            if posted < segs.len() && room > 0 {
                let batch = &segs[posted..segs.len().min(posted + room)];
                post_reads(&conn.qp, batch, lkey, posted as u64).map_err(|e| TransportError::Io {
                    peer: peer.to_string(),
                    op: "post rdma read",
                    kind: io::ErrorKind::Other,
                    detail: e.to_string(),
                })?;
                posted += batch.len();
            }
            // SAFETY: a live CQ and an array of POLL_BATCH entries.
            let got = unsafe { ffi::ibv_poll_cq(conn.qp.cq.raw, POLL_BATCH as c_int, wcs.as_mut_ptr()) };
            if got < 0 {
                return Err(TransportError::Io {
                    peer: peer.to_string(),
                    op: "poll completion queue",
                    kind: io::ErrorKind::Other,
                    detail: format!("ibv_poll_cq returned {got}"),
                });
            }
            for wc in &wcs[..got as usize] {
                if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                    let seg = usize::try_from(wc.wr_id).ok().and_then(|i| segs.get(i));
                    return Err(completion_error(peer, wc, seg));
                }
                completed += 1;
            }
            if got > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle & 255 == 0 && Instant::now() >= deadline {
                return Err(TransportError::Timeout { peer: peer.to_string(), op: "rdma read completion" });
            }
            // Spin briefly, then yield, then sleep a little: completions of a short read come
            // within microseconds, a long one may take seconds.
            if idle < 1024 {
                std::hint::spin_loop();
            } else if started.elapsed() < Duration::from_millis(2) {
                thread::yield_now();
            } else {
                thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }

    /// Aborts the reads still posted on `conn`: moves its QP to the error state and polls until
    /// each of the `outstanding` work requests has completed (flushed, or finished just before),
    /// or [`FLUSH_TIMEOUT`] passes. The caller drops the connection afterwards either way
    /// (destroying the QP also stops the device).
    fn flush(
        conn: &Conn,
        peer: &Endpoint,
        mut outstanding: usize,
        wcs: &mut [ffi::ibv_wc],
    ) -> Result<(), TransportError> {
        let mut attr = zeroed_qp_attr();
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        conn.qp.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE).map_err(|e| TransportError::Io {
            peer: peer.to_string(),
            op: "abort rdma reads",
            kind: io::ErrorKind::Other,
            detail: e.to_string(),
        })?;
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        while outstanding > 0 && Instant::now() < deadline {
            // SAFETY: a live CQ and an array of at least POLL_BATCH entries.
            let got = unsafe { ffi::ibv_poll_cq(conn.qp.cq.raw, POLL_BATCH as c_int, wcs.as_mut_ptr()) };
            if got < 0 {
                break;
            }
            outstanding = outstanding.saturating_sub(got as usize);
            if got == 0 {
                thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }

    fn read_inner(
        &mut self,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
        into: &mut [u8],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        let dev = self.device(peer)?;
        if self.conns.get(peer).is_some_and(Conn::closed) {
            self.conns.remove(peer);
        }
        if !self.conns.contains_key(peer) {
            let conn = self.connect(&dev, peer)?;
            self.conns.insert(peer.clone(), conn);
        }
        let Some(conn) = self.conns.get_mut(peer) else {
            return Err(TransportError::Protocol { peer: peer.to_string(), detail: "no connection".into() });
        };
        let total = into.len();
        if total == 0 {
            // Only zero-length ranges: checked against the table (and the server), nothing to
            // post.
            return match Self::plan(conn, peer, &dev, ranges, 0) {
                Ok(_) => Ok(()),
                Err(e) => {
                    if !matches!(e, TransportError::Remote { .. }) {
                        self.conns.remove(peer);
                    }
                    Err(e)
                }
            };
        }
        let direct = total >= self.direct_threshold;
        // Declared before the reads are posted: on error the connection (QP) is dropped before
        // this MR is.
        let direct_mr;
        let (local, lkey) = if direct {
            let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
            // SAFETY: `into` is borrowed mutably for this whole call and the MR is dropped
            // before it returns; the device writes it only through reads posted here, which
            // have all completed, or whose QP has been destroyed, by then.
            direct_mr = unsafe { Mr::register(&dev, into.as_mut_ptr(), total, access) }
                .map_err(|e| setup_error(peer, &e))?;
            (into.as_mut_ptr() as u64, direct_mr.lkey())
        } else {
            let big_enough = match &self.bounce {
                Some(b) => b.buf.len() >= total,
                None => false,
            };
            if !big_enough {
                self.bounce = None;
                let size = total.next_power_of_two().min(self.direct_threshold).max(total).max(4096);
                let mut buf = vec![0u8; size];
                let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
                // SAFETY: the buffer is owned next to its MR in `Bounce`, which drops the MR
                // first; Rust touches it only between reads, when no work request is posted
                // (after completion, or after the QP is destroyed on error).
                let mr = unsafe { Mr::register(&dev, buf.as_mut_ptr(), size, access) }
                    .map_err(|e| setup_error(peer, &e))?;
                self.bounce = Some(Bounce { mr, buf });
            }
            let Some(b) = self.bounce.as_mut() else {
                return Err(TransportError::Protocol { peer: peer.to_string(), detail: "no bounce".into() });
            };
            (b.buf.as_mut_ptr() as u64, b.mr.lkey())
        };
        let segs = match Self::plan(conn, peer, &dev, ranges, local) {
            Ok(segs) => segs,
            Err(e) => {
                // A refusal from the server's answer leaves the connection in step; a control
                // I/O failure does not.
                if !matches!(e, TransportError::Remote { .. }) {
                    self.conns.remove(peer);
                }
                return Err(e);
            }
        };
        if let Err(e) = Self::post_and_poll(conn, peer, &segs, lkey, self.io_timeout, cancelled) {
            // After a failed completion the QP is in the error state; after a timeout reads
            // may still be running. Destroying the QP stops the device before the buffers are
            // released (the direct MR below, or the bounce buffer later); the next read
            // reconnects and gets fresh keys.
            self.conns.remove(peer);
            return Err(e);
        }
        if !direct {
            if let Some(b) = &self.bounce {
                into.copy_from_slice(&b.buf[..total]);
            }
        }
        Ok(())
    }
}

/// Posts `segs` as one chain of signalled RDMA READs; work request ids count from `first_id`.
fn post_reads(qp: &Qp, segs: &[Segment], lkey: u32, first_id: u64) -> Result<(), VerbsError> {
    let mut sges: Vec<ffi::ibv_sge> =
        segs.iter().map(|s| ffi::ibv_sge { addr: s.local, length: s.len, lkey }).collect();
    let sge_base = sges.as_mut_ptr();
    let mut wrs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(segs.len());
    for (i, s) in segs.iter().enumerate() {
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions of those); zero is
        // valid and every field this opcode reads is set below.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = first_id + i as u64;
        // SAFETY: i < sges.len(); `sges` is not touched again while the pointer is in use.
        wr.sg_list = unsafe { sge_base.add(i) };
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = ffi::rdma_t { remote_addr: s.remote, rkey: s.rkey };
        wrs.push(wr);
    }
    // Chain them through raw pointers only; `wrs` does not grow any more.
    let base = wrs.as_mut_ptr();
    for i in 1..wrs.len() {
        // SAFETY: i < wrs.len(), so both elements are inside the vector.
        unsafe { (*base.add(i - 1)).next = base.add(i) };
    }
    let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: a live QP in RTS and a well-formed chain whose SGEs point at memory registered
    // under `lkey`; the provider copies the requests before returning.
    let ret = unsafe { ffi::ibv_post_send(qp.raw, base, &mut bad) };
    if ret != 0 {
        return Err(ret_call("ibv_post_send", ret));
    }
    Ok(())
}

fn wc_status_text(status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
    let p = unsafe { ffi::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, static and NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Maps a failed work completion to the transport's error.
fn completion_error(peer: &Endpoint, wc: &ffi::ibv_wc, seg: Option<&Segment>) -> TransportError {
    use ffi::ibv_wc_status as S;
    let peer_s = peer.to_string();
    let what = match seg {
        Some(s) => format!("RDMA READ of {} bytes at {:#x} (rkey {:#x})", s.len, s.remote, s.rkey),
        None => "RDMA READ".to_string(),
    };
    let detail = format!("{what}: {} (vendor error {:#x})", wc_status_text(wc.status), wc.vendor_err);
    match wc.status {
        // The rkey is no longer valid (a fence: rekey or deregister) or does not cover the
        // range: the key came from this connection's table, so the region was registered.
        S::IBV_WC_REM_ACCESS_ERR => {
            TransportError::Remote { peer: peer_s, code: RemoteCode::Revoked, message: detail }
        }
        S::IBV_WC_RETRY_EXC_ERR | S::IBV_WC_RNR_RETRY_EXC_ERR | S::IBV_WC_RESP_TIMEOUT_ERR => {
            TransportError::Timeout { peer: peer_s, op: "rdma read (transport retries exceeded)" }
        }
        S::IBV_WC_WR_FLUSH_ERR => TransportError::Io {
            peer: peer_s,
            op: "rdma read",
            kind: io::ErrorKind::ConnectionAborted,
            detail,
        },
        S::IBV_WC_REM_INV_REQ_ERR | S::IBV_WC_REM_OP_ERR | S::IBV_WC_BAD_RESP_ERR => {
            TransportError::Protocol { peer: peer_s, detail }
        }
        _ => TransportError::Io { peer: peer_s, op: "rdma read", kind: io::ErrorKind::Other, detail },
    }
}

/// The error for a failure to set up the device, a QP or an MR while talking to `peer`.
fn setup_error(peer: &Endpoint, e: &VerbsError) -> TransportError {
    let kind = match e {
        VerbsError::NoDevice { .. } | VerbsError::NoSuchDevice { .. } => io::ErrorKind::Unsupported,
        VerbsError::PortNotActive { .. } | VerbsError::NoGid { .. } => io::ErrorKind::NotConnected,
        _ => io::ErrorKind::Other,
    };
    TransportError::Connect { peer: peer.to_string(), kind, detail: e.to_string() }
}

fn read_message(stream: &TcpStream, peer: &Endpoint) -> Result<String, TransportError> {
    let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
    let mut len = [0u8; 4];
    (&*stream).read_exact(&mut len).map_err(io("read message"))?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE_BYTES {
        let detail = format!("message of {len} bytes; the limit is {MAX_MESSAGE_BYTES}");
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    let mut message = vec![0u8; len as usize];
    (&*stream).read_exact(&mut message).map_err(io("read message"))?;
    String::from_utf8(message).map_err(|e| TransportError::Protocol {
        peer: peer.to_string(),
        detail: format!("message is not UTF-8: {e}"),
    })
}

fn read_refusal(stream: &TcpStream, peer: &Endpoint, status: u8) -> TransportError {
    match read_message(stream, peer) {
        Ok(message) => TransportError::Remote { peer: peer.to_string(), code: remote_code(status), message },
        Err(e) => e,
    }
}

fn read_table(stream: &TcpStream, peer: &Endpoint) -> Result<Vec<TableEntry>, TransportError> {
    let io = |op| move |e: io::Error| TransportError::io(peer, op, &e);
    let mut count = [0u8; 4];
    (&*stream).read_exact(&mut count).map_err(io("read region table"))?;
    let count = u32::from_be_bytes(count);
    if count > MAX_TABLE_ENTRIES {
        let detail = format!("region table of {count} entries; the limit is {MAX_TABLE_ENTRIES}");
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    let mut body = vec![0u8; count as usize * ENTRY_BYTES];
    (&*stream).read_exact(&mut body).map_err(io("read region table"))?;
    let mut table: Vec<TableEntry> = body
        .chunks_exact(ENTRY_BYTES)
        .map(|c| {
            let u64_at = |i: usize| u64::from_be_bytes(c[i..i + 8].try_into().unwrap_or([0; 8]));
            TableEntry {
                base: u64_at(0),
                len: u64_at(8),
                va: u64_at(16),
                rkey: u32::from_be_bytes(c[24..28].try_into().unwrap_or([0; 4])),
            }
        })
        .collect();
    table.sort_by_key(|e| e.base);
    let overlapping = table.windows(2).any(|w| w[0].base.saturating_add(w[0].len) > w[1].base);
    if overlapping || table.iter().any(|e| e.base.checked_add(e.len).is_none()) {
        let detail = "region table has overlapping or overflowing entries".to_string();
        return Err(TransportError::Protocol { peer: peer.to_string(), detail });
    }
    Ok(table)
}

/// Checks the ranges against `into` and the limits, as the TCP data plane does.
impl Transport for VerbsTransport {
    fn read(
        &mut self,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
        into: &mut [u8],
    ) -> Result<(), TransportError> {
        self.read_cancellable(peer, ranges, into, &|| false)
    }

    fn read_cancellable(
        &mut self,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
        into: &mut [u8],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<(), TransportError> {
        check_total(ranges, into.len())?;
        if ranges.is_empty() {
            return Ok(());
        }
        if cancelled() {
            return Err(TransportError::Aborted { peer: peer.to_string() });
        }
        self.read_inner(peer, ranges, into, cancelled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// Whether the device-backed tests can run here. Without a device they are skipped with a
    /// reason on stderr (written past the test harness's capture), unless `PDKV_RDMA_REQUIRED=1`
    /// (the rdma-vm guest), where a missing device fails the test.
    fn device_present(test: &str) -> bool {
        match Device::open() {
            Ok(_) => true,
            Err(e) => {
                let required = std::env::var("PDKV_RDMA_REQUIRED").is_ok_and(|v| v == "1");
                assert!(!required, "{test}: PDKV_RDMA_REQUIRED=1 but {e}");
                let _ = writeln!(io::stderr(), "skipping {test}: {e}");
                false
            }
        }
    }

    /// The byte a test region holds at `addr` (251 is prime, so runs do not line up with 256).
    fn pattern(addr: u64) -> u8 {
        (addr % 251) as u8 ^ (addr >> 16) as u8
    }

    fn fill(regions: &mut Regions, base: u64, len: u64) {
        let data: Vec<u8> = (base..base + len).map(pattern).collect();
        regions.write(base, &data).expect("fill");
    }

    const A: (u64, u64) = (0x1_0000, 64 * 1024);
    const B: (u64, u64) = (0x100_0000, 3 << 20);
    const C: (u64, u64) = (0x2000_0000, 4096);

    fn setup() -> (VerbsServer, Arc<RwLock<Regions>>, Endpoint) {
        let mut regions = Regions::new();
        for (base, len) in [A, B, C] {
            regions.register(base, len).expect("register");
            fill(&mut regions, base, len);
        }
        let regions = Arc::new(RwLock::new(regions));
        let server = VerbsServer::bind((Ipv4Addr::LOCALHOST, 0).into(), Arc::clone(&regions)).expect("bind");
        let peer = Endpoint { host: "127.0.0.1".into(), port: server.local_addr().port() };
        (server, regions, peer)
    }

    fn read(
        t: &mut VerbsTransport,
        peer: &Endpoint,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<u8>, TransportError> {
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let mut buf = vec![0u8; total as usize];
        t.read(peer, ranges, &mut buf).map(|()| buf)
    }

    fn expect(ranges: &[(u64, u64)]) -> Vec<u8> {
        ranges.iter().flat_map(|&(a, l)| (a..a + l).map(pattern)).collect()
    }

    fn read_ok(t: &mut VerbsTransport, peer: &Endpoint, ranges: &[(u64, u64)]) {
        let got = read(t, peer, ranges).expect("read");
        assert!(got == expect(ranges), "bytes differ for {ranges:x?}");
    }

    /// The drain rule's abort: a cancelled read is refused before it starts, and one cancelled
    /// in flight moves the QP to the error state, drains its flushed completions and fails
    /// `Aborted`; the next read gets a fresh queue pair and the right bytes.
    #[test]
    fn verbs_cancelled_read_stops_in_flight_and_the_next_read_reconnects() {
        if !device_present("verbs_cancelled_read_stops_in_flight_and_the_next_read_reconnects") {
            return;
        }
        let (server, _regions, peer) = setup();
        let mut t = VerbsTransport::new();
        let mut buf = vec![0u8; 16];
        let before = t.read_cancellable(&peer, &[(A.0, 16)], &mut buf, &|| true);
        assert_eq!(before, Err(TransportError::Aborted { peer: peer.to_string() }));
        // Many small ranges (one work request each, more than the send queue holds), cancelled
        // at the first check inside the poll loop (after 64 turns of it).
        let many: Vec<(u64, u64)> = (0..4000u64).map(|i| (B.0 + (i * 1499) % (B.1 - 64), 64)).collect();
        let mut aborted = 0;
        for _ in 0..5 {
            let calls = std::cell::Cell::new(0u32);
            let cancelled = || {
                calls.set(calls.get() + 1);
                calls.get() > 1
            };
            let mut buf = vec![0u8; many.len() * 64];
            match t.read_cancellable(&peer, &many, &mut buf, &cancelled) {
                Err(TransportError::Aborted { .. }) => aborted += 1,
                Ok(()) => {}
                Err(other) => panic!("a cancelled read failed otherwise: {other}"),
            }
            read_ok(&mut t, &peer, &[(A.0, 4096), (C.0, 64)]);
        }
        assert!(aborted > 0, "no read was still in flight at its first poll check in 5 tries");
        server.shutdown().expect("clean shutdown");
    }

    #[test]
    fn verbs_reads_patterned_bytes_across_regions_and_ranges() {
        if !device_present("verbs_reads_patterned_bytes_across_regions_and_ranges") {
            return;
        }
        let (server, regions, peer) = setup();
        assert_eq!(server.registered(), 3);
        let mut t = VerbsTransport::new();
        // Ranges across all three regions, in one read, through the bounce buffer.
        read_ok(&mut t, &peer, &[(A.0 + 5, 100), (B.0 + 1000, 30_000), (C.0, C.1), (A.0 + 60_000, 5536)]);
        // A direct read (past the threshold) of a whole region and a piece of another.
        read_ok(&mut t, &peer, &[(B.0, B.1), (A.0, 10)]);
        // More ranges than the send queue holds at once.
        let many: Vec<(u64, u64)> = (0..300).map(|i| (B.0 + i * 4099, 17 + i % 5)).collect();
        read_ok(&mut t, &peer, &many);
        // Zero-length ranges inside a region are fine, even in a read of no bytes; at a
        // region's end they are not (as in the registry).
        read_ok(&mut t, &peer, &[(A.0 + 7, 0), (C.0 + 1, 3)]);
        read_ok(&mut t, &peer, &[(A.0 + 7, 0), (C.0, 0)]);
        let refused = read(&mut t, &peer, &[(C.0 + C.1, 0)]);
        assert!(
            matches!(refused, Err(TransportError::Remote { code: RemoteCode::Unregistered, .. })),
            "{refused:?}"
        );
        assert_eq!(t.connections(), 1);
        // A region registered after the connection was made is found through a refresh.
        let d = (0x3000_0000, 8192);
        {
            let mut r = regions.write().expect("lock");
            r.register(d.0, d.1).expect("register");
            fill(&mut r, d.0, d.1);
        }
        read_ok(&mut t, &peer, &[(d.0 + 100, 5000), (A.0, 4)]);
        assert_eq!(t.connections(), 1);
        assert_eq!(server.registered(), 4);
        // Bytes written after registration are what a reader sees (no stale pinned page).
        regions.write().expect("lock").write(A.0, &[9, 8, 7]).expect("write");
        assert_eq!(read(&mut t, &peer, &[(A.0, 3)]).expect("read"), vec![9, 8, 7]);
        // A second transport gets its own queue pair.
        let mut t2 = VerbsTransport::new();
        read_ok(&mut t2, &peer, &[(C.0 + 4000, 96)]);
        server.shutdown().expect("clean shutdown");
        // With the server gone the kept connection is noticed as closed and the reconnect
        // fails cleanly.
        let err = read(&mut t, &peer, &[(A.0, 4)]).expect_err("server is gone");
        assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
        assert_eq!(t.connections(), 0);
    }

    #[test]
    fn verbs_rekey_revokes_reads_until_reconnect() {
        if !device_present("verbs_rekey_revokes_reads_until_reconnect") {
            return;
        }
        let (server, _regions, peer) = setup();
        let mut t = VerbsTransport::new();
        read_ok(&mut t, &peer, &[(A.0, 128), (B.0, 64)]);
        let old: Vec<u32> =
            t.conns.get(&peer).map(|c| c.table.iter().map(|e| e.rkey).collect()).unwrap_or_default();
        let new_key = server.rekey(A.0).expect("rekey");
        assert!(!old.contains(&new_key), "rekey gave an old key {new_key:#x} ({old:x?})");
        // The connection still holds A's old rkey: the device refuses the read.
        match read(&mut t, &peer, &[(B.0, 8), (A.0 + 64, 64)]) {
            Err(TransportError::Remote { code: RemoteCode::Revoked, message, .. }) => {
                assert!(message.contains("remote access error"), "{message}");
            }
            other => panic!("expected a remote access error, got {other:?}"),
        }
        assert_eq!(t.connections(), 0, "the failed connection is dropped");
        // The next read reconnects and gets the new key.
        read_ok(&mut t, &peer, &[(A.0 + 64, 64), (B.0, 8)]);
        assert_eq!(t.connections(), 1);
        assert_eq!(server.rekey(0x1234), Err(VerbsError::UnknownRegion { base_addr: 0x1234 }));
        drop(server);
    }

    #[test]
    fn verbs_refusals_before_posting() {
        if !device_present("verbs_refusals_before_posting") {
            return;
        }
        let (server, regions, peer) = setup();
        let mut t = VerbsTransport::new();
        let code = |r: Result<Vec<u8>, TransportError>| match r {
            Err(TransportError::Remote { code, .. }) => code,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(code(read(&mut t, &peer, &[(0xdead_0000, 8)])), RemoteCode::Unregistered);
        assert_eq!(code(read(&mut t, &peer, &[(A.0, 8), (0xdead_0000, 8)])), RemoteCode::Unregistered);
        assert_eq!(code(read(&mut t, &peer, &[(A.0 + A.1 - 4, 8)])), RemoteCode::OutOfRange);
        // Refusals decided before posting keep the connection.
        assert_eq!(t.connections(), 1);
        read_ok(&mut t, &peer, &[(A.0, 16)]);
        // A region deregistered through the server: its MR goes first, then reads of its range
        // are refused as revoked (the kept connection's stale key fails on the device; a
        // fresh connection is refused by the server).
        let c_id = regions.read().expect("lock").live_regions().find(|r| r.base_addr == C.0).map(|r| r.id);
        let region = server.deregister(c_id.expect("C is live")).expect("deregister");
        assert_eq!(region.bytes.len() as u64, C.1);
        assert_eq!(server.registered(), 2);
        assert_eq!(code(read(&mut t, &peer, &[(C.0, 8)])), RemoteCode::Revoked);
        assert_eq!(code(read(&mut t, &peer, &[(C.0, 8)])), RemoteCode::Revoked);
        read_ok(&mut t, &peer, &[(B.0 + 3, 5)]);
        // Local refusals.
        let mut small = [0u8; 4];
        let err = t.read(&peer, &[(A.0, 8)], &mut small);
        assert!(matches!(err, Err(TransportError::InvalidRequest { .. })), "{err:?}");
    }

    /// Checks both buffer modes on a large read (48 ranges, 3 MiB) and on small ones (one 4 KiB
    /// range), and prints the time per read of each: the numbers behind
    /// [`DEFAULT_DIRECT_THRESHOLD`].
    #[test]
    fn verbs_reads_in_both_buffer_modes() {
        if !device_present("verbs_reads_in_both_buffer_modes") {
            return;
        }
        let (server, _regions, peer) = setup();
        let large: Vec<(u64, u64)> = (0..48).map(|i| (B.0 + i * 65_536, 65_536)).collect();
        let small = vec![(B.0 + 12_345, 4096)];
        for (ranges, rounds) in [(&large, 5u32), (&small, 200)] {
            let want = expect(ranges);
            let mut buf = vec![0u8; want.len()];
            for (name, threshold) in [("bounce", usize::MAX), ("direct", 0)] {
                let mut t = VerbsTransport::new();
                t.set_direct_threshold(threshold);
                t.read(&peer, ranges, &mut buf).expect("warm-up read");
                buf.fill(0);
                let started = Instant::now();
                for _ in 0..rounds {
                    t.read(&peer, ranges, &mut buf).expect("read");
                }
                let per = started.elapsed() / rounds;
                assert!(buf == want, "{name}: bytes differ");
                let mbps = want.len() as f64 / per.as_secs_f64() / 1e6;
                let _ = writeln!(
                    io::stderr(),
                    "verbs {name}: {} bytes in {} ranges: {per:?} per read, {mbps:.0} MB/s",
                    want.len(),
                    ranges.len()
                );
            }
        }
        drop(server);
    }

    /// A fake server whose QP stays in INIT, so the device drops every request to it: a read
    /// times out (the CQ wait), or, with a longer wait, the transport's retries run out.
    #[test]
    fn verbs_unanswered_reads_time_out() {
        if !device_present("verbs_unanswered_reads_time_out") {
            return;
        }
        let dev = Device::open().expect("device");
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let peer = Endpoint { host: "127.0.0.1".into(), port: listener.local_addr().expect("addr").port() };
        let fake = thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = listener.accept().expect("accept");
                let mut hello = [0u8; 6 + QP_INFO_BYTES];
                s.read_exact(&mut hello).expect("hello");
                let cq = Cq::create(&dev, 4).expect("cq");
                let qp = Qp::create(&cq, 1, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0).expect("qp");
                let mut out = vec![STATUS_OK];
                qp.info().encode(&mut out);
                encode_table(&[TableEntry { base: 0x1000, len: 4096, va: 0x1000, rkey: 0x1234 }], &mut out);
                s.write_all(&out).expect("answer");
                // Hold the QP (never connected) until the client closes.
                let _ = s.read(&mut [0u8; 1]);
                drop(qp);
            }
        });
        let mut t = VerbsTransport::with_timeouts(Duration::from_secs(5), Duration::from_millis(500));
        let err = read(&mut t, &peer, &[(0x1000, 64)]);
        let want = TransportError::Timeout { peer: peer.to_string(), op: "rdma read completion" };
        assert_eq!(err, Err(want));
        assert_eq!(t.connections(), 0);
        let mut t = VerbsTransport::with_timeouts(Duration::from_secs(5), Duration::from_secs(60));
        let started = Instant::now();
        let err = read(&mut t, &peer, &[(0x1000, 64)]);
        let want =
            TransportError::Timeout { peer: peer.to_string(), op: "rdma read (transport retries exceeded)" };
        assert_eq!(err, Err(want));
        assert!(started.elapsed() < Duration::from_secs(30), "retries took {:?}", started.elapsed());
        drop(t);
        fake.join().expect("fake server");
    }

    #[test]
    fn verbs_without_device_gives_typed_errors() {
        let Err(e) = Device::open() else {
            let _ = writeln!(
                io::stderr(),
                "skipping verbs_without_device_gives_typed_errors: a device is present"
            );
            return;
        };
        let VerbsError::NoDevice { detail } = &e else { panic!("expected NoDevice, got {e:?}") };
        assert!(detail.starts_with("ibv_get_device_list returned 0 devices"), "{detail}");
        let text = e.to_string();
        assert!(text.starts_with("no RDMA device: ibv_get_device_list returned 0 devices"), "{text}");
        assert!(text.contains("load rdma_rxe and run `rdma link add"), "{text}");
        let bind = VerbsServer::bind((Ipv4Addr::LOCALHOST, 0).into(), Arc::default());
        assert_eq!(bind.map(|_| ()), Err(e.clone()));
        let mut t = VerbsTransport::new();
        let peer = Endpoint { host: "127.0.0.1".into(), port: 9 };
        let mut buf = [0u8; 4];
        let want = TransportError::Connect {
            peer: "127.0.0.1:9".into(),
            kind: io::ErrorKind::Unsupported,
            detail: text,
        };
        assert_eq!(t.read(&peer, &[(0x1000, 4)], &mut buf), Err(want));
        assert_eq!(t.connections(), 0);
        // An empty read needs no device.
        assert_eq!(t.read(&peer, &[], &mut []), Ok(()));
    }

    #[test]
    fn verbs_wire_encodings_round_trip() {
        let info = QpInfo {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: [3; 16],
            mtu: 5,
            rd_atom: 16,
            link_layer: 2,
        };
        let mut out = Vec::new();
        info.encode(&mut out);
        let bytes: [u8; QP_INFO_BYTES] = out.as_slice().try_into().expect("size");
        assert_eq!(QpInfo::decode(&bytes), info);
        let mut table = Vec::new();
        encode_table(&[TableEntry { base: 1, len: 2, va: 3, rkey: 4 }], &mut table);
        assert_eq!(table.len(), 4 + ENTRY_BYTES);
        fn assert_send<T: Send>() {}
        assert_send::<VerbsTransport>();
        assert_send::<VerbsServer>();
    }
}
