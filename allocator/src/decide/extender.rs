//! The scheduler-extender decisions, pure: filter, prioritize and the card choice of bind, on top of
//! the engine. The HTTP service decodes a request, calls these, and encodes the answer; `simulate
//! --through-extender` calls them with exactly what kube-scheduler would send.
//!
//! - `filter` judges every candidate node on its own (kube-scheduler may send a single nominated or
//!   hinted node): fits, or a reason; reasons no eviction could fix go to `FailedAndUnresolvableNodes`
//!   (kube-scheduler gets every refused node there: [`unresolvable_for_scheduler`]).
//! - `prioritize` gives 0..=10. kube-scheduler breaks ties among equal totals at random, which would
//!   throw away the policy's own tie rule, so the node the engine would choose gets 10 alone; the others
//!   are spread over 0..=9 by the policy's score.
//! - `bind` picks the cards on the chosen node with the same evaluation and returns the assignment.
//!
//! `simulate --through-extender` drives these decisions as kube-scheduler would (`sim/extender.rs`).

use k8s_openapi::api::core::v1::Pod;
use nano_gpu_engine::engine::{Decision, Engine, NodeOrder, Prepared, Unschedulable};
use nano_gpu_engine::model::Grant;
use nano_gpu_engine::model::{ModelId, Models, NodeId};
use nano_gpu_engine::request::{Reason, Request, SlotDemand};
use nano_gpu_proto::annotations::{Assignment, CardGrant};
use nano_gpu_proto::demand::{CardDemand, DemandOptions, PodDemand, pod_demand};
use nano_gpu_proto::extender::{
    ExtenderArgs, ExtenderFilterResult, HostPriority, HostPriorityList, MAX_PRIORITY, MIN_PRIORITY,
    for_scheduler,
};
use std::collections::BTreeMap;
use thiserror::Error;

/// Why a bind cannot go ahead.
#[derive(Debug, Error, PartialEq)]
pub enum BindError {
    /// The pod's request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The node is not known to nano-gpu.
    #[error("node {0} has no nano-gpu inventory")]
    UnknownNode(String),
    /// The pod no longer fits on the node.
    #[error("pod no longer fits on node {node}: {reason}")]
    NoLongerFits {
        /// Node name.
        node: String,
        /// Why.
        reason: String,
    },
}

/// Extender decisions over one engine.
pub struct Extender {
    engine: Engine,
    salt: u64,
    order: NodeOrder,
    demand: DemandOptions,
}

impl Extender {
    /// Decisions over `engine`, with ties ordered by a hash of node names salted with `salt`.
    pub fn new(engine: Engine, salt: u64, demand: DemandOptions) -> Self {
        let order = NodeOrder::hashed(engine.cluster().nodes().iter().map(|n| n.name.as_str()), salt);
        Extender { engine, salt, order, demand }
    }

