//! `nvidia-smi -L` for the real-node cluster's workload image (the examples' `nvidia/cuda` image is
//! busybox and this there): lists the cards the container's NVML shows, in nvidia-smi's format
//! (`GPU 0: Tesla T4 (UUID: GPU-...)`), through the same nvml-wrapper FFI path the agent uses. In a
//! container the runtime mounted the driver's library into (here `nvidia-runtime-standin` with the
//! fake NVML), that is exactly the cards the container was given.
//!
//! Only `-L` is implemented; anything else is refused with a message.

use nvml_wrapper::Nvml;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args != ["-L"] {
        eprintln!("nvidia-smi (nano-gpu test stand-in): only -L is implemented, got {args:?}");
        std::process::exit(2);
    }
    // nvidia-smi exits 9 when it cannot talk to the driver; so does this.
    let nvml = match Nvml::builder().lib_path("libnvidia-ml.so.1".as_ref()).init() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver: {e}");
            std::process::exit(9);
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    for i in 0..count {
        let line =
            nvml.device_by_index(i).and_then(|d| Ok(format!("GPU {i}: {} (UUID: {})", d.name()?, d.uuid()?)));
        match line {
            Ok(l) => println!("{l}"),
            Err(e) => {
                eprintln!("GPU {i}: {e}");
                std::process::exit(15);
            }
        }
    }
}
