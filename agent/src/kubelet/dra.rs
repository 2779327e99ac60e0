//! The DRA front end: the agent as a Dynamic Resource Allocation kubelet plugin for the driver
//! [`DRIVER`], beside the device plugin and over the same model of the node's cards (the inventory
//! loop's snapshot) and the same container edits ([`crate::kubelet::plugin::container_edits`]).
//!
//! - [`slice`]: the cards as the node's ResourceSlice (each card one device, shared by capacity).
//! - [`prepare`]: a claim's allocation read against the cards (pure).
//! - [`cdi`]: prepared claims as CDI spec files, the front end's only state.
//! - here: the kubelet's plugin registration and the DRA gRPC service, on unix sockets.
//!
//! - [`limit`]: the driver's per-pod memory limit for a prepared claim's pod.
//!
//! A node's cards are served by one of the two front ends only (the Node's `nano-gpu/front-end`
//! label says which), so a card is never counted both as a share and as a claim.

pub mod authority;
pub mod cdi;
pub mod limit;
pub mod prepare;
pub mod slice;

use crate::kubelet::plugin::{Edits, Snapshot};
use crate::node::enforce::driver::{MemoryLimit, PodLimit};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::{WatchStreamExt, watcher};
use nano_gpu_proto::kubelet::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use nano_gpu_proto::kubelet::dra::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use nano_gpu_proto::kubelet::pluginregistration::registration_server::{Registration, RegistrationServer};
use nano_gpu_proto::kubelet::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use nano_gpu_proto::kubelet::{DRA_PLUGIN_TYPE, DRA_SERVICE};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tonic::service::Routes;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use nano_gpu_proto::annotations::DRA_LABEL;
pub use nano_gpu_proto::dra::DRIVER;

/// Where the front end serves and writes.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The kubelet's plugin registry (`/var/lib/kubelet/plugins_registry`): the registration socket.
    pub registry_dir: PathBuf,
    /// The driver's own directory (`/var/lib/kubelet/plugins/gpu.nano-gpu.io`): the DRA socket.
    pub plugin_dir: PathBuf,
    /// The node's CDI spec directory, which the container runtime reads (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// This agent among the node's agents (its pod's name; empty when it is the only one): its
    /// sockets are its own, so in a rollout the new agent registers beside the old one, and the old
    /// one, going, removes only its own (the kubelet uses the newest registration of a driver).
    pub instance: String,
}

impl Paths {
    /// The registration socket, `<registry>/gpu.nano-gpu.io-<instance>-reg.sock`
    /// (`gpu.nano-gpu.io-reg.sock` without an instance).
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER}{}-reg.sock", self.suffix()))
    }

    /// The DRA service socket, `<plugin dir>/dra-<instance>.sock` (`dra.sock` without an instance).
    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join(format!("dra{}.sock", self.suffix()))
    }

    fn suffix(&self) -> String {
        if self.instance.is_empty() { String::new() } else { format!("-{}", self.instance) }
    }

    /// Removes the sockets of this driver no one answers on (a crashed agent's), so the kubelet
    /// does not keep a registration whose service is gone; run before this agent binds its own.
    pub async fn sweep(&self) {
        let registration = |n: &str| n.starts_with(DRIVER) && n.ends_with("-reg.sock");
        crate::kubelet::plugin::socket::remove_unserved(&self.registry_dir, registration).await;
        let service = |n: &str| n.starts_with("dra") && n.ends_with(".sock");
        crate::kubelet::plugin::socket::remove_unserved(&self.plugin_dir, service).await;
    }
}

/// How the front end reads a claim the kubelet names, and the pod it was made for.
pub trait Claims: Send + Sync + 'static {
    /// The claim `namespace/name`, or why it cannot be read.
    fn get(&self, namespace: &str, name: &str) -> impl Future<Output = Result<ResourceClaim, String>> + Send;

    /// The pod `namespace/name`, or why it cannot be read.
    fn pod(&self, namespace: &str, name: &str) -> impl Future<Output = Result<Pod, String>> + Send;
}

