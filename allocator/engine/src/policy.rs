//! Placement policies: how a feasible node is scored and which card(s) on it a request gets.
//!
//! A policy is a pure function of one node and one request (plus the [`Context`]: the target workload
//! and the pressure on each card model), so the engine can cache its value per node version. Higher
//! scores win; `tiebreak` orders equal scores (lexicographically); the engine breaks what is still
//! equal (by node order, or uniformly at random for `random`).

mod fgd;
mod simple;

pub use fgd::{Fgd, FgdBalance};
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
}

/// What a policy may know beyond the node and the request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Context {
    /// The target workload.
    pub workload: Workload,
    /// Per card model ([`crate::model::ModelId`]), the model-constrained demand per card of that model
    /// in the cluster ([`Workload::pressure`]).
    pub pressure: Vec<f64>,
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

    /// Scores `req` on `node` and picks its cards, or says why it does not fit.
    fn evaluate(&self, node: &Node, req: &Request, ctx: &Context) -> Result<Eval, Reason>;

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

/// A policy by name (`default` names [`DEFAULT`]); `seed` drives `random`'s card choice.
pub fn by_name(name: &str, seed: u64) -> Option<Box<dyn Policy>> {
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
