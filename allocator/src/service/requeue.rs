//! Sends the pods the extender refused back to kube-scheduler's queue once the view has changed.
//!
//! kube-scheduler queues a pod an extender refused again at the next cluster event of any kind (it
//! cannot tell which events matter to an extender). kube-scheduler and the allocator each watch the
//! API server, so the pod may be tried again before the allocator's view holds the event that woke
//! it (its backoff, from 1 s, may end first; kube-scheduler 1.33 and later even take a pod straight
//! from the backoff queue while nothing else waits, unless `SchedulerPopFromBackoffQ` is off, as
//! nano-gpu's kube-scheduler runs): refused on what was, it then waits for the next event, which
//! in a quiet cluster is kube-scheduler's flush of unschedulable pods, 5 minutes later (seen on the
//! local cluster: a share asked while its node's cards were turning healthy waited 2 minutes and
//! more).
//!
//! So the leader, when its view has changed since it refused a pod on every node, changes the label
//! [`VIEW_LABEL`] of its own pod to the view's generation: kube-scheduler sees an assigned pod's label
//! change, a cluster event, and queues every pod an extender refused again. At most once per
//! [`EVERY`], only after a refusal, only by the replica that decides.

use crate::service::leader::Leadership;
use crate::state::SharedView;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The label of the allocator's pod whose change sends refused pods back to the queue.
pub const VIEW_LABEL: &str = "nano-gpu/view";

/// How often the view is looked at.
pub const EVERY: Duration = Duration::from_secs(1);

/// Labels pod `me` (this replica's, in the namespace of `pods`) whenever the view changed after a
/// refusal, while this replica decides.
pub async fn run(pods: Api<Pod>, me: String, view: Arc<SharedView>, leader: Arc<Leadership>) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !leader.is_leader() {
            continue;
        }
        let Some(generation) = view.lock().requeue_due() else { continue };
        let patch = Patch::Merge(json!({"metadata": {"labels": {VIEW_LABEL: generation.to_string()}}}));
        let params = PatchParams::default();
        let call = pods.patch(&me, &params, &patch);
        match tokio::time::timeout(crate::service::bind_api::CALL_TIMEOUT, call).await {
            Ok(Ok(_)) => {
                tracing::debug!(pod = %me, generation, "refused pods sent back to kube-scheduler's queue")
            }
            Ok(Err(e)) => {
                tracing::warn!(pod = %me, error = %e, "could not label this pod to requeue refused pods");
                view.lock().requeue_failed();
            }
            Err(_) => {
                tracing::warn!(pod = %me, "could not label this pod to requeue refused pods in time");
                view.lock().requeue_failed();
            }
        }
    }
}
