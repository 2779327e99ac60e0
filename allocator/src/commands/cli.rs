//! The commands a person runs against a cluster, shared by `nano-gpu-allocator` and the kubectl plugin
//! `kubectl-nano_gpu`: `inspect` (every card and the pods on it), `top` (granted against used, from
//! the agents' metrics), `why` (for a waiting GPU pod, each node's reason and what would make
//! room) and `check` (is nano-gpu installed and working, and if not, what to do). Each reads the cluster with the caller's kubeconfig, as kubectl does, and changes nothing;
//! `uninstall` (the plugin's only command that changes the cluster) removes nano-gpu.

use crate::commands::{inspect_table, top};
use crate::state::{ClusterState, NodeVerdict};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};
use nano_gpu_engine::{engine::Engine, model::Cluster, policy};
use nano_gpu_proto::demand::{DemandOptions, GpushareUnit};
use nano_gpu_proto::install::AGENT_LABEL;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

/// Where the cluster is: kubectl's own flags.
#[derive(Args, Clone, Default)]
pub struct Kube {
    /// Kubeconfig of the cluster; default: `KUBECONFIG`, `~/.kube/config`, in-cluster.
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
}

impl Kube {
    async fn client(&self) -> Result<kube::Client> {
        nano_gpu_runtime::connect_with_context(self.kubeconfig.as_deref(), self.context.as_deref())
            .await
            .context("connecting to the API server")
    }
}

/// Output format.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Columns for a person.
    Table,
    /// JSON for a program.
    Json,
}

/// gpushare's memory unit, as the cluster's allocator counts it (`serve --gpushare`).
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum GpushareUnitArg {
    /// `aliyun.com/gpu-mem` counts GiB.
    Gib,
    /// `aliyun.com/gpu-mem` counts MiB.
    Mib,
}

/// How pods' GPU demands are read: gpushare's memory resource accepted in `gpushare`'s unit, if given.
pub fn demand_options(gpushare: Option<GpushareUnitArg>) -> DemandOptions {
    DemandOptions {
        gpushare: gpushare.map(|u| match u {
            GpushareUnitArg::Gib => GpushareUnit::GiB,
            GpushareUnitArg::Mib => GpushareUnit::MiB,
        }),
    }
}

/// Where the agents run (`inspect`, `top`, `why`).
#[derive(Args)]
pub struct Agents {
    /// Namespace of the agent DaemonSet, whose pods are `app.kubernetes.io/name=nano-gpu-agent`: `top`
    /// reads their metrics; `inspect` and `why` count a node as serving only while a Ready one,
    /// controlled by a DaemonSet, runs there, as the shipped allocator judges it (`serve
    /// --require-ready-agent`).
    #[arg(long, value_name = "NAMESPACE", env = "NANO_GPU_NAMESPACE", default_value = nano_gpu_proto::install::NAMESPACE)]
    pub agent_namespace: String,
}

/// `inspect`'s arguments.
#[derive(Args)]
pub struct InspectArgs {
    /// Only this node.
    #[arg(long)]
    pub node: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub format: Format,
    /// Count gpushare's `aliyun.com/gpu-mem` as GPU memory, in this unit: as the allocator of the
    /// cluster is run (`serve --gpushare`), or its pods show as asking no GPU.
    #[arg(long, env = "NANO_GPU_GPUSHARE", value_enum)]
    pub gpushare: Option<GpushareUnitArg>,
    /// Where the agents run.
    #[command(flatten)]
    pub agents: Agents,
}

/// `top`'s arguments.
#[derive(Args)]
pub struct TopArgs {
    /// Only pods of this namespace.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Where the agents run.
    #[command(flatten)]
    pub agents: Agents,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub format: Format,
}

