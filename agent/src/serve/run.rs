//! The agent's main loop: read the cards (and re-read them periodically, publishing them on the Node
//! when they change), run the background tasks (usage sampler, checkpoint sweep, MPS daemon watch,
//! other plugins' cards) under one owner, and serve a device plugin per resource
//! (`nano-gpu.sock`, and `nano-gpu-gpushare.sock` with gpushare compatibility) through the kubelet's
//! registration protocol ([`crate::kubelet::register`]), or on a keeper's backend sockets.
//!
//! The loop ends when a background task ends or the kubelet refuses the registration. A backend that
//! cannot be read (no NVML on this node, say) leaves its cards out and is retried at the next
//! refresh, with the reason in the log.
use crate::cards::health::Health;
use crate::cards::inventory::{GpuInventory, read_all};
use crate::cards::resource::Resource;
use crate::kubelet::plugin::{Edits, Identity, Plugin, Snapshot};
use crate::kubelet::register::{
    RunError, Served, Serving, Timing, remove_dead_sockets, remove_own_sockets, serve_and_register,
    serve_backend, spawn_server,
};
use crate::node::enforce::Enforcement;
use crate::node::probe::Readiness;
use crate::node::publish::Publisher;
use nano_gpu_runtime::tasks::{Child, Tasks};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

fn read(
    backends: &[Box<dyn GpuInventory>],
    health: &Health,
    readiness: &Readiness,
    edits: &Edits,
) -> Snapshot {
    let (mut cards, errors) = read_all(backends);
    edits.apply(&mut cards);
    health.refuse_claimed(&mut cards);
    let mut problems = Vec::new();
    for (backend, e) in errors {
        tracing::warn!(backend, error = %e, "inventory backend unavailable; its cards are left out until it can be read");
        problems.push(format!("{backend}: {e}"));
    }
    problems
        .extend(cards.iter().filter_map(|c| Some(format!("card {}: {}", c.info.uuid, c.fault.as_ref()?))));
    health.apply(&mut cards, std::time::Instant::now());
    readiness.set_inventory(cards.len(), problems);
    Arc::new(cards)
}

/// The backends as the loop shares them with blocking threads.
type Backends = Arc<Vec<Box<dyn GpuInventory>>>;

/// [`read`] on a blocking thread (NVML and sysfs calls block and must not hold an async worker);
/// `None` if the read panicked (the caller keeps what it had).
async fn read_blocking(
    backends: &Backends,
    health: &Arc<Health>,
    readiness: &Arc<Readiness>,
    edits: &Edits,
) -> Option<Snapshot> {
    let (backends, health, readiness) = (backends.clone(), health.clone(), readiness.clone());
    let edits = edits.clone();
    match tokio::task::spawn_blocking(move || read(&backends, &health, &readiness, &edits)).await {
        Ok(snapshot) => Some(snapshot),
        Err(e) => {
            tracing::error!(error = %e, "reading the cards failed; keeping the last inventory");
            None
        }
    }
}

/// How often the MPS daemons are checked.
const DAEMON_CHECK: Duration = Duration::from_secs(1);

