//! A producer rank's RDMA data-plane server, [`VerbsServer`]: registers its regions as memory
//! regions and connects one queue pair per client over a TCP control connection.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use rdma_sys as ffi;

use super::control::{
    encode_table, QpInfo, TableEntry, CONTROL_MAGIC, CONTROL_VERSION, KIND_HELLO, KIND_REFRESH,
    MAX_TABLE_ENTRIES, QP_INFO_BYTES,
};
use super::device::{Cq, Device, Mr, Qp};
use super::error::VerbsError;
#[cfg(doc)]
use super::VerbsTransport;
use crate::memory::{HostRegion, MemoryError, RegionId, Regions};
use crate::tcp::{memory_status, push_message, STATUS_INTERNAL, STATUS_MALFORMED, STATUS_OK};
#[cfg(doc)]
use crate::transport::RemoteCode;

/// Most connections (queue pairs) a server serves at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a server waits for a started request, or for a client to take an answer.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(30);

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
    accept: crate::tcp::server::AcceptThread,
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
        VerbsServer::bind_on(addr, regions, None)
    }

    /// [`VerbsServer::bind`] on the device named `device` (`None`: `PDKV_RDMA_DEVICE`, else the
    /// first).
    pub fn bind_on(
        addr: SocketAddr,
        regions: Arc<RwLock<Regions>>,
        device: Option<&str>,
    ) -> Result<VerbsServer, VerbsError> {
        let dev = Device::open(device)?;
        let cq = Cq::create(&dev, 16)?;
        let listener = TcpListener::bind(addr)
            .map_err(|e| VerbsError::Server(crate::tcp::ServerError::bind(addr, &e)))?;
        let shared = Arc::new(ServerShared { regions, mrs: Mutex::new(BTreeMap::new()), cq, dev });
        // Register what is live now, so the first client does not pay for it.
        {
            let regions = shared.regions.read().unwrap_or_else(PoisonError::into_inner);
            shared.reconcile(&regions)?;
        }
        let accept = crate::tcp::server::AcceptThread::spawn(
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
