//! A pod's GPU demand, read from a `k8s_openapi` Pod.
//!
//! Per container: a share of one card (`nano-gpu/gpu-percent` 1..=99 and/or `nano-gpu/gpu-memory`),
//! or whole cards (a multiple of 100; 100 is one whole card, exclusive). Init containers are combined the way the kubelet's device
//! manager combines them: an init container runs before the app containers and its device IDs are
//! reused by them, so it rides on the card(s) of the largest app container of its kind, which grows to
//! cover it (the pod holds `max(init, app)` there). Invalid requests are data with a human message,
//! never a panic.

use crate::quantity;
use crate::resources::{GPU_MEMORY, GPU_MODEL_ANNOTATION, GPU_PERCENT, GPUSHARE_MEMORY};
use crate::units::{CpuMilli, MiB, Percent};
use k8s_openapi::api::core::v1::{Container, Pod};
use std::collections::BTreeMap;
use thiserror::Error;

/// What one container (or one slot of containers) needs from GPU cards.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CardDemand {
    /// A share of one card. At least one of the two is set; a memory-only share (gpushare style) takes
    /// the percent of the card that its memory is.
    Share {
        /// Share of the card's compute, 1..=99.
        percent: Option<Percent>,
        /// Memory on the card.
        memory: Option<MiB>,
    },
    /// Whole cards, exclusive to this container.
    Whole {
        /// Number of cards, at least 1.
        cards: u32,
        /// The least memory each card must have, if asked.
        memory: Option<MiB>,
    },
}

impl CardDemand {
    /// Total size in percent of one card, for comparing demands (a memory-only share counts as 0).
    pub fn size(&self) -> u64 {
        match self {
            CardDemand::Share { percent, .. } => percent.map_or(0, |p| u64::from(p.0)),
            CardDemand::Whole { cards, .. } => 100 * u64::from(*cards),
        }
    }
}

/// One container's demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerDemand {
    /// Container name.
    pub name: String,
    /// What it needs.
    pub gpu: CardDemand,
}

/// A unit of placement: one app container's demand, plus the init containers that ride on its card(s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// What the slot holds on its card(s) for the life of the pod.
    pub demand: CardDemand,
    /// The containers served by the slot's card(s): the app container first, then init containers.
    pub containers: Vec<String>,
}

/// Everything the allocator needs to know about a pod's request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDemand {
    /// Placement slots, in container order. Empty for a pod that asks no GPU.
    pub slots: Vec<Slot>,
    /// Host CPU the pod requests (kubelet rule: max of each init container vs the sum of app ones,
    /// plus overhead).
    pub cpu: CpuMilli,
    /// Host memory the pod requests, same rule.
    pub memory: MiB,
    /// The `nano-gpu/gpu-percent` device IDs the pod asks of the kubelet, same rule: what the
    /// kubelet's admission and kube-scheduler's `NodeResourcesFit` count against the node's
    /// allocatable.
    pub ids: u64,
    /// Card models allowed (`nano-gpu/gpu-model`); empty means any.
    pub models: Vec<String>,
}

impl PodDemand {
    /// Whether the pod asks for any GPU.
    pub fn wants_gpu(&self) -> bool {
        !self.slots.is_empty()
    }
}

/// How gpushare's `aliyun.com/gpu-mem` is read, when compatibility is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpushareUnit {
    /// Gibibytes (gpushare's default).
    GiB,
    /// Mebibytes (gpushare's `--memory-unit=MiB`).
    MiB,
}

impl GpushareUnit {
    /// MiB in one unit.
    fn mib(self) -> u64 {
        match self {
            GpushareUnit::GiB => 1024,
            GpushareUnit::MiB => 1,
        }
    }

    /// `units` of this unit in MiB, `None` past `u64`.
    pub fn to_mib(self, units: u64) -> Option<MiB> {
        units.checked_mul(self.mib()).map(MiB)
    }

