//! Which container a call is for (ARCHITECTURE §4), as the handlers ask it: the candidates from the
//! pod watch and pod-resources (`crate::node::pods` decides), the steering of GetPreferredAllocation, the
//! claim of an Allocate, and the [`Report`]s for the background repair worker.

use super::Snapshot;
use super::devices::prefer;
use super::edits::Claimed;
use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use crate::node::podresources::Lister;
use crate::node::pods::watch::NodePods;
use crate::node::pods::{NodePod, Pending, Pods, Served, identify, owner_of, pending, steer};
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::events::Reason;
use nano_gpu_proto::kubelet::podresources::ListPodResourcesResponse;
use nano_gpu_proto::units::MiB;
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tonic::Status;

/// Steering decisions kept until their Allocate comes.
const STEERED_KEPT: usize = 256;

/// Something the background worker acts on (it may call the API server; handlers do only to read
/// the node's pods when the watch lags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// An Allocate was refused: no pod placed here by nano-gpu could own the IDs.
    Refused {
        /// The pod (`namespace/name`) it was most likely for, if any.
        pod: Option<String>,
        /// Why.
        message: String,
    },
    /// A container is starting with these IDs: check its assignment says the same cards.
    Starting {
        /// The device IDs of the container.
        ids: Vec<String>,
        /// The cards at that time.
        cards: Snapshot,
        /// The resource of the IDs.
        resource: Resource,
    },
    /// A Warning Event on a pod: a container over its memory grant for longer than the grace
    /// period, a card's MPS daemon lost.
    Warning {
        /// The pod (`namespace/name`).
        pod: String,
        /// The Event's reason.
        reason: Reason,
        /// The Event's action.
        action: &'static str,
        /// What happened.
        message: String,
    },
    /// A pod's `nano-gpu/overrun` mark must say this (or go).
    Mark(crate::node::pods::MarkChange),
}

/// What tells containers apart: the pods on this node and the kubelet's pod-resources.
pub struct Identity {
    pods: watch::Receiver<Pods>,
    lister: Arc<dyn Lister>,
    pub(super) reports: mpsc::Sender<Report>,
    node: String,
    resource: Resource,
    /// How long to wait for the pod watch to show a pod the kubelet already admits.
    wait: Duration,
    /// Where to read the node's pods when the watch does not show it, and for how long in all.
    direct: Option<(Arc<dyn NodePods>, Duration)>,
    memo: std::sync::Mutex<Memo>,
}

/// Decisions between calls: which container a preferred set of IDs was for, and the containers this
/// agent has allocated (init containers do not show in pod-resources).
#[derive(Default)]
struct Memo {
    steered: VecDeque<(Vec<String>, (String, String))>,
    done: HashSet<(String, String)>,
}

