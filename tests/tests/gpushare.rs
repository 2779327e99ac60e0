//! gpushare drop-in, end to end on the local cluster (`hack/cluster.sh`, three real nodes with
//! nano-gpu installed as shipped: node-1 four 80 GiB cards, node-2 two 15 GiB and two 22 GiB cards,
//! node-3 eight 32 GiB cards):
//!
//! 1. The move from gpushare. node-3 first runs "the gpushare way": a stand-in for gpushare's device
//!    plugin serves `aliyun.com/gpu-mem` (`fake-device-plugin`, registered with node-3's kubelet),
//!    nano-gpu's agent does not run there (the node is not labelled for it) and its admission policy
//!    is not installed yet, and pods are bound with the annotations gpushare's extender and plugin
//!    wrote. Then the switch: gpushare's plugin goes, the node is labelled and nano-gpu's agent comes,
//!    and the policy. The old pods keep running
//!    untouched with their device IDs; new pods never over-commit a card they use. One old pod whose
//!    card index does not exist counts on every card, with a warning Event.
//! 2. gpushare's own tool, `kubectl-inspect-gpushare` (built from `../shared/tools`), shows per node and
//!    per card what `nano-gpu-allocator`'s view holds; on node-2, whose cards differ, it shows the
//!    average card, as gpushare assumes equal cards.
//! 3. NVIDIA's device plugin beside nano-gpu (a stand-in, `fake-device-plugin --as nvidia`) on
//!    node-2, given two of its four cards: nano-gpu serves only the other two.

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
use nano_gpu_tests::cluster::{Cluster, NS, create, gpu_pod, phase, wait_running, wait_until};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::Duration;

const GIB: u64 = 1024;

/// A pod asking `gib` of `aliyun.com/gpu-mem` on `node`.
fn gpushare_pod(name: &str, gib: u64, node: &str, annotations: Value) -> Pod {
    let mut p = gpu_pod(name, &[("c", &[("aliyun.com/gpu-mem", &gib.to_string())])], annotations);
    p.spec.as_mut().unwrap().node_selector =
        Some(BTreeMap::from([("kubernetes.io/hostname".into(), node.into())]));
    p
}

/// A pod gpushare placed: bound to `node` with the annotations its extender and device plugin wrote.
fn placed_by_gpushare(name: &str, gib: u64, node: &str, index: &str) -> Pod {
    let annotations = json!({
        "ALIYUN_COM_GPU_MEM_IDX": index, "ALIYUN_COM_GPU_MEM_POD": gib.to_string(),
        "ALIYUN_COM_GPU_MEM_DEV": "32", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1700000000000000000",
    });
    let mut p = gpushare_pod(name, gib, node, annotations);
    p.spec.as_mut().unwrap().node_name = Some(node.into());
    p
}

/// One card in the allocator's view: memory MiB, memory used MiB, the pods holding it.
type CardView = (u64, u64, Vec<String>);

/// The allocator's view: per node, per card index.
fn view(cluster: &Cluster) -> BTreeMap<String, BTreeMap<u64, CardView>> {
    let view = cluster.inspect();
    let mut out = BTreeMap::new();
    for node in view["nodes"].as_array().unwrap() {
        let cards = node["cards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let (total, free) = (c["memoryMiB"].as_u64().unwrap(), c["memoryFreeMiB"].as_u64().unwrap());
                let pods =
                    c["pods"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect();
                (c["index"].as_u64().unwrap(), (total, total - free, pods))
            })
            .collect();
        out.insert(node["name"].as_str().unwrap().to_owned(), cards);
    }
    out
}

