//! Pod identity on the node without a lock (ARCHITECTURE §4).
//!
//! The kubelet never says which pod a device-plugin call is for. Two things the agent can read
//! identify it: the pods on this node with their `nano-gpu/assignment` (a node-scoped watch), and
//! what the kubelet has allocated so far (pod-resources `List`). The call is for a container placed
//! here, asking the call's size, that the kubelet has not served yet; the kubelet admits one pod at a
//! time and lists that pod while it admits it, so that pod's containers come first. A wrong guess
//! costs nothing the kubelet's own accounting does not catch, and is repaired after the fact
//! (`repair`): device visibility always follows the IDs the kubelet chose.
//!
//! Everything here is pure: the handlers call it with snapshots.

pub mod watch;

use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use crate::node::podresources::Lister;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, CardGrant, OVERRUN, Overrun, OverrunMark,
};
use nano_gpu_proto::demand::asked;
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::podresources::ListPodResourcesResponse;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// A pod on this node that asks the served resource, as the watch last showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID (a re-created pod of the same name is another pod).
    pub uid: String,
    /// Creation time: the kubelet admits pods in this order.
    pub created: Option<Time>,
    /// The containers asking the resource, with how much, in the order the kubelet allocates them:
    /// init containers, then app containers.
    pub asking: Vec<(String, u64)>,
    /// The assignment, or why there is no usable one.
    pub assignment: Result<Assignment, String>,
}

/// `namespace/name`, how pod-resources names a pod.
pub fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

impl NodePod {
    /// The pod's `namespace/name`.
    pub fn key(&self) -> String {
        pod_key(&self.namespace, &self.name)
    }

    /// Reads a Pod; `None` for one that asks none of `resource` or has finished.
    pub fn from_pod(pod: &Pod, resource: &str) -> Option<NodePod> {
        let spec = pod.spec.as_ref()?;
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return None;
        }
        let asking: Vec<(String, u64)> = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .filter_map(|c| match asked(c, resource) {
                Ok(Some(n)) if n > 0 => Some((c.name.clone(), n)),
                _ => None,
            })
            .collect();
        if asking.is_empty() {
            return None;
        }
        let assignment = match pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)) {
            None => Err(format!(
                "it has no {ASSIGNMENT_ANNOTATION} annotation (was it scheduled by nano-gpu-scheduler?)"
            )),
            Some(text) => Assignment::decode(text).map_err(|e| e.to_string()),
        };
        Some(NodePod {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            created: pod.metadata.creation_timestamp.clone(),
            asking,
            assignment,
        })
    }
}

/// The pods on this node that ask the resource, by `namespace/name`.
pub type Pods = Arc<BTreeMap<String, NodePod>>;

/// Any pod running on this node (asking GPUs or not), as the usage metrics name its processes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID, as its cgroup names it.
    pub uid: String,
    /// Container names by runtime ID (the hex part of `containerStatuses[].containerID`), init
    /// containers included.
    pub containers: BTreeMap<String, String>,
    /// Its card grants per container, from a well-formed assignment (none without one).
    pub grants: BTreeMap<String, Vec<CardGrant>>,
    /// The ResourceClaims each container names (`resources.claims`), init containers included: the
    /// grants of a pod placed through DRA ([`crate::serve::usage::claims`]).
    pub claims: BTreeMap<String, Vec<ClaimUse>>,
    /// Its `nano-gpu/overrun` mark: none when it has neither the label nor the annotation; empty when
    /// it has only one of them or the annotation does not decode (to be rewritten or removed).
    pub mark: Option<Vec<Overrun>>,
}

impl Resident {
    /// Reads a Pod; `None` for one that has finished.
    pub fn from_pod(pod: &Pod) -> Option<Resident> {
        let status = pod.status.as_ref();
        if matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
            return None;
        }
        let containers = status
            .into_iter()
            .flat_map(|s| {
                s.init_container_statuses.iter().flatten().chain(s.container_statuses.iter().flatten())
            })
            .filter_map(|c| {
                let id = status_id(c.container_id.as_deref()?);
                Some((id.to_ascii_lowercase(), c.name.clone()))
            })
            .collect();
        let grants = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| Assignment::decode(a.get(ASSIGNMENT_ANNOTATION)?).ok())
            .map(|a| a.containers)
            .unwrap_or_default();
        let claims = claim_uses(pod);
        let labelled = pod.metadata.labels.as_ref().is_some_and(|l| l.contains_key(OVERRUN));
        let annotated = pod.metadata.annotations.as_ref().and_then(|a| a.get(OVERRUN));
        let mark = match (labelled, annotated) {
            (false, None) => None,
            (true, Some(text)) => Some(OverrunMark::decode(text).map(|m| m.containers).unwrap_or_default()),
            _ => Some(Vec::new()),
        };
        Some(Resident {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            containers,
            grants,
            claims,
            mark,
        })
    }
}

