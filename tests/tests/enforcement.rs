//! Enforcement on the local cluster (`hack/cluster.sh`, one real node, nano-gpu installed as
//! shipped): what each share container is given, read from inside it with `kubectl exec`, against
//! its assignment, for each mode the node is switched to by its `nano-gpu/enforcement` label.
//!
//! - `none`: the share's env (`NANO_GPU_*`), no MPS env, no MPS pipe directory.
//! - `mps`: the label also schedules `deploy/mps.yaml`; the node's runtime stand-in mounts the
//!   stand-in `nvidia-cuda-mps-control` (`tests/src/bin/nvidia-cuda-mps-control.rs`) into it, as
//!   NVIDIA's runtime mounts the real one. A share sees its percent and memory as MPS client limits,
//!   the pipe directory of its own card's daemon (the daemon wrote its card there) and a `/dev/shm`
//!   of its own, bounded, and no daemon's (each daemon writes a file named after its card in its
//!   own); a whole card sees none of it. A CUDA process
//!   stand-in in a share finds its card's daemon and runs as an MPS client, held to its share's
//!   percent; one whose process exports `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100` gets 100 %, until an
//!   operator sets the daemon's default (a ceiling for every client of the card); the agent's metrics
//!   show its memory under its own pod. A daemon killed is started again and the share's pod gets
//!   `MpsDaemonLost`. A process of another user than root waits while its card's server serves
//!   root's clients, as MPS serves one user at a time per card.
//!
//! - `hami-core`: HAMi-core "installed" in the node's own `/usr/local/vgpu` (a marker file, not
//!   HAMi's library: nothing here runs CUDA): a share sees HAMi-core's env with its percent and
//!   memory, the library, `/etc/ld.so.preload` and the lock directory (the agent pod's 1 MiB
//!   tmpfs: writing more fails); a whole card none of it.
//!
//! The Node's `nano-gpu/memory-limit` label says what the agent found of the driver's memory limit:
//! the fake NVML has the function, so it is `available` where the host's cgroups are v2 and
//! `unavailable` where they are not.

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use nano_gpu_agent::serve::canary::ISOLATION_LABEL;
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
use nano_gpu_tests::checks::{card_memories, check_consistency, held_memory};
use nano_gpu_tests::cluster::{
    Cluster, NS, clear_mps_dirs, create, mps_client_pipe, mps_layout, percent_pod, percent_pod_then,
    wait_running, wait_until,
};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";
const NODE: &str = "node-1";

/// What container `c` of pod `name` sees: its environment, and what its mounts hold as these
/// names: `PIPE_CARD` (the card its MPS pipe directory's daemon serves), `SHM_CARDS` (the cards
/// whose MPS daemons share its `/dev/shm`: none), `SHM_KB` (the size of its `/dev/shm`), `VGPU` and `PRELOAD` (HAMi-core's library and
/// `/etc/ld.so.preload`), `VGPULOCK` (`yes`: HAMi-core's lock directory); empty when absent.
struct Inside {
    env: BTreeMap<String, String>,
}

impl Inside {
    fn get(&self, name: &str) -> &str {
        self.env.get(name).map_or("", String::as_str)
    }

    /// Whether any variable starts with `prefix`.
    fn any(&self, prefix: &str) -> bool {
        self.env.keys().any(|k| k.starts_with(prefix))
    }
}

fn inside(cluster: &Cluster, name: &str) -> Inside {
    let script = "env; echo PIPE_CARD=$(cat /tmp/nvidia-mps/card 2>/dev/null); \
                  echo SHM_CARDS=$(cd /dev/shm && ls -d nano-gpu-mps-standin-* 2>/dev/null \
                                   | sed s/nano-gpu-mps-standin-//); \
                  echo SHM_KB=$(df -k /dev/shm | tail -1 | awk '{print $2}'); \
                  echo VGPU=$(cat /usr/local/vgpu/libvgpu.so 2>/dev/null); \
                  echo PRELOAD=$(cat /etc/ld.so.preload 2>/dev/null); \
                  test -d /tmp/vgpulock && echo VGPULOCK=yes; true";
    let out = cluster.ok(&["exec", "-n", NS, name, "-c", "c", "--", "sh", "-c", script]);
    let env =
        out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    Inside { env }
}

