//! `kubectl nano-gpu uninstall`: removes nano-gpu from a cluster, with what deleting the manifests
//! cannot undo. In order:
//!
//! 1. the namespace, waiting until it is gone: its pods stop, so the agents remove their sockets and
//!    `mps-control` stops its daemons. The webhook stays meanwhile, so a GPU pod made then is refused,
//!    not placed where nano-gpu's resources are still offered;
//! 2. the objects the install makes outside its namespace ([`install::OUTSIDE`]);
//! 3. the ResourceSlices the agents published for the DRA driver, once no agent is left;
//! 4. the nodes' files: one pod per node that has nano-gpu's keys and none of its pods left, in a
//!    namespace of its own ([`CLEAN_NAMESPACE`], removed after), runs `nano-gpu-agent clean-node`
//!    (the agent's image, pulled with copies of the agents' image pull Secrets) with the host's
//!    directories mounted;
//! 5. every `nano-gpu/` label and annotation of the nodes whose files were removed (a node whose
//!    files were not keeps them, so a second run finds it again);
//! 6. an Event [`Reason::Uninstalled`] on every pod still waiting for `nano-gpu-scheduler`, which no
//!    scheduler serves any more.
//!
//! A step that fails prints why, and the others still run. Running GPU containers keep their cards
//! (the runtime gave them their devices), and pods keep their annotations, so a later install counts
//! them again. Run again, it finds nothing to do.

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, ServiceAccount};
use kube::Resource;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, LogParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use nano_gpu_proto::events::Reason;
use nano_gpu_proto::install::{self, EARLIER, KEY_PREFIX, OUTSIDE, Object, SCHEDULER_NAME};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The namespace of the per-node cleanup pods, made and removed by `uninstall`.
pub const CLEAN_NAMESPACE: &str = "nano-gpu-uninstall";

/// The agent DaemonSet, whose image runs the nodes' cleanup.
const AGENT_DAEMONSET: &str = "nano-gpu-agent";

/// `uninstall`'s arguments.
#[derive(clap::Args)]
pub struct UninstallArgs {
    /// nano-gpu's namespace.
    #[arg(long, env = "NANO_GPU_NAMESPACE", default_value = install::NAMESPACE)]
    pub namespace: String,
    /// The image of the per-node cleanup pods, which run `nano-gpu-agent clean-node`: the agent's
    /// image. Default: the agent DaemonSet's, read before it is deleted.
    #[arg(long)]
    pub image: Option<String>,
    /// A Secret the cleanup pods pull their image with, `NAMESPACE/NAME` (`NAME`: in nano-gpu's
    /// namespace), copied into their namespace; repeat for more. The agent DaemonSet's image pull
    /// Secrets, its pods' and its ServiceAccount's, are copied too while they are there.
    #[arg(long = "image-pull-secret", value_name = "[NAMESPACE/]NAME")]
    pub image_pull_secrets: Vec<String>,
    /// The kubelet's root directory on the nodes (its `--root-dir`).
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub kubelet_root: String,
    /// Seconds to wait for nano-gpu's namespace to go, and again for the nodes' cleanup.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Print what would be removed, and remove nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// The lines printed as the steps go, and how many failed.
struct Out {
    failed: usize,
}

impl Out {
    fn line(&mut self, step: &str, object: &str, result: Result<String, String>) {
        match result {
            Ok(r) => println!("{step:<10} {object:<68} {r}"),
            Err(e) => {
                self.failed += 1;
                println!("{step:<10} {object:<68} FAILED: {e}");
            }
        }
    }
}

/// A node with nano-gpu's keys: its name and the keys.
struct GpuNode {
    name: String,
    labels: Vec<String>,
    annotations: Vec<String>,
}

/// The nodes that carry any `nano-gpu/` label or annotation.
fn gpu_nodes(nodes: &[Node]) -> Vec<GpuNode> {
    let ours = |map: &Option<std::collections::BTreeMap<String, String>>| -> Vec<String> {
        map.iter().flatten().map(|(k, _)| k).filter(|k| k.starts_with(KEY_PREFIX)).cloned().collect()
    };
    nodes
        .iter()
        .map(|n| GpuNode {
            name: n.metadata.name.clone().unwrap_or_default(),
            labels: ours(&n.metadata.labels),
            annotations: ours(&n.metadata.annotations),
        })
        .filter(|n| !n.labels.is_empty() || !n.annotations.is_empty())
        .collect()
}

/// The merge patch that removes `node`'s keys.
fn keys_patch(node: &GpuNode) -> Value {
    let nulls = |keys: &[String]| -> Value { keys.iter().map(|k| (k.clone(), Value::Null)).collect() };
    json!({"metadata": {"labels": nulls(&node.labels), "annotations": nulls(&node.annotations)}})
}

/// The cleanup pod of `node`: `nano-gpu-agent clean-node` in `image` (pulled with the Secrets named
/// `pull`), the host's `/run`, the kubelet's root and `/var/run/cdi` mounted, on that node whatever
/// its taints, run once.
fn clean_pod(node: &str, image: &str, pull: &[String], kubelet_root: &str) -> Value {
    let mounts = [
        ("run", "/run", "/host/run"),
        ("kubelet", kubelet_root, "/host/kubelet"),
        ("cdi", "/var/run", "/host/var-run"),
    ];
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "clean-",
            "namespace": CLEAN_NAMESPACE,
            "labels": {"app.kubernetes.io/name": "nano-gpu-uninstall"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "tolerations": [{"operator": "Exists"}],
            "automountServiceAccountToken": false,
            "imagePullSecrets": pull.iter().map(|name| json!({"name": name})).collect::<Vec<_>>(),
            "containers": [{
                "name": "clean-node",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "args": ["clean-node", "--host-run", "/host/run", "--host-kubelet", "/host/kubelet",
                         "--host-cdi", "/host/var-run/cdi"],
                "securityContext": {"runAsUser": 0, "readOnlyRootFilesystem": true,
                                    "allowPrivilegeEscalation": false,
                                    // Root, and past the modes of what a share left in its directories.
                                    "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}},
                                "volumeMounts": mounts.iter().map(|(name, _, at)| json!({"name": name, "mountPath": at})).collect::<Vec<_>>(),
            }],
            "volumes": mounts.iter().map(|(name, path, _)| json!({"name": name, "hostPath": {"path": path, "type": "Directory"}})).collect::<Vec<_>>(),
        },
    })
}

