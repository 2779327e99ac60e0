//! The device plugin against a fake kubelet over real unix sockets in a temp dir: registration, then
//! the kubelet's calls on the plugin's socket.

use futures::StreamExt;
use nano_gpu_agent::cards::inventory::Card;
use nano_gpu_agent::cards::resource::Resource;
use nano_gpu_agent::kubelet::plugin::{self, Plugin, Snapshot};
use nano_gpu_proto::demand::GpushareUnit;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{AllocateRequest, ContainerAllocateRequest, Empty};
use nano_gpu_proto::units::MiB;
use nano_gpu_tests::fake_kubelet::FakeKubelet;
use std::sync::Arc;
use tokio::sync::watch;

fn card(uuid: &str) -> Card {
    Card::nvidia(0, uuid, "Tesla T4", MiB(15360), None)
}

#[tokio::test]
async fn the_plugin_registers_and_serves_the_kubelet_over_unix_sockets() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-plugin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    let mut kubelet = FakeKubelet::start(&dir).unwrap();
    let kubelet_socket = kubelet.plugin_dir.join("kubelet.sock");

    // The plugin's socket, then registration.
    let (cards, rx) = watch::channel::<Snapshot>(Arc::new(vec![card("GPU-a")]));
    let plugin_socket = kubelet.plugin_dir.join("nano-gpu.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn({
        let socket = plugin_socket.clone();
        async move {
            plugin::serve(&socket, Plugin::new(rx, Resource::Percent, Default::default(), None), async {
                stopped.await.unwrap_or(())
            })
            .await
            .map_err(|e| e.to_string())
        }
    });
    let mut client = loop {
        // Ready when a connection succeeds (never by testing that the file exists).
        if let Ok(channel) = nano_gpu_runtime::unix_channel(plugin_socket.clone()).await {
            break DevicePluginClient::new(channel);
        }
        tokio::task::yield_now().await;
    };
    plugin::register(kubelet_socket.clone(), Resource::Percent, "nano-gpu.sock").await.unwrap();
    let r = kubelet.registrations.recv().await.unwrap();
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
    let e = plugin::register(dir.join("kubelet.sock"), Resource::Percent, "nano-gpu.sock").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn gpushare_memory_is_served_as_one_id_per_gib_with_gpushares_environment() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-plugin-gpushare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut kubelet = FakeKubelet::start(&dir).unwrap();
    let gib = Resource::Gpushare(GpushareUnit::GiB);
    let (_cards, rx) = watch::channel::<Snapshot>(Arc::new(vec![card("GPU-a")]));
    let socket = kubelet.plugin_dir.join(gib.socket(""));
    tokio::spawn({
        let socket = socket.clone();
        async move {
            plugin::serve(&socket, Plugin::new(rx, gib, Default::default(), None), std::future::pending())
                .await
        }
    });
    let mut client = loop {
        if let Ok(channel) = nano_gpu_runtime::unix_channel(socket.clone()).await {
            break DevicePluginClient::new(channel);
        }
        tokio::task::yield_now().await;
    };
    plugin::register(kubelet.plugin_dir.join("kubelet.sock"), gib, &gib.socket("")).await.unwrap();
    let r = kubelet.registrations.recv().await.unwrap();
    assert_eq!(
        (r.endpoint.as_str(), r.resource_name.as_str()),
        ("nano-gpu-gpushare.sock", "aliyun.com/gpu-mem")
    );
    // A 15 GiB card: 15 IDs.
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let devices = stream.next().await.unwrap().unwrap().devices;
    assert_eq!(devices.len(), 15);
    let ids: Vec<String> = devices.iter().take(3).map(|d| d.id.clone()).collect();
    let req = AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] };
    let env = client.allocate(req).await.unwrap().into_inner().container_responses[0].envs.clone();
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    assert_eq!(env["ALIYUN_COM_GPU_MEM_IDX"], "0");
    assert_eq!(env["ALIYUN_COM_GPU_MEM_CONTAINER"], "3");
    assert_eq!(env["ALIYUN_COM_GPU_MEM_DEV"], "15");
    assert_eq!(env["NANO_GPU_MEMORY_MIB"], "3072");
    assert!(!env.contains_key("NANO_GPU_PERCENT"));
    let _ = std::fs::remove_dir_all(&dir);
}
