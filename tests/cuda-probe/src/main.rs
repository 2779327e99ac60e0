//! The workload of the real-GPU node check (`hack/gpu-node.sh`): run in a container on a machine
//! with an NVIDIA card, it says what the CUDA driver shows the container and whether CUDA runs there.
//! It loads the driver's `libcuda.so.1` (the library the container runtime mounted from the node:
//! no CUDA toolkit is in the image), lists the devices it sees (index, UUID as `nvidia-smi` prints
//! it, name, SMs, memory), allocates what it is asked on device 0, runs a kernel (PTX, compiled by
//! the driver) for as long as asked, holds its context for a while so the node's tools can see it
//! (and holds as long when no driver answered), and prints each step as one JSON line.
//!
//! Usage: `cuda-probe [--alloc-mib N]... [--load-seconds S] [--hold-seconds S]`. Exit status 0 when
//! the driver answered (a refused allocation is a result, not a failure), 3 when no driver or device
//! answered, 2 on a usage error.

use serde_json::{Value, json};
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::io::Write;
use std::time::{Duration, Instant};

/// Where the driver's library is looked for after the loader's own search.
const CANDIDATES: [&str; 4] = [
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/libcuda.so.1",
];

/// A busy loop of fused multiply-adds per thread, its result stored so it is not optimised away.
const KERNEL: &str = r#".version 6.0
.target sm_50
.address_size 64

.visible .entry spin(.param .u64 out, .param .u32 iterations)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [iterations];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    cvt.rn.f32.s32 %f1, %r5;
    mov.f32 %f2, 0f3F800000;
    mov.f32 %f3, 0f3F7FFFFF;
LOOP:
    fma.rn.f32 %f1, %f1, %f3, %f2;
    sub.s32 %r1, %r1, 1;
    setp.ne.s32 %p, %r1, 0;
    @%p bra LOOP;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.s32 %rd3, %r5, 4;
    add.s64 %rd2, %rd2, %rd3;
    st.global.f32 [%rd2], %f1;
    ret;
}
"#;

/// The flags, as given.
#[derive(Debug, Default, PartialEq)]
struct Args {
    alloc_mib: Vec<u64>,
    load_seconds: f64,
    hold_seconds: f64,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut out = Args::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = || format!("{flag} {value}: not a number");
        match flag.as_str() {
            "--alloc-mib" => out.alloc_mib.push(value.parse().map_err(|_| bad())?),
            "--load-seconds" => out.load_seconds = value.parse().map_err(|_| bad())?,
            "--hold-seconds" => out.hold_seconds = value.parse().map_err(|_| bad())?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(out)
}

/// A card's UUID as `nvidia-smi` prints it.
fn uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

fn emit(event: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{event}");
    let _ = out.flush();
}

type CuResult = c_int;
type Device = c_int;
type Context = *mut c_void;
type Module = *mut c_void;
type Function = *mut c_void;
type DevicePtr = u64;

/// The driver API functions the probe calls, resolved from the loaded library.
struct Cuda {
    _lib: libloading::Library,
    path: String,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut Device, c_int) -> CuResult,
    device_name: unsafe extern "C" fn(*mut c_char, c_int, Device) -> CuResult,
    device_uuid: unsafe extern "C" fn(*mut [u8; 16], Device) -> CuResult,
    device_attribute: unsafe extern "C" fn(*mut c_int, c_int, Device) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, Device) -> CuResult,
    ctx_create: unsafe extern "C" fn(*mut Context, c_uint, Device) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult,
    memset_d32: unsafe extern "C" fn(DevicePtr, c_uint, usize) -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut Module, *const c_void) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Function,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
const MULTIPROCESSOR_COUNT: c_int = 16;

