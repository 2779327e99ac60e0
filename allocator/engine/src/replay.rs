//! One replay of a workload through a placer, with the method of the FGD paper (reference §2.1):
//! sort by name and shuffle with the seed, top up to `tune` × GPU capacity by resampling, arrive one by
//! one, never leave; a failed pod stays failed. After every pod the allocated GPU, the arrived demand
//! and the cluster's fragmentation are recorded and binned by integer arrived percent.

use crate::engine::{Engine, NodeOrder};
use crate::model::{Cluster, NodeId};
use crate::request::Request;
use crate::rng::Rng;
use crate::trace::TracePod;
use crate::workload::{Learner, Workload};
use nano_gpu_proto::units::Percent;

/// Largest arrived percent of the curve.
pub const MAX_ARRIVED: usize = 130;

/// Something that places pods one at a time: the raw engine, or the extender path.
pub trait Placer {
    /// Places one pod; returns the node it went to, or `None` if it failed.
    fn place(&mut self, pod: &TracePod, req: &Request) -> Option<NodeId>;

    /// The engine deciding.
    fn engine(&self) -> &Engine;

    /// The engine, to change its target workload.
    fn engine_mut(&mut self) -> &mut Engine;

    /// The cluster as it is now.
    fn cluster(&self) -> &Cluster {
        self.engine().cluster()
    }
}

/// The raw engine with the paper's tie rule: equal scores go to the first node in a per-seed random
/// node order.
pub struct RawPlacer {
    /// The engine.
    pub engine: Engine,
    /// Per-seed node order.
    pub order: NodeOrder,
    /// Seeded randomness for policies that break ties uniformly.
    pub rng: Rng,
}

impl Placer for RawPlacer {
    fn place(&mut self, _pod: &TracePod, req: &Request) -> Option<NodeId> {
        let decision = self.engine.decide(req, None, &self.order, &mut self.rng).ok()?;
        self.engine.commit(req, decision.node, &decision.eval.grants).ok()?;
        Some(decision.node)
    }

    fn engine(&self) -> &Engine {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
}

/// The pods of one seed in arrival order (indices into `pods`), and the per-seed node order.
pub fn arrivals(
    pods: &[TracePod],
    cards: usize,
    tune: f64,
    nodes: usize,
    seed: u64,
) -> (Vec<usize>, NodeOrder) {
    let mut rng = Rng::new(seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by(|&a, &b| pods[a].name.cmp(&pods[b].name));
    rng.shuffle(&mut order);
    let target = tune * (cards as f64) * 100.0;
    let mut total: f64 = order.iter().map(|&i| pods[i].gpu_percent() as f64).sum();
    if !pods.is_empty() {
        if total < target {
            // The paper's stop test compares the total plus the per-card size of the next sample.
            loop {
                let pick = rng.below(pods.len());
                if total + f64::from(pods[pick].gpu_milli) / 10.0 > target {
                    break;
                }
                order.push(pick);
                total += pods[pick].gpu_percent() as f64;
                if order.len() > 50 * pods.len() + 1_000_000 {
                    break; // a workload with no GPU pods never reaches the target
                }
            }
        } else {
            while total > target && !order.is_empty() {
                let gone = order.remove(rng.below(order.len()));
                total -= pods[gone].gpu_percent() as f64;
            }
        }
    }
    (order, NodeOrder::shuffled(nodes, &mut rng))
}

/// One point of a seed's curve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Unallocated GPU in % of capacity.
    pub unallocated: f64,
    /// Fragmented GPU (F(M)) in % of capacity.
    pub frag: f64,
}

/// The outcome of one replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    /// Curve indexed by arrived percent 0..=130 (`None` where no event fell near).
    pub curve: Vec<Option<Point>>,
    /// Pods that found no node.
    pub failed: usize,
    /// Pods that arrived.
    pub arrived: usize,
}

