//! The bind protocol, on its own: what `POST /bind` does between decoding kube-scheduler's
//! `ExtenderBindingArgs` and answering it.
//!
//! 1. Only the leader binds, and at most one bind of a pod runs at a time ([`InFlight`]): kube-scheduler
//!    retries a pod whose bind it gave up on, perhaps on another node, while the first may still run.
//! 2. Take the reservation the filter that chose this node made
//!    ([`ClusterState::take_filter_hold`](crate::state::ClusterState::take_filter_hold)), the default.
//!    Without one (a `fitting` filter, a hold that expired or names another node): read the pod from
//!    the API server (never from a filter body: what is bound is what the API server holds), check it
//!    has the uid kube-scheduler names, and reserve the cards in the view
//!    ([`ClusterState::reserve`](crate::state::ClusterState::reserve)): back-to-back binds never
//!    double-book, and a repeated bind of a bound pod is answered at once. The next pod's filter,
//!    which waited for this ([`crate::service::handoff`]), goes on.
//! 4. POST `pods/binding` carrying the assignment: one write sets the node and the annotations together
//!    (see [`binder`](crate::service::bind_api)), so no answer, however late, leaves a pod bound to one node with an
//!    assignment naming another.
//!
//! Steps 2–4 end within [`DEADLINE`] and reading back a failed binding within [`READ_BACK`], together
//! below kube-scheduler's `httpTimeout` (10 s in the shipped configurations): the answer always reaches
//! kube-scheduler before it gives up. A failure comes back as a [`BindFailed`] naming the step. Before
//! the binding is sent, the reservation is simply given back; after, what the API server holds decides
//! (the answer may have been lost): see [`settle_failure`].

use crate::decide::extender::BindError;
use crate::service::bind_api::{ApiError, Binder};
use crate::service::handoff::Handoff;
use crate::service::leader::Leadership;
use crate::state::{Reservation, SharedView};
use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
use nano_gpu_proto::extender::ExtenderBindingArgs;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};
use thiserror::Error;
use tokio::time::Instant;

/// What a replica that is not the leader answers.
pub const NOT_LEADER: &str = "this allocator replica is not the leader; retry";

/// How long reading the pod and binding it may take together.
pub const DEADLINE: Duration = Duration::from_secs(8);

/// How long reading back a failed binding may take, after [`DEADLINE`].
pub const READ_BACK: Duration = Duration::from_secs(1);

/// Why a bind did not happen; the message is what kube-scheduler records for the pod.
#[derive(Debug, Error)]
pub enum BindFailed {
    /// This replica does not decide.
    #[error("{}", NOT_LEADER)]
    NotLeader,
    /// Another bind of the same pod has not ended.
    #[error("a bind of pod {pod} to node {node} is still in flight; retry once it has ended")]
    InFlight {
        /// `namespace/name`.
        pod: String,
        /// The node that bind names.
        node: String,
    },
    /// The pod cannot be read.
    #[error("reading pod {pod}: {source}")]
    ReadPod {
        /// `namespace/name`.
        pod: String,
        /// The API error.
        source: ApiError,
    },
    /// The pod under that name has another uid.
    #[error("pod {pod} is not the pod with uid {uid}")]
    NotThePod {
        /// `namespace/name`.
        pod: String,
        /// The uid kube-scheduler asked for.
        uid: String,
    },
    /// The pod is bound to another node already (a binding kube-scheduler gave up on landed).
    #[error("pod {pod} is already bound to node {node}")]
    BoundElsewhere {
        /// `namespace/name`.
        pod: String,
        /// The node it is bound to.
        node: String,
    },
    /// No cards can be taken for it on that node.
    #[error(transparent)]
    Refused(#[from] BindError),
    /// The bind's task ended without an answer (a panic).
    #[error("the bind of this pod failed: {0}")]
    Task(String),
    /// The binding was refused or its answer lost.
    #[error("binding {pod} to {node}: {source}")]
    Bind {
        /// `namespace/name`.
        pod: String,
        /// The node.
        node: String,
        /// The API error.
        source: ApiError,
    },
}

/// The pods whose bind is running, by uid, with the node each names.
#[derive(Debug, Default)]
pub struct InFlight(Mutex<HashMap<String, String>>);

impl InFlight {
    /// Marks the pod `uid` as being bound to `node` until the returned guard is dropped; the node of
    /// the bind already running, if one is.
    fn enter(&self, uid: &str, node: &str) -> Result<Entered<'_>, String> {
        let mut running = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = running.get(uid) {
            return Err(other.clone());
        }
        running.insert(uid.to_owned(), node.to_owned());
        Ok(Entered { set: self, uid: uid.to_owned() })
    }
}

/// A bind in [`InFlight`]; leaves it when dropped.
struct Entered<'a> {
    set: &'a InFlight,
    uid: String,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.set.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.uid);
    }
}

/// `call`, or [`ApiError::Timeout`] once `deadline` has passed.
async fn by<T>(
    deadline: Instant,
    budget: Duration,
    call: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    tokio::time::timeout_at(deadline, call).await.unwrap_or(Err(ApiError::Timeout(budget)))
}

