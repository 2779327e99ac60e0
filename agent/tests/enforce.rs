//! MPS enforcement end to end, without a GPU: `nano-gpu-agent mps-control` runs one daemon per card
//! (a stand-in for NVIDIA's `nvidia-cuda-mps-control`, written by the test, that records what it is
//! told), and the agent on a Node labelled `nano-gpu/enforcement=mps` (its flag says `none`: the
//! label wins) against a fake kubelet and a fake API server. A share gets its own MPS limits and its
//! card's pipe directory; a whole card none. A daemon killed is started again by the supervisor and
//! the pod with a share of that card is told; while no daemon runs, the cards are unhealthy.

use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, CardGrant};
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, Empty, ListAndWatchResponse,
};
use nano_gpu_proto::resources::GPU_PERCENT;
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_tests::fake_api::{FakeApi, Objects};
use nano_gpu_tests::fake_kubelet::{Allocated, FakeKubelet, two_t4_node};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

/// The stand-in for `nvidia-cuda-mps-control`: `-f` is the daemon (it writes its PID file where
/// NVIDIA's does and runs until it is told to quit); without `-f` it reads commands from its
/// input and passes `quit` on. Both record what they saw in `control.log` of the log directory.
/// Its name makes its `/proc/<pid>/comm` the real one's (`nvidia-cuda-mps`).
const STAND_IN: &str = r#"#!/bin/bash
pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
log=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
if [ "$1" = "-f" ]; then
  mkdir -p "$pipe" "$log"
  echo "start CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >> "$log/control.log"
  echo $$ > "$pipe/nvidia-cuda-mps-control.pid"
  trap 'rm -f "$pipe/nvidia-cuda-mps-control.pid"; exit 0' TERM
  while :; do sleep 0.1; done
fi
pid=$(cat "$pipe/nvidia-cuda-mps-control.pid" 2>/dev/null) || { echo "Cannot find MPS control daemon process"; exit 1; }
while read -r command; do
  echo "command $command" >> "$log/control.log"
  case "$command" in
    quit) kill -TERM "$pid" ;;
    get_server_list) cat "$pipe/server" 2>/dev/null ;;
    "start_server -uid 0") echo 4321 > "$pipe/server" ;;
  esac
done
"#;

fn ids(uuid: &str, range: std::ops::Range<u32>) -> Vec<String> {
    range.map(|n| device_id::encode(uuid, n)).collect()
}

fn pod(name: &str, percent: u32, uuid: &str, memory: Option<u64>) -> Value {
    let grant =
        CardGrant { uuid: uuid.into(), index: 0, percent: Percent(percent), memory_mib: memory.map(MiB) };
    let assignment =
        Assignment::new("n1", "2026-11-24T00:00:00Z", BTreeMap::from([("c".to_string(), vec![grant])]));
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "7",
                        "annotations": {ASSIGNMENT_ANNOTATION: assignment.encode()}},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {GPU_PERCENT: percent.to_string()}}}]}})
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

/// Card `uuid`'s pipe directory, as its supervisor names it for the agent.
fn pipe_of(root: &Path, uuid: &str) -> Option<std::path::PathBuf> {
    Some(std::fs::read_to_string(root.join(uuid).join("pipe-source")).ok()?.trim().into())
}

