//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several replicas exactly one decides.
//!
//! Every `retry` the replica reads the Lease and creates it, renews it (it holds it), takes it over (its
//! holder has not renewed within the lease duration) or follows. Writes are replaces with the read
//! resourceVersion, so two replicas cannot both win a take-over. A leader that cannot renew stops
//! deciding after `renew_deadline` (less than the lease duration), before any other replica may take
//! over. Readiness follows leadership, so the Service routes only to the leader.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What a replica does with the Lease it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// There is no Lease: create it, held by us.
    Create,
    /// We hold it: renew it.
    Renew,
    /// Its holder let it expire: take it over.
    TakeOver,
    /// Someone else holds it.
    Follow(String),
}

/// The decision for `lease` (None: absent) by replica `me` at `now_ms` (milliseconds since the epoch).
pub fn step(lease: Option<&LeaseSpec>, me: &str, now_ms: i64) -> Step {
    let Some(spec) = lease else { return Step::Create };
    match spec.holder_identity.as_deref() {
        Some(h) if h == me => Step::Renew,
        None | Some("") => Step::TakeOver,
        Some(holder) => {
            let renewed = spec.renew_time.as_ref().map_or(i64::MIN / 2, |t| t.0.as_millisecond());
            let duration_ms = i64::from(spec.lease_duration_seconds.unwrap_or(15).max(1)) * 1000;
            if renewed.saturating_add(duration_ms) < now_ms {
                Step::TakeOver
            } else {
                Step::Follow(holder.to_owned())
            }
        }
    }
}

/// The Lease spec after `step` by `me` at `now`.
pub fn next_spec(
    previous: Option<&LeaseSpec>,
    step: &Step,
    me: &str,
    now: Timestamp,
    duration: Duration,
) -> LeaseSpec {
    let mut spec = previous.cloned().unwrap_or_default();
    spec.holder_identity = Some(me.to_owned());
    spec.lease_duration_seconds = Some(duration.as_secs().clamp(1, i32::MAX as u64) as i32);
    spec.renew_time = Some(MicroTime(now));
    if matches!(step, Step::Create | Step::TakeOver) {
        spec.acquire_time = Some(MicroTime(now));
        if *step == Step::TakeOver {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        } else {
            spec.lease_transitions = Some(0);
        }
    }
    spec
}

/// Lease timing.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// How long a holder's renewal counts.
    pub lease: Duration,
    /// A leader that has not renewed for this long stops deciding (must be below `lease`).
    pub renew_deadline: Duration,
    /// How often to try.
    pub retry: Duration,
}

/// One attempt: reads the Lease and writes it if this step calls for it; returns whether we lead.
async fn attempt(api: &Api<Lease>, name: &str, me: &str, timing: Timing) -> Result<bool, kube::Error> {
    let current = api.get_opt(name).await?;
    let now = Timestamp::now();
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let step = step(spec, me, now.as_millisecond());
    let next = next_spec(spec, &step, me, now, timing.lease);
    match step {
        Step::Follow(_) => Ok(false),
        Step::Create => {
            let lease = Lease {
                metadata: kube::api::ObjectMeta { name: Some(name.to_owned()), ..Default::default() },
                spec: Some(next),
            };
            api.create(&PostParams::default(), &lease).await?;
            Ok(true)
        }
        Step::Renew | Step::TakeOver => {
            let mut lease = current.unwrap_or_default();
            lease.spec = Some(next);
            // The read resourceVersion stays in the object: a concurrent writer makes this a 409.
            api.replace(name, &PostParams::default(), &lease).await?;
            Ok(true)
        }
    }
}

