//! `nvidia-smi -L` for the real-node cluster's workload image (the examples' `nvidia/cuda` image is
//! busybox and this there): lists the cards the container's NVML shows, in nvidia-smi's format
//! (`GPU 0: Tesla T4 (UUID: GPU-...)`), through the same nvml-wrapper FFI path the agent uses. In a
//! container the runtime mounted the driver's library into (here `nvidia-runtime-standin` with the
//! fake NVML), that is exactly the cards the container was given.
//!
//! `-L`, and `--query-gpu=FIELDS --format=csv,noheader,nounits` for the fields `gpu-check` compares
//! (index, uuid, name, memory.total, pci.bus_id, compute_cap, mig.mode.current, written as
//! nvidia-smi writes them: MiB, `9.0`, `Enabled`/`Disabled`, `[N/A]` for a card without MIG); anything
//! else is refused with a message.

use nvml_wrapper::Nvml;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let query = match args.as_slice() {
        [l] if l == "-L" => None,
        [q, f] if q.starts_with("--query-gpu=") && f == "--format=csv,noheader,nounits" => {
            Some(q["--query-gpu=".len()..].split(',').map(str::to_owned).collect::<Vec<_>>())
        }
        _ => {
            eprintln!(
                "nvidia-smi (nano-gpu test stand-in): only -L and --query-gpu=… \
                 --format=csv,noheader,nounits are implemented, got {args:?}"
            );
            std::process::exit(2);
        }
    };
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
        let line = nvml.device_by_index(i).and_then(|d| match &query {
            None => Ok(format!("GPU {i}: {} (UUID: {})", d.name()?, d.uuid()?)),
            Some(fields) => {
                let values: Result<Vec<String>, _> = fields.iter().map(|f| field(&d, i, f)).collect();
                Ok(values?.join(", "))
            }
        });
        match line {
            Ok(l) => println!("{l}"),
            Err(e) => {
                eprintln!("GPU {i}: {e}");
                std::process::exit(15);
            }
        }
    }
}

/// One `--query-gpu` field of card `index`, as nvidia-smi writes it with `nounits`.
fn field(d: &nvml_wrapper::Device, index: u32, name: &str) -> Result<String, nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::error::NvmlError;
    Ok(match name {
        "index" => index.to_string(),
        "uuid" => d.uuid()?,
        "name" => d.name()?,
        "memory.total" => (d.memory_info()?.total >> 20).to_string(),
        "pci.bus_id" => d.pci_info()?.bus_id,
        "compute_cap" => d.cuda_compute_capability().map(|c| format!("{}.{}", c.major, c.minor))?,
        "mig.mode.current" => match d.mig_mode() {
            Ok(m) if m.current == 1 => "Enabled".into(),
            Ok(_) => "Disabled".into(),
            Err(NvmlError::NotSupported) => "[N/A]".into(),
            Err(e) => return Err(e),
        },
        other => {
            eprintln!("nvidia-smi (nano-gpu test stand-in): field {other:?} is not implemented");
            std::process::exit(2);
        }
    })
}
