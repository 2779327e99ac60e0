//! The keeper against a fake kubelet, with the real agent binary serving for it in a directory of
//! its own: the agent is killed (SIGKILL, as a crash) while the kubelet holds its device stream, and
//! an Allocate the kubelet makes meanwhile waits for the agent's next start and then gets what the
//! agent answers; the kubelet's stream neither ends nor turns unhealthy while the agent is away for
//! less than the patience. The keeper runs the agent and starts it again itself (the kubelet, waiting
//! on the held call, would not). With a keeper run in the test's process and the agent started
//! beside it, an agent that stays away past the patience: the call fails with the reason and the
//! devices turn unhealthy, until the agent serves again.

use nano_gpu_agent::cards::resource::Resource;
use nano_gpu_agent::kubelet::keeper::{Keeper, keep};
use nano_gpu_agent::kubelet::register::Timing;
use nano_gpu_proto::device_id;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, Empty, ListAndWatchResponse,
};
use nano_gpu_proto::kubelet::{HEALTHY, UNHEALTHY};
use nano_gpu_tests::fake_kubelet::{FakeKubelet, two_t4_node};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tonic::Streaming;

const AGENT: &str = env!("CARGO_BIN_EXE_nano-gpu-agent");

/// The agent serving its plugins in `backend` for a keeper, on the cards of `gpus`.
fn agent(backend: &Path, gpus: &Path) -> Child {
    Command::new(AGENT)
        .arg("--backend-dir")
        .arg(backend)
        .arg("--fake-inventory")
        .arg(gpus)
        .args(["--probe-listen", "", "--usage-seconds", "0"])
        .spawn()
        .expect("starting the agent")
}

/// The keeper binary of `backend` registering with `kubelet` and running the agent on the cards of
/// `gpus`, holding calls for 20 s.
fn keeper(kubelet: &FakeKubelet, backend: &Path, gpus: &Path) -> Child {
    Command::new(AGENT)
        .arg("--plugin-dir")
        .arg(&kubelet.plugin_dir)
        .arg("--backend-dir")
        .arg(backend)
        .arg("--fake-inventory")
        .arg(gpus)
        .args(["--probe-listen", "", "--usage-seconds", "0", "--keeper-patience-seconds", "20", "keeper"])
        .spawn()
        .expect("starting the keeper")
}

