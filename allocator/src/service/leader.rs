//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several replicas exactly one decides.
//!
//! Every `retry` the replica reads the Lease and creates it, renews it (it holds it), takes it over (its
//! holder has not renewed for a lease duration) or follows. Writes are replaces with the read
//! resourceVersion, so two replicas cannot both win a take-over.
//!
//! Time is judged as client-go judges it: a follower never compares the holder's `renewTime` with its
//! own clock (the clocks of two machines differ); it notes when, by its own monotonic clock, it last saw
//! the Lease record change ([`Observation`]), and takes over only when the record has stood still for
//! a whole lease duration (its own configured one, whatever the Lease says).
//!
//! Leadership lapses by itself ([`Leadership`]): a renewal that succeeds lets the replica decide until
//! `renew_deadline` after that attempt began, well before any other replica may take over. A leader
//! whose API calls hang, or whose process is frozen (SIGSTOP) and later resumed, finds its leadership
//! expired and decides nothing until it renews; every attempt also has a timeout.
//!
//! In the shipped install kube-scheduler runs in the allocator's pod and calls it on loopback, so the
//! replica that decides must be the one whose kube-scheduler leads: with [`Election::follow`] a replica
//! contends for the Lease only while the holder of kube-scheduler's own Lease is its pod's
//! kube-scheduler (`<pod name>_<uuid>`), and gives the Lease up when it is not. The Lease above stays
//! what makes the decider unique; following only moves it to where the calls come from.
//!
//! The leader's pod carries a label ([`LeaderLabel`]) that shows operators which replica decides; at
//! shutdown a leader gives the Lease and the label up, so another replica leads at its next attempt.

mod label;

pub use label::{LEADER_LABEL, LeaderLabel};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Whether this replica may decide now. Without election it always may; with election only until the
/// deadline its last successful renewal set. It also counts the decisions in flight ([`Decision`]), so
/// that a leader that stops waits for its last writes to land before it gives the Lease up.
#[derive(Debug)]
pub struct Leadership {
    lead: Mutex<Lead>,
    in_flight: tokio::sync::watch::Sender<usize>,
}

/// One decision in flight (a bind, from its first read to its last write), counted while it lives.
#[derive(Debug)]
pub struct Decision<'a>(&'a Leadership);

impl Drop for Decision<'_> {
    fn drop(&mut self) {
        self.0.in_flight.send_modify(|n| *n -= 1);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lead {
    /// No election: the only replica.
    Always,
    /// Elected, until this instant (the monotonic clock of this process).
    Until(Instant),
    /// Not the leader.
    Not,
}

impl Leadership {
    /// No election: this replica always decides.
    pub fn always() -> Self {
        Self::starting(Lead::Always)
    }

    /// Elected: a follower until [`run`] wins the Lease.
    pub fn elected() -> Self {
        Self::starting(Lead::Not)
    }

    fn starting(lead: Lead) -> Self {
        Leadership { lead: Mutex::new(lead), in_flight: tokio::sync::watch::Sender::new(0) }
    }

    fn lead(&self) -> std::sync::MutexGuard<'_, Lead> {
        self.lead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a decision if this replica leads now; it counts until the returned guard drops. The
    /// decision still checks [`Leadership::is_leader`] before each write.
    pub fn decide(&self) -> Option<Decision<'_>> {
        if !self.is_leader() {
            return None;
        }
        self.in_flight.send_modify(|n| *n += 1);
        Some(Decision(self))
    }

    /// Waits until no decision is in flight, at most `limit`; returns whether none is.
    pub async fn settled(&self, limit: Duration) -> bool {
        let mut count = self.in_flight.subscribe();
        matches!(tokio::time::timeout(limit, count.wait_for(|n| *n == 0)).await, Ok(Ok(_)))
    }

    /// Whether this replica may decide at this moment.
    pub fn is_leader(&self) -> bool {
        match *self.lead() {
            Lead::Always => true,
            Lead::Until(t) => Instant::now() < t,
            Lead::Not => false,
        }
    }

    /// Leads until `until`; returns whether it did not lead just before.
    pub(crate) fn hold_until(&self, until: Instant) -> bool {
        let was = self.is_leader();
        let mut lead = self.lead();
        if *lead != Lead::Always {
            *lead = Lead::Until(until);
        }
        !was
    }

    /// Stops deciding (another replica holds the Lease); returns whether it led just before.
    pub fn step_down(&self) -> bool {
        let was = self.is_leader();
        let mut lead = self.lead();
        if *lead != Lead::Always {
            *lead = Lead::Not;
        }
        was
    }
}

