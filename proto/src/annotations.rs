//! The annotations and labels through which the agent and the allocator talk, via the API server.
//!
//! - `nano-gpu/gpus` on a Node: [`NodeInventory`], written by the agent.
//! - `nano-gpu/assignment` on a Pod: [`Assignment`], written by the allocator at bind.
//! - `nano-gpu/gpu.model`, `nano-gpu/gpu.count`, `nano-gpu/gpu.vendor` labels on a Node: [`node_labels`].
//! - `nano-gpu/overrun` on a Pod: [`OverrunMark`] (annotation) and `"true"` (label, for a selecting
//!   watch), written by the agent while a container of the pod is over its memory grant past the grace.
//!
//! Every payload carries `"v"`; a decoder refuses a version it does not know and names the field of
//! any error, so callers can fail closed (treat the card as full) and say why.

use crate::units::{MiB, Percent};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thiserror::Error;

/// Node annotation with the agent's card inventory.
pub const GPUS_ANNOTATION: &str = "nano-gpu/gpus";
/// Pod annotation with the allocator's placement.
pub const ASSIGNMENT_ANNOTATION: &str = "nano-gpu/assignment";
/// Node label: the card model most cards on the node have, sanitised for a label value.
pub const MODEL_LABEL: &str = "nano-gpu/gpu.model";
/// Node label set by an operator: `true` makes the node a nano-gpu node (the agents' DaemonSet
/// selects it).
pub const NODE_LABEL: &str = "nano-gpu/node";
/// Node label set by an operator: how the node's agent enforces shares (`none`, `mps`, `hami-core`).
pub const ENFORCEMENT_LABEL: &str = "nano-gpu/enforcement";
/// Node label set by the agent: the driver's per-cgroup memory limit on the node (`driver`: set on
/// every share's pod, `available`: the driver could, `unavailable`).
pub const MEMORY_LIMIT_LABEL: &str = "nano-gpu/memory-limit";
/// [`MEMORY_LIMIT_LABEL`]'s value where the agent sets the driver's limit on every share's pod.
pub const MEMORY_LIMIT_DRIVER: &str = "driver";
/// Node label: the number of cards.
pub const COUNT_LABEL: &str = "nano-gpu/gpu.count";
/// Node label: `nvidia`, `intel`, or `mixed`.
pub const VENDOR_LABEL: &str = "nano-gpu/gpu.vendor";
/// Node label set by the agent from its runtime canaries: whether the node's NVIDIA runtime keeps a
/// pod's own `NVIDIA_VISIBLE_DEVICES` and `cdi.k8s.io/` annotations away from the cards
/// ([`ISOLATION_HELD`]) or hands them over ([`ENV_HONOURED`], [`ANNOTATIONS_HONOURED`]). A node
/// labelled with any value but [`ISOLATION_HELD`] is served to no one.
pub const ISOLATION_LABEL: &str = "nano-gpu/device-isolation";
/// [`ISOLATION_LABEL`]'s value when a pod's env reaches no card.
pub const ISOLATION_HELD: &str = "held";
/// [`ISOLATION_LABEL`]'s value when the runtime honours a pod's env.
pub const ENV_HONOURED: &str = "env-honoured";
/// [`ISOLATION_LABEL`]'s value when the runtime honours a pod's `cdi.k8s.io/` annotations.
pub const ANNOTATIONS_HONOURED: &str = "annotations-honoured";

/// Node label set by the agent: which of its front ends serves the node's cards. [`FRONT_END_DRA`]:
/// the DRA driver does (claims of the DeviceClass `gpu.nano-gpu.io`), and the allocator places no
/// `nano-gpu/gpu-percent` share there, so the two never book the same card; absent: the device plugin.
pub const FRONT_END_LABEL: &str = "nano-gpu/front-end";
/// [`FRONT_END_LABEL`]'s value on a node whose cards the DRA driver serves.
pub const FRONT_END_DRA: &str = "dra";
/// Node label set by you: `"false"` keeps the node's cards on the device plugin though its agent
/// runs with `--dra` (the choice per node; the agent reads it when it starts).
pub const DRA_LABEL: &str = "nano-gpu/dra";

