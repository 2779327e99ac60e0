//! Tests of the view as a whole: records, index, rebuild, reservations and preemption together.

use super::*;
use k8s_openapi::api::core::v1::Node as KubeNode;
use nano_gpu_engine::policy;
use nano_gpu_engine::workload::Workload;
use nano_gpu_proto::annotations::GPUS_ANNOTATION;
use nano_gpu_proto::extender::MetaVictims;
use nano_gpu_proto::units::{MiB, Percent};
use serde_json::json;
use std::time::SystemTime;

/// `value` decoded as the pod watch decodes pods, with only what the view reads: every test of the
/// view so also checks that it reads nothing the watch drops.
pub(super) fn watched_pod(value: serde_json::Value) -> Pod {
    serde_json::from_value::<crate::state::slim::ViewPod>(value).unwrap().0
}

/// `value` decoded as the node watch decodes nodes (see [`watched_pod`]).
pub(super) fn watched_node(value: serde_json::Value) -> KubeNode {
    serde_json::from_value::<crate::state::slim::ViewNode>(value).unwrap().0
}

fn state() -> ClusterState {
    state_with("fgd-balance", DemandOptions::default())
}

/// An empty view deciding with `policy`, reading pods with `demand`.
fn state_with(policy: &str, demand: DemandOptions) -> ClusterState {
    let engine = Engine::new(
        nano_gpu_engine::model::Cluster::new(),
        policy::by_name(policy, 0).unwrap(),
        Workload::default(),
    );
    ClusterState::new(engine, 1, demand)
}

fn node(name: &str, cards: usize) -> KubeNode {
    let gpus: Vec<_> = (0..cards)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": "T4", "memoryMiB": 15360, "healthy": true}))
        .collect();
    watched_node(json!({
        "metadata": {"name": name, "annotations": {"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nano-gpu/gpu-percent": (cards * 100).to_string()}}
    }))
}

fn pod(uid: &str, percent: &str, node: Option<&str>, assignment: Option<String>) -> Pod {
    let mut annotations = serde_json::Map::new();
    if let Some(a) = assignment {
        annotations.insert("nano-gpu/assignment".into(), a.into());
    }
    watched_pod(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent, "cpu": "1"}}}]}
    }))
}

fn free(s: &ClusterState, node: &str) -> Vec<u32> {
    let c = s.extender().engine().cluster();
    c.node(c.id(node).unwrap()).cards.iter().map(|c| c.free.0).collect()
}

fn assignment(node: &str, card: u32, percent: u32) -> String {
    format!(
        r#"{{"v":1,"node":"{node}","at":"t","containers":{{"c":[{{"uuid":"GPU-{node}-{card}","index":{card},"percent":{percent}}}]}}}}"#
    )
}

#[test]
fn bound_pods_take_their_assigned_cards() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 1, 30))));
    assert_eq!(free(&s, "n1"), vec![100, 70]);
    let c = s.extender().engine().cluster();
    assert_eq!(c.node(c.id("n1").unwrap()).cpu_free, 15_000);
}

#[test]
fn terminal_or_deleted_pods_release_their_cards() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let mut p = pod("a", "30", Some("n1"), Some(assignment("n1", 0, 30)));
    s.apply_pod(&p);
    p.status = Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
    s.apply_pod(&p);
    assert_eq!(free(&s, "n1"), vec![100]);
    s.apply_pod(&pod("b", "50", Some("n1"), Some(assignment("n1", 0, 50))));
    s.delete_pod(&pod("b", "50", None, None));
    assert_eq!(free(&s, "n1"), vec![100]);
}

#[test]
fn an_undecodable_assignment_fails_closed_and_warns() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_pod(&pod("a", "30", Some("n1"), Some("{not json".into())));
    assert_eq!(free(&s, "n1"), vec![0, 0]);
    let w = s.take_warnings();
    assert_eq!((w[0].kind, w[0].name.as_str(), w[0].reason), ("Pod", "a", Reason::InvalidAssignment));
    // An assignment naming another node than the binding is not trusted either.
    s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n2", 0, 30))));
    assert_eq!(free(&s, "n1"), vec![0, 0]);
    s.delete_pod(&pod("a", "30", None, None));
    assert_eq!(free(&s, "n1"), vec![100, 100]);
}

/// The kubelet swapped two shares' cards (their repairs come one at a time): once `b` is repaired to
/// the card it got, its old card shows room that `c` really holds, and the node takes nothing until
/// `c`'s repair lands too and the view agrees with the kubelet again.
#[test]
fn a_card_over_100_percent_closes_its_node_until_the_repairs_land() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_pod(&pod("a", "60", Some("n1"), Some(assignment("n1", 0, 60))));
    s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&pod("d", "70", Some("n1"), Some(assignment("n1", 1, 70))));
    s.apply_pod(&pod("c", "30", Some("n1"), Some(assignment("n1", 1, 30))));
    assert_eq!(free(&s, "n1"), vec![10, 0]);
    assert!(s.take_warnings().is_empty());
    s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 1, 30))));
    assert_eq!(free(&s, "n1"), vec![0, 0]);
    let w = s.take_warnings();
    assert_eq!((w.len(), w[0].reason), (1, Reason::Overcommitted), "{w:?}");
    assert!(w[0].message.contains("no pod is placed on n1"), "{}", w[0].message);
    s.apply_pod(&pod("c", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    assert!(s.take_warnings().is_empty());
    assert_eq!(free(&s, "n1"), vec![10, 0]);
}

/// A pod that asks no GPU, as anyone who may create pods can write one.
fn plain_pod(uid: &str, node: Option<&str>, assignment: String) -> Pod {
    watched_pod(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": {"nano-gpu/assignment": assignment}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}
    }))
}

#[test]
fn an_assignment_on_a_pod_that_asks_no_gpu_takes_nothing_and_warns() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_node(&node("n3", 2));
    // Garbled, on a running pod asking no GPU: it used to make every card of n1 count as full.
    s.apply_pod(&plain_pod("forged-1", Some("n1"), "{garbage".into()));
    assert_eq!(free(&s, "n1"), vec![100, 100]);
    let w = s.take_warnings();
    assert_eq!((w[0].name.as_str(), w[0].reason), ("forged-1", Reason::IgnoredAssignment));
    assert!(w[0].message.contains("asks no GPU"), "{}", w[0].message);
    // Well-formed and naming card 1 of n3, on a pending pod asking no GPU: it used to take the card.
    s.apply_pod(&plain_pod("forged-2", None, assignment("n3", 1, 100)));
    assert_eq!(free(&s, "n3"), vec![100, 100]);
    // An invalid GPU request is never placed by the allocator either.
    s.apply_pod(&pod("forged-3", "150", Some("n3"), Some(assignment("n3", 0, 100))));
    assert_eq!(free(&s, "n3"), vec![100, 100]);
    assert!(s.take_warnings().iter().all(|w| w.reason == Reason::IgnoredAssignment));
    // The same assignment on a pod that asks a GPU still counts.
    s.apply_pod(&pod("real", "100", Some("n3"), Some(assignment("n3", 1, 100))));
    assert_eq!(free(&s, "n3"), vec![100, 0]);
}

#[test]
fn an_undecodable_inventory_gives_the_node_no_usable_card() {
    let mut s = state();
    let mut n = node("n1", 2);
    n.metadata.annotations.as_mut().unwrap().insert(GPUS_ANNOTATION.into(), r#"{"v":9}"#.into());
    s.apply_node(&n);
    let w = s.take_warnings();
    assert_eq!((w[0].kind, w[0].reason), ("Node", Reason::InvalidInventory));
    let r = s.filter(
        serde_json::from_value(json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]})).unwrap(),
    );
    assert_eq!(r.node_names, Some(vec![]));
    // The agent writes its inventory again: the node heals.
    s.apply_node(&node("n1", 2));
    assert_eq!(free(&s, "n1"), vec![100, 100]);
    let r = s.filter(
        serde_json::from_value(json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]})).unwrap(),
    );
    assert_eq!(r.node_names, Some(vec!["n1".to_owned()]));
}

#[test]
fn a_reservation_survives_a_stale_event_and_is_confirmed_by_the_annotated_one() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let p = pod("a", "60", None, None);
    let r = s.reserve(&p, "n1", SystemTime::UNIX_EPOCH).unwrap();
    assert_eq!(free(&s, "n1"), vec![40]);
    // A watch event from before the PATCH must not drop the reservation.
    s.apply_pod(&p);
    assert_eq!(free(&s, "n1"), vec![40]);
    // Another pod cannot double-book the card.
    assert!(s.reserve(&pod("b", "60", None, None), "n1", SystemTime::UNIX_EPOCH).is_err());
    // The annotated, bound pod confirms it; a repeated bind returns the same assignment.
    s.apply_pod(&pod("a", "60", Some("n1"), Some(r.assignment.encode())));
    assert_eq!(free(&s, "n1"), vec![40]);
    let again = s.reserve(&p, "n1", SystemTime::now()).unwrap();
    assert_eq!((again.assignment, again.fresh), (r.assignment, false));
}

#[test]
fn preemption_keeps_only_nodes_where_a_card_really_frees_and_only_the_victims_needed() {
    use nano_gpu_proto::extender::MetaPod;
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_node(&node("n2", 2));
    // n1: 60 % + 30 % on card 0, 70 % on card 1. n2: 40 % + 30 % on card 0, 40 % on card 1.
    s.apply_pod(&pod("a", "60", Some("n1"), Some(assignment("n1", 0, 60))));
    s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&pod("c", "70", Some("n1"), Some(assignment("n1", 1, 70))));
    s.apply_pod(&pod("d", "40", Some("n2"), Some(assignment("n2", 0, 40))));
    s.apply_pod(&pod("e", "40", Some("n2"), Some(assignment("n2", 1, 40))));
    s.apply_pod(&pod("f", "30", Some("n2"), Some(assignment("n2", 0, 30))));
    let victims = |uids: &[&str]| MetaVictims {
        pods: uids.iter().map(|u| MetaPod { uid: u.to_string() }).collect(),
        num_pdb_violations: 0,
    };
    let proposed =
        BTreeMap::from([("n1".to_string(), victims(&["a", "b", "c"])), ("n2".to_string(), victims(&["d"]))]);
    // A 70 % pod: on n1 evicting c alone frees card 1 (a and b need not go); on n2 evicting d
    // frees card 0.
    let out = s.preempt(&pod("p", "70", None, None), &proposed).unwrap();
    let uids = |n: &str| out[n].pods.iter().map(|p| p.uid.clone()).collect::<Vec<_>>();
    assert_eq!(uids("n1"), vec!["c"]);
    assert_eq!(uids("n2"), vec!["d"]);
    // Evicting only f's 30 % on n2 leaves 60 % free on each card: n2 is dropped.
    let proposed = BTreeMap::from([("n2".to_string(), victims(&["f"]))]);
    let out = s.preempt(&pod("p", "70", None, None), &proposed).unwrap();
    assert_eq!(out.get("n2").map(|v| v.pods.len()), None);
}

