//! The target workload `M` of fragmentation-aware policies: the typical pod shapes and how often each
//! arrives, and the expected fragmentation `F_n(M)` of a node under it (Weng et al., ATC '23, §3).
//!
//! `M` is built from the requests seen, with the paper's popularity rule: group by shape, keep the most
//! frequent shapes until they cover 95 % of the pods, renormalise.

use crate::model::{ModelId, Node};
use crate::request::{Request, SlotDemand};
use nano_gpu_proto::units::Percent;
use std::collections::HashMap;

/// Share of pods the typical shapes must cover.
pub const POPULARITY: f64 = 0.95;

/// One typical pod shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Typical {
    /// Host CPU in millicores.
    pub cpu: u64,
    /// Cards it needs (0 for CPU-only); the paper's `k`.
    pub cards: u32,
    /// Share it needs on each card (100 % for whole cards); the paper's `d`.
    pub percent: Percent,
    /// Allowed models (`None`: any).
    pub models: Option<Vec<ModelId>>,
    /// Probability of this shape among the typical ones; the paper's `p`.
    pub probability: f64,
}

/// Host CPU, cards, share per card, allowed models.
type Shape = (u64, u32, Percent, Option<Vec<ModelId>>);

fn shape(r: &Request) -> Shape {
    let k = r.slots.iter().map(SlotDemand::cards).sum();
    let d = r
        .slots
        .iter()
        .map(|s| match s {
            SlotDemand::Share { percent, .. } => percent.unwrap_or(Percent(1)),
            SlotDemand::Whole { .. } => Percent::FULL,
        })
        .max()
        .unwrap_or(Percent::ZERO);
    (r.cpu, k, d, r.models.clone())
}

/// The target workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Workload {
    /// Typical shapes, most frequent first; probabilities sum to 1 (or the list is empty).
    pub types: Vec<Typical>,
    /// Expected CPU (millicores) a GPU pod brings per card it uses.
    pub cpu_per_card: f64,
    /// Expected CPU (millicores) that pods asking no GPU bring per card the GPU pods use: with
    /// `cpu_per_card`, the CPU the workload asks per card.
    pub cpu_only_per_card: f64,
    /// Expected cards a pod asks (CPU-only pods counting 0).
    pub cards_per_pod: f64,
    /// Expected cards per pod that only cards of each model may serve, indexed by [`ModelId`]: the
    /// demand of model-constrained pods (a pod allowing several models counts a share for each).
    pub constrained: Vec<f64>,
}

impl Workload {
    /// A workload of these shapes, with its derived values.
    pub fn new(types: Vec<Typical>) -> Self {
        let (mut cpu, mut cards) = (0.0, 0.0);
        let mut constrained: Vec<f64> = Vec::new();
        for t in types.iter().filter(|t| t.cards > 0) {
            let size = f64::from(t.cards * t.percent.0) / 100.0;
            cpu += t.probability * t.cpu as f64;
            cards += t.probability * size;
            for m in t.models.iter().flatten() {
                let i = usize::from(m.0);
                if constrained.len() <= i {
                    constrained.resize(i + 1, 0.0);
                }
                constrained[i] += t.probability * size / t.models.as_ref().map_or(1, Vec::len) as f64;
            }
        }
        let cpu_only: f64 = types.iter().filter(|t| t.cards == 0).map(|t| t.probability * t.cpu as f64).sum();
        let per_card = |cpu: f64| if cards > 0.0 { cpu / cards } else { 0.0 };
        Workload {
            cpu_per_card: per_card(cpu),
            cpu_only_per_card: per_card(cpu_only),
            cards_per_pod: cards,
            types,
            constrained,
        }
    }

    /// How much model-constrained demand weighs on each model: constrained cards asked per card of
    /// the model in the cluster (`supply`, cards per [`ModelId`]).
    pub fn pressure(&self, supply: &[u32]) -> Vec<f64> {
        self.constrained
            .iter()
            .enumerate()
            .map(|(m, d)| d / f64::from(supply.get(m).copied().unwrap_or(0).max(1)))
            .collect()
    }

