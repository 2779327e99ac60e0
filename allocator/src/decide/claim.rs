//! ResourceClaims of nano-gpu's DeviceClass, read and written (pure): what a claim asks
//! ([`ClaimRecord::of`]: each request a slot of the engine, or why it cannot be one), what its
//! allocation holds, the allocation the allocator writes for its choice ([`allocation`]), and which
//! nodes a pod may go to at all ([`Placement`]: its node selector, required node affinity and
//! tolerations), since the allocator picks the node before kube-scheduler sees the pod.
//!
//! What a request may ask: `exactly` of class `gpu.nano-gpu.io`, `count` cards (default 1), with
//! capacity `percent` (1 to 100; default the whole card) and/or `memory`. A share (less than a whole
//! card, or memory only) is one card (`count` 1). Card models are chosen with CEL selectors of one
//! form only, `device.attributes["gpu.nano-gpu.io"].model == "<model>"`, several joined by `||`
//! ([`selected_models`]), or with the pod's `nano-gpu/gpu-model` annotation; whole cards also by
//! their memory, `device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("<q>")) >= 0`
//! ([`least_card_memory`]). Refused with the reason,
//! never silently changed: any other CEL selector, `All` mode,
//! `firstAvailable`, constraints, admin access, an opaque configuration for the driver, a claim that
//! mixes this class with others.

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, Pod, Taint, Toleration};
use k8s_openapi::api::resource::v1::{ExactDeviceRequest, ResourceClaim};
use nano_gpu_engine::request::SlotDemand;
use nano_gpu_proto::dra::{CLASS, DRIVER, MEMORY, PERCENT, card_index, device_name};
use nano_gpu_proto::quantity;
use nano_gpu_proto::units::{MiB, Percent};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// One request of a claim as a slot of the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimSlot {
    /// The request's name.
    pub request: String,
    /// What it asks.
    pub demand: SlotDemand,
    /// Whether it asked memory (the allocation then says how much each card gives).
    pub memory_asked: bool,
    /// The card models its selectors allow (`None`: any).
    pub models: Option<Vec<String>>,
}

/// One device of the driver an allocation holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldDevice {
    /// The card's index, or the device name that is none of the driver's.
    pub card: Result<u32, String>,
    /// Percent of the card.
    pub percent: Percent,
    /// Card memory, when the allocation says (else the percent's part of the card's memory).
    pub memory: Option<MiB>,
}

impl HeldDevice {
    /// The memory it holds on a card of `mem_total`: what the allocation says, else its percent's
    /// part of the card (the one memory rule).
    pub fn memory_on(&self, mem_total: MiB) -> MiB {
        self.memory.unwrap_or_else(|| self.percent.of(mem_total))
    }
}

/// What an allocation of the driver holds, on which node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The node (the pool of its devices: each node's slice is its own pool).
    pub node: String,
    /// Its devices.
    pub devices: Vec<HeldDevice>,
    /// Devices in other pools than the first: the allocation cannot be trusted on any of them.
    pub other_pools: Vec<String>,
}

/// Whether a claim is one nano-gpu allocates.
#[derive(Clone, Debug, PartialEq)]
pub enum Class {
    /// No request names nano-gpu's class.
    Other,
    /// Every request does: its slots, or why they cannot be placed.
    Ours(Result<Vec<ClaimSlot>, String>),
}

/// What the allocator keeps of a ResourceClaim.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimRecord {
    /// Namespace and name.
    pub key: (String, String),
    /// Its resourceVersion as a number (0 when it is not one).
    pub version: u64,
    /// Its resourceVersion as written.
    pub resource_version: String,
    /// Whose claim it is.
    pub class: Class,
    /// Whether it is allocated at all.
    pub allocated: bool,
    /// What the driver's devices in its allocation hold.
    pub held: Option<Held>,
    /// Whether it was made for one pod (its controlling owner is a Pod: made from a
    /// ResourceClaimTemplate), which alone may use it; else any pod of its namespace may join it.
    pub for_one_pod: bool,
    /// The uids of the pods it is reserved for (`status.reservedFor`); `None` when a consumer is not
    /// a pod (its end cannot be told from the pods).
    pub users: Option<Vec<String>>,
}

