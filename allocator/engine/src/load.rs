//! Real load as the last tie rule (Genius's idea, done so that it can never cost placement quality):
//! each card's recent utilisation, when the allocator has a fresh reading of it.
//!
//! - Between nodes the policy values equally (same score, same tiebreak), the one whose chosen
//!   cards are less busy wins, before the node order ([`crate::engine::Engine::decide`]).
//! - On the chosen node, a card the pod would take is swapped for an unused card of the same state
//!   (model, health, free percent and memory, total memory) that is less busy
//!   ([`Load::prefer_idle`]): the policy cannot tell such cards apart (its measures see cards only
//!   through that state), so the swap changes no value it computed.
//!
//! Without a reading (none configured, or stale), nothing changes: placement is exactly the
//! policy's. The openb trace has no load, so its numbers cannot move.

use crate::model::{Card, Grant, Node};
use std::collections::HashMap;

/// Utilisation (percent of the last period a kernel ran) by card UUID.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Load(HashMap<String, f64>);

impl Load {
    /// A reading.
    pub fn new(by_uuid: HashMap<String, f64>) -> Self {
        Load(by_uuid)
    }

    /// How many cards were read.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no card was read.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A card's utilisation, if read.
    pub fn of(&self, card: &Card) -> Option<f64> {
        self.0.get(&card.uuid).copied()
    }

    /// Each card's utilisation as people are shown it: a whole percent.
    pub fn shown(&self) -> std::collections::BTreeMap<&str, u32> {
        self.0.iter().map(|(uuid, &l)| (uuid.as_str(), whole_percent(l))).collect()
    }

    /// The mean utilisation of the cards `grants` take on `node`; `None` when one is not known (no
    /// comparison is made then).
    pub fn of_grants(&self, node: &Node, grants: &[Grant]) -> Option<f64> {
        let mut cards: Vec<usize> = grants.iter().map(|g| g.card).collect();
        cards.sort_unstable();
        cards.dedup();
        if cards.is_empty() {
            return None;
        }
        let loads: Option<Vec<f64>> =
            cards.iter().map(|&c| node.cards.get(c).and_then(|c| self.of(c))).collect();
        loads.map(|l| l.iter().sum::<f64>() / l.len() as f64)
    }

    /// Moves the grants on each card to an unused card of the same state that is less busy, if any
    /// (the least busy; lowest position on equal load). All grants on one card move together, so
    /// the request's shape on the node is unchanged.
    pub fn prefer_idle(&self, node: &Node, grants: &mut [Grant]) {
        let mut used: Vec<usize> = grants.iter().map(|g| g.card).collect();
        used.sort_unstable();
        used.dedup();
        for from in used.clone() {
            let Some(here) = node.cards.get(from).and_then(|c| self.of(c)) else { continue };
            let twin = |c: &Card| {
                let a = &node.cards[from];
                (c.model, c.healthy, c.free, c.mem_free, c.mem_total)
                    == (a.model, a.healthy, a.free, a.mem_free, a.mem_total)
            };
            let best = (0..node.cards.len())
                .filter(|i| !used.contains(i) && twin(&node.cards[*i]))
                .filter_map(|i| self.of(&node.cards[i]).map(|l| (i, l)))
                .filter(|&(_, l)| l < here)
                .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
            if let Some((to, _)) = best {
                for g in grants.iter_mut().filter(|g| g.card == from) {
                    g.card = to;
                }
                used.retain(|&c| c != from);
                used.push(to);
            }
        }
    }
}

/// A utilisation as a whole percent (0 to 100; a reading out of that range is clamped).
pub fn whole_percent(load: f64) -> u32 {
    load.clamp(0.0, 100.0).round() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelId;
    use nano_gpu_proto::units::{MiB, Percent};

    fn node(cards: &[(u32, u16)]) -> Node {
        let cards = cards
            .iter()
            .enumerate()
            .map(|(i, &(free, model))| {
                let mut c = Card::new(format!("GPU-{i}"), i as u32, ModelId(model), MiB(16384));
                c.free = Percent(free);
                c
            })
            .collect();
        Node::new("n", 8000, 32768, cards)
    }

    fn load(values: &[(usize, f64)]) -> Load {
        Load::new(values.iter().map(|&(i, l)| (format!("GPU-{i}"), l)).collect())
    }

    fn grant(slot: usize, card: usize, percent: u32) -> Grant {
        Grant { slot, card, percent: Percent(percent), mem: MiB(0) }
    }

    #[test]
    fn a_share_moves_to_the_least_busy_twin_card_only() {
        // Cards 0, 1 and 3 are twins (idle, model 0); card 2 is busier but another model.
        let n = node(&[(100, 0), (100, 0), (100, 1), (100, 0)]);
        let l = load(&[(0, 90.0), (1, 40.0), (2, 0.0), (3, 10.0)]);
        let mut grants = [grant(0, 0, 50)];
        l.prefer_idle(&n, &mut grants);
        assert_eq!(grants[0].card, 3);
        // Already on the least busy twin: stays.
        l.prefer_idle(&n, &mut grants);
        assert_eq!(grants[0].card, 3);
    }

    #[test]
    fn cards_in_other_states_or_without_a_reading_are_never_chosen() {
        // Card 1 has less free (not a twin); card 2 has no reading.
        let n = node(&[(100, 0), (70, 0), (100, 0)]);
        let l = load(&[(0, 90.0), (1, 0.0)]);
        let mut grants = [grant(0, 0, 20)];
        l.prefer_idle(&n, &mut grants);
        assert_eq!(grants[0].card, 0);
        // The chosen card itself unread: no move.
        let l = load(&[(1, 0.0), (2, 0.0)]);
        l.prefer_idle(&n, &mut grants);
        assert_eq!(grants[0].card, 0);
    }

    #[test]
    fn grants_on_one_card_move_together_and_never_onto_a_card_the_request_uses() {
        let n = node(&[(100, 0), (100, 0), (100, 0), (100, 0)]);
        let l = load(&[(0, 80.0), (1, 70.0), (2, 5.0), (3, 50.0)]);
        // Two slots share card 0; a third slot takes card 1.
        let mut grants = [grant(0, 0, 30), grant(1, 0, 30), grant(2, 1, 100)];
        l.prefer_idle(&n, &mut grants);
        assert_eq!(grants.map(|g| g.card), [2, 2, 3]);
    }

    #[test]
    fn the_load_of_a_choice_is_the_mean_of_its_cards_when_all_are_read() {
        let n = node(&[(100, 0), (100, 0)]);
        let l = load(&[(0, 30.0), (1, 10.0)]);
        assert_eq!(l.of_grants(&n, &[grant(0, 0, 100), grant(0, 1, 100)]), Some(20.0));
        assert_eq!(load(&[(0, 30.0)]).of_grants(&n, &[grant(0, 1, 10)]), None);
        assert_eq!(l.of_grants(&n, &[]), None);
    }
}
