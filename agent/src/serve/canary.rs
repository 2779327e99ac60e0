//! The runtime canaries: does this node's NVIDIA container runtime give cards to a container that
//! asks for none and names them in its own environment, or in its pod's annotations?
//!
//! A tenant's pod is judged by the runtime, not by us: set as the README says
//! (`accept-nvidia-visible-devices-envvar-when-unprivileged = false`), the runtime ignores an
//! unprivileged container's `NVIDIA_VISIBLE_DEVICES` and reads only the device list the device plugin
//! mounted; at its defaults it honours the variable, and any pod on the node that sets it sees every
//! card. The toolkit's configuration file is not a reliable place to read this (another file, another
//! runtime, a CDI mode), so the agent's pod asks the runtime itself: its container `runtime-canary`
//! (`nano-gpu-agent canary`) is unprivileged, asks no GPU, sets `NVIDIA_VISIBLE_DEVICES=all`, and
//! writes what it sees ([`look`], [`write`]) into a directory it shares with the agent. The agent
//! reads it ([`watch`]): a node whose runtime honoured the variable is not ready (`/readyz` says why,
//! so the allocator places no GPU pod there), is labelled `nano-gpu/device-isolation=env-honoured`,
//! and gets a Warning Event `RuntimeHonoursPodEnv`; one where it did not is labelled `held`.
//!
//! The same holds for pod annotations: NVIDIA's runtime in its CDI mode gives a container every device
//! a `cdi.k8s.io/*` annotation of its OCI spec names, with no privilege check, and a pod's annotations
//! reach that spec where the node passes them (CRI-O copies them all; containerd those its runtime's
//! `pod_annotations` lists). The agent's pod carries `cdi.k8s.io/nano-gpu-canary:
//! runtime.nvidia.com/gpu=all` (a name the runtime resolves from the driver, with no spec file), and
//! its container `annotation-canary` asks nothing else: given a card, the node is labelled
//! `annotations-honoured` and warned about (`RuntimeHonoursPodAnnotations`). The annotation reaches
//! every container of the pod, the env canary's too: when both see cards, the annotation is named.

use crate::cards::inventory::{GpuInventory, NvmlInventory};
use crate::node::probe::Readiness;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use nano_gpu_proto::events::Reason;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use nano_gpu_proto::annotations::ISOLATION_LABEL;
use nano_gpu_proto::annotations::{ANNOTATIONS_HONOURED, ENV_HONOURED, ISOLATION_HELD};

/// The largest report read (it is a few dozen bytes).
const MAX_REPORT: u64 = 4096;

/// What the canary container saw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Seen {
    /// Cards NVML listed (0 when no driver library was given to the container).
    pub nvml_cards: u32,
    /// Why NVML listed none, when it could not start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_error: Option<String>,
    /// NVIDIA card device nodes (`/dev/nvidia<N>`) in the container.
    pub device_nodes: u32,
}

impl Seen {
    /// Whether the runtime gave the container any card.
    pub fn any(&self) -> bool {
        self.nvml_cards > 0 || self.device_nodes > 0
    }
}

/// What a container sees: NVML's cards through the library `nvml_lib` (the runtime mounts the
/// driver's into a container it gives cards to), and the card device nodes under `dev`.
pub fn look(nvml_lib: &Path, dev: &Path) -> Seen {
    let (nvml_cards, nvml_error) = match NvmlInventory::new(nvml_lib.to_owned()).cards() {
        Ok(cards) => (u32::try_from(cards.len()).unwrap_or(u32::MAX), None),
        Err(e) => (0, Some(e.to_string())),
    };
    let device_nodes = std::fs::read_dir(dev)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    Seen { nvml_cards, nvml_error, device_nodes: u32::try_from(device_nodes).unwrap_or(u32::MAX) }
}

/// Writes `seen` to `report` whole (a temporary file renamed over it).
pub fn write(report: &Path, seen: &Seen) -> std::io::Result<()> {
    let tmp = report.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(seen)?)?;
    std::fs::rename(&tmp, report)
}

/// What the agent makes of the canary's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No report (yet), or one that cannot be read: the reason.
    Unknown(String),
    /// The runtime gave the canaries no card.
    Held,
    /// The runtime gave the env canary cards from its own environment.
    EnvHonoured(Seen),
    /// The runtime gave the annotation canary cards its pod's annotation names.
    AnnotationsHonoured(Seen),
}

