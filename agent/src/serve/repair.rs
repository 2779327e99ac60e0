//! What the agent does with the API server on the device plugin's behalf, off the request path
//! (the node-scoped pod watch that feeds the handlers is `pods::watch`): Events for refused
//! Allocates, and the verify-and-repair of every starting container (ARCHITECTURE §4 step 3): the owner of its IDs from
//! pod-resources, compared with its assignment; when they differ the assignment is patched to what the
//! container really got, so the allocator's accounting converges to the truth, and a warning Event
//! says so. A gpushare container's pod also gets what gpushare's device plugin wrote after Allocate
//! (`ALIYUN_COM_GPU_MEM_ASSIGNED: "true"`, and the card index of a repair). And the usage watchdog's
//! findings: a Warning Event for an overrun, and the pod's `nano-gpu/overrun` mark kept up to date.

use crate::cards::resource::Resource;
use crate::kubelet::plugin::Report;
use crate::node::podresources::Lister;
use crate::node::pods::{MarkChange, RepairAt, describe, owner_of, repaired};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, OVERRUN, OverrunMark, rfc3339};
use nano_gpu_proto::events::Reason;
use nano_gpu_proto::gpushare;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long one API call (a read, a write) may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a starting container's check keeps trying through API failures. A container that got
/// other cards than its assignment names leaves the allocator counting the wrong card until the
/// repair lands, so a failed read (the API server restarting, unreachable, slow) must not drop it.
pub const REPAIR_PATIENCE: Duration = Duration::from_secs(600);

/// The longest wait between two tries of a check. While a repair waits, the allocator places on the
/// view it has, so it is tried again at least every second: after an API server restart it lands
/// within a second of the API answering (the watches' backoff grows to 4 s).
const REPAIR_RETRY_MOST: Duration = Duration::from_secs(1);

/// The worker.
#[derive(Clone)]
pub struct Repairer {
    client: kube::Client,
    node: String,
    lister: Arc<dyn Lister>,
    recorder: Recorder,
    /// How often pod-resources is asked for the owner of a starting container's IDs.
    pub attempts: u32,
    /// How long a check retries API failures ([`REPAIR_PATIENCE`]).
    pub patience: Duration,
}

/// What a check of a starting container found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The assignment names the cards the container got.
    Agrees,
    /// The assignment was rewritten.
    Repaired {
        /// `namespace/name`.
        pod: String,
        /// Container.
        container: String,
    },
}

impl Repairer {
    /// A worker for node `node`.
    pub fn new(client: kube::Client, node: String, lister: Arc<dyn Lister>) -> Self {
        let reporter = Reporter { controller: "nano-gpu-agent".into(), instance: Some(node.clone()) };
        let recorder = Recorder::new(client.clone(), reporter);
        Repairer { client, node, lister, recorder, attempts: 10, patience: REPAIR_PATIENCE }
    }

