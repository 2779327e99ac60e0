//! The agent's pod-resources client against a kubelet that rate-limits it (the kubelet allows 100
//! calls a second in bursts of 10): the call waits and asks again instead of failing.

use nano_gpu_agent::plugin::{Lister, PodResourcesSocket};
use nano_gpu_proto::kubelet::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use nano_gpu_proto::kubelet::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, GetPodResourcesRequest,
    GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use tonic::{Request, Response, Status};

/// Refuses the first `limited` calls as the kubelet's rate limiter does.
struct Limited {
    limited: AtomicU32,
    calls: Arc<AtomicU32>,
}

#[tonic::async_trait]
impl PodResourcesLister for Limited {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.limited.load(Ordering::SeqCst) > 0 {
            self.limited.fetch_sub(1, Ordering::SeqCst);
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        let pod = PodResources { name: "p".into(), namespace: "ns".into(), containers: vec![] };
        Ok(Response::new(ListPodResourcesResponse { pod_resources: vec![pod] }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }
}

#[tokio::test]
async fn a_rate_limited_list_is_asked_again_not_given_up() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-podresources-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("kubelet.sock");
    let calls = Arc::new(AtomicU32::new(0));
    let server = Limited { limited: AtomicU32::new(3), calls: calls.clone() };
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(server))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let lister = PodResourcesSocket::new(socket);
    let answer = lister.list().await.expect("the list after the limiter let it through");
    assert_eq!(answer.pod_resources[0].name, "p");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