/// `why`'s arguments.
#[derive(Args)]
pub struct WhyArgs {
    /// The pod.
    pub pod: String,
    /// Its namespace (default: the kubeconfig context's).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub format: Format,
    /// As `inspect --gpushare`.
    #[arg(long, env = "NANO_GPU_GPUSHARE", value_enum)]
    pub gpushare: Option<GpushareUnitArg>,
    /// Where the agents run.
    #[command(flatten)]
    pub agents: Agents,
}

/// `check`'s arguments.
#[derive(Args)]
pub struct CheckArgs {
    /// nano-gpu's namespace.
    #[arg(long, env = "NANO_GPU_NAMESPACE", default_value = nano_gpu_proto::install::NAMESPACE)]
    pub namespace: String,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub format: Format,
}

/// One runtime for one command.
fn block_on<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(work)
}

/// Every object `api` lists, a page of [`crate::service::watch::LIST_PAGE`] at a time (one snapshot): a whole
/// cluster's pods in one response would be hundreds of megabytes at Kubernetes' scale.
async fn list_all<K>(api: &Api<K>) -> Result<Vec<K>, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut params = ListParams::default().limit(crate::service::watch::LIST_PAGE);
    let mut all = Vec::new();
    loop {
        let page = api.list(&params).await?;
        all.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(all),
        }
    }
}

/// The allocator's view of the cluster, built as the shipped service builds it (every node, pod and
/// ResourceClaim listed, a node serving only with a Ready agent in `agent_namespace`), with what it
/// found wrong on stderr. An API server without `resource.k8s.io/v1` has no claims to count.
async fn view(
    client: &kube::Client,
    gpushare: Option<GpushareUnitArg>,
    agent_namespace: &str,
) -> Result<ClusterState> {
    let nodes = list_all(&Api::<Node>::all(client.clone())).await.context("listing nodes")?;
    let pods = list_all(&Api::<Pod>::all(client.clone())).await.context("listing pods")?;
    let policy = policy::by_name(policy::DEFAULT, 0).context("default policy")?;
    let mut state = ClusterState::new(
        Engine::new(Cluster::new(), policy, Default::default()),
        0,
        demand_options(gpushare),
    )
    .require_ready_agents(AGENT_LABEL.0, AGENT_LABEL.1, agent_namespace);
    state.reset_nodes(&nodes);
    state.reset_pods(&pods);
    // What DRA allocations hold counts on their cards as assignments do.
    match list_all(&Api::<ResourceClaim>::all(client.clone())).await {
        Ok(claims) => claims.iter().for_each(|c| state.apply_claim(c)),
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => eprintln!("warning: ResourceClaims not counted (their cards look free): listing them: {e}"),
    }
    for w in state.take_warnings() {
        let namespace = if w.namespace.is_empty() { String::new() } else { format!("{}/", w.namespace) };
        eprintln!("warning: {} {namespace}{}: {}", w.kind, w.name, w.message);
    }
    Ok(state)
}

/// `inspect`: every node's cards, what is used and free, and the pods on each.
pub fn inspect(args: InspectArgs, kube: &Kube) -> Result<()> {
    let view = block_on(async {
        Ok(view(&kube.client().await?, args.gpushare, &args.agents.agent_namespace).await?.inspect())
    })?;
    let view = inspect_table::only_node(view, args.node.as_deref());
    match args.format {
        Format::Table => print!("{}", inspect_table::table(&view)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&view)?),
    }
    Ok(())
}

/// `check`: every check of [`crate::commands::check`], one line each; fails (exit 1) when one fails.
pub fn check(args: CheckArgs, kube: &Kube) -> Result<()> {
    let snapshot =
        block_on(async { crate::commands::check::gather(&kube.client().await?, &args.namespace).await })?;
    let lines = crate::commands::check::evaluate(&snapshot, std::time::SystemTime::now());
    match args.format {
        Format::Table => print!("{}", crate::commands::check::table(&lines)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&lines)?),
    }
    let failed = lines.iter().filter(|l| l.status == crate::commands::check::Status::Fail).count();
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}

