//! nano-gpu on a containerd 2 node, the runtime DRA needs (CDI): `hack/cluster.sh up --containerd2 1`
//! gives a two-node cluster whose node-1 runs Debian's containerd 1.6 and node-2 containerd 2 built
//! from its Go module (`hack/containerd-build.sh`), CDI on, its cards in a CDI spec as `nvidia-ctk
//! cdi generate` writes one (`hack/cards.sh`, `cdi_spec`). The kubelet reports each runtime; with the
//! shipped device list (env and mounts) a share on node-2 sees exactly its card; with the agents
//! naming cards only as CDI devices (`--device-list-strategy cdi`), a share, a whole card and two
//! cards on node-2 see exactly their assignment's cards, handed over by containerd's CDI injection
//! (the agent named them in no env or mount), while a share on node-1, whose containerd 1.6 has no
//! CDI, sees none: CDI, not something else, gave node-2's containers their cards.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
use nano_gpu_tests::cluster::{Cluster, NS, create, gpu_pod, report, wait_running};
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";

/// The cards of pod `name`'s container `c` by its assignment, and the node it was bound to.
async fn assigned(pods: &Api<Pod>, name: &str) -> (String, BTreeSet<String>) {
    let p = pods.get(name).await.unwrap();
    let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    let a = Assignment::decode(&p.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    (node, a.containers["c"].iter().map(|g| g.uuid.clone()).collect())
}

/// A pod of one container asking `percent` of a card of `model`.
fn model_pod(name: &str, percent: u32, model: &str) -> Pod {
    gpu_pod(
        name,
        &[("c", &[("nano-gpu/gpu-percent", &percent.to_string())])],
        json!({"nano-gpu/gpu-model": model}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_containerd_2_node_hands_each_container_its_cards_through_cdi() {
    let cluster = Cluster::up_with_containerd2("containerd2", 2, 1);
    let client = cluster.client().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    cluster.ok(&["create", "namespace", NS]);
    cluster.ok(&["label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline"]);

    // What each kubelet says its runtime is.
    let runtime =
        |n: Node| n.status.and_then(|s| s.node_info).map(|i| i.container_runtime_version).unwrap_or_default();
    let (one, two) =
        (runtime(nodes.get("node-1").await.unwrap()), runtime(nodes.get("node-2").await.unwrap()));
    println!("runtimes: node-1 {one}, node-2 {two}");
    assert!(one.starts_with("containerd://1.6"), "node-1 runs {one}");
    assert!(two.starts_with("containerd://2."), "node-2 runs {two}");

    // The shipped device list (env and mounts) works on containerd 2 as on 1.6.
    create(&pods, &model_pod("shipped", 30, "Tesla T4")).await;
    wait_running(&pods, &["shipped".into()], Duration::from_secs(120)).await;
    let (node, cards) = assigned(&pods, "shipped").await;
    let seen = report(&pods, "shipped", "c").await;
    assert_eq!((node.as_str(), &seen.cards), ("node-2", &cards), "{seen:?}");

    // Every agent names its cards as CDI devices only.
    cluster.ok(&[
        "-n",
        SYSTEM,
        "set",
        "env",
        "daemonset/nano-gpu-agent",
        "-c",
        "agent",
        "NANO_GPU_DEVICE_LIST_STRATEGY=cdi",
    ]);
    cluster.ok(&["-n", SYSTEM, "rollout", "status", "daemonset/nano-gpu-agent", "--timeout=180s"]);

    let wanted = [
        model_pod("share", 30, "Tesla T4"),
        model_pod("whole", 100, "NVIDIA A10"),
        model_pod("two", 200, "NVIDIA A10"),
        model_pod("old-runtime", 30, "NVIDIA A100-SXM4-80GB"),
    ];
    // node-2 has two A10s: the whole card is checked and deleted before the pair asks both.
    for pod in &wanted {
        let name = pod.metadata.name.clone().unwrap();
        create(&pods, pod).await;
        wait_running(&pods, std::slice::from_ref(&name), Duration::from_secs(120)).await;
        let (node, cards) = assigned(&pods, &name).await;
        let seen = report(&pods, &name, "c").await;
        println!(
            "{name} on {node}: assigned {cards:?}, NVML shows {:?}, device mounts {:?}",
            seen.cards, seen.mounts
        );
        let env = seen.env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str);
        assert_eq!(
            env,
            Some("/var/run/nvidia-container-devices"),
            "{name}: the agent named a card in the env"
        );
        if node == "node-2" {
            assert_eq!(seen.cards, cards, "{name}: NVML shows other cards than its assignment");
            assert_eq!(seen.mounts, cards, "{name}: CDI mounted other cards than its assignment");
        } else {
            assert_eq!(node, "node-1", "{name}");
            assert!(
                seen.cards.is_empty() && seen.mounts.is_empty(),
                "{name}: containerd 1.6 has no CDI: {seen:?}"
            );
        }
        if name == "whole" {
            cluster.ok(&["-n", NS, "delete", "pod", "whole", "--wait=true"]);
        }
    }
    // The card and accounting checks of every suite, over the pods whose runtime gave them cards.
    cluster.ok(&["-n", NS, "delete", "pod", "old-runtime", "--wait=true"]);
    let checked = nano_gpu_tests::checks::check_consistency(&cluster, &client).await;
    assert_eq!(checked, 3, "shipped, share and two");
}
