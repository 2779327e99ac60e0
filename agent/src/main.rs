//! `nano-gpu-agent`: serves the device plugin for `nano-gpu/gpu-percent`; `inventory` prints the
//! node's cards.

use clap::Parser;
use nano_gpu_agent::cards::inventory;
use nano_gpu_agent::cards::resource::Resource;
use nano_gpu_agent::node::enforce::driver::MemoryLimit;
use nano_gpu_agent::node::podresources::{Lister, PodResourcesSocket};
use nano_gpu_agent::node::{enforce, pods};
use nano_gpu_agent::plugin::Identity;
use nano_gpu_agent::{Command, Flags, checkpoint, kubelet, repair, run, usage};
use nano_gpu_proto::annotations::{NodeInventory, node_labels};
use nano_gpu_runtime::tasks::Tasks;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

fn print_inventory(flags: &Flags) -> ExitCode {
    let (cards, errors) = inventory::read_all(&flags.backends());
    for (backend, e) in &errors {
        eprintln!("nano-gpu-agent: {backend}: {e}");
    }
    let inv = NodeInventory::new(cards.into_iter().map(|c| c.info).collect());
    let doc = serde_json::json!({"annotation": inv.encode(), "labels": node_labels(&inv)});
    println!("{doc:#}");
    if errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

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
    publisher: nano_gpu_agent::node::publish::Publisher,
    identities: Vec<Arc<Identity>>,
    residents: watch::Receiver<nano_gpu_agent::node::pods::Residents>,
    reports: tokio::sync::mpsc::Sender<nano_gpu_agent::plugin::Report>,
    sweep: checkpoint::Sweep,
}

