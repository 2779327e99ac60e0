//! Publishes the node's cards on its Node object: the `nano-gpu/gpus` annotation and the
//! `nano-gpu/gpu.*` labels, with one merge patch, only when they differ from what the Node carries
//! (a watch on the Node; before it has shown the Node, from what was last written). So an annotation
//! someone removed or changed is written again.

use crate::inventory::Card;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use nano_gpu_proto::annotations::{
    COUNT_LABEL, GPUS_ANNOTATION, MODEL_LABEL, NodeInventory, VENDOR_LABEL, node_labels,
};
use serde_json::{Value, json};
use tokio::sync::watch;

/// The merge patch for `cards`: labels the inventory no longer has are removed (`null`).
pub fn node_patch(cards: &[Card]) -> Value {
    let inv = NodeInventory::new(cards.iter().map(|c| c.info.clone()).collect());
    let present = node_labels(&inv);
    let labels: serde_json::Map<String, Value> = [COUNT_LABEL, MODEL_LABEL, VENDOR_LABEL]
        .iter()
        .map(|k| (k.to_string(), present.get(*k).map_or(Value::Null, |v| Value::String(v.clone()))))
        .collect();
    json!({"metadata": {"annotations": {GPUS_ANNOTATION: inv.encode()}, "labels": labels}})
}

/// What a Node carries of ours, in the shape of [`node_patch`] (absent labels as `null`).
pub fn carried(node: &Node) -> Value {
    let annotation = node.metadata.annotations.as_ref().and_then(|a| a.get(GPUS_ANNOTATION));
    let labels: serde_json::Map<String, Value> = [COUNT_LABEL, MODEL_LABEL, VENDOR_LABEL]
        .iter()
        .map(|k| {
            let v = node.metadata.labels.as_ref().and_then(|l| l.get(*k));
            (k.to_string(), v.map_or(Value::Null, |v| Value::String(v.clone())))
        })
        .collect();
    let annotations = match annotation {
        Some(a) => json!({GPUS_ANNOTATION: a}),
        None => json!({GPUS_ANNOTATION: null}),
    };
    json!({"metadata": {"annotations": annotations, "labels": labels}})
}

/// Watches one Node; the receiver holds what it carries of ours (`None` until it is seen).
pub fn watch_node(client: kube::Client, node: &str) -> watch::Receiver<Option<Value>> {
    let (tx, rx) = watch::channel(None);
    let api: Api<Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    tokio::spawn(async move {
        let mut stream = watcher::watcher(api, config).default_backoff().boxed();
        loop {
            match stream.try_next().await {
                Ok(Some(watcher::Event::Apply(n) | watcher::Event::InitApply(n))) => {
                    tx.send_if_modified(|seen| {
                        let now = Some(carried(&n));
                        let changed = *seen != now;
                        *seen = now;
                        changed
                    });
                }
                Ok(Some(watcher::Event::Delete(_))) => {
                    tx.send_replace(None);
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(e) => tracing::warn!(error = %e, "node watch failed; retrying with backoff"),
            }
        }
    });
    rx
}

/// Writes the patch to one Node when it differs from what the Node carries.
pub struct Publisher {
    api: Api<Node>,
    node: String,
    last: Option<Value>,
    seen: Option<watch::Receiver<Option<Value>>>,
}

impl Publisher {
    /// For the Node `node`, comparing with the last patch written.
    pub fn new(client: kube::Client, node: String) -> Self {
        Publisher { api: Api::all(client), node, last: None, seen: None }
    }

    /// Compares with what `seen` (see [`watch_node`]) shows the Node carries, once it has shown it.
    pub fn watching(mut self, seen: watch::Receiver<Option<Value>>) -> Self {
        self.seen = Some(seen);
        self
    }

    /// Resolves when the watched Node changes (never without a watch).
    pub async fn node_changed(&mut self) {
        match self.seen.as_mut() {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Publishes `cards`; returns whether a write was needed.
    pub async fn publish(&mut self, cards: &[Card]) -> Result<bool, kube::Error> {
        let patch = node_patch(cards);
        let seen = self.seen.as_ref().and_then(|rx| rx.borrow().clone());
        let current = seen.as_ref().or(self.last.as_ref());
        if current == Some(&patch) {
            return Ok(false);
        }
        self.api.patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        self.last = Some(patch);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;
    use nano_gpu_proto::units::MiB;

    fn card(uuid: &str) -> Card {
        Card::nvidia(0, uuid, "Tesla T4", MiB(15360), None)
    }

    #[test]
    fn labels_of_an_empty_node_are_removed() {
        let p = node_patch(&[]);
        assert_eq!(p["metadata"]["labels"]["nano-gpu/gpu.count"], "0");
        assert!(p["metadata"]["labels"]["nano-gpu/gpu.model"].is_null());
        assert_eq!(p["metadata"]["annotations"]["nano-gpu/gpus"], r#"{"v":1,"gpus":[]}"#);
    }

    #[tokio::test]
    async fn the_node_is_patched_only_when_the_cards_change() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let mut publisher = Publisher::new(kube::Client::new(svc, "default"), "n1".into());
        let server = tokio::spawn(async move {
            for expected_cards in [1, 2] {
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!((req.method().as_str(), req.uri().path()), ("PATCH", "/api/v1/nodes/n1"));
                assert_eq!(req.headers()["content-type"], "application/merge-patch+json");
                let body: Value =
                    serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
                assert_eq!(body["metadata"]["labels"]["nano-gpu/gpu.count"], expected_cards.to_string());
                let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}});
                send.send_response(Response::new(Body::from(serde_json::to_vec(&node).unwrap())));
            }
        });
        assert!(publisher.publish(&[card("GPU-a")]).await.unwrap());
        assert!(!publisher.publish(&[card("GPU-a")]).await.unwrap());
        assert!(publisher.publish(&[card("GPU-a"), card("GPU-b")]).await.unwrap());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_node_that_lost_its_annotation_is_patched_again() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let (seen_tx, seen) = watch::channel(None);
        let mut publisher = Publisher::new(kube::Client::new(svc, "default"), "n1".into()).watching(seen);
        let cards = [card("GPU-a")];
        // The Node carries our cards already: nothing to write.
        seen_tx.send_replace(Some(node_patch(&cards)));
        assert!(!publisher.publish(&cards).await.unwrap());
        // Someone removed the annotation: written again.
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap();
        seen_tx.send_replace(Some(carried(&bare)));
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!((req.method().as_str(), req.uri().path()), ("PATCH", "/api/v1/nodes/n1"));
            let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}});
            send.send_response(Response::new(Body::from(serde_json::to_vec(&node).unwrap())));
        });
        assert!(publisher.publish(&cards).await.unwrap());
        server.await.unwrap();
    }
}
