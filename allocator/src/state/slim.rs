//! Pods and Nodes as the watches decode them: only the fields the view reads. A pod may carry 256 KiB
//! of annotations, managed fields, container commands, env and volumes, and a node a list of images;
//! none of it is read, yet a whole `Pod` allocates all of it for every object a list or event brings.
//! [`ViewPod`] and [`ViewNode`] deserialize the same JSON into the same `k8s_openapi` types, with
//! what is not kept left `None` (or empty), and skip the rest while parsing, allocating nothing for it.
//!
//! What is kept is what `state` and `claim` read; a new read of a field not listed here sees it empty,
//! so add it here (the tests below say what is dropped, field by field).

use k8s_openapi::api::core::v1::{
    Container, Node, NodeAffinity, NodeSpec, NodeStatus, Pod, PodCondition, PodResourceClaim,
    PodResourceClaimStatus, PodSpec, PodStatus, ResourceRequirements, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, GPUS_ANNOTATION};
use nano_gpu_proto::gpushare;
use nano_gpu_proto::resources::GPU_MODEL_ANNOTATION;
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

/// The annotations the view reads: of a pod, nano-gpu's assignment and model list and where gpushare
/// placed a pod it bound; of a node, the agent's inventory.
const KEPT_ANNOTATIONS: [&str; 5] =
    [ASSIGNMENT_ANNOTATION, GPU_MODEL_ANNOTATION, gpushare::ALLOCATION, gpushare::IDX, GPUS_ANNOTATION];

/// A Pod with only what the view reads (see the module's documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct ViewPod(pub Pod);

/// A Node with only what the view reads: its name, labels, inventory, taints, cordon and allocatable.
#[derive(Clone, Debug, PartialEq)]
pub struct ViewNode(pub Node);

impl<'de> Deserialize<'de> for ViewPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawPod::deserialize(d)?;
        Ok(ViewPod(Pod {
            metadata: raw.metadata.into_meta(),
            spec: raw.spec.map(RawPodSpec::into_spec),
            status: raw.status.map(RawPodStatus::into_status),
        }))
    }
}

impl<'de> Deserialize<'de> for ViewNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawNode::deserialize(d)?;
        Ok(ViewNode(Node {
            metadata: raw.metadata.into_meta(),
            spec: raw.spec.map(|s| NodeSpec {
                taints: s.taints,
                unschedulable: s.unschedulable,
                ..Default::default()
            }),
            status: raw.status.map(|s| NodeStatus { allocatable: s.allocatable, ..Default::default() }),
        }))
    }
}

/// Delegates to `K`'s own kind, group, version and plural, so an `Api` of the slim type reads the same
/// objects at the same paths.
macro_rules! resource_of {
    ($slim:ty, $full:ty) => {
        impl kube::Resource for $slim {
            type DynamicType = ();
            type Scope = <$full as kube::Resource>::Scope;

            fn kind(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::kind(dt)
            }
            fn group(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::group(dt)
            }
            fn version(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::version(dt)
            }
            fn plural(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::plural(dt)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.0.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

resource_of!(ViewPod, Pod);
resource_of!(ViewNode, Node);

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPod {
    #[serde(default)]
    metadata: RawMeta,
    spec: Option<RawPodSpec>,
    status: Option<RawPodStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawNode {
    #[serde(default)]
    metadata: RawMeta,
    spec: Option<RawNodeSpec>,
    status: Option<RawNodeStatus>,
}

/// The metadata both kinds keep.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct RawMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<Annotations>,
    owner_references: Option<Vec<OwnerReference>>,
}

impl RawMeta {
    fn into_meta(self) -> ObjectMeta {
        ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            uid: self.uid,
            resource_version: self.resource_version,
            creation_timestamp: self.creation_timestamp,
            deletion_timestamp: self.deletion_timestamp,
            labels: self.labels,
            annotations: self.annotations.map(|a| a.0),
            owner_references: self.owner_references,
            ..Default::default()
        }
    }
}

/// The annotations the view reads ([`KEPT_ANNOTATIONS`]), of a pod or a node: every other key and
/// value is skipped unread.
struct Annotations(BTreeMap<String, String>);

impl<'de> Deserialize<'de> for Annotations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Kept;
        impl<'de> Visitor<'de> for Kept {
            type Value = Annotations;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of annotations")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Annotations, A::Error> {
                let mut kept = BTreeMap::new();
                while let Some(KeptKey(key)) = map.next_key()? {
                    match key {
                        Some(key) => {
                            kept.insert(key.to_owned(), map.next_value::<String>()?);
                        }
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Annotations(kept))
            }
        }
        d.deserialize_map(Kept)
    }
}

/// An annotation's key: which of [`KEPT_ANNOTATIONS`] it is, if any (read without copying it).
struct KeptKey(Option<&'static str>);

impl<'de> Deserialize<'de> for KeptKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = KeptKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an annotation's key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<KeptKey, E> {
                Ok(KeptKey(KEPT_ANNOTATIONS.iter().copied().find(|k| *k == key)))
            }
        }
        d.deserialize_str(Key)
    }
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct RawPodSpec {
    node_name: Option<String>,
    containers: Vec<RawContainer>,
    init_containers: Option<Vec<RawContainer>>,
    overhead: Option<BTreeMap<String, Quantity>>,
    resource_claims: Option<Vec<PodResourceClaim>>,
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<RawAffinity>,
    tolerations: Option<Vec<Toleration>>,
    priority: Option<i32>,
    preemption_policy: Option<String>,
}

