//! NVIDIA cards through NVML (nvml-wrapper), loaded at run time from a configurable library path, so
//! a node without the driver runs (with no NVIDIA cards) and says why.
//!
//! One card that NVML cannot read (it fell off the bus, its handle or a query fails) does not take the
//! others with it: it is served as the card last read at that index, unhealthy, with the error as its
//! fault; a card never read yet is left out (and logged) until it can be. NVML calls block: callers
//! on an async runtime run [`NvmlInventory::cards`] on a blocking thread.

use super::{Card, CardSample, GpuInventory, InventoryError, ProcessSample};
use nano_gpu_proto::units::MiB;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// NVML, initialised on first use and kept (a failed start is retried on the next read), and the
/// cards last read, by index.
pub struct NvmlInventory {
    lib: PathBuf,
    /// Where the card's NUMA node is read (`<sysfs>/bus/pci/devices/<address>/numa_node`), if anywhere.
    sysfs: Option<PathBuf>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    nvml: Option<Nvml>,
    last: Vec<Option<Card>>,
    /// Per card index, the newest process-utilisation sample read (NVML's µs clock), so each
    /// sampling pass asks only for what is new.
    seen: Vec<u64>,
}

/// NVML from `lib`, started now if it was not (a failed start is retried next time).
fn started<'a>(nvml: &'a mut Option<Nvml>, lib: &std::path::Path) -> Result<&'a Nvml, NvmlError> {
    if nvml.is_none() {
        *nvml = Some(Nvml::builder().lib_path(lib.as_os_str()).init()?);
    }
    nvml.as_ref().ok_or(NvmlError::Uninitialized)
}

impl NvmlInventory {
    /// NVML from `lib` (`libnvidia-ml.so.1` resolves through the loader's search path).
    pub fn new(lib: PathBuf) -> Self {
        NvmlInventory { lib, sysfs: None, state: Mutex::new(State::default()) }
    }

    /// The same, reading each card's NUMA node from the sysfs tree at `root` (the host's `/sys`);
    /// without it the NUMA node is left unknown.
    pub fn with_sysfs(self, root: PathBuf) -> Self {
        NvmlInventory { sysfs: Some(root), ..self }
    }

    /// Card `index`, or why it cannot be read.
    fn card(nvml: &Nvml, sysfs: Option<&std::path::Path>, index: u32) -> Result<Card, String> {
        let d = nvml.device_by_index(index).map_err(|e| format!("device {index}: {e}"))?;
        let field = |what: &str, e: nvml_wrapper::error::NvmlError| format!("device {index} {what}: {e}");
        let uuid = d.uuid().map_err(|e| field("uuid", e))?;
        let model = d.name().map_err(|e| field("name", e))?;
        let memory = d.memory_info().map_err(|e| field("memory", e))?.total >> 20;
        let pci_address = d.pci_info().ok().map(|p| p.bus_id);
        // A card without MIG answers "not supported"; only a card that says so is in MIG mode.
        let mig = d.mig_mode().is_ok_and(|m| m.current == 1);
        let numa = sysfs.zip(pci_address.as_deref()).and_then(|(root, a)| numa_node(root, a));
        let mut card = Card { mig, ..Card::nvidia(index, uuid, model, MiB(memory), pci_address) };
        card.info.numa = numa;
        Ok(card)
    }

    fn invalid(&self, message: impl std::fmt::Display) -> InventoryError {
        InventoryError::Invalid { path: self.lib.clone(), message: message.to_string() }
    }

    /// What card `index` is doing; utilisation, temperature and power a card does not report are
    /// left out, a process list it cannot give is empty.
    fn sample_card(nvml: &Nvml, index: u32, seen: &mut u64) -> Result<CardSample, String> {
        let d = nvml.device_by_index(index).map_err(|e| format!("device {index}: {e}"))?;
        let uuid = d.uuid().map_err(|e| format!("device {index} uuid: {e}"))?;
        let memory = d.memory_info().map_err(|e| format!("device {index} memory: {e}"))?;
        let mut sm: HashMap<u32, (u64, u32)> = HashMap::new();
        match d.process_utilization_stats(Some(*seen).filter(|s| *s > 0)) {
            Ok(samples) => {
                for s in samples {
                    *seen = (*seen).max(s.timestamp);
                    let newest = sm.entry(s.pid).or_insert((s.timestamp, s.sm_util));
                    if s.timestamp >= newest.0 {
                        *newest = (s.timestamp, s.sm_util);
                    }
                }
            }
            // No process was busy since the last pass.
            Err(NvmlError::NotFound) => {}
            Err(e) => tracing::debug!(index, error = %e, "process utilisation not available"),
        }
        let mut processes = match d.running_compute_processes() {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(index, error = %e, "running processes not available");
                Vec::new()
            }
        };
        // Under MPS (Volta and newer) NVML lists the clients apart, each with its own memory.
        match d.mps_running_compute_processes() {
            Ok(clients) => {
                let known: std::collections::HashSet<u32> = processes.iter().map(|p| p.pid).collect();
                processes.extend(clients.into_iter().filter(|c| !known.contains(&c.pid)));
            }
            Err(e) => tracing::debug!(index, error = %e, "MPS clients not available"),
        }
        let processes = processes
            .into_iter()
            .map(|p| ProcessSample {
                pid: p.pid,
                memory: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(MiB(bytes >> 20)),
                    UsedGpuMemory::Unavailable => None,
                },
                sm: sm.get(&p.pid).map(|(_, u)| *u),
            })
            .collect();
        Ok(CardSample {
            uuid,
            index,
            memory_used: MiB(memory.used >> 20),
            memory_total: MiB(memory.total >> 20),
            utilization: d.utilization_rates().ok().map(|u| u.gpu),
            temperature: d.temperature(TemperatureSensor::Gpu).ok(),
            power_mw: d.power_usage().ok(),
            processes,
        })
    }
}