/// Labels the node `nano-gpu/enforcement=<mode>` and waits for its agent to restart under it (its
/// keeper starts it again) and be ready again.
async fn switch(cluster: &Cluster, nodes: &Api<Node>, system: &Api<Pod>, mode: &str) {
    let patch = json!({"metadata": {"labels": {"nano-gpu/enforcement": mode}}});
    nodes.patch(NODE, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    wait_until(&format!("the agent restarted under {mode}"), Duration::from_secs(90), || async {
        agent_mode(cluster).as_deref() == Some(mode)
    })
    .await;
    agent_ready(system).await;
}

/// The mode the node's newest agent said it enforces (its log's last `shares are enforced` line).
fn agent_mode(cluster: &Cluster) -> Option<String> {
    let args = ["logs", "-n", "nano-gpu-system", "-l", "app.kubernetes.io/name=nano-gpu-agent", "--tail=-1"];
    let out = cluster.kubectl(&args);
    let logs = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = logs.lines().rev().find(|l| l.contains("shares are enforced"))?;
    Some(line.split("mode=\"").nth(1)?.split('"').next()?.to_owned())
}

/// Pod `name`'s single grant: its card, the card's index and the memory (MiB) it holds.
async fn grant(pods: &Api<Pod>, nodes: &Api<Node>, name: &str) -> (String, u32, u64) {
    let pod = pods.get(name).await.unwrap();
    let a = Assignment::decode(&pod.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    let g = &a.containers["c"][0];
    let memories = card_memories(&nodes.list(&ListParams::default()).await.unwrap().items);
    (g.uuid.clone(), g.index, held_memory(g, &memories))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_share_container_sees_the_limits_of_its_assignment_in_each_mode() {
    clear_mps_dirs(NODE);
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
    let (card, _, _) = grant(&pods, &nodes, "plain-30").await;
    assert_eq!(plain.get("NANO_GPU_PERCENT"), "30", "{:?}", plain.env);
    assert_eq!(plain.get("NVIDIA_VISIBLE_DEVICES"), card);
    assert!(!plain.any("CUDA_MPS") && !plain.any("CUDA_DEVICE_"), "{:?}", plain.env);
    assert_eq!((plain.get("PIPE_CARD"), plain.get("SHM_CARDS"), plain.get("VGPU")), ("", "", ""));
    pods.delete("plain-30", &DeleteParams::default()).await.unwrap();

    // mps: the agent restarts under the new mode; the daemons' DaemonSet comes to the node.
    switch(&cluster, &nodes, &system, "mps").await;
    let shares = [("mps-30", 30), ("mps-20", 20), ("mps-whole", 100)];
    // Tenants' CUDA processes (the stand-in), each finding its card's daemon: an MPS client. mps-30
    // asks all SMs of its card and is held to its 30 %; mps-20's process exports 100 % first, and
    // gets it: the limits are the process's own environment (the README's guarantee table).
    let raising = "export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100; exec gpu-use --memory-mib 100 --sm 100";
    for (name, percent) in shares {
        let pod = match name {
            "mps-30" => percent_pod_then(name, percent, "exec gpu-use --memory-mib 1000 --sm 100"),
            "mps-20" => percent_pod_then(name, percent, raising),
            _ => percent_pod(name, percent),
        };
        create(&pods, &pod).await;
    }
    let names: Vec<String> = shares.iter().map(|s| s.0.to_string()).collect();
    wait_running(&pods, &names, Duration::from_secs(120)).await;
    for (name, percent) in &shares[..2] {
        let seen = inside(&cluster, name);
        let (card, _, memory) = grant(&pods, &nodes, name).await;
        assert_eq!(seen.get("NVIDIA_VISIBLE_DEVICES"), card, "{name}: {:?}", seen.env);
        assert_eq!(seen.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), percent.to_string(), "{name}");
        assert_eq!(seen.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), format!("0={memory}M"), "{name}");
        assert_eq!(seen.get("CUDA_MPS_PIPE_DIRECTORY"), "/tmp/nvidia-mps", "{name}");
        assert_eq!(seen.get("PIPE_CARD"), card, "{name}: not its own card's daemon");
        // Its own, no daemon's: what it puts there no other share reads.
        assert_eq!(seen.get("SHM_CARDS"), "", "{name}: the /dev/shm of the daemons of these cards");
        // Bounded: the pod's own 64 MiB /dev/shm, not a directory of the host.
        assert_eq!(seen.get("SHM_KB"), "65536", "{name}: /dev/shm of {} KiB", seen.get("SHM_KB"));
    }
    // Its use shows under its own pod: NVML lists MPS clients apart (the stand-in driver does too).
    let (card, index, _) = grant(&pods, &nodes, "mps-30").await;
    let series = format!(
        "nano_gpu_container_memory_used_bytes{{node=\"{NODE}\",namespace=\"{NS}\",pod=\"mps-30\",container=\"c\",gpu=\"{}\",uuid=\"{card}\"}} {}",
        index,
        1000u64 << 20
    );
    wait_until("mps-30's MPS client in the agent's metrics", Duration::from_secs(60), || async {
        cluster.agent_metrics(&system, NODE).await.lines().any(|l| l == series)
    })
    .await;
    let (memory_30, memory_20) =
        (grant(&pods, &nodes, "mps-30").await.2, grant(&pods, &nodes, "mps-20").await.2);
    let held = format!("using 1000 MiB and 30 % of {card} as an MPS client (limits: 30 %, {memory_30} MiB)");
    client_says(&cluster, "mps-30", &held).await;
    client_says(
        &cluster,
        "mps-20",
        &format!(
            "and 100 % of {} as an MPS client (limits: 100 %, {memory_20} MiB)",
            grant(&pods, &nodes, "mps-20").await.0
        ),
    )
    .await;
    // An operator's ceiling on every card of the node (the daemon's default, as root): a tenant's
    // export no longer raises past it.
    for card in node_cards() {
        set_daemon_default(&cluster, &card, "set_default_active_thread_percentage 50");
    }
    create(&pods, &percent_pod_then("mps-ceiling", 20, raising)).await;
    wait_running(&pods, &["mps-ceiling".to_string()], Duration::from_secs(60)).await;
    client_says(&cluster, "mps-ceiling", "and 50 % of ").await;
    client_says(&cluster, "mps-ceiling", "(limits: 50 %, ").await;
    pods.delete("mps-ceiling", &DeleteParams::default()).await.unwrap();
    wait_until("mps-ceiling gone", Duration::from_secs(60), || async {
        pods.get_opt("mps-ceiling").await.unwrap().is_none()
    })
    .await;
    for card in node_cards() {
        let defaults = mps_client_pipe(&card).join(nano_gpu_tests::mps_standin::DEFAULT_THREADS);
        let removed = cluster.on_node(NODE, &["rm", "-f", defaults.to_str().unwrap()]).status().unwrap();
        assert!(removed.success(), "{} stays", defaults.display());
    }
    let whole = inside(&cluster, "mps-whole");
    assert!(!whole.any("CUDA_MPS"), "{:?}", whole.env);
    assert_eq!((whole.get("PIPE_CARD"), whole.get("SHM_CARDS")), ("", ""), "a whole card bypasses MPS");

    // MPS serves one user at a time per card: a CUDA process of user 1000 in a share waits while its
    // card's server serves root's clients (mps-30's, mps-20's), and is served once they have ended.
    // The cards no share holds are taken whole first, so its share lands beside one of theirs.
    let cards = card_memories(&nodes.list(&ListParams::default()).await.unwrap().items);
    let mut held = std::collections::BTreeSet::new();
    for name in &names {
        held.insert(grant(&pods, &nodes, name).await.0);
    }
    let blockers: Vec<String> = (0..cards.len() - held.len()).map(|k| format!("blocker-{k}")).collect();
    for name in &blockers {
        create(&pods, &percent_pod(name, 100)).await;
    }
    wait_running(&pods, &blockers, Duration::from_secs(60)).await;
    let mut user = percent_pod_then("mps-user", 10, "exec gpu-use --memory-mib 100 --sm 100");
    user.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"runAsUser": 1000})).unwrap());
    create(&pods, &user).await;
    wait_running(&pods, &["mps-user".to_string()], Duration::from_secs(60)).await;
    let (card, _, _) = grant(&pods, &nodes, "mps-user").await;
    let mut ended = Vec::new();
    for name in ["mps-30", "mps-20"] {
        if grant(&pods, &nodes, name).await.0 == card {
            ended.push(name);
        }
    }
    assert!(!ended.is_empty(), "mps-user's {card} holds neither mps-30 nor mps-20");
    client_says(&cluster, "mps-user", "waiting: the card's MPS server serves UID 0").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let logs = cluster.ok(&["logs", "-n", NS, "mps-user"]);
    assert!(!logs.contains("as an MPS client"), "served beside root's clients {ended:?}: {logs}");
    for name in &ended {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    client_says(&cluster, "mps-user", &format!("using 100 MiB and 10 % of {card} as an MPS client")).await;
    println!("mps-user, user 1000 on {card}: served after {ended:?} ended");
    wait_until("the ended shares gone", Duration::from_secs(60), || async {
        for name in &ended {
            if pods.get_opt(name).await.unwrap().is_some() {
                return false;
            }
        }
        true
    })
    .await;

    // The daemon of mps-user's card is killed: started again, and the pod is told. (Its client
    // exits, as a CUDA process whose server is gone fails, and its container starts again.)
    let pid_file = mps_client_pipe(&card).join("nvidia-cuda-mps-control.pid").display().to_string();
    let pid = cluster.read_on_node(NODE, &pid_file).unwrap().trim().to_owned();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    wait_until("MpsDaemonLost on mps-user", Duration::from_secs(60), || async {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some("MpsDaemonLost")
                    && e.involved_object.name.as_deref() == Some("mps-user")
            })
        })
    })
    .await;
    wait_until("a new daemon on the card", Duration::from_secs(60), || async {
        cluster.read_on_node(NODE, &pid_file).is_ok_and(|p| p.trim() != pid)
    })
    .await;
    let running = names.len() - ended.len() + blockers.len() + 1;
    assert_eq!(check_consistency(&cluster, &client).await, running);

    let rest = names.iter().chain(&blockers).map(String::as_str).chain(["mps-user"]);
    for name in rest.filter(|n| !ended.contains(n)) {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }

    // hami-core, installed by the operator in the node's /usr/local/vgpu (the harness gives each
    // node its own /usr/local): a share gets HAMi-core's env with its percent and memory, the
    // library and ld.so.preload read-only, the shared, bounded lock directory; a whole card none of it.
    let vgpu = cluster.path(&format!("nodes/{NODE}/usr/local/vgpu"));
    std::fs::create_dir_all(&vgpu).unwrap();
    std::fs::write(vgpu.join("libvgpu.so"), "the node's HAMi-core, as its operator installed it\n").unwrap();
    std::fs::write(vgpu.join("ld.so.preload"), "/usr/local/vgpu/libvgpu.so\n").unwrap();
    switch(&cluster, &nodes, &system, "hami-core").await;
    let shares = [("hami-40", 40), ("hami-whole", 100)];
    for (name, percent) in shares {
        create(&pods, &percent_pod(name, percent)).await;
    }
    let names: Vec<String> = shares.iter().map(|s| s.0.to_string()).collect();
    wait_running(&pods, &names, Duration::from_secs(120)).await;
    let seen = inside(&cluster, "hami-40");
    let (card, _, memory) = grant(&pods, &nodes, "hami-40").await;
    assert_eq!(seen.get("NVIDIA_VISIBLE_DEVICES"), card, "{:?}", seen.env);
    assert_eq!(seen.get("CUDA_DEVICE_MEMORY_LIMIT_0"), format!("{memory}m"), "{:?}", seen.env);
    assert_eq!(seen.get("CUDA_DEVICE_SM_LIMIT"), "40");
    assert_eq!(seen.get("CUDA_DEVICE_MEMORY_SHARED_CACHE"), "/tmp/cudevshr.cache");
    assert_eq!(seen.get("VGPU"), "the node's HAMi-core, as its operator installed it");
    assert_eq!(seen.get("PRELOAD"), "/usr/local/vgpu/libvgpu.so");
    assert_eq!(seen.get("VGPULOCK"), "yes");
    // The lock directory is the agent pod's 1 MiB tmpfs, not the node's /tmp: a share writing more
    // is stopped there.
    let fill = "dd if=/dev/zero of=/tmp/vgpulock/fill bs=64k count=64 2>&1; \
                echo KB=$(du -k /tmp/vgpulock/fill | cut -f1); \
                echo SIZE=$(df -Pk /tmp/vgpulock | tail -1 | awk '{print $2}'); rm -f /tmp/vgpulock/fill";
    let out = cluster.ok(&["exec", "-n", NS, "hami-40", "-c", "c", "--", "sh", "-c", fill]);
    let value = |k: &str| out.lines().find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok());
    assert!(out.contains("No space left"), "a share filled past 1 MiB: {out}");
    assert!(value("KB=").is_some_and(|kb| kb <= 1024) && value("SIZE=") == Some(1024), "{out}");
    let whole = inside(&cluster, "hami-whole");
    assert!(!whole.any("CUDA_DEVICE_"), "{:?}", whole.env);
    assert_eq!((whole.get("VGPU"), whole.get("PRELOAD")), ("", ""), "a whole card bypasses HAMi-core");
    assert_eq!(check_consistency(&cluster, &client).await, shares.len());
    for name in &names {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }

    // Back to none: the agent restarts again and new shares are plain.
    switch(&cluster, &nodes, &system, "none").await;
    create(&pods, &percent_pod("plain-again", 40)).await;
    wait_running(&pods, &["plain-again".to_string()], Duration::from_secs(90)).await;
    let plain = inside(&cluster, "plain-again");
    assert!(!plain.any("CUDA_MPS") && !plain.any("CUDA_DEVICE_"), "{:?}", plain.env);
    the_runtime_canaries_tell_a_node_whose_runtime_honours_a_pods_env_or_annotations(
        &cluster, &nodes, &system, &pods,
    )
    .await;
    cluster.down();
    clear_mps_dirs(NODE);
}

