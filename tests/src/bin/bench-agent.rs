//! Benchmark of the node agent: the real `nano-gpu-agent` (fake inventory of 8 cards, a node name, a
//! fake API server holding the node's pods, a fake kubelet over real unix sockets), driven the way the
//! kubelet's device manager admits pods: for each pod, pod-resources lists it, then
//! GetPreferredAllocation → Allocate → PreStartContainer over the agent's unix socket. While it
//! measures, at least `--pending` placed pods wait on the node. Several rounds, each with a fresh
//! agent. Prints one JSON line:
//! `{"cards":8,"pending_pods":50,"allocate_p99_ms":…,"preferred_p99_ms":…,"rss_mib":…,…}`.
//!
//! `steered` counts the containers whose preferred IDs were all on the card their assignment names;
//! `idle_cpu_percent` is the agent's CPU use over `--idle-seconds` with nothing to do (no busy polling
//! means close to 0). Usage: `bench-agent [--cards N] [--pending N] [--measured N] [--rounds N]
//! [--idle-seconds N] [--agent PATH]`.

use anyhow::{Context, Result, bail};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, CardGrant};
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, PreStartContainerRequest,
    PreferredAllocationRequest,
};
use nano_gpu_proto::resources::GPU_PERCENT;
use nano_gpu_proto::units::Percent;
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use nano_gpu_tests::fake_kubelet::{Allocated, FakeKubelet};
use nano_gpu_tests::{Killed, cpu_ticks, p99, peak_rss_mib};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

struct Args {
    cards: usize,
    pending: usize,
    measured: usize,
    rounds: usize,
    idle_seconds: u64,
    agent: PathBuf,
}

fn args() -> Result<Args> {
    let mut a = Args {
        cards: 8,
        pending: 50,
        measured: 50,
        rounds: 10,
        idle_seconds: 3,
        agent: nano_gpu_tests::workspace_binary("nano-gpu-agent"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--cards" => a.cards = value.parse()?,
            "--pending" => a.pending = value.parse()?,
            "--measured" => a.measured = value.parse()?,
            "--rounds" => a.rounds = value.parse()?,
            "--idle-seconds" => a.idle_seconds = value.parse()?,
            "--agent" => a.agent = value.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// Shares the pods ask, in percent (small, so that measured + pending pods fit on 8 cards).
const SHARES: [u32; 5] = [2, 4, 6, 8, 10];

/// A placed pod: name, share, card.
struct Placed {
    name: String,
    percent: u32,
    card: usize,
}

/// Pods assigned first-fit over the cards, in creation order.
fn placements(cards: usize, pods: usize) -> Result<Vec<Placed>> {
    let mut free = vec![100u32; cards];
    (0..pods)
        .map(|i| {
            let percent = SHARES[i % SHARES.len()];
            let card = free.iter().position(|f| *f >= percent).context("the pods do not fit on the cards")?;
            free[card] -= percent;
            Ok(Placed { name: format!("p{i:04}"), percent, card })
        })
        .collect()
}

fn uuid(card: usize) -> String {
    format!("GPU-bench-{card}")
}

fn pod(p: &Placed, i: usize) -> Value {
    let grant =
        CardGrant { uuid: uuid(p.card), index: p.card as u32, percent: Percent(p.percent), memory_mib: None };
    let at = format!("2026-11-22T00:{:02}:{:02}Z", i / 60, i % 60);
    let assignment = Assignment::new("n1", at.clone(), BTreeMap::from([("c".to_string(), vec![grant])]));
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": p.name, "namespace": "bench", "uid": format!("uid-{}", p.name), "resourceVersion": "1",
                     "creationTimestamp": at, "annotations": {ASSIGNMENT_ANNOTATION: assignment.encode()}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c",
            "resources": {"limits": {GPU_PERCENT: p.percent.to_string()}}}]},
        "status": {"phase": "Pending"}})
}

fn entry(pod: &str, ids: Vec<String>) -> Allocated {
    Allocated {
        namespace: "bench".into(),
        pod: pod.into(),
        container: "c".into(),
        resource: GPU_PERCENT.into(),
        ids,
    }
}

#[derive(Default)]
struct Samples {
    preferred: Vec<f64>,
    allocate: Vec<f64>,
    prestart: Vec<f64>,
    steered: usize,
    rss: f64,
    idle_cpu_percent: f64,
}

