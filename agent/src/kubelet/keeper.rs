//! The keeper: the kubelet's side of the agent's device plugins, and the agent's parent process, so
//! that an agent that crashes does not fail the pods the kubelet admits meanwhile.
//!
//! A kubelet whose plugin's stream ends marks every device of the resource unhealthy at once, and
//! fails each pod it admits until a plugin registers again (`UnexpectedAdmissionError`, final for a
//! bare pod); the allocator stops placing on the node only when the kubelet reports the agent's pod
//! not Ready, a second or two later. With the keeper (`nano-gpu-agent keeper`, the DaemonSet's
//! command), the agent runs as the keeper's child and serves its plugins on sockets in a directory
//! of its own (`--backend-dir`); the keeper starts it again whenever it exits (a crash, an OOM kill,
//! a segfault in the driver's library), registers with the kubelet what it serves (the same loop as
//! the agent's own, [`crate::kubelet::register::serve_and_register`]: kubelet restarts and rollouts alike), and
//! relays:
//! - ListAndWatch: the agent's device lists as they come; while the agent is away the kubelet's
//!   stream stays open with the last list, marked unhealthy only once the agent has been away for
//!   the keeper's patience;
//! - GetPreferredAllocation, Allocate and PreStartContainer: passed on, and held while the agent does
//!   not serve (tried again every [`RETRY`]) for up to the patience, then failed with the reason; what
//!   the agent answers itself, errors included, goes back as it is.
//!
//! The agent must come back without the kubelet: while the kubelet waits on a held call it admits
//! nothing else and restarts no container (one loop does both). That is why the keeper is the
//! agent's parent rather than a container beside it. It holds no state of its own: a restarted agent
//! answers as the agent does after any restart.

pub mod memory;

use crate::cards::resource::Resource;
use crate::kubelet::plugin;
use crate::kubelet::register::{self, RunError, Served, Serving, Timing};
use crate::node::probe::Readiness;
use nano_gpu_proto::kubelet::UNHEALTHY;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_client::DevicePluginClient;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::DevicePlugin;
use nano_gpu_proto::kubelet::deviceplugin::{
    AllocateRequest, AllocateResponse, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use rustix::process::{Pid, Signal, kill_process};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// How often an absent agent is tried again.
pub const RETRY: Duration = Duration::from_millis(50);

/// What the keeper runs with.
#[derive(Clone, Debug)]
pub struct Keeper {
    /// The kubelet's device-plugin directory.
    pub plugin_dir: PathBuf,
    /// Where the agent serves (`<stem>.sock` per resource).
    pub backend: PathBuf,
    /// Names the keeper's sockets, as the agent's own would be named (its pod's name).
    pub instance: String,
    /// The resources the agent serves (its flags are the keeper's).
    pub resources: Vec<Resource>,
    /// How long a call is held, and the devices kept healthy, while the agent does not serve.
    pub patience: Duration,
    /// Timing of the registration loop.
    pub timing: Timing,
    /// The agent to run and start again whenever it exits (`None`: one runs beside the keeper).
    pub agent: Option<AgentProcess>,
}

/// How the keeper starts the agent.
#[derive(Clone, Debug)]
pub struct AgentProcess {
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<std::ffi::OsString>,
    /// The container's memory limit, under which the agent is stopped and started again (`None`:
    /// its memory is not watched); see [`memory`].
    pub memory: Option<memory::Guard>,
}

/// The first wait before starting an agent that exited again; it doubles up to [`RESTART_MOST`],
/// and starts over once an agent ran for [`RESTART_RESET`].
const RESTART_FIRST: Duration = Duration::from_millis(100);
const RESTART_MOST: Duration = Duration::from_secs(10);
const RESTART_RESET: Duration = Duration::from_secs(60);

/// How long a stopping agent has to end before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Resolves once `shutdown` says stop.
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Runs `agent`, starting it again whenever it exits, until `shutdown`; then stops it (SIGTERM,
/// SIGKILL after [`STOP_GRACE`]).
async fn supervise(agent: AgentProcess, mut shutdown: watch::Receiver<bool>) {
    match agent.memory {
        Some(g) => tracing::info!(
            "the container's memory limit is {} MiB: the agent is killed and started again before it holds \
             all but {} MiB of it beside the keeper",
            g.limit >> 20,
            g.margin() >> 20
        ),
        None => tracing::info!(
            "the container has no memory limit (or no cgroup v2): the agent's memory is not watched"
        ),
    }
    let mut backoff = RESTART_FIRST;
    loop {
        let started = tokio::time::Instant::now();
        let spawned =
            tokio::process::Command::new(&agent.program).args(&agent.args).kill_on_drop(true).spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                tracing::error!(program = %agent.program.display(), error = %e, "the agent did not start");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping(&mut shutdown) => return,
                }
                backoff = (backoff * 2).min(RESTART_MOST);
                continue;
            }
        };
        tracing::info!(pid = child.id(), "agent started");
        let pid = child.id();
        tokio::select! {
            (holds, ceiling) = over_ceiling(pid, agent.memory) => {
                tracing::warn!(
                    "the agent holds {} MiB, over its ceiling of {} MiB (the container's limit less the keeper's \
                     memory and a margin): killed before the kernel's OOM killer ends the whole container; \
                     starting it again in {backoff:?}",
                    holds >> 20,
                    ceiling >> 20
                );
                let _ = child.kill().await;
                if started.elapsed() >= RESTART_RESET {
                    backoff = RESTART_FIRST;
                }
            }
            status = child.wait() => {
                if started.elapsed() >= RESTART_RESET {
                    backoff = RESTART_FIRST;
                }
                match status {
                    // It asked to be started again (its node's enforcement mode changed).
                    Ok(s) if s.success() => tracing::info!("the agent stopped; starting it again in {backoff:?}"),
                    Ok(s) => tracing::warn!(status = %s, "the agent exited; starting it again in {backoff:?}"),
                    Err(e) => tracing::warn!(error = %e, "the agent cannot be waited on; starting it again in {backoff:?}"),
                }
            }
            _ = stopping(&mut shutdown) => {
                let pid = child.id().and_then(|p| i32::try_from(p).ok()).and_then(Pid::from_raw);
                if let Some(pid) = pid {
                    let _ = kill_process(pid, Signal::TERM);
                }
                if tokio::time::timeout(STOP_GRACE, child.wait()).await.is_err() {
                    tracing::warn!("the agent did not stop within {STOP_GRACE:?}; killed");
                    let _ = child.kill().await;
                }
                return;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopping(&mut shutdown) => return,
        }
        backoff = (backoff * 2).min(RESTART_MOST);
    }
}