impl Verdict {
    /// The Node label's value, when the canary has said.
    pub fn label(&self) -> Option<&'static str> {
        match self {
            Verdict::Unknown(_) => None,
            Verdict::Held => Some(ISOLATION_HELD),
            Verdict::EnvHonoured(_) => Some(ENV_HONOURED),
            Verdict::AnnotationsHonoured(_) => Some(ANNOTATIONS_HONOURED),
        }
    }

    /// The Event a node given this verdict gets.
    fn reason(&self) -> Option<Reason> {
        match self {
            Verdict::EnvHonoured(_) => Some(Reason::RuntimeHonoursPodEnv),
            Verdict::AnnotationsHonoured(_) => Some(Reason::RuntimeHonoursPodAnnotations),
            Verdict::Unknown(_) | Verdict::Held => None,
        }
    }

    /// Why the node must not be served, if it must not.
    pub fn problem(&self) -> Option<String> {
        let seen = match self {
            Verdict::Unknown(_) | Verdict::Held => return None,
            Verdict::AnnotationsHonoured(seen) => {
                return Some(format!(
                    "this node's NVIDIA runtime gave a container that asks no GPU the cards its pod's \
                     annotation cdi.k8s.io/nano-gpu-canary names ({} by NVML, {} device nodes): any pod \
                     whose annotations reach the runtime could reach every card; keep cdi.k8s.io/* pod \
                     annotations from it (containerd: out of the runtime's pod_annotations; CRI-O passes \
                     them all: run NVIDIA's runtime in legacy mode there), then restart this pod",
                    seen.nvml_cards, seen.device_nodes
                ));
            }
            Verdict::EnvHonoured(seen) => seen,
        };
        Some(format!(
            "this node's NVIDIA runtime gave a container that asks no GPU the cards its own \
             NVIDIA_VISIBLE_DEVICES=all names ({} by NVML, {} device nodes): any pod here could reach \
             every card; set accept-nvidia-visible-devices-envvar-when-unprivileged = false and \
             accept-nvidia-visible-devices-as-volume-mounts = true in the runtime's config.toml, then \
             restart this pod",
            seen.nvml_cards, seen.device_nodes
        ))
    }
}

/// What the two canaries' reports say together (`annotations`: `None` where there is no annotation
/// canary). The annotation reaches every container of the pod, so a runtime that honours it gives
/// both canaries cards: the annotation is named first.
pub fn judge(env: Verdict, annotations: Option<Verdict>) -> Verdict {
    let annotations = annotations.map(|v| match v {
        // [`read`] judges a report as the env canary's.
        Verdict::EnvHonoured(seen) => Verdict::AnnotationsHonoured(seen),
        v => v,
    });
    match (env, annotations) {
        (_, Some(v @ Verdict::AnnotationsHonoured(_))) => v,
        (v @ Verdict::EnvHonoured(_), _) => v,
        (Verdict::Unknown(why), _) => Verdict::Unknown(why),
        (_, Some(Verdict::Unknown(why))) => Verdict::Unknown(format!("annotation canary: {why}")),
        (v, _) => v,
    }
}

/// Reads the report at `path` without following a link or blocking on a pipe, at most
/// [`MAX_REPORT`] bytes.
pub fn read(path: &Path) -> Verdict {
    let text = match crate::node::enforce::mps::read_small_file(path, MAX_REPORT) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Verdict::Unknown("the runtime canary has not reported yet".into());
        }
        Err(e) => return Verdict::Unknown(format!("reading {}: {e}", path.display())),
    };
    match serde_json::from_str::<Seen>(&text) {
        Ok(seen) if seen.any() => Verdict::EnvHonoured(seen),
        Ok(_) => Verdict::Held,
        Err(e) => Verdict::Unknown(format!("{}: not a canary report: {e}", path.display())),
    }
}

/// `nano-gpu-agent canary`: looks once, writes the report, then waits for SIGTERM (the container
/// stays running, so the pod stays Ready and the report in place).
pub async fn report(nvml_lib: PathBuf, dev: PathBuf, out: PathBuf) -> Result<(), String> {
    let seen = tokio::task::spawn_blocking(move || look(&nvml_lib, &dev)).await.map_err(|e| e.to_string())?;
    write(&out, &seen).map_err(|e| format!("writing {}: {e}", out.display()))?;
    if seen.any() {
        tracing::warn!(
            ?seen,
            "this container asks no GPU and was given cards: the runtime honours its env or its pod's annotations"
        );
    } else {
        tracing::info!(?seen, "this container asks no GPU and was given none");
    }
    nano_gpu_runtime::terminated().await;
    Ok(())
}

