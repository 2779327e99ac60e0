//! End to end against the real control plane (`hack/cluster.sh`): upstream etcd, kube-apiserver and
//! kube-scheduler with the shipped configuration, the allocator and its webhook, and three simulated
//! GPU nodes (a kubelet stand-in on the upstream device manager and a nano-gpu-agent on fake NVML
//! cards each). One cluster for the whole test, the steps in order; each step says what it proves.
//!
//! The first run builds the upstream binaries (hack/k8s-build.sh, a few minutes, cached after).

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, GPUS_ANNOTATION, NodeInventory};
use nano_gpu_proto::device_id;
use nano_gpu_tests::cluster::{
    Cluster, NS, create, http_get, kill_and_restart, percent_pod, phase, pod, wait_running, wait_until,
};
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Every Running pod: the card(s) in its env equal its assignment and the cards of its kubelet device
/// IDs; no card is over 100 % or over its memory; the allocator's view holds exactly what the
/// assignments of the bound pods hold (no leaked reservation). Returns the pods checked.
async fn check_consistency(cluster: &Cluster, client: &kube::Client) -> usize {
    let nodes = Api::<Node>::all(client.clone()).list(&ListParams::default()).await.unwrap();
    let mut card_memory: HashMap<String, u64> = HashMap::new();
    for n in &nodes.items {
        if let Some(text) = n.metadata.annotations.as_ref().and_then(|a| a.get(GPUS_ANNOTATION)) {
            for g in NodeInventory::decode(text).unwrap().gpus {
                card_memory.insert(g.uuid, g.memory_mib.0);
            }
        }
    }
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await.unwrap();
    let (mut percent, mut memory): (HashMap<String, u32>, HashMap<String, u64>) = Default::default();
    let mut checked = 0;
    for p in &pods.items {
        let Some(text) = p.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)) else {
            continue;
        };
        let a = Assignment::decode(text).unwrap();
        let key =
            format!("{}/{}", p.metadata.namespace.as_deref().unwrap(), p.metadata.name.as_deref().unwrap());
        if !matches!(phase(p), "Succeeded" | "Failed") {
            for g in a.held() {
                *percent.entry(g.uuid.clone()).or_default() += g.percent.0;
                *memory.entry(g.uuid.clone()).or_default() += g.memory_mib.map_or(0, |m| m.0);
            }
        }
        if phase(p) != "Running" {
            continue;
        }
        let node = p.spec.as_ref().unwrap().node_name.clone().unwrap();
        let state = cluster.standin(&node);
        let recorded = &state["pods"][&key];
        assert_eq!(recorded["phase"], "Running", "{key}: stand-in state {recorded}");
        for (container, grants) in &a.containers {
            let assigned: BTreeSet<&str> = grants.iter().map(|g| g.uuid.as_str()).collect();
            let c = &recorded["containers"][container];
            let env_cards: BTreeSet<&str> =
                c["env"]["NANO_GPU_CARDS"].as_str().unwrap_or("").split(',').collect();
            assert_eq!(env_cards, assigned, "{key}/{container}: env {} vs assignment", c["env"]);
            let ids: BTreeSet<&str> = c["devices"]
                .as_object()
                .unwrap()
                .values()
                .flat_map(|ids| {
                    ids.as_array().unwrap().iter().map(|id| device_id::card_of(id.as_str().unwrap()).unwrap())
                })
                .collect();
            assert_eq!(ids, assigned, "{key}/{container}: kubelet device IDs vs assignment");
        }
        checked += 1;
    }
    for (card, used) in &percent {
        assert!(*used <= 100, "card {card} is at {used} %");
        assert!(
            memory[card] <= card_memory[card],
            "card {card} memory {} > {}",
            memory[card],
            card_memory[card]
        );
    }
    // The allocator's accounting equals the assignments: nothing reserved and forgotten.
    let (_, body) = http_get(&format!("{}/inspect", cluster.extender()));
    let view: Value = serde_json::from_str(&body).unwrap();
    for node in view["nodes"].as_array().unwrap() {
        for card in node["cards"].as_array().unwrap() {
            let uuid = card["uuid"].as_str().unwrap();
            assert_eq!(
                card["percentUsed"].as_u64().unwrap() as u32,
                percent.get(uuid).copied().unwrap_or(0),
                "allocator's view of {uuid} differs from the assignments"
            );
        }
    }
    checked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_works_against_the_real_control_plane() {
    let cluster = Cluster::up(3);
    let client = nano_gpu_runtime::connect(Some(Path::new(&cluster.env["ADMIN_KUBECONFIG"]))).await.unwrap();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The webhook: pods asking nano-gpu resources get the nano-gpu scheduler; 150 % is refused.
    let created = create(&pods, &percent_pod("share-30", 30)).await;
    assert_eq!(created.spec.as_ref().unwrap().scheduler_name.as_deref(), Some("nano-gpu-scheduler"));
    let refused = pods.create(&PostParams::default(), &percent_pod("bad-150", 150)).await.unwrap_err();
    assert!(refused.to_string().contains("150 is neither 1..=100 nor a multiple of 100"), "{refused}");

    // Shares, whole cards, several containers, a card model, gpushare memory: all run where their
    // assignment says. The card-model pod goes first: only node-2's two T4 cards can take it.
    create(
        &pods,
        &pod("t4", &[("c", &[("nano-gpu/gpu-percent", "40")])], json!({"nano-gpu/gpu-model": "Tesla T4"})),
    )
    .await;
    let mut names = vec!["share-30".to_string()];
    for (name, percent) in [("share-50", 50), ("whole-1", 100), ("whole-2", 200)] {
        create(&pods, &percent_pod(name, percent)).await;
        names.push(name.into());
    }
    create(
        &pods,
        &pod(
            "multi",
            &[("a", &[("nano-gpu/gpu-percent", "60")]), ("b", &[("nano-gpu/gpu-percent", "20")])],
            json!({}),
        ),
    )
    .await;
    create(&pods, &pod("gpushare", &[("c", &[("aliyun.com/gpu-mem", "4")])], json!({}))).await;
    names.extend(["multi", "t4", "gpushare"].map(String::from));
    wait_running(&pods, &names, Duration::from_secs(120)).await;
    assert_eq!(check_consistency(&cluster, &client).await, names.len());
    let t4 = pods.get("t4").await.unwrap();
    let a = Assignment::decode(&t4.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    assert_eq!(a.node, "node-2", "the only Tesla T4 cards are on node-2");
    let gpushare = pods.get("gpushare").await.unwrap();
    let node = gpushare.spec.unwrap().node_name.unwrap();
    let env = &cluster.standin(&node)["pods"]["e2e/gpushare"]["containers"]["c"]["env"];
    assert_eq!(env["ALIYUN_COM_GPU_MEM_CONTAINER"], "4", "{env}");
    assert!(env["ALIYUN_COM_GPU_MEM_IDX"].is_string() && env["ALIYUN_COM_GPU_MEM_DEV"].is_string(), "{env}");
    let whole = Assignment::decode(
        &pods.get("whole-2").await.unwrap().metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION],
    )
    .unwrap();
    assert!(whole.containers["c"].len() == 2 && whole.containers["c"].iter().all(|g| g.percent.0 == 100));

    // Only nano-gpu writes assignments (deploy/assignment-policy.yaml): anyone else's, even the
    // cluster admin's, is refused with the reason, on a new pod and on a running one.
    let stolen = whole.encode();
    let forged = pod("forged", &[("c", &[])], json!({ ASSIGNMENT_ANNOTATION: stolen }));
    match pods.create(&PostParams::default(), &forged).await {
        Err(kube::Error::Api(e)) => {
            assert!(e.message.contains("only nano-gpu may set nano-gpu/assignment"), "{}", e.message)
        }
        other => panic!("a forged assignment was admitted: {other:?}"),
    }
    let patch = json!({"metadata": {"annotations": { ASSIGNMENT_ANNOTATION: stolen }}});
    match pods.patch("t4", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await {
        Err(kube::Error::Api(e)) => assert!(e.message.contains("may not"), "{}", e.message),
        other => panic!("an assignment was rewritten by the admin: {other:?}"),
    }
    // Other annotations stay the users' own.
    let label = json!({"metadata": {"annotations": {"team": "ml"}}});
    pods.patch("t4", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&label)).await.unwrap();

    // Pods that fit nowhere stay Pending with a FailedScheduling event naming the reason: one the
    // in-tree fit check stops (more percent than any node has), one only the extender can judge (a
    // card model no node has).
    create(&pods, &percent_pod("too-big", 1600)).await;
    create(
        &pods,
        &pod(
            "no-such-model",
            &[("c", &[("nano-gpu/gpu-percent", "100")])],
            json!({"nano-gpu/gpu-model": "NVIDIA H100"}),
        ),
    )
    .await;
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    for (name, reason) in
        [("too-big", "Insufficient nano-gpu/gpu-percent"), ("no-such-model", "no card of an allowed model")]
    {
        wait_until(&format!("FailedScheduling for {name}"), Duration::from_secs(60), || async {
            let selector = format!("involvedObject.name={name}");
            let list = events.list(&ListParams::default().fields(&selector)).await.unwrap();
            list.items.iter().any(|e| {
                e.reason.as_deref() == Some("FailedScheduling")
                    && e.message.as_deref().is_some_and(|m| m.contains(reason))
            })
        })
        .await;
        assert_eq!(phase(&pods.get(name).await.unwrap()), "Pending");
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }

    // kill -9 of the allocator in the middle of a burst of 200 pods, then a restart: every pod is
    // bound, nothing over-committed, no reservation leaked.
    let burst: Vec<String> = (0..200).map(|i| format!("burst-{i:03}")).collect();
    for (i, name) in burst.iter().enumerate() {
        create(&pods, &percent_pod(name, [1, 2, 3, 4, 5][i % 5])).await;
        if i == 60 {
            kill_and_restart(&cluster, "allocator", true);
        }
    }
    wait_running(&pods, &burst, Duration::from_secs(300)).await;
    check_consistency(&cluster, &client).await;

    // An agent and a kubelet stand-in restart: they register again, no allocation is lost, and new
    // pods still land on their node.
    let before = cluster.standin("node-1")["pods"].as_object().map_or(0, |p| p.len());
    kill_and_restart(&cluster, "agent-node-1", true);
    kill_and_restart(&cluster, "standin-node-1", true);
    let nodes: Api<Node> = Api::all(client.clone());
    wait_until("node-1 ready again", Duration::from_secs(60), || async {
        let probe = std::fs::read_to_string(cluster.path("nodes/node-1/agent-probe-port")).unwrap();
        let n = nodes.get("node-1").await.unwrap();
        let allocatable = n.status.and_then(|s| s.allocatable).unwrap_or_default();
        http_get(&format!("http://127.0.0.1:{}/readyz", probe.trim())).0 == 200
            && allocatable.get("nano-gpu/gpu-percent").is_some_and(|q| q.0 != "0")
    })
    .await;
    assert_eq!(cluster.standin("node-1")["pods"].as_object().map_or(0, |p| p.len()), before);
    let after: Vec<String> = (0..10).map(|i| format!("after-restart-{i}")).collect();
    for name in &after {
        create(&pods, &percent_pod(name, 5)).await;
    }
    wait_running(&pods, &after, Duration::from_secs(120)).await;
    check_consistency(&cluster, &client).await;

    // An agent writes its Node's inventory again when someone removes it.
    let remove = json!({"metadata": {"annotations": {GPUS_ANNOTATION: null}}});
    nodes
        .patch("node-3", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&remove))
        .await
        .unwrap();
    wait_until("node-3's inventory written again", Duration::from_secs(30), || async {
        let n = nodes.get("node-3").await.unwrap();
        n.metadata.annotations.is_some_and(|a| a.contains_key(GPUS_ANNOTATION))
    })
    .await;

    // Two allocator replicas: only the leader is ready (so only it serves); killing it hands over.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let tls = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let second = Command::new(nano_gpu_tests::workspace_binary("nano-gpu-allocator"))
        .args([
            "--kubeconfig",
            cluster.path("allocator.kubeconfig").to_str().unwrap(),
            "serve",
            "--leader-elect",
        ])
        .args(["--listen", &format!("127.0.0.1:{port}"), "--tls-listen", &format!("127.0.0.1:{tls}")])
        .args(["--tls-dns-names", "localhost", "--gpushare", "gib"])
        .env("POD_NAME", "allocator-1")
        .env("POD_NAMESPACE", "nano-gpu-system")
        .stderr(std::fs::File::create(cluster.path("allocator-1.log")).unwrap())
        .spawn()
        .unwrap();
    let second = nano_gpu_tests::Killed(second);
    let follower = format!("http://127.0.0.1:{port}");
    wait_until("the second replica up", Duration::from_secs(30), || async {
        http_get(&format!("{follower}/healthz")).0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(http_get(&format!("{}/readyz", cluster.extender())).0, 200, "the first replica leads");
    assert_eq!(http_get(&format!("{follower}/readyz")).0, 503, "the second replica follows");
    // One webhook certificate for every replica: the second did not replace the CA the API server
    // trusts; the bundle in the webhook configuration verifies both replicas' HTTPS endpoints.
    let hooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let webhook = hooks.get("nano-gpu-allocator").await.unwrap();
    let bundle = webhook.webhooks.unwrap()[0].client_config.ca_bundle.clone().unwrap();
    std::fs::write(cluster.path("webhook-ca.pem"), &bundle.0).unwrap();
    for port in [cluster.env["WEBHOOK_PORT"].clone(), tls.to_string()] {
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
            .arg(cluster.path("webhook-ca.pem"))
            .arg(format!("https://localhost:{port}/healthz"))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "200",
            "replica on {port} is not trusted by the webhook's CA"
        );
    }
    // A follower that is asked anyway refuses to decide.
    let args = json!({"Pod": percent_pod("probe", 10), "NodeNames": ["node-1"]}).to_string();
    let out = Command::new("curl")
        .args(["-s", "-X", "POST", "--data", &args, &format!("{follower}/filter")])
        .output()
        .unwrap();
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(answer["Error"].as_str().is_some_and(|e| !e.is_empty()), "the follower decided: {answer}");
    kill_and_restart(&cluster, "allocator", false);
    wait_until("the second replica takes over", Duration::from_secs(30), || async {
        http_get(&format!("{follower}/readyz")).0 == 200
    })
    .await;
    let (_, view) = http_get(&format!("{follower}/inspect"));
    assert!(view.contains("e2e/burst-000"), "the new leader sees the cluster");

    // The webhook's allocator (the first replica) is gone now: only pods asking GPU resources are
    // sent to it (matchConditions), so a CPU-only pod is still admitted, a GPU pod is refused.
    let cpu_only: Pod = serde_json::from_value(json!({"metadata": {"name": "cpu-only", "namespace": NS},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &cpu_only).await.expect("a CPU-only pod is not sent to the webhook");
    let refused = pods.create(&PostParams::default(), &percent_pod("gpu-while-down", 10)).await.unwrap_err();
    assert!(refused.to_string().contains("failed calling webhook"), "{refused}");
    drop(second);
}
