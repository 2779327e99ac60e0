//! The extender HTTP service: decode, call the cluster view, encode.
//!
//! `POST /filter`, `/prioritize`, `/bind` (kube-scheduler's extender verbs; only the leader
//! decides), `GET /healthz`, `/readyz` (ready once the watches have listed everything, leader or
//! not), `/metrics` (Prometheus text), `/inspect` (JSON per node and card), `POST /preempt` (only
//! nodes where eviction really frees a card, only the victims needed), `POST /mutate` (the admission
//! webhook).

use crate::decide::admission::Admission;
use crate::service::bind::{self, InFlight, NOT_LEADER};
use crate::service::bind_api::Binder;
use crate::service::handoff::Handoff;
use crate::service::leader::Leadership;
use crate::service::metrics::{Metrics, Scrape, Verb, ViewGauges};
use crate::state::{ClusterState, SharedView};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_proto::admission::AdmissionReview;
use nano_gpu_proto::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, MetaPod, MetaVictims, for_scheduler,
};
use nano_gpu_proto::install::SCHEDULER_NAME;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// Everything the handlers share.
pub struct Shared<B> {
    /// The cluster view (the watches write through this).
    pub view: Arc<SharedView>,
    binder: B,
    /// Call counters and latencies.
    pub metrics: Metrics,
    /// Whether this replica may decide (always, unless leader election says otherwise).
    pub leader: Arc<Leadership>,
    /// The pods whose bind is running.
    binds: InFlight,
    /// The pod the last filter passed, whose bind the next filter waits for (with
    /// [`FilterAnswers::Fitting`]).
    handoff: Handoff,
    filter_answers: FilterAnswers,
    admission: Admission,
}

/// What `POST /filter` answers when nodes fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FilterAnswers {
    /// The one node the policy chooses, its cards held for the bind at once
    /// ([`ClusterState::choose_names`]): kube-scheduler then binds it without scoring nodes or calling
    /// prioritize. Its own preferences (preferred affinity, topology spread's `ScheduleAnyway`, image
    /// locality) do not weigh in for GPU pods; its hard constraints do (the candidates passed its
    /// filters).
    #[default]
    One,
    /// Every node that fits; prioritize gives the policy's choice 10, which kube-scheduler adds to
    /// its own scores. The next pod's filter waits for the last one's bind ([`crate::service::handoff`]).
    Fitting,
}

impl<B: Binder> Shared<B> {
    /// The same handlers, with the webhook setting `name` as the pods' scheduler (call before sharing).
    pub fn with_scheduler_name(mut self: Arc<Self>, name: &str) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.admission.scheduler_name = name.to_owned();
        }
        self
    }

    /// GPU pods that name no RuntimeClass get `class` at admission (call before sharing).
    pub fn with_runtime_class(mut self: Arc<Self>, class: Option<&str>) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.admission.runtime_class = class.map(str::to_owned);
        }
        self
    }

    /// The tolerations the webhook gives GPU pods that lack them (call before sharing).
    pub fn with_tolerations(
        mut self: Arc<Self>,
        tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    ) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.admission.tolerations = tolerations;
        }
        self
    }

    /// Which GPU pods the webhook turns into pods with claims (call before sharing).
    pub fn with_shares(mut self: Arc<Self>, shares: crate::decide::admission::Shares) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.admission.shares = shares;
        }
        self
    }

    /// What the filter answers (call before sharing).
    pub fn with_filter_answers(mut self: Arc<Self>, answers: FilterAnswers) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.filter_answers = answers;
        }
        self
    }

    /// The same handlers, deciding only while `leadership` says so (call before sharing).
    pub fn with_leadership(mut self: Arc<Self>, leadership: Arc<Leadership>) -> Arc<Self> {
        if let Some(s) = Arc::get_mut(&mut self) {
            s.leader = leadership;
        }
        self
    }

    /// Handlers over `state`, binding through `binder`.
    pub fn new(state: ClusterState, binder: B) -> Arc<Self> {
        let admission = Admission {
            scheduler_name: SCHEDULER_NAME.to_owned(),
            demand: *state.extender().demand_options(),
            runtime_class: None,
            shares: crate::decide::admission::Shares::DevicePlugin,
            tolerations: Vec::new(),
        };
        Arc::new(Shared {
            admission,
            view: Arc::new(SharedView::new(state)),
            binder,
            metrics: Metrics::default(),
            leader: Arc::new(Leadership::always()),
            binds: InFlight::default(),
            handoff: Handoff::default(),
            filter_answers: FilterAnswers::default(),
        })
    }

    /// The cluster view, for one decision.
    pub fn state(&self) -> MutexGuard<'_, ClusterState> {
        self.view.lock()
    }
}

/// Every second: gives back the cards of filters whose bind did not come in time and ends the
/// nominations past their limit ([`ClusterState::expire_filter_holds`]), and ends the pauses of
/// nodes whose kubelet refused a share ([`ClusterState::expire_kubelet_refusals`]).
pub async fn expire_filter_holds(view: Arc<SharedView>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut view = view.lock();
        view.expire_filter_holds(Instant::now());
        view.expire_kubelet_refusals(Instant::now());
    }
}

/// The extender's verbs, for kube-scheduler only (on the pod's loopback, or over HTTPS to clients
/// with a certificate), and the [`public_router`]'s routes. A request a web page could have sent is
/// refused ([`refuse_browsers`]): an operator's `kubectl port-forward` to this port must not let a
/// page in their browser bind pods.
pub fn router<B: Binder>(shared: Arc<Shared<B>>) -> Router {
    Router::new()
        .route("/filter", post(filter::<B>))
        .route("/prioritize", post(prioritize::<B>))
        .route("/bind", post(bind::<B>))
        .route("/preempt", post(preempt::<B>))
        .with_state(shared.clone())
        .layer(axum::middleware::from_fn(refuse_browsers))
        .layer(axum::middleware::from_fn(in_request_span))
        .merge(public_router(shared))
}

/// What an operator reads, on a loopback port of its own (`--operator-listen`, reached with
/// `kubectl port-forward`): `/inspect` and the GPU map (`/map`, [`crate::service::map_page`]).
/// Only reads: a port-forward for the map reaches no verb.
pub fn operator_router<B: Binder>(shared: Arc<Shared<B>>) -> Router {
    Router::new()
        .route("/inspect", get(inspect::<B>))
        .route("/map", get(crate::service::map_page::page))
        .route("/map/app.js", get(crate::service::map_page::script))
        .route("/map/data", get(map_data::<B>))
        .with_state(shared)
        .layer(axum::middleware::from_fn(in_request_span))
}

/// Refuses (403) a request that a web page could have made: see [`browser_made`].
async fn refuse_browsers(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match browser_made(request.method(), request.headers()) {
        Some(why) => (StatusCode::FORBIDDEN, format!("refused: {why}\n")).into_response(),
        None => next.run(request).await,
    }
}

