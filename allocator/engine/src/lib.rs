//! The placement engine of nano-gpu: domain types and decisions, no runtime. An immutable view of the
//! cluster and a request go in, a decision comes out; no clock, no I/O, randomness only from a seeded
//! [`rng::Rng`] passed in. The extender service and `simulate` both decide through it, so a benchmark
//! number is a number about the product.
//!
//! - [`model`]: the cluster (nodes, cards, models) and the [`model::Grant`]s that change it.
//! - [`request`]: what a pod asks, in the engine's terms, and the one fitting procedure ([`request::fit`]).
//! - [`policy`]: how candidates are scored (binpack, spread, random, bestfit, fgd, fgd-balance).
//! - [`workload`]: the typical requests of the workload, which the FGD policies measure against.
//! - [`engine`]: evaluation with a per-node cache, commit and release, node order for ties.
//! - [`load`]: real utilisation per card as the last tie rule, when the caller has a fresh reading.
//! - [`trace`], [`replay`]: the openb trace format and one replay of it with the FGD paper's method.
//!
//! This crate depends on no async runtime, Kubernetes client or server framework;
//! `tests/purity.rs` fails if one is added.

pub mod engine;
pub mod load;
pub mod model;
pub mod policy;
pub mod replay;
pub mod request;
pub mod rng;
pub mod trace;
pub mod workload;
