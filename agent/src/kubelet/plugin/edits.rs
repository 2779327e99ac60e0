//! Container edits: what one container gets for the IDs the kubelet chose: the card(s) as
//! `NVIDIA_VISIBLE_DEVICES`, as volume mounts the NVIDIA runtime reads (and CDI names), or Intel
//! device nodes, the share's env, and gpushare's env for `aliyun.com/gpu-mem`.
//!
//! A container's own `env` comes after the device plugin's, so `NVIDIA_VISIBLE_DEVICES` is the pod's
//! to change. The volume mounts are not: `/dev/null` at `/var/run/nvidia-container-devices/<uuid>`,
//! which nvidia-container-runtime reads as the container's device list when its configuration says
//! `accept-nvidia-visible-devices-as-volume-mounts = true`, before any environment variable, and a
//! pod under Pod Security `baseline` cannot mount `/dev/null` itself (no hostPath volumes).

use super::devices::derive;
use crate::cards::inventory::Card;
use crate::cards::resource::Resource;
use crate::node::enforce::driver::MemoryLimit;
use crate::node::enforce::{Enforcement, Share};
use nano_gpu_proto::annotations::{CardGrant, Vendor};
use nano_gpu_proto::gpushare;
use nano_gpu_proto::kubelet::deviceplugin::{CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount};
use nano_gpu_proto::units::{MiB, Percent};
use tonic::Status;

/// Where the NVIDIA runtime reads a container's device list from mounts (`/dev/null` at
/// `<root>/<device>`).
pub const DEVICE_LIST_MOUNTS: &str = "/var/run/nvidia-container-devices";

/// How NVIDIA cards are named to the runtime (`--device-list-strategy`): NVIDIA's device plugin's
/// names and meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceList {
    /// `envvar`: `NVIDIA_VISIBLE_DEVICES=<uuids>`.
    pub envvar: bool,
    /// `volume-mounts`: `/dev/null` at `/var/run/nvidia-container-devices/<uuid>` per card.
    pub volume_mounts: bool,
    /// `cdi`: the CDI device `nvidia.com/gpu=<uuid>` per card, which a runtime with CDI (containerd
    /// 2, CRI-O) resolves from the node's CDI specs (`nvidia-ctk cdi generate` writes NVIDIA's); a
    /// pod cannot name CDI devices itself.
    pub cdi: bool,
}

impl Default for DeviceList {
    /// Both: the env for nodes whose runtime reads only it, the mounts (which win there) for nodes set
    /// up as the README says.
    fn default() -> Self {
        DeviceList { envvar: true, volume_mounts: true, cdi: false }
    }
}

impl std::str::FromStr for DeviceList {
    type Err = String;

    /// A comma list of `envvar`, `volume-mounts` and `cdi`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut list = DeviceList { envvar: false, volume_mounts: false, cdi: false };
        for word in s.split(',').map(str::trim) {
            match word {
                "envvar" => list.envvar = true,
                "volume-mounts" => list.volume_mounts = true,
                "cdi" => list.cdi = true,
                other => {
                    return Err(format!(
                        "device list strategy {other:?}: the strategies are envvar, volume-mounts and cdi, \
                         comma-separated"
                    ));
                }
            }
        }
        Ok(list)
    }
}

/// How containers are given their cards beyond the environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    /// How NVIDIA cards are named to the runtime (`--cdi` is its `cdi`).
    pub devices: DeviceList,
    /// How a share of an NVIDIA card is limited.
    pub enforcement: Enforcement,
    /// Whether a share's pod also gets the driver's memory limit (set at PreStartContainer).
    pub memory: MemoryLimit,
}

impl Edits {
    /// Marks unhealthy, with the reason, every card whose shares cannot be limited as promised.
    pub fn apply(&self, cards: &mut [Card]) {
        crate::cards::health::refuse(cards, |c| {
            self.enforcement.refusal(c).or_else(|| self.memory.refusal(c))
        });
    }

    /// What holds a share on this node to its size against a tenant who does not cooperate, in one
    /// line (the README's guarantee table for these settings); `/readyz` says it.
    pub fn guarantee(&self) -> String {
        let limits = match &self.enforcement {
            Enforcement::None => "shares: not limited (the scheduler's accounting only)",
            Enforcement::Mps(_) => {
                "shares: MPS limits set in each process's own environment, which a tenant can raise to the \
                 daemon's defaults, and a process that ignores CUDA_MPS_PIPE_DIRECTORY gets the whole card \
                 unless the card is held in EXCLUSIVE_PROCESS mode (advisory against a hostile tenant)"
            }
            Enforcement::HamiCore(_) => {
                "shares: HAMi-core limits set in each process's own environment, which a tenant can change \
                 (advisory against a hostile tenant)"
            }
            Enforcement::Invalid(_) => "shares: none served (the node's enforcement label names no mode)",
        };
        let memory = match self.memory {
            MemoryLimit::Driver(_) => "; memory: the driver's per-pod limit, which a tenant cannot raise",
            _ => "",
        };
        format!("{limits}{memory}")
    }
}

/// The container an Allocate is for, as far as the agent could tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Its grants in the pod's assignment.
    pub grants: Vec<CardGrant>,
    /// What its whole pod asks of the resource (gpushare's `ALIYUN_COM_GPU_MEM_POD`).
    pub pod_units: u64,
}

