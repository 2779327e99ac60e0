//! ResourceClaims in the view, and the pods waiting for nano-gpu to allocate theirs.
//!
//! Every claim is kept ([`ClaimRecord`]): what an allocation of nano-gpu's driver holds counts on
//! its node's cards, as an assignment does (a node whose agent serves DRA holds only claims). A
//! pending pod that uses claims is kept too; once all its claims exist, are nano-gpu's and are not
//! allocated, [`ClusterState::plan_claims`] picks the node and cards with the policy, over the nodes
//! whose agent serves DRA and that the pod may go to, and holds them in flight
//! ([`ClusterState::in_flight`]) until the allocation is written ([`ClusterState::written`]) or fails
//! ([`ClusterState::not_written`]).
//!
//! A newer resourceVersion of a claim always wins over an older one: a re-list and the watch may
//! deliver one claim out of order, and an older copy must not free what a newer allocation took.
//! A claim deleted while a pod it was reserved for still runs keeps its cards until the last such
//! pod is gone: the kubelet keeps a prepared claim's devices in its containers until they end,
//! whatever became of the claim (anyone who may delete claims can take its finalizer off).
//! When kube-scheduler clears an allocation nano-gpu wrote while the pod still waits (the node
//! failed one of its own checks, e.g. a host port), that node is not picked for the pod again.

use super::ClusterState;
use super::decode::{NodeRecord, host_requests};
use super::preemption::{Needs, Preemptor};
use super::why::NodeVerdict;
use crate::decide::claim::{
    ClaimRecord, ClaimSlot, Given, Held, Placement, PodClaim, allocation, pod_claims, template_shape,
};
use crate::decide::extender::NO_INVENTORY;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use nano_gpu_engine::model::NodeId;
use nano_gpu_engine::request::{FrontEnd, Request, SlotDemand};
use nano_gpu_proto::annotations::{MEMORY_LIMIT_DRIVER, MEMORY_LIMIT_LABEL};
use nano_gpu_proto::demand::pod_demand;
use nano_gpu_proto::events::Reason;
use serde_json::Value;
use std::collections::{BTreeSet, HashSet};

/// A pending pod that uses claims.
#[derive(Clone, Debug)]
pub(super) struct ClaimPod {
    key: (String, String),
    claims: Vec<PodClaim>,
    /// Host CPU (milli) and memory (MiB), and the card models it allows (its `nano-gpu/gpu-model`).
    host: Result<(u64, u64, Vec<String>), String>,
    placement: Placement,
    /// Its priority, and whether it may preempt pods of lower priority (its `preemptionPolicy` is
    /// not `Never`).
    priority: i32,
    may_preempt: bool,
}

/// An allocation to write: the claim, the pod it is for, and what to write.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimWrite {
    /// The pod (namespace, name).
    pub pod: (String, String),
    /// The pod's uid.
    pub pod_uid: String,
    /// The claim (namespace, name).
    pub claim: (String, String),
    /// The claim's uid.
    pub claim_uid: String,
    /// The claim's resourceVersion the choice was made on (the writes are conditional on it).
    pub resource_version: String,
    /// The node chosen.
    pub node: String,
    /// `status.allocation`.
    pub allocation: Value,
}

/// What a waiting pod's claims still to be placed ask ([`ClusterState::claim_ask`]).
struct ClaimAsk {
    pod: ClaimPod,
    /// The claims to place: uid, record, slots.
    todo: Vec<(String, ClaimRecord, Vec<ClaimSlot>)>,
    /// Their request to the engine.
    req: Request,
    /// The node the pod's claims already allocated (or in flight) fix, if any.
    fixed: Option<String>,
}

/// Whether a pod's claims may go to a node ([`ClusterState::node_for_claims`]).
enum ClaimNode {
    /// Its cards are judged.
    Open,
    /// Not by the pod's node rules, or kube-scheduler refused the pod there.
    Excluded(String),
    /// Not at all: not a DRA node, or the pod's other claims are on another node.
    Outside(String),
}

