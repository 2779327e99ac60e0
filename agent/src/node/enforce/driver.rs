//! The driver's per-cgroup GPU memory limit (NVML `nvmlDeviceSetMemoryLimits_v1`, driver r615 and
//! newer, cgroup v2), chosen by `--memory-limit driver`: a share's memory becomes a hard limit the
//! driver enforces (allocations past it fail), set on its pod's cgroup when the kubelet calls
//! PreStartContainer, before the container is created, so before any process of it runs.
//!
//! The limit is the pod's: what the pod holds on the card (the grants of its assignment that add
//! to it). The container's own cgroup does not exist before it is created, and the device plugin is
//! not called after that; a pod's containers share its limit, so one container of a pod can use
//! what another of the same pod was granted on that card, never what another pod was. Whole cards
//! get no limit. Support is detected at start (the driver's NVML has the function, and the cgroup
//! root is cgroup v2) and shown on the Node's `nano-gpu/memory-limit` label: `driver` (limits
//! set), `available` (the driver could, `--memory-limit none`), `unavailable`.

use crate::cards::inventory::Card;
use nano_gpu_nvml_limits::Library;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::units::MiB;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What `--memory-limit` asks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Asked {
    /// No memory limit beyond the enforcement mode's.
    #[default]
    None,
    /// The driver's per-cgroup limit; cards are served to nobody where the driver cannot set it.
    Driver,
}

/// The driver's limit on this node: its NVML and the host's cgroup v2 root.
pub struct DriverLimit {
    lib: Library,
    cgroup_root: PathBuf,
}

/// Whether shares get the driver's memory limit, as decided at start.
#[derive(Clone)]
pub enum MemoryLimit {
    /// Not asked; `available` says whether the driver could.
    Off {
        /// The driver and cgroups could set limits here.
        available: bool,
    },
    /// Every share's pod gets its limit.
    Driver(Arc<DriverLimit>),
    /// Asked, and not possible here (the reason): no NVIDIA card is served.
    Unavailable(String),
}

impl Default for MemoryLimit {
    fn default() -> Self {
        MemoryLimit::Off { available: false }
    }
}

impl std::fmt::Debug for MemoryLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryLimit::Off { available } => write!(f, "Off {{ available: {available} }}"),
            MemoryLimit::Driver(d) => write!(f, "Driver({})", d.cgroup_root.display()),
            MemoryLimit::Unavailable(why) => write!(f, "Unavailable({why:?})"),
        }
    }
}

