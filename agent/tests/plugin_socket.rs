//! The device plugin against a fake kubelet over real unix sockets in a temp dir: registration, then
//! the kubelet's calls on the plugin's socket.

use futures::StreamExt;
use nano_gpu_agent::inventory::Card;
use nano_gpu_agent::plugin::{self, Plugin, Snapshot};
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::registration_server::{Registration, RegistrationServer};
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest,
};
use nano_gpu_proto::units::MiB;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};

/// The kubelet's Registration service: hands every request to the test.
struct FakeKubelet(mpsc::Sender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for FakeKubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        self.0.send(request.into_inner()).await.map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(Empty {}))
    }
}

fn card(uuid: &str) -> Card {
    Card::nvidia(0, uuid, "Tesla T4", MiB(15360), None)
}

#[tokio::test]
async fn the_plugin_registers_and_serves_the_kubelet_over_unix_sockets() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-plugin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // The kubelet's registration socket.
    let (registered, mut registrations) = mpsc::channel(1);
    let kubelet_socket = dir.join("kubelet.sock");
    let listener = tokio::net::UnixListener::bind(&kubelet_socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(FakeKubelet(registered)))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );

    // The plugin's socket, then registration.
    let (cards, rx) = watch::channel::<Snapshot>(Arc::new(vec![card("GPU-a")]));
    let plugin_socket = dir.join("nano-gpu.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn({
        let socket = plugin_socket.clone();
        async move {
            plugin::serve(&socket, Plugin::new(rx, Default::default(), None), async {
                stopped.await.unwrap_or(())
            })
            .await
            .map_err(|e| e.to_string())
        }
    });
    let mut client = loop {
        // Ready when a connection succeeds (never by testing that the file exists).
        if let Ok(channel) = plugin::connect(plugin_socket.clone()).await {
            break DevicePluginClient::new(channel);
        }
        tokio::task::yield_now().await;
    };
    plugin::register(kubelet_socket.clone(), "nano-gpu.sock").await.unwrap();
    let r = registrations.recv().await.unwrap();
    assert_eq!(
        (r.version.as_str(), r.endpoint.as_str(), r.resource_name.as_str()),
        ("v1beta1", "nano-gpu.sock", "nano-gpu/gpu-percent")
    );
    assert!(r.options.unwrap().pre_start_required);

    // ListAndWatch: the full list at once, and again on every change.
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(stream.next().await.unwrap().unwrap().devices.len(), 100);
    cards.send(Arc::new(vec![card("GPU-a"), card("GPU-b")])).unwrap();
    let second = stream.next().await.unwrap().unwrap().devices;
    assert_eq!(second.len(), 200);
    assert_eq!(second[100].id, "GPU-b-00");

    // Allocate: the card comes from the IDs.
    let ids: Vec<String> = (0..40).map(|n| format!("GPU-b-{n:02}")).collect();
    let req = AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] };
    let resp = client.allocate(req).await.unwrap().into_inner();
    assert_eq!(resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
    assert_eq!(resp.container_responses[0].envs["NANO_GPU_PERCENT"], "40");
    let bad = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: vec!["GPU-x-01".into()] }],
    };
    assert_eq!(client.allocate(bad).await.unwrap_err().code(), tonic::Code::InvalidArgument);

    // Graceful shutdown waits for open connections: the kubelet side goes first.
    drop(stream);
    drop(client);
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn registration_with_no_kubelet_is_an_error_not_a_hang() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-plugin-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = plugin::register(dir.join("kubelet.sock"), "nano-gpu.sock").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    std::fs::remove_dir_all(&dir).unwrap();
}
