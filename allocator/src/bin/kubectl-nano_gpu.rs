//! `kubectl nano-gpu`: the kubectl plugin (kubectl runs `kubectl-nano_gpu` from `PATH` for
//! `kubectl nano-gpu ...`). It reads the cluster with the caller's kubeconfig and changes nothing:
//! `inspect` (every card and the pods on it), `top` (granted against used, from the agents' metrics)
//! and `why POD` (for a waiting GPU pod, each node's reason and the pods whose end would make room).

use anyhow::Result;
use clap::{Parser, Subcommand};
use nano_gpu_allocator::cli::{self, InspectArgs, Kube, TopArgs, WhyArgs};

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
}

fn main() -> Result<()> {
    let plugin = Plugin::parse();
    match plugin.command {
        Command::Inspect(args) => cli::inspect(args, &plugin.kube),
        Command::Top(args) => cli::top(args, &plugin.kube),
        Command::Why(args) => cli::why(args, &plugin.kube),
    }
}