impl PartialEq for MemoryLimit {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (MemoryLimit::Off { available: a }, MemoryLimit::Off { available: b }) => a == b,
            (MemoryLimit::Driver(a), MemoryLimit::Driver(b)) => Arc::ptr_eq(a, b),
            (MemoryLimit::Unavailable(a), MemoryLimit::Unavailable(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for MemoryLimit {}

/// The driver's limit through NVML at `nvml` on the cgroups under `cgroup_root`, or why it cannot
/// be set here.
pub fn detect(nvml: &Path, cgroup_root: &Path) -> Result<DriverLimit, String> {
    if !cgroup_root.join("cgroup.controllers").is_file() {
        return Err(format!(
            "{} is not a cgroup v2 root (no cgroup.controllers): the driver's memory limit needs cgroup v2",
            cgroup_root.display()
        ));
    }
    let lib = Library::open(nvml)?;
    Ok(DriverLimit { lib, cgroup_root: cgroup_root.to_owned() })
}

impl MemoryLimit {
    /// What `asked` comes to on this node ([`detect`]).
    pub fn decide(asked: Asked, nvml: &Path, cgroup_root: &Path) -> MemoryLimit {
        match (asked, detect(nvml, cgroup_root)) {
            (Asked::None, found) => MemoryLimit::Off { available: found.is_ok() },
            (Asked::Driver, Ok(limit)) => MemoryLimit::Driver(Arc::new(limit)),
            (Asked::Driver, Err(why)) => MemoryLimit::Unavailable(why),
        }
    }

    /// The Node label's value.
    pub fn label(&self) -> &'static str {
        match self {
            MemoryLimit::Off { available: true } => "available",
            MemoryLimit::Off { available: false } | MemoryLimit::Unavailable(_) => "unavailable",
            MemoryLimit::Driver(_) => nano_gpu_proto::annotations::MEMORY_LIMIT_DRIVER,
        }
    }

    /// Why shares of `card` cannot get their limit, if they cannot.
    pub fn refusal(&self, card: &Card) -> Option<String> {
        match self {
            _ if card.info.vendor != Vendor::Nvidia => None,
            MemoryLimit::Off { .. } => None,
            MemoryLimit::Unavailable(why) => Some(format!("memory limit driver: {why}")),
            MemoryLimit::Driver(_) if card.mig => {
                Some("memory limit driver: the driver does not limit memory on a card in MIG mode".into())
            }
            MemoryLimit::Driver(_) => None,
        }
    }
}

/// Sets a pod's memory limit on one card: the driver's ([`DriverLimit`]), or a test's record of it.
pub trait PodLimit: Send + Sync {
    /// Limits pod `uid` to `memory` on card `uuid`; returns the pod's cgroup. Blocks.
    fn limit_pod(&self, uuid: &str, uid: &str, memory: MiB) -> Result<PathBuf, String>;
}

impl PodLimit for DriverLimit {
    /// Soft and hard limit both `memory`: the allocator never promises the same memory twice.
    fn limit_pod(&self, uuid: &str, uid: &str, memory: MiB) -> Result<PathBuf, String> {
        let cgroup = pod_cgroup(&self.cgroup_root, uid)?;
        let bytes = memory.0.saturating_mul(1 << 20);
        self.lib.set(uuid, &cgroup, bytes, bytes)?;
        Ok(cgroup)
    }
}

/// How deep below the root a pod's cgroup may be (root / kubelet's cgroup root / kubepods / QoS / pod).
const POD_DEPTH: usize = 5;

/// The cgroup of pod `uid` under `root`: the kubelet names it `pod<uid>` (cgroupfs driver) or
/// `kubepods-<qos>-pod<uid, '-' as '_'>.slice` (systemd driver), a few levels below the root.
pub fn pod_cgroup(root: &Path, uid: &str) -> Result<PathBuf, String> {
    let plain = format!("pod{uid}");
    let systemd = format!("-pod{}.slice", uid.replace('-', "_"));
    let mut level = vec![root.to_owned()];
    for _ in 0..POD_DEPTH {
        let mut next = Vec::new();
        for dir in &level {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            for entry in entries.flatten() {
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name == plain || name.ends_with(&systemd) {
                    return Ok(entry.path());
                }
                // Containers' scopes and other pods hold no pod.
                if !name.ends_with(".scope") && !name.starts_with("pod") && !name.contains("-pod") {
                    next.push(entry.path());
                }
            }
        }
        level = next;
    }
    Err(format!("no cgroup of pod {uid} under {} (is it the host's cgroup root?)", root.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::annotations::GpuInfo;

    fn tree(dirs: &[&str]) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("nano-gpu-cgroups-{}-{}", std::process::id(), dirs.len()));
        let _ = std::fs::remove_dir_all(&root);
        for d in dirs {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        root
    }

    #[test]
    fn a_pods_cgroup_is_found_under_either_cgroup_driver() {
        let uid = "6f1c2d3e-0000-4a4a-9b9b-123456789abc";
        let root = tree(&[
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6f1c2d3e_0000_4a4a_9b9b_123456789abc.slice/cri-containerd-ab.scope",
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod11111111_0000_4a4a_9b9b_123456789abc.slice",
            "system.slice/containerd.service",
        ]);
        let found = pod_cgroup(&root, uid).unwrap();
        assert!(
            found.ends_with("kubepods-burstable-pod6f1c2d3e_0000_4a4a_9b9b_123456789abc.slice"),
            "{found:?}"
        );
        std::fs::remove_dir_all(&root).unwrap();
        let root = tree(&[
            "nano-gpu-x-node-1/kubepods/besteffort/pod6f1c2d3e-0000-4a4a-9b9b-123456789abc/0123",
            "a",
        ]);
        assert!(
            pod_cgroup(&root, uid).unwrap().ends_with("besteffort/pod6f1c2d3e-0000-4a4a-9b9b-123456789abc")
        );
        let e = pod_cgroup(&root, "00000000-0000-0000-0000-000000000000").unwrap_err();
        assert!(e.contains("no cgroup of pod 00000000"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn support_needs_cgroup_v2_and_the_drivers_function() {
        let root = tree(&["v1/cpu", "v2/kubepods.slice", "v2b/x", "v2c/y"]);
        let e = detect(Path::new("libnvidia-ml.so.1"), &root.join("v1")).err().unwrap();
        assert!(e.contains("not a cgroup v2 root"), "{e}");
        std::fs::write(root.join("v2/cgroup.controllers"), "cpu memory misc\n").unwrap();
        // A library without NVML's functions: the C library every process has loaded.
        let e = detect(Path::new("libc.so.6"), &root.join("v2")).err().unwrap();
        assert!(e.contains("has no nvmlInit_v2") && e.contains("r615"), "{e}");
        let limit = MemoryLimit::decide(Asked::Driver, Path::new("libc.so.6"), &root.join("v2"));
        assert_eq!(limit.label(), "unavailable");
        assert_eq!(
            MemoryLimit::decide(Asked::None, Path::new("libc.so.6"), &root.join("v2")).label(),
            "unavailable"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn asked_and_unavailable_serves_no_nvidia_card_and_mig_is_refused() {
        let card = |vendor, mig| Card {
            info: GpuInfo {
                index: 0,
                uuid: "GPU-a".into(),
                vendor,
                model: "m".into(),
                memory_mib: MiB(1024),
                healthy: true,
                numa: None,
            },
            device_nodes: vec![],
            pci_address: None,
            fault: None,
            mig,
        };
        let unavailable = MemoryLimit::Unavailable("no cgroup v2".into());
        let mut cards = vec![card(Vendor::Nvidia, false), card(Vendor::Intel, false)];
        crate::cards::health::refuse(&mut cards, |c| unavailable.refusal(c));
        assert!(!cards[0].info.healthy && cards[0].fault.as_deref().unwrap().contains("no cgroup v2"));
        assert!(cards[1].info.healthy, "an Intel card is not the driver's to limit");
        assert_eq!(MemoryLimit::Off { available: true }.refusal(&card(Vendor::Nvidia, true)), None);
    }
}
