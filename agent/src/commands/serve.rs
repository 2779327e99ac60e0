//! The agent's default command: serve the device plugin (and the DRA plugin with `--dra`) for the
//! node's cards, with what the agent does with its node's name around it ([`NodeSide`]).

use super::until_terminated;
use crate::cards::health::Health;
use crate::cards::resource::Resource;
use crate::commands::flags::Flags;
use crate::kubelet::plugin::{self, Identity};
use crate::kubelet::{checkpoint, dra, register};
use crate::node::enforce::driver::MemoryLimit;
use crate::node::podresources::{Lister, PodResourcesSocket};
use crate::node::probe::Readiness;
use crate::node::{enforce, pods};
use crate::serve::{repair, run, usage};
use nano_gpu_runtime::listen::{Bounds, serve_plain};
use nano_gpu_runtime::tasks::Tasks;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use tokio::sync::watch;

/// `--memory-limit`: what the driver's per-pod memory limit can do on this node, said in the log.
fn memory_limit(flags: &Flags) -> MemoryLimit {
    let mut memory = MemoryLimit::decide(flags.memory_limit, &flags.nvml_lib, &flags.cgroup_root);
    if matches!(memory, MemoryLimit::Driver(_)) && flags.node_name.is_none() {
        // Which pod a share is for comes from the pod watch of the node.
        memory = MemoryLimit::Unavailable("it needs --node-name".into());
    }
    match &memory {
        MemoryLimit::Driver(_) => tracing::info!("shares' pods get the driver's memory limit"),
        MemoryLimit::Unavailable(why) => {
            tracing::error!("--memory-limit driver: {why}; no NVIDIA card is served")
        }
        MemoryLimit::Off { available } => {
            tracing::info!(available, "the driver's memory limit is not asked (--memory-limit none)")
        }
    }
    memory
}

/// What the agent does with its node's name (`--node-name`): publish the cards on the Node, tell
/// containers apart by the node's pods, report and repair, keep the kubelet's checkpoint clean.
struct NodeSide {
    client: kube::Client,
    node: String,
    publisher: crate::node::publish::Publisher,
    identities: Vec<Arc<Identity>>,
    residents: watch::Receiver<crate::node::pods::Residents>,
    reports: tokio::sync::mpsc::Sender<plugin::Report>,
    sweep: checkpoint::Sweep,
}

impl NodeSide {
    /// Starts the node's pod watch and the repair worker among `tasks`; `seen` is the agent's watch
    /// of its Node.
    fn start(
        flags: &Flags,
        (client, node): (kube::Client, String),
        resources: &[Resource],
        seen: watch::Receiver<Option<crate::node::publish::Carried>>,
        memory: &MemoryLimit,
        readiness: &Arc<Readiness>,
        tasks: &mut Tasks,
    ) -> NodeSide {
        let gpushare = resources.iter().copied().find(|r| matches!(r, Resource::Gpushare(_)));
        let publisher = crate::node::publish::Publisher::new(client.clone(), node.clone())
            .with_gpushare(gpushare)
            .with_memory_limit(memory.label())
            .watching(seen);
        let lister: Arc<dyn Lister> = Arc::new(PodResourcesSocket::new(flags.pod_resources_socket.clone()));
        let (reports, queue) = tokio::sync::mpsc::channel(256);
        let (views, watching) = pods::watch::watch_pods(client.clone(), &node, resources, readiness.clone());
        tasks.spawn("pod watch", watching);
        let sweep = checkpoint::Sweep::new(
            flags.plugin_dir.join(checkpoint::CHECKPOINT_FILE),
            resources.iter().map(|r| r.name()).collect(),
            views.residents.clone(),
            lister.clone(),
        );
        tasks.spawn("repair", repair::Repairer::new(client.clone(), node.clone(), lister.clone()).run(queue));
        let wait = Duration::from_millis(flags.identity_wait_ms);
        let patience = Duration::from_secs(flags.identity_patience_seconds);
        let reader: Arc<dyn pods::watch::NodePods> =
            Arc::new(pods::watch::ApiNodePods::new(client.clone(), &node));
        let identities = resources
            .iter()
            .zip(views.asking)
            .map(|(r, pods)| {
                let mut identity =
                    Identity::new(node.clone(), *r, pods, lister.clone(), reports.clone(), wait);
                if !patience.is_zero() {
                    identity = identity.with_direct_reads(reader.clone(), patience);
                }
                Arc::new(identity)
            })
            .collect();
        NodeSide { client, node, publisher, identities, residents: views.residents, reports, sweep }
    }
}

