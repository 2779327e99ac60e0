//! A fake `libnvidia-ml.so.1` for tests on machines without a GPU: it exports the NVML symbols that
//! nvml-wrapper resolves for inventory (init, shutdown, error strings, driver version, device count,
//! handles, UUID, name, memory, minor number, PCI info, index), with the struct layouts taken from
//! nvml-wrapper-sys itself so they match exactly. The cards come from the JSON file named by the
//! environment variable `FAKE_NVML_CONFIG`, read at `nvmlInit`:
//! `{"cards":[{"uuid":"GPU-…","name":"Tesla T4","memoryMiB":15360,"minor":0,"pciBusId":"00000000:3B:00.0"}],
//!   "xids":[{"card":0,"xid":79}]}` — the XID events are delivered, in order, by `nvmlEventSetWait_v2`
//! to an event set on which the card's critical XIDs were registered. A card whose index is listed
//! (comma-separated) in the file named by `FAKE_NVML_LOST`, read at every call, answers
//! `NVML_ERROR_GPU_IS_LOST` to every device query, as a card that fell off the bus does.
//!
//! **Processes.** A card's compute processes are those listed in the file
//! (`"processes":[{"card":0,"pid":4242,"memoryMiB":2048,"sm":40}]`) and the live ones of the process
//! directory named by `"processDir"`: a process there is a file (any name) holding
//! `{"uuid":"GPU-…","memoryMiB":N,"sm":N}` on which a process holds a lock (`flock` or `fcntl`);
//! its PID is the lock holder's in `/proc/locks`, as the reader's PID namespace sees it (the host's,
//! for an agent with `hostPID`), so a process's use ends when it does,
//! as a CUDA context's does. `tests/src/bin/gpu-use.rs` is such a process. A card's used memory is
//! the sum of its processes', its utilisation the sum of their SM shares (at most 100), and each
//! process with SM work has one utilisation sample per call, stamped with the time of the call.
//! A process marked `"mps": true` (listed or live) is an MPS client and one marked `"mpsServer": true`
//! its card's MPS server, as a real card under MPS showed them (an H200, driver 580.159.04:
//! `hack/gpu-check.sh`): `nvmlDeviceGetComputeRunningProcesses_v3` lists the server and every client,
//! each with its own memory; `nvmlDeviceGetMPSComputeRunningProcesses_v3` lists the clients alone; and
//! the clients' work is sampled under the server's PID (`nvmlDeviceGetProcessUtilization` gives a
//! client no sample of its own, and the server the sum of its clients' SM shares, at most 100).
//! `"temperature"` (°C, default 40), `"powerW"` (default 70) and `"computeCapability"` (default
//! `"7.5"`) are per card. A card with
//! `"mig": true` is in MIG mode; the others answer `NVML_ERROR_NOT_SUPPORTED` to the MIG mode query,
//! as cards without MIG do.
//!
//! **Memory limits.** `nvmlDeviceSetMemoryLimits_v1` appends each call it accepts to the file named
//! by `"memoryLimitLog"` as one JSON line (`{"uuid","nameSpace","softLimit","hardLimit"}`); it
//! answers `NVML_ERROR_NOT_SUPPORTED` without that file and for a card in MIG mode (as the driver
//! does for MIG handles), and `NVML_ERROR_INVALID_ARGUMENT` for a cgroup path that is not a
//! directory.
//!
//! **Compute modes.** `nvmlDeviceSetComputeMode` keeps each card's mode in the JSON file named by
//! `"computeModeFile"` (`{"GPU-…": 3}`), which every process using the fake reads, so a test sees what
//! the agent set; without that file it answers `NVML_ERROR_NO_PERMISSION`, as the driver answers a
//! caller that is not root.
//!
//! Each exported function is the NVML function of the same name; see NVIDIA's NVML reference.
#![allow(non_snake_case, unsafe_code, missing_docs, clippy::missing_safety_doc)]

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeXidCriticalError, nvmlMemory_v2_t,
    nvmlPciInfo_t, nvmlProcessInfo_t, nvmlProcessUtilizationSample_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH, nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE, nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    nvmlReturn_enum_NVML_ERROR_NOT_FOUND, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
    nvmlReturn_enum_NVML_ERROR_TIMEOUT, nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t, nvmlUtilization_t,
};
use std::os::raw::{c_char, c_uint};
use std::sync::Mutex;

struct Card {
    uuid: String,
    name: String,
    memory_mib: u64,
    minor: u32,
    bus_id: String,
    temperature: u32,
    power_mw: u32,
    mig: bool,
    /// CUDA compute capability (major, minor).
    capability: (i32, i32),
}