/// What one container gets for the device IDs of `resource` the kubelet chose: the cards come from
/// the IDs; the memory from its grants when it asked memory, else its share of the cards' memory; a
/// share of one NVIDIA card (less than the whole card) is limited as `edits.enforcement` says.
pub fn allocate(
    cards: &[Card],
    ids: &[String],
    claimed: Option<&Claimed>,
    resource: Resource,
    edits: &Edits,
) -> Result<ContainerAllocateResponse, Status> {
    let got = derive(cards, ids)?;
    container_edits(&got, claimed, resource, edits)
}

/// What one container gets for `got`: each card with how many units of `resource` it holds there
/// (the core both front ends share: the device plugin derives `got` from the kubelet's IDs, the DRA
/// plugin from a claim's allocation, which is in percent).
pub fn container_edits(
    got: &[(&Card, u32)],
    claimed: Option<&Claimed>,
    resource: Resource,
    edits: &Edits,
) -> Result<ContainerAllocateResponse, Status> {
    let mut response = ContainerAllocateResponse::default();
    let mut nvidia = Vec::new();
    for (card, _) in got {
        match card.info.vendor {
            Vendor::Nvidia => nvidia.push(card.info.uuid.clone()),
            Vendor::Intel => response.devices.extend(card.device_nodes.iter().map(|p| DeviceSpec {
                container_path: p.display().to_string(),
                host_path: p.display().to_string(),
                permissions: "rw".into(),
            })),
        }
    }
    if !nvidia.is_empty() {
        if edits.devices.cdi {
            response.cdi_devices =
                nvidia.iter().map(|u| CdiDevice { name: format!("nvidia.com/gpu={u}") }).collect();
        }
        // Without the env strategy the image's own value (CUDA images say `all`) is replaced by one
        // that names no card, so a runtime that reads only the env fails the container rather than
        // give it every card, as NVIDIA's device plugin does.
        let visible = if edits.devices.envvar { nvidia.join(",") } else { DEVICE_LIST_MOUNTS.into() };
        response.envs.insert("NVIDIA_VISIBLE_DEVICES".into(), visible);
        if edits.devices.volume_mounts {
            response.mounts.extend(nvidia.iter().map(|u| Mount {
                container_path: format!("{DEVICE_LIST_MOUNTS}/{u}"),
                host_path: "/dev/null".into(),
                read_only: true,
            }));
        }
    }
    let count: u32 = got.iter().map(|(_, n)| n).sum();
    let grants = claimed.map(|c| c.grants.as_slice());
    let asked_memory = grants.filter(|g| !g.is_empty() && g.iter().all(|g| g.memory_mib.is_some()));
    let memory: u64 = match (resource.memory_of(u64::from(count)), asked_memory) {
        (Some(m), _) => m.0,
        (None, Some(g)) => g.iter().filter_map(|g| g.memory_mib).map(|m| m.0).sum(),
        (None, None) => got.iter().map(|(c, n)| Percent(*n).of(c.info.memory_mib).0).sum(),
    };
    let uuids: Vec<&str> = got.iter().map(|(c, _)| c.info.uuid.as_str()).collect();
    let env = &mut response.envs;
    match resource {
        Resource::Percent => {
            env.insert("NANO_GPU_PERCENT".into(), count.to_string());
        }
        Resource::Gpushare(_) => {
            // What gpushare's device plugin set, for workloads and tools that read it.
            let (card, _) = got[0];
            env.insert(gpushare::IDX.into(), card.info.index.to_string());
            env.insert(gpushare::CONTAINER.into(), count.to_string());
            let pod = claimed.map_or(u64::from(count), |c| c.pod_units.max(u64::from(count)));
            env.insert(gpushare::POD.into(), pod.to_string());
            env.insert(gpushare::DEV.into(), resource.card_units(card).to_string());
        }
    }
    env.insert("NANO_GPU_MEMORY_MIB".into(), memory.to_string());
    env.insert("NANO_GPU_CARDS".into(), uuids.join(","));
    if let [(card, n)] = got
        && card.info.vendor == Vendor::Nvidia
    {
        let (n, units) = (u64::from(*n), resource.card_units(card));
        if n < units {
            // A share: its percent of the card's compute (rounded up), and the memory it holds.
            let percent = u32::try_from((n * 100).div_ceil(units)).unwrap_or(100);
            let share = Share { percent, memory: MiB(memory) };
            edits.enforcement.limit(&card.info.uuid, share, &mut response);
        } else if edits.enforcement.exclusive(&card.info.uuid) {
            // A whole card only MPS's server may hold: the container reaches it as a client.
            edits.enforcement.mps_client(&card.info.uuid, &mut response);
        }
    } else if let Some(held) = nvidia.iter().find(|u| edits.enforcement.exclusive(u)) {
        return Err(Status::failed_precondition(format!(
            "enforcement mps: card {held} is reachable only through its MPS daemon (EXCLUSIVE_PROCESS \
             compute mode), and a process can be the client of one daemon only: a container given \
             {} cards cannot use them on this node",
            nvidia.len()
        )));
    }
    Ok(response)
}
