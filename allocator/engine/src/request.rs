//! What a pod asks for, in the engine's terms, and the one fitting procedure every policy shares.
//!
//! A [`Request`] is host CPU and memory plus one [`SlotDemand`] per GPU slot (a share of one card or
//! whole cards) and the card models allowed. [`fit`] checks a node and, with a policy's
//! [`CardChooser`], picks the exact card(s) for every slot, or says why it cannot ([`Reason`]).

use crate::model::{Card, Grant, Host, ModelId, Node};
use nano_gpu_proto::units::{MiB, Percent};
use std::fmt;

/// One GPU slot of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SlotDemand {
    /// A share of one card: percent (1..=99) and/or memory in MiB; a memory-only share takes the
    /// percent of the card its memory is.
    Share {
        /// Share of the card.
        percent: Option<Percent>,
        /// Card memory.
        mem: Option<MiB>,
    },
    /// Whole cards, exclusive.
    Whole {
        /// Number of cards.
        cards: u32,
        /// The least memory per card.
        mem: Option<MiB>,
    },
}

impl SlotDemand {
    /// The percent this slot takes on `card`, or `None` if it cannot be expressed there (memory-only
    /// share on a card of unknown memory, or more memory than the card has).
    pub fn percent_on(&self, card: &Card) -> Option<Percent> {
        match *self {
            SlotDemand::Share { percent: Some(p), mem } => match mem {
                Some(m) if card.has_memory() && m > card.mem_total => None,
                _ => Some(p),
            },
            SlotDemand::Share { percent: None, mem: Some(m) } => {
                if !card.has_memory() || m > card.mem_total {
                    None
                } else {
                    Some(Percent(((m.0 * 100).div_ceil(card.mem_total.0)).clamp(1, 100) as u32))
                }
            }
            SlotDemand::Share { percent: None, mem: None } => Some(Percent::ZERO),
            SlotDemand::Whole { mem, .. } => match mem {
                Some(m) if card.has_memory() && m > card.mem_total => None,
                _ => Some(Percent::FULL),
            },
        }
    }

    /// Memory this slot takes on each of its cards: what it asked; a whole card all of it; a share
    /// that asked none its percent of the card's memory ([`Percent::of`]).
    pub fn mem_on(&self, card: &Card) -> MiB {
        match *self {
            SlotDemand::Share { mem: Some(m), .. } => m,
            SlotDemand::Share { percent, mem: None } => percent.unwrap_or(Percent::ZERO).of(card.mem_total),
            SlotDemand::Whole { .. } => card.mem_total,
        }
    }

    /// Number of cards the slot spans.
    pub fn cards(&self) -> u32 {
        match *self {
            SlotDemand::Share { .. } => 1,
            SlotDemand::Whole { cards, .. } => cards,
        }
    }

    /// Size in percent of one card (a memory-only share counts as 0; two whole cards are 200 %).
    pub fn size(&self) -> Percent {
        match *self {
            SlotDemand::Share { percent, .. } => percent.unwrap_or(Percent::ZERO),
            SlotDemand::Whole { cards, .. } => Percent(100 * cards),
        }
    }
}

/// Which of the node agents' front ends hands a request its cards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontEnd {
    /// The device plugin (`nano-gpu/gpu-percent` and friends): nodes whose agent does not serve DRA.
    #[default]
    DevicePlugin,
    /// DRA (claims of nano-gpu's DeviceClass): only nodes whose agent serves DRA.
    Dra,
}

/// What one pod asks for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    /// Host CPU in millicores.
    pub cpu: u64,
    /// Host memory in MiB.
    pub mem: u64,
    /// The `nano-gpu/gpu-percent` device IDs the pod asks of the kubelet (its containers' requests
    /// summed as kube-scheduler and the kubelet sum them); checked against a node's
    /// [`Node::ids_free`](crate::model::Node::ids_free) where the node knows its IDs.
    pub ids: u64,
    /// GPU slots, in container order. Empty for a CPU-only pod.
    pub slots: Vec<SlotDemand>,
    /// Allowed card models, sorted; `None` allows any; `Some(empty)` matches no card in this cluster.
    pub models: Option<Vec<ModelId>>,
    /// The front end its cards come through.
    pub front_end: FrontEnd,
}

impl Request {
    /// A device-plugin request with no model restriction.
    pub fn new(cpu: u64, mem: u64, slots: Vec<SlotDemand>) -> Self {
        Request { cpu, mem, ids: 0, slots, models: None, front_end: FrontEnd::DevicePlugin }
    }

    /// The same request asking `ids` device IDs of the kubelet.
    pub fn asking_ids(self, ids: u64) -> Self {
        Request { ids, ..self }
    }

