//! The kube-scheduler extender v1 wire types (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs have no JSON tags, so the wire uses the Go field names (`Pod`, `NodeNames`,
//! `FailedAndUnresolvableNodes`). Go's decoder matches names case-insensitively; we emit the exact
//! names and accept them. Go writes a nil pointer, slice or map as `null`, so every optional field
//! here accepts `null` and a missing field alike.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// `v1.NodeList` as kube-scheduler builds it for an extender: no `kind`/`apiVersion` (its TypeMeta is
/// empty), so `k8s_openapi::List`, which requires them, cannot read it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    /// List metadata (empty from kube-scheduler).
    #[serde(default)]
    pub metadata: ListMeta,
    /// The nodes.
    #[serde(default, deserialize_with = "null_default")]
    pub items: Vec<Node>,
}

/// Lowest score an extender may give (`MinExtenderPriority`).
pub const MIN_PRIORITY: i64 = 0;
/// Highest score an extender may give (`MaxExtenderPriority`).
pub const MAX_PRIORITY: i64 = 10;

/// A reason as kube-scheduler is to be told it (a node's filter failure, a bind's error): it records
/// them in Events through a format string (`EventRecorder.Eventf(..., msg)`, no arguments), where a
/// bare `%` is read as a verb ("30%!f(MISSING)ree"). Each `%` is written as a word instead, which reads
/// the same in the Event and in the pod's condition (which takes it as is).
pub fn for_scheduler(reason: &str) -> String {
    reason.replace('%', " percent")
}

/// `null` or missing both become the default.
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Body of `POST /filter` and `POST /prioritize`. Node names are `String`s, or `&str` borrowed from
/// the request body on the extender's hot path (thousands of names per request).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs<N = String> {
    /// The pod being scheduled.
    #[serde(default)]
    pub pod: Option<Pod>,
    /// Candidate nodes in full, only when the extender is not `nodeCacheCapable`.
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names, only when the extender is `nodeCacheCapable`.
    #[serde(default)]
    pub node_names: Option<Vec<N>>,
}

impl ExtenderArgs {
    /// Moves the candidate node names out (copying them only from a full `Nodes` list).
    pub fn take_candidate_names(&mut self) -> Vec<String> {
        match self.node_names.take() {
            Some(names) => names,
            None => self.candidate_names(),
        }
    }

    /// The candidate node names, from whichever of `NodeNames` and `Nodes` was sent.
    pub fn candidate_names(&self) -> Vec<String> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list.items.iter().filter_map(|n| n.metadata.name.clone()).collect(),
            (None, None) => Vec::new(),
        }
    }
}

/// Node name → reason it failed.
pub type FailedNodesMap = BTreeMap<String, String>;

/// Response of `POST /filter`, with node names as the request had them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult<N: Ord = String> {
    /// Nodes that fit, in full (only when the request carried `Nodes`).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Names of the nodes that fit (when the request carried `NodeNames`). Must be non-null then:
    /// a null list means no node passed.
    #[serde(default)]
    pub node_names: Option<Vec<N>>,
    /// Nodes that do not fit now but might after preemption.
    #[serde(default, deserialize_with = "null_default")]
    pub failed_nodes: BTreeMap<N, String>,
    /// Nodes on which the pod can never fit; preemption skips them.
    #[serde(default, deserialize_with = "null_default")]
    pub failed_and_unresolvable_nodes: BTreeMap<N, String>,
    /// A non-empty error fails the scheduling attempt.
    #[serde(default, deserialize_with = "null_default")]
    pub error: String,
}

impl<N: Ord> ExtenderFilterResult<N> {
    /// How many nodes passed, whichever of `Nodes` and `NodeNames` holds them.
    pub fn passed(&self) -> usize {
        self.nodes.as_ref().map_or(0, |n| n.items.len()) + self.node_names.as_ref().map_or(0, Vec::len)
    }
}

/// One node's score from `POST /prioritize`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority<N = String> {
    /// Node name.
    pub host: N,
    /// 0..=10.
    pub score: i64,
}

/// Response of `POST /prioritize`.
pub type HostPriorityList<N = String> = Vec<HostPriority<N>>;

/// Body of `POST /bind`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID (Go field `PodUID`).
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen.
    pub node: String,
}

/// Response of `POST /bind`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// Empty on success.
    #[serde(default, deserialize_with = "null_default")]
    pub error: String,
}

