//! The `/inspect` document: per node its CPU and memory, per card its model, health, percent and
//! memory used and free, and the pods holding it (`namespace/name`, sorted; pods gpushare placed
//! included).

use super::ClusterState;
use super::decode::Holding;
use nano_gpu_proto::units::Percent;

impl ClusterState {
    /// Per node and card, for `/inspect`.
    pub fn inspect(&self) -> serde_json::Value {
        let cluster = self.extender.engine().cluster();
        let mut nodes = Vec::new();
        for name in self.nodes.keys() {
            let Some(id) = cluster.id(name) else { continue };
            let n = cluster.node(id);
            let cards: Vec<serde_json::Value> = n
                .cards
                .iter()
                .map(|c| {
                    let pods: Vec<String> = self
                        .by_node
                        .get(name)
                        .into_iter()
                        .flatten()
                        .filter_map(|uid| self.pods.get(uid))
                        .filter(|p| match &p.holding {
                            Holding::Cards(a) => a.held().any(|g| g.uuid == c.uuid),
                            // As counted: on gpushare's card, or on every card when it cannot be told.
                            Holding::Gpushare(shares) => shares
                                .iter()
                                .any(|s| s.card_in(&n.cards).is_none_or(|k| n.cards[k].uuid == c.uuid)),
                            Holding::Nothing | Holding::Unknown(_) => false,
                        })
                        .map(|p| format!("{}/{}", p.key.0, p.key.1))
                        .collect();
                    let mut pods = pods;
                    pods.sort();
                    serde_json::json!({
                        "index": c.index, "uuid": c.uuid, "model": cluster.models.name(c.model),
                        "healthy": c.healthy, "percentUsed": Percent::FULL - c.free, "percentFree": c.free,
                        "memoryMiB": c.mem_total, "memoryFreeMiB": c.mem_free, "pods": pods,
                    })
                })
                .collect();
            nodes.push(serde_json::json!({
                "name": name, "cpuMilli": n.cpu_total, "cpuFreeMilli": n.cpu_free,
                "memoryMiB": n.mem_total, "memoryFreeMiB": n.mem_free, "agentReady": n.serving,
                "cards": cards,
            }));
        }
        serde_json::json!({ "nodes": nodes })
    }
}
