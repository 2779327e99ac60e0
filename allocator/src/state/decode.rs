//! Decoding Nodes and Pods into the records the view keeps: a Node's allocatable CPU and memory and
//! its `nano-gpu/gpus` inventory ([`node_record`]); a Pod's host requests and what its
//! `nano-gpu/assignment` (or, for a pod gpushare placed, gpushare's annotations) says it holds
//! ([`holding`]). Nothing undecodable is dropped: it becomes a record that fails closed (an inventory
//! error, an [`Holding::Unknown`] assignment, a gpushare share on an unknown card).

use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use nano_gpu_engine::model::{Card, Host};
use nano_gpu_engine::request::SlotDemand;
use nano_gpu_proto::annotations::{
    ASSIGNMENT_ANNOTATION, Assignment, DecodeError, FRONT_END_DRA, FRONT_END_LABEL, GPUS_ANNOTATION,
    ISOLATION_HELD, ISOLATION_LABEL, NodeInventory,
};
use nano_gpu_proto::demand::{
    DemandOptions, GpushareUnit, HostDemand, PodDemand, asked, host_demand, pod_demand,
};
use nano_gpu_proto::resources::{GPU_PERCENT, GPUSHARE_MEMORY};
use nano_gpu_proto::units::{MiB, Percent};
use nano_gpu_proto::{gpushare, quantity};
use std::collections::BTreeMap;

/// What a node object says.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct NodeRecord {
    pub(super) cpu: u64,
    pub(super) mem: u64,
    /// Its kubelet's allocatable `nano-gpu/gpu-percent`: the device IDs the agent's device plugin
    /// registered (none while it is not registered).
    pub(super) ids: u64,
    pub(super) inventory: Option<Result<NodeInventory, DecodeError>>,
    /// The agent's runtime canaries found that the node's runtime hands a pod the cards its own
    /// `NVIDIA_VISIBLE_DEVICES` or its `cdi.k8s.io/` annotations name
    /// (`nano-gpu/device-isolation` set, and not `held`: `env-honoured`, `annotations-honoured`, or a
    /// value of a later agent): served to no one, even by an older agent still Ready there during a
    /// rollout.
    pub(super) exposed: bool,
    /// Its agent serves the cards through DRA (`nano-gpu/front-end: dra`): no share goes there.
    pub(super) dra: bool,
    /// Of a DRA node only: its labels, taints and cordon, which the claims' placement reads.
    pub(super) facts: Option<crate::decide::claim::NodeFacts>,
}

/// What a pod holds.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Holding {
    /// Only CPU and memory.
    Nothing,
    /// The cards of its assignment.
    Cards(Assignment),
    /// Memory on cards that gpushare placed it on (before nano-gpu took over): named by card index in
    /// gpushare's own annotations, resolved against the node's cards when the node is rebuilt.
    Gpushare(Vec<GpushareShare>),
    /// An assignment that cannot be trusted: every card of the node counts as full.
    Unknown(String),
}

/// Memory a pod placed by gpushare holds on one card.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct GpushareShare {
    /// The card's index on the node, or why gpushare's annotations do not tell it (then the memory
    /// counts on every card of the node: it may be on any of them).
    pub(super) card: Result<u32, String>,
    /// Memory held.
    pub(super) memory: MiB,
}

impl GpushareShare {
    /// Where the share counts among a node's `cards`: the card of its index, or (`None`) every card,
    /// when the index cannot be read or names no card of the node.
    pub(super) fn card_in(&self, cards: &[Card]) -> Option<usize> {
        let index = self.card.as_ref().ok()?;
        cards.iter().position(|c| c.index == *index)
    }

    /// The percent of `card` the share holds: the part of its memory the share is (the rule for
    /// memory-only shares), all of it on a card whose memory is not known.
    pub(super) fn percent_on(&self, card: &Card) -> Percent {
        SlotDemand::Share { percent: None, mem: Some(self.memory) }.percent_on(card).unwrap_or(Percent::FULL)
    }
}

