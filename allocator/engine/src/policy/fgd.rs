//! Fragmentation gradient descent (Weng et al., ATC '23) and `fgd-balance`, our refinement of it.
//!
//! FGD places a pod where the node's expected fragmentation under the target workload grows least
//! (or shrinks most). Like the authors' scheduler it ranks nodes by the coarse integer score
//! `⌊100·σ(−Δ/1000)⌋` (Δ in milli-GPU), which makes near-equal nodes tie; ties go to the first node
//! in the node order. Shares go to the card whose use changes fragmentation least.
//!
//! `fgd-balance` keeps FGD's score and replaces the arbitrary tie order with what FGD's per-node
//! measure cannot see, the cluster around the node:
//! - a CPU-only pod goes where the CPU left after it is most in excess of what the node's idle cards
//!   will need (the workload's CPU per card), so it does not strand GPUs for lack of CPU;
//! - a GPU pod that accepts any model first avoids models that model-constrained pods depend on
//!   (their demand per card of the model), then goes where the CPU left per idle card stays closest to
//!   the workload's CPU per card, a shortfall counting [`SHORTFALL_WEIGHT`] times a surplus.
//!
//! On the openb trace this leaves about 0.4 points less GPU unallocated than FGD at 100 % arrived, and
//! less than FGD's published result on every other pod list (see the issue notes for the numbers).

use super::{Context, Eval, Policy};
use crate::model::{Card, Grant, Node};
use crate::request::{CardChooser, Reason, Request, Tentative, fit};
use crate::workload::Workload;
use nano_gpu_proto::units::Percent;

/// The paper's FGD.
pub struct Fgd;

/// FGD with ties resolved by CPU balance and model scarcity (see the module docs).
pub struct FgdBalance;

/// How much more a CPU shortfall (idle cards that will lack CPU) weighs than a CPU surplus when
/// `fgd-balance` breaks ties. Chosen on the openb default and multigpu traces: 4 to 12 all beat FGD
/// on default; below 6 the multi-GPU traces lose their margin.
pub const SHORTFALL_WEIGHT: f64 = 8.0;

/// Above this [`Context::cpu_load`] (the workload asks 90 % of the cluster's CPU per card or more, as
/// on openb lists with 20 % or more CPU-only tasks) `fgd-balance` breaks no tie by CPU: spreading
/// CPU-only pods to the CPU-richest nodes and keeping CPU beside idle cards then strands more cards
/// than it saves (25 % CPU-only tasks: 9.4 % unallocated against FGD's 7.0 %).
pub const CPU_LOAD_LIMIT: f64 = 0.9;

/// From this [`Context::model_load`] on (the constrained pods will ask 40 % of their model's cards or
/// more), GPU pods that accept any model avoid the models constrained pods depend on; below it those
/// pods find room anyway and steering the others away costs packing (5 % constrained pods: 4.9 %
/// unallocated with it, 4.4 % without).
pub const MODEL_LOAD_MIN: f64 = 0.4;

/// Picks the card whose use leaves the node least fragmented (lowest position on ties).
struct LeastFrag<'a> {
    workload: &'a Workload,
    scratch: Vec<Percent>,
}

impl CardChooser for LeastFrag<'_> {
    fn share(&mut self, node: &Node, hyp: &Tentative, feasible: &[usize], percent: &[Percent]) -> usize {
        self.scratch.clear();
        self.scratch.extend_from_slice(&hyp.free);
        let mut best = (f64::INFINITY, 0);
        for (i, (&card, &p)) in feasible.iter().zip(percent).enumerate() {
            self.scratch[card] -= p;
            let f = self.workload.frag(node, &self.scratch, hyp.cpu_free);
            self.scratch[card] += p;
            if f < best.0 {
                best = (f, i);
            }
        }
        best.1
    }
}

/// The fit by least fragmentation and the coarse FGD score.
fn descend(node: &Node, req: &Request, workload: &Workload) -> Result<Eval, Reason> {
    let mut chooser = LeastFrag { workload, scratch: Vec::with_capacity(node.cards.len()) };
    let (grants, hyp) = fit(node, req, &mut chooser)?;
    let before = workload.frag(node, &Tentative::of(node).free, node.cpu_free);
    let after = workload.frag(node, &hyp.free, hyp.cpu_free);
    Ok(Eval { score: coarse_score(after - before), tiebreak: [0.0; 2], grants, basis: 0.0 })
}

/// FGD's value depends on a request's CPU only through the band of the CPU it leaves.
fn cpu_band(node: &Node, cpu: u64, ctx: &Context) -> u64 {
    ctx.workload.cpu_band(node.cpu_free.saturating_sub(cpu))
}

