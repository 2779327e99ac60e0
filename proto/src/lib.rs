//! Every contract that crosses a process boundary in nano-gpu, each with exactly one Rust definition.
//!
//! - [`resources`]: the resource names pods ask for and [`demand`] reads a pod's GPU demand from a
//!   `k8s_openapi` Pod (per container: a share of one card, whole cards, memory; init containers
//!   combined as the kubelet combines them).
//! - [`annotations`]: the node inventory (`nano-gpu/gpus`) the agent publishes and the assignment
//!   (`nano-gpu/assignment`) the allocator writes at bind, versioned JSON that fails closed.
//! - [`device_id`]: the virtual device IDs a card advertises to the kubelet.
//! - [`extender`]: the kube-scheduler extender v1 wire types, with Go's exact field names.
//!
//! Nothing in this crate does I/O; everything is a value with an encoder, a decoder and golden tests.

pub mod admission;
pub mod annotations;
#[cfg(feature = "client")]
pub mod client;
pub mod demand;
pub mod device_id;
pub mod extender;
pub mod gpushare;
pub mod kubelet;
pub mod quantity;
pub mod resources;
pub mod units;

pub use units::{CpuMilli, MiB, Percent};