/// Pod annotation (the [`OverrunMark`]) and label (`"true"`) of a pod over its memory grant.
pub const OVERRUN: &str = "nano-gpu/overrun";

/// The payload version this build writes and reads.
pub const VERSION: u32 = 1;

/// An annotation that cannot be used, naming the annotation and the field.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{annotation}: {field}: {message}")]
pub struct DecodeError {
    /// Annotation key.
    pub annotation: &'static str,
    /// Path of the offending field (`containers.train[0].percent`), or `.` for the whole payload.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

fn decode<T: DeserializeOwned>(annotation: &'static str, text: &str) -> Result<T, DecodeError> {
    let err = |field: String, message: String| DecodeError { annotation, field, message };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(".".into(), format!("not JSON: {e}")))?;
    match value.get("v") {
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(u64::from(VERSION)) => {}
        Some(v) => {
            return Err(err("v".into(), format!("unsupported version {v} (this build reads {VERSION})")));
        }
        None => return Err(err("v".into(), "missing version".into())),
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        err(field, e.into_inner().to_string())
    })
}

/// Vendor of a card.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// NVIDIA, read through NVML.
    Nvidia,
    /// Intel, read through sysfs drm.
    Intel,
}

/// One card as the agent sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// Index on the node (NVML index, or drm card number for Intel).
    pub index: u32,
    /// Stable identifier (`GPU-…` for NVIDIA).
    pub uuid: String,
    /// Who made it.
    pub vendor: Vendor,
    /// Model name as the driver reports it.
    pub model: String,
    /// Total memory.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: MiB,
    /// Whether the card may take new work.
    pub healthy: bool,
    /// NUMA node, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<u32>,
}

/// The `nano-gpu/gpus` payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// Payload version, [`VERSION`].
    pub v: u32,
    /// The cards, in index order.
    pub gpus: Vec<GpuInfo>,
}

impl NodeInventory {
    /// An inventory of the current version.
    pub fn new(gpus: Vec<GpuInfo>) -> Self {
        NodeInventory { v: VERSION, gpus }
    }

    /// The annotation value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads and checks an annotation value.
    pub fn decode(text: &str) -> Result<Self, DecodeError> {
        let inv: NodeInventory = decode(GPUS_ANNOTATION, text)?;
        let err =
            |field: String, message: String| DecodeError { annotation: GPUS_ANNOTATION, field, message };
        let mut seen = std::collections::BTreeSet::new();
        for (i, g) in inv.gpus.iter().enumerate() {
            if g.uuid.is_empty() {
                return Err(err(format!("gpus[{i}].uuid"), "empty".into()));
            }
            if !seen.insert(g.uuid.as_str()) {
                return Err(err(format!("gpus[{i}].uuid"), format!("{} appears twice", g.uuid)));
            }
        }
        Ok(inv)
    }
}

/// One card (or a share of it) granted to a container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CardGrant {
    /// Card UUID.
    pub uuid: String,
    /// Card index on the node, for humans and gpushare's `ALIYUN_COM_GPU_MEM_IDX`.
    pub index: u32,
    /// Share of the card; 100 for a whole card.
    pub percent: Percent,
    /// Memory granted on the card, if the container asked for memory.
    #[serde(rename = "memoryMiB", default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<MiB>,
}

impl CardGrant {
    /// The memory this grant holds on a card of `card_memory`: what it asked, or, asking none, its
    /// percent of the card's memory (the one memory rule, [`Percent::of`]).
    pub fn memory_held(&self, card_memory: MiB) -> MiB {
        self.memory_mib.unwrap_or_else(|| self.percent.of(card_memory))
    }
}

/// The `nano-gpu/assignment` payload: which card(s) each container of the pod gets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Payload version, [`VERSION`].
    pub v: u32,
    /// The node the pod is bound to.
    pub node: String,
    /// When the allocator decided (RFC 3339, UTC).
    pub at: String,
    /// Per container name, its card grants.
    pub containers: BTreeMap<String, Vec<CardGrant>>,
    /// Containers (init containers) that run on the cards of another container of the pod, as the
    /// kubelet reuses their device IDs: their grants do not add to what the pod holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reuse: Vec<String>,
}

