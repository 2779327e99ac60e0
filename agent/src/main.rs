//! `nano-gpu-agent`: parses its flags; `inventory` prints the node's cards; running the device plugin
//! is not implemented yet.

use clap::Parser;
use nano_gpu_agent::{Command, Flags, inventory};
use nano_gpu_proto::annotations::{NodeInventory, node_labels};

fn main() -> std::process::ExitCode {
    let flags = Flags::parse();
    match flags.command {
        Some(Command::Inventory) => {
            let (cards, errors) = inventory::read_all(&flags.backends());
            for (backend, e) in &errors {
                eprintln!("nano-gpu-agent: {backend}: {e}");
            }
            let inv = NodeInventory::new(cards.into_iter().map(|c| c.info).collect());
            let doc = serde_json::json!({"annotation": inv.encode(), "labels": node_labels(&inv)});
            println!("{doc:#}");
            if errors.is_empty() { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE }
        }
        None => {
            eprintln!(
                "nano-gpu-agent: not implemented yet: the device plugin (and the NVML backend) are still to be built; \
                 `nano-gpu-agent inventory` prints the cards found (plugin dir {}, NVML library {})",
                flags.plugin_dir.display(),
                flags.nvml_lib.display()
            );
            std::process::ExitCode::FAILURE
        }
    }
}
