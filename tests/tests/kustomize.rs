//! The kustomize install, built by kubectl's own kustomize (the upstream kubectl of
//! `hack/k8s-build.sh`): `deploy/Kustomization` gives exactly the objects of `deploy/*.yaml`, each
//! component of `deploy/components/` (and `deploy/default-scheduler/`) changes what it says and
//! nothing else, and the install page's example overlay builds into what it promises. The local cluster
//! installs through an overlay too (`hack/cluster.sh`), so every cluster test applies the base and
//! the components it names.

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The upstream kubectl (`hack/k8s-build.sh` prints its directory; built once, cached after).
fn kubectl() -> PathBuf {
    let out = Command::new("bash").arg(root().join("hack/k8s-build.sh")).output().unwrap();
    assert!(out.status.success(), "hack/k8s-build.sh: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("kubectl")
}

/// The documents of a multi-document YAML text.
fn documents(text: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).unwrap();
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// What `kubectl kustomize dir` builds, by kind, namespace and name.
fn build(dir: &Path) -> BTreeMap<(String, String, String), Value> {
    let out = Command::new(kubectl()).arg("kustomize").arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    by_key(documents(&String::from_utf8(out.stdout).unwrap()))
}

fn by_key(docs: Vec<Value>) -> BTreeMap<(String, String, String), Value> {
    let key = |d: &Value| {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        (text(&d["kind"]), text(&d["metadata"]["namespace"]), text(&d["metadata"]["name"]))
    };
    let mut out = BTreeMap::new();
    for d in docs {
        assert!(out.insert(key(&d), d.clone()).is_none(), "{:?} twice", key(&d));
    }
    out
}

/// What the overlay `kustomization` builds (`{deploy}` standing for the path to `deploy/`), written
/// to a fresh directory named after `name`, removed once built.
fn build_overlay(name: &str, kustomization: &str) -> BTreeMap<(String, String, String), Value> {
    let dir = std::env::temp_dir().join(format!("nano-gpu-kustomize-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let deploy = root().join("deploy").canonicalize().unwrap();
    // kustomize takes no absolute path: the way up to / and down again.
    let up = "../".repeat(dir.canonicalize().unwrap().components().count() - 1);
    let relative = format!("{up}{}", deploy.display().to_string().trim_start_matches('/'));
    std::fs::write(dir.join("kustomization.yaml"), kustomization.replace("{deploy}", &relative)).unwrap();
    let built = build(&dir);
    let _ = std::fs::remove_dir_all(dir);
    built
}

/// The base with `components` (paths below `deploy/`).
fn with(name: &str, components: &[&str]) -> BTreeMap<(String, String, String), Value> {
    let list: String = components.iter().map(|c| format!("  - {{deploy}}/{c}\n")).collect();
    let text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {{deploy}}\ncomponents:\n{list}"
    );
    build_overlay(name, &text)
}

fn key(kind: &str, name: &str) -> (String, String, String) {
    let ns = if matches!(kind, "MutatingWebhookConfiguration" | "ValidatingAdmissionPolicy" | "Namespace") {
        ""
    } else {
        "nano-gpu-system"
    };
    (kind.to_owned(), ns.to_owned(), name.to_owned())
}

/// Container `name` of a workload.
fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    let containers = workload["spec"]["template"]["spec"]["containers"].as_array().unwrap();
    containers.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no container {name}"))
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    let list = container["env"].as_array()?;
    list.iter().find(|e| e["name"] == name).and_then(|e| e["value"].as_str())
}

/// The objects of `deploy/*.yaml`, as `kubectl apply -f deploy/` reads them.
fn files() -> BTreeMap<(String, String, String), Value> {
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(root().join("deploy")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            docs.extend(documents(&std::fs::read_to_string(&path).unwrap()));
        }
    }
    by_key(docs)
}

/// Everything but the objects in `changed` is as the base has it.
fn only_changed(built: &BTreeMap<(String, String, String), Value>, changed: &[(String, String, String)]) {
    let base = files();
    for (k, v) in &base {
        if !changed.contains(k) {
            assert_eq!(built.get(k), Some(v), "{k:?} changed");
        }
    }
}

#[test]
fn apply_k_of_deploy_installs_what_apply_f_does() {
    let base = files();
    assert_eq!(build(&root().join("deploy")), base);
    assert!(base.len() > 20, "{} objects", base.len());
}

