//! Soak: GPU pods created and deleted without pause (random sizes, some asking a card model) on the
//! local cluster's real nodes, while every part of the system is restarted in turn: the allocator's
//! leader pod, its kube-scheduler, an agent (deleted, killed, and rolled over), kube-apiserver, etcd,
//! kube-controller-manager, a kubelet, a containerd. Then what the fault suite checks: every pod the
//! kubelet got runs, none failed, no card over 100 % or its memory, the allocator's accounting equal
//! to the assignments, and each pod still waiting truly fits nowhere. All along, the resident memory
//! and open file descriptors of every allocator and agent process are sampled and printed.
//!
//! `NANO_GPU_SOAK_SECONDS` sets the churn's length (180 in the test run); `hack/soak.sh [MINUTES]`
//! runs a long one (30 minutes unless told). `NANO_GPU_SOAK_SEED` repeats a run's choices.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_tests::checks::check_consistency;
use nano_gpu_tests::cluster::{Cluster, NS, gpu_pod, phase, wait_until};
use nano_gpu_tests::kubelet_log;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Sizes asked, in percent of a card (200: two whole cards).
const SIZES: [u32; 8] = [10, 20, 25, 30, 50, 70, 100, 200];

/// The models of the cluster's cards (`hack/cards.sh`), for pods that ask one.
const MODELS: [&str; 4] = ["NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA A10", "Tesla V100-SXM2-32GB"];

/// What is restarted, in turn.
const RESTARTS: [&str; 10] = [
    "allocator-leader",
    "kube-scheduler",
    "agent-delete",
    "agent-kill",
    "kube-apiserver",
    "agent-rollout",
    "etcd",
    "kubelet",
    "kube-controller-manager",
    "containerd",
];

/// Pods alive at most at once (the cluster holds about 48 shares of 30 %: some always wait).
const MAX_PODS: usize = 60;

/// xorshift64*: the run's choices, repeatable from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One sample of one allocator or agent process.
struct Sample {
    at: Duration,
    pid: u32,
    program: String,
    rss_kib: u64,
    fds: usize,
}

/// The allocator and agent processes of this cluster (their cgroup is under the cluster's prefix):
/// resident memory and open file descriptors now.
fn sample(prefix: &str, at: Duration) -> Vec<Sample> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return out };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let dir = e.path();
        let Ok(cmdline) = std::fs::read(dir.join("cmdline")) else { continue };
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        let program = String::from_utf8_lossy(argv0).rsplit('/').next().unwrap_or_default().to_owned();
        if !matches!(program.as_str(), "nano-gpu-allocator" | "nano-gpu-agent") {
            continue;
        }
        // The agent's keeper is the same program.
        let keeper = cmdline.split(|b| *b == 0).any(|arg| arg == b"keeper");
        let program = if keeper { format!("{program} keeper") } else { program };
        let ours = std::fs::read_to_string(dir.join("cgroup")).is_ok_and(|c| c.contains(prefix));
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
        let fds = std::fs::read_dir(dir.join("fd")).map(|d| d.count());
        if let (true, Some(rss_kib), Ok(fds)) = (ours, rss_kib, fds) {
            out.push(Sample { at, pid, program, rss_kib, fds });
        }
    }
    out
}

/// What the samples of each process say, one line each; fails on a process whose memory or
/// descriptors grew past any steady state over the run.
fn report(samples: &[Sample]) {
    let mut by_pid: BTreeMap<(String, u32), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_pid.entry((s.program.clone(), s.pid)).or_default().push(s);
    }
    eprintln!("soak: per process: samples, seconds, resident MiB first/median/last/max, fds first/last/max");
    let mib = |kib: u64| kib as f64 / 1024.0;
    for ((program, pid), s) in &by_pid {
        let mut rss: Vec<u64> = s.iter().map(|x| x.rss_kib).collect();
        let (first, last) = (rss[0], rss[rss.len() - 1]);
        let (first_fds, last_fds) = (s[0].fds, s[s.len() - 1].fds);
        let max_fds = s.iter().map(|x| x.fds).max().unwrap_or(0);
        let span = s[s.len() - 1].at - s[0].at;
        rss.sort_unstable();
        let (median, max) = (rss[rss.len() / 2], rss[rss.len() - 1]);
        eprintln!(
            "soak: {program} {pid}: {} samples, {:.0} s, {:.1}/{:.1}/{:.1}/{:.1} MiB, fds {first_fds}/{last_fds}/{max_fds}",
            s.len(),
            span.as_secs_f64(),
            mib(first),
            mib(median),
            mib(last),
            mib(max)
        );
        // Gross growth only: a steady process stays well inside twice its median (plus start-up).
        assert!(last <= 2 * median + 32 * 1024, "{program} {pid}: resident memory grew to {} MiB", mib(last));
        assert!(last_fds <= first_fds.max(16) * 2 + 64, "{program} {pid}: descriptors grew to {last_fds}");
    }
}

