//! The RDMA device and the verbs objects made from it, each owned by a wrapper whose `Drop`
//! frees it in the order verbs requires: device context and protection domain, completion
//! queue, memory region, reliable-connected queue pair. Nearly all of the verbs `unsafe` is here.

use std::ffi::{c_int, c_void, CStr};
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdma_sys as ffi;

use super::control::QpInfo;
use super::error::VerbsError;

/// Largest RDMA READ a reader posts; longer ranges are split.
pub const MAX_READ_BYTES: u64 = 1 << 30;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Local ACK timeout exponent: 4.096 µs × 2^17 ≈ 0.5 s per try, generous for software RoCE
/// in an emulated guest; with [`RETRY_COUNT`] retries a dead peer is noticed in about 4 s.
const ACK_TIMEOUT: u8 = 17;
/// Transport and RNR retries. Not 7: rxe (like the spec for RNR) takes 7 as "retry forever",
/// and a read of a dead peer would then never complete.
const RETRY_COUNT: u8 = 6;
/// Most RDMA READs one side serves or issues at once, whatever the device allows.
const MAX_RD_ATOMIC: u8 = 16;

/// The last OS error's text, for a call that reported failure through `errno`.
fn errno_call(call: &'static str) -> VerbsError {
    VerbsError::Call { call, detail: io::Error::last_os_error().to_string() }
}

/// The error for a call that returned an errno value.
pub(super) fn ret_call(call: &'static str, ret: c_int) -> VerbsError {
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
pub(super) struct Device {
    pub(super) ctx: *mut ffi::ibv_context,
    pub(super) pd: *mut ffi::ibv_pd,
    pub(super) name: String,
    pub(super) port: u8,
    pub(super) lid: u16,
    pub(super) link_layer: u8,
    pub(super) active_mtu: u32,
    pub(super) max_msg_sz: u64,
    pub(super) gid: [u8; 16],
    pub(super) gid_index: u8,
    pub(super) max_qp_wr: u32,
    pub(super) max_rd_atom: u8,
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
    /// Opens the device named `want`, else the one `PDKV_RDMA_DEVICE` names, else the first.
    pub(super) fn open(want: Option<&str>) -> Result<Arc<Device>, VerbsError> {
        let list = DeviceList::get()?;
        let names: Vec<String> = (0..list.1).map(|i| list.name(i)).collect();
        let want = match want {
            Some(name) => Some(name.to_string()),
            None => env_setting("PDKV_RDMA_DEVICE")?,
        };
        let index = match want {
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
pub(super) struct Cq {
    pub(super) raw: *mut ffi::ibv_cq,
    pub(super) dev: Arc<Device>,
}

// SAFETY: see Device: verbs on a CQ may be called from any thread.
unsafe impl Send for Cq {}
// SAFETY: see Device.
unsafe impl Sync for Cq {}

impl Cq {
    pub(super) fn create(dev: &Arc<Device>, depth: u32) -> Result<Arc<Cq>, VerbsError> {
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
pub(super) struct Mr {
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
    pub(super) unsafe fn register(
        dev: &Arc<Device>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Mr, VerbsError> {
        // SAFETY: the caller's contract; the PD is alive (held by `dev`).
        let raw = unsafe { ffi::ibv_reg_mr(dev.pd, addr.cast::<c_void>(), len, access as c_int) };
        if raw.is_null() {
            return Err(errno_call("ibv_reg_mr"));
        }
        Ok(Mr { raw, _dev: Arc::clone(dev) })
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: a registered MR, alive while self is.
        unsafe { (*self.raw).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
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

/// A fresh 24-bit packet sequence number (any value works; distinct ones ease debugging).
fn next_psn() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    (nanos ^ COUNTER.fetch_add(0x9e37, Ordering::Relaxed).wrapping_mul(2_654_435_761)) & 0xff_ffff
}

/// A reliable-connected queue pair.
pub(super) struct Qp {
    pub(super) raw: *mut ffi::ibv_qp,
    pub(super) psn: u32,
    pub(super) cq: Arc<Cq>,
}

// SAFETY: see Device: verbs on a QP may be called from any thread; each Qp is used by one
// thread at a time (its owner).
unsafe impl Send for Qp {}

impl Qp {
    /// Creates an RC QP on `cq` and moves it to INIT with `access` for remote peers.
    pub(super) fn create(cq: &Arc<Cq>, send_depth: u32, access: u32) -> Result<Qp, VerbsError> {
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

    pub(super) fn dev(&self) -> &Device {
        &self.cq.dev
    }

    pub(super) fn info(&self) -> QpInfo {
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

    pub(super) fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), VerbsError> {
        // SAFETY: a live QP and a filled attribute block for the fields in `mask`.
        let ret = unsafe { ffi::ibv_modify_qp(self.raw, attr, mask.0 as c_int) };
        if ret != 0 {
            return Err(ret_call("ibv_modify_qp", ret));
        }
        Ok(())
    }

    /// Moves an INIT QP to RTR and then RTS, connected to `remote`.
    pub(super) fn connect(&self, remote: &QpInfo) -> Result<(), VerbsError> {
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

pub(super) fn zeroed_qp_attr() -> ffi::ibv_qp_attr {
    // SAFETY: ibv_qp_attr is plain old data (integers, byte arrays, a union of byte arrays);
    // all-zero is valid.
    unsafe { std::mem::zeroed() }
}
