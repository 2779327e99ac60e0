//! Stands in for the NVIDIA container runtime on the harness's real nodes (`hack/nodes.sh`), where
//! there is no GPU and no driver: containerd runs it in place of runc. Like
//! `nvidia-container-runtime`, it edits the OCI spec of a container whose environment sets
//! `NVIDIA_VISIBLE_DEVICES`, then hands every call to runc unchanged. Where the real one mounts the
//! driver's `libnvidia-ml.so.1` and the device nodes of the visible cards, this one mounts the
//! workspace's fake NVML (`libfakenvml.so`) at the driver library's path and a card list holding
//! only the visible cards (`all`: every card of the node), named by `FAKE_NVML_CONFIG`.
//!
//! The node's fake driver lives in the node's own `/var/lib/nano-gpu-fake-driver/`:
//! `libnvidia-ml.so.1`, `nvml.json` (the node's cards, the fake NVML's format) and `procs/`, the
//! fake driver's process table (mounted read-write at `/run/nano-gpu-fake-driver/procs` and named
//! as the list's `processDir`: every container's NVML sees the node's GPU processes, as the
//! driver's does). A container that asks the `compute` capability (`NVIDIA_DRIVER_CAPABILITIES`,
//! or `all`) also gets the node's `nvidia-cuda-mps-control` (the stand-in
//! `tests/src/bin/nvidia-cuda-mps-control.rs`) at `/usr/bin/nvidia-cuda-mps-control`, as the real
//! runtime mounts NVIDIA's.
//!
//! **Which cards**, by the toolkit's own rules (nvidia-container-toolkit's hook, `getDevices`), under
//! the node's configuration `/var/lib/nano-gpu-fake-driver/config.toml` (standing in for
//! `/etc/nvidia-container-runtime/config.toml`; the same two keys, the same defaults):
//! - with `accept-nvidia-visible-devices-as-volume-mounts = true` (default false), the cards named by
//!   mounts whose source is `/dev/null` and whose destination lies under
//!   `/var/run/nvidia-container-devices/` (`cdi/` and `imex/` names aside) come first: if there are
//!   any, they are the list;
//! - otherwise `NVIDIA_VISIBLE_DEVICES` (its last value), which counts only in a privileged container
//!   (`CAP_SYS_ADMIN` in the bounding set) or with
//!   `accept-nvidia-visible-devices-envvar-when-unprivileged = true` (the default); `void`, `none` or
//!   empty name no card.
//! - in CDI mode (`mode = "cdi"` under `[nvidia-container-runtime]`; default `auto`, which the real
//!   runtime resolves to `legacy` unless the env or mounts name only CDI devices), before both: the
//!   fully qualified CDI names that the OCI spec's annotations whose keys start with one of
//!   `annotation-prefixes` (under `[nvidia-container-runtime.modes.cdi]`, default `cdi.k8s.io/`)
//!   list, comma-separated, with no privilege check (the toolkit's `getDevicesFromSpec`). A pod's
//!   annotations are in that spec where containerd passes them (its runtime's `pod_annotations`;
//!   CRI-O copies them all).
//!
//! Where it differs from the real runtime: a device name is looked up among the node's cards by UUID
//! or index only (no MIG names), and a name that matches no card is dropped rather than failing the
//! container. Of CDI names it resolves only the kinds `runtime.nvidia.com/gpu` (which the real
//! runtime generates from the driver) and `nvidia.com/gpu` (the default kind, which the spec
//! `nvidia-ctk cdi generate` writes names), and fails the container on any other, as the real one
//! fails on a name no spec holds.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{Value, json};

const DRIVER: &str = "/var/lib/nano-gpu-fake-driver";
/// Where the NVIDIA runtime puts the driver's NVML in a Debian-based image.
const NVML_TARGET: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
const CARDS_TARGET: &str = "/run/nano-gpu-fake-driver/nvml.json";
const PROCS_TARGET: &str = "/run/nano-gpu-fake-driver/procs";
const MPS_CONTROL: &str = "nvidia-cuda-mps-control";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bundle) = creating(&args) {
        edit_spec(&bundle).with_context(|| format!("nvidia-runtime-standin: bundle {}", bundle.display()))?;
    }
    let err = Command::new("runc").args(&args).exec();
    Err(err).context("nvidia-runtime-standin: exec runc")
}

