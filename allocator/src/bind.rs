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
//! Any failure after step 2 removes what was written and gives the reservation back, and comes back
//! as a [`BindFailed`] naming the step.

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
    if !leader.is_leader() {
        return Err(BindFailed::NotLeader);
    }
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
    let annotated = loop {
        let rv = pod.metadata.resource_version.clone();
        if !leader.is_leader() {
            break Err(BindFailed::NotLeader);
        }
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
    if result.is_err() {
        // A replica that is no longer the leader leaves the API to the one that is (the pod may
        // already carry the new leader's assignment); it only forgets its own reservation.
        let writes = leader.is_leader();
        roll_back(view, binder, writes, ns, name, uid, &reservation).await;
    }
    result
}

async fn roll_back<B: Binder>(
    view: &SharedView,
    binder: &B,
    writes: bool,
    ns: &str,
    name: &str,
    uid: &str,
    reservation: &Reservation,
) {
    let remove = reservation.annotations.keys().map(|k| (k.clone(), None)).collect();
    if reservation.fresh
        && writes
        && let Err(e) = binder.annotate(ns, name, uid, None, &remove).await
    {
        tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "could not remove the assignment after a failed bind");
    }
    view.lock().release(reservation);
}
