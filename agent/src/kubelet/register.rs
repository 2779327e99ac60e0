//! The kubelet's side of the device-plugin protocol, which the agent and its keeper
//! ([`crate::kubelet::keeper`]) share: serve each resource on a socket in the kubelet's plugin directory,
//! register it, and serve and register again whenever the kubelet restarts (its `kubelet.sock` is
//! made anew, or our sockets disappear: a new kubelet deletes every socket in the directory) or
//! another agent of the node stops (a rollout's old one); a registration the kubelet refuses ends
//! the loop with the kubelet's reason. Also the sockets a keeper's agent serves instead
//! ([`serve_backend`]), and the socket files' names and clean-up.

use crate::cards::resource::Resource;
use crate::kubelet::plugin;
use crate::kubelet::plugin::socket::{is_served, remove_unserved};
use crate::node::probe::Readiness;
use nano_gpu_proto::kubelet::deviceplugin::device_plugin_server::DevicePlugin;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::watch;

/// Why the agent stopped.
#[derive(Debug, Error)]
pub enum RunError {
    /// The kubelet answered the registration with an error.
    #[error("the kubelet refused the registration: {0}")]
    Refused(String),
    /// A background task ended (returned or panicked): the agent no longer does all of its job.
    #[error("{0}")]
    Task(String),
    /// The plugin socket could not be served.
    #[error("serving {path}: {message}")]
    Serve {
        /// Socket path.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

/// Timing of the loop.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// How often the sockets are checked for a kubelet restart.
    pub check: Duration,
    /// How often the cards are re-read.
    pub refresh: Duration,
    /// Longest wait between registration attempts.
    pub max_backoff: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            // A restarted kubelet admits the pods bound to it in its first seconds, each failed for
            // good without a plugin registered: a `stat` or two every 100 ms to see it come.
            check: Duration::from_millis(100),
            refresh: Duration::from_secs(30),
            max_backoff: Duration::from_secs(8),
        }
    }
}

/// Wakes when an entry of a directory is created, removed or renamed (inotify): a starting
/// kubelet's socket, our sockets deleted by it, another agent's going. A restarted kubelet may admit
/// the pods bound to it within milliseconds of creating its socket, and fails those it admits
/// before we register; polling alone would see it up to [`Timing::check`] late. Without inotify
/// (the instances used up, a filesystem without it) it never wakes and the polling remains.
struct DirEvents(Option<inotify::EventStream<Vec<u8>>>);

impl DirEvents {
    fn new(dir: &Path) -> Self {
        use inotify::{Inotify, WatchMask};
        let watch = || -> std::io::Result<_> {
            let inotify = Inotify::init()?;
            let what = WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_TO | WatchMask::MOVED_FROM;
            inotify.watches().add(dir, what)?;
            inotify.into_event_stream(vec![0u8; 4096])
        };
        match watch() {
            Ok(events) => DirEvents(Some(events)),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "no inotify on the plugin directory; polling it only");
                DirEvents(None)
            }
        }
    }

    /// Resolves at the next change (one since the last call included).
    async fn changed(&mut self) {
        use futures::StreamExt;
        let Some(events) = &mut self.0 else { return std::future::pending().await };
        match events.next().await {
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the plugin directory's inotify failed; polling it only");
                self.0 = None;
            }
            None => self.0 = None,
        }
    }
}

