//! Reservations: a bind takes its cards in the view before any API call ([`ClusterState::reserve`]);
//! the reservation lives until the watch shows the annotated pod, so back-to-back decisions never
//! double-book, and a failed bind gives it back ([`ClusterState::release`]). Also the annotations a
//! bind writes: the assignment, and gpushare's for pods asking `aliyun.com/gpu-mem`.

use super::ClusterState;
use super::decode::{Holding, PodRecord, pod_uid};
use crate::decide::extender::{BindError, Bound};
use k8s_openapi::api::core::v1::Pod;
use nano_gpu_proto::annotations::{ASSIGNMENT_ANNOTATION, Assignment, rfc3339};
use nano_gpu_proto::gpushare;
use std::collections::BTreeMap;
use std::time::SystemTime;

impl ClusterState {
    /// Chooses the cards for `pod` on `node` and reserves them. A pod that already holds cards on that
    /// node (kube-scheduler retrying a bind) gets the same assignment again; a filter's hold is given
    /// back first (see [`ClusterState::take_filter_hold`]).
    pub fn reserve(&mut self, pod: &Pod, node: &str, now: SystemTime) -> Result<Reservation, BindError> {
        let uid = pod_uid(pod).ok_or_else(|| BindError::Invalid("pod has no uid".into()))?.to_owned();
        // A filter's hold that its bind did not take (`take_filter_hold`): decided anew, on this pod.
        self.give_back_filter_hold(&uid);
        if let Some(existing) = self.pods.get(&uid) {
            if let (Holding::Cards(a), true) = (&existing.holding, existing.node == node) {
                let annotations = self.annotations(pod, a, now);
                return Ok(Reservation { uid, assignment: a.clone(), annotations, fresh: false });
            }
            self.forget_pod(&uid);
        }
        let Bound { assignment, req, .. } = self.extender.bind(pod, node, &rfc3339(now))?;
        if let Some(workload) = self.learner.as_mut().and_then(|l| l.observe(&req)) {
            self.extender.engine_mut().set_workload(workload);
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let record = PodRecord {
            key: (ns, name),
            node: node.to_owned(),
            cpu: req.cpu,
            mem: req.mem,
            ids: req.ids,
            holding: Holding::Cards(assignment.clone()),
            reserved: true,
            priority: super::decode::priority(pod),
            terminating: false,
        };
        self.insert_pod(uid.clone(), record);
        self.rebuild(node);
        let annotations = self.annotations(pod, &assignment, now);
        Ok(Reservation { uid, assignment, annotations, fresh: true })
    }

    /// The annotations a bind writes: the assignment, and gpushare's for pods that ask
    /// `aliyun.com/gpu-mem` when compatibility is on.
    fn annotations(&self, pod: &Pod, assignment: &Assignment, now: SystemTime) -> BTreeMap<String, String> {
        let mut out = BTreeMap::from([(ASSIGNMENT_ANNOTATION.to_owned(), assignment.encode())]);
        let Some(unit) = self.extender.demand_options().gpushare else { return out };
        let units = gpushare::pod_units(pod);
        let cluster = self.extender.engine().cluster();
        let card = cluster.id(&assignment.node).and_then(|id| {
            let first = assignment.held().next()?;
            cluster.node(id).cards.iter().find(|c| c.uuid == first.uuid)
        });
        if let (true, Some(card)) = (units > 0, card) {
            let dev = unit.units_in(card.mem_total);
            let ns = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            out.extend(gpushare::annotations(card.index, units, dev, ns));
        }
        out
    }

    /// Gives back a reservation whose bind failed, if only the view holds it: once a watch event showed
    /// the pod, the record is what the API server said, and later events keep it true.
    pub fn release(&mut self, reservation: &Reservation) {
        let ours = |p: &PodRecord| p.reserved && p.holding == Holding::Cards(reservation.assignment.clone());
        if reservation.fresh && self.pods.get(&reservation.uid).is_some_and(ours) {
            self.forget_pod(&reservation.uid);
        }
    }
}

/// Cards reserved for a pod by [`ClusterState::reserve`].
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    /// Pod UID.
    pub uid: String,
    /// The assignment.
    pub assignment: Assignment,
    /// Every annotation to write: the encoded assignment, and gpushare's when they apply.
    pub annotations: BTreeMap<String, String>,
    /// False when the pod already held this assignment (a repeated bind): nothing to give back.
    pub fresh: bool,
}
