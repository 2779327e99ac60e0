//! NVIDIA MPS: one control daemon per card, each with its own pipe directory and log directory
//! (`<root>/<uuid>/log`), and the `/dev/shm` of the supervisor that runs it, which the card's
//! clients get too: a size-limited memory-backed emptyDir whose host directory the supervisor names
//! in `<root>/<uuid>/shm-source` (`--mps-shm-source`). The pipe directory, which the card's clients
//! get too and can write in, is another such emptyDir of the supervisor's (`--mps-pipe-source`, its
//! host directory named in `<root>/<uuid>/pipe-source`), for one card only. Each is the root of a
//! mount in the share containers, which a share can write in but not rename or replace (a link in
//! its place would be followed on the host by the next container's mount). So what shares write in
//! either is bounded and goes with the daemons' pod. Without them both are host directories of the
//! host's `/run` (`<root>/shm`, `<root>/<uuid>/pipe`), not bounded. The shipped DaemonSet runs one
//! supervisor per card (`--mps-card-index`), each in a container with its own `/dev/shm` and pipe
//! directory: a share can fill only its own card's.
//!
//! The daemons are run by [`supervise`] (`nano-gpu-agent mps-control`, its own DaemonSet that is
//! never rolled with the agent: a daemon that stops takes its clients' MPS server with it, so the
//! agent's rollouts must not touch them). A control daemon already running in a card's pipe
//! directory of the host when the supervisor first sees the card (an operator's) is adopted, not
//! replaced; one that stops later is started again, never looked for there, and none is looked for
//! in a pipe directory of the supervisor's own pod (a daemon there died with an earlier container of
//! it; what is there was written by shares, and is removed before the supervisor's first daemon of
//! the card starts). The supervisor
//! records the PID of each card's daemon in `<root>/<uuid>/control-daemon.pid`: share containers get
//! the pipe directory and can write there (the daemon's own PID file in it is theirs to replace),
//! never the record. The agent judges a daemon by that record and the process's
//! name in `/proc`.
//!
//! With `exclusive` the supervisor also closes the way around MPS, as a real card showed it must be
//! closed (`hack/gpu-check.sh`): each card goes to `EXCLUSIVE_PROCESS` compute mode, where only one
//! process, the MPS server, may hold a context, and a server is started ahead of any client
//! (`start_server -uid 0`) and again whenever none runs, since a process that reaches the card while
//! no server runs gets all of it. A card so set is marked (`<root>/<uuid>/exclusive-process`) for
//! the agent, which then sends whole cards through MPS too.

use crate::cards::inventory::{GpuInventory, read_all};
use nano_gpu_proto::annotations::Vendor;
use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// Where a client finds its card's pipe directory (CUDA's default, and `CUDA_MPS_PIPE_DIRECTORY`).
pub const PIPE_IN_CONTAINER: &str = "/tmp/nvidia-mps";
/// The file the control daemon writes its PID to, in its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The file the supervisor records its daemon's PID in, in the card's directory (out of the
/// containers' reach).
pub const RECORD: &str = "control-daemon.pid";
/// What `/proc/<pid>/comm` of a control daemon starts with (the kernel keeps 15 characters).
const COMM: &str = "nvidia-cuda-mps";
/// The control program's file name, as a daemon's first argument names it.
const CONTROL_PROGRAM: &str = "nvidia-cuda-mps-control";
/// The file that says a card is in `EXCLUSIVE_PROCESS` mode with a server kept up, in its directory.
pub const EXCLUSIVE_MARK: &str = "exclusive-process";
/// The file in which the supervisor names the host directory of a card's daemon's `/dev/shm`, in the
/// card's directory (in the root: one for every card, as earlier supervisors wrote it).
pub const SHM_SOURCE: &str = "shm-source";
/// The file in which the supervisor names the host directory of a card's pipe directory, when it is
/// an emptyDir of its pod (`--mps-pipe-source`), in the card's directory.
pub const PIPE_SOURCE: &str = "pipe-source";

/// The host directories of the node's MPS daemons.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Root (`--mps-root`, default `/run/nano-gpu/mps`).
    pub root: PathBuf,
    /// The host's `/proc`, where a daemon's PID is checked.
    pub proc_root: PathBuf,
    /// Of a supervisor of one card whose pipe directory is a size-limited emptyDir of its pod
    /// (`--mps-pipe-source`): that directory as it sees it (`--mps-pipe-dir`). `None`: the pipe
    /// directories are `<root>/<uuid>/pipe`.
    pub pipe_in: Option<PathBuf>,
}

impl Layout {
    /// The layout under `root`, the host's `/proc` at `proc_root`, with the pipe directories in the
    /// root.
    pub fn new(root: impl Into<PathBuf>, proc_root: impl Into<PathBuf>) -> Self {
        Layout { root: root.into(), proc_root: proc_root.into(), pipe_in: None }
    }

    /// Card `uuid`'s directory, which its supervisor makes when it first runs.
    pub fn card(&self, uuid: &str) -> PathBuf {
        self.root.join(uuid)
    }

