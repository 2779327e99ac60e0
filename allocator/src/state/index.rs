//! The index of what the watches have shown: node records by name, pod records by uid, and which
//! pods are on which node. Watch events come in through `apply_*`/`delete_*`; a re-list through
//! `begin_*_relist`, the objects, and `end_*_relist`, which forgets what the list did not mention
//! (but keeps the reservations, to be looked up: a bind in flight, or a pod deleted while the watch
//! was broken). Every change rebuilds only the nodes it touches.

use super::decode::{
    Holding, PodRecord, holding, host_requests, is_terminal, node_record, pod_uid, priority,
};
use super::{ClusterState, Unconfirmed, Waiting};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use nano_gpu_engine::model::Host;
use nano_gpu_proto::demand::pod_demand;
use nano_gpu_proto::events::Reason;
use std::collections::HashSet;

impl ClusterState {
    /// A Node was added or changed.
    pub fn apply_node(&mut self, node: &KubeNode) {
        let Some(name) = node.metadata.name.clone() else { return };
        if let Some(seen) = self.relisting_nodes.as_mut() {
            seen.insert(name.clone());
        }
        let record = node_record(node);
        if let Some(Err(e)) = &record.inventory {
            self.warn(
                "Node",
                "",
                &name,
                Reason::InvalidInventory,
                format!("{e}; its cards are treated as full"),
            );
        }
        if self.nodes.get(&name) != Some(&record) {
            self.nodes.insert(name.clone(), record);
            self.rebuild(&name);
        }
    }

