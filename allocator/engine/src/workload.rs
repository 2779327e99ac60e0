//! The target workload `M` of fragmentation-aware policies: the typical pod shapes and how often each
//! arrives, and the expected fragmentation `F_n(M)` of a node under it (Weng et al., ATC '23, §3).
//!
//! `M` is built from the requests seen, with the paper's popularity rule: group by shape, keep the most
//! frequent shapes until they cover 95 % of the pods, renormalise.

use crate::model::{Card, ModelId, Node};
use crate::request::{Request, SlotDemand};
use nano_gpu_proto::units::Percent;
use std::collections::HashMap;

/// Share of pods the typical shapes must cover.
pub const POPULARITY: f64 = 0.95;

/// Most typical shapes a workload keeps. The openb pod lists need at most 102; where users pick
/// exact CPU requests the popularity rule alone keeps thousands, and every fragmentation measure walks
/// all of them. Above this, shapes are grouped by CPU rounded up to a coarser grain (see
/// [`Workload::from_requests`]).
pub const MAX_TYPES: usize = 128;

/// Coarsest CPU grain (millicores) shapes are grouped by before the least frequent are cut.
const MAX_GRAIN: u64 = 1 << 17;

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
    /// The CPU of the GPU shapes, sorted, without repeats: the only free-CPU values at which
    /// [`Workload::frag`] changes (see [`Workload::cpu_band`]).
    cpu_steps: Vec<u64>,
    /// The GPU shapes' distinct (share, models), and per type its index among them (CPU-only types:
    /// none): [`Workload::frag`] walks the cards once per group, not once per type.
    groups: Vec<(Percent, Option<Vec<ModelId>>)>,
    group_of: Vec<Option<usize>>,
}

