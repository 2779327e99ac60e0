//! Eviction of pods over their GPU memory grant (`serve --evict-overruns`; off by default).
//!
//! The agent of a node marks a pod of its node whose container has used more card memory than granted
//! for longer than its grace period (`nano-gpu/overrun`, label and annotation), and unmarks it when it
//! is back under. The agent does not evict: the right to create `pods/eviction` cannot be limited to
//! the pods of one node (an admission policy sees the Eviction, not the pod's node), and one node's
//! agent must not be able to evict the cluster. The allocator's leader watches the marked pods only
//! (a label selector) and evicts each through the Eviction API, so PodDisruptionBudgets hold: an
//! eviction they refuse is tried again every [`BLOCKED_RETRY`], and said once in an Event. Who may set
//! the mark is limited by `deploy/assignment-policy.yaml` (only nano-gpu writes it).

use crate::service::leader::Leadership;
use crate::service::watch::publish;
use crate::state::Warning;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::Recorder;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, Config};
use nano_gpu_proto::annotations::{OVERRUN, OverrunMark};
use nano_gpu_proto::events::Reason;
use nano_gpu_runtime::tasks::Child;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How often the marked pods are looked at.
pub const EVERY: Duration = Duration::from_secs(5);
/// How long after a refused eviction (a PodDisruptionBudget) it is tried again.
pub const BLOCKED_RETRY: Duration = Duration::from_secs(30);
/// How long one eviction call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What an eviction attempt came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The API server accepted it: the pod is being deleted.
    Evicted,
    /// Refused for now (429: a PodDisruptionBudget allows no disruption), with the API server's words.
    Blocked(String),
    /// The pod is gone, or is another pod by that name now.
    Gone,
    /// Anything else (tried again at the next pass).
    Failed(String),
}

/// The mark of a pod that should be evicted, or why it should not (yet).
pub fn verdict(pod: &Pod) -> Result<OverrunMark, &'static str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err("already being deleted");
    }
    if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_none_or(str::is_empty) {
        return Err("not on a node");
    }
    if matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
        return Err("finished");
    }
    let text =
        pod.metadata.annotations.as_ref().and_then(|a| a.get(OVERRUN)).ok_or("labelled, not annotated")?;
    OverrunMark::decode(text).map_err(|_| "its mark does not decode")
}

/// Evicts the marked pods while this replica leads.
pub struct Evictor {
    client: kube::Client,
    leader: Arc<Leadership>,
    recorder: Recorder,
    /// Per pod UID: not before when to try again, and whether a refusal was already said.
    tried: HashMap<String, (Instant, bool)>,
}

impl Evictor {
    /// An evictor that acts only while `leader` says this replica leads.
    pub fn new(client: kube::Client, leader: Arc<Leadership>, recorder: Recorder) -> Self {
        Evictor { client, leader, recorder, tried: HashMap::new() }
    }

    /// Watches the marked pods and looks at them every [`EVERY`], until the task is dropped.
    pub async fn run(mut self) {
        let (reader, writer) = reflector::store();
        let config = Config::default().labels(OVERRUN);
        let stream = reflector(writer, watcher::watcher(Api::<Pod>::all(self.client.clone()), config))
            .backoff(nano_gpu_runtime::watch_backoff())
            .for_each(|event| async move {
                if let Err(e) = event {
                    tracing::warn!(error = %e, "watch of marked pods failed; retrying with backoff");
                }
            });
        let mut watching = Child::spawn("marked pods watch", stream);
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = watching.ended() => {
                    tracing::error!("the watch of marked pods ended");
                    return;
                }
            }
            self.pass(&reader.state(), Instant::now()).await;
        }
    }

    /// Evicts each of `pods` that should be and is due, when this replica leads.
    pub async fn pass(&mut self, pods: &[Arc<Pod>], now: Instant) {
        let uid = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
        self.tried.retain(|k, _| pods.iter().any(|p| uid(p) == *k));
        if !self.leader.is_leader() {
            return;
        }
        for pod in pods {
            let uid = uid(pod);
            let said = match self.tried.get(&uid) {
                Some((due, _)) if *due > now => continue,
                Some((_, said)) => *said,
                None => false,
            };
            let Ok(mark) = verdict(pod) else { continue };
            let outcome = self.evict(pod, &uid).await;
            let what = mark
                .containers
                .iter()
                .map(|o| {
                    format!("{} uses {} of card {} (granted {})", o.container, o.used, o.uuid, o.granted)
                })
                .collect::<Vec<_>>()
                .join("; ");
            let event = |reason, message| Warning {
                kind: "Pod",
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                reason,
                message,
            };
            match outcome {
                Outcome::Evicted => {
                    tracing::warn!(pod = ?pod.metadata.name, "evicted for a GPU memory overrun: {what}");
                    let message = format!("evicted: over its GPU memory grant ({what})");
                    publish(&self.recorder, &event(Reason::GpuMemoryOverrunEvicted, message), "Evict").await;
                    self.tried.insert(uid, (now + BLOCKED_RETRY, true));
                }
                Outcome::Blocked(why) => {
                    if !said {
                        let message = format!(
                            "over its GPU memory grant ({what}), but the eviction is refused: {why}; trying \
                             again every {} s",
                            BLOCKED_RETRY.as_secs()
                        );
                        publish(
                            &self.recorder,
                            &event(Reason::GpuMemoryOverrunEvictionBlocked, message),
                            "Evict",
                        )
                        .await;
                    }
                    self.tried.insert(uid, (now + BLOCKED_RETRY, true));
                }
                Outcome::Gone => {}
                Outcome::Failed(e) => {
                    tracing::warn!(pod = ?pod.metadata.name, error = %e, "evicting an overrunning pod failed");
                    self.tried.insert(uid, (now + EVERY, said));
                }
            }
        }
    }

    /// Posts the Eviction of `pod` ([`evict`]).
    async fn evict(&self, pod: &Pod, uid: &str) -> Outcome {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        evict(&self.client, namespace, pod.metadata.name.as_deref().unwrap_or_default(), uid).await
    }
}

