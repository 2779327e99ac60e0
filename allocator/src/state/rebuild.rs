//! Rebuilding one node of the engine's cluster from the view: its record's cards (none when its
//! inventory does not decode), minus what every pod on it holds; a node with an untrusted assignment
//! has every card full. A card asked past 100 % raises an `Overcommitted` warning.

use super::ClusterState;
use super::decode::Holding;
use nano_gpu_engine::model::{Card, Node};
use nano_gpu_proto::units::{MiB, Percent};

impl ClusterState {
    /// Recomputes one node of the engine's cluster from its record and the pods on it.
    pub(super) fn rebuild(&mut self, name: &str) {
        let Some(record) = self.nodes.get(name) else { return };
        let cluster = self.extender.engine_mut().cluster_mut();
        let cards: Vec<Card> = match &record.inventory {
            Some(Ok(inv)) => inv
                .gpus
                .iter()
                .map(|g| {
                    let model = cluster.models.intern(&g.model);
                    let mut c = Card::new(g.uuid.clone(), g.index, model, g.memory_mib);
                    c.healthy = g.healthy;
                    c
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut node = Node::new(name, record.cpu, record.mem, cards);
        let mut poisoned = false;
        let mut overcommit = Vec::new();
        let on_node = self.by_node.get(name).into_iter().flatten().filter_map(|uid| self.pods.get(uid));
        for p in on_node {
            node.cpu_free = node.cpu_free.saturating_sub(p.cpu);
            node.mem_free = node.mem_free.saturating_sub(p.mem);
            match &p.holding {
                Holding::Nothing => {}
                Holding::Unknown(_) => poisoned = true,
                Holding::Cards(a) => {
                    for g in a.held() {
                        match node.cards.iter_mut().find(|c| c.uuid == g.uuid) {
                            Some(c) if c.free >= g.percent => {
                                c.free -= g.percent;
                                c.mem_free = c.mem_free.saturating_sub(g.memory_mib.unwrap_or(MiB::ZERO));
                            }
                            Some(c) => {
                                c.free = Percent::ZERO;
                                overcommit.push((p.key.clone(), g.uuid.clone()));
                            }
                            // The card is gone from the inventory: nothing to take from.
                            None => {}
                        }
                    }
                }
            }
        }
        if poisoned || matches!(record.inventory, Some(Err(_))) {
            for c in &mut node.cards {
                c.free = Percent::ZERO;
            }
        }
        cluster.upsert_node(node);
        for ((ns, pod), uuid) in overcommit {
            self.warn(
                "Pod",
                &ns,
                &pod,
                "Overcommitted",
                format!("card {uuid} on {name} is over 100 % with this pod"),
            );
        }
    }
}