    /// Handles reports until every sender is gone.
    pub async fn run(self, mut reports: mpsc::Receiver<Report>) {
        while let Some(report) = reports.recv().await {
            match report {
                Report::Refused { pod, message } => {
                    tracing::warn!(pod = pod.as_deref().unwrap_or("-"), "{message}");
                    let object = match &pod {
                        Some(key) => pod_reference(key),
                        None => node_reference(&self.node),
                    };
                    record(&self.recorder, &object, Reason::NoUsableAssignment, "Allocate", &message).await;
                }
                Report::Warning { pod, reason, action, message } => {
                    tracing::warn!(%pod, %reason, "{message}");
                    record(&self.recorder, &pod_reference(&pod), reason, action, &message).await;
                }
                Report::Mark(change) => {
                    if let Err(e) = self.mark(&change).await {
                        tracing::warn!(pod = %change.pod, error = %e, "the overrun mark was not written");
                    }
                }
                Report::Starting { ids, cards, resource } => {
                    // Its own task: a check that waits out an API outage holds up no Event or mark.
                    let worker = self.clone();
                    tokio::spawn(async move {
                        match worker.verify(&ids, &cards, resource).await {
                            Ok(Verdict::Agrees) => {}
                            Ok(Verdict::Repaired { pod, container }) => {
                                tracing::warn!(%pod, %container, "assignment repaired to the cards the kubelet allocated")
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "a starting container could not be verified")
                            }
                        }
                    });
                }
            }
        }
    }

    /// Writes pod `change.pod`'s `nano-gpu/overrun` mark (label and annotation), or removes both when
    /// it names no overrun; only the pod with `change.uid` (a pod re-created under the same name is
    /// not touched).
    pub async fn mark(&self, change: &MarkChange) -> Result<(), String> {
        let (namespace, name) = change.pod.split_once('/').ok_or("a pod without a namespace")?;
        let (label, annotation) = if change.overruns.is_empty() {
            (serde_json::Value::Null, serde_json::Value::Null)
        } else {
            ("true".into(), OverrunMark::new(change.overruns.clone()).encode().into())
        };
        let patch = json!({"metadata": {
            "uid": change.uid,
            "labels": {OVERRUN: label},
            "annotations": {OVERRUN: annotation},
        }});
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match tokio::time::timeout(
            API_TIMEOUT,
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            // Gone, or another pod by now: nothing to mark.
            Ok(Err(kube::Error::Api(e))) if e.code == 404 || e.code == 409 => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} s", API_TIMEOUT.as_secs())),
        }
    }

    /// Checks the container holding `ids` against its assignment, repairing it when they differ;
    /// reads and writes that fail (no answer, an error other than the pod being gone) are tried
    /// again, 250 ms after the first failure doubling to [`REPAIR_RETRY_MOST`], for up to
    /// [`Repairer::patience`].
    pub async fn verify(
        &self,
        ids: &[String],
        cards: &[crate::cards::inventory::Card],
        resource: Resource,
    ) -> Result<Verdict, String> {
        let started = tokio::time::Instant::now();
        let mut backoff = nano_gpu_runtime::watch_backoff();
        loop {
            match self.verify_once(ids, cards, resource).await {
                Err(Failure::Transient(e)) if started.elapsed() < self.patience => {
                    let wait = backoff.next().unwrap_or(REPAIR_RETRY_MOST).min(REPAIR_RETRY_MOST);
                    tracing::debug!(error = %e, "verifying a starting container: trying again in {wait:?}");
                    tokio::time::sleep(wait).await;
                }
                Err(Failure::Transient(e) | Failure::Final(e)) => return Err(e),
                Ok(verdict) => return Ok(verdict),
            }
        }
    }

    /// One try of [`Repairer::verify`].
    async fn verify_once(
        &self,
        ids: &[String],
        cards: &[crate::cards::inventory::Card],
        resource: Resource,
    ) -> Result<Verdict, Failure> {
        let owner = owner_of(&*self.lister, resource.name(), ids, self.attempts).await;
        let final_ = |e: &str| Failure::Final(e.to_owned());
        let (key, container) =
            owner.ok_or_else(|| final_("no container holds these device IDs in pod-resources"))?;
        let (namespace, name) =
            key.split_once('/').ok_or_else(|| final_("pod-resources named a pod without a namespace"))?;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        for _ in 0..5 {
            let pod = match tokio::time::timeout(API_TIMEOUT, api.get(name)).await {
                Ok(Ok(pod)) => pod,
                // Gone: nothing is counted for it any more.
                Ok(Err(kube::Error::Api(e))) if e.code == 404 => return Ok(Verdict::Agrees),
                Ok(Err(e)) => return Err(Failure::Transient(format!("reading pod {key}: {e}"))),
                Err(_) => return Err(Failure::Transient(format!("reading pod {key}: no answer in 10 s"))),
            };
            let text = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION));
            // An undecodable annotation is replaced by what the container really got.
            let current = text.and_then(|t| Assignment::decode(t).ok());
            let now = rfc3339(std::time::SystemTime::now());
            let at = RepairAt { node: &self.node, cards, resource, now: &now };
            let next = repaired(current.as_ref(), &container, ids, at).map_err(Failure::Final)?;
            let mut annotations = serde_json::Map::new();
            if let Some(next) = &next {
                annotations.insert(ASSIGNMENT_ANNOTATION.into(), next.encode().into());
            }
            if let Resource::Gpushare(_) = resource {
                // What gpushare's device plugin writes once a container got its memory; and its card
                // index follows a repair.
                if let Some(g) = next.as_ref().and_then(|n| n.containers[&container].first()) {
                    annotations.insert(gpushare::IDX.into(), g.index.to_string().into());
                }
                let assigned = pod.metadata.annotations.as_ref().and_then(|a| a.get(gpushare::ASSIGNED));
                if assigned.map(String::as_str) != Some("true") {
                    annotations.insert(gpushare::ASSIGNED.into(), "true".into());
                }
            }
            if annotations.is_empty() {
                return Ok(Verdict::Agrees);
            }
            let patch = json!({"metadata": {
                "uid": pod.metadata.uid,
                "resourceVersion": pod.metadata.resource_version,
                "annotations": annotations,
            }});
            let (params, merge) = (PatchParams::default(), Patch::Merge(&patch));
            let written = tokio::time::timeout(API_TIMEOUT, api.patch(name, &params, &merge)).await;
            match written.unwrap_or_else(|_| Err(kube::Error::Service("no answer in 10 s".into()))) {
                Ok(_) => {
                    let Some(next) = next else { return Ok(Verdict::Agrees) };
                    let was = current
                        .as_ref()
                        .and_then(|a| a.containers.get(&container))
                        .map_or("nothing".to_owned(), |g| describe(g));
                    let message = format!(
                        "container {container:?} got card(s) {} from the kubelet, not {was} as assigned; \
                         {ASSIGNMENT_ANNOTATION} now says what it got",
                        describe(&next.containers[&container])
                    );
                    record(
                        &self.recorder,
                        &pod_reference(&key),
                        Reason::AssignmentRepaired,
                        "Allocate",
                        &message,
                    )
                    .await;
                    return Ok(Verdict::Repaired { pod: key, container });
                }
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Verdict::Agrees),
                Err(e) => return Err(Failure::Transient(format!("patching pod {key}: {e}"))),
            }
        }
        Err(Failure::Transient(format!("pod {key} kept changing; its assignment was not repaired yet")))
    }
}

