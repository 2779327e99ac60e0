//! The memory-overrun watchdog: a container whose processes use more of a card's memory than it was
//! granted, pass after pass for longer than a grace period, is an overrun. The first pass past the
//! grace reports it once (the caller posts a Warning Event on its pod); it stays marked in the
//! metrics and on its pod ([`marks`]) until it is back under its grant. Only the container's own
//! processes count, and only its own pod is ever named: a neighbour on the same card is never touched.
//!
//! Times are wall-clock, as the pod's mark records them, so an agent that restarts picks up where the
//! mark says the overrun began (no second grace, no second Event).

use super::ContainerUsage;
use crate::node::pods::{MarkChange, Resident, pod_key};
use nano_gpu_proto::annotations::{Overrun, rfc3339};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

/// A container, by pod UID, name and card.
type Key = (String, String, String);

/// Since when each container has been over its grant, and whether it was reported.
#[derive(Debug)]
pub struct Watchdog {
    grace: Duration,
    over: HashMap<Key, (SystemTime, bool)>,
}

impl Watchdog {
    /// Overruns count after `grace`.
    pub fn new(grace: Duration) -> Self {
        Watchdog { grace, over: HashMap::new() }
    }

    /// Looks at one pass at `now`: sets `overrun` (since when) on the rows over their grant past the
    /// grace, and returns those reaching it in this pass (to report once). A container back under
    /// its grant, or gone, starts again from zero. A row over its grant that this watchdog has not
    /// seen yet but whose pod is marked for it (`marked`: since when) continues from the mark.
    pub fn observe(
        &mut self,
        rows: &mut [ContainerUsage],
        now: SystemTime,
        marked: impl Fn(&ContainerUsage) -> Option<SystemTime>,
    ) -> Vec<ContainerUsage> {
        let mut over = HashMap::with_capacity(self.over.len());
        let mut reached = Vec::new();
        for row in rows.iter_mut().filter(|r| r.over_memory()) {
            let key = (row.pod_uid.clone(), row.container.clone(), row.uuid.clone());
            let (since, reported) = self
                .over
                .get(&key)
                .copied()
                .unwrap_or_else(|| marked(row).map_or((now, false), |t| (t, true)));
            let past = now.duration_since(since).unwrap_or_default() >= self.grace;
            row.overrun = past.then_some(since);
            if past && !reported {
                reached.push(row.clone());
            }
            over.insert(key, (since, reported || past));
        }
        self.over = over;
        reached
    }
}

/// Since when pod `r`'s mark says `row` has been over (an unreadable time counts from now).
pub fn marked_since(r: &Resident, row: &ContainerUsage, now: SystemTime) -> Option<SystemTime> {
    let o = r.mark.as_ref()?.iter().find(|o| o.container == row.container && o.uuid == row.uuid)?;
    let at = o.since.parse::<k8s_openapi::jiff::Timestamp>().ok();
    Some(at.map_or(now, SystemTime::from))
}

/// The containers and cards a mark names, in order.
fn named(o: &[Overrun]) -> Vec<(&str, &str)> {
    let mut v: Vec<(&str, &str)> = o.iter().map(|o| (o.container.as_str(), o.uuid.as_str())).collect();
    v.sort_unstable();
    v
}

