//! Card health from NVIDIA XID events: a critical XID makes the card Unhealthy (the kubelet stops
//! giving it out), and it recovers once no critical XID has arrived for a quiet period. XIDs that
//! report an application's own fault (as NVIDIA's device plugin treats them) do not count.

pub mod xid;

pub use xid::{watch_xids, watch_xids_retrying};

use crate::cards::inventory::Card;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// XIDs caused by the application, not the card.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// When each card last had a critical XID.
#[derive(Debug)]
pub struct Health {
    last: Mutex<HashMap<String, Instant>>,
    /// Every XID (critical or not) per card since the start, for the metrics.
    counts: Mutex<HashMap<String, u64>>,
    quiet: Duration,
    /// Cards another device plugin serves too, with why ([`crate::kubelet::coexist`]).
    claimed: Mutex<BTreeMap<String, String>>,
    /// Woken on every critical XID and every change of the cards another plugin serves, so the
    /// inventory is re-published at once.
    pub changed: Notify,
}

impl Health {
    /// Cards recover after `quiet` without a critical XID.
    pub fn new(quiet: Duration) -> Self {
        Health {
            last: Mutex::new(HashMap::new()),
            counts: Mutex::new(HashMap::new()),
            quiet,
            claimed: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
        }
    }

    /// Keeps `claimed` as the cards another device plugin serves; whether that changed.
    pub fn set_claimed(&self, claimed: BTreeMap<String, String>) -> bool {
        let mut held = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
        let changed = *held != claimed;
        *held = claimed;
        changed
    }

    /// Marks unhealthy, with the reason as its fault, every card another device plugin serves.
    pub fn refuse_claimed(&self, cards: &mut [Card]) {
        let held = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
        refuse(cards, |c| held.get(&c.info.uuid).cloned());
    }

    /// Records an XID on card `uuid` at `at`; returns whether it counts (is critical).
    pub fn record(&self, uuid: &str, xid: u64, at: Instant) -> bool {
        if let Ok(mut counts) = self.counts.lock() {
            *counts.entry(uuid.to_owned()).or_default() += 1;
        }
        if APPLICATION_XIDS.contains(&xid) {
            return false;
        }
        if let Ok(mut last) = self.last.lock() {
            last.insert(uuid.to_owned(), at);
        }
        self.changed.notify_one();
        true
    }

    /// XIDs recorded on card `uuid` since the start.
    pub fn xids(&self, uuid: &str) -> u64 {
        self.counts.lock().map_or(0, |c| c.get(uuid).copied().unwrap_or(0))
    }

    /// Marks unhealthy the cards with a critical XID less than the quiet period before `now`.
    pub fn apply(&self, cards: &mut [Card], now: Instant) {
        let Ok(last) = self.last.lock() else { return };
        for c in cards {
            if last.get(&c.info.uuid).is_some_and(|t| now.saturating_duration_since(*t) < self.quiet) {
                c.info.healthy = false;
            }
        }
    }
}

/// Marks unhealthy, with the reason as its fault, every card `refusal` names a reason for (a card
/// whose shares cannot be limited now, one another plugin serves).
pub fn refuse(cards: &mut [Card], refusal: impl Fn(&Card) -> Option<String>) {
    for card in cards {
        if let Some(reason) = refusal(card) {
            card.info.healthy = false;
            card.fault.get_or_insert(reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::units::MiB;

    fn card(uuid: &str) -> Card {
        Card::nvidia(0, uuid, "m", MiB(1), None)
    }

    #[test]
    fn a_critical_xid_makes_the_card_unhealthy_until_the_quiet_period_ends() {
        let health = Health::new(Duration::from_secs(300));
        let t0 = Instant::now();
        assert!(health.record("GPU-a", 79, t0));
        let mut cards = vec![card("GPU-a"), card("GPU-b")];
        health.apply(&mut cards, t0 + Duration::from_secs(10));
        assert_eq!((cards[0].info.healthy, cards[1].info.healthy), (false, true));
        let mut later = vec![card("GPU-a")];
        health.apply(&mut later, t0 + Duration::from_secs(301));
        assert!(later[0].info.healthy);
    }

    #[test]
    fn application_xids_do_not_count() {
        let health = Health::new(Duration::from_secs(300));
        assert!(!health.record("GPU-a", 43, Instant::now()));
        let mut cards = vec![card("GPU-a")];
        health.apply(&mut cards, Instant::now());
        assert!(cards[0].info.healthy);
    }
}
