//! A stand-in for another device plugin on a simulated node, as the kubelet sees it, in one of two
//! forms (`--as`):
//!
//! - `gpushare` (gpushare's `gpushare-device-plugin`), for the end-to-end test of the move from
//!   gpushare: a node can run pods "the gpushare way" before the nano-gpu agent replaces it. It
//!   registers `aliyun.com/gpu-mem` from the socket gpushare used (`aliyungpushare.sock`), advertises
//!   one ID per GiB of each card in gpushare's form (`<card uuid>-_-<n>`), and allocates whatever the
//!   kubelet chose (gpushare's plugin took its card from the pod's `ALIYUN_COM_GPU_MEM_IDX`; the test
//!   writes that annotation as gpushare's extender did). It does not implement
//!   GetPreferredAllocation, as gpushare's plugin did not.
//! - `nvidia` (NVIDIA's device plugin with its default `deviceIDStrategy: uuid`): registers
//!   `nvidia.com/gpu` from `nvidia-gpu.sock`, one ID per card, its UUID, for the first `--cards K`
//!   cards (all without it: the split an operator gives NVIDIA's plugin, e.g. with its container's
//!   `NVIDIA_VISIBLE_DEVICES`).
//!
//! Usage: fake-device-plugin --as gpushare|nvidia --plugin-dir <kubelet device-plugin dir>
//! --nvml-config <nvml.json> [--cards K] (the simulated node's cards: `{"cards": [{"uuid": ..,
//! "memoryMiB": ..}, ..]}`). Runs until killed.

use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use nano_gpu_proto::kubelet::deviceplugin::registration_client::RegistrationClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions, Empty,
    ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, RegisterRequest,
};
use nano_gpu_proto::kubelet::{HEALTHY, KUBELET_SOCKET, VERSION};
use nano_gpu_proto::resources::GPUSHARE_MEMORY;
use std::path::PathBuf;
use std::pin::Pin;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

struct Plugin {
    ids: Vec<String>,
    gpushare: bool,
}

type Devices = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = Devices;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Devices>, Status> {
        let devices = self
            .ids
            .iter()
            .map(|id| Device { id: id.clone(), health: HEALTHY.into(), topology: None })
            .collect();
        eprintln!("fake-device-plugin: the kubelet watches {} device IDs", self.ids.len());
        let first = tokio_stream::once(Ok(ListAndWatchResponse { devices }));
        // The stream stays open (the kubelet treats its end as the plugin gone).
        let rest = tokio_stream::pending();
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::chain(first, rest))))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("this stand-in has no preferred allocation"))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| {
                let env = if self.gpushare {
                    ("ALIYUN_COM_GPU_MEM_CONTAINER".to_owned(), c.devices_ids.len().to_string())
                } else {
                    ("NVIDIA_VISIBLE_DEVICES".to_owned(), c.devices_ids.join(","))
                };
                ContainerAllocateResponse { envs: [env].into(), ..Default::default() }
            })
            .collect();
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

fn arg(name: &str) -> anyhow::Result<String> {
    nano_gpu_tests::flag_value(name).ok_or_else(|| anyhow::anyhow!("{name} <value> is required"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(arg("--plugin-dir")?);
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(arg("--nvml-config")?)?)?;
    let form = arg("--as")?;
    let (resource, socket, gpushare) = match form.as_str() {
        "gpushare" => (GPUSHARE_MEMORY, "aliyungpushare.sock", true),
        "nvidia" => ("nvidia.com/gpu", "nvidia-gpu.sock", false),
        other => anyhow::bail!("--as {other}: gpushare or nvidia"),
    };
    let cards: Vec<&serde_json::Value> = config["cards"].as_array().into_iter().flatten().collect();
    let count = match nano_gpu_tests::flag_value("--cards") {
        Some(k) => k.parse()?,
        None => cards.len(),
    };
    let mut ids = Vec::new();
    for card in cards.into_iter().take(count) {
        let uuid = card["uuid"].as_str().ok_or_else(|| anyhow::anyhow!("a card without uuid"))?;
        if gpushare {
            let gib = card["memoryMiB"].as_u64().unwrap_or(0) / 1024;
            ids.extend((0..gib).map(|n| format!("{uuid}-_-{n}")));
        } else {
            ids.push(uuid.to_owned());
        }
    }
    let path = dir.join(socket);
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(Plugin { ids, gpushare }))
            .serve_with_incoming(incoming),
    );
    let channel = nano_gpu_runtime::unix_channel(dir.join(KUBELET_SOCKET)).await?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.into(),
            endpoint: socket.into(),
            resource_name: resource.into(),
            options: Some(DevicePluginOptions::default()),
        })
        .await?;
    eprintln!("fake-device-plugin: registered {resource} from {}", path.display());
    server.await??;
    Ok(())
}