/// What the loop runs with.
pub struct Agent {
    /// The kubelet's device-plugin directory.
    pub plugin_dir: PathBuf,
    /// Where to serve for a keeper instead ([`crate::kubelet::keeper`]): the plugins listen there and the
    /// keeper registers with the kubelet and relays its calls; nothing is registered from here.
    pub backend_dir: Option<PathBuf>,
    /// This agent among the node's agents (its pod's name; empty when it is the only one): names
    /// its sockets, so the new agent of a rollout serves before the old one stops.
    pub instance: String,
    /// Where the cards come from.
    pub backends: Vec<Box<dyn GpuInventory>>,
    /// Timing of the loop.
    pub timing: Timing,
    /// Container edits beyond the environment.
    pub edits: Edits,
    /// Card health from XID events.
    pub health: Arc<Health>,
    /// Writes the cards on the Node (absent without a node name).
    pub publisher: Option<Publisher>,
    /// The resources served, each with what tells its containers apart (absent without a node name).
    pub plugins: Vec<(Resource, Option<Arc<Identity>>)>,
    /// What the readiness probe reports.
    pub readiness: Arc<Readiness>,
    /// Usage sampling, and where its newest report goes (absent: not sampled).
    pub usage: Option<(crate::serve::usage::Sampling, crate::serve::usage::Latest)>,
    /// The node's pods and where Events about them go (absent without a node name): under MPS,
    /// the pods of a card whose daemon stopped are told.
    /// On a node that serves DRA, the pods' claims as the usage loop read them tell who shares a card.
    pub told: Option<(
        watch::Receiver<crate::node::pods::Residents>,
        tokio::sync::mpsc::Sender<crate::kubelet::plugin::Report>,
        crate::serve::usage::claims::SharedHeld,
    )>,
    /// The kubelet's device checkpoint kept free of pods that left (absent without a node name).
    pub sweep: Option<crate::kubelet::checkpoint::Sweep>,
    /// The kubelet's pod-resources API, asked which cards other device plugins serve
    /// ([`crate::kubelet::coexist`]; absent: not asked).
    pub allocatable: Option<Arc<crate::node::podresources::PodResourcesSocket>>,
    /// The DRA front end over the same cards (absent: the device plugin only).
    pub dra: Option<crate::kubelet::dra::FrontEnd>,
    /// The background tasks the caller started for this agent (its Node and pod watches, the repair
    /// worker, the probes, ...): the loop adds its own and owns them all. The first to end, by
    /// returning or by a panic, ends the loop with an error that names it (the agent exits and its
    /// keeper starts it again); the rest stop when the loop ends, however it ends.
    pub tasks: Tasks,
}

/// How long the agent waits for its first inventory to be on the Node before it serves the kubelet.
const FIRST_PUBLISH: Duration = Duration::from_secs(5);

/// How often the kubelet is asked which cards other device plugins serve.
pub const COEXIST_CHECK: Duration = Duration::from_secs(10);

