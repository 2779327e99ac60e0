//! nano-gpu as a DRA driver on real kubelets (`hack/cluster.sh up --containerd2 1 --dra`): node-1
//! runs containerd 1.6, which has no CDI, node-2 containerd 2 with CDI; the install adds the
//! component `deploy/components/dra` (the DeviceClass `gpu.nano-gpu.io`, whose selector kube-scheduler's
//! own allocator can match no device with; the agents' DRA rights and `NANO_GPU_DRA`; the allocator's
//! claim rights and `NANO_GPU_DRA`). The allocator's leader allocates each claim with its policy (FGD)
//! and kube-scheduler binds the pod to the allocation's node; the agent prepares the claims as CDI
//! devices. Kubernetes 1.37.
//!
//! Checked: only node-2 publishes a ResourceSlice (node-1's agent refuses DRA on its runtime), with
//! one device per card, the cards the device plugin serves; node-2 is labelled as DRA's and a
//! `nano-gpu/gpu-percent` share goes to node-1; a 30 % share, an 80 % share and a claim of
//! two whole cards run, each container seeing exactly the cards its claim's allocation names, with its
//! percent, each allocation written by the allocator (its log names the claim and the node); a 20 %
//! share goes where the policy packs it, on the 80 % share's card, where kube-scheduler's first fit
//! would take the 30 % share's; no card is allocated over 100 %; a claim with a CEL selector nano-gpu
//! does not read is refused with the reason in an Event and stays unallocated (kube-scheduler does
//! not allocate it either), one that selects its cards' model runs; a pod asking
//! `nano-gpu/gpu-percent` annotated for DRA gets a claim from nano-gpu's template and runs unchanged
//! on node-2 with exactly its claim's card, and another pod naming that claim directly is refused
//! where kube-scheduler would reserve the claim for it; after the agent and then the kubelet of node-2 restart
//! the running pods keep running (no container restart) and a new claim is prepared; after the
//! leading allocator is deleted the next leader allocates a new claim without over-committing a
//! card; on the full node, a pod of higher priority whose claim also selects its card's memory
//! preempts the one pod whose end frees a card (a Preempted Event on it) and runs there; no one can
//! take an allocated claim's owning pod off; a claim deleted (its finalizer taken off) under a
//! running pod keeps its card in the allocator's books until the pod is gone; a deleted pod's claim
//! is unprepared (its CDI spec goes).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams};
use nano_gpu_tests::cluster::{
    Cluster, NS, create, gpu_pod, percent_pod, percent_pod_then, report, wait_running, wait_until,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";
const CLASS: &str = "gpu.nano-gpu.io";

/// A claim of one request `gpu`: `count` devices of nano-gpu's class, each consuming `percent`
/// (none: the default, the whole card).
fn claim(name: &str, count: u32, percent: Option<u32>) -> ResourceClaim {
    let mut exactly = json!({"deviceClassName": CLASS, "allocationMode": "ExactCount", "count": count});
    if let Some(p) = percent {
        exactly["capacity"] = json!({"requests": {"percent": p.to_string()}});
    }
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }))
    .unwrap()
}

/// A reporting pod whose container `c` uses the claim `name` (the pod and claim share the name).
fn claim_pod(name: &str) -> Pod {
    let mut pod = serde_json::to_value(gpu_pod(name, &[("c", &[])], json!({}))).unwrap();
    pod["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": name}]);
    pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
    serde_json::from_value(pod).unwrap()
}

/// The devices of nano-gpu's driver a claim's allocation names, each with the percent it consumes.
fn allocated(claim: &ResourceClaim) -> Vec<(String, String, u32)> {
    let results = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref());
    results
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.driver == CLASS)
        .map(|r| {
            let percent = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("percent"))
                .map_or(100, |q| q.0.parse().unwrap());
            (r.pool, r.device, percent)
        })
        .collect()
}

/// Each device's UUID by `(pool, device)`, from the published slices.
async fn uuids(slices: &Api<ResourceSlice>) -> BTreeMap<(String, String), String> {
    let mut uuids = BTreeMap::new();
    for slice in slices.list(&ListParams::default()).await.unwrap().items {
        for d in slice.spec.devices.unwrap_or_default() {
            let uuid =
                d.attributes.as_ref().and_then(|a| a.get("uuid")).and_then(|a| a.string.clone()).unwrap();
            uuids.insert((slice.spec.pool.name.clone(), d.name), uuid);
        }
    }
    uuids
}

