//! The DRA front end as the kubelet meets it, over real unix sockets in a temp dir: the registration
//! the plugin watcher reads, then NodePrepareResources and NodeUnprepareResources on the driver's
//! socket, with claims as the API server has them and the CDI specs a runtime would read.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use nano_gpu_agent::cards::inventory::Card;
use nano_gpu_agent::kubelet::dra::{self, Claims, Driver, Paths, cdi};
use nano_gpu_agent::kubelet::plugin::{DeviceList, Edits, Snapshot};
use nano_gpu_agent::node::enforce::driver::PodLimit;
use nano_gpu_proto::kubelet::dra::dra_plugin_client::DraPluginClient;
use nano_gpu_proto::kubelet::dra::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use nano_gpu_proto::kubelet::pluginregistration::registration_client::RegistrationClient;
use nano_gpu_proto::kubelet::pluginregistration::{InfoRequest, RegistrationStatus};
use nano_gpu_proto::units::MiB;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tonic::transport::Channel;

const NODE: &str = "node-1";

/// Claims (and pods) as the API server has them, by namespace and name, and every read made
/// (`claim <name>`, `pod <name>`).
#[derive(Clone, Default)]
struct Store(
    Arc<Mutex<HashMap<(String, String), ResourceClaim>>>,
    Arc<Mutex<HashMap<String, Pod>>>,
    Arc<Mutex<Vec<String>>>,
);

impl Claims for Store {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        self.2.lock().unwrap().push(format!("claim {name}"));
        let claims = self.0.lock().unwrap();
        claims
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| format!("claim {name} not found"))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, String> {
        assert_eq!(namespace, "team-a");
        self.2.lock().unwrap().push(format!("pod {name}"));
        self.1.lock().unwrap().get(name).cloned().ok_or_else(|| format!("pod {name} not found"))
    }
}

impl Store {
    /// Adds the claim `name` (UID `uid-<name>`) allocated `results`; returns the kubelet's `Claim`.
    fn add(&self, name: &str, results: Value) -> Claim {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "team-a", "uid": format!("uid-{name}") },
            "spec": {},
            "status": { "allocation": { "devices": { "results": results } } },
        }))
        .unwrap();
        self.0.lock().unwrap().insert(("team-a".into(), name.into()), claim);
        Claim { namespace: "team-a".into(), uid: format!("uid-{name}"), name: name.into() }
    }

    /// Adds the claim `name` as [`Store::add`] does, made for pod `pod` (UID `uid-<pod>`) from a
    /// template, as Kubernetes' claim controller makes it.
    fn add_for(&self, pod: &str, name: &str, results: Value) -> Claim {
        let claim = self.add(name, results);
        let owner = json!([{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": format!("uid-{pod}"),
                            "controller": true, "blockOwnerDeletion": true}]);
        let mut all = self.0.lock().unwrap();
        all.get_mut(&("team-a".into(), name.into())).unwrap().metadata.owner_references =
            Some(serde_json::from_value(owner).unwrap());
        claim
    }

    /// Adds pod `name` (UID `uid`) using the claims `claims` made for it from templates.
    fn add_pod(&self, name: &str, uid: &str, claims: &[&str]) {
        let spec: Vec<Value> =
            claims.iter().map(|c| json!({"name": c, "resourceClaimTemplateName": "nano-gpu-p30"})).collect();
        let made: Vec<Value> = claims.iter().map(|c| json!({"name": c, "resourceClaimName": c})).collect();
        let pod = json!({"metadata": {"name": name, "namespace": "team-a", "uid": uid},
                         "spec": {"containers": [], "resourceClaims": spec},
                         "status": {"resourceClaimStatuses": made}});
        self.1.lock().unwrap().insert(name.into(), serde_json::from_value(pod).unwrap());
    }
}

/// The driver's memory limit as a test sees it: each limit set, in order; a pod without a cgroup
/// (`uid-nocgroup`) fails as the driver's does.
#[derive(Default)]
struct Limits(Mutex<Vec<(String, String, u64)>>);

impl PodLimit for Limits {
    fn limit_pod(&self, uuid: &str, uid: &str, memory: MiB) -> Result<PathBuf, String> {
        if uid == "uid-nocgroup" {
            return Err(format!("no cgroup of pod {uid} under /sys/fs/cgroup"));
        }
        self.0.lock().unwrap().push((uuid.to_owned(), uid.to_owned(), memory.0));
        Ok(PathBuf::from(format!("/sys/fs/cgroup/kubepods/pod{uid}")))
    }
}