/// Most groups [`Workload::frag`] keeps on the stack; a workload with more walks the cards per type.
const STACK_GROUPS: usize = 32;

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
        let mut cpu_steps: Vec<u64> = types.iter().filter(|t| t.cards > 0).map(|t| t.cpu).collect();
        cpu_steps.sort_unstable();
        cpu_steps.dedup();
        let mut groups: Vec<(Percent, Option<Vec<ModelId>>)> = Vec::new();
        let group_of = types
            .iter()
            .map(|t| {
                (t.cards > 0).then(|| {
                    let key = (t.percent, t.models.clone());
                    groups.iter().position(|g| *g == key).unwrap_or_else(|| {
                        groups.push(key);
                        groups.len() - 1
                    })
                })
            })
            .collect();
        Workload {
            groups,
            group_of,
            cpu_per_card: per_card(cpu),
            cpu_only_per_card: per_card(cpu_only),
            cards_per_pod: cards,
            types,
            constrained,
            cpu_steps,
        }
    }

    /// How many of the GPU shapes' CPU requests `cpu_free` covers. [`Workload::frag`] gives the same
    /// value for two free-CPU amounts of the same band (it compares free CPU only with those
    /// requests), which lets the engine share one evaluation among requests that differ in CPU.
    pub fn cpu_band(&self, cpu_free: u64) -> u64 {
        self.cpu_steps.partition_point(|&step| step <= cpu_free) as u64
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

    /// The typical shapes of `requests` under the popularity rule. When that keeps more than
    /// [`MAX_TYPES`] shapes, shapes are grouped by their CPU rounded up to 2, 4, 8, … millicores until
    /// it keeps no more (a task then counts as needing a little more CPU than it asks); past the
    /// coarsest grain the least frequent are cut.
    pub fn from_requests<'a>(requests: impl IntoIterator<Item = &'a Request>) -> Self {
        let mut counts: HashMap<Shape, u64> = HashMap::new();
        let mut total = 0u64;
        for r in requests {
            *counts.entry(shape(r)).or_default() += 1;
            total += 1;
        }
        Self::from_counts(&counts, total, 1).0
    }

    /// The workload of `counts` at the finest CPU grain from `grain` on that keeps at most
    /// [`MAX_TYPES`] shapes, and that grain.
    fn from_counts(counts: &HashMap<Shape, u64>, total: u64, mut grain: u64) -> (Self, u64) {
        let at = |grain: u64| popular(regroup(counts, grain).into_iter(), total);
        let mut kept = at(grain);
        while kept.len() > MAX_TYPES && grain < MAX_GRAIN {
            grain *= 2;
            kept = at(grain);
        }
        kept.truncate(MAX_TYPES);
        let covered: u64 = kept.iter().map(|(_, n)| n).sum();
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
        (Workload::new(types), grain)
    }

    /// [`Workload::frag`] of a node as it stands: its usable cards (unhealthy ones have none) and its
    /// free CPU.
    pub fn frag_now(&self, node: &Node) -> f64 {
        let free: Vec<Percent> = node.cards.iter().map(Card::usable).collect();
        self.frag(node, &free, node.cpu_free)
    }

    /// Expected fragmentation of a node (in percent of a card) if its free CPU were `cpu_free` and its
    /// cards had `free` percent usable: for each typical shape, the idle GPU it could not use.
    pub fn frag(&self, node: &Node, free: &[Percent], cpu_free: u64) -> f64 {
        debug_assert_eq!(self.types.len(), self.group_of.len(), "a workload is made by Workload::new");
        let total: Percent = free.iter().sum();
        if total == Percent::ZERO {
            return 0.0;
        }
        // Per (share, models): cards that can hold the share, and the free share on the others.
        let fit = |percent: Percent, models: &Option<Vec<ModelId>>| {
            let (mut fits, mut small) = (0u32, Percent::ZERO);
            for (card, &r) in node.cards.iter().zip(free) {
                let allowed = models.as_ref().is_none_or(|m| m.contains(&card.model));
                if allowed && r >= percent {
                    fits += 1;
                } else {
                    small += r;
                }
            }
            (fits, small)
        };
        let mut stack = [(0u32, Percent::ZERO); STACK_GROUPS];
        let grouped = self.groups.len() <= STACK_GROUPS;
        if grouped {
            for (g, (percent, models)) in self.groups.iter().enumerate() {
                stack[g] = fit(*percent, models);
            }
        }
        // Summed per type in type order whichever way the cards were walked: the same value.
        let mut f = 0.0;
        for (t, group) in self.types.iter().zip(&self.group_of) {
            let fm = match group {
                None => total,
                Some(g) => {
                    let (fits, small) = if grouped { stack[*g] } else { fit(t.percent, &t.models) };
                    if cpu_free >= t.cpu && fits >= t.cards { small } else { total }
                }
            };
            f += t.probability * f64::from(fm.0);
        }
        f
    }
}

/// A shape with its CPU rounded up to a multiple of `grain`.
fn coarse((cpu, k, d, models): Shape, grain: u64) -> Shape {
    (cpu.div_ceil(grain) * grain, k, d, models)
}

/// `counts` with CPU rounded up to a multiple of `grain` (a power of two: rounding to a finer one
/// first changes nothing).
fn regroup(counts: &HashMap<Shape, u64>, grain: u64) -> HashMap<Shape, u64> {
    let mut grouped: HashMap<Shape, u64> = HashMap::with_capacity(counts.len());
    for (s, &n) in counts {
        *grouped.entry(coarse(s.clone(), grain)).or_default() += n;
    }
    grouped
}

/// The most frequent shapes until they cover [`POPULARITY`] of `total`, most frequent first; equal
/// counts in a fixed order, so the cut is deterministic.
fn popular(counts: impl Iterator<Item = (Shape, u64)>, total: u64) -> Vec<(Shape, u64)> {
    let mut shapes: Vec<(Shape, u64)> = counts.collect();
    shapes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut covered = 0u64;
    let kept = shapes
        .iter()
        .take_while(|(_, n)| {
            let more = (covered as f64) < POPULARITY * total as f64;
            covered += n;
            more
        })
        .count();
    shapes.truncate(kept);
    shapes
}

/// Learns the target workload online from the requests a live allocator sees: counts every shape and
/// rebuilds `M` every `every` requests, so policies follow the real mix without recomputing per pod.
#[derive(Clone, Debug)]
pub struct Learner {
    counts: HashMap<Shape, u64>,
    /// The CPU grain of the last rebuild: shapes only accumulate, so it never needs to get finer, and
    /// shapes are counted at it.
    grain: u64,
    total: u64,
    every: u64,
    last: Option<Workload>,
}

