//! What the nano-gpu binaries need to run in a cluster, and nothing of what they decide: their logs, a
//! kube client the way kubectl finds its cluster (from `--kubeconfig` when given, else `KUBECONFIG`,
//! `~/.kube/config` or the in-cluster service account), the signal that stops them, and a gRPC channel
//! over a unix socket, the way the kubelet and its device plugins talk.
//!
//! Also [`listen`]: HTTP listeners whose every connection is bounded in number, time and memory;
//! [`cli_reference`]: each binary's flag reference in the book, rendered from its clap
//! definition; [`exposition`]: the Prometheus text both write; and [`tasks`]: one owner for each
//! process's background loops.
//!
//! The contracts themselves (payloads, the kubelet's generated gRPC types) are in `nano-gpu-proto`.

pub mod cli_reference;
pub mod exposition;
pub mod listen;
pub mod tasks;

use std::io::IsTerminal;
use std::path::Path;

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), as JSON lines or plain text; colours only
/// on a terminal (a container's log is a file, read by `kubectl logs` and log shippers).
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Connects with the kubeconfig at `path`, or the default chain when `None`. The client retries an
/// answer of 429, 503 or 504 with backoff (kube's default), for a while.
pub async fn connect(path: Option<&Path>) -> Result<kube::Client, kube::Error> {
    kube::Client::try_from(config(path, None).await?)
}

/// [`connect`] with the kubeconfig's context `context` instead of its current one, as kubectl's
/// `--context` (`None`: as [`connect`]).
pub async fn connect_with_context(
    path: Option<&Path>,
    context: Option<&str>,
) -> Result<kube::Client, kube::Error> {
    kube::Client::try_from(config(path, context).await?)
}

/// [`connect`], but every answer comes back as it is: for calls where 429 is the answer, not a
/// reason to wait (an Eviction a PodDisruptionBudget refuses).
pub async fn connect_without_retries(path: Option<&Path>) -> Result<kube::Client, kube::Error> {
    let mut config = config(path, None).await?;
    config.default_retry = false;
    kube::Client::try_from(config)
}

/// The kubeconfig at `path` (else `KUBECONFIG` or `~/.kube/config`) under `context` (else its current
/// one); with neither given, the default chain, the in-cluster service account included.
async fn config(path: Option<&Path>, context: Option<&str>) -> Result<kube::Config, kube::Error> {
    if path.is_none() && context.is_none() {
        return kube::Config::infer().await.map_err(kube::Error::InferConfig);
    }
    let kubeconfig = match path {
        Some(path) => kube::config::Kubeconfig::read_from(path),
        None => kube::config::Kubeconfig::read(),
    }
    .map_err(kube::Error::InferKubeconfig)?;
    let options =
        kube::config::KubeConfigOptions { context: context.map(str::to_owned), ..Default::default() };
    kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(kube::Error::InferKubeconfig)
}

/// How a broken watch retries (`WatchStreamExt::backoff`): after 250 ms, doubling up to 4 s, and from
/// 250 ms again once it delivers anything. kube's default waits up to 30 s, so after a control-plane
/// restart a few refusals in a row (RBAC caches still filling, then `410 Gone`) would keep a
/// component blind for half a minute while the kubelet admits pods.
pub fn watch_backoff() -> WatchBackoff {
    WatchBackoff { next: WatchBackoff::FIRST }
}

/// The backoff of [`watch_backoff`].
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    next: std::time::Duration,
}

impl WatchBackoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(250);
    const MOST: std::time::Duration = std::time::Duration::from_secs(4);
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<std::time::Duration> {
        let now = self.next;
        self.next = (now * 2).min(Self::MOST);
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// Resolves at Ctrl-C or SIGTERM (what the kubelet sends a container to stop it).
pub async fn terminated() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// A gRPC channel over the unix socket `socket`, the way the kubelet and its plugins talk.
pub async fn unix_channel(
    socket: std::path::PathBuf,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    // The URI is required by the builder and ignored by the connector.
    tonic::transport::Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;
    use std::time::Duration;

    #[test]
    fn a_watch_retries_within_seconds_and_starts_over_once_it_works() {
        let mut b = watch_backoff();
        let waits: Vec<u64> = b.by_ref().take(7).map(|d| d.as_millis() as u64).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 4000, 4000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(250)));
    }
}
