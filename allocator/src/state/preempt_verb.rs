//! `POST /preempt` on the view (kube-scheduler's own preemption): which of the nodes and victims kube-scheduler proposes would really
//! free a card the pod fits on, with the fewest victims.

use super::ClusterState;
use super::decode::{Holding, PodRecord};
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_engine::model::{Card, Node};
use nano_gpu_engine::request::{Tightest, fit};
use nano_gpu_proto::extender::MetaVictims;
use nano_gpu_proto::units::{MiB, Percent};
use std::collections::BTreeMap;

impl ClusterState {
    /// `POST /preempt`: for each node kube-scheduler proposes, keeps it only if evicting its victims
    /// really frees a card (or cards) the pod fits on, and drops the victims that are not needed for
    /// that. Victims this view does not know are kept (they hold no card, but may hold CPU or memory
    /// kube-scheduler counted). A node held for another pod that preempted there is dropped. A pod
    /// for which nano-gpu preempted pods itself ([`ClusterState::preempt_for_share`]) gets nothing
    /// more while it waits for them to end: one node's victims make room for it.
    pub fn preempt(
        &self,
        pod: &Pod,
        proposed: &BTreeMap<String, MetaVictims>,
    ) -> Result<BTreeMap<String, MetaVictims>, String> {
        let uid = super::decode::pod_uid(pod).unwrap_or_default();
        if self.nomination_waiting(uid) {
            self.extender.request(pod)?;
            return Ok(BTreeMap::new());
        }
        // Not on a node held for another pod of its priority or more: that pod would take it.
        let priority = super::decode::priority(pod);
        let open: BTreeMap<String, MetaVictims> = proposed
            .iter()
            .filter(|(node, _)| self.nominated_elsewhere(node, uid, priority).is_none())
            .map(|(node, v)| (node.clone(), v.clone()))
            .collect();
        self.victims_needed(pod, &open)
    }

    /// For each proposed node, the victims really needed to free a card the pod fits on, as
    /// [`Self::preempt`] answers them, whatever nano-gpu's own preemption did for the pod: for `why`.
    pub(super) fn victims_needed(
        &self,
        pod: &Pod,
        proposed: &BTreeMap<String, MetaVictims>,
    ) -> Result<BTreeMap<String, MetaVictims>, String> {
        let (_, req) = self.extender.request(pod)?;
        let cluster = self.extender.engine().cluster();
        let mut out = BTreeMap::new();
        for (node, victims) in proposed {
            let Some(id) = cluster.id(node) else { continue };
            let base = cluster.node(id);
            let fits_without = |evicted: &[&str]| {
                let mut n = base.clone();
                for uid in evicted {
                    if let Some(p) = self.pods.get(*uid).filter(|p| p.node == *node) {
                        free_record(&mut n, p);
                    }
                }
                fit(&n, &req, &mut Tightest).is_ok()
            };
            let mut evict: Vec<&str> = victims.pods.iter().map(|v| v.uid.as_str()).collect();
            if !fits_without(&evict) {
                continue; // evicting them would not make room on any card: no preemption here
            }
            // Keep every victim whose eviction is not needed, largest holders last.
            let mut order = evict.clone();
            order.sort_by_key(|uid| std::cmp::Reverse(self.pods.get(*uid).map_or(0, held_percent)));
            for uid in order.into_iter().rev() {
                if !self.pods.contains_key(uid) {
                    continue;
                }
                let without: Vec<&str> = evict.iter().copied().filter(|v| *v != uid).collect();
                if fits_without(&without) {
                    evict = without;
                }
            }
            let pods = victims.pods.iter().filter(|v| evict.contains(&v.uid.as_str())).cloned().collect();
            out.insert(node.clone(), MetaVictims { pods, num_pdb_violations: victims.num_pdb_violations });
        }
        Ok(out)
    }
}

/// Percent of cards a pod holds through its assignment.
pub(super) fn held_percent(p: &PodRecord) -> u32 {
    match &p.holding {
        Holding::Cards(a) => a.held().map(|g| g.percent.0).sum(),
        _ => 0,
    }
}

/// Gives a pod's CPU, memory and cards back to a copy of its node. (The memory of a pod gpushare
/// placed is not given back: a node where only its eviction would make room is not proposed.)
pub(super) fn free_record(n: &mut Node, p: &PodRecord) {
    n.cpu_free = (n.cpu_free + p.cpu).min(n.cpu_total);
    n.mem_free = (n.mem_free + p.mem).min(n.mem_total);
    if let Some(total) = n.ids_total {
        n.ids_free = (n.ids_free + p.ids).min(total);
    }
    if let Holding::Cards(a) = &p.holding {
        for g in a.held() {
            if let Some(c) = n.cards.iter_mut().find(|c| c.uuid == g.uuid) {
                let memory = super::rebuild::held_memory(g, c);
                give_back(c, g.percent, memory);
            }
        }
    }
}

/// Gives `percent` and `memory` back to a copy of `card`.
pub(super) fn give_back(card: &mut Card, percent: Percent, memory: MiB) {
    card.free = (card.free + percent).min(Percent::FULL);
    card.mem_free = (card.mem_free + memory).min(card.mem_total);
}
