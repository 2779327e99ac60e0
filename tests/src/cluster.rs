//! The local cluster of `hack/cluster.sh` as the end-to-end tests drive it: start and stop it, kill
//! and restart its components, create pods and wait for them.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The namespace the tests' pods live in.
pub const NS: &str = "e2e";

/// The running cluster; stopped (every process) when dropped.
pub struct Cluster {
    dir: PathBuf,
    /// What `hack/cluster.sh up` wrote to `cluster.env`.
    pub env: HashMap<String, String>,
}

impl Cluster {
    /// Starts a cluster of `nodes` simulated GPU nodes (`hack/cluster.sh up`) in a fresh directory.
    pub fn up(nodes: u32) -> Cluster {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = std::env::temp_dir().join(format!("nano-gpu-e2e-{}", std::process::id()));
        let bin = crate::workspace_binary("nano-gpu-allocator").parent().unwrap().to_path_buf();
        let status = Command::new("bash")
            .arg(root.join("hack/cluster.sh"))
            .args(["up", dir.to_str().unwrap(), "--nodes", &nodes.to_string()])
            .env("NANO_GPU_BIN", &bin)
            .env("NANO_GPU_FAKE_NVML", crate::fake_nvml())
            .status()
            .unwrap();
        // From here on, a failure stops what was started.
        let mut cluster = Cluster { dir: dir.clone(), env: HashMap::new() };
        assert!(status.success(), "hack/cluster.sh up failed; logs in {}", dir.display());
        cluster.env = crate::read_env(&dir.join("cluster.env"));
        cluster
    }

    /// A file of the cluster's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// What the kubelet stand-in of `node` recorded: pods, their containers' env and device IDs.
    pub fn standin(&self, node: &str) -> Value {
        let file = self.dir.join(format!("nodes/{node}/standin-state.json"));
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap_or_default()).unwrap_or(Value::Null)
    }

    /// The allocator's extender URL.
    pub fn extender(&self) -> &str {
        &self.env["EXTENDER_URL"]
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() && std::env::var_os("NANO_GPU_E2E_KEEP").is_some() {
            eprintln!("NANO_GPU_E2E_KEEP: the cluster in {} keeps running", self.dir.display());
            return;
        }
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let _ = Command::new("bash").arg(root.join("hack/cluster.sh")).arg("down").arg(&self.dir).status();
        // Logs stay after a failure; a passing run leaves nothing behind.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// How a component of the cluster was started, to start it again (see [`Cluster::stop`]).
pub struct Stopped {
    name: String,
    argv: Vec<String>,
    environ: Vec<(String, String)>,
}

impl Cluster {
    /// Kills the component `name` (its `<name>.pid`) with SIGKILL, and says how it was started.
    pub fn stop(&self, name: &str) -> Stopped {
        let pid: i32 =
            std::fs::read_to_string(self.path(&format!("{name}.pid"))).unwrap().trim().parse().unwrap();
        let split = |file: &str| -> Vec<String> {
            let bytes = std::fs::read(format!("/proc/{pid}/{file}")).unwrap();
            bytes
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let (argv, environ) = (split("cmdline"), split("environ"));
        let environ =
            environ.iter().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect();
        assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
        while Path::new(&format!("/proc/{pid}/stat")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z")
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        Stopped { name: name.into(), argv, environ }
    }

    /// Starts a stopped component again exactly as it was (arguments, environment, log file, pid file).
    pub fn start(&self, stopped: &Stopped) {
        self.launch(&stopped.name, &stopped.argv, &stopped.environ);
    }

    /// Starts a process as a component of the cluster `name`: in its own session, logging to
    /// `<name>.log`, with `<name>.pid`, so `hack/cluster.sh down` stops it. `environ` is its whole
    /// environment.
    pub fn launch(&self, name: &str, argv: &[String], environ: &[(String, String)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path(&format!("{name}.log")))
            .unwrap();
        let child = Command::new("setsid")
            .args(argv)
            .env_clear()
            .envs(environ.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        std::fs::write(self.path(&format!("{name}.pid")), child.id().to_string()).unwrap();
        // `hack/cluster.sh down` stops it through the pid file; this thread reaps it then.
        let mut child = child;
        std::thread::spawn(move || child.wait());
    }
}

/// Kills a component of the cluster with SIGKILL and, with `restart`, starts it again exactly as it was.
pub fn kill_and_restart(cluster: &Cluster, name: &str, restart: bool) {
    let stopped = cluster.stop(name);
    if restart {
        cluster.start(&stopped);
    }
}

/// GET with curl: the status code (0 when nothing answered) and the body.
pub fn http_get(url: &str) -> (u16, String) {
    let out = Command::new("curl").args(["-s", "-o", "-", "-w", "\n%{http_code}", url]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// A pod in [`NS`] with one pause container per `(name, limits)`, and `annotations`.
pub fn pod(name: &str, containers: &[(&str, &[(&str, &str)])], annotations: Value) -> Pod {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(c, limits)| {
            let limits: serde_json::Map<String, Value> =
                limits.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect();
            json!({"name": c, "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}})
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 0}}))
    .unwrap()
}

/// A pod of one container asking `percent` of `nano-gpu/gpu-percent`.
pub fn percent_pod(name: &str, percent: u32) -> Pod {
    pod(name, &[("c", &[("nano-gpu/gpu-percent", &percent.to_string())])], json!({}))
}

/// Polls `check` every 250 ms until it holds; fails the test after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A pod's phase (empty when it has none yet).
pub fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

/// Waits until every pod of `names` is Running.
pub async fn wait_running(pods: &Api<Pod>, names: &[String], limit: Duration) {
    wait_until(&format!("{} pods Running", names.len()), limit, || async {
        let list = pods.list(&ListParams::default()).await.unwrap();
        let running: BTreeSet<&str> = list
            .items
            .iter()
            .filter(|p| phase(p) == "Running")
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        names.iter().all(|n| running.contains(n.as_str()))
    })
    .await;
}

/// Creates a pod; while the allocator restarts its webhook refuses (failurePolicy Fail), and the
/// creation is retried as a controller would.
pub async fn create(pods: &Api<Pod>, pod: &Pod) -> Pod {
    let start = Instant::now();
    loop {
        match pods.create(&PostParams::default(), pod).await {
            Ok(p) => return p,
            Err(kube::Error::Api(e)) if e.message.contains("failed calling webhook") => {
                assert!(start.elapsed() < Duration::from_secs(60), "the webhook stayed down: {}", e.message);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("creating pod {:?}: {e}", pod.metadata.name),
        }
    }
}
