//! The local cluster of `hack/cluster.sh` as the end-to-end tests drive it: real kubelets on
//! containerd in one network namespace, nano-gpu installed as shipped. Start and stop it, restart
//! its parts, reach into its network, read what the kubelets and the containers saw, create pods and
//! wait for them.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, LogParams, PostParams};
use nano_gpu_proto::kubelet::podresources::ListPodResourcesRequest;
use nano_gpu_proto::kubelet::podresources::pod_resources_lister_client::PodResourcesListerClient;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The namespace the tests' pods live in.
pub const NS: &str = "e2e";

/// The GPU workload image (`deploy/examples/` names it; the harness makes it: busybox and an
/// `nvidia-smi -L` on the container's NVML).
pub const CUDA_IMAGE: &str = "nvidia/cuda:12.4.1-base-ubuntu22.04";

/// What a GPU container of the tests runs: its cards as its NVML shows them, its GPU environment,
/// then a marker, then it sleeps.
const REPORT: &str = "nvidia-smi -L; env | grep -E '^(NVIDIA_VISIBLE_DEVICES|NANO_GPU_[A-Z_]+|ALIYUN_COM_[A-Z_]+)=' \
                      | sort; for d in /var/run/nvidia-container-devices/*; do [ -e \"$d\" ] && echo \"devmount ${d##*/}\"; done; \
                      echo reported; ";

/// The running cluster; taken down (every process, mount, cgroup, namespace) when dropped.
pub struct Cluster {
    dir: PathBuf,
    /// What `hack/cluster.sh up` wrote to `cluster.env`.
    pub env: HashMap<String, String>,
}

/// `hack/cluster.sh ARGS` with the binaries of this test build: nano-gpu-allocator and -agent beside
/// the test tools (pause, netns-forward, nvidia-runtime-standin, nvidia-smi), and the fake NVML.
fn script(args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../hack/cluster.sh"))
        .args(args)
        .env("NANO_GPU_BIN", crate::workspace_binary("pause").parent().unwrap())
        .env("NANO_GPU_FAKE_NVML", crate::fake_nvml());
    cmd
}

impl Cluster {
    /// `nodes` real nodes with nano-gpu installed (`hack/cluster.sh up`), in a fresh directory named
    /// after `name` (tests side by side each have their own cluster).
    pub fn up(name: &str, nodes: u32) -> Cluster {
        Cluster::start(name, nodes, &[])
    }

    /// [`Cluster::up`] with more kube-apiserver flags (`hack/cluster.sh up --apiserver-arg`).
    pub fn up_with_apiserver_args(name: &str, nodes: u32, args: &[&str]) -> Cluster {
        let flags: Vec<&str> = args.iter().flat_map(|a| ["--apiserver-arg", a]).collect();
        Cluster::start(name, nodes, &flags)
    }

    /// [`Cluster::up`] whose last `containerd2` nodes run containerd 2 with CDI
    /// (`hack/cluster.sh up --containerd2`).
    pub fn up_with_containerd2(name: &str, nodes: u32, containerd2: u32) -> Cluster {
        let m = containerd2.to_string();
        Cluster::start(name, nodes, &["--containerd2", &m])
    }

    /// [`Cluster::up`] whose GPU runtime is the RuntimeClass `nvidia`, each node's default runtime
    /// plain runc (`hack/cluster.sh up --runtime-class`).
    pub fn up_with_runtime_class(name: &str, nodes: u32) -> Cluster {
        Cluster::start(name, nodes, &["--runtime-class"])
    }

    /// [`Cluster::up_with_containerd2`] with the component `dra`: the agents serve DRA where the
    /// runtime has CDI (`hack/cluster.sh up --containerd2 M --dra`).
    pub fn up_with_dra(name: &str, nodes: u32, containerd2: u32) -> Cluster {
        let m = containerd2.to_string();
        Cluster::start(name, nodes, &["--containerd2", &m, "--dra"])
    }

