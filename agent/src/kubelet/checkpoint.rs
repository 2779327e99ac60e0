//! The kubelet's device checkpoint kept free of pods that left the node.
//!
//! A kubelet forgets the devices of a pod that left (deleted, or finished) only when it next
//! allocates or answers pod-resources `List`, and writes that to its checkpoint
//! (`kubelet_internal_checkpoint` in the device-plugin directory) only when it next allocates or
//! gets a device list. A kubelet restarted before then reads the departed pods' devices back as in
//! use, and its first admissions after the restart run before it frees them (its pod sources are
//! not ready yet, kubelet `UpdateAllocatedDevices`): a share the allocator rightly placed on room
//! freed by a deleted pod fails "requested number of devices unavailable", for good
//! (kubernetes#109595's family). So the agent reads the checkpoint after pods leave and every
//! [`EVERY`]: while it names pods of our resources that are not on the node, the agent lists
//! pod-resources (the kubelet frees what no active pod holds) and sends its device lists again
//! (the kubelet writes its checkpoint). The kubelet may still count a departed pod active for a
//! while (its own pod watch lags the agent's, a container is still stopping), so the same pods are
//! asked for again after [`AGAIN_FIRST`], and twice as long each time after that.
//!
//! Only the fields named here are read; a checkpoint that does not decode is reported and left
//! alone (nothing is ever written to it).

use crate::node::podresources::Lister;
use crate::node::pods::Residents;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The kubelet's device checkpoint's file name in its device-plugin directory.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// How often the checkpoint is read while no pod leaves.
const EVERY: Duration = Duration::from_secs(10);

/// How long after a pod leaves the node the checkpoint is read, so that pods leaving together
/// (a deleted Job, a namespace) are asked for at once. The kubelet is done with a pod (its pod
/// worker knows it terminated) before the API server deletes it, and it counts a finished pod
/// inactive before it reports the phase.
const SETTLE: Duration = Duration::from_millis(250);

/// The first wait before the kubelet is asked again to free the same pods (it still counted one
/// active when asked).
const AGAIN_FIRST: Duration = Duration::from_secs(1);

/// The longest wait before the kubelet is asked again to free the same pods (a pod it still
/// counts active, such as one deleted with no grace whose containers are still stopping).
const AGAIN_MOST: Duration = Duration::from_secs(300);

#[derive(Deserialize)]
struct File {
    #[serde(rename = "Data")]
    data: Data,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "PodDeviceEntries", default)]
    entries: Option<Vec<Entry>>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "PodUID")]
    pod: String,
    #[serde(rename = "ResourceName")]
    resource: String,
}

/// The UIDs of the pods that hold devices of `resources` in the checkpoint `text`.
pub fn holders(text: &str, resources: &[&str]) -> Result<BTreeSet<String>, String> {
    let file: File = serde_json::from_str(text).map_err(|e| format!("not a device checkpoint: {e}"))?;
    Ok(file
        .data
        .entries
        .unwrap_or_default()
        .into_iter()
        .filter(|e| resources.contains(&e.resource.as_str()))
        .map(|e| e.pod)
        .collect())
}

/// What one look at the checkpoint did.
#[derive(Debug, PartialEq, Eq)]
pub enum Swept {
    /// No checkpoint yet, or it names only pods of the node.
    Clean,
    /// It names departed pods that were asked for a short while ago; not asked again yet.
    Waiting,
    /// The kubelet was asked to free the devices of these many departed pods.
    Asked(usize),
    /// The checkpoint could not be read, or pod-resources did not answer.
    Failed(String),
}

/// The look at the checkpoint and what it asks of the kubelet.
pub struct Sweep {
    /// The checkpoint file.
    path: PathBuf,
    /// The resources whose devices count (the agent's).
    resources: Vec<&'static str>,
    /// The node's pods (finished ones left out), by UID.
    residents: watch::Receiver<Residents>,
    /// pod-resources: a `List` lets the kubelet free what no active pod holds.
    lister: Arc<dyn Lister>,
    /// The departed pods asked for last, when to ask for them again, and the wait after that.
    asked: BTreeSet<String>,
    again_at: Instant,
    again_wait: Duration,
}

