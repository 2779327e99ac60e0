//! Placement policies: how a feasible node is scored and which card(s) on it a request gets.
//!
//! A policy is a pure function of one node and one request (plus the [`Context`]: the target workload
//! and the pressure on each card model), so the engine can cache its value per node version. Higher
//! scores win; `tiebreak` orders equal scores (lexicographically); the engine breaks what is still
//! equal (by node order, or uniformly at random for `random`).

mod fgd;
pub mod first_fit;
mod simple;

pub use fgd::{Fgd, FgdBalance};
pub use first_fit::FirstFitCards;
pub use simple::{BestFit, Binpack, Random, Spread};

use crate::model::Grant;
use crate::model::Node;
use crate::request::{Reason, Request};
use crate::workload::Workload;

/// A node's value for a request under a policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Eval {
    /// Higher is better.
    pub score: f64,
    /// Orders equal scores, first element first; higher is better.
    pub tiebreak: [f64; 2],
    /// The card(s) each slot gets on this node.
    pub grants: Vec<Grant>,
    /// What the policy keeps beside the value to [`Policy::refine`] it cheaply (0 if it does not).
    pub basis: f64,
}

/// What a policy may know beyond the node and the request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Context {
    /// The target workload.
    pub workload: Workload,
    /// Per card model ([`crate::model::ModelId`]), the model-constrained demand per card of that model
    /// in the cluster ([`Workload::pressure`]).
    pub pressure: Vec<f64>,
    /// The CPU the workload asks per card (GPU pods' and CPU-only pods') over the CPU the cluster has
    /// per card: above 1, CPU runs out before the cards do.
    pub cpu_load: f64,
    /// The share of its cards that the most pressed model's constrained pods will ask once the
    /// workload has filled the cluster's cards (0 without model constraints).
    pub model_load: f64,
}

impl Context {
    /// The context of `workload` on a cluster with `supply` cards per model and `cpu_per_card`
    /// millicores per card.
    pub fn new(workload: Workload, supply: &[u32], cpu_per_card: f64) -> Self {
        let asked = workload.cpu_per_card + workload.cpu_only_per_card;
        let cpu_load = if cpu_per_card > 0.0 { asked / cpu_per_card } else { 0.0 };
        let pressure = workload.pressure(supply);
        // Pods that fill the cluster's cards, times each model's constrained cards per pod and card.
        let cards: u64 = supply.iter().map(|&n| u64::from(n)).sum();
        let pods_to_fill =
            if workload.cards_per_pod > 0.0 { cards as f64 / workload.cards_per_pod } else { 0.0 };
        let model_load = pressure.iter().fold(0.0, |m: f64, p| m.max(p * pods_to_fill));
        Context { pressure, workload, cpu_load, model_load }
    }
}

/// How the engine breaks ties that remain after `score` and `tiebreak`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ties {
    /// The first node in the (seeded) node order.
    NodeOrder,
    /// Uniformly at random (seeded).
    Uniform,
}

/// A placement policy.
pub trait Policy: Send + Sync {
    /// Name on the command line.
    fn name(&self) -> &'static str;

    /// Scores `req` on `node` and picks its cards, or says why it does not fit. The request's host
    /// memory may count only through [`crate::request::host_check`].
    fn evaluate(&self, node: &Node, req: &Request, ctx: &Context) -> Result<Eval, Reason>;

    /// A key for a request's host CPU on `node`. Two requests that differ only in host CPU and
    /// memory, with equal keys here and the same outcome of [`crate::request::host_check`], get the
    /// same value from [`Policy::evaluate`] up to [`Policy::refine`]. The default key is the CPU
    /// itself: no two CPU requests share a value.
    fn cpu_band(&self, _node: &Node, cpu: u64, _ctx: &Context) -> u64 {
        cpu
    }

    /// Turns `eval`, the value of a request of the same band (see [`Policy::cpu_band`]), into the
    /// value of `req`.
    fn refine(&self, _node: &Node, _req: &Request, _eval: &mut Eval, _ctx: &Context) {}

    /// How remaining ties are broken.
    fn ties(&self) -> Ties {
        Ties::NodeOrder
    }

    /// Whether scores depend on the context (so a new workload or model supply invalidates cached
    /// scores).
    fn uses_workload(&self) -> bool {
        false
    }
}

/// Every policy name, in the order tables list them.
pub const NAMES: [&str; 6] = ["random", "spread", "binpack", "bestfit", "fgd", "fgd-balance"];

/// The policy a cluster gets unless told otherwise: the best one on the openb benchmark.
pub const DEFAULT: &str = "fgd-balance";

/// A policy by name (`default` names [`DEFAULT`]); `seed` drives `random`'s card choice. A name with
/// [`first_fit::SUFFIX`] is that policy's node choice with kube-scheduler's DRA card choice
/// ([`FirstFitCards`]).
pub fn by_name(name: &str, seed: u64) -> Option<Box<dyn Policy>> {
    if let Some(base) = name.strip_suffix(first_fit::SUFFIX) {
        let base = if base == "default" { DEFAULT } else { base };
        let at = NAMES.iter().position(|n| *n == base)?;
        return Some(Box::new(FirstFitCards { inner: by_name(base, seed)?, name: first_fit::NAMES[at] }));
    }
    Some(match name {
        "default" => return by_name(DEFAULT, seed),
        "random" => Box::new(Random { seed }),
        "spread" => Box::new(Spread),
        "binpack" => Box::new(Binpack),
        "bestfit" => Box::new(BestFit),
        "fgd" => Box::new(Fgd),
        "fgd-balance" => Box::new(FgdBalance),
        _ => return None,
    })
}
