//! The API calls of a bind, behind a narrow port: read the pod, write its assignment annotation with a
//! resourceVersion precondition, create the `pods/binding` subresource. [`KubeBinder`] is the real
//! one; tests use the same code against a fake API server (tower-test).

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
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
    /// Anything else.
    #[error("{0}")]
    Other(String),
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

    /// Sets (or, with `None`, removes) the assignment annotation, only if the pod still has
    /// `resource_version` (when given) and `uid`.
    fn annotate(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
        value: Option<&str>,
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

/// The merge patch that sets or removes the annotation, with the uid (and resourceVersion) as
/// preconditions: the API server refuses it with 409 if either changed.
pub fn annotation_patch(uid: &str, resource_version: Option<&str>, value: Option<&str>) -> serde_json::Value {
    let mut meta = serde_json::json!({
        "uid": uid,
        "annotations": { ASSIGNMENT_ANNOTATION: value },
    });
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
        Ok(self.pods(ns).get(name).await?)
    }

    async fn annotate(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
        value: Option<&str>,
    ) -> Result<(), ApiError> {
        let patch = annotation_patch(uid, resource_version, value);
        self.pods(ns).patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    async fn bind(&self, ns: &str, name: &str, uid: &str, node: &str) -> Result<(), ApiError> {
        let body = binding(ns, name, uid, node);
        let _: serde_json::Value =
            self.pods(ns).create_subresource("binding", name, &PostParams::default(), &body).await?;
        Ok(())
    }
}
