//! `kubectl nano-gpu check`: is nano-gpu installed and working on this cluster, and if not, what to do.
//! It reads the cluster ([`gather`] a [`Snapshot`]) and judges it ([`evaluate`]), one [`Line`] per
//! check and object, each failing line with the step that fixes it. It changes nothing.
//!
//! The checks: GPU nodes labelled; a Ready agent on each; each publishing at least one healthy card;
//! each node's runtime keeping a pod's `NVIDIA_VISIBLE_DEVICES` away from cards (the runtime canary's
//! `nano-gpu/device-isolation` label); a second device plugin on the node (`nvidia.com/gpu` on a
//! nano-gpu node: nano-gpu leaves it the cards it serves, worth a look); a Ready allocator and a leader renewing its Lease; the
//! webhook trusting the CA the allocator serves; the webhook certificate not near its end; with the
//! default-scheduler profile, its client CA not near its end and the date the control plane's copy
//! of the webhook CA must be replaced;
//! kube-scheduler in the allocator's pod within the supported skew of the API server; the RuntimeClass
//! the webhook gives GPU pods (`NANO_GPU_RUNTIME_CLASS`), where one is set, existing and usable; Pod
//! Security on nano-gpu's namespace and on every namespace with GPU pods; another DRA driver
//! publishing a GPU node's cards; MPS daemon pods on another image than their node's agent; a GPU pod
//! created in dry run, which admission must send to nano-gpu's scheduler profile.

use crate::service::tls::secret::{NOT_AFTER_ANNOTATION, RENEW_BEFORE};
use anyhow::{Context, Result};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Namespace, Node, Pod, Secret};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};
use nano_gpu_proto::annotations::{
    ANNOTATIONS_HONOURED, ENV_HONOURED, GPUS_ANNOTATION, ISOLATION_HELD, ISOLATION_LABEL, NODE_LABEL,
    NodeInventory,
};
use nano_gpu_proto::dra::DRIVER as DRA_DRIVER;
use nano_gpu_proto::install::SCHEDULER_NAME;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

/// A certificate that ends sooner than this is reported.
pub const CERT_WARNING: Duration = Duration::from_secs(14 * 86_400);

/// What the cluster holds of nano-gpu, as read by [`gather`] (`None`: absent or not readable).
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// nano-gpu's namespace.
    pub namespace: String,
    /// Every node.
    pub nodes: Vec<Node>,
    /// The agent pods.
    pub agents: Vec<Pod>,
    /// The allocator pods.
    pub allocators: Vec<Pod>,
    /// The allocator's Deployment.
    pub deployment: Option<Deployment>,
    /// The allocators' Lease.
    pub lease: Option<Lease>,
    /// The webhook configuration.
    pub webhook: Option<MutatingWebhookConfiguration>,
    /// The webhook certificate's Secret (`Err`: why it could not be read).
    pub secret: Result<Option<Secret>, String>,
    /// The default-scheduler profile's client CA Secret, `nano-gpu-extender-client-ca` (absent: the
    /// profile is not in use; `Err`: why it could not be read).
    pub extender_client_ca: Result<Option<Secret>, String>,
    /// Namespaces by name.
    pub namespaces: BTreeMap<String, Namespace>,
    /// The namespaces of pods that ask a nano-gpu resource.
    pub gpu_namespaces: BTreeSet<String>,
    /// The API server's version (`v1.37.2`).
    pub server_version: String,
    /// The cluster's RuntimeClasses by name (`Err`: why they could not be listed).
    pub runtime_classes: Result<BTreeMap<String, RuntimeClass>, String>,
    /// nano-gpu's admission policy bindings ([`POLICY_BINDINGS`]) by name (`Err`: why they could not
    /// be read).
    pub policy_bindings: Result<BTreeMap<String, ValidatingAdmissionPolicyBinding>, String>,
    /// The MPS daemons' pods (`app.kubernetes.io/name=nano-gpu-mps`).
    pub mps: Vec<Pod>,
    /// Every ResourceSlice (empty where the API server serves no `resource.k8s.io/v1`; `Err`: why
    /// they could not be listed).
    pub resource_slices: Result<Vec<ResourceSlice>, String>,
    /// A GPU pod created in dry run ([`dry_run_pod`]): its namespace, and what came of it (`None`:
    /// not tried).
    pub dry_run: Option<(String, DryRun)>,
}

/// What came of the dry-run GPU pod.
#[derive(Clone, Debug)]
pub enum DryRun {
    /// Admitted: the pod as admission left it (boxed: a Pod is large beside the messages).
    Admitted(Box<Pod>),
    /// Refused at admission (a webhook, Pod Security, a quota), with the API server's message.
    Refused(String),
    /// The check's user may not create pods there, so admission was not tried.
    NotAllowed(String),
}

/// The pod the check creates in dry run (nothing is stored): one container asking 10 % of a card,
/// within the restricted Pod Security level, so that only nano-gpu's admission decides it.
pub fn dry_run_pod() -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "nano-gpu-check-dry-run"},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10",
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                "resources": {"limits": {"nano-gpu/gpu-percent": "10"}}}]
        }
    }))
    .expect("a valid pod")
}

/// nano-gpu's admission policy bindings: name, whether the base install has it (the DRA component
/// adds the last three), whether its policy reads nano-gpu's Namespace as its parameter, and what is
/// open while it judges nothing.
pub const POLICY_BINDINGS: [(&str, bool, bool, &str); 6] = [
    ("nano-gpu-assignments", true, true, "anyone who may write a pod can set its nano-gpu/assignment"),
    (
        "nano-gpu-own-keys",
        true,
        true,
        "the allocator's and the agents' tokens may change any annotation or label",
    ),
    ("nano-gpu-agent-own-node", true, true, "an agent's token may change any node"),
    ("nano-gpu-agent-own-slice", false, true, "an agent's token may write any node's ResourceSlices"),
    (
        "nano-gpu-claim-for-its-pod",
        false,
        false,
        "any pod may join a claim made for another pod, and escapes the driver's memory limit",
    ),
    (
        "nano-gpu-claim-owner",
        false,
        false,
        "anyone who may update a claim can take its owning pod off and join another pod to it",
    ),
];

/// A check's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Holds.
    Ok,
    /// Holds for now, or cannot be told; worth a look.
    Warn,
    /// Does not hold: GPU pods fail or a boundary is open.
    Fail,
}

/// One check on one object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Line {
    /// The check's name.
    pub check: &'static str,
    /// What it looked at (a node, the webhook, ...).
    pub object: String,
    /// The verdict.
    pub status: Status,
    /// What was found, and for a failure, what to do.
    pub message: String,
}

fn line(check: &'static str, object: impl Into<String>, status: Status, message: impl Into<String>) -> Line {
    Line { check, object: object.into(), status, message: message.into() }
}

fn ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

/// `(major, minor)` of a version such as `v1.37.2` or `registry.k8s.io/kube-scheduler:v1.35.8`.
fn minor(version: &str) -> Option<(u32, u32)> {
    let v = version.rsplit(':').next()?.trim_start_matches('v');
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.trim_end_matches(|c: char| !c.is_ascii_digit()).parse().ok()?;
    Some((major, minor))
}

/// Labels that say a node has NVIDIA cards, put there by NVIDIA's GPU feature discovery or by Node
/// Feature Discovery (PCI vendor 10de), with the value they carry then.
const GPU_NODE_LABELS: [(&str, &str); 2] =
    [("nvidia.com/gpu.present", "true"), ("feature.node.kubernetes.io/pci-10de.present", "true")];

/// Whether `node` shows NVIDIA cards to someone other than nano-gpu: a label of [`GPU_NODE_LABELS`],
/// or an `nvidia.com/` resource in its capacity.
fn shows_nvidia_cards(node: &Node) -> bool {
    GPU_NODE_LABELS.iter().any(|(key, value)| label(node, key) == Some(*value))
        || other_gpu_resources(node).iter().any(|(name, _)| name.starts_with("nvidia.com/"))
}

/// The extended resources in `node`'s capacity that another device plugin serves cards under
/// (NVIDIA's: `nvidia.com/gpu`, `nvidia.com/gpu.shared` of its time-slicing, `nvidia.com/mig-*`;
/// Intel's `gpu.intel.com/*`), with their quantities, where not zero.
fn other_gpu_resources(node: &Node) -> Vec<(String, String)> {
    let capacity = node.status.as_ref().and_then(|st| st.capacity.as_ref());
    capacity
        .into_iter()
        .flatten()
        .filter(|(name, q)| {
            (name.starts_with("nvidia.com/") || name.starts_with("gpu.intel.com/")) && q.0 != "0"
        })
        .map(|(name, q)| (name.clone(), q.0.clone()))
        .collect()
}

