//! What must hold on the local cluster after anything that happened to it (the end-to-end and the
//! fault tests call it after each step): the cards every running container got, and the accounting.

use crate::cluster::{Cluster, phase, report};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use nano_gpu_allocator::service::bind;
use nano_gpu_allocator::state::FILTER_HOLD;
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, CardGrant, GPUS_ANNOTATION, NodeInventory,
};
use nano_gpu_proto::device_id;
use nano_gpu_proto::units::MiB;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// How long a container's agent may take to repair its pod's assignment to the cards the kubelet
/// gave it (the agent's repair, behind a slow API server in the fault suite).
const REPAIRED_WITHIN: Duration = Duration::from_secs(60);

/// Why the cards each container of pod `pod` (`<namespace>/<name>`) was handed differ from assignment
/// `a`, if they do: its `NANO_GPU_CARDS`, its device-list mounts, the cards its NVML shows and the
/// cards of the device IDs its kubelet holds (`devices`, the node's, per `<pod>/<container>`).
fn mismatch(
    a: &Assignment,
    seen: &HashMap<String, crate::cluster::Report>,
    devices: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    pod: &str,
) -> Option<String> {
    for (container, grants) in &a.containers {
        let assigned: BTreeSet<String> = grants.iter().map(|g| g.uuid.clone()).collect();
        let key = format!("{pod}/{container}");
        let Some(seen) = seen.get(container) else {
            return Some(format!("{key}: a container the assignment names that the pod does not report"));
        };
        let told: BTreeSet<String> = seen
            .env
            .get("NANO_GPU_CARDS")
            .map(|v| v.split(',').map(String::from).collect())
            .unwrap_or_default();
        let ids: BTreeSet<String> = devices
            .get(&key)
            .map(|per| per.values().flatten().map(|id| device_id::card_of(id).unwrap().to_owned()).collect())
            .unwrap_or_default();
        let checks = [
            (told, "NANO_GPU_CARDS"),
            (seen.mounts.clone(), "its device-list mounts"),
            (seen.cards.clone(), "the cards its NVML shows"),
            (ids, "the kubelet's device IDs"),
        ];
        for (got, what) in checks {
            if got != assigned {
                return Some(format!(
                    "{key}: {what} {got:?} vs its assignment {assigned:?}; env {:?}",
                    seen.env
                ));
            }
        }
    }
    None
}

