//! Pod identity without a lock, end to end: the `nano-gpu-agent` binary with a node name, a fake
//! kubelet (registration and pod-resources) over real unix sockets, and a fake API server holding the
//! node's pods. The test plays the kubelet's device manager: GetPreferredAllocation, Allocate,
//! PreStartContainer, with pod-resources answering what it has allocated so far.

use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, CardGrant};
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::registration_server::{Registration, RegistrationServer};
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreStartContainerRequest, PreferredAllocationRequest, RegisterRequest,
};
use nano_gpu_proto::kubelet::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use nano_gpu_proto::kubelet::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices, ContainerResources,
    GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse,
    PodResources,
};
use nano_gpu_proto::resources::GPU_PERCENT;
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

struct Kubelet(mpsc::UnboundedSender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.0.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// The kubelet's pod-resources: what the test says it has allocated.
#[derive(Clone, Default)]
struct PodResourcesState(Arc<Mutex<Vec<Allocated>>>);

/// Pod, container and the device IDs the kubelet gave it.
type Allocated = (String, String, Vec<String>);

impl PodResourcesState {
    fn set(&self, entries: &[(&str, &str, &[String])]) {
        *self.0.lock().unwrap() =
            entries.iter().map(|(p, c, ids)| (p.to_string(), c.to_string(), ids.to_vec())).collect();
    }
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesState {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let pod_resources = self
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(pod, container, ids)| PodResources {
                name: pod.clone(),
                namespace: "ns".into(),
                containers: vec![ContainerResources {
                    name: container.clone(),
                    devices: vec![ContainerDevices {
                        resource_name: GPU_PERCENT.into(),
                        device_ids: ids.clone(),
                        topology: None,
                    }],
                    ..Default::default()
                }],
            })
            .collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }
}

fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| device_id::encode(uuid, n)).collect()
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

fn serve_unix<S>(path: &Path, service: S)
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
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
    let dir = std::env::temp_dir().join(format!("nano-gpu-identity-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let gpus = dir.join("gpus.json");
    std::fs::write(
        &gpus,
        r#"{"v":1,"gpus":[
        {"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"Tesla T4","memoryMiB":16000,"healthy":true},
        {"index":1,"uuid":"GPU-b","vendor":"nvidia","model":"Tesla T4","memoryMiB":16000,"healthy":true}]}"#,
    )
    .unwrap();
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})],
        pods: vec![pod("steered", 30, ("GPU-b", 1), Some(4096)), pod("moved", 50, ("GPU-b", 1), None)],
    })
    .await
    .unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();

    let (registered, mut registrations) = mpsc::unbounded_channel();
    serve_unix(&plugins.join("kubelet.sock"), RegistrationServer::new(Kubelet(registered)));
    let pod_resources = PodResourcesState::default();
    pod_resources.set(&[("steered", "c", &[])]);
    serve_unix(&dir.join("pod-resources.sock"), PodResourcesListerServer::new(pod_resources.clone()));

    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_nano-gpu-agent"))
        .args(["--node-name", "n1", "--identity-wait-ms", "300"])
        .arg("--plugin-dir")
        .arg(&plugins)
        .arg("--pod-resources-socket")
        .arg(dir.join("pod-resources.sock"))
        .arg("--fake-inventory")
        .arg(&gpus)
        .env("KUBECONFIG", &kubeconfig)
        .spawn()
        .unwrap();
    let registration = tokio::time::timeout(Duration::from_secs(20), registrations.recv()).await;
    assert!(matches!(registration, Ok(Some(_))), "the agent did not register");
    let channel = nano_gpu_agent::plugin::connect(plugins.join("nano-gpu.sock")).await.unwrap();
    let mut kubelet = DevicePluginClient::new(channel);
    let mut all = ids("GPU-a", 0..100);
    all.extend(ids("GPU-b", 0..100));

    // Steer: the pod being admitted ("steered", listed by pod-resources) was assigned GPU-b.
    let preferred = kubelet
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: all.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 30,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let chosen = preferred.container_responses[0].device_i_ds.clone();
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
    pod_resources.set(&[("steered", "c", &chosen), ("moved", "c", &[])]);
    let on_a = ids("GPU-a", 0..50);
    let got = kubelet.allocate(allocate(on_a.clone())).await.unwrap().into_inner();
    assert_eq!(got.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    assert_eq!(got.container_responses[0].envs["NANO_GPU_MEMORY_MIB"], "8000");
    pod_resources.set(&[("steered", "c", &chosen), ("moved", "c", &on_a)]);
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
    agent.kill().unwrap();
    agent.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