    /// Whole units in `mib` (a card's memory as gpushare counts it).
    pub fn units_in(self, mib: MiB) -> u64 {
        mib.0 / self.mib()
    }
}

/// Options that change how a pod is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DemandOptions {
    /// Accept `aliyun.com/gpu-mem` as GPU memory in this unit; `None` ignores it.
    pub gpushare: Option<GpushareUnit>,
}

/// A request nano-gpu refuses, with a message a user can act on.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct InvalidDemand(pub String);

fn invalid(container: &str, what: impl std::fmt::Display) -> InvalidDemand {
    InvalidDemand(format!("container {container:?}: {what}"))
}

/// How much of the extended resource `name` a container asks, as a whole number: limits win; requests
/// alone are accepted; both must agree.
pub fn asked(c: &Container, name: &str) -> Result<Option<u64>, InvalidDemand> {
    let res = c.resources.as_ref();
    let get = |m: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        m.and_then(|m| m.get(name))
            .map(|q| quantity::whole(&q.0).map_err(|e| invalid(&c.name, format!("{name} {e}"))))
    };
    let limit = get(res.and_then(|r| r.limits.as_ref())).transpose()?;
    let request = get(res.and_then(|r| r.requests.as_ref())).transpose()?;
    match (limit, request) {
        (Some(l), Some(r)) if l != r => Err(invalid(
            &c.name,
            format!("{name} request {r} differs from limit {l}; extended resources cannot be overcommitted"),
        )),
        (l, r) => Ok(l.or(r)),
    }
}

/// `nano-gpu/gpu-memory` is a count of MiB, as every extended resource is a count: a binary suffix
/// (`8Gi`) would ask 2^30 times what its writer meant, so it is refused with the number to write. A
/// decimal suffix is left alone: the API server writes `8000` as `8k`.
fn memory_without_unit(c: &Container) -> Result<(), InvalidDemand> {
    let res = c.resources.as_ref();
    let texts = [res.and_then(|r| r.limits.as_ref()), res.and_then(|r| r.requests.as_ref())]
        .into_iter()
        .flatten()
        .filter_map(|m| m.get(GPU_MEMORY).map(|q| q.0.trim()));
    for text in texts {
        if ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"].iter().any(|unit| text.ends_with(unit)) {
            let meant = quantity::mebibytes(text).map_or(String::new(), |mib| format!(" ({text} is {mib})"));
            return Err(invalid(
                &c.name,
                format!(
                    "{GPU_MEMORY} {text:?} has a unit: it is a number of MiB, written without one{meant}"
                ),
            ));
        }
    }
    Ok(())
}

fn container_demand(c: &Container, opts: &DemandOptions) -> Result<Option<ContainerDemand>, InvalidDemand> {
    let percent = asked(c, GPU_PERCENT)?;
    memory_without_unit(c)?;
    let mut memory = asked(c, GPU_MEMORY)?.filter(|m| *m > 0);
    let gpushare = match opts.gpushare {
        Some(unit) => asked(c, GPUSHARE_MEMORY)?.filter(|m| *m > 0).map(|m| (unit, m)),
        None => None,
    };
    if let Some((unit, m)) = gpushare {
        if memory.is_some() {
            return Err(invalid(&c.name, format!("asks both {GPU_MEMORY} and {GPUSHARE_MEMORY}; use one")));
        }
        let mib =
            unit.to_mib(m).ok_or_else(|| invalid(&c.name, format!("{GPUSHARE_MEMORY} {m} is too large")))?;
        memory = Some(mib.0);
    }
    let gpu = match percent {
        None | Some(0) => match memory {
            None => return Ok(None),
            // gpushare's resource is served by the agent's own device plugin; nano-gpu's memory is
            // not (it only sizes a share), so a container asking it alone would reach no device
            // plugin and run without a card.
            Some(_) if gpushare.is_none() => {
                return Err(invalid(
                    &c.name,
                    format!(
                        "asks {GPU_MEMORY} without {GPU_PERCENT}: memory alone reaches no device plugin, so \
                         the container would get no card; ask {GPU_PERCENT} too (1..=99 for a share, 100 \
                         for a whole card)"
                    ),
                ));
            }
            Some(m) => CardDemand::Share { percent: None, memory: Some(MiB(m)) },
        },
        Some(p @ 1..=99) => CardDemand::Share { percent: Some(Percent(p as u32)), memory: memory.map(MiB) },
        Some(p) if p % 100 == 0 && p / 100 <= 64 => {
            CardDemand::Whole { cards: (p / 100) as u32, memory: memory.map(MiB) }
        }
        Some(p) if p % 100 == 0 => {
            return Err(invalid(&c.name, format!("{GPU_PERCENT} {p} asks more than 64 whole cards")));
        }
        Some(p) => {
            return Err(invalid(
                &c.name,
                format!("{GPU_PERCENT} {p} is neither 1..=100 nor a multiple of 100"),
            ));
        }
    };
    Ok(Some(ContainerDemand { name: c.name.clone(), gpu }))
}