    /// What it takes of a node besides cards.
    pub fn host(&self) -> Host {
        Host { cpu: self.cpu, mem: self.mem, ids: self.ids }
    }

    /// The same request through `front_end`.
    pub fn through(self, front_end: FrontEnd) -> Self {
        Request { front_end, ..self }
    }

    /// Whether a card of model `m` may serve this request.
    pub fn allows(&self, m: ModelId) -> bool {
        self.models.as_ref().is_none_or(|ms| ms.binary_search(&m).is_ok())
    }

    /// Total GPU asked in percent of one card.
    pub fn gpu_size(&self) -> Percent {
        self.slots.iter().map(SlotDemand::size).sum()
    }
}

/// What [`Reason::NotServing`] says.
const NOT_SERVING: &str = "no Ready nano-gpu agent, or its kubelet just failed a share for want of nano-gpu's devices: its device plugin may not serve";
/// What [`Reason::ServedByDra`] says.
const SERVED_BY_DRA: &str = "its cards are served through DRA (claims of gpu.nano-gpu.io), not to shares";
/// What [`Reason::NotDra`] says.
const NOT_DRA: &str = "its agent serves no DRA: claims of gpu.nano-gpu.io cannot get its cards";

/// Why a node cannot take a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// The node is gone from the API.
    Gone,
    /// The node's cards are not served to its kubelet now (its agent is not Ready).
    NotServing,
    /// The node's cards are served through DRA (its agent's `nano-gpu/front-end` label).
    ServedByDra,
    /// A claim's request and the node's agent serves no DRA.
    NotDra,
    /// The request wants GPUs and the node has none.
    NoGpu,
    /// No card of an allowed model on the node.
    ModelMismatch,
    /// A slot can never fit on this node, whatever is released.
    NeverFits(String),
    /// More CPU than the node has at all.
    CpuCapacity,
    /// More memory than the node has at all.
    MemCapacity,
    /// More `nano-gpu/gpu-percent` device IDs than the node's kubelet has at all (all of them: a
    /// kubelet whose device plugin is not registered has none).
    IdsCapacity(u64),
    /// Not enough free `nano-gpu/gpu-percent` device IDs at the kubelet now.
    Ids,
    /// Not enough free CPU now.
    Cpu,
    /// Not enough free memory now.
    Memory,
    /// The cards are too busy now.
    CardsBusy(String),
}

/// kube-scheduler's words for a node whose kubelet lacks the device IDs asked (its `NodeResourcesFit`
/// says the same where it counts them).
const INSUFFICIENT_IDS: &str = "Insufficient nano-gpu/gpu-percent";

impl Reason {
    /// Whether releasing other pods could never help (`FailedAndUnresolvableNodes`).
    pub fn unresolvable(&self) -> bool {
        matches!(
            self,
            Reason::Gone
                | Reason::NotServing
                | Reason::ServedByDra
                | Reason::NotDra
                | Reason::NoGpu
                | Reason::ModelMismatch
                | Reason::NeverFits(_)
                | Reason::CpuCapacity
                | Reason::MemCapacity
                | Reason::IdsCapacity(_)
        )
    }
}

impl Reason {
    /// The reason without its details, for counting nodes per reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::Gone => "node is gone",
            Reason::NotServing => NOT_SERVING,
            Reason::ServedByDra => SERVED_BY_DRA,
            Reason::NotDra => NOT_DRA,
            Reason::NoGpu => "node has no GPU",
            Reason::ModelMismatch => "no card of an allowed model",
            Reason::NeverFits(_) => "larger than any card",
            Reason::CpuCapacity => "more CPU than the node has",
            Reason::MemCapacity => "more memory than the node has",
            Reason::IdsCapacity(_) | Reason::Ids => INSUFFICIENT_IDS,
            Reason::Cpu => "insufficient cpu",
            Reason::Memory => "insufficient memory",
            Reason::CardsBusy(_) => "GPU busy",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Gone => f.write_str("node is gone"),
            Reason::NotServing => f.write_str(NOT_SERVING),
            Reason::ServedByDra => f.write_str(SERVED_BY_DRA),
            Reason::NotDra => f.write_str(NOT_DRA),
            Reason::NoGpu => f.write_str("node has no GPU"),
            Reason::ModelMismatch => f.write_str("no card of an allowed model"),
            Reason::NeverFits(s) => write!(f, "larger than any card: {s}"),
            Reason::CpuCapacity => f.write_str("more CPU than the node has"),
            Reason::MemCapacity => f.write_str("more memory than the node has"),
            Reason::IdsCapacity(has) => write!(f, "{INSUFFICIENT_IDS}: its kubelet has {has} in all"),
            Reason::Ids => f.write_str(INSUFFICIENT_IDS),
            Reason::Cpu => f.write_str("insufficient cpu"),
            Reason::Memory => f.write_str("insufficient memory"),
            Reason::CardsBusy(s) => write!(f, "GPU busy: {s}"),
        }
    }
}