/// What a replica does with the Lease it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// There is no Lease: create it, held by us.
    Create,
    /// We hold it: renew it.
    Renew,
    /// Its holder let it expire (or it names none): take it over.
    TakeOver,
    /// Someone else holds it.
    Follow(String),
}

/// What identifies one write of the Lease by its holder: holder, renew time, transitions, acquire time.
type Record = (Option<String>, Option<MicroTime>, Option<i32>, Option<MicroTime>);

/// The Lease record as last seen by this replica, and since when (by its own clock).
#[derive(Clone, Debug, Default)]
pub struct Observation(Option<(Record, Instant)>);

impl Observation {
    /// Notes `spec` (None: no Lease) as seen at `now`; returns since when its record has stood still.
    fn note(&mut self, spec: Option<&LeaseSpec>, now: Instant) -> Instant {
        let Some(spec) = spec else {
            self.0 = None;
            return now;
        };
        let record = (
            spec.holder_identity.clone(),
            spec.renew_time.clone(),
            spec.lease_transitions,
            spec.acquire_time.clone(),
        );
        match &self.0 {
            Some((seen, since)) if *seen == record => *since,
            _ => {
                self.0 = Some((record, now));
                now
            }
        }
    }
}

/// The decision for `lease` (None: absent) by replica `me` at `now` (this process's monotonic clock),
/// with leases lasting `duration`. Updates `seen` with the record and when it last changed.
pub fn step(
    lease: Option<&LeaseSpec>,
    me: &str,
    seen: &mut Observation,
    now: Instant,
    duration: Duration,
) -> Step {
    let since = seen.note(lease, now);
    let Some(spec) = lease else { return Step::Create };
    match spec.holder_identity.as_deref() {
        Some(h) if h == me => Step::Renew,
        None | Some("") => Step::TakeOver,
        Some(holder) => {
            if now.saturating_duration_since(since) > duration {
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
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1).max(1));
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
    /// A leader decides for this long after an attempt that renewed (must be below `lease`).
    pub renew_deadline: Duration,
    /// How often to try.
    pub retry: Duration,
}

impl Timing {
    /// How long one API call of the election may take.
    pub fn call_limit(&self) -> Duration {
        self.renew_deadline.min(self.lease / 2).max(Duration::from_millis(100))
    }
}

/// Why an attempt did not say who leads.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    /// The API server refused or failed.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// The API server did not answer in time.
    #[error("the API server did not answer within {0:?}")]
    Timeout(Duration),
}

/// One attempt: reads the Lease and writes it if this step calls for it; returns whether we lead.
///
/// `mine` is the Lease as this replica last wrote it: while it holds the Lease it renews from that,
/// without reading first (client-go's optimistic renewal), so that a renewal is one round trip to a
/// slow API server, not two. The written resourceVersion goes with it: a Lease anyone wrote since
/// makes it a 409, and the attempt reads the Lease and decides as usual.
async fn attempt(
    api: &Api<Lease>,
    name: &str,
    me: &str,
    timing: Timing,
    seen: &mut Observation,
    mine: &mut Option<Lease>,
) -> Result<bool, kube::Error> {
    if let Some(mut lease) = mine.take() {
        lease.spec = Some(next_spec(lease.spec.as_ref(), &Step::Renew, me, Timestamp::now(), timing.lease));
        match api.replace(name, &PostParams::default(), &lease).await {
            Ok(written) => {
                seen.note(written.spec.as_ref(), Instant::now());
                *mine = Some(written);
                return Ok(true);
            }
            Err(e) => tracing::debug!(lease = %name, error = %e, "renewal without a read failed; reading"),
        }
    }
    let current = api.get_opt(name).await?;
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let step = step(spec, me, seen, Instant::now(), timing.lease);
    let next = next_spec(spec, &step, me, Timestamp::now(), timing.lease);
    let written = match step {
        Step::Follow(_) => return Ok(false),
        Step::Create => {
            let lease = Lease {
                metadata: kube::api::ObjectMeta { name: Some(name.to_owned()), ..Default::default() },
                spec: Some(next),
            };
            api.create(&PostParams::default(), &lease).await?
        }
        Step::Renew | Step::TakeOver => {
            let mut lease = current.unwrap_or_default();
            lease.spec = Some(next);
            // The read resourceVersion stays in the object: a concurrent writer makes this a 409.
            api.replace(name, &PostParams::default(), &lease).await?
        }
    };
    *mine = Some(written);
    Ok(true)
}

/// [`attempt`] with a timeout (a hung call ends as an error, never holds the loop).
async fn attempt_in_time(
    api: &Api<Lease>,
    name: &str,
    me: &str,
    timing: Timing,
    seen: &mut Observation,
    mine: &mut Option<Lease>,
) -> Result<bool, AttemptError> {
    let limit = timing.call_limit();
    match tokio::time::timeout(limit, attempt(api, name, me, timing, seen, mine)).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(AttemptError::Timeout(limit)),
    }
}