/// Identity of a file: inode and change time, so a re-created file differs.
fn file_identity(path: &Path) -> Option<(u64, i64, i64)> {
    std::fs::metadata(path).ok().map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Stops the plugin servers of one round.
fn stop_serving(
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    servers: &[tokio::task::JoinHandle<Result<(), String>>],
) {
    for s in stops {
        let _ = s.send(());
    }
    servers.iter().for_each(|s| s.abort());
}

/// How often the socket files of the other agents serving the node are looked at (a `stat` each),
/// so that the old agent of a rollout is seen going within this: a kubelet before 1.36 has no
/// healthy device of the resource from its exit until we register anew.
const OTHERS_CHECK: Duration = Duration::from_millis(50);

/// How often the kubelet's socket is looked at while the kubelet is not reachable.
const KUBELET_POLL: Duration = Duration::from_millis(50);

/// After registering anew because another agent stopped, once more after each of these (from the
/// one before): a kubelet that handled the other's disconnect only after our registration stamped
/// that one stopped, and has no healthy device until the next. A 1.37 kubelet took the other's end
/// 4 ms after our registration (a CI run: four pods admitted in the next second failed), so soon,
/// then once more for a loaded kubelet that took it later.
const SETTLE: [Duration; 2] = [Duration::from_millis(100), Duration::from_secs(1)];

/// Registration errors in a row (other than an unreachable kubelet) that end the agent.
const REFUSALS: u32 = 3;

/// How a round of registrations ended.
enum Registration {
    /// Registered (or shutting down), with the kubelet's socket identity from just before the first
    /// registration it took.
    Done(Option<(u64, i64, i64)>),
    /// Our socket was deleted: serve and register again.
    ServeAgain,
    /// The kubelet refused a socket: register again on new ones (it may keep refusing that name).
    Rename,
    /// The kubelet refused [`REFUSALS`] times in a row.
    Refused(String),
}

/// Removes the socket files of `instance` in `dir`, each once it accepts no connection: no file
/// of ours stays behind, and another agent of the node takes a removed file for the end of our
/// streams and registers anew. The streams end within about a millisecond of that, before or after
/// (`hack/bench-rollout.sh` prints both); the other agent's second registration covers an end that
/// comes after.
pub(crate) async fn remove_own_sockets(dir: &Path, resources: &[Resource], instance: &str) {
    for name in sockets_of(dir, resources).into_iter().filter(|n| is_ours(n, resources, instance)) {
        let path = dir.join(name);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while is_served(&path).await && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = std::fs::remove_file(path);
    }
}

/// Serves `service` on `listener` on a task of its own until `stop` fires.
pub(crate) fn spawn_server<S: DevicePlugin>(
    listener: tokio::net::UnixListener,
    service: S,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<(), String>> {
    tokio::spawn(async move {
        plugin::serve_on(listener, service, async { stop.await.unwrap_or(()) })
            .await
            .map_err(|e| e.to_string())
    })
}

/// What the registration loop serves on each of its sockets: the agent's device plugin, or the
/// keeper's relay to it ([`crate::kubelet::keeper`]).
pub trait Served: Sync {
    /// Serves `resource` on `listener` until `stop` fires.
    fn serve(
        &self,
        resource: Resource,
        listener: tokio::net::UnixListener,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<Result<(), String>>;
    /// Sends every open ListAndWatch stream its devices again.
    fn send_again(&self);
}

/// What serving and registering work with.
pub struct Serving<'a> {
    /// The resources, each on its own socket.
    pub resources: &'a [Resource],
    /// What serves them.
    pub served: &'a dyn Served,
    /// This agent (or keeper) among the node's: names its sockets.
    pub instance: &'a str,
    /// The kubelet's device-plugin directory.
    pub plugin_dir: &'a Path,
    /// Timing of the loop.
    pub timing: Timing,
    /// Registered or not, for `/readyz`.
    pub readiness: &'a Arc<Readiness>,
}

/// How watching a registration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watched {
    /// Shutdown.
    Stop,
    /// The kubelet restarted (it deleted our sockets).
    KubeletRestarted,
    /// The kubelet's socket was created anew while ours stayed: a kubelet that may or may not hold
    /// our registration.
    KubeletChanged,
    /// Another agent of this node stopped serving.
    AnotherStopped,
    /// Each step of [`SETTLE`] after registering anew for [`Watched::AnotherStopped`].
    Settle,
}

/// Servers, and what stops them.
type Servers = (Vec<tokio::sync::oneshot::Sender<()>>, Vec<tokio::task::JoinHandle<Result<(), String>>>);

/// Serves every resource and registers it, again whenever the kubelet restarts, until `shutdown` or
/// a refusal.
///
/// When another agent of the node (the old one of a rollout) stops, a kubelet before 1.36 marks
/// every device of the resource unhealthy and stamps the endpoint it now uses, ours, as stopped: its
/// Allocates fail at once, and five minutes later the resource leaves the node's capacity. So then
/// the devices are sent again and every resource is registered once more on new sockets
/// (`<instance>.<generation>`), a fresh endpoint for that kubelet (and one more for a newer one),
/// while the earlier sockets stay served: closing their streams would stamp the new endpoint too.
///
/// No socket name is registered twice: a kubelet of 1.37 refuses an endpoint it still holds, and
/// after such a refusal it may hold that endpoint for good. So every new round of registrations (a
/// kubelet restart, a refusal, the kubelet's socket made anew) serves on sockets of the next
/// generation.
pub async fn serve_and_register(
    serving: Serving<'_>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), RunError> {
    let Serving { resources, served, instance, plugin_dir, timing, readiness } = serving;
    let kubelet = &plugin_dir.join(nano_gpu_proto::kubelet::KUBELET_SOCKET);
    let mut dir = DirEvents::new(plugin_dir);
    let mut generation = 0u32;
    let mut earlier: Vec<Servers> = Vec::new();
    // When to register once more after another agent stopped, and the step of [`SETTLE`] it is.
    let mut settle: Option<(tokio::time::Instant, usize)> = None;
    // Refusals in a row, across the names they came for.
    let mut refusals = 0;
    let stop_all = |current: Servers, earlier: &mut Vec<Servers>| {
        for (stops, servers) in earlier.drain(..).chain([current]) {
            stop_serving(stops, &servers);
        }
    };
    loop {
        if *shutdown.borrow() {
            stop_all((Vec::new(), Vec::new()), &mut earlier);
            break Ok(());
        }
        // Every round serves on sockets of its own generation (see above).
        let name = generation_name(instance, generation);
        generation += 1;
        let names: Vec<String> = resources.iter().map(|r| r.socket(&name)).collect();
        let sockets: Vec<PathBuf> = names.iter().map(|n| plugin_dir.join(n)).collect();
        let (stops, mut servers) = match serve_all(served, resources, &sockets) {
            Ok(serving) => serving,
            Err(e) => {
                stop_all((Vec::new(), Vec::new()), &mut earlier);
                return Err(e);
            }
        };
        // A kubelet that starts now deletes every socket in the directory: serve again then.
        let mut deleted = false;
        for (socket, server) in sockets.iter().zip(&mut servers) {
            while nano_gpu_runtime::unix_channel(socket.clone()).await.is_err() {
                if server.is_finished() {
                    let message = match server.await {
                        Ok(Err(m)) => m,
                        _ => "the server stopped".into(),
                    };
                    return Err(RunError::Serve { path: socket.clone(), message });
                }
                if file_identity(socket).is_none() {
                    deleted = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The other agents serving now (the old one of a rollout), before we register: one that
        // stops from here on is noticed, even while we register.
        let seen = served_by_others(plugin_dir, resources, instance).await;
        // Register every resource, with backoff while the kubelet is not there.
        // An unreachable kubelet is most often one starting: its socket may be there a moment before
        // it listens, and every pod it admits before we register fails. Asked again soon, then less
        // often.
        let mut unreachable = Duration::from_millis(20);
        let mut pending: Vec<(Resource, &String)> = resources.iter().copied().zip(&names).collect();
        // The kubelet's socket as it was just before the first registration it took: a kubelet that
        // restarts from then on shows up as a change, and we register again (never the other way
        // round). Read before each attempt, not once before the first: a kubelet that was not there
        // yet would otherwise look restarted right after it took us.
        let mut took: Option<Option<(u64, i64, i64)>> = None;
        let socket_gone = || sockets.iter().any(|s| file_identity(s).is_none());
        let registered = loop {
            let Some((resource, name)) = pending.first().copied() else {
                break Registration::Done(took.flatten());
            };
            // A kubelet that started meanwhile deleted our sockets: it could not call us back.
            if deleted || socket_gone() {
                break Registration::ServeAgain;
            }
            let before = file_identity(kubelet);
            match plugin::register(kubelet.to_path_buf(), resource, name).await {
                Ok(()) => {
                    tracing::info!(resource = resource.name(), socket = %name, "registered with the kubelet");
                    pending.remove(0);
                    took.get_or_insert(before);
                    refusals = 0;
                }
                Err(s) if s.code() == tonic::Code::Unavailable => {
                    tracing::info!(error = %s.message(), "kubelet not reachable; retrying");
                    if !kubelet_or_backoff(kubelet, &mut dir, unreachable, shutdown).await {
                        break Registration::Done(None);
                    }
                    unreachable = (unreachable * 2).min(timing.max_backoff);
                }
                Err(_) if socket_gone() => break Registration::ServeAgain,
                // A refusal repeats; a connection the restarting kubelet dropped does not.
                Err(s) if refusals + 1 >= REFUSALS => break Registration::Refused(s.message().to_owned()),
                // Asked again on new sockets: a kubelet of 1.37 refuses an endpoint it holds
                // ("device plugin already connected"), and once it has refused one it may hold it
                // for good (its failed connection drops the old one's client, whose end then never
                // frees the endpoint).
                Err(s) => {
                    refusals += 1;
                    tracing::warn!(error = %s.message(), "registration refused; registering again on new sockets");
                    let backoff = Duration::from_millis(250) * 2u32.pow(refusals - 1);
                    tokio::time::sleep(backoff.min(timing.max_backoff)).await;
                    break Registration::Rename;
                }
            }
        };
        let kubelet_identity = match registered {
            Registration::Done(id) => id,
            Registration::ServeAgain => {
                tracing::info!("a plugin socket was deleted (kubelet starting?); serving again");
                stop_all((stops, servers), &mut earlier);
                continue;
            }
            Registration::Rename => {
                // What registered before the refusal stays served, as after a rollout's.
                earlier.push((stops, servers));
                continue;
            }
            Registration::Refused(message) => {
                stop_all((stops, servers), &mut earlier);
                break Err(RunError::Refused(message));
            }
        };
        readiness.set_registered(true);
        // Watch for a kubelet restart, and for another agent of the node going away: its socket
        // files are looked at often (a stopping agent removes them once it serves no more), and
        // everything, its sockets served included (a killed agent leaves its files), every
        // `timing.check`.
        let mut full_check = tokio::time::Instant::now() + timing.check;
        let watched = loop {
            let mut wake = full_check;
            if !seen.is_empty() {
                wake = wake.min(tokio::time::Instant::now() + OTHERS_CHECK);
            }
            if let Some((at, _)) = settle {
                wake = wake.min(at);
            }
            let mut entries_changed = false;
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = dir.changed() => entries_changed = true,
                _ = shutdown.changed() => break Watched::Stop,
            }
            let now = tokio::time::Instant::now();
            if settle.is_some_and(|(at, _)| now >= at) {
                break Watched::Settle;
            }
            if !entries_changed && now < full_check && seen.iter().all(|o| plugin_dir.join(o).exists()) {
                continue;
            }
            full_check = now + timing.check;
            if sockets.iter().any(|s| file_identity(s).is_none()) {
                break Watched::KubeletRestarted;
            }
            if file_identity(kubelet) != kubelet_identity {
                break Watched::KubeletChanged;
            }
            if !seen.is_empty() && !instance.is_empty() {
                let now = served_by_others(plugin_dir, resources, instance).await;
                if seen.iter().any(|o| !now.contains(o)) {
                    break Watched::AnotherStopped;
                }
            }
        };
        match watched {
            Watched::AnotherStopped | Watched::Settle => {
                if watched == Watched::AnotherStopped {
                    tracing::info!(
                        "another agent of this node stopped; devices sent again, registering anew"
                    );
                    settle = Some((tokio::time::Instant::now() + SETTLE[0], 0));
                } else {
                    tracing::info!(
                        "registering once more, in case the kubelet took the other agent's exit after"
                    );
                    let next = settle.map_or(SETTLE.len(), |(_, step)| step + 1);
                    settle = SETTLE.get(next).map(|d| (tokio::time::Instant::now() + *d, next));
                }
                served.send_again();
                earlier.push((stops, servers));
            }
            Watched::KubeletChanged => {
                // A kubelet that restarted deletes our sockets, so this one may still hold our
                // endpoints: registered again on new ones, the earlier kept served.
                tracing::info!("the kubelet's socket was created anew; registering again on new sockets");
                settle = None;
                earlier.push((stops, servers));
            }
            Watched::KubeletRestarted => {
                settle = None;
                readiness.set_registered(false);
                stop_all((stops, servers), &mut earlier);
                tracing::info!("kubelet restarted; serving and registering again");
            }
            Watched::Stop => {
                readiness.set_registered(false);
                stop_all((stops, servers), &mut earlier);
                break Ok(());
            }
        }
    }
}

/// Waits `backoff`, or less: until the kubelet's socket is created anew (a starting kubelet; it is
/// asked at once). False when `shutdown` flips first.
async fn kubelet_or_backoff(
    kubelet: &Path,
    dir: &mut DirEvents,
    backoff: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let before = file_identity(kubelet);
    let until = tokio::time::Instant::now() + backoff;
    while tokio::time::Instant::now() < until {
        tokio::select! {
            _ = tokio::time::sleep(KUBELET_POLL.min(backoff)) => {}
            _ = dir.changed() => {}
            _ = shutdown.changed() => return false,
        }
        if file_identity(kubelet) != before {
            break;
        }
    }
    true
}

/// Serves every resource on its socket (`sockets`, in the same order), with what stops them; a
/// socket that cannot be bound stops those served already.
fn serve_all(served: &dyn Served, resources: &[Resource], sockets: &[PathBuf]) -> Result<Servers, RunError> {
    let (mut stops, mut servers) = (Vec::new(), Vec::new());
    for (resource, socket) in resources.iter().zip(sockets) {
        let listener = match plugin::bind(socket) {
            Ok(l) => l,
            Err(e) => {
                stop_serving(stops, &servers);
                return Err(RunError::Serve { path: socket.clone(), message: e.to_string() });
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        servers.push(served.serve(*resource, listener, stopped));
        stops.push(stop);
    }
    Ok((stops, servers))
}

/// Serves every resource on its socket in `dir` for the keeper (`<stem>.sock`), ready once they
/// listen, until `shutdown` or a server stops; then removes the files.
pub(crate) async fn serve_backend(
    dir: &Path,
    resources: &[Resource],
    served: &dyn Served,
    readiness: &Readiness,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), RunError> {
    let sockets: Vec<PathBuf> = resources.iter().map(|r| dir.join(r.socket(""))).collect();
    let (stops, mut servers) = serve_all(served, resources, &sockets)?;
    tracing::info!(dir = %dir.display(), "serving the keeper");
    readiness.set_registered(true);
    let result = tokio::select! {
        _ = shutdown.wait_for(|stop| *stop) => Ok(()),
        (_, i, _) = futures::future::select_all(servers.iter_mut()) => {
            Err(RunError::Serve { path: sockets[i].clone(), message: "the server stopped".into() })
        }
    };
    readiness.set_registered(false);
    stop_serving(stops, &servers);
    for socket in &sockets {
        let _ = std::fs::remove_file(socket);
    }
    result
}

/// The socket files of `resources` in `dir`.
fn sockets_of(dir: &Path, resources: &[Resource]) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| resources.iter().any(|r| r.is_socket(n)))
        .collect()
}

/// The sockets of `resources` in `dir` that another agent than `instance` serves now (one that
/// stops may leave its file: an older agent did).
async fn served_by_others(dir: &Path, resources: &[Resource], instance: &str) -> Vec<String> {
    let mut served = Vec::new();
    for name in sockets_of(dir, resources).into_iter().filter(|n| !is_ours(n, resources, instance)) {
        if is_served(&dir.join(&name)).await {
            served.push(name);
        }
    }
    served
}

/// The name agent `instance` serves its `generation`-th sockets under (the first: its own name;
/// then `<instance>.<generation>`, or the bare number for the unnamed agent).
fn generation_name(instance: &str, generation: u32) -> String {
    match (generation, instance) {
        (0, _) => instance.to_owned(),
        (g, "") => g.to_string(),
        (g, _) => format!("{instance}.{g}"),
    }
}

/// Whether socket file `name` is agent `instance`'s (any generation, [`generation_name`]).
fn is_ours(name: &str, resources: &[Resource], instance: &str) -> bool {
    let number = |g: &str| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit());
    resources.iter().filter_map(|r| r.instance_of(name)).any(|of| match of.strip_prefix(instance) {
        Some("") => true,
        Some(rest) if instance.is_empty() => number(rest),
        Some(rest) => rest.strip_prefix('.').is_some_and(number),
        None => false,
    })
}

/// Removes the sockets of `resources` in `dir` nobody serves (an agent that was killed leaves its
/// files); an agent that serves (the old one of a rollout) keeps its own.
pub(crate) async fn remove_dead_sockets(dir: &Path, resources: &[Resource]) {
    remove_unserved(dir, |n| resources.iter().any(|r| r.is_socket(n))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_owns_its_generations_and_no_other_name() {
        let r = [Resource::Percent];
        let owns = |name: &str, instance: &str| is_ours(name, &r, instance);
        assert_eq!(generation_name("", 0), "");
        assert_eq!(generation_name("", 2), "2");
        assert_eq!(generation_name("a", 3), "a.3");
        assert!(owns("nano-gpu.sock", "") && owns("nano-gpu.2.sock", ""));
        assert!(!owns("nano-gpu.a.sock", "") && !owns("nano-gpu.a.1.sock", ""));
        assert!(owns("nano-gpu.a.sock", "a") && owns("nano-gpu.a.3.sock", "a"));
        assert!(
            !owns("nano-gpu.ab.sock", "a")
                && !owns("nano-gpu.a.b.sock", "a")
                && !owns("nano-gpu.a..sock", "a")
        );
        assert!(!owns("nano-gpu.sock", "a") && !owns("nano-gpu.a.sock", "b"));
    }
}