#[test]
fn why_gives_every_node_its_verdict_and_the_fewest_pods_in_the_way() {
    let mut s = state();
    for (name, cards) in [("n1", 2), ("n2", 2), ("n3", 1), ("n4", 1)] {
        s.apply_node(&node(name, cards));
    }
    // n1: 60 % + 30 % on card 0, 70 % on card 1. n2: 20 % on card 0 (card 1 free). n3: 50 % + 40 %.
    // n4 has no inventory (no agent published its cards).
    s.apply_pod(&pod("a", "60", Some("n1"), Some(assignment("n1", 0, 60))));
    s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&pod("c", "70", Some("n1"), Some(assignment("n1", 1, 70))));
    s.apply_pod(&pod("d", "20", Some("n2"), Some(assignment("n2", 0, 20))));
    s.apply_pod(&pod("e", "50", Some("n3"), Some(assignment("n3", 0, 50))));
    s.apply_pod(&pod("f", "40", Some("n3"), Some(assignment("n3", 0, 40))));
    let mut bare = node("n4", 1);
    bare.metadata.annotations = None;
    s.apply_node(&bare);
    let verdicts = s.why(&pod("p", "70", None, None)).unwrap();
    let at = |n: &str| verdicts.iter().find(|v| v.node == n).unwrap().clone();
    let order: Vec<&str> = verdicts.iter().map(|v| v.node.as_str()).collect();
    assert_eq!(order, ["n2", "n1", "n3", "n4"], "fits, then fewest in the way, then never: {verdicts:?}");
    assert!(at("n2").fits && at("n2").reason.is_empty());
    // n1: c alone (card 1); n3: both of its pods.
    assert_eq!(
        (at("n1").fits, at("n1").unresolvable, at("n1").freed_by.clone()),
        (false, false, vec!["ns/c".into()])
    );
    assert_eq!(at("n3").freed_by, ["ns/e", "ns/f"]);
    assert!(at("n4").unresolvable && at("n4").reason.contains("no GPU"), "{:?}", at("n4"));
    // Judged as the extender judges: the same nodes pass its filter.
    let names = vec!["n1", "n2", "n3", "n4"];
    let filtered = s.filter_names(Some(&pod("p", "70", None, None)), names);
    assert_eq!(filtered.node_names, Some(vec!["n2"]));
    // A pod asking no GPU, or one whose request cannot be read, is told so.
    let cpu_only: Pod =
        serde_json::from_value(json!({"metadata": {"name": "q", "namespace": "ns", "uid": "q"},
        "spec": {"containers": [{"name": "c"}]}}))
        .unwrap();
    assert!(s.why(&cpu_only).unwrap_err().contains("asks no nano-gpu resource"));
    assert!(s.why(&pod("r", "150", None, None)).unwrap_err().contains("150"));
}

/// A load reading: utilisation by card UUID.
fn busy(uuids: &[(&str, f64)]) -> nano_gpu_engine::load::Load {
    nano_gpu_engine::load::Load::new(uuids.iter().map(|&(u, l)| (u.to_owned(), l)).collect())
}

#[test]
fn the_map_shows_each_cards_load_and_changes_when_what_it_shows_does() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    let loads = |s: &ClusterState| -> Vec<serde_json::Value> {
        s.inspect()["nodes"][0]["cards"].as_array().unwrap().iter().map(|c| c["load"].clone()).collect()
    };
    assert_eq!(loads(&s), [serde_json::Value::Null, serde_json::Value::Null]);
    let before = s.generation();
    s.set_load(Some(busy(&[("GPU-n1-0", 90.2)])));
    assert_eq!(loads(&s), [serde_json::json!(90), serde_json::Value::Null]);
    assert!(s.generation() > before);
    // The same whole percents: nothing the map shows changed.
    let before = s.generation();
    s.set_load(Some(busy(&[("GPU-n1-0", 89.9)])));
    assert_eq!(s.generation(), before);
    s.set_load(Some(busy(&[("GPU-n1-0", 89.9), ("GPU-n1-1", 130.0)])));
    assert_eq!(loads(&s), [serde_json::json!(90), serde_json::json!(100)]);
    assert!(s.generation() > before);
    // Stale or gone: no load shown.
    let before = s.generation();
    s.set_load(None);
    assert_eq!(loads(&s), [serde_json::Value::Null, serde_json::Value::Null]);
    assert!(s.generation() > before);
}

#[test]
fn with_a_load_reading_a_bind_takes_the_least_busy_of_identical_cards() {
    let card_of = |s: &mut ClusterState, uid: &str| {
        let r = s.reserve(&pod(uid, "100", None, None), "n1", SystemTime::UNIX_EPOCH).unwrap();
        r.assignment.containers["c"][0].index
    };
    // The policy alone: the lowest free card.
    let mut s = state();
    s.apply_node(&node("n1", 3));
    assert_eq!(card_of(&mut s, "a"), 0);
    // The same view with card 0 busy: the idlest twin instead.
    let mut s = state();
    s.apply_node(&node("n1", 3));
    s.set_load(Some(busy(&[("GPU-n1-0", 90.0), ("GPU-n1-1", 40.0), ("GPU-n1-2", 5.0)])));
    assert_eq!((card_of(&mut s, "a"), s.load_cards()), (2, 3));
    // A reading dropped: the policy alone again.
    s.set_load(None);
    assert_eq!((card_of(&mut s, "b"), s.load_cards()), (0, 0));
}

#[test]
fn a_failed_bind_gives_its_reservation_back() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let r = s.reserve(&pod("a", "60", None, None), "n1", SystemTime::UNIX_EPOCH).unwrap();
    s.release(&r);
    assert_eq!(free(&s, "n1"), vec![100]);
}

/// The landing CI's soak (2026-11-25): a 70 % share bound 0.3 s after the pod watch broke (410),
/// deleted before its re-list; the list did not show it and no event ever would, and its cards
/// stayed taken until the end.
#[test]
fn a_reservation_a_relist_does_not_show_is_looked_up_and_given_back_when_its_pod_is_gone() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.reserve(&pod("gone", "70", None, None), "n1", SystemTime::UNIX_EPOCH).unwrap();
    let in_flight = pod("inflight", "20", None, None);
    s.reserve(&in_flight, "n1", SystemTime::UNIX_EPOCH).unwrap();
    s.begin_pod_relist();
    // The pod of a bind in flight is listed, not annotated yet: still reserved, nothing to look up.
    s.apply_pod(&in_flight);
    s.end_pod_relist();
    assert_eq!(free(&s, "n1"), vec![10], "both reservations kept until the API server answers");
    let unconfirmed = s.take_unconfirmed();
    let uids: Vec<&str> = unconfirmed.iter().map(|u| u.uid.as_str()).collect();
    assert_eq!(uids, ["gone"]);
    assert_eq!((unconfirmed[0].namespace.as_str(), unconfirmed[0].name.as_str()), ("ns", "gone"));
    assert!(s.take_unconfirmed().is_empty(), "taken once");
    assert!(s.forget_gone("gone"));
    assert_eq!(free(&s, "n1"), vec![80]);
    // A pod an event has shown since is what the API server said: not given back.
    s.apply_pod(&pod("inflight", "20", Some("n1"), Some(assignment("n1", 0, 20))));
    assert!(!s.forget_gone("inflight"));
    assert_eq!(free(&s, "n1"), vec![80]);
}

#[test]
fn a_deleted_node_takes_no_pods_and_comes_back_with_its_pods() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.delete_node("n1");
    let args: ExtenderArgs =
        serde_json::from_value(json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]})).unwrap();
    assert_eq!(s.filter(args).failed_and_unresolvable_nodes["n1"], "node is gone");
    s.apply_node(&node("n1", 1));
    assert_eq!(free(&s, "n1"), vec![70]);
}

