//! The kubelet's pod-resources API as the agent reads it: `List` (what the kubelet has allocated, pod
//! by pod) over its unix socket, with a timeout, and waiting out the kubelet's rate limit. [`Lister`]
//! is the port; handler tests answer it in memory.

use nano_gpu_proto::kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use nano_gpu_proto::kubelet::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse,
};
use std::path::PathBuf;
use std::time::Duration;
use tonic::Status;
use tonic::transport::Channel;

/// How long one pod-resources call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Reads the kubelet's pod-resources `List` (a trait so handler tests can answer in memory).
#[tonic::async_trait]
pub trait Lister: Send + Sync + 'static {
    /// What the kubelet has allocated, pod by pod.
    async fn list(&self) -> Result<ListPodResourcesResponse, Status>;
}

/// The kubelet's pod-resources socket; connects on first use and again after an error.
pub struct PodResourcesSocket {
    path: PathBuf,
    client: tokio::sync::Mutex<Option<PodResourcesListerClient<Channel>>>,
}

impl PodResourcesSocket {
    /// The socket at `path` (`/var/lib/kubelet/pod-resources/kubelet.sock`).
    pub fn new(path: PathBuf) -> Self {
        PodResourcesSocket { path, client: tokio::sync::Mutex::new(None) }
    }
}

impl PodResourcesSocket {
    /// `GetAllocatableResources`: every device of every device plugin registered with the kubelet
    /// (not only nano-gpu's), as [`crate::kubelet::coexist`] reads it.
    pub async fn allocatable(&self) -> Result<AllocatableResourcesResponse, Status> {
        self.call(|mut c| async move { c.get_allocatable_resources(AllocatableResourcesRequest {}).await })
            .await
    }

    /// One call on the (cached) connection, within [`CALL_TIMEOUT`], asked again while the kubelet's
    /// rate limit answers; the connection is kept only after an answer.
    async fn call<T, F, Fut>(&self, call: F) -> Result<T, Status>
    where
        F: Fn(PodResourcesListerClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut slot = self.client.lock().await;
        let client = match slot.take() {
            Some(c) => c,
            None => PodResourcesListerClient::new(
                nano_gpu_runtime::unix_channel(self.path.clone()).await.map_err(|e| {
                    Status::unavailable(format!("pod-resources socket {}: {e}", self.path.display()))
                })?,
            ),
        };
        // The kubelet rate-limits pod-resources (100 calls/s, bursts of 10); a burst of admissions can
        // reach that, and identifying by the pod watch alone is a guess: wait and ask again.
        let mut pause = Duration::from_millis(10);
        let answer = loop {
            let answered = tokio::time::timeout(CALL_TIMEOUT, call(client.clone()))
                .await
                .map_err(|_| Status::deadline_exceeded("a pod-resources call took too long"))?;
            match answered {
                Err(s) if rate_limited(&s) && pause < Duration::from_secs(1) => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                other => break other?,
            }
        };
        *slot = Some(client);
        Ok(answer.into_inner())
    }
}

#[tonic::async_trait]
impl Lister for PodResourcesSocket {
    async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
        self.call(|mut c| async move { c.list(ListPodResourcesRequest {}).await }).await
    }
}

/// The kubelet's answer when pod-resources is called too often.
fn rate_limited(s: &Status) -> bool {
    s.code() == tonic::Code::ResourceExhausted || s.message().contains("rate limit")
}