impl Cuda {
    /// Loads the first of `candidates` that loads (the loader's own search for a bare name).
    fn load(candidates: &[String]) -> Result<Cuda, String> {
        let mut tried = Vec::new();
        for path in candidates {
            // SAFETY: loading the CUDA driver runs its initialisers, which is what it is for.
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => return Cuda::resolve(lib, path.clone()),
                Err(e) => tried.push(format!("{path}: {e}")),
            }
        }
        Err(format!("no CUDA driver library: {}", tried.join("; ")))
    }

    fn resolve(lib: libloading::Library, path: String) -> Result<Cuda, String> {
        // SAFETY: each symbol is the driver API function of that name, with the C signature the
        // field declares (cuda.h of CUDA 12 and 13).
        unsafe {
            macro_rules! sym {
                ($($name:literal),+) => {{
                    let mut found = None;
                    $(if found.is_none() {
                        found = lib.get(concat!($name, "\0").as_bytes()).ok().map(|s: libloading::Symbol<_>| *s);
                    })+
                    found.ok_or_else(|| format!("{path} has no {}", [$($name),+].join(" or ")))?
                }};
            }
            Ok(Cuda {
                init: sym!("cuInit"),
                driver_version: sym!("cuDriverGetVersion"),
                device_count: sym!("cuDeviceGetCount"),
                device_get: sym!("cuDeviceGet"),
                device_name: sym!("cuDeviceGetName"),
                device_uuid: sym!("cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
                device_attribute: sym!("cuDeviceGetAttribute"),
                device_total_mem: sym!("cuDeviceTotalMem_v2"),
                ctx_create: sym!("cuCtxCreate_v2"),
                mem_alloc: sym!("cuMemAlloc_v2"),
                memset_d32: sym!("cuMemsetD32_v2"),
                mem_get_info: sym!("cuMemGetInfo_v2"),
                module_load_data: sym!("cuModuleLoadData"),
                module_get_function: sym!("cuModuleGetFunction"),
                launch_kernel: sym!("cuLaunchKernel"),
                ctx_synchronize: sym!("cuCtxSynchronize"),
                error_string: sym!("cuGetErrorString"),
                _lib: lib,
                path,
            })
        }
    }

    /// `Ok(())`, or the driver's name for `code`.
    fn check(&self, code: CuResult, what: &str) -> Result<(), String> {
        if code == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string, or leaves it null.
        let named = unsafe { (self.error_string)(code, &mut text) } == 0 && !text.is_null();
        // SAFETY: a non-null pointer from cuGetErrorString is a NUL-terminated static string.
        let name = if named {
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        } else {
            String::new()
        };
        Err(format!("{what}: CUDA error {code} {name}").trim_end().to_owned())
    }
}

/// The devices the driver shows, as JSON.
fn devices(cuda: &Cuda) -> Result<Vec<Value>, String> {
    let mut count = 0;
    // SAFETY: each call writes only to the out-parameters given, sized as the API declares.
    unsafe {
        cuda.check((cuda.device_count)(&mut count), "cuDeviceGetCount")?;
        let mut out = Vec::new();
        for index in 0..count {
            let mut device = 0;
            cuda.check((cuda.device_get)(&mut device, index), "cuDeviceGet")?;
            let mut name = [0 as c_char; 256];
            cuda.check((cuda.device_name)(name.as_mut_ptr(), 256, device), "cuDeviceGetName")?;
            let mut id = [0u8; 16];
            cuda.check((cuda.device_uuid)(&mut id, device), "cuDeviceGetUuid")?;
            let mut sms = 0;
            cuda.check(
                (cuda.device_attribute)(&mut sms, MULTIPROCESSOR_COUNT, device),
                "cuDeviceGetAttribute",
            )?;
            let mut total = 0usize;
            cuda.check((cuda.device_total_mem)(&mut total, device), "cuDeviceTotalMem")?;
            out.push(json!({
                "index": index, "uuid": uuid(&id),
                "name": CStr::from_ptr(name.as_ptr()).to_string_lossy(),
                "sms": sms, "total_mib": total >> 20,
            }));
        }
        Ok(out)
    }
}

