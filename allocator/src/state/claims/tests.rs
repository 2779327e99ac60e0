//! The view's claims: what allocations hold, and the choices for pods waiting on claims.

use super::*;
use crate::decide::claim::{Given, allocation};
use k8s_openapi::api::core::v1::Node as KubeNode;
use nano_gpu_engine::engine::Engine;
use nano_gpu_engine::policy;
use nano_gpu_engine::workload::Workload;
use nano_gpu_proto::demand::DemandOptions;
use nano_gpu_proto::dra::CLASS;
use nano_gpu_proto::units::Percent;
use serde_json::json;

fn state() -> ClusterState {
    let engine = Engine::new(
        nano_gpu_engine::model::Cluster::new(),
        policy::by_name("fgd-balance", 0).unwrap(),
        Workload::default(),
    );
    ClusterState::new(engine, 1, DemandOptions::default())
}

/// A node of `cards` T4s; `dra`: its agent serves DRA.
fn node(name: &str, cards: usize, dra: bool) -> KubeNode {
    node_of("T4", name, cards, dra)
}

/// A node of `cards` cards of `model`.
fn node_of(model: &str, name: &str, cards: usize, dra: bool) -> KubeNode {
    let gpus: Vec<_> = (0..cards)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "vendor": "nvidia", "model": model, "memoryMiB": 15360, "healthy": true}))
        .collect();
    let labels = if dra { json!({"nano-gpu/front-end": "dra", "zone": name}) } else { json!({"zone": name}) };
    crate::state::tests::watched_node(json!({
        "metadata": {"name": name, "labels": labels,
            "annotations": {"nano-gpu/gpus": json!({"v": 1, "gpus": gpus}).to_string()}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nano-gpu/gpu-percent": (cards * 100).to_string()}}
    }))
}

/// Claim `name` (uid `u-<name>`, resourceVersion `version`) with one request `gpu`.
fn claim(name: &str, version: u32, exactly: serde_json::Value) -> ResourceClaim {
    let mut e = json!({"deviceClassName": CLASS});
    for (k, v) in exactly.as_object().unwrap() {
        e[k] = v.clone();
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "t", "uid": format!("u-{name}"), "resourceVersion": version.to_string()},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": e}]}},
    }))
    .unwrap()
}

fn share(name: &str, version: u32, percent: u32) -> ResourceClaim {
    claim(name, version, json!({"capacity": {"requests": {"percent": percent.to_string()}}}))
}

/// A share of `percent` allocated on card `card` of node `dra`.
fn allocated(name: &str, version: u32, card: u32, percent: u32) -> ResourceClaim {
    let mut c = share(name, version, percent);
    let given = [Given { request: "gpu".into(), card, percent: Percent(percent), memory: None }];
    let uid = format!("u-{name}");
    c.status = Some(serde_json::from_value(json!({"allocation": allocation(&uid, "dra", &given)})).unwrap());
    c
}

/// A pending pod `name` using claims `claims`, with `extra` merged into its spec.
fn claim_pod(name: &str, claims: &[&str], extra: serde_json::Value) -> Pod {
    let entries: Vec<_> = claims
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
        .collect();
    let mut spec = json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}], "resourceClaims": entries});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    crate::state::tests::watched_pod(
        json!({"metadata": {"name": name, "namespace": "t", "uid": format!("p-{name}")}, "spec": spec}),
    )
}

fn free(s: &ClusterState, node: &str) -> Vec<u32> {
    let c = s.extender().engine().cluster();
    c.node(c.id(node).unwrap()).cards.iter().map(|c| c.free.0).collect()
}

/// The claim as the API server has it once `w` is written (version bumped).
fn written(c: &ResourceClaim, w: &ClaimWrite) -> ResourceClaim {
    let mut c = c.clone();
    let v: u64 = c.metadata.resource_version.as_deref().unwrap().parse().unwrap();
    c.metadata.resource_version = Some((v + 2).to_string());
    c.status = Some(serde_json::from_value(json!({"allocation": w.allocation})).unwrap());
    c
}

fn warnings(s: &mut ClusterState) -> Vec<String> {
    s.take_warnings()
        .into_iter()
        .map(|w| format!("{} {}/{}: {}", w.reason, w.namespace, w.name, w.message))
        .collect()
}