/// A compute process on a card.
#[derive(Clone, Copy)]
struct Process {
    pid: u32,
    memory_mib: u64,
    sm: u32,
    mps: bool,
    mps_server: bool,
}

static CARDS: Mutex<Option<Vec<Card>>> = Mutex::new(None);
/// Where a card's processes come from.
struct Processes {
    /// Listed in the file: (card index, process).
    listed: Vec<(usize, Process)>,
    /// The live process directory.
    dir: Option<String>,
}

static PROCESSES: Mutex<Processes> = Mutex::new(Processes { listed: Vec::new(), dir: None });
/// Where accepted memory limits are recorded (`"memoryLimitLog"`).
static LIMIT_LOG: Mutex<Option<String>> = Mutex::new(None);
/// Where the cards' compute modes are kept (`"computeModeFile"`), shared by every process.
static COMPUTE_MODES: Mutex<Option<String>> = Mutex::new(None);
/// Pending XID events: (card index, XID).
static XIDS: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
/// Cards whose critical XIDs an event set listens to.
static REGISTERED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn load() -> Vec<Card> {
    let Some(path) = std::env::var_os("FAKE_NVML_CONFIG") else { return Vec::new() };
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(&text) else { return Vec::new() };
    if let Ok(mut xids) = XIDS.lock() {
        *xids = doc["xids"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|x| (x["card"].as_u64().unwrap_or(0) as usize, x["xid"].as_u64().unwrap_or(79)))
            .collect();
    }
    if let Ok(mut log) = LIMIT_LOG.lock() {
        *log = doc["memoryLimitLog"].as_str().map(str::to_owned);
    }
    if let Ok(mut file) = COMPUTE_MODES.lock() {
        *file = doc["computeModeFile"].as_str().map(str::to_owned);
    }
    if let Ok(mut p) = PROCESSES.lock() {
        let listed = doc["processes"].as_array().into_iter().flatten().map(|p| {
            let n = |k: &str| p[k].as_u64().unwrap_or(0);
            (
                n("card") as usize,
                Process {
                    pid: n("pid") as u32,
                    memory_mib: n("memoryMiB"),
                    sm: n("sm") as u32,
                    mps: p["mps"].as_bool().unwrap_or(false),
                    mps_server: p["mpsServer"].as_bool().unwrap_or(false),
                },
            )
        });
        *p = Processes { listed: listed.collect(), dir: doc["processDir"].as_str().map(str::to_owned) };
    }
    doc["cards"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, c)| Card {
            uuid: c["uuid"].as_str().unwrap_or("GPU-fake").to_owned(),
            name: c["name"].as_str().unwrap_or("Fake GPU").to_owned(),
            memory_mib: c["memoryMiB"].as_u64().unwrap_or(16_384),
            minor: c["minor"].as_u64().map_or(i as u32, |m| m as u32),
            bus_id: c["pciBusId"]
                .as_str()
                .map_or_else(|| format!("00000000:{:02X}:00.0", i + 1), str::to_owned),
            temperature: c["temperature"].as_u64().unwrap_or(40) as u32,
            power_mw: (c["powerW"].as_f64().unwrap_or(70.0) * 1000.0) as u32,
            mig: c["mig"].as_bool().unwrap_or(false),
            capability: c["computeCapability"]
                .as_str()
                .and_then(|v| v.split_once('.'))
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                .unwrap_or((7, 5)),
        })
        .collect()
}

/// The compute processes of card `index` (UUID `uuid`) now: the listed ones and the live ones.
fn processes(index: usize, uuid: &str) -> Vec<Process> {
    let Ok(guard) = PROCESSES.lock() else { return Vec::new() };
    let Processes { listed, dir } = &*guard;
    let mut all: Vec<Process> = listed.iter().filter(|(card, _)| *card == index).map(|(_, p)| *p).collect();
    if let Some(dir) = dir {
        all.extend(live(dir, uuid));
    }
    all
}

