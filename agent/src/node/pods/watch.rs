//! The node-scoped pod watch (`spec.nodeName=<node>`) that feeds the handlers: for each resource, a
//! watch channel that always holds the latest [`Pods`] asking it, and one with every pod of the node
//! by UID ([`Residents`], for the usage metrics). A re-list replaces a view at its end, so readers
//! never see half a list. A watch that breaks comes back within seconds
//! (`nano_gpu_runtime::watch_backoff`), and
//! [`NodePods`] reads the node's pods directly for the moments it lags.

use super::{NodePod, Pods, Resident, Residents, pod_key};
use crate::cards::resource::Resource;
use crate::node::probe::Readiness;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long one direct read of the node's pods may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads the pods bound to this node straight from the API server, for the device plugin when the
/// watch does not show the pod the kubelet is admitting (a trait so handler tests answer in memory).
#[tonic::async_trait]
pub trait NodePods: Send + Sync + 'static {
    /// Every pod bound to the node now.
    async fn list(&self) -> Result<Vec<Pod>, String>;
}

/// [`NodePods`] through the API server.
pub struct ApiNodePods {
    api: Api<Pod>,
    node: String,
}

impl ApiNodePods {
    /// The pods of node `node`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        ApiNodePods { api: Api::all(client), node: node.to_owned() }
    }
}

#[tonic::async_trait]
impl NodePods for ApiNodePods {
    async fn list(&self) -> Result<Vec<Pod>, String> {
        let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        match tokio::time::timeout(READ_TIMEOUT, self.api.list(&params)).await {
            Ok(Ok(list)) => Ok(list.items),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} s", READ_TIMEOUT.as_secs())),
        }
    }
}

/// What the watch feeds.
pub struct Views {
    /// For each resource asked, the pods asking it.
    pub asking: Vec<watch::Receiver<Pods>>,
    /// Every pod of the node.
    pub residents: watch::Receiver<Residents>,
}

/// Watches the pods bound to `node`; for each of `resources`, a receiver that always holds the latest
/// view of the pods asking it, and one of every pod (all empty until the first list completes), for
/// as long as the watch (the future, which the caller runs among its background tasks) runs.
pub fn watch_pods(
    client: kube::Client,
    node: &str,
    resources: &[Resource],
    readiness: Arc<Readiness>,
) -> (Views, impl std::future::Future<Output = ()> + Send + 'static) {
    let (senders, receivers): (Vec<_>, Vec<_>) =
        resources.iter().map(|_| watch::channel(Pods::default())).unzip();
    let (residents_tx, residents) = watch::channel(Residents::default());
    let resources = resources.to_vec();
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let watching = async move {
        let mut stream = watcher::watcher(api, config).backoff(nano_gpu_runtime::watch_backoff()).boxed();
        let mut views: Vec<View<NodePod>> = resources
            .iter()
            .map(|r| {
                let resource = r.name();
                View::new(key, move |p: &Pod| NodePod::from_pod(p, resource))
            })
            .collect();
        let mut all = View::new(|p| p.metadata.uid.clone().unwrap_or_default(), Resident::from_pod);
        loop {
            let event = match stream.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "pod watch failed; retrying with backoff");
                    readiness.set_watch_error(Some(e.to_string()));
                    continue;
                }
            };
            readiness.set_watch_error(None);
            for (view, tx) in views.iter_mut().zip(&senders) {
                if view.apply(&event) {
                    tx.send_replace(Arc::new(view.pods.clone()));
                }
            }
            if all.apply(&event) {
                residents_tx.send_replace(Arc::new(all.pods.clone()));
            }
        }
    };
    (Views { asking: receivers, residents }, watching)
}

/// A pod's `namespace/name`.
fn key(p: &Pod) -> String {
    pod_key(p.metadata.namespace.as_deref().unwrap_or(""), p.metadata.name.as_deref().unwrap_or(""))
}

/// What a pod reads as when it counts.
type Read<T> = Box<dyn Fn(&Pod) -> Option<T> + Send>;

/// The pods that count, by key, kept from watch events.
struct View<T> {
    key: fn(&Pod) -> String,
    read: Read<T>,
    pods: BTreeMap<String, T>,
    relist: Option<BTreeMap<String, T>>,
}

impl<T: Clone + PartialEq> View<T> {
    fn new(key: fn(&Pod) -> String, read: impl Fn(&Pod) -> Option<T> + Send + 'static) -> Self {
        View { key, read: Box::new(read), pods: BTreeMap::new(), relist: None }
    }

    /// Applies one watch event; returns whether the view changed.
    fn apply(&mut self, event: &watcher::Event<Pod>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(p) => {
                if let (Some(into), Some(n)) = (self.relist.as_mut(), (self.read)(p)) {
                    into.insert((self.key)(p), n);
                }
                false
            }
            watcher::Event::InitDone => {
                self.pods = self.relist.take().unwrap_or_default();
                true
            }
            watcher::Event::Apply(p) => match (self.read)(p) {
                Some(n) => self.pods.insert((self.key)(p), n.clone()) != Some(n),
                None => self.pods.remove(&(self.key)(p)).is_some(),
            },
            watcher::Event::Delete(p) => self.pods.remove(&(self.key)(p)).is_some(),
        }
    }
}
