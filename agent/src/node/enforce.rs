//! Enforcement of each share with what NVIDIA ships, chosen per node (`--enforcement`, or the Node's
//! `nano-gpu/enforcement` label, which wins): `none` (the default: a share is a reservation the
//! scheduler keeps), `mps` (one MPS control daemon per card, run by `nano-gpu-agent mps-control`;
//! each share container gets its own compute and memory limits as MPS client env) or `hami-core`
//! (an operator-installed HAMi-core on the node; its env and mounts per container).
//!
//! Only shares are limited: a container given whole cards gets them as in `none`. A card the mode
//! cannot limit now (MPS: in MIG mode, or its daemon is not running; HAMi-core: not installed) is
//! served unhealthy with the reason as its fault, so the kubelet gives it to nobody: a share is never
//! handed out unlimited under a mode that promises a limit. The pods with shares on a card whose
//! daemon stopped are told with a Warning Event (`MpsDaemonLost`) by [`crate::serve::daemons`].

pub mod driver;
pub mod mps;

use crate::cards::inventory::Card;
use crate::node::publish::Carried;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::kubelet::deviceplugin::{ContainerAllocateResponse, Mount};
use nano_gpu_proto::units::MiB;
use std::path::{Path, PathBuf};
use tokio::sync::watch;

/// The Node label that chooses the mode of its agent.
pub use nano_gpu_proto::annotations::ENFORCEMENT_LABEL as NODE_LABEL;

/// How shares are enforced on a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Not enforced: the scheduler's accounting only.
    #[default]
    None,
    /// NVIDIA MPS: per-client active-thread percentage and pinned device memory limit.
    Mps,
    /// HAMi-core (`libvgpu.so`), installed on the node by the operator.
    HamiCore,
}

impl Mode {
    /// The mode named `text` as the label and flag spell it.
    pub fn parse(text: &str) -> Result<Mode, String> {
        match text {
            "none" => Ok(Mode::None),
            "mps" => Ok(Mode::Mps),
            "hami-core" => Ok(Mode::HamiCore),
            other => Err(format!("{NODE_LABEL}={other:?} is not a mode (none, mps, hami-core)")),
        }
    }

    /// The mode of a node: its label's when it has one, else the flag's.
    pub fn of_node(flag: Mode, label: Option<&str>) -> Result<Mode, String> {
        label.map_or(Ok(flag), Mode::parse)
    }
}

/// The HAMi-core an operator installed: its host directory holds `libvgpu.so` and the
/// `ld.so.preload` that names it (HAMi's `vgpu-init.sh` writes both; default `/usr/local/vgpu`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HamiCore {
    /// The host directory.
    pub dir: PathBuf,
    /// Where the agent sees the host's root (`/` outside a container; the DaemonSet mounts the
    /// host's `/usr/local` under `/host`).
    pub host_root: PathBuf,
    /// The host directory handed to shares as HAMi-core's lock directory ([`HAMI_LOCK`]): the
    /// shipped DaemonSet's is a 1 MiB tmpfs (an emptyDir of the agent's pod), so no share can fill
    /// the node's disk through it.
    pub lock: PathBuf,
}

/// Where HAMi-core is mounted in a container (HAMi's own path, so its tools find it).
pub const HAMI_IN_CONTAINER: &str = "/usr/local/vgpu";
/// HAMi-core's lock directory in a container, shared by the node's HAMi-core shares.
pub const HAMI_LOCK: &str = "/tmp/vgpulock";
/// HAMi-core's shared-region file: in the container's own `/tmp`, so per container.
pub const HAMI_CACHE: &str = "/tmp/cudevshr.cache";

impl HamiCore {
    /// Why HAMi-core cannot limit shares here, if it cannot.
    pub fn missing(&self) -> Option<String> {
        let seen = self.host_root.join(self.dir.strip_prefix("/").unwrap_or(&self.dir));
        let file = ["libvgpu.so", "ld.so.preload"].into_iter().find(|f| !seen.join(f).is_file())?;
        Some(format!(
            "enforcement hami-core: {} not found on the host (install HAMi-core on this node, or choose \
             another mode)",
            self.dir.join(file).display()
        ))
    }
}

/// A mode with the host paths it hands containers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Enforcement {
    /// Nothing beyond the card.
    #[default]
    None,
    /// MPS daemons laid out under a root.
    Mps(mps::Layout),
    /// HAMi-core from a host directory.
    HamiCore(HamiCore),
    /// The node's label names no mode: no card is served until it does (the reason).
    Invalid(String),
}

