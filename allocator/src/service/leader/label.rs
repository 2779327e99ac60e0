//! The leader's pod carries the label `nano-gpu/leader=true`: operators (`kubectl get pods -l
//! nano-gpu/leader=true`) and any Service that must reach the deciding replica alone see which one it
//! is, while every replica that can serve is Ready (the webhook's Service reaches them all, and
//! rollouts, PDBs and drains see two Ready replicas).
//!
//! Deciding never depends on the label: a replica decides only while it holds the Lease (see the
//! parent module). The label only shows. A replica that takes the Lease first removes the label
//! from any other pod still carrying it (a leader that died or froze before it could), then labels
//! its own pod; a replica that stops leading removes its own. A patch that fails is tried again at
//! the next election round.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use std::time::Duration;

/// The label on the deciding replica's pod.
pub const LEADER_LABEL: &str = "nano-gpu/leader";

/// Keeps the leader label of this replica's pod in step with its leadership.
pub struct LeaderLabel {
    pods: Api<Pod>,
    me: String,
    /// What our pod carries as far as we know (None: not known yet).
    labelled: Option<bool>,
    /// Since we lead, the label is off every other pod.
    others_cleared: bool,
}

impl LeaderLabel {
    /// For the pod `me` in the namespace of `pods`.
    pub fn new(pods: Api<Pod>, me: String) -> Self {
        LeaderLabel { pods, me, labelled: None, others_cleared: false }
    }

    /// Brings the labels in step with `leading`, each API call within `limit`.
    pub async fn reconcile(&mut self, leading: bool, limit: Duration) {
        if !leading {
            self.others_cleared = false;
        } else if !self.others_cleared {
            match tokio::time::timeout(limit, self.clear_others()).await {
                Ok(Ok(())) => self.others_cleared = true,
                Ok(Err(e)) => tracing::warn!(error = %e, "could not take the leader label off other pods"),
                Err(_) => tracing::warn!("could not take the leader label off other pods within {limit:?}"),
            }
            if !self.others_cleared {
                // Never two labelled pods from our side: label ourselves once the others are clear.
                return;
            }
        }
        if self.labelled == Some(leading) {
            return;
        }
        match tokio::time::timeout(limit, set(&self.pods, &self.me, leading)).await {
            Ok(Ok(())) => {
                self.labelled = Some(leading);
                tracing::info!(pod = %self.me, leading, "leader label set");
            }
            Ok(Err(e)) => tracing::warn!(pod = %self.me, error = %e, "could not set the leader label"),
            Err(_) => tracing::warn!(pod = %self.me, "could not set the leader label within {limit:?}"),
        }
    }

    async fn clear_others(&self) -> Result<(), kube::Error> {
        let labelled = self.pods.list(&ListParams::default().labels(&format!("{LEADER_LABEL}=true"))).await?;
        for p in labelled.items {
            let name = p.metadata.name.unwrap_or_default();
            if name != self.me {
                set(&self.pods, &name, false).await?;
                tracing::info!(pod = %name, "took the leader label off a former leader");
            }
        }
        Ok(())
    }
}

/// Puts the label on pod `name` (`on`) or takes it off; a pod that is gone carries none.
async fn set(pods: &Api<Pod>, name: &str, on: bool) -> Result<(), kube::Error> {
    let value = if on { json!("true") } else { json!(null) };
    let patch = json!({"metadata": {"labels": {LEADER_LABEL: value}}});
    match pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 && !on => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    //! The requests of each step against a fake API server (tower-test).
    use super::*;
    use crate::api_replies::{body_json, failure, respond};
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::Value;

    const LIMIT: Duration = Duration::from_secs(5);

    fn pod(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"}})
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    /// The next request: its method, path, query and JSON body (Null when none).
    async fn next(handle: &mut Handle, answer: Response<Body>) -> (String, String, String, Value) {
        let (req, send) = handle.next_request().await.unwrap();
        let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
        let query = req.uri().query().unwrap_or_default().to_owned();
        let json = if method == "PATCH" { body_json(req).await } else { Value::Null };
        send.send_response(answer);
        (method, path, query, json)
    }

    #[tokio::test]
    async fn a_new_leader_clears_a_former_leaders_label_then_labels_itself_once() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods: Api<Pod> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
        let server = tokio::spawn(async move {
            let (m, path, query, _) =
                next(&mut handle, respond(200, json!({"kind": "PodList", "items": [pod("old"), pod("me")]})))
                    .await;
            assert_eq!((m.as_str(), path.as_str()), ("GET", "/api/v1/namespaces/ns/pods"));
            assert!(query.contains("labelSelector=nano-gpu%2Fleader%3Dtrue"), "{query}");
            let (m, path, _, patch) = next(&mut handle, respond(200, pod("old"))).await;
            assert_eq!((m.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/old"));
            assert_eq!(patch, json!({"metadata": {"labels": {"nano-gpu/leader": null}}}));
            let (m, path, _, patch) = next(&mut handle, respond(200, pod("me"))).await;
            assert_eq!((m.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/me"));
            assert_eq!(patch, json!({"metadata": {"labels": {"nano-gpu/leader": "true"}}}));
            // Stepping down: our own label off, nothing listed.
            let (m, path, _, patch) = next(&mut handle, respond(200, pod("me"))).await;
            assert_eq!((m.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/me"));
            assert_eq!(patch, json!({"metadata": {"labels": {"nano-gpu/leader": null}}}));
            handle
        });
        let mut label = LeaderLabel::new(pods, "me".into());
        label.reconcile(true, LIMIT).await;
        // Leading on: nothing more to write.
        label.reconcile(true, LIMIT).await;
        label.reconcile(false, LIMIT).await;
        label.reconcile(false, LIMIT).await;
        let mut handle = server.await.unwrap();
        drop(label);
        assert!(handle.next_request().await.is_none(), "no request beyond those");
    }

    #[tokio::test]
    async fn a_leader_that_cannot_clear_the_others_does_not_label_itself_and_tries_again() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods: Api<Pod> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
        let server = tokio::spawn(async move {
            let (m, ..) =
                next(&mut handle, respond(200, json!({"kind": "PodList", "items": [pod("old")]}))).await;
            assert_eq!(m, "GET");
            let (m, path, ..) = next(&mut handle, failure(500, "InternalError")).await;
            assert_eq!((m.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/old"));
            // The next round: the former leader is gone by now; we label ourselves.
            let (m, ..) = next(&mut handle, respond(200, json!({"kind": "PodList", "items": []}))).await;
            assert_eq!(m, "GET");
            let (m, path, _, patch) = next(&mut handle, respond(200, pod("me"))).await;
            assert_eq!((m.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/me"));
            assert_eq!(patch["metadata"]["labels"]["nano-gpu/leader"], "true");
        });
        let mut label = LeaderLabel::new(pods, "me".into());
        label.reconcile(true, LIMIT).await;
        label.reconcile(true, LIMIT).await;
        server.await.unwrap();
    }
}