#[test]
fn a_waiting_pods_claim_is_placed_on_a_dra_node_and_holds_its_card_from_the_choice_on() {
    let mut s = state();
    s.apply_node(&node("plugin", 2, false));
    s.apply_node(&node("dra", 2, true));
    let c = share("a", 5, 30);
    s.apply_claim(&c);
    s.apply_pod(&claim_pod("a", &["a"], json!({})));
    let writes = s.plan_claims();
    assert_eq!(writes.len(), 1, "{:?}", warnings(&mut s));
    let w = &writes[0];
    assert_eq!((w.node.as_str(), w.claim.1.as_str(), w.resource_version.as_str()), ("dra", "a", "5"));
    let result = &w.allocation["devices"]["results"][0];
    assert_eq!(result["pool"], "dra");
    assert_eq!(result["consumedCapacity"]["percent"], "30");
    let card: usize = result["device"].as_str().unwrap()["gpu-".len()..].parse().unwrap();
    // Held while in flight: a second look plans nothing more, and the card shows it taken.
    assert_eq!(free(&s, "dra")[card], 70);
    assert_eq!(free(&s, "plugin"), vec![100, 100]);
    assert!(s.plan_claims().is_empty());
    // A failed write gives it back, and the pod is planned again.
    s.not_written(w);
    assert_eq!(free(&s, "dra"), vec![100, 100]);
    let w = s.plan_claims().pop().unwrap();
    // Written: the allocation holds it; the pod waits for kube-scheduler, nothing more to plan.
    s.written(&w, &written(&c, &w));
    assert_eq!(free(&s, "dra")[card], 70);
    assert_eq!(s.in_flight().count(), 0);
    assert!(s.plan_claims().is_empty());
    // An older copy of the claim (a late watch event) frees nothing.
    s.apply_claim(&c);
    assert_eq!(free(&s, "dra")[card], 70);
    // The claim goes (its pod ended): the card is free.
    s.delete_claim(&c);
    assert_eq!(free(&s, "dra"), vec![100, 100]);
}

#[test]
fn claims_pack_cards_with_the_policy_and_whole_cards_take_free_ones() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    // Card 0 already holds a 60 % claim.
    let held = share("held", 1, 60);
    s.apply_claim(&held);
    s.apply_claim(&allocated("held", 2, 0, 60));
    assert_eq!(free(&s, "dra"), vec![40, 100]);
    // A 40 % share fills card 0 rather than opening card 1.
    s.apply_claim(&share("b", 3, 40));
    s.apply_pod(&claim_pod("b", &["b"], json!({})));
    let w = s.plan_claims().pop().unwrap();
    assert_eq!(w.allocation["devices"]["results"][0]["device"], "gpu-0");
    assert_eq!(free(&s, "dra"), vec![0, 100]);
    // A whole card takes the free one; a second finds none.
    s.apply_claim(&claim("w1", 4, json!({})));
    s.apply_pod(&claim_pod("w1", &["w1"], json!({})));
    let w = s.plan_claims().pop().unwrap();
    assert_eq!(w.allocation["devices"]["results"][0]["device"], "gpu-1");
    assert_eq!(w.allocation["devices"]["results"][0]["consumedCapacity"]["percent"], "100");
    s.apply_claim(&claim("w2", 5, json!({})));
    s.apply_pod(&claim_pod("w2", &["w2"], json!({})));
    assert!(s.plan_claims().is_empty());
    let said = warnings(&mut s);
    assert!(
        said.iter().any(|w| w.starts_with("ClaimNotAllocated t/w2: no node takes the claims")),
        "{said:?}"
    );
    // Said once, not at every look.
    assert!(s.plan_claims().is_empty());
    assert!(warnings(&mut s).is_empty());
}