/// A node's resources while slots are being placed on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tentative {
    /// Free CPU.
    pub cpu_free: u64,
    /// Free memory.
    pub mem_free: u64,
    /// Usable share per card (0 for unhealthy cards).
    pub free: Vec<Percent>,
    /// Free memory per card.
    pub card_mem_free: Vec<MiB>,
}

impl Tentative {
    /// The node as it is now.
    pub fn of(node: &Node) -> Self {
        Tentative {
            cpu_free: node.cpu_free,
            mem_free: node.mem_free,
            free: node.cards.iter().map(Card::usable).collect(),
            card_mem_free: node.cards.iter().map(|c| c.mem_free).collect(),
        }
    }
}

/// A policy's choice of card(s) among the feasible ones.
pub trait CardChooser {
    /// One card for a share of `percent[i]` on card `feasible[i]`; returns the index into `feasible`.
    fn share(&mut self, node: &Node, hyp: &Tentative, feasible: &[usize], percent: &[Percent]) -> usize;

    /// `k` cards among the fully free `feasible` ones (ascending positions); default: the lowest.
    fn whole(&mut self, _node: &Node, _hyp: &Tentative, feasible: &[usize], k: usize) -> Vec<usize> {
        feasible[..k].to_vec()
    }
}

/// Best fit: the feasible card with the least free percent (lowest position on ties).
pub struct Tightest;

impl CardChooser for Tightest {
    fn share(&mut self, _node: &Node, hyp: &Tentative, feasible: &[usize], _percent: &[Percent]) -> usize {
        (0..feasible.len()).min_by_key(|&i| (hyp.free[feasible[i]], i)).unwrap_or(0)
    }
}

/// Fits `req` on `node`, choosing cards with `chooser`. Returns the grants and the node after them.
///
/// Slots are placed whole-card first, then shares largest first; if the chooser's greedy choices
/// leave a slot without a card, the fit is retried best-fit before giving up.
pub fn fit(
    node: &Node,
    req: &Request,
    chooser: &mut dyn CardChooser,
) -> Result<(Vec<Grant>, Tentative), Reason> {
    check_node(node, req)?;
    let mut order: Vec<usize> = (0..req.slots.len()).collect();
    order.sort_by_key(|&i| {
        let s = &req.slots[i];
        (!matches!(s, SlotDemand::Whole { .. }), std::cmp::Reverse(s.size()), i)
    });
    let done = match place(node, req, &order, chooser) {
        Ok(done) => done,
        Err(e) if req.slots.len() > 1 => place(node, req, &order, &mut Tightest).map_err(|_| e)?,
        Err(e) => return Err(e),
    };
    // After the cards, whose reason says more where both lack room (they agree but for a kubelet
    // whose count is behind the cards' health).
    if node.ids_total.is_some() && req.ids > node.ids_free {
        return Err(Reason::Ids);
    }
    Ok(done)
}

/// The node-level checks: GPUs present, model, CPU and memory.
pub fn check_node(node: &Node, req: &Request) -> Result<(), Reason> {
    if !node.schedulable {
        return Err(Reason::Gone);
    }
    if !node.serving {
        return Err(Reason::NotServing);
    }
    if !req.slots.is_empty() {
        match (node.dra, req.front_end) {
            (true, FrontEnd::DevicePlugin) => return Err(Reason::ServedByDra),
            (false, FrontEnd::Dra) => return Err(Reason::NotDra),
            _ => {}
        }
        if node.cards.is_empty() {
            return Err(Reason::NoGpu);
        }
        if !node.cards.iter().any(|c| req.allows(c.model)) {
            return Err(Reason::ModelMismatch);
        }
        for s in &req.slots {
            let usable =
                node.cards.iter().filter(|c| req.allows(c.model) && s.percent_on(c).is_some()).count();
            if usable < s.cards() as usize {
                return Err(Reason::NeverFits(match *s {
                    SlotDemand::Whole { cards, .. } => {
                        format!("{cards} whole cards asked, {usable} cards here could hold them")
                    }
                    SlotDemand::Share { mem, .. } => {
                        format!("{} of GPU memory asked", mem.unwrap_or(MiB::ZERO))
                    }
                }));
            }
        }
    }
    ids_check(node, req)?;
    host_check(node, req)
}

