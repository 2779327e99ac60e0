//! The agent's main loop against a fake kubelet over real unix sockets: registration, re-registration
//! after a kubelet restart (our socket deleted) within 2 s on a new socket, never the same endpoint
//! twice (a kubelet of 1.37 refuses one it holds), and refusals ending the agent with the kubelet's
//! reason; the two agents of a rollout side by side.

use nano_gpu_agent::cards::inventory::{FakeFile, GpuInventory};
use nano_gpu_agent::kubelet::register::{RunError, Timing};
use nano_gpu_agent::serve::run;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::registration_server::{Registration, RegistrationServer};
use nano_gpu_proto::kubelet::deviceplugin::{Empty, RegisterRequest};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Request, Response, Status};

/// Behaves as the kubelet's device manager does where it matters here: at start it deletes every
/// socket in the directory; a registration dials the plugin's endpoint back before it answers and
/// holds the endpoint while its ListAndWatch stream lasts, refusing it meanwhile as 1.37 does
/// ("device plugin already connected").
struct FakeKubelet {
    dir: PathBuf,
    seen: mpsc::UnboundedSender<RegisterRequest>,
    /// How many registrations to refuse before accepting (`u32::MAX`: all).
    refuse: AtomicU32,
    /// The endpoints whose streams are open.
    held: Arc<Mutex<HashSet<String>>>,
}

#[tonic::async_trait]
impl Registration for FakeKubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        let _ = self.seen.send(request.clone());
        let left = self.refuse.load(Ordering::SeqCst);
        if left > 0 {
            if left != u32::MAX {
                self.refuse.store(left - 1, Ordering::SeqCst);
            }
            return Err(Status::invalid_argument("resource nano-gpu/gpu-percent is already registered"));
        }
        let path = self.dir.join(&request.endpoint);
        if self.held.lock().unwrap().contains(&request.endpoint) {
            return Err(Status::unknown(format!("device plugin already connected: {}", path.display())));
        }
        let channel = nano_gpu_runtime::unix_channel(path)
            .await
            .map_err(|e| Status::unknown(format!("failed to dial device plugin: {e}")))?;
        let mut stream = DevicePluginClient::new(channel)
            .list_and_watch(Empty {})
            .await
            .map_err(|e| Status::unknown(format!("ListAndWatch: {e}")))?
            .into_inner();
        self.held.lock().unwrap().insert(request.endpoint.clone());
        let held = self.held.clone();
        tokio::spawn(async move {
            while let Ok(Some(_)) = stream.message().await {}
            held.lock().unwrap().remove(&request.endpoint);
        });
        Ok(Response::new(Empty {}))
    }
}

type Started = (mpsc::UnboundedReceiver<RegisterRequest>, oneshot::Sender<()>);

/// Starts a fake kubelet on `dir/kubelet.sock`; dropping the returned sender stops it.
fn kubelet(dir: &Path, refuse: u32) -> Started {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".sock") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    kubelet_holding(dir, refuse, &[])
}

/// [`kubelet`] without its start's deletions (a plugin served again after them), holding
/// `held` endpoints already (one whose end it missed).
fn kubelet_holding(dir: &Path, refuse: u32, held: &[&str]) -> Started {
    let path = dir.join("kubelet.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let (seen, registrations) = mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(FakeKubelet {
                dir: dir.to_owned(),
                seen,
                refuse: AtomicU32::new(refuse),
                held: Arc::new(Mutex::new(held.iter().map(|e| e.to_string()).collect())),
            }))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
                stopped.await.unwrap_or(())
            }),
    );
    (registrations, stop)
}

fn setup(name: &str) -> (PathBuf, Vec<Box<dyn GpuInventory>>) {
    let dir = std::env::temp_dir().join(format!("nano-gpu-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let gpus = dir.join("gpus.json");
    std::fs::write(&gpus, r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"Tesla T4","memoryMiB":15360,"healthy":true}]}"#).unwrap();
    (dir, vec![Box::new(FakeFile { path: gpus })])
}

const TIMING: Timing = Timing {
    check: Duration::from_millis(100),
    refresh: Duration::from_secs(60),
    max_backoff: Duration::from_millis(400),
};

