//! Preemption nano-gpu carries out itself, for pods that kube-scheduler's own preemption cannot help:
//!
//! - a pod waiting on claims: kube-scheduler does not see it while nano-gpu places its claims (the
//!   webhook's scheduling gate holds it), so its preemption never runs for it;
//! - a pod asking a GPU share that the filter refused on every node for want of room on a card
//!   (the free percent spread over cards, card memory): kube-scheduler tries victims with its own
//!   filter plugins only, which those nodes passed, so it finds none there.
//!
//! When no node takes such a pod, this does what kube-scheduler's default preemption does, over the
//! nodes the pod may go to (for a share: those the filter refused for want of room):
//!
//! - on each node, the pods of lower priority are the candidates; ending all of them (and the pods
//!   being deleted there already) must make room for the pod, judged by the engine's own fit on the
//!   node with what they hold given back (a claim is given back once every pod it is reserved for
//!   ends: the ResourceClaim controller deallocates it then);
//! - then as many candidates as can be are spared, the highest priority first, and among equals
//!   those holding the least of the cards first (so that the victims are few);
//! - the node chosen is the one whose victims' highest priority is lowest, then the smallest sum of
//!   priorities, then the fewest victims, then the name, among the first nodes found where
//!   preemption works: 10 % of the candidates or 100, whichever is more, as kube-scheduler's default
//!   preemption does (from an offset that differs from pod to pod).
//!
//! The victims are evicted through the Eviction API by the leader ([`crate::service::preempt_evict`]), so
//! PodDisruptionBudgets hold (where kube-scheduler only prefers nodes that violate fewer); a refused
//! eviction gives the node up for [`RETRY`]. Until the victims are gone (and their claims
//! deallocated), the pod is nominated to the node: no pod of its priority or lower is placed there.
//! A pod whose `preemptionPolicy` is `Never` preempts no one.

use crate::state::ClusterState;
use crate::state::decode::{self, PodRecord};
use crate::state::preempt_verb::{free_record, give_back, held_percent};
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_engine::model::{Node, NodeId};
use nano_gpu_engine::request::{Request, Tightest, fit};
use nano_gpu_proto::extender::ExtenderFilterResult;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// How long a pod whose victims' eviction was refused waits before preempting again.
pub const RETRY: Duration = Duration::from_secs(30);

/// How long a nomination holds its node at most, whether or not the pods it waits for ended (a pod
/// of a lost node may stay "being deleted" for long) and whether or not kube-scheduler still tries
/// the pod: then the pod searches again ([`ClusterState::expire_nominations`]).
pub const NOMINATION_LIMIT: Duration = Duration::from_secs(120);

/// A preemption search stops once it found this share of the candidate nodes (in percent) where
/// preemption works, or [`MIN_CANDIDATES`] if that is more: kube-scheduler's default preemption's
/// `minCandidateNodesPercentage` and `minCandidateNodesAbsolute`, at their defaults.
const MIN_CANDIDATES_PERCENT: usize = 10;
/// See [`MIN_CANDIDATES_PERCENT`].
const MIN_CANDIDATES: usize = 100;

/// How many nodes where preemption works a search of `candidates` nodes looks for.
fn enough_candidates(candidates: usize) -> usize {
    (candidates * MIN_CANDIDATES_PERCENT / 100).max(MIN_CANDIDATES).min(candidates)
}

/// Where pod `uid`'s search of `candidates` nodes starts: the same for the same pod, spread over
/// pods (kube-scheduler draws it at random), so that preemptors do not all search the same nodes.
pub(super) fn offset(uid: &str, candidates: usize) -> usize {
    let hash =
        uid.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    usize::try_from(hash % candidates.max(1) as u64).unwrap_or(0)
}

/// What the waiting pod needs room for: it words the Events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// ResourceClaims of nano-gpu's DeviceClass.
    Claims,
    /// A GPU share (`nano-gpu/gpu-percent`) that kube-scheduler sent to the extender.
    Share,
}

/// Pods to evict so that a waiting pod fits on a node ([`ClusterState::take_preemptions`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preemption {
    /// The waiting pod (namespace, name).
    pub pod: (String, String),
    /// Its uid.
    pub pod_uid: String,
    /// Its priority.
    pub priority: i32,
    /// What it needs room for.
    pub needs: Needs,
    /// The node it is nominated to.
    pub node: String,
    /// The pods to evict, highest priority first.
    pub victims: Vec<Victim>,
}

