//! The nano-gpu allocator: it decides, for the whole cluster, which node and which card(s) every GPU
//! pod gets.
//!
//! The placement engine itself (cluster model, requests, policies, workload, replay) is the pure crate
//! `nano-gpu-engine` beside this one (`allocator/engine/`); everything here is its adapters.
//!
//! - [`extender`]: the scheduler-extender decisions (filter, prioritize, bind) on top of the engine.
//! - [`state`], [`binder`], [`server`], [`metrics`]: the extender service: the cluster view fed by
//!   watches, the API calls of a bind, the HTTP routes, the Prometheus text.
//! - [`sim`]: trace replay with the method of the FGD paper, for measuring policies.

pub mod admission;
pub mod bind;
pub mod binder;
pub mod extender;
pub mod inspect;
pub mod leader;
pub mod metrics;
pub mod server;
pub mod sim;
pub mod state;
pub mod tls;
pub mod watch;
