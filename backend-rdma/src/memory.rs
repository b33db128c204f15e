//! Registered memory regions of host memory: what a producer rank lets its peers read, and how a
//! fence takes that permission back.
//!
//! A region is a buffer that a peer addresses by a 64-bit address, as RDMA addresses a memory
//! region by its virtual address. Host regions pick their `base_addr` freely (the address space
//! is the registry's, not the process's), so no `unsafe` is needed. HIP device memory lives in
//! `crate::hip` behind the `hip` feature; [`Backing`] and [`select_backing`] are here, compiled
//! in every build, so a caller picks host or device memory without a `cfg` of its own.
//!
//! Rules the registry keeps:
//!
//! - Live regions never overlap and never wrap past `u64::MAX`; a zero-length region is refused.
//! - A read or write must lie inside one live region; straddling two adjacent regions is refused,
//!   as an RDMA READ against one memory key would be.
//! - [`Regions::deregister`] revokes a region: later accesses to its old range get
//!   [`MemoryError::Revoked`] (not [`MemoryError::Unregistered`]), so a reader that lost a race
//!   with a fence is told so. Registering a new region forgets every revocation whose range it
//!   overlaps.

use std::collections::BTreeMap;
use std::fmt;

/// Identifier of a registered region, unique for the life of a [`Regions`] registry (ids are
/// never reused, so a stale id cannot name a newer region).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub u32);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region {}", self.0)
    }
}

/// A registered region of host memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRegion {
    /// The region's identifier.
    pub id: RegionId,
    /// The address of its first byte, as peers name it.
    pub base_addr: u64,
    /// Its contents; the length is fixed at registration.
    pub bytes: Vec<u8>,
}

impl HostRegion {
    /// One past the last address of the region (registration guarantees it does not overflow).
    pub fn end_addr(&self) -> u64 {
        self.base_addr + self.bytes.len() as u64
    }
}

/// Why a registration or an access was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryError {
    /// A region of zero bytes was asked for.
    ZeroLength {
        /// The requested base address.
        base_addr: u64,
    },
    /// `base_addr + len` passes `u64::MAX`, or `len` does not fit this machine's memory.
    TooLarge {
        /// The requested base address.
        base_addr: u64,
        /// The requested length.
        len: u64,
    },
    /// The new region would overlap a live one.
    Overlap {
        /// The requested base address.
        base_addr: u64,
        /// The requested length.
        len: u64,
        /// The live region it overlaps.
        existing: RegionId,
    },
    /// Every region id has been used.
    IdsExhausted,
    /// No live or revoked region contains the first byte of the access.
    Unregistered {
        /// First address of the access.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The access starts in a region that has been deregistered.
    Revoked {
        /// First address of the access.
        addr: u64,
        /// Its length.
        len: u64,
        /// The revoked region.
        region: RegionId,
    },
    /// The access starts inside a live region but runs past its end.
    OutOfRange {
        /// First address of the access.
        addr: u64,
        /// Its length.
        len: u64,
        /// The region it starts in.
        region: RegionId,
        /// One past the region's last address.
        region_end: u64,
    },
    /// [`Regions::deregister`] was given an id that is not live.
    UnknownRegion {
        /// The id.
        region: RegionId,
    },
    /// A read that names a transfer touches bytes not granted to it: they were fenced and
    /// granted to another transfer since (the block was freed and reused), or never granted.
    NotGranted {
        /// First address of the access.
        addr: u64,
        /// Its length.
        len: u64,
        /// The region it lies in.
        region: RegionId,
    },
}