/// How long the agent waits for the canary's first report before it is ready without one (a
/// canary that cannot run must not keep a node from serving for good; the agent's log says it).
pub const FIRST_REPORT: Duration = Duration::from_secs(30);

/// Where the canaries write their reports.
#[derive(Clone, Debug)]
pub struct Reports {
    /// The env canary's (`runtime-canary`).
    pub env: PathBuf,
    /// The annotation canary's (`annotation-canary`), if the pod has one.
    pub annotations: Option<PathBuf>,
}

impl Reports {
    /// What they say now ([`judge`]).
    fn read(&self) -> Verdict {
        judge(read(&self.env), self.annotations.as_deref().map(read))
    }
}

/// Reads the canaries' reports every second until they have said, then every `every`: keeps the
/// readiness problem, the Node's label and (on every change to a verdict that the runtime honours
/// what a pod names) a Warning Event in step with them. Until the first verdict, for at most
/// [`FIRST_REPORT`], the agent is not ready.
pub async fn watch(
    reports: Reports,
    readiness: Arc<Readiness>,
    node: Option<(kube::Client, String)>,
    every: Duration,
) {
    let recorder = node.as_ref().map(|(client, name)| {
        let reporter = Reporter { controller: "nano-gpu-agent".into(), instance: Some(name.clone()) };
        (Recorder::new(client.clone(), reporter), Api::<Node>::all(client.clone()), name.clone())
    });
    let mut labelled: Option<&'static str> = None;
    let started = tokio::time::Instant::now();
    let (mut reported, mut gave_up, mut first) = (false, false, true);
    let mut last: Option<Verdict> = None;
    loop {
        if !first {
            tokio::time::sleep(if reported { every } else { Duration::from_secs(1) }).await;
        }
        first = false;
        let read_now = {
            let reports = reports.clone();
            tokio::task::spawn_blocking(move || reports.read())
                .await
                .unwrap_or_else(|e| Verdict::Unknown(e.to_string()))
        };
        // A report that cannot be read after one was: the last verdict stands (an `env-honoured` or
        // `annotations-honoured` node never turns servable by a lost file).
        let verdict = match (&read_now, &last) {
            (Verdict::Unknown(why), Some(last)) => {
                tracing::warn!(
                    "the runtime canary's report cannot be read ({why}); keeping its last verdict"
                );
                last.clone()
            }
            _ => read_now,
        };
        if !matches!(verdict, Verdict::Unknown(_)) {
            last = Some(verdict.clone());
        }
        reported |= !matches!(verdict, Verdict::Unknown(_));
        let problem = match &verdict {
            Verdict::Unknown(why) if !reported && started.elapsed() < FIRST_REPORT => {
                Some(format!("waiting for the runtime canary's first report ({why})"))
            }
            Verdict::Unknown(why) if !reported => {
                if !gave_up {
                    tracing::warn!(
                        "no report from the runtime canary within {FIRST_REPORT:?} ({why}); serving without its verdict"
                    );
                    gave_up = true;
                }
                None
            }
            v => v.problem(),
        };
        readiness.set_runtime_problem(problem);
        let (Some(label), Some((recorder, nodes, name))) = (verdict.label(), recorder.as_ref()) else {
            continue;
        };
        if labelled == Some(label) {
            continue;
        }
        let patch = serde_json::json!({"metadata": {"labels": {ISOLATION_LABEL: label}}});
        let written = tokio::time::timeout(
            Duration::from_secs(10),
            nodes.patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await;
        match written {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the device-isolation label was not written; trying again");
                continue;
            }
            Err(_) => {
                tracing::warn!("writing the device-isolation label timed out; trying again");
                continue;
            }
        }
        labelled = Some(label);
        if let (Some(problem), Some(reason)) = (verdict.problem(), verdict.reason()) {
            tracing::error!("{problem}");
            let event = Event {
                type_: EventType::Warning,
                reason: reason.as_str().into(),
                note: Some(problem),
                action: "CheckRuntime".into(),
                secondary: None,
            };
            let node_ref = crate::serve::repair::node_reference(name);
            let sent =
                tokio::time::timeout(Duration::from_secs(10), recorder.publish(&event, &node_ref)).await;
            if !matches!(sent, Ok(Ok(()))) {
                tracing::warn!("the {reason} Event was not written");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> crate::Scratch {
        crate::Scratch::new(&format!("canary-{name}"))
    }

    #[test]
    fn a_container_given_no_card_sees_none_and_one_given_cards_sees_them() {
        let dev = dir("dev");
        for name in ["null", "nvidiactl", "nvidia-uvm", "nvidia-caps"] {
            std::fs::write(dev.join(name), "").unwrap();
        }
        let nowhere = Path::new("/nonexistent/libnvidia-ml.so.1");
        let seen = look(nowhere, &dev);
        assert_eq!((seen.nvml_cards, seen.device_nodes, seen.any()), (0, 0, false), "{seen:?}");
        assert!(seen.nvml_error.is_some());
        for name in ["nvidia0", "nvidia3"] {
            std::fs::write(dev.join(name), "").unwrap();
        }
        assert_eq!(look(nowhere, &dev).device_nodes, 2);
    }

    #[test]
    fn the_report_decides_held_honoured_or_unknown() {
        let d = dir("report");
        let report = d.join("seen.json");
        assert!(matches!(read(&report), Verdict::Unknown(ref m) if m.contains("not reported yet")));
        write(&report, &Seen { nvml_error: Some("no library".into()), ..Seen::default() }).unwrap();
        assert_eq!(read(&report), Verdict::Held);
        assert_eq!((Verdict::Held.label(), Verdict::Held.problem()), (Some("held"), None));
        let seen = Seen { nvml_cards: 4, nvml_error: None, device_nodes: 0 };
        write(&report, &seen).unwrap();
        let verdict = read(&report);
        assert_eq!(verdict, Verdict::EnvHonoured(seen));
        assert_eq!(verdict.label(), Some("env-honoured"));
        let problem = verdict.problem().unwrap();
        assert!(
            problem.contains("(4 by NVML, 0 device nodes)") && problem.contains("when-unprivileged = false")
        );
        std::fs::write(&report, "garbage").unwrap();
        assert!(matches!(read(&report), Verdict::Unknown(ref m) if m.contains("not a canary report")));
    }

    #[test]
    fn the_annotation_is_named_when_it_gave_cards_and_both_must_say_before_a_node_is_held() {
        let cards = Seen { nvml_cards: 2, nvml_error: None, device_nodes: 2 };
        let honoured = || Verdict::EnvHonoured(cards.clone());
        let unknown = || Verdict::Unknown("not reported yet".into());
        // The annotation reaches the env canary too: both see cards, the annotation is named.
        let both = judge(honoured(), Some(honoured()));
        assert_eq!(both, Verdict::AnnotationsHonoured(cards.clone()));
        assert_eq!(
            (both.label(), both.reason()),
            (Some("annotations-honoured"), Some(Reason::RuntimeHonoursPodAnnotations))
        );
        let problem = both.problem().unwrap();
        assert!(
            problem.contains("cdi.k8s.io/nano-gpu-canary") && problem.contains("pod_annotations"),
            "{problem}"
        );
        assert_eq!(judge(unknown(), Some(honoured())), Verdict::AnnotationsHonoured(cards.clone()));
        // Only the env canary's own env gave it cards.
        let env = judge(honoured(), Some(Verdict::Held));
        assert_eq!((env.label(), env.reason()), (Some("env-honoured"), Some(Reason::RuntimeHonoursPodEnv)));
        assert_eq!(judge(honoured(), Some(unknown())), Verdict::EnvHonoured(cards));
        // Held only when both say so; a pod without the annotation canary is judged by the env's.
        assert_eq!(judge(Verdict::Held, Some(Verdict::Held)), Verdict::Held);
        assert_eq!(judge(Verdict::Held, None), Verdict::Held);
        assert!(
            matches!(judge(Verdict::Held, Some(unknown())), Verdict::Unknown(ref m) if m.starts_with("annotation canary"))
        );
        assert!(matches!(judge(unknown(), Some(Verdict::Held)), Verdict::Unknown(_)));
    }

    #[test]
    fn a_link_or_a_pipe_in_place_of_the_report_is_not_read() {
        let d = dir("tricks");
        let report = d.join("seen.json");
        std::os::unix::fs::symlink("/dev/zero", &report).unwrap();
        assert!(matches!(read(&report), Verdict::Unknown(_)));
        std::fs::remove_file(&report).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&report).status().unwrap();
        assert!(made.success());
        assert!(matches!(read(&report), Verdict::Unknown(ref m) if m.contains("not a regular file")));
    }
}