/// A pod to evict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Victim {
    /// Its uid.
    pub uid: String,
    /// (namespace, name).
    pub pod: (String, String),
    /// Its priority.
    pub priority: i32,
}

/// The waiting pod that may preempt: its name, its priority, and whether it may preempt at all (its
/// `preemptionPolicy` is not `Never`).
pub(super) struct Preemptor {
    pub key: (String, String),
    pub priority: i32,
    pub may_preempt: bool,
}

impl Preemptor {
    /// As `pod`'s spec says.
    pub fn of(pod: &Pod) -> Self {
        let key = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        let may_preempt = pod.spec.as_ref().and_then(|s| s.preemption_policy.as_deref()) != Some("Never");
        Preemptor { key, priority: decode::priority(pod), may_preempt }
    }
}

/// A waiting pod nominated to a node where pods were preempted for it: the pods it waits for to end
/// (victims and those being deleted anyway) and the claims their end frees.
#[derive(Clone, Debug)]
pub(in crate::state) struct Nomination {
    node: String,
    priority: i32,
    key: (String, String),
    ending: Vec<String>,
    claims: Vec<String>,
    since: Instant,
}

/// What ending some pods on a node frees: the pods (victims and pods being deleted anyway), and the
/// claims given back with them.
struct Freed {
    ending: BTreeSet<String>,
    claims: Vec<String>,
}