    /// The typical shapes of `requests` under the popularity rule.
    pub fn from_requests<'a>(requests: impl IntoIterator<Item = &'a Request>) -> Self {
        let mut counts: HashMap<Shape, u64> = HashMap::new();
        let mut total = 0u64;
        for r in requests {
            *counts.entry(shape(r)).or_default() += 1;
            total += 1;
        }
        Self::from_counts(counts, total)
    }

    fn from_counts(counts: HashMap<Shape, u64>, total: u64) -> Self {
        let mut shapes: Vec<(Shape, u64)> = counts.into_iter().collect();
        // Most frequent first; equal counts in a fixed order, so the cut is deterministic.
        shapes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut kept = Vec::new();
        let mut covered = 0u64;
        for (s, n) in shapes {
            if covered as f64 >= POPULARITY * total as f64 {
                break;
            }
            covered += n;
            kept.push((s, n));
        }
        let types = kept
            .into_iter()
            .map(|((cpu, cards, percent, models), n)| Typical {
                cpu,
                cards,
                percent,
                models,
                probability: n as f64 / covered as f64,
            })
            .collect();
        Workload::new(types)
    }

    /// Expected fragmentation of a node (in percent of a card) if its free CPU were `cpu_free` and its
    /// cards had `free` percent usable: for each typical shape, the idle GPU it could not use.
    pub fn frag(&self, node: &Node, free: &[Percent], cpu_free: u64) -> f64 {
        let total: Percent = free.iter().sum();
        if total == Percent::ZERO {
            return 0.0;
        }
        let mut f = 0.0;
        for t in &self.types {
            let fm = if t.cards == 0 {
                total
            } else {
                let (mut fits, mut small) = (0u32, Percent::ZERO);
                for (card, &r) in node.cards.iter().zip(free) {
                    let allowed = t.models.as_ref().is_none_or(|m| m.contains(&card.model));
                    if allowed && r >= t.percent {
                        fits += 1;
                    } else {
                        small += r;
                    }
                }
                if cpu_free >= t.cpu && fits >= t.cards { small } else { total }
            };
            f += t.probability * f64::from(fm.0);
        }
        f
    }
}

/// Learns the target workload online from the requests a live allocator sees: counts every shape and
/// rebuilds `M` every `every` requests, so policies follow the real mix without recomputing per pod.
#[derive(Clone, Debug)]
pub struct Learner {
    counts: HashMap<Shape, u64>,
    total: u64,
    every: u64,
    last: Option<Workload>,
}

/// A rebuilt workload replaces the last one only if some shape's probability moved by more than this
/// (or the set of shapes changed): a stable mix keeps the policies' cached scores.
pub const LEARN_TOLERANCE: f64 = 0.01;

fn close(a: &Workload, b: &Workload) -> bool {
    a.types.len() == b.types.len()
        && a.types.iter().all(|t| {
            b.types.iter().any(|u| {
                (t.cpu, t.cards, t.percent, &t.models) == (u.cpu, u.cards, u.percent, &u.models)
                    && (t.probability - u.probability).abs() <= LEARN_TOLERANCE
            })
        })
}

impl Learner {
    /// A learner that rebuilds after every `every` requests (at least 1).
    pub fn new(every: u64) -> Self {
        Learner { counts: HashMap::new(), total: 0, every: every.max(1), last: None }
    }

    /// Counts a request; returns the new workload when it is time to rebuild and the mix has moved
    /// (see [`LEARN_TOLERANCE`]).
    pub fn observe(&mut self, r: &Request) -> Option<Workload> {
        *self.counts.entry(shape(r)).or_default() += 1;
        self.total += 1;
        let due =
            self.total.is_multiple_of(self.every) || self.total < self.every && self.total.is_power_of_two();
        if !due {
            return None;
        }
        let next = Workload::from_counts(self.counts.clone(), self.total);
        if self.last.as_ref().is_some_and(|last| close(last, &next)) {
            return None;
        }
        self.last = Some(next.clone());
        Some(next)
    }
}

