//! The kubelet's side of the device-plugin API over real unix sockets in a directory: the
//! registration service on `<dir>/plugins/kubelet.sock` (every request is handed to the test) and
//! pod-resources on `<dir>/pod-resources.sock`, answering what the test says was allocated.
//!
//! For agent tests and the agent benchmark; the end-to-end tests use a kubelet stand-in instead.

use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::registration_server::{Registration, RegistrationServer};
use nano_gpu_proto::kubelet::deviceplugin::{Empty, RegisterRequest};
use nano_gpu_proto::kubelet::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use nano_gpu_proto::kubelet::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// One container's allocation as pod-resources lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Resource name.
    pub resource: String,
    /// Device IDs (empty: the pod is being admitted, nothing allocated yet).
    pub ids: Vec<String>,
}

/// What pod-resources answers; the test changes it as "the kubelet" allocates.
#[derive(Clone, Default)]
pub struct PodResourcesState {
    entries: Arc<Mutex<Vec<Allocated>>>,
    limited: Arc<AtomicU32>,
    calls: Arc<AtomicU32>,
}

impl PodResourcesState {
    /// Replaces the whole answer.
    pub fn set(&self, entries: Vec<Allocated>) {
        *self.entries.lock().unwrap_or_else(|e| e.into_inner()) = entries;
    }

    /// Refuses the next `n` List calls the way the kubelet's rate limiter does.
    pub fn rate_limit(&self, n: u32) {
        self.limited.store(n, Ordering::SeqCst);
    }

    /// List calls received so far (refused ones included).
    pub fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Adds or replaces one container's entry.
    pub fn put(&self, entry: Allocated) {
        let mut all = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|a| {
            (&a.namespace, &a.pod, &a.container) != (&entry.namespace, &entry.pod, &entry.container)
        });
        all.push(entry);
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesState {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.limited.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        let all = self.entries.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut pods: Vec<PodResources> = Vec::new();
        for a in all {
            let at = match pods.iter().position(|p| p.namespace == a.namespace && p.name == a.pod) {
                Some(i) => i,
                None => {
                    pods.push(PodResources {
                        name: a.pod.clone(),
                        namespace: a.namespace.clone(),
                        containers: vec![],
                    });
                    pods.len() - 1
                }
            };
            let devices = if a.ids.is_empty() {
                vec![]
            } else {
                vec![ContainerDevices { resource_name: a.resource, device_ids: a.ids, topology: None }]
            };
            pods[at].containers.push(ContainerResources { name: a.container, devices, ..Default::default() });
        }
        Ok(Response::new(ListPodResourcesResponse { pod_resources: pods }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("the fake kubelet lists pods only"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("the fake kubelet lists pods only"))
    }
}

struct Registrar(mpsc::UnboundedSender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.0.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// A running fake kubelet.
pub struct FakeKubelet {
    /// The device-plugin directory (`<dir>/plugins`), where plugins put their sockets.
    pub plugin_dir: PathBuf,
    /// The pod-resources socket.
    pub pod_resources_socket: PathBuf,
    /// Registrations received.
    pub registrations: mpsc::UnboundedReceiver<RegisterRequest>,
    /// What pod-resources answers.
    pub pod_resources: PodResourcesState,
}

/// The node the agent's tests run on: two Tesla T4 cards of 16,000 MiB, `GPU-a` and `GPU-b`, in
/// the fake inventory's format.
pub const TWO_T4: &str = r#"{"v":1,"gpus":[
    {"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"Tesla T4","memoryMiB":16000,"healthy":true},
    {"index":1,"uuid":"GPU-b","vendor":"nvidia","model":"Tesla T4","memoryMiB":16000,"healthy":true}]}"#;

/// A fresh scratch directory `nano-gpu-<name>-<pid>` with [`TWO_T4`] in its `gpus.json`: the
/// directory and that file.
pub fn two_t4_node(name: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("nano-gpu-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating the test's directory");
    let gpus = dir.join("gpus.json");
    std::fs::write(&gpus, TWO_T4).expect("writing the fake inventory");
    (dir, gpus)
}

impl FakeKubelet {
    /// Waits (up to 20 s) for the next registration; fails the test without one.
    pub async fn registered(&mut self) -> RegisterRequest {
        let registration =
            tokio::time::timeout(std::time::Duration::from_secs(20), self.registrations.recv());
        match registration.await {
            Ok(Some(r)) => r,
            _ => panic!("the agent did not register"),
        }
    }

    /// A client of the plugin registered on `nano-gpu.sock`, as the kubelet calls it.
    pub async fn plugin(&self) -> DevicePluginClient<tonic::transport::Channel> {
        let socket = self.plugin_dir.join("nano-gpu.sock");
        let channel = nano_gpu_runtime::unix_channel(socket).await.expect("connecting to the plugin");
        DevicePluginClient::new(channel)
    }

    /// The agent binary `program` as node `n1`'s agent against this kubelet, the cards of `inventory`
    /// and the API server of `kubeconfig`; callers add their own flags.
    pub fn agent(&self, program: &Path, inventory: &Path, kubeconfig: &Path) -> std::process::Command {
        let mut command = std::process::Command::new(program);
        command
            .args(["--node-name", "n1"])
            .arg("--plugin-dir")
            .arg(&self.plugin_dir)
            .arg("--pod-resources-socket")
            .arg(&self.pod_resources_socket)
            .arg("--fake-inventory")
            .arg(inventory)
            .env("KUBECONFIG", kubeconfig);
        command
    }

    /// Serves in `dir` (created), on the current tokio runtime.
    pub fn start(dir: &Path) -> std::io::Result<FakeKubelet> {
        let plugin_dir = dir.join("plugins");
        std::fs::create_dir_all(&plugin_dir)?;
        let (tx, registrations) = mpsc::unbounded_channel();
        let registration = tokio::net::UnixListener::bind(plugin_dir.join("kubelet.sock"))?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(Registrar(tx)))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(registration)),
        );
        let pod_resources = PodResourcesState::default();
        let pod_resources_socket = dir.join("pod-resources.sock");
        let lister = tokio::net::UnixListener::bind(&pod_resources_socket)?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(pod_resources.clone()))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(lister)),
        );
        Ok(FakeKubelet { plugin_dir, pod_resources_socket, registrations, pod_resources })
    }
}
