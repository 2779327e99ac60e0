//! The cluster model the engine decides on: nodes with CPU, memory and cards; cards with a model, free
//! percent, free memory and health. Every change to a node gives it a new version, so per-node values
//! computed by policies can be cached and reused until the node changes.

use nano_gpu_proto::units::{MiB, Percent};
use std::collections::HashMap;

/// A map keyed by short strings such as node and model names, looked up thousands of times per
/// decision: foldhash's fast hash with its fixed seed (the same order on every run, so replays
/// stay deterministic).
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// A share (or a whole card) granted to one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Grant {
    /// Slot index in the request.
    pub slot: usize,
    /// Position of the card in the node's card list.
    pub card: usize,
    /// Share of the card taken.
    pub percent: Percent,
    /// Card memory taken ([`crate::request::SlotDemand::mem_on`]).
    pub mem: MiB,
}

/// Index of a card model in the cluster's [`Models`] table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelId(pub u16);

/// Index of a node in the [`Cluster`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub usize);

/// Interned card model names. A model matches a request by its name or its label form.
#[derive(Clone, Debug, Default)]
pub struct Models {
    names: Vec<String>,
    by_name: FastMap<String, ModelId>,
}

impl Models {
    /// The id of `name`, adding it if new.
    pub fn intern(&mut self, name: &str) -> ModelId {
        if let Some(id) = self.by_name.get(name) {
            return *id;
        }
        let id = ModelId(self.names.len() as u16);
        self.names.push(name.to_owned());
        self.by_name.insert(name.to_owned(), id);
        let label = nano_gpu_proto::annotations::label_value(name);
        self.by_name.entry(label).or_insert(id);
        id
    }

    /// The id of a known model name (or label form).
    pub fn get(&self, name: &str) -> Option<ModelId> {
        self.by_name.get(name).copied()
    }

    /// The name of a model.
    pub fn name(&self, id: ModelId) -> &str {
        &self.names[usize::from(id.0)]
    }
}

/// One GPU card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Card {
    /// Stable identifier.
    pub uuid: String,
    /// Index on its node.
    pub index: u32,
    /// Model.
    pub model: ModelId,
    /// Free share of the card (0..=100 %).
    pub free: Percent,
    /// Total memory (0 if unknown: memory is then not accounted on this card).
    pub mem_total: MiB,
    /// Free memory.
    pub mem_free: MiB,
    /// Whether the card may take new work.
    pub healthy: bool,
}

impl Card {
    /// A free, healthy card.
    pub fn new(uuid: impl Into<String>, index: u32, model: ModelId, mem_total: MiB) -> Self {
        Card {
            uuid: uuid.into(),
            index,
            model,
            free: Percent::FULL,
            mem_total,
            mem_free: mem_total,
            healthy: true,
        }
    }

    /// The share this card can still hand out (an unhealthy card hands out nothing).
    pub fn usable(&self) -> Percent {
        if self.healthy { self.free } else { Percent::ZERO }
    }

    /// Whether the card's memory is accounted (its total is known).
    pub fn has_memory(&self) -> bool {
        self.mem_total > MiB::ZERO
    }
}

/// What a placement takes of a node besides its cards: host CPU (milli) and memory (MiB), and the
/// `nano-gpu/gpu-percent` device IDs it asks of the kubelet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Host {
    /// Host CPU in millicores.
    pub cpu: u64,
    /// Host memory in MiB.
    pub mem: u64,
    /// `nano-gpu/gpu-percent` device IDs.
    pub ids: u64,
}

