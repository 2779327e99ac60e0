//! What a prepared claim gives its containers: the claim's allocation (the devices of this driver and
//! node, each with the capacity it consumes) read against the node's cards, then the same container
//! edits the device plugin hands out ([`crate::kubelet::plugin::container_edits`]), one CDI device per request.
//!
//! Pure: the claim comes in as the API server has it, the cards as the inventory has them.

use super::DRIVER;
use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use crate::kubelet::plugin::{Claimed, Edits, container_edits};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::kubelet::deviceplugin::ContainerAllocateResponse;
use nano_gpu_proto::quantity;
use nano_gpu_proto::units::{MiB, Percent};

pub use nano_gpu_proto::dra::{DEVICE_PREFIX, MEMORY, PERCENT};

/// One device of the claim on this node, as the allocation gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The request (or `request/subrequest`) it was allocated for.
    pub request: String,
    /// The device's name in the ResourceSlice (`gpu-<index>`).
    pub device: String,
    /// The share's ID when the device is shared by capacity.
    pub share_id: Option<String>,
    /// The card's UUID.
    pub uuid: String,
    /// Percent of the card's compute.
    pub percent: u32,
    /// Card memory, when the claim asked some.
    pub memory: Option<MiB>,
}

/// What one request of the claim gives a container that names it.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    /// The request's name.
    pub request: String,
    /// Its devices.
    pub grants: Vec<Grant>,
    /// The container edits for all of them together.
    pub edits: ContainerAllocateResponse,
}

/// The devices of `claim` this driver serves on `node`, checked against `cards`: an allocation on
/// another node, an unknown or unhealthy card, a capacity that is no number or more than the card
/// has, or more than one card's worth of one card across the claim is an error that names it.
pub fn grants(claim: &ResourceClaim, node: &str, cards: &[Card]) -> Result<Vec<Grant>, String> {
    let name = claim.metadata.name.as_deref().unwrap_or("");
    // The driver takes no parameters: a configuration for it (from the claim or its DeviceClass)
    // would be silently ignored, so it is refused.
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    let configs = allocation.and_then(|a| a.devices.as_ref()).and_then(|d| d.config.as_ref());
    if let Some(c) =
        configs.into_iter().flatten().find(|c| c.opaque.as_ref().is_some_and(|o| o.driver == DRIVER))
    {
        return Err(format!(
            "claim {name}: {DRIVER} takes no opaque configuration (one from the {} is set); ask capacity \
             (percent, memory) in the request and select cards by their attributes instead",
            if c.source == "FromClass" { "DeviceClass" } else { "claim" }
        ));
    }
    read(claim, node, cards, true)
}

/// What a claim prepared earlier holds on `node` (for the usage metrics and the memory watchdog):
/// [`grants`] without its refusals of what preparing must not start, so a card that turned
/// unhealthy since still counts what its containers were given.
pub fn held(claim: &ResourceClaim, node: &str, cards: &[Card]) -> Result<Vec<Grant>, String> {
    read(claim, node, cards, false)
}