impl fmt::Display for MemoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryError::ZeroLength { base_addr } => {
                write!(f, "cannot register a zero-length region at {base_addr:#x}")
            }
            MemoryError::TooLarge { base_addr, len } => {
                write!(f, "region of {len} bytes at {base_addr:#x} is too large")
            }
            MemoryError::Overlap { base_addr, len, existing } => {
                write!(f, "region of {len} bytes at {base_addr:#x} overlaps {existing}")
            }
            MemoryError::IdsExhausted => f.write_str("every region id has been used"),
            MemoryError::Unregistered { addr, len } => {
                write!(f, "no registered region holds {len} bytes at {addr:#x}")
            }
            MemoryError::Revoked { addr, len, region } => {
                write!(f, "{len} bytes at {addr:#x} lie in {region}, which has been revoked")
            }
            MemoryError::OutOfRange { addr, len, region, region_end } => write!(
                f,
                "{len} bytes at {addr:#x} run past the end of {region} (which ends at {region_end:#x})"
            ),
            MemoryError::UnknownRegion { region } => write!(f, "{region} is not registered"),
            MemoryError::NotGranted { addr, len, region } => write!(
                f,
                "{len} bytes at {addr:#x} in {region} do not hold the transfer the read names (freed and reused, or never filled for it)"
            ),
        }
    }
}

impl std::error::Error for MemoryError {}

/// The registry of a rank's regions: live ones by base address, and the ranges of revoked ones.
#[derive(Debug, Default)]
pub struct Regions {
    /// Live regions keyed by base address; non-overlapping, so a range query finds the one
    /// candidate holding an address.
    live: BTreeMap<u64, HostRegion>,
    /// Revoked ranges keyed by base address: (end, id). Kept so that a late reader gets
    /// `Revoked`, which the decode side maps to "the producer fenced this transfer".
    revoked: BTreeMap<u64, (u64, RegionId)>,
    /// The next id to hand out; `None` once `u32::MAX` has been used.
    next_id: Option<u32>,
    /// Fenced ranges inside live regions, disjoint and never adjacent, keyed by start: end. A
    /// fence revokes access to some blocks without touching the rest of the region; refilling
    /// the blocks for a new transfer lifts it ([`Regions::unfence`]).
    fenced: BTreeMap<u64, u64>,
    /// Ranges granted to a transfer (keyed by start: end and the transfer's key), disjoint. A
    /// read that names a transfer is served only from bytes granted to it, so a read that comes
    /// after its blocks were fenced and refilled for another transfer is refused rather than
    /// served the other transfer's KV ([`Regions::grant`], [`Regions::read_granted`]).
    grants: BTreeMap<u64, (u64, u64)>,
}

impl Regions {
    /// An empty registry.
    pub fn new() -> Regions {
        Regions {
            live: BTreeMap::new(),
            revoked: BTreeMap::new(),
            next_id: Some(0),
            fenced: BTreeMap::new(),
            grants: BTreeMap::new(),
        }
    }