fn sorted(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

impl Identity {
    /// Identity for `resource` from the pods of node `node` that ask it, the kubelet's
    /// pod-resources, reporting to `reports`.
    pub fn new(
        node: String,
        resource: Resource,
        pods: watch::Receiver<Pods>,
        lister: Arc<dyn Lister>,
        reports: mpsc::Sender<Report>,
        wait: Duration,
    ) -> Self {
        Identity { pods, lister, reports, node, resource, wait, direct: None, memo: Default::default() }
    }

    /// Also reads the node's pods from the API server when the watch does not show the pod the
    /// kubelet is admitting, for up to `patience` in all (a control-plane blip must not fail a pod).
    pub fn with_direct_reads(mut self, reader: Arc<dyn NodePods>, patience: Duration) -> Self {
        self.direct = Some((reader, patience));
        self
    }

    /// Sends every container that holds IDs of this resource now (pod-resources `List`) to the
    /// check a starting one gets: at an agent's start, one that started while no agent ran, or whose
    /// check the previous agent did not finish (killed between the kubelet's Allocate and the
    /// check), has its assignment repaired to the cards the kubelet gave it. A container whose
    /// assignment agrees is left as it is. Returns how many were sent.
    pub async fn recheck_running(&self, cards: &Snapshot) -> Result<usize, String> {
        let listed = self.listed().await?;
        let mut sent = 0;
        for container in listed.pod_resources.iter().flat_map(|p| &p.containers) {
            let ids: Vec<String> = container
                .devices
                .iter()
                .filter(|d| d.resource_name == self.resource.name())
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect();
            if ids.is_empty() {
                continue;
            }
            let report = Report::Starting { ids, cards: cards.clone(), resource: self.resource };
            if self.reports.send(report).await.is_err() {
                break;
            }
            sent += 1;
        }
        Ok(sent)
    }

    /// What the kubelet's pod-resources lists now (every resource's: the node's identities share it).
    pub async fn listed(&self) -> Result<ListPodResourcesResponse, String> {
        self.lister.list().await.map_err(|e| format!("pod-resources List: {}", e.message()))
    }

    /// The pods bound to this node that ask the resource and still wait for their devices by
    /// `listed` ([`crate::node::pods::unadmitted`]), by `namespace/name`: what an agent going away
    /// serves first.
    pub fn unadmitted(&self, listed: &ListPodResourcesResponse) -> Vec<String> {
        let served = Served::from_list(listed, self.resource.name());
        let pods = self.pods.borrow().clone();
        let memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
        crate::node::pods::unadmitted(&pods, &served, &memo.done)
    }

    /// The containers that may be asking `size` now, likeliest first. Certain is a candidate whose
    /// pod the kubelet lists (it is admitting it). Waits up to `wait` for the pod watch to show one
    /// (the kubelet can see a pod before our watch does); then, with direct reads, asks the API
    /// server for the node's pods, again every second while it cannot answer, up to `patience`.
    /// What a successful read shows is the answer, even with no certain candidate in it.
    async fn candidates(&self, size: u64) -> Vec<Pending> {
        let found = self.watched(size, tokio::time::Instant::now() + self.wait).await;
        let certain = |found: &[Pending]| found.first().is_some_and(|p| p.known);
        let Some((reader, patience)) = self.direct.as_ref().filter(|_| !certain(&found)) else {
            return found;
        };
        let deadline = tokio::time::Instant::now() + *patience;
        let mut said = false;
        loop {
            match reader.list().await {
                Ok(list) => {
                    // Newer than the watch's view, and whole: it replaces it for this call.
                    let pods: BTreeMap<String, NodePod> = list
                        .iter()
                        .filter_map(|p| NodePod::from_pod(p, self.resource.name()))
                        .map(|p| (p.key(), p))
                        .collect();
                    return self.pending(&pods, &self.served().await, size);
                }
                Err(e) if !said => {
                    tracing::warn!(error = %e, "the pod watch does not show the pod being admitted, and \
                        the API server cannot be read; asking again every second");
                    said = true;
                }
                Err(_) => {}
            }
            // The watch may come back first.
            let next = (tokio::time::Instant::now() + Duration::from_secs(1)).min(deadline);
            let found = self.watched(size, next).await;
            if certain(&found) || tokio::time::Instant::now() >= deadline {
                return found;
            }
            // Never faster than once a second (the watch may have ended, or shown something else).
            tokio::time::sleep_until(next).await;
        }
    }

    /// The candidates the pod watch shows, waiting for it until `deadline` while it shows none.
    async fn watched(&self, size: u64, deadline: tokio::time::Instant) -> Vec<Pending> {
        let mut pods = self.pods.clone();
        loop {
            let served = self.served().await;
            let snapshot = pods.borrow_and_update().clone();
            let found = self.pending(&snapshot, &served, size);
            if !found.is_empty() {
                return found;
            }
            match tokio::time::timeout_at(deadline, pods.changed()).await {
                Ok(Ok(())) => continue,
                _ => return found,
            }
        }
    }

    /// What the kubelet has allocated (nothing known when pod-resources cannot be read).
    async fn served(&self) -> Served {
        match self.lister.list().await {
            Ok(list) => Served::from_list(&list, self.resource.name()),
            Err(e) => {
                tracing::warn!(error = %e.message(), "pod-resources List failed; identifying by the pod watch alone");
                Served::default()
            }
        }
    }

    /// [`pending`] among `pods`, leaving out what this agent allocated (and forgetting what it
    /// allocated for pods that are gone).
    fn pending(&self, pods: &BTreeMap<String, NodePod>, served: &Served, size: u64) -> Vec<Pending> {
        let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
        let uids: HashSet<&str> = pods.values().map(|p| p.uid.as_str()).collect();
        memo.done.retain(|(uid, _)| uids.contains(uid.as_str()));
        pending(pods, served, &memo.done, size)
    }

    /// [`Identity::candidates`] without the agent's own record (pod-resources alone), no waiting.
    async fn candidates_unrecorded(&self, size: u64) -> Vec<Pending> {
        let served = match self.lister.list().await {
            Ok(list) => Served::from_list(&list, self.resource.name()),
            Err(_) => return Vec::new(),
        };
        let snapshot = self.pods.borrow().clone();
        pending(&snapshot, &served, &HashSet::new(), size)
    }

    /// The pod of the container the kubelet gave `ids` (pod-resources names it) and what that pod
    /// holds on `card`: its `namespace/name`, UID and memory there (the grants of its assignment
    /// that add to the pod). The pod watch shows it (it was admitted); without it, one direct read.
    pub(super) async fn holding(&self, ids: &[String], card: &Card) -> Result<(String, String, MiB), String> {
        let owner = owner_of(&*self.lister, self.resource.name(), ids, 10).await;
        let (key, _) = owner.ok_or("no container holds these device IDs in pod-resources")?;
        let mut pod = self.pods.borrow().get(&key).cloned();
        if pod.is_none()
            && let Some((reader, _)) = &self.direct
        {
            let list = reader.list().await.map_err(|e| format!("pod {key}: reading the node's pods: {e}"))?;
            pod = list
                .iter()
                .filter_map(|p| NodePod::from_pod(p, self.resource.name()))
                .find(|p| p.key() == key);
        }
        let pod = pod.ok_or_else(|| {
            format!("pod {key} is not among the node's pods asking {}", self.resource.name())
        })?;
        let assignment = pod.assignment.map_err(|e| format!("pod {key}: {e}"))?;
        let memory = assignment
            .held()
            .filter(|g| g.uuid == card.info.uuid)
            .map(|g| g.memory_held(card.info.memory_mib).0)
            .sum::<u64>();
        if memory == 0 {
            return Err(format!("pod {key} holds nothing on card {} in its assignment", card.info.uuid));
        }
        Ok((key, pod.uid, MiB(memory)))
    }

    /// GetPreferredAllocation for one container: IDs on the cards of the container most likely
    /// asking, else the card-packing choice.
    pub(super) async fn prefer(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let candidates = self.candidates(size as u64).await;
        let first = candidates.first();
        let quota = |g: &CardGrant| self.resource.quota(g, size);
        let steered = first.and_then(|p| steer(p.grants.as_ref().ok()?, available, must, size, quota));
        let ids = steered.unwrap_or_else(|| prefer(available, must, size));
        if let Some(p) = first {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            if memo.steered.len() >= STEERED_KEPT {
                memo.steered.pop_front();
            }
            memo.steered.push_back((sorted(&ids), (p.uid.clone(), p.container.clone())));
        }
        ids
    }

    /// The grants of the container an Allocate of `ids` (on `cards`) is for; an error the kubelet
    /// reports (and an Event) when no pod placed here by nano-gpu can own them.
    pub(super) async fn claim(&self, ids: &[String], cards: &BTreeSet<&str>) -> Result<Claimed, Status> {
        let mut candidates = self.candidates(ids.len() as u64).await;
        if candidates.is_empty() {
            // An earlier guess may have taken this container's place in the record of what the
            // agent allocated: ask again, trusting pod-resources alone.
            candidates = self.candidates_unrecorded(ids.len() as u64).await;
        }
        let key = sorted(ids);
        let steered = {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            let at = memo.steered.iter().position(|(k, _)| *k == key);
            at.and_then(|i| memo.steered.remove(i)).map(|(_, who)| who)
        };
        let refuse = |pod: Option<String>, message: String| {
            let _ = self.reports.try_send(Report::Refused { pod, message: message.clone() });
            Status::failed_precondition(message)
        };
        match identify(&candidates, steered.as_ref(), cards) {
            Some(p) => match &p.grants {
                Ok(grants) => {
                    let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
                    memo.done.insert((p.uid.clone(), p.container.clone()));
                    Ok(Claimed { grants: grants.clone(), pod_units: p.pod_units })
                }
                Err(reason) => Err(refuse(
                    Some(p.pod.clone()),
                    format!("nano-gpu cannot serve pod {} container {:?}: {reason}", p.pod, p.container),
                )),
            },
            None => Err(refuse(
                None,
                format!(
                    "no pod placed on node {} by nano-gpu is waiting for {} of {}; \
                     pods asking it must be scheduled by nano-gpu-scheduler",
                    self.node,
                    ids.len(),
                    self.resource.name()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
    use nano_gpu_proto::device_id;
    use nano_gpu_proto::kubelet::podresources::{ListPodResourcesResponse, PodResources};
    use nano_gpu_proto::resources::GPU_PERCENT;
    use nano_gpu_proto::units::Percent;
    use serde_json::json;
    use std::sync::Mutex;

    /// pod-resources listing pod `ns/<name>` (being admitted, nothing allocated yet).
    struct Admitting(&'static str);

    #[tonic::async_trait]
    impl Lister for Admitting {
        async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
            let pod = PodResources { name: self.0.into(), namespace: "ns".into(), containers: vec![] };
            Ok(ListPodResourcesResponse { pod_resources: vec![pod] })
        }
    }

    /// One answer of the API server to a direct read.
    type Answer = Result<Vec<Pod>, String>;

    /// The API server's answers to direct reads, in order (the last repeats); counts the reads.
    struct Answers(Mutex<(Vec<Answer>, usize)>);

    #[tonic::async_trait]
    impl NodePods for Answers {
        async fn list(&self) -> Answer {
            let mut a = self.0.lock().unwrap();
            a.1 += 1;
            let i = (a.1 - 1).min(a.0.len() - 1);
            a.0[i].clone()
        }
    }

    fn pod(name: &str) -> Pod {
        let grant = CardGrant { uuid: "GPU-a".into(), index: 0, percent: Percent(30), memory_mib: None };
        let a = Assignment::new("n1", "2026-11-23T10:00:00Z", [("c".to_owned(), vec![grant])].into());
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "annotations": {ASSIGNMENT_ANNOTATION: a.encode()}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: "30"}}}]}}))
        .unwrap()
    }

    /// An identity whose pod watch shows nothing (it lags), reading the node's pods from `answers`.
    fn lagging(answers: Vec<Answer>) -> (Identity, Arc<Answers>, mpsc::Receiver<Report>) {
        let (_, pods) = watch::channel(Pods::default());
        let (reports, queue) = mpsc::channel(8);
        let answers = Arc::new(Answers(Mutex::new((answers, 0))));
        let wait = Duration::from_secs(3);
        let identity =
            Identity::new("n1".into(), Resource::Percent, pods, Arc::new(Admitting("new")), reports, wait)
                .with_direct_reads(answers.clone(), Duration::from_secs(60));
        (identity, answers, queue)
    }

    fn claim_ids() -> Vec<String> {
        (0..30).map(|n| device_id::encode("GPU-a", n)).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_the_watch_has_not_shown_is_found_by_reading_the_node_once_the_api_answers() {
        // The API server is down for 10 s (refusals, as after its restart), then answers.
        let mut answers: Vec<_> = (0..10).map(|_| Err("403 Forbidden".to_owned())).collect();
        answers.push(Ok(vec![pod("old-done"), pod("new")]));
        let (identity, reads, _queue) = lagging(answers);
        let started = tokio::time::Instant::now();
        let claimed = identity.claim(&claim_ids(), &BTreeSet::from(["GPU-a"])).await.unwrap();
        assert_eq!(claimed.grants[0].uuid, "GPU-a");
        assert_eq!(reads.0.lock().unwrap().1, 11);
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn what_a_successful_read_does_not_show_is_refused_at_once() {
        let (identity, reads, mut queue) = lagging(vec![Ok(vec![])]);
        let started = tokio::time::Instant::now();
        let refused = identity.claim(&claim_ids(), &BTreeSet::from(["GPU-a"])).await.unwrap_err();
        assert!(refused.message().contains("no pod placed on node n1"), "{}", refused.message());
        assert!(matches!(queue.try_recv(), Ok(Report::Refused { .. })));
        // The watch's wait, one read (and the retry without the agent's record): no patience spent.
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(reads.0.lock().unwrap().1 <= 2);
    }

    /// pod-resources listing `ns/<name>`'s container `c` holding `devices` of each resource.
    struct Holding(Vec<(&'static str, &'static str, Vec<String>)>);

    #[tonic::async_trait]
    impl Lister for Holding {
        async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
            use nano_gpu_proto::kubelet::podresources::{ContainerDevices, ContainerResources};
            let pod_resources = self
                .0
                .iter()
                .map(|(name, resource, ids)| PodResources {
                    name: (*name).into(),
                    namespace: "ns".into(),
                    containers: vec![ContainerResources {
                        name: "c".into(),
                        devices: vec![ContainerDevices {
                            resource_name: (*resource).into(),
                            device_ids: ids.clone(),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }],
                })
                .collect();
            Ok(ListPodResourcesResponse { pod_resources })
        }
    }

    #[tokio::test]
    async fn running_containers_of_the_resource_are_sent_to_the_starting_check() {
        let (_, pods) = watch::channel(Pods::default());
        let (reports, mut queue) = mpsc::channel(8);
        let lister = Holding(vec![
            ("a", GPU_PERCENT, claim_ids()),
            ("b", "nvidia.com/gpu", vec!["GPU-x".into()]),
            ("c", GPU_PERCENT, vec![]),
        ]);
        let identity =
            Identity::new("n1".into(), Resource::Percent, pods, Arc::new(lister), reports, Duration::ZERO);
        let cards: Snapshot = Arc::new(vec![]);
        assert_eq!(identity.recheck_running(&cards).await, Ok(1));
        match queue.try_recv() {
            Ok(Report::Starting { ids, resource: Resource::Percent, .. }) => assert_eq!(ids, claim_ids()),
            other => panic!("expected the check of a's container, got {other:?}"),
        }
        assert!(queue.try_recv().is_err(), "only the container holding IDs of the resource");
    }

    #[tokio::test(start_paused = true)]
    async fn an_api_that_never_answers_is_waited_for_up_to_the_patience_then_refused() {
        let (identity, reads, _queue) = lagging(vec![Err("connection refused".into())]);
        let started = tokio::time::Instant::now();
        assert!(identity.claim(&claim_ids(), &BTreeSet::from(["GPU-a"])).await.is_err());
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(60) && waited < Duration::from_secs(70), "{waited:?}");
        assert!(reads.0.lock().unwrap().1 >= 50, "read about once a second");
    }
}
