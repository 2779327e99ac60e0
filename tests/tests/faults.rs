//! Faults on the local cluster's real nodes, each during a burst of GPU pods: what must hold after
//! every one is that each pod that fits ends Running on the cards it was assigned, no card is over
//! 100 % or its memory, the allocator's accounting equals the assignments, and no pod is failed by us
//! (`nano_gpu_tests::checks::check_consistency` and the phases here).
//!
//! The cluster has 16 cards (4 A100, 2 T4 and 2 A10, 8 V100): 48 shares of 30 % fit.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use nano_gpu_tests::checks::check_consistency;
use nano_gpu_tests::cluster::{Cluster, NS, percent_pod, phase, wait_until};
use std::time::{Duration, Instant};

/// Creates `pod` as a controller would: while the API server is away, again until it answers
/// (a create whose answer was lost finds the pod there).
async fn create_retrying(pods: &Api<Pod>, pod: &Pod) {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let start = Instant::now();
    loop {
        match pods.create(&PostParams::default(), pod).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 409 => return,
            Err(e) => {
                assert!(start.elapsed() < Duration::from_secs(120), "creating {name}: {e}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// The pods by phase, and every pod the kubelet failed, with its reason and message.
async fn phases(pods: &Api<Pod>) -> (usize, usize, Vec<String>) {
    let list = pods.list(&ListParams::default()).await.unwrap();
    let failed = list
        .items
        .iter()
        .filter(|p| phase(p) == "Failed")
        .map(|p| {
            let s = p.status.as_ref();
            format!(
                "{}: {} {}",
                p.metadata.name.as_deref().unwrap_or(""),
                s.and_then(|s| s.reason.as_deref()).unwrap_or(""),
                s.and_then(|s| s.message.as_deref()).unwrap_or("")
            )
        })
        .collect();
    let count = |want: &str| list.items.iter().filter(|p| phase(p) == want).count();
    (count("Running"), count("Pending"), failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_crashes_during_a_burst_lose_no_pod() {
    let cluster = Cluster::up("faults", 3);
    let client = cluster.client().await;
    cluster.ok(&["create", "namespace", NS]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // 60 shares of 30 % in a burst: kube-apiserver killed after the 30th (back 4 s later), etcd
    // killed after the 45th (back 3 s later). The agents' pod watches are refused, then expire, while
    // the kubelets admit pods.
    let mut crashes = Vec::new();
    for i in 0..60 {
        create_retrying(&pods, &percent_pod(&format!("burst-{i:02}"), 30)).await;
        match i {
            30 => crashes.push(cluster.crash("kube-apiserver", 4)),
            45 => {
                // One crash at a time.
                for mut c in crashes.drain(..) {
                    assert!(c.wait().unwrap().success(), "restarting kube-apiserver");
                }
                crashes.push(cluster.crash("etcd", 3));
            }
            _ => {}
        }
    }
    for mut c in crashes {
        assert!(c.wait().unwrap().success(), "restarting etcd");
    }
    wait_until("48 of the 60 shares Running", Duration::from_secs(240), || async {
        let (running, _, failed) = phases(&pods).await;
        assert!(failed.is_empty(), "pods failed: {failed:?}");
        running == 48
    })
    .await;
    // Settled: the 12 that do not fit wait, none fails.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (running, pending, failed) = phases(&pods).await;
    assert_eq!((running, pending, failed), (48, 12, Vec::<String>::new()));
    assert_eq!(check_consistency(&cluster, &client).await, 48);
}
