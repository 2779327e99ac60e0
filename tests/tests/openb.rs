//! The placement engine on the openb trace (Alibaba cluster-trace-gpu-v2023) with the FGD paper's
//! method: our FGD and BestFit must reproduce the published numbers, and the extender path must decide
//! exactly as the raw engine does when both use the same node order.

use nano_gpu_allocator::sim::extender::SimExtender;
use nano_gpu_allocator::sim::{Options, read_nodes, read_pods, simulate};
use nano_gpu_engine::engine::{Engine, NodeOrder};
use nano_gpu_engine::policy;
use nano_gpu_engine::replay::{RawPlacer, arrivals, replay};
use nano_gpu_engine::rng::Rng;
use nano_gpu_engine::trace::{self, build_cluster};
use nano_gpu_engine::workload::Workload;
use nano_gpu_tests::openb_dir;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

fn load(pods: &str) -> (Vec<trace::TraceNode>, Vec<trace::TracePod>) {
    let dir = openb_dir();
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).expect("openb node list (../shared)");
    let pods = read_pods(&dir.join(pods)).expect("openb pod list (../shared)");
    (nodes, pods)
}

/// The median unallocated GPU % at 100 % arrived of a policy on a pod list, simulated once per
/// test binary: two tests judge the default policy on the default list (about a minute of CPU).
fn median_at_100(pod_list: &str, policy: &str) -> f64 {
    type Medians = Mutex<HashMap<(String, String), Arc<OnceLock<f64>>>>;
    static MEDIANS: OnceLock<Medians> = OnceLock::new();
    let once = {
        let mut medians = MEDIANS.get_or_init(Medians::default).lock().unwrap_or_else(|e| e.into_inner());
        medians.entry((pod_list.into(), policy.into())).or_default().clone()
    };
    *once.get_or_init(|| {
        let (nodes, pods) = load(pod_list);
        median_of(&nodes, &pods, policy)
    })
}

fn median_of(nodes: &[trace::TraceNode], pods: &[trace::TracePod], policy: &str) -> f64 {
    let opts = Options {
        policies: vec![policy.into()],
        seeds: (42..=51).collect(),
        through_extender: false,
        tune: 1.3,
        threads: 2,
        online_workload: false,
    };
    let report = simulate(nodes, pods, &opts).unwrap();
    report.policies[0].unallocated_at(100).unwrap()
}

/// The published median unallocated GPU % at 100 % arrived of a policy on a pod list
/// (`fgd_reference/`, derived from the authors' cached results).
fn published(pod_list: &str, policy: &str) -> f64 {
    let path = openb_dir().join("fgd_reference/unallocated_gpu_pct_by_policy.csv");
    let text = std::fs::read_to_string(&path).expect("fgd_reference (../shared)");
    let workload = pod_list.trim_end_matches(".csv");
    text.lines()
        .map(|l| l.split(',').collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[0] == workload && f[1] == policy && f[2] == "100")
        .and_then(|f| f[3].parse().ok())
        .unwrap_or_else(|| panic!("no published {policy} number for {workload}"))
}

#[test]
fn our_fgd_reproduces_the_papers_4_77_within_0_3() {
    let fgd = median_at_100("openb_pod_list_default.csv", "fgd");
    let paper = published("openb_pod_list_default.csv", "06-FGD");
    assert_eq!(paper, 4.77);
    assert!((fgd - paper).abs() <= 0.3, "FGD median unallocated at 100 % arrived: {fgd}");
}

#[test]
fn our_bestfit_reproduces_the_papers_7_09_within_0_5() {
    let bestfit = median_at_100("openb_pod_list_default.csv", "bestfit");
    let paper = published("openb_pod_list_default.csv", "05-BestFit");
    assert!((bestfit - paper).abs() <= 0.5, "BestFit median unallocated at 100 % arrived: {bestfit}");
}

#[test]
fn the_default_policy_leaves_at_most_4_4_percent_unallocated_on_the_default_trace() {
    let ours = median_at_100("openb_pod_list_default.csv", policy::DEFAULT);
    assert!(ours <= 4.4, "{} median unallocated at 100 % arrived: {ours}", policy::DEFAULT);
}