/// A rebuilt workload replaces the last one only if the mix moved by more than this since the last
/// one, in total variation: half the sum over shapes of the change in probability, a shape absent
/// from one mix counting 0 there. A stable mix keeps the policies' cached scores, also when many
/// rare shapes drift by sampling noise or come and go at the popularity cut; a real shift is taken
/// once 5 % of the pods have moved.
pub const LEARN_TOLERANCE: f64 = 0.05;

fn close(a: &Workload, b: &Workload) -> bool {
    let p = |w: &Workload, t: &Typical| {
        w.types
            .iter()
            .find(|u| (t.cpu, t.cards, t.percent, &t.models) == (u.cpu, u.cards, u.percent, &u.models))
            .map_or(0.0, |u| u.probability)
    };
    let moved = a.types.iter().map(|t| (t.probability - p(b, t)).abs()).sum::<f64>()
        + b.types.iter().filter(|t| p(a, t) == 0.0).map(|t| t.probability).sum::<f64>();
    moved / 2.0 <= LEARN_TOLERANCE
}

impl Learner {
    /// A learner that rebuilds after every `every` requests (at least 1).
    pub fn new(every: u64) -> Self {
        Learner { counts: HashMap::new(), grain: 1, total: 0, every: every.max(1), last: None }
    }

