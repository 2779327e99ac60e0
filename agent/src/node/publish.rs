//! Publishes the node's cards on its Node object: the `nano-gpu/gpus` annotation and the
//! `nano-gpu/gpu.*` labels, with one merge patch, only when they differ from what the Node carries
//! (a watch on the Node; before it has shown the Node, from what was last written). So an annotation
//! someone removed or changed is written again.
//!
//! With gpushare compatibility, also what gpushare's device plugin put in the Node's status for
//! gpushare's tools (`kubectl inspect gpushare` divides `aliyun.com/gpu-mem` by it to show each card):
//! `aliyun.com/gpu-count` capacity and allocatable, the cards that serve `aliyun.com/gpu-mem`. The
//! kubelet keeps extended resources others write in the status (and copies capacity to allocatable);
//! when it resets them (a node registered anew) the watch shows it and they are written again.

use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use nano_gpu_proto::annotations::{
    COUNT_LABEL, ENFORCEMENT_LABEL, GPUS_ANNOTATION, MEMORY_LIMIT_LABEL, MODEL_LABEL, NodeInventory,
    VENDOR_LABEL, node_labels,
};
use nano_gpu_proto::resources::GPUSHARE_COUNT;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use tokio::sync::watch;

/// The Node labels the agent writes.
const OURS: [&str; 4] = [COUNT_LABEL, MODEL_LABEL, VENDOR_LABEL, MEMORY_LIMIT_LABEL];

/// The merge patch for `cards` and the driver's memory limit (`memory_limit`, the label's value):
/// labels the inventory no longer has are removed (`null`).
pub fn node_patch(cards: &[Card], memory_limit: Option<&str>) -> Value {
    let inv = NodeInventory::new(cards.iter().map(|c| c.info.clone()).collect());
    let mut present = node_labels(&inv);
    if let Some(value) = memory_limit {
        present.insert(MEMORY_LIMIT_LABEL.to_owned(), value.to_owned());
    }
    let labels: serde_json::Map<String, Value> = OURS
        .iter()
        .map(|k| (k.to_string(), present.get(*k).map_or(Value::Null, |v| Value::String(v.clone()))))
        .collect();
    json!({"metadata": {"annotations": {GPUS_ANNOTATION: inv.encode()}, "labels": labels}})
}

/// The merge patch of the Node's status for gpushare's tools: `aliyun.com/gpu-count` capacity and
/// allocatable, the cards that serve `resource` (gpushare's `aliyun.com/gpu-mem`).
pub fn gpushare_status_patch(cards: &[Card], resource: Resource) -> Value {
    let count = cards.iter().filter(|c| resource.card_units(c) > 0).count().to_string();
    json!({"status": {"capacity": {GPUSHARE_COUNT: count}, "allocatable": {GPUSHARE_COUNT: count}}})
}

/// What a Node's status carries of [`gpushare_status_patch`] (absent as `null`).
pub fn carried_status(node: &Node) -> Value {
    let status = node.status.as_ref();
    let count = |list: Option<&BTreeMap<String, Quantity>>| {
        list.and_then(|l| l.get(GPUSHARE_COUNT)).map_or(Value::Null, |q| Value::String(q.0.clone()))
    };
    json!({"status": {
        "capacity": {GPUSHARE_COUNT: count(status.and_then(|s| s.capacity.as_ref()))},
        "allocatable": {GPUSHARE_COUNT: count(status.and_then(|s| s.allocatable.as_ref()))},
    }})
}

