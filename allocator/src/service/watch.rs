//! Watches on Nodes and Pods that feed the cluster view, and the warning Events it raises.
//!
//! Each watch lists everything first (the view is rebuilt from that list), then applies changes one
//! by one; a watch that breaks re-lists after a short backoff (`nano_gpu_runtime::watch_backoff`: at
//! most 4 s). The service is ready once both have listed. A reserved pod a re-list did not show is
//! looked up ([`look_up_unconfirmed`]). Lists are streamed where the API server can ([`Listing`]).
//! Pods and Nodes are decoded with only the fields the view reads ([`crate::state::slim`]).

use crate::state::slim::{ViewNode, ViewPod};
use crate::state::{ClusterState, Listed, SharedView, Unconfirmed, Warning};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Instrument;

/// How a kind of object enters the view.
trait Feed: Clone + Send + 'static {
    const KIND: Listed;
    fn apply(state: &mut ClusterState, obj: &Self);
    fn delete(state: &mut ClusterState, obj: &Self);
    fn begin_relist(state: &mut ClusterState);
    fn end_relist(state: &mut ClusterState);
}

impl Feed for ViewNode {
    const KIND: Listed = Listed::Nodes;
    fn apply(state: &mut ClusterState, obj: &Self) {
        state.apply_node(&obj.0);
    }
    fn delete(state: &mut ClusterState, obj: &Self) {
        if let Some(name) = obj.0.metadata.name.as_deref() {
            state.delete_node(name);
        }
    }
    fn begin_relist(state: &mut ClusterState) {
        state.begin_node_relist();
    }
    fn end_relist(state: &mut ClusterState) {
        state.end_node_relist();
    }
}

impl Feed for ViewPod {
    const KIND: Listed = Listed::Pods;
    fn apply(state: &mut ClusterState, obj: &Self) {
        state.apply_pod(&obj.0);
    }
    fn delete(state: &mut ClusterState, obj: &Self) {
        state.delete_pod(&obj.0);
    }
    fn begin_relist(state: &mut ClusterState) {
        state.begin_pod_relist();
    }
    fn end_relist(state: &mut ClusterState) {
        state.end_pod_relist();
    }
}

/// Applies one watch event to the view; returns whether a full list just completed. A re-list is
/// applied object by object as it arrives (never buffered whole), and what it did not mention is
/// removed at its end.
fn apply_event<K: Feed>(state: &mut ClusterState, event: Event<K>) -> bool {
    match event {
        Event::Init => K::begin_relist(state),
        Event::InitApply(o) => K::apply(state, &o),
        Event::InitDone => {
            K::end_relist(state);
            return true;
        }
        Event::Apply(o) => K::apply(state, &o),
        Event::Delete(o) => K::delete(state, &o),
    }
    false
}

/// How a watch lists: streamed from the API server's watch cache (`sendInitialEvents`, the WatchList
/// feature, on by default from Kubernetes 1.34: one watch request, objects one by one, nothing held
/// but the object being decoded), or in pages of [`LIST_PAGE`] (one request per page: 1,500 for
/// 150,000 pods, each page held whole while it is decoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listing {
    /// `sendInitialEvents=true`.
    Streamed,
    /// Pages of [`LIST_PAGE`].
    Paged,
}

impl Listing {
    /// Streamed on an API server of 1.34 or later, else paged (also when its version cannot be read).
    /// A server of that version that refuses a streamed list (its WatchList gate off) gets pages from
    /// then on ([`Watch`]).
    pub async fn of(client: &Client) -> Listing {
        match client.apiserver_version().await {
            Ok(v) if streams(&v.major, &v.minor) => Listing::Streamed,
            Ok(v) => {
                tracing::info!(version = %v.git_version, "the API server streams no lists; listing in pages");
                Listing::Paged
            }
            Err(e) => {
                tracing::warn!(error = %e, "the API server's version cannot be read; listing in pages");
                Listing::Paged
            }
        }
    }

    fn config(self) -> watcher::Config {
        match self {
            Listing::Streamed => watcher::Config::default().streaming_lists(),
            Listing::Paged => watcher::Config::default().page_size(LIST_PAGE),
        }
    }
}

/// Whether an API server of version `major.minor` (`minor` may carry a `+`) serves streamed lists
/// by default: 1.34 and later.
fn streams(major: &str, minor: &str) -> bool {
    let number = |s: &str| s.trim_end_matches('+').parse::<u32>().ok();
    matches!((number(major), number(minor)), (Some(1), Some(m)) if m >= 34)
}

/// A watch of every `K`, re-listing with backoff after it breaks, listing as its [`Listing`] says
/// until the API server refuses a streamed list.
pub struct Watch<K: 'static> {
    api: Api<K>,
    listing: Listing,
    stream: BoxStream<'static, Result<Event<K>, watcher::Error>>,
}