impl RawPodSpec {
    fn into_spec(self) -> PodSpec {
        let containers = |cs: Vec<RawContainer>| cs.into_iter().map(RawContainer::into_container).collect();
        PodSpec {
            node_name: self.node_name,
            containers: containers(self.containers),
            init_containers: self.init_containers.map(containers),
            overhead: self.overhead,
            resource_claims: self.resource_claims,
            node_selector: self.node_selector,
            affinity: self.affinity.map(|a| k8s_openapi::api::core::v1::Affinity {
                node_affinity: a.node_affinity,
                ..Default::default()
            }),
            tolerations: self.tolerations,
            priority: self.priority,
            preemption_policy: self.preemption_policy,
            ..Default::default()
        }
    }
}

/// Of a pod's affinity, only the node affinity (the claims' placement reads it).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawAffinity {
    node_affinity: Option<NodeAffinity>,
}

/// Of a container: its name, its resources and (a sidecar's) restart policy.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawContainer {
    #[serde(default)]
    name: String,
    resources: Option<ResourceRequirements>,
    restart_policy: Option<String>,
}

impl RawContainer {
    fn into_container(self) -> Container {
        Container {
            name: self.name,
            resources: self.resources,
            restart_policy: self.restart_policy,
            ..Default::default()
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPodStatus {
    phase: Option<String>,
    reason: Option<String>,
    message: Option<String>,
    conditions: Option<Vec<PodCondition>>,
    resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
}

impl RawPodStatus {
    fn into_status(self) -> PodStatus {
        PodStatus {
            phase: self.phase,
            reason: self.reason,
            message: self.message,
            conditions: self.conditions,
            resource_claim_statuses: self.resource_claim_statuses,
            ..Default::default()
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawNodeSpec {
    taints: Option<Vec<Taint>>,
    unschedulable: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawNodeStatus {
    allocatable: Option<BTreeMap<String, Quantity>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A pod as the API server sends it once the kubelet has run it: what the view reads, and much
    /// that it does not (managed fields, other annotations, a command, env, volumes, pod
    /// anti-affinity, container statuses).
    fn full_pod() -> Value {
        let resources =
            json!({"limits": {"nano-gpu/gpu-percent": "30", "cpu": "1"}, "requests": {"memory": "1Gi"}});
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": "42",
                "creationTimestamp": "2026-11-28T10:00:00Z", "deletionTimestamp": "2026-11-28T11:00:00Z",
                "labels": {"app": "train"},
                "annotations": {
                    "nano-gpu/assignment": "{\"v\":1}", "nano-gpu/gpu-model": "A100|H100",
                    "ALIYUN_COM_GPU_MEM_IDX": "1", "scheduler.framework.gpushare.allocation": "{}",
                    "kubectl.kubernetes.io/last-applied-configuration": "x".repeat(10_000),
                    "other": {"not": "a string"}
                },
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "o", "controller": true}],
                "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}],
                "generateName": "p-", "finalizers": ["f"]
            },
            "spec": {
                "nodeName": "n1", "schedulerName": "nano-gpu-scheduler", "priority": 5,
                "preemptionPolicy": "Never",
                "containers": [{"name": "app", "image": "cuda", "command": ["python", "train.py"],
                                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                                "volumeMounts": [{"name": "v", "mountPath": "/data"}], "resources": resources}],
                "initContainers": [{"name": "sidecar", "image": "proxy", "restartPolicy": "Always",
                                    "resources": {"requests": {"cpu": "100m"}}}],
                "overhead": {"cpu": "250m"},
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                "nodeSelector": {"zone": "a"},
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}},
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "train"}}}]}
                },
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {
                "phase": "Failed", "reason": "UnexpectedAdmissionError", "message": "Allocate failed",
                "conditions": [{"type": "Ready", "status": "True"}],
                "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x"}],
                "podIP": "10.0.0.1", "qosClass": "Burstable",
                "containerStatuses": [{"name": "app", "image": "cuda", "imageID": "sha", "ready": true,
                                       "restartCount": 0, "state": {"running": {}}}]
            }
        })
    }

    /// `full` with what the view does not read taken out, field by field.
    fn as_the_view_keeps_it(mut full: Value) -> Value {
        let meta = full["metadata"].as_object_mut().unwrap();
        for dropped in ["managedFields", "generateName", "finalizers"] {
            meta.remove(dropped);
        }
        meta["annotations"] = json!({
            "nano-gpu/assignment": "{\"v\":1}", "nano-gpu/gpu-model": "A100|H100",
            "ALIYUN_COM_GPU_MEM_IDX": "1", "scheduler.framework.gpushare.allocation": "{}"
        });
        let spec = full["spec"].as_object_mut().unwrap();
        for dropped in ["schedulerName", "volumes"] {
            spec.remove(dropped);
        }
        spec["affinity"].as_object_mut().unwrap().remove("podAntiAffinity");
        for c in ["containers", "initContainers"] {
            for container in spec[c].as_array_mut().unwrap() {
                container
                    .as_object_mut()
                    .unwrap()
                    .retain(|k, _| ["name", "resources", "restartPolicy"].contains(&k.as_str()));
            }
        }
        let status = full["status"].as_object_mut().unwrap();
        for dropped in ["podIP", "qosClass", "containerStatuses"] {
            status.remove(dropped);
        }
        full
    }

    #[test]
    fn a_pod_keeps_what_the_view_reads_and_nothing_else() {
        let slim: ViewPod = serde_json::from_value(full_pod()).unwrap();
        let kept: Pod = serde_json::from_value(as_the_view_keeps_it(full_pod())).unwrap();
        assert_eq!(slim.0, kept);
        assert!(slim.0.spec.as_ref().unwrap().containers[0].env.is_none());
    }

    #[test]
    fn a_pod_decoded_from_text_as_a_watch_reads_it_is_the_same_with_its_keys_escaped_or_not() {
        let text = serde_json::to_string(&full_pod()).unwrap();
        // JSON may escape a key's '/': it is read as the key it spells.
        let escaped = text.replace("\"nano-gpu/assignment\"", r#""nano-gpu\/assignment""#);
        assert_ne!(escaped, text);
        let from_text: ViewPod = serde_json::from_slice(escaped.as_bytes()).unwrap();
        assert_eq!(from_text, serde_json::from_value::<ViewPod>(full_pod()).unwrap());
    }

    #[test]
    fn a_pod_without_annotations_spec_or_status_decodes() {
        let bare: ViewPod =
            serde_json::from_value(json!({"metadata": {"name": "p", "annotations": null}})).unwrap();
        assert_eq!(bare.0.metadata.name.as_deref(), Some("p"));
        assert!(bare.0.metadata.annotations.is_none() && bare.0.spec.is_none() && bare.0.status.is_none());
    }

    #[test]
    fn a_kept_annotation_that_is_not_a_string_is_refused_as_a_whole_pod_would_be() {
        let odd = json!({"metadata": {"name": "p", "annotations": {"nano-gpu/assignment": 1}}});
        assert!(serde_json::from_value::<ViewPod>(odd.clone()).is_err());
        assert!(serde_json::from_value::<Pod>(odd).is_err());
    }

    #[test]
    fn a_node_keeps_its_name_labels_inventory_taints_cordon_and_allocatable() {
        let full = json!({
            "metadata": {"name": "n1", "resourceVersion": "7", "labels": {"nano-gpu/front-end": "dra"},
                         "annotations": {"nano-gpu/gpus": "{}", "node.alpha.kubernetes.io/ttl": "0"},
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"podCIDR": "10.0.0.0/24", "unschedulable": true,
                     "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "4", "nano-gpu/gpu-percent": "800"}, "capacity": {"cpu": "4"},
                       "images": [{"names": ["cuda:12"], "sizeBytes": 1}],
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "nodeInfo": {"kubeletVersion": "v1.35.8", "machineID": "", "systemUUID": "", "bootID": "",
                                    "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "",
                                    "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"}}
        });
        let slim: ViewNode = serde_json::from_value(full).unwrap();
        let kept: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "resourceVersion": "7", "labels": {"nano-gpu/front-end": "dra"},
                         "annotations": {"nano-gpu/gpus": "{}"}},
            "spec": {"unschedulable": true, "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "4", "nano-gpu/gpu-percent": "800"}}
        }))
        .unwrap();
        assert_eq!(slim.0, kept);
    }

    #[test]
    fn the_slim_kinds_are_read_where_the_full_ones_are() {
        use kube::Resource;
        assert_eq!(ViewPod::url_path(&(), Some("ns")), Pod::url_path(&(), Some("ns")));
        assert_eq!(ViewPod::url_path(&(), None), "/api/v1/pods");
        assert_eq!(ViewNode::url_path(&(), None), "/api/v1/nodes");
        assert_eq!(ViewPod::kind(&()), "Pod");
    }
}
