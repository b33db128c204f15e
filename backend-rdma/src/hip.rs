//! HIP device memory (the `hip` feature): counting devices and device buffers that free
//! themselves. The choice between device and host memory for a rank's KV is
//! `crate::memory::select_backing`, which asks [`device_count`] in a build with this module.
//!
//! The runtime comes from `hip-sys` (`hip-runtime-sys`'s pregenerated bindings), linked against
//! `libamdhip64`; its build script needs `HIP_PATH` such that `$HIP_PATH/include/hip/
//! hip_runtime_api.h` exists (`/usr` with Debian's `libamdhip64-dev`, `/opt/rocm` with AMD's
//! packages). A machine without a GPU still runs this code: `hipGetDeviceCount` answers
//! `hipErrorNoDevice`, which is [`HipError::NoDevice`], and `select_backing` falls back to the
//! host with a message saying why.
//!
//! Every failed runtime call becomes a [`HipError`] naming the call, the `hipError_t` code and
//! the runtime's own name and description of it; a bad offset or length is refused before any
//! call. Nothing here panics on outside input.
//!
//! Caveat: the bindings declare `hipError_t` as a Rust enum, so a runtime newer than the bindings
//! that returned a code they do not list would be undefined behaviour. Every code of Debian 12's
//! ROCm 5.2.3 header is listed (checked when this module was written); recheck on an upgrade.

#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_int, c_void, CStr};
use std::fmt;

use hip_sys::hiprt as ffi;

/// A HIP runtime call that failed, or a device-buffer request refused before any call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HipError {
    /// The runtime sees no device: `hipErrorNoDevice`, or a device count of zero.
    NoDevice {
        /// The call that said so.
        call: &'static str,
        /// The runtime's description (`hipGetErrorString`), or what the count was.
        detail: String,
    },
    /// Any other failed call.
    Call {
        /// The call that failed, e.g. `"hipMalloc"`.
        call: &'static str,
        /// The `hipError_t` it returned.
        code: u32,
        /// The code's name (`hipGetErrorName`), e.g. `"hipErrorOutOfMemory"`.
        name: String,
        /// The runtime's description of it (`hipGetErrorString`).
        detail: String,
    },
    /// A device ordinal at or past the number of devices.
    NoSuchDevice {
        /// The ordinal asked for.
        device: u32,
        /// How many devices there are.
        count: u32,
    },
    /// A buffer of zero bytes was asked for (`hipMalloc` would hand back a null pointer).
    ZeroLength,
    /// A copy that does not lie inside the buffer.
    OutOfRange {
        /// Offset of the copy in the buffer.
        offset: usize,
        /// Its length.
        len: usize,
        /// The buffer's length.
        buffer_len: usize,
    },
}

impl fmt::Display for HipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HipError::NoDevice { call, detail } => write!(f, "no HIP device ({call}: {detail})"),
            HipError::Call { call, code, name, detail } => {
                write!(f, "{call} failed: {name} ({code})")?;
                if detail != name {
                    write!(f, ": {detail}")?;
                }
                Ok(())
            }
            HipError::NoSuchDevice { device, count } => {
                write!(f, "no HIP device {device} (this machine has {count})")
            }
            HipError::ZeroLength => f.write_str("cannot allocate a zero-length device buffer"),
            HipError::OutOfRange { offset, len, buffer_len } => write!(
                f,
                "{len} bytes at offset {offset} run past the end of a {buffer_len}-byte device buffer"
            ),
        }
    }
}

impl std::error::Error for HipError {}

/// The runtime's text for a code; `None` if it gave a null pointer.
fn runtime_text(text: *const std::ffi::c_char) -> Option<String> {
    if text.is_null() {
        return None;
    }
    // SAFETY: `text` is non-null and came from hipGetErrorName or hipGetErrorString, which
    // return pointers to static NUL-terminated strings owned by the runtime.
    Some(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
}

/// `Ok` for `hipSuccess`; otherwise the typed error for `call`.
fn check(call: &'static str, status: ffi::hipError_t) -> Result<(), HipError> {
    if status == ffi::hipError_t::hipSuccess {
        return Ok(());
    }
    let code = status as u32;
    // SAFETY: both take any hipError_t by value and return a pointer to a static string (or
    // null); they touch no device and need no initialised runtime.
    let (name, detail) = unsafe { (ffi::hipGetErrorName(status), ffi::hipGetErrorString(status)) };
    let name = runtime_text(name).unwrap_or_else(|| format!("hipError_t {code}"));
    let detail = runtime_text(detail).unwrap_or_else(|| name.clone());
    if status == ffi::hipError_t::hipErrorNoDevice {
        return Err(HipError::NoDevice { call, detail });
    }
    Err(HipError::Call { call, code, name, detail })
}

/// The number of HIP devices: at least one, or [`HipError::NoDevice`] (never `Ok(0)`).
pub fn device_count() -> Result<u32, HipError> {
    let mut count: c_int = 0;
    // SAFETY: `count` is a live, writable c_int for the duration of the call.
    check("hipGetDeviceCount", unsafe { ffi::hipGetDeviceCount(&mut count) })?;
    match u32::try_from(count) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(HipError::NoDevice { call: "hipGetDeviceCount", detail: format!("{count} devices") }),
    }
}