/// The kubelet's count of `nano-gpu/gpu-percent` device IDs, where the node knows it: the kubelet
/// admits a pod only while what its pods ask fits in what it has. Here: more than it has at all;
/// [`fit`] checks what is free once the cards fit.
fn ids_check(node: &Node, req: &Request) -> Result<(), Reason> {
    match node.ids_total {
        Some(total) if req.ids > total => Err(Reason::IdsCapacity(total)),
        _ => Ok(()),
    }
}

/// The node's host CPU and memory checks, the last of [`check_node`]'s.
pub fn host_check(node: &Node, req: &Request) -> Result<(), Reason> {
    if req.cpu > node.cpu_total {
        return Err(Reason::CpuCapacity);
    }
    if req.mem > node.mem_total {
        return Err(Reason::MemCapacity);
    }
    if req.cpu > node.cpu_free {
        return Err(Reason::Cpu);
    }
    if req.mem > node.mem_free {
        return Err(Reason::Memory);
    }
    Ok(())
}

fn place(
    node: &Node,
    req: &Request,
    order: &[usize],
    chooser: &mut dyn CardChooser,
) -> Result<(Vec<Grant>, Tentative), Reason> {
    let mut hyp = Tentative::of(node);
    hyp.cpu_free -= req.cpu;
    hyp.mem_free -= req.mem;
    let mut grants = Vec::with_capacity(req.slots.len());
    let mut feasible = Vec::with_capacity(node.cards.len());
    let mut percents = Vec::with_capacity(node.cards.len());
    for &slot in order {
        let s = req.slots[slot];
        feasible.clear();
        percents.clear();
        for (i, c) in node.cards.iter().enumerate() {
            if !req.allows(c.model) || !c.healthy {
                continue;
            }
            let Some(p) = s.percent_on(c) else { continue };
            let mem = s.mem_on(c);
            let whole = matches!(s, SlotDemand::Whole { .. });
            let mem_ok = !c.has_memory()
                || if whole { hyp.card_mem_free[i] == c.mem_total } else { mem <= hyp.card_mem_free[i] };
            if p <= hyp.free[i] && mem_ok {
                feasible.push(i);
                percents.push(p);
            }
        }
        let k = s.cards() as usize;
        let chosen: Vec<usize> = match s {
            SlotDemand::Whole { .. } if feasible.len() >= k => chooser.whole(node, &hyp, &feasible, k),
            SlotDemand::Share { .. } if !feasible.is_empty() => {
                let i = chooser.share(node, &hyp, &feasible, &percents);
                vec![feasible[i]]
            }
            SlotDemand::Whole { cards, .. } => {
                return Err(Reason::CardsBusy(format!(
                    "{cards} whole free cards asked, {} free",
                    feasible.len()
                )));
            }
            SlotDemand::Share { .. } => {
                let most = node
                    .cards
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| req.allows(c.model))
                    .map(|(i, _)| hyp.free[i])
                    .max()
                    .unwrap_or(Percent::ZERO);
                return Err(Reason::CardsBusy(match s {
                    SlotDemand::Share { percent: Some(p), .. } => {
                        format!("no card has {p} free (most free: {most})")
                    }
                    _ => "no card has the GPU memory asked free".to_owned(),
                }));
            }
        };
        for card in chosen {
            let c = &node.cards[card];
            let percent = s.percent_on(c).unwrap_or(Percent::FULL);
            let mem = s.mem_on(c);
            hyp.free[card] -= percent;
            hyp.card_mem_free[card] = hyp.card_mem_free[card].saturating_sub(mem);
            grants.push(Grant { slot, card, percent, mem });
        }
    }
    grants.sort_by_key(|g| (g.slot, g.card));
    Ok((grants, hyp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Card;

    fn node(frees: &[u32]) -> Node {
        let cards = frees
            .iter()
            .enumerate()
            .map(|(i, &f)| Card {
                free: Percent(f),
                ..Card::new(format!("GPU-{i}"), i as u32, ModelId(0), MiB(16384))
            })
            .collect();
        Node::new("n", 32_000, 65_536, cards)
    }

    fn share(p: u32) -> SlotDemand {
        SlotDemand::Share { percent: Some(Percent(p)), mem: None }
    }

    #[test]
    fn best_fit_takes_the_tightest_card_that_fits() {
        let (grants, hyp) =
            fit(&node(&[100, 40, 20]), &Request::new(1000, 0, vec![share(30)]), &mut Tightest).unwrap();
        // A share that asks no memory holds its percent of the card's memory.
        assert_eq!(grants, vec![Grant { slot: 0, card: 1, percent: Percent(30), mem: MiB(4915) }]);
        assert_eq!(hyp.free, [100, 10, 20].map(Percent));
        assert_eq!(hyp.cpu_free, 31_000);
    }

    #[test]
    fn a_node_whose_cards_dra_serves_takes_pods_asking_no_gpu_only() {
        let mut n = node(&[100]);
        n.dra = true;
        let err = check_node(&n, &Request::new(1000, 0, vec![share(30)])).unwrap_err();
        assert_eq!(err, Reason::ServedByDra);
        assert!(err.unresolvable());
        assert!(err.to_string().contains("served through DRA"), "{err}");
        assert_eq!(
            check_node(&n, &Request::new(1000, 0, vec![share(30)]).through(FrontEnd::DevicePlugin)),
            Err(Reason::ServedByDra)
        );
        assert_eq!(check_node(&n, &Request::new(1000, 0, vec![])), Ok(()));
        // A claim's share goes to such a node only.
        let claim = Request::new(1000, 0, vec![share(30)]).through(FrontEnd::Dra);
        assert_eq!(check_node(&n, &claim), Ok(()));
        n.dra = false;
        let err = check_node(&n, &claim).unwrap_err();
        assert_eq!(err, Reason::NotDra);
        assert!(err.unresolvable());
        assert!(err.to_string().contains("serves no DRA"), "{err}");
    }

    #[test]
    fn whole_cards_take_the_lowest_free_cards() {
        let req = Request::new(0, 0, vec![SlotDemand::Whole { cards: 2, mem: None }]);
        let (grants, _) = fit(&node(&[90, 100, 100, 100]), &req, &mut Tightest).unwrap();
        assert_eq!(grants.iter().map(|g| g.card).collect::<Vec<_>>(), vec![1, 2]);
        assert!(grants.iter().all(|g| g.percent == Percent::FULL && g.mem == MiB(16384)));
    }

    #[test]
    fn greedy_failure_is_retried_best_fit_decreasing() {
        // A chooser that always takes the first card would put 50 on card 0 and strand 60.
        struct First;
        impl CardChooser for First {
            fn share(&mut self, _: &Node, _: &Tentative, _: &[usize], _: &[Percent]) -> usize {
                0
            }
        }
        let req = Request::new(0, 0, vec![share(50), share(50), share(60)]);
        let (grants, hyp) = fit(&node(&[100, 60]), &req, &mut First).unwrap();
        assert_eq!(grants.len(), 3);
        assert_eq!(hyp.free, vec![Percent::ZERO; 2]);
    }

    #[test]
    fn reasons_separate_never_from_not_now() {
        let n = node(&[20, 10]);
        let r = fit(&n, &Request::new(0, 0, vec![share(30)]), &mut Tightest).unwrap_err();
        assert_eq!(r.to_string(), "GPU busy: no card has 30% free (most free: 20%)");
        assert!(!r.unresolvable());
        let r = fit(&n, &Request::new(0, 0, vec![SlotDemand::Whole { cards: 3, mem: None }]), &mut Tightest)
            .unwrap_err();
        assert!(r.unresolvable(), "{r}");
        let r = fit(&n, &Request::new(64_000, 0, vec![]), &mut Tightest).unwrap_err();
        assert_eq!(r, Reason::CpuCapacity);
        let mut other_model = Request::new(0, 0, vec![share(10)]);
        other_model.models = Some(vec![ModelId(3)]);
        assert_eq!(fit(&n, &other_model, &mut Tightest).unwrap_err(), Reason::ModelMismatch);
        let big_mem = Request::new(
            0,
            0,
            vec![SlotDemand::Share { percent: Some(Percent(10)), mem: Some(MiB(20_000)) }],
        );
        assert!(fit(&n, &big_mem, &mut Tightest).unwrap_err().unresolvable());
    }

    #[test]
    fn memory_only_share_takes_the_percent_of_the_card_it_is() {
        let req = Request::new(0, 0, vec![SlotDemand::Share { percent: None, mem: Some(MiB(4096)) }]);
        let (grants, hyp) = fit(&node(&[100]), &req, &mut Tightest).unwrap();
        assert_eq!((grants[0].percent, grants[0].mem), (Percent(25), MiB(4096)));
        assert_eq!(hyp.card_mem_free, vec![MiB(16384 - 4096)]);
    }

    #[test]
    fn unhealthy_cards_take_no_work() {
        let mut n = node(&[100, 100]);
        n.cards[0].healthy = false;
        let (grants, _) = fit(&n, &Request::new(0, 0, vec![share(10)]), &mut Tightest).unwrap();
        assert_eq!(grants[0].card, 1);
    }
}