async fn round(a: &Args, n: usize, out: &mut Samples) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("nano-gpu-bench-agent-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let placed = placements(a.cards, a.measured + a.pending)?;
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})],
        pods: placed.iter().enumerate().map(|(i, p)| pod(p, i)).collect(),
        ..Objects::default()
    })
    .await?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let gpus: Vec<Value> = (0..a.cards)
        .map(|i| {
            json!({"index": i, "uuid": uuid(i), "vendor": "nvidia", "model": "NVIDIA A100-SXM4-80GB",
                        "memoryMiB": 81920, "healthy": true})
        })
        .collect();
    let inventory = dir.join("gpus.json");
    std::fs::write(&inventory, json!({"v": 1, "gpus": gpus}).to_string())?;
    let mut kubelet = FakeKubelet::start(&dir)?;
    let agent = Killed(
        kubelet
            .agent(&a.agent, &inventory, &kubeconfig)
            .args(["--probe-listen", ""])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", a.agent.display()))?,
    );
    tokio::time::timeout(Duration::from_secs(30), kubelet.registrations.recv())
        .await
        .context("the agent did not register within 30 s")?;
    let mut client = DevicePluginClient::new(
        nano_gpu_runtime::unix_channel(kubelet.plugin_dir.join("nano-gpu.sock")).await?,
    );
    let mut free: BTreeSet<String> =
        (0..a.cards).flat_map(|c| (0..100).map(move |n| device_id::encode(&uuid(c), n))).collect();
    let preferred = |available: Vec<String>, size: u32| PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size as i32,
        }],
    };
    // Warm-up, not measured: wait until the agent's pod watch has listed (a steered answer).
    let first = &placed[0];
    kubelet.pod_resources.put(entry(&first.name, vec![]));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r =
            client.get_preferred_allocation(preferred(free.iter().cloned().collect(), first.percent)).await?;
        if r.into_inner().container_responses[0]
            .device_i_ds
            .iter()
            .all(|id| id.starts_with(&uuid(first.card)))
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("the agent never steered to the assigned card");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in placed.iter().take(a.measured) {
        kubelet.pod_resources.put(entry(&p.name, vec![]));
        let available: Vec<String> = free.iter().cloned().collect();
        let t = Instant::now();
        let r = client.get_preferred_allocation(preferred(available, p.percent)).await?.into_inner();
        out.preferred.push(t.elapsed().as_secs_f64() * 1000.0);
        let ids = r.container_responses[0].device_i_ds.clone();
        if ids.iter().all(|id| id.starts_with(&format!("{}-", uuid(p.card)))) {
            out.steered += 1;
        }
        let t = Instant::now();
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: ids.clone() }],
        };
        client.allocate(request).await.with_context(|| format!("Allocate for {}", p.name))?;
        out.allocate.push(t.elapsed().as_secs_f64() * 1000.0);
        for id in &ids {
            free.remove(id);
        }
        kubelet.pod_resources.put(entry(&p.name, ids.clone()));
        let t = Instant::now();
        client.pre_start_container(PreStartContainerRequest { devices_ids: ids }).await?;
        out.prestart.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    // Idle: let the repairs finish, then count the CPU the agent uses doing nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = agent.0.id();
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(a.idle_seconds)).await;
    let ticks = cpu_ticks(pid) - before;
    let per_second = 100.0; // USER_HZ on Linux
    let idle = ticks as f64 / per_second / a.idle_seconds.max(1) as f64 * 100.0;
    out.idle_cpu_percent = out.idle_cpu_percent.max(idle);
    out.rss = out.rss.max(peak_rss_mib(pid));
    if api.writes().iter().any(|(m, p, _)| m == "PATCH" && p.contains("/pods/")) {
        bail!("the agent repaired an assignment although every container got its assigned card");
    }
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<()> {
    let a = args()?;
    if !a.agent.exists() {
        bail!("{} not found: build it first (cargo build --release -p nano-gpu-agent)", a.agent.display());
    }
    let mut s = Samples::default();
    for n in 0..a.rounds {
        round(&a, n, &mut s).await?;
    }
    let r = |v: f64| (v * 1000.0).round() / 1000.0;
    let total = a.measured * a.rounds;
    println!(
        "{}",
        json!({
            "cards": a.cards, "pending_pods": a.pending, "measured_pods": total, "rounds": a.rounds,
            "allocate_p99_ms": r(p99(s.allocate)), "preferred_p99_ms": r(p99(s.preferred)),
            "prestart_p99_ms": r(p99(s.prestart)), "rss_mib": r(s.rss),
            "steered": format!("{}/{total}", s.steered), "idle_cpu_percent": r(s.idle_cpu_percent),
        })
    );
    Ok(())
}
