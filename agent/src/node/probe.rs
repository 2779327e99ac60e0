//! The agent's probes for its DaemonSet: `/healthz` (the process serves) and `/readyz` (registered with
//! the kubelet, serving at least one card, and its pod watch working or failing for less than
//! [`WATCH_LAG`]; otherwise 503 with the reason, e.g. NVML missing).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the pod watch may fail before the agent says it is not ready (Allocates then read the
/// API server directly, which is slower and also fails while the API server is away).
pub const WATCH_LAG: Duration = Duration::from_secs(10);

/// What readiness depends on; the run loop keeps it current.
#[derive(Debug, Default)]
pub struct Readiness {
    registered: AtomicBool,
    cards: AtomicUsize,
    /// What holds a share to its size here, said when ready.
    guarantee: Mutex<String>,
    /// Why the node's runtime must not be trusted with tenants' pods (the runtime canary's verdict).
    runtime_problem: Mutex<Option<String>>,
    problems: Mutex<Vec<String>>,
    /// Since when the pod watch has failed, and its last error.
    watch_failing: Mutex<Option<(Instant, String)>>,
}

impl Readiness {
    /// Whether the kubelet has accepted the registration (false again while it restarts).
    pub fn set_registered(&self, yes: bool) {
        self.registered.store(yes, Ordering::SeqCst);
    }

    /// The cards served now and the backends that could not be read.
    pub fn set_inventory(&self, cards: usize, problems: Vec<String>) {
        self.cards.store(cards, Ordering::SeqCst);
        *self.problems.lock().unwrap_or_else(|e| e.into_inner()) = problems;
    }

    /// What holds a share on this node to its size ([`Edits::guarantee`](crate::kubelet::plugin::Edits::guarantee)).
    pub fn set_guarantee(&self, guarantee: String) {
        *self.guarantee.lock().unwrap_or_else(|e| e.into_inner()) = guarantee;
    }

    /// The runtime canary's problem with this node's runtime (`None`: none, or not known yet).
    pub fn set_runtime_problem(&self, problem: Option<String>) {
        *self.runtime_problem.lock().unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// The pod watch failed with `error` (`None`: it works again).
    pub fn set_watch_error(&self, error: Option<String>) {
        let mut failing = self.watch_failing.lock().unwrap_or_else(|e| e.into_inner());
        *failing = error.map(|e| (failing.as_ref().map_or_else(Instant::now, |f| f.0), e));
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<String, String> {
        if let Some((since, error)) = &*self.watch_failing.lock().unwrap_or_else(|e| e.into_inner())
            && since.elapsed() >= WATCH_LAG
        {
            return Err(format!(
                "the pod watch has failed for {} s (last: {error}); Allocate reads the API server directly",
                since.elapsed().as_secs()
            ));
        }
        if let Some(problem) = &*self.runtime_problem.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(problem.clone());
        }
        let cards = self.cards.load(Ordering::SeqCst);
        let problems = self.problems.lock().unwrap_or_else(|e| e.into_inner()).join("; ");
        if cards == 0 {
            let why = if problems.is_empty() { "no GPU cards found".to_owned() } else { problems };
            return Err(format!("not serving any card: {why}"));
        }
        if !self.registered.load(Ordering::SeqCst) {
            return Err("not registered with the kubelet".into());
        }
        let guarantee = self.guarantee.lock().unwrap_or_else(|e| e.into_inner());
        if guarantee.is_empty() {
            return Ok(format!("serving {cards} card(s)"));
        }
        Ok(format!("serving {cards} card(s); {guarantee}"))
    }
}

async fn ready(State(r): State<Arc<Readiness>>) -> (StatusCode, String) {
    match r.check() {
        Ok(m) => (StatusCode::OK, m),
        Err(m) => (StatusCode::SERVICE_UNAVAILABLE, m),
    }
}

/// The probe routes.
pub fn router(readiness: Arc<Readiness>) -> Router {
    Router::new().route("/healthz", get(|| async { "ok" })).route("/readyz", get(ready)).with_state(readiness)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_cards_and_a_registration_and_says_why_not() {
        let r = Readiness::default();
        r.set_inventory(0, vec!["nvml: libnvidia-ml.so.1: cannot open shared object file".into()]);
        assert!(r.check().unwrap_err().contains("libnvidia-ml.so.1"));
        r.set_inventory(2, vec![]);
        assert_eq!(r.check().unwrap_err(), "not registered with the kubelet");
        r.set_registered(true);
        assert_eq!(r.check().unwrap(), "serving 2 card(s)");
        r.set_guarantee("shares: not limited".into());
        assert_eq!(r.check().unwrap(), "serving 2 card(s); shares: not limited");
        // A runtime that gives tenants cards by their env: not ready, with the reason, until it is fixed.
        r.set_runtime_problem(Some("this node's NVIDIA runtime gave ...".into()));
        assert_eq!(r.check().unwrap_err(), "this node's NVIDIA runtime gave ...");
        r.set_runtime_problem(None);
        assert!(r.check().is_ok());
    }

    #[test]
    fn a_pod_watch_failing_longer_than_the_lag_makes_it_unready_until_it_works() {
        let r = Readiness::default();
        r.set_inventory(1, vec![]);
        r.set_registered(true);
        r.set_watch_error(Some("403".into()));
        assert!(r.check().is_ok(), "a short failure is not a lag");
        // Failing since long ago: the first failure's time is kept across further errors.
        *r.watch_failing.lock().unwrap() = Some((Instant::now() - WATCH_LAG, "403".into()));
        r.set_watch_error(Some("410 Gone".into()));
        let why = r.check().unwrap_err();
        assert!(why.contains("pod watch has failed for 10 s (last: 410 Gone)"), "{why}");
        r.set_watch_error(None);
        assert!(r.check().is_ok());
    }
}
