//! The XID watcher: NVML's critical-XID events on every NVIDIA card, recorded in [`Health`]. Blocking
//! (NVML's event wait), so it runs on its own thread, never on an async worker.

use super::Health;
use nvml_wrapper::Nvml;

/// [`watch_xids`], started again every `retry` while NVML cannot deliver events (the driver may load
/// after the agent starts, or a card may fall off the bus), until `stop`. Says why in the log, once
/// per different reason. Blocking: run it on its own thread.
pub fn watch_xids_retrying(
    lib: &std::path::Path,
    health: &Health,
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
    health: &Health,
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
