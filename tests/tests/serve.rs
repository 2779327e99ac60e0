//! The extender service end to end over real sockets: the watches list a (fake) API server, the
//! service becomes ready, and a filter → bind round writes the binding that carries the
//! assignment.

use nano_gpu_allocator::service::bind_api::KubeBinder;
use nano_gpu_allocator::service::{server, watch};
use nano_gpu_allocator::state::ClusterState;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::model::Cluster;
use nano_gpu_engine::policy;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use nano_gpu_tests::http_client::Conn;
use serde_json::{Value, json};
use std::time::Duration;

fn node(name: &str, cards: usize) -> Value {
    let gpus: Vec<Value> = (0..cards)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": "Tesla T4", "memoryMiB": 15360, "healthy": true}))
        .collect();
    let mut n = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "resourceVersion": "1"},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nano-gpu/gpu-percent": (cards * 100).to_string()}}});
    if cards > 0 {
        n["metadata"]["annotations"] = json!({"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()});
    }
    n
}

fn pod(name: &str, percent: u32, node: Option<&str>, assignment: Option<Value>) -> Value {
    let mut p = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"), "resourceVersion": "5"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"nano-gpu/gpu-percent": percent.to_string(), "cpu": "1"}}}]},
        "status": {"phase": if node.is_some() { "Running" } else { "Pending" }}});
    if let Some(n) = node {
        p["spec"]["nodeName"] = n.into();
    }
    if let Some(a) = assignment {
        p["metadata"]["annotations"] = json!({"nano-gpu/assignment": a.to_string()});
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_lists_the_cluster_in_pages_then_places_and_binds_a_pod() {
    lists_then_places_and_binds(false).await;
}

/// The same from an API server that streams its lists (1.34 and later): the fake's stream is what
/// `bench-pending --listing streamed` measures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_lists_a_streamed_cluster_then_places_and_binds_a_pod() {
    lists_then_places_and_binds(true).await;
}

async fn lists_then_places_and_binds(streams: bool) {
    let old = json!({"v": 1, "node": "n1", "at": "t", "containers": {"main": [{"uuid": "GPU-n1-0", "index": 0, "percent": 60}]}});
    let api = FakeApi::start(Objects {
        nodes: vec![node("n1", 2), node("cpu-only", 0)],
        pods: vec![pod("old", 60, Some("n1"), Some(old)), pod("new", 50, None, None)],
        streams,
    })
    .await
    .unwrap();
    let config = kube::Config::new(format!("http://{}", api.addr).parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let engine =
        Engine::new(Cluster::new(), policy::by_name(policy::DEFAULT, 0).unwrap(), Default::default());
    let shared = server::Shared::new(
        ClusterState::new(engine, 0, DemandOptions::default()),
        KubeBinder::new(client.clone()),
    );
    let listing = watch::Listing::of(&client).await;
    assert_eq!(listing, if streams { watch::Listing::Streamed } else { watch::Listing::Paged });
    tokio::spawn(watch::run(client, shared.view.clone(), None, listing));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // The extender's and the operators' routes on one port (in the pod they are two).
    let routes = server::router(shared.clone()).merge(server::operator_router(shared));
    tokio::spawn(async move { axum::serve(listener, routes).await });

    let mut conn = Conn::open(&addr).await.unwrap();
    let ready = async {
        loop {
            if conn.call("GET", "/readyz", vec![]).await.unwrap().0 == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), ready).await.expect("ready within 20 s");

    let args = json!({"Pod": pod("new", 50, None, None), "NodeNames": ["n1", "cpu-only"]});
    let (status, body) = conn.call("POST", "/filter", args.to_string().into_bytes()).await.unwrap();
    assert_eq!(status, 200);
    let filtered: Value = serde_json::from_slice(&body).unwrap();
    // The node the allocator chooses, alone (kube-scheduler then binds it without scoring); a pod
    // that fits nowhere gets every node's reason.
    assert_eq!(filtered["NodeNames"], json!(["n1"]));
    assert!(filtered["FailedAndUnresolvableNodes"].as_object().is_none_or(|m| m.is_empty()), "{filtered}");
    let nowhere = json!({"Pod": pod("nowhere", 50, None, None), "NodeNames": ["cpu-only"]});
    let (_, body) = conn.call("POST", "/filter", nowhere.to_string().into_bytes()).await.unwrap();
    let refused: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(refused["NodeNames"], json!([]));
    assert_eq!(refused["FailedAndUnresolvableNodes"]["cpu-only"], "node has no GPU");
    let bind = json!({"PodName": "new", "PodNamespace": "default", "PodUID": "uid-new", "Node": "n1"});
    let (_, body) = conn.call("POST", "/bind", bind.to_string().into_bytes()).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&body), r#"{"Error":""}"#);

    // One write: the binding, carrying the assignment (kube-apiserver copies it onto the pod).
    let writes = api.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    let (method, path, binding) = &writes[0];
    assert_eq!((method.as_str(), path.as_str()), ("POST", "/api/v1/namespaces/default/pods/new/binding"));
    assert_eq!(binding["target"], json!({"kind": "Node", "name": "n1"}));
    assert_eq!(binding["metadata"]["uid"], "uid-new");
    let assignment: Value =
        serde_json::from_str(binding["metadata"]["annotations"]["nano-gpu/assignment"].as_str().unwrap())
            .unwrap();
    // Card 0 has 40 % left, so the 50 % share goes to card 1.
    assert_eq!(assignment["containers"]["main"][0]["uuid"], "GPU-n1-1");

    let (_, body) = conn.call("GET", "/inspect", vec![]).await.unwrap();
    let view: Value = serde_json::from_slice(&body).unwrap();
    let n1 = view["nodes"].as_array().unwrap().iter().find(|n| n["name"] == "n1").unwrap();
    assert_eq!(n1["cards"][0]["percentUsed"], 60);
    assert_eq!(n1["cards"][0]["pods"], json!(["default/old"]));
    assert_eq!(n1["cards"][1]["percentUsed"], 50);
}

