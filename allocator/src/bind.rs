//! The bind protocol, on its own: what `POST /bind` does between decoding kube-scheduler's
//! `ExtenderBindingArgs` and answering it.
//!
//! 1. Only the leader binds. Read the pod from the API server (never from a filter body: what is
//!    bound is what the API server holds) and check it has the uid kube-scheduler names.
//! 2. Reserve the cards in the view ([`ClusterState::reserve`](crate::state::ClusterState::reserve)):
//!    back-to-back binds never double-book, and a repeated bind of a bound pod is answered at once.
//! 3. Write the annotations with uid + resourceVersion preconditions; a conflict re-reads the pod and
//!    tries again, up to [`CONFLICT_RETRIES`] times.
//! 4. POST `pods/binding`.
//!
//! A failure comes back as a [`BindFailed`] naming the step. Before any write, the reservation is
//! simply given back; after one, what the API server holds decides (an answer may have been lost):
//! see [`settle_failure`].

use crate::binder::{ApiError, Binder};
use crate::extender::BindError;
use crate::leader::Leadership;
use crate::state::{Reservation, SharedView};
use nano_gpu_proto::annotations::ASSIGNMENT_ANNOTATION;
use nano_gpu_proto::extender::ExtenderBindingArgs;
use std::collections::BTreeMap;
use std::time::SystemTime;
use thiserror::Error;

/// What a replica that is not the leader answers.
pub const NOT_LEADER: &str = "this allocator replica is not the leader; retry";

/// Conflicting annotation writes retried before a bind gives up.
pub const CONFLICT_RETRIES: usize = 5;