/// Host requests of one container: requests, else limits (as the API server defaults them).
fn host_request(c: &Container) -> Result<(u64, u64), InvalidDemand> {
    let res = c.resources.as_ref();
    let pick = |name: &str| {
        res.and_then(|r| r.requests.as_ref().and_then(|m| m.get(name)))
            .or_else(|| res.and_then(|r| r.limits.as_ref().and_then(|m| m.get(name))))
    };
    let cpu = pick("cpu")
        .map(|q| quantity::cpu_milli(&q.0).map_err(|e| invalid(&c.name, format!("cpu {e}"))))
        .transpose()?
        .unwrap_or(0);
    let mem = pick("memory")
        .map(|q| quantity::mebibytes(&q.0).map_err(|e| invalid(&c.name, format!("memory {e}"))))
        .transpose()?
        .unwrap_or(0);
    Ok((cpu, mem))
}

/// Folds init container demands into the app slots (see the module docs).
fn combine(app: Vec<ContainerDemand>, init: Vec<ContainerDemand>) -> Result<Vec<Slot>, InvalidDemand> {
    let mut slots: Vec<Slot> =
        app.into_iter().map(|c| Slot { demand: c.gpu, containers: vec![c.name] }).collect();
    for c in init {
        let largest = |whole: bool| {
            slots
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s.demand, CardDemand::Whole { .. }) == whole)
                .max_by_key(|(i, s)| (s.demand.size(), std::cmp::Reverse(*i)))
                .map(|(i, _)| i)
        };
        let target = match &c.gpu {
            CardDemand::Share { .. } => largest(false).or_else(|| largest(true)),
            CardDemand::Whole { .. } => match largest(true) {
                Some(i) => Some(i),
                None if slots.is_empty() => None,
                None => {
                    return Err(invalid(
                        &c.name,
                        "init container asks whole cards while the app containers share cards; \
                         give an app container whole cards too",
                    ));
                }
            },
        };
        let Some(i) = target else {
            slots.push(Slot { demand: c.gpu, containers: vec![c.name] });
            continue;
        };
        let slot = &mut slots[i];
        slot.demand = match (&slot.demand, &c.gpu) {
            (
                CardDemand::Share { percent: p1, memory: m1 },
                CardDemand::Share { percent: p2, memory: m2 },
            ) => CardDemand::Share { percent: (*p1).max(*p2), memory: (*m1).max(*m2) },
            (CardDemand::Whole { cards: k1, memory: m1 }, CardDemand::Whole { cards: k2, memory: m2 }) => {
                CardDemand::Whole { cards: (*k1).max(*k2), memory: (*m1).max(*m2) }
            }
            (CardDemand::Whole { cards, memory: m1 }, CardDemand::Share { memory: m2, .. }) => {
                CardDemand::Whole { cards: *cards, memory: (*m1).max(*m2) }
            }
            (CardDemand::Share { .. }, CardDemand::Whole { .. }) => {
                return Err(invalid(&c.name, "cannot combine whole cards with a shared card"));
            }
        };
        slot.containers.push(c.name);
    }
    Ok(slots)
}