/// One allocation result of this driver on this node.
fn result(request: &str, device: &str, capacity: Value) -> Value {
    json!({ "request": request, "driver": dra::DRIVER, "pool": NODE, "device": device,
            "consumedCapacity": capacity, "shareID": format!("share-{request}-{device}") })
}

fn cards() -> Vec<Card> {
    vec![
        Card::nvidia(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB", MiB(81920), None),
        Card::nvidia(1, "GPU-bbbb", "NVIDIA A100-SXM4-80GB", MiB(81920), None),
        Card::nvidia(2, "GPU-cccc", "Tesla T4", MiB(15360), None),
    ]
}

struct Running {
    dir: PathBuf,
    paths: Paths,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Running {
    async fn start(name: &str, store: Store, edits: Edits) -> Running {
        let dir = std::env::temp_dir().join(format!("nano-gpu-dra-{name}-{}", std::process::id()));
        Running::start_in(dir, store, edits).await
    }

    async fn start_in(dir: PathBuf, store: Store, edits: Edits) -> Running {
        Running::start_as(dir, "", store, edits, None).await
    }

    /// The front end of the agent `instance` (its pod's name) in `dir`, setting the driver's memory
    /// limit through `limit` when given.
    async fn start_as(
        dir: PathBuf,
        instance: &str,
        store: Store,
        edits: Edits,
        limit: Option<Arc<dyn PodLimit>>,
    ) -> Running {
        let paths = Paths {
            registry_dir: dir.join("plugins_registry"),
            plugin_dir: dir.join("plugins").join(dra::DRIVER),
            cdi_dir: dir.join("cdi"),
            instance: instance.to_owned(),
        };
        let (_cards, rx) = watch::channel::<Snapshot>(Arc::new(cards()));
        let driver = Driver {
            claims: store.clone(),
            node: NODE.into(),
            cards: rx,
            edits,
            cdi_dir: paths.cdi_dir.clone(),
            limit,
        };
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(dra::run(paths.clone(), driver, None, stopped));
        std::mem::forget(_cards);
        Running { dir, paths, stop, task }
    }

    async fn stop(self) -> PathBuf {
        self.stop.send(true).unwrap();
        self.task.await.unwrap().unwrap();
        self.dir
    }

    async fn client(&self) -> DraPluginClient<Channel> {
        DraPluginClient::new(channel(&self.paths.dra_socket()).await)
    }

    fn spec(&self, uid: &str) -> Option<Value> {
        let text = std::fs::read(cdi::path(&self.paths.cdi_dir, uid)).ok()?;
        Some(serde_json::from_slice(&text).unwrap())
    }
}

/// A connection to `socket` once it answers (never by testing that the file exists).
async fn channel(socket: &Path) -> Channel {
    for _ in 0..500 {
        if let Ok(channel) = nano_gpu_runtime::unix_channel(socket.to_owned()).await {
            return channel;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} never answered", socket.display())
}

fn env(device: &Value) -> HashMap<String, String> {
    device["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn mounts(device: &Value) -> Vec<String> {
    device["containerEdits"]["mounts"]
        .as_array()
        .map(|m| m.iter().map(|m| m["containerPath"].as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_kubelet_finds_the_driver_its_socket_and_the_v1_service_in_the_registry() {
    let running = Running::start("registry", Store::default(), Edits::default()).await;
    let mut registration = RegistrationClient::new(channel(&running.paths.registration_socket()).await);
    let info = registration.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.nano-gpu.io");
    assert_eq!(PathBuf::from(&info.endpoint), running.paths.dra_socket());
    assert_eq!(info.supported_versions, vec!["v1.DRAPlugin".to_owned()]);
    // The service it names answers by then.
    let mut client = running.client().await;
    client.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![] }).await.unwrap();
    registration
        .notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() })
        .await
        .unwrap();
    drop((registration, client));
    let registry = running.paths.registration_socket();
    let dir = running.stop().await;
    // Stopped: the registration is gone, so the kubelet unregisters the driver.
    assert!(!registry.exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// gRPC calls over one HTTP/2 connection to `socket`, written frame by frame as grpc-go writes them
/// when given a bare socket path, that path as every request's `:authority` (the kubelet's plugin
/// watcher does so). Each call's answer: the response message, or the RST_STREAM error code.
async fn calls_with_path_authority(socket: &Path, calls: &[(&str, Vec<u8>)]) -> Vec<Result<Vec<u8>, u32>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    let mut conn = tokio::net::UnixStream::connect(socket).await.unwrap();
    conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    conn.write_all(&frame(0x4, 0, 0, &[])).await.unwrap();
    let mut encoder = loona_hpack::Encoder::new();
    let mut decoder = loona_hpack::Decoder::new();
    let authority = socket.display().to_string();
    let mut answers = Vec::new();
    for (n, (path, body)) in calls.iter().enumerate() {
        let stream = 2 * n as u32 + 1;
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority.as_bytes()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        conn.write_all(&frame(0x1, 0x4, stream, &encoder.encode(headers))).await.unwrap();
        let mut message = vec![0, 0, 0, 0, body.len() as u8];
        message.extend_from_slice(body);
        conn.write_all(&frame(0x0, 0x1, stream, &message)).await.unwrap();
        let mut data = Vec::new();
        let answer = loop {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head).await.unwrap();
            let length = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            conn.read_exact(&mut payload).await.unwrap();
            let (kind, flags) = (head[3], head[4]);
            let on = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
            match kind {
                0x4 if flags & 1 == 0 => conn.write_all(&frame(0x4, 1, 0, &[])).await.unwrap(),
                0x3 if on == stream => break Err(u32::from_be_bytes(payload[..4].try_into().unwrap())),
                0x0 if on == stream => data.extend_from_slice(&payload),
                0x1 if on == stream => {
                    let headers = decoder.decode(&payload).unwrap();
                    let status = headers.iter().find(|(k, _)| k.as_slice() == b"grpc-status");
                    if flags & 1 != 0 {
                        assert_eq!(status.map(|(_, v)| v.as_slice()), Some(&b"0"[..]), "{headers:?}");
                        break Ok(data[5..].to_vec());
                    }
                }
                _ => {}
            }
        };
        answers.push(answer);
    }
    answers
}

#[tokio::test]
async fn the_kubelets_plugin_watcher_is_answered_though_it_sends_the_socket_path_as_authority() {
    use nano_gpu_proto::kubelet::pluginregistration::PluginInfo;
    use nano_gpu_proto::kubelet::pluginregistration::registration_server::RegistrationServer;
    use prost::Message;
    let running = Running::start("authority", Store::default(), Edits::default()).await;
    let socket = running.paths.registration_socket();
    channel(&socket).await;
    let status = RegistrationStatus { plugin_registered: true, error: String::new() }.encode_to_vec();
    let calls = [
        ("/pluginregistration.Registration/GetInfo", Vec::new()),
        ("/pluginregistration.Registration/NotifyRegistrationStatus", status),
    ];
    let answers = calls_with_path_authority(&socket, &calls).await;
    let info = PluginInfo::decode(answers[0].as_deref().unwrap()).unwrap();
    assert_eq!(info.name, "gpu.nano-gpu.io");
    assert!(answers[1].is_ok(), "{answers:?}");

    // The control: tonic on its own refuses the same request (RST_STREAM, PROTOCOL_ERROR).
    let plain = running.dir.join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&plain).unwrap();
    let registrar = dra::Registrar::new(Path::new("/nowhere"));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registrar))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let refused = calls_with_path_authority(&plain, &calls[..1]).await;
    assert_eq!(refused, vec![Err(0x1)]);
    let _ = std::fs::remove_dir_all(running.stop().await);
}

