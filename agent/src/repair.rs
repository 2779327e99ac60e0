//! What the agent does with the API server on the device plugin's behalf, off the request path
//! (the node-scoped pod watch that feeds the handlers is `pods::watch`): Events for refused
//! Allocates, and the verify-and-repair of every starting container (ARCHITECTURE §4 step 3): the owner of its IDs from
//! pod-resources, compared with its assignment; when they differ the assignment is patched to what the
//! container really got, so the allocator's accounting converges to the truth, and a warning Event
//! says so. A gpushare container's pod also gets what gpushare's device plugin wrote after Allocate
//! (`ALIYUN_COM_GPU_MEM_ASSIGNED: "true"`, and the card index of a repair). And the usage watchdog's
//! findings: a Warning Event for an overrun, and the pod's `nano-gpu/overrun` mark kept up to date.

use crate::plugin::Report;
use crate::podresources::Lister;
use crate::pods::{MarkChange, RepairAt, Served, describe, repaired};
use crate::resource::Resource;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, OVERRUN, OverrunMark, rfc3339};
use nano_gpu_proto::gpushare;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long one write of a mark may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// The worker.
pub struct Repairer {
    client: kube::Client,
    node: String,
    lister: Arc<dyn Lister>,
    recorder: Recorder,
    /// How often pod-resources is asked for the owner of a starting container's IDs.
    pub attempts: u32,
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
        Repairer { client, node, lister, recorder, attempts: 10 }
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
                    record(&self.recorder, &object, "NoUsableAssignment", "Allocate", &message).await;
                }
                Report::Warning { pod, reason, action, message } => {
                    tracing::warn!(%pod, reason, "{message}");
                    record(&self.recorder, &pod_reference(&pod), reason, action, &message).await;
                }
                Report::Mark(change) => {
                    if let Err(e) = self.mark(&change).await {
                        tracing::warn!(pod = %change.pod, error = %e, "the overrun mark was not written");
                    }
                }
                Report::Starting { ids, cards, resource } => {
                    match self.verify(&ids, &cards, resource).await {
                        Ok(Verdict::Agrees) => {}
                        Ok(Verdict::Repaired { pod, container }) => {
                            tracing::warn!(%pod, %container, "assignment repaired to the cards the kubelet allocated")
                        }
                        Err(e) => tracing::warn!(error = %e, "a starting container could not be verified"),
                    }
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

    /// Checks the container holding `ids` against its assignment, repairing it when they differ.
    pub async fn verify(
        &self,
        ids: &[String],
        cards: &[crate::inventory::Card],
        resource: Resource,
    ) -> Result<Verdict, String> {
        let mut owner = None;
        for attempt in 0..self.attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            match self.lister.list().await {
                Ok(list) => owner = Served::from_list(&list, resource.name()).owner(ids).cloned(),
                Err(e) => tracing::debug!(error = %e.message(), "pod-resources List failed"),
            }
            if owner.is_some() {
                break;
            }
        }
        let (key, container) = owner.ok_or("no container holds these device IDs in pod-resources")?;
        let (namespace, name) = key.split_once('/').ok_or("pod-resources named a pod without a namespace")?;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        for _ in 0..5 {
            let pod = api.get(name).await.map_err(|e| format!("reading pod {key}: {e}"))?;
            let text = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION));
            // An undecodable annotation is replaced by what the container really got.
            let current = text.and_then(|t| Assignment::decode(t).ok());
            let now = rfc3339(std::time::SystemTime::now());
            let at = RepairAt { node: &self.node, cards, resource, now: &now };
            let next = repaired(current.as_ref(), &container, ids, at)?;
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
            match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
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
                    record(&self.recorder, &pod_reference(&key), "AssignmentRepaired", "Allocate", &message)
                        .await;
                    return Ok(Verdict::Repaired { pod: key, container });
                }
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(format!("patching pod {key}: {e}")),
            }
        }
        Err(format!("pod {key} kept changing; its assignment was not repaired"))
    }
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

fn node_reference(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        ..Default::default()
    }
}

async fn record(recorder: &Recorder, object: &ObjectReference, reason: &str, action: &str, message: &str) {
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(message.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, object).await {
        tracing::warn!(error = %e, "could not record an event");
    }
}
