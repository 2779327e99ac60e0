//! The kubelet device plugin for `nano-gpu/gpu-percent`: every card advertises 100 virtual device IDs
//! `<uuid>-NN`, and `Allocate` derives the card(s) from the IDs the kubelet actually chose, so what a
//! container sees always matches the kubelet's own per-ID accounting.
//!
//! Handlers read snapshots of the cards and of the pods on the node (no NVML or API call on the request
//! path). With an [`Identity`], GetPreferredAllocation steers the kubelet to the cards the pod's
//! assignment names, Allocate refuses IDs no placed pod can own, and PreStartContainer queues a check
//! of the assignment against what the kubelet really allocated (`repair`).

use crate::inventory::Card;
use crate::pods::{Pending, Pods, Served, identify, pending, steer};
use crate::resource::Resource;
use futures::Stream;
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::device_id;
use nano_gpu_proto::gpushare;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use nano_gpu_proto::kubelet::deviceplugin::registration_client::RegistrationClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty,
    ListAndWatchResponse, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest, TopologyInfo,
};
use nano_gpu_proto::kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use nano_gpu_proto::kubelet::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use nano_gpu_proto::kubelet::{HEALTHY, UNHEALTHY, VERSION};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::sync::watch;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// The cards as the handlers see them.
pub type Snapshot = Arc<Vec<Card>>;

