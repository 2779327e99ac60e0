//! What both binaries need to run in a cluster: a kube client the way kubectl finds its cluster (from
//! `--kubeconfig` when given, else `KUBECONFIG`, `~/.kube/config` or the in-cluster service account),
//! and the signal that stops them.

use std::path::Path;

/// Connects with the kubeconfig at `path`, or the default chain when `None`.
pub async fn connect(path: Option<&Path>) -> Result<kube::Client, kube::Error> {
    let Some(path) = path else {
        return kube::Client::try_default().await;
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(kube::Error::InferKubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(kube::Error::InferKubeconfig)?;
    kube::Client::try_from(config)
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