/// Resolves once the agent `pid` holds more memory than `guard` leaves it beside the keeper's own:
/// what it holds, and its ceiling then. Never, without a guard.
async fn over_ceiling(pid: Option<u32>, guard: Option<memory::Guard>) -> (u64, u64) {
    let (Some(pid), Some(guard)) = (pid, guard) else { return std::future::pending().await };
    loop {
        tokio::time::sleep(guard.period).await;
        let keeper = memory::held(std::process::id()).unwrap_or(0);
        let ceiling = guard.ceiling(keeper);
        if let Some(holds) = memory::held(pid).filter(|&h| h > ceiling) {
            return (holds, ceiling);
        }
    }
}

/// Runs the agent (if it has one to run) and waits for it to serve, then registers its resources
/// and relays until `shutdown` (or the kubelet refuses). At a shutdown the agent is stopped first and
/// the kubelet's calls are relayed until it has gone: it serves the pods bound to the node that
/// still wait for their devices before it stops (`crate::serve::run`'s drain), which the kubelet would fail
/// once the keeper's sockets are gone. Then the keeper's socket files go.
pub async fn keep(keeper: Keeper, mut shutdown: watch::Receiver<bool>) -> Result<(), RunError> {
    let Keeper { plugin_dir, backend, instance, resources, patience, timing, agent } = keeper;
    // The agent runs until the keeper ends, however it ends.
    let (stop_agent, agent_stop) = watch::channel(false);
    let mut supervised = agent.map(|agent| tokio::spawn(supervise(agent, agent_stop)));
    let (stop_relay, mut relaying) = watch::channel(false);
    let relayed = relay(&plugin_dir, &backend, &instance, &resources, patience, timing, &mut relaying);
    tokio::pin!(relayed);
    let mut agent_gone = false;
    let result = tokio::select! {
        // The kubelet refused, or the relay broke.
        result = &mut relayed => result,
        () = stopping(&mut shutdown) => {
            let _ = stop_agent.send(true);
            let stopped = async {
                if let Some(supervised) = supervised.as_mut() {
                    let _ = supervised.await;
                }
            };
            tokio::select! {
                result = &mut relayed => result,
                () = stopped => {
                    agent_gone = true;
                    let _ = stop_relay.send(true);
                    relayed.await
                }
            }
        }
    };
    let _ = stop_agent.send(true);
    if let Some(supervised) = supervised.filter(|_| !agent_gone) {
        let _ = supervised.await;
    }
    result
}