/// What a pod requests of its node: host CPU and memory and the `nano-gpu/gpu-percent` device IDs,
/// each summed as the kubelet sums a pod's requests (app containers and sidecars add up, each other
/// init container counts alone with the sidecars started before it, the larger wins; then the pod's
/// overhead).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostDemand {
    /// Host CPU.
    pub cpu: CpuMilli,
    /// Host memory.
    pub memory: MiB,
    /// `nano-gpu/gpu-percent` device IDs.
    pub ids: u64,
}

/// Reads what a pod requests of its node. It depends on the quantities alone, not on whether its GPU
/// demand is valid: the kubelet counts the device IDs of a pod the allocator refuses too.
pub fn host_demand(pod: &Pod) -> Result<HostDemand, InvalidDemand> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(HostDemand::default());
    };
    let mut sum = [0u64; 3];
    let mut init = [0u64; 3];
    let add = |sum: &mut [u64; 3], own: [u64; 3]| {
        sum.iter_mut().zip(own).for_each(|(s, o)| *s = s.saturating_add(o))
    };
    let asks = |c: &Container| -> Result<[u64; 3], InvalidDemand> {
        let (cpu, mem) = host_request(c)?;
        Ok([cpu, mem, asked(c, GPU_PERCENT)?.unwrap_or(0)])
    };
    for c in spec.init_containers.iter().flatten() {
        let own = asks(c)?;
        // Sidecars run beside the app containers: they add to the sum, like app containers.
        let sidecar = c.restart_policy.as_deref() == Some("Always");
        if sidecar {
            add(&mut sum, own);
        } else {
            for ((most, so_far), own) in init.iter_mut().zip(sum).zip(own) {
                *most = (*most).max(so_far.saturating_add(own));
            }
        }
    }
    for c in &spec.containers {
        add(&mut sum, asks(c)?);
    }
    let (mut cpu, mut memory, ids) = (sum[0].max(init[0]), sum[1].max(init[1]), sum[2].max(init[2]));
    if let Some(overhead) = spec.overhead.as_ref() {
        let err = |what: &str, e: quantity::QuantityError| InvalidDemand(format!("pod overhead {what} {e}"));
        if let Some(q) = overhead.get("cpu") {
            cpu = cpu.saturating_add(quantity::cpu_milli(&q.0).map_err(|e| err("cpu", e))?);
        }
        if let Some(q) = overhead.get("memory") {
            memory = memory.saturating_add(quantity::mebibytes(&q.0).map_err(|e| err("memory", e))?);
        }
    }
    Ok(HostDemand { cpu: CpuMilli(cpu), memory: MiB(memory), ids })
}

/// Reads a pod's GPU and host demand. A pod that asks no GPU gets a demand with no slots.
pub fn pod_demand(pod: &Pod, opts: &DemandOptions) -> Result<PodDemand, InvalidDemand> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(PodDemand::default());
    };
    let host = host_demand(pod)?;
    let (mut app, mut init) = (Vec::new(), Vec::new());
    for c in spec.init_containers.iter().flatten() {
        let slots = container_demand(c, opts)?;
        if c.restart_policy.as_deref() == Some("Always") { app.extend(slots) } else { init.extend(slots) }
    }
    for c in &spec.containers {
        app.extend(container_demand(c, opts)?);
    }
    let models = match pod.metadata.annotations.as_ref().and_then(|a| a.get(GPU_MODEL_ANNOTATION)) {
        Some(value) => models(value)?,
        None => Vec::new(),
    };
    Ok(PodDemand { slots: combine(app, init)?, cpu: host.cpu, memory: host.memory, ids: host.ids, models })
}