#[test]
fn claims_nano_gpu_does_not_allocate_get_the_reason_and_others_are_left_alone() {
    let mut s = state();
    s.apply_node(&node("dra", 1, true));
    let other: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "other", "namespace": "t", "uid": "u-other", "resourceVersion": "1"},
        "spec": {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "other.example.com"}}]}},
    }))
    .unwrap();
    s.apply_claim(&other);
    s.apply_pod(&claim_pod("foreign", &["other"], json!({})));
    s.apply_claim(&claim("cel", 2, json!({"selectors": [{"cel": {"expression": "true"}}]})));
    s.apply_pod(&claim_pod("cel", &["cel"], json!({})));
    s.apply_claim(&share("mine", 3, 10));
    s.apply_pod(&claim_pod("mixed", &["mine", "other"], json!({})));
    s.apply_pod(&claim_pod("missing", &["not-yet"], json!({})));
    let mut both = claim_pod("both", &["mine"], json!({}));
    both.spec.as_mut().unwrap().containers[0].resources =
        Some(serde_json::from_value(json!({"limits": {"nano-gpu/gpu-percent": "10"}})).unwrap());
    s.apply_pod(&both);
    assert!(s.plan_claims().is_empty());
    let said = warnings(&mut s);
    assert_eq!(said.len(), 3, "{said:?}");
    assert!(said.iter().any(|w| w.contains("t/cel") && w.contains("nano-gpu/gpu-model")), "{said:?}");
    assert!(said.iter().any(|w| w.contains("t/mixed") && w.contains("other classes")), "{said:?}");
    assert!(said.iter().any(|w| w.contains("t/both") && w.contains("one or the other")), "{said:?}");
    assert_eq!(free(&s, "dra"), vec![100]);
}

#[test]
fn the_pods_node_rules_are_kept_and_a_node_kube_scheduler_refused_is_not_picked_again() {
    let mut s = state();
    s.apply_node(&node("n1", 1, true));
    s.apply_node(&node("n2", 1, true));
    let c = share("a", 1, 50);
    s.apply_claim(&c);
    s.apply_pod(&claim_pod("a", &["a"], json!({"nodeSelector": {"zone": "n2"}})));
    let w = s.plan_claims().pop().unwrap();
    assert_eq!(w.node, "n2");
    let allocated = written(&c, &w);
    s.written(&w, &allocated);
    // kube-scheduler refused n2 for the pod and cleared the allocation: n2 is left out for it now.
    let mut cleared = allocated.clone();
    cleared.metadata.resource_version = Some("9".into());
    cleared.status = None;
    s.apply_claim(&cleared);
    assert_eq!(free(&s, "n2"), vec![100]);
    assert!(s.plan_claims().is_empty());
    // With every node it may go to refused once, they are all tried again.
    let w = s.plan_claims().pop().unwrap();
    assert_eq!(w.node, "n2");
    // A pod that ran ends its wait: bound pods are not planned.
    s.not_written(&w);
    let mut bound = claim_pod("a", &["a"], json!({}));
    bound.spec.as_mut().unwrap().node_name = Some("n2".into());
    s.apply_pod(&bound);
    assert!(s.plan_claims().is_empty());
}

#[test]
fn a_node_with_the_drivers_memory_limit_takes_only_shares_made_for_one_pod() {
    let mut s = state();
    let mut limited = node("limited", 1, true);
    limited.metadata.labels.as_mut().unwrap().insert("nano-gpu/memory-limit".into(), "driver".into());
    s.apply_node(&limited);
    // A share anyone may join: no node takes it, and the reason says why.
    s.apply_claim(&share("open", 1, 30));
    s.apply_pod(&claim_pod("open", &["open"], json!({})));
    assert!(s.plan_claims().is_empty());
    let said = warnings(&mut s);
    assert!(
        said.len() == 1
            && said[0].contains("limited: it sets the driver's memory limit per pod")
            && said[0].contains("claim open holds a share"),
        "{said:?}"
    );
    // The same share made for its pod from a template, and a whole card anyone may join, go there.
    let mut mine = share("mine", 1, 30);
    mine.metadata.owner_references = Some(vec![
        serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Pod", "name": "mine", "uid": "p-mine", "controller": true}),
        )
        .unwrap(),
    ]);
    s.apply_claim(&mine);
    s.apply_pod(&claim_pod("mine", &["mine"], json!({})));
    let planned: Vec<String> =
        s.plan_claims().into_iter().map(|w| format!("{}/{}", w.claim.1, w.node)).collect();
    assert_eq!(planned, vec!["mine/limited"]);
    let mut s = state();
    s.apply_node(&limited);
    s.apply_claim(&claim("whole", 1, json!({})));
    s.apply_pod(&claim_pod("whole", &["whole"], json!({})));
    assert_eq!(s.plan_claims().pop().map(|w| w.node).as_deref(), Some("limited"));
}

