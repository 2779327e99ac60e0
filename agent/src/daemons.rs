//! The MPS daemons as the agent watches them: when one stops or is replaced, the cards are read
//! again at once (the card goes unhealthy until a daemon runs again, [`crate::enforce`]) and every
//! pod with a share of that card gets a Warning Event `MpsDaemonLost`, since its CUDA processes
//! there lost their MPS server.

use crate::enforce::mps;
use crate::health::Health;
use crate::plugin::{Report, Snapshot};
use crate::pods::{Resident, Residents, pod_key};
use nano_gpu_proto::annotations::Vendor;
use nano_gpu_proto::events::Reason;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Watches the MPS daemons of the node's cards every `every`; a change wakes `reread`'s refresh.
pub async fn watch(
    layout: mps::Layout,
    cards: watch::Receiver<Snapshot>,
    told: Option<(watch::Receiver<Residents>, mpsc::Sender<Report>)>,
    reread: Arc<Health>,
    every: Duration,
) {
    let mut seen: HashMap<String, u32> = HashMap::new();
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let uuids: Vec<String> = cards
            .borrow()
            .iter()
            .filter(|c| c.info.vendor == Vendor::Nvidia && !c.mig)
            .map(|c| c.info.uuid.clone())
            .collect();
        let mut changed = false;
        let mut lost = Vec::new();
        for uuid in &uuids {
            let now = layout.daemon(uuid).ok();
            let before = seen.get(uuid).copied();
            if now != before {
                changed = true;
                if let Some(pid) = before {
                    lost.push((uuid.clone(), pid, now));
                }
                match now {
                    Some(pid) => seen.insert(uuid.clone(), pid),
                    None => seen.remove(uuid),
                };
            }
        }
        if changed {
            reread.changed.notify_one();
        }
        for (uuid, pid, now) in lost {
            let what = match now {
                Some(new) => format!("was replaced (PID {pid} → {new})"),
                None => format!("stopped (PID {pid}); the card takes no new share until it runs again"),
            };
            tracing::warn!(card = %uuid, "MPS control daemon {what}");
            let Some((residents, reports)) = &told else { continue };
            let pods = holders(&residents.borrow(), &uuid);
            for pod in pods {
                let message = format!(
                    "the MPS control daemon of card {uuid} {what}: this pod's CUDA processes on that card \
                     lost their MPS server (restart them to run limited again)"
                );
                let report =
                    Report::Warning { pod, reason: Reason::MpsDaemonLost, action: "Enforce", message };
                if reports.try_send(report).is_err() {
                    tracing::warn!(card = %uuid, "report queue full; an MpsDaemonLost Event is dropped");
                }
            }
        }
    }
}

/// The pods (`namespace/name`) with a share (less than the whole card) of card `uuid`.
pub fn holders(residents: &BTreeMap<String, Resident>, uuid: &str) -> Vec<String> {
    residents
        .values()
        .filter(|r| r.grants.values().flatten().any(|g| g.uuid == uuid && g.percent.0 < 100))
        .map(|r| pod_key(&r.namespace, &r.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pods_with_a_share_of_the_card_hold_it() {
        use nano_gpu_proto::annotations::CardGrant;
        use nano_gpu_proto::units::Percent;
        let grant = |uuid: &str, p: u32| CardGrant {
            index: 0,
            uuid: uuid.into(),
            percent: Percent(p),
            memory_mib: None,
        };
        let resident = |name: &str, grants: Vec<CardGrant>| Resident {
            namespace: "ml".into(),
            name: name.into(),
            grants: [("main".to_owned(), grants)].into(),
            ..Default::default()
        };
        let residents: BTreeMap<String, Resident> = [
            ("ml/a".to_owned(), resident("a", vec![grant("GPU-a", 30)])),
            ("ml/b".to_owned(), resident("b", vec![grant("GPU-a", 100)])),
            ("ml/c".to_owned(), resident("c", vec![grant("GPU-b", 50)])),
        ]
        .into();
        assert_eq!(holders(&residents, "GPU-a"), ["ml/a"]);
    }
}
