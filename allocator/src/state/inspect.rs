//! The `/inspect` document: per node its CPU and memory and its fragmentation under the workload the
//! policy expects, per card its model, health, percent and memory used and free, the pods holding
//! it (`namespace/name`, sorted; pods gpushare placed included) and the ResourceClaims allocated on
//! it, each with what it holds there, and its load (utilisation in percent, averaged over the last
//! minute) when the allocator reads one.

use super::ClusterState;
use super::decode::{Holding, PodRecord};
use super::rebuild::held_memory;
use nano_gpu_engine::load::whole_percent;
use nano_gpu_engine::model::Card;
use nano_gpu_proto::units::{MiB, Percent};
use serde::Serialize;

/// The `/inspect` document, typed: built under the view's lock, written out after it (a `Value`
/// built field by field took 120 to 380 ms at 5,000 nodes, all of it under the lock).
#[derive(Debug, Serialize)]
pub struct InspectDoc {
    /// Per node.
    pub nodes: Vec<NodeDoc>,
}

/// One node of an [`InspectDoc`].
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeDoc {
    name: String,
    cpu_milli: u64,
    cpu_free_milli: u64,
    #[serde(rename = "memoryMiB")]
    memory_mib: u64,
    #[serde(rename = "memoryFreeMiB")]
    memory_free_mib: u64,
    agent_ready: bool,
    fragmentation: f64,
    cards: Vec<CardDoc>,
}

/// One card of a [`NodeDoc`].
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CardDoc {
    index: u32,
    uuid: String,
    model: String,
    healthy: bool,
    percent_used: Percent,
    percent_free: Percent,
    #[serde(rename = "memoryMiB")]
    memory_mib: MiB,
    #[serde(rename = "memoryFreeMiB")]
    memory_free_mib: MiB,
    pods: Vec<String>,
    shares: Vec<ShareDoc>,
    claims: Vec<ClaimDoc>,
    load: Option<u32>,
}

/// What one ResourceClaim's allocation holds of a [`CardDoc`].
#[derive(Debug, Serialize)]
struct ClaimDoc {
    /// `namespace/name`.
    claim: String,
    percent: Percent,
    #[serde(rename = "memoryMiB")]
    memory_mib: MiB,
}

/// What one pod holds of a [`CardDoc`].
#[derive(Debug, Serialize)]
struct ShareDoc {
    pod: String,
    percent: Percent,
    #[serde(rename = "memoryMiB")]
    memory_mib: MiB,
}

impl ClusterState {
    /// Per node and card, for `/inspect`.
    pub fn inspect(&self) -> serde_json::Value {
        serde_json::to_value(self.inspect_doc()).unwrap_or_default()
    }

    /// [`ClusterState::inspect`], typed.
    pub fn inspect_doc(&self) -> InspectDoc {
        let engine = self.extender.engine();
        let cluster = engine.cluster();
        let mut nodes = Vec::new();
        for name in self.nodes.keys() {
            let Some(id) = cluster.id(name) else { continue };
            let n = cluster.node(id);
            let on_node: Vec<&PodRecord> =
                self.by_node.get(name).into_iter().flatten().filter_map(|uid| self.pods.get(uid)).collect();
            // Claims whose allocation cannot be trusted here (devices of other nodes too) count the
            // node as full and are named by the Overcommitted warning, not here.
            let claims: Vec<((String, String), crate::decide::claim::Held)> =
                self.claims_held_on(name).into_iter().filter_map(|(key, held)| Some((key, held?))).collect();
            let cards = n
                .cards
                .iter()
                .map(|c| {
                    let mut shares: Vec<ShareDoc> = on_node
                        .iter()
                        .filter_map(|p| {
                            let (percent, memory_mib) = held_on(p, c, &n.cards)?;
                            Some(ShareDoc { pod: format!("{}/{}", p.key.0, p.key.1), percent, memory_mib })
                        })
                        .collect();
                    shares.sort_by(|a, b| {
                        (&a.pod, a.percent, a.memory_mib).cmp(&(&b.pod, b.percent, b.memory_mib))
                    });
                    let mut held: Vec<ClaimDoc> = claims
                        .iter()
                        .flat_map(|(key, h)| {
                            let here = h.devices.iter().filter(|d| d.card.as_ref().ok() == Some(&c.index));
                            here.map(move |d| ClaimDoc {
                                claim: format!("{}/{}", key.0, key.1),
                                percent: d.percent,
                                memory_mib: d.memory_on(c.mem_total),
                            })
                        })
                        .collect();
                    held.sort_by(|a, b| a.claim.cmp(&b.claim));
                    CardDoc {
                        index: c.index,
                        uuid: c.uuid.clone(),
                        model: cluster.models.name(c.model).to_owned(),
                        healthy: c.healthy,
                        percent_used: Percent::FULL - c.free,
                        percent_free: c.free,
                        memory_mib: c.mem_total,
                        memory_free_mib: c.mem_free,
                        pods: shares.iter().map(|s| s.pod.clone()).collect(),
                        shares,
                        claims: held,
                        load: engine.load().and_then(|l| l.of(c)).map(whole_percent),
                    }
                })
                .collect();
            let fragmentation = engine.workload().frag_now(n);
            nodes.push(NodeDoc {
                name: name.clone(),
                cpu_milli: n.cpu_total,
                cpu_free_milli: n.cpu_free,
                memory_mib: n.mem_total,
                memory_free_mib: n.mem_free,
                agent_ready: n.serving,
                fragmentation: (fragmentation * 10.0).round() / 10.0,
                cards,
            });
        }
        InspectDoc { nodes }
    }
}

/// What pod `p` holds on `card` of a node with `cards` (percent, memory), if anything: its grant, or
/// as counted for a pod gpushare placed (on gpushare's card, or on every card when it cannot be told).
fn held_on(p: &PodRecord, card: &Card, cards: &[Card]) -> Option<(Percent, MiB)> {
    match &p.holding {
        Holding::Cards(a) => {
            let grants = a.held().filter(|g| g.uuid == card.uuid);
            grants.fold(None, |sum, g| {
                let (pc, mib) = sum.unwrap_or((Percent::ZERO, MiB(0)));
                Some((pc + g.percent, MiB(mib.0 + held_memory(g, card).0)))
            })
        }
        Holding::Gpushare(shares) => {
            let here = shares.iter().filter(|s| s.card_in(cards).is_none_or(|k| cards[k].uuid == card.uuid));
            here.fold(None, |sum, s| {
                let (pc, mib) = sum.unwrap_or((Percent::ZERO, MiB(0)));
                Some((pc + s.percent_on(card), MiB(mib.0 + s.memory.0)))
            })
        }
        Holding::Nothing | Holding::Unknown(_) => None,
    }
}