impl<K> Watch<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    /// Watches `api`, listing as `listing` says.
    pub fn new(api: Api<K>, listing: Listing) -> Self {
        let stream = Self::stream(&api, listing);
        Watch { api, listing, stream }
    }

    /// Drops the stream and starts again with a list.
    fn relist(&mut self) {
        self.stream = Self::stream(&self.api, self.listing);
    }

    fn stream(api: &Api<K>, listing: Listing) -> BoxStream<'static, Result<Event<K>, watcher::Error>> {
        watcher::watcher(api.clone(), listing.config()).backoff(nano_gpu_runtime::watch_backoff()).boxed()
    }

    /// The next event, or why the watch failed (it goes on after a backoff); `None` when it ended.
    pub async fn next(&mut self) -> Result<Option<Event<K>>, watcher::Error> {
        let next = self.stream.try_next().await;
        if let Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) = &next
            && self.listing == Listing::Streamed
            && matches!(status.code, 400 | 422)
        {
            tracing::warn!(error = %status.message, "the API server refuses streamed lists; listing in pages");
            self.listing = Listing::Paged;
            self.stream = Self::stream(&self.api, Listing::Paged);
        }
        next
    }
}

async fn run_watch<K>(
    mut watch: Watch<K>,
    view: Arc<SharedView>,
    events: mpsc::Sender<Warning>,
    unconfirmed: mpsc::UnboundedSender<Unconfirmed>,
) where
    K: Feed + kube::Resource + serde::de::DeserializeOwned + std::fmt::Debug + Sync,
    K::DynamicType: Default,
{
    loop {
        let next = if K::KIND == Listed::Pods {
            tokio::select! {
                next = watch.next() => next,
                () = view.pods_relist_asked() => {
                    watch.relist();
                    continue;
                }
            }
        } else {
            watch.next().await
        };
        match next {
            Ok(Some(event)) => {
                let (done, warnings) = {
                    let mut state = view.lock();
                    let done = apply_event(&mut state, event);
                    for u in state.take_unconfirmed() {
                        // The receiver lives as long as the watches.
                        let _ = unconfirmed.send(u);
                    }
                    (done, state.take_warnings())
                };
                if done {
                    let was = view.synced();
                    view.set_listed(K::KIND);
                    if !was && view.synced() {
                        tracing::info!("nodes and pods listed; ready");
                    }
                }
                // Never waits on the API server: a full queue drops the Event (the log has it).
                for w in warnings {
                    if events.try_send(w).is_err() {
                        tracing::warn!("warning event queue full; an event is only in the log");
                    }
                }
            }
            Ok(None) => break,
            Err(e) => tracing::warn!(error = %e, "watch failed; retrying with backoff"),
        }
    }
}

/// Objects per page of a list (the watches' initial lists and re-lists, the catch-up list). A page is
/// held whole while it is decoded, and a tenant's pod may carry 256 KiB of annotations that we do not
/// read: 100 such pods are 25 MiB a page, where client-go's 500 were 125 MiB (seen: 1,000 pending
/// pods of that size raised a replica's memory by 420 MiB at its start; `hack/bench-pending.sh`).
pub const LIST_PAGE: u32 = 100;

/// Warnings waiting to become Events, at most.
const EVENT_QUEUE: usize = 1024;

/// How long posting one Event may take.
const EVENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Posts the warnings the watches raise as Events, one at a time, each with a timeout, so a slow or
/// hung API server delays Events, never the view.
async fn post_events(recorder: Recorder, mut warnings: mpsc::Receiver<Warning>) {
    while let Some(w) = warnings.recv().await {
        if tokio::time::timeout(EVENT_TIMEOUT, publish(&recorder, &w, "Allocate")).await.is_err() {
            tracing::warn!(object = %w.name, reason = %w.reason, "posting a warning event timed out");
        }
    }
}

/// Records `w` as a Warning Event of `action` on its object (failures are logged).
pub async fn publish(recorder: &Recorder, w: &Warning, action: &str) {
    let api_version = match w.kind {
        "ResourceClaim" => "resource.k8s.io/v1",
        _ => "v1",
    };
    let reference = ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(w.kind.into()),
        name: Some(w.name.clone()),
        namespace: (!w.namespace.is_empty()).then(|| w.namespace.clone()),
        ..Default::default()
    };
    let event = KubeEvent {
        type_: EventType::Warning,
        reason: w.reason.as_str().into(),
        note: Some(w.message.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &reference).await {
        tracing::warn!(error = %e, object = %w.name, "could not record a warning event");
    }
}

/// The annotation a new leader writes on its own pod to learn the newest pod write (see
/// [`Newest::OwnPod`]): when it did, a different value each time.
pub const CAUGHT_UP_ANNOTATION: &str = "nano-gpu/caught-up";

