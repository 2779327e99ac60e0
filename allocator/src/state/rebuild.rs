//! Rebuilding one node of the engine's cluster from the view: its record's cards (none when its
//! inventory does not decode), minus what every pod on it holds (a share that asked no GPU memory
//! holds its percent of the card's memory); a node with an untrusted assignment
//! has every card full. A card asked past 100 % raises an `Overcommitted` warning and also fills
//! every card of its node: the view then disagrees with what the kubelet gave (an agent repaired one
//! pod's assignment to the card the kubelet chose, and the pod the kubelet moved off that card is not
//! repaired yet), so the room it shows elsewhere on the node is not there. Placing there would let the
//! kubelet, which counts device IDs and not cards, split the next share over the leftovers of several
//! cards. The node takes pods again once the repairs land and no card is over. A pod gpushare
//! placed holds its memory (and the percent of the card that memory is, the rule for memory-only
//! shares) on the card of gpushare's index; when that card cannot be told, on every card of the node
//! (it may be on any), with a `GpushareCardUnknown` warning.

use super::ClusterState;
use super::decode::Holding;
use nano_gpu_engine::model::{Card, Node};
use nano_gpu_proto::events::Reason;

use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::units::{MiB, Percent};

impl ClusterState {
    /// Recomputes one node of the engine's cluster from its record and the pods on it.
    pub(super) fn rebuild(&mut self, name: &str) {
        self.generation += 1;
        let serving = self.agent_ready(name);
        let Some(record) = self.nodes.get(name) else { return };
        let serving = serving && !record.exposed;
        let claims = self.claims_held_on(name);
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
        let mut node = Node::new(name, record.cpu, record.mem, cards).with_ids(record.ids);
        node.serving = serving;
        node.dra = record.dra;
        let mut poisoned = false;
        let mut overcommit = Vec::new();
        let mut unknown_card = Vec::new();
        let mut unknown_claim: Vec<((String, String), String)> = Vec::new();
        let mut overcommit_claims = Vec::new();
        let on_node = self.by_node.get(name).into_iter().flatten().filter_map(|uid| self.pods.get(uid));
        for p in on_node {
            node.cpu_free = node.cpu_free.saturating_sub(p.cpu);
            node.mem_free = node.mem_free.saturating_sub(p.mem);
            node.ids_free = node.ids_free.saturating_sub(p.ids);
            match &p.holding {
                Holding::Nothing => {}
                Holding::Unknown(_) => poisoned = true,
                Holding::Cards(a) => {
                    for g in a.held() {
                        // A card gone from the inventory: nothing to take from.
                        if let Some(c) = node.cards.iter_mut().find(|c| c.uuid == g.uuid)
                            && !take(c, g.percent, held_memory(g, c))
                        {
                            overcommit.push((p.key.clone(), g.uuid.clone()));
                        }
                    }
                }
                Holding::Gpushare(shares) => {
                    for s in shares {
                        if let Some(k) = s.card_in(&node.cards) {
                            let c = &mut node.cards[k];
                            if !take(c, s.percent_on(c), s.memory) {
                                overcommit.push((p.key.clone(), c.uuid.clone()));
                            }
                            continue;
                        }
                        let why = match &s.card {
                            Ok(i) => format!("gpushare's card index {i} is not a card of {name}"),
                            Err(why) => why.clone(),
                        };
                        unknown_card.push((
                            p.key.clone(),
                            format!("{why}; its {} MiB count on every card of {name}", s.memory.0),
                        ));
                        for c in &mut node.cards {
                            take(c, s.percent_on(c), s.memory);
                        }
                    }
                }
            }
        }
        // Claims allocated here (a node whose agent serves DRA holds only claims).
        for (key, held) in claims {
            let Some(held) = held else {
                poisoned = true;
                unknown_claim
                    .push((key, format!("its allocation names devices of {name} and of other nodes")));
                continue;
            };
            for d in &held.devices {
                let card = d.card.as_ref().ok().and_then(|i| node.cards.iter_mut().find(|c| c.index == *i));
                let Some(c) = card else {
                    poisoned = true;
                    let device = match &d.card {
                        Ok(i) => nano_gpu_proto::dra::device_name(*i),
                        Err(name) => name.clone(),
                    };
                    unknown_claim.push((
                        key.clone(),
                        format!("its allocation names device {device}, no card of {name}"),
                    ));
                    continue;
                };
                let memory = d.memory_on(c.mem_total);
                if !take(c, d.percent, memory) {
                    overcommit_claims.push((key.clone(), c.uuid.clone()));
                }
            }
        }
        if poisoned
            || !overcommit.is_empty()
            || !overcommit_claims.is_empty()
            || matches!(record.inventory, Some(Err(_)))
        {
            for c in &mut node.cards {
                c.free = Percent::ZERO;
            }
        }
        cluster.upsert_node(node);
        for ((ns, pod), message) in unknown_card {
            self.warn("Pod", &ns, &pod, Reason::GpushareCardUnknown, message);
        }
        for ((ns, claim), why) in unknown_claim {
            self.warn(
                "ResourceClaim",
                &ns,
                &claim,
                Reason::InvalidAllocation,
                format!("{why}; every card of {name} is treated as full"),
            );
        }
        for ((ns, claim), uuid) in overcommit_claims {
            self.warn(
                "ResourceClaim",
                &ns,
                &claim,
                Reason::Overcommitted,
                format!("card {uuid} on {name} is over 100 % with this claim; no claim is placed on {name} until it is not"),
            );
        }
        for ((ns, pod), uuid) in overcommit {
            self.warn(
                "Pod",
                &ns,
                &pod,
                Reason::Overcommitted,
                format!(
                    "card {uuid} on {name} is over 100 % with this pod; no pod is placed on {name} \
                     until its assignments agree with the kubelet's again"
                ),
            );
        }
    }
}

/// The GPU memory a grant holds on `card`: what the assignment records, else (no memory asked) its
/// percent of the card's memory, the engine's rule ([`nano_gpu_engine::request::SlotDemand::mem_on`]).
pub(super) fn held_memory(g: &CardGrant, card: &Card) -> MiB {
    g.memory_held(card.mem_total)
}

/// Takes `percent` and `memory` from `card`; false (and the card full) when the card does not have the
/// percent left.
fn take(card: &mut Card, percent: Percent, memory: MiB) -> bool {
    if card.free < percent {
        card.free = Percent::ZERO;
        return false;
    }
    card.free -= percent;
    card.mem_free = card.mem_free.saturating_sub(memory);
    true
}
