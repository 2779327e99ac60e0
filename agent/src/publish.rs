//! Publishes the node's cards on its Node object: the `nano-gpu/gpus` annotation and the
//! `nano-gpu/gpu.*` labels, with one merge patch, only when they change.

use crate::inventory::Card;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use nano_gpu_proto::annotations::{
    COUNT_LABEL, GPUS_ANNOTATION, MODEL_LABEL, NodeInventory, VENDOR_LABEL, node_labels,
};
use serde_json::{Value, json};

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

/// Writes the patch to one Node when it differs from the last one written.
pub struct Publisher {
    api: Api<Node>,
    node: String,
    last: Option<Value>,
}

impl Publisher {
    /// For the Node `node`.
    pub fn new(client: kube::Client, node: String) -> Self {
        Publisher { api: Api::all(client), node, last: None }
    }

    /// Publishes `cards`; returns whether a write was needed.
    pub async fn publish(&mut self, cards: &[Card]) -> Result<bool, kube::Error> {
        let patch = node_patch(cards);
        if self.last.as_ref() == Some(&patch) {
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
}
