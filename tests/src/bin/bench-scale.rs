//! The driver of `hack/bench-scale.sh`: nano-gpu at Kubernetes' scale, through the real kube-apiserver
//! and kube-scheduler, without kubelets.
//!
//! `bench-scale fill` writes what agents and earlier placements would have written: `--nodes` nodes
//! of `--cards` cards each (the `nano-gpu/gpus` annotation, and `nano-gpu/gpu-percent` allocatable as
//! the device plugin advertises it) and `--pods-per-node` placed pods per node, bound with their
//! `nano-gpu/assignment`. The placed pods follow the pod list `--trace` (openb's, read where it lies;
//! a synthetic list without it) in order: its GPU pods until `--gpu-fill` of all cards' percent is
//! taken, its CPU-only pods for the rest. openb asks about 0.86 of a card per GPU pod, so 30 pods a
//! node of openb's mix would ask three times the cards a node has: what is placed is printed.
//!
//! `bench-scale measure` then runs bursts against the allocator and kube-scheduler started by the
//! script: `--burst` GPU pods (the trace's next GPU pods, on cards left free), as many CPU-only pods
//! through the same profile (kube-scheduler does not call the extender for them) and as many asking
//! an extended resource no extender manages; `--rounds` rounds of these three, each in another
//! order, their pods deleted between rounds (one `scale-ratio` line: the GPU throughput over the
//! others', per round and the median); then a GPU burst while `/metrics` and `/map/data` are read
//! every 2 s. Each burst prints one JSON line:
//! pods bound per second, creation → bound p50/p99 (as this driver sees the pod's `nodeName`), the
//! extender calls' p50/p99 (the allocator's `nano_gpu_decision_seconds` histogram over the burst:
//! the bucket's upper bound), the allocator's CPU and resident memory. Before the bursts: the
//! allocator's time to ready and its memory at rest.
//!
//! Nothing here creates a container: no kubelet runs. Placed and burst pods stay `Pending` with a
//! `nodeName`, which kube-scheduler and the allocator both count as placed.

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use nano_gpu_engine::request::SlotDemand;
use nano_gpu_engine::trace::{TracePod, parse_pods, synthetic};
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, CardGrant, GPUS_ANNOTATION, GpuInfo, NODE_LABEL, NodeInventory, Vendor,
};
use nano_gpu_proto::install::AGENT_LABEL;
use nano_gpu_proto::{MiB, Percent};
use nano_gpu_tests::http_client::Conn;
use nano_gpu_tests::{TICKS_PER_S, cpu_ticks, peak_rss_mib, quantile, rss_mib};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The scheduler profile of `deploy/scheduler-config.yaml`.
const SCHEDULER: &str = "nano-gpu-scheduler";
/// The allocator's Lease (in `nano-gpu-system`), as the shipped Deployment names it.
const LEASE: &str = "nano-gpu-allocator";
/// Where the probes of `failover` and `probe` live.
const PROBE_NS: &str = "bench-burst-gpu";
/// Where the placed pods live.
const PLACED_NS: &str = "bench-placed";
/// Where the GPU pods that fit nowhere wait (`--waiting`).
const WAITING_NS: &str = "bench-waiting";
/// Where `--waiting`'s churn window creates and deletes its placed pods.
const CHURN_NS: &str = "bench-churn";
/// How long each of `--waiting`'s windows lasts.
const WINDOW: Duration = Duration::from_secs(30);
/// Card memory of the synthetic cards.
const CARD_MIB: u32 = 81_920;
/// An extended resource every node has plenty of, which no extender manages: the CPU-only pods of
/// the `extended` burst ask one, so that kube-scheduler alone does the per-node work an extended
/// resource costs it (its `NodeResourcesFit` checks each one on each node), as it does for GPU pods.
const SLOT: &str = "bench.example.com/slot";
/// A burst is over when every pod is bound, or when none was bound for this long.
const STALL: Duration = Duration::from_secs(30);

#[derive(Clone)]
struct Args {
    command: String,
    kubeconfig: PathBuf,
    trace: Option<PathBuf>,
    nodes: usize,
    cards: usize,
    pods_per_node: usize,
    gpu_fill: f64,
    concurrency: usize,
    replicas: Vec<Replica>,
    burst: usize,
    /// How many rounds of the `gpu`, `cpu` and `extended` bursts `measure` runs (`--rounds`).
    rounds: usize,
    label: String,
    what: String,
    /// etcd's and kube-apiserver's PIDs (`--control-plane ETCD_PID,APISERVER_PID`), for the CPU each
    /// burst costs them.
    control_plane: Option<(u32, u32)>,
    /// How many GPU pods that fit nowhere `measure` leaves waiting through its windows and rounds
    /// (`--waiting`).
    waiting: usize,
}

/// One allocator and the kube-scheduler that calls it (a replica of the shipped Deployment).
#[derive(Clone)]
struct Replica {
    /// Its pod's name (`POD_NAME`): the identity it holds the Lease under.
    name: String,
    /// Its `--listen` address.
    addr: String,
    allocator_pid: u32,
    scheduler_pid: u32,
    /// Its kube-scheduler's secure port (`host:port`), where its `/metrics` are read.
    scheduler_addr: Option<String>,
    /// Its `--operator-listen` address, where the GPU map's data is read.
    operator_addr: Option<String>,
}

impl std::str::FromStr for Replica {
    type Err = anyhow::Error;

    /// `NAME,ADDR,ALLOCATOR_PID,SCHEDULER_PID[,SCHEDULER_ADDR[,OPERATOR_ADDR]]`.
    fn from_str(s: &str) -> Result<Replica> {
        let fields = s.split(',').collect::<Vec<_>>();
        let (name, addr, allocator, scheduler, rest) = match fields[..] {
            [name, addr, allocator, scheduler, ref rest @ ..] if rest.len() <= 2 => {
                (name, addr, allocator, scheduler, rest)
            }
            _ => bail!(
                "--replica NAME,ADDR,ALLOCATOR_PID,SCHEDULER_PID[,SCHEDULER_ADDR[,OPERATOR_ADDR]], not {s}"
            ),
        };
        let scheduler_addr = rest.first().map(|a| (*a).to_owned());
        let operator_addr = rest.get(1).map(|a| (*a).to_owned());
        Ok(Replica {
            name: name.into(),
            addr: addr.into(),
            allocator_pid: allocator.parse()?,
            scheduler_pid: scheduler.parse()?,
            scheduler_addr,
            operator_addr,
        })
    }
}

