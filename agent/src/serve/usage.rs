//! Who uses what on every card: the agent samples its cards every few seconds on a blocking thread,
//! off the device-plugin path (NVML: utilisation, memory, temperature, power, running processes and
//! their utilisation samples), maps each host PID to its pod and container through `/proc/<pid>/cgroup`
//! ([`cgroup`], [`procs`]) and the node's pods, and puts the result beside each container's grant
//! ([`attribute`]). The newest [`Report`] is served as Prometheus metrics (`/metrics`, [`metrics`]) and
//! watched for memory overruns ([`watchdog`]).

pub mod cgroup;
pub mod claims;
pub mod metrics;
pub mod procs;
pub mod watchdog;

use crate::cards::health::Health;
pub use crate::cards::inventory::{CardSample, ProcessSample};
use nano_gpu_proto::events::Reason;

use crate::cards::inventory::{Card, GpuInventory, sample_all};
use crate::kubelet::plugin::Snapshot;
use crate::node::pods::{Resident, Residents, pod_key};
use nano_gpu_proto::units::{MiB, Percent};
use procs::Procs;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use watchdog::Watchdog;

/// One container's grant on and use of one card.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerUsage {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub pod_uid: String,
    /// Container name.
    pub container: String,
    /// Card UUID.
    pub uuid: String,
    /// Card index.
    pub index: u32,
    /// Share granted (0: the container uses a card it was not given).
    pub granted: Percent,
    /// Memory granted: asked, or its percent of the card's (the one memory rule).
    pub granted_memory: MiB,
    /// Memory its processes use.
    pub memory_used: MiB,
    /// Sum of its processes' SM utilisation (percent of the card).
    pub utilization: u32,
    /// Its processes on the card (host PIDs).
    pub pids: Vec<u32>,
    /// Since when it has been over its memory grant, once the watchdog holds it so past the grace
    /// period.
    pub overrun: Option<SystemTime>,
    /// It names a claim whose grants the agent has not read (yet): its grant is not known, so its
    /// use is not judged.
    pub grant_unread: bool,
}

impl ContainerUsage {
    /// Container `container` of pod `r` on card `uuid` (index `index`), nothing granted or used yet.
    fn of(r: &Resident, container: &str, uuid: &str, index: u32) -> Self {
        ContainerUsage {
            namespace: r.namespace.clone(),
            pod: r.name.clone(),
            pod_uid: r.uid.clone(),
            container: container.to_owned(),
            uuid: uuid.to_owned(),
            index,
            ..Default::default()
        }
    }

    /// Whether it uses more memory than it was granted now (never while its grant is unread).
    pub fn over_memory(&self) -> bool {
        !self.grant_unread && self.memory_used > self.granted_memory
    }
}

/// A process on a card that belongs to no container of a pod on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unattributed {
    /// Card UUID.
    pub uuid: String,
    /// Card index.
    pub index: u32,
    /// Host PID.
    pub pid: u32,
    /// Memory it uses.
    pub memory: MiB,
}

/// One card as the metrics show it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CardUsage {
    /// What the backend reported.
    pub sample: CardSample,
    /// Model name.
    pub model: String,
    /// Whether the card is served as healthy.
    pub healthy: bool,
    /// XIDs seen on it since the agent started.
    pub xids: u64,
    /// Sum of the shares granted on it to pods of this node.
    pub granted: u32,
}

/// One sampling pass, attributed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The cards sampled.
    pub cards: Vec<CardUsage>,
    /// Per container and card: every grant of a running pod, and every container seen using a card.
    pub containers: Vec<ContainerUsage>,
    /// Processes of no pod on this node.
    pub unattributed: Vec<Unattributed>,
}

