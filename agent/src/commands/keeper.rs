//! `keeper`: the agent's parent process, holding the kubelet's side of its device plugins
//! ([`crate::kubelet::keeper`]) while the agent runs as its child.

use super::until_terminated;
use crate::commands::flags::Flags;
use crate::kubelet::{keeper, register};
use std::process::ExitCode;
use std::time::Duration;

/// `keeper`: the kubelet's side of the agent's device plugins, until SIGTERM.
pub fn keeper(flags: &Flags) -> ExitCode {
    let Some(backend) = flags.backend_dir.clone() else {
        eprintln!(
            "nano-gpu-agent: keeper: --backend-dir (NANO_GPU_BACKEND_DIR) names where the agent serves"
        );
        return ExitCode::FAILURE;
    };
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("nano-gpu-agent: keeper: finding its own program to run the agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The agent: the same flags (and environment), without the subcommand.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(at) = args.iter().rposition(|a| a == "keeper") {
        args.remove(at);
    }
    // The container's memory limit, read from its own cgroup: the agent is stopped under it (see
    // keeper::memory).
    let memory =
        keeper::memory::own_limit(std::path::Path::new("/sys/fs/cgroup")).map(keeper::memory::Guard::new);
    let keeper = keeper::Keeper {
        plugin_dir: flags.plugin_dir.clone(),
        backend,
        instance: flags.instance.clone(),
        resources: flags.resources(),
        patience: Duration::from_secs(flags.keeper_patience_seconds),
        timing: register::Timing::default(),
        agent: Some(keeper::AgentProcess { program, args, memory }),
    };
    until_terminated(flags, "keeper: ", |_, stopped| async move {
        keeper::keep(keeper, stopped).await.map_err(|e| e.to_string())
    })
}