impl Sweep {
    /// A sweep of the checkpoint at `path` for `resources`.
    pub fn new(
        path: PathBuf,
        resources: Vec<&'static str>,
        residents: watch::Receiver<Residents>,
        lister: Arc<dyn Lister>,
    ) -> Self {
        Sweep {
            path,
            resources,
            residents,
            lister,
            asked: BTreeSet::new(),
            again_at: Instant::now(),
            again_wait: AGAIN_FIRST,
        }
    }

    /// Reads the checkpoint once; when it names pods not on the node, lists pod-resources and calls
    /// `resend` (the device lists sent again), unless the same pods were asked for a short while ago.
    pub async fn once(&mut self, resend: &(dyn Fn() + Send + Sync)) -> Swept {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Swept::Clean,
            Err(e) => return Swept::Failed(format!("reading {}: {e}", self.path.display())),
        };
        let held = match holders(&text, &self.resources) {
            Ok(h) => h,
            Err(e) => return Swept::Failed(format!("{}: {e}", self.path.display())),
        };
        let departed: BTreeSet<String> = {
            let here = self.residents.borrow();
            held.into_iter().filter(|uid| !here.contains_key(uid)).collect()
        };
        if departed.is_empty() {
            self.asked.clear();
            return Swept::Clean;
        }
        let now = Instant::now();
        if departed == self.asked {
            if now < self.again_at {
                return Swept::Waiting;
            }
            self.again_wait = (self.again_wait * 2).min(AGAIN_MOST);
        } else {
            self.again_wait = AGAIN_FIRST;
        }
        self.again_at = now + self.again_wait;
        let count = departed.len();
        self.asked = departed;
        match self.lister.list().await {
            Ok(_) => {
                resend();
                Swept::Asked(count)
            }
            Err(e) => {
                // Not asked after all: the next look asks again rather than waiting its turn.
                self.asked.clear();
                Swept::Failed(format!("pod-resources List: {}", e.message()))
            }
        }
    }

    /// When the pods asked for last are due to be asked for again; `None` when none are waiting.
    fn again(&self) -> Option<Instant> {
        (!self.asked.is_empty()).then_some(self.again_at)
    }

    /// Looks at the checkpoint after a pod leaves the node, when the pods asked for last are due
    /// again, and every [`EVERY`], until the pod watch ends (or the task is dropped).
    pub async fn run(mut self, resend: impl Fn() + Send + Sync + 'static) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_failure = None;
        let mut here = self.residents.borrow().clone();
        loop {
            let again = self.again();
            tokio::select! {
                _ = tick.tick() => {}
                _ = tokio::time::sleep_until(again.unwrap_or_else(Instant::now)), if again.is_some() => {}
                changed = self.residents.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let now = self.residents.borrow_and_update().clone();
                    let left = here.keys().any(|uid| !now.contains_key(uid));
                    here = now;
                    if !left {
                        continue;
                    }
                    tokio::time::sleep(SETTLE).await;
                }
            }
            match self.once(&resend).await {
                Swept::Asked(pods) => tracing::info!(
                    pods,
                    "the kubelet's device checkpoint holds devices for pods not on this node; asked it to free them"
                ),
                Swept::Failed(why) => {
                    if last_failure.as_ref() != Some(&why) {
                        tracing::warn!(error = %why, "checking the kubelet's device checkpoint");
                        last_failure = Some(why);
                    }
                    continue;
                }
                Swept::Clean | Swept::Waiting => {}
            }
            last_failure = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::pods::Resident;
    use nano_gpu_proto::kubelet::podresources::ListPodResourcesResponse;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tonic::Status;

    /// A checkpoint as kubelet 1.37 writes it: `uids` each hold two IDs of `resource`.
    fn checkpoint(entries: &[(&str, &str)]) -> String {
        let entries: Vec<_> = entries
            .iter()
            .map(|(uid, resource)| {
                serde_json::json!({
                    "PodUID": uid, "ContainerName": "main", "ResourceName": resource,
                    "DeviceIDs": {"-1": ["GPU-a-0", "GPU-a-1"]}, "AllocResp": "CgA="
                })
            })
            .collect();
        serde_json::json!({
            "Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"nano-gpu/gpu-percent": ["GPU-a-0"]}},
            "Checksum": 1234
        })
        .to_string()
    }

    #[test]
    fn holders_are_the_pods_with_devices_of_our_resources() {
        let text = checkpoint(&[
            ("u1", "nano-gpu/gpu-percent"),
            ("u2", "nvidia.com/gpu"),
            ("u3", "nano-gpu/gpu-percent"),
        ]);
        let held = holders(&text, &["nano-gpu/gpu-percent"]).unwrap();
        assert_eq!(held, BTreeSet::from(["u1".to_owned(), "u3".to_owned()]));
        // A kubelet with no allocation writes null entries.
        let empty = r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":1}"#;
        assert_eq!(holders(empty, &["nano-gpu/gpu-percent"]).unwrap(), BTreeSet::new());
        for bad in ["", "{", "[]", r#"{"Data":{"PodDeviceEntries":[{"PodUID":1}]}}"#] {
            assert!(holders(bad, &["nano-gpu/gpu-percent"]).is_err(), "{bad:?}");
        }
    }

    #[derive(Default)]
    struct Counting {
        calls: AtomicUsize,
        fail: bool,
    }

    #[tonic::async_trait]
    impl Lister for Counting {
        async fn list(&self) -> Result<ListPodResourcesResponse, Status> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.fail {
                Err(Status::unavailable("no kubelet"))
            } else {
                Ok(ListPodResourcesResponse::default())
            }
        }
    }

    fn residents(uids: &[&str]) -> Residents {
        Arc::new(
            uids.iter()
                .map(|u| (u.to_string(), Resident { uid: u.to_string(), ..Default::default() }))
                .collect::<BTreeMap<_, _>>(),
        )
    }

    struct Fixture {
        /// The checkpoint's directory, removed with the fixture.
        _dir: crate::Scratch,
        path: PathBuf,
        pods: watch::Sender<Residents>,
        lister: Arc<Counting>,
        sweep: Sweep,
        resent: Arc<AtomicUsize>,
    }

    fn fixture(name: &str, fail: bool) -> Fixture {
        let dir = crate::Scratch::new(&format!("checkpoint-{name}"));
        let path = dir.join(CHECKPOINT_FILE);
        let (pods, seen) = watch::channel(residents(&[]));
        let lister = Arc::new(Counting { fail, ..Default::default() });
        let sweep = Sweep::new(path.clone(), vec!["nano-gpu/gpu-percent"], seen, lister.clone());
        Fixture { _dir: dir, path, pods, lister, sweep, resent: Arc::new(AtomicUsize::new(0)) }
    }

    impl Fixture {
        async fn once(&mut self) -> Swept {
            let resent = self.resent.clone();
            self.sweep
                .once(&move || {
                    resent.fetch_add(1, Ordering::SeqCst);
                })
                .await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn departed_pods_in_the_checkpoint_are_listed_and_the_devices_sent_again() {
        let mut f = fixture("checkpoint-departed", false);
        // No checkpoint yet: nothing to do.
        assert_eq!(f.once().await, Swept::Clean);
        std::fs::write(
            &f.path,
            checkpoint(&[("u1", "nano-gpu/gpu-percent"), ("u2", "nano-gpu/gpu-percent")]),
        )
        .unwrap();
        f.pods.send_replace(residents(&["u1", "u2"]));
        assert_eq!(f.once().await, Swept::Clean);
        assert_eq!(f.lister.calls.load(Ordering::SeqCst), 0);

        // u2 left; the checkpoint still names it.
        f.pods.send_replace(residents(&["u1"]));
        assert_eq!(f.once().await, Swept::Asked(1));
        assert_eq!((f.lister.calls.load(Ordering::SeqCst), f.resent.load(Ordering::SeqCst)), (1, 1));
        // The kubelet still names it right after: not asked again at once, but after AGAIN_FIRST,
        // then after twice that.
        assert_eq!(f.once().await, Swept::Waiting);
        assert_eq!(f.sweep.again(), Some(Instant::now() + AGAIN_FIRST));
        tokio::time::advance(AGAIN_FIRST).await;
        assert_eq!(f.once().await, Swept::Asked(1));
        tokio::time::advance(AGAIN_FIRST).await;
        assert_eq!(f.once().await, Swept::Waiting);
        tokio::time::advance(AGAIN_FIRST).await;
        assert_eq!(f.once().await, Swept::Asked(1));
        // Another pod leaving is asked for at once.
        f.pods.send_replace(residents(&[]));
        assert_eq!(f.once().await, Swept::Asked(2));
        assert_eq!((f.lister.calls.load(Ordering::SeqCst), f.resent.load(Ordering::SeqCst)), (4, 4));

        // The kubelet wrote a checkpoint without them: clean.
        std::fs::write(&f.path, checkpoint(&[("u9", "nvidia.com/gpu")])).unwrap();
        assert_eq!(f.once().await, Swept::Clean);
        assert_eq!(f.lister.calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_leaving_has_the_checkpoint_read_at_once() {
        let f = fixture("checkpoint-run", false);
        std::fs::write(&f.path, checkpoint(&[("u1", "nano-gpu/gpu-percent")])).unwrap();
        f.pods.send_replace(residents(&["u1", "u2"]));
        let Fixture { pods, lister, sweep, resent, .. } = f;
        let counted = resent.clone();
        let task = tokio::spawn(sweep.run(move || {
            counted.fetch_add(1, Ordering::SeqCst);
        }));
        tokio::time::sleep(SETTLE * 2).await;
        assert_eq!(lister.calls.load(Ordering::SeqCst), 0, "u1 is on the node");
        // u2 leaving, which the checkpoint does not name: nothing asked.
        pods.send_replace(residents(&["u1"]));
        tokio::time::sleep(SETTLE * 2).await;
        assert_eq!(lister.calls.load(Ordering::SeqCst), 0);
        // u1 leaving: asked within the settle, well before the next periodic look.
        pods.send_replace(residents(&[]));
        tokio::time::sleep(SETTLE * 2).await;
        assert_eq!((lister.calls.load(Ordering::SeqCst), resent.load(Ordering::SeqCst)), (1, 1));
        // The kubelet still names it (it counted the pod active): asked again after AGAIN_FIRST,
        // well before the next periodic look.
        tokio::time::sleep(AGAIN_FIRST + SETTLE).await;
        assert_eq!((lister.calls.load(Ordering::SeqCst), resent.load(Ordering::SeqCst)), (2, 2));
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_bad_checkpoint_or_a_silent_kubelet_is_reported_and_nothing_sent() {
        let mut f = fixture("checkpoint-bad", true);
        std::fs::write(&f.path, "{ not json").unwrap();
        assert!(matches!(f.once().await, Swept::Failed(why) if why.contains("not a device checkpoint")));
        std::fs::write(&f.path, checkpoint(&[("u1", "nano-gpu/gpu-percent")])).unwrap();
        assert!(matches!(f.once().await, Swept::Failed(why) if why.contains("no kubelet")));
        assert_eq!((f.lister.calls.load(Ordering::SeqCst), f.resent.load(Ordering::SeqCst)), (1, 0));
        // A List that failed did not ask: the next look asks again, not after a wait.
        assert!(matches!(f.once().await, Swept::Failed(why) if why.contains("no kubelet")));
        assert_eq!((f.lister.calls.load(Ordering::SeqCst), f.resent.load(Ordering::SeqCst)), (2, 0));
    }
}
