//! The node-scoped pod watch (`spec.nodeName=<node>`) that feeds the handlers: for each resource, a
//! watch channel that always holds the latest [`Pods`] asking it. A re-list replaces the view at its
//! end, so handlers never see half a list.

use super::{NodePod, Pods, pod_key};
use crate::resource::Resource;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

/// Watches the pods bound to `node`; for each of `resources`, a receiver that always holds the latest
/// view of the pods asking it (empty until the first list completes).
pub fn watch_pods(client: kube::Client, node: &str, resources: &[Resource]) -> Vec<watch::Receiver<Pods>> {
    let (senders, receivers): (Vec<_>, Vec<_>) =
        resources.iter().map(|_| watch::channel(Pods::default())).unzip();
    let resources = resources.to_vec();
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    tokio::spawn(async move {
        let mut stream = watcher::watcher(api, config).default_backoff().boxed();
        let mut views: Vec<View> = resources.iter().map(|r| View::new(r.name())).collect();
        loop {
            let event = match stream.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "pod watch failed; retrying with backoff");
                    continue;
                }
            };
            for (view, tx) in views.iter_mut().zip(&senders) {
                if view.apply(&event) {
                    tx.send_replace(Arc::new(view.pods.clone()));
                }
            }
        }
    });
    receivers
}

/// The pods asking one resource, kept from watch events.
struct View {
    resource: &'static str,
    pods: BTreeMap<String, NodePod>,
    relist: Option<BTreeMap<String, NodePod>>,
}

impl View {
    fn new(resource: &'static str) -> Self {
        View { resource, pods: BTreeMap::new(), relist: None }
    }

    /// Applies one watch event; returns whether the view changed.
    fn apply(&mut self, event: &watcher::Event<Pod>) -> bool {
        let key = |p: &Pod| {
            pod_key(p.metadata.namespace.as_deref().unwrap_or(""), p.metadata.name.as_deref().unwrap_or(""))
        };
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(p) => {
                if let (Some(into), Some(n)) = (self.relist.as_mut(), NodePod::from_pod(p, self.resource)) {
                    into.insert(key(p), n);
                }
                false
            }
            watcher::Event::InitDone => {
                self.pods = self.relist.take().unwrap_or_default();
                true
            }
            watcher::Event::Apply(p) => match NodePod::from_pod(p, self.resource) {
                Some(n) => self.pods.insert(key(p), n.clone()) != Some(n),
                None => self.pods.remove(&key(p)).is_some(),
            },
            watcher::Event::Delete(p) => self.pods.remove(&key(p)).is_some(),
        }
    }
}
