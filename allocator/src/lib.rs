//! The nano-gpu allocator: it decides, for the whole cluster, which node and which card(s) every GPU
//! pod gets.
//!
//! The placement engine itself (cluster model, requests, policies, workload, replay) is the pure crate
//! `nano-gpu-engine` beside this one (`allocator/engine/`); everything here is its adapters.
//!
//! Decisions (pure, tested without a cluster):
//! - [`extender`]: filter, prioritize and the card choice of bind on top of the engine.
//! - [`admission`]: the mutating webhook's decision (scheduler name, refusal of invalid requests).
//!
//! The service (`nano-gpu-allocator serve`), in the order a request flows:
//! - [`watch`] feeds [`state`] (the cluster view: decode, index, rebuild, reservations, preemption,
//!   `/inspect`) from Node and Pod watches, which decode only what the view reads ([`slim`]);
//! - [`server`] decodes HTTP requests and answers them from the view; `/bind` runs [`bind`] (the bind
//!   protocol: reserve, one binding that carries the assignment, read back) through [`binder`] (the API calls behind a port);
//! - [`evict`]: with `--evict-overruns`, the leader evicts the pods agents marked as over their GPU
//!   memory grant; [`victims`]: it evicts the pods preempted for a pod of higher priority;
//! - [`map`]: the GPU map page and its live data, on the loopback listener with `/inspect`;
//! - [`load`]: with `--prometheus-url`, each card's real utilisation for the engine's last tie rule;
//! - [`leader`] decides which replica may decide; [`tls`] serves the webhook over HTTPS;
//!   [`metrics`] renders the Prometheus text.
//!
//! Tools: [`sim`] (`simulate`: trace replay with the FGD paper's method, raw or through the
//! extender); [`cli`] (`inspect`, `top`, `why`, also the kubectl plugin `kubectl-nano_gpu`), with
//! [`inspect`] and [`top`] rendering their tables.

pub mod admission;
#[cfg(test)]
mod api_replies;
pub mod bind;
pub mod binder;
pub mod check;
pub mod claim;
pub mod cli;
pub mod dra;
pub mod evict;
pub mod extender;
pub mod handoff;
pub mod inspect;
pub mod leader;
pub mod load;
pub mod map;
pub mod metrics;
pub mod requeue;
pub mod server;
pub mod sim;
pub mod slim;
pub mod state;
pub mod tls;
pub mod top;
pub mod uninstall;
pub mod victims;
pub mod watch;