/// `⌊100·σ(−Δ/1000)⌋` with Δ in milli-GPU (Δ here is in percent: 1 % = 10 milli).
pub fn coarse_score(delta_percent: f64) -> f64 {
    (100.0 / (1.0 + (delta_percent / 100.0).exp())).floor()
}

impl Policy for Fgd {
    fn name(&self) -> &'static str {
        "fgd"
    }

    fn evaluate(&self, node: &Node, req: &Request, ctx: &Context) -> Result<Eval, Reason> {
        descend(node, req, &ctx.workload)
    }

    fn cpu_band(&self, node: &Node, cpu: u64, ctx: &Context) -> u64 {
        cpu_band(node, cpu, ctx)
    }

    fn uses_workload(&self) -> bool {
        true
    }
}

/// `fgd-balance`'s tie order for `req` on `node` from `eval.basis` (see [`balance_basis`]): the
/// element that depends on the CPU asked (see the module docs).
fn balance(node: &Node, req: &Request, eval: &mut Eval, ctx: &Context) {
    // Where CPU is what runs out, CPU balance cannot save cards: FGD's own order is kept.
    let balance_cpu = ctx.cpu_load <= CPU_LOAD_LIMIT;
    // CPU left beyond what the idle cards will need.
    let excess = node.cpu_free.saturating_sub(req.cpu) as f64 + eval.basis;
    if req.slots.is_empty() {
        eval.tiebreak[0] = if balance_cpu { excess } else { 0.0 };
        return;
    }
    eval.tiebreak[1] = match (balance_cpu, excess < 0.0) {
        (false, _) => 0.0,
        (true, true) => SHORTFALL_WEIGHT * excess,
        (true, false) => -excess,
    };
}