/// Runs until `shutdown` flips to true and the pods bound to the node that wait for their devices
/// have them ([`drain`]), or the kubelet refuses the registration.
pub async fn run(agent: Agent, shutdown: watch::Receiver<bool>) -> Result<(), RunError> {
    let Agent {
        plugin_dir,
        backend_dir,
        instance,
        backends,
        timing,
        edits,
        health,
        mut publisher,
        plugins,
        readiness,
        usage,
        told,
        sweep,
        allocatable,
        dra,
        mut tasks,
    } = agent;
    let backends: Backends = Arc::new(backends);
    readiness.set_guarantee(edits.guarantee());
    let first = read_blocking(&backends, &health, &readiness, &edits).await.unwrap_or_default();
    let (cards, snapshot) = watch::channel(first);
    let cards = Arc::new(cards);
    if let Some((sampling, latest)) = usage {
        let usage =
            crate::serve::usage::run(sampling, backends.clone(), snapshot.clone(), health.clone(), latest);
        tasks.spawn("usage sampler", usage);
    }
    // Sending the devices again makes the kubelet write its checkpoint.
    if let Some(sweep) = sweep {
        let cards = cards.clone();
        tasks.spawn("checkpoint sweep", sweep.run(move || cards.send_modify(|_| {})));
    }
    if let Enforcement::Mps(layout) = &edits.enforcement {
        let watch = crate::serve::daemons::watch(
            layout.clone(),
            snapshot.clone(),
            told,
            health.clone(),
            DAEMON_CHECK,
        );
        tasks.spawn("MPS daemon watch", watch);
    }
    // Not aborted with the loop: at a shutdown it removes its own sockets, so the kubelet
    // unregisters it (see `stop_front_end`).
    let dra = dra.map(|front| tokio::spawn(front.run(snapshot.clone(), edits.clone(), shutdown.clone())));
    if let Some(kubelet) = allocatable {
        let ours: Vec<&'static str> = plugins.iter().map(|(r, _)| r.name()).collect();
        let watch =
            crate::kubelet::coexist::watch(kubelet, ours, snapshot.clone(), health.clone(), COEXIST_CHECK);
        tasks.spawn("other plugins' cards", watch);
    }
    // The Node shows the cards as this agent reads them before the kubelet is told: an agent
    // started under a new enforcement mode serves a card unhealthy until its MPS daemon runs, and
    // the allocator, still reading the previous agent's healthy inventory, would place a share the
    // kubelet then fails ("no healthy devices"; seen in the enforcement suite: bound 50 ms after the
    // kubelet was told, 50 ms before the Node was). Waited for until the agent's own watch of the
    // Node shows it; bounded, so an API server that does not answer does not keep the node's
    // devices from the kubelet.
    let first = snapshot.borrow().clone();
    if let Some(p) = publisher.as_mut() {
        let published = async {
            publish_logged(p, &first).await;
            p.shown().await;
        };
        if tokio::time::timeout(FIRST_PUBLISH, published).await.is_err() {
            tracing::warn!(
                "publishing the node inventory took over {} s; serving the kubelet meanwhile",
                FIRST_PUBLISH.as_secs()
            );
        }
    }
    {
        let cards = cards.clone();
        let backends = backends.clone();
        let health = health.clone();
        let readiness = readiness.clone();
        let edits = edits.clone();
        tasks.spawn("card refresh", async move {
            let mut tick = tokio::time::interval(timing.refresh);
            tick.tick().await;
            let mut fresh = first;
            loop {
                if let Some(p) = publisher.as_mut() {
                    publish_logged(p, &fresh).await;
                }
                // Re-read on the period, at once when a card's health changed, and publish again
                // when the Node changed (someone removed or edited what we wrote).
                let node_changed = async {
                    match publisher.as_mut() {
                        Some(p) => p.node_changed().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = health.changed.notified() => {}
                    _ = node_changed => {}
                }
                let Some(read) = read_blocking(&backends, &health, &readiness, &edits).await else {
                    continue;
                };
                fresh = read;
                cards.send_if_modified(|current| {
                    let changed = **current != *fresh;
                    if changed {
                        *current = fresh.clone();
                    }
                    changed
                });
            }
        });
    }
    // The containers that run already are checked once, as starting ones are: one whose check a
    // killed agent did not finish keeps other cards than its assignment names until repaired (the
    // fault suite's killed agent containers left one so, 2026-12-04). Beside serving, not before
    // it: the kubelet is not kept waiting while many containers queue for their check.
    let identities: Vec<Arc<Identity>> =
        plugins.iter().filter_map(|(_, identity)| identity.clone()).collect();
    let recheck = tokio::spawn(recheck_running(identities.clone(), snapshot.borrow().clone()));
    // Told to stop, the agent serves on while pods bound to the node wait for their devices.
    let (drained_tx, mut drained) = watch::channel(false);
    let draining = Child::spawn("drain", async move {
        drain(identities, shutdown).await;
        let _ = drained_tx.send(true);
    });
    let resources: Vec<Resource> = plugins.iter().map(|(r, _)| *r).collect();
    let served = Plugins { plugins: &plugins, snapshot: &snapshot, cards: &cards, edits: &edits };
    if let Some(dir) = &backend_dir {
        // The keeper registers, and relays the kubelet's calls to these sockets.
        let result = tokio::select! {
            result = serve_backend(dir, &resources, &served, &readiness, &mut drained) => result,
            ended = tasks.first_ended() => Err(RunError::Task(ended.to_string())),
        };
        drop(draining);
        recheck.abort();
        stop_front_end(dra).await;
        tasks.shutdown().await;
        return result;
    }
    remove_dead_sockets(&plugin_dir, &resources).await;
    let serving = Serving {
        resources: &resources,
        served: &served,
        instance: &instance,
        plugin_dir: &plugin_dir,
        timing,
        readiness: &readiness,
    };
    let result = tokio::select! {
        result = serve_and_register(serving, &mut drained) => result,
        ended = tasks.first_ended() => Err(RunError::Task(ended.to_string())),
    };
    drop(draining);
    remove_own_sockets(&plugin_dir, &resources, &instance).await;
    recheck.abort();
    stop_front_end(dra).await;
    tasks.shutdown().await;
    result
}

/// How long an agent told to stop goes on serving at least: a pod bound to its node in the moment
/// before the allocator saw the agent going (a DaemonSet rollout, a deleted agent pod) shows in its
/// pod watch within it.
const DRAIN_LEAST: Duration = Duration::from_secs(2);

/// How long at most, while pods bound to its node wait for their devices: below the keeper's grace
/// for the agent to stop.
const DRAIN_MOST: Duration = Duration::from_secs(8);

/// How often the pods still waiting are counted meanwhile.
const DRAIN_CHECK: Duration = Duration::from_millis(200);

/// Resolves once `shutdown` has flipped and no pod bound to the node that asks a served resource
/// waits for its devices ([`Identity::unadmitted`], from one pod-resources List a round), at least [`DRAIN_LEAST`] after it and at most
/// [`DRAIN_MOST`]. A kubelet that admits such a pod once the plugin is gone fails it for good
/// ("no healthy devices", `UnexpectedAdmissionError`: the soak saw one bound 0.5 s after its
/// agent's pod was deleted), so an agent going away serves those first; its keeper relays the
/// kubelet's calls until it has stopped. Without a node name (no identities) nothing waits.
async fn drain(identities: Vec<Arc<Identity>>, mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
    if identities.is_empty() {
        return;
    }
    let started = tokio::time::Instant::now();
    tokio::time::sleep(DRAIN_LEAST).await;
    let mut said = false;
    loop {
        // One List for every resource: a pod that asks two is one pod waiting.
        let listed = match identities[0].listed().await {
            Ok(listed) => listed,
            Err(e) => {
                tracing::warn!(error = %e, "stopping without knowing which pods wait for their devices");
                return;
            }
        };
        let waiting: std::collections::BTreeSet<String> =
            identities.iter().flat_map(|identity| identity.unadmitted(&listed)).collect();
        if waiting.is_empty() {
            return;
        }
        if started.elapsed() >= DRAIN_MOST {
            tracing::warn!(
                pods = ?waiting,
                "stopping while pods bound to the node still wait for their devices: a kubelet that admits \
                 one before the next agent serves fails it"
            );
            return;
        }
        if !said {
            tracing::info!(pods = ?waiting, "stopping once the pods bound to the node have their devices");
            said = true;
        }
        tokio::time::sleep(DRAIN_CHECK).await;
    }
}

/// Sends each resource's running containers to the starting check ([`Identity::recheck_running`]),
/// once, saying how many.
async fn recheck_running(identities: Vec<Arc<Identity>>, cards: Snapshot) {
    for identity in identities {
        match identity.recheck_running(&cards).await {
            Ok(0) => {}
            Ok(sent) => tracing::info!(containers = sent, "checking the assignments of running containers"),
            Err(e) => tracing::warn!(error = %e, "running containers not checked"),
        }
    }
}

/// Publishes `cards` on the Node, saying when it wrote and when it failed (the refresh loop tries
/// again at its next turn).
async fn publish_logged(publisher: &mut Publisher, cards: &[crate::cards::inventory::Card]) {
    match publisher.publish(cards).await {
        Ok(true) => tracing::info!(cards = cards.len(), "node inventory published"),
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(error = %e, "publishing the node inventory failed; retrying at the next refresh")
        }
    }
}

/// Waits a moment for the DRA front end to end by itself (it does at a shutdown, after removing its
/// sockets), then stops it.
async fn stop_front_end(front: Option<tokio::task::JoinHandle<()>>) {
    if let Some(mut task) = front
        && tokio::time::timeout(Duration::from_secs(2), &mut task).await.is_err()
    {
        task.abort();
    }
}

/// The agent's device plugins over its cards.
struct Plugins<'a> {
    plugins: &'a [(Resource, Option<Arc<Identity>>)],
    snapshot: &'a watch::Receiver<Snapshot>,
    cards: &'a Arc<watch::Sender<Snapshot>>,
    edits: &'a Edits,
}

impl Served for Plugins<'_> {
    fn serve(
        &self,
        resource: Resource,
        listener: tokio::net::UnixListener,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<Result<(), String>> {
        let identity = self.plugins.iter().find(|(r, _)| *r == resource).and_then(|(_, i)| i.clone());
        spawn_server(
            listener,
            Plugin::new(self.snapshot.clone(), resource, self.edits.clone(), identity),
            stop,
        )
    }

    fn send_again(&self) {
        self.cards.send_modify(|_| {});
    }
}
