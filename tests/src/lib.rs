//! Helpers shared by the cross-crate tests and benchmarks in `tests/`: where the shared data lives,
//! a fake API server, and a small HTTP client for driving the extender.

pub mod fake_api;
pub mod http_client;

use std::path::PathBuf;

/// The openb trace folder: `$NANO_GPU_SHARED/traces/openb`, by default `../shared` beside the repository.
pub fn openb_dir() -> PathBuf {
    let shared = std::env::var_os("NANO_GPU_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    shared.join("traces/openb")
}

/// A workspace binary built next to the running test or benchmark (`target/<profile>/<name>`).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}