/// What `fgd-balance` keeps to refine a value: minus the CPU the idle cards left after `grants` will
/// need. And the tie order's first element for a GPU pod: minus the pressure of constrained pods on
/// the models it is given, if it accepts any model (0 for a CPU-only pod, whose first element is set
/// by [`balance`]).
fn balance_basis(node: &Node, req: &Request, grants: &[Grant], ctx: &Context) -> (f64, f64) {
    let free: Percent = node.cards.iter().map(Card::usable).sum();
    let granted: Percent = grants.iter().map(|g| g.percent).sum();
    let idle_cards = f64::from((free - granted).0) / 100.0;
    let avoid_models = ctx.model_load >= MODEL_LOAD_MIN;
    let pressure = if !req.slots.is_empty() && req.models.is_none() && avoid_models {
        grants
            .iter()
            .map(|g| ctx.pressure.get(usize::from(node.cards[g.card].model.0)).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    } else {
        0.0
    };
    (-idle_cards * ctx.workload.cpu_per_card, -pressure)
}

impl Policy for FgdBalance {
    fn name(&self) -> &'static str {
        "fgd-balance"
    }

    fn evaluate(&self, node: &Node, req: &Request, ctx: &Context) -> Result<Eval, Reason> {
        let mut eval = descend(node, req, &ctx.workload)?;
        let (basis, first) = balance_basis(node, req, &eval.grants, ctx);
        eval.basis = basis;
        eval.tiebreak[0] = first;
        balance(node, req, &mut eval, ctx);
        Ok(eval)
    }

    fn cpu_band(&self, node: &Node, cpu: u64, ctx: &Context) -> u64 {
        cpu_band(node, cpu, ctx)
    }

    fn refine(&self, node: &Node, req: &Request, eval: &mut Eval, ctx: &Context) {
        balance(node, req, eval, ctx);
    }

    fn uses_workload(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Card, ModelId};
    use crate::request::SlotDemand;
    use crate::workload::Typical;
    use nano_gpu_proto::units::{MiB, Percent};

    fn ctx(types: Vec<Typical>) -> Context {
        Context { workload: Workload::new(types), pressure: vec![], cpu_load: 0.5, model_load: 0.0 }
    }

    /// A workload of whole-card pods bringing 10 CPUs each.
    fn ten_cpus_per_card() -> Context {
        ctx(vec![Typical { cpu: 10_000, cards: 1, percent: Percent(100), models: None, probability: 1.0 }])
    }

    fn node(name: &str, cpu: u64, frees: &[u32], model: ModelId) -> Node {
        let cards = frees
            .iter()
            .enumerate()
            .map(|(i, &f)| Card {
                free: Percent(f),
                ..Card::new(format!("{name}-{i}"), i as u32, model, MiB(0))
            })
            .collect();
        let mut n = Node::new(name, cpu, 1 << 20, cards);
        n.cpu_free = cpu;
        n
    }

    fn share(p: u32) -> SlotDemand {
        SlotDemand::Share { percent: Some(Percent(p)), mem: None }
    }

    #[test]
    fn coarse_score_matches_the_paper_examples() {
        // Δ = −1000, 0, +1000 milli → 73, 50, 26.
        assert_eq!(coarse_score(-100.0), 73.0);
        assert_eq!(coarse_score(0.0), 50.0);
        assert_eq!(coarse_score(100.0), 26.0);
    }

    #[test]
    fn the_worked_example_picks_card_1_with_score_57() {
        let c = Context { workload: crate::workload::worked_example(), ..Context::default() };
        let n = node("t4", 8000, &[100, 30], ModelId(0));
        let req = Request::new(2000, 0, vec![share(30)]);
        let eval = Fgd.evaluate(&n, &req, &c).unwrap();
        assert_eq!(eval.grants[0].card, 1);
        assert_eq!(eval.score, 57.0);
    }

    #[test]
    fn a_cpu_only_pod_prefers_the_node_whose_idle_cards_need_the_cpu_least() {
        let c = ten_cpus_per_card();
        let req = Request::new(8000, 0, vec![]);
        let busy = node("busy", 40_000, &[0, 0], ModelId(0)); // no idle card: all CPU is spare
        let idle = node("idle", 40_000, &[100, 100], ModelId(0)); // 20 CPUs spoken for
        let a = FgdBalance.evaluate(&busy, &req, &c).unwrap();
        let b = FgdBalance.evaluate(&idle, &req, &c).unwrap();
        assert_eq!(a.score, b.score);
        assert!(a.tiebreak > b.tiebreak, "{a:?} vs {b:?}");
        // Where the workload asks more CPU than the cluster has per card, no tie is broken by CPU.
        let scarce = Context { cpu_load: CPU_LOAD_LIMIT + 0.1, ..c };
        let a = FgdBalance.evaluate(&busy, &req, &scarce).unwrap();
        let b = FgdBalance.evaluate(&idle, &req, &scarce).unwrap();
        assert_eq!(a.tiebreak, b.tiebreak);
    }

    #[test]
    fn a_gpu_pod_avoids_starving_the_cards_left_of_cpu() {
        let c = ten_cpus_per_card();
        let req = Request::new(10_000, 0, vec![SlotDemand::Whole { cards: 1, mem: None }]);
        // After the pod: 2 idle cards with 20 CPUs (balanced) vs 2 idle cards with 5 CPUs (short).
        let balanced = node("balanced", 30_000, &[100, 100, 100], ModelId(0));
        let short = node("short", 15_000, &[100, 100, 100], ModelId(0));
        let a = FgdBalance.evaluate(&balanced, &req, &c).unwrap();
        let b = FgdBalance.evaluate(&short, &req, &c).unwrap();
        assert!(a.tiebreak > b.tiebreak, "{a:?} vs {b:?}");
    }

    #[test]
    fn an_unconstrained_pod_leaves_scarce_models_to_the_pods_that_need_them() {
        let scarce = ModelId(1);
        let mut c = ctx(vec![
            Typical { cpu: 1000, cards: 1, percent: Percent(100), models: None, probability: 0.5 },
            Typical {
                cpu: 1000,
                cards: 1,
                percent: Percent(100),
                models: Some(vec![scarce]),
                probability: 0.5,
            },
        ]);
        c = Context::new(c.workload, &[100, 10], 10_000.0);
        // Half the pods, one card each, want the 10 cards of the scarce model: filling 110 cards
        // takes 110 pods, 55 of them for those 10 cards.
        assert!((c.model_load - 5.5).abs() < 1e-9, "{}", c.model_load);
        let req = Request::new(1000, 0, vec![SlotDemand::Whole { cards: 1, mem: None }]);
        let common = FgdBalance.evaluate(&node("common", 8000, &[100, 100], ModelId(0)), &req, &c).unwrap();
        let rare = FgdBalance.evaluate(&node("rare", 8000, &[100, 100], scarce), &req, &c).unwrap();
        assert!(common.tiebreak > rare.tiebreak, "{common:?} vs {rare:?}");
        // Constrained pods that will not fill their model: nobody is steered away from it.
        let light = Context { model_load: MODEL_LOAD_MIN / 2.0, ..c.clone() };
        let common =
            FgdBalance.evaluate(&node("common", 8000, &[100, 100], ModelId(0)), &req, &light).unwrap();
        let rare = FgdBalance.evaluate(&node("rare", 8000, &[100, 100], scarce), &req, &light).unwrap();
        assert_eq!(common.tiebreak[0], rare.tiebreak[0]);
        // A pod that asks for the scarce model is not pushed away from it.
        let mut wants = req.clone();
        wants.models = Some(vec![scarce]);
        assert_eq!(
            FgdBalance.evaluate(&node("rare", 8000, &[100, 100], scarce), &wants, &c).unwrap().tiebreak[0],
            0.0
        );
    }
}
