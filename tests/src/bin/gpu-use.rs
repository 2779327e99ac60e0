//! A CUDA process for the real-node cluster's workload image, on the fake driver: it takes
//! `--memory-mib` of memory and `--sm` percent of the SMs on every card its NVML shows (the cards the
//! container was given), for as long as it runs. Through the fake NVML's process directory (see
//! `tests/fakenvml`): one file per card naming the card and the use, held under a lock, so the
//! driver — here every fake NVML of the node, the agent's included — lists this process on those
//! cards with its host PID, and forgets it when it ends, as a CUDA context is forgotten. Where an
//! MPS control daemon answers in `CUDA_MPS_PIPE_DIRECTORY` (its PID file is there), it is an MPS
//! client, as a CUDA process that finds one is (the driver lists it apart), held to the limits a
//! real client gets (`nano_gpu_tests::mps_standin::client_limits`: the daemon's defaults, lowered by
//! its own environment): its SM use is at most its active-thread percentage, and memory past its
//! pinned limit fails as an allocation does (out of memory); while the card's server serves another
//! user's clients, it waits (`waiting: ...`), as a client of MPS does, and when its daemon goes away
//! it exits, as a CUDA process whose MPS server is gone fails. It prints what it uses and its
//! limits.

use anyhow::{Context, Result, bail};
use std::io::Write;
use std::time::Duration;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| -> Result<u64> {
        let at = args
            .iter()
            .position(|a| a == name)
            .with_context(|| format!("usage: gpu-use --memory-mib N --sm N (missing {name})"))?;
        args.get(at + 1).and_then(|v| v.parse().ok()).with_context(|| format!("{name} needs a number"))
    };
    let (memory, sm) = (flag("--memory-mib")?, flag("--sm")?);
    let config = std::env::var("FAKE_NVML_CONFIG")
        .context("no GPU driver in this container (FAKE_NVML_CONFIG unset)")?;
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).context("reading the driver's card list")?)?;
    let dir = doc["processDir"].as_str().context("the driver has no process directory")?;
    let cards: Vec<&str> =
        doc["cards"].as_array().into_iter().flatten().filter_map(|c| c["uuid"].as_str()).collect();
    if cards.is_empty() {
        bail!("no GPU visible");
    }
    let pipe = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").map(std::path::PathBuf::from);
    let pipe = pipe.filter(|d| d.join("nvidia-cuda-mps-control.pid").is_file());
    let mps = pipe.is_some();
    let mut limits = String::new();
    let mut sm = sm;
    // Its place among the card's clients, held until it ends: MPS serves one user at a time.
    let _client = match &pipe {
        Some(pipe) => {
            let waiting = |other| {
                println!("waiting: the card's MPS server serves UID {other}");
                let _ = std::io::stdout().flush();
            };
            let client = nano_gpu_tests::mps_standin::connect(pipe, waiting);
            let client = client.context("connecting to the MPS control daemon")?;
            // A CUDA process whose MPS server is gone fails at its next call: this one ends (its
            // container is started again, and connects anew).
            let mut gone = client.try_clone().context("watching the MPS connection")?;
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut gone, &mut std::io::sink());
                println!("the MPS server went away; exiting");
                let _ = std::io::stdout().flush();
                std::process::exit(1);
            });
            Some(client)
        }
        None => None,
    };
    if let Some(pipe) = &pipe {
        let var = |name: &str| std::env::var(name).ok();
        let (threads, memory_limit) = nano_gpu_tests::mps_standin::client_limits(
            pipe,
            var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").as_deref(),
            var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").as_deref(),
        );
        if let Some(limit) = memory_limit.filter(|l| memory > *l) {
            bail!("out of memory: {memory} MiB asked, this MPS client's pinned limit is {limit} MiB");
        }
        sm = sm.min(threads as u64);
        let memory_limit = memory_limit.map_or("no memory limit".to_owned(), |l| format!("{l} MiB"));
        limits = format!(" (limits: {threads} %, {memory_limit})");
    }
    // Held open (and locked) until the process ends.
    let mut held = Vec::new();
    for uuid in cards {
        let path = std::path::Path::new(dir).join(format!("{uuid}.{}.{}", hostname(), std::process::id()));
        let mut file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        file.lock().with_context(|| format!("locking {}", path.display()))?;
        file.write_all(
            serde_json::json!({"uuid": uuid, "memoryMiB": memory, "sm": sm, "mps": mps})
                .to_string()
                .as_bytes(),
        )?;
        println!(
            "using {memory} MiB and {sm} % of {uuid}{}{limits}",
            if mps { " as an MPS client" } else { "" }
        );
        held.push(file);
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The container's hostname (its pod's name), to keep file names apart across containers.
fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}
