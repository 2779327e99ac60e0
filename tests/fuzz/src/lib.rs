//! Every decoder that reads what others write, each behind one entry point that takes raw bytes and
//! asserts what must hold of the answer: nothing panics, a route never answers 5xx (except `/bind`,
//! whose API calls fail here), and what decodes survives a round trip where it has one.
//!
//! Two drivers feed them: proptest on stable Rust (`tests/tests/fuzz.rs`: arbitrary and mutated valid
//! inputs, run by the README's test command) and libFuzzer, coverage-guided, on nightly
//! (`fuzz_targets/`, one target per entry point, run for a fixed time by `hack/fuzz.sh --coverage`).
//! An input made of several parts (a pod and a limit, seven sysfs files) has them split at [`SEP`],
//! a byte no UTF-8 text holds.

use http::Request;
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_proto::annotations::{Assignment, NodeInventory, OverrunMark};
use nano_gpu_proto::demand::{self, DemandOptions};
use nano_gpu_proto::{device_id, gpushare, quantity};
use std::sync::OnceLock;
use tower::ServiceExt;

/// Separates the parts of an input of several.
pub const SEP: u8 = 0xff;

/// Valid inputs, the seeds the mutations start from.
pub mod samples {
    /// A `nano-gpu/assignment` annotation.
    pub const ASSIGNMENT: &str = r#"{"v":1,"node":"n1","at":"2026-11-21T10:00:00Z","containers":{"infer":[{"uuid":"GPU-b","index":1,"percent":100},{"uuid":"GPU-c","index":2,"percent":100}],"train":[{"uuid":"GPU-a","index":0,"percent":30,"memoryMiB":8192}]},"reuse":["infer"]}"#;
    /// A Node's `nano-gpu/gpus` annotation.
    pub const INVENTORY: &str = r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-8a1c","vendor":"nvidia","model":"NVIDIA H100 80GB HBM3","memoryMiB":81559,"healthy":true,"numa":0},{"index":1,"uuid":"0000:03:00.0","vendor":"intel","model":"Intel Data Center GPU Flex 170","memoryMiB":16256,"healthy":false}]}"#;
    /// A pod's `nano-gpu/overrun` mark.
    pub const OVERRUN: &str = r#"{"v":1,"containers":[{"container":"c","uuid":"GPU-a","index":0,"usedMiB":20000,"grantedMiB":1536,"since":"2026-11-23T10:00:00Z"}]}"#;
    /// A pod asking a share, memory, gpushare's memory and CPU, with gpushare's annotations.
    pub const POD: &str = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","namespace":"ns","uid":"u","annotations":{"ALIYUN_COM_GPU_MEM_IDX":"1","ALIYUN_COM_GPU_MEM_POD":"4"}},"spec":{"nodeName":"node-1","initContainers":[{"name":"i","resources":{"limits":{"nano-gpu/gpu-percent":"20"}}}],"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"30","nano-gpu/gpu-memory":"4Gi","aliyun.com/gpu-mem":"4","cpu":"500m"}}}]}}"#;
    /// The agent's Prometheus text, as `top` reads it.
    pub const METRICS: &str = "nano_gpu_container_granted_percent{node=\"node-1\",namespace=\"ml\",pod=\"p\",container=\"c\",gpu=\"0\",uuid=\"GPU-a\"} 30\nnano_gpu_container_memory_used_bytes{node=\"node-1\",namespace=\"ml\",pod=\"p\",container=\"c\",gpu=\"0\",uuid=\"GPU-a\"} 1.048576e9\n";
    /// A `/proc/<pid>/cgroup` line of a containerd container under systemd.
    pub const CGROUP: &str = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_0000_4000_8000_123456789abc.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";
    /// One of our virtual device IDs.
    pub const DEVICE_ID: &str = "GPU-8a1c2b3d-0000-4000-8000-0123456789ab-42";
    /// The kubelet's device checkpoint (`kubelet_internal_checkpoint`).
    pub const CHECKPOINT: &str = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"1b2c3d4e-0000-4000-8000-123456789abc","ContainerName":"c","ResourceName":"nano-gpu/gpu-percent","DeviceIDs":{"-1":["GPU-8a1c-00","GPU-8a1c-01"]},"AllocResp":"CgA="}],"RegisteredDevices":{"nano-gpu/gpu-percent":["GPU-8a1c-00","GPU-8a1c-01"]}},"Checksum":1234}"#;
    /// A `/proc/<pid>/stat` line.
    pub const STAT: &str =
        "42 (python3) S 1 42 42 0 -1 4194560 1000 0 0 0 10 5 0 0 20 0 8 0 123456 1000000 500";
    /// The extender's `/filter` body.
    pub const FILTER: &str = r#"{"Pod":{"metadata":{"name":"p","namespace":"ns","uid":"u"},"spec":{"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"30"}}}]}},"NodeNames":["node-1","node-2"]}"#;
    /// The extender's `/bind` body.
    pub const BIND: &str = r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"node-1"}"#;
    /// The webhook's AdmissionReview.
    pub const REVIEW: &str = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"r","operation":"CREATE","object":{"metadata":{"name":"p"},"spec":{"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"150"}}}]}}}}"#;
}

/// The first `n` parts of `data` split at [`SEP`] (missing ones empty), as text.
pub fn parts<const N: usize>(data: &[u8]) -> [String; N] {
    let mut split = data.split(|b| *b == SEP);
    std::array::from_fn(|_| String::from_utf8_lossy(split.next().unwrap_or_default()).into_owned())
}

/// `parts` joined: the input [`parts`] splits again.
pub fn join(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(&SEP)
}

/// The three annotations we write and read back: the text read as each of them.
pub fn annotations(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(x) = Assignment::decode(&text) {
        assert_eq!(Assignment::decode(&x.encode()), Ok(x));
    }
    if let Ok(x) = NodeInventory::decode(&text) {
        assert_eq!(NodeInventory::decode(&x.encode()), Ok(x));
    }
    if let Ok(x) = OverrunMark::decode(&text) {
        assert_eq!(OverrunMark::decode(&x.encode()), Ok(x));
    }
}

/// A Kubernetes quantity, read as CPU, as memory and as a whole number.
pub fn quantities(data: &[u8]) {
    let q = String::from_utf8_lossy(data);
    let _ = (quantity::cpu_milli(&q), quantity::mebibytes(&q), quantity::whole(&q));
}

/// A pod (JSON), then one of its limits replaced (the first byte of the third part says which) and
/// gpushare's card index annotation set: its demand and gpushare's view of it, read or refused.
pub fn pod_demand(data: &[u8]) {
    let [pod, limit, which, idx] = parts::<4>(data);
    let Ok(mut p) = serde_json::from_str::<Pod>(&pod) else {
        return;
    };
    let _ = demand::pod_demand(&p, &DemandOptions::default());
    let _ = (gpushare::placement(&p), gpushare::pod_units(&p));
    let keys = ["nano-gpu/gpu-percent", "nano-gpu/gpu-memory", "aliyun.com/gpu-mem", "cpu"];
    let key = keys[usize::from(which.bytes().next().unwrap_or(0)) % keys.len()];
    if let Some(c) = p.spec.as_mut().and_then(|s| s.containers.first_mut()) {
        let limits = c.resources.get_or_insert_default().limits.get_or_insert_default();
        limits.insert(key.into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity(limit));
    }
    p.metadata.annotations.get_or_insert_default().insert("ALIYUN_COM_GPU_MEM_IDX".into(), idx);
    let _ = demand::pod_demand(&p, &DemandOptions::default());
    let _ = (gpushare::placement(&p), gpushare::pod_units(&p));
}

/// A device ID the kubelet hands back, decoded; text that fits as a card UUID round-trips through
/// our encoding. The text is also read as the kubelet's device checkpoint, where it keeps the IDs.
pub fn device_ids(data: &[u8]) {
    let id = String::from_utf8_lossy(data);
    let _ = (device_id::decode(&id), device_id::card_of(&id));
    if device_id::uuid_fits(&id) {
        let n = (data.len() % 100) as u32;
        let encoded = device_id::encode(&id, n);
        assert_eq!(device_id::decode(&encoded), Ok((&*id, n)));
        assert_eq!(device_id::card_of(&encoded), Ok(&*id));
    }
}

/// The kubelet's device checkpoint (`kubelet_internal_checkpoint`) the agent's sweep reads: decoded
/// or refused, and when decoded, the pods it names for our resource are those a generic JSON reading
/// of the same text names.
pub fn kubelet_checkpoint(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(holders) = nano_gpu_agent::kubelet::checkpoint::holders(&text, &["nano-gpu/gpu-percent"]) else {
        return;
    };
    let named =
        checkpoint_holders_as_json(&text, "nano-gpu/gpu-percent").expect("decoded by the sweep, not JSON");
    assert_eq!(holders, named, "{text}");
}

/// The UIDs of the pods that hold devices of `resource` in the kubelet's device checkpoint `text`,
/// read as generic JSON (the oracle for the sweep's decoder; the fault suite reads the nodes'
/// checkpoints with it); None when `text` is not JSON.
pub fn checkpoint_holders_as_json(text: &str, resource: &str) -> Option<std::collections::BTreeSet<String>> {
    let doc: serde_json::Value = serde_json::from_str(text).ok()?;
    let entries = doc["Data"]["PodDeviceEntries"].as_array().cloned().unwrap_or_default();
    Some(
        entries
            .iter()
            .filter(|e| e["ResourceName"] == resource)
            .filter_map(|e| e["PodUID"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// A `/proc/<pid>/cgroup` line, and the Prometheus text `top` reads (line by line and whole).
pub fn cgroup_and_metrics(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for line in text.lines() {
        let _ = nano_gpu_agent::serve::usage::cgroup::container_of(line);
        let _ = nano_gpu_allocator::commands::top::sample(line);
    }
    let _ = nano_gpu_allocator::commands::top::rows(&text);
}

/// The device plugin's Allocate over two cards: the bytes as a protobuf `AllocateRequest`, and as
/// device IDs one per line; for both resources and with and without MPS limits, an answer given is
/// never without its env, and an MPS limit only ever comes with its card's pipe directory.
pub fn allocate(data: &[u8]) {
    use nano_gpu_agent::cards::inventory::Card;
    use nano_gpu_agent::cards::resource::Resource;
    use nano_gpu_agent::kubelet::plugin::{Edits, allocate};
    use nano_gpu_agent::node::enforce::{Enforcement, mps::Layout};
    use nano_gpu_proto::kubelet::deviceplugin::AllocateRequest;
    use nano_gpu_proto::units::MiB;
    use prost::Message;
    let cards =
        [Card::nvidia(0, "GPU-a", "T4", MiB(15360), None), Card::nvidia(1, "GPU-b", "T4", MiB(15360), None)];
    let mut requests = vec![String::from_utf8_lossy(data).lines().map(str::to_owned).collect::<Vec<_>>()];
    if let Ok(r) = AllocateRequest::decode(data) {
        requests.extend(r.container_requests.into_iter().map(|c| c.devices_ids));
    }
    let mps = Edits {
        enforcement: Enforcement::Mps(Layout::new("/run/nano-gpu/mps", "/proc")),
        ..Default::default()
    };
    for ids in requests {
        for resource in [Resource::Percent, Resource::Gpushare(nano_gpu_proto::demand::GpushareUnit::GiB)] {
            for edits in [&Edits::default(), &mps] {
                if let Ok(r) = allocate(&cards, &ids, None, resource, edits) {
                    assert!(!r.envs.is_empty(), "an Allocate answer without env for {ids:?}");
                    if let Some(limit) = r.envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") {
                        let percent: u32 = limit.parse().expect("a number");
                        assert!((1..100).contains(&percent), "{limit} for {ids:?}");
                        let card = &r.envs["NANO_GPU_CARDS"];
                        assert!(r.mounts.iter().any(|m| m.host_path.ends_with(&format!("{card}/pipe"))));
                    }
                }
            }
        }
    }
}

/// The allocator's routes on its real routers (over an empty cluster, with API calls that fail):
/// the first byte picks `/filter`, `/prioritize`, `/bind`, `/preempt` or `/mutate`, the rest is the
/// body.
pub fn http_routes(data: &[u8]) {
    let Some((first, body)) = data.split_first() else {
        return;
    };
    let path = ["/filter", "/prioritize", "/bind", "/preempt", "/mutate"][usize::from(*first) % 5];
    let status = runtime().block_on(async {
        let (app, public) = allocator();
        let router = if path == "/mutate" { public } else { app };
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_vec()))
            .unwrap();
        router.oneshot(request).await.unwrap().status()
    });
    assert!(!status.is_server_error() || path == "/bind", "{path} answered {status}");
}

/// A sysfs drm card (vendor, device, NUMA node, local memory, VF count) and a `/proc/<pid>` (stat,
/// cgroup) as files: read or skipped, and the inventory made of what was read round-trips.
pub fn sysfs_and_proc(data: &[u8]) {
    use nano_gpu_agent::cards::inventory::GpuInventory;
    let [vendor, device, numa, memory, vfs, stat, cgroup, fdinfo] = parts::<8>(data);
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("nano-gpu-fuzz-{}-{run}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let card = dir.join("sys/class/drm/card0");
    std::fs::create_dir_all(card.join("device/drm/renderD128")).unwrap();
    let files = [
        ("device/vendor", &vendor),
        ("device/device", &device),
        ("device/numa_node", &numa),
        ("device/sriov_numvfs", &vfs),
        ("lmem_total_bytes", &memory),
    ];
    for (file, content) in files {
        std::fs::write(card.join(file), content).unwrap();
    }
    let drm =
        nano_gpu_agent::cards::inventory::SysfsDrm::new(dir.join("sys"), dir.join("dev"), dir.join("proc"));
    if let Ok(cards) = drm.cards() {
        let inventory = NodeInventory::new(cards.into_iter().map(|c| c.info).collect());
        assert_eq!(NodeInventory::decode(&inventory.encode()), Ok(inventory));
    }
    let process = dir.join("proc/42");
    std::fs::create_dir_all(&process).unwrap();
    std::fs::write(process.join("stat"), &stat).unwrap();
    std::fs::write(process.join("cgroup"), &cgroup).unwrap();
    let _ = nano_gpu_agent::serve::usage::procs::Procs::new(dir.join("proc")).container_of(42);
    // A DRM client's fdinfo, parsed and sampled twice (the second turns counters into
    // utilisation): read or skipped, never a panic.
    std::fs::create_dir_all(process.join("fdinfo")).unwrap();
    std::fs::create_dir_all(process.join("fd")).unwrap();
    std::fs::write(process.join("fdinfo/3"), &fdinfo).unwrap();
    std::os::unix::fs::symlink("/dev/dri/renderD128", process.join("fd/3")).unwrap();
    let _ = nano_gpu_agent::cards::inventory::fdinfo::parse(&fdinfo);
    for _ in 0..2 {
        let _ = drm.sample();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An entry point: raw bytes in, a panic when what must hold does not.
pub type EntryPoint = fn(&[u8]);

/// Every entry point by name, for the drivers that pick one (the seeds' writer, the targets' list).
pub const TARGETS: [(&str, EntryPoint); 9] = [
    ("annotations", annotations),
    ("quantities", quantities),
    ("pod_demand", pod_demand),
    ("device_ids", device_ids),
    ("kubelet_checkpoint", kubelet_checkpoint),
    ("cgroup_and_metrics", cgroup_and_metrics),
    ("allocate", allocate),
    ("http_routes", http_routes),
    ("sysfs_and_proc", sysfs_and_proc),
];

/// Valid inputs of each entry point, the corpus libFuzzer starts from.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    use samples::*;
    let texts = |t: &[&str]| t.iter().map(|s| s.as_bytes().to_vec()).collect();
    match target {
        "annotations" => texts(&[ASSIGNMENT, INVENTORY, OVERRUN]),
        "quantities" => texts(&["500m", "4Gi", "1.5e3", "100"]),
        "pod_demand" => vec![join(&[POD.as_bytes(), b"8Gi", b"\x01", b"2"])],
        "device_ids" => texts(&[DEVICE_ID]),
        "kubelet_checkpoint" => texts(&[CHECKPOINT]),
        "cgroup_and_metrics" => texts(&[CGROUP, METRICS]),
        "allocate" => {
            use nano_gpu_proto::kubelet::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
            use prost::Message;
            let ids = vec!["GPU-a-07".to_owned(), "GPU-a-08".to_owned()];
            let request =
                AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] };
            vec![request.encode_to_vec(), b"GPU-a-07\nGPU-b-01".to_vec()]
        }
        "http_routes" => [(0u8, FILTER), (1, FILTER), (2, BIND), (3, FILTER), (4, REVIEW)]
            .iter()
            .map(|(route, body)| [&[*route][..], body.as_bytes()].concat())
            .collect(),
        "sysfs_and_proc" => {
            vec![join(&[
                b"0x8086",
                b"0x56a0",
                b"1",
                b"17179869184",
                b"0",
                STAT.as_bytes(),
                CGROUP.as_bytes(),
            ])]
        }
        _ => Vec::new(),
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

/// The allocator's two routers over an empty cluster, with a binder whose API calls all fail.
fn allocator() -> (axum::Router, axum::Router) {
    use nano_gpu_allocator::service::bind_api::{ApiError, Binder};
    use nano_gpu_allocator::service::server::{Shared, public_router, router};
    use nano_gpu_allocator::state::ClusterState;
    use nano_gpu_engine::{engine::Engine, model::Cluster, policy, workload::Workload};
    struct NoApi;
    impl Binder for NoApi {
        async fn get_pod(&self, _: &str, name: &str) -> Result<Pod, ApiError> {
            Err(ApiError::NotFound(name.into()))
        }
        async fn bind(
            &self,
            _: &str,
            _: &str,
            _: &str,
            _: &str,
            _: &std::collections::BTreeMap<String, String>,
        ) -> Result<(), ApiError> {
            Err(ApiError::Unanswered("no API server".into()))
        }
    }
    let engine = Engine::new(Cluster::new(), policy::by_name("default", 0).unwrap(), Workload::default());
    let shared = Shared::new(ClusterState::new(engine, 0, DemandOptions::default()), NoApi);
    shared.view.set_synced();
    (router(shared.clone()), public_router(shared))
}