#[tokio::test]
async fn in_a_rollout_the_new_agent_registers_beside_the_old_and_a_dead_ones_sockets_go() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-dra-rollout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A crashed agent's sockets: the files are there, no one answers.
    let registry = dir.join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let dead = registry.join("gpu.nano-gpu.io-agent-dead-reg.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let unrelated = registry.join("other.example.com-reg.sock");
    drop(std::os::unix::net::UnixListener::bind(&unrelated).unwrap());

    let old = Running::start_as(dir.clone(), "agent-old", Store::default(), Edits::default(), None).await;
    let new = Running::start_as(dir.clone(), "agent-new", Store::default(), Edits::default(), None).await;
    for running in [&old, &new] {
        let mut registration = RegistrationClient::new(channel(&running.paths.registration_socket()).await);
        let info = registration.get_info(InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(PathBuf::from(info.endpoint), running.paths.dra_socket());
    }
    assert_ne!(old.paths.dra_socket(), new.paths.dra_socket());
    assert!(!dead.exists(), "the dead agent's registration is still there");
    assert!(unrelated.exists(), "another driver's socket was removed");
    // The old agent goes: only its own sockets with it.
    let (old_registration, old_dra) = (old.paths.registration_socket(), old.paths.dra_socket());
    old.stop().await;
    assert!(!old_registration.exists() && !old_dra.exists());
    let mut client = new.client().await;
    client.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![] }).await.unwrap();
    assert!(new.paths.registration_socket().exists());
    drop(client);
    let _ = std::fs::remove_dir_all(new.stop().await);
}

