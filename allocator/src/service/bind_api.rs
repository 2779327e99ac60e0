//! The API calls of a bind, behind a narrow port: read the pod, and create its `pods/binding`
//! subresource carrying the assignment. kube-apiserver copies a Binding's annotations onto the pod in
//! the same write that sets `spec.nodeName`, with the Binding's uid as a precondition
//! (`BindingREST.setPodNodeAndMetadata`): a pod is never bound without its assignment, nor annotated
//! without being bound. [`KubeBinder`] is the real one; tests use the same code against a fake API
//! server (tower-test).

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use std::collections::BTreeMap;
use std::future::Future;
use thiserror::Error;

/// A failed API call.
#[derive(Debug, Error)]
pub enum ApiError {
    /// The object changed since it was read (HTTP 409 on a precondition).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The pod is gone.
    #[error("not found: {0}")]
    NotFound(String),
    /// The API server did not answer in time: the call may or may not have taken effect.
    #[error("the API server did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The API server answered with another error: the call took no effect.
    #[error("{0}")]
    Refused(String),
    /// No answer came (the connection failed), or a server error (5xx) that does not say: the call
    /// may or may not have taken effect.
    #[error("{0}")]
    Unanswered(String),
}

impl ApiError {
    /// Whether the API server's answer says the call took no effect (a lost answer leaves it open).
    pub fn answered(&self) -> bool {
        !matches!(self, ApiError::Timeout(_) | ApiError::Unanswered(_))
    }
}

/// How long one API call of a bind may take: kube-scheduler's extender call waits for the whole bind,
/// and a hung call must not hold the pod's reservation (or the handler) indefinitely.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `call`, or [`ApiError::Timeout`] after [`CALL_TIMEOUT`].
async fn in_time<T>(call: impl Future<Output = Result<T, kube::Error>>) -> Result<T, ApiError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ApiError::Timeout(CALL_TIMEOUT)),
    }
}

impl From<kube::Error> for ApiError {
    fn from(e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(s) if s.code == 409 => ApiError::Conflict(s.message.clone()),
            kube::Error::Api(s) if s.code == 404 => ApiError::NotFound(s.message.clone()),
            // A server error does not say the write was not made (etcd may have taken it).
            kube::Error::Api(s) if s.code >= 500 => ApiError::Unanswered(s.message.clone()),
            kube::Error::Api(s) => ApiError::Refused(s.message.clone()),
            _ => ApiError::Unanswered(e.to_string()),
        }
    }
}

/// The API calls of a bind.
pub trait Binder: Send + Sync + 'static {
    /// Reads a pod.
    fn get_pod(&self, ns: &str, name: &str) -> impl Future<Output = Result<Pod, ApiError>> + Send;

    /// Binds the pod to the node and sets `annotations` on it in the same write, only if the pod still
    /// has `uid` and is bound to no node.
    fn bind(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
}

/// The real API server.
#[derive(Clone)]
pub struct KubeBinder {
    client: kube::Client,
}

impl KubeBinder {
    /// Over `client`.
    pub fn new(client: kube::Client) -> Self {
        KubeBinder { client }
    }

    fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), ns)
    }
}

/// The `pods/binding` body: the target node, the pod's uid as the precondition, and the annotations
/// the API server copies onto the pod.
pub fn binding(
    ns: &str,
    name: &str,
    uid: &str,
    node: &str,
    annotations: &BTreeMap<String, String>,
) -> Binding {
    Binding {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            uid: Some(uid.to_owned()),
            annotations: (!annotations.is_empty()).then(|| annotations.clone()),
            ..Default::default()
        },
        target: ObjectReference {
            kind: Some("Node".into()),
            name: Some(node.to_owned()),
            ..Default::default()
        },
    }
}

impl Binder for KubeBinder {
    async fn get_pod(&self, ns: &str, name: &str) -> Result<Pod, ApiError> {
        in_time(self.pods(ns).get(name)).await
    }

    async fn bind(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        let body = binding(ns, name, uid, node, annotations);
        let pods = self.pods(ns);
        let _: serde_json::Value =
            in_time(pods.create_subresource("binding", name, &PostParams::default(), &body)).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The exact requests the real binder sends, against a fake API server (tower-test).
    use super::*;
    use crate::api_replies::{body_json, respond};
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::{Value, json};

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn client() -> (KubeBinder, Handle) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (KubeBinder::new(kube::Client::new(svc, "default")), handle)
    }

    async fn body(req: Request<Body>) -> (String, String, Option<String>, Value) {
        let method = req.method().to_string();
        let path = req.uri().path().to_owned();
        let ctype = req.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
        (method, path, ctype, body_json(req).await)
    }

    #[tokio::test]
    async fn bind_posts_one_binding_that_carries_the_assignment_and_the_uid_precondition() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            let (method, path, _, body) = body(req).await;
            assert_eq!((method.as_str(), path.as_str()), ("POST", "/api/v1/namespaces/ns/pods/p/binding"));
            assert_eq!(
                body,
                json!({"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                    "annotations": {"nano-gpu/assignment": "{\"v\":1}"}},
                "target": {"kind": "Node", "name": "n1"}})
            );
            send.send_response(respond(
                201,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
            ));
        });
        let set = BTreeMap::from([("nano-gpu/assignment".to_string(), "{\"v\":1}".to_string())]);
        binder.bind("ns", "p", "u1", "n1", &set).await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn answers_are_told_apart_from_lost_ones() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            for code in [409, 404, 422, 500] {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(respond(
                    code,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "the object has been modified", "reason": "Conflict", "code": code}),
                ));
            }
        });
        let none = BTreeMap::new();
        let e = binder.bind("ns", "p", "u1", "n1", &none).await.unwrap_err();
        assert!(matches!(e, ApiError::Conflict(ref m) if m == "the object has been modified"), "{e:?}");
        let e = binder.get_pod("ns", "p").await.unwrap_err();
        assert!(matches!(e, ApiError::NotFound(_)), "{e:?}");
        let e = binder.bind("ns", "p", "u1", "n1", &none).await.unwrap_err();
        assert!(matches!(e, ApiError::Refused(_)) && e.answered(), "{e:?}");
        let e = binder.bind("ns", "p", "u1", "n1", &none).await.unwrap_err();
        assert!(!e.answered(), "a server error may hide a write that was made: {e:?}");
        server.await.unwrap();
        assert!(!ApiError::Timeout(CALL_TIMEOUT).answered());
        assert!(!ApiError::Unanswered("connection reset".into()).answered());
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_the_api_server_never_answers_ends_as_a_timeout() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (_request, _never_answered) = handle.next_request().await.unwrap();
            std::future::pending::<()>().await;
        });
        let started = tokio::time::Instant::now();
        let err = binder.bind("ns", "p", "u", "n1", &BTreeMap::new()).await.unwrap_err();
        assert!(matches!(err, ApiError::Timeout(_)), "{err}");
        assert_eq!(started.elapsed(), CALL_TIMEOUT);
        server.abort();
    }
}
