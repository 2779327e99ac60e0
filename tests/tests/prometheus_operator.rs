//! `deploy/components/prometheus-operator` against the real Prometheus Operator (v0.85.0, built from
//! its Go module by `hack/prometheus-operator-build.sh`) on the local cluster with nano-gpu installed.
//! The operator's CRDs are installed, the component's PodMonitors and PrometheusRule applied (the API
//! server validates them against the CRDs' schemas, strictly), and the operator, running beside the
//! cluster with the admin's certificate, turns a `Prometheus` that selects them into the scrape
//! configuration and rule files it hands its Prometheus (its StatefulSet has no replicas: the images
//! cannot be pulled here). Debian's Prometheus then runs that configuration as the operator's
//! config-reloader would hand it over (the shard and pod name expanded), except for Kubernetes
//! discovery (Debian builds it without), which becomes a file of what discovery would give.
//!
//! Checked: every agent and allocator pod is a target that is up, under the job the PodMonitors name;
//! the agents' series keep the labels they carry (a workload's `namespace`, `pod` and `container`,
//! not the operator's target labels, which would turn them into `exported_*`) and name the scraped pod
//! `kubernetes_pod`; the rules Prometheus loaded are exactly the kit's alerts.

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::Api;
use kube::api::ListParams;
use nano_gpu_tests::cluster::{Cluster, NS, create, percent_pod, wait_running, wait_until};
use nano_gpu_tests::monitoring::{Prometheus, kit};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const SYSTEM: &str = "nano-gpu-system";

/// The operator's version directory (`bin/operator`, `crds/`), built if not cached.
fn operator() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash").arg(root.join("hack/prometheus-operator-build.sh")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The alert names of a rule file's groups.
fn alerts(groups: &Value) -> BTreeSet<String> {
    let rules = groups.as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap().iter());
    rules.filter_map(|r| r["alert"].as_str().or(r["name"].as_str()).map(str::to_owned)).collect()
}