/// The target workload of the reference's worked example (§3.3), for tests.
#[cfg(test)]
pub(crate) fn worked_example() -> Workload {
    Workload::new(vec![
        Typical { cpu: 4000, cards: 1, percent: Percent(50), models: None, probability: 0.5 },
        Typical { cpu: 2000, cards: 1, percent: Percent(100), models: None, probability: 0.3 },
        Typical { cpu: 4000, cards: 0, percent: Percent(0), models: None, probability: 0.2 },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Card;
    use nano_gpu_proto::units::{MiB, Percent};

    fn share(p: u32) -> SlotDemand {
        SlotDemand::Share { percent: Some(Percent(p)), mem: None }
    }

    /// The worked example of the reference (§3.3): T4 node, 8 CPUs, cards [1000, 300] milli.
    #[test]
    fn frag_matches_the_worked_example() {
        let w = worked_example();
        let cards = (0..2).map(|i| Card::new(format!("g{i}"), i, ModelId(0), MiB(0))).collect();
        let node = Node::new("t4", 8000, 0, cards);
        let f = |free: &[u32], cpu| {
            let free: Vec<Percent> = free.iter().copied().map(Percent).collect();
            (w.frag(&node, &free, cpu) * 10.0).round() / 10.0
        };
        assert_eq!(f(&[100, 30], 8000), 50.0);
        // The new pod (2000 cpu, 30 %) on card 0 and on card 1:
        assert_eq!(f(&[70, 30], 6000), 65.0);
        assert_eq!(f(&[100, 0], 6000), 20.0);
    }

    #[test]
    fn derived_values_weigh_shapes_by_probability() {
        let t4 = ModelId(1);
        let w = Workload::new(vec![
            Typical { cpu: 12_000, cards: 1, percent: Percent(100), models: None, probability: 0.5 },
            Typical { cpu: 4_000, cards: 1, percent: Percent(50), models: Some(vec![t4]), probability: 0.25 },
            Typical { cpu: 8_000, cards: 0, percent: Percent(0), models: None, probability: 0.25 },
        ]);
        // (0.5·12000 + 0.25·4000) / (0.5·1 + 0.25·0.5) CPU per card; CPU-only shapes do not count.
        assert!((w.cpu_per_card - 7000.0 / 0.625).abs() < 1e-9);
        assert_eq!(w.constrained, vec![0.0, 0.125]);
        assert_eq!(w.pressure(&[10, 5]), vec![0.0, 0.025]);
        // A model with no cards yet does not divide by zero.
        assert_eq!(w.pressure(&[]), vec![0.0, 0.125]);
    }

    #[test]
    fn typical_shapes_cover_95_percent_most_frequent_first() {
        let mut reqs = vec![Request::new(1000, 0, vec![share(50)]); 60];
        reqs.extend(vec![Request::new(2000, 0, vec![]); 36]);
        reqs.extend(vec![Request::new(3000, 0, vec![share(10)]); 4]);
        let w = Workload::from_requests(&reqs);
        assert_eq!(w.types.len(), 2);
        assert!((w.types[0].probability - 60.0 / 96.0).abs() < 1e-9);
        assert_eq!((w.types[1].cards, w.types[1].cpu), (0, 2000));
    }

    #[test]
    fn learner_rebuilds_periodically() {
        let mut l = Learner::new(100);
        let r = Request::new(1000, 0, vec![share(50)]);
        let rebuilt = (0..300).filter(|_| l.observe(&r).is_some()).count();
        // One shape only: the first rebuild, then nothing moves.
        assert_eq!(rebuilt, 1);
        let other = Request::new(2000, 0, vec![]);
        // A new shape moves the mix at the next due point.
        assert!((0..100).any(|_| l.observe(&other).is_some()));
    }
}
