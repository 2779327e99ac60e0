//! `simulate --through-extender`: every trace pod goes through what a real cluster does with it, over
//! the same [`Extender`] the service runs: a Pod object and the candidate node names as JSON, our
//! filter, our 0..=10 scores, kube-scheduler's pick (`selectHost`), then our bind and the assignment
//! annotation read back as the agent would.

use crate::decide::extender::Extender;
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::model::NodeId;
use nano_gpu_engine::replay::Placer;
use nano_gpu_engine::request::Request;
use nano_gpu_engine::rng::Rng;
use nano_gpu_engine::trace::TracePod;
use nano_gpu_proto::annotations::Assignment;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_proto::extender::{ExtenderArgs, HostPriority};
use std::collections::BTreeMap;

/// `simulate --through-extender`: every pod goes through what a real cluster does: a Pod object and
/// the candidate node names as JSON, our filter, our 0..=10 scores, kube-scheduler's pick (highest
/// score, ties uniformly at random as `selectHost`), then our bind and the assignment annotation.
pub struct SimExtender {
    extender: Extender,
    names: Vec<String>,
    rng: Rng,
}

impl SimExtender {
    /// Over `engine`; `seed` salts the extender's node order and drives kube-scheduler's tie-breaks.
    pub fn new(engine: Engine, seed: u64) -> Self {
        let names = engine.cluster().nodes().iter().map(|n| n.name.clone()).collect();
        SimExtender {
            extender: Extender::new(engine, seed, DemandOptions::default()),
            names,
            rng: Rng::new(seed ^ 0x5c4e_d01e),
        }
    }
}

/// The Pod kube-scheduler would send for a trace pod: one container with CPU, memory and
/// `nano-gpu/gpu-percent` limits, and the model annotation for `gpu_spec`.
pub fn trace_pod(pod: &TracePod) -> Pod {
    use k8s_openapi::api::core::v1::{Container, PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut limits = BTreeMap::from([
        ("cpu".to_owned(), Quantity(format!("{}m", pod.cpu_milli))),
        ("memory".to_owned(), Quantity(format!("{}Mi", pod.memory_mib))),
    ]);
    if pod.num_gpu > 0 {
        let percent = if pod.num_gpu == 1 && pod.gpu_milli < 1000 {
            u64::from(pod.gpu_milli / 10)
        } else {
            100 * u64::from(pod.num_gpu)
        };
        limits.insert(nano_gpu_proto::resources::GPU_PERCENT.to_owned(), Quantity(percent.to_string()));
    }
    let mut p = Pod {
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".to_owned(),
                resources: Some(ResourceRequirements { limits: Some(limits), ..Default::default() }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    p.metadata.name = Some(pod.name.clone());
    p.metadata.namespace = Some("default".to_owned());
    if !pod.gpu_spec.is_empty() {
        p.metadata.annotations = Some(BTreeMap::from([(
            nano_gpu_proto::resources::GPU_MODEL_ANNOTATION.to_owned(),
            pod.gpu_spec.join("|"),
        )]));
    }
    p
}

impl Placer for SimExtender {
    fn place(&mut self, pod: &TracePod, _req: &Request) -> Option<NodeId> {
        let k8s_pod = trace_pod(pod);
        let args = ExtenderArgs { pod: Some(k8s_pod), nodes: None, node_names: Some(self.names.clone()) };
        // What crosses the wire: JSON in, JSON out.
        let wire = serde_json::to_string(&args).ok()?;
        let args: ExtenderArgs = serde_json::from_str(&wire).ok()?;
        let k8s_pod = args.pod.clone();
        let filtered = self.extender.filter(args);
        let feasible = filtered.node_names.unwrap_or_default();
        if !filtered.error.is_empty() || feasible.is_empty() {
            return None;
        }
        // kube-scheduler skips prioritize when only one node is feasible.
        let chosen = if feasible.len() == 1 {
            feasible[0].clone()
        } else {
            let args = ExtenderArgs { pod: k8s_pod.clone(), nodes: None, node_names: Some(feasible) };
            let scores = self.extender.prioritize(args);
            select_host(&scores, &mut self.rng)?
        };
        let bound = self.extender.bind(k8s_pod.as_ref()?, &chosen, "1970-01-01T00:00:00Z").ok()?;
        // The agent reads the annotation back: a pod whose annotation does not decode to what was
        // decided counts as not placed (in release builds too), so the raw-vs-extender test sees it.
        let written = Assignment::decode(&bound.assignment.encode()).ok();
        (written.as_ref() == Some(&bound.assignment)).then_some(bound.node)
    }

    fn engine(&self) -> &Engine {
        self.extender.engine()
    }

    fn engine_mut(&mut self) -> &mut Engine {
        self.extender.engine_mut()
    }
}

/// kube-scheduler's `selectHost`: the highest score, ties broken uniformly at random.
pub fn select_host(scores: &[HostPriority], rng: &mut Rng) -> Option<String> {
    let mut best: Option<&HostPriority> = None;
    let mut equal = 0;
    for h in scores {
        match best {
            Some(b) if h.score < b.score => {}
            Some(b) if h.score == b.score => {
                equal += 1;
                if rng.below(equal) == 0 {
                    best = Some(h);
                }
            }
            _ => {
                best = Some(h);
                equal = 1;
            }
        }
    }
    best.map(|h| h.host.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_host_breaks_ties_at_random_and_otherwise_takes_the_max() {
        let h = |host: &str, score| HostPriority { host: host.into(), score };
        let mut rng = Rng::new(3);
        assert_eq!(select_host(&[h("a", 3), h("b", 10), h("c", 9)], &mut rng).unwrap(), "b");
        let picks: std::collections::BTreeSet<_> =
            (0..50).map(|_| select_host(&[h("a", 5), h("b", 5)], &mut rng).unwrap()).collect();
        assert_eq!(picks.len(), 2);
        assert_eq!(select_host(&[], &mut rng), None);
    }
}