/// Puts `samples` beside the grants of the node's pods (`residents`), naming each process's
/// container through `procs`. `cards` are the cards served (model, health); `xids` counts XIDs by UUID.
pub fn attribute(
    samples: &[CardSample],
    cards: &[Card],
    residents: &BTreeMap<String, Resident>,
    claims: &claims::Held,
    procs: &mut Procs,
    xids: impl Fn(&str) -> u64,
) -> Report {
    let card_memory = |uuid: &str| cards.iter().find(|c| c.info.uuid == uuid).map(|c| c.info.memory_mib);
    // Every grant, keyed by pod UID, container and card.
    let mut rows: BTreeMap<(String, String, String), ContainerUsage> = BTreeMap::new();
    // Each card's granted percent: an assignment's grants per container, a claim's devices once
    // however many containers (or pods) name the claim.
    let mut card_granted: BTreeMap<String, u32> = BTreeMap::new();
    let mut claim_devices: BTreeSet<(&str, &str, usize)> = BTreeSet::new();
    // Containers that name a claim not read: their grant is not known.
    let mut unread: BTreeSet<(&str, &str)> = BTreeSet::new();
    for r in residents.values() {
        for (container, grants) in &r.grants {
            for g in grants {
                let memory = card_memory(&g.uuid).unwrap_or_default();
                let row = ContainerUsage {
                    granted: g.percent,
                    granted_memory: g.memory_held(memory),
                    ..ContainerUsage::of(r, container, &g.uuid, g.index)
                };
                rows.insert((r.uid.clone(), container.clone(), g.uuid.clone()), row);
                *card_granted.entry(g.uuid.clone()).or_default() += g.percent.0;
            }
        }
        for (container, uses) in &r.claims {
            for u in uses {
                let Some(devices) = claims::taken(claims, &r.namespace, u) else {
                    unread.insert((r.uid.as_str(), container.as_str()));
                    continue;
                };
                for (n, c) in devices {
                    let g = &c.grant;
                    let memory = g.memory_held(card_memory(&g.uuid).unwrap_or_default());
                    let row = rows
                        .entry((r.uid.clone(), container.clone(), g.uuid.clone()))
                        .or_insert_with(|| ContainerUsage::of(r, container, &g.uuid, g.index));
                    row.granted = Percent(row.granted.0 + g.percent.0);
                    row.granted_memory = MiB(row.granted_memory.0 + memory.0);
                    if claim_devices.insert((r.namespace.as_str(), u.claim.as_str(), n)) {
                        *card_granted.entry(g.uuid.clone()).or_default() += g.percent.0;
                    }
                }
            }
        }
    }
    let mut unattributed = Vec::new();
    for s in samples {
        for p in &s.processes {
            let memory = p.memory.unwrap_or_default();
            let owner = procs.container_of(p.pid).and_then(|c| {
                let r = residents.get(&c.pod_uid)?;
                let name = r.containers.get(&c.container_id)?;
                Some((r, name.clone()))
            });
            let Some((r, container)) = owner else {
                unattributed.push(Unattributed { uuid: s.uuid.clone(), index: s.index, pid: p.pid, memory });
                continue;
            };
            let row = rows
                .entry((r.uid.clone(), container.clone(), s.uuid.clone()))
                .or_insert_with(|| ContainerUsage::of(r, &container, &s.uuid, s.index));
            row.memory_used = MiB(row.memory_used.0 + memory.0);
            row.utilization += p.sm.unwrap_or(0);
            row.pids.push(p.pid);
        }
    }
    procs.end_pass();
    for row in rows.values_mut() {
        row.grant_unread = unread.contains(&(row.pod_uid.as_str(), row.container.as_str()));
    }
    let cards = samples
        .iter()
        .map(|s| {
            let served = cards.iter().find(|c| c.info.uuid == s.uuid);
            CardUsage {
                sample: s.clone(),
                model: served.map(|c| c.info.model.clone()).unwrap_or_default(),
                healthy: served.is_some_and(|c| c.info.healthy),
                xids: xids(&s.uuid),
                granted: card_granted.get(&s.uuid).copied().unwrap_or(0),
            }
        })
        .collect();
    Report { cards, containers: rows.into_values().collect(), unattributed }
}

/// What the sampling loop runs with.
pub struct Sampling {
    /// Time between passes.
    pub every: Duration,
    /// The host's `/proc` (the agent runs with `hostPID`).
    pub proc_root: PathBuf,
    /// How long a container may stay over its memory grant before it is reported.
    pub grace: Duration,
    /// The node's pods (an empty view without a node name: every process is then unattributed).
    pub residents: watch::Receiver<Residents>,
    /// Where overruns are reported (the Event worker), when there is one.
    pub reports: Option<mpsc::Sender<crate::kubelet::plugin::Report>>,
    /// Where the claims of pods placed through DRA are read, when the node serves DRA.
    pub claims: Option<ClaimSource>,
}

/// The API server, for the claims the node's pods name, and the node (the pool of its devices).
pub struct ClaimSource {
    /// A client whose rights include reading ResourceClaims (the DRA component gives the agent's).
    pub client: kube::Client,
    /// This node.
    pub node: String,
    /// Where each pass leaves what the claims hold, for the MPS daemons' watcher.
    pub held: claims::SharedHeld,
}

