//! Cards another device plugin serves on this node (NVIDIA's device plugin, the GPU Operator's).
//!
//! Two plugins handing out the same card double-book it: the kubelet counts each resource apart, and
//! the allocator counts only nano-gpu's. The kubelet's pod-resources `GetAllocatableResources` lists
//! the devices of every plugin registered with it. A card that a resource other than nano-gpu's names
//! is served by that plugin too, and nano-gpu serves it to nobody: unhealthy, with the reason (the
//! kubelet gives its devices to no new pod, the Node's inventory shows it unhealthy, so the allocator
//! places nothing there; pods already on it keep running). A card is named
//! - by its UUID, under any resource: NVIDIA's plugin's default IDs (`deviceIDStrategy: uuid`), and
//!   its time-slicing replicas `<uuid>::<n>`;
//! - by its index, under `nvidia.com/*` only (`deviceIDStrategy: index`: `0`, `1`, …), where an index
//!   means an NVIDIA card.
//!
//! So the split between the plugins is the other plugin's own configuration (NVIDIA's device plugin
//! given only some cards, e.g. through its container's `NVIDIA_VISIBLE_DEVICES`): nano-gpu serves the
//! cards it does not. MIG devices (`MIG-…`) name no card here; a card in MIG mode is not one nano-gpu
//! shares whole anyway.

use crate::cards::health::Health;
use crate::cards::inventory::Card;
use crate::node::podresources::PodResourcesSocket;
use nano_gpu_proto::kubelet::podresources::AllocatableResourcesResponse;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The cards of `cards` that a resource not in `ours` names in `allocatable`: card UUID → why.
pub fn claimed(
    allocatable: &AllocatableResourcesResponse,
    ours: &[&str],
    cards: &[Card],
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for devices in &allocatable.devices {
        let resource = devices.resource_name.as_str();
        if ours.contains(&resource) {
            continue;
        }
        let nvidia = resource.starts_with("nvidia.com/");
        for id in &devices.device_ids {
            let uuid = id.split_once("::").map_or(id.as_str(), |(uuid, _)| uuid);
            let card = cards.iter().find(|c| {
                c.info.uuid == uuid || (nvidia && uuid.parse::<u32>().is_ok_and(|i| i == c.info.index))
            });
            if let Some(card) = card {
                out.entry(card.info.uuid.clone()).or_insert_with(|| {
                    format!(
                        "another device plugin serves this card too ({resource}, device {id}): nano-gpu serves it \
                         to nobody, or the two would hand it out twice; keep that plugin off this card (or this node)"
                    )
                });
            }
        }
    }
    out
}

/// Asks the kubelet what every plugin serves, every `every`, and keeps in `health` the
/// cards of `cards` another plugin serves; a change re-reads the inventory at once. A kubelet that
/// does not answer changes nothing (what was found stays until it answers again).
pub async fn watch(
    kubelet: Arc<PodResourcesSocket>,
    ours: Vec<&'static str>,
    cards: watch::Receiver<Arc<Vec<Card>>>,
    health: Arc<Health>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut said = String::new();
    loop {
        tick.tick().await;
        let allocatable = match kubelet.allocatable().await {
            Ok(a) => a,
            Err(e) => {
                let e = format!("GetAllocatableResources: {}", e.message());
                if said != e {
                    tracing::warn!(error = %e, "cannot ask the kubelet what other device plugins serve");
                    said = e;
                }
                continue;
            }
        };
        said.clear();
        let found = claimed(&allocatable, &ours, &cards.borrow());
        if health.set_claimed(found.clone()) {
            for (uuid, why) in &found {
                tracing::warn!(card = %uuid, "{why}");
            }
            if found.is_empty() {
                tracing::info!("no other device plugin serves a card of this node");
            }
            health.changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::kubelet::podresources::ContainerDevices;
    use nano_gpu_proto::units::MiB;

    fn cards() -> Vec<Card> {
        (0..3).map(|i| Card::nvidia(i, format!("GPU-{i}"), "m", MiB(1), None)).collect()
    }

    fn allocatable(devices: &[(&str, &[&str])]) -> AllocatableResourcesResponse {
        AllocatableResourcesResponse {
            devices: devices
                .iter()
                .map(|(resource, ids)| ContainerDevices {
                    resource_name: (*resource).into(),
                    device_ids: ids.iter().map(|i| (*i).into()).collect(),
                    topology: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    const OURS: [&str; 2] = ["nano-gpu/gpu-percent", "aliyun.com/gpu-mem"];

    #[test]
    fn a_card_another_plugin_names_by_uuid_replica_or_index_is_claimed() {
        let a = allocatable(&[
            ("nano-gpu/gpu-percent", &["GPU-0-p0", "GPU-1-p0"]),
            ("nvidia.com/gpu", &["GPU-0", "GPU-9"]),
            ("nvidia.com/gpu.shared", &["GPU-2::0", "GPU-2::1"]),
        ]);
        let found = claimed(&a, &OURS, &cards());
        assert_eq!(found.keys().collect::<Vec<_>>(), ["GPU-0", "GPU-2"]);
        assert!(found["GPU-2"].contains("nvidia.com/gpu.shared"), "{}", found["GPU-2"]);
        for id in ["1", "1::0"] {
            let by_index = allocatable(&[("nvidia.com/gpu", &[id])]);
            assert_eq!(claimed(&by_index, &OURS, &cards()).keys().collect::<Vec<_>>(), ["GPU-1"], "{id}");
        }
    }

    #[test]
    fn our_own_resources_other_vendors_indexes_and_mig_devices_claim_nothing() {
        let a = allocatable(&[
            ("nano-gpu/gpu-percent", &["GPU-0-p0"]),
            ("aliyun.com/gpu-mem", &["GPU-1-m0"]),
            ("example.com/fpga", &["0", "1"]),
            ("nvidia.com/mig-1g.10gb", &["MIG-abc"]),
        ]);
        assert!(claimed(&a, &OURS, &cards()).is_empty());
    }
}
