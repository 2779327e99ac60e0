//! Per-process use of Intel cards from DRM fdinfo (the kernel's `drm-usage-stats`): every open DRM
//! file of a process has `/proc/<pid>/fdinfo/<fd>` with the card's PCI address (`drm-pdev`), a client
//! id (one client may be open under several fds), the time each engine class spent on its work
//! (i915: `drm-engine-<class>: <ns> ns`; xe: `drm-cycles-<class>` against `drm-total-cycles-<class>`)
//! and its memory per region (`drm-resident-<region>`, else `drm-total-<region>`; device memory is
//! the `local*` and `vram*` regions). Utilisation is the busiest engine class's share of the time
//! between two samples, so a client is first seen without one.
//!
//! Reading another process's fdinfo needs the right to trace it (`CAP_SYS_PTRACE` when it is not
//! ours): without it those processes are not seen, and the card's numbers count only the others.

use nano_gpu_proto::units::MiB;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

/// One DRM client's counters as one fdinfo file gives them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Client {
    /// The card's PCI address.
    pub pdev: String,
    /// The client's id (unique per card while it is open).
    pub id: u64,
    /// Per engine class: busy time (ns, i915) or busy cycles with the cycles elapsed (xe).
    pub engines: BTreeMap<String, (u64, Option<u64>)>,
    /// Device memory (bytes) in the `local*`/`vram*` regions: resident where said, else total.
    pub device_memory: u64,
}

/// One fdinfo file's DRM client, if it is one (`drm-pdev` and `drm-client-id` present).
pub fn parse(text: &str) -> Option<Client> {
    let mut c = Client::default();
    let (mut pdev, mut id) = (None, None);
    let (mut resident, mut total) = (None::<u64>, None::<u64>);
    let mut total_cycles: BTreeMap<&str, u64> = BTreeMap::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if key == "drm-pdev" {
            pdev = Some(value.to_owned());
        } else if key == "drm-client-id" {
            id = value.parse().ok();
        } else if let Some(class) = key.strip_prefix("drm-engine-") {
            // `drm-engine-capacity-<class>` is how many engines the class has, not time.
            if let Some(ns) = value.strip_suffix("ns").and_then(|v| v.trim().parse().ok())
                && !class.starts_with("capacity-")
            {
                c.engines.insert(class.to_owned(), (ns, None));
            }
        } else if let Some(class) = key.strip_prefix("drm-total-cycles-") {
            if let Ok(v) = value.parse() {
                total_cycles.insert(class, v);
            }
        } else if let Some(class) = key.strip_prefix("drm-cycles-") {
            if let Ok(v) = value.parse() {
                c.engines.insert(class.to_owned(), (v, None));
            }
        } else if let Some(region) = key.strip_prefix("drm-resident-") {
            // A size in a unit not known here is left out, the rest of the client kept.
            if let Some(b) = bytes(value).filter(|_| device_region(region)) {
                *resident.get_or_insert(0) += b;
            }
        } else if let Some(region) = key.strip_prefix("drm-total-") {
            // A size in a unit not known here is left out, the rest of the client kept.
            if let Some(b) = bytes(value).filter(|_| device_region(region)) {
                *total.get_or_insert(0) += b;
            }
        }
    }
    for (class, busy) in c.engines.iter_mut() {
        if let Some(&t) = total_cycles.get(class.as_str()) {
            busy.1 = Some(t);
        }
    }
    c.pdev = pdev?;
    c.id = id?;
    c.device_memory = resident.or(total).unwrap_or(0);
    Some(c)
}

fn device_region(region: &str) -> bool {
    region.starts_with("local") || region.starts_with("vram")
}

/// `<n>`, `<n> KiB` or `<n> MiB` in bytes.
fn bytes(value: &str) -> Option<u64> {
    let (n, unit) = value.split_once(' ').unwrap_or((value, ""));
    let n: u64 = n.parse().ok()?;
    match unit.trim() {
        "" => Some(n),
        "KiB" => n.checked_mul(1 << 10),
        "MiB" => n.checked_mul(1 << 20),
        _ => None,
    }
}

/// DRM clients by (pid, card's PCI address, client id).
pub type Clients = BTreeMap<(u32, String, u64), Client>;

