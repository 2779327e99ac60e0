//! `nano-gpu-agent`: serves the device plugin for `nano-gpu/gpu-percent`; its subcommands run the
//! keeper, the MPS daemons, the runtime canary and `clean-node`, and print the node's cards
//! (`nano_gpu_agent::commands`).

use clap::Parser;
use nano_gpu_agent::Flags;
use std::process::ExitCode;

fn main() -> ExitCode {
    nano_gpu_agent::commands::run(Flags::parse())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The book's flag reference is this binary's clap definition (`docs/src/reference/`).
    #[test]
    fn cli_reference_is_the_books_page() {
        let command = super::Flags::command();
        nano_gpu_runtime::cli_reference::check_book_page(
            env!("CARGO_MANIFEST_DIR"),
            "cli-agent.md",
            "nano-gpu-agent flags",
            &command,
        );
    }
}
