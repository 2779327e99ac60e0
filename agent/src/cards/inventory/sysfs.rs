//! Intel cards from sysfs drm, as Intel's own device plugin reads them: `class/drm/cardN` (exactly
//! `card<digits>`), vendor `0x8086`, a `device/drm` directory (a real device, not a connector), not an
//! SR-IOV physical function with virtual functions enabled; the driver (`i915` or `xe`) from the
//! `device/driver` link, the PCI address from the `device` link, local memory from `lmem_total_bytes`
//! where the driver reports it, NUMA node from `device/numa_node`, and the device nodes (`cardN`,
//! `renderD*`) from `device/drm/`.

use super::fdinfo::Sampler;
use super::{Card, CardSample, GpuInventory, InventoryError, ProcessSample};
use nano_gpu_proto::annotations::{GpuInfo, Vendor};
use nano_gpu_proto::units::MiB;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The sysfs drm reader.
pub struct SysfsDrm {
    /// The sysfs mount (`/sys`).
    pub sysfs_root: PathBuf,
    /// Where device nodes live (`/dev`).
    pub dev_root: PathBuf,
    /// The host's processes (`/proc`), whose DRM fdinfo says who uses which card.
    pub proc_root: PathBuf,
    /// The last fdinfo scan, for utilisation.
    pub usage: Mutex<Sampler>,
}

impl SysfsDrm {
    /// A reader of the cards under `sysfs_root`, their nodes under `dev_root` and their users'
    /// fdinfo under `proc_root`.
    pub fn new(sysfs_root: PathBuf, dev_root: PathBuf, proc_root: PathBuf) -> Self {
        SysfsDrm { sysfs_root, dev_root, proc_root, usage: Mutex::new(Sampler::default()) }
    }
}

const INTEL: &str = "0x8086";

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

fn link_name(path: &Path) -> Option<String> {
    std::fs::read_link(path).ok()?.file_name()?.to_str().map(str::to_owned)
}

impl SysfsDrm {
    fn card(&self, dir: &Path, number: u32) -> Option<Card> {
        let device = dir.join("device");
        if read_trimmed(&device.join("vendor")).as_deref() != Some(INTEL) || !device.join("drm").is_dir() {
            return None;
        }
        if read_trimmed(&device.join("sriov_numvfs")).and_then(|v| v.parse::<i64>().ok()).unwrap_or(0) > 0 {
            return None; // a physical function whose virtual functions are the schedulable cards
        }
        let driver = link_name(&device.join("driver")).unwrap_or_else(|| "i915".to_owned());
        let device_id = read_trimmed(&device.join("device")).unwrap_or_default();
        let pci_address = link_name(&device);
        let memory =
            read_trimmed(&dir.join("lmem_total_bytes")).and_then(|b| b.parse::<u64>().ok()).unwrap_or(0)
                >> 20;
        let numa = super::numa_node(&device);
        let mut device_nodes: Vec<PathBuf> = std::fs::read_dir(device.join("drm"))
            .ok()?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| !n.starts_with("controlD"))
            .map(|n| self.dev_root.join("dri").join(n))
            .collect();
        device_nodes.sort();
        let uuid = format!("intel-{}", pci_address.clone().unwrap_or_else(|| format!("card{number}")));
        Some(Card {
            info: GpuInfo {
                index: number,
                uuid,
                vendor: Vendor::Intel,
                model: format!("Intel {device_id} ({driver})"),
                memory_mib: MiB(memory),
                healthy: true,
                numa,
            },
            device_nodes,
            pci_address,
            fault: None,
            mig: false,
        })
    }
}