    /// A Node was deleted.
    pub fn delete_node(&mut self, name: &str) {
        if self.nodes.remove(name).is_some() {
            self.extender.engine_mut().cluster_mut().remove_node(name);
            self.generation += 1;
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
        self.note_version(pod);
        let Some(uid) = pod_uid(pod).map(str::to_owned) else { return };
        if let Some(seen) = self.relisting_pods.as_mut() {
            seen.insert(uid.clone());
        }
        self.note_agent(&uid, pod);
        // Whether it waits is decided anew below. A waiting pod's every event moves the generation,
        // even one that changes nothing (kube-scheduler's status write after each try): the requeue
        // sends refused pods back to kube-scheduler on it. (Moving it only on a real change was tried
        // on 2026-12-05; a fault-suite run then left shares pending past 240 s once, not explained.)
        let waited = self.waiting.remove(&uid);
        self.apply_pod_record(uid.clone(), pod);
        if waited.is_some() || self.waiting.contains_key(&uid) {
            self.generation += 1;
        }
    }

    /// [`Self::apply_pod`] past the agent and the waiting list: the pod's record, and whether it
    /// waits ([`Self::wait`]).
    fn apply_pod_record(&mut self, uid: String, pod: &Pod) {
        let pending = !is_terminal(pod)
            && pod.metadata.deletion_timestamp.is_none()
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_none_or(str::is_empty);
        self.note_claim_pod(&uid, pod, pending);
        if !pending {
            // Bound, ended or going: it waits on no pod preempted for it.
            self.end_nomination(&uid);
        }
        if is_terminal(pod) {
            // A share nano-gpu placed (it holds an assignment: no tenant can write one) that its
            // kubelet failed for want of our devices. Not a pod bound by hand (a tenant's nodeName
            // pod asking more than is free fails so too, and could pause every node), not one a
            // re-list finds failed (it may have failed long ago).
            let placed = self
                .pods
                .get(&uid)
                .filter(|p| p.reserved || matches!(p.holding, Holding::Cards(_)))
                .map(|p| p.node.clone());
            if let Some(node) = placed.filter(|_| self.relisting_pods.is_none() && refused_for_devices(pod)) {
                let name = pod.metadata.name.as_deref().unwrap_or_default();
                self.note_kubelet_refusal(&node, name, std::time::Instant::now());
            }
            self.forget_pod(&uid);
            return;
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let (holding, read) = holding(pod, self.extender.demand_options());
        let holding = match holding {
            Ok(h) => h,
            Err(why) => {
                self.warn("Pod", &ns, &name, Reason::IgnoredAssignment, why);
                Holding::Nothing
            }
        };
        // A pod our bind just reserved keeps its reservation until an event shows the annotation; one
        // still pending is still waiting, as this event shows it (a filter's hold is taken only
        // for the request the watch shows).
        if holding == Holding::Nothing && self.pods.get(&uid).is_some_and(|p| p.reserved) {
            if bound_to.is_none() {
                self.wait(uid, pod);
            }
            return;
        }
        let node = match (&bound_to, &holding) {
            (Some(n), _) => n.clone(),
            (None, Holding::Cards(a)) => a.node.clone(),
            // Pending and unassigned: holds nothing anywhere yet; one that asks a GPU waits.
            (None, _) => {
                self.forget_pod(&uid);
                self.wait(uid, pod);
                return;
            }
        };
        if let Holding::Unknown(why) = &holding {
            self.warn(
                "Pod",
                &ns,
                &name,
                Reason::InvalidAssignment,
                format!("{why}; every card of {node} is treated as full"),
            );
        }
        let Host { cpu, mem, ids } = host_requests(pod, read.as_ref());
        let record = PodRecord {
            key: (ns, name),
            node: node.clone(),
            cpu,
            mem,
            ids,
            holding,
            reserved: false,
            priority: priority(pod),
            terminating: pod.metadata.deletion_timestamp.is_some(),
        };
        let previous = self.insert_pod(uid, record.clone());
        match previous {
            Some(p) if p == record => {}
            // A bind's reservation seen annotated, or a change only preemption weighs: no node to
            // rebuild (a GPU pod's bind would otherwise rebuild its node twice).
            Some(p) if p.takes_the_same(&record) => self.victims_changed += 1,
            previous => {
                if let Some(p) = previous.filter(|p| p.node != node) {
                    self.rebuild(&p.node);
                }
                self.rebuild(&node);
            }
        }
    }

    /// A Pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        self.note_version(pod);
        if let Some(uid) = pod_uid(pod) {
            self.set_agent(uid, None);
            self.stop_waiting(uid);
            self.invalid_requests.remove(uid);
            self.forget_claim_pod(uid);
            self.forget_pod(uid);
        }
    }

    /// Notes whether `pod` is an agent (see [`ClusterState::require_ready_agents`]), where, and
    /// whether it is Ready and not going away.
    fn note_agent(&mut self, uid: &str, pod: &Pod) {
        let Some(agents) = &self.agent_label else { return };
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let agent = match (agents.matches(pod), node) {
            (true, Some(node)) => {
                let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
                let ready =
                    conditions.into_iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
                Some((node, ready && pod.metadata.deletion_timestamp.is_none() && !is_terminal(pod)))
            }
            _ => None,
        };
        self.set_agent(uid, agent);
    }

    /// Records (or, `None`, forgets) agent pod `uid`: its node and whether it is Ready. A node whose
    /// agents changed is rebuilt: whether it serves is part of the engine's node.
    pub(super) fn set_agent(&mut self, uid: &str, agent: Option<(String, bool)>) {
        let before = match &agent {
            Some(a) => self.agents.insert(uid.to_owned(), a.clone()),
            None => self.agents.remove(uid),
        };
        if before == agent {
            return;
        }
        if let Some((node, true)) = &before
            && let Some(count) = self.ready_agents.get_mut(node)
        {
            *count -= 1;
            if *count == 0 {
                self.ready_agents.remove(node);
            }
        }
        if let Some((node, true)) = &agent {
            *self.ready_agents.entry(node.clone()).or_default() += 1;
        }
        for node in before.into_iter().chain(agent).map(|(node, _)| node) {
            self.rebuild(&node);
        }
    }

    /// Notes the resourceVersion of a pod the watch showed: the watch shows pod writes in the order
    /// they were made, so every pod write up to the newest one noted is in the view (once a re-list is
    /// done).
    fn note_version(&mut self, pod: &Pod) {
        self.pod_events = self.pod_events.wrapping_add(1);
        if let Some(v) = pod.metadata.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()) {
            self.pods_version = self.pods_version.max(v);
        }
    }