/// One replica's part in the election: the Lease (`api`, `name`), its identity `me`, the timing, and
/// the leader label of its pod (if it knows its pod).
pub struct Election {
    /// Leases of the Lease's namespace.
    pub api: Api<Lease>,
    /// The Lease's name.
    pub name: String,
    /// This replica's identity (its pod's name).
    pub me: String,
    /// Lease timing.
    pub timing: Timing,
    /// The leader label of this replica's pod.
    pub label: Option<LeaderLabel>,
    /// kube-scheduler's Lease (same namespace): contend only while this pod's kube-scheduler holds it.
    pub follow: Option<String>,
    /// What a replica that just won the Lease waits for before it decides (within the limit it is
    /// given; false: not yet): its view holding what the previous leader wrote. None: nothing.
    pub catch_up: Option<CatchUp>,
}

/// See [`Election::catch_up`].
pub type CatchUp = Box<dyn Fn(Duration) -> futures::future::BoxFuture<'static, bool> + Send + Sync>;

/// How long a leader that stops waits for its decisions in flight (a bind's last API call, bounded by
/// [`CALL_TIMEOUT`](crate::service::bind_api::CALL_TIMEOUT)) before it gives the Lease up: the next leader must
/// find every write of this one made.
pub const SETTLE: Duration = Duration::from_secs(crate::service::bind_api::CALL_TIMEOUT.as_secs() + 1);

/// Stops deciding; once the decisions in flight ended (at most [`SETTLE`]), returns whether this
/// replica led.
async fn stop_deciding(leadership: &Leadership) -> bool {
    if !leadership.step_down() {
        return false;
    }
    if !leadership.settled(SETTLE).await {
        tracing::warn!("a decision was still in flight after {SETTLE:?}; giving the lease up anyway");
    }
    true
}

/// Whether `holder` of kube-scheduler's Lease is the kube-scheduler of pod `me`: kube-scheduler names
/// itself `<hostname>_<uuid>`, and a pod's hostname is its name.
pub fn scheduler_of(holder: Option<&str>, me: &str) -> bool {
    holder.and_then(|h| h.strip_prefix(me)).is_some_and(|rest| rest.starts_with('_'))
}

/// Whether this pod's kube-scheduler holds `lease`; None when the API server did not say within `limit`.
async fn our_scheduler_leads(api: &Api<Lease>, lease: &str, me: &str, limit: Duration) -> Option<bool> {
    match tokio::time::timeout(limit, api.get_opt(lease)).await {
        Ok(Ok(found)) => {
            let holder = found.and_then(|l| l.spec).and_then(|s| s.holder_identity);
            Some(scheduler_of(holder.as_deref(), me))
        }
        Ok(Err(e)) => {
            tracing::warn!(lease = %lease, error = %e, "reading kube-scheduler's lease failed");
            None
        }
        Err(_) => {
            tracing::warn!(lease = %lease, "reading kube-scheduler's lease took over {limit:?}");
            None
        }
    }
}

