//! Debian's Prometheus on the local cluster, run with `deploy/monitoring/`'s scrape jobs and alert
//! rules, for the end-to-end test of the monitoring kit. Debian builds Prometheus without Kubernetes
//! service discovery, so each job's `kubernetes_sd_configs` becomes a `file_sd_configs` file the
//! harness writes from the pods in `nano-gpu-system`, with the `__meta_kubernetes_*` labels Kubernetes
//! discovery gives them: the shipped relabelling then picks the targets, as it would in a cluster.

use crate::cluster::Cluster;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Where it listens, inside the cluster's network namespace: the control plane's address, where the
/// local cluster's allocators read the cards' load (`hack/cluster.sh`: NANO_GPU_PROMETHEUS_URL).
fn listen(cluster: &Cluster) -> String {
    format!("{}:19090", cluster.env["CP_IP"])
}

/// The monitoring kit in the repository.
pub fn kit() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

/// A running Prometheus; stopped when dropped.
pub struct Prometheus {
    child: Child,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus in `dir` (its configuration, targets and data) scraping the cluster every
    /// `interval` (the kit's own is 15 s), after `promtool check config` accepted the configuration.
    pub async fn start(cluster: &Cluster, client: &kube::Client, dir: &Path, interval: &str) -> Prometheus {
        std::fs::create_dir_all(dir).unwrap();
        let text = std::fs::read_to_string(kit().join("prometheus.yml")).unwrap();
        let mut config: Value = serde_saphyr::from_str(&text).unwrap();
        config["global"]["scrape_interval"] = interval.into();
        config["global"]["evaluation_interval"] = interval.into();
        std::fs::copy(kit().join("alerts.yml"), dir.join("alerts.yml")).unwrap();
        Prometheus::run(cluster, client, dir, config).await
    }

    /// Starts Prometheus in `dir` with `config` (its rule files already in place), every job's
    /// Kubernetes discovery replaced by a file of what it would discover in `nano-gpu-system`, after
    /// `promtool check config` accepted it.
    pub async fn run(cluster: &Cluster, client: &kube::Client, dir: &Path, mut config: Value) -> Prometheus {
        std::fs::create_dir_all(dir).unwrap();
        let targets = dir.join("targets.json");
        for job in config["scrape_configs"].as_array_mut().unwrap() {
            let job = job.as_object_mut().unwrap();
            assert!(job.remove("kubernetes_sd_configs").is_some(), "every job discovers pods: {job:?}");
            job.insert("file_sd_configs".into(), json!([{"files": [targets.display().to_string()]}]));
        }
        let file = dir.join("prometheus.json");
        std::fs::write(&file, config.to_string()).unwrap();
        std::fs::write(&targets, discovered(client).await.to_string()).unwrap();
        let check = Command::new("promtool")
            .arg("check")
            .arg("config")
            .arg(&file)
            .output()
            .expect("promtool (Debian's prometheus)");
        assert!(
            check.status.success(),
            "promtool check config: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net={}", cluster.env["NETNS"]))
            .arg("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={}", listen(cluster)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting prometheus (Debian's prometheus)");
        Prometheus { child }
    }

    /// `GET /api/v1/<path>` with the query parameters `params` (URL-encoded); the answer's `data`,
    /// `None` while Prometheus does not answer (starting). A refused query fails the test.
    pub fn api(&self, cluster: &Cluster, path: &str, params: &[(&str, &str)]) -> Option<Value> {
        let mut extra = vec!["--get".to_owned()];
        for (k, v) in params {
            extra.push("--data-urlencode".into());
            extra.push(format!("{k}={v}"));
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let (code, body) = cluster.curl(&format!("http://{}/api/v1/{path}", listen(cluster)), None, &extra);
        if code == 0 || code == 503 {
            return None;
        }
        let answer: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        assert!(code == 200 && answer["status"] == "success", "prometheus {path} {params:?}: {code} {body}");
        Some(answer["data"].clone())
    }

    /// The instant vector or scalar of `expr` now (empty while Prometheus does not answer).
    pub fn query(&self, cluster: &Cluster, expr: &str) -> Vec<Value> {
        let Some(data) = self.api(cluster, "query", &[("query", expr)]) else { return Vec::new() };
        match data["resultType"].as_str() {
            Some("vector" | "matrix") => data["result"].as_array().cloned().unwrap_or_default(),
            _ => vec![data["result"].clone()],
        }
    }
}

/// What Kubernetes discovery (role `pod`) would give for every container port of every pod in
/// `nano-gpu-system`: the address and the `__meta_kubernetes_*` labels the kit's relabelling and the
/// Prometheus Operator's read (not the annotations, owners and host IP, which neither reads).
async fn discovered(client: &kube::Client) -> Value {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "nano-gpu-system");
    let mut groups = Vec::new();
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let (Some(spec), Some(ip)) = (p.spec.as_ref(), p.status.as_ref().and_then(|s| s.pod_ip.clone()))
        else {
            continue;
        };
        for c in &spec.containers {
            for port in c.ports.iter().flatten() {
                let status = p.status.as_ref();
                let ready = status
                    .and_then(|s| s.conditions.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                let mut labels = json!({
                    "__meta_kubernetes_namespace": "nano-gpu-system",
                    "__meta_kubernetes_pod_name": p.metadata.name,
                    "__meta_kubernetes_pod_uid": p.metadata.uid,
                    "__meta_kubernetes_pod_ip": ip,
                    "__meta_kubernetes_pod_node_name": spec.node_name,
                    "__meta_kubernetes_pod_phase": status.and_then(|s| s.phase.clone()).unwrap_or_default(),
                    "__meta_kubernetes_pod_ready": ready.to_string(),
                    "__meta_kubernetes_pod_container_name": c.name,
                    "__meta_kubernetes_pod_container_init": "false",
                    "__meta_kubernetes_pod_container_port_name": port.name.clone().unwrap_or_default(),
                    "__meta_kubernetes_pod_container_port_number": port.container_port.to_string(),
                    "__meta_kubernetes_pod_container_port_protocol": port.protocol.clone().unwrap_or("TCP".into()),
                });
                for (k, v) in p.metadata.labels.iter().flatten() {
                    let key: String =
                        k.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' }).collect();
                    labels[format!("__meta_kubernetes_pod_label_{key}")] = v.clone().into();
                    labels[format!("__meta_kubernetes_pod_labelpresent_{key}")] = "true".into();
                }
                groups.push(json!({"targets": [format!("{ip}:{}", port.container_port)], "labels": labels}));
            }
        }
    }
    Value::Array(groups)
}

/// Every query of the kit: each target `expr` of the dashboard, and for the alert rules each
/// `nano_gpu_*` metric they read (an alert's own expression is empty while all is well).
pub fn queries() -> (Vec<String>, Vec<String>) {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(kit().join("dashboard.json")).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let exprs: Vec<String> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_owned()))
        .collect();
    let alerts: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(kit().join("alerts.yml")).unwrap()).unwrap();
    let mut metrics: Vec<String> = alerts["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .flat_map(|r| metric_names(r["expr"].as_str().unwrap()))
        .collect();
    metrics.sort();
    metrics.dedup();
    (exprs, metrics)
}

/// The `nano_gpu_*` metric names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("nano_gpu_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}