    /// Registers `len` zeroed bytes at `base_addr` and returns the new region's id.
    pub fn register(&mut self, base_addr: u64, len: u64) -> Result<RegionId, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroLength { base_addr });
        }
        let too_large = MemoryError::TooLarge { base_addr, len };
        let end = base_addr.checked_add(len).ok_or(too_large.clone())?;
        let size = usize::try_from(len).map_err(|_| too_large)?;
        // The only live region that can overlap [base, end) without starting inside it is the
        // last one starting before `end`.
        if let Some((_, r)) = self.live.range(..end).next_back() {
            if r.end_addr() > base_addr {
                return Err(MemoryError::Overlap { base_addr, len, existing: r.id });
            }
        }
        let raw = self.next_id.ok_or(MemoryError::IdsExhausted)?;
        self.next_id = raw.checked_add(1);
        let id = RegionId(raw);
        // A live region takes the address range back from any revocation there.
        self.revoked.retain(|&b, &mut (e, _)| e <= base_addr || b >= end);
        self.live.insert(base_addr, HostRegion { id, base_addr, bytes: vec![0; size] });
        Ok(id)
    }

    /// Deregisters (revokes) a live region: later accesses to its range fail with
    /// [`MemoryError::Revoked`]. Returns the region, whose bytes the caller may reuse.
    pub fn deregister(&mut self, id: RegionId) -> Result<HostRegion, MemoryError> {
        let base = self
            .live
            .iter()
            .find(|(_, r)| r.id == id)
            .map(|(&b, _)| b)
            .ok_or(MemoryError::UnknownRegion { region: id })?;
        let region = self.live.remove(&base).ok_or(MemoryError::UnknownRegion { region: id })?;
        self.revoked.insert(base, (region.end_addr(), id));
        let (start, end) = (region.base_addr, region.end_addr());
        self.fenced.retain(|&b, &mut e| e <= start || b >= end);
        self.grants.retain(|&b, &mut (e, _)| e <= start || b >= end);
        Ok(region)
    }

    /// The live region with this id, if any.
    pub fn region(&self, id: RegionId) -> Option<&HostRegion> {
        self.live.values().find(|r| r.id == id)
    }

    /// Number of live regions.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no region is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The live regions in order of base address (the RDMA data plane registers each as a
    /// memory region; a live region's buffer never moves, since its length is fixed).
    pub fn live_regions(&self) -> impl Iterator<Item = &HostRegion> {
        self.live.values()
    }

    /// Fences `len` bytes at `addr`, which must lie inside one live region: later accesses that
    /// touch them fail with [`MemoryError::Revoked`] until [`Regions::unfence`] lifts the fence
    /// from them. Fences merge: fencing a whole region and then unfencing one block leaves the
    /// rest fenced.
    pub fn fence(&mut self, addr: u64, len: u64) -> Result<(), MemoryError> {
        self.locate_live(addr, len)?;
        // A fenced range belongs to no transfer any more.
        self.cut_grants(addr, addr + len);
        let (mut start, mut end) = (addr, addr + len);
        // Absorb every fence that overlaps or touches [start, end).
        let touching: Vec<(u64, u64)> =
            self.fenced.range(..=end).rev().take_while(|(_, &e)| e >= start).map(|(&b, &e)| (b, e)).collect();
        for (b, e) in touching {
            self.fenced.remove(&b);
            start = start.min(b);
            end = end.max(e);
        }
        self.fenced.insert(start, end);
        Ok(())
    }

    /// Lifts the fence from `len` bytes at `addr` (they are being refilled); fenced bytes
    /// around them stay fenced.
    pub fn unfence(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        let overlapping: Vec<(u64, u64)> =
            self.fenced.range(..end).rev().take_while(|(_, &e)| e > addr).map(|(&b, &e)| (b, e)).collect();
        for (b, e) in overlapping {
            self.fenced.remove(&b);
            if b < addr {
                self.fenced.insert(b, addr);
            }
            if e > end {
                self.fenced.insert(end, e);
            }
        }
    }

    /// Grants `len` bytes at `addr` to the transfer `key` (they now hold its KV), replacing any
    /// earlier grant of them; a read that names `key` may read them ([`Regions::read_granted`]).
    pub fn grant(&mut self, addr: u64, len: u64, key: u64) {
        let end = addr.saturating_add(len);
        self.cut_grants(addr, end);
        self.grants.insert(addr, (end, key));
    }

    /// Removes every grant of bytes in `[start, end)`, keeping the parts of grants outside it.
    fn cut_grants(&mut self, start: u64, end: u64) {
        let overlapping: Vec<(u64, (u64, u64))> = self
            .grants
            .range(..end)
            .rev()
            .take_while(|(_, &(e, _))| e > start)
            .map(|(&b, &g)| (b, g))
            .collect();
        for (b, (e, key)) in overlapping {
            self.grants.remove(&b);
            if b < start {
                self.grants.insert(b, (start, key));
            }
            if e > end {
                self.grants.insert(end, (e, key));
            }
        }
    }

    /// Whether every byte of `[addr, addr + len)` is granted to `key`.
    fn granted(&self, addr: u64, len: u64, key: u64) -> bool {
        let end = addr.saturating_add(len);
        let mut at = addr;
        // Grants are disjoint: walk them from the one holding `addr`, each must follow on.
        let Some((&first, _)) = self.grants.range(..=addr).next_back() else { return len == 0 };
        for (&b, &(e, k)) in self.grants.range(first..) {
            if at >= end {
                break;
            }
            if b > at || e <= at || k != key {
                return false;
            }
            at = e;
        }
        at >= end
    }

    /// Number of disjoint fenced ranges.
    pub fn fenced_ranges(&self) -> usize {
        self.fenced.len()
    }

    /// The live region holding all of `len` bytes at `addr`, fences ignored.
    fn locate_live(&self, addr: u64, len: u64) -> Result<(u64, usize, usize), MemoryError> {
        self.locate_inner(addr, len, false)
    }

    /// Checks that `len` bytes at `addr` lie inside one live region, unfenced, and returns the
    /// region's base and the offset range inside it.
    fn locate(&self, addr: u64, len: u64) -> Result<(u64, usize, usize), MemoryError> {
        self.locate_inner(addr, len, true)
    }

    fn locate_inner(
        &self,
        addr: u64,
        len: u64,
        check_fences: bool,
    ) -> Result<(u64, usize, usize), MemoryError> {
        if let Some((&base, r)) = self.live.range(..=addr).next_back() {
            let region_end = r.end_addr();
            if addr < region_end {
                let out = MemoryError::OutOfRange { addr, len, region: r.id, region_end };
                let end = addr.checked_add(len).ok_or(out.clone())?;
                if end > region_end {
                    return Err(out);
                }
                // Fences are disjoint, so only the last one starting before `end` can overlap.
                let fenced = self.fenced.range(..end).next_back().is_some_and(|(_, &e)| e > addr);
                if check_fences && fenced {
                    return Err(MemoryError::Revoked { addr, len, region: r.id });
                }
                // Both offsets are at most the region's length, which is a usize.
                let start = (addr - base) as usize;
                return Ok((base, start, start + len as usize));
            }
        }
        if let Some((_, &(end, region))) = self.revoked.range(..=addr).next_back() {
            if addr < end {
                return Err(MemoryError::Revoked { addr, len, region });
            }
        }
        Err(MemoryError::Unregistered { addr, len })
    }

    /// The `len` bytes at `addr` for a read of transfer `key`: they must lie inside one live
    /// region, unfenced, and be granted to `key` ([`MemoryError::NotGranted`] otherwise).
    pub fn read_granted(&self, addr: u64, len: u64, key: u64) -> Result<&[u8], MemoryError> {
        let bytes = self.read(addr, len)?;
        if !self.granted(addr, len, key) {
            let region = self.live.range(..=addr).next_back().map_or(RegionId(0), |(_, r)| r.id);
            return Err(MemoryError::NotGranted { addr, len, region });
        }
        Ok(bytes)
    }

    /// The `len` bytes at `addr`, which must lie inside one live region.
    pub fn read(&self, addr: u64, len: u64) -> Result<&[u8], MemoryError> {
        let (base, start, end) = self.locate(addr, len)?;
        let region = self.live.get(&base).ok_or(MemoryError::Unregistered { addr, len })?;
        Ok(&region.bytes[start..end])
    }

    /// The `len` bytes at `addr` for filling in place (saves a copy when a producer writes a
    /// large block).
    pub fn slice_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8], MemoryError> {
        let (base, start, end) = self.locate(addr, len)?;
        let region = self.live.get_mut(&base).ok_or(MemoryError::Unregistered { addr, len })?;
        Ok(&mut region.bytes[start..end])
    }

    /// Copies `data` to `addr`; the whole range must lie inside one live region.
    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.slice_mut(addr, data.len() as u64)?.copy_from_slice(data);
        Ok(())
    }

    /// Copies `data` to `addr` for the memory's owner, fences ignored: a fence keeps peers'
    /// reads out, not the owner staging its own blocks.
    pub fn write_own(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        let len = data.len() as u64;
        let (base, start, end) = self.locate_live(addr, len)?;
        let region = self.live.get_mut(&base).ok_or(MemoryError::Unregistered { addr, len })?;
        region.bytes[start..end].copy_from_slice(data);
        Ok(())
    }

    /// The `len` bytes at `addr` for the memory's owner, fences ignored.
    pub fn read_own(&self, addr: u64, len: u64) -> Result<&[u8], MemoryError> {
        let (base, start, end) = self.locate_live(addr, len)?;
        let region = self.live.get(&base).ok_or(MemoryError::Unregistered { addr, len })?;
        Ok(&region.bytes[start..end])
    }
}