/// Runs the election from when `start` resolves until `stop` resolves, keeping `leadership` (and the
/// leader label, if any) up to date; then gives the Lease and the label up. `start` is the view
/// having listed the whole cluster: a replica that (re)started must not decide with half a view,
/// even under the name that holds the Lease.
pub async fn run(
    election: Election,
    leadership: Arc<Leadership>,
    start: impl std::future::Future<Output = ()>,
    stop: impl std::future::Future<Output = ()>,
) {
    let Election { api, name, me, timing, mut label, follow, catch_up } = election;
    let mut seen = Observation::default();
    let mut mine: Option<Lease> = None;
    tokio::pin!(stop);
    tokio::select! {
        _ = start => {}
        _ = &mut stop => return,
    }
    loop {
        let began = Instant::now();
        let contend = match &follow {
            None => true,
            // Unknown: a leader renews on (its scheduler most likely leads still), a follower waits.
            Some(scheduler) => our_scheduler_leads(&api, scheduler, &me, timing.call_limit())
                .await
                .unwrap_or_else(|| leadership.is_leader()),
        };
        if !contend {
            if stop_deciding(&leadership).await {
                tracing::info!(lease = %name, "this pod's kube-scheduler does not lead; stopped deciding");
            }
            // Still watched, so that a take-over when our scheduler leads need not wait a whole lease
            // more; and given up if it names us.
            mine = None;
            give_up(&api, &name, &me, timing.call_limit(), &mut seen).await;
        } else {
            // A renewal counts from when its own attempt began (the write lands after it, so no
            // other replica may take over before that plus a lease), not from the round's start:
            // with seconds of latency, the reads before it would eat the deadline and leadership
            // would lapse between renewals.
            let attempt_began = Instant::now();
            match attempt_in_time(&api, &name, &me, timing, &mut seen, &mut mine).await {
                Ok(true) => {
                    // Newly leading: only once the view holds what the last leader wrote.
                    let ready = leadership.is_leader()
                        || match &catch_up {
                            Some(catch_up) => catch_up(timing.call_limit()).await,
                            None => true,
                        };
                    if !ready {
                        tracing::warn!(lease = %name, "holds the lease, but its view has not caught up yet");
                    } else if leadership.hold_until(attempt_began + timing.renew_deadline) {
                        tracing::info!(lease = %name, identity = %me, "became the leader");
                    }
                }
                Ok(false) => {
                    if leadership.step_down() {
                        tracing::warn!(lease = %name, "another replica holds the lease; stopped deciding");
                    }
                }
                // Leadership lapses by itself at its deadline unless a later attempt renews it.
                Err(e) => tracing::warn!(lease = %name, error = %e, "lease update failed"),
            }
        }
        if let Some(label) = label.as_mut() {
            label.reconcile(leadership.is_leader(), timing.call_limit()).await;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(began + timing.retry) => {}
            _ = &mut stop => break,
        }
    }
    if stop_deciding(&leadership).await {
        give_up(&api, &name, &me, timing.call_limit(), &mut seen).await;
    }
    if let Some(label) = label.as_mut() {
        label.reconcile(false, timing.call_limit()).await;
    }
}

/// The Lease spec that gives it up, when `me` holds `lease`: no holder, which the other replicas take
/// over at their next attempt instead of after a lease duration (client-go's release on cancel).
pub fn released(lease: Option<&LeaseSpec>, me: &str) -> Option<LeaseSpec> {
    let spec = lease.filter(|s| s.holder_identity.as_deref() == Some(me))?;
    Some(LeaseSpec { holder_identity: None, ..spec.clone() })
}