/// Runs the election until the process ends, keeping `leader` up to date.
pub async fn run(api: Api<Lease>, name: String, me: String, timing: Timing, leader: Arc<AtomicBool>) {
    let mut last_renewal: Option<Instant> = None;
    loop {
        match attempt(&api, &name, &me, timing).await {
            Ok(true) => {
                if !leader.swap(true, Ordering::SeqCst) {
                    tracing::info!(lease = %name, identity = %me, "became the leader");
                }
                last_renewal = Some(Instant::now());
            }
            Ok(false) => {
                if leader.swap(false, Ordering::SeqCst) {
                    tracing::warn!(lease = %name, "another replica holds the lease; stopped deciding");
                }
            }
            Err(e) => {
                tracing::warn!(lease = %name, error = %e, "lease update failed");
                if last_renewal.is_none_or(|t| t.elapsed() >= timing.renew_deadline)
                    && leader.swap(false, Ordering::SeqCst)
                {
                    tracing::warn!(lease = %name, "could not renew within the deadline; stopped deciding");
                }
            }
        }
        tokio::time::sleep(timing.retry).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(by: &str, renewed_ms: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(by.into()),
            renew_time: Some(MicroTime(Timestamp::from_millisecond(renewed_ms).unwrap())),
            lease_duration_seconds: Some(15),
            lease_transitions: Some(2),
            ..Default::default()
        }
    }

    mod api {
        //! The requests of one attempt, against a fake API server (tower-test).
        use super::super::*;
        use http::{Request, Response};
        use kube::client::Body;
        use serde_json::{Value, json};

        fn respond(code: u16, value: Value) -> Response<Body> {
            Response::builder().status(code).body(Body::from(serde_json::to_vec(&value).unwrap())).unwrap()
        }

        const TIMING: Timing = Timing {
            lease: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry: Duration::from_secs(2),
        };

        #[tokio::test]
        async fn an_absent_lease_is_created_by_us() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let server = tokio::spawn(async move {
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l")
                );
                send.send_response(respond(404, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("POST", "/apis/coordination.k8s.io/v1/namespaces/ns/leases")
                );
                let body: Value =
                    serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
                assert_eq!(body["spec"]["holderIdentity"], "me");
                assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
                send.send_response(respond(201, body));
            });
            assert!(attempt(&api, "l", "me", TIMING).await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test]
        async fn an_expired_lease_is_taken_over_with_its_resource_version() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let server = tokio::spawn(async move {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(respond(200, json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "l", "namespace": "ns", "resourceVersion": "77"},
                    "spec": {"holderIdentity": "other", "renewTime": "2020-01-01T00:00:00.000000Z", "leaseDurationSeconds": 15, "leaseTransitions": 4}})));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l")
                );
                let body: Value =
                    serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
                assert_eq!(body["metadata"]["resourceVersion"], "77");
                assert_eq!(
                    (body["spec"]["holderIdentity"].as_str(), body["spec"]["leaseTransitions"].as_i64()),
                    (Some("me"), Some(5))
                );
                send.send_response(respond(200, body));
            });
            assert!(attempt(&api, "l", "me", TIMING).await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test]
        async fn a_live_lease_of_another_replica_writes_nothing() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let now = Timestamp::now().to_string();
            let server = tokio::spawn(async move {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(respond(
                    200,
                    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "l", "namespace": "ns", "resourceVersion": "1"},
                    "spec": {"holderIdentity": "other", "renewTime": now, "leaseDurationSeconds": 15}}),
                ));
            });
            assert!(!attempt(&api, "l", "me", TIMING).await.unwrap());
            server.await.unwrap();
        }
    }

    #[test]
    fn an_absent_lease_is_created_and_our_own_is_renewed() {
        assert_eq!(step(None, "a", 0), Step::Create);
        assert_eq!(step(Some(&held("a", 0)), "a", 1_000_000), Step::Renew);
    }

    #[test]
    fn a_live_lease_of_another_replica_is_followed_until_it_expires() {
        let lease = held("b", 100_000);
        assert_eq!(step(Some(&lease), "a", 114_999), Step::Follow("b".into()));
        assert_eq!(step(Some(&lease), "a", 115_000), Step::Follow("b".into()));
        assert_eq!(step(Some(&lease), "a", 115_001), Step::TakeOver);
        assert_eq!(step(Some(&LeaseSpec::default()), "a", 0), Step::TakeOver);
    }

    #[test]
    fn a_take_over_counts_a_transition_and_a_renewal_does_not() {
        let now = Timestamp::from_second(1_000).unwrap();
        let lease = held("b", 0);
        let taken = next_spec(Some(&lease), &Step::TakeOver, "a", now, Duration::from_secs(15));
        assert_eq!((taken.holder_identity.as_deref(), taken.lease_transitions), (Some("a"), Some(3)));
        assert_eq!(taken.acquire_time, Some(MicroTime(now)));
        let renewed = next_spec(Some(&taken), &Step::Renew, "a", now, Duration::from_secs(15));
        assert_eq!(renewed.lease_transitions, Some(3));
        let created = next_spec(None, &Step::Create, "a", now, Duration::from_secs(15));
        assert_eq!((created.lease_transitions, created.lease_duration_seconds), (Some(0), Some(15)));
    }
}