/// Runs the claim's pod, then checks its container sees exactly the allocated cards and its percent.
async fn run_and_check(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    slices: &Api<ResourceSlice>,
    name: &str,
) -> (ResourceClaim, BTreeSet<String>) {
    wait_running(pods, &[name.to_owned()], Duration::from_secs(120)).await;
    let claim = claims.get(name).await.unwrap();
    let devices = allocated(&claim);
    let uuids = uuids(slices).await;
    let cards: BTreeSet<String> =
        devices.iter().map(|(pool, d, _)| uuids[&(pool.clone(), d.clone())].clone()).collect();
    let seen = report(pods, name, "c").await;
    println!("{name}: allocated {devices:?} = {cards:?}; NVML shows {:?}, env {:?}", seen.cards, seen.env);
    assert!(devices.iter().all(|(pool, _, _)| pool == "node-2"), "{name}: {devices:?}");
    assert_eq!(seen.cards, cards, "{name}: NVML shows other cards than its claim's");
    let percent: u32 = devices.iter().map(|(_, _, p)| p).sum();
    assert_eq!(seen.env.get("NANO_GPU_PERCENT"), Some(&percent.to_string()), "{name}");
    (claim, cards)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_nano_gpus_class_give_each_container_exactly_its_allocated_cards() {
    let cluster = Cluster::up_with_dra("dra", 2, 1);
    let client = cluster.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    cluster.ok(&["create", "namespace", NS]);
    cluster.ok(&["label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline"]);

    // node-2's slice: its four cards, as the agent reads them for the device plugin too.
    wait_until("node-2's ResourceSlice", Duration::from_secs(60), || async {
        !slices.list(&ListParams::default()).await.unwrap().items.is_empty()
    })
    .await;
    let uuids = uuids(&slices).await;
    let devices: Vec<(String, String)> = uuids.keys().cloned().collect();
    println!("published devices: {uuids:?}");
    let want: Vec<(String, String)> = (0..4).map(|i| ("node-2".to_owned(), format!("gpu-{i}"))).collect();
    assert_eq!(devices, want, "node-1's runtime has no CDI: only node-2 serves DRA");
    assert_eq!(uuids[&("node-2".to_owned(), "gpu-3".to_owned())], "GPU-node-2-3");
    let log = cluster.ok(&[
        "-n",
        SYSTEM,
        "logs",
        "-l",
        "app.kubernetes.io/name=nano-gpu-agent",
        "-c",
        "agent",
        "--tail=-1",
    ]);
    assert!(
        log.contains("containerd://1.6.20 has no CDI"),
        "node-1's agent did not say why it serves no DRA"
    );

    // node-2 says its cards are DRA's: a share of nano-gpu/gpu-percent goes to node-1 only.
    let labels = |n: k8s_openapi::api::core::v1::Node| n.metadata.labels.unwrap_or_default();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    wait_until("node-2 labelled nano-gpu/front-end=dra", Duration::from_secs(30), || async {
        labels(nodes.get("node-2").await.unwrap()).get("nano-gpu/front-end").map(String::as_str)
            == Some("dra")
    })
    .await;
    assert_eq!(labels(nodes.get("node-1").await.unwrap()).get("nano-gpu/front-end"), None);
    create(&pods, &percent_pod("device-plugin-share", 30)).await;
    wait_running(&pods, &["device-plugin-share".into()], Duration::from_secs(120)).await;
    let placed = pods.get("device-plugin-share").await.unwrap().spec.unwrap().node_name;
    assert_eq!(placed.as_deref(), Some("node-1"), "a share went to the node whose cards DRA serves");

    // A 30 % share, an 80 % share (they cannot share a card), two whole cards, then a 20 % share: the
    // policy packs it onto the 80 % share's card, which it fills; kube-scheduler's first fit would
    // put it on the first card with room, the 30 % share's.
    let post = PostParams::default();
    let mut cards = BTreeMap::new();
    for (name, count, percent) in
        [("share-30", 1, Some(30)), ("share-80", 1, Some(80)), ("two", 2, None), ("share-20", 1, Some(20))]
    {
        claims.create(&post, &claim(name, count, percent)).await.unwrap();
        create(&pods, &claim_pod(name)).await;
        let (_, seen) = run_and_check(&pods, &claims, &slices, name).await;
        cards.insert(name, seen);
    }
    assert_eq!(cards["two"].len(), 2);
    let two = cards["two"].clone();
    assert_ne!(cards["share-30"], cards["share-80"]);
    assert_eq!(cards["share-20"], cards["share-80"], "the 20 % share did not go where the policy packs it");
    // `kubectl nano-gpu inspect` counts the claims and names each on its card.
    let out = cluster.kubectl_plugin(&["inspect", "--node", "node-2", "-o", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let on_cards: Vec<(Vec<String>, u64)> = view["nodes"][0]["cards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let names =
                c["claims"].as_array().unwrap().iter().map(|h| h["claim"].as_str().unwrap().to_owned());
            (names.collect(), c["percentUsed"].as_u64().unwrap())
        })
        .collect();
    let packed = on_cards.iter().find(|(names, _)| names.contains(&format!("{NS}/share-80")));
    assert_eq!(
        packed,
        Some(&(vec![format!("{NS}/share-20"), format!("{NS}/share-80")], 100)),
        "inspect: {on_cards:?}"
    );
    let named: usize = on_cards.iter().map(|(names, _)| names.len()).sum();
    assert_eq!(named, 5, "share-30, share-80, two (2 cards), share-20: {on_cards:?}");
    let log = cluster.ok(&[
        "-n",
        SYSTEM,
        "logs",
        "-l",
        "app.kubernetes.io/name=nano-gpu-allocator",
        "-c",
        "allocator",
        "--tail=-1",
    ]);
    for name in ["share-30", "share-80", "two", "share-20"] {
        assert!(
            log.lines().any(|l| l.contains("claim allocated")
                && l.contains(&format!("claim={name}"))
                && l.contains("node=node-2")),
            "the allocator did not allocate {name}"
        );
    }

    // A claim nano-gpu does not allocate (a CEL selector): the reason in an Event on its pod, and no
    // one allocates it.
    let mut cel = claim("cel", 1, Some(10));
    let request = &mut cel.spec.devices.as_mut().unwrap().requests.as_mut().unwrap()[0];
    request.exactly.as_mut().unwrap().selectors =
        Some(vec![serde_json::from_value(json!({"cel": {"expression": "true"}})).unwrap()]);
    claims.create(&post, &cel).await.unwrap();
    create(&pods, &claim_pod("cel")).await;
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), NS);
    wait_until("a ClaimNotAllocated Event on pod cel", Duration::from_secs(60), || async {
        events.list(&ListParams::default()).await.unwrap().items.iter().any(|e| {
            e.reason.as_deref() == Some("ClaimNotAllocated")
                && e.involved_object.name.as_deref() == Some("cel")
                && e.message.as_deref().is_some_and(|m| m.contains("is not one nano-gpu allocates"))
        })
    })
    .await;
    assert!(claims.get("cel").await.unwrap().status.and_then(|s| s.allocation).is_none());
    // `kubectl nano-gpu why` gives the same reason for the pod.
    let out = cluster.kubectl_plugin(&["why", "cel", "-n", NS]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("is not one nano-gpu allocates"), "why: {said}");
    let phase = pods.get("cel").await.unwrap().status.and_then(|s| s.phase);
    assert_eq!(phase.as_deref(), Some("Pending"));

    // A claim that selects its cards' model (the one selector form nano-gpu reads) runs there.
    let slice = slices.list(&ListParams::default()).await.unwrap().items.remove(0);
    let device = &slice.spec.devices.unwrap()[0];
    let model = device.attributes.as_ref().unwrap()["model"].string.clone().unwrap();
    let mut by_model = claim("by-model", 1, Some(10));
    let request = &mut by_model.spec.devices.as_mut().unwrap().requests.as_mut().unwrap()[0];
    let expression = format!("device.attributes[\"{CLASS}\"].model == \"{model}\"");
    request.exactly.as_mut().unwrap().selectors =
        Some(vec![serde_json::from_value(json!({"cel": {"expression": expression}})).unwrap()]);
    claims.create(&post, &by_model).await.unwrap();
    create(&pods, &claim_pod("by-model")).await;
    run_and_check(&pods, &claims, &slices, "by-model").await;

    // A pod asking nano-gpu/gpu-percent, annotated for DRA: the webhook gives it a claim from
    // nano-gpu's template of its shape (the allocator makes the template), and it runs unchanged on
    // node-2, seeing exactly its claim's card.
    // Its CUDA process (tests/src/bin/gpu-use.rs) uses 1,000 MiB of the card.
    let mut converted = percent_pod_then("converted", 20, "exec gpu-use --memory-mib 1000 --sm 10");
    converted.metadata.annotations = Some([("nano-gpu/front-end".to_owned(), "dra".to_owned())].into());
    create(&pods, &converted).await;
    wait_running(&pods, &["converted".into()], Duration::from_secs(120)).await;
    let pod = pods.get("converted").await.unwrap();
    let entries = pod.spec.as_ref().unwrap().resource_claims.clone().unwrap();
    assert_eq!(entries[0].resource_claim_template_name.as_deref(), Some("nano-gpu-p20"));
    let limits = pod.spec.as_ref().unwrap().containers[0].resources.as_ref().unwrap().limits.clone();
    assert!(!limits.unwrap_or_default().contains_key("nano-gpu/gpu-percent"));
    let made = pod.status.unwrap().resource_claim_statuses.unwrap()[0].resource_claim_name.clone().unwrap();
    let made_claim = claims.get(&made).await.unwrap();
    let owner = made_claim.metadata.owner_references.clone().unwrap_or_default();
    assert!(owner.iter().any(|o| o.kind == "Pod" && o.name == "converted"), "{owner:?}");
    let devices = allocated(&made_claim);
    let seen = report(&pods, "converted", "c").await;
    println!("converted: claim {made} allocated {devices:?}; NVML shows {:?}", seen.cards);
    let cards: BTreeSet<String> =
        devices.iter().map(|(p, d, _)| uuids[&(p.clone(), d.clone())].clone()).collect();
    assert_eq!(seen.cards, cards);
    assert_eq!(devices.iter().map(|d| d.2).collect::<Vec<_>>(), vec![20]);
    assert_eq!(seen.env.get("NANO_GPU_PERCENT").map(String::as_str), Some("20"));
    // node-2's agent reads the claim as the pod's grant: the usage metrics put the process's memory
    // beside 20 % of the card (so the watchdog sees no overrun), not beside a card it was not given.
    let card = cards.iter().next().unwrap().clone();
    let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let series = |name: &str, value: &str| -> String {
        let index = card.rsplit('-').next().unwrap();
        format!(
            "{name}{{node=\"node-2\",namespace=\"{NS}\",pod=\"converted\",container=\"c\",gpu=\"{index}\",\
             uuid=\"{card}\"}} {value}"
        )
    };
    let granted = series("nano_gpu_container_granted_percent", "20");
    let used = series("nano_gpu_container_memory_used_bytes", &(1000u64 << 20).to_string());
    let start = std::time::Instant::now();
    loop {
        let text = cluster.agent_metrics(&system, "node-2").await;
        if [&granted, &used].iter().all(|w| text.lines().any(|l| l == w.as_str())) {
            let memory = text
                .lines()
                .find(|l| {
                    l.starts_with("nano_gpu_container_granted_memory_bytes")
                        && l.contains("pod=\"converted\"")
                })
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
            assert!(
                memory.is_some_and(|m| m > f64::from(1000u32 << 20)),
                "converted's granted memory: {memory:?}"
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "converted's grant and use not in node-2's agent metrics within 60 s: {granted}, {used}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A claim made for a pod is that pod's alone: another pod naming it directly (kube-scheduler
    // checks the owner only of a pod that names the template) is refused where kube-scheduler
    // reserves the claim for it (the policy nano-gpu-claim-for-its-pod), and waits with the reason.
    let mut intruder = claim_pod("intruder");
    intruder.spec.as_mut().unwrap().resource_claims.as_mut().unwrap()[0].resource_claim_name =
        Some(made.clone());
    create(&pods, &intruder).await;
    let refusal = "was made for pod converted from a ResourceClaimTemplate, so only that pod may use it";
    wait_until("the intruder refused with the policy's reason", Duration::from_secs(60), || async {
        let status = pods.get("intruder").await.unwrap().status.unwrap_or_default();
        let conditions = status.conditions.unwrap_or_default();
        conditions
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.message.as_deref().is_some_and(|m| m.contains(refusal)))
    })
    .await;
    let reserved = claims.get(&made).await.unwrap().status.unwrap().reserved_for.unwrap_or_default();
    assert_eq!(reserved.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), vec!["converted"]);
    cluster.ok(&["-n", NS, "delete", "pod", "intruder", "--wait=true"]);
    // Nor can anyone take the claim's owning pod off while it is allocated (the policy
    // nano-gpu-claim-owner), which would open it to the intruder.
    let patch = r#"[{"op": "remove", "path": "/metadata/ownerReferences"}]"#;
    let out = cluster.kubectl(&["-n", NS, "patch", "resourceclaim", &made, "--type=json", "-p", patch]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("nano-gpu-claim-owner"), "owner taken off: {said}");
    let owner = claims.get(&made).await.unwrap().metadata.owner_references.unwrap_or_default();
    assert!(owner.iter().any(|o| o.kind == "Pod" && o.name == "converted"), "{owner:?}");
    let over_capacity = || async {
        let mut per_device: BTreeMap<String, u32> = BTreeMap::new();
        for c in claims.list(&ListParams::default()).await.unwrap().items {
            for (_, device, percent) in allocated(&c) {
                *per_device.entry(device).or_default() += percent;
            }
        }
        per_device.into_iter().filter(|(_, p)| *p > 100).collect::<Vec<_>>()
    };
    assert_eq!(over_capacity().await, vec![]);

    // The agent of node-2 restarts: what runs keeps running, a new claim is prepared.
    let agent = |node: &'static str| {
        let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
        async move {
            let list = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=nano-gpu-agent"))
                .await
                .unwrap();
            list.items
                .into_iter()
                .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
                .and_then(|p| p.metadata.name)
                .unwrap()
        }
    };
    let before = agent("node-2").await;
    cluster.ok(&["-n", SYSTEM, "delete", "pod", &before, "--wait=true"]);
    cluster.ok(&["-n", SYSTEM, "rollout", "status", "daemonset/nano-gpu-agent", "--timeout=120s"]);
    assert_ne!(agent("node-2").await, before);
    // The kubelet of node-2 restarts (it deletes the node's slices as it starts; the agent writes its
    // slice back and registers again): what runs keeps running, and the next claim is prepared.
    cluster.restart("kubelet", "node-2");
    wait_until("node-2's slice back after the kubelet's restart", Duration::from_secs(90), || async {
        slices.list(&ListParams::default()).await.unwrap().items.iter().any(|s| s.spec.pool.name == "node-2")
    })
    .await;
    claims.create(&post, &claim("share-10", 1, Some(10))).await.unwrap();
    create(&pods, &claim_pod("share-10")).await;
    run_and_check(&pods, &claims, &slices, "share-10").await;
    let running = ["share-30", "share-80", "two", "share-20", "by-model", "converted"].map(String::from);
    wait_running(&pods, &running, Duration::from_secs(10)).await;
    for name in &running {
        let status = pods.get(name).await.unwrap().status.unwrap();
        let restarts: i32 =
            status.container_statuses.unwrap_or_default().iter().map(|c| c.restart_count).sum();
        assert_eq!(restarts, 0, "{name} restarted across the agent's and the kubelet's restarts");
    }
    assert_eq!(over_capacity().await, vec![]);

    // The leading allocator goes: the other replica leads, re-lists the claims its predecessor
    // allocated, and allocates the next claim without taking their cards.
    let leader = cluster.allocator_leader().expect("an allocator leads");
    cluster.ok(&["-n", SYSTEM, "delete", "pod", &leader, "--wait=false"]);
    wait_until("another allocator leads", Duration::from_secs(60), || async {
        cluster.allocator_leader().is_some_and(|l| l != leader)
    })
    .await;
    claims.create(&post, &claim("after-failover", 1, Some(30))).await.unwrap();
    create(&pods, &claim_pod("after-failover")).await;
    run_and_check(&pods, &claims, &slices, "after-failover").await;
    assert_eq!(over_capacity().await, vec![]);

    // node-2's four cards are full now. A pod of higher priority asking a whole card: kube-scheduler
    // never preempts for it (it cannot allocate the class), nano-gpu does: the fewest pods of lower
    // priority whose end frees a card, here `two` alone (its claim holds two whole cards), evicted
    // with a Preempted Event; its claim is deallocated once it is gone, and the pod runs on one of
    // those cards.
    assert!(cluster.apply(
        r#"{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": "nano-gpu-e2e-high"}, "value": 1000}"#
    ));
    // It chooses its card by memory too (node-2's cards have 22.5 GiB).
    let mut urgent_claim = claim("urgent", 1, None);
    let request = &mut urgent_claim.spec.devices.as_mut().unwrap().requests.as_mut().unwrap()[0];
    let expression = format!("device.capacity[\"{CLASS}\"].memory.compareTo(quantity(\"20Gi\")) >= 0");
    request.exactly.as_mut().unwrap().selectors =
        Some(vec![serde_json::from_value(json!({"cel": {"expression": expression}})).unwrap()]);
    claims.create(&post, &urgent_claim).await.unwrap();
    let mut urgent = claim_pod("urgent");
    urgent.spec.as_mut().unwrap().priority_class_name = Some("nano-gpu-e2e-high".into());
    create(&pods, &urgent).await;
    let (_, seen) = run_and_check(&pods, &claims, &slices, "urgent").await;
    assert!(seen.is_subset(&two), "urgent runs on {seen:?}, not on one of two's cards {:?}", two);
    assert!(pods.get_opt("two").await.unwrap().is_none(), "two still there");
    let preempted = events.list(&ListParams::default()).await.unwrap().items.into_iter().find(|e| {
        e.reason.as_deref() == Some("Preempted") && e.involved_object.name.as_deref() == Some("two")
    });
    let said = preempted.and_then(|e| e.message).unwrap_or_default();
    assert!(said.contains(&format!("for pod {NS}/urgent (priority 1000")), "Preempted on two: {said:?}");
    let others = ["share-30", "share-80", "share-20", "by-model", "converted", "share-10", "after-failover"];
    wait_running(&pods, &others.map(String::from), Duration::from_secs(10)).await;
    assert_eq!(over_capacity().await, vec![]);

    // A pod that goes: the kubelet unprepares its claim, and its CDI spec is gone from node-2.
    let uid = claims.get("share-30").await.unwrap().metadata.uid.unwrap();
    let spec = cluster.path(&format!("nodes/node-2/run/cdi/nano-gpu.io-claim_{uid}.json"));
    assert!(spec.exists(), "{} missing while its pod runs", spec.display());
    let text: Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
    assert_eq!(text["kind"], "nano-gpu.io/claim");
    // Its claim is deleted first, its finalizer taken off (as anyone who may update claims can): the
    // pod keeps its card, and so do the allocator's books until the pod is gone.
    cluster.ok(&["-n", NS, "delete", "resourceclaim", "share-30", "--wait=false"]);
    let strip = r#"{"metadata": {"finalizers": null}}"#;
    cluster.ok(&["-n", NS, "patch", "resourceclaim", "share-30", "--type=merge", "-p", strip]);
    wait_until("share-30's claim gone", Duration::from_secs(30), || async {
        claims.get_opt("share-30").await.unwrap().is_none()
    })
    .await;
    // The leading allocator's own books (its /inspect): `kubectl nano-gpu inspect` builds its view
    // from the API, where a deleted claim no longer is.
    let counted = || {
        cluster.inspect()["nodes"].as_array().unwrap().iter().filter(|n| n["name"] == "node-2").any(|n| {
            n["cards"].as_array().unwrap().iter().any(|c| {
                c["claims"].as_array().unwrap().iter().any(|h| h["claim"] == format!("{NS}/share-30"))
            })
        })
    };
    wait_until("the allocator saw the claim go", Duration::from_secs(30), || async {
        cluster.allocator_leader().is_some_and(|leader| {
            let log = cluster.kubectl(&["-n", SYSTEM, "logs", &leader, "-c", "allocator", "--tail=-1"]);
            String::from_utf8_lossy(&log.stdout).contains("cards stay counted until those pods are gone")
        })
    })
    .await;
    assert!(counted(), "share-30's card freed while its pod runs: {}", cluster.inspect());
    wait_running(&pods, &["share-30".into()], Duration::from_secs(5)).await;
    cluster.ok(&["-n", NS, "delete", "pod", "share-30", "--wait=true"]);
    wait_until("share-30's claim unprepared", Duration::from_secs(60), || async { !spec.exists() }).await;
    wait_until("share-30's card free in the books", Duration::from_secs(30), || async { !counted() }).await;

    // The rest go while the agents run; the kubelet unprepares each claim once its pod is gone.
    cluster.ok(&["-n", NS, "delete", "pods", "--all", "--wait=true", "--timeout=60s"]);
    let cdi = cluster.path("nodes/node-2/run/cdi");
    let left = || {
        std::fs::read_dir(&cdi)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("nano-gpu.io-claim_"))
            .collect::<Vec<String>>()
    };
    wait_until("every claim unprepared", Duration::from_secs(60), || async { left().is_empty() }).await;
}
