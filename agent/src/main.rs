//! `nano-gpu-agent`: parses its flags; the device plugin itself is not implemented yet.

use clap::Parser;
use nano_gpu_agent::Flags;

fn main() -> std::process::ExitCode {
    let flags = Flags::parse();
    eprintln!(
        "nano-gpu-agent: not implemented yet: inventory (NVML, sysfs drm) and the device plugin are still to be \
         built; flags parsed: plugin dir {}, NVML library {}",
        flags.plugin_dir.display(),
        flags.nvml_lib.display()
    );
    std::process::ExitCode::FAILURE
}
