//! The kubelet device plugin for `nano-gpu/gpu-percent`: every card advertises 100 virtual device IDs
//! `<uuid>-NN`, and `Allocate` derives the card(s) from the IDs the kubelet actually chose, so what a
//! container sees always matches the kubelet's own per-ID accounting.
//!
//! Handlers read a snapshot of the cards (no NVML or API call on the request path). This slice serves
//! options, ListAndWatch, a card-packing GetPreferredAllocation, Allocate and PreStartContainer over a
//! unix socket, and registers with the kubelet. Not yet: steering by the pod's assignment and the
//! verify-and-repair step (they need the pod watch and pod-resources).

use crate::inventory::Card;
use futures::Stream;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use nano_gpu_proto::kubelet::deviceplugin::registration_client::RegistrationClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty,
    ListAndWatchResponse, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest, TopologyInfo,
};
use nano_gpu_proto::kubelet::{HEALTHY, UNHEALTHY, VERSION};
use nano_gpu_proto::resources::GPU_PERCENT;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// The cards as the handlers see them.
pub type Snapshot = Arc<Vec<Card>>;

/// The 100 virtual device IDs of every card, with health and NUMA node.
pub fn devices(cards: &[Card]) -> Vec<Device> {
    cards
        .iter()
        .flat_map(|c| {
            let topology = c.info.numa.map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] });
            let health = if c.info.healthy { HEALTHY } else { UNHEALTHY };
            (0..device_id::IDS_PER_CARD).map(move |n| Device {
                id: device_id::encode(&c.info.uuid, n),
                health: health.to_owned(),
                topology: topology.clone(),
            })
        })
        .collect()
}

/// How containers are given their cards beyond the environment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    /// Also name NVIDIA cards as CDI devices (`nvidia.com/gpu=<uuid>`), for runtimes set up with CDI.
    pub cdi: bool,
}

