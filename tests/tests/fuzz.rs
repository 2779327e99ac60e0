//! Structured random inputs for every decoder that reads what others write: annotations, node
//! inventory, extender and AdmissionReview bodies (through the allocator's real HTTP routes),
//! quantities, pod demand, device IDs, the device plugin's gRPC requests (protobuf bytes through
//! Allocate), sysfs and `/proc` trees, cgroup lines and the Prometheus text `top` reads.
//!
//! Each input is either arbitrary or a valid one mutated (bytes flipped, JSON-significant characters
//! inserted, ranges deleted or repeated); a decoder must never panic, and what it accepts must
//! survive a round trip where it has one. Stable Rust, proptest. The budget is proptest's own
//! `PROPTEST_CASES` (256 per property in the test run); `hack/fuzz.sh` runs a larger one. A failure
//! prints the smallest input found; each becomes a named regression case at the end of this file.

use http::Request;
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_agent::inventory::GpuInventory;
use nano_gpu_proto::annotations::{Assignment, NodeInventory, OverrunMark};
use nano_gpu_proto::demand::{DemandOptions, pod_demand};
use nano_gpu_proto::{device_id, gpushare, quantity};
use proptest::prelude::*;
use std::sync::OnceLock;
use tower::ServiceExt;

const ASSIGNMENT: &str = r#"{"v":1,"node":"n1","at":"2026-11-21T10:00:00Z","containers":{"infer":[{"uuid":"GPU-b","index":1,"percent":100},{"uuid":"GPU-c","index":2,"percent":100}],"train":[{"uuid":"GPU-a","index":0,"percent":30,"memoryMiB":8192}]},"reuse":["infer"]}"#;
const INVENTORY: &str = r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-8a1c","vendor":"nvidia","model":"NVIDIA H100 80GB HBM3","memoryMiB":81559,"healthy":true,"numa":0},{"index":1,"uuid":"0000:03:00.0","vendor":"intel","model":"Intel Data Center GPU Flex 170","memoryMiB":16256,"healthy":false}]}"#;
const OVERRUN: &str = r#"{"v":1,"containers":[{"container":"c","uuid":"GPU-a","index":0,"usedMiB":20000,"grantedMiB":1536,"since":"2026-11-23T10:00:00Z"}]}"#;
const POD: &str = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","namespace":"ns","uid":"u","annotations":{"ALIYUN_COM_GPU_MEM_IDX":"1","ALIYUN_COM_GPU_MEM_POD":"4"}},"spec":{"nodeName":"node-1","initContainers":[{"name":"i","resources":{"limits":{"nano-gpu/gpu-percent":"20"}}}],"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"30","nano-gpu/gpu-memory":"4Gi","aliyun.com/gpu-mem":"4","cpu":"500m"}}}]}}"#;
const METRICS: &str = "nano_gpu_container_granted_percent{node=\"node-1\",namespace=\"ml\",pod=\"p\",container=\"c\",gpu=\"0\",uuid=\"GPU-a\"} 30\nnano_gpu_container_memory_used_bytes{node=\"node-1\",namespace=\"ml\",pod=\"p\",container=\"c\",gpu=\"0\",uuid=\"GPU-a\"} 1.048576e9\n";
const CGROUP: &str = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_0000_4000_8000_123456789abc.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope";

/// Characters that matter to JSON, quantities and our own formats.
const SIGNIFICANT: &[u8] = b"{}[]\":,.-+eE0123456789 \\/_kKmMGi\n\tnul";

/// `valid` with up to 8 edits.
fn mutated(valid: &'static str) -> impl Strategy<Value = String> {
    prop::collection::vec((any::<u8>(), any::<usize>(), 0..4u8), 0..8).prop_map(move |edits| {
        let mut b = valid.as_bytes().to_vec();
        for (byte, at, kind) in edits {
            if b.is_empty() {
                b.push(byte);
                continue;
            }
            let i = at % b.len();
            let span = (i + 1 + usize::from(byte) % 16).min(b.len());
            match kind {
                0 => b[i] = byte,
                1 => b.insert(i, SIGNIFICANT[usize::from(byte) % SIGNIFICANT.len()]),
                2 => {
                    b.drain(i..span);
                }
                _ => {
                    let piece = b[i..span].to_vec();
                    b.splice(i..i, piece);
                }
            }
        }
        String::from_utf8_lossy(&b).into_owned()
    })
}

/// Arbitrary text, or `valid` mutated.
fn text(valid: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), mutated(valid)]
}