/// The node's value of the label the runtime canary's verdict sets.
async fn isolation(nodes: &Api<Node>) -> Option<String> {
    let node = nodes.get(NODE).await.unwrap();
    node.metadata.labels.unwrap_or_default().get(ISOLATION_LABEL).cloned()
}

/// Deletes the node's agent pod (the DaemonSet makes a new one, whose canary looks again) and waits
/// until the Node's `nano-gpu/device-isolation` says `want` for the new pod.
async fn new_agent_until(nodes: &Api<Node>, system: &Api<Pod>, want: &str) {
    let params = ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent");
    for p in system.list(&params).await.unwrap().items {
        system.delete(&p.metadata.name.unwrap(), &DeleteParams::default()).await.unwrap();
    }
    // The old agent's label stays until the new one writes its own; clear it to see the new one's.
    let clear = json!({"metadata": {"labels": {ISOLATION_LABEL: null}}});
    nodes.patch(NODE, &PatchParams::default(), &Patch::Merge(&clear)).await.unwrap();
    wait_until(&format!("{ISOLATION_LABEL}={want}"), Duration::from_secs(120), || async {
        isolation(nodes).await.as_deref() == Some(want)
    })
    .await;
}

/// The runtime canaries: under the configuration the README asks of a node, the agent's unprivileged
/// canary containers (no GPU asked; `NVIDIA_VISIBLE_DEVICES=all` in one's env, the pod's
/// `cdi.k8s.io/nano-gpu-canary` annotation for both) are given no card and the Node says `held`. At
/// the NVIDIA toolkit's defaults the runtime honours the env: the Node says `env-honoured` with a
/// `RuntimeHonoursPodEnv` Warning, the agent is not ready (so no GPU pod is placed there), and a GPU
/// pod waits; set right again, the node serves again. The same for the runtime in its CDI mode, which
/// reads the pod's annotations this node's containerd passes: `annotations-honoured`, with a
/// `RuntimeHonoursPodAnnotations` Warning.
async fn the_runtime_canaries_tell_a_node_whose_runtime_honours_a_pods_env_or_annotations(
    cluster: &Cluster,
    nodes: &Api<Node>,
    system: &Api<Pod>,
    pods: &Api<Pod>,
) {
    wait_until("the canary's verdict", Duration::from_secs(60), || async {
        isolation(nodes).await.as_deref() == Some("held")
    })
    .await;
    let config = cluster.path(&format!("nodes/{NODE}/var/lib/nano-gpu-fake-driver/config.toml"));
    let secure = std::fs::read_to_string(&config).unwrap();
    assert!(secure.contains("when-unprivileged = false"), "{secure}");
    std::fs::write(&config, "# the NVIDIA container toolkit's defaults\n").unwrap();
    new_agent_until(nodes, system, "env-honoured").await;
    unserved(cluster, system, pods, ("RuntimeHonoursPodEnv", "when-unprivileged = false"), "waits").await;
    // Set right again: served again, and the waiting pod runs.
    std::fs::write(&config, &secure).unwrap();
    new_agent_until(nodes, system, "held").await;
    agent_ready(system).await;
    wait_running(pods, &["waits".to_string()], Duration::from_secs(120)).await;

    // Set as the README asks, but in the CDI mode: the pod's annotation, which this node's containerd
    // passes to the runtime, names every card, and comes before the device plugin's mounts.
    std::fs::write(&config, format!("{secure}[nvidia-container-runtime]\nmode = \"cdi\"\n")).unwrap();
    new_agent_until(nodes, system, "annotations-honoured").await;
    unserved(cluster, system, pods, ("RuntimeHonoursPodAnnotations", "pod_annotations"), "waits-too").await;
    std::fs::write(&config, &secure).unwrap();
    new_agent_until(nodes, system, "held").await;
    agent_ready(system).await;
    wait_running(pods, &["waits-too".to_string()], Duration::from_secs(120)).await;
}

