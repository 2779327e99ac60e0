//! A scratch directory for unit tests.

/// A fresh directory under the system's temporary directory for a unit test, removed when dropped.
pub(crate) struct Scratch(std::path::PathBuf);

impl Scratch {
    /// `nano-gpu-<name>-<pid>`, emptied first.
    pub(crate) fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("nano-gpu-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