/// A ResourceClaim a container names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimUse {
    /// The claim's name, in the pod's namespace.
    pub claim: String,
    /// The one request of the claim the container takes; `None`: all of them.
    pub request: Option<String>,
}

impl ClaimUse {
    /// Whether the container takes what the allocation gave request `request` (`name` or
    /// `name/subrequest`).
    pub fn takes(&self, request: &str) -> bool {
        self.request.as_deref().is_none_or(|r| request.split('/').next() == Some(r))
    }
}

/// The claims each container of `pod` names, by container: a pod's entry names its claim directly or
/// through a template, whose claim's name the pod's status gives once the claim is made (an entry
/// with no claim yet is left out).
fn claim_uses(pod: &Pod) -> BTreeMap<String, Vec<ClaimUse>> {
    let Some(spec) = pod.spec.as_ref() else { return BTreeMap::new() };
    let claim_of = |entry: &str| nano_gpu_proto::dra::claim_of_entry(pod, entry);
    let mut uses = BTreeMap::new();
    for c in spec.init_containers.iter().flatten().chain(spec.containers.iter()) {
        let named = c.resources.as_ref().and_then(|r| r.claims.as_ref());
        let list: Vec<ClaimUse> = named
            .into_iter()
            .flatten()
            .filter_map(|n| Some(ClaimUse { claim: claim_of(&n.name)?, request: n.request.clone() }))
            .collect();
        if !list.is_empty() {
            uses.insert(c.name.clone(), list);
        }
    }
    uses
}

/// A pod whose mark must change: `namespace/name`, UID, and the overruns it should name (none: remove
/// the mark).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkChange {
    /// `namespace/name`.
    pub pod: String,
    /// Pod UID (the patch's precondition).
    pub uid: String,
    /// What the mark should say.
    pub overruns: Vec<Overrun>,
}

/// The hex ID of a `containerStatuses[].containerID` (`containerd://<id>`, `cri-o://<id>`, `docker://<id>`).
pub fn status_id(container_id: &str) -> &str {
    container_id.rsplit_once("://").map_or(container_id, |(_, id)| id)
}

/// Every pod running on this node, by UID.
pub type Residents = Arc<BTreeMap<String, Resident>>;

/// What the kubelet has allocated, from pod-resources `List`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Pods the kubelet knows (admitted, or being admitted), by `namespace/name`.
    pub pods: HashSet<String>,
    /// Device IDs of the resource per pod (`namespace/name`) and container.
    pub ids: HashMap<(String, String), Vec<String>>,
}

impl Served {
    /// Reads a `List` answer for `resource`.
    pub fn from_list(list: &ListPodResourcesResponse, resource: &str) -> Served {
        let mut served = Served::default();
        for pod in &list.pod_resources {
            let key = pod_key(&pod.namespace, &pod.name);
            for c in &pod.containers {
                let ids: Vec<String> = c
                    .devices
                    .iter()
                    .filter(|d| d.resource_name == resource)
                    .flat_map(|d| d.device_ids.iter().cloned())
                    .collect();
                if !ids.is_empty() {
                    served.ids.insert((key.clone(), c.name.clone()), ids);
                }
            }
            served.pods.insert(key);
        }
        served
    }

    /// The pod and container the kubelet gave exactly `ids` (in any order).
    pub fn owner(&self, ids: &[String]) -> Option<&(String, String)> {
        let want: BTreeSet<&String> = ids.iter().collect();
        self.ids.iter().find(|(_, got)| got.iter().collect::<BTreeSet<_>>() == want).map(|(k, _)| k)
    }
}