#[test]
fn each_component_changes_what_it_says_and_nothing_else() {
    let allocator = key("Deployment", "nano-gpu-allocator");
    let agent = key("DaemonSet", "nano-gpu-agent");
    let mps = key("DaemonSet", "nano-gpu-mps");
    for unit in ["gib", "mib"] {
        let built = with(&format!("gpushare-{unit}"), &[&format!("components/gpushare-{unit}")]);
        assert_eq!(env(container(&built[&allocator], "allocator"), "NANO_GPU_GPUSHARE"), Some(unit));
        assert_eq!(env(container(&built[&agent], "agent"), "NANO_GPU_GPUSHARE"), Some(unit));
        only_changed(&built, &[allocator.clone(), agent.clone()]);
    }
    for (component, tag) in [("kube-scheduler-v1.35", "v1.35.8"), ("kube-scheduler-v1.36", "v1.36.0")] {
        let built = with(component, &[&format!("components/{component}")]);
        let image = container(&built[&allocator], "kube-scheduler")["image"].as_str().unwrap().to_owned();
        assert_eq!(image, format!("registry.k8s.io/kube-scheduler:{tag}"));
        only_changed(&built, std::slice::from_ref(&allocator));
    }
    let built = with("default-scheduler", &["default-scheduler"]);
    let service = key("Service", "nano-gpu-extender");
    assert_eq!(built[&service]["spec"]["selector"]["nano-gpu/leader"], "true");
    let a = container(&built[&allocator], "allocator");
    assert_eq!(env(a, "NANO_GPU_EXTENDER_TLS_LISTEN"), Some("0.0.0.0:8889"));
    let volumes = built[&allocator]["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    assert!(
        volumes.iter().any(|v| v["secret"]["secretName"] == "nano-gpu-extender-client-ca"),
        "{volumes:?}"
    );
    only_changed(&built, &[allocator.clone(), service]);
    let built = with("mps-exclusive", &["components/mps-exclusive-process"]);
    let controls = built[&mps]["spec"]["template"]["spec"]["containers"].as_array().unwrap();
    assert_eq!(controls.len(), 8, "one container per card");
    for control in controls {
        assert_eq!(env(control, "NANO_GPU_MPS_EXCLUSIVE_PROCESS"), Some("true"), "{}", control["name"]);
        assert_eq!(control["securityContext"]["capabilities"]["add"], serde_json::json!(["SYS_ADMIN"]));
        assert_eq!(control["securityContext"]["capabilities"]["drop"], serde_json::json!(["ALL"]));
    }
    only_changed(&built, std::slice::from_ref(&mps));
    let built = with("runtime-class", &["components/runtime-class-nvidia"]);
    assert_eq!(env(container(&built[&allocator], "allocator"), "NANO_GPU_RUNTIME_CLASS"), Some("nvidia"));
    for daemons in [&agent, &mps] {
        assert_eq!(built[daemons]["spec"]["template"]["spec"]["runtimeClassName"], "nvidia");
    }
    only_changed(&built, &[allocator.clone(), agent.clone(), mps.clone()]);
    let built = with("dra", &["components/dra"]);
    let a = container(&built[&agent], "agent");
    assert_eq!(env(a, "NANO_GPU_DRA"), Some("true"));
    let mounts: Vec<&str> =
        a["volumeMounts"].as_array().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
    let volumes = built[&agent]["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    // The agent's defaults (--dra-registry-dir, --dra-plugin-dir, --cdi-dir), each the host's own path:
    // the kubelet dials the socket path the registration names, the runtime reads the specs there.
    for path in
        ["/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins/gpu.nano-gpu.io", "/var/run/cdi"]
    {
        assert!(mounts.contains(&path), "{path} is not mounted: {mounts:?}");
        assert!(volumes.iter().any(|v| v["hostPath"]["path"] == path), "no hostPath {path}");
    }
    // The allocator allocates the class's claims; kube-scheduler's own allocator finds no device in it.
    assert_eq!(env(container(&built[&allocator], "allocator"), "NANO_GPU_DRA"), Some("true"));
    let class = &built[&("DeviceClass".to_owned(), String::new(), "gpu.nano-gpu.io".to_owned())];
    let expression = class["spec"]["selectors"][0]["cel"]["expression"].as_str().unwrap();
    assert!(expression.starts_with("device.driver == \"gpu.nano-gpu.io\" && has("), "{expression}");
    let rules =
        &built[&("ClusterRole".to_owned(), String::new(), "nano-gpu-allocator-dra".to_owned())]["rules"];
    assert_eq!(rules[1]["resources"], serde_json::json!(["resourceclaims/status", "resourceclaims/binding"]));
    only_changed(&built, &[allocator.clone(), agent.clone()]);
    let built = with("dra-shares", &["components/dra", "components/dra-shares"]);
    let a = container(&built[&allocator], "allocator");
    assert_eq!((env(a, "NANO_GPU_DRA"), env(a, "NANO_GPU_DRA_SHARES")), (Some("true"), Some("true")));
    only_changed(&built, &[allocator.clone(), agent.clone()]);
}

/// `deploy/mps.yaml` runs one MPS supervisor per card, each with a `/dev/shm` and a pipe directory of
/// its own that it names to the agent: container `card-N` supervises the card of index N, mounts the
/// emptyDirs `shm-N` at `/dev/shm` and `pipe-N` at `/run/nano-gpu/mps-pipe` (memory-backed,
/// bounded) and names those volumes' host directories; no two share an index or a volume.
#[test]
fn each_mps_container_serves_one_card_with_a_bounded_shm_of_its_own() {
    let base = files();
    let spec = &base[&key("DaemonSet", "nano-gpu-mps")]["spec"]["template"]["spec"];
    let volumes = spec["volumes"].as_array().unwrap();
    let containers = spec["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 8);
    for (n, c) in containers.iter().enumerate() {
        assert_eq!(c["name"], format!("card-{n}"));
        assert_eq!(c["args"], serde_json::json!(["mps-control"]));
        assert_eq!(env(c, "NANO_GPU_MPS_CARD_INDEX"), Some(n.to_string().as_str()), "card-{n}");
        let shm = format!("shm-{n}");
        let source = format!("/var/lib/kubelet/pods/$(POD_UID)/volumes/kubernetes.io~empty-dir/{shm}");
        assert_eq!(env(c, "NANO_GPU_MPS_SHM_SOURCE"), Some(source.as_str()), "card-{n}");
        // Its pipe directory, another bounded emptyDir of its own, at the flag's default path.
        let pipe = format!("pipe-{n}");
        let source = format!("/var/lib/kubelet/pods/$(POD_UID)/volumes/kubernetes.io~empty-dir/{pipe}");
        assert_eq!(env(c, "NANO_GPU_MPS_PIPE_SOURCE"), Some(source.as_str()), "card-{n}");
        let mounts = c["volumeMounts"].as_array().unwrap();
        let at_pipe: Vec<&Value> =
            mounts.iter().filter(|m| m["mountPath"] == "/run/nano-gpu/mps-pipe").collect();
        assert_eq!((at_pipe.len(), &at_pipe[0]["name"]), (1, &Value::from(pipe.as_str())), "card-{n}");
        let volume =
            volumes.iter().find(|v| v["name"] == pipe.as_str()).unwrap_or_else(|| panic!("no {pipe}"));
        assert_eq!(volume["emptyDir"]["medium"], "Memory", "{pipe}");
        assert!(volume["emptyDir"]["sizeLimit"].is_string(), "{pipe} is not bounded");
        let at_shm: Vec<&Value> = mounts.iter().filter(|m| m["mountPath"] == "/dev/shm").collect();
        assert_eq!(at_shm.len(), 1, "card-{n}");
        assert_eq!(at_shm[0]["name"], shm.as_str(), "card-{n}");
        let volume = volumes.iter().find(|v| v["name"] == shm.as_str()).unwrap_or_else(|| panic!("no {shm}"));
        assert_eq!(volume["emptyDir"]["medium"], "Memory", "{shm}");
        assert!(volume["emptyDir"]["sizeLimit"].is_string(), "{shm} is not bounded");
        assert!(c["resources"]["limits"]["memory"].is_string(), "card-{n}: no memory limit");
    }
}

/// An overlay's `namespace:` moves the whole install, with every component: the build equals the
/// one in `nano-gpu-system` with that name replaced wherever it appears (the webhook's exemption,
/// the policies' parameter, role bindings' subjects, the webhook's Service), and nothing names
/// `nano-gpu-system` any more. The policies' CEL names no namespace (it reads the parameter's name),
/// and kube-scheduler takes its Lease's namespace from its pod. The tenant suite installs this way.
#[test]
fn an_overlays_namespace_moves_every_mention_of_the_install_namespace() {
    use nano_gpu_proto::install::NAMESPACE;
    let mut components = vec!["default-scheduler".to_owned()];
    for entry in std::fs::read_dir(root().join("deploy/components")).unwrap() {
        components.push(format!("components/{}", entry.unwrap().file_name().to_string_lossy()));
    }
    components.sort();
    let list: String = components.iter().map(|c| format!("  - {{deploy}}/{c}\n")).collect();
    let text = |namespace: &str| {
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n{namespace}resources:\n  - {{deploy}}\ncomponents:\n{list}"
        )
    };
    let shipped = build_overlay("namespace-shipped", &text(""));
    let moved = build_overlay("namespace-moved", &text("namespace: gpu-sharing\n"));
    // kustomize gives every object it does not know as cluster-scoped (admission policies, DRA's
    // classes) a namespace; kubectl apply drops it for cluster-scoped kinds.
    let comparable = |built: BTreeMap<(String, String, String), Value>| -> BTreeMap<(String, String), Value> {
        built
            .into_iter()
            .map(|((kind, _, name), mut object)| {
                object["metadata"].as_object_mut().unwrap().remove("namespace");
                ((kind, name), object)
            })
            .collect()
    };
    let moved_text = serde_json::to_string(&moved.values().collect::<Vec<_>>()).unwrap();
    assert!(!moved_text.contains(NAMESPACE), "the moved install still names {NAMESPACE}");
    let renamed: Value = serde_json::from_str(
        &serde_json::to_string(&shipped.values().collect::<Vec<_>>())
            .unwrap()
            .replace(NAMESPACE, "gpu-sharing"),
    )
    .unwrap();
    let renamed = by_key(renamed.as_array().unwrap().clone());
    assert_eq!(comparable(moved.clone()), comparable(renamed));
    // Every namespaced object is in the new namespace, and the checks that matter name it.
    for ((kind, namespace, name), object) in &moved {
        if kind == "Namespace" {
            assert_eq!(name, "gpu-sharing");
        } else if !namespace.is_empty() {
            assert_eq!(namespace, "gpu-sharing", "{kind} {name}");
        }
        // Every policy but those that name no account of nano-gpu's reads the install's
        // Namespace as its parameter.
        let reads_namespace = name != "nano-gpu-claim-for-its-pod" && name != "nano-gpu-claim-owner";
        if kind == "ValidatingAdmissionPolicy" {
            let param = &object["spec"]["paramKind"];
            assert_eq!(
                param["kind"],
                if reads_namespace { json!("Namespace") } else { Value::Null },
                "{name}"
            );
        }
        if kind == "ValidatingAdmissionPolicyBinding" {
            let param = &object["spec"]["paramRef"];
            assert_eq!(
                param["name"],
                if reads_namespace { json!("gpu-sharing") } else { Value::Null },
                "{name}"
            );
        }
    }
    assert!(moved.len() > 25, "{} objects", moved.len());
}

/// `components/network-policies` adds NetworkPolicies only: every pod of the namespace is closed to
/// ingress but what the others open; those select the agent's and the allocator's pods by their
/// templates' labels, and open ports those pods serve (8889 only with `deploy/default-scheduler`):
/// the metrics ports to the namespace `monitoring` alone, the webhook and the mutual-TLS extender to
/// any source.
#[test]
fn the_network_policies_component_opens_only_what_it_says() {
    let built = with("network-policies", &["components/network-policies"]);
    let base = files();
    let policies: Vec<&Value> = built.values().filter(|o| o["kind"] == "NetworkPolicy").collect();
    assert_eq!(policies.len(), 3);
    let added: Vec<_> = built.keys().filter(|k| !base.contains_key(*k)).collect();
    assert!(added.iter().all(|k| k.0 == "NetworkPolicy"), "{added:?}");
    only_changed(&built, &[]);
    let deny = &built[&key("NetworkPolicy", "nano-gpu-default-deny-ingress")]["spec"];
    assert_eq!(deny["podSelector"], serde_json::json!({}));
    assert_eq!(deny["policyTypes"], serde_json::json!(["Ingress"]));
    assert!(deny.get("ingress").is_none(), "{deny}");
    let with_scheduler =
        with("network-policies-extender", &["default-scheduler", "components/network-policies"]);
    let monitoring = serde_json::json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]);
    for (policy, workload, open_to_all) in [
        ("nano-gpu-agent-metrics", key("DaemonSet", "nano-gpu-agent"), vec![]),
        ("nano-gpu-allocator", key("Deployment", "nano-gpu-allocator"), vec![8443, 8889]),
    ] {
        let spec = &built[&key("NetworkPolicy", policy)]["spec"];
        let labels = &with_scheduler[&workload]["spec"]["template"]["metadata"]["labels"];
        for (k, v) in spec["podSelector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(&labels[k], v, "{policy} selects {k}={v}, which {workload:?} does not carry");
        }
        let served: Vec<u64> = with_scheduler[&workload]["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
            .map(|p| p["containerPort"].as_u64().unwrap())
            .collect();
        let (mut to_monitoring, mut to_all) = (vec![], vec![]);
        for rule in spec["ingress"].as_array().unwrap() {
            let ports = rule["ports"].as_array().unwrap().iter().map(|p| p["port"].as_u64().unwrap());
            match rule.get("from") {
                Some(from) => {
                    assert_eq!(from, &monitoring, "{policy}");
                    to_monitoring.extend(ports)
                }
                None => to_all.extend(ports),
            }
        }
        for port in to_monitoring.iter().chain(&to_all) {
            assert!(
                served.contains(port),
                "{policy} opens {port}, which {workload:?} does not serve: {served:?}"
            );
        }
        assert_eq!(to_all, open_to_all, "{policy}: open to every source");
        assert_eq!(to_monitoring.len(), 1, "{policy}: one metrics port for Prometheus");
    }
}