/// A keeper in this process for an agent the test starts beside it (in `backend`), registering
/// with `kubelet`, holding calls for `patience_s` seconds; it stops when the sender goes.
fn keeper_beside(kubelet: &FakeKubelet, backend: &Path, patience_s: u64) -> watch::Sender<bool> {
    let keeper = Keeper {
        plugin_dir: kubelet.plugin_dir.clone(),
        backend: backend.to_owned(),
        instance: String::new(),
        resources: vec![Resource::Percent],
        patience: Duration::from_secs(patience_s),
        timing: Timing::default(),
        agent: None,
    };
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(keep(keeper, stopped));
    stop
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    nano_gpu_tests::pids().into_iter().filter(|p| nano_gpu_tests::parent_pid(*p) == Some(pid)).collect()
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn allocate_request() -> AllocateRequest {
    let ids = (0..30).map(|n| device_id::encode("GPU-a", n)).collect();
    AllocateRequest { container_requests: vec![ContainerAllocateRequest { devices_ids: ids }] }
}

/// The next list on the kubelet's stream within `within`, or `None` when none came.
async fn next_list(
    stream: &mut Streaming<ListAndWatchResponse>,
    within: Duration,
) -> Option<ListAndWatchResponse> {
    match tokio::time::timeout(within, stream.message()).await {
        Ok(Ok(Some(list))) => Some(list),
        Ok(other) => panic!("the kubelet's device stream ended: {other:?}"),
        Err(_) => None,
    }
}

fn all(list: &ListAndWatchResponse, health: &str) -> bool {
    list.devices.len() == 200 && list.devices.iter().all(|d| d.health == health)
}

struct Node {
    dir: PathBuf,
    gpus: PathBuf,
    backend: PathBuf,
    kubelet: FakeKubelet,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn node(name: &str) -> Node {
    let (dir, gpus) = two_t4_node(name);
    let backend = dir.join("backend");
    std::fs::create_dir_all(&backend).unwrap();
    let kubelet = FakeKubelet::start(&dir).unwrap();
    Node { dir, gpus, backend, kubelet }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_while_the_agent_restarts_waits_for_it_and_the_devices_stay_healthy() {
    let mut n = node("keeper-restart").await;
    let _keeper = keeper_beside(&n.kubelet, &n.backend, 20);
    // The keeper registers only once the agent serves.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(n.kubelet.registrations.try_recv().is_err(), "registered before the agent served");
    let mut first = agent(&n.backend, &n.gpus);
    let registration = n.kubelet.registered().await;
    assert_eq!(registration.endpoint, "nano-gpu.sock");
    let mut plugin = n.kubelet.plugin().await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    let list = next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices");
    assert!(all(&list, HEALTHY), "{list:?}");
    assert!(plugin.allocate(allocate_request()).await.is_ok());

    // A crash: the kubelet's stream stays, and an Allocate made now waits for the next agent.
    kill(&mut first);
    let mut client: DevicePluginClient<_> = plugin.clone();
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        (client.allocate(allocate_request()).await, started.elapsed())
    });
    let away = next_list(&mut stream, Duration::from_secs(2)).await;
    assert!(away.is_none(), "a list while the agent was away: {away:?}");
    assert!(!waiting.is_finished(), "the Allocate did not wait for the agent");
    let mut second = agent(&n.backend, &n.gpus);
    let (answer, waited) = waiting.await.unwrap();
    let answer = answer.expect("the Allocate, answered by the agent's next start").into_inner();
    let envs = &answer.container_responses[0].envs;
    assert_eq!(envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-a"), "{envs:?}");
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    // The next agent's devices come on the same stream.
    let list = next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices again");
    assert!(all(&list, HEALTHY), "{list:?}");
    assert!(n.kubelet.registrations.try_recv().is_err(), "the keeper registered again");

    kill(&mut second);
    let _ = std::fs::remove_dir_all(&n.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_away_past_the_patience_fails_the_call_and_its_devices_turn_unhealthy() {
    let mut n = node("keeper-away").await;
    let _keeper = keeper_beside(&n.kubelet, &n.backend, 2);
    let mut first = agent(&n.backend, &n.gpus);
    n.kubelet.registered().await;
    let mut plugin = n.kubelet.plugin().await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices");

    kill(&mut first);
    let started = Instant::now();
    let refused = plugin.allocate(allocate_request()).await.expect_err("an Allocate with no agent");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("the agent did not answer Allocate within 2 s"),
        "{}",
        refused.message()
    );
    assert!(started.elapsed() >= Duration::from_secs(2), "{:?}", started.elapsed());
    let list = next_list(&mut stream, Duration::from_secs(5)).await.expect("the devices marked unhealthy");
    assert!(all(&list, UNHEALTHY), "{list:?}");

    let mut second = agent(&n.backend, &n.gpus);
    let list = next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices again");
    assert!(all(&list, HEALTHY), "{list:?}");
    assert!(plugin.allocate(allocate_request()).await.is_ok());

    kill(&mut second);
    let _ = std::fs::remove_dir_all(&n.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keeper_starts_a_crashed_agent_again_and_the_held_allocate_gets_its_answer() {
    let mut n = node("keeper-runs").await;
    let mut keeper = keeper(&n.kubelet, &n.backend, &n.gpus);
    n.kubelet.registered().await;
    let mut plugin = n.kubelet.plugin().await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    let list = next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices");
    assert!(all(&list, HEALTHY), "{list:?}");
    let agents = children(keeper.id());
    assert_eq!(agents.len(), 1, "the keeper's agent: {agents:?}");

    // The agent crashes; nobody but the keeper starts it again.
    let killed = Command::new("kill").args(["-KILL", &agents[0].to_string()]).status().unwrap();
    assert!(killed.success());
    let started = Instant::now();
    let answer = plugin.allocate(allocate_request()).await.expect("the Allocate, held for the next agent");
    let envs = &answer.into_inner().container_responses[0].envs;
    assert_eq!(envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-a"), "{envs:?}");
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    let now = children(keeper.id());
    assert!(now.len() == 1 && now[0] != agents[0], "a new agent: {agents:?} then {now:?}");
    let list = next_list(&mut stream, Duration::from_secs(10)).await.expect("the devices again");
    assert!(all(&list, HEALTHY), "{list:?}");
    assert!(n.kubelet.registrations.try_recv().is_err(), "the keeper registered again");

    // SIGTERM: the keeper stops its agent and removes its socket.
    assert!(Command::new("kill").args(["-TERM", &keeper.id().to_string()]).status().unwrap().success());
    let stopped = keeper.wait().unwrap();
    assert!(stopped.success(), "{stopped:?}");
    assert!(children(keeper.id()).is_empty());
    assert!(!n.kubelet.plugin_dir.join("nano-gpu.sock").exists());
    let _ = std::fs::remove_dir_all(&n.dir);
}