/// Where a rank keeps the KV it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Host memory ([`Regions`]).
    Host,
    /// Device memory of one HIP device (`crate::hip::DeviceBuffer`, `hip` feature).
    Hip {
        /// The device's ordinal.
        device: u32,
    },
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backing::Host => f.write_str("host memory"),
            Backing::Hip { device } => write!(f, "HIP device {device}"),
        }
    }
}

/// Chooses the backing: with `prefer_device`, HIP device 0 when the `hip` feature is built and a
/// device is present. Falling back to the host comes with a message saying why, for the caller
/// to log (e.g. "no HIP device (hipGetDeviceCount: hipErrorNoDevice); KV stays in host memory");
/// not preferring the device gives the host with no message.
#[cfg(feature = "hip")]
pub fn select_backing(prefer_device: bool) -> (Backing, Option<String>) {
    use crate::hip::{device_count, HipError};
    if !prefer_device {
        return (Backing::Host, None);
    }
    match device_count() {
        Ok(_) => (Backing::Hip { device: 0 }, None),
        Err(e @ HipError::NoDevice { .. }) => (Backing::Host, Some(format!("{e}; KV stays in host memory"))),
        Err(e) => (Backing::Host, Some(format!("HIP is unusable ({e}); KV stays in host memory"))),
    }
}