#[tokio::test]
async fn a_share_is_prepared_as_a_cdi_device_with_its_card_its_limits_and_its_share_id() {
    let store = Store::default();
    let running = Running::start("share", store.clone(), Edits::default()).await;
    let claim = store.add("share", json!([result("gpu", "gpu-1", json!({"percent": "30"}))]));
    let mut client = running.client().await;
    let answer = client
        .node_prepare_resources(NodePrepareResourcesRequest { claims: vec![claim.clone()] })
        .await
        .unwrap()
        .into_inner();
    let got = &answer.claims["uid-share"];
    assert_eq!(got.error, "");
    assert_eq!(got.devices.len(), 1);
    let device = &got.devices[0];
    assert_eq!((device.pool_name.as_str(), device.device_name.as_str()), (NODE, "gpu-1"));
    assert_eq!(device.request_names, vec!["gpu".to_owned()]);
    assert_eq!(device.cdi_device_ids, vec!["nano-gpu.io/claim=uid-share-0".to_owned()]);
    assert_eq!(device.share_id.as_deref(), Some("share-gpu-gpu-1"));

    let spec = running.spec("uid-share").expect("the claim's CDI spec");
    assert_eq!(spec["kind"], "nano-gpu.io/claim");
    assert_eq!(spec["devices"][0]["name"], "uid-share-0");
    let env = env(&spec["devices"][0]);
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-bbbb");
    assert_eq!(env["NANO_GPU_PERCENT"], "30");
    assert_eq!(env["NANO_GPU_CARDS"], "GPU-bbbb");
    // The one memory rule: 30 % of the card's 80 GiB.
    assert_eq!(env["NANO_GPU_MEMORY_MIB"], "24576");
    assert_eq!(mounts(&spec["devices"][0]), vec!["/var/run/nvidia-container-devices/GPU-bbbb".to_owned()]);

    // Prepared again (the kubelet retries, or restarted): the same answer, the same spec.
    let again =
        client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![claim] }).await.unwrap();
    assert_eq!(&again.into_inner().claims["uid-share"], got);
    assert_eq!(running.spec("uid-share").unwrap(), spec);
    drop(client);
    let _ = std::fs::remove_dir_all(running.stop().await);
}

#[tokio::test]
async fn a_request_of_two_cards_is_one_cdi_device_and_asked_memory_is_held() {
    let store = Store::default();
    let edits =
        Edits { devices: DeviceList { envvar: true, volume_mounts: true, cdi: true }, ..Default::default() };
    let running = Running::start("two", store.clone(), edits).await;
    let claim = store.add(
        "two",
        json!([
            result("pair", "gpu-0", json!({})),
            result("pair", "gpu-1", json!({})),
            result("small", "gpu-2", json!({"percent": "10", "memory": "4Gi"})),
        ]),
    );
    let mut client = running.client().await;
    let answer =
        client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![claim] }).await.unwrap();
    let got = &answer.into_inner().claims["uid-two"];
    assert_eq!(got.error, "");
    let ids: Vec<Vec<String>> = got.devices.iter().map(|d| d.cdi_device_ids.clone()).collect();
    assert_eq!(
        ids,
        vec![
            vec!["nano-gpu.io/claim=uid-two-0".to_owned(), "nvidia.com/gpu=GPU-aaaa".to_owned()],
            vec!["nvidia.com/gpu=GPU-bbbb".to_owned()],
            vec!["nano-gpu.io/claim=uid-two-1".to_owned(), "nvidia.com/gpu=GPU-cccc".to_owned()],
        ]
    );
    let spec = running.spec("uid-two").unwrap();
    let pair = env(&spec["devices"][0]);
    assert_eq!(pair["NVIDIA_VISIBLE_DEVICES"], "GPU-aaaa,GPU-bbbb");
    assert_eq!(pair["NANO_GPU_PERCENT"], "200");
    assert_eq!(
        mounts(&spec["devices"][0]),
        vec!["/var/run/nvidia-container-devices/GPU-aaaa", "/var/run/nvidia-container-devices/GPU-bbbb"]
    );
    let small = env(&spec["devices"][1]);
    assert_eq!(small["NVIDIA_VISIBLE_DEVICES"], "GPU-cccc");
    assert_eq!(small["NANO_GPU_MEMORY_MIB"], "4096");
    drop(client);
    let _ = std::fs::remove_dir_all(running.stop().await);
}

