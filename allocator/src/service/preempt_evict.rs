//! Evicting the victims of the preemption nano-gpu decides itself ([`crate::state`]'s preemption:
//! for pods waiting on claims, and for GPU shares that no card has room for). Only the leader evicts,
//! through the Eviction API, so PodDisruptionBudgets hold; each victim gets a `Preempted` Event.
//! An eviction refused or failed ends the waiting pod's nomination for
//! [`crate::state::PREEMPT_RETRY`] and says why on the waiting pod.

use crate::service::leader::Leadership;
use crate::service::overrun_evict::{self, Outcome};
use crate::service::watch::publish;
use crate::state::{Needs, Preemption, SharedView, Warning};
use kube::Client;
use kube::runtime::events::Recorder;
use nano_gpu_proto::events::Reason;
use std::sync::Arc;
use std::time::Duration;

/// How often the view is looked at for preemptions a filter decided.
const EVERY: Duration = Duration::from_millis(200);

/// Evicts the victims of every preemption the view decided (the filter's, for GPU shares; the claim
/// planner carries out its own at once, [`crate::service::dra`]) while this replica leads; one decided while
/// it led is dropped once it no longer does ([`carry_out`]).
pub async fn run(client: Client, view: Arc<SharedView>, leader: Arc<Leadership>, recorder: Recorder) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let preemptions = view.lock().take_preemptions();
        for p in &preemptions {
            carry_out(&client, &view, &leader, &recorder, p).await;
        }
    }
}

/// Evicts the victims of `p` (while this replica leads), each with a `Preempted` Event; a refused or
/// failed eviction ends the pod's nomination for a while and says why on the waiting pod. One that
/// stops leading first ends the nomination: whoever leads next searches again.
pub async fn carry_out(
    client: &Client,
    view: &SharedView,
    leader: &Leadership,
    recorder: &Recorder,
    p: &Preemption,
) {
    let waiting = format!("{}/{}", p.pod.0, p.pod.1);
    let what = match p.needs {
        Needs::Claims => "whose ResourceClaims nano-gpu allocates",
        Needs::Share => "whose GPU share no card had room for",
    };
    for v in &p.victims {
        if !leader.is_leader() {
            tracing::info!(preemptor = %waiting, "no longer leading: the pods preempted for it are left alone");
            view.lock().preemption_dropped(&p.pod_uid, &p.node);
            return;
        }
        let victim = format!("{}/{}", v.pod.0, v.pod.1);
        let why = match overrun_evict::evict(client, &v.pod.0, &v.pod.1, &v.uid).await {
            Outcome::Evicted => {
                tracing::info!(pod = %victim, node = %p.node, preemptor = %waiting, "preempted");
                let message = format!(
                    "evicted to make room on node {} for pod {waiting} (priority {}, above this pod's {}), {what}",
                    p.node, p.priority, v.priority
                );
                let event = Warning::on_pod(&v.pod, Reason::Preempted, message);
                publish(recorder, &event, "Preempt").await;
                continue;
            }
            Outcome::Gone => continue,
            Outcome::Blocked(why) | Outcome::Failed(why) => why,
        };
        tracing::warn!(pod = %victim, preemptor = %waiting, error = %why, "evicting a pod to preempt it failed");
        view.lock().preemption_failed(&p.pod_uid, std::time::Instant::now());
        let (reason, room) = match p.needs {
            Needs::Claims => (Reason::ClaimNotAllocated, "this pod's claims"),
            Needs::Share => (Reason::PreemptionFailed, "this pod's GPU share"),
        };
        let message = format!(
            "evicting pod {victim} on node {} to make room for {room} failed: {why}; preempting again in {} s",
            p.node,
            crate::state::PREEMPT_RETRY.as_secs()
        );
        publish(recorder, &Warning::on_pod(&p.pod, reason, message), "Preempt").await;
        return;
    }
}