/// Judges `s` at `now`.
pub fn evaluate(s: &Snapshot, now: SystemTime) -> Vec<Line> {
    let mut out = Vec::new();
    let ns = &s.namespace;
    let gpu_nodes: Vec<&Node> = s.nodes.iter().filter(|n| label(n, NODE_LABEL) == Some("true")).collect();
    if gpu_nodes.is_empty() {
        out.push(line(
            "nodes-labelled",
            "nodes",
            Status::Fail,
            format!("no node is labelled {NODE_LABEL}=true: label each GPU node (kubectl label node NAME {NODE_LABEL}=true)"),
        ));
    } else {
        out.push(line("nodes-labelled", "nodes", Status::Ok, format!("{} GPU node(s)", gpu_nodes.len())));
    }
    // Nodes with NVIDIA cards that nano-gpu does not serve: left to another plugin on purpose, or
    // forgotten.
    let unlabelled: Vec<&str> = s
        .nodes
        .iter()
        .filter(|n| label(n, NODE_LABEL) != Some("true") && shows_nvidia_cards(n))
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    out.push(if unlabelled.is_empty() {
        line("gpu-nodes", "nodes", Status::Ok, "every node that shows NVIDIA cards is labelled")
    } else {
        line(
            "gpu-nodes",
            "nodes",
            Status::Warn,
            format!(
                "{} node(s) show NVIDIA cards (NVIDIA's or NFD's labels, or an nvidia.com/ resource) but are not labelled \
                 {NODE_LABEL}=true, so nano-gpu serves no card there: {}; if that is not on purpose, label each \
                 (kubectl label node NAME {NODE_LABEL}=true)",
                unlabelled.len(),
                unlabelled.join(", ")
            ),
        )
    });
    for node in &gpu_nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let on_node =
            |p: &&Pod| p.spec.as_ref().and_then(|sp| sp.node_name.as_deref()) == Some(name.as_str());
        if s.agents.iter().filter(on_node).any(ready) {
            out.push(line("agent-ready", &name, Status::Ok, "a Ready agent"));
        } else {
            out.push(line(
                "agent-ready",
                &name,
                Status::Fail,
                format!(
                    "no Ready agent, so no GPU pod is placed here: see why with kubectl -n {ns} describe pod -l \
                     app.kubernetes.io/name=nano-gpu-agent --field-selector spec.nodeName={name} (its /readyz \
                     gives the reason)"
                ),
            ));
        }
        let inventory = node.metadata.annotations.as_ref().and_then(|a| a.get(GPUS_ANNOTATION));
        match inventory.map(|text| NodeInventory::decode(text.as_str())) {
            Some(Ok(inv)) if inv.gpus.iter().all(|g| g.healthy) && !inv.gpus.is_empty() => {
                out.push(line("cards", &name, Status::Ok, format!("{} healthy card(s)", inv.gpus.len())));
            }
            Some(Ok(inv)) if inv.gpus.iter().any(|g| g.healthy) => {
                let healthy = inv.gpus.iter().filter(|g| g.healthy).count();
                let unhealthy: Vec<String> =
                    inv.gpus.iter().filter(|g| !g.healthy).map(|g| g.index.to_string()).collect();
                out.push(line(
                    "cards",
                    &name,
                    Status::Warn,
                    format!(
                        "{healthy} healthy card(s) of {}: card(s) {} serve no pod; the agent's /readyz and log give \
                         each one's fault (kubectl -n {ns} get pod -l app.kubernetes.io/name=nano-gpu-agent \
                         --field-selector spec.nodeName={name}, then kubectl -n {ns} logs POD -c agent)",
                        inv.gpus.len(),
                        unhealthy.join(", ")
                    ),
                ));
            }
            Some(Ok(inv)) => out.push(line(
                "cards",
                &name,
                Status::Fail,
                format!(
                    "{} card(s), none healthy: the agent's log gives each card's fault (kubectl -n {ns} get pod -l \
                     app.kubernetes.io/name=nano-gpu-agent --field-selector spec.nodeName={name}, then kubectl -n \
                     {ns} logs POD -c agent)",
                    inv.gpus.len()
                ),
            )),
            Some(Err(e)) => out.push(line("cards", &name, Status::Fail, format!("{GPUS_ANNOTATION} unreadable: {e}"))),
            None => out.push(line(
                "cards",
                &name,
                Status::Fail,
                format!("no {GPUS_ANNOTATION}: its agent has not published the node's cards (NVML reachable? see its log)"),
            )),
        }
        match label(node, ISOLATION_LABEL) {
            Some(ISOLATION_HELD) => {
                out.push(line("device-isolation", &name, Status::Ok, "a pod's own env and annotations reach no card"))
            }
            Some(ENV_HONOURED) => out.push(line(
                "device-isolation",
                &name,
                Status::Fail,
                "the NVIDIA runtime gives a pod every card its own NVIDIA_VISIBLE_DEVICES names: set \
                 accept-nvidia-visible-devices-envvar-when-unprivileged = false and \
                 accept-nvidia-visible-devices-as-volume-mounts = true in its config.toml, then delete the node's \
                 agent pod",
            )),
            Some(ANNOTATIONS_HONOURED) => out.push(line(
                "device-isolation",
                &name,
                Status::Fail,
                "the NVIDIA runtime gives a pod every card its cdi.k8s.io/ annotations name: keep those \
                 annotations from it (containerd: out of the runtime's pod_annotations; CRI-O passes them all: \
                 run NVIDIA's runtime in legacy mode there), then delete the node's agent pod",
            )),
            Some(other) => out.push(line(
                "device-isolation",
                &name,
                Status::Fail,
                format!("{ISOLATION_LABEL}={other}, a verdict this version does not know: the allocator serves the node to no one"),
            )),
            None => out.push(line(
                "device-isolation",
                &name,
                Status::Warn,
                "the runtime canaries have not said (nano-gpu/device-isolation absent): are the agent pod's \
                 runtime-canary and annotation-canary containers running?",
            )),
        }
        let others = other_gpu_resources(node);
        let intel: Vec<String> = others
            .iter()
            .filter(|(r, _)| r.starts_with("gpu.intel.com/"))
            .map(|(r, q)| format!("{r} {q}"))
            .collect();
        if !intel.is_empty() {
            // Intel's plugin names its devices `card0-0` and the like, which the agent cannot tie to
            // a card: both plugins may hand out the same one.
            out.push(line(
                "one-plugin",
                &name,
                Status::Fail,
                format!(
                    "Intel's device plugin serves cards here ({}), and nano-gpu cannot tell which: both may hand out \
                     the same card; keep Intel's plugin off nano-gpu nodes (its DaemonSet's nodeSelector or \
                     affinity: not {NODE_LABEL}=true)",
                    intel.join(", ")
                ),
            ));
        } else if others.is_empty() {
            out.push(line("one-plugin", &name, Status::Ok, "only nano-gpu serves the cards"));
        } else {
            let served: Vec<String> = others.iter().map(|(r, q)| format!("{r} {q}")).collect();
            out.push(line(
                "one-plugin",
                &name,
                Status::Warn,
                format!(
                    "another device plugin serves cards here ({}): nano-gpu serves only the cards it does not \
                     (the others show unhealthy, with the reason in the agent's /readyz); if that split is not \
                     yours, keep NVIDIA's device plugin (or the GPU Operator's, its time-slicing and MIG \
                     resources included) off nano-gpu nodes",
                    served.join(", ")
                ),
            ));
        }
        if let Some(Ok(inv)) = inventory.map(|text| NodeInventory::decode(text.as_str())) {
            let uuids: Vec<&str> = inv.gpus.iter().map(|g| g.uuid.as_str()).collect();
            out.push(other_dra_drivers(&name, &uuids, &s.resource_slices));
        }
    }
    out.extend(mps_images(s));

    let ready_allocators = s.allocators.iter().filter(|p| ready(p)).count();
    out.push(if ready_allocators > 0 {
        line("allocator-ready", "allocator", Status::Ok, format!("{ready_allocators} Ready replica(s)"))
    } else {
        line(
            "allocator-ready",
            "allocator",
            Status::Fail,
            format!("no Ready allocator: GPU pods are not created or placed; kubectl -n {ns} describe pod -l app.kubernetes.io/name=nano-gpu-allocator"),
        )
    });
    out.push(leader(s, now));
    out.extend(webhook(s, now));
    out.extend(dry_run(s));
    out.extend(default_scheduler_profile(s, now));
    out.push(scheduler_version(s));
    out.extend(runtime_class(s));
    out.extend(pod_security(s));
    out.extend(policy_bindings(s));
    out
}

