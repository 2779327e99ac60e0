//! `simulate`: replays a workload through the placement engine with the method of the FGD paper and
//! reports, per policy, the unallocated GPU against the arrived workload (median over seeds).
//!
//! The trace format and one replay (raw or through a placer) are pure and live in the engine crate
//! (`nano_gpu_engine::trace`, `nano_gpu_engine::replay`); here are the parts that run them:
//!
//! - reading the openb CSV files ([`read_nodes`], [`read_pods`]) and running policies × seeds on
//!   threads ([`simulate`]);
//! - [`extender`]: the placer of `--through-extender`, which goes through the service's decisions;
//! - [`report`]: medians over seeds, the table, the JSON document and the SVG plot.

pub mod extender;
pub mod report;

use extender::SimExtender;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::policy;
use nano_gpu_engine::replay::{Placer, RawPlacer, Replay, arrivals, replay};
use nano_gpu_engine::rng::Rng;
use nano_gpu_engine::trace::{TraceError, TraceNode, TracePod, build_cluster, parse_nodes, parse_pods};
use nano_gpu_engine::workload::{Learner, Workload};
use report::{PolicyReport, Report};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;
use thiserror::Error;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct Options {
    /// Policy names (already expanded: no `all`).
    pub policies: Vec<String>,
    /// Seeds, one replay each.
    pub seeds: Vec<u64>,
    /// Go through filter → prioritize → kube-scheduler's pick → bind instead of the raw engine.
    pub through_extender: bool,
    /// Arrived demand to top up to, as a multiple of GPU capacity.
    pub tune: f64,
    /// Worker threads.
    pub threads: usize,
    /// Learn the target workload online from the pods as they arrive (rebuilt every
    /// [`LEARN_EVERY`] pods) instead of taking it from the whole pod list up front.
    pub online_workload: bool,
}

/// How often an online target workload is rebuilt, in pods.
pub const LEARN_EVERY: u64 = 100;

/// A simulation that cannot run.
#[derive(Debug, Error)]
pub enum SimError {
    /// Unknown policy name.
    #[error(
        "unknown policy {0:?}; known: {known}, default, all (each also as <name>{suffix}: its node \
         choice with kube-scheduler's first-fit card choice)",
        known = policy::NAMES.join(", "),
        suffix = policy::first_fit::SUFFIX
    )]
    UnknownPolicy(String),
    /// The node list is unusable.
    #[error("node list: {0}")]
    Cluster(#[from] nano_gpu_engine::model::ModelError),
    /// Nothing to do.
    #[error("{0}")]
    Empty(&'static str),
}

fn read(path: &Path) -> Result<(String, String), TraceError> {
    let file = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Io { file: file.clone(), source })?;
    Ok((file, text))
}

/// Reads a node list.
pub fn read_nodes(path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    let (file, text) = read(path)?;
    parse_nodes(&file, &text)
}

/// Reads a pod list.
pub fn read_pods(path: &Path) -> Result<Vec<TracePod>, TraceError> {
    let (file, text) = read(path)?;
    parse_pods(&file, &text)
}

/// Expands `all` and `default` and checks every name.
pub fn expand_policies(names: &[String]) -> Result<Vec<String>, SimError> {
    let mut out: Vec<String> = Vec::new();
    for n in names {
        let expanded: Vec<String> = match n.as_str() {
            "all" => policy::NAMES.iter().map(|s| s.to_string()).collect(),
            "default" => vec![policy::DEFAULT.to_string()],
            other if policy::by_name(other, 0).is_some() => vec![other.to_string()],
            other => return Err(SimError::UnknownPolicy(other.to_string())),
        };
        for e in expanded {
            if !out.contains(&e) {
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// Runs every policy over every seed; seeds of one policy run in parallel.
pub fn simulate(nodes: &[TraceNode], pods: &[TracePod], opts: &Options) -> Result<Report, SimError> {
    if opts.seeds.is_empty() || opts.policies.is_empty() {
        return Err(SimError::Empty("nothing to simulate: give at least one policy and one seed"));
    }
    let base = build_cluster(nodes)?;
    if base.card_count() == 0 {
        return Err(SimError::Empty("the node list has no GPU cards"));
    }
    // The paper's target workload: typical shapes of the original pod list.
    let measure = Workload::from_requests(&pods.iter().map(|p| p.request(&base)).collect::<Vec<_>>());
    let mut report = Report::default();
    for name in &opts.policies {
        if policy::by_name(name, 0).is_none() {
            return Err(SimError::UnknownPolicy(name.clone()));
        }
        let started = Instant::now();
        let results: Mutex<Vec<(u64, Replay)>> = Mutex::new(Vec::new());
        let next = Mutex::new(opts.seeds.iter());
        std::thread::scope(|s| {
            for _ in 0..opts.threads.clamp(1, opts.seeds.len()) {
                s.spawn(|| {
                    loop {
                        let seed = match next.lock() {
                            Ok(mut it) => it.next().copied(),
                            Err(_) => None,
                        };
                        let Some(seed) = seed else { break };
                        let r = run_one(&base, pods, name, seed, opts, &measure);
                        if let Ok(mut all) = results.lock() {
                            all.push((seed, r));
                        }
                    }
                });
            }
        });
        let mut results = results.into_inner().unwrap_or_default();
        results.sort_by_key(|(seed, _)| *seed);
        report.policies.push(PolicyReport::from_replays(
            name,
            opts.through_extender,
            &results,
            started.elapsed().as_millis() as u64,
        ));
    }
    Ok(report)
}

fn run_one(
    base: &nano_gpu_engine::model::Cluster,
    pods: &[TracePod],
    name: &str,
    seed: u64,
    opts: &Options,
    measure: &Workload,
) -> Replay {
    let (order, node_order) = arrivals(pods, base.card_count(), opts.tune, base.nodes().len(), seed);
    let Some(policy) = policy::by_name(name, seed) else {
        unreachable!("policy names are checked before the replays start")
    };
    let (workload, learner) = if opts.online_workload {
        (Workload::default(), Some(Learner::new(LEARN_EVERY)))
    } else {
        (measure.clone(), None)
    };
    let engine = Engine::new(base.clone(), policy, workload);
    let mut placer: Box<dyn Placer> = if opts.through_extender {
        Box::new(SimExtender::new(engine, seed))
    } else {
        Box::new(RawPlacer { engine, order: node_order, rng: Rng::new(seed ^ 0x5eed) })
    };
    replay(pods, &order, placer.as_mut(), measure, learner)
}