/// How a new leader learns the newest pod write its view must hold before it decides.
pub enum Newest {
    /// Writes [`CAUGHT_UP_ANNOTATION`] on this replica's own pod (its namespace's pods, its name):
    /// etcd numbers writes in order, so the write's resourceVersion is above every pod write made
    /// before it, and the pod watch shows the pod in that order. One small request, whatever the
    /// cluster's size.
    OwnPod(Api<Pod>, String),
    /// Lists the metadata of every pod (paged) for the newest resourceVersion: for a replica that
    /// does not know its pod. Grows with the cluster: 1,500 pages at 150,000 pods.
    List(Api<Pod>),
}

/// Waits, at most `limit`, until the view holds every pod write the API server held when this was
/// called; returns whether it does. A new leader calls it before deciding: the replica that led before
/// wrote its last assignments moments ago, and a decision on a view that has not seen them would give
/// their cards away again. The pod watch shows writes in order, so the view holds them once the watch
/// showed the newest write ([`Newest`]) or a later one. Pods deleted since only make the view hold
/// more than it must for a moment (never less).
pub async fn caught_up(how: &Newest, view: &SharedView, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let shown = view.lock().pod_events();
    let newest = match how {
        Newest::OwnPod(pods, me) => written_now(pods, me, deadline).await,
        Newest::List(pods) => listed_newest(pods, deadline).await,
    };
    let newest = match newest {
        Ok(Some(v)) => v,
        // Not etcd's numbers: the order of writes cannot be read from them.
        Ok(None) => {
            tracing::warn!("pod resourceVersions are not numbers; deciding without waiting for the watch");
            return true;
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not learn the newest pod write to catch up with");
            return false;
        }
    };
    loop {
        if view.lock().has_pods_up_to(newest) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            if view.lock().pod_events() == shown {
                // Not one pod, while a write was made: a stream that delivers nothing (a connection
                // that died without closing; kube's watcher would notice only at its idle timeout,
                // about 5 minutes), while this replica holds the Lease and cannot decide.
                tracing::warn!(
                    resource_version = newest,
                    "the pod watch showed no pod within {limit:?}, not even the newest write: listing \
                     pods again"
                );
                view.relist_pods();
            } else {
                tracing::warn!(
                    resource_version = newest,
                    "the pod watch did not show the newest pod write within {limit:?}"
                );
            }
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How often a deciding replica checks a pod watch that showed nothing ([`check_pod_watch`]).
pub const POD_WATCH_CHECK: Duration = Duration::from_secs(30);

/// Keeps a deciding replica's pod watch honest: after every `every` in which the watch showed no pod
/// while `leads()`, checks it with [`caught_up`] (`newest`: one write on the replica's own pod), which
/// drops and lists again a stream that shows not even that write. A stream that died without closing
/// is so replaced within two periods and `limit` (the first whole period after its last pod), where
/// kube's watcher notices it only at its idle timeout (about 5 minutes), all the while the leader
/// misses every pod deletion (their cards look used). A quiet period costs one small write; a watch
/// that shows pods, none. Never returns.
pub async fn check_pod_watch(
    newest: Arc<Newest>,
    view: Arc<SharedView>,
    leads: impl Fn() -> bool,
    every: Duration,
    limit: Duration,
) {
    let mut shown = view.lock().pod_events();
    loop {
        tokio::time::sleep(every).await;
        let quiet = view.lock().pod_events() == shown;
        if quiet && view.synced() && leads() && caught_up(&newest, &view, limit).await {
            tracing::debug!("the pod watch is alive: it showed this replica's own write");
        }
        shown = view.lock().pod_events();
    }
}

/// The resourceVersion of a write of [`CAUGHT_UP_ANNOTATION`] on pod `me`, made now.
async fn written_now(
    pods: &Api<Pod>,
    me: &str,
    deadline: tokio::time::Instant,
) -> anyhow::Result<Option<u64>> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    // A value no earlier write had: a write that changes nothing gets no new resourceVersion.
    let value = format!("{}.{:09}", now.as_secs(), now.subsec_nanos());
    let patch = serde_json::json!({"metadata": {"annotations": {CAUGHT_UP_ANNOTATION: value}}});
    let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
    let call = pods.patch_metadata(me, &params, &patch);
    let pod = tokio::time::timeout_at(deadline, call)
        .await
        .map_err(|_| anyhow::anyhow!("writing to pod {me} timed out"))??;
    Ok(pod.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()))
}

