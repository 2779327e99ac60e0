//! The extended resources the agent serves: `nano-gpu/gpu-percent` (100 IDs per card, one per
//! percent), and with gpushare compatibility `aliyun.com/gpu-mem` (one ID per GiB or MiB of card
//! memory, as gpushare's device plugin advertised it), each on its own socket.

use crate::cards::inventory::Card;
use nano_gpu_proto::annotations::CardGrant;
use nano_gpu_proto::demand::GpushareUnit;
use nano_gpu_proto::device_id;
use nano_gpu_proto::resources::{GPU_PERCENT, GPUSHARE_MEMORY};
use nano_gpu_proto::units::{MiB, Percent};

/// A resource the agent serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// `nano-gpu/gpu-percent`.
    Percent,
    /// gpushare's `aliyun.com/gpu-mem`, in this unit.
    Gpushare(GpushareUnit),
}

impl Resource {
    /// The resource name the kubelet knows.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Percent => GPU_PERCENT,
            Resource::Gpushare(_) => GPUSHARE_MEMORY,
        }
    }

    /// The plugin's socket file name in the kubelet's device-plugin directory for agent `instance`
    /// (its pod's name; empty: `nano-gpu.sock`). Two agents of one node (the new one of a rollout
    /// starts before the old one stops) serve on two sockets.
    pub fn socket(self, instance: &str) -> String {
        match instance {
            "" => format!("{}.sock", self.stem()),
            _ => format!("{}.{instance}.sock", self.stem()),
        }
    }

    /// Whether `file` is a socket name of this resource's plugin (of any instance).
    pub fn is_socket(self, file: &str) -> bool {
        self.instance_of(file).is_some()
    }

    /// The agent instance a socket file of this resource's plugin is named after (`""` for
    /// `nano-gpu.sock`, `x.1` for `nano-gpu.x.1.sock`); `None` when it is not one.
    pub fn instance_of(self, file: &str) -> Option<&str> {
        match file.strip_prefix(self.stem())?.strip_suffix(".sock")? {
            "" => Some(""),
            middle => middle.strip_prefix('.').filter(|m| !m.is_empty()),
        }
    }

    fn stem(self) -> &'static str {
        match self {
            Resource::Percent => "nano-gpu",
            Resource::Gpushare(_) => "nano-gpu-gpushare",
        }
    }

    /// The device IDs a card advertises.
    pub fn ids(self, card: &Card) -> Vec<String> {
        match self {
            Resource::Percent => {
                (0..device_id::IDS_PER_CARD).map(|n| device_id::encode(&card.info.uuid, n)).collect()
            }
            Resource::Gpushare(unit) => (0..unit.units_in(card.info.memory_mib))
                .map(|n| device_id::encode_unit(&card.info.uuid, n))
                .collect(),
        }
    }

    /// Memory `n` IDs stand for, for a gpushare resource.
    pub fn memory_of(self, n: u64) -> Option<MiB> {
        match self {
            Resource::Percent => None,
            Resource::Gpushare(unit) => unit.to_mib(n),
        }
    }

    /// The card's memory in the resource's units (gpushare's `ALIYUN_COM_GPU_MEM_DEV`).
    pub fn card_units(self, card: &Card) -> u64 {
        match self {
            Resource::Percent => u64::from(device_id::IDS_PER_CARD),
            Resource::Gpushare(unit) => unit.units_in(card.info.memory_mib),
        }
    }

    /// How many of a container's `size` IDs its grant `g` may hold: its percent, or (memory, where
    /// a share is one card) all of them.
    pub fn quota(self, g: &CardGrant, size: usize) -> usize {
        match self {
            Resource::Percent => g.percent.0 as usize,
            Resource::Gpushare(_) => size,
        }
    }

    /// The grant of a container holding `n` IDs on `card`, for a repaired assignment; a percent
    /// grant keeps the memory it had.
    pub fn grant(self, card: &Card, n: u64, memory: Option<MiB>) -> CardGrant {
        let (percent, memory_mib) = match self.memory_of(n) {
            None => (n.min(100), memory),
            Some(m) => {
                (m.0.saturating_mul(100).div_ceil(card.info.memory_mib.0.max(1)).clamp(1, 100), Some(m))
            }
        };
        CardGrant {
            uuid: card.info.uuid.clone(),
            index: card.info.index,
            percent: Percent(percent as u32),
            memory_mib,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_agent_has_its_own_socket_and_knows_the_others() {
        let gib = Resource::Gpushare(GpushareUnit::GiB);
        assert_eq!(Resource::Percent.socket(""), "nano-gpu.sock");
        assert_eq!(Resource::Percent.socket("nano-gpu-agent-x7k2p"), "nano-gpu.nano-gpu-agent-x7k2p.sock");
        assert_eq!(gib.socket("a"), "nano-gpu-gpushare.a.sock");
        for (file, percent, gpushare) in [
            ("nano-gpu.sock", true, false),
            ("nano-gpu.old-pod.sock", true, false),
            ("nano-gpu-gpushare.sock", false, true),
            ("nano-gpu-gpushare.old-pod.sock", false, true),
            ("nano-gpu..sock", false, false),
            ("kubelet.sock", false, false),
            ("nvidia-gpu.sock", false, false),
        ] {
            assert_eq!(
                (Resource::Percent.is_socket(file), gib.is_socket(file)),
                (percent, gpushare),
                "{file}"
            );
        }
    }

    #[test]
    fn a_card_advertises_percent_slots_or_memory_units() {
        let card = Card::nvidia(2, "GPU-a", "T4", MiB(15360), None);
        assert_eq!(Resource::Percent.ids(&card).len(), 100);
        let gib = Resource::Gpushare(GpushareUnit::GiB);
        assert_eq!(gib.ids(&card).len(), 15);
        assert_eq!(gib.ids(&card)[14], "GPU-a-m14");
        assert_eq!(gib.card_units(&card), 15);
        let g = gib.grant(&card, 3, None);
        assert_eq!((g.index, g.percent, g.memory_mib), (2, Percent(20), Some(MiB(3072))));
        let p = Resource::Percent.grant(&card, 30, Some(MiB(1)));
        assert_eq!((p.percent, p.memory_mib), (Percent(30), Some(MiB(1))));
    }
}
