//! The engine stays pure by construction, not by convention: built on its own, its normal
//! dependencies include no async runtime, Kubernetes client or API types, HTTP or gRPC framework.
//! Adding one (directly or through a feature of `nano-gpu-proto`) fails this test.

use std::process::Command;

/// Crates the engine must never reach: what would let a clock, a socket or an API call creep in.
const FORBIDDEN: &[&str] =
    &["tokio", "kube", "kube-client", "kube-runtime", "k8s-openapi", "axum", "tonic", "hyper", "hyper-util"];

/// The packages `package` depends on when built alone (features resolved for it only, as
/// `cargo build -p` does), from `cargo tree`.
fn normal_dependencies(package: &str) -> Vec<String> {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--frozen", "--manifest-path", manifest, "-p", package])
        .args(["-e", "normal", "--prefix", "none", "--format", "{p}"])
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&out.stderr));
    // Lines are `name vX.Y.Z [(path)] [(*)]`.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

fn forbidden_in(package: &str) -> Vec<String> {
    let mut found: Vec<String> =
        normal_dependencies(package).into_iter().filter(|d| FORBIDDEN.contains(&d.as_str())).collect();
    found.sort();
    found.dedup();
    found
}

#[test]
fn the_engine_depends_on_no_runtime_kubernetes_or_server_crate() {
    assert_eq!(forbidden_in("nano-gpu-engine"), Vec::<String>::new());
}

#[test]
fn the_check_sees_the_service_stack_where_it_is() {
    // The same check over the allocator service finds what the engine must not have, so an empty
    // answer above means "none", not "the check cannot see".
    let found = forbidden_in("nano-gpu-allocator");
    for expected in ["tokio", "kube", "k8s-openapi", "axum"] {
        assert!(
            found.iter().any(|f| f == expected),
            "{expected} not found in the allocator's tree: {found:?}"
        );
    }
}