    /// Counts a request; returns the new workload when it is time to rebuild and the mix has moved
    /// (see [`LEARN_TOLERANCE`]).
    pub fn observe(&mut self, r: &Request) -> Option<Workload> {
        *self.counts.entry(coarse(shape(r), self.grain)).or_default() += 1;
        self.total += 1;
        let due =
            self.total.is_multiple_of(self.every) || self.total < self.every && self.total.is_power_of_two();
        if !due {
            return None;
        }
        let (next, grain) = Workload::from_counts(&self.counts, self.total, self.grain);
        if grain != self.grain {
            // Counted at the grain every later rebuild starts from: the same workloads, and as many
            // entries as shapes at that grain, not as distinct requests ever seen.
            self.grain = grain;
            self.counts = regroup(&self.counts, grain);
        }
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
    fn thousands_of_cpu_requests_are_grouped_into_at_most_max_types_shapes() {
        let reqs: Vec<Request> = (0..6000)
            .map(|i| Request::new(1000 + i % 2000, 0, vec![share(10 + (i as u32 % 6) * 10)]))
            .collect();
        let w = Workload::from_requests(&reqs);
        assert!(w.types.len() <= MAX_TYPES, "{}", w.types.len());
        // The coarsest grain that was needed: 2,000 CPU values over 6 shares fit at 128 m.
        assert!(
            w.types.iter().all(|t| t.cpu % 128 == 0),
            "{:?}",
            w.types.iter().map(|t| t.cpu).collect::<Vec<_>>()
        );
        assert!(w.types.iter().all(|t| (1000..=3072).contains(&t.cpu)));
        assert!((w.types.iter().map(|t| t.probability).sum::<f64>() - 1.0).abs() < 1e-9);
        // A mix within the bound keeps its exact CPU.
        let few: Vec<Request> = (0..100).map(|i| Request::new(1001 + i % 7, 0, vec![share(50)])).collect();
        let mut cpus: Vec<u64> = Workload::from_requests(&few).types.iter().map(|t| t.cpu).collect();
        cpus.sort_unstable();
        assert_eq!(cpus, (1001..=1007).collect::<Vec<_>>());
    }

    /// The measure as the paper states it, card walk per type: what the grouped walk must equal
    /// exactly (the same sum in the same order).
    fn frag_per_type(w: &Workload, node: &Node, free: &[Percent], cpu_free: u64) -> f64 {
        let total: Percent = free.iter().sum();
        if total == Percent::ZERO {
            return 0.0;
        }
        let mut f = 0.0;
        for t in &w.types {
            let fits =
                node.cards.iter().zip(free).filter(|(c, r)| {
                    t.models.as_ref().is_none_or(|m| m.contains(&c.model)) && **r >= t.percent
                });
            let small: Percent = node
                .cards
                .iter()
                .zip(free)
                .filter(|(c, r)| {
                    !(t.models.as_ref().is_none_or(|m| m.contains(&c.model)) && **r >= t.percent)
                })
                .map(|(_, r)| *r)
                .sum();
            let fm = if t.cards > 0 && cpu_free >= t.cpu && fits.count() as u32 >= t.cards {
                small
            } else {
                total
            };
            f += t.probability * f64::from(fm.0);
        }
        f
    }

    #[test]
    fn the_grouped_card_walk_gives_exactly_the_per_type_measure() {
        let mut rng = crate::rng::Rng::new(5);
        for round in 0..300 {
            // Up to 60 types over a few shares and models: grouped below 32 groups, per type above.
            let types = (0..1 + rng.below(60))
                .map(|_| Typical {
                    cpu: 1000 * rng.below(20) as u64,
                    cards: rng.below(3) as u32,
                    percent: Percent([10, 25, 50, 100][rng.below(4)]),
                    models: [None, Some(vec![ModelId(0)]), Some(vec![ModelId(1)])][rng.below(3)].clone(),
                    probability: 1.0 + rng.below(100) as f64,
                })
                .collect();
            let w = Workload::new(types);
            let cards = (0..1 + rng.below(8))
                .map(|i| Card::new(format!("g{i}"), i as u32, ModelId(rng.below(2) as u16), MiB(0)))
                .collect::<Vec<_>>();
            let free: Vec<Percent> = cards.iter().map(|_| Percent(rng.below(101) as u32)).collect();
            let node = Node::new("n", 32_000, 0, cards);
            let cpu = 1000 * rng.below(20) as u64;
            assert_eq!(
                w.frag(&node, &free, cpu).to_bits(),
                frag_per_type(&w, &node, &free, cpu).to_bits(),
                "round {round}"
            );
        }
    }

    #[test]
    fn frag_depends_on_free_cpu_only_through_its_band() {
        let w = worked_example();
        let cards = (0..2).map(|i| Card::new(format!("g{i}"), i, ModelId(0), MiB(0))).collect();
        let node = Node::new("t4", 8000, 0, cards);
        let free = [Percent(70), Percent(30)];
        for a in (0..9000).step_by(250) {
            for b in (0..9000).step_by(250) {
                if w.cpu_band(a) == w.cpu_band(b) {
                    assert_eq!(w.frag(&node, &free, a), w.frag(&node, &free, b), "{a} {b}");
                }
            }
        }
        assert_eq!((w.cpu_band(1999), w.cpu_band(2000), w.cpu_band(4000)), (0, 1, 2));
    }

    #[test]
    fn the_learner_counts_at_its_grain_and_learns_what_the_whole_list_gives() {
        let reqs: Vec<Request> = (0..6000)
            .map(|i| Request::new(1000 + (i * 7919) % 2000, 0, vec![share(10 + (i as u32 % 6) * 10)]))
            .collect();
        let mut l = Learner::new(100);
        for r in &reqs {
            l.observe(r);
        }
        // 2,000 CPU values × 6 shares asked; counted at 128 m: at most 17 × 6 entries.
        assert_eq!(l.grain, 128);
        assert!(l.counts.len() <= 17 * 6, "{}", l.counts.len());
        // A rebuild from the coarse counts is the workload of all the requests at once.
        let (now, _) = Workload::from_counts(&l.counts, l.total, l.grain);
        assert_eq!(now, Workload::from_requests(&reqs));
    }

    #[test]
    fn rare_shapes_coming_and_going_at_the_cut_do_not_rebuild() {
        let mut l = Learner::new(100);
        let common = Request::new(1000, 0, vec![share(50)]);
        for _ in 0..1000 {
            l.observe(&common);
        }
        // 40 shapes seen once each (0.1 % of pods each): the set at the cut changes, the mix does not.
        let rebuilt =
            (0..40).filter(|&i| l.observe(&Request::new(5000 + i, 0, vec![share(20)])).is_some()).count();
        assert_eq!(rebuilt, 0);
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