/// Claims read from the API server.
pub struct ApiClaims(pub kube::Client);

impl Claims for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.0.clone(), namespace);
        api.get(name).await.map_err(|e| format!("reading claim {namespace}/{name}: {e}"))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, String> {
        let api: kube::Api<Pod> = kube::Api::namespaced(self.0.clone(), namespace);
        api.get(name).await.map_err(|e| format!("reading pod {namespace}/{name}: {e}"))
    }
}

/// The DRA gRPC service.
pub struct Driver<C> {
    /// Where claims come from.
    pub claims: C,
    /// This node (the pool of its devices).
    pub node: String,
    /// The node's cards, as the inventory loop has them.
    pub cards: watch::Receiver<Snapshot>,
    /// What containers get beyond their cards (the device plugin's settings).
    pub edits: Edits,
    /// Where the CDI specs go.
    pub cdi_dir: PathBuf,
    /// The driver's per-pod memory limit, when the node sets it (`--memory-limit driver`).
    pub limit: Option<Arc<dyn PodLimit>>,
}

/// One request's reads: each claim and pod is read from `C` once. The kubelet prepares a pod's
/// claims of a driver in one request, and with the driver's memory limit each claim's preparation
/// reads the pod and its other claims: without this, k claims of a pod cost k² reads.
struct Memo<'a, C> {
    inner: &'a C,
    claims: std::sync::Mutex<std::collections::HashMap<(String, String), ResourceClaim>>,
    pods: std::sync::Mutex<std::collections::HashMap<(String, String), Pod>>,
}

impl<'a, C: Claims> Memo<'a, C> {
    fn new(inner: &'a C) -> Self {
        Memo { inner, claims: Default::default(), pods: Default::default() }
    }

    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        once(&self.claims, namespace, name, self.inner.get(namespace, name)).await
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, String> {
        once(&self.pods, namespace, name, self.inner.pod(namespace, name)).await
    }
}

/// `namespace/name` from `cache`, else what `read` gives (then kept there).
async fn once<T: Clone>(
    cache: &std::sync::Mutex<std::collections::HashMap<(String, String), T>>,
    namespace: &str,
    name: &str,
    read: impl Future<Output = Result<T, String>>,
) -> Result<T, String> {
    let key = (namespace.to_owned(), name.to_owned());
    if let Some(kept) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(kept.clone());
    }
    let read = read.await?;
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, read.clone());
    Ok(read)
}

impl<C: Claims> Driver<C> {
    /// Prepares one claim: reads it (through `reads`, the request's), checks its allocation against
    /// the cards, writes its CDI spec.
    async fn prepare(&self, reads: &Memo<'_, C>, claim: &Claim) -> Result<Vec<Device>, String> {
        let read = reads.get(&claim.namespace, &claim.name).await?;
        let uid = read.metadata.uid.as_deref().unwrap_or("");
        if uid != claim.uid {
            return Err(format!(
                "claim {}/{} has UID {uid}, not {} (deleted and made again?)",
                claim.namespace, claim.name, claim.uid
            ));
        }
        let cards = self.cards.borrow().clone();
        let grants = prepare::grants(&read, &self.node, &cards)?;
        let prepared = prepare::prepare(&grants, &cards, &self.edits)?;
        // Before the spec: no container can be given the card until its pod's limit is set.
        if let Some(limit) = &self.limit {
            limit::set(reads, limit, &read, &grants, &self.node, &cards).await?;
        }
        cdi::write(&self.cdi_dir, uid, &cdi::spec(uid, &prepared))
            .map_err(|e| format!("writing the CDI spec in {}: {e}", self.cdi_dir.display()))?;
        let mut devices = Vec::new();
        for (n, p) in prepared.iter().enumerate() {
            for (i, g) in p.grants.iter().enumerate() {
                // The request's edits once (on its first device), and each card's own CDI device
                // where the runtime names cards by CDI.
                let mut ids: Vec<String> = Vec::new();
                if i == 0 {
                    ids.push(cdi::device_id(uid, n));
                }
                let own = format!("={}", g.uuid);
                ids.extend(
                    p.edits.cdi_devices.iter().filter(|d| d.name.ends_with(&own)).map(|d| d.name.clone()),
                );
                devices.push(Device {
                    request_names: vec![g.request.clone()],
                    pool_name: self.node.clone(),
                    device_name: g.device.clone(),
                    cdi_device_ids: ids,
                    share_id: g.share_id.clone(),
                });
            }
        }
        tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid, devices = devices.len(), "claim prepared");
        Ok(devices)
    }
}