#[tokio::test]
async fn bad_claims_are_refused_with_their_reason_and_nothing_is_written() {
    let store = Store::default();
    let running = Running::start("bad", store.clone(), Edits::default()).await;
    let other_node =
        json!([{ "request": "gpu", "driver": dra::DRIVER, "pool": "node-2", "device": "gpu-0" }]);
    let other_driver =
        json!([{ "request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0" }]);
    let cases = [
        ("unallocated", Value::Null, "is not allocated"),
        ("other-driver", other_driver, "has no device of driver gpu.nano-gpu.io"),
        ("other-node", other_node, "not this node's"),
        ("unknown", json!([result("gpu", "gpu-9", json!({}))]), "has no card 9"),
        ("renamed", json!([result("gpu", "card-0", json!({}))]), "not one of this driver's names"),
        ("too-much", json!([result("gpu", "gpu-0", json!({"percent": "150"}))]), "percent 150"),
        ("fraction", json!([result("gpu", "gpu-0", json!({"percent": "500m"}))]), "not a whole number"),
        ("garbage", json!([result("gpu", "gpu-0", json!({"percent": "lots"}))]), "percent of gpu-0"),
        ("memory", json!([result("gpu", "gpu-2", json!({"memory": "16Gi"}))]), "16384 MiB of gpu-2"),
        (
            "twice",
            json!([
                result("a", "gpu-0", json!({"percent": "60"})),
                result("b", "gpu-0", json!({"percent": "60"}))
            ]),
            "120 % of gpu-0",
        ),
    ];
    let mut claims = Vec::new();
    for (name, results, _) in &cases {
        let mut claim = store.add(name, results.clone());
        if results.is_null() {
            let mut all = store.0.lock().unwrap();
            all.get_mut(&("team-a".into(), (*name).into())).unwrap().status = None;
        }
        claim.namespace = "team-a".into();
        claims.push(claim);
    }
    // The driver takes no opaque configuration: one is refused, not ignored.
    let configured = store.add("configured", json!([result("gpu", "gpu-0", json!({}))]));
    {
        let mut all = store.0.lock().unwrap();
        let claim = all.get_mut(&("team-a".into(), "configured".into())).unwrap();
        let allocation = claim.status.as_mut().unwrap().allocation.as_mut().unwrap();
        allocation.devices.as_mut().unwrap().config = Some(vec![
            serde_json::from_value(json!({"source": "FromClaim", "requests": ["gpu"],
                "opaque": {"driver": dra::DRIVER, "parameters": {"sharing": "time-slicing"}}}))
            .unwrap(),
        ]);
    }
    claims.push(configured);
    // A claim made again under the same name has another UID than the one the kubelet names.
    let mut stale = store.add("stale", json!([result("gpu", "gpu-0", json!({}))]));
    stale.uid = "uid-before".into();
    claims.push(stale);
    claims.push(Claim { namespace: "team-a".into(), uid: "uid-gone".into(), name: "gone".into() });
    let mut client = running.client().await;
    let answer =
        client.node_prepare_resources(NodePrepareResourcesRequest { claims }).await.unwrap().into_inner();
    for (name, _, why) in &cases {
        let error = &answer.claims[&format!("uid-{name}")].error;
        assert!(error.contains(why), "{name}: {error:?} does not say {why:?}");
    }
    assert!(answer.claims["uid-before"].error.contains("has UID uid-stale, not uid-before"));
    let error = &answer.claims["uid-configured"].error;
    assert!(error.contains("takes no opaque configuration (one from the claim is set)"), "{error}");
    assert!(answer.claims["uid-gone"].error.contains("not found"));
    assert!(answer.claims.values().all(|c| c.devices.is_empty()));
    assert_eq!(cdi::prepared(&running.paths.cdi_dir).unwrap(), Vec::<String>::new());
    drop(client);
    let _ = std::fs::remove_dir_all(running.stop().await);
}