/// Why a bind did not happen; the message is what kube-scheduler records for the pod.
#[derive(Debug, Error)]
pub enum BindFailed {
    /// This replica does not decide.
    #[error("{}", NOT_LEADER)]
    NotLeader,
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
    /// No cards can be taken for it on that node.
    #[error(transparent)]
    Refused(#[from] BindError),
    /// The pod was deleted and created again while its annotation was being written.
    #[error("pod {pod} was replaced")]
    Replaced {
        /// `namespace/name`.
        pod: String,
    },
    /// Re-reading the pod after a conflict failed.
    #[error("re-reading pod {pod}: {source}")]
    Reread {
        /// `namespace/name`.
        pod: String,
        /// The API error.
        source: ApiError,
    },
    /// Writing the annotations failed.
    #[error("writing {ASSIGNMENT_ANNOTATION} on {pod}: {source}")]
    Annotate {
        /// `namespace/name`.
        pod: String,
        /// The API error.
        source: ApiError,
    },
    /// The binding was refused.
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

/// Binds the pod `args` names to `args.node`: reserve, annotate (retrying conflicts), bind; on failure
/// the annotations and the reservation are removed. Leadership is checked again before every write:
/// a replica that lost it mid-bind (a hung API call, a frozen process) writes nothing more.
pub async fn bind<B: Binder>(
    view: &SharedView,
    binder: &B,
    leader: &Leadership,
    args: &ExtenderBindingArgs,
) -> Result<(), BindFailed> {
    let (ns, name, uid, node) = (&args.pod_namespace, &args.pod_name, &args.pod_uid, &args.node);
    let key = || format!("{ns}/{name}");
    // Counted in flight until it returns: a leader that stops lets it end before giving the Lease up.
    let Some(_decision) = leader.decide() else { return Err(BindFailed::NotLeader) };
    let mut pod =
        binder.get_pod(ns, name).await.map_err(|source| BindFailed::ReadPod { pod: key(), source })?;
    if pod.metadata.uid.as_deref() != Some(uid.as_str()) {
        return Err(BindFailed::NotThePod { pod: key(), uid: uid.clone() });
    }
    let reservation = view.lock().reserve(&pod, node, SystemTime::now())?;
    let already_bound = pod.spec.as_ref().and_then(|sp| sp.node_name.as_deref()) == Some(node.as_str());
    if !reservation.fresh && already_bound {
        return Ok(()); // kube-scheduler retried a bind that had succeeded
    }
    let set: BTreeMap<String, Option<String>> =
        reservation.annotations.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect();
    let mut attempt = 0;
    // Whether an annotation write went out (its answer may be lost: then it may have been made).
    let mut written = false;
    let annotated = loop {
        let rv = pod.metadata.resource_version.clone();
        if !leader.is_leader() {
            break Err(BindFailed::NotLeader);
        }
        written = true;
        match binder.annotate(ns, name, uid, rv.as_deref(), &set).await {
            Ok(()) => break Ok(()),
            Err(ApiError::Conflict(_)) if attempt < CONFLICT_RETRIES => {
                attempt += 1;
                match binder.get_pod(ns, name).await {
                    Ok(fresh) if fresh.metadata.uid.as_deref() == Some(uid.as_str()) => pod = fresh,
                    Ok(_) => break Err(BindFailed::Replaced { pod: key() }),
                    Err(source) => break Err(BindFailed::Reread { pod: key(), source }),
                }
            }
            Err(source) => break Err(BindFailed::Annotate { pod: key(), source }),
        }
    };
    let result = match annotated {
        Ok(()) if !leader.is_leader() => Err(BindFailed::NotLeader),
        Ok(()) => binder.bind(ns, name, uid, node).await.map_err(|source| BindFailed::Bind {
            pod: key(),
            node: node.clone(),
            source,
        }),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => Ok(()),
        // Kube-scheduler's retry of a pod that held this assignment already: nothing of ours to undo.
        Err(e) if !reservation.fresh => Err(e),
        Err(e) if !written => {
            view.lock().release(&reservation);
            Err(e)
        }
        Err(e) => settle_failure(view, binder, args, &reservation, e).await,
    }
}

/// A bind failed after an annotation write went out; what the API server holds now decides what that
/// failure was. Its answers may have been lost (a crash, a timeout), so nothing is undone blind:
/// - the pod is bound to the node with our assignment: the bind took effect, only its answer was
///   lost, and it succeeded;
/// - the pod is unbound with our assignment: the assignment is removed, only while it is still ours
///   (resourceVersion precondition: a new leader's assignment is never removed; this also holds for a
///   replica that lost leadership meanwhile), and the reservation given back;
/// - another assignment, another pod, or none: the reservation is given back;
/// - the pod cannot be read, or the removal's answer is lost: what it holds is left as it is (it may be
///   bound) and the view keeps the reservation until the watch shows the pod.
async fn settle_failure<B: Binder>(
    view: &SharedView,
    binder: &B,
    args: &ExtenderBindingArgs,
    reservation: &Reservation,
    failed: BindFailed,
) -> Result<(), BindFailed> {
    let (ns, name, uid, node) = (&args.pod_namespace, &args.pod_name, &args.pod_uid, &args.node);
    let key = format!("{ns}/{name}");
    let ours = reservation.annotations.get(ASSIGNMENT_ANNOTATION);
    let remove = reservation.annotations.keys().map(|k| (k.clone(), None)).collect();
    for _ in 0..=CONFLICT_RETRIES {
        let pod = match binder.get_pod(ns, name).await {
            Ok(pod) => pod,
            Err(ApiError::NotFound(_)) => break,
            Err(e) => {
                tracing::warn!(pod = %key, error = %e, after = %failed, "a failed bind's outcome cannot be read; its assignment stays until the pod is seen");
                return Err(failed);
            }
        };
        let assignment = pod.metadata.annotations.as_ref().and_then(|a| a.get(ASSIGNMENT_ANNOTATION));
        if pod.metadata.uid.as_deref() != Some(uid.as_str()) || assignment != ours {
            break;
        }
        match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(n) if n == node.as_str() => {
                tracing::info!(pod = %key, node = %node, after = %failed, "the bind took effect; its answer was lost");
                return Ok(());
            }
            Some(other) => {
                tracing::warn!(pod = %key, node = %other, "bound elsewhere with our assignment; left as it is");
                break;
            }
            None => {}
        }
        match binder.annotate(ns, name, uid, pod.metadata.resource_version.as_deref(), &remove).await {
            Ok(()) => break,
            Err(ApiError::Conflict(_)) => continue,
            Err(e) => {
                tracing::warn!(pod = %key, error = %e, "could not remove the assignment after a failed bind");
                return Err(failed);
            }
        }
    }
    view.lock().release(reservation);
    Err(failed)
}