/// kubectl for the churn: a failure (the API server away) is only logged.
fn kubectl_quiet(cluster: &Cluster, args: &[&str]) -> Option<String> {
    let out = cluster.kubectl(&[&["--request-timeout=10s"], args].concat());
    if out.status.success() {
        Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        eprintln!("soak: kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
        None
    }
}

/// Starts restart `what`; a control-plane crash runs in the background (the child ends once the
/// program was started again). Also the node it acts on (if it acts on one).
fn restart(cluster: &Cluster, what: &str, rng: &mut Rng) -> (Option<std::process::Child>, String) {
    let node = format!("node-{}", 1 + rng.below(3));
    (restart_on(cluster, what, &node), node)
}

/// [`restart`] on `node`.
fn restart_on(cluster: &Cluster, what: &str, node: &str) -> Option<std::process::Child> {
    let system = "nano-gpu-system";
    let leader = || cluster.allocator_leader();
    let kill = |pod: &str, container: &str| {
        if let Err(e) = cluster.try_signal_container(system, pod, container, "SIGKILL") {
            eprintln!("soak: {e}");
        }
    };
    let agent = || {
        let selector = format!("spec.nodeName={node}");
        let name = "jsonpath={.items[0].metadata.name}";
        let args = ["get", "pods", "-n", system, "-l", "app.kubernetes.io/name=nano-gpu-agent"];
        let args = [&args[..], &["--field-selector", &selector, "-o", name]].concat();
        kubectl_quiet(cluster, &args).filter(|p| !p.is_empty())
    };
    eprintln!("soak: restarting {what} ({node} if on a node)");
    match what {
        "allocator-leader" => {
            if let Some(pod) = leader() {
                kubectl_quiet(cluster, &["delete", "pod", &pod, "-n", system, "--wait=false"]);
            }
        }
        "kube-scheduler" => {
            if let Some(pod) = leader() {
                kill(&pod, "kube-scheduler");
            }
        }
        // Deleted, as an operator does: terminating, its node takes no new GPU pod.
        "agent-delete" => {
            if let Some(pod) = agent() {
                kubectl_quiet(cluster, &["delete", "pod", &pod, "-n", system, "--wait=false"]);
            }
        }
        // A crash of the agent process: its keeper starts it again and holds the kubelet's calls.
        "agent-kill" => {
            if let Some(pod) = agent()
                && let Err(e) = cluster.kill_children(system, &pod, "agent")
            {
                eprintln!("soak: {e}");
            }
        }
        "agent-rollout" => {
            kubectl_quiet(cluster, &["rollout", "restart", "daemonset/nano-gpu-agent", "-n", system]);
        }
        "kubelet" | "containerd" => cluster.restart(what, node),
        "kube-apiserver" | "etcd" | "kube-controller-manager" => return Some(cluster.crash(what, 3)),
        _ => unreachable!("{what}"),
    }
    None
}

/// Whether pod `p` failed as a restarted kubelet fails the pods of its first admissions (upstream,
/// kubernetes#109595, #133382), either way the fault suite knows:
/// - it counts the devices its checkpoint holds for pods that left as still held until its pod
///   sources are ready, so a pod bound around the restart is refused for want of device IDs the
///   allocator rightly saw free. The agents keep the checkpoints clean (`nano_gpu_agent::kubelet::checkpoint`),
///   which leaves the pods that left in the moment before the kill. Only that message, on a node
///   whose kubelet the soak restarted within the last 30 s;
/// - it denied the pod for want of a healthy device before it had our devices, which we sent
///   promptly: only as its own log shows it ([`kubelet_log::denied_before_our_devices`]).
///
/// `None` while its log cannot tell yet.
fn by_kubelet_restart(cluster: &Cluster, p: &Pod, restarts: &[(String, Instant)]) -> Option<bool> {
    let message = p.status.as_ref().and_then(|s| s.message.as_deref()).unwrap_or_default();
    let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or_default();
    let restarted = restarts.iter().any(|(n, at)| n == node && at.elapsed() < Duration::from_secs(30));
    let name = p.metadata.name.as_deref().unwrap_or_default();
    if restarted && message.contains("requested number of devices unavailable") {
        return Some(true);
    }
    if !restarts.iter().any(|(n, _)| n == node) {
        return Some(false);
    }
    kubelet_log::denied_before_our_devices(cluster, NS, name, node, message)
}

/// Why pod `p` failed, on which node, and when it was seen failed (from the churn's start).
fn failure(p: &Pod, started: Instant) -> String {
    let s = p.status.as_ref().unwrap();
    let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("-");
    format!(
        "{} {} (node {node}, seen at {:?})",
        s.reason.as_deref().unwrap_or(""),
        s.message.as_deref().unwrap_or(""),
        started.elapsed()
    )
}

/// What a pod asks: its percent and the models it allows (empty: any).
fn demand(p: &Pod) -> (u32, Vec<String>) {
    let c = &p.spec.as_ref().unwrap().containers[0];
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref()).unwrap();
    let percent = limits["nano-gpu/gpu-percent"].0.parse().unwrap();
    let model = p.metadata.annotations.as_ref().and_then(|a| a.get("nano-gpu/gpu-model"));
    (percent, model.into_iter().cloned().collect())
}