/// The newest resourceVersion of all pods, from a consistent list of their metadata.
async fn listed_newest(pods: &Api<Pod>, deadline: tokio::time::Instant) -> anyhow::Result<Option<u64>> {
    // No resourceVersion: a consistent read, as of now; its pages continue the same snapshot.
    let mut params = ListParams::default().limit(LIST_PAGE);
    let mut newest = 0u64;
    loop {
        let page = tokio::time::timeout_at(deadline, pods.list_metadata(&params))
            .await
            .map_err(|_| anyhow::anyhow!("listing pods took too long"))??;
        for p in &page.items {
            let Ok(v) = p.metadata.resource_version.as_deref().unwrap_or("0").parse::<u64>() else {
                return Ok(None);
            };
            newest = newest.max(v);
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(Some(newest)),
        }
    }
}

/// The longest wait between two look-ups of a pod while the API server does not answer.
const LOOK_UP_BACKOFF: Duration = Duration::from_secs(30);

/// Looks up each pod a re-list did not show though the view holds a reservation for it, and gives
/// the reservation back when the API server no longer holds that pod (that uid): deleted while the
/// pod watch was broken, it would otherwise hold its cards for good, as no event will say it went.
/// A pod still there is left to its events. Asked again, backing off, while the API server fails.
pub async fn look_up_unconfirmed(
    client: Client,
    view: Arc<SharedView>,
    mut unconfirmed: mpsc::UnboundedReceiver<Unconfirmed>,
) {
    while let Some(u) = unconfirmed.recv().await {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &u.namespace);
        let mut wait = Duration::from_millis(500);
        loop {
            match pods.get_opt(&u.name).await {
                Ok(Some(p)) if p.metadata.uid.as_deref() == Some(u.uid.as_str()) => break,
                Ok(_) => {
                    if view.lock().forget_gone(&u.uid) {
                        tracing::info!(
                            pod = %format!("{}/{}", u.namespace, u.name),
                            "gave back the cards reserved for a pod deleted while the pod watch was broken"
                        );
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(pod = %format!("{}/{}", u.namespace, u.name), error = %e, "looking up a reserved pod a re-list did not show failed; asking again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LOOK_UP_BACKOFF);
                }
            }
        }
    }
}

/// Runs the node and pod watches until they end (they only end with the process).
pub async fn run(client: Client, view: Arc<SharedView>, instance: Option<String>, listing: Listing) {
    let reporter = Reporter { controller: "nano-gpu-allocator".into(), instance };
    let recorder = Recorder::new(client.clone(), reporter);
    let (events, warnings) = mpsc::channel(EVENT_QUEUE);
    let (unconfirmed, look_ups) = mpsc::unbounded_channel();
    let nodes = Watch::new(Api::<ViewNode>::all(client.clone()), listing);
    // Each watch logs in a span with its kind: "watch failed" says which.
    let nodes = run_watch(nodes, view.clone(), events.clone(), unconfirmed.clone())
        .instrument(tracing::info_span!("watch", kind = "nodes"));
    let pods = Watch::new(Api::<ViewPod>::all(client.clone()), listing);
    let pods = run_watch(pods, view.clone(), events, unconfirmed)
        .instrument(tracing::info_span!("watch", kind = "pods"));
    futures::join!(nodes, pods, post_events(recorder, warnings), look_up_unconfirmed(client, view, look_ups));
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Node;
    use nano_gpu_engine::engine::Engine;
    use nano_gpu_engine::policy;
    use nano_gpu_engine::workload::Workload;
    use nano_gpu_proto::demand::DemandOptions;
    use serde_json::json;

    fn node(name: &str) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name},
                "status": {"allocatable": {"cpu": "4", "memory": "1Gi", "nano-gpu/gpu-percent": "100"}}}))
        .unwrap()
    }

    fn state() -> ClusterState {
        let engine = Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            policy::by_name("fgd", 0).unwrap(),
            Workload::default(),
        );
        ClusterState::new(engine, 0, DemandOptions::default())
    }

    #[test]
    fn lists_are_streamed_from_kubernetes_1_34_on() {
        assert!(streams("1", "34") && streams("1", "37+") && streams("1", "40"));
        assert!(!streams("1", "33") && !streams("1", "30+") && !streams("", "") && !streams("2", "x"));
    }

    #[test]
    fn a_relist_replaces_the_nodes_and_reports_completion() {
        let mut state = state();
        assert!(!apply_event(&mut state, Event::Apply(ViewNode(node("old")))));
        assert!(!apply_event(&mut state, Event::<ViewNode>::Init));
        assert!(!apply_event(&mut state, Event::InitApply(ViewNode(node("new")))));
        assert!(apply_event(&mut state, Event::<ViewNode>::InitDone));
        let names: Vec<_> =
            state.inspect()["nodes"].as_array().unwrap().iter().map(|n| n["name"].clone()).collect();
        assert_eq!(names, vec![json!("new")]);
    }

    fn versioned_pod(uid: &str, version: &str) -> Pod {
        serde_json::from_value(
            json!({"metadata": {"name": uid, "namespace": "ns", "uid": uid, "resourceVersion": version}}),
        )
        .unwrap()
    }

    /// A pod list whose items have `versions`, as the API server answers a metadata list.
    fn listed(versions: &[&str]) -> serde_json::Value {
        let items: Vec<_> = versions
            .iter()
            .enumerate()
            .map(|(i, v)| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("p{i}"), "namespace": "ns", "resourceVersion": v}}))
            .collect();
        json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {"resourceVersion": "99"}, "items": items})
    }

    /// A watch whose streamed list the API server refuses (`code`) lists in pages from then on, and
    /// the list it gets is the view's; any other failure keeps it streaming.
    async fn refused_stream(code: u16) -> (Listing, Vec<String>) {
        use crate::api_replies::{failure, respond};
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let mut watch =
            Watch::new(Api::<ViewNode>::all(kube::Client::new(svc, "default")), Listing::Streamed);
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            let query = req.uri().query().unwrap_or("").to_owned();
            assert!(query.contains("sendInitialEvents=true") && query.contains("watch=true"), "{query}");
            send.send_response(failure(code, "Invalid"));
            let (req, send) = handle.next_request().await.unwrap();
            let query = req.uri().query().unwrap_or("").to_owned();
            if query.contains("sendInitialEvents=true") {
                // Still streaming: the list comes as a watch's events.
                return;
            }
            assert!(
                query.contains(&format!("limit={LIST_PAGE}")) && !query.contains("watch="),
                "paged: {query}"
            );
            let list = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "7"},
                              "items": [node("a"), node("b")]});
            send.send_response(respond(200, list));
            // The watch from the list's version: it stays open.
            let (req, _open) = handle.next_request().await.unwrap();
            let query = req.uri().query().unwrap_or("").to_owned();
            assert!(query.contains("watch=true") && query.contains("resourceVersion=7"), "{query}");
            std::future::pending::<()>().await;
        });
        let first = watch.next().await;
        assert!(
            matches!(&first, Err(watcher::Error::WatchStartFailed(kube::Error::Api(s))) if s.code == code),
            "{first:?}"
        );
        let listing = watch.listing;
        let mut listed = Vec::new();
        if listing == Listing::Paged {
            loop {
                match watch.next().await {
                    Ok(Some(Event::Init)) => {}
                    Ok(Some(Event::InitApply(n))) => listed.push(n.0.metadata.name.unwrap()),
                    Ok(Some(Event::InitDone)) => break,
                    other => panic!("{other:?}"),
                }
            }
        }
        server.abort();
        (listing, listed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_whose_streamed_list_is_refused_lists_in_pages_from_then_on() {
        for code in [422, 400] {
            assert_eq!(refused_stream(code).await, (Listing::Paged, vec!["a".to_owned(), "b".to_owned()]));
        }
        // A server that fails for another reason may stream its next list.
        assert_eq!(refused_stream(500).await, (Listing::Streamed, Vec::new()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_view_has_caught_up_once_its_watch_showed_the_newest_pod_write_and_no_relist_is_half_done() {
        use crate::api_replies::respond;
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = Newest::List(Api::all(kube::Client::new(svc, "default")));
        let view = Arc::new(SharedView::new(state()));
        view.lock().apply_pod(&versioned_pod("a", "5"));
        let server = tokio::spawn(async move {
            // The newest write is on the second page.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.uri().path(), "/api/v1/pods");
            let query = req.uri().query().unwrap_or("").to_owned();
            assert!(!query.contains("resourceVersion"), "a consistent list: {query}");
            assert!(query.contains(&format!("limit={LIST_PAGE}")), "paged: {query}");
            let mut first = listed(&["3", "5"]);
            first["metadata"]["continue"] = "page-2".into();
            send.send_response(respond(200, first));
            let (req, send) = handle.next_request().await.unwrap();
            assert!(req.uri().query().unwrap_or("").contains("continue=page-2"), "{:?}", req.uri());
            send.send_response(respond(200, listed(&["8"])));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(respond(200, listed(&["4"])));
        });
        let feeder = view.clone();
        let feed = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            // A re-list shows the newest write, but is not done yet.
            {
                let mut state = feeder.lock();
                apply_event(&mut state, Event::<ViewPod>::Init);
                apply_event(&mut state, Event::InitApply(ViewPod(versioned_pod("b", "8"))));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            apply_event(&mut feeder.lock(), Event::<ViewPod>::InitDone);
        });
        let started = tokio::time::Instant::now();
        assert!(caught_up(&pods, &view, Duration::from_secs(5)).await);
        assert!(started.elapsed() >= Duration::from_secs(1), "caught up before the re-list was done");
        feed.await.unwrap();
        // Nothing newer than what the view showed: at once.
        let started = tokio::time::Instant::now();
        assert!(caught_up(&pods, &view, Duration::from_secs(5)).await);
        assert!(started.elapsed() < Duration::from_millis(100));
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_view_that_never_shows_the_newest_write_or_a_failed_list_is_not_caught_up() {
        use crate::api_replies::{failure, respond};
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = Newest::List(Api::all(kube::Client::new(svc, "default")));
        let view = SharedView::new(state());
        view.lock().delete_pod(&versioned_pod("gone", "6"));
        let server = tokio::spawn(async move {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(respond(200, listed(&["7"])));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(failure(500, "InternalError"));
        });
        let started = tokio::time::Instant::now();
        assert!(!caught_up(&pods, &view, Duration::from_secs(3)).await);
        assert!(started.elapsed() >= Duration::from_secs(3));
        assert!(!caught_up(&pods, &view, Duration::from_secs(3)).await);
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_knows_its_pod_catches_up_with_a_write_of_its_own_not_a_list() {
        use crate::api_replies::{body_json, failure, respond};
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let own = Newest::OwnPod(Api::namespaced(kube::Client::new(svc, "default"), "system"), "me".into());
        let view = Arc::new(SharedView::new(state()));
        view.lock().apply_pod(&versioned_pod("a", "5"));
        let server = tokio::spawn(async move {
            let mut values = Vec::new();
            for reply in [
                respond(
                    200,
                    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": "me", "namespace": "system", "resourceVersion": "12"}}),
                ),
                failure(403, "Forbidden"),
            ] {
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("PATCH", "/api/v1/namespaces/system/pods/me")
                );
                let body = body_json(req).await;
                values
                    .push(body["metadata"]["annotations"][CAUGHT_UP_ANNOTATION].as_str().unwrap().to_owned());
                send.send_response(reply);
            }
            assert_ne!(values[0], values[1], "each write changes the pod: {values:?}");
        });
        let feeder = view.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            // Pod writes before ours, then ours.
            feeder.lock().apply_pod(&versioned_pod("b", "11"));
            tokio::time::sleep(Duration::from_millis(500)).await;
            feeder.lock().apply_pod(&versioned_pod("me", "12"));
        });
        let started = tokio::time::Instant::now();
        assert!(caught_up(&own, &view, Duration::from_secs(5)).await);
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "caught up before the watch showed its own write"
        );
        // A write that fails: not caught up (the election asks again next round).
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!caught_up(&own, &view, Duration::from_secs(5)).await);
        server.await.unwrap();
    }

    type ApiHandle =
        tower_test::mock::Handle<http::Request<kube::client::Body>, http::Response<kube::client::Body>>;

    /// A pod list of `pods` (name, resourceVersion) at `version`.
    fn pod_list(pods: &[(&str, &str)], version: &str) -> serde_json::Value {
        let items: Vec<_> = pods.iter().map(|(name, v)| versioned_pod(name, v)).collect();
        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": version}, "items": items})
    }

    /// A view whose nodes are listed and whose pod watch runs against the returned fake API server.
    fn watching_pods() -> (Arc<SharedView>, ApiHandle) {
        let (svc, api) = tower_test::mock::pair();
        let view = Arc::new(SharedView::new(state()));
        view.set_listed(Listed::Nodes);
        let (events, _warnings) = mpsc::channel(8);
        let (unconfirmed, _look_ups) = mpsc::unbounded_channel();
        let pods = Api::<ViewPod>::all(kube::Client::new(svc, "default"));
        tokio::spawn(run_watch(Watch::new(pods, Listing::Paged), view.clone(), events, unconfirmed));
        (view, api)
    }

    /// This replica's pod "me" in "system" as [`Newest::OwnPod`], and the count of its writes, each
    /// answered with resourceVersion `version` (the count ends when the [`Newest`] is dropped).
    fn own_pod_written_at(version: &str) -> (Newest, tokio::task::JoinHandle<usize>) {
        let (svc, mut api): (_, ApiHandle) = tower_test::mock::pair();
        let answer = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "me", "namespace": "system", "resourceVersion": version}});
        let writes = tokio::spawn(async move {
            let mut n = 0;
            while let Some((_, send)) = api.next_request().await {
                n += 1;
                send.send_response(crate::api_replies::respond(200, answer.clone()));
            }
            n
        });
        (Newest::OwnPod(Api::namespaced(kube::Client::new(svc, "default"), "system"), "me".into()), writes)
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_watch_that_shows_nothing_not_even_the_leaders_own_write_lists_again() {
        use crate::api_replies::respond;
        let (view, mut watch_api) = watching_pods();
        let apiserver = tokio::spawn(async move {
            let (req, send) = watch_api.next_request().await.unwrap();
            assert!(!req.uri().query().unwrap_or("").contains("watch="), "a list first: {:?}", req.uri());
            send.send_response(respond(200, pod_list(&[("a", "5"), ("me", "6")], "6")));
            // The watch from there: open, and silent from then on (a connection that died unseen).
            let (req, silent) = watch_api.next_request().await.unwrap();
            let query = req.uri().query().unwrap_or("").to_owned();
            assert!(query.contains("watch=true") && query.contains("resourceVersion=6"), "{query}");
            // Asked to list again: the list shows the leader's write.
            let (req, send) = watch_api.next_request().await.unwrap();
            assert!(!req.uri().query().unwrap_or("").contains("watch="), "listed again: {:?}", req.uri());
            send.send_response(respond(200, pod_list(&[("a", "5"), ("me", "12")], "12")));
            let (req, open) = watch_api.next_request().await.unwrap();
            assert!(req.uri().query().unwrap_or("").contains("resourceVersion=12"), "{:?}", req.uri());
            (silent, open)
        });
        // Both writes of the leader are answered with the version the second list shows.
        let (own, _writes) = own_pod_written_at("12");
        while !view.synced() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!caught_up(&own, &view, Duration::from_secs(5)).await, "the watch showed nothing");
        assert!(caught_up(&own, &view, Duration::from_secs(5)).await, "listed again, it shows the write");
        let _open = apiserver.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_deciding_replicas_pod_watch_that_went_silent_is_listed_again_within_two_periods() {
        use crate::api_replies::respond;
        let (view, mut watch_api) = watching_pods();
        let started = tokio::time::Instant::now();
        let apiserver = tokio::spawn(async move {
            let (_, send) = watch_api.next_request().await.unwrap();
            send.send_response(respond(200, pod_list(&[("a", "5"), ("me", "6")], "6")));
            // The watch, silent from then on (the pod "a" is deleted meanwhile, unseen).
            let (_, silent) = watch_api.next_request().await.unwrap();
            let (req, send) = watch_api.next_request().await.unwrap();
            assert!(!req.uri().query().unwrap_or("").contains("watch="), "listed again: {:?}", req.uri());
            let relisted = started.elapsed();
            send.send_response(respond(200, pod_list(&[("me", "12")], "12")));
            let (_, open) = watch_api.next_request().await.unwrap();
            (relisted, silent, open)
        });
        let (own, writes) = own_pod_written_at("12");
        let check = tokio::spawn(check_pod_watch(
            Arc::new(own),
            view.clone(),
            || true,
            POD_WATCH_CHECK,
            Duration::from_secs(5),
        ));
        let (relisted, _silent, _open) = apiserver.await.unwrap();
        assert!(
            relisted >= POD_WATCH_CHECK && relisted <= 2 * POD_WATCH_CHECK + Duration::from_secs(6),
            "listed again {relisted:?} after the watch went silent"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(view.lock().has_pods_up_to(12), "the view holds what the list showed");
        check.abort();
        assert_eq!(writes.await.unwrap(), 1, "one write: the check that found the watch dead");
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_or_a_watch_that_shows_pods_makes_no_write_to_check_it() {
        let (write_svc, mut write_api) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let view = Arc::new(SharedView::new(state()));
        view.set_listed(Listed::Nodes);
        view.set_listed(Listed::Pods);
        let own = Arc::new(Newest::OwnPod(
            Api::namespaced(kube::Client::new(write_svc, "default"), "system"),
            "me".into(),
        ));
        let leads = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let leading = leads.clone();
        let every = POD_WATCH_CHECK;
        let check = tokio::spawn(check_pod_watch(
            own,
            view.clone(),
            move || leading.load(std::sync::atomic::Ordering::SeqCst),
            every,
            Duration::from_secs(5),
        ));
        // A quiet follower: no write (the phases change between two checks).
        let none = tokio::time::timeout(every * 3 + every / 2, write_api.next_request()).await;
        assert!(none.is_err(), "a follower wrote");
        // A leader whose watch shows a pod every 10 s: no write.
        leads.store(true, std::sync::atomic::Ordering::SeqCst);
        let feeder = view.clone();
        let feed = tokio::spawn(async move {
            for v in 10.. {
                feeder.lock().apply_pod(&versioned_pod("b", &v.to_string()));
                tokio::time::sleep(every / 3).await;
            }
        });
        let none = tokio::time::timeout(every * 5, write_api.next_request()).await;
        assert!(none.is_err(), "a leader whose watch shows pods wrote");
        feed.abort();
        // The same leader, its watch quiet: a write within the next check.
        let (req, _send) = tokio::time::timeout(every * 2 + Duration::from_secs(1), write_api.next_request())
            .await
            .expect("a write once the watch was quiet for a whole period")
            .unwrap();
        assert_eq!(req.method(), "PATCH");
        check.abort();
    }

    /// A pod with `uid` asking `percent` of a card, pending.
    fn gpu_pod(uid: &str, percent: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent}}}]}
        }))
        .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_reserved_pod_a_relist_missed_is_given_back_once_the_api_server_says_it_is_gone() {
        use crate::api_replies::{failure, respond};
        use http::{Request, Response};
        use kube::client::Body;
        let view = Arc::new(SharedView::new(state()));
        let one_card = json!({"v": 1, "gpus": [{"uuid": "GPU-0", "index": 0, "vendor": "nvidia", "model": "Tesla T4", "memoryMiB": 15360, "healthy": true}]});
        let mut n = node("n1");
        n.metadata.annotations = Some([("nano-gpu/gpus".to_owned(), one_card.to_string())].into());
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut state = view.lock();
            state.apply_node(&n);
            state.reserve(&gpu_pod("gone", "60"), "n1", std::time::SystemTime::UNIX_EPOCH).unwrap();
            state.reserve(&gpu_pod("kept", "30"), "n1", std::time::SystemTime::UNIX_EPOCH).unwrap();
            apply_event(&mut state, Event::<ViewPod>::Init);
            apply_event(&mut state, Event::<ViewPod>::InitDone);
            for u in state.take_unconfirmed() {
                tx.send(u).unwrap();
            }
        }
        drop(tx);
        let used = |view: &SharedView| view.lock().inspect()["nodes"][0]["cards"][0]["percentUsed"].clone();
        assert_eq!(used(&view), 90);
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let server = tokio::spawn(async move {
            // "gone" is not found; "kept" is asked while the API server is away, then again.
            let mut paths = Vec::new();
            while paths.len() < 3 {
                let (req, send) = handle.next_request().await.unwrap();
                let path = req.uri().path().to_owned();
                send.send_response(match path.as_str() {
                    "/api/v1/namespaces/ns/pods/gone" => failure(404, "NotFound"),
                    "/api/v1/namespaces/ns/pods/kept" if !paths.contains(&path) => {
                        failure(503, "ServiceUnavailable")
                    }
                    _ => respond(200, serde_json::to_value(gpu_pod("kept", "30")).unwrap()),
                });
                paths.push(path);
            }
            paths.sort();
            paths
        });
        tokio::time::timeout(Duration::from_secs(60), look_up_unconfirmed(client, view.clone(), rx))
            .await
            .expect("every pod looked up");
        let paths = server.await.unwrap();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/ns/pods/gone",
                "/api/v1/namespaces/ns/pods/kept",
                "/api/v1/namespaces/ns/pods/kept"
            ]
        );
        assert_eq!(used(&view), 30, "the gone pod's 60 % given back, the pod still there kept");
    }

    #[test]
    fn the_view_is_synced_only_once_both_kinds_listed_not_after_two_node_lists() {
        let view = SharedView::new(state());
        // The node watch lists, breaks and lists again before the pod list completes.
        view.set_listed(<ViewNode as Feed>::KIND);
        view.set_listed(<ViewNode as Feed>::KIND);
        assert!(!view.synced());
        view.set_listed(<ViewPod as Feed>::KIND);
        assert!(view.synced());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_event_post_delays_only_the_events_after_it_by_its_timeout() {
        use http::{Request, Response};
        use kube::client::Body;
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let recorder = Recorder::new(client, Reporter { controller: "test".into(), instance: None });
        let (events, warnings) = mpsc::channel(EVENT_QUEUE);
        let warning = |name: &str| Warning {
            kind: "Pod",
            namespace: "ns".into(),
            name: name.into(),
            reason: nano_gpu_proto::events::Reason::InvalidAssignment,
            message: "m".into(),
        };
        // Queued without waiting, as the watch loop does.
        events.try_send(warning("first")).unwrap();
        events.try_send(warning("second")).unwrap();
        drop(events);
        let poster = tokio::spawn(post_events(recorder, warnings));
        let started = tokio::time::Instant::now();
        let (first, _never_answered) = handle.next_request().await.unwrap();
        assert!(String::from_utf8_lossy(&first.into_body().collect_bytes().await.unwrap()).contains("first"));
        let (second, answer) = handle.next_request().await.unwrap();
        assert!(started.elapsed() >= EVENT_TIMEOUT, "the second waited for the first's timeout");
        let body = second.into_body().collect_bytes().await.unwrap();
        assert!(String::from_utf8_lossy(&body).contains("second"));
        answer.send_response(Response::builder().status(201).body(Body::from(body.to_vec())).unwrap());
        poster.await.unwrap();
    }
}
