//! `nano-gpu-allocator`: command-line entry. Parses flags and hands over to the library.

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use nano_gpu_allocator::commands::cli::{
    self, Format, GpushareUnitArg, InspectArgs, Kube, TopArgs, WhyArgs, demand_options,
};
use nano_gpu_allocator::sim::{self, Options};
use nano_gpu_engine::trace;
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "nano-gpu-allocator",
    version,
    about = "nano-gpu allocator: placement engine and trace simulator"
)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value = "plain", env = "NANO_GPU_LOG_FORMAT", global = true)]
    log_format: LogFormat,
    /// Kubeconfig of the cluster (`serve`, `inspect`); default: `KUBECONFIG`, `~/.kube/config`, in-cluster.
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Plain,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the scheduler extender (filter, prioritize, bind) over a cluster view built from watches.
    Serve(Box<ServeArgs>),
    /// Show every node's cards: model, percent and memory used and free, the pods on each (reads the
    /// cluster with the kubeconfig, like kubectl).
    Inspect(InspectArgs),
    /// Show granted against used GPU per pod, container and card, from every agent's `/metrics`
    /// (through the API server's pod proxy: needs `get pods/proxy` in the agents' namespace).
    Top(TopArgs),
    /// For a GPU pod (a Pending one, above all): each node's reason it does not fit, by the extender's
    /// own filter, and the fewest pods whose end would make room there.
    Why(WhyArgs),
    /// Replay a workload through the placement engine and report unallocated GPU per policy.
    Simulate(SimulateArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Address of the extender's verbs over HTTP (besides probes, metrics and the webhook). Loopback
    /// only: kube-scheduler in the same pod calls it; an extender anyone can reach would bind any pod
    /// anywhere. It refuses requests a web page could send.
    #[arg(long, env = "NANO_GPU_LISTEN", default_value = "127.0.0.1:8888", value_parser = extender_address)]
    listen: std::net::SocketAddr,
    /// Address of what operators read over HTTP: `/inspect` and the GPU map (`/map`). Loopback only:
    /// reached with `kubectl port-forward`, which reaches no verb here.
    #[arg(long, env = "NANO_GPU_OPERATOR_LISTEN", default_value = "127.0.0.1:8890", value_parser = operator_address)]
    operator_listen: std::net::SocketAddr,
    /// Address of what anyone who reaches the pod may call over HTTP: `/healthz`, `/readyz`,
    /// `/metrics` and the webhook (for the kubelet's probes and Prometheus).
    #[arg(long, env = "NANO_GPU_PUBLIC_LISTEN")]
    public_listen: Option<std::net::SocketAddr>,
    /// With `--leader-elect`: contend for the Lease only while this pod's kube-scheduler holds
    /// kube-scheduler's Lease of this name (the shipped install: kube-scheduler in the same pod calls
    /// this replica on loopback, so the decider must be where its calls come from).
    #[arg(long, env = "NANO_GPU_FOLLOW_SCHEDULER_LEASE", requires = "leader_elect")]
    follow_scheduler_lease: Option<String>,
    /// Placement policy (`default` is the best on the openb benchmark).
    #[arg(long, env = "NANO_GPU_POLICY", default_value = "default", value_parser = serving_policy)]
    policy: String,
    /// Accept gpushare's `aliyun.com/gpu-mem` as GPU memory, in this unit.
    #[arg(long, env = "NANO_GPU_GPUSHARE", value_enum)]
    gpushare: Option<GpushareUnitArg>,
    /// Place on a node only while a Ready agent pod with this label (`key=value`) runs there (the
    /// shipped install: `app.kubernetes.io/name=nano-gpu-agent`): a kubelet whose device plugin does
    /// not serve fails the GPU pods it admits. Only pods in this replica's namespace
    /// (`POD_NAMESPACE`) that a DaemonSet controls count as agents.
    #[arg(long, env = "NANO_GPU_REQUIRE_READY_AGENT", value_parser = parse_label)]
    require_ready_agent: Option<(String, String)>,
    /// Rebuild the learned target workload every this many binds.
    #[arg(long, default_value_t = 100)]
    learn_every: u64,
    /// This replica's name, for the Events it records and the Lease it holds.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// Elect one leader among replicas with a Lease; only the leader decides (every replica that can
    /// serve is ready; the leader's pod is labelled `nano-gpu/leader=true`).
    #[arg(long, env = "NANO_GPU_LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "nano-gpu-system")]
    lease_namespace: String,
    /// Name of the Lease.
    #[arg(long, default_value = "nano-gpu-allocator")]
    lease_name: String,
    /// Lease duration in seconds (renew deadline 2/3 of it, retry every 1/7 of it).
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// Address of the HTTPS endpoint: the admission webhook (`/mutate`) and `/healthz`.
    #[arg(long, env = "NANO_GPU_TLS_LISTEN")]
    tls_listen: Option<std::net::SocketAddr>,
    /// Address of the extender's verbs over HTTPS with client certificates, for a kube-scheduler
    /// outside this pod (the cluster's default scheduler calling this extender): the serving
    /// certificate of `--tls-listen`, and only clients whose certificate `--extender-client-ca`
    /// signed.
    #[arg(long, env = "NANO_GPU_EXTENDER_TLS_LISTEN", requires = "extender_client_ca")]
    extender_tls_listen: Option<std::net::SocketAddr>,
    /// CA (PEM) of the client certificates `--extender-tls-listen` accepts: one that signs nothing
    /// but kube-scheduler's extender client certificate. Re-read when the file changes (several CAs
    /// in it: any of them), so a rotation needs no restart.
    #[arg(long, env = "NANO_GPU_EXTENDER_CLIENT_CA", requires = "extender_tls_listen")]
    extender_client_ca: Option<PathBuf>,
    /// Mounted serving certificate (PEM); re-read when it changes. Without it every replica serves the
    /// certificate of the Secret `--tls-secret` (created by the first replica, renewed before it ends).
    #[arg(long, env = "NANO_GPU_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Mounted serving key (PEM).
    #[arg(long, env = "NANO_GPU_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// DNS names of the generated certificate (the Service's names). Default: the Service
    /// nano-gpu-allocator in the `--lease-namespace` namespace, `nano-gpu-allocator.<namespace>.svc`
    /// and `nano-gpu-allocator.<namespace>.svc.cluster.local`.
    #[arg(long, value_delimiter = ',')]
    tls_dns_names: Vec<String>,
    /// The scheduler the webhook gives pods that ask nano-gpu resources: the profile of the
    /// kube-scheduler in this pod that calls this extender.
    #[arg(long, env = "NANO_GPU_SCHEDULER_NAME", default_value = nano_gpu_proto::install::SCHEDULER_NAME)]
    scheduler_name: String,
    /// The RuntimeClass the webhook gives GPU pods that name none: the NVIDIA runtime's, on clusters
    /// where it is not the nodes' default runtime (as `nvidia-ctk runtime configure` without
    /// `--set-as-default` leaves it). Unset: GPU pods run under the nodes' default runtime.
    #[arg(long, env = "NANO_GPU_RUNTIME_CLASS")]
    runtime_class: Option<String>,
    /// Tolerations the webhook gives every pod that asks nano-gpu resources (those it lacks), for
    /// the taints GPU nodes carry: written as taints are, `KEY[=VALUE][:EFFECT]`, comma separated
    /// (`KEY` alone: any value); `none`: no toleration. The default tolerates GKE's GPU node pools
    /// (`nvidia.com/gpu=present:NoSchedule`), the same key elsewhere, and AKS's documented
    /// `sku=gpu:NoSchedule`.
    #[arg(
        long,
        env = "NANO_GPU_GPU_POD_TOLERATIONS",
        default_value = nano_gpu_allocator::decide::admission::DEFAULT_GPU_POD_TOLERATIONS
    )]
    gpu_pod_tolerations: nano_gpu_allocator::decide::admission::Tolerations,
    /// Secret (in the `--lease-namespace` namespace) that holds the webhook certificate all replicas
    /// serve.
    #[arg(long, env = "NANO_GPU_TLS_SECRET", default_value = "nano-gpu-allocator-webhook-tls")]
    tls_secret: String,
    /// Evict (through the Eviction API, so PodDisruptionBudgets hold) every pod an agent marked as
    /// over its GPU memory grant past the agent's grace period (`nano-gpu/overrun`); only the leader
    /// does. Off: overruns get Events, metrics and the mark, nothing more.
    #[arg(long, env = "NANO_GPU_EVICT_OVERRUNS")]
    evict_overruns: bool,
    /// Allocate the ResourceClaims of nano-gpu's DeviceClass (`gpu.nano-gpu.io`; component
    /// `deploy/components/dra`): the leader picks node and cards for each pending pod that uses them
    /// and writes the claims' allocations before kube-scheduler binds it. Needs Kubernetes 1.34+
    /// (`resource.k8s.io/v1`; shares need DRAConsumableCapacity, on by default from 1.36).
    #[arg(long, env = "NANO_GPU_DRA")]
    dra: bool,
    /// With `--dra`: the webhook turns every pod asking `nano-gpu/gpu-percent` or
    /// `nano-gpu/gpu-memory` into a pod with claims of nano-gpu's class (each GPU container's claim
    /// made from the template of its shape, which the allocator makes), so that pods run unchanged on
    /// nodes whose agent serves DRA. Without it only pods annotated `nano-gpu/front-end: dra` are.
    #[arg(long, env = "NANO_GPU_DRA_SHARES", requires = "dra")]
    dra_shares: bool,
    /// What the extender's filter answers: `one`, the node the policy chooses, alone, so that
    /// kube-scheduler binds it without scoring (fast; its own soft preferences do not weigh in for GPU
    /// pods); `fitting`, every node that fits, the choice then made by prioritize's score added to
    /// kube-scheduler's own.
    #[arg(long, env = "NANO_GPU_FILTER_ANSWERS", value_enum, default_value = "one")]
    filter_answers: FilterAnswersArg,
    /// Prometheus (`http://host:port`) scraping the agents: each card's recent utilisation breaks
    /// the policy's ties (equal nodes, identical cards) toward the less busy. Absent, slow or
    /// stale: placement is exactly the policy's.
    #[arg(long, env = "NANO_GPU_PROMETHEUS_URL")]
    prometheus_url: Option<String>,
    /// How often the card load is read, in seconds (at least 1).
    #[arg(long, env = "NANO_GPU_LOAD_REFRESH_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    load_refresh_seconds: u64,
    /// A load reading older than this many seconds (at least 1) is dropped.
    #[arg(long, env = "NANO_GPU_LOAD_STALE_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    load_stale_seconds: u64,
    /// MutatingWebhookConfiguration whose caBundle gets the shared CA.
    #[arg(long, default_value = "nano-gpu-allocator")]
    webhook_config: String,
}