#[cfg(test)]
mod properties {
    //! State rebuilt from a list of objects equals state built from the same events one by one.
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[derive(Clone, Debug)]
    enum Event {
        Node { name: usize, cards: usize, broken: bool },
        DeleteNode(usize),
        Pod { uid: usize, node: Option<usize>, card: usize, percent: u32, garbage: bool, done: bool },
        DeletePod(usize),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0usize..4, 0usize..4, proptest::bool::weighted(0.1))
                .prop_map(|(name, cards, broken)| Event::Node { name, cards, broken }),
            (0usize..4).prop_map(Event::DeleteNode),
            (
                0usize..12,
                proptest::option::of(0usize..4),
                0usize..4,
                1u32..=100,
                proptest::bool::weighted(0.1),
                proptest::bool::weighted(0.1)
            )
                .prop_map(|(uid, node, card, percent, garbage, done)| Event::Pod {
                    uid,
                    node,
                    card,
                    percent,
                    garbage,
                    done
                }),
            (0usize..12).prop_map(Event::DeletePod),
        ]
    }

    fn state() -> ClusterState {
        super::state_with("fgd", DemandOptions::default())
    }

    fn kube_node(name: usize, cards: usize, broken: bool) -> KubeNode {
        let gpus: Vec<_> = (0..cards)
            .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": "T4", "memoryMiB": 16384, "healthy": true}))
            .collect();
        let inv = if broken { "{".to_string() } else { json!({"v": 1, "gpus": gpus}).to_string() };
        watched_node(json!({
            "metadata": {"name": format!("n{name}"), "annotations": {"nano-gpu/gpus": inv}},
            "status": {"allocatable": {"cpu": "32", "memory": "64Gi", "nano-gpu/gpu-percent": (cards * 100).to_string()}}
        }))
    }

    fn kube_pod(
        uid: usize,
        node: Option<usize>,
        card: usize,
        percent: u32,
        garbage: bool,
        done: bool,
    ) -> Pod {
        let assignment = node.map(|n| {
            if garbage {
                "garbage".to_string()
            } else {
                format!(r#"{{"v":1,"node":"n{n}","at":"t","containers":{{"c":[{{"uuid":"GPU-{n}-{card}","index":{card},"percent":{percent}}}]}}}}"#)
            }
        });
        watched_pod(json!({
            "metadata": {"name": format!("p{uid}"), "namespace": "ns", "uid": format!("u{uid}"),
                         "annotations": assignment.map(|a| json!({"nano-gpu/assignment": a})).unwrap_or(json!({}))},
            "spec": {"nodeName": node.map(|n| format!("n{n}")),
                     "containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent.to_string(), "cpu": "1"}}}]},
            "status": {"phase": if done { "Succeeded" } else { "Running" }}
        }))
    }

    /// A schedulable node: name, schedulable, free CPU, each card's free percent.
    type NodeView = (String, bool, u64, Vec<u32>);

    /// Every schedulable node's free CPU and cards, and the waiting pods (the GPU map's list).
    fn view(s: &ClusterState) -> (Vec<NodeView>, Vec<String>) {
        let mut v: Vec<_> = s
            .extender()
            .engine()
            .cluster()
            .nodes()
            .iter()
            .filter(|n| n.schedulable)
            .map(|n| (n.name.clone(), n.schedulable, n.cpu_free, n.cards.iter().map(|c| c.free.0).collect()))
            .collect();
        v.sort();
        (v, s.waiting.keys().cloned().collect())
    }

    proptest! {
        #[test]
        fn state_from_a_list_equals_state_from_the_events(events in proptest::collection::vec(event(), 0..60)) {
            let mut one_by_one = state();
            let mut nodes: BTreeMap<usize, KubeNode> = BTreeMap::new();
            let mut pods: BTreeMap<usize, Pod> = BTreeMap::new();
            for e in events {
                match e {
                    Event::Node { name, cards, broken } => {
                        let n = kube_node(name, cards, broken);
                        one_by_one.apply_node(&n);
                        nodes.insert(name, n);
                    }
                    Event::DeleteNode(name) => {
                        one_by_one.delete_node(&format!("n{name}"));
                        nodes.remove(&name);
                    }
                    Event::Pod { uid, node, card, percent, garbage, done } => {
                        let p = kube_pod(uid, node, card, percent, garbage, done);
                        one_by_one.apply_pod(&p);
                        pods.insert(uid, p);
                    }
                    Event::DeletePod(uid) => {
                        if let Some(p) = pods.remove(&uid) {
                            one_by_one.delete_pod(&p);
                        }
                    }
                }
            }
            let mut listed = state();
            listed.reset_nodes(&nodes.values().cloned().collect::<Vec<_>>());
            listed.reset_pods(&pods.values().cloned().collect::<Vec<_>>());
            prop_assert_eq!(view(&one_by_one), view(&listed));
            // And a re-list on top of the event-built state changes nothing.
            one_by_one.reset_nodes(&nodes.values().cloned().collect::<Vec<_>>());
            one_by_one.reset_pods(&pods.values().cloned().collect::<Vec<_>>());
            prop_assert_eq!(view(&one_by_one), view(&listed));
        }
    }
}

/// A pod gpushare placed before nano-gpu took over: `aliyun.com/gpu-mem` (GiB), bound, with
/// gpushare's own annotations and no assignment.
fn gpushare_pod(uid: &str, gib: &str, node: Option<&str>, annotations: serde_json::Value) -> Pod {
    watched_pod(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid, "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": gib}}}]}
    }))
}

fn gpushare_state() -> ClusterState {
    state_with("fgd-balance", DemandOptions { gpushare: Some(nano_gpu_proto::demand::GpushareUnit::GiB) })
}

fn mem_free(s: &ClusterState, node: &str) -> Vec<u64> {
    let c = s.extender().engine().cluster();
    c.node(c.id(node).unwrap()).cards.iter().map(|c| c.mem_free.0).collect()
}

#[test]
fn pods_gpushare_placed_hold_their_memory_on_gpushare_s_card() {
    let mut s = gpushare_state();
    s.apply_node(&node("n1", 3));
    // 3 GiB of a 15 GiB card: 3072 MiB and 20 %, the rule of a memory-only share.
    s.apply_pod(&gpushare_pod(
        "a",
        "3",
        Some("n1"),
        json!({"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}),
    ));
    assert_eq!(free(&s, "n1"), vec![100, 80, 100]);
    assert_eq!(mem_free(&s, "n1"), vec![15360, 12288, 15360]);
    // The per-container map of newer gpushare extenders wins over the index.
    s.apply_pod(&gpushare_pod(
        "b",
        "2",
        Some("n1"),
        json!({"ALIYUN_COM_GPU_MEM_IDX": "0", "scheduler.framework.gpushare.allocation": r#"{"0":{"2":2}}"#}),
    ));
    assert_eq!(mem_free(&s, "n1"), vec![15360, 12288, 13312]);
    let inspect = s.inspect();
    assert_eq!(inspect["nodes"][0]["cards"][1]["pods"], json!(["ns/a"]));
    assert_eq!(inspect["nodes"][0]["cards"][2]["pods"], json!(["ns/b"]));
    // New pods are placed around them: 14 GiB fits only card 0.
    let mut p = gpushare_pod("c", "14", None, json!({}));
    p.spec.as_mut().unwrap().node_name = None;
    let r = s.reserve(&p, "n1", SystemTime::UNIX_EPOCH).unwrap();
    assert_eq!(r.assignment.containers["c"][0].index, 0);
    assert!(s.take_warnings().is_empty());
    s.delete_pod(&gpushare_pod("a", "3", None, json!({})));
    assert_eq!(mem_free(&s, "n1")[1], 15360);
}

#[test]
fn gpushare_annotations_hold_nothing_on_pending_pods_or_pods_asking_no_gpu_or_without_compatibility() {
    let idx = json!({"ALIYUN_COM_GPU_MEM_IDX": "0"});
    let mut s = gpushare_state();
    s.apply_node(&node("n1", 1));
    s.apply_pod(&gpushare_pod("pending", "3", None, idx.clone()));
    let mut no_gpu = gpushare_pod("no-gpu", "3", Some("n1"), idx.clone());
    no_gpu.spec.as_mut().unwrap().containers[0].resources = None;
    s.apply_pod(&no_gpu);
    assert_eq!(free(&s, "n1"), vec![100]);
    let w = s.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].message.contains("gpushare's annotations on a pod that asks no GPU"), "{w:?}");
    // Without gpushare compatibility, aliyun.com/gpu-mem is not ours to read.
    let mut plain = state();
    plain.apply_node(&node("n1", 1));
    plain.apply_pod(&gpushare_pod("a", "3", Some("n1"), idx));
    assert_eq!(free(&plain, "n1"), vec![100]);
    assert!(plain.take_warnings().is_empty());
    // Nor is a gpushare pod nano-gpu placed; the warning says how to read it (a tool run without
    // the cluster's --gpushare).
    let ours = json!({"nano-gpu/assignment": assignment("n1", 0, 20)});
    plain.apply_pod(&gpushare_pod("b", "3", Some("n1"), ours));
    assert_eq!(free(&plain, "n1"), vec![100]);
    let w = plain.take_warnings();
    assert!(
        w.len() == 1 && w[0].message.contains("asks aliyun.com/gpu-mem: read it with --gpushare"),
        "{w:?}"
    );
}

#[test]
fn a_gpushare_card_that_cannot_be_told_counts_on_every_card_and_warns() {
    let mut s = gpushare_state();
    s.apply_node(&node("n1", 2));
    for (uid, idx) in [("gone", "7"), ("garbled", "x")] {
        s.apply_pod(&gpushare_pod(uid, "3", Some("n1"), json!({"ALIYUN_COM_GPU_MEM_IDX": idx})));
    }
    // Each pod's 3 GiB (20 %) on both cards: whichever card it is on, nothing is over-committed.
    assert_eq!(free(&s, "n1"), vec![60, 60]);
    assert_eq!(mem_free(&s, "n1"), vec![15360 - 6144, 15360 - 6144]);
    let w = s.take_warnings();
    assert!(w.iter().all(|w| w.reason == Reason::GpushareCardUnknown), "{w:?}");
    assert!(
        w.iter().any(|w| w.name == "gone" && w.message.contains("card index 7 is not a card of n1")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|w| w.name == "garbled" && w.message.contains("\"x\" is not a card index")),
        "{w:?}"
    );
    assert_eq!(s.inspect()["nodes"][0]["cards"][0]["pods"], json!(["ns/garbled", "ns/gone"]));
}

#[test]
fn what_the_agent_publishes_for_gpushare_s_tools_changes_nothing_the_allocator_counts() {
    let mut s = gpushare_state();
    s.apply_node(&node("n1", 2));
    let before = (free(&s, "n1"), mem_free(&s, "n1"));
    // gpushare's tools divide aliyun.com/gpu-mem by aliyun.com/gpu-count; the allocator reads neither.
    let mut published = node("n1", 2);
    let alloc = published.status.as_mut().unwrap().allocatable.as_mut().unwrap();
    for (k, v) in [("aliyun.com/gpu-count", "9"), ("aliyun.com/gpu-mem", "1")] {
        alloc.insert(k.into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity(v.into()));
    }
    s.apply_node(&published);
    assert_eq!((free(&s, "n1"), mem_free(&s, "n1")), before);
}

/// One memory truth: a share that asks no GPU memory holds its percent of the card's memory in the
/// engine (placed by us or read back from its assignment), in the inspect view and in what the agent
/// tells its container (`Percent::of`, the agent's `NANO_GPU_MEMORY_MIB`), so a later pod asking
/// memory is not placed into memory already promised.
#[test]
fn a_share_asking_no_memory_holds_its_percent_of_the_cards_memory_everywhere() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    // Read back from an assignment that records no memory.
    s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 1, 30))));
    assert_eq!(mem_free(&s, "n1"), vec![15_360, 15_360 - 4608]);
    assert_eq!(Percent(30).of(MiB(15_360)), MiB(4608));
    let cards = &s.inspect()["nodes"][0]["cards"];
    assert_eq!(
        (cards[1]["memoryMiB"].as_u64(), cards[1]["memoryFreeMiB"].as_u64()),
        (Some(15_360), Some(10_752))
    );
    // 10 % and 11,000 MiB: card 1 has the percent but not the memory any more.
    let wants_memory: Pod = serde_json::from_value(json!({
        "metadata": {"name": "m", "namespace": "ns", "uid": "m"},
        "spec": {"containers": [{"name": "c", "resources": {"limits":
            {"nano-gpu/gpu-percent": "10", "nano-gpu/gpu-memory": "11000", "cpu": "1"}}}]}
    }))
    .unwrap();
    let r = s.reserve(&wants_memory, "n1", SystemTime::UNIX_EPOCH).unwrap();
    assert_eq!(r.assignment.containers["c"][0].index, 0);
    assert_eq!(mem_free(&s, "n1"), vec![15_360 - 11_000, 10_752]);
    // A share placed by us holds the same as one read back.
    let b = pod("b", "30", None, None);
    let r = s.reserve(&b, "n1", SystemTime::UNIX_EPOCH).unwrap();
    let card = r.assignment.containers["c"][0].index as usize;
    assert_eq!(card, 1, "only card 1 has 4,608 MiB free");
    assert_eq!(mem_free(&s, "n1")[1], 15_360 - 2 * 4608);
    // Released, it gives back what it held.
    s.delete_pod(&b);
    assert_eq!(mem_free(&s, "n1"), vec![15_360 - 11_000, 10_752]);
}