/// The NUMA node of the PCI device NVML names `bus_id` (`00000000:3B:00.0`: an 8-digit domain,
/// upper case), read from its sysfs directory (`0000:3b:00.0`).
fn numa_node(sysfs: &std::path::Path, bus_id: &str) -> Option<u32> {
    let (domain, rest) = bus_id.split_once(':')?;
    let domain = domain.get(domain.len().checked_sub(4)?..)?;
    let address = format!("{domain}:{rest}").to_ascii_lowercase();
    super::numa_node(&sysfs.join("bus/pci/devices").join(address))
}

impl GpuInventory for NvmlInventory {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn cards(&self) -> Result<Vec<Card>, InventoryError> {
        let mut guard = self.state.lock().map_err(|_| self.invalid("NVML state poisoned"))?;
        let state = &mut *guard;
        let nvml = started(&mut state.nvml, &self.lib).map_err(|e| self.invalid(e))?;
        let count = nvml.device_count().map_err(|e| self.invalid(e))?;
        state.last.resize(count as usize, None);
        let mut cards = Vec::with_capacity(count as usize);
        for (index, last) in (0..count).zip(state.last.iter_mut()) {
            match Self::card(nvml, self.sysfs.as_deref(), index) {
                Ok(card) => {
                    if last.as_ref().is_some_and(|c| c.fault.is_some()) {
                        tracing::info!(gpu = %card.info.uuid, "card readable again");
                    }
                    *last = Some(card.clone());
                    cards.push(card);
                }
                Err(fault) => match last {
                    Some(known) => {
                        if known.fault.as_ref() != Some(&fault) {
                            tracing::warn!(gpu = %known.info.uuid, %fault, "card cannot be read; served as unhealthy");
                        }
                        known.info.healthy = false;
                        known.fault = Some(fault);
                        cards.push(known.clone());
                    }
                    None => {
                        tracing::warn!(index, %fault, "card cannot be read and was never read before; left out")
                    }
                },
            }
        }
        Ok(cards)
    }

    fn sample(&self) -> Result<Vec<CardSample>, InventoryError> {
        let mut guard = self.state.lock().map_err(|_| self.invalid("NVML state poisoned"))?;
        let state = &mut *guard;
        let nvml = started(&mut state.nvml, &self.lib).map_err(|e| self.invalid(e))?;
        let count = nvml.device_count().map_err(|e| self.invalid(e))?;
        state.seen.resize(count as usize, 0);
        let mut samples = Vec::with_capacity(count as usize);
        for (index, seen) in (0..count).zip(state.seen.iter_mut()) {
            // A card that cannot be read is reported by the inventory (unhealthy, with its fault).
            match Self::sample_card(nvml, index, seen) {
                Ok(s) => samples.push(s),
                Err(fault) => tracing::debug!(index, %fault, "card not sampled"),
            }
        }
        Ok(samples)
    }
}

#[cfg(test)]
mod tests {
    use super::numa_node;

    #[test]
    fn the_numa_node_is_read_from_sysfs_at_the_address_nvml_names() {
        let root = std::env::temp_dir().join(format!("nano-gpu-numa-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let device = |address: &str, numa: &str| {
            let dir = root.join("bus/pci/devices").join(address);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), numa).unwrap();
        };
        device("0000:3b:00.0", "1\n");
        device("0000:af:00.0", "-1\n");
        assert_eq!(numa_node(&root, "00000000:3B:00.0"), Some(1));
        assert_eq!(numa_node(&root, "00000000:AF:00.0"), None, "-1: the firmware does not tell");
        assert_eq!(numa_node(&root, "00000000:01:00.0"), None, "no such device");
        assert_eq!(numa_node(&root, "garbage"), None);
        assert_eq!(numa_node(&root, "0:01:00.0"), None, "a domain shorter than sysfs's");
        let _ = std::fs::remove_dir_all(&root);
    }
}
