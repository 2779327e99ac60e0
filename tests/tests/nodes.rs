//! The real-node harness (`hack/nodes.sh`) does what a real cluster does: two nodes, each a real
//! kubelet on a containerd, with kube-controller-manager, kube-scheduler and kube-proxy; a Deployment
//! rolls out on both, a Service answers across nodes, exec and logs reach the containers, a drain
//! finishes, and `down` leaves no process, mount or cgroup behind. And nano-gpu installed as shipped
//! (`hack/nodes.sh install`: deploy/ applied, the allocator Deployment and the agent DaemonSet on
//! those nodes) hands real containers exactly their cards.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

struct Nodes {
    dir: PathBuf,
    /// What `hack/nodes.sh up` wrote: `control-plane.env` and `nodes.env` together.
    env: HashMap<String, String>,
}

/// `hack/nodes.sh ARGS` with the binaries of this test build: ours (nano-gpu-allocator and -agent
/// sit beside the test tools netns-forward, pause and nvidia-runtime-standin), and the fake NVML.
fn script(args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../hack/nodes.sh"))
        .args(args)
        .env("NANO_GPU_BIN", Path::new(env!("CARGO_BIN_EXE_pause")).parent().unwrap())
        .env("NANO_GPU_FAKE_NVML", nano_gpu_tests::fake_nvml());
    cmd
}

impl Nodes {
    fn up(name: &str, nodes: u32) -> Nodes {
        let dir = std::env::temp_dir().join(format!("nano-gpu-nodes-{name}-{}", std::process::id()));
        let status = script(&["up", dir.to_str().unwrap(), "--nodes", &nodes.to_string()]).status().unwrap();
        // From here on, a failure takes down what was started.
        let mut nodes = Nodes { dir, env: HashMap::new() };
        assert!(status.success(), "hack/nodes.sh up failed; logs in {}", nodes.dir.display());
        for file in ["control-plane.env", "nodes.env"] {
            nodes.env.extend(nano_gpu_tests::read_env(&nodes.dir.join(file)));
        }
        nodes
    }

    fn kubectl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(Path::new(&self.env["K8S_BIN"]).join("kubectl"));
        cmd.arg("--kubeconfig").arg(&self.env["ADMIN_KUBECONFIG"]).args(args);
        cmd
    }

    fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_cmd(args).output().unwrap()
    }

    /// kubectl's stdout; panics with its stderr when it fails.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    fn install(&self) {
        let status = script(&["install", self.dir.to_str().unwrap()]).status().unwrap();
        assert!(status.success(), "hack/nodes.sh install failed; logs in {}", self.dir.display());
    }

    /// `kubectl apply -f -` of `manifest` (YAML or JSON); whether it succeeded.
    fn apply(&self, manifest: &str) -> bool {
        let mut child = self.kubectl_cmd(&["apply", "-f", "-"]).stdin(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(manifest.as_bytes()).unwrap();
        child.wait().unwrap().success()
    }

    fn down_status(&self) -> ExitStatus {
        script(&["down", self.dir.to_str().unwrap()]).status().unwrap()
    }

    fn down(&self) {
        assert!(self.down_status().success(), "hack/nodes.sh down failed");
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.down_status();
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

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
    let nodes = Nodes::up("plain", 2);
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

    let netns_inode =
        std::fs::metadata(nodes.dir.join("netns")).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    nodes.down();
    let dir = nodes.dir.to_str().unwrap().to_owned();
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

/// A pod whose containers print their GPU environment and the cards their NVML shows, then sleep.
fn gpu_pod(name: &str, containers: &[(&str, &str)], model: Option<&str>) -> String {
    let script = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|NANO_GPU_[A-Z_]+)=' | sort; \
                  echo cards=$(grep -o 'GPU-[a-z0-9-]*' $FAKE_NVML_CONFIG | tr '\\n' ' '); sleep 3600";
    let containers: Vec<serde_json::Value> = containers
        .iter()
        .map(|(c, percent)| {
            serde_json::json!({
                "name": c, "image": "nano-gpu.local/busybox:1", "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"limits": {"nano-gpu/gpu-percent": percent}},
            })
        })
        .collect();
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": containers},
    });
    if let Some(model) = model {
        pod["metadata"]["annotations"] = serde_json::json!({"nano-gpu/gpu-model": model});
    }
    pod.to_string()
}