/// The PodMonitors scrape the ports the containers name, and the PrometheusRule carries exactly the
/// alerts of `deploy/monitoring/alerts.yml`, which the end-to-end test runs on a real Prometheus.
#[test]
fn the_prometheus_operator_component_scrapes_the_named_ports_with_the_shipped_alerts() {
    let built = with("prometheus-operator", &["components/prometheus-operator"]);
    for (workload, name, port) in [
        (key("DaemonSet", "nano-gpu-agent"), "agent", "probes"),
        (key("Deployment", "nano-gpu-allocator"), "allocator", "http"),
    ] {
        let monitor = &built[&key("PodMonitor", &format!("nano-gpu-{name}"))];
        assert_eq!(
            monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
            format!("nano-gpu-{name}")
        );
        assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["port"], port);
        let ports = container(&built[&workload], name)["ports"].as_array().unwrap();
        assert!(ports.iter().any(|p| p["name"] == port), "{name} has no port {port}");
    }
    let alerts = documents(&std::fs::read_to_string(root().join("deploy/monitoring/alerts.yml")).unwrap());
    let rule = &built[&key("PrometheusRule", "nano-gpu")];
    assert_eq!(rule["spec"]["groups"], alerts[0]["groups"]);
    only_changed(&built, &[key("PodMonitor", "nano-gpu-agent"), key("PodMonitor", "nano-gpu-allocator")]);
}