/// Pods that would be evicted on a node, in full.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Victims {
    /// The pods.
    #[serde(default, deserialize_with = "null_default")]
    pub pods: Vec<Pod>,
    /// PodDisruptionBudgets violated by evicting them.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// A victim named by UID only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// Pod UID (Go field `UID`).
    #[serde(rename = "UID")]
    pub uid: String,
}

/// Victims on a node, by UID.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    /// The pods.
    #[serde(default, deserialize_with = "null_default")]
    pub pods: Vec<MetaPod>,
    /// PodDisruptionBudgets violated by evicting them.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// Body of `POST /preempt`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionArgs {
    /// The pod being scheduled.
    #[serde(default)]
    pub pod: Option<Pod>,
    /// Victims in full (not `nodeCacheCapable`).
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Victims by UID (`nodeCacheCapable`).
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// Response of `POST /preempt`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    /// The nodes still worth preempting on, with their (possibly changed) victims.
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

#[cfg(test)]
mod tests {
    //! Golden JSON written from the upstream Go definitions: what `encoding/json` emits for each struct.
    use super::*;
    use serde_json::{Value, json};

    fn roundtrip<T: Serialize + for<'de> Deserialize<'de> + PartialEq + std::fmt::Debug>(golden: Value) -> T {
        let t: T = serde_json::from_value(golden.clone()).unwrap();
        assert_eq!(serde_json::to_value(&t).unwrap(), golden);
        t
    }

    #[test]
    fn extender_args_with_node_names_round_trip() {
        let a: ExtenderArgs = roundtrip(json!({
            "Pod": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "spec": {"containers": []}},
            "Nodes": null,
            "NodeNames": ["n1", "n2"]
        }));
        assert_eq!(a.candidate_names(), ["n1", "n2"]);
    }

    #[test]
    fn extender_args_with_full_nodes_give_their_names() {
        let a: ExtenderArgs = serde_json::from_value(json!({
            "Pod": null,
            "Nodes": {"metadata": {}, "items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]},
        }))
        .unwrap();
        assert_eq!(a.candidate_names(), ["a", "b"]);
    }

    #[test]
    fn filter_result_uses_go_field_names() {
        roundtrip::<ExtenderFilterResult>(json!({
            "Nodes": null,
            "NodeNames": ["n1"],
            "FailedNodes": {"n2": "card 0: 30% free < 50% asked"},
            "FailedAndUnresolvableNodes": {"n3": "no card of model A100"},
            "Error": ""
        }));
        // Go writes nil maps as null; they read as empty.
        let r: ExtenderFilterResult = serde_json::from_value(json!({
            "Nodes": null, "NodeNames": null, "FailedNodes": null, "FailedAndUnresolvableNodes": null, "Error": ""
        }))
        .unwrap();
        assert!(r.failed_nodes.is_empty() && r.node_names.is_none());
    }

    #[test]
    fn host_priority_list_uses_go_field_names() {
        roundtrip::<HostPriorityList>(json!([{"Host": "n1", "Score": 10}, {"Host": "n2", "Score": 0}]));
    }

    #[test]
    fn binding_args_spell_pod_uid_as_go_does() {
        let b: ExtenderBindingArgs =
            roundtrip(json!({"PodName": "p", "PodNamespace": "ns", "PodUID": "8c2e", "Node": "n1"}));
        assert_eq!(b.pod_uid, "8c2e");
        roundtrip::<ExtenderBindingResult>(json!({"Error": "no card"}));
    }

    #[test]
    fn preemption_types_use_go_field_names() {
        roundtrip::<ExtenderPreemptionArgs>(json!({
            "Pod": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}},
            "NodeNameToVictims": null,
            "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0}}
        }));
        roundtrip::<ExtenderPreemptionArgs>(json!({
            "Pod": null,
            "NodeNameToVictims": {"n1": {"Pods": [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "v"}}], "NumPDBViolations": 1}},
            "NodeNameToMetaVictims": null
        }));
        roundtrip::<ExtenderPreemptionResult>(json!({
            "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "u1"}, {"UID": "u2"}], "NumPDBViolations": 2}}
        }));
    }

    #[test]
    fn a_reason_for_kube_scheduler_has_no_bare_percent() {
        assert_eq!(
            for_scheduler("GPU busy: no card has 30% free (most free: 20%)"),
            "GPU busy: no card has 30 percent free (most free: 20 percent)"
        );
        assert_eq!(for_scheduler("node is gone"), "node is gone");
    }
}