#[cfg(test)]
mod tests {
    //! The exact requests of a preemption, against a fake API server (tower-test).
    use super::*;
    use crate::api_replies::{failure, respond};
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    /// A client of a fake API server, its handle, a recorder through it, and an empty view.
    fn harness() -> (Client, Handle, Recorder, SharedView) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let reporter = kube::runtime::events::Reporter { controller: "test".into(), instance: None };
        let recorder = Recorder::new(client.clone(), reporter);
        let engine = nano_gpu_engine::engine::Engine::new(
            nano_gpu_engine::model::Cluster::new(),
            nano_gpu_engine::policy::by_name("fgd-balance", 0).unwrap(),
            nano_gpu_engine::workload::Workload::default(),
        );
        let view = SharedView::new(crate::state::ClusterState::new(engine, 1, Default::default()));
        (client, handle, recorder, view)
    }

    #[tokio::test]
    async fn victims_are_evicted_each_with_an_event_and_a_refusal_stops_the_rest_and_is_said_on_the_pod() {
        for (needs, reason, room) in [
            (Needs::Claims, "ClaimNotAllocated", "this pod's claims"),
            (Needs::Share, "PreemptionFailed", "this pod's GPU share"),
        ] {
            one_preemption(needs, reason, room).await;
        }
    }

    #[tokio::test]
    async fn a_replica_that_no_longer_leads_evicts_no_one() {
        let (client, handle, recorder, view) = harness();
        let p = Preemption {
            pod: ("t".into(), "high".into()),
            pod_uid: "u-high".into(),
            priority: 100,
            needs: Needs::Share,
            node: "n1".into(),
            victims: vec![crate::state::Victim {
                uid: "u-a".into(),
                pod: ("t".into(), "a".into()),
                priority: 0,
            }],
        };
        let server = crate::api_replies::recording(handle, |_, body, _| respond(201, body.clone()));
        carry_out(&client, &view, &Leadership::elected(), &recorder, &p).await;
        drop((client, recorder));
        assert_eq!(server.await.unwrap(), vec![], "a replica that does not lead called the API");
    }

    async fn one_preemption(needs: Needs, reason: &str, room: &str) {
        let (client, handle, recorder, view) = harness();
        let victim = |name: &str, priority| crate::state::Victim {
            uid: format!("u-{name}"),
            pod: ("t".into(), name.into()),
            priority,
        };
        let p = Preemption {
            pod: ("t".into(), "high".into()),
            pod_uid: "u-high".into(),
            priority: 100,
            needs,
            node: "n1".into(),
            victims: vec![victim("a", 5), victim("b", 0), victim("c", 0)],
        };
        // `a` is evicted, `b` refused by a PodDisruptionBudget: `c` is not tried.
        let server = crate::api_replies::recording(handle, |path, body, _| {
            if path.ends_with("/b/eviction") {
                failure(429, "Cannot evict pod as it would violate the pod's disruption budget.")
            } else {
                respond(201, body.clone())
            }
        });
        carry_out(&client, &view, &Leadership::always(), &recorder, &p).await;
        drop((client, recorder));
        let seen = server.await.unwrap();
        let paths: Vec<&str> = seen.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/t/pods/a/eviction",
                "/apis/events.k8s.io/v1/namespaces/t/events",
                "/api/v1/namespaces/t/pods/b/eviction",
                "/apis/events.k8s.io/v1/namespaces/t/events",
            ]
        );
        assert_eq!(seen[0].1["deleteOptions"]["preconditions"]["uid"], "u-a");
        let (first, second) = (&seen[1].1, &seen[3].1);
        assert_eq!((&first["reason"], &first["regarding"]["name"]), (&json!("Preempted"), &json!("a")));
        assert!(
            first["note"].as_str().unwrap().contains("for pod t/high (priority 100, above this pod's 5)"),
            "{first}"
        );
        assert_eq!((&second["reason"], &second["regarding"]["name"]), (&json!(reason), &json!("high")));
        let said = second["note"].as_str().unwrap();
        assert!(
            said.contains(&format!("evicting pod t/b on node n1 to make room for {room} failed")),
            "{second}"
        );
    }
}