impl ClusterState {
    /// A ResourceClaim was added or changed (an older copy than the one held is ignored).
    pub fn apply_claim(&mut self, claim: &ResourceClaim) {
        let Some(uid) = claim.metadata.uid.clone() else { return };
        if let Some(seen) = self.relisting_claims.as_mut() {
            seen.insert(uid.clone());
        }
        let record = ClaimRecord::of(claim);
        let before = self.claims.get(&uid);
        if before.is_some_and(|b| b.version > record.version && record.version != 0) {
            return;
        }
        if before == Some(&record) {
            return;
        }
        // Deleted objects do not come back: a claim shown again after it was taken for deleted
        // (a list that raced its deletion) is as it is now.
        self.ended_claims.remove(&uid);
        // An allocation nano-gpu wrote, cleared while the pod still waits: kube-scheduler refused the
        // node (its PostFilter clears allocations that made a pod unschedulable).
        if let Some(node) = before.and_then(|b| b.held.as_ref()).map(|h| h.node.clone())
            && !record.allocated
        {
            let users: Vec<String> = self
                .claim_pods
                .iter()
                .filter(|(_, p)| {
                    p.key.0 == record.key.0 && p.claims.iter().any(|c| c.name.as_ref() == Some(&record.key.1))
                })
                .map(|(uid, _)| uid.clone())
                .collect();
            for pod in users {
                tracing::info!(claim = %format!("{}/{}", record.key.0, record.key.1), %node,
                    "an allocation of a waiting pod's claim was cleared; its node is not picked for the pod again");
                self.refused_nodes.entry(pod).or_default().insert(node.clone());
            }
        }
        self.claim_keys.insert(record.key.clone(), uid.clone());
        let old = self.claims.insert(uid.clone(), record);
        self.reindex_claim(&uid, old.as_ref().and_then(|c| c.held.as_ref()));
    }

    /// A ResourceClaim was deleted.
    pub fn delete_claim(&mut self, claim: &ResourceClaim) {
        if let Some(uid) = claim.metadata.uid.as_deref() {
            self.forget_claim(uid);
        }
    }

    /// Claim `uid` is gone from the API: its cards are free, unless a pod it was reserved for still
    /// runs (see the module's doc); then it is kept until that pod is gone.
    fn forget_claim(&mut self, uid: &str) {
        let Some(old) = self.claims.get(uid) else { return };
        if self.claim_keys.get(&old.key).is_some_and(|u| u == uid) {
            self.claim_keys.remove(&old.key);
        }
        if self.in_use(old) {
            if self.ended_claims.insert(uid.to_owned()) {
                tracing::info!(claim = %format!("{}/{}", old.key.0, old.key.1),
                    "a claim was deleted while a pod it was reserved for still runs; its cards stay counted until those pods are gone");
            }
            return;
        }
        self.ended_claims.remove(uid);
        if let Some(old) = self.claims.remove(uid) {
            self.reindex_claim(uid, old.held.as_ref());
        }
    }

    /// Whether claim `c` holds cards for a pod that is still on its node (bound, not ended). A
    /// consumer other than a pod cannot be told from the pods: such a claim is not.
    fn in_use(&self, c: &ClaimRecord) -> bool {
        c.held.is_some() && c.users.iter().flatten().any(|pod| self.pods.contains_key(pod))
    }

    /// Frees the cards of deleted claims no running pod uses any more (after a pod is gone).
    pub(super) fn release_ended_claims(&mut self) {
        if self.ended_claims.is_empty() {
            return;
        }
        let done: Vec<String> = self
            .ended_claims
            .iter()
            .filter(|uid| self.claims.get(*uid).is_none_or(|c| !self.in_use(c)))
            .cloned()
            .collect();
        for uid in done {
            self.forget_claim(&uid);
        }
    }

