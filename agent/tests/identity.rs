//! Pod identity without a lock, end to end: the `nano-gpu-agent` binary with a node name, a fake
//! kubelet (registration and pod-resources) over real unix sockets, and a fake API server holding the
//! node's pods. The test plays the kubelet's device manager: GetPreferredAllocation, Allocate,
//! PreStartContainer, with pod-resources answering what it has allocated so far.

use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, CardGrant};
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, PreStartContainerRequest,
    PreferredAllocationRequest,
};
use nano_gpu_proto::resources::{GPU_PERCENT, GPUSHARE_MEMORY};
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use nano_gpu_tests::fake_kubelet::{Allocated, FakeKubelet, two_t4_node};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| device_id::encode(uuid, n)).collect()
}

/// A gpushare-style pod: `aliyun.com/gpu-mem` GiB, assigned on `card` as the allocator does.
fn gpushare_pod(name: &str, gib: u64, card: (&str, u32)) -> Value {
    let mut p = pod(name, 25, card, Some(gib * 1024));
    p["spec"]["containers"][0]["resources"] = json!({"limits": {GPUSHARE_MEMORY: gib.to_string()}});
    p
}

fn pod(name: &str, asks: u32, card: (&str, u32), memory: Option<u64>) -> Value {
    let grant =
        CardGrant { uuid: card.0.into(), index: card.1, percent: Percent(asks), memory_mib: memory.map(MiB) };
    let assignment = Assignment::new(
        "n1",
        format!("2026-11-22T00:00:0{}Z", asks / 10),
        BTreeMap::from([("c".to_string(), vec![grant])]),
    );
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "7",
                        "annotations": {ASSIGNMENT_ANNOTATION: assignment.encode()}},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: asks.to_string()}}}]}})
}