/// Posts the Eviction of pod `namespace/name` (only the pod with `uid`). The body is built here:
/// kube's `Api::evict` (kube-core 5.0) writes its delete options as `delete_options`, a field the
/// API server does not know and ignores, so a uid precondition would silently not apply.
pub async fn evict(client: &kube::Client, namespace: &str, name: &str, uid: &str) -> Outcome {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: Some(Preconditions { uid: Some(uid.to_owned()), resource_version: None }),
            ..Default::default()
        }),
    };
    let post = PostParams::default();
    let call = api.create_subresource::<_, serde_json::Value>("eviction", name, &post, &eviction);
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(_)) => Outcome::Evicted,
        Ok(Err(kube::Error::Api(e))) if e.code == 429 => Outcome::Blocked(e.message),
        Ok(Err(kube::Error::Api(e))) if e.code == 404 || e.code == 409 => Outcome::Gone,
        Ok(Err(e)) => Outcome::Failed(e.to_string()),
        Err(_) => Outcome::Failed(format!("no answer within {} s", CALL_TIMEOUT.as_secs())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api_replies::{failure, recording, respond};
    use http::{Request, Response};
    use kube::client::Body;
    use kube::runtime::events::Reporter;
    use serde_json::{Value, json};

    const MARK: &str = r#"{"v":1,"containers":[{"container":"c","uuid":"GPU-a","index":0,"usedMiB":20000,"grantedMiB":1536,"since":"2026-11-23T10:00:00Z"}]}"#;

    fn pod(name: &str, extra: Value) -> Arc<Pod> {
        let mut v = json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "labels": {OVERRUN: "true"}, "annotations": {OVERRUN: MARK}},
            "spec": {"nodeName": "node-1", "containers": []},
            "status": {"phase": "Running"},
        });
        json_patch(&mut v, extra);
        Arc::new(serde_json::from_value(v).unwrap())
    }

    fn json_patch(into: &mut Value, from: Value) {
        match (into, from) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    json_patch(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (slot, v) => *slot = v,
        }
    }

    #[test]
    fn only_a_well_marked_pod_on_a_node_that_is_still_running_is_evicted() {
        assert!(verdict(&pod("p", json!({}))).is_ok());
        for (extra, why) in [
            (json!({"metadata": {"deletionTimestamp": "2026-11-23T10:00:00Z"}}), "already being deleted"),
            (json!({"spec": {"nodeName": null}}), "not on a node"),
            (json!({"status": {"phase": "Succeeded"}}), "finished"),
            (json!({"metadata": {"annotations": null}}), "labelled, not annotated"),
            (
                json!({"metadata": {"annotations": {OVERRUN: "{\"v\":1,\"containers\":[]}"}}}),
                "its mark does not decode",
            ),
        ] {
            assert_eq!(verdict(&pod("p", extra.clone())).unwrap_err(), why, "{extra}");
        }
    }

    fn evictor(leader: Leadership) -> (Evictor, tower_test::mock::Handle<Request<Body>, Response<Body>>) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let recorder = Recorder::new(client.clone(), Reporter { controller: "test".into(), instance: None });
        (Evictor::new(client, Arc::new(leader), recorder), handle)
    }

    #[tokio::test]
    async fn a_follower_evicts_nothing() {
        let (mut e, mut handle) = evictor(Leadership::elected());
        e.pass(&[pod("p", json!({}))], Instant::now()).await;
        drop(e);
        assert!(handle.next_request().await.is_none(), "a follower called the API server");
    }

    #[tokio::test]
    async fn the_leader_evicts_that_pod_only_and_a_refusal_is_said_once_and_tried_again_later() {
        let (mut e, handle) = evictor(Leadership::always());
        let pods = [pod("hog", json!({}))];
        let t0 = Instant::now();
        let server = recording(handle, |path, body, seen| {
            if !path.ends_with("/eviction") {
                return respond(201, body.clone());
            }
            // The first is refused by a PodDisruptionBudget, the second accepted.
            match seen.iter().filter(|(p, _)| p.ends_with("/eviction")).count() {
                0 => failure(429, "TooManyRequests"),
                _ => respond(201, json!({"kind": "Status", "status": "Success"})),
            }
        });
        e.pass(&pods, t0).await;
        e.pass(&pods, t0 + EVERY).await; // not yet due
        e.pass(&pods, t0 + BLOCKED_RETRY).await;
        drop(e);
        let seen = server.await.unwrap();
        let paths: Vec<&str> = seen.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/ns/pods/hog/eviction",
                "/apis/events.k8s.io/v1/namespaces/ns/events",
                "/api/v1/namespaces/ns/pods/hog/eviction",
                "/apis/events.k8s.io/v1/namespaces/ns/events",
            ]
        );
        assert_eq!(seen[0].1["deleteOptions"]["preconditions"]["uid"], "uid-hog", "{}", seen[0].1);
        assert_eq!((&seen[0].1["kind"], &seen[0].1["apiVersion"]), (&json!("Eviction"), &json!("policy/v1")));
        assert_eq!(seen[1].1["reason"], "GpuMemoryOverrunEvictionBlocked");
        assert_eq!(seen[3].1["reason"], "GpuMemoryOverrunEvicted");
        assert!(
            seen[3].1["note"].as_str().unwrap().contains("c uses 20000 MiB of card GPU-a"),
            "{}",
            seen[3].1
        );
    }
}
