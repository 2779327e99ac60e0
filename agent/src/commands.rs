//! The agent's commands: the flags ([`flags`]), the default command that serves ([`serve`]), the
//! keeper ([`keeper`]), `clean-node` ([`clean`]), and the small ones here (`inventory`,
//! `mps-control`, `canary`), each run to its exit status by [`run`].

pub mod clean;
pub mod flags;
pub mod keeper;
pub mod serve;

use crate::cards::inventory;
use crate::node::enforce;
use flags::{Command, Flags};
use nano_gpu_proto::annotations::{NodeInventory, node_labels};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Runs the command `flags` name to its exit status.
pub fn run(flags: Flags) -> ExitCode {
    match &flags.command {
        Some(Command::Inventory) => print_inventory(&flags),
        Some(Command::MpsControl) => mps_control(&flags),
        Some(Command::Keeper) => keeper::keeper(&flags),
        Some(Command::Canary) => canary(&flags),
        Some(Command::CleanNode(dirs)) => clean::clean_node(dirs),
        None => serve::serve(&flags),
    }
}

/// `inventory`: the node's cards, as the `nano-gpu/gpus` annotation and labels would carry them.
fn print_inventory(flags: &Flags) -> ExitCode {
    let (cards, errors) = inventory::read_all(&flags.backends());
    for (backend, e) in &errors {
        eprintln!("nano-gpu-agent: {backend}: {e}");
    }
    let inv = NodeInventory::new(cards.into_iter().map(|c| c.info).collect());
    let doc = serde_json::json!({"annotation": inv.encode(), "labels": node_labels(&inv)});
    println!("{doc:#}");
    if errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// `mps-control`: the node's MPS daemons, until SIGTERM.
fn mps_control(flags: &Flags) -> ExitCode {
    // With a pipe directory of its own (a size-limited emptyDir), its card's daemon runs there.
    let mut layout = flags.mps_layout();
    layout.pipe_in = flags.mps_pipe_source.as_ref().map(|_| flags.mps_pipe_dir.clone());
    let supervisor = enforce::mps::Supervisor {
        layout,
        program: flags.mps_control.clone(),
        backends: flags.backends(),
        every: Duration::from_secs(2),
        exclusive: flags.mps_exclusive_process.then(|| flags.nvml_lib.clone()),
        shm_source: flags.mps_shm_source.clone(),
        pipe_source: flags.mps_pipe_source.clone(),
        card_index: flags.mps_card_index,
    };
    until_terminated(flags, "mps-control: ", |_, stopped| enforce::mps::supervise(supervisor, stopped))
}

/// `canary`: what this container sees, written to `--runtime-canary`, then wait for SIGTERM.
fn canary(flags: &Flags) -> ExitCode {
    let Some(out) = flags.runtime_canary.clone() else {
        eprintln!(
            "nano-gpu-agent: canary: --runtime-canary (NANO_GPU_RUNTIME_CANARY) names the report to write"
        );
        return ExitCode::FAILURE;
    };
    let (lib, dev) = (flags.nvml_lib.clone(), flags.dev_root.clone());
    until_terminated(flags, "canary: ", |_, _| crate::serve::canary::report(lib, dev, out))
}

/// Runs `body` on the agent's runtime (one worker; NVML and sysfs reads go to blocking threads)
/// with logging set up, giving it a stop signal (and its sender) that flips at SIGTERM or SIGINT;
/// an error it ends with is printed after `what`.
pub(crate) fn until_terminated<F, Fut>(flags: &Flags, what: &str, body: F) -> ExitCode
where
    F: FnOnce(Arc<watch::Sender<bool>>, watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    nano_gpu_runtime::init_logging(flags.log_format == "json");
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nano-gpu-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let (stop, stopped) = watch::channel(false);
        let stop = Arc::new(stop);
        let terminate = stop.clone();
        tokio::spawn(async move {
            nano_gpu_runtime::terminated().await;
            let _ = terminate.send(true);
        });
        body(stop, stopped).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nano-gpu-agent: {what}{e}");
            ExitCode::FAILURE
        }
    }
}