#[test]
fn an_allocation_nano_gpu_could_not_have_written_fills_its_node() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    let mut c = claim("odd", 1, json!({}));
    c.status = Some(
        serde_json::from_value(json!({"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": CLASS, "pool": "dra", "device": "gpu-7"}
        ]}}}))
        .unwrap(),
    );
    s.apply_claim(&c);
    assert_eq!(free(&s, "dra"), vec![0, 0]);
    let said = warnings(&mut s);
    assert!(said.iter().any(|w| w.starts_with("InvalidAllocation t/odd") && w.contains("gpu-7")), "{said:?}");
    s.delete_claim(&c);
    assert_eq!(free(&s, "dra"), vec![100, 100]);
}

#[test]
fn a_claims_model_selector_and_the_pods_model_annotation_choose_the_node_together() {
    let mut s = state();
    s.apply_node(&node_of("T4", "t4", 1, true));
    s.apply_node(&node_of("A100", "a100", 1, true));
    let model = |m: &str| json!({"cel": {"expression": format!("device.attributes[\"gpu.nano-gpu.io\"].model == \"{m}\"")}});
    s.apply_claim(&claim("a", 1, json!({"selectors": [model("A100")]})));
    s.apply_pod(&claim_pod("a", &["a"], json!({})));
    assert_eq!(s.plan_claims().pop().unwrap().node, "a100");
    // The annotation and the selector allow no model together: no node, and the reason.
    s.apply_claim(&claim("b", 2, json!({"selectors": [model("T4")]})));
    let mut pod = claim_pod("b", &["b"], json!({}));
    pod.metadata.annotations = Some([("nano-gpu/gpu-model".to_owned(), "A100".to_owned())].into());
    s.apply_pod(&pod);
    assert!(s.plan_claims().is_empty());
    let said = warnings(&mut s);
    assert!(said.iter().any(|w| w.contains("t/b") && w.contains("no card of an allowed model")), "{said:?}");
}

#[test]
fn a_pod_whose_claim_comes_from_nano_gpus_template_asks_for_the_template_then_gets_placed() {
    let mut s = state();
    s.apply_node(&node("dra", 1, true));
    let pod = |status: serde_json::Value| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "t", "uid": "p-p"},
            "spec": {"containers": [{"name": "c"}],
                "resourceClaims": [{"name": "nano-gpu-0", "resourceClaimTemplateName": "nano-gpu-p30"}]},
            "status": status,
        }))
        .unwrap()
    };
    // No claim yet: the template is wanted (made by the runner), nothing is placed.
    s.apply_pod(&pod(json!({})));
    assert!(s.plan_claims().is_empty());
    let wanted: Vec<_> = s.take_templates_wanted().into_iter().collect();
    assert_eq!(wanted, vec![("t".to_owned(), "nano-gpu-p30".to_owned())]);
    // The controller made the claim from it: placed.
    s.apply_claim(&share("p-nano-gpu-0-x", 3, 30));
    s.apply_pod(&pod(
        json!({"resourceClaimStatuses": [{"name": "nano-gpu-0", "resourceClaimName": "p-nano-gpu-0-x"}]}),
    ));
    assert!(s.take_templates_wanted().is_empty());
    let w = s.plan_claims().pop().unwrap();
    assert_eq!(w.claim.1, "p-nano-gpu-0-x");
    s.not_written(&w);
    // A claim made from a template of that name that asks something else (a tenant's own template
    // by nano-gpu's name) is refused.
    s.apply_claim(&share("p-nano-gpu-0-x", 4, 100));
    assert!(s.plan_claims().is_empty());
    let said = warnings(&mut s);
    assert!(
        said.iter().any(|w| w.contains("t/p") && w.contains("nano-gpu-p30, which does not ask")),
        "{said:?}"
    );
}

#[test]
fn a_snapshot_forgets_claims_it_did_not_show_unless_the_watch_showed_them_later() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    // Deleted while this replica's watch missed it (version 4), and made after the list (version 9).
    s.apply_claim(&allocated("gone", 4, 0, 50));
    s.apply_claim(&allocated("new", 9, 1, 50));
    assert_eq!(free(&s, "dra"), vec![50, 50]);
    let seen = std::collections::HashSet::new();
    s.end_claim_snapshot(&seen, 8);
    assert_eq!(free(&s, "dra"), vec![100, 50]);
}