/// One container's share of one card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    /// Percent of the card's compute (1..=99).
    pub percent: u32,
    /// Memory granted.
    pub memory: MiB,
}

fn mount(host: &Path, container: &str, read_only: bool) -> Mount {
    Mount { container_path: container.into(), host_path: host.display().to_string(), read_only }
}

impl Enforcement {
    /// The mode's name.
    pub fn name(&self) -> &'static str {
        match self {
            Enforcement::None => Mode::None.name(),
            Enforcement::Mps(_) => Mode::Mps.name(),
            Enforcement::HamiCore(_) => Mode::HamiCore.name(),
            Enforcement::Invalid(_) => "invalid",
        }
    }

    /// Adds what limits a container to `share` of NVIDIA card `uuid` (the only card it sees, so its
    /// CUDA ordinal 0) to `response`.
    pub fn limit(&self, uuid: &str, share: Share, response: &mut ContainerAllocateResponse) {
        let env = &mut response.envs;
        match self {
            Enforcement::None | Enforcement::Invalid(_) => {}
            Enforcement::Mps(_) => {
                env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), share.percent.to_string());
                env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={}M", share.memory.0));
                self.mps_client(uuid, response);
            }
            Enforcement::HamiCore(hami) => {
                env.insert("CUDA_DEVICE_MEMORY_LIMIT_0".into(), format!("{}m", share.memory.0));
                env.insert("CUDA_DEVICE_SM_LIMIT".into(), share.percent.to_string());
                env.insert("CUDA_DEVICE_MEMORY_SHARED_CACHE".into(), HAMI_CACHE.into());
                let lib = format!("{HAMI_IN_CONTAINER}/libvgpu.so");
                response.mounts.push(mount(&hami.dir.join("libvgpu.so"), &lib, true));
                response.mounts.push(mount(&hami.dir.join("ld.so.preload"), "/etc/ld.so.preload", true));
                response.mounts.push(mount(&hami.lock, HAMI_LOCK, false));
            }
        }
    }

    /// Under `mps`: makes the container a client of card `uuid`'s daemon (its pipe directory,
    /// read-only), without limits of its own. The container keeps a `/dev/shm` of its own: the
    /// daemon's is not mounted, so no share reads or writes another's shared memory there, and no
    /// share can fill, replace or remove what the card's other shares find in the pipe directory. On
    /// the cards measured (H200, driver 580.159.04: `hack/gpu-check-reports/2026-12-04-*`,
    /// `confined_clients`), a client with its own `/dev/shm` and its pipe directory read-only reached
    /// the card through MPS with its limits held, and the server of two clients put nothing in the
    /// daemon's `/dev/shm`.
    pub fn mps_client(&self, uuid: &str, response: &mut ContainerAllocateResponse) {
        if let Enforcement::Mps(layout) = self {
            response.envs.insert("CUDA_MPS_PIPE_DIRECTORY".into(), mps::PIPE_IN_CONTAINER.into());
            let shm = layout.shm(uuid);
            response.mounts.push(mount(&layout.client_pipe(uuid, &shm), mps::PIPE_IN_CONTAINER, true));
        }
    }

    /// Whether card `uuid` is reachable only through MPS (`mps` with the card held in
    /// `EXCLUSIVE_PROCESS` mode by `mps-control --mps-exclusive-process`).
    pub fn exclusive(&self, uuid: &str) -> bool {
        matches!(self, Enforcement::Mps(layout) if layout.exclusive(uuid))
    }

    /// Why shares of `card` cannot be limited now, if they cannot.
    pub fn refusal(&self, card: &Card) -> Option<String> {
        match self {
            Enforcement::None => None,
            Enforcement::Invalid(why) => Some(format!("enforcement: {why}; no card is served until it does")),
            other if card.info.vendor != Vendor::Nvidia => Some(format!(
                "enforcement {}: only NVIDIA cards can be limited; this card is served to nobody",
                other.name()
            )),
            Enforcement::Mps(_) if card.mig => {
                Some("enforcement mps: the card is in MIG mode, which MPS shares do not support here".into())
            }
            Enforcement::Mps(layout) => layout.daemon(&card.info.uuid).err().map(|why| {
                if layout.card(&card.info.uuid).is_dir() {
                    return why;
                }
                // No supervisor has ever run for it: the shipped pod has one container per index.
                let index = card.info.index;
                format!(
                    "{why}; no MPS supervisor has run for this card yet: the MPS pod needs a container \
                     with NANO_GPU_MPS_CARD_INDEX={index} (deploy/mps.yaml runs cards 0 to 7)"
                )
            }),
            Enforcement::HamiCore(hami) => hami.missing(),
        }
    }

    /// Marks unhealthy, with the reason as its fault, every card whose shares cannot be limited now.
    pub fn apply(&self, cards: &mut [Card]) {
        crate::cards::health::refuse(cards, |card| self.refusal(card));
    }
}

