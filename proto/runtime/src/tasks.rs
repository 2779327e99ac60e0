//! One owner for a process's background work. Every loop a binary starts for as long as it serves
//! (the allocator's watches, claim allocation, evictions, requeue, load reader, certificate keeper
//! and listeners; the agent's Node and pod watches, repair worker, enforcement label, probes,
//! runtime canary, card refresh, usage sampler, checkpoint sweep, MPS daemon watch and other
//! plugins' watch) runs under [`Tasks`], by name, in a span that carries the name. None of them
//! ends while the process serves, so the first that does, by returning or by a panic, ends the
//! serving with an error that names it: the process exits and is started again (by the kubelet, or
//! the agent's keeper), where one that lost a loop silently would stay Ready and no longer do that
//! job. At shutdown the rest are aborted and waited for.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use tokio::task::{Id, JoinSet};
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

/// The service's background tasks, each with its name.
#[derive(Default)]
pub struct Tasks {
    set: JoinSet<()>,
    names: HashMap<Id, &'static str>,
}

/// How a background task ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The task returned (or was cancelled from outside).
    Returned(&'static str),
    /// The task panicked, with the panic's message.
    Panicked(&'static str, String),
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ended::Returned(name) => write!(f, "the background task {name:?} ended"),
            Ended::Panicked(name, message) => write!(f, "the background task {name:?} panicked: {message}"),
        }
    }
}

impl Tasks {
    /// Runs `task` in the background as `name`, its log lines in a `task` span with that name.
    pub fn spawn<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let handle = self.set.spawn(task.instrument(tracing::info_span!("task", name)));
        self.names.insert(handle.id(), name);
    }

    /// How many tasks run.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether no task runs.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// The first task to end, and how; never resolves while there is none.
    pub async fn first_ended(&mut self) -> Ended {
        let Some(joined) = self.set.join_next_with_id().await else {
            return std::future::pending().await;
        };
        match joined {
            Ok((id, ())) => Ended::Returned(self.name(id)),
            Err(e) => {
                let name = self.name(e.id());
                match e.try_into_panic() {
                    Ok(payload) => Ended::Panicked(name, panic_message(payload.as_ref())),
                    Err(_) => Ended::Returned(name),
                }
            }
        }
    }

    /// Aborts every task and waits until all have ended.
    pub async fn shutdown(&mut self) {
        self.set.shutdown().await;
        self.names.clear();
    }

    fn name(&mut self, id: Id) -> &'static str {
        self.names.remove(&id).unwrap_or("(unnamed)")
    }
}

/// A task one of the service's loops starts for a part of its job (the claim watch of the claim
/// allocation, say), in a `task` span named `name`: aborted when the loop that holds it ends (its
/// handle is dropped), and [`Child::ended`] resolves when it ends, re-raising its panic in the loop,
/// so the loop's own task ends as the child did.
pub struct Child(AbortOnDropHandle<()>);

impl Child {
    /// Runs `task` in the background for the caller.
    pub fn spawn<F>(name: &'static str, task: F) -> Child
    where
        F: Future<Output = ()> + Send + 'static,
    {
        Child(AbortOnDropHandle::new(tokio::spawn(task.instrument(tracing::info_span!("task", name)))))
    }

    /// Resolves when the task ended: returns if it returned, panics as it did if it panicked.
    pub async fn ended(&mut self) {
        if let Err(e) = (&mut self.0).await
            && let Ok(payload) = e.try_into_panic()
        {
            std::panic::resume_unwind(payload);
        }
    }
}

/// A panic's message, when it is a string (what `panic!` gives).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_owned(),
        (_, Some(s)) => s.clone(),
        _ => "(not a string)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_task_that_panics_is_told_by_name_and_message() {
        let mut tasks = Tasks::default();
        tasks.spawn("forever", std::future::pending());
        tasks.spawn("claims", async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            panic!("the claim watch broke");
        });
        let ended = tasks.first_ended().await;
        assert_eq!(ended, Ended::Panicked("claims", "the claim watch broke".into()));
        assert_eq!(ended.to_string(), "the background task \"claims\" panicked: the claim watch broke");
        assert_eq!(tasks.len(), 1, "the other task runs on");
        tasks.shutdown().await;
        assert!(tasks.is_empty());
    }

    #[tokio::test]
    async fn a_task_that_returns_is_told_and_none_running_never_resolves() {
        let mut tasks = Tasks::default();
        let no_task = tokio::time::timeout(Duration::from_millis(20), tasks.first_ended()).await;
        assert!(no_task.is_err(), "resolved with no task: {no_task:?}");
        tasks.spawn("requeue", async {});
        assert_eq!(tasks.first_ended().await, Ended::Returned("requeue"));
    }

    #[tokio::test]
    async fn shutdown_aborts_what_runs() {
        let mut tasks = Tasks::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tasks.spawn("holds a sender", async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        tasks.shutdown().await;
        // The task was dropped: its sender with it.
        assert!(rx.await.is_err());
    }

    #[tokio::test]
    async fn a_childs_panic_ends_the_loop_that_holds_it() {
        let mut tasks = Tasks::default();
        tasks.spawn("claims", async {
            let mut watch = Child::spawn("claim watch", async { panic!("the claim stream broke") });
            loop {
                tokio::select! {
                    () = watch.ended() => return,
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
        });
        assert_eq!(tasks.first_ended().await, Ended::Panicked("claims", "the claim stream broke".into()));
    }

    #[tokio::test]
    async fn a_child_is_aborted_with_its_holder() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let child = Child::spawn("holds a sender", async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(child);
        assert!(rx.await.is_err());
    }
}