/// The device IDs of every card for `resource`, with health and NUMA node.
pub fn devices(cards: &[Card], resource: Resource) -> Vec<Device> {
    cards
        .iter()
        .flat_map(|c| {
            let topology = c.info.numa.map(|n| TopologyInfo { nodes: vec![NumaNode { id: i64::from(n) }] });
            let health = if c.info.healthy { HEALTHY } else { UNHEALTHY };
            resource.ids(c).into_iter().map(move |id| Device {
                id,
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

/// The cards a container got, with how many of its IDs are on each, from the IDs the kubelet chose.
pub fn derive<'a>(cards: &'a [Card], ids: &[String]) -> Result<Vec<(&'a Card, u32)>, Status> {
    let mut per_card: BTreeMap<&str, u32> = BTreeMap::new();
    for id in ids {
        let uuid = device_id::card_of(id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        *per_card.entry(uuid).or_default() += 1;
    }
    if per_card.is_empty() {
        return Err(Status::invalid_argument("no device IDs"));
    }
    per_card
        .into_iter()
        .map(|(uuid, n)| {
            let card = cards
                .iter()
                .find(|c| c.info.uuid == uuid)
                .ok_or_else(|| Status::invalid_argument(format!("device IDs of unknown card {uuid}")))?;
            Ok((card, n))
        })
        .collect()
}

/// The container an Allocate is for, as far as the agent could tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Its grants in the pod's assignment.
    pub grants: Vec<CardGrant>,
    /// What its whole pod asks of the resource (gpushare's `ALIYUN_COM_GPU_MEM_POD`).
    pub pod_units: u64,
}

/// What one container gets for the device IDs of `resource` the kubelet chose: the cards come from
/// the IDs; the memory from its grants when it asked memory, else its share of the cards' memory.
pub fn allocate(
    cards: &[Card],
    ids: &[String],
    claimed: Option<&Claimed>,
    resource: Resource,
    edits: Edits,
) -> Result<ContainerAllocateResponse, Status> {
    let got = derive(cards, ids)?;
    let mut response = ContainerAllocateResponse::default();
    let mut nvidia = Vec::new();
    for (card, _) in &got {
        match card.info.vendor {
            Vendor::Nvidia => nvidia.push(card.info.uuid.clone()),
            Vendor::Intel => response.devices.extend(card.device_nodes.iter().map(|p| DeviceSpec {
                container_path: p.display().to_string(),
                host_path: p.display().to_string(),
                permissions: "rw".into(),
            })),
        }
    }
    if !nvidia.is_empty() {
        if edits.cdi {
            response.cdi_devices =
                nvidia.iter().map(|u| CdiDevice { name: format!("nvidia.com/gpu={u}") }).collect();
        }
        response.envs.insert("NVIDIA_VISIBLE_DEVICES".into(), nvidia.join(","));
    }
    let count: u32 = got.iter().map(|(_, n)| n).sum();
    let grants = claimed.map(|c| c.grants.as_slice());
    let asked_memory = grants.filter(|g| !g.is_empty() && g.iter().all(|g| g.memory_mib.is_some()));
    let memory: u64 = match (resource.memory_of(u64::from(count)), asked_memory) {
        (Some(m), _) => m.0,
        (None, Some(g)) => g.iter().filter_map(|g| g.memory_mib).map(|m| m.0).sum(),
        (None, None) => got.iter().map(|(c, n)| c.info.memory_mib.0 * u64::from(*n) / 100).sum(),
    };
    let uuids: Vec<&str> = got.iter().map(|(c, _)| c.info.uuid.as_str()).collect();
    let env = &mut response.envs;
    match resource {
        Resource::Percent => {
            env.insert("NANO_GPU_PERCENT".into(), count.to_string());
        }
        Resource::Gpushare(_) => {
            // What gpushare's device plugin set, for workloads and tools that read it.
            let (card, _) = got[0];
            env.insert(gpushare::IDX.into(), card.info.index.to_string());
            env.insert(gpushare::CONTAINER.into(), count.to_string());
            let pod = claimed.map_or(u64::from(count), |c| c.pod_units.max(u64::from(count)));
            env.insert(gpushare::POD.into(), pod.to_string());
            env.insert(gpushare::DEV.into(), resource.card_units(card).to_string());
        }
    }
    env.insert("NANO_GPU_MEMORY_MIB".into(), memory.to_string());
    env.insert("NANO_GPU_CARDS".into(), uuids.join(","));
    Ok(response)
}

/// Picks `size` IDs among `available` (keeping `must`) from as few cards as possible, fullest cards
/// first, so a share lands on one card whenever one card can hold it.
pub fn prefer(available: &[String], must: &[String], size: usize) -> Vec<String> {
    let mut chosen: Vec<String> = must.to_vec();
    let mut by_card: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in available.iter().filter(|id| !must.contains(id)) {
        if let Ok(uuid) = device_id::card_of(id) {
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

#[tonic::async_trait]
impl Lister for PodResourcesSocket {
    async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
        let mut slot = self.client.lock().await;
        let mut client = match slot.take() {
            Some(c) => c,
            None => PodResourcesListerClient::new(nano_gpu_runtime::unix_channel(self.path.clone()).await.map_err(|e| {
                Status::unavailable(format!("pod-resources socket {}: {e}", self.path.display()))
            })?),
        };
        // The kubelet rate-limits pod-resources (100 calls/s, bursts of 10); a burst of admissions can
        // reach that, and identifying by the pod watch alone is a guess: wait and ask again.
        let mut pause = Duration::from_millis(10);
        let answer = loop {
            let call = tokio::time::timeout(LIST_TIMEOUT, client.list(ListPodResourcesRequest {}))
                .await
                .map_err(|_| Status::deadline_exceeded("pod-resources List took too long"))?;
            match call {
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

/// The kubelet's answer when pod-resources is called too often.
fn rate_limited(s: &Status) -> bool {
    s.code() == tonic::Code::ResourceExhausted || s.message().contains("rate limit")
}

const LIST_TIMEOUT: Duration = Duration::from_secs(2);
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Steering decisions kept until their Allocate comes.
const STEERED_KEPT: usize = 256;

/// Something the background worker acts on (it may call the API server; handlers never do).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// An Allocate was refused: no pod placed here by nano-gpu could own the IDs.
    Refused {
        /// The pod (`namespace/name`) it was most likely for, if any.
        pod: Option<String>,
        /// Why.
        message: String,
    },
    /// A container is starting with these IDs: check its assignment says the same cards.
    Starting {
        /// The device IDs of the container.
        ids: Vec<String>,
        /// The cards at that time.
        cards: Snapshot,
        /// The resource of the IDs.
        resource: Resource,
    },
}

/// What tells containers apart: the pods on this node and the kubelet's pod-resources.
pub struct Identity {
    pods: watch::Receiver<Pods>,
    lister: Arc<dyn Lister>,
    reports: mpsc::Sender<Report>,
    node: String,
    resource: Resource,
    /// How long to wait for the pod watch to show a pod the kubelet already admits.
    wait: Duration,
    memo: std::sync::Mutex<Memo>,
}

/// Decisions between calls: which container a preferred set of IDs was for, and the containers this
/// agent has allocated (init containers do not show in pod-resources).
#[derive(Default)]
struct Memo {
    steered: VecDeque<(Vec<String>, (String, String))>,
    done: HashSet<(String, String)>,
}

fn sorted(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

impl Identity {
    /// Identity for `resource` from the pods of node `node` that ask it, the kubelet's
    /// pod-resources, reporting to `reports`.
    pub fn new(
        node: String,
        resource: Resource,
        pods: watch::Receiver<Pods>,
        lister: Arc<dyn Lister>,
        reports: mpsc::Sender<Report>,
        wait: Duration,
    ) -> Self {
        Identity { pods, lister, reports, node, resource, wait, memo: Default::default() }
    }

    /// The containers that may be asking `size` now, likeliest first; waits up to `wait` for the pod
    /// watch when none is known yet (the kubelet can see a pod before our watch does).
    async fn candidates(&self, size: u64) -> Vec<Pending> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let mut pods = self.pods.clone();
        loop {
            let served = match self.lister.list().await {
                Ok(list) => Served::from_list(&list, self.resource.name()),
                Err(e) => {
                    tracing::warn!(error = %e.message(), "pod-resources List failed; identifying by the pod watch alone");
                    Served::default()
                }
            };
            let snapshot = pods.borrow_and_update().clone();
            let found = {
                let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
                let uids: HashSet<&str> = snapshot.values().map(|p| p.uid.as_str()).collect();
                memo.done.retain(|(uid, _)| uids.contains(uid.as_str()));
                pending(&snapshot, &served, &memo.done, size)
            };
            if !found.is_empty() {
                return found;
            }
            match tokio::time::timeout_at(deadline, pods.changed()).await {
                Ok(Ok(())) => continue,
                _ => return found,
            }
        }
    }

    /// [`Identity::candidates`] without the agent's own record (pod-resources alone), no waiting.
    async fn candidates_unrecorded(&self, size: u64) -> Vec<Pending> {
        let served = match self.lister.list().await {
            Ok(list) => Served::from_list(&list, self.resource.name()),
            Err(_) => return Vec::new(),
        };
        let snapshot = self.pods.borrow().clone();
        pending(&snapshot, &served, &HashSet::new(), size)
    }

    /// GetPreferredAllocation for one container: IDs on the cards of the container most likely
    /// asking, else the card-packing choice.
    async fn prefer(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let candidates = self.candidates(size as u64).await;
        let first = candidates.first();
        let quota = |g: &CardGrant| self.resource.quota(g, size);
        let steered = first.and_then(|p| steer(p.grants.as_ref().ok()?, available, must, size, quota));
        let ids = steered.unwrap_or_else(|| prefer(available, must, size));
        if let Some(p) = first {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            if memo.steered.len() >= STEERED_KEPT {
                memo.steered.pop_front();
            }
            memo.steered.push_back((sorted(&ids), (p.uid.clone(), p.container.clone())));
        }
        ids
    }

    /// The grants of the container an Allocate of `ids` (on `cards`) is for; an error the kubelet
    /// reports (and an Event) when no pod placed here by nano-gpu can own them.
    async fn claim(&self, ids: &[String], cards: &BTreeSet<&str>) -> Result<Claimed, Status> {
        let mut candidates = self.candidates(ids.len() as u64).await;
        if candidates.is_empty() {
            // An earlier guess may have taken this container's place in the record of what the
            // agent allocated: ask again, trusting pod-resources alone.
            candidates = self.candidates_unrecorded(ids.len() as u64).await;
        }
        let key = sorted(ids);
        let steered = {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            let at = memo.steered.iter().position(|(k, _)| *k == key);
            at.and_then(|i| memo.steered.remove(i)).map(|(_, who)| who)
        };
        let refuse = |pod: Option<String>, message: String| {
            let _ = self.reports.try_send(Report::Refused { pod, message: message.clone() });
            Status::failed_precondition(message)
        };
        match identify(&candidates, steered.as_ref(), cards) {
            Some(p) => match &p.grants {
                Ok(grants) => {
                    let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
                    memo.done.insert((p.uid.clone(), p.container.clone()));
                    Ok(Claimed { grants: grants.clone(), pod_units: p.pod_units })
                }
                Err(reason) => Err(refuse(
                    Some(p.pod.clone()),
                    format!("nano-gpu cannot serve pod {} container {:?}: {reason}", p.pod, p.container),
                )),
            },
            None => Err(refuse(
                None,
                format!(
                    "no pod placed on node {} by nano-gpu is waiting for {} of {}; \
                     pods asking it must be scheduled by nano-gpu-scheduler",
                    self.node,
                    ids.len(),
                    self.resource.name()
                ),
            )),
        }
    }
}

/// The gRPC service for one resource.
pub struct Plugin {
    cards: watch::Receiver<Snapshot>,
    resource: Resource,
    edits: Edits,
    identity: Option<Arc<Identity>>,
}

impl Plugin {
    /// Serving `resource` on the cards `cards` carries (updated by the inventory loop). Without
    /// `identity` every container gets what its IDs say and GetPreferredAllocation packs cards.
    pub fn new(
        cards: watch::Receiver<Snapshot>,
        resource: Resource,
        edits: Edits,
        identity: Option<Arc<Identity>>,
    ) -> Self {
        Plugin { cards, resource, edits, identity }
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
        let resource = self.resource;
        let stream = async_stream(move |tx| async move {
            loop {
                let snapshot = rx.borrow_and_update().clone();
                if tx.send(Ok(ListAndWatchResponse { devices: devices(&snapshot, resource) })).await.is_err()
                {
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
        let mut container_responses = Vec::new();
        for r in &request.into_inner().container_requests {
            let size = r.allocation_size.max(0) as usize;
            let (available, must) = (&r.available_device_i_ds, &r.must_include_device_i_ds);
            let device_i_ds = match &self.identity {
                Some(identity) => identity.prefer(available, must, size).await,
                None => prefer(available, must, size),
            };
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let cards = self.cards.borrow().clone();
        let mut container_responses = Vec::new();
        for r in &request.into_inner().container_requests {
            let got = derive(&cards, &r.devices_ids)?;
            let claimed = match &self.identity {
                Some(identity) => {
                    let uuids = got.iter().map(|(c, _)| c.info.uuid.as_str()).collect();
                    Some(identity.claim(&r.devices_ids, &uuids).await?)
                }
                None => None,
            };
            let response = allocate(&cards, &r.devices_ids, claimed.as_ref(), self.resource, self.edits)?;
            container_responses.push(response);
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        let cards = self.cards.borrow().clone();
        derive(&cards, &ids)?;
        if let Some(identity) = &self.identity {
            // Checked in the background: the container already has what its IDs say.
            let report = Report::Starting { ids, cards, resource: self.resource };
            if identity.reports.try_send(report).is_err() {
                tracing::warn!("repair queue full; a container start is not verified");
            }
        }
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

/// Binds the plugin's socket, removing a stale file first.
pub fn bind(socket: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(socket);
    tokio::net::UnixListener::bind(socket)
}

/// Serves the plugin on `socket` (a stale file is removed first) until `shutdown` resolves.
pub async fn serve(
    socket: &Path,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    serve_on(bind(socket)?, plugin, shutdown).await
}

/// Serves the plugin on a bound socket until `shutdown` resolves.
pub async fn serve_on(
    listener: tokio::net::UnixListener,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    Server::builder()
        .add_service(DevicePluginServer::new(plugin))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// Registers `resource` with the kubelet; the plugin serves on `resource.socket()` in the kubelet's
/// directory.
pub async fn register(kubelet_socket: PathBuf, resource: Resource) -> Result<(), Status> {
    let channel = nano_gpu_runtime::unix_channel(kubelet_socket).await.map_err(|e| Status::unavailable(e.to_string()))?;
    let options = DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true };
    let request = RegisterRequest {
        version: VERSION.into(),
        endpoint: resource.socket().into(),
        resource_name: resource.name().into(),
        options: Some(options),
    };
    // A kubelet that accepts the connection but never answers must not hold the agent forever.
    tokio::time::timeout(REGISTER_TIMEOUT, RegistrationClient::new(channel).register(request))
        .await
        .map_err(|_| Status::unavailable("the kubelet did not answer the registration in time"))??;
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
        let d = devices(&[card("GPU-a", Vendor::Nvidia), card("GPU-b", Vendor::Nvidia)], Resource::Percent);
        assert_eq!(d.len(), 200);
        assert_eq!(d[0].id, "GPU-a-00");
        assert_eq!(d[199].id, "GPU-b-99");
        assert_eq!(d[0].topology.as_ref().unwrap().nodes[0].id, 1);
    }

    #[test]
    fn allocate_derives_the_cards_from_the_ids() {
        let cards = [card("GPU-a", Vendor::Nvidia), card("intel-0000:03:00.0", Vendor::Intel)];
        let r = allocate(&cards, &ids("GPU-a", 0..30), None, Resource::Percent, Edits::default()).unwrap();
        assert!(r.cdi_devices.is_empty());
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(r.envs["NANO_GPU_PERCENT"], "30");
        let r =
            allocate(&cards, &ids("intel-0000:03:00.0", 0..50), None, Resource::Percent, Edits { cdi: true })
                .unwrap();
        assert!(!r.envs.contains_key("NVIDIA_VISIBLE_DEVICES") && r.cdi_devices.is_empty());
        assert_eq!(
            r.devices.iter().map(|d| d.host_path.as_str()).collect::<Vec<_>>(),
            ["/dev/dri/card1", "/dev/dri/renderD129"]
        );
        let r =
            allocate(&cards, &ids("GPU-a", 0..100), None, Resource::Percent, Edits { cdi: true }).unwrap();
        assert_eq!(r.cdi_devices[0].name, "nvidia.com/gpu=GPU-a");
    }

    #[test]
    fn unknown_ids_are_invalid_arguments_not_a_poisoned_env() {
        let cards = [card("GPU-a", Vendor::Nvidia)];
        assert_eq!(
            allocate(&cards, &["not-ours".into()], None, Resource::Percent, Edits::default())
                .unwrap_err()
                .code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            allocate(&cards, &ids("GPU-zz", 0..1), None, Resource::Percent, Edits::default())
                .unwrap_err()
                .code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            allocate(&cards, &[], None, Resource::Percent, Edits::default()).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
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