/// `serve --filter-answers`.
#[derive(Clone, Copy, ValueEnum)]
enum FilterAnswersArg {
    One,
    Fitting,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum WorkloadSource {
    Given,
    Online,
}

#[derive(Args)]
struct SimulateArgs {
    /// Node list in the openb CSV format (sn,cpu_milli,memory_mib,gpu,model). Without it: a built-in
    /// synthetic cluster.
    #[arg(long, requires = "pods")]
    nodes: Option<PathBuf>,
    /// Pod list in the openb CSV format (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]).
    #[arg(long, requires = "nodes")]
    pods: Option<PathBuf>,
    /// Policy to replay (repeatable): a policy name, `default`, or `all`.
    #[arg(long = "policy", default_value = "default")]
    policies: Vec<String>,
    /// Seeds: `42`, `42..51` (inclusive) or `1,5,9`.
    #[arg(long, default_value = "42..51")]
    seeds: String,
    /// Decide through the extender path: filter, 0..=10 scores, kube-scheduler's pick, bind.
    #[arg(long)]
    through_extender: bool,
    /// Arrived workload to top up to, as a multiple of GPU capacity.
    #[arg(long, default_value_t = 1.3, value_parser = tune)]
    tune: f64,
    /// Where fragmentation-aware policies get their target workload: `given` (the typical shapes of
    /// the whole pod list, as the paper) or `online` (learned from the pods as they arrive).
    #[arg(long, value_enum, default_value = "given")]
    workload: WorkloadSource,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Also write an SVG plot of unallocated GPU against arrived workload.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Worker threads (default: the number of CPUs).
    #[arg(long)]
    threads: Option<usize>,
}

fn parse_seeds(text: &str) -> Result<Vec<u64>> {
    let bad = || format!("--seeds {text:?}: expected N, A..B or a comma-separated list");
    if let Some((a, b)) = text.split_once("..") {
        let a: u64 = a.trim().parse().with_context(bad)?;
        let b: u64 = b.trim_start_matches('=').trim().parse().with_context(bad)?;
        if b < a || b - a > 10_000 {
            bail!("{}", bad());
        }
        return Ok((a..=b).collect());
    }
    text.split(',').map(|s| s.trim().parse::<u64>().with_context(bad)).collect()
}

fn simulate(args: SimulateArgs) -> Result<()> {
    let (nodes, pods) = match (&args.nodes, &args.pods) {
        (Some(n), Some(p)) => (sim::read_nodes(n)?, sim::read_pods(p)?),
        _ => trace::synthetic(42),
    };
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let opts = Options {
        policies: sim::expand_policies(&args.policies)?,
        seeds: parse_seeds(&args.seeds)?,
        through_extender: args.through_extender,
        tune: args.tune,
        threads,
        online_workload: args.workload == WorkloadSource::Online,
    };
    tracing::info!(nodes = nodes.len(), pods = pods.len(), policies = ?opts.policies, seeds = opts.seeds.len(), "simulating");
    let report = sim::simulate(&nodes, &pods, &opts)?;
    match args.format {
        Format::Table => print!("{}", report.to_table()),
        Format::Json => println!("{}", report.to_json()),
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, report.to_svg()).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `--tune`: a multiple of GPU capacity in (0, 10].
fn tune(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(t) if t > 0.0 && t <= 10.0 => Ok(t),
        Ok(_) => Err("must be in (0, 10]".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `--listen`: on loopback only.
fn extender_address(text: &str) -> Result<std::net::SocketAddr, String> {
    loopback(
        text,
        "the extender (filter, bind) must listen on loopback, where only kube-scheduler in the same pod \
         reaches it; probes and metrics go on --public-listen",
    )
}

/// `--operator-listen`: on loopback only.
fn operator_address(text: &str) -> Result<std::net::SocketAddr, String> {
    loopback(
        text,
        "/inspect and the GPU map name every pod; they stay on loopback, reached with kubectl port-forward",
    )
}

/// An address that must be on loopback, else `why`.
fn loopback(text: &str, why: &str) -> Result<std::net::SocketAddr, String> {
    let address: std::net::SocketAddr = text.parse().map_err(|e| format!("{e}"))?;
    if address.ip().is_loopback() { Ok(address) } else { Err(why.to_owned()) }
}

/// `serve --policy`: a policy the allocator can serve (the `simulate`-only variants refused).
fn serving_policy(text: &str) -> Result<String, String> {
    use nano_gpu_engine::policy;
    let known = || policy::NAMES.join(", ");
    if text.ends_with(policy::first_fit::SUFFIX) {
        return Err(format!(
            "the {} variants model kube-scheduler's DRA card choice for `simulate`; serve one of {}",
            policy::first_fit::SUFFIX,
            known()
        ));
    }
    match policy::by_name(text, 0) {
        Some(_) => Ok(text.to_owned()),
        None => Err(format!("unknown policy {text:?}; known: {}", known())),
    }
}

fn serve(args: ServeArgs, kubeconfig: Option<PathBuf>) -> Result<()> {
    use nano_gpu_allocator::service::{bind_api::KubeBinder, server, watch};
    use nano_gpu_allocator::state;
    use nano_gpu_engine::{engine::Engine, model::Cluster, policy};
    let policy = policy::by_name(&args.policy, 0)
        .with_context(|| format!("unknown policy {:?}; known: {}", args.policy, policy::NAMES.join(", ")))?;
    let demand = demand_options(args.gpushare);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let client = nano_gpu_runtime::connect(kubeconfig.as_deref()).await.context("connecting to the API server")?;
        let client_for_tls = client.clone();
        let engine = Engine::new(Cluster::new(), policy, Default::default());
        let mut view = state::ClusterState::new(engine, 0, demand).learn_workload(args.learn_every);
        if let Some((key, value)) = &args.require_ready_agent {
            view = view.require_ready_agents(key, value, &args.lease_namespace);
        }
        let mut shared =
            server::Shared::new(view, KubeBinder::new(client.clone()))
            .with_scheduler_name(&args.scheduler_name)
            .with_runtime_class(args.runtime_class.as_deref())
            .with_tolerations(args.gpu_pod_tolerations.0.clone())
            .with_filter_answers(match args.filter_answers {
                FilterAnswersArg::One => server::FilterAnswers::One,
                FilterAnswersArg::Fitting => server::FilterAnswers::Fitting,
            })
            .with_shares(match (args.dra, args.dra_shares) {
                (_, true) => nano_gpu_allocator::decide::admission::Shares::Claims,
                (true, false) => nano_gpu_allocator::decide::admission::Shares::ClaimsIfAnnotated,
                (false, false) => nano_gpu_allocator::decide::admission::Shares::DevicePlugin,
            });
        // Every background loop, owned: the first to end ends the service (nano_gpu_runtime::tasks).
        let mut tasks = nano_gpu_runtime::tasks::Tasks::default();
        // The election, and what gives its Lease up at shutdown.
        let mut election = None;
        if args.leader_elect {
            use nano_gpu_allocator::service::leader;
            shared = shared.with_leadership(std::sync::Arc::new(leader::Leadership::elected()));
            let identity = args.pod_name.clone().unwrap_or_else(|| format!("nano-gpu-allocator-{}", std::process::id()));
            let lease = std::time::Duration::from_secs(args.lease_seconds.max(3));
            let timing = leader::Timing { lease, renew_deadline: lease * 2 / 3, retry: lease / 7 };
            let api = kube::Api::namespaced(client.clone(), &args.lease_namespace);
            // The label shows which pod decides (when we know our pod).
            let label = args.pod_name.clone().map(|pod| {
                leader::LeaderLabel::new(kube::Api::namespaced(client.clone(), &args.lease_namespace), pod)
            });
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let view = shared.view.clone();
            let synced = async move {
                while !view.synced() {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            };
            let follow = args.follow_scheduler_lease.clone();
            // The newest pod write, from a write on our own pod (one request), else from a list.
            let newest = std::sync::Arc::new(match &args.pod_name {
                Some(pod) => watch::Newest::OwnPod(kube::Api::namespaced(client.clone(), &args.lease_namespace), pod.clone()),
                None => watch::Newest::List(kube::Api::all(client.clone())),
            });
            // While it decides, a pod watch that shows nothing is checked with a write of its own.
            if matches!(*newest, watch::Newest::OwnPod(..)) {
                let (newest, view, leadership) = (newest.clone(), shared.view.clone(), shared.leader.clone());
                let leads = move || leadership.is_leader();
                let check = watch::check_pod_watch(newest, view, leads, watch::POD_WATCH_CHECK, timing.call_limit());
                tasks.spawn("pod watch check", check);
            }
            let view = shared.view.clone();
            let catch_up: leader::CatchUp = Box::new(move |limit| {
                let (newest, view) = (newest.clone(), view.clone());
                Box::pin(async move { watch::caught_up(&newest, &view, limit).await })
            });
            let part = leader::Election {
                api,
                name: args.lease_name.clone(),
                me: identity,
                timing,
                label,
                follow,
                catch_up: Some(catch_up),
            };
            let run = leader::run(part, shared.leader.clone(), synced, async {
                let _ = stopped.await;
            });
            election = Some((tokio::spawn(run), stop));
        }
        if args.evict_overruns {
            use kube::runtime::events::{Recorder, Reporter};
            // A 429 of an eviction is a PodDisruptionBudget's answer, not load to back off from.
            let client = nano_gpu_runtime::connect_without_retries(kubeconfig.as_deref())
                .await
                .context("connecting to the API server")?;
            let reporter = Reporter { controller: "nano-gpu-allocator".into(), instance: args.pod_name.clone() };
            let recorder = Recorder::new(client.clone(), reporter);
            let evictor = nano_gpu_allocator::service::overrun_evict::Evictor::new(client.clone(), shared.leader.clone(), recorder);
            tracing::info!("evicting pods marked as over their GPU memory grant");
            tasks.spawn("overrun eviction", evictor.run());
        }
        {
            use kube::runtime::events::{Recorder, Reporter};
            // A 429 of an eviction is a PodDisruptionBudget's answer, not load to back off from.
            let client = nano_gpu_runtime::connect_without_retries(kubeconfig.as_deref())
                .await
                .context("connecting to the API server")?;
            let reporter = Reporter { controller: "nano-gpu-allocator".into(), instance: args.pod_name.clone() };
            let recorder = Recorder::new(client.clone(), reporter);
            let evictions = nano_gpu_allocator::service::preempt_evict::run(client, shared.view.clone(), shared.leader.clone(), recorder);
            tasks.spawn("preemption eviction", evictions);
        }
        // How the watches list, read once from the API server's version.
        let listing = watch::Listing::of(&client).await;
        tracing::info!(?listing, "watching nodes, pods and claims");
        if args.dra {
            use kube::runtime::events::{Recorder, Reporter};
            let reporter = Reporter { controller: "nano-gpu-allocator".into(), instance: args.pod_name.clone() };
            let recorder = Recorder::new(client.clone(), reporter);
            tracing::info!("allocating the claims of nano-gpu's DeviceClass");
            tasks.spawn("claims", nano_gpu_allocator::service::dra::run(
                client.clone(),
                shared.view.clone(),
                shared.leader.clone(),
                recorder,
                listing,
            ));
        }
        if let Some(url) = args.prometheus_url.clone() {
            let (every, stale) = (args.load_refresh_seconds, args.load_stale_seconds);
            tasks.spawn("load", nano_gpu_allocator::service::load::follow(
                url,
                shared.view.clone(),
                std::time::Duration::from_secs(every),
                std::time::Duration::from_secs(stale),
            ));
        }
        if let Some(me) = args.pod_name.clone() {
            let pods = kube::Api::namespaced(client.clone(), &args.lease_namespace);
            tasks.spawn("requeue", nano_gpu_allocator::service::requeue::run(pods, me, shared.view.clone(), shared.leader.clone()));
        }
        tasks.spawn("filter holds", server::expire_filter_holds(shared.view.clone()));
        tasks.spawn("watches", watch::run(client, shared.view.clone(), args.pod_name, listing));
        use nano_gpu_runtime::listen::{self, Bounds};
        let bind = |addr: std::net::SocketAddr| async move {
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("listening on {addr}"))
        };
        let listener = bind(args.listen).await?;
        tracing::info!(listen = %args.listen, "serving the scheduler extender");
        let loopback = axum::middleware::from_fn(server::loopback_host_only);
        let app = server::router(shared.clone());
        let operators = server::operator_router(shared.clone()).layer(loopback.clone());
        let ends = shared.metrics.certificates.clone();
        let webhook = server::webhook_router(shared.clone());
        let public = server::public_router(shared);
        let listener_ops = bind(args.operator_listen).await?;
        tracing::info!(listen = %args.operator_listen, "serving /inspect and the GPU map");
        tasks.spawn("operators HTTP", listen::serve_plain("operators", listener_ops, operators, Bounds::LOOPBACK, std::future::pending()));
        if let Some(addr) = args.public_listen {
            let listener = bind(addr).await?;
            tracing::info!(listen = %addr, "serving probes, metrics and the webhook over HTTP");
            tasks.spawn("public HTTP", listen::serve_plain("public", listener, public, Bounds::REACHABLE, std::future::pending()));
        }
        if args.tls_listen.is_some() || args.extender_tls_listen.is_some() {
            use nano_gpu_allocator::service::tls;
            let certs = match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => {
                    std::sync::Arc::new(tls::CertSource::files(cert.clone(), key.clone(), ends.clone())?)
                }
                _ => {
                    let api = kube::Api::namespaced(client_for_tls.clone(), &args.lease_namespace);
                    let dns = match args.tls_dns_names.is_empty() {
                        true => tls::service_dns_names("nano-gpu-allocator", &args.lease_namespace),
                        false => args.tls_dns_names.clone(),
                    };
                    let m = tls::secret::ensure(&api, &args.tls_secret, &dns).await?;
                    ends.set(tls::Certificate::Serving, m.not_after);
                    let published = tls::secret::publish(&client_for_tls, &args.webhook_config, &m.ca_pem).await;
                    let config = tls::server_config(m.cert_pem.as_bytes(), m.key_pem.as_bytes())?;
                    let certs = std::sync::Arc::new(tls::CertSource::Shared(std::sync::RwLock::new(config)));
                    let (name, webhook) = (args.tls_secret.clone(), args.webhook_config.clone());
                    let keeper = tls::secret::keep(api, name, dns, certs.clone(), m, client_for_tls.clone(), webhook, published, ends.clone());
                    tasks.spawn("certificate keeper", keeper);
                    certs
                }
            };
            if let Some(addr) = args.tls_listen {
                let listener = bind(addr).await?;
                tracing::info!(listen = %addr, "serving the webhook over HTTPS");
                tasks.spawn("webhook HTTPS", tls::serve("webhook", listener, webhook, Bounds::REACHABLE, certs.clone(), None));
            }
            if let (Some(addr), Some(ca)) = (args.extender_tls_listen, &args.extender_client_ca) {
                let clients = std::sync::Arc::new(tls::ClientCa::open(ca.clone(), ends.clone())?);
                let listener = bind(addr).await?;
                tracing::info!(listen = %addr, "serving the scheduler extender over HTTPS to clients with a certificate");
                tasks.spawn("extender HTTPS", tls::serve("extender", listener, app.clone(), Bounds::REACHABLE, certs, Some(clients)));
            }
        }
        tracing::info!(tasks = tasks.len(), "background tasks started");
        tokio::select! {
            () = listen::serve_plain("extender", listener, app.layer(loopback), Bounds::LOOPBACK, shutdown(election)) => {}
            ended = tasks.first_ended() => bail!("{ended}; exiting, for the kubelet to start the allocator again"),
        }
        tasks.shutdown().await;
        Ok(())
    })
}

/// A `key=value` label.
fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{text:?} is not a label key=value")),
    }
}