/// The bundle of a `create` (or `run`) call: `--bundle DIR`, `-b DIR`, `--bundle=DIR`, or the
/// working directory (runc's default).
fn creating(args: &[String]) -> Option<PathBuf> {
    // runc's global flags come before the command; the command is the first word that is not a flag
    // or a global flag's value.
    let with_value = ["--root", "--log", "--log-format", "--criu", "--rootless"];
    let mut i = 0;
    while i < args.len() && args[i].starts_with('-') {
        i += if with_value.contains(&args[i].as_str()) { 2 } else { 1 };
    }
    if !matches!(args.get(i).map(String::as_str), Some("create" | "run")) {
        return None;
    }
    let rest = &args[i + 1..];
    for (j, a) in rest.iter().enumerate() {
        if let Some(dir) = a.strip_prefix("--bundle=") {
            return Some(dir.into());
        }
        if a == "--bundle" || a == "-b" {
            return rest.get(j + 1).map(PathBuf::from);
        }
    }
    std::env::current_dir().ok()
}

fn edit_spec(bundle: &Path) -> Result<()> {
    let file = bundle.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&file)?)?;
    // The last setting wins, as in a process environment.
    let var = |name: &str| {
        let prefix = format!("{name}=");
        spec["process"]["env"].as_array().and_then(|env| {
            env.iter().rev().find_map(|e| e.as_str()?.strip_prefix(prefix.as_str()).map(str::to_owned))
        })
    };
    let compute = var("NVIDIA_DRIVER_CAPABILITIES")
        .is_some_and(|caps| caps.split(',').any(|c| matches!(c.trim(), "compute" | "all")));
    let config = std::fs::read_to_string(Path::new(DRIVER).join("config.toml"))
        .map(|t| RuntimeConfig::parse(&t))
        .unwrap_or_default();
    let Some(visible) = config.devices(&spec, var("NVIDIA_VISIBLE_DEVICES"))? else {
        return Ok(());
    };
    // The node's cards, kept to the visible ones.
    let mut list: Value = serde_json::from_slice(
        &std::fs::read(Path::new(DRIVER).join("nvml.json")).context("reading the node's card list")?,
    )?;
    let cards = visible_cards(list["cards"].take(), &visible);
    list["cards"] = cards;
    list["processDir"] = json!(PROCS_TARGET);
    let list_file = bundle.join("nano-gpu-fake-nvml.json");
    std::fs::write(&list_file, serde_json::to_vec(&list)?)?;

    // A pod's sandbox (its pause container) gets the pod's annotations too, and its spec may have no
    // env (an image without one) or no mounts.
    if spec["mounts"].is_null() {
        spec["mounts"] = json!([]);
    }
    if spec["process"]["env"].is_null() {
        spec["process"]["env"] = json!([]);
    }
    let mounts = spec["mounts"].as_array_mut().context("spec without mounts")?;
    let mut driver = vec![
        (Path::new(DRIVER).join("libnvidia-ml.so.1"), NVML_TARGET.into(), "ro"),
        (list_file, PathBuf::from(CARDS_TARGET), "ro"),
        (Path::new(DRIVER).join("procs"), PathBuf::from(PROCS_TARGET), "rw"),
    ];
    if compute && Path::new(DRIVER).join(MPS_CONTROL).is_file() {
        driver.push((Path::new(DRIVER).join(MPS_CONTROL), Path::new("/usr/bin").join(MPS_CONTROL), "ro"));
    }
    for (source, target, mode) in driver {
        mounts.push(json!({
            "destination": target,
            "type": "bind",
            "source": source,
            "options": ["rbind", mode, "nosuid", "nodev"],
        }));
    }
    spec["process"]["env"]
        .as_array_mut()
        .context("spec without env")?
        .push(json!(format!("FAKE_NVML_CONFIG={CARDS_TARGET}")));
    std::fs::write(&file, serde_json::to_vec(&spec)?)?;
    Ok(())
}