fn args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let command =
        it.next().context("usage: bench-scale fill|measure|failover|probe|check --kubeconfig F [flags]")?;
    let mut a = Args {
        command,
        kubeconfig: PathBuf::new(),
        trace: None,
        nodes: 500,
        cards: 8,
        pods_per_node: 30,
        gpu_fill: 0.6,
        concurrency: 64,
        replicas: Vec::new(),
        burst: 1000,
        rounds: 3,
        label: String::new(),
        what: "probe".into(),
        control_plane: None,
        waiting: 0,
    };
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--kubeconfig" => a.kubeconfig = value.into(),
            "--trace" => a.trace = Some(value.into()),
            "--nodes" => a.nodes = value.parse()?,
            "--cards" => a.cards = value.parse()?,
            "--pods-per-node" => a.pods_per_node = value.parse()?,
            "--gpu-fill" => a.gpu_fill = value.parse()?,
            "--concurrency" => a.concurrency = value.parse()?,
            "--replica" => a.replicas.push(value.parse()?),
            "--what" => a.what = value,
            "--burst" => a.burst = value.parse()?,
            "--rounds" => a.rounds = value.parse()?,
            "--waiting" => a.waiting = value.parse()?,
            "--label" => a.label = value,
            "--control-plane" => {
                let (etcd, apiserver) =
                    value.split_once(',').context("--control-plane ETCD_PID,APISERVER_PID")?;
                a.control_plane = Some((etcd.parse()?, apiserver.parse()?));
            }
            other => bail!("unknown flag {other}"),
        }
    }
    if a.kubeconfig.as_os_str().is_empty() {
        bail!("--kubeconfig is required");
    }
    let zero = a.cards == 0 || a.nodes == 0 || a.concurrency == 0 || a.rounds == 0;
    if !(0.0..=1.0).contains(&a.gpu_fill) || zero {
        bail!("--gpu-fill must be in 0..=1; --cards, --nodes, --concurrency and --rounds above 0");
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let client = nano_gpu_runtime::connect(Some(&a.kubeconfig)).await.context("--kubeconfig")?;
    let trace = Trace::load(a.trace.as_deref())?;
    match a.command.as_str() {
        "fill" => fill(&a, &client, &trace).await,
        "measure" => measure(&a, &client, &trace).await,
        "failover" => failover(&a, &client).await,
        "probe" => probe(&a, &client, Instant::now()).await,
        "check" => check(&a, &client).await,
        other => bail!("unknown command {other}: fill, measure, failover, probe or check"),
    }
}

/// The trace's pods, split by kind, each list walked in order from where the last walk stopped.
struct Trace {
    gpu: Vec<TracePod>,
    cpu: Vec<TracePod>,
    source: String,
}

impl Trace {
    fn load(path: Option<&std::path::Path>) -> Result<Trace> {
        let (pods, source) = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                (parse_pods(&p.display().to_string(), &text)?, p.display().to_string())
            }
            None => (synthetic(1).1, "synthetic".to_owned()),
        };
        let (gpu, mut cpu): (Vec<_>, Vec<_>) = pods.into_iter().partition(|p| ask(p).is_some());
        if cpu.is_empty() {
            // A list of GPU pods only: the CPU-only pods ask one core and 1 GiB.
            cpu.push(TracePod {
                name: "cpu".into(),
                cpu_milli: 1000,
                memory_mib: 1024,
                num_gpu: 0,
                gpu_milli: 0,
                gpu_spec: vec![],
            });
        }
        if gpu.is_empty() {
            bail!("{source}: no GPU pod");
        }
        Ok(Trace { gpu, cpu, source })
    }
}

/// Which cards of every node have how much percent free, as the placed pods left them.
struct Cards {
    free: Vec<Vec<u32>>,
    /// The next node to look at (next fit: placements spread over the nodes as the trace goes on).
    cursor: usize,
}

impl Cards {
    fn new(nodes: usize, cards: usize) -> Cards {
        Cards { free: vec![vec![100; cards]; nodes], cursor: 0 }
    }

    /// Places `pod` on the first node from the cursor that takes it (a share on that node's fullest
    /// card it fits on; whole cards on free ones): the node and its grants, if any node takes it.
    fn place(&mut self, pod: &TracePod) -> Option<(usize, Vec<(u32, u32)>)> {
        let nodes = self.free.len();
        for step in 0..nodes {
            let n = (self.cursor + step) % nodes;
            let free = &mut self.free[n];
            let grants: Vec<(u32, u32)> = match ask(pod)? {
                Ask::Share(percent) => {
                    let best = (0..free.len()).filter(|&c| free[c] >= percent).min_by_key(|&c| free[c]);
                    best.map(|c| vec![(c as u32, percent)]).unwrap_or_default()
                }
                Ask::Whole(cards) => {
                    let whole: Vec<usize> = (0..free.len()).filter(|&c| free[c] == 100).collect();
                    if whole.len() >= cards as usize {
                        whole[..cards as usize].iter().map(|&c| (c as u32, 100)).collect()
                    } else {
                        vec![]
                    }
                }
            };
            if grants.is_empty() {
                continue;
            }
            for &(c, p) in &grants {
                free[c as usize] -= p;
            }
            self.cursor = (n + 1) % nodes;
            return Some((n, grants));
        }
        None
    }
}

/// What a trace pod asks of cards, as the engine reads it ([`TracePod::slots`]).
#[derive(Clone, Copy)]
enum Ask {
    /// A share of one card, in percent (at least 1).
    Share(u32),
    /// Whole cards.
    Whole(u32),
}