    /// How pods are read (gpushare compatibility).
    pub fn demand_options(&self) -> &DemandOptions {
        &self.demand
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, for cluster changes from watches.
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    fn refresh_order(&mut self) {
        if self.order.0.len() != self.engine.cluster().nodes().len() {
            let names = self.engine.cluster().nodes().iter().map(|n| n.name.as_str());
            self.order = NodeOrder::hashed(names, self.salt);
        }
    }

    /// The request of a pod, or the message that rejects it.
    pub fn request(&self, pod: &Pod) -> Result<(PodDemand, Request), String> {
        let demand = pod_demand(pod, &self.demand).map_err(|e| e.to_string())?;
        let req = engine_request(&demand, &self.engine.cluster().models);
        Ok((demand, req))
    }

    /// `POST /filter`. Takes the arguments by value: the candidate names move into the answer.
    pub fn filter(&mut self, mut args: ExtenderArgs) -> ExtenderFilterResult {
        let by_name = args.node_names.is_some();
        let names = args.take_candidate_names();
        let result = self.filter_names(args.pod.as_ref(), names);
        with_nodes(by_name, &args, result)
    }

    /// The filter decision for candidate `names` (owned or borrowed from the request), which move
    /// into the answer.
    pub fn filter_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> ExtenderFilterResult<N> {
        let (mut result, req) = self.filter_request(pod);
        let Some(req) = req else { return result };
        let mut passed = Vec::with_capacity(names.len());
        self.judge(&req, names, |name, judged| match judged {
            Ok(()) => passed.push(name),
            Err(reason) => refuse(&mut result, name, reason),
        });
        result.node_names = Some(passed);
        result
    }

    /// Each of `names` judged for `req` as the filter judges it, handed to `each`: fits (`Ok`), has
    /// no nano-gpu inventory (`Err(None)`, [`NO_INVENTORY`]), or does not fit for a reason.
    pub fn judge<N: AsRef<str>>(
        &mut self,
        req: &Request,
        names: impl IntoIterator<Item = N>,
        mut each: impl FnMut(N, Result<(), Option<&Reason>>),
    ) {
        let prepared = self.engine.prepare(req);
        for name in names {
            let Some(id) = self.engine.cluster().id(name.as_ref()) else {
                each(name, Err(None));
                continue;
            };
            each(name, self.engine.evaluate_prepared(prepared, req, id).as_ref().map(|_| ()).map_err(Some));
        }
    }

    /// An empty filter answer and the pod's request; without a request, the answer says why the pod
    /// cannot be judged.
    fn filter_request<N: Ord>(&self, pod: Option<&Pod>) -> (ExtenderFilterResult<N>, Option<Request>) {
        let mut result = ExtenderFilterResult {
            nodes: None,
            node_names: Some(Vec::new()),
            failed_nodes: BTreeMap::new(),
            failed_and_unresolvable_nodes: BTreeMap::new(),
            error: String::new(),
        };
        let req = match pod.map(|p| self.request(p)) {
            Some(Ok((_, req))) => Some(req),
            Some(Err(message)) => {
                result.error = message;
                None
            }
            None => {
                result.error = "request has no Pod".to_owned();
                None
            }
        };
        (result, req)
    }

    /// `POST /prioritize`: 10 for the node the engine would choose, 0..=9 for the others.
    pub fn prioritize(&mut self, mut args: ExtenderArgs) -> HostPriorityList {
        let names = args.take_candidate_names();
        self.prioritize_names(args.pod.as_ref(), names)
    }

    /// The scores of candidate `names` (owned or borrowed from the request).
    pub fn prioritize_names<N: AsRef<str>>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> HostPriorityList<N> {
        self.refresh_order();
        let Some(Ok((_, req))) = pod.map(|p| self.request(p)) else {
            return names.into_iter().map(|host| HostPriority { host, score: MIN_PRIORITY }).collect();
        };
        let mut scored: Vec<(N, Option<Value>)> = Vec::with_capacity(names.len());
        let prepared = self.engine.prepare(&req);
        for name in names {
            let value = self
                .engine
                .cluster()
                .id(name.as_ref())
                .and_then(|id| self.value(prepared, &req, id, false).ok());
            scored.push((name, value));
        }
        let best = scored
            .iter()
            .enumerate()
            .filter_map(|(i, (_, v))| v.map(|v| (i, v)))
            .max_by(|(_, a), (_, b)| rank(a, b))
            .map(|(i, _)| i);
        let (lo, hi) = scored
            .iter()
            .filter_map(|(_, v)| v.map(|v| v.0))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| (lo.min(s), hi.max(s)));
        scored
            .into_iter()
            .enumerate()
            .map(|(i, (host, v))| {
                let score = match v {
                    _ if Some(i) == best => MAX_PRIORITY,
                    None => MIN_PRIORITY,
                    Some(_) if hi <= lo => MAX_PRIORITY - 1,
                    Some((s, ..)) => (((s - lo) / (hi - lo)) * (MAX_PRIORITY - 1) as f64).floor() as i64,
                };
                HostPriority { host, score: score.clamp(MIN_PRIORITY, MAX_PRIORITY) }
            })
            .collect()
    }