/// The keys of the NVIDIA runtime's configuration that decide where a container's device list comes
/// from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RuntimeConfig {
    /// `accept-nvidia-visible-devices-envvar-when-unprivileged`.
    envvar_when_unprivileged: bool,
    /// `accept-nvidia-visible-devices-as-volume-mounts`.
    volume_mounts: bool,
    /// `nvidia-container-runtime.mode` is `cdi`.
    cdi: bool,
    /// `nvidia-container-runtime.modes.cdi.annotation-prefixes`.
    annotation_prefixes: Vec<String>,
}

impl Default for RuntimeConfig {
    /// The toolkit's defaults.
    fn default() -> Self {
        RuntimeConfig {
            envvar_when_unprivileged: true,
            volume_mounts: false,
            cdi: false,
            annotation_prefixes: vec!["cdi.k8s.io/".into()],
        }
    }
}

/// The CDI kinds the stand-in resolves to the node's cards.
const CDI_KINDS: [&str; 2] = ["runtime.nvidia.com/gpu", "nvidia.com/gpu"];

/// Where the runtime reads a device list from mounts.
const DEVICE_MOUNTS: &str = "/var/run/nvidia-container-devices";

impl RuntimeConfig {
    /// The keys of a `config.toml` the stand-in reads (one `key = value` a line; strings in double
    /// quotes, a list of them in brackets).
    fn parse(text: &str) -> Self {
        let mut config = RuntimeConfig::default();
        let mut section = String::new();
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.trim().to_owned();
                continue;
            }
            let Some((key, value)) = line.split_once('=') else { continue };
            let (key, value) = (key.trim(), value.trim());
            let strings = || -> Vec<String> {
                value
                    .trim_matches(['[', ']'])
                    .split(',')
                    .map(|s| s.trim().trim_matches('"').to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            };
            match (section.as_str(), key) {
                ("", "accept-nvidia-visible-devices-envvar-when-unprivileged") => {
                    config.envvar_when_unprivileged = value == "true"
                }
                ("", "accept-nvidia-visible-devices-as-volume-mounts") => {
                    config.volume_mounts = value == "true"
                }
                ("nvidia-container-runtime", "mode") => config.cdi = value.trim_matches('"') == "cdi",
                ("nvidia-container-runtime.modes.cdi", "annotation-prefixes") => {
                    config.annotation_prefixes = strings()
                }
                _ => {}
            }
        }
        config
    }

    /// The container's device list (`all` or comma-separated names), or `None` for no card, from its
    /// OCI `spec` and its `NVIDIA_VISIBLE_DEVICES` (the last value); an error where the real runtime
    /// fails the container (a CDI name it cannot resolve).
    fn devices(&self, spec: &Value, env: Option<String>) -> Result<Option<String>> {
        if self.cdi {
            let annotated = self.devices_from_annotations(spec)?;
            if !annotated.is_empty() {
                return Ok(Some(annotated.join(",")));
            }
        }
        if self.volume_mounts {
            let mounted = devices_from_mounts(spec);
            if !mounted.is_empty() {
                return Ok(Some(mounted.join(",")));
            }
        }
        let Some(env) = env.filter(|v| !matches!(v.as_str(), "" | "void" | "none")) else { return Ok(None) };
        Ok((self.envvar_when_unprivileged || privileged(spec)).then_some(env))
    }

    /// The cards (`all`, indexes or UUIDs) that the spec's annotations under the CDI prefixes name.
    fn devices_from_annotations(&self, spec: &Value) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for (key, value) in spec["annotations"].as_object().into_iter().flatten() {
            if !self.annotation_prefixes.iter().any(|p| key.starts_with(p.as_str())) {
                continue;
            }
            for name in value.as_str().unwrap_or_default().split(',') {
                let Some((kind, device)) =
                    name.split_once('=').filter(|(k, d)| k.contains('/') && !d.is_empty())
                else {
                    anyhow::bail!("invalid device name {name:?} in annotation {key:?}");
                };
                if !CDI_KINDS.contains(&kind) {
                    anyhow::bail!("unresolvable CDI devices {name}");
                }
                if !names.iter().any(|n| n == device) {
                    names.push(device.to_owned());
                }
            }
        }
        Ok(names)
    }
}

