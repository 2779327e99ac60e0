//! The driver's per-cgroup GPU memory limit: NVML's `nvmlDeviceSetMemoryLimits_v1` (driver r615 and
//! newer, cgroup v2), which nvml-wrapper does not bind yet. The library is loaded at run time, as
//! nvml-wrapper loads it, so a driver without the function is told apart from one with it
//! ([`Library::open`] fails with the reason) and nothing is linked at build time.
//!
//! The limit holds for every process in the cgroup and its descendants: allocations past the hard
//! limit fail, and the soft limit is what the driver keeps for the cgroup under memory pressure
//! (NVIDIA's NVML reference, `nvmlSetMemoryLimits_v1_t`). The cgroup is named by its full path in
//! the caller's mount namespace (`/sys/fs/cgroup/...`).

use std::ffi::{CStr, CString, c_char, c_uint, c_void};
use std::path::Path;

/// NVML's `nvmlReturn_t`.
type Return = c_uint;
/// NVML's `nvmlDevice_t`.
type Device = *mut c_void;
const SUCCESS: Return = 0;

/// `nvmlSetMemoryLimits_v1_t` (24 bytes on x86_64: a pointer and two `unsigned long long`).
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: u64,
    hard_limit: u64,
}

type Init = unsafe extern "C" fn() -> Return;
type ByUuid = unsafe extern "C" fn(*const c_char, *mut Device) -> Return;
type SetLimits = unsafe extern "C" fn(Device, *mut SetMemoryLimitsV1) -> Return;
type ErrorString = unsafe extern "C" fn(Return) -> *const c_char;

/// The name of the function this crate needs beyond what every NVML has.
pub const SET_MEMORY_LIMITS: &str = "nvmlDeviceSetMemoryLimits_v1";

/// A loaded NVML that has [`SET_MEMORY_LIMITS`], with the functions it needs found once, at load.
pub struct Library {
    init: Init,
    shutdown: Init,
    by_uuid: ByUuid,
    set: SetLimits,
    error_string: ErrorString,
    /// Kept loaded while the functions above are called.
    _lib: libloading::Library,
}

impl Library {
    /// Loads NVML from `path` (a bare file name resolves through the loader's search path), or says
    /// why the driver's memory limit cannot be used through it.
    pub fn open(path: &Path) -> Result<Library, String> {
        // SAFETY: loading NVML runs its initialisers, as nvml-wrapper's own loading of it does.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load NVML from {}: {e}", path.display()))?;
        let missing = |name: &str| {
            format!(
                "the driver's NVML ({}) has no {name}: per-cgroup memory limits need driver r615 or newer",
                path.display()
            )
        };
        Ok(Library {
            init: symbol(&lib, "nvmlInit_v2").ok_or_else(|| missing("nvmlInit_v2"))?,
            shutdown: symbol(&lib, "nvmlShutdown").ok_or_else(|| missing("nvmlShutdown"))?,
            by_uuid: symbol(&lib, "nvmlDeviceGetHandleByUUID")
                .ok_or_else(|| missing("nvmlDeviceGetHandleByUUID"))?,
            set: symbol(&lib, SET_MEMORY_LIMITS).ok_or_else(|| missing(SET_MEMORY_LIMITS))?,
            error_string: symbol(&lib, "nvmlErrorString").ok_or_else(|| missing("nvmlErrorString"))?,
            _lib: lib,
        })
    }

    /// NVML's text for `code`.
    fn error(&self, code: Return) -> String {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.error_string)(code) };
        let text = if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("NVML error {code} ({text})")
    }

    /// Limits the memory the processes of cgroup `cgroup` may allocate on card `uuid` to `hard`
    /// bytes, keeping `soft` bytes for them under pressure. Blocks (NVML calls do).
    pub fn set(&self, uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), String> {
        let c_uuid = CString::new(uuid).map_err(|_| format!("card UUID {uuid:?} holds a NUL"))?;
        let c_path = CString::new(cgroup.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("cgroup path {} holds a NUL", cgroup.display()))?;
        // SAFETY: nvmlInit_v2 takes nothing and may be called again (NVML counts its users).
        let code = unsafe { (self.init)() };
        if code != SUCCESS {
            return Err(format!("nvmlInit: {}", self.error(code)));
        }
        let result = self.set_started(&c_uuid, &c_path, soft, hard);
        // SAFETY: balances the nvmlInit_v2 above (NVML counts its users; the agent's own stays).
        unsafe { (self.shutdown)() };
        result
    }

    /// [`Library::set`] once NVML is started.
    fn set_started(&self, uuid: &CStr, cgroup: &CStr, soft: u64, hard: u64) -> Result<(), String> {
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID and a place for the handle, as the function takes them.
        let code = unsafe { (self.by_uuid)(uuid.as_ptr(), &mut device) };
        if code != SUCCESS {
            return Err(format!("card {}: {}", uuid.to_string_lossy(), self.error(code)));
        }
        let mut limits =
            SetMemoryLimitsV1 { name_space: cgroup.as_ptr(), soft_limit: soft, hard_limit: hard };
        // SAFETY: a handle NVML gave, and the struct it documents, whose path outlives the call.
        let code = unsafe { (self.set)(device, &mut limits) };
        if code != SUCCESS {
            return Err(format!(
                "{SET_MEMORY_LIMITS} on card {} for {}: {}",
                uuid.to_string_lossy(),
                cgroup.to_string_lossy(),
                self.error(code)
            ));
        }
        Ok(())
    }
}

/// Function `name` of `lib`, if it has it.
fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Option<T> {
    let name = CString::new(name).ok()?;
    // SAFETY: every caller names a function of NVML's API with `T` its C signature.
    unsafe { lib.get::<T>(name.as_bytes_with_nul()) }.ok().map(|s| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_struct_has_nvidias_layout() {
        assert_eq!(std::mem::size_of::<SetMemoryLimitsV1>(), 24);
        assert_eq!(std::mem::offset_of!(SetMemoryLimitsV1, soft_limit), 8);
        assert_eq!(std::mem::offset_of!(SetMemoryLimitsV1, hard_limit), 16);
    }

    #[test]
    fn a_library_that_is_not_there_is_refused_with_its_path() {
        let e = Library::open(Path::new("/nonexistent/libnvidia-ml.so.1")).err().unwrap();
        assert!(e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
    }
}
