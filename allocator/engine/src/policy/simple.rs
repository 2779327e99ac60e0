//! Policies without a workload model: `random`, `spread`, `binpack` and the paper's `bestfit`.

use super::{Context, Eval, Policy, Ties};
use crate::model::Node;
use crate::request::{CardChooser, Reason, Request, Tentative, Tightest, fit};
use nano_gpu_proto::units::Percent;

/// A uniformly random feasible node, and a random feasible card on it (seeded).
pub struct Random {
    /// Seed of the card choice.
    pub seed: u64,
}

struct HashPick(u64);

impl CardChooser for HashPick {
    fn share(&mut self, _node: &Node, _hyp: &Tentative, feasible: &[usize], _percent: &[Percent]) -> usize {
        let mut rng = crate::rng::Rng::new(self.0);
        self.0 = rng.next_u64();
        rng.below(feasible.len())
    }

    fn whole(&mut self, _node: &Node, _hyp: &Tentative, feasible: &[usize], k: usize) -> Vec<usize> {
        let mut rng = crate::rng::Rng::new(self.0);
        self.0 = rng.next_u64();
        let mut picks = feasible.to_vec();
        rng.shuffle(&mut picks);
        picks.truncate(k);
        picks.sort();
        picks
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn evaluate(&self, node: &Node, req: &Request, _: &Context) -> Result<Eval, Reason> {
        // The card choice is random but a pure function of the seed and the node's state.
        let (grants, _) = fit(node, req, &mut HashPick(self.seed ^ node.version.wrapping_mul(0x9E37_79B9)))?;
        Ok(Eval { score: 0.0, tiebreak: [0.0; 2], grants, basis: 0.0 })
    }

    fn ties(&self) -> Ties {
        Ties::Uniform
    }
}

/// Most free GPU after placement wins; shares go to the card with the most free.
pub struct Spread;

struct Loosest;

impl CardChooser for Loosest {
    fn share(&mut self, _node: &Node, hyp: &Tentative, feasible: &[usize], _percent: &[Percent]) -> usize {
        (0..feasible.len()).max_by_key(|&i| (hyp.free[feasible[i]], std::cmp::Reverse(i))).unwrap_or(0)
    }
}

impl Policy for Spread {
    fn name(&self) -> &'static str {
        "spread"
    }

    fn evaluate(&self, node: &Node, req: &Request, _: &Context) -> Result<Eval, Reason> {
        let (grants, hyp) = fit(node, req, &mut Loosest)?;
        let free: Percent = hyp.free.iter().sum();
        Ok(Eval { score: f64::from(free.0), tiebreak: [hyp.cpu_free as f64, 0.0], grants, basis: 0.0 })
    }
}

/// Least free GPU after placement wins (then least free CPU); shares go to the tightest card.
pub struct Binpack;

impl Policy for Binpack {
    fn name(&self) -> &'static str {
        "binpack"
    }

    fn evaluate(&self, node: &Node, req: &Request, _: &Context) -> Result<Eval, Reason> {
        let (grants, hyp) = fit(node, req, &mut Tightest)?;
        let free: Percent = hyp.free.iter().sum();
        Ok(Eval { score: -f64::from(free.0), tiebreak: [-(hyp.cpu_free as f64), 0.0], grants, basis: 0.0 })
    }
}

/// The ATC '23 paper's BestFit: least leftover of CPU and GPU, equally weighted against a 128-core,
/// 8-card reference node; shares go to the tightest card.
pub struct BestFit;

impl Policy for BestFit {
    fn name(&self) -> &'static str {
        "bestfit"
    }

    fn evaluate(&self, node: &Node, req: &Request, _: &Context) -> Result<Eval, Reason> {
        let (grants, _) = fit(node, req, &mut Tightest)?;
        let gpu_left = f64::from(node.gpu_free().0) - f64::from(req.gpu_size().0);
        let cpu_left = node.cpu_free as f64 - req.cpu as f64;
        let score = 100.0 * (1.0 - (0.5 * cpu_left / 128_000.0 + 0.5 * gpu_left / 800.0));
        Ok(Eval { score, tiebreak: [0.0; 2], grants, basis: 0.0 })
    }
}
