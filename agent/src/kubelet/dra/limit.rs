//! The driver's per-pod memory limit for claims (`--memory-limit driver`), set when the kubelet
//! prepares a claim. The kubelet makes the pod's cgroup before it prepares the pod's claims, and
//! creates no container of the pod before they are prepared, so the limit is in place before any
//! process of the pod runs, as the device plugin's is at PreStartContainer.
//!
//! The limit is the pod's on each card: what all its claims of this driver hold there (a share's
//! asked memory, else its percent of the card's: the one memory rule), as the device plugin's is
//! what all the pod's containers hold. Whole cards get none.
//!
//! Only a claim made for one pod (from a ResourceClaimTemplate: its controlling owner is that pod)
//! may hold a share on such a node. The kubelet prepares a claim once: a pod that joins a claim
//! already prepared for another pod is never shown to the driver and would run unlimited, so a claim
//! that could be shared is refused with the reason instead (the allocator does not place one there).

use super::Claims;
use super::prepare::Grant;
use crate::cards::inventory::Card;
use crate::node::enforce::driver::PodLimit;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::units::{MiB, Percent};
use std::sync::Arc;

/// Whether `grant` is a share of an NVIDIA card among `cards`: what the driver limits.
fn is_limited_share(grant: &Grant, cards: &[Card]) -> bool {
    grant.percent < 100 && cards.iter().any(|c| c.info.uuid == grant.uuid && c.info.vendor == Vendor::Nvidia)
}

/// What `grants` (all of one pod's claims of this driver on this node) hold on each card that one
/// of them shares, in the order the cards first appear: the pod's limit there. Pure.
pub fn pod_limits(grants: &[Grant], cards: &[Card]) -> Vec<(String, MiB)> {
    let mut out: Vec<(String, MiB)> = Vec::new();
    for g in grants.iter().filter(|g| is_limited_share(g, cards)) {
        if out.iter().any(|(uuid, _)| *uuid == g.uuid) {
            continue;
        }
        let card = cards.iter().find(|c| c.info.uuid == g.uuid).expect("a limited share's card is known");
        let memory = grants
            .iter()
            .filter(|h| h.uuid == g.uuid)
            .map(|h| h.memory.unwrap_or_else(|| Percent(h.percent).of(card.info.memory_mib)).0)
            .sum();
        out.push((g.uuid.clone(), MiB(memory)));
    }
    out
}

/// A consumer the claim is reserved for other than the pod `owner` (its UID), as `kind name`.
fn other_consumer(claim: &ResourceClaim, owner: &str) -> Option<String> {
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_deref()).unwrap_or_default();
    reserved.iter().find(|r| r.uid != owner).map(|r| format!("{} {}", r.resource, r.name))
}

/// The names of the ResourceClaims `pod` uses: those it names, and those made for it from templates
/// (as its status records them; one not made yet is left out).
pub fn pod_claim_names(pod: &Pod) -> Vec<String> {
    let spec = pod.spec.as_ref().and_then(|s| s.resource_claims.as_deref()).unwrap_or_default();
    spec.iter().filter_map(|c| nano_gpu_proto::dra::claim_of_entry(pod, &c.name)).collect()
}