/// Reads the Lease (noting its record in `seen`) and gives it up if it names `me` (at shutdown, or
/// while this pod's kube-scheduler does not lead), so another replica leads at its next attempt; the
/// caller stopped deciding first. Within `limit`; a failure only means the others wait out the lease.
async fn give_up(api: &Api<Lease>, name: &str, me: &str, limit: Duration, seen: &mut Observation) {
    let give_up = async {
        let Some(mut lease) = api.get_opt(name).await? else { return Ok(false) };
        seen.note(lease.spec.as_ref(), Instant::now());
        let Some(spec) = released(lease.spec.as_ref(), me) else { return Ok(false) };
        lease.spec = Some(spec);
        // With the read resourceVersion: a replica that took over meanwhile keeps the Lease.
        api.replace(name, &PostParams::default(), &lease).await.map(|_| true)
    };
    match tokio::time::timeout(limit, give_up).await {
        Ok(Ok(true)) => tracing::info!(lease = %name, "gave the lease up"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => tracing::warn!(lease = %name, error = %e, "could not give the lease up"),
        Err(_) => tracing::warn!(lease = %name, "could not give the lease up within {limit:?}"),
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
        use crate::api_replies::{body_json, failure, respond};
        use http::{Request, Response};
        use kube::client::Body;
        use serde_json::json;

        const TIMING: Timing = Timing {
            lease: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry: Duration::from_secs(2),
        };

        /// Lease `name` of namespace "ns" at resourceVersion `rv`, with `spec`, as the API server
        /// returns it.
        fn lease(name: &str, rv: &str, spec: serde_json::Value) -> serde_json::Value {
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv}, "spec": spec})
        }

        /// Replica "me" in the election for Lease "l", without a label.
        fn election(api: Api<Lease>) -> Election {
            Election {
                api,
                name: "l".into(),
                me: "me".into(),
                timing: TIMING,
                label: None,
                follow: None,
                catch_up: None,
            }
        }

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
                send.send_response(failure(404, "NotFound"));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("POST", "/apis/coordination.k8s.io/v1/namespaces/ns/leases")
                );
                let body = body_json(req).await;
                assert_eq!(body["spec"]["holderIdentity"], "me");
                assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
                send.send_response(respond(201, body));
            });
            assert!(attempt(&api, "l", "me", TIMING, &mut Observation::default(), &mut None).await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test]
        async fn an_expired_lease_is_taken_over_with_its_resource_version() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let server = tokio::spawn(async move {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(respond(200, lease("l", "77", json!({"holderIdentity": "other", "renewTime": "2020-01-01T00:00:00.000000Z", "leaseDurationSeconds": 15, "leaseTransitions": 4}))));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l")
                );
                let body = body_json(req).await;
                assert_eq!(body["metadata"]["resourceVersion"], "77");
                assert_eq!(
                    (body["spec"]["holderIdentity"].as_str(), body["spec"]["leaseTransitions"].as_i64()),
                    (Some("me"), Some(5))
                );
                send.send_response(respond(200, body));
            });
            // The record has stood still for longer than a lease, by this replica's own clock.
            let mut seen = Observation::default();
            let old = LeaseSpec {
                holder_identity: Some("other".into()),
                renew_time: Some(MicroTime("2020-01-01T00:00:00Z".parse().unwrap())),
                lease_transitions: Some(4),
                ..Default::default()
            };
            let long_ago = Instant::now() - Duration::from_secs(20);
            step(Some(&old), "me", &mut seen, long_ago, TIMING.lease);
            assert!(attempt(&api, "l", "me", TIMING, &mut seen, &mut None).await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test(start_paused = true)]
        async fn a_leader_whose_renewals_hang_stops_deciding_by_its_deadline() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let server = tokio::spawn(async move {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(failure(404, "NotFound"));
                let (req, send) = handle.next_request().await.unwrap();
                let body = body_json(req).await;
                send.send_response(respond(201, body));
                // From now on the API server accepts requests and never answers them.
                let mut hanging = Vec::new();
                while let Some((_, send)) = handle.next_request().await {
                    hanging.push(send);
                }
            });
            let leadership = Arc::new(Leadership::elected());
            let election = tokio::spawn(run(
                election(api),
                leadership.clone(),
                std::future::ready(()),
                std::future::pending(),
            ));
            while !leadership.is_leader() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let elected = Instant::now();
            while leadership.is_leader() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let led = elected.elapsed();
            assert!(led <= TIMING.renew_deadline, "decided for {led:?} without a renewal");
            assert!(led < TIMING.lease, "another replica could take over after {:?}", TIMING.lease);
            election.abort();
            server.abort();
        }

        #[tokio::test]
        async fn a_replica_whose_view_has_not_listed_everything_does_not_even_try_to_lead() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let leadership = Arc::new(Leadership::elected());
            let stop = tokio::time::sleep(Duration::from_millis(100));
            run(election(api), leadership.clone(), std::future::pending(), stop).await;
            assert!(!leadership.is_leader());
            assert!(handle.next_request().await.is_none(), "no request to the API server");
        }

        #[tokio::test]
        async fn a_stopped_leader_gives_the_lease_up_and_stops_deciding() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(failure(404, "NotFound"));
                let (req, send) = handle.next_request().await.unwrap();
                let created = body_json(req).await;
                send.send_response(respond(201, created.clone()));
                stop.send(()).unwrap();
                // The release: the Lease read, then written back naming no holder.
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method().as_str(), "GET");
                let mut held = created.clone();
                held["metadata"]["resourceVersion"] = json!("7");
                send.send_response(respond(200, held));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method().as_str(), req.uri().path()),
                    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l")
                );
                let body = body_json(req).await;
                assert_eq!(body["metadata"]["resourceVersion"], "7", "written over what was read");
                assert_eq!(body["spec"].get("holderIdentity"), None, "{body}");
                assert_eq!(body["spec"]["acquireTime"], created["spec"]["acquireTime"]);
                send.send_response(respond(200, body));
            });
            let leadership = Arc::new(Leadership::elected());
            let stop = async {
                let _ = stopped.await;
            };
            run(election(api), leadership.clone(), std::future::ready(()), stop).await;
            server.await.unwrap();
            assert!(!leadership.is_leader(), "a replica that gave the lease up decides nothing");
        }

        #[tokio::test(start_paused = true)]
        async fn a_stopping_leader_lets_its_binds_in_flight_end_before_it_gives_the_lease_up() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let leadership = Arc::new(Leadership::elected());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let election =
                tokio::spawn(run(election(api), leadership.clone(), std::future::ready(()), async {
                    let _ = stopped.await;
                }));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(failure(404, "NotFound"));
            let (req, send) = handle.next_request().await.unwrap();
            let created = body_json(req).await;
            send.send_response(respond(201, created.clone()));
            while !leadership.is_leader() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let bind = leadership.decide().expect("the leader decides");
            stop.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(leadership.decide().is_none(), "a stopping leader starts no decision");
            let early = tokio::time::timeout(Duration::from_secs(5), handle.next_request()).await;
            assert!(early.is_err(), "the lease was given up while a bind was in flight");
            drop(bind);
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method().as_str(), "GET");
            send.send_response(respond(200, created));
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method().as_str(), "PUT");
            let body = body_json(req).await;
            assert_eq!(body["spec"].get("holderIdentity"), None, "{body}");
            send.send_response(respond(200, body));
            election.await.unwrap();
        }

        #[tokio::test(start_paused = true)]
        async fn a_replica_that_wins_the_lease_decides_only_once_its_view_caught_up() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let leadership = Arc::new(Leadership::elected());
            let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let mut part = election(api);
            let counted = calls.clone();
            // Not caught up at the first try, caught up at the second.
            part.catch_up = Some(Box::new(move |_| {
                let calls = counted.clone();
                Box::pin(async move { calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 1 })
            }));
            let election =
                tokio::spawn(run(part, leadership.clone(), std::future::ready(()), std::future::pending()));
            let calls_now = || calls.load(std::sync::atomic::Ordering::SeqCst);
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(failure(404, "NotFound"));
            let (req, send) = handle.next_request().await.unwrap();
            let mut held = body_json(req).await;
            send.send_response(respond(201, held.clone()));
            // Each later attempt: the Lease read (ours), then renewed.
            for round in 1..=3 {
                let (_, send) = handle.next_request().await.unwrap();
                assert_eq!(leadership.is_leader(), round > 1, "round {round}");
                assert_eq!(calls_now(), round.min(2), "a catch-up per attempt until one succeeds, then none");
                held["metadata"]["resourceVersion"] = json!(round.to_string());
                send.send_response(respond(200, held.clone()));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method().as_str(), "PUT");
                send.send_response(respond(200, body_json(req).await));
            }
            let (_, _send) = handle.next_request().await.unwrap();
            assert!(leadership.is_leader());
            assert_eq!(calls_now(), 2);
            election.abort();
        }

        #[tokio::test(start_paused = true)]
        async fn a_replica_leads_only_while_its_pods_kube_scheduler_does() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let leadership = Arc::new(Leadership::elected());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let watched = leadership.clone();
            let server = tokio::spawn(async move {
                let scheduler = |holder: &str| {
                    respond(
                        200,
                        lease("sched", "3", json!({"holderIdentity": holder, "leaseDurationSeconds": 15})),
                    )
                };
                // Our pod's kube-scheduler leads: the Lease is created, held by us.
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/apis/coordination.k8s.io/v1/namespaces/ns/leases/sched");
                send.send_response(scheduler("me_6f1c"));
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(failure(404, "NotFound"));
                let (req, send) = handle.next_request().await.unwrap();
                let created = body_json(req).await;
                send.send_response(respond(201, created.clone()));
                // Another pod's kube-scheduler took over (a pod named "me2" is not us): we give up.
                let (_, send) = handle.next_request().await.unwrap();
                assert!(watched.is_leader());
                send.send_response(scheduler("me2_0a9b"));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!((req.method().as_str(), req.uri().path().ends_with("/leases/l")), ("GET", true));
                assert!(!watched.is_leader(), "still deciding while another pod's scheduler leads");
                send.send_response(respond(200, created));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method().as_str(), "PUT");
                let body = body_json(req).await;
                assert_eq!(body["spec"].get("holderIdentity"), None, "{body}");
                send.send_response(respond(200, body.clone()));
                // Still not ours: the Lease is read (watched, for a prompt take-over later), not written.
                let (req, send) = handle.next_request().await.unwrap();
                assert!(req.uri().path().ends_with("/leases/sched"));
                send.send_response(scheduler("me2_0a9b"));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!((req.method().as_str(), req.uri().path().ends_with("/leases/l")), ("GET", true));
                let mut other = body.clone();
                other["spec"]["holderIdentity"] = json!("me2");
                send.send_response(respond(200, other));
                stop.send(()).unwrap();
                assert!(handle.next_request().await.is_none(), "nothing more to give up at stop");
            });
            let mut part = election(api);
            part.follow = Some("sched".into());
            let stop = async {
                let _ = stopped.await;
            };
            run(part, leadership.clone(), std::future::ready(()), stop).await;
            assert!(!leadership.is_leader());
            drop(leadership);
            server.await.unwrap();
        }

        /// A fake API server of Leases in namespace `ns` (GET, POST, PUT with resourceVersion
        /// checks), each request taking `each_way` to arrive and as long for its answer.
        fn slow_leases(
            mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
            each_way: Duration,
            leases: Arc<Mutex<std::collections::HashMap<String, serde_json::Value>>>,
        ) -> tokio::task::JoinHandle<()> {
            tokio::spawn(async move {
                while let Some((req, send)) = handle.next_request().await {
                    let leases = leases.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(each_way).await;
                        let method = req.method().clone();
                        let path = req.uri().path().to_owned();
                        let body = body_json(req).await;
                        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
                        let answer = {
                            let mut leases = leases.lock().unwrap();
                            let rv = |l: &serde_json::Value| {
                                l["metadata"]["resourceVersion"].as_str().map(str::to_owned)
                            };
                            match method.as_str() {
                                "GET" => match leases.get(&name) {
                                    Some(lease) => respond(200, lease.clone()),
                                    None => failure(404, "NotFound"),
                                },
                                "POST" => {
                                    let mut lease = body;
                                    let name = lease["metadata"]["name"].as_str().unwrap().to_owned();
                                    lease["metadata"]["resourceVersion"] = json!("1");
                                    leases.insert(name, lease.clone());
                                    respond(201, lease)
                                }
                                _ => match leases.get(&name) {
                                    Some(stored) if rv(stored) == rv(&body) => {
                                        let next = rv(stored).unwrap().parse::<u64>().unwrap() + 1;
                                        let mut lease = body;
                                        lease["metadata"]["resourceVersion"] = json!(next.to_string());
                                        leases.insert(name, lease.clone());
                                        respond(200, lease)
                                    }
                                    _ => failure(409, "Conflict"),
                                },
                            }
                        };
                        tokio::time::sleep(each_way).await;
                        send.send_response(answer);
                    });
                }
            })
        }

        /// The fault suite's slow API (a second each way): the renewal counts from its own start and
        /// is one round trip, so leadership holds from one to the next. It lapsed every round when
        /// it counted from before the read of kube-scheduler's Lease and renewed after a read: the
        /// leader answered "not the leader" to most of kube-scheduler's calls and the burst stalled.
        #[tokio::test(start_paused = true)]
        async fn a_leader_behind_a_slow_api_server_leads_without_a_break() {
            let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let leases = Arc::new(Mutex::new(std::collections::HashMap::from([(
                "sched".to_owned(),
                lease("sched", "1", json!({"holderIdentity": "me_6f1c", "leaseDurationSeconds": 15})),
            )])));
            let server = slow_leases(handle, Duration::from_secs(1), leases.clone());
            let leadership = Arc::new(Leadership::elected());
            let mut part = election(api);
            part.follow = Some("sched".into());
            let election =
                tokio::spawn(run(part, leadership.clone(), std::future::ready(()), std::future::pending()));
            while !leadership.is_leader() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let elected = Instant::now();
            while elected.elapsed() < Duration::from_secs(120) {
                assert!(leadership.is_leader(), "leadership lapsed {:?} after it began", elected.elapsed());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let renewals =
                leases.lock().unwrap()["l"]["metadata"]["resourceVersion"].as_str().unwrap().to_owned();
            assert!(renewals.parse::<u64>().unwrap() > 20, "renewed {renewals} times in 2 minutes");
            election.abort();
            server.abort();
        }

        /// A Lease another replica wrote since our last renewal (taken over while we were frozen)
        /// makes the renewal without a read a 409: the attempt reads it and follows.
        #[tokio::test]
        async fn a_renewal_without_a_read_that_conflicts_reads_and_follows() {
            let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "default"), "ns");
            let now = Timestamp::now().to_string();
            let server = tokio::spawn(async move {
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method().as_str(), "PUT");
                assert_eq!(body_json(req).await["metadata"]["resourceVersion"], "5");
                send.send_response(failure(409, "Conflict"));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method().as_str(), "GET");
                send.send_response(respond(
                    200,
                    lease(
                        "l",
                        "6",
                        json!({"holderIdentity": "other", "renewTime": now, "leaseDurationSeconds": 15}),
                    ),
                ));
            });
            let mut mine: Option<Lease> = Some(
                serde_json::from_value(lease(
                    "l",
                    "5",
                    json!({"holderIdentity": "me", "leaseDurationSeconds": 15}),
                ))
                .unwrap(),
            );
            let mut seen = Observation::default();
            assert!(!attempt(&api, "l", "me", TIMING, &mut seen, &mut mine).await.unwrap());
            assert!(mine.is_none());
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
                    lease(
                        "l",
                        "1",
                        json!({"holderIdentity": "other", "renewTime": now, "leaseDurationSeconds": 15}),
                    ),
                ));
            });
            assert!(!attempt(&api, "l", "me", TIMING, &mut Observation::default(), &mut None).await.unwrap());
            server.await.unwrap();
        }
    }

    const LEASE: Duration = Duration::from_secs(15);

    #[test]
    fn only_this_pods_kube_scheduler_is_ours() {
        assert!(scheduler_of(Some("alloc-7d9f-x2_0c3e5a"), "alloc-7d9f-x2"));
        assert!(!scheduler_of(Some("alloc-7d9f-x2b_0c3e5a"), "alloc-7d9f-x2"));
        assert!(!scheduler_of(Some("alloc-7d9f-x2"), "alloc-7d9f-x2"));
        assert!(!scheduler_of(Some(""), "alloc-7d9f-x2"));
        assert!(!scheduler_of(None, "alloc-7d9f-x2"));
    }

    #[test]
    fn an_absent_lease_is_created_and_our_own_is_renewed() {
        let (mut seen, now) = (Observation::default(), Instant::now());
        assert_eq!(step(None, "a", &mut seen, now, LEASE), Step::Create);
        assert_eq!(step(Some(&held("a", 0)), "a", &mut seen, now, LEASE), Step::Renew);
    }

    #[test]
    fn a_lease_is_taken_over_only_after_its_record_stood_still_for_a_lease_by_our_clock() {
        let (mut seen, t0) = (Observation::default(), Instant::now());
        // Renewed in 1970 by the holder's clock: nothing is concluded from that.
        let lease = held("b", 0);
        assert_eq!(step(Some(&lease), "a", &mut seen, t0, LEASE), Step::Follow("b".into()));
        assert_eq!(step(Some(&lease), "a", &mut seen, t0 + LEASE, LEASE), Step::Follow("b".into()));
        // The holder renews (its record changes): the wait starts again.
        let renewed = held("b", 1);
        let t1 = t0 + LEASE + Duration::from_millis(1);
        assert_eq!(step(Some(&renewed), "a", &mut seen, t1, LEASE), Step::Follow("b".into()));
        assert_eq!(step(Some(&renewed), "a", &mut seen, t1 + LEASE, LEASE), Step::Follow("b".into()));
        let later = t1 + LEASE + Duration::from_millis(1);
        assert_eq!(step(Some(&renewed), "a", &mut seen, later, LEASE), Step::TakeOver);
    }

    #[test]
    fn a_renewal_far_in_the_future_does_not_pin_a_dead_holder() {
        // A holder whose clock runs a year ahead, or a Lease edited by hand, then silence.
        let (mut seen, t0) = (Observation::default(), Instant::now());
        let mut lease = held("b", 4_102_444_800_000); // 2100-01-01
        lease.lease_duration_seconds = Some(1_000_000_000);
        assert_eq!(step(Some(&lease), "a", &mut seen, t0, LEASE), Step::Follow("b".into()));
        let after = t0 + LEASE + Duration::from_millis(1);
        assert_eq!(step(Some(&lease), "a", &mut seen, after, LEASE), Step::TakeOver);
    }

    #[test]
    fn a_lease_edited_to_name_no_holder_or_garbage_is_taken_over_at_once() {
        let (mut seen, now) = (Observation::default(), Instant::now());
        assert_eq!(step(Some(&LeaseSpec::default()), "a", &mut seen, now, LEASE), Step::TakeOver);
        let mut garbled = held("", 0);
        garbled.lease_duration_seconds = Some(-5);
        garbled.lease_transitions = Some(i32::MAX);
        assert_eq!(step(Some(&garbled), "a", &mut seen, now, LEASE), Step::TakeOver);
        let taken = next_spec(Some(&garbled), &Step::TakeOver, "a", Timestamp::now(), LEASE);
        assert_eq!((taken.lease_duration_seconds, taken.lease_transitions), (Some(15), Some(i32::MAX)));
    }

    #[tokio::test(start_paused = true)]
    async fn leadership_lapses_by_itself_at_its_deadline() {
        let l = Leadership::elected();
        assert!(!l.is_leader());
        assert!(l.hold_until(Instant::now() + Duration::from_secs(10)));
        assert!(l.is_leader());
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!l.is_leader(), "no renewal: no leadership");
        let only = Leadership::always();
        only.step_down();
        assert!(only.is_leader(), "without election the only replica always decides");
    }

    #[test]
    fn a_released_lease_names_no_holder_and_is_taken_over_at_once() {
        let mine = held("a", 1_000);
        let given_up = released(Some(&mine), "a").unwrap();
        assert_eq!(given_up.holder_identity, None);
        assert_eq!(LeaseSpec { holder_identity: mine.holder_identity.clone(), ..given_up.clone() }, mine);
        let mut seen = Observation::default();
        assert_eq!(step(Some(&given_up), "b", &mut seen, Instant::now(), LEASE), Step::TakeOver);
        assert_eq!(released(Some(&held("b", 1_000)), "a"), None, "only the holder gives a lease up");
        assert_eq!(released(None, "a"), None);
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
