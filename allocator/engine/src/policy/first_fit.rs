//! A policy's node choice with kube-scheduler's DRA card choice: what nano-gpu places when the
//! extender picks the node but kube-scheduler's DRA allocator picks the card (its devices in the
//! order the node's ResourceSlice lists them, the first with room for each request, whole cards the
//! first free ones). `simulate` replays it beside the policy itself to show what choosing the card
//! is worth.

use super::{Context, Eval, Policy, Ties};
use crate::model::Node;
use crate::request::{CardChooser, Reason, Request, Tentative, fit};
use nano_gpu_proto::units::Percent;

/// The suffix that names a policy's first-fit variant (`fgd-balance+first-fit`).
pub const SUFFIX: &str = "+first-fit";

/// Every first-fit variant's name, in the order of [`super::NAMES`].
pub const NAMES: [&str; 6] = [
    "random+first-fit",
    "spread+first-fit",
    "binpack+first-fit",
    "bestfit+first-fit",
    "fgd+first-fit",
    "fgd-balance+first-fit",
];

/// `inner`'s score for the node, the first feasible card(s) on it.
pub struct FirstFitCards {
    /// The policy that scores nodes.
    pub inner: Box<dyn Policy>,
    /// This variant's name (one of [`NAMES`]).
    pub name: &'static str,
}

/// The first feasible card, in the node's card order.
struct First;

impl CardChooser for First {
    fn share(&mut self, _node: &Node, _hyp: &Tentative, _feasible: &[usize], _percent: &[Percent]) -> usize {
        0
    }
}

impl Policy for FirstFitCards {
    fn name(&self) -> &'static str {
        self.name
    }

    fn evaluate(&self, node: &Node, req: &Request, ctx: &Context) -> Result<Eval, Reason> {
        let mut eval = self.inner.evaluate(node, req, ctx)?;
        eval.grants = fit(node, req, &mut First)?.0;
        Ok(eval)
    }

    fn cpu_band(&self, node: &Node, cpu: u64, ctx: &Context) -> u64 {
        self.inner.cpu_band(node, cpu, ctx)
    }

    fn refine(&self, node: &Node, req: &Request, eval: &mut Eval, ctx: &Context) {
        let grants = std::mem::take(&mut eval.grants);
        self.inner.refine(node, req, eval, ctx);
        eval.grants = grants;
    }

    fn ties(&self) -> Ties {
        self.inner.ties()
    }

    fn uses_workload(&self) -> bool {
        self.inner.uses_workload()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Fgd, by_name};
    use super::*;
    use crate::model::{Card, ModelId};
    use crate::request::SlotDemand;
    use nano_gpu_proto::units::MiB;

    fn node(frees: &[u32]) -> Node {
        let cards = frees
            .iter()
            .enumerate()
            .map(|(i, &f)| Card {
                free: Percent(f),
                ..Card::new(format!("c-{i}"), i as u32, ModelId(0), MiB(0))
            })
            .collect();
        let mut n = Node::new("n", 8000, 1 << 20, cards);
        n.cpu_free = 8000;
        n
    }

    fn share(p: u32) -> SlotDemand {
        SlotDemand::Share { percent: Some(Percent(p)), mem: None }
    }

    #[test]
    fn the_node_is_the_policys_and_the_card_the_first_with_room() {
        // The paper's worked example: FGD puts the 30 % share on card 1 (30 % free, filled exactly);
        // kube-scheduler's allocator takes card 0, the first that holds it.
        let ctx = Context { workload: crate::workload::worked_example(), ..Context::default() };
        let n = node(&[100, 30]);
        let req = Request::new(2000, 0, vec![share(30)]);
        let fgd = Fgd.evaluate(&n, &req, &ctx).unwrap();
        let first = by_name("fgd+first-fit", 0).unwrap();
        let eval = first.evaluate(&n, &req, &ctx).unwrap();
        assert_eq!((fgd.grants[0].card, eval.grants[0].card), (1, 0));
        assert_eq!(eval.score, fgd.score);
        assert_eq!(first.name(), "fgd+first-fit");
        // A share too big for card 0 goes to the first card it fits.
        let eval = first.evaluate(&node(&[20, 50, 100]), &Request::new(0, 0, vec![share(40)]), &ctx).unwrap();
        assert_eq!(eval.grants[0].card, 1);
        // Whole cards: the first free ones.
        let whole = SlotDemand::Whole { cards: 2, mem: None };
        let eval =
            first.evaluate(&node(&[100, 50, 100, 100]), &Request::new(0, 0, vec![whole]), &ctx).unwrap();
        let cards: Vec<usize> = eval.grants.iter().map(|g| g.card).collect();
        assert_eq!(cards, [0, 2]);
    }

    #[test]
    fn every_policy_has_its_first_fit_variant_and_nothing_else_does() {
        for (base, name) in super::super::NAMES.iter().zip(NAMES) {
            assert_eq!(by_name(&format!("{base}{SUFFIX}"), 0).unwrap().name(), name);
        }
        assert_eq!(by_name("default+first-fit", 0).unwrap().name(), "fgd-balance+first-fit");
        assert!(by_name("nope+first-fit", 0).is_none());
        assert!(by_name("fgd+first-fit+first-fit", 0).is_none());
    }
}