impl Assignment {
    /// An assignment of the current version.
    pub fn new(
        node: impl Into<String>,
        at: impl Into<String>,
        containers: BTreeMap<String, Vec<CardGrant>>,
    ) -> Self {
        Assignment { v: VERSION, node: node.into(), at: at.into(), containers, reuse: Vec::new() }
    }

    /// What the pod holds: the grants of every container that does not reuse another's cards.
    pub fn held(&self) -> impl Iterator<Item = &CardGrant> {
        self.containers.iter().filter(|(name, _)| !self.reuse.contains(name)).flat_map(|(_, grants)| grants)
    }

    /// The annotation value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads and checks an annotation value: shares in 1..=100, a container never gets one card twice.
    pub fn decode(text: &str) -> Result<Self, DecodeError> {
        let a: Assignment = decode(ASSIGNMENT_ANNOTATION, text)?;
        let err = |field: String, message: String| DecodeError {
            annotation: ASSIGNMENT_ANNOTATION,
            field,
            message,
        };
        if a.node.is_empty() {
            return Err(err("node".into(), "empty".into()));
        }
        for (name, grants) in &a.containers {
            if grants.is_empty() {
                return Err(err(format!("containers.{name}"), "no cards".into()));
            }
            let mut seen = std::collections::BTreeSet::new();
            for (i, g) in grants.iter().enumerate() {
                if !(1..=100).contains(&g.percent.0) {
                    return Err(err(
                        format!("containers.{name}[{i}].percent"),
                        format!("{} is not in 1..=100", g.percent.0),
                    ));
                }
                if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
                    return Err(err(format!("containers.{name}[{i}].uuid"), "empty or repeated".into()));
                }
            }
        }
        for (i, name) in a.reuse.iter().enumerate() {
            if !a.containers.contains_key(name) {
                return Err(err(format!("reuse[{i}]"), format!("{name:?} is not among the containers")));
            }
        }
        Ok(a)
    }
}

/// The `nano-gpu/overrun` payload: the containers of a pod that have used more card memory than
/// granted for longer than the agent's grace period. The agent keeps it equal to what it sees and
/// removes it when all are back under; with `--evict-overruns` the allocator evicts a marked pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverrunMark {
    /// Payload version, [`VERSION`].
    pub v: u32,
    /// The containers over their grant, one entry per container and card.
    pub containers: Vec<Overrun>,
}

/// One container over its memory grant on one card.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Overrun {
    /// Container name.
    pub container: String,
    /// Card UUID.
    pub uuid: String,
    /// Card index.
    pub index: u32,
    /// Memory its processes used when it was marked.
    #[serde(rename = "usedMiB")]
    pub used: MiB,
    /// Memory granted.
    #[serde(rename = "grantedMiB")]
    pub granted: MiB,
    /// Since when it has been over (RFC 3339, UTC).
    pub since: String,
}

impl OverrunMark {
    /// A mark of the current version.
    pub fn new(containers: Vec<Overrun>) -> Self {
        OverrunMark { v: VERSION, containers }
    }

    /// The annotation value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads and checks an annotation value: at least one container, each named, on a named card.
    pub fn decode(text: &str) -> Result<Self, DecodeError> {
        let m: OverrunMark = decode(OVERRUN, text)?;
        let err = |field: String, message: &str| DecodeError {
            annotation: OVERRUN,
            field,
            message: message.into(),
        };
        if m.containers.is_empty() {
            return Err(err("containers".into(), "empty"));
        }
        for (i, o) in m.containers.iter().enumerate() {
            if o.container.is_empty() || o.uuid.is_empty() {
                return Err(err(format!("containers[{i}]"), "no container or card named"));
            }
        }
        Ok(m)
    }
}

/// A UTC time as RFC 3339 with second precision (`2026-11-21T10:00:00Z`).
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// A model name as a label value: characters outside `[A-Za-z0-9_.-]` become `-`, trimmed to 63
/// characters and to alphanumerics at both ends (`NVIDIA H100 80GB HBM3` → `NVIDIA-H100-80GB-HBM3`).
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' })
        .take(63)
        .collect();
    mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
}