#[test]
fn a_claim_deleted_under_a_running_pod_keeps_its_card_until_the_pod_is_gone() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    running(&mut s, "a", 0, 0, 60);
    running(&mut s, "b", 0, 1, 30);
    assert_eq!(free(&s, "dra"), vec![40, 70]);
    // Deleted (its finalizer taken off) while its pod runs: the kubelet keeps the card in the pod.
    s.delete_claim(&reserved(allocated("a", 1, 0, 60), &["a"]));
    assert_eq!(free(&s, "dra"), vec![40, 70]);
    let cards = &s.inspect()["nodes"][0]["cards"];
    assert_eq!(cards[0]["claims"][0]["claim"], "t/a", "{cards}");
    // A re-list that no longer shows it keeps it too.
    s.begin_claim_relist();
    s.apply_claim(&reserved(allocated("b", 1, 1, 30), &["b"]));
    s.end_claim_relist();
    assert_eq!(free(&s, "dra"), vec![40, 70]);
    // A claim made again by that name is a claim of its own.
    let mut again = share("a", 7, 10);
    again.metadata.uid = Some("u-a-2".into());
    s.apply_claim(&again);
    let pod = claim_pod("next", &["a"], json!({}));
    s.apply_pod(&pod);
    let writes = s.plan_claims();
    assert_eq!(writes.iter().map(|w| w.claim_uid.as_str()).collect::<Vec<_>>(), ["u-a-2"]);
    s.not_written(&writes[0]);
    // Its pod ends: the card is free.
    let mut done = claim_pod("a", &["a"], json!({"nodeName": "dra"}));
    done.status = Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
    s.apply_pod(&done);
    assert_eq!(free(&s, "dra"), vec![100, 70]);
    // Deleted with its pod gone already (or never reserved for one), a claim frees its card at once;
    // so does one whose pod is deleted after it.
    s.apply_claim(&reserved(allocated("b", 2, 1, 30), &["gone"]));
    s.delete_claim(&reserved(allocated("b", 2, 1, 30), &["gone"]));
    assert_eq!(free(&s, "dra"), vec![100, 100]);
    running(&mut s, "c", 0, 1, 50);
    s.delete_claim(&reserved(allocated("c", 1, 1, 50), &["c"]));
    assert_eq!(free(&s, "dra"), vec![100, 50]);
    s.delete_pod(&claim_pod("c", &["c"], json!({"nodeName": "dra"})));
    assert_eq!(free(&s, "dra"), vec![100, 100]);
}

#[test]
fn inspect_names_each_claim_on_the_card_its_allocation_holds() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    s.apply_claim(&allocated("a", 1, 1, 60));
    s.apply_claim(&allocated("b", 2, 1, 30));
    let cards = &s.inspect()["nodes"][0]["cards"];
    assert_eq!(cards[0]["claims"], json!([]));
    assert_eq!(
        cards[1]["claims"],
        json!([{"claim": "t/a", "percent": 60, "memoryMiB": 9216}, {"claim": "t/b", "percent": 30, "memoryMiB": 4608}])
    );
    assert_eq!(cards[1]["percentUsed"], 90);
    s.delete_claim(&allocated("a", 1, 1, 60));
    assert_eq!(
        s.inspect()["nodes"][0]["cards"][1]["claims"],
        json!([{"claim": "t/b", "percent": 30, "memoryMiB": 4608}])
    );
}

#[test]
fn why_judges_a_pod_waiting_on_claims_node_by_node_as_the_planner_would() {
    let mut s = state();
    s.apply_node(&node("full", 1, true));
    s.apply_node(&node("room", 1, true));
    s.apply_node(&node("plugin", 1, false));
    // 90 % of "full"'s card allocated to another claim.
    let mut busy = share("busy", 2, 90);
    let given = [Given { request: "gpu".into(), card: 0, percent: Percent(90), memory: None }];
    busy.status =
        Some(serde_json::from_value(json!({"allocation": allocation("u-busy", "full", &given)})).unwrap());
    s.apply_claim(&busy);
    s.apply_claim(&share("want", 3, 50));
    let pod = claim_pod("waits", &["want"], json!({}));
    s.apply_pod(&pod);
    let verdicts = s.why(&pod).unwrap();
    let seen: Vec<(&str, bool, bool)> =
        verdicts.iter().map(|v| (v.node.as_str(), v.fits, v.unresolvable)).collect();
    assert_eq!(
        seen,
        [("room", true, false), ("full", false, false), ("plugin", false, true)],
        "{verdicts:?}"
    );
    assert!(verdicts[2].reason.contains("does not serve DRA"), "{verdicts:?}");
    assert!(!verdicts[1].reason.is_empty());
    // Bound, it waits no more: `why` says so.
    let mut bound = pod.clone();
    bound.spec.as_mut().unwrap().node_name = Some("room".into());
    s.apply_pod(&bound);
    let said = s.why(&bound).unwrap_err();
    assert!(said.contains("ResourceClaims") && said.contains("bound to node room"), "{said}");
    // A pending pod whose claims kube-scheduler allocates is not said to be bound.
    let theirs = claim_pod("theirs", &["someone-elses"], json!({}));
    let said = s.why(&theirs).unwrap_err();
    assert!(said.contains("not all of nano-gpu's class") && !said.contains("bound"), "{said}");
}