impl ClaimSource {
    /// Reads every claim `grants` has to read now, each within a few seconds.
    async fn refresh(
        &self,
        grants: &mut claims::ClaimGrants,
        pods: &BTreeMap<String, Resident>,
        cards: &[Card],
    ) {
        use crate::kubelet::dra::Claims;
        let reader = crate::kubelet::dra::ApiClaims(self.client.clone());
        for (namespace, name) in grants.to_read(pods, std::time::Instant::now()) {
            let read = tokio::time::timeout(Duration::from_secs(5), reader.get(&namespace, &name))
                .await
                .unwrap_or_else(|_| Err(format!("reading claim {namespace}/{name}: no answer in 5 s")));
            let key = (namespace, name);
            if let Err(error) = grants.learn(key.clone(), read, cards, std::time::Instant::now()) {
                tracing::debug!(claim = %format!("{}/{}", key.0, key.1), %error, "claim's grants not known yet");
            }
        }
    }
}

/// The newest report and when it was taken (seconds since the epoch), shared with `/metrics`.
pub type Latest = Arc<RwLock<Option<(Report, f64)>>>;

/// Samples every `sampling.every` until the task is dropped: on a blocking thread, each pass reads
/// every backend and attributes the processes; the watchdog looks at the result, which then replaces
/// `latest`.
pub async fn run(
    sampling: Sampling,
    backends: Arc<Vec<Box<dyn GpuInventory>>>,
    cards: watch::Receiver<Snapshot>,
    health: Arc<Health>,
    latest: Latest,
) {
    let Sampling { every, proc_root, grace, residents, reports, claims: source } = sampling;
    let mut grants = source.as_ref().map(|s| claims::ClaimGrants::new(s.node.clone()));
    let mut procs = Procs::new(proc_root.clone());
    let mut dog = Watchdog::new(grace);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pods = residents.borrow().clone();
        let now_cards = cards.borrow().clone();
        if let (Some(source), Some(grants)) = (&source, grants.as_mut()) {
            source.refresh(grants, &pods, &now_cards).await;
        }
        let held = grants.as_ref().map(|g| g.held().clone()).unwrap_or_default();
        if let Some(source) = &source {
            *source.held.write().unwrap_or_else(|e| e.into_inner()) = held.clone();
        }
        let (backends, cards, residents, health) =
            (backends.clone(), now_cards, pods.clone(), health.clone());
        // The cache goes to the blocking thread and comes back with the report (a fresh one if the
        // pass panicked).
        let mut p = std::mem::replace(&mut procs, Procs::new(proc_root.clone()));
        let pass = tokio::task::spawn_blocking(move || {
            let (samples, errors) = sample_all(&backends);
            for (backend, e) in errors {
                tracing::debug!(backend, error = %e, "backend not sampled");
            }
            let report = attribute(&samples, &cards, &residents, &held, &mut p, |uuid| health.xids(uuid));
            (report, p)
        })
        .await;
        let Ok((mut report, p)) = pass else {
            tracing::error!("a sampling pass failed; sampling again with an empty cache");
            continue;
        };
        procs = p;
        let now = SystemTime::now();
        let marked = |row: &ContainerUsage| watchdog::marked_since(pods.get(&row.pod_uid)?, row, now);
        for r in dog.observe(&mut report.containers, now, marked) {
            let message = format!(
                "container {} uses {} of card {} (index {}), above its grant of {} for more than {} s",
                r.container,
                r.memory_used,
                r.uuid,
                r.index,
                r.granted_memory,
                grace.as_secs()
            );
            if let Some(tx) = &reports {
                let _ = tx.try_send(crate::kubelet::plugin::Report::Warning {
                    pod: pod_key(&r.namespace, &r.pod),
                    reason: Reason::GpuMemoryOverrun,
                    action: "Sample",
                    message,
                });
            }
        }
        // The pods' marks follow the overruns (the pod watch shows what was written; a mark lost to a
        // full queue or a failed patch is tried again next pass).
        if let Some(tx) = &reports {
            for change in watchdog::marks(&report.containers, &pods) {
                let _ = tx.try_send(crate::kubelet::plugin::Report::Mark(change));
            }
        }
        let at = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        *latest.write().unwrap_or_else(|e| e.into_inner()) = Some((report, at));
    }
}

/// `/metrics`: the newest report of node `node` (empty until the first pass).
pub fn router(latest: Latest, node: String) -> axum::Router {
    let serve = move || {
        let (latest, node) = (latest.clone(), node.clone());
        async move {
            let body = match &*latest.read().unwrap_or_else(|e| e.into_inner()) {
                Some((report, at)) => metrics::render(report, &node, *at),
                None => String::new(),
            };
            ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
        }
    };
    axum::Router::new().route("/metrics", axum::routing::get(serve))
}

#[cfg(test)]
mod tests;