/// Why a check did not end.
enum Failure {
    /// The API failed us; a later try may succeed.
    Transient(String),
    /// Nothing to try again: the IDs have no owner, the pod's assignment cannot be repaired.
    Final(String),
}

fn pod_reference(key: &str) -> ObjectReference {
    let (namespace, name) = key.split_once('/').unwrap_or(("", key));
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

pub(crate) fn node_reference(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        ..Default::default()
    }
}

async fn record(recorder: &Recorder, object: &ObjectReference, reason: Reason, action: &str, message: &str) {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.as_str().into(),
        note: Some(message.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, object).await {
        tracing::warn!(error = %e, "could not record an event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cards::inventory::Card;
    use http::{Request, Response};
    use kube::client::Body;
    use nano_gpu_proto::device_id;
    use nano_gpu_proto::kubelet::podresources::{
        ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
    };
    use nano_gpu_proto::resources::GPU_PERCENT;
    use nano_gpu_proto::units::MiB;
    use tonic::Status;

    /// pod-resources: container `c` of pod `ns/p` holds `ids`.
    struct Holds(Vec<String>);

    #[tonic::async_trait]
    impl Lister for Holds {
        async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
            let devices = vec![ContainerDevices {
                resource_name: GPU_PERCENT.into(),
                device_ids: self.0.clone(),
                topology: None,
            }];
            let container = ContainerResources { name: "c".into(), devices, ..Default::default() };
            let pod = PodResources { name: "p".into(), namespace: "ns".into(), containers: vec![container] };
            Ok(ListPodResourcesResponse { pod_resources: vec![pod] })
        }
    }

    fn pod_assigned_to(uuid: &str) -> Vec<u8> {
        let a = format!(
            r#"{{"v":1,"node":"n1","at":"t","containers":{{"c":[{{"uuid":"{uuid}","index":0,"percent":30}}]}}}}"#
        );
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                         "annotations": {ASSIGNMENT_ANNOTATION: a}}});
        serde_json::to_vec(&pod).unwrap()
    }

    fn status(code: u16) -> Response<Body> {
        let body = serde_json::json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code,
                                      "reason": "InternalError", "message": "the API server is not itself"});
        Response::builder().status(code).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap()
    }

    /// The kubelet gave the container card GPU-b while its assignment names GPU-a, and the API server
    /// fails the first reads: the check keeps trying and repairs the assignment once it answers.
    #[tokio::test(start_paused = true)]
    async fn a_repair_waits_out_api_failures_instead_of_dropping_the_container() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let ids: Vec<String> = (0..30).map(|n| device_id::encode("GPU-b", n)).collect();
        let mut repairer =
            Repairer::new(kube::Client::new(svc, "default"), "n1".into(), Arc::new(Holds(ids.clone())));
        repairer.attempts = 1;
        let cards = [
            Card::nvidia(0, "GPU-a", "T4", MiB(15360), None),
            Card::nvidia(1, "GPU-b", "T4", MiB(15360), None),
        ];
        let server = tokio::spawn(async move {
            // Two failed reads (an error, then silence past the call's timeout), then the pod.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!((req.method().as_str(), req.uri().path()), ("GET", "/api/v1/namespaces/ns/pods/p"));
            send.send_response(status(500));
            let (_, silent) = handle.next_request().await.unwrap();
            let (req, send) = handle.next_request().await.unwrap();
            drop(silent);
            assert_eq!(req.method().as_str(), "GET");
            send.send_response(Response::new(Body::from(pod_assigned_to("GPU-a"))));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!((req.method().as_str(), req.uri().path()), ("PATCH", "/api/v1/namespaces/ns/pods/p"));
            let body: serde_json::Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            let written =
                Assignment::decode(body["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].as_str().unwrap());
            assert_eq!(written.unwrap().containers["c"][0].uuid, "GPU-b");
            send.send_response(Response::new(Body::from(pod_assigned_to("GPU-b"))));
            // The Event that says so.
            let (req, send) = handle.next_request().await.unwrap();
            assert!(req.uri().path().ends_with("/events"), "{}", req.uri());
            send.send_response(Response::new(Body::from(b"{}".to_vec())));
        });
        let verdict = repairer.verify(&ids, &cards, Resource::Percent).await.unwrap();
        assert_eq!(verdict, Verdict::Repaired { pod: "ns/p".into(), container: "c".into() });
        server.await.unwrap();
    }

    /// A pod that is gone needs no repair; the check ends without retrying.
    #[tokio::test(start_paused = true)]
    async fn a_gone_pod_ends_the_check() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let ids: Vec<String> = (0..30).map(|n| device_id::encode("GPU-b", n)).collect();
        let repairer =
            Repairer::new(kube::Client::new(svc, "default"), "n1".into(), Arc::new(Holds(ids.clone())));
        let server = tokio::spawn(async move {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(status(404));
        });
        let cards = [Card::nvidia(1, "GPU-b", "T4", MiB(15360), None)];
        assert_eq!(repairer.verify(&ids, &cards, Resource::Percent).await.unwrap(), Verdict::Agrees);
        server.await.unwrap();
    }
}