/// `c` (allocated) reserved for the pods `users` (by name; their uids are `p-<name>`).
fn reserved(mut c: ResourceClaim, users: &[&str]) -> ResourceClaim {
    let entries: Vec<_> =
        users.iter().map(|u| json!({"resource": "pods", "name": u, "uid": format!("p-{u}")})).collect();
    c.status.as_mut().unwrap().reserved_for = Some(serde_json::from_value(json!(entries)).unwrap());
    c
}

/// A pod `name` running on node `dra` with priority `priority`, using claim `claim`, which holds
/// `percent` of card `card` for it.
fn running(s: &mut ClusterState, name: &str, priority: i32, card: u32, percent: u32) {
    s.apply_claim(&reserved(allocated(name, 1, card, percent), &[name]));
    s.apply_pod(&claim_pod(name, &[name], json!({"nodeName": "dra", "priority": priority})));
}

fn victims(s: &mut ClusterState) -> Vec<(String, Vec<String>)> {
    s.take_preemptions()
        .into_iter()
        .map(|p| (format!("{} on {}", p.pod.1, p.node), p.victims.into_iter().map(|v| v.pod.1).collect()))
        .collect()
}

#[test]
fn a_waiting_pod_preempts_the_fewest_pods_of_the_lowest_priority_and_the_node_is_held_for_it() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    running(&mut s, "low", 0, 0, 60);
    running(&mut s, "mid", 5, 1, 60);
    assert_eq!(free(&s, "dra"), vec![40, 40]);
    // 80 % fits nowhere; ending `low` alone makes room (not `mid`, whose priority is higher).
    s.apply_claim(&share("high", 1, 80));
    s.apply_pod(&claim_pod("high", &["high"], json!({"priority": 100})));
    assert!(s.plan_claims().is_empty());
    assert_eq!(victims(&mut s), [("high on dra".to_owned(), vec!["low".to_owned()])]);
    let said = warnings(&mut s);
    assert!(
        said.len() == 1 && said[0].contains("preempting pods of lower priority on dra to make room: t/low"),
        "{said:?}"
    );
    // Nothing more while it waits; a pod of lower priority is not placed where it is nominated,
    // though 40 % is free there now.
    s.apply_claim(&share("other", 1, 30));
    s.apply_pod(&claim_pod("other", &["other"], json!({"priority": 50})));
    assert!(s.plan_claims().is_empty());
    assert!(victims(&mut s).is_empty());
    let said = warnings(&mut s);
    assert!(
        said.iter().any(|w| w.contains("t/other") && w.contains("held for pod t/high (priority 100)")),
        "{said:?}"
    );
    assert!(said.iter().any(|w| w.contains("t/high") && w.contains("waiting for them to end")), "{said:?}");
    // `low` ends; its claim is still allocated until the ResourceClaim controller deallocates it.
    s.delete_pod(&claim_pod("low", &["low"], json!({"nodeName": "dra"})));
    assert!(s.plan_claims().is_empty());
    assert!(victims(&mut s).is_empty());
    s.delete_claim(&allocated("low", 1, 0, 60));
    // Then `high` takes card 0, first, and `other` the rest of card 1.
    let writes = s.plan_claims();
    let placed: Vec<(&str, &str)> = writes
        .iter()
        .map(|w| (w.pod.1.as_str(), w.allocation["devices"]["results"][0]["device"].as_str().unwrap()))
        .collect();
    assert_eq!(placed, [("high", "gpu-0"), ("other", "gpu-1")]);
    assert_eq!(free(&s, "dra"), vec![20, 10]);
}

