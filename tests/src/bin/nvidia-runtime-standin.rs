//! Stands in for the NVIDIA container runtime on the harness's real nodes (`hack/nodes.sh`), where
//! there is no GPU and no driver: containerd runs it in place of runc. Like
//! `nvidia-container-runtime`, it edits the OCI spec of a container whose environment sets
//! `NVIDIA_VISIBLE_DEVICES`, then hands every call to runc unchanged. Where the real one mounts the
//! driver's `libnvidia-ml.so.1` and the device nodes of the visible cards, this one mounts the
//! workspace's fake NVML (`libfakenvml.so`) at the driver library's path and a card list holding
//! only the visible cards (`all`: every card of the node), named by `FAKE_NVML_CONFIG`.
//!
//! The node's fake driver lives in the node's own `/var/lib/nano-gpu-fake-driver/`:
//! `libnvidia-ml.so.1` and `nvml.json` (the node's cards, the fake NVML's format).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{Value, json};

const DRIVER: &str = "/var/lib/nano-gpu-fake-driver";
/// Where the NVIDIA runtime puts the driver's NVML in a Debian-based image.
const NVML_TARGET: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
const CARDS_TARGET: &str = "/run/nano-gpu-fake-driver/nvml.json";

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
    let env: Vec<String> = spec["process"]["env"]
        .as_array()
        .map(|e| e.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let Some(visible) = env.iter().rev().find_map(|e| e.strip_prefix("NVIDIA_VISIBLE_DEVICES=")) else {
        return Ok(());
    };
    if matches!(visible, "" | "void" | "none") {
        return Ok(());
    }
    // The node's cards, kept to the visible ones (by UUID or index, as the real runtime takes them).
    let all: Value = serde_json::from_slice(
        &std::fs::read(Path::new(DRIVER).join("nvml.json")).context("reading the node's card list")?,
    )?;
    let cards = all["cards"].as_array().cloned().unwrap_or_default();
    let cards: Vec<Value> = if visible == "all" {
        cards
    } else {
        let wanted: Vec<&str> = visible.split(',').map(str::trim).collect();
        cards
            .into_iter()
            .enumerate()
            .filter(|(i, c)| wanted.iter().any(|w| c["uuid"].as_str() == Some(w) || i.to_string() == *w))
            .map(|(_, c)| c)
            .collect()
    };
    let mut visible_list = all.clone();
    visible_list["cards"] = Value::Array(cards);
    let list = bundle.join("nano-gpu-fake-nvml.json");
    std::fs::write(&list, serde_json::to_vec(&visible_list)?)?;

    let mounts = spec["mounts"].as_array_mut().context("spec without mounts")?;
    for (source, target) in [
        (Path::new(DRIVER).join("libnvidia-ml.so.1"), NVML_TARGET.into()),
        (list, PathBuf::from(CARDS_TARGET)),
    ] {
        mounts.push(json!({
            "destination": target,
            "type": "bind",
            "source": source,
            "options": ["rbind", "ro", "nosuid", "nodev"],
        }));
    }
    spec["process"]["env"]
        .as_array_mut()
        .context("spec without env")?
        .push(json!(format!("FAKE_NVML_CONFIG={CARDS_TARGET}")));
    std::fs::write(&file, serde_json::to_vec(&spec)?)?;
    Ok(())
}