    /// A re-list of claims starts: claims not applied before [`ClusterState::end_claim_relist`] are
    /// gone.
    pub fn begin_claim_relist(&mut self) {
        self.relisting_claims = Some(HashSet::new());
    }

    /// The re-list of claims is complete.
    pub fn end_claim_relist(&mut self) {
        let Some(seen) = self.relisting_claims.take() else { return };
        // The watch's own list: everything it did not show is gone, whatever its version.
        self.end_claim_snapshot(&seen, u64::MAX);
    }

    /// A consistent list of every claim, read at resourceVersion `version`, was applied (each with
    /// [`ClusterState::apply_claim`]; `seen`: their uids): a claim it did not show is gone, unless the
    /// watch showed it at a later version (made after the list). Unlike a re-list it leaves the
    /// watch's own re-list, if one is under way, as it is.
    pub fn end_claim_snapshot(&mut self, seen: &HashSet<String>, version: u64) {
        let gone: Vec<String> = self
            .claims
            .iter()
            .filter(|(uid, c)| !seen.contains(*uid) && c.version <= version)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in gone {
            self.forget_claim(&uid);
        }
    }

    /// The node a claim holds cards on now: what is being written for it, else its allocation.
    fn claim_node(&self, uid: &str) -> Option<String> {
        self.claim_held(uid).map(|h| h.node.clone())
    }

    /// What claim `uid` holds now: what is being written for it, else its allocation.
    pub(super) fn claim_held(&self, uid: &str) -> Option<&Held> {
        match self.in_flight.get(uid) {
            Some(h) => Some(h),
            None => self.claims.get(uid).and_then(|c| c.held.as_ref()),
        }
    }

    /// Moves claim `uid` in the node index after a change (`before`: what it held before, unless
    /// something is in flight for it) and rebuilds the nodes it left and went to. An allocation naming
    /// devices in several pools is indexed on each of them (each of those nodes is then full: see
    /// [`ClusterState::claims_held_on`]).
    fn reindex_claim(&mut self, uid: &str, before: Option<&Held>) {
        let nodes = |h: Option<&Held>| -> BTreeSet<String> {
            h.map(|h| std::iter::once(h.node.clone()).chain(h.other_pools.iter().cloned()).collect())
                .unwrap_or_default()
        };
        let before = nodes(self.in_flight.get(uid).or(before));
        let now = nodes(self.claim_held(uid));
        for n in before.difference(&now) {
            if let Some(set) = self.claims_on.get_mut(n) {
                set.remove(uid);
                if set.is_empty() {
                    self.claims_on.remove(n);
                }
            }
        }
        for n in &now {
            self.claims_on.entry(n.clone()).or_default().insert(uid.to_owned());
        }
        for n in before.union(&now) {
            self.rebuild(n);
        }
    }

    /// What the claims on `node` hold, for [`ClusterState::rebuild`]: (claim, what it holds there);
    /// `None` for a claim whose allocation names devices of `node` beside another node's (it cannot
    /// be trusted: the node counts as full).
    pub(super) fn claims_held_on(&self, node: &str) -> Vec<((String, String), Option<Held>)> {
        let mut out = Vec::new();
        for uid in self.claims_on.get(node).into_iter().flatten() {
            let key = self.claims.get(uid).map(|c| c.key.clone()).unwrap_or_default();
            let Some(held) = self.claim_held(uid) else { continue };
            let trusted = held.node == node && held.other_pools.is_empty();
            out.push((key, trusted.then(|| held.clone())));
        }
        out
    }