/// What `t` asks of cards; `None` for a CPU-only pod.
fn ask(t: &TracePod) -> Option<Ask> {
    match t.slots().first()? {
        SlotDemand::Share { percent, .. } => Some(Ask::Share(percent.map_or(1, |p| p.0.max(1)))),
        SlotDemand::Whole { cards, .. } => Some(Ask::Whole(*cards)),
    }
}

fn node_name(n: usize) -> String {
    format!("node-{n:05}")
}

fn card_uuid(n: usize, c: u32) -> String {
    format!("GPU-{n:05}-{c}")
}

/// Node `n` as its agent and kubelet would have written it.
fn node(n: usize, cards: usize) -> Result<Node> {
    let gpus = (0..cards as u32)
        .map(|i| GpuInfo {
            index: i,
            uuid: card_uuid(n, i),
            vendor: Vendor::Nvidia,
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: MiB(CARD_MIB.into()),
            healthy: true,
            numa: None,
        })
        .collect();
    // Enough CPU and memory that only cards limit placement; kube-scheduler's default of 110 pods.
    let resources = json!({"cpu": "4000", "memory": "64Ti", "pods": "110",
        "nano-gpu/gpu-percent": (cards * 100).to_string(), SLOT: "1000"});
    Ok(serde_json::from_value(json!({
        "metadata": {"name": node_name(n), "labels": {NODE_LABEL: "true", "kubernetes.io/hostname": node_name(n)},
            "annotations": {GPUS_ANNOTATION: NodeInventory::new(gpus).encode()}},
        "status": {"capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "bench-scale: no kubelet", "lastHeartbeatTime": "2026-11-26T00:00:00Z",
                "lastTransitionTime": "2026-11-26T00:00:00Z"}]}
    }))?)
}

/// Node `n`'s agent pod as the shipped DaemonSet makes it (`deploy/agent.yaml`: its label, in
/// `nano-gpu-system`, controlled by the DaemonSet), for the allocator's `--require-ready-agent`; its
/// status is written Ready after it is created ([`agent_ready`]).
fn agent_pod(n: usize) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": format!("nano-gpu-agent-{n:05}"), "namespace": "nano-gpu-system",
            "labels": {AGENT_LABEL.0: AGENT_LABEL.1},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "nano-gpu-agent",
                "uid": "00000000-0000-4000-8000-000000000001", "controller": true}]},
        "spec": {"nodeName": node_name(n), "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "agent", "image": "registry.k8s.io/pause:3.10"}]}
    }))?)
}

/// The status a kubelet writes for a running, Ready agent pod.
fn agent_ready() -> Value {
    json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-26T00:00:00Z"}]}})
}

/// A pod of the trace's shape: its GPU as `nano-gpu/gpu-percent` (whole cards as 100 each).
fn pod(name: &str, namespace: &str, t: &TracePod) -> Result<Pod> {
    pod_asking(name, namespace, t, None)
}

/// [`pod`], asking one unit of `extra` too.
fn pod_asking(name: &str, namespace: &str, t: &TracePod, extra: Option<&str>) -> Result<Pod> {
    let mut limits =
        json!({"cpu": format!("{}m", t.cpu_milli.max(1)), "memory": format!("{}Mi", t.memory_mib.max(1))});
    let percent = match ask(t) {
        Some(Ask::Share(p)) => Some(p),
        Some(Ask::Whole(cards)) => Some(100 * cards),
        None => None,
    };
    if let Some(percent) = percent {
        limits["nano-gpu/gpu-percent"] = json!(percent.to_string());
    }
    if let Some(extra) = extra {
        limits[extra] = json!("1");
    }
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"schedulerName": SCHEDULER, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": limits, "requests": limits}}]}
    }))?)
}

/// Runs `make(i)` for `0..count` with `concurrency` at once; fails on the first error.
async fn each<F, Fut>(count: usize, concurrency: usize, make: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    stream::iter(0..count).map(make).buffer_unordered(concurrency).try_collect::<Vec<()>>().await?;
    Ok(())
}

/// Namespaces `names`, each with the ServiceAccount `default` (no controller manager makes it here,
/// and the API server admits no pod without it).
async fn namespaces(client: &Client, names: &[&str]) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        ignore_exists(api.create(&PostParams::default(), &ns).await)
            .with_context(|| format!("namespace {name}"))?;
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), name);
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}}))?;
        ignore_exists(accounts.create(&PostParams::default(), &sa).await)
            .with_context(|| format!("{name}/default"))?;
    }
    Ok(())
}

fn ignore_exists<T>(r: kube::Result<T>) -> kube::Result<()> {
    match r {
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        r => r.map(drop),
    }
}