/// An agent pod on `node`: Ready or not, going away or not.
fn agent(uid: &str, node: &str, ready: bool, deleting: bool) -> Pod {
    let status = if ready { "True" } else { "False" };
    let mut p = watched_pod(json!({
        "metadata": {"name": uid, "namespace": "nano-gpu-system", "uid": uid,
                     "labels": {"app.kubernetes.io/name": "nano-gpu-agent"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "nano-gpu-agent",
                                          "uid": "ds-1", "controller": true}]},
        "spec": {"nodeName": node, "containers": [{"name": "agent"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": status}]}
    }));
    if deleting {
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-01-01T00:00:00Z".parse().unwrap(),
        ));
    }
    p
}

#[test]
fn no_pod_is_placed_where_no_ready_agent_runs_when_that_is_required() {
    let mut s = state().require_ready_agents("app.kubernetes.io/name", "nano-gpu-agent", "nano-gpu-system");
    s.apply_node(&node("n1", 1));
    s.apply_node(&node("n2", 1));
    let filter = |s: &mut ClusterState| {
        let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1", "n2"]});
        s.filter(serde_json::from_value(args).unwrap())
    };
    // No agent anywhere yet: nowhere, with the reason.
    let r = filter(&mut s);
    assert_eq!(r.node_names, Some(vec![]));
    assert!(r.failed_and_unresolvable_nodes["n1"].contains("no Ready nano-gpu agent"));
    let refused = s.reserve(&pod("p", "10", None, None), "n1", SystemTime::UNIX_EPOCH).unwrap_err();
    assert!(refused.to_string().contains("node n1: no Ready nano-gpu agent"), "{refused}");
    // n1's agent starts (not Ready yet), then is Ready; n2's is Ready but going away.
    s.apply_pod(&agent("a1", "n1", false, false));
    assert_eq!(filter(&mut s).node_names, Some(vec![]));
    s.apply_pod(&agent("a1", "n1", true, false));
    s.apply_pod(&agent("a2", "n2", true, true));
    assert_eq!(filter(&mut s).node_names, Some(vec!["n1".to_owned()]));
    assert_eq!(s.inspect()["nodes"][0]["agentReady"], true);
    assert_eq!(s.inspect()["nodes"][1]["agentReady"], false);
    assert!(s.reserve(&pod("p", "10", None, None), "n1", SystemTime::UNIX_EPOCH).is_ok());
    // n1's agent deleted; a re-list that no longer shows n2's.
    s.delete_pod(&agent("a1", "n1", true, false));
    s.apply_pod(&agent("a2", "n2", true, false));
    assert_eq!(filter(&mut s).node_names, Some(vec!["n2".to_owned()]));
    s.reset_pods(&[]);
    assert_eq!(filter(&mut s).node_names, Some(vec![]));
}

/// A rollout: the new agent pod of a node starts beside the old one. The node serves while either is
/// Ready, and stops only when neither is; an agent that moves between states or is seen twice counts
/// once.
#[test]
fn a_node_serves_while_any_of_its_agents_is_ready() {
    let mut s = state().require_ready_agents("app.kubernetes.io/name", "nano-gpu-agent", "nano-gpu-system");
    s.apply_node(&node("n1", 1));
    let serves = |s: &mut ClusterState| {
        let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]});
        s.filter(serde_json::from_value(args).unwrap()).node_names == Some(vec!["n1".to_owned()])
    };
    s.apply_pod(&agent("old", "n1", true, false));
    s.apply_pod(&agent("old", "n1", true, false));
    s.apply_pod(&agent("new", "n1", false, false));
    assert!(serves(&mut s));
    s.apply_pod(&agent("new", "n1", true, false));
    s.apply_pod(&agent("old", "n1", true, true));
    assert!(serves(&mut s), "the new agent is Ready");
    s.delete_pod(&agent("old", "n1", true, true));
    assert!(serves(&mut s));
    s.apply_pod(&agent("new", "n1", false, false));
    assert!(!serves(&mut s), "no agent of n1 is Ready");
    s.apply_pod(&agent("new", "n1", true, false));
    assert!(serves(&mut s));
    s.delete_pod(&agent("new", "n1", true, false));
    s.delete_pod(&agent("new", "n1", true, false));
    assert!(!serves(&mut s), "a delete seen twice");
    s.apply_pod(&agent("again", "n1", true, false));
    assert!(serves(&mut s));
}

/// A node chosen while its agent was Ready whose agent pod is deleted before the bind (a DaemonSet
/// rollout, an operator's delete): the bind does not take the filter's hold there but decides anew,
/// and is refused, so kube-scheduler tries the pod again elsewhere instead of its kubelet refusing it
/// for want of healthy devices once the plugin is gone.
#[test]
fn a_bind_to_a_node_whose_agent_went_away_since_the_filter_is_refused() {
    let mut s = state().require_ready_agents("app.kubernetes.io/name", "nano-gpu-agent", "nano-gpu-system");
    s.apply_node(&node("n1", 1));
    s.apply_pod(&agent("a1", "n1", true, false));
    let p = pod("p", "30", None, None);
    s.apply_pod(&p);
    let t0 = Instant::now();
    assert_eq!(s.choose_names(Some(&p), vec!["n1"], t0).node_names, Some(vec!["n1"]));
    assert!(s.held_by_filter("p"));
    s.apply_pod(&agent("a1", "n1", true, true));
    assert_eq!(s.take_filter_hold("p", "n1"), None);
    let refused = s.reserve(&p, "n1", SystemTime::UNIX_EPOCH).unwrap_err();
    assert!(refused.to_string().contains("no Ready nano-gpu agent"), "{refused}");
    assert!(!s.held_by_filter("p"));
    assert_eq!(free(&s, "n1"), vec![100], "the hold was given back");
}

/// A share its kubelet failed for want of our devices (the agent's whole container restarting) pauses
/// its node for [`super::REFUSAL_PAUSE`]: the agent may still look Ready, and the failed share's
/// cards are free again, so the policy would choose the node again. Other failures, pods bound by
/// hand, and failed pods a re-list finds (the view held none of them), pause nothing.
#[test]
fn a_node_whose_kubelet_failed_a_share_for_want_of_devices_is_paused() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_node(&node("n2", 1));
    let filter = |s: &mut ClusterState| {
        let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1", "n2"]});
        s.filter(serde_json::from_value(args).unwrap()).node_names.unwrap()
    };
    let failed = |uid: &str, reason: &str, message: &str| {
        let mut p = pod(uid, "30", Some("n1"), Some(assignment("n1", 0, 30)));
        p.status = Some(
            serde_json::from_value(json!({"phase": "Failed", "reason": reason, "message": message})).unwrap(),
        );
        p
    };
    let unhealthy = "Pod was rejected: Allocate failed due to no healthy devices present; cannot allocate \
                     unhealthy devices nano-gpu/gpu-percent, which is unexpected";
    // Another failure (the container's own) pauses nothing.
    s.apply_pod(&pod("x", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&failed("x", "Error", "exit code 1"));
    assert_eq!(filter(&mut s), ["n1", "n2"]);
    // A re-list that finds a share failed so long ago pauses nothing either.
    s.apply_pod(&failed("old", "UnexpectedAdmissionError", unhealthy));
    assert_eq!(filter(&mut s), ["n1", "n2"]);
    // A pod bound by hand (a tenant's nodeName, no assignment) that asks more than is free fails so
    // too: it pauses nothing (anyone could make one, on every node).
    let mut by_hand = pod("t", "30", Some("n1"), None);
    s.apply_pod(&by_hand);
    let unavailable = "Pod was rejected: Allocate failed due to requested number of devices unavailable for \
                       nano-gpu/gpu-percent. Requested: 30, Available: 20, which is unexpected";
    by_hand.status = Some(
        serde_json::from_value(
            json!({"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": unavailable}),
        )
        .unwrap(),
    );
    s.apply_pod(&by_hand);
    assert_eq!(filter(&mut s), ["n1", "n2"]);
    // A held share failed so: n1 takes nothing, with the reason, and its card is free.
    s.apply_pod(&pod("a", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    let start = Instant::now();
    s.apply_pod(&failed("a", "UnexpectedAdmissionError", unhealthy));
    assert_eq!(free(&s, "n1"), vec![100]);
    assert_eq!(filter(&mut s), ["n2"]);
    let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]});
    let why = s.filter(serde_json::from_value(args).unwrap()).failed_and_unresolvable_nodes["n1"].clone();
    assert!(why.contains("just failed a share for want of nano-gpu's devices"), "{why}");
    assert_eq!(s.inspect()["nodes"][0]["agentReady"], false);
    // Until the pause is over.
    s.expire_kubelet_refusals(start + super::REFUSAL_PAUSE - Duration::from_millis(1));
    assert_eq!(filter(&mut s), ["n2"]);
    s.expire_kubelet_refusals(start + super::REFUSAL_PAUSE + Duration::from_millis(1));
    assert_eq!(filter(&mut s), ["n1", "n2"]);
    // gpushare's resource too.
    let gib = "Pod was rejected: Allocate failed due to cannot allocate unregistered device aliyun.com/gpu-mem, which is unexpected";
    s.apply_pod(&pod("b", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&failed("b", "UnexpectedAdmissionError", gib));
    assert_eq!(filter(&mut s), ["n2"]);
    // A plugin that died during the kubelet's call (the message names no resource).
    let start = start + super::REFUSAL_PAUSE * 2;
    s.expire_kubelet_refusals(start);
    assert_eq!(filter(&mut s), ["n1", "n2"]);
    let reset = "Pod was rejected: Allocate failed due to device plugin GetPreferredAllocation rpc failed with \
                 err: rpc error: code = Unavailable desc = error reading from server: connection reset by peer, \
                 which is unexpected";
    s.apply_pod(&pod("c", "30", Some("n1"), Some(assignment("n1", 0, 30))));
    s.apply_pod(&failed("c", "UnexpectedAdmissionError", reset));
    assert_eq!(filter(&mut s), ["n2"]);
}