/// `uninstall`: nano-gpu removed from the cluster, with what deleting its manifests leaves
/// ([`crate::commands::uninstall`]); fails (exit 1) when a step failed.
pub fn uninstall(args: crate::commands::uninstall::UninstallArgs, kube: &Kube) -> Result<()> {
    let failed = block_on(async { crate::commands::uninstall::run(&kube.client().await?, &args).await })?;
    if failed > 0 {
        bail!("{failed} step(s) failed: fix what they say, then run it again");
    }
    Ok(())
}

/// `top`: granted against used per pod, container and card, from every agent's `/metrics` through
/// the API server's pod proxy.
pub fn top(args: TopArgs, kube: &Kube) -> Result<()> {
    let rows = block_on(async {
        let client = kube.client().await?;
        let agents = Api::<Pod>::namespaced(client.clone(), &args.agents.agent_namespace)
            .list(&ListParams::default().labels(&format!("{}={}", AGENT_LABEL.0, AGENT_LABEL.1)))
            .await
            .context("listing the agents")?;
        if agents.items.is_empty() {
            bail!("no nano-gpu agent pod in namespace {}", args.agents.agent_namespace);
        }
        // Every agent asked at once (16 in flight), each given 10 s.
        let scrape = |agent: &Pod| {
            let (client, namespace) = (client.clone(), args.agents.agent_namespace.clone());
            let name = agent.metadata.name.clone().unwrap_or_default();
            let node = agent.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
            async move {
                let path = format!("/api/v1/namespaces/{namespace}/pods/{name}:9401/proxy/metrics");
                let request = http::Request::get(path).body(Vec::new()).map_err(|e| e.to_string());
                let read = match request {
                    Ok(r) => tokio::time::timeout(Duration::from_secs(10), client.request_text(r)).await,
                    Err(e) => return Err(format!("node {node}: agent {name}: {e}")),
                };
                match read {
                    Ok(Ok(text)) => Ok(top::rows(&text)),
                    Ok(Err(e)) => Err(format!("node {node}: agent {name}'s metrics: {e}")),
                    Err(_) => Err(format!("node {node}: agent {name}'s metrics: no answer in 10 s")),
                }
            }
        };
        let answers: Vec<_> =
            futures::stream::iter(agents.items.iter().map(scrape)).buffer_unordered(16).collect().await;
        let mut rows = Vec::new();
        for answer in answers {
            match answer {
                Ok(r) => rows.extend(r),
                Err(e) => eprintln!("warning: {e}"),
            }
        }
        anyhow::Ok(rows)
    })?;
    let rows: Vec<top::Row> =
        rows.into_iter().filter(|r| args.namespace.as_ref().is_none_or(|n| *n == r.namespace)).collect();
    match args.format {
        Format::Table => print!("{}", top::table(&rows)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
    }
    Ok(())
}

/// What `why` found: the pod, where it stands, what the scheduler last said, each node's verdict.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Why {
    /// `namespace/name`.
    pub pod: String,
    /// Its phase.
    pub phase: String,
    /// The node it is bound to, if any.
    pub node: Option<String>,
    /// Its scheduler.
    pub scheduler: String,
    /// The newest `FailedScheduling` message, if any (it also names reasons that are not the GPU's:
    /// taints, affinity, CPU).
    pub last_failed_scheduling: Option<String>,
    /// Per node, from the allocator's filter over the cluster as listed now.
    pub nodes: Vec<NodeVerdict>,
}