/// What a Node carries of ours, in the shape of [`node_patch`] (absent labels as `null`).
pub fn carried(node: &Node) -> Value {
    let annotation = node.metadata.annotations.as_ref().and_then(|a| a.get(GPUS_ANNOTATION));
    let labels: serde_json::Map<String, Value> = OURS
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

/// What the agent reads of its Node: what it carries of ours, its metadata ([`carried`]) and status
/// ([`carried_status`]), and the enforcement mode its operator chose (the `nano-gpu/enforcement`
/// label).
#[derive(Clone, Debug, PartialEq)]
pub struct Carried {
    /// Ours in its metadata, in the shape of [`node_patch`].
    pub metadata: Value,
    /// Ours in its status, in the shape of [`gpushare_status_patch`].
    pub status: Value,
    /// Its `nano-gpu/enforcement` label.
    pub enforcement: Option<String>,
}

impl Carried {
    /// What `node` carries.
    pub fn of(node: &Node) -> Self {
        let label = node.metadata.labels.as_ref().and_then(|l| l.get(ENFORCEMENT_LABEL));
        Carried { metadata: carried(node), status: carried_status(node), enforcement: label.cloned() }
    }
}

/// Watches one Node: the receiver holds what it carries (`None` until it is seen), for as long as
/// the watch (the future, which the caller runs among its background tasks) runs.
pub fn watch_node(
    client: kube::Client,
    node: &str,
) -> (watch::Receiver<Option<Carried>>, impl std::future::Future<Output = ()> + Send + 'static) {
    let (tx, rx) = watch::channel(None);
    let api: Api<Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let watching = async move {
        let mut stream = watcher::watcher(api, config).backoff(nano_gpu_runtime::watch_backoff()).boxed();
        loop {
            match stream.try_next().await {
                Ok(Some(watcher::Event::Apply(n) | watcher::Event::InitApply(n))) => {
                    tx.send_if_modified(|seen| {
                        let now = Some(Carried::of(&n));
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
    };
    (rx, watching)
}

/// Writes the patches to one Node when they differ from what the Node carries.
pub struct Publisher {
    api: Api<Node>,
    node: String,
    gpushare: Option<Resource>,
    memory_limit: Option<&'static str>,
    last: (Option<Value>, Option<Value>),
    seen: Option<watch::Receiver<Option<Carried>>>,
}

impl Publisher {
    /// For the Node `node`, comparing with the last patch written.
    pub fn new(client: kube::Client, node: String) -> Self {
        Publisher {
            api: Api::all(client),
            node,
            gpushare: None,
            memory_limit: None,
            last: (None, None),
            seen: None,
        }
    }

    /// Also publishes the status gpushare's tools read ([`gpushare_status_patch`]) for `resource`.
    pub fn with_gpushare(mut self, resource: Option<Resource>) -> Self {
        self.gpushare = resource;
        self
    }

    /// Also shows the driver's memory limit on the node (`nano-gpu/memory-limit`, `value`).
    pub fn with_memory_limit(mut self, value: &'static str) -> Self {
        self.memory_limit = Some(value);
        self
    }

    /// Compares with what `seen` (see [`watch_node`]) shows the Node carries, once it has shown it.
    pub fn watching(mut self, seen: watch::Receiver<Option<Carried>>) -> Self {
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

    /// Resolves once the watched Node carries the labels and annotation last written, about when
    /// other watchers of the Node (the allocator) see them; at once without a watch or a write.
    pub async fn shown(&mut self) {
        let (Some(seen), Some(last)) = (self.seen.as_mut(), self.last.0.as_ref()) else { return };
        let _ = seen.wait_for(|node| node.as_ref().is_some_and(|n| n.metadata == *last)).await;
    }

    /// Publishes `cards`; returns whether a write was needed.
    pub async fn publish(&mut self, cards: &[Card]) -> Result<bool, kube::Error> {
        let seen = self.seen.as_ref().and_then(|rx| rx.borrow().clone());
        let (seen_metadata, seen_status) = seen.map_or((None, None), |c| (Some(c.metadata), Some(c.status)));
        let mut wrote = false;
        let patch = node_patch(cards, self.memory_limit);
        if seen_metadata.as_ref().or(self.last.0.as_ref()) != Some(&patch) {
            self.api.patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            self.last.0 = Some(patch);
            wrote = true;
        }
        if let Some(resource) = self.gpushare {
            let patch = gpushare_status_patch(cards, resource);
            if seen_status.as_ref().or(self.last.1.as_ref()) != Some(&patch) {
                self.api.patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                self.last.1 = Some(patch);
                wrote = true;
            }
        }
        Ok(wrote)
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
        let p = node_patch(&[], None);
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
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap();
        seen_tx.send_replace(Some(Carried { metadata: node_patch(&cards, None), ..Carried::of(&bare) }));
        assert!(!publisher.publish(&cards).await.unwrap());
        // Someone removed the annotation: written again.
        seen_tx.send_replace(Some(Carried::of(&bare)));
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!((req.method().as_str(), req.uri().path()), ("PATCH", "/api/v1/nodes/n1"));
            let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}});
            send.send_response(Response::new(Body::from(serde_json::to_vec(&node).unwrap())));
        });
        assert!(publisher.publish(&cards).await.unwrap());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn with_gpushare_the_status_carries_gpushare_s_card_count_and_gets_it_back_after_a_reset() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let (seen_tx, seen) = watch::channel(None);
        let gib = Resource::Gpushare(nano_gpu_proto::demand::GpushareUnit::GiB);
        let mut publisher = Publisher::new(kube::Client::new(svc, "default"), "n1".into())
            .with_gpushare(Some(gib))
            .watching(seen);
        // Two cards serve gpushare memory; one of under 1 GiB serves none and is not counted.
        let cards = [card("GPU-a"), card("GPU-b"), Card::nvidia(2, "GPU-c", "tiny", MiB(512), None)];
        let node = |count: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": "n1"}, "status": {
                "capacity": {"aliyun.com/gpu-count": count}, "allocatable": {"aliyun.com/gpu-count": count}}}))
            .unwrap()
        };
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!((req.method().as_str(), req.uri().path()), ("PATCH", "/api/v1/nodes/n1/status"));
            assert_eq!(req.headers()["content-type"], "application/merge-patch+json");
            let body: Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
            assert_eq!(
                body,
                json!({"status": {"capacity": {"aliyun.com/gpu-count": "2"}, "allocatable": {"aliyun.com/gpu-count": "2"}}})
            );
            let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}});
            send.send_response(Response::new(Body::from(serde_json::to_vec(&node).unwrap())));
        });
        // The Node carries our metadata and a count the kubelet reset to 0: only the status is written.
        seen_tx.send_replace(Some(Carried { metadata: node_patch(&cards, None), ..Carried::of(&node("0")) }));
        assert!(publisher.publish(&cards).await.unwrap());
        server.await.unwrap();
        // Once the watch shows it, nothing more to write.
        seen_tx.send_replace(Some(Carried { metadata: node_patch(&cards, None), ..Carried::of(&node("2")) }));
        assert!(!publisher.publish(&cards).await.unwrap());
    }
}