/// The agent, until SIGTERM.
pub fn serve(flags: &Flags) -> ExitCode {
    let timing = register::Timing {
        refresh: std::time::Duration::from_secs(flags.refresh_seconds),
        ..Default::default()
    };
    until_terminated(flags, "", |stop, stopped| async move {
        let resources = flags.resources();
        let memory = memory_limit(flags);
        let readiness = Arc::new(Readiness::default());
        // Every loop the agent runs while it serves, under one owner: the first to end ends the agent
        // (see `run::Agent::tasks`).
        let mut tasks = Tasks::default();
        let mut enforcement = flags.enforcement(None);
        let side = match &flags.node_name {
            Some(node) => {
                let client = nano_gpu_runtime::connect(flags.kubeconfig.as_deref())
                    .await
                    .map_err(|e| format!("connecting to the API server for node {node}: {e}"))?;
                let (seen, watching) = crate::node::publish::watch_node(client.clone(), node);
                tasks.spawn("node watch", watching);
                let Some(label) = enforce::node_label(seen.clone(), stopped.clone()).await else {
                    return Ok(());
                };
                enforcement = flags.enforcement(label.as_deref());
                let relabel = enforce::restart_on_relabel(
                    seen.clone(),
                    flags.enforcement,
                    enforcement.clone(),
                    stop.clone(),
                );
                tasks.spawn("enforcement label", relabel);
                Some(NodeSide::start(
                    flags,
                    (client, node.clone()),
                    &resources,
                    seen,
                    &memory,
                    &readiness,
                    &mut tasks,
                ))
            }
            None => {
                tracing::warn!(
                    "no --node-name: the node inventory is not published and containers are not told \
                     apart (every container gets what its device IDs say; nothing is verified)"
                );
                None
            }
        };
        let dra = dra_front_end(flags, side.as_ref())?;
        let (health, stop_xids) = watch_xids(flags, timing.refresh);
        match &enforcement {
            enforce::Enforcement::Invalid(why) => {
                tracing::error!("{why}: no card is served until it names a mode")
            }
            e => tracing::info!(mode = e.name(), "shares are enforced"),
        }
        let edits = plugin::Edits { devices: flags.device_list(), enforcement, memory };
        let latest = usage::Latest::default();
        serve_probes(flags, &readiness, &latest, &mut tasks).await?;
        if let Some(env) = flags.runtime_canary.clone() {
            let reports = crate::serve::canary::Reports { env, annotations: flags.annotation_canary.clone() };
            let node = side.as_ref().map(|s| (s.client.clone(), s.node.clone()));
            let watch =
                crate::serve::canary::watch(reports, readiness.clone(), node, Duration::from_secs(10));
            tasks.spawn("runtime canary", watch);
        }
        let held = usage::claims::SharedHeld::default();
        let plugins: Vec<_> = match &side {
            Some(side) => resources.iter().copied().zip(side.identities.iter().cloned().map(Some)).collect(),
            None => resources.iter().map(|r| (*r, None)).collect(),
        };
        let told = side.as_ref().map(|s| (s.residents.clone(), s.reports.clone(), held.clone()));
        let usage =
            (flags.usage_seconds > 0).then(|| (sampling(flags, side.as_ref(), dra.as_ref(), &held), latest));
        let (publisher, sweep) = side.map(|s| (s.publisher, s.sweep)).unzip();
        let agent = run::Agent {
            plugin_dir: flags.plugin_dir.clone(),
            backend_dir: flags.backend_dir.clone(),
            instance: flags.instance.clone(),
            backends: flags.backends(),
            timing,
            edits,
            health,
            publisher,
            plugins,
            readiness,
            usage,
            told,
            sweep,
            allocatable: Some(Arc::new(PodResourcesSocket::new(flags.pod_resources_socket.clone()))),
            dra,
            tasks,
        };
        let result = run::run(agent, stopped).await;
        stop_xids.store(true, std::sync::atomic::Ordering::Relaxed);
        result.map_err(|e| e.to_string())
    })
}

