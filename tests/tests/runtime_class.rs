//! nano-gpu where the NVIDIA runtime is a RuntimeClass, not the nodes' default runtime
//! (`hack/cluster.sh up --runtime-class`: each node's containerd runs plain runc by default and the
//! runtime stand-in as the handler `nvidia`; the install adds the component
//! `deploy/components/runtime-class-nvidia`). The agent runs under the class and its canary finds the
//! runtime holding; a GPU pod that names no class is given `nvidia` by the webhook and sees exactly its
//! card; a GPU pod that names plain runc itself keeps it and sees none, though the agent handed it its
//! card (so the class is what gives containers their cards); a pod asking no GPU whose image says
//! `NVIDIA_VISIBLE_DEVICES=all` sees none; once the class has an overhead and a toleration, a GPU pod
//! the webhook gives it is admitted with both and runs on its card; `kubectl nano-gpu check` finds the
//! class; a share still lands on the node once it is tainted as GKE taints GPU nodes (the webhook's
//! default tolerations); then the card and accounting checks.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
use nano_gpu_tests::cluster::{Cluster, NS, create, gpu_pod, percent_pod, report, wait_running, wait_until};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";

fn runtime_class(p: &Pod) -> Option<&str> {
    p.spec.as_ref().and_then(|s| s.runtime_class_name.as_deref())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_class_gives_gpu_pods_their_cards_and_nothing_else_gets_any() {
    let cluster = Cluster::up_with_runtime_class("runtime-class", 1);
    let client = cluster.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let nodes: Api<Node> = Api::all(client.clone());
    cluster.ok(&["create", "namespace", NS]);
    cluster.ok(&["label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline"]);

    // The agent runs under the class, and its canary (same pod, same runtime) is given no card.
    let agents = system.list(&Default::default()).await.unwrap().items;
    let agent = agents
        .iter()
        .find(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with("nano-gpu-agent-")))
        .expect("an agent pod");
    assert_eq!(runtime_class(agent), Some("nvidia"));
    wait_until("node-1's runtime judged", Duration::from_secs(60), || async {
        let labels = nodes.get("node-1").await.unwrap().metadata.labels.unwrap_or_default();
        labels.get("nano-gpu/device-isolation").map(String::as_str) == Some("held")
    })
    .await;

    // A share that names no class gets the NVIDIA runtime's from the webhook, and its card.
    let share = create(&pods, &percent_pod("share", 30)).await;
    assert_eq!(runtime_class(&share), Some("nvidia"), "the webhook gave no class");
    // One that names plain runc keeps it: its card is handed over, but no runtime gives it.
    let mut plain = percent_pod("plain-runc", 30);
    plain.spec.as_mut().unwrap().runtime_class_name = Some("runc".into());
    let plain = create(&pods, &plain).await;
    assert_eq!(runtime_class(&plain), Some("runc"));
    // A pod asking no GPU, its image saying NVIDIA_VISIBLE_DEVICES=all, runs under the default.
    let cpu = create(&pods, &gpu_pod("no-gpu", &[("c", &[])], json!({}))).await;
    assert_eq!(runtime_class(&cpu), None);
    let names: Vec<String> = ["share", "plain-runc", "no-gpu"].map(String::from).to_vec();
    wait_running(&pods, &names, Duration::from_secs(120)).await;

    let assigned = |p: Pod| {
        let a = Assignment::decode(&p.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
        a.containers["c"].iter().map(|g| g.uuid.clone()).collect::<BTreeSet<String>>()
    };
    let cards = assigned(pods.get("share").await.unwrap());
    let seen = report(&pods, "share", "c").await;
    println!("share: assigned {cards:?}, NVML shows {:?}", seen.cards);
    assert_eq!((cards.len(), &seen.cards), (1, &cards), "{seen:?}");
    let handed = assigned(pods.get("plain-runc").await.unwrap());
    let seen = report(&pods, "plain-runc", "c").await;
    println!("plain-runc: assigned {handed:?}, device mounts {:?}, NVML shows {:?}", seen.mounts, seen.cards);
    assert_eq!(seen.mounts, handed, "the agent's device list reached the container");
    assert!(seen.cards.is_empty(), "plain runc gave a card: {seen:?}");
    let seen = report(&pods, "no-gpu", "c").await;
    assert!(seen.cards.is_empty() && seen.mounts.is_empty(), "a pod asking no GPU got a card: {seen:?}");

    // The class gets an overhead and a toleration. The API server's RuntimeClass step runs before
    // webhooks, but runs again after a webhook changed a pod (admission reinvocation), so a pod the
    // webhook gives the class gets both, and is not refused for an overhead that is not its class's.
    cluster.ok(&[
        "patch",
        "runtimeclass",
        "nvidia",
        "--type=merge",
        "-p",
        r#"{"overhead": {"podFixed": {"cpu": "10m", "memory": "8Mi"}},
            "scheduling": {"tolerations": [{"key": "nano-gpu/test", "operator": "Exists"}]}}"#,
    ]);
    let dry = kube::api::PostParams { dry_run: true, ..Default::default() };
    let with_overhead = percent_pod("overhead", 20);
    wait_until("a GPU pod admitted with the class's overhead", Duration::from_secs(10), || async {
        pods.create(&dry, &with_overhead).await.is_ok()
    })
    .await;
    let pod = create(&pods, &with_overhead).await;
    let spec = pod.spec.unwrap();
    let overhead = spec.overhead.unwrap_or_default();
    assert_eq!((overhead["cpu"].0.as_str(), overhead["memory"].0.as_str()), ("10m", "8Mi"));
    assert!(spec.tolerations.unwrap_or_default().iter().any(|t| t.key.as_deref() == Some("nano-gpu/test")));
    wait_running(&pods, &["overhead".into()], Duration::from_secs(120)).await;
    let seen = report(&pods, "overhead", "c").await;
    let cards = assigned(pods.get("overhead").await.unwrap());
    assert_eq!((cards.len(), &seen.cards), (1, &cards), "{seen:?}");

    // `kubectl nano-gpu check` finds the class the webhook gives.
    let out = cluster.kubectl_plugin(&["check", "-o", "json"]);
    let lines: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let class = lines.as_array().unwrap().iter().find(|l| l["check"] == "runtime-class").cloned();
    assert_eq!(class.map(|l| l["status"].clone()), Some(json!("ok")), "{lines:#}");

    // A GPU node tainted as GKE taints its GPU node pools: the webhook gives GPU pods the
    // toleration, so a share still lands there.
    cluster.ok(&["taint", "node", "node-1", "nvidia.com/gpu=present:NoSchedule"]);
    let tainted = create(&pods, &percent_pod("tainted", 20)).await;
    let tolerated = tainted.spec.unwrap().tolerations.unwrap_or_default();
    assert!(tolerated.iter().any(|t| t.key.as_deref() == Some("nvidia.com/gpu")), "{tolerated:?}");
    wait_running(&pods, &["tainted".into()], Duration::from_secs(120)).await;
    cluster.ok(&["taint", "node", "node-1", "nvidia.com/gpu=present:NoSchedule-"]);

    // The card and accounting checks, over the pods a runtime gave their cards.
    cluster.ok(&["-n", NS, "delete", "pod", "plain-runc", "no-gpu", "tainted", "--wait=true"]);
    assert_eq!(nano_gpu_tests::checks::check_consistency(&cluster, &client).await, 2);
}