impl NodeSide {
    /// Starts the node's pod watch and the repair worker among `tasks`; `seen` is the agent's watch
    /// of its Node.
    fn start(
        flags: &Flags,
        (client, node): (kube::Client, String),
        resources: &[Resource],
        seen: watch::Receiver<Option<nano_gpu_agent::node::publish::Carried>>,
        memory: &MemoryLimit,
        readiness: &Arc<nano_gpu_agent::node::probe::Readiness>,
        tasks: &mut Tasks,
    ) -> NodeSide {
        let gpushare = resources.iter().copied().find(|r| matches!(r, Resource::Gpushare(_)));
        let publisher = nano_gpu_agent::node::publish::Publisher::new(client.clone(), node.clone())
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

fn serve(flags: &Flags) -> ExitCode {
    let timing = kubelet::Timing {
        refresh: std::time::Duration::from_secs(flags.refresh_seconds),
        ..Default::default()
    };
    until_terminated(flags, "", |stop, stopped| async move {
        let resources = flags.resources();
        let memory = memory_limit(flags);
        let readiness = Arc::new(nano_gpu_agent::node::probe::Readiness::default());
        // Every loop the agent runs while it serves, under one owner: the first to end ends the agent
        // (see `run::Agent::tasks`).
        let mut tasks = Tasks::default();
        let mut enforcement = flags.enforcement(None);
        let side = match &flags.node_name {
            Some(node) => {
                let client = nano_gpu_runtime::connect(flags.kubeconfig.as_deref())
                    .await
                    .map_err(|e| format!("connecting to the API server for node {node}: {e}"))?;
                let (seen, watching) = nano_gpu_agent::node::publish::watch_node(client.clone(), node);
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
        let dra = match (&side, flags.dra) {
            (Some(side), true) => Some(nano_gpu_agent::dra::FrontEnd {
                paths: nano_gpu_agent::dra::Paths {
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
                tokio::spawn(async move { nano_gpu_agent::dra::label_front_end(&nodes, &node, false).await });
                None
            }
            (None, false) => None,
        };
        let quiet = std::time::Duration::from_secs(flags.xid_quiet_seconds);
        let health = std::sync::Arc::new(nano_gpu_agent::cards::health::Health::new(quiet));
        let stop_xids = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if flags.fake_inventory.is_none() {
            let (health, stop, lib) = (health.clone(), stop_xids.clone(), flags.nvml_lib.clone());
            let retry = timing.refresh;
            std::thread::spawn(move || {
                nano_gpu_agent::cards::health::watch_xids_retrying(&lib, &health, &stop, retry)
            });
        }
        match &enforcement {
            enforce::Enforcement::Invalid(why) => {
                tracing::error!("{why}: no card is served until it names a mode")
            }
            e => tracing::info!(mode = e.name(), "shares are enforced"),
        }
        let edits = nano_gpu_agent::plugin::Edits { devices: flags.device_list(), enforcement, memory };
        let latest = usage::Latest::default();
        if !flags.probe_listen.is_empty() {
            let listener = tokio::net::TcpListener::bind(&flags.probe_listen)
                .await
                .map_err(|e| format!("probes on {}: {e}", flags.probe_listen))?;
            let node = flags.node_name.clone().unwrap_or_default();
            let app = nano_gpu_agent::node::probe::router(readiness.clone())
                .merge(usage::router(latest.clone(), node));
            use nano_gpu_runtime::listen::{Bounds, serve_plain};
            // The kubelet's probes, Prometheus and `kubectl nano-gpu top` (through the API server):
            // a few peers, each with a connection or two.
            let bounds = Bounds { connections: 64, per_peer: Some(16), ..Bounds::REACHABLE };
            tasks.spawn("probes HTTP", serve_plain("probes", listener, app, bounds, std::future::pending()));
        }
        if let Some(env) = flags.runtime_canary.clone() {
            let reports =
                nano_gpu_agent::canary::Reports { env, annotations: flags.annotation_canary.clone() };
            let node = side.as_ref().map(|s| (s.client.clone(), s.node.clone()));
            let watch =
                nano_gpu_agent::canary::watch(reports, readiness.clone(), node, Duration::from_secs(10));
            tasks.spawn("runtime canary", watch);
        }
        let held = usage::claims::SharedHeld::default();
        let plugins: Vec<_> = match &side {
            Some(side) => resources.iter().copied().zip(side.identities.iter().cloned().map(Some)).collect(),
            None => resources.iter().map(|r| (*r, None)).collect(),
        };
        let told = side.as_ref().map(|s| (s.residents.clone(), s.reports.clone(), held.clone()));
        let usage = (flags.usage_seconds > 0).then(|| {
            let sampling = usage::Sampling {
                every: Duration::from_secs(flags.usage_seconds),
                proc_root: flags.proc_root.clone(),
                grace: Duration::from_secs(flags.overrun_grace_seconds),
                residents: side.as_ref().map_or_else(
                    || tokio::sync::watch::channel(Default::default()).1,
                    |s| s.residents.clone(),
                ),
                reports: side.as_ref().map(|s| s.reports.clone()),
                claims: dra.as_ref().map(|front| usage::ClaimSource {
                    client: front.client.clone(),
                    node: front.node.clone(),
                    held: held.clone(),
                }),
            };
            (sampling, latest)
        });
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

/// `mps-control`: the node's MPS daemons, until SIGTERM.
fn mps_control(flags: &Flags) -> ExitCode {
    // With a pipe directory of its own (a size-limited emptyDir), its card's daemon runs there.
    let mut layout = flags.mps_layout();
    layout.pipe_in = flags.mps_pipe_source.as_ref().map(|_| flags.mps_pipe_dir.clone());
    let supervisor = enforce::mps::Supervisor {
        layout,
        program: flags.mps_control.clone(),
        backends: flags.backends(),
        every: Duration::from_secs(2),
        exclusive: flags.mps_exclusive_process.then(|| flags.nvml_lib.clone()),
        shm_source: flags.mps_shm_source.clone(),
        pipe_source: flags.mps_pipe_source.clone(),
        card_index: flags.mps_card_index,
    };
    until_terminated(flags, "mps-control: ", |_, stopped| enforce::mps::supervise(supervisor, stopped))
}

/// `clean-node`: nano-gpu's files removed from the node, each named on stdout.
fn clean_node(dirs: &nano_gpu_agent::clean::Dirs) -> ExitCode {
    match nano_gpu_agent::clean::clean(dirs) {
        Ok(removed) if removed.is_empty() => {
            println!("nothing of nano-gpu on this node");
            ExitCode::SUCCESS
        }
        Ok(removed) => {
            removed.iter().for_each(|p| println!("removed {}", p.display()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nano-gpu-agent: clean-node: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `canary`: what this container sees, written to `--runtime-canary`, then wait for SIGTERM.
fn canary(flags: &Flags) -> ExitCode {
    let Some(out) = flags.runtime_canary.clone() else {
        eprintln!(
            "nano-gpu-agent: canary: --runtime-canary (NANO_GPU_RUNTIME_CANARY) names the report to write"
        );
        return ExitCode::FAILURE;
    };
    let (lib, dev) = (flags.nvml_lib.clone(), flags.dev_root.clone());
    until_terminated(flags, "canary: ", |_, _| nano_gpu_agent::canary::report(lib, dev, out))
}

/// `keeper`: the kubelet's side of the agent's device plugins, until SIGTERM.
fn keeper(flags: &Flags) -> ExitCode {
    let Some(backend) = flags.backend_dir.clone() else {
        eprintln!(
            "nano-gpu-agent: keeper: --backend-dir (NANO_GPU_BACKEND_DIR) names where the agent serves"
        );
        return ExitCode::FAILURE;
    };
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("nano-gpu-agent: keeper: finding its own program to run the agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The agent: the same flags (and environment), without the subcommand.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(at) = args.iter().rposition(|a| a == "keeper") {
        args.remove(at);
    }
    // The container's memory limit, read from its own cgroup: the agent is stopped under it (see
    // keeper::memory).
    let memory = nano_gpu_agent::keeper::memory::own_limit(std::path::Path::new("/sys/fs/cgroup"))
        .map(nano_gpu_agent::keeper::memory::Guard::new);
    let keeper = nano_gpu_agent::keeper::Keeper {
        plugin_dir: flags.plugin_dir.clone(),
        backend,
        instance: flags.instance.clone(),
        resources: flags.resources(),
        patience: Duration::from_secs(flags.keeper_patience_seconds),
        timing: kubelet::Timing::default(),
        agent: Some(nano_gpu_agent::keeper::AgentProcess { program, args, memory }),
    };
    until_terminated(flags, "keeper: ", |_, stopped| async move {
        nano_gpu_agent::keeper::keep(keeper, stopped).await.map_err(|e| e.to_string())
    })
}

/// Runs `body` on the agent's runtime (one worker; NVML and sysfs reads go to blocking threads)
/// with logging set up, giving it a stop signal (and its sender) that flips at SIGTERM or SIGINT;
/// an error it ends with is printed after `what`.
fn until_terminated<F, Fut>(flags: &Flags, what: &str, body: F) -> ExitCode
where
    F: FnOnce(Arc<watch::Sender<bool>>, watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    nano_gpu_runtime::init_logging(flags.log_format == "json");
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nano-gpu-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let (stop, stopped) = watch::channel(false);
        let stop = Arc::new(stop);
        let terminate = stop.clone();
        tokio::spawn(async move {
            nano_gpu_runtime::terminated().await;
            let _ = terminate.send(true);
        });
        body(stop, stopped).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nano-gpu-agent: {what}{e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    match flags.command {
        Some(Command::Inventory) => print_inventory(&flags),
        Some(Command::MpsControl) => mps_control(&flags),
        Some(Command::Keeper) => keeper(&flags),
        Some(Command::Canary) => canary(&flags),
        Some(Command::CleanNode(dirs)) => clean_node(&dirs),
        None => serve(&flags),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The book's flag reference is this binary's clap definition (`docs/src/reference/`).
    #[test]
    fn cli_reference_is_the_books_page() {
        let command = super::Flags::command();
        nano_gpu_runtime::cli_reference::check_book_page(
            env!("CARGO_MANIFEST_DIR"),
            "cli-agent.md",
            "nano-gpu-agent flags",
            &command,
        );
    }
}
