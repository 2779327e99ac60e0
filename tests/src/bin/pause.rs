//! The pod sandbox's process in the harness's real-node cluster (`hack/cluster.sh` makes the image
//! `nano-gpu.local/pause:1` of it, as no registry can be reached here): holds the pod's namespaces,
//! does nothing, and exits on SIGTERM or SIGINT (as PID 1 a signal without a handler is ignored).

use tokio::signal::unix::{SignalKind, signal};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
