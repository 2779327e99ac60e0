//! The API calls of a bind, behind a narrow port: read the pod, write its assignment annotation with a
//! resourceVersion precondition, create the `pods/binding` subresource. [`KubeBinder`] is the real
//! one; tests use the same code against a fake API server (tower-test).

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
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
    /// The API server did not answer in time.
    #[error("the API server did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// Anything else.
    #[error("{0}")]
    Other(String),
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
            _ => ApiError::Other(e.to_string()),
        }
    }
}

/// The API calls of a bind.
pub trait Binder: Send + Sync + 'static {
    /// Reads a pod.
    fn get_pod(&self, ns: &str, name: &str) -> impl Future<Output = Result<Pod, ApiError>> + Send;

    /// Sets annotations (a `None` value removes one), only if the pod still has `uid` and, when
    /// given, `resource_version`.
    fn annotate(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;

    /// Binds the pod to the node.
    fn bind(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        node: &str,
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

/// The merge patch that sets or removes (`None`) annotations, with the uid (and resourceVersion) as
/// preconditions: the API server refuses it with 409 if either changed.
pub fn annotation_patch(
    uid: &str,
    resource_version: Option<&str>,
    annotations: &BTreeMap<String, Option<String>>,
) -> serde_json::Value {
    let mut meta = serde_json::json!({ "uid": uid, "annotations": annotations });
    if let Some(rv) = resource_version {
        meta["resourceVersion"] = rv.into();
    }
    serde_json::json!({ "metadata": meta })
}

/// The `pods/binding` body.
pub fn binding(ns: &str, name: &str, uid: &str, node: &str) -> Binding {
    Binding {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            uid: Some(uid.to_owned()),
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

    async fn annotate(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<(), ApiError> {
        let patch = annotation_patch(uid, resource_version, annotations);
        in_time(self.pods(ns).patch(name, &PatchParams::default(), &Patch::Merge(&patch))).await?;
        Ok(())
    }

    async fn bind(&self, ns: &str, name: &str, uid: &str, node: &str) -> Result<(), ApiError> {
        let body = binding(ns, name, uid, node);
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

    fn pod() -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}})
    }

    #[tokio::test]
    async fn annotate_sends_a_merge_patch_with_uid_and_resource_version_preconditions() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            let (method, path, ctype, body) = body(req).await;
            assert_eq!((method.as_str(), path.as_str()), ("PATCH", "/api/v1/namespaces/ns/pods/p"));
            assert_eq!(ctype.as_deref(), Some("application/merge-patch+json"));
            assert_eq!(
                body,
                json!({"metadata": {"uid": "u1", "resourceVersion": "42",
                "annotations": {"nano-gpu/assignment": "{\"v\":1}"}}})
            );
            send.send_response(respond(200, pod()));
        });
        let set = BTreeMap::from([("nano-gpu/assignment".to_string(), Some("{\"v\":1}".to_string()))]);
        binder.annotate("ns", "p", "u1", Some("42"), &set).await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn removing_the_annotation_patches_it_to_null() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            let (_, _, _, body) = body(req).await;
            assert_eq!(
                body,
                json!({"metadata": {"uid": "u1", "annotations": {"nano-gpu/assignment": null}}})
            );
            send.send_response(respond(200, pod()));
        });
        binder
            .annotate("ns", "p", "u1", None, &BTreeMap::from([("nano-gpu/assignment".to_string(), None)]))
            .await
            .unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_409_is_a_conflict_and_a_404_is_not_found() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            for code in [409, 404] {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(respond(
                    code,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "the object has been modified", "reason": "Conflict", "code": code}),
                ));
            }
        });
        let set = BTreeMap::from([("nano-gpu/assignment".to_string(), Some("x".to_string()))]);
        let e = binder.annotate("ns", "p", "u1", Some("1"), &set).await.unwrap_err();
        assert!(matches!(e, ApiError::Conflict(ref m) if m == "the object has been modified"), "{e:?}");
        let e = binder.get_pod("ns", "p").await.unwrap_err();
        assert!(matches!(e, ApiError::NotFound(_)), "{e:?}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn bind_posts_the_binding_subresource() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            let (method, path, _, body) = body(req).await;
            assert_eq!((method.as_str(), path.as_str()), ("POST", "/api/v1/namespaces/ns/pods/p/binding"));
            assert_eq!(
                body,
                json!({"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "target": {"kind": "Node", "name": "n1"}})
            );
            send.send_response(respond(
                201,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
            ));
        });
        binder.bind("ns", "p", "u1", "n1").await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_the_api_server_never_answers_ends_as_a_timeout() {
        let (binder, mut handle) = client();
        let server = tokio::spawn(async move {
            let (_request, _never_answered) = handle.next_request().await.unwrap();
            std::future::pending::<()>().await;
        });
        let started = tokio::time::Instant::now();
        let err = binder.bind("ns", "p", "u", "n1").await.unwrap_err();
        assert!(matches!(err, ApiError::Timeout(_)), "{err}");
        assert_eq!(started.elapsed(), CALL_TIMEOUT);
        server.abort();
    }
}