/// The pod and container the kubelet gave exactly `ids` of `resource`, asking pod-resources up to
/// `attempts` times, 200 ms apart (a container's IDs show there a moment after its Allocate).
pub async fn owner_of(
    lister: &dyn Lister,
    resource: &str,
    ids: &[String],
    attempts: u32,
) -> Option<(String, String)> {
    for attempt in 0..attempts.max(1) {
        if attempt > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        match lister.list().await {
            Ok(list) => {
                if let Some(owner) = Served::from_list(&list, resource).owner(ids) {
                    return Some(owner.clone());
                }
            }
            Err(e) => tracing::debug!(error = %e.message(), "pod-resources List failed"),
        }
    }
    None
}

/// A container placed on this node that the kubelet has not served yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// Its pod's `namespace/name`.
    pub pod: String,
    /// Its pod's UID.
    pub uid: String,
    /// Container name.
    pub container: String,
    /// Its cards, or why the pod has no usable assignment.
    pub grants: Result<Vec<CardGrant>, String>,
    /// What the whole pod asks of the resource.
    pub pod_units: u64,
    /// Whether the kubelet lists its pod (it is admitting it): what makes a candidate certain.
    pub known: bool,
}

/// The containers of `pods` asking `size` that the kubelet has not served (`served`, plus `done`:
/// `(uid, container)` the agent itself allocated, which covers init containers that pod-resources
/// does not list), likeliest first: the pods the kubelet lists (it is admitting them), then by
/// assignment time, creation time and container order.
pub fn pending(
    pods: &BTreeMap<String, NodePod>,
    served: &Served,
    done: &HashSet<(String, String)>,
    size: u64,
) -> Vec<Pending> {
    let mut found = Vec::new();
    for (key, pod) in pods {
        // Init containers are allocated before the app containers: once one app container of a pod
        // holds IDs, the pod's init containers are past.
        let past_init = pod.asking.iter().any(|(c, _)| served.ids.contains_key(&(key.clone(), c.clone())));
        for (order, (container, asks)) in pod.asking.iter().enumerate() {
            if *asks != size
                || served.ids.contains_key(&(key.clone(), container.clone()))
                || done.contains(&(pod.uid.clone(), container.clone()))
            {
                continue;
            }
            let grants = match &pod.assignment {
                Ok(a) => match a.containers.get(container) {
                    Some(g) => Ok(g.clone()),
                    None => {
                        Err(format!("its {ASSIGNMENT_ANNOTATION} has no cards for container {container:?}"))
                    }
                },
                Err(e) => Err(e.clone()),
            };
            let at = pod.assignment.as_ref().map(|a| a.at.clone()).unwrap_or_default();
            let known = served.pods.contains(key);
            let rank = (!known, past_init, at, pod.created.clone(), key.clone(), order);
            let pod_units = pod.asking.iter().map(|(_, n)| n).sum();
            let (pod_key, uid, container) = (key.clone(), pod.uid.clone(), container.clone());
            found.push((rank, Pending { pod: pod_key, uid, container, grants, pod_units, known }));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found.into_iter().map(|(_, p)| p).collect()
}

/// The pods of `pods` (by `namespace/name`) that still wait for their devices: none of their
/// containers asking the resource holds IDs (`served`) or was allocated by this agent (`done`). The
/// kubelet allocates every container of a pod as it admits it, so one served container means the
/// pod's admission is past; a pod bound to the node that the kubelet has not admitted yet is here,
/// whether or not the kubelet has seen it.
pub fn unadmitted(
    pods: &BTreeMap<String, NodePod>,
    served: &Served,
    done: &HashSet<(String, String)>,
) -> Vec<String> {
    pods.iter()
        .filter(|(key, pod)| {
            !pod.asking.iter().any(|(c, _)| {
                served.ids.contains_key(&((*key).clone(), c.clone()))
                    || done.contains(&(pod.uid.clone(), c.clone()))
            })
        })
        .map(|(key, _)| key.clone())
        .collect()
}

/// The IDs to prefer for a container granted `grants`: the IDs the kubelet must include, then free
/// IDs of the granted cards, each card up to its `quota`, `size` in all. `None` when the granted
/// cards cannot hold the request among the available IDs, or a must-include ID is on another card.
pub fn steer(
    grants: &[CardGrant],
    available: &[String],
    must: &[String],
    size: usize,
    quota: impl Fn(&CardGrant) -> usize,
) -> Option<Vec<String>> {
    if must.len() > size {
        return None;
    }
    let mut held: HashMap<&str, usize> = HashMap::new();
    for id in must {
        let uuid = device_id::card_of(id).ok()?;
        if !grants.iter().any(|g| g.uuid == uuid) {
            return None;
        }
        *held.entry(uuid).or_default() += 1;
    }
    let mut chosen: Vec<String> = must.to_vec();
    for g in grants {
        let have = held.get(g.uuid.as_str()).copied().unwrap_or(0);
        let want = quota(g).min(have + size - chosen.len()).saturating_sub(have);
        let free = available
            .iter()
            .filter(|id| device_id::card_of(id).is_ok_and(|uuid| uuid == g.uuid) && !must.contains(id));
        let before = chosen.len();
        chosen.extend(free.take(want).cloned());
        if chosen.len() - before < want {
            return None;
        }
    }
    (chosen.len() == size).then_some(chosen)
}

/// Which pending container an Allocate of IDs on `cards` served: the one steered to exactly these
/// IDs, else the first whose grants cover the cards, else the likeliest.
pub fn identify<'a>(
    candidates: &'a [Pending],
    steered: Option<&(String, String)>,
    cards: &BTreeSet<&str>,
) -> Option<&'a Pending> {
    if let Some((uid, container)) = steered
        && let Some(p) = candidates.iter().find(|p| &p.uid == uid && &p.container == container)
    {
        return Some(p);
    }
    let covers =
        |p: &&Pending| p.grants.as_ref().is_ok_and(|g| cards.iter().all(|c| g.iter().any(|g| g.uuid == *c)));
    candidates.iter().find(covers).or_else(|| candidates.first())
}