/// Every DRM client of every process under `proc_root`: a client open under several fds counts
/// once. Only the fds that are DRM device nodes (`fd/<n>` links into `/dev/dri/`) are read;
/// processes whose fds cannot be read are skipped.
pub fn scan(proc_root: &Path) -> Clients {
    let mut clients = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(proc_root) else { return clients };
    for entry in entries.filter_map(Result::ok) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.filter_map(Result::ok) {
            let drm = std::fs::read_link(fd.path()).is_ok_and(|target| target.starts_with("/dev/dri/"));
            if !drm {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(entry.path().join("fdinfo").join(fd.file_name())) else {
                continue;
            };
            if let Some(c) = parse(&text) {
                clients.insert((pid, c.pdev.clone(), c.id), c);
            }
        }
    }
    clients
}

/// The counters of the last scan, to turn the next one's into utilisation.
#[derive(Default)]
pub struct Sampler {
    last: Option<(Instant, Clients)>,
}

/// One process on one card, from its DRM clients there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Use {
    /// Host PID.
    pub pid: u32,
    /// Device memory of its clients.
    pub memory: MiB,
    /// Its busiest engine class's share of the time since the last scan (percent); `None` when
    /// none of its clients was seen in the last scan.
    pub busy: Option<u32>,
}

impl Sampler {
    /// The processes on each card (by PCI address) now, and each card's utilisation (the busiest
    /// engine class, summed over its clients; `None` before a second scan). Cards no client has
    /// open are not in it.
    pub fn sample(&mut self, proc_root: &Path) -> HashMap<String, (Vec<Use>, Option<u32>)> {
        let now = Instant::now();
        let clients = scan(proc_root);
        let last = self.last.as_ref();
        let wall_ns = last.map(|(t, _)| now.duration_since(*t).as_nanos() as f64).filter(|ns| *ns > 0.0);
        // Per card: its processes, and the busy share summed per engine class.
        type Card = (BTreeMap<u32, Use>, BTreeMap<String, f64>);
        let mut by_card: HashMap<String, Card> = HashMap::new();
        for (key, c) in &clients {
            let before = last.and_then(|(_, l)| l.get(key));
            let (uses, engines) = by_card.entry(c.pdev.clone()).or_default();
            let mut busiest = None::<f64>;
            if let (Some(before), Some(wall)) = (before, wall_ns) {
                for (class, &(busy, cycles)) in &c.engines {
                    let Some(&(was, was_cycles)) = before.engines.get(class) else { continue };
                    let spent = busy.saturating_sub(was) as f64;
                    let share = match (cycles, was_cycles) {
                        (Some(t), Some(w)) if t > w => spent / (t - w) as f64,
                        (None, None) => spent / wall,
                        _ => continue,
                    };
                    let share = share.clamp(0.0, 1.0);
                    *engines.entry(class.clone()).or_default() += share;
                    busiest = Some(busiest.map_or(share, |b: f64| b.max(share)));
                }
            }
            let u = uses.entry(key.0).or_insert(Use { pid: key.0, memory: MiB(0), busy: None });
            u.memory = MiB(u.memory.0 + (c.device_memory >> 20));
            if let Some(b) = busiest {
                let pc = (b * 100.0).round() as u32;
                u.busy = Some(u.busy.map_or(pc, |v| v.max(pc)));
            }
        }
        let out = by_card
            .into_iter()
            .map(|(pdev, (uses, engines))| {
                let card = wall_ns.map(|_| {
                    let top = engines.values().fold(0.0_f64, |a, &b| a.max(b));
                    (top.min(1.0) * 100.0).round() as u32
                });
                (pdev, (uses.into_values().collect(), card))
            })
            .collect();
        self.last = Some((now, clients));
        out
    }

