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
        ("", "pods/eviction", "create"),
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
fn the_allocator_changes_pods_only_in_its_own_namespace() {
    // Binds carry the assignment in the Binding; a pod is patched only for the leader label.
    for (kind, r) in rules() {
        let pods = r.resources.iter().flatten().any(|x| x == "pods");
        let writes = r.verbs.iter().any(|v| !["get", "list", "watch"].contains(&v.as_str()));
        assert!(!(pods && writes) || kind == "Role", "{kind} may change pods cluster-wide: {r:?}");
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

/// Every ServiceAccount's effective rights, computed from every manifest in `deploy/`: each binding
/// resolved to the rules of the role it names (roles shipped elsewhere, the built-in ones, by name),
/// one line per rule: `<account>: <where>: <verbs> <resource>[<names>]`.
fn effective_rights() -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    let mut docs: Vec<Value> = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let parsed: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
            docs.extend(parsed.into_iter().filter(|d| !d.is_null()));
        }
    }
    let role = |kind: &str, name: &str, ns: Option<&str>| {
        docs.iter().find(|d| {
            d["kind"] == kind && d["metadata"]["name"] == name && d["metadata"]["namespace"].as_str() == ns
        })
    };
    let mut lines = Vec::new();
    for b in docs.iter().filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding") {
        let ns = b["metadata"]["namespace"].as_str();
        let scope = ns.map_or("cluster-wide".to_owned(), |n| format!("in {n}"));
        let (ref_kind, ref_name) =
            (b["roleRef"]["kind"].as_str().unwrap(), b["roleRef"]["name"].as_str().unwrap());
        let role_ns = if ref_kind == "Role" { ns } else { None };
        for s in b["subjects"].as_array().unwrap() {
            assert_eq!(
                s["kind"], "ServiceAccount",
                "{}: only ServiceAccounts are bound: {s}",
                b["metadata"]["name"]
            );
            let who = s["name"].as_str().unwrap();
            match role(ref_kind, ref_name, role_ns) {
                None => {
                    assert!(
                        ref_name.starts_with("system:") || ref_name.starts_with("extension-apiserver"),
                        "{} names {ref_kind} {ref_name}, which deploy/ does not ship",
                        b["metadata"]["name"]
                    );
                    lines.push(format!("{who}: {scope}: built-in {ref_kind} {ref_name}"));
                }
                Some(r) => {
                    for rule in r["rules"].as_array().unwrap() {
                        let list = |k: &str| -> Vec<String> {
                            rule[k]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .map(|v| v.as_str().unwrap().to_owned())
                                .collect()
                        };
                        let groups = list("apiGroups");
                        for res in list("resources") {
                            for g in &groups {
                                let resource = if g.is_empty() { res.clone() } else { format!("{res}.{g}") };
                                let names = list("resourceNames");
                                let names = if names.is_empty() {
                                    String::new()
                                } else {
                                    format!(" [{}]", names.join(", "))
                                };
                                lines.push(format!(
                                    "{who}: {scope}: {} {resource}{names}",
                                    list("verbs").join(", ")
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    lines.sort();
    lines.dedup();
    lines
}

#[test]
fn the_security_page_states_every_accounts_effective_rights_exactly() {
    let page = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/src/concepts/security.md");
    let text = std::fs::read_to_string(page).unwrap();
    let (start, end) = ("<!-- rbac:begin -->", "<!-- rbac:end -->");
    let block = text
        .split(start)
        .nth(1)
        .and_then(|r| r.split(end).next())
        .expect("the security page has the RBAC block");
    let stated: Vec<String> =
        block.lines().filter_map(|l| l.trim().strip_prefix("- ").map(|l| l.replace('`', ""))).collect();
    let computed = effective_rights();
    assert_eq!(
        stated,
        computed,
        "docs/src/concepts/security.md's RBAC block differs from deploy/ (computed:\n- {})",
        computed.join("\n- ")
    );
}

/// The `(resource, operation)` pairs a ValidatingAdmissionPolicy in `deploy/<file>` matches.
fn matched(file: &str, policy: &str) -> Vec<(String, String)> {
    let path = format!("{}/../deploy/{file}", env!("CARGO_MANIFEST_DIR"));
    let docs: Vec<Value> = serde_saphyr::from_multiple(&std::fs::read_to_string(path).unwrap()).unwrap();
    let doc = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy" && d["metadata"]["name"] == policy)
        .unwrap_or_else(|| panic!("{file} has no policy {policy}"));
    let words = |v: &Value| -> Vec<String> {
        v.as_array().into_iter().flatten().map(|w| w.as_str().unwrap().to_owned()).collect()
    };
    let mut pairs = Vec::new();
    for rule in doc["spec"]["matchConstraints"]["resourceRules"].as_array().unwrap() {
        assert_eq!(words(&rule["apiGroups"]), [""], "{policy}: core resources only: {rule}");
        for resource in words(&rule["resources"]) {
            pairs.extend(words(&rule["operations"]).into_iter().map(|op| (resource.clone(), op)));
        }
    }
    pairs
}

/// Every way nano-gpu's accounts can change a pod or a Node's content (their own roles and the
/// built-in `system:kube-scheduler` the allocator's account also holds) passes nano-gpu-own-keys,
/// and every way a pod can come to carry an assignment passes nano-gpu-assignments: a resource
/// dropped from either policy's match (the older `bindings` among them) fails here.
#[test]
fn every_write_of_nano_gpus_accounts_and_every_way_to_an_assignment_is_judged_by_a_policy() {
    let own = matched("own-keys-policy.yaml", "nano-gpu-own-keys");
    for (resource, op) in [
        ("pods", "UPDATE"),
        ("pods/status", "UPDATE"),
        ("pods/binding", "CREATE"),
        ("bindings", "CREATE"),
        ("nodes", "UPDATE"),
        ("nodes/status", "UPDATE"),
    ] {
        assert!(
            own.contains(&(resource.into(), op.into())),
            "nano-gpu-own-keys does not judge {op} {resource}"
        );
    }
    let assignments = matched("assignment-policy.yaml", "nano-gpu-assignments");
    for resource in ["pods", "pods/status", "pods/binding", "bindings"] {
        for op in ["CREATE", "UPDATE"] {
            assert!(
                assignments.contains(&(resource.into(), op.into())),
                "nano-gpu-assignments does not judge {op} {resource}"
            );
        }
    }
    // The rights this covers: every write deploy/ grants the accounts on pods, Bindings and nodes
    // (create, patch, update) is among the pairs nano-gpu-own-keys judges.
    let judged = ["pods", "pods/status", "pods/binding", "bindings", "nodes", "nodes/status"];
    let mut seen = 0;
    for line in effective_rights() {
        let Some((who, rest)) = line.split_once(": ") else { continue };
        if !who.starts_with("nano-gpu-") {
            continue;
        }
        // `<where>: <verb>, <verb> <resource>[ [names]]`
        let Some((_, rule)) = rest.split_once(": ") else { continue };
        let mut words = rule.split(' ');
        let mut ops = Vec::new();
        for word in words.by_ref() {
            match word.trim_end_matches(',') {
                "patch" | "update" => ops.push("UPDATE"),
                "create" => ops.push("CREATE"),
                _ => {}
            }
            if !word.ends_with(',') {
                break;
            }
        }
        let resource = words.next().unwrap_or_default();
        if judged.contains(&resource) {
            for op in ops {
                seen += 1;
                assert!(own.contains(&(resource.to_owned(), op.to_owned())), "{line}: {op} not judged");
            }
        }
    }
    // The allocator's Bindings and the accounts' pod and Node writes at least: a parse that finds
    // none checks nothing.
    assert!(seen >= 3, "only {seen} writes of nano-gpu's accounts on pods, Bindings and nodes found");
}