/// A tenant's pod labelled as an agent (in its own namespace, or with no DaemonSet controlling it)
/// does not make a node serve.
#[test]
fn only_the_system_s_daemonset_pods_count_as_agents() {
    let mut s = state().require_ready_agents("app.kubernetes.io/name", "nano-gpu-agent", "nano-gpu-system");
    s.apply_node(&node("n1", 1));
    let filter = |s: &mut ClusterState| {
        let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]});
        s.filter(serde_json::from_value(args).unwrap()).node_names.unwrap()
    };
    let mut posing = agent("t1", "n1", true, false);
    posing.metadata.namespace = Some("tenant".into());
    s.apply_pod(&posing);
    let mut unowned = agent("t2", "n1", true, false);
    unowned.metadata.owner_references = None;
    s.apply_pod(&unowned);
    assert!(filter(&mut s).is_empty(), "no agent of the system runs on n1");
    s.apply_pod(&agent("a1", "n1", true, false));
    assert_eq!(filter(&mut s), ["n1"]);
}

#[test]
fn without_the_requirement_agents_do_not_matter() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1"]});
    assert_eq!(s.filter(serde_json::from_value(args).unwrap()).node_names, Some(vec!["n1".to_owned()]));
    assert_eq!(s.inspect()["nodes"][0]["agentReady"], true);
}

/// Found by the fault suite (all our API connections cut mid-bind): a bind wrote its assignment,
/// lost the answer, and kept the cards; kube-scheduler asked again and the pod, counted against its
/// own cards, fitted nowhere and waited as unschedulable beside them.
#[test]
fn a_pod_holding_cards_is_judged_without_them_and_binds_to_them_again() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_node(&node("n2", 1));
    s.apply_pod(&pod("b", "70", Some("n1"), Some(assignment("n1", 0, 70))));
    s.apply_pod(&pod("c", "80", Some("n2"), Some(assignment("n2", 0, 80))));
    let filter =
        |s: &mut ClusterState, p: &Pod| s.filter_names(Some(p), vec!["n1", "n2"]).node_names.unwrap();
    // Held by its reservation, and by its annotation as the watch shows it (an unbound pod).
    let reserved = pod("a", "30", None, None);
    s.reserve(&reserved, "n1", SystemTime::UNIX_EPOCH).unwrap();
    let annotated = pod("d", "20", None, Some(assignment("n2", 0, 20)));
    s.apply_pod(&annotated);
    assert_eq!((free(&s, "n1"), free(&s, "n2")), (vec![0], vec![0]));
    assert!(filter(&mut s, &pod("e", "20", None, None)).is_empty(), "no room for another");
    assert_eq!(filter(&mut s, &reserved), vec!["n1"]);
    assert_eq!(filter(&mut s, &annotated), vec!["n2"]);
    let scores = s.prioritize_names(Some(&reserved), vec!["n1", "n2"]);
    assert_eq!(scores.len(), 2);
    // The cards stay held, and a bind on the same node takes the same ones.
    assert_eq!((free(&s, "n1"), free(&s, "n2")), (vec![0], vec![0]));
    assert!(!s.reserve(&reserved, "n1", SystemTime::UNIX_EPOCH).unwrap().fresh);
    assert!(!s.reserve(&annotated, "n2", SystemTime::UNIX_EPOCH).unwrap().fresh);
}

#[test]
fn a_node_whose_runtime_honours_a_pods_env_or_annotations_is_served_to_no_one() {
    // Even without --require-ready-agent, and whichever agent is still Ready there (a rollout keeps
    // the old one until the new one is Ready, which on such a node it never is). A value a later agent
    // may write counts as not held too.
    for verdict in ["env-honoured", "annotations-honoured", "something-new"] {
        let mut s = state();
        let mut honoured = node("n1", 1);
        honoured.metadata.labels =
            Some([("nano-gpu/device-isolation".to_owned(), verdict.to_owned())].into());
        s.apply_node(&honoured);
        s.apply_node(&node("n2", 1));
        let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1", "n2"]});
        let r = s.filter(serde_json::from_value(args.clone()).unwrap());
        assert_eq!(r.node_names, Some(vec!["n2".to_owned()]), "{verdict}");
        assert!(r.failed_and_unresolvable_nodes.contains_key("n1"), "{verdict}: {r:?}");
        assert!(s.reserve(&pod("p", "10", None, None), "n1", SystemTime::UNIX_EPOCH).is_err());
        // Fixed, and the agent's canaries say so: served again.
        let mut held = node("n1", 1);
        held.metadata.labels = Some([("nano-gpu/device-isolation".to_owned(), "held".to_owned())].into());
        s.apply_node(&held);
        let r = s.filter(serde_json::from_value(args).unwrap());
        assert_eq!(r.node_names, Some(vec!["n1".to_owned(), "n2".to_owned()]), "{verdict}");
    }
}

#[test]
fn a_node_whose_cards_dra_serves_takes_no_share() {
    // Its agent serves the cards as the DRA driver: claims book them, so no share may.
    let mut s = state();
    let mut dra = node("n1", 1);
    dra.metadata.labels = Some([("nano-gpu/front-end".to_owned(), "dra".to_owned())].into());
    s.apply_node(&dra);
    s.apply_node(&node("n2", 1));
    let args = json!({"Pod": pod("p", "10", None, None), "NodeNames": ["n1", "n2"]});
    let r = s.filter(serde_json::from_value(args.clone()).unwrap());
    assert_eq!(r.node_names, Some(vec!["n2".to_owned()]));
    let why = &r.failed_and_unresolvable_nodes["n1"];
    assert!(why.contains("served through DRA"), "{why}");
    assert!(s.reserve(&pod("p", "10", None, None), "n1", SystemTime::UNIX_EPOCH).is_err());
    // Back to the device plugin (the label gone): shares again.
    s.apply_node(&node("n1", 1));
    let r = s.filter(serde_json::from_value(args).unwrap());
    assert_eq!(r.node_names, Some(vec!["n1".to_owned(), "n2".to_owned()]));
}

#[test]
fn a_pod_refused_everywhere_is_requeued_once_the_view_has_changed_since() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_pod(&pod("a", "80", Some("n1"), Some(assignment("n1", 0, 80))));
    // Fits: nothing to requeue, even after changes.
    assert_eq!(
        s.filter_names(Some(&pod("small", "10", None, None)), vec!["n1"]).node_names,
        Some(vec!["n1"])
    );
    s.apply_node(&node("n2", 1));
    assert_eq!(s.requeue_due(), None);
    // Refused on every node asked: nothing due until the view changes, then once.
    let refused = s.filter_names(Some(&pod("big", "50", None, None)), vec!["n1"]);
    assert_eq!(refused.node_names, Some(vec![]));
    assert_eq!(s.requeue_due(), None, "the view has not changed since the refusal");
    s.delete_pod(&pod("a", "80", Some("n1"), Some(assignment("n1", 0, 80))));
    assert!(s.requeue_due().is_some(), "the card freed after the refusal");
    assert_eq!(s.requeue_due(), None, "once per refusal");
    // A requeue that could not be made is due again.
    let _ = s.filter_names(Some(&pod("huge", "200", None, None)), vec!["n1", "n2"]);
    s.apply_node(&node("n3", 1));
    assert!(s.requeue_due().is_some());
    s.requeue_failed();
    assert!(s.requeue_due().is_some());
}

/// A node of `cards` cards whose kubelet advertises `ids` device IDs of `nano-gpu/gpu-percent` (or
/// none at all: the agent's device plugin is not registered).
fn node_with_ids(name: &str, cards: usize, ids: Option<&str>) -> KubeNode {
    let mut n = node(name, cards);
    let alloc = n.status.as_mut().unwrap().allocatable.as_mut().unwrap();
    match ids {
        Some(ids) => alloc.insert(
            "nano-gpu/gpu-percent".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(ids.into()),
        ),
        None => alloc.remove("nano-gpu/gpu-percent"),
    };
    n
}

/// kube-scheduler leaves `nano-gpu/gpu-percent` to the extender (`ignoredByScheduler`), so the
/// filter checks what the kubelet admits: the device IDs its pods ask within the node's allocatable.
#[test]
fn the_filter_counts_the_device_ids_the_kubelet_has_as_kube_scheduler_would() {
    let mut s = state();
    // No device plugin registered: nothing is placed there whatever the cards show, and no pod's
    // end could help.
    s.apply_node(&node_with_ids("n1", 1, None));
    // Two cards published, but the kubelet has only one card's IDs (the other's are unhealthy at
    // the device plugin, or not registered yet).
    s.apply_node(&node_with_ids("n2", 2, Some("100")));
    s.apply_pod(&pod("a", "60", Some("n2"), Some(assignment("n2", 0, 60))));
    let r = s.filter_names(Some(&pod("b", "50", None, None)), vec!["n1", "n2"]);
    assert_eq!(r.node_names, Some(vec![]));
    assert_eq!(
        r.failed_and_unresolvable_nodes["n1"],
        "Insufficient nano-gpu/gpu-percent: its kubelet has 0 in all"
    );
    assert_eq!(r.failed_nodes["n2"], "Insufficient nano-gpu/gpu-percent", "{r:?}");
    // 40 IDs are left on n2: a 40 % share fits (on the free card), and its reservation takes them.
    let c = pod("c", "40", None, None);
    assert_eq!(s.filter_names(Some(&c), vec!["n1", "n2"]).node_names, Some(vec!["n2"]));
    let reservation = s.reserve(&c, "n2", SystemTime::UNIX_EPOCH).unwrap();
    assert_eq!(s.filter_names(Some(&pod("d", "1", None, None)), vec!["n2"]).node_names, Some(vec![]));
    // Given back with the reservation; once the plugin registers on n1, n1 takes shares.
    s.release(&reservation);
    assert_eq!(s.filter_names(Some(&pod("d", "1", None, None)), vec!["n2"]).node_names, Some(vec!["n2"]));
    s.apply_node(&node_with_ids("n1", 1, Some("100")));
    assert_eq!(s.filter_names(Some(&pod("b", "50", None, None)), vec!["n1"]).node_names, Some(vec!["n1"]));
}

