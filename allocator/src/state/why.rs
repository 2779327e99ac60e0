//! Why a pod waits, node by node (`kubectl nano-gpu why`): the filter the extender answers
//! kube-scheduler with, over the same view, and for each node where only other pods are in the way,
//! the fewest of them whose end would make room (judged as `/preempt` judges victims).

use super::ClusterState;
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_proto::extender::{MetaPod, MetaVictims};
use serde::Serialize;
use std::collections::BTreeMap;

/// One node's answer for the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeVerdict {
    /// Node name.
    pub node: String,
    /// Whether the pod fits there now, as the extender's filter says.
    pub fits: bool,
    /// Why it does not (empty when it fits).
    pub reason: String,
    /// Whether no pod's end could ever make room (wrong model, too small, no agent serving...).
    pub unresolvable: bool,
    /// The fewest pods (`namespace/name`) whose end would make room, when other pods are what is in
    /// the way; empty when it fits, when nothing can help, or when ending every pod there would not.
    pub freed_by: Vec<String>,
}

impl ClusterState {
    /// Every node's verdict for `pod`: the nodes it fits on first, then those where the fewest pods
    /// are in the way, then those where nothing helps. Err: the pod's GPU request cannot be read, or
    /// it asks none.
    pub fn why(&mut self, pod: &Pod) -> Result<Vec<NodeVerdict>, String> {
        // A pod that waits for nano-gpu to allocate its claims: each node as the claims' planner
        // judges it.
        if let Some(judged) = pod.metadata.uid.clone().and_then(|uid| self.why_claims(&uid)) {
            return judged.map(ranked);
        }
        let (demand, _) = self.extender.request(pod)?;
        if !demand.wants_gpu() {
            if !crate::decide::claim::pod_claims(pod).is_empty() {
                let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
                return Err(match node {
                    Some(node) => format!("the pod uses ResourceClaims and is bound to node {node}"),
                    None => "the pod uses ResourceClaims and does not wait for nano-gpu to allocate them: \
                             they are not all of nano-gpu's class (kube-scheduler allocates them), or nano-gpu \
                             has not seen the pod or its claims yet"
                        .into(),
                });
            }
            return Err("the pod asks no nano-gpu resource: the nano-gpu scheduler does not place it".into());
        }
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        let filtered = self.judge_names(Some(pod), names);
        if !filtered.error.is_empty() {
            return Err(filtered.error);
        }
        let own = pod.metadata.uid.as_deref();
        // Every pod on a node where others are in the way is a candidate; `preempt` keeps the fewest.
        let proposed: BTreeMap<String, MetaVictims> = filtered
            .failed_nodes
            .keys()
            .map(|node| {
                let uids =
                    self.by_node.get(node).into_iter().flatten().filter(|uid| Some(uid.as_str()) != own);
                let pods = uids.map(|uid| MetaPod { uid: uid.clone() }).collect();
                (node.clone(), MetaVictims { pods, num_pdb_violations: 0 })
            })
            .collect();
        let freed = self.victims_needed(pod, &proposed)?;
        let name_of = |uid: &str| self.pods.get(uid).map(|p| format!("{}/{}", p.key.0, p.key.1));
        let mut verdicts: Vec<NodeVerdict> = filtered
            .node_names
            .unwrap_or_default()
            .into_iter()
            .map(|node| NodeVerdict {
                node,
                fits: true,
                reason: String::new(),
                unresolvable: false,
                freed_by: vec![],
            })
            .collect();
        for (node, reason) in filtered.failed_nodes {
            let mut freed_by: Vec<String> =
                freed.get(&node).into_iter().flat_map(|v| &v.pods).filter_map(|p| name_of(&p.uid)).collect();
            freed_by.sort();
            verdicts.push(NodeVerdict { node, fits: false, reason, unresolvable: false, freed_by });
        }
        for (node, reason) in filtered.failed_and_unresolvable_nodes {
            verdicts.push(NodeVerdict { node, fits: false, reason, unresolvable: true, freed_by: vec![] });
        }
        Ok(ranked(verdicts))
    }
}

/// `verdicts` in `why`'s order: fits; then room that ending pods makes, fewest first; then busy with
/// no such room; then never; by node within each.
fn ranked(mut verdicts: Vec<NodeVerdict>) -> Vec<NodeVerdict> {
    let rank = |v: &NodeVerdict| match (v.fits, v.unresolvable, v.freed_by.len()) {
        (true, _, _) => (0, 0),
        (false, false, n) if n > 0 => (1, n),
        (false, false, _) => (2, 0),
        (false, true, _) => (3, 0),
    };
    verdicts.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.node.cmp(&b.node)));
    verdicts
}