/// The install page's example overlay (`docs/src/getting-started/install.md`), as written there (its path to `deploy/` replaced by this
/// checkout's): the images from the registry it names, kube-scheduler of 1.35, gpushare in both,
/// the taint tolerated by the agent and the MPS daemons.
#[test]
fn the_install_pages_overlay_builds_into_what_it_promises() {
    let page = std::fs::read_to_string(root().join("docs/src/getting-started/install.md")).unwrap();
    let start = page.find("<!-- kustomize: example overlay -->").expect("the install page's overlay marker");
    let block = page[start..].split("```yaml\n").nth(1).unwrap().split("```").next().unwrap();
    let built = build_overlay("readme", &block.replace("../nano-gpu/deploy", "{deploy}"));
    let mut images = Vec::new();
    for object in built.values() {
        let spec = &object["spec"]["template"]["spec"];
        for c in spec["containers"].as_array().into_iter().flatten() {
            images.push(c["image"].as_str().unwrap().to_owned());
        }
    }
    images.sort();
    images.dedup();
    assert_eq!(
        images,
        [
            "registry.example.com/nano-gpu/agent:0.1.0",
            "registry.example.com/nano-gpu/allocator:0.1.0",
            "registry.k8s.io/kube-scheduler:v1.35.8",
        ]
    );
    for name in ["nano-gpu-agent", "nano-gpu-mps"] {
        let tolerations =
            built[&key("DaemonSet", name)]["spec"]["template"]["spec"]["tolerations"].as_array().unwrap();
        assert!(tolerations.iter().any(|t| t["key"] == "example.com/gpu-node"), "{name}: {tolerations:?}");
    }
    let allocator = &built[&key("Deployment", "nano-gpu-allocator")];
    assert_eq!(env(container(allocator, "allocator"), "NANO_GPU_GPUSHARE"), Some("gib"));
}

