//! The `/inspect` document: per node its CPU and memory and its fragmentation under the workload the
//! policy expects, per card its model, health, percent and memory used and free, and the pods holding
//! it (`namespace/name`, sorted; pods gpushare placed included), each with what it holds there, and
//! its load (utilisation in percent, averaged over the last minute) when the allocator reads one.

use super::ClusterState;
use super::decode::{Holding, PodRecord};
use super::rebuild::held_memory;
use nano_gpu_engine::load::whole_percent;
use nano_gpu_engine::model::Card;
use nano_gpu_proto::units::{MiB, Percent};

impl ClusterState {
    /// Per node and card, for `/inspect`.
    pub fn inspect(&self) -> serde_json::Value {
        let engine = self.extender.engine();
        let cluster = engine.cluster();
        let mut nodes = Vec::new();
        for name in self.nodes.keys() {
            let Some(id) = cluster.id(name) else { continue };
            let n = cluster.node(id);
            let on_node: Vec<&PodRecord> =
                self.by_node.get(name).into_iter().flatten().filter_map(|uid| self.pods.get(uid)).collect();
            let cards: Vec<serde_json::Value> = n
                .cards
                .iter()
                .map(|c| {
                    let mut shares: Vec<(String, Percent, MiB)> = on_node
                        .iter()
                        .filter_map(|p| {
                            held_on(p, c, &n.cards)
                                .map(|(pc, mib)| (format!("{}/{}", p.key.0, p.key.1), pc, mib))
                        })
                        .collect();
                    shares.sort();
                    let pods: Vec<&str> = shares.iter().map(|(pod, ..)| pod.as_str()).collect();
                    let shares: Vec<serde_json::Value> = shares
                        .iter()
                        .map(
                            |(pod, pc, mib)| serde_json::json!({"pod": pod, "percent": pc, "memoryMiB": mib}),
                        )
                        .collect();
                    serde_json::json!({
                        "index": c.index, "uuid": c.uuid, "model": cluster.models.name(c.model),
                        "healthy": c.healthy, "percentUsed": Percent::FULL - c.free, "percentFree": c.free,
                        "memoryMiB": c.mem_total, "memoryFreeMiB": c.mem_free, "pods": pods, "shares": shares,
                        "load": engine.load().and_then(|l| l.of(c)).map(whole_percent),
                    })
                })
                .collect();
            let fragmentation = engine.workload().frag_now(n);
            nodes.push(serde_json::json!({
                "name": name, "cpuMilli": n.cpu_total, "cpuFreeMilli": n.cpu_free,
                "memoryMiB": n.mem_total, "memoryFreeMiB": n.mem_free, "agentReady": n.serving,
                "fragmentation": (fragmentation * 10.0).round() / 10.0, "cards": cards,
            }));
        }
        serde_json::json!({ "nodes": nodes })
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