/// Replays `order` through `placer`, measuring fragmentation under `measure` (the paper's M). With a
/// `learner`, the placer's target workload is learned online from the pods as they arrive instead of
/// given up front.
pub fn replay(
    pods: &[TracePod],
    order: &[usize],
    placer: &mut dyn Placer,
    measure: &Workload,
    mut learner: Option<Learner>,
) -> Replay {
    let cluster = placer.cluster();
    let cards = cluster.card_count().max(1) as f64;
    let mut node_frag: Vec<f64> = cluster.nodes().iter().map(|n| measure.frag_now(n)).collect();
    let mut frag_total: f64 = node_frag.iter().sum();
    let mut node_used: Vec<Percent> = cluster.nodes().iter().map(|n| n.gpu_used()).collect();
    let mut used: f64 = node_used.iter().map(|u| f64::from(u.0)).sum();
    let mut arrived = 0.0;
    let mut failed = 0;
    // Per integer arrived percent: (sum of allocation %, sum of frag %, events).
    let mut bins = vec![(0.0, 0.0, 0u32); MAX_ARRIVED + 2];
    for &i in order {
        let pod = &pods[i];
        let req = pod.request(placer.cluster());
        arrived += pod.gpu_percent() as f64;
        if let Some(workload) = learner.as_mut().and_then(|l| l.observe(&req)) {
            placer.engine_mut().set_workload(workload);
        }
        match placer.place(pod, &req) {
            Some(node) => {
                let n = placer.cluster().node(node);
                used += f64::from(n.gpu_used().0) - f64::from(node_used[node.0].0);
                node_used[node.0] = n.gpu_used();
                let f = measure.frag_now(n);
                frag_total += f - node_frag[node.0];
                node_frag[node.0] = f;
            }
            None => failed += 1,
        }
        let x = (arrived / cards).round_ties_even();
        if x <= MAX_ARRIVED as f64 {
            let b = &mut bins[x as usize];
            b.0 += (used / cards * 100.0).round() / 100.0;
            b.1 += frag_total / cards;
            b.2 += 1;
        }
    }
    let curve = (0..=MAX_ARRIVED)
        .map(|x| {
            let near = if bins[x].2 > 0 { x..=x } else { x.saturating_sub(1)..=x + 1 };
            let (a, f, n) =
                bins[near].iter().fold((0.0, 0.0, 0), |acc, b| (acc.0 + b.0, acc.1 + b.1, acc.2 + b.2));
            (n > 0).then(|| Point { unallocated: 100.0 - a / f64::from(n), frag: f / f64::from(n) })
        })
        .collect();
    Replay { curve, failed, arrived: order.len() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, k: u32, m: u32) -> TracePod {
        TracePod {
            name: name.into(),
            cpu_milli: 1000,
            memory_mib: 1024,
            num_gpu: k,
            gpu_milli: m,
            gpu_spec: vec![],
        }
    }

    #[test]
    fn arrivals_top_up_to_the_target_and_are_fixed_by_the_seed() {
        let pods: Vec<TracePod> = (0..10).map(|i| pod(&format!("p{i}"), 1, 500)).collect();
        // 10 cards: capacity 1000 %, target 1300 %: 26 pods of 50 %.
        let (order, node_order) = arrivals(&pods, 10, 1.3, 4, 42);
        assert_eq!(order.len(), 26);
        assert_eq!(arrivals(&pods, 10, 1.3, 4, 42), (order.clone(), node_order));
        assert_ne!(arrivals(&pods, 10, 1.3, 4, 43).0, order);
    }

    #[test]
    fn arrivals_drop_pods_when_the_trace_is_over_the_target() {
        let pods: Vec<TracePod> = (0..40).map(|i| pod(&format!("p{i}"), 1, 1000)).collect();
        let (order, _) = arrivals(&pods, 10, 1.3, 4, 1);
        assert_eq!(order.len(), 13);
    }
}