impl Mode {
    /// The mode as the flag and label spell it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Mps => "mps",
            Mode::HamiCore => "hami-core",
        }
    }
}

/// What to say when the Node's `label` now chooses another mode than `current`, the one the agent
/// enforces (`flag`: `--enforcement`); `None` while they agree.
pub fn relabelled(flag: Mode, current: &Enforcement, label: Option<&str>) -> Option<String> {
    let now = match Mode::of_node(flag, label) {
        Ok(mode) => mode.name(),
        Err(_) => "invalid",
    };
    (now != current.name()).then(|| {
        format!(
            "the Node's {NODE_LABEL} label now chooses {now} (label {:?}), the agent enforces {}: \
             restarting to apply it",
            label.unwrap_or(""),
            current.name()
        )
    })
}

/// The Node's `nano-gpu/enforcement` label, once the agent's watch on its Node ([`watch_node`])
/// has shown the Node; `None` when `stop` flips first.
///
/// [`watch_node`]: crate::node::publish::watch_node
pub async fn node_label(
    mut seen: watch::Receiver<Option<Carried>>,
    mut stop: watch::Receiver<bool>,
) -> Option<Option<String>> {
    loop {
        if let Some(node) = &*seen.borrow_and_update() {
            return Some(node.enforcement.clone());
        }
        tokio::select! {
            changed = seen.changed() => changed.ok()?,
            _ = stop.changed() => return None,
        }
    }
}