/// What one container gets for the device IDs the kubelet chose.
pub fn allocate(cards: &[Card], ids: &[String], edits: Edits) -> Result<ContainerAllocateResponse, Status> {
    let mut per_card: BTreeMap<&str, u32> = BTreeMap::new();
    for id in ids {
        let (uuid, _) = device_id::decode(id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        *per_card.entry(uuid).or_default() += 1;
    }
    let mut response = ContainerAllocateResponse::default();
    let mut nvidia = Vec::new();
    let mut uuids = Vec::new();
    for uuid in per_card.keys() {
        let card = cards
            .iter()
            .find(|c| c.info.uuid == *uuid)
            .ok_or_else(|| Status::invalid_argument(format!("device IDs of unknown card {uuid}")))?;
        uuids.push(card.info.uuid.clone());
        match card.info.vendor {
            Vendor::Nvidia => nvidia.push(card.info.uuid.clone()),
            Vendor::Intel => response.devices.extend(card.device_nodes.iter().map(|p| DeviceSpec {
                container_path: p.display().to_string(),
                host_path: p.display().to_string(),
                permissions: "rw".into(),
            })),
        }
    }
    if uuids.is_empty() {
        return Err(Status::invalid_argument("no device IDs"));
    }
    if !nvidia.is_empty() {
        if edits.cdi {
            response.cdi_devices =
                nvidia.iter().map(|u| CdiDevice { name: format!("nvidia.com/gpu={u}") }).collect();
        }
        response.envs.insert("NVIDIA_VISIBLE_DEVICES".into(), nvidia.join(","));
    }
    let percent: u32 = per_card.values().sum();
    response.envs.insert("NANO_GPU_PERCENT".into(), percent.to_string());
    response.envs.insert("NANO_GPU_CARDS".into(), uuids.join(","));
    Ok(response)
}

/// Picks `size` IDs among `available` (keeping `must`) from as few cards as possible, fullest cards
/// first, so a share lands on one card whenever one card can hold it.
pub fn prefer(available: &[String], must: &[String], size: usize) -> Vec<String> {
    let mut chosen: Vec<String> = must.to_vec();
    let mut by_card: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in available.iter().filter(|id| !must.contains(id)) {
        if let Ok((uuid, _)) = device_id::decode(id) {
            by_card.entry(uuid.to_owned()).or_default().push(id.clone());
        }
    }
    // Cards with the fewest free IDs that still hold the rest whole come first; then the largest.
    let need = size.saturating_sub(chosen.len());
    let mut cards: Vec<Vec<String>> = by_card.into_values().collect();
    cards.sort_by_key(|ids| {
        (ids.len() < need, if ids.len() >= need { ids.len() } else { usize::MAX - ids.len() })
    });
    for ids in cards {
        if chosen.len() >= size {
            break;
        }
        let take = size - chosen.len();
        chosen.extend(ids.into_iter().take(take));
    }
    chosen
}

/// The gRPC service.
pub struct Plugin {
    cards: watch::Receiver<Snapshot>,
    edits: Edits,
}

impl Plugin {
    /// Serving the cards `cards` carries (updated by the inventory loop).
    pub fn new(cards: watch::Receiver<Snapshot>, edits: Edits) -> Self {
        Plugin { cards, edits }
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    type ListAndWatchStream = DeviceStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        }))
    }

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.cards.clone();
        let stream = async_stream(move |tx| async move {
            loop {
                let snapshot = rx.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: devices(&snapshot) })).await.is_err() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|r| ContainerPreferredAllocationResponse {
                device_i_ds: prefer(
                    &r.available_device_i_ds,
                    &r.must_include_device_i_ds,
                    r.allocation_size.max(0) as usize,
                ),
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let cards = self.cards.borrow().clone();
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|r| allocate(&cards, &r.devices_ids, self.edits))
            .collect::<Result<_, _>>()?;
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A stream fed by a task through a channel.
fn async_stream<F, Fut>(body: F) -> DeviceStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<ListAndWatchResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(body(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Serves the plugin on `socket` (a stale file is removed first) until `shutdown` resolves.
pub async fn serve(
    socket: &Path,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let _ = std::fs::remove_file(socket);
    let listener = tokio::net::UnixListener::bind(socket)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    Server::builder()
        .add_service(DevicePluginServer::new(plugin))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// A gRPC channel over a unix socket.
pub async fn connect(socket: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

/// Registers `endpoint` (a socket file name in the kubelet's directory) for `nano-gpu/gpu-percent`.
pub async fn register(kubelet_socket: PathBuf, endpoint: &str) -> Result<(), Status> {
    let channel = connect(kubelet_socket).await.map_err(|e| Status::unavailable(e.to_string()))?;
    let options = DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true };
    let request = RegisterRequest {
        version: VERSION.into(),
        endpoint: endpoint.into(),
        resource_name: GPU_PERCENT.into(),
        options: Some(options),
    };
    RegistrationClient::new(channel).register(request).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::annotations::GpuInfo;
    use nano_gpu_proto::units::MiB;

    fn card(uuid: &str, vendor: Vendor) -> Card {
        Card {
            info: GpuInfo {
                index: 0,
                uuid: uuid.into(),
                vendor,
                model: "m".into(),
                memory_mib: MiB(1),
                healthy: true,
                numa: Some(1),
            },
            device_nodes: if vendor == Vendor::Intel {
                vec!["/dev/dri/card1".into(), "/dev/dri/renderD129".into()]
            } else {
                vec![]
            },
            pci_address: None,
        }
    }

    fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
        range.map(|n| device_id::encode(uuid, n)).collect()
    }

    #[test]
    fn every_card_advertises_100_ids_with_its_numa_node() {
        let d = devices(&[card("GPU-a", Vendor::Nvidia), card("GPU-b", Vendor::Nvidia)]);
        assert_eq!(d.len(), 200);
        assert_eq!(d[0].id, "GPU-a-00");
        assert_eq!(d[199].id, "GPU-b-99");
        assert_eq!(d[0].topology.as_ref().unwrap().nodes[0].id, 1);
    }

    #[test]
    fn allocate_derives_the_cards_from_the_ids() {
        let cards = [card("GPU-a", Vendor::Nvidia), card("intel-0000:03:00.0", Vendor::Intel)];
        let r = allocate(&cards, &ids("GPU-a", 0..30), Edits::default()).unwrap();
        assert!(r.cdi_devices.is_empty());
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(r.envs["NANO_GPU_PERCENT"], "30");
        let r = allocate(&cards, &ids("intel-0000:03:00.0", 0..50), Edits { cdi: true }).unwrap();
        assert!(!r.envs.contains_key("NVIDIA_VISIBLE_DEVICES") && r.cdi_devices.is_empty());
        assert_eq!(
            r.devices.iter().map(|d| d.host_path.as_str()).collect::<Vec<_>>(),
            ["/dev/dri/card1", "/dev/dri/renderD129"]
        );
        let r = allocate(&cards, &ids("GPU-a", 0..100), Edits { cdi: true }).unwrap();
        assert_eq!(r.cdi_devices[0].name, "nvidia.com/gpu=GPU-a");
    }

    #[test]
    fn unknown_ids_are_invalid_arguments_not_a_poisoned_env() {
        let cards = [card("GPU-a", Vendor::Nvidia)];
        assert_eq!(
            allocate(&cards, &["not-ours".into()], Edits::default()).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            allocate(&cards, &ids("GPU-zz", 0..1), Edits::default()).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(allocate(&cards, &[], Edits::default()).unwrap_err().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn preferred_ids_come_from_one_card_when_one_can_hold_them() {
        let mut available = ids("GPU-a", 0..40);
        available.extend(ids("GPU-b", 0..100));
        let chosen = prefer(&available, &[], 30);
        assert_eq!(chosen.len(), 30);
        // The tightest card that holds all 30 (GPU-a, 40 free) rather than spreading.
        assert!(chosen.iter().all(|id| id.starts_with("GPU-a-")), "{chosen:?}");
        let chosen = prefer(&available, &[], 60);
        assert!(chosen.iter().all(|id| id.starts_with("GPU-b-")), "{chosen:?}");
        let chosen = prefer(&available, &ids("GPU-b", 0..1), 2);
        assert_eq!(chosen[0], "GPU-b-00");
    }
}
