//! The allocator's view of the cluster, fed by watch events on Nodes and Pods.
//!
//! Everything comes from the API: a node's cards from its `nano-gpu/gpus` annotation, its CPU and
//! memory from `status.allocatable`; what each pod holds from its `nano-gpu/assignment` annotation (GPU)
//! and its requests (CPU, memory). Watches call [`ClusterState::apply_node`], [`ClusterState::delete_node`],
//! [`ClusterState::apply_pod`], [`ClusterState::delete_pod`] and the `reset_*` methods (a re-list), and
//! every change rebuilds only the node it touches, so the engine's per-node cache stays valid elsewhere.
//!
//! Fail closed: a node inventory that cannot be decoded gives the node no usable card; an assignment
//! that cannot be decoded (or names another node) makes every card of its node count as full until the
//! pod goes away. Both raise a [`Warning`] for an Event naming the object.
//!
//! A bind reserves the cards in memory before the API calls ([`ClusterState::reserve`]); the reservation
//! lives until the watch shows the annotated pod, so back-to-back decisions never double-book, and a
//! failed bind gives it back ([`ClusterState::release`]).

use nano_gpu_engine::engine::Engine;
use crate::extender::{BindError, Bound, Extender};
use nano_gpu_engine::model::{Card, Node};
use nano_gpu_engine::request::{Tightest, fit};
use nano_gpu_engine::workload::Learner;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use nano_gpu_proto::annotations::rfc3339;
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, DecodeError, GPUS_ANNOTATION, NodeInventory,
};
use nano_gpu_proto::demand::{DemandOptions, GpushareUnit, pod_demand};
use nano_gpu_proto::extender::{ExtenderArgs, ExtenderFilterResult, HostPriorityList, MetaVictims};
use nano_gpu_proto::gpushare;
use nano_gpu_proto::quantity;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

/// Something wrong with an object that a person should hear about (becomes a warning Event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// `Node` or `Pod`.
    pub kind: &'static str,
    /// Namespace (empty for nodes).
    pub namespace: String,
    /// Object name.
    pub name: String,
    /// Short machine-readable reason.
    pub reason: &'static str,
    /// What is wrong.
    pub message: String,
}

/// What a node object says.
#[derive(Clone, Debug, PartialEq)]
struct NodeRecord {
    cpu: u64,
    mem: u64,
    inventory: Option<Result<NodeInventory, DecodeError>>,
}

/// What a pod holds.
#[derive(Clone, Debug, PartialEq)]
enum Holding {
    /// Only CPU and memory.
    Nothing,
    /// The cards of its assignment.
    Cards(Assignment),
    /// An assignment that cannot be trusted: every card of the node counts as full.
    Unknown(String),
}

#[derive(Clone, Debug, PartialEq)]
struct PodRecord {
    key: (String, String),
    node: String,
    cpu: u64,
    mem: u64,
    holding: Holding,
    /// Made by our bind and not yet seen annotated in a watch event.
    reserved: bool,
}

/// The cluster view: node and pod records, and the extender deciding over them.
pub struct ClusterState {
    extender: Extender,
    learner: Option<Learner>,
    nodes: BTreeMap<String, NodeRecord>,
    pods: HashMap<String, PodRecord>,
    /// Node name → uids of the pods on it.
    by_node: HashMap<String, HashSet<String>>,
    /// During a re-list: the names and uids seen so far.
    relisting_nodes: Option<HashSet<String>>,
    relisting_pods: Option<HashSet<String>>,
    warnings: Vec<Warning>,
}

/// The view as the service shares it: the watches write to it, the handlers decide on it, one at a
/// time; and whether the watches have listed everything yet.
pub struct SharedView {
    state: Mutex<ClusterState>,
    synced: AtomicBool,
}

impl SharedView {
    /// Shares `state`, not yet listed.
    pub fn new(state: ClusterState) -> Self {
        SharedView { state: Mutex::new(state), synced: AtomicBool::new(false) }
    }

    /// The view, for one decision or one watch event.
    pub fn lock(&self) -> MutexGuard<'_, ClusterState> {
        // A panic while holding the lock cannot leave the view half-changed in a way that matters more
        // than stopping every decision would, so a poisoned lock is used as is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the node and pod watches have listed everything.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// The node and pod watches have listed everything.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }
}

