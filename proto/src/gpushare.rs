//! Compatibility with Aliyun gpushare: the pod annotations its scheduler extender wrote at bind, which
//! its device plugin, `kubectl inspect gpushare` and existing workloads read. nano-gpu writes them (as
//! well as its own assignment) for pods that ask `aliyun.com/gpu-mem`, when compatibility is on.

use crate::quantity;
use crate::resources::GPUSHARE_MEMORY;
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;

/// Index of the card the pod got.
pub const IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
/// The pod's total `aliyun.com/gpu-mem` (sum of its containers' limits), in gpushare units.
pub const POD: &str = "ALIYUN_COM_GPU_MEM_POD";
/// The container's own `aliyun.com/gpu-mem` (environment only, set by the device plugin).
pub const CONTAINER: &str = "ALIYUN_COM_GPU_MEM_CONTAINER";
/// The card's memory in gpushare units.
pub const DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
/// `"false"` at bind; gpushare's device plugin sets `"true"` after Allocate.
pub const ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";
/// Bind time in nanoseconds since the epoch (gpushare's device plugin sorts candidates by it).
pub const ASSUME_TIME: &str = "ALIYUN_COM_GPU_MEM_ASSUME_TIME";

/// Newer gpushare extenders (multi-card pods) also write, per container index, the units each card
/// index got: `{"0":{"1":4}}`; gpushare's tools read it before [`IDX`].
pub const ALLOCATION: &str = "scheduler.framework.gpushare.allocation";

/// Every key, for removal on a failed bind.
pub const KEYS: [&str; 5] = [IDX, POD, DEV, ASSIGNED, ASSUME_TIME];

/// Where gpushare placed a pod, read from its annotations the way gpushare's own tools read them
/// ([`ALLOCATION`] first, else [`IDX`] with the pod's total units): per card index, the units it holds.
/// `None` when the pod carries neither; an error says what cannot be read.
pub fn placement(pod: &Pod) -> Option<Result<BTreeMap<u32, u64>, String>> {
    let annotations = pod.metadata.annotations.as_ref()?;
    if let Some(text) = annotations.get(ALLOCATION) {
        return Some(read_allocation(text).map_err(|e| format!("{ALLOCATION} {text:?}: {e}")));
    }
    let text = annotations.get(IDX)?;
    Some(match text.trim().parse::<u32>() {
        Ok(index) => Ok(BTreeMap::from([(index, pod_units(pod))])),
        Err(_) => Err(format!("{IDX} {text:?} is not a card index")),
    })
}

fn read_allocation(text: &str) -> Result<BTreeMap<u32, u64>, String> {
    let per_container: BTreeMap<String, BTreeMap<String, u64>> =
        serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut cards = BTreeMap::new();
    for units in per_container.values() {
        for (index, n) in units {
            let index: u32 = index.parse().map_err(|_| format!("{index:?} is not a card index"))?;
            *cards.entry(index).or_default() += n;
        }
    }
    Ok(cards)
}

/// The pod's total `aliyun.com/gpu-mem` over its app containers (limits, else requests); 0 when it
/// asks none or a value is not a whole number.
pub fn pod_units(pod: &Pod) -> u64 {
    let containers = pod.spec.as_ref().map(|s| s.containers.as_slice()).unwrap_or_default();
    containers
        .iter()
        .filter_map(|c| {
            let r = c.resources.as_ref()?;
            let q = r
                .limits
                .as_ref()
                .and_then(|m| m.get(GPUSHARE_MEMORY))
                .or_else(|| r.requests.as_ref()?.get(GPUSHARE_MEMORY))?;
            quantity::whole(&q.0).ok()
        })
        .sum()
}

/// The annotations gpushare wrote at bind.
pub fn annotations(
    card_index: u32,
    pod_units: u64,
    dev_units: u64,
    assume_time_ns: u128,
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (IDX.to_owned(), card_index.to_string()),
        (POD.to_owned(), pod_units.to_string()),
        (DEV.to_owned(), dev_units.to_string()),
        (ASSIGNED.to_owned(), "false".to_owned()),
        (ASSUME_TIME.to_owned(), assume_time_ns.to_string()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pod_units_sum_the_containers() {
        let pod: Pod = serde_json::from_value(json!({"spec": {"containers": [
            {"name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}},
            {"name": "b", "resources": {"requests": {"aliyun.com/gpu-mem": "2"}}},
            {"name": "c"}]}}))
        .unwrap();
        assert_eq!(pod_units(&pod), 5);
    }

    fn annotated(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"annotations": annotations}, "spec": {"containers": [
            {"name": "a", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}}))
        .unwrap()
    }

    #[test]
    fn placement_is_read_as_gpushare_tools_read_it() {
        assert_eq!(placement(&annotated(json!({}))), None);
        assert_eq!(placement(&annotated(json!({IDX: "2"}))), Some(Ok(BTreeMap::from([(2, 3)]))));
        // The per-container map wins over the index, and sums per card.
        let multi = json!({IDX: "0", ALLOCATION: r#"{"0":{"1":2,"3":1},"1":{"1":4}}"#});
        assert_eq!(placement(&annotated(multi)), Some(Ok(BTreeMap::from([(1, 6), (3, 1)]))));
        for bad in [
            json!({IDX: "x"}),
            json!({IDX: "-1"}),
            json!({ALLOCATION: "{"}),
            json!({ALLOCATION: r#"{"0":{"a":1}}"#}),
        ] {
            let err = placement(&annotated(bad.clone())).unwrap().unwrap_err();
            assert!(err.contains("ALIYUN_COM_GPU_MEM_IDX") || err.contains(ALLOCATION), "{bad}: {err}");
        }
    }

    #[test]
    fn annotations_are_the_ones_gpushare_wrote() {
        let a = annotations(1, 3, 16, 1_700_000_000_123_456_789);
        assert_eq!(a[IDX], "1");
        assert_eq!(a[POD], "3");
        assert_eq!(a[DEV], "16");
        assert_eq!(a[ASSIGNED], "false");
        assert_eq!(a[ASSUME_TIME], "1700000000123456789");
        assert_eq!(a.len(), KEYS.len());
    }
}
