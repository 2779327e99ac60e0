//! The real-GPU check (`hack/gpu-check.sh`, `src/bin/gpu-check`) run here as on a GPU machine, against
//! the fake NVML and the harness's `nvidia-smi` and `nvidia-cuda-mps-control` stand-ins, so the script
//! cannot rot between the sessions that have a card: every section runs, the inventory matches what
//! `nvidia-smi` says, and the parts that need CUDA say why they were skipped.

use nano_gpu_tests::{fake_nvml, workspace_binary};
use serde_json::Value;
use std::path::Path;

#[test]
fn the_real_gpu_check_runs_against_the_fake_nvml() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-gpu-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let limits = dir.join("limits.log");
    let config = dir.join("nvml.json");
    let doc = serde_json::json!({
        "cards": [
            {"uuid": "GPU-0a1b", "name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559,
             "pciBusId": "00000000:3B:00.0", "computeCapability": "9.0"},
            {"uuid": "GPU-2c3d", "name": "NVIDIA A100-SXM4-40GB", "memoryMiB": 40960, "mig": true,
             "computeCapability": "8.0"}
        ],
        "memoryLimitLog": limits,
    });
    std::fs::write(&config, doc.to_string()).unwrap();
    std::fs::create_dir_all(dir.join("lib")).unwrap();
    std::os::unix::fs::symlink(fake_nvml(), dir.join("lib/libnvidia-ml.so.1")).unwrap();
    let bin = workspace_binary("gpu-check");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/gpu-check.sh");
    let out = dir.join("out");
    let run = std::process::Command::new("bash")
        .arg(&script)
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .arg("--nvidia-smi")
        .arg(workspace_binary("nvidia-smi"))
        .arg("--mps-control")
        .arg(workspace_binary("nvidia-cuda-mps-control"))
        .arg("--work")
        .arg(dir.join("work"))
        .env("GPU_CHECK_BIN", bin.parent().unwrap())
        .env("OUT", &out)
        .env("FAKE_NVML_CONFIG", &config)
        // The stand-in nvidia-smi loads NVML by its soname, as the real one does.
        .env("LD_LIBRARY_PATH", dir.join("lib"))
        .output()
        .expect("bash");
    let log = std::fs::read_to_string(out.join("check.log")).unwrap_or_default();
    assert!(run.status.success(), "{}\n{log}", String::from_utf8_lossy(&run.stderr));
    let printed: Value = serde_json::from_slice(&run.stdout).expect("the report on stdout");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(printed, report, "stdout and report.json say the same");
    for raw in ["machine.txt", "nvidia-smi-q.xml", "raw.log", "check.log"] {
        assert!(out.join(raw).is_file(), "{raw} kept");
    }

    let env = &report["environment"];
    assert_eq!(env["ok"], true, "{env}");
    assert_eq!((env["driver"].as_str(), env["nvml"].as_str()), (Some("550.54.15"), Some("12.550.54.15")));
    assert_eq!(env["cuda_driver"], "12040");

    let inventory = &report["inventory"];
    assert_eq!(inventory["ok"], true, "the agent's inventory is what nvidia-smi says: {inventory}");
    let cards = inventory["cards"].as_array().unwrap();
    assert_eq!(cards.len(), 2);
    assert_eq!(cards[0]["compute_capability"], "9.0");
    assert_eq!(cards[0]["pci"], "00000000:3B:00.0");
    assert_eq!(cards[0]["memory_mib"], 81559);
    assert_eq!((cards[0]["mig"].as_bool(), cards[1]["mig"].as_bool()), (Some(false), Some(true)));
    assert!(inventory["annotation"].as_str().unwrap().contains("\"uuid\":\"GPU-0a1b\""));

    assert_eq!(report["xid"]["ok"], true, "XID events registered: {}", report["xid"]);

    // No PyTorch with a CUDA device here: the CUDA parts say so rather than pass or fail.
    if report["torch"].get("Err").is_some() {
        assert_eq!(report["usage"]["ok"], Value::Null);
        assert!(report["usage"]["reason"].as_str().unwrap().starts_with("skipped"), "{}", report["usage"]);
    }

    // The fake NVML has the driver's memory-limit function; where this machine has cgroup v2, the
    // check sets a 2 GiB limit on a cgroup of its own, which the fake records.
    let limit = &report["memory_limit"];
    assert_eq!(limit["available"], true, "{limit}");
    if limit["set"]["Ok"] == "accepted" {
        let line = std::fs::read_to_string(&limits).unwrap();
        assert!(line.contains("\"hardLimit\":2147483648") && line.contains("nano-gpu-check-"), "{line}");
    } else {
        assert!(
            limit["reason"].as_str().is_some_and(|r| r.contains("cgroup v2"))
                || limit["set"].get("Err").is_some()
        );
    }

    // The agent's MPS supervisor started the control daemon for the card outside MIG mode, and it was
    // told to quit at the end.
    let mps = &report["mps"];
    assert_eq!(mps["card"], "GPU-0a1b", "{mps}");
    assert!(mps["daemon_pid"].as_u64().is_some(), "{mps}");
    assert_eq!(mps["supervisor_stopped"], "stopped; its daemon told to quit");
    // The mount namespace a confined client runs in (as a share's container): its own /dev/shm, the
    // pipe directory read-only. It takes root (unshare, mount), as on the GPU machine.
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    if root {
        assert_eq!(mps["confinement"]["ok"], true, "{}", mps["confinement"]);
    }
    assert!(mps["pipe_dir_daemon_alone"].is_object(), "{mps}");
    assert_eq!(mps["daemon_after_stop"]["Err"], "gone");
    let _ = std::fs::remove_dir_all(&dir);
}