/// Launches the kernel over `sms * 4` blocks until `seconds` passed; the number of launches.
fn load(cuda: &Cuda, sms: u32, seconds: f64) -> Result<u64, String> {
    let blocks = sms.max(1) * 4;
    let threads = 256u32;
    let ptx = CString::new(KERNEL).map_err(|e| e.to_string())?;
    let mut module: Module = std::ptr::null_mut();
    let mut function: Function = std::ptr::null_mut();
    let mut out: DevicePtr = 0;
    // SAFETY: the module is the PTX above (NUL-terminated); the kernel's parameters are a device
    // pointer to blocks * threads floats, allocated here, and a u32, passed by address as
    // cuLaunchKernel takes them.
    unsafe {
        cuda.check((cuda.module_load_data)(&mut module, ptx.as_ptr().cast()), "cuModuleLoadData")?;
        cuda.check(
            (cuda.module_get_function)(&mut function, module, c"spin".as_ptr()),
            "cuModuleGetFunction",
        )?;
        cuda.check(
            (cuda.mem_alloc)(&mut out, (blocks * threads) as usize * 4),
            "cuMemAlloc (kernel output)",
        )?;
        let mut iterations: u32 = 1 << 16;
        let mut params: [*mut c_void; 2] =
            [(&mut out as *mut DevicePtr).cast(), (&mut iterations as *mut u32).cast()];
        let start = Instant::now();
        let mut launches = 0;
        while launches == 0 || start.elapsed().as_secs_f64() < seconds {
            let launched = (cuda.launch_kernel)(
                function,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            cuda.check(launched, "cuLaunchKernel")?;
            cuda.check((cuda.ctx_synchronize)(), "cuCtxSynchronize")?;
            launches += 1;
        }
        Ok(launches)
    }
}

fn env_event() -> Value {
    let names = [
        "NVIDIA_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "NANO_GPU_CARDS",
    ];
    let mut event = json!({"event": "env"});
    for name in names {
        event[name] = std::env::var(name).map(Value::from).unwrap_or(Value::Null);
    }
    let mut nodes: Vec<String> = std::fs::read_dir("/dev")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("nvidia"))
                .collect()
        })
        .unwrap_or_default();
    nodes.sort();
    event["dev_nvidia"] = json!(nodes);
    event
}