/// Whether the allocator's view (`/inspect`) has room for `percent` on one node, on cards of
/// `models` (empty: any): a share needs one card with that percent and its part of the card's
/// memory free; whole cards need that many cards entirely free.
fn room(view: &Value, percent: u32, models: &[String]) -> Option<String> {
    for node in view["nodes"].as_array().unwrap() {
        let cards: Vec<&Value> = node["cards"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["healthy"].as_bool() == Some(true))
            .filter(|c| models.is_empty() || models.iter().any(|m| c["model"].as_str() == Some(m)))
            .collect();
        let free = |c: &&Value, p: u32| {
            let mem = MiB(c["memoryMiB"].as_u64().unwrap());
            c["percentFree"].as_u64().unwrap() >= u64::from(p)
                && c["memoryFreeMiB"].as_u64().unwrap() >= Percent(p).of(mem).0
        };
        let fits = if percent <= 100 {
            cards.iter().any(|c| free(c, percent))
        } else {
            cards.iter().filter(|c| free(c, 100)).count() >= (percent / 100) as usize
        };
        if fits {
            return node["name"].as_str().map(String::from);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_with_every_part_restarted_loses_no_pod_and_leaks_nothing() {
    let seconds: u64 =
        std::env::var("NANO_GPU_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(180);
    let seed: u64 =
        std::env::var("NANO_GPU_SOAK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
        });
    // Every kind once in a short run (16 s apart in 180 s), a restart every 2 min in a long one.
    let every = Duration::from_secs((seconds / (RESTARTS.len() as u64 + 1)).clamp(10, 120));
    let sample_every = Duration::from_secs((seconds / 30).clamp(5, 30));
    eprintln!("soak: {seconds} s of churn, a restart every {every:?}, seed {seed} (NANO_GPU_SOAK_SEED)");
    let mut rng = Rng(seed);

    let cluster = Cluster::up("soak", 3);
    let client = cluster.client().await;
    cluster.ok(&["create", "namespace", NS]);
    let prefix = cluster.env["CGROUP_PREFIX"].clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    let started = Instant::now();
    let (mut samples, mut next_sample) = (sample(&prefix, Duration::ZERO), started + sample_every);
    let (mut next_restart, mut restarts) = (started + every, 0usize);
    let mut crash: Option<std::process::Child> = None;
    let mut failed: BTreeMap<String, String> = BTreeMap::new();
    // Pods the kubelet failed in its first admissions after a restart (upstream; see below).
    let mut upstream: BTreeMap<String, String> = BTreeMap::new();
    let mut kubelet_restarts: Vec<(String, Instant)> = Vec::new();
    let (mut created, mut deleted) = (0usize, 0usize);
    while started.elapsed() < Duration::from_secs(seconds) {
        let listed = tokio::time::timeout(Duration::from_secs(10), pods.list(&ListParams::default())).await;
        if let Ok(Ok(list)) = listed {
            for p in list.items.iter().filter(|p| phase(p) == "Failed") {
                let name = p.metadata.name.clone().unwrap();
                if failed.contains_key(&name) || upstream.contains_key(&name) {
                    continue;
                }
                let why = failure(p, started);
                match by_kubelet_restart(&cluster, p, &kubelet_restarts) {
                    Some(true) => upstream.insert(name, why),
                    Some(false) => failed.insert(name, why),
                    None => continue,
                };
            }
            let live: Vec<String> = list.items.iter().filter_map(|p| p.metadata.name.clone()).collect();
            if live.len() < 20 || (live.len() < MAX_PODS && rng.below(10) < 6) {
                let size = SIZES[rng.below(SIZES.len())];
                let annotations = if rng.below(10) < 3 {
                    json!({"nano-gpu/gpu-model": MODELS[rng.below(MODELS.len())]})
                } else {
                    json!({})
                };
                let name = format!("soak-{created:05}");
                let pod =
                    gpu_pod(&name, &[("c", &[("nano-gpu/gpu-percent", &size.to_string())])], annotations);
                // Refused while no allocator serves the webhook or the API server is away: next round.
                if pods.create(&PostParams::default(), &pod).await.is_ok() {
                    created += 1;
                }
            } else if !live.is_empty() {
                let name = &live[rng.below(live.len())];
                if pods.delete(name, &DeleteParams::default()).await.is_ok() {
                    deleted += 1;
                }
            }
        }
        if Instant::now() >= next_restart && crash.as_mut().is_none_or(|c| c.try_wait().unwrap().is_some()) {
            eprintln!("soak: {:?} into the churn, pod {created} created", started.elapsed());
            let what = RESTARTS[restarts % RESTARTS.len()];
            let node;
            (crash, node) = restart(&cluster, what, &mut rng);
            if what == "kubelet" {
                kubelet_restarts.push((node, Instant::now()));
            }
            restarts += 1;
            next_restart = Instant::now() + every;
        }
        if Instant::now() >= next_sample {
            samples.extend(sample(&prefix, started.elapsed()));
            next_sample += sample_every;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if let Some(mut c) = crash {
        assert!(c.wait().unwrap().success(), "the last crash's restart failed");
    }
    eprintln!(
        "soak: churn over after {:?}: {created} created, {deleted} deleted, {restarts} restarts",
        started.elapsed()
    );

    // Settled: the parts ready again, every pod the kubelets got Running, none failed.
    for what in ["deployment/nano-gpu-allocator", "daemonset/nano-gpu-agent"] {
        cluster.ok(&["rollout", "status", what, "-n", "nano-gpu-system", "--timeout=240s"]);
    }
    wait_until("every bound pod Running", Duration::from_secs(240), || async {
        let list = pods.list(&ListParams::default()).await.unwrap();
        list.items.iter().all(|p| {
            let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            !bound || matches!(phase(p), "Running" | "Failed")
        })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let list = pods.list(&ListParams::default()).await.unwrap();
    for p in list.items.iter().filter(|p| phase(p) == "Failed") {
        let name = p.metadata.name.clone().unwrap();
        if upstream.contains_key(&name) || failed.contains_key(&name) {
            continue;
        }
        // Not told before, or failed since: judged now, and ours unless its kubelet's log says.
        let why = failure(p, started);
        if by_kubelet_restart(&cluster, p, &kubelet_restarts) == Some(true) {
            upstream.insert(name, why);
        } else {
            failed.insert(name, why);
        }
    }
    if !upstream.is_empty() {
        eprintln!(
            "soak: failed by a restarted kubelet's first admissions (upstream, kubernetes#109595; see \
             the README): {upstream:#?}"
        );
    }
    samples.extend(sample(&prefix, started.elapsed()));
    report(&samples);
    assert!(failed.is_empty(), "pods failed: {failed:#?}");
    let running = check_consistency(&cluster, &client).await;
    // kube-scheduler retries a waiting pod after the events that may make room (with backoff): each
    // waiting pod must come to fit nowhere.
    wait_until("no waiting pod fits anywhere", Duration::from_secs(60), || async {
        let view = cluster.inspect();
        let list = pods.list(&ListParams::default()).await.unwrap();
        let fitting: Vec<String> = list
            .items
            .iter()
            .filter(|p| phase(p) == "Pending" && p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
            .filter_map(|p| {
                let (percent, models) = demand(p);
                let node = room(&view, percent, &models)?;
                Some(format!("{} ({percent} %, {models:?}) fits on {node}", p.metadata.name.as_deref()?))
            })
            .collect();
        if !fitting.is_empty() {
            eprintln!("soak: waiting but fitting: {fitting:?}");
        }
        fitting.is_empty()
    })
    .await;
    let waiting = list.items.iter().filter(|p| phase(p) == "Pending").count();
    eprintln!("soak: settled: {running} Running and checked, {waiting} waiting (none fits)");
}
