//! The allocator's view of the cluster, fed by watch events on Nodes and Pods.
//!
//! Everything comes from the API: a node's cards from its `nano-gpu/gpus` annotation, its CPU and
//! memory from `status.allocatable`; what each pod holds from its `nano-gpu/assignment` annotation (GPU)
//! and its requests (CPU, memory). Watches call [`ClusterState::apply_node`], [`ClusterState::delete_node`],
//! [`ClusterState::apply_pod`], [`ClusterState::delete_pod`] and the `reset_*` methods (a re-list), and
//! every change rebuilds only the node it touches, so the engine's per-node cache stays valid elsewhere.
//!
//! Fail closed: a node inventory that cannot be decoded gives the node no usable card; an assignment
//! that cannot be decoded (or names another node) makes every card of its node count as full until the
//! pod goes away. Both raise a [`Warning`] for an Event naming the object. An assignment on a pod that
//! asks no GPU is somebody else's: it holds nothing (and raises a warning too).
//!
//! The service shares the view as a [`SharedView`]: the watches write through it, the handlers decide
//! on it, and it knows whether both watches have listed.
//!
//! A bind reserves the cards in memory before the API calls ([`ClusterState::reserve`]); the reservation
//! lives until the watch shows the annotated pod, so back-to-back decisions never double-book, and a
//! failed bind gives it back ([`ClusterState::release`]).
//!
//! One job per file under `state/`: `slim` (pods and nodes as the watches decode them), `decode`
//! (objects → records), `index` (watch events and re-lists), `rebuild` (records → the engine's node),
//! `reserve` (reservations and the annotations a bind writes), `preempt_verb` (kube-scheduler's
//! `/preempt` call, answered on the view), `preemption` (the preemption nano-gpu carries out itself),
//! `claims` (ResourceClaims and the pods waiting on them), `inspect` (the `/inspect` document), `map`
//! (the GPU map's data: `/inspect` and the waiting pods), `why` (a waiting pod's verdict per node).

mod claims;
mod decode;
mod index;
mod inspect;
mod map;
mod preempt_verb;
mod preemption;
mod rebuild;
mod reserve;
pub mod slim;
#[cfg(test)]
mod tests;
mod why;

pub use claims::ClaimWrite;
pub use inspect::InspectDoc;
pub use map::MapDoc;
pub use preemption::RETRY as PREEMPT_RETRY;
pub use preemption::{Needs, Preemption, Victim};
pub use reserve::Reservation;
pub use why::NodeVerdict;

use crate::decide::extender::Extender;
use decode::{NodeRecord, PodRecord};
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::workload::Learner;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_proto::events::Reason;
use nano_gpu_proto::extender::{ExtenderArgs, ExtenderFilterResult, HostPriorityList};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

/// How long a filter's choice holds the pod's cards for its bind ([`ClusterState::choose_names`]).
/// kube-scheduler sends the bind as soon as its own Reserve, Permit and PreBind plugins pass, within
/// milliseconds for a pod without volumes to bind; a bind after this still finds its cards if no
/// other pod took them meanwhile, else it fails and kube-scheduler retries the pod.
pub const FILTER_HOLD: Duration = Duration::from_secs(15);

/// How long no share is placed on a node after its kubelet failed one for want of nano-gpu's devices
/// (`UnexpectedAdmissionError`: no plugin served them, as while an agent container restarts, whole,
/// keeper included, or a restarted kubelet waits for its plugins). Its agent may still look Ready
/// (the kubelet restarts the container within a second, before it reports it dead), and a failed
/// share gives its cards back, so without the pause the policy keeps choosing that node, and every
/// share sent there in the meantime fails too. The kubelet is served again about a second after the
/// agent's container starts.
pub const REFUSAL_PAUSE: Duration = Duration::from_secs(5);

/// Something wrong with an object that a person should hear about (becomes a warning Event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// `Node` or `Pod`.
    pub kind: &'static str,
    /// Namespace (empty for nodes).
    pub namespace: String,
    /// Object name.
    pub name: String,
    /// Why (the Event's reason).
    pub reason: Reason,
    /// What is wrong.
    pub message: String,
}