#[test]
fn installed_as_shipped_real_containers_get_exactly_their_cards() {
    let nodes = Nodes::up("install", 2);
    nodes.install();
    // Both agents (DaemonSet) ready, one per node; the allocator Deployment has its leader ready.
    let ds = nodes.ok(&[
        "get",
        "ds",
        "nano-gpu-agent",
        "-n",
        "nano-gpu-system",
        "-o",
        "jsonpath={.status.numberReady}",
    ]);
    assert_eq!(ds, "2");

    // The card-model pod goes first: only node-2's two T4 cards (GPU-node-2-0, -1) can take it.
    let pods = [
        ("t4", vec![("c", "40")], Some("Tesla T4")),
        ("share30", vec![("c", "30")], None),
        ("share50", vec![("c", "50")], None),
        ("whole", vec![("c", "100")], None),
        ("two-cards", vec![("c", "200")], None),
        ("pair", vec![("a", "20"), ("b", "40")], None),
    ];
    for (name, containers, model) in &pods {
        // The webhook (through its Service) may refuse while the leader changes; retry as a user would.
        let pod = gpu_pod(name, containers, *model);
        eventually(&format!("{name} created"), 60, || nodes.apply(&pod));
    }
    for (name, containers, _) in &pods {
        eventually(&format!("{name} Running"), 90, || {
            nodes.ok(&["get", "pod", name, "-o", "jsonpath={.status.phase}"]) == "Running"
        });
        let assignment =
            nodes.ok(&["get", "pod", name, "-o", "jsonpath={.metadata.annotations.nano-gpu/assignment}"]);
        let assignment: serde_json::Value = serde_json::from_str(&assignment).unwrap();
        for (c, percent) in containers {
            let mut want: Vec<String> = assignment["containers"][c]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| g["uuid"].as_str().unwrap().to_owned())
                .collect();
            want.sort();
            let mut log = String::new();
            eventually(&format!("{name}/{c} printed its cards"), 30, || {
                log = nodes.ok(&["logs", name, "-c", c]);
                log.contains("cards=")
            });
            let line = |key: &str| {
                log.lines()
                    .find_map(|l| l.strip_prefix(&format!("{key}=")))
                    .map(str::to_owned)
                    .unwrap_or_default()
            };
            let mut visible: Vec<String> =
                line("NVIDIA_VISIBLE_DEVICES").split(',').map(String::from).collect();
            visible.sort();
            let mut seen: Vec<String> = line("cards").split_whitespace().map(String::from).collect();
            seen.sort();
            assert_eq!(visible, want, "{name}/{c}: NVIDIA_VISIBLE_DEVICES against its assignment\n{log}");
            assert_eq!(seen, want, "{name}/{c}: the cards its NVML shows\n{log}");
            if *name == "t4" {
                assert!(want == ["GPU-node-2-0"] || want == ["GPU-node-2-1"], "t4 on {want:?}");
            }
            let p: u32 = percent.parse().unwrap();
            if p < 100 {
                assert_eq!(line("NANO_GPU_PERCENT"), *percent, "{name}/{c}\n{log}");
            }
        }
    }
    // Six pods, seven containers: 40 + 30 + 50 + 100 + 200 + 20 + 40 percent on 2 x 400: none over 100.
    let mut per_card = std::collections::BTreeMap::<String, u64>::new();
    let all = nodes.ok(&[
        "get",
        "pods",
        "-n",
        "default",
        "-o",
        "jsonpath={range .items[*]}{.metadata.annotations.nano-gpu/assignment}{\"\\n\"}{end}",
    ]);
    for a in all.lines().filter(|l| !l.is_empty()) {
        let a: serde_json::Value = serde_json::from_str(a).unwrap();
        for grants in a["containers"].as_object().unwrap().values() {
            for g in grants.as_array().unwrap() {
                *per_card.entry(g["uuid"].as_str().unwrap().to_owned()).or_default() +=
                    g["percent"].as_u64().unwrap();
            }
        }
    }
    assert!(per_card.values().all(|p| *p <= 100), "{per_card:?}");
    nodes.down();
}