/// The marks to write after a pass: every pod whose mark does not name exactly its containers that
/// are overruns in `rows` (by container and card), with the overruns to write.
pub fn marks(rows: &[ContainerUsage], residents: &BTreeMap<String, Resident>) -> Vec<MarkChange> {
    let mut want: BTreeMap<&str, Vec<Overrun>> = BTreeMap::new();
    for row in rows {
        let Some(since) = row.overrun else { continue };
        want.entry(row.pod_uid.as_str()).or_default().push(Overrun {
            container: row.container.clone(),
            uuid: row.uuid.clone(),
            index: row.index,
            used: row.memory_used,
            granted: row.granted_memory,
            since: rfc3339(since),
        });
    }
    residents
        .values()
        .filter_map(|r| {
            let overruns = want.remove(r.uid.as_str()).unwrap_or_default();
            let same = match &r.mark {
                None => overruns.is_empty(),
                Some(has) => !has.is_empty() && named(has) == named(&overruns),
            };
            (!same).then(|| MarkChange { pod: pod_key(&r.namespace, &r.name), uid: r.uid.clone(), overruns })
        })
        .collect()
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

    fn at(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    #[test]
    fn an_overrun_counts_after_the_grace_is_reported_once_and_clears_when_back_under() {
        let mut dog = Watchdog::new(Duration::from_secs(30));
        let none = |_: &ContainerUsage| None;
        let mut pass = vec![row("hog", 5000, 4608), row("fine", 1000, 4608)];
        assert!(dog.observe(&mut pass, at(0), none).is_empty());
        assert_eq!(pass[0].overrun, None);
        assert!(dog.observe(&mut pass, at(29), none).is_empty());
        let reached = dog.observe(&mut pass, at(30), none);
        assert_eq!(reached.iter().map(|r| r.container.as_str()).collect::<Vec<_>>(), ["hog"]);
        assert_eq!((pass[0].overrun, pass[1].overrun), (Some(at(0)), None));
        // Still over: marked, not reported again.
        assert!(dog.observe(&mut pass, at(40), none).is_empty());
        assert_eq!(pass[0].overrun, Some(at(0)));
        // Back under its grant, then over again: the grace starts over.
        let mut under = vec![row("hog", 4000, 4608)];
        assert!(dog.observe(&mut under, at(50), none).is_empty());
        assert_eq!(under[0].overrun, None);
        let mut again = vec![row("hog", 5000, 4608)];
        assert!(dog.observe(&mut again, at(60), none).is_empty());
        assert_eq!(dog.observe(&mut again, at(90), none).len(), 1);
    }

    #[test]
    fn using_a_card_it_was_not_given_is_an_overrun() {
        let mut dog = Watchdog::new(Duration::ZERO);
        let mut pass = vec![row("stowaway", 1, 0)];
        assert_eq!(dog.observe(&mut pass, at(0), |_| None).len(), 1);
        assert!(pass[0].overrun.is_some());
    }

    #[test]
    fn a_restarted_watchdog_continues_from_the_pods_mark_without_a_second_report() {
        let mut dog = Watchdog::new(Duration::from_secs(30));
        let mut pass = vec![row("hog", 5000, 4608)];
        // Marked 40 s ago by the agent before this one: an overrun at once, already reported.
        assert!(dog.observe(&mut pass, at(40), |_| Some(at(0))).is_empty());
        assert_eq!(pass[0].overrun, Some(at(0)));
        // Marked 10 s ago (the mark outlived a short dip): not yet past the grace, and not reported
        // when it gets there.
        let mut dog = Watchdog::new(Duration::from_secs(30));
        assert!(dog.observe(&mut pass, at(10), |_| Some(at(0))).is_empty());
        assert!(dog.observe(&mut pass, at(30), |_| Some(at(0))).is_empty());
        assert_eq!(pass[0].overrun, Some(at(0)));
    }

    fn resident(uid: &str, mark: Option<Vec<Overrun>>) -> Resident {
        Resident {
            namespace: "ns".into(),
            name: format!("pod-{uid}"),
            uid: uid.into(),
            mark,
            ..Default::default()
        }
    }

    fn overrun(container: &str) -> Overrun {
        Overrun {
            container: container.into(),
            uuid: "GPU-a".into(),
            index: 0,
            used: MiB(1),
            granted: MiB(0),
            since: "2026-11-23T10:00:00Z".into(),
        }
    }

    #[test]
    fn marks_are_written_for_new_overruns_removed_when_they_end_and_left_alone_when_they_agree() {
        let mut hog = row("hog", 5000, 4608);
        hog.pod_uid = "a".into();
        hog.overrun = Some(at(0));
        let mut fine = row("fine", 1000, 4608);
        fine.pod_uid = "c".into();
        let residents: BTreeMap<String, Resident> = [
            resident("a", None),                       // over, unmarked: mark it
            resident("b", Some(vec![overrun("hog")])), // marked, no longer over: remove
            resident("c", None),                       // fine, unmarked: nothing
            resident("d", Some(vec![])),               // a mark that does not decode: remove
        ]
        .into_iter()
        .map(|r| (r.uid.clone(), r))
        .collect();
        let changes = marks(&[hog.clone(), fine], &residents);
        let got: Vec<(&str, Vec<&str>)> = changes
            .iter()
            .map(|c| (c.uid.as_str(), c.overruns.iter().map(|o| o.container.as_str()).collect()))
            .collect();
        assert_eq!(got, [("a", vec!["hog"]), ("b", vec![]), ("d", vec![])]);
        assert_eq!(changes[0].overruns[0].since, rfc3339(at(0)));
        assert_eq!((changes[0].overruns[0].used, changes[0].overruns[0].granted), (MiB(5000), MiB(4608)));
        // Once written, the same overrun (its usage changed) needs no new mark.
        let marked: BTreeMap<String, Resident> =
            [("a".to_owned(), resident("a", Some(vec![overrun("hog")])))].into();
        hog.memory_used = MiB(6000);
        assert!(marks(&[hog], &marked).is_empty());
    }
}