    /// [`Cluster::up`] with nano-gpu installed in `namespace` instead of `nano-gpu-system` (the
    /// overlay's `namespace:`, `hack/cluster.sh up --namespace`).
    pub fn up_in_namespace(name: &str, nodes: u32, namespace: &str) -> Cluster {
        Cluster::start(name, nodes, &["--namespace", namespace])
    }

    /// [`Cluster::up_in_namespace`] with the component `network-policies` too, as an operator
    /// hosting tenants installs it (`hack/cluster.sh up --network-policies`): the API server takes
    /// the policies, but nothing on these nodes enforces them.
    pub fn up_for_tenants(name: &str, nodes: u32, namespace: &str) -> Cluster {
        Cluster::start(name, nodes, &["--namespace", namespace, "--network-policies"])
    }

    /// The namespace nano-gpu is installed in.
    pub fn namespace(&self) -> &str {
        self.env.get("NAMESPACE").map_or(nano_gpu_proto::install::NAMESPACE, String::as_str)
    }

    /// `nodes` real nodes without nano-gpu (`hack/cluster.sh up --bare`).
    pub fn bare(name: &str, nodes: u32) -> Cluster {
        Cluster::start(name, nodes, &["--bare"])
    }

    fn start(name: &str, nodes: u32, flags: &[&str]) -> Cluster {
        let dir = std::env::temp_dir().join(format!("nano-gpu-{name}-{}", std::process::id()));
        let mut args = vec!["up", dir.to_str().unwrap(), "--nodes"];
        let n = nodes.to_string();
        args.push(&n);
        args.extend(flags);
        let status = script(&args).status().unwrap();
        // From here on, a failure takes down what was started.
        let mut cluster = Cluster { dir, env: HashMap::new() };
        assert!(status.success(), "hack/cluster.sh up failed; logs in {}", cluster.dir.display());
        cluster.env = crate::read_env(&cluster.dir.join("cluster.env"));
        cluster
    }

    /// nano-gpu installed on the cluster (`hack/cluster.sh install`): this checkout's version, or
    /// (`from`) the one `hack/previous-build.sh` laid out in that directory. Over a running install,
    /// this is an upgrade or a rollback: the overlay pointed at the other version, applied.
    pub fn install(&self, from: Option<&Path>) {
        let mut cmd = script(&["install", self.dir.to_str().unwrap()]);
        if let Some(from) = from {
            cmd.env("NANO_GPU_INSTALL_FROM", from);
        }
        assert!(
            cmd.status().unwrap().success(),
            "hack/cluster.sh install failed; logs in {}",
            self.dir.display()
        );
    }

    /// `kubectl nano-gpu ARGS` as a user runs it: kubectl finds the plugin (`kubectl-nano_gpu`, built
    /// beside this test) on PATH, the kubeconfig comes from KUBECONFIG.
    pub fn kubectl_plugin(&self, args: &[&str]) -> Output {
        let plugin = crate::workspace_binary("kubectl-nano_gpu");
        let path = format!("{}:{}", plugin.parent().unwrap().display(), std::env::var("PATH").unwrap());
        Command::new(Path::new(&self.env["K8S_BIN"]).join("kubectl"))
            .arg("nano-gpu")
            .args(args)
            .env("PATH", path)
            .env("KUBECONFIG", &self.env["ADMIN_KUBECONFIG"])
            .output()
            .unwrap()
    }

    /// A file of the cluster's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `argv`, run in `node`'s mount namespace, where that node's kubelet mounted its pods' volumes (a
    /// memory-backed emptyDir is a tmpfs there, and an empty directory seen from this machine's).
    pub fn on_node(&self, node: &str, argv: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount={}", self.dir.join("nodes").join(node).join("mntns").display()));
        cmd.arg("--").args(argv);
        cmd
    }

