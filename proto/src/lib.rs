//! Every contract that crosses a process boundary in nano-gpu, each with exactly one Rust definition.
//!
//! - [`resources`]: the resource names pods ask for and [`demand`] reads a pod's GPU demand from a
//!   `k8s_openapi` Pod (per container: a share of one card, whole cards, memory; init containers
//!   combined as the kubelet combines them).
//! - [`annotations`]: the node inventory (`nano-gpu/gpus`) the agent publishes and the assignment
//!   (`nano-gpu/assignment`) the allocator writes at bind, versioned JSON that fails closed.
//! - [`device_id`]: the virtual device IDs a card advertises to the kubelet.
//! - [`dra`]: the names the DRA driver and the allocator agree on (driver, capacities, devices).
//! - [`events`]: the reasons of the Events the agent and the allocator record.
//! - [`install`]: what the install makes outside its namespace and leaves on nodes (for `uninstall`).
//! - [`extender`]: the kube-scheduler extender v1 wire types, with Go's exact field names.
//! - [`kubelet`]: the kubelet's gRPC APIs (device plugin v1beta1, pod-resources v1), generated from
//!   `api/*.proto`, with the client and server stubs tonic generates.
//! - [`admission`], [`gpushare`], [`quantity`], [`units`]: the webhook's AdmissionReview, gpushare's
//!   pod annotations and env, Kubernetes quantities, and the unit newtypes every payload uses.
//!
//! Nothing in this crate does I/O: every contract is a value with an encoder, a decoder and golden
//! tests (connecting to anything is in `nano-gpu-runtime`). Features: `k8s` (what is read from
//! Kubernetes objects: [`demand`], [`extender`], [`gpushare`]) and `grpc` ([`kubelet`]), both default;
//! without them the crate needs only serde, which is what the pure placement engine uses.

pub mod admission;
pub mod annotations;
#[cfg(feature = "k8s")]
pub mod demand;
pub mod device_id;
pub mod dra;
pub mod events;
#[cfg(feature = "k8s")]
pub mod extender;
#[cfg(feature = "k8s")]
pub mod gpushare;
pub mod install;
#[cfg(feature = "grpc")]
pub mod kubelet;
pub mod quantity;
pub mod resources;
pub mod units;

pub use units::{CpuMilli, MiB, Percent};