    /// Notes `pod` if it is pending and uses claims; forgets it otherwise. (A pending pod without
    /// claims keeps its nomination, a share's: kube-scheduler writes its status after each try.)
    pub(super) fn note_claim_pod(&mut self, uid: &str, pod: &Pod, pending: bool) {
        let claims = pod_claims(pod);
        if !pending {
            self.forget_claim_pod(uid);
            return;
        }
        if claims.is_empty() {
            self.drop_claim_pod(uid);
            return;
        }
        let Preemptor { key, priority, may_preempt } = Preemptor::of(pod);
        let host = match pod_demand(pod, self.extender.demand_options()) {
            Ok(d) if d.wants_gpu() => Err(format!(
                "pod {}/{} asks both claims and nano-gpu's extended resources; use one or the other",
                key.0, key.1
            )),
            Ok(d) => {
                let host = host_requests(pod, Some(&d));
                Ok((host.cpu, host.mem, d.models))
            }
            Err(e) => Err(e.to_string()),
        };
        let placement = Placement::of(pod);
        self.claim_pods
            .insert(uid.to_owned(), ClaimPod { key, claims, host, placement, priority, may_preempt });
    }

    /// Forgets pod `uid` as one waiting for claims, and its nomination.
    pub(super) fn forget_claim_pod(&mut self, uid: &str) {
        self.drop_claim_pod(uid);
        self.end_nomination(uid);
    }

    /// Forgets pod `uid` as one waiting for claims.
    fn drop_claim_pod(&mut self, uid: &str) {
        self.claim_pods.remove(uid);
        self.refused_nodes.remove(uid);
        self.claim_notes.remove(uid);
    }

    /// Picks node and cards for every waiting pod whose claims are all nano-gpu's, exist and are not
    /// allocated (or allocated in part, by an earlier write that failed half-way: the rest then goes
    /// to the same node), holds them in flight and returns the writes. A pod that cannot be placed,
    /// or whose claims nano-gpu cannot allocate, gets a warning (once per distinct message); one that
    /// pods of lower priority are in the way of preempts them ([`super::preemption`]). Pods of higher priority
    /// are planned first.
    pub fn plan_claims(&mut self) -> Vec<ClaimWrite> {
        let mut writes = Vec::new();
        let mut uids: Vec<(i32, String)> =
            self.claim_pods.iter().map(|(uid, p)| (p.priority, uid.clone())).collect();
        uids.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let uids = uids.into_iter().map(|(_, uid)| uid);
        for pod_uid in uids {
            match self.plan_pod(&pod_uid) {
                Ok(mut w) => writes.append(&mut w),
                Err(Some(message)) => {
                    let Some(pod) = self.claim_pods.get(&pod_uid) else { continue };
                    let key = pod.key.clone();
                    if self.claim_notes.get(&pod_uid) != Some(&message) {
                        self.claim_notes.insert(pod_uid.clone(), message.clone());
                        self.warn("Pod", &key.0, &key.1, Reason::ClaimNotAllocated, message);
                    }
                }
                Err(None) => {}
            }
        }
        writes
    }