/// The agent's loop over `dir`, as the binary runs it (no NVML health, no publishing).
fn agent(
    dir: PathBuf,
    backends: Vec<Box<dyn GpuInventory>>,
    stopped: watch::Receiver<bool>,
) -> impl std::future::Future<Output = Result<(), RunError>> {
    agent_named(dir, "", backends, stopped)
}

/// [`agent`] as agent `instance` of the node.
fn agent_named(
    dir: PathBuf,
    instance: &str,
    backends: Vec<Box<dyn GpuInventory>>,
    stopped: watch::Receiver<bool>,
) -> impl std::future::Future<Output = Result<(), RunError>> {
    let instance = instance.to_owned();
    agent_with(dir, backends, stopped, move |a| a.instance = instance)
}

/// [`agent`] with `change` made to it.
fn agent_with(
    dir: PathBuf,
    backends: Vec<Box<dyn GpuInventory>>,
    stopped: watch::Receiver<bool>,
    change: impl FnOnce(&mut run::Agent),
) -> impl std::future::Future<Output = Result<(), RunError>> {
    let health = std::sync::Arc::new(nano_gpu_agent::cards::health::Health::new(Duration::from_secs(300)));
    let mut agent = run::Agent {
        plugin_dir: dir,
        backend_dir: None,
        instance: String::new(),
        backends,
        timing: TIMING,
        edits: Default::default(),
        health,
        publisher: None,
        plugins: vec![(nano_gpu_agent::cards::resource::Resource::Percent, None)],
        readiness: Default::default(),
        usage: None,
        told: None,
        sweep: None,
        allocatable: None,
        dra: None,
        tasks: Default::default(),
    };
    change(&mut agent);
    run::run(agent, stopped)
}

async fn within(limit: Duration, rx: &mut mpsc::UnboundedReceiver<RegisterRequest>) -> RegisterRequest {
    tokio::time::timeout(limit, rx.recv()).await.expect("registered in time").expect("kubelet alive")
}

type Running = tokio::task::JoinHandle<Result<(), RunError>>;

/// No registration in a second (many times the agent's check and its backoff), the agent running.
async fn registers_no_more(rx: &mut mpsc::UnboundedReceiver<RegisterRequest>, agent: &Running) {
    let more = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
    assert!(more.is_err(), "registered again: {more:?}");
    assert!(!agent.is_finished(), "the agent ended");
}

/// Stops the agent, which must end well within 5 s.
async fn stop(shutdown: watch::Sender<bool>, agent: Running) {
    shutdown.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(5), agent).await.unwrap().unwrap().unwrap();
}

