//! The MPS daemons as the agent watches them: when one stops or is replaced, the cards are read
//! again at once (the card goes unhealthy until a daemon runs again, [`crate::node::enforce`]) and every
//! pod with a share of that card gets a Warning Event `MpsDaemonLost`, since its CUDA processes
//! there lost their MPS server.

use crate::cards::health::Health;
use crate::kubelet::plugin::{Report, Snapshot};
use crate::node::enforce::mps;
use crate::node::pods::{Resident, Residents, pod_key};
use crate::serve::usage::claims::{Held, SharedHeld, taken};
use nano_gpu_proto::annotations::{CardGrant, Vendor};
use nano_gpu_proto::events::Reason;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Watches the MPS daemons of the node's cards every `every`; a change wakes `reread`'s refresh.
pub async fn watch(
    layout: mps::Layout,
    cards: watch::Receiver<Snapshot>,
    told: Option<(watch::Receiver<Residents>, mpsc::Sender<Report>, SharedHeld)>,
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
            let Some((residents, reports, claims)) = &told else { continue };
            let held = claims.read().unwrap_or_else(|e| e.into_inner()).clone();
            let pods = holders(&residents.borrow(), &held, &uuid);
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

/// The pods (`namespace/name`) with a share (less than the whole card) of card `uuid`: in their
/// assignment, or in a claim one of their containers names (`claims`, as the usage loop read them).
pub fn holders(residents: &BTreeMap<String, Resident>, claims: &Held, uuid: &str) -> Vec<String> {
    let share = |g: &CardGrant| g.uuid == uuid && g.percent.0 < 100;
    let by_claim = |r: &Resident| {
        let mut uses = r.claims.values().flatten();
        uses.any(|u| taken(claims, &r.namespace, u).into_iter().flatten().any(|(_, c)| share(&c.grant)))
    };
    residents
        .values()
        .filter(|r| r.grants.values().flatten().any(share) || by_claim(r))
        .map(|r| pod_key(&r.namespace, &r.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pods_with_a_share_of_the_card_hold_it() {
        use crate::node::pods::ClaimUse;
        use crate::serve::usage::claims::ClaimGrant;
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
        // Pods d and e (DRA) name claim c1, a 20 % share of GPU-a and a whole GPU-b; e takes only
        // its whole card.
        let with_claim = |name: &str, request: Option<&str>| {
            let mut r = resident(name, vec![]);
            let u = ClaimUse { claim: "c1".into(), request: request.map(String::from) };
            r.claims = [("main".to_owned(), vec![u])].into();
            r
        };
        let residents: BTreeMap<String, Resident> = [
            ("ml/a".to_owned(), resident("a", vec![grant("GPU-a", 30)])),
            ("ml/b".to_owned(), resident("b", vec![grant("GPU-a", 100)])),
            ("ml/c".to_owned(), resident("c", vec![grant("GPU-b", 50)])),
            ("ml/d".to_owned(), with_claim("d", None)),
            ("ml/e".to_owned(), with_claim("e", Some("whole"))),
        ]
        .into();
        let claims: Held = [(
            ("ml".to_owned(), "c1".to_owned()),
            vec![
                ClaimGrant { request: "share".into(), grant: grant("GPU-a", 20) },
                ClaimGrant { request: "whole".into(), grant: grant("GPU-b", 100) },
            ],
        )]
        .into();
        assert_eq!(holders(&residents, &claims, "GPU-a"), ["ml/a", "ml/d"]);
        assert_eq!(holders(&residents, &Held::new(), "GPU-a"), ["ml/a"]);
        assert_eq!(holders(&residents, &claims, "GPU-b"), ["ml/c"]);
    }
}