    /// The pipe directory of card `uuid`'s daemon, as this process sees it (the supervisor's).
    pub fn pipe(&self, uuid: &str) -> PathBuf {
        match &self.pipe_in {
            Some(dir) => dir.clone(),
            None => self.card(uuid).join("pipe"),
        }
    }

    /// The host directory of card `uuid`'s pipe directory, which its clients get: the one its
    /// supervisor named in the card's [`PIPE_SOURCE`] (an emptyDir of its pod), else
    /// `<root>/<uuid>/pipe`. A name is trusted only beside the card's `/dev/shm` that the same
    /// supervisor named (in the same pod's volumes): one left by a supervisor that ran before an older
    /// one, which names no pipe directory, would name a directory gone with its pod.
    /// `shm` is the card's [`Layout::shm`], which the caller has read already.
    pub fn client_pipe(&self, uuid: &str, shm: &Path) -> PathBuf {
        let named = read_small_file(&self.card(uuid).join(PIPE_SOURCE), 4096).ok();
        let named = named.map(|t| PathBuf::from(t.trim())).filter(|p| p.is_absolute());
        match named {
            Some(pipe) if pipe.parent().is_some() && pipe.parent() == shm.parent() => pipe,
            _ => self.card(uuid).join("pipe"),
        }
    }

    /// Names `source` as the host directory of card `uuid`'s pipe directory (`None`: the pipe
    /// directory is in the root), replaced in one rename and only when it changes.
    fn name_pipe(&self, uuid: &str, source: Option<&Path>) -> std::io::Result<()> {
        self.name(uuid, PIPE_SOURCE, source)
    }

    /// The log directory of card `uuid`'s daemon.
    pub fn log(&self, uuid: &str) -> PathBuf {
        self.card(uuid).join("log")
    }