    /// `POST /filter` when the filter chooses ([`crate::state::ClusterState::choose_names`]): the one
    /// node prioritize would give 10, alone, or (none fits) every node with its reason, as `filter`
    /// answers them. With one feasible node kube-scheduler skips scoring and prioritize and binds it.
    pub fn choose_names<N: AsRef<str> + Ord>(
        &mut self,
        pod: Option<&Pod>,
        names: Vec<N>,
    ) -> ExtenderFilterResult<N> {
        let (mut result, req) = self.filter_request(pod);
        let Some(req) = req else { return result };
        self.refresh_order();
        let prepared = self.engine.prepare(&req);
        let mut best: Option<(N, Value)> = None;
        for name in names {
            // Reasons matter only while nothing fits: kube-scheduler reads them then.
            let Some(id) = self.engine.cluster().id(name.as_ref()) else {
                if best.is_none() {
                    refuse(&mut result, name, None);
                }
                continue;
            };
            match self.value(prepared, &req, id, best.is_none()) {
                Ok(v) if best.as_ref().is_none_or(|(_, b)| rank(&v, b).is_gt()) => best = Some((name, v)),
                Ok(_) | Err(None) => {}
                Err(Some(reason)) => refuse(&mut result, name, Some(&reason)),
            }
        }
        if let Some((name, _)) = best {
            result.failed_nodes.clear();
            result.failed_and_unresolvable_nodes.clear();
            result.node_names = Some(vec![name]);
        }
        result
    }

    /// How the policy values `req` on node `id`, if it fits; else why not, if `why`.
    fn value(
        &mut self,
        prepared: Prepared,
        req: &Request,
        id: NodeId,
        why: bool,
    ) -> Result<Value, Option<Reason>> {
        let reading = self.engine.load().is_some();
        let rank = self.order.rank(id);
        let (score, tiebreak, grants) = match self.engine.evaluate_prepared(prepared, req, id) {
            Ok(eval) => (eval.score, eval.tiebreak, reading.then(|| eval.grants.clone())),
            Err(reason) => return Err(why.then(|| reason.clone())),
        };
        let busy = grants.and_then(|g| self.engine.busy(id, &g));
        Ok((score, tiebreak, busy, rank))
    }

    /// The policy's choice among `candidates` for `req` (the claims of a pod, which nano-gpu places
    /// itself before kube-scheduler sees the pod): the node and its grants; nothing is taken.
    pub fn place(&mut self, req: &Request, candidates: &[NodeId]) -> Result<Decision, Unschedulable> {
        self.refresh_order();
        // Ties go to the node order (the salted hash): the uniform tie rule's randomness would make
        // two replicas choose differently for nothing.
        let mut rng = nano_gpu_engine::rng::Rng::new(self.salt);
        let mut decision = self.engine.decide(req, Some(candidates), &self.order, &mut rng)?;
        if let Some(load) = self.engine.load() {
            load.prefer_idle(self.engine.cluster().node(decision.node), &mut decision.eval.grants);
        }
        Ok(decision)
    }

    /// The card choice of `POST /bind`: takes the cards on `node` and returns what was taken and the
    /// assignment to write. The caller writes it and binds; on failure it releases what `Bound` took.
    pub fn bind(&mut self, pod: &Pod, node: &str, at: &str) -> Result<Bound, BindError> {
        let (demand, req) = self.request(pod).map_err(BindError::Invalid)?;
        let id = self.engine.cluster().id(node).ok_or_else(|| BindError::UnknownNode(node.to_owned()))?;
        let no_longer = |reason: String| BindError::NoLongerFits { node: node.to_owned(), reason };
        let mut grants = match self.engine.evaluate(&req, id) {
            Ok(eval) => eval.grants.clone(),
            Err(reason) => return Err(no_longer(reason.to_string())),
        };
        // Among cards the policy cannot tell apart, the less busy (with a fresh load reading).
        if let Some(load) = self.engine.load() {
            load.prefer_idle(self.engine.cluster().node(id), &mut grants);
        }
        self.engine.commit(&req, id, &grants).map_err(|e| no_longer(e.to_string()))?;
        let cards = &self.engine.cluster().node(id).cards;
        let mut containers = BTreeMap::new();
        let mut reuse = Vec::new();
        for (i, slot) in demand.slots.iter().enumerate() {
            let asked_memory = matches!(
                req.slots[i],
                SlotDemand::Share { mem: Some(_), .. } | SlotDemand::Whole { mem: Some(_), .. }
            );
            let list: Vec<CardGrant> = grants
                .iter()
                .filter(|g| g.slot == i)
                .map(|g| CardGrant {
                    uuid: cards[g.card].uuid.clone(),
                    index: cards[g.card].index,
                    percent: g.percent,
                    memory_mib: asked_memory.then_some(g.mem),
                })
                .collect();
            for name in &slot.containers {
                containers.insert(name.clone(), list.clone());
            }
            // The first container of a slot holds its cards; the init containers after it reuse them.
            reuse.extend(slot.containers.iter().skip(1).cloned());
        }
        let mut assignment = Assignment::new(node, at, containers);
        assignment.reuse = reuse;
        Ok(Bound { node: id, assignment, req, grants })
    }
}