/// Every Running pod with an assignment: in each of its containers the cards of its device-list
/// mounts and of `NANO_GPU_CARDS`, the cards its NVML shows, and the cards of the device IDs its
/// kubelet gave it all equal its assignment (not `NVIDIA_VISIBLE_DEVICES`: the pod's own env may
/// say anything, and the node's runtime reads the mounts); no card is over 100 % or over its memory;
/// the allocator's view holds exactly what the assignments of the bound pods hold (no leaked
/// reservation), percent and memory; one memory truth: a share that asked no memory holds its percent
/// of the card's memory there, and its container was told exactly that (`NANO_GPU_MEMORY_MIB`).
/// Returns the pods checked.
pub async fn check_consistency(cluster: &Cluster, client: &kube::Client) -> usize {
    let nodes = Api::<Node>::all(client.clone()).list(&ListParams::default()).await.unwrap();
    let card_memory = card_memories(&nodes.items);
    let mut devices = HashMap::new();
    for n in &nodes.items {
        let name = n.metadata.name.clone().unwrap();
        devices.insert(name.clone(), cluster.kubelet_devices(&name).await);
    }
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await.unwrap();
    let mut checked = 0;
    for p in &pods.items {
        let Some(text) = p.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)) else {
            continue;
        };
        let mut a = Assignment::decode(text).unwrap();
        if phase(p) != "Running" {
            continue;
        }
        let (ns, name) = (p.metadata.namespace.as_deref().unwrap(), p.metadata.name.as_deref().unwrap());
        let node = p.spec.as_ref().unwrap().node_name.clone().unwrap();
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let mut seen = HashMap::new();
        for container in a.containers.keys() {
            seen.insert(container.clone(), report(&api, name, container).await);
        }
        // A container the kubelet gave other cards than the allocator chose (the agent could not
        // steer the kubelet in time, as under a slow API server) runs on the kubelet's, and its
        // agent repairs the assignment to them: right after such a start, the check waits for that.
        let start = Instant::now();
        while let Some(why) = mismatch(&a, &seen, &devices[&node], &format!("{ns}/{name}")) {
            assert!(start.elapsed() < REPAIRED_WITHIN, "{why} (and no repair in {REPAIRED_WITHIN:?})");
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = api.get(name).await.unwrap();
            let text = now.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)).unwrap();
            a = Assignment::decode(text).unwrap();
        }
        for (container, grants) in &a.containers {
            let key = format!("{ns}/{name}/{container}");
            if grants.iter().all(|g| g.memory_mib.is_none()) {
                let told: u64 = grants.iter().map(|g| held_memory(g, &card_memory)).sum();
                assert_eq!(
                    seen[container].env.get("NANO_GPU_MEMORY_MIB"),
                    Some(&told.to_string()),
                    "{key}: the memory its container was told vs what its share holds"
                );
            }
        }
        checked += 1;
    }
    // The allocator's accounting equals the assignments: nothing reserved and forgotten. A pod that
    // was waiting may be placed between the listing and the view (kube-scheduler retries it when a
    // deleted pod makes room): its cards are in the view before its assignment is on the pod, for as
    // long as its bind takes, so the two are compared until they agree; a reservation that is
    // forgotten never comes to agree.
    let deadline = Instant::now() + ACCOUNTING_SETTLES;
    loop {
        let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await.unwrap();
        match accounting(cluster, &pods.items, &card_memory) {
            Ok(()) => break,
            Err(e) if Instant::now() >= deadline => panic!("{e}"),
            Err(e) => eprintln!("checks: not yet: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    checked
}

/// How long the allocator's accounting may take to agree with the assignments: a filter's hold and
/// a bind's deadline and read-back, twice (a pod filtered again as its first hold ends).
const ACCOUNTING_SETTLES: Duration =
    Duration::from_secs(2 * (FILTER_HOLD.as_secs() + bind::DEADLINE.as_secs() + bind::READ_BACK.as_secs()));

/// Whether the assignments of the pods not ended hold no card over 100 % or over its memory, and
/// exactly what the allocator's view counts on every card; what differs, if not.
fn accounting(cluster: &Cluster, pods: &[Pod], card_memory: &HashMap<String, u64>) -> Result<(), String> {
    let (mut percent, mut memory): (HashMap<String, u32>, HashMap<String, u64>) = Default::default();
    // Per card, the pods whose assignments hold it and how much (told when the allocator disagrees).
    let mut holders: HashMap<String, Vec<String>> = HashMap::new();
    for p in pods {
        let Some(text) = p.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)) else {
            continue;
        };
        if matches!(phase(p), "Succeeded" | "Failed") {
            continue;
        }
        let a = Assignment::decode(text).unwrap();
        let (ns, name) = (p.metadata.namespace.as_deref().unwrap(), p.metadata.name.as_deref().unwrap());
        for g in a.held() {
            *percent.entry(g.uuid.clone()).or_default() += g.percent.0;
            *memory.entry(g.uuid.clone()).or_default() += held_memory(g, card_memory);
            holders.entry(g.uuid.clone()).or_default().push(format!("{ns}/{name} {}", g.percent.0));
        }
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
    let view = cluster.inspect();
    for node in view["nodes"].as_array().unwrap() {
        for card in node["cards"].as_array().unwrap() {
            let uuid = card["uuid"].as_str().unwrap();
            let counted = card["percentUsed"].as_u64().unwrap();
            let assigned = percent.get(uuid).copied().unwrap_or(0);
            if counted != u64::from(assigned) {
                return Err(format!(
                    "allocator's view of {uuid} differs from the assignments: it counts {counted} % \
                     ({}), the assignments {assigned} % ({:?})",
                    card["shares"],
                    holders.get(uuid)
                ));
            }
            let (total, free) =
                (card["memoryMiB"].as_u64().unwrap(), card["memoryFreeMiB"].as_u64().unwrap());
            let assigned = memory.get(uuid).copied().unwrap_or(0);
            if total - free != assigned {
                return Err(format!(
                    "allocator's view of {uuid}'s memory differs from the assignments: it counts {} MiB, \
                     the assignments {assigned} MiB",
                    total - free
                ));
            }
        }
    }
    Ok(())
}

/// The GPU memory a grant holds: what it records, else its percent of the card's memory.
pub fn held_memory(g: &CardGrant, card_memory: &HashMap<String, u64>) -> u64 {
    g.memory_held(MiB(card_memory[&g.uuid])).0
}

/// Every card's memory (MiB) by UUID, from the nodes' inventories.
pub fn card_memories(nodes: &[Node]) -> HashMap<String, u64> {
    let inventories = nodes.iter().filter_map(|n| n.metadata.annotations.as_ref()?.get(GPUS_ANNOTATION));
    inventories
        .flat_map(|text| NodeInventory::decode(text).unwrap().gpus)
        .map(|g| (g.uuid, g.memory_mib.0))
        .collect()
}
