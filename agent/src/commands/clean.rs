//! `nano-gpu-agent clean-node`: removes what nano-gpu left on a node's filesystem once its agents
//! and MPS daemons are gone. `kubectl nano-gpu uninstall` runs it in one pod per node, with the
//! host's directories mounted where [`Dirs`] says. What it removes is named in
//! [`nano_gpu_proto::install::node_files`]; nothing else is touched, and a link is removed, never
//! followed.

use nano_gpu_proto::install::node_files::{CDI_SPECS, DEVICE_PLUGINS, PLUGIN_DIR, PLUGINS_REGISTRY, RUN_DIR};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Where the host's directories are.
#[derive(Clone, Debug, clap::Args)]
pub struct Dirs {
    /// The host's `/run` (the MPS daemons' `nano-gpu/` is in it).
    #[arg(long, default_value = "/host/run")]
    pub host_run: PathBuf,
    /// The kubelet's root directory on the host (`/var/lib/kubelet` unless its `--root-dir` says
    /// otherwise): the device plugins' sockets and the DRA plugin's registration and directory.
    #[arg(long, default_value = "/host/kubelet")]
    pub host_kubelet: PathBuf,
    /// The host's CDI spec directory (`/var/run/cdi`): the DRA claims' specs.
    #[arg(long, default_value = "/host/cdi")]
    pub host_cdi: PathBuf,
}

/// Removes nano-gpu's files under `dirs`: the paths removed, or every failure (each with its path)
/// after trying all the others.
pub fn clean(dirs: &Dirs) -> Result<Vec<PathBuf>, String> {
    // Every kubelet has its device-plugin directory: without it, this is not the kubelet's root, and
    // finding nothing there would read as a clean node.
    let plugins = dirs.host_kubelet.join(DEVICE_PLUGINS.0);
    if !plugins.is_dir() {
        return Err(format!(
            "{} is not a directory: is {} the kubelet's root (its --root-dir)?",
            plugins.display(),
            dirs.host_kubelet.display()
        ));
    }
    let mut removed = Vec::new();
    let mut failed = Vec::new();
    let mut paths =
        vec![dirs.host_run.join(RUN_DIR), dirs.host_kubelet.join(PLUGIN_DIR.0).join(PLUGIN_DIR.1)];
    let prefixed = [
        (dirs.host_kubelet.join(DEVICE_PLUGINS.0), DEVICE_PLUGINS.1),
        (dirs.host_kubelet.join(PLUGINS_REGISTRY.0), PLUGINS_REGISTRY.1),
        (dirs.host_cdi.clone(), CDI_SPECS),
    ];
    for (dir, prefix) in prefixed {
        match entries_starting(&dir, prefix) {
            Ok(found) => paths.extend(found),
            Err(e) => failed.push(e),
        }
    }
    for path in paths {
        match remove(&path) {
            Ok(true) => removed.push(path),
            Ok(false) => {}
            Err(e) => failed.push(format!("{}: {e}", path.display())),
        }
    }
    if failed.is_empty() { Ok(removed) } else { Err(failed.join("; ")) }
}

/// Removes `path` (a directory with all in it; a link itself): whether it was there.
fn remove(path: &Path) -> std::io::Result<bool> {
    let gone = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => Err(e),
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
    };
    gone.map(|()| true)
}

/// The entries of `dir` whose names start with `prefix` (none if `dir` does not exist).
fn entries_starting(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>, String> {
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
        Ok(entries) => entries,
    };
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            paths.push(entry.path());
        }
    }
    paths.sort();
    Ok(paths)
}