    /// Whether the view holds every pod write up to resourceVersion `version` (see
    /// [`ClusterState::note_version`]): the pod watch showed that write or a later one, and no re-list
    /// is half applied (until it ends, pods it has not reached yet are as they were before it).
    pub fn has_pods_up_to(&self, version: u64) -> bool {
        self.relisting_pods.is_none() && self.pods_version >= version
    }

    /// How many pods the watch has shown so far (see [`ClusterState::note_version`]).
    pub fn pod_events(&self) -> u64 {
        self.pod_events
    }

    pub(super) fn forget_pod(&mut self, uid: &str) {
        self.filter_holds.remove(uid);
        if let Some(p) = self.remove_pod(uid) {
            self.rebuild(&p.node);
            self.release_ended_claims();
        }
    }

    /// Records a pod, keeping the node index; returns the record it replaces.
    pub(super) fn insert_pod(&mut self, uid: String, record: PodRecord) -> Option<PodRecord> {
        self.by_node.entry(record.node.clone()).or_default().insert(uid.clone());
        self.count_pod(&record, true);
        let previous = self.pods.insert(uid.clone(), record);
        if let Some(p) = &previous {
            self.count_pod(p, false);
            if self.pods.get(&uid).is_some_and(|now| now.node != p.node) {
                self.unindex(&uid, &p.node);
            }
        }
        previous
    }

    pub(super) fn remove_pod(&mut self, uid: &str) -> Option<PodRecord> {
        let p = self.pods.remove(uid)?;
        self.count_pod(&p, false);
        self.unindex(uid, &p.node);
        Some(p)
    }

    /// Counts pod `p` in (`added`) or out of the counts by priority and of pods being deleted.
    fn count_pod(&mut self, p: &PodRecord, added: bool) {
        if p.terminating {
            self.pods_ending = if added { self.pods_ending + 1 } else { self.pods_ending.saturating_sub(1) };
            return;
        }
        let n = self.pods_by_priority.entry(p.priority).or_default();
        *n = if added { *n + 1 } else { n.saturating_sub(1) };
        if *n == 0 {
            self.pods_by_priority.remove(&p.priority);
        }
    }

    pub(super) fn unindex(&mut self, uid: &str, node: &str) {
        if let Some(set) = self.by_node.get_mut(node) {
            set.remove(uid);
            if set.is_empty() {
                self.by_node.remove(node);
            }
        }
    }

    /// A re-list of pods starts: pods not applied before [`ClusterState::end_pod_relist`] are gone.
    /// A reservation (a bind in flight, or one whose pod no event showed annotated yet) is kept, and
    /// its pod looked up ([`ClusterState::take_unconfirmed`]): deleted while the watch was broken, it
    /// would otherwise hold its cards for good.
    pub fn begin_pod_relist(&mut self) {
        self.relisting_pods = Some(HashSet::new());
    }

    /// The re-list of pods is complete.
    pub fn end_pod_relist(&mut self) {
        let Some(seen) = self.relisting_pods.take() else { return };
        let unseen: Vec<String> = self.agents.keys().filter(|uid| !seen.contains(*uid)).cloned().collect();
        for uid in unseen {
            self.set_agent(&uid, None);
        }
        let unseen: Vec<(String, bool)> = self
            .pods
            .iter()
            .filter(|(uid, _)| !seen.contains(*uid))
            .map(|(u, p)| (u.clone(), p.reserved))
            .collect();
        for (uid, reserved) in unseen {
            if !reserved {
                self.forget_pod(&uid);
            } else if let Some(p) = self.pods.get(&uid) {
                let (namespace, name) = p.key.clone();
                self.unconfirmed.push(Unconfirmed { uid, namespace, name });
            }
        }
        self.nominations.retain(|uid, _| seen.contains(uid));
        self.preempt_searched.retain(|uid, _| seen.contains(uid));
        self.preempt_after.retain(|uid, _| seen.contains(uid));
        self.invalid_requests.retain(|uid| seen.contains(uid));
        let before = self.waiting.len();
        self.waiting.retain(|uid, _| seen.contains(uid));
        if self.waiting.len() != before {
            self.generation += 1;
        }
    }