async fn fill(a: &Args, client: &Client, trace: &Trace) -> Result<()> {
    let started = Instant::now();
    namespaces(
        client,
        &[
            PLACED_NS,
            "nano-gpu-system",
            "bench-burst-gpu",
            "bench-burst-cpu",
            "bench-burst-ext",
            "bench-burst-read",
            WAITING_NS,
            CHURN_NS,
        ],
    )
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    each(a.nodes, a.concurrency, |n| {
        let nodes = nodes.clone();
        async move {
            nodes.create(&PostParams::default(), &node(n, a.cards)?).await.with_context(|| node_name(n))?;
            Ok(())
        }
    })
    .await?;
    // Each node's Ready agent, as the DaemonSet and the kubelet leave it.
    let agents: Api<Pod> = Api::namespaced(client.clone(), "nano-gpu-system");
    each(a.nodes, a.concurrency, |n| {
        let agents = agents.clone();
        async move {
            let pod = agent_pod(n)?;
            let name = pod.metadata.name.clone().context("agent pod name")?;
            agents.create(&PostParams::default(), &pod).await.with_context(|| name.clone())?;
            agents
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(agent_ready()))
                .await
                .with_context(|| name)?;
            Ok(())
        }
    })
    .await?;
    let nodes_s = started.elapsed().as_secs_f64();

    // What to place, decided here in trace order, then written concurrently.
    let mut cards = Cards::new(a.nodes, a.cards);
    let gpu_budget = (a.gpu_fill * (a.nodes * a.cards * 100) as f64) as u64;
    let (mut gpu_used, mut gi, mut ci) = (0u64, 0usize, 0usize);
    let mut gpu_misses = 0usize;
    let mut placed: Vec<Pod> = Vec::with_capacity(a.nodes * a.pods_per_node);
    let (mut shares, mut wholes, mut cpus) = (0usize, 0usize, 0usize);
    while placed.len() < a.nodes * a.pods_per_node {
        let name = format!("placed-{}", placed.len());
        // GPU pods while the budget lasts and nodes take them (a few misses: fragments left).
        if gpu_used < gpu_budget && gpu_misses < 100 {
            let t = &trace.gpu[gi % trace.gpu.len()];
            gi += 1;
            let Some((n, grants)) = cards.place(t) else {
                gpu_misses += 1;
                continue;
            };
            let mut p = pod(&name, PLACED_NS, t)?;
            let grants: Vec<CardGrant> = grants
                .iter()
                .map(|&(c, percent)| CardGrant {
                    uuid: card_uuid(n, c),
                    index: c,
                    percent: Percent(percent),
                    memory_mib: None,
                })
                .collect();
            gpu_used += grants.iter().map(|g| u64::from(g.percent.0)).sum::<u64>();
            match ask(t) {
                Some(Ask::Share(_)) => shares += 1,
                _ => wholes += 1,
            }
            let assignment = Assignment::new(
                node_name(n),
                "2026-11-26T00:00:00Z",
                BTreeMap::from([("main".to_owned(), grants)]),
            );
            let annotations =
                BTreeMap::from([(ASSIGNMENT_ANNOTATION.to_owned(), serde_json::to_string(&assignment)?)]);
            p.metadata.annotations = Some(annotations);
            p.spec.as_mut().context("pod spec")?.node_name = Some(node_name(n));
            placed.push(p);
        } else {
            let t = &trace.cpu[ci % trace.cpu.len()];
            ci += 1;
            let mut p = pod(&name, PLACED_NS, t)?;
            p.spec.as_mut().context("pod spec")?.node_name = Some(node_name(placed.len() % a.nodes));
            placed.push(p);
            cpus += 1;
        }
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), PLACED_NS);
    let placed = Arc::new(placed);
    let pods_started = Instant::now();
    each(placed.len(), a.concurrency, |i| {
        let (pods, placed) = (pods.clone(), placed.clone());
        async move {
            pods.create(&PostParams::default(), &placed[i]).await.with_context(|| format!("placed-{i}"))?;
            Ok(())
        }
    })
    .await?;
    let pods_s = pods_started.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"bench": "scale-fill", "label": a.label, "trace": trace.source, "nodes": a.nodes, "cards": a.nodes * a.cards,
            "pods": placed.len(), "gpu_shares": shares, "gpu_whole": wholes, "cpu_only": cpus,
            "cards_taken_pct": round((gpu_used as f64) / ((a.nodes * a.cards) as f64)),
            "nodes_s": round(nodes_s), "pods_s": round(pods_s),
            "pods_per_s": round(placed.len() as f64 / pods_s)})
    );
    Ok(())
}

/// The allocator's extender-call histograms (`nano_gpu_decision_seconds`): per verb, per upper bound
/// (`+Inf` as infinity), the cumulative count.
type Histograms = BTreeMap<String, Vec<(f64, u64)>>;

async fn get(addr: &str, path: &str) -> Result<(u16, Vec<u8>)> {
    let mut conn = Conn::open(addr).await?;
    conn.call("GET", path, vec![]).await
}

async fn histograms(addr: &str) -> Result<Histograms> {
    let (status, body) = get(addr, "/metrics").await?;
    if status != 200 {
        bail!("GET /metrics: {status}");
    }
    let mut out = Histograms::new();
    for line in String::from_utf8_lossy(&body).lines() {
        let Some(rest) = line.strip_prefix("nano_gpu_decision_seconds_bucket{verb=\"") else { continue };
        let Some((verb, rest)) = rest.split_once("\",le=\"") else { continue };
        let Some((le, count)) = rest.split_once("\"} ") else { continue };
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse()? };
        out.entry(verb.to_owned()).or_default().push((le, count.trim().parse()?));
    }
    Ok(out)
}