impl Warning {
    /// A warning on pod `(namespace, name)`.
    pub fn on_pod(pod: &(String, String), reason: Reason, message: String) -> Self {
        Warning { kind: "Pod", namespace: pod.0.clone(), name: pod.1.clone(), reason, message }
    }
}

/// A pod reserved for that a re-list did not show ([`ClusterState::take_unconfirmed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unconfirmed {
    /// Its uid.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// The cluster view: node and pod records, and the extender deciding over them.
pub struct ClusterState {
    extender: Extender,
    learner: Option<Learner>,
    nodes: BTreeMap<String, NodeRecord>,
    pods: HashMap<String, PodRecord>,
    /// Node name → uids of the pods on it.
    by_node: HashMap<String, HashSet<String>>,
    /// How many of those pods are being deleted, and how many of the others there are of each
    /// priority: whether a preemption could find anything to end ([`ClusterState::could_preempt`]).
    pods_ending: usize,
    pods_by_priority: BTreeMap<i32, usize>,
    /// During a re-list: the names and uids seen so far.
    relisting_nodes: Option<HashSet<String>>,
    relisting_pods: Option<HashSet<String>>,
    /// Pods reserved for by a bind that a re-list did not show, to be looked up
    /// ([`ClusterState::take_unconfirmed`]).
    unconfirmed: Vec<Unconfirmed>,
    /// The newest pod resourceVersion a watch event showed.
    pods_version: u64,
    /// How many pods the watch has shown (events and listed objects): a count that stands still
    /// while this replica's own pod write should show says the watch is stalled.
    pod_events: u64,
    /// With [`ClusterState::require_ready_agents`]: what makes a pod an agent (its label and
    /// namespace), and the agent pods seen, by uid: their node and whether they are Ready.
    agent_label: Option<AgentPods>,
    agents: HashMap<String, (String, bool)>,
    /// Of `agents`, how many Ready ones each node has (a node without one is absent): whether a node
    /// serves is read at every rebuild, which must not walk every agent of the cluster.
    ready_agents: HashMap<String, usize>,
    /// Nodes whose kubelet failed a share for want of nano-gpu's devices, and when that was seen:
    /// none is placed there for [`REFUSAL_PAUSE`] ([`ClusterState::expire_kubelet_refusals`]).
    kubelet_refusals: HashMap<String, Instant>,
    warnings: Vec<Warning>,
    /// Pending pods that ask a GPU and hold no assignment yet, by uid (the GPU map's waiting list).
    waiting: BTreeMap<String, Waiting>,
    /// Pending pods whose GPU request cannot be read, warned of once each, by uid.
    invalid_requests: HashSet<String>,
    /// Bumped at every change of what `/inspect` or the map shows, so a reader can tell nothing
    /// changed without building them.
    generation: u64,
    /// The generation at which the filter last found no node for a pod, until that pod and any other
    /// refused are sent back to kube-scheduler's queue ([`crate::service::requeue`]).
    refused_at: Option<u64>,
    /// Every ResourceClaim by uid, and the uid of each (namespace, name).
    claims: HashMap<String, crate::decide::claim::ClaimRecord>,
    claim_keys: HashMap<(String, String), String>,
    /// During a re-list of claims: the uids seen so far.
    relisting_claims: Option<HashSet<String>>,
    /// Claims deleted while a pod they were reserved for still runs, by uid: kept in `claims` with
    /// their cards until the last of those pods is gone ([`ClusterState::release_ended_claims`]).
    ended_claims: HashSet<String>,
    /// Allocations being written, by claim uid: they hold their cards until written or failed.
    in_flight: HashMap<String, crate::decide::claim::Held>,
    /// Node name → uids of the claims holding cards on it.
    claims_on: HashMap<String, HashSet<String>>,
    /// Pending pods that use claims, by uid; per pod, the nodes kube-scheduler refused after
    /// nano-gpu allocated its claims there, and the last warning it got.
    claim_pods: BTreeMap<String, claims::ClaimPod>,
    refused_nodes: HashMap<String, std::collections::BTreeSet<String>>,
    claim_notes: HashMap<String, String>,
    /// Templates waiting pods need ([`ClusterState::take_templates_wanted`]).
    templates_wanted: std::collections::BTreeSet<(String, String)>,
    /// Pods whose cards a filter reserved when it chose their node ([`ClusterState::choose_names`]),
    /// until their bind takes the reservation, and when.
    filter_holds: HashMap<String, FilterHold>,
    /// Waiting pods that preempted pods for their claims, by uid: where, and whom they wait for;
    /// when a pod whose victims' eviction was refused may preempt again; the evictions decided and
    /// not yet taken ([`ClusterState::take_preemptions`]).
    nominations: HashMap<String, preemption::Nomination>,
    preempt_after: HashMap<String, Instant>,
    /// Per waiting pod, the view its last search for victims was made on (the generation and
    /// `victims_changed`).
    preempt_searched: HashMap<String, (u64, u64)>,
    /// Counts the pod changes that leave every node as it was but change what preemption may end (a
    /// reservation confirmed, a priority, a pod being deleted): with the generation, what a search
    /// for victims was made on.
    victims_changed: u64,
    preemptions: Vec<Preemption>,
}