/// [`keep`] but the agent's process.
async fn relay(
    plugin_dir: &std::path::Path,
    backend: &std::path::Path,
    instance: &str,
    resources: &[Resource],
    patience: Duration,
    timing: Timing,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), RunError> {
    // Registering before the agent serves would show the kubelet no device at all.
    let mut said = false;
    for resource in resources {
        let socket = backend.join(resource.socket(""));
        while !crate::kubelet::plugin::socket::is_served(&socket).await {
            if !said {
                tracing::info!(dir = %backend.display(), "waiting for the agent to serve");
                said = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = stopping(shutdown) => return Ok(()),
            }
        }
    }
    let (again, _) = watch::channel(());
    let relays = Relays { backend: backend.to_owned(), patience, again };
    register::remove_dead_sockets(plugin_dir, resources).await;
    let readiness = Arc::new(Readiness::default());
    let serving = Serving { resources, served: &relays, instance, plugin_dir, timing, readiness: &readiness };
    let result = register::serve_and_register(serving, shutdown).await;
    register::remove_own_sockets(plugin_dir, resources, instance).await;
    result
}

/// The relays of every resource.
struct Relays {
    backend: PathBuf,
    patience: Duration,
    again: watch::Sender<()>,
}

impl Served for Relays {
    fn serve(
        &self,
        resource: Resource,
        listener: tokio::net::UnixListener,
        stop: oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<Result<(), String>> {
        let relay = Relay::new(self.backend.join(resource.socket("")), self.patience, self.again.subscribe());
        register::spawn_server(listener, relay, stop)
    }

    fn send_again(&self) {
        self.again.send_modify(|_| {});
    }
}

/// The relay of one resource to the agent's socket.
struct Relay {
    agent: PathBuf,
    patience: Duration,
    again: watch::Receiver<()>,
}

/// A Status the agent did not answer itself: it was not reached, or went during the call.
fn not_answered(status: &Status) -> bool {
    std::error::Error::source(status).is_some()
}

impl Relay {
    /// A relay to the agent serving on `agent`, holding calls for up to `patience`, sending its
    /// devices again whenever `again` changes.
    fn new(agent: PathBuf, patience: Duration, again: watch::Receiver<()>) -> Self {
        Relay { agent, patience, again }
    }

    async fn client(&self) -> Result<DevicePluginClient<Channel>, String> {
        nano_gpu_runtime::unix_channel(self.agent.clone())
            .await
            .map(DevicePluginClient::new)
            .map_err(|e| format!("{e}: {}", self.agent.display()))
    }

    /// `call` on the agent, tried again every [`RETRY`] while the agent does not answer, for up to
    /// the patience.
    async fn forward<T, F, Fut>(&self, what: &str, call: F) -> Result<Response<T>, Status>
    where
        F: Fn(DevicePluginClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<T>, Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.patience;
        let mut said = false;
        loop {
            let why = match self.client().await {
                Ok(client) => match call(client).await {
                    Err(s) if not_answered(&s) => s.message().to_owned(),
                    answered => {
                        if said {
                            tracing::info!("the agent answers again; {what} relayed");
                        }
                        return answered;
                    }
                },
                Err(e) => e,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(Status::unavailable(format!(
                    "the agent did not answer {what} within {} s: {why}",
                    self.patience.as_secs()
                )));
            }
            if !said {
                tracing::warn!(error = %why, "the agent does not answer {what}; holding the call for it");
                said = true;
            }
            tokio::time::sleep(RETRY).await;
        }
    }
}

type DeviceStream =
    Pin<Box<dyn futures::Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

/// Resolves when the devices are to be sent again (never once nothing can ask).
async fn asked_again(again: &mut watch::Receiver<()>) {
    if again.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Every device of `list` unhealthy.
fn unhealthy(list: &ListAndWatchResponse) -> ListAndWatchResponse {
    let mut list = list.clone();
    for d in &mut list.devices {
        d.health = UNHEALTHY.to_owned();
    }
    list
}

#[tonic::async_trait]
impl DevicePlugin for Relay {
    type ListAndWatchStream = DeviceStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin::options()))
    }

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let relay = Relay::new(self.agent.clone(), self.patience, self.again.clone());
        tokio::spawn(async move { relay.relay_devices(tx).await });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let request = request.into_inner();
        self.forward("GetPreferredAllocation", |mut c| {
            let request = request.clone();
            async move { c.get_preferred_allocation(request).await }
        })
        .await
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let request = request.into_inner();
        self.forward("Allocate", |mut c| {
            let request = request.clone();
            async move { c.allocate(request).await }
        })
        .await
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        let request = request.into_inner();
        self.forward("PreStartContainer", |mut c| {
            let request = request.clone();
            async move { c.pre_start_container(request).await }
        })
        .await
    }
}