/// With `--dra`, the DRA kubelet plugin's front end over the node's cards (it needs the node's
/// name); without, the Node is labelled as served by the device plugin.
fn dra_front_end(flags: &Flags, side: Option<&NodeSide>) -> Result<Option<dra::FrontEnd>, String> {
    Ok(match (side, flags.dra) {
        (Some(side), true) => Some(dra::FrontEnd {
            paths: dra::Paths {
                registry_dir: flags.dra_registry_dir.clone(),
                plugin_dir: flags.dra_plugin_dir.clone(),
                cdi_dir: flags.cdi_dir.clone(),
                instance: flags.instance.clone(),
            },
            node: side.node.clone(),
            client: side.client.clone(),
        }),
        (None, true) => return Err("--dra needs --node-name (the pool of the node's devices)".into()),
        (Some(side), false) => {
            // An agent without DRA serves the cards through its device plugin: the Node says so
            // (once; a failure is logged, and the label read as absent).
            let (nodes, node) = (kube::Api::all(side.client.clone()), side.node.clone());
            tokio::spawn(async move { dra::label_front_end(&nodes, &node, false).await });
            None
        }
        (None, false) => None,
    })
}

/// The cards' health, fed by NVML's XID events on a thread of its own (retried every `retry`
/// while NVML cannot be read; none with a fake inventory), and the flag that stops that thread.
fn watch_xids(flags: &Flags, retry: Duration) -> (Arc<Health>, Arc<AtomicBool>) {
    let health = Arc::new(Health::new(Duration::from_secs(flags.xid_quiet_seconds)));
    let stop = Arc::new(AtomicBool::new(false));
    if flags.fake_inventory.is_none() {
        let (health, stop, lib) = (health.clone(), stop.clone(), flags.nvml_lib.clone());
        std::thread::spawn(move || crate::cards::health::watch_xids_retrying(&lib, &health, &stop, retry));
    }
    (health, stop)
}

/// `--probe-listen`: `/healthz`, `/readyz` and the usage (`/metrics`, what `kubectl nano-gpu top`
/// reads) served among `tasks`.
async fn serve_probes(
    flags: &Flags,
    readiness: &Arc<Readiness>,
    latest: &usage::Latest,
    tasks: &mut Tasks,
) -> Result<(), String> {
    if flags.probe_listen.is_empty() {
        return Ok(());
    }
    let listener = tokio::net::TcpListener::bind(&flags.probe_listen)
        .await
        .map_err(|e| format!("probes on {}: {e}", flags.probe_listen))?;
    let node = flags.node_name.clone().unwrap_or_default();
    let app = crate::node::probe::router(readiness.clone()).merge(usage::router(latest.clone(), node));
    // The kubelet's probes, Prometheus and `kubectl nano-gpu top` (through the API server): a few
    // peers, each with a connection or two.
    let bounds = Bounds { connections: 64, per_peer: Some(16), ..Bounds::REACHABLE };
    tasks.spawn("probes HTTP", serve_plain("probes", listener, app, bounds, std::future::pending()));
    Ok(())
}

/// How the usage loop samples (`--usage-seconds`): the node's pods and reports where there is a
/// node side, and the claims' grants where DRA serves.
fn sampling(
    flags: &Flags,
    side: Option<&NodeSide>,
    dra: Option<&dra::FrontEnd>,
    held: &usage::claims::SharedHeld,
) -> usage::Sampling {
    usage::Sampling {
        every: Duration::from_secs(flags.usage_seconds),
        proc_root: flags.proc_root.clone(),
        grace: Duration::from_secs(flags.overrun_grace_seconds),
        residents: side.map_or_else(|| watch::channel(Default::default()).1, |s| s.residents.clone()),
        reports: side.map(|s| s.reports.clone()),
        claims: dra.map(|front| usage::ClaimSource {
            client: front.client.clone(),
            node: front.node.clone(),
            held: held.clone(),
        }),
    }
}
