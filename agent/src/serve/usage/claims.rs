//! The grants of pods placed through DRA. Their containers name ResourceClaims (`resources.claims`),
//! and a claim's allocation (devices of nano-gpu's driver on this node, each with the capacity it
//! consumes) is what an assignment is to a device-plugin pod: the usage metrics put it beside what
//! the containers use, and the memory watchdog judges them by it. Without it, a DRA pod's use of its
//! own card would read as the use of a card it was not given (an overrun).
//!
//! Each claim is read once from the API server and kept while a pod of the node names it: the
//! allocation of a claim that a running pod uses does not change. A claim that cannot be read, or is
//! not allocated yet, is read again after [`RETRY`].

use crate::cards::inventory::Card;
use crate::kubelet::dra::prepare;
use crate::node::pods::{ClaimUse, Resident};
use k8s_openapi::api::resource::v1::ResourceClaim;
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::dra::card_index;
use nano_gpu_proto::units::Percent;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How long a claim that could not be read waits before it is read again.
pub const RETRY: Duration = Duration::from_secs(30);

/// One device of a claim on this node: the request it was allocated for and the card's grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimGrant {
    /// The request (`name` or `name/subrequest`).
    pub request: String,
    /// The card and what the claim holds on it.
    pub grant: CardGrant,
}

/// The claims of the node's pods that are read, by (namespace, name): their devices on this node
/// (none for a claim of another driver or node).
pub type Held = BTreeMap<(String, String), Vec<ClaimGrant>>;

/// [`Held`] as the usage loop last read it, for the MPS daemons' watcher ([`crate::serve::daemons`]).
pub type SharedHeld = std::sync::Arc<std::sync::RwLock<Held>>;

/// The claims the node's pods name, read or waiting to be.
#[derive(Debug)]
pub struct ClaimGrants {
    node: String,
    held: Held,
    /// Claims whose last read failed, and when.
    failed: BTreeMap<(String, String), Instant>,
}

impl ClaimGrants {
    /// For node `node` (the pool of its devices).
    pub fn new(node: String) -> Self {
        ClaimGrants { node, held: Held::new(), failed: BTreeMap::new() }
    }

    /// What the claims read so far hold.
    pub fn held(&self) -> &Held {
        &self.held
    }

    /// Forgets the claims no pod of `residents` names any more, and returns those to read now: named,
    /// not read, and not failed within [`RETRY`] of `now`.
    pub fn to_read(&mut self, residents: &BTreeMap<String, Resident>, now: Instant) -> Vec<(String, String)> {
        let named: BTreeSet<(String, String)> = residents
            .values()
            .flat_map(|r| r.claims.values().flatten().map(|u| (r.namespace.clone(), u.claim.clone())))
            .collect();
        self.held.retain(|k, _| named.contains(k));
        self.failed.retain(|k, _| named.contains(k));
        named
            .into_iter()
            .filter(|k| !self.held.contains_key(k))
            .filter(|k| self.failed.get(k).is_none_or(|at| now.duration_since(*at) >= RETRY))
            .collect()
    }

    /// Keeps what a read of claim `key` gave, read against the node's `cards`; the error, when it
    /// failed or the claim is not allocated yet (to be read again later).
    pub fn learn(
        &mut self,
        key: (String, String),
        read: Result<ResourceClaim, String>,
        cards: &[Card],
        now: Instant,
    ) -> Result<(), String> {
        match read.and_then(|claim| self.grants_of(&claim, cards)) {
            Ok(held) => {
                self.failed.remove(&key);
                self.held.insert(key, held);
                Ok(())
            }
            Err(e) => {
                self.failed.insert(key, now);
                Err(e)
            }
        }
    }

    /// What `claim` holds on this node's `cards`: nothing when it has no device of nano-gpu's driver
    /// here (another driver's, or another node's), an error while it is not allocated.
    fn grants_of(&self, claim: &ResourceClaim, cards: &[Card]) -> Result<Vec<ClaimGrant>, String> {
        let name = claim.metadata.name.as_deref().unwrap_or("");
        let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
        let allocation = allocation.ok_or_else(|| format!("claim {name} is not allocated yet"))?;
        let mut results = allocation.devices.iter().flat_map(|d| d.results.iter().flatten());
        if !results.any(|r| r.driver == crate::kubelet::dra::DRIVER && r.pool == self.node) {
            return Ok(Vec::new());
        }
        let grants = prepare::held(claim, &self.node, cards)?;
        let held = grants.into_iter().filter_map(|g| {
            let grant = CardGrant {
                index: card_index(&g.device)?,
                uuid: g.uuid,
                percent: Percent(g.percent),
                memory_mib: g.memory,
            };
            Some(ClaimGrant { request: g.request, grant })
        });
        Ok(held.collect())
    }
}