#[test]
fn no_one_is_preempted_by_an_equal_priority_a_never_policy_a_shared_claim_or_a_refused_eviction() {
    let mut s = state();
    s.apply_node(&node("dra", 1, true));
    running(&mut s, "a", 10, 0, 100);
    // Same priority as the pod in the way: no preemption.
    s.apply_claim(&share("same", 1, 50));
    s.apply_pod(&claim_pod("same", &["same"], json!({"priority": 10})));
    // Higher, but it may not preempt.
    s.apply_claim(&share("never", 1, 50));
    s.apply_pod(&claim_pod("never", &["never"], json!({"priority": 20, "preemptionPolicy": "Never"})));
    assert!(s.plan_claims().is_empty());
    assert!(victims(&mut s).is_empty());
    // A claim also reserved for a pod of higher priority is not freed by ending `a`.
    s.apply_claim(&reserved(allocated("a", 2, 0, 100), &["a", "vip"]));
    s.apply_pod(&claim_pod("vip", &["a"], json!({"nodeName": "dra", "priority": 1000})));
    s.apply_claim(&share("high", 1, 50));
    s.apply_pod(&claim_pod("high", &["high"], json!({"priority": 100})));
    assert!(s.plan_claims().is_empty());
    assert!(victims(&mut s).is_empty());
    // Reserved for `a` alone again: `high` preempts it; the eviction is refused (a
    // PodDisruptionBudget), so it does not preempt again before the retry.
    s.apply_claim(&reserved(allocated("a", 3, 0, 100), &["a"]));
    assert!(s.plan_claims().is_empty());
    assert_eq!(victims(&mut s), [("high on dra".to_owned(), vec!["a".to_owned()])]);
    s.preemption_failed("p-high", std::time::Instant::now());
    assert!(s.plan_claims().is_empty());
    assert!(victims(&mut s).is_empty());
    s.preempt_after.insert("p-high".into(), std::time::Instant::now());
    assert!(s.plan_claims().is_empty());
    assert_eq!(victims(&mut s).len(), 1);
}

#[test]
fn a_pod_being_deleted_is_waited_for_not_preempted_and_higher_priority_pods_are_planned_first() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    running(&mut s, "going", 0, 0, 100);
    let mut going = claim_pod("going", &["going"], json!({"nodeName": "dra"}));
    going.metadata.deletion_timestamp = Some(serde_json::from_value(json!("2026-11-29T00:00:00Z")).unwrap());
    s.apply_pod(&going);
    // Two pods want the one free card: the higher priority gets it, whatever their order.
    s.apply_claim(&claim("a-low", 1, json!({})));
    s.apply_pod(&claim_pod("a-low", &["a-low"], json!({"priority": 1})));
    s.apply_claim(&claim("b-high", 1, json!({})));
    s.apply_pod(&claim_pod("b-high", &["b-high"], json!({"priority": 2})));
    let writes = s.plan_claims();
    assert_eq!(writes.iter().map(|w| w.pod.1.as_str()).collect::<Vec<_>>(), ["b-high"]);
    // `a-low` preempts no one: the pod in its way is being deleted already.
    assert!(victims(&mut s).is_empty());
    let said = warnings(&mut s);
    assert!(
        said.iter().any(|w| w.contains("t/a-low") && w.contains("waiting for pods being deleted on dra")),
        "{said:?}"
    );
}

#[test]
fn why_names_the_pods_whose_end_would_make_room_for_a_pod_waiting_on_claims() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    running(&mut s, "x", 0, 0, 70);
    running(&mut s, "y", 100, 1, 50);
    // Ending either makes room: the one of lower priority is named.
    s.apply_claim(&share("want", 1, 60));
    let pod = claim_pod("want", &["want"], json!({}));
    s.apply_pod(&pod);
    let verdicts = s.why(&pod).unwrap();
    assert_eq!(
        (verdicts[0].fits, verdicts[0].freed_by.clone()),
        (false, vec!["t/x".to_owned()]),
        "{verdicts:?}"
    );
}

#[test]
fn among_pods_of_one_priority_the_fewest_are_preempted() {
    let mut s = state();
    s.apply_node(&node("dra", 2, true));
    // Card 0 holds two halves, card 1 one whole card (its pod first in uid order).
    running(&mut s, "x", 0, 0, 50);
    running(&mut s, "y", 0, 0, 50);
    running(&mut s, "a-whole", 0, 1, 100);
    s.apply_claim(&claim("high", 1, json!({})));
    s.apply_pod(&claim_pod("high", &["high"], json!({"priority": 1})));
    assert!(s.plan_claims().is_empty());
    assert_eq!(victims(&mut s), [("high on dra".to_owned(), vec!["a-whole".to_owned()])]);
}