/// The longest `nano-gpu/gpu-model` value read, in bytes: every pending GPU pod's models are kept,
/// so a pod cannot make the allocator hold more than this for it.
pub const MAX_MODELS_LEN: usize = 1024;
/// The most models one pod may name.
pub const MAX_MODELS: usize = 32;

/// The models `nano-gpu/gpu-model` names (`|`-separated, blanks ignored, each once), or why it is
/// refused: longer than [`MAX_MODELS_LEN`] or naming more than [`MAX_MODELS`].
fn models(value: &str) -> Result<Vec<String>, InvalidDemand> {
    if value.len() > MAX_MODELS_LEN {
        return Err(InvalidDemand(format!(
            "annotation {GPU_MODEL_ANNOTATION} is {} bytes long; at most {MAX_MODELS_LEN} (card models separated by '|')",
            value.len()
        )));
    }
    // Counted as written, before duplicates are dropped (as the assignment policy counts them).
    let named: Vec<&str> = value.split('|').map(str::trim).filter(|m| !m.is_empty()).collect();
    if named.len() > MAX_MODELS {
        return Err(InvalidDemand(format!(
            "annotation {GPU_MODEL_ANNOTATION} names {} models; at most {MAX_MODELS}",
            named.len()
        )));
    }
    let mut models: Vec<String> = Vec::new();
    for m in named {
        if !models.iter().any(|k| k == m) {
            models.push(m.to_owned());
        }
    }
    Ok(models)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_model_list_is_bounded_and_each_model_kept_once() {
        let with = |value: String| {
            let mut p = pod(json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "30"}))]}));
            p.metadata.annotations = Some([(GPU_MODEL_ANNOTATION.to_string(), value)].into());
            pod_demand(&p, &DemandOptions::default())
        };
        assert_eq!(with("T4|A10|T4| T4 ".into()).unwrap().models, ["T4", "A10"]);
        // A pending pod cannot make the allocator keep 100,000 strings for it.
        let huge = with("a|".repeat(100_000)).unwrap_err().0;
        assert!(huge.contains("200000 bytes") && huge.len() < 200, "{huge}");
        let many: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
        assert!(with(many.join("|")).unwrap_err().0.contains("names 40 models"));
        assert_eq!(with("|".repeat(MAX_MODELS_LEN)).unwrap().models, Vec::<String>::new());
    }

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec})).unwrap()
    }

    fn container(name: &str, limits: serde_json::Value) -> serde_json::Value {
        json!({"name": name, "resources": {"limits": limits}})
    }

    fn read(spec: serde_json::Value) -> Result<PodDemand, InvalidDemand> {
        pod_demand(&pod(spec), &DemandOptions::default())
    }

    #[test]
    fn a_share_of_one_card_is_read_from_limits() {
        let d = read(json!({"containers": [container("train", json!({"nano-gpu/gpu-percent": "30", "cpu": "2", "memory": "1Gi"}))]})).unwrap();
        assert_eq!(
            d.slots,
            vec![Slot {
                demand: CardDemand::Share { percent: Some(Percent(30)), memory: None },
                containers: vec!["train".into()],
            }]
        );
        assert_eq!((d.cpu, d.memory), (CpuMilli(2000), MiB(1024)));
    }

    #[test]
    fn a_multiple_of_100_is_whole_cards() {
        let d = read(json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "200", "nano-gpu/gpu-memory": "40000"}))]})).unwrap();
        assert_eq!(d.slots[0].demand, CardDemand::Whole { cards: 2, memory: Some(MiB(40000)) });
    }

    #[test]
    fn percent_150_is_rejected_with_a_message_naming_the_container() {
        let e = read(json!({"containers": [container("train", json!({"nano-gpu/gpu-percent": "150"}))]}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "container \"train\": nano-gpu/gpu-percent 150 is neither 1..=100 nor a multiple of 100"
        );
    }

    #[test]
    fn a_malformed_quantity_is_an_error_not_a_panic() {
        let e = read(json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "lots"}))]}))
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("container \"c\": nano-gpu/gpu-percent \"lots\" is not a valid quantity"),
            "{e}"
        );
        let e = read(json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "0.5"}))]}))
            .unwrap_err();
        assert!(e.to_string().contains("not a whole number"), "{e}");
    }

    #[test]
    fn memory_with_a_binary_unit_is_refused_with_the_number_to_write() {
        let asks = |memory: &str| {
            read(
                json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "30", "nano-gpu/gpu-memory": memory}))]}),
            )
        };
        let e = asks("8Gi").unwrap_err();
        assert_eq!(
            e.to_string(),
            "container \"c\": nano-gpu/gpu-memory \"8Gi\" has a unit: it is a number of MiB, written without one (8Gi is 8192)"
        );
        assert!(asks("512Mi").unwrap_err().to_string().contains("(512Mi is 512)"));
        // The API server writes 8000 as 8k: a decimal suffix is a number.
        let d = asks("8k").unwrap();
        assert_eq!(
            d.slots[0].demand,
            CardDemand::Share { percent: Some(Percent(30)), memory: Some(MiB(8000)) }
        );
    }

    #[test]
    fn request_and_limit_must_agree() {
        let e = read(json!({"containers": [{"name": "c", "resources": {
            "limits": {"nano-gpu/gpu-percent": "30"}, "requests": {"nano-gpu/gpu-percent": "20"}}}]}))
        .unwrap_err();
        assert!(e.to_string().contains("differs from limit"), "{e}");
    }

    #[test]
    fn memory_without_percent_is_refused_as_it_would_reach_no_device_plugin() {
        for limits in [
            json!({"nano-gpu/gpu-memory": "4096"}),
            json!({"nano-gpu/gpu-memory": "4k", "nano-gpu/gpu-percent": "0"}),
        ] {
            let e = read(json!({"containers": [container("c", limits)]})).unwrap_err();
            assert!(e.to_string().contains("asks nano-gpu/gpu-memory without nano-gpu/gpu-percent"), "{e}");
        }
        let both = json!({"nano-gpu/gpu-memory": "4096", "nano-gpu/gpu-percent": "20"});
        assert!(read(json!({"containers": [container("c", both)]})).is_ok());
    }

    #[test]
    fn a_pod_without_gpu_has_no_slots() {
        let d = read(json!({"containers": [container("c", json!({"cpu": "1"}))]})).unwrap();
        assert!(!d.wants_gpu());
        assert_eq!(d.cpu, CpuMilli(1000));
    }

    #[test]
    fn every_gpu_container_of_a_multi_container_pod_is_a_slot() {
        let d = read(json!({"containers": [
            container("a", json!({"nano-gpu/gpu-percent": "30"})),
            container("sidecar", json!({"cpu": "100m"})),
            container("b", json!({"nano-gpu/gpu-percent": "100"})),
        ]}))
        .unwrap();
        let names: Vec<_> = d.slots.iter().map(|s| s.containers.clone()).collect();
        assert_eq!(names, vec![vec!["a".to_string()], vec!["b".to_string()]]);
        assert_eq!(d.slots[1].demand, CardDemand::Whole { cards: 1, memory: None });
    }

    #[test]
    fn init_containers_ride_the_largest_app_slot_which_grows_to_cover_them() {
        let d = read(json!({
        "initContainers": [container("init", json!({"nano-gpu/gpu-percent": "50", "cpu": "4"}))],
        "containers": [
            container("a", json!({"nano-gpu/gpu-percent": "20", "cpu": "1"})),
            container("b", json!({"nano-gpu/gpu-percent": "30", "cpu": "1"})),
        ]}))
        .unwrap();
        assert_eq!(d.slots[1].containers, vec!["b".to_string(), "init".to_string()]);
        assert_eq!(d.slots[1].demand, CardDemand::Share { percent: Some(Percent(50)), memory: None });
        assert_eq!(d.slots[0].demand.size(), 20);
        // max(init 4, sum of app 2)
        assert_eq!(d.cpu, CpuMilli(4000));
    }

    #[test]
    fn an_init_container_alone_is_its_own_slot() {
        let d = read(json!({
            "initContainers": [container("init", json!({"nano-gpu/gpu-percent": "40"}))],
            "containers": [container("app", json!({"cpu": "1"}))]}))
        .unwrap();
        assert_eq!(d.slots.len(), 1);
        assert_eq!(d.slots[0].containers, vec!["init".to_string()]);
    }

    #[test]
    fn whole_card_init_with_shared_app_cards_is_refused_clearly() {
        let e = read(json!({
            "initContainers": [container("init", json!({"nano-gpu/gpu-percent": "100"}))],
            "containers": [container("app", json!({"nano-gpu/gpu-percent": "30"}))]}))
        .unwrap_err();
        assert!(e.to_string().starts_with("container \"init\": init container asks whole cards"), "{e}");
    }

    #[test]
    fn sidecar_init_containers_count_like_app_containers() {
        let d = read(json!({
            "initContainers": [{"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}}],
            "containers": [container("app", json!({"cpu": "1"}))]}))
        .unwrap();
        assert_eq!(d.cpu, CpuMilli(2000));
    }

    /// A plain init container runs before the sidecars declared after it start: it counts with the
    /// sidecars before it only. And what a pod asks of its node does not depend on its GPU demand
    /// being valid (150 is no share).
    #[test]
    fn an_init_container_counts_with_the_sidecars_started_before_it() {
        let ids = |n: &str| json!({"nano-gpu/gpu-percent": n});
        let spec = json!({
            "initContainers": [
                {"name": "side-1", "restartPolicy": "Always", "resources": {"limits": ids("10")}},
                container("init", ids("150")),
                {"name": "side-2", "restartPolicy": "Always", "resources": {"limits": ids("30")}}],
            "containers": [container("app", ids("40"))]});
        // side-1 + init = 160 against side-1 + side-2 + app = 80 (not side-2 + init: 180).
        assert_eq!(host_demand(&pod(spec.clone())).unwrap().ids, 160);
        assert!(read(spec).is_err());
    }

    #[test]
    fn gpushare_memory_is_read_in_gib_only_when_enabled() {
        let spec = json!({"containers": [container("c", json!({"aliyun.com/gpu-mem": "3"}))]});
        assert!(!read(spec.clone()).unwrap().wants_gpu());
        let opts = DemandOptions { gpushare: Some(GpushareUnit::GiB) };
        let d = pod_demand(&pod(spec), &opts).unwrap();
        assert_eq!(d.slots[0].demand, CardDemand::Share { percent: None, memory: Some(MiB(3072)) });
    }

    #[test]
    fn model_annotation_lists_allowed_models() {
        let mut p = pod(json!({"containers": [container("c", json!({"nano-gpu/gpu-percent": "10"}))]}));
        p.metadata.annotations =
            Some([(GPU_MODEL_ANNOTATION.to_string(), "T4| V100M32 |".to_string())].into());
        let d = pod_demand(&p, &DemandOptions::default()).unwrap();
        assert_eq!(d.models, vec!["T4".to_string(), "V100M32".to_string()]);
    }

    #[test]
    fn pod_overhead_adds_to_host_requests() {
        let d = read(json!({"overhead": {"cpu": "250m", "memory": "64Mi"},
            "containers": [container("c", json!({"cpu": "1", "memory": "1Gi"}))]}))
        .unwrap();
        assert_eq!((d.cpu, d.memory), (CpuMilli(1250), MiB(1088)));
    }
}