/// `hack/build-images.sh` names its images after the workspace's version by default, which is the
/// version `deploy/` names, and the `images:` stanza it ends with installs what it pushed.
#[test]
fn build_images_names_the_version_deploy_names_and_prints_the_overlay_that_installs_them() {
    let run = |args: &[&str]| {
        let out = Command::new("bash").arg(root().join("hack/build-images.sh")).args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let version = manifest
        .split("[workspace.package]")
        .nth(1)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let (ok, out, err) = run(&["--dry-run"]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("-t nano-gpu/agent:{version} ")), "{out}");
    let images = files()
        .values()
        .flat_map(|o| o["spec"]["template"]["spec"]["containers"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["image"].as_str().map(str::to_owned))
        .filter(|i| i.starts_with("nano-gpu/"))
        .collect::<std::collections::BTreeSet<_>>();
    let want = std::collections::BTreeSet::from([
        format!("nano-gpu/agent:{version}"),
        format!("nano-gpu/allocator:{version}"),
    ]);
    assert_eq!(images, want);

    let (ok, out, err) =
        run(&["--dry-run", "--registry", "registry.example.com/team/", "--tag", "1.2.3-rc1", "--push"]);
    assert!(ok, "{err}");
    for part in ["agent", "allocator"] {
        let image = format!("registry.example.com/team/nano-gpu/{part}:1.2.3-rc1");
        assert!(out.contains(&format!("/Dockerfile.{part} -t {image} ")), "{out}");
        assert!(out.contains(&format!("push {image}")), "{out}");
    }
    let stanza = &out[out.find("images:").unwrap()..];
    let built = build_overlay(
        "images",
        &format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {{deploy}}\n{stanza}"
        ),
    );
    let mut installed: Vec<String> = built
        .values()
        .flat_map(|o| o["spec"]["template"]["spec"]["containers"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["image"].as_str().map(str::to_owned))
        .filter(|i| i.contains("nano-gpu/"))
        .collect();
    installed.sort();
    installed.dedup();
    assert_eq!(
        installed,
        [
            "registry.example.com/team/nano-gpu/agent:1.2.3-rc1",
            "registry.example.com/team/nano-gpu/allocator:1.2.3-rc1"
        ]
    );
    let bad: [&[&str]; 4] = [&["--tag", "a b"], &["0.2.0"], &["--registry", "UPPER/case"], &["--bogus"]];
    for bad in bad {
        let mut args = vec!["--dry-run"];
        args.extend_from_slice(bad);
        let (ok, _, err) = run(&args);
        assert!(!ok && err.contains("error:"), "{bad:?}: {err}");
    }
}

/// `kubectl nano-gpu uninstall` deletes by name what the install makes outside its namespace
/// (`nano_gpu_proto::install::OUTSIDE`): that list is exactly what the base and its components make
/// there, so a new cluster-wide object cannot be left behind by an uninstall.
#[test]
fn uninstall_knows_every_object_the_install_makes_outside_its_namespace() {
    use nano_gpu_proto::install::{NAMESPACE, OUTSIDE};
    let mut builds =
        vec![build(&root().join("deploy")), with("uninstall-default-scheduler", &["default-scheduler"])];
    for entry in std::fs::read_dir(root().join("deploy/components")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        // dra-shares is a setting of dra's and comes with it.
        let components = match name.as_str() {
            "dra-shares" => vec!["components/dra".to_owned(), format!("components/{name}")],
            _ => vec![format!("components/{name}")],
        };
        let components: Vec<&str> = components.iter().map(String::as_str).collect();
        builds.push(with(&format!("uninstall-{name}"), &components));
    }
    // By apiVersion too: the uninstall deletes through the group and version it names.
    let made: std::collections::BTreeSet<(String, String, String, String)> = builds
        .into_iter()
        .flat_map(BTreeMap::into_iter)
        .filter(|((kind, namespace, name), _)| {
            namespace != NAMESPACE && !(kind == "Namespace" && name == NAMESPACE)
        })
        .map(|((kind, namespace, name), object)| {
            (object["apiVersion"].as_str().unwrap_or_default().to_owned(), kind, namespace, name)
        })
        .collect();
    let listed = OUTSIDE
        .iter()
        .map(|o| {
            let api_version =
                if o.group.is_empty() { o.version.to_owned() } else { format!("{}/{}", o.group, o.version) };
            (api_version, o.kind.to_owned(), o.namespace.to_owned(), o.name.to_owned())
        })
        .collect();
    assert_eq!(made, listed);
}