/// Per verb, the calls between `before` and `after` and the upper bounds of the buckets that hold
/// their p50 and p99, in milliseconds (`null`: beyond the last bound).
fn call_quantiles(before: &Histograms, after: &Histograms) -> Value {
    let mut out = serde_json::Map::new();
    for (verb, buckets) in after {
        let base: HashMap<u64, u64> = before
            .get(verb)
            .map(|b| b.iter().map(|&(le, c)| (le.to_bits(), c)).collect())
            .unwrap_or_default();
        let delta: Vec<(f64, u64)> =
            buckets.iter().map(|&(le, c)| (le, c - base.get(&le.to_bits()).copied().unwrap_or(0))).collect();
        let total = delta.last().map_or(0, |d| d.1);
        if total == 0 {
            continue;
        }
        let bound = |q: f64| {
            let rank = ((total as f64) * q).ceil() as u64;
            let le = delta.iter().find(|d| d.1 >= rank).map_or(f64::INFINITY, |d| d.0);
            if le.is_finite() { json!(round(le * 1000.0)) } else { Value::Null }
        };
        out.insert(verb.clone(), json!({"calls": total, "p50_le_ms": bound(0.5), "p99_le_ms": bound(0.99)}));
    }
    Value::Object(out)
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The allocator's largest resident memory while a burst runs, sampled every 250 ms, in MiB.
async fn peak_rss(pid: u32, stop: tokio::sync::watch::Receiver<bool>) -> f64 {
    let mut peak = rss_mib(pid);
    while !*stop.borrow() {
        tokio::time::sleep(Duration::from_millis(250)).await;
        peak = peak.max(rss_mib(pid));
    }
    round(peak)
}

/// Reads `/metrics` (at `addr`) and `/map/data` (at `operators`) every 2 s until stopped: the slowest read of each, and sizes.
async fn read_pages(addr: String, operators: String, stop: tokio::sync::watch::Receiver<bool>) -> Value {
    let mut worst: BTreeMap<&str, (f64, usize, u32)> = BTreeMap::new();
    while !*stop.borrow() {
        for (at, path) in [(&addr, "/metrics"), (&operators, "/map/data")] {
            let t = Instant::now();
            if let Ok((200, body)) = get(at, path).await {
                let e = worst.entry(path).or_default();
                e.0 = e.0.max(t.elapsed().as_secs_f64() * 1000.0);
                e.1 = body.len();
                e.2 += 1;
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    worst
        .into_iter()
        .map(|(p, (ms, bytes, reads))| {
            (p.to_owned(), json!({"slowest_ms": round(ms), "bytes": bytes, "reads": reads}))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Creates `pods` in `namespace` and waits until kube-scheduler bound them: one JSON line.
async fn burst(
    a: &Args,
    r: &Replica,
    client: &Client,
    kind: &str,
    ns: &str,
    pods: Vec<Pod>,
    read: bool,
) -> Result<Value> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let before = histograms(&r.addr).await?;
    let version = api
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let bound: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let watcher = {
        let (api, bound) = (api.clone(), bound.clone());
        let mut version = version;
        tokio::spawn(async move {
            loop {
                let Ok(stream) = api.watch(&WatchParams::default().timeout(290), &version).await else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                let mut stream = std::pin::pin!(stream);
                while let Some(Ok(event)) = stream.next().await {
                    if let WatchEvent::Added(p) | WatchEvent::Modified(p) = event {
                        version = p.metadata.resource_version.clone().unwrap_or(version);
                        let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
                        if on_node && let Some(name) = p.metadata.name {
                            bound.lock().unwrap().entry(name).or_insert_with(Instant::now);
                        }
                    }
                }
            }
        })
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let peak = tokio::spawn(peak_rss(r.allocator_pid, stopped.clone()));
    let operators = r.operator_addr.clone().unwrap_or_else(|| r.addr.clone());
    let reader = read.then(|| tokio::spawn(read_pages(r.addr.clone(), operators, stopped)));

    let count = pods.len();
    let pods = Arc::new(pods);
    let cpu = Cpu::of(a, r);
    let counts = SchedulerCounts::read(a, r).await;
    let (first, ticks) = (Instant::now(), cpu.ticks());
    each(count, a.concurrency, |i| {
        let (api, pods, created) = (api.clone(), pods.clone(), created.clone());
        async move {
            let name = pods[i].metadata.name.clone().unwrap_or_default();
            created.lock().unwrap().insert(name.clone(), Instant::now());
            api.create(&PostParams::default(), &pods[i]).await.with_context(|| name)?;
            Ok(())
        }
    })
    .await?;
    let created_s = first.elapsed().as_secs_f64();
    // The allocator's CPU from the first creation to the last bind (not the wait for pods that fit
    // nowhere).
    let (mut seen, mut last_change, mut ticks_then) = (0, Instant::now(), ticks);
    loop {
        let now = bound.lock().unwrap().len();
        if now != seen {
            (seen, last_change, ticks_then) = (now, Instant::now(), cpu.ticks());
        }
        if now >= count || last_change.elapsed() > STALL {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(true);
    watcher.abort();
    let peak_rss = peak.await?;
    let pages = match reader {
        Some(r) => r.await?,
        None => Value::Null,
    };
    let after = histograms(&r.addr).await?;
    let counts_then = SchedulerCounts::read(a, r).await;

    let (created, bound) = (created.lock().unwrap().clone(), bound.lock().unwrap().clone());
    // Creation → bound, in milliseconds.
    let latencies: Vec<f64> = bound
        .iter()
        .filter_map(|(name, at)| {
            created.get(name).map(|c| at.saturating_duration_since(*c).as_secs_f64() * 1e3)
        })
        .collect();
    let last = bound.values().max().copied().unwrap_or(first);
    let span = last.saturating_duration_since(first).as_secs_f64().max(1e-3);
    let per_pod = cpu.per_pod(&ticks, &ticks_then, bound.len());
    Ok(json!({"bench": "scale-burst", "label": a.label, "kind": kind, "pods": count, "bound": bound.len(),
        "create_s": round(created_s), "span_s": round(span), "pods_per_s": round(bound.len() as f64 / span),
        "bound_p50_ms": round(quantile(latencies.clone(), 0.5)), "bound_p99_ms": round(quantile(latencies, 0.99)),
        "extender": call_quantiles(&before, &after),
        "allocator_cpu_cores": round(ticks_then.allocator.saturating_sub(ticks.allocator) as f64 / TICKS_PER_S / span),
        // ms per pod is s per 1,000 pods, the unit the peers were compared in.
        "allocator_cpu_s_per_1000_pods": per_pod["allocator"],
        "cpu_ms_per_pod": per_pod,
        "machine_busy_cores": round(ticks_then.machine.saturating_sub(ticks.machine) as f64 / TICKS_PER_S / span),
        "allocator_peak_rss_mib": peak_rss,
        "scheduler": counts.zip(counts_then).map(|(b, l)| b.since(&l, first.elapsed().as_secs_f64())),
        "pages": pages}))
}

/// kube-scheduler's own account of its nano-gpu profile, from its `/metrics`: scheduling attempts by
/// result (`scheduler_schedule_attempts_total`) and the seconds they took
/// (`scheduler_scheduling_attempt_duration_seconds_sum`), and the seconds of its PostFilter
/// extension point, where its preemption dry run runs.
#[derive(Clone, Copy, Default)]
struct SchedulerCounts {
    scheduled: f64,
    unschedulable: f64,
    attempt_s: f64,
    post_filter_s: f64,
}

impl SchedulerCounts {
    /// Reads the counters of replica `r`'s kube-scheduler (with `--kubeconfig`'s credentials; its
    /// serving certificate is self-signed): `None` without its address or when it does not answer.
    async fn read(a: &Args, r: &Replica) -> Option<SchedulerCounts> {
        let addr = r.scheduler_addr.as_deref()?;
        match Self::fetch(a, addr).await {
            Ok(text) => Some(Self::parse(&text)),
            Err(e) => {
                eprintln!("bench-scale: kube-scheduler's /metrics at {addr}: {e:#}");
                None
            }
        }
    }

    async fn fetch(a: &Args, addr: &str) -> Result<String> {
        let kubeconfig = kube::config::Kubeconfig::read_from(&a.kubeconfig)?;
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        config.cluster_url = format!("https://{addr}").parse()?;
        config.accept_invalid_certs = true;
        config.tls_server_name = None;
        let client = Client::try_from(config)?;
        Ok(client.request_text(http::Request::get("/metrics").body(Vec::new())?).await?)
    }

    fn parse(text: &str) -> SchedulerCounts {
        let mut c = SchedulerCounts::default();
        for line in text.lines().filter(|l| l.contains(&format!("profile=\"{SCHEDULER}\""))) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            let field = match series.split_once('{').map_or(series, |(name, _)| name) {
                "scheduler_schedule_attempts_total" if series.contains("result=\"scheduled\"") => {
                    &mut c.scheduled
                }
                "scheduler_schedule_attempts_total" if series.contains("result=\"unschedulable\"") => {
                    &mut c.unschedulable
                }
                "scheduler_scheduling_attempt_duration_seconds_sum" => &mut c.attempt_s,
                "scheduler_framework_extension_point_duration_seconds_sum"
                    if series.contains("extension_point=\"PostFilter\"") =>
                {
                    &mut c.post_filter_s
                }
                _ => continue,
            };
            *field += value;
        }
        c
    }

    /// What happened between `self` and `later`, over `span` seconds.
    fn since(&self, later: &SchedulerCounts, span: f64) -> Value {
        let span = span.max(1e-3);
        json!({"scheduled": later.scheduled - self.scheduled,
            "unschedulable": later.unschedulable - self.unschedulable,
            "unschedulable_per_s": round((later.unschedulable - self.unschedulable) / span),
            "attempt_s": round(later.attempt_s - self.attempt_s),
            "post_filter_s": round(later.post_filter_s - self.post_filter_s)})
    }
}

/// Leaves `--waiting` GPU pods that fit nowhere (each asks eight whole cards, more than any node of
/// the fill has free) and prints one `scale-waiting` line: how often kube-scheduler tried them and
/// what that cost, over a quiet window (nothing else happens) and over a churn window (a placed
/// CPU-only pod created and one deleted each second, as pods come and go in a cluster). The pods
/// stay through the rounds and the failover after.
async fn leave_waiting(a: &Args, r: &Replica, client: &Client) -> Result<Value> {
    let eight = TracePod {
        name: String::new(),
        cpu_milli: 1000,
        memory_mib: 1024,
        num_gpu: 8,
        gpu_milli: 1000,
        gpu_spec: vec![],
    };
    let pods =
        (0..a.waiting).map(|i| pod(&format!("wait-{i}"), WAITING_NS, &eight)).collect::<Result<Vec<_>>>()?;
    let api: Api<Pod> = Api::namespaced(client.clone(), WAITING_NS);
    let pods = Arc::new(pods);
    each(pods.len(), a.concurrency, |i| {
        let (api, pods) = (api.clone(), pods.clone());
        async move {
            api.create(&PostParams::default(), &pods[i]).await.with_context(|| format!("wait-{i}"))?;
            Ok(())
        }
    })
    .await?;
    // Their first tries, and the backoff they grow to (kube-scheduler's default is 10 s at most).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let quiet = window(a, r, None).await;
    let churn_api: Api<Pod> = Api::namespaced(client.clone(), CHURN_NS);
    let churn = window(a, r, Some(&churn_api)).await;
    let still = api.list_metadata(&ListParams::default()).await?.items.len();
    let bound = api.list(&ListParams::default().fields("spec.nodeName!=")).await?.items.len();
    Ok(json!({"bench": "scale-waiting", "label": a.label, "pods": a.waiting, "waiting": still - bound,
        "quiet": quiet?, "churn": churn?}))
}

/// One [`WINDOW`] of what kube-scheduler and the allocator do while the pods wait: with `churn`, a
/// CPU-only pod bound to a node is created there each second and the one of the second before
/// deleted.
async fn window(a: &Args, r: &Replica, churn: Option<&Api<Pod>>) -> Result<Value> {
    let cpu = Cpu::of(a, r);
    let (before, ticks, started) = (SchedulerCounts::read(a, r).await, cpu.ticks(), Instant::now());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut made = 0usize;
    while started.elapsed() < WINDOW {
        tick.tick().await;
        let Some(api) = churn else { continue };
        let name = format!("churn-{made}");
        let shape = TracePod {
            name: name.clone(),
            cpu_milli: 100,
            memory_mib: 128,
            num_gpu: 0,
            gpu_milli: 0,
            gpu_spec: vec![],
        };
        let mut p = pod(&name, CHURN_NS, &shape)?;
        p.spec.as_mut().context("pod spec")?.node_name = Some(node_name(made % a.nodes.max(1)));
        api.create(&PostParams::default(), &p).await.with_context(|| name.clone())?;
        if made > 0 {
            let gone = format!("churn-{}", made - 1);
            api.delete(&gone, &DeleteParams::default().grace_period(0)).await.with_context(|| gone)?;
        }
        made += 1;
    }
    let span = started.elapsed().as_secs_f64();
    let (after, ticks_then) = (SchedulerCounts::read(a, r).await, cpu.ticks());
    let cores = |from: u64, to: u64| round(to.saturating_sub(from) as f64 / TICKS_PER_S / span);
    Ok(json!({"span_s": round(span),
        "kube_scheduler_cores": cores(ticks.scheduler, ticks_then.scheduler),
        "allocator_cores": cores(ticks.allocator, ticks_then.allocator),
        "machine_busy_cores": cores(ticks.machine, ticks_then.machine),
        "scheduler": before.zip(after).map(|(b, l)| b.since(&l, span))}))
}

/// The processes whose CPU a burst reports, beside the whole machine's.
struct Cpu {
    allocator: u32,
    scheduler: u32,
    control_plane: Option<(u32, u32)>,
}

/// CPU ticks so far: of the deciding allocator, its kube-scheduler, etcd, kube-apiserver, and the
/// machine's busy time over all cores (`/proc/stat`: all but idle and iowait).
#[derive(Clone, Copy, Default)]
struct Ticks {
    allocator: u64,
    scheduler: u64,
    etcd: u64,
    apiserver: u64,
    machine: u64,
}

impl Cpu {
    fn of(a: &Args, r: &Replica) -> Cpu {
        Cpu { allocator: r.allocator_pid, scheduler: r.scheduler_pid, control_plane: a.control_plane }
    }

    fn ticks(&self) -> Ticks {
        let (etcd, apiserver) = self.control_plane.map_or((0, 0), |(e, s)| (cpu_ticks(e), cpu_ticks(s)));
        Ticks {
            allocator: cpu_ticks(self.allocator),
            scheduler: cpu_ticks(self.scheduler),
            etcd,
            apiserver,
            machine: machine_ticks(),
        }
    }

    /// Milliseconds of CPU per bound pod, by process, between two readings.
    fn per_pod(&self, from: &Ticks, to: &Ticks, pods: usize) -> Value {
        let ms = |a: u64, b: u64| round(b.saturating_sub(a) as f64 / TICKS_PER_S * 1e3 / pods.max(1) as f64);
        let mut out = json!({
            "allocator": ms(from.allocator, to.allocator),
            "kube_scheduler": ms(from.scheduler, to.scheduler),
            "machine": ms(from.machine, to.machine),
        });
        if self.control_plane.is_some() {
            out["etcd"] = ms(from.etcd, to.etcd).into();
            out["kube_apiserver"] = ms(from.apiserver, to.apiserver).into();
        }
        out
    }
}

/// The machine's busy CPU ticks over all cores since boot (`/proc/stat`'s first line, without idle
/// and iowait); 0 where it cannot be read.
fn machine_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next() else { return 0 };
    let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum()
}

/// The replica that decides: the only one, once it answers `/readyz`; of several, the holder of the
/// allocator's Lease, once there is one (a replica contends only once it listed the cluster).
async fn deciding(a: &Args, client: &Client, limit: Duration) -> Result<Replica> {
    let started = Instant::now();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "nano-gpu-system");
    loop {
        if let [only] = &a.replicas[..] {
            if let Ok((200, _)) = get(&only.addr, "/readyz").await {
                return Ok(only.clone());
            }
        } else if let Ok(Some(lease)) = leases.get_opt(LEASE).await {
            let holder = lease.spec.and_then(|s| s.holder_identity).unwrap_or_default();
            if let Some(r) = a.replicas.iter().find(|r| r.name == holder) {
                return Ok(r.clone());
            }
        }
        if started.elapsed() > limit {
            bail!("no allocator replica decides after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn measure(a: &Args, client: &Client, trace: &Trace) -> Result<()> {
    // Time to ready: the allocators were started just before this; their lists are most of it.
    let started = Instant::now();
    let r = deciding(a, client, Duration::from_secs(900)).await?;
    let ready_s = started.elapsed().as_secs_f64();
    let listed_peak = peak_rss_mib(r.allocator_pid);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (ticks, rest_started) = (cpu_ticks(r.allocator_pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rest_cores =
        (cpu_ticks(r.allocator_pid) - ticks) as f64 / TICKS_PER_S / rest_started.elapsed().as_secs_f64();
    let placed = Api::<Pod>::namespaced(client.clone(), PLACED_NS)
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .metadata
        .remaining_item_count
        .map_or(0, |n| n + 1);
    println!(
        "{}",
        json!({"bench": "scale-rest", "label": a.label, "placed_pods": placed, "ready_s": round(ready_s),
            "allocator_peak_rss_mib_listing": round(listed_peak), "allocator_rss_mib": round(rss_mib(r.allocator_pid)),
            "replicas": a.replicas.len(), "deciding": r.name,
            "allocator_cpu_cores": round(rest_cores)})
    );

    if a.waiting > 0 {
        println!("{}", leave_waiting(a, &r, client).await?);
    }

    // The trace's GPU pods after those the fill placed: a fresh walk from an offset that is not its
    // start, so the burst is not the fill's first pods again.
    let gpu_pods = |prefix: &str, ns: &str, offset: usize| -> Result<Vec<Pod>> {
        (0..a.burst)
            .map(|i| pod(&format!("{prefix}-{i}"), ns, &trace.gpu[(offset + i) % trace.gpu.len()]))
            .collect()
    };
    let gpu = gpu_pods("gpu", "bench-burst-gpu", trace.gpu.len() / 2)?;
    let cpu = (0..a.burst)
        .map(|i| pod(&format!("cpu-{i}"), "bench-burst-cpu", &trace.cpu[i % trace.cpu.len()]))
        .collect::<Result<Vec<_>>>()?;
    // The same CPU-only pods asking one extended resource that no extender manages: what
    // kube-scheduler alone spends on a pod that asks an extended resource, as GPU pods do.
    let ext = (0..a.burst)
        .map(|i| {
            pod_asking(&format!("ext-{i}"), "bench-burst-ext", &trace.cpu[i % trace.cpu.len()], Some(SLOT))
        })
        .collect::<Result<Vec<_>>>()?;
    // The same three bursts in every round, each round in another order (no kind always first), the
    // cluster put back between rounds: the ratios are the rounds' medians, as one burst of a kind
    // varied by up to 36 % from round to round on the 2-core machine.
    let bursts = [
        ("gpu", "bench-burst-gpu", gpu),
        ("cpu", "bench-burst-cpu", cpu),
        ("extended", "bench-burst-ext", ext),
    ];
    let mut rounds: Vec<BTreeMap<&str, f64>> = Vec::new();
    for round in 0..a.rounds {
        let mut rates = BTreeMap::new();
        for k in 0..bursts.len() {
            let (kind, ns, pods) = &bursts[(round + k) % bursts.len()];
            let mut line = burst(a, &r, client, kind, ns, pods.clone(), false).await?;
            line["round"] = round.into();
            rates.insert(*kind, line["pods_per_s"].as_f64().unwrap_or(0.0));
            println!("{line}");
        }
        rounds.push(rates);
        if round + 1 < a.rounds {
            remove_pods(client, &bursts.each_ref().map(|(_, ns, _)| *ns)).await?;
        }
    }
    println!("{}", ratios(&a.label, &rounds));
    let read = gpu_pods("read", "bench-burst-read", trace.gpu.len() / 4)?;
    println!("{}", burst(a, &r, client, "gpu-with-reads", "bench-burst-read", read, true).await?);
    Ok(())
}

/// The `scale-ratio` line: per round and as the rounds' median, the GPU pods' throughput over the
/// CPU-only pods' and over the extended pods'.
fn ratios(label: &str, rounds: &[BTreeMap<&str, f64>]) -> Value {
    let over =
        |other: &str| -> Vec<f64> { rounds.iter().map(|r| round(r["gpu"] / r[other].max(1e-9))).collect() };
    let (cpu, ext) = (over("cpu"), over("extended"));
    json!({"bench": "scale-ratio", "label": label, "rounds": rounds.len(),
        "gpu_per_cpu": cpu, "gpu_per_cpu_median": round(quantile(cpu.clone(), 0.5)),
        "gpu_per_extended": ext, "gpu_per_extended_median": round(quantile(ext.clone(), 0.5))})
}

/// Deletes every pod of `namespaces` at once (no kubelet runs to end them gracefully), waits until
/// the API server holds none, then 5 s more for the watches to see it and the machine to settle.
async fn remove_pods(client: &Client, namespaces: &[&str]) -> Result<()> {
    let now = DeleteParams::default().grace_period(0);
    for ns in namespaces {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        api.delete_collection(&now, &ListParams::default()).await.with_context(|| format!("pods of {ns}"))?;
    }
    let started = Instant::now();
    for ns in namespaces {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        while !api.list_metadata(&ListParams::default().limit(1)).await?.items.is_empty() {
            if started.elapsed() > Duration::from_secs(300) {
                bail!("the pods of {ns} were not gone after 300 s");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(())
}

/// Stops the deciding replica as a pod deletion does (SIGTERM to its allocator and kube-scheduler,
/// which give their Leases up) and times a new share from then until it is bound.
async fn failover(a: &Args, client: &Client) -> Result<()> {
    let r = deciding(a, client, Duration::from_secs(60)).await?;
    let started = Instant::now();
    for pid in [r.allocator_pid, r.scheduler_pid] {
        let status = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
    }
    probe(a, client, started).await?;
    let others =
        Args { replicas: a.replicas.iter().filter(|o| o.name != r.name).cloned().collect(), ..a.clone() };
    let next = deciding(&others, client, Duration::from_secs(60)).await?;
    println!(
        "{}",
        json!({"bench": "scale-failover", "label": a.label, "stopped": r.name, "deciding": next.name})
    );
    Ok(())
}

/// Creates a 10 % share (asking again while the API server does not answer) and prints the time from
/// `since` until kube-scheduler bound it.
async fn probe(a: &Args, client: &Client, since: Instant) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), PROBE_NS);
    let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
    let name = format!("probe-{millis}");
    let share = TracePod {
        name: name.clone(),
        cpu_milli: 1000,
        memory_mib: 1024,
        num_gpu: 1,
        gpu_milli: 100,
        gpu_spec: vec![],
    };
    let p = pod(&name, PROBE_NS, &share)?;
    let limit = Duration::from_secs(300);
    loop {
        match api.create(&PostParams::default(), &p).await {
            Ok(_) => break,
            Err(kube::Error::Api(e)) if e.code == 409 => break,
            Err(e) if since.elapsed() > limit => return Err(e).context("creating the probe"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let created_s = since.elapsed().as_secs_f64();
    loop {
        if let Ok(p) = api.get(&name).await
            && p.spec.and_then(|s| s.node_name).is_some()
        {
            break;
        }
        if since.elapsed() > limit {
            bail!("the probe {name} was not bound within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "{}",
        json!({"bench": "scale-probe", "label": a.label, "what": a.what, "created_after_s": round(created_s),
            "bound_after_s": round(since.elapsed().as_secs_f64())})
    );
    Ok(())
}

/// What must hold however the run went: every bound GPU pod carries an assignment naming its node, no
/// GPU pod waits with one, no card holds more than 100 %. Fails when one does not.
async fn check(a: &Args, client: &Client) -> Result<()> {
    let api: Api<Pod> = Api::all(client.clone());
    let mut params = ListParams::default().limit(500);
    let (mut bound, mut waiting, mut unassigned, mut elsewhere, mut assigned_waiting) = (0, 0, 0, 0, 0);
    let mut cards: HashMap<String, u32> = HashMap::new();
    loop {
        let page = api.list(&params).await?;
        for p in &page.items {
            let limits = p
                .spec
                .iter()
                .flat_map(|s| &s.containers)
                .filter_map(|c| c.resources.as_ref()?.limits.as_ref());
            if !limits.into_iter().any(|l| l.contains_key("nano-gpu/gpu-percent")) {
                continue;
            }
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            let assignment = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|an| an.get(ASSIGNMENT_ANNOTATION))
                .map(|text| serde_json::from_str::<Assignment>(text))
                .transpose()?;
            match (&node, &assignment) {
                (None, None) => waiting += 1,
                (None, Some(_)) => assigned_waiting += 1,
                (Some(_), None) => unassigned += 1,
                (Some(n), Some(asg)) => {
                    bound += 1;
                    if &asg.node != n {
                        elsewhere += 1;
                    }
                    for grant in asg.containers.values().flatten() {
                        *cards.entry(grant.uuid.clone()).or_default() += grant.percent.0;
                    }
                }
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    let over = cards.values().filter(|&&p| p > 100).count();
    println!(
        "{}",
        json!({"bench": "scale-check", "label": a.label, "gpu_pods_bound": bound, "gpu_pods_waiting": waiting,
            "bound_without_assignment": unassigned, "assignment_names_another_node": elsewhere,
            "waiting_with_assignment": assigned_waiting, "cards_over_100_percent": over})
    );
    if unassigned + elsewhere + assigned_waiting + over > 0 {
        bail!("the cluster is not consistent");
    }
    Ok(())
}