/// Per card UUID, how many of `ids` are on it; `None` if one is not a nano-gpu ID.
pub fn per_card(ids: &[String]) -> Option<BTreeMap<&str, u32>> {
    let mut cards = BTreeMap::new();
    for id in ids {
        *cards.entry(device_id::card_of(id).ok()?).or_default() += 1;
    }
    Some(cards)
}

/// Where and when a repair happens.
#[derive(Clone, Copy, Debug)]
pub struct RepairAt<'a> {
    /// This node.
    pub node: &'a str,
    /// The cards now.
    pub cards: &'a [Card],
    /// The resource of the IDs.
    pub resource: Resource,
    /// Stamps an assignment made from nothing.
    pub now: &'a str,
}

/// The assignment to write when a container got other cards than `current` says: its grants replaced
/// by the cards of `ids` (see [`Resource::grant`]); `None` when the cards agree.
pub fn repaired(
    current: Option<&Assignment>,
    container: &str,
    ids: &[String],
    at: RepairAt<'_>,
) -> Result<Option<Assignment>, String> {
    let got = per_card(ids).ok_or_else(|| format!("device IDs {ids:?} are not nano-gpu IDs"))?;
    let old = current.and_then(|a| a.containers.get(container));
    if let Some(old) = old {
        let assigned: BTreeSet<&str> = old.iter().map(|g| g.uuid.as_str()).collect();
        if assigned == got.keys().copied().collect() {
            return Ok(None);
        }
    }
    let grants = got
        .iter()
        .enumerate()
        .map(|(i, (uuid, n))| {
            let card = at
                .cards
                .iter()
                .find(|c| c.info.uuid == *uuid)
                .ok_or_else(|| format!("card {uuid} is not on this node"))?;
            let memory_mib = old.and_then(|o| o.get(i).or(o.first())).and_then(|g| g.memory_mib);
            Ok(at.resource.grant(card, u64::from(*n), memory_mib))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mut next = current.cloned().unwrap_or_else(|| Assignment::new(at.node, at.now, BTreeMap::new()));
    next.containers.insert(container.to_owned(), grants);
    Ok(Some(next))
}

/// Grants as `uuid (n%)` for messages.
pub fn describe(grants: &[CardGrant]) -> String {
    grants.iter().map(|g| format!("{} ({}%)", g.uuid, g.percent.0)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::kubelet::podresources::{ContainerDevices, ContainerResources, PodResources};
    use nano_gpu_proto::resources::GPU_PERCENT;
    use nano_gpu_proto::units::{MiB, Percent};
    use serde_json::{Value, json};

    fn grant(uuid: &str, percent: u32) -> CardGrant {
        CardGrant { uuid: uuid.into(), index: 0, percent: Percent(percent), memory_mib: None }
    }

    /// A pod with one container "c" asking `asks`, assigned at `at` that share of card `uuid`.
    fn pod(name: &str, created: &str, asks: u32, at: &str, uuid: &str) -> NodePod {
        let containers = BTreeMap::from([("c".to_string(), vec![grant(uuid, asks)])]);
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "creationTimestamp": created,
                         "annotations": {ASSIGNMENT_ANNOTATION: Assignment::new("n1", at, containers).encode()}},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: asks.to_string()}}}]}}))
        .unwrap();
        NodePod::from_pod(&p, GPU_PERCENT).unwrap()
    }

    fn pods(list: Vec<NodePod>) -> BTreeMap<String, NodePod> {
        list.into_iter().map(|p| (p.key(), p)).collect()
    }

    fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| device_id::encode(uuid, n)).collect()
    }

    fn list(entries: &[(&str, &str, &[String])]) -> ListPodResourcesResponse {
        ListPodResourcesResponse {
            pod_resources: entries
                .iter()
                .map(|(pod, container, ids)| PodResources {
                    name: pod.to_string(),
                    namespace: "ns".into(),
                    containers: vec![ContainerResources {
                        name: container.to_string(),
                        devices: if ids.is_empty() {
                            vec![]
                        } else {
                            vec![ContainerDevices {
                                resource_name: GPU_PERCENT.into(),
                                device_ids: ids.to_vec(),
                                topology: None,
                            }]
                        },
                        ..Default::default()
                    }],
                })
                .collect(),
        }
    }

    #[test]
    fn a_pod_waits_for_its_devices_until_one_of_its_containers_is_served() {
        let all = pods(vec![
            pod("admitted", "2026-01-01T00:00:00Z", 30, "t", "GPU-a"),
            pod("bound", "2026-01-01T00:00:01Z", 20, "t", "GPU-a"),
            pod("by-us", "2026-01-01T00:00:02Z", 10, "t", "GPU-a"),
        ]);
        // The kubelet lists `admitted` with IDs, and `bound` without (it is admitting it).
        let served = Served::from_list(
            &list(&[("admitted", "c", &ids("GPU-a", 0..30)), ("bound", "c", &[])]),
            GPU_PERCENT,
        );
        let done = HashSet::from([("uid-by-us".to_string(), "c".to_string())]);
        assert_eq!(unadmitted(&all, &served, &done), vec!["ns/bound".to_string()]);
        assert_eq!(
            unadmitted(&all, &served, &HashSet::new()),
            vec!["ns/bound".to_string(), "ns/by-us".to_string()]
        );
        assert!(unadmitted(&BTreeMap::new(), &served, &done).is_empty());
    }

    #[test]
    fn a_pod_is_read_with_its_asks_in_allocation_order_and_its_assignment() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"initContainers": [{"name": "init", "resources": {"limits": {GPU_PERCENT: "20"}}}],
                     "containers": [{"name": "cpu"},
                                    {"name": "main", "resources": {"limits": {GPU_PERCENT: "50"}}}]}}))
        .unwrap();
        let p = NodePod::from_pod(&p, GPU_PERCENT).unwrap();
        assert_eq!(p.asking, vec![("init".to_string(), 20), ("main".to_string(), 50)]);
        assert!(p.assignment.unwrap_err().contains("no nano-gpu/assignment"));

        let done: Pod = serde_json::from_value(json!({
            "metadata": {"name": "q"}, "status": {"phase": "Succeeded"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: "50"}}}]}}))
        .unwrap();
        assert_eq!(NodePod::from_pod(&done, GPU_PERCENT), None);
        let bad: Pod = serde_json::from_value(json!({
            "metadata": {"name": "b", "annotations": {ASSIGNMENT_ANNOTATION: "{"}},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: "50"}}}]}}))
        .unwrap();
        assert!(NodePod::from_pod(&bad, GPU_PERCENT).unwrap().assignment.is_err());
    }

    #[test]
    fn a_residents_overrun_mark_is_read_whole_or_as_one_to_rewrite() {
        let mark = OverrunMark::new(vec![Overrun {
            container: "c".into(),
            uuid: "GPU-a".into(),
            index: 0,
            used: MiB(9),
            granted: MiB(1),
            since: "2026-11-23T10:00:00Z".into(),
        }]);
        let resident = |labels: Value, annotations: Value| {
            let p: Pod = serde_json::from_value(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": labels, "annotations": annotations},
                "spec": {"containers": [{"name": "c"}]}}))
            .unwrap();
            Resident::from_pod(&p).unwrap().mark
        };
        let marked = json!({OVERRUN: "true"});
        assert_eq!(resident(json!({}), json!({})), None);
        assert_eq!(resident(marked.clone(), json!({OVERRUN: mark.encode()})), Some(mark.containers.clone()));
        // Half a mark, or one that does not decode: to be rewritten (or removed).
        assert_eq!(resident(json!({}), json!({OVERRUN: mark.encode()})), Some(vec![]));
        assert_eq!(resident(marked.clone(), json!({})), Some(vec![]));
        assert_eq!(resident(marked, json!({OVERRUN: "{"})), Some(vec![]));
    }

    #[test]
    fn a_resident_names_the_claims_its_containers_use_directly_or_through_a_template() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {
                "resourceClaims": [
                    {"name": "direct", "resourceClaimName": "shared-claim"},
                    {"name": "made", "resourceClaimTemplateName": "nano-gpu-p30"},
                    {"name": "not-yet", "resourceClaimTemplateName": "nano-gpu-w1"}],
                "initContainers": [{"name": "init", "resources": {"claims": [{"name": "direct"}]}}],
                "containers": [
                    {"name": "a", "resources": {"claims": [{"name": "made", "request": "gpu"}, {"name": "direct"}]}},
                    {"name": "b", "resources": {"claims": [{"name": "not-yet"}, {"name": "unknown"}]}},
                    {"name": "c"}]},
            "status": {"resourceClaimStatuses": [{"name": "made", "resourceClaimName": "p-made-x7k2"}]}}))
        .unwrap();
        let r = Resident::from_pod(&p).unwrap();
        let uses = |c: &str| -> Vec<(String, Option<String>)> {
            r.claims.get(c).into_iter().flatten().map(|u| (u.claim.clone(), u.request.clone())).collect()
        };
        assert_eq!(uses("init"), [("shared-claim".into(), None)]);
        assert_eq!(uses("a"), [("p-made-x7k2".into(), Some("gpu".into())), ("shared-claim".into(), None)]);
        // A claim not made yet, or an entry the pod does not have, names nothing.
        assert!(!r.claims.contains_key("b") && !r.claims.contains_key("c"), "{:?}", r.claims);
        let gpu = ClaimUse { claim: "x".into(), request: Some("gpu".into()) };
        assert!(gpu.takes("gpu") && gpu.takes("gpu/small") && !gpu.takes("other") && !gpu.takes("gpux"));
        assert!(ClaimUse { claim: "x".into(), request: None }.takes("other"));
    }

    #[test]
    fn the_pod_being_admitted_comes_first_then_the_oldest_assignment() {
        let all = pods(vec![
            pod("old", "2026-01-01T00:00:00Z", 30, "2026-01-01T00:00:01Z", "GPU-a"),
            pod("new", "2026-01-01T00:00:05Z", 30, "2026-01-01T00:00:06Z", "GPU-b"),
            pod("big", "2026-01-01T00:00:00Z", 50, "2026-01-01T00:00:00Z", "GPU-c"),
        ]);
        let none = HashSet::new();
        let order = |served: &Served| -> Vec<String> {
            pending(&all, served, &none, 30).into_iter().map(|p| p.pod).collect()
        };
        assert_eq!(order(&Served::default()), ["ns/old", "ns/new"]);
        // The kubelet lists "new" (it is admitting it) before "old".
        let admitting = Served::from_list(&list(&[("new", "c", &[])]), GPU_PERCENT);
        assert_eq!(order(&admitting), ["ns/new", "ns/old"]);
        // Served containers, by pod-resources or by the agent's own record, are no longer pending.
        let served = Served::from_list(&list(&[("old", "c", &ids("GPU-a", 0..30))]), GPU_PERCENT);
        assert_eq!(order(&served), ["ns/new"]);
        let done = HashSet::from([("uid-new".to_string(), "c".to_string())]);
        assert!(pending(&all, &served, &done, 30).is_empty());
    }

    #[test]
    fn steering_takes_the_granted_cards_ids_up_to_each_grant() {
        let mut available = ids("GPU-a", 0..100);
        available.extend(ids("GPU-b", 40..100));
        let pct = |g: &CardGrant| g.percent.0 as usize;
        let chosen = steer(&[grant("GPU-b", 30)], &available, &[], 30, pct).unwrap();
        assert!(chosen.len() == 30 && chosen.iter().all(|id| id.starts_with("GPU-b-")));
        // Two whole cards: a hundred of each.
        let mut whole = ids("GPU-a", 0..100);
        whole.extend(ids("GPU-b", 0..100));
        let chosen = steer(&[grant("GPU-a", 100), grant("GPU-b", 100)], &whole, &[], 200, pct).unwrap();
        assert_eq!(chosen.iter().filter(|id| id.starts_with("GPU-a-")).count(), 100);
        // Reused IDs of an init container come first; the rest from the same card.
        let must = ids("GPU-b", 40..60);
        let chosen = steer(&[grant("GPU-b", 50)], &available, &must, 50, pct).unwrap();
        assert_eq!(&chosen[..20], &must[..]);
        assert!(chosen.len() == 50 && chosen.iter().all(|id| id.starts_with("GPU-b-")));
        // The granted card is too full, or a must-include ID is elsewhere: no steering.
        assert_eq!(steer(&[grant("GPU-b", 70)], &available, &[], 70, pct), None);
        assert_eq!(steer(&[grant("GPU-b", 30)], &available, &ids("GPU-a", 0..1), 30, pct), None);
    }

    #[test]
    fn allocate_identifies_the_steered_container_else_the_one_whose_cards_match() {
        let candidates = vec![
            Pending {
                pod: "ns/x".into(),
                uid: "ux".into(),
                container: "c".into(),
                grants: Ok(vec![grant("GPU-a", 30)]),
                pod_units: 30,
                known: true,
            },
            Pending {
                pod: "ns/y".into(),
                uid: "uy".into(),
                container: "c".into(),
                grants: Ok(vec![grant("GPU-b", 30)]),
                pod_units: 30,
                known: true,
            },
        ];
        let on_b = BTreeSet::from(["GPU-b"]);
        let steered = ("ux".to_string(), "c".to_string());
        assert_eq!(identify(&candidates, Some(&steered), &on_b).unwrap().uid, "ux");
        assert_eq!(identify(&candidates, None, &on_b).unwrap().uid, "uy");
        assert_eq!(identify(&candidates, None, &BTreeSet::from(["GPU-z"])).unwrap().uid, "ux");
        assert_eq!(identify(&[], None, &on_b), None);
    }

    #[test]
    fn the_owner_of_ids_is_found_in_any_order() {
        let mut given = ids("GPU-a", 0..3);
        let served = Served::from_list(&list(&[("p", "c", &given)]), GPU_PERCENT);
        given.reverse();
        assert_eq!(served.owner(&given), Some(&("ns/p".to_string(), "c".to_string())));
        assert_eq!(served.owner(&ids("GPU-a", 0..2)), None);
        assert_eq!(per_card(&["x".to_string()]), None);
    }

    #[test]
    fn a_container_on_other_cards_gets_its_assignment_rewritten_keeping_its_memory() {
        let cards = [Card::nvidia(3, "GPU-b", "T4", MiB(15360), None)];
        let mut g = grant("GPU-a", 30);
        g.memory_mib = Some(MiB(2048));
        let current = Assignment::new("n1", "t", BTreeMap::from([("c".to_string(), vec![g.clone()])]));
        let on_a = ids("GPU-a", 0..30);
        let at = RepairAt { node: "n1", cards: &cards, resource: Resource::Percent, now: "now" };
        assert_eq!(repaired(Some(&current), "c", &on_a, at), Ok(None));
        let next = repaired(Some(&current), "c", &ids("GPU-b", 10..40), at).unwrap().unwrap();
        let want =
            CardGrant { uuid: "GPU-b".into(), index: 3, percent: Percent(30), memory_mib: Some(MiB(2048)) };
        assert_eq!(next.containers["c"], vec![want]);
        assert_eq!(next.at, "t");
        // No assignment at all: one is made.
        let made = repaired(None, "c", &ids("GPU-b", 0..100), at).unwrap().unwrap();
        assert_eq!(
            (made.node.as_str(), made.at.as_str(), made.containers["c"][0].percent),
            ("n1", "now", Percent(100))
        );
        assert!(repaired(None, "c", &ids("GPU-zz", 0..1), at).is_err());
    }
}