/// Why a request to an extender verb looks made by a browser, if it does. kube-scheduler sends
/// `Content-Type: application/json` and none of a browser's headers; a page can send a POST to any
/// address without asking first only as `text/plain`, a form or multipart, and a browser marks what
/// it sends with `Origin` and `Sec-Fetch-*`.
pub fn browser_made(method: &http::Method, headers: &HeaderMap) -> Option<String> {
    if headers.contains_key(header::ORIGIN) {
        return Some("the request has an Origin header, as a web page's has".into());
    }
    if let Some(name) = headers.keys().find(|name| name.as_str().starts_with("sec-fetch-")) {
        return Some(format!("the request has a browser's {name} header"));
    }
    if method == http::Method::POST {
        let ctype =
            headers.get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let essence = ctype.as_deref().and_then(|t| t.split(';').next()).map(str::trim);
        if !essence.is_some_and(|t| t.eq_ignore_ascii_case("application/json")) {
            let sent = ctype.unwrap_or_else(|| "missing".into());
            return Some(format!("the extender takes Content-Type application/json, not {sent}"));
        }
    }
    None
}

/// Refuses (403) a request whose `Host` names anything but a loopback address or `localhost`: a
/// listener on the pod's loopback is reached from outside only through `kubectl port-forward`, and a
/// page served from another name that resolves to 127.0.0.1 (DNS rebinding) would read it as its own.
pub async fn loopback_host_only(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let host =
        request.headers().get(header::HOST).map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let host = host.or_else(|| request.uri().authority().map(|a| a.to_string()));
    match host {
        Some(h) if !is_loopback_host(&h) => {
            let why =
                format!("refused: Host {h:?} is not this pod's loopback (127.0.0.1, [::1] or localhost)\n");
            (StatusCode::FORBIDDEN, why).into_response()
        }
        _ => next.run(request).await,
    }
}

/// Whether `host` (a `Host` header: `NAME[:PORT]` or `[IPV6][:PORT]`) is a loopback address or
/// `localhost`.
pub fn is_loopback_host(host: &str) -> bool {
    let (loopback, port) = match host.strip_prefix('[') {
        Some(bracketed) => match bracketed.split_once(']') {
            Some((v6, port)) => (v6.parse::<std::net::Ipv6Addr>().is_ok_and(|ip| ip.is_loopback()), port),
            None => return false,
        },
        None => {
            let (name, port) = host.find(':').map_or((host, ""), |i| host.split_at(i));
            let name = name.strip_suffix('.').unwrap_or(name);
            let loopback = name.eq_ignore_ascii_case("localhost")
                || name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback());
            (loopback, port)
        }
    };
    loopback && (port.is_empty() || port.strip_prefix(':').is_some_and(|p| p.parse::<u16>().is_ok()))
}

/// What the webhook's HTTPS port serves: `/mutate` for the API server and `/healthz`. Any pod may
/// reach that port (the API server has no namespace a NetworkPolicy could select), so `/metrics` and
/// `/readyz` stay on the [`public_router`]'s port, which NetworkPolicies can close.
pub fn webhook_router<B: Binder>(shared: Arc<Shared<B>>) -> Router {
    Router::new()
        .route("/mutate", post(mutate::<B>))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(shared)
        .layer(axum::middleware::from_fn(in_request_span))
}

/// What anyone who reaches the pod may call: probes, `/metrics` (counts, latencies and per-card
/// allocation by node; no pod names) and the webhook (it answers a patch, changes nothing).
pub fn public_router<B: Binder>(shared: Arc<Shared<B>>) -> Router {
    Router::new()
        .route("/mutate", post(mutate::<B>))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz::<B>))
        .route("/metrics", get(metrics::<B>))
        .with_state(shared)
        .layer(axum::middleware::from_fn(in_request_span))
}

/// Every request's handling in a `request` span with its method and path (`POST /bind`), so what
/// a handler logs says which verb it serves, and the pod it is about (`namespace/name`), which the
/// handler records once it has read the body ([`for_pod`]).
async fn in_request_span(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        pod = tracing::field::Empty
    );
    next.run(request).instrument(span).await
}

/// Records on the current request's span the pod its body names (formatted only where a subscriber
/// writes it: nothing is allocated on the request path for it).
fn for_pod(namespace: Option<&str>, name: Option<&str>) {
    if let Some(name) = name {
        let namespace = namespace.unwrap_or_default();
        tracing::Span::current().record("pod", tracing::field::display(format_args!("{namespace}/{name}")));
    }
}

/// [`for_pod`] of a Pod the body carries.
fn for_pod_of(pod: Option<&Pod>) {
    if let Some(pod) = pod {
        for_pod(pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref());
    }
}

fn decode<T: DeserializeOwned>(body: &Bytes, what: &str) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("invalid {what}: {e}\n"))
}

/// A body that is not what the verb takes: counted as an error, answered 400 with the reason.
fn rejected<B>(s: &Shared<B>, verb: Verb, started: Instant, message: String) -> Response {
    s.metrics.observe(verb, false, started.elapsed());
    (StatusCode::BAD_REQUEST, message).into_response()
}

fn json<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A filter or prioritize body.
enum Candidates<'a> {
    /// `NodeNames` borrowed from the body (no allocation per name): the common case. Node names need
    /// no JSON escapes; a body that has them, or carries `Nodes`, is read owned.
    Borrowed(Option<Pod>, Vec<&'a str>),
    /// Anything else.
    Owned(ExtenderArgs),
}

impl Candidates<'_> {
    /// The pod the body asks about.
    fn pod(&self) -> Option<&Pod> {
        match self {
            Candidates::Borrowed(pod, _) => pod.as_ref(),
            Candidates::Owned(args) => args.pod.as_ref(),
        }
    }
}

fn candidates(body: &Bytes) -> Result<Candidates<'_>, String> {
    if let Ok(ExtenderArgs { pod, nodes: None, node_names: Some(names) }) = serde_json::from_slice(body) {
        return Ok(Candidates::Borrowed(pod, names));
    }
    decode(body, "ExtenderArgs").map(Candidates::Owned)
}

/// How long a filter that reaches a replica which does not decide waits for it to. kube-scheduler
/// calls the allocator of its own pod, and schedules only while it holds its own Lease: a call to a
/// replica that does not decide comes right after its kube-scheduler took over, and the replica takes
/// the allocator's Lease at its next attempt (within a seventh of the lease, about 2 s) and catches
/// up. Refused at once, the pod backs off (`hack/bench-scale.sh`'s failover at 300 nodes: the next
/// replica led 3.8 s after the leader was stopped and the pod was bound 2.5 s after that; with this
/// wait, bound 3.2 s after the stop). Well below kube-scheduler's 10 s `httpTimeout`.
pub const LEAD_WAIT: Duration = Duration::from_secs(5);

