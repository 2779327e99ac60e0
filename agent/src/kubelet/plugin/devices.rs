//! Device IDs and cards: the IDs every card advertises for a resource (ListAndWatch), the cards a
//! set of IDs the kubelet chose is on ([`derive`]), and the card-packing choice of IDs when no pod
//! tells where a container should go ([`prefer`]).

use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::{Device, NumaNode, TopologyInfo};
use nano_gpu_proto::kubelet::{HEALTHY, UNHEALTHY};
use std::collections::BTreeMap;
use tonic::Status;

/// The device IDs of every card for `resource`, with health and NUMA node.
pub fn devices(cards: &[Card], resource: Resource) -> Vec<Device> {
    cards
        .iter()
        .flat_map(|c| {
            let topology = c.info.numa.map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] });
            let health = if c.info.healthy { HEALTHY } else { UNHEALTHY };
            resource.ids(c).into_iter().map(move |id| Device {
                id,
                health: health.to_owned(),
                topology: topology.clone(),
            })
        })
        .collect()
}

/// The cards a container got, with how many of its IDs are on each, from the IDs the kubelet chose.
pub fn derive<'a>(cards: &'a [Card], ids: &[String]) -> Result<Vec<(&'a Card, u32)>, Status> {
    let mut per_card: BTreeMap<&str, u32> = BTreeMap::new();
    for id in ids {
        let uuid = device_id::card_of(id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        *per_card.entry(uuid).or_default() += 1;
    }
    if per_card.is_empty() {
        return Err(Status::invalid_argument("no device IDs"));
    }
    per_card
        .into_iter()
        .map(|(uuid, n)| {
            let card = cards
                .iter()
                .find(|c| c.info.uuid == uuid)
                .ok_or_else(|| Status::invalid_argument(format!("device IDs of unknown card {uuid}")))?;
            Ok((card, n))
        })
        .collect()
}

/// Picks `size` IDs among `available` (keeping `must`) from as few cards as possible, fullest cards
/// first, so a share lands on one card whenever one card can hold it.
pub fn prefer(available: &[String], must: &[String], size: usize) -> Vec<String> {
    let mut chosen: Vec<String> = must.to_vec();
    let mut by_card: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in available.iter().filter(|id| !must.contains(id)) {
        if let Ok(uuid) = device_id::card_of(id) {
            by_card.entry(uuid.to_owned()).or_default().push(id.clone());
        }
    }
    // Cards with the fewest free IDs that still hold the rest whole come first; then the largest.
    let need = size.saturating_sub(chosen.len());
    let mut cards: Vec<Vec<String>> = by_card.into_values().collect();
    cards.sort_by_key(|ids| {
        (ids.len() < need, if ids.len() >= need { ids.len() } else { usize::MAX - ids.len() })
    });
    for ids in cards {
        if chosen.len() >= size {
            break;
        }
        let take = size - chosen.len();
        chosen.extend(ids.into_iter().take(take));
    }
    chosen
}
