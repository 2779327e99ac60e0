//! The node's GPU cards, from one or more backends behind one trait: NVML for NVIDIA, sysfs drm for
//! Intel, and a JSON file for local clusters and demos. NVIDIA and Intel cards on one
//! node are both served: backends are read one after another and their cards listed together.

mod fake;
pub mod fdinfo;
mod nvml;
mod sysfs;

pub use fake::FakeFile;
pub use nvml::NvmlInventory;
pub use sysfs::SysfsDrm;

use nano_gpu_proto::annotations::{GpuInfo, Vendor};
use nano_gpu_proto::units::MiB;
use std::path::PathBuf;
use thiserror::Error;

/// One card as the agent serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Card {
    /// What the allocator sees (published in `nano-gpu/gpus`).
    pub info: GpuInfo,
    /// Host device nodes a container needs for this card (Intel: `/dev/dri/cardN`, `renderD*`).
    pub device_nodes: Vec<PathBuf>,
    /// PCI address, where known.
    pub pci_address: Option<String>,
    /// Why the card could not be read, when it could not: it is then served as unhealthy (the kubelet
    /// gives it to nobody) while the node's other cards are served as usual.
    pub fault: Option<String>,
    /// Whether the card is in MIG mode (NVIDIA; its MIG mode query says so).
    pub mig: bool,
}

impl Card {
    /// An NVIDIA card as NVML reports it: no device nodes (nvidia-container-runtime adds them from
    /// `NVIDIA_VISIBLE_DEVICES`), healthy, NUMA node unknown.
    pub fn nvidia(
        index: u32,
        uuid: impl Into<String>,
        model: impl Into<String>,
        memory: MiB,
        pci_address: Option<String>,
    ) -> Self {
        Card {
            info: GpuInfo {
                index,
                uuid: uuid.into(),
                vendor: Vendor::Nvidia,
                model: model.into(),
                memory_mib: memory,
                healthy: true,
                numa: None,
            },
            device_nodes: Vec::new(),
            pci_address,
            fault: None,
            mig: false,
        }
    }
}

/// What one card is doing, as its backend reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CardSample {
    /// Card UUID.
    pub uuid: String,
    /// Index on the node.
    pub index: u32,
    /// Memory in use, by every process and the driver.
    pub memory_used: MiB,
    /// Memory of the card.
    pub memory_total: MiB,
    /// Percent of the last sample period a kernel ran, when the card reports it.
    pub utilization: Option<u32>,
    /// Degrees Celsius, when reported.
    pub temperature: Option<u32>,
    /// Milliwatts, when reported.
    pub power_mw: Option<u32>,
    /// The processes with a compute context on the card.
    pub processes: Vec<ProcessSample>,
}

/// One process on a card.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessSample {
    /// Host PID.
    pub pid: u32,
    /// Card memory it uses, when the driver says.
    pub memory: Option<MiB>,
    /// Its SM utilisation in the newest sample since the last pass (percent); `None`: no sample (idle).
    pub sm: Option<u32>,
}

/// A backend that cannot be read.
#[derive(Debug, Error)]
pub enum InventoryError {
    /// A file or directory cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// What was read.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A file has unexpected content.
    #[error("{path}: {message}")]
    Invalid {
        /// What was read.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// A source of cards.
pub trait GpuInventory: Send + Sync {
    /// Backend name, for logs.
    fn name(&self) -> &'static str;

    /// The cards now.
    fn cards(&self) -> Result<Vec<Card>, InventoryError>;

    /// What each card is doing now (utilisation, memory, processes); backends that cannot say return
    /// no samples (the fake file).
    fn sample(&self) -> Result<Vec<CardSample>, InventoryError> {
        Ok(Vec::new())
    }
}

/// The NUMA node of the PCI device whose sysfs directory is `device` (its `numa_node`); `None` where
/// there is none or it says `-1` (one NUMA node, or firmware that does not tell).
fn numa_node(device: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(device.join("numa_node")).ok()?;
    text.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
}

/// Every backend's cards, in backend order; a backend that fails is reported, the others still count.
pub fn read_all(backends: &[Box<dyn GpuInventory>]) -> (Vec<Card>, Vec<(String, InventoryError)>) {
    each_backend(backends, |b| b.cards())
}

/// Every backend's samples, as [`read_all`] reads cards.
pub fn sample_all(backends: &[Box<dyn GpuInventory>]) -> (Vec<CardSample>, Vec<(String, InventoryError)>) {
    each_backend(backends, |b| b.sample())
}

fn each_backend<T>(
    backends: &[Box<dyn GpuInventory>],
    read: impl Fn(&dyn GpuInventory) -> Result<Vec<T>, InventoryError>,
) -> (Vec<T>, Vec<(String, InventoryError)>) {
    let mut all = Vec::new();
    let mut errors = Vec::new();
    for b in backends {
        match read(b.as_ref()) {
            Ok(c) => all.extend(c),
            Err(e) => errors.push((b.name().to_owned(), e)),
        }
    }
    (all, errors)
}
