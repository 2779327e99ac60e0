//! Property tests of the engine: no sequence of placements and releases, under any policy, ever
//! over-commits a card's percent or memory or a node's CPU or memory, and releasing everything
//! returns the cluster to empty; the engine's cached values are always what the policy computes
//! afresh.

use nano_gpu_engine::engine::{Engine, NodeOrder};
use nano_gpu_engine::model::Grant;
use nano_gpu_engine::model::{Card, Cluster, Node, NodeId};
use nano_gpu_engine::policy;
use nano_gpu_engine::request::{Request, SlotDemand};
use nano_gpu_engine::rng::Rng;
use nano_gpu_engine::workload::Workload;
use nano_gpu_proto::units::{MiB, Percent};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Place(Request),
    Release(usize),
    Unhealthy(usize, usize),
}

fn slot() -> impl Strategy<Value = SlotDemand> {
    prop_oneof![
        (1u32..=99, proptest::option::of(0u64..20_000))
            .prop_map(|(p, mem)| SlotDemand::Share { percent: Some(Percent(p)), mem: mem.map(MiB) }),
        (1u64..20_000).prop_map(|m| SlotDemand::Share { percent: None, mem: Some(MiB(m)) }),
        (1u32..=4, proptest::option::of(0u64..40_000))
            .prop_map(|(cards, mem)| SlotDemand::Whole { cards, mem: mem.map(MiB) }),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    (
        0u64..20_000,
        0u64..40_000,
        proptest::collection::vec(slot(), 0..3),
        proptest::option::of(proptest::collection::vec(0u16..2, 1..2)),
    )
        .prop_map(|(cpu, mem, slots, models)| Request {
            cpu,
            mem,
            // The clusters here do not know their kubelets' device IDs (`ids_total` is `None`).
            ids: 0,
            slots,
            models: models.map(|m| {
                let mut ids: Vec<_> = m.into_iter().map(nano_gpu_engine::model::ModelId).collect();
                ids.sort();
                ids.dedup();
                ids
            }),
            front_end: Default::default(),
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => request().prop_map(Op::Place),
        2 => (0usize..64).prop_map(Op::Release),
        1 => (0usize..8, 0usize..8).prop_map(|(n, c)| Op::Unhealthy(n, c)),
    ]
}

/// A node shape: CPU, memory, and (model index, card memory) per card.
type Shape = (u64, u64, Vec<(u16, u64)>);

fn cluster(shapes: &[Shape]) -> Cluster {
    let mut c = Cluster::new();
    let models = [c.models.intern("T4"), c.models.intern("A100")];
    for (i, (cpu, mem, cards)) in shapes.iter().enumerate() {
        let cards = cards
            .iter()
            .enumerate()
            .map(|(g, &(m, card_mem))| {
                Card::new(format!("n{i}-g{g}"), g as u32, models[usize::from(m)], MiB(card_mem))
            })
            .collect();
        c.add_node(Node::new(format!("n{i}"), *cpu, *mem, cards)).unwrap();
    }
    c
}

fn shapes() -> impl Strategy<Value = Vec<Shape>> {
    proptest::collection::vec(
        (
            1_000u64..64_000,
            1_000u64..128_000,
            proptest::collection::vec((0u16..2, prop_oneof![Just(0u64), 8_000u64..81_920]), 0..8),
        ),
        1..6,
    )
}

/// Recomputes every node's usage from the live placements and compares with the model.
fn check(c: &Cluster, live: &[(Request, NodeId, Vec<Grant>)]) {
    for (i, n) in c.nodes().iter().enumerate() {
        let mine: Vec<_> = live.iter().filter(|(_, node, _)| node.0 == i).collect();
        let cpu: u64 = mine.iter().map(|(r, ..)| r.cpu).sum();
        let mem: u64 = mine.iter().map(|(r, ..)| r.mem).sum();
        assert_eq!(n.cpu_free + cpu, n.cpu_total, "cpu accounting of {}", n.name);
        assert_eq!(n.mem_free + mem, n.mem_total, "memory accounting of {}", n.name);
        for (g, card) in n.cards.iter().enumerate() {
            let grants = mine.iter().flat_map(|(_, _, gs)| gs.iter().filter(|x| x.card == g));
            let (p, m) = grants.fold((Percent::ZERO, MiB::ZERO), |(p, m), x| (p + x.percent, m + x.mem));
            assert!(p <= Percent::FULL, "card {g} of {} over-committed: {p}", n.name);
            assert_eq!(card.free + p, Percent::FULL, "percent accounting of card {g} of {}", n.name);
            if card.has_memory() {
                assert!(m <= card.mem_total, "card {g} of {} memory over-committed", n.name);
                assert_eq!(card.mem_free + m, card.mem_total, "memory accounting of card {g} of {}", n.name);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn no_sequence_of_placements_and_releases_overcommits_anything(
        shapes in shapes(),
        ops in proptest::collection::vec(op(), 1..80),
        policy_index in 0usize..policy::NAMES.len(),
        seed in 0u64..1000,
    ) {
        let base = cluster(&shapes);
        let reqs: Vec<Request> = ops.iter().filter_map(|o| match o { Op::Place(r) => Some(r.clone()), _ => None }).collect();
        let workload = Workload::from_requests(&reqs);
        let mut e = Engine::new(base.clone(), policy::by_name(policy::NAMES[policy_index], seed).unwrap(), workload);
        let order = NodeOrder::identity(base.nodes().len());
        let mut rng = Rng::new(seed);
        let mut live: Vec<(Request, NodeId, Vec<Grant>)> = Vec::new();
        for op in ops {
            match op {
                Op::Place(req) => {
                    if let Ok(d) = e.decide(&req, None, &order, &mut rng) {
                        // The grants cover every slot with the cards it asked.
                        for (i, s) in req.slots.iter().enumerate() {
                            let n = d.eval.grants.iter().filter(|g| g.slot == i).count();
                            prop_assert_eq!(n, s.cards() as usize);
                        }
                        e.commit(&req, d.node, &d.eval.grants).unwrap();
                        live.push((req, d.node, d.eval.grants));
                    }
                }
                Op::Release(i) if !live.is_empty() => {
                    let (req, node, grants) = live.remove(i % live.len());
                    e.release(&req, node, &grants);
                }
                Op::Release(_) => {}
                Op::Unhealthy(n, c) => {
                    let id = NodeId(n % base.nodes().len());
                    e.cluster_mut().update(id, |node| {
                        if let Some(card) = node.cards.get_mut(c) {
                            card.healthy = false;
                        }
                    });
                }
            }
            check(e.cluster(), &live);
        }
        for (req, node, grants) in live.drain(..) {
            e.release(&req, node, &grants);
        }
        for (now, before) in e.cluster().nodes().iter().zip(base.nodes()) {
            prop_assert_eq!((now.cpu_free, now.mem_free), (before.cpu_free, before.mem_free));
            let free = |n: &Node| n.cards.iter().map(|c| (c.free, c.mem_free)).collect::<Vec<_>>();
            prop_assert_eq!(free(now), free(before));
        }
    }

    #[test]
    fn a_decision_never_lands_on_a_node_that_does_not_fit(
        shapes in shapes(),
        req in request(),
        policy_index in 0usize..policy::NAMES.len(),
    ) {
        let base = cluster(&shapes);
        let mut e = Engine::new(base.clone(), policy::by_name(policy::NAMES[policy_index], 1).unwrap(), Workload::default());
        let decision = e.decide(&req, None, &NodeOrder::identity(base.nodes().len()), &mut Rng::new(1));
        if let Ok(d) = decision {
            // Applying it to a fresh copy of the cluster must succeed.
            let mut fresh = base.clone();
            prop_assert!(fresh.apply(d.node, req.host(), &d.eval.grants).is_ok());
            for g in &d.eval.grants {
                let card = &base.node(d.node).cards[g.card];
                prop_assert!(req.allows(card.model));
            }
        }
    }

    /// Requests of a few GPU shapes with many CPU and memory requests share cached values where the
    /// policy allows it ([`policy::Policy::cpu_band`]): each value the engine gives must equal the
    /// one a new engine (empty cache) computes for the cluster as it is.
    #[test]
    fn cached_values_equal_fresh_ones_whatever_the_cpu_asked(
        shapes in shapes(),
        gpu in proptest::collection::vec(proptest::collection::vec(slot(), 0..3), 1..4),
        asks in proptest::collection::vec((0usize..4, 0u64..40_000, 0u64..64_000, any::<bool>()), 1..40),
        policy_index in 0usize..policy::NAMES.len(),
    ) {
        let base = cluster(&shapes);
        let reqs: Vec<Request> =
            asks.iter().map(|&(g, cpu, mem, _)| Request::new(cpu, mem, gpu[g % gpu.len()].clone())).collect();
        let workload = Workload::from_requests(&reqs);
        let name = policy::NAMES[policy_index];
        let mut e = Engine::new(base.clone(), policy::by_name(name, 7).unwrap(), workload.clone());
        let order = NodeOrder::identity(base.nodes().len());
        for (req, &(.., place)) in reqs.iter().zip(&asks) {
            let mut fresh = Engine::new(e.cluster().clone(), policy::by_name(name, 7).unwrap(), workload.clone());
            for i in 0..base.nodes().len() {
                let cached = e.evaluate(req, NodeId(i)).clone();
                prop_assert_eq!(&cached, fresh.evaluate(req, NodeId(i)), "node {} request {:?}", i, req);
            }
            if place && let Ok(d) = e.decide(req, None, &order, &mut Rng::new(1)) {
                e.commit(req, d.node, &d.eval.grants).unwrap();
            }
        }
    }
}
