//! The allocator's RBAC (`deploy/allocator-rbac.yaml`) allows exactly what its code calls; of Secrets
//! only its own webhook certificate, in its own namespace.

use k8s_openapi::api::rbac::v1::PolicyRule;
use serde_json::Value;

fn rules() -> Vec<(String, PolicyRule)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/allocator-rbac.yaml"))
        .unwrap();
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
    docs.into_iter()
        .filter(|d| d["kind"] == "ClusterRole" || d["kind"] == "Role")
        .flat_map(|d| {
            let kind = d["kind"].as_str().unwrap_or_default().to_owned();
            let rules: Vec<PolicyRule> = serde_json::from_value(d["rules"].clone()).unwrap();
            rules.into_iter().map(move |r| (kind.clone(), r))
        })
        .collect()
}

fn allows(group: &str, resource: &str, verb: &str) -> bool {
    rules().iter().any(|(_, r)| {
        r.api_groups.iter().flatten().any(|g| g == group)
            && r.resources.iter().flatten().any(|x| x == resource)
            && r.verbs.iter().any(|v| v == verb)
    })
}

#[test]
fn the_allocator_may_do_what_its_code_does() {
    for (group, resource, verb) in [
        ("", "nodes", "watch"),
        ("", "pods", "watch"),
        ("", "pods", "patch"),
        ("", "pods/binding", "create"),
        ("events.k8s.io", "events", "create"),
        ("coordination.k8s.io", "leases", "update"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "update"),
        ("", "secrets", "create"),
        ("", "secrets", "get"),
        ("", "secrets", "update"),
    ] {
        assert!(allows(group, resource, verb), "{verb} {group}/{resource} is not allowed");
    }
}

#[test]
fn the_allocator_has_no_wildcards_and_reads_only_its_own_secret() {
    for (kind, r) in rules() {
        let words: Vec<&String> =
            r.resources.iter().flatten().chain(&r.verbs).chain(r.api_groups.iter().flatten()).collect();
        assert!(!words.iter().any(|w| *w == "*"), "{kind} has a wildcard: {r:?}");
        assert!(!r.verbs.iter().any(|v| v == "delete"), "{kind} may delete: {r:?}");
        if r.resources.iter().flatten().any(|x| x.contains("secret")) {
            assert_eq!(kind, "Role", "Secrets only in its own namespace: {r:?}");
            let names = r.resource_names.clone().unwrap_or_default();
            let only_create = r.verbs == ["create"];
            assert!(
                only_create || names == ["nano-gpu-allocator-webhook-tls"],
                "a Secret rule other than create must name the webhook certificate: {r:?}"
            );
            assert!(!r.verbs.iter().any(|v| v == "list" || v == "watch"), "may list Secrets: {r:?}");
        }
    }
}
