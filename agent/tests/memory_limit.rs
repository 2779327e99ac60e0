//! The driver's per-cgroup memory limit end to end, without a GPU: the agent with
//! `--memory-limit driver` against a fake kubelet and API server, its NVML the workspace's fake
//! (loaded through the real dynamic-loading path, `nvmlDeviceSetMemoryLimits_v1` recording each call),
//! and a cgroup v2 tree in a temporary directory laid out as the systemd cgroup driver lays it out.
//! PreStartContainer of a share sets its pod's limit (what the pod holds on the card) on the pod's
//! cgroup; a whole card gets none; a pod whose cgroup is not there fails the call (the kubelet
//! starts the container later) instead of running unlimited. Where the driver cannot set limits
//! (no cgroup v2), no NVIDIA card is served and the Node says `unavailable`.

use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, CardGrant};
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, Empty, PreStartContainerRequest,
};
use nano_gpu_proto::resources::GPU_PERCENT;
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use nano_gpu_tests::fake_kubelet::{Allocated, FakeKubelet, two_t4_node};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| device_id::encode(uuid, n)).collect()
}

/// Pod `name` (UID `uid-<name>`) whose container `c` holds `percent` of `uuid`, and, when
/// `sidecar` is given, a container `s` holding that much more of the same card.
fn pod(name: &str, percent: u32, uuid: &str, memory: Option<u64>, sidecar: Option<u64>) -> Value {
    let grant = |percent: u32, memory: Option<u64>| CardGrant {
        uuid: uuid.into(),
        index: 0,
        percent: Percent(percent),
        memory_mib: memory.map(MiB),
    };
    let mut containers = BTreeMap::from([("c".to_string(), vec![grant(percent, memory)])]);
    let mut specs = vec![json!({"name": "c", "resources": {"limits": {GPU_PERCENT: percent.to_string()}}})];
    if let Some(m) = sidecar {
        containers.insert("s".into(), vec![grant(10, Some(m))]);
        specs.push(json!({"name": "s", "resources": {"limits": {GPU_PERCENT: "10"}}}));
    }
    let assignment = Assignment::new("n1", "2026-11-24T00:00:00Z", containers);
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "7",
                        "annotations": {ASSIGNMENT_ANNOTATION: assignment.encode()}},
           "spec": {"nodeName": "n1", "containers": specs}})
}

fn entry(pod: &str, ids: &[String]) -> Allocated {
    Allocated {
        namespace: "ns".into(),
        pod: pod.into(),
        container: "c".into(),
        resource: GPU_PERCENT.into(),
        ids: ids.to_vec(),
    }
}

fn terminate(child: &mut Child) {
    let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
}

/// A scratch directory with the node's cards (fake inventory), the fake NVML's configuration
/// (recording memory limits in `limits.log`) and a cgroup tree; `v2` makes it a cgroup v2 root.
fn node(name: &str, v2: bool) -> (PathBuf, PathBuf, PathBuf) {
    let (dir, gpus) = two_t4_node(&format!("memlimit-{name}"));
    let cgroup = dir.join("cgroup");
    for uid in ["uid_shared", "uid_whole", "uid_pair"] {
        let qos = cgroup.join("kubepods.slice/kubepods-burstable.slice");
        std::fs::create_dir_all(qos.join(format!("kubepods-burstable-pod{uid}.slice"))).unwrap();
    }
    if v2 {
        std::fs::write(cgroup.join("cgroup.controllers"), "cpuset cpu io memory pids misc\n").unwrap();
    }
    let config = dir.join("nvml.json");
    let log = dir.join("limits.log");
    let nvml = json!({"cards": [{"uuid": "GPU-a"}, {"uuid": "GPU-b"}], "memoryLimitLog": log});
    std::fs::write(&config, nvml.to_string()).unwrap();
    (dir, gpus, config)
}

fn limits(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("limits.log")).unwrap_or_default();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..300 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not happen within 15 s");
}

/// The value of the `nano-gpu/memory-limit` label the agent last wrote on its Node.
fn label(api: &FakeApi) -> Option<String> {
    api.writes()
        .into_iter()
        .filter(|(_, p, _)| p.ends_with("/nodes/n1"))
        .filter_map(|(_, _, b)| b["metadata"]["labels"]["nano-gpu/memory-limit"].as_str().map(str::to_owned))
        .next_back()
}

/// What the kubelet does to start container `c` of `pod` on `ids`: Allocate, then (pod-resources
/// now listing them) PreStartContainer, whose answer this is.
async fn admit(
    fake: &FakeKubelet,
    kubelet: &mut DevicePluginClient<tonic::transport::Channel>,
    pod: &str,
    ids: Vec<String>,
) -> Result<(), tonic::Status> {
    fake.pod_resources.put(entry(pod, &[]));
    let request = ContainerAllocateRequest { devices_ids: ids.clone() };
    kubelet.allocate(AllocateRequest { container_requests: vec![request] }).await?;
    fake.pod_resources.put(entry(pod, &ids));
    kubelet.pre_start_container(PreStartContainerRequest { devices_ids: ids }).await.map(|_| ())
}