/// Binds the pod `args` names to `args.node`: reserve, then one binding that carries the assignment;
/// on failure the reservation is given back unless the pod may hold it. Leadership is checked again
/// before the write: a replica that lost it mid-bind (a hung API call, a frozen process) writes
/// nothing.
pub async fn bind<B: Binder>(
    view: &SharedView,
    binder: &B,
    leader: &Leadership,
    in_flight: &InFlight,
    handoff: &Handoff,
    args: &ExtenderBindingArgs,
) -> Result<(), BindFailed> {
    let (ns, name, uid, node) = (&args.pod_namespace, &args.pod_name, &args.pod_uid, &args.node);
    // Until the cards are reserved (or the bind fails), the next pod's filter waits for this one.
    let settle = Settle(handoff, uid);
    let key = || format!("{ns}/{name}");
    // Counted in flight until it returns: a leader that stops lets it end before giving the Lease up.
    let Some(_decision) = leader.decide() else { return Err(BindFailed::NotLeader) };
    let _entered = in_flight.enter(uid, node).map_err(|node| BindFailed::InFlight { pod: key(), node })?;
    let deadline = Instant::now() + DEADLINE;
    // The filter that chose this node reserved the cards (on the pod kube-scheduler filtered, of this
    // uid): no read, as the binding's uid precondition is the check it would make, and a binding the
    // API server refuses (the pod replaced or bound meanwhile) is read back below.
    let held = view.lock().take_filter_hold(uid, node);
    let reservation = match held {
        Some(reservation) => reservation,
        None => {
            let pod = by(deadline, DEADLINE, binder.get_pod(ns, name))
                .await
                .map_err(|source| BindFailed::ReadPod { pod: key(), source })?;
            if pod.metadata.uid.as_deref() != Some(uid.as_str()) {
                return Err(BindFailed::NotThePod { pod: key(), uid: uid.clone() });
            }
            // Bound elsewhere: what the view holds for it (its cards there) stays as it is; reserving
            // here would replace it, and the binding would be refused anyway.
            let bound_to = pod.spec.as_ref().and_then(|sp| sp.node_name.as_deref());
            if let Some(other) = bound_to.filter(|n| *n != node.as_str()) {
                return Err(BindFailed::BoundElsewhere { pod: key(), node: other.to_owned() });
            }
            let reservation = view.lock().reserve(&pod, node, SystemTime::now())?;
            if !reservation.fresh && bound_to == Some(node.as_str()) {
                return Ok(()); // kube-scheduler retried a bind that had succeeded
            }
            reservation
        }
    };
    drop(settle);
    if !leader.is_leader() {
        if reservation.fresh {
            view.lock().release(&reservation);
        }
        return Err(BindFailed::NotLeader);
    }
    let bound = by(deadline, DEADLINE, binder.bind(ns, name, uid, node, &reservation.annotations)).await;
    match bound {
        Ok(()) => Ok(()),
        Err(source) => {
            let failed = BindFailed::Bind { pod: key(), node: node.clone(), source };
            // Kube-scheduler's retry of a pod that held this assignment already: nothing of ours to undo.
            if !reservation.fresh {
                return Err(failed);
            }
            settle_failure(view, binder, args, &reservation, failed).await
        }
    }
}

/// Tells the [`Handoff`] that the bind of this pod settled, when dropped.
struct Settle<'a>(&'a Handoff, &'a str);

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        self.0.settled(self.1);
    }
}

/// A binding failed; what the API server holds now decides what that failure was. Its answer may
/// have been lost (a timeout, a broken connection), so nothing is given back blind:
/// - the pod is bound to the node with our assignment: the binding took effect, only its answer was
///   lost, and it succeeded;
/// - the pod is gone, replaced, or bound elsewhere or with another assignment: the binding did not
///   take effect (a pod is bound once), and the reservation is given back;
/// - the pod is unbound: the reservation is given back if the API server's answer said the binding
///   was refused; after a lost answer the binding may still land, so the view keeps the reservation
///   until the watch shows the pod (a later bind of the pod reuses it or replaces it);
/// - the pod cannot be read in [`READ_BACK`]: the view keeps the reservation the same way.
async fn settle_failure<B: Binder>(
    view: &SharedView,
    binder: &B,
    args: &ExtenderBindingArgs,
    reservation: &Reservation,
    failed: BindFailed,
) -> Result<(), BindFailed> {
    let (ns, name, uid, node) = (&args.pod_namespace, &args.pod_name, &args.pod_uid, &args.node);
    let key = format!("{ns}/{name}");
    let answered = matches!(&failed, BindFailed::Bind { source, .. } if source.answered());
    let read = by(Instant::now() + READ_BACK, READ_BACK, binder.get_pod(ns, name)).await;
    let pod = match read {
        Ok(pod) => pod,
        Err(ApiError::NotFound(_)) => {
            view.lock().release(reservation);
            return Err(failed);
        }
        Err(e) => {
            tracing::warn!(pod = %key, error = %e, after = %failed, "a failed bind's outcome cannot be read; its reservation stays until the pod is seen");
            return Err(failed);
        }
    };
    let ours = reservation.annotations.get(ASSIGNMENT_ANNOTATION);
    let assignment = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION));
    let on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let same_pod = pod.metadata.uid.as_deref() == Some(uid.as_str());
    match on {
        Some(n) if same_pod && n == node.as_str() && assignment == ours => {
            tracing::info!(pod = %key, node = %node, after = %failed, "the bind took effect; its answer was lost");
            Ok(())
        }
        None if same_pod && !answered => {
            tracing::warn!(pod = %key, after = %failed, "a binding whose answer was lost may still land; its reservation stays until the pod is seen");
            Err(failed)
        }
        _ => {
            view.lock().release(reservation);
            Err(failed)
        }
    }
}