#[tokio::test]
async fn prepared_claims_outlive_a_restart_and_unprepare_removes_them_once() {
    let store = Store::default();
    let running = Running::start("restart", store.clone(), Edits::default()).await;
    let a = store.add("a", json!([result("gpu", "gpu-0", json!({"percent": "50"}))]));
    let b = store.add("b", json!([result("gpu", "gpu-0", json!({"percent": "50"}))]));
    let mut client = running.client().await;
    let answer = client
        .node_prepare_resources(NodePrepareResourcesRequest { claims: vec![a.clone(), b.clone()] })
        .await
        .unwrap()
        .into_inner();
    assert!(answer.claims.values().all(|c| c.error.is_empty()), "{answer:?}");
    drop(client);
    let dir = running.stop().await;

    // A new agent on the same node: the specs are its state.
    let running = Running::start_in(dir, store.clone(), Edits::default()).await;
    assert_eq!(cdi::prepared(&running.paths.cdi_dir).unwrap(), vec!["uid-a".to_owned(), "uid-b".to_owned()]);
    let mut client = running.client().await;
    for _ in 0..2 {
        let answer = client
            .node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![a.clone()] })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.claims["uid-a"].error, "");
    }
    assert_eq!(cdi::prepared(&running.paths.cdi_dir).unwrap(), vec!["uid-b".to_owned()]);
    assert!(running.spec("uid-b").is_some());
    drop(client);
    let _ = std::fs::remove_dir_all(running.stop().await);
}