impl ClaimRecord {
    /// Reads `claim`.
    pub fn of(claim: &ResourceClaim) -> Self {
        let resource_version = claim.metadata.resource_version.clone().unwrap_or_default();
        let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
        ClaimRecord {
            key: (
                claim.metadata.namespace.clone().unwrap_or_default(),
                claim.metadata.name.clone().unwrap_or_default(),
            ),
            version: resource_version.parse().unwrap_or(0),
            resource_version,
            class: class(claim),
            allocated: allocation.is_some(),
            held: held(claim),
            for_one_pod: nano_gpu_proto::dra::made_for_pod(&claim.metadata).is_some(),
            users: users(claim),
        }
    }

    /// Its slots, when nano-gpu allocates it and it can be placed.
    pub fn slots(&self) -> Option<&Result<Vec<ClaimSlot>, String>> {
        match &self.class {
            Class::Ours(slots) => Some(slots),
            Class::Other => None,
        }
    }
}

/// The pods a claim is reserved for; `None` when a consumer is anything else.
fn users(claim: &ResourceClaim) -> Option<Vec<String>> {
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
    reserved
        .into_iter()
        .flatten()
        .map(|r| {
            (r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty())
                .then(|| r.uid.clone())
        })
        .collect()
}

/// Whose claim it is, and what it asks when it is ours.
fn class(claim: &ResourceClaim) -> Class {
    let devices = claim.spec.devices.as_ref();
    let requests = devices.and_then(|d| d.requests.as_deref()).unwrap_or_default();
    let ours = |r: &&k8s_openapi::api::resource::v1::DeviceRequest| {
        r.exactly.as_ref().is_some_and(|e| e.device_class_name == CLASS)
            || r.first_available.iter().flatten().any(|s| s.device_class_name == CLASS)
    };
    let mine = requests.iter().filter(ours).count();
    if mine == 0 {
        return Class::Other;
    }
    let name = claim.metadata.name.as_deref().unwrap_or("");
    if mine < requests.len() {
        return Class::Ours(Err(format!(
            "claim {name} mixes requests of {CLASS} with other classes; nano-gpu allocates a claim only \
             when all its requests are its own (use one claim per class)"
        )));
    }
    if devices.and_then(|d| d.constraints.as_ref()).is_some_and(|c| !c.is_empty()) {
        return Class::Ours(Err(format!(
            "claim {name}: constraints are not supported for {CLASS} (the allocator chooses the cards)"
        )));
    }
    let config = devices.and_then(|d| d.config.as_ref());
    if config.into_iter().flatten().any(|c| c.opaque.as_ref().is_some_and(|o| o.driver == DRIVER)) {
        return Class::Ours(Err(format!(
            "claim {name}: {DRIVER} takes no opaque configuration; ask capacity (percent, memory) in the \
             request instead"
        )));
    }
    let slots = requests.iter().map(|r| slot(name, &r.name, r.exactly.as_ref())).collect();
    Class::Ours(slots)
}

/// The most cards one request may ask.
const MAX_COUNT: i64 = 64;

