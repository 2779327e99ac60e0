//! Helpers shared by the cross-crate tests in `tests/`: where the shared data lives.

use std::path::PathBuf;

/// The openb trace folder: `$NANO_GPU_SHARED/traces/openb`, by default `../shared` beside the repository.
pub fn openb_dir() -> PathBuf {
    let shared = std::env::var_os("NANO_GPU_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    shared.join("traces/openb")
}
