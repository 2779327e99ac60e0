//! `kubectl nano-gpu`: the kubectl plugin (kubectl runs `kubectl-nano_gpu` from `PATH` for
//! `kubectl nano-gpu ...`). It reads the cluster with the caller's kubeconfig and changes nothing:
//! `inspect` (every card and the pods on it), `top` (granted against used, from the agents' metrics)
//! `why POD` (for a waiting GPU pod, each node's reason and the pods whose end would make room) and
//! `check` (is nano-gpu installed and working, and if not, what to do). One command changes the
//! cluster: `uninstall` removes nano-gpu, with what deleting its manifests leaves.

use anyhow::Result;
use clap::{Parser, Subcommand};
use nano_gpu_allocator::commands::cli::{self, CheckArgs, InspectArgs, Kube, TopArgs, WhyArgs};

#[derive(Parser)]
#[command(name = "kubectl nano-gpu", version, about = "nano-gpu's view of a cluster's GPUs, for kubectl")]
struct Plugin {
    #[command(flatten)]
    kube: Kube,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every node's cards: model, percent and memory used and free, health, the pods on each.
    Inspect(InspectArgs),
    /// Granted against used GPU per pod, container and card, from every agent's metrics (through the
    /// API server's pod proxy: needs `get pods/proxy` in the agents' namespace).
    Top(TopArgs),
    /// For a GPU pod (a Pending one, above all): each node's reason it does not fit, by the
    /// allocator's own filter, and the fewest pods whose end would make room there.
    Why(WhyArgs),
    /// Is nano-gpu installed and working: GPU nodes labelled, agents Ready with healthy cards, the
    /// runtime keeping a pod's env away from cards, one device plugin per card, an allocator leading,
    /// the webhook trusting its CA, the certificate's end, kube-scheduler's version, Pod Security.
    /// Each failing line says what to do; exits 1 when one fails.
    Check(CheckArgs),
    /// Remove nano-gpu: its namespace (its agents stop), the objects it installed outside it, the
    /// ResourceSlices of its DRA driver, its files on each node (a pod per node runs
    /// `nano-gpu-agent clean-node`), its labels and annotations on Nodes; an Event on each pod left
    /// Pending for `nano-gpu-scheduler`. Running GPU containers keep their cards. Exits 1 when a
    /// step fails; run again, it does only what is left.
    Uninstall(nano_gpu_allocator::commands::uninstall::UninstallArgs),
}

fn main() -> Result<()> {
    let plugin = Plugin::parse();
    match plugin.command {
        Command::Inspect(args) => cli::inspect(args, &plugin.kube),
        Command::Top(args) => cli::top(args, &plugin.kube),
        Command::Why(args) => cli::why(args, &plugin.kube),
        Command::Check(args) => cli::check(args, &plugin.kube),
        Command::Uninstall(args) => cli::uninstall(args, &plugin.kube),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The book's flag reference is the plugin's clap definition (`docs/src/reference/`).
    #[test]
    fn cli_reference_is_the_books_page() {
        let command = super::Plugin::command();
        nano_gpu_runtime::cli_reference::check_book_page(
            env!("CARGO_MANIFEST_DIR"),
            "cli-kubectl-nano-gpu.md",
            "kubectl nano-gpu flags",
            &command,
        );
    }
}
