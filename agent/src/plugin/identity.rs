//! Which container a call is for (ARCHITECTURE §4), as the handlers ask it: the candidates from the
//! pod watch and pod-resources (`crate::pods` decides), the steering of GetPreferredAllocation, the
//! claim of an Allocate, and the [`Report`]s for the background repair worker.

use super::Snapshot;
use super::devices::prefer;
use super::edits::Claimed;
use crate::podresources::Lister;
use crate::pods::{Pending, Pods, Served, identify, pending, steer};
use crate::resource::Resource;
use nano_gpu_proto::annotations::CardGrant;
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tonic::Status;

/// Steering decisions kept until their Allocate comes.
const STEERED_KEPT: usize = 256;

/// Something the background worker acts on (it may call the API server; handlers never do).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// An Allocate was refused: no pod placed here by nano-gpu could own the IDs.
    Refused {
        /// The pod (`namespace/name`) it was most likely for, if any.
        pod: Option<String>,
        /// Why.
        message: String,
    },
    /// A container is starting with these IDs: check its assignment says the same cards.
    Starting {
        /// The device IDs of the container.
        ids: Vec<String>,
        /// The cards at that time.
        cards: Snapshot,
        /// The resource of the IDs.
        resource: Resource,
    },
    /// A container has used more card memory than granted for longer than the grace period.
    Overrun {
        /// The pod (`namespace/name`).
        pod: String,
        /// What it uses and was granted.
        message: String,
    },
    /// A pod's `nano-gpu/overrun` mark must say this (or go).
    Mark(crate::pods::MarkChange),
}

/// What tells containers apart: the pods on this node and the kubelet's pod-resources.
pub struct Identity {
    pods: watch::Receiver<Pods>,
    lister: Arc<dyn Lister>,
    pub(super) reports: mpsc::Sender<Report>,
    node: String,
    resource: Resource,
    /// How long to wait for the pod watch to show a pod the kubelet already admits.
    wait: Duration,
    memo: std::sync::Mutex<Memo>,
}

/// Decisions between calls: which container a preferred set of IDs was for, and the containers this
/// agent has allocated (init containers do not show in pod-resources).
#[derive(Default)]
struct Memo {
    steered: VecDeque<(Vec<String>, (String, String))>,
    done: HashSet<(String, String)>,
}

fn sorted(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

impl Identity {
    /// Identity for `resource` from the pods of node `node` that ask it, the kubelet's
    /// pod-resources, reporting to `reports`.
    pub fn new(
        node: String,
        resource: Resource,
        pods: watch::Receiver<Pods>,
        lister: Arc<dyn Lister>,
        reports: mpsc::Sender<Report>,
        wait: Duration,
    ) -> Self {
        Identity { pods, lister, reports, node, resource, wait, memo: Default::default() }
    }

    /// The containers that may be asking `size` now, likeliest first; waits up to `wait` for the pod
    /// watch when none is known yet (the kubelet can see a pod before our watch does).
    async fn candidates(&self, size: u64) -> Vec<Pending> {
        let deadline = tokio::time::Instant::now() + self.wait;
        let mut pods = self.pods.clone();
        loop {
            let served = match self.lister.list().await {
                Ok(list) => Served::from_list(&list, self.resource.name()),
                Err(e) => {
                    tracing::warn!(error = %e.message(), "pod-resources List failed; identifying by the pod watch alone");
                    Served::default()
                }
            };
            let snapshot = pods.borrow_and_update().clone();
            let found = {
                let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
                let uids: HashSet<&str> = snapshot.values().map(|p| p.uid.as_str()).collect();
                memo.done.retain(|(uid, _)| uids.contains(uid.as_str()));
                pending(&snapshot, &served, &memo.done, size)
            };
            if !found.is_empty() {
                return found;
            }
            match tokio::time::timeout_at(deadline, pods.changed()).await {
                Ok(Ok(())) => continue,
                _ => return found,
            }
        }
    }

    /// [`Identity::candidates`] without the agent's own record (pod-resources alone), no waiting.
    async fn candidates_unrecorded(&self, size: u64) -> Vec<Pending> {
        let served = match self.lister.list().await {
            Ok(list) => Served::from_list(&list, self.resource.name()),
            Err(_) => return Vec::new(),
        };
        let snapshot = self.pods.borrow().clone();
        pending(&snapshot, &served, &HashSet::new(), size)
    }

    /// GetPreferredAllocation for one container: IDs on the cards of the container most likely
    /// asking, else the card-packing choice.
    pub(super) async fn prefer(&self, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let candidates = self.candidates(size as u64).await;
        let first = candidates.first();
        let quota = |g: &CardGrant| self.resource.quota(g, size);
        let steered = first.and_then(|p| steer(p.grants.as_ref().ok()?, available, must, size, quota));
        let ids = steered.unwrap_or_else(|| prefer(available, must, size));
        if let Some(p) = first {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            if memo.steered.len() >= STEERED_KEPT {
                memo.steered.pop_front();
            }
            memo.steered.push_back((sorted(&ids), (p.uid.clone(), p.container.clone())));
        }
        ids
    }

    /// The grants of the container an Allocate of `ids` (on `cards`) is for; an error the kubelet
    /// reports (and an Event) when no pod placed here by nano-gpu can own them.
    pub(super) async fn claim(&self, ids: &[String], cards: &BTreeSet<&str>) -> Result<Claimed, Status> {
        let mut candidates = self.candidates(ids.len() as u64).await;
        if candidates.is_empty() {
            // An earlier guess may have taken this container's place in the record of what the
            // agent allocated: ask again, trusting pod-resources alone.
            candidates = self.candidates_unrecorded(ids.len() as u64).await;
        }
        let key = sorted(ids);
        let steered = {
            let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
            let at = memo.steered.iter().position(|(k, _)| *k == key);
            at.and_then(|i| memo.steered.remove(i)).map(|(_, who)| who)
        };
        let refuse = |pod: Option<String>, message: String| {
            let _ = self.reports.try_send(Report::Refused { pod, message: message.clone() });
            Status::failed_precondition(message)
        };
        match identify(&candidates, steered.as_ref(), cards) {
            Some(p) => match &p.grants {
                Ok(grants) => {
                    let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
                    memo.done.insert((p.uid.clone(), p.container.clone()));
                    Ok(Claimed { grants: grants.clone(), pod_units: p.pod_units })
                }
                Err(reason) => Err(refuse(
                    Some(p.pod.clone()),
                    format!("nano-gpu cannot serve pod {} container {:?}: {reason}", p.pod, p.container),
                )),
            },
            None => Err(refuse(
                None,
                format!(
                    "no pod placed on node {} by nano-gpu is waiting for {} of {}; \
                     pods asking it must be scheduled by nano-gpu-scheduler",
                    self.node,
                    ids.len(),
                    self.resource.name()
                ),
            )),
        }
    }
}