/// A pod's device IDs are summed as the kubelet sums them: app containers and sidecars add up, an
/// init container counts alone (its IDs are reused by the app containers after it).
#[test]
fn a_pods_device_ids_are_summed_as_the_kubelet_sums_them() {
    let mut s = state();
    s.apply_node(&node_with_ids("n1", 2, Some("100")));
    let two = watched_pod(json!({
        "metadata": {"name": "two", "namespace": "ns", "uid": "two"},
        "spec": {"initContainers": [{"name": "init", "resources": {"limits": {"nano-gpu/gpu-percent": "90"}}}],
            "containers": [
                {"name": "x", "resources": {"limits": {"nano-gpu/gpu-percent": "40"}}},
                {"name": "y", "resources": {"limits": {"nano-gpu/gpu-percent": "50"}}}]}
    }));
    // 90 IDs (max of the init container's 90 and the app containers' 40 + 50) of 100.
    assert_eq!(s.filter_names(Some(&two), vec!["n1"]).node_names, Some(vec!["n1"]));
    let three = watched_pod(json!({
        "metadata": {"name": "three", "namespace": "ns", "uid": "three"},
        "spec": {"containers": [
                {"name": "x", "resources": {"limits": {"nano-gpu/gpu-percent": "40"}}},
                {"name": "y", "resources": {"limits": {"nano-gpu/gpu-percent": "50"}}},
                {"name": "z", "resources": {"limits": {"nano-gpu/gpu-percent": "20"}}}]}
    }));
    let r = s.filter_names(Some(&three), vec!["n1"]);
    assert_eq!(
        r.failed_and_unresolvable_nodes["n1"],
        "Insufficient nano-gpu/gpu-percent: its kubelet has 100 in all"
    );
}

/// A bound pod whose GPU request the allocator refuses (the webhook skips the system namespaces)
/// still holds the device IDs its kubelet counts for it.
#[test]
fn a_pod_with_an_invalid_gpu_request_still_holds_its_device_ids() {
    let mut s = state();
    s.apply_node(&node_with_ids("n1", 2, Some("200")));
    s.apply_pod(&watched_pod(json!({
        "metadata": {"name": "odd", "namespace": "kube-system", "uid": "odd"},
        "spec": {"nodeName": "n1", "containers": [
            {"name": "x", "resources": {"limits": {"nano-gpu/gpu-percent": "150"}}}]}
    })));
    let r = s.filter_names(Some(&pod("b", "60", None, None)), vec!["n1"]);
    assert_eq!(r.failed_nodes["n1"], "Insufficient nano-gpu/gpu-percent", "{r:?}");
    assert_eq!(s.filter_names(Some(&pod("c", "50", None, None)), vec!["n1"]).node_names, Some(vec!["n1"]));
}

fn choose(s: &mut ClusterState, p: &Pod, at: Instant) -> ExtenderFilterResult<&'static str> {
    s.choose_names(Some(p), vec!["n1", "n2", "n3"], at)
}

#[test]
fn the_choosing_filter_answers_prioritizes_best_node_alone_and_holds_its_cards() {
    let mut s = state();
    for n in ["n1", "n2", "n3"] {
        s.apply_node(&node(n, 1));
    }
    s.apply_pod(&pod("b", "60", Some("n2"), Some(assignment("n2", 0, 60))));
    s.apply_pod(&pod("c", "90", Some("n3"), Some(assignment("n3", 0, 90))));
    let a = pod("a", "30", None, None);
    s.apply_pod(&a);
    // The node prioritize gives 10 (packing onto n2's 40 % left), and nothing else: kube-scheduler
    // has no choice to make and no reasons to read.
    let scores = s.prioritize_names(Some(&a), vec!["n1", "n2", "n3"]);
    let best = scores.iter().find(|h| h.score == 10).unwrap().host;
    let t0 = Instant::now();
    let r = choose(&mut s, &a, t0);
    assert_eq!(r.node_names, Some(vec![best]));
    assert_eq!(best, "n2");
    assert!(r.failed_nodes.is_empty() && r.failed_and_unresolvable_nodes.is_empty() && r.error.is_empty());
    // Held at once: the next pod's filter, before a's bind, counts a's cards.
    assert!(s.held_by_filter("a"));
    assert_eq!(free(&s, "n2"), vec![10]);
    let d = pod("d", "20", None, None);
    assert_eq!(choose(&mut s, &d, t0).node_names, Some(vec!["n1"]));

    // The bind takes the hold as its own, fresh reservation: the same cards, given back if it fails;
    // only a bind to the chosen node does.
    assert_eq!(s.take_filter_hold("a", "n1"), None);
    let reservation = s.take_filter_hold("a", "n2").unwrap();
    assert!(reservation.fresh && !s.held_by_filter("a"));
    assert_eq!(free(&s, "n2"), vec![10]);
    s.release(&reservation);
    assert_eq!(free(&s, "n2"), vec![40]);
}

#[test]
fn a_hold_is_taken_only_for_the_request_the_watch_shows_else_the_bind_decides_anew() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let t0 = Instant::now();
    // The watch has not shown the pod yet: no hold is taken; the bind's own reservation (on the pod
    // it reads) gives the hold back and decides anew.
    let a = pod("a", "30", None, None);
    assert_eq!(choose(&mut s, &a, t0).node_names, Some(vec!["n1"]));
    assert_eq!(s.take_filter_hold("a", "n1"), None);
    assert!(s.reserve(&a, "n1", SystemTime::UNIX_EPOCH).unwrap().fresh);
    assert_eq!(free(&s, "n1"), vec![70]);
    // A filter body that asks other than the watch shows (kube-scheduler's copy is not what the API
    // server holds): the bind reserves what the API server's pod asks.
    let b = pod("b", "60", None, None);
    s.apply_pod(&b);
    assert_eq!(choose(&mut s, &pod("b", "10", None, None), t0).node_names, Some(vec!["n1"]));
    assert_eq!(free(&s, "n1"), vec![60]);
    assert_eq!(s.take_filter_hold("b", "n1"), None);
    let reservation = s.reserve(&b, "n1", SystemTime::UNIX_EPOCH).unwrap();
    assert!(reservation.fresh);
    assert_eq!(free(&s, "n1"), vec![10]);
    // An event of a held pod that changes its request is what a later take compares with.
    let c = pod("c", "5", None, None);
    s.apply_pod(&c);
    choose(&mut s, &c, t0);
    s.apply_pod(&pod("c", "6", None, None));
    assert_eq!(s.take_filter_hold("c", "n1"), None);
}

#[test]
fn a_choosing_filter_with_no_fitting_node_gives_every_reason() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_node(&node("n2", 1));
    s.apply_pod(&pod("b", "80", Some("n1"), Some(assignment("n1", 0, 80))));
    s.apply_pod(&pod("c", "80", Some("n2"), Some(assignment("n2", 0, 80))));
    let r = choose(&mut s, &pod("a", "30", None, None), Instant::now());
    assert_eq!(r.node_names, Some(vec![]));
    assert_eq!(r.failed_nodes.keys().copied().collect::<Vec<_>>(), vec!["n1", "n2"]);
    assert_eq!(r.failed_and_unresolvable_nodes.keys().copied().collect::<Vec<_>>(), vec!["n3"]);
    assert!(!s.held_by_filter("a"));
    // A pod the engine cannot read is an error, nothing held.
    let mut bad = pod("x", "30", None, None);
    bad.spec.as_mut().unwrap().containers[0].resources.as_mut().unwrap().limits.as_mut().unwrap().insert(
        "nano-gpu/gpu-percent".into(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity("abc".into()),
    );
    let r = choose(&mut s, &bad, Instant::now());
    assert!(!r.error.is_empty() && !s.held_by_filter("x"), "{r:?}");
}

#[test]
fn a_filter_hold_no_bind_takes_is_given_back_and_a_pod_filtered_again_is_held_once() {
    let mut s = state();
    for n in ["n1", "n2", "n3"] {
        s.apply_node(&node(n, 1));
    }
    let a = pod("a", "70", None, None);
    let t0 = Instant::now();
    let first = choose(&mut s, &a, t0).node_names.unwrap()[0];
    // kube-scheduler filters a again (its bind never came, or failed): the earlier hold is given
    // back before it is judged, so it is held once, and it may take the same node again.
    let again = choose(&mut s, &a, t0 + Duration::from_secs(1)).node_names.unwrap()[0];
    assert_eq!(first, again);
    let held = |s: &ClusterState| -> u32 { ["n1", "n2", "n3"].iter().map(|n| 100 - free(s, n)[0]).sum() };
    assert_eq!(held(&s), 70);

    // A stale event of the pending pod keeps the hold; past the hold, the next filter gives it back.
    s.apply_pod(&a);
    assert!(s.held_by_filter("a"));
    choose(&mut s, &pod("e", "10", None, None), t0 + Duration::from_secs(1) + FILTER_HOLD);
    assert!(!s.held_by_filter("a"));
    assert_eq!(held(&s), 10, "only e's share is held");

    // A pod deleted while held gives its cards back at once.
    let b = pod("b", "50", None, None);
    assert_eq!(choose(&mut s, &b, t0 + FILTER_HOLD * 2).passed(), 1);
    assert_eq!(held(&s), 60);
    s.delete_pod(&b);
    assert!(!s.held_by_filter("b"));
    assert_eq!(held(&s), 10);
}