/// The agent on node `dir` with `--memory-limit driver`, registered; its device plugin client.
async fn agent(
    dir: &Path,
    gpus: &Path,
    config: &Path,
    api: &FakeApi,
) -> (Child, FakeKubelet, DevicePluginClient<tonic::transport::Channel>) {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
    let mut fake = FakeKubelet::start(dir).unwrap();
    let agent = fake
        .agent(env!("CARGO_BIN_EXE_nano-gpu-agent").as_ref(), gpus, &kubeconfig)
        .args(["--memory-limit", "driver", "--probe-listen", ""])
        .arg("--cgroup-root")
        .arg(dir.join("cgroup"))
        .arg("--nvml-lib")
        .arg(nano_gpu_tests::fake_nvml())
        .env("FAKE_NVML_CONFIG", config)
        .spawn()
        .unwrap();
    fake.registered().await;
    let kubelet = fake.plugin().await;
    (agent, fake, kubelet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shares_pod_gets_the_drivers_limit_before_its_container_starts() {
    let (dir, gpus, config) = node("driver", true);
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})],
        pods: vec![
            pod("shared", 30, "GPU-a", Some(2048), None),
            pod("whole", 100, "GPU-b", None, None),
            pod("pair", 20, "GPU-a", None, Some(1000)),
            pod("nocgroup", 10, "GPU-a", None, None),
        ],
        ..Objects::default()
    })
    .await
    .unwrap();
    let (mut agent, fake, mut kubelet) = agent(&dir, &gpus, &config, &api).await;
    let first =
        kubelet.list_and_watch(Empty {}).await.unwrap().into_inner().message().await.unwrap().unwrap();
    assert!(first.devices.iter().all(|d| d.health == "Healthy"), "the driver can set limits: cards served");
    eventually("the Node's memory-limit label", || label(&api).as_deref() == Some("driver")).await;

    let pod_dir = |uid: &str| {
        dir.join(format!("cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice"))
    };

    // A 30 % share asking 2 GiB: its pod's cgroup gets 2 GiB on GPU-a, soft and hard.
    admit(&fake, &mut kubelet, "shared", ids("GPU-a", 0..30)).await.unwrap();
    let set = limits(&dir);
    assert_eq!(set.len(), 1, "{set:?}");
    assert_eq!(set[0]["uuid"], "GPU-a");
    assert_eq!(set[0]["nameSpace"], pod_dir("uid_shared").display().to_string());
    assert_eq!(
        (set[0]["softLimit"].as_u64(), set[0]["hardLimit"].as_u64()),
        (Some(2048 << 20), Some(2048 << 20))
    );

    // A whole card: no limit.
    admit(&fake, &mut kubelet, "whole", ids("GPU-b", 0..100)).await.unwrap();
    assert_eq!(limits(&dir).len(), 1, "a whole card got a limit");

    // A pod of two containers on GPU-a: the pod's limit is what both hold (20 % of 16000 MiB, its
    // percent's memory, and the sidecar's asked 1000 MiB).
    admit(&fake, &mut kubelet, "pair", ids("GPU-a", 30..50)).await.unwrap();
    let set = limits(&dir);
    assert_eq!(set.len(), 2, "{set:?}");
    assert_eq!(set[1]["nameSpace"], pod_dir("uid_pair").display().to_string());
    assert_eq!(set[1]["hardLimit"].as_u64(), Some((3200 + 1000) << 20));

    // A pod whose cgroup cannot be found: the call fails with the reason, nothing is set.
    let refused = admit(&fake, &mut kubelet, "nocgroup", ids("GPU-a", 50..60)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert!(refused.message().contains("no cgroup of pod uid-nocgroup"), "{}", refused.message());
    assert_eq!(limits(&dir).len(), 2);

    terminate(&mut agent);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cgroup_v2_no_nvidia_card_is_served_and_the_node_says_so() {
    let (dir, gpus, config) = node("v1", false);
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})],
        pods: vec![],
        ..Objects::default()
    })
    .await
    .unwrap();
    let (mut agent, _fake, mut kubelet) = agent(&dir, &gpus, &config, &api).await;
    let first =
        kubelet.list_and_watch(Empty {}).await.unwrap().into_inner().message().await.unwrap().unwrap();
    assert!(!first.devices.is_empty() && first.devices.iter().all(|d| d.health == "Unhealthy"), "{first:?}");
    eventually("the Node's memory-limit label", || label(&api).as_deref() == Some("unavailable")).await;
    let annotation = api
        .writes()
        .into_iter()
        .filter_map(|(_, _, b)| b["metadata"]["annotations"]["nano-gpu/gpus"].as_str().map(str::to_owned))
        .next_back()
        .unwrap();
    assert!(!annotation.contains(r#""healthy":true"#), "{annotation}");
    terminate(&mut agent);
    let _ = std::fs::remove_dir_all(&dir);
}