/// What claim use `u` of a container of a pod in `namespace` takes, each device with its position
/// in the claim (the same device, however many containers name it); `None` while the claim is not
/// read.
pub fn taken<'a>(
    held: &'a Held,
    namespace: &str,
    u: &'a ClaimUse,
) -> Option<impl Iterator<Item = (usize, &'a ClaimGrant)>> {
    let devices = held.get(&(namespace.to_owned(), u.claim.clone()))?;
    Some(devices.iter().enumerate().filter(|(_, c)| u.takes(&c.request)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resident(ns: &str, uid: &str, claims: &[(&str, &str)]) -> Resident {
        let mut r = Resident { namespace: ns.into(), uid: uid.into(), ..Default::default() };
        for (container, claim) in claims {
            let u = ClaimUse { claim: (*claim).into(), request: None };
            r.claims.entry((*container).to_owned()).or_default().push(u);
        }
        r
    }

    fn claim(results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ml", "uid": "cu"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}},
        }))
        .unwrap()
    }

    fn card(index: u32, healthy: bool) -> Card {
        let mut c = Card::nvidia(index, format!("GPU-{index}"), "m", nano_gpu_proto::units::MiB(16384), None);
        c.info.healthy = healthy;
        c
    }

    fn key(name: &str) -> (String, String) {
        ("ml".into(), name.into())
    }

    #[test]
    fn claims_named_by_the_nodes_pods_are_read_once_and_forgotten_with_them() {
        let mut g = ClaimGrants::new("node-1".into());
        let now = Instant::now();
        let pods = BTreeMap::from([
            ("u1".to_string(), resident("ml", "u1", &[("a", "c1"), ("b", "c1")])),
            ("u2".to_string(), resident("ml", "u2", &[("a", "c2")])),
        ]);
        assert_eq!(g.to_read(&pods, now), vec![key("c1"), key("c2")]);
        let results = json!([{"request": "gpu", "driver": "gpu.nano-gpu.io", "pool": "node-1",
            "device": "gpu-1", "consumedCapacity": {"percent": "30"}}]);
        g.learn(key("c1"), Ok(claim(results)), &[card(0, true), card(1, false)], now).unwrap();
        // Unhealthy since: what it holds still counts.
        assert_eq!(g.held()[&key("c1")][0].grant.percent, Percent(30));
        assert_eq!(g.held()[&key("c1")][0].grant.index, 1);
        let failed = g.learn(key("c2"), Err("forbidden".into()), &[], now);
        assert_eq!(failed, Err("forbidden".into()));
        assert_eq!(g.to_read(&pods, now + Duration::from_secs(1)), Vec::<(String, String)>::new());
        assert_eq!(g.to_read(&pods, now + RETRY), vec![key("c2")]);
        let only_u2 = BTreeMap::from([("u2".to_string(), resident("ml", "u2", &[("a", "c2")]))]);
        g.to_read(&only_u2, now + RETRY);
        assert!(g.held().is_empty(), "{:?}", g.held());
    }

    #[test]
    fn a_claim_of_another_driver_or_node_holds_nothing_here_and_an_unallocated_one_is_read_again() {
        let mut g = ClaimGrants::new("node-1".into());
        let now = Instant::now();
        let other = json!([{"request": "r", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"},
            {"request": "r", "driver": "gpu.nano-gpu.io", "pool": "node-2", "device": "gpu-0"}]);
        g.learn(key("c"), Ok(claim(other)), &[card(0, true)], now).unwrap();
        assert_eq!(g.held()[&key("c")], Vec::new());
        let mut pending = claim(json!([]));
        pending.status = None;
        assert!(g.learn(key("p"), Ok(pending), &[card(0, true)], now).is_err());
        assert!(!g.held().contains_key(&key("p")));
        let pods = BTreeMap::from([("u".to_string(), resident("ml", "u", &[("a", "p")]))]);
        assert_eq!(g.to_read(&pods, now + RETRY), vec![key("p")]);
    }
}