#[test]
fn each_card_is_one_device_shared_by_percent_and_memory() {
    let mut cards = cards();
    cards[2].info.healthy = false;
    cards[2].info.numa = Some(1);
    cards[1].pci_address = Some("0000:3b:00.0".into());
    let slice = dra::slice::slice(NODE, "uid-node", 4, &cards);
    let slice = serde_json::to_value(&slice).unwrap();
    assert_eq!(slice["metadata"]["name"], "node-1-gpu.nano-gpu.io");
    assert_eq!(slice["metadata"]["ownerReferences"][0]["kind"], "Node");
    assert_eq!(slice["spec"]["driver"], "gpu.nano-gpu.io");
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(slice["spec"]["pool"], json!({"name": NODE, "generation": 4, "resourceSliceCount": 1}));
    let devices = slice["spec"]["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2"]);
    let a100 = &devices[1];
    assert_eq!(a100["allowMultipleAllocations"], true);
    assert_eq!(
        a100["capacity"]["percent"],
        json!({"value": "100", "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}})
    );
    // As the API server writes 81920Mi back.
    assert_eq!(
        a100["capacity"]["memory"],
        json!({"value": "80Gi", "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "80Gi", "step": "1Mi"}}})
    );
    assert_eq!(a100["attributes"]["uuid"], json!({"string": "GPU-bbbb"}));
    assert_eq!(a100["attributes"]["model"], json!({"string": "NVIDIA A100-SXM4-80GB"}));
    assert_eq!(a100["attributes"]["index"], json!({"int": 1}));
    assert_eq!(a100["attributes"]["memoryMiB"], json!({"int": 81920}));
    assert_eq!(a100["attributes"]["pciBusID"], json!({"string": "0000:3b:00.0"}));
    assert!(a100.get("taints").is_none());
    let t4 = &devices[2];
    assert_eq!(t4["capacity"]["memory"]["value"], "15Gi");
    assert_eq!(t4["attributes"]["numaNode"], json!({"int": 1}));
    assert_eq!(t4["taints"], json!([{"key": "gpu.nano-gpu.io/unhealthy", "effect": "NoSchedule"}]));
}

#[tokio::test]
async fn with_the_drivers_memory_limit_a_claims_pod_is_limited_before_its_spec_is_written() {
    let store = Store::default();
    let limits = Arc::new(Limits::default());
    let dir = std::env::temp_dir().join(format!("nano-gpu-dra-limit-{}", std::process::id()));
    let limit: Arc<dyn PodLimit> = limits.clone();
    let running = Running::start_as(dir, "", store.clone(), Edits::default(), Some(limit)).await;
    // Pod p uses three claims made for it: 30 % of gpu-0 asking 2 GiB, 20 % of gpu-0 asking no
    // memory (20 % of its 80 GiB by the one memory rule) and the whole gpu-1.
    store.add_pod("p", "uid-p", &["p-gpu", "p-more", "p-whole"]);
    let gpu = store.add_for(
        "p",
        "p-gpu",
        json!([result("gpu", "gpu-0", json!({"percent": "30", "memory": "2Gi"}))]),
    );
    store.add_for("p", "p-more", json!([result("gpu", "gpu-0", json!({"percent": "20"}))]));
    let whole = store.add_for("p", "p-whole", json!([result("gpu", "gpu-1", json!({}))]));
    // A claim anyone may name and join (made by hand, owned by no pod): a share is refused, a whole
    // card is not (it needs no limit).
    let shared = store.add("shared", json!([result("gpu", "gpu-2", json!({"percent": "10"}))]));
    let shared_whole = store.add("shared-whole", json!([result("gpu", "gpu-2", json!({}))]));
    // A pod whose cgroup is not there, and a claim whose pod was deleted and made again.
    store.add_pod("nocgroup", "uid-nocgroup", &["n-gpu"]);
    let nocgroup =
        store.add_for("nocgroup", "n-gpu", json!([result("gpu", "gpu-0", json!({"percent": "10"}))]));
    store.add_pod("again", "uid-again-2", &["a-gpu"]);
    let again = store.add_for("again", "a-gpu", json!([result("gpu", "gpu-0", json!({"percent": "10"}))]));
    // A claim made for pod q that another pod (naming it) was reserved for too.
    store.add_pod("q", "uid-q", &["q-gpu"]);
    let joined = store.add_for("q", "q-gpu", json!([result("gpu", "gpu-0", json!({"percent": "10"}))]));
    {
        let mut all = store.0.lock().unwrap();
        let status = all.get_mut(&("team-a".into(), "q-gpu".into())).unwrap().status.as_mut().unwrap();
        status.reserved_for = Some(
            serde_json::from_value(json!([
            {"resource": "pods", "name": "q", "uid": "uid-q"},
            {"resource": "pods", "name": "intruder", "uid": "uid-intruder"}]))
            .unwrap(),
        );
    }

    let mut client = running.client().await;
    let claims = vec![gpu, whole, shared, shared_whole, nocgroup, again, joined];
    let answer =
        client.node_prepare_resources(NodePrepareResourcesRequest { claims }).await.unwrap().into_inner();
    let error = |uid: &str| answer.claims[uid].error.clone();
    assert_eq!((error("uid-p-gpu"), error("uid-p-whole"), error("uid-shared-whole")), Default::default());
    assert!(error("uid-shared").contains("only a claim made for one pod"), "{}", error("uid-shared"));
    assert!(
        error("uid-n-gpu").contains("pod team-a/nocgroup: the driver's memory limit was not set: no cgroup")
    );
    assert!(error("uid-a-gpu").contains("pod team-a/again, which claim a-gpu was made for, is gone"));
    assert!(error("uid-q-gpu").contains("reserved for pods intruder too"), "{}", error("uid-q-gpu"));
    // The pod's limit on gpu-0 is what all its claims hold there; the whole card gets none.
    assert_eq!(*limits.0.lock().unwrap(), vec![("GPU-aaaa".to_owned(), "uid-p".to_owned(), 2048 + 16384)]);
    // One request reads each claim and pod once, however many of the pod's claims it prepares.
    let reads = store.2.lock().unwrap().clone();
    for read in ["claim p-gpu", "claim p-more", "claim p-whole", "pod p"] {
        assert_eq!(reads.iter().filter(|r| *r == read).count(), 1, "{read}: {reads:?}");
    }
    let mut written = cdi::prepared(&running.paths.cdi_dir).unwrap();
    written.sort();
    assert_eq!(written, vec!["uid-p-gpu", "uid-p-whole", "uid-shared-whole"], "a refused claim has no spec");
    drop(client);
    let _ = std::fs::remove_dir_all(running.stop().await);
}
