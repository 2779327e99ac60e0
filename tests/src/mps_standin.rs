//! What the MPS stand-ins share (`nvidia-cuda-mps-control`, the control daemon; `gpu-use`, a CUDA
//! process that finds one and becomes its client): the daemon's defaults, kept in its pipe directory,
//! and the limits a client ends up with. As NVIDIA documents, and as an H200 showed
//! (`hack/gpu-check.sh`), the daemon's defaults are ceilings: a client's own
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` may lower them, never
//! raise them. Both come from the client's own environment, which its process may change.

use std::path::Path;

/// The daemon's default active-thread percentage, in its pipe directory (absent: 100).
pub const DEFAULT_THREADS: &str = "default-active-thread-percentage";

/// The daemon's default pinned memory limit, `DEV VALUE` as it was set, in its pipe directory
/// (absent: none).
pub const DEFAULT_MEMORY: &str = "default-device-pinned-mem-limit";

/// A limit as MPS spells it (`2048M`, `2G`, `1024K`, or bytes), in MiB.
pub fn mib(value: &str) -> Option<u64> {
    let value = value.trim();
    let (digits, unit) = value.split_at(value.find(|c: char| !c.is_ascii_digit()).unwrap_or(value.len()));
    let n: u64 = digits.parse().ok()?;
    match unit {
        "G" | "g" => n.checked_mul(1024),
        "M" | "m" => Some(n),
        "K" | "k" => Some(n / 1024),
        "" => Some(n >> 20),
        _ => None,
    }
}

/// What an MPS client of the daemon in `pipe` gets: its active-thread percentage and its pinned
/// memory limit on device 0 in MiB (`None`: unlimited), from the daemon's defaults lowered by
/// `threads_env` and `memory_env` (the client's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, e.g. `0=2048M`).
pub fn client_limits(pipe: &Path, threads_env: Option<&str>, memory_env: Option<&str>) -> (f64, Option<u64>) {
    let default_threads = std::fs::read_to_string(pipe.join(DEFAULT_THREADS))
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    let threads = threads_env
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(default_threads, |t| t.min(default_threads));
    let default_memory = std::fs::read_to_string(pipe.join(DEFAULT_MEMORY)).ok().and_then(|v| {
        let mut words = v.split_whitespace();
        (words.next() == Some("0")).then(|| words.next().and_then(mib)).flatten()
    });
    let own =
        memory_env.and_then(|v| v.split(',').find_map(|entry| entry.trim().strip_prefix("0=").and_then(mib)));
    let memory = match (own, default_memory) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    (threads, memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_defaults_are_ceilings_the_clients_env_may_only_lower() {
        let pipe = std::env::temp_dir().join(format!("nano-gpu-mps-standin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pipe);
        std::fs::create_dir_all(&pipe).unwrap();
        // No defaults: the env is the limit, or nothing.
        assert_eq!(client_limits(&pipe, None, None), (100.0, None));
        assert_eq!(client_limits(&pipe, Some("30"), Some("0=2048M")), (30.0, Some(2048)));
        assert_eq!(client_limits(&pipe, Some("100"), None), (100.0, None));
        // Defaults set: a higher env value is capped, a lower one is kept.
        std::fs::write(pipe.join(DEFAULT_THREADS), "50").unwrap();
        std::fs::write(pipe.join(DEFAULT_MEMORY), "0 4G").unwrap();
        assert_eq!(client_limits(&pipe, Some("100"), Some("0=8192M")), (50.0, Some(4096)));
        assert_eq!(client_limits(&pipe, Some("20"), Some("0=1024M")), (20.0, Some(1024)));
        assert_eq!(client_limits(&pipe, None, None), (50.0, Some(4096)));
        assert_eq!(
            (mib("2G"), mib("512M"), mib("1048576"), mib("lots")),
            (Some(2048), Some(512), Some(1), None)
        );
    }
}
