//! The running service (`nano-gpu-allocator serve`), in the order a request flows:
//!
//! - [`watch`] feeds the view ([`crate::state`]) from Node and Pod watches;
//! - [`server`] decodes HTTP requests and answers them from the view; `/bind` runs [`bind`] (the bind
//!   protocol: reserve, one binding that carries the assignment, read back) through [`bind_api`]
//!   (the API calls behind a port); [`handoff`] holds the next pod's filter until the last bind
//!   reserved its cards; [`requeue`] sends refused pods back to kube-scheduler's queue once the view
//!   changed;
//! - [`dra`]: ResourceClaims of nano-gpu's driver allocated and written back;
//! - [`overrun_evict`]: with `--evict-overruns`, the leader evicts the pods agents marked as over their
//!   GPU memory grant; [`preempt_evict`]: it evicts the pods preempted for a pod of higher priority;
//! - [`map_page`]: the GPU map page and its live data, on the loopback listener with `/inspect`;
//! - [`load`]: with `--prometheus-url`, each card's real utilisation for the engine's last tie rule;
//! - [`leader`] decides which replica may decide; [`tls`] serves the webhook over HTTPS;
//!   [`metrics`] renders the Prometheus text. Their owner is `nano_gpu_runtime::tasks`: the first
//!   loop that ends or panics ends the service.

pub mod bind;
pub mod bind_api;
pub mod dra;
pub mod handoff;
pub mod leader;
pub mod load;
pub mod map_page;
pub mod metrics;
pub mod overrun_evict;
pub mod preempt_evict;
pub mod requeue;
pub mod server;
pub mod tls;
pub mod watch;