#[test]
fn the_default_policy_is_not_worse_than_published_fgd_on_any_pod_list() {
    let lists: Vec<String> = std::fs::read_dir(openb_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("openb_pod_list_") && n.ends_with(".csv"))
        .collect();
    assert!(lists.len() >= 8, "{lists:?}");
    let mut worse = Vec::new();
    for list in &lists {
        let ours = median_at_100(list, policy::DEFAULT);
        let fgd = published(list, "06-FGD");
        eprintln!("{list}: {} {ours:.2} vs published FGD {fgd:.2}", policy::DEFAULT);
        if ours > fgd {
            worse.push(format!("{list}: {ours:.2} > {fgd:.2}"));
        }
    }
    assert!(worse.is_empty(), "worse than published FGD: {worse:?}");
}

/// Workload mixes the default policy was not tuned on (`nano_gpu_tests::variants`, seed 1): the two
/// CPU-heaviest and the lightest model constraints, where its tie-breaks used to cost up to 2.4 points.
#[test]
fn the_default_policy_is_never_behind_fgd_on_cpu_heavy_and_lightly_constrained_mixes() {
    use nano_gpu_tests::variants::{Axis, PodList, generate};
    let dir = openb_dir();
    let default = PodList::read(&dir.join("openb_pod_list_default.csv")).unwrap();
    let gpuspec = PodList::read(&dir.join("openb_pod_list_gpuspec20.csv")).unwrap();
    let nodes = read_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
    let mut behind = Vec::new();
    for axis in [Axis::Cpu(25.0), Axis::Cpu(30.0), Axis::Gpuspec(5.0)] {
        let csv = generate(&default, &gpuspec, axis, 1).unwrap().to_csv();
        let pods = trace::parse_pods(&axis.name(), &csv).unwrap();
        let (ours, fgd) = (median_of(&nodes, &pods, policy::DEFAULT), median_of(&nodes, &pods, "fgd"));
        eprintln!("{}: {} {ours:.2} vs fgd {fgd:.2}", axis.name(), policy::DEFAULT);
        if ours > fgd + 0.1 {
            behind.push(format!("{}: {ours:.2} > {fgd:.2} + 0.1", axis.name()));
        }
    }
    assert!(behind.is_empty(), "behind fgd: {behind:?}");
}

#[test]
fn the_extender_path_decides_exactly_as_the_engine_with_the_same_node_order() {
    let (nodes, pods) = load("openb_pod_list_gpuspec20.csv");
    let base = build_cluster(&nodes).unwrap();
    let measure = Workload::from_requests(&pods.iter().map(|p| p.request(&base)).collect::<Vec<_>>());
    for name in ["fgd", policy::DEFAULT, "bestfit"] {
        let seed = 44;
        let (order, _) = arrivals(&pods, base.card_count(), 1.3, base.nodes().len(), seed);
        // Only the first 3,000 arrivals: enough to fill part of the cluster and keep the test quick.
        let order = &order[..3000];
        let hashed = NodeOrder::hashed(base.nodes().iter().map(|n| n.name.as_str()), seed);
        let engine = || Engine::new(base.clone(), policy::by_name(name, seed).unwrap(), measure.clone());
        let mut raw = RawPlacer { engine: engine(), order: hashed, rng: Rng::new(0) };
        let mut ext = SimExtender::new(engine(), seed);
        let a = replay(&pods, order, &mut raw, &measure, None);
        let b = replay(&pods, order, &mut ext, &measure, None);
        assert_eq!(a, b, "{name}: the extender path diverged from the engine");
        let nodes_a: Vec<_> = raw
            .engine
            .cluster()
            .nodes()
            .iter()
            .map(|n| n.cards.iter().map(|c| c.free).collect::<Vec<_>>())
            .collect();
        let nodes_b: Vec<_> = nano_gpu_engine::replay::Placer::cluster(&ext)
            .nodes()
            .iter()
            .map(|n| n.cards.iter().map(|c| c.free).collect::<Vec<_>>())
            .collect();
        assert_eq!(nodes_a, nodes_b);
    }
}