/// The labels an agent puts on its Node for this inventory.
pub fn node_labels(inv: &NodeInventory) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    labels.insert(COUNT_LABEL.to_owned(), inv.gpus.len().to_string());
    let mut counts: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (i, g) in inv.gpus.iter().enumerate() {
        counts.entry(g.model.as_str()).or_insert((0, i)).0 += 1;
    }
    // Most cards wins; on a tie, the model of the lowest index.
    if let Some((model, _)) = counts.iter().max_by_key(|(_, (n, first))| (*n, std::cmp::Reverse(*first))) {
        labels.insert(MODEL_LABEL.to_owned(), label_value(model));
    }
    let vendors: std::collections::BTreeSet<Vendor> = inv.gpus.iter().map(|g| g.vendor).collect();
    let vendor = match vendors.len() {
        0 => None,
        1 => Some(match vendors.iter().next() {
            Some(Vendor::Intel) => "intel",
            _ => "nvidia",
        }),
        _ => Some("mixed"),
    };
    if let Some(v) = vendor {
        labels.insert(VENDOR_LABEL.to_owned(), v.to_owned());
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    const INVENTORY_GOLDEN: &str = r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-8a1c","vendor":"nvidia","model":"NVIDIA H100 80GB HBM3","memoryMiB":81559,"healthy":true,"numa":0},{"index":1,"uuid":"0000:03:00.0","vendor":"intel","model":"Intel Data Center GPU Flex 170","memoryMiB":16256,"healthy":false}]}"#;
    const ASSIGNMENT_GOLDEN: &str = r#"{"v":1,"node":"n1","at":"2026-11-21T10:00:00Z","containers":{"infer":[{"uuid":"GPU-b","index":1,"percent":100},{"uuid":"GPU-c","index":2,"percent":100}],"train":[{"uuid":"GPU-a","index":0,"percent":30,"memoryMiB":8192}]}}"#;

    #[test]
    fn an_overrun_mark_round_trips_and_refuses_what_names_nothing() {
        let golden = r#"{"v":1,"containers":[{"container":"c","uuid":"GPU-a","index":0,"usedMiB":20000,"grantedMiB":1536,"since":"2026-11-23T10:00:00Z"}]}"#;
        let mark = OverrunMark::decode(golden).unwrap();
        assert_eq!(mark.containers[0].used, MiB(20000));
        assert_eq!(mark.encode(), golden);
        for (text, field) in [
            (r#"{"v":1,"containers":[]}"#, "containers"),
            (
                r#"{"v":1,"containers":[{"container":"","uuid":"GPU-a","index":0,"usedMiB":1,"grantedMiB":0,"since":""}]}"#,
                "containers[0]",
            ),
            (r#"{"v":2,"containers":[]}"#, "v"),
            (r#"{"v":1,"containers":[{"container":"c"}]}"#, "containers[0]"),
        ] {
            let e = OverrunMark::decode(text).unwrap_err();
            assert_eq!((e.annotation, e.field.as_str()), (OVERRUN, field), "{text}: {e}");
        }
    }

    fn inventory() -> NodeInventory {
        NodeInventory::new(vec![
            GpuInfo {
                index: 0,
                uuid: "GPU-8a1c".into(),
                vendor: Vendor::Nvidia,
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_mib: MiB(81559),
                healthy: true,
                numa: Some(0),
            },
            GpuInfo {
                index: 1,
                uuid: "0000:03:00.0".into(),
                vendor: Vendor::Intel,
                model: "Intel Data Center GPU Flex 170".into(),
                memory_mib: MiB(16256),
                healthy: false,
                numa: None,
            },
        ])
    }

    fn assignment() -> Assignment {
        let grant = |uuid: &str, index, percent, memory_mib| CardGrant {
            uuid: uuid.into(),
            index,
            percent: Percent(percent),
            memory_mib,
        };
        Assignment::new(
            "n1",
            "2026-11-21T10:00:00Z",
            [
                ("train".to_string(), vec![grant("GPU-a", 0, 30, Some(MiB(8192)))]),
                ("infer".to_string(), vec![grant("GPU-b", 1, 100, None), grant("GPU-c", 2, 100, None)]),
            ]
            .into(),
        )
    }

    #[test]
    fn inventory_encodes_to_the_golden_json_and_back() {
        assert_eq!(inventory().encode(), INVENTORY_GOLDEN);
        assert_eq!(NodeInventory::decode(INVENTORY_GOLDEN).unwrap(), inventory());
    }

    #[test]
    fn assignment_encodes_to_the_golden_json_and_back() {
        assert_eq!(assignment().encode(), ASSIGNMENT_GOLDEN);
        assert_eq!(Assignment::decode(ASSIGNMENT_GOLDEN).unwrap(), assignment());
    }

    #[test]
    fn a_future_version_is_refused_not_guessed() {
        let e = Assignment::decode(&ASSIGNMENT_GOLDEN.replace(r#""v":1"#, r#""v":2"#)).unwrap_err();
        assert_eq!(e.to_string(), "nano-gpu/assignment: v: unsupported version 2 (this build reads 1)");
        let e = NodeInventory::decode(r#"{"gpus":[]}"#).unwrap_err();
        assert_eq!(e.field, "v");
    }

    #[test]
    fn decode_errors_name_the_field() {
        let bad = ASSIGNMENT_GOLDEN.replace(r#""percent":30"#, r#""percent":"30""#);
        let e = Assignment::decode(&bad).unwrap_err();
        assert_eq!(e.field, "containers.train[0].percent", "{e}");
        let bad = INVENTORY_GOLDEN.replace(r#""memoryMiB":16256,"#, "");
        let e = NodeInventory::decode(&bad).unwrap_err();
        assert!(e.to_string().contains("missing field `memoryMiB`"), "{e}");
        assert_eq!(e.field, "gpus[1]");
        let e = NodeInventory::decode("not json").unwrap_err();
        assert!(e.to_string().starts_with("nano-gpu/gpus: .: not JSON"), "{e}");
    }

    #[test]
    fn reusing_containers_do_not_add_to_what_the_pod_holds() {
        let golden = r#"{"v":1,"node":"n1","at":"t","containers":{"app":[{"uuid":"GPU-a","index":0,"percent":40}],"warm":[{"uuid":"GPU-a","index":0,"percent":40}]},"reuse":["warm"]}"#;
        let a = Assignment::decode(golden).unwrap();
        assert_eq!(a.encode(), golden);
        assert_eq!(a.held().map(|g| g.percent.0).sum::<u32>(), 40);
        let e = Assignment::decode(&golden.replace(r#"["warm"]"#, r#"["cold"]"#)).unwrap_err();
        assert_eq!(e.field, "reuse[0]");
    }

    #[test]
    fn assignment_shares_must_be_in_range() {
        let bad = ASSIGNMENT_GOLDEN.replace(r#""percent":30"#, r#""percent":130"#);
        let e = Assignment::decode(&bad).unwrap_err();
        assert_eq!(e.to_string(), "nano-gpu/assignment: containers.train[0].percent: 130 is not in 1..=100");
    }

    #[test]
    fn inventory_refuses_a_repeated_uuid() {
        let bad = INVENTORY_GOLDEN.replace("0000:03:00.0", "GPU-8a1c");
        assert_eq!(NodeInventory::decode(&bad).unwrap_err().field, "gpus[1].uuid");
    }

    #[test]
    fn unknown_fields_from_a_newer_agent_are_ignored() {
        let newer = INVENTORY_GOLDEN.replace(r#""healthy":true"#, r#""healthy":true,"migMode":false"#);
        assert_eq!(NodeInventory::decode(&newer).unwrap(), inventory());
    }

    #[test]
    fn rfc3339_formats_utc_dates() {
        let t = |secs| rfc3339(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs));
        assert_eq!(t(0), "1970-01-01T00:00:00Z");
        assert_eq!(t(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(t(1_795_305_600 + 3661), "2026-11-22T01:01:01Z");
    }

    #[test]
    fn labels_name_the_majority_model_sanitised() {
        let labels = node_labels(&inventory());
        assert_eq!(labels[COUNT_LABEL], "2");
        assert_eq!(labels[MODEL_LABEL], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(labels[VENDOR_LABEL], "mixed");
        assert_eq!(label_value("  (weird) name!  "), "weird--name");
        assert_eq!(label_value(&"x".repeat(80)).len(), 63);
    }
}
