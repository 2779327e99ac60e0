//! The nano-gpu node agent: reads the node's cards (NVML for NVIDIA, sysfs drm for Intel), serves the
//! kubelet device-plugin API for `nano-gpu/gpu-percent`, and hands each container the card(s) the
//! allocator chose.
//!
//! With a node name, the agent publishes its cards on the Node, watches the node's pods and tells
//! containers apart without a lock: steering in GetPreferredAllocation, cards derived from the IDs in
//! Allocate, verify-and-repair after PreStartContainer.
//!
//! - [`cards`]: what the node has: the cards (NVML, sysfs drm, a fake file), what each served
//!   resource's IDs mean on them, their health (XID events and recovery, refusals).
//! - [`node`]: what the agent reads from and writes on its node: the Node's inventory annotation and
//!   labels, how each share is limited (MPS, HAMi-core, the driver's memory limit) and the MPS
//!   daemons' directories, the node's pods and which container a call is for (pure, fed by its
//!   node-scoped pod watch), the kubelet's pod-resources client, `/healthz` and `/readyz`.
//! - [`kubelet`]: what the agent serves the kubelet: the register protocol that survives kubelet
//!   restarts and rollouts, the device-plugin gRPC service and its parts (IDs, container edits,
//!   identity, socket), the DRA kubelet plugin beside it over the same cards and container edits
//!   (`--dra`: ResourceSlices, prepare and unprepare, CDI specs), the keeper (the agent's parent
//!   process, so the kubelet's side outlives an agent crash), the kubelet's device checkpoint kept
//!   free of pods that left, and the cards another device plugin serves, which nano-gpu serves to
//!   nobody.
//! - [`serve`]: what the agent keeps doing while it serves: its main loop and the tasks it owns,
//!   who uses what on every card (NVML samples, PIDs to containers), `/metrics` and the
//!   memory-overrun watchdog, the watch on the MPS daemons, the background worker (Events,
//!   verify-and-repair of starting containers), the runtime canary.
//! - [`commands`]: the command line (every path a flag, so tests run in temp dirs) and what it
//!   selects, and each command's body: the agent that serves, the keeper, `clean-node` (what it
//!   removes from a node at uninstall), `inventory`, `mps-control`, `canary`.

pub mod cards;
pub mod commands;
pub mod kubelet;
pub mod node;
pub mod serve;

#[cfg(test)]
mod scratch;

pub use commands::flags::{Command, Flags, GpushareUnitArg};
#[cfg(test)]
pub(crate) use scratch::Scratch;