    /// The writes for one pod; `Err(None)`: nothing to do now; `Err(Some(why))`: it cannot be done.
    fn plan_pod(&mut self, pod_uid: &str) -> Result<Vec<ClaimWrite>, Option<String>> {
        let ask = self.claim_ask(pod_uid)?;
        let refused = self.refused_nodes.get(pod_uid);
        let cluster = self.extender.engine().cluster();
        let mut excluded = Vec::new();
        let mut candidates: Vec<NodeId> = Vec::new();
        for (name, record) in &self.nodes {
            match self.node_for_claims(&ask, pod_uid, name, record) {
                ClaimNode::Outside(_) => continue,
                ClaimNode::Excluded(why) => excluded.push(format!("{name}: {why}")),
                ClaimNode::Open => candidates.extend(cluster.id(name)),
            }
        }
        if candidates.is_empty() && refused.is_some_and(|r| !r.is_empty()) {
            // Every node was refused once: what refused may have changed; try them all again.
            self.refused_nodes.remove(pod_uid);
            return Err(None);
        }
        let ClaimAsk { pod, todo, req, .. } = ask;
        let decision = match self.extender.place(&req, &candidates) {
            Ok(decision) => decision,
            Err(no) => {
                let mut why = format!(
                    "no node takes the claims of pod {}/{}: {no} (nodes whose nano-gpu agent serves DRA)",
                    pod.key.0, pod.key.1
                );
                if !excluded.is_empty() {
                    why.push_str(&format!("; not considered: {}", excluded.join(", ")));
                }
                let who =
                    Preemptor { key: pod.key.clone(), priority: pod.priority, may_preempt: pod.may_preempt };
                why.extend(self.preempt_for(pod_uid, &who, &req, &candidates, Needs::Claims));
                return Err(Some(why));
            }
        };
        self.end_nomination(pod_uid);
        let node = self.extender.engine().cluster().node(decision.node);
        let name = node.name.clone();
        let indexes: Vec<u32> = node.cards.iter().map(|c| c.index).collect();
        let mut writes = Vec::new();
        let mut slot = 0;
        for (uid, c, slots) in todo {
            let mut given = Vec::new();
            for s in &slots {
                for g in decision.eval.grants.iter().filter(|g| g.slot == slot) {
                    given.push(Given {
                        request: s.request.clone(),
                        card: indexes[g.card],
                        percent: g.percent,
                        memory: s.memory_asked.then_some(g.mem),
                    });
                }
                slot += 1;
            }
            let held = Held {
                node: name.clone(),
                devices: given
                    .iter()
                    .map(|g| crate::decide::claim::HeldDevice {
                        card: Ok(g.card),
                        percent: g.percent,
                        memory: g.memory,
                    })
                    .collect(),
                other_pools: Vec::new(),
            };
            writes.push(ClaimWrite {
                pod: pod.key.clone(),
                pod_uid: pod_uid.to_owned(),
                claim: c.key.clone(),
                claim_uid: uid.clone(),
                resource_version: c.resource_version.clone(),
                node: name.clone(),
                allocation: allocation(&uid, &name, &given),
            });
            self.in_flight.insert(uid.clone(), held);
            self.reindex_claim(&uid, c.held.as_ref());
        }
        self.claim_notes.remove(pod_uid);
        Ok(writes)
    }