/// Chooses the backing: this build has no `hip` feature, so always the host; with
/// `prefer_device` a message says why, for the caller to log.
#[cfg(not(feature = "hip"))]
pub fn select_backing(prefer_device: bool) -> (Backing, Option<String>) {
    let why = prefer_device.then(|| "built without the `hip` feature; KV stays in host memory".to_string());
    (Backing::Host, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "hip"))]
    #[test]
    fn select_backing_without_hip_feature_is_host() {
        let why = "built without the `hip` feature; KV stays in host memory".to_string();
        assert_eq!(select_backing(true), (Backing::Host, Some(why)));
        assert_eq!(select_backing(false), (Backing::Host, None));
        assert_eq!(Backing::Host.to_string(), "host memory");
        assert_eq!(Backing::Hip { device: 1 }.to_string(), "HIP device 1");
    }

    /// Two regions: id 0 at [0x1000, 0x1100), id 1 at [0x2000, 0x2010).
    fn two() -> Regions {
        let mut r = Regions::new();
        assert_eq!(r.register(0x1000, 0x100), Ok(RegionId(0)));
        assert_eq!(r.register(0x2000, 0x10), Ok(RegionId(1)));
        r
    }

    #[test]
    fn register_refusals() {
        let cases: &[(u64, u64, MemoryError)] = &[
            (0x5000, 0, MemoryError::ZeroLength { base_addr: 0x5000 }),
            (u64::MAX, 2, MemoryError::TooLarge { base_addr: u64::MAX, len: 2 }),
            (0x1000, 1, MemoryError::Overlap { base_addr: 0x1000, len: 1, existing: RegionId(0) }),
            (0x10ff, 1, MemoryError::Overlap { base_addr: 0x10ff, len: 1, existing: RegionId(0) }),
            (0xf00, 0x101, MemoryError::Overlap { base_addr: 0xf00, len: 0x101, existing: RegionId(0) }),
            (0x0, 0x3000, MemoryError::Overlap { base_addr: 0, len: 0x3000, existing: RegionId(1) }),
            (0x200f, 8, MemoryError::Overlap { base_addr: 0x200f, len: 8, existing: RegionId(1) }),
        ];
        for (base, len, want) in cases {
            let mut r = two();
            assert_eq!(r.register(*base, *len).as_ref(), Err(want), "register({base:#x}, {len})");
            assert_eq!(r.len(), 2);
        }
        // Adjacent regions touch without overlapping.
        let mut r = two();
        assert_eq!(r.register(0x1100, 0x10), Ok(RegionId(2)));
        assert_eq!(r.register(0xff0, 0x10), Ok(RegionId(3)));
        assert_eq!(r.register(u64::MAX - 1, 1), Ok(RegionId(4)));
    }

    #[test]
    fn read_and_write_errors() {
        let mut r = two();
        r.write(0x1010, &[1, 2, 3]).expect("in range");
        assert_eq!(r.read(0x100f, 5), Ok(&[0, 1, 2, 3, 0][..]));
        let out = |addr, len, region, region_end| MemoryError::OutOfRange {
            addr,
            len,
            region: RegionId(region),
            region_end,
        };
        let cases: &[(u64, u64, Result<usize, MemoryError>)] = &[
            (0x1000, 0x100, Ok(0x100)),
            (0x10ff, 1, Ok(1)),
            (0x1050, 0, Ok(0)),
            (0x1000, 0x101, Err(out(0x1000, 0x101, 0, 0x1100))),
            (0x10ff, u64::MAX, Err(out(0x10ff, u64::MAX, 0, 0x1100))),
            // Straddling into the gap and on into the next region is still out of range.
            (0x1080, 0x1000, Err(out(0x1080, 0x1000, 0, 0x1100))),
            (0xfff, 1, Err(MemoryError::Unregistered { addr: 0xfff, len: 1 })),
            (0x1100, 1, Err(MemoryError::Unregistered { addr: 0x1100, len: 1 })),
            (0x2010, 0, Err(MemoryError::Unregistered { addr: 0x2010, len: 0 })),
            (u64::MAX, 1, Err(MemoryError::Unregistered { addr: u64::MAX, len: 1 })),
        ];
        for (addr, len, want) in cases {
            let got = r.read(*addr, *len).map(<[u8]>::len);
            assert_eq!(&got, want, "read({addr:#x}, {len})");
            let data = vec![7; usize::try_from(*len).unwrap_or(16).min(0x1000)];
            if want.is_err() {
                assert!(r.write(*addr, &data).is_err(), "write({addr:#x}, {len})");
            }
        }
    }

    #[test]
    fn deregister_revokes_until_reregistered() {
        let mut r = two();
        r.write(0x2000, b"abc").expect("in range");
        let region = r.deregister(RegionId(1)).expect("live");
        assert_eq!(&region.bytes[..3], b"abc");
        assert_eq!(r.region(RegionId(1)), None);
        let revoked = MemoryError::Revoked { addr: 0x2004, len: 2, region: RegionId(1) };
        assert_eq!(r.read(0x2004, 2), Err(revoked.clone()));
        assert_eq!(r.write(0x2004, b"xy"), Err(revoked));
        assert_eq!(r.read(0x2010, 1), Err(MemoryError::Unregistered { addr: 0x2010, len: 1 }));
        assert_eq!(r.deregister(RegionId(1)), Err(MemoryError::UnknownRegion { region: RegionId(1) }));
        // The other region is untouched.
        assert_eq!(r.read(0x1000, 4), Ok(&[0, 0, 0, 0][..]));
        // A new region over the revoked range is live there, under a new id.
        assert_eq!(r.register(0x2000, 8), Ok(RegionId(2)));
        assert_eq!(r.read(0x2004, 2), Ok(&[0, 0][..]));
        assert_eq!(r.region(RegionId(2)).map(HostRegion::end_addr), Some(0x2008));
    }

    #[test]
    fn a_fence_revokes_only_its_range_until_lifted() {
        let mut regions = Regions::new();
        let id = regions.register(1000, 400).unwrap();
        regions.write(1000, &[7; 400]).unwrap();
        regions.fence(1100, 100).unwrap();
        assert_eq!(regions.read(1050, 50), Ok(&[7u8; 50][..]));
        assert_eq!(regions.read(1200, 10), Ok(&[7u8; 10][..]));
        for (addr, len) in [(1100, 1), (1150, 10), (1050, 60), (1199, 2), (1000, 400)] {
            assert_eq!(regions.read(addr, len), Err(MemoryError::Revoked { addr, len, region: id }));
        }
        let out = MemoryError::OutOfRange { addr: 1350, len: 100, region: id, region_end: 1400 };
        assert_eq!(regions.fence(1350, 100), Err(out));
        regions.unfence(1100, 100);
        assert_eq!(regions.fenced_ranges(), 0);
        assert_eq!(regions.read(1000, 400).map(<[u8]>::len), Ok(400));
    }

    /// A read naming a transfer is served only from bytes granted to it: a block fenced and
    /// refilled for another transfer refuses the first transfer's late read, and grants split
    /// and join around what a fence or a new grant takes.
    #[test]
    fn reads_of_a_transfer_see_only_its_granted_blocks() {
        let mut r = two();
        let (a, b) = (0x1000u64, 0x1000u64 + 16);
        r.fence(0x1000, 64).unwrap();
        r.unfence(a, 32);
        r.grant(a, 16, 7);
        r.grant(b, 16, 7);
        assert!(r.read_granted(a, 32, 7).is_ok(), "two adjacent grants of one transfer");
        assert!(matches!(r.read_granted(a, 32, 8), Err(MemoryError::NotGranted { .. })));
        // The transfer's second block is freed (fenced) and refilled for transfer 9.
        r.fence(b, 16).unwrap();
        assert!(matches!(r.read_granted(b, 16, 7), Err(MemoryError::Revoked { .. })));
        r.unfence(b, 16);
        r.grant(b, 16, 9);
        assert!(matches!(r.read_granted(b, 16, 7), Err(MemoryError::NotGranted { .. })));
        assert!(r.read_granted(b, 16, 9).is_ok());
        assert!(r.read_granted(a, 16, 7).is_ok(), "the first block is still transfer 7's");
        assert!(matches!(r.read_granted(a, 32, 7), Err(MemoryError::NotGranted { .. })));
        // A grant inside another's range splits it.
        r.grant(a + 4, 4, 5);
        assert!(r.read_granted(a, 4, 7).is_ok() && r.read_granted(a + 8, 8, 7).is_ok());
        assert!(matches!(r.read_granted(a, 16, 7), Err(MemoryError::NotGranted { .. })));
        // A read that names no transfer sees what is unfenced, whoever holds it.
        assert!(r.read(a, 32).is_ok());
    }

    #[test]
    fn fences_merge_and_unfencing_a_block_leaves_the_rest_fenced() {
        let mut regions = Regions::new();
        let id = regions.register(0, 1000).unwrap();
        regions.fence(0, 1000).unwrap();
        regions.unfence(100, 100);
        regions.unfence(300, 100);
        assert_eq!(regions.fenced_ranges(), 3);
        let check = |regions: &Regions, addr: u64, len: u64, readable: bool| {
            let got = regions.read(addr, len).map(<[u8]>::len);
            let expected =
                if readable { Ok(len as usize) } else { Err(MemoryError::Revoked { addr, len, region: id }) };
            assert_eq!(got, expected, "{addr}+{len}");
        };
        check(&regions, 100, 100, true);
        check(&regions, 300, 100, true);
        check(&regions, 99, 2, false);
        check(&regions, 150, 100, false);
        check(&regions, 0, 100, false);
        check(&regions, 400, 600, false);
        // Fencing a block back merges the three fences into one.
        regions.fence(100, 100).unwrap();
        regions.fence(300, 100).unwrap();
        assert_eq!(regions.fenced_ranges(), 1);
        check(&regions, 0, 1000, false);
        // Deregistering the region forgets its fences.
        regions.deregister(id).unwrap();
        assert_eq!(regions.fenced_ranges(), 0);
    }
}