fn pid_of(root: &Path, uuid: &str) -> Option<u32> {
    std::fs::read_to_string(pipe_of(root, uuid)?.join("nvidia-cuda-mps-control.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn control_log(root: &Path, uuid: &str) -> String {
    std::fs::read_to_string(root.join(uuid).join("log/control.log")).unwrap_or_default()
}

/// Whether ListAndWatch sends a list where every device is `health` within 15 s.
async fn every_device(devices: &mut tonic::Streaming<ListAndWatchResponse>, health: &str) -> bool {
    let all = async {
        while let Some(update) = devices.message().await.unwrap() {
            if update.devices.iter().all(|d| d.health == health) {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(Duration::from_secs(15), all).await.unwrap_or(false)
}

/// `nano-gpu-agent mps-control` over the fake cards, with the stand-in, as `deploy/mps.yaml` runs it:
/// one supervisor per card index, each naming its own `/dev/shm` (here `<root>/../shm-N`).
fn supervisors(gpus: &Path, root: &Path, program: &Path) -> Vec<Child> {
    (0..2)
        .map(|index| {
            Command::new(env!("CARGO_BIN_EXE_nano-gpu-agent"))
                .arg("--fake-inventory")
                .arg(gpus)
                .arg("--mps-root")
                .arg(root)
                .arg("--mps-control")
                .arg(program)
                .arg(format!("--mps-card-index={index}"))
                .arg("--mps-shm-source")
                .arg(shm_of(root, index))
                // Its pipe directory of its own (on the host, where the container sees it).
                .arg("--mps-pipe-source")
                .arg(pipe_dir_of(root, index))
                .arg("--mps-pipe-dir")
                .arg(pipe_dir_of(root, index))
                .arg("mps-control")
                .spawn()
                .unwrap()
        })
        .collect()
}

/// The `/dev/shm` the supervisor of card `index` names.
fn shm_of(root: &Path, index: u32) -> std::path::PathBuf {
    root.parent().unwrap().join(format!("shm-{index}"))
}

/// The pipe directory of the supervisor of card `index`, beside its `/dev/shm` as a pod's volumes are.
fn pipe_dir_of(root: &Path, index: u32) -> std::path::PathBuf {
    root.parent().unwrap().join(format!("pipe-{index}"))
}

fn terminate(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_shares_get_their_limits_and_a_lost_daemon_is_restarted_and_told() {
    let (dir, gpus) = two_t4_node("enforce");
    let program = dir.join("bin/nvidia-cuda-mps-control");
    std::fs::create_dir_all(program.parent().unwrap()).unwrap();
    std::fs::write(&program, STAND_IN).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = dir.join("mps");

    // The daemons first (their own DaemonSet in deploy/): one per card, each told its card, each
    // card's by the supervisor of its index only.
    let mut daemons = supervisors(&gpus, &root, &program);
    eventually("both daemons", || pid_of(&root, "GPU-a").is_some() && pid_of(&root, "GPU-b").is_some()).await;
    for uuid in ["GPU-a", "GPU-b"] {
        let log = control_log(&root, uuid);
        assert_eq!(log.matches("start CUDA_VISIBLE_DEVICES=").count(), 1, "{uuid}: {log}");
        assert!(log.contains(&format!("start CUDA_VISIBLE_DEVICES={uuid}")), "{uuid}: {log}");
    }

    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": "n1", "labels": {"nano-gpu/enforcement": "mps"}}})],
        pods: vec![pod("shared", 30, "GPU-a", Some(2048)), pod("whole", 100, "GPU-b", None)],
        ..Objects::default()
    })
    .await
    .unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
    let mut fake = FakeKubelet::start(&dir).unwrap();
    let entry = |pod: &str, ids: &[String]| Allocated {
        namespace: "ns".into(),
        pod: pod.into(),
        container: "c".into(),
        resource: GPU_PERCENT.into(),
        ids: ids.to_vec(),
    };
    let mut agent = fake
        .agent(env!("CARGO_BIN_EXE_nano-gpu-agent").as_ref(), &gpus, &kubeconfig)
        .args(["--enforcement", "none", "--probe-listen", ""])
        .arg("--mps-root")
        .arg(&root)
        .spawn()
        .unwrap();
    fake.registered().await;
    let mut kubelet = fake.plugin().await;
    let mut devices = kubelet.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = devices.message().await.unwrap().unwrap();
    assert!(first.devices.iter().all(|d| d.health == "Healthy"), "both daemons run: every card is healthy");

    // A 30 % share with 2 GiB: its own MPS limits and its card's pipe directory; not the daemon's
    // /dev/shm (the container keeps its own).
    let allocate = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    fake.pod_resources.put(entry("shared", &[]));
    let got = kubelet.allocate(allocate(ids("GPU-a", 0..30))).await.unwrap().into_inner();
    let share = &got.container_responses[0];
    assert_eq!(share.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    assert_eq!(share.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=2048M");
    assert_eq!(share.envs["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/nvidia-mps");
    let mounts: Vec<(String, &str)> =
        share.mounts.iter().map(|m| (m.host_path.clone(), m.container_path.as_str())).collect();
    let pipe = pipe_of(&root, "GPU-a").unwrap();
    assert_eq!(pipe, pipe_dir_of(&root, 0), "the pipe directory is the supervisor's own");
    let pipe = pipe.display().to_string();
    assert_eq!(
        mounts,
        [("/dev/null".to_owned(), "/var/run/nvidia-container-devices/GPU-a"), (pipe, "/tmp/nvidia-mps"),]
    );
    // The supervisor still names its /dev/shm (the pipe directory is trusted beside it).
    let named = std::fs::read_to_string(root.join("GPU-a").join("shm-source")).unwrap();
    assert_eq!(named.trim(), shm_of(&root, 0).display().to_string());
    // A whole card bypasses MPS.
    fake.pod_resources.put(entry("shared", &ids("GPU-a", 0..30)));
    fake.pod_resources.put(entry("whole", &[]));
    let got = kubelet.allocate(allocate(ids("GPU-b", 0..100))).await.unwrap().into_inner();
    let whole = &got.container_responses[0];
    assert_eq!(whole.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
    assert!(
        whole.mounts.iter().all(|m| m.host_path == "/dev/null")
            && !whole.envs.keys().any(|k| k.starts_with("CUDA_MPS")),
        "{whole:?}"
    );

    // GPU-a's daemon dies: the supervisor starts it again, and the pod with a share there is told.
    let killed = pid_of(&root, "GPU-a").unwrap();
    assert!(Command::new("kill").args(["-KILL", &killed.to_string()]).status().unwrap().success());
    eventually("a new daemon on GPU-a", || pid_of(&root, "GPU-a").is_some_and(|p| p != killed)).await;
    let events = |api: &FakeApi| -> Vec<Value> {
        api.writes().into_iter().filter(|(_, p, _)| p.contains("/events")).map(|(_, _, b)| b).collect()
    };
    eventually("the MpsDaemonLost Event", || events(&api).iter().any(|e| e["reason"] == "MpsDaemonLost"))
        .await;
    let lost: Vec<Value> = events(&api).into_iter().filter(|e| e["reason"] == "MpsDaemonLost").collect();
    assert!(
        lost.iter().all(|e| e["regarding"]["name"] == "shared"),
        "only the share of GPU-a is told: {lost:?}"
    );
    assert!(lost[0]["note"].as_str().unwrap().contains("card GPU-a"), "{lost:?}");

    // The supervisors stop: each tells its daemon to quit, and no card takes a share while none runs.
    daemons.iter_mut().for_each(terminate);
    for uuid in ["GPU-a", "GPU-b"] {
        assert!(control_log(&root, uuid).contains("command quit"), "{uuid}: {}", control_log(&root, uuid));
        assert_eq!(pid_of(&root, uuid), None);
    }
    assert!(every_device(&mut devices, "Unhealthy").await, "the cards stayed healthy with no MPS daemon");
    // Back: healthy again.
    let mut daemons = supervisors(&gpus, &root, &program);
    assert!(
        every_device(&mut devices, "Healthy").await,
        "the cards stayed unhealthy with their daemons back"
    );

    terminate(&mut agent);
    daemons.iter_mut().for_each(terminate);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `mps-control --mps-exclusive-process` on the fake NVML: each card outside MIG mode goes to
/// `EXCLUSIVE_PROCESS` (the fake keeps the mode in a file every process reads), an MPS server is
/// started ahead of any client and again once none runs, the card is marked for the agent; at
/// SIGTERM the card is set back to `DEFAULT` and the mark removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_mps_holds_each_card_in_exclusive_process_mode_with_a_server_up() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-exclusive-mps-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (root, modes) = (dir.join("mps"), dir.join("modes.json"));
    let program = dir.join("bin/nvidia-cuda-mps-control");
    std::fs::create_dir_all(program.parent().unwrap()).unwrap();
    std::fs::write(&program, STAND_IN).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.join("nvml.json");
    let doc = json!({
        "cards": [{"uuid": "GPU-a", "name": "Tesla T4"}, {"uuid": "GPU-m", "name": "A100", "mig": true}],
        "computeModeFile": modes,
    });
    std::fs::write(&config, doc.to_string()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_nano-gpu-agent"))
        .arg("--nvml-lib")
        .arg(nano_gpu_tests::fake_nvml())
        .arg("--sysfs-root")
        .arg(dir.join("no-sysfs"))
        .arg("--mps-root")
        .arg(&root)
        .arg("--mps-control")
        .arg(&program)
        .arg("--mps-exclusive-process")
        .arg("mps-control")
        .env("FAKE_NVML_CONFIG", &config)
        .spawn()
        .unwrap();
    let mode = |uuid: &str| -> Option<u64> {
        let doc: Value = serde_json::from_slice(&std::fs::read(&modes).ok()?).ok()?;
        doc[uuid].as_u64()
    };
    let mark = root.join("GPU-a").join("exclusive-process");
    let server = root.join("GPU-a/pipe/server");
    eventually("GPU-a in EXCLUSIVE_PROCESS with a server and its mark", || {
        mode("GPU-a") == Some(3) && server.is_file() && mark.is_file()
    })
    .await;
    assert!(control_log(&root, "GPU-a").contains("command start_server -uid 0"));
    assert_eq!(mode("GPU-m"), None, "a card in MIG mode has no daemon and keeps its mode");
    // The server ends (its last client did, or someone shut it down): another is started.
    std::fs::remove_file(&server).unwrap();
    eventually("a new server", || server.is_file()).await;

    terminate(&mut child);
    assert_eq!(mode("GPU-a"), Some(0), "set back to DEFAULT");
    assert!(!mark.exists(), "the mark is removed");
    let _ = std::fs::remove_dir_all(&dir);
}
