//! The reasons of the Kubernetes Events nano-gpu records (every one of type `Warning`).
//!
//! One enum, so that every reason the agent and the allocator can give an Event is named here and
//! nowhere else: the book's catalogue (`docs/src/reference/events.md`, cause and fix per reason) is
//! checked against [`Reason::ALL`] by the docs test.

use std::fmt;

/// Why an Event was recorded; its [`Reason::as_str`] is the Event's `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Allocator, on a pod: its `nano-gpu/assignment` cannot be read; its node's cards count as full.
    InvalidAssignment,
    /// Allocator, on a pod: it carries an assignment but asks no GPU (or asks one that cannot be
    /// read), so the assignment is not counted.
    IgnoredAssignment,
    /// Allocator, on a pending pod: its GPU request cannot be read (a request the webhook would
    /// refuse, or a `nano-gpu/gpu-model` over its limits), so no card is given to it.
    InvalidGpuRequest,
    /// Allocator, on a Node: its `nano-gpu/gpus` inventory cannot be read; its cards count as full.
    InvalidInventory,
    /// Allocator, on a pod gpushare placed: the card its annotations name is not on its node.
    GpushareCardUnknown,
    /// Allocator, on a pod: a card of its node is over 100 % with it (the assignments disagree with
    /// what the kubelet handed out); no pod is placed on that node until they agree again.
    Overcommitted,
    /// Allocator's leader, on a pod: evicted for staying over its GPU memory grant.
    GpuMemoryOverrunEvicted,
    /// Allocator's leader, on a pod: over its grant, but the eviction is refused (a
    /// PodDisruptionBudget); tried again.
    GpuMemoryOverrunEvictionBlocked,
    /// Agent, on a pod (or its Node): the kubelet asked devices for a container that no assignment
    /// can serve; the container is refused.
    NoUsableAssignment,
    /// Agent, on a pod: the kubelet gave a container other cards than its assignment names (its
    /// devices are the kubelet's to choose once admitted); the assignment now says what it got.
    AssignmentRepaired,
    /// Agent, on a pod: a container used more GPU memory than granted for longer than the grace.
    GpuMemoryOverrun,
    /// Agent, on a pod: the MPS control daemon of a card it has a share of stopped or was replaced.
    MpsDaemonLost,
    /// Allocator's leader, on a pod that uses claims of nano-gpu's DeviceClass: its claims cannot be
    /// allocated (none of the nodes whose agent serves DRA takes them, or a claim asks what nano-gpu
    /// does not allocate); the message says why.
    ClaimNotAllocated,
    /// Allocator's leader, on a pod: evicted to make room for a pod of higher priority that
    /// kube-scheduler's preemption cannot help (its claims nano-gpu allocates, or a GPU share that no
    /// card has room for).
    Preempted,
    /// Allocator's leader, on a pod waiting for a GPU share: evicting a pod of lower priority
    /// preempted for it failed or was refused (a PodDisruptionBudget); it preempts again later.
    PreemptionFailed,
    /// Allocator, on a ResourceClaim: its allocation names a device of nano-gpu's driver that is no
    /// card of its node, or devices of several nodes; that node's cards count as full.
    InvalidAllocation,
    /// Agent, on its Node: the container runtime gave an unprivileged container cards it did not ask
    /// for through its env; the node serves no GPU pod until the runtime is fixed.
    RuntimeHonoursPodEnv,
    /// Agent, on its Node: the container runtime gave an unprivileged container that asks no GPU the
    /// cards its pod's `cdi.k8s.io/` annotation names; the node serves no GPU pod until the runtime
    /// is fixed.
    RuntimeHonoursPodAnnotations,
    /// `kubectl nano-gpu uninstall`, on a pod still Pending for `nano-gpu-scheduler`: no scheduler
    /// serves that name any more.
    Uninstalled,
}

impl Reason {
    /// Every reason, in the order of the catalogue.
    pub const ALL: [Reason; 19] = [
        Reason::InvalidAssignment,
        Reason::IgnoredAssignment,
        Reason::InvalidGpuRequest,
        Reason::InvalidInventory,
        Reason::GpushareCardUnknown,
        Reason::Overcommitted,
        Reason::GpuMemoryOverrunEvicted,
        Reason::GpuMemoryOverrunEvictionBlocked,
        Reason::NoUsableAssignment,
        Reason::AssignmentRepaired,
        Reason::GpuMemoryOverrun,
        Reason::MpsDaemonLost,
        Reason::ClaimNotAllocated,
        Reason::Preempted,
        Reason::PreemptionFailed,
        Reason::InvalidAllocation,
        Reason::RuntimeHonoursPodEnv,
        Reason::RuntimeHonoursPodAnnotations,
        Reason::Uninstalled,
    ];

    /// The Event's `reason` field (UpperCamelCase, as Kubernetes' own reasons).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidAssignment => "InvalidAssignment",
            Reason::IgnoredAssignment => "IgnoredAssignment",
            Reason::InvalidGpuRequest => "InvalidGpuRequest",
            Reason::InvalidInventory => "InvalidInventory",
            Reason::GpushareCardUnknown => "GpushareCardUnknown",
            Reason::Overcommitted => "Overcommitted",
            Reason::GpuMemoryOverrunEvicted => "GpuMemoryOverrunEvicted",
            Reason::GpuMemoryOverrunEvictionBlocked => "GpuMemoryOverrunEvictionBlocked",
            Reason::NoUsableAssignment => "NoUsableAssignment",
            Reason::AssignmentRepaired => "AssignmentRepaired",
            Reason::GpuMemoryOverrun => "GpuMemoryOverrun",
            Reason::MpsDaemonLost => "MpsDaemonLost",
            Reason::ClaimNotAllocated => "ClaimNotAllocated",
            Reason::Preempted => "Preempted",
            Reason::PreemptionFailed => "PreemptionFailed",
            Reason::InvalidAllocation => "InvalidAllocation",
            Reason::RuntimeHonoursPodEnv => "RuntimeHonoursPodEnv",
            Reason::RuntimeHonoursPodAnnotations => "RuntimeHonoursPodAnnotations",
            Reason::Uninstalled => "Uninstalled",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Reason;

    #[test]
    fn every_reason_is_listed_once_and_spelled_as_its_variant() {
        let names: std::collections::BTreeSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for r in Reason::ALL {
            assert_eq!(format!("{r:?}"), r.as_str());
            assert!(r.as_str().chars().all(|c| c.is_ascii_alphanumeric()) && r.as_str().len() <= 128);
        }
    }
}