/// Resolves at SIGTERM, once the election (if any) let its binds in flight end and gave the Lease and
/// the leader label up: another replica leads at once, while this one drains its open connections.
async fn shutdown(election: Option<(tokio::task::JoinHandle<()>, tokio::sync::oneshot::Sender<()>)>) {
    nano_gpu_runtime::terminated().await;
    tracing::info!("shutting down");
    if let Some((task, stop)) = election {
        let _ = stop.send(());
        // Within the pod's 30 s grace period: binds settling, then two calls of the election.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(25), task).await;
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    nano_gpu_runtime::init_logging(matches!(cli.log_format, LogFormat::Json));
    match cli.command {
        Command::Simulate(args) => simulate(args),
        Command::Serve(args) => serve(*args, cli.kubeconfig),
        Command::Inspect(args) => cli::inspect(args, &Kube { kubeconfig: cli.kubeconfig, context: None }),
        Command::Top(args) => cli::top(args, &Kube { kubeconfig: cli.kubeconfig, context: None }),
        Command::Why(args) => cli::why(args, &Kube { kubeconfig: cli.kubeconfig, context: None }),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The book's flag reference is this binary's clap definition (`docs/src/reference/`).
    #[test]
    fn cli_reference_is_the_books_page() {
        let command = super::Cli::command();
        nano_gpu_runtime::cli_reference::check_book_page(
            env!("CARGO_MANIFEST_DIR"),
            "cli-allocator.md",
            "nano-gpu-allocator flags",
            &command,
        );
    }
}