/// Other DRA drivers on GPU node `node` (whose cards have `uuids`): FAIL where one publishes a
/// device with an attribute that names one of the cards (NVIDIA's DRA driver: `uuid`, or a MIG
/// device's `parentUUID`), since a claim through it and a nano-gpu share can get the same card; WARN
/// where a driver whose name says GPU publishes devices that name none of them; nothing for drivers
/// of other devices (OK); WARN where the slices could not be listed.
fn other_dra_drivers(node: &str, uuids: &[&str], slices: &Result<Vec<ResourceSlice>, String>) -> Line {
    let slices = match slices {
        Ok(slices) => slices,
        Err(e) => {
            return line(
                "dra-drivers",
                node,
                Status::Warn,
                format!(
                    "the ResourceSlices could not be listed ({e}): other DRA drivers' devices are not checked"
                ),
            );
        }
    };
    // Per driver: the node's cards its devices name, and how many devices it publishes here.
    let mut drivers: BTreeMap<&str, (BTreeSet<&str>, usize)> = BTreeMap::new();
    for slice in
        slices.iter().filter(|sl| sl.spec.driver != DRA_DRIVER && sl.spec.node_name.as_deref() == Some(node))
    {
        let entry = drivers.entry(slice.spec.driver.as_str()).or_default();
        for device in slice.spec.devices.iter().flatten() {
            entry.1 += 1;
            let named = device.attributes.iter().flatten().filter_map(|(_, a)| a.string.as_deref());
            entry.0.extend(named.filter_map(|v| uuids.iter().copied().find(|u| *u == v)));
        }
    }
    let taking: Vec<String> = drivers
        .iter()
        .filter(|(_, (cards, _))| !cards.is_empty())
        .map(|(driver, (cards, _))| {
            format!("{driver} ({})", cards.iter().copied().collect::<Vec<_>>().join(", "))
        })
        .collect();
    if !taking.is_empty() {
        return line(
            "dra-drivers",
            node,
            Status::Fail,
            format!(
                "another DRA driver publishes this node's cards as its devices: {}; a claim through it and a nano-gpu \
                 share can get the same card: keep its kubelet plugin off nano-gpu nodes (its DaemonSet's \
                 nodeSelector or affinity: not {NODE_LABEL}=true), or serve claims through nano-gpu's own driver \
                 (deploy/components/dra)",
                taking.join("; ")
            ),
        );
    }
    let gpu_like: Vec<String> = drivers
        .iter()
        .filter(|(driver, (_, devices))| *devices > 0 && driver.to_ascii_lowercase().contains("gpu"))
        .map(|(driver, (_, devices))| format!("{driver} ({devices} device(s))"))
        .collect();
    if gpu_like.is_empty() {
        line("dra-drivers", node, Status::Ok, "no other DRA driver publishes the node's cards")
    } else {
        line(
            "dra-drivers",
            node,
            Status::Warn,
            format!(
                "a GPU DRA driver publishes devices here that name none of nano-gpu's cards: {}; if they are these \
                 cards under other names, a claim through it and a nano-gpu share can get the same card",
                gpu_like.join(", ")
            ),
        )
    }
}

/// Each MPS daemon pod against its node's agent: the MPS DaemonSet updates only when its pod is
/// deleted (`OnDelete`: a restart ends the MPS server its clients run on), so after an upgrade it
/// runs the previous image until someone restarts it. WARN where its image differs from the agent's
/// on the node, with how to restart it; OK where they agree.
fn mps_images(s: &Snapshot) -> Vec<Line> {
    let ns = &s.namespace;
    let image = |p: &Pod, container: Option<&str>| -> Option<String> {
        let containers = &p.spec.as_ref()?.containers;
        let c = match container {
            Some(name) => containers.iter().find(|c| c.name == name)?,
            None => containers.first()?,
        };
        c.image.clone()
    };
    let node_of = |p: &Pod| p.spec.as_ref().and_then(|sp| sp.node_name.clone()).unwrap_or_default();
    let mut out = Vec::new();
    for daemon in &s.mps {
        let name = daemon.metadata.name.clone().unwrap_or_default();
        let node = node_of(daemon);
        let Some(mps) = image(daemon, None) else { continue };
        let agent = s.agents.iter().filter(|a| node_of(a) == node).find_map(|a| image(a, Some("agent")));
        match agent {
            Some(agent) if agent != mps => out.push(line(
                "mps-image",
                &name,
                Status::Warn,
                format!(
                    "runs {mps} where node {node}'s agent runs {agent}: the MPS DaemonSet is not updated with the \
                     agents (OnDelete: a restart ends its clients' MPS server); once node {node}'s MPS shares are \
                     moved away (kubectl drain {node}), kubectl -n {ns} delete pod {name}"
                ),
            )),
            Some(_) => out.push(line("mps-image", &name, Status::Ok, format!("runs the agent's image, {mps}"))),
            None => {}
        }
    }
    out
}

/// Each of nano-gpu's policy bindings: present (the base's), denying, and reading its parameter from
/// nano-gpu's namespace. A binding's `paramRef` names the install's namespace, and its
/// `parameterNotFoundAction: Allow` lets every request through where that namespace does not exist
/// (so that an uninstall that removed it leaves no policy refusing writes): a binding that names
/// another namespace judges nothing, or judges nano-gpu's own accounts as strangers.
fn policy_bindings(s: &Snapshot) -> Vec<Line> {
    let bindings = match &s.policy_bindings {
        Ok(bindings) => bindings,
        Err(why) => {
            return vec![line(
                "policy-binding",
                "policies",
                Status::Warn,
                format!("the admission policy bindings cannot be read ({why})"),
            )];
        }
    };
    let ns = &s.namespace;
    let mut out = Vec::new();
    for (name, required, params, open) in POLICY_BINDINGS {
        let Some(binding) = bindings.get(name) else {
            if required {
                out.push(line(
                    "policy-binding",
                    name,
                    Status::Fail,
                    format!("missing, so its policy judges nothing: {open}; apply the install again"),
                ));
            }
            continue;
        };
        let spec = binding.spec.as_ref();
        let param = spec.and_then(|s| s.param_ref.as_ref()).and_then(|p| p.name.clone()).unwrap_or_default();
        let denies = spec
            .and_then(|s| s.validation_actions.as_ref())
            .is_some_and(|actions| actions.iter().any(|a| a == "Deny"));
        out.push(if params && param != *ns {
            line(
                "policy-binding",
                name,
                Status::Fail,
                format!(
                    "its paramRef names the namespace {param:?}, not nano-gpu's {ns}: where that namespace does not \
                     exist the policy lets every request through ({open}), where it does it refuses nano-gpu's own \
                     writes; install with an overlay's namespace: (kustomize renames it) or set spec.paramRef.name \
                     to {ns}"
                ),
            )
        } else if !denies {
            line(
                "policy-binding",
                name,
                Status::Fail,
                format!("its validationActions do not include Deny, so it refuses nothing: {open}"),
            )
        } else if params {
            line("policy-binding", name, Status::Ok, format!("denies, with the parameter {ns}"))
        } else {
            line("policy-binding", name, Status::Ok, "denies".to_owned())
        })
    }
    out
}

/// The RuntimeClass the allocator's webhook gives GPU pods (`NANO_GPU_RUNTIME_CLASS` of its container),
/// if it gives one: it must exist (the API server refuses a pod naming a missing class). Its
/// `overhead` and `scheduling` hold for those pods too: the API server runs its own admission steps
/// (RuntimeClass's among them) again after a webhook changed a pod.
fn runtime_class(s: &Snapshot) -> Option<Line> {
    let class = allocator_env(s, "NANO_GPU_RUNTIME_CLASS")?;
    let object = format!("runtimeclass/{class}");
    let classes = match &s.runtime_classes {
        Ok(classes) => classes,
        Err(why) => {
            return Some(line(
                "runtime-class",
                object,
                Status::Warn,
                format!("the RuntimeClasses cannot be read ({why})"),
            ));
        }
    };
    Some(match classes.get(&class) {
        None => line(
            "runtime-class",
            object,
            Status::Fail,
            format!(
                "GPU pods are given the RuntimeClass {class}, which does not exist: the API server refuses them; \
                 create it (handler: the NVIDIA runtime's, e.g. nvidia) or unset NANO_GPU_RUNTIME_CLASS"
            ),
        ),
        Some(rc) => {
            let mut message = format!("GPU pods run under handler {}", rc.handler);
            if rc.overhead.is_some() || rc.scheduling.is_some() {
                message.push_str(", with the class's overhead and scheduling");
            }
            line("runtime-class", object, Status::Ok, message)
        }
    })
}

fn leader(s: &Snapshot, now: SystemTime) -> Line {
    let Some(spec) = s.lease.as_ref().and_then(|l| l.spec.as_ref()) else {
        return line(
            "leader",
            "lease",
            Status::Fail,
            "no Lease nano-gpu-allocator: no allocator has led yet",
        );
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let renewed = spec.renew_time.as_ref().map(|t| SystemTime::from(t.0));
    let lasts = Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15));
    match renewed {
        _ if holder.is_empty() => {
            line("leader", "lease", Status::Fail, "the Lease has no holder: no allocator leads")
        }
        Some(t) if now.duration_since(t).unwrap_or_default() <= lasts * 2 => {
            line("leader", "lease", Status::Ok, format!("{holder} leads"))
        }
        _ => line(
            "leader",
            "lease",
            Status::Fail,
            format!(
                "{holder} holds the Lease but has not renewed it: no allocator is deciding; see the allocator pods' logs"
            ),
        ),
    }
}