#[tonic::async_trait]
impl<C: Claims> DraPlugin for Driver<C> {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut response = NodePrepareResourcesResponse::default();
        let reads = Memo::new(&self.claims);
        for claim in request.into_inner().claims {
            let answer = match self.prepare(&reads, &claim).await {
                Ok(devices) => NodePrepareResourceResponse { devices, error: String::new() },
                Err(error) => {
                    tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), %error, "claim not prepared");
                    NodePrepareResourceResponse { devices: Vec::new(), error }
                }
            };
            response.claims.insert(claim.uid, answer);
        }
        Ok(Response::new(response))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut response = NodeUnprepareResourcesResponse::default();
        for claim in request.into_inner().claims {
            let error = match cdi::remove(&self.cdi_dir, &claim.uid) {
                Ok(()) => {
                    tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = claim.uid, "claim unprepared");
                    String::new()
                }
                Err(e) => format!("removing the CDI spec of claim {}: {e}", claim.uid),
            };
            response.claims.insert(claim.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(response))
    }
}

/// The registration service the kubelet's plugin watcher finds in its registry.
pub struct Registrar {
    /// What the kubelet is told.
    pub info: PluginInfo,
}

impl Registrar {
    /// The registration of [`DRIVER`] serving [`DRA_SERVICE`] on `dra_socket`.
    pub fn new(dra_socket: &Path) -> Registrar {
        Registrar {
            info: PluginInfo {
                r#type: DRA_PLUGIN_TYPE.into(),
                name: DRIVER.into(),
                endpoint: dra_socket.display().to_string(),
                supported_versions: vec![DRA_SERVICE.into()],
            },
        }
    }
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = DRIVER, "the kubelet registered the DRA plugin");
        } else {
            tracing::error!(driver = DRIVER, error = status.error, "the kubelet refused the DRA plugin");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Binds the unix socket `socket` (its directory made, a stale file removed first).
fn bind(socket: &Path) -> Result<tokio::net::UnixListener, String> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    crate::kubelet::plugin::bind(socket).map_err(|e| format!("{}: {e}", socket.display()))
}

/// Serves `routes` on `listener` until `stop`; with `fix_authority`, through [`authority`]'s front
/// (for the kubelet's plugin watcher).
async fn serve(
    listener: tokio::net::UnixListener,
    routes: Routes,
    fix_authority: bool,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let served = if fix_authority {
        let incoming = authority::incoming(listener);
        Server::builder().add_routes(routes).serve_with_incoming_shutdown(incoming, stop).await
    } else {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        Server::builder().add_routes(routes).serve_with_incoming_shutdown(incoming, stop).await
    };
    served.map_err(|e| format!("serving: {e}"))
}

/// How often the slice is written again after the API server refused it.
const RETRY: Duration = Duration::from_secs(5);