/// `why`: for a GPU pod (a waiting one, above all), each node's verdict and what would make room.
pub fn why(args: WhyArgs, kube: &Kube) -> Result<()> {
    let why = block_on(async {
        let client = kube.client().await?;
        let namespace = args.namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let pod =
            pods.get(&args.pod).await.with_context(|| format!("reading pod {namespace}/{}", args.pod))?;
        let events: Api<Event> = Api::namespaced(client.clone(), &namespace);
        let about = format!("involvedObject.name={},involvedObject.kind=Pod", args.pod);
        let events =
            events.list(&ListParams::default().fields(&about)).await.context("listing the pod's events")?;
        let uid = pod.metadata.uid.as_deref();
        let last_failed_scheduling = events
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some("FailedScheduling") && e.involved_object.uid.as_deref() == uid
            })
            .max_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0).or(e.event_time.as_ref().map(|t| t.0)))
            .and_then(|e| e.message);
        let mut state = view(&client, args.gpushare, &args.agents.agent_namespace).await?;
        let nodes = state.why(&pod).map_err(|e| anyhow::anyhow!("pod {namespace}/{}: {e}", args.pod))?;
        let spec = pod.spec.as_ref();
        anyhow::Ok(Why {
            pod: format!("{namespace}/{}", args.pod),
            phase: pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default(),
            node: spec.and_then(|s| s.node_name.clone()),
            scheduler: spec.and_then(|s| s.scheduler_name.clone()).unwrap_or_default(),
            last_failed_scheduling,
            nodes,
        })
    })?;
    match args.format {
        Format::Table => print!("{}", why_table(&why)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&why)?),
    }
    Ok(())
}

/// `why` for a person: a header on the pod, then one line per node.
pub fn why_table(why: &Why) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Pod:        {} ({}, scheduler {})", why.pod, why.phase, why.scheduler);
    if let Some(node) = &why.node {
        let _ = writeln!(out, "Bound to:   {node} (the verdicts below leave its own cards out)");
    }
    if let Some(message) = &why.last_failed_scheduling {
        let _ = writeln!(out, "Scheduler:  {message}");
    }
    let fits = why.nodes.iter().filter(|v| v.fits).count();
    let _ = writeln!(out, "Fits now on {fits} of {} nodes.\n", why.nodes.len());
    let _ = writeln!(out, "{:<24} {:<6} {:<48}  WOULD FIT ONCE THESE END", "NODE", "FITS", "REASON");
    for v in &why.nodes {
        let verdict = match (v.fits, v.unresolvable) {
            (true, _) => "yes",
            (false, false) => "not now",
            (false, true) => "never",
        };
        let freed = if v.freed_by.is_empty() { "-".to_owned() } else { v.freed_by.join(",") };
        let reason = if v.reason.is_empty() { "-" } else { &v.reason };
        let _ = writeln!(out, "{:<24} {verdict:<6} {reason:<48}  {freed}", v.node);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(node: &str, fits: bool, reason: &str, unresolvable: bool, freed_by: &[&str]) -> NodeVerdict {
        NodeVerdict {
            node: node.into(),
            fits,
            reason: reason.into(),
            unresolvable,
            freed_by: freed_by.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_why_table_names_each_node_its_verdict_and_the_pods_in_the_way() {
        let why = Why {
            pod: "ml/train".into(),
            phase: "Pending".into(),
            node: None,
            scheduler: "nano-gpu-scheduler".into(),
            last_failed_scheduling: Some("0/3 nodes are available".into()),
            nodes: vec![
                verdict("n1", true, "", false, &[]),
                verdict("n2", false, "cards busy", false, &["ml/a", "ml/b"]),
                verdict("n3", false, "no card of an allowed model", true, &[]),
            ],
        };
        let t = why_table(&why);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("ml/train (Pending, scheduler nano-gpu-scheduler)"), "{t}");
        assert!(lines[1].ends_with("0/3 nodes are available"), "{t}");
        assert!(lines[2].contains("Fits now on 1 of 3 nodes"), "{t}");
        let row = |node: &str| *lines.iter().find(|l| l.starts_with(node)).unwrap();
        assert!(row("n1").contains(" yes ") && row("n1").ends_with('-'), "{t}");
        assert!(row("n2").contains("not now") && row("n2").ends_with("ml/a,ml/b"), "{t}");
        assert!(row("n3").contains("never") && row("n3").contains("no card of an allowed model"), "{t}");
    }
}