fn webhook(s: &Snapshot, now: SystemTime) -> Vec<Line> {
    let mut out = Vec::new();
    let secret = match &s.secret {
        Ok(secret) => secret.as_ref(),
        Err(why) => {
            out.push(line(
                "webhook-ca",
                "webhook",
                Status::Warn,
                format!("the webhook certificate cannot be read ({why})"),
            ));
            return out;
        }
    };
    let ca = secret
        .and_then(|s| s.data.as_ref())
        .and_then(|d| d.get("ca.crt"))
        .map(|b| b.0.clone())
        .filter(|b| !b.is_empty());
    let Some(config) = &s.webhook else {
        out.push(line(
            "webhook-ca",
            "webhook",
            Status::Fail,
            "no MutatingWebhookConfiguration nano-gpu-allocator: apply deploy/webhook.yaml",
        ));
        return out;
    };
    let bundles: Vec<Vec<u8>> = config
        .webhooks
        .iter()
        .flatten()
        .map(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.clone()).unwrap_or_default())
        .collect();
    out.push(match &ca {
        _ if bundles.iter().any(Vec::is_empty) => line(
            "webhook-ca",
            "webhook",
            Status::Fail,
            "the webhook's caBundle is empty, so the API server refuses GPU pods: the allocator writes it again \
             within a minute; if it stays empty, see the allocator's log",
        ),
        Some(ca) if bundles.iter().all(|b| b == ca) => line("webhook-ca", "webhook", Status::Ok, "trusts the served CA"),
        Some(_) => line(
            "webhook-ca",
            "webhook",
            Status::Fail,
            "the webhook's caBundle is not the CA the allocator serves: the allocator writes it again within a \
             minute; if it stays, see the allocator's log",
        ),
        None => line("webhook-ca", "webhook", Status::Warn, "no webhook certificate Secret yet (the first replica makes it)"),
    });
    if let Some(end) = annotated_end(secret) {
        let (status, days) = end_status(end, now);
        let what = match status {
            Status::Ok => format!("ends in {days} days (renewed 30 days before)"),
            Status::Warn => format!("ends in {days} days and was not renewed: see the allocator's log"),
            Status::Fail => "has ended: delete the Secret and the allocator makes a new one".to_owned(),
        };
        out.push(line("certificate", "webhook", status, what));
    }
    out
}

/// The end the allocator wrote on its webhook certificate Secret (annotation `NOT_AFTER_ANNOTATION`).
/// The `allocator` container of the allocator's Deployment.
fn allocator_container(s: &Snapshot) -> Option<&Container> {
    let spec = s.deployment.as_ref()?.spec.as_ref()?.template.spec.as_ref()?;
    spec.containers.iter().find(|c| c.name == "allocator")
}

/// The value of environment variable `name` in the allocator's container.
fn allocator_env(s: &Snapshot, name: &str) -> Option<String> {
    allocator_container(s)?.env.as_ref()?.iter().find(|e| e.name == name)?.value.clone()
}

/// The scheduler profile the webhook sends GPU pods to: the allocator container's
/// `--scheduler-name` or `NANO_GPU_SCHEDULER_NAME`, else the allocator's default.
fn scheduler_name(s: &Snapshot) -> String {
    let arg = allocator_container(s).and_then(|c| {
        let args = c.args.iter().flatten();
        args.filter_map(|a| a.strip_prefix("--scheduler-name=")).next_back().map(str::to_owned)
    });
    arg.or_else(|| allocator_env(s, "NANO_GPU_SCHEDULER_NAME")).unwrap_or_else(|| SCHEDULER_NAME.to_owned())
}

/// The dry-run GPU pod ([`dry_run_pod`]): OK when admission sent it to nano-gpu's scheduler profile
/// (or, with DRA shares, turned its request into claims); FAIL when it was refused or left as
/// written (the webhook was not called: a GPU pod would wait, or be placed without nano-gpu).
fn dry_run(s: &Snapshot) -> Option<Line> {
    const CHECK: &str = "webhook-dry-run";
    let (namespace, result) = s.dry_run.as_ref()?;
    let (status, message) = match result {
        DryRun::Refused(why) => (
            Status::Fail,
            format!("a GPU pod is refused at admission: {why}; see the webhook and allocator lines"),
        ),
        DryRun::NotAllowed(why) => {
            (Status::Warn, format!("cannot be tried: this user may not create pods in {namespace} ({why})"))
        }
        DryRun::Admitted(pod) => {
            let expected = scheduler_name(s);
            let spec = pod.spec.as_ref();
            let scheduler = spec.and_then(|p| p.scheduler_name.as_deref()).unwrap_or("default-scheduler");
            let claims = spec.and_then(|p| p.resource_claims.as_ref()).is_some_and(|c| !c.is_empty());
            if claims {
                (Status::Ok, format!("a GPU pod is admitted and turned into a pod with claims ({scheduler})"))
            } else if scheduler == expected {
                (Status::Ok, format!("a GPU pod is admitted and sent to that profile ({scheduler})"))
            } else {
                let why = format!(
                    "a GPU pod was admitted unchanged, for scheduler {scheduler} and not {expected}: the webhook \
                     was not called; kubectl get mutatingwebhookconfiguration nano-gpu-allocator -o yaml (its \
                     namespaceSelector must not leave out {namespace})"
                );
                (Status::Fail, why)
            }
        }
    };
    Some(line(CHECK, format!("{namespace}/nano-gpu-check-dry-run"), status, message))
}

fn annotated_end(secret: Option<&Secret>) -> Option<SystemTime> {
    let end = secret?.metadata.annotations.as_ref()?.get(NOT_AFTER_ANNOTATION)?;
    end.parse::<k8s_openapi::jiff::Timestamp>().ok().map(SystemTime::from)
}

/// How near a certificate's `end` is at `now`: Ok beyond [`CERT_WARNING`], Warn within it, Fail once
/// passed; and the whole days left.
fn end_status(end: SystemTime, now: SystemTime) -> (Status, u64) {
    let left = end.duration_since(now).unwrap_or_default();
    let status = if left > CERT_WARNING {
        Status::Ok
    } else if left > Duration::ZERO {
        Status::Warn
    } else {
        Status::Fail
    };
    (status, left.as_secs() / 86_400)
}

/// The UTC date of `t` (`2026-12-01`).
fn date(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map(|t| t.to_string()[..10].to_owned()).unwrap_or_default()
}

/// With the default-scheduler profile (its client CA Secret exists): that CA's end, and when the
/// webhook certificate's renewal makes the control plane's copy of its CA stale.
fn default_scheduler_profile(s: &Snapshot, now: SystemTime) -> Vec<Line> {
    const OBJECT: &str = "extender-client-ca";
    let secret = match &s.extender_client_ca {
        Ok(None) => return Vec::new(),
        Ok(Some(secret)) => secret,
        Err(why) => {
            return vec![line(
                "certificate",
                OBJECT,
                Status::Warn,
                format!("the Secret cannot be read ({why})"),
            )];
        }
    };
    let mut out = Vec::new();
    let pem = secret.data.as_ref().and_then(|d| d.get("ca.crt")).map(|b| b.0.clone()).unwrap_or_default();
    let ns = &s.namespace;
    out.push(match crate::service::tls::certificate_ends(&pem).map(|ends| ends.into_iter().min()) {
        Ok(Some(end)) => {
            let (status, days) = end_status(end, now);
            let what = match status {
                Status::Ok => format!("ends in {days} days ({})", date(end)),
                Status::Warn => format!(
                    "a CA of the Secret's ca.crt ends in {days} days ({}): rotate it (both CAs in ca.crt, a new \
                     client certificate for kube-scheduler, then the new CA alone; the allocator re-reads the file)",
                    date(end)
                ),
                Status::Fail => format!(
                    "a CA of the Secret's ca.crt ended on {}: put a current CA in \
                     {ns}/nano-gpu-extender-client-ca and give kube-scheduler a client certificate it signs (the \
                     allocator checks the client certificate's own dates)",
                    date(end)
                ),
            };
            line("certificate", OBJECT, status, what)
        }
        Ok(None) | Err(_) => line(
            "certificate",
            OBJECT,
            Status::Fail,
            format!(
                "the Secret {ns}/nano-gpu-extender-client-ca has no usable ca.crt: allocators that start now fail; \
                 put the CA that signs kube-scheduler's client certificate there"
            ),
        ),
    });
    let not_after = annotated_end(s.secret.as_ref().ok().and_then(Option::as_ref));
    if let Some(renewal) = not_after.and_then(|end| end.checked_sub(RENEW_BEFORE)) {
        let left = renewal.duration_since(now).unwrap_or_default();
        let days = left.as_secs() / 86_400;
        let what = format!(
            "the webhook certificate is renewed on {} with a new CA: copy its ca.crt to the control plane's \
             extender-ca.crt then, or kube-scheduler's calls fail",
            date(renewal)
        );
        out.push(if left > CERT_WARNING {
            line("certificate", "extender-ca-copy", Status::Ok, what)
        } else {
            line("certificate", "extender-ca-copy", Status::Warn, format!("in {days} days, {what}"))
        });
    }
    out
}

fn scheduler_version(s: &Snapshot) -> Line {
    let image = s.deployment.as_ref().and_then(|d| {
        let spec = d.spec.as_ref()?.template.spec.as_ref()?;
        spec.containers.iter().find(|c| c.name == "kube-scheduler")?.image.clone()
    });
    let (Some(image), Some(server)) = (image, minor(&s.server_version)) else {
        return line(
            "scheduler-version",
            "allocator",
            Status::Warn,
            "no kube-scheduler container in the allocator's Deployment",
        );
    };
    match minor(&image) {
        Some(own) if own > server => line(
            "scheduler-version",
            "allocator",
            Status::Fail,
            format!(
                "{image} is newer than the API server ({}): set the kube-scheduler image to the API server's version",
                s.server_version
            ),
        ),
        Some(own) if own.0 == server.0 && own.1 + 1 < server.1 => line(
            "scheduler-version",
            "allocator",
            Status::Fail,
            format!("{image} is more than one minor older than the API server ({})", s.server_version),
        ),
        Some(_) => line(
            "scheduler-version",
            "allocator",
            Status::Ok,
            format!("{image} with API server {}", s.server_version),
        ),
        None => {
            line("scheduler-version", "allocator", Status::Warn, format!("cannot read a version in {image}"))
        }
    }
}