/// One node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Node name.
    pub name: String,
    /// Allocatable CPU in millicores.
    pub cpu_total: u64,
    /// CPU not yet requested.
    pub cpu_free: u64,
    /// Allocatable memory in MiB.
    pub mem_total: u64,
    /// Memory not yet requested.
    pub mem_free: u64,
    /// The `nano-gpu/gpu-percent` device IDs its kubelet has (allocatable), where the view knows
    /// them: the kubelet admits a pod only while the IDs its pods ask fit in them. `None` (the
    /// simulator's nodes) checks nothing.
    pub ids_total: Option<u64>,
    /// Of those, the IDs the node's pods do not ask.
    pub ids_free: u64,
    /// Cards in index order.
    pub cards: Vec<Card>,
    /// Whether the node takes new pods (false once it is gone from the API).
    pub schedulable: bool,
    /// Whether the node's cards are served to its kubelet now (false while its agent is not Ready: the
    /// kubelet would fail the pods it admits). A node that does not serve takes no new pod.
    pub serving: bool,
    /// Whether the node's cards are served through DRA instead (its agent's `nano-gpu/front-end`
    /// label): it takes no GPU share, and pods asking no GPU as any node.
    pub dra: bool,
    /// Changes whenever anything above changes; unique across the cluster's life.
    pub version: u64,
}

impl Node {
    /// An empty node.
    pub fn new(name: impl Into<String>, cpu_total: u64, mem_total: u64, cards: Vec<Card>) -> Self {
        Node {
            name: name.into(),
            cpu_total,
            cpu_free: cpu_total,
            mem_total,
            mem_free: mem_total,
            ids_total: None,
            ids_free: 0,
            cards,
            schedulable: true,
            serving: true,
            dra: false,
            version: 0,
        }
    }

    /// The node with `total` device IDs at its kubelet, none of them asked yet.
    pub fn with_ids(self, total: u64) -> Self {
        Node { ids_total: Some(total), ids_free: total, ..self }
    }

    /// Total free percent over the healthy cards.
    pub fn gpu_free(&self) -> Percent {
        self.cards.iter().map(Card::usable).sum()
    }

    /// Percent of all cards in use (unhealthy cards count as capacity that is not allocated).
    pub fn gpu_used(&self) -> Percent {
        self.cards.iter().map(|c| Percent::FULL - c.free).sum()
    }
}

/// Why a node or cluster change was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// No node of that name.
    #[error("unknown node {0}")]
    UnknownNode(String),
    /// A node of that name exists already.
    #[error("node {0} exists already")]
    DuplicateNode(String),
    /// Applying the placement would over-commit something.
    #[error("node {node}: {what}")]
    Overcommit {
        /// Node name.
        node: String,
        /// What would be over-committed.
        what: String,
    },
}

