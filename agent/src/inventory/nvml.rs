//! NVIDIA cards through NVML (nvml-wrapper), loaded at run time from a configurable library path, so
//! a node without the driver runs (with no NVIDIA cards) and says why.

use super::{Card, GpuInventory, InventoryError};
use nano_gpu_proto::units::MiB;
use nvml_wrapper::Nvml;
use std::path::PathBuf;
use std::sync::Mutex;

/// NVML, initialised on first use and kept (a failed start is retried on the next read).
pub struct NvmlInventory {
    lib: PathBuf,
    nvml: Mutex<Option<Nvml>>,
}

impl NvmlInventory {
    /// NVML from `lib` (`libnvidia-ml.so.1` resolves through the loader's search path).
    pub fn new(lib: PathBuf) -> Self {
        NvmlInventory { lib, nvml: Mutex::new(None) }
    }

    fn invalid(&self, message: impl std::fmt::Display) -> InventoryError {
        InventoryError::Invalid { path: self.lib.clone(), message: message.to_string() }
    }
}

impl GpuInventory for NvmlInventory {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn cards(&self) -> Result<Vec<Card>, InventoryError> {
        let mut guard = self.nvml.lock().map_err(|_| self.invalid("NVML state poisoned"))?;
        if guard.is_none() {
            let nvml = Nvml::builder().lib_path(self.lib.as_os_str()).init().map_err(|e| self.invalid(e))?;
            *guard = Some(nvml);
        }
        let Some(nvml) = guard.as_ref() else { return Ok(Vec::new()) };
        let count = nvml.device_count().map_err(|e| self.invalid(e))?;
        let mut cards = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = nvml.device_by_index(index).map_err(|e| self.invalid(format!("device {index}: {e}")))?;
            let field = |what: &str, e: nvml_wrapper::error::NvmlError| {
                self.invalid(format!("device {index} {what}: {e}"))
            };
            let uuid = d.uuid().map_err(|e| field("uuid", e))?;
            let model = d.name().map_err(|e| field("name", e))?;
            let memory = d.memory_info().map_err(|e| field("memory", e))?.total >> 20;
            let pci_address = d.pci_info().ok().map(|p| p.bus_id);
            cards.push(Card::nvidia(index, uuid, model, MiB(memory), pci_address));
        }
        Ok(cards)
    }
}
