//! The agent's command line: its flags (`Flags`, one per path and library, so tests run in temp
//! dirs), its subcommands, and what the flags select (resources, enforcement, inventory backends).

use crate::cards::inventory::{FakeFile, GpuInventory, NvmlInventory, SysfsDrm};
use crate::cards::resource;
use crate::commands::clean;
use crate::kubelet::plugin;
use crate::node::enforce;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Command-line flags of `nano-gpu-agent`. Every path and library name is a flag with the production
/// default, so tests run in temp dirs.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "nano-gpu-agent",
    version,
    about = "nano-gpu node agent (device plugin for nano-gpu/gpu-percent)"
)]
pub struct Flags {
    /// Name of this node (the Node object the agent annotates).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// This agent among the node's agents (the DaemonSet gives its pod's name): its plugin sockets
    /// are named after it (`nano-gpu.<instance>.sock`), so the new agent of a rollout serves and
    /// registers before the old one stops, and no pod is admitted while neither serves. Empty:
    /// `nano-gpu.sock`.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub instance: String,
    /// Directory of the kubelet's device-plugin sockets.
    #[arg(long, env = "NANO_GPU_PLUGIN_DIR", default_value = "/var/lib/kubelet/device-plugins")]
    pub plugin_dir: PathBuf,
    /// Where the agent serves its plugins for the keeper (`keeper`: the agent's parent process,
    /// which registers with the kubelet and relays its calls, so that a pod the kubelet admits while
    /// the agent restarts waits for it instead of failing). Unset: the agent registers itself.
    #[arg(long, env = "NANO_GPU_BACKEND_DIR")]
    pub backend_dir: Option<PathBuf>,
    /// How long the keeper holds a kubelet's call while the agent does not serve (then fails it),
    /// and keeps the devices healthy (then marks them unhealthy until the agent is back). The
    /// kubelet gives PreStartContainer 30 s.
    #[arg(long, env = "NANO_GPU_KEEPER_PATIENCE_SECONDS", default_value_t = 25, value_parser = clap::value_parser!(u64).range(1..))]
    pub keeper_patience_seconds: u64,
    /// Kubeconfig of the cluster; default: `KUBECONFIG`, `~/.kube/config`, in-cluster.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubelet's pod-resources socket.
    #[arg(
        long,
        env = "NANO_GPU_POD_RESOURCES",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pub pod_resources_socket: PathBuf,
    /// NVML library to load.
    #[arg(long, env = "NANO_GPU_NVML_LIB", default_value = "libnvidia-ml.so.1")]
    pub nvml_lib: PathBuf,
    /// Root of the sysfs tree: Intel cards, and the NUMA node of every card.
    #[arg(long, env = "NANO_GPU_SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// A JSON file describing fake cards (local clusters and demos) instead of NVML and sysfs.
    #[arg(long, env = "NANO_GPU_FAKE_INVENTORY")]
    pub fake_inventory: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "NANO_GPU_LOG_FORMAT", default_value = "plain", value_parser = ["plain", "json"])]
    pub log_format: String,
    /// Also hand NVIDIA cards to containers as CDI devices (`nvidia.com/gpu=<uuid>`): the same as
    /// adding `cdi` to `--device-list-strategy`.
    #[arg(long, env = "NANO_GPU_CDI")]
    pub cdi: bool,
    /// How NVIDIA cards are named to the runtime: `envvar` (`NVIDIA_VISIBLE_DEVICES`, which a pod's
    /// own env overrides), `volume-mounts` (`/dev/null` at `/var/run/nvidia-container-devices/<uuid>`,
    /// read first by a runtime set to accept them; a pod cannot change them), `cdi` (the CDI device
    /// `nvidia.com/gpu=<uuid>`, for runtimes with CDI: containerd 2, CRI-O), comma-separated. Without
    /// `envvar`, `NVIDIA_VISIBLE_DEVICES` is set to a value that names no card.
    #[arg(long, env = "NANO_GPU_DEVICE_LIST_STRATEGY", default_value = "envvar,volume-mounts")]
    pub device_list_strategy: plugin::DeviceList,
    /// Seconds without a critical XID before an unhealthy card is healthy again.
    #[arg(long, env = "NANO_GPU_XID_QUIET_SECONDS", default_value_t = 300)]
    pub xid_quiet_seconds: u64,
    /// Milliseconds a device-plugin call waits for the pod watch to show a pod the kubelet admits.
    #[arg(long, env = "NANO_GPU_IDENTITY_WAIT_MS", default_value_t = 3000)]
    pub identity_wait_ms: u64,
    /// Seconds in all a device-plugin call may spend finding the pod the kubelet admits when the pod
    /// watch does not show it: the node's pods are read from the API server, again every second while
    /// it cannot answer (a control-plane restart must not fail a pod). 0: refuse after the wait above.
    #[arg(long, env = "NANO_GPU_IDENTITY_PATIENCE_SECONDS", default_value_t = 60)]
    pub identity_patience_seconds: u64,
    /// Also serve gpushare's `aliyun.com/gpu-mem` (one device ID per unit of card memory) and set
    /// gpushare's environment, for workloads placed by the allocator's gpushare compatibility.
    #[arg(long, env = "NANO_GPU_GPUSHARE", value_enum)]
    pub gpushare: Option<GpushareUnitArg>,
    /// Address of the `/healthz` and `/readyz` probes; empty turns them off.
    #[arg(long, env = "NANO_GPU_PROBE_LISTEN", default_value = "0.0.0.0:9401")]
    pub probe_listen: String,
    /// Seconds between inventory refreshes (at least 1).
    #[arg(long, env = "NANO_GPU_REFRESH_SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub refresh_seconds: u64,
    /// Seconds between usage samples (per card and per process, served on `/metrics`); 0 turns
    /// sampling off.
    #[arg(long, env = "NANO_GPU_USAGE_SECONDS", default_value_t = 5)]
    pub usage_seconds: u64,
    /// The host's `/proc`, where GPU processes are mapped to their containers (the DaemonSet runs
    /// with `hostPID`, so its own `/proc` is the host's).
    #[arg(long, env = "NANO_GPU_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// Seconds a container may use more card memory than granted before a Warning Event and
    /// `nano_gpu_container_memory_overrun`.
    #[arg(long, env = "NANO_GPU_OVERRUN_GRACE_SECONDS", default_value_t = 60)]
    pub overrun_grace_seconds: u64,
    /// Root of the device nodes (`/dev`).
    #[arg(long, env = "NANO_GPU_DEV_ROOT", default_value = "/dev")]
    pub dev_root: PathBuf,
    /// How a share of an NVIDIA card is limited: `none` (the scheduler's accounting only), `mps`
    /// (MPS client limits; the daemons run by `mps-control`) or `hami-core` (an installed
    /// HAMi-core). The Node's `nano-gpu/enforcement` label wins over this flag.
    #[arg(long, env = "NANO_GPU_ENFORCEMENT", value_enum, default_value = "none")]
    pub enforcement: enforce::Mode,
    /// The driver's per-cgroup memory limit on each share's pod (NVML, driver r615+, cgroup v2):
    /// `driver` sets it at PreStartContainer and serves no NVIDIA card where it cannot be set;
    /// `none` leaves memory to the enforcement mode. Support is shown on the Node either way
    /// (`nano-gpu/memory-limit`).
    #[arg(long, env = "NANO_GPU_MEMORY_LIMIT", value_enum, default_value = "none")]
    pub memory_limit: enforce::driver::Asked,
    /// The host's cgroup v2 root, where pods' cgroups are found and named to the driver.
    #[arg(long, env = "NANO_GPU_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Host directory of the MPS daemons (one directory per card: its log, the supervisor's record,
    /// and the names of its `/dev/shm` and pipe directory, or the pipe directory itself).
    #[arg(long, env = "NANO_GPU_MPS_ROOT", default_value = "/run/nano-gpu/mps")]
    pub mps_root: PathBuf,
    /// NVIDIA's MPS control program, which `mps-control` runs once per card. A name without a
    /// directory is looked for on `PATH`, then where drivers put their programs
    /// (`/usr/local/nvidia/bin`, `/usr/bin`, `/run/nvidia/driver/usr/bin`,
    /// `/home/kubernetes/bin/nvidia/bin`).
    #[arg(long, env = "NANO_GPU_MPS_CONTROL", default_value = "nvidia-cuda-mps-control")]
    pub mps_control: PathBuf,
    /// `mps-control`: put each card in `EXCLUSIVE_PROCESS` compute mode and keep an MPS server
    /// running on it, so no process reaches the card except as a client of its daemon (set back to
    /// `DEFAULT` when it stops). Whole single cards then go through MPS too, unlimited; a container
    /// given several cards of such a node is refused.
    #[arg(long, env = "NANO_GPU_MPS_EXCLUSIVE_PROCESS")]
    pub mps_exclusive_process: bool,
    /// `mps-control`: the host directory of this container's `/dev/shm` (its pod's size-limited,
    /// memory-backed emptyDir: `<kubelet root>/pods/<pod uid>/volumes/kubernetes.io~empty-dir/<name>`),
    /// which the share containers of its cards get as theirs. Unset: `<mps root>/shm`, a host
    /// directory, not bounded.
    #[arg(long, env = "NANO_GPU_MPS_SHM_SOURCE")]
    pub mps_shm_source: Option<PathBuf>,
    /// `mps-control` with `--mps-card-index`: the host directory of its card's pipe directory (its
    /// pod's size-limited, memory-backed emptyDir, mounted at `--mps-pipe-dir`), which the card's
    /// share containers get. Unset: `<mps root>/<uuid>/pipe`, a host directory, not bounded.
    #[arg(long, env = "NANO_GPU_MPS_PIPE_SOURCE")]
    pub mps_pipe_source: Option<PathBuf>,
    /// `mps-control`: where this container sees the directory `--mps-pipe-source` names (emptied
    /// when this process first starts the card's daemon).
    #[arg(long, env = "NANO_GPU_MPS_PIPE_DIR", default_value = "/run/nano-gpu/mps-pipe")]
    pub mps_pipe_dir: PathBuf,
    /// `mps-control`: run the daemon of one card only, the NVIDIA card of this NVML index (the
    /// shipped DaemonSet runs one container per index, each with its own `/dev/shm`). Unset: every
    /// card's daemon, all sharing this container's `/dev/shm`.
    #[arg(long, env = "NANO_GPU_MPS_CARD_INDEX")]
    pub mps_card_index: Option<u32>,
    /// Host directory of an installed HAMi-core (`libvgpu.so` and its `ld.so.preload`).
    #[arg(long, env = "NANO_GPU_HAMI_CORE_DIR", default_value = "/usr/local/vgpu")]
    pub hami_core_dir: PathBuf,
    /// Host directory handed to HAMi-core shares as their lock directory (`/tmp/vgpulock`), which
    /// every share of the node may write. The shipped DaemonSet names a 1 MiB memory emptyDir of
    /// its pod; the default, the host's own `/tmp/vgpulock`, lets a share fill the host's `/tmp`.
    #[arg(long, env = "NANO_GPU_HAMI_LOCK_SOURCE", default_value = enforce::HAMI_LOCK)]
    pub hami_lock_source: PathBuf,
    /// Where the host's root is seen (host paths handed to containers are checked under it).
    #[arg(long, env = "NANO_GPU_HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,
    /// The runtime canary's report, shared with the `runtime-canary` container (`canary` writes it,
    /// the agent reads it every 10 s): a node whose runtime gave that container cards is not ready,
    /// labelled `nano-gpu/device-isolation=env-honoured` and warned about; unset: no canary.
    #[arg(long, env = "NANO_GPU_RUNTIME_CANARY")]
    pub runtime_canary: Option<PathBuf>,
    /// The annotation canary's report, written by the `annotation-canary` container (`canary` with
    /// `--runtime-canary` naming this file; the pod's annotation `cdi.k8s.io/nano-gpu-canary` asks
    /// every card): a node whose runtime gave it cards is not ready, labelled
    /// `nano-gpu/device-isolation=annotations-honoured` and warned about. Read with
    /// `--runtime-canary` only; unset: the env canary alone judges.
    #[arg(long, env = "NANO_GPU_ANNOTATION_CANARY", requires = "runtime_canary")]
    pub annotation_canary: Option<PathBuf>,
    /// Also serve the cards as a DRA driver (`gpu.nano-gpu.io`): publish the node's ResourceSlice,
    /// register with the kubelet's plugin registry and prepare the claims it names as CDI devices
    /// (needs a runtime with CDI, and a node name). The node then takes claims only (the allocator
    /// allocates them with `--dra`), no share of the device plugin's resources.
    #[arg(long, env = "NANO_GPU_DRA")]
    pub dra: bool,
    /// The kubelet's plugin registry, where the DRA plugin's registration socket goes.
    #[arg(long, env = "NANO_GPU_DRA_REGISTRY_DIR", default_value = "/var/lib/kubelet/plugins_registry")]
    pub dra_registry_dir: PathBuf,
    /// The DRA plugin's own directory, where its service socket goes.
    #[arg(long, env = "NANO_GPU_DRA_PLUGIN_DIR", default_value = "/var/lib/kubelet/plugins/gpu.nano-gpu.io")]
    pub dra_plugin_dir: PathBuf,
    /// The node's CDI spec directory, read by the container runtime: one spec per prepared claim.
    #[arg(long, env = "NANO_GPU_CDI_DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// What to do (default: run the agent).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// gpushare's memory unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GpushareUnitArg {
    /// GiB (gpushare's default).
    Gib,
    /// MiB (gpushare's `--memory-unit=MiB`).
    Mib,
}