/// Records in a filter answer why node `name` does not fit: no nano-gpu inventory (`None`), or
/// `reason`, under `FailedAndUnresolvableNodes` where no pod's end could help.
fn refuse<N: Ord>(result: &mut ExtenderFilterResult<N>, name: N, reason: Option<&Reason>) {
    match reason {
        None => result.failed_and_unresolvable_nodes.insert(name, NO_INVENTORY.to_owned()),
        Some(r) if r.unresolvable() => {
            result.failed_and_unresolvable_nodes.insert(name, for_scheduler(&r.to_string()))
        }
        Some(r) => result.failed_nodes.insert(name, for_scheduler(&r.to_string())),
    };
}

/// The filter's answer as kube-scheduler gets it: every refused node is unresolvable.
/// kube-scheduler's preemption looks for victims with its own filter plugins only
/// (`SelectVictimsOnNode`), and every node it sent here passed them: on a node the extender refused,
/// whatever the reason, its dry run spares every pod and finds no victim. Left resolvable, each such
/// node still costs that dry run a copy of the node and its pods at every attempt of a pod that
/// fits nowhere. (Only where kube-scheduler counts `nano-gpu/gpu-percent` itself, as with
/// `deploy/default-scheduler/`, does its `NodeResourcesFit` refuse nodes whose total is taken, and
/// its preemption there is its own: such a node never reaches the extender.)
pub fn unresolvable_for_scheduler<N: Ord>(mut result: ExtenderFilterResult<N>) -> ExtenderFilterResult<N> {
    let resolvable = std::mem::take(&mut result.failed_nodes);
    result.failed_and_unresolvable_nodes.extend(resolvable);
    result
}

/// A filter's answer to a kube-scheduler that sent whole `Nodes` (not `nodeCacheCapable`): the
/// nodes that passed, as it sent them, beside their names.
pub fn with_nodes(
    by_name: bool,
    args: &ExtenderArgs,
    mut result: ExtenderFilterResult,
) -> ExtenderFilterResult {
    if let (false, Some(list), Some(passed)) = (by_name, &args.nodes, &result.node_names) {
        let mut nodes = list.clone();
        nodes.items.retain(|n| n.metadata.name.as_ref().is_some_and(|n| passed.contains(n)));
        result.nodes = Some(nodes);
    }
    result
}

/// How the policy values a node that fits a request: its score, tie-break, the load of the cards it
/// would take (with `--prometheus-url`), and its rank in the node order.
type Value = (f64, [f64; 2], Option<f64>, u32);

/// Orders two [`Value`]s as `Engine::decide` orders nodes: the greater is the better choice.
fn rank(a: &Value, b: &Value) -> std::cmp::Ordering {
    let tie = |x: &[f64; 2], y: &[f64; 2]| x[0].total_cmp(&y[0]).then(x[1].total_cmp(&y[1]));
    let idle = match (a.2, b.2) {
        (Some(x), Some(y)) => y.total_cmp(&x),
        _ => std::cmp::Ordering::Equal,
    };
    a.0.total_cmp(&b.0).then(tie(&a.1, &b.1)).then(idle).then(b.3.cmp(&a.3))
}

/// The filter's reason for a node no agent published cards for.
pub const NO_INVENTORY: &str = "node has no nano-gpu inventory";

/// The engine's request for a pod's demand; model names unknown to `models` match nothing.
pub fn engine_request(d: &PodDemand, models: &Models) -> Request {
    let slots = d
        .slots
        .iter()
        .map(|s| match s.demand {
            CardDemand::Share { percent, memory } => SlotDemand::Share { percent, mem: memory },
            CardDemand::Whole { cards, memory } => SlotDemand::Whole { cards, mem: memory },
        })
        .collect();
    let allowed = (!d.models.is_empty()).then(|| {
        let mut ids: Vec<ModelId> = d.models.iter().filter_map(|m| models.get(m)).collect();
        ids.sort();
        ids.dedup();
        ids
    });
    Request { models: allowed, ..Request::new(d.cpu.0, d.memory.0, slots) }.asking_ids(d.ids)
}