/// Whether the container is privileged as the toolkit judges it: `CAP_SYS_ADMIN` in its bounding set.
fn privileged(spec: &Value) -> bool {
    spec["process"]["capabilities"]["bounding"]
        .as_array()
        .is_some_and(|caps| caps.iter().any(|c| c == "CAP_SYS_ADMIN"))
}

/// The device names of `/dev/null` mounts under [`DEVICE_MOUNTS`], each destination once, CDI and IMEX
/// names aside.
fn devices_from_mounts(spec: &Value) -> Vec<String> {
    let clean = |p: &str| Path::new(p).components().collect::<PathBuf>();
    let root = clean(DEVICE_MOUNTS);
    let mut seen = std::collections::HashSet::new();
    let mut devices = Vec::new();
    for m in spec["mounts"].as_array().into_iter().flatten() {
        let (Some(source), Some(destination)) = (m["source"].as_str(), m["destination"].as_str()) else {
            continue;
        };
        let destination = clean(destination);
        if clean(source) != Path::new("/dev/null") || !seen.insert(destination.clone()) {
            continue;
        }
        let Ok(device) = destination.strip_prefix(&root) else { continue };
        let device = device.to_string_lossy().into_owned();
        if device.is_empty() || device.starts_with("cdi/") || device.starts_with("imex/") {
            continue;
        }
        devices.push(device);
    }
    devices
}