/// Runs the front end until `shutdown`: the DRA service first, then the registration (so the
/// kubelet never finds a registration whose service does not answer), and the node's ResourceSlice
/// whenever the cards change. The registration socket goes when it stops: the kubelet then
/// unregisters the driver.
pub async fn run<C: Claims>(
    paths: Paths,
    driver: Driver<C>,
    publisher: Option<slice::Publisher>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), String> {
    let mut cards = driver.cards.clone();
    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    paths.sweep().await;
    let dra_socket = paths.dra_socket();
    let registration = paths.registration_socket();
    let registrar = Registrar::new(&dra_socket);
    // The DRA socket is bound before the registration's: the kubelet never finds a registration
    // whose service does not answer.
    let dra_listener = bind(&dra_socket)?;
    let registration_listener = bind(&registration)?;
    let dra = tokio::spawn(serve(
        dra_listener,
        Routes::new(DraPluginServer::new(driver)),
        false,
        stop(shutdown.clone()),
    ));
    let register = tokio::spawn(serve(
        registration_listener,
        Routes::new(RegistrationServer::new(registrar)),
        true,
        stop(shutdown.clone()),
    ));
    tracing::info!(driver = DRIVER, socket = %registration.display(), "DRA plugin serving");
    let publish = async {
        let Some(mut publisher) = publisher else { return std::future::pending().await };
        // Every change of the slice by anyone else (the kubelet wipes a node's slices when it
        // starts, and a driver's when it stays unregistered for 30 s) is looked at at once.
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", slice::name(&publisher.node)));
        let mut changes = watcher::watcher(publisher.slices.clone(), config)
            .backoff(nano_gpu_runtime::watch_backoff())
            .boxed();
        loop {
            let fresh = cards.borrow_and_update().clone();
            match publisher.publish(&fresh).await {
                Ok(true) => tracing::info!(devices = fresh.len(), "ResourceSlice published"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "publishing the ResourceSlice failed; retrying");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            }
            tokio::select! {
                changed = cards.changed() => if changed.is_err() { return std::future::pending().await },
                event = changes.next() => match event {
                    Some(Err(e)) => tracing::warn!(error = %e, "ResourceSlice watch failed; retrying with backoff"),
                    Some(Ok(_)) => {}
                    None => return std::future::pending().await,
                },
            }
        }
    };
    tokio::select! {
        _ = publish => {}
        _ = shutdown.wait_for(|s| *s) => {}
    }
    let _ = std::fs::remove_file(&registration);
    let (a, b) = (dra.await, register.await);
    let _ = std::fs::remove_file(&dra_socket);
    a.map_err(|e| e.to_string())??;
    b.map_err(|e| e.to_string())?
}

/// The front end as the agent runs it on a node: claims and the slice through the API server.
pub struct FrontEnd {
    /// Where it serves and writes.
    pub paths: Paths,
    /// This node.
    pub node: String,
    /// The agent's client.
    pub client: kube::Client,
}

impl FrontEnd {
    /// Serves the node's cards `cards` with the container edits `edits` until `shutdown`; an error
    /// it ends with is logged (the device plugin goes on serving).
    pub async fn run(self, cards: watch::Receiver<Snapshot>, edits: Edits, shutdown: watch::Receiver<bool>) {
        let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(self.client.clone());
        // The slice is owned by the Node: its UID first, the runtime its kubelet reports, and
        // whether the node was kept off DRA.
        let (node_uid, runtime, kept_off) = loop {
            match nodes.get(&self.node).await {
                Ok(n) => {
                    let kept_off = kept_off_dra(n.metadata.labels.as_ref());
                    let runtime = n.status.and_then(|s| s.node_info).map(|i| i.container_runtime_version);
                    break (n.metadata.uid.unwrap_or_default(), runtime.unwrap_or_default(), kept_off);
                }
                Err(e) => {
                    tracing::warn!(error = %e, node = self.node, "reading the Node for its ResourceSlice; retrying");
                    tokio::time::sleep(RETRY).await;
                }
            }
        };
        if kept_off {
            tracing::info!(
                node = self.node,
                "the Node is labelled {DRA_LABEL}=false: DRA is not served on it (the device plugin is)"
            );
            label_front_end(&nodes, &self.node, false).await;
            return;
        }
        if let Err(why) = runtime_has_cdi(&runtime) {
            tracing::error!(node = self.node, "{why}: DRA is not served on this node (the device plugin is)");
            label_front_end(&nodes, &self.node, false).await;
            return;
        }
        // Before the first slice: from here on the allocator places no share on this node's cards.
        label_front_end(&nodes, &self.node, true).await;
        let publisher =
            slice::Publisher::new(kube::Api::all(self.client.clone()), self.node.clone(), node_uid);
        let limit = match &edits.memory {
            MemoryLimit::Driver(d) => Some(d.clone() as Arc<dyn PodLimit>),
            _ => None,
        };
        let driver = Driver {
            claims: ApiClaims(self.client),
            node: self.node,
            cards,
            edits,
            cdi_dir: self.paths.cdi_dir.clone(),
            limit,
        };
        if let Err(e) = run(self.paths, driver, Some(publisher), shutdown).await {
            tracing::error!(error = %e, "the DRA plugin stopped");
        }
    }
}

