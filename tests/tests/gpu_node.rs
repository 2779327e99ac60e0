//! The real GPU node's script (`hack/gpu-node.sh`) run here as on a GPU machine, so it cannot rot
//! between the sessions that have a card: `--dry-run --from-harness` starts its one-node cluster with
//! NVIDIA's own runtime (built from its Go module, in CDI mode) on one fake card (the fake NVML in a
//! CDI spec of the script's own, the harness's `nvidia-cuda-mps-control` stand-in where a driver's
//! programs are), installs nano-gpu from `deploy/` and runs every stage. Only the card is missing:
//! the probe finds no CUDA driver, so what the report's CUDA checks say is not judged here; what
//! nano-gpu did around them is: every stage ran, each pod was handed the card its assignment names
//! (its env), `kubectl nano-gpu inspect` and the agent's books agree while the shares run, a new
//! agent was Ready after the old one's deletion, a pod asking no GPU got none, and the node served
//! MPS with each share's limits in its env.

use nano_gpu_tests::cluster::clear_mps_dirs;
use serde_json::Value;
use std::path::Path;

/// The pods of `checks[key]`, a list of the script's per-pod judgements.
fn pods<'a>(checks: &'a Value, key: &str) -> &'a Vec<Value> {
    checks[key].as_array().unwrap_or_else(|| panic!("checks.{key} is no list: {checks}"))
}

/// The env event of one pod's probe.
fn env(pod: &Value) -> &Value {
    let events = pod["events"].as_array().unwrap_or_else(|| panic!("no events: {pod}"));
    events.iter().find(|e| e["event"] == "env").unwrap_or_else(|| panic!("no env event: {pod}"))
}

#[test]
fn the_real_gpu_node_script_runs_every_stage_on_a_fake_card() {
    // Its node's card is GPU-node-1-0, whose MPS directories on this machine another cluster's
    // node-1 may have left.
    clear_mps_dirs("node-1");
    let dir = std::env::temp_dir().join(format!("nano-gpu-gpu-node-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (out, work) = (dir.join("out"), dir.join("work"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/gpu-node.sh");
    let run = std::process::Command::new("bash")
        .arg(&script)
        .args(["--dry-run", "--from-harness"])
        .env("OUT", &out)
        .env("GPU_NODE_WORK", &work)
        .output()
        .expect("bash");
    let log = std::fs::read_to_string(out.join("gpu-node.log")).unwrap_or_default();
    let said = format!("{}\n{log}\n(logs in {})", String::from_utf8_lossy(&run.stderr), out.display());
    assert!(run.status.success(), "{said}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
        .unwrap_or_else(|e| panic!("report.json: {e}\n{said}"));

    let stages = report["stages"].as_object().unwrap();
    for stage in ["cluster-up", "shares", "whole-card", "after-restart", "no-gpu", "mps", "finished"] {
        assert_eq!(stages.get(stage), Some(&Value::from("done")), "stage {stage}: {report}\n{said}");
    }
    let checks = &report["checks"];

    // Each pod that asked a GPU was handed the card its assignment names, and only it.
    for key in ["shares", "whole_card_through_an_agent_restart", "share_after_the_restart", "mps"] {
        for pod in pods(checks, key) {
            let assignment: Value = serde_json::from_str(pod["assignment"].as_str().unwrap()).unwrap();
            let card = &assignment["containers"]["probe"][0]["uuid"];
            assert_eq!(env(pod)["NANO_GPU_CARDS"], *card, "{pod}");
            // The probe ran and found no CUDA driver, as here there is none.
            assert!(
                pod["events"].as_array().unwrap().iter().any(|e| e["event"] == "init" && e["ok"] == false)
            );
        }
    }
    assert_eq!(pods(checks, "shares").len(), 3);

    // The allocator's view (inspect) and the agent's books agree on the three shares.
    let books = &checks["inspect_and_agent_agree"];
    assert_eq!(books["ok"], true, "{books}");
    assert_eq!(books["inspect"].as_array().unwrap().len(), 4, "one card and three shares: {books}");

    let restart = &checks["agent_restart"];
    assert_eq!(restart["new_ready"], true, "{restart}");
    assert_ne!(restart["new"], restart["deleted"], "{restart}");

    let none = &pods(checks, "no_gpu")[0];
    assert_eq!(none["ok"], true, "{none}");
    assert_eq!(none["cards_seen"], Value::Array(vec![]));
    assert_eq!(env(none)["NANO_GPU_CARDS"], Value::Null, "{none}");

    // MPS: the daemon ran (the stand-in, found by the MPS pod where drivers put their programs), the
    // agent served the card again, and each share was given its limits and its card's pipe directory.
    assert_eq!(checks["mps_serving"], true, "{checks}");
    for pod in pods(checks, "mps") {
        let percent = pod["percent"].as_u64().unwrap().to_string();
        let env = env(pod);
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], Value::from(percent), "{pod}");
        assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/nvidia-mps", "{pod}");
        assert!(
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].as_str().is_some_and(|l| l.starts_with("0=")),
            "{pod}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    clear_mps_dirs("node-1");
}
