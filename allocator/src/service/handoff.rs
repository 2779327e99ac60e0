//! The hand-off between one pod's filter and the next pod's: the next filter waits, briefly, until the
//! bind of the pod the last filter passed has reserved its cards.
//!
//! kube-scheduler schedules one pod at a time, but binds on a task of its own: it assumes pod A on
//! the node it chose and goes on to pod B while A's bind is still on its way to the extender. Its own
//! accounting of A covers `nano-gpu/gpu-percent` summed over the node, not which card A gets, so B's
//! filter, answered on a view without A, may pass the node whose last fitting card A is about to
//! take; B's bind then finds the card gone and kube-scheduler backs B off for a second or more (seen
//! by `hack/bench-scale.sh`: in a burst of 128 shares on 100 nodes, 17 binds failed so and the last
//! pods waited 5 s). So a filter of another pod first waits until the bind of the pod the last
//! filter passed has reserved (or failed), at most [`WAIT`]: a pod kube-scheduler does not bind after
//! all (another plugin refused it, a PreBind that takes long) delays the next pod by that much, once.

use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a filter waits for the bind of the pod the last filter passed.
pub const WAIT: Duration = Duration::from_millis(250);

/// The pod the last filter passed whose bind has not reserved yet.
#[derive(Default)]
pub struct Handoff {
    awaited: Mutex<Option<(String, Instant)>>,
    reserved: Notify,
}

impl Handoff {
    /// Before a filter of pod `uid`: waits while another pod passed a filter less than [`WAIT`] ago
    /// and its bind has not reserved; returns how long it waited.
    pub async fn before_filter(&self, uid: &str) -> Duration {
        let started = Instant::now();
        loop {
            // Registered before the look, so a bind that reserves in between still wakes us.
            let reserved = self.reserved.notified();
            let until = match &*self.awaited.lock().unwrap_or_else(|e| e.into_inner()) {
                Some((other, since)) if other != uid && since.elapsed() < WAIT => *since + WAIT,
                _ => return started.elapsed(),
            };
            if tokio::time::timeout_at(until, reserved).await.is_err() {
                return started.elapsed();
            }
        }
    }

    /// A filter passed pod `uid` on some node: kube-scheduler most likely binds it next.
    pub fn passed(&self, uid: &str) {
        *self.awaited.lock().unwrap_or_else(|e| e.into_inner()) = Some((uid.to_owned(), Instant::now()));
    }

    /// The bind of pod `uid` reserved its cards, or failed: the next filter need not wait for it.
    pub fn settled(&self, uid: &str) {
        let mut awaited = self.awaited.lock().unwrap_or_else(|e| e.into_inner());
        if awaited.as_ref().is_some_and(|(u, _)| u == uid) {
            *awaited = None;
            self.reserved.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_filter_waits_for_the_last_passed_pods_bind_and_no_longer_than_the_limit() {
        let h = std::sync::Arc::new(Handoff::default());
        // Nothing passed yet, or the same pod again (kube-scheduler's retry): no wait.
        assert_eq!(h.before_filter("a").await, Duration::ZERO);
        h.passed("a");
        assert_eq!(h.before_filter("a").await, Duration::ZERO);

        // Another pod waits until a's bind settles.
        let binder = h.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(40)).await;
            binder.settled("someone-else");
            tokio::time::sleep(Duration::from_millis(20)).await;
            binder.settled("a");
        });
        let waited = h.before_filter("b").await;
        assert!(waited >= Duration::from_millis(60) && waited < Duration::from_millis(70), "{waited:?}");

        // A pod that is never bound holds the next one back WAIT at most, and only once.
        h.passed("never-bound");
        assert!(h.before_filter("c").await >= WAIT);
        assert_eq!(h.before_filter("d").await, Duration::ZERO);
    }
}
