//! Helpers shared by the cross-crate tests and benchmarks in `tests/`: where the shared data lives,
//! a fake API server, the local cluster as the end-to-end tests drive it, and a small HTTP client for
//! driving the extender.

pub mod browser;
pub mod checks;
pub mod cluster;
pub mod fake_api;
pub mod fake_kubelet;
pub mod http_client;
pub mod kubelet_log;
pub mod monitoring;
pub mod mps_standin;
pub mod variants;

use std::path::PathBuf;

/// The openb trace folder: `$NANO_GPU_SHARED/traces/openb`, by default `../shared` beside the repository.
pub fn openb_dir() -> PathBuf {
    let shared = std::env::var_os("NANO_GPU_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    shared.join("traces/openb")
}

/// A workspace binary built next to the running test or benchmark (`target/<profile>/<name>`).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// `libfakenvml.so` as cargo built it for the running test (a dev-dependency): next to the binaries,
/// or only among their deps after a cold build.
pub fn fake_nvml() -> PathBuf {
    let bin = workspace_binary("libfakenvml.so");
    let dir = bin.parent().map(PathBuf::from).unwrap_or_default();
    // A dependency build refreshes only `deps/`; a `cargo build` of the cdylib also copies it up. The
    // newer one is the library of the sources as they are.
    [bin, dir.join("deps/libfakenvml.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .expect("libfakenvml.so is built (fakenvml is a dev-dependency of the tests)")
}

/// Runs the test `test` of the running test binary again in a child process with `env` (the fake
/// NVML reads its configuration from the environment, which a test cannot set for itself), and
/// asserts it passed there.
pub fn run_test_in_child(test: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", test, "--nocapture"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("running the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "the child ran the test: {stdout}");
}

/// The `KEY=VALUE` lines of an env file the harness wrote (`cluster.env`, `control-plane.env`, ...).
pub fn read_env(path: &std::path::Path) -> std::collections::HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

/// The value after `--<flag>` on the command line of the running test tool, if given.
pub fn flag_value(flag: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|a| a != flag);
    args.next()?;
    args.next()
}

/// The 99th percentile (nearest rank) of samples; 0 for none.
pub fn p99(v: Vec<f64>) -> f64 {
    quantile(v, 0.99)
}

/// The `q` quantile (nearest rank) of samples; 0 for none.
pub fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64) * q).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

/// Peak resident memory of a process (VmHWM), in MiB; 0 when it cannot be read.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM:")
}

/// Resident memory of a process now (VmRSS), in MiB; 0 when it cannot be read.
pub fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS:")
}

/// A `/proc/<pid>/status` field given in kB, in MiB.
fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The fields of `/proc/<pid>/stat` after the command name (the state first); none when unreadable.
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    rest.split_whitespace().map(str::to_owned).collect()
}

/// Clock ticks per second, the unit of [`cpu_ticks`] (`USER_HZ`, 100 on Linux).
pub const TICKS_PER_S: f64 = 100.0;

/// CPU time (user + system) a process has used, in clock ticks (`/proc/<pid>/stat`); 0 when unreadable.
pub fn cpu_ticks(pid: u32) -> u64 {
    let fields = stat_fields(pid);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let get = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// This process's real user ID (`/proc/self/status`); `None` when unreadable.
pub fn own_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok())
}

/// The parent of a process (`/proc/<pid>/stat`); `None` when it is gone.
pub fn parent_pid(pid: u32) -> Option<u32> {
    stat_fields(pid).get(1)?.parse().ok()
}

/// The processes running now (the numbered entries of `/proc`).
pub fn pids() -> Vec<u32> {
    let entries = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    entries.filter_map(|e| e.file_name().to_string_lossy().parse().ok()).collect()
}

/// A child process killed (and reaped) when dropped, so a failing benchmark leaves nothing running.
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