impl Flags {
    /// The resources these flags serve: `nano-gpu/gpu-percent`, and gpushare's memory when asked.
    pub fn resources(&self) -> Vec<resource::Resource> {
        let mut all = vec![resource::Resource::Percent];
        if let Some(unit) = self.gpushare {
            all.push(resource::Resource::Gpushare(match unit {
                GpushareUnitArg::Gib => nano_gpu_proto::demand::GpushareUnit::GiB,
                GpushareUnitArg::Mib => nano_gpu_proto::demand::GpushareUnit::MiB,
            }));
        }
        all
    }
}

/// Subcommands.
#[derive(Clone, Debug, Subcommand)]
pub enum Command {
    /// Print the cards this node has, as the `nano-gpu/gpus` annotation and labels would carry them.
    Inventory,
    /// Run the agent (serving in `--backend-dir`) and hold the kubelet's side of its device plugins:
    /// register, keep the kubelet's device streams open and relay its calls, holding them while the
    /// agent restarts.
    Keeper,
    /// Run one MPS control daemon per NVIDIA card (not in MIG mode), starting again any that stops,
    /// under `--mps-root`: the daemons of nodes whose shares are enforced with MPS.
    MpsControl,
    /// The runtime canary (an unprivileged container of the agent's pod that asks no GPU and sets
    /// `NVIDIA_VISIBLE_DEVICES=all`): write the cards this container sees (NVML's, and the device
    /// nodes under `--dev-root`) to `--runtime-canary`, then wait for SIGTERM.
    Canary,
    /// Remove what nano-gpu left on this node's filesystem once its agents and MPS daemons are gone
    /// (`kubectl nano-gpu uninstall` runs it in a pod per node): the MPS directories, the plugin
    /// sockets, the DRA plugin's registration and directory, the claims' CDI specs.
    CleanNode(clean::Dirs),
}