/// The claim's devices on `node`, each read against `cards` (which must be healthy when
/// `healthy` is set).
fn read(claim: &ResourceClaim, node: &str, cards: &[Card], healthy: bool) -> Result<Vec<Grant>, String> {
    let name = claim.metadata.name.as_deref().unwrap_or("");
    let allocation = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or_else(|| format!("claim {name} is not allocated"))?;
    let results = allocation.devices.as_ref().and_then(|d| d.results.as_ref());
    let ours: Vec<&DeviceRequestAllocationResult> =
        results.into_iter().flatten().filter(|r| r.driver == DRIVER).collect();
    if ours.is_empty() {
        return Err(format!("claim {name} has no device of driver {DRIVER}"));
    }
    let mut grants = Vec::new();
    for result in ours {
        if result.pool != node {
            return Err(format!(
                "claim {name}: device {} is in pool {:?}, not this node's ({node})",
                result.device, result.pool
            ));
        }
        let card = card_of(cards, &result.device, healthy).map_err(|e| format!("claim {name}: {e}"))?;
        let consumed = result.consumed_capacity.as_ref();
        let percent = match consumed.and_then(|c| c.get(PERCENT)) {
            // Without consumable capacity the device is the whole card.
            None => 100,
            Some(q) => match quantity::whole(&q.0) {
                Ok(p @ 1..=100) => p as u32,
                Ok(p) => return Err(format!("claim {name}: {PERCENT} {p} of {}: 1 to 100", result.device)),
                Err(e) => return Err(format!("claim {name}: {PERCENT} of {}: {e}", result.device)),
            },
        };
        let memory = match consumed.and_then(|c| c.get(MEMORY)) {
            None => None,
            Some(q) => {
                let mib = quantity::mebibytes(&q.0).map_err(|e| format!("claim {name}: {MEMORY}: {e}"))?;
                (mib > 0).then_some(MiB(mib))
            }
        };
        if let Some(m) = memory.filter(|m| *m > card.info.memory_mib) {
            return Err(format!("claim {name}: {m} of {} which has {}", result.device, card.info.memory_mib));
        }
        grants.push(Grant {
            request: result.request.clone(),
            device: result.device.clone(),
            share_id: result.share_id.clone(),
            uuid: card.info.uuid.clone(),
            percent,
            memory,
        });
    }
    for card in cards {
        let on: Vec<&Grant> = grants.iter().filter(|g| g.uuid == card.info.uuid).collect();
        let percent: u32 = on.iter().map(|g| g.percent).sum();
        if percent > 100 {
            return Err(format!("claim {name}: {percent} % of {} in one claim", on[0].device));
        }
    }
    Ok(grants)
}

/// The card a device name (`gpu-<index>`) stands for, if it may take work (or, unless `healthy`, if
/// the node has it).
fn card_of<'a>(cards: &'a [Card], device: &str, healthy: bool) -> Result<&'a Card, String> {
    let index = nano_gpu_proto::dra::card_index(device).ok_or_else(|| {
        format!("device {device:?} is not one of this driver's names ({DEVICE_PREFIX}<index>)")
    })?;
    let card = cards
        .iter()
        .find(|c| c.info.index == index)
        .ok_or_else(|| format!("device {device}: this node has no card {index}"))?;
    if healthy && !card.info.healthy {
        let why = card.fault.as_deref().unwrap_or("unhealthy");
        return Err(format!("device {device} ({}): {why}", card.info.uuid));
    }
    Ok(card)
}

/// The edits for each request of the claim, in the order the allocation names them: its cards with
/// their percent, its memory where every device of the request has some.
pub fn prepare(grants: &[Grant], cards: &[Card], edits: &Edits) -> Result<Vec<Prepared>, String> {
    let mut requests: Vec<&str> = Vec::new();
    for g in grants {
        if !requests.contains(&g.request.as_str()) {
            requests.push(&g.request);
        }
    }
    requests
        .into_iter()
        .map(|request| {
            let mine: Vec<Grant> = grants.iter().filter(|g| g.request == request).cloned().collect();
            let got: Vec<(&Card, u32)> = mine
                .iter()
                .map(|g| {
                    let card =
                        cards.iter().find(|c| c.info.uuid == g.uuid).expect("grants are of these cards");
                    (card, g.percent)
                })
                .collect();
            let claimed = Claimed {
                grants: mine
                    .iter()
                    .zip(&got)
                    .map(|(g, (card, _))| CardGrant {
                        uuid: g.uuid.clone(),
                        index: card.info.index,
                        percent: Percent(g.percent),
                        memory_mib: g.memory,
                    })
                    .collect(),
                pod_units: 0,
            };
            let edits = container_edits(&got, Some(&claimed), Resource::Percent, edits)
                .map_err(|s| format!("request {request}: {}", s.message()))?;
            Ok(Prepared { request: request.to_owned(), grants: mine, edits })
        })
        .collect()
}
