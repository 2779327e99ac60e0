//! DRA (`serve --dra`): nano-gpu allocates the ResourceClaims of its DeviceClass itself, so the
//! policy (FGD by default) chooses the node and the card of every claim, where kube-scheduler's own
//! DRA allocator would take the first device that fits.
//!
//! How: the DeviceClass `gpu.nano-gpu.io` selects no device for kube-scheduler
//! (`deploy/components/dra`), so kube-scheduler never allocates a claim of it and cannot race this.
//! The leader watches every ResourceClaim ([`watch`]) beside the pod and node watches; for each
//! pending pod whose claims are all of the class and unallocated it picks node and cards
//! ([`crate::state::ClusterState::plan_claims`]) and writes each claim's allocation ([`write`]):
//! Kubernetes' allocation finalizer first, then `status.allocation` (device, consumed capacity,
//! share ID, node selector), each conditional on the resourceVersion the choice was made on.
//! kube-scheduler then sees allocated claims, keeps the pod to that node, reserves the claims and
//! binds; the kubelet has the node's agent prepare them. A claim held by the allocation counts on its
//! card from the moment it is chosen, so back-to-back choices never double-book.
//!
//! A new leader re-lists every claim (a consistent read) before its first choice: the replica that
//! led before may have written allocations this replica's watch has not shown yet.

use crate::service::leader::Leadership;
use crate::service::watch::{LIST_PAGE, Listing, Watch, publish};
use crate::state::{ClaimWrite, SharedView};
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim, ResourceClaimTemplate};
use kube::api::{ListParams, PostParams};
use kube::runtime::events::Recorder;
use kube::runtime::watcher::Event;
use kube::{Api, Client};
use nano_gpu_proto::dra::ALLOCATED_FINALIZER;
use nano_gpu_runtime::tasks::Child;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// How often waiting pods are looked at when nothing wakes the planner earlier.
const EVERY: Duration = Duration::from_millis(500);
/// How long a template made (or found) is taken to exist without looking again.
const TEMPLATE_RECHECK: Duration = Duration::from_secs(60);
/// How long one API call of a write may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the claim watch and, while this replica leads, the allocation of waiting pods' claims.
pub async fn run(
    client: Client,
    view: Arc<SharedView>,
    leader: Arc<Leadership>,
    recorder: Recorder,
    listing: Listing,
) {
    let listed = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    let api: Api<ResourceClaim> = Api::all(client.clone());
    let claims = Watch::new(api.clone(), listing);
    let mut watching = Child::spawn("claim watch", watch(claims, view.clone(), listed.clone(), wake.clone()));
    let mut led = false;
    // The templates made (or found) lately, by (namespace, name): each is looked at again after
    // [`TEMPLATE_RECHECK`], in case it was deleted since.
    let mut made: HashMap<(String, String), tokio::time::Instant> = HashMap::new();
    loop {
        tokio::select! {
            _ = tokio::time::timeout(EVERY, wake.notified()) => {}
            () = watching.ended() => {
                tracing::error!("the claim watch ended");
                return;
            }
        }
        if !view.synced() || !listed.load(Ordering::SeqCst) {
            continue;
        }
        if !leader.is_leader() {
            led = false;
            continue;
        }
        if !led {
            match relist(&api, &view).await {
                Ok(n) => {
                    tracing::info!(
                        claims = n,
                        "leading: claims re-listed; allocating claims of nano-gpu's class"
                    );
                    led = true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "re-listing claims failed; no claim is allocated until it succeeds");
                    continue;
                }
            }
        }
        let Some(_deciding) = leader.decide() else { continue };
        let (writes, warnings, wanted, preemptions) = {
            let mut state = view.lock();
            let writes = state.plan_claims();
            (writes, state.take_warnings(), state.take_templates_wanted(), state.take_preemptions())
        };
        for w in &warnings {
            publish(&recorder, w, "Allocate").await;
        }
        for p in &preemptions {
            crate::service::preempt_evict::carry_out(&client, &view, &leader, &recorder, p).await;
        }
        made.retain(|_, at| at.elapsed() < TEMPLATE_RECHECK);
        for (namespace, name) in wanted {
            if made.contains_key(&(namespace.clone(), name.clone())) {
                continue;
            }
            match make_template(&client, &namespace, &name).await {
                Ok(()) => {
                    made.insert((namespace, name), tokio::time::Instant::now());
                }
                Err(e) => tracing::warn!(template = %format!("{namespace}/{name}"), error = %e,
                    "making a claim template failed; trying again"),
            }
        }
        for w in writes {
            let outcome = if leader.is_leader() { write(&api, &w).await } else { Err(Failure::NotLeader) };
            match outcome {
                Ok(claim) => {
                    tracing::info!(pod = %format!("{}/{}", w.pod.0, w.pod.1), claim = %w.claim.1, node = %w.node,
                        "claim allocated");
                    view.lock().written(&w, &claim);
                }
                Err(f) => {
                    match &f {
                        Failure::Changed => tracing::info!(claim = %format!("{}/{}", w.claim.0, w.claim.1),
                            "the claim changed since the choice; choosing again"),
                        other => {
                            tracing::warn!(claim = %format!("{}/{}", w.claim.0, w.claim.1), error = %other,
                            "writing a claim's allocation failed; choosing again")
                        }
                    }
                    view.lock().not_written(&w);
                }
            }
        }
    }
}