/// The library candidates: the loader's search, `$NANO_GPU_LIBCUDA`, then [`CANDIDATES`].
fn candidates() -> Vec<String> {
    let mut all = vec!["libcuda.so.1".to_owned()];
    all.extend(std::env::var("NANO_GPU_LIBCUDA").ok());
    all.extend(CANDIDATES.iter().map(|c| (*c).to_owned()));
    all
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(args) => args,
        Err(e) => {
            eprintln!(
                "cuda-probe: {e}\nusage: cuda-probe [--alloc-mib N]... [--load-seconds S] [--hold-seconds S]"
            );
            std::process::exit(2);
        }
    };
    emit(env_event());
    let started = (|| -> Result<(Cuda, Vec<Value>, i32), String> {
        let cuda = Cuda::load(&candidates())?;
        // SAFETY: cuInit(0) and cuDriverGetVersion write only their out-parameter.
        let version = unsafe {
            cuda.check((cuda.init)(0), "cuInit")?;
            let mut v = 0;
            cuda.check((cuda.driver_version)(&mut v), "cuDriverGetVersion")?;
            v
        };
        let found = devices(&cuda)?;
        if found.is_empty() {
            return Err("the driver shows no device".into());
        }
        Ok((cuda, found, version))
    })();
    let (cuda, found, version) = match started {
        Ok(s) => s,
        Err(e) => {
            emit(json!({"event": "init", "ok": false, "error": e}));
            // Held all the same: the pod runs as long as asked, with or without a card (the node's
            // books are read while it runs).
            hold(args.hold_seconds);
            emit(json!({"event": "done", "ok": false}));
            std::process::exit(3);
        }
    };
    emit(
        json!({"event": "init", "ok": true, "library": cuda.path, "driver_version": version, "devices": found}),
    );
    let sms = found[0]["sms"].as_u64().unwrap_or(1) as u32;
    let mut ok = true;
    let mut context: Context = std::ptr::null_mut();
    let mut device = 0;
    // SAFETY: device 0 exists (the driver listed it); the context is current on this thread.
    let created = unsafe { cuda.check((cuda.device_get)(&mut device, 0), "cuDeviceGet") }
        .and_then(|()| unsafe { cuda.check((cuda.ctx_create)(&mut context, 0, device), "cuCtxCreate") });
    if let Err(e) = created {
        emit(json!({"event": "context", "ok": false, "error": e}));
        emit(json!({"event": "done", "ok": false}));
        return;
    }
    for mib in &args.alloc_mib {
        let mut ptr: DevicePtr = 0;
        let bytes = (*mib as usize) << 20;
        // SAFETY: the allocation is `bytes` long and set in 4-byte words; it is kept until the
        // process ends (the driver frees it then).
        let done = unsafe {
            cuda.check((cuda.mem_alloc)(&mut ptr, bytes), "cuMemAlloc")
                .and_then(|()| cuda.check((cuda.memset_d32)(ptr, 0x5a5a_5a5a, bytes / 4), "cuMemsetD32"))
        };
        emit(json!({"event": "alloc", "mib": mib, "ok": done.is_ok(), "error": done.err()}));
    }
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two sizes.
    if unsafe { (cuda.mem_get_info)(&mut free, &mut total) } == 0 {
        emit(json!({"event": "mem", "free_mib": free >> 20, "total_mib": total >> 20}));
    }
    if args.load_seconds > 0.0 {
        let start = Instant::now();
        let ran = load(&cuda, sms, args.load_seconds);
        ok &= ran.is_ok();
        emit(json!({
            "event": "load", "ok": ran.is_ok(), "seconds": start.elapsed().as_secs_f64(),
            "launches": ran.as_ref().ok(), "error": ran.err(),
        }));
    }
    hold(args.hold_seconds);
    emit(json!({"event": "done", "ok": ok}));
}

/// Sleeps `seconds` (none when 0), saying so first.
fn hold(seconds: f64) {
    if seconds > 0.0 {
        emit(json!({"event": "holding", "seconds": seconds}));
        std::thread::sleep(Duration::from_secs_f64(seconds));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_reads_as_nvidia_smi_prints_it() {
        let bytes =
            [0xa0, 0x1c, 0x85, 0x42, 0xd1, 0x32, 0x6d, 0xe9, 0xc4, 0x70, 0x6f, 0x39, 0xfd, 0x14, 0x07, 0xb3];
        assert_eq!(uuid(&bytes), "GPU-a01c8542-d132-6de9-c470-6f39fd1407b3");
    }

    #[test]
    fn flags_repeat_and_unknown_ones_are_refused() {
        let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let args = parse(&words("--alloc-mib 16 --alloc-mib 32 --load-seconds 1.5")).unwrap();
        assert_eq!(args, Args { alloc_mib: vec![16, 32], load_seconds: 1.5, hold_seconds: 0.0 });
        assert!(parse(&words("--bogus 1")).unwrap_err().contains("unknown flag --bogus"));
        assert!(parse(&words("--alloc-mib x")).unwrap_err().contains("not a number"));
        assert!(parse(&words("--hold-seconds")).unwrap_err().contains("needs a value"));
    }

    #[test]
    fn no_library_is_an_error_that_names_what_was_tried() {
        let missing = vec!["/nonexistent/libcuda.so.1".to_owned()];
        let err = Cuda::load(&missing).err().expect("loaded a library that does not exist");
        assert!(err.contains("/nonexistent/libcuda.so.1"), "{err}");
    }
}
