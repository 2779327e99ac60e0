//! Upgrade and rollback on real nodes, with the steps of the upgrade page
//! (`docs/src/operations/upgrade.md`): the previous version (`hack/previous-build.sh`: its
//! binaries and its `deploy/`) is installed and runs shares; the overlay is pointed at this
//! checkout's version and applied, shares are created right after the apply (the agents may still be
//! rolling over; the test says how many were) and after the rollouts; then the overlay is pointed back at the previous version and applied, with shares again.
//! Throughout: every share that ran before keeps running on its cards without a restart, every new
//! one runs, and `check_consistency` holds (each container sees exactly its assignment, no card
//! over 100 % or its memory, the leader's accounting equal to the assignments).

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
use nano_gpu_proto::install::NAMESPACE;
use nano_gpu_tests::checks::check_consistency;
use nano_gpu_tests::cluster::{Cluster, NS, create, percent_pod, phase, wait_running, wait_until};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The previous version, built by `hack/previous-build.sh` (cached per commit): a directory with
/// its `bin/` and `deploy/`.
fn previous_version() -> PathBuf {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../hack/previous-build.sh");
    let out = Command::new("bash").arg(script).output().unwrap();
    assert!(out.status.success(), "hack/previous-build.sh: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// What a running share is: its node, its assignment, and when its container started.
type Running = BTreeMap<String, (String, String, String)>;

/// Every pod of the tests' namespace, each Running with no restart; what each runs on.
async fn running(pods: &Api<Pod>) -> Running {
    let mut out = Running::new();
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let name = p.metadata.name.clone().unwrap();
        assert_eq!(phase(&p), "Running", "{name}: {:?}", p.status);
        let status = &p.status.as_ref().unwrap().container_statuses.as_ref().unwrap()[0];
        assert_eq!(status.restart_count, 0, "{name} restarted");
        let started =
            status.state.as_ref().and_then(|s| s.running.as_ref()).and_then(|r| r.started_at.clone());
        let assignment = p.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)).cloned();
        let node = p.spec.as_ref().unwrap().node_name.clone();
        out.insert(
            name.clone(),
            (
                node.unwrap_or_else(|| panic!("{name} has no node")),
                assignment.unwrap_or_else(|| panic!("{name} has no assignment")),
                format!("{:?}", started.unwrap_or_else(|| panic!("{name} has no start time")).0),
            ),
        );
    }
    out
}

/// Every share of `before` still runs where and as it did, and started no container since.
fn kept(before: &Running, now: &Running, step: &str) {
    for (name, was) in before {
        assert_eq!(now.get(name), Some(was), "{step}: {name} changed");
    }
}

/// The images the pods of the install's `component` run, one line per pod (its name and image).
fn images(cluster: &Cluster, component: &str) -> Vec<String> {
    let selector = format!("app.kubernetes.io/name={component}");
    let path = "jsonpath={range .items[*]}{.metadata.name} {.spec.containers[0].image}{\"\\n\"}{end}";
    cluster
        .ok(&["get", "pods", "-n", NAMESPACE, "-l", &selector, "-o", path])
        .lines()
        .map(String::from)
        .collect()
}

/// Waits until the agents and the allocators have rolled over to `tag`: the rollouts complete, and
/// every pod of theirs (none of the other version left, terminating ones included) runs it.
async fn rolled_over(cluster: &Cluster, tag: &str) {
    for what in ["daemonset/nano-gpu-agent", "deployment/nano-gpu-allocator"] {
        cluster.ok(&["rollout", "status", "-n", NAMESPACE, what, "--timeout=300s"]);
    }
    wait_until(&format!("every agent and allocator pod runs {tag}"), Duration::from_secs(120), || async {
        ["nano-gpu-agent", "nano-gpu-allocator"].iter().all(|c| {
            let pods = images(cluster, c);
            !pods.is_empty() && pods.iter().all(|p| p.ends_with(&format!(":{tag}")))
        })
    })
    .await;
    let ready = "jsonpath={.status.readyReplicas}";
    wait_until("both allocator replicas Ready", Duration::from_secs(120), || async {
        cluster.ok(&["get", "deployment", "-n", NAMESPACE, "nano-gpu-allocator", "-o", ready]).trim() == "2"
    })
    .await;
}

/// Says how many agent pods still run the version being left (`tag`), as shares are created.
fn still_rolling(cluster: &Cluster, tag: &str) {
    let agents = images(cluster, "nano-gpu-agent");
    let left = agents.iter().filter(|p| p.ends_with(&format!(":{tag}"))).count();
    eprintln!("shares created while {left} of {} agent pods still ran {tag}", agents.len());
}

/// Creates shares `names` (the percent each asks beside it) and waits until they all run.
async fn shares(pods: &Api<Pod>, names: &[(&str, u32)]) {
    for (name, percent) in names {
        create(pods, &percent_pod(name, *percent)).await;
    }
    let names: Vec<String> = names.iter().map(|(n, _)| n.to_string()).collect();
    wait_running(pods, &names, Duration::from_secs(180)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_and_a_rollback_keep_every_share_on_its_cards() {
    let previous = previous_version();
    let old_tag: String = previous.file_name().unwrap().to_string_lossy().chars().take(12).collect();
    // deploy/ names the workspace's version (tests/tests/kustomize.rs checks it).
    let new_tag = env!("CARGO_PKG_VERSION");

    let cluster = Cluster::bare("upgrade", 2);
    cluster.install(Some(&previous));
    rolled_over(&cluster, &old_tag).await;
    let client = cluster.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    cluster.ok(&["create", "namespace", NS]);

    // The previous version runs shares.
    shares(&pods, &[("before-a", 30), ("before-b", 50), ("before-c", 100), ("before-d", 20)]).await;
    check_consistency(&cluster, &client).await;
    let before = running(&pods).await;

    // Upgrade: the overlay points at this version and is applied; shares come right after it (the
    // install step waits for the allocators' rollout, not the agents'), whether or not the agents
    // are still rolling over then: the test says which.
    cluster.install(None);
    still_rolling(&cluster, &old_tag);
    shares(&pods, &[("during-up-a", 30), ("during-up-b", 40)]).await;
    rolled_over(&cluster, new_tag).await;
    let now = running(&pods).await;
    kept(&before, &now, "upgrade");
    check_consistency(&cluster, &client).await;
    shares(&pods, &[("after-up-a", 30), ("after-up-b", 100), ("after-up-c", 10)]).await;
    check_consistency(&cluster, &client).await;
    let upgraded = running(&pods).await;

    // Rollback: the overlay points at the previous version again.
    cluster.install(Some(&previous));
    still_rolling(&cluster, new_tag);
    shares(&pods, &[("during-back", 20)]).await;
    rolled_over(&cluster, &old_tag).await;
    kept(&upgraded, &running(&pods).await, "rollback");
    check_consistency(&cluster, &client).await;
    shares(&pods, &[("after-back-a", 30), ("after-back-b", 50)]).await;
    let checked = check_consistency(&cluster, &client).await;
    let all = running(&pods).await;
    assert_eq!(checked, all.len(), "the checks saw every share");
    eprintln!("upgrade and rollback: {} shares, none restarted, every check held", all.len());
}