/// What a bind took.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    /// The node.
    pub node: NodeId,
    /// The pod's request.
    pub req: Request,
    /// The cards taken.
    pub grants: Vec<Grant>,
    /// The annotation to write.
    pub assignment: Assignment,
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_engine::model::{Card, Cluster, Node};
    use nano_gpu_engine::policy;
    use nano_gpu_engine::rng::Rng;
    use nano_gpu_engine::workload::Workload;
    use nano_gpu_proto::units::{MiB, Percent};
    use serde_json::json;

    fn extender() -> Extender {
        let mut c = Cluster::new();
        let t4 = c.models.intern("T4");
        let a100 = c.models.intern("NVIDIA A100-SXM4-80GB");
        for i in 0..3 {
            let cards = (0..2).map(|g| Card::new(format!("GPU-t{i}{g}"), g, t4, MiB(15_360))).collect();
            c.add_node(Node::new(format!("t4-{i}"), 16_000, 65_536, cards)).unwrap();
        }
        c.add_node(Node::new("a100", 64_000, 262_144, vec![Card::new("GPU-a", 0, a100, MiB(81_920))]))
            .unwrap();
        c.add_node(Node::new("cpu", 64_000, 262_144, vec![])).unwrap();
        Extender::new(
            Engine::new(c, policy::by_name("fgd", 0).unwrap(), Workload::default()),
            7,
            DemandOptions::default(),
        )
    }

    fn args(percent: &str, annotations: serde_json::Value, nodes: &[&str]) -> ExtenderArgs {
        serde_json::from_value(json!({
            "Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": annotations},
                    "spec": {"containers": [{"name": "train", "resources": {"limits": {"nano-gpu/gpu-percent": percent, "cpu": "1"}}}]}},
            "NodeNames": nodes,
        }))
        .unwrap()
    }

    const ALL: [&str; 6] = ["t4-0", "t4-1", "t4-2", "a100", "cpu", "ghost"];

    #[test]
    fn filter_separates_unresolvable_nodes_and_keeps_the_input_subset() {
        let mut e = extender();
        let r = e.filter(args("200", json!({}), &ALL));
        assert_eq!(r.node_names, Some(vec!["t4-0".to_string(), "t4-1".to_string(), "t4-2".to_string()]));
        assert_eq!(
            r.failed_and_unresolvable_nodes["a100"],
            "larger than any card: 2 whole cards asked, 1 cards here could hold them"
        );
        assert_eq!(r.failed_and_unresolvable_nodes["cpu"], "node has no GPU");
        assert_eq!(r.failed_and_unresolvable_nodes["ghost"], "node has no nano-gpu inventory");
        assert!(r.failed_nodes.is_empty() && r.error.is_empty());
    }

    #[test]
    fn filter_answers_full_nodes_with_the_nodes_that_fit() {
        let mut e = extender();
        let mut a = args("200", json!({}), &[]);
        a.node_names = None;
        a.nodes = Some(
            serde_json::from_value(json!({"metadata": {}, "items": [
            {"metadata": {"name": "t4-0"}}, {"metadata": {"name": "a100"}}]}))
            .unwrap(),
        );
        let r = e.filter(a);
        let names: Vec<_> = r.nodes.unwrap().items.into_iter().filter_map(|n| n.metadata.name).collect();
        assert_eq!(names, vec!["t4-0".to_string()]);
        assert!(r.failed_and_unresolvable_nodes.contains_key("a100"));
    }

    #[test]
    fn filter_reports_busy_cards_as_resolvable() {
        let mut e = extender();
        for _ in 0..2 {
            let b = e.bind(args("60", json!({}), &[]).pod.as_ref().unwrap(), "t4-0", "t").unwrap();
            assert_eq!(b.assignment.containers["train"][0].percent, Percent(60));
        }
        let r = e.filter(args("50", json!({}), &["t4-0"]));
        assert_eq!(r.node_names, Some(vec![]));
        assert_eq!(r.failed_nodes["t4-0"], "GPU busy: no card has 50 percent free (most free: 40 percent)");
    }

    #[test]
    fn a_model_annotation_leaves_only_nodes_with_that_model() {
        let mut e = extender();
        let r = e.filter(args("30", json!({"nano-gpu/gpu-model": "NVIDIA-A100-SXM4-80GB"}), &ALL));
        assert_eq!(r.node_names, Some(vec!["a100".to_string()]));
        assert_eq!(r.failed_and_unresolvable_nodes["t4-1"], "no card of an allowed model");
    }

    #[test]
    fn an_invalid_request_fails_the_filter_with_the_users_message() {
        let mut e = extender();
        let r = e.filter(args("150", json!({}), &ALL));
        assert_eq!(
            r.error,
            "container \"train\": nano-gpu/gpu-percent 150 is neither 1..=100 nor a multiple of 100"
        );
        assert_eq!(r.node_names, Some(vec![]));
        let r = e.filter(ExtenderArgs::default());
        assert_eq!(r.error, "request has no Pod");
    }

    #[test]
    fn prioritize_gives_10_to_exactly_the_engines_choice() {
        let mut e = extender();
        e.bind(args("50", json!({}), &[]).pod.as_ref().unwrap(), "t4-2", "t").unwrap();
        let a = args("30", json!({}), &["t4-0", "t4-1", "t4-2", "a100"]);
        let scores = e.prioritize(a.clone());
        assert_eq!(scores.len(), 4);
        assert!(scores.iter().all(|h| (MIN_PRIORITY..=MAX_PRIORITY).contains(&h.score)));
        let tens: Vec<_> = scores.iter().filter(|h| h.score == MAX_PRIORITY).collect();
        assert_eq!(tens.len(), 1, "{scores:?}");
        // The engine, with the extender's own node order, decides the same node.
        let (_, req) = e.request(a.pod.as_ref().unwrap()).unwrap();
        let ids: Vec<NodeId> =
            ["t4-0", "t4-1", "t4-2", "a100"].iter().map(|n| e.engine().cluster().id(n).unwrap()).collect();
        let order = e.order.clone();
        let d = e.engine_mut().decide(&req, Some(&ids), &order, &mut Rng::new(0)).unwrap();
        assert_eq!(tens[0].host, e.engine().cluster().node(d.node).name);
    }

    #[test]
    fn bind_writes_every_container_of_a_slot_and_releasing_gives_it_back() {
        let mut e = extender();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "initContainers": [{"name": "warm", "resources": {"limits": {"nano-gpu/gpu-percent": "40"}}}],
                "containers": [{"name": "app", "resources": {"limits": {"nano-gpu/gpu-percent": "30", "nano-gpu/gpu-memory": "4096"}}}]}
        }))
        .unwrap();
        let before = e.engine().cluster().node(NodeId(0)).clone();
        let b = e.bind(&pod, "t4-0", "2026-11-21T00:00:00Z").unwrap();
        let app = &b.assignment.containers["app"];
        assert_eq!(app, &b.assignment.containers["warm"]);
        assert_eq!(b.assignment.reuse, vec!["warm".to_string()]);
        assert_eq!((app[0].percent, app[0].memory_mib), (Percent(40), Some(MiB(4096))));
        assert_eq!(Assignment::decode(&b.assignment.encode()).unwrap(), b.assignment);
        e.engine_mut().release(&b.req, b.node, &b.grants);
        let after = e.engine().cluster().node(NodeId(0));
        assert_eq!((after.cards.clone(), after.cpu_free), (before.cards, before.cpu_free));
    }

    #[test]
    fn bind_refuses_what_no_longer_fits() {
        let mut e = extender();
        let pod = args("100", json!({}), &[]).pod.unwrap();
        e.bind(&pod, "a100", "t").unwrap();
        let err = e.bind(&pod, "a100", "t").unwrap_err();
        assert!(matches!(err, BindError::NoLongerFits { .. }), "{err}");
        assert_eq!(e.bind(&pod, "nowhere", "t").unwrap_err(), BindError::UnknownNode("nowhere".into()));
    }
}