fn pod_uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref()
}

fn is_terminal(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

impl ClusterState {
    /// An empty view deciding with `engine` (whose cluster should start empty).
    pub fn new(engine: Engine, salt: u64, demand: DemandOptions) -> Self {
        ClusterState {
            extender: Extender::new(engine, salt, demand),
            learner: None,
            nodes: BTreeMap::new(),
            pods: HashMap::new(),
            by_node: HashMap::new(),
            relisting_nodes: None,
            relisting_pods: None,
            warnings: Vec::new(),
        }
    }

    /// Learns the target workload from the pods it binds (rebuilt every `every` binds).
    pub fn learn_workload(mut self, every: u64) -> Self {
        self.learner = Some(Learner::new(every));
        self
    }

    /// The extender deciding over this view.
    pub fn extender(&self) -> &Extender {
        &self.extender
    }

    /// Warnings raised since the last call.
    pub fn take_warnings(&mut self) -> Vec<Warning> {
        std::mem::take(&mut self.warnings)
    }

    fn warn(&mut self, kind: &'static str, ns: &str, name: &str, reason: &'static str, message: String) {
        tracing::warn!(kind, namespace = ns, name, reason, %message, "fail closed");
        self.warnings.push(Warning {
            kind,
            namespace: ns.to_owned(),
            name: name.to_owned(),
            reason,
            message,
        });
    }

    /// A Node was added or changed.
    pub fn apply_node(&mut self, node: &KubeNode) {
        let Some(name) = node.metadata.name.clone() else { return };
        if let Some(seen) = self.relisting_nodes.as_mut() {
            seen.insert(name.clone());
        }
        let alloc = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let read = |key: &str, parse: fn(&str) -> Result<u64, quantity::QuantityError>| {
            alloc.and_then(|a| a.get(key)).and_then(|q| parse(&q.0).ok()).unwrap_or(0)
        };
        let inventory = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(GPUS_ANNOTATION))
            .map(|text| NodeInventory::decode(text));
        if let Some(Err(e)) = &inventory {
            self.warn("Node", "", &name, "InvalidInventory", format!("{e}; its cards are treated as full"));
        }
        let record = NodeRecord {
            cpu: read("cpu", quantity::cpu_milli),
            mem: read("memory", quantity::mebibytes),
            inventory,
        };
        if self.nodes.get(&name) != Some(&record) {
            self.nodes.insert(name.clone(), record);
            self.rebuild(&name);
        }
    }

    /// A Node was deleted.
    pub fn delete_node(&mut self, name: &str) {
        if self.nodes.remove(name).is_some() {
            self.extender.engine_mut().cluster_mut().remove_node(name);
        }
    }

    /// A re-list of nodes starts: nodes not applied before [`ClusterState::end_node_relist`] are gone.
    pub fn begin_node_relist(&mut self) {
        self.relisting_nodes = Some(HashSet::new());
    }

    /// The re-list of nodes is complete.
    pub fn end_node_relist(&mut self) {
        let Some(seen) = self.relisting_nodes.take() else { return };
        let gone: Vec<String> = self.nodes.keys().filter(|n| !seen.contains(*n)).cloned().collect();
        for name in gone {
            self.delete_node(&name);
        }
    }

    /// Replaces every node (a re-list in one go).
    pub fn reset_nodes(&mut self, nodes: &[KubeNode]) {
        self.begin_node_relist();
        for n in nodes {
            self.apply_node(n);
        }
        self.end_node_relist();
    }

    /// A Pod was added or changed.
    pub fn apply_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod_uid(pod).map(str::to_owned) else { return };
        if let Some(seen) = self.relisting_pods.as_mut() {
            seen.insert(uid.clone());
        }
        if is_terminal(pod) {
            self.forget_pod(&uid);
            return;
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let annotation = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION));
        let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let holding = match annotation.map(|t| Assignment::decode(t)) {
            None => Holding::Nothing,
            Some(Ok(a)) if bound_to.as_ref().is_none_or(|n| *n == a.node) => Holding::Cards(a),
            Some(Ok(a)) => Holding::Unknown(format!(
                "{ASSIGNMENT_ANNOTATION} names node {} but the pod is bound to {}",
                a.node,
                bound_to.as_deref().unwrap_or("")
            )),
            Some(Err(e)) => Holding::Unknown(e.to_string()),
        };
        // A pod our bind just reserved keeps its reservation until an event shows the annotation.
        if holding == Holding::Nothing && self.pods.get(&uid).is_some_and(|p| p.reserved) {
            return;
        }
        let node = match (&bound_to, &holding) {
            (Some(n), _) => n.clone(),
            (None, Holding::Cards(a)) => a.node.clone(),
            // Pending and unassigned: holds nothing anywhere yet.
            (None, _) => {
                self.forget_pod(&uid);
                return;
            }
        };
        if let Holding::Unknown(why) = &holding {
            self.warn(
                "Pod",
                &ns,
                &name,
                "InvalidAssignment",
                format!("{why}; every card of {node} is treated as full"),
            );
        }
        let (cpu, mem) = match pod_demand(pod, &DemandOptions::default()) {
            Ok(d) => (d.cpu.0, d.memory.0),
            Err(_) => (0, 0),
        };
        let record = PodRecord { key: (ns, name), node: node.clone(), cpu, mem, holding, reserved: false };
        let previous = self.insert_pod(uid, record.clone());
        if previous.as_ref() != Some(&record) {
            if let Some(p) = previous.filter(|p| p.node != node) {
                self.rebuild(&p.node);
            }
            self.rebuild(&node);
        }
    }

    /// A Pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        if let Some(uid) = pod_uid(pod) {
            self.forget_pod(uid);
        }
    }

    fn forget_pod(&mut self, uid: &str) {
        if let Some(p) = self.remove_pod(uid) {
            self.rebuild(&p.node);
        }
    }

    /// Records a pod, keeping the node index; returns the record it replaces.
    fn insert_pod(&mut self, uid: String, record: PodRecord) -> Option<PodRecord> {
        self.by_node.entry(record.node.clone()).or_default().insert(uid.clone());
        let previous = self.pods.insert(uid.clone(), record);
        if let Some(p) = &previous
            && self.pods.get(&uid).is_some_and(|now| now.node != p.node)
        {
            self.unindex(&uid, &p.node);
        }
        previous
    }

    fn remove_pod(&mut self, uid: &str) -> Option<PodRecord> {
        let p = self.pods.remove(uid)?;
        self.unindex(uid, &p.node);
        Some(p)
    }

    fn unindex(&mut self, uid: &str, node: &str) {
        if let Some(set) = self.by_node.get_mut(node) {
            set.remove(uid);
            if set.is_empty() {
                self.by_node.remove(node);
            }
        }
    }

    /// A re-list of pods starts: pods not applied before [`ClusterState::end_pod_relist`] are gone
    /// (reservations of binds in flight are kept).
    pub fn begin_pod_relist(&mut self) {
        self.relisting_pods = Some(HashSet::new());
    }

    /// The re-list of pods is complete.
    pub fn end_pod_relist(&mut self) {
        let Some(seen) = self.relisting_pods.take() else { return };
        let gone: Vec<String> = self
            .pods
            .iter()
            .filter(|(uid, p)| !p.reserved && !seen.contains(*uid))
            .map(|(u, _)| u.clone())
            .collect();
        for uid in gone {
            self.forget_pod(&uid);
        }
    }

    /// Replaces every pod (a re-list in one go).
    pub fn reset_pods(&mut self, pods: &[Pod]) {
        self.begin_pod_relist();
        for p in pods {
            self.apply_pod(p);
        }
        self.end_pod_relist();
    }

    /// Recomputes one node of the engine's cluster from its record and the pods on it.
    fn rebuild(&mut self, name: &str) {
        let Some(record) = self.nodes.get(name) else { return };
        let cluster = self.extender.engine_mut().cluster_mut();
        let cards: Vec<Card> = match &record.inventory {
            Some(Ok(inv)) => inv
                .gpus
                .iter()
                .map(|g| {
                    let model = cluster.models.intern(&g.model);
                    let mut c = Card::new(g.uuid.clone(), g.index, model, g.memory_mib.0);
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
                            Some(c) if c.free >= g.percent.0 => {
                                c.free -= g.percent.0;
                                c.mem_free = c.mem_free.saturating_sub(g.memory_mib.map_or(0, |m| m.0));
                            }
                            Some(c) => {
                                c.free = 0;
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
                c.free = 0;
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

    /// `POST /filter`.
    pub fn filter(&mut self, args: ExtenderArgs) -> ExtenderFilterResult {
        self.extender.filter(args)
    }

    /// `POST /prioritize`.
    pub fn prioritize(&mut self, args: ExtenderArgs) -> HostPriorityList {
        self.extender.prioritize(args)
    }

    /// `POST /filter` with the node names borrowed from the request.
    pub fn filter_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> ExtenderFilterResult<N> {
        self.extender.filter_names(pod, names)
    }

    /// `POST /prioritize` with the node names borrowed from the request.
    pub fn prioritize_names<N: AsRef<str>>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> HostPriorityList<N> {
        self.extender.prioritize_names(pod, names)
    }

    /// Chooses the cards for `pod` on `node` and reserves them. A pod that already holds cards on that
    /// node (kube-scheduler retrying a bind) gets the same assignment again.
    pub fn reserve(&mut self, pod: &Pod, node: &str, now: SystemTime) -> Result<Reservation, BindError> {
        let uid = pod_uid(pod).ok_or_else(|| BindError::Invalid("pod has no uid".into()))?.to_owned();
        if let Some(existing) = self.pods.get(&uid) {
            if let (Holding::Cards(a), true) = (&existing.holding, existing.node == node) {
                let annotations = self.annotations(pod, a, now);
                return Ok(Reservation { uid, assignment: a.clone(), annotations, fresh: false });
            }
            self.forget_pod(&uid);
        }
        let Bound { assignment, req, .. } = self.extender.bind(pod, node, &rfc3339(now))?;
        if let Some(workload) = self.learner.as_mut().and_then(|l| l.observe(&req)) {
            self.extender.engine_mut().set_workload(workload);
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let record = PodRecord {
            key: (ns, name),
            node: node.to_owned(),
            cpu: req.cpu,
            mem: req.mem,
            holding: Holding::Cards(assignment.clone()),
            reserved: true,
        };
        self.insert_pod(uid.clone(), record);
        self.rebuild(node);
        let annotations = self.annotations(pod, &assignment, now);
        Ok(Reservation { uid, assignment, annotations, fresh: true })
    }

    /// The annotations a bind writes: the assignment, and gpushare's for pods that ask
    /// `aliyun.com/gpu-mem` when compatibility is on.
    fn annotations(&self, pod: &Pod, assignment: &Assignment, now: SystemTime) -> BTreeMap<String, String> {
        let mut out = BTreeMap::from([(ASSIGNMENT_ANNOTATION.to_owned(), assignment.encode())]);
        let Some(unit) = self.extender.demand_options().gpushare else { return out };
        let units = gpushare::pod_units(pod);
        let cluster = self.extender.engine().cluster();
        let card = cluster.id(&assignment.node).and_then(|id| {
            let first = assignment.held().next()?;
            cluster.node(id).cards.iter().find(|c| c.uuid == first.uuid)
        });
        if let (true, Some(card)) = (units > 0, card) {
            let dev = match unit {
                GpushareUnit::GiB => card.mem_total / 1024,
                GpushareUnit::MiB => card.mem_total,
            };
            let ns = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            out.extend(gpushare::annotations(card.index, units, dev, ns));
        }
        out
    }

    /// Gives back a reservation whose bind failed.
    pub fn release(&mut self, reservation: &Reservation) {
        if reservation.fresh {
            self.forget_pod(&reservation.uid);
        }
    }

    /// `POST /preempt`: for each node kube-scheduler proposes, keeps it only if evicting its victims
    /// really frees a card (or cards) the pod fits on, and drops the victims that are not needed for
    /// that. Victims this view does not know are kept (they hold no card, but may hold CPU or memory
    /// kube-scheduler counted).
    pub fn preempt(
        &self,
        pod: &Pod,
        proposed: &BTreeMap<String, MetaVictims>,
    ) -> Result<BTreeMap<String, MetaVictims>, String> {
        let (_, req) = self.extender.request(pod)?;
        let cluster = self.extender.engine().cluster();
        let mut out = BTreeMap::new();
        for (node, victims) in proposed {
            let Some(id) = cluster.id(node) else { continue };
            let base = cluster.node(id);
            let fits_without = |evicted: &[&str]| {
                let mut n = base.clone();
                for uid in evicted {
                    if let Some(p) = self.pods.get(*uid).filter(|p| p.node == *node) {
                        free_record(&mut n, p);
                    }
                }
                fit(&n, &req, &mut Tightest).is_ok()
            };
            let mut evict: Vec<&str> = victims.pods.iter().map(|v| v.uid.as_str()).collect();
            if !fits_without(&evict) {
                continue; // evicting them would not make room on any card: no preemption here
            }
            // Keep every victim whose eviction is not needed, largest holders last.
            let mut order = evict.clone();
            order.sort_by_key(|uid| std::cmp::Reverse(self.pods.get(*uid).map_or(0, held_percent)));
            for uid in order.into_iter().rev() {
                if !self.pods.contains_key(uid) {
                    continue;
                }
                let without: Vec<&str> = evict.iter().copied().filter(|v| *v != uid).collect();
                if fits_without(&without) {
                    evict = without;
                }
            }
            let pods = victims.pods.iter().filter(|v| evict.contains(&v.uid.as_str())).cloned().collect();
            out.insert(node.clone(), MetaVictims { pods, num_pdb_violations: victims.num_pdb_violations });
        }
        Ok(out)
    }

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
                        .filter(
                            |p| matches!(&p.holding, Holding::Cards(a) if a.held().any(|g| g.uuid == c.uuid)),
                        )
                        .map(|p| format!("{}/{}", p.key.0, p.key.1))
                        .collect();
                    let mut pods = pods;
                    pods.sort();
                    serde_json::json!({
                        "index": c.index, "uuid": c.uuid, "model": cluster.models.name(c.model),
                        "healthy": c.healthy, "percentUsed": 100 - c.free, "percentFree": c.free,
                        "memoryMiB": c.mem_total, "memoryFreeMiB": c.mem_free, "pods": pods,
                    })
                })
                .collect();
            nodes.push(serde_json::json!({
                "name": name, "cpuMilli": n.cpu_total, "cpuFreeMilli": n.cpu_free,
                "memoryMiB": n.mem_total, "memoryFreeMiB": n.mem_free, "cards": cards,
            }));
        }
        serde_json::json!({ "nodes": nodes })
    }
}

/// Percent of cards a pod holds.
fn held_percent(p: &PodRecord) -> u32 {
    match &p.holding {
        Holding::Cards(a) => a.held().map(|g| g.percent.0).sum(),
        _ => 0,
    }
}

/// Gives a pod's CPU, memory and cards back to a copy of its node.
fn free_record(n: &mut Node, p: &PodRecord) {
    n.cpu_free = (n.cpu_free + p.cpu).min(n.cpu_total);
    n.mem_free = (n.mem_free + p.mem).min(n.mem_total);
    if let Holding::Cards(a) = &p.holding {
        for g in a.held() {
            if let Some(c) = n.cards.iter_mut().find(|c| c.uuid == g.uuid) {
                c.free = (c.free + g.percent.0).min(100);
                c.mem_free = (c.mem_free + g.memory_mib.map_or(0, |m| m.0)).min(c.mem_total);
            }
        }
    }
}

/// Cards reserved for a pod by [`ClusterState::reserve`].
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    /// Pod UID.
    pub uid: String,
    /// The assignment.
    pub assignment: Assignment,
    /// Every annotation to write: the encoded assignment, and gpushare's when they apply.
    pub annotations: BTreeMap<String, String>,
    /// False when the pod already held this assignment (a repeated bind): nothing to give back.
    pub fresh: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_engine::policy;
    use nano_gpu_engine::workload::Workload;
    use serde_json::json;

    fn state() -> ClusterState {
        let engine = Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            policy::by_name("fgd-balance", 0).unwrap(),
            Workload::default(),
        );
        ClusterState::new(engine, 1, DemandOptions::default())
    }

    fn node(name: &str, cards: usize) -> KubeNode {
        let gpus: Vec<_> = (0..cards)
            .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": "T4", "memoryMiB": 15360, "healthy": true}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()}},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}}
        }))
        .unwrap()
    }

    fn pod(uid: &str, percent: &str, node: Option<&str>, assignment: Option<String>) -> Pod {
        let mut annotations = serde_json::Map::new();
        if let Some(a) = assignment {
            annotations.insert("nano-gpu/assignment".into(), a.into());
        }
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent, "cpu": "1"}}}]}
        }))
        .unwrap()
    }

    fn free(s: &ClusterState, node: &str) -> Vec<u32> {
        let c = s.extender().engine().cluster();
        c.node(c.id(node).unwrap()).cards.iter().map(|c| c.free).collect()
    }

    fn assignment(node: &str, card: u32, percent: u32) -> String {
        format!(
            r#"{{"v":1,"node":"{node}","at":"t","containers":{{"c":[{{"uuid":"GPU-{node}-{card}","index":{card},"percent":{percent}}}]}}}}"#
        )
    }

    #[test]
    fn bound_pods_take_their_assigned_cards() {
        let mut s = state();
        s.apply_node(&node("n1", 2));
        s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 1, 30))));
        assert_eq!(free(&s, "n1"), vec![100, 70]);
        let c = s.extender().engine().cluster();
        assert_eq!(c.node(c.id("n1").unwrap()).cpu_free, 15_000);
    }

    #[test]
    fn terminal_or_deleted_pods_release_their_cards() {
        let mut s = state();
        s.apply_node(&node("n1", 1));
        let mut p = pod("a", "30", Some("n1"), Some(assignment("n1", 0, 30)));
        s.apply_pod(&p);
        p.status = Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
        s.apply_pod(&p);
        assert_eq!(free(&s, "n1"), vec![100]);
        s.apply_pod(&pod("b", "50", Some("n1"), Some(assignment("n1", 0, 50))));
        s.delete_pod(&pod("b", "50", None, None));
        assert_eq!(free(&s, "n1"), vec![100]);
    }

    #[test]
    fn an_undecodable_assignment_fails_closed_and_warns() {
        let mut s = state();
        s.apply_node(&node("n1", 2));
        s.apply_pod(&pod("a", "30", Some("n1"), Some("{not json".into())));
        assert_eq!(free(&s, "n1"), vec![0, 0]);
        let w = s.take_warnings();
        assert_eq!((w[0].kind, w[0].name.as_str(), w[0].reason), ("Pod", "a", "InvalidAssignment"));
        // An assignment naming another node than the binding is not trusted either.
        s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n2", 0, 30))));
        assert_eq!(free(&s, "n1"), vec![0, 0]);
        s.delete_pod(&pod("a", "30", None, None));
        assert_eq!(free(&s, "n1"), vec![100, 100]);
    }

    #[test]
    fn an_undecodable_inventory_gives_the_node_no_usable_card() {
        let mut s = state();
        let mut n = node("n1", 2);
        n.metadata.annotations.as_mut().unwrap().insert(GPUS_ANNOTATION.into(), r#"{"v":9}"#.into());
        s.apply_node(&n);
        let w = s.take_warnings();
        assert_eq!((w[0].kind, w[0].reason), ("Node", "InvalidInventory"));
        let r = s.filter(
            serde_json::from_value(json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]})).unwrap(),
        );
        assert_eq!(r.node_names, Some(vec![]));
    }

    #[test]
    fn a_reservation_survives_a_stale_event_and_is_confirmed_by_the_annotated_one() {
        let mut s = state();
        s.apply_node(&node("n1", 1));
        let p = pod("a", "60", None, None);
        let r = s.reserve(&p, "n1", SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(free(&s, "n1"), vec![40]);
        // A watch event from before the PATCH must not drop the reservation.
        s.apply_pod(&p);
        assert_eq!(free(&s, "n1"), vec![40]);
        // Another pod cannot double-book the card.
        assert!(s.reserve(&pod("b", "60", None, None), "n1", SystemTime::UNIX_EPOCH).is_err());
        // The annotated, bound pod confirms it; a repeated bind returns the same assignment.
        s.apply_pod(&pod("a", "60", Some("n1"), Some(r.assignment.encode())));
        assert_eq!(free(&s, "n1"), vec![40]);
        let again = s.reserve(&p, "n1", SystemTime::now()).unwrap();
        assert_eq!((again.assignment, again.fresh), (r.assignment, false));
    }

    #[test]
    fn preemption_keeps_only_nodes_where_a_card_really_frees_and_only_the_victims_needed() {
        use nano_gpu_proto::extender::MetaPod;
        let mut s = state();
        s.apply_node(&node("n1", 2));
        s.apply_node(&node("n2", 2));
        // n1: 60 % + 30 % on card 0, 70 % on card 1. n2: 40 % + 30 % on card 0, 40 % on card 1.
        s.apply_pod(&pod("a", "60", Some("n1"), Some(assignment("n1", 0, 60))));
        s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 0, 30))));
        s.apply_pod(&pod("c", "70", Some("n1"), Some(assignment("n1", 1, 70))));
        s.apply_pod(&pod("d", "40", Some("n2"), Some(assignment("n2", 0, 40))));
        s.apply_pod(&pod("e", "40", Some("n2"), Some(assignment("n2", 1, 40))));
        s.apply_pod(&pod("f", "30", Some("n2"), Some(assignment("n2", 0, 30))));
        let victims = |uids: &[&str]| MetaVictims {
            pods: uids.iter().map(|u| MetaPod { uid: u.to_string() }).collect(),
            num_pdb_violations: 0,
        };
        let proposed = BTreeMap::from([
            ("n1".to_string(), victims(&["a", "b", "c"])),
            ("n2".to_string(), victims(&["d"])),
        ]);
        // A 70 % pod: on n1 evicting c alone frees card 1 (a and b need not go); on n2 evicting d
        // frees card 0.
        let out = s.preempt(&pod("p", "70", None, None), &proposed).unwrap();
        let uids = |n: &str| out[n].pods.iter().map(|p| p.uid.clone()).collect::<Vec<_>>();
        assert_eq!(uids("n1"), vec!["c"]);
        assert_eq!(uids("n2"), vec!["d"]);
        // Evicting only f's 30 % on n2 leaves 60 % free on each card: n2 is dropped.
        let proposed = BTreeMap::from([("n2".to_string(), victims(&["f"]))]);
        let out = s.preempt(&pod("p", "70", None, None), &proposed).unwrap();
        assert_eq!(out.get("n2").map(|v| v.pods.len()), None);
    }

    #[test]
    fn a_failed_bind_gives_its_reservation_back() {
        let mut s = state();
        s.apply_node(&node("n1", 1));
        let r = s.reserve(&pod("a", "60", None, None), "n1", SystemTime::UNIX_EPOCH).unwrap();
        s.release(&r);
        assert_eq!(free(&s, "n1"), vec![100]);
    }

    #[test]
    fn a_deleted_node_takes_no_pods_and_comes_back_with_its_pods() {
        let mut s = state();
        s.apply_node(&node("n1", 1));
        s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 0, 30))));
        s.delete_node("n1");
        let args: ExtenderArgs =
            serde_json::from_value(json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]})).unwrap();
        assert_eq!(s.filter(args).failed_and_unresolvable_nodes["n1"], "node is gone");
        s.apply_node(&node("n1", 1));
        assert_eq!(free(&s, "n1"), vec![70]);
    }
}