    /// The environment that points the control program (the daemon, or a command to it) at card
    /// `uuid`'s daemon.
    pub fn control_env(&self, uuid: &str) -> [(&'static str, String); 3] {
        [
            ("CUDA_VISIBLE_DEVICES", uuid.to_owned()),
            ("CUDA_MPS_PIPE_DIRECTORY", self.pipe(uuid).display().to_string()),
            ("CUDA_MPS_LOG_DIRECTORY", self.log(uuid).display().to_string()),
        ]
    }

    /// Whether the supervisor holds card `uuid` in `EXCLUSIVE_PROCESS` mode (its mark is there).
    pub fn exclusive(&self, uuid: &str) -> bool {
        self.card(uuid).join(EXCLUSIVE_MARK).is_file()
    }

    /// The host directory of the `/dev/shm` card `uuid`'s daemon and its clients share: the one its
    /// supervisor named in the card's [`SHM_SOURCE`] (its container's size-limited emptyDir), else
    /// the one named in the root's (an earlier supervisor's, for every card), else `<root>/shm`.
    pub fn shm(&self, uuid: &str) -> PathBuf {
        for named in [self.card(uuid).join(SHM_SOURCE), self.root.join(SHM_SOURCE)] {
            match read_small_file(&named, 4096) {
                Ok(text) if text.trim().starts_with('/') => return PathBuf::from(text.trim()),
                _ => {}
            }
        }
        self.root.join("shm")
    }

    /// Names `source` as the host directory of card `uuid`'s daemon's `/dev/shm` (replaced in one
    /// rename, and only when it names another), or with `None` takes the name away.
    fn name_shm(&self, uuid: &str, source: Option<&Path>) -> std::io::Result<()> {
        self.name(uuid, SHM_SOURCE, source)
    }

    /// Writes `source` into card `uuid`'s file `file` (replaced in one rename, and only when it
    /// names another), or with `None` removes it.
    fn name(&self, uuid: &str, file: &str, source: Option<&Path>) -> std::io::Result<()> {
        let named = self.card(uuid).join(file);
        match source {
            Some(source) => {
                let text = format!("{}\n", source.display());
                match read_small_file(&named, 4096) {
                    Ok(was) if was == text => Ok(()),
                    _ => replace_file(&named, &text),
                }
            }
            None => match std::fs::remove_file(&named) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }

    /// Where the supervisor records the PID of card `uuid`'s daemon.
    pub fn record(&self, uuid: &str) -> PathBuf {
        self.card(uuid).join(RECORD)
    }

    /// The PID of card `uuid`'s control daemon as the supervisor recorded it, or why it is not
    /// running.
    pub fn daemon(&self, uuid: &str) -> Result<u32, String> {
        self.daemon_in(&self.record(uuid))
    }

    /// The PID card `uuid`'s daemon wrote in its pipe directory, or why it is not running: only to
    /// adopt a daemon found running, as a share's container may have replaced the file.
    pub fn daemon_in_pipe(&self, uuid: &str) -> Result<u32, String> {
        self.daemon_in(&self.pipe(uuid).join(PID_FILE))
    }

    /// The daemon to adopt for card `uuid`, if one runs there: only when the supervisor `first` sees
    /// the card (an operator's daemon, started before it), only in a pipe directory of the host
    /// (none runs in one of this pod's own), and only a process that runs the control program (the
    /// MPS server's name in `comm` is the same). A daemon of ours that stopped, perhaps
    /// told `quit` by a share, is started again and never looked for in the pipe directory, whose
    /// PID file a share may have pointed at another process by then.
    pub fn adoptable(&self, uuid: &str, first: bool) -> Option<u32> {
        if !first || self.pipe_in.is_some() {
            return None;
        }
        let pid = self.daemon_in_pipe(uuid).ok()?;
        self.runs_control_program(pid).then_some(pid)
    }

    /// Whether process `pid`'s first argument names the control program (`/proc/<pid>/cmdline`,
    /// which any process may read).
    fn runs_control_program(&self, pid: u32) -> bool {
        let cmdline = std::fs::read(self.proc_root.join(pid.to_string()).join("cmdline")).unwrap_or_default();
        let first = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        Path::new(std::ffi::OsStr::from_bytes(first)).file_name()
            == Some(std::ffi::OsStr::new(CONTROL_PROGRAM))
    }

    /// Whether process `pid` is a control daemon (by its name in `/proc`).
    pub fn is_daemon(&self, pid: u32) -> bool {
        let comm =
            std::fs::read_to_string(self.proc_root.join(pid.to_string()).join("comm")).unwrap_or_default();
        comm.trim_end().starts_with(COMM)
    }

    /// Records `pid` as card `uuid`'s daemon (`None`: none runs), replacing the record in one rename
    /// so the agent never reads half of one.
    fn keep_record(&self, uuid: &str, pid: Option<u32>) -> std::io::Result<()> {
        let record = self.record(uuid);
        match pid {
            None => match std::fs::remove_file(&record) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
            Some(pid) if self.daemon(uuid) == Ok(pid) => Ok(()),
            Some(pid) => replace_file(&record, &format!("{pid}\n")),
        }
    }

    /// The PID in `file`, if it names a running control daemon; else why not.
    fn daemon_in(&self, file: &Path) -> Result<u32, String> {
        let down =
            |why: String| format!("enforcement mps: the card's MPS control daemon is not running ({why})");
        let text = read_small_file(file, 64).map_err(|e| down(format!("{}: {e}", file.display())))?;
        let pid: u32 =
            text.trim().parse().map_err(|_| down(format!("{} holds {:?}", file.display(), text.trim())))?;
        if self.is_daemon(pid) {
            Ok(pid)
        } else {
            Err(down(format!("PID {pid} of {} is gone", file.display())))
        }
    }
}

/// Writes `text` as `file` in one rename (its directory made if missing), so a reader sees the old
/// file or the new one, never half of one.
fn replace_file(file: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let next = file.with_extension("next");
    std::fs::write(&next, text)?;
    std::fs::rename(&next, file)
}

/// The text of `file`, at most `limit` bytes, only if it is a regular file. The pipe directories are
/// writable by every share's container, so a FIFO, a device or a link may stand where a file should:
/// such a file is refused, never waited on or followed (opened without blocking and without
/// following a link, then checked on the open descriptor).
pub(crate) fn read_small_file(file: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOFOLLOW;
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(flags.bits() as i32).open(file)?;
    if !opened.metadata()?.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a regular file"));
    }
    let mut text = String::new();
    opened.take(limit).read_to_string(&mut text)?;
    Ok(text)
}

/// What the supervisor runs with.
pub struct Supervisor {
    /// Where the daemons live.
    pub layout: Layout,
    /// The control program (`nvidia-cuda-mps-control`, from the driver).
    pub program: PathBuf,
    /// Where the cards come from.
    pub backends: Vec<Box<dyn GpuInventory>>,
    /// How often the cards and daemons are checked.
    pub every: Duration,
    /// NVML's library, when each card is to be held in `EXCLUSIVE_PROCESS` mode with a server up.
    pub exclusive: Option<PathBuf>,
    /// The host directory of this process's own `/dev/shm` (its container's emptyDir), which its
    /// cards' clients are to get; `None`: `<root>/shm`, made here.
    pub shm_source: Option<PathBuf>,
    /// The host directory of the pipe directory of this process's one card (`layout.pipe_in`, its
    /// container's emptyDir), which the card's clients are to get; `None`: `<root>/<uuid>/pipe`.
    pub pipe_source: Option<PathBuf>,
    /// The one card to run a daemon for, by its NVML index; `None`: every card.
    pub card_index: Option<u32>,
}

/// A daemon of ours, or the PID of one we found running.
enum Daemon {
    Ours(Child),
    Adopted(u32),
    /// It stopped; not started again before this.
    Waiting {
        until: Instant,
        backoff: Duration,
    },
}

/// Longest wait before a daemon that keeps stopping is started again.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Where drivers put their programs, looked in after `PATH` for a control program named without a
/// directory: NVIDIA's runtime mounts the driver's programs at the paths they have on the node, and
/// a node whose driver lives in `/usr/local/nvidia` (GKE, and the lent H100/H200 machines) or under
/// the GPU Operator's `/run/nvidia/driver` puts them where no image's `PATH` looks.
const DRIVER_BIN_DIRS: [&str; 4] =
    ["/usr/local/nvidia/bin", "/usr/bin", "/run/nvidia/driver/usr/bin", "/home/kubernetes/bin/nvidia/bin"];

/// The control program to run for `name`: itself when it names a directory, else the first
/// executable file of that name on `path` (a `PATH` value), then in [`DRIVER_BIN_DIRS`]; `None`
/// when there is none.
pub fn find_control(name: &Path, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if name.components().count() != 1 {
        return Some(name.to_path_buf());
    }
    let on_path = path.map(std::env::split_paths).into_iter().flatten();
    on_path.chain(DRIVER_BIN_DIRS.iter().map(PathBuf::from)).map(|dir| dir.join(name)).find(|file| {
        std::fs::metadata(file).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// `PATH` for the control program, with its own directory first: the daemon starts the driver's
/// `nvidia-cuda-mps-server`, which lies beside it.
fn control_path(program: &Path) -> Option<std::ffi::OsString> {
    let dir = program.parent().filter(|d| !d.as_os_str().is_empty())?;
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&rest))).ok()
}

/// A command of the control program for card `uuid`'s daemon, with [`control_path`] as its `PATH`.
fn control_command(layout: &Layout, program: &Path, uuid: &str) -> Command {
    let mut command = Command::new(program);
    if let Some(path) = control_path(program) {
        command.env("PATH", path);
    }
    command.envs(layout.control_env(uuid));
    command
}

/// Runs one control daemon per NVIDIA card not in MIG mode, starting again (with backoff) any that
/// stops, until `stop` flips to true; then tells each of ours to quit.
pub async fn supervise(supervisor: Supervisor, mut stop: watch::Receiver<bool>) -> Result<(), String> {
    let Supervisor { layout, program, backends, every, exclusive, shm_source, pipe_source, card_index } =
        supervisor;
    let program = match find_control(&program, std::env::var_os("PATH").as_deref()) {
        Some(found) => {
            tracing::info!(program = %found.display(), "the MPS control program");
            found
        }
        None => {
            tracing::error!(
                program = %program.display(),
                "the MPS control program is neither on PATH nor in {}: no card's daemon starts until it is \
                 (is the node's NVIDIA runtime mounting the driver's programs into this container?)",
                DRIVER_BIN_DIRS.join(", ")
            );
            program
        }
    };
    if layout.pipe_in.is_some() != pipe_source.is_some() || (pipe_source.is_some() && card_index.is_none()) {
        return Err("a pipe directory of this pod's own (--mps-pipe-source, --mps-pipe-dir) is one card's: \
                    it needs --mps-card-index"
            .into());
    }
    // Each card's daemon names its own; one for every card would be an earlier supervisor's.
    let _ = std::fs::remove_file(layout.root.join(SHM_SOURCE));
    if shm_source.is_none() {
        let shm = layout.root.join("shm");
        std::fs::create_dir_all(&shm).map_err(|e| format!("{}: {e}", shm.display()))?
    }
    let mut exclusive = exclusive.map(Exclusive::new);
    let backends = std::sync::Arc::new(backends);
    let mut daemons: HashMap<String, Daemon> = HashMap::new();
    // Cards seen since this supervisor started (a card that goes and comes back is not new to it).
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    loop {
        let read = backends.clone();
        let (cards, errors) = tokio::task::spawn_blocking(move || read_all(&read))
            .await
            .map_err(|e| format!("reading the cards: {e}"))?;
        // A read that failed says nothing about which cards are gone: their daemons stay.
        let complete = errors.is_empty();
        for (backend, e) in errors {
            tracing::warn!(backend, error = %e, "inventory backend unavailable; the daemons are kept");
        }
        // A card NVML cannot read now keeps its daemon (its clients keep their server).
        let wanted: Vec<String> = cards
            .iter()
            .filter(|c| c.info.vendor == Vendor::Nvidia && !c.mig)
            .filter(|c| card_index.is_none_or(|i| c.info.index == i))
            .map(|c| c.info.uuid.clone())
            .collect();
        for uuid in &wanted {
            // Named before the daemon is recorded: the agent serves the card from then on.
            if let Err(e) = layout.name_shm(uuid, shm_source.as_deref()) {
                tracing::warn!(card = %uuid, error = %e, "cannot name the card's /dev/shm for its clients");
            }
            if let Err(e) = layout.name_pipe(uuid, pipe_source.as_deref()) {
                tracing::warn!(card = %uuid, error = %e, "cannot name the card's pipe directory for its clients");
            }
            let daemon = daemons.remove(uuid);
            let next = match daemon {
                Some(Daemon::Ours(mut child)) => match child.try_wait() {
                    Ok(None) => Daemon::Ours(child),
                    Ok(Some(status)) => {
                        tracing::warn!(card = %uuid, %status, "MPS control daemon stopped; starting it again");
                        waiting(Duration::from_secs(1))
                    }
                    Err(e) => {
                        tracing::warn!(card = %uuid, error = %e, "MPS control daemon cannot be waited on");
                        Daemon::Ours(child)
                    }
                },
                Some(Daemon::Adopted(pid)) if layout.is_daemon(pid) => Daemon::Adopted(pid),
                Some(Daemon::Waiting { until, backoff }) if Instant::now() < until => {
                    Daemon::Waiting { until, backoff }
                }
                earlier => {
                    let backoff = match earlier {
                        Some(Daemon::Waiting { backoff, .. }) => (backoff * 2).min(MAX_BACKOFF),
                        _ => Duration::from_secs(1),
                    };
                    let first = seen.insert(uuid.clone());
                    match layout.adoptable(uuid, first) {
                        Some(pid) => {
                            tracing::info!(card = %uuid, pid, "adopted the MPS control daemon running there");
                            Daemon::Adopted(pid)
                        }
                        None => match start(&layout, &program, uuid, first) {
                            Ok(child) => {
                                tracing::info!(card = %uuid, pid = child.id(), "MPS control daemon started");
                                Daemon::Ours(child)
                            }
                            Err(e) => {
                                tracing::error!(card = %uuid, error = %e, "MPS control daemon did not start");
                                waiting(backoff)
                            }
                        },
                    }
                }
            };
            let pid = match &next {
                Daemon::Ours(child) => child.id(),
                Daemon::Adopted(pid) => Some(*pid),
                Daemon::Waiting { .. } => None,
            };
            if let Err(e) = layout.keep_record(uuid, pid) {
                tracing::warn!(card = %uuid, error = %e, "cannot record the MPS control daemon's PID");
            }
            daemons.insert(uuid.clone(), next);
        }
        if let Some(exclusive) = exclusive.as_mut() {
            for uuid in &wanted {
                if matches!(daemons.get(uuid), Some(Daemon::Ours(_) | Daemon::Adopted(_))) {
                    exclusive.hold(&layout, &program, uuid).await;
                }
            }
        }
        // Cards gone (or now in MIG mode): their daemons of ours quit.
        let gone: Vec<String> = daemons.keys().filter(|u| complete && !wanted.contains(u)).cloned().collect();
        for uuid in gone {
            if let Some(Daemon::Ours(child)) = daemons.remove(&uuid) {
                quit(&layout, &program, &uuid, child).await;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            for (uuid, daemon) in daemons.drain() {
                if let Daemon::Ours(child) = daemon {
                    quit(&layout, &program, &uuid, child).await;
                }
            }
            if let Some(exclusive) = exclusive {
                exclusive.release(&layout).await;
            }
            return Ok(());
        }
    }
}

fn waiting(backoff: Duration) -> Daemon {
    Daemon::Waiting { until: Instant::now() + backoff, backoff }
}

/// Starts card `uuid`'s control daemon in the foreground (`-f`), as our child.
/// A pipe directory of this pod's own (`layout.pipe_in`) is, at the `first`
/// start for the card in this process, emptied: a daemon there died with an earlier container, and
/// what is left was written by shares. (Not after a daemon of ours stopped: the clients it served
/// may still hold their places there.)
fn start(layout: &Layout, program: &Path, uuid: &str, first: bool) -> std::io::Result<Child> {
    for dir in [layout.pipe(uuid), layout.log(uuid)] {
        std::fs::create_dir_all(&dir)?;
    }
    // What cannot be removed is left: the daemon starts all the same.
    if first
        && layout.pipe_in.is_some()
        && let Err(e) = empty(&layout.pipe(uuid))
    {
        tracing::warn!(card = %uuid, error = %e, "the card's pipe directory could not be emptied");
    }
    control_command(layout, program, uuid).arg("-f").stdin(Stdio::null()).kill_on_drop(true).spawn()
}

/// Removes everything in `dir`, never following a link (a link is removed, not what it names).
fn empty(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Runs the control program for card `uuid`'s daemon with `commands` on its input; its output, or
/// why there is none (it did not run or answer within 5 s).
async fn control(layout: &Layout, program: &Path, uuid: &str, commands: &str) -> Result<String, String> {
    let asked = async {
        let mut control = control_command(layout, program, uuid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        if let Some(mut input) = control.stdin.take() {
            input.write_all(commands.as_bytes()).await?;
        }
        control.wait_with_output().await
    };
    match tokio::time::timeout(Duration::from_secs(5), asked).await {
        Ok(Ok(out)) => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer in 5 s".into()),
    }
}

/// The cards held in `EXCLUSIVE_PROCESS` mode, and NVML to hold them.
struct Exclusive {
    lib: PathBuf,
    nvml: Option<std::sync::Arc<nvml_wrapper::Nvml>>,
    /// Cards this supervisor put in the mode (set back at the end), and the last problem said of each.
    held: HashMap<String, Option<String>>,
}

impl Exclusive {
    fn new(lib: PathBuf) -> Self {
        Exclusive { lib, nvml: None, held: HashMap::new() }
    }

    /// NVML, started on first use (a failed start is tried again next time).
    fn nvml(&mut self) -> Result<std::sync::Arc<nvml_wrapper::Nvml>, String> {
        if self.nvml.is_none() {
            let nvml = nvml_wrapper::Nvml::builder()
                .lib_path(self.lib.as_os_str())
                .init()
                .map_err(|e| format!("NVML from {}: {e}", self.lib.display()))?;
            self.nvml = Some(std::sync::Arc::new(nvml));
        }
        self.nvml.clone().ok_or_else(|| "NVML".into())
    }

    /// Card `uuid` in `EXCLUSIVE_PROCESS` mode with a server running, and marked so; a problem is
    /// logged once (and the mark removed, so the agent does not count on it) until it changes.
    async fn hold(&mut self, layout: &Layout, program: &Path, uuid: &str) {
        let mark = layout.card(uuid).join(EXCLUSIVE_MARK);
        let result = match self.nvml() {
            Ok(nvml) => {
                let card = uuid.to_owned();
                tokio::task::spawn_blocking(move || set_mode(&nvml, &card, ComputeMode::ExclusiveProcess))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            }
            Err(e) => Err(e),
        };
        let result = match result {
            Ok(()) => self.server(layout, program, uuid).await,
            Err(e) => Err(format!("setting EXCLUSIVE_PROCESS compute mode: {e}")),
        };
        let said = self.held.entry(uuid.to_owned()).or_default();
        match result {
            Ok(()) => {
                if !mark.is_file() {
                    if let Err(e) = std::fs::write(&mark, "EXCLUSIVE_PROCESS\n") {
                        tracing::warn!(card = %uuid, error = %e, "cannot mark the card exclusive");
                    } else {
                        tracing::info!(card = %uuid, "card in EXCLUSIVE_PROCESS mode with an MPS server up");
                    }
                }
                *said = None;
            }
            Err(e) => {
                let _ = std::fs::remove_file(&mark);
                if said.as_ref() != Some(&e) {
                    tracing::error!(card = %uuid, error = %e, "the card is not held exclusive to MPS");
                    *said = Some(e);
                }
            }
        }
    }

    /// An MPS server on card `uuid`: started (as root's) when the daemon lists none.
    async fn server(&self, layout: &Layout, program: &Path, uuid: &str) -> Result<(), String> {
        let servers = control(layout, program, uuid, "get_server_list\n").await?;
        if !servers.is_empty() {
            return Ok(());
        }
        let answer = control(layout, program, uuid, "start_server -uid 0\n").await?;
        // The real daemon lists a new server a moment after it was asked for one (on an H200 the
        // list asked at once was still empty; a second later it named the server).
        let mut servers = String::new();
        for _ in 0..10 {
            servers = control(layout, program, uuid, "get_server_list\n").await?;
            if !servers.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if servers.is_empty() {
            return Err(format!("start_server -uid 0 started no server in 2 s ({answer:?})"));
        }
        tracing::info!(card = %uuid, server = %servers, "MPS server started ahead of its clients");
        Ok(())
    }

    /// Every card this supervisor held goes back to `DEFAULT` and loses its mark.
    async fn release(mut self, layout: &Layout) {
        let Ok(nvml) = self.nvml() else { return };
        for uuid in self.held.into_keys() {
            let _ = std::fs::remove_file(layout.card(&uuid).join(EXCLUSIVE_MARK));
            let nvml = nvml.clone();
            let card = uuid.clone();
            let set = tokio::task::spawn_blocking(move || set_mode(&nvml, &card, ComputeMode::Default)).await;
            match set {
                Ok(Ok(())) => tracing::info!(card = %uuid, "card back in DEFAULT compute mode"),
                Ok(Err(e)) => tracing::warn!(card = %uuid, error = %e, "card not set back to DEFAULT"),
                Err(e) => tracing::warn!(card = %uuid, error = %e, "card not set back to DEFAULT"),
            }
        }
    }
}

use nvml_wrapper::enum_wrappers::device::ComputeMode;

/// Card `uuid` in compute mode `mode` (set only when it is not in it already).
fn set_mode(nvml: &nvml_wrapper::Nvml, uuid: &str, mode: ComputeMode) -> Result<(), String> {
    let mut device = nvml.device_by_uuid(uuid).map_err(|e| e.to_string())?;
    if device.compute_mode().is_ok_and(|m| m == mode) {
        return Ok(());
    }
    device.set_compute_mode(mode).map_err(|e| e.to_string())
}

/// Tells card `uuid`'s daemon to quit (`quit` on the control program's input), waiting up to 5 s
/// before killing it.
async fn quit(layout: &Layout, program: &Path, uuid: &str, mut child: Child) {
    if let Err(e) = control(layout, program, uuid, "quit\n").await {
        tracing::warn!(card = %uuid, error = %e, "asking the MPS control daemon to quit failed");
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait()).await.is_err() {
        tracing::warn!(card = %uuid, "MPS control daemon did not quit in 5 s; killing it");
        let _ = child.kill().await;
    }
    if let Err(e) = layout.keep_record(uuid, None) {
        tracing::warn!(card = %uuid, error = %e, "cannot remove the MPS control daemon's record");
    }
    tracing::info!(card = %uuid, "MPS control daemon stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_program_is_found_on_path_and_only_as_an_executable_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::Scratch::new("mps-find");
        let (plain, runnable) = (dir.join("plain"), dir.join("runnable"));
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::create_dir_all(&runnable).unwrap();
        let name = "nano-gpu-test-mps-control";
        std::fs::write(plain.join(name), "").unwrap();
        std::fs::write(runnable.join(name), "").unwrap();
        std::fs::set_permissions(runnable.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = std::env::join_paths([&plain, &runnable]).unwrap();
        // The file that is not executable is passed over; the one after it on PATH is taken.
        assert_eq!(find_control(Path::new(name), Some(&path)), Some(runnable.join(name)));
        // A name with a directory is taken as it is; a name found nowhere is none.
        assert_eq!(find_control(Path::new("./x/y"), None), Some(PathBuf::from("./x/y")));
        assert_eq!(find_control(Path::new(name), Some(plain.as_os_str())), None);
        // Its own directory comes first on the daemon's PATH.
        let first = std::env::split_paths(&control_path(&runnable.join(name)).unwrap()).next();
        assert_eq!(first, Some(runnable.clone()));
        assert_eq!(control_path(Path::new(name)), None);
    }

    #[test]
    fn a_daemon_is_running_only_while_its_record_names_a_control_process() {
        let root = std::env::temp_dir().join(format!("nano-gpu-mps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let proc_root = root.join("proc");
        let layout = Layout::new(root.clone(), proc_root.clone());
        let err = layout.daemon("GPU-a").unwrap_err();
        assert!(err.contains("not running") && err.contains(RECORD), "{err}");
        std::fs::create_dir_all(layout.pipe("GPU-a")).unwrap();
        std::fs::write(layout.record("GPU-a"), "garbage").unwrap();
        assert!(layout.daemon("GPU-a").unwrap_err().contains("holds \"garbage\""));
        layout.keep_record("GPU-a", Some(4242)).unwrap();
        assert!(layout.daemon("GPU-a").unwrap_err().contains("PID 4242"));
        std::fs::create_dir_all(proc_root.join("4242")).unwrap();
        std::fs::write(proc_root.join("4242/comm"), "bash\n").unwrap();
        assert!(layout.daemon("GPU-a").is_err(), "a reused PID is not the daemon");
        std::fs::write(proc_root.join("4242/comm"), "nvidia-cuda-mps\n").unwrap();
        assert_eq!(layout.daemon("GPU-a"), Ok(4242));
        // What the pipe directory holds does not count: the daemon's own PID file there may be gone
        // or name another process.
        assert!(layout.daemon_in_pipe("GPU-a").is_err());
        std::fs::write(layout.pipe("GPU-a").join(PID_FILE), "1\n").unwrap();
        assert_eq!(layout.daemon("GPU-a"), Ok(4242));
        layout.keep_record("GPU-a", None).unwrap();
        assert!(layout.daemon("GPU-a").is_err());
        layout.keep_record("GPU-a", None).unwrap();
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_cards_shm_is_the_directory_its_supervisor_named_else_the_roots() {
        let root = crate::Scratch::new("mps-shm");
        let layout = Layout::new(root.to_path_buf(), root.join("proc"));
        assert_eq!(layout.shm("GPU-a"), root.join("shm"));
        // An earlier supervisor's, for every card.
        let earlier = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/shm";
        std::fs::write(root.join(SHM_SOURCE), format!("{earlier}\n")).unwrap();
        assert_eq!(layout.shm("GPU-a"), Path::new(earlier));
        // Each card's own, once its supervisor named it.
        let (a, b) = (Path::new("/k/shm-0"), Path::new("/k/shm-1"));
        layout.name_shm("GPU-a", Some(a)).unwrap();
        layout.name_shm("GPU-b", Some(b)).unwrap();
        assert_eq!((layout.shm("GPU-a"), layout.shm("GPU-b")), (a.to_path_buf(), b.to_path_buf()));
        layout.name_shm("GPU-b", None).unwrap();
        assert_eq!(layout.shm("GPU-b"), Path::new(earlier));
        // Only an absolute path counts.
        std::fs::write(root.join(SHM_SOURCE), "relative/shm\n").unwrap();
        assert_eq!(layout.shm("GPU-b"), root.join("shm"));
    }

    /// A supervisor of one card with a pipe directory of its own (an emptyDir) names its host
    /// directory for the agent, which mounts it into the clients; a name beside another pod's
    /// `/dev/shm` (left by a supervisor that ran before an older one) is not trusted.
    #[test]
    fn a_pipe_directory_of_the_supervisors_own_is_named_for_the_agent_beside_its_shm() {
        let root = crate::Scratch::new("mps-pipes");
        let mut supervisor = Layout::new(root.to_path_buf(), root.join("proc"));
        let agent = supervisor.clone();
        assert_eq!(supervisor.pipe("GPU-a"), root.join("GPU-a/pipe"));
        assert_eq!(agent.client_pipe("GPU-a", &agent.shm("GPU-a")), root.join("GPU-a/pipe"));
        supervisor.pipe_in = Some(root.join("pipe-view"));
        assert_eq!(supervisor.pipe("GPU-a"), root.join("pipe-view"));
        let volumes = Path::new("/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir");
        supervisor.name_shm("GPU-a", Some(&volumes.join("shm-0"))).unwrap();
        supervisor.name_pipe("GPU-a", Some(&volumes.join("pipe-0"))).unwrap();
        assert_eq!(agent.client_pipe("GPU-a", &agent.shm("GPU-a")), volumes.join("pipe-0"));
        assert_eq!(
            agent.client_pipe("GPU-b", &agent.shm("GPU-b")),
            root.join("GPU-b/pipe"),
            "another card's is its own"
        );
        // Another pod's /dev/shm (an older supervisor named only that): the pipe name is stale.
        supervisor
            .name_shm(
                "GPU-a",
                Some(Path::new("/var/lib/kubelet/pods/v/volumes/kubernetes.io~empty-dir/shm-0")),
            )
            .unwrap();
        assert_eq!(agent.client_pipe("GPU-a", &agent.shm("GPU-a")), root.join("GPU-a/pipe"));
        supervisor.name_pipe("GPU-a", None).unwrap();
        assert_eq!(agent.client_pipe("GPU-a", &agent.shm("GPU-a")), root.join("GPU-a/pipe"));
        // A daemon is never adopted from the pod's own pipe directory, and the directory is emptied
        // (a link removed, not followed) before one starts.
        std::fs::create_dir_all(root.join("pipe-view/sub")).unwrap();
        std::fs::write(root.join("pipe-view").join(PID_FILE), "1\n").unwrap();
        std::os::unix::fs::symlink(root.join("GPU-b"), root.join("pipe-view/link")).unwrap();
        std::fs::create_dir_all(root.join("GPU-b")).unwrap();
        std::fs::write(root.join("GPU-b/kept"), "x").unwrap();
        assert_eq!(supervisor.adoptable("GPU-a", true), None);
        empty(&root.join("pipe-view")).unwrap();
        assert_eq!(std::fs::read_dir(root.join("pipe-view")).unwrap().count(), 0);
        // (A start makes it root's alone, as a pipe directory the supervisor makes is.)
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.join("pipe-view"), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(root.join("GPU-b/kept").is_file(), "the link's target was touched");
    }

    /// A share's root can tell its card's daemon `quit` and then name another process in the pipe
    /// directory's PID file: the supervisor adopts a daemon only when it first sees the card, and only
    /// a process that runs the control program, not the MPS server (whose `comm` is the same).
    #[test]
    fn only_a_control_program_found_at_the_start_is_adopted() {
        let root = crate::Scratch::new("mps-adopt");
        let layout = Layout::new(root.to_path_buf(), root.join("proc"));
        std::fs::create_dir_all(layout.pipe("GPU-a")).unwrap();
        let process = |pid: u32, cmdline: &[u8]| {
            let dir = root.join("proc").join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("comm"), "nvidia-cuda-mps\n").unwrap();
            std::fs::write(dir.join("cmdline"), cmdline).unwrap();
        };
        process(10, b"/usr/bin/nvidia-cuda-mps-control\0-d\0");
        process(11, b"nvidia-cuda-mps-server\0");
        let named =
            |pid: u32| std::fs::write(layout.pipe("GPU-a").join(PID_FILE), format!("{pid}\n")).unwrap();
        assert_eq!(layout.adoptable("GPU-a", true), None, "no PID file");
        named(10);
        assert_eq!(layout.adoptable("GPU-a", true), Some(10));
        assert_eq!(layout.adoptable("GPU-a", false), None, "a daemon of ours stopped: start one");
        named(11);
        assert_eq!(layout.adoptable("GPU-a", true), None, "the server is not the daemon");
    }

    /// A share's container can write in its card's pipe directory: what it puts in the PID file's
    /// place is refused at once, never read from (a FIFO would block the reader, `/dev/zero` never
    /// end), and the daemon the supervisor recorded still counts as running.
    #[test]
    fn a_fifo_or_a_link_in_place_of_the_pid_file_is_refused_without_waiting() {
        let root = std::env::temp_dir().join(format!("nano-gpu-mps-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let layout = Layout::new(root.clone(), root.join("proc"));
        std::fs::create_dir_all(layout.pipe("GPU-a")).unwrap();
        std::fs::create_dir_all(root.join("proc/7")).unwrap();
        std::fs::write(root.join("proc/7/comm"), "nvidia-cuda-mps\n").unwrap();
        layout.keep_record("GPU-a", Some(7)).unwrap();
        let file = layout.pipe("GPU-a").join(PID_FILE);
        let made = std::process::Command::new("mkfifo").arg(&file).status().unwrap();
        assert!(made.success());
        // A reader that waited on the FIFO would never answer: the test fails instead of hanging.
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = layout.clone();
        std::thread::spawn(move || tx.send(reader.daemon_in_pipe("GPU-a")));
        let err = rx.recv_timeout(Duration::from_secs(10)).expect("the PID file read waited").unwrap_err();
        assert!(err.contains("not a regular file"), "{err}");
        assert_eq!(layout.daemon("GPU-a"), Ok(7));
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        let err = layout.daemon_in_pipe("GPU-a").unwrap_err();
        assert!(err.contains("not running"), "{err}");
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, "1".repeat(1 << 20)).unwrap();
        assert!(
            layout.daemon_in_pipe("GPU-a").unwrap_err().contains("holds"),
            "a huge file is read only in part"
        );
        assert_eq!(layout.daemon("GPU-a"), Ok(7));
        let _ = std::fs::remove_dir_all(&root);
    }
}