/// The live processes on card `uuid` in process directory `dir`: files with a lock held.
fn live(dir: &str, uuid: &str) -> Vec<Process> {
    use std::os::unix::fs::MetadataExt;
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else { return Vec::new() };
    // `1: FLOCK  ADVISORY  WRITE 1234 fd:01:56789 0 EOF`: holder PID, then the file as
    // `MAJOR:MINOR:INODE` (hex, hex, decimal); a waiter (`1: -> …`) holds nothing.
    let holders: Vec<(u32, &str)> = locks
        .lines()
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            if t.get(1) == Some(&"->") {
                return None;
            }
            Some((t.get(4)?.parse().ok()?, *t.get(5)?))
        })
        .collect();
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            let dev = meta.dev();
            // glibc's major()/minor() of a dev_t.
            let (major, minor) =
                (((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff), (dev & 0xff) | ((dev >> 12) & !0xff));
            let file = format!("{major:02x}:{minor:02x}:{}", meta.ino());
            let (pid, _) = holders.iter().find(|(_, id)| *id == file)?;
            let pid = *pid;
            let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok()?;
            (doc["uuid"].as_str()? == uuid).then(|| Process {
                pid,
                memory_mib: doc["memoryMiB"].as_u64().unwrap_or(0),
                sm: doc["sm"].as_u64().unwrap_or(0) as u32,
                mps: doc["mps"].as_bool().unwrap_or(false),
                mps_server: doc["mpsServer"].as_bool().unwrap_or(false),
            })
        })
        .collect()
}

/// The processes of the card behind `device`.
fn card_processes(device: nvmlDevice_t) -> Result<Vec<Process>, nvmlReturn_t> {
    let uuid = with_card(device, |c| c.uuid.clone())?;
    Ok(processes(device as usize - 1, &uuid))
}

/// Fills a caller's array of `*count` entries with `items`, NVML's way: the needed count back, and
/// `INSUFFICIENT_SIZE` when the array is missing or short.
unsafe fn fill<T, U>(items: &[T], count: *mut c_uint, out: *mut U, write: impl Fn(&T) -> U) -> nvmlReturn_t {
    let Some(count) = (unsafe { count.as_mut() }) else { return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT };
    let room = *count as usize;
    *count = items.len() as c_uint;
    if items.is_empty() {
        return nvmlReturn_enum_NVML_SUCCESS;
    }
    if out.is_null() || room < items.len() {
        return nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (i, item) in items.iter().enumerate() {
        unsafe { out.add(i).write(write(item)) };
    }
    nvmlReturn_enum_NVML_SUCCESS
}

fn with_card<T>(device: nvmlDevice_t, f: impl FnOnce(&Card) -> T) -> Result<T, nvmlReturn_t> {
    let guard = CARDS.lock().map_err(|_| nvmlReturn_enum_NVML_ERROR_UNINITIALIZED)?;
    let cards = guard.as_ref().ok_or(nvmlReturn_enum_NVML_ERROR_UNINITIALIZED)?;
    let index = (device as usize).checked_sub(1).ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)?;
    if lost(index) {
        return Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST);
    }
    cards.get(index).map(f).ok_or(nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT)
}

/// Whether card `index` is listed in the `FAKE_NVML_LOST` file now.
fn lost(index: usize) -> bool {
    let Some(path) = std::env::var_os("FAKE_NVML_LOST") else { return false };
    let Ok(text) = std::fs::read_to_string(path) else { return false };
    text.split(',').any(|i| i.trim().parse() == Ok(index))
}