/// What the Event on a pod left Pending for `nano-gpu-scheduler` says.
pub fn pending_note() -> String {
    format!(
        "nano-gpu was uninstalled: no scheduler serves {SCHEDULER_NAME}, which nano-gpu's webhook gave this pod, so \
         it stays Pending. Delete it; a pod made again by its controller gets the default scheduler (and must ask \
         for whatever replaces nano-gpu's resources)"
    )
}

fn api_of(client: &kube::Client, o: &Object) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(o.group, o.version, o.kind);
    let resource = ApiResource::from_gvk_with_plural(&gvk, o.plural);
    if o.namespace.is_empty() {
        Api::all_with(client.clone(), &resource)
    } else {
        Api::namespaced_with(client.clone(), o.namespace, &resource)
    }
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(a) if a.code == 404)
}

/// Deletes `o` (or, dry, says whether it is there).
async fn delete(client: &kube::Client, o: &Object, dry_run: bool) -> Result<String, String> {
    let api = api_of(client, o);
    if dry_run {
        return match api.get_opt(o.name).await {
            Ok(Some(_)) => Ok("would be deleted".into()),
            Ok(None) => Ok("not there".into()),
            Err(e) if is_not_found(&e) => Ok("not there".into()),
            Err(e) => Err(e.to_string()),
        };
    }
    match api.delete(o.name, &DeleteParams::default()).await {
        Ok(_) => Ok("deleted".into()),
        Err(e) if is_not_found(&e) => Ok("not there".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Deletes namespace `name` and waits (up to `timeout`) until it is gone.
async fn delete_namespace(client: &kube::Client, name: &str, timeout: Duration) -> Result<String, String> {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => return Ok("not there".into()),
        Err(e) => return Err(e.to_string()),
    }
    let since = Instant::now();
    loop {
        match api.get_opt(name).await {
            Ok(None) => return Ok(format!("deleted ({:.0} s)", since.elapsed().as_secs_f64())),
            Ok(Some(_)) if since.elapsed() > timeout => {
                return Err(format!(
                    "still there after {} s (look at what it still holds)",
                    timeout.as_secs()
                ));
            }
            Ok(Some(_)) => tokio::time::sleep(Duration::from_secs(1)).await,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// What the agent DaemonSet runs: its container `agent`'s image (else its first container's), and
/// the image pull Secrets its pods use (theirs, then their ServiceAccount's); `None` when the
/// DaemonSet is not there.
async fn agent_image(
    client: &kube::Client,
    namespace: &str,
) -> Result<Option<(Option<String>, Vec<String>)>> {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let ds = api.get_opt(AGENT_DAEMONSET).await.context("reading the agent DaemonSet")?;
    let Some(pod) = ds.and_then(|d| d.spec?.template.spec) else { return Ok(None) };
    let agent = pod.containers.iter().find(|c| c.name == "agent").or(pod.containers.first());
    let mut pull: Vec<String> = pod.image_pull_secrets.iter().flatten().map(|r| r.name.clone()).collect();
    let account = pod.service_account_name.as_deref().filter(|a| !a.is_empty()).unwrap_or("default");
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    // An unreadable ServiceAccount costs only its pull Secrets, not the image.
    let account = accounts.get_opt(account).await.ok().flatten();
    pull.extend(account.and_then(|a| a.image_pull_secrets).into_iter().flatten().map(|r| r.name));
    Ok(Some((agent.and_then(|c| c.image.clone()), pull)))
}

/// An image pull Secret for the cleanup pods.
#[derive(Debug, PartialEq)]
struct PullSecret {
    namespace: String,
    name: String,
    /// Named with `--image-pull-secret` (else only the agents name it).
    asked: bool,
}

/// The Secrets `--image-pull-secret` names (`NAMESPACE/NAME`, or `NAME` in `namespace`) and then the
/// agents' (`agents`, in `namespace`), each once.
fn pull_secret_names(asked: &[String], agents: &[String], namespace: &str) -> Vec<PullSecret> {
    let named = asked.iter().map(|a| match a.split_once('/') {
        Some((ns, name)) => (ns, name, true),
        None => (namespace, a.as_str(), true),
    });
    let mut secrets: Vec<PullSecret> = Vec::new();
    for (ns, name, asked) in named.chain(agents.iter().map(|a| (namespace, a.as_str(), false))) {
        if !secrets.iter().any(|s| s.namespace == ns && s.name == name) {
            secrets.push(PullSecret { namespace: ns.to_owned(), name: name.to_owned(), asked });
        }
    }
    secrets
}

/// A copy of image pull Secret `secret` for the cleanup pods' namespace: its name, type and data.
fn pull_secret_copy(secret: &Secret) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: secret.metadata.name.clone(),
            namespace: Some(CLEAN_NAMESPACE.into()),
            labels: Some([("app.kubernetes.io/name".to_owned(), "nano-gpu-uninstall".to_owned())].into()),
            ..Default::default()
        },
        type_: secret.type_.clone(),
        data: secret.data.clone(),
        ..Default::default()
    }
}

/// The ResourceSlices of nano-gpu's DRA driver: deleted (or, dry, counted); none where the API
/// server serves no DRA.
async fn resource_slices(client: &kube::Client, dry_run: bool) -> Result<String, String> {
    let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice");
    let api: Api<DynamicObject> =
        Api::all_with(client.clone(), &ApiResource::from_gvk_with_plural(&gvk, "resourceslices"));
    let driver = format!("spec.driver={}", nano_gpu_proto::dra::DRIVER);
    let slices = match api.list(&ListParams::default().fields(&driver)).await {
        Ok(list) => list.items,
        Err(e) if is_not_found(&e) => return Ok("not served by this API server".into()),
        Err(e) => return Err(e.to_string()),
    };
    if dry_run || slices.is_empty() {
        let verb = if dry_run { "would be deleted" } else { "none" };
        return Ok(if slices.is_empty() { "none".into() } else { format!("{} {verb}", slices.len()) });
    }
    for s in &slices {
        let name = s.metadata.name.clone().unwrap_or_default();
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
    Ok(format!("{} deleted", slices.len()))
}

/// The paths `clean-node` printed, as the host names them (the cleanup pod mounts the host's
/// directories under `/host`).
fn host_paths(text: &str, kubelet_root: &str) -> String {
    text.replace("/host/var-run", "/var/run")
        .replace("/host/run", "/run")
        .replace("/host/kubelet", kubelet_root)
}

/// What a pod's status says of why it did not run: its reason and message, and each container's.
fn pod_detail(pod: &Pod) -> String {
    let Some(status) = &pod.status else { return String::new() };
    let mut parts: Vec<String> = [&status.reason, &status.message].into_iter().flatten().cloned().collect();
    for c in status.container_statuses.iter().flatten() {
        let state = c.state.as_ref();
        let waiting = state.and_then(|s| s.waiting.as_ref()).map(|w| (w.reason.clone(), w.message.clone()));
        let ended = state.and_then(|s| s.terminated.as_ref()).map(|t| (t.reason.clone(), t.message.clone()));
        if let Some((reason, message)) = waiting.or(ended) {
            parts.extend(reason.into_iter().chain(message));
        }
    }
    parts.join(": ")
}

/// Makes [`CLEAN_NAMESPACE`] (Pod Security `privileged`), after an earlier one of ours has gone, with
/// copies of the image pull Secrets `pull`, and waits for its ServiceAccount `default`, without which
/// the API server refuses its pods.
async fn clean_namespace(client: &kube::Client, timeout: Duration, pull: &[Secret]) -> Result<(), String> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ours = |n: &Namespace| {
        n.metadata.labels.as_ref().and_then(|l| l.get("app.kubernetes.io/name")).map(String::as_str)
            == Some("nano-gpu-uninstall")
    };
    let since = Instant::now();
    loop {
        match namespaces.get_opt(CLEAN_NAMESPACE).await.map_err(|e| e.to_string())? {
            None => break,
            Some(n) if !ours(&n) => {
                return Err(format!(
                    "namespace {CLEAN_NAMESPACE} is there and is not nano-gpu's: rename or delete it"
                ));
            }
            Some(n) if n.metadata.deletion_timestamp.is_none() => break,
            Some(_) if since.elapsed() > timeout => {
                return Err(format!(
                    "namespace {CLEAN_NAMESPACE} of an earlier run is still going after {} s",
                    timeout.as_secs()
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
    let namespace = serde_json::from_value(json!({
        "metadata": {"name": CLEAN_NAMESPACE, "labels": {
            "app.kubernetes.io/name": "nano-gpu-uninstall",
            "pod-security.kubernetes.io/enforce": "privileged",
            "pod-security.kubernetes.io/warn": "privileged",
            "pod-security.kubernetes.io/audit": "privileged",
        }},
    }))
    .map_err(|e| e.to_string())?;
    match namespaces.create(&PostParams::default(), &namespace).await {
        Ok(_) => {}
        Err(kube::Error::Api(a)) if a.code == 409 => {}
        Err(e) => return Err(format!("creating namespace {CLEAN_NAMESPACE}: {e}")),
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), CLEAN_NAMESPACE);
    for secret in pull {
        let name = secret.metadata.name.as_deref().unwrap_or_default();
        match secrets.create(&PostParams::default(), &pull_secret_copy(secret)).await {
            Ok(_) => {}
            Err(kube::Error::Api(a)) if a.code == 409 => {}
            Err(e) => return Err(format!("copying image pull secret {name} to {CLEAN_NAMESPACE}: {e}")),
        }
    }
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), CLEAN_NAMESPACE);
    let since = Instant::now();
    while !matches!(accounts.get_opt("default").await, Ok(Some(_))) {
        if since.elapsed() > Duration::from_secs(60) {
            return Err(format!("namespace {CLEAN_NAMESPACE} got no ServiceAccount default in 60 s"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// Runs the cleanup pod of every node in `nodes` and waits for them, each for at most `--timeout`;
/// removes [`CLEAN_NAMESPACE`] after, whatever happened. The pods pull `image` with copies of the
/// Secrets `pull`. The nodes cleaned.
async fn clean_nodes(
    client: &kube::Client,
    nodes: &[String],
    image: &str,
    pull: &[Secret],
    args: &UninstallArgs,
    out: &mut Out,
) -> Vec<String> {
    let timeout = Duration::from_secs(args.timeout);
    let line = |out: &mut Out, node: &str, result| out.line("files", &format!("node/{node}"), result);
    if let Err(e) = clean_namespace(client, timeout, pull).await {
        nodes.iter().for_each(|n| line(out, n, Err(e.clone())));
        return Vec::new();
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), CLEAN_NAMESPACE);
    let names: Vec<String> = pull.iter().filter_map(|s| s.metadata.name.clone()).collect();
    let mut waiting = Vec::new();
    for node in nodes {
        let pod: Pod = match serde_json::from_value(clean_pod(node, image, &names, &args.kubelet_root)) {
            Ok(p) => p,
            Err(e) => {
                line(out, node, Err(e.to_string()));
                continue;
            }
        };
        match pods.create(&PostParams::default(), &pod).await {
            Ok(p) => waiting.push((node.clone(), p.metadata.name.unwrap_or_default())),
            Err(e) => line(out, node, Err(e.to_string())),
        }
    }
    let since = Instant::now();
    let mut cleaned = Vec::new();
    while !waiting.is_empty() {
        let mut still = Vec::new();
        for (node, name) in waiting {
            let read = pods.get_opt(&name).await;
            let phase = match &read {
                Ok(Some(p)) => p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default(),
                Ok(None) => "gone".to_owned(),
                // The API server did not answer: ask again, until the time is up.
                Err(_) => String::new(),
            };
            let said = || async {
                let log = pods.logs(&name, &LogParams::default()).await.unwrap_or_default();
                let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
                host_paths(&lines.join("; "), &args.kubelet_root)
            };
            let detail = || match &read {
                Ok(Some(p)) => pod_detail(p),
                _ => String::new(),
            };
            match phase.as_str() {
                "Succeeded" => {
                    line(out, &node, Ok(said().await));
                    cleaned.push(node);
                }
                "Failed" => {
                    let why =
                        [said().await, detail()].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>();
                    line(out, &node, Err(format!("its cleanup pod failed: {}", why.join("; "))));
                }
                "gone" => line(out, &node, Err("its cleanup pod is gone (was the node deleted?)".into())),
                _ if since.elapsed() > timeout => {
                    let why = format!(
                        "its cleanup pod {CLEAN_NAMESPACE}/{name} is still {} after {} s (is the node Ready, and has \
                         it the image {image}?) {}",
                        if phase.is_empty() { "unread" } else { &phase },
                        timeout.as_secs(),
                        detail()
                    );
                    line(out, &node, Err(why.trim_end().to_owned()));
                    // A pod on a node that does not answer would hold the namespace's deletion.
                    let _ = pods
                        .delete(&name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
                        .await;
                }
                _ => still.push((node, name)),
            }
        }
        waiting = still;
        if !waiting.is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let gone = delete_namespace(client, CLEAN_NAMESPACE, timeout).await;
    out.line("delete", &format!("namespace/{CLEAN_NAMESPACE}"), gone);
    cleaned
}

/// The nodes where pods of nano-gpu's namespace still are (its deletion waits for them: a node that
/// does not answer keeps them), or why that cannot be read.
async fn nodes_still_serving(client: &kube::Client, namespace: &str) -> Result<Vec<String>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let left = pods.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
    Ok(left.items.into_iter().filter_map(|p| p.spec?.node_name).collect())
}

/// `uninstall`: every step, one line each as it goes; the number of steps that failed.
pub async fn run(client: &kube::Client, args: &UninstallArgs) -> Result<usize> {
    let mut out = Out { failed: 0 };
    let dry_run = args.dry_run;
    let timeout = Duration::from_secs(args.timeout);
    // The image and its pull Secrets first: the agent DaemonSet goes with the namespace.
    let agents = agent_image(client, &args.namespace).await.unwrap_or(None);
    let (agent_image, agent_pull) = agents.unwrap_or_default();
    let image = args.image.clone().or(agent_image);
    println!("{:<10} {:<68} RESULT", "STEP", "OBJECT");
    let mut pull = Vec::new();
    for PullSecret { namespace: ns, name, asked } in
        pull_secret_names(&args.image_pull_secrets, &agent_pull, &args.namespace)
    {
        let object = format!("secret/{name} -n {ns}");
        let result = match Api::<Secret>::namespaced(client.clone(), &ns).get_opt(&name).await {
            Ok(Some(secret)) => {
                pull.push(secret);
                Ok(if dry_run {
                    format!("would be copied to {CLEAN_NAMESPACE} for the cleanup pods' image pull")
                } else {
                    format!("read: the cleanup pods pull with a copy of it in {CLEAN_NAMESPACE}")
                })
            }
            Ok(None) if asked => Err("not found".to_owned()),
            Ok(None) => Ok("not found: the agents name it; the cleanup pods pull without it".to_owned()),
            Err(e) => Err(format!("reading it: {e}")),
        };
        out.line("copy", &object, result);
    }

    // 1. The namespace and its pods: the agents stop (each removes its sockets) and mps-control stops
    // its daemons. The webhook stays until then, so a GPU pod made meanwhile is refused, not placed on
    // a node that still offers nano-gpu's resources.
    let namespace = format!("namespace/{}", args.namespace);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let serving = if dry_run {
        let there = namespaces.get_opt(&args.namespace).await.map_err(|e| e.to_string());
        let said = there.map(|t| {
            if t.is_some() { "would be deleted, with everything in it" } else { "not there" }.to_owned()
        });
        out.line("delete", &namespace, said);
        Ok(Vec::new())
    } else {
        match delete_namespace(client, &args.namespace, timeout).await {
            Ok(r) => {
                out.line("delete", &namespace, Ok(r));
                Ok(Vec::new())
            }
            Err(e) => {
                let serving = nodes_still_serving(client, &args.namespace).await;
                let on = match &serving {
                    Ok(nodes) => format!("its pods on {} have not stopped", nodes.join(", ")),
                    Err(e) => format!("its pods cannot be listed: {e}"),
                };
                out.line("delete", &namespace, Err(format!("{e}; {on}")));
                serving
            }
        }
    };

    // 2. The objects outside the namespace: the webhook, the admission policies, the rights; and what
    // an earlier version made there that this one no longer makes.
    for o in OUTSIDE.iter().chain(&EARLIER) {
        let object = match o.namespace {
            "" => format!("{}/{}", o.kind.to_lowercase(), o.name),
            ns => format!("{}/{} -n {ns}", o.kind.to_lowercase(), o.name),
        };
        out.line("delete", &object, delete(client, o, dry_run).await);
    }

    // 3. What the agents published for DRA, once no agent is left to publish it again.
    let slices = match &serving {
        Ok(nodes) if nodes.is_empty() => resource_slices(client, dry_run).await,
        _ => Err("skipped: agents may still run".to_owned()),
    };
    out.line("delete", "resourceslices of the driver", slices);

    // 4 and 5. The nodes' files, then their keys: listed now, after the agents stopped writing them.
    let nodes = match Api::<Node>::all(client.clone()).list(&ListParams::default()).await {
        Ok(list) => gpu_nodes(&list.items),
        Err(e) => {
            out.line("files", "every node", Err(format!("listing nodes: {e}")));
            Vec::new()
        }
    };
    let mut ready = Vec::new();
    for n in &nodes {
        let refuse = match (&serving, &image) {
            (Err(e), _) => Some(format!("skipped: {e}")),
            (Ok(busy), _) if busy.contains(&n.name) => {
                Some("skipped: nano-gpu's pods on it have not stopped (is the node Ready?)".to_owned())
            }
            (_, None) => Some(format!(
                "no image for its cleanup pod: the agent DaemonSet {}/{AGENT_DAEMONSET} is gone; name the agent image \
                 the install used with --image (one with `nano-gpu-agent clean-node`, 0.1.0 of {} or later)",
                args.namespace,
                env!("CARGO_PKG_VERSION")
            )),
            _ => None,
        };
        match refuse {
            Some(why) => out.line("files", &format!("node/{}", n.name), Err(why)),
            None => ready.push(n.name.clone()),
        }
    }
    let image = image.unwrap_or_default();
    let cleaned = if dry_run {
        for n in &ready {
            let what = format!("would run nano-gpu-agent clean-node ({image}) in {CLEAN_NAMESPACE}");
            out.line("files", &format!("node/{n}"), Ok(what));
        }
        ready
    } else if ready.is_empty() {
        ready
    } else {
        clean_nodes(client, &ready, &image, &pull, args, &mut out).await
    };
    let node_api: Api<Node> = Api::all(client.clone());
    for name in &cleaned {
        let object = format!("node/{name}");
        let node = match node_api.get_opt(name).await {
            Ok(Some(node)) => node,
            Ok(None) => continue,
            Err(e) => {
                out.line("keys", &object, Err(e.to_string()));
                continue;
            }
        };
        let Some(n) = gpu_nodes(std::slice::from_ref(&node)).pop() else { continue };
        let keys = n.labels.iter().chain(&n.annotations).cloned().collect::<Vec<_>>().join(",");
        let result = if dry_run {
            Ok(format!("would remove {keys}"))
        } else {
            let patch = Patch::Merge(keys_patch(&n));
            match node_api.patch(name, &PatchParams::default(), &patch).await {
                Ok(_) => Ok(format!("removed {keys}")),
                Err(e) => Err(e.to_string()),
            }
        };
        out.line("keys", &object, result);
    }

    // 6. Pods no scheduler will place any more (bound ones are only starting: not these).
    let waiting = format!("spec.schedulerName={SCHEDULER_NAME},spec.nodeName=,status.phase=Pending");
    let pending = match Api::<Pod>::all(client.clone()).list(&ListParams::default().fields(&waiting)).await {
        Ok(list) => list.items,
        Err(e) => {
            out.line(
                "pending",
                "every pod",
                Err(format!("listing the pods Pending for {SCHEDULER_NAME}: {e}")),
            );
            Vec::new()
        }
    };
    let recorder =
        Recorder::new(client.clone(), Reporter { controller: "kubectl-nano-gpu".into(), instance: None });
    for pod in &pending {
        let object = format!(
            "pod/{} -n {}",
            pod.metadata.name.as_deref().unwrap_or_default(),
            pod.metadata.namespace.as_deref().unwrap_or_default()
        );
        let result = if dry_run {
            Ok(format!("would get an Event {}", Reason::Uninstalled.as_str()))
        } else {
            let event = KubeEvent {
                type_: EventType::Warning,
                reason: Reason::Uninstalled.as_str().into(),
                note: Some(pending_note()),
                action: "Uninstall".into(),
                secondary: None,
            };
            match recorder.publish(&event, &pod.object_ref(&())).await {
                Ok(()) => Ok(format!("Event {}: delete it", Reason::Uninstalled.as_str())),
                Err(e) => Err(e.to_string()),
            }
        };
        out.line("pending", &object, result);
    }
    Ok(out.failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, labels: Value, annotations: Value) -> Node {
        serde_json::from_value(
            json!({"metadata": {"name": name, "labels": labels, "annotations": annotations}}),
        )
        .unwrap()
    }

    #[test]
    fn only_nodes_with_nano_gpus_keys_are_cleaned_and_only_those_keys_go() {
        let nodes = [
            node(
                "gpu-1",
                json!({"nano-gpu/node": "true", "nano-gpu/gpu.count": "4", "kubernetes.io/hostname": "gpu-1"}),
                json!({"nano-gpu/gpus": "{}", "node.alpha.kubernetes.io/ttl": "0"}),
            ),
            node("cpu-1", json!({"kubernetes.io/hostname": "cpu-1", "nano-gpu.io/other": "x"}), json!({})),
            node("gpu-2", json!({}), json!({"nano-gpu/gpus": "{}"})),
        ];
        let gpu = gpu_nodes(&nodes);
        assert_eq!(gpu.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["gpu-1", "gpu-2"]);
        assert_eq!(
            keys_patch(&gpu[0]),
            json!({"metadata": {
                "labels": {"nano-gpu/gpu.count": null, "nano-gpu/node": null},
                "annotations": {"nano-gpu/gpus": null},
            }})
        );
    }

    #[test]
    fn the_cleanup_pod_runs_the_agents_clean_node_on_its_node_with_the_host_directories() {
        let pull = ["regcred".to_owned()];
        let pod: Pod = serde_json::from_value(clean_pod(
            "gpu-1",
            "registry.example/nano-gpu/agent:0.1.0",
            &pull,
            "/data/kubelet",
        ))
        .expect("a valid pod");
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-1"));
        let secrets: Vec<_> = spec.image_pull_secrets.iter().flatten().map(|r| r.name.as_str()).collect();
        assert_eq!(secrets, ["regcred"]);
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("registry.example/nano-gpu/agent:0.1.0"));
        assert_eq!(c.args.as_ref().unwrap()[0], "clean-node");
        let host = |name: &str| {
            let v = spec.volumes.as_ref().unwrap().iter().find(|v| v.name == name).unwrap();
            v.host_path.as_ref().unwrap().path.clone()
        };
        assert_eq!(host("kubelet"), "/data/kubelet");
        assert_eq!(host("run"), "/run");
        // Every directory the command is told of is a mount of the host.
        let args = c.args.as_ref().unwrap();
        let mounts: Vec<&str> =
            c.volume_mounts.as_ref().unwrap().iter().map(|m| m.mount_path.as_str()).collect();
        for dir in args.iter().filter(|a| a.starts_with('/')) {
            assert!(mounts.iter().any(|m| dir.starts_with(m)), "{dir} is not under a mount: {mounts:?}");
        }
        // It tolerates every taint: an uninstall cleans tainted GPU nodes too.
        assert_eq!(spec.tolerations.unwrap()[0].operator.as_deref(), Some("Exists"));
    }

    #[test]
    fn the_pull_secrets_asked_come_first_then_the_agents_each_once() {
        let asked = ["other/mirror".to_owned(), "regcred".to_owned()];
        let agents = ["regcred".to_owned(), "ghcr".to_owned(), "ghcr".to_owned()];
        let secret = |ns: &str, name: &str, asked| PullSecret {
            namespace: ns.to_owned(),
            name: name.to_owned(),
            asked,
        };
        assert_eq!(
            pull_secret_names(&asked, &agents, "nano-gpu-system"),
            [
                secret("other", "mirror", true),
                secret("nano-gpu-system", "regcred", true),
                secret("nano-gpu-system", "ghcr", false)
            ]
        );
    }

    #[test]
    fn a_pull_secret_is_copied_with_its_type_and_data_into_the_cleanup_namespace() {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "regcred", "namespace": "nano-gpu-system", "uid": "u", "resourceVersion": "9",
                         "ownerReferences": [{"apiVersion": "v1", "kind": "ServiceAccount", "name": "a", "uid": "o"}]},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": "e30="}
        }))
        .unwrap();
        let copy = serde_json::to_value(pull_secret_copy(&secret)).unwrap();
        assert_eq!(
            copy,
            json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "regcred", "namespace": CLEAN_NAMESPACE,
                             "labels": {"app.kubernetes.io/name": "nano-gpu-uninstall"}},
                "type": "kubernetes.io/dockerconfigjson",
                "data": {".dockerconfigjson": "e30="}
            })
        );
    }

    /// The agent DaemonSet's image and pull Secrets are read from its pod template and from the
    /// ServiceAccount its pods run as; a ServiceAccount that cannot be read costs only its Secrets.
    #[tokio::test]
    async fn the_agents_image_and_pull_secrets_are_read_from_the_daemonset_and_its_service_account() {
        use crate::api_replies::{failure, respond};
        let (svc, mut api) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let client = kube::Client::new(svc, "default");
        let daemon_set = json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "nano-gpu-agent"},
            "spec": {"selector": {}, "template": {"spec": {
                "serviceAccountName": "nano-gpu-agent", "imagePullSecrets": [{"name": "pod-level"}],
                "containers": [{"name": "keeper", "image": "k"}, {"name": "agent", "image": "reg/agent:1"}]}}}
        });
        let account = json!({
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nano-gpu-agent"},
            "imagePullSecrets": [{"name": "account-level"}]
        });
        let server = tokio::spawn(async move {
            for account in [respond(200, account), failure(403, "Forbidden")] {
                let (req, send) = api.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/apis/apps/v1/namespaces/ns/daemonsets/nano-gpu-agent");
                send.send_response(respond(200, daemon_set.clone()));
                let (req, send) = api.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/api/v1/namespaces/ns/serviceaccounts/nano-gpu-agent");
                send.send_response(account);
            }
            // No DaemonSet: nothing to read.
            let (_, send) = api.next_request().await.unwrap();
            send.send_response(failure(404, "NotFound"));
        });
        let image = Some("reg/agent:1".to_owned());
        let both = vec!["pod-level".to_owned(), "account-level".to_owned()];
        assert_eq!(agent_image(&client, "ns").await.unwrap(), Some((image.clone(), both)));
        assert_eq!(agent_image(&client, "ns").await.unwrap(), Some((image, vec!["pod-level".to_owned()])));
        assert_eq!(agent_image(&client, "ns").await.unwrap(), None);
        server.await.unwrap();
    }

    #[test]
    fn what_clean_node_printed_is_told_in_the_hosts_paths() {
        let said = "removed /host/run/nano-gpu; removed /host/kubelet/device-plugins/nano-gpu.x.sock; \
                    removed /host/var-run/cdi/nano-gpu.io-claim_1.json";
        assert_eq!(
            host_paths(said, "/data/kubelet"),
            "removed /run/nano-gpu; removed /data/kubelet/device-plugins/nano-gpu.x.sock; \
             removed /var/run/cdi/nano-gpu.io-claim_1.json"
        );
    }

    #[test]
    fn a_cleanup_pod_that_did_not_run_says_why() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "clean-x"},
            "status": {"phase": "Pending", "containerStatuses": [{
                "name": "clean-node", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull", "message": "pull access denied"}},
            }]},
        }))
        .unwrap();
        assert_eq!(pod_detail(&pod), "ErrImagePull: pull access denied");
        let evicted: Pod = serde_json::from_value(json!({
            "status": {"phase": "Failed", "reason": "OutOfpods", "message": "Node didn't have enough resource: pods"},
        }))
        .unwrap();
        assert_eq!(pod_detail(&evicted), "OutOfpods: Node didn't have enough resource: pods");
    }

    #[test]
    fn the_event_says_why_the_pod_waits_and_what_to_do() {
        let note = pending_note();
        assert!(note.contains(SCHEDULER_NAME) && note.contains("Delete it"), "{note}");
        // The Event API keeps at most 1 kB of a note.
        assert!(note.len() < 1024);
    }
}
