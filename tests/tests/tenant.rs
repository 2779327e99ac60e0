//! A tenant's tries on the local cluster (`hack/cluster.sh`, two real nodes, nano-gpu installed as
//! shipped but in the namespace `gpu-sharing` with the NetworkPolicies component (which nothing here
//! enforces), node-1's shares enforced with MPS). The tenant is what the README asks an operator to
//! give one: a ServiceAccount with the `edit` ClusterRole in its own namespace, which is under Pod
//! Security `baseline`. Every try is made with the tenant's token, as a pod or a write in its
//! namespace; each is refused with the message the tenant sees, or is harmless. A neighbour share on
//! each node (another user's) keeps its card, its limits and its container through all of them.
//!
//! The tries (the list, each where it applies):
//! - a share whose own env says `NVIDIA_VISIBLE_DEVICES=all` (and raises its MPS thread percentage)
//!   sees its one card; a pod asking no GPU whose image says `all` sees none;
//! - memory without a percent (which would reach no device plugin), a hostPath device list, a
//!   privileged container, devices asked of the runtime by annotation (CDI's, CRI-O's), a 200 kB
//!   model list: refused at admission with the reason;
//! - writing an assignment (on a new pod, on its running pod), the overrun label: refused; creating
//!   a Binding, writing a pod's status, an Event in nano-gpu's namespace, a Node: not allowed;
//! - a pod labelled as nano-gpu's agent on a node whose agent is not Ready: no GPU pod is placed there;
//! - in an MPS share: replacing the daemon's PID file in the pipe directory with a FIFO (which once
//!   hung the agent, and then made the card unhealthy for everyone): the agent answers, the card
//!   stays healthy, no neighbour is told its daemon was lost; `quit` to the daemon as a user other
//!   than root: refused by the daemon; filling its `/dev/shm`: it holds 64 MiB at most, its own,
//!   and a neighbour keeps all of its own;
//! - holding many connections to the webhook's port without a byte: those past a share's cap are
//!   closed at once, the rest within the handshake's bound, and the webhook keeps answering.
//!
//! Not tried here because it is not held (README, "Enforcing each share"): a root container of an MPS
//! share can stop its card's daemon, or remove the daemon's socket from the pipe directory; `export`
//! of MPS or HAMi-core variables in a share's own process.

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, ENFORCEMENT_LABEL, GPUS_ANNOTATION, NodeInventory,
};
use nano_gpu_tests::cluster::{
    Cluster, NS, clear_mps_dirs, create, gpu_pod, mps_client_pipe, percent_pod, percent_pod_then, phase,
    report, wait_running, wait_until,
};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

/// nano-gpu's namespace here: not the shipped `nano-gpu-system` but an overlay's `namespace:`, so the
/// policies that tell nano-gpu's accounts from a tenant's are tried where they must follow the install.
const SYSTEM: &str = "gpu-sharing";

/// `pod` placed only on `node` (kube-scheduler's node selector; nano-gpu then picks the card).
fn on(node: &str, mut pod: Pod) -> Pod {
    let selector = [("kubernetes.io/hostname".to_owned(), node.to_owned())].into();
    pod.spec.as_mut().unwrap().node_selector = Some(selector);
    pod
}