/// Copies `text` and a NUL into a caller's buffer of `len` bytes.
unsafe fn write_c_string(text: &str, buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    let bytes = text.as_bytes();
    if buf.is_null() || bytes.len() + 1 > len as usize {
        return nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    nvmlReturn_enum_NVML_SUCCESS
}

fn status<T>(r: Result<T, nvmlReturn_t>, store: impl FnOnce(T)) -> nvmlReturn_t {
    match r {
        Ok(v) => {
            store(v);
            nvmlReturn_enum_NVML_SUCCESS
        }
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    if let Ok(mut cards) = CARDS.lock() {
        *cards = Some(load());
    }
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(_result: nvmlReturn_t) -> *const c_char {
    c"fake NVML error".as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    unsafe { write_c_string("550.54.15", version, length) }
}

/// NVML's version: the CUDA major version, then the driver's (`13.580.159.04` on driver 580.159.04).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    unsafe { write_c_string("12.550.54.15", version, length) }
}

/// The CUDA version the driver supports, as 1000 × major + 10 × minor (driver 550: CUDA 12.4).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    version: *mut std::os::raw::c_int,
) -> nvmlReturn_t {
    match unsafe { version.as_mut() } {
        Some(v) => {
            *v = 12040;
            nvmlReturn_enum_NVML_SUCCESS
        }
        None => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    let n = CARDS.lock().ok().and_then(|c| c.as_ref().map(Vec::len));
    match (n, count.is_null()) {
        (Some(n), false) => {
            unsafe { *count = n as c_uint };
            nvmlReturn_enum_NVML_SUCCESS
        }
        (None, _) => nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
        (_, true) => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let handle = (index as usize + 1) as nvmlDevice_t;
    status(with_card(handle, |_| handle), |h| unsafe { *device = h })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if uuid.is_null() || device.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let wanted = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy().into_owned();
    let Ok(guard) = CARDS.lock() else { return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED };
    let Some(cards) = guard.as_ref() else { return nvmlReturn_enum_NVML_ERROR_UNINITIALIZED };
    match cards.iter().position(|c| c.uuid == wanted) {
        Some(i) => {
            unsafe { *device = (i + 1) as nvmlDevice_t };
            nvmlReturn_enum_NVML_SUCCESS
        }
        None => nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
    }
}

/// NVML's `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
pub struct nvmlSetMemoryLimits_v1_t {
    pub nameSpace: *const c_char,
    pub softLimit: u64,
    pub hardLimit: u64,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlSetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    let (uuid, mig) = match with_card(device, |c| (c.uuid.clone(), c.mig)) {
        Ok(card) => card,
        Err(e) => return e,
    };
    let Some(limits) = (unsafe { limits.as_ref() }) else {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    };
    if limits.nameSpace.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let path = unsafe { std::ffi::CStr::from_ptr(limits.nameSpace) }.to_string_lossy().into_owned();
    let Some(log) = LIMIT_LOG.lock().ok().and_then(|l| l.clone()) else {
        return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    };
    if mig {
        return nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    }
    if !std::path::Path::new(&path).is_dir() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let line = serde_json::json!({
        "uuid": uuid, "nameSpace": path, "softLimit": limits.softLimit, "hardLimit": limits.hardLimit,
    });
    use std::io::Write;
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    match written {
        Ok(()) => nvmlReturn_enum_NVML_SUCCESS,
        Err(_) => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    }
}

/// The compute modes set so far, by UUID (`NVML_COMPUTEMODE_*`: 0 default, 2 prohibited, 3
/// exclusive process), from the shared file; a card not in it is in the default mode.
fn compute_modes() -> (Option<String>, serde_json::Map<String, serde_json::Value>) {
    let file = COMPUTE_MODES.lock().ok().and_then(|f| f.clone());
    let modes = file
        .as_ref()
        .and_then(|f| std::fs::read(f).ok())
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    (file, modes)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut c_uint) -> nvmlReturn_t {
    let Some(mode) = (unsafe { mode.as_mut() }) else { return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT };
    let uuid = match with_card(device, |c| c.uuid.clone()) {
        Ok(u) => u,
        Err(e) => return e,
    };
    *mode = compute_modes().1.get(&uuid).and_then(|m| m.as_u64()).unwrap_or(0) as c_uint;
    nvmlReturn_enum_NVML_SUCCESS
}

/// As NVML: modes 0, 2 and 3 (1, exclusive thread, is gone); without `"computeModeFile"` the
/// caller is treated as not root (`NO_PERMISSION`), as the driver treats one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetComputeMode(device: nvmlDevice_t, mode: c_uint) -> nvmlReturn_t {
    let uuid = match with_card(device, |c| c.uuid.clone()) {
        Ok(u) => u,
        Err(e) => return e,
    };
    if !matches!(mode, 0 | 2 | 3) {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    let (Some(file), mut modes) = compute_modes() else {
        return nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
    };
    modes.insert(uuid, mode.into());
    match std::fs::write(&file, serde_json::Value::Object(modes).to_string()) {
        Ok(()) => nvmlReturn_enum_NVML_SUCCESS,
        Err(_) => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    status(with_card(device, |_| (device as usize - 1) as c_uint), |i| unsafe { *index = i })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    match with_card(device, |c| c.uuid.clone()) {
        Ok(text) => unsafe { write_c_string(&text, uuid, length) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    match with_card(device, |c| c.name.clone()) {
        Ok(text) => unsafe { write_c_string(&text, name, length) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let Some(m) = (unsafe { memory.as_mut() }) else { return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT };
    if m.version >> 24 != 2 {
        return nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    let used: u64 = match card_processes(device) {
        Ok(p) => p.iter().map(|p| p.memory_mib << 20).sum(),
        Err(e) => return e,
    };
    status(with_card(device, |c| c.memory_mib << 20), |total| {
        m.total = total;
        m.reserved = 0;
        m.used = used.min(total);
        m.free = total - m.used;
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut std::os::raw::c_int,
    minor: *mut std::os::raw::c_int,
) -> nvmlReturn_t {
    if major.is_null() || minor.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    status(with_card(device, |c| c.capability), |(a, b)| unsafe {
        *major = a;
        *minor = b;
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    match with_card(device, |c| c.mig) {
        Ok(true) => unsafe {
            *current = 1;
            *pending = 1;
            nvmlReturn_enum_NVML_SUCCESS
        },
        Ok(false) => nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) -> nvmlReturn_t {
    status(with_card(device, |c| c.minor), |m| unsafe { *minor = m })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    let Some(p) = (unsafe { pci.as_mut() }) else { return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT };
    status(with_card(device, |c| c.bus_id.clone()), |bus_id| {
        p.busId = [0; 32];
        p.busIdLegacy = [0; 16];
        for (dst, src) in p.busId.iter_mut().zip(bus_id.bytes().take(31)) {
            *dst = src as c_char;
        }
        for (dst, src) in p.busIdLegacy.iter_mut().zip(bus_id.bytes().skip(4).take(15)) {
            *dst = src as c_char;
        }
        p.domain = 0;
        p.bus = 0;
        p.device = 0;
        p.pciDeviceId = 0x1eb8_10de;
        p.pciSubSystemId = 0;
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    if set.is_null() {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    }
    unsafe { *set = 1usize as nvmlEventSet_t };
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(_set: nvmlEventSet_t) -> nvmlReturn_t {
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: u64,
    _set: nvmlEventSet_t,
) -> nvmlReturn_t {
    let index = match with_card(device, |_| device as usize - 1) {
        Ok(i) => i,
        Err(e) => return e,
    };
    if types & u64::from(nvmlEventTypeXidCriticalError) != 0
        && let Ok(mut r) = REGISTERED.lock()
    {
        r.push(index);
    }
    nvmlReturn_enum_NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    _set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let registered = REGISTERED.lock().map(|r| r.clone()).unwrap_or_default();
    let next = XIDS.lock().ok().and_then(|mut x| {
        let pos = x.iter().position(|(card, _)| registered.contains(card))?;
        Some(x.remove(pos))
    });
    match (next, unsafe { data.as_mut() }) {
        (Some((card, xid)), Some(d)) => {
            d.device = (card + 1) as nvmlDevice_t;
            d.eventType = u64::from(nvmlEventTypeXidCriticalError);
            d.eventData = xid;
            d.gpuInstanceId = 0;
            d.computeInstanceId = 0;
            nvmlReturn_enum_NVML_SUCCESS
        }
        (Some(_), None) => nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
        (None, _) => {
            // Nothing to report: wait out the timeout, as NVML does.
            std::thread::sleep(std::time::Duration::from_millis(u64::from(timeout_ms.min(1000))));
            nvmlReturn_enum_NVML_ERROR_TIMEOUT
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe { process_infos(device, false, count, infos) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    unsafe { process_infos(device, true, count, infos) }
}

/// The compute processes of the card behind `device` (MPS clients and servers among them), or its MPS
/// clients alone (`mps_clients`), NVML's way.
unsafe fn process_infos(
    device: nvmlDevice_t,
    mps_clients: bool,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    match card_processes(device)
        .map(|all| all.into_iter().filter(|p| p.mps || !mps_clients).collect::<Vec<_>>())
    {
        Ok(p) => unsafe {
            fill(&p, count, infos, |p| nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p.memory_mib << 20,
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            })
        },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    samples: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen: u64,
) -> nvmlReturn_t {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let processes = match card_processes(device) {
        Ok(p) => p,
        Err(e) => return e,
    };
    // MPS clients' work is the server's: it is sampled under the server's PID, theirs has none.
    let clients: u32 = processes.iter().filter(|p| p.mps).map(|p| p.sm).sum();
    let busy: Vec<Process> = processes
        .iter()
        .filter(|p| !p.mps)
        .map(|p| if p.mps_server { Process { sm: (p.sm + clients).min(100), ..*p } } else { *p })
        .filter(|p| p.sm > 0 && now > last_seen)
        .collect();
    // As NVML: no sample since `last_seen` is NOT_FOUND.
    if busy.is_empty() {
        return nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
    }
    unsafe {
        fill(&busy, count, samples, |p| nvmlProcessUtilizationSample_t {
            pid: p.pid,
            timeStamp: now,
            smUtil: p.sm,
            memUtil: 0,
            encUtil: 0,
            decUtil: 0,
        })
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    let Some(u) = (unsafe { utilization.as_mut() }) else {
        return nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    };
    status(card_processes(device), |p| {
        // An MPS server's own share is its clients': counted once.
        u.gpu = p.iter().filter(|p| !p.mps_server).map(|p| p.sm).sum::<u32>().min(100);
        u.memory = 0;
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    _sensor: c_uint,
    temperature: *mut c_uint,
) -> nvmlReturn_t {
    status(with_card(device, |c| c.temperature), |t| unsafe { *temperature = t })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) -> nvmlReturn_t {
    status(with_card(device, |c| c.power_mw), |mw| unsafe { *power = mw })
}
