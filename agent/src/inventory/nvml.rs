//! NVIDIA cards through NVML (nvml-wrapper), loaded at run time from a configurable library path, so
//! a node without the driver runs (with no NVIDIA cards) and says why.
//!
//! One card that NVML cannot read (it fell off the bus, its handle or a query fails) does not take the
//! others with it: it is served as the card last read at that index, unhealthy, with the error as its
//! fault; a card never read yet is left out (and logged) until it can be. NVML calls block: callers
//! on an async runtime run [`NvmlInventory::cards`] on a blocking thread.

use super::{Card, GpuInventory, InventoryError};
use nano_gpu_proto::units::MiB;
use nvml_wrapper::Nvml;
use std::path::PathBuf;
use std::sync::Mutex;

/// NVML, initialised on first use and kept (a failed start is retried on the next read), and the
/// cards last read, by index.
pub struct NvmlInventory {
    lib: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    nvml: Option<Nvml>,
    last: Vec<Option<Card>>,
}

impl NvmlInventory {
    /// NVML from `lib` (`libnvidia-ml.so.1` resolves through the loader's search path).
    pub fn new(lib: PathBuf) -> Self {
        NvmlInventory { lib, state: Mutex::new(State::default()) }
    }

    /// Card `index`, or why it cannot be read.
    fn card(nvml: &Nvml, index: u32) -> Result<Card, String> {
        let d = nvml.device_by_index(index).map_err(|e| format!("device {index}: {e}"))?;
        let field = |what: &str, e: nvml_wrapper::error::NvmlError| format!("device {index} {what}: {e}");
        let uuid = d.uuid().map_err(|e| field("uuid", e))?;
        let model = d.name().map_err(|e| field("name", e))?;
        let memory = d.memory_info().map_err(|e| field("memory", e))?.total >> 20;
        let pci_address = d.pci_info().ok().map(|p| p.bus_id);
        Ok(Card::nvidia(index, uuid, model, MiB(memory), pci_address))
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
        let mut guard = self.state.lock().map_err(|_| self.invalid("NVML state poisoned"))?;
        let state = &mut *guard;
        if state.nvml.is_none() {
            let nvml = Nvml::builder().lib_path(self.lib.as_os_str()).init().map_err(|e| self.invalid(e))?;
            state.nvml = Some(nvml);
        }
        let Some(nvml) = state.nvml.as_ref() else { return Ok(Vec::new()) };
        let count = nvml.device_count().map_err(|e| self.invalid(e))?;
        state.last.resize(count as usize, None);
        let mut cards = Vec::with_capacity(count as usize);
        for (index, last) in (0..count).zip(state.last.iter_mut()) {
            match Self::card(nvml, index) {
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
}
