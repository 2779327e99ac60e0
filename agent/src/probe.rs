//! The agent's probes for its DaemonSet: `/healthz` (the process serves) and `/readyz` (registered with
//! the kubelet and serving at least one card; otherwise 503 with the reason, e.g. NVML missing).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What readiness depends on; the run loop keeps it current.
#[derive(Debug, Default)]
pub struct Readiness {
    registered: AtomicBool,
    cards: AtomicUsize,
    problems: Mutex<Vec<String>>,
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

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<String, String> {
        let cards = self.cards.load(Ordering::SeqCst);
        let problems = self.problems.lock().unwrap_or_else(|e| e.into_inner()).join("; ");
        if cards == 0 {
            let why = if problems.is_empty() { "no GPU cards found".to_owned() } else { problems };
            return Err(format!("not serving any card: {why}"));
        }
        if !self.registered.load(Ordering::SeqCst) {
            return Err("not registered with the kubelet".into());
        }
        Ok(format!("serving {cards} card(s)"))
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
    }
}