/// Says on the Node which front end serves its cards (`nano-gpu/front-end: dra`, or no label: the
/// device plugin): a merge patch, which changes nothing when the Node already says so; retried until
/// written (the allocator must not place shares on cards the DRA driver serves).
pub async fn label_front_end(nodes: &kube::Api<k8s_openapi::api::core::v1::Node>, node: &str, dra: bool) {
    use nano_gpu_proto::annotations::{FRONT_END_DRA, FRONT_END_LABEL};
    let wanted = dra.then_some(FRONT_END_DRA);
    let patch = serde_json::json!({"metadata": {"labels": {FRONT_END_LABEL: wanted}}});
    let params = kube::api::PatchParams::default();
    while let Err(e) = nodes.patch(node, &params, &kube::api::Patch::Merge(&patch)).await {
        tracing::warn!(error = %e, "writing the front-end label; retrying");
        tokio::time::sleep(RETRY).await;
    }
}

/// Whether the Node's labels keep it off DRA (`nano-gpu/dra: "false"`, set by an operator).
pub fn kept_off_dra(labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
    labels.and_then(|l| l.get(DRA_LABEL)).map(String::as_str) == Some("false")
}

/// Whether the node's runtime, as its kubelet reports it (`containerd://2.2.9`), applies the CDI
/// devices a prepared claim is handed over as: containerd has CDI from 1.7 (on by default from 2.0);
/// other runtimes (CRI-O has it from 1.23) are taken as having it.
pub fn runtime_has_cdi(runtime: &str) -> Result<(), String> {
    let Some(version) = runtime.strip_prefix("containerd://") else { return Ok(()) };
    let mut parts = version.trim_start_matches('v').split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < (1, 7) {
        return Err(format!(
            "the node's runtime {runtime} has no CDI (containerd 1.7 with enable_cdi, or 2.x)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{kept_off_dra, runtime_has_cdi};

    #[test]
    fn containerd_before_1_7_has_no_cdi() {
        assert!(
            runtime_has_cdi("containerd://1.6.20").unwrap_err().contains("containerd://1.6.20 has no CDI")
        );
        assert!(runtime_has_cdi("containerd://v1.5.0").is_err());
        assert!(runtime_has_cdi("containerd://1.7.0").is_ok());
        assert!(runtime_has_cdi("containerd://2.2.9").is_ok());
        assert!(runtime_has_cdi("cri-o://1.30.0").is_ok());
    }

    #[test]
    fn only_false_keeps_a_node_off_dra() {
        let labels = |v: &str| Some([("nano-gpu/dra".to_owned(), v.to_owned())].into());
        assert!(kept_off_dra(labels("false").as_ref()));
        for v in ["true", "", "False", "no"] {
            assert!(!kept_off_dra(labels(v).as_ref()), "{v}");
        }
        assert!(!kept_off_dra(None));
    }
}