    /// The text of `file` as `node` sees it ([`Cluster::on_node`]), or why it cannot be read.
    pub fn read_on_node(&self, node: &str, file: &str) -> Result<String, String> {
        let out = self.on_node(node, &["cat", file]).output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// An admin client of the cluster's API server.
    pub async fn client(&self) -> kube::Client {
        nano_gpu_runtime::connect(Some(Path::new(&self.env["ADMIN_KUBECONFIG"]))).await.unwrap()
    }

    /// kubectl as the cluster's admin.
    pub fn kubectl_cmd(&self, args: &[&str]) -> Command {
        self.kubectl_with(Path::new(&self.env["ADMIN_KUBECONFIG"]), args)
    }

    /// kubectl with `kubeconfig`.
    fn kubectl_with(&self, kubeconfig: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(Path::new(&self.env["K8S_BIN"]).join("kubectl"));
        cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
        cmd
    }

    /// kubectl's output, whatever its exit.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_cmd(args).output().unwrap()
    }

    /// kubectl's stdout; panics with its stderr when it fails.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// A kubeconfig `<name>.kubeconfig` for the cluster that authenticates with `token`.
    pub fn token_kubeconfig(&self, name: &str, token: &str) -> PathBuf {
        let view = self.ok(&["config", "view", "--raw", "--minify", "--flatten", "-o", "json"]);
        let mut config: Value = serde_json::from_str(&view).unwrap();
        config["users"][0]["user"] = json!({ "token": token.trim() });
        let path = self.path(&format!("{name}.kubeconfig"));
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    /// kubectl's output with `kubeconfig` (a [`Cluster::token_kubeconfig`]), whatever its exit.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        self.kubectl_with(kubeconfig, args).output().unwrap()
    }