/// Something shaped like a Kubernetes quantity, often almost valid.
fn quantity_like() -> impl Strategy<Value = String> {
    prop_oneof![
        "[-+]?[0-9]{0,30}(\\.[0-9]{0,12})?([eE][-+]?[0-9]{1,5})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|n|u)?",
        any::<String>(),
    ]
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

proptest! {
    #[test]
    fn annotations_decode_or_refuse_and_what_decodes_round_trips(
        a in text(ASSIGNMENT), i in text(INVENTORY), o in text(OVERRUN),
    ) {
        if let Ok(x) = Assignment::decode(&a) {
            prop_assert_eq!(Assignment::decode(&x.encode()), Ok(x));
        }
        if let Ok(x) = NodeInventory::decode(&i) {
            prop_assert_eq!(NodeInventory::decode(&x.encode()), Ok(x));
        }
        if let Ok(x) = OverrunMark::decode(&o) {
            prop_assert_eq!(OverrunMark::decode(&x.encode()), Ok(x));
        }
    }

    #[test]
    fn quantities_parse_or_refuse(q in quantity_like(), n in 0u64..1_000_000_000_000) {
        let _ = (quantity::cpu_milli(&q), quantity::mebibytes(&q), quantity::whole(&q));
        prop_assert_eq!(quantity::whole(&n.to_string()), Ok(n));
        prop_assert_eq!(quantity::mebibytes(&format!("{n}Mi")), Ok(n));
        prop_assert_eq!(quantity::cpu_milli(&format!("{n}m")), Ok(n));
    }

    #[test]
    fn a_pods_demand_is_read_or_refused_whatever_its_limits_and_annotations(
        pod in text(POD), limit in quantity_like(), which in 0..4usize, idx in any::<String>(),
    ) {
        if let Ok(mut p) = serde_json::from_str::<Pod>(&pod) {
            let _ = pod_demand(&p, &DemandOptions::default());
            let _ = (gpushare::placement(&p), gpushare::pod_units(&p));
            let key = ["nano-gpu/gpu-percent", "nano-gpu/gpu-memory", "aliyun.com/gpu-mem", "cpu"][which];
            if let Some(c) = p.spec.as_mut().and_then(|s| s.containers.first_mut()) {
                let limits = c.resources.get_or_insert_default().limits.get_or_insert_default();
                limits.insert(key.into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity(limit));
            }
            p.metadata.annotations.get_or_insert_default().insert("ALIYUN_COM_GPU_MEM_IDX".into(), idx);
            let _ = pod_demand(&p, &DemandOptions::default());
            let _ = (gpushare::placement(&p), gpushare::pod_units(&p));
        }
    }

    #[test]
    fn device_ids_decode_or_refuse_and_ours_round_trip(
        id in text("GPU-8a1c2b3d-0000-4000-8000-0123456789ab-42"),
        uuid in "[A-Za-z0-9:._-]{1,80}", n in 0u32..100,
    ) {
        let _ = (device_id::decode(&id), device_id::card_of(&id));
        if device_id::uuid_fits(&uuid) {
            let encoded = device_id::encode(&uuid, n);
            prop_assert_eq!(device_id::decode(&encoded), Ok((uuid.as_str(), n)));
            prop_assert_eq!(device_id::card_of(&encoded), Ok(uuid.as_str()));
        }
    }

    #[test]
    fn cgroup_lines_and_metrics_text_are_read_or_ignored(line in text(CGROUP), metrics in text(METRICS)) {
        let _ = nano_gpu_agent::usage::cgroup::container_of(&line);
        for l in metrics.lines() {
            let _ = nano_gpu_allocator::top::sample(l);
        }
        let _ = nano_gpu_allocator::top::rows(&metrics);
    }

    #[test]
    fn the_device_plugins_grpc_requests_are_served_or_refused(bytes in prop::collection::vec(any::<u8>(), 0..512), ids in prop::collection::vec(text("GPU-a-07"), 0..120)) {
        use nano_gpu_agent::inventory::Card;
        use nano_gpu_agent::plugin::{Edits, allocate};
        use nano_gpu_agent::resource::Resource;
        use nano_gpu_proto::kubelet::deviceplugin::AllocateRequest;
        use nano_gpu_proto::units::MiB;
        use prost::Message;
        let cards = [Card::nvidia(0, "GPU-a", "T4", MiB(15360), None), Card::nvidia(1, "GPU-b", "T4", MiB(15360), None)];
        let mut requests = vec![ids];
        if let Ok(r) = AllocateRequest::decode(bytes.as_slice()) {
            requests.extend(r.container_requests.into_iter().map(|c| c.devices_ids));
        }
        for ids in requests {
            for resource in [Resource::Percent, Resource::Gpushare(nano_gpu_proto::demand::GpushareUnit::GiB)] {
                if let Ok(r) = allocate(&cards, &ids, None, resource, Edits::default()) {
                    prop_assert!(!r.envs.is_empty());
                }
            }
        }
    }

    #[test]
    fn the_allocators_http_routes_answer_any_body(route in 0..5usize, body in prop_oneof![
        text(r#"{"Pod":{"metadata":{"name":"p","namespace":"ns","uid":"u"},"spec":{"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"30"}}}]}},"NodeNames":["node-1","node-2"]}"#),
        text(r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"node-1"}"#),
        text(r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"r","operation":"CREATE","object":{"metadata":{"name":"p"},"spec":{"containers":[{"name":"c","resources":{"limits":{"nano-gpu/gpu-percent":"150"}}}]}}}}"#),
    ]) {
        let path = ["/filter", "/prioritize", "/bind", "/preempt", "/mutate"][route];
        let status = runtime().block_on(async {
            let (app, public) = allocator();
            let router = if path == "/mutate" { public } else { app };
            let request = Request::post(path).header("content-type", "application/json").body(axum::body::Body::from(body)).unwrap();
            router.oneshot(request).await.unwrap().status()
        });
        prop_assert!(!status.is_server_error() || path == "/bind", "{} answered {}", path, status);
    }

    #[test]
    fn sysfs_and_proc_trees_are_read_or_skipped(
        vendor in text("0x8086"), device in text("0x56a0"), numa in text("1"), memory in text("17179869184"),
        vfs in text("0"), stat in text("42 (python3) S 1 42 42 0 -1 4194560 1000 0 0 0 10 5 0 0 20 0 8 0 123456 1000000 500"),
        cgroup in text(CGROUP),
    ) {
        let dir = std::env::temp_dir().join(format!("nano-gpu-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let card = dir.join("sys/class/drm/card0");
        std::fs::create_dir_all(card.join("device/drm/renderD128")).unwrap();
        for (file, content) in [("device/vendor", &vendor), ("device/device", &device), ("device/numa_node", &numa), ("device/sriov_numvfs", &vfs), ("lmem_total_bytes", &memory)] {
            std::fs::write(card.join(file), content).unwrap();
        }
        let drm = nano_gpu_agent::inventory::SysfsDrm { sysfs_root: dir.join("sys"), dev_root: dir.join("dev") };
        if let Ok(cards) = drm.cards() {
            let inventory = NodeInventory::new(cards.into_iter().map(|c| c.info).collect());
            prop_assert_eq!(NodeInventory::decode(&inventory.encode()), Ok(inventory));
        }
        let process = dir.join("proc/42");
        std::fs::create_dir_all(&process).unwrap();
        std::fs::write(process.join("stat"), &stat).unwrap();
        std::fs::write(process.join("cgroup"), &cgroup).unwrap();
        let _ = nano_gpu_agent::usage::procs::Procs::new(dir.join("proc")).container_of(42);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The allocator's two routers over an empty cluster, with a binder whose API calls all fail.
fn allocator() -> (axum::Router, axum::Router) {
    use nano_gpu_allocator::binder::{ApiError, Binder};
    use nano_gpu_allocator::server::{Shared, public_router, router};
    use nano_gpu_allocator::state::ClusterState;
    use nano_gpu_engine::{engine::Engine, model::Cluster, policy, workload::Workload};
    struct NoApi;
    impl Binder for NoApi {
        async fn get_pod(&self, _: &str, name: &str) -> Result<Pod, ApiError> {
            Err(ApiError::NotFound(name.into()))
        }
        async fn annotate(
            &self,
            _: &str,
            _: &str,
            _: &str,
            _: Option<&str>,
            _: &std::collections::BTreeMap<String, Option<String>>,
        ) -> Result<(), ApiError> {
            Err(ApiError::Other("no API server".into()))
        }
        async fn bind(&self, _: &str, _: &str, _: &str, _: &str) -> Result<(), ApiError> {
            Err(ApiError::Other("no API server".into()))
        }
    }
    let engine = Engine::new(Cluster::new(), policy::by_name("default", 0).unwrap(), Workload::default());
    let shared = Shared::new(ClusterState::new(engine, 0, DemandOptions::default()), NoApi);
    shared.view.set_synced();
    (router(shared.clone()), public_router(shared))
}
