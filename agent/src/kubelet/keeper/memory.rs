//! The agent's memory, as the keeper watches it.
//!
//! On cgroup v2 the kubelet (1.28 and later, unless its `singleProcessOOMKill` is set) has the
//! kernel kill every process of a container that reaches the container's memory limit, not only the
//! largest one. An agent that grew to the agent container's limit would take the keeper with it, and
//! with the keeper the kubelet's side of the plugins: the kubelet then fails the pods it admits until
//! the container is back. So the keeper stops an agent whose memory reaches a ceiling below the
//! limit, and starts it again as after any crash, holding the kubelet's calls meanwhile. An agent that
//! takes more than the margin in one step, between two readings, still meets the kernel first.

use std::path::Path;
use std::time::Duration;

/// How often the agent's memory is read.
pub const PERIOD: Duration = Duration::from_millis(250);

/// The least margin kept under the limit.
const LEAST_MARGIN: u64 = 8 << 20;

/// The agent's memory ceiling, from the container's memory limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guard {
    /// The container's memory limit, bytes.
    pub limit: u64,
    /// How often the agent's memory is read.
    pub period: Duration,
}

impl Guard {
    /// A guard for a container whose limit is `limit` bytes, read every [`PERIOD`].
    pub fn new(limit: u64) -> Guard {
        Guard { limit, period: PERIOD }
    }

    /// What is kept free under the limit: an eighth of it, at least 8 MiB.
    pub fn margin(&self) -> u64 {
        (self.limit / 8).max(LEAST_MARGIN)
    }

    /// What the agent may hold while the keeper holds `keeper` bytes: the limit less both and the
    /// margin.
    pub fn ceiling(&self, keeper: u64) -> u64 {
        self.limit.saturating_sub(keeper).saturating_sub(self.margin())
    }
}

/// The memory limit of this process's cgroup (v2: `memory.max` of the cgroup `/proc/self/cgroup`
/// names, under the cgroup filesystem mounted at `root`); None when it has none (`max`) or the
/// files are not there (cgroup v1, no cgroup filesystem in the container).
pub fn own_limit(root: &Path) -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit(root, &own)
}

/// The limit of the cgroup `own` (a `/proc/PID/cgroup` text) names, under `root`.
fn cgroup_limit(root: &Path, own: &str) -> Option<u64> {
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let file = root.join(path.trim_start_matches('/')).join("memory.max");
    parse_max(&std::fs::read_to_string(file).ok()?)
}

/// A `memory.max` value: bytes, or None for `max` (no limit) and anything unreadable.
fn parse_max(text: &str) -> Option<u64> {
    match text.trim() {
        "max" => None,
        t => t.parse().ok(),
    }
}

/// The memory of process `pid` that only its end gives back, bytes: its anonymous and shared
/// memory pages (`RssAnon` and `RssShmem` of `/proc/PID/status`; its mapped files the kernel may
/// reclaim). None when the process is gone.
pub fn held(pid: u32) -> Option<u64> {
    parse_status(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// `RssAnon` + `RssShmem` of a `/proc/PID/status` text, bytes.
fn parse_status(status: &str) -> Option<u64> {
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
    };
    Some((kib("RssAnon:")? + kib("RssShmem:").unwrap_or(0)) * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_leaves_the_keeper_its_memory_and_a_margin() {
        let mib = 1 << 20;
        let g = Guard::new(128 * mib);
        assert_eq!(g.margin(), 16 * mib);
        assert_eq!(g.ceiling(12 * mib), 100 * mib);
        // A small limit keeps 8 MiB; a keeper over the limit leaves the agent nothing.
        assert_eq!(Guard::new(32 * mib).ceiling(4 * mib), 20 * mib);
        assert_eq!(Guard::new(32 * mib).ceiling(64 * mib), 0);
    }

    #[test]
    fn the_limit_is_the_own_cgroups_memory_max_and_none_for_max_or_v1() {
        let root = std::env::temp_dir().join(format!("nano-gpu-memory-max-{}", std::process::id()));
        let own = root.join("kubepods.slice/pod-a.slice/cri-b.scope");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(own.join("memory.max"), "134217728\n").unwrap();
        let text = "0::/kubepods.slice/pod-a.slice/cri-b.scope\n";
        assert_eq!(cgroup_limit(&root, text), Some(134_217_728));
        // In a cgroup namespace the container's cgroup is the root.
        std::fs::write(root.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit(&root, "0::/\n"), None);
        std::fs::write(root.join("memory.max"), "67108864\n").unwrap();
        assert_eq!(cgroup_limit(&root, "0::/\n"), Some(67_108_864));
        // cgroup v1 lines only, or a cgroup without the file.
        assert_eq!(cgroup_limit(&root, "4:memory:/kubepods/pod-a\n"), None);
        assert_eq!(cgroup_limit(&root, "0::/elsewhere\n"), None);
        assert_eq!(parse_max("garbage"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn held_memory_is_anonymous_and_shared_pages() {
        let status = "Name:\tagent\nVmRSS:\t   30000 kB\nRssAnon:\t   20000 kB\nRssFile:\t    9000 kB\nRssShmem:\t    1000 kB\n";
        assert_eq!(parse_status(status), Some(21_000 * 1024));
        assert_eq!(parse_status("Name:\tkthread\n"), None);
        // This process is real and holds some.
        assert!(held(std::process::id()).is_some_and(|b| b > 0));
    }
}