/// The kubelet's GetPreferredAllocation for one container of `size` among `available`.
async fn preferred(
    plugin: &mut DevicePluginClient<tonic::transport::Channel>,
    available: Vec<String>,
    size: i32,
) -> Vec<String> {
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    let answer = plugin.get_preferred_allocation(request).await.unwrap().into_inner();
    answer.container_responses[0].device_i_ds.clone()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..200 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not happen within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_steers_derives_and_repairs_against_a_fake_kubelet_and_api_server() {
    let (dir, gpus) = two_t4_node("identity");
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})],
        pods: vec![
            pod("steered", 30, ("GPU-b", 1), Some(4096)),
            pod("moved", 50, ("GPU-b", 1), None),
            gpushare_pod("shared", 4, ("GPU-b", 1)),
        ],
        ..Objects::default()
    })
    .await
    .unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();

    let mut fake = FakeKubelet::start(&dir).unwrap();
    let pod_resources = fake.pod_resources.clone();
    let entry = |pod: &str, ids: &[String]| Allocated {
        namespace: "ns".into(),
        pod: pod.into(),
        container: "c".into(),
        resource: GPU_PERCENT.into(),
        ids: ids.to_vec(),
    };
    pod_resources.put(entry("steered", &[]));

    let probes = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut agent = fake
        .agent(env!("CARGO_BIN_EXE_nano-gpu-agent").as_ref(), &gpus, &kubeconfig)
        .args(["--identity-wait-ms", "300", "--gpushare", "gib", "--probe-listen", &probes])
        .spawn()
        .unwrap();
    fake.registered().await;
    // Registered and serving two cards: ready.
    let mut probe = nano_gpu_tests::http_client::Conn::open(&probes).await.unwrap();
    let mut ready = (0, String::new());
    for _ in 0..100 {
        let (code, body) = probe.call("GET", "/readyz", vec![]).await.unwrap();
        ready = (code, String::from_utf8_lossy(&body).into_owned());
        if code == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Saying what holds a share to its size here: nothing but the accounting under `none`.
    let said = "serving 2 card(s); shares: not limited (the scheduler's accounting only)";
    assert_eq!(ready, (200, said.to_string()));
    let mut kubelet = fake.plugin().await;
    let mut all = ids("GPU-a", 0..100);
    all.extend(ids("GPU-b", 0..100));

    // Steer: the pod being admitted ("steered", listed by pod-resources) was assigned GPU-b.
    let chosen = preferred(&mut kubelet, all.clone(), 30).await;
    assert!(chosen.len() == 30 && chosen.iter().all(|id| id.starts_with("GPU-b-")), "{chosen:?}");

    // Derive: the container sees the card of its IDs, with the memory it asked.
    let allocate = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let got = kubelet.allocate(allocate(chosen.clone())).await.unwrap().into_inner();
    let env = &got.container_responses[0].envs;
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
    assert_eq!((env["NANO_GPU_PERCENT"].as_str(), env["NANO_GPU_MEMORY_MIB"].as_str()), ("30", "4096"));

    // The kubelet gives "moved" IDs on GPU-a although it was assigned GPU-b: the container sees
    // GPU-a (what the kubelet accounts), and PreStart repairs the assignment.
    pod_resources.put(entry("steered", &chosen));
    pod_resources.put(entry("moved", &[]));
    let on_a = ids("GPU-a", 0..50);
    let got = kubelet.allocate(allocate(on_a.clone())).await.unwrap().into_inner();
    assert_eq!(got.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    assert_eq!(got.container_responses[0].envs["NANO_GPU_MEMORY_MIB"], "8000");
    pod_resources.put(entry("moved", &on_a));
    for ids in [chosen.clone(), on_a.clone()] {
        kubelet.pre_start_container(PreStartContainerRequest { devices_ids: ids }).await.unwrap();
    }
    let patched = |api: &FakeApi, name: &str| -> Option<Assignment> {
        api.writes().iter().find(|(m, p, _)| m == "PATCH" && p.ends_with(&format!("/pods/{name}"))).map(
            |(_, _, b)| {
                assert_eq!(b["metadata"]["uid"], format!("uid-{name}"));
                assert_eq!(b["metadata"]["resourceVersion"], "7");
                Assignment::decode(b["metadata"]["annotations"][ASSIGNMENT_ANNOTATION].as_str().unwrap())
                    .unwrap()
            },
        )
    };
    eventually("the repair of pod moved", || patched(&api, "moved").is_some()).await;
    let repaired = patched(&api, "moved").unwrap();
    assert_eq!(repaired.containers["c"][0].uuid, "GPU-a");
    assert_eq!((repaired.containers["c"][0].index, repaired.containers["c"][0].percent), (0, Percent(50)));
    let reasons = |api: &FakeApi| -> Vec<String> {
        api.writes()
            .iter()
            .filter(|(_, p, _)| p.contains("/events"))
            .map(|(_, _, b)| b["reason"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    eventually("the AssignmentRepaired event", || reasons(&api).contains(&"AssignmentRepaired".into())).await;
    // The container that got its assigned card is left alone.
    assert!(patched(&api, "steered").is_none());

    // IDs no placed pod can own: an error the kubelet reports, and an Event on the Node; no env.
    let refused = kubelet.allocate(allocate(ids("GPU-a", 50..90))).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("no pod placed on node n1"), "{}", refused.message());
    eventually("the NoUsableAssignment event", || reasons(&api).contains(&"NoUsableAssignment".into())).await;

    // The cards were published on the Node.
    assert!(api.writes().iter().any(|(m, p, _)| m == "PATCH" && p == "/api/v1/nodes/n1"));

    // gpushare: the memory resource on its own socket, steered to the assigned card, with gpushare's env.
    let second =
        tokio::time::timeout(Duration::from_secs(10), fake.registrations.recv()).await.unwrap().unwrap();
    assert_eq!(second.resource_name, GPUSHARE_MEMORY);
    let channel = nano_gpu_runtime::unix_channel(fake.plugin_dir.join(&second.endpoint)).await.unwrap();
    let mut memory = DevicePluginClient::new(channel);
    pod_resources.put(Allocated { resource: GPUSHARE_MEMORY.into(), ..entry("shared", &[]) });
    let units: Vec<String> =
        ["GPU-a", "GPU-b"].iter().flat_map(|u| (0..15).map(move |n| device_id::encode_unit(u, n))).collect();
    let chosen = preferred(&mut memory, units, 4).await;
    assert!(chosen.len() == 4 && chosen.iter().all(|id| id.starts_with("GPU-b-m")), "{chosen:?}");
    let got = memory.allocate(allocate(chosen.clone())).await.unwrap().into_inner();
    let env = &got.container_responses[0].envs;
    assert_eq!((env["ALIYUN_COM_GPU_MEM_IDX"].as_str(), env["ALIYUN_COM_GPU_MEM_POD"].as_str()), ("1", "4"));
    assert_eq!(env["NANO_GPU_MEMORY_MIB"], "4096");
    // Once it starts on its assigned card, the pod gets what gpushare's device plugin wrote after
    // Allocate, and its assignment is left as it is.
    pod_resources.put(Allocated { resource: GPUSHARE_MEMORY.into(), ..entry("shared", &chosen) });
    memory.pre_start_container(PreStartContainerRequest { devices_ids: chosen }).await.unwrap();
    let marked = |api: &FakeApi| {
        api.writes().iter().any(|(m, p, b)| {
            let annotations = &b["metadata"]["annotations"];
            m == "PATCH"
                && p.ends_with("/pods/shared")
                && annotations["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
                && annotations.get(ASSIGNMENT_ANNOTATION).is_none()
                && b["metadata"]["uid"] == "uid-shared"
        })
    };
    eventually("ALIYUN_COM_GPU_MEM_ASSIGNED on pod shared", || marked(&api)).await;

    agent.kill().unwrap();
    agent.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
