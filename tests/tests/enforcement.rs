//! Enforcement on the local cluster (`hack/cluster.sh`, one real node, nano-gpu installed as
//! shipped): what each share container is given, read from inside it with `kubectl exec`, against
//! its assignment, for each mode the node is switched to by its `nano-gpu/enforcement` label.
//!
//! - `none`: the share's env (`NANO_GPU_*`), no MPS env, no MPS pipe directory.
//! - `mps`: the label also schedules `deploy/mps.yaml`; the node's runtime stand-in mounts the
//!   stand-in `nvidia-cuda-mps-control` (`tests/src/bin/nvidia-cuda-mps-control.rs`) into it, as
//!   NVIDIA's runtime mounts the real one. A share sees its percent and memory as MPS client limits,
//!   the pipe directory of its own card's daemon (the daemon wrote its card there) and the daemons'
//!   `/dev/shm` (the daemon wrote a file there); a whole card sees none of it. A daemon killed is
//!   started again and the share's pod gets `MpsDaemonLost`.
//!
//! The Node's `nano-gpu/memory-limit` label says what the agent found of the driver's memory limit:
//! the fake NVML has the function, so it is `available` where the host's cgroups are v2 and
//! `unavailable` where they are not. `hami-core` is not run here: it needs files in the host's
//! `/usr/local` (unit-tested in the agent).

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
use nano_gpu_tests::checks::{card_memories, check_consistency, held_memory};
use nano_gpu_tests::cluster::{Cluster, NS, create, percent_pod, wait_running, wait_until};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";
const NODE: &str = "node-1";

/// What container `c` of pod `name` sees: its environment, the card its MPS pipe directory names
/// (the daemon's `card` file) and whether the daemons' `/dev/shm` is its own.
struct Inside {
    env: BTreeMap<String, String>,
    pipe_card: Option<String>,
    daemons_shm: bool,
}

fn inside(cluster: &Cluster, name: &str) -> Inside {
    let script = "env; echo PIPE_CARD=$(cat /tmp/nvidia-mps/card 2>/dev/null); \
                  test -f /dev/shm/nano-gpu-mps-standin && echo DAEMONS_SHM=yes; true";
    let out = cluster.ok(&["exec", "-n", NS, name, "-c", "c", "--", "sh", "-c", script]);
    let env: BTreeMap<String, String> =
        out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    let pipe_card = env.get("PIPE_CARD").filter(|c| !c.is_empty()).cloned();
    let daemons_shm = env.get("DAEMONS_SHM").is_some_and(|v| v == "yes");
    Inside { env, pipe_card, daemons_shm }
}