    /// Whether a scan was made before (utilisation is known from the next one on).
    pub fn timed(&self) -> bool {
        self.last.is_some()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const I915: &str = "pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1018\ndrm-driver:\ti915\n\
        drm-client-id:\t7\ndrm-pdev:\t0000:03:00.0\ndrm-total-system0:\t4 MiB\ndrm-total-local0:\t2048 KiB\n\
        drm-resident-local0:\t1024 KiB\ndrm-engine-render:\t5000000 ns\ndrm-engine-copy:\t0 ns\n\
        drm-engine-capacity-video:\t2\ndrm-engine-video:\t100 ns\n";

    const XE: &str = "drm-driver:\txe\ndrm-client-id:\t12\ndrm-pdev:\t0000:04:00.0\n\
        drm-total-vram0:\t8 MiB\ndrm-total-gtt:\t1 MiB\ndrm-cycles-rcs:\t300\ndrm-total-cycles-rcs:\t1000\n\
        drm-cycles-ccs:\t50\ndrm-total-cycles-ccs:\t1000\n";

    #[test]
    fn i915_and_xe_fdinfo_give_the_card_the_client_its_engines_and_device_memory() {
        let c = parse(I915).unwrap();
        assert_eq!((c.pdev.as_str(), c.id, c.device_memory), ("0000:03:00.0", 7, 1 << 20));
        assert_eq!(c.engines["render"], (5_000_000, None));
        assert!(!c.engines.contains_key("capacity-video"), "{:?}", c.engines);
        let x = parse(XE).unwrap();
        assert_eq!((x.pdev.as_str(), x.id, x.device_memory), ("0000:04:00.0", 12, 8 << 20));
        assert_eq!((x.engines["rcs"], x.engines["ccs"]), ((300, Some(1000)), (50, Some(1000))));
        // Not a DRM client (an ordinary file), or one cut short.
        assert_eq!(parse("pos:\t0\nflags:\t0100002\n"), None);
        assert_eq!(parse("drm-pdev:\t0000:03:00.0\n"), None);
        let odd = parse("drm-client-id:\t7\ndrm-pdev:\tx\ndrm-resident-local0:\t9 PiB\n").unwrap();
        assert_eq!(odd.device_memory, 0);
    }

    /// Process `pid`'s fd `fd` with `text` as its fdinfo: a DRM render node when it says `drm-`.
    pub(crate) fn write(root: &Path, pid: u32, fd: u32, text: &str) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(dir.join("fdinfo")).unwrap();
        std::fs::create_dir_all(dir.join("fd")).unwrap();
        std::fs::write(dir.join("fdinfo").join(fd.to_string()), text).unwrap();
        let link = dir.join("fd").join(fd.to_string());
        let _ = std::fs::remove_file(&link);
        let target = if text.contains("drm-") { "/dev/dri/renderD128" } else { "/var/log/app.log" };
        std::os::unix::fs::symlink(target, link).unwrap();
    }

    #[test]
    fn two_scans_give_each_process_and_card_its_busy_share_and_memory() {
        let root = std::env::temp_dir().join(format!("nano-gpu-fdinfo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // Process 10: one i915 client under two fds; process 11: an xe client; process 12 no DRM.
        write(&root, 10, 3, I915);
        write(&root, 10, 4, I915);
        write(&root, 11, 5, XE);
        write(&root, 12, 0, "pos:\t0\n");
        // fdinfo that looks like a client behind an fd that is not a DRM node: not read.
        write(&root, 13, 1, "pos:\t0\n");
        std::fs::write(root.join("13/fdinfo/1"), I915).unwrap();
        let mut s = Sampler::default();
        let first = s.sample(&root);
        let (uses, card) = &first["0000:03:00.0"];
        assert_eq!((uses.as_slice(), *card), (&[Use { pid: 10, memory: MiB(1), busy: None }][..], None));
        assert_eq!(first.len(), 2);
        assert!(first.values().all(|(uses, _)| uses.iter().all(|u| u.pid != 13)), "{first:?}");
        // xe: 300 of 1000 more cycles busy on rcs; i915: render busy for ever (clamped to 100 %).
        write(
            &root,
            11,
            5,
            &XE.replace("cycles-rcs:\t300", "cycles-rcs:\t600").replace("rcs:\t1000", "rcs:\t2000"),
        );
        for fd in [3, 4] {
            write(&root, 10, fd, &I915.replace("5000000 ns", "999999999999 ns"));
        }
        let second = s.sample(&root);
        let (uses, card) = &second["0000:04:00.0"];
        assert_eq!((uses[0].busy, *card), (Some(30), Some(30)));
        let (uses, card) = &second["0000:03:00.0"];
        assert_eq!((uses[0].busy, *card), (Some(100), Some(100)));
        // A process gone is gone from the card.
        std::fs::remove_dir_all(root.join("11")).unwrap();
        assert!(!s.sample(&root).contains_key("0000:04:00.0"));
        let _ = std::fs::remove_dir_all(&root);
    }
}
