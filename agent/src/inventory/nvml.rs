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

/// [`watch_xids`], started again every `retry` while NVML cannot deliver events (the driver may load
/// after the agent starts, or a card may fall off the bus), until `stop`. Says why in the log, once
/// per different reason. Blocking: run it on its own thread.
pub fn watch_xids_retrying(
    lib: &std::path::Path,
    health: &crate::health::Health,
    stop: &std::sync::atomic::AtomicBool,
    retry: std::time::Duration,
) {
    use std::sync::atomic::Ordering;
    let mut said = String::new();
    while !stop.load(Ordering::Relaxed) {
        match watch_xids(lib, health, stop) {
            Ok(()) => return,
            Err(e) if e != said => {
                tracing::warn!(error = %e, retry_s = retry.as_secs(), "no XID events from NVML; card health is not watched until it can be");
                said = e;
            }
            Err(_) => {}
        }
        let until = std::time::Instant::now() + retry;
        while std::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(100).min(retry));
        }
    }
}

/// Listens for critical XID events on every NVIDIA card and records them in `health`, until `stop`.
/// Blocking: run it on its own thread. Returns the reason if NVML cannot deliver events.
pub fn watch_xids(
    lib: &std::path::Path,
    health: &crate::health::Health,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), String> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::error::NvmlError;
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init().map_err(|e| e.to_string())?;
    let mut set = nvml.create_event_set().map_err(|e| e.to_string())?;
    let count = nvml.device_count().map_err(|e| e.to_string())?;
    for i in 0..count {
        let device = nvml.device_by_index(i).map_err(|e| e.to_string())?;
        set = device.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| e.to_string())?;
    }
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match set.wait(500) {
            Ok(event) => {
                let xid = event.event_data.map_or(0, |x| match x {
                    nvml_wrapper::enums::event::XidError::Value(v) => v,
                    nvml_wrapper::enums::event::XidError::Unknown => 0,
                });
                let uuid = event.device.uuid().map_err(|e| e.to_string())?;
                if health.record(&uuid, xid, std::time::Instant::now()) {
                    tracing::warn!(gpu = %uuid, xid, "critical XID: card marked unhealthy");
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}
