//! The `nano-gpu-allocator` binary driven as a user drives it.

use std::process::Command;

fn allocator() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nano-gpu-allocator"))
}

#[test]
fn simulate_prints_one_json_document_with_a_point_per_arrived_percent() {
    let out = allocator()
        .args(["simulate", "--policy", "fgd", "--policy", "bestfit", "--seeds", "42..43", "--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies = doc["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 2);
    assert_eq!(policies[0]["policy"], "fgd");
    assert_eq!(policies[0]["through_extender"], false);
    assert_eq!(policies[0]["seeds"], serde_json::json!([42, 43]));
    let curve = policies[0]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 131);
    for (x, p) in curve.iter().enumerate() {
        assert_eq!(p["arrived_pct"], x);
    }
    // At 50 % arrived on the synthetic cluster everything fits: unallocated is 50 % within binning.
    let at50 = curve[50]["unallocated_pct_median"].as_f64().unwrap();
    assert!((at50 - 50.0).abs() < 1.5, "{at50}");
    for key in ["unallocated_pct_q25", "unallocated_pct_q75", "frag_pct_median"] {
        assert!(curve[100][key].is_number(), "{key}");
    }
    assert!(policies[0]["wall_ms"].is_u64() && policies[0]["failed_pods_median"].is_number());
}

#[test]
fn simulate_writes_an_svg_plot_and_a_readable_table() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("plot.svg");
    let out = allocator()
        .args(["simulate", "--policy", "all", "--seeds", "7", "--plot"])
        .arg(&svg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    for name in nano_gpu_engine::policy::NAMES {
        assert!(table.lines().any(|l| l.starts_with(name)), "{name} missing from\n{table}");
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(plot.matches("<polyline").count(), nano_gpu_engine::policy::NAMES.len() + 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_malformed_csv_row_is_an_error_naming_file_and_line() {
    let dir = std::env::temp_dir().join(format!("nano-gpu-csv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nodes = dir.join("nodes.csv");
    let pods = dir.join("pods.csv");
    std::fs::write(&nodes, "sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\n").unwrap();
    std::fs::write(
        &pods,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,500\np2,1000,lots,1,500\n",
    )
    .unwrap();
    let out =
        allocator().args(["simulate", "--nodes"]).arg(&nodes).arg("--pods").arg(&pods).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:3: memory_mib \"lots\" is not a non-negative integer", pods.display())),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_policies_and_bad_seeds_are_refused_clearly() {
    let out = allocator().args(["simulate", "--policy", "magic"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy \"magic\""));
    let out = allocator().args(["simulate", "--seeds", "9..3"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seeds \"9..3\""));
}

#[test]
fn serve_flags_that_cannot_hold_are_refused_before_anything_starts() {
    // Each refused as clap refuses a malformed value (exit 2), naming the flag and why; no API
    // server is needed to get there.
    for (args, why) in [
        (&["serve", "--listen", "0.0.0.0:8888"][..], "must listen on loopback"),
        (&["serve", "--operator-listen", "10.0.0.1:8890"][..], "they stay on loopback"),
        (&["serve", "--policy", "magic"][..], "unknown policy \"magic\""),
        (&["serve", "--policy", "fgd+first-fit"][..], "model kube-scheduler's DRA card choice"),
        (&["serve", "--load-refresh-seconds", "0"][..], "--load-refresh-seconds"),
        (&["simulate", "--tune", "0"][..], "must be in (0, 10]"),
    ] {
        let out = allocator().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}