/// Feeds every ResourceClaim into the view, re-listing after a broken watch (with backoff).
async fn watch(
    mut claims: Watch<ResourceClaim>,
    view: Arc<SharedView>,
    listed: Arc<AtomicBool>,
    wake: Arc<Notify>,
) {
    loop {
        match claims.next().await {
            Ok(Some(event)) => {
                {
                    let mut state = view.lock();
                    match event {
                        Event::Init => state.begin_claim_relist(),
                        Event::InitApply(c) | Event::Apply(c) => state.apply_claim(&c),
                        Event::InitDone => {
                            state.end_claim_relist();
                            if !listed.swap(true, Ordering::SeqCst) {
                                tracing::info!("claims listed");
                            }
                        }
                        Event::Delete(c) => state.delete_claim(&c),
                    }
                }
                wake.notify_one();
            }
            Ok(None) => break,
            Err(e) => tracing::warn!(error = %e, "claim watch failed; retrying with backoff"),
        }
    }
}

/// Makes nano-gpu's ResourceClaimTemplate `name` in `namespace` (a name of
/// [`crate::decide::claim::template_name`]'s form); one that exists already is left as it is (if someone
/// else made it asking something else, the claims made from it are refused).
async fn make_template(client: &Client, namespace: &str, name: &str) -> anyhow::Result<()> {
    let Some(body) = crate::decide::claim::template(namespace, name) else {
        anyhow::bail!("{name} is not a name of nano-gpu's templates");
    };
    let template: ResourceClaimTemplate = serde_json::from_value(body)?;
    let api: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), namespace);
    match tokio::time::timeout(CALL_TIMEOUT, api.create(&PostParams::default(), &template)).await {
        Err(_) => anyhow::bail!("creating it took over {CALL_TIMEOUT:?}"),
        Ok(Ok(_)) => {
            tracing::info!(template = %format!("{namespace}/{name}"), "claim template made");
            Ok(())
        }
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(()),
        Ok(Err(e)) => Err(e.into()),
    }
}