/// The plugin sockets in `dir`.
fn sockets(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("nano-gpu"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_registers_again_within_2_s_after_a_kubelet_restart() {
    let (dir, backends) = setup("restart");
    let (mut first, stop_first) = kubelet(&dir, 0);
    let (shutdown, stopped) = watch::channel(false);
    let agent = tokio::spawn(agent(dir.clone(), backends, stopped));
    let r = within(Duration::from_secs(10), &mut first).await;
    assert_eq!((r.endpoint.as_str(), r.resource_name.as_str()), ("nano-gpu.sock", "nano-gpu/gpu-percent"));

    // A new kubelet deletes every socket in the directory, ours included, and makes kubelet.sock
    // anew: the agent registers with it on a new socket.
    stop_first.send(()).unwrap();
    let (mut second, _keep) = kubelet(&dir, 0);
    let again = within(Duration::from_secs(2), &mut second).await;
    assert_eq!(again.endpoint, "nano-gpu.1.sock");

    // Our socket deleted (by a kubelet starting): served and registered again, on a name the
    // kubelet may not still hold.
    std::fs::remove_file(dir.join(&again.endpoint)).unwrap();
    let third = within(Duration::from_secs(2), &mut second).await;
    assert_eq!(third.endpoint, "nano-gpu.2.sock");
    assert!(dir.join(&third.endpoint).exists());
    assert!(!dir.join(&again.endpoint).exists() && !dir.join("nano-gpu.sock").exists());

    stop(shutdown, agent).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_waits_for_a_kubelet_that_is_not_there_yet() {
    let (dir, backends) = setup("late");
    let (shutdown, stopped) = watch::channel(false);
    let agent = tokio::spawn(agent(dir.clone(), backends, stopped));
    // The agent is up (its socket answers) before any kubelet exists.
    while !dir.join("nano-gpu.sock").exists() {
        tokio::task::yield_now().await;
    }
    // The kubelet starts and deletes the agent's socket: the agent serves again and registers.
    let (mut late, _keep) = kubelet(&dir, 0);
    let registered = within(Duration::from_secs(5), &mut late).await;
    assert!(dir.join(&registered.endpoint).exists(), "the agent serves on the socket it registered");
    stop(shutdown, agent).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The soak's node-1, in CI: the restarted kubelet deleted the agent's socket, the agent served it
/// again before the kubelet listened (its socket not there yet), and once registered took the
/// kubelet's new socket for another restart. It registered the same endpoint again, which the
/// kubelet (1.37) refused as already connected and then held for good: the agent ended, and its
/// restarts were refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_listens_after_the_agent_serves_is_registered_with_once() {
    let (dir, backends) = setup("listens-after");
    let (shutdown, stopped) = watch::channel(false);
    let agent = tokio::spawn(agent(dir.clone(), backends, stopped));
    while !dir.join("nano-gpu.sock").exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The agent has tried and found no kubelet; then one listens, leaving the agent's socket.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (mut seen, _keep) = kubelet_holding(&dir, 0, &[]);
    assert_eq!(within(Duration::from_secs(5), &mut seen).await.endpoint, "nano-gpu.sock");
    registers_no_more(&mut seen, &agent).await;
    stop(shutdown, agent).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A kubelet that holds the agent's endpoint (its stream's end missed, as 1.37 does after refusing
/// that endpoint once) refuses it: the agent registers on a new socket and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_the_kubelet_refuses_as_connected_is_replaced_by_a_new_one() {
    let (dir, backends) = setup("held");
    let (mut seen, _keep) = kubelet_holding(&dir, 0, &["nano-gpu.sock"]);
    let (shutdown, stopped) = watch::channel(false);
    let agent = tokio::spawn(agent(dir.clone(), backends, stopped));
    assert_eq!(within(Duration::from_secs(5), &mut seen).await.endpoint, "nano-gpu.sock");
    assert_eq!(within(Duration::from_secs(5), &mut seen).await.endpoint, "nano-gpu.1.sock");
    registers_no_more(&mut seen, &agent).await;
    stop(shutdown, agent).await;
    assert_eq!(sockets(&dir), Vec::<String>::new(), "sockets left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_that_fails_once_is_retried_not_taken_for_a_refusal() {
    let (dir, backends) = setup("once");
    let (mut seen, _keep) = kubelet(&dir, 1);
    let (shutdown, stopped) = watch::channel(false);
    let agent = tokio::spawn(agent(dir.clone(), backends, stopped));
    within(Duration::from_secs(5), &mut seen).await;
    within(Duration::from_secs(5), &mut seen).await;
    stop(shutdown, agent).await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_stops_the_agent_with_the_reason() {
    let (dir, backends) = setup("refused");
    let (_seen, _keep) = kubelet(&dir, u32::MAX);
    let (_shutdown, stopped) = watch::channel(false);
    let result =
        tokio::time::timeout(Duration::from_secs(10), agent(dir.clone(), backends, stopped)).await.unwrap();
    match result {
        Err(RunError::Refused(reason)) => assert!(reason.contains("already registered"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_task_that_ends_stops_the_agent_with_its_name() {
    // The checkpoint sweep follows the node's pods; their watch gone, it ends, and so does the
    // loop (the keeper starts the agent again), instead of serving on without it.
    let (dir, backends) = setup("task-ended");
    let (mut seen, _keep) = kubelet(&dir, 0);
    let (_shutdown, stopped) = watch::channel(false);
    let (pods, residents) = watch::channel(nano_gpu_agent::node::pods::Residents::default());
    let lister =
        Arc::new(nano_gpu_agent::node::podresources::PodResourcesSocket::new(dir.join("pod-resources.sock")));
    let sweep = nano_gpu_agent::kubelet::checkpoint::Sweep::new(
        dir.join("kubelet_internal_checkpoint"),
        vec!["nano-gpu/gpu-percent"],
        residents,
        lister,
    );
    let running = tokio::spawn(agent_with(dir.clone(), backends, stopped, |a| a.sweep = Some(sweep)));
    within(Duration::from_secs(5), &mut seen).await;
    assert!(!running.is_finished(), "the agent stopped while its tasks ran");
    drop(pods);
    let result = tokio::time::timeout(Duration::from_secs(5), running).await.unwrap().unwrap();
    match result {
        Err(RunError::Task(why)) => assert!(why.contains("\"checkpoint sweep\" ended"), "{why}"),
        other => panic!("expected the task's end, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_the_caller_started_that_panics_stops_the_agent_with_its_name() {
    // The binary starts the Node and pod watches, the repair worker, the probes and the canary
    // before the loop, in the tasks it hands the loop: a panic in one of them ends the agent.
    let (dir, backends) = setup("caller-task");
    let (mut seen, _keep) = kubelet(&dir, 0);
    let (_shutdown, stopped) = watch::channel(false);
    let (panic_now, mut told) = watch::channel(false);
    let running = tokio::spawn(agent_with(dir.clone(), backends, stopped, |a| {
        a.tasks.spawn("pod watch", async move {
            let _ = told.wait_for(|now| *now).await;
            panic!("the pod stream broke");
        })
    }));
    within(Duration::from_secs(5), &mut seen).await;
    assert!(!running.is_finished(), "the agent stopped while its tasks ran");
    panic_now.send(true).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), running).await.unwrap().unwrap();
    match result {
        Err(RunError::Task(why)) => {
            assert!(why.contains("\"pod watch\" panicked: the pod stream broke"), "{why}")
        }
        other => panic!("expected the task's panic, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_agent_of_a_rollout_serves_before_the_old_one_stops_and_sends_its_devices_again_after() {
    let (dir, backends) = setup("rollout");
    // A socket left by an agent that was killed: nobody serves it.
    drop(std::os::unix::net::UnixListener::bind(dir.join("nano-gpu.dead.sock")).unwrap());
    let (mut seen, _keep) = kubelet(&dir, 0);
    let (stop_old, stopped) = watch::channel(false);
    let old = tokio::spawn(agent_named(dir.clone(), "old", backends, stopped));
    assert_eq!(within(Duration::from_secs(10), &mut seen).await.endpoint, "nano-gpu.old.sock");
    assert!(!dir.join("nano-gpu.dead.sock").exists(), "a socket nobody serves is removed");

    // The new agent starts while the old one serves: both serve, on their own sockets.
    let (new_dir, backends) = setup("rollout-new");
    let (stop_new, stopped) = watch::channel(false);
    let new = tokio::spawn(agent_named(dir.clone(), "new", backends, stopped));
    assert_eq!(within(Duration::from_secs(10), &mut seen).await.endpoint, "nano-gpu.new.sock");
    assert!(dir.join("nano-gpu.old.sock").exists(), "the new agent leaves a served socket alone");

    // The kubelet's stream from the new agent; the old agent stops and removes its socket: the new
    // one sends its devices again and registers anew on a new socket (a kubelet before 1.36 marked
    // them unhealthy and its endpoint stopped at the old one's exit), serving the first one on.
    let channel = nano_gpu_runtime::unix_channel(dir.join("nano-gpu.new.sock")).await.unwrap();
    let mut stream = DevicePluginClient::new(channel).list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 100);
    stop(stop_old, old).await;
    assert!(!dir.join("nano-gpu.old.sock").exists(), "a stopped agent leaves no socket behind");
    let again =
        tokio::time::timeout(Duration::from_secs(2), stream.message()).await.expect("sent again within 2 s");
    assert_eq!(again.unwrap().unwrap().devices.len(), 100);
    // Registered anew on a new socket, and once more 100 ms and a second later (a kubelet that took
    // the old agent's exit after the one before stamped it stopped), each a fresh endpoint.
    assert_eq!(within(Duration::from_secs(2), &mut seen).await.endpoint, "nano-gpu.new.1.sock");
    assert_eq!(within(Duration::from_secs(1), &mut seen).await.endpoint, "nano-gpu.new.2.sock");
    assert_eq!(within(Duration::from_secs(3), &mut seen).await.endpoint, "nano-gpu.new.3.sock");
    registers_no_more(&mut seen, &new).await;
    assert!(dir.join("nano-gpu.new.sock").exists(), "the first sockets stay served");

    stop(stop_new, new).await;
    assert_eq!(sockets(&dir), Vec::<String>::new(), "sockets left behind");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&new_dir).unwrap();
}