/// Per card index of `node`, the GiB its gpushare pods hold by their annotations (`IDX`, the pod's
/// total).
async fn held_by_annotations(pods: &Api<Pod>, node: &str) -> BTreeMap<u64, u64> {
    let mut held = BTreeMap::new();
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        if p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(node)
            || matches!(phase(&p), "Succeeded" | "Failed")
        {
            continue;
        }
        let a = p.metadata.annotations.unwrap_or_default();
        let (Some(idx), Some(units)) = (a.get("ALIYUN_COM_GPU_MEM_IDX"), a.get("ALIYUN_COM_GPU_MEM_POD"))
        else {
            continue;
        };
        let Ok(idx) = idx.parse::<u64>() else { continue };
        *held.entry(idx).or_default() += units.parse::<u64>().unwrap();
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushare_tools_see_what_nano_gpu_placed_and_a_gpushare_cluster_moves_over() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash").arg(root.join("hack/gpushare-inspect-build.sh")).output().unwrap();
    assert!(
        out.status.success(),
        "building kubectl-inspect-gpushare: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inspect_gpushare = String::from_utf8_lossy(&out.stdout).trim().to_owned();

    let cluster = Cluster::up("gpushare", 3);
    let client = cluster.client().await;
    cluster.ok(&["create", "namespace", NS]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let system: Api<Pod> = Api::namespaced(client.clone(), "nano-gpu-system");
    let agent_on_node3 =
        ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent").fields("spec.nodeName=node-3");

    // --- Before: node-3 runs the gpushare way. ---
    cluster.ok(&["label", "node", "node-3", "nano-gpu/node-"]);
    wait_until("no nano-gpu agent on node-3", Duration::from_secs(60), || async {
        system.list(&agent_on_node3).await.unwrap().items.is_empty()
    })
    .await;
    // gpushare's plugin, with node-3's paths (a unix socket is reached by its path, so it registers
    // with node-3's kubelet from here).
    cluster.launch("gpushare-plugin-node-3", &device_plugin(&cluster, "node-3", &["--as", "gpushare"]));
    wait_until("gpushare's plugin serves node-3", Duration::from_secs(30), || async {
        std::fs::read_to_string(cluster.path("gpushare-plugin-node-3.log"))
            .is_ok_and(|l| l.contains("the kubelet watches 256 device IDs"))
    })
    .await;
    // gpushare had no admission policy: its extender wrote these annotations.
    cluster.ok(&["delete", "validatingadmissionpolicybinding", "nano-gpu-assignments"]);
    let legacy =
        [("old-a", 20, "0"), ("old-b", 10, "1"), ("old-c", 8, "2"), ("old-d", 8, "2"), ("old-bad", 2, "9")];
    for (name, gib, idx) in legacy {
        // The API server drops the policy binding from its cache within a few seconds.
        let pod = placed_by_gpushare(name, gib, "node-3", idx);
        wait_until(&format!("{name} created without nano-gpu's policy"), Duration::from_secs(30), || async {
            match pods.create(&PostParams::default(), &pod).await {
                Ok(_) => true,
                Err(kube::Error::Api(e)) if e.message.contains("nano-gpu-assignments") => false,
                Err(e) => panic!("creating {name}: {e}"),
            }
        })
        .await;
    }
    let legacy_names: Vec<String> = legacy.iter().map(|(n, ..)| n.to_string()).collect();
    wait_running(&pods, &legacy_names, Duration::from_secs(60)).await;
    let mut before_pods = HashMap::new();
    for name in &legacy_names {
        before_pods.insert(name.clone(), pods.get(name).await.unwrap());
    }
    let devices = cluster.kubelet_devices("node-3").await;
    let old_ids: HashMap<String, _> =
        legacy_names.iter().map(|n| (n.clone(), devices[&format!("{NS}/{n}/c")].clone())).collect();
    let ids = &old_ids["old-a"]["aliyun.com/gpu-mem"];
    assert!(ids.len() == 20 && ids.iter().all(|id| id.contains("-_-")), "gpushare's device IDs: {ids:?}");

    // --- The switch: gpushare's plugin goes, nano-gpu's agent and admission policy come. ---
    cluster.kill("gpushare-plugin-node-3");
    cluster.ok(&["label", "node", "node-3", "nano-gpu/node=true"]);
    cluster.ok(&["apply", "-f", root.join("deploy/assignment-policy.yaml").to_str().unwrap()]);
    wait_until("nano-gpu's agent serves node-3", Duration::from_secs(90), || async {
        system.list(&agent_on_node3).await.unwrap().items.iter().any(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .is_some_and(|c| c.iter().all(|c| c.ready))
        })
    })
    .await;

    // The pod whose card index node-3 does not have: a warning Event, its 2 GiB on every card.
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    wait_until("GpushareCardUnknown for old-bad", Duration::from_secs(30), || async {
        let list = events.list(&ListParams::default().fields("involvedObject.name=old-bad")).await.unwrap();
        list.items.iter().any(|e| {
            e.reason.as_deref() == Some("GpushareCardUnknown")
                && e.message.as_deref().is_some_and(|m| m.contains("card index 9 is not a card of node-3"))
        })
    })
    .await;
    let by_annotations = held_by_annotations(&pods, "node-3").await;
    let cards = &view(&cluster)["node-3"];
    for (index, (_, used, pods_on)) in cards {
        let expected = (by_annotations.get(index).copied().unwrap_or(0) + 2) * GIB;
        assert_eq!(*used, expected, "node-3 card {index}: {pods_on:?}");
        assert!(pods_on.contains(&format!("{NS}/old-bad")));
    }
    pods.delete("old-bad", &DeleteParams::default().grace_period(0)).await.unwrap();
    before_pods.remove("old-bad");
    wait_until("old-bad's memory given back", Duration::from_secs(30), || async {
        view(&cluster)["node-3"][&3].1 == 0
    })
    .await;

    // New pods: 16 GiB each fits twice on each of the five empty 32 GiB cards, once beside old-b (10)
    // and beside old-c + old-d (16), never beside old-a (20): 12 of 14 run, 2 stay Pending.
    let new: Vec<String> = (0..14).map(|i| format!("new-{i:02}")).collect();
    for name in &new {
        create(&pods, &gpushare_pod(name, 16, "node-3", json!({}))).await;
    }
    wait_until("12 new pods Running", Duration::from_secs(120), || async {
        let list = pods.list(&ListParams::default()).await.unwrap();
        list.items
            .iter()
            .filter(|p| {
                p.metadata.name.as_ref().is_some_and(|n| n.starts_with("new-")) && phase(p) == "Running"
            })
            .count()
            == 12
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let list = pods.list(&ListParams::default()).await.unwrap();
    let pending: Vec<&Pod> = list.items.iter().filter(|p| phase(p) == "Pending").collect();
    assert_eq!(pending.len(), 2, "{:?}", pending.iter().map(|p| &p.metadata.name).collect::<Vec<_>>());
    let by_annotations = held_by_annotations(&pods, "node-3").await;
    for (index, (total, used, pods_on)) in &view(&cluster)["node-3"] {
        let held = by_annotations.get(index).copied().unwrap_or(0);
        assert!(held * GIB <= *total, "node-3 card {index} over-committed: {held} GiB, {pods_on:?}");
        assert_eq!(*used, held * GIB, "the allocator's view of node-3 card {index} vs the annotations");
    }
    assert_eq!(by_annotations[&0], 20, "nothing new beside old-a");
    // The old pods are untouched: Running, same annotations (no assignment written), same device IDs.
    let devices = cluster.kubelet_devices("node-3").await;
    for (name, was) in &before_pods {
        let now = pods.get(name).await.unwrap();
        assert_eq!(phase(&now), "Running", "{name}");
        assert_eq!(now.metadata.annotations, was.metadata.annotations, "{name}'s annotations changed");
        assert!(!now.metadata.annotations.as_ref().unwrap().contains_key(ASSIGNMENT_ANNOTATION));
        assert_eq!(devices[&format!("{NS}/{name}/c")], old_ids[name], "{name}'s device IDs changed");
    }
    // New pods got what gpushare's plugin wrote once they ran.
    for p in list
        .items
        .iter()
        .filter(|p| phase(p) == "Running" && p.metadata.name.as_ref().unwrap().starts_with("new-"))
    {
        let name = p.metadata.name.as_deref().unwrap();
        wait_until(&format!("{name} ASSIGNED=true"), Duration::from_secs(30), || async {
            let a = pods.get(name).await.unwrap().metadata.annotations.unwrap_or_default();
            a.get("ALIYUN_COM_GPU_MEM_ASSIGNED").map(String::as_str) == Some("true")
        })
        .await;
    }
    for p in pending {
        pods.delete(p.metadata.name.as_deref().unwrap(), &DeleteParams::default()).await.unwrap();
    }

    // --- gpushare's tool on the other nodes too. ---
    for (name, gib, node) in [
        ("n1-a", 30, "node-1"),
        ("n1-b", 50, "node-1"),
        ("n1-c", 10, "node-1"),
        ("n2-a", 10, "node-2"),
        ("n2-b", 20, "node-2"),
    ] {
        create(&pods, &gpushare_pod(name, gib, node, json!({}))).await;
    }
    let names: Vec<String> = ["n1-a", "n1-b", "n1-c", "n2-a", "n2-b"].map(String::from).to_vec();
    wait_running(&pods, &names, Duration::from_secs(60)).await;
    let nodes: Api<Node> = Api::all(client.clone());
    for (node, count) in [("node-1", "4"), ("node-2", "4"), ("node-3", "8")] {
        let n = nodes.get(node).await.unwrap();
        let status = n.status.unwrap();
        for list in [status.capacity.unwrap(), status.allocatable.unwrap()] {
            assert_eq!(list["aliyun.com/gpu-count"].0, count, "{node}'s aliyun.com/gpu-count");
        }
    }
    let run = |args: &[&str]| {
        let out = Command::new(&inspect_gpushare)
            .args(args)
            .env("KUBECONFIG", &cluster.env["ADMIN_KUBECONFIG"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl-inspect-gpushare {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let summary = run(&[]);
    eprintln!("kubectl-inspect-gpushare:\n{summary}");
    let ours = view(&cluster);
    for (node, cards) in &ours {
        let row = row(&summary, node);
        let total_gib: u64 = cards.values().map(|(t, ..)| t / GIB).sum();
        // gpushare assumes equal cards: each card is shown as the node's memory over its card count.
        let shown_card = total_gib / cards.len() as u64;
        for (index, (_, used, _)) in cards {
            let cell = row[2 + *index as usize];
            assert_eq!(cell, format!("{}/{shown_card}", used / GIB), "{node} GPU{index} in:\n{summary}");
        }
        let used_gib: u64 = cards.values().map(|(_, u, _)| u / GIB).sum();
        assert_eq!(*row.last().unwrap(), format!("{used_gib}/{total_gib}"), "{node} in:\n{summary}");
    }
    // Details: every pod in the column of the card it holds.
    let details = run(&["-d"]);
    eprintln!("kubectl-inspect-gpushare -d:\n{details}");
    for p in pods.list(&ListParams::default()).await.unwrap().items.iter().filter(|p| phase(p) == "Running") {
        let a = p.metadata.annotations.as_ref().unwrap();
        let name = p.metadata.name.as_deref().unwrap();
        let row = row(&details, name);
        let index: usize = a["ALIYUN_COM_GPU_MEM_IDX"].parse().unwrap();
        let cards = &ours[p.spec.as_ref().unwrap().node_name.as_ref().unwrap()];
        assert!(
            cards[&(index as u64)].2.contains(&format!("{NS}/{name}")),
            "{name} on card {index} in our view"
        );
        for (i, cell) in row[2..].iter().enumerate() {
            let expected = if i == index { a["ALIYUN_COM_GPU_MEM_POD"].as_str() } else { "0" };
            assert_eq!(*cell, expected, "{name} GPU{i} in:\n{details}");
        }
    }
    nvidia_s_plugin_beside_nano_gpu(&cluster, &client).await;
}

/// Part 3: NVIDIA's device plugin beside nano-gpu on node-2, given its first two cards (the split its
/// operator chose): nano-gpu serves those two to nobody (unhealthy in the Node's inventory, the
/// kubelet's pod-resources naming them under `nvidia.com/gpu`), and the other two as before; a share
/// asked on node-2 lands on one of those.
async fn nvidia_s_plugin_beside_nano_gpu(cluster: &Cluster, client: &kube::Client) {
    cluster.launch(
        "nvidia-plugin-node-2",
        &device_plugin(cluster, "node-2", &["--as", "nvidia", "--cards", "2"]),
    );
    let nodes: Api<Node> = Api::all(client.clone());
    let health = || async {
        let node = nodes.get("node-2").await.unwrap();
        let text = node.metadata.annotations.unwrap_or_default()["nano-gpu/gpus"].clone();
        let inventory = nano_gpu_proto::annotations::NodeInventory::decode(&text).unwrap();
        inventory.gpus.iter().map(|g| (g.uuid.clone(), g.healthy)).collect::<BTreeMap<_, _>>()
    };
    wait_until("node-2's first two cards left to NVIDIA's plugin", Duration::from_secs(60), || async {
        health().await.into_values().collect::<Vec<_>>() == [false, false, true, true]
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut share = gpu_pod("beside-nvidia", &[("c", &[("nano-gpu/gpu-percent", "30")])], json!({}));
    share.spec.as_mut().unwrap().node_selector =
        Some([("kubernetes.io/hostname".into(), "node-2".into())].into());
    create(&pods, &share).await;
    wait_running(&pods, &["beside-nvidia".into()], Duration::from_secs(120)).await;
    let p = pods.get("beside-nvidia").await.unwrap();
    let a = nano_gpu_proto::annotations::Assignment::decode(
        &p.metadata.annotations.unwrap()[ASSIGNMENT_ANNOTATION],
    )
    .unwrap();
    let card = &a.containers["c"][0].uuid;
    assert!(
        card == "GPU-node-2-2" || card == "GPU-node-2-3",
        "a share on a card NVIDIA's plugin serves: {card}"
    );
    cluster.kill("nvidia-plugin-node-2");
}

/// The command line of `fake-device-plugin` with `args`, registering with `node`'s kubelet (a unix
/// socket is reached by its path, so it registers from here) and reading `node`'s cards.
fn device_plugin(cluster: &Cluster, node: &str, args: &[&str]) -> Vec<String> {
    let lib = cluster.path(&format!("nodes/{node}/var/lib"));
    let mut argv = vec![nano_gpu_tests::workspace_binary("fake-device-plugin").display().to_string()];
    argv.extend(args.iter().map(|a| a.to_string()));
    argv.extend(["--plugin-dir".into(), lib.join("kubelet/device-plugins").display().to_string()]);
    argv.extend(["--nvml-config".into(), lib.join("nano-gpu-fake-driver/nvml.json").display().to_string()]);
    argv
}

/// The cells of the row of `table` (kubectl-inspect-gpushare's output) whose first cell is `first`.
fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("{first} missing from:\n{table}"))
        .split_whitespace()
        .collect()
}