/// On a node whose runtime hands a pod cards it named itself: a Warning Event on the Node whose
/// reason and message are `event`'s, the agent not Ready with the reason, and GPU pod `waiting`
/// (created here) not placed.
async fn unserved(cluster: &Cluster, system: &Api<Pod>, pods: &Api<Pod>, event: (&str, &str), waiting: &str) {
    let (reason, says) = event;
    let events: Api<Event> = Api::namespaced(cluster.client().await, "default");
    wait_until(&format!("a {reason} Event on the Node"), Duration::from_secs(30), || async {
        let selector = format!("involvedObject.kind=Node,involvedObject.name={NODE}");
        let list = events.list(&ListParams::default().fields(&selector)).await.unwrap();
        list.items.iter().any(|e| {
            e.reason.as_deref() == Some(reason) && e.message.as_deref().is_some_and(|m| m.contains(says))
        })
    })
    .await;
    // Not ready, with the reason (the kubelet probes every 5 s); a GPU pod is not placed.
    let agent_status = || async {
        let params = ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent");
        let pods = system.list(&params).await.unwrap().items;
        let agent = pods.into_iter().find(|p| p.metadata.deletion_timestamp.is_none());
        agent.and_then(|p| p.status).unwrap_or_default()
    };
    wait_until("the agent not Ready", Duration::from_secs(30), || async {
        let conditions = agent_status().await.conditions.unwrap_or_default();
        conditions.iter().any(|c| c.type_ == "Ready" && c.status == "False")
    })
    .await;
    let ip = agent_status().await.pod_ip.unwrap_or_default();
    let (code, why) = cluster.curl(&format!("http://{ip}:9401/readyz"), None, &[]);
    assert_eq!(code, 503, "{why}");
    assert!(why.contains("could reach every card") && why.contains(says), "{why}");
    create(pods, &percent_pod(waiting, 10)).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let pod = pods.get(waiting).await.unwrap();
    assert_eq!(pod.spec.and_then(|s| s.node_name), None, "a GPU pod was placed on the node");
}