/// What a pod holds, and where.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct PodRecord {
    pub(super) key: (String, String),
    pub(super) node: String,
    pub(super) cpu: u64,
    pub(super) mem: u64,
    /// The `nano-gpu/gpu-percent` device IDs it asks of the kubelet.
    pub(super) ids: u64,
    pub(super) holding: Holding,
    /// Made by our bind and not yet seen annotated in a watch event.
    pub(super) reserved: bool,
    /// Its priority (`spec.priority`; 0 when none is set), which preemption weighs.
    pub(super) priority: i32,
    /// Being deleted: what it holds is freed soon without anyone preempting it.
    pub(super) terminating: bool,
}

impl PodRecord {
    /// Whether `other` takes from its node what this one does: the same node, host resources and
    /// holding (and name, which the node's warnings carry). What else differs (the reservation
    /// confirmed by the watch, priority, being deleted) leaves the engine's node as it was.
    pub(super) fn takes_the_same(&self, other: &PodRecord) -> bool {
        self.key == other.key
            && self.node == other.node
            && (self.cpu, self.mem, self.ids) == (other.cpu, other.mem, other.ids)
            && self.holding == other.holding
    }
}

pub(super) fn pod_uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref()
}

/// A pod's priority (`spec.priority`, which admission sets from its PriorityClass; 0 when none).
pub(super) fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

pub(super) fn is_terminal(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// What a Node object says: allocatable CPU (milli), memory (MiB) and `nano-gpu/gpu-percent`, and its
/// inventory if annotated.
pub(super) fn node_record(node: &KubeNode) -> NodeRecord {
    let alloc = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let read = |key: &str, parse: fn(&str) -> Result<u64, quantity::QuantityError>| {
        alloc.and_then(|a| a.get(key)).and_then(|q| parse(&q.0).ok()).unwrap_or(0)
    };
    let inventory = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GPUS_ANNOTATION))
        .map(|text| NodeInventory::decode(text));
    let exposed = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ISOLATION_LABEL))
        .is_some_and(|v| v != ISOLATION_HELD);
    let dra = node.metadata.labels.as_ref().and_then(|l| l.get(FRONT_END_LABEL)).map(String::as_str)
        == Some(FRONT_END_DRA);
    let facts = dra.then(|| crate::decide::claim::NodeFacts {
        labels: node.metadata.labels.clone().unwrap_or_default(),
        taints: node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default(),
        cordoned: node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
    });
    NodeRecord {
        cpu: read("cpu", quantity::cpu_milli),
        mem: read("memory", quantity::mebibytes),
        ids: read(GPU_PERCENT, quantity::whole),
        inventory,
        exposed,
        dra,
        facts,
    }
}

/// What a pod's assignment says it holds; an assignment that names another node than the one the pod
/// is bound to cannot be trusted. A bound pod without one that gpushare placed (its annotations, with
/// gpushare compatibility on) holds the memory gpushare gave it.
///
/// Only a pod that asks a GPU resource can hold cards: the allocator never writes an assignment on
/// any other pod, so one found there is somebody else's (anyone who may create pods could write one)
/// and is ignored; the error says why, for a warning Event. `demand` says how pods are read
/// (gpushare compatibility). The demand read for that check comes back with the answer, so the
/// caller reads the pod's host requests from it instead of reading the pod again.
pub(super) fn holding(pod: &Pod, demand: &DemandOptions) -> (Result<Holding, String>, Option<PodDemand>) {
    let Some(claim) = claim(pod, demand) else { return (Ok(Holding::Nothing), None) };
    let what = match &claim {
        Claim::Assignment(_) => ASSIGNMENT_ANNOTATION,
        Claim::Gpushare(..) => "gpushare's annotations",
    };
    let read = match pod_demand(pod, demand) {
        Ok(d) if d.wants_gpu() => d,
        Ok(d) => {
            // A tool run without gpushare compatibility on a cluster that has it reads gpushare's pods
            // as asking nothing: say how to read them.
            let gpushare = demand.gpushare.is_none() && asks_gpushare_memory(pod);
            let hint = if gpushare {
                format!(" (it asks {GPUSHARE_MEMORY}: read it with --gpushare)")
            } else {
                String::new()
            };
            return (Err(format!("{what} on a pod that asks no GPU is ignored{hint}")), Some(d));
        }
        Err(e) => {
            return (Err(format!("{what} on a pod with an invalid GPU request ({e}) is ignored")), None);
        }
    };
    let held = match claim {
        Claim::Assignment(annotation) => assigned(pod, annotation),
        Claim::Gpushare(unit, placed) => placed_by_gpushare(pod, unit, placed),
    };
    (Ok(held), Some(read))
}