/// Sets the limits `claim` (whose devices here are `grants`) calls for: for its pod, what all the
/// pod's claims of this driver hold on each card it shares. Nothing to do without a share of an
/// NVIDIA card. A claim not made for one pod, a pod that cannot be read, or a limit that cannot be
/// set is an error that names it: the kubelet then prepares the claim again later, and starts no
/// container of the pod unlimited meanwhile.
pub(super) async fn set<C: Claims>(
    claims: &super::Memo<'_, C>,
    limit: &Arc<dyn PodLimit>,
    claim: &ResourceClaim,
    grants: &[Grant],
    node: &str,
    cards: &[Card],
) -> Result<(), String> {
    if !grants.iter().any(|g| is_limited_share(g, cards)) {
        return Ok(());
    }
    let namespace = claim.metadata.namespace.as_deref().unwrap_or("");
    let name = claim.metadata.name.as_deref().unwrap_or("");
    let owner = nano_gpu_proto::dra::made_for_pod(&claim.metadata).ok_or_else(|| {
        format!(
            "claim {namespace}/{name} holds a share, and this node sets the driver's memory limit per pod \
             (--memory-limit driver): only a claim made for one pod from a ResourceClaimTemplate may hold \
             one here (the kubelet prepares a claim once, so a pod joining it later would run \
             unlimited); use a ResourceClaimTemplate, or whole cards"
        )
    })?;
    let (pod_name, pod_uid) = (&owner.name, &owner.uid);
    let key = format!("{namespace}/{pod_name}");
    if let Some(other) = other_consumer(claim, pod_uid) {
        return Err(format!(
            "claim {namespace}/{name} was made for pod {key} and is reserved for {other} too: the driver's \
             memory limit is set for the pod a claim was made for only"
        ));
    }
    let pod = claims.pod(namespace, pod_name).await?;
    if pod.metadata.uid.as_ref() != Some(pod_uid) {
        return Err(format!("pod {key}, which claim {name} was made for, is gone (another has its name)"));
    }
    let mut all = grants.to_vec();
    for other in pod_claim_names(&pod).into_iter().filter(|n| n != name) {
        let read = claims.get(namespace, &other).await?;
        // A claim of another driver holds nothing here; one of this driver that cannot be
        // prepared fails its own preparation, and the pod starts with neither.
        all.extend(super::prepare::grants(&read, node, cards).unwrap_or_default());
    }
    for (uuid, memory) in pod_limits(&all, cards) {
        let (limit, card, uid) = (limit.clone(), uuid.clone(), pod_uid.clone());
        let cgroup = tokio::task::spawn_blocking(move || limit.limit_pod(&card, &uid, memory))
            .await
            .map_err(|e| format!("setting the memory limit: {e}"))?
            .map_err(|e| format!("pod {key}: the driver's memory limit was not set: {e}"))?;
        tracing::info!(pod = %key, card = %uuid, memory_mib = memory.0, cgroup = %cgroup.display(), claim = %format!("{namespace}/{name}"), "driver memory limit set");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(uuid: &str, percent: u32, memory: Option<u64>) -> Grant {
        Grant {
            request: "r".into(),
            device: "gpu-0".into(),
            share_id: None,
            uuid: uuid.into(),
            percent,
            memory: memory.map(MiB),
        }
    }

    #[test]
    fn a_pods_limit_on_a_card_is_what_all_its_claims_hold_there() {
        let cards = vec![
            Card::nvidia(0, "GPU-a", "A100", MiB(80_000), None),
            Card::nvidia(1, "GPU-b", "A100", MiB(80_000), None),
            Card::nvidia(2, "GPU-c", "A100", MiB(80_000), None),
        ];
        // 30 % asking 2 GiB and 20 % asking none (20 % of 80,000 MiB) on GPU-a; a whole GPU-b; a
        // memory-only share on GPU-c.
        let grants = [
            grant("GPU-a", 30, Some(2048)),
            grant("GPU-b", 100, None),
            grant("GPU-a", 20, None),
            grant("GPU-c", 5, Some(4000)),
        ];
        assert_eq!(
            pod_limits(&grants, &cards),
            vec![("GPU-a".to_owned(), MiB(2048 + 16_000)), ("GPU-c".to_owned(), MiB(4000))]
        );
        assert!(pod_limits(&[grant("GPU-b", 100, None)], &cards).is_empty(), "a whole card has none");
        let intel = [Card {
            info: nano_gpu_proto::annotations::GpuInfo { vendor: Vendor::Intel, ..cards[0].info.clone() },
            ..cards[0].clone()
        }];
        assert!(
            pod_limits(&[grant("GPU-a", 30, None)], &intel).is_empty(),
            "the driver limits only NVIDIA cards"
        );
    }

    #[test]
    fn a_pods_claims_include_those_made_from_its_templates() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "gpu", "resourceClaimTemplateName": "t"},
                {"name": "named", "resourceClaimName": "shared-one"},
                {"name": "later", "resourceClaimTemplateName": "t"}]},
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x"}]}}))
        .unwrap();
        assert_eq!(pod_claim_names(&pod), vec!["p-gpu-x".to_owned(), "shared-one".to_owned()]);
    }
}