/// What makes a pod one of the node agents: its label, its namespace, a DaemonSet as its controller.
#[derive(Clone, Debug)]
struct AgentPods {
    key: String,
    value: String,
    namespace: String,
}

impl AgentPods {
    /// Whether `pod` is an agent pod.
    fn matches(&self, pod: &Pod) -> bool {
        let labelled = pod.metadata.labels.as_ref().and_then(|l| l.get(&self.key)) == Some(&self.value);
        let here = pod.metadata.namespace.as_deref() == Some(self.namespace.as_str());
        let daemon_set = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.kind == "DaemonSet" && o.api_version == "apps/v1");
        labelled && here && daemon_set
    }
}

/// A pending GPU pod: its name, what it asks, since when (its creation, RFC 3339 and in seconds
/// since the epoch).
#[derive(Clone, Debug, PartialEq)]
struct Waiting {
    key: (String, String),
    demand: nano_gpu_proto::demand::PodDemand,
    since: String,
    created: Option<i64>,
}

/// Cards a filter reserved for the pod whose node it chose ([`ClusterState::choose_names`]).
struct FilterHold {
    since: Instant,
    reservation: Reservation,
    /// The pod's request as the filter read it (from kube-scheduler's copy).
    demand: nano_gpu_proto::demand::PodDemand,
}

/// The view as the service shares it: the watches write to it, the handlers decide on it, one at a
/// time; and whether each watch has listed everything yet.
pub struct SharedView {
    state: Mutex<ClusterState>,
    nodes_listed: AtomicBool,
    pods_listed: AtomicBool,
    /// Asks the pod watch to list again ([`SharedView::relist_pods`]).
    relist_pods: tokio::sync::Notify,
}

/// The kinds of object the view is listed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listed {
    /// Nodes.
    Nodes,
    /// Pods.
    Pods,
}

impl SharedView {
    /// Shares `state`, not yet listed.
    pub fn new(state: ClusterState) -> Self {
        SharedView {
            state: Mutex::new(state),
            nodes_listed: AtomicBool::new(false),
            pods_listed: AtomicBool::new(false),
            relist_pods: tokio::sync::Notify::new(),
        }
    }

    /// Asks the pod watch to drop its stream and list again (kept until the watch takes it): for a
    /// watch that shows nothing, not even a write this replica just made.
    pub fn relist_pods(&self) {
        self.relist_pods.notify_one();
    }

    /// Resolves when [`SharedView::relist_pods`] was asked (at once if it was asked before).
    pub async fn pods_relist_asked(&self) {
        self.relist_pods.notified().await;
    }

    /// The view, for one decision or one watch event.
    pub fn lock(&self) -> MutexGuard<'_, ClusterState> {
        // A panic while holding the lock cannot leave the view half-changed in a way that matters more
        // than stopping every decision would, so a poisoned lock is used as is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether both the node and the pod watch have listed everything (a view missing either would
    /// decide on half a cluster).
    pub fn synced(&self) -> bool {
        self.nodes_listed.load(Ordering::SeqCst) && self.pods_listed.load(Ordering::SeqCst)
    }