fn pod_security(s: &Snapshot) -> Vec<Line> {
    let enforce = |name: &str| {
        s.namespaces
            .get(name)
            .and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get("pod-security.kubernetes.io/enforce"))
            .cloned()
    };
    let mut out = Vec::new();
    out.push(match enforce(&s.namespace).as_deref() {
        Some("privileged") | None => line("pod-security", &s.namespace, Status::Ok, "nano-gpu's own pods may use host paths"),
        Some(level) => line(
            "pod-security",
            &s.namespace,
            Status::Fail,
            format!("enforces {level}: the agents need host paths; label it pod-security.kubernetes.io/enforce=privileged"),
        ),
    });
    for ns in s.gpu_namespaces.iter().filter(|n| **n != s.namespace) {
        out.push(match enforce(ns).as_deref() {
            Some("baseline" | "restricted") => line("pod-security", ns, Status::Ok, "GPU pods under baseline or stricter"),
            level => line(
                "pod-security",
                ns,
                Status::Warn,
                format!(
                    "runs GPU pods under {}: a privileged pod there is handed every card by its own env; label it \
                     pod-security.kubernetes.io/enforce=baseline",
                    level.unwrap_or("no Pod Security level")
                ),
            ),
        });
    }
    out
}

/// Reads what [`evaluate`] judges, from nano-gpu's namespace `ns`.
pub async fn gather(client: &kube::Client, ns: &str) -> Result<Snapshot> {
    let lp = ListParams::default();
    let nodes = Api::<Node>::all(client.clone()).list(&lp).await.context("listing nodes")?.items;
    let in_ns: Api<Pod> = Api::namespaced(client.clone(), ns);
    let by_label = |name: &str| ListParams::default().labels(&format!("app.kubernetes.io/name={name}"));
    let agents = in_ns.list(&by_label("nano-gpu-agent")).await.context("listing the agent pods")?.items;
    let allocators =
        in_ns.list(&by_label("nano-gpu-allocator")).await.context("listing the allocator pods")?.items;
    let deployment =
        Api::<Deployment>::namespaced(client.clone(), ns).get_opt("nano-gpu-allocator").await.ok().flatten();
    let lease =
        Api::<Lease>::namespaced(client.clone(), ns).get_opt("nano-gpu-allocator").await.ok().flatten();
    let webhook = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get_opt("nano-gpu-allocator")
        .await
        .context("reading the webhook configuration")?;
    let secret = Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt("nano-gpu-allocator-webhook-tls")
        .await
        .map_err(|e| e.to_string());
    let extender_client_ca = Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt("nano-gpu-extender-client-ca")
        .await
        .map_err(|e| e.to_string());
    let namespaces = Api::<Namespace>::all(client.clone())
        .list(&lp)
        .await
        .context("listing namespaces")?
        .items
        .into_iter()
        .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
        .collect();
    let pods = Api::<Pod>::all(client.clone()).list(&lp).await.context("listing pods")?.items;
    let gpu_namespaces: BTreeSet<String> = pods
        .iter()
        .filter(|p| {
            p.spec.iter().flat_map(|s| &s.containers).any(|c| {
                let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
                limits.is_some_and(|l| l.keys().any(|k| k.starts_with("nano-gpu/")))
            })
        })
        .filter_map(|p| p.metadata.namespace.clone())
        .collect();
    let server_version = client.apiserver_version().await.map(|v| v.git_version).unwrap_or_default();
    let runtime_classes = Api::<RuntimeClass>::all(client.clone())
        .list(&lp)
        .await
        .map(|l| l.items.into_iter().map(|c| (c.metadata.name.clone().unwrap_or_default(), c)).collect())
        .map_err(|e| e.to_string());
    let ours = |name: &str| POLICY_BINDINGS.iter().any(|(n, ..)| *n == name);
    let policy_bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .list(&lp)
        .await
        .map(|l| {
            let named = l.items.into_iter().map(|b| (b.metadata.name.clone().unwrap_or_default(), b));
            named.filter(|(name, _)| ours(name)).collect()
        })
        .map_err(|e| e.to_string());
    let mps = in_ns.list(&by_label("nano-gpu-mps")).await.context("listing the MPS daemon pods")?.items;
    let resource_slices = match Api::<ResourceSlice>::all(client.clone()).list(&lp).await {
        Ok(list) => Ok(list.items),
        // No resource.k8s.io/v1 served: no DRA driver can publish devices.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        Err(e) => Err(e.to_string()),
    };
    // A GPU pod in dry run, where users run GPU pods (else `default`): nano-gpu's own namespace is
    // outside the webhook's reach.
    let namespace = gpu_namespaces.iter().find(|n| *n != ns && *n != "kube-system").cloned();
    let namespace = namespace.unwrap_or_else(|| "default".to_owned());
    let params = kube::api::PostParams { dry_run: true, ..Default::default() };
    let created = Api::<Pod>::namespaced(client.clone(), &namespace).create(&params, &dry_run_pod()).await;
    let dry_run = Some((
        namespace,
        match created {
            Ok(pod) => DryRun::Admitted(Box::new(pod)),
            // RBAC's refusal, before admission: "User ... cannot create resource \"pods\"".
            Err(kube::Error::Api(e)) if e.code == 403 && e.message.contains("cannot create resource") => {
                DryRun::NotAllowed(e.message)
            }
            Err(e) => DryRun::Refused(e.to_string()),
        },
    ));
    Ok(Snapshot {
        namespace: ns.to_owned(),
        nodes,
        agents,
        allocators,
        deployment,
        lease,
        webhook,
        secret,
        extender_client_ca,
        namespaces,
        gpu_namespaces,
        server_version,
        runtime_classes,
        policy_bindings,
        mps,
        resource_slices,
        dry_run,
    })
}

