//! The nano-gpu allocator: it decides, for the whole cluster, which node and which card(s) every GPU
//! pod gets.
//!
//! - [`model`], [`request`]: the cluster and what pods ask, in the engine's terms.
//! - [`policy`], [`workload`], [`engine`]: the pure placement engine (no I/O, no clock; randomness only
//!   from a seeded [`rng::Rng`]), shared by the extender and by `simulate`.
//! - [`extender`]: the scheduler-extender decisions (filter, prioritize, bind) on top of the engine.
//! - [`state`], [`binder`], [`server`], [`metrics`]: the extender service: the cluster view fed by
//!   watches, the API calls of a bind, the HTTP routes, the Prometheus text.
//! - [`sim`]: trace replay with the method of the FGD paper, for measuring policies.

pub mod admission;
pub mod binder;
pub mod engine;
pub mod extender;
pub mod inspect;
pub mod leader;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod request;
pub mod rng;
pub mod server;
pub mod sim;
pub mod state;
pub mod tls;
pub mod watch;
pub mod workload;