impl GpuInventory for SysfsDrm {
    fn name(&self) -> &'static str {
        "sysfs-drm"
    }

    fn cards(&self) -> Result<Vec<Card>, InventoryError> {
        let class = self.sysfs_root.join("class/drm");
        let entries = match std::fs::read_dir(&class) {
            Ok(e) => e,
            // No drm class at all: no Intel cards, not an error.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(InventoryError::Io { path: class, source }),
        };
        let mut cards: Vec<Card> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let number: u32 = name.strip_prefix("card")?.parse().ok()?;
                self.card(&e.path(), number)
            })
            .collect();
        cards.sort_by_key(|c| c.info.index);
        Ok(cards)
    }

    /// Each card's users from their DRM fdinfo ([`super::fdinfo`]): memory is the device memory
    /// its clients hold (a card without a local-memory size says 0 of 0), utilisation from the
    /// second sample on.
    fn sample(&self) -> Result<Vec<CardSample>, InventoryError> {
        let cards = self.cards()?;
        if cards.is_empty() {
            return Ok(Vec::new()); // no Intel card: no process scan
        }
        let mut sampler = self.usage.lock().unwrap_or_else(|e| e.into_inner());
        let timed = sampler.timed();
        let mut users = sampler.sample(&self.proc_root);
        Ok(cards
            .into_iter()
            .map(|c| {
                let (uses, busy) = c.pci_address.as_ref().and_then(|a| users.remove(a)).unwrap_or_default();
                CardSample {
                    uuid: c.info.uuid,
                    index: c.info.index,
                    memory_used: MiB(uses.iter().map(|u| u.memory.0).sum()),
                    memory_total: c.info.memory_mib,
                    utilization: if timed { Some(busy.unwrap_or(0)) } else { None },
                    temperature: None,
                    power_mw: None,
                    processes: uses
                        .into_iter()
                        .map(|u| ProcessSample { pid: u.pid, memory: Some(u.memory), sm: u.busy })
                        .collect(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake sysfs tree with one card: `class/drm/card<n>` and its PCI device directory.
    fn card(root: &Path, n: u32, pci: &str, driver: &str, vendor: &str, lmem: Option<u64>) {
        let dev = root.join("devices/pci0000:00").join(pci);
        std::fs::create_dir_all(dev.join("drm").join(format!("card{n}"))).unwrap();
        std::fs::create_dir_all(dev.join("drm").join(format!("renderD{}", 128 + n))).unwrap();
        std::fs::create_dir_all(dev.join("drm").join(format!("controlD{}", 64 + n))).unwrap();
        std::fs::write(dev.join("vendor"), format!("{vendor}\n")).unwrap();
        std::fs::write(dev.join("device"), "0x56c0\n").unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        let drivers = root.join("bus/pci/drivers").join(driver);
        std::fs::create_dir_all(&drivers).unwrap();
        symlink(&drivers, dev.join("driver")).unwrap();
        let class = root.join("class/drm").join(format!("card{n}"));
        std::fs::create_dir_all(&class).unwrap();
        symlink(&dev, class.join("device")).unwrap();
        if let Some(bytes) = lmem {
            std::fs::write(class.join("lmem_total_bytes"), bytes.to_string()).unwrap();
        }
    }

    fn tree(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("nano-gpu-sysfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("class/drm")).unwrap();
        root
    }

    #[test]
    fn an_i915_and_an_xe_card_are_read_with_their_device_nodes() {
        let root = tree("two");
        card(&root, 0, "0000:03:00.0", "i915", "0x8086", Some(16 << 30));
        card(&root, 1, "0000:4d:00.0", "xe", "0x8086", None);
        // A connector and a non-Intel card are not cards.
        std::fs::create_dir_all(root.join("class/drm/card0-DP-1")).unwrap();
        card(&root, 2, "0000:65:00.0", "nvidia", "0x10de", None);
        let reader = SysfsDrm::new(root.clone(), PathBuf::from("/dev"), root.join("proc"));
        let cards = reader.cards().unwrap();
        assert_eq!(cards.len(), 2);
        let (i915, xe) = (&cards[0], &cards[1]);
        assert_eq!(i915.info.uuid, "intel-0000:03:00.0");
        assert_eq!(i915.info.model, "Intel 0x56c0 (i915)");
        assert_eq!((i915.info.memory_mib, i915.info.numa), (MiB(16384), Some(1)));
        assert_eq!(
            i915.device_nodes,
            vec![PathBuf::from("/dev/dri/card0"), PathBuf::from("/dev/dri/renderD128")]
        );
        assert_eq!((xe.info.model.as_str(), xe.info.memory_mib), ("Intel 0x56c0 (xe)", MiB(0)));
        assert_eq!(xe.pci_address.as_deref(), Some("0000:4d:00.0"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn each_card_is_sampled_with_the_processes_that_have_it_open() {
        let root = tree("users");
        card(&root, 0, "0000:03:00.0", "i915", "0x8086", Some(16 << 30));
        card(&root, 1, "0000:4d:00.0", "xe", "0x8086", None);
        let busy = |ns: u64| {
            format!(
                "drm-driver:\ti915\ndrm-client-id:\t3\ndrm-pdev:\t0000:03:00.0\ndrm-resident-local0:\t2048 MiB\ndrm-engine-compute:\t{ns} ns\n"
            )
        };
        let procs = root.join("proc");
        super::super::fdinfo::tests::write(&procs, 4242, 5, &busy(0));
        let reader = SysfsDrm::new(root.clone(), PathBuf::from("/dev"), root.join("proc"));
        let first = reader.sample().unwrap();
        assert_eq!(first.len(), 2);
        let (i915, xe) = (&first[0], &first[1]);
        assert_eq!((i915.memory_used, i915.memory_total, i915.utilization), (MiB(2048), MiB(16384), None));
        assert_eq!(i915.processes, vec![ProcessSample { pid: 4242, memory: Some(MiB(2048)), sm: None }]);
        assert!(xe.processes.is_empty());
        // The compute engine busy the whole time since (and more: clamped).
        super::super::fdinfo::tests::write(&procs, 4242, 5, &busy(u64::MAX / 2));
        let second = reader.sample().unwrap();
        assert_eq!((second[0].utilization, second[0].processes[0].sm), (Some(100), Some(100)));
        assert_eq!(second[1].utilization, Some(0));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_physical_function_with_virtual_functions_is_skipped() {
        let root = tree("sriov");
        card(&root, 0, "0000:03:00.0", "i915", "0x8086", None);
        std::fs::write(root.join("devices/pci0000:00/0000:03:00.0/sriov_numvfs"), "4\n").unwrap();
        let reader = SysfsDrm::new(root.clone(), PathBuf::from("/dev"), root.join("proc"));
        assert!(reader.cards().unwrap().is_empty());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn no_drm_class_means_no_cards() {
        let reader = SysfsDrm::new(
            PathBuf::from("/nonexistent-sysfs"),
            PathBuf::from("/dev"),
            PathBuf::from("/nonexistent-proc"),
        );
        assert!(reader.cards().unwrap().is_empty());
    }
}