/// The lines as a table for a person.
pub fn table(lines: &[Line]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    // Columns as wide as their longest entry, so every message starts in one column.
    let check = lines.iter().map(|l| l.check.len()).max().unwrap_or(0);
    let object = lines.iter().map(|l| l.object.len()).max().unwrap_or(0);
    for l in lines {
        let mark = match l.status {
            Status::Ok => "ok  ",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        let _ = writeln!(out, "{mark} {:<check$} {:<object$} {}", l.check, l.object, l.message);
    }
    let fails = lines.iter().filter(|l| l.status == Status::Fail).count();
    let warns = lines.iter().filter(|l| l.status == Status::Warn).count();
    let _ = writeln!(out, "{} check(s): {fails} failed, {warns} to look at", lines.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: u64 = 1_800_000_000;

    fn at(secs: u64) -> String {
        k8s_openapi::jiff::Timestamp::from_second(secs as i64).unwrap().to_string()
    }

    fn node(name: &str, labels: serde_json::Value, healthy: bool) -> Node {
        let gpus = json!({"v": 1, "gpus": [{"index": 0, "uuid": format!("GPU-{name}"), "vendor": "nvidia",
            "model": "T4", "memoryMiB": 15360, "healthy": healthy}]});
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels,
            "annotations": {GPUS_ANNOTATION: gpus.to_string()}}}))
        .unwrap()
    }

    fn pod(name: &str, node: &str, ready: bool) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": name},
            "spec": {"nodeName": node, "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}}))
        .unwrap()
    }

    fn namespace(name: &str, level: &str) -> (String, Namespace) {
        let ns = serde_json::from_value(json!({"metadata": {"name": name,
            "labels": {"pod-security.kubernetes.io/enforce": level}}}))
        .unwrap();
        (name.to_owned(), ns)
    }

    /// A cluster where every check holds.
    fn healthy() -> Snapshot {
        let gpu = json!({NODE_LABEL: "true", ISOLATION_LABEL: "held"});
        let webhook = serde_json::from_value(json!({"metadata": {"name": "nano-gpu-allocator"},
            "webhooks": [{"name": "pods.nano-gpu.io", "clientConfig": {"caBundle": "UEVN"},
                "admissionReviewVersions": ["v1"], "sideEffects": "None"}]}))
        .unwrap();
        let secret = serde_json::from_value(json!({"metadata": {"name": "nano-gpu-allocator-webhook-tls",
            "annotations": {NOT_AFTER_ANNOTATION: at(NOW + 200 * 86_400)}}, "data": {"ca.crt": "UEVN"}}))
        .unwrap();
        let lease = serde_json::from_value(json!({"metadata": {"name": "nano-gpu-allocator"},
            "spec": {"holderIdentity": "allocator-a", "leaseDurationSeconds": 15,
                "renewTime": at(NOW - 3).replace('Z', ".000000Z")}}))
        .unwrap();
        let deployment = serde_json::from_value(json!({"metadata": {"name": "nano-gpu-allocator"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "allocator", "image": "nano-gpu/allocator:0.1.0"},
                {"name": "kube-scheduler", "image": "registry.k8s.io/kube-scheduler:v1.37.2"}]}}}}))
        .unwrap();
        Snapshot {
            namespace: "nano-gpu-system".into(),
            nodes: vec![
                node("node-1", gpu.clone(), true),
                node("node-2", gpu, true),
                node("cpu", json!({}), true),
            ],
            agents: vec![pod("agent-1", "node-1", true), pod("agent-2", "node-2", true)],
            allocators: vec![pod("allocator-a", "cpu", true)],
            deployment: Some(deployment),
            lease: Some(lease),
            webhook: Some(webhook),
            secret: Ok(Some(secret)),
            extender_client_ca: Ok(None),
            namespaces: [namespace("nano-gpu-system", "privileged"), namespace("team", "baseline")].into(),
            gpu_namespaces: ["team".to_owned()].into(),
            server_version: "v1.37.2".into(),
            runtime_classes: Ok(BTreeMap::new()),
            policy_bindings: Ok(POLICY_BINDINGS
                .iter()
                .filter(|(_, required, ..)| *required)
                .map(|(name, ..)| (name.to_string(), binding(name, "nano-gpu-system", "Deny")))
                .collect()),
            mps: Vec::new(),
            resource_slices: Ok(Vec::new()),
            dry_run: Some(("team".into(), DryRun::Admitted(Box::new(admitted("nano-gpu-scheduler"))))),
        }
    }

    /// The dry-run pod as admission left it, for scheduler `scheduler`.
    fn admitted(scheduler: &str) -> Pod {
        let mut pod = super::dry_run_pod();
        pod.metadata.namespace = Some("team".into());
        pod.spec.as_mut().unwrap().scheduler_name = Some(scheduler.into());
        pod
    }

    /// A ResourceSlice of `driver` on `node` with one device per attribute set in `devices`.
    fn slice(driver: &str, node: &str, devices: &[serde_json::Value]) -> ResourceSlice {
        let devices: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(i, attributes)| json!({"name": format!("d{i}"), "attributes": attributes}))
            .collect();
        serde_json::from_value(json!({"metadata": {"name": format!("{node}-{driver}")},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}}))
        .unwrap()
    }

    /// A pod `name` on `node` whose container `container` runs `image`.
    fn running(name: &str, node: &str, container: &str, image: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": container, "image": image}]}}))
        .unwrap()
    }

    /// Binding `name` of policy `name`, with the parameter namespace `param` and the action `action`.
    fn binding(name: &str, param: &str, action: &str) -> ValidatingAdmissionPolicyBinding {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"policyName": name,
            "paramRef": {"name": param, "parameterNotFoundAction": "Allow"}, "validationActions": [action]}}))
        .unwrap()
    }

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(NOW)
    }

    fn failing(s: &Snapshot) -> Vec<(&'static str, String, Status)> {
        evaluate(s, now())
            .into_iter()
            .filter(|l| l.status != Status::Ok)
            .map(|l| (l.check, l.object, l.status))
            .collect()
    }

    #[test]
    fn a_healthy_cluster_passes_every_check() {
        let lines = evaluate(&healthy(), now());
        assert!(lines.iter().all(|l| l.status == Status::Ok), "{}", table(&lines));
        let checks: BTreeSet<&str> = lines.iter().map(|l| l.check).collect();
        let want = [
            "agent-ready",
            "allocator-ready",
            "cards",
            "certificate",
            "device-isolation",
            "dra-drivers",
            "gpu-nodes",
            "leader",
            "nodes-labelled",
            "one-plugin",
            "pod-security",
            "policy-binding",
            "scheduler-version",
            "webhook-ca",
            "webhook-dry-run",
        ];
        assert_eq!(checks, want.into_iter().collect());
        assert!(table(&lines).ends_with("failed, 0 to look at\n"));
    }

    #[test]
    fn another_dra_driver_publishing_a_nodes_cards_fails_and_a_gpu_driver_naming_none_is_worth_a_look() {
        let mut s = healthy();
        // NVIDIA's DRA driver on node-1: a whole card by its `uuid`, a MIG device by its parent; ours
        // and a NIC driver's are not looked at.
        s.resource_slices = Ok(vec![
            slice(
                "gpu.nvidia.com",
                "node-1",
                &[
                    json!({"uuid": {"string": "GPU-node-1"}, "index": {"int": 0}}),
                    json!({"uuid": {"string": "MIG-x"}, "parentUUID": {"string": "GPU-node-1"}}),
                ],
            ),
            slice(DRA_DRIVER, "node-2", &[json!({"uuid": {"string": "GPU-node-2"}})]),
            slice("net.example.com", "node-2", &[json!({"mac": {"string": "GPU-node-2x"}})]),
        ]);
        assert_eq!(failing(&s), vec![("dra-drivers", "node-1".to_owned(), Status::Fail)]);
        let lines = evaluate(&s, now());
        let fail = lines.iter().find(|l| l.status == Status::Fail).unwrap();
        assert!(fail.message.contains("gpu.nvidia.com (GPU-node-1)"), "{}", fail.message);
        // A GPU driver whose devices name none of the cards (other names for them, or other cards).
        s.resource_slices =
            Ok(vec![slice("gpu.example.com", "node-2", &[json!({"serial": {"string": "7"}})])]);
        assert_eq!(failing(&s), vec![("dra-drivers", "node-2".to_owned(), Status::Warn)]);
        // Slices that cannot be listed: said on each node, nothing else changes.
        s.resource_slices = Err("forbidden".into());
        let warned: Vec<_> = failing(&s);
        assert_eq!(warned.len(), 2);
        assert!(warned.iter().all(|(check, _, status)| *check == "dra-drivers" && *status == Status::Warn));
    }

    #[test]
    fn an_mps_daemon_on_another_image_than_its_nodes_agent_is_named_with_how_to_restart_it() {
        let mut s = healthy();
        s.agents = vec![
            running("agent-1", "node-1", "agent", "nano-gpu/agent:0.2.0"),
            running("agent-2", "node-2", "agent", "nano-gpu/agent:0.2.0"),
        ];
        for a in &mut s.agents {
            a.status = pod("x", "x", true).status;
        }
        s.mps = vec![
            running("mps-old", "node-1", "card-0", "nano-gpu/agent:0.1.0"),
            running("mps-new", "node-2", "card-0", "nano-gpu/agent:0.2.0"),
        ];
        assert_eq!(failing(&s), vec![("mps-image", "mps-old".to_owned(), Status::Warn)]);
        let lines = evaluate(&s, now());
        let warn = lines.iter().find(|l| l.status == Status::Warn).unwrap();
        assert!(
            warn.message.contains("kubectl drain node-1") && warn.message.contains("delete pod mps-old"),
            "{}",
            warn.message
        );
        assert!(
            lines.iter().any(|l| l.check == "mps-image" && l.object == "mps-new" && l.status == Status::Ok)
        );
    }

    #[test]
    fn nodes_with_cards_nano_gpu_does_not_serve_are_named() {
        // A node NVIDIA's feature discovery (or NFD) says has cards, not labelled for nano-gpu.
        let mut s = healthy();
        s.nodes[2].metadata.labels.as_mut().unwrap().insert("nvidia.com/gpu.present".into(), "true".into());
        assert_eq!(failing(&s), vec![("gpu-nodes", "nodes".to_owned(), Status::Warn)]);
        let lines = evaluate(&s, now());
        let l = lines.iter().find(|l| l.check == "gpu-nodes").unwrap();
        assert!(
            l.message.contains(": cpu;") && l.message.contains("kubectl label node NAME"),
            "{}",
            l.message
        );
        // Or whose capacity shows another plugin's cards; a label of another value says nothing.
        let mut s = healthy();
        s.nodes[2].status =
            Some(serde_json::from_value(json!({"capacity": {"nvidia.com/gpu": "2"}})).unwrap());
        assert_eq!(failing(&s), vec![("gpu-nodes", "nodes".to_owned(), Status::Warn)]);
        let mut s = healthy();
        let labels = s.nodes[2].metadata.labels.as_mut().unwrap();
        labels.insert("feature.node.kubernetes.io/pci-10de.present".into(), "false".into());
        assert!(failing(&s).is_empty());
        // Intel's plugin's cards are no NVIDIA cards.
        s.nodes[2].status =
            Some(serde_json::from_value(json!({"capacity": {"gpu.intel.com/i915": "1"}})).unwrap());
        assert!(failing(&s).is_empty());
    }

    #[test]
    fn a_node_with_some_cards_unhealthy_is_worth_a_look() {
        let mut s = healthy();
        let gpus = json!({"v": 1, "gpus": [
            {"index": 0, "uuid": "GPU-a", "vendor": "nvidia", "model": "H100", "memoryMiB": 81559, "healthy": true},
            {"index": 1, "uuid": "GPU-b", "vendor": "nvidia", "model": "H100", "memoryMiB": 81559, "healthy": false},
            {"index": 2, "uuid": "GPU-c", "vendor": "nvidia", "model": "H100", "memoryMiB": 81559, "healthy": false}]});
        s.nodes[0].metadata.annotations.as_mut().unwrap().insert(GPUS_ANNOTATION.into(), gpus.to_string());
        assert_eq!(failing(&s), vec![("cards", "node-1".to_owned(), Status::Warn)]);
        let lines = evaluate(&s, now());
        let l = lines.iter().find(|l| l.check == "cards" && l.object == "node-1").unwrap();
        assert!(l.message.starts_with("1 healthy card(s) of 3: card(s) 1, 2 serve no pod"), "{}", l.message);
    }

    #[test]
    fn each_broken_part_is_named_with_what_to_do() {
        let fail = |s: &Snapshot, check: &str, object: &str| {
            let lines = evaluate(s, now());
            let l = lines.iter().find(|l| l.check == check && l.object == object && l.status == Status::Fail);
            assert!(l.is_some(), "{check} on {object} not failed:\n{}", table(&lines));
            assert_eq!(failing(s).len(), 1, "only {check} fails:\n{}", table(&lines));
            l.unwrap().message.clone()
        };
        let mut s = healthy();
        s.agents[1] = pod("agent-2", "node-2", false);
        assert!(fail(&s, "agent-ready", "node-2").contains("--field-selector spec.nodeName=node-2"));
        let mut s = healthy();
        s.nodes[0] = node("node-1", json!({NODE_LABEL: "true", ISOLATION_LABEL: "held"}), false);
        assert!(fail(&s, "cards", "node-1").contains("none healthy"));
        let mut s = healthy();
        s.nodes[1].metadata.labels.as_mut().unwrap().insert(ISOLATION_LABEL.into(), "env-honoured".into());
        assert!(fail(&s, "device-isolation", "node-2").contains("when-unprivileged = false"));
        let mut s = healthy();
        s.nodes[1]
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(ISOLATION_LABEL.into(), "annotations-honoured".into());
        assert!(fail(&s, "device-isolation", "node-2").contains("pod_annotations"));
        let mut s = healthy();
        s.nodes[1].metadata.labels.as_mut().unwrap().insert(ISOLATION_LABEL.into(), "later".into());
        assert!(fail(&s, "device-isolation", "node-2").contains("serves the node to no one"));
        let mut s = healthy();
        s.allocators[0] = pod("allocator-a", "cpu", false);
        fail(&s, "allocator-ready", "allocator");
        let mut s = healthy();
        s.lease.as_mut().unwrap().spec.as_mut().unwrap().renew_time =
            Some(serde_json::from_value(json!(at(NOW - 120).replace('Z', ".000000Z"))).unwrap());
        assert!(fail(&s, "leader", "lease").contains("has not renewed"));
        let mut s = healthy();
        s.webhook.as_mut().unwrap().webhooks.as_mut().unwrap()[0].client_config.ca_bundle = None;
        assert!(fail(&s, "webhook-ca", "webhook").contains("caBundle is empty"));
        let mut s = healthy();
        s.webhook.as_mut().unwrap().webhooks.as_mut().unwrap()[0].client_config.ca_bundle =
            Some(k8s_openapi::ByteString(b"OTHER".to_vec()));
        assert!(fail(&s, "webhook-ca", "webhook").contains("not the CA the allocator serves"));
        let mut s = healthy();
        s.server_version = "v1.35.8".into();
        assert!(fail(&s, "scheduler-version", "allocator").contains("newer than the API server"));
        let mut s = healthy();
        s.namespaces.insert("nano-gpu-system".into(), namespace("nano-gpu-system", "baseline").1);
        assert!(fail(&s, "pod-security", "nano-gpu-system").contains("enforce=privileged"));
        let mut s = healthy();
        s.nodes.iter_mut().for_each(|n| n.metadata.labels = None);
        let lines = evaluate(&s, now());
        assert_eq!(lines[0].status, Status::Fail, "{}", table(&lines));
        assert!(lines[0].message.contains("kubectl label node NAME nano-gpu/node=true"));
    }

    #[test]
    fn a_policy_binding_that_is_missing_denies_nothing_or_reads_another_namespace_fails() {
        let only = |s: &Snapshot, object: &str| {
            let lines = evaluate(s, now());
            assert_eq!(
                failing(s),
                [("policy-binding", object.to_owned(), Status::Fail)],
                "{}",
                table(&lines)
            );
            lines.into_iter().find(|l| l.object == object).unwrap().message
        };
        let mut s = healthy();
        s.policy_bindings.as_mut().unwrap().remove("nano-gpu-assignments");
        assert!(only(&s, "nano-gpu-assignments").contains("can set its nano-gpu/assignment"));
        let mut s = healthy();
        s.namespace = "gpu-sharing".into();
        s.namespaces.insert("gpu-sharing".into(), namespace("gpu-sharing", "privileged").1);
        let moved = |s: &mut Snapshot, name: &str| {
            s.policy_bindings.as_mut().unwrap().insert(name.into(), binding(name, "gpu-sharing", "Deny"));
        };
        moved(&mut s, "nano-gpu-assignments");
        moved(&mut s, "nano-gpu-agent-own-node");
        let message = only(&s, "nano-gpu-own-keys");
        assert!(message.contains("\"nano-gpu-system\", not nano-gpu's gpu-sharing"), "{message}");
        moved(&mut s, "nano-gpu-own-keys");
        assert!(failing(&s).is_empty());
        // The DRA component's binding is judged where it is installed.
        let mut s = healthy();
        let slices = binding("nano-gpu-agent-own-slice", "nano-gpu-system", "Warn");
        s.policy_bindings.as_mut().unwrap().insert("nano-gpu-agent-own-slice".into(), slices);
        assert!(only(&s, "nano-gpu-agent-own-slice").contains("refuses nothing"));
        // A policy that reads no parameter is judged by its action only.
        let mut s = healthy();
        let mut claims = binding("nano-gpu-claim-for-its-pod", "", "Deny");
        claims.spec.as_mut().unwrap().param_ref = None;
        s.policy_bindings.as_mut().unwrap().insert("nano-gpu-claim-for-its-pod".into(), claims.clone());
        assert!(failing(&s).is_empty());
        claims.spec.as_mut().unwrap().validation_actions = Some(vec!["Audit".into()]);
        s.policy_bindings.as_mut().unwrap().insert("nano-gpu-claim-for-its-pod".into(), claims);
        assert!(only(&s, "nano-gpu-claim-for-its-pod").contains("escapes the driver's memory limit"));
        let mut s = healthy();
        s.policy_bindings = Err("forbidden".into());
        assert_eq!(failing(&s), [("policy-binding", "policies".to_owned(), Status::Warn)]);
    }

    #[test]
    fn the_bindings_judged_are_the_ones_the_install_has() {
        let installed: BTreeSet<&str> = nano_gpu_proto::install::OUTSIDE
            .iter()
            .filter(|o| o.kind == "ValidatingAdmissionPolicyBinding")
            .map(|o| o.name)
            .collect();
        let judged: BTreeSet<&str> = POLICY_BINDINGS.iter().map(|(name, ..)| *name).collect();
        assert_eq!(judged, installed);
    }

    #[test]
    fn what_cannot_be_told_or_is_only_near_is_a_warning() {
        let mut s = healthy();
        s.secret = Err("secrets is forbidden".into());
        s.namespaces.insert("team".into(), namespace("team", "privileged").1);
        s.nodes[0].metadata.labels.as_mut().unwrap().remove(ISOLATION_LABEL);
        let warned: Vec<_> = failing(&s);
        assert_eq!(
            warned,
            vec![
                ("device-isolation", "node-1".to_owned(), Status::Warn),
                ("webhook-ca", "webhook".to_owned(), Status::Warn),
                ("pod-security", "team".to_owned(), Status::Warn),
            ]
        );
        let mut s = healthy();
        let secret = s.secret.as_mut().unwrap().as_mut().unwrap();
        secret
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(NOT_AFTER_ANNOTATION.into(), at(NOW + 3 * 86_400));
        assert_eq!(failing(&s), vec![("certificate", "webhook".to_owned(), Status::Warn)]);
        // Another device plugin on a node: nano-gpu serves only the cards it does not, worth a look.
        let mut s = healthy();
        s.nodes[0].status =
            Some(serde_json::from_value(json!({"capacity": {"nvidia.com/gpu": "4"}})).unwrap());
        assert_eq!(failing(&s), vec![("one-plugin", "node-1".to_owned(), Status::Warn)]);
        // NVIDIA's time-slicing and MIG resources are other plugins' cards too; Intel's plugin's
        // devices cannot be tied to a card, so it fails.
        let mut s = healthy();
        s.nodes[0].status = Some(
            serde_json::from_value(
                json!({"capacity": {"nvidia.com/gpu.shared": "8", "nvidia.com/mig-1g.10gb": "0"}}),
            )
            .unwrap(),
        );
        let lines = evaluate(&s, now());
        let plugin = lines.iter().find(|l| l.check == "one-plugin" && l.object == "node-1").unwrap();
        assert_eq!(plugin.status, Status::Warn);
        assert!(plugin.message.contains("(nvidia.com/gpu.shared 8)"), "{}", plugin.message);
        s.nodes[0].status =
            Some(serde_json::from_value(json!({"capacity": {"gpu.intel.com/i915": "1"}})).unwrap());
        assert_eq!(failing(&s), vec![("one-plugin", "node-1".to_owned(), Status::Fail)]);
        assert_eq!(
            (minor("v1.37.2"), minor("registry.k8s.io/kube-scheduler:v1.35.8")),
            (Some((1, 37)), Some((1, 35)))
        );
    }

    #[test]
    fn the_default_scheduler_profiles_certificates_are_watched() {
        // A client CA that ends `days` from NOW, in the profile's Secret.
        let with_ca = |days: Option<u64>| {
            let mut s = healthy();
            let pem = match days {
                Some(d) => {
                    let (from, to) =
                        (now() - Duration::from_secs(86_400), now() + Duration::from_secs(d * 86_400));
                    crate::service::tls::generate(&["kube-scheduler".into()], Some((from, to)))
                        .unwrap()
                        .ca_pem
                }
                None => "not a certificate".into(),
            };
            let secret = json!({"metadata": {"name": "nano-gpu-extender-client-ca"},
                "data": {"ca.crt": k8s_openapi::ByteString(pem.into_bytes())}});
            s.extender_client_ca = Ok(Some(serde_json::from_value(secret).unwrap()));
            s
        };
        let lines = |s: &Snapshot| -> Vec<(String, Status, String)> {
            evaluate(s, now())
                .into_iter()
                .filter(|l| l.object.starts_with("extender"))
                .map(|l| (l.object, l.status, l.message))
                .collect()
        };
        // Not in use: no line.
        assert!(lines(&healthy()).is_empty());
        // A CA with a year left; the webhook certificate (200 days left) is renewed in 170 days.
        let s = with_ca(Some(365));
        let got = lines(&s);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!((got[0].0.as_str(), got[0].1), ("extender-client-ca", Status::Ok));
        assert!(got[0].2.starts_with("ends in 364 days"), "{}", got[0].2);
        assert_eq!((got[1].0.as_str(), got[1].1), ("extender-ca-copy", Status::Ok));
        let renewal = date(now() + Duration::from_secs(170 * 86_400));
        assert!(got[1].2.contains(&format!("renewed on {renewal}")), "{}", got[1].2);
        // Near its end, ended, unusable.
        assert_eq!(
            failing(&with_ca(Some(10))),
            vec![("certificate", "extender-client-ca".to_owned(), Status::Warn)]
        );
        assert!(lines(&with_ca(Some(10)))[0].2.contains("rotate it"));
        let mut ended = with_ca(Some(0));
        let ca = ended.extender_client_ca.as_mut().unwrap().as_mut().unwrap();
        let (from, to) = (now() - Duration::from_secs(90 * 86_400), now() - Duration::from_secs(2 * 86_400));
        let old = crate::service::tls::generate(&["kube-scheduler".into()], Some((from, to))).unwrap().ca_pem;
        ca.data.as_mut().unwrap().insert("ca.crt".into(), k8s_openapi::ByteString(old.into_bytes()));
        assert_eq!(failing(&ended), vec![("certificate", "extender-client-ca".to_owned(), Status::Fail)]);
        assert_eq!(
            failing(&with_ca(None)),
            vec![("certificate", "extender-client-ca".to_owned(), Status::Fail)]
        );
        // The webhook certificate's renewal within 14 days: the copy is due.
        let mut due = with_ca(Some(365));
        let secret = due.secret.as_mut().unwrap().as_mut().unwrap();
        secret
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(NOT_AFTER_ANNOTATION.into(), at(NOW + 40 * 86_400));
        assert_eq!(failing(&due), vec![("certificate", "extender-ca-copy".to_owned(), Status::Warn)]);
        assert!(lines(&due)[1].2.starts_with("in 10 days, the webhook certificate is renewed on"));
        // An unreadable Secret warns.
        let mut hidden = healthy();
        hidden.extender_client_ca = Err("secrets is forbidden".into());
        assert_eq!(failing(&hidden), vec![("certificate", "extender-client-ca".to_owned(), Status::Warn)]);
    }

    #[test]
    fn the_runtime_class_gpu_pods_are_given_must_exist() {
        let with_class = |classes: Result<BTreeMap<String, RuntimeClass>, String>| {
            let mut s = healthy();
            let spec = s.deployment.as_mut().unwrap().spec.as_mut().unwrap().template.spec.as_mut().unwrap();
            let env = json!([{"name": "NANO_GPU_RUNTIME_CLASS", "value": "nvidia"}]);
            spec.containers[0].env = Some(serde_json::from_value(env).unwrap());
            s.runtime_classes = classes;
            s
        };
        let class = |extra: serde_json::Value| {
            let mut rc = json!({"metadata": {"name": "nvidia"}, "handler": "nvidia"});
            rc.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            Ok([("nvidia".to_owned(), serde_json::from_value::<RuntimeClass>(rc).unwrap())].into())
        };
        // No class set: no line; the class there: ok.
        assert!(!evaluate(&healthy(), now()).iter().any(|l| l.check == "runtime-class"));
        let lines = evaluate(&with_class(class(json!({}))), now());
        let ok = lines.iter().find(|l| l.check == "runtime-class").unwrap();
        assert_eq!((ok.status, ok.message.as_str()), (Status::Ok, "GPU pods run under handler nvidia"));
        let object = "runtimeclass/nvidia".to_owned();
        let missing = with_class(Ok(BTreeMap::new()));
        assert_eq!(failing(&missing), vec![("runtime-class", object.clone(), Status::Fail)]);
        assert!(evaluate(&missing, now()).iter().any(|l| l.message.contains("does not exist")));
        // A class's overhead and scheduling hold for the pods the webhook gives it: nothing to warn
        // about.
        let overhead = with_class(class(json!({"overhead": {"podFixed": {"memory": "64Mi"}}})));
        assert!(failing(&overhead).is_empty());
        let scheduling = with_class(class(json!({"scheduling": {"nodeSelector": {"gpu": "true"}}})));
        let lines = evaluate(&scheduling, now());
        let ok = lines.iter().find(|l| l.check == "runtime-class").unwrap();
        assert!(
            ok.status == Status::Ok && ok.message.contains("with the class's overhead and scheduling"),
            "{}",
            ok.message
        );
        let unreadable = with_class(Err("runtimeclasses is forbidden".into()));
        assert_eq!(failing(&unreadable), vec![("runtime-class", object, Status::Warn)]);
    }

    #[test]
    fn a_dry_run_gpu_pod_must_be_sent_to_nano_gpus_profile() {
        let mut s = healthy();
        let dry = |s: &Snapshot| {
            let l = evaluate(s, now()).into_iter().find(|l| l.check == "webhook-dry-run").unwrap();
            (l.object.clone(), l.status, l.message)
        };
        assert_eq!(dry(&s).1, Status::Ok, "{:?}", dry(&s));
        assert_eq!(dry(&s).0, "team/nano-gpu-check-dry-run");
        // Left as written: the webhook was not called.
        s.dry_run = Some(("team".into(), DryRun::Admitted(Box::new(admitted("default-scheduler")))));
        let (_, status, message) = dry(&s);
        assert_eq!(status, Status::Fail);
        assert!(message.contains("the webhook was not called") && message.contains("team"), "{message}");
        // Refused at admission (the API server cannot reach the webhook).
        let refused = "Internal error occurred: failed calling webhook \"pods.nano-gpu.io\": x509";
        s.dry_run = Some(("team".into(), DryRun::Refused(refused.into())));
        let (_, status, message) = dry(&s);
        assert_eq!(status, Status::Fail);
        assert!(message.contains("failed calling webhook"), "{message}");
        // A user who may not create pods there: admission is not tried, which is worth a look only.
        let forbidden =
            "pods is forbidden: User \"viewer\" cannot create resource \"pods\" in the namespace \"team\"";
        s.dry_run = Some(("team".into(), DryRun::NotAllowed(forbidden.into())));
        let (_, status, message) = dry(&s);
        assert_eq!(status, Status::Warn);
        assert!(message.contains("may not create pods in team"), "{message}");
        // Another profile name, set on the allocator: the pod must go there.
        s.dry_run = Some(("team".into(), DryRun::Admitted(Box::new(admitted("gpu-scheduler")))));
        assert_eq!(dry(&s).1, Status::Fail);
        let deployment = s.deployment.as_mut().unwrap();
        let spec = deployment.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
        spec.containers[0].args = Some(vec!["serve".into(), "--scheduler-name=gpu-scheduler".into()]);
        assert_eq!(dry(&s).1, Status::Ok, "{:?}", dry(&s));
        // With DRA shares the pod's request becomes claims.
        let mut claims = admitted("default-scheduler");
        claims.spec.as_mut().unwrap().resource_claims = Some(vec![
            serde_json::from_value(json!({"name": "gpu-0", "resourceClaimTemplateName": "nano-gpu-p10"}))
                .unwrap(),
        ]);
        s.dry_run = Some(("team".into(), DryRun::Admitted(Box::new(claims))));
        assert_eq!(dry(&s).1, Status::Ok, "{:?}", dry(&s));
        // Not tried: no line.
        s.dry_run = None;
        assert!(evaluate(&s, now()).iter().all(|l| l.check != "webhook-dry-run"));
    }
}
