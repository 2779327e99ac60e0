//! The names nano-gpu's DRA driver and its allocator agree on: the driver (also the DeviceClass's
//! name), the capacities a share consumes, a card's device name in its node's ResourceSlice, and the
//! finalizer an allocation carries.

/// The DRA driver's name: the ResourceSlices', the DeviceClass's and the claims' `driver`.
pub const DRIVER: &str = "gpu.nano-gpu.io";
/// The DeviceClass claims name to get nano-gpu's cards (the driver's name).
pub const CLASS: &str = DRIVER;
/// The capacity of a card that shares consume, in percent of its compute (1 to 100).
pub const PERCENT: &str = "percent";
/// The capacity of a card that shares consume, in card memory.
pub const MEMORY: &str = "memory";
/// A device's name in the node's ResourceSlice: `gpu-<index>`.
pub const DEVICE_PREFIX: &str = "gpu-";
/// The finalizer of an allocated claim (Kubernetes' own, `resource.kubernetes.io/delete-protection`):
/// with it, the ResourceClaim controller clears the allocation once no pod uses the claim.
pub const ALLOCATED_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// The pod a ResourceClaim was made for from a ResourceClaimTemplate: its controlling owner of kind
/// Pod (as Kubernetes' claim controller writes it). Only that pod may use such a claim; a claim
/// without one may be named, and joined, by any pod of its namespace.
#[cfg(feature = "k8s")]
pub fn made_for_pod(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    let owners = meta.owner_references.as_deref().unwrap_or_default();
    owners.iter().find(|o| o.controller == Some(true) && o.kind == "Pod" && o.api_version == "v1")
}

/// The ResourceClaim a pod's `resourceClaims` entry `entry` stands for: the claim it names, or the
/// one made for it from its template, as the pod's status records it (`None` until then, or for an
/// entry the pod does not have).
#[cfg(feature = "k8s")]
pub fn claim_of_entry(pod: &k8s_openapi::api::core::v1::Pod, entry: &str) -> Option<String> {
    let entries = pod.spec.as_ref().and_then(|s| s.resource_claims.as_deref()).unwrap_or_default();
    let own = entries.iter().find(|c| c.name == entry)?;
    if let Some(name) = &own.resource_claim_name {
        return Some(name.clone());
    }
    let made = pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default();
    made.iter().find(|m| m.name == entry)?.resource_claim_name.clone()
}

/// The device name of the card of `index`.
pub fn device_name(index: u32) -> String {
    format!("{DEVICE_PREFIX}{index}")
}

/// The card index a device name stands for, if it is one of the driver's names.
pub fn card_index(device: &str) -> Option<u32> {
    let digits = device.strip_prefix(DEVICE_PREFIX)?;
    // `gpu-01` or `gpu-+1` would name card 1 too: only the canonical spelling is a name.
    let index: u32 = digits.parse().ok()?;
    (device_name(index) == device).then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_only_canonical_ones_parse() {
        assert_eq!(device_name(3), "gpu-3");
        assert_eq!(card_index("gpu-3"), Some(3));
        assert_eq!(card_index("gpu-12"), Some(12));
        for bad in ["gpu-", "gpu-01", "gpu-+1", "gpu--1", "card-1", "gpu-1x", "gpu-4294967296"] {
            assert_eq!(card_index(bad), None, "{bad}");
        }
    }

    #[cfg(feature = "k8s")]
    #[test]
    fn a_claim_is_made_for_its_controlling_pod_owner_only() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let meta = |owners: serde_json::Value| -> ObjectMeta {
            serde_json::from_value(serde_json::json!({"name": "c", "ownerReferences": owners})).unwrap()
        };
        let made = meta(serde_json::json!([
            {"apiVersion": "v1", "kind": "Pod", "name": "other", "uid": "u0"},
            {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1", "controller": true}]));
        assert_eq!(made_for_pod(&made).map(|o| (o.name.as_str(), o.uid.as_str())), Some(("p", "u1")));
        let not_a_pod = meta(serde_json::json!([
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "u2", "controller": true}]));
        assert!(made_for_pod(&not_a_pod).is_none());
        assert!(made_for_pod(&ObjectMeta::default()).is_none());
    }
}