/// Pod `name`'s single grant: its card and the memory (MiB) it holds.
async fn grant(pods: &Api<Pod>, nodes: &Api<Node>, name: &str) -> (String, u64) {
    let pod = pods.get(name).await.unwrap();
    let a = Assignment::decode(&pod.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    let g = &a.containers["c"][0];
    let memories = card_memories(&nodes.list(&ListParams::default()).await.unwrap().items);
    (g.uuid.clone(), held_memory(g, &memories))
}

async fn label_node(nodes: &Api<Node>, mode: &str) {
    let patch = json!({"metadata": {"labels": {"nano-gpu/enforcement": mode}}});
    nodes.patch(NODE, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
}

/// The node's agent serves: its pod is Ready and the Node's inventory shows a healthy card.
async fn agent_ready(system: &Api<Pod>) {
    wait_until("the agent Ready", Duration::from_secs(120), || async {
        let params = ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent");
        system.list(&params).await.is_ok_and(|l| {
            l.items.iter().any(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                    && p.metadata.deletion_timestamp.is_none()
            })
        })
    })
    .await;
}

/// The restart count of the node's agent container.
async fn agent_restarts(system: &Api<Pod>) -> i32 {
    let params = ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent");
    let list = system.list(&params).await.unwrap();
    list.items
        .iter()
        .flat_map(|p| p.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default())
        .map(|c| c.restart_count)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_share_container_sees_the_limits_of_its_assignment_in_each_mode() {
    clear_mps_dirs();
    let cluster = Cluster::up("enforce", 1);
    let client = cluster.client().await;
    cluster.ok(&["create", "namespace", NS]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let nodes: Api<Node> = Api::all(client.clone());

    // The driver's memory limit, as the agent found it on this host.
    let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").is_file();
    let want = if v2 { "available" } else { "unavailable" };
    wait_until("the Node's memory-limit label", Duration::from_secs(60), || async {
        let node = nodes.get(NODE).await.unwrap();
        node.metadata.labels.unwrap_or_default().get("nano-gpu/memory-limit").map(String::as_str)
            == Some(want)
    })
    .await;

    // none: the share's own env, nothing of MPS.
    create(&pods, &percent_pod("plain-30", 30)).await;
    wait_running(&pods, &["plain-30".to_string()], Duration::from_secs(60)).await;
    let plain = inside(&cluster, "plain-30");
    let (card, _) = grant(&pods, &nodes, "plain-30").await;
    assert_eq!(plain.env.get("NANO_GPU_PERCENT").map(String::as_str), Some("30"), "{:?}", plain.env);
    assert_eq!(plain.env.get("NVIDIA_VISIBLE_DEVICES"), Some(&card));
    assert!(!plain.env.keys().any(|k| k.starts_with("CUDA_MPS")), "{:?}", plain.env);
    assert_eq!((plain.pipe_card, plain.daemons_shm), (None, false));
    pods.delete("plain-30", &DeleteParams::default()).await.unwrap();

    // mps: the agent restarts under the new mode; the daemons' DaemonSet comes to the node.
    let restarts = agent_restarts(&system).await;
    label_node(&nodes, "mps").await;
    wait_until("the agent restarted under mps", Duration::from_secs(90), || async {
        agent_restarts(&system).await > restarts
    })
    .await;
    agent_ready(&system).await;
    let shares = [("mps-30", 30), ("mps-20", 20), ("mps-whole", 100)];
    for (name, percent) in shares {
        create(&pods, &percent_pod(name, percent)).await;
    }
    let names: Vec<String> = shares.iter().map(|s| s.0.to_string()).collect();
    wait_running(&pods, &names, Duration::from_secs(120)).await;
    for (name, percent) in &shares[..2] {
        let seen = inside(&cluster, name);
        let (card, memory) = grant(&pods, &nodes, name).await;
        let env = |k: &str| seen.env.get(k).map(String::as_str);
        assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), Some(card.as_str()), "{name}: {:?}", seen.env);
        assert_eq!(env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some(percent.to_string().as_str()), "{name}");
        assert_eq!(env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some(format!("0={memory}M").as_str()), "{name}");
        assert_eq!(env("CUDA_MPS_PIPE_DIRECTORY"), Some("/tmp/nvidia-mps"), "{name}");
        assert_eq!(seen.pipe_card.as_deref(), Some(card.as_str()), "{name}: not its own card's daemon");
        assert!(seen.daemons_shm, "{name}: not the daemons' /dev/shm");
    }
    let whole = inside(&cluster, "mps-whole");
    assert!(!whole.env.keys().any(|k| k.starts_with("CUDA_MPS")), "{:?}", whole.env);
    assert_eq!((whole.pipe_card, whole.daemons_shm), (None, false), "a whole card bypasses MPS");

    // The daemon of mps-30's card is killed: started again, and the pod is told.
    let (card, _) = grant(&pods, &nodes, "mps-30").await;
    let pid_file = format!("/run/nano-gpu/mps/{card}/pipe/nvidia-cuda-mps-control.pid");
    let pid = std::fs::read_to_string(&pid_file).unwrap().trim().to_owned();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    wait_until("MpsDaemonLost on mps-30", Duration::from_secs(60), || async {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some("MpsDaemonLost")
                    && e.involved_object.name.as_deref() == Some("mps-30")
            })
        })
    })
    .await;
    wait_until("a new daemon on the card", Duration::from_secs(60), || async {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.trim() != pid)
    })
    .await;
    assert_eq!(check_consistency(&cluster, &client).await, shares.len());

    // Back to none: the agent restarts again and new shares are plain.
    for name in &names {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let restarts = agent_restarts(&system).await;
    label_node(&nodes, "none").await;
    wait_until("the agent restarted under none", Duration::from_secs(90), || async {
        agent_restarts(&system).await > restarts
    })
    .await;
    agent_ready(&system).await;
    create(&pods, &percent_pod("plain-again", 40)).await;
    wait_running(&pods, &["plain-again".to_string()], Duration::from_secs(90)).await;
    let plain = inside(&cluster, "plain-again");
    assert!(!plain.env.keys().any(|k| k.starts_with("CUDA_MPS")), "{:?}", plain.env);
    cluster.down();
    clear_mps_dirs();
}

/// The MPS daemons' directories of this node's cards, which outlive the cluster on the host
/// (`/run/nano-gpu/mps`, a hostPath); another cluster's node-1 has cards of the same UUIDs.
fn clear_mps_dirs() {
    let Ok(entries) = std::fs::read_dir("/run/nano-gpu/mps") else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&format!("GPU-{NODE}-")) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