impl Relay {
    /// Feeds one kubelet stream until the kubelet closes it: the agent's lists, the last one again
    /// when asked, and that one unhealthy once the agent has been away for the patience.
    async fn relay_devices(mut self, tx: mpsc::Sender<Result<ListAndWatchResponse, Status>>) {
        let mut last: Option<ListAndWatchResponse> = None;
        let mut away: Option<tokio::time::Instant> = None;
        let mut told = false;
        loop {
            if let Ok(mut client) = self.client().await
                && let Ok(stream) = client.list_and_watch(Empty {}).await
            {
                let mut stream = stream.into_inner();
                if away.take().is_some() {
                    tracing::info!(agent = %self.agent.display(), "the agent serves again");
                }
                told = false;
                loop {
                    tokio::select! {
                        next = stream.message() => match next {
                            Ok(Some(list)) => {
                                last = Some(list.clone());
                                if tx.send(Ok(list)).await.is_err() {
                                    return;
                                }
                            }
                            _ => break,
                        },
                        _ = asked_again(&mut self.again) => {
                            if let Some(list) = &last && tx.send(Ok(list.clone())).await.is_err() {
                                return;
                            }
                        }
                        _ = tx.closed() => return,
                    }
                }
            }
            let since = *away.get_or_insert_with(|| {
                tracing::warn!(agent = %self.agent.display(), "the agent stopped serving; the kubelet's devices stay as they were while it comes back");
                tokio::time::Instant::now()
            });
            if !told
                && since.elapsed() >= self.patience
                && let Some(list) = &last
            {
                tracing::warn!(
                    "the agent has not served for {} s; its devices are unhealthy until it does",
                    self.patience.as_secs()
                );
                told = true;
                if tx.send(Ok(unhealthy(list))).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = asked_again(&mut self.again) => {
                    let list = last.as_ref().map(|l| if told { unhealthy(l) } else { l.clone() });
                    if let Some(list) = list && tx.send(Ok(list)).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PIDs of this process's children whose command line holds `marker`.
    fn children_marked(marker: &str) -> Vec<u32> {
        let own = std::process::id();
        nano_gpu_tests::pids()
            .into_iter()
            .filter(|&pid| nano_gpu_tests::parent_pid(pid) == Some(own))
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                String::from_utf8_lossy(&cmdline).contains(marker)
            })
            .collect()
    }

    /// An "agent" that takes `mib` MiB and keeps it for 10 s: a shell holding that many bytes in a
    /// variable.
    fn holder(marker: &str, mib: u64, memory: Option<memory::Guard>) -> AgentProcess {
        let script = format!(": {marker}; x=$(head -c {} /dev/zero | tr '\\0' a); sleep 10", mib << 20);
        AgentProcess { program: "sh".into(), args: vec!["-c".into(), script.into()], memory }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_over_its_ceiling_is_killed_and_started_again_and_one_under_it_is_left() {
        // Under a ceiling far above it, the holder takes its 100 MiB and keeps running.
        let (stop, stopped) = watch::channel(false);
        let roomy = tokio::spawn(supervise(holder("roomy", 100, Some(memory::Guard::new(4 << 30))), stopped));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let first = loop {
            let pids = children_marked("roomy");
            if let Some(&pid) = pids.first()
                && memory::held(pid).is_some_and(|h| h >= 90 << 20)
            {
                break pid;
            }
            assert!(std::time::Instant::now() < deadline, "the holder never held 90 MiB");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(children_marked("roomy"), vec![first], "an agent under its ceiling was stopped");
        stop.send(true).unwrap();
        roomy.await.unwrap();

        // A 64 MiB container: the ceiling is under 56 MiB, and the holder is killed once it is over,
        // then started again.
        let (stop, stopped) = watch::channel(false);
        let tight =
            tokio::spawn(supervise(holder("tight", 100, Some(memory::Guard::new(64 << 20))), stopped));
        let mut seen = std::collections::BTreeSet::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while seen.len() < 3 {
            seen.extend(children_marked("tight"));
            assert!(std::time::Instant::now() < deadline, "started {seen:?}: not killed and started again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.send(true).unwrap();
        tight.await.unwrap();
    }
}
