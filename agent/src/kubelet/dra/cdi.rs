//! The CDI specs of prepared claims: one file per claim in the node's CDI directory (`/var/run/cdi`),
//! one device per request, whose container edits are what the device plugin would have handed the
//! container (env, mounts, device nodes). A runtime with CDI (containerd 2, CRI-O) applies them when
//! the kubelet names the device.
//!
//! The files are the DRA front end's whole state: a claim is prepared while its file exists, so an
//! agent or kubelet restart loses nothing, and unprepare is removing it. Each is written to a
//! temporary name and renamed, so a runtime never reads half of one.

use super::prepare::Prepared;
use nano_gpu_proto::kubelet::deviceplugin::ContainerAllocateResponse;
use serde_json::{Value, json};
use std::io;
use std::path::{Path, PathBuf};

/// The CDI kind of the devices (`vendor/class`): a device is named `nano-gpu.io/claim=<claim uid>-<n>`.
pub const KIND: &str = "nano-gpu.io/claim";
/// The CDI version of the specs (mounts, env and device nodes need no newer one).
pub const VERSION: &str = "0.6.0";

/// The file of a claim's spec: `nano-gpu.io-claim_<uid>.json`, the name CDI's own tools give it.
pub fn path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("{}_{claim_uid}.json", KIND.replace('/', "-")))
}

/// The CDI device name of the claim's `n`th request.
pub fn device_name(claim_uid: &str, n: usize) -> String {
    format!("{claim_uid}-{n}")
}

/// The fully qualified CDI device ID the kubelet hands the runtime.
pub fn device_id(claim_uid: &str, n: usize) -> String {
    format!("{KIND}={}", device_name(claim_uid, n))
}

/// The claim's spec: one device per prepared request.
pub fn spec(claim_uid: &str, prepared: &[Prepared]) -> Value {
    let devices: Vec<Value> = prepared
        .iter()
        .enumerate()
        .map(|(n, p)| json!({ "name": device_name(claim_uid, n), "containerEdits": container_edits(&p.edits) }))
        .collect();
    json!({ "cdiVersion": VERSION, "kind": KIND, "devices": devices })
}

/// A device plugin's answer for one container as CDI container edits. CDI device IDs in it
/// (`nvidia.com/gpu=<uuid>` under the `cdi` device list) are not edits: the kubelet gets them beside
/// ours.
fn container_edits(r: &ContainerAllocateResponse) -> Value {
    // Sorted: the same claim always gives the same file.
    let mut env: Vec<String> = r.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.sort();
    let mounts: Vec<Value> = r
        .mounts
        .iter()
        .map(|m| {
            let access = if m.read_only { "ro" } else { "rw" };
            json!({ "hostPath": m.host_path, "containerPath": m.container_path,
                    "options": [access, "nosuid", "nodev", "bind"] })
        })
        .collect();
    let nodes: Vec<Value> = r
        .devices
        .iter()
        .map(|d| json!({ "path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions }))
        .collect();
    let mut edits = serde_json::Map::new();
    if !env.is_empty() {
        edits.insert("env".into(), env.into());
    }
    if !mounts.is_empty() {
        edits.insert("mounts".into(), mounts.into());
    }
    if !nodes.is_empty() {
        edits.insert("deviceNodes".into(), nodes.into());
    }
    Value::Object(edits)
}

/// Writes the claim's spec (whole or not at all).
pub fn write(dir: &Path, claim_uid: &str, spec: &Value) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = path(dir, claim_uid);
    let tmp = file.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(spec).map_err(io::Error::other)?)?;
    std::fs::rename(&tmp, &file)
}

/// Removes the claim's spec; one that is not there is already removed.
pub fn remove(dir: &Path, claim_uid: &str) -> io::Result<()> {
    match std::fs::remove_file(path(dir, claim_uid)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The UIDs of the claims prepared on this node (those with a spec file).
pub fn prepared(dir: &Path) -> io::Result<Vec<String>> {
    let prefix = format!("{}_", KIND.replace('/', "-"));
    let mut uids = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(uids),
        other => other?,
    };
    for entry in entries {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(uid) = name.strip_prefix(&prefix).and_then(|n| n.strip_suffix(".json")) {
            uids.push(uid.to_owned());
        }
    }
    uids.sort();
    Ok(uids)
}