/// The UUIDs of the cards pod `name`'s container `c` was assigned.
async fn assigned(pods: &Api<Pod>, name: &str) -> BTreeSet<String> {
    let p = pods.get(name).await.unwrap();
    let a = Assignment::decode(&p.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    a.containers["c"].iter().map(|g| g.uuid.clone()).collect()
}

/// How many times pod `name`'s containers were restarted.
async fn restarts(pods: &Api<Pod>, name: &str) -> i32 {
    let p = pods.get(name).await.unwrap();
    p.status.and_then(|s| s.container_statuses).unwrap_or_default().iter().map(|c| c.restart_count).sum()
}

/// The agent pod on `node` that is not going away, if any.
async fn agent_on(system: &Api<Pod>, node: &str) -> Option<Pod> {
    let params = ListParams::default()
        .labels("app.kubernetes.io/name=nano-gpu-agent")
        .fields(&format!("spec.nodeName={node}"));
    let list = system.list(&params).await.unwrap().items;
    list.into_iter().find(|p| p.metadata.deletion_timestamp.is_none())
}

fn is_ready(p: &Pod) -> bool {
    let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether card `uuid` of `node` is healthy in the inventory its agent publishes.
async fn healthy(nodes: &Api<Node>, node: &str, uuid: &str) -> bool {
    let n = nodes.get(node).await.unwrap();
    let text = n.metadata.annotations.unwrap_or_default().get(GPUS_ANNOTATION).cloned().unwrap_or_default();
    NodeInventory::decode(&text).is_ok_and(|inv| inv.gpus.iter().any(|g| g.uuid == uuid && g.healthy))
}

/// The reason of a refused create or write, or a panic naming what got through.
fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(e)) => e.message,
        other => panic!("{what} was not refused: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_its_share_and_nothing_it_creates_takes_or_breaks_anyone_elses() {
    clear_mps_dirs("node-1");
    let cluster = Cluster::up_for_tenants("tenant", 2, SYSTEM);
    let admin = cluster.client().await;
    // The NetworkPolicies component, taken by the API server in the install's namespace (nothing
    // here enforces them).
    let policies = cluster.ok(&["get", "networkpolicy", "-n", SYSTEM, "-o", "name"]);
    let policies: BTreeSet<&str> = policies.lines().collect();
    let want = ["allocator", "agent-metrics", "default-deny-ingress"]
        .map(|p| format!("networkpolicy.networking.k8s.io/nano-gpu-{p}"));
    assert_eq!(policies, want.iter().map(String::as_str).collect(), "the NetworkPolicies in {SYSTEM}");
    let system: Api<Pod> = Api::namespaced(admin.clone(), SYSTEM);
    let nodes: Api<Node> = Api::all(admin.clone());
    let neighbours: Api<Pod> = Api::namespaced(admin.clone(), "default");

    // The tenant: `edit` in its namespace, which is under Pod Security baseline.
    cluster.ok(&["create", "namespace", NS]);
    cluster.ok(&["label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline"]);
    cluster.ok(&["create", "serviceaccount", "tenant", "-n", NS]);
    let role = ["create", "rolebinding", "tenant-edit", "--clusterrole=edit", "-n", NS];
    cluster.ok(&[&role[..], &[&format!("--serviceaccount={NS}:tenant")]].concat());
    let token = cluster.ok(&["create", "token", "tenant", "-n", NS, "--duration=2h"]);
    let kubeconfig = cluster.token_kubeconfig("tenant", &token);
    let tenant = nano_gpu_runtime::connect(Some(&kubeconfig)).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(tenant.clone(), NS);

    // node-1's shares under MPS (its daemons' DaemonSet comes with the label).
    let patch = json!({"metadata": {"labels": {ENFORCEMENT_LABEL: "mps"}}});
    nodes.patch("node-1", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    wait_until("node-1's agent enforcing mps and Ready", Duration::from_secs(120), || async {
        let Some(agent) = agent_on(&system, "node-1").await else { return false };
        let name = agent.metadata.name.clone().unwrap();
        let logs = cluster.kubectl(&["logs", "-n", SYSTEM, &name, "--tail=-1"]);
        let logs = String::from_utf8_lossy(&logs.stdout).into_owned();
        let mode = logs
            .lines()
            .rev()
            .find(|l| l.contains("shares are enforced"))
            .map(|l| l.contains("mode=\"mps\""));
        mode == Some(true) && is_ready(&agent)
    })
    .await;

    // Under mps a card is unhealthy until its daemon runs.
    wait_until("node-1's cards healthy under mps", Duration::from_secs(60), || async {
        let n = nodes.get("node-1").await.unwrap();
        let text =
            n.metadata.annotations.unwrap_or_default().get(GPUS_ANNOTATION).cloned().unwrap_or_default();
        NodeInventory::decode(&text).is_ok_and(|inv| inv.gpus.iter().all(|g| g.healthy))
    })
    .await;

    // Another user's shares, one per node, in their own namespace.
    let mut before = Vec::new();
    for node in ["node-1", "node-2"] {
        let name = format!("neighbour-{node}");
        let mut pod = on(node, percent_pod(&name, 30));
        pod.metadata.namespace = Some("default".into());
        let created = create(&neighbours, &pod).await;
        assert_eq!(created.spec.unwrap().scheduler_name.as_deref(), Some("nano-gpu-scheduler"), "{name}");
        let start = std::time::Instant::now();
        while neighbours.get(&name).await.map(|p| phase(&p) != "Running").unwrap_or(true) {
            if start.elapsed() > Duration::from_secs(120) {
                let pod = cluster.kubectl(&["get", "pod", "-n", "default", &name, "-o", "yaml"]);
                let events = cluster.kubectl(&["get", "events", "-A", "--sort-by=.lastTimestamp"]);
                let logs = cluster.kubectl(&[
                    "logs",
                    "-n",
                    SYSTEM,
                    "-l",
                    "app.kubernetes.io/name=nano-gpu-allocator",
                    "--all-containers",
                    "--tail=-1",
                    "--prefix",
                ]);
                let node = nodes.get(node).await.unwrap().metadata.annotations.unwrap_or_default();
                panic!(
                    "{name} not Running:\n{:?}\n{}\n{}\n{}\n{}",
                    node.get(GPUS_ANNOTATION),
                    cluster.inspect(),
                    String::from_utf8_lossy(&pod.stdout),
                    String::from_utf8_lossy(&events.stdout),
                    String::from_utf8_lossy(&logs.stdout)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let seen = report(&neighbours, &name, "c").await;
        assert_eq!(seen.cards, assigned(&neighbours, &name).await, "{name}");
        let devices = cluster.kubelet_devices(node).await[&format!("default/{name}/c")].clone();
        before.push((node, name, seen.cards, seen.env, devices));
    }

    // A share whose own env asks every card (and every SM of MPS) sees its one card; a pod asking no
    // GPU, whose image says `all`, sees none.
    let mut widen = on("node-2", percent_pod("widen", 10));
    widen.spec.as_mut().unwrap().containers[0].env = Some(vec![
        serde_json::from_value(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})).unwrap(),
        serde_json::from_value(json!({"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"})).unwrap(),
    ]);
    create(&pods, &widen).await;
    create(&pods, &gpu_pod("no-gpu", &[("c", &[])], json!({}))).await;
    wait_running(&pods, &["widen".into(), "no-gpu".into()], Duration::from_secs(120)).await;
    let seen = report(&pods, "widen", "c").await;
    assert_eq!(seen.env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("all"), "its own env won");
    assert_eq!(
        seen.cards,
        assigned(&pods, "widen").await,
        "a share asking all cards by its env sees its own"
    );
    let none = report(&pods, "no-gpu", "c").await;
    assert!(none.cards.is_empty() && none.mounts.is_empty(), "a pod asking no GPU sees a card: {none:?}");

    // Refused at admission, each with its reason.
    let memory_only = gpu_pod("memory-only", &[("c", &[("nano-gpu/gpu-memory", "4096")])], json!({}));
    let why = refused("memory without a percent", pods.create(&PostParams::default(), &memory_only).await);
    assert!(why.contains("nano-gpu/gpu-memory without nano-gpu/gpu-percent"), "{why}");
    let mut mounting = gpu_pod("mounting", &[("c", &[])], json!({}));
    let spec = mounting.spec.as_mut().unwrap();
    spec.volumes = Some(vec![
        serde_json::from_value(json!({"name": "all", "hostPath": {"path": "/dev/null"}})).unwrap(),
    ]);
    spec.containers[0].volume_mounts = Some(vec![
        serde_json::from_value(json!({"name": "all", "mountPath": "/var/run/nvidia-container-devices/all"}))
            .unwrap(),
    ]);
    let why = refused("a hostPath device list", pods.create(&PostParams::default(), &mounting).await);
    assert!(why.contains("hostPath"), "{why}");
    let mut privileged = gpu_pod("privileged", &[("c", &[])], json!({}));
    privileged.spec.as_mut().unwrap().containers[0].security_context =
        Some(serde_json::from_value(json!({"privileged": true})).unwrap());
    let why = refused("a privileged container", pods.create(&PostParams::default(), &privileged).await);
    assert!(why.contains("privileged"), "{why}");
    // Devices asked of the runtime by annotation (CDI's, which NVIDIA's runtime honours before any
    // device list; CRI-O's; the NRI device injector's), on a pod asking no GPU and on one that does;
    // nor added to a running pod.
    let device_annotations = [
        ("cdi.k8s.io/all", "nvidia.com/gpu=all"),
        ("io.kubernetes.cri-o.Devices", "/dev/fuse,/dev/nvidia0"),
        ("devices.nri.io/container.c", "- path: /dev/nvidia0"),
    ];
    for (key, value) in device_annotations {
        for (name, limits) in
            [("annotated", &[][..]), ("annotated-share", &[("nano-gpu/gpu-percent", "10")][..])]
        {
            let pod = gpu_pod(name, &[("c", limits)], json!({ key: value }));
            let why = refused(&format!("{key} on {name}"), pods.create(&PostParams::default(), &pod).await);
            assert!(why.contains(key) && why.contains("device plugin"), "{why}");
        }
        let added = json!({"metadata": {"annotations": {key: value}}});
        let why = refused(
            &format!("{key} added to a running share"),
            pods.patch("widen", &PatchParams::default(), &Patch::Merge(&added)).await,
        );
        assert!(why.contains(key), "{why}");
    }
    // CRI-O's annotation for /dev/fuse alone, as Eclipse Che and CI runners ask it, is admitted.
    let fuse = gpu_pod("fuse", &[("c", &[])], json!({"io.kubernetes.cri-o.Devices": "/dev/fuse"}));
    pods.create(&PostParams::default(), &fuse).await.expect("a pod asking /dev/fuse of CRI-O");
    pods.delete("fuse", &DeleteParams::default()).await.unwrap();
    let models = json!({"nano-gpu/gpu-model": "a|".repeat(100_000)});
    let huge = gpu_pod("huge-models", &[("c", &[("nano-gpu/gpu-percent", "10")])], models);
    let why = refused("a 200 kB model list", pods.create(&PostParams::default(), &huge).await);
    assert!(why.contains("at most 1024"), "{why}");
    // Nor made so later, on a pod that was admitted.
    let longer = json!({"metadata": {"annotations": {"nano-gpu/gpu-model": "a|".repeat(100_000)}}});
    let why = refused(
        "a model list made 200 kB long",
        pods.patch("widen", &PatchParams::default(), &Patch::Merge(&longer)).await,
    );
    assert!(why.contains("at most 1024"), "{why}");

    // Only nano-gpu writes assignments and the overrun mark; a tenant's own pod included.
    let stolen =
        pods.get("widen").await.unwrap().metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION].clone();
    let forged = gpu_pod("forged", &[("c", &[])], json!({ ASSIGNMENT_ANNOTATION: stolen }));
    let why = refused("a forged assignment", pods.create(&PostParams::default(), &forged).await);
    assert!(why.contains("only nano-gpu may set nano-gpu/assignment"), "{why}");
    let rewrite =
        json!({"metadata": {"annotations": { ASSIGNMENT_ANNOTATION: stolen.replace("node-2", "node-1") }}});
    let why = refused(
        "a rewritten assignment",
        pods.patch("widen", &PatchParams::default(), &Patch::Merge(&rewrite)).await,
    );
    assert!(why.contains("may not"), "{why}");
    let overrun = json!({"metadata": {"labels": {"nano-gpu/overrun": "false"}}});
    let why = refused(
        "the overrun label",
        pods.patch("widen", &PatchParams::default(), &Patch::Merge(&overrun)).await,
    );
    assert!(why.contains("label nano-gpu/overrun"), "{why}");
    let mut allowed = Vec::new();
    for (verb, resource, subresource, namespace) in [
        ("create", "pods", "binding", NS),
        ("patch", "pods", "status", NS),
        ("create", "events", "", SYSTEM),
        ("patch", "nodes", "", NS),
        ("get", "secrets", "", SYSTEM),
    ] {
        let sub = format!("--subresource={subresource}");
        let mut args = vec!["auth", "can-i", verb, resource, "-n", namespace];
        if !subresource.is_empty() {
            args.push(&sub);
        }
        let out = cluster.kubectl_as(&kubeconfig, &args);
        if String::from_utf8_lossy(&out.stdout).trim() != "no" {
            allowed.push(format!("{verb} {resource} {subresource} in {namespace}"));
        }
    }
    let list = cluster.kubectl_as(&kubeconfig, &["auth", "can-i", "--list", "-n", NS]);
    assert!(allowed.is_empty(), "the tenant may {allowed:?}:\n{}", String::from_utf8_lossy(&list.stdout));
    // (The same checks allow what a tenant does: it may create pods.)
    let out = cluster.kubectl_as(&kubeconfig, &["auth", "can-i", "create", "pods", "-n", NS]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "yes");

    // MPS on node-1: a share that runs as another user than root asks its card's daemon to quit and
    // is refused; a share running as root tries to replace the daemon's PID file in the pipe
    // directory with a FIFO, and cannot: its pipe directory is read-only. The agent answers, the
    // card stays healthy, no neighbour is told its daemon was lost.
    let mut quitter = on(
        "node-1",
        percent_pod_then("quitter", 1, "echo quit | nvidia-cuda-mps-control; echo asked; exec sleep 86400"),
    );
    quitter.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"runAsUser": 1000})).unwrap());
    create(&pods, &quitter).await;
    let says = |name: &'static str, text: &'static str| {
        let cluster = &cluster;
        async move {
            wait_until(&format!("{name} says {text:?}"), Duration::from_secs(60), || async {
                let out = cluster.kubectl(&["logs", "-n", NS, name]);
                String::from_utf8_lossy(&out.stdout).contains(text)
            })
            .await
        }
    };
    says("quitter", "Not enough privilege to execute quit command").await;
    // (Nor can it move its pipe directory away to put a link in its place, which the next share's
    // mount would follow on the host: the directory is the root of its mount.)
    let tamper = "cd /tmp/nvidia-mps && rm -f nvidia-cuda-mps-control.pid && mkfifo nvidia-cuda-mps-control.pid \
                  && echo tampered; mv /tmp/nvidia-mps /tmp/moved 2>/dev/null && echo MOVED; echo tried; exec sleep 86400";
    create(&pods, &on("node-1", percent_pod_then("tamper", 1, tamper))).await;
    says("tamper", "tried").await;
    let out = cluster.kubectl(&["logs", "-n", NS, "tamper"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("MOVED"), "a share moved its pipe directory");
    assert!(!said.contains("tampered"), "a share replaced its daemon's PID file");
    let card = assigned(&pods, "tamper").await.into_iter().next().unwrap();
    // The card's pipe directory, as the agent hands it, is an emptyDir of its daemon's pod, whose
    // host directory its supervisor names.
    let named = mps_client_pipe(&card).display().to_string();
    assert!(
        named.contains("kubernetes.io~empty-dir/pipe-"),
        "the pipe directory is not an emptyDir: {named}"
    );
    // (A tmpfs in node-1's mount namespace, where its kubelet mounted it.)
    let pid_file = format!("{named}/nvidia-cuda-mps-control.pid");
    let kind = cluster.on_node("node-1", &["stat", "-c", "%F", &pid_file]).output().unwrap();
    let kind = String::from_utf8_lossy(&kind.stdout);
    assert_eq!(kind.trim(), "regular file", "{pid_file} is not the daemon's PID file");
    // Longer than the agent's daemon watch (5 s) and its health refresh.
    for _ in 0..20 {
        assert!(healthy(&nodes, "node-1", &card).await, "the tampered card {card} was made unhealthy");
        let agent = agent_on(&system, "node-1").await.unwrap();
        assert!(is_ready(&agent), "node-1's agent is not Ready after the tamper");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let ip = agent_on(&system, "node-1").await.unwrap().status.unwrap().pod_ip.unwrap();
    let (code, body) = cluster.curl(&format!("http://{ip}:9401/readyz"), None, &[]);
    assert_eq!(code, 200, "{body}");
    let events: Api<Event> = Api::all(admin.clone());
    let lost: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("MpsDaemonLost"))
        .map(|e| format!("{:?}: {:?}", e.involved_object.name, e.message))
        .collect();
    assert!(lost.is_empty(), "a daemon counted as lost: {lost:?}");
    // A new share on node-1 is given its card.
    create(&pods, &on("node-1", percent_pod("after-tamper", 20))).await;
    wait_running(&pods, &["after-tamper".into()], Duration::from_secs(120)).await; // after-tamper
    assert_eq!(report(&pods, "after-tamper", "c").await.cards, assigned(&pods, "after-tamper").await);

    // An MPS share tries to fill its pipe directory (its card's, read-only to it), then fills its
    // /dev/shm (its own, a bounded tmpfs): the neighbour on another card of node-1 keeps all of its
    // own. (80 % does not fit beside the neighbour's 30 %.)
    let fill = "dd if=/dev/zero of=/tmp/nvidia-mps/fill bs=1M 2>/dev/null; \
                echo piped $(cat /tmp/nvidia-mps/fill 2>/dev/null | wc -c) bytes; \
                dd if=/dev/zero of=/dev/shm/fill bs=1M 2>/dev/null; \
                echo filled $(du -k /dev/shm/fill | cut -f1) KiB; exec sleep 86400";
    create(&pods, &on("node-1", percent_pod_then("filler", 80, fill))).await;
    says("filler", "filled ").await;
    let out = cluster.kubectl(&["logs", "-n", NS, "filler"]);
    let logged = String::from_utf8_lossy(&out.stdout).to_string();
    let count = |word: &str| -> u64 {
        logged.split_whitespace().skip_while(|w| *w != word).nth(1).and_then(|w| w.parse().ok()).expect(word)
    };
    let (piped, filled) = (count("piped"), count("filled"));
    assert_eq!(piped, 0, "a share wrote {piped} bytes in its card's pipe directory");
    // Stopped by its 64 MiB, not before, not after.
    assert!(
        (60 * 1024..=64 * 1024).contains(&filled),
        "a share wrote {filled} KiB in /dev/shm: not its own 64 MiB"
    );
    let neighbour_card = assigned(&neighbours, "neighbour-node-1").await;
    assert_ne!(assigned(&pods, "filler").await, neighbour_card, "the filler landed on the neighbour's card");
    let script =
        "test -e /dev/shm/fill && echo SEEN; echo FREE $(df -k /dev/shm | tail -1 | awk '{print $4}')";
    let seen =
        cluster.ok(&["exec", "-n", "default", "neighbour-node-1", "-c", "c", "--", "sh", "-c", script]);
    assert!(!seen.contains("SEEN"), "the neighbour's /dev/shm holds the filler's file: {seen}");
    let free: u64 = seen.split_whitespace().skip_while(|w| *w != "FREE").nth(1).unwrap().parse().unwrap();
    assert!(
        free > 60 * 1024,
        "the neighbour's /dev/shm has {free} KiB free after another card's share filled its own"
    );
    pods.delete("filler", &DeleteParams::default()).await.unwrap();

    // A pod labelled as nano-gpu's agent (in the tenant's namespace) on node-2, whose agent is not
    // Ready (frozen: its kubelet's probes fail, its device plugin stays registered): a GPU pod is not
    // placed there. Once the real agent is back (resumed, or restarted by its liveness probe), it is.
    let mut posing = on("node-2", gpu_pod("posing", &[("c", &[])], json!({})));
    posing.metadata.labels =
        Some([("app.kubernetes.io/name".to_owned(), "nano-gpu-agent".to_owned())].into());
    create(&pods, &posing).await;
    wait_until("the posing pod Ready", Duration::from_secs(60), || async {
        pods.get("posing").await.is_ok_and(|p| is_ready(&p))
    })
    .await;
    let agent_2 = agent_on(&system, "node-2").await.unwrap().metadata.name.unwrap();
    cluster.signal_container(SYSTEM, &agent_2, "agent", "SIGSTOP");
    wait_until("node-2's agent not Ready", Duration::from_secs(60), || async {
        system.get(&agent_2).await.is_ok_and(|p| !is_ready(&p))
    })
    .await;
    create(&pods, &on("node-2", percent_pod("lured", 10))).await;
    let tenant_events: Api<Event> = Api::namespaced(admin.clone(), NS);
    let start = std::time::Instant::now();
    loop {
        let list =
            tenant_events.list(&ListParams::default().fields("involvedObject.name=lured")).await.unwrap();
        let said: Vec<String> = list.items.iter().filter_map(|e| e.message.clone()).collect();
        if said.iter().any(|m| m.contains("no Ready nano-gpu agent")) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "lured not refused for want of an agent: {said:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let lured = pods.get("lured").await.unwrap();
    assert_eq!(
        lured.spec.and_then(|s| s.node_name),
        None,
        "a GPU pod was placed where only a posing agent runs"
    );
    // (Its liveness probe may have restarted it meanwhile.)
    let _ = cluster.try_signal_container(SYSTEM, &agent_2, "agent", "SIGCONT");
    wait_running(&pods, &["lured".into()], Duration::from_secs(180)).await;
    // The leader sends a refused pod back to kube-scheduler's queue once its view has changed (see
    // allocator/src/service/requeue.rs): its pod comes to carry the view's generation. It looks once a
    // second, so kube-scheduler, woken by the agent's return, may have placed `lured` first.
    let leader = cluster.allocator_leader().unwrap();
    let start = std::time::Instant::now();
    loop {
        let labels = system.get(&leader).await.unwrap().metadata.labels.unwrap_or_default();
        if labels.contains_key("nano-gpu/view") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "{leader}: {labels:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // A share holds 64 connections to the webhook's port, which any pod reaches, without a byte: the
    // allocator closes those past 32 at once, and the rest once their TLS handshake is 10 s late;
    // meanwhile the API server's calls to the webhook are answered (a new GPU pod is created and
    // runs), and no allocator is restarted.
    let leader = cluster.allocator_leader().unwrap();
    let allocator_restarts = restarts(&system, &leader).await;
    let ip = system.get(&leader).await.unwrap().status.unwrap().pod_ip.unwrap();
    let flood = format!(
        "count() {{ c=0; for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = nc ] && c=$((c+1)); done; echo $c; }}; \
         n=0; while [ $n -lt 64 ]; do (sleep 600 | nc {ip} 8443) & n=$((n+1)); done; \
         sleep 3; echo at-once $(count); sleep 15; echo later $(count); exec sleep 86400"
    );
    create(&pods, &on("node-2", percent_pod_then("flood", 1, &flood))).await;
    says("flood", "at-once ").await;
    create(&pods, &on("node-2", percent_pod("after-flood", 10))).await;
    wait_running(&pods, &["after-flood".into()], Duration::from_secs(120)).await;
    says("flood", "later ").await;
    let out = cluster.kubectl(&["logs", "-n", NS, "flood"]);
    let logged = String::from_utf8_lossy(&out.stdout).to_string();
    let held = |word: &str| -> u32 {
        logged.split_whitespace().skip_while(|w| *w != word).nth(1).and_then(|w| w.parse().ok()).expect(word)
    };
    let (at_once, later) = (held("at-once"), held("later"));
    eprintln!(
        "the webhook's port: {at_once} of a share's 64 idle connections open at once, {later} after 18 s"
    );
    assert!(at_once <= 32, "a share held {at_once} connections to the webhook's port at once (at most 32)");
    assert_eq!(later, 0, "connections without a handshake were still open after 18 s");
    assert_eq!(restarts(&system, &leader).await, allocator_restarts, "{leader} was restarted");

    // The neighbours kept their cards, their limits and their containers.
    for (node, name, cards, env, devices) in before {
        let p = neighbours.get(&name).await.unwrap();
        assert_eq!(phase(&p), "Running", "{name}");
        assert_eq!(restarts(&neighbours, &name).await, 0, "{name} was restarted");
        assert_eq!(assigned(&neighbours, &name).await, cards, "{name}'s assignment changed");
        assert_eq!(env.get("NANO_GPU_PERCENT").map(String::as_str), Some("30"), "{name}");
        let now = cluster.kubelet_devices(node).await[&format!("default/{name}/c")].clone();
        assert_eq!(now, devices, "{name}'s device IDs changed");
    }
    assert_eq!(nano_gpu_tests::checks::check_consistency(&cluster, &admin).await, 9);
    for name in
        ["widen", "no-gpu", "quitter", "tamper", "after-tamper", "posing", "lured", "flood", "after-flood"]
    {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    cluster.down();
    clear_mps_dirs("node-1");
}