/// All nodes, by id and by name.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    nodes: Vec<Node>,
    by_name: FastMap<String, NodeId>,
    /// Card model names.
    pub models: Models,
    supply: Vec<u32>,
    /// CPU (millicores) and cards of every node, kept with `supply`.
    cpu_total: u64,
    cards_total: u64,
    clock: u64,
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node; its version is fresh.
    pub fn add_node(&mut self, node: Node) -> Result<NodeId, ModelError> {
        if self.by_name.contains_key(&node.name) {
            return Err(ModelError::DuplicateNode(node.name));
        }
        Ok(self.upsert_node(node))
    }

    /// Adds a node, or replaces the node of the same name (keeping its id); its version is fresh.
    pub fn upsert_node(&mut self, mut node: Node) -> NodeId {
        self.clock += 1;
        node.version = self.clock;
        self.count_supply(&node, 1);
        match self.by_name.get(&node.name) {
            Some(&id) => {
                let old = std::mem::replace(&mut self.nodes[id.0], node);
                self.count_supply(&old, -1);
                id
            }
            None => {
                let id = NodeId(self.nodes.len());
                self.by_name.insert(node.name.clone(), id);
                self.nodes.push(node);
                id
            }
        }
    }

    /// Marks a node gone: it keeps its id (and name) but has no cards and takes no pods.
    pub fn remove_node(&mut self, name: &str) {
        if let Some(&id) = self.by_name.get(name) {
            let mut gone = Node::new(name, 0, 0, Vec::new());
            gone.schedulable = false;
            self.upsert_node(gone);
            debug_assert_eq!(self.by_name.get(name), Some(&id));
        }
    }

    fn count_supply(&mut self, node: &Node, sign: i64) {
        let add = |total: u64, n: u64| if sign > 0 { total + n } else { total.saturating_sub(n) };
        self.cpu_total = add(self.cpu_total, node.cpu_total);
        self.cards_total = add(self.cards_total, node.cards.len() as u64);
        for c in &node.cards {
            let m = usize::from(c.model.0);
            if self.supply.len() <= m {
                self.supply.resize(m + 1, 0);
            }
            self.supply[m] = (i64::from(self.supply[m]) + sign).max(0) as u32;
        }
    }

    /// All nodes, indexed by [`NodeId`].
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// The id of a node by name.
    pub fn id(&self, name: &str) -> Option<NodeId> {
        self.by_name.get(name).copied()
    }

    /// Changes a node through `f` and gives it a new version.
    pub fn update<R>(&mut self, id: NodeId, f: impl FnOnce(&mut Node) -> R) -> R {
        self.clock += 1;
        let node = &mut self.nodes[id.0];
        node.version = self.clock;
        f(node)
    }

    /// Takes the resources of a placement; refuses (changing nothing) if anything would over-commit.
    pub fn apply(&mut self, node: NodeId, host: Host, grants: &[Grant]) -> Result<(), ModelError> {
        let Host { cpu, mem, ids } = host;
        let n = &self.nodes[node.0];
        let over = |what: String| ModelError::Overcommit { node: n.name.clone(), what };
        if cpu > n.cpu_free {
            return Err(over(format!("cpu {cpu}m > {}m free", n.cpu_free)));
        }
        if mem > n.mem_free {
            return Err(over(format!("memory {mem} MiB > {} MiB free", n.mem_free)));
        }
        if n.ids_total.is_some() && ids > n.ids_free {
            return Err(over(format!("device IDs {ids} > {} free", n.ids_free)));
        }
        let mut want: HashMap<usize, (Percent, MiB)> = HashMap::new();
        for g in grants {
            let e = want.entry(g.card).or_default();
            e.0 += g.percent;
            e.1 += g.mem;
        }
        for (&card, &(percent, mem)) in &want {
            let c = n.cards.get(card).ok_or_else(|| over(format!("no card at position {card}")))?;
            if percent > c.usable() || (c.has_memory() && mem > c.mem_free) {
                return Err(over(format!(
                    "card {}: {percent} and {mem} asked, {} and {} free",
                    c.index,
                    c.usable(),
                    c.mem_free
                )));
            }
        }
        self.update(node, |n| {
            n.cpu_free -= cpu;
            n.mem_free -= mem;
            if n.ids_total.is_some() {
                n.ids_free -= ids;
            }
            for (card, (percent, mem)) in want {
                let c = &mut n.cards[card];
                c.free -= percent;
                c.mem_free = c.mem_free.saturating_sub(mem);
            }
        });
        Ok(())
    }

    /// Gives back what [`Cluster::apply`] took. Never frees beyond capacity.
    pub fn release(&mut self, node: NodeId, host: Host, grants: &[Grant]) {
        let Host { cpu, mem, ids } = host;
        self.update(node, |n| {
            n.cpu_free = (n.cpu_free + cpu).min(n.cpu_total);
            n.mem_free = (n.mem_free + mem).min(n.mem_total);
            if let Some(total) = n.ids_total {
                n.ids_free = (n.ids_free + ids).min(total);
            }
            for g in grants {
                if let Some(c) = n.cards.get_mut(g.card) {
                    c.free = (c.free + g.percent).min(Percent::FULL);
                    c.mem_free = (c.mem_free + g.mem).min(c.mem_total);
                }
            }
        });
    }

    /// Cards per model, indexed by [`ModelId`].
    pub fn supply(&self) -> &[u32] {
        &self.supply
    }

    /// CPU (millicores) per card over the whole cluster; 0 without cards.
    pub fn cpu_per_card(&self) -> f64 {
        if self.cards_total == 0 { 0.0 } else { self.cpu_total as f64 / self.cards_total as f64 }
    }

    /// Total cards in the cluster.
    pub fn card_count(&self) -> usize {
        self.nodes.iter().map(|n| n.cards.len()).sum()
    }
}
