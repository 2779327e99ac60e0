//! Which pod and container a process belongs to, from its `/proc/<pid>/cgroup`.
//!
//! The kubelet puts every container in a cgroup under the pod's, and names the pod's cgroup after the
//! pod's UID; the runtime names the container's after its ID. The forms differ by cgroup version,
//! cgroup driver and runtime:
//!
//! | driver   | pod cgroup                                        | container cgroup                    |
//! |----------|---------------------------------------------------|-------------------------------------|
//! | cgroupfs | `…/kubepods/burstable/pod<uid>`                   | `<id>` (containerd), `crio-<id>`    |
//! | systemd  | `…/kubepods-burstable-pod<uid with _>.slice`      | `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` |
//!
//! cgroup v1 lists one line per hierarchy (`4:memory:/path`), v2 one line (`0::/path`); a reader in
//! another cgroup namespace sees paths relative to its own root (`/../../kubepods/…`), and the
//! kubelet's `--cgroup-root` adds a prefix. Only the last two segments that name a pod and a
//! container count, so all of these read the same. CRI-O's `crio-conmon-<id>` (its monitor process,
//! not the container) is not a container.

/// A container, as its cgroup names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerRef {
    /// The pod's UID, with dashes (`metadata.uid`).
    pub pod_uid: String,
    /// The container's ID without the runtime's prefix (the hex part of `status.containerStatuses[].containerID`).
    pub container_id: String,
}

/// The container of a process, from the text of its `/proc/<pid>/cgroup`; `None` for a process that
/// is not in a Kubernetes container (the host's, a pod's cgroup itself, conmon).
pub fn container_of(cgroup: &str) -> Option<ContainerRef> {
    // v2's unified line first (on a hybrid host the v1 lines may lag a migration), then any v1 line.
    let mut lines: Vec<&str> = cgroup.lines().collect();
    lines.sort_by_key(|l| !l.starts_with("0::"));
    lines.into_iter().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        from_path(path)
    })
}

/// The container a cgroup path names: a pod segment followed by a container segment.
fn from_path(path: &str) -> Option<ContainerRef> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    segments.windows(2).rev().find_map(|w| {
        let pod_uid = pod_uid(w[0])?;
        let container_id = container_id(w[1])?;
        Some(ContainerRef { pod_uid, container_id })
    })
}

/// The pod UID a pod cgroup names: `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid_>.slice`
/// (systemd, dashes of the UID written as underscores).
fn pod_uid(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice").unwrap_or(segment);
    let (before, uid) = name.rsplit_once("pod")?;
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    let uid = uid.replace('_', "-");
    let well_formed = uid.len() == 36
        && uid
            .char_indices()
            .all(|(i, c)| if matches!(i, 8 | 13 | 18 | 23) { c == '-' } else { c.is_ascii_hexdigit() });
    well_formed.then(|| uid.to_ascii_lowercase())
}

/// The container ID a container cgroup names: 64 hex digits, bare (containerd with cgroupfs) or after
/// the runtime's prefix (`cri-containerd-`, `crio-`, `docker-`), with systemd's `.scope`.
fn container_id(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-"]
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    (id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::pods::status_id;

    const UID: &str = "0f3d6a1e-7b2c-4c1d-9e8f-1a2b3c4d5e6f";
    const ID: &str = "8c4f5e0a1b2c3d4e5f60718293a4b5c6d7e8f90112233445566778899aabbccd";

    fn expected() -> Option<ContainerRef> {
        Some(ContainerRef { pod_uid: UID.into(), container_id: ID.into() })
    }

    #[test]
    fn every_version_driver_and_runtime_names_the_same_container() {
        let uid_ = UID.replace('-', "_");
        let forms = [
            // cgroup v1, cgroupfs, containerd: one line per hierarchy.
            format!(
                "12:pids:/kubepods/burstable/pod{UID}/{ID}\n4:memory:/kubepods/burstable/pod{UID}/{ID}\n\
                 1:name=systemd:/kubepods/burstable/pod{UID}/{ID}\n0::/\n"
            ),
            // Under a kubelet --cgroup-root, Guaranteed QoS (no class segment).
            format!("4:memory:/nano-gpu-e2e-node-1/kubepods/pod{UID}/{ID}\n3:cpuset:/\n"),
            // cgroup v2, systemd, containerd; Burstable and Guaranteed.
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{ID}.scope\n"
            ),
            format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{ID}.scope\n"),
            // CRI-O with systemd and with cgroupfs.
            format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{ID}.scope\n"
            ),
            format!("0::/kubepods/besteffort/pod{UID}/crio-{ID}\n"),
            // Docker with systemd on cgroup v1.
            format!(
                "11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/docker-{ID}.scope\n"
            ),
            // A reader in another cgroup namespace.
            format!("0::/../../kubepods-besteffort-pod{uid_}.slice/cri-containerd-{ID}.scope\n"),
        ];
        for text in forms {
            assert_eq!(container_of(&text), expected(), "{text}");
        }
    }

    #[test]
    fn not_cri_o_s_monitor() {
        let conmon = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/crio-conmon-{ID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(container_of(&conmon), None);
    }

    #[test]
    fn processes_outside_containers_belong_to_none() {
        for text in [
            "0::/system.slice/sshd.service\n".to_owned(),
            "0::/user.slice/user-1000.slice/session-3.scope\n".to_owned(),
            format!("4:memory:/kubepods/burstable/pod{UID}\n"),
            format!("4:memory:/kubepods/burstable/pod{UID}/not-a-container\n"),
            format!("4:memory:/kubepods/burstable/podnot-a-uid/{ID}\n"),
            format!("4:memory:/kubepods/burstable/mypod{UID}/{ID}\n"),
            String::new(),
            "garbage without colons\n".to_owned(),
        ] {
            assert_eq!(container_of(&text), None, "{text}");
        }
    }

    #[test]
    fn the_unified_line_wins_over_a_v1_line_that_lags() {
        let other = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let text = format!("4:memory:/kubepods/pod{UID}/{other}\n0::/kubepods/pod{UID}/{ID}\n");
        assert_eq!(container_of(&text), expected());
    }

    #[test]
    fn status_ids_lose_their_runtime_prefix() {
        assert_eq!(status_id(&format!("containerd://{ID}")), ID);
        assert_eq!(status_id(&format!("cri-o://{ID}")), ID);
        assert_eq!(status_id(ID), ID);
    }
}