/// One request as a slot.
fn slot(claim: &str, request: &str, exactly: Option<&ExactDeviceRequest>) -> Result<ClaimSlot, String> {
    let at = format!("claim {claim}, request {request}");
    let Some(e) = exactly else {
        return Err(format!("{at}: firstAvailable is not supported for {CLASS}; use exactly"));
    };
    let mut models: Option<Vec<String>> = None;
    // The least memory a card must have (its `memory` capacity), from selectors.
    let mut card_memory: Option<MiB> = None;
    for selector in e.selectors.iter().flatten() {
        let expression = selector.cel.as_ref().map(|c| c.expression.as_str()).unwrap_or_default();
        if let Some(least) = least_card_memory(expression) {
            card_memory = card_memory.max(Some(least));
            continue;
        }
        let allowed = selected_models(expression).ok_or_else(|| {
            format!(
                "{at}: the CEL selector {expression:?} is not one nano-gpu allocates (it chooses the card); \
                 select models as device.attributes[\"{DRIVER}\"].model == \"<model>\" (several joined by ||) \
                 or with the pod's annotation nano-gpu/gpu-model, and whole cards by their memory as \
                 device.capacity[\"{DRIVER}\"].memory.compareTo(quantity(\"<quantity>\")) >= 0"
            )
        })?;
        // Selectors all hold: the models each allows, together.
        models = Some(match models {
            None => allowed,
            Some(before) => before.into_iter().filter(|m| allowed.contains(m)).collect(),
        });
    }
    if e.admin_access == Some(true) {
        return Err(format!("{at}: admin access is not supported for {CLASS}"));
    }
    match e.allocation_mode.as_deref() {
        None | Some("ExactCount") => {}
        Some(mode) => return Err(format!("{at}: allocation mode {mode} is not supported; use ExactCount")),
    }
    let count = e.count.unwrap_or(1);
    if !(1..=MAX_COUNT).contains(&count) {
        return Err(format!("{at}: count {count}: 1 to {MAX_COUNT}"));
    }
    let asked = e.capacity.as_ref().and_then(|c| c.requests.as_ref());
    let mut percent = None;
    let mut memory = None;
    for (key, q) in asked.into_iter().flatten() {
        match key.as_str() {
            PERCENT => match quantity::whole(&q.0) {
                Ok(p @ 1..=100) => percent = Some(Percent(p as u32)),
                Ok(p) => return Err(format!("{at}: {PERCENT} {p}: 1 to 100")),
                Err(e) => return Err(format!("{at}: {PERCENT} {:?}: {e}", q.0)),
            },
            MEMORY => match quantity::mebibytes(&q.0) {
                Ok(0) => {}
                Ok(m) => memory = Some(MiB(m)),
                Err(e) => return Err(format!("{at}: {MEMORY} {:?}: {e}", q.0)),
            },
            other => {
                return Err(format!("{at}: capacity {other:?}: the devices have {PERCENT} and {MEMORY}"));
            }
        }
    }
    let memory_asked = memory.is_some();
    let whole = matches!(percent, Some(Percent::FULL)) || (percent.is_none() && memory.is_none());
    if card_memory.is_some() && !whole {
        return Err(format!(
            "{at}: a selector on the card's memory is read for whole cards only; a share asks the \
             memory it holds as capacity ({MEMORY}), and the card must have that much free"
        ));
    }
    let demand = match percent {
        None if memory.is_none() => SlotDemand::Whole { cards: count as u32, mem: card_memory },
        Some(Percent::FULL) => SlotDemand::Whole { cards: count as u32, mem: memory.max(card_memory) },
        _ if count > 1 => {
            return Err(format!(
                "{at}: a share (less than a whole card) is one card: count 1, or ask whole cards"
            ));
        }
        _ => SlotDemand::Share { percent, mem: memory },
    };
    Ok(ClaimSlot { request: request.to_owned(), demand, memory_asked, models })
}

/// The card models a CEL selector of the one form nano-gpu reads allows:
/// `device.attributes["gpu.nano-gpu.io"].model == "<model>"`, several joined by `||` (either quote);
/// `None` for any other expression.
pub fn selected_models(expression: &str) -> Option<Vec<String>> {
    let mut models = Vec::new();
    for part in expression.split("||") {
        let (lhs, rhs) = part.split_once("==")?;
        let lhs: String = lhs.chars().filter(|c| !c.is_whitespace()).collect();
        let attribute = [
            format!("device.attributes[\"{DRIVER}\"].model"),
            format!("device.attributes['{DRIVER}'].model"),
        ];
        if !attribute.contains(&lhs) {
            return None;
        }
        let rhs = rhs.trim();
        let quoted = |q: char| rhs.strip_prefix(q)?.strip_suffix(q);
        let model = quoted('"').or_else(|| quoted('\''))?;
        if model.is_empty() || model.contains(['"', '\'', '\\']) {
            return None;
        }
        models.push(model.to_owned());
    }
    Some(models)
}