    /// The watch of `kind` has listed everything (again, after a re-list: it stays listed).
    pub fn set_listed(&self, kind: Listed) {
        match kind {
            Listed::Nodes => self.nodes_listed.store(true, Ordering::SeqCst),
            Listed::Pods => self.pods_listed.store(true, Ordering::SeqCst),
        }
    }

    /// Both watches have listed everything (tests and tools that fill the view by hand).
    pub fn set_synced(&self) {
        self.set_listed(Listed::Nodes);
        self.set_listed(Listed::Pods);
    }
}

impl ClusterState {
    /// An empty view deciding with `engine` (whose cluster should start empty).
    pub fn new(engine: Engine, salt: u64, demand: DemandOptions) -> Self {
        ClusterState {
            extender: Extender::new(engine, salt, demand),
            learner: None,
            nodes: BTreeMap::new(),
            pods: HashMap::new(),
            by_node: HashMap::new(),
            pods_ending: 0,
            pods_by_priority: BTreeMap::new(),
            relisting_nodes: None,
            relisting_pods: None,
            unconfirmed: Vec::new(),
            pods_version: 0,
            pod_events: 0,
            agent_label: None,
            agents: HashMap::new(),
            ready_agents: HashMap::new(),
            kubelet_refusals: HashMap::new(),
            warnings: Vec::new(),
            waiting: BTreeMap::new(),
            invalid_requests: HashSet::new(),
            generation: 0,
            refused_at: None,
            claims: HashMap::new(),
            claim_keys: HashMap::new(),
            relisting_claims: None,
            ended_claims: HashSet::new(),
            in_flight: HashMap::new(),
            claims_on: HashMap::new(),
            claim_pods: BTreeMap::new(),
            refused_nodes: HashMap::new(),
            claim_notes: HashMap::new(),
            templates_wanted: Default::default(),
            filter_holds: HashMap::new(),
            nominations: HashMap::new(),
            preempt_after: HashMap::new(),
            preempt_searched: HashMap::new(),
            victims_changed: 0,
            preemptions: Vec::new(),
        }
    }

    /// Learns the target workload from the pods it binds (rebuilt every `every` binds).
    pub fn learn_workload(mut self, every: u64) -> Self {
        self.learner = Some(Learner::new(every));
        self
    }

    /// Places on a node only while a Ready agent pod runs there: a kubelet whose device plugin does
    /// not serve (its agent crashed or was deleted) fails the pods it admits
    /// (`UnexpectedAdmissionError`), so none is sent there until the agent is back. An agent pod is
    /// labelled `key=value`, runs in `namespace` (the system's, where tenants create no pods) and is
    /// controlled by a DaemonSet: a tenant's pod with the label counts for nothing. The engine's node
    /// says it (`serving`, rebuilt when the node's agents change): filter, bind and `/inspect` read it.
    pub fn require_ready_agents(mut self, key: &str, value: &str, namespace: &str) -> Self {
        self.agent_label =
            Some(AgentPods { key: key.to_owned(), value: value.to_owned(), namespace: namespace.to_owned() });
        self
    }

    /// Whether `node` serves its cards: a Ready agent runs there (when that is required), and its
    /// kubelet has not just failed a share for want of nano-gpu's devices ([`REFUSAL_PAUSE`]).
    fn agent_ready(&self, node: &str) -> bool {
        !self.kubelet_refusals.contains_key(node)
            && (self.agent_label.is_none() || self.ready_agents.contains_key(node))
    }