/// Waits until pod `name`'s log has a line containing `text` (what its CUDA process stand-in said).
async fn client_says(cluster: &Cluster, name: &str, text: &str) {
    let start = std::time::Instant::now();
    loop {
        let out = cluster.kubectl(&["logs", "-n", NS, name]);
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        if said.lines().any(|l| l.contains(text)) {
            return;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let before = cluster.kubectl(&["logs", "-n", NS, name, "--previous"]);
            panic!(
                "{name} did not say {text:?} within 60 s; it said:\n{said}{}\nbefore its last restart:\n{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&before.stdout)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The UUIDs of this node's cards whose MPS daemons have directories on the host.
fn node_cards() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(mps_layout().root) else { return Vec::new() };
    entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&format!("GPU-{NODE}-")))
        .collect()
}

/// Tells the daemon of card `uuid` `command` as root, through the control program (the stand-in),
/// run where the node's pods see the card's pipe directory.
fn set_daemon_default(cluster: &Cluster, uuid: &str, command: &str) {
    use std::io::Write;
    let program = nano_gpu_tests::workspace_binary("nvidia-cuda-mps-control");
    let pipe = mps_client_pipe(uuid);
    let mut child = cluster
        .on_node(NODE, &[program.to_str().unwrap()])
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", mps_layout().log(uuid))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    child.stdin.take().unwrap().write_all(format!("{command}\n").as_bytes()).unwrap();
    assert!(child.wait().unwrap().success(), "{command} in {}", pipe.display());
}
