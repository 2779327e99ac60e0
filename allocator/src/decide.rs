//! The decisions, pure and tested without a cluster: each takes what the view or a request says and
//! returns what to do, with no I/O.
//!
//! - [`extender`]: filter, prioritize and the card choice of bind on top of the engine.
//! - [`admission`]: the mutating webhook's decision (scheduler name, refusal of invalid requests).
//! - [`claim`]: which cards a ResourceClaim of nano-gpu's driver gets, and the allocation written back.

pub mod admission;
pub mod claim;
pub mod extender;