/// Makes `device` current on the calling thread.
fn set_device(device: u32) -> Result<(), HipError> {
    let count = device_count()?;
    if device >= count {
        return Err(HipError::NoSuchDevice { device, count });
    }
    // `device < count <= i32::MAX`, so the conversion holds.
    let ordinal = c_int::try_from(device).map_err(|_| HipError::NoSuchDevice { device, count })?;
    // SAFETY: hipSetDevice takes a plain integer; the ordinal was checked against the count.
    check("hipSetDevice", unsafe { ffi::hipSetDevice(ordinal) })
}

/// Memory on one HIP device, allocated with `hipMalloc` and freed with `hipFree` on drop.
///
/// Every call makes the buffer's device current on the calling thread (`hipSetDevice`) first
/// and leaves it current.
#[derive(Debug)]
pub struct DeviceBuffer {
    /// The device address of the first byte; never dereferenced on the host.
    ptr: *mut c_void,
    /// Length in bytes; at least one.
    len: usize,
    /// The device's ordinal.
    device: u32,
}

// SAFETY: the buffer owns its allocation exclusively, and a HIP device pointer is valid from
// every host thread of the process (the runtime is thread-safe and each call sets the device).
unsafe impl Send for DeviceBuffer {}

// SAFETY: the only methods taking `&self` read device memory (or nothing); writing takes
// `&mut self`, so shared references never race a write.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes (contents unspecified) on `device`.
    pub fn new(device: u32, len: usize) -> Result<DeviceBuffer, HipError> {
        if len == 0 {
            return Err(HipError::ZeroLength);
        }
        set_device(device)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a live, writable pointer slot; on success the runtime stores the
        // address of `len` bytes of device memory there, which this buffer then owns.
        check("hipMalloc", unsafe { ffi::hipMalloc(&mut ptr, len) })?;
        Ok(DeviceBuffer { ptr, len, device })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-length buffers are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The device address of the first byte (what an RDMA registration or a peer names).
    pub fn device_ptr(&self) -> u64 {
        self.ptr as usize as u64
    }

    /// Checks that `len` bytes at `offset` lie inside the buffer.
    fn check_range(&self, offset: usize, len: usize) -> Result<(), HipError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(HipError::OutOfRange { offset, len, buffer_len: self.len }),
        }
    }

    /// Copies `data` to the buffer at `offset`; the whole range must lie inside the buffer.
    pub fn copy_from_host(&mut self, offset: usize, data: &[u8]) -> Result<(), HipError> {
        self.check_range(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        set_device(self.device)?;
        let dst = self.ptr.cast::<u8>().wrapping_add(offset).cast::<c_void>();
        let kind = ffi::hipMemcpyKind::hipMemcpyHostToDevice;
        // SAFETY: `dst..dst + data.len()` lies inside this buffer's allocation (checked above),
        // which `&mut self` holds exclusively; `data` is a live host slice of that length; and
        // hipMemcpy from pageable host memory returns only once `data` may be reused.
        check("hipMemcpy", unsafe { ffi::hipMemcpy(dst, data.as_ptr().cast(), data.len(), kind) })
    }

    /// Copies bytes at `offset` of the buffer into `out`; the whole range must lie inside the
    /// buffer.
    pub fn copy_to_host(&self, offset: usize, out: &mut [u8]) -> Result<(), HipError> {
        self.check_range(offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        set_device(self.device)?;
        let src = self.ptr.cast::<u8>().wrapping_add(offset).cast::<c_void>().cast_const();
        let kind = ffi::hipMemcpyKind::hipMemcpyDeviceToHost;
        // SAFETY: `src..src + out.len()` lies inside this buffer's allocation (checked above);
        // `out` is a live, exclusively borrowed host slice of that length; and a device-to-host
        // hipMemcpy is synchronous, so the runtime has stopped writing `out` when it returns.
        check("hipMemcpy", unsafe { ffi::hipMemcpy(out.as_mut_ptr().cast(), src, out.len(), kind) })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; a device that went away took its memory along.
        if set_device(self.device).is_ok() {
            // SAFETY: `ptr` came from hipMalloc, is owned by this buffer alone, and is freed
            // exactly once, here.
            let _ = unsafe { ffi::hipFree(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{select_backing, Backing};

    /// Without the kernel driver's node no HIP device can be visible, so the answers are known.
    fn driverless() -> bool {
        !std::path::Path::new("/dev/kfd").exists()
    }

    #[test]
    fn hip_no_device_is_typed_and_falls_back_to_host() {
        if !driverless() {
            println!("skipped: /dev/kfd exists");
            return;
        }
        let err = device_count().expect_err("no device without /dev/kfd");
        let HipError::NoDevice { call, detail } = &err else { panic!("not NoDevice: {err:?}") };
        assert_eq!(*call, "hipGetDeviceCount");
        assert!(!detail.is_empty());
        let why = format!("no HIP device (hipGetDeviceCount: {detail}); KV stays in host memory");
        assert_eq!(select_backing(true), (Backing::Host, Some(why)));
        assert_eq!(select_backing(false), (Backing::Host, None));
        assert_eq!(DeviceBuffer::new(0, 16).map(|b| b.len()), Err(err));
        assert_eq!(DeviceBuffer::new(0, 0).map(|b| b.len()), Err(HipError::ZeroLength));
    }

    #[test]
    fn hip_errors_name_the_call_and_code() {
        assert_eq!(check("hipFree", ffi::hipError_t::hipSuccess), Ok(()));
        let Err(err) = check("hipMalloc", ffi::hipError_t::hipErrorOutOfMemory) else {
            panic!("hipErrorOutOfMemory is an error")
        };
        let HipError::Call { call, code, name, detail } = &err else { panic!("not Call: {err:?}") };
        assert_eq!((*call, *code, name.as_str()), ("hipMalloc", 2, "hipErrorOutOfMemory"));
        let shown = err.to_string();
        assert!(shown.starts_with("hipMalloc failed: hipErrorOutOfMemory (2)"), "{shown}");
        assert!(shown.contains(detail.as_str()), "{shown}");
        let no = check("hipSetDevice", ffi::hipError_t::hipErrorNoDevice);
        assert!(matches!(no, Err(HipError::NoDevice { call: "hipSetDevice", .. })), "{no:?}");
        let out = HipError::OutOfRange { offset: 10, len: 8, buffer_len: 16 };
        assert_eq!(out.to_string(), "8 bytes at offset 10 run past the end of a 16-byte device buffer");
        let missing = HipError::NoSuchDevice { device: 2, count: 1 };
        assert_eq!(missing.to_string(), "no HIP device 2 (this machine has 1)");
    }

    /// Runs only where a device is present; elsewhere it says so and passes.
    #[test]
    fn hip_device_round_trip_and_bounds() {
        let Ok(count) = device_count() else {
            println!("skipped: no HIP device");
            return;
        };
        assert_eq!(select_backing(true), (Backing::Hip { device: 0 }, None));
        assert_eq!(
            DeviceBuffer::new(count, 16).map(|b| b.len()),
            Err(HipError::NoSuchDevice { device: count, count })
        );
        let mut buf = DeviceBuffer::new(0, 4096).expect("hipMalloc of 4 KiB");
        assert_eq!((buf.len(), buf.device(), buf.is_empty()), (4096, 0, false));
        assert_ne!(buf.device_ptr(), 0);
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        buf.copy_from_host(0, &pattern).expect("whole buffer");
        buf.copy_from_host(100, b"hello").expect("in range");
        let mut back = vec![0u8; 4096];
        buf.copy_to_host(0, &mut back).expect("whole buffer");
        let mut want = pattern.clone();
        want[100..105].copy_from_slice(b"hello");
        assert_eq!(back, want);
        let mut tail = [0u8; 6];
        buf.copy_to_host(4090, &mut tail).expect("last six bytes");
        assert_eq!(tail[..], want[4090..]);
        buf.copy_to_host(4096, &mut []).expect("empty copy at the end");
        let out = |offset, len| Err(HipError::OutOfRange { offset, len, buffer_len: 4096 });
        assert_eq!(buf.copy_from_host(4095, b"ab"), out(4095, 2));
        assert_eq!(buf.copy_to_host(4097, &mut []), out(4097, 0));
        assert_eq!(buf.copy_to_host(usize::MAX, &mut tail), out(usize::MAX, 6));
        // A refused copy changed nothing.
        buf.copy_to_host(4090, &mut tail).expect("last six bytes");
        assert_eq!(tail[..], want[4090..]);
        // Drop frees: 4 GiB allocated in 64 MiB rounds, each dropped before the next.
        for _ in 0..64 {
            let big = DeviceBuffer::new(0, 64 << 20).expect("hipMalloc of 64 MiB");
            drop(big);
        }
    }
}
