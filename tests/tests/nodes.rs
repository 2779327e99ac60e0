//! The real-node harness (`hack/cluster.sh up --bare`) does what a real cluster does: two nodes, each a
//! real kubelet on a containerd, with kube-controller-manager, kube-scheduler and kube-proxy; a
//! Deployment rolls out on both, a Service answers across nodes, exec and logs reach the containers,
//! a drain finishes, and `down` leaves no process, mount, cgroup or namespace behind. (nano-gpu
//! installed on such nodes is the end-to-end test, `e2e.rs`.)

use nano_gpu_tests::cluster::Cluster;
use std::time::{Duration, Instant};

fn eventually(what: &str, secs: u64, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not after {secs}s");
        std::thread::sleep(Duration::from_millis(500));
    }
}

const WEB: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata: { name: web, namespace: default }
spec:
  replicas: 2
  selector: { matchLabels: { app: web } }
  template:
    metadata: { labels: { app: web } }
    spec:
      terminationGracePeriodSeconds: 1
      topologySpreadConstraints:
        - { maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway,
            labelSelector: { matchLabels: { app: web } } }
      containers:
        - name: web
          image: nano-gpu.local/busybox:1
          imagePullPolicy: Never
          command: ["/bin/sh", "-c", "echo serving; while true; do printf 'HTTP/1.0 200 OK\r\n\r\n%s\n' $(hostname) | nc -l -p 8080; done"]
---
apiVersion: v1
kind: Service
metadata: { name: web, namespace: default }
spec:
  selector: { app: web }
  ports: [{ port: 80, targetPort: 8080 }]
"#;

#[test]
fn real_nodes_run_a_deployment_a_service_and_a_drain_and_leave_nothing() {
    let nodes = Cluster::bare("plain", 2);
    let ready =
        nodes.ok(&["get", "nodes", "-o", "jsonpath={.items[*].status.nodeInfo.containerRuntimeVersion}"]);
    assert_eq!(ready.split_whitespace().filter(|v| v.starts_with("containerd://")).count(), 2, "{ready}");

    assert!(nodes.apply(WEB));
    nodes.ok(&["rollout", "status", "deploy/web", "--timeout=90s"]);
    let placed = nodes.ok(&["get", "pods", "-l", "app=web", "-o", "jsonpath={.items[*].spec.nodeName}"]);
    let mut placed: Vec<&str> = placed.split_whitespace().collect();
    placed.sort();
    assert_eq!(placed, ["node-1", "node-2"], "one replica per node");

    // The Service (kube-proxy's rules) answers from a pod, with both replicas across the two nodes.
    let ip = nodes.ok(&["get", "svc", "web", "-o", "jsonpath={.spec.clusterIP}"]);
    let pods = nodes.ok(&["get", "pods", "-l", "app=web", "-o", "jsonpath={.items[*].metadata.name}"]);
    let pods: Vec<&str> = pods.split_whitespace().collect();
    let mut seen = std::collections::BTreeSet::new();
    eventually("both replicas answer through the Service", 60, || {
        let out = nodes.kubectl(&["exec", pods[0], "--", "sh", "-c", &format!("nc -w 2 {ip} 80 </dev/null")]);
        let body = String::from_utf8_lossy(&out.stdout);
        if let Some(host) = body.lines().last().filter(|l| pods.contains(l)) {
            seen.insert(host.to_owned());
        }
        seen.len() == 2
    });
    // The container's own log, through the kubelet.
    assert_eq!(nodes.ok(&["logs", pods[1]]).lines().next(), Some("serving"));
    // The pods reach the apiserver through the "kubernetes" Service with their ServiceAccount.
    let api = nodes.kubectl(&[
        "exec",
        pods[0],
        "--",
        "sh",
        "-c",
        "test -s /var/run/secrets/kubernetes.io/serviceaccount/token && nc -w 2 $KUBERNETES_SERVICE_HOST 443 </dev/null",
    ]);
    assert!(api.status.success(), "{}", String::from_utf8_lossy(&api.stderr));

    // A drain evicts node-1's replica and the Deployment replaces it on node-2.
    nodes.ok(&["drain", "node-1", "--ignore-daemonsets", "--timeout=60s"]);
    nodes.ok(&["rollout", "status", "deploy/web", "--timeout=60s"]);
    let placed = nodes.ok(&["get", "pods", "-l", "app=web", "-o", "jsonpath={.items[*].spec.nodeName}"]);
    assert_eq!(placed.split_whitespace().collect::<Vec<_>>(), ["node-2", "node-2"]);

    let netns_inode = std::fs::metadata(nodes.path("netns")).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    nodes.down();
    let dir = nodes.path("").to_str().unwrap().trim_end_matches('/').to_owned();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&format!("{dir}/")), "mounts left under {dir}");
    for proc in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(proc.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(!cmdline.contains(&format!("{dir}/")), "process left: {cmdline}");
        if let (Ok(ino), Ok(ns)) = (&netns_inode, std::fs::metadata(proc.path().join("ns/net"))) {
            assert_ne!(
                *ino,
                std::os::unix::fs::MetadataExt::ino(&ns),
                "process left in the netns: {cmdline}"
            );
        }
    }
    let cgroups = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .flat_map(|h| std::fs::read_dir(h.path()).into_iter().flatten().flatten().map(|e| e.file_name()));
    let prefix = nodes.env["CGROUP_PREFIX"].trim_start_matches('/');
    assert!(cgroups.into_iter().all(|c| !c.to_string_lossy().starts_with(prefix)), "cgroups {prefix}* left");
}
