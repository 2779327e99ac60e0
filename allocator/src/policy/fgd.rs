//! Fragmentation gradient descent (Weng et al., ATC '23) and our packing refinement of it.
//!
//! FGD places a pod where the node's expected fragmentation under the target workload grows least
//! (or shrinks most). Like the authors' scheduler it ranks nodes by the coarse integer score
//! `⌊100·σ(−Δ/1000)⌋` (Δ in milli-GPU), which makes near-equal nodes tie; ties go to the first node
//! in the node order. Shares go to the card whose use changes fragmentation least.

use super::{Eval, Policy};
use crate::model::Node;
use crate::request::{CardChooser, Hyp, Reason, Request, fit};
use crate::workload::Workload;

/// The paper's FGD.
pub struct Fgd;

/// FGD that resolves its ties by packing: among nodes with the same coarse score, the one left with
/// the least free GPU wins (then the node order).
pub struct FgdPack;

/// Picks the card whose use leaves the node least fragmented (lowest position on ties).
struct LeastFrag<'a> {
    workload: &'a Workload,
    scratch: Vec<u32>,
}

impl CardChooser for LeastFrag<'_> {
    fn share(&mut self, node: &Node, hyp: &Hyp, feasible: &[usize], percent: &[u32]) -> usize {
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

/// The fit by least fragmentation and the change of the node's fragmentation, in percent of a card.
fn descend(node: &Node, req: &Request, workload: &Workload) -> Result<(Eval, f64), Reason> {
    let mut chooser = LeastFrag {
        workload,
        scratch: Vec::with_capacity(node.cards.len()),
    };
    let (grants, hyp) = fit(node, req, &mut chooser)?;
    let before = workload.frag(node, &Hyp::of(node).free, node.cpu_free);
    let after = workload.frag(node, &hyp.free, hyp.cpu_free);
    let free_after: u32 = hyp.free.iter().sum();
    Ok((
        Eval {
            score: 0.0,
            tiebreak: -f64::from(free_after),
            grants,
        },
        after - before,
    ))
}

/// `⌊100·σ(−Δ/1000)⌋` with Δ in milli-GPU (Δ here is in percent: 1 % = 10 milli).
pub fn coarse_score(delta_percent: f64) -> f64 {
    (100.0 / (1.0 + (delta_percent / 100.0).exp())).floor()
}

impl Policy for Fgd {
    fn name(&self) -> &'static str {
        "fgd"
    }

    fn evaluate(&self, node: &Node, req: &Request, workload: &Workload) -> Result<Eval, Reason> {
        let (eval, delta) = descend(node, req, workload)?;
        Ok(Eval {
            score: coarse_score(delta),
            tiebreak: 0.0,
            ..eval
        })
    }

    fn uses_workload(&self) -> bool {
        true
    }
}

impl Policy for FgdPack {
    fn name(&self) -> &'static str {
        "fgd-pack"
    }

    fn evaluate(&self, node: &Node, req: &Request, workload: &Workload) -> Result<Eval, Reason> {
        let (eval, delta) = descend(node, req, workload)?;
        Ok(Eval {
            score: coarse_score(delta),
            ..eval
        })
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

    #[test]
    fn coarse_score_matches_the_paper_examples() {
        // Δ = −1000, 0, +1000 milli → 73, 50, 26.
        assert_eq!(coarse_score(-100.0), 73.0);
        assert_eq!(coarse_score(0.0), 50.0);
        assert_eq!(coarse_score(100.0), 26.0);
    }

    #[test]
    fn the_worked_example_picks_card_1_with_score_57() {
        let w = Workload {
            types: vec![
                Typical {
                    cpu: 4000,
                    k: 1,
                    d: 50,
                    models: None,
                    p: 0.5,
                },
                Typical {
                    cpu: 2000,
                    k: 1,
                    d: 100,
                    models: None,
                    p: 0.3,
                },
                Typical {
                    cpu: 4000,
                    k: 0,
                    d: 0,
                    models: None,
                    p: 0.2,
                },
            ],
        };
        let mut cards: Vec<Card> = (0..2)
            .map(|i| Card::new(format!("g{i}"), i, ModelId(0), 0))
            .collect();
        cards[1].free = 30;
        let node = Node::new("t4", 8000, 1000, cards);
        let req = Request::new(
            2000,
            0,
            vec![SlotDemand::Share {
                percent: Some(30),
                mem: None,
            }],
        );
        let eval = Fgd.evaluate(&node, &req, &w).unwrap();
        assert_eq!(eval.grants[0].card, 1);
        assert_eq!(eval.score, 57.0);
    }
}
