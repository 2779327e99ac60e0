//! The nano-gpu allocator: it decides, for the whole cluster, which node and which card(s) every GPU
//! pod gets.
//!
//! The placement engine itself (cluster model, requests, policies, workload, replay) is the pure crate
//! `nano-gpu-engine` beside this one (`allocator/engine/`); everything here is its adapters, one folder
//! per job, each using only the ones listed before it:
//!
//! - [`decide`]: the decisions, pure (the extender's verbs, the webhook's, a claim's cards);
//! - [`state`]: the cluster view the decisions read (decode, index, rebuild, reservations,
//!   preemption, `/inspect`), fed by the watches;
//! - [`service`]: `nano-gpu-allocator serve`, the HTTP routes, watches, bind, leader election and the
//!   background loops;
//! - [`commands`]: what a person runs (`inspect`, `top`, `why`, `check`, `uninstall`);
//! - [`sim`]: `simulate`, trace replay with the FGD paper's method, raw or through the extender.

#[cfg(test)]
mod api_replies;
pub mod commands;
pub mod decide;
pub mod service;
pub mod sim;
pub mod state;