/// Whether any container of the pod names gpushare's memory resource (a quantity that does not
/// read counts: it names it).
fn asks_gpushare_memory(pod: &Pod) -> bool {
    let containers =
        pod.spec.iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
    containers.map(|c| asked(c, GPUSHARE_MEMORY)).any(|a| !matches!(a, Ok(None)))
}

/// What a pod's annotations say it holds, before checking that it asks a GPU.
enum Claim<'a> {
    /// Our `nano-gpu/assignment`.
    Assignment(&'a str),
    /// gpushare's placement of a bound pod (see [`gpushare::placement`]), with gpushare's unit.
    Gpushare(GpushareUnit, Result<BTreeMap<u32, u64>, String>),
}

fn claim<'a>(pod: &'a Pod, demand: &DemandOptions) -> Option<Claim<'a>> {
    if let Some(annotation) = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION)) {
        return Some(Claim::Assignment(annotation));
    }
    // gpushare's bind writes its annotations before binding: on a pod still Pending they hold nothing.
    pod.spec.as_ref()?.node_name.as_ref()?;
    Some(Claim::Gpushare(demand.gpushare?, gpushare::placement(pod)?))
}

/// What gpushare's `placed` says `pod` holds: per card index, its units in MiB; when the card cannot be
/// told, the pod's whole memory on whichever card it is.
fn placed_by_gpushare(pod: &Pod, unit: GpushareUnit, placed: Result<BTreeMap<u32, u64>, String>) -> Holding {
    let mib = |units: u64| unit.to_mib(units).unwrap_or(MiB(u64::MAX));
    Holding::Gpushare(match placed {
        Ok(cards) => cards
            .into_iter()
            .map(|(index, units)| GpushareShare { card: Ok(index), memory: mib(units) })
            .collect(),
        Err(why) => vec![GpushareShare { card: Err(why), memory: mib(gpushare::pod_units(pod)) }],
    })
}

/// What the assignment `annotation` of `pod` says it holds.
fn assigned(pod: &Pod, annotation: &str) -> Holding {
    let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    match Assignment::decode(annotation) {
        Ok(a) if bound_to.is_none_or(|n| n == a.node) => Holding::Cards(a),
        Ok(a) => Holding::Unknown(format!(
            "{ASSIGNMENT_ANNOTATION} names node {} but the pod is bound to {}",
            a.node,
            bound_to.unwrap_or("")
        )),
        Err(e) => Holding::Unknown(e.to_string()),
    }
}

/// The host CPU (milli) and memory (MiB) a pod requests and the device IDs it asks of the kubelet,
/// from its demand when it was read already, else from its quantities alone (a pod whose GPU demand
/// the allocator refuses still holds what the kubelet counts for it; one whose quantities cannot be
/// read, which the API server does not admit, holds none).
pub(super) fn host_requests(pod: &Pod, read: Option<&PodDemand>) -> Host {
    let host = match read {
        Some(d) => HostDemand { cpu: d.cpu, memory: d.memory, ids: d.ids },
        None => host_demand(pod).unwrap_or_default(),
    };
    Host { cpu: host.cpu.0, mem: host.memory.0, ids: host.ids }
}
