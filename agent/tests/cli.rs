//! `nano-gpu-agent` driven as an operator drives it.

use std::process::Command;

/// The agent without its probe port (tests run side by side).
fn agent() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nano-gpu-agent"));
    c.args(["--probe-listen", ""]);
    c
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
fn a_refused_registration_ends_the_agent_with_the_kubelets_reason() {
    use nano_gpu_proto::kubelet::deviceplugin::registration_server::{Registration, RegistrationServer};
    use nano_gpu_proto::kubelet::deviceplugin::{Empty, RegisterRequest};

    struct Refusing;
    #[tonic::async_trait]
    impl Registration for Refusing {
        async fn register(
            &self,
            _: tonic::Request<RegisterRequest>,
        ) -> Result<tonic::Response<Empty>, tonic::Status> {
            Err(tonic::Status::invalid_argument("unsupported version"))
        }
    }

    let dir = std::env::temp_dir().join(format!("nano-gpu-agent-refused-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("gpus.json"), r#"{"v":1,"gpus":[]}"#).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener =
        runtime.block_on(async { tokio::net::UnixListener::bind(dir.join("kubelet.sock")) }).unwrap();
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Refusing))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let out = agent()
        .arg("--plugin-dir")
        .arg(&dir)
        .arg("--fake-inventory")
        .arg(dir.join("gpus.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the kubelet refused the registration: unsupported version"), "{err}");
    drop(runtime);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inventory_reads_nvidia_cards_through_the_real_nvml_ffi_path() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-agent-nvml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("nvml.json");
    std::fs::write(&config, r#"{"cards":[
        {"uuid":"GPU-4b6a1f5e-0c61-6f0e-2a5c-3e1f0bb2d9a7","name":"Tesla T4","memoryMiB":15360,"pciBusId":"00000000:3B:00.0"},
        {"uuid":"GPU-9c1d2e3f-0000-1111-2222-333344445555","name":"NVIDIA A100-SXM4-80GB","memoryMiB":81920}]}"#).unwrap();
    let out = agent()
        .arg("--nvml-lib")
        .arg(nano_gpu_tests::fake_nvml())
        .arg("--sysfs-root")
        .arg(dir.join("no-sysfs"))
        .arg("inventory")
        .env("FAKE_NVML_CONFIG", &config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let inv: serde_json::Value = serde_json::from_str(doc["annotation"].as_str().unwrap()).unwrap();
    let gpus = inv["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0]["uuid"], "GPU-4b6a1f5e-0c61-6f0e-2a5c-3e1f0bb2d9a7");
    assert_eq!((gpus[0]["model"].as_str(), gpus[0]["memoryMiB"].as_u64()), (Some("Tesla T4"), Some(15360)));
    assert_eq!((gpus[1]["index"].as_u64(), gpus[1]["vendor"].as_str()), (Some(1), Some("nvidia")));
    // Mixed models: the label names the first of the tied models.
    assert_eq!(doc["labels"]["nano-gpu/gpu.model"], "Tesla-T4");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_nvml_library_is_reported_not_a_crash() {
    let out = agent()
        .args(["--nvml-lib", "/nonexistent/libnvidia-ml.so.1", "--sysfs-root", "/nonexistent", "inventory"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nvml: /nonexistent/libnvidia-ml.so.1:") && !err.contains("panicked"), "{err}");
    // The other backends still report (here: no cards).
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["labels"]["nano-gpu/gpu.count"], "0");
}

#[test]
fn a_period_of_zero_is_refused_not_taken_for_one() {
    for flag in ["--refresh-seconds", "--keeper-patience-seconds"] {
        let out = agent().args([flag, "0", "inventory"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains(&format!("invalid value '0' for '{flag}")), "{flag}: {err}");
    }
}