/// A consistent list of every claim, applied to the view as a re-list; returns how many.
async fn relist(api: &Api<ResourceClaim>, view: &SharedView) -> anyhow::Result<usize> {
    // No resourceVersion: a consistent read, as of now; its pages continue the same snapshot.
    let mut params = ListParams::default().limit(LIST_PAGE);
    let mut seen = std::collections::HashSet::new();
    let mut version = None;
    loop {
        let page = tokio::time::timeout(CALL_TIMEOUT, api.list(&params))
            .await
            .map_err(|_| anyhow::anyhow!("listing claims took over {CALL_TIMEOUT:?}"))??;
        // The snapshot's version, from its first page (0: not a number, nothing is taken as gone).
        version.get_or_insert_with(|| {
            page.metadata.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        });
        {
            let mut state = view.lock();
            for c in &page.items {
                state.apply_claim(c);
                seen.extend(c.metadata.uid.clone());
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    view.lock().end_claim_snapshot(&seen, version.unwrap_or(0));
    Ok(seen.len())
}

/// Why a write did not happen.
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// The claim is not the one the choice was made on any more (changed, deleted or replaced).
    #[error("the claim changed")]
    Changed,
    /// This replica no longer leads.
    #[error("no longer the leader")]
    NotLeader,
    /// Anything else.
    #[error("{0}")]
    Api(String),
}

impl From<kube::Error> for Failure {
    fn from(e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(s) if s.code == 409 || s.code == 404 => Failure::Changed,
            _ => Failure::Api(e.to_string()),
        }
    }
}

/// Writes `w`: the allocation finalizer, then the allocation, each conditional on the claim being
/// the one the choice was made on. Returns the claim as the API server has it after.
async fn write(api: &Api<ResourceClaim>, w: &ClaimWrite) -> Result<ResourceClaim, Failure> {
    let timed = |what: &'static str| move |_| Failure::Api(format!("{what} took over {CALL_TIMEOUT:?}"));
    let api = Api::<ResourceClaim>::namespaced(api.clone().into_client(), &w.claim.0);
    let post = PostParams::default();
    let mut claim = tokio::time::timeout(CALL_TIMEOUT, api.get(&w.claim.1))
        .await
        .map_err(timed("reading the claim"))??;
    let same = claim.metadata.uid.as_deref() == Some(w.claim_uid.as_str())
        && claim.metadata.resource_version.as_deref() == Some(w.resource_version.as_str());
    if !same {
        return Err(Failure::Changed);
    }
    let finalizers = claim.metadata.finalizers.get_or_insert_with(Vec::new);
    if !finalizers.iter().any(|f| f == ALLOCATED_FINALIZER) {
        finalizers.push(ALLOCATED_FINALIZER.to_owned());
        let call = api.replace(&w.claim.1, &post, &claim);
        claim = tokio::time::timeout(CALL_TIMEOUT, call).await.map_err(timed("adding the finalizer"))??;
    }
    let mut allocation: AllocationResult = serde_json::from_value(w.allocation.clone())
        .map_err(|e| Failure::Api(format!("the allocation does not decode: {e}")))?;
    // kube-scheduler stamps an allocation without a timestamp when it reserves the claim for the pod
    // (with DRADeviceBindingConditions, on by default), and the API server refuses that as a change
    // of an allocation: the pod would never bind. Stamped here, the allocation is never changed.
    allocation.allocation_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
    claim.status.get_or_insert_with(Default::default).allocation = Some(allocation);
    let call = api.replace_status(&w.claim.1, &post, &claim);
    Ok(tokio::time::timeout(CALL_TIMEOUT, call).await.map_err(timed("writing the allocation"))??)
}

#[cfg(test)]
mod tests {
    //! The exact requests of a write, against a fake API server (tower-test).
    use super::*;
    use crate::api_replies::{body_json, failure, respond};
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::{Value, json};

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn api() -> (Api<ResourceClaim>, Handle) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (Api::all(kube::Client::new(svc, "default")), handle)
    }

    fn claim(version: &str, finalizers: Value) -> Value {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "t", "uid": "u-c", "resourceVersion": version,
                "finalizers": finalizers},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nano-gpu.io"}}]}}})
    }

    fn the_write() -> ClaimWrite {
        ClaimWrite {
            pod: ("t".into(), "p".into()),
            pod_uid: "u-p".into(),
            claim: ("t".into(), "c".into()),
            claim_uid: "u-c".into(),
            resource_version: "5".into(),
            node: "n1".into(),
            allocation: crate::decide::claim::allocation(
                "u-c",
                "n1",
                &[crate::decide::claim::Given {
                    request: "gpu".into(),
                    card: 1,
                    percent: nano_gpu_proto::units::Percent(30),
                    memory: None,
                }],
            ),
        }
    }

    async fn next(
        handle: &mut Handle,
    ) -> (String, String, Value, tower_test::mock::SendResponse<Response<Body>>) {
        let (req, send) = handle.next_request().await.unwrap();
        let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
        (method, path, body_json(req).await, send)
    }

    #[tokio::test]
    async fn a_write_adds_the_finalizer_then_the_stamped_allocation_each_on_the_version_it_read() {
        let (api, mut handle) = api();
        let server = tokio::spawn(async move {
            let (method, path, _, send) = next(&mut handle).await;
            assert_eq!(
                (method.as_str(), path.as_str()),
                ("GET", "/apis/resource.k8s.io/v1/namespaces/t/resourceclaims/c")
            );
            send.send_response(respond(200, claim("5", json!(["other"]))));
            let (method, path, body, send) = next(&mut handle).await;
            assert_eq!(
                (method.as_str(), path.as_str()),
                ("PUT", "/apis/resource.k8s.io/v1/namespaces/t/resourceclaims/c")
            );
            assert_eq!(body["metadata"]["resourceVersion"], "5");
            assert_eq!(body["metadata"]["finalizers"], json!(["other", ALLOCATED_FINALIZER]));
            send.send_response(respond(200, claim("6", json!(["other", ALLOCATED_FINALIZER]))));
            let (method, path, body, send) = next(&mut handle).await;
            assert_eq!(
                (method.as_str(), path.as_str()),
                ("PUT", "/apis/resource.k8s.io/v1/namespaces/t/resourceclaims/c/status")
            );
            assert_eq!(body["metadata"]["resourceVersion"], "6");
            let allocation = &body["status"]["allocation"];
            assert_eq!(allocation["devices"]["results"][0]["device"], "gpu-1");
            assert_eq!(allocation["devices"]["results"][0]["consumedCapacity"]["percent"], "30");
            assert!(allocation["allocationTimestamp"].is_string(), "{allocation}");
            let mut done = body.clone();
            done["metadata"]["resourceVersion"] = json!("7");
            send.send_response(respond(200, done));
        });
        let claim = write(&api, &the_write()).await.unwrap();
        assert_eq!(claim.metadata.resource_version.as_deref(), Some("7"));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_claim_changed_since_the_choice_is_not_written() {
        let (api, mut handle) = api();
        let server = tokio::spawn(async move {
            // Read at another version: nothing is written.
            let (_, _, _, send) = next(&mut handle).await;
            send.send_response(respond(200, claim("9", json!([]))));
            // Changed between the read and the write: the API server's conflict.
            let (_, _, _, send) = next(&mut handle).await;
            send.send_response(respond(200, claim("5", json!([ALLOCATED_FINALIZER]))));
            let (method, path, _, send) = next(&mut handle).await;
            assert!(
                method == "PUT" && path.ends_with("/status"),
                "the finalizer is there: straight to the status"
            );
            send.send_response(failure(409, "Conflict"));
            // Gone.
            let (_, _, _, send) = next(&mut handle).await;
            send.send_response(failure(404, "NotFound"));
            // Refused for another reason.
            let (_, _, _, send) = next(&mut handle).await;
            send.send_response(failure(403, "Forbidden"));
        });
        for _ in 0..3 {
            let e = write(&api, &the_write()).await.unwrap_err();
            assert!(matches!(e, Failure::Changed), "{e}");
        }
        let e = write(&api, &the_write()).await.unwrap_err();
        assert!(matches!(e, Failure::Api(_)), "{e}");
        server.await.unwrap();
    }
}