    /// Gives back the reservation of pod `uid`, which the API server no longer holds (looked up
    /// after a re-list did not show it): only while it is still a reservation, as an event since
    /// then is what the API server said.
    pub fn forget_gone(&mut self, uid: &str) -> bool {
        if self.pods.get(uid).is_some_and(|p| p.reserved) {
            self.forget_pod(uid);
            return true;
        }
        false
    }

    /// A pending pod with no assignment: one that asks a GPU is recorded as waiting (for the GPU map).
    /// One whose GPU request cannot be read (a pod the webhook did not see, or an annotation made
    /// too long later) is not kept, and gets a warning Event once.
    fn wait(&mut self, uid: String, pod: &Pod) {
        let demand = match pod_demand(pod, self.extender.demand_options()) {
            Ok(d) => {
                self.invalid_requests.remove(&uid);
                Some(d).filter(|d| d.wants_gpu())
            }
            Err(e) => {
                if asks_nano_gpu(pod) && self.invalid_requests.insert(uid.clone()) {
                    let (ns, name) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref());
                    let message = format!("{e}; nano-gpu gives this pod no card until its request is fixed");
                    self.warn(
                        "Pod",
                        ns.unwrap_or_default(),
                        name.unwrap_or_default(),
                        Reason::InvalidGpuRequest,
                        message,
                    );
                }
                None
            }
        };
        // (apply_pod took the pod off the waiting list before, and counts whether it changed.)
        let Some(demand) = demand else { return };
        let key = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        let created = pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let since = created.map(|t| t.to_string()).unwrap_or_default();
        let created = created.map(|t| t.as_second());
        self.waiting.insert(uid, Waiting { key, demand, since, created });
    }

    /// The pod no longer waits (bound, assigned, ended or deleted).
    fn stop_waiting(&mut self, uid: &str) {
        if self.waiting.remove(uid).is_some() {
            self.generation += 1;
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
}

/// Whether `pod` asks anything of nano-gpu: a resource under `nano-gpu/` or gpushare's, or the card
/// models it may run on.
fn asks_nano_gpu(pod: &Pod) -> bool {
    let ours = |k: &String| k.starts_with("nano-gpu/") || k == nano_gpu_proto::resources::GPUSHARE_MEMORY;
    let spec = pod.spec.as_ref();
    let containers =
        spec.into_iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
    let asks = containers
        .filter_map(|c| c.resources.as_ref())
        .any(|r| r.limits.iter().chain(r.requests.iter()).flat_map(|m| m.keys()).any(ours));
    let annotations = pod.metadata.annotations.as_ref();
    asks || annotations.is_some_and(|a| a.contains_key(nano_gpu_proto::resources::GPU_MODEL_ANNOTATION))
}

/// Whether the kubelet failed `pod` at admission for want of nano-gpu's devices: its reason
/// `UnexpectedAdmissionError`, its message naming one of our resources ("no healthy devices
/// present; cannot allocate unhealthy devices nano-gpu/gpu-percent", "cannot allocate unregistered
/// device ...") or a device plugin call that broke ("device plugin GetPreferredAllocation rpc
/// failed with err: ... connection reset by peer", as when the agent dies during the call; the
/// caller counts only shares nano-gpu placed, whose plugin is nano-gpu's).
pub(super) fn refused_for_devices(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else { return false };
    status.phase.as_deref() == Some("Failed")
        && status.reason.as_deref() == Some("UnexpectedAdmissionError")
        && status.message.as_deref().is_some_and(|m| {
            m.contains("device")
                && (m.contains(nano_gpu_proto::resources::GPU_PERCENT)
                    || m.contains(nano_gpu_proto::resources::GPUSHARE_MEMORY)
                    || (m.contains("device plugin") && m.contains("rpc failed")))
        })
}