/// The least card memory a CEL selector of the one memory form nano-gpu reads asks:
/// `device.capacity["gpu.nano-gpu.io"].memory.compareTo(quantity("<quantity>")) >= 0` (or `> 0`:
/// more than the quantity; either quote, any spacing), in whole MiB; `None` for any other
/// expression.
pub fn least_card_memory(expression: &str) -> Option<MiB> {
    let text: String = expression.chars().filter(|c| !c.is_whitespace()).collect();
    let rest =
        [format!("device.capacity[\"{DRIVER}\"].{MEMORY}"), format!("device.capacity['{DRIVER}'].{MEMORY}")]
            .iter()
            .find_map(|prefix| text.strip_prefix(prefix.as_str()))?;
    let rest = rest.strip_prefix(".compareTo(quantity(")?;
    let quote = rest.chars().next().filter(|q| *q == '"' || *q == '\'')?;
    let (q, rest) = rest[1..].split_once(quote)?;
    let strictly = match rest.strip_prefix("))")? {
        ">=0" => false,
        ">0" => true,
        _ => return None,
    };
    // Cards' memory is whole MiB: at least the quantity rounded up, or one MiB more than a quantity
    // of whole MiB when it must be more.
    let mib = quantity::mebibytes(q).ok()?;
    let whole_mib = quantity::bytes(q).ok()? % (1 << 20) == 0;
    Some(MiB(mib + u64::from(strictly && whole_mib)))
}

/// What the driver's devices in the claim's allocation hold.
fn held(claim: &ResourceClaim) -> Option<Held> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    let results = allocation.devices.as_ref()?.results.as_ref()?;
    let mut held: Option<Held> = None;
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        let consumed = r.consumed_capacity.as_ref();
        let percent = match consumed.and_then(|c| c.get(PERCENT)).map(|q| quantity::whole(&q.0)) {
            None => Percent::FULL,
            Some(Ok(p @ 1..=100)) => Percent(p as u32),
            // Unreadable: it counts as the whole card (fail closed).
            Some(_) => Percent::FULL,
        };
        let memory = consumed
            .and_then(|c| c.get(MEMORY))
            .and_then(|q| quantity::mebibytes(&q.0).ok())
            .filter(|m| *m > 0)
            .map(MiB);
        let card = card_index(&r.device).ok_or_else(|| r.device.clone());
        let device = HeldDevice { card, percent, memory };
        match held.as_mut() {
            None => {
                held = Some(Held { node: r.pool.clone(), devices: vec![device], other_pools: Vec::new() })
            }
            Some(h) if h.node == r.pool => h.devices.push(device),
            Some(h) => {
                if !h.other_pools.contains(&r.pool) {
                    h.other_pools.push(r.pool.clone());
                }
            }
        }
    }
    held
}

/// One claim a pod uses: its name in the pod's namespace (`None` for one made from a template that
/// the ResourceClaim controller has not created, or recorded in the pod's status, yet) and the
/// template it is made from, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodClaim {
    /// The claim's name.
    pub name: Option<String>,
    /// Its ResourceClaimTemplate.
    pub template: Option<String>,
}

/// The claims a pod uses.
pub fn pod_claims(pod: &Pod) -> Vec<PodClaim> {
    let entries = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
    entries
        .into_iter()
        .flatten()
        .map(|c| PodClaim {
            name: nano_gpu_proto::dra::claim_of_entry(pod, &c.name),
            template: c
                .resource_claim_name
                .is_none()
                .then(|| c.resource_claim_template_name.clone())
                .flatten(),
        })
        .collect()
}

/// The prefix of the ResourceClaimTemplates the webhook names for pods asking
/// `nano-gpu/gpu-percent` that it turns into claims: each names one slot's shape
/// ([`template_name`]), and the allocator makes it in the pod's namespace ([`template`]).
pub const TEMPLATE_PREFIX: &str = "nano-gpu-";