    /// What the claims of the waiting pod `pod_uid` still to be placed ask; `Err(None)`: nothing to
    /// place now; `Err(Some(why))`: they cannot be placed.
    fn claim_ask(&mut self, pod_uid: &str) -> Result<ClaimAsk, Option<String>> {
        let pod = self.claim_pods.get(pod_uid).ok_or(None)?.clone();
        let mut claims: Vec<(String, ClaimRecord)> = Vec::new();
        let mut waiting = false;
        for c in &pod.claims {
            let ours = c.template.as_deref().and_then(|t| template_shape(t).map(|shape| (t, shape)));
            let Some(name) = &c.name else {
                // A claim from a template not made yet: the ResourceClaim controller makes it once
                // the template exists; nano-gpu's templates are made on demand.
                if let Some((t, _)) = ours {
                    self.templates_wanted.insert((pod.key.0.clone(), t.to_owned()));
                }
                waiting = true;
                continue;
            };
            // Not seen yet: later.
            let Some(uid) = self.claim_keys.get(&(pod.key.0.clone(), name.clone())) else {
                waiting = true;
                continue;
            };
            let Some(record) = self.claims.get(uid) else {
                waiting = true;
                continue;
            };
            // A claim made from one of nano-gpu's templates asks what the template's name says, or
            // the template is not nano-gpu's (someone made one by that name first).
            if let Some((t, shape)) = ours {
                let asks = match record.slots() {
                    Some(Ok(slots)) => slots.iter().map(|s| s.demand).collect(),
                    _ => Vec::new(),
                };
                if asks != [shape] {
                    return Err(Some(format!(
                        "claim {name} of pod {}/{} was made from the ResourceClaimTemplate {t}, which does not \
                         ask what nano-gpu's template of that name asks; delete the template (nano-gpu makes \
                         it again) and the pod",
                        pod.key.0, pod.key.1
                    )));
                }
            }
            claims.push((uid.clone(), record.clone()));
        }
        if waiting {
            return Err(None);
        }
        let ours = claims.iter().filter(|(_, c)| c.slots().is_some()).count();
        if ours == 0 {
            return Err(None);
        }
        if ours < claims.len() {
            return Err(Some(format!(
                "pod {}/{} uses claims of {} and of other classes; nano-gpu allocates pods whose claims \
                 are all its own",
                pod.key.0,
                pod.key.1,
                nano_gpu_proto::dra::CLASS
            )));
        }
        let (cpu, mem, models) = pod.host.clone().map_err(Some)?;
        // Claims already held (allocated, or being written) fix the node; the rest are placed.
        let mut fixed: Option<String> = None;
        let mut todo: Vec<(String, ClaimRecord, Vec<ClaimSlot>)> = Vec::new();
        for (uid, c) in claims {
            if let Some(node) = self.claim_node(&uid) {
                if fixed.as_ref().is_some_and(|f| *f != node) {
                    return Err(Some(format!(
                        "the claims of pod {}/{} are allocated on different nodes ({} and {node})",
                        pod.key.0,
                        pod.key.1,
                        fixed.unwrap_or_default()
                    )));
                }
                fixed = Some(node);
                continue;
            }
            if c.allocated {
                // Allocated, but not to a device of nano-gpu's driver: not ours to touch.
                return Err(None);
            }
            match c.slots() {
                Some(Ok(slots)) => todo.push((uid, c.clone(), slots.clone())),
                Some(Err(why)) => return Err(Some(why.clone())),
                None => return Err(None),
            }
        }
        if todo.is_empty() {
            return Err(None);
        }
        // The models the pod's annotation and every claim's selectors allow, together.
        let mut allow: Option<Vec<String>> = (!models.is_empty()).then_some(models);
        for m in todo.iter().flat_map(|(_, _, slots)| slots.iter().filter_map(|s| s.models.as_ref())) {
            allow = Some(match allow {
                None => m.clone(),
                Some(before) => before.into_iter().filter(|x| m.contains(x)).collect(),
            });
        }
        let cluster = self.extender.engine().cluster();
        let allowed = allow.map(|models| {
            let mut ids: Vec<_> = models.iter().filter_map(|m| cluster.models.get(m)).collect();
            ids.sort();
            ids.dedup();
            ids
        });
        let slots = todo.iter().flat_map(|(_, _, s)| s.iter().map(|s| s.demand)).collect();
        let req = Request { models: allowed, ..Request::new(cpu, mem, slots).through(FrontEnd::Dra) };
        Ok(ClaimAsk { pod, todo, req, fixed })
    }

    /// Whether the claims of `ask` (of pod `pod_uid`) may go to node `name` at all, before the
    /// policy judges its cards.
    fn node_for_claims(&self, ask: &ClaimAsk, pod_uid: &str, name: &str, record: &NodeRecord) -> ClaimNode {
        if !record.dra {
            return ClaimNode::Outside("its nano-gpu agent does not serve DRA".into());
        }
        if let Some(f) = ask.fixed.as_ref().filter(|f| *f != name) {
            return ClaimNode::Outside(format!("the pod's other claims are allocated on {f}"));
        }
        let facts = record.facts.as_ref().cloned().unwrap_or_default();
        if let Err(why) = ask.pod.placement.allows(name, &facts) {
            return ClaimNode::Excluded(why);
        }
        if self.refused_nodes.get(pod_uid).is_some_and(|r| r.contains(name)) {
            return ClaimNode::Excluded("kube-scheduler refused the pod there".into());
        }
        if let Some(held) = self.nominated_elsewhere(name, pod_uid, ask.pod.priority) {
            return ClaimNode::Excluded(held);
        }
        if facts.labels.get(MEMORY_LIMIT_LABEL).is_some_and(|v| v == MEMORY_LIMIT_DRIVER)
            && let Some((_, c, _)) = ask.todo.iter().find(|(_, c, slots)| {
                !c.for_one_pod && slots.iter().any(|s| matches!(s.demand, SlotDemand::Share { .. }))
            })
        {
            return ClaimNode::Excluded(format!(
                "it sets the driver's memory limit per pod ({MEMORY_LIMIT_LABEL}={MEMORY_LIMIT_DRIVER}), and \
                 claim {} holds a share without being made for one pod (from a ResourceClaimTemplate): a pod \
                 joining it would not get the limit",
                c.key.1
            ));
        }
        ClaimNode::Open
    }

