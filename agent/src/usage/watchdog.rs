//! The memory-overrun watchdog: a container whose processes use more of a card's memory than it was
//! granted, pass after pass for longer than a grace period, is an overrun. The first pass past the
//! grace reports it once (the caller posts a Warning Event on its pod); it stays marked in the
//! metrics until it is back under its grant. Only the container's own processes count, and only its
//! own pod is ever named: a neighbour on the same card is never touched.

use super::ContainerUsage;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A container, by pod UID, name and card.
type Key = (String, String, String);

/// Since when each container has been over its grant, and whether it was reported.
#[derive(Debug)]
pub struct Watchdog {
    grace: Duration,
    over: HashMap<Key, (Instant, bool)>,
}

impl Watchdog {
    /// Overruns count after `grace`.
    pub fn new(grace: Duration) -> Self {
        Watchdog { grace, over: HashMap::new() }
    }

    /// Looks at one pass at `now`: marks `overrun` on the rows over their grant past the grace, and
    /// returns those reaching it in this pass (to report once). A container back under its grant, or
    /// gone, starts again from zero.
    pub fn observe(&mut self, rows: &mut [ContainerUsage], now: Instant) -> Vec<ContainerUsage> {
        let mut over = HashMap::with_capacity(self.over.len());
        let mut reached = Vec::new();
        for row in rows.iter_mut().filter(|r| r.over_memory()) {
            let key = (row.pod_uid.clone(), row.container.clone(), row.uuid.clone());
            let (since, reported) = self.over.get(&key).copied().unwrap_or((now, false));
            row.overrun = now.saturating_duration_since(since) >= self.grace;
            if row.overrun && !reported {
                reached.push(row.clone());
            }
            over.insert(key, (since, reported || row.overrun));
        }
        self.over = over;
        reached
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nano_gpu_proto::units::MiB;

    fn row(container: &str, used: u64, granted: u64) -> ContainerUsage {
        ContainerUsage {
            pod_uid: "uid".into(),
            container: container.into(),
            uuid: "GPU-a".into(),
            granted_memory: MiB(granted),
            memory_used: MiB(used),
            ..Default::default()
        }
    }

    #[test]
    fn an_overrun_counts_after_the_grace_is_reported_once_and_clears_when_back_under() {
        let mut dog = Watchdog::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut pass = vec![row("hog", 5000, 4608), row("fine", 1000, 4608)];
        assert!(dog.observe(&mut pass, at(0)).is_empty());
        assert!(!pass[0].overrun);
        assert!(dog.observe(&mut pass, at(29)).is_empty());
        let reached = dog.observe(&mut pass, at(30));
        assert_eq!(reached.iter().map(|r| r.container.as_str()).collect::<Vec<_>>(), ["hog"]);
        assert!(pass[0].overrun && !pass[1].overrun);
        // Still over: marked, not reported again.
        assert!(dog.observe(&mut pass, at(40)).is_empty());
        assert!(pass[0].overrun);
        // Back under its grant, then over again: the grace starts over.
        let mut under = vec![row("hog", 4000, 4608)];
        assert!(dog.observe(&mut under, at(50)).is_empty());
        assert!(!under[0].overrun);
        let mut again = vec![row("hog", 5000, 4608)];
        assert!(dog.observe(&mut again, at(60)).is_empty());
        assert_eq!(dog.observe(&mut again, at(90)).len(), 1);
    }

    #[test]
    fn using_a_card_it_was_not_given_is_an_overrun() {
        let mut dog = Watchdog::new(Duration::ZERO);
        let mut pass = vec![row("stowaway", 1, 0)];
        assert_eq!(dog.observe(&mut pass, Instant::now()).len(), 1);
        assert!(pass[0].overrun);
    }
}