/// The template of a slot: `nano-gpu-p30` (30 %), `nano-gpu-m4096` (4096 MiB), `nano-gpu-p30-m4096`,
/// `nano-gpu-w2` (two whole cards), `nano-gpu-w1-m16384` (a whole card of at least 16384 MiB).
pub fn template_name(slot: &SlotDemand) -> String {
    let memory = |m: Option<MiB>| m.map(|m| format!("-m{}", m.0)).unwrap_or_default();
    match *slot {
        SlotDemand::Share { percent: Some(p), mem } => format!("{TEMPLATE_PREFIX}p{}{}", p.0, memory(mem)),
        SlotDemand::Share { percent: None, mem: Some(m) } => format!("{TEMPLATE_PREFIX}m{}", m.0),
        SlotDemand::Share { percent: None, mem: None } => format!("{TEMPLATE_PREFIX}p0"),
        SlotDemand::Whole { cards, mem } => format!("{TEMPLATE_PREFIX}w{cards}{}", memory(mem)),
    }
}

/// The slot a template name of [`template_name`]'s form stands for.
pub fn template_shape(name: &str) -> Option<SlotDemand> {
    let rest = name.strip_prefix(TEMPLATE_PREFIX)?;
    let (head, memory) = match rest.split_once("-m") {
        Some((h, m)) => (h, Some(MiB(number(m)?))),
        None => (rest, None),
    };
    let slot = if let Some(p) = head.strip_prefix('p') {
        let p = number(p)?;
        if !(1..100).contains(&p) {
            return None;
        }
        SlotDemand::Share { percent: Some(Percent(p as u32)), mem: memory }
    } else if let Some(n) = head.strip_prefix('w') {
        let n = number(n)?;
        if !(1..=MAX_COUNT as u64).contains(&n) {
            return None;
        }
        SlotDemand::Whole { cards: n as u32, mem: memory }
    } else if let Some(m) = head.strip_prefix('m') {
        if memory.is_some() {
            return None;
        }
        SlotDemand::Share { percent: None, mem: Some(MiB(number(m)?)) }
    } else {
        return None;
    };
    // Only the canonical spelling names a shape.
    (template_name(&slot) == name).then_some(slot)
}

/// A decimal number without sign or leading zeros, above 0.
fn number(text: &str) -> Option<u64> {
    let n: u64 = text.parse().ok()?;
    (n > 0 && n.to_string() == text).then_some(n)
}

/// The ResourceClaimTemplate `name` of [`template_name`]'s form, in `namespace`: one request `gpu` of
/// nano-gpu's class asking the slot.
pub fn template(namespace: &str, name: &str) -> Option<Value> {
    let mut exactly = json!({"deviceClassName": CLASS, "allocationMode": "ExactCount"});
    match template_shape(name)? {
        SlotDemand::Share { percent, mem } => {
            exactly["count"] = json!(1);
            let mut requests = json!({});
            if let Some(p) = percent {
                requests[PERCENT] = json!(p.0.to_string());
            }
            if let Some(m) = mem {
                requests[MEMORY] = json!(format!("{}Mi", m.0));
            }
            exactly["capacity"] = json!({"requests": requests});
        }
        SlotDemand::Whole { cards, mem } => {
            exactly["count"] = json!(cards);
            if let Some(m) = mem {
                exactly["capacity"] = json!({"requests": {PERCENT: "100", MEMORY: format!("{}Mi", m.0)}});
            }
        }
    }
    Some(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "nano-gpu"}},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }))
}

/// The nodes a pod may go to at all: kube-scheduler's node-selection rules the allocator checks
/// before it picks a node for the pod's claims. Everything else (ports, volumes, spread, CPU of
/// non-GPU pods it does not see) kube-scheduler still checks; a node it then refuses is not picked
/// again for that pod.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    node_selector: BTreeMap<String, String>,
    affinity: Option<NodeSelector>,
    tolerations: Vec<Toleration>,
}

/// What a node shows for [`Placement::allows`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeFacts {
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its taints.
    pub taints: Vec<Taint>,
    /// Cordoned (`spec.unschedulable`).
    pub cordoned: bool,
}

impl Placement {
    /// The rules of `pod`.
    pub fn of(pod: &Pod) -> Self {
        let Some(spec) = pod.spec.as_ref() else { return Placement::default() };
        let affinity = spec.affinity.as_ref().and_then(|a| a.node_affinity.as_ref());
        Placement {
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            affinity: affinity.and_then(|a| a.required_during_scheduling_ignored_during_execution.clone()),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
        }
    }

