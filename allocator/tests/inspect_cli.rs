//! `nano-gpu-allocator inspect` against a (fake) API server, through a kubeconfig as kubectl reads it.

use nano_gpu_tests::fake_api::{FakeApi, Objects};
use serde_json::json;
use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_prints_every_card_with_its_pods_and_warns_about_bad_annotations() {
    let inventory = json!({"v": 1, "gpus": [
        {"index": 0, "uuid": "GPU-0", "vendor": "nvidia", "model": "Tesla T4", "memoryMiB": 15360, "healthy": true},
        {"index": 1, "uuid": "GPU-1", "vendor": "nvidia", "model": "Tesla T4", "memoryMiB": 15360, "healthy": true}]});
    let assignment = json!({"v": 1, "node": "n1", "at": "t", "containers": {"main": [{"uuid": "GPU-1", "index": 1, "percent": 30, "memoryMiB": 2048}]}});
    let api = FakeApi::start(Objects {
        nodes: vec![json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "annotations": {"nano-gpu/gpus": inventory.to_string()}},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "nano-gpu/gpu-percent": "200"}}})],
        pods: vec![
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "train", "namespace": "ml", "uid": "u1", "annotations": {"nano-gpu/assignment": assignment.to_string()}},
                "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {"nano-gpu/gpu-percent": "30", "nano-gpu/gpu-memory": "2048"}}}]}, "status": {"phase": "Running"}}),
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "broken", "namespace": "ml", "uid": "u2", "annotations": {"nano-gpu/assignment": "{"}},
                "spec": {"nodeName": "elsewhere", "containers": [{"name": "main", "resources": {"limits": {"nano-gpu/gpu-percent": "30"}}}]}, "status": {"phase": "Running"}}),
            // Placed by gpushare before the move: counted only as the cluster runs, with --gpushare.
            json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "legacy", "namespace": "ml", "uid": "u3",
                    "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_POD": "4"}},
                "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {"aliyun.com/gpu-mem": "4"}}}]}, "status": {"phase": "Running"}}),
        ],
        ..Objects::default()
    })
    .await
    .unwrap();
    let dir = std::env::temp_dir().join(format!("nano-gpu-inspect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kubeconfig"), api.kubeconfig()).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    let run = move |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_nano-gpu-allocator"))
            .arg("inspect")
            .args(args)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap()
    };
    let out = tokio::task::spawn_blocking(move || {
        (
            run(&[]),
            run(&["--node", "n1", "--format", "json"]),
            run(&["--gpushare", "gib", "--format", "json"]),
        )
    })
    .await
    .unwrap();
    let (table, json_out, gpushare) = out;
    assert!(table.status.success(), "{}", String::from_utf8_lossy(&table.stderr));
    let text = String::from_utf8(table.stdout).unwrap();
    let card1 = text.lines().find(|l| l.contains("ml/train")).unwrap_or_else(|| panic!("{text}"));
    assert!(card1.contains("   30 ") && card1.contains("2048/15360"), "{card1}");
    let stderr = String::from_utf8_lossy(&table.stderr);
    assert!(stderr.contains("warning: Pod ml/broken: nano-gpu/assignment: .: not JSON"), "{stderr}");
    let view: serde_json::Value = serde_json::from_slice(&json_out.stdout).unwrap();
    assert_eq!(view["nodes"][0]["cards"][1]["percentFree"], 70);
    assert_eq!(view["nodes"][0]["cards"][0]["pods"], json!([]), "without --gpushare: {}", view["nodes"][0]);
    let view: serde_json::Value = serde_json::from_slice(&gpushare.stdout).unwrap();
    let card0 = &view["nodes"][0]["cards"][0];
    assert_eq!(
        (card0["pods"].clone(), card0["memoryFreeMiB"].clone()),
        (json!(["ml/legacy"]), json!(15360 - 4096)),
        "{card0}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