#[test]
fn a_pod_bound_with_its_assignment_ends_its_hold_and_a_retried_bind_is_not_fresh() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let a = pod("a", "30", None, None);
    s.apply_pod(&a);
    let t0 = Instant::now();
    assert_eq!(choose(&mut s, &a, t0).node_names, Some(vec!["n1"]));
    let reservation = s.take_filter_hold("a", "n1").unwrap();
    let bound = pod("a", "30", Some("n1"), Some(reservation.assignment.encode()));
    s.apply_pod(&bound);
    assert!(!s.reserve(&bound, "n1", SystemTime::UNIX_EPOCH).unwrap().fresh);
    // Long after, nothing expires what the API server holds.
    choose(&mut s, &pod("e", "10", None, None), t0 + FILTER_HOLD * 3);
    assert_eq!(free(&s, "n1"), vec![60]);
}

#[test]
fn a_quiet_cluster_gives_an_expired_hold_back_without_another_filter() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let t0 = Instant::now();
    choose(&mut s, &pod("a", "40", None, None), t0);
    s.expire_filter_holds(t0 + FILTER_HOLD - Duration::from_millis(1));
    assert_eq!(free(&s, "n1"), vec![60]);
    s.expire_filter_holds(t0 + FILTER_HOLD);
    assert_eq!(free(&s, "n1"), vec![100]);
    assert!(!s.held_by_filter("a"));
}

/// A pod of `priority` asking `percent` of a card, bound to `node` with `assignment` if given.
fn pod_of_priority(uid: &str, percent: &str, priority: i32, placed: Option<(&str, u32)>) -> Pod {
    let mut p = match placed {
        Some((node, card)) => {
            pod(uid, percent, Some(node), Some(assignment(node, card, percent.parse().unwrap())))
        }
        None => pod(uid, percent, None, None),
    };
    p.spec.as_mut().unwrap().priority = Some(priority);
    p
}

/// kube-scheduler's preemption tries victims with its own filters, which pass a node whose free
/// percent is spread over cards: nano-gpu preempts for such a share itself, the fewest pods of the
/// lowest priorities, holds the node for it until they are gone, and then places it there.
#[test]
fn a_share_no_card_has_room_for_preempts_pods_of_lower_priority_and_holds_the_node() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_node(&node("n2", 2));
    // n1: 40 % free on each card, held by pods of priority 0; ending l1 alone frees card 0.
    s.apply_pod(&pod_of_priority("l1", "60", 0, Some(("n1", 0))));
    s.apply_pod(&pod_of_priority("l2", "30", 0, Some(("n1", 1))));
    s.apply_pod(&pod_of_priority("l3", "30", 0, Some(("n1", 1))));
    // n2: a pod above the preemptor's priority, and one of 500 whose end would do.
    s.apply_pod(&pod_of_priority("top", "60", 2000, Some(("n2", 0))));
    s.apply_pod(&pod_of_priority("mid", "60", 500, Some(("n2", 1))));
    let high = pod_of_priority("high", "80", 1000, None);
    s.apply_pod(&high);
    let t0 = Instant::now();
    // `why` only looks: it names the pods whose end would make room, and preempts no one.
    let why = s.why(&high).unwrap();
    let n1 = why.iter().find(|v| v.node == "n1").unwrap();
    assert_eq!((n1.fits, n1.freed_by.clone()), (false, vec!["ns/l1".to_owned()]));
    assert!(s.take_preemptions().is_empty() && !s.nominated("high"));

    let r = s.choose_names(Some(&high), vec!["n1", "n2"], t0);
    assert_eq!(r.node_names, Some(vec![]));
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/l1");
    let p = s.take_preemptions();
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!((p[0].node.as_str(), p[0].needs, p[0].priority), ("n1", Needs::Share, 1000));
    assert_eq!(p[0].victims.iter().map(|v| v.uid.as_str()).collect::<Vec<_>>(), ["l1"]);
    // kube-scheduler's own preemption, which follows the filter, gets no node to add victims on.
    let victims = MetaVictims {
        pods: vec![nano_gpu_proto::extender::MetaPod { uid: "mid".into() }],
        num_pdb_violations: 0,
    };
    let proposed = BTreeMap::from([("n2".to_owned(), victims)]);
    assert_eq!(s.preempt(&high, &proposed).unwrap(), BTreeMap::new());
    // `why` still names them, and adds no preemption.
    let why = s.why(&high).unwrap();
    assert_eq!(why.iter().find(|v| v.node == "n1").unwrap().freed_by, ["ns/l1"]);
    assert!(s.take_preemptions().is_empty());

    // Held for it: a pod of lower priority that would fit on n1's card 1 goes elsewhere.
    let low = pod_of_priority("low", "30", 0, None);
    let r = s.choose_names(Some(&low), vec!["n1", "n2"], t0);
    assert_eq!(r.node_names, Some(vec!["n2"]));
    let r = s.choose_names(Some(&low), vec!["n1"], t0);
    assert_eq!(r.node_names, Some(vec![]));
    assert!(r.failed_nodes["n1"].starts_with("held for pod ns/high (priority 1000)"), "{:?}", r.failed_nodes);
    s.expire_filter_holds(t0 + FILTER_HOLD);
    // Another pod of the same priority does not search the held node: it preempts on n2.
    let other = pod_of_priority("other", "80", 1000, None);
    let r = s.choose_names(Some(&other), vec!["n1", "n2"], t0);
    assert!(r.failed_nodes["n1"].starts_with("held for pod ns/high"), "{:?}", r.failed_nodes);
    assert_eq!(r.failed_nodes["n2"], "preempting pods of lower priority on n2 to make room: ns/mid");
    assert_eq!(s.take_preemptions()[0].victims[0].uid, "mid");
    s.delete_pod(&other);

    // Filtered again while l1 ends: it waits, and preempts no one more.
    let mut ending = pod_of_priority("l1", "60", 0, Some(("n1", 0)));
    ending.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2026-01-01T00:00:00Z".parse().unwrap()));
    s.apply_pod(&ending);
    let r = s.choose_names(Some(&high), vec!["n1", "n2"], t0);
    assert_eq!(r.node_names, Some(vec![]));
    assert!(
        r.failed_nodes["n1"].contains("were preempted for it: waiting for them to end"),
        "{:?}",
        r.failed_nodes
    );
    assert_eq!(s.take_preemptions(), vec![]);

    // Gone: kube-scheduler's own preemption is answered again (n2 is held for no one now), and
    // the pod is placed on the card l1 held, and n1 is held for no one any more.
    s.delete_pod(&ending);
    let proposed = BTreeMap::from([(
        "n2".to_owned(),
        MetaVictims {
            pods: vec![nano_gpu_proto::extender::MetaPod { uid: "top".into() }],
            num_pdb_violations: 0,
        },
    )]);
    assert_eq!(s.preempt(&high, &proposed).unwrap().len(), 1, "no answer once its victims are gone");
    let r = s.choose_names(Some(&high), vec!["n1", "n2"], t0);
    assert_eq!(r.node_names, Some(vec!["n1"]));
    assert!(!s.nominated("high"));
    assert_eq!(s.choose_names(Some(&low), vec!["n1"], t0).node_names, Some(vec!["n1"]));

    // The counts that spare the search where no pod could end follow every pod in and out.
    assert!(s.could_preempt(1) && !s.could_preempt(0));
    s.expire_filter_holds(t0 + FILTER_HOLD);
    for (uid, percent, priority, card) in [("l2", "30", 0, 1), ("l3", "30", 0, 1), ("mid", "60", 500, 1)] {
        s.delete_pod(&pod_of_priority(
            uid,
            percent,
            priority,
            Some((if uid == "mid" { "n2" } else { "n1" }, card)),
        ));
    }
    assert!(s.could_preempt(2001) && !s.could_preempt(2000), "only top (2000) is left");
    s.delete_pod(&pod_of_priority("top", "60", 2000, Some(("n2", 0))));
    assert!(!s.could_preempt(i32::MAX) && s.pods.is_empty());
}

/// Node n1 of two cards, each 60 % taken by a share of priority 0, and pod `high` (priority 1000,
/// 80 %) refused there at `t0`: it preempts one share. Returns `high` and that share as the watch
/// shows it deleted.
fn high_preempts_on_n1(s: &mut ClusterState, t0: Instant) -> (Pod, Pod) {
    s.apply_node(&node("n1", 2));
    s.apply_pod(&pod_of_priority("l1", "60", 0, Some(("n1", 0))));
    s.apply_pod(&pod_of_priority("l2", "60", 0, Some(("n1", 1))));
    let high = pod_of_priority("high", "80", 1000, None);
    s.apply_pod(&high);
    assert_eq!(s.choose_names(Some(&high), vec!["n1"], t0).node_names, Some(vec![]));
    let planned = s.take_preemptions();
    assert_eq!(planned.len(), 1);
    let gone = planned[0].victims[0].uid.clone();
    let card = if gone == "l1" { 0 } else { 1 };
    let victim = pod_of_priority(&gone, "60", 0, Some(("n1", card)));
    (high, victim)
}

/// kube-scheduler writes the waiting pod's status after each try (its `PodScheduled` condition):
/// the watch's update of a pending pod without claims does not end its nomination, so a pod of
/// its priority that may not preempt does not take the card its victims free.
#[test]
fn a_preemptors_status_update_keeps_its_node_held_until_it_is_placed() {
    let mut s = state();
    let mut never = pod_of_priority("never", "80", 1000, None);
    never.spec.as_mut().unwrap().preemption_policy = Some("Never".into());
    s.apply_pod(&never);
    let t0 = Instant::now();
    let (high, victim) = high_preempts_on_n1(&mut s, t0);
    let mut tried = high.clone();
    tried.status = Some(
        serde_json::from_value(json!({"conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable"}]}))
        .unwrap(),
    );
    s.apply_pod(&tried);
    assert!(s.nominated("high"));
    // The victim is gone: the pod that may not preempt, tried first, finds the node held.
    s.delete_pod(&victim);
    let r = s.choose_names(Some(&never), vec!["n1"], t0);
    assert_eq!(r.node_names, Some(vec![]), "{r:?}");
    assert!(r.failed_nodes["n1"].starts_with("held for pod ns/high"), "{:?}", r.failed_nodes);
    assert_eq!(s.choose_names(Some(&tried), vec!["n1"], t0).node_names, Some(vec!["n1"]));
}