    /// Every node's verdict for the claims of the waiting pod `pod_uid` (for `why`), as
    /// [`ClusterState::plan_claims`] would judge them now, unsorted, with the fewest pods whose end
    /// would make room where other pods are in the way (of any priority, as `why` says for other
    /// pods); `None`: it is not a pod waiting on claims.
    pub(super) fn why_claims(&mut self, pod_uid: &str) -> Option<Result<Vec<NodeVerdict>, String>> {
        if !self.claim_pods.contains_key(pod_uid) {
            return None;
        }
        let ask = match self.claim_ask(pod_uid) {
            Ok(ask) => ask,
            Err(Some(why)) => return Some(Err(why)),
            Err(None) => {
                return Some(Err(
                    "nothing to place: its claims do not all exist yet, are allocated, or are \
                                 not all nano-gpu's"
                        .into(),
                ));
            }
        };
        let verdict = |node: String, reason: Option<String>, unresolvable: bool| NodeVerdict {
            node,
            fits: reason.is_none(),
            reason: reason.unwrap_or_default(),
            unresolvable,
            freed_by: vec![],
        };
        let mut verdicts = Vec::new();
        let mut open = Vec::new();
        for (name, record) in &self.nodes {
            match self.node_for_claims(&ask, pod_uid, name, record) {
                ClaimNode::Outside(why) | ClaimNode::Excluded(why) => {
                    verdicts.push(verdict(name.clone(), Some(why), true))
                }
                ClaimNode::Open => open.push(name.clone()),
            }
        }
        self.extender.judge(&ask.req, open, |name, judged| {
            verdicts.push(match judged {
                Ok(()) => verdict(name, None, false),
                Err(None) => verdict(name, Some(NO_INVENTORY.to_owned()), true),
                Err(Some(reason)) => verdict(name, Some(reason.to_string()), false),
            })
        });
        for v in verdicts.iter_mut().filter(|v| !v.fits && !v.unresolvable) {
            v.freed_by = self.freed_by(&v.node, &ask.req);
        }
        Some(Ok(verdicts))
    }

    /// The templates of nano-gpu's form ([`crate::decide::claim::template_name`]) that waiting pods use and
    /// that no claim was made from yet, by (namespace, name): to be made if they do not exist.
    pub fn take_templates_wanted(&mut self) -> std::collections::BTreeSet<(String, String)> {
        std::mem::take(&mut self.templates_wanted)
    }

    /// The claims being written now, by uid.
    pub fn in_flight(&self) -> impl Iterator<Item = &String> {
        self.in_flight.keys()
    }

    /// The allocation of `w` is written: the claim as the API server now has it replaces what was in
    /// flight.
    pub fn written(&mut self, w: &ClaimWrite, claim: &ResourceClaim) {
        self.apply_claim(claim);
        self.not_written(w);
    }

    /// Writing `w` ended without an allocation (or with, then [`ClusterState::written`] applied it):
    /// what was held in flight for it is given back.
    pub fn not_written(&mut self, w: &ClaimWrite) {
        if let Some(h) = self.in_flight.remove(&w.claim_uid) {
            // It held what was in flight: the index moves to what the record holds.
            self.reindex_claim(&w.claim_uid, Some(&h));
        }
    }
}

#[cfg(test)]
mod tests;