impl Flags {
    /// How NVIDIA cards are named to the runtime: `--device-list-strategy`, with `cdi` added by
    /// `--cdi`.
    pub fn device_list(&self) -> plugin::DeviceList {
        plugin::DeviceList { cdi: self.device_list_strategy.cdi || self.cdi, ..self.device_list_strategy }
    }

    /// What mode `label` (the Node's `nano-gpu/enforcement`, if any) and `--enforcement` choose,
    /// with its host paths; a label that names no mode serves no card, with the reason.
    pub fn enforcement(&self, label: Option<&str>) -> enforce::Enforcement {
        match enforce::Mode::of_node(self.enforcement, label) {
            Ok(enforce::Mode::None) => enforce::Enforcement::None,
            Ok(enforce::Mode::Mps) => enforce::Enforcement::Mps(self.mps_layout()),
            Ok(enforce::Mode::HamiCore) => enforce::Enforcement::HamiCore(enforce::HamiCore {
                dir: self.hami_core_dir.clone(),
                host_root: self.host_root.clone(),
                lock: self.hami_lock_source.clone(),
            }),
            Err(why) => enforce::Enforcement::Invalid(why),
        }
    }

    /// Where the MPS daemons live.
    pub fn mps_layout(&self) -> enforce::mps::Layout {
        enforce::mps::Layout::new(self.mps_root.clone(), self.proc_root.clone())
    }

    /// The inventory backends these flags select: the fake file alone when given, otherwise NVML and
    /// sysfs drm (NVIDIA and Intel cards on one node are both served).
    pub fn backends(&self) -> Vec<Box<dyn GpuInventory>> {
        match &self.fake_inventory {
            Some(path) => vec![Box::new(FakeFile { path: path.clone() })],
            None => vec![
                Box::new(NvmlInventory::new(self.nvml_lib.clone()).with_sysfs(self.sysfs_root.clone())),
                Box::new(SysfsDrm::new(
                    self.sysfs_root.clone(),
                    self.dev_root.clone(),
                    self.proc_root.clone(),
                )),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_production_paths() {
        let f = Flags::try_parse_from(["nano-gpu-agent"]).unwrap();
        assert_eq!(f.plugin_dir, PathBuf::from("/var/lib/kubelet/device-plugins"));
        assert_eq!(f.nvml_lib, PathBuf::from("libnvidia-ml.so.1"));
        assert_eq!(f.sysfs_root, PathBuf::from("/sys"));
    }

    #[test]
    fn an_unknown_log_format_is_refused() {
        assert!(Flags::try_parse_from(["nano-gpu-agent", "--log-format", "xml"]).is_err());
    }
}