#[cfg(test)]
mod properties {
    //! State rebuilt from a list of objects equals state built from the same events one by one.
    use super::*;
    use nano_gpu_engine::policy;
    use nano_gpu_engine::workload::Workload;
    use proptest::prelude::*;
    use serde_json::json;

    #[derive(Clone, Debug)]
    enum Event {
        Node { name: usize, cards: usize, broken: bool },
        DeleteNode(usize),
        Pod { uid: usize, node: Option<usize>, card: usize, percent: u32, garbage: bool, done: bool },
        DeletePod(usize),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0usize..4, 0usize..4, proptest::bool::weighted(0.1))
                .prop_map(|(name, cards, broken)| Event::Node { name, cards, broken }),
            (0usize..4).prop_map(Event::DeleteNode),
            (
                0usize..12,
                proptest::option::of(0usize..4),
                0usize..4,
                1u32..=100,
                proptest::bool::weighted(0.1),
                proptest::bool::weighted(0.1)
            )
                .prop_map(|(uid, node, card, percent, garbage, done)| Event::Pod {
                    uid,
                    node,
                    card,
                    percent,
                    garbage,
                    done
                }),
            (0usize..12).prop_map(Event::DeletePod),
        ]
    }

    fn state() -> ClusterState {
        let engine = Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            policy::by_name("fgd", 0).unwrap(),
            Workload::default(),
        );
        ClusterState::new(engine, 1, DemandOptions::default())
    }

    fn kube_node(name: usize, cards: usize, broken: bool) -> KubeNode {
        let gpus: Vec<_> = (0..cards)
            .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": "T4", "memoryMiB": 16384, "healthy": true}))
            .collect();
        let inv = if broken { "{".to_string() } else { json!({"v": 1, "gpus": gpus}).to_string() };
        serde_json::from_value(json!({
            "metadata": {"name": format!("n{name}"), "annotations": {"nano-gpu/gpus": inv}},
            "status": {"allocatable": {"cpu": "32", "memory": "64Gi"}}
        }))
        .unwrap()
    }

    fn kube_pod(
        uid: usize,
        node: Option<usize>,
        card: usize,
        percent: u32,
        garbage: bool,
        done: bool,
    ) -> Pod {
        let assignment = node.map(|n| {
            if garbage {
                "garbage".to_string()
            } else {
                format!(r#"{{"v":1,"node":"n{n}","at":"t","containers":{{"c":[{{"uuid":"GPU-{n}-{card}","index":{card},"percent":{percent}}}]}}}}"#)
            }
        });
        serde_json::from_value(json!({
            "metadata": {"name": format!("p{uid}"), "namespace": "ns", "uid": format!("u{uid}"),
                         "annotations": assignment.map(|a| json!({"nano-gpu/assignment": a})).unwrap_or(json!({}))},
            "spec": {"nodeName": node.map(|n| format!("n{n}")),
                     "containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent.to_string(), "cpu": "1"}}}]},
            "status": {"phase": if done { "Succeeded" } else { "Running" }}
        }))
        .unwrap()
    }

    fn view(s: &ClusterState) -> Vec<(String, bool, u64, Vec<u32>)> {
        let mut v: Vec<_> = s
            .extender()
            .engine()
            .cluster()
            .nodes()
            .iter()
            .filter(|n| n.schedulable)
            .map(|n| (n.name.clone(), n.schedulable, n.cpu_free, n.cards.iter().map(|c| c.free).collect()))
            .collect();
        v.sort();
        v
    }

    proptest! {
        #[test]
        fn state_from_a_list_equals_state_from_the_events(events in proptest::collection::vec(event(), 0..60)) {
            let mut one_by_one = state();
            let mut nodes: BTreeMap<usize, KubeNode> = BTreeMap::new();
            let mut pods: BTreeMap<usize, Pod> = BTreeMap::new();
            for e in events {
                match e {
                    Event::Node { name, cards, broken } => {
                        let n = kube_node(name, cards, broken);
                        one_by_one.apply_node(&n);
                        nodes.insert(name, n);
                    }
                    Event::DeleteNode(name) => {
                        one_by_one.delete_node(&format!("n{name}"));
                        nodes.remove(&name);
                    }
                    Event::Pod { uid, node, card, percent, garbage, done } => {
                        let p = kube_pod(uid, node, card, percent, garbage, done);
                        one_by_one.apply_pod(&p);
                        pods.insert(uid, p);
                    }
                    Event::DeletePod(uid) => {
                        if let Some(p) = pods.remove(&uid) {
                            one_by_one.delete_pod(&p);
                        }
                    }
                }
            }
            let mut listed = state();
            listed.reset_nodes(&nodes.values().cloned().collect::<Vec<_>>());
            listed.reset_pods(&pods.values().cloned().collect::<Vec<_>>());
            prop_assert_eq!(view(&one_by_one), view(&listed));
            // And a re-list on top of the event-built state changes nothing.
            one_by_one.reset_nodes(&nodes.values().cloned().collect::<Vec<_>>());
            one_by_one.reset_pods(&pods.values().cloned().collect::<Vec<_>>());
            prop_assert_eq!(view(&one_by_one), view(&listed));
        }
    }
}