    /// Whether the pod may go to node `name`, or why not.
    pub fn allows(&self, name: &str, node: &NodeFacts) -> Result<(), String> {
        if node.cordoned && !self.tolerates(&unschedulable_taint()) {
            return Err("cordoned".into());
        }
        for (k, v) in &self.node_selector {
            if node.labels.get(k) != Some(v) {
                return Err(format!("node selector {k}={v}"));
            }
        }
        if let Some(required) = &self.affinity
            && !required.node_selector_terms.iter().any(|t| {
                t.match_expressions.iter().flatten().all(|r| matches(r, node.labels.get(&r.key)))
                    && t.match_fields.iter().flatten().all(|r| {
                        let name = (r.key == "metadata.name").then_some(name.to_owned());
                        matches(r, name.as_ref())
                    })
            })
        {
            return Err("required node affinity".into());
        }
        for t in &node.taints {
            if matches!(t.effect.as_str(), "NoSchedule" | "NoExecute") && !self.tolerates(t) {
                return Err(format!("untolerated taint {}", t.key));
            }
        }
        Ok(())
    }

    fn tolerates(&self, taint: &Taint) -> bool {
        self.tolerations.iter().any(|t| {
            let effect = t.effect.as_deref().is_none_or(|e| e.is_empty() || e == taint.effect);
            let key = t.key.as_deref().unwrap_or("");
            let matched = match t.operator.as_deref().unwrap_or("Equal") {
                "Exists" => key.is_empty() || key == taint.key,
                _ => {
                    key == taint.key
                        && t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
                }
            };
            effect && matched
        })
    }
}

/// The taint a cordoned node counts as having.
fn unschedulable_taint() -> Taint {
    Taint { key: "node.kubernetes.io/unschedulable".into(), effect: "NoSchedule".into(), ..Taint::default() }
}

/// Whether a label (or field) value meets a node selector requirement.
fn matches(r: &NodeSelectorRequirement, value: Option<&String>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) =
                (value.and_then(|v| number(v)), values.first().and_then(|b| number(b)))
            else {
                return false;
            };
            if r.operator == "Gt" { v > bound } else { v < bound }
        }
        _ => false,
    }
}

/// One device the allocator gives a claim's request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Given {
    /// The request.
    pub request: String,
    /// The card's index.
    pub card: u32,
    /// Percent of the card.
    pub percent: Percent,
    /// Card memory, when the request asked some.
    pub memory: Option<MiB>,
}

/// The `status.allocation` of a claim given `devices` on `node` (its pool), shared by capacity: each
/// result with the capacity it consumes and its own share ID (derived from the claim's uid and the
/// result's position, so a retried write names the same shares).
pub fn allocation(claim_uid: &str, node: &str, devices: &[Given]) -> Value {
    let results: Vec<Value> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut consumed = json!({ PERCENT: d.percent.0.to_string() });
            if let Some(m) = d.memory {
                consumed[MEMORY] = json!(format!("{}Mi", m.0));
            }
            json!({
                "request": d.request,
                "driver": DRIVER,
                "pool": node,
                "device": device_name(d.card),
                "shareID": share_id(claim_uid, i),
                "consumedCapacity": consumed,
            })
        })
        .collect();
    json!({
        "devices": { "results": results },
        "nodeSelector": { "nodeSelectorTerms": [
            { "matchFields": [{ "key": "metadata.name", "operator": "In", "values": [node] }] }
        ] },
    })
}

/// A UUID (version 4 layout) for result `i` of the claim `uid`.
fn share_id(uid: &str, i: usize) -> String {
    let a = nano_gpu_engine::engine::name_hash(uid, i as u64);
    let b = nano_gpu_engine::engine::name_hash(uid, (i as u64) ^ 0x9e37_79b9_7f4a_7c15);
    let a = (a & 0xffff_ffff_ffff_0fff) | 0x4000;
    let b = (b & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests;