impl ClusterState {
    /// Preemption for waiting pod `pod_uid` (`who`), which asks `req` (for `needs`) and which no node
    /// of `candidates` takes now: what it does, to be added to the pod's warning (`None`: nothing).
    pub(super) fn preempt_for(
        &mut self,
        pod_uid: &str,
        who: &Preemptor,
        req: &Request,
        candidates: &[NodeId],
        needs: Needs,
    ) -> Option<String> {
        if let Some(n) = self.nominations.get(pod_uid) {
            if self.nomination_waiting(pod_uid) {
                return Some(format!(
                    "; pods of lower priority on {} were preempted for it: waiting for them to end",
                    n.node
                ));
            }
            self.nominations.remove(pod_uid);
        }
        if !who.may_preempt
            || !self.could_preempt(who.priority)
            || self.preempt_after.get(pod_uid).is_some_and(|t| Instant::now() < *t)
        {
            return None;
        }
        // The search weighs every pod of every node the pod may go to: done again only once the
        // view changed since it last found nothing for this pod.
        let view = (self.generation, self.victims_changed);
        if self.preempt_searched.get(pod_uid) == Some(&view) {
            return None;
        }
        self.preempt_searched.insert(pod_uid.to_owned(), view);
        let cluster = self.extender.engine().cluster();
        let mut best: Option<((i32, i64, usize, String), Freed)> = None;
        // As kube-scheduler's default preemption: from an offset that differs from pod to pod, until
        // enough nodes where preemption works were found (the best of those is taken, not the
        // cluster's): a search weighs every pod of each node it tries, under the view's lock.
        let (enough, start) = (enough_candidates(candidates.len()), offset(pod_uid, candidates.len()));
        let mut found = 0;
        for id in candidates.iter().cycle().skip(start).take(candidates.len()) {
            if found == enough {
                break;
            }
            let name = cluster.node(*id).name.clone();
            let Some(freed) = self.freed_on(&name, req, Some(who.priority), needs) else { continue };
            found += 1;
            let victims: Vec<&PodRecord> = self.victims(&freed).map(|(_, p)| p).collect();
            let rank = (
                victims.iter().map(|p| p.priority).max().unwrap_or(i32::MIN),
                victims.iter().map(|p| i64::from(p.priority)).sum(),
                victims.len(),
                name,
            );
            if best.as_ref().is_none_or(|(b, _)| rank < *b) {
                best = Some((rank, freed));
            }
        }
        let ((_, _, _, node), freed) = best?;
        let mut victims: Vec<Victim> = self
            .victims(&freed)
            .map(|(uid, p)| Victim { uid: uid.clone(), pod: p.key.clone(), priority: p.priority })
            .collect();
        victims.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.pod.cmp(&b.pod)));
        let names: Vec<String> = victims.iter().map(|v| format!("{}/{}", v.pod.0, v.pod.1)).collect();
        self.nominations.insert(
            pod_uid.to_owned(),
            Nomination {
                node: node.clone(),
                priority: who.priority,
                key: who.key.clone(),
                ending: freed.ending.into_iter().collect(),
                claims: freed.claims,
                since: Instant::now(),
            },
        );
        if victims.is_empty() {
            return Some(format!("; waiting for pods being deleted on {node} to end"));
        }
        self.preemptions.push(Preemption {
            pod: who.key.clone(),
            pod_uid: pod_uid.to_owned(),
            priority: who.priority,
            needs,
            node: node.clone(),
            victims,
        });
        Some(format!("; preempting pods of lower priority on {node} to make room: {}", names.join(", ")))
    }

    /// After a filter that passed no node for `pod`, which asks a GPU share: preemption among the
    /// nodes refused for want of room (`FailedNodes`; a node refused for its model, its size or its
    /// agent is no candidate, whoever ends there). The node it goes to says so in its reason, which
    /// kube-scheduler shows in the pod's `FailedScheduling` Event.
    pub(super) fn preempt_for_share<N: AsRef<str> + Ord>(
        &mut self,
        pod: &Pod,
        result: &mut ExtenderFilterResult<N>,
    ) {
        let Some(uid) = decode::pod_uid(pod) else { return };
        let who = Preemptor::of(pod);
        // (Not even the candidates are looked up where no pod could end for it.)
        if !self.nominated(uid) && !self.could_preempt(who.priority) {
            return;
        }
        let Ok((_, req)) = self.extender.request(pod) else { return };
        // Not on a node held for another pod: its victims are going already, for that pod.
        let held = self.held_nodes(uid, who.priority);
        let cluster = self.extender.engine().cluster();
        let candidates: Vec<NodeId> = result
            .failed_nodes
            .keys()
            .filter(|n| !held.contains_key(n.as_ref()))
            .filter_map(|n| cluster.id(n.as_ref()))
            .collect();
        let Some(said) = self.preempt_for(uid, &who, &req, &candidates, Needs::Share) else { return };
        let Some(node) = self.nominations.get(uid).map(|n| n.node.clone()) else { return };
        if let Some((_, reason)) = result.failed_nodes.iter_mut().find(|(n, _)| n.as_ref() == node) {
            *reason = said.trim_start_matches("; ").to_owned();
        }
    }

    /// Whether any pod could end for a pod of `priority`: one of lower priority, or one being
    /// deleted already. Where none is, no node is searched.
    pub(super) fn could_preempt(&self, priority: i32) -> bool {
        self.pods_ending > 0 || self.pods_by_priority.range(..priority).next().is_some()
    }

    /// Whether pod `uid` is nominated to a node (until it is placed or gone, or searches again).
    pub(super) fn nominated(&self, uid: &str) -> bool {
        self.nominations.contains_key(uid)
    }

    /// Whether pod `uid` still waits for pods preempted for it (or claims they free) to end, within
    /// [`NOMINATION_LIMIT`]: kube-scheduler's own preemption then proposes nothing more for it (see
    /// [`ClusterState::preempt`]).
    pub(super) fn nomination_waiting(&self, uid: &str) -> bool {
        self.nominations.get(uid).is_some_and(|n| {
            n.since.elapsed() < NOMINATION_LIMIT
                && (n.ending.iter().any(|uid| self.pods.contains_key(uid))
                    || n.claims.iter().any(|uid| self.claim_held(uid).is_some()))
        })
    }

    /// The nodes held for pods other than `uid` of priority `priority` or more, each with the
    /// nomination of the highest priority there.
    fn held_nodes(&self, uid: &str, priority: i32) -> HashMap<&str, &Nomination> {
        let mut held: HashMap<&str, &Nomination> = HashMap::new();
        for (_, n) in self.nominations.iter().filter(|(u, n)| *u != uid && n.priority >= priority) {
            let slot = held.entry(n.node.as_str()).or_insert(n);
            if n.priority > slot.priority {
                *slot = n;
            }
        }
        held
    }

    /// Candidate `names` for pod `uid` (of `priority`), less those held for another pod that preempted
    /// pods there ([`Self::nominated_elsewhere`]), which come back with the reason.
    pub(super) fn split_held<N: AsRef<str>>(
        &self,
        uid: Option<&str>,
        priority: i32,
        names: Vec<N>,
    ) -> (Vec<N>, Vec<(N, String)>) {
        if self.nominations.is_empty() {
            return (names, Vec::new());
        }
        let nodes = self.held_nodes(uid.unwrap_or_default(), priority);
        let mut open = Vec::with_capacity(names.len());
        let mut held = Vec::new();
        for name in names {
            match nodes.get(name.as_ref()) {
                Some(n) => held.push((name, held_for(n))),
                None => open.push(name),
            }
        }
        (open, held)
    }

    /// The pods of `freed` that are not being deleted already, with their records.
    fn victims<'a>(&'a self, freed: &'a Freed) -> impl Iterator<Item = (&'a String, &'a PodRecord)> {
        freed
            .ending
            .iter()
            .filter_map(|uid| self.pods.get(uid).map(|p| (uid, p)))
            .filter(|(_, p)| !p.terminating)
    }

    /// The fewest pods on `node` (of priority below `below`, any when `None`) whose end, with the
    /// pods being deleted there, makes room for `req`: the pods of the highest priority are spared
    /// first. `None`: ending them all would not make room, or the node's claims cannot be trusted.
    ///
    /// For a share (`needs`), only pods holding cards are candidates: kube-scheduler sent the node
    /// after its own filters passed it with every pod there, so room on a card is all that lacks (and
    /// a node's pods are mostly CPU-only ones, each a fit to try). A pod waiting on claims was judged
    /// by no one else: its host CPU and memory count too.
    fn freed_on(&self, node: &str, req: &Request, below: Option<i32>, needs: Needs) -> Option<Freed> {
        let cluster = self.extender.engine().cluster();
        let base = cluster.node(cluster.id(node)?);
        if self.claims_held_on(node).iter().any(|(_, held)| held.is_none()) {
            return None;
        }
        let here: Vec<(&String, &PodRecord)> = self
            .by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|uid| self.pods.get(uid).map(|p| (uid, p)))
            .collect();
        let candidates: Vec<(&String, &PodRecord)> = here
            .iter()
            .copied()
            // (A reserved pod is not bound yet, or not seen bound: evicting it would delete it.)
            .filter(|(_, p)| !p.terminating && !p.reserved && below.is_none_or(|b| p.priority < b))
            .filter(|(_, p)| needs == Needs::Claims || held_percent(p) > 0)
            .collect();
        let mut ending: BTreeSet<String> = here
            .iter()
            .filter(|(_, p)| p.terminating)
            .chain(&candidates)
            .map(|(uid, _)| (*uid).clone())
            .collect();
        if ending.is_empty() || !self.fits_without(base, node, &ending, req) {
            return None;
        }
        // Spared first: the highest priority, then (to keep the victims few) those holding least.
        let mut candidates: Vec<(i32, u32, &String)> =
            candidates.into_iter().map(|(uid, p)| (p.priority, self.percent_held(node, uid), uid)).collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then_with(|| a.2.cmp(b.2)));
        for (_, _, uid) in candidates {
            ending.remove(uid);
            if !self.fits_without(base, node, &ending, req) {
                ending.insert(uid.clone());
            }
        }
        if ending.is_empty() {
            return None; // it fits with no pod ending: not this search's to hold
        }
        let claims = self.claims_freed(node, &ending);
        Some(Freed { ending, claims })
    }

    /// Whether `req` fits on `base` (node `name`) once the pods `ending` and the claims their end
    /// frees give back what they hold.
    fn fits_without(&self, base: &Node, name: &str, ending: &BTreeSet<String>, req: &Request) -> bool {
        let mut n = base.clone();
        for p in ending.iter().filter_map(|uid| self.pods.get(uid)) {
            free_record(&mut n, p);
        }
        for uid in self.claims_freed(name, ending) {
            for d in self.claim_held(&uid).into_iter().flat_map(|h| &h.devices) {
                let card = d.card.as_ref().ok().and_then(|i| n.cards.iter_mut().find(|c| c.index == *i));
                if let Some(c) = card {
                    give_back(c, d.percent, d.memory_on(c.mem_total));
                }
            }
        }
        fit(&n, req, &mut Tightest).is_ok()
    }

    /// Percent of cards pod `uid` holds on `node`: its shares' and those of the claims reserved for it
    /// there.
    fn percent_held(&self, node: &str, uid: &str) -> u32 {
        let mine = self.claims_on.get(node).into_iter().flatten().filter(|c| {
            self.claims.get(*c).and_then(|c| c.users.as_ref()).is_some_and(|u| u.iter().any(|p| p == uid))
        });
        let claims: u32 =
            mine.filter_map(|c| self.claim_held(c)).flat_map(|h| &h.devices).map(|d| d.percent.0).sum();
        claims + self.pods.get(uid).map_or(0, held_percent)
    }

    /// The claims on `node` that every pod they are reserved for is among `ending` (a claim reserved
    /// for no pod, or for something else than pods, is not freed by ending pods).
    fn claims_freed(&self, node: &str, ending: &BTreeSet<String>) -> Vec<String> {
        let mut out: Vec<String> = self
            .claims_on
            .get(node)
            .into_iter()
            .flatten()
            .filter(|uid| {
                let users = self.claims.get(*uid).and_then(|c| c.users.as_ref());
                users.is_some_and(|u| !u.is_empty() && u.iter().all(|p| ending.contains(p)))
            })
            .cloned()
            .collect();
        out.sort();
        out
    }

    /// The pods (`namespace/name`, sorted) on `node` whose end would make room for `req`, of any
    /// priority, for `why`.
    pub(super) fn freed_by(&self, node: &str, req: &Request) -> Vec<String> {
        let Some(freed) = self.freed_on(node, req, None, Needs::Claims) else { return Vec::new() };
        let mut names: Vec<String> =
            self.victims(&freed).map(|(_, p)| format!("{}/{}", p.key.0, p.key.1)).collect();
        names.sort();
        names
    }

    /// Whether node `node` is held for a pod other than `pod_uid` (of priority `priority` or more)
    /// that preempted pods there: that pod, as a reason not to place there.
    pub(super) fn nominated_elsewhere(&self, node: &str, pod_uid: &str, priority: i32) -> Option<String> {
        self.nominations
            .iter()
            .find(|(uid, n)| *uid != pod_uid && n.node == node && n.priority >= priority)
            .map(|(_, n)| held_for(n))
    }

    /// Ends the nominations older than [`NOMINATION_LIMIT`] at `now`: their nodes are held no longer,
    /// and their pods search again the next time no node takes them. (A pod that kube-scheduler no
    /// longer sends to the extender, say one its own filters now refuse everywhere, would otherwise
    /// hold its node for as long as it waits.)
    pub(super) fn expire_nominations(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .nominations
            .iter()
            .filter(|(_, n)| now.saturating_duration_since(n.since) >= NOMINATION_LIMIT)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in expired {
            if let Some(n) = self.nominations.remove(&uid) {
                tracing::info!(pod = %format!("{}/{}", n.key.0, n.key.1), node = %n.node,
                    "a nomination reached its limit: its node is held no longer");
            }
            self.preempt_searched.remove(&uid);
        }
    }

    /// The waiting pod `pod_uid` was placed or is gone: it is nominated nowhere.
    pub(super) fn end_nomination(&mut self, pod_uid: &str) {
        self.nominations.remove(pod_uid);
        self.preempt_after.remove(pod_uid);
        self.preempt_searched.remove(pod_uid);
    }

    /// The evictions a plan decided, to be carried out by the leader.
    pub fn take_preemptions(&mut self) -> Vec<Preemption> {
        std::mem::take(&mut self.preemptions)
    }

    /// The evictions for waiting pod `pod_uid` were not made (this replica stopped leading before it
    /// made them): it is nominated nowhere, and searches again the next time no node takes it. (A
    /// nomination kept would wait for victims no one evicts.)
    pub fn preemption_dropped(&mut self, pod_uid: &str, node: &str) {
        if self.nominations.get(pod_uid).is_some_and(|n| n.node == node) {
            self.nominations.remove(pod_uid);
            self.preempt_searched.remove(pod_uid);
        }
    }

    /// Evicting a victim for waiting pod `pod_uid` was refused or failed: its nomination ends, and it
    /// preempts again after [`RETRY`] (at `now`).
    pub fn preemption_failed(&mut self, pod_uid: &str, now: Instant) {
        self.nominations.remove(pod_uid);
        self.preempt_searched.remove(pod_uid);
        self.preempt_after.insert(pod_uid.to_owned(), now + RETRY);
    }
}

/// The reason a node held for nomination `n` gives other pods.
fn held_for(n: &Nomination) -> String {
    format!(
        "held for pod {}/{} (priority {}), which preempted pods there and waits for them to end",
        n.key.0, n.key.1, n.priority
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_looks_for_a_tenth_of_the_candidates_or_a_hundred() {
        assert_eq!(enough_candidates(0), 0);
        assert_eq!(enough_candidates(40), 40);
        assert_eq!(enough_candidates(150), 100);
        assert_eq!(enough_candidates(5000), 500);
        // Each pod starts somewhere of its own, the same every time.
        let starts: BTreeSet<usize> = (0..50).map(|i| offset(&format!("pod-{i}"), 5000)).collect();
        assert!(starts.len() > 40 && starts.iter().all(|s| *s < 5000), "{starts:?}");
        assert_eq!(offset("pod-1", 5000), offset("pod-1", 5000));
        assert_eq!(offset("pod-1", 0), 0);
    }
}