/// `clean-node`: nano-gpu's files removed from the node, each named on stdout.
pub fn clean_node(dirs: &Dirs) -> ExitCode {
    match clean(dirs) {
        Ok(removed) if removed.is_empty() => {
            println!("nothing of nano-gpu on this node");
            ExitCode::SUCCESS
        }
        Ok(removed) => {
            removed.iter().for_each(|p| println!("removed {}", p.display()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nano-gpu-agent: clean-node: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for test `name`, removed when dropped.
    fn scratch(name: &str) -> crate::Scratch {
        crate::Scratch::new(&format!("clean-{name}"))
    }

    fn dirs(root: &Path) -> Dirs {
        Dirs { host_run: root.join("run"), host_kubelet: root.join("kubelet"), host_cdi: root.join("cdi") }
    }

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "x").unwrap();
    }

    #[test]
    fn removes_nano_gpus_files_and_nothing_beside_them() {
        let tmp = scratch("ours");
        let d = dirs(&tmp);
        let ours = [
            d.host_run.join(RUN_DIR).join("mps/GPU-1/pipe/control"),
            d.host_kubelet.join("device-plugins/nano-gpu.agent-x.sock"),
            d.host_kubelet.join("device-plugins/nano-gpu-gpushare.agent-x.sock"),
            d.host_kubelet.join("plugins_registry/gpu.nano-gpu.io-1-reg.sock"),
            d.host_kubelet.join("plugins/gpu.nano-gpu.io/dra.sock"),
            crate::kubelet::dra::cdi::path(&d.host_cdi, "0b4a"),
        ];
        let theirs = [
            d.host_run.join("containerd/containerd.sock"),
            d.host_kubelet.join("device-plugins/kubelet.sock"),
            d.host_kubelet.join("device-plugins/kubelet_internal_checkpoint"),
            d.host_kubelet.join("device-plugins/nvidia-gpu.sock"),
            d.host_kubelet.join("plugins_registry/gpu.nvidia.com-reg.sock"),
            d.host_kubelet.join("plugins/gpu.nvidia.com/dra.sock"),
            d.host_cdi.join("nvidia.yaml"),
        ];
        ours.iter().chain(&theirs).for_each(|p| touch(p));
        // A link of ours is removed, not what it points at.
        std::os::unix::fs::symlink(&theirs[0], d.host_kubelet.join("device-plugins/nano-gpu.link.sock"))
            .unwrap();

        let removed = clean(&d).unwrap();
        for p in &ours {
            assert!(!p.exists(), "{} left", p.display());
        }
        for p in &theirs {
            assert!(p.exists(), "{} removed", p.display());
        }
        assert!(!d.host_run.join(RUN_DIR).exists());
        assert!(!d.host_kubelet.join("plugins/gpu.nano-gpu.io").exists());
        assert_eq!(removed.len(), 7, "{removed:?}");
        // Again: nothing left to remove, and that is no error.
        assert_eq!(clean(&d).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_node_without_nano_gpus_files_has_nothing_to_remove() {
        let tmp = scratch("none");
        let d = dirs(&tmp);
        touch(&d.host_kubelet.join("device-plugins/kubelet.sock"));
        assert_eq!(clean(&d).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_kubelet_root_without_the_device_plugin_directory_is_refused() {
        let tmp = scratch("not-kubelet");
        let d = dirs(&tmp);
        touch(&d.host_run.join(RUN_DIR).join("mps/x"));
        let err = clean(&d).unwrap_err();
        assert!(err.contains("is not a directory: is") && err.contains("--root-dir"), "{err}");
        // Nothing was removed: the node keeps its keys and is tried again.
        assert!(d.host_run.join(RUN_DIR).join("mps/x").exists());
    }

    #[test]
    fn a_directory_that_cannot_be_read_is_named_and_the_rest_still_goes() {
        let tmp = scratch("unreadable");
        let d = dirs(&tmp);
        touch(&d.host_run.join(RUN_DIR).join("mps/x"));
        touch(&d.host_kubelet.join("device-plugins/kubelet.sock"));
        // The CDI "directory" is a file: reading it fails.
        touch(&d.host_cdi);
        let err = clean(&d).unwrap_err();
        assert!(err.contains(&d.host_cdi.display().to_string()), "{err}");
        assert!(!d.host_run.join(RUN_DIR).exists());
    }
}