/// Whether this replica decides, now or within [`LEAD_WAIT`].
async fn leads_soon(leader: &Leadership) -> bool {
    let until = tokio::time::Instant::now() + LEAD_WAIT;
    while !leader.is_leader() {
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

async fn filter<B: Binder>(State(s): State<Arc<Shared<B>>>, body: Bytes) -> Response {
    let started = Instant::now();
    let args = match candidates(&body) {
        Ok(a) => a,
        Err(e) => return rejected(&s, Verb::Filter, started, e),
    };
    if !leads_soon(&s.leader).await {
        s.metrics.observe(Verb::Filter, false, started.elapsed());
        let error = NOT_LEADER.to_owned();
        return json(&ExtenderFilterResult::<String> {
            node_names: Some(Vec::new()),
            error,
            ..Default::default()
        });
    }
    for_pod_of(args.pod());
    let uid = args.pod().and_then(|p| p.metadata.uid.clone()).unwrap_or_default();
    let one = s.filter_answers == FilterAnswers::One;
    if !one {
        s.handoff.before_filter(&uid).await;
    }
    let (ok, passed, response) = match args {
        Candidates::Borrowed(pod, names) => {
            let result = match one {
                true => s.state().choose_names(pod.as_ref(), names, Instant::now()),
                false => s.state().filter_names(pod.as_ref(), names),
            };
            let result = crate::decide::extender::unresolvable_for_scheduler(result);
            (result.error.is_empty(), result.passed(), json(&result))
        }
        Candidates::Owned(args) => {
            let result = match one {
                true => s.state().choose(args, Instant::now()),
                false => s.state().filter(args),
            };
            let result = crate::decide::extender::unresolvable_for_scheduler(result);
            (result.error.is_empty(), result.passed(), json(&result))
        }
    };
    if passed > 0 && !uid.is_empty() && !one {
        s.handoff.passed(&uid);
    }
    s.metrics.observe(Verb::Filter, ok, started.elapsed());
    response
}

async fn prioritize<B: Binder>(State(s): State<Arc<Shared<B>>>, body: Bytes) -> Response {
    let started = Instant::now();
    let args = match candidates(&body) {
        Ok(a) => a,
        Err(e) => return rejected(&s, Verb::Prioritize, started, e),
    };
    for_pod_of(args.pod());
    if !s.leader.is_leader() {
        s.metrics.observe(Verb::Prioritize, false, started.elapsed());
        return (StatusCode::SERVICE_UNAVAILABLE, NOT_LEADER).into_response();
    }
    let response = match args {
        Candidates::Borrowed(pod, names) => json(&s.state().prioritize_names(pod.as_ref(), names)),
        Candidates::Owned(args) => json(&s.state().prioritize(args)),
    };
    s.metrics.observe(Verb::Prioritize, true, started.elapsed());
    response
}

async fn bind<B: Binder>(State(s): State<Arc<Shared<B>>>, body: Bytes) -> Response {
    let started = Instant::now();
    let args: ExtenderBindingArgs = match decode(&body, "ExtenderBindingArgs") {
        Ok(a) => a,
        Err(e) => return rejected(&s, Verb::Bind, started, e),
    };
    for_pod(Some(&args.pod_namespace), Some(&args.pod_name));
    // On a task of its own (in this request's span): a bind runs to its end (and settles) even if
    // kube-scheduler hangs up.
    let task = {
        use tracing::Instrument;
        let (s, args) = (s.clone(), args.clone());
        tokio::spawn(
            async move { bind::bind(&s.view, &s.binder, &s.leader, &s.binds, &s.handoff, &args).await }
                .instrument(tracing::Span::current()),
        )
    };
    let result = task.await.unwrap_or_else(|e| Err(bind::BindFailed::Task(e.to_string())));
    s.metrics.observe(Verb::Bind, result.is_ok(), started.elapsed());
    let error = match result {
        Ok(()) => {
            tracing::info!(verb = "bind", node = %args.node, "bound");
            String::new()
        }
        Err(e) => {
            tracing::warn!(verb = "bind", node = %args.node, error = %e, "bind failed");
            for_scheduler(&e.to_string())
        }
    };
    json(&ExtenderBindingResult { error })
}

/// The mutating admission webhook (the API server reaches it over HTTPS, `tls::serve`, with the same
/// routes).
async fn mutate<B: Binder>(State(s): State<Arc<Shared<B>>>, body: Bytes) -> Response {
    match decode::<AdmissionReview>(&body, "AdmissionReview") {
        Ok(review) => {
            if let Some(request) = &review.request {
                // A pod being created may have only a generateName yet.
                let meta = request.object.as_ref().and_then(|o| o.get("metadata"));
                let name = ["name", "generateName"].iter().find_map(|k| meta?.get(*k)?.as_str());
                for_pod(request.namespace.as_deref(), name);
            }
            json(&s.admission.review(&review))
        }
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

/// `POST /preempt`: keeps only the nodes (and victims) where eviction really frees a card.
async fn preempt<B: Binder>(State(s): State<Arc<Shared<B>>>, body: Bytes) -> Response {
    let args: ExtenderPreemptionArgs = match decode(&body, "ExtenderPreemptionArgs") {
        Ok(a) => a,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    if !s.leader.is_leader() {
        return (StatusCode::SERVICE_UNAVAILABLE, NOT_LEADER).into_response();
    }
    let Some(pod) = args.pod.as_ref() else {
        return (StatusCode::BAD_REQUEST, "ExtenderPreemptionArgs has no Pod\n").into_response();
    };
    for_pod_of(Some(pod));
    // nodeCacheCapable sends victims by UID; otherwise whole pods, reduced here to their UIDs.
    let proposed: BTreeMap<String, MetaVictims> =
        match (&args.node_name_to_meta_victims, &args.node_name_to_victims) {
            (Some(meta), _) => meta.clone(),
            (None, Some(full)) => full
                .iter()
                .map(|(node, v)| {
                    let pods = v
                        .pods
                        .iter()
                        .filter_map(|p| p.metadata.uid.clone())
                        .map(|uid| MetaPod { uid })
                        .collect();
                    (node.clone(), MetaVictims { pods, num_pdb_violations: v.num_pdb_violations })
                })
                .collect(),
            (None, None) => BTreeMap::new(),
        };
    let result = s.state().preempt(pod, &proposed);
    match result {
        Ok(kept) => json(&ExtenderPreemptionResult { node_name_to_meta_victims: Some(kept) }),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

/// Ready = can serve: the view has listed everything. A follower is ready too (it serves the webhook,
/// and rollouts, PDBs and drains need it Ready); the extender's calls reach only the leader, whose pod
/// is where they come from (kube-scheduler of the same pod, on loopback), and a follower asked anyway
/// decides nothing.
async fn readyz<B: Binder>(State(s): State<Arc<Shared<B>>>) -> Response {
    if s.view.synced() {
        let role = if s.leader.is_leader() { "leader" } else { "follower" };
        (StatusCode::OK, format!("ready ({role})\n")).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "waiting for the node and pod watches to list everything\n")
            .into_response()
    }
}

async fn metrics<B: Binder>(State(s): State<Arc<Shared<B>>>) -> Response {
    // What the text needs is copied under the view's lock; the fragmentation and the text after.
    let taken = {
        let state = s.state();
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let (waiting, oldest_waiting_seconds) = state.waiting_now(now);
        let load_cards = state.load_cards();
        let gauges =
            ViewGauges { leading: s.leader.is_leader(), waiting, oldest_waiting_seconds, load_cards };
        Scrape::taken(state.extender().engine(), gauges)
    };
    let text = s.metrics.render(&taken.rows());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn map_data<B: Binder>(State(s): State<Arc<Shared<B>>>, headers: HeaderMap) -> Response {
    // The view's lock is let go before the document is written out.
    let data = crate::service::map_page::data(&mut s.state(), headers.get(header::IF_NONE_MATCH));
    data.respond()
}

async fn inspect<B: Binder>(State(s): State<Arc<Shared<B>>>) -> Response {
    // The view's lock is let go before the document is written out.
    let doc = s.state().inspect_doc();
    json(&doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::bind_api::ApiError;
    use axum::body::Body;
    use http::Request;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use nano_gpu_engine::engine::Engine;
    use nano_gpu_engine::policy;
    use nano_gpu_engine::workload::Workload;
    use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
    use nano_gpu_proto::demand::DemandOptions;
    use serde_json::{Value, json};
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, SystemTime};
    use tower::ServiceExt;

    /// A hand-written fake of the API calls: records them, keeps the pods they write (each write a new
    /// resourceVersion), binds as kube-apiserver does (the node and the Binding's annotations in one
    /// write, refused for a pod bound already), and fails or waits on demand.
    #[derive(Default)]
    struct FakeBinder {
        calls: Mutex<Vec<String>>,
        pods: Mutex<HashMap<String, Pod>>,
        fail_bind: AtomicBool,
        /// The binding is made, but its answer is lost (a timeout).
        lose_bind_answer: AtomicBool,
        /// The binding is not made, and no answer comes (a broken connection).
        drop_bind: AtomicBool,
        /// Reads fail after a binding was tried (the API server went away).
        unreadable_after_bind: AtomicBool,
        /// Another writer's binding to n1 with this assignment, made when a binding is tried.
        bound_by_another: Mutex<Option<String>>,
        /// How long a binding takes to be made, the first `slow_binds` times: its answer never comes,
        /// and the API server makes it that long after it was sent.
        bind_delay: Mutex<Duration>,
        slow_binds: AtomicUsize,
        /// Bindings the API server still works on: when each is made, the pod, node and annotations.
        late: Mutex<Vec<LateBinding>>,
        written: Mutex<Vec<BTreeMap<String, String>>>,
    }

    /// A binding the fake API server makes later: when, the pod, the node and the annotations.
    type LateBinding = (tokio::time::Instant, String, String, BTreeMap<String, String>);

    impl FakeBinder {
        fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }

        /// Changes a stored pod as a write does: a new resourceVersion.
        fn change(&self, name: &str, write: impl FnOnce(&mut Pod)) {
            if let Some(p) = self.pods.lock().unwrap().get_mut(name) {
                write(p);
                let rv = p.metadata.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok());
                p.metadata.resource_version = Some((rv.unwrap_or(0) + 1).to_string());
            }
        }

        fn assignment(&self, name: &str) -> Option<String> {
            let pods = self.pods.lock().unwrap();
            pods.get(name)?.metadata.annotations.as_ref()?.get(ASSIGNMENT_ANNOTATION).cloned()
        }

        /// Makes the late bindings whose time has come (each refused if the pod is bound by then).
        fn land_due(&self) {
            let now = tokio::time::Instant::now();
            let due: Vec<_> = {
                let mut late = self.late.lock().unwrap();
                let (due, rest) = late.drain(..).partition(|l| l.0 <= now);
                *late = rest;
                due
            };
            for (_, name, node, annotations) in due {
                let _refused_if_bound = self.apply_binding(&name, &node, &annotations);
            }
        }

        fn node_of(&self, name: &str) -> Option<String> {
            self.pods.lock().unwrap().get(name)?.spec.as_ref()?.node_name.clone()
        }

        /// kube-apiserver's binding: refused for a pod bound already, else node and annotations at once.
        fn apply_binding(
            &self,
            name: &str,
            node: &str,
            annotations: &BTreeMap<String, String>,
        ) -> Result<(), ApiError> {
            if let Some(on) = self.node_of(name) {
                return Err(ApiError::Refused(format!("pod {name} is already assigned to node \"{on}\"")));
            }
            self.change(name, |p| {
                p.spec.get_or_insert_default().node_name = Some(node.to_owned());
                p.metadata.annotations.get_or_insert_default().extend(annotations.clone());
            });
            Ok(())
        }
    }

    impl Binder for FakeBinder {
        async fn get_pod(&self, ns: &str, name: &str) -> Result<Pod, ApiError> {
            self.calls.lock().unwrap().push(format!("get {ns}/{name}"));
            self.land_due();
            let tried = self.calls().iter().any(|c| c.starts_with("bind "));
            if tried && self.unreadable_after_bind.load(Ordering::SeqCst) {
                return Err(ApiError::Timeout(crate::service::bind_api::CALL_TIMEOUT));
            }
            self.pods.lock().unwrap().get(name).cloned().ok_or_else(|| ApiError::NotFound(name.into()))
        }

        async fn bind(
            &self,
            _: &str,
            name: &str,
            _: &str,
            node: &str,
            annotations: &BTreeMap<String, String>,
        ) -> Result<(), ApiError> {
            self.calls.lock().unwrap().push(format!("bind {name} {node}"));
            self.land_due();
            self.written.lock().unwrap().push(annotations.clone());
            if let Some(theirs) = self.bound_by_another.lock().unwrap().take() {
                self.apply_binding(name, "n1", &[(ASSIGNMENT_ANNOTATION.to_owned(), theirs)].into())?;
            }
            if self.fail_bind.load(Ordering::SeqCst) {
                return Err(ApiError::Refused("binding refused".into()));
            }
            if self.drop_bind.load(Ordering::SeqCst) {
                return Err(ApiError::Unanswered("connection reset by peer".into()));
            }
            let slow = self
                .slow_binds
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if slow {
                let at = tokio::time::Instant::now() + *self.bind_delay.lock().unwrap();
                self.late.lock().unwrap().push((at, name.to_owned(), node.to_owned(), annotations.clone()));
                return std::future::pending().await;
            }
            self.apply_binding(name, node, annotations)?;
            if self.lose_bind_answer.load(Ordering::SeqCst) {
                return Err(ApiError::Timeout(crate::service::bind_api::CALL_TIMEOUT));
            }
            Ok(())
        }
    }

    fn pod(uid: &str, rv: &str, node: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid, "resourceVersion": rv},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": "60"}}}]}
        }))
        .unwrap()
    }

    fn shared() -> Arc<Shared<FakeBinder>> {
        shared_with(DemandOptions::default())
    }

    fn shared_with(demand: DemandOptions) -> Arc<Shared<FakeBinder>> {
        let engine = Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            policy::by_name("fgd-balance", 0).unwrap(),
            Workload::default(),
        );
        let mut state = ClusterState::new(engine, 1, demand);
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "annotations": {"nano-gpu/gpus":
                r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-0","vendor":"nvidia","model":"T4","memoryMiB":15360,"healthy":true}]}"#}},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "nano-gpu/gpu-percent": "100"}}
        }))
        .unwrap();
        state.apply_node(&node);
        Shared::new(state, FakeBinder::default())
    }

    async fn call(
        s: &Arc<Shared<FakeBinder>>,
        method: &str,
        path: &str,
        body: Value,
    ) -> (StatusCode, String) {
        call_raw(s, method, path, &body.to_string()).await
    }

    /// [`call`] with a body that need not be JSON.
    async fn call_raw(
        s: &Arc<Shared<FakeBinder>>,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        let resp = match path.starts_with("/inspect") || path.starts_with("/map") {
            true => operator_router(s.clone()).oneshot(req).await.unwrap(),
            false => router(s.clone()).oneshot(req).await.unwrap(),
        };
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    fn free(s: &Arc<Shared<FakeBinder>>) -> u32 {
        s.state().extender().engine().cluster().node(nano_gpu_engine::model::NodeId(0)).cards[0].free.0
    }

    fn binding(uid: &str) -> Value {
        json!({"PodName": uid, "PodNamespace": "ns", "PodUID": uid, "Node": "n1"})
    }

    #[tokio::test]
    async fn a_gpushare_pod_gets_the_annotations_gpushare_wrote_and_nothing_on_failure() {
        let s = shared_with(DemandOptions { gpushare: Some(nano_gpu_proto::demand::GpushareUnit::GiB) });
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "g", "namespace": "ns", "uid": "g", "resourceVersion": "1"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}
        }))
        .unwrap();
        s.binder.pods.lock().unwrap().insert("g".into(), p);
        s.binder.fail_bind.store(true, Ordering::SeqCst);
        call(&s, "POST", "/bind", binding("g")).await;
        let written = s.binder.written.lock().unwrap().clone();
        let set = &written[0];
        assert_eq!(set["ALIYUN_COM_GPU_MEM_IDX"], "0");
        assert_eq!(set["ALIYUN_COM_GPU_MEM_POD"], "3");
        assert_eq!(set["ALIYUN_COM_GPU_MEM_DEV"], "15");
        assert_eq!(set["ALIYUN_COM_GPU_MEM_ASSIGNED"], "false");
        assert!(set["ALIYUN_COM_GPU_MEM_ASSUME_TIME"].len() >= 19);
        let assignment: Value = serde_json::from_str(&set[ASSIGNMENT_ANNOTATION]).unwrap();
        // 3 GiB of a 15 GiB card: 20 %.
        assert_eq!(assignment["containers"]["c"][0]["percent"], 20);
        // The refused binding left nothing on the pod, and its cards are given back.
        assert_eq!(s.binder.assignment("g"), None);
        assert_eq!(free(&s), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_that_is_not_the_leader_decides_nothing_but_is_ready_to_serve() {
        let s = shared();
        s.view.set_synced();
        let s = s.with_leadership(Arc::new(Leadership::elected()));
        assert_eq!(
            call(&s, "GET", "/readyz", json!(null)).await,
            (StatusCode::OK, "ready (follower)\n".into())
        );
        let args = json!({"Pod": pod("a", "7", None), "NodeNames": ["n1"]});
        let (_, body) = call(&s, "POST", "/filter", args.clone()).await;
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((r["Error"].as_str(), r["NodeNames"].clone()), (Some(NOT_LEADER), json!([])));
        assert_eq!(call(&s, "POST", "/prioritize", args).await.0, StatusCode::SERVICE_UNAVAILABLE);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert!(body.contains("not the leader"));
        assert!(s.binder.calls().is_empty());
        assert_eq!(free(&s), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn a_filter_that_comes_while_the_replica_takes_over_waits_for_it_and_decides() {
        let s = shared();
        s.view.set_synced();
        let leadership = Arc::new(Leadership::elected());
        let s = s.with_leadership(leadership.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            leadership.hold_until(tokio::time::Instant::now() + Duration::from_secs(60));
        });
        let started = tokio::time::Instant::now();
        let args = json!({"Pod": pod("a", "7", None), "NodeNames": ["n1"]});
        let (_, body) = call(&s, "POST", "/filter", args).await;
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((r["Error"].as_str(), r["NodeNames"].clone()), (Some(""), json!(["n1"])), "{body}");
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(2) && waited < LEAD_WAIT, "{waited:?}");
    }

    #[tokio::test]
    async fn the_webhook_route_answers_reviews() {
        let s = shared();
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r1", "operation": "CREATE", "object": pod("a", "1", None)}});
        let (status, body) = call(&s, "POST", "/mutate", review).await;
        assert_eq!(status, StatusCode::OK);
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (r["response"]["uid"].as_str(), r["response"]["allowed"].as_bool()),
            (Some("r1"), Some(true))
        );
        assert_eq!(r["response"]["patchType"], "JSONPatch");
        assert_eq!(call(&s, "POST", "/mutate", json!("nonsense")).await.0, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn the_webhook_gives_pods_the_configured_scheduler() {
        let s = shared().with_scheduler_name("default-scheduler");
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r1", "operation": "CREATE", "object": pod("a", "1", None)}});
        let (_, body) = call(&s, "POST", "/mutate", review).await;
        let r: Value = serde_json::from_str(&body).unwrap();
        let want = json!([{"op": "add", "path": "/spec/schedulerName", "value": "default-scheduler"}]);
        assert_eq!(r["response"]["patch"], nano_gpu_proto::admission::base64(want.to_string().as_bytes()));
    }

    #[tokio::test]
    async fn bad_json_is_a_400_with_a_message() {
        let s = shared();
        let (status, body) = call_raw(&s, "POST", "/filter", "{nope").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.starts_with("invalid ExtenderArgs: key must be a string"), "{body}");
        let (status, _) = call(&s, "POST", "/bind", json!({"PodName": 3})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn names_with_json_escapes_get_the_same_answers_as_plain_ones() {
        // Plain names are read borrowed from the body; escaped ones take the owned path.
        let s = shared();
        let pod = serde_json::to_string(&pod("a", "7", None)).unwrap();
        let raw = |path: &'static str, names: &'static str| {
            let body = format!(r#"{{"Pod":{pod},"NodeNames":{names}}}"#);
            let s = s.clone();
            async move {
                let req = Request::builder()
                    .method("POST")
                    .uri(path)
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Body::from(body))
                    .unwrap();
                let resp = router(s).oneshot(req).await.unwrap();
                let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
                serde_json::from_slice::<Value>(&bytes).unwrap()
            }
        };
        for path in ["/filter", "/prioritize"] {
            let plain = raw(path, r#"["n1","n2"]"#).await;
            let escaped = raw(path, r#"["n\u0031","n2"]"#).await;
            assert_eq!(plain, escaped, "{path}");
            assert!(plain.to_string().contains("n1"), "{path}: {plain}");
        }
    }

    #[tokio::test]
    async fn the_filter_answers_the_chosen_node_alone_and_its_bind_needs_no_read() {
        let s = shared();
        let a = pod("a", "7", None);
        s.binder.pods.lock().unwrap().insert("a".into(), a.clone());
        s.state().apply_pod(&a); // as the watch shows it
        let args = json!({"Pod": a, "NodeNames": ["n1", "n2"]});
        let (status, body) = call(&s, "POST", "/filter", args).await;
        assert_eq!(status, StatusCode::OK);
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(r["NodeNames"], json!(["n1"]));
        assert!(r["FailedNodes"].as_object().is_none_or(|m| m.is_empty()), "{r}");
        assert!(r["FailedAndUnresolvableNodes"].as_object().is_none_or(|m| m.is_empty()), "{r}");
        assert_eq!(free(&s), 40, "held from the filter on");
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        // The binding carries the pod's uid as its precondition: the read would check nothing more.
        assert_eq!(s.binder.calls(), vec!["bind a n1"]);
        assert!(s.binder.assignment("a").is_some_and(|a| a.contains("\"node\":\"n1\"")));
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn kube_scheduler_gets_every_refused_node_as_unresolvable() {
        for answers in [FilterAnswers::One, FilterAnswers::Fitting] {
            let s = shared().with_filter_answers(answers);
            let b = pod("b", "1", None);
            s.binder.pods.lock().unwrap().insert("b".into(), b.clone());
            s.state().apply_pod(&b);
            call(&s, "POST", "/filter", json!({"Pod": b, "NodeNames": ["n1"]})).await;
            assert_eq!(call(&s, "POST", "/bind", binding("b")).await.1, r#"{"Error":""}"#);
            let args = json!({"Pod": pod("a", "7", None), "NodeNames": ["n1", "n2"]});
            let (status, body) = call(&s, "POST", "/filter", args).await;
            assert_eq!(status, StatusCode::OK);
            let r: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(r["NodeNames"], json!([]), "{answers:?}");
            assert!(r["FailedNodes"].as_object().is_none_or(|m| m.is_empty()), "{answers:?}: {r}");
            // Busy cards, which the view (and `kubectl nano-gpu why`) counts as resolvable.
            let busy = r["FailedAndUnresolvableNodes"]["n1"].as_str().unwrap_or_default();
            assert!(busy.starts_with("GPU busy"), "{answers:?}: {r}");
            assert_eq!(r["FailedAndUnresolvableNodes"]["n2"], "node has no nano-gpu inventory");
            let view = s.state().filter_names(Some(&pod("a", "7", None)), vec!["n1"]);
            assert!(view.failed_nodes.contains_key("n1"), "{view:?}");
        }
    }

    #[tokio::test]
    async fn filter_prioritize_and_bind_place_a_pod_and_write_its_assignment() {
        let s = shared().with_filter_answers(FilterAnswers::Fitting);
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "7", None));
        let args = json!({"Pod": pod("a", "7", None), "NodeNames": ["n1", "n2"]});
        let (status, body) = call(&s, "POST", "/filter", args.clone()).await;
        assert_eq!(status, StatusCode::OK);
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(r["NodeNames"], json!(["n1"]));
        assert_eq!(r["FailedAndUnresolvableNodes"]["n2"], "node has no nano-gpu inventory");
        let (_, body) = call(&s, "POST", "/prioritize", args).await;
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap(),
            json!([{"Host": "n1", "Score": 10}, {"Host": "n2", "Score": 0}])
        );
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        // The pod is read from the API server and bound with its assignment in one write.
        assert_eq!(s.binder.calls(), vec!["get ns/a", "bind a n1"]);
        assert_eq!(s.binder.node_of("a").as_deref(), Some("n1"));
        assert!(s.binder.assignment("a").is_some_and(|a| a.contains("\"node\":\"n1\"")));
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn bind_takes_the_pod_from_the_api_server_never_from_a_filter_body() {
        let s = shared();
        // The API server's pod asks 60 %; a filter body under its uid claimed 10 % on another node.
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "3", None));
        let mut forged = pod("a", "3", Some("elsewhere"));
        forged.spec.as_mut().unwrap().containers[0].resources.as_mut().unwrap().limits =
            Some([("nano-gpu/gpu-percent".to_string(), Quantity("10".into()))].into());
        call(&s, "POST", "/filter", json!({"Pod": forged, "NodeNames": ["n1"]})).await;
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        assert_eq!(s.binder.calls(), vec!["get ns/a", "bind a n1"]);
        assert_eq!(free(&s), 40, "60 % held, as the API server's pod asks");
    }

    /// Log lines written as a bind runs, in its own task: in the request's span, which names the pod.
    #[tokio::test]
    async fn a_binds_lines_are_in_its_request_span_which_names_the_pod() {
        #[derive(Clone, Default)]
        struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber =
            tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "3", None));
        // A lost answer read back: a line the bind's task writes, then one the handler writes.
        s.binder.lose_bind_answer.store(true, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        let out = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        for said in ["the bind took effect", "bound"] {
            let line = out.lines().find(|l| l.contains(said)).unwrap_or_else(|| panic!("{said}: {out}"));
            assert!(line.contains("request{method=POST path=/bind pod=ns/a}"), "{line}");
        }
    }

    #[tokio::test]
    async fn the_public_routes_hold_no_extender_verb_and_no_pod_names() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        for (method, path) in [
            ("POST", "/filter"),
            ("POST", "/prioritize"),
            ("POST", "/bind"),
            ("POST", "/preempt"),
            ("GET", "/inspect"),
            ("GET", "/map"),
            ("GET", "/map/data"),
        ] {
            let req = Request::builder().method(method).uri(path).body(Body::from("{}")).unwrap();
            let resp = public_router(s.clone()).oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{path} is public");
        }
        call(&s, "POST", "/bind", binding("a")).await;
        let req = Request::builder().uri("/metrics").body(Body::empty()).unwrap();
        let resp = public_router(s.clone()).oneshot(req).await.unwrap();
        let text = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("n1") && !text.contains("pod=") && !text.contains("\"a\""), "{text}");
    }

    #[tokio::test]
    async fn the_operators_port_reaches_no_verb_and_the_verbs_port_no_view() {
        let s = shared();
        for (method, path) in
            [("POST", "/filter"), ("POST", "/bind"), ("POST", "/preempt"), ("GET", "/metrics")]
        {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from("{}"))
                .unwrap();
            let resp = operator_router(s.clone()).oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{method} {path} on the operators' port");
        }
        for path in ["/inspect", "/map", "/map/data"] {
            let req = Request::builder().uri(path).body(Body::empty()).unwrap();
            let resp = router(s.clone()).oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{path} on the verbs' port");
        }
    }

    #[tokio::test]
    async fn a_bind_a_web_page_could_send_is_refused_and_binds_nothing() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        let body = binding("a").to_string();
        // What a page's fetch(..., {mode: "no-cors"}) or form sends, and a JSON one with a browser's marks.
        let tries: [&[(&str, &str)]; 5] = [
            &[("content-type", "text/plain;charset=UTF-8")],
            &[("content-type", "application/x-www-form-urlencoded")],
            &[],
            &[("content-type", "application/json"), ("origin", "http://evil.example")],
            &[("content-type", "application/json"), ("sec-fetch-site", "cross-site")],
        ];
        for headers in tries {
            let mut req = Request::builder().method("POST").uri("/bind");
            for (name, value) in headers {
                req = req.header(*name, *value);
            }
            let resp = router(s.clone()).oneshot(req.body(Body::from(body.clone())).unwrap()).await.unwrap();
            assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{headers:?}");
        }
        assert!(s.binder.calls().is_empty(), "{:?}", s.binder.calls());
        // kube-scheduler's own request binds.
        let (_, answer) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(answer, r#"{"Error":""}"#);
    }

    #[tokio::test]
    async fn a_body_over_2_mib_is_refused_with_413() {
        let s = shared();
        let names: Vec<String> = (0..150_000).map(|i| format!("node-{i:08}")).collect();
        let body = json!({"Pod": pod("a", "1", None), "NodeNames": names}).to_string();
        assert!(body.len() > 2 << 20, "{} bytes", body.len());
        let (status, _) = call_raw(&s, "POST", "/filter", &body).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn only_loopback_addresses_and_localhost_are_loopback_hosts() {
        let loopback = [
            "127.0.0.1",
            "127.0.0.1:8888",
            "localhost",
            "LOCALHOST:8890",
            "localhost.:8890",
            "[::1]:8890",
            "[::1]",
        ];
        for host in loopback {
            assert!(is_loopback_host(host), "{host}");
        }
        // (A bare IPv6 address is no Host; `::1:8888` would be another address.)
        let others = [
            "evil.example",
            "evil.example:8888",
            "10.0.0.1:8888",
            "[fd00::1]:80",
            "localhost.evil.example",
            "",
            "::1",
            "::1:8888",
            "[::1]junk",
            "[::1]:x",
            "127.0.0.1:99999",
        ];
        for host in others {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[tokio::test]
    async fn the_webhook_port_serves_the_webhook_and_healthz_only() {
        let s = shared();
        for (method, path, status) in [
            ("GET", "/healthz", StatusCode::OK),
            ("GET", "/metrics", StatusCode::NOT_FOUND),
            ("GET", "/readyz", StatusCode::NOT_FOUND),
            ("POST", "/bind", StatusCode::NOT_FOUND),
            ("GET", "/map/data", StatusCode::NOT_FOUND),
        ] {
            let req = Request::builder().method(method).uri(path).body(Body::from("{}")).unwrap();
            let resp = webhook_router(s.clone()).oneshot(req).await.unwrap();
            assert_eq!(resp.status(), status, "{method} {path}");
        }
        // /mutate answers a review (a malformed one: 400 with the reason), it is not a missing route.
        let req = Request::builder().method("POST").uri("/mutate").body(Body::from("{")).unwrap();
        let resp = webhook_router(s.clone()).oneshot(req).await.unwrap();
        assert_ne!(resp.status(), StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn the_map_shows_cards_shares_and_waiting_pods_and_answers_304_until_something_changes() {
        let s = shared();
        let (status, html) = call_raw(&s, "GET", "/map", "").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            html.contains("<title>nano-gpu map</title>") && html.contains("src=\"map/app.js\""),
            "{html}"
        );
        // Nothing from elsewhere: no URL with a scheme in the page or its script.
        let (_, script) = call_raw(&s, "GET", "/map/app.js", "").await;
        assert!(!html.contains("://") && !script.contains("://"), "the map fetches nothing from elsewhere");
        assert!(script.contains("map/data") && !script.contains("innerHTML"), "{script}");

        // A running 60 % share on card 0 and a waiting 60 % pod that cannot fit beside it.
        let mut running = pod("run", "1", Some("n1"));
        running.metadata.annotations = Some(BTreeMap::from([(
            ASSIGNMENT_ANNOTATION.to_owned(),
            r#"{"v":1,"node":"n1","at":"t","containers":{"c":[{"uuid":"GPU-0","index":0,"percent":60}]}}"#
                .to_owned(),
        )]));
        s.view.lock().apply_pod(&running);
        s.view.lock().apply_pod(&pod("wait", "2", None));
        let get = |etag: Option<String>| {
            let s = s.clone();
            async move {
                let mut req = Request::builder().uri("/map/data");
                if let Some(e) = etag {
                    req = req.header(header::IF_NONE_MATCH, e);
                }
                let resp = operator_router(s).oneshot(req.body(Body::empty()).unwrap()).await.unwrap();
                let etag = resp.headers().get(header::ETAG).map(|v| v.to_str().unwrap().to_owned());
                let status = resp.status();
                let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
                (status, etag, serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null))
            }
        };
        let (status, etag, doc) = get(None).await;
        assert_eq!(status, StatusCode::OK);
        let card = &doc["nodes"][0]["cards"][0];
        assert_eq!(card["shares"], json!([{"pod": "ns/run", "percent": 60, "memoryMiB": 9216}]), "{doc}");
        assert!(doc["nodes"][0]["fragmentation"].is_number(), "{doc}");
        assert_eq!(doc["waitingTotal"], 1);
        let w = &doc["waiting"][0];
        assert_eq!(
            (&w["pod"], &w["asks"], &w["fitsOn"]),
            (&json!("ns/wait"), &json!("60%"), &json!(0)),
            "{doc}"
        );
        assert_eq!(w["reasons"], json!({"GPU busy": 1}), "{doc}");
        // Unchanged: 304, no body built.
        let (status, again, _) = get(etag.clone()).await;
        assert_eq!((status, &again), (StatusCode::NOT_MODIFIED, &etag));
        // The running pod ends: the waiting one now fits, and the map says so under a new ETag.
        s.view.lock().delete_pod(&running);
        let (status, newer, doc) = get(etag.clone()).await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(newer, etag);
        assert_eq!(
            (&doc["waiting"][0]["fitsOn"], &doc["nodes"][0]["cards"][0]["shares"]),
            (&json!(1), &json!([]))
        );
        // Bound: no longer waiting.
        s.view.lock().apply_pod(&pod("wait", "3", Some("n1")));
        let (_, _, doc) = get(newer).await;
        assert_eq!((&doc["waitingTotal"], &doc["waiting"]), (&json!(0), &json!([])), "{doc}");
    }

    #[tokio::test]
    async fn a_refused_binding_gives_the_reservation_back() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        s.binder.fail_bind.store(true, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(r["Error"], "binding ns/a to n1: binding refused");
        assert_eq!(s.binder.calls(), vec!["get ns/a", "bind a n1", "get ns/a"]);
        assert_eq!((s.binder.assignment("a"), s.binder.node_of("a")), (None, None));
        assert_eq!(free(&s), 100);
    }

    #[tokio::test]
    async fn a_binding_whose_answer_was_lost_is_read_back_and_kept() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        s.binder.lose_bind_answer.store(true, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#, "the pod is bound: the bind took effect");
        assert_eq!(s.binder.calls(), vec!["get ns/a", "bind a n1", "get ns/a"]);
        assert!(s.binder.assignment("a").is_some(), "a bound pod keeps its assignment");
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn a_binding_lost_before_it_was_made_keeps_the_reservation_for_a_late_landing() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        s.binder.drop_bind.store(true, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert!(body.contains("connection reset"), "{body}");
        assert_eq!(s.binder.node_of("a"), None);
        // It may still land: the cards stay held until the watch shows the pod.
        assert_eq!(free(&s), 40);
        // kube-scheduler's retry on the same node reuses them.
        s.binder.drop_bind.store(false, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn a_failed_bind_whose_outcome_cannot_be_read_leaves_the_reservation() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        s.binder.lose_bind_answer.store(true, Ordering::SeqCst);
        s.binder.unreadable_after_bind.store(true, Ordering::SeqCst);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert!(body.contains("did not answer"), "{body}");
        assert!(s.binder.assignment("a").is_some());
        // Held until the watch shows the pod: it may well be bound (here it is).
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn a_pod_another_bound_first_keeps_their_assignment_and_ours_is_given_back() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        // Another leader's binding lands just before ours.
        let theirs = r#"{"v":1,"node":"n1","at":"other","containers":{"c":[{"uuid":"GPU-0","index":0,"percent":60}]}}"#;
        *s.binder.bound_by_another.lock().unwrap() = Some(theirs.to_owned());
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert!(body.contains("already assigned to node"), "{body}");
        assert_eq!(s.binder.assignment("a").as_deref(), Some(theirs));
        // Our reservation is given back; theirs comes in with the watch.
        assert_eq!(free(&s), 100);
    }

    /// The cluster of [`shared`] with a second node, n2, like n1.
    fn two_nodes() -> Arc<Shared<FakeBinder>> {
        let s = shared();
        let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
            "metadata": {"name": "n2", "annotations": {"nano-gpu/gpus":
                r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-1","vendor":"nvidia","model":"T4","memoryMiB":15360,"healthy":true}]}"#}},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "nano-gpu/gpu-percent": "100"}}
        }))
        .unwrap();
        s.state().apply_node(&node);
        s
    }

    fn binding_to(uid: &str, node: &str) -> Value {
        json!({"PodName": uid, "PodNamespace": "ns", "PodUID": uid, "Node": node})
    }

    /// A bind of pod `a` to n1 that the API server makes 20 s after it was sent (its answer never
    /// comes: far past kube-scheduler's 10 s), and kube-scheduler's retry on n2 `retry_at` seconds
    /// after the first; what the retry is told, and where the pod ends with which assignment.
    async fn a_slow_bind_then_a_retry_elsewhere(retry_at: u64) -> (String, String, String) {
        let s = two_nodes();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        *s.binder.bind_delay.lock().unwrap() = Duration::from_secs(20);
        s.binder.slow_binds.store(1, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let first = {
            let s = s.clone();
            tokio::spawn(async move { call(&s, "POST", "/bind", binding_to("a", "n1")).await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        // A retry while the first runs is told to come back.
        let (_, body) = call(&s, "POST", "/bind", binding_to("a", "n2")).await;
        assert!(body.contains("a bind of pod ns/a to node n1 is still in flight"), "{body}");
        // The first answers within the deadline and the read back, below kube-scheduler's 10 s.
        let (_, body) = first.await.unwrap();
        assert!(body.contains("did not answer"), "{body}");
        assert!(started.elapsed() <= bind::DEADLINE + bind::READ_BACK, "{:?}", started.elapsed());
        tokio::time::sleep_until(started + Duration::from_secs(retry_at)).await;
        let (_, retried) = call(&s, "POST", "/bind", binding_to("a", "n2")).await;
        tokio::time::sleep_until(started + Duration::from_secs(60)).await;
        s.binder.land_due();
        // Whichever landed, the view holds the 60 % on exactly the node the pod is bound to.
        let node = s.binder.node_of("a").unwrap();
        let cards = s
            .state()
            .extender()
            .engine()
            .cluster()
            .nodes()
            .iter()
            .map(|n| (n.name.to_string(), n.cards[0].free.0))
            .collect::<Vec<_>>();
        let want: Vec<(String, u32)> =
            ["n1", "n2"].iter().map(|n| (n.to_string(), if *n == node { 40 } else { 100 })).collect();
        assert_eq!(cards, want, "bound to {node}");
        (retried, node, s.binder.assignment("a").unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_binding_never_leaves_a_pod_on_one_node_with_an_assignment_naming_another() {
        // The retry lands first; the late binding to n1 is then refused.
        let (retried, node, assignment) = a_slow_bind_then_a_retry_elsewhere(12).await;
        assert_eq!(retried, r#"{"Error":""}"#);
        assert_eq!(node, "n2");
        assert!(assignment.contains("\"node\":\"n2\"") && assignment.contains("GPU-1"), "{assignment}");
        // The late binding lands first; the retry is refused before any write, and the pod keeps
        // n1's assignment, whose cards the view still holds.
        let (retried, node, assignment) = a_slow_bind_then_a_retry_elsewhere(25).await;
        assert!(retried.contains("pod ns/a is already bound to node n1"), "{retried}");
        assert_eq!(node, "n1");
        assert!(assignment.contains("\"node\":\"n1\"") && assignment.contains("GPU-0"), "{assignment}");
    }

    #[tokio::test]
    async fn a_repeated_bind_of_a_bound_pod_succeeds_without_api_calls() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        call(&s, "POST", "/bind", binding("a")).await;
        // The watch shows the pod bound and annotated; kube-scheduler retries after a timeout.
        let assignment = s.binder.calls().len();
        let mut bound = pod("a", "2", Some("n1"));
        let reserved = s.state().reserve(&pod("a", "1", None), "n1", SystemTime::UNIX_EPOCH).unwrap();
        bound.metadata.annotations =
            Some([(ASSIGNMENT_ANNOTATION.to_string(), reserved.assignment.encode())].into());
        s.state().apply_pod(&bound);
        s.binder.pods.lock().unwrap().insert("a".into(), bound);
        let (_, body) = call(&s, "POST", "/bind", binding("a")).await;
        assert_eq!(body, r#"{"Error":""}"#);
        assert_eq!(s.binder.calls().len(), assignment + 1, "only the read: {:?}", s.binder.calls());
        assert_eq!(free(&s), 40);
    }

    #[tokio::test]
    async fn a_pod_that_does_not_fit_is_refused_at_bind_without_writing() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        s.binder.pods.lock().unwrap().insert("b".into(), pod("b", "1", None));
        call(&s, "POST", "/bind", binding("a")).await;
        let (_, body) = call(&s, "POST", "/bind", binding("b")).await;
        assert!(body.contains("no longer fits on node n1"), "{body}");
        assert!(!s.binder.calls().iter().any(|c| c.starts_with("bind b")));
    }

    #[tokio::test]
    async fn readiness_waits_for_the_watches_and_preempt_answers() {
        let s = shared();
        assert_eq!(call(&s, "GET", "/readyz", json!(null)).await.0, StatusCode::SERVICE_UNAVAILABLE);
        s.view.set_synced();
        assert_eq!(call(&s, "GET", "/readyz", json!(null)).await.0, StatusCode::OK);
        assert_eq!(call(&s, "GET", "/healthz", json!(null)).await, (StatusCode::OK, "ok".to_string()));
        assert_eq!(call(&s, "POST", "/preempt", json!({})).await.0, StatusCode::BAD_REQUEST);
        let (status, body) = call(
            &s,
            "POST",
            "/preempt",
            json!({"Pod": pod("p", "1", None),
            "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "nobody"}], "NumPDBViolations": 0}}}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        // The card is free already, so the unknown victim is kept (it may hold CPU kube-scheduler counted).
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap(),
            json!({"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "nobody"}], "NumPDBViolations": 0}}})
        );
    }

    #[tokio::test]
    async fn metrics_and_inspect_describe_the_cards() {
        let s = shared();
        s.binder.pods.lock().unwrap().insert("a".into(), pod("a", "1", None));
        call(&s, "POST", "/bind", binding("a")).await;
        let (_, text) = call(&s, "GET", "/metrics", json!(null)).await;
        assert!(
            text.contains("nano_gpu_card_allocated_percent{node=\"n1\",gpu=\"GPU-0\",index=\"0\"} 60"),
            "{text}"
        );
        assert!(text.contains("nano_gpu_decisions_total{verb=\"bind\",result=\"ok\"} 1"));
        let (_, body) = call(&s, "GET", "/inspect", json!(null)).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["nodes"][0]["cards"][0]["percentUsed"], 60);
        assert_eq!(v["nodes"][0]["cards"][0]["pods"], json!(["ns/a"]));
    }

    #[tokio::test]
    async fn a_malformed_admission_review_is_answered_with_the_reason_and_changes_nothing() {
        let s = shared();
        let (status, body) = call_raw(&s, "POST", "/mutate", "{not json").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.contains("invalid AdmissionReview"), "{body}");
        // Well-formed JSON without a request: refused with the reason, never a crash.
        let (status, body) = call(
            &s,
            "POST",
            "/mutate",
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let review: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(review["response"]["allowed"], false);
        assert!(review["response"]["status"]["message"].as_str().unwrap().contains("no request"), "{review}");
        // The service still answers.
        assert_eq!(call(&s, "GET", "/healthz", json!(null)).await.0, StatusCode::OK);
    }
}
