//! The node's cards as a ResourceSlice: one device per card (`gpu-<index>`), shared by capacity
//! (`percent` of its compute, 1 to 100, and `memory`), with the attributes a claim selects on (model,
//! UUID, index, memory, vendor, NUMA node, PCI address) and an unhealthy card tainted `NoSchedule`.
//!
//! A claim that names no capacity gets the whole card (percent's default is 100) and none of the
//! memory capacity (its default is 0): its memory is then its percent of the card's, the one memory
//! rule, which the agent applies when it prepares the claim.

use super::DRIVER;
use super::prepare::{MEMORY, PERCENT};
use crate::cards::inventory::Card;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity, DeviceTaint,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{Patch, PatchParams};
use nano_gpu_proto::annotations::Vendor;
use std::collections::BTreeMap;

/// The taint on an unhealthy card's device.
pub const UNHEALTHY: &str = "gpu.nano-gpu.io/unhealthy";

/// The name of a node's slice.
pub fn name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// The devices of `cards`.
pub fn devices(cards: &[Card]) -> Vec<Device> {
    cards.iter().map(device).collect()
}

fn device(card: &Card) -> Device {
    let info = &card.info;
    let mut attributes = BTreeMap::new();
    let string = |s: &str| DeviceAttribute { string: Some(s.to_owned()), ..Default::default() };
    let int = |i: i64| DeviceAttribute { int: Some(i), ..Default::default() };
    attributes.insert("model".to_owned(), string(&info.model));
    attributes.insert("uuid".to_owned(), string(&info.uuid));
    attributes.insert("index".to_owned(), int(i64::from(info.index)));
    attributes.insert("memoryMiB".to_owned(), int(i64::try_from(info.memory_mib.0).unwrap_or(i64::MAX)));
    let vendor = match info.vendor {
        Vendor::Nvidia => "nvidia",
        Vendor::Intel => "intel",
    };
    attributes.insert("vendor".to_owned(), string(vendor));
    if let Some(numa) = info.numa {
        attributes.insert("numaNode".to_owned(), int(i64::from(numa)));
    }
    if let Some(pci) = &card.pci_address {
        attributes.insert("pciBusID".to_owned(), string(pci));
    }
    let q = |s: String| Quantity(s);
    let memory = mebibytes(info.memory_mib.0);
    let capacity = BTreeMap::from([
        (
            PERCENT.to_owned(),
            DeviceCapacity {
                value: q("100".into()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(q("100".into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: q("1".into()),
                        max: Some(q("100".into())),
                        step: Some(q("1".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            MEMORY.to_owned(),
            DeviceCapacity {
                value: q(memory.clone()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(q("0".into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: q("0".into()),
                        max: Some(q(memory)),
                        step: Some(q("1Mi".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ]);
    let taints = (!info.healthy).then(|| {
        vec![DeviceTaint { key: UNHEALTHY.to_owned(), effect: "NoSchedule".to_owned(), ..Default::default() }]
    });
    Device {
        name: nano_gpu_proto::dra::device_name(info.index),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        taints,
        ..Default::default()
    }
}

/// `mib` MiB as the API server writes a quantity back (the largest binary suffix that divides it), so
/// that what the agent wrote and what it reads compare equal.
fn mebibytes(mib: u64) -> String {
    match mib {
        0 => "0".into(),
        m if m % (1 << 20) == 0 => format!("{}Ti", m >> 20),
        m if m % (1 << 10) == 0 => format!("{}Gi", m >> 10),
        m => format!("{m}Mi"),
    }
}

/// Whether the slice the API server has says `wanted` (the time a taint was added is the server's).
fn same(current: &ResourceSlice, node: &str, wanted: &[Device]) -> bool {
    let mut devices = current.spec.devices.clone().unwrap_or_default();
    for taint in devices.iter_mut().flat_map(|d| d.taints.iter_mut().flatten()) {
        taint.time_added = None;
    }
    current.spec.node_name.as_deref() == Some(node) && current.spec.driver == DRIVER && devices == wanted
}

/// The node's slice: its pool is the node, owned by the Node (so it goes with it).
pub fn slice(node: &str, node_uid: &str, generation: i64, cards: &[Card]) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name(node)),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_owned(),
                uid: node_uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation, resource_slice_count: 1 },
            devices: Some(devices(cards)),
            ..Default::default()
        },
    }
}

/// Writes the node's slice when its devices differ from what the API server has (a new pool
/// generation each time, so nothing reads an old slice as current).
pub struct Publisher {
    /// The ResourceSlice API.
    pub slices: Api<ResourceSlice>,
    /// This node.
    pub node: String,
    /// Its UID (the slice's owner).
    pub node_uid: String,
    /// The devices last written and the resourceVersion the API server gave them: a slice still at
    /// that version is ours as written, whatever the server normalised or dropped (an API server
    /// without consumable capacity drops the sharing fields, and the comparison would never hold).
    pub last: Option<(Vec<Device>, String)>,
}

impl Publisher {
    /// A publisher that has written nothing yet.
    pub fn new(slices: Api<ResourceSlice>, node: String, node_uid: String) -> Publisher {
        Publisher { slices, node, node_uid, last: None }
    }

    /// Publishes `cards`; `Ok(true)` when something was written.
    pub async fn publish(&mut self, cards: &[Card]) -> Result<bool, kube::Error> {
        let current = self.slices.get_opt(&name(&self.node)).await?;
        let wanted = devices(cards);
        let generation = match &current {
            Some(s) if self.unchanged(s, &wanted) || same(s, &self.node, &wanted) => return Ok(false),
            Some(s) => s.spec.pool.generation + 1,
            None => 1,
        };
        let slice = slice(&self.node, &self.node_uid, generation, cards);
        let params = PatchParams::apply("nano-gpu-agent").force();
        let written = self.slices.patch(&name(&self.node), &params, &Patch::Apply(&slice)).await?;
        self.last = written.metadata.resource_version.map(|v| (wanted, v));
        Ok(true)
    }

    /// Whether `current` is the slice this publisher last wrote, for the same devices.
    fn unchanged(&self, current: &ResourceSlice, wanted: &[Device]) -> bool {
        self.last.as_ref().is_some_and(|(devices, version)| {
            devices == wanted && current.metadata.resource_version.as_ref() == Some(version)
        })
    }
}