/// A preemptor that kube-scheduler stops sending to the extender (its own filters refuse every node
/// now, say) holds its node only until the nomination's limit: then other pods may take the room.
#[test]
fn a_nomination_holds_its_node_no_longer_than_its_limit() {
    let mut s = state();
    let t0 = Instant::now();
    let (_, victim) = high_preempts_on_n1(&mut s, t0);
    s.delete_pod(&victim);
    let other = pod_of_priority("other", "80", 0, None);
    s.apply_pod(&other);
    s.expire_filter_holds(t0 + preemption::NOMINATION_LIMIT - Duration::from_secs(1));
    let r = s.choose_names(Some(&other), vec!["n1"], t0);
    assert!(r.failed_nodes["n1"].starts_with("held for pod ns/high"), "{:?}", r.failed_nodes);
    s.expire_filter_holds(Instant::now() + preemption::NOMINATION_LIMIT);
    assert!(!s.nominated("high"));
    assert_eq!(s.choose_names(Some(&other), vec!["n1"], Instant::now()).node_names, Some(vec!["n1"]));
}

#[test]
fn a_share_preempts_no_one_of_its_priority_or_above_nor_with_preemption_policy_never() {
    let mut s = state();
    s.apply_node(&node("n1", 2));
    s.apply_pod(&pod_of_priority("a", "60", 1000, Some(("n1", 0))));
    s.apply_pod(&pod_of_priority("b", "60", 0, Some(("n1", 1))));
    let t0 = Instant::now();
    // Ending b (priority 0) frees card 1: but not for a pod that may not preempt, nor for one of
    // b's own priority.
    let mut never = pod_of_priority("never", "80", 1000, None);
    never.spec.as_mut().unwrap().preemption_policy = Some("Never".into());
    let r = s.choose_names(Some(&never), vec!["n1"], t0);
    assert_eq!(r.node_names, Some(vec![]));
    assert!(!r.failed_nodes["n1"].contains("preempting"), "{:?}", r.failed_nodes);
    let equal = pod_of_priority("equal", "80", 0, None);
    let r = s.choose_names(Some(&equal), vec!["n1"], t0);
    assert!(!r.failed_nodes["n1"].contains("preempting"), "{:?}", r.failed_nodes);
    assert_eq!(s.take_preemptions(), vec![]);
    assert!(!s.nominated("never") && !s.nominated("equal"));
    // The same pod allowed to preempt: b goes, not a.
    let may = pod_of_priority("may", "80", 1000, None);
    let r = s.choose_names(Some(&may), vec!["n1"], t0);
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/b");
}

/// A replica that stopped leading before it evicted the victims drops the nomination: kept, it would
/// hold the node for victims no one evicts, and the pod would never search again.
#[test]
fn a_preemption_not_carried_out_ends_its_nomination_and_the_pod_searches_again() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    s.apply_pod(&pod_of_priority("low", "60", 0, Some(("n1", 0))));
    let high = pod_of_priority("high", "80", 1000, None);
    let t0 = Instant::now();
    s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(s.take_preemptions().len(), 1);
    assert!(s.nominated("high"));
    // Asked again, unchanged: it waits for its victims and decides nothing more.
    s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(s.take_preemptions(), vec![]);
    s.preemption_dropped("high", "elsewhere");
    assert!(s.nominated("high"), "a preemption for another node drops nothing");
    s.preemption_dropped("high", "n1");
    assert!(!s.nominated("high"));
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/low");
    assert_eq!(s.take_preemptions().len(), 1);
}

/// A pod whose cards a filter holds (or a bind reserved) is not bound yet, or not seen bound:
/// evicting it would delete a pending pod. It is never a victim.
#[test]
fn a_pod_not_yet_bound_is_never_a_victim() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let t0 = Instant::now();
    let low = pod_of_priority("low", "60", 0, None);
    s.apply_pod(&low);
    assert_eq!(s.choose_names(Some(&low), vec!["n1"], t0).node_names, Some(vec!["n1"]));
    let high = pod_of_priority("high", "80", 1000, None);
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert!(!r.failed_nodes["n1"].contains("preempting"), "{:?}", r.failed_nodes);
    assert!(s.take_preemptions().is_empty() && !s.nominated("high"));
    // Bound (the watch shows it with its assignment), it may go.
    s.apply_pod(&pod_of_priority("low", "60", 0, Some(("n1", 0))));
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/low");
}

/// The watch showing a bind's pod with the assignment the bind wrote changes no node (it was rebuilt
/// when the bind reserved): the view's generation moves once, for the pod that no longer waits,
/// and not for a rebuild of its node. The pod has become a victim
/// preemption may end, which a search made while it was reserved did not see: it is searched again.
#[test]
fn a_binds_pod_seen_annotated_rebuilds_nothing_and_may_then_be_preempted() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let t0 = Instant::now();
    let low = pod_of_priority("low", "60", 0, None);
    s.apply_pod(&low);
    let reservation = s.reserve(&low, "n1", SystemTime::UNIX_EPOCH).unwrap();
    let high = pod_of_priority("high", "80", 1000, None);
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert!(!r.failed_nodes["n1"].contains("preempting"), "{:?}", r.failed_nodes);
    let generation = s.generation();
    let mut bound = low.clone();
    bound.spec.as_mut().unwrap().node_name = Some("n1".into());
    bound.metadata.annotations = Some(reservation.annotations.clone());
    s.apply_pod(&bound);
    assert_eq!(s.generation(), generation + 1, "no node rebuilt");
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/low");
}

/// For a share, only pods holding cards are victims: kube-scheduler passed the node with every pod
/// on it, so a CPU-only pod's end is never what the share waits for (and a node's pods are mostly
/// CPU-only ones, each a fit to try).
#[test]
fn a_share_never_preempts_a_pod_that_holds_no_card() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let hog = watched_pod(json!({
        "metadata": {"name": "hog", "namespace": "ns", "uid": "hog"},
        "spec": {"nodeName": "n1", "priority": 0, "containers": [{"name": "c", "resources": {"requests": {"cpu": "15"}}}]}
    }));
    s.apply_pod(&hog);
    s.apply_pod(&pod_of_priority("g", "60", 0, Some(("n1", 0))));
    let t0 = Instant::now();
    // Two CPUs and 80 %: ending g frees the card and one CPU; only ending hog too would do.
    let mut high = pod_of_priority("high", "80", 1000, None);
    high.spec.as_mut().unwrap().containers[0]
        .resources
        .as_mut()
        .unwrap()
        .limits
        .as_mut()
        .unwrap()
        .insert("cpu".into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("2".into()));
    let r = s.choose_names(Some(&high), vec!["n1"], t0);
    assert_eq!(r.node_names, Some(vec![]));
    assert!(!r.failed_nodes.get("n1").is_some_and(|w| w.contains("preempting")), "{r:?}");
    assert!(s.take_preemptions().is_empty() && !s.nominated("high"));
    // One CPU: ending g alone makes room.
    let one = pod_of_priority("one-cpu", "80", 1000, None);
    let r = s.choose_names(Some(&one), vec!["n1"], t0);
    assert_eq!(r.failed_nodes["n1"], "preempting pods of lower priority on n1 to make room: ns/g");
}

/// Of 150 nodes where preemption works, the search weighs 100 (kube-scheduler's
/// `minCandidateNodesAbsolute`), from the pod's own offset: every node's victim is alike, so the
/// whole cluster's best would be the first name, `n000`, and the window's best is its first node.
#[test]
fn a_preemption_search_weighs_a_hundred_of_150_candidates_from_the_pods_offset() {
    let mut s = state();
    let names: Vec<String> = (0..150).map(|i| format!("n{i:03}")).collect();
    for (i, n) in names.iter().enumerate() {
        s.apply_node(&node(n, 1));
        s.apply_pod(&pod_of_priority(&format!("low-{i}"), "60", 0, Some((n, 0))));
    }
    // A pod whose window (offset .. offset + 99) neither starts at n000 nor wraps around to it.
    let uid = (0..)
        .map(|i| format!("high-{i}"))
        .find(|u| (1..=50).contains(&preemption::offset(u, names.len())))
        .unwrap();
    let start = preemption::offset(&uid, names.len());
    let high = pod_of_priority(&uid, "80", 1000, None);
    s.apply_pod(&high);
    let r = s.choose_names(Some(&high), names.iter().map(String::as_str).collect(), Instant::now());
    assert_eq!(r.node_names, Some(vec![]), "{r:?}");
    let planned = s.take_preemptions();
    assert_eq!(planned.len(), 1);
    assert_eq!(planned[0].node, names[start], "offset {start}");
    assert_eq!(planned[0].victims.len(), 1);
    assert!(r.failed_nodes[names[start].as_str()].starts_with("preempting pods of lower priority"), "{r:?}");
}

/// A pending pod whose GPU request cannot be read (here a model list made too long after the
/// webhook admitted it) is not kept and gets one warning, however often the watch shows it again.
#[test]
fn a_pending_pod_whose_request_cannot_be_read_is_warned_of_once_and_not_kept() {
    let mut s = state();
    s.apply_node(&node("n1", 1));
    let mut p = pod("p", "30", None, None);
    p.metadata.annotations = Some([("nano-gpu/gpu-model".to_owned(), "a|".repeat(100_000))].into());
    s.apply_pod(&p);
    let w = s.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].name.as_str(), w[0].reason), ("p", Reason::InvalidGpuRequest));
    assert!(w[0].message.contains("at most 1024") && w[0].message.contains("no card"), "{}", w[0].message);
    assert!(s.waiting.is_empty(), "a pod over the limits is kept");
    s.apply_pod(&p);
    assert!(s.take_warnings().is_empty());
    // Fixed, it waits; made invalid again, it is warned of again.
    let fixed = pod("p", "30", None, None);
    s.apply_pod(&fixed);
    assert!(s.waiting.contains_key("p") && s.take_warnings().is_empty());
    s.apply_pod(&p);
    assert_eq!(s.take_warnings().len(), 1);
    // A pod that asks nothing of nano-gpu is none of its business, even one whose request cannot
    // be read either.
    let cpu = watched_pod(json!({"metadata": {"name": "cpu", "namespace": "ns", "uid": "cpu"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": "1x"}}}]}}));
    assert!(nano_gpu_proto::demand::pod_demand(&cpu, &DemandOptions::default()).is_err());
    s.apply_pod(&cpu);
    assert!(s.take_warnings().is_empty());
}