/// Follows the Node's label through the agent's watch on its Node and, once it chooses another
/// mode than `current`, says so and flips `stop`: the agent stops, and its container starts again
/// with the new mode (a changed label never leaves shares under a mode the node no longer asks
/// for, unnoticed). Returns only if the watch ended (its task's end ends the agent).
pub async fn restart_on_relabel(
    mut seen: watch::Receiver<Option<Carried>>,
    flag: Mode,
    current: Enforcement,
    stop: std::sync::Arc<watch::Sender<bool>>,
) {
    while seen.changed().await.is_ok() {
        let label = seen.borrow_and_update().as_ref().map(|n| n.enforcement.clone());
        let Some(label) = label else { continue };
        if let Some(why) = relabelled(flag, &current, label.as_deref()) {
            tracing::warn!("{why}");
            let _ = stop.send(true);
            return std::future::pending().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nvidia(uuid: &str) -> Card {
        Card::nvidia(0, uuid, "H100", MiB(81_559), None)
    }

    #[test]
    fn the_label_wins_over_the_flag_and_a_garbled_one_is_an_error() {
        assert_eq!(Mode::of_node(Mode::Mps, None), Ok(Mode::Mps));
        assert_eq!(Mode::of_node(Mode::None, Some("hami-core")), Ok(Mode::HamiCore));
        assert_eq!(Mode::of_node(Mode::Mps, Some("none")), Ok(Mode::None));
        let err = Mode::of_node(Mode::None, Some("MPS ")).unwrap_err();
        assert!(err.contains("\"MPS \" is not a mode (none, mps, hami-core)"), "{err}");
        for m in [Mode::None, Mode::Mps, Mode::HamiCore] {
            assert_eq!(Mode::parse(m.name()), Ok(m));
        }
    }

    #[test]
    fn a_label_that_chooses_another_mode_is_noticed() {
        let mps = Enforcement::Mps(mps::Layout::new("/r", "/proc"));
        assert_eq!(relabelled(Mode::None, &mps, Some("mps")), None);
        assert_eq!(relabelled(Mode::Mps, &mps, None), None);
        let why = relabelled(Mode::None, &mps, None).unwrap();
        assert!(why.contains("now chooses none") && why.contains("enforces mps"), "{why}");
        assert!(relabelled(Mode::None, &Enforcement::None, Some("mps")).is_some());
        let invalid = Enforcement::Invalid("x".into());
        assert_eq!(relabelled(Mode::None, &invalid, Some("bogus")), None);
        assert!(relabelled(Mode::None, &invalid, Some("none")).is_some());
    }

    #[test]
    fn an_mps_share_gets_its_own_limits_and_the_cards_pipe() {
        // A root of its own: the host's /run/nano-gpu/mps may name a supervisor's /dev/shm.
        let root = std::env::temp_dir().join(format!("nano-gpu-mps-share-{}", std::process::id()));
        let layout = mps::Layout::new(root.clone(), "/proc");
        let mut r = ContainerAllocateResponse::default();
        Enforcement::Mps(layout).limit("GPU-a", Share { percent: 30, memory: MiB(2048) }, &mut r);
        assert_eq!(r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
        assert_eq!(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=2048M");
        assert_eq!(r.envs["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/nvidia-mps");
        let mounts: Vec<_> =
            r.mounts.iter().map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only)).collect();
        // The card's pipe directory, read-only, and not the daemon's /dev/shm: the container keeps its
        // own.
        let pipe = root.join("GPU-a/pipe").display().to_string();
        assert_eq!(mounts, [(pipe.as_str(), "/tmp/nvidia-mps", true)]);
    }

    #[test]
    fn a_hami_core_share_gets_its_env_and_mounts() {
        let lock = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/hami-lock";
        let hami = HamiCore { dir: "/usr/local/vgpu".into(), host_root: "/".into(), lock: lock.into() };
        let mut r = ContainerAllocateResponse::default();
        Enforcement::HamiCore(hami).limit("GPU-a", Share { percent: 70, memory: MiB(6144) }, &mut r);
        assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "6144m");
        assert_eq!(r.envs["CUDA_DEVICE_SM_LIMIT"], "70");
        assert_eq!(r.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"], HAMI_CACHE);
        let preload = r.mounts.iter().find(|m| m.container_path == "/etc/ld.so.preload").unwrap();
        assert_eq!((preload.host_path.as_str(), preload.read_only), ("/usr/local/vgpu/ld.so.preload", true));
        let locks: Vec<_> = r.mounts.iter().filter(|m| m.container_path == HAMI_LOCK).collect();
        assert_eq!(locks.len(), 1);
        assert_eq!((locks[0].host_path.as_str(), locks[0].read_only), (lock, false));
    }

    #[test]
    fn cards_a_mode_cannot_limit_are_unhealthy_with_the_reason() {
        let dir = std::env::temp_dir().join(format!("nano-gpu-enforce-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // The agent sees the host's /usr/local/vgpu under a root of its own.
        let hami = Enforcement::HamiCore(HamiCore {
            dir: "/usr/local/vgpu".into(),
            host_root: dir.clone(),
            lock: HAMI_LOCK.into(),
        });
        let mut cards = vec![nvidia("GPU-a")];
        hami.apply(&mut cards);
        assert!(!cards[0].info.healthy);
        let fault = cards[0].fault.as_deref().unwrap();
        assert!(fault.contains("/usr/local/vgpu/libvgpu.so not found on the host"), "{fault}");
        std::fs::create_dir_all(dir.join("usr/local/vgpu")).unwrap();
        for f in ["libvgpu.so", "ld.so.preload"] {
            std::fs::write(dir.join("usr/local/vgpu").join(f), "").unwrap();
        }
        let mut cards = vec![nvidia("GPU-a")];
        hami.apply(&mut cards);
        assert!(cards[0].info.healthy && cards[0].fault.is_none());

        let mps = Enforcement::Mps(mps::Layout::new(dir.clone(), dir.join("proc")));
        let mut cards = vec![nvidia("GPU-a"), Card { mig: true, ..nvidia("GPU-m") }];
        mps.apply(&mut cards);
        let fault = cards[0].fault.as_deref().unwrap();
        assert!(fault.contains("MPS control daemon"), "{fault}");
        // No supervisor ever ran for the card: which container it needs.
        assert!(fault.contains("a container with NANO_GPU_MPS_CARD_INDEX=0"), "{fault}");
        assert!(cards[1].fault.as_deref().unwrap().contains("MIG mode"));
        // One did (its directory is there): the daemon is down, nothing more to say.
        std::fs::create_dir_all(dir.join("GPU-a")).unwrap();
        let mut cards = vec![nvidia("GPU-a")];
        mps.apply(&mut cards);
        let fault = cards[0].fault.as_deref().unwrap();
        assert!(fault.contains("MPS control daemon") && !fault.contains("CARD_INDEX"), "{fault}");
        let mut none = vec![nvidia("GPU-a")];
        Enforcement::None.apply(&mut none);
        assert!(none[0].info.healthy);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