/// The cards of `cards` (a JSON array) that `visible` names: `all`, or a comma list of UUIDs or
/// indexes, as the real runtime takes them.
fn visible_cards(cards: Value, visible: &str) -> Value {
    let Value::Array(cards) = cards else { return Value::Array(vec![]) };
    if visible == "all" {
        return Value::Array(cards);
    }
    let wanted: Vec<&str> = visible.split(',').map(str::trim).collect();
    let named =
        |(i, c): &(usize, Value)| wanted.iter().any(|w| c["uuid"].as_str() == Some(w) || i.to_string() == *w);
    Value::Array(cards.into_iter().enumerate().filter(named).map(|(_, c)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_bundle_of_a_create_is_found_past_runc_s_global_flags() {
        let shim = args(
            "--root /run/containerd/runc/k8s.io --log /x/log.json --log-format json create --bundle /b/1 --pid-file /x/pid id",
        );
        assert_eq!(creating(&shim), Some(PathBuf::from("/b/1")));
        assert_eq!(creating(&args("create -b /b/2 id")), Some(PathBuf::from("/b/2")));
        assert_eq!(creating(&args("--systemd-cgroup create --bundle=/b/3 id")), Some(PathBuf::from("/b/3")));
        // Other commands pass through untouched, even with a --bundle-like word after them.
        assert_eq!(creating(&args("--root /r start id")), None);
        assert_eq!(creating(&args("--log /x state --bundle /b id")), None);
    }

    fn devices(config: &RuntimeConfig, spec: &Value, env: Option<String>) -> Option<String> {
        config.devices(spec, env).unwrap()
    }

    fn spec(mounts: &[(&str, &str)], bounding: &[&str]) -> Value {
        let mounts: Vec<Value> =
            mounts.iter().map(|(s, d)| json!({"source": s, "destination": d, "type": "bind"})).collect();
        json!({"mounts": mounts, "process": {"capabilities": {"bounding": bounding}}})
    }

    #[test]
    fn the_device_list_follows_the_toolkit_s_rules() {
        let secure = RuntimeConfig::parse(
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n\
             accept-nvidia-visible-devices-as-volume-mounts = true\n[nvidia-container-cli]\nldconfig = \"x\"\n",
        );
        assert_eq!(
            secure,
            RuntimeConfig {
                envvar_when_unprivileged: false,
                volume_mounts: true,
                ..RuntimeConfig::default()
            }
        );
        assert_eq!(RuntimeConfig::parse("# nothing set\n"), RuntimeConfig::default());
        let all = Some("all".to_owned());
        let mounted = spec(
            &[
                ("/dev/null", "/var/run/nvidia-container-devices/GPU-a"),
                ("/dev/null", "/var/run/nvidia-container-devices/GPU-a/"),
                ("/dev/null", "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu=0"),
                ("/tmp/x", "/var/run/nvidia-container-devices/GPU-b"),
                ("/dev/null", "/elsewhere/GPU-c"),
            ],
            &["CAP_CHOWN"],
        );
        // The mounts win over the env, and only /dev/null ones under the root count.
        assert_eq!(devices(&secure, &mounted, all.clone()), Some("GPU-a".into()));
        // No mounts: the env of an unprivileged container is ignored, a privileged one's is not.
        assert_eq!(devices(&secure, &spec(&[], &["CAP_CHOWN"]), all.clone()), None);
        assert_eq!(devices(&secure, &spec(&[], &["CAP_SYS_ADMIN"]), all.clone()), all);
        // The toolkit's defaults: the env counts for anyone, the mounts are not read.
        let default = RuntimeConfig::default();
        assert_eq!(devices(&default, &mounted, all.clone()), all);
        assert_eq!(devices(&default, &mounted, None), None);
        for nothing in ["", "void", "none"] {
            assert_eq!(devices(&default, &spec(&[], &[]), Some(nothing.into())), None);
        }
    }

    #[test]
    fn in_cdi_mode_the_annotations_name_the_cards_before_anything_else() {
        let cdi = RuntimeConfig::parse(
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n\
             accept-nvidia-visible-devices-as-volume-mounts = true\n\
             [nvidia-container-runtime]\nmode = \"cdi\"\n",
        );
        assert!(cdi.cdi && cdi.annotation_prefixes == ["cdi.k8s.io/"], "{cdi:?}");
        let annotated = |annotations: Value| {
            let mut s = spec(&[("/dev/null", "/var/run/nvidia-container-devices/GPU-a")], &["CAP_CHOWN"]);
            s["annotations"] = annotations;
            s
        };
        // Unprivileged, a pod's annotation wins over the device plugin's mounts.
        let all = annotated(json!({"cdi.k8s.io/x": "runtime.nvidia.com/gpu=all"}));
        assert_eq!(devices(&cdi, &all, None), Some("all".into()));
        let two = annotated(json!({"cdi.k8s.io/a": "nvidia.com/gpu=0,nvidia.com/gpu=GPU-b", "other/b": "x"}));
        assert_eq!(devices(&cdi, &two, None), Some("0,GPU-b".into()));
        // Other annotations, or none: the mounts as before.
        let none = annotated(json!({"example.com/cdi": "nvidia.com/gpu=all"}));
        assert_eq!(devices(&cdi, &none, None), Some("GPU-a".into()));
        // A name no spec holds, or one not fully qualified, fails the container.
        let unknown = annotated(json!({"cdi.k8s.io/x": "vendor.example/gpu=0"}));
        assert!(cdi.devices(&unknown, None).unwrap_err().to_string().contains("unresolvable"));
        let bare = annotated(json!({"cdi.k8s.io/x": "all"}));
        assert!(cdi.devices(&bare, None).unwrap_err().to_string().contains("invalid device name"));
        // In the legacy (and auto) mode, and with no prefix configured, annotations are not read.
        let legacy = RuntimeConfig { cdi: false, ..cdi.clone() };
        assert_eq!(devices(&legacy, &all, None), Some("GPU-a".into()));
        let prefixes = RuntimeConfig::parse(
            "[nvidia-container-runtime]\nmode = \"cdi\"\n[nvidia-container-runtime.modes.cdi]\nannotation-prefixes = []\n",
        );
        assert!(prefixes.cdi && prefixes.annotation_prefixes.is_empty(), "{prefixes:?}");
        assert_eq!(devices(&prefixes, &all, None), None);
    }

    #[test]
    fn only_the_visible_cards_are_kept() {
        let cards = json!([{"uuid": "GPU-a"}, {"uuid": "GPU-b"}, {"uuid": "GPU-c"}]);
        assert_eq!(visible_cards(cards.clone(), "all"), cards);
        assert_eq!(visible_cards(cards.clone(), "GPU-c, 0"), json!([{"uuid": "GPU-a"}, {"uuid": "GPU-c"}]));
        assert_eq!(visible_cards(cards, "GPU-z"), json!([]));
    }
}