    /// `kubectl apply -f -` of `manifest` (YAML or JSON); whether it succeeded.
    pub fn apply(&self, manifest: &str) -> bool {
        let mut child = self.kubectl_cmd(&["apply", "-f", "-"]).stdin(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(manifest.as_bytes()).unwrap();
        child.wait().unwrap().success()
    }

    /// GET (or POST `data` to) `url` from inside the cluster's network: the status code (0 when nothing
    /// answered) and the body. `extra` goes to curl as is.
    pub fn curl(&self, url: &str, data: Option<&str>, extra: &[&str]) -> (u16, String) {
        curl_in(&self.env["NETNS"], url, data, extra)
    }

    /// The allocator replica that decides: the holder of the allocator's Lease, if any (None too when
    /// the API server does not answer within 10 s).
    pub fn allocator_leader(&self) -> Option<String> {
        let path = "jsonpath={.spec.holderIdentity}";
        let args = [
            "--request-timeout=10s",
            "get",
            "lease",
            "nano-gpu-allocator",
            "-n",
            self.namespace(),
            "-o",
            path,
        ];
        let out = self.kubectl(&args);
        let holder = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        Some(holder).filter(|h| out.status.success() && !h.is_empty())
    }

    /// `kubectl port-forward` of a free local port to `port` of pod `pod` in `namespace`, as an operator
    /// reaches a pod's loopback; stopped when the answer is dropped.
    pub fn port_forward(&self, namespace: &str, pod: &str, port: u16) -> PortForward {
        let mut child = self
            .kubectl_cmd(&["port-forward", "-n", namespace, &format!("pod/{pod}"), &format!(":{port}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        // "Forwarding from 127.0.0.1:PORT -> 8890"
        std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
        let local = line
            .strip_prefix("Forwarding from 127.0.0.1:")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("kubectl port-forward said {line:?}"));
        // The rest of its stdout (one line per connection) is drained so it never blocks.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        PortForward { child, port: local }
    }

    /// [`Cluster::curl`] from inside the network namespace of the allocator pod `pod` (its loopback
    /// is where kube-scheduler calls the extender, and where `kubectl port-forward` leads). Code 0
    /// when nothing answered, as while the pod's container is (re)starting and its status names none.
    pub fn curl_in_allocator(&self, pod: &str, url: &str, data: Option<&str>) -> (u16, String) {
        let (node, id) = match self.try_container(self.namespace(), pod, "allocator") {
            Ok(found) => found,
            Err(e) => return (0, format!("no allocator container of {pod} yet: {e}")),
        };
        let out = script(&["ctr", self.dir.to_str().unwrap(), &node, "tasks", "ps", &id]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let pid = text.lines().nth(1).and_then(|l| l.split_whitespace().next()).unwrap_or_default();
        if pid.is_empty() {
            return (0, format!("no process of {pod}'s allocator: {text}"));
        }
        curl_in(&format!("/proc/{pid}/ns/net"), url, data, &[])
    }

    /// The allocator's view (`/inspect` of the replica that decides, on its loopback: the operators'
    /// port, or the extender's on a version from before it).
    /// (Right after a handover the Lease may name a replica that is still starting: tried for 30 s.)
    pub fn inspect(&self) -> Value {
        let start = Instant::now();
        loop {
            let leader = self.allocator_leader();
            let (code, body) = match &leader {
                None => (0, "no replica holds the Lease".to_owned()),
                Some(pod) => match self.curl_in_allocator(pod, "http://127.0.0.1:8890/inspect", None) {
                    // An allocator from before `--operator-listen` (the upgrade suite's previous
                    // version) serves it on the extender's port.
                    (0, _) => self.curl_in_allocator(pod, "http://127.0.0.1:8888/inspect", None),
                    answer => answer,
                },
            };
            if code == 200 {
                return serde_json::from_str(&body).unwrap();
            }
            assert!(start.elapsed() < Duration::from_secs(30), "/inspect of {leader:?}: {code} {body}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// kill -9 of the node's `kubelet` or `containerd`, then started again (`hack/cluster.sh restart`).
    pub fn restart(&self, what: &str, node: &str) {
        let status = script(&["restart", self.dir.to_str().unwrap(), what, node]).status().unwrap();
        assert!(status.success(), "restarting {what} on {node}");
    }

    /// kill -9 of a control-plane program (`etcd`, `kube-apiserver`, ...), started again `seconds`
    /// later (`hack/cluster.sh crash`), in the background: wait on the child for it to be back.
    pub fn crash(&self, what: &str, seconds: u32) -> std::process::Child {
        script(&["crash", self.dir.to_str().unwrap(), what, &seconds.to_string()]).spawn().unwrap()
    }

    /// SIGSTOP to a control-plane program, SIGCONT `seconds` later (`hack/cluster.sh freeze`: it hangs,
    /// its connections open and unanswered), in the background.
    pub fn freeze(&self, what: &str, seconds: u32) -> std::process::Child {
        script(&["freeze", self.dir.to_str().unwrap(), what, &seconds.to_string()]).spawn().unwrap()
    }

    /// SIGKILL to the processes of one container of a pod, through its node's containerd (a crash;
    /// the kubelet restarts the container).
    pub fn kill_container(&self, namespace: &str, pod: &str, container: &str) {
        self.signal_container(namespace, pod, container, "SIGKILL");
    }

    /// SIGKILL to the processes of one container of a pod that its first process started (the
    /// agent under its keeper: a crash the container itself lives through); how many were killed
    /// (an error while the pod's status names no such container).
    pub fn kill_children(&self, namespace: &str, pod: &str, container: &str) -> Result<usize, String> {
        let (_, id) = self.try_container(namespace, pod, container)?;
        // The container's processes: those in its cgroup (named after its containerd ID).
        let in_container =
            |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(&id));
        let parents: std::collections::BTreeMap<u32, u32> = crate::pids()
            .into_iter()
            .filter(|pid| in_container(*pid))
            .filter_map(|pid| Some((pid, crate::parent_pid(pid)?)))
            .collect();
        let children: Vec<u32> =
            parents.iter().filter(|(_, ppid)| parents.contains_key(ppid)).map(|(pid, _)| *pid).collect();
        for pid in &children {
            let killed = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            if !killed.is_ok_and(|k| k.success()) {
                return Err(format!("kill -KILL {pid} ({namespace}/{pod}/{container})"));
            }
        }
        Ok(children.len())
    }

    /// Sends `signal` (`SIGSTOP`, `SIGCONT`, ...) to the processes of one container of a pod, through
    /// its node's containerd.
    pub fn signal_container(&self, namespace: &str, pod: &str, container: &str, signal: &str) {
        self.try_signal_container(namespace, pod, container, signal).unwrap();
    }

    /// [`Cluster::signal_container`], saying what went wrong instead of failing the test (a pod that
    /// is going away, an API server that is).
    pub fn try_signal_container(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        signal: &str,
    ) -> Result<(), String> {
        let (node, id) = self.try_container(namespace, pod, container)?;
        let kill = ["ctr", self.dir.to_str().unwrap(), &node, "tasks", "kill", "--all", "-s", signal, &id];
        let status = script(&kill).status().unwrap();
        status
            .success()
            .then_some(())
            .ok_or_else(|| format!("{signal} to {namespace}/{pod}/{container} on {node}"))
    }

    /// The node and containerd ID of one container of a pod (an error while its status names none).
    fn try_container(&self, namespace: &str, pod: &str, container: &str) -> Result<(String, String), String> {
        let path = format!(
            "jsonpath={{.spec.nodeName}} {{.status.containerStatuses[?(@.name==\"{container}\")].containerID}}"
        );
        let out = self.kubectl(&["get", "pod", pod, "-n", namespace, "-o", &path]);
        let out = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let (node, id) =
            out.split_once(' ').ok_or_else(|| format!("{namespace}/{pod}/{container}: {out:?}"))?;
        let id = id.trim().strip_prefix("containerd://").ok_or_else(|| format!("container id {id:?}"))?;
        Ok((node.to_owned(), id.to_owned()))
    }

    /// The device IDs the node's kubelet gave each container, from its pod-resources API: per
    /// `namespace/pod/container`, per resource.
    pub async fn kubelet_devices(&self, node: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
        let socket = self.path(&format!("nodes/{node}/var/lib/kubelet/pod-resources/kubelet.sock"));
        // A kubelet that just (re)started may not serve yet.
        let start = Instant::now();
        let list = loop {
            let answer = match nano_gpu_runtime::unix_channel(socket.clone()).await {
                Ok(channel) => PodResourcesListerClient::new(channel)
                    .list(ListPodResourcesRequest::default())
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match answer {
                Ok(list) => break list.into_inner(),
                Err(e) => assert!(start.elapsed() < Duration::from_secs(60), "{node}'s pod-resources: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let mut out = BTreeMap::new();
        for p in list.pod_resources {
            for c in p.containers {
                let mut per: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
                for d in c.devices {
                    per.entry(d.resource_name).or_default().extend(d.device_ids);
                }
                out.insert(format!("{}/{}/{}", p.namespace, p.name, c.name), per);
            }
        }
        out
    }

    /// Starts a program on this machine as a part of the cluster, `name`: logging to `<name>.log`,
    /// with `<name>.pid`, stopped by `down` when its command line names the cluster's directory.
    pub fn launch(&self, name: &str, argv: &[String]) {
        let log = std::fs::File::create(self.path(&format!("{name}.log"))).unwrap();
        let child = Command::new("setsid")
            .args(argv)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        std::fs::write(self.path(&format!("{name}.pid")), child.id().to_string()).unwrap();
        let mut child = child;
        std::thread::spawn(move || child.wait());
    }

    /// A second way to the API server, on `port` of its address inside the cluster, with faults set
    /// on demand (`netns-forward --faults`); [`ApiProxy::route`] sends workloads' API calls through it.
    pub fn api_proxy(&self, port: u16) -> ApiProxy {
        let faults = self.path("api-proxy.faults");
        std::fs::write(&faults, "pass\n").unwrap();
        let (netns, host) = (&self.env["NETNS"], self.env["CP_IP"].clone());
        let argv = [
            "nsenter".to_owned(),
            format!("--net={netns}"),
            crate::workspace_binary("netns-forward").to_str().unwrap().to_owned(),
            "--netns".to_owned(),
            netns.clone(),
            "--faults".to_owned(),
            faults.to_str().unwrap().to_owned(),
            format!("{host}:{port}={host}:6443"),
        ];
        self.launch("api-proxy", &argv);
        ApiProxy { faults, host, port }
    }

    /// SIGKILL to a program [`Cluster::launch`] started.
    pub fn kill(&self, name: &str) {
        let pid = std::fs::read_to_string(self.path(&format!("{name}.pid"))).unwrap();
        assert!(Command::new("kill").args(["-9", pid.trim()]).status().unwrap().success());
    }

    fn down_status(&self) -> std::process::ExitStatus {
        script(&["down", self.dir.to_str().unwrap()]).status().unwrap()
    }

    /// The Prometheus text of `node`'s agent (`:9401/metrics`, from the cluster's network); empty
    /// while it has none.
    pub async fn agent_metrics(&self, system: &Api<Pod>, node: &str) -> String {
        let selector = ListParams::default()
            .labels("app.kubernetes.io/name=nano-gpu-agent")
            .fields(&format!("spec.nodeName={node}"));
        let Some(agent) = system.list(&selector).await.unwrap().items.into_iter().next() else {
            return String::new();
        };
        let Some(ip) = agent.status.and_then(|s| s.pod_ip) else { return String::new() };
        self.curl(&format!("http://{ip}:9401/metrics"), None, &[]).1
    }

    /// Takes the cluster down, asserting it went.
    pub fn down(&self) {
        assert!(self.down_status().success(), "hack/cluster.sh down failed");
    }
}

/// A running `kubectl port-forward` ([`Cluster::port_forward`]).
pub struct PortForward {
    child: std::process::Child,
    /// The local port (on 127.0.0.1).
    pub port: u16,
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy in front of the API server ([`Cluster::api_proxy`]): the fault suite's slow,
/// unreachable or reset API for the workloads routed through it, while the rest of the cluster (the
/// kubelets, the control plane, the test) reaches the API server as before.
#[derive(Clone)]
pub struct ApiProxy {
    faults: PathBuf,
    host: String,
    port: u16,
}

impl ApiProxy {
    /// Sends the API calls of `workloads` (`deployment/NAME`, `daemonset/NAME`) in `namespace`
    /// through the proxy: their in-cluster config reads `KUBERNETES_SERVICE_HOST` and `_PORT`, so
    /// both are set on every container; waits for the rollouts this starts.
    pub fn route(&self, cluster: &Cluster, namespace: &str, workloads: &[&str]) {
        let (host, port) = (
            format!("KUBERNETES_SERVICE_HOST={}", self.host),
            format!("KUBERNETES_SERVICE_PORT={}", self.port),
        );
        let mut args = vec!["set", "env", "-n", namespace];
        args.extend(workloads);
        args.extend([host.as_str(), port.as_str()]);
        cluster.ok(&args);
        for w in workloads {
            cluster.ok(&["rollout", "status", "-n", namespace, w, "--timeout=300s"]);
        }
    }

    /// Puts `fault` in force (`pass`, `delay MS` or `cut`): written whole and renamed, so the proxy
    /// never reads half of it, then given the 100 ms the proxy takes to read it again (and some).
    pub fn set(&self, fault: &str) {
        let next = self.faults.with_extension("next");
        std::fs::write(&next, format!("{fault}\n")).unwrap();
        std::fs::rename(&next, &self.faults).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
}

impl Cluster {
    /// After a failure, before the cluster goes (and the containers' logs with it): every pod, the
    /// newest events, and each nano-gpu container's log, saved under `failure/` in the cluster's
    /// directory; the pods, the events and the tail of each log also go to stderr, which is all a CI
    /// run keeps. Every kubectl call is bounded: the API may be the thing that failed.
    fn keep_evidence(&self) {
        // A cluster whose `up` failed has no API server to ask (its logs are in its directory); a
        // panic here, in a drop during a panic, would abort every test of the binary and leak their
        // clusters.
        if !self.env.contains_key("ADMIN_KUBECONFIG") || !self.env.contains_key("K8S_BIN") {
            return;
        }
        let dir = self.path("failure");
        let _ = std::fs::create_dir_all(&dir);
        let kubectl = |args: &[&str]| {
            let mut all = vec!["--request-timeout=10s"];
            all.extend(args);
            let out = self.kubectl(&all);
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
        };
        let pods = kubectl(&["get", "pods", "-A", "-o", "wide"]);
        let events = kubectl(&["get", "events", "-A", "--sort-by=.lastTimestamp"]);
        let tail = |text: &str, n: usize| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        // The local kubelets have no cluster DNS: their MissingClusterDNS warnings say nothing here.
        let telling: String =
            events.lines().filter(|l| !l.contains("MissingClusterDNS")).map(|l| format!("{l}\n")).collect();
        // What a CI log shows first, as it keeps only the head and the tail of a failure's output: the
        // system's pods whole, the tests' pods counted by namespace and status; then the Leases.
        let ns = self.namespace();
        let (mut ours, mut counts) = (String::new(), BTreeMap::<(String, String), usize>::new());
        for (i, l) in pods.lines().enumerate() {
            let fields: Vec<&str> = l.split_whitespace().collect();
            if i == 0 || fields.first().is_some_and(|n| *n == ns || *n == "kube-system") {
                ours.push_str(l);
                ours.push('\n');
            } else if let [namespace, _, _, status, ..] = fields[..] {
                *counts.entry((namespace.to_owned(), status.to_owned())).or_default() += 1;
            }
        }
        let counted: String = counts.iter().map(|((n, s), c)| format!("{n}: {c} {s}\n")).collect();
        let leases = kubectl(&["get", "leases", "-n", ns]);
        eprintln!(
            "--- pods of {ns} and kube-system\n{ours}--- other pods\n{counted}--- leases of {ns}\n{leases}\
             --- newest events\n{}",
            tail(&telling, 40)
        );
        let _ = std::fs::write(dir.join("pods.txt"), &pods);
        let _ = std::fs::write(dir.join("events.txt"), &events);
        let names = kubectl(&["get", "pods", "-n", self.namespace(), "-o", "name"]);
        for pod in names.lines().filter_map(|l| l.strip_prefix("pod/")) {
            let log = kubectl(&["logs", "-n", self.namespace(), pod, "--all-containers", "--prefix"]);
            let _ = std::fs::write(dir.join(format!("{pod}.log")), &log);
            eprintln!("--- {pod}, last lines\n{}", tail(&log, 30));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.keep_evidence();
            if std::env::var_os("NANO_GPU_E2E_KEEP").is_some() {
                eprintln!("NANO_GPU_E2E_KEEP: the cluster in {} keeps running", self.dir.display());
                return;
            }
            // Logs stay after a failure.
            let _ = self.down_status();
        } else {
            let _ = self.down_status();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What one GPU container reported (see [`gpu_pod`]): its GPU environment, and the UUIDs of the cards
/// its NVML shows.
#[derive(Debug, Default)]
pub struct Report {
    /// `NVIDIA_VISIBLE_DEVICES`, `NANO_GPU_*` and `ALIYUN_COM_*` as the container saw them.
    pub env: BTreeMap<String, String>,
    /// The UUIDs `nvidia-smi -L` listed.
    pub cards: BTreeSet<String>,
    /// The device list the container was handed as mounts (`/var/run/nvidia-container-devices/*`).
    pub mounts: BTreeSet<String>,
}

/// Reads what a container of [`gpu_pod`] printed, from its log (waits until it printed all of it).
pub async fn report(pods: &Api<Pod>, pod: &str, container: &str) -> Report {
    let params = LogParams { container: Some(container.into()), ..Default::default() };
    let start = Instant::now();
    let log = loop {
        let log = pods.logs(pod, &params).await.unwrap_or_default();
        if log.lines().any(|l| l == "reported") {
            break log;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{pod}/{container} did not report: {log}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let mut report = Report::default();
    for line in log.lines() {
        if let Some(uuid) = line.strip_prefix("GPU ").and_then(|l| l.split("(UUID: ").nth(1)) {
            report.cards.insert(uuid.trim_end_matches(')').to_owned());
        } else if let Some(device) = line.strip_prefix("devmount ") {
            report.mounts.insert(device.to_owned());
        } else if let Some((k, v)) = line.split_once('=') {
            report.env.insert(k.to_owned(), v.to_owned());
        }
    }
    report
}

/// A pod in [`NS`] with one container of the GPU workload image per `(name, limits)`, each reporting
/// its cards and environment (see [`report`]), and `annotations`.
pub fn gpu_pod(name: &str, containers: &[(&str, &[(&str, &str)])], annotations: Value) -> Pod {
    gpu_pod_then(name, containers, annotations, "exec sleep 86400")
}

/// A pod of one container asking `percent`, running `then` (a shell command, e.g. `exec gpu-use …`)
/// after it reported.
pub fn percent_pod_then(name: &str, percent: u32, then: &str) -> Pod {
    gpu_pod_then(name, &[("c", &[("nano-gpu/gpu-percent", &percent.to_string())])], json!({}), then)
}

fn gpu_pod_then(name: &str, containers: &[(&str, &[(&str, &str)])], annotations: Value, then: &str) -> Pod {
    let command = format!("{REPORT}{then}");
    let containers: Vec<Value> = containers
        .iter()
        .map(|(c, limits)| {
            let limits: serde_json::Map<String, Value> =
                limits.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect();
            json!({"name": c, "image": CUDA_IMAGE, "imagePullPolicy": "Never",
                   "command": ["sh", "-c", command], "resources": {"limits": limits}})
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
    gpu_pod(name, &[("c", &[("nano-gpu/gpu-percent", &percent.to_string())])], json!({}))
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

/// Creates a pod; while no allocator serves its webhook (failurePolicy Fail) the creation is refused,
/// and retried as a controller would.
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

/// curl in the network namespace `net` (a path): the status code (0 when nothing answered) and the
/// body.
fn curl_in(net: &str, url: &str, data: Option<&str>, extra: &[&str]) -> (u16, String) {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={net}")).args(["curl", "-s", "-m", "10", "-o", "-", "-w", "\n%{http_code}"]);
    if let Some(d) = data {
        cmd.args(["-X", "POST", "-H", "Content-Type: application/json", "--data", d]);
    }
    let out = cmd.args(extra).arg(url).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The MPS daemons' host directories on this machine (`/run/nano-gpu/mps`, a hostPath of the MPS
/// pods of every node), as the agents read them.
pub fn mps_layout() -> nano_gpu_agent::node::enforce::mps::Layout {
    nano_gpu_agent::node::enforce::mps::Layout::new("/run/nano-gpu/mps", "/proc")
}

/// The pipe directory an agent hands the MPS shares of card `uuid`: the one its supervisor named
/// (the emptyDir `pipe-N` of the daemons' pod, a tmpfs only in the node's mount namespace), else the
/// host directory `<root>/<uuid>/pipe`.
pub fn mps_client_pipe(uuid: &str) -> std::path::PathBuf {
    let layout = mps_layout();
    layout.client_pipe(uuid, &layout.shm(uuid))
}

/// Removes the MPS daemons' directories of `node`'s cards, which outlive a cluster on the host
/// (`/run/nano-gpu/mps`, a hostPath): another cluster's node of that name has cards of the same
/// UUIDs. And the supervisor's `shm-source`, which names its pod's `/dev/shm`: `/run/nano-gpu` is
/// the machine's, not a node's, so one node at a time may run MPS on this machine.
pub fn clear_mps_dirs(node: &str) {
    let root = mps_layout().root;
    let _ = std::fs::remove_file(root.join(nano_gpu_agent::node::enforce::mps::SHM_SOURCE));
    let Ok(entries) = std::fs::read_dir(&root) else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&format!("GPU-{node}-")) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
