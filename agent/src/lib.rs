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
//! - [`plugin`]: the device-plugin gRPC service and its parts (IDs, container edits, identity, socket).
//!   [`coexist`]: the cards another device plugin serves, which nano-gpu serves to nobody.
//! - [`repair`]: the background worker (Events, verify-and-repair of starting containers);
//!   [`checkpoint`]: the kubelet's device checkpoint kept free of pods that left.
//! - [`run`]: the agent's main loop and its background tasks; [`kubelet`]: the serve/register
//!   protocol that survives kubelet restarts and rollouts; [`keeper`]: the agent's parent process,
//!   registering through that protocol and relaying to the agent, so the kubelet's side outlives an
//!   agent crash.
//! - [`flags`]: the command line (every path a flag, so tests run in temp dirs) and what it selects.
//! - [`clean`]: what `clean-node` removes from a node at uninstall.
//! - [`daemons`]: the agent's watch on the MPS daemons.
//! - [`dra`]: the DRA kubelet plugin beside the device plugin, over the same cards and container
//!   edits (`--dra`): ResourceSlices, prepare and unprepare, CDI specs.
//! - [`usage`]: who uses what on every card (NVML samples, PIDs to containers), `/metrics`, the
//!   memory-overrun watchdog.

pub mod canary;
pub mod cards;
pub mod checkpoint;
pub mod clean;
pub mod coexist;
pub mod daemons;
pub mod dra;
pub mod flags;
pub mod keeper;
pub mod kubelet;
pub mod node;
pub mod plugin;
pub mod repair;
pub mod run;
pub mod usage;

#[cfg(test)]
mod scratch;

pub use flags::{Command, Flags, GpushareUnitArg};
#[cfg(test)]
pub(crate) use scratch::Scratch;