/// `gzip -dc` of `bytes`.
fn gunzip(bytes: &[u8]) -> String {
    let mut child =
        Command::new("gzip").arg("-dc").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_operator_turns_the_component_into_scrapes_of_every_nano_gpu_pod_and_the_kits_alerts() {
    let operator = operator();
    let cluster = Cluster::up("promop", 1);
    let client = cluster.client().await;
    // The CRDs (server-side: the Prometheus CRD is larger than client-side apply's annotation holds).
    cluster.ok(&["apply", "--server-side", "-f", operator.join("crds").to_str().unwrap()]);
    cluster.ok(&["wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"]);
    let component =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/components/prometheus-operator");
    for file in ["pod-monitors.yaml", "prometheus-rule.yaml"] {
        cluster.ok(&["apply", "--validate=strict", "-f", component.join(file).to_str().unwrap()]);
    }

    // The operator, in the cluster's network (where `hack/cluster.sh down` stops what runs), with the
    // admin's certificate, for nano-gpu's namespace only.
    let pki = |f: &str| cluster.path(&format!("pki/{f}")).display().to_string();
    let argv = [
        "nsenter".to_owned(),
        format!("--net={}", cluster.env["NETNS"]),
        operator.join("bin/operator").display().to_string(),
        format!("--apiserver=https://{}:6443", cluster.env["CP_IP"]),
        format!("--cert-file={}", pki("admin.crt")),
        format!("--key-file={}", pki("admin.key")),
        format!("--ca-file={}", pki("ca.crt")),
        format!("--namespaces={SYSTEM}"),
        "--web.listen-address=127.0.0.1:0".into(),
    ];
    cluster.launch("prometheus-operator", &argv);
    // A Prometheus selecting every PodMonitor and PrometheusRule of the namespace, for Debian's
    // Prometheus version (the operator writes the configuration that version reads).
    // `prometheus, version 2.42.0+ds (...)` on standard output.
    let said = Command::new("prometheus").arg("--version").output().unwrap().stdout;
    let said = String::from_utf8_lossy(&said);
    let version = said.split_whitespace().nth(2).and_then(|v| v.split('+').next());
    let version = version.filter(|v| v.split('.').all(|n| n.parse::<u32>().is_ok()));
    let version = version.unwrap_or_else(|| panic!("prometheus --version: {said}")).to_owned();
    assert!(
        cluster.apply(
            &json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
            "metadata": {"name": "nano-gpu", "namespace": SYSTEM},
            "spec": {"replicas": 0, "version": format!("v{version}"), "scrapeInterval": "2s",
                     "evaluationInterval": "2s", "podMonitorSelector": {}, "ruleSelector": {}}})
            .to_string()
        )
    );

    // What the operator wrote: the configuration (gzipped in a Secret) and the rule files.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), SYSTEM);
    let written = || async {
        let data = secrets.get_opt("prometheus-nano-gpu").await.unwrap().and_then(|s| s.data);
        data.and_then(|d| d.get("prometheus.yaml.gz").map(|b| gunzip(&b.0))).unwrap_or_default()
    };
    wait_until("the operator's configuration with both PodMonitors", Duration::from_secs(120), || async {
        let config = written().await;
        config.contains("podMonitor/nano-gpu-system/nano-gpu-agent")
            && config.contains("podMonitor/nano-gpu-system/nano-gpu-allocator")
    })
    .await;
    // The operator's config-reloader expands the pod's environment in it before Prometheus reads it:
    // the shard (0 of 1) and the pod's name.
    let text = written().await.replace("$(SHARD)", "0").replace("$(POD_NAME)", "prometheus-nano-gpu-0");
    let mut config: Value = serde_saphyr::from_str(&text).unwrap();
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), SYSTEM);
    let rule_files = || async {
        let map = maps.get_opt("prometheus-nano-gpu-rulefiles-0").await.unwrap();
        map.and_then(|m| m.data).unwrap_or_default()
    };
    wait_until("the operator's rule files", Duration::from_secs(60), || async {
        !rule_files().await.is_empty()
    })
    .await;
    let dir = cluster.path("prometheus");
    std::fs::create_dir_all(dir.join("rules")).unwrap();
    for (name, text) in rule_files().await {
        std::fs::write(dir.join("rules").join(name), text).unwrap();
    }
    config["rule_files"] = json!([dir.join("rules/*.yaml").display().to_string()]);
    println!("the operator's configuration: {config}");

    // A share runs, so the agent has per-container series.
    cluster.ok(&["create", "namespace", NS]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    create(&pods, &percent_pod("watched", 30)).await;
    wait_running(&pods, &["watched".into()], Duration::from_secs(120)).await;

    let prometheus = Prometheus::run(&cluster, &client, &dir, config).await;
    let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let count = |app: &str| {
        let system = system.clone();
        let selector = format!("app.kubernetes.io/name={app}");
        async move { system.list(&ListParams::default().labels(&selector)).await.unwrap().items.len() }
    };
    let (agents, allocators) = (count("nano-gpu-agent").await, count("nano-gpu-allocator").await);
    wait_until("every agent and allocator scraped and up", Duration::from_secs(60), || async {
        let up = |job: &str| prometheus.query(&cluster, &format!("count(up{{job=\"{job}\"}} == 1)"));
        let n = |v: Vec<Value>| v.first().and_then(|s| s["value"][1].as_str()?.parse::<usize>().ok());
        n(up("nano-gpu-agent")) == Some(agents) && n(up("nano-gpu-allocator")) == Some(allocators)
    })
    .await;
    let share = format!(
        "nano_gpu_container_granted_percent{{namespace=\"{NS}\",pod=\"watched\",container=\"c\",\
         kubernetes_pod=~\"nano-gpu-agent-.*\"}}"
    );
    wait_until(
        "the share's grant under its own namespace, pod and container",
        Duration::from_secs(60),
        || async { prometheus.query(&cluster, &share).first().is_some_and(|s| s["value"][1] == "30") },
    )
    .await;
    let relabelled =
        prometheus.query(&cluster, "count({exported_namespace=~\".+\"} or {exported_pod=~\".+\"})");
    assert!(relabelled.is_empty(), "series with the operator's target labels over their own: {relabelled:?}");

    // The rules loaded are the kit's alerts, all of them.
    let loaded = prometheus.api(&cluster, "rules", &[]).unwrap();
    let kit_alerts: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(kit().join("alerts.yml")).unwrap()).unwrap();
    assert_eq!(alerts(&loaded["groups"]), alerts(&kit_alerts["groups"]));
    drop(prometheus);
    cluster.down();
}
