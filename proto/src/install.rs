//! What the shipped install (`deploy/` and its components) makes outside its own namespace, and what
//! nano-gpu leaves on nodes: `kubectl nano-gpu uninstall` removes exactly these, and a test builds
//! every component with kustomize and checks that the install makes nothing else outside
//! [`NAMESPACE`].

/// The namespace everything else of the install is in.
pub const NAMESPACE: &str = "nano-gpu-system";

/// The prefix of every label and annotation key nano-gpu writes or reads on Nodes.
pub const KEY_PREFIX: &str = "nano-gpu/";

/// The scheduler name the webhook gives GPU pods (the allocator Deployment's kube-scheduler).
pub const SCHEDULER_NAME: &str = "nano-gpu-scheduler";

/// The label of the agent pods (`deploy/agent.yaml`), which the allocator's `--require-ready-agent`
/// names in the shipped install.
pub const AGENT_LABEL: (&str, &str) = ("app.kubernetes.io/name", "nano-gpu-agent");

/// An object the install makes outside [`NAMESPACE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Object {
    /// API group (`""`: the core group).
    pub group: &'static str,
    /// API version.
    pub version: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Resource (plural, as in the API path).
    pub plural: &'static str,
    /// Namespace (`""`: cluster-scoped).
    pub namespace: &'static str,
    /// Name.
    pub name: &'static str,
}

const fn object(
    group: &'static str,
    kind: &'static str,
    plural: &'static str,
    namespace: &'static str,
    name: &'static str,
) -> Object {
    Object { group, version: "v1", kind, plural, namespace, name }
}

const RBAC: &str = "rbac.authorization.k8s.io";
const ADMISSION: &str = "admissionregistration.k8s.io";

/// Every object of the install (base and components) outside [`NAMESPACE`]: the webhook first, then
/// the admission policies, the DeviceClass and the rights.
pub const OUTSIDE: [Object; 25] = [
    object(
        ADMISSION,
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        "",
        "nano-gpu-allocator",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-assignments",
    ),
    object(ADMISSION, "ValidatingAdmissionPolicy", "validatingadmissionpolicies", "", "nano-gpu-assignments"),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-agent-own-node",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
        "",
        "nano-gpu-agent-own-node",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-own-keys",
    ),
    object(ADMISSION, "ValidatingAdmissionPolicy", "validatingadmissionpolicies", "", "nano-gpu-own-keys"),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-agent-own-slice",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
        "",
        "nano-gpu-agent-own-slice",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-claim-for-its-pod",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
        "",
        "nano-gpu-claim-for-its-pod",
    ),
    object(
        ADMISSION,
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        "",
        "nano-gpu-claim-owner",
    ),
    object(ADMISSION, "ValidatingAdmissionPolicy", "validatingadmissionpolicies", "", "nano-gpu-claim-owner"),
    object("resource.k8s.io", "DeviceClass", "deviceclasses", "", crate::dra::DRIVER),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-agent"),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-agent-dra"),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-allocator"),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-allocator-dra"),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-scheduler-access"),
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-scheduler-volumes"),
    object(RBAC, "ClusterRole", "clusterroles", "", "nano-gpu-agent"),
    object(RBAC, "ClusterRole", "clusterroles", "", "nano-gpu-agent-dra"),
    object(RBAC, "ClusterRole", "clusterroles", "", "nano-gpu-allocator"),
    object(RBAC, "ClusterRole", "clusterroles", "", "nano-gpu-allocator-dra"),
    object(RBAC, "ClusterRole", "clusterroles", "", "nano-gpu-scheduler"),
];

/// What earlier versions of the install made outside [`NAMESPACE`] and this one no longer does (an
/// upgrade by `kubectl apply` leaves it): deleted too, where it is, by an uninstall.
pub const EARLIER: [Object; 2] = [
    // Until 0.1.0 (commit cac7fa4 included): the allocator's kube-scheduler read the cluster's client CA
    // for its secure port; it now skips that lookup (`--authentication-skip-lookup`).
    object(RBAC, "RoleBinding", "rolebindings", "kube-system", "nano-gpu-scheduler-authentication-reader"),
    // Until 0.1.0 (commit ced8cf9 included): the allocator's kube-scheduler held upstream's
    // `system:kube-scheduler`, which may take the default scheduler's Lease.
    object(RBAC, "ClusterRoleBinding", "clusterrolebindings", "", "nano-gpu-scheduler"),
];

/// What the agent and the MPS daemons leave on a node's filesystem, by directory: the paths
/// `nano-gpu-agent clean-node` removes, relative to the directories it is given.
pub mod node_files {
    /// Under the host's `/run`: the MPS daemons' directories (a `hostPath` of both DaemonSets).
    pub const RUN_DIR: &str = "nano-gpu";
    /// Under the kubelet's root: the device plugins' sockets start with this.
    pub const DEVICE_PLUGINS: (&str, &str) = ("device-plugins", "nano-gpu");
    /// Under the kubelet's root: the DRA registration sockets start with the driver's name.
    pub const PLUGINS_REGISTRY: (&str, &str) = ("plugins_registry", crate::dra::DRIVER);
    /// Under the kubelet's root: the DRA plugin's own directory.
    pub const PLUGIN_DIR: (&str, &str) = ("plugins", crate::dra::DRIVER);
    /// In the CDI spec directory (`/var/run/cdi`): the claims' specs start with this.
    pub const CDI_SPECS: &str = "nano-gpu.io-claim_";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_object_is_named_once_and_none_is_in_the_namespace() {
        let all: Vec<&Object> = OUTSIDE.iter().chain(&EARLIER).collect();
        for (i, a) in all.iter().enumerate() {
            assert_ne!(a.namespace, NAMESPACE, "{a:?}");
            assert!(
                all[i + 1..].iter().all(|b| (a.kind, a.namespace, a.name) != (b.kind, b.namespace, b.name))
            );
        }
    }
}
