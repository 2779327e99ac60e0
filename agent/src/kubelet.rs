//! What the agent serves the kubelet, and how it keeps serving it: the register protocol that
//! survives kubelet restarts and rollouts ([`register`]), the device-plugin gRPC service and its
//! parts ([`plugin`]), the DRA kubelet plugin beside it over the same cards and edits ([`dra`]),
//! the agent's parent process that keeps the kubelet's side up across an agent crash ([`keeper`]),
//! the kubelet's device checkpoint kept free of pods that left ([`checkpoint`]), and the cards
//! another device plugin serves, which nano-gpu serves to nobody ([`coexist`]).

pub mod checkpoint;
pub mod coexist;
pub mod dra;
pub mod keeper;
pub mod plugin;
pub mod register;
