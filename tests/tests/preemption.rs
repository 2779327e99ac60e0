//! Priority preemption for GPU shares on a real node (`hack/cluster.sh`, one node of four A100
//! cards, nano-gpu installed as shipped). Four shares of priority 0 take 60 % of each card: the node
//! has 160 % free, but no card 80 %. kube-scheduler leaves `nano-gpu/gpu-percent` to the extender
//! (`ignoredByScheduler`), so its preemption, which tries victims with its own filters only, finds
//! none there; nano-gpu preempts for it. A pod of higher priority whose `preemptionPolicy` is
//! `Never` preempts no one and waits. One of `preemptionPolicy: PreemptLowerPriority` gets the
//! node: exactly one share is evicted (with a `Preempted` Event naming the pod it made room for),
//! the pod runs on that share's card, the other shares keep theirs. (That the node is held against
//! the waiting pod of the same priority while the share goes is unit-tested: here kube-scheduler
//! may not try it in that window.) Then the card and accounting checks.

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::ListParams;
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment};
use nano_gpu_tests::cluster::{Cluster, NS, create, percent_pod, wait_running, wait_until};
use std::collections::BTreeMap;
use std::time::Duration;

/// The one card pod `p` was assigned.
fn card(p: &Pod) -> String {
    let a = Assignment::decode(&p.metadata.annotations.as_ref().unwrap()[ASSIGNMENT_ANNOTATION]).unwrap();
    a.containers["c"][0].uuid.clone()
}

/// The messages of the Events with `reason` about pod `name`.
async fn said(events: &Api<Event>, name: &str, reason: &str) -> Vec<String> {
    let selector = format!("involvedObject.name={name}");
    let list = events.list(&ListParams::default().fields(&selector)).await.unwrap();
    list.items.into_iter().filter(|e| e.reason.as_deref() == Some(reason)).filter_map(|e| e.message).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_of_higher_priority_preempts_where_no_card_has_room_for_it() {
    let cluster = Cluster::up("preemption", 1);
    let client = cluster.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    cluster.ok(&["create", "namespace", NS]);
    cluster.ok(&["label", "namespace", NS, "pod-security.kubernetes.io/enforce=baseline"]);
    for (name, policy) in
        [("nano-gpu-test-high", "PreemptLowerPriority"), ("nano-gpu-test-high-never", "Never")]
    {
        let class = format!(
            r#"{{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {{"name": "{name}"}},
                "value": 1000, "preemptionPolicy": "{policy}"}}"#
        );
        assert!(cluster.apply(&class), "PriorityClass {name}");
    }

    let shares: Vec<String> = (0..4).map(|i| format!("share-{i}")).collect();
    for name in &shares {
        create(&pods, &percent_pod(name, 60)).await;
    }
    wait_running(&pods, &shares, Duration::from_secs(120)).await;
    let mut cards = BTreeMap::new();
    for name in &shares {
        cards.insert(name.clone(), card(&pods.get(name).await.unwrap()));
    }
    assert_eq!(cards.values().collect::<std::collections::BTreeSet<_>>().len(), 4, "{cards:?}");

    // Above them, but it may not preempt: it waits, and every share stays.
    let mut never = percent_pod("never", 80);
    never.spec.as_mut().unwrap().priority_class_name = Some("nano-gpu-test-high-never".into());
    create(&pods, &never).await;
    wait_until("never refused", Duration::from_secs(60), || async {
        !said(&events, "never", "FailedScheduling").await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    for name in &shares {
        let p = pods.get(name).await.unwrap();
        assert!(p.metadata.deletion_timestamp.is_none(), "{name} is going for a pod that may not preempt");
    }

    // One that may: the fewest pods of lower priority go, here one share, and it runs on its card.
    let mut urgent = percent_pod("urgent", 80);
    urgent.spec.as_mut().unwrap().priority_class_name = Some("nano-gpu-test-high".into());
    create(&pods, &urgent).await;
    wait_running(&pods, &["urgent".to_owned()], Duration::from_secs(120)).await;
    let mut gone = Vec::new();
    for name in &shares {
        if pods.get_opt(name).await.unwrap().is_none_or(|p| p.metadata.deletion_timestamp.is_some()) {
            gone.push(name.clone());
        }
    }
    assert_eq!(gone.len(), 1, "preempted: {gone:?}");
    let victim = &gone[0];
    assert_eq!(card(&pods.get("urgent").await.unwrap()), cards[victim], "urgent is not on {victim}'s card");
    let preempted = said(&events, victim, "Preempted").await;
    assert!(
        preempted
            .iter()
            .any(|m| m.contains(&format!("for pod {NS}/urgent (priority 1000, above this pod's 0)"))),
        "{victim}'s Preempted Events: {preempted:?}"
    );
    let refused = said(&events, "urgent", "FailedScheduling").await;
    assert!(
        refused.iter().any(|m| m.contains("preempting pods of lower priority on node-1 to make room")),
        "urgent's FailedScheduling Events: {refused:?}"
    );
    let kept: Vec<String> = shares.iter().filter(|n| *n != victim).cloned().collect();
    wait_running(&pods, &kept, Duration::from_secs(5)).await;

    assert_eq!(nano_gpu_tests::checks::check_consistency(&cluster, &client).await, 4);
}
