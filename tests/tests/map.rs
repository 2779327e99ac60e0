//! The GPU map at 5,000 nodes in a real browser (Chromium's headless shell): the allocator's routes
//! over a view of 5,000 nodes of 8 cards, 20,000 running shares and 50 waiting pods, served on
//! loopback; the page must come up, stay small (groups closed, 200 rows at most per open group), find
//! one node by a pod's name, and list the waiting pods. It prints what it measured (the document's
//! size, the time to the first drawing and to a search's answer): numbers to read, not thresholds.

use k8s_openapi::api::core::v1::{Node, Pod};
use nano_gpu_allocator::service::bind_api::KubeBinder;
use nano_gpu_allocator::service::server;
use nano_gpu_allocator::state::ClusterState;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::model::Cluster;
use nano_gpu_engine::policy;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_tests::browser::Browser;
use serde_json::json;
use std::time::{Duration, Instant};

const NODES: usize = 5000;
const CARDS: usize = 8;
const MODELS: [&str; 3] = ["NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA H100 80GB HBM3"];

fn node(i: usize) -> Node {
    let model = MODELS[i % MODELS.len()];
    let gpus: Vec<_> = (0..CARDS)
        .map(|c| json!({"index": c, "uuid": format!("GPU-{i:05}-{c}"), "vendor": "nvidia", "model": model, "memoryMiB": 81920, "healthy": true}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": format!("node-{i:05}"), "annotations": {"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()}},
        "status": {"allocatable": {"cpu": "96", "memory": "1024Gi", "nano-gpu/gpu-percent": (CARDS * 100).to_string()}}
    }))
    .unwrap()
}

fn pod(name: &str, percent: u32, placed: Option<(usize, usize)>) -> Pod {
    let mut p = json!({
        "metadata": {"name": name, "namespace": "ml", "uid": name, "creationTimestamp": "2026-11-24T07:00:00Z"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nano-gpu/gpu-percent": percent.to_string()}}}]},
        "status": {"phase": if placed.is_some() { "Running" } else { "Pending" }}
    });
    if let Some((n, c)) = placed {
        p["spec"]["nodeName"] = format!("node-{n:05}").into();
        let a = json!({"v": 1, "node": format!("node-{n:05}"), "at": "t",
                       "containers": {"c": [{"uuid": format!("GPU-{n:05}-{c}"), "index": c, "percent": percent}]}});
        p["metadata"]["annotations"] = json!({"nano-gpu/assignment": a.to_string()});
    }
    serde_json::from_value(p).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_map_stays_readable_at_5000_nodes_in_a_browser() {
    let engine =
        Engine::new(Cluster::new(), policy::by_name(policy::DEFAULT, 0).unwrap(), Default::default());
    let mut state = ClusterState::new(engine, 0, DemandOptions::default());
    let nodes: Vec<Node> = (0..NODES).map(node).collect();
    state.reset_nodes(&nodes);
    // Four 30 % shares on every node (cards 0..4), and 50 pods waiting for 5 whole cards, which no
    // node has free (4 each).
    let mut pods: Vec<Pod> =
        (0..NODES * 4).map(|i| pod(&format!("share-{i:05}"), 30, Some((i / 4, i % 4)))).collect();
    pods.extend((0..50).map(|i| pod(&format!("waiting-{i:02}"), 500, None)));
    state.reset_pods(&pods);
    // No bind happens here: the binder's client points nowhere.
    let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let shared = server::Shared::new(state, KubeBinder::new(client));
    shared.view.set_synced();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, server::operator_router(shared)).await });

    let started = Instant::now();
    let mut browser = Browser::open(&format!("http://{addr}/map"), 1400, 1000).await;
    browser
        .wait_for(
            "the summary",
            "document.getElementById('summary').textContent.startsWith('5000 nodes · 40000 cards')",
            Duration::from_secs(60),
        )
        .await;
    let first = started.elapsed();
    let bytes = browser.eval("fetch('map/data').then(r => r.text()).then(t => t.length)").await;
    // Readable: grouped by cards (three kinds of node), closed, nothing drawn per node yet.
    let groups = browser.eval("document.querySelectorAll('[data-group]').length").await;
    let drawn = browser.eval("document.querySelectorAll('[data-node]').length").await;
    assert_eq!((groups, drawn), (json!(3), json!(0)));
    // The waiting pods, with their reason: 5 whole cards asked, no node has more than 8 - 4 free.
    let waiting = browser.eval("document.getElementById('waiting-meta').textContent").await;
    assert_eq!(waiting, json!("50"));
    let reason = browser.eval("document.querySelector('[data-waiting=\"ml/waiting-00\"]').textContent").await;
    assert!(reason.as_str().unwrap().contains("5000 × GPU busy"), "{reason}");
    // A search for one pod opens its group and draws its node alone.
    let searched = Instant::now();
    browser.eval(&type_in_search("share-12345")).await;
    browser
        .wait_for(
            "the searched node alone",
            "[...document.querySelectorAll('[data-node]')].map(n => n.dataset.node).join() === 'node-03086'",
            Duration::from_secs(30),
        )
        .await;
    let search = searched.elapsed();
    let pods = browser.eval("document.querySelector('[data-uuid=\"GPU-03086-1\"]').dataset.pods").await;
    assert_eq!(pods, json!("ml/share-12345"));
    // One group opened: at most 200 nodes drawn.
    browser.eval(&type_in_search("")).await;
    browser.eval("document.querySelector('[data-group] h2').click()").await;
    let drawn = browser.eval("document.querySelectorAll('[data-node]').length").await;
    assert_eq!(drawn, json!(200));
    println!(
        "GPU map at {NODES} nodes × {CARDS} cards, {} pods: map/data {:.1} MB; first drawing {:.2} s after the browser started; search answered in {:.2} s",
        NODES * 4 + 50,
        bytes.as_f64().unwrap_or(0.0) / 1e6,
        first.as_secs_f64(),
        search.as_secs_f64()
    );
}

/// The JavaScript that types `text` into the map's search box, as a person would.
fn type_in_search(text: &str) -> String {
    format!(
        "(() => {{ const s = document.getElementById('search'); s.value = '{text}'; s.dispatchEvent(new Event('input')); }})()"
    )
}
