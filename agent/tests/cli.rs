//! `nano-gpu-agent` driven as an operator drives it.

use std::process::Command;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nano-gpu-agent"))
}

#[test]
fn inventory_prints_the_annotation_and_labels_of_a_fake_node() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-agent-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gpus.json");
    std::fs::write(&file, r#"{"v":1,"gpus":[{"index":0,"uuid":"GPU-a","vendor":"nvidia","model":"NVIDIA A100-SXM4-80GB","memoryMiB":81920,"healthy":true},{"index":1,"uuid":"GPU-b","vendor":"nvidia","model":"NVIDIA A100-SXM4-80GB","memoryMiB":81920,"healthy":true}]}"#).unwrap();
    let out = agent().arg("--fake-inventory").arg(&file).arg("inventory").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["labels"]["nano-gpu/gpu.count"], "2");
    assert_eq!(doc["labels"]["nano-gpu/gpu.model"], "NVIDIA-A100-SXM4-80GB");
    let annotation: serde_json::Value = serde_json::from_str(doc["annotation"].as_str().unwrap()).unwrap();
    assert_eq!(annotation["gpus"][1]["uuid"], "GPU-b");
    // A broken file is an error naming it, never a panic.
    std::fs::write(&file, "{").unwrap();
    let out = agent().arg("--fake-inventory").arg(&file).arg("inventory").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gpus.json") && !err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn running_the_agent_says_it_is_not_implemented_yet() {
    let out = agent().arg("--sysfs-root").arg("/nonexistent").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not implemented yet"));
}