/// The extender benchmark's driver at a small scale places the pods, each with its one write. So a
/// change to the bind protocol the benchmark's fake cluster does not follow fails here, not only when
/// someone runs `hack/bench-extender.sh` (bind reading the pod it binds found a fake API server
/// without the pods to place: every bind failed). Not every pod: binds run beside the next pod's
/// filter, as in kube-scheduler, so on 40 small cards a filter can pick cards a queued bind is about
/// to take, and that bind is refused (kube-scheduler would retry the pod); 0 to 3 of 30 in runs here.
#[test]
fn the_extender_benchmark_places_the_pods_at_a_small_scale() {
    let allocator = nano_gpu_tests::workspace_binary("nano-gpu-allocator");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench-extender"))
        .arg("--allocator")
        .arg(&allocator)
        .args(["--nodes", "20", "--cards", "2", "--placed", "10", "--pods", "30"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-extender failed: {stderr}");
    let line = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    let result: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?} {stderr}"));
    let (failed, writes) = (result["failed"].as_u64().unwrap(), result["bind_writes"].as_u64().unwrap());
    assert!(failed <= 10 && writes == 30 - failed, "{result}");
}

/// The pending-pod memory benchmark at a small scale runs both allocators and prints its line, so a
/// change it does not follow fails here, not only when someone runs `hack/bench-pending.sh`.
#[test]
fn the_pending_pod_benchmark_prints_both_runs() {
    for listing in ["paged", "streamed"] {
        pending_pod_benchmark(listing);
    }
}

fn pending_pod_benchmark(listing: &str) {
    let allocator = nano_gpu_tests::workspace_binary("nano-gpu-allocator");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bench-pending"))
        .arg("--allocator")
        .arg(&allocator)
        .args(["--nodes", "5", "--cards", "2", "--placed", "10", "--pending", "20", "--filler-kib", "8"])
        .args(["--listing", listing])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-pending failed: {stderr}");
    let line = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    let result: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?} {stderr}"));
    assert_eq!(
        (result["pending_pods"].as_u64(), result["annotation_bytes_per_pod"].as_u64()),
        (Some(20), Some(1023 + 8192))
    );
    assert_eq!(result["listing"], listing, "{result}");
    for run in ["baseline", "with_pending"] {
        assert!(result[run]["rss_mib"].as_f64().is_some_and(|m| m > 0.0), "{result}");
    }
    assert!(result["growth_kib_per_pod"].is_number(), "{result}");
}