    /// `node`'s kubelet failed a share for want of nano-gpu's devices, seen `now`: nothing is placed
    /// there for [`REFUSAL_PAUSE`] from now (a refusal during a pause does not lengthen it).
    pub(crate) fn note_kubelet_refusal(&mut self, node: &str, pod: &str, now: Instant) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.kubelet_refusals.entry(node.to_owned()) {
            e.insert(now);
            tracing::warn!(node, pod, pause = ?REFUSAL_PAUSE, "the node's kubelet failed a share for want of nano-gpu's devices; placing nothing there for a while");
            self.rebuild(node);
        }
    }

    /// Ends the pauses of [`REFUSAL_PAUSE`] that began before `now` less the pause (called every
    /// second).
    pub fn expire_kubelet_refusals(&mut self, now: Instant) {
        let over: Vec<String> = self
            .kubelet_refusals
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= REFUSAL_PAUSE)
            .map(|(node, _)| node.clone())
            .collect();
        for node in over {
            self.kubelet_refusals.remove(&node);
            tracing::info!(node = %node, "placing on the node again after its kubelet's refusal");
            self.rebuild(&node);
        }
    }

    /// The extender deciding over this view.
    pub fn extender(&self) -> &Extender {
        &self.extender
    }

    /// The engine's card-load reading from now on (`None`: none, placement exactly the policy's).
    /// The map shows each card's load, so a reading that changes what it shows is a change.
    pub fn set_load(&mut self, load: Option<nano_gpu_engine::load::Load>) {
        let shown = self.extender.engine().load().map(nano_gpu_engine::load::Load::shown);
        if shown != load.as_ref().map(nano_gpu_engine::load::Load::shown) {
            self.generation += 1;
        }
        self.extender.engine_mut().set_load(load);
    }

    /// How many cards the load reading in use covers (0 without one).
    pub fn load_cards(&self) -> usize {
        self.extender.engine().load().map_or(0, |l| l.len())
    }

    /// Warnings raised since the last call.
    pub fn take_warnings(&mut self) -> Vec<Warning> {
        std::mem::take(&mut self.warnings)
    }

    /// The reserved pods a re-list did not show since the last call: each is gone (deleted after
    /// the bind, the event lost with the watch that broke, so no event will ever say so) or newer
    /// than the list. Only the API server can tell; [`ClusterState::forget_gone`] with its answer.
    pub fn take_unconfirmed(&mut self) -> Vec<Unconfirmed> {
        std::mem::take(&mut self.unconfirmed)
    }

    pub(super) fn warn(&mut self, kind: &'static str, ns: &str, name: &str, reason: Reason, message: String) {
        tracing::warn!(kind, namespace = ns, name, %reason, %message, "fail closed");
        self.warnings.push(Warning {
            kind,
            namespace: ns.to_owned(),
            name: name.to_owned(),
            reason,
            message,
        });
    }

    /// `POST /filter` (as [`Self::filter_names`]).
    pub fn filter(&mut self, mut args: ExtenderArgs) -> ExtenderFilterResult {
        let by_name = args.node_names.is_some();
        let names = args.take_candidate_names();
        let result = self.filter_names(args.pod.as_ref(), names);
        crate::decide::extender::with_nodes(by_name, &args, result)
    }

    /// Acts on a filter's answer `result` for `pod`: a pod that no node passed may preempt pods of
    /// lower priority ([`Self::preempt_for_share`]), and waits in kube-scheduler's queue for a
    /// cluster event, which may already be behind this view ([`crate::service::requeue`]); one that some node
    /// passed is nominated nowhere.
    fn after_filter<N: AsRef<str> + Ord>(&mut self, pod: Option<&Pod>, result: &mut ExtenderFilterResult<N>) {
        if !result.error.is_empty() {
            return;
        }
        let uid = pod.and_then(decode::pod_uid);
        if result.passed() > 0 {
            if let Some(uid) = uid.filter(|uid| self.nominated(uid)) {
                self.end_nomination(uid);
            }
            return;
        }
        if let Some(pod) = pod {
            self.preempt_for_share(pod, result);
        }
        if !result.failed_nodes.is_empty() || !result.failed_and_unresolvable_nodes.is_empty() {
            self.refused_at = Some(self.generation);
        }
    }

    /// Runs `judge` on candidate `names` for `pod`, less the nodes held for another pod that
    /// preempted pods there ([`Self::split_held`]), which its answer then refuses with that reason;
    /// the pod's own cards given back for the while ([`Self::without_own_cards`]).
    fn judge_open<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
        judge: impl FnOnce(&mut Extender, Vec<N>) -> ExtenderFilterResult<N>,
    ) -> ExtenderFilterResult<N> {
        let uid = pod.and_then(decode::pod_uid);
        let (names, held) = self.split_held(uid, pod.map_or(0, decode::priority), names);
        let mut result = self.without_own_cards(uid, |s| judge(&mut s.extender, names));
        if result.error.is_empty() {
            for (name, why) in held {
                result.failed_nodes.insert(name, why);
            }
        }
        result
    }

    /// Whether the view changed since the filter last refused a pod on every node it was asked
    /// about: then (once) the generation it changed to, and the refusal counts as answered.
    pub fn requeue_due(&mut self) -> Option<u64> {
        match self.refused_at {
            Some(at) if self.generation > at => {
                self.refused_at = None;
                Some(self.generation)
            }
            _ => None,
        }
    }

    /// A requeue that could not be made: due again at the next look.
    pub fn requeue_failed(&mut self) {
        self.refused_at = Some(0);
    }

    /// `POST /filter` when the filter chooses (`serve --filter-answers one`, the default): the node
    /// the policy chooses among the candidates, alone ([`Extender::choose_names`]), so kube-scheduler
    /// binds it without scoring; the pod's cards there are reserved at once, so the next pod's filter
    /// (kube-scheduler filters it while this bind is on its way) counts them. The bind takes the
    /// reservation ([`ClusterState::reserve`]); one that does not come within [`FILTER_HOLD`] (another
    /// plugin refused the pod, a PreBind that takes long) is given back at a later filter. A pod filtered
    /// again gives its earlier hold back first.
    pub fn choose_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
        now: Instant,
    ) -> ExtenderFilterResult<N> {
        self.expire_filter_holds(now);
        let uid = pod.and_then(decode::pod_uid);
        if let Some(uid) = uid {
            self.give_back_filter_hold(uid);
        }
        let mut result = self.judge_open(pod, names, |e, names| e.choose_names(pod, names));
        self.after_filter(pod, &mut result);
        if let (Some(pod), Some(uid), Some([node])) = (pod, uid, result.node_names.as_deref())
            && !self.pods.contains_key(uid)
            && let Ok((demand, _)) = self.extender.request(pod)
        {
            match self.reserve(pod, node.as_ref(), SystemTime::now()) {
                Ok(reservation) => {
                    self.filter_holds.insert(uid.to_owned(), FilterHold { since: now, reservation, demand });
                }
                // The same evaluation just passed it: only a pod the engine cannot read gets here,
                // and its bind says why.
                Err(e) => {
                    tracing::warn!(pod = uid, node = node.as_ref(), error = %e, "no hold for the chosen node")
                }
            }
        }
        result
    }

    /// [`Self::choose_names`] for arguments read whole.
    pub fn choose(&mut self, mut args: ExtenderArgs, now: Instant) -> ExtenderFilterResult {
        let by_name = args.node_names.is_some();
        let names = args.take_candidate_names();
        let result = self.choose_names(args.pod.as_ref(), names, now);
        crate::decide::extender::with_nodes(by_name, &args, result)
    }

    /// Gives back the filter holds older than [`FILTER_HOLD`] whose bind did not come, and ends the
    /// nominations past their limit (at each filter, and every second by
    /// [`crate::service::server::expire_filter_holds`], so a quiet cluster does not keep them).
    pub fn expire_filter_holds(&mut self, now: Instant) {
        self.expire_nominations(now);
        let expired: Vec<String> = self
            .filter_holds
            .iter()
            .filter(|(_, hold)| now.saturating_duration_since(hold.since) >= FILTER_HOLD)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in expired {
            tracing::info!(pod = %uid, "the bind of a chosen node did not come; its cards are given back");
            self.give_back_filter_hold(&uid);
        }
    }

    /// Gives back pod `uid`'s filter hold, if it has one that is still only the view's reservation
    /// (not what the watch since showed the API server holding).
    fn give_back_filter_hold(&mut self, uid: &str) {
        if self.filter_holds.remove(uid).is_some() && self.pods.get(uid).is_some_and(|p| p.reserved) {
            self.forget_pod(uid);
        }
    }

    /// The bind of pod `uid` to `node` takes the hold of the filter that chose that node: its
    /// reservation, now the bind's own (`fresh`). Only while the pod asks what the watch last showed
    /// it asking (what is bound is what the API server holds, never only what a filter body said).
    /// `None`: no such hold (another node, expired, another request, or a `fitting` filter), or the
    /// node no longer serves (its agent stopped being ready since the filter: an agent pod deleted
    /// or rolled, whose kubelet would refuse the pod for want of healthy devices); the bind then reads
    /// the pod and [`reserve`](ClusterState::reserve)s, which gives the hold back and decides anew.
    pub fn take_filter_hold(&mut self, uid: &str, node: &str) -> Option<Reservation> {
        let hold = self.filter_holds.get(uid)?;
        let assignment = &hold.reservation.assignment;
        let ours =
            |p: &PodRecord| p.reserved && matches!(&p.holding, decode::Holding::Cards(a) if a == assignment);
        let as_watched = self.waiting.get(uid).is_some_and(|w| w.demand == hold.demand);
        let cluster = self.extender.engine().cluster();
        let serving = cluster.id(node).is_some_and(|id| cluster.node(id).serving);
        if assignment.node != node || !self.pods.get(uid).is_some_and(ours) || !as_watched || !serving {
            return None;
        }
        self.filter_holds.remove(uid).map(|h| h.reservation)
    }

    /// Whether pod `uid`'s cards are held by a filter's choice that no bind took yet.
    #[cfg(test)]
    fn held_by_filter(&self, uid: &str) -> bool {
        self.filter_holds.contains_key(uid) && self.pods.get(uid).is_some_and(|p| p.reserved)
    }

    /// `POST /prioritize` (as [`Self::filter_names`]).
    pub fn prioritize(&mut self, args: ExtenderArgs) -> HostPriorityList {
        let uid = args.pod.as_ref().and_then(decode::pod_uid).map(str::to_owned);
        self.without_own_cards(uid.as_deref(), |s| s.extender.prioritize(args))
    }

    /// `POST /filter` with the node names borrowed from the request; a pod that holds cards already is
    /// judged without them ([`ClusterState::without_own_cards`]).
    pub fn filter_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> ExtenderFilterResult<N> {
        let mut result = self.judge_names(pod, names);
        self.after_filter(pod, &mut result);
        result
    }

    /// What [`Self::filter_names`] answers, without acting on it (no preemption, no requeue): for
    /// `why`, which only looks.
    pub(super) fn judge_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> ExtenderFilterResult<N> {
        self.judge_open(pod, names, |e, names| e.filter_names(pod, names))
    }

    /// `POST /prioritize` with the node names borrowed from the request (as [`Self::filter_names`]).
    pub fn prioritize_names<N: AsRef<str>>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> HostPriorityList<N> {
        self.without_own_cards(pod.and_then(decode::pod_uid), |s| s.extender.prioritize_names(pod, names))
    }

    /// Runs `judge` with the cards the pod `uid` holds in the view given back for the while. kube-scheduler
    /// asks again about a pod whose bind wrote its assignment and then failed or lost its answer
    /// (the cards stay held until the API server says what became of the write): counted against
    /// itself, it would fit nowhere and wait as unschedulable (minutes) beside cards kept for it. Its
    /// bind on the node that holds them takes the same cards again ([`ClusterState::reserve`]).
    fn without_own_cards<T>(&mut self, uid: Option<&str>, judge: impl FnOnce(&mut Self) -> T) -> T {
        let holds = |p: &PodRecord| matches!(p.holding, decode::Holding::Cards(_));
        let held = uid.filter(|uid| self.pods.get(*uid).is_some_and(holds));
        let Some((uid, record)) = held.and_then(|uid| Some((uid.to_owned(), self.remove_pod(uid)?))) else {
            return judge(self);
        };
        let node = record.node.clone();
        self.rebuild(&node);
        let answer = judge(self);
        self.insert_pod(uid, record);
        self.rebuild(&node);
        answer
    }
}
